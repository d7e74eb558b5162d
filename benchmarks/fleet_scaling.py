"""``fleet.py`` over a grid of collectors x trainers: a Markdown table and a plot.

    python benchmarks/fleet_scaling.py [--collectors 1,4,16,32] [--trainers 1,2,4] [--seconds 30] \
        [--out benchmarks/figures] [-- more fleet.py options]
    python benchmarks/fleet_scaling.py --replot   # redraw OUT/fleet_scaling.png from its JSON, run nothing

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


STORES = {"s3": "S3 (SeaweedFS)", "dir": "a shared directory"}
PANELS = (  # key, y label (with its unit), log scale, factor
    ("samples_per_s", "samples/s received\n(all trainers)", False, 1),
    ("gbps", "GB/s received\n(all trainers)", False, 1),
    ("latency_p99_ms", "put -> trainer latency,\np99 (s, log scale)", True, 1e-3),
    ("trainer_idle", "trainer idle fraction\n(time waiting for data)", False, 1),
)


def plot(rows: list[dict], path: str) -> None:
    """Four panels against collectors (one line per trainer count), 1000 px wide: the docs' width."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    collectors = sorted({r["collectors"] for r in rows})
    trainers = sorted({r["trainers"] for r in rows})
    cores = rows[0].get("cpu_cores", {}).get("machine", os.cpu_count())
    with plt.rc_context({"font.size": 11, "legend.fontsize": 10}):
        fig, axes = plt.subplots(2, 2, figsize=(10, 7.2), sharex=True)
        for m in trainers:
            mine = sorted((r for r in rows if r["trainers"] == m), key=lambda r: r["collectors"])
            x = [r["collectors"] for r in mine]
            for ax, (key, _, _, factor) in zip(axes.flat, PANELS, strict=True):
                y = [None if r[key] is None else r[key] * factor for r in mine]
                ax.plot(x, y, marker="o", label=f"{m} trainer{'s' if m > 1 else ''}")
        for ax, (_, label, log, _) in zip(axes.flat, PANELS, strict=True):
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_locator(FixedLocator(collectors))  # the grid's values, as plain numbers
            ax.xaxis.set_minor_locator(NullLocator())
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            if log:
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
                ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else ""))
        for ax in axes[1]:
            ax.set_xlabel("collector processes (log scale)")
        axes[0][0].legend(title="trainers", loc="upper left")
        fig.suptitle(
            f"fleet_scaling.py: fleet.py over {len(collectors)} collector counts x {len(trainers)} trainer counts, "
            f"{rows[0]['seconds']:g} s each, no faults\n"
            f"{rows[0].get('redis', 'single')} Redis, {STORES.get(rows[0].get('store'), 'a store')}; one machine, {cores} cores "
            "for every process",
            fontsize=11,
        )
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--collectors", default="1,4,16,32")
    p.add_argument("--trainers", default="1,2,4")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--out", default=os.path.join(HERE, "figures"))
    p.add_argument("--replot", action="store_true", help="run nothing: redraw from OUT/fleet_scaling.json")
    p.add_argument("extra", nargs="*", help="more fleet.py options, after --")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.replot:
        with open(os.path.join(a.out, "fleet_scaling.json")) as f:
            rows = json.load(f)
        plot(rows, os.path.join(a.out, "fleet_scaling.png"))
        print(markdown(rows))
        return
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
