"""What a loader worker does: turn Storage handles into filled leases (see ``_alloc``).

Shared by ``StorageLoader``'s processes and ``StorageDataset``'s DataLoader workers.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from typing import Any, Callable

from . import _format, _objects
from ._alloc import FillInfo, Lease, PrivateAllocator, SlotAllocator
from ._format import ALIGN, Header, ReadOptions
from ._batch import file_iovecs, plan
from ._slots import CTRL, OneOffRef, SlotRef
from .storage import FileStorage, ObjectStorage, Storage

__all__ = ["FillInfo", "LocalFiller", "SlotFiller"]


class SlotFiller:
    """Reads samples (or stacks batches) into a worker's shared-memory slots.

    ``fill`` / ``fill_batch`` return ``(FillInfo, payload)``: the payload is a small picklable
    reference that unpickles, in the receiving process, into the sample backed by shared memory.
    ``budget`` bounds this worker's shared memory (default: half of the shm filesystem);
    ``watch``: receivers forget this process's rings when it exits (DataLoader workers).
    """

    def __init__(self, n_slots: int, slot_size_hint: int = 0, *, as_tensors: bool = False,
                 max_rings: int = 8, budget: int | None = None, watch: bool = False) -> None:
        self.as_tensors = as_tensors
        self.alloc: SlotAllocator | PrivateAllocator = SlotAllocator(
            n_slots, slot_size_hint, max_rings=max_rings, budget=budget, watch=watch)
        self._scratch = memoryview(bytearray(ALIGN))

    # ------------------------------------------------------------------------- single samples
    def fill(self, storage: Storage) -> tuple[FillInfo, Any]:
        """Load ``storage`` into a slot."""
        opts = ReadOptions(getattr(storage, "allow_pickle", False), self.as_tensors)
        if _is_plain_file(storage):
            return self._fill_file(storage.path, opts)
        if type(storage) is ObjectStorage:
            return self._fill_remote(storage, opts)
        return self.fill_object(storage.load(), opts=opts, path=repr(storage))

    def _fill_remote(self, storage: ObjectStorage, opts: ReadOptions) -> tuple[FillInfo, Any]:
        # Ranged reads land in the slot: the client's buffers are the only copy on the way.
        header, head = _objects.read_header(storage.path, storage.size, storage.version)
        _format.check_readable(header, opts, storage.path)
        lease = self.alloc.lease(header.data_size, storage.path, opts)
        try:
            _objects.read_into(storage.path, lease.view, header.data_offset, storage.version, head)
        except BaseException:
            lease.abort()
            raise
        return lease.info, lease.commit(header)

    def _fill_file(self, path: str, opts: ReadOptions) -> tuple[FillInfo, Any]:
        fd = _format.open_storage(path)
        try:
            header = _format.read_header(fd, path)
            _format.check_readable(header, opts, path)
            lease = self.alloc.lease(header.data_size, path, opts)
            _read(fd, [lease.view], header.data_offset, path, lease)
        finally:
            os.close(fd)
        return lease.info, lease.commit(header)

    def fill_object(self, obj: Any, *, opts: ReadOptions, path: str) -> tuple[FillInfo, Any]:
        """Copy an in-memory sample into a slot (Storage types that are not files, collated batches)."""
        from ._tree import encode

        spec, leaves = encode(obj, allow_pickle=opts.allow_pickle)
        arrays, size = _format.layout(leaves)
        header = Header(spec, arrays, 0, size)
        lease = self.alloc.lease(size, path, opts)
        try:
            for leaf, e in zip(leaves, arrays):
                lease.view[e.offset: e.offset + e.nbytes] = leaf.data
        except BaseException:
            lease.abort()
            raise
        return lease.info, lease.commit(header)

    # -------------------------------------------------------------------------------- batches
    def fill_batch(self, storages: list[Storage], collate_fn: Callable | None = None) -> tuple[FillInfo, Any]:
        """Stack samples into one slot (leaves gain a leading batch dimension), or collate them."""
        opts = ReadOptions(any(getattr(s, "allow_pickle", False) for s in storages), self.as_tensors)
        names = [repr(s) for s in storages]
        if collate_fn is None and all(_is_plain_file(s) for s in storages):
            fds = []
            try:
                headers = []
                for s in storages:
                    fds.append(_format.open_storage(s.path))
                    headers.append(_format.read_header(fds[-1], s.path))
                    _format.check_readable(headers[-1], opts, s.path)
                batch = plan(headers, names)
                lease = self.alloc.lease(batch.data_size, names[0], opts)
                for j, (fd, h, s) in enumerate(zip(fds, headers, storages)):
                    _read(fd, _iovecs(h, batch, j, lease, self._scratch), h.data_offset, s.path, lease)
            finally:
                for fd in fds:
                    os.close(fd)
            return lease.info, lease.commit(batch)
        from ._tree import to_tensors

        samples = [s.load() for s in storages]
        if collate_fn is not None:
            return self.fill_object(collate_fn([to_tensors(x) for x in samples]), opts=opts, path=names[0])
        return self._stack_objects(samples, names, opts)

    def _stack_objects(self, samples: list, names: list[str], opts: ReadOptions) -> tuple[FillInfo, Any]:
        from ._tree import encode

        encoded = [encode(x, allow_pickle=opts.allow_pickle) for x in samples]
        headers = []
        for spec, leaves in encoded:
            arrays, size = _format.layout(leaves)
            headers.append(Header(spec, arrays, 0, size))
        batch = plan(headers, names)
        lease = self.alloc.lease(batch.data_size, names[0], opts)
        try:
            for j, (_, leaves) in enumerate(encoded):
                for leaf, b in zip(leaves, batch.arrays):
                    start = b.offset + j * leaf.nbytes
                    lease.view[start: start + leaf.nbytes] = leaf.data
        except BaseException:
            lease.abort()
            raise
        return lease.info, lease.commit(batch)

    def materialize_here(self, payload: Any) -> Any:
        """Build ``payload`` in this process (the worker's), as if it had been sent and received.

        For a DataLoader that collates in its workers: the slot stays leased until the collated
        copy no longer needs the views.
        """
        from ._tree import build

        if isinstance(payload, SlotRef):
            ring = self.alloc.find(payload.ring_uid)
            if ring is None:
                raise RuntimeError(f"ring {payload.ring_uid} is not this worker's; materialize_here takes "
                                   "payloads of this filler only")
            if payload.segment is not None:
                ring.segment_sent = False  # the receiver never saw it: send it with the next reference
            ring.received_here()
            anchor = (ctypes.c_ubyte * payload.header.data_size).from_buffer(
                ring.segment.mm, CTRL + payload.slot * ring.slot_size)
            weakref.finalize(anchor, _release_here, ring, payload.slot, payload.generation, os.getpid())
            return build(payload.header, anchor, payload.opts, path=payload.path)
        if isinstance(payload, OneOffRef):
            anchor = (ctypes.c_ubyte * payload.header.data_size).from_buffer(payload.segment.mm)
            return build(payload.header, anchor, payload.opts, path=payload.path)
        return build(payload.header, payload.data, payload.opts, path=payload.path)

    @staticmethod
    def sent(payload: Any) -> None:
        """Call once ``payload`` is pickled: a segment of its own is the receiver's from then on."""
        if isinstance(payload, OneOffRef):
            payload.segment.close()

    def close(self) -> None:
        self.alloc.close()


def _release_here(ring, slot: int, generation: int, pid: int) -> None:
    if os.getpid() == pid:
        ring.release(slot, generation)


def _read(fd: int, views: list, offset: int, path: str, lease: Lease) -> None:
    try:
        _format.preadv_into(fd, views, offset, path)
    except BaseException:
        views.clear()
        lease.abort()  # the slot or segment is not delivered: give it back
        raise
    finally:
        for v in views:
            v.release()


def _iovecs(sample: Header, batch: Header, j: int, lease: Lease, scratch: memoryview) -> list:
    """``file_iovecs`` into ``lease``, which is given back if they cannot be made."""
    try:
        return file_iovecs(sample, batch, j, lease.view, scratch)
    except BaseException:
        lease.abort()
        raise


def _is_plain_file(storage: Storage) -> bool:
    return isinstance(storage, FileStorage) and type(storage).load is FileStorage.load


class LocalFiller(SlotFiller):
    """The same work in the consuming process itself (``num_workers=0``): private buffers, no slots."""

    def __init__(self, n_slots: int = 1, slot_size_hint: int = 0, *, as_tensors: bool = False, **_: Any) -> None:
        self.as_tensors = as_tensors
        self.alloc = PrivateAllocator()
        self._scratch = memoryview(bytearray(ALIGN))
