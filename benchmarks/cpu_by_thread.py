"""Where the CPU of one small-sample run goes: per process and thread, per sample.

Drains ``DataLoader(StorageDataset(source, batch_size=B), batch_size=None, num_workers=2)`` over
4 KB files (a list of handles, a ``StorageQueue``, or a directory) and reads, around the loop, the
CPU time of every thread of the trainer and of its workers from ``/proc/<pid>/task/<tid>/stat``
(sampled every 10 ms, so a worker's last figures are its last sample). Prints the rate and each
thread's CPU per sample: the trainer's threads by name (``tsl-ledger``, ``tsl-feeder``, torch's
queue feeders), a worker's as ``main`` or ``thread``. CPU figures vary less than rates on a noisy
machine: compare two checkouts by running this in each, alternately (``PYTHONPATH=DIR``).

    python benchmarks/cpu_by_thread.py {list,queue,dir} [--batch 32] [--n 30000] [--files DIR]

Linux only (``/proc``). ``--batch 0``: one sample per DataLoader item.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
TICKS = os.sysconf("SC_CLK_TCK")


class ThreadClock:
    """CPU seconds of every thread of this process and its children, sampled by a thread of its own."""

    def __init__(self) -> None:
        self.last: dict[tuple[int, str], tuple[str, str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="this-clock", daemon=True)

    def sample(self) -> None:
        names = {str(t.native_id): t.name for t in threading.enumerate()}
        me = os.getpid()
        pids = [me]
        try:
            with open(f"/proc/{me}/task/{me}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            pass
        for pid in pids:
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        stat = f.read()
                except OSError:
                    continue
                fields = stat[stat.rindex(")") + 2 :].split()
                who = "trainer" if pid == me else "worker"
                name = names.get(tid, "?") if pid == me else ("main" if tid == str(pid) else "thread")
                self.last[(pid, tid)] = (who, name, (int(fields[11]) + int(fields[12])) / TICKS)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.sample()

    def __enter__(self) -> ThreadClock:
        self.sample()
        self.start = dict(self.last)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def spent(self) -> collections.Counter[tuple[str, str]]:
        out: collections.Counter[tuple[str, str]] = collections.Counter()
        for key, (who, name, cpu) in self.last.items():
            out[(who, name)] += cpu - (self.start[key][2] if key in self.start else 0.0)
        return out


def main() -> None:
    from bench_small import _save, make_source
    from torch.utils.data import DataLoader

    from torch_storage_loader import StorageDataset

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", choices=("list", "queue", "dir"))
    ap.add_argument("--batch", type=int, default=32, help="dataset batch size; 0: one sample per item")
    ap.add_argument("--n", type=int, default=30000, help="samples (one file each), when --files is not given")
    ap.add_argument("--files", help="a directory of saved 4 KB samples to reuse (else made, then removed)")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="tsl-bench-cpu-")
    try:
        files = a.files
        if files is None:
            files = os.path.join(work, "files")
            _save(files, a.n)
        source = make_source(a.source, files, work)
        options = {"batch_size": a.batch} if a.batch else {}
        loader = DataLoader(StorageDataset(source, **options), batch_size=None, num_workers=2, timeout=120)
        got = 0
        with ThreadClock() as clock:
            t0 = time.perf_counter()
            for item in loader:
                got += len(item["id"]) if a.batch else 1
            wall = time.perf_counter() - t0
        print(f"{a.source}, batch {a.batch}: {got / wall:,.0f} samples/s ({got} samples)")
        total = 0.0
        for (who, name), cpu in sorted(clock.spent().items(), key=lambda kv: -kv[1]):
            total += cpu
            if cpu > 0.005:
                print(f"  {who:8s} {name:20s} {cpu:6.2f} s  {cpu / got * 1e6:6.1f} us/sample")
        print(f"  all threads {total / got * 1e6:.1f} us/sample of CPU; wall {wall / got * 1e6:.1f} us/sample")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
