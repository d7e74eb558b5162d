"""Every figure issue 32 tracks, each beside its reference measured in the same run, in one command.

Runs the benchmarks of this folder in fresh processes and prints one Markdown table: per row, this
checkout's figure, the reference it is compared with (measured in the same run: a list source, a raw
``readinto`` of the same files, the same training loop over batches already in memory, ``pickle.load``
in the trainer, a plain ``handle.load()``), their ratio, the figure issue 32 was filed with (main at
c0a849d, on this kind of 2-core machine) and the issue's target. ``--against DIR`` (a checkout of
another commit: ``git worktree add /tmp/old HEAD~3``) runs every benchmark for it too and adds its
ratio (and figure) as a column: bench_small's cases interleaved with this checkout's, the others
right after this checkout's, so that a before/after comparison comes from the same minutes of the
same machine. These machines are noisy (20% between runs of the same tree): compare ratios, and run
it twice before believing a small step.

    python benchmarks/report.py [--against DIR] [--quick] [--json-out FILE]

Rows and their sources: ``bench_small.py`` (4 KB samples from a list, a ``StorageQueue`` and a
directory, in dataset batches of 32 and one per DataLoader item), ``bench_gpu.py --only one_worker``
(one worker against a raw ``readinto`` into 4 mapped slots, the depth of its own ring, and into one
warm private buffer), ``bench_dataset.py`` (the GPU-like trainer, and the large-sample and
lists-of-transitions figures that must not get worse), ``bench_loader.py --consumers copy`` (the
callback path) and ``bench_first_load.py``'s children (the first load of a fresh loader).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# Issue 32's figures (main at c0a849d) and targets, per row: (what it says, its figure, target ratio).
ISSUE = {
    "queue32": ("0.22x (4,500-5,200/s)", 0.9),
    "dir32": ("-", 0.9),
    "queue1": ("0.39x (1,060-1,200/s)", 0.8),
    "dir1": ("-", 0.8),
    "list1": ("2,700-3,100/s (target: 2x that)", None),
    "list32": ("20,800-22,700/s", None),
    "worker1": ("0.40-0.48 (warm buffer)", 0.85),
    "worker4": ("0.40-0.48 (warm buffer)", 0.85),
    "gpu5": ("0.82-0.85", 0.95),
    "gpu2": ("0.72-0.82", 0.90),
    "callback": ("0.70x", 1.0),
    "first": ("3.0-12 s", None),
    "large": ("6.3x", None),
    "transitions": ("66x", None),
}


def _json_lines(cmd: list[str], tree: str) -> list[dict]:
    """The JSON lines ``cmd`` prints when it imports the package from ``tree``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, HERE])}
    out = subprocess.run(cmd, env=env, cwd=HERE, check=True, capture_output=True, text=True)
    rows = []
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            rows.append(json.loads(line))
    return rows


def _first_load(tree: str) -> dict:
    """First load of a fresh ``FileStorageLoader`` (forkserver: the default) against ``handle.load()``,
    and the first batch of a ``StorageDataset`` under a DataLoader, 8 MiB sample (bench_first_load)."""
    code = (
        "import json, os, tempfile, bench_first_load as b\n"
        "from torch_storage_loader import FileStorage\n"
        "d = tempfile.mkdtemp(prefix='tsl-report-'); p = os.path.join(d, 's.tsl')\n"
        "FileStorage(p).save(b.sample(8))\n"
        "r = b.run_child('ours', 'forkserver', p, '20'); r['dataset'] = b.run_child('dataset', 'fork', p, '0')\n"
        "os.remove(p); os.rmdir(d); print(json.dumps(r))\n"
    )
    return _json_lines([sys.executable, "-c", code], tree)[-1]


def measure(tree: str, quick: bool) -> dict[str, tuple[float, float, str]]:
    """Every row for the package in ``tree`` except bench_small's: ``{row: (figure, reference, unit)}``."""
    py = sys.executable
    rows: dict[str, tuple[float, float, str]] = {}
    gpu_args = ["--samples", "16", "--epochs", "2"] if quick else ["--samples", "32", "--epochs", "4"]
    for r in _json_lines([py, "bench_gpu.py", "--only", "one_worker", "--workers", "2", *gpu_args], tree):
        if r.get("section") == "one_worker":
            key = "worker1" if r["batch"] == "single samples" else "worker4"
            rows[key] = (r["ours_gb_s"], r["raw_slots_gb_s"], "GB/s")
            rows[key + "_warm"] = (r["ours_gb_s"], r["raw_gb_s"], "GB/s")
    ds_args = ["--large", "16", "--small", "16", "--rounds", "1", "--gpu-epochs", "2"] if quick else []
    for r in _json_lines([py, "bench_dataset.py", *ds_args], tree):
        w, paths = r.get("workload", ""), r.get("paths", {})
        if w == "large":
            rows["large"] = (paths["c_storage_dataset"]["gb_per_s"], paths["a_default_2_workers"]["gb_per_s"], "GB/s")
        elif w == "small":
            c, a = paths["c_storage_dataset"]["samples_per_s"], paths["a_default_2_workers"]["samples_per_s"]
            rows["transitions"] = (c, a, "samples/s")
        elif w.startswith("large 7 MB, GPU-like"):
            key = "gpu5" if r["step_ms"] == 5.0 else "gpu2"
            ours, resident = paths["storage_dataset_2w"], paths["resident_ceiling"]
            rows[key] = (ours["fraction_of_ideal"], resident["fraction_of_ideal"], "of ideal")
    loader_args = ["--samples", "16", "--rounds", "1"] if quick else []
    for r in _json_lines([py, "bench_loader.py", "--consumers", "copy", "--no-save", *loader_args], tree):
        by = {p["path"]: p for p in r["paths"]}
        rows["callback"] = (by["loader"]["gb_per_s"], by["pickle_load"]["gb_per_s"], "GB/s")
    first = _first_load(tree)
    rows["first"] = (first["first_ms"], first["plain_ms"], "ms")
    rows["first_batch"] = (first["dataset"].get("first_batch_ms", float("nan")), float("nan"), "ms")
    return rows


def small(trees: dict[str, str], quick: bool) -> dict[str, dict[str, tuple[float, float, str]]]:
    """bench_small's rows per tree: ``{tree: {row: (samples/s, the list's samples/s, unit)}}``."""
    cmd = [sys.executable, "bench_small.py", "--n", "2000" if quick else "8000", "--rounds", "1" if quick else "3"]
    if "against" in trees:
        cmd += ["--against", trees["against"]]
    last = _json_lines(cmd, trees["this"])[-1]
    out: dict[str, dict[str, tuple[float, float, str]]] = {t: {} for t in trees}
    for row in last["rows"]:
        size = "32" if row["batch"] else "1"
        for t in trees:
            lst = next(r for r in last["rows"] if r["batch"] == row["batch"] and r["source"] == "list")
            out[t][row["source"] + size] = (row[t]["samples_per_s"], lst[t]["samples_per_s"], "samples/s")
    return out


LABELS = {
    "queue32": "4 KB, dataset batches of 32: StorageQueue vs list source",
    "dir32": "4 KB, dataset batches of 32: directory vs list source",
    "list32": "4 KB, dataset batches of 32: list source (samples/s)",
    "queue1": "4 KB, one per DataLoader item: StorageQueue vs list",
    "dir1": "4 KB, one per DataLoader item: directory vs list",
    "list1": "4 KB, one per DataLoader item: list source (samples/s)",
    "worker1": "one worker, 7 MB singles vs raw readinto into 4 mapped slots",
    "worker1_warm": "one worker, 7 MB singles vs raw readinto into one warm buffer",
    "worker4": "one worker, 7 MB batches of 4 vs raw readinto into 4 mapped slots",
    "worker4_warm": "one worker, 7 MB batches of 4 vs raw readinto into one warm buffer",
    "gpu5": "GPU-like trainer, 5 ms per 7 MB batch: vs the resident loop",
    "gpu2": "GPU-like trainer, 2 ms per 7 MB batch: vs the resident loop",
    "callback": "FileStorageLoader.load, consumer copies: vs pickle.load in the trainer",
    "first": "first load of a fresh FileStorageLoader (forkserver) vs handle.load()",
    "first_batch": "first batch of DataLoader(StorageDataset, num_workers=2), fork",
    "large": "7 MB samples, StorageDataset vs the default DataLoader path",
    "transitions": "lists of 64 transitions, StorageDataset vs the default DataLoader path",
}


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", help="a checkout of another commit, measured in the same run")
    ap.add_argument("--quick", action="store_true", help="a smoke run: small sizes, one round")
    ap.add_argument("--json-out", help="also write every figure to this file")
    args = ap.parse_args()
    trees = {"this": ROOT}
    if args.against:
        trees["against"] = os.path.abspath(args.against)
    rows = small(trees, args.quick)
    for t in trees:
        rows[t].update(measure(trees[t], args.quick))
    print(
        f"\n| figure | this | reference, same run | ratio |{' against: ratio |' if args.against else ''} "
        "issue 32 (c0a849d) | target |"
    )
    print(f"| --- | --- | --- | --- |{' --- |' if args.against else ''} --- | --- |")
    for key, label in LABELS.items():
        if key not in rows["this"]:
            continue
        fig, ref, unit = rows["this"][key]
        ratio = fig / ref if ref == ref and ref else float("nan")  # nan: no reference
        line = f"| {label} | {_num(fig)} {unit} | {_num(ref)} | {ratio:.2f} |"
        if args.against:
            f2, r2, _ = rows["against"].get(key, (float("nan"),) * 2 + ("",))
            line += f" {f2 / r2 if r2 == r2 and r2 else float('nan'):.2f} ({_num(f2)}) |"
        old, target = ISSUE.get(key, ("-", None))
        line += f" {old} | {'>= ' + format(target, '.2f') if target else '-'} |"
        print(line.replace("nan", "-"))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
