# The public names, once: type checkers read this stub, and __init__.py reads it to build
# __all__ and its lazy imports. Add a public name here, and its entry to the page of its kind in
# docs/reference/ (tests/test_docstrings.py checks that the reference renders exactly these names).
from ._redis.records import register_storage_type as register_storage_type
from ._sources import DirectorySource as DirectorySource
from ._sources import end_directory_stream as end_directory_stream
from ._sources import start_directory_stream as start_directory_stream
from ._sources.prefix import PrefixSource as PrefixSource
from ._stores.objects import configure_object_store as configure_object_store
from .dataset import StorageDataset as StorageDataset
from .errors import HandleRecordError as HandleRecordError
from .errors import InsufficientSharedMemoryError as InsufficientSharedMemoryError
from .errors import LoadCancelledError as LoadCancelledError
from .errors import PickleNotAllowedError as PickleNotAllowedError
from .errors import ProducerDiedError as ProducerDiedError
from .errors import RedisStreamLostError as RedisStreamLostError
from .errors import SampleMismatchError as SampleMismatchError
from .errors import SampleTooLargeError as SampleTooLargeError
from .errors import SampleTooLargeForDeviceError as SampleTooLargeForDeviceError
from .errors import ShmTransportError as ShmTransportError
from .errors import SlotPinningWarning as SlotPinningWarning
from .errors import StorageCorruptError as StorageCorruptError
from .errors import StorageError as StorageError
from .errors import StorageNotFoundError as StorageNotFoundError
from .errors import StorageUnavailableError as StorageUnavailableError
from .errors import StreamEndedError as StreamEndedError
from .errors import UnsupportedLeafError as UnsupportedLeafError
from .errors import UnsupportedTorchError as UnsupportedTorchError
from .errors import UntrustedStorageError as UntrustedStorageError
from .errors import WorkerDiedError as WorkerDiedError
from .file_loader import FileStorageLoader as FileStorageLoader
from .loader import LoaderStats as LoaderStats
from .loader import StorageLoader as StorageLoader
from .queue import StorageQueue as StorageQueue
from .redis_queue import RedisStorageQueue as RedisStorageQueue
from .storage import FileStorage as FileStorage
from .storage import ObjectStorage as ObjectStorage
from .storage import Storage as Storage

__version__: str
__all__: list[str]
