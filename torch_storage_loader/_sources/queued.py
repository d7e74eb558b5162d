"""A ``StorageQueue``, ``queue.Queue`` or multiprocessing queue as a streaming source."""

from __future__ import annotations

import queue as _queue
from collections.abc import Callable, Iterator
from multiprocessing.reduction import ForkingPickler
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

    def take_pickled(self, most: int, timeout: float) -> list[bytes] | None:
        """Between one and ``most`` handles, pickled: each is its own token (what the trainer feeds
        its workers, who unpickle it; a ``StorageQueue``'s handles are never unpickled here), or None
        once the stream ended. Raises as ``take``."""
        q = self.queue
        if isinstance(q, StorageQueue):
            return q._take(most, timeout)
        got = self.take(timeout)
        if got is None:
            return None
        try:
            return [bytes(ForkingPickler.dumps(got[1]))]
        except Exception as exc:  # noqa: BLE001 - whatever pickling raised: the handle cannot travel
            raise TypeError(f"{got[1]!r} does not pickle ({exc}): it cannot reach a DataLoader worker") from None

    def iterate(
        self, shard: int, num_shards: int, *, family: str = "", stop: Callable[[], bool] | None = None
    ) -> Iterator[tuple[Any, Storage]]:
        if isinstance(self.queue, _queue.Queue) and get_worker_info() is not None:
            raise TypeError(
                "a queue.Queue is not shared with worker processes, and this DataLoader's workers are "
                "not fed by the trainer (only torch's DataLoader feeds them); use a StorageQueue"
            )
        while True:
            try:
                got = self.take(timeout=3600.0)  # (never given a stop: under workers the trainer feeds them)
            except _queue.Empty:
                continue
            if got is None:
                return
            yield got

    def ack(self, tokens: list[Any]) -> None:
        pass

    def fail(self, tokens: list[Any]) -> None:
        pass

    def keep_alive(self, tokens: list[Any]) -> None:
        pass

    def give_back(self, tokens: list[Any]) -> None:
        """Put back handles taken and not delivered: tokens from ``take`` (handles) or from
        ``take_pickled`` (pickled handles)."""
        pickled = [t for t in tokens if type(t) is bytes]
        handles = [t for t in tokens if type(t) is not bytes]
        if isinstance(self.queue, StorageQueue):
            self.queue._give_back_pickled(pickled)
            self.queue.give_back(handles)
            return
        for storage in [*handles, *(ForkingPickler.loads(t) for t in pickled)]:
            self.queue.put(storage)
