"""The demo behind README's first command: save trajectories, load them back through workers."""

from __future__ import annotations

import argparse
import tempfile
import threading
import time

import numpy as np
import torch

from .file_loader import FileStorageLoader


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trajectories", type=int, default=64, help="how many to save and load")
    p.add_argument("--steps", type=int, default=64, help="transitions per trajectory")
    p.add_argument("--workers", type=int, default=2, help="loader worker processes")


def trajectory(i: int, steps: int) -> dict:
    rng = np.random.default_rng(i)
    return {
        "obs": rng.random((steps, 4, 84, 84), dtype=np.float32),
        "action": torch.from_numpy(rng.integers(0, 6, steps)),
        "reward": rng.random(steps, dtype=np.float32),
        "done": np.arange(steps) == steps - 1,
        "meta": {"episode": i, "env": "demo"},
    }


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="tsl-demo-") as d, \
            FileStorageLoader(d, worker_num=args.workers) as loader:
        t0 = time.perf_counter()
        handles = [loader.save(trajectory(i, args.steps)) for i in range(args.trajectories)]
        saved = time.perf_counter() - t0
        received, lock, done = [], threading.Lock(), threading.Semaphore(0)

        def callback(obj):
            with lock:
                received.append(int(obj["meta"]["episode"]))
            done.release()

        t0 = time.perf_counter()
        for h in handles:
            loader.load(h, callback)
        for _ in handles:
            done.acquire()
        loaded = time.perf_counter() - t0
        stats = loader.stats()
    gb = stats.bytes / 1e9 or 1e-12
    print(f"saved  {len(handles)} trajectories in {saved:.2f} s")
    print(f"loaded {len(received)} trajectories in {loaded:.2f} s "
          f"({len(received) / loaded:.0f} samples/s, {gb / loaded:.2f} GB/s through workers)")
    print(f"slots used {stats.slot_loads}, fallbacks {stats.fallbacks}, errors {stats.errors}")
    assert sorted(received) == list(range(args.trajectories))
    return 0
