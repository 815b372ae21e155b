"""The exception family of autockpt.

Every error autockpt raises on purpose is an :class:`AutockptError`. Internal failures are
re-raised at the public boundary with the user's context: which model, which node or module
path, which budget, and what to do about it.

Example:
    >>> import autockpt
    >>> try:
    ...     autockpt.apply(object(), budget_mb=10)
    ... except autockpt.AutockptError as err:
    ...     print(type(err).__name__)
    InvalidArgumentError
"""

from __future__ import annotations

__all__ = [
    "AutockptError",
    "InvalidArgumentError",
    "TraceError",
    "InfeasibleBudgetError",
    "CheckpointError",
    "BudgetWarning",
]


class AutockptError(Exception):
    """Base class of every error autockpt raises on purpose.

    The message always says what went wrong and how to fix it.
    """

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        self.message = message
        self.fix = fix
        super().__init__(message if fix is None else f"{message}\n  fix: {fix}")


class InvalidArgumentError(AutockptError, ValueError):
    """An argument has the wrong type or an impossible value (a budget of -1 MiB, a string
    where a module was expected, example inputs the model's forward does not accept).

    It is also a :class:`ValueError`, so code that already catches that keeps working.
    """


class TraceError(AutockptError):
    """The model could not be traced into a graph.

    Attributes:
        model_name: class name of the model that failed to trace.
        location: ``file:line`` of the user's source where tracing failed, when known.
        module_path: qualified name of the innermost submodule being traced when it failed
            (``""`` for the model's own forward, ``None`` when unknown).
    """

    def __init__(
        self,
        message: str,
        *,
        fix: str | None = None,
        model_name: str = "",
        location: str | None = None,
        module_path: str | None = None,
    ) -> None:
        self.model_name = model_name
        self.location = location
        self.module_path = module_path
        super().__init__(message, fix=fix)


class InfeasibleBudgetError(AutockptError):
    """No plan keeps peak activation memory within the budget.

    Attributes:
        budget_bytes: the budget that was asked for.
        min_feasible_bytes: the smallest peak activation memory the planner can reach for
            this model and input size; a budget at or above it is feasible.
    """

    def __init__(self, message: str, *, budget_bytes: int, min_feasible_bytes: int,
                 fix: str | None = None) -> None:
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes
        if fix is None:
            fix = (
                f"pass budget_mb={_ceil_mib(min_feasible_bytes)} or more, "
                "use a smaller batch, or pass budget_mb=None for the least memory reachable"
            )
        super().__init__(message, fix=fix)


class BudgetWarning(UserWarning):
    """A training step does not match what its plan was made for (for example ``.grad``
    already allocated, as in gradient accumulation, in a plan made for fresh gradients), so
    the budget may not hold."""


class CheckpointError(AutockptError):
    """A training checkpoint could not be written, read or loaded into a model."""


def _ceil_mib(num_bytes: int) -> float:
    """Bytes to MiB, rounded up to two decimals, so that the suggested budget is feasible."""
    mib = num_bytes / 2**20
    return -(-round(mib * 100, 6) // 1) / 100
