"""Storage types for tests; a module of their own so that spawned workers can import them."""

from __future__ import annotations

import os
import signal
import time

import numpy as np

from torch_storage_loader import Storage


class MemoryStorage(Storage):
    """Holds its sample in the handle: exercises the generic (non-file) worker path."""

    def __init__(self, value, tag: str = "mem") -> None:
        super().__init__(tag)
        self.value = value

    def save(self, data) -> None:
        self.value = data

    def load(self):
        return self.value


class SleepStorage(Storage):
    def __init__(self, seconds: float, tag: str = "sleep") -> None:
        super().__init__(tag)
        self.seconds = seconds

    def save(self, data) -> None:
        raise NotImplementedError

    def load(self):
        time.sleep(self.seconds)
        return {"slept": np.array([self.seconds])}


class KillStorage(Storage):
    """Kills the worker that loads it; with ``marker``, only the first time."""

    def __init__(self, marker: str | None) -> None:
        super().__init__(marker or "always")
        self.marker = marker

    def save(self, data) -> None:
        raise NotImplementedError

    def load(self):
        if self.marker is None or not os.path.exists(self.marker):
            if self.marker is not None:
                open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return {"survived": np.array([1])}


def produce(queue, directory: str, start: int, count: int) -> None:
    """A producer process: save trajectories and put their handles on a StorageQueue."""
    from conftest import traj
    from torch_storage_loader import FileStorageLoader

    loader = FileStorageLoader(directory, ttl=None)
    with queue.producer():
        for i in range(start, start + count):
            queue.put(loader.save(traj(i)))
    loader.shutdown()


def start_producers(queue, root, count: int, n: int = 2) -> list:
    """Start ``n`` spawned producers; producer k puts ids 100k .. 100k+count-1."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=produce, args=(queue, os.path.join(str(root), f"p{k}"), 100 * k, count))
             for k in range(n)]
    for p in procs:
        p.start()
    return procs


def produce_then_die(queue, directory: str) -> None:
    from conftest import traj
    from torch_storage_loader import FileStorageLoader

    loader = FileStorageLoader(directory, ttl=None)
    with queue.producer():
        queue.put(loader.save(traj(0)))
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)


def produce_into_directory(directory: str, start: int, count: int) -> None:
    from conftest import traj
    from torch_storage_loader import FileStorageLoader

    with FileStorageLoader(directory, ttl=None) as loader:
        for i in range(start, start + count):
            loader.save(traj(i))
            time.sleep(0.01)


def consume_directory(directory: str, out) -> None:
    """Another consumer process of a directory source; puts the ids it loaded on ``out``."""
    from torch.utils.data import DataLoader
    from torch_storage_loader import StorageDataset

    ids = [int(s["info"]["id"]) for s in DataLoader(StorageDataset(directory), batch_size=None, num_workers=1)]
    out.put(ids)


def ddp_rank(rank: int, world: int, init_file: str, handles, out) -> None:
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from torch_storage_loader import StorageDataset

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        dl = DataLoader(StorageDataset(handles), batch_size=None, num_workers=2, multiprocessing_context="spawn")
        out.put((rank, [int(s["info"]["id"]) for s in dl]))
    finally:
        dist.destroy_process_group()


import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402


class Tiny(pl.LightningModule):
    """A small model that regresses reward from obs, recording the sample ids it trains on."""

    def __init__(self, record_dir: str | None = None, fail_at: int | None = None):
        super().__init__()
        self.net = torch.nn.Linear(4 * 8 * 8, 1)
        self.seen: list[int] = []
        self.record_dir, self.fail_at = record_dir, fail_at

    def training_step(self, batch, batch_idx):
        if self.fail_at is not None and batch_idx == self.fail_at:
            raise ValueError("boom in training_step")
        obs = batch["obs"].reshape(*batch["obs"].shape[:-3], -1)
        loss = torch.nn.functional.mse_loss(self.net(obs).squeeze(-1), batch["reward"])
        ids = batch["info"]["id"]
        self.seen += ids.tolist() if isinstance(ids, torch.Tensor) else [int(ids)]
        self.log("loss", loss)
        return loss

    def on_train_end(self):
        if self.record_dir is not None:
            with open(os.path.join(self.record_dir, f"rank{self.global_rank}.txt"), "w") as f:
                f.write(" ".join(map(str, self.seen)))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def tiny_model(record_dir: str | None = None, fail_at: int | None = None) -> Tiny:
    return Tiny(record_dir, fail_at)


class EpisodeMissing(LookupError):
    """A user Storage's own exception type."""


class RaisingStorage(Storage):
    """Raises its own exception type in the worker."""

    def save(self, data) -> None:
        raise NotImplementedError

    def load(self):
        raise EpisodeMissing(f"episode {self.path} is gone from the replay buffer")
