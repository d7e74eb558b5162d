"""What a consumer waiting on a directory stream costs while nothing is unclaimed.

A DataLoader worker of a directory source that has run out of files lists the directory every
``poll_interval`` (0.05 s) and, to know whether claims are a dead trainer's (to give them back) or
whether the stream is over, checks the claims it sees. With many claims in flight (held by live
trainers' workers: dataset batches of 32, prefetched) that check ran once per claim, a ``/proc``
read each; it now runs once per trainer and listing. Printed: the waiting consumer's CPU, as a
share of one core, for a few counts of claims in flight (this process's pid stands in for a live
trainer's and its workers').

    python benchmarks/bench_idle.py [--seconds 3] [--claims 0 300 3000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import tempfile
import threading
import time


def waiting_cpu(claims: int, seconds: float) -> float:
    """CPU share of one core used by a consumer that waits for ``seconds`` beside ``claims`` live claims."""
    from torch_storage_loader import DirectorySource, end_directory_stream

    work = tempfile.mkdtemp(prefix="tsl-bench-idle-")
    try:
        host, me = socket.gethostname(), os.getpid()
        for i in range(claims):
            open(os.path.join(work, f"{i:06d}.tsl.claimed-{host}-{me}-{me}"), "w").close()
        pairs = DirectorySource(work).iterate(0, 1)
        cpu: list[float] = []

        def wait() -> None:
            t0 = time.thread_time()
            next(pairs, None)  # returns once the end marker is there (and every claim is a live trainer's)
            cpu.append(time.thread_time() - t0)

        t = threading.Thread(target=wait)
        t.start()
        time.sleep(seconds)
        end_directory_stream(work)
        t.join()
        return cpu[0] / seconds
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--claims", type=int, nargs="+", default=[0, 300, 3000])
    a = ap.parse_args()
    print("| claims in flight | waiting consumer's CPU, % of a core |")
    print("| --- | --- |")
    for n in a.claims:
        print(f"| {n} | {100 * waiting_cpu(n, a.seconds):.1f} |")


if __name__ == "__main__":
    main()
