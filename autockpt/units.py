"""Human units for bytes and FLOPs (binary units for bytes, two decimals)."""

from __future__ import annotations

__all__ = ["format_bytes", "format_flops"]

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(num_bytes: int) -> str:
    """``512 -> "512 B"``, ``1536 -> "1.50 KiB"``, ``3 * 2**20 -> "3.00 MiB"``.

    Example:
        >>> format_bytes(1536)
        '1.50 KiB'
    """
    value = float(num_bytes)
    if abs(value) < 1024:
        return f"{int(num_bytes)} B"
    for unit in _BYTE_UNITS[1:]:
        value /= 1024
        if abs(value) < 1024 or unit == _BYTE_UNITS[-1]:
            return f"{value:.2f} {unit}"
    raise AssertionError("unreachable")


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
