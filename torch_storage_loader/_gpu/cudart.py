"""The CUDA runtime behaviour the GPU path relies on (private torch pieces are in ``_dataloader.hooks``).

Each entry says what it relies on and checks it before use, so that a torch release that changes
one of them turns into a clear fallback or error here instead of a silent misbehaviour elsewhere:

- ``cudaHostRegister`` / ``cudaHostUnregister`` / ``cudaGetErrorString`` as bound by
  ``torch.cuda.cudart()`` (``torch/csrc/cuda/shared/cudart.cpp``: they return the ``cudaError``
  code instead of raising). A failed call leaves the error as the CUDA runtime's "last error" of
  the calling thread, which torch's next kernel-launch check would report as its own failure: it
  is cleared through the runtime library torch loaded (``cudaGetLastError``).

- ``cuDeviceGet`` / ``cuDevicePrimaryCtxGetState`` of the CUDA driver library the process loaded
  (``libcuda``, as torch's own ``hasPrimaryContext`` asks it): whether a device has a context,
  without creating one. The GPU path calls the GPU only on such devices (``has_context``); the
  driver numbers devices as the runtime and torch do (both after ``CUDA_VISIBLE_DEVICES``).

Imported only in processes that use CUDA (or its tests); DataLoader workers never import it.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import torch

__all__ = ["cuda_error_name", "has_context", "host_register", "host_unregister", "registration_api"]

# cudaHostRegisterPortable: page-locked for every CUDA context of the process, so that whichever
# thread (and current device) unregisters it later, the registration is found.
HOST_REGISTER_PORTABLE = 1


@functools.cache
def registration_api() -> Any:
    """``torch.cuda.cudart()`` if it binds what registration needs, else raise ``RuntimeError`` saying what is missing."""
    cudart = torch.cuda.cudart()
    missing = [
        name
        for name in ("cudaHostRegister", "cudaHostUnregister", "cudaGetErrorString")
        if not callable(getattr(cudart, name, None))
    ]
    if missing:
        raise RuntimeError(f"torch {torch.__version__}'s torch.cuda.cudart() lacks {', '.join(missing)}")
    return cudart


def has_context(index: int) -> bool:
    """Whether device ``index`` has a CUDA context in this process (asking creates none); raise
    ``RuntimeError`` where the driver cannot be asked."""
    lib = _loaded_library("libcuda.so")
    if lib is None:
        raise RuntimeError("the CUDA driver library (libcuda) is not loaded in this process")
    device, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    try:
        rc = lib.cuDeviceGet(ctypes.byref(device), index)
        if not rc:
            rc = lib.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active))
    except AttributeError as exc:  # a driver library without the call
        raise RuntimeError(f"the CUDA driver library lacks it: {exc}") from None
    if rc:
        raise RuntimeError(f"the CUDA driver could not say whether device {index} has a context (CUresult {rc})")
    return bool(active.value)


def _code(rc: Any) -> int:
    return int(rc) if not isinstance(rc, int) else rc


def cuda_error_name(rc: Any) -> str:
    try:
        return str(registration_api().cudaGetErrorString(rc))
    except Exception:  # noqa: BLE001 - an unnamed code: the number says it
        return f"cudaError {_code(rc)}"


def host_register(address: int, size: int) -> tuple[int, str]:
    """Page-lock ``size`` bytes at ``address`` in place; ``(0, "")`` or ``(code, name)`` of the refusal."""
    if size <= 0:
        raise ValueError(f"{size=} must be > 0: registering 0 bytes is an error in CUDA")
    return _outcome(registration_api().cudaHostRegister(address, size, HOST_REGISTER_PORTABLE))


def host_unregister(address: int) -> tuple[int, str]:
    return _outcome(registration_api().cudaHostUnregister(address))


def _outcome(rc: Any) -> tuple[int, str]:
    """``(0, "")``, or the error's code and name (the thread's "last error" cleared)."""
    code = _code(rc)
    if not code:
        return 0, ""
    name = cuda_error_name(rc)
    _clear_last_error()
    return code, name


@functools.cache
def _loaded_library(prefix: str) -> Any:
    """The library this process loaded whose file name starts with ``prefix`` (torch's), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(maxsplit=5)[-1].strip() for line in f if prefix in line}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith(prefix):
            try:
                return ctypes.CDLL(path)  # already loaded: the same instance (the same per-thread state)
            except OSError:
                continue
    return None


def _clear_last_error() -> None:
    lib = _loaded_library("libcudart.so")
    if lib is not None and hasattr(lib, "cudaGetLastError"):
        lib.cudaGetLastError()
