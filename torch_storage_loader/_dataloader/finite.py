"""A ``StorageDataset``'s finite side (a list of handles): the epoch of each iteration, and resuming.

The epoch is agreed between a trainer and its DataLoader workers through counters in one
small tensor in shared memory, reaching the workers with the dataset (persistent ones included):
``[set_epoch called, its epoch, then one automatic counter per (num_workers, worker id)]``. Each
worker counts its own iterations in a counter of its own, so fresh copies (as non-persistent
workers get) continue where the last ones stopped and no two processes write one counter; all of a
DataLoader's workers start each iteration, so they agree.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch

from .._sources import ListSource
from .items import SKIP, Reader

__all__ = ["Finite"]

# Automatic epoch counters are kept for DataLoaders of up to this many workers (beyond it, only
# persistent workers advance the epoch by themselves; set_epoch always works).
MAX_TRACKED_WORKERS = 64
_AUTO_BASE = 2


def _auto_slot(num_workers: int, wid: int) -> int | None:
    """The counter of worker ``wid`` of ``num_workers`` (0 workers: the trainer itself), or None: untracked."""
    if num_workers > MAX_TRACKED_WORKERS:
        return None
    return _AUTO_BASE + num_workers * (num_workers + 1) // 2 + wid


class Finite:
    """One finite dataset's epochs (see the module) and its progress through the current one, in each of its copies."""

    def __init__(self, source: ListSource, reader: Reader) -> None:
        self.source, self.reader = source, reader
        size = _AUTO_BASE + MAX_TRACKED_WORKERS * (MAX_TRACKED_WORKERS + 1) // 2 + MAX_TRACKED_WORKERS
        self._shared = torch.zeros(size, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]  # torch leaves share_memory_ unannotated
        self.epoch = 0  # the epoch being (or last) iterated in this copy
        self.yielded = 0  # groups this copy passed in it
        self.resume: tuple[int, int] | None = None  # (epoch, groups to skip), from load_state_dict
        self._iters = 0  # this copy's own count, for a worker that has no counter

    def own(self, new: bool) -> None:
        """In a trainer; ``new``: a copy that reached another trainer (a DDP rank) takes counters of its own."""
        if new:
            self._shared = self._shared.clone()  # as they are now
        if not self._shared.is_shared():
            self._shared.share_memory_()  # a new copy's, or after copy.deepcopy

    def set_epoch(self, epoch: int) -> None:
        """Every later iteration uses ``epoch``."""
        self._shared[1] = epoch
        self._shared[0] = 1

    def iterate(self, rank: int, world: int, wid: int, num_workers: int) -> Iterator[Any]:
        """This copy's groups of the next epoch, loaded (``num_workers``: 0 in the trainer). The epoch is
        decided here, not in the generator: ``StatefulDataLoader`` snapshots ``state_dict()`` right after ``iter()``."""
        slot = _auto_slot(num_workers, wid)
        auto = self._shared[1] if self._shared[0] else self._shared[slot] if slot is not None else self._iters
        (epoch, skip), self.resume = self.resume or (int(auto), 0), None  # resumed, else set_epoch's, else counted
        self._iters = epoch + 1
        if slot is not None:
            self._shared[slot] = epoch + 1  # this worker's next iteration
        self.epoch, self.yielded = epoch, skip
        o = self.reader.opts
        groups = self.source.groups(
            rank,
            world,
            wid,
            num_workers or 1,
            epoch=epoch,
            shuffle=o.shuffle,
            seed=o.seed,
            batch=o.batch_size or 1,
            drop_last=o.drop_last,
        )
        return self.reader.run(num_workers, functools.partial(self._items, iter(groups[skip:]), epoch))

    def _items(self, groups: Iterator[list[Any]], epoch: int) -> Iterator[Any]:
        for group in groups:
            self.yielded += 1  # counts the group even if it is skipped: resume continues after it
            item = self.reader.load(group)
            if item is not SKIP:
                yield item
        self.epoch, self.yielded = epoch + 1, 0
