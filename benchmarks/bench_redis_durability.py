"""What Redis durability costs RedisStorageQueue: puts/s and get+ack/s, side by side, per setting.

    python benchmarks/bench_redis_durability.py [--n 5000] [--rounds 3]

Starts one ``redis-server`` per setting on 127.0.0.1 (in a temporary directory on this machine's
disk): no persistence; ``appendonly yes`` with ``appendfsync no`` / ``everysec`` / ``always``; and a
master with one replica and ``replicas=1`` (each put waits for the replica, Redis ``WAIT``). One
process puts ``--n`` small handles, then takes and acknowledges them all; rounds interleave the
settings. Prints handles/s per setting (best round) and its ratio to no persistence.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from _redis_server import RedisServer

from torch_storage_loader import FileStorage, RedisStorageQueue

SETTINGS = {
    "no persistence": ("--appendonly", "no"),
    "appendonly, appendfsync no": ("--appendonly", "yes", "--appendfsync", "no"),
    "appendonly, appendfsync everysec": ("--appendonly", "yes", "--appendfsync", "everysec"),
    "appendonly, appendfsync always": ("--appendonly", "yes", "--appendfsync", "always"),
    "replica + replicas=1 (WAIT), no persistence": ("--appendonly", "no"),
}


def once(url: str, n: int, replicas: int) -> tuple[float, float]:
    q = RedisStorageQueue(url, f"bench-{uuid.uuid4().hex[:8]}", replicas=replicas, trusted_roots=["/data"])
    handles = [FileStorage(f"/data/{i:06d}.tsl") for i in range(n)]
    t0 = time.perf_counter()
    for h in handles:
        q.put(h)
    t1 = time.perf_counter()
    for _ in range(n):
        token, _ = q.get(timeout=10)
        q.ack(token)
    t2 = time.perf_counter()
    q.delete()
    q.disconnect()
    return n / (t1 - t0), n / (t2 - t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="tsl-bench-durability-")
    servers, replica = {}, None
    try:
        for i, (name, args) in enumerate(SETTINGS.items()):
            d = os.path.join(root, str(i))
            os.mkdir(d)
            servers[name] = RedisServer(d, args=args + ("--save", "")).start()
        d = os.path.join(root, "replica")
        os.mkdir(d)
        master = servers["replica + replicas=1 (WAIT), no persistence"]
        replica = RedisServer(d, args=("--replicaof", "127.0.0.1", str(master.port), "--save", "")).start()
        time.sleep(1.0)  # let it sync
        best: dict[str, list[float]] = {name: [0.0, 0.0] for name in SETTINGS}
        for _ in range(a.rounds):
            for name, server in servers.items():
                puts, takes = once(server.url, a.n, 1 if "WAIT" in name else 0)
                best[name] = [max(best[name][0], puts), max(best[name][1], takes)]
        base = best["no persistence"]
        print(f"{'setting':45s} {'puts/s':>9s} {'ratio':>6s} {'get+ack/s':>10s} {'ratio':>6s}")
        for name, (puts, takes) in best.items():
            print(f"{name:45s} {puts:9.0f} {puts / base[0]:6.2f} {takes:10.0f} {takes / base[1]:6.2f}")
    finally:
        for server in [*servers.values(), replica]:
            if server is not None:
                server.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
