"""One sample's own work, in one process: CPU per 4 KB sample, without DataLoader or thread hops.

A worker's fill of one file into its slot ring, the payload pickled as torch's queue pickles it,
and the trainer's receive (unpickled: the sample built on the slot), then dropped (the slot freed).
What the one-sample-per-item path and ``FileStorageLoader`` pay per sample beyond torch's own
per-item cost; CPU time varies less than rates on a noisy machine. Prints microseconds of CPU per
sample, the best of ``--rounds`` passes over ``--n`` files. ``--against DIR`` also measures the
package found in ``DIR`` (a checkout of an older commit), each checkout in fresh interpreters,
alternately, ``--runs`` times, and prints every run.

    python benchmarks/bench_fill.py [--n 6000] [--runs 6] [--against /tmp/old]
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _case(files: str, rounds: int) -> float:
    """Best-of-``rounds`` CPU microseconds per sample over the files in ``files``, in this process."""
    from multiprocessing.reduction import ForkingPickler

    from torch_storage_loader import FileStorage
    from torch_storage_loader._shm.filling import SlotFiller

    handles = [FileStorage(os.path.join(files, p)) for p in sorted(os.listdir(files))]
    filler = SlotFiller(8, as_tensors=True, budget=1 << 30)
    best = float("inf")
    try:
        for _ in range(rounds):
            t0 = time.process_time()
            for h in handles:
                payload = filler.fill(h)[1]
                data = ForkingPickler.dumps(payload)
                del payload
                sample = pickle.loads(data)
                del sample
            best = min(best, (time.process_time() - t0) / len(handles) * 1e6)
    finally:
        filler.close()
    return best


def _run(package_dir: str, files: str, rounds: int) -> float:
    env = {**os.environ, "PYTHONPATH": package_dir}
    code = (
        f"import sys; sys.path.insert(0, {HERE + '/benchmarks'!r}); import bench_fill as b; "
        f"print(b._case({files!r}, {rounds}))"
    )
    # cwd: "-c" puts it first on sys.path, and a checkout run from must not shadow package_dir
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=package_dir, check=True, capture_output=True, text=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=6000, help="samples (one file each)")
    ap.add_argument("--rounds", type=int, default=5, help="passes per run; the best is kept")
    ap.add_argument("--runs", type=int, default=6, help="runs per checkout, alternated")
    ap.add_argument("--against", help="a checkout of another commit to measure in the same run")
    args = ap.parse_args()
    from bench_small import _save

    trees = {"this": HERE, **({"against": os.path.abspath(args.against)} if args.against else {})}
    root = tempfile.mkdtemp(prefix="tsl-bench-fill-")
    try:
        files = os.path.join(root, "files")
        _save(files, args.n)
        got: dict[str, list[float]] = {t: [] for t in trees}
        for i in range(args.runs):
            for tree in list(trees)[:: 1 if i % 2 == 0 else -1]:
                got[tree].append(_run(trees[tree], files, args.rounds))
        print(
            f"{args.n} samples of 4 KB: fill + send + receive, CPU us per sample (best of {args.rounds} passes a run)"
        )
        for tree, runs in got.items():
            print(f"  {tree:8s} min {min(runs):6.1f}  runs {' '.join(f'{x:.1f}' for x in sorted(runs))}")
        if args.against:
            print(f"  this/against (mins): {min(got['this']) / min(got['against']):.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
