"""An emulated GPU for CPU tests of the GPU path: a real ``_pinning.Accelerator`` whose device is
host memory and whose copies happen when their event completes, as a DMA queued on a stream would.

It keeps a log of registrations (checking, when a range is unregistered, that it is still mapped),
and its events complete at once (``auto=True``) or when the test says so (``complete_all``).

``pin_thread=True``: ``device=`` copies are issued on the DataLoader's pin-memory thread, as with
CUDA. torch starts that thread only where it sees an accelerator: ``torch_sees_an_accelerator``
makes this CPU-only torch see one (its public ``torch.accelerator`` answers), so that torch's own
pin loop runs, and unpickles the workers' results, as on a GPU machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading

import numpy as np
import torch

from torch_storage_loader._gpu.cuda import too_large
from torch_storage_loader.errors import PinRefused


def mapped(address: int, size: int) -> bool:
    """Whether [address, address + size) lies inside one mapping of this process."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address and address + size <= hi:
                return True
    return False


class FakeEvent:
    """Completes once, running the copies queued before it was recorded."""

    def __init__(self, copies: list) -> None:
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
        self._done.wait()


class _Stage:
    def __init__(self, gpu: FakeGPU) -> None:
        self.gpu = gpu
        self.device = torch.device("cpu")
        self.owned: list[torch.Tensor] = []
        self.event = None

    def copy(self, host: np.ndarray, path: str) -> torch.Tensor:
        n = host.nbytes
        if n > self.gpu.capacity:
            raise too_large(path, n, self.device, self.gpu.capacity, self.gpu.capacity)
        out = torch.empty(n, dtype=torch.uint8)
        self.gpu.allocated.add(out.untyped_storage().data_ptr())
        self.gpu.queue_copy(host, out.numpy())
        self.owned.append(out)
        return out

    def move(self, t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        self.gpu.allocated.add(out.untyped_storage().data_ptr())
        self.owned.append(out)
        return out


class FakeGPU:
    """``_pinning.Accelerator`` over host memory; ``device="cpu"`` datasets use it."""

    name = "the emulated GPU"

    def __init__(
        self,
        *,
        auto: bool = True,
        refuse: str | None = None,
        sees_pinned: bool = True,
        capacity: int = 1 << 40,
        pin_thread: bool = False,
    ) -> None:
        self.auto = auto
        self.pin_thread = pin_thread
        self.refuse = refuse
        self._sees_pinned = sees_pinned
        self.capacity = capacity
        self.used = True
        self.lock = threading.Lock()
        self.registered: dict[int, int] = {}
        self.log: list[tuple] = []  # ("register", address, size) / ("unregister", address, still mapped)
        self.events: list[FakeEvent] = []
        self.queued: list = []  # copies issued since the last event
        self.allocated: set[int] = set()  # data pointers of "device" buffers
        self.consumed: list = []

    # pinning
    def in_use(self) -> bool:
        return self.used

    def register(self, address: int, size: int) -> None:
        with self.lock:
            self.log.append(("register", address, size))
            if self.refuse is not None:
                raise PinRefused(self.refuse)
            if address in self.registered:
                raise PinRefused("cudaErrorHostMemoryAlreadyRegistered")
            self.registered[address] = size

    def unregister(self, address: int) -> None:
        with self.lock:
            still_mapped = mapped(address, self.registered[address])
            self.log.append(("unregister", address, still_mapped))
            del self.registered[address]

    def sees_pinned(self, address: int) -> bool:
        return self._sees_pinned and any(a <= address < a + n for a, n in self.registered.items())

    # streams and events
    def queue_copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        """A copy on the (one) stream: it reads ``src`` when the next event recorded completes."""
        with self.lock:
            self.queued.append((src, dst))

    def record_event(self) -> FakeEvent:
        with self.lock:
            event = FakeEvent(self.queued)
            self.queued = []
            self.events.append(event)
        if self.auto:
            event.complete()
        return event

    def complete_all(self) -> None:
        with self.lock:
            events = list(self.events)
        for e in events:
            e.complete()

    # device copies
    def handles(self, device) -> bool:
        return torch.device(device).type == "cpu"

    @contextlib.contextmanager
    def stage(self, device):
        stage = _Stage(self)
        try:
            yield stage
        finally:
            stage.event = self.record_event()

    def consume(self, owned: list, event, device) -> None:
        self.consumed.append(event)  # a GPU stream would wait for it; the host does not

    def copy_async(self, t: torch.Tensor) -> torch.Tensor:
        """What ``t.to("cuda", non_blocking=True)`` does from pinned memory: the bytes are read
        later, by address, when the GPU gets there; nothing keeps ``t`` alive meanwhile."""
        out = torch.empty_like(t)
        self.queue_copy(t.data_ptr(), out.numpy())
        return out


def torch_sees_an_accelerator(monkeypatch) -> None:
    """Make torch's DataLoader start its pin-memory thread on this CPU-only machine (for ``pin_thread=True``):
    the public ``torch.accelerator`` calls it makes answer as for one device (the host, ``cpu``)."""
    acc = torch.accelerator
    monkeypatch.setattr(acc, "is_available", lambda: True)
    monkeypatch.setattr(acc, "current_accelerator", lambda check_available=False: torch.device("cpu"))
    monkeypatch.setattr(acc, "current_device_index", lambda: 0)
    monkeypatch.setattr(acc, "set_device_index", lambda index: None)
