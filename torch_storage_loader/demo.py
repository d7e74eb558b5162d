"""The demo behind README's first command: collectors feed a Lightning trainer through storage.

Collector processes roll out a small simulated environment (numpy only) and save trajectories
with ``FileStorageLoader`` into a temporary directory, putting the handles on a ``StorageQueue``
(or, with ``--redis URL``, a ``RedisStorageQueue``);
a small Lightning model trains from ``StorageDataModule`` for a fixed number of steps. Then the
same number of steps runs through a plain ``DataLoader`` over the same files, and a table compares
the two. Everything lives in a temporary directory that is removed at the end.
"""

from __future__ import annotations

import argparse
import glob
import multiprocessing as mp
import os
import tempfile
import threading
import warnings
from collections.abc import Iterator, Sequence
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np
import torch

from ._optional import require
from .file_loader import FileStorageLoader
from .queue import StorageQueue
from .storage import FileStorage

if TYPE_CHECKING:  # imported where used: Lightning when the demo runs, redis only with --redis
    import lightning.pytorch as pl

    from .redis_queue import RedisStorageQueue


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--collectors", type=int, default=2, help="producer processes")
    p.add_argument("--trajectories", type=int, default=24, help="trajectories per collector")
    p.add_argument("--steps", type=int, default=64, help="environment steps per trajectory")
    p.add_argument("--size", type=int, default=84, help="observation frames are size x size")
    p.add_argument("--batch-size", type=int, default=2, help="trajectories per training batch")
    p.add_argument("--train-steps", type=int, default=20, help="optimizer steps per trainer")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    p.add_argument("--no-progress-bar", action="store_true")
    p.add_argument(
        "--redis",
        metavar="URL",
        default=None,
        help="hand trajectories over through a RedisStorageQueue at URL (redis://host:port/db) "
        "instead of a local StorageQueue; the demo's stream is deleted at the end",
    )


class BallEnv:
    """A ball bouncing in a box; the agent nudges it; reward is minus its distance to the centre."""

    def __init__(self, seed: int, size: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.size = size
        self.pos = self.rng.uniform(0, size, 2)
        self.vel = self.rng.normal(0, 2, 2)
        self.frames = np.zeros((4, size, size), np.float32)

    def step(self, action: int) -> tuple[np.ndarray, float, bool]:
        self.vel += np.array([[0, 0], [1, 0], [-1, 0], [0, 1], [0, -1]][action], np.float64) * 0.5
        self.pos += self.vel
        for k in range(2):
            if not 0 <= self.pos[k] < self.size:
                self.vel[k] = -self.vel[k]
                self.pos[k] = np.clip(self.pos[k], 0, self.size - 1)
        frame = np.zeros((self.size, self.size), np.float32)
        x, y = self.pos.astype(int)
        frame[max(0, x - 2) : x + 3, max(0, y - 2) : y + 3] = 1.0
        self.frames = np.concatenate([self.frames[1:], frame[None]])
        reward = -float(np.linalg.norm(self.pos - self.size / 2)) / self.size
        return self.frames.copy(), reward, self.rng.random() < 0.01


def collect(
    queue: StorageQueue | RedisStorageQueue, directory: str, collector: int, trajectories: int, steps: int, size: int
) -> None:
    """A collector process: roll out, save each trajectory, hand its handle to the trainer."""
    torch.set_num_threads(1)
    env = BallEnv(collector, size)
    loader = FileStorageLoader(directory, ttl=None)
    with queue.producer():
        for t in range(trajectories):
            obs = np.empty((steps, 4, size, size), np.float32)
            action = env.rng.integers(0, 5, steps)
            reward = np.empty(steps, np.float32)
            done = np.zeros(steps, bool)
            for i in range(steps):
                obs[i], reward[i], done[i] = env.step(int(action[i]))
            queue.put(
                loader.save(
                    {
                        "obs": obs,
                        "action": torch.from_numpy(action),
                        "reward": reward,
                        "done": done,
                        "info": {"collector": collector, "trajectory": t},
                    }
                )
            )
    loader.shutdown()


def _model() -> pl.LightningModule:
    require("lightning.pytorch", "lightning", "The demo")  # where it is missing: which extra installs it
    import lightning.pytorch as pl

    class RewardModel(pl.LightningModule):
        """Predicts each step's reward from its stacked frames."""

        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Conv2d(4, 8, 8, stride=4),
                torch.nn.ReLU(),
                torch.nn.AdaptiveAvgPool2d(4),
                torch.nn.Flatten(),
                torch.nn.Linear(8 * 16, 1),
            )

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            obs = batch["obs"].flatten(0, -4)  # (batch * steps, 4, H, W)
            loss = torch.nn.functional.mse_loss(self.net(obs).squeeze(-1), batch["reward"].flatten())
            self.log("loss", loss, prog_bar=True, batch_size=obs.shape[0])
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    return RewardModel()


class PlainFileDataset(torch.utils.data.IterableDataset[Any]):
    """The usual way, for comparisons: load each file in a worker and let DataLoader ship the tensors."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        for p in self.paths[wid::nw]:
            yield FileStorage(p).load()


class _Run(TypedDict):
    """What one training run measured (a row of the demo's table)."""

    batches: int
    bytes: int
    wall: float
    waited: float


def _fit(datamodule: pl.LightningDataModule, args: argparse.Namespace, progress: bool) -> _Run:
    require("lightning.pytorch", "lightning", "The demo")  # where it is missing: which extra installs it
    import lightning.pytorch as pl

    from .lightning import StorageStatsCallback

    stats = StorageStatsCallback()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.train_steps,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=progress,
        callbacks=[stats],
        num_sanity_val_steps=0,
    )
    trainer.fit(_model(), datamodule=datamodule)
    return {"batches": stats.batches, "bytes": stats.bytes, "wall": stats.train_seconds, "waited": stats.wait_total}


def _quiet_lightning() -> None:
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*GPU available but not used.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    warnings.filterwarnings("ignore", message="'pin_memory' argument is set as true but no accelerator")


def _close_when_done(queue: StorageQueue | RedisStorageQueue, collectors: Sequence[BaseProcess]) -> None:
    for p in collectors:
        p.join()
    queue.close()


def _queue_for(args: argparse.Namespace, workdir: str) -> StorageQueue | RedisStorageQueue:
    if not args.redis:
        return StorageQueue()
    import uuid

    from .redis_queue import RedisStorageQueue

    print("handing trajectories over through Redis Streams")
    # The trainer loads handles from the stream only under the directory its collectors write into.
    return RedisStorageQueue(args.redis, f"tsl-demo-{uuid.uuid4().hex[:12]}", trusted_roots=[workdir])


def run(args: argparse.Namespace) -> int:
    require("lightning.pytorch", "lightning", "The demo")  # where it is missing: which extra installs it
    import lightning.pytorch as pl

    from .lightning import StorageDataModule

    _quiet_lightning()
    pl.seed_everything(0, verbose=False)
    ctx = mp.get_context("spawn")
    needed = args.train_steps * args.batch_size
    with tempfile.TemporaryDirectory(prefix="tsl-demo-") as workdir:
        queue = _queue_for(args, workdir)
        collectors = [
            ctx.Process(
                target=collect,
                args=(queue, os.path.join(workdir, f"collector{c}"), c, args.trajectories, args.steps, args.size),
                daemon=True,
            )
            for c in range(args.collectors)
        ]
        for p in collectors:
            p.start()
        print(
            f"{args.collectors} collectors are rolling out {args.trajectories} trajectories each "
            f"({args.steps} steps of {4}x{args.size}x{args.size} frames) into {workdir}"
        )
        closer = threading.Thread(target=_close_when_done, args=(queue, collectors), name="demo-closer")
        closer.start()  # the stream ends with the collectors, so a last, short batch is trained on too
        dm = StorageDataModule(queue, batch_size=args.batch_size, num_workers=args.workers)
        ours = _fit(dm, args, not args.no_progress_bar)
        dm.teardown("fit")
        closer.join()
        if not isinstance(queue, StorageQueue):  # the RedisStorageQueue of --redis: its stream goes
            queue.delete()
        paths = sorted(glob.glob(os.path.join(workdir, "collector*", "*.tsl")))
        if len(paths) < needed:
            print(f"note: {len(paths)} trajectories for {needed} samples: the runs below repeat epochs")
        print("now the same files, through StorageDataModule and through a plain DataLoader ...")
        dm = StorageDataModule([FileStorage(p) for p in paths], batch_size=args.batch_size, num_workers=args.workers)
        files_ours = _fit(dm, args, False)
        dm.teardown("fit")
        plain_dm = pl.LightningDataModule.from_datasets(
            train_dataset=PlainFileDataset(paths), batch_size=args.batch_size, num_workers=args.workers
        )
        plain = _fit(plain_dm, args, False)
    print()
    print(f"{'run':<44}{'batches':>8}{'MB':>8}{'samples/s':>11}{'MB/s':>8}{'waited for data (s)':>21}")
    for name, r in (
        ("streaming from collectors, StorageDataModule", ours),
        ("same files, StorageDataModule", files_ours),
        ("same files, plain DataLoader", plain),
    ):
        samples = r["batches"] * args.batch_size
        print(
            f"{name:<44}{r['batches']:>8}{r['bytes'] / 1e6:>8.1f}{samples / r['wall']:>11.1f}"
            f"{r['bytes'] / 1e6 / r['wall']:>8.1f}{r['waited']:>21.2f}"
        )
    print("(samples/s over the training loop; the streaming run includes waiting for the collectors)")
    return 0
