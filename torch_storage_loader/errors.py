"""Exception types. Each is picklable, so a worker can raise it across processes."""

from __future__ import annotations

__all__ = [
    "InsufficientSharedMemoryError",
    "LoadCancelledError",
    "PickleNotAllowedError",
    "SampleMismatchError",
    "StorageCorruptError",
    "StorageError",
    "StorageNotFoundError",
    "UnsupportedLeafError",
    "WorkerDiedError",
]


class StorageError(Exception):
    """Base class of every error this library raises on purpose."""

    def __init__(self, message: str, **attrs: object) -> None:
        super().__init__(message)
        self.__dict__.update(attrs)

    def __reduce__(self):
        return _rebuild_error, (type(self), self.args[0], dict(self.__dict__))


def _rebuild_error(cls, message, attrs):
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


class LoadCancelledError(StorageError, RuntimeError):
    """A load was still pending when ``shutdown(timeout=...)`` gave up on it."""


class InsufficientSharedMemoryError(StorageError, MemoryError):
    """Not enough shared memory for the slots; the message says how much is needed and how to fix it."""
