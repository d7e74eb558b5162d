"""Small samples from a list, a StorageQueue and a directory, side by side in one run (issue 32).

4 KB samples (a dict of two float32 arrays and an int), ``DataLoader(StorageDataset(source, ...),
batch_size=None, num_workers=2)``: in dataset batches of 32, and one sample per DataLoader item.
Each source is drained ``--rounds`` times, interleaved, and the best round is kept; printed as
samples/s from the first item on (the workers' start is not in it) and as a ratio to the list
source of the same run. The reference for the raw file rate
is one process that opens, ``readinto``s and closes the same files.

``--against DIR`` also runs every case with the package found in ``DIR`` (a checkout of an
older commit, e.g. ``git worktree add /tmp/old HEAD~1``), interleaved with this one, so the two
columns come from the same minutes of the same machine.

    python benchmarks/bench_small.py [--n 6000] [--rounds 3] [--against /tmp/old]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _save(directory: str, n: int) -> list[str]:
    import numpy as np

    from torch_storage_loader import FileStorage

    os.makedirs(directory, exist_ok=True)
    paths = []
    for i in range(n):
        path = os.path.join(directory, f"{i:06d}.tsl")
        FileStorage(path).save(
            {"obs": np.full((4, 4, 8, 8), i % 251, np.float32), "reward": np.zeros(4, np.float32), "id": i}
        )
        paths.append(path)
    return paths


def make_source(kind: str, files: str, work: str) -> object:
    """A source of ``kind`` over the samples saved in ``files``: a list of handles, a closed
    ``StorageQueue`` of them, or (``dir``) a copy of ``files`` under ``work`` with its stream ended."""
    from torch_storage_loader import FileStorage, StorageQueue, end_directory_stream

    paths = sorted(os.path.join(files, p) for p in os.listdir(files) if p.endswith(".tsl"))
    if kind == "list":
        return [FileStorage(p) for p in paths]
    if kind == "queue":
        q = StorageQueue()
        for p in paths:
            q.put(FileStorage(p))
        q.close()
        return q
    source = os.path.join(work, "d")
    shutil.copytree(files, source)
    end_directory_stream(source)
    return source


def _case(kind: str, files: str, batch: int) -> tuple[float, float]:
    """Samples/s draining ``files`` once through ``kind`` (list, queue or dir), in this process, and
    the CPU time all processes spent per sample (microseconds: the trainer and its workers)."""
    from torch.utils.data import DataLoader

    from torch_storage_loader import StorageDataset

    n = len([p for p in os.listdir(files) if p.endswith(".tsl")])
    work = tempfile.mkdtemp(prefix="tsl-bench-small-")
    source = make_source(kind, files, work)
    options = {"batch_size": batch} if batch else {}
    c0 = os.times()
    got = first = 0
    t0 = 0.0
    for item in DataLoader(StorageDataset(source, **options), batch_size=None, num_workers=2, timeout=120):
        got += len(item["id"]) if batch else 1
        if not first:  # timed from the first item: the workers' start is the first-batch figure's
            first, t0 = got, time.perf_counter()
    rate = (n - first) / (time.perf_counter() - t0)
    c1 = os.times()  # the workers were joined: their time is the children's
    cpu = sum(c1[:4]) - sum(c0[:4])
    shutil.rmtree(work)
    if got != n:
        raise SystemExit(f"{kind}: {got} samples of {n}")
    return rate, cpu / n * 1e6


def _raw(files: str) -> float:
    """Files/s for one process that opens, reads whole and closes each file."""
    paths = sorted(os.path.join(files, p) for p in os.listdir(files))
    buf = bytearray(1 << 16)
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            f.readinto(buf)
    return len(paths) / (time.perf_counter() - t0)


def _run(package_dir: str, kind: str, files: str, batch: int) -> tuple[float, float]:
    """One case in a fresh interpreter that imports the package from ``package_dir``."""
    env = {**os.environ, "PYTHONPATH": package_dir}
    code = (
        f"import sys; sys.path.insert(0, {HERE + '/benchmarks'!r}); import bench_small as b; "
        f"print(b._case({kind!r}, {files!r}, {batch}))"
    )
    # cwd: "-c" puts it first on sys.path, and a checkout run from must not shadow package_dir
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=package_dir, check=True, capture_output=True, text=True
    )
    rate, cpu = out.stdout.strip().splitlines()[-1].strip("()").split(",")
    return float(rate), float(cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=6000, help="samples (one file each)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--against", help="a checkout of another commit to measure in the same run")
    args = ap.parse_args()
    trees = {"this": HERE}
    if args.against:
        trees["against"] = os.path.abspath(args.against)
    root = tempfile.mkdtemp(prefix="tsl-bench-small-")
    try:
        files = os.path.join(root, "files")
        _save(files, args.n)
        best: dict[tuple, float] = {}  # the best rate of the rounds
        cpu: dict[tuple, float] = {}  # the least CPU per sample of the rounds
        raw = 0.0
        for _ in range(args.rounds):
            raw = max(raw, _raw(files))
            for batch in (32, 0):
                for kind in ("list", "queue", "dir"):
                    for tree, where in trees.items():
                        key = (tree, batch, kind)
                        rate, us = _run(where, kind, files, batch)
                        best[key] = max(best.get(key, 0.0), rate)
                        cpu[key] = min(cpu.get(key, float("inf")), us)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.n} samples of 4 KB, DataLoader(num_workers=2, batch_size=None), best of {args.rounds} rounds")
    print(f"one process open/readinto/close of the same files: {raw:,.0f} files/s")
    print("samples/s, its ratio to the list source, and the CPU all processes spent per sample (us)")
    head = f"{'items':>22s} {'source':>6s}"
    for t in trees:
        head += f" {t + ' samples/s':>18s} {'vs list':>8s} {'us CPU':>7s}"
    if args.against:
        head += f" {'rate this/against':>18s} {'CPU this/against':>17s}"
    print(head)
    rows = []
    for batch in (32, 0):
        for kind in ("list", "queue", "dir"):
            line = f"{'dataset batches of 32' if batch else 'one sample per item':>22s} {kind:>6s}"
            for tree in trees:
                rate = best[(tree, batch, kind)]
                line += f" {rate:18,.0f} {rate / best[(tree, batch, 'list')]:8.2f} {cpu[(tree, batch, kind)]:7.0f}"
            if args.against:
                this, other = ("this", batch, kind), ("against", batch, kind)
                line += f" {best[this] / best[other]:18.2f} {cpu[this] / cpu[other]:17.2f}"
            print(line)
            rows.append(
                {
                    "batch": batch,
                    "source": kind,
                    **{t: {"samples_per_s": best[(t, batch, kind)], "cpu_us": cpu[(t, batch, kind)]} for t in trees},
                }
            )
    print(json.dumps({"raw_files_per_s": raw, "rows": rows}))


if __name__ == "__main__":
    main()
