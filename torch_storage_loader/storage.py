"""Storage handles: tiny, picklable references to where a sample's bytes live."""

from __future__ import annotations

import mmap
import os
from abc import ABC, abstractmethod
from typing import Any

from . import _ding
from ._format import file as _format

__all__ = ["FileStorage", "ObjectStorage", "Storage"]


class Storage(ABC):
    """A handle to one saved sample. Pickle the handle, never the data.

    Subclasses implement ``save`` and ``load``; loaders call ``load`` in worker processes, so a
    subclass must be importable there (define it in a module, not in a notebook cell, for spawn).
    Two handles are equal when they are of the same type and have the same attributes.

    Args:
        path: Where the sample lives: a file path or a URL, as the subclass reads it.
    """

    def __init__(self, path: str) -> None:
        self.path = path

    @abstractmethod
    def save(self, data: Any) -> Any:  # FileStorage returns the bytes written
        """Write one sample where the handle points.

        Args:
            data: The sample: a tensor, an array, or a nest of dicts, lists and tuples of them.

        Returns:
            What the subclass reports; ``FileStorage`` and ``ObjectStorage`` return the size in bytes.
        """

    @abstractmethod
    def load(self) -> Any:
        """Read the sample back, in the calling process.

        Returns:
            The sample, with the structure it was saved with.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((type(self), self.path))


def _allocate(size: int) -> mmap.mmap | bytearray:
    # Page-aligned, writable, and released when the last view onto it is gone.
    return mmap.mmap(-1, size) if size else bytearray()


class FileStorage(Storage):
    """One sample in one file, in this library's format (see ``_format``).

    ``allow_pickle`` lets ``save`` pickle values it cannot store as raw bytes, and ``load`` unpickle
    them; leave it off unless every writer of the file is trusted.

    Args:
        path: The file's path.
        allow_pickle: Let ``save`` pickle values it cannot store as raw bytes, and ``load`` unpickle them.

    Examples:
        >>> import torch
        >>> from torch_storage_loader import FileStorage
        >>> handle = FileStorage("sample.tsl")
        >>> handle.save({"x": torch.arange(3)}) > 0
        True
        >>> handle.load()["x"]
        tensor([0, 1, 2])
    """

    def __init__(self, path: str | os.PathLike[str], *, allow_pickle: bool = False) -> None:
        super().__init__(os.fspath(path))
        self.allow_pickle = allow_pickle

    def save(self, data: Any, *, fsync: bool = False) -> int:
        """Write ``data`` atomically: readers see the old file or the whole new one, never a part.

        Args:
            data: The sample: tensors, arrays and plain values, nested in dicts, lists and tuples.
            fsync: Flush the file's bytes to disk before it takes the path's name, so a crash of
                the machine cannot leave a named but incomplete file; slower.

        Returns:
            The file's size in bytes.

        Raises:
            UnsupportedLeafError: ``data`` holds a value that needs pickle and ``allow_pickle`` is off.
        """
        from ._format.tree import encode

        spec, leaves = encode(data, allow_pickle=self.allow_pickle)
        return _format.write(self.path, spec, leaves, fsync=fsync)

    def load(self) -> Any:
        """Read the sample in this process; its arrays are views onto one private buffer.

        Returns:
            The sample, with the structure it was saved with.

        Raises:
            StorageNotFoundError: The file does not exist.
            StorageCorruptError: The file is truncated, damaged, or not in this library's format.
            PickleNotAllowedError: The file holds pickled values and ``allow_pickle`` is off.
        """
        return self._load(_format.ReadOptions(self.allow_pickle))

    def _load(self, opts: _format.ReadOptions) -> Any:
        from ._format.tree import build

        header, buf = _format.read_into(self.path, _allocate)
        return build(header, buf, opts, path=self.path)

    def read_header(self) -> _format.Header:
        """Read only the file's header: its structure, and where and how large its data is.

        Returns:
            The parsed header (the format is described in the docs' File format page).
        """
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

    Args:
        url: The object's URL (``s3://bucket/key``, or any fsspec URL).
        size: The object's size in bytes, as ``save`` recorded it; a load checks it when given.
        version: The object's version tag (ETag), as ``save`` recorded it; a load of a replaced
            object fails when given.
        allow_pickle: Let ``save`` pickle values it cannot store as raw bytes, and ``load`` unpickle them.

    Raises:
        ValueError: ``url`` is not an object-store URL.
    """

    def __init__(
        self, url: str, *, size: int | None = None, version: str | None = None, allow_pickle: bool = False
    ) -> None:
        from ._stores.objects import is_url

        if not is_url(url):
            raise ValueError(f"{url=} is not an object-store URL (such as s3://bucket/key); use FileStorage for files")
        super().__init__(url)
        self.size = size
        self.version = version
        self.allow_pickle = allow_pickle

    @property
    def url(self) -> str:
        """The object's URL (the same as ``path``)."""
        return self.path

    def save(self, data: Any) -> int:
        """Publish ``data`` as one object (whole or not at all), and record its size and version.

        Args:
            data: The sample: tensors, arrays and plain values, nested in dicts, lists and tuples.

        Returns:
            The object's size in bytes.

        Raises:
            UnsupportedLeafError: ``data`` holds a value that needs pickle and ``allow_pickle`` is off.
            StorageUnavailableError: The store could not be reached after retries.
        """
        from ._format.tree import encode
        from ._stores import objects as _objects

        spec, leaves = encode(data, allow_pickle=self.allow_pickle)
        buffers, size = _format.serialize(spec, leaves)
        self.version = _objects.put(self.path, buffers)
        self.size = size
        return size

    def load(self) -> Any:
        """Read the sample in this process with ranged reads; its arrays are views onto one private buffer.

        Returns:
            The sample, with the structure it was saved with.

        Raises:
            StorageNotFoundError: The object does not exist.
            StorageCorruptError: The object is damaged, not in this library's format, or was replaced
                (its size or version differs from the handle's).
            StorageUnavailableError: The store could not be reached after retries.
        """
        return self._load(_format.ReadOptions(self.allow_pickle))

    def _load(self, opts: _format.ReadOptions) -> Any:
        from ._format.tree import build
        from ._stores import objects as _objects

        header, head = _objects.read_header(self.path, self.size, self.version)
        buf = _allocate(header.data_size)
        _objects.read_into(self.path, memoryview(buf)[: header.data_size], header.data_offset, self.version, head)
        return build(header, buf, opts, path=self.path)

    def read_header(self) -> _format.Header:
        """Read only the object's header (one ranged read): its structure, and where and how large its data is.

        Returns:
            The parsed header (the format is described in the docs' File format page).
        """
        from ._stores.objects import read_header

        return read_header(self.path, self.size, self.version)[0]


# DI-engine's middleware recognises handles by ``isinstance(x, ding.data.Storage)``: ours are, once
# (and if ever) DI-engine is imported, so switching a pipeline takes an import change (see _ding).
_ding.install(Storage)
