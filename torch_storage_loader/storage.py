"""Storage handles: tiny, picklable references to where a sample's bytes live."""

from __future__ import annotations

import mmap
import os
from abc import ABC, abstractmethod
from typing import Any

from . import _format

__all__ = ["FileStorage", "ObjectStorage", "Storage"]


class Storage(ABC):
    """A handle to one saved sample. Pickle the handle, never the data.

    Subclasses implement ``save`` and ``load``; loaders call ``load`` in worker processes, so a
    subclass must be importable there (define it in a module, not in a notebook cell, for spawn).
    """

    def __init__(self, path: str) -> None:
        self.path = path

    @abstractmethod
    def save(self, data: Any) -> Any: ...  # FileStorage returns the bytes written

    @abstractmethod
    def load(self) -> Any: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((type(self), self.path))


def _allocate(size: int):
    # Page-aligned, writable, and released when the last view onto it is gone.
    return mmap.mmap(-1, size) if size else bytearray()


class FileStorage(Storage):
    """One sample in one file, in this library's format (see ``_format``).

    ``allow_pickle`` lets ``save`` pickle values it cannot store as raw bytes, and ``load`` unpickle
    them; leave it off unless every writer of the file is trusted.
    """

    def __init__(self, path: str | os.PathLike, *, allow_pickle: bool = False) -> None:
        super().__init__(os.fspath(path))
        self.allow_pickle = allow_pickle

    def save(self, data: Any, *, fsync: bool = False) -> int:
        """Write ``data`` atomically; returns the file size in bytes."""
        from ._tree import encode

        spec, leaves = encode(data, allow_pickle=self.allow_pickle)
        return _format.write(self.path, spec, leaves, fsync=fsync)

    def load(self) -> Any:
        """Read the sample in this process; its arrays are views onto one private buffer."""
        return self._load(_format.ReadOptions(self.allow_pickle))

    def _load(self, opts: _format.ReadOptions) -> Any:
        from ._tree import build

        header, buf = _format.read_into(self.path, _allocate)
        return build(header, buf, opts, path=self.path)

    def read_header(self) -> _format.Header:
        fd = _format.open_storage(self.path)
        try:
            return _format.read_header(fd, self.path)
        finally:
            os.close(fd)


class ObjectStorage(Storage):
    """One sample in one object of an object store (any fsspec URL: ``s3://``, ``gs://``, ``memory://``),
    in the same format as ``FileStorage``.

    The handle names the URL, the object's size and its version tag (the ETag where the store
    gives one; a replaced object then fails to load), never credentials: each process uses the
    options configured for the URL (``configure_object_store``, or a loader's ``storage_options``,
    which reach its workers) or the client's defaults, which read the environment.
    ``memory://`` objects live in one process: load them there (``num_workers=0``).
    """

    def __init__(self, url: str, *, size: int | None = None, version: str | None = None,
                 allow_pickle: bool = False) -> None:
        from ._objects import is_url

        if not is_url(url):
            raise ValueError(f"{url=} is not an object-store URL (such as s3://bucket/key); use FileStorage for files")
        super().__init__(url)
        self.size = size
        self.version = version
        self.allow_pickle = allow_pickle

    @property
    def url(self) -> str:
        return self.path

    def save(self, data: Any) -> int:
        """Publish ``data`` as one object (whole or not at all); records its size and version; returns the size."""
        from . import _objects
        from ._tree import encode

        spec, leaves = encode(data, allow_pickle=self.allow_pickle)
        buffers, size = _format.serialize(spec, leaves)
        self.version = _objects.put(self.path, buffers)
        self.size = size
        return size

    def load(self) -> Any:
        """Read the sample in this process with ranged reads; its arrays are views onto one private buffer."""
        return self._load(_format.ReadOptions(self.allow_pickle))

    def _load(self, opts: _format.ReadOptions) -> Any:
        from . import _objects
        from ._tree import build

        header, head = _objects.read_header(self.path, self.size, self.version)
        buf = _allocate(header.data_size)
        _objects.read_into(self.path, memoryview(buf)[: header.data_size], header.data_offset, self.version, head)
        return build(header, buf, opts, path=self.path)

    def read_header(self) -> _format.Header:
        from ._objects import read_header

        return read_header(self.path, self.size, self.version)[0]
