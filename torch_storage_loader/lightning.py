"""Lightning integration: ``StorageDataModule`` and ``StorageStatsCallback``.

Imported only when used (``from torch_storage_loader.lightning import StorageDataModule``), so the
core library does not import Lightning.
"""

from __future__ import annotations

import collections
import re
import time
import warnings
from typing import Any, Callable

import lightning.pytorch as pl
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from ._dataloader import hooks
from ._slots import retire_rings
from .dataset import StorageDataset

__all__ = ["StorageDataModule", "StorageStatsCallback"]

# Lightning (lightning.pytorch.utilities.data.has_len_all_ranks) warns on every fit that an
# IterableDataset with a length "could be inaccurate if each worker is not configured
# independently". A StorageDataset splits its handles across DataLoader workers and ranks itself
# and its length is exact per rank (padded or dropped evenly), so for our loaders that warning is
# a false alarm. It is ignored by exact message, category and emitting module, only between this
# data module's setup and teardown (when Lightning checks the loaders), see _quiet_len_warning.
_LEN_WARNING = re.escape("Your `IterableDataset` has `__len__` defined.")
_LEN_WARNING_MODULE = re.escape("lightning.pytorch.utilities.data") + r"\Z"


class _ConsumedStateLoader(StatefulDataLoader):
    """A ``StatefulDataLoader`` whose ``state_dict`` covers the batches the model consumed.

    Lightning fetches one batch ahead of the one it trains on; a plain loader's state would count
    that batch as used, and a run resumed from a mid-epoch checkpoint would skip it. For the same
    reason a streaming source's handles are acknowledged when their batch is consumed, not when
    it is fetched: the batch fetched ahead at ``max_steps`` goes back to the source.
    """

    def __init__(self, *args: Any, epoch_fn: Callable[[], int | None] | None = None,
                 confirm_delivery: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.confirm_delivery = confirm_delivery
        self._epoch_fn = epoch_fn
        self._yielded_states: collections.deque = collections.deque()
        self._consumed_state: dict | None = None

    def __iter__(self):
        epoch = self._epoch_fn() if self._epoch_fn is not None else None
        if epoch is not None:
            self.dataset.set_epoch(epoch)  # Lightning calls set_epoch on samplers only
        self._yielded_states.clear()
        self._consumed_state = None
        for batch in super().__iter__():
            self._yielded_states.append(super().state_dict())
            yield batch

    def mark_consumed(self) -> None:
        if self._yielded_states:
            self._consumed_state = self._yielded_states.popleft()
        ledger = getattr(hooks.loader_iterator(self), "_tsl_ledger", None)
        if ledger is not None:
            ledger.consumed()

    def state_dict(self) -> dict[str, Any]:
        return self._consumed_state if self._consumed_state is not None else super().state_dict()


class StorageDataModule(pl.LightningDataModule):
    """A ``LightningDataModule`` over ``StorageDataset``.

    ``source`` (and the optional ``val_source``) is anything ``StorageDataset`` takes. The train
    loader is a ``torchdata`` ``StatefulDataLoader``: Lightning checkpoints its ``state_dict``, so a
    run resumed from a mid-epoch checkpoint neither repeats nor skips samples of a finite source.
    ``batch_size`` batches inside the dataset (samples are stacked straight into shared memory).
    A finite source sizes Lightning's epochs (``len`` per rank, equal on every rank: see
    ``StorageDataset``); ``shuffle=True`` shuffles the train source with ``seed`` and the trainer's epoch.
    ``storage_options`` are for object-store handles or prefixes (see ``StorageDataset``); they are
    kept out of the saved hyperparameters. ``trusted_roots``: where handles from a network source
    may point (see ``StorageDataset``). ``device="cuda"``: batches reach the model already on the
    GPU (copied one batch ahead on a side stream, see ``StorageDataset``), so Lightning's own
    transfer has nothing left to do; ``pin_memory`` is then ignored.
    """

    def __init__(self, source: Any, *, val_source: Any = None, batch_size: int | None = None,
                 num_workers: int = 2, prefetch_factor: int | None = 2, persistent_workers: bool | None = None,
                 pin_memory: bool = False, drop_last: bool = False, collate_fn: Callable[[list[Any]], Any] | None = None,
                 slots_per_worker: int = 4, max_rings_per_worker: int = 8, on_error: str = "raise",
                 multiprocessing_context: str | None = None, shuffle: bool = False, seed: int = 0,
                 storage_options: dict | None = None, trusted_roots: list[str] | None = None,
                 device: str | torch.device | None = None) -> None:
        super().__init__()
        if num_workers < 0:
            raise ValueError(f"{num_workers=} must be >= 0")
        if not isinstance(shuffle, bool):
            raise TypeError(f"{shuffle=} must be a bool")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"{seed=} must be an int")
        # Credentials never reach hparams (logged, checkpointed).
        self.save_hyperparameters(ignore=["source", "val_source", "collate_fn", "storage_options"])
        self.storage_options = storage_options
        self.trusted_roots = trusted_roots
        self.device = None if device is None else str(device)
        self.source = source
        self.val_source = val_source
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor if num_workers else None
        self.persistent_workers = bool(num_workers) if persistent_workers is None else persistent_workers
        self.pin_memory = pin_memory
        self.drop_last = drop_last
        self.collate_fn = collate_fn
        self.slots_per_worker = slots_per_worker
        self.max_rings_per_worker = max_rings_per_worker
        self.on_error = on_error
        self.shuffle = shuffle
        self.seed = seed
        self.multiprocessing_context = multiprocessing_context if num_workers else None
        self.train_dataset: StorageDataset | None = None
        self.val_dataset: StorageDataset | None = None
        self._loaders: list = []
        self._train_loader: _ConsumedStateLoader | None = None
        self._hide_val_if_unused()

    def _hide_val_if_unused(self) -> None:
        # Lightning runs (and warns about) a validation loop whenever val_dataloader is overridden.
        if self.val_source is None:
            self.val_dataloader = super().val_dataloader

    def prepare_data(self) -> None:
        """Nothing to download or write: producers fill the source."""

    def _dataset(self, source: Any, shuffle: bool = False) -> StorageDataset:
        return StorageDataset(source, batch_size=self.batch_size, drop_last=self.drop_last,
                              collate_fn=self.collate_fn, slots_per_worker=self.slots_per_worker,
                              max_rings_per_worker=self.max_rings_per_worker,
                              on_error=self.on_error, shuffle=shuffle, seed=self.seed,
                              storage_options=self.storage_options, trusted_roots=self.trusted_roots,
                              device=self.device)

    def _quiet_len_warning(self, on: bool) -> None:
        entry: Any = getattr(self, "_len_filter", None)
        if on and entry is None:
            warnings.filterwarnings("ignore", message=_LEN_WARNING, category=UserWarning, module=_LEN_WARNING_MODULE)
            self._len_filter: Any = warnings.filters[0]
        elif not on and entry is not None:
            self._len_filter = None
            try:
                warnings.filters.remove(entry)  # type: ignore[attr-defined]
            except ValueError:
                return  # the filters were restored meanwhile (a catch_warnings block ended)
            getattr(warnings, "_filters_mutated", lambda: None)()

    def setup(self, stage: str | None = None) -> None:
        self._quiet_len_warning(True)
        if stage in ("fit", None) and self.train_dataset is None:
            self.train_dataset = self._dataset(self.source, self.shuffle)
        if stage in ("fit", "validate", None) and self.val_source is not None and self.val_dataset is None:
            self.val_dataset = self._dataset(self.val_source)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        trainer = getattr(self, "trainer", None)
        if trainer is not None and trainer.training and self._train_loader is not None:
            self._train_loader.mark_consumed()
        return batch

    def _trainer_epoch(self) -> int | None:
        trainer = self.trainer
        return trainer.fit_loop.epoch_progress.current.processed if trainer is not None else None

    def _loader(self, dataset: StorageDataset, train: bool = False) -> StatefulDataLoader:
        loader = _ConsumedStateLoader(
            dataset, epoch_fn=self._trainer_epoch if train else None, confirm_delivery=train, batch_size=None,
            num_workers=self.num_workers, prefetch_factor=self.prefetch_factor,
            persistent_workers=self.persistent_workers, pin_memory=self.pin_memory and self.device is None,
            multiprocessing_context=self.multiprocessing_context)
        self._loaders.append(loader)
        return loader

    def train_dataloader(self) -> StatefulDataLoader:
        if self.train_dataset is None:
            self.setup("fit")
        self._train_loader = self._loader(self.train_dataset, train=True)
        return self._train_loader

    def val_dataloader(self) -> StatefulDataLoader:
        if self.val_dataset is None:
            self.setup("validate")
        return self._loader(self.val_dataset)

    def teardown(self, stage: str | None = None) -> None:
        """Stop every worker of the loaders this module made and release their shared memory."""
        for loader in self._loaders:
            hooks.shutdown_iterator(loader)
        self._loaders.clear()
        self._train_loader = None
        retire_rings(dead_only=True)
        self._quiet_len_warning(False)

    def state_dict(self) -> dict[str, Any]:
        stats = self.train_dataset.stats() if self.train_dataset is not None else {}
        return {"train_stats": stats}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loader progress is restored by Lightning from the StatefulDataLoader's own state."""

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_loaders"], state["_train_loader"] = [], None
        state["_len_filter"] = None  # this process's warning filter
        state.pop("val_dataloader", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._hide_val_if_unused()


class StorageStatsCallback(pl.Callback):
    """Logs loader figures next to the loss, and tears the data module down on an exception.

    Logged per step: ``loader/samples_per_s``, ``loader/gb_per_s``, ``loader/slot_loads``,
    ``loader/fallbacks``, ``loader/wait_s`` (time the trainer waited for this batch) and
    ``loader/wait_total_s``.
    """

    def __init__(self, prog_bar: bool = False) -> None:
        self.prog_bar = prog_bar
        self.wait_total = 0.0
        self.batches = 0
        self.bytes = 0
        self._batch_end = None
        self._start = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = self._batch_end = time.perf_counter()
        self.wait_total = 0.0
        self.batches = self.bytes = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        now = time.perf_counter()
        wait = now - self._batch_end if self._batch_end is not None else 0.0
        self.wait_total += wait
        self.batches += 1
        self.bytes += sum(t.nbytes for t in _tensors(batch))
        dm = trainer.datamodule
        stats = dm.train_dataset.stats() if isinstance(dm, StorageDataModule) and dm.train_dataset is not None else {}
        elapsed = max(now - (self._start or now), 1e-9)
        samples = self.batches * (getattr(dm, "batch_size", None) or 1)
        pl_module.log_dict({
            "loader/wait_s": wait,
            "loader/wait_total_s": self.wait_total,
            "loader/samples_per_s": samples / elapsed,
            "loader/gb_per_s": self.bytes / elapsed / 1e9,
            "loader/slot_loads": float(stats.get("slot_loads", 0)),
            "loader/fallbacks": float(stats.get("fallbacks", 0)),
        }, on_step=True, on_epoch=False, prog_bar=self.prog_bar, batch_size=1, sync_dist=False)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._batch_end = time.perf_counter()

    @property
    def train_seconds(self) -> float:
        """From the start of training to the end of the last batch."""
        if self._start is None or self._batch_end is None:
            return 0.0
        return self._batch_end - self._start

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if isinstance(trainer.datamodule, StorageDataModule):
            trainer.datamodule.teardown("fit")



def _tensors(x: Any):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict) or hasattr(x, "items"):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)
