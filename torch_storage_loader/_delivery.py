"""At-least-once delivery for streaming sources under DataLoader workers.

A handle taken by a worker counts as delivered only once the trainer's DataLoader iterator hands
its sample to the trainer's code. Each worker writes what it takes to a pipe of its own (before
loading, so that a worker killed mid-load loses nothing) tagged with its incarnation (persistent
workers restart their iterator each epoch) and the index of the DataLoader item it will belong to.
In the trainer, the iterator's ``_process_data`` (the one place every item passes on its way to
the caller, after unpickling, pinning and reordering) acknowledges what the worker took for the
items it yielded: each worker's items reach the caller in the order the worker made them, so a
count per worker says which. A loader whose ``confirm_delivery`` is true (Lightning's, which
fetches a batch ahead of the one it trains on) acknowledges only when told ``consumed()``, in
the order items were yielded. Whatever is left when the iterator stops (a ``break``, an
exception, workers killed, the next epoch of persistent workers) goes back to the source.

The hooks wrap four methods of torch's ``_MultiProcessingDataLoaderIter`` (and of torchdata's
``StatefulDataLoader`` iterator, which has the same protocol) and act only for iterators over a
streaming ``StorageDataset``; other iterators are untouched. Under an iterator class without the
hooks, a StorageDataset's workers acknowledge handles as they load them.
"""

from __future__ import annotations

import collections
import fcntl
import functools
import logging
import multiprocessing as mp
import secrets
from typing import Any

logger = logging.getLogger("torch_storage_loader")

PIPE_BYTES = 1 << 20  # room for what workers take between two items (Linux's default max for a pipe)

TAKE, DROP = "take", "drop"


class Ledger:
    """Trainer side: what each worker took, until it is acknowledged or given back."""

    def __init__(self, source: Any, num_workers: int, ctx: Any, *, confirm: bool = False) -> None:
        self.source = source
        self.confirm = confirm  # acknowledge on consumed(), not as the iterator yields
        self._unconfirmed: collections.deque = collections.deque()  # (worker, incarnation, item) yielded
        self.id = secrets.token_hex(8)
        pipes = [ctx.Pipe(duplex=False) for _ in range(num_workers)]
        self._readers: list[Any] = [r for r, _ in pipes]
        self.writers: list[Any] = [w for _, w in pipes]
        for w in self.writers:
            try:
                fcntl.fcntl(w.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
            except OSError:  # a lower pipe-max-size: the default 64 KiB still works for small batches
                pass
        self._taken: dict[tuple[int, int, int], list] = {}  # (worker, incarnation, item) -> tokens
        self._yielded = [0] * num_workers
        self._incarnation = 0
        self._closed = False

    def started(self) -> None:
        """The workers have their write ends: drop ours, so a reader sees EOF once they are gone."""
        for w in self.writers:
            w.close()

    def _drain(self) -> None:
        for i, reader in enumerate(self._readers):
            if reader is None:
                continue
            try:
                while reader.poll():
                    kind, inc, item, tokens = reader.recv()
                    entry = self._taken.setdefault((i, inc, item), [])
                    if kind == TAKE:
                        entry.extend(tokens)
                    else:
                        for t in tokens:
                            entry.remove(t)
            except (EOFError, OSError):
                reader.close()
                self._readers[i] = None

    def delivered(self, worker: int) -> None:
        """The iterator is handing worker ``worker``'s next item to the trainer."""
        self._drain()
        self._yielded[worker] += 1
        if self.confirm:
            self._unconfirmed.append((worker, self._incarnation, self._yielded[worker] - 1))
            return
        done = [k for k in self._taken if k[0] == worker and k[1] == self._incarnation and k[2] < self._yielded[worker]]
        self._ack(done)

    def consumed(self) -> None:
        """With ``confirm``: the trainer used the oldest item yielded and not yet confirmed."""
        if self._unconfirmed:
            self._drain()
            self._ack([self._unconfirmed.popleft()])

    def _ack(self, keys: list) -> None:
        tokens = [t for k in keys for t in self._taken.pop(k, ())]
        if tokens:
            self.source.ack(tokens)

    def next_incarnation(self) -> None:
        """Persistent workers restarted their iterators: what the last epoch left goes back."""
        self._drain()
        self._incarnation += 1
        self._yielded = [0] * len(self._yielded)
        self._unconfirmed.clear()
        self._give_back([k for k in self._taken if k[1] < self._incarnation])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._drain()
            self._give_back(list(self._taken))
        finally:
            for r in self._readers:
                if r is not None:
                    r.close()
            self._readers = [None] * len(self._readers)

    def _give_back(self, keys: list) -> None:
        tokens = [t for k in keys for t in self._taken.pop(k)]
        if tokens:
            self.source.give_back(tokens)


class LedgerWriter:
    """Worker side: one worker's pipe, and the incarnation it is in."""

    def __init__(self, ledger_id: str, conn: Any) -> None:
        self.ledger_id, self._conn, self.incarnation = ledger_id, conn, -1

    def restart(self) -> None:
        self.incarnation += 1

    def took(self, item: int, tokens: list) -> None:
        self._conn.send((TAKE, self.incarnation, item, tokens))

    def dropped(self, item: int, tokens: list) -> None:
        self._conn.send((DROP, self.incarnation, item, tokens))


def _open(loader: Any) -> Ledger | None:
    from .dataset import StorageDataset

    ds = loader.dataset
    if not isinstance(ds, StorageDataset) or ds.source.finite or loader.num_workers < 1:
        return None
    ctx = loader.multiprocessing_context or mp.get_context()
    ctx = mp.get_context(ctx) if isinstance(ctx, str) else ctx
    ledger = Ledger(ds.source, loader.num_workers, ctx, confirm=bool(getattr(loader, "confirm_delivery", False)))
    ds._ledger = (ledger.id, ledger.writers)
    return ledger


def install() -> None:
    """Wrap torch's multiprocessing DataLoader iterator, and torchdata's if it is imported (idempotent)."""
    import sys

    from torch.utils.data import dataloader

    _hook(dataloader._MultiProcessingDataLoaderIter)
    stateful = sys.modules.get("torchdata.stateful_dataloader.stateful_dataloader")
    if stateful is not None:
        _hook(stateful._StatefulMultiProcessingDataLoaderIter)


def _hook(cls: type) -> None:
    if cls.__dict__.get("_tsl_delivery", False):
        return
    needed = ("__init__", "_reset", "_process_data", "_shutdown_workers")
    if not all(callable(getattr(cls, n, None)) for n in needed):
        logger.warning("%s lacks %s: streaming StorageDatasets acknowledge handles when loaded, not when "
                       "the trainer gets them", cls.__name__, needed)
        return
    init, reset, process, shutdown = (getattr(cls, n) for n in needed)

    @functools.wraps(init)
    def __init__(self, loader, *args, **kwargs):
        self._tsl_ledger = None
        ledger = _open(loader)
        try:
            init(self, loader, *args, **kwargs)
        except BaseException:
            if ledger is not None:
                ledger.close()
            raise
        finally:
            if ledger is not None:
                loader.dataset._ledger = None
                ledger.started()
        self._tsl_ledger = ledger

    @functools.wraps(reset)
    def _reset(self, loader, first_iter=False, *args, **kwargs):
        reset(self, loader, first_iter, *args, **kwargs)
        ledger = getattr(self, "_tsl_ledger", None)
        if ledger is not None and not first_iter:
            ledger.next_incarnation()

    @functools.wraps(process)
    def _process_data(self, data, worker_idx, *args, **kwargs):
        ledger = getattr(self, "_tsl_ledger", None)
        if ledger is not None:
            ledger.delivered(worker_idx)
        return process(self, data, worker_idx, *args, **kwargs)

    @functools.wraps(shutdown)
    def _shutdown_workers(self):
        try:
            shutdown(self)
        finally:
            ledger = getattr(self, "_tsl_ledger", None)
            if ledger is not None:
                self._tsl_ledger = None
                ledger.close()

    cls.__init__, cls._reset, cls._process_data, cls._shutdown_workers = (
        __init__, _reset, _process_data, _shutdown_workers)
    cls._tsl_delivery = True
