"""The Redis road as a user walks it (issue 28): scripts run as ``python example.py``, hard time limits.

Collectors put file handles into a Redis stream; a trainer that forgot ``trusted_roots=`` must fail
loudly on its own thread, naming the setting and the path, and lose nothing: the next trainer,
configured, gets every handle.
"""

from __future__ import annotations

import uuid

from _helpers import run_script
from _redis_server import redis_server  # noqa: F401  (fixture)

from torch_storage_loader import RedisStorageQueue

N = 40

PRODUCER = """
import sys

import numpy as np

from torch_storage_loader import FileStorageLoader, RedisStorageQueue

if __name__ == "__main__":
    url, stream, directory, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    queue = RedisStorageQueue(url, stream)  # a producer needs no trusted_roots
    with FileStorageLoader(directory, ttl=None) as loader, queue.producer():
        for i in range(n):
            queue.put(loader.save({"id": np.array([i]), "x": np.zeros(4, dtype=np.float32)}))
    queue.close()
    print("put", n)
"""

CONSUMER = """
import sys

from torch.utils.data import DataLoader

from torch_storage_loader import RedisStorageQueue, StorageDataset

if __name__ == "__main__":
    url, stream, roots = sys.argv[1], sys.argv[2], sys.argv[3:]
    queue = RedisStorageQueue(url, stream, trusted_roots=roots or None)
    loader = DataLoader(StorageDataset(queue), batch_size=None, num_workers=2, timeout=60)
    ids = [int(sample["id"]) for sample in loader]
    print("ids", " ".join(map(str, sorted(ids))))
"""


def test_a_trainer_without_trusted_roots_fails_loudly_and_the_next_one_gets_every_handle(redis_server, tmp_path):
    stream, data = f"journey-{uuid.uuid4().hex[:8]}", tmp_path / "shared"
    url = redis_server.url
    q = RedisStorageQueue(url, stream, trusted_roots=[str(data)])
    try:
        put = run_script(PRODUCER, tmp_path, timeout=120, args=(url, stream, str(data), str(N)))
        assert put.returncode == 0, put.stderr[-3000:]

        forgot = run_script(CONSUMER, tmp_path, timeout=60, args=(url, stream))
        assert forgot.returncode != 0, f"a trainer trusting no root ended normally:\n{forgot.stdout[-2000:]}"
        assert "trusted_roots=" in forgot.stderr and str(data) in forgot.stderr, forgot.stderr[-3000:]
        s = q.stats()
        assert (s["acked"], s["refused"], s["delivered"]) == (0, 0, 0), (
            f"the misconfigured trainer consumed entries: {s}"
        )

        ok = run_script(CONSUMER, tmp_path, timeout=120, args=(url, stream, str(data)))
        assert ok.returncode == 0, ok.stderr[-3000:]
        line = next(x for x in ok.stdout.splitlines() if x.startswith("ids"))
        assert sorted(int(i) for i in line.split()[1:]) == list(range(N)), line
        s = q.stats()
        assert (s["delivered"], s["acked"], s["refused"], s["pending"], s["undelivered"]) == (N, N, 0, 0, 0), s
    finally:
        q.delete()
