"""Handles/s through RedisStorageQueue against StorageQueue (small FileStorage handles), side by side.

One process puts N handles, then takes them all (and acknowledges each, for Redis). Without
``--url`` a throwaway ``redis-server`` is started on a free local port (``--save ""``).

    python benchmarks/bench_queue.py [--n 20000] [--url redis://host:6379/0]
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import tempfile
import time
import uuid

from torch_storage_loader import FileStorage, RedisStorageQueue, StorageQueue


def _server() -> tuple[subprocess.Popen, str, str]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server not found: apt-get install -y redis-server, or pass --url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = tempfile.mkdtemp(prefix="tsl-bench-redis-")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", d,
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)
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
    q = RedisStorageQueue(url, f"bench-{uuid.uuid4().hex[:8]}", prefetch=prefetch)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--url", help="an existing Redis (default: start a local redis-server)")
    args = ap.parse_args()
    handles = [FileStorage(f"/data/collector-0/{i:08d}-{uuid.uuid4().hex[:8]}.tsl") for i in range(args.n)]
    proc = directory = None
    url = args.url
    if url is None:
        proc, url, directory = _server()
    try:
        rows = [("StorageQueue (local, mp.Queue)", *bench_local(handles)),
                ("RedisStorageQueue prefetch=1", *bench_redis(url, handles, 1)),
                ("RedisStorageQueue prefetch=16", *bench_redis(url, handles, 16))]
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
            shutil.rmtree(directory, ignore_errors=True)
    print(f"{args.n} handles of ~{len(handles[0].path)} character paths, one process")
    print(f"{'queue':34s} {'put/s':>10s} {'get(+ack)/s':>12s}")
    for name, put, get in rows:
        print(f"{name:34s} {put:10,.0f} {get:12,.0f}")


if __name__ == "__main__":
    main()
