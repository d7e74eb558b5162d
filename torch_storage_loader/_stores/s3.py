"""``s3://`` objects read through obstore, in the worker processes that may use it.

Loader and DataLoader workers read ``s3://`` objects through obstore when it is installed and the
fsspec (s3fs) options translate to it (on these machines it reads 7 MB objects 1.5 to 2x faster than
s3fs); everything else goes through fsspec (``objects``). The trainer's own process never starts
obstore's runtime, which a forked child (a DataLoader worker) could not use.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._proc import after_fork_in_child, fork_safe_lock

if TYPE_CHECKING:
    from obstore import GetOptions

__all__ = ["get_ranges", "store", "use_obstore_here"]

logger = logging.getLogger(__name__)

_S3_KEYS = {
    "key": "access_key_id",
    "secret": "secret_access_key",
    "token": "session_token",
    "endpoint_url": "endpoint",
    "region_name": "region",
}
_S3_IGNORED = {
    "skip_instance_cache",
    "use_listings_cache",
    "listings_expiry_time",
    "max_paths",
    "default_block_size",
    "default_fill_cache",
    "default_cache_type",
    "asynchronous",
    "loop",
    "retries",
    "cache_regions",
    "version_aware",
    "use_ssl",
}

_lock = fork_safe_lock()
_stores: dict[tuple[int, str, str], Any] = {}  # (pid, "proto://bucket", options) -> obstore store

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


@after_fork_in_child
def _no_obstore_in_child() -> None:
    global _obstore_allowed, _obstore_poisoned
    # Imported by the parent (by this library in a worker, or by the user): its runtime may be running.
    _obstore_allowed, _obstore_poisoned = False, _obstore_poisoned or _obstore_used or "obstore" in sys.modules


def store(root: str, opts: dict[str, Any]) -> Any:
    """An obstore store for bucket ``root`` (``s3://bucket``) with the fsspec options ``opts``, or None
    (not a worker, not installed, or options it cannot take)."""
    global _obstore_used
    if not _obstore_allowed:
        return None
    _obstore_used = True
    key = (os.getpid(), root, repr(sorted(opts.items())))
    with _lock:
        if key in _stores:
            return _stores[key]
    made = None
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
                made = _s3_store(S3Store, root.split("://", 1)[1], config)
            except Exception as exc:  # noqa: BLE001 - options obstore rejects: s3fs reads instead
                logger.debug("obstore cannot read %s (%s): reading through s3fs", root, exc)
    with _lock:
        _stores[key] = made
    return made


def _s3_store(S3Store: Callable[..., Any], bucket: str, config: dict[str, Any]) -> Any:
    endpoint = config.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    config.setdefault("region", os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1")
    client = {"allow_http": True} if endpoint and endpoint.startswith("http://") else {}
    # A few quick retries in the client; longer outages are ``objects.retrying``'s.
    retry = {
        "max_retries": 2,
        "retry_timeout": datetime.timedelta(seconds=5),
        "backoff": {
            "init_backoff": datetime.timedelta(milliseconds=50),
            "max_backoff": datetime.timedelta(seconds=1),
            "base": 2,
        },
    }
    return S3Store(bucket, config=config, client_options=client, retry_config=retry)


def get_ranges(
    s3: Any, url: str, ranges: list[tuple[int, int]], version: str | None, window: int, sink: Callable[[int, Any], None]
) -> None:
    """Read ``ranges`` of ``url`` from store ``s3``, at most ``window`` in flight at a time; ``sink(i, data)``
    takes range ``i`` as it arrives."""
    import obstore

    key = url.split("://", 1)[1].split("/", 1)[1]

    def options(r: tuple[int, int]) -> GetOptions:
        return {"range": r, "if_match": version} if version else {"range": r}

    if len(ranges) == 1:
        sink(0, obstore.get(s3, key, options=options(ranges[0])).bytes())
        return

    async def all_ranges() -> None:
        limit = asyncio.Semaphore(window)

        async def one(i: int, r: tuple[int, int]) -> None:
            async with limit:
                sink(i, await (await obstore.get_async(s3, key, options=options(r))).bytes_async())

        await asyncio.gather(*(one(i, r) for i, r in enumerate(ranges)))

    asyncio.run(all_ranges())
