"""``RedisStorageQueue``: at-least-once delivery of storage handles across machines (Redis Streams).

The queue is composed of the parts in ``_redis/`` (options, key layout, scripts, the client and its
retries, producers, the consumer, records, stats and deletion); its ``StorageDataset`` source is
``_sources/redis.RedisSource``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ._options import take
from ._redis import admin as _admin
from ._redis.client import Client
from ._redis.conn import redact_url
from ._redis.consumer import Consumer, token_list
from ._redis.keys import family as _family  # noqa: F401 -- kept importable from here (tests name it)
from ._redis.keys import stream_keys as stream_keys
from ._redis.options import Options, renamed_retry_for
from ._redis.producers import Producers
from ._untrusted import trust as _trust
from .storage import Storage

if TYPE_CHECKING:
    from ._sources.redis import RedisSource

__all__ = ["RedisSource", "RedisStorageQueue", "redact_url"]


def __getattr__(name: str) -> Any:
    if name == "RedisSource":  # lives in _sources/, whose package imports torch: loaded when asked for
        from ._sources.redis import RedisSource

        return RedisSource
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Size: 86 lines of code, delegating to _redis/; the other 205 are docstrings, this queue's reference for users.
class RedisStorageQueue:
    """Handles flow from producers on any machine to consumers on any machine, at least once.

    Built on a Redis stream ``stream`` read by the consumer group ``group`` (created on first use,
    from the start of the stream). ``put(storage)`` appends a handle as a JSON record (an
    allow-listed ``Storage`` type, see ``register_storage_type``; nothing is ever unpickled).
    Each consumer (a process, or a ``RedisStorageQueue`` object within one) reads under a name of
    its own; ``get()`` returns ``(token, storage)`` and ``ack(token)`` acknowledges it, from any
    process. An entry not acknowledged ``claim_after`` seconds after its delivery is claimed by
    another consumer (its reader is taken for dead) and delivered again: acknowledge within
    ``claim_after``, and expect a redelivered handle now and then (``stats()`` counts them).

    ``close()`` ends the stream: a consumer stops (``get`` returns ``None``) once every entry put
    before it was delivered and nothing is pending on another consumer (it claims what a dead one
    held). A closed stream stays closed; use a new stream name per run, or ``delete()``. Producers
    that run ``with queue.producer():`` keep a heartbeat key alive; a consumer that finds the stream
    empty while a registered producer's heartbeat expired (``producer_timeout``) raises
    ``ProducerDiedError``.

    Trimming: acknowledging trims the stream (at most once a second per process, and when a consumer
    stops) below the oldest entry some group still needs, its oldest pending entry or its next
    undelivered one (``XTRIM MINID``), so an undelivered or unacknowledged entry is never dropped,
    and memory holds only those. There is no length cap: a stream nobody reads grows.

    Whoever can write to the stream is not trusted: each entry is checked in Redis before it is
    sent (one ``h`` field of at most 64 KiB), then decoded as data with an exact schema (see
    ``_redis.records``), and a ``FileStorage`` or ``ObjectStorage`` handle is delivered only if it names a
    file under one of ``trusted_roots`` (absolute directories) or an object under one of them
    (``s3://bucket/prefix``); others are refused, acknowledged and counted (``stats()["refused"]``). With
    none at all, ``get`` raises ``UntrustedStorageError`` and gives the entry back undelivered: nothing lost.

    Connection loss is retried with back-off for ``retry_timeout`` seconds (``retry_for``, its old
    name, still works and warns), then raises ``StorageUnavailableError`` naming the URL without its
    secrets (``rediss://``, users and passwords come from the URL, in any form redis-py reads; they
    are never logged or shown). A ``put`` retried after a lost reply may append the handle twice.
    The queue pickles as its URL and options; each process connects on first use. ``disconnect()``
    (or leaving ``with queue:``) closes this process's connections; the next call reconnects.

    Beyond one server: ``cluster=True`` for any node of a Redis Cluster (all the stream's keys share
    the hash tag ``{stream}``, so one slot); ``redis+sentinel://host:port[,host:port...]/SERVICE[/DB]``
    for the master a Sentinel names; ``replicas=N`` makes ``put`` and ``close`` wait until N replicas
    have them (Redis ``WAIT``), so a failover loses nothing acknowledged. A stream lost under a process
    that used it (its epoch, stream or group gone or made anew: a restart without persistence, say)
    raises ``RedisStreamLostError``; consumers never end as if it were drained.

    Args:
        url: ``redis://``, ``rediss://``, ``unix://`` or ``redis+sentinel://`` URL (secrets in it
            are never shown).
        stream: the stream's name; one per run (a closed stream stays closed).
        group: the consumer group that shares the stream's entries (each group gets every entry).
        claim_after: seconds after which an unacknowledged delivery is claimed by another consumer.
        producer_timeout: seconds without a heartbeat after which a registered producer is dead.
        retry_timeout: seconds a lost connection is retried before ``StorageUnavailableError``.
        prefetch: entries a consumer reads per round trip (>= 1).
        allow_pickle: accept handles of Storage types registered as pickled (see
            ``register_storage_type``); never for a stream others can write.
        trusted_roots: directories and ``proto://bucket/prefix`` roots handles must lie under.
        cluster: ``url`` names a node of a Redis Cluster.
        replicas: replicas ``put`` and ``close`` wait for (Redis ``WAIT``).
        retry_for: the old name of ``retry_timeout`` (warns).

    Raises:
        TypeError: an option of the wrong type (the message names it and the type expected).
        ValueError: an option out of range (the message names it).

    Examples:
        >>> from torch_storage_loader import RedisStorageQueue
        >>> queue = RedisStorageQueue("redis://127.0.0.1:6379/0", "run-1", trusted_roots=["/data"])
        >>> queue
        RedisStorageQueue('redis://127.0.0.1:6379/0', 'run-1', group='trainers', claim_after=30.0)
    """

    def __init__(
        self,
        url: str,
        stream: str,
        *,
        group: str = "trainers",
        claim_after: float = 30.0,
        producer_timeout: float = 10.0,
        retry_timeout: float = 5.0,
        prefetch: int = 1,
        allow_pickle: bool = False,
        trusted_roots: list[str] | None = None,
        cluster: bool = False,
        replicas: int = 0,
        retry_for: float | None = None,
    ) -> None:
        retry_timeout = renamed_retry_for(retry_timeout, retry_for)
        o = self._options = take(Options, locals())  # checks them
        self.stream, self.group, self.claim_after = o.stream, o.group, o.claim_after
        self.producer_timeout, self.retry_timeout, self.prefetch = o.producer_timeout, o.retry_timeout, o.prefetch
        self.allow_pickle, self.cluster, self.replicas = o.allow_pickle, o.cluster, o.replicas
        self._redis = Client(o)
        self._producers = Producers(self._redis)
        self._reader = Consumer(self._redis, self._producers)

    def __getstate__(self) -> dict[str, Any]:
        return {**vars(self._options), "epoch": self._redis.epoch}

    def __setstate__(self, state: dict[str, Any]) -> None:
        url, stream, epoch = state.pop("url"), state.pop("stream"), state.pop("epoch", None)
        type(self).__init__(self, url, stream, **state)
        self._redis.epoch = epoch  # a copy of a queue that knew the stream knows it too: it never makes a new one

    def __repr__(self) -> str:
        extra = (", cluster=True" if self.cluster else "") + (f", replicas={self.replicas}" if self.replicas else "")
        return (
            f"RedisStorageQueue({self.url!r}, {self.stream!r}, group={self.group!r}, "
            f"claim_after={self.claim_after}{extra})"
        )

    @property
    def url(self) -> str:
        """The URL without its secrets (user, password, and any query parameter but plain settings)."""
        return self._options.shown

    @property
    def trusted_roots(self) -> list[str]:
        """The directories and ``proto://bucket/prefix`` roots handles read from this queue must lie under."""
        roots = self._options.trusted_roots
        return list(roots.dirs) + roots.urls()

    def disconnect(self) -> None:
        """Close this process's connections to Redis (the stream is untouched; the next call reconnects)."""
        self._redis.disconnect()

    def __enter__(self) -> RedisStorageQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.disconnect()

    def put(self, storage: Storage, block: bool = True, timeout: float | None = None) -> str:
        """Append a handle to the stream.

        Args:
            storage: the handle (an allow-listed ``Storage`` type).
            block: accepted for ``StorageQueue``'s signature; a stream never blocks.
            timeout: likewise.

        Returns:
            The stream entry's id.

        Raises:
            HandleRecordError: ``storage``'s type is not registered, or a field is not a JSON value.
            RedisStreamLostError: the stream this process used is gone.
            StorageUnavailableError: Redis could not be reached within ``retry_timeout``.
        """
        return self._producers.put(storage)

    def close(self) -> None:
        """End the stream for every consumer, once every handle put before it is delivered."""
        self._producers.close()

    @contextlib.contextmanager
    def producer(self, name: str | None = None) -> Iterator[RedisStorageQueue]:
        """Register this process as a producer for as long as the block runs (see the class doc).

        ``name`` (default: ``host-pid-tag``) is how consumers and ``dead_producers()`` know it; a
        stable one (a collector's rank, a pod name) lets a restarted producer take over its
        registration: if it is back within ``producer_timeout``, nobody takes it for dead.

        Args:
            name: this producer's name.

        Yields:
            The queue itself.
        """
        with self._producers.registered(name):
            yield self

    def dead_producers(self) -> list[str]:
        """Producers registered with ``producer()`` whose heartbeat expired.

        Returns:
            Their names.
        """
        return self._producers.dead()

    def forget_dead_producers(self) -> list[str]:
        """Unregister the dead producers (after restarting them, say).

        Returns:
            The names of those unregistered.
        """
        return self._producers.forget_dead()

    def get(self, timeout: float | None = None) -> tuple[str, Storage] | None:
        """The next delivered entry.

        Args:
            timeout: seconds to wait for one (``None``: until one comes or the stream ends).

        Returns:
            ``(token, storage)``: acknowledge ``token`` with ``ack``; ``None`` once the stream is
            closed and drained.

        Raises:
            queue.Empty: nothing came within ``timeout``.
            ProducerDiedError: the stream is empty and a registered producer died.
            HandleRecordError: an entry is not a handle record, or names an unregistered Storage
                type (acknowledged and counted as ``refused``: never delivered again; a
                ``StorageDataset`` skips such entries).
            UntrustedStorageError: an entry names a path or bucket outside ``trusted_roots`` (likewise if any).
            RedisStreamLostError: the stream this process used is gone.
        """
        return self._reader.get(timeout)

    def __iter__(self) -> Iterator[tuple[str, Storage]]:
        while (item := self.get()) is not None:
            yield item

    def ack(self, *tokens: str | list[str], failed: bool = False) -> int:
        """Acknowledge delivered entries by token, from any process.

        Args:
            *tokens: the tokens ``get`` returned, as arguments or as one list (as ``StorageQueue`` takes them).
            failed: their handles could not be loaded (counted as ``failed`` in ``stats()``).

        Returns:
            How many of them were pending (the others were acknowledged before: duplicates).

        Raises:
            TypeError: tokens given both as arguments and in a list.
            StorageUnavailableError: Redis could not be reached within ``retry_timeout``.
        """
        return self._reader.ack(token_list(tokens), failed)

    def trim(self) -> int:
        """Drop entries no group needs any more (see the class doc).

        Returns:
            How many entries were dropped.
        """
        return self._reader.trim()

    def give_back(self, *tokens: str | list[str], family: str | None = None) -> int:
        """Make delivered entries undelivered again (appended anew), for any consumer.

        Only entries still pending on this consumer (or, with ``family``, on a consumer named
        ``FAMILY/...``) are given back: one claimed by another consumer meanwhile is theirs.

        Args:
            *tokens: the tokens ``get`` returned, as arguments or as one list (as ``StorageQueue.give_back`` takes them).
            family: give back what the consumers of this trainer family hold, not only this consumer.

        Returns:
            How many entries were given back.

        Raises:
            TypeError: tokens given both as arguments and in a list.
            StorageUnavailableError: Redis could not be reached within ``retry_timeout``.
        """
        return self._reader.give_back(token_list(tokens), family)

    def keep_alive(self, *tokens: str | list[str], family: str) -> None:
        """Keep delivered entries that ``family``'s trainer holds from being claimed after ``claim_after``.

        Args:
            *tokens: the tokens, as arguments or as one list.
            family: the trainer family (``HOST-TRAINER``) whose ledger holds them.

        Raises:
            TypeError: tokens given both as arguments and in a list.
            StorageUnavailableError: Redis could not be reached within ``retry_timeout``.
        """
        self._reader.keep_alive(token_list(tokens), family)

    @property
    def consumer(self) -> str:
        """This process's consumer name (``host-pid-tag``, or ``FAMILY/pid-tag`` after ``join_trainer``)."""
        return self._reader.name

    @property
    def family(self) -> str:
        """The trainer family this process reads for (``HOST-TRAINER``), or ``""``."""
        return self._reader.family

    def join_trainer(self, trainer: str) -> None:
        """Read, in this process, as one of trainer ``trainer``'s consumers (a ``StorageDataset`` worker does).

        Args:
            trainer: the trainer's id (its pid): consumers named ``HOST-TRAINER/...`` read for it.
        """
        self._reader.join(trainer)

    def stats(self) -> dict[str, int]:
        """Counts for the group, across all processes and machines.

        ``delivered`` (handed out, redeliveries included), ``claimed`` (taken over from a consumer idle for
        ``claim_after``), ``acked``, ``duplicates`` (entries delivered or acknowledged more than once), ``failed``
        (acknowledged after a failed load), ``refused`` (not handle records, or outside ``trusted_roots``), ``lost``
        (pending entries deleted by someone else), ``returned`` (given back undelivered by a stopped DataLoader, and
        delivered again); and now: ``length`` (entries in the stream), ``pending`` (delivered, not acknowledged),
        ``undelivered``.

        Returns:
            The counts by name.
        """
        return _admin.stats(self._redis)

    def delete(self) -> None:
        """Delete the stream and exactly its keys (every group's counts included), and nothing else.

        Also deletes what version 0.1 kept for a stream of this name (``tsl:NAME:closed``,
        ``...:producers``, ``...:hb:PRODUCER`` and ``...:GROUP:stats`` / ``...:GROUP:dups`` of its groups),
        by name, never by pattern.
        """
        _admin.delete(self._redis)
        self._reader.closed = False

    def as_source(self, trusted_roots: list[str] | None = None) -> RedisSource:
        """The queue as a ``StorageDataset`` source (``StorageDataset(queue)`` calls this).

        Args:
            trusted_roots: roots added to the queue's own for what the source delivers.

        Returns:
            The source: each DataLoader worker reads as a consumer of this trainer.
        """
        from ._sources.redis import RedisSource

        extra = _trust.roots(trusted_roots)
        if not extra:
            return RedisSource(self)
        state = self.__getstate__()
        state["trusted_roots"] = self._options.trusted_roots | extra
        queue = RedisStorageQueue.__new__(RedisStorageQueue)
        queue.__setstate__(state)
        return RedisSource(queue)
