"""A ``StorageQueue``, ``queue.Queue`` or multiprocessing queue as a streaming source."""

from __future__ import annotations

import queue as _queue
from collections.abc import Iterator
from typing import Any

from torch.utils.data import get_worker_info

from ..queue import StorageQueue
from ..storage import Storage

__all__ = ["QueueSource"]


class QueueSource:
    """A ``StorageQueue``, or a ``queue.Queue`` / multiprocessing queue ending at a ``None``.

    Taking from a queue removes the handle before anyone can record who took it, so under a
    DataLoader the trainer takes (``take``) and feeds its workers (``fed_from_trainer``: see
    ``_dataloader.ledger``); a worker killed at any point then loses nothing, and a thread's
    ``queue.Queue`` can feed worker processes too. Handles a DataLoader took but did not deliver
    are put back: ``StorageQueue.give_back`` (its consumers wait for them at the end of the
    stream), else after a plain queue's ``None``, which consumers look past briefly.
    """

    finite = False
    keep_alive_every = None
    ack_in_background = False
    fed_from_trainer = True

    def __init__(self, q: Any) -> None:
        self.queue = q

    def take(self, timeout: float) -> tuple[Any, Storage] | None:
        """The next ``(token, handle)``, or None once the stream ended; ``queue.Empty`` after ``timeout`` s.

        Raises:
            queue.Empty: Nothing came within ``timeout`` seconds.
            ProducerDiedError: A ``StorageQueue``'s watched producer died.
            TypeError: A plain queue held something other than a handle or ``None``.
        """
        q = self.queue
        if isinstance(q, StorageQueue):
            storage = q.get(timeout=timeout)
            return None if storage is None else (storage, storage)
        item = q.get(timeout=timeout)
        if item is None:
            try:
                item = q.get(timeout=0.05)  # a handle given back after the end
            except _queue.Empty:
                item = None
            q.put(None)  # every consumer must see the end
            if item is None:
                return None
        if not isinstance(item, Storage):
            raise TypeError(f"queue yielded a {type(item).__name__}, not a Storage handle or None")
        return item, item

    def iterate(self, shard: int, num_shards: int, *, family: str = "") -> Iterator[tuple[Any, Storage]]:
        if isinstance(self.queue, _queue.Queue) and get_worker_info() is not None:
            raise TypeError(
                "a queue.Queue is not shared with worker processes, and this DataLoader's workers are "
                "not fed by the trainer (only torch's DataLoader feeds them); use a StorageQueue"
            )
        while True:
            try:
                got = self.take(timeout=3600.0)
            except _queue.Empty:
                continue
            if got is None:
                return
            yield got

    def ack(self, tokens: list) -> None:
        pass

    def fail(self, tokens: list) -> None:
        pass

    def keep_alive(self, tokens: list) -> None:
        pass

    def give_back(self, tokens: list) -> None:
        if isinstance(self.queue, StorageQueue):
            self.queue.give_back(tokens)
            return
        for storage in tokens:
            self.queue.put(storage)
