"""Exception types. Each is picklable, so a worker can raise it across processes."""

from __future__ import annotations

import pickle
import traceback
from typing import Any

__all__ = [
    "HandleRecordError",
    "InsufficientSharedMemoryError",
    "LoadCancelledError",
    "PickleNotAllowedError",
    "PinRefused",
    "PinThreadUnavailable",
    "ProducerDiedError",
    "RedisStreamLostError",
    "RemoteTraceback",
    "SampleMismatchError",
    "SampleTooLargeError",
    "SampleTooLargeForDeviceError",
    "ShmTransportError",
    "SlotPinningWarning",
    "StorageCorruptError",
    "StorageError",
    "StorageNotFoundError",
    "StorageUnavailableError",
    "StreamEndedError",
    "UnsupportedLeafError",
    "UnsupportedTorchError",
    "UntrustedStorageError",
    "WorkerDiedError",
]


class StorageError(Exception):
    """Base class of every error this library raises on purpose.

    Catch it to handle any of them; each subclass also derives from the builtin exception it
    resembles (``StorageNotFoundError`` is a ``FileNotFoundError``), so code that catches builtins
    keeps working.

    Args:
        message: What went wrong and how to fix it.
        **attrs: Details set as attributes of the exception (``path``, ``url``, ...); they survive
            pickling, so a worker's error reaches the trainer whole.
    """

    def __init__(self, message: str, **attrs: object) -> None:
        super().__init__(message)
        self.__dict__.update(attrs)

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_error, (type(self), self.args[0], dict(self.__dict__))


def _rebuild_error(cls: type[StorageError], message: str, attrs: dict[str, object]) -> StorageError:
    return cls(message, **attrs)


class StorageCorruptError(StorageError, ValueError):
    """A storage file is truncated, damaged, or not written by this library. ``path`` names it."""


class StorageNotFoundError(StorageError, FileNotFoundError):
    """A storage file does not exist (deleted by a TTL cleaner, never written, wrong directory)."""


class UnsupportedLeafError(StorageError, TypeError):
    """``save`` met a value it cannot store without pickle. ``key_path`` names where."""


class PickleNotAllowedError(StorageError, PermissionError):
    """A file holds pickled values and the reader did not pass ``allow_pickle=True``."""


class SampleMismatchError(StorageError, ValueError):
    """Samples cannot be stacked into one batch (shape, dtype or structure differ)."""


class WorkerDiedError(StorageError, RuntimeError):
    """A loader worker process died while it held a load, and the retry died too."""


class ProducerDiedError(StorageError, RuntimeError):
    """A producer registered with ``producer()`` (of ``StorageQueue`` or ``RedisStorageQueue``) died
    without leaving it. ``producers`` lists them (process ids, or the Redis queue's producer ids)."""


class LoadCancelledError(StorageError, RuntimeError):
    """A load was still pending when ``shutdown(timeout=...)`` gave up on it."""


class InsufficientSharedMemoryError(StorageError, MemoryError):
    """Not enough shared memory for the slots; the message says how much is needed and how to fix it."""


class SampleTooLargeError(InsufficientSharedMemoryError):
    """A sample's data section is larger than one worker's share of ``max_shm_bytes`` (without
    workers: than ``max_shm_bytes``, which bounds a sample's private memory then)."""


class ShmTransportError(StorageError, RuntimeError):
    """A reference to shared memory could not be mapped (its worker exited before it was received)."""


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
    except Exception:  # noqa: BLE001 -- any failure to pickle means: send a plain copy instead
        exc = RuntimeError(f"{type(exc).__qualname__}: {exc}")
    return exc, tb


def unpack_exception(exc: BaseException, tb: str) -> BaseException:
    exc.__cause__ = RemoteTraceback(f'\n"""\n{tb}"""')
    return exc


class HandleRecordError(StorageError, ValueError):
    """A handle cannot cross a network queue: its record is malformed (not JSON, a pickle, wrong
    fields), or its Storage type is not registered (``type_name`` names it then; the fix is
    ``register_storage_type``). ``put`` raises it; ``get`` acknowledges such an entry, counts it as
    refused, and raises it."""


class StorageUnavailableError(StorageError, ConnectionError):
    """Redis or an object store could not be reached, or refused the credentials, after retries.
    ``url`` names it (without its password)."""


class StreamEndedError(StorageError, RuntimeError):
    """A consumer would start on a directory (or object-store prefix) stream that has already ended: its
    end marker is there and every file it ended was delivered, or files were saved after it. ``path``
    names the marker; ``start_directory_stream`` removes it, so a new stream can start."""


class SampleTooLargeForDeviceError(StorageError, MemoryError):
    """A sample (or batch) for ``device=`` does not fit in the device's memory; the message says how large.
    Unlike ``SampleTooLargeError`` it is no ``InsufficientSharedMemoryError``: more shared memory would not help."""


class SlotPinningWarning(RuntimeWarning):
    """Shared-memory slots could not be page-locked for fast copies to the GPU; the message says why and how to fix it."""


class PinRefused(Exception):
    """Internal: the accelerator refused to register memory; ``str()`` says why (its error name).
    Never reaches users: it turns into one ``SlotPinningWarning`` and the unpinned path."""


class PinThreadUnavailable(RuntimeError):
    """Internal: this torch's DataLoader does not start or use its pin-memory thread as ``device=`` relies on."""


class RedisStreamLostError(StorageError, RuntimeError):
    """The Redis stream a ``RedisStorageQueue`` names is not the one it made: it vanished or was made
    anew while in use (its identity (epoch) key, stream or consumer group is gone: Redis restarted
    without persistence, a failover lost unreplicated writes, FLUSHALL, eviction, or ``delete()``), or
    its key exists but was not made by this version of the queue (an older key layout, or something
    else's key). Either way, start a new stream: another name, or ``delete()`` this one first.
    ``stream`` and ``url`` (no password) name it."""


class UntrustedStorageError(StorageError, PermissionError):
    """A handle or file this consumer refuses to touch: a network handle naming a path or bucket
    outside its ``trusted_roots``, or a file that is a symbolic link or not a regular file (a FIFO,
    a device, a directory). ``path`` names it."""


class UnsupportedTorchError(StorageError, RuntimeError):
    """The installed torch lacks (or changed) a private piece the DataLoader hooks rely on; the message says
    which, and which torch releases have it."""
