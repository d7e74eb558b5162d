"""``StorageDataset``: ``DataLoader(StorageDataset(source))`` with shared-memory slots.

Inside DataLoader workers each sample (or dataset-side batch) is read straight into the worker's
ring of shared-memory slots; what crosses the DataLoader's result queue is a small reference that
unpickles, in the trainer, into tensors backed by the slot. A slot is reused only after the
trainer dropped every tensor viewing it; when none is free the worker uses a segment of its own
for that sample (counted as a fallback), so keeping batches never deadlocks and never sees them
change. With ``num_workers=0`` samples are read into private memory in the trainer's process.

Size: about 640 lines (390 of code, 175 of docstrings: the users' reference), because
``StorageDataset`` is torch's dataset protocol (iteration, length, ``state_dict``, ``set_epoch``,
pickling into workers and DDP ranks, ``stats``) over finite and streaming sources alike; what it
uses has its own home already (``_sources``, ``_dataloader.epochs``, ``_dataloader.items``,
``_dataloader.ledger``, ``_shm.filling``): what is left is one class's methods, sharing its state.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from ._dataloader import hooks
from ._dataloader.epochs import EpochCounters
from ._dataloader.items import WorkerCounts, WorkerItem, collate_items, counts, record
from ._dataloader.ledger import LedgerRef, LedgerWriter
from ._gpu import device as _device
from ._options import check_option, take
from ._shm.alloc import check_slot_options
from ._shm.filling import FillInfo, LocalFiller, SlotFiller
from ._shm.segments import default_shm_budget
from ._sources import DirectorySource, ListSource, Source, as_source, end_directory_stream
from ._sources.redis import RedisSource
from ._stores import objects as _objects
from ._untrusted import trust as _trust
from .storage import Storage

__all__ = ["StorageDataset", "end_directory_stream"]


logger = logging.getLogger("torch_storage_loader")


def _live_dist() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


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
        on_error = self.on_error
        check_option("on_error", on_error, str)
        if on_error not in ("raise", "skip"):
            raise ValueError(f"{on_error=} must be 'raise' or 'skip'")


# Size: about 540 lines, a third of them its documentation; see the module.
class StorageDataset(IterableDataset[Any]):
    """An ``IterableDataset`` of the samples behind storage handles.

    ``source`` is a finite iterable of ``Storage`` handles (each delivered once per epoch, split
    across DataLoader workers and distributed ranks), a ``StorageQueue``, a ``queue.Queue`` or
    multiprocessing queue ending at ``None``, or a directory (or object-store prefix, such as
    ``s3://bucket/prefix``) a ``FileStorageLoader`` writes into, or a ``RedisStorageQueue``.

    ``trusted_roots`` (absolute directories and ``proto://bucket/prefix`` URLs) add to a network
    source's own (``RedisStorageQueue(trusted_roots=...)``): handles read from the network load only
    if they name a file or object under one of them; others are refused and counted
    (``stats()["refused"]``, which also counts refused claims of directory and prefix sources). With
    no roots at all, the first such handle raises ``UntrustedStorageError`` out of the DataLoader and
    stays in the stream for a consumer that has them. ``storage_options`` (given to fsspec as they
    are) apply to the buckets this dataset names: that prefix's, its handles' (a list), and those of
    the object-store roots it trusts; never to other buckets a handle might name. They reach the
    DataLoader workers, as does ``configure_object_store``'s configuration.

    Finite sources work like ``DistributedSampler``: ``shuffle=True`` draws a permutation of
    ``(seed, epoch)``, the same on every rank; every rank yields the same number of items
    (``len(dataset)``, per rank), by repeating handles from the start of the order
    (``stats()["padded"]``) or, with ``drop_last=True``, dropping the tail. The epoch advances by
    itself each time the dataset is iterated; ``set_epoch`` fixes it (persistent workers included).

    ``batch_size``: stack that many samples straight into one slot (leaves gain a leading batch
    dimension); use it with ``DataLoader(..., batch_size=None)``. ``collate_fn`` combines samples
    whose shapes differ instead. ``on_error="skip"`` skips (and counts) samples that fail to load
    instead of raising (in a batch, only the files that fail: the batch comes shorter).
    ``max_shm_bytes`` bounds the shared memory of this DataLoader's workers
    (split evenly; default half the size of /dev/shm): a sample larger than one worker's share
    raises ``SampleTooLargeError``. Numeric numpy leaves come out as tensors (sharing memory, as DataLoader's
    default conversion does); treetensor trees stay trees.

    ``device`` (``"cuda"``, ``"cuda:1"``, a ``torch.device``): batches come out on that device. Under
    DataLoader workers each one crosses in a single copy on a side stream, issued as it arrives
    (on the DataLoader's pin-memory thread, ahead of the trainer); the trainer's current stream
    waits for it, and its slot goes back to the worker once the copy is done. ``"cuda"`` is the
    current device of the process creating the DataLoader iterator. Strings, bytes and other
    non-tensor leaves stay on the host; a sample too large for the device raises
    ``SampleTooLargeForDeviceError``. Leave ``pin_memory`` off with it (it changes nothing with
    workers, and with ``num_workers=0`` torch cannot pin device tensors).

    Args:
        source: Where the handles come from: a list (or other finite iterable) of ``Storage``
            handles, a ``StorageQueue`` or queue, a directory or object-store prefix (or a
            ``DirectorySource``), or a ``RedisStorageQueue``.
        batch_size: Stack this many samples into one slot in the worker (use the DataLoader with
            ``batch_size=None``); None yields single samples.
        drop_last: Drop a last batch smaller than ``batch_size``, and with a finite source the tail
            of the order instead of padding every rank to the same length.
        collate_fn: Combine a batch's samples yourself (samples whose shapes differ); needs ``batch_size``.
        slots_per_worker: Shared-memory slots in each worker's ring: how many items a worker can
            have in flight before it falls back to segments of its own.
        max_rings_per_worker: How many rings (one per size class of items) a worker keeps.
        max_shm_bytes: Shared memory for all of this DataLoader's workers, split evenly between
            them; None: half the size of /dev/shm. Without workers, the most private memory one
            sample may take (a file's header cannot make the trainer allocate more).
        on_error: ``"raise"`` (the default) raises a sample's load error in the trainer; ``"skip"``
            logs it, counts it (``stats()["skipped"]``, one per file, workers' included) and goes on.
            With ``batch_size``, a batch loses only the files that fail on their own, and comes with
            fewer samples (the batches are fixed groups of handles, as ``len()`` and resuming count
            them); it is skipped whole only where its samples cannot be stacked together or
            ``collate_fn`` fails.
        shuffle: Draw a new order each epoch from ``(seed, epoch)``; finite sources only.
        seed: The seed of the shuffled order, the same on every rank.
        storage_options: fsspec options (credentials, endpoint) for the buckets this dataset names.
        trusted_roots: Directories and ``proto://bucket/prefix`` URLs that handles read from the
            network may name, added to the source's own.
        device: Deliver batches on this device (``"cuda"``, ``"cuda:1"``, a ``torch.device``); None:
            on the host, in shared memory.

    Raises:
        TypeError: An option has the wrong type, or ``source`` is none of the kinds above.
        ValueError: An option is out of range, ``collate_fn`` is given without ``batch_size``,
            ``shuffle=True`` with a streaming source, or ``storage_options`` with no bucket to apply to.
        StreamEndedError: ``source`` is a directory or prefix whose stream had ended before this
            dataset was made (see ``DirectorySource.check_start``): call ``start_directory_stream``.
        UnsupportedTorchError: The installed torch lacks a private piece the DataLoader hooks rely on
            (checked by the first dataset made in a process, which installs them), naming the torch needed.

    Examples:
        >>> import torch
        >>> from torch_storage_loader import FileStorage, StorageDataset
        >>> handles = [FileStorage(f"{i}.tsl") for i in range(4)]
        >>> for i, handle in enumerate(handles):
        ...     size = handle.save({"x": torch.full((2,), i)})
        >>> dataset = StorageDataset(handles, batch_size=2)
        >>> [batch["x"].tolist() for batch in torch.utils.data.DataLoader(dataset, batch_size=None)]
        [[[0, 0], [1, 1]], [[2, 2], [3, 3]]]
    """

    def __init__(
        self,
        source: Any,
        *,
        batch_size: int | None = None,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        slots_per_worker: int = 4,
        max_rings_per_worker: int = 8,
        max_shm_bytes: int | None = None,
        on_error: str = "raise",
        shuffle: bool = False,
        seed: int = 0,
        storage_options: dict[str, Any] | None = None,
        trusted_roots: list[str] | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__()
        hooks.install(WorkerItem, collate_items)  # here, not at import: see __setstate__
        take(DatasetOptions, locals())  # checks them
        self.device = _device.normalize(device)  # None, or a device this process copies samples to
        roots = _trust.roots(trusted_roots)  # raises ValueError naming trusted_roots
        self.source = as_source(source, roots)
        if storage_options is not None:
            for bucket in self._buckets(roots):
                _objects.configure_object_store(bucket, storage_options)
        self._object_stores = _objects.snapshot()  # reaches the DataLoader workers with the dataset
        if isinstance(self.source, DirectorySource):
            self.source.check_start()  # once, here: an ended stream is refused before any worker starts
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.collate_fn = collate_fn
        self.slots_per_worker = slots_per_worker
        self.max_rings_per_worker = max_rings_per_worker
        self.max_shm_bytes = max_shm_bytes
        self.on_error = on_error
        self.shuffle = shuffle
        self.seed = seed
        if shuffle and not self.source.finite:
            raise ValueError("shuffle=True needs a finite source (a list of handles); a stream comes in its own order")
        self._uid = uuid.uuid4().hex
        self._dist: tuple[int, int] | None = None
        self._epoch = 0  # the epoch being (or last) iterated in this copy
        self._yielded = 0  # groups this copy passed in it
        self._resume: tuple[int, int] | None = None
        self._iters = 0
        self._owner = os.getpid()
        self._epochs = EpochCounters() if self.source.finite else None  # shared with the DataLoader's workers
        self._skipped = 0  # in the trainer: handles skipped since the last sample it recorded
        self._worker_counts = WorkerCounts()  # skipped and refused in the DataLoader's workers
        self._refused_sent = 0  # of the source's refusals in this worker, those added to _worker_counts
        self._wid = 0  # this DataLoader worker's id (its row of _worker_counts)
        self._counting_pid = 0  # the process _refused_sent was last set up for
        self._filler: SlotFiller | None = None
        self._filler_pid = 0
        self._materialize = False  # set per iteration: see hooks.fetch_context
        self._per_item = 1  # DataLoader-side batch size, the same way
        self._ledger: LedgerRef | None = None  # while a DataLoader starts its workers: see _tsl_attach_ledger
        self._writer: LedgerWriter | None = None  # this worker's end of it

    def _buckets(self, roots: _trust.Roots) -> list[str]:
        """The buckets (``proto://bucket``) ``storage_options`` are for; ValueError when there are none."""
        src = self.source
        path = getattr(src, "path", None)
        found = [_trust.roots([path]) if _objects.is_url(path) else _trust.Roots(), roots]
        if isinstance(src, RedisSource):
            found.append(src.roots)  # the queue's own (the dataset's are among them)
        buckets = _trust.object_roots(found)
        if isinstance(src, ListSource):
            buckets += [_objects.root(h.path) for h in src.handles if _objects.is_url(h.path)]
        buckets = list(dict.fromkeys(buckets))
        if not buckets:
            raise ValueError(
                "storage_options= apply to the buckets this dataset names (an s3://bucket/prefix source, object "
                "handles in a list, or trusted_roots=['s3://bucket/prefix']), and this one names none; pass "
                "trusted_roots=, or call configure_object_store('s3://bucket', options) for each bucket"
            )
        return buckets

    # -------------------------------------------------------------------------- the protocol
    def _own(self) -> None:
        """Called where this process uses the dataset as a trainer (not in a DataLoader worker).

        A copy that reached another process that way (say, a DDP rank) takes its own epoch counters
        and process group, so that ranks sharing one pickled dataset never write each other's slots.
        """
        if self._owner != os.getpid() and get_worker_info() is None:
            self._owner, self._dist = os.getpid(), None
            self._worker_counts = WorkerCounts()  # another trainer's workers: counted apart, from zero
            if self._epochs is not None:
                self._epochs = self._epochs.detach()
        self._worker_counts.ensure_shared()
        if self._epochs is not None:
            self._epochs.ensure_shared()

    def __getstate__(self) -> dict[str, Any]:
        self._own()
        state = self.__dict__.copy()
        state["_filler"], state["_filler_pid"], state["_writer"] = None, 0, None
        state["_refused_sent"] = 0  # a source unpickles with no refusals of its own yet
        state["_object_stores"] = {**self._object_stores, **_objects.snapshot()}  # as configured now
        if state["_dist"] is None:
            state["_dist"] = _live_dist()  # a spawned worker has no process group of its own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A spawned DataLoader worker collates this dataset's items; another trainer makes its iterators.
        hooks.install(WorkerItem, collate_items)
        self.__dict__.update(state)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next iterations (as ``DistributedSampler.set_epoch``): call it before ``iter()``.

        Reaches persistent DataLoader workers too. Without it the epoch advances by itself.

        Args:
            epoch: The epoch number (>= 0); with ``shuffle=True`` it picks the order.

        Raises:
            TypeError: ``epoch`` is not an int.
            ValueError: ``epoch`` is negative.
        """
        check_option("epoch", epoch, int, least=0)
        self._own()
        if self._epochs is not None:
            self._epochs.set(epoch)

    def __bool__(self) -> bool:
        return True  # as before it had a length: ``if dataset:`` must not raise for a stream

    def __len__(self) -> int:
        """Items (samples, or batches with ``batch_size``) this rank yields per epoch; finite sources only."""
        if not isinstance(self.source, ListSource):
            raise TypeError(
                f"a StorageDataset over a {type(self.source).__name__} has no length: "
                "it streams until its producers end it"
            )
        self._own()
        _, world = self._dist if self._dist is not None else _live_dist()
        return int(self.source.items_per_rank(world, self.batch_size or 1, self.drop_last))

    def state_dict(self) -> dict[str, int]:
        """Progress through the current epoch: for resuming a finite source mid-epoch.

        Called in each worker by ``torchdata.stateful_dataloader.StatefulDataLoader`` (and in the
        trainer with ``num_workers=0``); resume with the same ``num_workers`` and world size.

        Returns:
            ``{"epoch": ..., "yielded": ...}``: the epoch, and how many items this copy yielded in it.
        """
        return {"epoch": self._epoch, "yielded": self._yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume a finite source where ``state_dict`` was taken: the next iteration skips what was yielded.

        Args:
            state: What ``state_dict`` returned.

        Raises:
            TypeError: The source is a stream, which cannot resume.
        """
        if not isinstance(self.source, ListSource):
            raise TypeError("only a finite source (a list of handles) can resume from a state_dict")
        self._resume = (int(state["epoch"]), int(state["yielded"]))

    def stats(self) -> dict[str, int]:
        """Counts of what reached this process: loads, bytes, slot_loads, fallbacks, regrows, skipped.

        ``skipped`` (handles that failed to load under ``on_error="skip"``, one per file, batched or
        not) and ``refused`` (entries the source refused) include those of this process's DataLoader
        workers, persistent or not, whatever the source. ``padded``: handles this rank repeats each
        epoch so that all ranks yield as many items.

        Returns:
            The counts by name (``loads``, ``bytes``, ``skipped``, ``refused``, ``padded``, ...).
        """
        padded = 0
        self._own()
        if isinstance(self.source, ListSource):
            rank, world = self._dist if self._dist is not None else _live_dist()
            padded = self.source.padded(rank, world, self.drop_last)
        skipped, refused = self._worker_counts.totals()
        return counts(self._uid, self._skipped + skipped, self._unsent_refusals() + refused) | {"padded": padded}

    def _unsent_refusals(self) -> int:
        """Refusals of this process's source not yet reported (a worker adds them to ``_worker_counts``)."""
        return getattr(self.source, "refused", 0) - self._refused_sent

    def _start_counting(self, worker_id: int) -> None:
        """In a DataLoader worker, as it starts iterating: what its source refused before is not its own
        (a forked worker inherits the trainer's count, which the trainer reports)."""
        self._wid = worker_id
        if self._counting_pid != os.getpid():
            self._counting_pid = os.getpid()
            self._refused_sent = getattr(self.source, "refused", 0)

    def _report_refusals(self) -> None:
        """In a DataLoader worker: add what the source refused since the last report to the trainer's counts."""
        refused = self._unsent_refusals()
        if refused:
            self._refused_sent += refused
            self._worker_counts.add(self._wid, refused=refused)

    def _count_skipped(self, n: int, in_worker: bool) -> None:
        """``n`` handles were skipped (``on_error="skip"``): a worker adds them to the trainer's counts at
        once, since no item may follow to carry them (its last handles may all fail)."""
        if in_worker:
            self._worker_counts.add(self._wid, skipped=n)
        else:
            self._skipped += n

    # --------------------------------------------------------------------------- iteration
    def _next_epoch(self, num_workers: int, wid: int) -> tuple[int, int]:
        """(epoch, groups to skip) for the iteration starting now in this copy (see ``_dataloader.epochs``)."""
        epochs = self._epochs
        assert epochs is not None  # finite sources only, and those have the shared counters
        if self._resume is not None:
            (epoch, skip), self._resume = self._resume, None
        else:
            epoch, skip = epochs.current(num_workers, wid, self._iters), 0
        self._iters = epoch + 1
        epochs.started(num_workers, wid, epoch)
        return epoch, skip

    def __iter__(self) -> Iterator[Any]:
        worker = get_worker_info()
        if worker is not None:
            _objects.apply(self._object_stores, overwrite=False)  # a forked worker's own is as new
            _objects.use_obstore_here()
        wid, nw = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        self._own()
        if worker is not None:
            self._start_counting(wid)
        rank, world = self._dist if self._dist is not None else _live_dist()
        src = self.source
        if not isinstance(src, ListSource):
            writer = self._writer_for() if worker is not None else None
            if writer is not None and writer.feed is not None:
                pairs = self._fed(writer)  # the trainer takes from the source (see _dataloader.feed)
            else:
                pairs = src.iterate(rank * nw + wid, world * nw, family=str(self._owner))
            return self._iterate(pairs, nw if worker is not None else 0, None, writer)
        # Decided here, not in the generator: StatefulDataLoader snapshots state_dict() right after iter().
        epoch, skip = self._next_epoch(nw if worker is not None else 0, wid)
        self._epoch, self._yielded = epoch, skip
        groups = src.groups(
            rank,
            world,
            wid,
            nw,
            epoch=epoch,
            shuffle=self.shuffle,
            seed=self.seed,
            batch=self.batch_size or 1,
            drop_last=self.drop_last,
        )
        return self._iterate(iter(groups[skip:]), nw if worker is not None else 0, epoch)

    def _iterate(
        self, source: Iterator[Any], num_workers: int, epoch: int | None, writer: LedgerWriter | None = None
    ) -> Iterator[Any]:
        """Load what ``source`` gives: groups of handles (finite sources) or (token, handle) pairs (streams)."""
        filler = self._filler_for(num_workers)
        in_worker = get_worker_info() is not None
        user_collates, per_item = hooks.fetch_context() if in_worker else (False, 1)
        self._materialize, self._per_item = user_collates, per_item
        if epoch is not None:
            for group in source:
                self._yielded += 1  # counts the group even if it is skipped: resume continues after it
                item = self._load(filler, group, in_worker)
                if item is not _SKIP:
                    yield item
            self._epoch, self._yielded = epoch + 1, 0
            return
        yield from self._stream(filler, source, in_worker, per_item, writer)

    def _fed(self, writer: LedgerWriter) -> Iterator[tuple[Any, Storage]]:
        """What the trainer feeds this worker, asked for one DataLoader item's worth at a time (known
        from the fetcher once iteration starts: this generator starts after ``_iterate`` asked)."""
        yield from writer.fed((self.batch_size or 1) * self._per_item)

    def _stream(
        self,
        filler: SlotFiller,
        pairs: Iterator[tuple[Any, Storage]],
        in_worker: bool,
        per_item: int,
        writer: LedgerWriter | None,
    ) -> Iterator[Any]:
        """A streaming source, at least once (see ``_dataloader.ledger``): every handle taken is either
        acknowledged once the trainer has its sample, failed, or given back."""
        src, size = self._streaming(), self.batch_size or 1
        made = 0  # samples (or dataset-side batches) yielded; DataLoader item = made // per_item
        group: list[Any] = []
        try:
            for token, storage in pairs:
                group.append((token, storage))
                if writer is not None:
                    # Each as it is read, never once per group: a worker that waits for the rest of
                    # its group (a slow stream) must not hold handles the trainer cannot see (a
                    # claimed file) or that keep its feed counted full (the feeder would stop).
                    writer.took(made // per_item, [token])
                if len(group) < size:
                    continue
                if in_worker:
                    self._report_refusals()
                item = self._load_stream(filler, group, in_worker, writer, made // per_item)
                group = []
                if item is not _SKIP:
                    made += 1
                    yield item
            if group and not self.drop_last:
                item = self._load_stream(filler, group, in_worker, writer, made // per_item)
                group = []
                if item is not _SKIP:
                    yield item
        finally:
            pairs.close()  # type: ignore[attr-defined]  # a stream's pairs come from a generator
            if group and writer is None:
                src.give_back([t for t, _ in group])  # taken, never delivered (with a ledger, the trainer does this)
            if in_worker:
                self._report_refusals()  # those after the last sample, or with none at all

    def _load_stream(
        self,
        filler: SlotFiller,
        group: list[tuple[Any, Storage]],
        in_worker: bool,
        writer: LedgerWriter | None,
        item: int,
    ) -> Any:
        tokens = [t for t, _ in group]
        src = self._streaming()

        def failed(bad: list[Any]) -> None:
            src.fail(bad)
            if writer is not None:
                writer.dropped(item, bad)

        dropped: list[int] = []  # positions skipped (on_error="skip"): settled as failed, never delivered
        try:
            out = self._load(filler, [s for _, s in group], in_worker, dropped)
        except Exception:
            failed(tokens)
            group.clear()  # settled: nothing to give back
            raise
        # Anything else (KeyboardInterrupt, the worker stopping) leaves them taken: they go back.
        if dropped:
            failed([tokens[i] for i in dropped])
        if out is not _SKIP and writer is None:
            src.ack([t for i, t in enumerate(tokens) if i not in dropped])  # in the trainer: delivered as loaded
        return out

    def _streaming(self) -> Source:
        src = self.source
        assert not isinstance(src, ListSource)  # called on streaming sources only
        return src

    def _tsl_delivery_source(self) -> Any:
        """For ``hooks``: the streaming source whose handles DataLoader workers report to a ledger (None: finite)."""
        return None if self.source.finite else self.source

    def _tsl_attach_ledger(self, ref: LedgerRef | None) -> None:
        """For ``hooks``: the ledger the workers a DataLoader is starting write to (None once started)."""
        self._ledger = ref

    def _writer_for(self) -> LedgerWriter | None:
        """This worker's ledger writer, restarted for each new iteration (epoch) of the worker."""
        if self._ledger is None:
            return None
        ref = self._ledger
        worker = get_worker_info()
        assert worker is not None  # called in DataLoader workers only
        if self._writer is None or self._writer.ledger_id != ref.id:
            feed = ref.feeds[worker.id] if ref.feeds is not None else None
            self._writer = LedgerWriter(ref.id, ref.writers[worker.id], feed, ref.trainer_pid)
            self._refused_sent += self._unsent_refusals()  # a forked worker's inherited count is the trainer's
        self._writer.restart()
        return self._writer

    def _filler_for(self, num_workers: int) -> SlotFiller:
        if self._filler is None or self._filler_pid != os.getpid():
            if num_workers:
                budget = (self.max_shm_bytes or default_shm_budget()) // num_workers
                self._filler = SlotFiller(
                    self.slots_per_worker,
                    as_tensors=True,
                    max_rings=self.max_rings_per_worker,
                    budget=budget,
                    watch=True,
                    device=self.device,
                )
            else:
                budget = self.max_shm_bytes or default_shm_budget()  # bounds private memory here
                self._filler = LocalFiller(as_tensors=True, device=self.device, budget=budget)
            self._filler_pid = os.getpid()
        return self._filler

    def _load(self, filler: SlotFiller, group: list[Any], in_worker: bool, dropped: list[int] | None = None) -> Any:
        """Fill one item (a sample, or a batch) from ``group``; under ``on_error="skip"``, ``_SKIP`` or a batch
        of fewer samples instead of an error, the positions in ``group`` of the handles skipped added to ``dropped``."""
        dropped = [] if dropped is None else dropped
        try:
            info, payload = self._fill(filler, group, in_worker, dropped)
        except Exception as exc:
            if self.on_error == "raise":
                raise
            rest = [i for i in range(len(group)) if i not in dropped]
            if rest:  # (none: each failed on its own, logged and counted already)
                logger.warning("skipping %s: %s", [group[i] for i in rest] if len(rest) > 1 else group[rest[0]], exc)
                dropped.extend(rest)
                self._count_skipped(len(rest), in_worker)
            return _SKIP
        skipped, self._skipped = self._skipped, 0
        if in_worker and self._materialize:
            return filler.materialize_here(payload)  # the DataLoader's collate_fn is the user's: give it samples
        if in_worker:
            return WorkerItem(self._uid, info, payload, filler)
        record(self._uid, info, skipped)
        if type(payload) is _device.DeviceItem:
            return payload.finish()  # in the trainer's process: its stream waits for the copy
        return payload

    def _fill(self, filler: SlotFiller, group: list[Any], in_worker: bool, dropped: list[int]) -> tuple[FillInfo, Any]:
        """``filler``'s fill of ``group``. Under ``on_error="skip"`` a batch that fails is filled again without
        the handles that fail on their own (each logged and counted, its position added to ``dropped``):
        a bad file costs its own sample, never the good ones batched with it, and the batch comes shorter
        (the dataset's batches are fixed groups of handles: ``len()``, resuming and the delivery ledger
        count them). Only on that error path is each handle read a second time. Raises the batch's error if no handle fails alone (they cannot be stacked together,
        or ``collate_fn`` failed) or the others fail together again."""
        if self.batch_size is None:
            return filler.fill(group[0])
        try:
            return filler.fill_batch(group, self.collate_fn)
        except Exception:
            if self.on_error == "raise" or len(group) == 1:
                raise
            why = {i: exc for i, h in enumerate(group) if (exc := self._fails_alone(h, filler)) is not None}
            if not why:
                raise
        for i, exc in why.items():
            logger.warning("skipping %s: %s", group[i], exc)
        dropped.extend(why)
        self._count_skipped(len(why), in_worker)
        rest = [h for i, h in enumerate(group) if i not in why]
        if not rest:
            raise _AllSkipped
        return filler.fill_batch(rest, self.collate_fn)

    def _fails_alone(self, storage: Storage, filler: SlotFiller) -> Exception | None:
        """Why ``storage`` cannot be loaded on its own (None: it can), read as ``fill_batch`` reads it, into
        private memory bounded as ``filler`` bounds a batch, then dropped: no slot, no device."""
        try:
            if self.collate_fn is not None:
                storage.load()  # what fill_batch does for collate_fn
            else:
                LocalFiller(budget=filler.alloc.budget).fill_batch([storage])
        except Exception as exc:  # noqa: BLE001 - the reason it is skipped, logged
            return exc
        return None


class _AllSkipped(Exception):
    """Every handle of a batch failed on its own: each was logged and counted already."""


_SKIP = object()
