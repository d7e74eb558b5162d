"""``StorageLoader``: save synchronously, load asynchronously in worker processes.

Names and defaults follow DI-engine's ``ding.data.storage_loader``, so switching is an import change.
Unlike it, data handed to a callback is never overwritten later: each sample lives in a
shared-memory slot that stays leased until the last array or tensor viewing it is dropped (keep
what you got as long as you like; the worker uses another slot, or a slower path when none is free).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import importlib
import logging
import multiprocessing as mp
import os
import selectors
import threading
import time
import weakref
from abc import ABC, abstractmethod
from concurrent.futures import Future
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

from ._shm import shm_dir
from ._slots import retire_rings
from ._supervisor import run_worker
from .errors import LoadCancelledError, WorkerDiedError, unpack_exception
from .storage import Storage

__all__ = ["LoaderStats", "StorageLoader"]

logger = logging.getLogger("torch_storage_loader")


@dataclasses.dataclass(frozen=True)
class LoaderStats:
    """A snapshot of what a loader did since it was created."""

    loads: int = 0  # samples delivered
    bytes: int = 0  # array bytes delivered
    errors: int = 0  # loads that failed
    slot_loads: int = 0  # delivered through a shared-memory slot
    fallbacks: int = 0  # delivered in a segment of its own (every slot of every ring still leased)
    regrows: int = 0  # a worker added a ring (slots all leased) or replaced its rings by larger ones
    retries: int = 0  # loads retried after their worker died
    worker_restarts: int = 0
    queued: int = 0  # loads that waited because every worker was busy
    queue_wait_s: float = 0.0  # total time they waited
    pending: int = 0  # not yet delivered
    expired: int = 0  # files deleted by the TTL cleaner (FileStorageLoader)
    expired_unloaded: int = 0  # ... of which this loader never loaded

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Request:
    __slots__ = ("storage", "future", "callback", "attempts", "enqueued", "waited")

    def __init__(self, storage: Storage, callback: Callable | None) -> None:
        self.storage = storage
        self.future: Future = Future()
        self.callback = callback
        self.attempts = 0
        self.enqueued = time.monotonic()
        self.waited = False


class _Worker:
    __slots__ = ("index", "proc", "conn", "inflight")

    def __init__(self, index: int, proc, conn) -> None:
        self.index, self.proc, self.conn = index, proc, conn
        self.inflight: dict[int, _Request] = {}


_live: weakref.WeakSet = weakref.WeakSet()

# multiprocessing terminates daemon children from its own atexit hook, registered when
# multiprocessing.util is first imported. Import it first, so that (atexit being LIFO) loaders
# shut their workers down cleanly before that hook runs.
importlib.import_module("multiprocessing.util")


@atexit.register
def _shutdown_live_loaders() -> None:
    for loader in list(_live):
        loader.shutdown(timeout=5)


def default_context():
    """``forkserver`` where available (Python 3.14's default on Linux), else ``spawn``."""
    methods = mp.get_all_start_methods()
    return mp.get_context("forkserver" if "forkserver" in methods else "spawn")


class StorageLoader(ABC):
    """Loads ``Storage`` handles in ``worker_num`` processes and calls back with the samples.

    The first ``load`` reads in the calling thread and sizes each worker's ring of
    ``slots_per_worker`` shared-memory slots from that sample; later loads run in the workers. A
    worker whose slots are all still held by the consumer adds rings, up to
    ``max_rings_per_worker``, then gives each further sample a segment of its own (a fallback).
    Callbacks run on the loader's receiving thread, one at a time, in completion order.
    """

    def __init__(self, worker_num: int = 3, *, slots_per_worker: int = 4, max_rings_per_worker: int = 8,
                 max_inflight_per_worker: int = 4, mp_context: str | mp.context.BaseContext | None = None) -> None:
        if worker_num < 1:
            raise ValueError(f"{worker_num=} must be >= 1")
        if slots_per_worker < 1:
            raise ValueError(f"{slots_per_worker=} must be >= 1")
        if max_rings_per_worker < 1:
            raise ValueError(f"{max_rings_per_worker=} must be >= 1")
        if max_inflight_per_worker < 1:
            raise ValueError(f"{max_inflight_per_worker=} must be >= 1")
        self._worker_num = worker_num
        self._slots = slots_per_worker
        self._max_rings = max_rings_per_worker
        self._max_inflight = max_inflight_per_worker
        if isinstance(mp_context, str):
            mp_context = mp.get_context(mp_context)
        self._ctx = mp_context or default_context()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._start_lock = threading.Lock()
        self._counts: collections.Counter = collections.Counter()
        self._reset_state()

    def _reset_state(self) -> None:
        self._workers: list[_Worker] = []
        self._pending: collections.deque[_Request] = collections.deque()
        self._ready: collections.deque[tuple[_Request, Any]] = collections.deque()
        self._thread: threading.Thread | None = None
        self._wake: tuple[int, int] | None = None
        self._stop = threading.Event()
        self._hint = 0
        self._started = False
        self._closing = False

    # ----------------------------------------------------------------------------- public API
    @abstractmethod
    def save(self, obj: Any) -> Storage:
        """Store ``obj`` synchronously and return a small, picklable handle to it."""

    def to_storage(self, obj: Any) -> Storage:
        """DI-engine's older name for ``save``."""
        return self.save(obj)

    def load(self, storage: Storage, callback: Callable[[Any], None]) -> Future:
        """Load ``storage`` in a worker, then call ``callback(obj)`` on the receiving thread.

        Returns at once. The returned ``Future`` resolves to ``None`` once the callback has run
        (it does not hold the sample, so keeping futures around keeps no slot leased), or to the
        error: a failure is logged and set on it, and the callback is not called then. A callback
        that raises is logged; the loader keeps serving.
        """
        return self._submit(storage, callback)

    def load_async(self, storage: Storage) -> Future:
        """Load ``storage`` in a worker; the ``Future`` gets the sample or the error."""
        return self._submit(storage, None)

    def stats(self) -> LoaderStats:
        with self._lock:
            c = dict(self._counts)
            c["pending"] = self._outstanding_locked()
        c["queue_wait_s"] = c.pop("queue_wait_ns", 0) / 1e9
        return LoaderStats(**c)

    def shutdown(self, timeout: float | None = None) -> None:
        """Deliver what is pending (at most ``timeout`` seconds), then stop workers and threads.

        Loads still pending after ``timeout`` fail with ``LoadCancelledError``. All shared memory is
        released; the loader can be used again afterwards.
        """
        on_receiver = threading.current_thread() is self._thread
        with self._cond:
            if not self._started or self._closing:
                return
            self._closing = True
        leftovers: list[_Request] = []
        try:
            with self._cond:
                deadline = None if timeout is None else time.monotonic() + timeout
                while self._outstanding_locked() and not on_receiver:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    self._cond.wait(left)
        finally:
            with self._lock:
                leftovers = [req for req, _ in self._ready] + list(self._pending)
                for w in self._workers:
                    leftovers += w.inflight.values()
                    w.inflight = {}
                self._ready.clear()
                self._pending.clear()
                self._stop.set()
            self._stop_workers_and_thread(on_receiver)
            for req in leftovers:
                self._finish(req, error=LoadCancelledError(
                    f"shutdown(timeout={timeout}) gave up on loading {req.storage!r}; "
                    "call shutdown() without a timeout to wait for every pending load",
                    storage=req.storage))
            with self._lock:
                self._reset_state()
            _live.discard(self)

    def __enter__(self) -> "StorageLoader":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    # ---------------------------------------------------------------------- hooks for subclasses
    def _on_submit(self, storage: Storage) -> None:
        """Called before a load is queued (FileStorageLoader pins the file against its TTL)."""

    def _on_finish(self, storage: Storage) -> None:
        """Called once a load is delivered or has failed."""

    # -------------------------------------------------------------------------------- internals
    def _outstanding_locked(self) -> int:
        return len(self._pending) + len(self._ready) + sum(len(w.inflight) for w in self._workers)

    def _submit(self, storage: Storage, callback: Callable | None) -> Future:
        if not isinstance(storage, Storage):
            raise TypeError(f"storage must be a Storage handle, got {type(storage).__name__}")
        req = _Request(storage, callback)
        self._on_submit(storage)
        if self._enqueue(req):
            return req.future
        with self._start_lock:  # one first meet at a time; the others queue behind it
            if not self._enqueue(req):
                self._first_meet(req)
        return req.future

    def _enqueue(self, req: _Request) -> bool:
        with self._lock:
            if self._closing:
                self._on_finish(req.storage)
                raise RuntimeError("this loader is shutting down; load again once shutdown() returned")
            if not self._started:
                return False
            self._pending.append(req)
            self._dispatch_locked()
            return True

    def _first_meet(self, req: _Request) -> None:
        """Load in this thread to learn the sample size, then start the workers sized from it."""
        from ._format import layout
        from ._tree import encode

        try:
            obj = req.storage.load()
            _, leaves = encode(obj, allow_pickle=True)
            hint = layout(leaves)[1]
        except BaseException as exc:  # noqa: BLE001 - delivered through the Future
            self._finish(req, error=exc)
            return
        with self._lock:
            self._hint = hint
            self._wake = os.pipe()
            os.set_blocking(self._wake[1], False)
            self._workers = [self._spawn(i) for i in range(self._worker_num)]
            self._ready.append((req, obj))
            self._started = True
            self._thread = threading.Thread(target=self._run, args=(self._stop, self._wake),
                                            name="tsl-loader-recv", daemon=True)
            self._thread.start()
        _live.add(self)

    def _spawn(self, index: int) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        # The shared-memory directory is passed explicitly: a forkserver started earlier would
        # otherwise hand its own, older environment to the worker.
        proc = self._ctx.Process(target=run_worker, args=(child, self._slots, self._hint, shm_dir(), self._max_rings),
                                 name=f"tsl-loader-worker-{index}", daemon=True)
        proc.start()
        child.close()
        return _Worker(index, proc, parent)

    def _wakeup(self) -> None:
        with self._lock:
            if self._wake is not None:
                try:
                    os.write(self._wake[1], b"\0")
                except OSError:
                    pass  # the pipe is full: the thread is awake anyway

    def _dispatch_locked(self) -> None:
        while self._pending:
            worker = min(self._workers, key=lambda w: len(w.inflight), default=None)
            if worker is None or len(worker.inflight) >= self._max_inflight:
                for req in self._pending:
                    req.waited = True
                return
            req = self._pending.popleft()
            if not req.future.running() and not req.future.set_running_or_notify_cancel():
                self._on_finish(req.storage)
                continue
            if req.waited:
                self._counts["queued"] += 1
                self._counts["queue_wait_ns"] += int((time.monotonic() - req.enqueued) * 1e9)
            key = id(req)
            worker.inflight[key] = req
            try:
                worker.conn.send((key, req.storage))
            except (BrokenPipeError, OSError):
                pass  # the receiving thread sees the death and retries this request

    def _run(self, stop: threading.Event, wake: tuple[int, int]) -> None:
        try:
            self._loop(stop, wake[0])
        finally:
            with self._lock:
                if self._wake is wake:
                    self._wake = None
            for fd in wake:
                os.close(fd)

    def _loop(self, stop: threading.Event, wake_r: int) -> None:
        # One selector for the thread's life, re-registered only when the set of workers changes.
        with selectors.DefaultSelector() as selector:
            selector.register(wake_r, selectors.EVENT_READ, None)
            registered: dict[_Worker, tuple[int, int]] = {}
            while True:
                while True:  # samples loaded in-process (the first meet)
                    with self._lock:
                        if not self._ready:
                            break
                        req, obj = self._ready.popleft()
                    self._count_delivery(None, obj)
                    self._finish(req, result=obj)
                    del obj
                with self._lock:
                    if stop.is_set():
                        return
                    self._dispatch_locked()
                    workers = list(self._workers)
                if workers != list(registered):
                    for fds in registered.values():
                        for fd in fds:
                            selector.unregister(fd)
                    registered = {}
                    for w in workers:  # by descriptor number: a closed Connection has no fileno()
                        registered[w] = (w.conn.fileno(), w.proc.sentinel)
                        selector.register(registered[w][0], selectors.EVENT_READ, (w, True))
                        selector.register(registered[w][1], selectors.EVENT_READ, (w, False))
                for key, _ in selector.select():
                    if key.data is None:
                        try:
                            os.read(wake_r, 4096)
                        except BlockingIOError:
                            pass
                        continue
                    worker, is_conn = key.data
                    if worker not in registered:
                        continue
                    if is_conn and self._receive(worker):
                        continue
                    for fd in registered.pop(worker):
                        selector.unregister(fd)
                    self._on_death(worker)

    def _receive(self, worker: _Worker) -> bool:
        """Handle one reply; False when the worker's pipe is closed."""
        try:
            key, info, payload = worker.conn.recv()
        except (EOFError, OSError):
            return False
        with self._lock:
            req = worker.inflight.get(key)
        obj, error = None, None
        if info is None:
            error = unpack_exception(*payload)
        else:
            try:
                # Maps the slot (its descriptor may come from the worker, which must still be
                # running: the request stays in flight, so shutdown waits, until this is done).
                obj = ForkingPickler.loads(payload)
            except BaseException as exc:  # noqa: BLE001
                error = exc
        with self._lock:
            worker.inflight.pop(key, None)
        if req is None:  # cancelled by shutdown(timeout); dropping obj frees its slot
            return True
        if error is not None:
            self._finish(req, error=error)
        else:
            self._count_delivery(info, obj)
            self._finish(req, result=obj)
        return True

    def _count_delivery(self, info, obj) -> None:
        with self._lock:
            c = self._counts
            c["loads"] += 1
            if info is not None:
                c["bytes"] += info.nbytes
                c["slot_loads" if info.via == "slot" else "fallbacks"] += 1
                c["regrows"] += info.regrew

    def _on_death(self, worker: _Worker) -> None:
        with self._lock:
            if worker not in self._workers:
                return
        try:
            while worker.conn.poll() and self._receive(worker):
                pass
        except OSError:
            pass
        worker.proc.join(timeout=5)
        code = worker.proc.exitcode
        retire_rings(worker.proc.pid)
        worker.conn.close()
        failed: list[_Request] = []
        with self._lock:
            if worker not in self._workers:
                return
            self._workers.remove(worker)
            for req in worker.inflight.values():
                if req.attempts == 0:
                    req.attempts += 1
                    self._counts["retries"] += 1
                    self._pending.appendleft(req)
                else:
                    failed.append(req)
            worker.inflight = {}
            if not self._stop.is_set():
                self._workers.append(self._spawn(worker.index))
                self._counts["worker_restarts"] += 1
        logger.warning("loader worker %s (pid %s) died with exit code %s; restarted it and retrying "
                       "its loads once", worker.index, worker.proc.pid, code)
        for req in failed:
            self._finish(req, error=WorkerDiedError(
                f"loader worker died (exit code {code}) twice while loading {req.storage!r}; "
                "the sample may crash the reader, or the machine is out of memory",
                storage=req.storage, exitcode=code))

    def _finish(self, req: _Request, *, result: Any = None, error: BaseException | None = None) -> None:
        if error is not None:
            logger.warning("loading %r failed: %s", req.storage, error)
            with self._lock:
                self._counts["errors"] += 1
            if not req.future.done():
                req.future.set_exception(error)
        else:
            if req.callback is not None:
                try:
                    req.callback(result)
                except Exception:
                    logger.exception("callback %r raised while handling %r; the loader goes on",
                                     req.callback, req.storage)
            if not req.future.done():
                req.future.set_result(result if req.callback is None else None)
        self._on_finish(req.storage)
        with self._cond:
            self._cond.notify_all()

    def _stop_workers_and_thread(self, on_receiver: bool) -> None:
        with self._lock:
            workers, self._workers = self._workers, []
        for w in workers:
            try:
                w.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        self._wakeup()
        if self._thread is not None and not on_receiver:
            self._thread.join()
        for w in workers:
            w.proc.join(timeout=5)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join()
            w.conn.close()
            retire_rings(w.proc.pid)
            w.proc.close()
