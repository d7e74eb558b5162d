"""Object stores (``s3://``, ``gs://``, ``memory://``: any fsspec URL) as the home of payloads.

Each process reads and writes with the options registered for a URL (``configure``: a loader's
``storage_options``, which its workers receive with ``snapshot``/``apply``), else with the client's
own defaults, which read the environment (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ...).
Handles never carry credentials.

Loader and DataLoader workers read ``s3://`` objects through obstore when it is installed and
the options translate to it (on these machines it reads 7 MB objects 1.5 to 2x faster than
s3fs); everything else goes through fsspec. The trainer's own process never starts obstore's
runtime, which a forked child (a DataLoader worker) could not use. Transient failures are retried with exponential back-off for ``retry_timeout``
seconds; then ``StorageUnavailableError`` names the URL and the endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import errno
import os
import sys
import threading
import time
from typing import Any, Callable, Iterator, NamedTuple

import logging

from . import _format
from .errors import StorageCorruptError, StorageError, StorageNotFoundError, StorageUnavailableError

__all__ = ["Config", "apply", "bounded", "configure_object_store", "create_if_absent", "exists", "is_url", "listing",
           "put", "read_all", "read_head", "read_header", "read_into", "remove", "snapshot", "use_obstore_here"]

logger = logging.getLogger(__name__)

DEFAULT_RETRY_S = 30.0
CHUNK = 8 << 20  # a large sample is read as ranges of this size ...
WINDOW = 4  # ... this many in flight at a time: at most 32 MiB held on top of the slot
_HEAD = 64 << 10  # the first read: the header, and the whole of a small sample


class Config(NamedTuple):
    storage_options: dict
    retry_timeout: float

    def __repr__(self) -> str:  # options hold credentials: never print them
        return f"Config(storage_options=<{len(self.storage_options)} options>, retry_timeout={self.retry_timeout})"


_lock = threading.Lock()
_config: dict[str, Config] = {}  # "proto://bucket", "proto" or "*" -> Config
_stores: dict[tuple, Any] = {}  # (pid, "proto://bucket", options) -> obstore store


def protocol(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url else "file"


def is_url(path: Any) -> bool:
    """Whether ``path`` names an object store rather than a local path (``file://`` is local)."""
    return isinstance(path, str) and protocol(path) not in ("file", "local")


def local_path(path: str) -> str:
    return path.split("://", 1)[1] if isinstance(path, str) and protocol(path) in ("file", "local") and "://" in path \
        else path


def _root(url: str) -> str:
    proto, rest = url.split("://", 1)
    return f"{proto}://{rest.split('/', 1)[0]}"


def configure_object_store(url: str, storage_options: dict | None = None, *,
                           retry_timeout: float | None = None) -> None:
    """Use ``storage_options`` (given to fsspec as they are: for s3fs ``key``, ``secret``,
    ``endpoint_url``...) for objects under ``url``'s bucket, in this process and in the workers of
    loaders and DataLoaders started after this call.

    ``url`` may also be a bare protocol (``"s3"``) or ``"*"`` (every object store); the most
    specific entry applies. Transient errors are retried for ``retry_timeout`` seconds (default 30)
    before ``StorageUnavailableError``. Either argument left as None keeps what was set before.
    """
    if retry_timeout is not None and retry_timeout <= 0:
        raise ValueError(f"{retry_timeout=} must be > 0 seconds")
    key = url if url == "*" or "://" not in url else _root(url)
    with _lock:
        old = _config.get(key)
        options = dict(storage_options) if storage_options is not None else (old.storage_options if old else {})
        timeout = retry_timeout if retry_timeout is not None else (old.retry_timeout if old else DEFAULT_RETRY_S)
        _config[key] = Config(options, timeout)


def snapshot() -> dict[str, Config]:
    """This process's configuration, to hand to a worker process (pickled; stays in our processes)."""
    with _lock:
        return dict(_config)


def apply(config: dict[str, Config], *, overwrite: bool = True) -> None:
    """Register a snapshot; ``overwrite=False`` keeps what this process has (a forked child's is newer)."""
    with _lock:
        for key, value in config.items():
            if overwrite or key not in _config:
                _config[key] = value


def _config_for(url: str) -> Config:
    with _lock:
        for key in (_root(url), protocol(url), "*"):
            if key in _config:
                return _config[key]
    return Config({}, DEFAULT_RETRY_S)


def filesystem(url: str):
    import fsspec

    return fsspec.filesystem(protocol(url), **_config_for(url).storage_options)  # cached per options and process


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
    if isinstance(exc, PermissionError) or name in ("PermissionDeniedError", "UnauthenticatedError",
                                                    "NoCredentialsError", "PartialCredentialsError"):
        return "denied"
    if isinstance(exc, OSError) and exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ERANGE) \
            or name in ("NotSupportedError", "NotImplementedError", "InvalidPathError"):
        return "other"  # a request the store refuses (bad range, unsupported feature): retrying cannot help
    if isinstance(exc, (OSError, TimeoutError)) or type(exc).__module__.split(".")[0] in (
            "aiohttp", "botocore", "aiobotocore", "obstore", "urllib3", "requests"):
        return "transient"
    return "other"


def _endpoint(url: str) -> str:
    opts = _config_for(url).storage_options
    return (opts.get("endpoint_url") or opts.get("client_kwargs", {}).get("endpoint_url")
            or os.environ.get(f"AWS_ENDPOINT_URL_{protocol(url).upper()}") or os.environ.get("AWS_ENDPOINT_URL")
            or f"the default {protocol(url)}:// endpoint")


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


def retrying(url: str, what: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, retried on transient errors; client errors become ours, naming ``url``."""
    delay, deadline = 0.05, None
    stop, cut = getattr(_local, "stop", None), getattr(_local, "deadline", None)
    while True:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            kind = _kind(exc)
            if kind == "missing":
                raise StorageNotFoundError(
                    f"{url}: no such object; it was deleted (a FileStorageLoader's ttl expired, or a consumer "
                    "acknowledged it) or never written: raise ttl, or load before it expires", path=url) from None
            if kind == "changed":
                raise StorageCorruptError(f"{url}: the object was replaced after its handle was made (its "
                                          "version tag differs); save the sample again", path=url) from None
            if kind == "denied":
                raise StorageUnavailableError(
                    f"{url}: {what} was refused ({type(exc).__name__}: {exc}); check the credentials given as "
                    "storage_options or in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)",
                    url=url) from None
            if kind == "exists":
                raise FileExistsError(f"{url}: an object has this name already") from None
            if kind != "transient":
                raise
            timeout = _config_for(url).retry_timeout
            now = time.monotonic()
            deadline = now + timeout if deadline is None else deadline
            if now + delay > deadline:
                raise StorageUnavailableError(
                    f"{url}: {what} kept failing for {timeout:g} s ({type(exc).__name__}: {exc}); is the object "
                    f"store at {_endpoint(url)} running and reachable? (retry_timeout sets how long to retry)",
                    url=url) from exc
            if (stop is not None and stop.is_set()) or (cut is not None and now + delay > cut):
                raise StorageUnavailableError(
                    f"{url}: {what} failed ({type(exc).__name__}: {exc}) and was not retried further: the thread "
                    "is stopping", url=url) from exc
            if stop is not None:
                stop.wait(delay)
            else:
                time.sleep(delay)
            delay = min(delay * 2, 2.0)


# --------------------------------------------------------------------------------- obstore
_S3_KEYS = {"key": "access_key_id", "secret": "secret_access_key", "token": "session_token",
            "endpoint_url": "endpoint", "region_name": "region"}
_S3_IGNORED = {"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths", "default_block_size",
               "default_fill_cache", "default_cache_type", "asynchronous", "loop", "retries", "cache_regions",
               "version_aware", "use_ssl"}


# obstore's runtime does not survive fork: a forked child of a process that used it hangs in it.
# So only worker processes use it (they opt in), and never one forked from a process that had
# imported it (the trainer never does, unless its own code uses obstore).
_obstore_allowed = False
_obstore_used = False
_obstore_poisoned = False


def use_obstore_here() -> None:
    """Let this process (a loader or DataLoader worker) read ``s3://`` objects through obstore."""
    global _obstore_allowed
    _obstore_allowed = not _obstore_poisoned


def _after_fork_in_child() -> None:
    global _obstore_allowed, _obstore_poisoned, _lock
    # Imported by the parent (by this library in a worker, or by the user): its runtime may be running.
    _obstore_allowed, _obstore_poisoned = False, _obstore_poisoned or _obstore_used or "obstore" in sys.modules
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)


def _obstore(url: str):
    """An obstore store for ``url``'s bucket, or None (not S3, not a worker, not installed, or options
    it cannot take)."""
    global _obstore_used
    if not _obstore_allowed or protocol(url) not in ("s3", "s3a"):
        return None
    _obstore_used = True
    opts = _config_for(url).storage_options
    key = (os.getpid(), _root(url), repr(sorted(opts.items())))
    with _lock:
        if key in _stores:
            return _stores[key]
    store = None
    try:
        from obstore.store import S3Store
    except ImportError:
        pass
    else:
        config: dict[str, Any] = {}
        flat = {k: v for k, v in opts.items() if v is not None}
        flat.update({k: v for k, v in (flat.pop("client_kwargs", None) or {}).items() if v is not None})
        translatable = True
        for k, v in flat.items():
            if k in _S3_KEYS:
                config[_S3_KEYS[k]] = v
            elif k == "anon":
                config["skip_signature"] = bool(v)
            elif k not in _S3_IGNORED:
                translatable = False  # an s3fs option obstore has no equivalent for: read through s3fs
        # obstore reads credentials from options and AWS_* variables only, not from ~/.aws profiles,
        # SSO or credential processes as botocore does: leave those setups to s3fs.
        explicit = "access_key_id" in config or config.get("skip_signature") or os.environ.get("AWS_ACCESS_KEY_ID")
        if translatable and explicit:
            try:
                store = _s3_store(S3Store, _root(url).split("://", 1)[1], config)
            except Exception as exc:  # options obstore rejects: s3fs reads instead
                logger.debug("obstore cannot read %s (%s): reading through s3fs", _root(url), exc)
    with _lock:
        _stores[key] = store
    return store


def _s3_store(S3Store, bucket: str, config: dict):
    endpoint = config.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    config.setdefault("region", os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1")
    client = {"allow_http": True} if endpoint and endpoint.startswith("http://") else {}
    # A few quick retries in the client; longer outages are ``retrying``'s.
    retry = {"max_retries": 2, "retry_timeout": datetime.timedelta(seconds=5),
             "backoff": {"init_backoff": datetime.timedelta(milliseconds=50),
                         "max_backoff": datetime.timedelta(seconds=1), "base": 2}}
    return S3Store(bucket, config=config, client_options=client, retry_config=retry)


def _key(url: str) -> str:
    return url.split("://", 1)[1].split("/", 1)[1]


def _get_ranges(url: str, ranges: list[tuple[int, int]], version: str | None, sink: Callable[[int, Any], None]) -> None:
    """Read ``ranges`` of ``url``, at most ``WINDOW`` in flight at a time; ``sink(i, data)`` takes range ``i``
    as it arrives (and must copy it: the buffer is dropped afterwards)."""
    store = _obstore(url)
    if store is not None:
        import obstore

        def options(r):
            return {"range": r, **({"if_match": version} if version else {})}

        if len(ranges) == 1:
            sink(0, obstore.get(store, _key(url), options=options(ranges[0])).bytes())
            return

        async def all_ranges():
            window = asyncio.Semaphore(WINDOW)

            async def one(i, r):
                async with window:
                    sink(i, await (await obstore.get_async(store, _key(url), options=options(r))).bytes_async())
            await asyncio.gather(*(one(i, r) for i, r in enumerate(ranges)))
        asyncio.run(all_ranges())
        return
    fs = filesystem(url)
    if len(ranges) == 1:
        sink(0, fs.cat_file(url, start=ranges[0][0], end=ranges[0][1]))
        return
    for w in range(0, len(ranges), WINDOW):
        part = ranges[w: w + WINDOW]
        for i, data in enumerate(fs.cat_ranges([url] * len(part), [r[0] for r in part], [r[1] for r in part],
                                               on_error="raise"), w):
            sink(i, data)
            del data


def _get(url: str, start: int, end: int, version: str | None) -> bytes:
    out: list = []
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
        raise _format._corrupt(url, f"object is truncated ({len(raw)} bytes, its handle says {size})")
    header, need = _format.parse_header(raw, url, size)
    if header is None:
        rest = retrying(url, "reading the header", _get, url, len(raw), need, version)
        if len(rest) != need - len(raw):
            raise _format._corrupt(url, f"object is truncated ({len(raw) + len(rest)} bytes, its header needs {need})")
        raw = memoryview(bytes(raw) + bytes(rest))  # (obstore gives a buffer of its own, not bytes)
        del rest
        header, _ = _format.parse_header(raw, url, size)
        if header is None:
            raise _format._corrupt(url, "object shrank while its header was read")
    return header, raw


def read_into(url: str, view: memoryview, offset: int, version: str | None, have: memoryview) -> None:
    """Fill ``view`` with the object's bytes from ``offset``: first from ``have`` (bytes from 0), then
    with ranged reads of ``CHUNK`` bytes, ``WINDOW`` in flight at a time, each copied as it lands."""
    done = max(0, min(len(view), len(have) - offset))
    view[:done] = have[offset: offset + done]
    ranges = [(offset + s, offset + min(s + CHUNK, len(view))) for s in range(done, len(view), CHUNK)]
    if not ranges:
        return

    def land(i: int, data: Any) -> None:
        start, end = ranges[i]
        with memoryview(data) as part:
            if len(part) != end - start:
                raise _format._corrupt(url, f"object shrank while it was read ({len(part)} of {end - start} bytes)")
            view[start - offset: end - offset] = part

    retrying(url, "reading", _get_ranges, url, ranges, version, land)


def put(url: str, buffers: list) -> str | None:
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
    return retrying(url, "reading", filesystem(url).cat_file, url)


def read_head(url: str, limit: int) -> bytes:
    """At most the first ``limit`` bytes of ``url`` (one ranged read: never the whole of a large object)."""
    return retrying(url, "reading", filesystem(url).cat_file, url, start=0, end=limit)


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

    def ls():
        try:
            return fs.ls(prefix, detail=True, refresh=True)
        except FileNotFoundError:
            if proto in _BUCKETED and not fs.exists(_root(prefix)):
                raise StorageNotFoundError(f"{prefix}: bucket {_root(prefix)} does not exist; create it, or "
                                           "check the URL", path=prefix) from None
            return []  # nothing under the prefix yet
    out = []
    for info in retrying(prefix, "listing", ls):
        if info.get("type") != "file":
            continue
        modified = info.get("LastModified") or info.get("created") or info.get("mtime") or 0
        mtime = modified.timestamp() if isinstance(modified, datetime.datetime) else float(modified)
        etag = info.get("ETag")
        name = info["name"]
        out.append(Entry(name if "://" in name else f"{proto}://{name}", int(info.get("size") or 0), mtime,
                         etag.strip('"') if etag else None))
    return out
