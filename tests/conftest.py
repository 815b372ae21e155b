"""Fixtures shared by the tests; plain helpers are in tests/helpers.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a whole module, restored afterwards.

    Results do not depend on it; speed does. On a busy 2-core machine OpenMP threads spin
    against other processes and make small matmuls ~15x slower. Module scope, so that the
    module-scoped fixtures that build and measure models run on one thread too. Use it with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
