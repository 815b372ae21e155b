"""Which plan serves a call of a new shape, and at which shape a new plan is priced.

Plain numbers only (tuples of sizes), like the rest of the planner: the runtime hands in the
shapes of the calls it has seen and of the plans it has, and gets back an index or a shape.

NOTE [ Buckets of shapes ]
For a fixed plan, activation memory grows with every size of the input (batch, sequence
length, image side): a plan priced at a shape keeps its budget at every shape no larger in
any dimension. So a call of a new shape needs no plan of its own when one priced at a shape
at least as large in every dimension exists. Planning every new shape at its own size makes
as many plans as shapes (a padding collator makes a new length nearly every batch); planning
once at the largest shape recomputes more than needed at every smaller one. Between the two,
each dimension seen to vary is rounded up to a bucket: sizes from ``2**k`` up are rounded to
multiples of ``2**(k - 2)`` (four buckets per doubling: 32, 40, 48, 56, 64, 80, ..., 224, 256,
320), so a plan is priced at most a quarter above the call it was made for, and a run whose
lengths spread over 32..256 makes at most 12 plans, most runs fewer. A dimension not yet seen
to vary keeps its size: a run of one shape plans at that shape exactly, as before. A plan
priced at a shape the user stated as the largest (``example_inputs`` or ``max_shapes=``)
serves every smaller call; a bucket's plan serves the calls of its bucket and the smaller
calls whose own bucket it does not exceed.

A plan costs a fake-tensor profile of the whole step (a few tenths of a second for a small
transformer on a CPU) or an evaluation of one and a search (tens of milliseconds), as much as
or more than a training step of a small model. So a call whose bucket has no plan runs the
least larger plan that covers it, if any (its budget holds; it recomputes more than its own
bucket's plan would), and its bucket gets a plan of its own once that pays, as a skier rents
skis until renting has cost what buying would: each call run by a larger plan adds what that
plan recomputed in it (the forward's measured seconds times the plan's recompute per forward
FLOP, :func:`recompute_seconds`) to its bucket's account, at least what the bucket's own
plan would have saved there (the least recompute that keeps the budget at the bucket's
shape is no more than the larger plan's), and the bucket is planned when its account reaches
what the last plan of its structure took to make (:func:`plan_pays`). A bucket met often is
planned after a few calls, one met rarely never, and a run pays at most about twice the
least it could for the buckets it meets. Only a call larger than every plan is planned at
once, since no plan keeps its budget; it is planned at the largest size met in each
dimension (each rounded up to its bucket), not at its own: where two sizes vary (rows and
length, height and width) a plan at the call's own bucket leaves the next call, shorter but
with more rows, larger than every plan again, while one at the largest of each serves every
call of sizes met so far, and the call itself runs it as a stand-in for its bucket. Where
no plan meets the budget at those sizes, the call is planned at its own bucket, and sizes at
least those are not tried again.

Which plan serves a call thus depends on measured times and may differ between two runs of
the same loop; its budget and its gradients do not. On a GPU a forward's seconds are the
host's (kernels run asynchronously), fewer than the device's, so a bucket is planned later
there, never sooner. ``example_inputs`` or ``max_shapes=`` make one plan serve every call.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Shapes", "bucket_size", "choose", "covering", "dominates", "plan_pays",
           "recompute_seconds", "target_shapes", "varying_dims"]

Shapes = tuple[tuple[int, ...], ...]
"""The sizes of each tensor of a call, in a fixed order."""


def bucket_size(size: int) -> int:
    """``size`` rounded up to its bucket (NOTE [ Buckets of shapes ]).

    Example:
        >>> [bucket_size(n) for n in (1, 7, 32, 33, 100, 129, 256, 257)]
        [1, 7, 32, 40, 112, 160, 256, 320]
    """
    if size <= 8:
        return size
    step = 1 << (size.bit_length() - 3)
    return -(-size // step) * step


def dominates(larger: Shapes, smaller: Shapes) -> bool:
    """Whether every size of ``larger`` is at least that of ``smaller`` (same structure).

    Example:
        >>> dominates(((4, 64),), ((4, 50),)), dominates(((4, 64),), ((8, 50),))
        (True, False)
    """
    return len(larger) == len(smaller) and all(
        len(a) == len(b) and all(x >= y for x, y in zip(a, b)) for a, b in zip(larger, smaller))


def varying_dims(seen: Sequence[Shapes]) -> tuple[tuple[int, int], ...]:
    """``(tensor, dimension)`` of each size that differs between the shapes ``seen``.

    Example:
        >>> varying_dims([((4, 64), (4, 64)), ((4, 80), (4, 80))])
        ((0, 1), (1, 1))
    """
    if not seen:
        return ()
    first = seen[0]
    return tuple((t, d) for t, dims in enumerate(first) for d, size in enumerate(dims)
                 if any(shapes[t][d] != size for shapes in seen[1:]))


def target_shapes(shapes: Shapes, varying: Sequence[tuple[int, int]]) -> Shapes:
    """The shape a plan for a call of ``shapes`` is priced at: each varying size rounded up
    to its bucket, the others as they are.

    Example:
        >>> target_shapes(((4, 100), (4, 100)), [(0, 1), (1, 1)])
        ((4, 112), (4, 112))
    """
    wanted = set(varying)
    return tuple(tuple(bucket_size(size) if (t, d) in wanted else size
                       for d, size in enumerate(dims)) for t, dims in enumerate(shapes))


def choose(priced: Sequence[Shapes], stated: Sequence[bool], shapes: Shapes,
           varying: Sequence[tuple[int, int]]) -> int | None:
    """The index of the plan a call of ``shapes`` runs, among plans priced at ``priced``
    (``stated``: at a shape the user stated as the largest), or ``None`` when a new plan is
    needed: the plan of least priced size that is at least ``shapes`` everywhere and, unless
    stated, no larger than the call's bucket (NOTE [ Buckets of shapes ]).

    Example:
        >>> choose([((4, 64),), ((4, 256),)], [False, False], ((4, 60),), [(0, 1)])
        0
        >>> choose([((4, 256),)], [False], ((4, 60),), [(0, 1)]) is None
        True
        >>> choose([((4, 256),)], [True], ((4, 60),), [(0, 1)])
        0
    """
    bucket = target_shapes(shapes, varying)
    best: tuple[int, int] | None = None
    for index, (at, whole) in enumerate(zip(priced, stated)):
        if not dominates(at, shapes) or not (whole or dominates(bucket, at)):
            continue
        size = sum(_numel(dims) for dims in at)
        if best is None or size < best[0]:
            best = (size, index)
    return None if best is None else best[1]


def covering(priced: Sequence[Shapes], shapes: Shapes) -> int | None:
    """The index of the plan of least priced size at least ``shapes`` everywhere, if any.

    Example:
        >>> covering([((4, 256),), ((4, 128),), ((4, 64),)], ((4, 100),))
        1
    """
    best: tuple[int, int] | None = None
    for index, at in enumerate(priced):
        if dominates(at, shapes):
            size = sum(_numel(dims) for dims in at)
            if best is None or size < best[0]:
                best = (size, index)
    return None if best is None else best[1]


def _numel(dims: tuple[int, ...]) -> int:
    count = 1
    for size in dims:
        count *= size
    return count


def recompute_seconds(forward_seconds: float, recompute_flops: int, forward_flops: int
                      ) -> float:
    """What a plan recomputing ``recompute_flops`` of a forward of ``forward_flops`` spent on
    its recompute in a step whose forward took ``forward_seconds`` (NOTE [ Buckets of
    shapes ]).

    Example:
        >>> recompute_seconds(0.3, 50, 100)
        0.15
    """
    return forward_seconds * recompute_flops / forward_flops if forward_flops > 0 else 0.0


def plan_pays(recomputed_seconds: float, plan_seconds: float | None) -> bool:
    """Whether a bucket whose calls larger plans ran, recomputing ``recomputed_seconds`` in
    all, should now get a plan of its own, one costing ``plan_seconds`` to make (``None``:
    none made yet). NOTE [ Buckets of shapes ]: rent until renting has cost what buying
    would.

    Example:
        >>> plan_pays(0.2, 0.5), plan_pays(0.6, 0.5), plan_pays(9.0, None)
        (False, True, False)
    """
    return plan_seconds is not None and recomputed_seconds >= plan_seconds
