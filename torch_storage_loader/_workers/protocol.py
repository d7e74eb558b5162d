"""What a loader worker and its parent say to each other: the messages, and replies that carry
shared-memory segments as file descriptors.

A reply is self-contained: the shared-memory segments it names travel as file descriptors attached
to the worker's own socket (SCM_RIGHTS), right behind the reply. A worker killed after replying
therefore loses nothing, and the parent never has to reach a worker to map what it sent.
"""

from __future__ import annotations

import array
import io
import os
import pickle
import socket
from multiprocessing.reduction import ForkingPickler
from typing import Any, NamedTuple

from .._shm.segments import ShmSegment

__all__ = [
    "STOP",
    "Failed",
    "Load",
    "Loaded",
    "Ready",
    "WorkerLost",
    "dumps_with_fds",
    "loads_with_fds",
    "recv_fds",
    "send_fds",
]


class Load(NamedTuple):
    """Parent -> worker: load ``storage``; the reply carries ``request_id``."""

    request_id: int
    storage: Any


STOP = None  # parent -> worker: finish and exit


class Ready(NamedTuple):
    """Worker -> parent, once, when the worker is up."""

    pid: int


class Loaded(NamedTuple):
    """Worker -> parent: ``payload`` (pickled with its segments as fds) and its ``FillInfo``.

    In the parent, ``WorkerPool`` hands it on with ``payload`` unpickled into the sample.
    """

    request_id: int
    info: Any
    payload: Any
    n_fds: int = 0


class Failed(NamedTuple):
    """Worker -> parent: loading raised ``error`` (with the worker's traceback attached in the parent)."""

    request_id: int
    error: BaseException
    traceback: str = ""


class WorkerLost(NamedTuple):
    """Parent-side event: a worker died with ``request_ids`` undelivered; ``restarted`` if replaced
    (not when ``MAX_STARTUP_FAILURES`` workers in a row failed before they were up)."""

    worker: int  # its index in the pool
    pid: int
    exitcode: int | None
    request_ids: tuple[int, ...]
    restarted: bool


# ------------------------------------------------------------------------------------- fd passing
class _SegmentPickler(ForkingPickler):
    """Pickles each ``ShmSegment`` as an index into ``fds``, the descriptors sent with the reply."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.fds: list[int] = []

    def persistent_id(self, obj: object) -> tuple[str, int, int] | None:
        if isinstance(obj, ShmSegment):
            if (fd := obj._fd) is None or fd < 0:  # never None once built (mypy infers int | None)
                raise ValueError("cannot send a ShmSegment whose descriptor was released")
            self.fds.append(fd)
            return ("shm", len(self.fds) - 1, obj.size)
        return None


class _SegmentUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, fds: list[int]) -> None:
        super().__init__(file)
        self.fds = fds
        self.used: set[int] = set()

    def persistent_load(self, pid: Any) -> ShmSegment:  # pid: what the reply's pickle says
        kind, index, size = pid
        if kind != "shm" or index in self.used or not 0 <= index < len(self.fds):
            raise pickle.UnpicklingError(f"bad shared-memory reference {pid!r} in a worker's reply")
        self.used.add(index)
        seg = ShmSegment(size, fd=self.fds[index])  # closes the fd itself if mapping fails
        seg.release_fd()  # a receiver never re-sends; the mapping is all it needs
        return seg


def dumps_with_fds(obj: Any) -> tuple[bytes, list[int]]:
    buf = io.BytesIO()
    pickler = _SegmentPickler(buf)
    pickler.dump(obj)
    return buf.getvalue(), pickler.fds


def loads_with_fds(data: bytes, fds: list[int]) -> Any:
    unpickler = _SegmentUnpickler(io.BytesIO(data), fds)
    try:
        return unpickler.load()
    finally:
        for i, fd in enumerate(fds):
            if i not in unpickler.used:
                os.close(fd)


def send_fds(sock: socket.socket, fds: list[int]) -> None:
    sock.sendmsg([b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])


def recv_fds(sock: socket.socket, n: int) -> list[int]:
    """Receive ``n`` descriptors sent by ``send_fds``; EOFError if the peer is gone first."""
    msg, ancdata, flags, _ = sock.recvmsg(1, socket.CMSG_SPACE(n * array.array("i").itemsize))
    fds = array.array("i")
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    if msg != b"F" or len(fds) != n or flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        if not msg:
            raise EOFError("worker closed its socket before sending the reply's descriptors")
        raise OSError(f"expected {n} descriptors with a worker's reply, got {len(fds)}")
    return list(fds)
