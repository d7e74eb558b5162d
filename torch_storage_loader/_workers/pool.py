"""Loader worker processes seen from the parent: starting, watching and replacing them, and decoding
their replies (the loop each one runs: ``worker``; what they say: ``protocol``)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import selectors
import socket
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, TypeAlias

from .. import _gpu  # noqa: F401 - replies are received through the GPU path, which importing it installs
from .._proc import WakePipe
from .._shm.slots import retire_rings
from .._stores import objects as _objects
from ..errors import unpack_exception
from .protocol import STOP, Failed, Load, Loaded, Ready, WorkerLost, loads_with_fds, recv_fds
from .worker import run_worker

__all__ = [
    "UNGUARDED_MAIN_EXIT",
    "WorkerConfig",
    "WorkerPool",
    "preload_torch_in_forkserver",
    "refuse_start_while_bootstrapping",
]

logger = logging.getLogger("torch_storage_loader")
_Conn: TypeAlias = "Connection[Load | None, Ready | Loaded | Failed]"  # the parent's end: sends, receives

MAX_STARTUP_FAILURES = 3  # workers in a row that exit with an error before they are up: stop replacing them
WORKER_NAME = "tsl-loader-worker-"
# A worker re-running a script's top level (no main guard) exits with this code when that code starts
# loaders: every worker would, so none is replaced, and the parent alone tells the trainer the fix.
UNGUARDED_MAIN_EXIT = 87
MAIN_GUARD_FIX = 'put the code that starts loaders under `if __name__ == "__main__":`'


def preload_torch_in_forkserver() -> None:
    """Have the forkserver import torch before it forks anything, if it has not started yet.

    A worker checks, before it sends a sample, that the trainer can build it, which imports torch
    there (about a second). Forked from a forkserver that has torch already, a worker (and one that
    replaces a killed worker) loads at once, as before. Modules already listed stay preloaded; a
    forkserver that runs already is left as it is (its workers import torch at their first load).
    """
    if "forkserver" not in mp.get_all_start_methods():
        return
    from multiprocessing import forkserver

    server = forkserver._forkserver  # the process-wide server multiprocessing starts on first use
    if getattr(server, "_forkserver_pid", None) is not None:
        return
    preload = list(getattr(server, "_preload_modules", ["__main__"]))
    if "torch" not in preload:
        forkserver.set_forkserver_preload([*preload, "torch"])


def refuse_start_while_bootstrapping() -> None:
    """Before starting workers: in a process still importing its parent's main script (what spawn and
    forkserver children do first), starting processes is a script without its main guard, run again.

    A loader worker of ours exits at once with ``UNGUARDED_MAIN_EXIT`` (before the rest of the script
    runs again, and without a traceback per worker); any other process gets a ``RuntimeError`` naming
    the guard, instead of multiprocessing's own error from a thread.
    """
    process = mp.current_process()
    if not getattr(process, "_inheriting", False):  # multiprocessing sets it while a child imports main
        return
    if process.name.startswith(WORKER_NAME):
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(UNGUARDED_MAIN_EXIT)  # a forkserver child's SystemExit would exit with 1
    raise RuntimeError(
        f"process {process.name!r} starts loader workers while it imports the main script again (it was "
        f"started with spawn or forkserver): {MAIN_GUARD_FIX}"
    )


@dataclass(frozen=True)
class WorkerConfig:
    n_slots: int
    max_rings: int
    budget: int  # shared-memory bytes this worker may hold
    shm_directory: str


class WorkerHandle:
    """One worker process, seen from the parent."""

    __slots__ = ("conn", "index", "inflight", "proc", "ready", "sock")

    def __init__(self, index: int, proc: BaseProcess, conn: _Conn) -> None:
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
        self._starting: _Conn | None = None  # the parent end of a pipe whose worker is being started
        self._selector = selectors.DefaultSelector()
        self._wake = WakePipe()
        self._selector.register(self._wake.fileno(), selectors.EVENT_READ, None)
        self._launched_lock = threading.Lock()
        self._stopped = False
        self._startup_failures = 0
        self._launcher: threading.Thread | None = None  # starts the first workers (see start)
        self._launched: list[tuple[int, BaseProcess, _Conn]] = []  # started, not yet adopted; under _launched_lock
        self._launch_error: BaseException | None = None

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the workers from a thread of their own and return at once: under forkserver or spawn
        a start takes seconds (the child imports the main script's imports), and the receiving thread
        meanwhile loads files itself. ``wait`` adopts each worker once started."""
        self._launcher = threading.Thread(target=self._launch_all, name="tsl-loader-start", daemon=True)
        self._launcher.start()

    @property
    def starting(self) -> bool:
        """Whether workers are still being started in the background."""
        return self._launcher is not None and (self._launcher.is_alive() or bool(self._launched))

    def any_ready(self) -> bool:
        return any(w.ready for w in self.workers)

    def all_ready(self) -> bool:
        """Whether all ``size`` workers are started and ready (read from any thread: a snapshot)."""
        workers = list(self.workers)
        return len(workers) == self._size and all(w.ready for w in workers)

    def _launch_all(self) -> None:
        try:
            for i in range(self._size):
                if self._stopped:
                    return
                launched = self._launch(i)
                with self._launched_lock:
                    self._launched.append(launched)
                self.wake()
        except BaseException as exc:  # noqa: BLE001 -- reported on the receiving thread by wait()
            self._launch_error = exc
            self.wake()

    def _launch(self, index: int) -> tuple[int, BaseProcess, _Conn]:
        cfg = self._config
        parent, child = self._ctx.Pipe(duplex=True)
        self._starting = parent  # a fork child closes its copy (see forget)
        try:
            proc: BaseProcess = self._ctx.Process(  # type: ignore[attr-defined]  # typeshed: on concrete contexts only
                target=run_worker,
                args=(child, cfg.n_slots, cfg.shm_directory, cfg.max_rings, cfg.budget, _objects.snapshot()),
                name=f"{WORKER_NAME}{index}",
                daemon=True,
            )
            proc.start()
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
            self._starting = None
        return index, proc, parent

    def _adopt_launched(self) -> None:
        with self._launched_lock:
            launched, self._launched = self._launched, []
        for index, proc, parent in launched:
            self._adopt(index, proc, parent)
        if self._launch_error is not None:
            exc, self._launch_error = self._launch_error, None
            raise exc

    def _spawn(self, index: int) -> WorkerHandle:
        return self._adopt(*self._launch(index))

    def _adopt(self, index: int, proc: BaseProcess, parent: _Conn) -> WorkerHandle:
        worker = WorkerHandle(index, proc, parent)
        self.workers.append(worker)
        # By descriptor number: a closed Connection has no fileno().
        self._selector.register(parent.fileno(), selectors.EVENT_READ, (worker, True))
        self._selector.register(proc.sentinel, selectors.EVENT_READ, (worker, False))
        return worker

    def stop(self, timeout: float = 5) -> None:
        """Ask every worker to exit, kill those that do not within ``timeout``, release everything."""
        self._stopped = True
        if self._launcher is not None:
            self._launcher.join()  # it stops after the worker it is starting
            self._launch_error = None
            self._adopt_launched()
        workers, self.workers = self.workers, []
        for w in workers:
            try:
                w.conn.send(STOP)
            except OSError:
                pass
        for w in workers:
            self._bury(w, timeout)
        self._selector.close()
        self._wake.close()

    def forget(self) -> None:
        """In a forked child: drop the parent's workers without touching them."""
        # multiprocessing would otherwise terminate and join them at this process's exit.
        children: set[BaseProcess] = mp.process._children  # type: ignore[attr-defined]  # private: not in typeshed
        for w in self.workers:
            children.discard(w.proc)
            w.close()
        for _, proc, parent in self._launched:
            children.discard(proc)
            parent.close()
        self._launched = []
        self._wake.close()
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

    def wake(self) -> None:
        self._wake.wake()  # a no-op once stopped

    # ------------------------------------------------------------------------------ receiving
    def wait(self, timeout: float | None = None) -> list[Loaded | Failed | WorkerLost]:
        """Block until something happens (at most ``timeout`` seconds); return replies and deaths
        (dead workers already replaced). Adopts the workers the start thread started."""
        if self._stopped:
            return []
        self._adopt_launched()
        events: list[Loaded | Failed | WorkerLost] = []
        for key, _ in self._selector.select(timeout):
            if key.data is None:
                self._wake.drain()
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
            return Loaded(
                msg.request_id, msg.info, loads_with_fds(msg.payload, fds) if fds else pickle.loads(msg.payload)
            )
        except Exception as exc:  # noqa: BLE001 - that request's error, not the worker's death
            return Failed(msg.request_id, exc)

    def _lose(self, worker: WorkerHandle) -> list[Loaded | Failed | WorkerLost]:
        """Deliver the replies the dead worker completed, bury it, and start a replacement."""
        events: list[Loaded | Failed | WorkerLost] = []
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
        assert pid is not None  # it was started before it was adopted
        code = self._bury(worker, timeout=5)
        failed_to_start = not worker.ready and code is not None and code > 0
        self._startup_failures = self._startup_failures + 1 if failed_to_start else 0
        if failed_to_start and code == UNGUARDED_MAIN_EXIT:
            self._startup_failures = MAX_STARTUP_FAILURES  # a replacement would run the same script again
        restarted = not self._stopped and self._startup_failures < MAX_STARTUP_FAILURES
        if restarted:
            self._spawn(worker.index)
        logger.warning(
            "loader worker %s (pid %s) died with exit code %s%s",
            worker.index,
            pid,
            code,
            "; started a new one" if restarted else "",
        )
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
