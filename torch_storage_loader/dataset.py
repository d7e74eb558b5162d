"""``StorageDataset``: ``DataLoader(StorageDataset(source))`` with shared-memory slots.

Inside DataLoader workers each sample (or dataset-side batch) is read straight into the worker's
ring of shared-memory slots; what crosses the DataLoader's result queue is a small reference that
unpickles, in the trainer, into tensors backed by the slot. A slot is reused only after the
trainer dropped every tensor viewing it; when none is free the worker uses a segment of its own
for that sample (counted as a fallback), so keeping batches never deadlocks and never sees them
change. With ``num_workers=0`` samples are read into private memory in the trainer's process.

The class is torch's dataset protocol (iteration, length, ``state_dict``, ``set_epoch``, pickling into
workers and DDP ranks, ``stats``); each side is an object of its own: ``_dataloader.finite`` (a list's
epochs, resuming), ``_dataloader.stream`` (a stream's delivery), both loading through ``_dataloader.items``.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from ._dataloader import hooks
from ._dataloader.finite import Finite
from ._dataloader.items import DatasetOptions, Reader, WorkerItem, collate_items
from ._dataloader.ledger import LedgerRef
from ._dataloader.stream import Stream
from ._gpu import device as _device
from ._options import check_option, take
from ._sources import DirectorySource, ListSource, Source, as_source, end_directory_stream
from ._sources.redis import RedisSource
from ._stores import objects as _objects
from ._untrusted import trust as _trust

__all__ = ["StorageDataset", "end_directory_stream"]


def _where(dist: tuple[int, int] | None) -> tuple[int, int]:
    """(rank, world size) of a dataset's trainer: ``dist``, where it was pickled in one, or its process group's."""
    if dist is not None:
        return dist
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _configure_buckets(src: ListSource | Source, roots: _trust.Roots, storage_options: dict[str, Any]) -> None:
    """Give ``storage_options`` to the buckets (``proto://bucket``) the dataset names; ValueError when there are none."""
    path = getattr(src, "path", None)
    found = [_trust.roots([path]) if _objects.is_url(path) else _trust.Roots(), roots]
    if isinstance(src, RedisSource):
        found.append(src.roots)  # the queue's own (the dataset's are among them)
    buckets = _trust.object_roots(found)
    if isinstance(src, ListSource):
        buckets += [_objects.root(h.path) for h in src.handles if _objects.is_url(h.path)]
    if not buckets:
        raise ValueError(
            "storage_options= apply to the buckets this dataset names (an s3://bucket/prefix source, object "
            "handles in a list, or trusted_roots=['s3://bucket/prefix']), and this one names none; pass "
            "trusted_roots=, or call configure_object_store('s3://bucket', options) for each bucket"
        )
    for bucket in dict.fromkeys(buckets):
        _objects.configure_object_store(bucket, storage_options)


# Size: about 255 lines, 95 of them the docstring users read; the logic is in _dataloader (finite, stream, items).
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
    workers, and with ``num_workers=0`` torch cannot pin device tensors). A batch's tensors are views
    of one device buffer: a tensor kept beyond the step (labels for a metric) keeps the whole batch
    on the device; keep ``.clone()`` of it instead.

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
            logs it, counts it (``stats()["skipped"]``, one per file, workers' included) and goes on;
            so too for a batch that fails on its way into the trainer or onto ``device``.
            With ``batch_size``, a batch loses only the files that fail on their own, and comes with
            fewer samples (the batches are fixed groups of handles, as ``len()`` and resuming count
            them); it is skipped whole only where its samples cannot be stacked together or
            ``collate_fn`` fails. Under ``"raise"``, a streaming source keeps the files at fault
            as failed (a directory's as ``NAME.failed``) and gets the others back: an error about
            how samples combine or where they go (they cannot be stacked, ``collate_fn``, shared or
            device memory too small), or an unreachable store, sets no file aside, so a run with the
            fix delivers them all.
        shuffle: Draw a new order each epoch from ``(seed, epoch)``; finite sources only.
        seed: The seed of the shuffled order, the same on every rank.
        storage_options: fsspec options (credentials, endpoint) for the buckets this dataset names.
        trusted_roots: Directories and ``proto://bucket/prefix`` URLs that handles read from the
            network may name, added to the source's own.
        device: Deliver batches on this device (``"cuda"``, ``"cuda:1"``, a ``torch.device``); None:
            on the host, in shared memory. Each batch's tensors are views of one device buffer:
            keeping any of them keeps the whole batch there (``.clone()`` what you keep).

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

    batch_size: int | None  # the options: read-only properties (``_option``, below the class)
    drop_last: bool
    collate_fn: Callable[[list[Any]], Any] | None
    slots_per_worker: int
    max_rings_per_worker: int
    max_shm_bytes: int | None
    on_error: str
    shuffle: bool
    seed: int

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
        opts = take(DatasetOptions, locals())  # checks them
        self.device = _device.normalize(device)  # None, or a device this process copies samples to
        roots = _trust.roots(trusted_roots)  # raises ValueError naming trusted_roots
        self.source = src = as_source(source, roots)
        if storage_options is not None:
            _configure_buckets(src, roots, storage_options)
        self._object_stores = _objects.snapshot()  # reaches the DataLoader workers with the dataset
        if isinstance(src, DirectorySource):
            src.check_start()  # once, here: an ended stream is refused before any worker starts
        if shuffle and not src.finite:
            raise ValueError("shuffle=True needs a finite source (a list of handles); a stream comes in its own order")
        self._dist: tuple[int, int] | None = None
        self._owner = os.getpid()
        self._reader = Reader(opts, self.device)
        self._finite = Finite(src, self._reader) if isinstance(src, ListSource) else None
        self._stream = None if isinstance(src, ListSource) else Stream(src, self._reader)

    def _own(self) -> None:
        """Called where this process uses the dataset as a trainer (not in a DataLoader worker): a copy that
        reached another process that way (a DDP rank) takes its own counters and process group, so that
        ranks sharing one pickled dataset never write each other's slots."""
        new = self._owner != os.getpid() and get_worker_info() is None
        if new:
            self._owner, self._dist = os.getpid(), None
        self._reader.own(new)
        if self._finite is not None:
            self._finite.own(new)

    def __getstate__(self) -> dict[str, Any]:
        self._own()
        stores = {**self._object_stores, **_objects.snapshot()}  # as configured now
        return {**self.__dict__, "_object_stores": stores, "_dist": _where(self._dist)}  # a spawned worker has no group

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
        if self._finite is not None:
            self._finite.set_epoch(epoch)

    def __bool__(self) -> bool:
        return True  # as before it had a length: ``if dataset:`` must not raise for a stream

    def __len__(self) -> int:
        """Items (samples, or batches with ``batch_size``) this rank yields per epoch; finite sources only."""
        if self._finite is None:
            raise TypeError(
                f"a StorageDataset over a {type(self.source).__name__} has no length: "
                "it streams until its producers end it"
            )
        self._own()
        return self._finite.source.items_per_rank(_where(self._dist)[1], self.batch_size or 1, self.drop_last)

    def state_dict(self) -> dict[str, int]:
        """Progress through the current epoch: for resuming a finite source mid-epoch.

        Called in each worker by ``torchdata.stateful_dataloader.StatefulDataLoader`` (and in the
        trainer with ``num_workers=0``); resume with the same ``num_workers`` and world size.

        Returns:
            ``{"epoch": ..., "yielded": ...}``: the epoch, and how many items this copy yielded in it.
        """
        fin = self._finite
        return {"epoch": fin.epoch, "yielded": fin.yielded} if fin is not None else {"epoch": 0, "yielded": 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume a finite source where ``state_dict`` was taken: the next iteration skips what was yielded.

        Args:
            state: What ``state_dict`` returned.

        Raises:
            TypeError: The source is a stream, which cannot resume.
        """
        if self._finite is None:
            raise TypeError("only a finite source (a list of handles) can resume from a state_dict")
        self._finite.resume = (int(state["epoch"]), int(state["yielded"]))

    def stats(self) -> dict[str, int]:
        """Counts of what reached this process: loads, bytes, slot_loads, fallbacks, regrows, skipped.

        ``skipped`` (handles that failed to load under ``on_error="skip"``, one per file, batched or
        not) and ``refused`` (entries the source refused) include those of this process's DataLoader
        workers, persistent or not, whatever the source. ``padded``: handles this rank repeats each
        epoch so that all ranks yield as many items.

        Returns:
            The counts by name (``loads``, ``bytes``, ``skipped``, ``refused``, ``padded``, ...).
        """
        self._own()
        padded = self._finite.source.padded(*_where(self._dist), self.drop_last) if self._finite is not None else 0
        refused = self._stream.unsent_refusals() if self._stream is not None else 0
        return self._reader.stats(refused) | {"padded": padded}

    def __iter__(self) -> Iterator[Any]:
        worker = get_worker_info()
        if worker is not None:
            _objects.apply(self._object_stores, overwrite=False)  # a forked worker's own is as new
            _objects.use_obstore_here()
        wid, num_workers = (worker.id, worker.num_workers) if worker is not None else (0, 0)
        self._own()
        self._reader.wid = wid
        rank, world = _where(self._dist)
        if self._stream is not None:
            return self._stream.iterate(rank, world, wid, num_workers, str(self._owner))
        assert self._finite is not None  # one of the two
        return self._finite.iterate(rank, world, wid, num_workers)

    def _tsl_delivery_source(self) -> Any:
        """For ``hooks``: the streaming source whose handles DataLoader workers report to a ledger (None: finite)."""
        return None if self.source.finite else self.source

    def _tsl_attach_ledger(self, ref: LedgerRef | None) -> None:
        """For ``hooks``: the ledger the workers a DataLoader is starting write to (None once started)."""
        if self._stream is not None:
            self._stream.ledger = ref


def _option(name: str) -> property:
    """A read-only option, over the reader's one copy (which iteration reads): an assignment would
    change ``len()`` and the hooks' checks, but not what is read."""

    def refuse(self: StorageDataset, value: object) -> None:
        raise AttributeError(
            f"StorageDataset.{name} is fixed when the dataset is made: make a new StorageDataset(..., {name}={value!r})"
        )

    return property(operator.attrgetter(f"_reader.opts.{name}"), refuse)


for _name in StorageDataset.__annotations__:  # the options declared at the class's top
    setattr(StorageDataset, _name, _option(_name))
