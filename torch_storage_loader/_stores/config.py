"""Which options and retry timeout each object-store URL is read and written with, in this process.

``configure_object_store`` registers them per bucket, protocol or ``"*"``; a loader's or dataset's
workers receive this process's registrations with ``snapshot``/``apply``. Without one, a client's
own defaults apply (they read the environment: ``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ...).
"""

from __future__ import annotations

import select
import sys
from typing import Any, NamedTuple

from .._optional import require
from .._proc import after_fork_in_child, before_fork, fork_safe_lock

__all__ = [
    "Config",
    "apply",
    "configure_object_store",
    "filesystem",
    "is_url",
    "local_path",
    "protocol",
    "root",
    "snapshot",
]

DEFAULT_RETRY_S = 30.0


class Config(NamedTuple):
    storage_options: dict[str, Any]  # fsspec's keyword arguments
    retry_timeout: float

    def __repr__(self) -> str:  # options hold credentials: never print them
        return f"Config(storage_options=<{len(self.storage_options)} options>, retry_timeout={self.retry_timeout})"


_lock = fork_safe_lock()
_config: dict[str, Config] = {}  # "proto://bucket", "proto" or "*" -> Config


def protocol(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url else "file"


def is_url(path: Any) -> bool:
    """Whether ``path`` names an object store rather than a local path (``file://`` is local)."""
    return isinstance(path, str) and protocol(path) not in ("file", "local")


def local_path(path: str) -> str:
    return (
        path.split("://", 1)[1]
        if isinstance(path, str) and protocol(path) in ("file", "local") and "://" in path
        else path
    )


def root(url: str) -> str:
    proto, rest = url.split("://", 1)
    return f"{proto}://{rest.split('/', 1)[0]}"


def configure_object_store(
    url: str, storage_options: dict[str, Any] | None = None, *, retry_timeout: float | None = None
) -> None:
    """Use ``storage_options`` (given to fsspec as they are: for s3fs ``key``, ``secret``,
    ``endpoint_url``...) for objects under ``url``'s bucket, in this process and in the workers of
    loaders and DataLoaders started after this call.

    ``url`` may also be a bare protocol (``"s3"``) or ``"*"`` (every object store); the most
    specific entry applies. Transient errors are retried for ``retry_timeout`` seconds (default 30)
    before ``StorageUnavailableError``. Either argument left as None keeps what was set before.

    Args:
        url: An object-store URL (its bucket is what the options apply to), a protocol (``"s3"``),
            or ``"*"``.
        storage_options: fsspec options for those objects; None keeps what was set before.
        retry_timeout: Seconds to retry transient errors for; None keeps what was set before.

    Raises:
        ValueError: ``retry_timeout`` is not positive.
    """
    if retry_timeout is not None and retry_timeout <= 0:
        raise ValueError(f"{retry_timeout=} must be > 0 seconds")
    key = url if url == "*" or "://" not in url else root(url)
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


def config_for(url: str) -> Config:
    with _lock:
        for key in (root(url), protocol(url), "*"):
            if key in _config:
                return _config[key]
    return Config({}, DEFAULT_RETRY_S)


def filesystem(url: str) -> Any:  # an fsspec AbstractFileSystem (fsspec has no type information)
    import fsspec  # torch's own dependency; the S3 client is the s3 extra's

    proto = protocol(url)
    if proto in ("s3", "s3a"):
        require("s3fs", "s3", "Object storage (s3://)")
    return fsspec.filesystem(proto, **config_for(url).storage_options)  # cached per options and process


_inherited: list[Any] = []  # in a forked child: the parent's fsspec instances, never to be closed here
_parent_loop: list[Any] = []  # fsspec's event loop, as the parent had it when it forked


@before_fork
def _note_loop_before_fork() -> None:
    asyn = sys.modules.get("fsspec.asyn")
    _parent_loop[:] = [asyn.loop[0]] if asyn is not None and asyn.loop[0] is not None else []


@after_fork_in_child
def _leave_the_parents_loop() -> None:
    # A forked child (a DataLoader worker) holds copies of the parent's fsspec instances and of the
    # event loop their connections belong to, and that loop's epoll descriptor is the parent's own
    # epoll instance. fsspec drops those instances at the child's first use (it caches per process),
    # and s3fs then closes their connections in the child: unregistering the parent's sockets from
    # the parent's loop, whose next request on one waited for a reply it was never told of (for
    # ever, or a 60 s read timeout). So the child's copy of that loop gets an epoll of its own, and
    # the cached instances are kept (never collected here, so never closed: no errors either).
    epoll = getattr(select, "epoll", None)  # Linux; a kqueue is not inherited across fork
    for loop in _parent_loop:
        selector = getattr(loop, "_selector", None)
        shared = getattr(selector, "_selector", None)
        if epoll is not None and isinstance(shared, epoll):
            selector._selector = epoll()  # type: ignore[union-attr]
            shared.close()  # this child's descriptor only
    _parent_loop.clear()
    spec = sys.modules.get("fsspec.spec")
    if spec is None:
        return
    classes = [spec.AbstractFileSystem]
    while classes:
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        _inherited.extend(vars(cls).get("_cache", {}).values())
