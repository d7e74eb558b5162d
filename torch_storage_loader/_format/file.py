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
Reading is total: any bytes give a ``Header`` that is exactly what ``serialize`` writes (every
type checked, arrays laid out in order, the tree's leaves numbered depth-first, bounds from
``_bounded`` checked before the JSON is parsed), or ``StorageCorruptError`` naming the file and never
quoting it. Files are opened without following a symbolic link and without blocking, and must be
regular files (a FIFO or a device is refused, not waited on). Workers validate here, before any
slot is taken, so a refused file costs neither a slot nor a ring nor a worker.
This module imports neither torch nor the tree code, so worker processes start fast; the tree
spec's grammar and its check are in ``spec``.

Size: about 530 lines (400 of code), because writing and reading one versioned layout (header bytes,
array table, aligned reads and writes, safe opens) belong together; split, each half would
restate the layout the other relies on.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import stat
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

import numpy as np

from .._untrusted import bounded as _bounded
from ..errors import (
    PickleNotAllowedError,
    StorageCorruptError,
    StorageNotFoundError,
    UnsupportedLeafError,
    UntrustedStorageError,
)
from .names import temp_name
from .spec import check_tree, corrupt

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "ALIGN",
    "MAGIC",
    "VERSION",
    "ArrayEntry",
    "Header",
    "ReadOptions",
    "read_header",
    "read_into",
    "serialize",
    "write",
]

MAGIC = b"TSLSTOR\x00"
VERSION = 1
ALIGN = 64
FIXED = struct.Struct("<8sIIQQ")
MAX_HEADER = _bounded.HEADER_MAX_BYTES
MAX_DIMS = 64  # numpy's limit
_FIRST_READ = 64 << 10
_IOV_MAX = 512

# Element sizes of the torch dtypes a file may name (kept here so that workers need no torch).
TORCH_ITEMSIZE = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "uint16": 2,
    "int16": 2,
    "uint32": 4,
    "int32": 4,
    "uint64": 8,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
}
BYTE_KINDS = ("bytes", "bytearray", "pickle")
KINDS = ("numpy", "numpy_scalar", "torch") + BYTE_KINDS


class ReadOptions(NamedTuple):
    """How a reader turns bytes back into objects."""

    allow_pickle: bool = False  # unpickle "pickle" leaves (runs code from the file)
    as_tensors: bool = False  # numeric numpy leaves become torch tensors (no copy), as DataLoader does
    device: str | None = None  # the receiver copies the sample there (``_gpu.device``), e.g. "cuda"


DEFAULT_READ = ReadOptions()


class ArrayEntry(NamedTuple):
    kind: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class Leaf(Protocol):
    """What writing reads of a leaf (``tree.Leaf`` is one; this module does not import the tree code)."""

    @property
    def kind(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> Sequence[int]: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def data(self) -> np.ndarray[Any, np.dtype[np.uint8]]: ...


_Rows = tuple[tuple[object, ...], ...]  # a header's array entries as the plain tuples it pickles


@dataclass(frozen=True)
class Header:
    spec: list[Any]  # the tree spec, JSON nodes (see ``spec``)
    arrays: tuple[ArrayEntry, ...]
    data_offset: int
    data_size: int

    @property
    def file_size(self) -> int:
        return self.data_offset + self.data_size

    def __reduce__(self) -> tuple[Callable[[list[Any], _Rows, int, int], Header], tuple[list[Any], _Rows, int, int]]:
        # Plain tuples pickle several times faster than one object per array (samples can hold
        # hundreds of small arrays, and a header crosses a pipe with every sample).
        return _header, (self.spec, tuple(map(tuple, self.arrays)), self.data_offset, self.data_size)


def _header(spec: list[Any], arrays: _Rows, data_offset: int, data_size: int) -> Header:
    return Header(spec, tuple(map(ArrayEntry._make, arrays)), data_offset, data_size)


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def layout(leaves: Sequence[Leaf]) -> tuple[tuple[ArrayEntry, ...], int]:
    """Where each leaf goes in a data section (each at an aligned offset), and the section's size."""
    arrays: list[ArrayEntry] = []
    offset = 0
    for leaf in leaves:
        arrays.append(ArrayEntry(leaf.kind, leaf.dtype, tuple(leaf.shape), offset, leaf.nbytes))
        offset = align(offset + leaf.nbytes)
    return tuple(arrays), offset


def serialize(spec: list[Any], leaves: Sequence[Leaf]) -> tuple[list[bytes | memoryview], int]:
    """A file's bytes as a list of buffers (header, arrays, padding), and its size."""
    arrays, data_size = layout(leaves)
    header = json.dumps(
        {"arrays": arrays, "tree": spec}, sort_keys=True, separators=(",", ":"), allow_nan=False
    ).encode()
    _check_writable(header)
    data_offset = align(FIXED.size + len(header))
    head = FIXED.pack(MAGIC, VERSION, len(header), data_offset, data_size) + header
    buffers: list[bytes | memoryview] = [head + bytes(data_offset - len(head))]
    for leaf, entry in zip(leaves, arrays):
        if leaf.nbytes:
            buffers.append(leaf.data.data)  # the array's memoryview
        pad = align(entry.offset + entry.nbytes) - (entry.offset + entry.nbytes)
        if pad:
            buffers.append(bytes(pad))
    return buffers, data_offset + data_size


def write(path: str | os.PathLike[str], spec: list[Any], leaves: Sequence[Leaf], *, fsync: bool = False) -> int:
    """Write a file atomically (temporary name, then rename); returns its size in bytes."""
    path = os.fspath(path)
    buffers, size = serialize(spec, leaves)
    tmp = temp_name(path)
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


def _check_writable(header: bytes) -> None:
    """Refuse to write a header that readers would refuse (see ``_bounded``): a file must load where it saves."""
    values = 0 if len(header) <= _bounded.HEADER_MAX_VALUES else _bounded.measure(header, _bounded.HEADER_MAX_VALUES)[1]
    if len(header) > MAX_HEADER or values > _bounded.HEADER_MAX_VALUES:
        raise UnsupportedLeafError(
            f"the sample's header (its tree and one entry per array) would take {len(header)} bytes and {values} "
            f"JSON values, over what readers accept ({MAX_HEADER} bytes, {_bounded.HEADER_MAX_VALUES} values: about "
            "17,000 arrays); store fewer, larger arrays (stack small ones), and long text as bytes",
            key_path="<root>",
        )


def _writev_all(fd: int, buffers: list[bytes | memoryview]) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        written = os.writev(fd, views[:_IOV_MAX])
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if written:
            views[0] = views[0][written:]


# The dtype strings ``numpy.dtype.str`` gives for the kinds stored: "<f4", "|b1", "<U5", "<M8[ns]", ...
_DTYPE_STR = re.compile(r"[<|][biufcmMUS][0-9]{1,9}(\[[0-9]{0,9}[a-zA-Z]{1,3}\])?")


@functools.lru_cache(maxsize=1024)
def _itemsize(kind: str, dtype: str) -> int:
    if kind == "torch":
        return TORCH_ITEMSIZE[dtype]
    if kind in BYTE_KINDS:
        if dtype != "|u1":
            raise ValueError("bytes are stored as |u1")
        return 1
    if not _DTYPE_STR.fullmatch(dtype):
        raise ValueError("not a dtype string numpy writes")
    dt = np.dtype(dtype)
    if dt.kind not in "biufcmMUS" or dt.fields is not None or dt.str != dtype or dt.itemsize < 1:
        raise ValueError("not a dtype stored as raw bytes")
    return dt.itemsize


def header_end(raw: bytes | memoryview, path: str, file_size: int | None) -> int:
    """Check the fixed part at the start of a file (``raw``: at least its first bytes) and return the
    number of bytes from the file's start that ``parse_header`` needs: the end of its header."""
    if raw[: len(MAGIC)] != MAGIC[: len(raw)]:
        raise StorageCorruptError(
            f"{path}: not a torch_storage_loader file (it does not start with the format's magic bytes); pass "
            "only files written by FileStorage.save or a FileStorageLoader",
            path=path,
        )
    if len(raw) < FIXED.size:
        raise corrupt(path, f"file is truncated ({len(raw)} bytes)")
    header_len: int
    _, version, header_len, data_offset, data_size = FIXED.unpack_from(raw)
    if version != VERSION:
        raise StorageCorruptError(
            f"{path}: format version {version}, but this torch_storage_loader reads version {VERSION}; "
            "upgrade torch_storage_loader to read it",
            path=path,
        )
    if header_len > MAX_HEADER:
        raise corrupt(path, f"its header claims {header_len} bytes, over the {MAX_HEADER} a reader accepts")
    if data_offset != align(FIXED.size + header_len):
        raise corrupt(path, f"header length {header_len} / data offset {data_offset} are inconsistent")
    if file_size is not None and file_size != data_offset + data_size:
        raise corrupt(
            path, f"file is truncated or has trailing bytes: {file_size} bytes, header says {data_offset + data_size}"
        )
    return FIXED.size + header_len


def parse_header(raw: bytes | memoryview, path: str, file_size: int | None) -> Header:
    """Parse and validate the header at the start of a file; ``raw`` holds at least ``header_end`` bytes
    (fewer: the file shrank or was cut while it was read, a ``StorageCorruptError``)."""
    end = header_end(raw, path, file_size)
    if len(raw) < end:
        raise corrupt(
            path, f"its header needs {end} bytes, but only {len(raw)} could be read (the file shrank while it was read)"
        )
    _, _, _, data_offset, data_size = FIXED.unpack_from(raw)
    with memoryview(raw) as view:
        return _parse_doc(view[FIXED.size : end], path, data_offset, data_size)


# Headers parsed in this process, by their exact text and data size: consecutive samples of one
# structure often have byte-identical headers, which then cost a lookup instead of a parse. Bounded
# by count and by size; cleared when full.
_parsed: dict[tuple[bytes, int], tuple[list[Any], tuple[ArrayEntry, ...]]] = {}
_PARSED_MAX, _PARSED_MAX_TEXT, _PARSED_MAX_BYTES = 64, 256 << 10, 4 << 20
_parsed_bytes = 0


# Array tables parsed in this process, by their exact text (``{"arrays":[...]``, as written) and data
# size -> (the table, its count of JSON values). Samples of one structure share the table while
# their trees differ (an inline ``id``): then only the tree is parsed (``_parse_tree_only``). A table
# is kept the second time it is parsed (samples whose shapes vary never repeat one), while the kept
# texts take at most _TABLES_MAX_BYTES; both sets are cleared when full.
_tables: dict[tuple[bytes, int], tuple[tuple[ArrayEntry, ...], int]] = {}
_tables_seen: set[int] = set()  # hashes of the tables parsed once
_TABLE_HEAD, _TREE_KEY = b'{"arrays":', b'],"tree":'
_TABLES_MAX_BYTES = 1 << 20
_tables_bytes = 0
_kept_arrays: dict[int, tuple[ArrayEntry, ...]] = {}  # id -> the arrays of each kept table


def _parse_doc(text: memoryview, path: str, data_offset: int, data_size: int) -> Header:
    global _parsed_bytes
    key = (bytes(text), data_size) if len(text) <= _PARSED_MAX_TEXT else None
    known = _parsed.get(key) if key is not None else None
    if known is not None:
        return Header(known[0], known[1], data_offset, data_size)
    raw = key[0] if key is not None else b""  # (a header too long to keep is parsed whole)
    table = _table_key(raw, data_size)
    header = _parse_tree_only(raw, table, path, data_offset) if table is not None else None
    if header is None:
        header = _parse_new_doc(text, path, data_offset, data_size)
        if table is not None:
            _remember_table(table, header.arrays)
    if key is not None:
        if len(_parsed) >= _PARSED_MAX or _parsed_bytes + len(key[0]) > _PARSED_MAX_BYTES:
            _parsed.clear()
            _parsed_bytes = 0
        _parsed[key] = (header.spec, header.arrays)
        _parsed_bytes += len(key[0])
    return header


def _parse_new_doc(text: memoryview, path: str, data_offset: int, data_size: int) -> Header:
    try:
        doc = _bounded.loads(
            text,
            max_bytes=MAX_HEADER,
            max_depth=_bounded.HEADER_MAX_DEPTH,
            max_values=_bounded.HEADER_MAX_VALUES,
            floats=False,
        )
    except ValueError as exc:
        raise corrupt(path, f"its header is damaged: {exc}") from None
    if type(doc) is not dict or len(doc) != 2 or "arrays" not in doc or "tree" not in doc:
        raise corrupt(path, 'its header is not {"arrays": [...], "tree": ...}')
    arrays = _arrays(doc["arrays"], path, data_size)
    check_tree(doc["tree"], arrays, path)
    return Header(doc["tree"], arrays, data_offset, data_size)


def _table_key(raw: bytes, data_size: int) -> tuple[bytes, int] | None:
    """``raw`` up to its first ``],"tree":`` (where a table written by ``layout`` ends), and the data size."""
    i = raw.find(_TREE_KEY)
    return (raw[: i + 1], data_size) if i > 0 else None


def _parse_tree_only(raw: bytes, table: tuple[bytes, int], path: str, data_offset: int) -> Header | None:
    """The header of ``raw`` if its array table (``table``: ``_table_key``) is one parsed before (then
    only its tree is parsed and checked), else None. Whole, ``raw`` is ``{"arrays":`` + A +
    ``,"tree":`` + T + ``}`` with A a JSON array parsed before: A ends where a parser would end it, so
    the document holds exactly A and T, and its bounds follow from A's and T's. Whatever T fails on:
    None (the full parse says why)."""
    known = _tables.get(table) if raw[-1:] == b"}" else None
    if known is None or len(raw) > MAX_HEADER:
        return None
    i = len(table[0]) - 1  # where _TREE_KEY starts
    # The document's depth is 1 + A's or T's (A's passed), its values A's + T's + 3 ({, :, and , : of "tree").
    arrays, values = known
    try:
        tree = _bounded.loads(
            memoryview(raw)[i + len(_TREE_KEY) : -1],
            max_bytes=MAX_HEADER,
            max_depth=_bounded.HEADER_MAX_DEPTH - 1,
            max_values=_bounded.HEADER_MAX_VALUES - values - 3,
            floats=False,
        )
        check_tree(tree, arrays, path)
    except Exception:  # noqa: BLE001 - refused here, it is parsed whole, and that parse says why
        return None
    return Header(tree, arrays, data_offset, table[1])


def _remember_table(key: tuple[bytes, int], arrays: tuple[ArrayEntry, ...]) -> None:
    """After a full parse: keep its array table (``key``: ``_table_key``), if written as ``layout``
    writes it, the second time. Its text ends at the first ``],"tree":``: a table that parsed holds no
    object (no ``:`` outside its strings), and no JSON string holds an unescaped ``"``."""
    global _tables_bytes
    if not key[0].startswith(_TABLE_HEAD):
        return
    seen = hash(key)
    if seen not in _tables_seen:
        if len(_tables_seen) >= 4 * _PARSED_MAX:
            _tables_seen.clear()
        _tables_seen.add(seen)
        return
    if len(_tables) >= _PARSED_MAX or _tables_bytes + len(key[0]) > _TABLES_MAX_BYTES:
        _tables.clear()
        _kept_arrays.clear()
        _tables_bytes = 0
    _tables[key] = (arrays, _bounded.measure(memoryview(key[0])[len(_TABLE_HEAD) :])[1])
    _kept_arrays[id(arrays)] = arrays
    _tables_bytes += len(key[0])


def is_kept_table(arrays: tuple[ArrayEntry, ...]) -> bool:
    """Whether ``arrays`` is a kept table's object, which every header of that table parsed since
    shares (``_parse_tree_only``): worth keying things by."""
    return _kept_arrays.get(id(arrays)) is arrays


def _arrays(entries: object, path: str, data_size: int) -> tuple[ArrayEntry, ...]:
    """The array table, exactly as ``layout`` writes it: each entry typed and consistent, each array
    starting where the previous one ended (64-byte aligned), the last one ending the data section."""
    if type(entries) is not list:
        raise corrupt(path, "its array table is not a list")
    out: list[ArrayEntry] = []
    pos = 0
    for i, e in enumerate(entries):
        if type(e) is not list or len(e) != 5:
            raise _bad_array(path, i, "is not [kind, dtype, shape, offset, nbytes]")
        kind, dtype, shape, offset, nbytes = e
        if type(kind) is not str or kind not in KINDS:
            raise _bad_array(path, i, "has an unknown kind")
        if type(dtype) is not str or len(dtype) > 32:
            raise _bad_array(path, i, "has a dtype that is not a short string")
        try:
            itemsize = _itemsize(kind, dtype)
        except Exception:  # noqa: BLE001 - whatever numpy makes of it, it is not ours
            raise _bad_array(path, i, f"has a dtype this reader does not store as {kind}") from None
        if type(shape) is not list or len(shape) > MAX_DIMS:
            raise _bad_array(path, i, f"has a shape that is not a list of at most {MAX_DIMS} sizes")
        count = span = 1
        for n in shape:
            if type(n) is not int or not 0 <= n < 1 << 63:
                raise _bad_array(path, i, "has a size that is not an integer in [0, 2**63)")
            count *= n
            span *= n or 1
        if span * itemsize >= 1 << 63:  # numpy refuses such a shape even with a zero in it
            raise _bad_array(path, i, "has a shape too large to make, even empty")
        if (kind == "numpy_scalar" and shape) or (kind in BYTE_KINDS and len(shape) != 1):
            raise _bad_array(path, i, f"has a shape a {kind} leaf never has")
        if type(offset) is not int or type(nbytes) is not int:
            raise _bad_array(path, i, "has an offset or size that is not an integer")
        if nbytes != count * itemsize:
            raise _bad_array(path, i, "has a size that does not match its shape and dtype")
        if offset != pos:
            raise _bad_array(
                path,
                i,
                f"starts at {offset}, not at {pos} where the previous array ends "
                "(arrays are laid out in order, 64-byte aligned, never overlapping)",
            )
        if offset + nbytes > data_size:
            raise _bad_array(path, i, "ends past the data section")
        pos = align(offset + nbytes)
        out.append(ArrayEntry(kind, dtype, tuple(shape), offset, nbytes))
    if pos != data_size:
        raise corrupt(path, f"its data section is {data_size} bytes but its arrays take {pos}")
    return tuple(out)


def _bad_array(path: str, i: int, why: str) -> StorageCorruptError:
    return corrupt(path, f"array {i} of its header {why}")


def check_readable(header: Header, opts: ReadOptions, path: str) -> None:
    """Refuse, where the file is read (before a slot is taken), what the receiver would refuse to build."""
    if not opts.allow_pickle and any(e.kind == "pickle" for e in header.arrays):
        raise PickleNotAllowedError(
            f"{path}: holds a pickled value; loading it would run code from the file. Pass allow_pickle=True "
            "only if you trust whoever wrote it",
            path=path,
        )


def read_header(fd: int, path: str) -> Header:
    """Read and validate the header of an open file."""
    size = os.fstat(fd).st_size
    raw = os.pread(fd, _FIRST_READ, 0)
    need = header_end(raw, path, size)
    if len(raw) < need:
        raw = os.pread(fd, need, 0)
    return parse_header(raw, path, size)


def _not_found(path: str) -> str:
    """Why ``path`` is not there, and what to do: a handle whose directory does not exist on this
    machine names a file on the machine that saved it; one whose directory exists lost its file."""
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):
        return (
            f"{path}: no such storage file, and its directory {directory} does not exist on this machine. "
            "A handle names a path on the machine that saved it: to load on other machines, save into a "
            "shared filesystem mounted at the same path on every machine, or into object storage "
            "(FileStorageLoader('s3://bucket/prefix')) with the handles passed through Redis "
            "(RedisStorageQueue); or the directory was removed, or a relative path meant another working directory"
        )
    return (
        f"{path}: no such storage file; it was deleted (a FileStorageLoader's ttl expired, or it "
        "was shut down) or never written: raise ttl, or load before it expires"
    )


def open_storage(path: str) -> int:
    """Open a storage file to read: never through a symbolic link, never blocking (a FIFO), and
    only if it is a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        raise StorageNotFoundError(_not_found(path), path=path) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UntrustedStorageError(
                f"{path}: is a symbolic link; storage files are opened without following links (one in a "
                "watched directory could point anywhere): pass the path of the file itself",
                path=path,
            ) from None
        if exc.errno == errno.ENAMETOOLONG:
            raise StorageNotFoundError(f"{path}: the path is too long to be a storage file", path=path) from None
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            raise exc from None
        if stat.S_ISREG(mode):
            raise
        raise _not_regular(path, mode) from None  # a socket cannot even be opened (ENXIO)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _not_regular(path: str, mode: int) -> UntrustedStorageError:
    kind = (
        "a FIFO"
        if stat.S_ISFIFO(mode)
        else "a directory"
        if stat.S_ISDIR(mode)
        else "a device"
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "a special file"
    )
    return UntrustedStorageError(
        f"{path}: is {kind}, not a regular file; storage files are regular files written by "
        "torch_storage_loader (reading anything else could block or never end)",
        path=path,
    )


def preadv_into(fd: int, buffers: list[memoryview], offset: int, path: str) -> None:
    """Fill ``buffers`` (memoryviews) from ``offset``; a short file is a corrupt file."""
    if preadv_upto(fd, buffers, offset) < sum(len(b) for b in buffers):
        raise corrupt(path, "file shrank while it was read")


def preadv_upto(fd: int, buffers: list[memoryview], offset: int) -> int:
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


_Buf = TypeVar("_Buf", bound="Buffer")


def read_into(path: str, allocate: Callable[[int], _Buf]) -> tuple[Header, _Buf]:
    """Read a whole file: header, then the data section into ``allocate(size)`` (returned as made)."""
    fd = open_storage(path)
    try:
        header = read_header(fd, path)
        buf = allocate(header.data_size)
        preadv_into(fd, [memoryview(buf)[: header.data_size]], header.data_offset, path)
        return header, buf
    finally:
        os.close(fd)
