"""What a loader worker does: turn a Storage handle into a filled slot (or, failing that, bytes).

Shared by ``StorageLoader``'s processes and ``StorageDataset``'s DataLoader workers.
"""

from __future__ import annotations

import os
import pickle
import signal
import traceback
from multiprocessing.reduction import ForkingPickler
from dataclasses import dataclass
from typing import Any

from . import _format
from ._format import ALIGN, ArrayEntry, Header, ReadOptions
from ._shm import ENV_DIR
from ._shm import ShmSegment
from ._slots import BytesRef, OneOffRef, SlotRef, SlotRing, page_round
from .storage import FileStorage, Storage

__all__ = ["FillInfo", "RemoteTraceback", "SlotFiller", "pack_exception", "run_worker", "unpack_exception"]

GROWTH = 1.25


@dataclass(frozen=True)
class FillInfo:
    """What the worker did, for stats: ``via`` is "slot" or "fallback"."""

    via: str
    nbytes: int
    regrew: bool = False


class SlotFiller:
    """A worker's ring, sized from a hint (the first sample) and regrown when a sample outgrows it."""

    def __init__(self, n_slots: int, slot_size_hint: int = 0, *, as_tensors: bool = False) -> None:
        self.n_slots = n_slots
        self.as_tensors = as_tensors
        self.hint = slot_size_hint
        self.ring: SlotRing | None = None
        self._retired: list[str] = []

    def _slot(self, nbytes: int) -> tuple[tuple[int, int] | None, bool]:
        regrew = False
        if self.ring is None or nbytes > self.ring.slot_size:
            if self.ring is not None:
                self._retired.append(self.ring.uid)
                self.ring.close()
                regrew = True
                size = int(nbytes * GROWTH)
            else:
                size = max(nbytes, self.hint)
            self.ring = SlotRing(self.n_slots, page_round(size))
        return self.ring.acquire(), regrew

    def _ref(self, slot: tuple[int, int], header: Header, path: str, opts: ReadOptions) -> SlotRef:
        ring = self.ring
        ref = SlotRef(ring.uid, slot[0], slot[1], ring.slot_size, header, path, opts,
                      segment=None if ring.sent else ring.segment, retired=tuple(self._retired))
        ring.sent = True
        self._retired.clear()
        return ref

    def fill(self, storage: Storage) -> tuple[FillInfo, Any]:
        """Load ``storage``; returns stats and a picklable payload that unpickles into the sample."""
        if isinstance(storage, FileStorage) and type(storage).load is FileStorage.load:
            return self._fill_file(storage.path, self._opts(storage))
        return self.fill_object(storage.load(), opts=self._opts(storage), path=repr(storage))

    def _opts(self, storage: Storage) -> ReadOptions:
        return ReadOptions(getattr(storage, "allow_pickle", False), self.as_tensors)

    def _fill_file(self, path: str, opts: ReadOptions) -> tuple[FillInfo, Any]:
        fd = _format.open_storage(path)
        try:
            header = _format.read_header(fd, path)
            size = header.data_size
            if not size:
                return FillInfo("slot", 0), BytesRef(header, bytearray(), path, opts)
            slot, regrew = self._slot(size)
            if slot is None:
                segment = ShmSegment(size, purpose="a fallback segment (every slot is still leased)")
                try:
                    _format.preadv_into(fd, [memoryview(segment.mm)[:size]], header.data_offset, path)
                except BaseException:
                    segment.close()
                    raise
                return FillInfo("fallback", size, regrew), OneOffRef(header, segment, path, opts)
            try:
                _format.preadv_into(fd, [self.ring.view(slot[0], size)], header.data_offset, path)
            except BaseException:
                self.ring.unacquire(slot[0])
                raise
            return FillInfo("slot", size, regrew), self._ref(slot, header, path, opts)
        finally:
            os.close(fd)

    def fill_object(self, obj: Any, *, opts: ReadOptions, path: str) -> tuple[FillInfo, Any]:
        """Copy an in-memory sample into a slot (for Storage types that are not files)."""
        from ._tree import encode

        spec, leaves = encode(obj, allow_pickle=opts)
        arrays, offset = [], 0
        for leaf in leaves:
            arrays.append(ArrayEntry(leaf.kind, leaf.dtype, leaf.shape, offset, leaf.nbytes))
            offset = -(-(offset + leaf.nbytes) // ALIGN) * ALIGN
        header = Header(spec, tuple(arrays), 0, offset)
        if not offset:
            return FillInfo("slot", 0), BytesRef(header, bytearray(), path, opts)
        slot, regrew = self._slot(offset)
        if slot is None:
            segment = ShmSegment(offset, purpose="a fallback segment (every slot is still leased)")
            view, payload = memoryview(segment.mm), OneOffRef(header, segment, path, opts)
            info = FillInfo("fallback", offset, regrew)
        else:
            view, payload = self.ring.view(slot[0], offset), self._ref(slot, header, path, opts)
            info = FillInfo("slot", offset, regrew)
        for leaf, e in zip(leaves, arrays):
            view[e.offset: e.offset + e.nbytes] = leaf.data
        return info, payload

    @staticmethod
    def sent(payload: Any) -> None:
        """Call once ``payload`` is pickled: a fallback segment is the receiver's from then on."""
        if isinstance(payload, OneOffRef):
            payload.segment.close()

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
            self.ring = None


class RemoteTraceback(Exception):
    """Carries a worker's formatted traceback; set as ``__cause__`` of the re-raised exception."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


def pack_exception(exc: BaseException) -> tuple[BaseException, str]:
    tb = "".join(traceback.format_exception(exc))
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        exc = RuntimeError(f"{type(exc).__qualname__}: {exc}")
    return exc, tb


def unpack_exception(exc: BaseException, tb: str) -> BaseException:
    exc.__cause__ = RemoteTraceback(f'\n"""\n{tb}"""')
    return exc


def run_worker(conn, n_slots: int, slot_size_hint: int, shm_directory: str) -> None:
    """A StorageLoader worker: serve ``(request_id, storage)`` until ``None`` or the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops us
    os.environ[ENV_DIR] = shm_directory
    filler = SlotFiller(n_slots, slot_size_hint)
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg is None:
                break
            request_id, storage = msg
            try:
                info, payload = filler.fill(storage)
                # Pickled here, unpickled apart from the envelope: a failure to map the slot in
                # the parent is then that request's error, not a broken pipe.
                reply = (request_id, info, bytes(ForkingPickler.dumps(payload)))
                filler.sent(payload)
                del payload
            except BaseException as exc:  # noqa: BLE001 - everything goes back to the caller
                reply = (request_id, None, pack_exception(exc))
            try:
                conn.send(reply)
            except (BrokenPipeError, OSError):
                break
    finally:
        filler.close()
        conn.close()
