"""The small references that stand for a filled slot (or a segment, or bytes), and receiving them.

A worker sends a ``SlotRef`` (ring id, slot, generation, the plan key of its header); unpickling it
in the receiver maps the ring (``slots``) once and returns the sample as views onto the slot, leased
until every view is gone (then ``_release`` frees the slot in the ring's control block). A sample
no slot could take travels as a ``OneOffRef`` (a segment of its own) or, small, as ``BytesRef``.
References whose options name a ``device`` are received as samples on that device (``slots.gpu``).
"""

from __future__ import annotations

import functools
import os
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._format.file import Header, ReadOptions
from ..errors import ShmTransportError
from . import slots as _slots
from .segments import ShmSegment
from .slots import _RECEIVED, _STATES, CTRL, _MappedRing

__all__ = ["BytesRef", "OneOffRef", "SlotRef", "plan_key"]


def _private(nbytes: int) -> np.ndarray:
    """Private memory for a copied-out sample. Large buffers come from torch's allocator: numpy
    asks for transparent huge pages there, and compacting memory for them at every fault made
    fresh buffers three times slower to fill (0.5 against 1.4 GB/s on these machines)."""
    if nbytes < 1 << 22:
        return np.empty(nbytes, np.uint8)
    import torch

    return torch.empty(nbytes, dtype=torch.uint8).numpy()


@functools.cache
def tree() -> Any:
    """``_format.tree``, imported on first use (it imports torch, which a process that never builds
    a sample does not need); cached, since an import statement costs a microsecond a sample."""
    from .._format import tree as module

    return module


def plan_key(header: Header, opts: ReadOptions) -> tuple[bytes, tuple]:
    """``_format.tree.plan_key``: what a reference carries instead of its header."""
    return tree().plan_key(header, opts)


def _release(ring: _MappedRing, slot: int, generation: int, pid: int) -> None:
    """A lease's finalizer: free the slot, unless this is a forked child dropping inherited views.

    A pinned ring's slot may still be read by a copy queued on the GPU: it is freed once the GPU
    is past what the current stream has queued (``gpu.defer``)."""
    if os.getpid() != pid:
        return
    if ring.pin or ring.pinning:  # being registered: a copy may already read it asynchronously
        _slots.gpu.defer(functools.partial(_free, ring, slot, generation))
    else:
        _free(ring, slot, generation)


def _free(ring: _MappedRing, slot: int, generation: int) -> None:
    reg = _slots._registry  # looked up each time: a forked child has its own (slots._new_registry_in_child)
    with reg.lock:
        w = ring.words
        if w[_STATES + slot] == generation:
            w[_STATES + slot] = 0
        reg.unlease(ring)
    reg.close_let_go()


def _pin(ring: _MappedRing) -> None:
    """Register ``ring`` with the GPU, outside the registry's lock (registering may wait for the
    device); the caller holds a lease on it, so that it is not unmapped meanwhile."""
    pinned = None
    try:
        pinned = _slots.gpu.pin(ring)
    finally:
        with _slots._registry.lock:
            ring.pin, ring.pinning = pinned, False


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
        return _receive_slot, (
            self.ring_uid,
            self.slot,
            self.generation,
            self.slot_size,
            *plan_key(self.header, self.opts),
            self.path,
            self.segment,
            os.getpid(),
            self.copy,
            self.watch,
        )


def _receive_slot(
    ring_uid: str,
    slot: int,
    generation: int,
    slot_size: int,
    key: bytes,
    consts: tuple,
    path: str,
    segment: ShmSegment | None,
    pid: int,
    copy: bool = False,
    watch: bool = False,
) -> Any:
    plan = tree().plan_for(key).bind(consts)
    size = plan.header.data_size
    device = plan.opts.device
    reg = _slots._registry  # looked up each time: a forked child has its own (slots._new_registry_in_child)
    try:  # (what a section let go is closed even where it raised)
        with reg.lock:
            ring = reg.rings.get(ring_uid)
            if ring is None:
                if segment is None:
                    raise ShmTransportError(
                        f"shared-memory ring {ring_uid} of process {pid} is not mapped in this process (its "
                        "worker exited, or the reference was sent to another process than the loader's)",
                        ring=ring_uid,
                        pid=pid,
                    )
                ring = reg.rings[ring_uid] = _MappedRing(ring_uid, segment, slot_size, pid)
                if watch:
                    reg.watch(pid)
            ring.words[_RECEIVED] += 1
            # Registering may wait for the device: it runs outside the lock, under a lease of the
            # receiver's (not unmapped meanwhile), and only where it may happen (CUDA in use here).
            pinning = ring.pin is None and not ring.pinning and _slots.gpu.may_pin()
            if pinning:
                ring.pinning = True
                ring.leases += 1
            else:
                view = _take(reg, ring, slot, generation, size, device, copy)
        if pinning:
            try:
                _pin(ring)
                with reg.lock:
                    view = _take(reg, ring, slot, generation, size, device, copy)
            finally:
                with reg.lock:
                    reg.unlease(ring)  # (the last reference of a retired ring, copied: it is forgotten here)
    finally:
        reg.close_let_go()
    if device is not None:
        return _slots.gpu.deliver(plan, view, path, device, functools.partial(_free, ring, slot, generation))
    return plan.build(view, path)


def _take(
    reg: _slots._Registry, ring: _MappedRing, slot: int, generation: int, size: int, device: Any, copy: bool
) -> np.ndarray:
    """The slot's bytes for the sample, under the registry's lock: leased (a view, or the host side
    of a device copy), or copied into private memory and the slot freed at once."""
    start = CTRL + slot * ring.slot_size
    if copy and device is None:
        buf = _private(size)
        np.copyto(buf, np.frombuffer(ring.mm, np.uint8, size, start))
        if ring.words[_STATES + slot] == generation:
            ring.words[_STATES + slot] = 0
        if ring.leases == 0 and ring.finished():
            reg.forget(ring)  # its last reference, copied
        return buf
    # The lease anchor is the array that exports the slot's bytes: every leaf is a view whose base
    # is this array (numpy collapses view chains onto it; torch.from_numpy keeps the array it was
    # given), while intermediate memoryviews may be dropped early. A device copy reads the slot,
    # then frees it (``_free``): the consumer never views it.
    view = np.frombuffer(ring.mm, np.uint8, size, start)
    ring.leases += 1
    if device is None:
        weakref.finalize(view, _release, ring, slot, generation, os.getpid())
    return view


@dataclass
class BytesRef:
    """The data section travels through the pipe (empty samples)."""

    header: Header
    data: bytearray
    path: str
    opts: ReadOptions

    def __reduce__(self):
        return _receive_bytes, (*plan_key(self.header, self.opts), self.data, self.path)


def _receive_bytes(key: bytes, consts: tuple, data: bytearray, path: str) -> Any:
    plan = tree().plan_for(key).bind(consts)
    if plan.opts.device is not None:
        return _slots.gpu.deliver(plan, np.frombuffer(data, np.uint8), path, plan.opts.device, _nothing_to_free)
    return plan.build(np.frombuffer(data, np.uint8), path)


def _nothing_to_free() -> None:
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
        return _receive_oneoff, (*plan_key(self.header, self.opts), self.segment, self.path, self.copy)


def _receive_oneoff(key: bytes, consts: tuple, segment: ShmSegment, path: str, copy: bool = False) -> Any:
    plan = tree().plan_for(key).bind(consts)
    size = plan.header.data_size
    if plan.opts.device is not None:
        host = np.frombuffer(segment.mm, np.uint8, size)
        return _slots.gpu.deliver(plan, host, path, plan.opts.device, segment.close)
    if copy:
        buf = _private(size)
        np.copyto(buf, np.frombuffer(segment.mm, np.uint8, size))
        segment.close()
    else:
        buf = np.frombuffer(segment.mm, np.uint8, size)  # its leaves keep the mapping alive
    return plan.build(buf, path)
