"""Loader worker processes: the loop each one runs, the messages they exchange, and their supervision.

A reply is self-contained: the shared-memory segments it names travel as file descriptors attached
to the worker's own socket (SCM_RIGHTS), right behind the reply. A worker killed after replying
therefore loses nothing, and the parent never has to reach a worker to map what it sent.
"""

from __future__ import annotations

import array
import io
import logging
import multiprocessing as mp
import os
import pickle
import selectors
import signal
import socket
import threading
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, NamedTuple

from ._shm import ENV_DIR, ShmSegment
from ._slots import retire_rings
from . import _objects
from ._worker import SlotFiller
from .errors import pack_exception, unpack_exception

__all__ = ["Failed", "Load", "Loaded", "Ready", "STOP", "WorkerConfig", "WorkerLost", "WorkerPool", "run_worker"]

logger = logging.getLogger("torch_storage_loader")

MAX_STARTUP_FAILURES = 3  # workers in a row that exit with an error before they are up: stop replacing them


# ------------------------------------------------------------------------------------- protocol
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

    index: int
    pid: int
    exitcode: int | None
    request_ids: tuple[int, ...]
    restarted: bool


# ------------------------------------------------------------------------------------- fd passing
class _SegmentPickler(ForkingPickler):
    """Pickles each ``ShmSegment`` as an index into ``fds``, the descriptors sent with the reply."""

    def __init__(self, file) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.fds: list[int] = []

    def persistent_id(self, obj):
        if isinstance(obj, ShmSegment):
            if obj._fd < 0:
                raise ValueError("cannot send a ShmSegment whose descriptor was released")
            self.fds.append(obj._fd)
            return ("shm", len(self.fds) - 1, obj.size)
        return None


class _SegmentUnpickler(pickle.Unpickler):
    def __init__(self, file, fds: list[int]) -> None:
        super().__init__(file)
        self.fds = fds
        self.used: set[int] = set()

    def persistent_load(self, pid):
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


# ---------------------------------------------------------------------------------- worker side
def run_worker(conn, n_slots: int, slot_size_hint: int, shm_directory: str, max_rings: int = 8,
               budget: int | None = None, object_stores: dict | None = None) -> None:
    """A StorageLoader worker: answer each ``Load`` with ``Loaded`` or ``Failed`` until ``STOP`` or EOF.

    ``object_stores``: the parent's object-store options (``_objects.snapshot()``), for ``ObjectStorage``.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops us
    os.environ[ENV_DIR] = shm_directory
    if object_stores:
        _objects.apply(object_stores)
    _objects.use_obstore_here()
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    filler = SlotFiller(n_slots, slot_size_hint, max_rings=max_rings, budget=budget)
    try:
        conn.send(Ready(os.getpid()))
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg is STOP:
                break
            payload = None
            try:
                info, payload = filler.fill(msg.storage)
                data, fds = dumps_with_fds(payload)
                reply = Loaded(msg.request_id, info, data, len(fds))
            except BaseException as exc:  # noqa: BLE001 - everything goes back to the caller
                payload, fds = None, []
                reply = Failed(msg.request_id, *pack_exception(exc))
            try:
                conn.send(reply)
                if fds:
                    send_fds(sock, fds)
            except OSError:
                break
            finally:
                if payload is not None:
                    filler.sent(payload)
                del payload
    except (BrokenPipeError, ConnectionResetError):
        pass  # the parent is gone
    finally:
        filler.close()
        sock.close()
        conn.close()


# ---------------------------------------------------------------------------------- parent side
@dataclass(frozen=True)
class WorkerConfig:
    n_slots: int
    max_rings: int
    budget: int  # shared-memory bytes this worker may hold
    shm_directory: str


class WorkerHandle:
    """One worker process, seen from the parent."""

    __slots__ = ("index", "proc", "conn", "sock", "ready", "inflight")

    def __init__(self, index: int, proc, conn) -> None:
        self.index, self.proc, self.conn = index, proc, conn
        self.sock = socket.socket(fileno=os.dup(conn.fileno()))
        self.ready = False
        self.inflight: set[int] = set()

    def close(self) -> None:
        self.conn.close()
        self.sock.close()


class WorkerPool:
    """Starts ``size`` workers, watches them, replaces the dead, and decodes their replies.

    Every method but ``pids`` and ``forget`` belongs to one thread (the loader's receiving thread),
    except ``stop`` once that thread is done. ``wake`` may be called from any thread.
    """

    def __init__(self, ctx: mp.context.BaseContext, size: int, config: WorkerConfig) -> None:
        self._ctx, self._size, self._config = ctx, size, config
        self.workers: list[WorkerHandle] = []
        self._starting = None  # the parent end of a pipe whose worker is being started
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._wake_lock = threading.Lock()  # wake() may race stop(): never write to a reused fd number
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._stopped = False
        self._startup_failures = 0

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        for i in range(self._size):
            self._spawn(i)

    def _spawn(self, index: int) -> WorkerHandle:
        cfg = self._config
        parent, child = self._ctx.Pipe(duplex=True)
        self._starting = parent  # a fork child closes its copy (see forget)
        try:
            proc = self._ctx.Process(
                target=run_worker,
                args=(child, cfg.n_slots, 0, cfg.shm_directory, cfg.max_rings, cfg.budget, _objects.snapshot()),
                name=f"tsl-loader-worker-{index}", daemon=True)
            proc.start()
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
            self._starting = None
        worker = WorkerHandle(index, proc, parent)
        self.workers.append(worker)
        # By descriptor number: a closed Connection has no fileno().
        self._selector.register(parent.fileno(), selectors.EVENT_READ, (worker, True))
        self._selector.register(proc.sentinel, selectors.EVENT_READ, (worker, False))
        return worker

    def stop(self, timeout: float = 5) -> None:
        """Ask every worker to exit, kill those that do not within ``timeout``, release everything."""
        self._stopped = True
        workers, self.workers = self.workers, []
        for w in workers:
            try:
                w.conn.send(STOP)
            except OSError:
                pass
        for w in workers:
            self._bury(w, timeout)
        self._selector.close()
        with self._wake_lock:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_w = -1

    def forget(self) -> None:
        """In a forked child: drop the parent's workers without touching them."""
        for w in self.workers:
            # multiprocessing would otherwise terminate and join them at this process's exit.
            mp.process._children.discard(w.proc)
            w.close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        self._wake_w = -1
        if self._starting is not None:
            self._starting.close()
        self.workers = []
        self._stopped = True

    # -------------------------------------------------------------------------------- dispatch
    def least_busy(self, max_inflight: int) -> WorkerHandle | None:
        """The ready worker with the fewest loads in flight, if it has fewer than ``max_inflight``."""
        ready = [w for w in self.workers if w.ready]
        worker = min(ready, key=lambda w: len(w.inflight), default=None)
        return worker if worker is not None and len(worker.inflight) < max_inflight else None

    def send(self, worker: WorkerHandle, request_id: int, storage: Any) -> None:
        worker.inflight.add(request_id)
        try:
            worker.conn.send(Load(request_id, storage))
        except OSError:
            pass  # the worker is dead: wait() reports it, with this request

    def pids(self) -> list[int]:
        return [w.proc.pid for w in list(self.workers)]

    def wake(self) -> None:
        with self._wake_lock:
            if self._wake_w < 0:
                return  # stopped
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass  # full: the thread is awake anyway

    # ------------------------------------------------------------------------------ receiving
    def wait(self) -> list[Loaded | Failed | WorkerLost]:
        """Block until something happens; return replies and deaths (dead workers already replaced)."""
        if self._stopped:
            return []
        events: list = []
        for key, _ in self._selector.select():
            if key.data is None:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
                continue
            worker, is_conn = key.data
            if worker not in self.workers:
                continue  # buried earlier in this batch
            if is_conn:
                try:
                    event = self._receive(worker)
                except (EOFError, OSError):
                    pass  # the worker is gone, possibly mid-reply
                else:
                    if event is not None:
                        events.append(event)
                    continue
            events += self._lose(worker)
        return events

    def _receive(self, worker: WorkerHandle) -> Loaded | Failed | None:
        msg = worker.conn.recv()
        if isinstance(msg, Ready):
            worker.ready = True
            self._startup_failures = 0
            return None
        fds = recv_fds(worker.sock, msg.n_fds) if isinstance(msg, Loaded) and msg.n_fds else []
        worker.inflight.discard(msg.request_id)
        if isinstance(msg, Failed):
            return Failed(msg.request_id, unpack_exception(msg.error, msg.traceback))
        try:
            # Without descriptors the payload holds no persistent ids: plain loads is cheaper.
            return Loaded(msg.request_id, msg.info, loads_with_fds(msg.payload, fds) if fds else pickle.loads(msg.payload))
        except Exception as exc:  # noqa: BLE001 - that request's error, not the worker's death
            return Failed(msg.request_id, exc)

    def _lose(self, worker: WorkerHandle) -> list[Loaded | Failed | WorkerLost]:
        """Deliver the replies the dead worker completed, bury it, and start a replacement."""
        events: list = []
        try:
            while worker.conn.poll():
                event = self._receive(worker)
                if event is not None:
                    events.append(event)
        except (EOFError, OSError):
            pass  # the rest is a reply cut short
        self.workers.remove(worker)
        self._selector.unregister(worker.conn.fileno())
        self._selector.unregister(worker.proc.sentinel)
        pid, lost = worker.proc.pid, tuple(worker.inflight)
        code = self._bury(worker, timeout=5)
        failed_to_start = not worker.ready and code is not None and code > 0
        self._startup_failures = self._startup_failures + 1 if failed_to_start else 0
        restarted = not self._stopped and self._startup_failures < MAX_STARTUP_FAILURES
        if restarted:
            self._spawn(worker.index)
        logger.warning("loader worker %s (pid %s) died with exit code %s%s", worker.index, pid, code,
                       "; started a new one" if restarted else "")
        events.append(WorkerLost(worker.index, pid, code, lost, restarted))
        return events

    @staticmethod
    def _bury(worker: WorkerHandle, timeout: float) -> int | None:
        worker.proc.join(timeout)
        if worker.proc.is_alive():
            worker.proc.kill()
            worker.proc.join()
        code = worker.proc.exitcode
        worker.close()
        retire_rings(worker.proc.pid)
        worker.proc.close()
        return code
