"""Rings of shared-memory slots and their lifetimes (the references that stand for a filled slot: ``refs``).

A worker owns its rings: it creates them, fills a free slot, and sends a ``SlotRef`` (ring id,
slot, generation, header). Unpickling a ``SlotRef`` in the receiving process maps the ring (its
descriptor travels with the first reference only) and returns the sample as views onto the slot.
The slot stays leased until every view is gone; then the receiver marks it free in the ring's
control block, which the worker reads before reusing it. No array bytes cross a pipe.

Lifetimes. A ring's control block holds its identity (checked by every process that maps it), a
"retired" flag with the number of references the worker sent naming it, and the number the
receiver got. A worker retires a ring (when samples grow, shrink, or it stops) instead of closing
it; it unmaps it only once every reference it sent was received and every slot is free, and a
receiver forgets it under the same condition. So no reference can outlive its ring, and a kept
sample pins its own slot only: the free slots of a retired ring are given back to the kernel.
Receivers also forget the rings of a worker process that has exited (``watch=True`` references:
DataLoader workers, which nobody else supervises).

In a receiver that uses CUDA, each ring is page-locked in place once, so that its slots cross to
the GPU at link speed, and unregistered before it is unmapped; a slot of a pinned ring goes back to
its worker only once the GPU is past the work queued before its release. References whose options
name a ``device`` are received as samples on that device. That is the GPU path (``_gpu``), which
lies above this package: receiving reaches it through ``gpu``, which it sets when imported.
"""

from __future__ import annotations

import logging
import mmap
import os
import selectors
import threading
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .._proc import WakePipe, after_fork_in_child, pid_alive
from ..errors import ShmTransportError
from .segments import ShmSegment

__all__ = ["CTRL", "MAX_SLOTS", "GpuPath", "SlotRing", "gpu", "page_round", "retire_rings"]

logger = logging.getLogger("torch_storage_loader")

PAGE = mmap.PAGESIZE  # 4 KiB on x86-64; 16 or 64 KiB on many arm64 kernels (Grace Hopper among them)
_CTRL_WORDS = 512  # identity and lifetime words, then one int64 state word per slot
_UID, _RETIRED, _SENT, _RECEIVED, _STATES = 0, 2, 3, 4, 8  # word offsets (the uid takes two words)
MAX_SLOTS = _CTRL_WORDS - _STATES
# The control block fills whole pages, so that every slot starts on a page: madvise(MADV_REMOVE)
# and page-locking act on pages.
CTRL = max(PAGE, -(-_CTRL_WORDS * 8 // PAGE) * PAGE)
_REMOVE = getattr(mmap, "MADV_REMOVE", None)


class GpuPath(NamedTuple):
    """What receiving needs of the GPU path (``_gpu`` sets ``gpu`` when imported; dataset.py and
    loader.py import it, so every process that receives samples has it)."""

    pin: Callable[[Any], bool | None]  # a ring just mapped: True page-locked, False never, None ask later
    unpin: Callable[[Any], None]  # a pinned ring, before it is unmapped
    defer: Callable[..., None]  # (callback, event=None): run callback once event (None: one recorded now) completed
    deliver: Callable[..., Any]  # (plan, host, path, device, release): the sample on device, release() once read
    may_pin: Callable[[], bool]  # whether pin could register a ring now (cheap: asked for each reference)


def _no_device(plan: Any, host: Any, path: str, device: Any, release: Callable[[], None]) -> Any:
    release()
    raise RuntimeError("a sample for device= arrived before torch_storage_loader._gpu was imported")


# Until then: nothing is pinned, so nothing is deferred or delivered.
gpu = GpuPath(lambda ring: None, lambda ring: None, lambda callback, event=None: callback(), _no_device, lambda: False)


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
        self.segment.mm[:16] = bytes.fromhex(self.uid)
        self._words = memoryview(self.segment.mm)[:CTRL].cast("q")
        self._next = 0
        self._generation = 0
        self._trimmed: set[int] = set()
        self.sent = 0  # references handed out naming this ring
        self.segment_sent = False  # the receiver has (or will have) the descriptor
        self.retired = False

    @property
    def nbytes(self) -> int:
        """Shared memory this ring still holds (free slots of a retired ring are given back)."""
        return CTRL + (self.n_slots - len(self._trimmed)) * self.slot_size

    def acquire(self) -> tuple[int, int] | None:
        """A free slot and its new generation, or None when every slot is still leased."""
        w = self._words
        for k in range(self.n_slots):
            i = (self._next + k) % self.n_slots
            if w[_STATES + i] == 0:
                self._generation += 1
                w[_STATES + i] = self._generation
                self._next = i + 1
                return i, self._generation
        return None

    def unacquire(self, slot: int) -> None:
        self._words[_STATES + slot] = 0

    def release(self, slot: int, generation: int) -> None:
        """Free ``slot`` if it still holds ``generation`` (a lease dropped in this process)."""
        if self._words[_STATES + slot] == generation:
            self._words[_STATES + slot] = 0

    def received_here(self) -> None:
        """A reference was consumed in this process (a DataLoader that collates in its workers)."""
        self._words[_RECEIVED] += 1

    def in_flight(self) -> int:
        """References sent and not yet received."""
        return self.sent - self._words[_RECEIVED]

    def free_slots(self) -> int:
        w = self._words
        return sum(1 for i in range(self.n_slots) if w[_STATES + i] == 0)

    def view(self, slot: int, nbytes: int) -> memoryview:
        start = CTRL + slot * self.slot_size
        return memoryview(self.segment.mm)[start : start + nbytes]

    def retire(self) -> None:
        """No more slots from this ring; receivers may forget it once they got every reference."""
        self._words[_SENT] = self.sent
        self._words[_RETIRED] = 1
        self.retired = True
        self.trim()

    def trim(self) -> None:
        """Give the pages of free slots back to the kernel (retired rings only)."""
        if _REMOVE is None:
            return
        w = self._words
        for i in range(self.n_slots):
            if i not in self._trimmed and w[_STATES + i] == 0:
                self.segment.mm.madvise(_REMOVE, CTRL + i * self.slot_size, self.slot_size)
                self._trimmed.add(i)

    def done(self) -> bool:
        """Retired, every reference received and every slot free: safe to unmap."""
        w = self._words
        return self.retired and w[_RECEIVED] >= self.sent and all(w[_STATES + i] == 0 for i in range(self.n_slots))

    def close(self) -> None:
        self._words.release()
        self.segment.close()


class _MappedRing:
    """Receiver side: one mapping of a worker's ring.

    ``pin``: registered with the accelerator (True), never to be (False), not asked yet (None);
    ``pinning`` while one receiver registers it (outside the registry's lock, holding a lease).
    Unmapped by ``close`` once forgotten and no lease is left: unregistered first.
    """

    __slots__ = (
        "__weakref__",
        "address",
        "forgotten",
        "leases",
        "mm",
        "nbytes",
        "owner_pid",
        "pin",
        "pinning",
        "slot_size",
        "uid",
        "words",
    )

    def __init__(self, uid: str, segment: ShmSegment, slot_size: int, owner_pid: int) -> None:
        if bytes(segment.mm[:16]) != bytes.fromhex(uid):
            raise ShmTransportError(
                f"the shared memory received for ring {uid} of process {owner_pid} is another ring "
                f"({bytes(segment.mm[:16]).hex()}); this is a bug in torch_storage_loader, please report it",
                ring=uid,
            )
        self.uid = uid
        self.mm = segment.mm
        self.slot_size = slot_size
        self.owner_pid = owner_pid
        self.words = memoryview(self.mm)[:CTRL].cast("q")
        self.leases = 0
        self.pin: bool | None = None
        self.pinning = False
        self.address = np.frombuffer(self.mm, np.uint8, 1).ctypes.data
        self.nbytes = len(self.mm)
        self.forgotten = False

    def finished(self) -> bool:
        w = self.words
        return self.leases == 0 and w[_RETIRED] == 1 and w[_RECEIVED] >= w[_SENT]

    def close(self) -> None:
        """Unregister, then unmap (no lease is left: nothing views the mapping). Not under the
        registry's lock: unregistering may wait for the device (``_Registry.locked``)."""
        self.pin = False
        gpu.unpin(self)  # also where pin() registered it and then failed: nothing is unmapped registered
        self.words.release()
        try:
            self.mm.close()
        except BufferError:
            pass  # something still exports it: it is unmapped with the last export


class _Registry:
    """The rings mapped in this process, by uid, and a thread that forgets those of exited workers.

    Used under ``with reg.lock:``, the C lock itself: a signal handler's error (torch raises a dead
    worker's from its SIGCHLD handler, wherever the trainer's thread is) raised inside a Python
    ``__enter__`` after the acquire would leave it held for ever. Page-locking calls (which may wait
    for the device) are made outside it: a ring let go is queued (``closing``) and closed by
    ``close_let_go()``, called after each section; and a ring is registered by a receiver holding
    a lease on it (``refs``), so that none is unmapped before it is unregistered, nor registered
    once unmapped.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.RLock()  # lease finalizers may run inside a locked section (GC)
        self.closing: list[_MappedRing] = []  # forgotten, no lease left: closed by close_let_go()
        self.rings: dict[str, _MappedRing] = {}
        self.watched: dict[int, int] = {}  # owner pid -> pidfd
        self.wake: WakePipe | None = None
        self.reaper: threading.Thread | None = None

    def close_let_go(self) -> None:
        """Close the rings let go, outside the lock. Inside a section of this thread's (a lease's
        finalizer the garbage collector ran there) it leaves them to that section's own call; one
        skipped by an error is closed by the next call."""
        if not self.closing or self.lock._is_owned():  # type: ignore[attr-defined]  # C RLock's, as threading.Condition uses
            return
        with self.lock:
            closing, self.closing = self.closing, []
        for ring in closing:
            try:
                ring.close()
            except Exception:
                logger.exception("closing shared-memory ring %s failed", ring.uid)

    def forget(self, ring: _MappedRing) -> None:
        if self.rings.get(ring.uid) is ring:
            del self.rings[ring.uid]
        if not ring.forgotten:
            ring.forgotten = True
            if ring.leases == 0:
                self.closing.append(ring)  # else with the last lease (unlease)

    def unlease(self, ring: _MappedRing) -> None:
        """A lease on ``ring`` ends: the last one of a forgotten ring closes it."""
        ring.leases -= 1
        if ring.leases == 0:
            if ring.forgotten:
                self.closing.append(ring)
            elif ring.finished():
                self.forget(ring)

    def forget_owner(self, pid: int) -> None:
        for ring in [r for r in self.rings.values() if r.owner_pid == pid]:
            self.forget(ring)

    def watch(self, pid: int) -> None:
        """Forget ``pid``'s rings once it exits (called with the lock held)."""
        if pid in self.watched:
            return
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.forget_owner(pid)
            return
        except (AttributeError, OSError):
            return  # no pidfd here: rings are forgotten when retired, or when the worker's loader stops
        self.watched[pid] = pidfd
        if self.wake is not None:  # the reaper runs: it registers the new pidfd
            self.wake.wake()
            return
        self.wake = WakePipe()
        self.reaper = threading.Thread(target=self._reap, args=(self.wake,), name="tsl-ring-reaper", daemon=True)
        self.reaper.start()

    def _reap(self, wake: WakePipe) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(wake.fileno(), selectors.EVENT_READ, None)
            registered: dict[int, int] = {}
            while True:
                with self.lock:
                    for pid, fd in self.watched.items():
                        if pid not in registered:
                            sel.register(fd, selectors.EVENT_READ, pid)
                            registered[pid] = fd
                    if not self.watched:
                        self.reaper = self.wake = None
                        break
                self.close_let_go()  # a lease's finalizer the garbage collector ran in that section
                for key, _ in sel.select():
                    if key.data is None:
                        wake.drain()
                        continue
                    pid = key.data
                    sel.unregister(key.fd)
                    with self.lock:
                        del registered[pid]
                        os.close(self.watched.pop(pid))
                        self.forget_owner(pid)
                    self.close_let_go()
        wake.close()


_registry = _Registry()


@after_fork_in_child
def _new_registry_in_child() -> None:
    # Rings the parent mapped stay mapped where the child's inherited views need them, but the
    # child never receives references for them, and its releases are ignored (see refs._release).
    global _registry
    _registry = _Registry()


def retire_rings(owner_pid: int | None = None, *, dead_only: bool = False) -> None:
    """Forget mapped rings (of one worker, or all); leased slots keep their memory until dropped."""
    reg = _registry
    with reg.lock:
        for ring in list(reg.rings.values()):
            if owner_pid is not None and ring.owner_pid != owner_pid:
                continue
            if dead_only and pid_alive(ring.owner_pid):
                continue
            reg.forget(ring)
    reg.close_let_go()
