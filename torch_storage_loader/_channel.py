"""A channel of frames (bytes) between processes, held by the process that made it.

A ``multiprocessing.Queue`` cannot hold more than its pipe does: a writer's feeder thread writes
what does not fit as the pipe is read, and the writer cannot exit before that. Here the owner runs
one thread, ``tsl-queue``, that moves bytes from the writers' pipe into memory and on into the
readers' socket as they read: a ``send`` returns once its frame is in the owner's hands, and what was
sent stays there as long as the owner lives. The thread copies bytes (whole frames, written under
one lock, read whole): it never looks inside them.

The readers' end is a socket, not a pipe, so that a reader can look at what is there without taking
it (``MSG_PEEK``) and take as many whole frames as it wants in one read: a trainer feeding its
workers takes dozens of small handles at a time, and a read per frame cost more than the rest of
the handle's way.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as _queue
import select
import socket
import struct
import threading
import time
import weakref
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

from ._proc import WakePipe, frame, pid_alive
from .errors import StorageError

__all__ = ["Channel"]

_CHUNK = 1 << 16
PEEK = 1 << 16  # the most a reader looks at for whole frames at once
_FRAME_GUESS = 1024  # bytes looked at per frame asked for (a FileStorage's frame is about 150)
_LEN = struct.Struct("!i")  # a frame's length, or -1 and 8 bytes more (see _proc.frame)


class _Relay:
    """The owner's thread: bytes from the producers' pipe (``inbox``) to the consumers' (``outbox``).

    It holds no reference to the queue, so the queue can be collected; ``stop`` (the queue's
    finalizer) ends it. What it buffers is whole frames in order, since producers write each frame
    under one lock and only this thread writes the outbox (non-blocking: a full outbox never keeps it
    from reading the inbox).
    """

    def __init__(self, inbox: Connection, outbox: Connection) -> None:
        self.pipes = (inbox, outbox)  # the owner's ends: they close with the relay
        self.inbox, self.outbox = inbox.fileno(), outbox.fileno()
        self.wake = WakePipe()
        os.set_blocking(self.outbox, False)
        self.pending: deque[memoryview] = deque()
        self.thread = threading.Thread(target=self._run, name="tsl-queue", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        pending, inbox, outbox, wake = self.pending, self.inbox, self.outbox, self.wake.fileno()
        while True:
            readable, writable, _ = select.select([inbox, wake], [outbox] if pending else [], [])
            if wake in readable:
                return
            if inbox in readable:
                pending.append(memoryview(os.read(inbox, _CHUNK)))
            if writable:
                while pending:
                    try:
                        n = os.write(outbox, pending[0])
                    except BlockingIOError:
                        break
                    if n == len(pending[0]):
                        pending.popleft()
                    else:
                        pending[0] = pending[0][n:]
                        break

    def stop(self) -> None:
        self.wake.wake()
        if threading.current_thread() is not self.thread:
            self.thread.join(5)
        self.wake.close()
        for pipe in self.pipes:
            pipe.close()


def _stop_relay(relay: _Relay, owner: int) -> None:
    if os.getpid() == owner:  # a forked child's copy of the finalizer has no thread to stop
        relay.stop()


class Channel:
    """Frames from any process to any process, held by the process that made the channel (its owner).

    Writers send frames into the ``inbox`` pipe under one lock; the owner's relay moves them
    into the ``outbox`` pipe, which readers poll without a lock and read under another. The owner's
    ends of the pipes stay with its relay: what travels to other processes is ``inbox``'s write end
    and ``outbox``'s read end.
    """

    def __init__(self, ctx: mp.context.BaseContext) -> None:
        self.owner = os.getpid()
        inbox_r, self.inbox = ctx.Pipe(duplex=False)
        self.outbox, outbox_w = ctx.Pipe(duplex=True)  # a socket pair: readers peek (see the module)
        os.set_blocking(self.inbox.fileno(), False)  # a writer waits in select(), watching the owner
        self.wlock = ctx.Lock()  # one writer writes a frame at a time
        self.rlock = ctx.Lock()  # one reader reads a frame at a time
        self.finalizer = weakref.finalize(self, _stop_relay, _Relay(inbox_r, outbox_w), self.owner)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("finalizer", None)  # the owner's alone (a copy passed on again has none)
        return state

    def check_owner(self) -> None:
        if not pid_alive(self.owner):
            raise StorageError(
                f"the process that made this StorageQueue (pid {self.owner}) has exited, and the "
                "handles it held with it; make the queue in a process that lives as long as the stream"
            )

    def send(self, data: bytes) -> None:
        """Send one frame (bytes the readers take whole); returns once it is in the inbox pipe."""
        rest = memoryview(frame(data))
        fd = self.inbox.fileno()
        with self.wlock:
            while rest:
                try:
                    rest = rest[os.write(fd, rest) :]
                except BrokenPipeError:  # nothing reads the inbox any more: the owner went
                    self.check_owner()
                    raise StorageError(  # the owner lives: its queue was dropped there
                        f"the process that made this StorageQueue (pid {self.owner}) no longer reads it: "
                        "it is exiting, or it dropped the queue; keep the queue referenced in that process "
                        "for as long as the stream runs"
                    ) from None
                except BlockingIOError:
                    # The owner's relay reads this pipe as fast as it fills; waiting means it is
                    # busy, or gone.
                    if not select.select([], [fd], [], 1.0)[1]:
                        self.check_owner()

    def take(self, most: int, wait: float) -> list[bytes]:
        """Between one and ``most`` frames, waiting up to ``wait`` seconds for the first without
        holding the read lock; the others are those already there (one lock for all of them).

        A consumer killed while it waits holds no lock, so the others go on; the lock is held only
        while frames that are already there are read.
        """
        outbox = self.outbox
        deadline = time.monotonic() + wait
        while True:
            if not outbox.poll(max(0.0, deadline - time.monotonic())):
                if os.getpid() != self.owner:
                    self.check_owner()
                raise _queue.Empty
            # A frame is there: wait for the lock (another consumer may be reading it), briefly.
            if self.rlock.acquire(timeout=0.05):
                try:
                    out = self._read(most)
                except EOFError:  # no process holds the outbox's write end: the owner is gone
                    self.check_owner()
                    raise
                finally:
                    self.rlock.release()
                if out:
                    return out
            if time.monotonic() >= deadline:
                raise _queue.Empty

    def _read(self, most: int) -> list[bytes]:
        """Up to ``most`` whole frames that are there now, in one read where they fit in ``PEEK``
        bytes (under the read lock); one frame read whole otherwise (a long one, or half written)."""
        if most == 1:
            return [self.outbox.recv_bytes()] if self.outbox.poll(0) else []
        # A socket object over the outbox's descriptor for this read only (detached after: the
        # Connection owns the descriptor); family, type and protocol given: no system call.
        peeker = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0, self.outbox.fileno())
        try:
            return self._read_peeking(peeker, most)
        finally:
            peeker.detach()

    def _read_peeking(self, peeker: socket.socket, most: int) -> list[bytes]:
        try:
            seen = peeker.recv(min(PEEK, most * _FRAME_GUESS), socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return []  # another reader took it between the poll and the lock
        if not seen:
            raise EOFError
        ends: list[int] = []
        at = 0
        while len(ends) < most and at + _LEN.size <= len(seen):
            n = _LEN.unpack_from(seen, at)[0]
            if n < 0:  # a long frame (its length in 8 more bytes): read whole, alone
                break
            if at + _LEN.size + n > len(seen):
                break
            at += _LEN.size + n
            ends.append(at)
        if not ends:
            return [self.outbox.recv_bytes()] if self.outbox.poll(0) else []
        data = peeker.recv(at)  # all there (seen, and this reader holds the lock): one read,
        while len(data) < at:  # unless a signal cuts it short
            got = peeker.recv(at - len(data))
            if not got:
                raise EOFError
            data += got
        out, start = [], 0
        for end in ends:
            out.append(data[start + _LEN.size : end])
            start = end
        return out
