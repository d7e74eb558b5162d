"""Where a StorageDataset's handles come from: one module per source, behind one ``Source`` contract.

A finite source (``ListSource``) deals groups of handles to ranks and workers each epoch. A
streaming source (``Source``) hands out ``(token, handle)`` pairs and settles each token once:
``ack`` (the trainer has its sample), ``fail`` (it cannot load), or ``give_back`` (taken, never
delivered); ``keep_alive`` renews what is held where claims expire (``keep_alive_every`` seconds,
None: never), and ``ack_in_background`` asks the trainer's ledger thread to acknowledge in batches.
A source whose takes are not atomic with a record of who took (a queue: the handle is gone from it
before a worker can say so), or that one claimer per trainer serves best (a directory: no races
between workers, no message per claim), is ``fed_from_trainer``: under DataLoader workers the trainer
calls its ``take_pickled`` and feeds the workers, so a killed worker's handles are known
(``_dataloader.ledger``).
"""

from __future__ import annotations

import multiprocessing.queues
import os
import queue as _queue
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

from ..queue import StorageQueue
from ..storage import Storage
from .directory import DirectorySource
from .end import END_OF_STREAM, end_directory_stream, start_directory_stream
from .listed import ListSource
from .prefix import PrefixSource
from .queued import QueueSource

__all__ = [
    "END_OF_STREAM",
    "DirectorySource",
    "ListSource",
    "PrefixSource",
    "QueueSource",
    "Source",
    "SourceProvider",
    "as_source",
    "end_directory_stream",
    "start_directory_stream",
]


@runtime_checkable
class Source(Protocol):
    """A streaming source of handles (see the module)."""

    finite: bool
    ack_in_background: bool
    fed_from_trainer: bool

    @property
    def keep_alive_every(self) -> float | None: ...  # read-only: a class may say None, or a float

    def iterate(
        self, shard: int, num_shards: int, *, family: str = "", stop: Callable[[], bool] | None = None
    ) -> Iterator[tuple[Any, Storage]]:
        """``(token, handle)`` pairs for consumer ``shard`` of ``num_shards`` of trainer ``family``;
        ``stop`` is asked between polls while nothing is there to take: True ends them."""

    def ack(self, tokens: list[Any]) -> None: ...

    def fail(self, tokens: list[Any]) -> None: ...

    def give_back(self, tokens: list[Any]) -> None: ...

    def keep_alive(self, tokens: list[Any]) -> None: ...


@runtime_checkable
class SourceProvider(Protocol):
    """Something that makes its own source (a ``RedisStorageQueue``), trusting ``trusted_roots`` too."""

    def as_source(self, trusted_roots: Any = None) -> Source: ...


def as_source(source: Any, trusted_roots: Any = None) -> ListSource | Source:
    """The source behind ``source``; ``trusted_roots`` are added to a network source's own."""
    if isinstance(source, SourceProvider):
        return source.as_source(trusted_roots)
    if isinstance(source, (ListSource, Source)):
        return source
    if isinstance(source, (StorageQueue, _queue.Queue, multiprocessing.queues.Queue)):
        return QueueSource(source)
    if isinstance(source, (str, os.PathLike)):
        return DirectorySource(source)
    if hasattr(source, "get") and hasattr(source, "put"):
        return QueueSource(source)  # e.g. a manager's queue proxy
    try:
        return ListSource(source)
    except TypeError as exc:
        raise TypeError(
            f"source must be a list of Storage handles, a StorageQueue, a RedisStorageQueue, a "
            f"queue, or a directory path; got {type(source).__name__} ({exc})"
        ) from None
