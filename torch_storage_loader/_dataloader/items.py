"""A StorageDataset's items: its options, loading one (``Reader``, for both sides: ``finite``, ``stream``),
what a DataLoader worker yields (``WorkerItem``), and the counts it carries.

``Reader`` fills one item (a sample, or a dataset-side batch) from a group of handles in the
process iterating the dataset: into the DataLoader worker's ring of shared-memory slots, or into
private memory in the trainer. Under ``on_error="skip"`` it logs and counts what fails instead of
raising, a batch losing only the files that fail on their own.

A ``WorkerItem`` pickles into a call of ``_receive``: in the trainer it unpickles into the
sample itself and adds its counts to the dataset's (``stats``), keyed by the dataset's uid. With
DataLoader-side batching, ``default_collate`` builds the samples in the worker (``collate_items``).

What a worker skips or its source refuses comes with no item, so it cannot ride on one (the last
handles of a worker's share may all fail): the worker adds it to ``WorkerCounts``, a small tensor
in shared memory that reaches the workers with the dataset, before it sends anything more.
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from .._gpu import device as _device
from .._options import check_option
from .._proc import fork_safe_lock
from .._shm.alloc import check_slot_options
from .._shm.filling import FillInfo, LocalFiller, SlotFiller
from .._shm.segments import default_shm_budget
from ..errors import (
    InsufficientSharedMemoryError,
    SampleMismatchError,
    SampleTooLargeForDeviceError,
    ShmTransportError,
    StorageError,
    StorageUnavailableError,
)
from ..storage import Storage
from . import hooks

__all__ = ["SKIP", "DatasetOptions", "Reader", "WorkerItem", "collate_items"]

logger = logging.getLogger("torch_storage_loader")

SKIP = object()  # what ``Reader.load`` returns for an item skipped whole
_stats: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
_stats_lock = fork_safe_lock()


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
    """What a DataLoader worker yields: unpickles in the trainer into the sample (and counts it).

    The payload (a reference to shared memory) travels pickled on its own, and is unpickled inside
    ``_receive``'s ``try``: receiving it can fail (its ring forgotten, a descriptor not passed, the
    device copy refused), and that happens wherever torch unpickles the worker's result, under
    ``device=`` on torch's pin-memory thread, outside any ``try`` of torch's (an error there ends
    the thread, and the trainer would see only "Pin memory thread exited unexpectedly"). So a failure
    arrives as a ``hooks.Undelivered`` item instead: its error raised on the trainer's thread, or
    under ``on_error="skip"`` logged, counted (``handles``) and passed over. Pickling the small
    reference twice costs microseconds per item.
    """

    __slots__ = ("counted", "filler", "handles", "info", "payload", "skip", "uid")

    def __init__(
        self,
        uid: str,
        info: FillInfo,
        payload: Any,
        filler: SlotFiller,
        *,
        handles: int = 1,
        skip: bool = False,
        counted: bool = True,
    ) -> None:
        self.uid, self.info = uid, info
        self.payload, self.filler = payload, filler
        self.handles, self.skip, self.counted = handles, skip, counted

    def __reduce__(self) -> tuple[Any, ...]:
        # The stats travel as plain values, cheaper to unpickle than a FillInfo.
        info = self.info
        counts = (info.via, info.nbytes, info.regrew, info.copied) if self.counted else None
        payload = bytes(ForkingPickler.dumps(self.payload))  # its segments as DupFd, as torch's queue sends them
        return _receive, (self.uid, counts, self.handles, self.skip, payload)


def _receive(uid: str, counts: tuple[str, int, bool, bool] | None, handles: int, skip: bool, payload: bytes) -> Any:
    try:
        sample = pickle.loads(payload)
    except Exception as exc:  # noqa: BLE001 - any failure to receive: raised on the trainer's thread, or skipped
        return _undelivered(uid, handles, skip, exc)
    if type(sample) is _device.DeviceItem and sample.error is not None and skip:
        return _undelivered(uid, handles, skip, sample.error, _NOT_COPIED)
    if counts is not None:
        record(uid, FillInfo(*counts), 0)
    return sample


_NOT_RECEIVED = (
    "a DataLoader worker's item could not be received in the trainer ({}); its worker may have exited "
    "meanwhile, or the process ran out of descriptors (ulimit -n)"
)
_NOT_COPIED = "an item's copy to the device failed ({})"


def _undelivered(uid: str, handles: int, skip: bool, exc: BaseException, why: str = _NOT_RECEIVED) -> hooks.Undelivered:
    """An item that failed on its way into the trainer (``why``: not received, or its device copy
    failed): the library's error, or (``skip``) logged and counted."""
    error = exc
    if not isinstance(exc, StorageError):
        error = ShmTransportError(why.format(f"{type(exc).__name__}: {exc}"))
        error.__cause__ = exc
    if not skip:
        return hooks.Undelivered(error)
    logger.warning("skipping an item of %d handle(s) that did not reach the trainer: %s", handles, error)
    with _stats_lock:
        _stats[uid]["skipped"] += handles
    return hooks.Undelivered(None)


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
    # Its samples are not counted, as without device=; its handles are, if it cannot be received.
    handles = sum(d.handles for d in batch)
    return WorkerItem(first.uid, info, payload, first.filler, handles=handles, skip=first.skip, counted=False)


@dataclass(frozen=True)
class DatasetOptions:
    """``StorageDataset``'s options (all but ``source``), checked as they are made: their one list and
    check. ``StorageDataModule`` makes them from its own, so its mistakes raise at construction."""

    batch_size: int | None
    drop_last: bool
    collate_fn: Callable[[list[Any]], Any] | None
    slots_per_worker: int
    max_rings_per_worker: int
    max_shm_bytes: int | None
    on_error: str
    shuffle: bool
    seed: int
    storage_options: dict[str, Any] | None  # these three are checked by the dataset, with its source
    trusted_roots: list[str] | None
    device: str | torch.device | None

    def __post_init__(self) -> None:
        check_option("shuffle", self.shuffle, bool)
        check_option("seed", self.seed, int)
        check_option("drop_last", self.drop_last, bool)
        check_option("batch_size", self.batch_size, int, least=1, none="for single samples")
        if self.collate_fn is not None and self.batch_size is None:
            raise ValueError("collate_fn needs batch_size: the dataset collates its own batches")
        check_slot_options(
            slots_per_worker=self.slots_per_worker,
            max_rings_per_worker=self.max_rings_per_worker,
            max_shm_bytes=self.max_shm_bytes,
        )
        check_option("on_error", self.on_error, str)
        if self.on_error not in ("raise", "skip"):
            raise ValueError(f"on_error={self.on_error!r} must be 'raise' or 'skip'")


class Reader:
    """Loads one dataset's items in the process iterating it, and counts the handles it skips."""

    def __init__(self, opts: DatasetOptions, device: str | None) -> None:
        self.opts, self.device, self.uid = opts, device, uuid.uuid4().hex
        self.skipped = 0  # in the trainer: handles skipped since the last sample it recorded
        self.worker_counts = WorkerCounts()  # skipped and refused in the DataLoader's workers
        self.wid = 0  # this DataLoader worker's id (its row of worker_counts)
        self.in_worker, self.materialize, self.per_item = False, False, 1  # set per iteration: see run
        self.filler: SlotFiller | None = None  # this process's (made by run)
        self._filler_pid = 0

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "filler": None, "_filler_pid": 0}  # each process makes its own

    def own(self, new: bool) -> None:
        """In a trainer; ``new``: a copy that reached another trainer (a DDP rank), whose workers count apart."""
        if new:
            self.worker_counts = WorkerCounts()
        self.worker_counts.ensure_shared()

    def stats(self, refused: int) -> dict[str, int]:
        """The counts of this dataset in this process, its workers' included; ``refused``: its source's, not yet counted."""
        skipped, by_workers = self.worker_counts.totals()
        with _stats_lock:
            c = _stats[self.uid]
            skipped += c["skipped"] + self.skipped
            return {k: c[k] for k in STAT_KEYS} | {"skipped": skipped, "refused": c["refused"] + refused + by_workers}

    def run(self, num_workers: int, items: Callable[[], Iterator[Any]]) -> Iterator[Any]:
        """``items()``, loading with this process's filler (``num_workers``: 0 in the trainer). Its first step,
        which the DataLoader's fetcher runs, asks the fetcher how the DataLoader collates (``hooks.fetch_context``)."""
        self.in_worker = num_workers > 0
        self.materialize, self.per_item = hooks.fetch_context() if self.in_worker else (False, 1)
        if self.filler is None or self._filler_pid != os.getpid():
            opts = self.opts
            budget = opts.max_shm_bytes or default_shm_budget()  # without workers, it bounds private memory
            if num_workers:
                self.filler = SlotFiller(
                    opts.slots_per_worker,
                    as_tensors=True,
                    max_rings=opts.max_rings_per_worker,
                    budget=budget // num_workers,
                    watch=True,
                    device=self.device,
                )
            else:
                self.filler = LocalFiller(as_tensors=True, device=self.device, budget=budget)
            self._filler_pid = os.getpid()
        yield from items()

    def count_skipped(self, n: int) -> None:
        """``n`` handles were skipped: a worker adds them to the trainer's counts at once, since no item
        may follow to carry them (its last handles may all fail)."""
        if self.in_worker:
            self.worker_counts.add(self.wid, skipped=n)
        else:
            self.skipped += n

    def load(self, group: list[Any], dropped: list[int] | None = None) -> Any:
        """Fill one item (a sample, or a batch) from ``group``; under ``on_error="skip"``, ``SKIP`` or a batch
        of fewer samples instead of an error, the positions in ``group`` of the handles skipped added to ``dropped``."""
        filler, dropped = self.filler, [] if dropped is None else dropped
        assert filler is not None  # loading runs in run
        try:
            info, payload = self._fill(filler, group, dropped)
        except Exception as exc:
            if self.opts.on_error == "raise":
                raise
            rest = [i for i in range(len(group)) if i not in dropped]
            if rest:  # (none: each failed on its own, logged and counted already)
                logger.warning("skipping %s: %s", [group[i] for i in rest] if len(rest) > 1 else group[rest[0]], exc)
                dropped.extend(rest)
                self.count_skipped(len(rest))
            return SKIP
        skipped, self.skipped = self.skipped, 0
        if self.in_worker and self.materialize:
            return filler.materialize_here(payload)  # the DataLoader's collate_fn is the user's: give it samples
        if self.in_worker:
            handles, skip = len(group) - len(dropped), self.opts.on_error == "skip"
            return WorkerItem(self.uid, info, payload, filler, handles=handles, skip=skip)
        if type(payload) is _device.DeviceItem and payload.error is not None and self.opts.on_error == "skip":
            self.skipped = skipped
            rest = [i for i in range(len(group)) if i not in dropped]
            dropped.extend(rest)  # settled as failed by the stream, like the handles that failed to load
            _undelivered(self.uid, len(rest), True, payload.error, _NOT_COPIED)
            return SKIP
        record(self.uid, info, skipped)
        if type(payload) is _device.DeviceItem:
            return payload.finish()  # in the trainer's process: its stream waits for the copy
        return payload

    def _fill(self, filler: SlotFiller, group: list[Any], dropped: list[int]) -> tuple[FillInfo, Any]:
        """``filler``'s fill of ``group``. Under ``on_error="skip"`` a batch that fails is filled again without
        the handles that fail on their own (each logged and counted, its position added to ``dropped``):
        a bad file costs its own sample, never the good ones batched with it, and the batch comes shorter
        (the dataset's batches are fixed groups of handles: ``len()``, resuming and the delivery ledger
        count them). Only on that error path is each handle read a second time. Raises the batch's error
        if no handle fails alone (they cannot be stacked together, or ``collate_fn`` failed) or the
        others fail together again."""
        opts = self.opts
        if opts.batch_size is None:
            return filler.fill(group[0])
        try:
            return filler.fill_batch(group, opts.collate_fn)
        except Exception:
            if opts.on_error == "raise" or len(group) == 1:
                raise
            why = {i: exc for i, h in enumerate(group) if (exc := self._fails_alone(h, filler)) is not None}
            if not why:
                raise
        for i, exc in why.items():
            logger.warning("skipping %s: %s", group[i], exc)
        dropped.extend(why)
        self.count_skipped(len(why))
        rest = [h for i, h in enumerate(group) if i not in why]
        if not rest:
            raise _AllSkipped
        return filler.fill_batch(rest, opts.collate_fn)

    def at_fault(self, group: list[Any], error: Exception) -> list[int]:
        """The positions in ``group`` whose own file made its load raise ``error`` (``on_error="raise"``):
        those are set aside as failed, and the others go back to their source, so a run with the fix
        delivers them. None is at fault for an error about how the samples were combined or where
        they go (they cannot be stacked, ``collate_fn`` raised, shared or device memory is too small):
        every handle goes back; so too where the store is unreachable (an outage is no file's fault,
        and reading each again would wait out the retries once more per handle). In a dataset batch,
        even of one, each handle is read again on its own, as under ``"skip"`` (a file whose shape
        differs from its batch's loads alone: it goes back with the others, and raises again until
        ``collate_fn=`` or ``on_error="skip"`` deals with it)."""
        if isinstance(error, _NOT_THE_FILES):
            return []
        if self.opts.batch_size is None:
            return [0]  # a sample loaded alone: its file is at fault
        assert self.filler is not None  # loading runs in run
        out = []
        for i, storage in enumerate(group):
            alone = self._fails_alone(storage, self.filler)
            if alone is not None and not isinstance(alone, _NOT_THE_FILES):
                out.append(i)
        return out

    def _fails_alone(self, storage: Storage, filler: SlotFiller) -> Exception | None:
        """Why ``storage`` cannot be loaded on its own (None: it can), read as ``fill_batch`` reads it, into
        private memory bounded as ``filler`` bounds a batch, then dropped: no slot, no device."""
        try:
            if self.opts.collate_fn is not None:
                storage.load()  # what fill_batch does for collate_fn
            else:
                LocalFiller(budget=filler.alloc.budget).fill_batch([storage])
        except Exception as exc:  # noqa: BLE001 - the reason it is skipped, logged
            return exc
        return None


# Errors that say nothing against the files loaded: their handles go back (see Reader.at_fault).
_NOT_THE_FILES = (
    SampleMismatchError,
    InsufficientSharedMemoryError,
    SampleTooLargeForDeviceError,
    StorageUnavailableError,
)


class _AllSkipped(Exception):
    """Every handle of a batch failed on its own: each was logged and counted already."""
