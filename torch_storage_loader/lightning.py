"""Lightning integration: ``StorageDataModule`` and ``StorageStatsCallback``.

Imported only when used (``from torch_storage_loader.lightning import StorageDataModule``), so the
core library does not import Lightning.
"""

from __future__ import annotations

import re
import time
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ._dataloader import hooks
from ._dataloader.consumed import ConsumedStateLoader
from ._dataloader.items import DatasetOptions
from ._optional import require
from ._options import check_option, take
from ._shm.slots import retire_rings
from .dataset import StorageDataset

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torchdata.stateful_dataloader import StatefulDataLoader
else:
    pl = require("lightning.pytorch", "lightning", "StorageDataModule")

__all__ = ["StorageDataModule", "StorageStatsCallback"]

# Lightning (lightning.pytorch.utilities.data.has_len_all_ranks) warns on every fit that an
# IterableDataset with a length "could be inaccurate if each worker is not configured
# independently". A StorageDataset splits its handles across DataLoader workers and ranks itself
# and its length is exact per rank (padded or dropped evenly), so for our loaders that warning is
# a false alarm. It is ignored by exact message, category and emitting module, only between this
# data module's setup and teardown (when Lightning checks the loaders), see _quiet_len_warning.
_LEN_WARNING = re.escape("Your `IterableDataset` has `__len__` defined.")
_LEN_WARNING_MODULE = re.escape("lightning.pytorch.utilities.data") + r"\Z"


class StorageDataModule(pl.LightningDataModule):
    """A ``LightningDataModule`` over ``StorageDataset``.

    The train loader is a ``torchdata`` ``StatefulDataLoader``: Lightning checkpoints its
    ``state_dict``, so a run resumed from a mid-epoch checkpoint neither repeats nor skips samples of
    a finite source. A finite source sizes Lightning's epochs (``len`` per rank, equal on every
    rank: see ``StorageDataset``). The dataset options are ``StorageDataset``'s, checked here when
    the module is made (errors at construction, not at ``fit``).

    Args:
        source: the train source: anything ``StorageDataset`` takes.
        val_source: the validation source (none: no validation loop).
        batch_size: batches made inside the dataset (samples stacked straight into shared memory).
        num_workers: DataLoader workers (0: load in the trainer's process).
        prefetch_factor: items each worker loads ahead (DataLoader's).
        persistent_workers: keep workers between epochs (default: when there are workers).
        pin_memory: DataLoader's; ignored with ``device``.
        drop_last: drop a last incomplete batch (``StorageDataset``'s).
        collate_fn: how samples become a batch (``StorageDataset``'s).
        slots_per_worker: shared-memory slots per worker ring (``StorageDataset``'s).
        max_rings_per_worker: rings a worker may hold for changing layouts (``StorageDataset``'s).
        max_shm_bytes: the shared memory all workers together may map (``StorageDataset``'s).
        on_error: ``"raise"`` or ``"skip"`` a sample that cannot be loaded (``StorageDataset``'s).
        multiprocessing_context: the workers' start method (DataLoader's).
        shuffle: shuffle the train source with ``seed`` and the trainer's epoch.
        seed: the shuffle's seed.
        storage_options: for object-store handles or prefixes (``StorageDataset``'s); kept out of the
            saved hyperparameters.
        trusted_roots: where handles from a network source may point (``StorageDataset``'s).
        device: e.g. ``"cuda"``: batches reach the model already on the GPU (copied one batch ahead
            on a side stream), so Lightning's own transfer has nothing left to do.

    Raises:
        TypeError: an option of the wrong type (the message names it and the type expected).
        ValueError: an option out of range (the message names it).
    """

    def __init__(
        self,
        source: Any,
        *,
        val_source: Any = None,
        batch_size: int | None = None,
        num_workers: int = 2,
        prefetch_factor: int | None = 2,
        persistent_workers: bool | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        slots_per_worker: int = 4,
        max_rings_per_worker: int = 8,
        max_shm_bytes: int | None = None,
        on_error: str = "raise",
        multiprocessing_context: str | None = None,
        shuffle: bool = False,
        seed: int = 0,
        storage_options: dict[str, Any] | None = None,
        trusted_roots: list[str] | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__()
        check_option("num_workers", num_workers, int, least=0)
        check_option("prefetch_factor", prefetch_factor, int, least=1, none="for the DataLoader's default")
        check_option("persistent_workers", persistent_workers, bool, none="for: when there are workers")
        check_option("pin_memory", pin_memory, bool)
        # What every StorageDataset of this module is made with, checked now, not at fit (shuffle: the
        # train one's only; batch_size: this module's, which Lightning's batch-size tuner may change).
        self._dataset_options = take(DatasetOptions, locals())
        # Credentials never reach hparams (logged, checkpointed).
        self.save_hyperparameters(ignore=["source", "val_source", "collate_fn", "storage_options"])
        self.source = source
        self.val_source = val_source
        self.batch_size = batch_size  # read by Lightning's batch-size tuner
        self.shuffle = shuffle
        self.device = None if device is None else str(device)
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor if num_workers else None
        self.persistent_workers = bool(num_workers) if persistent_workers is None else persistent_workers
        self.pin_memory = pin_memory
        self.multiprocessing_context = multiprocessing_context if num_workers else None
        self.train_dataset: StorageDataset | None = None
        self.val_dataset: StorageDataset | None = None
        self._loaders: list[ConsumedStateLoader] = []
        self._train_loader: ConsumedStateLoader | None = None
        self._hide_val_if_unused()

    def _hide_val_if_unused(self) -> None:
        # Lightning runs (and warns about) a validation loop whenever val_dataloader is overridden.
        if self.val_source is None:
            self.val_dataloader = super().val_dataloader  # type: ignore[method-assign]  # so Lightning sees no override

    def prepare_data(self) -> None:
        """Nothing to download or write: producers fill the source."""

    def _dataset(self, source: Any, shuffle: bool = False) -> StorageDataset:
        return StorageDataset(
            source, **{**vars(self._dataset_options), "batch_size": self.batch_size, "shuffle": shuffle}
        )

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
        """Make the datasets ``stage`` needs (Lightning calls this on every rank).

        Args:
            stage: ``"fit"``, ``"validate"``, or ``None`` for both.
        """
        self._quiet_len_warning(True)
        if stage in ("fit", None) and self.train_dataset is None:
            self.train_dataset = self._dataset(self.source, self.shuffle)
        if stage in ("fit", "validate", None) and self.val_source is not None and self.val_dataset is None:
            self.val_dataset = self._dataset(self.val_source)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Count a train batch as consumed by the model, for the loader's checkpointed state.

        Args:
            batch: the batch (returned unchanged).
            dataloader_idx: which loader it came from.

        Returns:
            ``batch``.
        """
        trainer = getattr(self, "trainer", None)
        if trainer is not None and trainer.training and self._train_loader is not None:
            self._train_loader.mark_consumed()
        return batch

    def _trainer_epoch(self) -> int | None:
        trainer = self.trainer
        if trainer is None:
            return None
        # A _ProcessedTracker at runtime; Lightning annotates its base class.
        return trainer.fit_loop.epoch_progress.current.processed  # type: ignore[attr-defined,no-any-return]

    def _loader(self, dataset: StorageDataset, train: bool = False) -> StatefulDataLoader:
        loader = ConsumedStateLoader(
            dataset,
            epoch_fn=self._trainer_epoch if train else None,
            confirm_delivery=train,
            batch_size=None,
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor,
            persistent_workers=self.persistent_workers,
            pin_memory=self.pin_memory and self.device is None,
            multiprocessing_context=self.multiprocessing_context,
        )
        self._loaders.append(loader)
        return loader

    def train_dataloader(self) -> StatefulDataLoader:
        """The train loader (a new one per call: Lightning asks once per ``fit``).

        Returns:
            A ``StatefulDataLoader`` over the train ``StorageDataset``.
        """
        if self.train_dataset is None:
            self.setup("fit")
        assert self.train_dataset is not None  # setup made it
        self._train_loader = self._loader(self.train_dataset, train=True)
        return self._train_loader

    def val_dataloader(self) -> StatefulDataLoader:
        """The validation loader (only offered when there is a ``val_source``).

        Returns:
            A ``StatefulDataLoader`` over the validation ``StorageDataset``.
        """
        if self.val_dataset is None:
            self.setup("validate")
        assert self.val_dataset is not None  # setup made it (val_dataloader is hidden without a val_source)
        return self._loader(self.val_dataset)

    def teardown(self, stage: str | None = None) -> None:
        """Stop every worker of the loaders this module made and release their shared memory.

        Args:
            stage: the stage ending (every stage tears down the same).
        """
        for loader in self._loaders:
            hooks.shutdown_iterator(loader)
        self._loaders.clear()
        self._train_loader = None
        retire_rings(dead_only=True)
        self._quiet_len_warning(False)

    def state_dict(self) -> dict[str, Any]:
        """What Lightning saves of the module in a checkpoint: the train dataset's counts.

        Returns:
            ``{"train_stats": ...}`` (``StorageDataset.stats()``).
        """
        stats = self.train_dataset.stats() if self.train_dataset is not None else {}
        return {"train_stats": stats}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore here: Lightning restores loader progress from the StatefulDataLoader's own state.

        Args:
            state_dict: what ``state_dict`` saved.
        """

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

    Args:
        prog_bar: show the figures in the progress bar too.
    """

    def __init__(self, prog_bar: bool = False) -> None:
        self.prog_bar = prog_bar
        self.wait_total = 0.0
        self.batches = 0
        self.bytes = 0
        self._batch_end: float | None = None
        self._start: float | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start the clock and reset the counts.

        Args:
            trainer: the trainer.
            pl_module: the model.
        """
        self._start = self._batch_end = time.perf_counter()
        self.wait_total = 0.0
        self.batches = self.bytes = 0

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Log the figures for this batch (how long the trainer waited for it, throughput).

        Args:
            trainer: the trainer.
            pl_module: the model, which logs them.
            batch: the batch (its tensors' bytes are counted).
            batch_idx: its index.
        """
        now = time.perf_counter()
        wait = now - self._batch_end if self._batch_end is not None else 0.0
        self.wait_total += wait
        self.batches += 1
        self.bytes += sum(t.nbytes for t in _tensors(batch))
        dm = getattr(trainer, "datamodule", None)  # set by Trainer.fit; not declared on the class
        stats = dm.train_dataset.stats() if isinstance(dm, StorageDataModule) and dm.train_dataset is not None else {}
        elapsed = max(now - (self._start or now), 1e-9)
        samples = self.batches * (getattr(dm, "batch_size", None) or 1)
        pl_module.log_dict(
            {
                "loader/wait_s": wait,
                "loader/wait_total_s": self.wait_total,
                "loader/samples_per_s": samples / elapsed,
                "loader/gb_per_s": self.bytes / elapsed / 1e9,
                "loader/slot_loads": float(stats.get("slot_loads", 0)),
                "loader/fallbacks": float(stats.get("fallbacks", 0)),
            },
            on_step=True,
            on_epoch=False,
            prog_bar=self.prog_bar,
            batch_size=1,
            sync_dist=False,
        )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Note when the step ended: the wait for the next batch starts here.

        Args:
            trainer: the trainer.
            pl_module: the model.
            outputs: the step's outputs.
            batch: the batch.
            batch_idx: its index.
        """
        self._batch_end = time.perf_counter()

    @property
    def train_seconds(self) -> float:
        """From the start of training to the end of the last batch."""
        if self._start is None or self._batch_end is None:
            return 0.0
        return self._batch_end - self._start

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Tear a ``StorageDataModule`` down (workers stopped, shared memory released) when training fails.

        Args:
            trainer: the trainer.
            pl_module: the model.
            exception: what was raised.
        """
        dm = getattr(trainer, "datamodule", None)  # set by Trainer.fit; not declared on the class
        if isinstance(dm, StorageDataModule):
            dm.teardown("fit")


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict) or hasattr(x, "items"):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)
