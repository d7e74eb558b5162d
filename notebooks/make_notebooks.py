"""Writes quickstart.ipynb and benchmark.ipynb (then run: python notebooks/make_notebooks.py --execute)."""

from __future__ import annotations

import argparse
import os

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = os.path.dirname(os.path.abspath(__file__))

SETUP = """\
import multiprocessing as mp
import os
import tempfile

# Tests run this notebook with TSL_START_METHOD=fork and =spawn; by default the kernel's own is kept.
if os.environ.get("TSL_START_METHOD"):
    mp.set_start_method(os.environ["TSL_START_METHOD"], force=True)
SMALL = bool(os.environ.get("TSL_NOTEBOOK_SMALL"))
print("start method:", mp.get_start_method(), "| small run:", SMALL)"""

QUICKSTART = [
    new_markdown_cell(
        "# torch_storage_loader: quick start\n\nProducers save samples and pass tiny handles on; "
        "trainers load them asynchronously, through shared-memory slots that are reused instead of "
        "reallocated. This notebook saves and loads with callbacks, feeds a `DataLoader`, and fits a "
        "Lightning model."
    ),
    new_code_cell(SETUP),
    new_markdown_cell(
        "## Save and load with callbacks\n\n`save` writes one file atomically and returns a small, "
        "picklable handle. `load` returns at once; the callback runs on the loader's receiving thread "
        "once a worker process has read the file into a shared-memory slot."
    ),
    new_code_cell("""\
import threading
import numpy as np
import torch
from torch_storage_loader import FileStorageLoader

workdir = tempfile.mkdtemp(prefix="tsl-notebook-")
steps = 8 if SMALL else 64

def trajectory(i):
    return {"obs": np.full((steps, 4, 84, 84), i, np.float32), "action": torch.full((steps,), i),
            "reward": np.ones(steps, np.float32), "done": np.arange(steps) == steps - 1}

got, done = [], threading.Semaphore(0)
def callback(sample):
    got.append(sample)   # keeping samples is safe: their slot is never reused while they live
    done.release()

loader = FileStorageLoader(os.path.join(workdir, "files"), worker_num=2, mp_context=mp.get_start_method())
handles = [loader.save(trajectory(i)) for i in range(8)]
for h in handles:
    loader.load(h, callback)
for _ in handles:
    done.acquire()
print(sorted(int(s["action"][0]) for s in got))
print(loader.stats())"""),
    new_markdown_cell(
        "`load_async` returns a `Future` instead. Errors (a missing or damaged file) arrive there, "
        "named by path, and the loader keeps serving."
    ),
    new_code_cell("""\
from torch_storage_loader import FileStorage
print(loader.load_async(handles[0]).result()["obs"].shape)
err = loader.load_async(FileStorage(os.path.join(workdir, "missing.tsl"))).exception()
print(type(err).__name__, "-", str(err)[:90], "...")
loader.shutdown()"""),
    new_markdown_cell(
        "## `DataLoader(StorageDataset(...))`\n\nA `StorageDataset` iterates over handles (a list, "
        "a `StorageQueue`, a queue, or a directory). In DataLoader workers each sample goes into the "
        "worker's shared-memory slots; only a small reference crosses the result queue. With "
        "`batch_size` the dataset stacks samples straight into one slot, so use the DataLoader with "
        "`batch_size=None`."
    ),
    new_code_cell("""\
from torch.utils.data import DataLoader
from torch_storage_loader import StorageDataset

files = os.path.join(workdir, "dataset")
os.makedirs(files)
handles = []
for i in range(16):
    h = FileStorage(os.path.join(files, f"{i}.tsl"))
    h.save(trajectory(i))
    handles.append(h)

dataset = StorageDataset(handles, batch_size=4)
for batch in DataLoader(dataset, batch_size=None, num_workers=2):
    print(batch["obs"].shape, batch["action"][:, 0].tolist())
print(dataset.stats())"""),
    new_markdown_cell(
        "## Fit with Lightning\n\n`StorageDataModule` wraps the same dataset for `Trainer.fit`; "
        "`StorageStatsCallback` logs the loader's figures next to the loss."
    ),
    new_code_cell("""\
import logging
import warnings
import lightning.pytorch as pl
from torch_storage_loader.lightning import StorageDataModule, StorageStatsCallback

logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
warnings.filterwarnings("ignore", message=".*(does not have many workers|set_vital|LeafSpec).*")

class RewardModel(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 8, stride=8), torch.nn.Flatten(), torch.nn.LazyLinear(1))
    def training_step(self, batch, batch_idx):
        obs = batch["obs"].flatten(0, 1) / 16
        loss = torch.nn.functional.mse_loss(self.net(obs).squeeze(-1), batch["reward"].flatten())
        self.log("loss", loss, batch_size=obs.shape[0])
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)

stats = StorageStatsCallback()
datamodule = StorageDataModule(handles, batch_size=4, num_workers=2)
trainer = pl.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=[stats])
trainer.fit(RewardModel(), datamodule=datamodule)
datamodule.teardown("fit")
print({k: round(float(v), 4) for k, v in trainer.logged_metrics.items()})"""),
    new_code_cell("""\
import shutil
shutil.rmtree(workdir)"""),
]

BENCHMARK = [
    new_markdown_cell(
        "# Throughput: the default DataLoader path against `StorageDataset`\n\nThe same files "
        "through (a) a plain `IterableDataset` that loads each file in the worker and lets the "
        "DataLoader ship the tensors, and (b) `StorageDataset`, across sample sizes and worker "
        "counts. Each point is a steady-state epoch after a warm-up epoch; the consumer reads every "
        "tensor. Figures are from the machine that ran the notebook (2 cores when committed)."
    ),
    new_code_cell(SETUP),
    new_code_cell("""\
import time
import numpy as np
import torch
from torch.utils.data import DataLoader
from torch_storage_loader import FileStorage, StorageDataset

torch.set_num_threads(1)  # leave the other core to the loading workers, as a tuned trainer would

# The baseline: load each file in the worker, let the DataLoader ship the tensors. It lives in a
# module (not in this notebook) so that spawned workers can import it.
from torch_storage_loader.demo import PlainFileDataset

def epoch_rate(loader):
    for batch in loader:   # warm-up epoch
        pass
    del batch
    n, t0 = 0, time.perf_counter()
    for batch in loader:
        for t in batch.values():
            t.sum()
        n += 1
    return n / (time.perf_counter() - t0)

sizes_kb = [16, 256, 4096] if SMALL else [16, 256, 1024, 4096, 16384, 32768]
workers = [1, 2]
workdir = tempfile.mkdtemp(prefix="tsl-bench-")
rows = []
for kb in sizes_kb:
    count = 12 if SMALL else max(8, min(48, (512 * 1024) // kb))  # at most about 512 MB of files per size
    paths = []
    for i in range(count):
        p = os.path.join(workdir, f"{kb}-{i}.tsl")
        FileStorage(p).save({"obs": np.random.default_rng(i).random(kb * 256, dtype=np.float32),
                             "action": np.int64(i)})
        paths.append(p)
    for nw in workers:
        kw = dict(batch_size=None, num_workers=nw, persistent_workers=True)
        default = epoch_rate(DataLoader(PlainFileDataset(paths), **kw))
        ours = epoch_rate(DataLoader(StorageDataset([FileStorage(p) for p in paths]), **kw))
        rows.append({"sample_kb": kb, "workers": nw, "default_samples_s": round(default, 1),
                     "storage_dataset_samples_s": round(ours, 1), "speedup": round(ours / default, 2)})
    for p in paths:
        os.remove(p)
os.rmdir(workdir)"""),
    new_code_cell("""\
header = f"{'sample':>9} {'workers':>8} {'default/s':>10} {'StorageDataset/s':>17} {'speedup':>8}"
print(header)
for r in rows:
    print(f"{r['sample_kb']:>7}KB {r['workers']:>8} {r['default_samples_s']:>10} "
          f"{r['storage_dataset_samples_s']:>17} {r['speedup']:>8}")"""),
    new_code_cell("""\
%matplotlib inline
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(7, 4))
for nw, style in zip(workers, ["-", "--"]):
    sel = [r for r in rows if r["workers"] == nw]
    mb = [r["sample_kb"] / 1024 for r in sel]
    ax.plot(mb, [r["default_samples_s"] * r["sample_kb"] / 1024 for r in sel], "o" + style, color="tab:gray",
            label=f"default path, {nw} worker(s)")
    ax.plot(mb, [r["storage_dataset_samples_s"] * r["sample_kb"] / 1024 for r in sel], "o" + style,
            color="tab:blue", label=f"StorageDataset, {nw} worker(s)")
ax.set_xscale("log"); ax.set_yscale("log")
ax.set_xlabel("sample size (MB)"); ax.set_ylabel("throughput (MB/s)")
ax.legend(); ax.grid(True, which="both", alpha=0.3)
plt.show()"""),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--execute", action="store_true", help="run them and store the outputs")
    args = ap.parse_args()
    for name, cells in (("quickstart", QUICKSTART), ("benchmark", BENCHMARK)):
        nb = new_notebook(
            cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
        )
        path = os.path.join(HERE, f"{name}.ipynb")
        if args.execute:
            from nbclient import NotebookClient

            NotebookClient(nb, timeout=1200, kernel_name="python3", resources={"metadata": {"path": HERE}}).execute()
        nbformat.write(nb, path)
        print("wrote", path)


if __name__ == "__main__":
    main()
