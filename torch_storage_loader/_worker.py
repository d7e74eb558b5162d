"""What a loader worker does: turn a Storage handle into a filled slot (or, failing that, bytes).

Shared by ``StorageLoader``'s processes and ``StorageDataset``'s DataLoader workers.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable

from . import _format
from ._format import ALIGN, Header, ReadOptions
from ._batch import file_iovecs, plan
from ._shm import ShmSegment
from ._slots import CTRL, BytesRef, OneOffRef, SlotRef, SlotRing
from .storage import FileStorage, Storage

__all__ = ["FillInfo", "LocalFiller", "SlotFiller"]

GROWTH = 1.25


@dataclass(frozen=True)
class FillInfo:
    """What the worker did, for stats: ``via`` is "slot" or "fallback"."""

    via: str
    nbytes: int
    regrew: bool = False


class SlotFiller:
    """A worker's rings of slots, sized from a hint (the first sample).

    When every slot is leased (the consumer keeps what it got), another ring of the same size is
    added, up to ``max_rings``; past that, a sample gets a segment of its own (a fallback). A
    sample larger than a slot replaces the rings by one with larger slots.

    ``fill`` / ``fill_batch`` return ``(FillInfo, payload)``: the payload is a small picklable
    reference that unpickles, in the receiving process, into the sample backed by shared memory.
    """

    def __init__(self, n_slots: int, slot_size_hint: int = 0, *, as_tensors: bool = False,
                 max_rings: int = 8, budget: int | None = None) -> None:
        self.n_slots = n_slots
        self.budget = budget
        self.as_tensors = as_tensors
        self.hint = slot_size_hint
        self.max_rings = max_rings
        self.rings: list[SlotRing] = []
        self._retired: list[str] = []
        self._scratch = memoryview(bytearray(ALIGN))

    # ----------------------------------------------------------------------- where bytes go
    def _acquire(self, nbytes: int) -> tuple[SlotRing | None, tuple[int, int] | None, bool]:
        grew = False
        if not self.rings or nbytes > self.rings[0].slot_size:
            regrow = bool(self.rings)
            for ring in self.rings:
                self._retired.append(ring.uid)
                ring.close()
            size = int(nbytes * GROWTH) if regrow else max(nbytes, self.hint)
            self.rings = [SlotRing(self.n_slots, size)]
            grew = regrow
        for ring in self.rings:
            slot = ring.acquire()
            if slot is not None:
                return ring, slot, grew
        if len(self.rings) < self.max_rings:
            self.rings.append(SlotRing(self.n_slots, self.rings[0].slot_size))
            return self.rings[-1], self.rings[-1].acquire(), True
        return None, None, grew

    def _target(self, nbytes: int, path: str, opts: ReadOptions) -> tuple[memoryview, Callable, FillInfo, Callable]:
        """A writable view of ``nbytes``, a function turning its header into the payload, stats,
        and a function that gives the target back if filling it fails."""
        if not nbytes:
            return (memoryview(bytearray()), lambda h: BytesRef(h, bytearray(), path, opts), FillInfo("slot", 0),
                    _nothing)
        ring, slot, grew = self._acquire(nbytes)
        if ring is None:
            segment = ShmSegment(nbytes, purpose="a fallback segment (every slot is still leased)")
            return (memoryview(segment.mm)[:nbytes], lambda h: OneOffRef(h, segment, path, opts),
                    FillInfo("fallback", nbytes, grew), segment.close)

        def payload(header: Header) -> SlotRef:
            ref = SlotRef(ring.uid, slot[0], slot[1], ring.slot_size, header, path, opts,
                          segment=None if ring.sent else ring.segment, retired=tuple(self._retired))
            ring.sent = True
            self._retired.clear()
            return ref

        return ring.view(slot[0], nbytes), payload, FillInfo("slot", nbytes, grew), lambda: ring.unacquire(slot[0])

    # ------------------------------------------------------------------------- single samples
    def fill(self, storage: Storage) -> tuple[FillInfo, Any]:
        """Load ``storage`` into a slot."""
        opts = ReadOptions(getattr(storage, "allow_pickle", False), self.as_tensors)
        if _is_plain_file(storage):
            return self._fill_file(storage.path, opts)
        return self.fill_object(storage.load(), opts=opts, path=repr(storage))

    def _fill_file(self, path: str, opts: ReadOptions) -> tuple[FillInfo, Any]:
        fd = _format.open_storage(path)
        try:
            header = _format.read_header(fd, path)
            view, payload, info, abandon = self._target(header.data_size, path, opts)
            _read(fd, [view], header.data_offset, path, abandon)
            del view
        finally:
            os.close(fd)
        return info, payload(header)

    def fill_object(self, obj: Any, *, opts: ReadOptions, path: str) -> tuple[FillInfo, Any]:
        """Copy an in-memory sample into a slot (Storage types that are not files, collated batches)."""
        from ._tree import encode

        spec, leaves = encode(obj, allow_pickle=opts.allow_pickle)
        arrays, size = _format.layout(leaves)
        header = Header(spec, arrays, 0, size)
        view, payload, info, _ = self._target(size, path, opts)
        for leaf, e in zip(leaves, arrays):
            view[e.offset: e.offset + e.nbytes] = leaf.data
        del view
        return info, payload(header)

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
                batch = plan(headers, names)
                view, payload, info, abandon = self._target(batch.data_size, names[0], opts)
                for j, (fd, h, s) in enumerate(zip(fds, headers, storages)):
                    _read(fd, file_iovecs(h, batch, j, view, self._scratch), h.data_offset, s.path, abandon)
                del view
            finally:
                for fd in fds:
                    os.close(fd)
            return info, payload(batch)
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
        view, payload, info, _ = self._target(batch.data_size, names[0], opts)
        for j, (_, leaves) in enumerate(encoded):
            for leaf, b in zip(leaves, batch.arrays):
                start = b.offset + j * leaf.nbytes
                view[start: start + leaf.nbytes] = leaf.data
        del view
        return info, payload(batch)

    def materialize_here(self, payload: Any) -> Any:
        """Build ``payload`` in this process (the worker's), as if it had been sent and received.

        For a DataLoader that collates in its workers: the slot stays leased until the collated
        copy no longer needs the views.
        """
        from ._tree import build

        if isinstance(payload, SlotRef):
            ring = next((r for r in self.rings if r.uid == payload.ring_uid), None)
            if ring is None:
                raise RuntimeError("the slot's ring was replaced before the sample was used")
            if payload.segment is not None:
                ring.sent = False  # the receiver never saw it: send it with the next reference
            self._retired.extend(payload.retired)
            anchor = (ctypes.c_ubyte * payload.header.data_size).from_buffer(
                ring.segment.mm, CTRL + payload.slot * ring.slot_size)
            weakref.finalize(anchor, ring.release, payload.slot, payload.generation)
            return build(payload.header, anchor, payload.opts, path=payload.path)
        if isinstance(payload, OneOffRef):
            anchor = (ctypes.c_ubyte * payload.header.data_size).from_buffer(payload.segment.mm)
            return build(payload.header, anchor, payload.opts, path=payload.path)
        return build(payload.header, payload.data, payload.opts, path=payload.path)

    @staticmethod
    def sent(payload: Any) -> None:
        """Call once ``payload`` is pickled: a fallback segment is the receiver's from then on."""
        if isinstance(payload, OneOffRef):
            payload.segment.close()

    def close(self) -> None:
        for ring in self.rings:
            ring.close()
        self.rings = []


def _nothing() -> None:
    pass


def _read(fd: int, views: list, offset: int, path: str, abandon: Callable) -> None:
    try:
        _format.preadv_into(fd, views, offset, path)
    except BaseException:
        views.clear()
        abandon()  # the slot or segment is not delivered: give it back
        raise


def _is_plain_file(storage: Storage) -> bool:
    return isinstance(storage, FileStorage) and type(storage).load is FileStorage.load


class LocalFiller(SlotFiller):
    """The same work in the consuming process itself (``num_workers=0``): private buffers, no slots."""

    def _target(self, nbytes: int, path: str, opts: ReadOptions) -> tuple[memoryview, Callable, FillInfo, Callable]:
        from ._tree import build

        buf = mmap.mmap(-1, nbytes) if nbytes else bytearray()
        return memoryview(buf), lambda h: build(h, buf, opts, path=path), FillInfo("local", nbytes), _nothing
