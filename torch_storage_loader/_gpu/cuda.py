"""The CUDA accelerator of ``_pinning``: registration, events, and copies to ``device=`` on a side stream.

Public torch API, plus what ``cudart`` checks (the ``cudart`` registration calls).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .._shm.segments import _human
from ..errors import PinRefused, SampleTooLargeForDeviceError
from . import cudart as _cudart

__all__ = ["CopyStage", "CudaAccelerator", "too_large"]


class CudaAccelerator:
    """``_pinning.Accelerator`` for CUDA through torch."""

    name = "CUDA"
    pin_thread = True  # device= copies are issued on the DataLoader's pin-memory thread

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    # ----------------------------------------------------------------------------- devices
    def devices_in_use(self) -> list[int]:
        if not torch.cuda.is_initialized():
            return []
        try:
            return [i for i in range(torch.cuda.device_count()) if _cudart.has_context(i)]
        except RuntimeError:  # this torch cannot tell: the calling thread's device (its caller chose it)
            return [torch.cuda.current_device()]

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def on_device(self, index: int) -> torch.cuda.device:
        # Restoring the device before it on exit creates no context there (torch's MaybeExchangeDevice).
        return torch.cuda.device(index)

    # ----------------------------------------------------------------------------- pinning
    def register(self, address: int, size: int) -> None:
        try:
            code, name = _cudart.host_register(address, size)
        except RuntimeError as exc:  # this torch cannot register memory
            raise PinRefused(str(exc)) from None
        if code:
            raise PinRefused(f"cudaHostRegister returned {code}, {name}")

    def unregister(self, address: int) -> None:
        code, name = _cudart.host_unregister(address)
        if code:
            raise PinRefused(f"cudaHostUnregister returned {code}, {name}")

    def sees_pinned(self, address: int) -> bool:
        probe = (ctypes.c_uint8 * 1).from_address(address)
        return bool(torch.frombuffer(probe, dtype=torch.uint8).is_pinned())

    def record_event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(blocking=True)  # its waiter sleeps instead of spinning
        event.record()  # on the current device's current stream
        return event

    def handles(self, device: Any) -> bool:
        return torch.device(device).type == "cuda" and torch.cuda.is_available()

    # ------------------------------------------------------------------------ device copies
    def resolve(self, device: Any) -> torch.device:
        device = torch.device(device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            stream = self._streams.get(device.index)
            if stream is None:
                stream = self._streams[device.index] = torch.cuda.Stream(device)
            return stream

    @contextlib.contextmanager
    def stage(self, device: Any) -> Iterator[CopyStage]:
        """Copies issued inside go on ``device``'s side stream; ``stage.event`` marks their end."""
        device = self.resolve(device)
        stream = self.side_stream(device)
        stage = CopyStage(device)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            try:
                yield stage
            finally:  # also after a failure: a copy issued before it may still be reading the slot
                stage.event = torch.cuda.Event(blocking=True)
                stage.event.record(stream)

    def current_stream(self, device: Any) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def record_stream(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        tensor.record_stream(stream)


class CopyStage:
    """The copies of one sample to a device, inside ``CudaAccelerator.stage``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.index: int = device.index
        self.owned: list[torch.Tensor] = []  # device memory allocated on the side stream
        self.event: Any = None

    def copy(self, host: np.ndarray, path: str) -> torch.Tensor:
        """``host`` (1-D uint8) on the device, as one copy (asynchronous where ``host`` is pinned)."""
        n = host.nbytes
        total = torch.cuda.get_device_properties(self.device).total_memory
        try:
            if n > total:
                raise torch.OutOfMemoryError(f"{n} bytes is more than the device has")
            out = torch.empty(n, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError:
            free, total = torch.cuda.mem_get_info(self.device)
            raise too_large(path, n, self.device, free, total) from None
        out.copy_(torch.from_numpy(host), non_blocking=True)
        self.owned.append(out)
        return out

    def move(self, t: torch.Tensor) -> torch.Tensor:
        """A small CPU tensor built on the host (stacked inline scalars), on the device."""
        out = t.to(self.device, non_blocking=True)
        self.owned.append(out)
        return out


def too_large(path: str, nbytes: int, device: Any, free: int, total: int) -> SampleTooLargeForDeviceError:
    """The error of a sample that does not fit on ``device`` (an accelerator's ``CopyStage.copy`` raises it)."""
    return SampleTooLargeForDeviceError(
        f"{path}: the sample needs {_human(nbytes)} on {device}, which has {_human(free)} free of {_human(total)}: "
        "lower batch_size, free memory on the device, or pass device=None and move what fits yourself",
        path=path,
        needed=nbytes,
        free=free,
        device=str(device),
    )
