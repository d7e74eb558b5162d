"""What a StorageDataset's DataLoader worker yields (``WorkerItem``), and the counts it carries.

A ``WorkerItem`` pickles into a call of ``_receive``: in the trainer it unpickles into the
sample itself and adds its counts to the dataset's (``stats``), keyed by the dataset's uid. With
DataLoader-side batching, ``default_collate`` builds the samples in the worker (``_collate``).
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Any

from .._shm.filling import FillInfo, SlotFiller
from . import hooks

__all__ = ["STAT_KEYS", "WorkerItem", "counts", "record", "record_refused"]

_stats: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_stats_lock = threading.Lock()


def _renew_lock_in_child() -> None:
    global _stats_lock
    _stats_lock = threading.Lock()  # another thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_renew_lock_in_child)


def record(uid: str, info: FillInfo, skipped: int) -> None:
    """Add one delivered fill (and the handles skipped before it) to dataset ``uid``'s counts."""
    with _stats_lock:
        c = _stats[uid]
        info.count(c)
        if skipped:
            c["skipped"] += skipped


def record_refused(uid: str, refused: int) -> None:
    """Add what the sources of dataset ``uid`` refused in a DataLoader worker (its ledger reports them)."""
    with _stats_lock:
        _stats[uid]["refused"] += refused


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

    __slots__ = ("filler", "info", "payload", "skipped", "uid")

    def __init__(self, uid: str | None, info: FillInfo, skipped: int, payload: Any, filler: SlotFiller) -> None:
        self.uid, self.info, self.skipped = uid, info, skipped
        self.payload, self.filler = payload, filler

    def __reduce__(self):
        # The payload is unpickled first (it is an argument), then _receive counts it; the stats
        # travel as plain values, cheaper to unpickle than a FillInfo.
        info = self.info
        return _receive, (
            self.uid,
            info.via,
            info.nbytes,
            info.regrew,
            info.copied,
            self.skipped,
            self.payload,
        )


def _receive(uid: str | None, via: str, nbytes: int, regrew: bool, copied: bool, skipped: int, sample: Any) -> Any:
    if uid is not None:
        record(uid, FillInfo(via, nbytes, regrew, copied), skipped)
    return sample


def _collate(batch: list[WorkerItem], *, collate_fn_map=None) -> Any:
    # DataLoader-side batching (DataLoader(ds, batch_size=n)) collates in the worker: build each
    # sample there, and let the default path ship the collated batch (slower, but correct). For
    # device=, the collated batch goes back into a slot, to be copied to the device in one piece.
    collated = hooks.collate([d.filler.materialize_here(d.payload) for d in batch], collate_fn_map=collate_fn_map)
    first = batch[0]
    opts = first.payload.opts
    if opts.device is None:
        return collated
    info, payload = first.filler.fill_object(collated, opts=opts, path=first.payload.path)
    return WorkerItem(None, info, 0, payload, first.filler)  # its samples are not counted, as without device=


# The extension point torch documents for default_collate: a collate function per element type.
hooks.register_collate(WorkerItem, _collate)
hooks.install()  # raises UnsupportedTorchError, naming the torch needed, where torch differs


def counts(uid: str, skipped: int, refused: int) -> dict[str, int]:
    """The counts of dataset ``uid`` in this process, plus what it has not sent yet."""
    with _stats_lock:
        c = _stats[uid]
        return {k: c[k] for k in STAT_KEYS} | {"skipped": c["skipped"] + skipped, "refused": c["refused"] + refused}
