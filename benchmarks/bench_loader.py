"""FileStorageLoader against in-process pickle.load and a raw readinto, on the same samples.

Prints one JSON line per consumer ("drop": the callback drops each sample; "copy": it copies each
sample into memory of its own and drops the copy, as a replay buffer with its own storage would;
"keep": it keeps them all), plus one for save against a raw write. Each line compares, side by
side on the same files, pickle.load in the main process followed by the same consumer, the
loader's callback, and a raw readinto. Run: python benchmarks/bench_loader.py [--samples N]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import tempfile
import threading
import time

import numpy as np
import torch

from torch_storage_loader import FileStorage, FileStorageLoader


def trajectory(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {
        "obs": rng.random((64, 4, 84, 84), dtype=np.float32),
        "action": torch.from_numpy(rng.integers(0, 6, 64)),
        "reward": rng.random(64, dtype=np.float32),
        "done": np.zeros(64, bool),
    }


def sample_bytes(sample: dict) -> list[memoryview]:
    return [
        memoryview(np.ascontiguousarray(v if isinstance(v, np.ndarray) else v.numpy())).cast("B")
        for v in sample.values()
    ]


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def figures(name: str, n: int, nbytes: int, wall: float, cpu: float) -> dict:
    gb = nbytes / 1e9
    return {
        "path": name,
        "samples_per_s": round(n / wall, 1),
        "gb_per_s": round(gb / wall, 3),
        "main_cpu_s_per_gb": round(cpu / gb, 3),
    }


def bench_save(workdir: str, samples: list[dict], rounds: int = 3) -> dict:
    nbytes = sum(sum(len(b) for b in sample_bytes(s)) for s in samples)
    raw_dir, tsl_dir = os.path.join(workdir, "raw"), os.path.join(workdir, "saved")
    os.makedirs(raw_dir)

    def raw_write():
        for i, s in enumerate(samples):
            fd = os.open(os.path.join(raw_dir, f"{i}.bin"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            for b in sample_bytes(s):
                os.write(fd, b)
            os.close(fd)

    loader = FileStorageLoader(tsl_dir, ttl=None)

    def clean():  # untimed: new files every round for both, and no dirty pages carried over
        for d in (raw_dir, tsl_dir):
            for name in os.listdir(d) if os.path.isdir(d) else ():
                os.remove(os.path.join(d, name))
        os.sync()

    results = {}
    for _ in range(rounds):  # alternate, keep the best of each: the disk is shared and noisy
        for name, fn in (("raw_write", raw_write), ("save", lambda: [loader.save(s) for s in samples])):
            clean()
            wall, _ = timed(fn)
            results[name] = min(results.get(name, wall), wall)
    clean()
    loader.shutdown()
    shutil.rmtree(raw_dir)
    return {
        "bench": "save",
        "samples": len(samples),
        "bytes": nbytes,
        "raw_write_gb_per_s": round(nbytes / results["raw_write"] / 1e9, 3),
        "save_gb_per_s": round(nbytes / results["save"] / 1e9, 3),
        "save_over_raw": round(results["raw_write"] / results["save"], 3),
    }


def own_copy(obj: dict) -> dict:
    """Each leaf copied into fresh memory of the consumer's own."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v.copy() for k, v in obj.items()}


def bench_load(
    workdir: str, samples: list[dict], consumer: str, workers: int, inflight: int | None = None, rounds: int = 3
) -> dict:
    n = len(samples)
    storages = [FileStorage(os.path.join(workdir, f"{i}.tsl")) for i in range(n)]
    pickles = [os.path.join(workdir, f"{i}.pkl") for i in range(n)]
    for s, p, sample in zip(storages, pickles, samples, strict=False):
        s.save(sample)
        with open(p, "wb") as f:
            pickle.dump(sample, f, protocol=pickle.HIGHEST_PROTOCOL)
    nbytes = sum(s.read_header().data_size for s in storages)
    sink: list = []

    def consume(obj):
        if consumer == "keep":
            sink.append(obj)
        elif consumer == "copy":
            own_copy(obj)
        else:
            for leaf in obj.values():  # touch every leaf, as a trainer would
                leaf[0]

    def run_pickle():
        for p in pickles:
            with open(p, "rb") as f:
                consume(pickle.load(f))

    buf = bytearray(max(s.read_header().data_size for s in storages))

    def run_readinto():
        for s in storages:
            header = s.read_header()
            with open(s.path, "rb", buffering=0) as f:
                f.seek(header.data_offset)
                f.readinto(memoryview(buf)[: header.data_size])

    options = {} if inflight is None else {"max_inflight_per_worker": inflight}
    loader = FileStorageLoader(os.path.join(workdir, "unused"), worker_num=workers, **options)
    loader.start()  # the workers, ready (a fresh loader reads its first files itself while they start)
    for s in storages[: workers * 2]:  # size their rings
        loader.load_async(s).result()
    done = threading.Semaphore(0)

    def run_loader():
        def cb(obj):
            consume(obj)
            done.release()

        for s in storages:
            loader.load(s, cb)
        for _ in storages:
            done.acquire()

    out = {"bench": "load", "consumer": consumer, "samples": n, "bytes": nbytes, "rounds": rounds}
    best: dict[str, tuple[float, float]] = {}
    for _ in range(rounds):  # alternate, keep the fastest of each: other processes share the cores
        for name, fn in (("pickle_load", run_pickle), ("loader", run_loader), ("readinto", run_readinto)):
            sink.clear()
            wall, cpu = timed(fn)
            if name not in best or wall < best[name][0]:
                best[name] = (wall, cpu)
    sink.clear()
    rows = {name: figures(name, n, nbytes, *best[name]) for name in best}
    stats = loader.stats()
    loader.shutdown()
    for p in pickles:
        os.remove(p)
    for s in storages:
        os.remove(s.path)
    out["paths"] = list(rows.values())
    out["loader_over_pickle_throughput"] = round(rows["loader"]["gb_per_s"] / rows["pickle_load"]["gb_per_s"], 2)
    out["loader_cpu_per_gb_over_pickle"] = round(
        rows["loader"]["main_cpu_s_per_gb"] / rows["pickle_load"]["main_cpu_s_per_gb"], 3
    )
    out["loader_stats"] = {k: stats.as_dict()[k] for k in ("slot_loads", "fallbacks", "regrows")}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--inflight", type=int, default=None, help="max_inflight_per_worker (default: the loader's)")
    ap.add_argument("--consumers", nargs="+", choices=("drop", "copy", "keep"), default=["drop", "copy", "keep"])
    ap.add_argument("--rounds", type=int, default=3, help="timed runs per path (the fastest is printed)")
    ap.add_argument("--no-save", action="store_true", help="skip the save benchmark")
    args = ap.parse_args(argv)
    samples = [trajectory(i) for i in range(args.samples)]
    workdir = tempfile.mkdtemp(prefix="tsl-bench-")
    try:
        for consumer in args.consumers:
            print(
                json.dumps(bench_load(workdir, samples, consumer, args.workers, args.inflight, args.rounds)), flush=True
            )
        if not args.no_save:
            print(json.dumps(bench_save(workdir, samples)), flush=True)
    finally:
        shutil.rmtree(workdir)


if __name__ == "__main__":
    main()
