"""Save samples synchronously, load them asynchronously through reusable shared-memory slots.

Public names are imported on first use, so that worker processes, which only read files into
shared memory, start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "DirectorySource": "_sources",
    "FileStorage": "storage",
    "FileStorageLoader": "file_loader",
    "HandleRecordError": "errors",
    "InsufficientSharedMemoryError": "errors",
    "LoadCancelledError": "errors",
    "LoaderStats": "loader",
    "ObjectStorage": "storage",
    "PickleNotAllowedError": "errors",
    "ProducerDiedError": "queue",
    "RedisStorageQueue": "redis_queue",
    "RedisStreamLayoutError": "errors",
    "RedisStreamLostError": "errors",
    "RedisUnavailableError": "errors",
    "SampleMismatchError": "errors",
    "SampleTooLargeError": "errors",
    "SampleTooLargeForDeviceError": "errors",
    "SlotPinningWarning": "errors",
    "Storage": "storage",
    "StorageCorruptError": "errors",
    "StorageDataset": "dataset",
    "StorageError": "errors",
    "StorageLoader": "loader",
    "StorageNotFoundError": "errors",
    "StorageQueue": "queue",
    "StorageUnavailableError": "errors",
    "UnregisteredStorageTypeError": "errors",
    "UnsupportedLeafError": "errors",
    "UnsupportedTorchError": "errors",
    "UntrustedStorageError": "errors",
    "WorkerDiedError": "errors",
    "configure_object_store": "_objects",
    "end_directory_stream": "_sources",
    "register_storage_type": "_codec",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)


if TYPE_CHECKING:
    from .errors import (HandleRecordError, InsufficientSharedMemoryError, LoadCancelledError, PickleNotAllowedError,
                         RedisStreamLayoutError, RedisStreamLostError, RedisUnavailableError, SampleMismatchError,
                         SampleTooLargeError, SampleTooLargeForDeviceError, SlotPinningWarning, StorageCorruptError,
                         StorageError, StorageNotFoundError, StorageUnavailableError, UnregisteredStorageTypeError, UnsupportedLeafError,
                         UnsupportedTorchError, UntrustedStorageError, WorkerDiedError)
    from ._codec import register_storage_type
    from ._objects import configure_object_store
    from ._sources import DirectorySource, end_directory_stream
    from .dataset import StorageDataset
    from .file_loader import FileStorageLoader
    from .queue import ProducerDiedError, StorageQueue
    from .redis_queue import RedisStorageQueue
    from .loader import LoaderStats, StorageLoader
    from .storage import FileStorage, ObjectStorage, Storage
