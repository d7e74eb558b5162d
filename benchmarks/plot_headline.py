"""The headline figures of docs/benchmarks.md as a bar chart, drawn from the measured table, never by hand.

    python benchmarks/plot_headline.py [--table docs/benchmarks.md] [--out benchmarks/figures/headline.png]

Reads the rows of the "Measured on a 2-core machine" table that ``benchmarks/bench_dataset.py``'s runs
filled in: "StorageDataset vs default DataLoader path, 2 workers" (throughput, ``7x (large), 32x
(...)``) and "trainer burning 20 ms per batch: fraction of ideal time" (``0.90 (StorageDataset) vs 0.66
(default path)``), and draws each beside the default DataLoader. Change the table (after a new run of
the benchmark), run this again: the plot follows. Fails if a row is missing or its figures do not parse.
"""

from __future__ import annotations

import argparse
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
THROUGHPUT_ROW = "StorageDataset vs default DataLoader path, 2 workers"
TRAINER_ROW = "trainer burning 20 ms per batch: fraction of ideal time"


def table_row(markdown: str, label: str) -> str:
    """The figure column of the table row whose first column starts with ``label``."""
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith(label):
            return cells[1]
    raise SystemExit(f"no row {label!r} in the table")


def headline(markdown: str) -> dict:
    throughput = re.fullmatch(r"([\d.]+)x \(large\), ([\d.]+)x \((.+)\)", table_row(markdown, THROUGHPUT_ROW))
    trainer = re.fullmatch(
        r"([\d.]+) \(StorageDataset\) vs ([\d.]+) \(default path\)", table_row(markdown, TRAINER_ROW)
    )
    if not throughput or not trainer:
        raise SystemExit("the headline rows of the table no longer read as expected: update this script")
    return {
        "throughput": {"7.2 MB samples": float(throughput[1]), throughput[3]: float(throughput[2])},
        "trainer": {"StorageDataset": float(trainer[1]), "default DataLoader": float(trainer[2])},
    }


def plot(figures: dict, out: str, source: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    default, ours = "#9e9e9e", "#3f51b5"
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8), gridspec_kw={"width_ratios": [2, 1]})
    workloads = list(figures["throughput"])
    for i, name in enumerate(workloads):
        ratio = figures["throughput"][name]
        left.bar(i - 0.2, 1.0, 0.4, color=default, label="default DataLoader" if i == 0 else None)
        left.bar(i + 0.2, ratio, 0.4, color=ours, label="StorageDataset" if i == 0 else None)
        left.text(i + 0.2, ratio, f"{ratio:g}x", ha="center", va="bottom")
        left.text(i - 0.2, 1.0, "1x", ha="center", va="bottom")
    left.set_xticks(range(len(workloads)), [name.replace(" of ", "\nof ") for name in workloads])
    left.set_ylabel("throughput, x the default DataLoader")
    left.set_title("2 DataLoader workers")
    left.legend(loc="upper left", frameon=False)
    names = list(figures["trainer"])[::-1]  # the default first, as on the left
    values = [figures["trainer"][n] for n in names]
    right.bar(range(2), values, 0.6, color=[default, ours])
    for i, value in enumerate(values):
        right.text(i, value, f"{value:.2f}", ha="center", va="bottom")
    right.set_xticks(range(2), [n.replace(" ", "\n", 1) for n in names])
    right.set_ylim(0, 1.1)
    right.set_ylabel("fraction of the ideal time")
    right.set_title("trainer burning 20 ms a batch")
    for ax in (left, right):
        ax.spines[["top", "right"]].set_visible(False)
    fig.text(0.01, 0.01, f"Measured side by side on a 2-core machine; figures read from {source}.", fontsize=8)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", default=os.path.join(ROOT, "docs", "benchmarks.md"))
    parser.add_argument("--out", default=os.path.join(HERE, "figures", "headline.png"))
    args = parser.parse_args()
    with open(args.table, encoding="utf-8") as f:
        figures = headline(f.read())
    source = os.path.relpath(args.table, ROOT) + " (bench_dataset.py runs)"
    plot(figures, args.out, source)
    print(f"{args.out}: {figures}")


if __name__ == "__main__":
    main()
