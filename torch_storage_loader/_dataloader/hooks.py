"""Every touch of private PyTorch (and torchdata) in one module, checked when installed.

What this library relies on, each checked by ``install()`` (or, for the GPU path's pin thread, by
``pin_thread_unavailable()``); a torch that differs raises ``UnsupportedTorchError`` naming the
piece and the torch releases known to have it: loudly, never a silent fallback.

- ``torch.utils.data.dataloader._MultiProcessingDataLoaderIter`` (and torchdata's
  ``_StatefulMultiProcessingDataLoaderIter``): ``__init__(self, loader, ...)``,
  ``_reset(self, loader, first_iter=False, ...)``, ``__next__(self)``,
  ``_process_data(self, data, worker_idx, ...)``
  (the worker's index is passed since torch's out-of-order support; before, ``(self, data)``) and
  ``_shutdown_workers(self)``, called by ``_next_data`` once the data ends. A subclass made for a
  ``StorageDataset``'s iterators overrides them for the delivery ledger (``ledger``) and ``device=``
  (``_device``); torch's classes keep their methods. The subclass of torch's sets ``_in_order``
  (``DataLoader(in_order=)``, read by ``_next_data`` since torch 2.6) to False for a streaming source.
- ``torch.utils.data.dataloader._BaseDataLoaderIter``, the base of every DataLoader iterator (and of
  torchdata's): it has no ``__new__`` of its own. ``install()`` gives it one, which chooses that
  subclass when the loader's dataset is a ``StorageDataset``, and for any other dataset makes torch's
  own class, as ``object.__new__`` did. A ``StorageDataset`` installs it when made or unpickled, never
  at import: importing the library changes nothing in torch, and installed, nothing for other DataLoaders.
- ``torch.utils.data.dataloader._BaseDataLoaderIter.__next__``: a ``record_function`` around
  ``_reset()`` (when ``_sampler_iter`` is None), ``_next_data()``, ``_num_yielded += 1`` and a warning
  past ``len()``. While no profiler records, the subclass runs that body without the annotation
  (``_unrecorded_next``), where the names torch's code reads are the ones it was read from; else torch's.
- ``torch._utils.ExceptionWrapper``: what a worker's failed item is.
- ``torch.utils.data._utils.fetch._BaseDatasetFetcher``: its ``fetch(self, possibly_batched_index)``
  frame is two to five frames above a dataset's first ``next()`` (``fetch_context``).
- ``torch.utils.data._utils.collate``: ``collate``, ``default_collate``, ``default_convert`` and
  ``default_collate_fn_map`` (the documented extension point of ``default_collate``).
- ``DataLoader._iterator``: the iterator a (persistent) DataLoader keeps (``loader_iterator``).
- The pin-memory thread: started when ``loader.pin_memory`` is true at the iterator's creation;
  ``torch.utils.data._utils.pin_memory.pin_memory`` hands back an object whose ``pin_memory()``
  returns itself.
- torch's SIGCHLD handler, which raises a dead worker's error wherever the trainer's thread is:
  ``torch.utils.data._utils.signal_handling._set_SIGCHLD_handler`` sets it once per process (torch
  calls it as each multi-process iterator starts); it is read back with ``signal.getsignal`` and
  told from another's by its ``__module__``. While a ``StorageDataset``'s iterator lives, it is
  wrapped (``_Deaths``) so that the error is raised only where that is safe.
- ``torch.cuda._sleep``: a kernel that spins (tests and benchmarks keep a stream busy with it).

Size: about 660 lines (330 of code), because every private torch touch lives here by rule
(``tests/test_architecture.py``), each beside its check: split, private torch would have two homes.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import dataloader as _torch_dataloader
from torch.utils.data._utils import collate as _collate
from torch.utils.data._utils import fetch as _fetch
from torch.utils.data._utils import signal_handling as _signal_handling

from .._proc import after_fork_in_child
from ..errors import PinThreadUnavailable, UnsupportedTorchError
from .interrupts import SAFE_WAITS, interrupts
from .ledger import Ledger, LedgerRef

__all__ = [
    "Tracked",
    "Undelivered",
    "collate",
    "default_collate",
    "fetch_context",
    "gpu_sleep",
    "install",
    "loader_iterator",
    "pin_thread_for",
    "pin_thread_unavailable",
    "shutdown_iterator",
]

logger = logging.getLogger("torch_storage_loader")

NEEDS = "torch >= 2.7.1 (the lowest release the suite passed on), with torchdata >= 0.8"

collate = _collate.collate
default_collate = _collate.default_collate
default_convert = _collate.default_convert


class Tracked(Protocol):
    """A dataset whose DataLoader iterators the hooks act for (``StorageDataset``): see ``_reads_storage``."""

    device: Any  # None, or where its batches go (finished on the trainer's thread as handed over)
    batch_size: int | None  # handles per item it yields (None: one)

    def _tsl_delivery_source(self) -> Any:
        """The streaming source whose handles the workers report to a ledger, or None (finite)."""

    def _tsl_attach_ledger(self, ref: LedgerRef | None) -> None:
        """Hand the ledger's pipes to the workers about to start (None once they have them)."""


# ------------------------------------------------------------------------------ checks
def _params(fn: Any) -> list[inspect.Parameter]:
    return list(inspect.signature(fn).parameters.values())


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _check(cls: type, name: str, want: str, ok: Callable[[list[inspect.Parameter]], bool]) -> Callable:
    fn = cls.__dict__.get(name) or getattr(cls, name, None)
    if not callable(fn):
        raise UnsupportedTorchError(
            f"torch {torch.__version__}: {cls.__module__}.{cls.__qualname__} has no {name}; "
            f"torch_storage_loader needs {NEEDS}"
        )
    try:
        good = ok(_params(fn))
    except (TypeError, ValueError):
        good = False
    if not good:
        raise UnsupportedTorchError(
            f"torch {torch.__version__}: {cls.__qualname__}.{name}{inspect.signature(fn)} is not {want}, which the "
            f"delivery hooks wrap; torch_storage_loader needs {NEEDS}: install one (pip install 'torch>=2.7.1')"
        )
    return fn


def check_iterator(cls: type) -> None:
    """Raise ``UnsupportedTorchError`` unless ``cls`` has the methods the hooks wrap, as they are wrapped."""

    def positional(names: int) -> Callable[[list[inspect.Parameter]], bool]:
        return lambda ps: len(ps) >= names and all(p.kind in _POSITIONAL for p in ps[:names])

    _check(cls, "__init__", "(self, loader, ...)", positional(2))
    _check(
        cls,
        "_reset",
        "(self, loader, first_iter=False, ...)",
        lambda ps: positional(3)(ps) and ps[2].name == "first_iter",
    )
    _check(cls, "_process_data", "(self, data, worker_idx, ...)", positional(3))
    _check(cls, "__next__", "(self)", lambda ps: len([p for p in ps if p.default is p.empty]) == 1)
    _check(cls, "_shutdown_workers", "(self)", lambda ps: len([p for p in ps if p.default is p.empty]) == 1)
    next_data = _check(cls, "_next_data", "(self)", positional(1))
    if "_shutdown_workers" not in getattr(next_data, "__code__", None).co_names:
        raise UnsupportedTorchError(
            f"torch {torch.__version__}: {cls.__qualname__}._next_data no longer calls "
            f"_shutdown_workers at the end of the data; torch_storage_loader needs {NEEDS}"
        )


def _check_fetcher() -> None:
    base = getattr(_fetch, "_BaseDatasetFetcher", None)
    fetchers = [getattr(_fetch, n, None) for n in ("_IterableDatasetFetcher", "_MapDatasetFetcher")]
    if base is None or any(f is None or not issubclass(f, base) for f in fetchers):
        raise UnsupportedTorchError(
            f"torch {torch.__version__}: torch.utils.data._utils.fetch lacks the dataset "
            f"fetchers; torch_storage_loader needs {NEEDS}"
        )
    for f in fetchers:
        _check(
            f,
            "fetch",
            "(self, possibly_batched_index)",
            lambda ps: len(ps) == 2 and ps[1].name == "possibly_batched_index",
        )
    if not isinstance(getattr(_collate, "default_collate_fn_map", None), dict):
        raise UnsupportedTorchError(
            f"torch {torch.__version__}: torch.utils.data._utils.collate has no "
            f"default_collate_fn_map; torch_storage_loader needs {NEEDS}"
        )


# ------------------------------------------------------------------------------ install
@functools.cache
def _iterator_classes() -> tuple[type, ...]:
    """torch's multi-process DataLoader iterator, and torchdata's where it is installed."""
    classes: tuple[type, ...] = (_torch_dataloader._MultiProcessingDataLoaderIter,)
    try:
        from torchdata.stateful_dataloader import stateful_dataloader
    except ImportError:  # torchdata is optional for the hooks: only its loader needs them
        return classes
    return (*classes, stateful_dataloader._StatefulMultiProcessingDataLoaderIter)


def install(item: type, collate_items: Callable[..., Any]) -> None:
    """Check what the hooks need, then let DataLoaders over a ``StorageDataset`` make iterators with them
    and ``default_collate`` batch ``item`` objects with ``collate_items`` (idempotent, cheap once done).

    torch's classes keep their methods: ``_BaseDataLoaderIter`` gains a ``__new__`` (``_new``) that, for
    any dataset but ours, makes torch's own class as ``object.__new__`` did.
    """
    base = _torch_dataloader._BaseDataLoaderIter
    if base.__dict__.get("__new__") is not _NEW:
        _check_fetcher()
        for cls in (base, *_iterator_classes()):
            if cls.__new__ is not object.__new__:
                raise UnsupportedTorchError(
                    f"torch {torch.__version__}: {cls.__module__}.{cls.__qualname__} has a __new__ of its own, "
                    f"where the hooks choose the iterator class; torch_storage_loader needs {NEEDS}"
                )
        for cls in _iterator_classes():
            _delivering(cls)  # checks what it overrides: a torch that differs is refused before any use
        base.__new__ = _NEW
    _collate.default_collate_fn_map[item] = collate_items  # checked a dict by _check_fetcher


def _reads_storage(loader: Any) -> bool:
    """Whether ``loader`` reads a ``Tracked`` dataset: looked up on the dataset's class, so that no
    other dataset's attributes (a ``__getattr__`` of its own) are touched."""
    return callable(getattr(type(loader.dataset), "_tsl_delivery_source", None))


def _new(cls: type, loader: Any = None, *args: Any, **kwargs: Any) -> Any:
    """``_BaseDataLoaderIter.__new__``: for a ``Tracked`` dataset, check the DataLoader's batching and
    make a multi-process iterator of ``_delivering(cls)``; for any other, ``cls`` itself, as torch does."""
    if loader is not None and _reads_storage(loader):
        _check_batching(loader)
        if issubclass(cls, _iterator_classes()):
            cls = _delivering(cls)
    return object.__new__(cls)


_NEW = staticmethod(_new)


def _check_batching(loader: Any) -> None:
    """Refuse a DataLoader that would stack a batching dataset's batches again (``[1, 8, ...]`` for its
    default ``batch_size=1``): an error, as the iterator is made, before any worker starts or any
    handle is taken, since broadcasting may hide the extra dimension from a model. A ``collate_fn``
    of the user's receives the dataset's batches as a list, deliberately."""
    per_item = loader.dataset.batch_size
    if per_item is None or loader.batch_size is None or loader.collate_fn is not default_collate:
        return
    raise ValueError(
        f"StorageDataset(batch_size={per_item}) yields batches already, and DataLoader(batch_size="
        f"{loader.batch_size}) would batch them again (into [{loader.batch_size}, {per_item}, ...]): "
        "pass DataLoader(..., batch_size=None), or leave the dataset's batch_size None to batch in the DataLoader"
    )


# Iterators with a ledger, for _shut_down_at_exit (registered after torch's own exit handlers, so it runs
# before them: torch still stops its workers then).
_live: weakref.WeakSet[Any] = weakref.WeakSet()


@atexit.register
def _shut_down_at_exit() -> None:
    """Settle each delivering iterator still alive at interpreter exit (a global, or one in a reference
    cycle). Later, torch no longer stops workers, modules are half gone and the ledger's daemon thread
    is frozen with whatever lock it held: what the workers took could not go back.

    Its workers are stopped as torch stops them, not killed: the ledger tells those that wait in a
    source to stop waiting (``stop_waits``), and a worker killed between reading a Redis entry and
    reporting it would leave that entry pending under a dead consumer until ``claim_after`` (a CI
    run: a trainer that trusted no root left one so). What they reported goes back; a fed worker's
    is the feeder's to give back."""
    for it in list(_live):
        if getattr(it, "_tsl_pid", None) != os.getpid():
            continue
        try:
            it._shutdown_workers()
        except Exception:  # one iterator's failure must not stop the others'
            logger.exception("could not shut a DataLoader iterator down at exit")


def _open(loader: Any) -> Ledger | None:
    ds: Tracked = loader.dataset
    source = ds._tsl_delivery_source()
    if source is None:
        return None
    ctx = loader.multiprocessing_context or mp.get_context()
    ctx = mp.get_context(ctx) if isinstance(ctx, str) else ctx
    # What one DataLoader item of dataset batches takes: what a fed worker is fed at a time.
    per_item = (loader.batch_size or 1) * (ds.batch_size or 1)
    ledger = Ledger(
        source,
        loader.num_workers,
        ctx,
        confirm=bool(getattr(loader, "confirm_delivery", False)),
        item=per_item,
        # Indices sent and not yet processed: torch's prefetch, and one per worker that ended.
        ahead=((loader.prefetch_factor or 2) + 1) * loader.num_workers,
    )
    ds._tsl_attach_ledger(ledger.ref())
    return ledger


def _receive_ahead(loader: Any, device: Any) -> Any:
    """Around the creation of an iterator for ``device=``: its results are received (and their copies
    issued) on the DataLoader's pin-memory thread, ahead of the trainer, where the accelerator has one."""
    from .._gpu import pinning as _pinning

    if device is None or not getattr(_pinning.accelerator(), "pin_thread", False):
        return contextlib.nullcontext()
    why = pin_thread_unavailable()
    if why is not None:  # correct still, but each copy is issued when the trainer asks for its batch
        if not _warned:
            _warned.append(why)
            logger.warning("device=: %s; batches are copied when the trainer asks for them, not ahead", why)
        return contextlib.nullcontext()
    return pin_thread_for(loader)


_warned: list = []


@functools.cache
def _delivering(cls: type) -> type:
    """``cls`` (a multi-process iterator class) with the delivery hooks: its subclass, made once."""
    check_iterator(cls)
    init, reset, process, shutdown = cls.__init__, cls._reset, cls._process_data, cls._shutdown_workers
    next_, unrecorded = cls.__next__, _unrecorded_next(cls)
    # Not torchdata's: out of order, its iterator takes no snapshots and warns at each state_dict().
    in_any_order = cls is _torch_dataloader._MultiProcessingDataLoaderIter
    profiling = torch._C._autograd._profiler_enabled

    @functools.wraps(init)
    def __init__(self, loader, *args, **kwargs):
        self._tsl_pid = getpid()
        self._tsl_device = device = loader.dataset.device
        self._tsl_ledger = ledger = _open(loader)
        _deaths.guard(self)
        interrupts.guard(self)
        try:
            with _receive_ahead(loader, device):
                init(self, loader, *args, **kwargs)
        except BaseException:
            interrupts.unguard(self)
            if ledger is not None:
                self._tsl_ledger = None
                ledger.close()
            raise
        finally:
            if ledger is not None:
                loader.dataset._tsl_attach_ledger(None)
                ledger.started()
        if ledger is not None:
            _live.add(self)
            if in_any_order:
                # A stream: items as they arrive. Which worker takes which handle is a race, and in
                # order one a worker made would wait behind the worker the trainer waits on, which
                # may be waiting on an idle stream (torch reads this per item; its first indices go
                # out alike).
                self._in_order = False

    @functools.wraps(reset)
    def _reset(self, loader, first_iter=False, *args, **kwargs):
        if not first_iter:
            _Deaths.raise_deferred(self)  # (persistent workers: one died between epochs)
        ledger = getattr(self, "_tsl_ledger", None)
        if ledger is not None and not first_iter:
            ledger.end_iteration()  # workers leave the last one, to take torch's message to start anew
        reset(self, loader, first_iter, *args, **kwargs)
        if ledger is not None and not first_iter:
            ledger.next_incarnation()

    @functools.wraps(process)
    def _process_data(self, data, worker_idx, *args, **kwargs):
        ledger = getattr(self, "_tsl_ledger", None)
        if ledger is not None:  # (a skipped item's handles fail: neither acknowledged nor loaded again)
            undelivered = type(data) is Undelivered
            failed = isinstance(data, ExceptionWrapper) or (undelivered and data.error is not None)
            ledger.delivered(worker_idx, ok=not failed, skipped=undelivered and data.error is None)
        out = process(self, data, worker_idx, *args, **kwargs)
        if type(out) is Undelivered:
            return out.settle()  # its error, raised here on the trainer's thread; or skipped (__next__ goes on)
        device = getattr(self, "_tsl_device", None)
        if device is not None:
            from .._gpu.device import arrive

            out = arrive(out, device)  # the trainer's stream waits for the copy issued ahead
        return out

    @functools.wraps(next_)
    def __next__(self):
        while True:
            try:
                _Deaths.raise_deferred(self)  # a worker's death noticed where raising was not safe
                interrupts.raise_held()  # a Ctrl-C held back since the last step
                if unrecorded and self._IterableDataset_len_called is None and not profiling():
                    out = unrecorded(self)
                else:
                    out = next_(self)
                interrupts.raise_held()  # before handed(): what was processed goes back
            except BaseException:
                ledger = getattr(self, "_tsl_ledger", None)
                if ledger is not None:
                    ledger.not_handed()  # processed, then the error: the trainer never got them
                raise
            ledger = getattr(self, "_tsl_ledger", None)
            if ledger is not None:
                ledger.handed()  # not before: until here, a dead worker's error may still be raised
            if type(out) is not Undelivered:  # (skipped under on_error="skip": the next item instead)
                return out  # (a Ctrl-C held back from handed() on lands just after this return)

    # Kept here: at interpreter exit, module globals are gone before __del__ runs.
    getframe, getpid, deaths, ctrl_c = sys._getframe, os.getpid, _deaths, interrupts

    @functools.wraps(shutdown)
    def _shutdown_workers(self):
        if self._tsl_pid != getpid():  # collected in a process forked from the trainer (a later DataLoader's
            return  # worker): the workers and the ledger are the trainer's, to stop and settle there only
        exhausted = getframe(1).f_code.co_name == "_next_data"  # the one call made at the end of the data
        ledger = getattr(self, "_tsl_ledger", None)
        try:
            if ledger is not None:
                ledger.stop_waits()  # workers stop waiting for handles, and exit when told to
            shutdown(self)
        finally:
            deaths.iterators.discard(self)  # not before: torch's shutdown puts to the workers' queues
            ledger = getattr(self, "_tsl_ledger", None)
            if ledger is not None:
                self._tsl_ledger = None
                ledger.close(exhausted)
            ctrl_c.unguard(self)

    # Steps where a Ctrl-C waits (see interrupts): taking an item, and starting or stopping the workers.
    interrupts.section(__next__, waits=True)
    interrupts.section(_reset, waits=False)
    interrupts.section(_shutdown_workers, waits=False)

    methods = {f.__name__: f for f in (__init__, _reset, _process_data, __next__, _shutdown_workers)}
    return type(f"Delivering{cls.__name__}", (cls,), {"__module__": __name__, **methods})


# The names torch's ``_BaseDataLoaderIter.__next__`` reads (torch 2.7 to 2.13), where its body is a
# ``record_function`` around ``_unrecorded``'s and a warning about ``len()``.
_NEXT_NAMES = frozenset(
    ("Iterable", "_DatasetKind", "_IterableDataset_len_called", "_dataset", "_dataset_kind", "_next_data")
    + ("_num_workers", "_num_yielded", "_profile_name", "_reset", "_sampler_iter", "autograd", "profiler")
    + ("record_function", "torch", "warn", "warnings")
)


class _Deaths:
    """torch's SIGCHLD handler, made to raise only where that is safe while our iterators live.

    torch raises a dead worker's error from its SIGCHLD handler wherever the trainer's thread is:
    inside ``multiprocessing.Queue.put`` between taking the queue's lock and the ``with`` that
    releases it (torch's shutdown then waits for ever on that lock), inside a ``weakref.finalize``
    (which then never frees its slot), inside the ledger between taking items off what is owed and
    settling them (a sample neither delivered nor given back: lost until the trainer exits). CI runs
    hit all three after a worker was SIGKILLed. So, while a ``StorageDataset``'s iterator lives,
    torch's handler runs at once (handlers it chains to included), but its error is raised there
    only where the trainer's thread waits in a selector (waiting for the next item, without a
    pin-memory thread); elsewhere it is kept on the iterator whose worker died and raised at its
    next ``__next__`` (or ``_reset``). A death among other DataLoaders' workers is left to torch's
    own check, which finds it when no item came for 5 s. With no such iterator, torch's handler
    runs as torch made it."""

    def __init__(self) -> None:
        self.iterators: weakref.WeakSet[Any] = weakref.WeakSet()
        self.torch_handler: Callable[[int, Any], Any] | None = None

    def guard(self, iterator: Any) -> None:
        """Wrap torch's SIGCHLD handler (set now if torch has not yet) for ``iterator``, before it
        starts its workers and queues their first indices."""
        if threading.current_thread() is not threading.main_thread():
            return  # torch sets no handler off the main thread, and signal.signal cannot
        _signal_handling._set_SIGCHLD_handler()  # once per process: torch's own call, made early
        current = signal.getsignal(signal.SIGCHLD)
        if current is not _on_sigchld:
            if getattr(current, "__module__", None) != _signal_handling.__name__:
                return  # another's handler, set after torch's: left as it is (it may chain to ours)
            self.torch_handler = current
            signal.signal(signal.SIGCHLD, _on_sigchld)
        self.iterators.add(iterator)

    def on_signal(self, signum: int, frame: Any, safe: frozenset = SAFE_WAITS) -> None:
        handler = self.torch_handler
        if handler is None:
            return
        if not self.iterators or (frame is not None and frame.f_code in safe):
            handler(signum, frame)
            return
        try:
            handler(signum, frame)
        except Exception as exc:  # noqa: BLE001 - a dead worker's error, kept for a safe place
            exc.__traceback__ = None  # (its frames are whatever the trainer was running)
            for it in list(self.iterators):
                if any(_exited(w.pid) for w in getattr(it, "_workers", ())):
                    it._tsl_death = exc

    @staticmethod
    def raise_deferred(iterator: Any) -> None:
        """On the trainer's thread, where raising is safe: the error ``on_signal`` kept for ``iterator``."""
        exc = iterator.__dict__.pop("_tsl_death", None)
        if exc is not None:
            raise exc


def _exited(pid: int | None) -> bool:
    """Whether child ``pid`` has exited (left unreaped, as torch's own check leaves it). Not a child
    of this process (forkserver's workers) or reaped already: False, left to torch's own check."""
    if pid is None:
        return False
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return False


_deaths = _Deaths()


def _on_sigchld(signum: int, frame: Any, deaths: _Deaths = _deaths) -> None:
    deaths.on_signal(signum, frame)  # (bound as a default: a signal may come as the interpreter exits)


@after_fork_in_child
def _no_deaths_in_child() -> None:
    _deaths.iterators = weakref.WeakSet()  # the parent's iterators are not the child's to guard


def _unrecorded_next(cls: type) -> Callable[[Any], Any] | None:
    """``cls.__next__`` without its ``record_function``, for when no profiler records; None (use
    torch's own) where ``cls`` has a ``__next__`` of its own (torchdata's) or torch's reads other names.

    The annotation costs the trainer's thread 8 us a batch, and 60 to 100 us when the trainer slept
    on a GPU step since the last (cold caches: benchmarks/bench_dataset.py --only gpu): a profiler
    that records as ``_profiler_enabled()`` sees it (``torch.profiler``, ``emit_nvtx``) still gets it,
    and so does a loader whose ``len()`` was asked (torch's own ``__next__`` warns past it). A trace
    attached from outside (on-demand Kineto through dynolog) or an ``ExecutionTraceObserver`` alone
    would miss the annotation (nothing else)."""
    base = _torch_dataloader._BaseDataLoaderIter.__next__
    if cls.__next__ is not base or frozenset(base.__code__.co_names) != _NEXT_NAMES:
        return None
    return _unrecorded


def _unrecorded(self: Any) -> Any:
    if self._sampler_iter is None:
        self._reset()
    data = self._next_data()
    self._num_yielded += 1
    return data


class Undelivered:
    """A worker's item that failed on its way into the trainer (``items.WorkerItem``): unpickled where
    torch unpickles it (under ``device=``, torch's pin-memory thread, where a raised error would end
    the thread), it carries the library's ``error`` to the trainer's thread, where the iterator raises
    it; None: skipped under ``on_error="skip"`` (logged and counted already), and the iterator goes on."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None) -> None:
        self.error = error

    def pin_memory(self, *args: Any, **kwargs: Any) -> Undelivered:
        return self  # the pin-memory thread hands it on as it is

    def settle(self) -> Undelivered:
        """On the trainer's thread: raise the error, or return self (skipped)."""
        error, self.error = self.error, None
        if error is not None:
            raise error
        return self


# ------------------------------------------------------------------------------ uses
def fetch_context() -> tuple[bool, int]:
    """(whether the DataLoader passes a dataset's items to a collate_fn of the user's, items per DataLoader item).

    Called from a dataset iterator's first step, which torch's dataset fetcher runs: its
    ``collate_fn`` is the DataLoader's. Ours (``default_collate`` with the entry ``install`` adds,
    or ``default_convert``) ship references; a user's function must see samples instead. With
    DataLoader-side batching the fetcher asks for as many items as its index list is long.
    """
    frame = sys._getframe(2)  # above our caller (a generator's first step): what runs it
    for _ in range(4):
        if frame is None:
            break
        fetcher = frame.f_locals.get("self")
        if isinstance(fetcher, _fetch._BaseDatasetFetcher):
            index = frame.f_locals.get("possibly_batched_index")
            per_item = len(index) if fetcher.auto_collation and hasattr(index, "__len__") else 1
            return fetcher.collate_fn not in (default_collate, default_convert), max(1, per_item)
        frame = frame.f_back
    return False, 1


def loader_iterator(loader: Any) -> Any:
    """The iterator a DataLoader keeps (persistent workers), or None."""
    return getattr(loader, "_iterator", None)


def shutdown_iterator(loader: Any) -> None:
    """Stop the workers of the iterator ``loader`` keeps, as Lightning does for DataLoader's own iterators."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    loader._iterator = None


class _PassThrough:
    def pin_memory(self, *args: Any, **kwargs: Any) -> _PassThrough:
        return self


@functools.cache
def pin_thread_unavailable() -> str | None:
    """Why ``pin_thread_for`` cannot be used with this torch (None: it can)."""
    try:
        from torch.utils.data._utils.pin_memory import _pin_memory_loop, pin_memory
    except ImportError as exc:
        return f"torch.utils.data lacks the pin-memory thread ({exc})"
    probe = _PassThrough()
    if pin_memory(probe) is not probe:
        return "torch's pin_memory() does not pass objects with a pin_memory method through"
    base = getattr(_torch_dataloader, "_BaseDataLoaderIter", None)
    if base is None or "pin_memory" not in getattr(base.__init__, "__code__", None).co_names:
        return "torch's DataLoader iterator no longer reads loader.pin_memory when it starts"
    del _pin_memory_loop
    return None


@contextlib.contextmanager
def pin_thread_for(loader: Any) -> Iterator[None]:
    """While a DataLoader iterator is created inside this block, it starts its pin-memory thread.

    That thread unpickles the workers' results as they arrive, off the trainer's thread and ahead
    of it: the GPU path issues each batch's copy there. ``loader.pin_memory`` is restored after.
    """
    why = pin_thread_unavailable()
    if why is not None:
        raise PinThreadUnavailable(why)
    before = loader.pin_memory
    loader.pin_memory = True
    try:
        yield
    finally:
        loader.pin_memory = before


def gpu_sleep(cycles: int) -> None:
    """Queue a kernel that spins ``cycles`` GPU cycles on the current stream (``torch.cuda._sleep``)."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        raise UnsupportedTorchError(f"torch {torch.__version__} has no torch.cuda._sleep")
    sleep(int(cycles))
