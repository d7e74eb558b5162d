"""``fleet.py`` over a grid of collectors x trainers: a Markdown table and a plot.

    python benchmarks/fleet_scaling.py [--collectors 1,4,16,32] [--trainers 1,2,4] [--seconds 30] \
        [--out benchmarks/figures] [-- more fleet.py options]

Runs ``python benchmarks/fleet.py --collectors N --trainers M --seconds S --faults none --json`` for
each pair, one after the other (each starts and stops its own servers), keeps each run's last JSON
line in ``OUT/fleet_scaling.json``, prints the table and draws ``OUT/fleet_scaling.png``: samples/s,
GB/s, latency and trainer idle fraction against collectors, one line per trainer count.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
COLUMNS = (
    "collectors",
    "trainers",
    "produced",
    "lost",
    "duplicates",
    "samples_per_s",
    "gbps",
    "latency_p50_ms",
    "latency_p99_ms",
    "trainer_idle",
)


def run(n: int, m: int, seconds: float, extra: list[str]) -> dict:
    cmd = [
        sys.executable,
        os.path.join(HERE, "fleet.py"),
        "--collectors",
        str(n),
        "--trainers",
        str(m),
        "--seconds",
        str(seconds),
        "--faults",
        "none",
        "--json",
        "--plot",
        "",
        *extra,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 600)
    if out.returncode != 0:
        sys.stderr.write(out.stderr[-3000:])
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])


def markdown(rows: list[dict]) -> str:
    def cpu(r: dict) -> str:
        c = r["cpu_cores"]
        return " / ".join(f"{c.get(k, 0):.2f}" for k in ("redis", "store", "collectors", "trainers"))

    lines = [
        "| " + " | ".join(COLUMNS) + " | CPU cores: redis / store / collectors / trainers |",
        "|" + " --- |" * (len(COLUMNS) + 1),
    ]
    for r in rows:
        lines.append("| " + " | ".join(str(r[c]) for c in COLUMNS) + f" | {cpu(r)} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    for m in sorted({r["trainers"] for r in rows}):
        mine = sorted((r for r in rows if r["trainers"] == m), key=lambda r: r["collectors"])
        x = [r["collectors"] for r in mine]
        for ax, key in zip(axes, ("samples_per_s", "gbps", "latency_p99_ms", "trainer_idle"), strict=False):
            ax.plot(x, [r[key] for r in mine], marker="o", label=f"{m} trainer{'s' if m > 1 else ''}")
    for ax, title in zip(
        axes, ("samples/s received", "GB/s received", "put-to-trainer p99 (ms)", "trainer idle fraction"), strict=False
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("collectors")
        ax.set_title(title, fontsize=10)
    axes[2].set_yscale("log")
    axes[0].legend()
    fig.suptitle(f"fleet.py on {os.cpu_count()} cores, {rows[0]['seconds']:g} s per run, faults: none", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--collectors", default="1,4,16,32")
    p.add_argument("--trainers", default="1,2,4")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--out", default=os.path.join(HERE, "figures"))
    p.add_argument("extra", nargs="*", help="more fleet.py options, after --")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rows = []
    for m in (int(x) for x in a.trainers.split(",")):
        for n in (int(x) for x in a.collectors.split(",")):
            rows.append(run(n, m, a.seconds, a.extra))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            with open(os.path.join(a.out, "fleet_scaling.json"), "w") as f:
                json.dump(rows, f, indent=1)
    plot(rows, os.path.join(a.out, "fleet_scaling.png"))
    print(markdown(rows))


if __name__ == "__main__":
    main()
