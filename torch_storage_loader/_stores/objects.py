"""Object stores (``s3://``, ``gs://``, ``memory://``: any fsspec URL) as the home of payloads.

Each process reads and writes with the options registered for a URL (``configure``: a loader's
``storage_options``, which its workers receive with ``snapshot``/``apply``), else with the client's
own defaults, which read the environment (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ...).
Handles never carry credentials.

Loader and DataLoader workers may read ``s3://`` objects through obstore (``s3``); everything else
goes through fsspec. Transient failures are retried with exponential back-off (``_retry``) for
``retry_timeout`` seconds; then ``StorageUnavailableError`` names the URL and the endpoint.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, ParamSpec, TypeVar

from .._format import file as _format
from .._format.spec import corrupt
from .._retry import Backoff
from ..errors import StorageCorruptError, StorageError, StorageNotFoundError, StorageUnavailableError
from . import s3 as _s3
from .config import (  # the object-store facade: callers find configuration here too
    Config,
    apply,
    config_for,
    configure_object_store,
    filesystem,
    is_url,
    local_path,
    protocol,
    root,
    snapshot,
)
from .s3 import use_obstore_here

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "Config",
    "apply",
    "bounded",
    "config_for",
    "configure_object_store",
    "create_if_absent",
    "exists",
    "filesystem",
    "is_url",
    "listing",
    "local_path",
    "protocol",
    "put",
    "read_all",
    "read_head",
    "read_header",
    "read_into",
    "remove",
    "root",
    "snapshot",
    "use_obstore_here",
]


CHUNK = 8 << 20  # a large sample is read as ranges of this size ...
WINDOW = 4  # ... this many in flight at a time: at most 32 MiB held on top of the slot
_HEAD = 64 << 10  # the first read: the header, and the whole of a small sample


# --------------------------------------------------------------------------------- retries
def _kind(exc: BaseException) -> str:
    name = type(exc).__name__
    text = str(exc)
    if isinstance(exc, StorageError):
        return "ours"
    if isinstance(exc, FileExistsError) or name == "AlreadyExistsError":
        return "exists"
    if isinstance(exc, FileNotFoundError) or name in ("NotFoundError", "NoSuchKey", "NoSuchBucket"):
        return "missing"
    if name == "PreconditionError" or "pre-condition" in text or "PreconditionFailed" in text:
        return "changed"
    if isinstance(exc, PermissionError) or name in (
        "PermissionDeniedError",
        "UnauthenticatedError",
        "NoCredentialsError",
        "PartialCredentialsError",
    ):
        return "denied"
    if (
        isinstance(exc, OSError) and exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ERANGE)
    ) or name in ("NotSupportedError", "NotImplementedError", "InvalidPathError"):
        return "other"  # a request the store refuses (bad range, unsupported feature): retrying cannot help
    if isinstance(exc, (OSError, TimeoutError)) or type(exc).__module__.split(".")[0] in (
        "aiohttp",
        "botocore",
        "aiobotocore",
        "obstore",
        "urllib3",
        "requests",
    ):
        return "transient"
    return "other"


def _endpoint(url: str) -> str:
    opts = config_for(url).storage_options
    return (
        opts.get("endpoint_url")
        or opts.get("client_kwargs", {}).get("endpoint_url")
        or os.environ.get(f"AWS_ENDPOINT_URL_{protocol(url).upper()}")
        or os.environ.get("AWS_ENDPOINT_URL")
        or f"the default {protocol(url)}:// endpoint"
    )


_local = threading.local()  # per thread: a stop event and a deadline that cut retries short (see bounded)


@contextlib.contextmanager
def bounded(stop: threading.Event | None = None, seconds: float | None = None) -> Iterator[None]:
    """Within the block, this thread's retries give up once ``stop`` is set or after ``seconds``
    (``StorageUnavailableError``), whatever ``retry_timeout`` says: for background threads that must
    stop when asked, and for shutdowns that must end while a store is down."""
    saved = getattr(_local, "stop", None), getattr(_local, "deadline", None)
    _local.stop = stop if stop is not None else saved[0]
    _local.deadline = time.monotonic() + seconds if seconds is not None else saved[1]
    try:
        yield
    finally:
        _local.stop, _local.deadline = saved


_P = ParamSpec("_P")
_T = TypeVar("_T")


def retrying(url: str, what: str, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """``fn(*args, **kwargs)``, retried on transient errors; client errors become ours, naming ``url``."""
    backoff = None  # the time budget starts at the first failure
    stop, cut = getattr(_local, "stop", None), getattr(_local, "deadline", None)
    while True:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            kind = _kind(exc)
            if kind == "missing":
                raise StorageNotFoundError(
                    f"{url}: no such object; it was deleted (a FileStorageLoader's ttl expired, or a consumer "
                    "acknowledged it) or never written: raise ttl, or load before it expires",
                    path=url,
                ) from None
            if kind == "changed":
                raise StorageCorruptError(
                    f"{url}: the object was replaced after its handle was made (its "
                    "version tag differs); save the sample again",
                    path=url,
                ) from None
            if kind == "denied":
                raise StorageUnavailableError(
                    f"{url}: {what} was refused ({type(exc).__name__}: {exc}); check the credentials given as "
                    "storage_options or in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)",
                    url=url,
                ) from None
            if kind == "exists":
                raise FileExistsError(f"{url}: an object has this name already") from None
            if kind != "transient":
                raise
            backoff = backoff or Backoff(config_for(url).retry_timeout, cap=2.0)
            now = time.monotonic()
            if backoff.spent(now):
                raise StorageUnavailableError(
                    f"{url}: {what} kept failing for {backoff.seconds:g} s ({type(exc).__name__}: {exc}); is the "
                    f"object store at {_endpoint(url)} running and reachable? (retry_timeout sets how long to retry)",
                    url=url,
                ) from exc
            if (stop is not None and stop.is_set()) or (cut is not None and now + backoff.delay > cut):
                raise StorageUnavailableError(
                    f"{url}: {what} failed ({type(exc).__name__}: {exc}) and was not retried further: the thread "
                    "is stopping",
                    url=url,
                ) from exc
            backoff.wait(stop)


# --------------------------------------------------------------------------------- obstore
def _obstore(url: str) -> object | None:
    """An obstore store for ``url``'s bucket (only ``s3`` uses it), or None (not S3, not a worker, not
    installed, or options it cannot take): see ``s3``."""
    if protocol(url) not in ("s3", "s3a"):
        return None
    store: object | None = _s3.store(root(url), config_for(url).storage_options)
    return store


def _get_ranges(
    url: str, ranges: list[tuple[int, int]], version: str | None, sink: Callable[[int, Buffer], None]
) -> None:
    """Read ``ranges`` of ``url``, at most ``WINDOW`` in flight at a time; ``sink(i, data)`` takes range ``i``
    as it arrives (and must copy it: the buffer is dropped afterwards)."""
    store = _obstore(url)
    if store is not None:
        _s3.get_ranges(store, url, ranges, version, WINDOW, sink)
        return
    fs = filesystem(url)
    if len(ranges) == 1:
        sink(0, fs.cat_file(url, start=ranges[0][0], end=ranges[0][1]))
        return
    for w in range(0, len(ranges), WINDOW):
        part = ranges[w : w + WINDOW]
        for i, data in enumerate(
            fs.cat_ranges([url] * len(part), [r[0] for r in part], [r[1] for r in part], on_error="raise"), w
        ):
            sink(i, data)
            del data


def _get(url: str, start: int, end: int, version: str | None) -> Buffer:
    """Bytes ``start:end`` of ``url``: ``bytes`` from fsspec, a buffer of obstore's own from obstore."""
    out: list[Buffer] = []
    _get_ranges(url, [(start, end)], version, lambda i, data: out.append(data))
    return out[0]


# ----------------------------------------------------------------------------- the format
def read_header(url: str, size: int | None, version: str | None) -> tuple[_format.Header, memoryview]:
    """The header of an object, and the bytes read so far (all of a small sample)."""
    if size is None:
        size = retrying(url, "reading the size", lambda: filesystem(url).size(url))
    first = min(size, _HEAD) if size else _HEAD
    raw = memoryview(retrying(url, "reading the header", _get, url, 0, first, version))
    if len(raw) < first:
        raise corrupt(url, f"object is truncated ({len(raw)} bytes, its handle says {size})")
    need = _format.header_end(raw, url, size)
    if len(raw) < need:
        rest = memoryview(retrying(url, "reading the header", _get, url, len(raw), need, version))
        if len(rest) != need - len(raw):
            raise corrupt(url, f"object is truncated ({len(raw) + len(rest)} bytes, its header needs {need})")
        raw = memoryview(bytes(raw) + bytes(rest))  # (obstore gives a buffer of its own, not bytes)
        del rest
    return _format.parse_header(raw, url, size), raw


def read_into(url: str, view: memoryview, offset: int, version: str | None, have: memoryview) -> None:
    """Fill ``view`` with the object's bytes from ``offset``: first from ``have`` (bytes from 0), then
    with ranged reads of ``CHUNK`` bytes, ``WINDOW`` in flight at a time, each copied as it lands."""
    done = max(0, min(len(view), len(have) - offset))
    view[:done] = have[offset : offset + done]
    ranges = [(offset + s, offset + min(s + CHUNK, len(view))) for s in range(done, len(view), CHUNK)]
    if not ranges:
        return

    def land(i: int, data: Buffer) -> None:
        start, end = ranges[i]
        with memoryview(data) as part:
            if len(part) != end - start:
                raise corrupt(url, f"object shrank while it was read ({len(part)} of {end - start} bytes)")
            view[start - offset : end - offset] = part

    retrying(url, "reading", _get_ranges, url, ranges, version, land)


def put(url: str, buffers: list[bytes | memoryview]) -> str | None:
    """Publish one object whole (an object store shows a PUT only once complete); returns its version tag."""
    data = b"".join(buffers)
    response = retrying(url, "writing", filesystem(url).pipe_file, url, data)
    etag = response.get("ETag") if isinstance(response, dict) else None
    return etag.strip('"') if etag else None


def create_if_absent(url: str, data: bytes) -> bool:
    """Create ``url`` only if no object has its name (a conditional PUT); False if one does.

    ``data`` should be unique to the caller: a PUT that succeeded but whose reply was lost is
    retried, refused, and then recognised by reading the object back.
    """
    try:
        retrying(url, "claiming", filesystem(url).pipe_file, url, data, mode="create")
    except (FileExistsError, StorageCorruptError):  # the store refused: the name is taken
        try:
            return read_head(url, len(data) + 1) == data
        except StorageNotFoundError:
            return False  # taken, then released meanwhile: the next listing offers it again
    return True


def exists(url: str) -> bool:
    """Whether ``url`` exists now (asks the store; never a listing cache)."""
    try:
        retrying(url, "checking", filesystem(url).info, url, refresh=True)
    except StorageNotFoundError:
        return False
    return True


def read_all(url: str) -> bytes:
    data: bytes = retrying(url, "reading", filesystem(url).cat_file, url)
    return data


def read_head(url: str, limit: int) -> bytes:
    """At most the first ``limit`` bytes of ``url`` (one ranged read: never the whole of a large object)."""
    data: bytes = retrying(url, "reading", filesystem(url).cat_file, url, start=0, end=limit)
    return data


def remove(url: str) -> bool:
    try:
        retrying(url, "deleting", filesystem(url).rm_file, url)
    except StorageNotFoundError:
        return False
    return True


_BUCKETED = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss")


class Entry(NamedTuple):
    url: str
    size: int
    mtime: float  # seconds since the epoch, by the store's clock
    version: str | None


def listing(prefix: str) -> list[Entry]:
    """The objects directly under ``prefix`` (fresh: never from a listing cache)."""
    fs = filesystem(prefix)
    proto = protocol(prefix)

    def ls() -> list[dict[str, Any]]:
        try:
            infos: list[dict[str, Any]] = fs.ls(prefix, detail=True, refresh=True)
            return infos
        except FileNotFoundError:
            if proto in _BUCKETED and not fs.exists(root(prefix)):
                raise StorageNotFoundError(
                    f"{prefix}: bucket {root(prefix)} does not exist; create it, or check the URL", path=prefix
                ) from None
            return []  # nothing under the prefix yet

    out: list[Entry] = []
    for info in retrying(prefix, "listing", ls):
        if info.get("type") != "file":
            continue
        modified = info.get("LastModified") or info.get("created") or info.get("mtime") or 0
        mtime = modified.timestamp() if isinstance(modified, datetime.datetime) else float(modified)
        etag = info.get("ETag")
        name = info["name"]
        out.append(
            Entry(
                name if "://" in name else f"{proto}://{name}",
                int(info.get("size") or 0),
                mtime,
                etag.strip('"') if etag else None,
            )
        )
    return out
