"""Rings of shared-memory slots, and the small references that stand for a filled slot.

A worker owns its rings: it creates them, fills a free slot, and sends a ``SlotRef`` (ring id,
slot, generation, header). Unpickling a ``SlotRef`` in the receiving process maps the ring (its
descriptor travels with the first reference only) and returns the sample as views onto the slot.
The slot stays leased until every view is gone; then the receiver marks it free in the ring's
control block, which the worker reads before reusing it. No array bytes cross a pipe.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

from ._format import Header, ReadOptions
from ._shm import ShmSegment

__all__ = ["BytesRef", "CTRL", "OneOffRef", "SlotRef", "SlotRing", "page_round", "retire_rings"]

PAGE = mmap.PAGESIZE
CTRL = 4096  # control block: one int64 state word per slot (0 = free, else the lease generation)
MAX_SLOTS = CTRL // 8


def page_round(n: int) -> int:
    return max(PAGE, -(-n // PAGE) * PAGE)


class SlotRing:
    """Worker side: ``n_slots`` slots of ``slot_size`` bytes in one segment."""

    def __init__(self, n_slots: int, slot_size: int, *, purpose: str = "a shared-memory slot ring") -> None:
        if not 1 <= n_slots <= MAX_SLOTS:
            raise ValueError(f"{n_slots=} must be between 1 and {MAX_SLOTS}")
        self.uid = uuid.uuid4().hex
        self.n_slots = n_slots
        self.slot_size = page_round(slot_size)
        self.segment = ShmSegment(CTRL + n_slots * self.slot_size, purpose=purpose)
        self._states = memoryview(self.segment.mm)[:CTRL].cast("q")
        self._next = 0
        self._generation = 0
        self.sent = False

    def acquire(self) -> tuple[int, int] | None:
        """A free slot and its new generation, or None when every slot is still leased."""
        for k in range(self.n_slots):
            i = (self._next + k) % self.n_slots
            if self._states[i] == 0:
                self._generation += 1
                self._states[i] = self._generation
                self._next = i + 1
                return i, self._generation
        return None

    def unacquire(self, slot: int) -> None:
        self._states[slot] = 0

    def release(self, slot: int, generation: int) -> None:
        """Free ``slot`` if it still holds ``generation`` (a lease dropped in this process)."""
        try:
            if self._states[slot] == generation:
                self._states[slot] = 0
        except ValueError:
            pass  # the ring was closed (regrown) meanwhile: nobody reuses its slots

    def free_slots(self) -> int:
        return sum(1 for i in range(self.n_slots) if self._states[i] == 0)

    def view(self, slot: int, nbytes: int) -> memoryview:
        start = CTRL + slot * self.slot_size
        return memoryview(self.segment.mm)[start: start + nbytes]

    def close(self) -> None:
        self._states.release()
        self.segment.close()


class _MappedRing:
    """Receiver side: one mapping of a worker's ring; freed when retired and no lease is left."""

    def __init__(self, segment: ShmSegment, slot_size: int, owner_pid: int) -> None:
        self.mm = segment.mm
        self.slot_size = slot_size
        self.owner_pid = owner_pid
        self.states = memoryview(self.mm)[:CTRL].cast("q")

    def release(self, slot: int, generation: int) -> None:
        if self.states[slot] == generation:
            self.states[slot] = 0


_rings: dict[str, _MappedRing] = {}
_rings_lock = threading.Lock()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def retire_rings(owner_pid: int | None = None, *, dead_only: bool = False) -> None:
    """Forget mapped rings (of one worker, or all); leased slots keep their memory until dropped."""
    with _rings_lock:
        for uid, ring in list(_rings.items()):
            if owner_pid is not None and ring.owner_pid != owner_pid:
                continue
            if dead_only and _pid_alive(ring.owner_pid):
                continue
            del _rings[uid]


def mapped_ring_count() -> int:
    with _rings_lock:
        return len(_rings)


@dataclass
class SlotRef:
    """Stands for a filled slot; unpickles (in the receiver) into the sample itself."""

    ring_uid: str
    slot: int
    generation: int
    slot_size: int
    header: Header
    path: str
    opts: ReadOptions
    segment: ShmSegment | None = None
    retired: tuple[str, ...] = ()

    def __reduce__(self):
        return _receive_slot, (self.ring_uid, self.slot, self.generation, self.slot_size, self.header,
                               self.path, self.opts, self.segment, self.retired, os.getpid())


def _receive_slot(ring_uid, slot, generation, slot_size, header, path, opts, segment, retired, pid):
    from ._tree import build

    if segment is not None:
        retire_rings(dead_only=True)  # rings of workers that are gone (earlier epochs, restarts)
    with _rings_lock:
        for uid in retired:
            _rings.pop(uid, None)
        if segment is not None:
            _rings[ring_uid] = _MappedRing(segment, slot_size, pid)
        ring = _rings.get(ring_uid)
    if ring is None:
        raise RuntimeError(f"shared-memory ring {ring_uid} of worker {pid} is not mapped in this process; "
                           "a reference was delivered to a process other than the loader's")
    # The lease anchor must be the buffer *exporter*: consumers (numpy, torch) keep a reference to
    # the exporter, while intermediate memoryviews may be dropped early.
    anchor = (ctypes.c_ubyte * header.data_size).from_buffer(ring.mm, CTRL + slot * ring.slot_size)
    weakref.finalize(anchor, ring.release, slot, generation)
    return build(header, anchor, opts, path=path)


@dataclass
class BytesRef:
    """The slow path: the data section travels through the pipe (no free slot, or no ring)."""

    header: Header
    data: bytearray
    path: str
    opts: ReadOptions

    def __reduce__(self):
        return _receive_bytes, (self.header, self.data, self.path, self.opts)


def _receive_bytes(header: Header, data: bytearray, path: str, opts: ReadOptions) -> Any:
    from ._tree import build

    return build(header, data, opts, path=path)


@dataclass
class OneOffRef:
    """The fallback when every slot is leased: a segment of its own, owned by the receiver.

    Slower than a slot (fresh pages fault in), but no array bytes cross a pipe, and the memory
    is freed when the receiver drops the last view.
    """

    header: Header
    segment: ShmSegment
    path: str
    opts: ReadOptions

    def __reduce__(self):
        return _receive_oneoff, (self.header, self.segment, self.path, self.opts)


def _receive_oneoff(header: Header, segment: ShmSegment, path: str, opts: ReadOptions) -> Any:
    from ._tree import build

    anchor = (ctypes.c_ubyte * header.data_size).from_buffer(segment.mm)
    return build(header, anchor, opts, path=path)
