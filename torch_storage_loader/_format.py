"""The on-disk format, version 1. Reading it never unpickles unless the caller allows pickle.

Layout (all integers little-endian)::

    offset 0   8s   magic  b"TSLSTOR\\0"
           8   u32  format version (1)
          12   u32  header length in bytes (UTF-8 JSON)
          16   u64  data offset (a multiple of 64)
          24   u64  data size
          32   ...  header: {"arrays": [[kind, dtype, shape, offset, nbytes], ...], "tree": spec}
                    compact JSON with sorted keys, zero-padded up to the data offset
    data offset     array bytes, each array at a multiple of 64 from the data offset,
                    zero padding between; the file ends exactly at data offset + data size

Array offsets are relative to the data section, so a worker can ``readinto`` the whole section
(or scatter it with ``preadv``) straight into a shared-memory slot and the views line up.
This module imports neither torch nor the tree code, so worker processes start fast.
"""

from __future__ import annotations

import functools
import json
import os
import struct
import uuid
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from .errors import StorageCorruptError, StorageNotFoundError

__all__ = ["ALIGN", "ArrayEntry", "Header", "MAGIC", "ReadOptions", "VERSION", "read_header", "read_into", "serialize", "write"]

MAGIC = b"TSLSTOR\x00"
VERSION = 1
ALIGN = 64
FIXED = struct.Struct("<8sIIQQ")
MAX_HEADER = 256 << 20
_FIRST_READ = 64 << 10
_IOV_MAX = 512

# Element sizes of the torch dtypes a file may name (kept here so that workers need no torch).
TORCH_ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "uint32": 4, "int32": 4,
    "uint64": 8, "int64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex32": 4, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1,
    "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
}
BYTE_KINDS = ("bytes", "bytearray", "pickle")
KINDS = ("numpy", "numpy_scalar", "torch") + BYTE_KINDS


class ReadOptions(NamedTuple):
    """How a reader turns bytes back into objects."""

    allow_pickle: bool = False  # unpickle "pickle" leaves (runs code from the file)
    as_tensors: bool = False  # numeric numpy leaves become torch tensors (no copy), as DataLoader does
    device: str | None = None  # the receiver copies the sample there (``_device``), e.g. "cuda"


class ArrayEntry(NamedTuple):
    kind: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Header:
    spec: list
    arrays: tuple[ArrayEntry, ...]
    data_offset: int
    data_size: int

    @property
    def file_size(self) -> int:
        return self.data_offset + self.data_size

    def __reduce__(self):
        # Plain tuples pickle several times faster than one object per array (samples can hold
        # hundreds of small arrays, and a header crosses a pipe with every sample).
        return _header, (self.spec, tuple(map(tuple, self.arrays)), self.data_offset, self.data_size)


def _header(spec: list, arrays: tuple, data_offset: int, data_size: int) -> Header:
    return Header(spec, tuple(map(ArrayEntry._make, arrays)), data_offset, data_size)


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def layout(leaves: Sequence) -> tuple[tuple[ArrayEntry, ...], int]:
    """Where each leaf goes in a data section (each at an aligned offset), and the section's size."""
    arrays, offset = [], 0
    for leaf in leaves:
        arrays.append(ArrayEntry(leaf.kind, leaf.dtype, tuple(leaf.shape), offset, leaf.nbytes))
        offset = align(offset + leaf.nbytes)
    return tuple(arrays), offset


def serialize(spec: list, leaves: Sequence) -> tuple[list, int]:
    """A file's bytes as a list of buffers (header, arrays, padding), and its size."""
    arrays, data_size = layout(leaves)
    header = json.dumps({"arrays": arrays, "tree": spec}, sort_keys=True, separators=(",", ":"),
                        allow_nan=False).encode()
    data_offset = align(FIXED.size + len(header))
    head = FIXED.pack(MAGIC, VERSION, len(header), data_offset, data_size) + header
    buffers: list = [head + bytes(data_offset - len(head))]
    for leaf, entry in zip(leaves, arrays):
        if leaf.nbytes:
            buffers.append(memoryview(leaf.data))
        pad = align(entry.offset + entry.nbytes) - (entry.offset + entry.nbytes)
        if pad:
            buffers.append(bytes(pad))
    return buffers, data_offset + data_size


def write(path: str | os.PathLike, spec: list, leaves: Sequence, *, fsync: bool = False) -> int:
    """Write a file atomically (temporary name, then rename); returns its size in bytes."""
    path = os.fspath(path)
    buffers, size = serialize(spec, leaves)
    tmp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        _writev_all(fd, buffers)
        if fsync:
            os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        os.unlink(tmp)
        raise
    return size


def _writev_all(fd: int, buffers: list) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        written = os.writev(fd, views[:_IOV_MAX])
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if written:
            views[0] = views[0][written:]


def _corrupt(path: str, why: str) -> StorageCorruptError:
    return StorageCorruptError(
        f"{path}: {why}; it was not written completely by torch_storage_loader (or was damaged "
        "since): delete it, or save the sample again",
        path=path,
    )


@functools.lru_cache(maxsize=1024)
def _itemsize(kind: str, dtype: str) -> int:
    if kind == "torch":
        return TORCH_ITEMSIZE[dtype]
    if kind in BYTE_KINDS:
        if dtype != "|u1":
            raise ValueError(dtype)
        return 1
    dt = np.dtype(dtype)
    if dt.kind not in "biufcmMUS" or dt.fields is not None or dt.str != dtype:
        raise ValueError(dtype)
    return dt.itemsize


def parse_header(raw: bytes, path: str, file_size: int | None) -> tuple[Header, int]:
    """Parse a header from the start of a file; returns it and how many bytes it needs in total."""
    if raw[: len(MAGIC)] != MAGIC[: len(raw)]:
        raise StorageCorruptError(
            f"{path}: not a torch_storage_loader file (bad magic {bytes(raw[:8])!r}); pass only files "
            "written by FileStorage.save or a FileStorageLoader", path=path)
    if len(raw) < FIXED.size:
        raise _corrupt(path, f"file is truncated ({len(raw)} bytes)")
    magic, version, header_len, data_offset, data_size = FIXED.unpack_from(raw)
    if version != VERSION:
        raise StorageCorruptError(
            f"{path}: format version {version}, but this torch_storage_loader reads version {VERSION}; "
            "upgrade torch_storage_loader to read it",
            path=path,
        )
    if header_len > MAX_HEADER or data_offset != align(FIXED.size + header_len):
        raise _corrupt(path, f"header length {header_len} / data offset {data_offset} are inconsistent")
    if file_size is not None and file_size != data_offset + data_size:
        raise _corrupt(path, f"file is truncated or has trailing bytes: {file_size} bytes, "
                             f"header says {data_offset + data_size}")
    end = FIXED.size + header_len
    if len(raw) < end:
        return None, end  # type: ignore[return-value]
    try:
        doc = json.loads(bytes(raw[FIXED.size:end]))
        arrays = []
        for kind, dtype, shape, offset, nbytes in doc["arrays"]:
            if kind not in KINDS or not all(type(s) is int and s >= 0 for s in shape):
                raise ValueError(kind)
            count = 1
            for s in shape:
                count *= s
            if (type(offset) is not int or offset % ALIGN or offset < 0 or nbytes != count * _itemsize(kind, dtype)
                    or offset + nbytes > data_size):
                raise ValueError(offset)
            arrays.append(ArrayEntry(kind, dtype, tuple(shape), offset, nbytes))
        spec = doc["tree"]
    except (ValueError, KeyError, TypeError) as exc:
        raise _corrupt(path, f"header is damaged ({type(exc).__name__}: {exc})") from None
    return Header(spec, tuple(arrays), data_offset, data_size), end


def read_header(fd: int, path: str) -> Header:
    """Read and validate the header of an open file."""
    size = os.fstat(fd).st_size
    raw = os.pread(fd, _FIRST_READ, 0)
    header, need = parse_header(raw, path, size)
    if header is None:
        header, _ = parse_header(raw + os.pread(fd, need - len(raw), len(raw)), path, size)
    return header


def open_storage(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise StorageNotFoundError(
            f"{path}: no such storage file; it was deleted (a FileStorageLoader's ttl expired, or it "
            "was shut down) or never written: raise ttl, or load before it expires",
            path=path,
        ) from None


def preadv_into(fd: int, buffers: list, offset: int, path: str) -> None:
    """Fill ``buffers`` (memoryviews) from ``offset``; a short file is a corrupt file."""
    if preadv_upto(fd, buffers, offset) < sum(len(b) for b in buffers):
        raise _corrupt(path, "file shrank while it was read")


def preadv_upto(fd: int, buffers: list, offset: int) -> int:
    """Fill ``buffers`` (memoryviews) from ``offset`` until they are full or the file ends; the bytes read."""
    total = 0
    views = [b for b in buffers if len(b)]
    while views:
        got = os.preadv(fd, views[:_IOV_MAX], offset)
        if got == 0:
            break
        total += got
        offset += got
        while views and got >= len(views[0]):
            got -= len(views[0])
            views.pop(0)
        if got:
            views[0] = views[0][got:]
    return total


def read_into(path: str, allocate) -> tuple[Header, memoryview]:
    """Read a whole file: header, then the data section into ``allocate(size)``."""
    fd = open_storage(path)
    try:
        header = read_header(fd, path)
        buf = allocate(header.data_size)
        preadv_into(fd, [memoryview(buf)[: header.data_size]], header.data_offset, path)
        return header, buf
    finally:
        os.close(fd)
