"""What a loader worker does: turn Storage handles into filled leases (see ``alloc``).

Shared by ``StorageLoader``'s processes and ``StorageDataset``'s DataLoader workers.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from collections.abc import Callable
from typing import Any

from .._format import file as _format
from .._format.batch import file_iovecs, plan
from .._format.file import ALIGN, Header, ReadOptions
from .._stores import objects as _objects
from ..errors import StorageCorruptError
from ..storage import FileStorage, ObjectStorage, Storage
from .alloc import FillInfo, Lease, PrivateAllocator, SlotAllocator
from .refs import OneOffRef, SlotRef
from .slots import CTRL

__all__ = ["FillInfo", "LocalFiller", "SlotFiller", "is_plain_file"]


class SlotFiller:
    """Reads samples (or stacks batches) into a worker's shared-memory slots.

    Size: about 260 lines, because the fast paths (one ``preadv`` per file of the last file's
    size, one per sample of a batch) and the general path share the layout state they keep.

    ``fill`` / ``fill_batch`` return ``(FillInfo, payload)``: the payload is a small picklable
    reference that unpickles, in the receiving process, into the sample backed by shared memory.
    ``budget`` bounds this worker's shared memory (default: half of the shm filesystem);
    ``watch``: receivers forget this process's rings when it exits (DataLoader workers);
    ``device``: receivers copy each sample to that device (see ``_device``).
    """

    def __init__(
        self,
        n_slots: int,
        *,
        as_tensors: bool = False,
        max_rings: int = 8,
        budget: int | None = None,
        watch: bool = False,
        device: str | None = None,
    ) -> None:
        self.as_tensors = as_tensors
        self.device = device
        self.alloc: SlotAllocator | PrivateAllocator = SlotAllocator(
            n_slots, max_rings=max_rings, budget=budget, watch=watch
        )
        self._init_reader()

    def _init_reader(self) -> None:
        self._scratch = memoryview(bytearray(ALIGN))  # padding between arrays, read and dropped
        self._head_buf = memoryview(bytearray(4096))
        self._layout: _Layout | None = None  # the last file's layout: the next is read as if it had it
        self._batches: dict[int, tuple[Header, bool]] = {}  # batch size -> stacked header, and whether
        # its spec is that of samples with the layout's header exactly (no inline values that vary)
        self._misses = self._skip = 0

    # ------------------------------------------------------------------------- single samples
    def fill(self, storage: Storage) -> tuple[FillInfo, Any]:
        """Load ``storage`` into a slot."""
        opts = ReadOptions(getattr(storage, "allow_pickle", False), self.as_tensors, self.device)
        if is_plain_file(storage):
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
            layout = self._guess()
            if layout is not None and os.fstat(fd).st_size == layout.header.file_size:
                lease = self.alloc.lease(layout.header.data_size, path, opts)
                header = self._read_as(layout, fd, [lease.view], path, lease)
                if header is not None:
                    _check(header, opts, path, lease)
                    return lease.info, lease.commit(header)
            header = _format.read_header(fd, path)
            _format.check_readable(header, opts, path)
            lease = self.alloc.lease(header.data_size, path, opts)
            _read(fd, [lease.view], header.data_offset, path, lease)
            self._layout = _Layout.of(fd, header)
        finally:
            os.close(fd)
        return lease.info, lease.commit(header)

    def _read_as(
        self, layout: _Layout, fd: int, views: list, path: str, lease: Lease, same_arrays: tuple | None = None
    ) -> Header | None:
        """Read a file of ``layout``'s size as if it had ``layout``: its header into scratch memory
        and its data section into ``views``, in one ``preadv``.

        Returns the file's header, or None if it has another layout (``lease`` is then given back,
        and the caller reads the file the long way). A header with the same bytes as ``layout``'s is
        ``layout``'s, validated when first read; another one is validated here (``parse_header``),
        and the data already read is kept if its data section starts where ``layout``'s does (and,
        with ``same_arrays``, for views scattering each array to its place, if its arrays are those).
        """
        h = layout.header
        head = self._head(h.data_offset)
        try:
            got = _format.preadv_upto(fd, [head, *views], 0)
        except BaseException:
            views.clear()
            lease.abort()
            raise
        finally:
            for v in views:
                v.release()
        if got == h.file_size:
            if head == layout.head:
                self._misses = 0
                return h
            header = self._parse(head, path, got)
            if (
                header is not None
                and header.data_offset == h.data_offset
                and (same_arrays is None or header.arrays == same_arrays)
            ):
                self._misses = 0
                return header  # the data is where it belongs (a batch: each array at its place)
        lease.abort()
        self._misses += 1
        if self._misses >= _MAX_MISSES:  # layouts keep changing: read headers first for a while
            self._misses, self._skip = 0, _SKIP_AFTER_MISSES
        return None

    def _guess(self) -> _Layout | None:
        if self._skip:
            self._skip -= 1
            return None
        return self._layout

    def _head(self, n: int) -> memoryview:
        if len(self._head_buf) < n:
            self._head_buf = memoryview(bytearray(max(n, 2 * len(self._head_buf))))
        return self._head_buf[:n]

    @staticmethod
    def _parse(head: memoryview, path: str, file_size: int) -> Header | None:
        """The header in ``head`` if it is whole and valid for a file of ``file_size`` bytes, else None.

        ``parse_header`` keeps the headers it parsed by their text: a repeated one costs a lookup."""
        try:
            header = _format.parse_header(head, path, file_size)  # a header longer than ``head`` raises too
        except StorageCorruptError:
            return None  # read again the long way, which raises it with the whole file in view
        return header if header.data_offset == len(head) else None

    def fill_object(self, obj: Any, *, opts: ReadOptions, path: str) -> tuple[FillInfo, Any]:
        """Copy an in-memory sample into a slot (Storage types that are not files, collated batches)."""
        from .._format.tree import encode

        spec, leaves = encode(obj, allow_pickle=opts.allow_pickle)
        arrays, size = _format.layout(leaves)
        header = Header(spec, arrays, 0, size)
        lease = self.alloc.lease(size, path, opts)
        try:
            for leaf, e in zip(leaves, arrays):
                lease.view[e.offset : e.offset + e.nbytes] = leaf.data
        except BaseException:
            lease.abort()
            raise
        return lease.info, lease.commit(header)

    # -------------------------------------------------------------------------------- batches
    def fill_batch(self, storages: list[Storage], collate_fn: Callable | None = None) -> tuple[FillInfo, Any]:
        """Stack samples into one slot (leaves gain a leading batch dimension), or collate them."""
        opts = ReadOptions(any(getattr(s, "allow_pickle", False) for s in storages), self.as_tensors, self.device)
        if collate_fn is None and all(is_plain_file(s) for s in storages):
            fds = []
            try:
                for s in storages:
                    fds.append(_format.open_storage(s.path))
                done = self._stack_as_last(storages, fds, opts)
                if done is not None:
                    return done
                names = [repr(s) for s in storages]
                headers = [_format.read_header(fd, s.path) for fd, s in zip(fds, storages)]
                for h, s in zip(headers, storages):
                    _format.check_readable(h, opts, s.path)
                batch = plan(headers, names)
                lease = self.alloc.lease(batch.data_size, names[0], opts)
                for j, (fd, h, s) in enumerate(zip(fds, headers, storages)):
                    _read(fd, _iovecs(h, batch, j, lease, self._scratch), h.data_offset, s.path, lease)
                first = headers[0]
                if all(h.arrays == first.arrays and h.data_offset == first.data_offset for h in headers):
                    self._layout = _Layout.of(fds[0], first)
                    self._batches = {len(headers): (batch, all(h == first for h in headers))}
            finally:
                for fd in fds:
                    os.close(fd)
            return lease.info, lease.commit(batch)
        from .._format.tree import to_tensors

        names = [repr(s) for s in storages]

        samples = [s.load() for s in storages]
        if collate_fn is not None:
            return self.fill_object(collate_fn([to_tensors(x) for x in samples]), opts=opts, path=names[0])
        return self._stack_objects(samples, names, opts)

    def _stack_as_last(self, storages: list, fds: list[int], opts: ReadOptions) -> tuple[FillInfo, Any] | None:
        """Stack files that have the layout of the last batch's samples, each read in one ``preadv``
        (see ``_read_as``); None if one of them has another (nothing delivered, nothing held)."""
        layout, k = self._guess(), len(storages)
        cached = self._batches.get(k) if layout is not None else None
        if cached is None:
            return None
        batch, exact = cached
        if any(os.fstat(fd).st_size != layout.header.file_size for fd in fds):
            return None
        lease = self.alloc.lease(batch.data_size, repr(storages[0]), opts)
        headers = []
        for j, (fd, s) in enumerate(zip(fds, storages)):
            views = file_iovecs(layout.header, batch, j, lease.view, self._scratch)
            tail = layout.header.data_size - sum(len(v) for v in views)  # the padding after the last array
            if tail:
                views.append(self._scratch[:tail])
            header = self._read_as(
                layout, fd, views, s.path, lease, layout.header.arrays
            )  # gives the lease back if not
            if header is None:
                return None
            _check(header, opts, s.path, lease)
            headers.append(header)
        if not exact or any(h is not layout.header for h in headers):  # inline values differ: the spec too
            try:
                batch = plan(headers, [repr(s) for s in storages])
            except BaseException:
                lease.abort()  # the arrays matched, the trees do not: the slot is not delivered
                raise
        return lease.info, lease.commit(batch)

    def _stack_objects(self, samples: list, names: list[str], opts: ReadOptions) -> tuple[FillInfo, Any]:
        from .._format.tree import encode

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
                    lease.view[start : start + leaf.nbytes] = leaf.data
        except BaseException:
            lease.abort()
            raise
        return lease.info, lease.commit(batch)

    def materialize_here(self, payload: Any) -> Any:
        """Build ``payload`` in this process (the worker's), as if it had been sent and received.

        For a DataLoader that collates in its workers: the slot stays leased until the collated
        copy no longer needs the views.
        """
        from .._format.tree import build

        if isinstance(payload, SlotRef):
            ring = self.alloc.find(payload.ring_uid)
            if ring is None:
                raise RuntimeError(
                    f"ring {payload.ring_uid} is not this worker's; materialize_here takes payloads of this filler only"
                )
            if payload.segment is not None:
                ring.segment_sent = False  # the receiver never saw it: send it with the next reference
            ring.received_here()
            anchor = (ctypes.c_ubyte * payload.header.data_size).from_buffer(
                ring.segment.mm, CTRL + payload.slot * ring.slot_size
            )
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


_MAX_MISSES = 4  # files in a row whose layout was not the last one's: stop guessing ...
_SKIP_AFTER_MISSES = 64  # ... for this many reads


class _Layout:
    """A validated header and the exact bytes in front of its data section (padding included)."""

    __slots__ = ("head", "header")

    def __init__(self, head: bytes, header: Header) -> None:
        self.head, self.header = head, header

    @classmethod
    def of(cls, fd: int, header: Header) -> _Layout | None:
        head = os.pread(fd, header.data_offset, 0)
        return cls(head, header) if len(head) == header.data_offset else None


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


def _check(header: Header, opts: ReadOptions, path: str, lease: Lease) -> None:
    """``check_readable`` for a file already read into ``lease``, which is given back if it is refused."""
    try:
        _format.check_readable(header, opts, path)
    except BaseException:
        lease.abort()
        raise


def is_plain_file(storage: Storage) -> bool:
    """Whether ``storage`` is read as a file of this library's format (a FileStorage whose load is not overridden)."""
    return isinstance(storage, FileStorage) and type(storage).load is FileStorage.load


class LocalFiller(SlotFiller):
    """The same work in the consuming process itself (``num_workers=0``): private buffers, no slots."""

    def __init__(
        self,
        n_slots: int = 1,
        *,
        as_tensors: bool = False,
        device: str | None = None,
        budget: int | None = None,
        **_: Any,
    ) -> None:
        self.as_tensors = as_tensors
        self.device = device
        self.alloc = PrivateAllocator(budget)  # one sample's private memory (None: unbounded)
        self._init_reader()
