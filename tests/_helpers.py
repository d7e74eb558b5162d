"""Storage types for tests; a module of their own so that spawned workers can import them."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

import numpy as np

from torch_storage_loader import Storage


class MemoryStorage(Storage):
    """Holds its sample in the handle: exercises the generic (non-file) worker path."""

    def __init__(self, value, tag: str = "mem") -> None:
        super().__init__(tag)
        self.value = value

    def save(self, data) -> None:
        self.value = data

    def load(self):
        return self.value


def _unpickle_outside_workers(value):
    """A handle's unpickling that fails in a DataLoader worker (its class, say, not importable there)."""
    from torch.utils.data import get_worker_info

    if get_worker_info() is not None:
        raise ImportError("No module named 'collector_only_module'")
    return WorkerFails(value)


class WorkerFails(MemoryStorage):
    """A handle that pickles fine and fails to unpickle in a DataLoader worker."""

    def __reduce__(self):
        return _unpickle_outside_workers, (self.value,)


class SleepStorage(Storage):
    def __init__(self, seconds: float, tag: str = "sleep") -> None:
        super().__init__(tag)
        self.seconds = seconds

    def save(self, data) -> None:
        raise NotImplementedError

    def load(self):
        time.sleep(self.seconds)
        return {"slept": np.array([self.seconds])}


class KillStorage(Storage):
    """Kills the worker that loads it; with ``marker``, only the first time."""

    def __init__(self, marker: str | None) -> None:
        super().__init__(marker or "always")
        self.marker = marker

    def save(self, data) -> None:
        raise NotImplementedError

    def load(self):
        if self.marker is None or not os.path.exists(self.marker):
            if self.marker is not None:
                open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return {"survived": np.array([1])}


def produce(queue, directory: str, start: int, count: int) -> None:
    """A producer process: save trajectories and put their handles on a StorageQueue."""
    from conftest import traj

    from torch_storage_loader import FileStorageLoader

    loader = FileStorageLoader(directory, ttl=None)
    with queue.producer():
        for i in range(start, start + count):
            queue.put(loader.save(traj(i)))
    loader.shutdown()


def start_producers(queue, root, count: int, n: int = 2) -> list:
    """Start ``n`` spawned producers; producer k puts ids 100k .. 100k+count-1."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=produce, args=(queue, os.path.join(str(root), f"p{k}"), 100 * k, count)) for k in range(n)
    ]
    for p in procs:
        p.start()
    return procs


def produce_then_die(queue, directory: str) -> None:
    from conftest import traj

    from torch_storage_loader import FileStorageLoader

    loader = FileStorageLoader(directory, ttl=None)
    with queue.producer():
        queue.put(loader.save(traj(0)))
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)


def produce_into_directory(directory: str, start: int, count: int) -> None:
    from conftest import traj

    from torch_storage_loader import FileStorageLoader

    with FileStorageLoader(directory, ttl=None) as loader:
        for i in range(start, start + count):
            loader.save(traj(i))
            time.sleep(0.01)


def consume_directory(directory: str, out) -> None:
    """Another consumer process of a directory source; puts the ids it loaded on ``out``."""
    from torch.utils.data import DataLoader

    from torch_storage_loader import StorageDataset

    ids = [int(s["info"]["id"]) for s in DataLoader(StorageDataset(directory), batch_size=None, num_workers=1)]
    out.put(ids)


def consume_queue(queue, out, ready) -> None:
    """A consumer process of a StorageQueue: says it is waiting, then puts the paths it took on ``out``."""
    ready.set()
    out.put([s.path for s in queue])


def consume_and_block(directory: str, ready) -> None:
    """A trainer process that takes five samples of a directory source, then hangs (to be killed)."""
    from torch.utils.data import DataLoader

    from torch_storage_loader import StorageDataset

    it = iter(DataLoader(StorageDataset(directory), batch_size=None, num_workers=2))
    for _ in range(5):
        next(it)
    ready.set()
    time.sleep(600)


def consume_redis_and_block(queue, n: int, out, ready) -> None:
    """A trainer process that takes ``n`` samples from a RedisStorageQueue, reports them, then hangs."""
    from torch.utils.data import DataLoader

    from torch_storage_loader import StorageDataset

    it = iter(DataLoader(StorageDataset(queue), batch_size=None, num_workers=2))
    out.put([int(next(it)["info"]["id"]) for _ in range(n)])
    ready.set()
    time.sleep(600)


def _report(out, item) -> None:
    """Put ``item`` on ``out`` and wait until it is in the pipe.

    A rank reports before ``destroy_process_group``, which now and then hangs in torch's teardown
    (pytorch/pytorch#75097): the parent then kills the rank, and a report still in the queue's
    feeder thread would be lost with it, failing the test as a hang of ours.
    """
    out.put(item)
    out.close()
    out.join_thread()


def ddp_rank(rank: int, world: int, init_file: str, handles, out) -> None:
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from torch_storage_loader import StorageDataset

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        dl = DataLoader(StorageDataset(handles), batch_size=None, num_workers=2, multiprocessing_context="spawn")
        _report(out, (rank, [int(s["info"]["id"]) for s in dl]))
    finally:
        dist.destroy_process_group()


import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402


class Tiny(pl.LightningModule):
    """A small model that regresses reward from obs, recording the sample ids it trains on."""

    def __init__(self, record_dir: str | None = None, fail_at: int | None = None):
        super().__init__()
        self.net = torch.nn.Linear(4 * 8 * 8, 1)
        self.seen: list[int] = []
        self.record_dir, self.fail_at = record_dir, fail_at

    def training_step(self, batch, batch_idx):
        if self.fail_at is not None and batch_idx == self.fail_at:
            raise ValueError("boom in training_step")
        obs = batch["obs"].reshape(*batch["obs"].shape[:-3], -1)
        loss = torch.nn.functional.mse_loss(self.net(obs).squeeze(-1), batch["reward"])
        ids = batch["info"]["id"]
        self.seen += ids.tolist() if isinstance(ids, torch.Tensor) else [int(ids)]
        self.log("loss", loss)
        return loss

    def on_train_end(self):
        if self.record_dir is not None:
            with open(os.path.join(self.record_dir, f"rank{self.global_rank}.txt"), "w") as f:
                f.write(" ".join(map(str, self.seen)))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def tiny_model(record_dir: str | None = None, fail_at: int | None = None) -> Tiny:
    return Tiny(record_dir, fail_at)


class EpisodeMissing(LookupError):
    """A user Storage's own exception type."""


class RaisingStorage(Storage):
    """Raises its own exception type in the worker."""

    def save(self, data) -> None:
        raise NotImplementedError

    def load(self):
        raise EpisodeMissing(f"episode {self.path} is gone from the replay buffer")


def ddp_train_rank(rank: int, world: int, init_file: str, handles, options: dict, out) -> None:
    """A DDP (gloo) rank training a tiny model one step per batch; puts (rank, report) on ``out``.

    ``options``: dataset keywords (``batch_size``, ``drop_last``, ``shuffle``, ``seed``) and
    ``num_workers``, ``persistent_workers``, ``epochs``, ``set_epoch``. A rank that fails (a
    process-group timeout, say) reports ``{"error": ...}`` instead of hanging its parent.
    """
    import datetime
    import traceback
    import warnings

    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from torch_storage_loader import StorageDataset

    opts = dict(options)
    num_workers, epochs = opts.pop("num_workers", 0), opts.pop("epochs", 1)
    persistent, call_set_epoch = opts.pop("persistent_workers", False), opts.pop("set_epoch", False)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30)
    )
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4 * 8 * 8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        ds = StorageDataset(handles, **opts)
        dl = DataLoader(
            ds,
            batch_size=None,
            num_workers=num_workers,
            persistent_workers=persistent,
            multiprocessing_context="fork" if num_workers else None,
        )
        report = {"len": len(dl), "padded": ds.stats()["padded"], "epochs": [], "warnings": []}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for epoch in range(epochs):
                if call_set_epoch:
                    ds.set_epoch(epoch)
                ids = []
                for b in dl:
                    obs = b["obs"].reshape(*b["obs"].shape[:-3], -1)
                    loss = torch.nn.functional.mse_loss(model(obs).squeeze(-1), b["reward"])
                    opt.zero_grad()
                    loss.backward()  # DDP all-reduces the gradients: ranks must take the same steps
                    opt.step()
                    i = b["info"]["id"]
                    ids.append(i.tolist() if isinstance(i, torch.Tensor) else [int(i)])
                report["epochs"].append(ids)
        report["warnings"] = [str(w.message) for w in caught if "IterableDataset" in str(w.message)]
        del dl
        _report(out, (rank, report))
    except BaseException:  # noqa: BLE001 -- the child reports any failure to the parent test
        _report(out, (rank, {"error": traceback.format_exc()}))
    finally:
        dist.destroy_process_group()


def run_ranks(target, world: int, init_file: str, *args, timeout: float = 240) -> dict:
    """Run ``target(rank, world, init_file, *args, out)`` in ``world`` spawned processes; their reports.

    Joins with a timeout and kills what is left, so a hung rank fails the test instead of hanging it.
    """
    import multiprocessing as mp
    import queue as _queue

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, init_file, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world:
            rank, report = out.get(timeout=max(1.0, deadline - time.monotonic()))
            got[rank] = report
    except _queue.Empty:
        pass
    finally:
        if len(got) == world:  # all reported: a rank still in torch's teardown gets a minute
            deadline = min(deadline, time.monotonic() + 60)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
    assert len(got) == world, f"ranks {sorted(set(range(world)) - set(got))} never reported (hung?)"
    for rank, report in got.items():
        assert "error" not in report, f"rank {rank} failed:\n{report['error']}"
    return got


def len_rank(rank: int, world: int, init_file: str, handles, out) -> None:
    """A rank checking ``len`` against what it yields, for batch_size x drop_last x num_workers."""
    import itertools
    import traceback
    import warnings

    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from torch_storage_loader import StorageDataset

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        rows = []
        for batch_size, drop_last, num_workers in itertools.product([None, 2, 3], [False, True], [0, 1, 3]):
            ds = StorageDataset(handles, batch_size=batch_size, drop_last=drop_last, shuffle=True, seed=5)
            dl = DataLoader(
                ds, batch_size=None, num_workers=num_workers, multiprocessing_context="fork" if num_workers else None
            )
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # torch warns when more than len(dl) items come
                warnings.filterwarnings("ignore", "This DataLoader will create 3 worker processes")  # 2 cores
                n = len(dl)
                items = list(dl)
            ids = [i for b in items for i in (b["info"]["id"].tolist() if batch_size else [int(b["info"]["id"])])]
            rows.append(
                {
                    "batch_size": batch_size,
                    "drop_last": drop_last,
                    "num_workers": num_workers,
                    "len": n,
                    "len_ds": len(ds),
                    "yielded": len(items),
                    "ids": ids,
                }
            )
            del items, dl
        _report(out, (rank, {"rows": rows}))
    except BaseException:  # noqa: BLE001 -- the child reports any failure to the parent test
        _report(out, (rank, {"error": traceback.format_exc()}))
    finally:
        dist.destroy_process_group()


class TinyCounting(Tiny):
    """``Tiny`` that also records, per rank, Lightning's ``num_training_batches`` and its steps."""

    def on_train_end(self):
        super().on_train_end()
        if self.record_dir is not None:
            with open(os.path.join(self.record_dir, f"rank{self.global_rank}.batches"), "w") as f:
                f.write(f"{self.trainer.num_training_batches} {self.trainer.global_step}")


def lock_free(lock) -> bool:
    """Whether another thread can take ``lock`` (an RLock is re-entered by its own thread)."""
    import threading

    got = []

    def take():
        ok = lock.acquire(timeout=2)
        if ok:
            lock.release()
        got.append(ok)

    t = threading.Thread(target=take)
    t.start()
    t.join()
    return got[0]


def run_script(
    source: str, cwd, *, timeout: float = 120, env: dict | None = None, args: tuple = (), python_args: tuple = ()
):
    """Run ``source`` the way a user runs an example: saved as ``example.py`` and started with
    ``python example.py`` in ``cwd`` (its own session, so a hang is killed with every process it
    started). ``python_args`` go to the interpreter (``-W error``), ``args`` to the script. Returns the
    ``subprocess.CompletedProcess``; a run past ``timeout`` seconds is a test failure that shows what
    the script printed so far.
    """
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    path = Path(cwd) / "example.py"
    path.write_text(source)
    proc = subprocess.Popen(
        [sys.executable, *python_args, str(path), *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"example.py still ran after {timeout} s (a hang):\n--- stdout\n{out}\n--- stderr\n{err[-4000:]}")
    kill_session(proc.pid)  # whatever the script started and left behind is a leak of the example's
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def session_processes(sid: int) -> dict[int, str]:
    """pid -> command line of each live process in session ``sid``."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # field 6 of stat: the session
            out[int(pid)] = cmdline
    return out


def kill_session(sid: int) -> None:
    """SIGKILL what is left of a script's session, multiprocessing's resource trackers last: a
    tracker unlinks the named semaphores (``/dev/shm/sem.mp-*``) of the processes killed here once
    the last of them is gone, and killed with them it would leave those files for ever."""
    left = session_processes(sid)
    for pid, cmdline in left.items():
        if "resource_tracker" not in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while (trackers := session_processes(sid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in trackers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class _Interrupt(Exception):
    pass


def interrupted_constantly(section, seconds: float = 1.0) -> int:
    """Run ``section()`` over and over for ``seconds`` while another thread signals this one every
    few microseconds and the handler raises, as torch's SIGCHLD handler raises a dead worker's error
    wherever the trainer's thread is. Returns how many times it was interrupted."""
    here, stop, armed = sys._getframe(), threading.Event(), [True]

    def raise_(signum, frame):
        if armed[0] and frame is not here:  # anywhere inside section(), whose error this loop catches
            raise _Interrupt

    def signaller(target: int):
        while not stop.wait(1e-5):
            signal.pthread_kill(target, signal.SIGUSR1)

    interrupted = 0
    old = signal.signal(signal.SIGUSR1, raise_)
    t = threading.Thread(target=signaller, args=(threading.get_ident(),))
    t.start()
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                section()
            except _Interrupt:
                interrupted += 1
    finally:
        armed[0] = False
        stop.set()
        t.join()
        signal.signal(signal.SIGUSR1, old)
    return interrupted


def free_for_another_thread(lock) -> bool:
    """Whether another thread gets ``lock`` (with ``with``) within 2 s."""
    got = threading.Event()

    def take():
        with lock:
            got.set()

    threading.Thread(target=take, daemon=True).start()  # (left blocked only where the check fails)
    return got.wait(2)
