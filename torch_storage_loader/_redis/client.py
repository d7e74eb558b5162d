"""One process's use of the stream's Redis: connecting, retrying, and what error replies stand for.

Connection loss is retried with back-off (``_retry``) for ``retry_timeout`` seconds, then raises
``StorageUnavailableError`` naming the URL without its secrets. Each process connects on first use (a
forked child never shares its parent's sockets) and makes or checks the stream, its epoch and the
group once; a stream whose epoch changed or vanished raises ``RedisStreamLostError``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._optional import require
from .._retry import Backoff
from ..errors import RedisStreamLostError, StorageUnavailableError
from . import conn as _conn
from .keys import Keys, decode_id
from .options import Options
from .scripts import SCRIPTS

if TYPE_CHECKING:
    import redis
else:
    redis = require("redis", "redis", "RedisStorageQueue")

__all__ = ["Client"]

logger = logging.getLogger("torch_storage_loader")


def _disconnect(close: Callable[[], None], pid: int) -> None:
    if os.getpid() == pid:  # a forked child must not close its parent's sockets
        close()


class Client:
    """The connection, scripts and stream identity (epoch) of one queue, in this process.

    ``on_new_process(reset)`` adds what else to reset when the queue is first used in a forked child
    (held weakly: the parts of a queue hold their client, not the other way round).
    """

    def __init__(self, options: Options) -> None:
        self.options = options
        self.keys = Keys.of(options.stream)
        self.epoch: str | None = None  # the stream's identity, once this queue (or its pickler) saw it
        self._resets: list[weakref.WeakMethod[Callable[[], None]]] = []
        self._reset()

    def on_new_process(self, reset: Callable[[], None]) -> None:
        self._resets.append(weakref.WeakMethod(reset))

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._client: Any = None
        self._connection: _conn.Connection | None = None
        self._closer: weakref.finalize[Any, Any] | None = None
        self._scripts: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.group_ready = False
        for ref in self._resets:
            reset = ref()
            if reset is not None:
                reset()

    @property
    def connected(self) -> bool:
        """Whether this process holds a client (it connects on first use)."""
        return self._client is not None

    def this_process(self) -> None:
        """Reset the per-process state if this is a forked child: never share the parent's sockets or names."""
        if self._pid != os.getpid():
            self._reset()

    def conn(self) -> Any:
        self.this_process()
        if self._client is None:
            with self._lock:
                if self._client is None:
                    o = self.options
                    retry = (
                        redis.retry.Retry(redis.backoff.ExponentialBackoff(cap=0.5, base=0.05), 3)
                        if o.cluster
                        else redis.retry.Retry(redis.backoff.NoBackoff(), 0)
                    )
                    connection = _conn.connect(
                        o.url,
                        cluster=o.cluster,
                        shown=o.shown,
                        connect_timeout=2.0,
                        retry=retry,
                        socket_timeout=5.0 + (o.retry_timeout if o.replicas else 0.0),
                    )
                    client = connection.client
                    self._scripts = {name: client.register_script(src) for name, src in SCRIPTS.items()}
                    self._connection, self._client = connection, client
                    # backup for a queue dropped without disconnect(): close its sockets, not leave them to gc
                    self._closer = weakref.finalize(self, _disconnect, connection.close, self._pid)
        return self._client

    def disconnect(self) -> None:
        with self._lock:
            closer, self._closer, self._client, self._connection, self._scripts = self._closer, None, None, None, {}
        if closer is not None and self._pid == os.getpid():
            closer()

    def script(self, name: str, keys: list[Any], args: list[Any]) -> Any:
        """Run script ``name`` (inside ``call``, which connects first)."""
        return self._scripts[name](keys=keys, args=args)

    def call(self, fn: Callable[[Any], Any], what: str, *, ensure: bool = True) -> Any:
        """Run ``fn(client)``, retrying lost connections for ``retry_timeout`` seconds."""
        shown, seconds = self.options.shown, self.options.retry_timeout
        backoff = Backoff(seconds, cap=1.0)
        tries = 0
        while True:
            tries += 1
            try:
                client = self.conn()
                if ensure and not self.group_ready:
                    self._ensure_group()
                return fn(client)
            except redis.AuthenticationError as exc:
                raise StorageUnavailableError(
                    f"Redis at {shown} refused the credentials in the URL while trying to {what} "
                    f"({type(exc).__name__}: {self.scrub(exc)}); check the user and password in the URL",
                    url=shown,
                ) from None
            except (
                redis.ConnectionError,
                redis.TimeoutError,
                redis.RedisError,
                redis.exceptions.RedisClusterException,
            ) as exc:
                if isinstance(exc, redis.ResponseError) and not _conn.transient(exc):
                    self._response_error(exc, backoff)
                    continue
                if not isinstance(exc, (redis.ConnectionError, redis.TimeoutError)) and not _conn.transient(exc):
                    raise
                if backoff.spent():
                    raise StorageUnavailableError(
                        f"Redis at {shown} is unreachable: could not {what} in {tries} tries over "
                        f"{seconds:g} s ({type(exc).__name__}: {self.scrub(exc)})",
                        url=shown,
                    ) from None
                logger.warning(
                    "Redis at %s: %s while trying to %s; retrying in %.2f s",
                    shown,
                    type(exc).__name__,
                    what,
                    backoff.delay,
                )
                backoff.wait()

    def _response_error(self, exc: redis.ResponseError, backoff: Backoff) -> None:
        """Raise the error a Redis error reply stands for; return to try again (the group is checked first)."""
        text, o = str(exc), self.options
        if "TSLLOST" in text:
            self.group_ready = False
            raise self.lost(text.split("TSLLOST", 1)[1].split()[0]) from None
        if "TSLLAYOUT" in text:
            kind = text.split("TSLLAYOUT", 1)[1].split()[0]
            raise RedisStreamLostError(
                f"Redis key {o.stream!r} at {o.shown} exists (a {kind}) but has no {self.keys.meta!r}: it was "
                "not made by this version of RedisStorageQueue (0.1 kept its keys as tsl:NAME:*, or it is "
                "something else's key). Finish that run with the version that made it, use another stream "
                f"name, or delete it: RedisStorageQueue(url, {o.stream!r}).delete() removes the keys of "
                "both layouts",
                stream=o.stream,
                url=o.shown,
            ) from None
        if _conn.moved(exc) and not o.cluster:
            raise ValueError(
                f"Redis at {o.shown} is a Redis Cluster node (it redirected to {text}): "
                "pass cluster=True to RedisStorageQueue"
            ) from None
        if ("NOGROUP" in text or "no such key" in text) and backoff.left() > 0:
            self.group_ready = False  # the group or the stream is gone: _ensure_group says how
            return
        raise exc

    def lost(self, why: str) -> RedisStreamLostError:
        o = self.options
        what = {
            "gone": f"its identity key {self.keys.meta!r} is gone",
            "renewed": "it was made anew (another epoch) since this process first used it",
            "stream": "its stream key is gone",
            "group": f"its consumer group {o.group!r} is gone",
        }.get(why, why)
        return RedisStreamLostError(
            f"Redis stream {o.stream!r} at {o.shown} was lost while this process used it: {what}. Its "
            "undelivered and unacknowledged handles went with it (Redis restarted without persistence, a "
            "failover lost writes not yet on a replica, FLUSHALL, eviction, or delete()). Run Redis durably "
            "(appendonly yes, maxmemory-policy noeviction; README: 'Running Redis durably') and start a new "
            "stream (another name, or delete() this one first)",
            stream=o.stream,
            url=o.shown,
        )

    def scrub(self, exc: BaseException) -> str:
        return _conn.scrub(str(exc), self.options.url)

    def _ensure_group(self) -> None:
        """Make (or check) the stream, its epoch and the group, once per process."""
        epoch = self.durable(
            "ensure", [self.keys.stream, self.keys.meta], [secrets.token_hex(8), self.options.group, self.epoch or ""]
        )
        self.epoch = decode_id(epoch)
        self.group_ready = True

    def durable(self, script: str, keys: list[Any], args: list[Any]) -> Any:
        """Run a writing script; with ``replicas``, return only once that many replicas have its writes."""
        o = self.options
        if not o.replicas:
            return self._scripts[script](keys=keys, args=args)
        assert self._connection is not None  # scripts run through call, which connects first
        node = _conn.node_of(self._connection, o.stream)
        try:
            pipe = node.pipeline(transaction=False)
            self._scripts[script](keys=keys, args=args, client=pipe)
            pipe.wait(o.replicas, max(1, int(o.retry_timeout * 1000)))
            result, copies = pipe.execute()
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as exc:
            if o.cluster and (_conn.moved(exc) or not isinstance(exc, redis.ResponseError)):
                with contextlib.suppress(redis.RedisError, redis.exceptions.RedisClusterException):
                    self._client.exists(self.keys.meta)  # through the cluster client: it learns where the slot went
                raise redis.ConnectionError(f"the stream's node changed ({type(exc).__name__})") from None
            raise
        if copies < o.replicas:
            raise StorageUnavailableError(
                f"Redis at {o.shown}: only {copies} of replicas={o.replicas} confirmed a write to stream "
                f"{o.stream!r} within {o.retry_timeout:g} s; it may be lost if the master fails over now "
                "(or it may be delivered): try again (a duplicate at worst)",
                url=o.shown,
            )
        return result

    def forget_stream(self) -> None:
        """The stream was deleted: the next call makes a new one (a new epoch)."""
        self.group_ready = False
        self.epoch = None
