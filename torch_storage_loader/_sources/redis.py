"""A ``RedisStorageQueue`` as a streaming source (the queue lives in ``redis_queue``, its parts in ``_redis``)."""

from __future__ import annotations

import logging
import os
import queue as _queue
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from .._redis.keys import family as _family
from .._untrusted import bounded as _bounded
from .._untrusted import trust as _trust
from ..errors import HandleRecordError, UntrustedStorageError
from ..storage import Storage

__all__ = ["RedisSource", "StreamQueue"]

logger = logging.getLogger("torch_storage_loader")


class StreamQueue(Protocol):
    """All ``RedisSource`` uses of its ``RedisStorageQueue``: public methods, nothing set from outside."""

    stream: str
    claim_after: float

    @property
    def family(self) -> str: ...

    @property
    def trusted_roots(self) -> list[str]: ...

    def join_trainer(self, trainer: str) -> None: ...

    def get(self, timeout: float | None = None) -> tuple[str, Storage] | None: ...

    def ack(self, *tokens: str | list[str], failed: bool = False) -> int: ...

    def give_back(self, *tokens: str | list[str], family: str | None = None) -> int: ...

    def keep_alive(self, *tokens: str | list[str], family: str) -> None: ...

    def as_source(self, trusted_roots: list[str] | None = None) -> RedisSource: ...


class RedisSource:
    """``StorageDataset``'s view of a ``RedisStorageQueue``: handles in, acknowledgements out.

    DataLoader workers read as consumers named after their trainer; the trainer acknowledges an
    entry once it received its sample, or gives it back (``RedisStorageQueue.give_back``) when its
    DataLoader stops first. A file that cannot be read fails everywhere, so its entry is
    acknowledged too and counted as ``failed``. Refused entries are skipped and counted (``refused``),
    except where the queue trusts no root at all: that misconfiguration raises (``get`` gave the entry back).
    """

    finite = False
    ack_in_background = True  # the trainer's ledger thread sends acknowledgements in batches
    fed_from_trainer = False  # its claims are atomic: workers take themselves

    def __init__(self, queue: StreamQueue) -> None:
        self.queue = queue
        self.refused = 0  # entries refused in this process (Redis counts them all: stats()["refused"])

    def __getstate__(self) -> dict[str, Any]:
        return {"queue": self.queue}

    def __setstate__(self, state: dict[str, Any]) -> None:
        type(self).__init__(self, state["queue"])

    @property
    def roots(self) -> _trust.Roots:
        """The roots handles from this source may name (its queue's, with any the dataset added)."""
        return _trust.roots(self.queue.trusted_roots)

    def as_source(self, trusted_roots: list[str] | None = None) -> RedisSource:
        """This source, or one over a copy of its queue that also trusts ``trusted_roots``."""
        return self.queue.as_source(trusted_roots) if trusted_roots else self

    def iterate(
        self, shard: int, num_shards: int, *, family: str = "", stop: Callable[[], bool] | None = None
    ) -> Iterator[tuple[str, Storage]]:
        from .._redis.options import POLL_S  # here: importing it imports redis, which the queue has by now

        q = self.queue
        if family:
            q.join_trainer(family)
        while True:
            try:
                item = q.get(None if stop is None else POLL_S)
            except _queue.Empty:
                if stop is not None and stop():
                    return
                continue
            except (HandleRecordError, UntrustedStorageError) as exc:
                if isinstance(exc, UntrustedStorageError) and not q.trusted_roots:
                    raise  # a misconfiguration, not an attack: get() left the entry in the stream
                self.refused += 1  # acknowledged and counted by get(): never raised out of a DataLoader
                _bounded.log_refused(logger, "Redis stream %s: %s", q.stream, exc)
                continue
            if item is None:
                return
            yield item

    @property
    def keep_alive_every(self) -> float:
        return self.queue.claim_after / 3

    def ack(self, tokens: list[str]) -> None:
        self.queue.ack(tokens)

    def fail(self, tokens: list[str]) -> None:
        self.queue.ack(tokens, failed=True)

    def give_back(self, tokens: list[str]) -> None:
        self.queue.give_back(tokens, family=self._family())

    def keep_alive(self, tokens: list[str]) -> None:
        self.queue.keep_alive(tokens, family=self._family())

    def _family(self) -> str:
        return self.queue.family or _family(str(os.getpid()))  # a worker's, else this trainer's
