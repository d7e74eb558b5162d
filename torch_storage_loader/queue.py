"""``StorageQueue``: a multi-producer, multi-consumer queue of storage handles across processes."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue as _queue
import time
from typing import Iterator

from ._proc import pid_alive
from .errors import StorageError
from .storage import Storage

__all__ = ["ProducerDiedError", "StorageQueue"]

MAX_PRODUCERS = 256


class ProducerDiedError(StorageError, RuntimeError):
    """A process registered with ``StorageQueue.producer()`` died without leaving it."""


class _End:
    """End-of-stream marker; every consumer that reads it puts it back for the next one."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _End)

    def __hash__(self) -> int:
        return 0


class StorageQueue:
    """Handles flow from producers to consumers (DataLoader workers, other processes).

    Pass it to producer processes and to ``StorageDataset`` under any start method (fork, spawn,
    forkserver): it travels with the process that is being started. ``close()`` ends the stream:
    consumers stop once it is drained. Producers that run ``with queue.producer():`` are watched:
    if one dies without leaving the block, consumers get ``ProducerDiedError`` instead of waiting
    forever.
    """

    def __init__(self, maxsize: int = 0, *, mp_context: str | mp.context.BaseContext | None = None) -> None:
        if maxsize < 0:
            raise ValueError(f"{maxsize=} must be >= 0")
        # Primitives made in a spawn context travel to fork, spawn and forkserver children alike;
        # fork-made ones refuse to go to spawned processes.
        ctx = mp.get_context(mp_context or "spawn") if isinstance(mp_context, (str, type(None))) else mp_context
        self._queue = ctx.Queue(maxsize)
        self._producers = ctx.Array("q", MAX_PRODUCERS)  # pids of live producers; 0 = free

    def put(self, storage: Storage, block: bool = True, timeout: float | None = None) -> None:
        if not isinstance(storage, Storage):
            raise TypeError(f"StorageQueue holds Storage handles, got {type(storage).__name__}")
        self._queue.put(storage, block, timeout)

    def close(self) -> None:
        """End the stream: consumers stop once every handle put before it is taken.

        Handles put after it (as a stopped ``StorageDataset`` gives back what it did not deliver)
        are still taken by the consumers that come after.
        """
        self._queue.put(_End())

    def get(self, timeout: float | None = None) -> Storage | None:
        """The next handle, or ``None`` once the queue is closed and drained.

        Raises ``queue.Empty`` after ``timeout`` seconds, and ``ProducerDiedError`` when the
        queue is empty and a watched producer has died.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 0.1 if deadline is None else min(0.1, max(0.0, deadline - time.monotonic()))
            try:
                item = self._queue.get(timeout=wait)
            except _queue.Empty:
                dead = self.dead_producers()
                if dead:
                    raise ProducerDiedError(
                        f"producer process(es) {dead} died without closing the StorageQueue or leaving "
                        "queue.producer(); what they did not put is lost. Restart them, or close() the "
                        "queue to end the stream", pids=dead) from None
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                continue
            if isinstance(item, _End):
                try:  # a handle a stopped DataLoader gave back after the end: deliver it first
                    item = self._queue.get(timeout=0.05)
                except _queue.Empty:
                    item = None
                self._queue.put(_End())
                if item is None or isinstance(item, _End):
                    return None
            return item

    def __iter__(self) -> Iterator[Storage]:
        while (item := self.get()) is not None:
            yield item

    @contextlib.contextmanager
    def producer(self) -> Iterator[StorageQueue]:
        """Mark this process as a producer for as long as the block runs (see the class doc)."""
        pid = os.getpid()
        with self._producers.get_lock():
            try:
                slot = list(self._producers[:]).index(0)
            except ValueError:
                raise RuntimeError(f"more than {MAX_PRODUCERS} producers at once") from None
            self._producers[slot] = pid
        try:
            yield self
        finally:
            with self._producers.get_lock():
                self._producers[slot] = 0

    def dead_producers(self) -> list[int]:
        with self._producers.get_lock():
            pids = [p for p in self._producers[:] if p]
        return [pid for pid in pids if not pid_alive(pid)]
