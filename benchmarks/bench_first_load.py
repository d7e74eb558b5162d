"""First load of a fresh loader, per start method, beside a plain ``handle.load()``; then the steady rate.

Each row is a fresh process (``python bench_first_load.py --child ...``), as a training script is:
it imports torch, reads the sample once with ``handle.load()`` (warm page cache), then creates a
loader and times its first ``load`` until the callback, then ``--loads`` more loads in flight
together (the steady rate, once the workers are up). DI-engine's ``FileStorageLoader`` (its workers
fork) runs beside it where DI-engine is installed, on a pickle of the same sample. The first batch of
a ``StorageDataset`` under a ``DataLoader`` with workers is timed too (those workers are torch's).
Prints a Markdown table. Run: python benchmarks/bench_first_load.py [--mb 8] [--loads 40]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import torch

CHILD = "--child"


def sample(mb: float) -> dict:
    n = int(mb * (1 << 20)) // 4
    return {"obs": np.random.default_rng(0).random(n, dtype=np.float32), "reward": np.ones(64, np.float32)}


def child(impl: str, method: str, path: str, loads: int) -> dict:
    if impl == "ding":
        from ding.data import FileStorage as Handle
        from ding.data.storage_loader import FileStorageLoader
    else:
        from torch_storage_loader import FileStorage as Handle
        from torch_storage_loader import FileStorageLoader
    handle = Handle(path)
    handle.load()
    start = time.perf_counter()
    handle.load()
    plain = time.perf_counter() - start
    workdir = tempfile.mkdtemp(prefix="tsl-first-")
    options = {} if impl == "ding" else {"mp_context": method}  # DI-engine's loader forks, always
    loader = FileStorageLoader(workdir, **options)
    done = threading.Semaphore(0)
    start = time.perf_counter()
    loader.load(handle, lambda obj: done.release())
    done.acquire()
    first = time.perf_counter() - start
    if impl == "ding":
        time.sleep(2)  # its workers fork: up within this
    else:
        loader.start()  # the steady rate is the workers'
    for _ in range(6):  # warm: slots sized, rings mapped
        loader.load(handle, lambda obj: done.release())
        done.acquire()
    start = time.perf_counter()
    for _ in range(loads):
        loader.load(handle, lambda obj: done.release())
    for _ in range(loads):
        done.acquire()
    steady = time.perf_counter() - start
    nbytes = os.path.getsize(path)
    loader.shutdown()
    shutil.rmtree(workdir, ignore_errors=True)
    return {"plain_ms": plain * 1e3, "first_ms": first * 1e3, "gb_per_s": nbytes * loads / steady / 1e9}


def dataset_child(path: str, method: str) -> dict:

    from torch_storage_loader import FileStorage, StorageDataset

    handles = [FileStorage(path)] * 8
    loader = torch.utils.data.DataLoader(
        StorageDataset(handles), batch_size=None, num_workers=2, multiprocessing_context=method
    )
    start = time.perf_counter()
    it = iter(loader)
    next(it)
    first = time.perf_counter() - start
    del it
    return {"first_batch_ms": first * 1e3}


def run_child(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), CHILD, *args], capture_output=True, text=True, timeout=300
    )
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=float, default=8, help="sample size in MiB")
    ap.add_argument("--loads", type=int, default=40, help="loads in the steady-state run")
    ap.add_argument("--methods", nargs="+", default=["fork", "spawn", "forkserver"])
    args = ap.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="tsl-bench-first-")
    try:
        from torch_storage_loader import FileStorage

        ours = os.path.join(workdir, "sample.tsl")
        FileStorage(ours).save(sample(args.mb))
        rows = [("torch_storage_loader", m, run_child("ours", m, ours, str(args.loads))) for m in args.methods]
        try:
            from ding.data import FileStorage as DingFileStorage
        except ImportError:
            print("(DI-engine is not installed: its loader is left out)")
        else:
            pickled = os.path.join(workdir, "sample.pkl")
            DingFileStorage(pickled).save(sample(args.mb))
            rows.append(("DI-engine 0.5.3", "fork (its own)", run_child("ding", "fork", pickled, str(args.loads))))
        print(f"\n{args.mb:g} MiB sample; steady state: {args.loads} loads in flight\n")
        print("| loader | start method | plain handle.load() | first load | steady state |")
        print("| --- | --- | --- | --- | --- |")
        for name, method, r in rows:
            if "error" in r:
                print(f"| {name} | {method} | error: {r['error']} | | |")
                continue
            print(f"| {name} | {method} | {r['plain_ms']:.1f} ms | {r['first_ms']:.1f} ms | {r['gb_per_s']:.2f} GB/s |")
        print("\n| StorageDataset, DataLoader(num_workers=2) | first batch |")
        print("| --- | --- |")
        for m in args.methods:
            r = run_child("dataset", m, ours, "0")
            print(f"| {m} | {r.get('first_batch_ms', 0):.0f} ms |" if "error" not in r else f"| {m} | {r['error']} |")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == CHILD:
        impl, method, path, loads = sys.argv[2:6]
        result = dataset_child(path, method) if impl == "dataset" else child(impl, method, path, int(loads))
        print(json.dumps(result), flush=True)
    else:
        main()
