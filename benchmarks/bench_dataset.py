"""DataLoader's default path against StorageDataset, on the same data, in one run.

(a) a plain IterableDataset that unpickles each file, num_workers=2, persistent workers: the
    DataLoader's default path ships the tensors; (b) the same with num_workers=0; (c)
    StorageDataset, num_workers=2, persistent workers. Timed over steady-state epochs after a
    warm-up epoch; the trainer reads every leaf of every batch. Prints one JSON line per workload
    with samples/s, GB/s, the trainer process's peak RSS, and the ratios (c)/(a), (c)/(b); then a
    line with the fraction of the ideal (compute-only) time reached when the trainer burns a fixed
    amount of CPU per batch (``--burn-ms``).

The GPU-like trainer (``--step-ms``, default 5 and 2 ms): per batch it looks at every leaf, then
sleeps for the step, leaving the CPU free as while a GPU computes. Printed side by side in one
run, per step: StorageDataset (2 workers), the default DataLoader path (2 workers), in-process
loading (0 workers) and, as a ceiling, the same loop over one batch kept in memory: each as the
fraction of ideal (batches * step / wall, median of ``--rounds``) and the trainer thread's CPU per
batch (``time.thread_time``, ms; the sleep costs none).
Run: python benchmarks/bench_dataset.py  (only the GPU-like trainer: --only gpu)
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import tempfile
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from torch_storage_loader import FileStorage, StorageDataset


class PickleFiles(IterableDataset):
    """The baseline users write: unpickle each file, let the DataLoader ship the result."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        for p in self.paths[wid::nw]:
            with open(p, "rb") as f:
                yield pickle.load(f)


def large(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {
        "obs": rng.random((64, 4, 84, 84), dtype=np.float32),
        "action": rng.integers(0, 6, 64),
        "reward": rng.random(64, dtype=np.float32),
        "done": np.zeros(64, bool),
    }


def small(i: int) -> list:
    rng = np.random.default_rng(i)
    return [
        {
            "obs": rng.random(4, dtype=np.float32),
            "action": np.int64(rng.integers(6)),
            "reward": np.float32(rng.random()),
            "done": np.bool_(False),
            "next_obs": rng.random(4, dtype=np.float32),
        }
        for _ in range(64)
    ]


def leaves(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from leaves(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from leaves(v)
    else:
        yield x


def read_all(batch) -> int:
    n = 0
    for t in leaves(batch):
        t.sum()  # the trainer reads every byte of every leaf
        n += t.nbytes
    return n


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run(loader, epochs: int, step=None) -> dict:
    for batch in loader:  # warm-up epoch: workers started, rings sized, caches warm
        read_all(batch)
    del batch
    reset_peak_rss()
    n = nbytes = 0
    t0 = time.perf_counter()
    for _ in range(epochs):
        for batch in loader:
            nbytes += read_all(batch)
            n += 1
            if step is not None:
                step()
        del batch
    wall = time.perf_counter() - t0
    return {
        "samples_per_s": round(n / wall, 1),
        "gb_per_s": round(nbytes / wall / 1e9, 3),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "wall_s": round(wall, 3),
        "batches": n,
    }


def write_files(workdir: str, make, count: int) -> tuple[list, list[str]]:
    """Each sample saved twice: as a storage file (its handle) and as a pickle file (its path)."""
    handles, pickles = [], []
    for i in range(count):
        sample = make(i)
        h = FileStorage(os.path.join(workdir, f"{i}.tsl"))
        h.save(sample)
        handles.append(h)
        pickles.append(os.path.join(workdir, f"{i}.pkl"))
        with open(pickles[-1], "wb") as f:
            pickle.dump(sample, f, protocol=pickle.HIGHEST_PROTOCOL)
    return handles, pickles


def make_loaders(workdir: str, make, count: int):
    handles, pickles = write_files(workdir, make, count)
    kw = dict(batch_size=None, num_workers=2, persistent_workers=True)
    return {
        "a_default_2_workers": DataLoader(PickleFiles(pickles), **kw),
        "b_default_0_workers": DataLoader(PickleFiles(pickles), batch_size=None, num_workers=0),
        "c_storage_dataset": DataLoader(StorageDataset(handles), **kw),
    }


def workload(name: str, make, count: int, epochs: int) -> dict:
    workdir = tempfile.mkdtemp(prefix="tsl-bench-")
    try:
        loaders = make_loaders(workdir, make, count)
        rows = {k: run(dl, epochs) for k, dl in loaders.items()}
        del loaders
    finally:
        shutil.rmtree(workdir)
    a, b, c = (rows[k]["samples_per_s"] for k in ("a_default_2_workers", "b_default_0_workers", "c_storage_dataset"))
    return {
        "workload": name,
        "samples": count,
        "epochs": epochs,
        "paths": rows,
        "c_over_a": round(c / a, 2),
        "c_over_b": round(c / b, 2),
    }


def burn(seconds: float) -> None:
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


def compute_bound(count: int, step_s: float) -> dict:
    workdir = tempfile.mkdtemp(prefix="tsl-bench-")
    try:
        loaders = make_loaders(workdir, large, count)
        out = {}
        for key in ("a_default_2_workers", "c_storage_dataset"):
            r = run(loaders[key], 1, step=lambda: burn(step_s))
            ideal = r["batches"] * step_s
            out[key] = {"fraction_of_ideal": round(ideal / r["wall_s"], 3), **r}
        del loaders
    finally:
        shutil.rmtree(workdir)
    return {"workload": "large, trainer burns CPU", "step_ms": step_s * 1e3, "paths": out}


def touch(batch) -> int:
    n = 0
    for t in leaves(batch):  # what a GPU trainer does on its CPU thread: hand each leaf on
        n += t.shape[0]
    return n


class Resident:
    """The ceiling: one batch kept in memory, yielded ``n`` times (no loading at all)."""

    def __init__(self, batch, n: int) -> None:
        self.batch, self.n = batch, n

    def __iter__(self):
        for _ in range(self.n):
            yield self.batch


def gpu_run(loader, step_s: float, epochs: int) -> dict:
    for batch in loader:  # warm-up epoch: workers started, rings sized, caches warm
        touch(batch)
    del batch
    n = 0
    cpu0, t0 = time.thread_time(), time.perf_counter()
    for _ in range(epochs):
        for batch in loader:
            touch(batch)
            n += 1
            time.sleep(step_s)
        del batch
    wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    return {"fraction": n * step_s / wall, "cpu_ms": cpu / n * 1e3, "batches": n}


def gpu_like(count: int, steps_ms: list[float], epochs: int, rounds: int) -> list[dict]:
    workdir = tempfile.mkdtemp(prefix="tsl-bench-")
    out = []
    try:
        loaders = make_loaders(workdir, large, count)
        loaders = {
            "storage_dataset_2w": loaders["c_storage_dataset"],
            "default_2w": loaders["a_default_2_workers"],
            "in_process_0w": DataLoader(
                StorageDataset(list(loaders["c_storage_dataset"].dataset.source.handles)),
                batch_size=None,
                num_workers=0,
            ),
            "resident_ceiling": Resident(large(0), count),
        }
        for step_ms in steps_ms:
            runs: dict[str, list[dict]] = {k: [] for k in loaders}
            for _ in range(rounds):  # interleaved, so that noise from other processes hits every path
                for key, dl in loaders.items():
                    runs[key].append(gpu_run(dl, step_ms / 1e3, epochs))
            paths = {}
            for key, rs in runs.items():
                fr = sorted(r["fraction"] for r in rs)
                cpu = sorted(r["cpu_ms"] for r in rs)
                paths[key] = {
                    "fraction_of_ideal": round(fr[len(fr) // 2], 3),
                    "all": [round(f, 3) for f in fr],
                    "trainer_cpu_ms_per_batch": round(cpu[len(cpu) // 2], 3),
                    "batches": rs[0]["batches"],
                }
            out.append(
                {
                    "workload": "large 7 MB, GPU-like trainer (sleeps per batch)",
                    "step_ms": step_ms,
                    "rounds": rounds,
                    "paths": paths,
                }
            )
            print(json.dumps(out[-1]), flush=True)
        del loaders
    finally:
        shutil.rmtree(workdir)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--large", type=int, default=32, help="7 MB trajectories")
    ap.add_argument("--small", type=int, default=64, help="lists of 64 transition dicts")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--burn-ms", type=float, default=20.0, help="CPU the compute-bound trainer burns per batch")
    ap.add_argument(
        "--step-ms",
        type=float,
        nargs="+",
        default=[5.0, 2.0],
        help="GPU-like trainer: sleep per batch (one or more values)",
    )
    ap.add_argument("--gpu-epochs", type=int, default=4, help="timed epochs over --large files per GPU-like run")
    ap.add_argument("--rounds", type=int, default=3, help="GPU-like runs per path and step (median printed)")
    ap.add_argument("--only", choices=("gpu", "throughput"), default=None)
    ap.add_argument(
        "--trainer-threads",
        type=int,
        default=1,
        help="torch intra-op threads of the trainer (0: torch's default). With 2 cores, one "
        "trainer thread leaves a core to the loading workers, as a tuned run would",
    )
    args = ap.parse_args(argv)
    if args.trainer_threads:
        torch.set_num_threads(args.trainer_threads)
    print(json.dumps({"cores": os.cpu_count(), "trainer_threads": torch.get_num_threads()}), flush=True)
    if args.only != "gpu":
        print(json.dumps(workload("large", large, args.large, args.epochs)), flush=True)
        print(json.dumps(workload("small", small, args.small, 1)), flush=True)
        print(json.dumps(compute_bound(args.large, args.burn_ms / 1e3)), flush=True)
    if args.only != "throughput":
        gpu_like(args.large, args.step_ms, args.gpu_epochs, args.rounds)


if __name__ == "__main__":
    main()
