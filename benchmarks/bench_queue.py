"""Handles/s through RedisStorageQueue against StorageQueue (small FileStorage handles), side by side.

First, one process puts N handles, then takes them all (and acknowledges each, for Redis). Then,
end to end, ``DataLoader(StorageDataset(source), batch_size=None, num_workers=2)`` drains a closed
stream of saved samples, small ones and 7 MB trajectories, from a StorageQueue, a
RedisStorageQueue and a directory: at least once, so each sample is acknowledged by the trainer.
Without ``--url`` a throwaway ``redis-server`` is started on a free local port (``--save ""``).

    python benchmarks/bench_queue.py [--n 20000] [--small 3000] [--large 150] [--url redis://host:6379/0]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid

import numpy as np
from torch.utils.data import DataLoader

from torch_storage_loader import FileStorage, RedisStorageQueue, StorageDataset, StorageQueue, end_directory_stream


def _server() -> tuple[subprocess.Popen, str, str]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server not found: apt-get install -y redis-server, or pass --url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = tempfile.mkdtemp(prefix="tsl-bench-redis-")
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", d, "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    import redis

    for _ in range(500):
        try:
            if redis.Redis.from_url(url).ping():
                break
        except redis.ConnectionError:
            time.sleep(0.01)
    return proc, url, d


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_local(handles) -> tuple[float, float]:
    q = StorageQueue()
    put = _time(lambda: [q.put(h) for h in handles])
    get = _time(lambda: [q.get() for _ in handles])
    return len(handles) / put, len(handles) / get


def bench_redis(url: str, handles, prefetch: int) -> tuple[float, float]:
    q = RedisStorageQueue(url, f"bench-{uuid.uuid4().hex[:8]}", prefetch=prefetch, trusted_roots=["/data"])
    try:
        put = _time(lambda: [q.put(h) for h in handles])

        def take():
            for _ in handles:
                token, _s = q.get()
                q.ack(token)

        get = _time(take)
        return len(handles) / put, len(handles) / get
    finally:
        q.delete()


def _save(directory: str, n: int, steps: int, size: int) -> list[str]:
    os.makedirs(directory)
    paths = []
    for i in range(n):
        path = os.path.join(directory, f"{i:06d}.tsl")
        FileStorage(path + ".part").save(
            {
                "obs": np.full((steps, 4, size, size), i % 251, np.float32),
                "reward": np.zeros(steps, np.float32),
                "id": i,
            }
        )
        os.rename(path + ".part", path)
        paths.append(path)
    return paths


def _drain(source, n: int, nbytes: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    got = sum(1 for _ in DataLoader(StorageDataset(source), batch_size=None, num_workers=2, timeout=120))
    wall = time.perf_counter() - t0
    assert got == n, (got, n)
    return n / wall, n * nbytes / wall / 1e9


def bench_end_to_end(url: str, root: str, n: int, steps: int, size: int) -> list[tuple[str, float, float]]:
    nbytes = steps * 4 * size * size * 4
    rows = []
    paths = _save(os.path.join(root, "files"), n, steps, size)
    q = StorageQueue()
    for p in paths:
        q.put(FileStorage(p))
    q.close()
    rows.append(("StorageQueue", *_drain(q, n, nbytes)))
    with RedisStorageQueue(url, f"bench-{uuid.uuid4().hex[:8]}", trusted_roots=[root]) as r:
        try:
            for p in paths:
                r.put(FileStorage(p))
            r.close()
            rows.append(("RedisStorageQueue", *_drain(r, n, nbytes)))
        finally:
            r.delete()
    end_directory_stream(os.path.join(root, "files"))  # the directory source deletes what it delivers
    rows.append(("directory", *_drain(os.path.join(root, "files"), n, nbytes)))
    shutil.rmtree(root)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--small", type=int, default=3000, help="small samples (4 KB) end to end")
    ap.add_argument("--large", type=int, default=150, help="7 MB trajectories end to end")
    ap.add_argument("--url", help="an existing Redis (default: start a local redis-server)")
    args = ap.parse_args()
    handles = [FileStorage(f"/data/collector-0/{i:08d}-{uuid.uuid4().hex[:8]}.tsl") for i in range(args.n)]
    proc = directory = None
    url = args.url
    if url is None:
        proc, url, directory = _server()
    try:
        rows = [
            ("StorageQueue (local, mp.Queue)", *bench_local(handles)),
            ("RedisStorageQueue prefetch=1", *bench_redis(url, handles, 1)),
            ("RedisStorageQueue prefetch=16", *bench_redis(url, handles, 16)),
        ]
        work = tempfile.mkdtemp(prefix="tsl-bench-queue-")
        small = bench_end_to_end(url, os.path.join(work, "small"), args.small, 4, 8)
        large = bench_end_to_end(url, os.path.join(work, "large"), args.large, 64, 84)
        shutil.rmtree(work, ignore_errors=True)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
            shutil.rmtree(directory, ignore_errors=True)
    print(f"{args.n} handles of ~{len(handles[0].path)} character paths, one process")
    print(f"{'queue':34s} {'put/s':>10s} {'get(+ack)/s':>12s}")
    for name, put, get in rows:
        print(f"{name:34s} {put:10,.0f} {get:12,.0f}")
    for title, table in ((f"{args.small} samples of 4 KB", small), (f"{args.large} trajectories of 7.2 MB", large)):
        print()
        print(f"end to end, {title}: DataLoader(StorageDataset(source), batch_size=None, num_workers=2)")
        print(f"{'source':34s} {'samples/s':>10s} {'GB/s':>7s} {'vs StorageQueue':>16s}")
        for name, rate, gbs in table:
            print(f"{name:34s} {rate:10,.0f} {gbs:7.2f} {rate / table[0][1]:16.2f}")


if __name__ == "__main__":
    main()
