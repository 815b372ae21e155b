"""What :func:`autockpt.diagnose` and :func:`autockpt.lint` return: findings and a report.

A :class:`Finding` names one problem: a stable code (``AC001``...), a severity, where it is
(a module path and/or ``file:line``), what is wrong and why, and a concrete fix with code. A
:class:`Report` holds the findings in a canonical order, so that the same model or script
always gives an identical report. Rendering lives in :mod:`autockpt.report`; nothing here
prints.

Example:
    >>> from autockpt.tools.findings import Finding, Report
    >>> report = Report((
    ...     Finding("AC006", "warning", "train.py:12", "no use_reentrant",
    ...             "checkpoint(fn, x, use_reentrant=False)"),
    ...     Finding("AC001", "error", "train.py:30", "no gradient",
    ...             "checkpoint(fn, x, use_reentrant=False)"),
    ... ))
    >>> [f.code for f in report], report.has_errors, len(report.warnings)
    (['AC001', 'AC006'], True, 1)
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from autockpt.errors import InvalidArgumentError
from autockpt.report import format_findings

__all__ = ["CODES", "SEVERITIES", "Finding", "Report"]

SEVERITIES: tuple[str, ...] = ("error", "warning", "info")
"""The severities, most severe first: the order reports are sorted in."""

CODES: dict[str, str] = {
    "AC000": "the diagnostic run failed",
    "AC001": "reentrant checkpoint, no input requires grad: no gradients",
    "AC002": "input made to require grad just for checkpoint",
    "AC003": "trainable parameters got no gradient",
    "AC004": "buffers updated twice (forward and recompute)",
    "AC005": "random ops recomputed without the RNG state",
    "AC006": "use_reentrant not passed explicitly",
    "AC007": "checkpoint in eval mode or under no_grad",
    "AC008": "in-place op on a checkpoint's input",
    "AC009": "reentrant checkpoint loses keyword/container tensors",
    "AC010": "DDP find_unused_parameters with reentrant checkpoint",
    "AC011": "checkpoint saves no memory",
    "AC012": "loss tensor accumulated across steps",
    "AC013": "state_dict keys with a wrapper prefix",
    "AC014": "training checkpoint without optimizer state",
}
"""Every finding code, with its one-line title (docs/diagnostics.md has an example of each)."""

_RANK = {severity: rank for rank, severity in enumerate(SEVERITIES)}


@dataclass(frozen=True)
class Finding:
    """One problem found in a model's run or in a training script."""

    code: str
    """Stable identifier of the kind of problem, a key of :data:`CODES` (``"AC001"``)."""
    severity: str
    """``"error"`` (training is silently wrong or fails), ``"warning"`` (likely wrong or
    wasteful) or ``"info"`` (worth knowing)."""
    where: str
    """Where it is: the module path, and ``file:line`` of the user's source where known."""
    message: str
    """What is wrong and why it matters."""
    fix: str
    """A concrete change, with code."""

    def __post_init__(self) -> None:
        if self.code not in CODES:
            raise InvalidArgumentError(
                f"unknown finding code {self.code!r}", fix=f"use one of {', '.join(CODES)}"
            )
        if self.severity not in _RANK:
            raise InvalidArgumentError(
                f"unknown severity {self.severity!r}", fix=f"use one of {', '.join(SEVERITIES)}"
            )

    @property
    def title(self) -> str:
        """The code's one-line title from :data:`CODES`."""
        return CODES[self.code]

    def sort_key(self) -> tuple[int, tuple[tuple[int, str | int], ...], str, str]:
        """Most severe first, then by location (line numbers compared as numbers), then code."""
        return (_RANK[self.severity], _natural(self.where), self.code, self.message)


def _natural(text: str) -> tuple[tuple[int, str | int], ...]:
    # "train.py:9" before "train.py:10": digit runs compare as numbers.
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", text) if part
    )


@dataclass(frozen=True)
class Report:
    """The findings of one :func:`autockpt.diagnose` or :func:`autockpt.lint` call.

    Iterating yields the findings most severe first; ``str(report)`` renders a table (see
    :func:`autockpt.report.format_findings`). Exact duplicates are dropped.
    """

    findings: tuple[Finding, ...] = ()
    """The findings, sorted by severity, then location, then code."""
    subject: str = ""
    """What was analysed: the model's class name or the script's file name."""
    checkpoint_calls: int = 0
    """How many checkpoint calls the diagnostic run observed (always 0 for :func:`lint`)."""

    def __post_init__(self) -> None:
        findings = tuple(self.findings)
        for finding in findings:
            if not isinstance(finding, Finding):
                raise InvalidArgumentError(
                    f"Report holds Finding objects, got {type(finding).__name__}",
                    fix="build each entry with Finding(code, severity, where, message, fix)",
                )
        unique = dict.fromkeys(findings)  # keeps the first of equal findings, in order
        object.__setattr__(self, "findings", tuple(sorted(unique, key=Finding.sort_key)))

    @property
    def errors(self) -> tuple[Finding, ...]:
        """The findings of severity ``"error"``."""
        return tuple(f for f in self.findings if f.severity == "error")

    @property
    def warnings(self) -> tuple[Finding, ...]:
        """The findings of severity ``"warning"``."""
        return tuple(f for f in self.findings if f.severity == "warning")

    @property
    def infos(self) -> tuple[Finding, ...]:
        """The findings of severity ``"info"``."""
        return tuple(f for f in self.findings if f.severity == "info")

    @property
    def has_errors(self) -> bool:
        """Whether any finding is an error."""
        return any(f.severity == "error" for f in self.findings)

    def codes(self) -> tuple[str, ...]:
        """The distinct codes found, sorted (``"AC001" in report.codes()``)."""
        return tuple(sorted({f.code for f in self.findings}))

    def __iter__(self) -> Iterator[Finding]:
        return iter(self.findings)

    def __len__(self) -> int:
        return len(self.findings)

    def __str__(self) -> str:
        return format_findings(self)
