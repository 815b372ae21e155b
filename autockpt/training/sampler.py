"""A shuffling sampler whose position is part of the training state, so that a resumed run
sees the rest of the epoch in the same order."""

from __future__ import annotations

import builtins
import math
from collections.abc import Iterator, Mapping, Sized

import torch
from torch.utils.data import Sampler

from autockpt.errors import InvalidArgumentError
from autockpt.training.distributed import dist_rank_world

__all__ = ["ResumableSampler"]


class ResumableSampler(Sampler[int]):
    """A shuffling sampler whose position can be saved and restored mid-epoch.

    Epoch ``e`` visits a permutation drawn from a private generator seeded with ``seed + e``,
    so it neither reads nor advances the global RNG. :meth:`state_dict` returns
    ``{"epoch", "position", "seed"}``; ``position`` counts the indices already handed to the
    DataLoader this epoch, which equals what the training loop consumed when the DataLoader has
    ``num_workers=0``. (With workers, indices are fetched ahead: call
    ``sampler.set_epoch(epoch, start=samples_consumed)`` on resume with your own count.)
    When an epoch's indices run out the sampler moves to the next epoch by itself, so calling
    :meth:`set_epoch` is optional. With ``num_replicas > 1`` each rank gets every
    ``num_replicas``-th index of the permutation, padded by repeating, like
    ``DistributedSampler``.

    Give the DataLoader its own generator (``generator=torch.Generator()``): otherwise each
    ``iter(loader)`` draws a worker seed from the global RNG, and a resumed run, which creates
    its iterator after restoring the RNG, would be one draw off.

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader
        >>> data = torch.arange(10)
        >>> sampler = ResumableSampler(data, seed=0)
        >>> loader = DataLoader(data, batch_size=4, sampler=sampler, generator=torch.Generator())
        >>> first = next(iter(loader))
        >>> state = sampler.state_dict()        # {"epoch": 0, "position": 4, "seed": 0}
        >>> again = ResumableSampler(data, seed=0)
        >>> again.load_state_dict(state)
        >>> rest = [b for b in DataLoader(data, batch_size=4, sampler=again)]
        >>> sorted(torch.cat([first] + rest).tolist()) == list(range(10))
        True
    """

    def __init__(
        self,
        data_source: Sized | int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        if isinstance(data_source, int) and not isinstance(data_source, bool):
            length = data_source
        elif isinstance(data_source, Sized):
            length = len(data_source)
        else:
            raise InvalidArgumentError(
                f"data_source must be a sized dataset or a length, got "
                f"{type(data_source).__name__}",
                fix="pass the dataset (it must have __len__) or its length",
            )
        if length < 0:
            raise InvalidArgumentError(
                f"data_source length must be >= 0, got {length}", fix="pass the dataset length"
            )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InvalidArgumentError(f"seed must be an int, got {seed!r}", fix="pass e.g. seed=0")
        d_rank, d_world = dist_rank_world()
        num_replicas = d_world if num_replicas is None else num_replicas
        rank = d_rank if rank is None else rank
        if not (isinstance(num_replicas, int) and num_replicas >= 1):
            raise InvalidArgumentError(
                f"num_replicas must be an int >= 1, got {num_replicas!r}",
                fix="pass the world size, or leave it None to read it from torch.distributed",
            )
        if not (isinstance(rank, int) and 0 <= rank < num_replicas):
            raise InvalidArgumentError(
                f"rank must be an int in [0, {num_replicas}), got {rank!r}",
                fix="pass this process's rank, or leave it None",
            )
        self.length = length
        self.shuffle = shuffle
        self.seed = seed
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        return math.ceil(self.length / self.num_replicas) if self.length else 0

    def _order(self) -> builtins.list[int]:
        if self.shuffle:
            gen = torch.Generator()
            gen.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=gen).tolist()
        else:
            order = builtins.list(range(self.length))
        per_rank = len(self)
        total = per_rank * self.num_replicas
        if order and total > len(order):
            order = (order * math.ceil(total / len(order)))[:total]
        return order[self.rank : total : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        for i in range(self.position, len(order)):
            # Counted before the yield: once the DataLoader holds index i, it is consumed.
            self.position = i + 1
            yield order[i]
        self.epoch += 1
        self.position = 0

    def set_epoch(self, epoch: int, *, start: int | None = None) -> None:
        """Move to ``epoch``. ``start`` (samples of this rank to skip) defaults to keeping the
        position when ``epoch`` is the current epoch (i.e. just after a resume) and 0 otherwise.

        Example:
            >>> s = ResumableSampler(8)
            >>> s.set_epoch(3, start=2)
            >>> (s.epoch, s.position)
            (3, 2)
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise InvalidArgumentError(
                f"epoch must be an int >= 0, got {epoch!r}", fix="pass the epoch number"
            )
        if start is None:
            start = self.position if epoch == self.epoch else 0
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= len(self):
            raise InvalidArgumentError(
                f"start must be an int in [0, {len(self)}], got {start!r}",
                fix="pass the number of this rank's samples already consumed in that epoch",
            )
        self.epoch, self.position = epoch, start

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position", "seed"}``, JSON-able, for ``save(sampler_state=...)``.

        Example:
            >>> ResumableSampler(4, seed=5).state_dict()
            {'epoch': 0, 'position': 0, 'seed': 5}
        """
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue where :meth:`state_dict` was taken.

        Example:
            >>> s = ResumableSampler(4)
            >>> s.load_state_dict({"epoch": 2, "position": 1, "seed": 0})
            >>> (s.epoch, s.position)
            (2, 1)
        """
        if not isinstance(state, Mapping) or not {"epoch", "position", "seed"} <= set(state):
            raise InvalidArgumentError(
                f"sampler state must be a dict with 'epoch', 'position' and 'seed', got {state!r}",
                fix="pass what ResumableSampler.state_dict() returned",
            )
        if state["seed"] != self.seed:
            raise InvalidArgumentError(
                f"the state was saved with seed={state['seed']} but this sampler has "
                f"seed={self.seed}; the permutations would differ",
                fix=f"create the sampler with seed={state['seed']}",
            )
        self.set_epoch(int(state["epoch"]), start=int(state["position"]))
