"""Files to the GPU, side by side in one run (issue 18, "Measured, not assumed").

1. Ceilings: host -> GPU copies from pinned memory, pageable memory and a shared-memory ring
   page-locked in place (GPU only); page cache -> mapped slots with ``readinto`` in 1..N processes.
2. One DataLoader worker against a raw ``readinto`` of the same files in one process (single
   samples and dataset-side batches of 4; the consumer drops what it gets).
3. Files -> GPU at each worker count, no trainer work, for: the default path (pickle files,
   DataLoader batching, ``pin_memory``), ours without pinned slots (the pin thread copies each
   batch), ours with pinned slots (``pin_memory`` passes them through) and ours with ``device=``.
   GB/s, as a fraction of the N-process ``readinto`` ceiling, and the trainer thread's CPU per batch.
4. A trainer (a small CNN, repeated to about ``--step-ms`` per 29 MB batch, synchronising every
   step) as a fraction of the same loop over one batch already on the GPU, per path and worker count.
5. Lightning ``fit`` (the same CNN, 6 workers): samples/s as a fraction of the same fit over
   batches already in (pinned) RAM.

Every measurement prints one JSON line; a table follows. Without CUDA the GPU parts are skipped
and the loaders run to host memory, so the benchmark can be smoke-tested anywhere (``--quick``).
Run: python benchmarks/bench_gpu.py [--workers 2 6 8 12] [--samples 64] [--quick] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import shutil
import sys
import tempfile
import time
import warnings

import numpy as np
import torch
from bench_dataset import large, write_files  # the 7.2 MB trajectories, as storage and pickle files
from torch.utils.data import DataLoader, Dataset

from torch_storage_loader import StorageDataset
from torch_storage_loader._gpu import pinning as _pinning
from torch_storage_loader._shm.segments import ShmSegment, shm_dir

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda") if CUDA else None
ROWS: list[dict] = []
OUT = None


def emit(row: dict) -> dict:
    ROWS.append(row)
    line = json.dumps(row)
    print(line, flush=True)
    if OUT is not None:
        OUT.write(line + "\n")
        OUT.flush()
    return row


class PickleFiles(Dataset):
    """The baseline: unpickle each file, DataLoader batching and pinning."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        with open(self.paths[i], "rb") as f:
            return pickle.load(f)


def nbytes(batch) -> int:
    return sum(v.nbytes for v in batch.values())


# ------------------------------------------------------------------------------------ ceilings
def h2d(args) -> None:
    if not CUDA:
        emit({"section": "ceiling", "what": "host->GPU copies", "skipped": "no CUDA device"})
        return
    n = 4 * 7 * 1024 * 1024
    dst = torch.empty(n, dtype=torch.uint8, device=DEV)

    def rate(src: torch.Tensor, reps: int = 20) -> float:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        return n * reps / (time.perf_counter() - t) / 1e9

    pinned = torch.empty(n, dtype=torch.uint8).pin_memory()
    pageable = torch.empty(n, dtype=torch.uint8)
    pageable.fill_(1)
    seg = ShmSegment(256 << 20)
    ring = np.frombuffer(seg.mm, np.uint8)
    address = ring.ctypes.data
    from torch_storage_loader._gpu.cudart import host_register, host_unregister

    t = time.perf_counter()
    code, name = host_register(address, seg.size)
    reg_ms = (time.perf_counter() - t) * 1e3
    row = {
        "section": "ceiling",
        "what": "host->GPU copies",
        "pinned_gb_s": round(rate(pinned), 1),
        "pageable_gb_s": round(rate(pageable), 1),
        "bytes": n,
        "shm_ring_pageable_gb_s": None,
        "shm_ring_registered_gb_s": None,
        "register_256mb_ms": round(reg_ms, 1),
        "register_rc": code,
        "register_error": name,
    }
    src = torch.from_numpy(ring[:n])
    if code == 0:
        row["shm_ring_registered_gb_s"] = round(rate(src), 1)
        row["torch_sees_pinned"] = bool(src.is_pinned())
        host_unregister(address)
    row["shm_ring_pageable_gb_s"] = round(rate(src, reps=5), 1)
    del src, ring
    seg.close()
    emit(row)


def _reader(paths: list[str], slot: int, seconds: float, start, out) -> None:
    seg = ShmSegment(4 * slot)
    views = [memoryview(seg.mm)[k * slot : (k + 1) * slot] for k in range(4)]
    for k, p in enumerate(paths):  # warm up: buffers touched, files in the page cache
        with open(p, "rb", buffering=0) as f:
            f.readinto(views[k % 4])
    start.wait()
    total = k = 0
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        for p in paths:
            with open(p, "rb", buffering=0) as f:
                total += f.readinto(views[k % 4])
            k += 1
    out.put(total / (time.perf_counter() - t))
    del views
    seg.close()


def readinto_ceiling(paths: list[str], procs: int, seconds: float) -> float:
    """GB/s of ``procs`` processes reading the files (each its share, round and round, all at once)
    into 4 mapped slots each: what ``procs`` loader workers could do at best."""
    ctx = mp.get_context("fork")
    q, start = ctx.Queue(), ctx.Barrier(procs)
    slot = max(os.path.getsize(p) for p in paths)
    shares = [paths[i::procs] or paths[: 1 + i % len(paths)] for i in range(procs)]
    ps = [ctx.Process(target=_reader, args=(s, slot, seconds, start, q)) for s in shares]
    for p in ps:
        p.start()
    total = sum(q.get() for _ in ps)
    for p in ps:
        p.join()
    return total / 1e9


def raw_one(paths: list[str], rounds: int, slots: bool) -> float:
    """One process: ``readinto`` each file into one warm private buffer, or into 4 mapped slots in turn."""
    size = max(os.path.getsize(p) for p in paths)
    if slots:
        seg = ShmSegment(4 * size)
        bufs = [memoryview(seg.mm)[k * size : (k + 1) * size] for k in range(4)]
    else:
        seg, bufs = None, [memoryview(bytearray(size))]
    for k, p in enumerate(paths[: len(bufs)]):  # touch the buffers first
        with open(p, "rb", buffering=0) as f:
            f.readinto(bufs[k])
    n = k = 0
    t = time.perf_counter()
    for _ in range(rounds):
        for p in paths:
            with open(p, "rb", buffering=0) as f:
                n += f.readinto(bufs[k % len(bufs)])
            k += 1
    rate = n / (time.perf_counter() - t) / 1e9
    del bufs
    if seg is not None:
        seg.close()
    return rate


# ------------------------------------------------------------------------------- the loaders
def loader(kind: str, handles, pickles, workers: int, batch: int = 4):
    kw = dict(num_workers=workers, persistent_workers=workers > 0, prefetch_factor=2 if workers else None)
    if kind == "default":
        return DataLoader(PickleFiles(pickles), batch_size=batch, pin_memory=CUDA, **kw)
    if kind == "ours_pin_thread":
        return DataLoader(StorageDataset(handles, batch_size=batch), batch_size=None, pin_memory=CUDA, **kw)
    if kind == "ours_pinned":
        return DataLoader(StorageDataset(handles, batch_size=batch), batch_size=None, pin_memory=CUDA, **kw)
    if kind == "ours_device":
        return DataLoader(
            StorageDataset(handles, batch_size=batch, device="cuda" if CUDA else None), batch_size=None, **kw
        )
    raise ValueError(kind)


def set_pinning(kind: str) -> None:
    """Slot pinning off for the "as before" path (rings mapped from now on stay unpinned)."""
    _pinning._state.disabled = kind == "ours_pin_thread"


def to_gpu(batch):
    if not CUDA:
        return batch
    return {k: v.to(DEV, non_blocking=True) if v.device.type == "cpu" else v for k, v in batch.items()}


def stream(dl, epochs: int) -> dict:
    """Files -> GPU, no trainer work: GB/s and the trainer thread's CPU per batch."""
    for b in dl:  # warm-up: workers started, rings made (and registered)
        to_gpu(b)
    del b
    if CUDA:
        torch.cuda.synchronize()
    n = moved = 0
    cpu0, t0 = time.thread_time(), time.perf_counter()
    for _ in range(epochs):
        for b in dl:
            g = to_gpu(b)
            moved += nbytes(g)
            n += 1
            del b, g
    if CUDA:
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    return {
        "gb_s": round(moved / wall / 1e9, 2),
        "trainer_ms_per_batch": round(cpu / n * 1e3, 3),
        "trainer_busy": round(cpu / wall, 2),
        "batches": n,
        "pinned_bytes": _pinning.pinned_bytes(),
    }


# ------------------------------------------------------------------------------------ trainer
class CNN(torch.nn.Module):
    """The DQN network (Mnih et al. 2015) on 84x84x4 frames."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(4, 32, 8, 4),
            torch.nn.ReLU(),
            torch.nn.Conv2d(32, 64, 4, 2),
            torch.nn.ReLU(),
            torch.nn.Conv2d(64, 64, 3, 1),
            torch.nn.ReLU(),
            torch.nn.Flatten(),
            torch.nn.Linear(3136, 512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 6),
        )

    def forward(self, x):
        return self.net(x)


def make_step(repeats: int):
    model = CNN().to(DEV)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step(batch) -> float:
        x = batch["obs"].view(-1, 4, 84, 84)
        loss = None
        for _ in range(repeats):
            q = model(x)
            loss = (q.gather(1, batch["action"].view(-1, 1)).squeeze(1) - batch["reward"].view(-1)).pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return loss.item()  # the trainer looks at its loss every step (a synchronisation)

    return step


def calibrate(batch, target_ms: float) -> tuple[int, float]:
    step = make_step(1)
    for _ in range(5):
        step(batch)
    t = time.perf_counter()
    for _ in range(10):
        step(batch)
    one = (time.perf_counter() - t) / 10
    return max(1, round(target_ms / 1e3 / one)), one * 1e3


def train(dl, step, epochs: int) -> tuple[float, int]:
    for b in dl:
        step(to_gpu(b))
    del b
    n = 0
    t = time.perf_counter()
    for _ in range(epochs):
        for b in dl:
            step(to_gpu(b))
            n += 1
            del b
    return time.perf_counter() - t, n


def resident(batch, step, n: int) -> float:
    for _ in range(3):
        step(batch)
    t = time.perf_counter()
    for _ in range(n):
        step(batch)
    return time.perf_counter() - t


# ---------------------------------------------------------------------------------- lightning
def lightning_fits(handles, pickles, gpu_batch, repeats: int, steps: int, workers: int) -> None:
    import lightning.pytorch as pl

    from torch_storage_loader.lightning import StorageDataModule

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.cnn = CNN()

        def training_step(self, batch, i):
            x = batch["obs"].reshape(-1, 4, 84, 84)
            loss = 0
            for _ in range(repeats):
                q = self.cnn(x)
                loss = (
                    loss
                    + (q.gather(1, batch["action"].reshape(-1, 1)).squeeze(1) - batch["reward"].reshape(-1))
                    .pow(2)
                    .mean()
                )
            self.log("loss", loss)  # Lightning syncs it for the progress (as trainers do)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    class Clock(pl.Callback):
        skip = 10  # steps before the clock starts (workers started, caches warm)

        def __init__(self):
            self.seen = 0

        def on_train_batch_start(self, trainer, module, batch, i):
            self.seen += 1
            if self.seen == self.skip + 1:
                torch.cuda.synchronize()
                self.t0 = time.perf_counter()

        def on_train_end(self, trainer, module):
            torch.cuda.synchronize()
            self.wall = time.perf_counter() - self.t0

    cpu_batch = {k: v.cpu().pin_memory() for k, v in gpu_batch.items()}

    class InRam(torch.utils.data.IterableDataset):
        def __iter__(self):
            for _ in range(steps + 5):
                yield cpu_batch

    def fit(name, **data):
        from lightning.fabric.plugins.environments import LightningEnvironment

        clock = Clock()
        trainer = pl.Trainer(
            accelerator="gpu",
            devices=1,
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[clock],
            default_root_dir=tempfile.gettempdir(),
            plugins=[LightningEnvironment()],
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(Model(), **data)
        return (steps - clock.skip) * 4 / clock.wall

    base = fit("in_ram", train_dataloaders=DataLoader(InRam(), batch_size=None, num_workers=0))
    rows = {"in_ram_samples_s": round(base, 1)}
    set_pinning("ours_pinned")
    dm = StorageDataModule(handles, batch_size=4, num_workers=workers, device="cuda")
    rows["ours_device"] = round(fit("ours_device", datamodule=dm) / base, 3)
    dm = StorageDataModule(handles, batch_size=4, num_workers=workers, pin_memory=True)
    rows["ours_pinned"] = round(fit("ours_pinned", datamodule=dm) / base, 3)
    set_pinning("ours_pin_thread")
    dm = StorageDataModule(handles, batch_size=4, num_workers=workers, pin_memory=True)
    rows["ours_pin_thread"] = round(fit("ours_pin_thread", datamodule=dm) / base, 3)
    set_pinning("ours_pinned")
    dl = DataLoader(PickleFiles(pickles), batch_size=4, num_workers=workers, pin_memory=True, persistent_workers=True)
    rows["default"] = round(fit("default", train_dataloaders=dl) / base, 3)
    emit({"section": "lightning", "workers": workers, "steps": steps, "fraction_of_in_ram": rows})


# ----------------------------------------------------------------------------------------- main
def table() -> str:
    lines = ["", "| what | figure |", "| --- | --- |"]
    for r in ROWS:
        s = r["section"]
        if s == "ceiling" and "pinned_gb_s" in r:
            lines.append(
                f"| host->GPU pinned / pageable / shm ring pageable / shm ring registered | {r['pinned_gb_s']} / "
                f"{r['pageable_gb_s']} / {r['shm_ring_pageable_gb_s']} / {r['shm_ring_registered_gb_s']} GB/s; "
                f"registering 256 MB: {r['register_256mb_ms']} ms (rc {r['register_rc']}) |"
            )
        elif s == "ceiling" and "readinto_gb_s" in r:
            lines.append(
                f"| page cache -> mapped slots, readinto, {r['procs']} processes | {r['readinto_gb_s']} GB/s |"
            )
        elif s == "one_worker":
            lines.append(
                f"| one worker, {r['batch']}: ours / raw readinto (warm buffer; 4 mapped slots) | "
                f"{r['ours_gb_s']} / {r['raw_gb_s']}; {r['raw_slots_gb_s']} GB/s = "
                f"{r['ratio']}; {r['ratio_slots']} |"
            )
        elif s == "files_to_gpu":
            lines.append(
                f"| files->{'GPU' if CUDA else 'host'}, {r['path']}, {r['workers']} workers | {r['gb_s']} GB/s "
                f"({r['of_ceiling']} of the readinto ceiling), trainer thread {r['trainer_ms_per_batch']} "
                f"ms/batch, trainer fraction {r.get('trainer_fraction', '-')} |"
            )
        elif s == "trainer_calibration":
            lines.append(
                f"| trainer: CNN step x{r['repeats']}, resident loop | {r['resident_ms_per_batch']} ms per batch |"
            )
        elif s == "error":
            lines.append(f"| error in {r.get('in') or (r.get('path'), r.get('workers'))} | {r['error'][:200]} |")
        elif "skipped" in r:
            lines.append(f"| {s} | skipped: {r['skipped']} |")
        elif s == "lightning":
            f = r["fraction_of_in_ram"]
            lines.append(
                f"| Lightning fit, {r['workers']} workers, fraction of in-RAM ({f['in_ram_samples_s']} samples/s): "
                f"device= / pinned slots / pin thread / default | {f['ours_device']} / {f['ours_pinned']} / "
                f"{f['ours_pin_thread']} / {f['default']} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 6, 8, 12])
    ap.add_argument("--samples", type=int, default=64, help="7.2 MB trajectories (files)")
    ap.add_argument("--epochs", type=int, default=4, help="timed epochs per files->GPU run")
    ap.add_argument("--train-epochs", type=int, default=2, help="timed epochs per trainer run")
    ap.add_argument("--step-ms", type=float, default=9.0, help="the trainer's time per batch, resident")
    ap.add_argument("--fit-steps", type=int, default=100)
    ap.add_argument("--fit-workers", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=1.0, help="per readinto ceiling")
    ap.add_argument("--only", nargs="+", default=None, choices=["ceilings", "one_worker", "files_to_gpu", "lightning"])
    ap.add_argument("--quick", action="store_true", help="a smoke test: few files, short runs")
    ap.add_argument("--json-out", default=None, help="also append the JSON lines to this file")
    args = ap.parse_args(argv)
    if args.quick:
        args.samples, args.epochs, args.train_epochs, args.seconds, args.fit_steps = 16, 1, 1, 0.3, 15
        args.workers = [w for w in args.workers if w <= 2] or [2]
    if args.json_out:
        OUT = open(args.json_out, "a")  # noqa: SIM115 -- the JSON lines file stays open for the whole run
    only = set(args.only or ["ceilings", "one_worker", "files_to_gpu", "lightning"])
    torch.set_num_threads(1)
    st = os.statvfs(shm_dir())
    emit(
        {
            "section": "machine",
            "cuda": CUDA,
            "device": torch.cuda.get_device_name() if CUDA else None,
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "shm_dir": shm_dir(),
            "shm_gb": round(st.f_blocks * st.f_frsize / 1e9, 1),
            "python": sys.version.split()[0],
            "memlock": _memlock(),
        }
    )
    workdir = tempfile.mkdtemp(prefix="tsl-bench-gpu-")
    try:
        handles, pickles = write_files(workdir, large, args.samples)
        paths = [h.path for h in handles]
        raw_one(paths, 1, False)  # the page cache holds them all
        ceiling: dict[int, float] = {}
        if "ceilings" in only or "files_to_gpu" in only:
            for procs in sorted({1, *args.workers}):
                ceiling[procs] = readinto_ceiling(paths, procs, args.seconds)
                emit({"section": "ceiling", "procs": procs, "readinto_gb_s": round(ceiling[procs], 2)})
        if "ceilings" in only:
            h2d(args)
        if "one_worker" in only:
            guarded(one_worker, handles, paths, args)
        if "files_to_gpu" in only:
            guarded(files_to_gpu, handles, pickles, args, ceiling)
        if "lightning" in only:
            if CUDA:
                gpu_batch = to_gpu(next(iter(DataLoader(StorageDataset(handles[:4], batch_size=4), batch_size=None))))
                repeats, _ = calibrate(gpu_batch, args.step_ms)
                guarded(lightning_fits, handles, pickles, gpu_batch, repeats, args.fit_steps, args.fit_workers)
            else:
                emit({"section": "lightning", "skipped": "no CUDA device"})
    finally:
        shutil.rmtree(workdir)
    print(table(), flush=True)
    if OUT is not None:
        OUT.close()


def guarded(section, *args) -> None:
    try:
        section(*args)
    except Exception as exc:  # noqa: BLE001 -- one failed section is reported and the others still run
        import traceback

        traceback.print_exc()
        emit({"section": "error", "in": section.__name__, "error": f"{type(exc).__name__}: {exc}"})


def _memlock() -> str:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else str(soft)


def one_worker(handles, paths, args) -> None:
    for batch in (None, 4):
        ds = StorageDataset(handles, batch_size=batch)
        dl = DataLoader(ds, batch_size=None, num_workers=1, persistent_workers=True, prefetch_factor=4)
        ours, raw, raw_slots = [], [], []
        for b in dl:  # noqa: B007 -- warm-up epoch; the last batch is dropped below
            pass
        del b
        for _ in range(3):  # interleaved: noise hits all three
            n = 0
            t = time.perf_counter()
            for _ in range(args.epochs):
                for b in dl:
                    n += nbytes(b)
                    del b
            ours.append(n / (time.perf_counter() - t) / 1e9)
            raw.append(raw_one(paths, args.epochs, False))
            raw_slots.append(raw_one(paths, args.epochs, True))
        del dl
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        emit(
            {
                "section": "one_worker",
                "batch": "single samples" if batch is None else f"batches of {batch}",
                "ours_gb_s": round(med(ours), 2),
                "raw_gb_s": round(med(raw), 2),
                "raw_slots_gb_s": round(med(raw_slots), 2),
                "ratio": round(med(ours) / med(raw), 2),
                "ratio_slots": round(med(ours) / med(raw_slots), 2),
            }
        )


def files_to_gpu(handles, pickles, args, ceiling) -> None:
    step = resident_s = None
    if CUDA:
        gpu_batch = to_gpu(next(iter(DataLoader(StorageDataset(handles[:4], batch_size=4), batch_size=None))))
        repeats, one_ms = calibrate(gpu_batch, args.step_ms)
        step = make_step(repeats)
        n = args.train_epochs * (len(handles) // 4)
        resident_s = resident(gpu_batch, step, n) / n
        emit(
            {
                "section": "trainer_calibration",
                "repeats": repeats,
                "one_step_ms": round(one_ms, 2),
                "resident_ms_per_batch": round(resident_s * 1e3, 2),
            }
        )
        del gpu_batch
    for workers in args.workers:
        for kind in ("default", "ours_pin_thread", "ours_pinned", "ours_device"):
            set_pinning(kind)
            dl = None
            try:
                dl = loader(kind, handles, pickles, workers)
                row = {"section": "files_to_gpu", "path": kind, "workers": workers, **stream(dl, args.epochs)}
                row["of_ceiling"] = round(row["gb_s"] / ceiling[workers], 2) if workers in ceiling else None
                if step is not None:
                    wall, n = train(dl, step, args.train_epochs)
                    row["trainer_fraction"] = round(resident_s * n / wall, 3)
                emit(row)
            except Exception as exc:  # noqa: BLE001 -- one failed run (say, /dev/shm too small) does not stop the others
                emit({"section": "error", "path": kind, "workers": workers, "error": f"{type(exc).__name__}: {exc}"})
            del dl
            set_pinning("ours_pinned")


if __name__ == "__main__":
    main()
