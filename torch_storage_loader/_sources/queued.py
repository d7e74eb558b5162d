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

    Handles a DataLoader took but did not deliver are put back: ``StorageQueue.give_back`` (its
    consumers wait for them at the end of the stream), else after a plain queue's ``None``, which
    consumers look past briefly.
    """

    finite = False
    keep_alive_every = None
    ack_in_background = False

    def __init__(self, q: Any) -> None:
        self.queue = q

    def iterate(self, shard: int, num_shards: int, *, family: str = "") -> Iterator[tuple[Any, Storage]]:
        q = self.queue
        if isinstance(q, StorageQueue):
            for storage in q:
                yield storage, storage
            return
        if isinstance(q, _queue.Queue) and get_worker_info() is not None:
            raise TypeError(
                "a queue.Queue is not shared with DataLoader worker processes; use a "
                "StorageQueue or a multiprocessing Queue with num_workers > 0"
            )
        while True:
            item = q.get()
            if item is None:
                try:
                    item = q.get(timeout=0.05)  # a handle given back after the end
                except _queue.Empty:
                    item = None
                q.put(None)  # every consumer must see the end
                if item is None:
                    return
            if not isinstance(item, Storage):
                raise TypeError(f"queue yielded a {type(item).__name__}, not a Storage handle or None")
            yield item, item

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
