"""An emulated GPU for CPU tests of the GPU path: a real ``_pinning.Accelerator`` whose devices are
host memory and whose copies happen when their event completes, as a DMA queued on a stream would.

What it emulates of CUDA, so that the CPU tests see what a real GPU would punish:

- **Devices and contexts.** ``devices`` devices, of which ``contexts`` have a context in this
  process (the trainer's). Each thread has its own current device (0 until it chooses one, as a
  fresh CUDA thread), and every call runs on it: a call on a device without a context creates one
  there (what a thread of the library must never do: under DDP each rank would hold a context on
  GPU 0). ``calls`` logs each call as ``(what, thread name, device)``.
- **Streams and events.** A copy is queued on its device's stream and reads the host memory only
  when an event recorded after it on that device completes: at once (``auto=True``), or, for
  devices in ``late`` (every device with ``auto=False``), only when a consumer's stream waits for it
  or the test calls ``complete_all``. Device buffers start as poison (``POISON``), so a consumer
  that does not wait for the copy reads poison.
- **Registration.** A log of registrations (checking, when a range is unregistered, that it is
  still mapped); ``refuse`` refuses them; ``during_calls`` runs inside each (un)registration, as a
  call that waits for the device would (a test's probe of what is locked meanwhile).
- **Fork.** An event destroyed in a forked child (whose CUDA would fail) counts in
  ``FakeEvent.destroyed_after_fork`` of that child.
- **Pin thread.** ``pin_thread=True``: ``device=`` copies are issued on the DataLoader's pin-memory
  thread, as with CUDA. torch starts that thread only where it sees an accelerator:
  ``torch_sees_an_accelerator`` makes this CPU-only torch see one (its public ``torch.accelerator``
  answers), so that torch's own pin loop runs, and unpickles the workers' results, as on a GPU machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import weakref
from collections.abc import Callable, Iterable

import numpy as np
import torch

from torch_storage_loader._gpu.cuda import too_large
from torch_storage_loader.errors import PinRefused

POISON = 0xEE  # the bytes of device memory no copy has written yet


def mapped(address: int, size: int) -> bool:
    """Whether [address, address + size) lies inside one mapping of this process."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address and address + size <= hi:
                return True
    return False


class FakeEvent:
    """Completes once, running the copies queued on its device before it was recorded."""

    destroyed_after_fork = 0  # in a forked child: events of the parent's that the child destroyed

    def __init__(self, gpu: FakeGPU, device: int, copies: list) -> None:
        self.gpu, self.device, self.pid = gpu, device, os.getpid()
        self._copies = copies
        self._done = threading.Event()
        self._lock = threading.Lock()

    def complete(self) -> None:
        with self._lock:
            copies, self._copies = self._copies, []
            for src, dst in copies:  # reads the host memory now, as a DMA does when the GPU gets to it
                if isinstance(src, int):
                    ctypes.memmove(dst.ctypes.data, src, dst.nbytes)
                else:
                    dst[:] = src
            self._done.set()

    def synchronize(self) -> None:
        self.gpu.call("synchronize")
        self._done.wait()

    def __del__(self) -> None:
        if os.getpid() != self.pid:  # a real one would call cudaEventDestroy in a forked child
            FakeEvent.destroyed_after_fork += 1


class FakeStream:
    """A consumer's current stream on one device: its work runs on the host as soon as it is queued."""

    def __init__(self, gpu: FakeGPU, device: int) -> None:
        self.gpu, self.device = gpu, device

    def wait_event(self, event: FakeEvent) -> None:
        self.gpu.call("wait_event")
        self.gpu.waits.append(event)
        event.complete()  # what this stream runs next runs after the copy


class _Stage:
    def __init__(self, gpu: FakeGPU, index: int) -> None:
        self.gpu = gpu
        self.index = index
        self.device = torch.device("cpu", index)
        self.owned: list[torch.Tensor] = []
        self.event = None

    def copy(self, host: np.ndarray, path: str) -> torch.Tensor:
        n = host.nbytes
        if n > self.gpu.capacity:
            raise too_large(path, n, self.device, self.gpu.capacity, self.gpu.capacity)
        out = torch.full((n,), POISON, dtype=torch.uint8)
        self.gpu.allocated.add(out.untyped_storage().data_ptr())
        self.gpu.queue_copy(host, out.numpy(), self.index)
        self.owned.append(out)
        return out

    def move(self, t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        self.gpu.allocated.add(out.untyped_storage().data_ptr())
        self.owned.append(out)
        return out


class FakeGPU:
    """``_pinning.Accelerator`` over host memory; ``device="cpu"`` (``"cpu:1"``...) datasets use it."""

    name = "the emulated GPU"

    def __init__(
        self,
        *,
        auto: bool = True,
        late: Iterable[int] = (),
        devices: int = 1,
        contexts: Iterable[int] = (0,),
        refuse: str | None = None,
        sees_pinned: bool = True,
        capacity: int = 1 << 40,
        during_calls: Callable[[str], None] | None = None,
        pin_thread: bool = False,
    ) -> None:
        self.auto = auto
        self.late = set(late) if auto else set(range(devices))
        self.devices = devices
        self.contexts = set(contexts)
        self.pin_thread = pin_thread
        self.refuse = refuse
        self._sees_pinned = sees_pinned
        self.capacity = capacity
        self.during_calls = during_calls
        self.used = True
        self.lock = threading.Lock()
        self._current = threading.local()
        self.calls: list[tuple[str, str, int]] = []
        self.registered: dict[int, int] = {}
        self.log: list[tuple] = []  # ("register", address, size) / ("unregister", address, still mapped)
        self.events: weakref.WeakSet[FakeEvent] = weakref.WeakSet()  # (held weakly: as CUDA, it holds no Python object)
        self.queued: dict[int, list] = {}  # device -> copies issued since its last event
        self.allocated: set[int] = set()  # data pointers of "device" buffers
        self.kept: set[int] = set()  # data pointers recorded on a consumer's stream
        self.waits: list[FakeEvent] = []  # events a consumer's stream waited for

    # devices
    def call(self, what: str) -> None:
        """A call on the calling thread's current device: it gets a context there if it had none."""
        device = self.current_device()
        with self.lock:
            self.contexts.add(device)
            self.calls.append((what, threading.current_thread().name, device))

    def current_device(self) -> int:
        return getattr(self._current, "index", 0)

    def set_device(self, index: int) -> None:
        """``torch.cuda.set_device`` on the calling thread (the trainer's, in a test)."""
        self._current.index = index
        self.call("set_device")

    @contextlib.contextmanager
    def on_device(self, index: int):
        before = self.current_device()
        self.set_device(index)
        try:
            yield
        finally:
            self._current.index = before  # as torch restores it: without creating a context there

    def devices_in_use(self) -> list[int]:
        with self.lock:
            return sorted(self.contexts) if self.used else []

    def device_count(self) -> int:
        return self.devices

    # pinning
    def register(self, address: int, size: int) -> None:
        self.call("register")
        if self.during_calls is not None:
            self.during_calls("register")
        with self.lock:
            self.log.append(("register", address, size))
            if self.refuse is not None:
                raise PinRefused(self.refuse)
            if address in self.registered:
                raise PinRefused("cudaErrorHostMemoryAlreadyRegistered")
            self.registered[address] = size

    def unregister(self, address: int) -> None:
        self.call("unregister")
        if self.during_calls is not None:
            self.during_calls("unregister")
        with self.lock:
            still_mapped = mapped(address, self.registered[address])
            self.log.append(("unregister", address, still_mapped))
            del self.registered[address]

    def sees_pinned(self, address: int) -> bool:
        return self._sees_pinned and any(a <= address < a + n for a, n in self.registered.items())

    # streams and events
    def queue_copy(self, src: np.ndarray | int, dst: np.ndarray, device: int | None = None) -> None:
        """A copy on ``device``'s stream (default: the current one): it reads ``src`` when the next
        event recorded on that device completes."""
        device = self.current_device() if device is None else device
        with self.lock:
            self.queued.setdefault(device, []).append((src, dst))

    def record_event(self) -> FakeEvent:
        self.call("record")
        device = self.current_device()
        with self.lock:
            event = FakeEvent(self, device, self.queued.pop(device, []))
            self.events.add(event)
        if device not in self.late:
            event.complete()
        return event

    def complete_all(self) -> None:
        """The GPU gets to everything queued: every event completes, every copy is done."""
        with self.lock:
            leftover = [FakeEvent(self, d, copies) for d, copies in self.queued.items()]
            self.queued = {}
            events = list(self.events) + leftover
        for e in events:
            e.complete()

    def current_stream(self, device) -> FakeStream:
        return FakeStream(self, self._index(device))

    def record_stream(self, t: torch.Tensor, stream: FakeStream) -> None:
        self.kept.add(t.untyped_storage().data_ptr())

    # device copies
    def handles(self, device) -> bool:
        return torch.device(device).type == "cpu"

    def _index(self, device) -> int:
        index = torch.device(device).index
        return self.current_device() if index is None else index

    @contextlib.contextmanager
    def stage(self, device):
        index = self._index(device)
        stage = _Stage(self, index)
        with self.on_device(index):
            try:
                yield stage
            finally:
                stage.event = self.record_event()

    def copy_async(self, t: torch.Tensor, device: int | None = None) -> torch.Tensor:
        """What ``t.to("cuda:<device>", non_blocking=True)`` does from pinned memory: the bytes are
        read later, by address, when the GPU gets there; nothing keeps ``t`` alive meanwhile."""
        out = torch.empty_like(t)
        self.queue_copy(t.data_ptr(), out.numpy(), device)
        return out


def torch_sees_an_accelerator(monkeypatch) -> None:
    """Make torch's DataLoader start its pin-memory thread on this CPU-only machine (for ``pin_thread=True``):
    the public ``torch.accelerator`` calls it makes answer as for one device (the host, ``cpu``)."""
    acc = torch.accelerator
    monkeypatch.setattr(acc, "is_available", lambda: True)
    monkeypatch.setattr(acc, "current_accelerator", lambda check_available=False: torch.device("cpu"))
    monkeypatch.setattr(acc, "current_device_index", lambda: 0)
    monkeypatch.setattr(acc, "set_device_index", lambda index: None)
