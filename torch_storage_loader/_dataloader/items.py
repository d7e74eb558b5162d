"""What a StorageDataset's DataLoader worker yields (``WorkerItem``), and the counts it carries.

A ``WorkerItem`` pickles into a call of ``_receive``: in the trainer it unpickles into the
sample itself and adds its counts to the dataset's (``stats``), keyed by the dataset's uid. With
DataLoader-side batching, ``default_collate`` builds the samples in the worker (``collate_items``).

What a worker skips or its source refuses comes with no item, so it cannot ride on one (the last
handles of a worker's share may all fail): the worker adds it to ``WorkerCounts``, a small tensor
in shared memory that reaches the workers with the dataset, before it sends anything more.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from .._proc import ForkSafeLock
from .._shm.filling import FillInfo, SlotFiller
from . import hooks

__all__ = ["STAT_KEYS", "WorkerCounts", "WorkerItem", "collate_items", "counts", "record"]

_stats: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
_stats_lock = ForkSafeLock()


def record(uid: str, info: FillInfo, skipped: int) -> None:
    """Add one delivered fill (and the handles skipped before it) to dataset ``uid``'s counts."""
    with _stats_lock:
        c = _stats[uid]
        info.count(c)
        if skipped:
            c["skipped"] += skipped


class WorkerCounts:
    """Handles skipped and entries refused in a dataset's DataLoader workers, as the trainer sees them.

    One row ``[skipped, refused]`` per worker id, in shared memory: each worker adds to its own row
    only (rows are not locked), persistent workers included, and the trainer sums them in
    ``stats()``. A count is written before the worker sends its next item or its end, so the
    trainer has it once the DataLoader has passed what came after.
    """

    ROWS = 1024  # worker ids beyond it share rows (then two workers may race on one)

    def __init__(self) -> None:
        self._shared = torch.zeros((self.ROWS, 2), dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]  # torch leaves share_memory_ unannotated

    def ensure_shared(self) -> None:
        if not self._shared.is_shared():
            self._shared.share_memory_()  # e.g. after copy.deepcopy

    def add(self, worker: int, *, skipped: int = 0, refused: int = 0) -> None:
        """In worker ``worker``: it skipped ``skipped`` handles, and its source refused ``refused`` entries."""
        row = self._shared[worker % self.ROWS]
        row[0] += skipped
        row[1] += refused

    def totals(self) -> tuple[int, int]:
        """(skipped, refused), summed over the workers."""
        skipped, refused = self._shared.sum(0).tolist()
        return int(skipped), int(refused)


STAT_KEYS = (
    "loads",
    "bytes",
    "slot_loads",
    "fallbacks",
    "oversize",
    "copies",
    "local_loads",
    "regrows",
    "skipped",
    "refused",
)


class WorkerItem:
    """What a DataLoader worker yields: unpickles in the trainer into the sample (and counts it)."""

    __slots__ = ("filler", "info", "payload", "uid")

    def __init__(self, uid: str | None, info: FillInfo, payload: Any, filler: SlotFiller) -> None:
        self.uid, self.info = uid, info
        self.payload, self.filler = payload, filler

    def __reduce__(self) -> tuple[Any, ...]:
        # The payload is unpickled first (it is an argument), then _receive counts it; the stats
        # travel as plain values, cheaper to unpickle than a FillInfo.
        info = self.info
        return _receive, (
            self.uid,
            info.via,
            info.nbytes,
            info.regrew,
            info.copied,
            self.payload,
        )


def _receive(uid: str | None, via: str, nbytes: int, regrew: bool, copied: bool, sample: Any) -> Any:
    if uid is not None:
        record(uid, FillInfo(via, nbytes, regrew, copied), 0)
    return sample


def collate_items(batch: list[WorkerItem], *, collate_fn_map: Any = None) -> Any:
    """``default_collate`` for ``WorkerItem`` batches: DataLoader-side batching collates in the worker, so
    each sample is built there and the collated batch shipped (slower, but correct); for ``device=`` it goes
    back into a slot, to be copied to the device in one piece."""
    collated = hooks.collate([d.filler.materialize_here(d.payload) for d in batch], collate_fn_map=collate_fn_map)
    first = batch[0]
    opts = first.payload.opts
    if opts.device is None:
        return collated
    info, payload = first.filler.fill_object(collated, opts=opts, path=first.payload.path)
    return WorkerItem(None, info, payload, first.filler)  # its samples are not counted, as without device=


def counts(uid: str, skipped: int, refused: int) -> dict[str, int]:
    """The counts of dataset ``uid`` in this process, plus ``skipped`` and ``refused`` counted elsewhere
    (not yet recorded here, and those of its DataLoader workers)."""
    with _stats_lock:
        c = _stats[uid]
        return {k: c[k] for k in STAT_KEYS} | {"skipped": c["skipped"] + skipped, "refused": c["refused"] + refused}
