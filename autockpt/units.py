"""Human-readable units shared by every formatter in autockpt.

Example:
    >>> from autockpt.units import format_bytes
    >>> format_bytes(3 * 2**20 // 2)
    '1.50 MiB'
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from autockpt.errors import InvalidArgumentError

__all__ = ["format_bytes", "format_flops", "format_names", "format_seconds"]

_BINARY_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def format_bytes(n: int) -> str:
    """Format a byte count with binary units (1 KiB = 1024 B) and two decimals.

    Counts below 1 KiB are printed exactly, without decimals. Negative counts (differences
    between two measurements) keep their sign.

    Args:
        n: a number of bytes; any integer, including numpy integers.

    Returns:
        A short string such as ``"512 B"``, ``"3.00 KiB"`` or ``"1.50 MiB"``.

    Raises:
        InvalidArgumentError: ``n`` is not an integer (a float or a bool).

    Example:
        >>> format_bytes(512)
        '512 B'
        >>> format_bytes(3072)
        '3.00 KiB'
        >>> format_bytes(2 * 2**30)
        '2.00 GiB'
        >>> format_bytes(-1536)
        '-1.50 KiB'
    """
    if isinstance(n, bool):
        raise InvalidArgumentError(
            f"format_bytes expects an integer number of bytes, got the bool {n!r}",
            fix="pass an int",
        )
    try:
        count = operator.index(n)
    except TypeError:
        raise InvalidArgumentError(
            f"format_bytes expects an integer number of bytes, got {type(n).__name__} {n!r}",
            fix="round the value to an int first, e.g. format_bytes(int(x))",
        ) from None

    sign = "-" if count < 0 else ""
    magnitude = abs(count)
    if magnitude < 1024:
        return f"{sign}{magnitude} B"

    # Pick the unit from the rounded value, not the raw one: 1 MiB - 1 B would otherwise
    # print as "1024.00 KiB", which reads like a formatting bug.
    value = magnitude / 1024
    unit_index = 0
    while unit_index + 1 < len(_BINARY_UNITS) and round(value, 2) >= 1024:
        value /= 1024
        unit_index += 1
    return f"{sign}{value:.2f} {_BINARY_UNITS[unit_index]}"


def format_flops(flops: int) -> str:
    """``0 -> "0 FLOP"``, ``2.5e9 -> "2.50 GFLOP"`` (decimal prefixes, as FLOPs usually are).

    Example:
        >>> format_flops(2_500_000_000)
        '2.50 GFLOP'
    """
    value = float(flops)
    if abs(value) < 1000:
        return f"{int(flops)} FLOP"
    for prefix in ("k", "M", "G", "T", "P"):
        value /= 1000
        if abs(value) < 1000 or prefix == "P":
            return f"{value:.2f} {prefix}FLOP"
    raise AssertionError("unreachable")


def format_seconds(seconds: float) -> str:
    """``0.0004 -> "400 us"``, ``0.0123 -> "12.3 ms"``, ``2.5 -> "2.50 s"``.

    Example:
        >>> format_seconds(0.0123)
        '12.3 ms'
    """
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def format_names(names: Sequence[str], limit: int = 4) -> str:
    """The first ``limit`` names joined with commas, and how many more there are.

    Example:
        >>> format_names(["a", "b", "c"], limit=2)
        'a, b and 1 more'
    """
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"
