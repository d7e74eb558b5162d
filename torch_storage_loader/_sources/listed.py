"""A finite list of handles: each once per epoch, split across ranks and DataLoader workers."""

from __future__ import annotations

from typing import Any

import torch

from ..storage import Storage

__all__ = ["ListSource"]


class ListSource:
    """A finite sequence: each handle once per epoch, split evenly across ranks, then across workers.

    Like ``DistributedSampler``: the (optionally shuffled) order is the same on every rank; rank
    ``r`` takes positions ``r, r + world, ...``, after the order was padded with handles from its
    start to a multiple of ``world`` (or cut to one, with ``drop_last``), so that every rank gets
    the same number of samples and so of batches. A rank's samples are cut into groups of
    ``batch`` (the last may be short, or dropped with ``drop_last``) and dealt to its workers in turn.
    """

    finite = True

    def __init__(self, handles: Any) -> None:
        self.handles = list(handles)
        for i, h in enumerate(self.handles):
            if not isinstance(h, Storage):
                raise TypeError(f"source[{i}] is a {type(h).__name__}, not a Storage handle")

    def __len__(self) -> int:
        return len(self.handles)

    def samples_per_rank(self, world: int, drop_last: bool) -> int:
        n = len(self.handles)
        return n // world if drop_last else -(-n // world)

    def items_per_rank(self, world: int, batch: int, drop_last: bool) -> int:
        """Groups (samples, or batches of ``batch``) each rank yields per epoch."""
        per = self.samples_per_rank(world, drop_last)
        return per // batch if drop_last else -(-per // batch)

    def padded(self, rank: int, world: int, drop_last: bool) -> int:
        """Handles rank ``rank`` repeats each epoch so that every rank gets as many as the others."""
        n = len(self.handles)
        if drop_last or n == 0:
            return 0
        return sum(1 for pos in range(rank, self.samples_per_rank(world, False) * world, world) if pos >= n)

    def order(self, epoch: int, shuffle: bool, seed: int) -> list[int]:
        """Positions in epoch order: a permutation of (seed, epoch), as ``DistributedSampler`` draws it."""
        if not shuffle:
            return list(range(len(self.handles)))
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        return torch.randperm(len(self.handles), generator=g).tolist()

    def groups(
        self,
        rank: int,
        world: int,
        worker: int,
        num_workers: int,
        *,
        epoch: int,
        shuffle: bool,
        seed: int,
        batch: int,
        drop_last: bool,
    ) -> list[list[Storage]]:
        """What worker ``worker`` of ``num_workers`` on rank ``rank`` of ``world`` loads this epoch."""
        order = self.order(epoch, shuffle, seed)
        total = self.samples_per_rank(world, drop_last) * world
        if order and total > len(order):
            order = (order * -(-total // len(order)))[:total]  # pad from the start, cyclically
        mine = [self.handles[i] for i in order[rank:total:world]]
        cut = self.items_per_rank(world, batch, drop_last) * batch
        groups = [mine[i : i + batch] for i in range(0, min(cut, len(mine)), batch)]
        return groups[worker::num_workers]
