"""``StorageQueue``: a multi-producer, multi-consumer queue of storage handles across processes.

Its handles travel through a ``_channel.Channel``, held by the process that makes the queue.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue as _queue
import struct
import time
from collections.abc import Iterator

from ._channel import Channel
from ._options import check_option
from ._proc import pid_alive
from .errors import (
    ProducerDiedError,  # re-exported: torch_storage_loader.queue.ProducerDiedError stays importable
)
from .storage import Storage

__all__ = ["ProducerDiedError", "StorageQueue"]

MAX_PRODUCERS = 256


# A frame is one of these bytes, then its payload: a pickled handle put by a producer; a pickled
# handle given back (after the 8-byte pid of the process that gave it back); the end of the stream.
_HANDLE, _RETURNED, _END = b"H", b"R", b"E"
_PID = struct.Struct("<q")


class StorageQueue:
    """Handles flow from producers to consumers (DataLoader workers, other processes).

    Pass it to producer processes and to ``StorageDataset`` under any start method (fork, spawn,
    forkserver): it travels with the process that is being started. The process that makes the
    queue holds what was put and not yet read (a thread, ``tsl-queue``, moves handles from producers
    to consumers): a ``put`` returns at once, producers exit whenever they are done, and their
    handles wait for consumers as long as that process lives. Make the queue where the stream lives
    its whole life: the trainer, or the script that starts collectors and trainer.

    ``close()`` ends the stream: consumers stop once it is drained, and once every handle given back
    (``give_back``, as a stopped ``StorageDataset`` does) was taken again. With several producers,
    one process closes: the one that started them, once they are done or once the trainer stops
    (producers that loop forever check ``closed``). A ``put`` racing the close still keeps its handle
    for the next consumer, and a full queue stops blocking its producers once closed.
    Producers that run ``with queue.producer():`` are watched: if one dies without leaving the block,
    consumers get ``ProducerDiedError`` instead of waiting forever.

    Args:
        maxsize: How many handles the queue holds before ``put`` blocks; 0: no bound. Handles given
            back do not count.
        mp_context: The multiprocessing start method (a name or a context) its primitives are made
            in; None: ``spawn``, whose primitives travel to children of any start method.

    Raises:
        TypeError: ``maxsize`` is not an int.
        ValueError: ``maxsize`` is negative.

    Examples:
        >>> from torch_storage_loader import FileStorage, StorageQueue
        >>> queue = StorageQueue()
        >>> queue.put(FileStorage("a.tsl"))
        >>> queue.close()
        >>> list(queue)
        [FileStorage('a.tsl')]
    """

    def __init__(self, maxsize: int = 0, *, mp_context: str | mp.context.BaseContext | None = None) -> None:
        check_option("maxsize", maxsize, int, least=0)
        # Primitives made in a spawn context travel to fork, spawn and forkserver children alike;
        # fork-made ones refuse to go to spawned processes.
        ctx = mp.get_context(mp_context or "spawn") if isinstance(mp_context, (str, type(None))) else mp_context
        self._channel = Channel(ctx)
        # Not bounded: a handle put past the end skipped the bound, and its release lands on nothing.
        self._room = ctx.Semaphore(maxsize) if maxsize else None
        self._closed = ctx.Value("b", 0)  # close() was called
        self._producers = ctx.Array("q", MAX_PRODUCERS)  # pids of live producers; 0 = free
        self._ended = ctx.Value("b", 0, lock=False)  # the end marker was read
        self._returns = ctx.Array("q", 2 * MAX_PRODUCERS)  # (pid, handles given back and not yet taken)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called (by any process): producers that loop forever stop on it."""
        return bool(self._closed.value)

    def put(self, storage: Storage, block: bool = True, timeout: float | None = None) -> None:
        """Add a handle for a consumer to take; returns once the queue's owner process holds it.

        Args:
            storage: The handle (its sample must be saved already).
            block: Wait while the queue is full; False raises ``queue.Full`` at once instead.
            timeout: With ``block``, raise ``queue.Full`` after this many seconds; None waits forever.

        Raises:
            TypeError: ``storage`` is not a ``Storage`` handle.
            queue.Full: The queue stayed full (see ``block`` and ``timeout``).
            StorageError: The process that made the queue has exited (the queue went with it).
        """
        if not isinstance(storage, Storage):
            raise TypeError(f"StorageQueue holds Storage handles, got {type(storage).__name__}")
        if self._room is not None:
            self._wait_for_room(block, timeout)
        self._channel.send(_HANDLE + pickle.dumps(storage, protocol=pickle.HIGHEST_PROTOCOL))

    def _wait_for_room(self, block: bool, timeout: float | None) -> None:
        assert self._room is not None
        if not block:
            if not self._room.acquire(False):
                raise _queue.Full
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._room.acquire(timeout=0.1):
            if self._closed.value:
                return  # past the end the bound is moot: a producer is never stranded by a full, closed queue
            self._channel.check_owner()
            if deadline is not None and time.monotonic() >= deadline:
                raise _queue.Full

    def close(self) -> None:
        """End the stream: consumers stop once every handle put before it is taken."""
        with self._closed.get_lock():
            if self._closed.value:
                return
            self._closed.value = 1
        self._channel.send(_END)

    def give_back(self, storages: list[Storage]) -> None:
        """Put back handles taken and not used, to be taken again even after the stream ended.

        Consumers wait for them at the end of the stream as long as this process lives.

        Args:
            storages: The handles, as ``get`` returned them.
        """
        self._give_back_pickled([pickle.dumps(s, protocol=pickle.HIGHEST_PROTOCOL) for s in storages])

    def _give_back_pickled(self, handles: list[bytes]) -> None:
        """``give_back`` for handles as ``_take`` returned them (pickled)."""
        if not handles:
            return
        pid = os.getpid()
        with self._returns.get_lock():
            pairs = self._returns
            slot = next((i for i in range(0, len(pairs), 2) if pairs[i] == pid), None)
            if slot is None:
                slot = next(i for i in range(0, len(pairs), 2) if pairs[i + 1] == 0)
                pairs[slot] = pid
            pairs[slot + 1] += len(handles)
        for data in handles:
            self._channel.send(_RETURNED + _PID.pack(pid) + data)

    def _took_back(self, pid: int) -> None:
        with self._returns.get_lock():
            pairs = self._returns
            for i in range(0, len(pairs), 2):
                if pairs[i] == pid and pairs[i + 1] > 0:
                    pairs[i + 1] -= 1
                    return

    def _returns_pending(self) -> bool:
        """Handles given back by live processes that nobody took yet (a dead one's are gone with it)."""
        with self._returns.get_lock():
            pairs = self._returns
            for i in range(0, len(pairs), 2):
                if pairs[i + 1] > 0:
                    if pid_alive(pairs[i]):
                        return True
                    pairs[i + 1] = 0
        return False

    def get(self, timeout: float | None = None) -> Storage | None:
        """The next handle, or ``None`` once the queue is closed and drained.

        Args:
            timeout: Seconds to wait for a handle; None waits as long as the stream is open.

        Returns:
            The next handle, or None once the queue is closed and drained.

        Raises:
            queue.Empty: No handle came within ``timeout`` seconds.
            ProducerDiedError: The queue is empty and a watched producer has died.
            StorageError: The process that made the queue has exited (the queue went with it).
        """
        got = self._take(1, timeout)
        return None if got is None else pickle.loads(got[0])

    def _take(self, most: int, timeout: float | None) -> list[bytes] | None:
        """Between one and ``most`` handles, pickled (what a DataLoader's trainer passes on to its
        workers without unpickling), or None once the queue is closed and drained; raises as ``get``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 0.1 if deadline is None else min(0.1, max(0.0, deadline - time.monotonic()))
            if self._ended.value:
                wait = min(wait, 0.02)
            try:
                frames = self._channel.take(most, wait)
            except _queue.Empty:
                if self._ended.value:
                    if not self._returns_pending():
                        return None
                    continue
                dead = self.dead_producers()
                if dead:
                    raise ProducerDiedError(
                        f"producer process(es) {dead} died without closing the StorageQueue or leaving "
                        "queue.producer(); what they did not put is lost. Restart them, or close() the "
                        "queue to end the stream",
                        producers=dead,
                    ) from None
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                continue
            out = []
            for frame in frames:
                kind = frame[:1]
                if kind == _HANDLE:
                    if self._room is not None:
                        self._room.release()
                    out.append(frame[1:])
                elif kind == _RETURNED:
                    self._took_back(_PID.unpack_from(frame, 1)[0])
                    out.append(frame[1 + _PID.size :])
                elif kind == _END:
                    self._ended.value = 1
            if out:
                return out

    def __iter__(self) -> Iterator[Storage]:
        while (item := self.get()) is not None:
            yield item

    @contextlib.contextmanager
    def producer(self) -> Iterator[StorageQueue]:
        """Mark this process as a producer for as long as the block runs (see the class doc).

        Yields:
            This queue, to put handles into.

        Raises:
            RuntimeError: More than 256 producers are registered at once.

        Examples:
            >>> from torch_storage_loader import FileStorage, StorageQueue
            >>> queue = StorageQueue()
            >>> with queue.producer() as q:
            ...     q.put(FileStorage("a.tsl"))
            >>> queue.dead_producers()
            []
        """
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
        """Producers that died inside ``with queue.producer():``, without leaving it.

        Returns:
            Their process ids; empty while every registered producer lives.
        """
        with self._producers.get_lock():
            pids = [p for p in self._producers[:] if p]
        return [pid for pid in pids if not pid_alive(pid)]
