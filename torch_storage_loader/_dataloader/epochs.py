"""The epoch of each iteration over a finite source, agreed between a trainer and its DataLoader workers.

One small tensor in shared memory, reaching the workers with the dataset (persistent ones
included): ``[set_epoch called, its epoch, then one automatic counter per (num_workers, worker id)]``.
Each worker counts its own iterations in a counter of its own, so fresh copies (as non-persistent
workers get) continue where the last ones stopped and no two processes write one counter; all of a
DataLoader's workers start each iteration, so they agree.
"""

from __future__ import annotations

import torch

__all__ = ["EpochCounters"]

# Automatic epoch counters are kept for DataLoaders of up to this many workers (beyond it, only
# persistent workers advance the epoch by themselves; set_epoch always works).
MAX_TRACKED_WORKERS = 64
_AUTO_BASE = 2


def _auto_slot(num_workers: int, wid: int) -> int | None:
    """The counter of worker ``wid`` of ``num_workers`` (0 workers: the trainer itself), or None: untracked."""
    if num_workers > MAX_TRACKED_WORKERS:
        return None
    return _AUTO_BASE + num_workers * (num_workers + 1) // 2 + wid


class EpochCounters:
    """The shared epoch counters of one finite ``StorageDataset`` (see the module)."""

    def __init__(self) -> None:
        size = _AUTO_BASE + MAX_TRACKED_WORKERS * (MAX_TRACKED_WORKERS + 1) // 2 + MAX_TRACKED_WORKERS
        self._shared = torch.zeros(size, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]  # torch leaves share_memory_ unannotated

    def detach(self) -> EpochCounters:
        """Counters of its own, as they are now, for a copy that reached another trainer (a DDP rank)."""
        out = EpochCounters.__new__(EpochCounters)
        out._shared = self._shared.clone().share_memory_()
        return out

    def ensure_shared(self) -> None:
        if not self._shared.is_shared():
            self._shared.share_memory_()  # e.g. after copy.deepcopy

    def set(self, epoch: int) -> None:
        """``set_epoch``: every later iteration uses ``epoch``."""
        self._shared[1] = epoch
        self._shared[0] = 1

    def current(self, num_workers: int, wid: int, local: int) -> int:
        """The epoch of the iteration starting now in worker ``wid`` (``local``: this copy's own count,
        for a worker that has no counter)."""
        if self._shared[0]:
            return int(self._shared[1])
        slot = _auto_slot(num_workers, wid)
        return int(self._shared[slot]) if slot is not None else local

    def started(self, num_workers: int, wid: int, epoch: int) -> None:
        """Worker ``wid`` started an iteration of ``epoch``: its next one is ``epoch + 1``."""
        slot = _auto_slot(num_workers, wid)
        if slot is not None:
            self._shared[slot] = epoch + 1
