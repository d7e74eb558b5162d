"""Rings of shared-memory slots, and the small references that stand for a filled slot.

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

In a receiver that uses CUDA, each ring is page-locked in place once (``_pinning``), so that its
slots cross to the GPU at link speed, and unregistered before it is unmapped; a slot of a pinned
ring goes back to its worker only once the GPU is past the work queued before its release.
References whose options name a ``device`` are received as samples on that device (``_device``).
"""

from __future__ import annotations

import functools
import mmap
import os
import pickle
import selectors
import threading
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._format import Header, ReadOptions
from ._proc import pid_alive
from ._shm import ShmSegment
from .errors import ShmTransportError

__all__ = ["BytesRef", "CTRL", "MAX_SLOTS", "OneOffRef", "SlotRef", "SlotRing", "page_round",
           "retire_rings"]

PAGE = mmap.PAGESIZE
CTRL = 4096  # control block: identity and lifetime words, then one int64 state word per slot
_UID, _RETIRED, _SENT, _RECEIVED, _STATES = 0, 2, 3, 4, 8  # word offsets (the uid takes two words)
MAX_SLOTS = CTRL // 8 - _STATES
_REMOVE = getattr(mmap, "MADV_REMOVE", None)


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
        return memoryview(self.segment.mm)[start: start + nbytes]

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
        return (self.retired and w[_RECEIVED] >= self.sent
                and all(w[_STATES + i] == 0 for i in range(self.n_slots)))

    def close(self) -> None:
        self._words.release()
        self.segment.close()


class _MappedRing:
    """Receiver side: one mapping of a worker's ring.

    ``pin``: registered with the accelerator (True), never to be (False), not asked yet (None).
    Unmapped by ``close`` once forgotten and no lease is left: unregistered first.
    """

    __slots__ = ("uid", "mm", "slot_size", "owner_pid", "words", "leases", "pin", "address", "nbytes",
                 "forgotten", "__weakref__")

    def __init__(self, uid: str, segment: ShmSegment, slot_size: int, owner_pid: int) -> None:
        if bytes(segment.mm[:16]) != bytes.fromhex(uid):
            raise ShmTransportError(
                f"the shared memory received for ring {uid} of process {owner_pid} is another ring "
                f"({bytes(segment.mm[:16]).hex()}); this is a bug in torch_storage_loader, please report it",
                ring=uid)
        self.uid = uid
        self.mm = segment.mm
        self.slot_size = slot_size
        self.owner_pid = owner_pid
        self.words = memoryview(self.mm)[:CTRL].cast("q")
        self.leases = 0
        self.pin: bool | None = None
        self.address = np.frombuffer(self.mm, np.uint8, 1).ctypes.data
        self.nbytes = len(self.mm)
        self.forgotten = False

    def finished(self) -> bool:
        w = self.words
        return self.leases == 0 and w[_RETIRED] == 1 and w[_RECEIVED] >= w[_SENT]

    def close(self) -> None:
        """Unregister, then unmap (no lease is left: nothing views the mapping)."""
        if self.pin:
            from . import _pinning

            self.pin = False
            _pinning.unpin(self)
        self.words.release()
        try:
            self.mm.close()
        except BufferError:
            pass  # something still exports it: it is unmapped with the last export


class _Registry:
    """The rings mapped in this process, by uid, and a thread that forgets those of exited workers."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.RLock()  # lease finalizers may run inside a locked section (GC)
        self.rings: dict[str, _MappedRing] = {}
        self.watched: dict[int, int] = {}  # owner pid -> pidfd
        self.wake: tuple[int, int] | None = None
        self.reaper: threading.Thread | None = None

    def forget(self, ring: _MappedRing) -> None:
        if self.rings.get(ring.uid) is ring:
            del self.rings[ring.uid]
        if not ring.forgotten:
            ring.forgotten = True
            if ring.leases == 0:
                ring.close()  # else with the last lease (_free)

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
        if self.reaper is None:
            self.wake = os.pipe()
            self.reaper = threading.Thread(target=self._reap, args=(self.wake,), name="tsl-ring-reaper",
                                           daemon=True)
            self.reaper.start()
        else:
            os.write(self.wake[1], b"\0")

    def _reap(self, wake: tuple[int, int]) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(wake[0], selectors.EVENT_READ, None)
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
                for key, _ in sel.select():
                    if key.data is None:
                        os.read(wake[0], 4096)
                        continue
                    pid = key.data
                    sel.unregister(key.fd)
                    with self.lock:
                        del registered[pid]
                        os.close(self.watched.pop(pid))
                        self.forget_owner(pid)
        for fd in wake:
            os.close(fd)


_registry = _Registry()


def _after_fork_in_child() -> None:
    # Rings the parent mapped stay mapped where the child's inherited views need them, but the
    # child never receives references for them, and its releases are ignored (see _release).
    global _registry
    _registry = _Registry()


os.register_at_fork(after_in_child=_after_fork_in_child)


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


def _private(nbytes: int) -> np.ndarray:
    """Private memory for a copied-out sample. Large buffers come from torch's allocator: numpy
    asks for transparent huge pages there, and compacting memory for them at every fault made
    fresh buffers three times slower to fill (0.5 against 1.4 GB/s on these machines)."""
    if nbytes < 1 << 22:
        return np.empty(nbytes, np.uint8)
    import torch

    return torch.empty(nbytes, dtype=torch.uint8).numpy()


def plan_key(header: Header, opts: ReadOptions) -> bytes:
    """What a reference carries instead of its header: the receiver's key for a cached build plan
    (``_tree.plan_for``). Plain bytes, so that nothing depends on which worker, ring or process
    sent it; pickling it here keeps torch out of the workers. Workers reuse one header object per
    layout (``_worker._Layout``), so its key is made once, not per sample."""
    hit = _plan_keys.get(id(header))
    if hit is not None and hit[0] is header and hit[1] == opts:
        return hit[2]
    key = pickle.dumps((header, opts), protocol=pickle.HIGHEST_PROTOCOL)
    if len(_plan_keys) >= _MAX_PLAN_KEYS:
        _plan_keys.clear()
    _plan_keys[id(header)] = (header, opts, key)  # the header is kept: its id stays its own
    return key


_plan_keys: dict[int, tuple[Header, ReadOptions, bytes]] = {}
_MAX_PLAN_KEYS = 64


def _release(ring: _MappedRing, slot: int, generation: int, pid: int) -> None:
    """A lease's finalizer: free the slot, unless this is a forked child dropping inherited views.

    A pinned ring's slot may still be read by a copy queued on the GPU: it is freed once the GPU
    is past what the current stream has queued (``_pinning.defer``)."""
    if os.getpid() != pid:
        return
    if ring.pin:
        from . import _pinning

        _pinning.defer(functools.partial(_free, ring, slot, generation))
    else:
        _free(ring, slot, generation)


def _free(ring: _MappedRing, slot: int, generation: int) -> None:
    reg = _registry
    with reg.lock:
        w = ring.words
        if w[_STATES + slot] == generation:
            w[_STATES + slot] = 0
        ring.leases -= 1
        if ring.leases == 0:
            if ring.forgotten:
                ring.close()
            elif ring.finished():
                reg.forget(ring)


def _free_after(ring: _MappedRing, slot: int, generation: int, event: Any) -> None:
    """``_device.deliver``'s release: free the slot once ``event`` (after the copy) completed."""
    if event is None:
        _free(ring, slot, generation)
    else:
        from . import _pinning

        _pinning.defer(functools.partial(_free, ring, slot, generation), event)


def _pin(ring: _MappedRing) -> bool | None:
    from . import _pinning

    return _pinning.pin(ring)


@dataclass
class SlotRef:
    """Stands for a filled slot; unpickles (in the receiver) into the sample itself.

    ``copy``: the worker is short of free slots (the consumer keeps what it gets), so the
    receiver copies the sample into private memory and frees the slot at once.
    """

    ring_uid: str
    slot: int
    generation: int
    slot_size: int
    header: Header
    path: str
    opts: ReadOptions
    segment: ShmSegment | None = None
    copy: bool = False
    watch: bool = False

    def __reduce__(self):
        # The header travels as a plan key: the receiver decodes each distinct header once.
        return _receive_slot, (self.ring_uid, self.slot, self.generation, self.slot_size,
                               plan_key(self.header, self.opts), self.path, self.segment, os.getpid(), self.copy,
                               self.watch)


def _receive_slot(ring_uid: str, slot: int, generation: int, slot_size: int, key: bytes, path: str,
                  segment: ShmSegment | None, pid: int, copy: bool = False, watch: bool = False) -> Any:
    from ._tree import plan_for

    plan = plan_for(key)
    size = plan.header.data_size
    device = plan.opts.device
    reg = _registry
    with reg.lock:
        ring = reg.rings.get(ring_uid)
        if ring is None:
            if segment is None:
                raise ShmTransportError(
                    f"shared-memory ring {ring_uid} of process {pid} is not mapped in this process (its "
                    "worker exited, or the reference was sent to another process than the loader's)",
                    ring=ring_uid, pid=pid)
            ring = reg.rings[ring_uid] = _MappedRing(ring_uid, segment, slot_size, pid)
            if watch:
                reg.watch(pid)
        ring.words[_RECEIVED] += 1
        if ring.pin is None:
            ring.pin = _pin(ring)
        start = CTRL + slot * ring.slot_size
        if device is not None:  # the slot is read by the copy, then freed (never viewed by the consumer)
            ring.leases += 1
            host = np.frombuffer(ring.mm, np.uint8, size, start)
        elif copy:
            buf = _private(size)
            np.copyto(buf, np.frombuffer(ring.mm, np.uint8, size, start))
            if ring.words[_STATES + slot] == generation:
                ring.words[_STATES + slot] = 0
            if ring.finished():
                reg.forget(ring)
        else:
            # The lease anchor is the array that exports the slot's bytes: every leaf is a view
            # whose base is this array (numpy collapses view chains onto it; torch.from_numpy keeps
            # the array it was given), while intermediate memoryviews may be dropped early.
            buf = np.frombuffer(ring.mm, np.uint8, size, start)
            ring.leases += 1
            weakref.finalize(buf, _release, ring, slot, generation, os.getpid())
    if device is not None:
        from ._device import deliver

        return deliver(plan, host, path, device, functools.partial(_free_after, ring, slot, generation))
    return plan.build(buf, path)


@dataclass
class BytesRef:
    """The data section travels through the pipe (empty samples)."""

    header: Header
    data: bytearray
    path: str
    opts: ReadOptions

    def __reduce__(self):
        return _receive_bytes, (plan_key(self.header, self.opts), self.data, self.path)


def _receive_bytes(key: bytes, data: bytearray, path: str) -> Any:
    from ._tree import plan_for

    plan = plan_for(key)
    if plan.opts.device is not None:
        from ._device import deliver

        return deliver(plan, np.frombuffer(data, np.uint8), path, plan.opts.device, _nothing_to_free)
    return plan.build(np.frombuffer(data, np.uint8), path)


def _nothing_to_free(event: Any) -> None:
    return None


@dataclass
class OneOffRef:
    """A segment of its own: an outlier far above the slot size, or no slot free at all.

    With ``copy`` the receiver copies the sample into private memory and unmaps the segment at
    once, so keeping many such samples costs no mapping each; without, the sample's views keep
    the segment (one mapping) alive until dropped.
    """

    header: Header
    segment: ShmSegment
    path: str
    opts: ReadOptions
    copy: bool = False

    def __reduce__(self):
        return _receive_oneoff, (plan_key(self.header, self.opts), self.segment, self.path, self.copy)


def _receive_oneoff(key: bytes, segment: ShmSegment, path: str, copy: bool = False) -> Any:
    from ._tree import plan_for

    plan = plan_for(key)
    size = plan.header.data_size
    if plan.opts.device is not None:
        from ._device import deliver

        return deliver(plan, np.frombuffer(segment.mm, np.uint8, size), path, plan.opts.device,
                       functools.partial(_close_after, segment))
    if copy:
        buf = _private(size)
        np.copyto(buf, np.frombuffer(segment.mm, np.uint8, size))
        segment.close()
    else:
        buf = np.frombuffer(segment.mm, np.uint8, size)  # its leaves keep the mapping alive
    return plan.build(buf, path)


def _close_after(segment: ShmSegment, event: Any) -> None:
    """Unmap a one-off segment once the copy reading it is done."""
    if event is None:
        segment.close()
    else:
        from . import _pinning

        _pinning.defer(segment.close, event)
