"""Python's cyclic garbage collector, paused while autockpt plans.

# NOTE [ Planning with the collector paused ]
Capturing, profiling and planning a model allocate hundreds of thousands of small objects
(fx nodes, fake tensors, the dynamic programme's tuples), most of them alive until the plan
is made. Every few hundred allocations the collector scans the young ones, and every few
young scans promote them towards the oldest generation, whose full scan walks every object
of the process: with torch, a model zoo and a model loaded, half a million objects, 0.3-0.6 s
on this project's 2-core CPU, landing on about one plan in four at random. Paused, the plan's
objects are scanned once, when it ends (the collector's thresholds count from there), so the
full scans come less often. Over the 21 models of the planning-speed corpus in one process
(four runs each way), the collector's time fell from 2.4-2.9 s to 2.0-2.3 s and the slowest
first plan from 2.4-3.6 s to 2.2-2.4 s. Nothing a plan makes holds device memory in a cycle:
it runs on fake tensors, and the real forwards it may run (the modules rung's fallback,
``cost="profile"``) free their tensors by reference count.

A module that meets many shapes plans again and again, and the scan at a plan's end was still a
full one whenever the plan's objects tipped the oldest generation over its threshold: 0.24 s
of a BERT plan that otherwise took 70 ms (2026-12-07). So the collector is also told to set
aside every object that existed before the plan (``gc.freeze``): the scan at the end walks only
what the plan made, most of it garbage by then, and the objects set aside are handed back to
the oldest generation afterwards (``gc.unfreeze``). A process that froze objects itself (a
server that forks workers) keeps them frozen: there autockpt only pauses the collector.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["paused"]


@contextmanager
def paused() -> Iterator[None]:
    """Pause the cyclic garbage collector, if it runs, for the duration, and collect only what
    was made meanwhile at the end (NOTE [ Planning with the collector paused ]); nested uses
    leave it to the outermost.

    Example:
        >>> import gc
        >>> with paused():
        ...     gc.isenabled()
        False
        >>> gc.isenabled()
        True
    """
    enabled = gc.isenabled()
    gc.disable()
    # Never unfreeze what someone else froze.
    freeze = enabled and gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        yield
    finally:
        if freeze:
            gc.collect()  # only what was made since the freeze
            gc.unfreeze()
        if enabled:
            gc.enable()
