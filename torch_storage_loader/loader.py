"""``StorageLoader``: save synchronously, load asynchronously in worker processes.

Names and defaults follow DI-engine's ``ding.data.storage_loader``, so switching is an import change.
Unlike it, data handed to a callback is never overwritten later: each sample lives in a
shared-memory slot that stays leased until the last array or tensor viewing it is dropped (keep
what you got as long as you like; the worker uses another slot, or a slower path when none is free).

This module is dispatch: requests, futures, callbacks, retries and stats. The worker processes
themselves are ``_workers``' (``pool`` starts, watches and replaces them; ``protocol`` is what they
say; ``worker`` is the loop each runs).

Size: about 650 lines (390 of code, 150 of docstrings), because ``StorageLoader`` is the DI-engine API and its dispatch
(one receiving thread owning requests, futures, callbacks, retries after a worker died, and the
counts of all of them): split, each part would reach into the other's state under its lock.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import importlib
import itertools
import logging
import multiprocessing as mp
import os
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any

from ._ding_storage import foreign_storage
from ._options import check_option
from ._proc import after_fork_in_child, signal_safe_condition
from ._shm.alloc import FillInfo, check_slot_options
from ._shm.filling import LocalFiller, is_plain_file
from ._shm.segments import default_shm_budget, free_shm_bytes, shm_dir
from ._workers.pool import (
    MAIN_GUARD_FIX,
    UNGUARDED_MAIN_EXIT,
    WorkerConfig,
    WorkerPool,
    preload_torch_in_forkserver,
    refuse_start_while_bootstrapping,
)
from ._workers.protocol import Failed, Loaded, WorkerLost
from .errors import LoadCancelledError, StorageError, WorkerDiedError
from .storage import Storage

__all__ = ["LoaderStats", "StorageLoader"]

logger = logging.getLogger("torch_storage_loader")


@dataclasses.dataclass(frozen=True)
class LoaderStats(Mapping[str, Any]):
    """A snapshot of what a loader did since it was created.

    Read it by attribute (``stats.loads``) or, like every ``stats()`` of this library
    (``StorageDataset.stats()``, ``RedisStorageQueue.stats()``), as a mapping of counts by name
    (``stats["loads"]``, ``dict(stats)``).

    Attributes:
        loads: Samples delivered.
        bytes: Array bytes delivered.
        errors: Loads that failed.
        slot_loads: Samples delivered through a shared-memory slot.
        local_loads: Samples read on the loader's receiving thread into private memory, because no
            worker was ready yet (the first loads of a fresh loader, while its workers start).
        fallbacks: Samples delivered in a segment of their own because every slot of every ring was
            still leased.
        oversize: Outliers too large for the slots, delivered in a segment of their own.
        copies: Samples copied out of shared memory on delivery (the consumer kept every slot).
        regrows: Times a worker added a ring (its slots all leased) or replaced its rings by larger ones.
        retries: Loads retried after their worker died.
        worker_restarts: Workers started again after one died.
        queued: Loads that waited because every worker was busy or still starting.
        queue_wait_s: The total time, in seconds, they waited.
        pending: Loads not yet delivered.
        expired: Files deleted by the TTL cleaner (``FileStorageLoader``).
        expired_unloaded: Of those, this loader's own files nobody loaded (see ``FileStorageLoader``).
    """

    loads: int = 0
    bytes: int = 0
    errors: int = 0
    slot_loads: int = 0
    local_loads: int = 0
    fallbacks: int = 0
    oversize: int = 0
    copies: int = 0
    regrows: int = 0
    retries: int = 0
    worker_restarts: int = 0
    queued: int = 0
    queue_wait_s: float = 0.0
    pending: int = 0
    expired: int = 0
    expired_unloaded: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The counts as a plain dict (``dict(stats)`` gives the same).

        Returns:
            Each count by its name.
        """
        return dataclasses.asdict(self)

    def __getitem__(self, name: str) -> Any:
        if name not in _STAT_FIELDS:
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(_STAT_FIELDS)

    def __len__(self) -> int:
        return len(_STAT_FIELDS)


_STAT_FIELDS = tuple(f.name for f in dataclasses.fields(LoaderStats))


class _Request:
    __slots__ = ("attempts", "callback", "enqueued", "future", "storage", "waited")

    def __init__(self, storage: Storage, callback: Callable[[Any], None] | None) -> None:
        self.storage = storage
        self.future: Future[Any] = Future()
        self.callback = callback
        self.attempts = 0
        self.enqueued = time.monotonic()
        self.waited = False


class _WorkersCannotStart(Exception):
    """Raised on the receiving thread when workers keep exiting before they are up."""

    def __init__(self, event: WorkerLost) -> None:
        super().__init__(event)
        self.event = event

    def error_for(self, storage: Storage) -> WorkerDiedError:
        code = self.event.exitcode
        if code == UNGUARDED_MAIN_EXIT:
            why = (
                "they import this script again (spawn and forkserver do) and its top-level code starts loaders: "
                f"{MAIN_GUARD_FIX}"
            )
        else:
            why = f"their error output says why (under spawn or forkserver, {MAIN_GUARD_FIX})"
        return WorkerDiedError(
            f"loader workers exit with code {code} as they start, so {storage!r} was not loaded; {why}",
            storage=storage,
            exitcode=code,
        )


_loaders: weakref.WeakSet[StorageLoader] = weakref.WeakSet()  # every loader of this process, for the fork hook
_live: weakref.WeakSet[StorageLoader] = weakref.WeakSet()  # loaders with workers, for the atexit hook

# multiprocessing terminates daemon children from its own atexit hook, registered when
# multiprocessing.util is first imported. Import it first, so that (atexit being LIFO) loaders
# shut their workers down cleanly before that hook runs.
importlib.import_module("multiprocessing.util")


@atexit.register
def _shutdown_live_loaders() -> None:
    for loader in list(_live):
        if loader._pid == os.getpid():
            loader.shutdown(timeout=5)


@after_fork_in_child
def _forget_parent_loaders() -> None:
    for loader in list(_loaders):
        loader._forget_parent()
    _live.clear()


def default_context() -> mp.context.BaseContext:
    """``forkserver`` where available (Python 3.14's default on Linux), else ``spawn``."""
    methods = mp.get_all_start_methods()
    return mp.get_context("forkserver" if "forkserver" in methods else "spawn")


preload_torch_in_forkserver()  # before anything in this process starts the forkserver


# Size: about 290 lines; the dispatch state (requests, futures, retries, counts) is one lock's, see the module.
class StorageLoader(ABC):
    """Loads ``Storage`` handles in ``worker_num`` processes and calls back with the samples.

    ``load`` never blocks: the first one starts the workers in the background. Until one of them is
    ready (seconds under forkserver or spawn, whose workers import the main script's imports), the
    receiving thread reads ``FileStorage`` files itself, so the first samples arrive as fast as a
    plain ``handle.load()``; other handles wait for a worker.
    Each worker sizes its ring of ``slots_per_worker`` shared-memory slots from the first sample it
    loads; a worker whose slots are all still held by the consumer adds rings, up to
    ``max_rings_per_worker``, then gives each further sample a segment of its own (a fallback).
    The workers together hold at most ``max_shm_bytes`` of shared memory (default: half the shm
    filesystem). Callbacks run on the receiving thread, one at a time, in completion order.

    Subclasses implement ``save`` (``FileStorageLoader`` is the one this library ships). Use a
    loader as a context manager, or call ``shutdown``, to stop its workers.

    Args:
        worker_num: How many worker processes load samples.
        slots_per_worker: Shared-memory slots in each worker's ring.
        max_rings_per_worker: How many rings a worker may add when its slots are all still held.
        max_inflight_per_worker: Loads sent to one worker before it answers; more wait in the loader.
        max_shm_bytes: Shared memory for all workers together; None: half the shm filesystem.
        mp_context: The multiprocessing start method (a name or a context) for the workers; None:
            ``forkserver`` where available, else ``spawn``.

    Raises:
        TypeError: An option has the wrong type (the message names it and the type expected).
        ValueError: An option is out of range (``worker_num`` and the per-worker counts must be >= 1).
    """

    def __init__(
        self,
        worker_num: int = 3,
        *,
        slots_per_worker: int = 4,
        max_rings_per_worker: int = 8,
        max_inflight_per_worker: int = 4,
        max_shm_bytes: int | None = None,
        mp_context: str | mp.context.BaseContext | None = None,
    ) -> None:
        check_option("worker_num", worker_num, int, least=1)
        check_slot_options(
            slots_per_worker=slots_per_worker, max_rings_per_worker=max_rings_per_worker, max_shm_bytes=max_shm_bytes
        )
        check_option("max_inflight_per_worker", max_inflight_per_worker, int, least=1)
        self._worker_num = worker_num
        self._slots = slots_per_worker
        self._max_rings = max_rings_per_worker
        self._max_inflight = max_inflight_per_worker
        self._max_shm_bytes = max_shm_bytes
        if isinstance(mp_context, str):
            mp_context = mp.get_context(mp_context)
        self._ctx = mp_context or default_context()
        self._init_runtime()
        _loaders.add(self)

    def _init_runtime(self) -> None:
        self._pid = os.getpid()
        self._lock, self._cond = signal_safe_condition()  # entered as ``with self._lock``
        self._counts: collections.Counter[str] = collections.Counter()
        self._ids = itertools.count()
        # Workers that exit with UNGUARDED_MAIN_EXIT as they start would do so in every session:
        # later loads fail at once with the same error, never starting (and re-running the script in) more.
        self._cannot_start: _WorkersCannotStart | None = None
        self._reset_state()

    def _reset_state(self) -> None:
        self._pool: WorkerPool | None = None
        self._pending: collections.deque[_Request] = collections.deque()
        self._inflight: dict[int, _Request] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._started = False
        self._local: LocalFiller | None = None  # reads files on the receiving thread until a worker is ready
        self._budget = 0  # one worker's share of max_shm_bytes, set as the workers start
        self._closing = False

    # ----------------------------------------------------------------------------- public API
    @abstractmethod
    def save(self, obj: Any) -> Storage:
        """Store ``obj`` synchronously and return a small, picklable handle to it.

        Args:
            obj: The sample: tensors, arrays and plain values, nested in dicts, lists and tuples.

        Returns:
            A handle to pass to ``load``, possibly in another process.
        """

    def to_storage(self, obj: Any) -> Storage:
        """DI-engine's older name for ``save``.

        Args:
            obj: The sample, as for ``save``.

        Returns:
            A handle, as ``save`` returns.
        """
        return self.save(obj)

    def start(self, *, timeout: float | None = 120) -> None:
        """Start the workers now and wait until every one is ready (``load`` starts them otherwise,
        and reads files on its receiving thread meanwhile). DI-engine's ``start_link``, waiting.

        Args:
            timeout: Seconds to wait for the workers; None waits as long as they take.

        Raises:
            TimeoutError: The workers were not all ready within ``timeout``.
            WorkerDiedError: The workers exit as they start (their error output says why).
            RuntimeError: The loader is shutting down.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            if self._closing:
                raise RuntimeError("this loader is shutting down; start it once shutdown() returned")
            if not self._started:
                refuse_start_while_bootstrapping()
                self._start_locked()
            pool = self._pool
        while True:
            with self._lock:
                if self._pool is not pool:
                    raise WorkerDiedError(
                        "loader workers exit as they start; their error output says why (under spawn or "
                        "forkserver, a script that starts loaders needs `if __name__ == '__main__':`)"
                    )
            assert pool is not None  # started above
            if pool.all_ready():
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the loader's {self._worker_num} workers were not all ready after {timeout} s")
            time.sleep(0.01)

    def load(self, storage: Storage, callback: Callable[[Any], None]) -> Future[None]:
        """Load ``storage`` in a worker, then call ``callback(obj)`` on the receiving thread.

        Returns at once. The returned ``Future`` resolves to ``None`` once the callback has run
        (it does not hold the sample, so keeping futures around keeps no slot leased), or to the
        error: a failure is logged and set on it, and the callback is not called then. A callback
        that raises is logged; the loader keeps serving.

        Args:
            storage: The handle to load.
            callback: Called with the sample once loaded, on the loader's receiving thread.

        Returns:
            A future that resolves to None once the callback has run, or to the load's error.
        """
        return self._submit(storage, callback)

    def load_async(self, storage: Storage) -> Future[Any]:
        """Load ``storage`` in a worker; the ``Future`` gets the sample or the error.

        Args:
            storage: The handle to load.

        Returns:
            A future of the sample; its ``result()`` raises the load's error, if any.
        """
        return self._submit(storage, None)

    def stats(self) -> LoaderStats:
        """What this loader did so far: loads, bytes, slot use, errors, retries.

        Returns:
            A snapshot of the counts (``LoaderStats``).
        """
        with self._lock:
            c = dict(self._counts)
            c["pending"] = self._outstanding_locked()
        queue_wait_s = c.pop("queue_wait_ns", 0) / 1e9
        return LoaderStats(**c, queue_wait_s=queue_wait_s)

    def shutdown(self, timeout: float | None = None) -> None:
        """Deliver what is pending (at most ``timeout`` seconds), then stop workers and threads.

        Loads still pending after ``timeout`` fail with ``LoadCancelledError``. All shared memory is
        released; the loader can be used again afterwards.

        Args:
            timeout: Seconds to wait for pending loads; None waits for all of them.
        """
        on_receiver = threading.current_thread() is self._thread
        with self._lock:
            if not self._started or self._closing:
                return
            self._closing = True
            pool = self._pool
        try:
            # A load queued by a load() that Ctrl-C interrupted before it woke the receiving thread
            # would wait, with the workers idle, for a wake that never comes: wake it (nothing is
            # queued from now on).
            if pool is not None:
                pool.wake()
            with self._lock:
                deadline = None if timeout is None else time.monotonic() + timeout
                while self._outstanding_locked() and not on_receiver:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    self._cond.wait(left)
        finally:
            leftovers = self._stop_session(on_receiver)
            for req in leftovers:
                self._finish(
                    req,
                    error=LoadCancelledError(
                        f"shutdown(timeout={timeout}) gave up on loading {req.storage!r}; "
                        "call shutdown() without a timeout to wait for every pending load",
                        storage=req.storage,
                    ),
                )

    def __enter__(self) -> StorageLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # ---------------------------------------------------------------------- hooks for subclasses
    def _on_submit(self, storage: Storage) -> None:  # noqa: B027 -- an optional hook: a no-op unless a subclass needs it
        """Called before a load is queued (FileStorageLoader pins the file against its TTL)."""

    def _on_finish(self, storage: Storage) -> None:  # noqa: B027 -- an optional hook
        """Called once a load is delivered or has failed."""

    def _after_fork_in_child(self) -> None:  # noqa: B027 -- an optional hook
        """Called in a forked child once the loader forgot the parent's workers, threads and loads."""

    # ------------------------------------------------------------------------- for tests, debugging
    @property
    def _workers(self) -> list[Any]:
        pool = self._pool
        return list(pool.workers) if pool is not None else []

    # -------------------------------------------------------------------------------- internals
    def _outstanding_locked(self) -> int:
        return len(self._pending) + len(self._inflight)

    def _submit(self, handle: object, callback: Callable[[Any], None] | None) -> Future[Any]:
        # DI-engine's own handles (a fleet switching): loaded with allow_pickle=True, else refused.
        storage = (
            handle
            if isinstance(handle, Storage)
            else foreign_storage(handle, allow_pickle=getattr(self, "allow_pickle", False))
        )
        if not self._started:
            refuse_start_while_bootstrapping()  # before anything is queued: this process exits or raises
        req = _Request(storage, callback)
        self._on_submit(storage)
        if self._cannot_start is not None:
            self._finish(req, error=self._cannot_start.error_for(storage))
            return req.future
        with self._lock:
            if self._closing:
                self._on_finish(storage)
                raise RuntimeError("this loader is shutting down; load again once shutdown() returned")
            self._pending.append(req)
            if not self._started:
                self._start_locked()
            pool = self._pool
        assert pool is not None  # started above
        pool.wake()
        return req.future

    def _start_locked(self) -> None:
        """Start the receiving thread; it starts the workers, so that no caller waits for them."""
        preload_torch_in_forkserver()
        total = self._max_shm_bytes or default_shm_budget()
        # The shared-memory directory is passed explicitly: a forkserver started earlier would
        # otherwise hand its own, older environment to the worker.
        config = WorkerConfig(self._slots, self._max_rings, max(1, total // self._worker_num), shm_dir())
        self._budget = config.budget
        self._pool = WorkerPool(self._ctx, self._worker_num, config)
        self._thread = threading.Thread(
            target=self._run, args=(self._pool, self._stop), name="tsl-loader-recv", daemon=True
        )
        self._started = True
        self._thread.start()
        _live.add(self)

    def _run(self, pool: WorkerPool, stop: threading.Event) -> None:
        try:
            # The first file before the workers start, as DI-engine's _first_meet: starting them (a
            # fork, or a fork and exec) would compete with it for the CPU and the GIL.
            self._load_here(pool)
            pool.start()
            while not stop.is_set():
                self._dispatch(pool)
                loaded_here = self._load_here(pool)
                events = collections.deque(pool.wait(0 if loaded_here else None))
                while events and not stop.is_set():
                    event = events.popleft()
                    if isinstance(event, WorkerLost):
                        self._on_worker_lost(event, pool)
                    else:
                        self._on_reply(event)
                    del event  # a sample dropped by its callback frees its slot before the next dispatch
        except BaseException as exc:
            if stop.is_set():
                return
            if not isinstance(exc, _WorkersCannotStart):
                logger.exception("the loader's receiving thread failed; failing its pending loads")
            elif exc.event.exitcode == UNGUARDED_MAIN_EXIT:
                self._cannot_start = exc
            with self._lock:
                mine = self._pool is pool
            if mine:
                for req in self._stop_session(on_receiver=True):
                    self._finish(req, error=exc.error_for(req.storage) if isinstance(exc, _WorkersCannotStart) else exc)

    def _dispatch(self, pool: WorkerPool) -> None:
        with self._lock:
            while self._pending:
                # A retry waits for an idle worker: queued behind other loads, it would be exposed
                # to another death for longer.
                worker = pool.least_busy(1 if self._pending[0].attempts else self._max_inflight)
                if worker is None:
                    for req in self._pending:
                        req.waited = True
                    break
                req = self._pending.popleft()
                if not req.future.running() and not req.future.set_running_or_notify_cancel():
                    self._on_finish(req.storage)  # cancelled while queued
                    continue
                if req.waited:
                    self._counts["queued"] += 1
                    self._counts["queue_wait_ns"] += int((time.monotonic() - req.enqueued) * 1e9)
                    req.waited = False
                key = next(self._ids)
                self._inflight[key] = req
                pool.send(worker, key, req.storage)

    def _load_here(self, pool: WorkerPool) -> bool:
        """While no worker is ready, read the first waiting file on this thread, as ``handle.load()``
        would (workers take seconds to start under forkserver or spawn); True if it did."""
        with self._lock:
            if not self._pending or pool.any_ready():
                return False
            req = self._pending[0]
            if req.attempts or not is_plain_file(req.storage):
                return False  # a retry, or a handle whose load() is its own: for a worker
        if not self._fits_the_workers(req.storage):
            return False  # a worker refuses it with the error that names the fix: not loaded here either
        with self._lock:
            if not self._pending or self._pending[0] is not req:
                return True  # cancelled by shutdown meanwhile: look again
            self._pending.popleft()
            if not req.future.set_running_or_notify_cancel():
                self._on_finish(req.storage)  # cancelled while queued
                return True
            key = next(self._ids)
            self._inflight[key] = req  # shutdown(timeout) sees it, and may give up on it
        if self._local is None:
            self._local = LocalFiller()
        try:
            info, payload = self._local.fill(req.storage)
        except Exception as exc:  # noqa: BLE001 - that load's error, as a worker would report it
            self._on_reply(Failed(key, exc))
        else:
            self._on_reply(Loaded(key, info, payload))
        return True

    def _fits_the_workers(self, storage: Storage) -> bool:
        """Whether the workers could load ``storage`` into their slots (its data within one worker's
        share of ``max_shm_bytes``, a ring of it within the free shared memory): what does not fit is
        left to them, so a first load fails as every later one would."""
        try:
            size: int = storage.read_header().data_size  # type: ignore[attr-defined]  # a plain FileStorage
        except StorageError:
            return True  # damaged or missing: read here, it fails with the error a worker would give
        return size <= self._budget and size * self._slots <= free_shm_bytes()

    def _on_reply(self, event: Loaded | Failed) -> None:
        with self._lock:
            req = self._inflight.pop(event.request_id, None)
        if req is None:
            return  # cancelled by shutdown(timeout); dropping the sample frees its slot
        if isinstance(event, Failed):
            self._finish(req, error=event.error)
            return
        self._count_delivery(event.info)
        self._finish(req, result=event.payload)

    def _count_delivery(self, info: FillInfo) -> None:
        with self._lock:
            info.count(self._counts)

    def _on_worker_lost(self, event: WorkerLost, pool: WorkerPool) -> None:
        if not event.restarted and not pool.workers and not pool.starting:
            raise _WorkersCannotStart(event)
        failed: list[_Request] = []
        with self._lock:
            self._counts["worker_restarts"] += event.restarted
            for key in reversed(event.request_ids):
                req = self._inflight.pop(key, None)
                if req is None:
                    continue
                if req.attempts == 0:
                    req.attempts += 1
                    self._counts["retries"] += 1
                    self._pending.appendleft(req)
                else:
                    failed.append(req)
        for req in reversed(failed):
            self._finish(
                req,
                error=WorkerDiedError(
                    f"loader worker {event.worker} (pid {event.pid}) died with exit code {event.exitcode} while "
                    f"loading {req.storage!r}, after that load's first worker had died too; the sample may crash "
                    "the reader, or the machine is out of memory",
                    storage=req.storage,
                    exitcode=event.exitcode,
                ),
            )

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
                    logger.exception(
                        "callback %r raised while handling %r; the loader goes on", req.callback, req.storage
                    )
            if not req.future.done():
                req.future.set_result(result if req.callback is None else None)
        self._on_finish(req.storage)
        with self._lock:
            self._cond.notify_all()

    def _stop_session(self, on_receiver: bool) -> list[_Request]:
        """Stop the workers and the receiving thread; return the loads they leave undelivered."""
        with self._lock:
            leftovers = list(self._inflight.values()) + list(self._pending)
            self._inflight.clear()
            self._pending.clear()
            pool, thread = self._pool, self._thread
            self._stop.set()
        if pool is not None:
            pool.wake()
            if thread is not None and not on_receiver:
                thread.join()
            pool.stop()
        with self._lock:
            self._reset_state()
        _live.discard(self)
        return leftovers

    def _forget_parent(self) -> None:
        """In a forked child: drop what belongs to the parent (workers, threads, loads); start afresh."""
        if self._pool is not None:
            self._pool.forget()
        if self._ctx.get_start_method() == "forkserver":
            # The stdlib's forkserver handle does not survive os.fork (it waitpid()s the parent's server).
            self._ctx = mp.get_context("spawn")
        self._init_runtime()
        self._after_fork_in_child()
