"""The GPU path on a real CUDA device: pinned slots, deferred release, ``device=``, Lightning.

Skipped, saying so, where no CUDA device is present (CI has none); the same logic is tested on
CPU with an emulated GPU in test_pinning.py. Run on a GPU machine with ``pytest -m cuda``.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import treetensor.torch as ttorch
from _helpers import lock_free
from conftest import traj
from torch.utils.data import DataLoader

from torch_storage_loader import (
    FileStorage,
    FileStorageLoader,
    SampleTooLargeForDeviceError,
    ShmTransportError,
    StorageDataset,
    StorageQueue,
)
from torch_storage_loader._gpu import pinning as _pinning
from torch_storage_loader._shm import slots as _slots

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"
    ),
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*isinstance.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:lightning"),
    pytest.mark.filterwarnings("ignore:.*You are using a CUDA device.*"),
    pytest.mark.filterwarnings("ignore:.*The number of training batches.*:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*Tensor Cores.*"),
    pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning"),
]

GPU_SLEEP_CYCLES = 1_000_000_000  # about half a second of one kernel spinning on an H100/H200


@pytest.fixture(autouse=True)
def cuda_in_use():
    # A process that uses CUDA, as a trainer with its model on the GPU does: the library pins only on
    # a device that has a context (it never makes one), and torch.cuda.init() makes none.
    torch.empty(1, device="cuda")
    yield
    torch.cuda.synchronize()
    gc.collect()


def save(d, i, n=256):
    s = FileStorage(d / f"{i:04d}.tsl")
    s.save({"obs": np.full((n, 1024), i, np.float32), "id": np.int64(i), "name": f"s{i}"})
    return s


@pytest.fixture
def files(tmp_path):
    return [save(tmp_path, i) for i in range(16)]


def in_registered_ring(ptr: int) -> bool:
    return any(a <= ptr < a + n for a, (n, _) in _pinning._state.registered.items())


def test_slot_tensors_are_pinned_and_pass_the_pin_thread_uncopied(files):
    got = 0
    for b in DataLoader(StorageDataset(files, batch_size=4), batch_size=None, num_workers=2, pin_memory=True):
        for t in (b["obs"], b["obs"][1], b["obs"][2, 7:]):  # views at non-zero offsets too
            assert t.is_pinned() and in_registered_ring(t.data_ptr()), "the pin thread copied a slot"
        assert b["obs"].pin_memory().data_ptr() == b["obs"].data_ptr()
        x = b["obs"].to("cuda", non_blocking=True)
        assert torch.equal(x[:, 0, 0].cpu(), b["id"].to(torch.float32))
        got += len(b["id"])
        del b, x, t  # t too: a view kept keeps its ring pinned (as it should)
    assert got == 16 and _pinning.pinned_bytes() >= 0
    gc.collect()
    deadline = time.monotonic() + 10
    while _pinning.pinned_bytes() and time.monotonic() < deadline:  # the workers exited: rings unregistered
        time.sleep(0.05)
        gc.collect()
    assert _pinning.pinned_bytes() == 0, rings_report()


def rings_report() -> str:
    """What keeps rings mapped in this process (for a failure message)."""
    import weakref

    reg = _slots._registry
    lines = [
        f"registered={_pinning._state.registered} pending releases={_pinning._state.releases.pending()} "
        f"watched={reg.watched} reaper={reg.reaper}"
    ]
    for obj in gc.get_objects():
        if type(obj) is _slots._MappedRing:  # (isinstance would touch deprecated torch objects, which warn)
            try:
                w = obj.words
                state = (
                    f"retired={w[_slots._RETIRED]} sent={w[_slots._SENT]} received={w[_slots._RECEIVED]} "
                    f"slots={[w[_slots._STATES + i] for i in range(4)]}"
                )
            except ValueError:
                state = "closed"
            lines.append(
                f"ring {obj.uid[:8]} owner={obj.owner_pid} alive={os.path.exists(f'/proc/{obj.owner_pid}')} "
                f"leases={obj.leases} forgotten={obj.forgotten} pin={obj.pin} in_registry="
                f"{reg.rings.get(obj.uid) is obj} {state}"
            )
            for f in [f for f in weakref.finalize._registry.values() if obj in f.args]:
                lines.append(f"    finalizer {f.func.__name__} slot={f.args[1]} gen={f.args[2]}")
            for r in gc.get_referrers(obj):
                lines.append(f"    referrer {type(r).__name__} {str(r)[:150]!r}")
    return "\n".join(lines)


@pytest.mark.parametrize("deferred", [True, False], ids=["deferred", "control-without-deferral"])
def test_a_slot_is_not_refilled_while_the_gpu_may_still_copy_it(tmp_path, monkeypatch, deferred):
    """A slow kernel queued before the copy, the sample dropped at once, the worker refilling the
    slot: the GPU must still see the old bytes. The control run turns the deferral off and
    expects the new bytes, which shows the test can see the hazard it guards against."""
    if not deferred:
        monkeypatch.setattr(_slots, "gpu", _slots.gpu._replace(defer=lambda callback, event=None: callback()))
    a, b = save(tmp_path, 1, n=1024), save(tmp_path, 2, n=1024)
    with FileStorageLoader(str(tmp_path), ttl=None, worker_num=1, slots_per_worker=1, max_rings_per_worker=1) as loader:
        loader.start()  # through the workers: a fresh loader reads its first files itself
        first = loader.load_async(a).result(timeout=60)
        host = torch.from_numpy(first["obs"])
        assert host.is_pinned()
        from torch_storage_loader._dataloader.hooks import gpu_sleep

        gpu_sleep(GPU_SLEEP_CYCLES)  # the copy below waits behind this on the stream
        on_gpu = host.to("cuda", non_blocking=True)
        del first, host
        gc.collect()
        second = loader.load_async(b).result(timeout=60)  # needs a slot while the GPU still sleeps
        assert int(second["id"]) == 2
        torch.cuda.synchronize()
        seen = on_gpu[0, 0].item()
        del second
        if deferred:
            assert seen == 1.0 and torch.equal(on_gpu, torch.full_like(on_gpu, 1.0)), (
                "the slot was refilled under the copy"
            )
        else:
            assert seen == 2.0, "without the deferral the refill should have reached the copy (is the GPU that fast?)"


def rich(i: int) -> dict:
    return {
        "obs": np.full((64, 32), i, np.float32),
        "ids": [np.int64(i), {"t": torch.tensor([i, i])}],
        "tree": ttorch.Tensor({"x": torch.full((3,), float(i))}),
        "name": f"s{i}",
        "n": i,
    }


@pytest.mark.parametrize("num_workers", [0, 2])
def test_device_batches_arrive_on_the_gpu(tmp_path, num_workers):
    hs = []
    for i in range(8):
        hs.append(FileStorage(tmp_path / f"{i}.tsl"))
        hs[-1].save(rich(i))
    seen = []
    for b in DataLoader(StorageDataset(hs, batch_size=2, device="cuda"), batch_size=None, num_workers=num_workers):
        assert b["obs"].is_cuda and b["ids"][1]["t"].is_cuda and b["tree"].x.is_cuda and b["n"].is_cuda
        ids = b["n"].tolist()
        assert torch.equal(b["obs"][:, 0, 0].cpu(), torch.tensor(ids, dtype=torch.float32))
        assert b["name"] == [f"s{i}" for i in ids]
        seen += ids
        b["obs"].mul_(2)  # the trainer's stream uses it at once
    assert sorted(seen) == list(range(8))


def test_device_with_dataloader_side_batching_and_a_stream(tmp_path):
    q = StorageQueue()
    for i in range(6):
        q.put(save(tmp_path, i, n=16))
    q.close()
    got = list(DataLoader(StorageDataset(q, device="cuda"), batch_size=3, num_workers=2))
    assert sorted(int(i) for b in got for i in b["id"]) == list(range(6))
    assert all(b["obs"].is_cuda and b["id"].is_cuda for b in got)


def test_device_sample_too_large(files):
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1e-5)  # about 1.4 MB of an H200
    try:
        it = iter(DataLoader(StorageDataset(files, batch_size=4, device="cuda"), batch_size=None, num_workers=1))
        with pytest.raises(SampleTooLargeForDeviceError, match=r"0000\.tsl.* needs 4\.0 MiB on cuda:0, which has"):
            next(it)
        del it
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


@pytest.mark.parametrize(
    ("device", "on_error"), [("cuda", "raise"), ("cuda", "skip"), (None, "raise")], ids=["device", "skip", "pin_memory"]
)
def test_a_batch_that_cannot_be_received_fails_on_the_trainers_thread(tmp_path, device, on_error):
    """Issue 33, risk 2: the trainer forgets its worker's ring, so the worker's next reference cannot be
    received on torch's pin-memory thread (device=, or pin_memory=True): the library's error reaches
    the trainer's thread (not "Pin memory thread exited unexpectedly"), and the DataLoader goes on."""
    q = StorageQueue()
    q.put(save(tmp_path, 0, n=16))
    ds = StorageDataset(q, device=device, on_error=on_error, slots_per_worker=1, max_rings_per_worker=1)
    it = iter(DataLoader(ds, batch_size=None, num_workers=1, pin_memory=device is None))
    assert int(next(it)["id"]) == 0
    _pinning._state.releases.drain()  # sample 0's slot is free again (else the worker maps a new ring)
    _slots.retire_rings()  # its next reference names a ring this process no longer knows
    for i in (1, 2, 3):
        q.put(save(tmp_path, i, n=16))
    q.close()
    if on_error == "raise":
        with pytest.raises(ShmTransportError, match="is not mapped in this process"):
            next(it)
        assert sorted(int(s["id"]) for s in it) == [1, 2, 3]  # the failed handle was given back
    else:
        assert [int(s["id"]) for s in it] == [2, 3] and ds.stats()["skipped"] == 1


@pytest.mark.parametrize("dropped", ["after-the-copy", "after-the-step"])
def test_a_pass_through_slot_goes_back_once_the_gpu_is_past_its_drop(files, dropped):
    """Issue 33, risk 5: with pin_memory=True (no device=), a slot goes back once the GPU is past what
    was queued when the batch's last host view was dropped: right after its copy if dropped then (the
    slot is free while the step still runs), only after the step if the batch is held through it."""
    from torch_storage_loader._dataloader.hooks import gpu_sleep

    it = iter(DataLoader(StorageDataset(files, batch_size=4), batch_size=None, num_workers=1, pin_memory=True))
    b = next(it)
    assert b["obs"].is_pinned() and in_registered_ring(b["obs"].data_ptr())
    torch.cuda.synchronize()
    x = b["obs"].to("cuda", non_blocking=True)
    if dropped == "after-the-copy":
        del b
        gc.collect()
    gpu_sleep(GPU_SLEEP_CYCLES)  # the step's work
    if dropped == "after-the-step":
        del b
        gc.collect()
    _pinning._state.releases.drain()  # the slot went back
    step_running = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert step_running == (dropped == "after-the-copy")
    assert x.shape == (4, 256, 1024)
    del x, it


def test_a_kept_leaf_keeps_its_whole_batch_on_the_gpu(tmp_path):
    """Issue 33, risk 6 (documented, docs/guides/gpu.md): a batch's tensors are views of one device
    buffer, so a small leaf kept keeps its whole batch's memory; its ``.clone()`` keeps only its own."""
    hs = []
    for i in range(16):
        hs.append(FileStorage(tmp_path / f"{i}.tsl"))
        hs[-1].save({"obs": np.zeros((256, 1024), np.float32), "label": np.array([i], np.int64)})  # 1 MiB each

    def allocated() -> int:
        gc.collect()
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")  # the allocator frees blocks whose streams are done as it allocates
        return torch.cuda.memory_allocated()

    before = allocated()
    ds = StorageDataset(hs, batch_size=4, device="cuda")
    kept = [b["label"] for b in DataLoader(ds, batch_size=None, num_workers=1)]
    assert allocated() - before >= 4 * (4 << 20)  # four batches of 4 MiB, for 32 bytes of labels
    cloned = [k.clone() for k in kept]
    del kept
    assert allocated() - before < 1 << 20
    assert sorted(int(c) for c in torch.cat(cloned)) == list(range(16))


def test_lightning_fit_with_device(tmp_path):
    import lightning.pytorch as pl

    from torch_storage_loader.lightning import StorageDataModule

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4 * 8 * 8, 1)
            self.seen = []

        def training_step(self, batch, batch_idx):
            assert batch["obs"].is_cuda and batch["reward"].is_cuda
            self.seen += batch["info"]["id"].tolist()
            obs = batch["obs"].reshape(*batch["obs"].shape[:-3], -1)
            return torch.nn.functional.mse_loss(self.net(obs).squeeze(-1), batch["reward"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    hs = []
    for i in range(24):
        hs.append(FileStorage(tmp_path / f"{i}.tsl"))
        hs[-1].save(traj(i))
    model = Model()
    dm = StorageDataModule(hs, batch_size=4, num_workers=2, device="cuda")
    from lightning.fabric.plugins.environments import LightningEnvironment

    # A cluster environment given: Lightning does not probe MPI (mpi4py would start an orted daemon).
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        plugins=[LightningEnvironment()],
    )
    trainer.fit(model, datamodule=dm)
    assert sorted(model.seen) == list(range(24))


# ------------------------------------------------------------------------------------ issue 33
def two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices ({torch.cuda.device_count()} here)")


def test_devices_in_use_are_asked_of_the_driver():
    """The GPU path calls the GPU only on devices with a context: it must see the current one."""
    torch.empty(1, device="cuda")
    acc = _pinning.accelerator()
    assert torch.cuda.current_device() in acc.devices_in_use()
    assert acc.devices_in_use() == sorted(acc.devices_in_use())


_ON_DEVICE_1 = """
import gc, sys, time, torch
from torch.utils.data import DataLoader
from torch_storage_loader import FileStorage, FileStorageLoader, StorageDataset
from torch_storage_loader._gpu import cudart, pinning
torch.cuda.set_device(1)  # a DDP rank 1: nothing of the library's may make a context on cuda:0
files = [FileStorage(p) for p in sys.argv[1:]]
for b in DataLoader(StorageDataset(files, batch_size=4), batch_size=None, num_workers=2, pin_memory=True):
    b["obs"].to("cuda", non_blocking=True).mul_(2)
for b in DataLoader(StorageDataset(files, batch_size=4, device="cuda"), batch_size=None, num_workers=2):
    b["obs"].mul_(2)
with FileStorageLoader(files[0].path.rsplit("/", 1)[0], ttl=None, worker_num=1) as loader:
    for f in files:
        torch.from_numpy(loader.load_async(f).result(timeout=60)["obs"]).to("cuda", non_blocking=True)
torch.cuda.synchronize()
deadline = time.monotonic() + 20
while (pinning.pinned_bytes() or pinning._state.releases.pending()) and time.monotonic() < deadline:
    gc.collect()
    time.sleep(0.05)
assert cudart.has_context(1), "no context on cuda:1?"
assert not cudart.has_context(0), "the library made a context on cuda:0"
"""


def test_no_thread_of_the_library_makes_a_context_on_another_device(files):
    """Risk 1: the trainer on cuda:1 (a fresh process: this one has a context on cuda:0 already)."""
    two_gpus()
    subprocess.run([sys.executable, "-c", _ON_DEVICE_1, *[f.path for f in files]], check=True, timeout=120)


def test_a_slot_copied_to_another_device_is_not_refilled_under_the_copy(tmp_path):
    """Risk 1: copied to cuda:1 (busy) while cuda:0 (idle) is current; its release waits for cuda:1."""
    two_gpus()
    from torch_storage_loader._dataloader.hooks import gpu_sleep

    torch.empty(1, device="cuda:1")  # cuda:1 in use in this process
    a, b = save(tmp_path, 1, n=1024), save(tmp_path, 2, n=1024)
    with FileStorageLoader(str(tmp_path), ttl=None, worker_num=1, slots_per_worker=1, max_rings_per_worker=1) as loader:
        loader.start()
        first = loader.load_async(a).result(timeout=60)
        host = torch.from_numpy(first["obs"])
        assert host.is_pinned() and torch.cuda.current_device() == 0
        with torch.cuda.device(1):
            gpu_sleep(GPU_SLEEP_CYCLES)  # the copy below waits behind this on cuda:1's stream
        on_gpu = host.to("cuda:1", non_blocking=True)
        del first, host
        gc.collect()
        second = loader.load_async(b).result(timeout=60)
        assert int(second["id"]) == 2
        torch.cuda.synchronize(1)
        assert torch.equal(on_gpu, torch.full_like(on_gpu, 1.0)), "the slot was refilled under the copy"
        del second


def test_a_forked_child_leaves_the_parents_pending_events_alone():
    """Risk 3: releases pending at a fork; the child must not call CUDA for them (nothing on its stderr)."""
    from torch_storage_loader._dataloader.hooks import gpu_sleep

    _pinning.accelerator()  # the release thread's backend, as a trainer's first pinned batch sets it up
    gpu_sleep(GPU_SLEEP_CYCLES)
    for _ in range(3):
        _pinning.defer(lambda: None)  # events recorded behind the sleep: pending
    assert _pinning._state.releases.pending() == 3, "nothing pending at the fork: the test would prove nothing"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(w, 2)
            gc.collect()
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        err = f.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and "CUDA" not in err, err
    _pinning._state.releases.drain()


def test_page_locking_runs_outside_the_ring_registry(files, monkeypatch):
    """Risk 4: cudaHostRegister / Unregister (the real ones, called through) never hold the registry."""
    torch.empty(1, device="cuda")
    acc = _pinning.accelerator()
    held, calls = [], []

    def probing(name, real):
        def probe(*args):
            calls.append(name)
            if not lock_free(_slots._registry.lock):
                held.append(name)
            return real(*args)

        return probe

    for name in ("register", "unregister"):
        monkeypatch.setattr(acc, name, probing(name, getattr(acc, name)))
    for b in DataLoader(StorageDataset(files, batch_size=4), batch_size=None, num_workers=2):
        b["obs"].to("cuda", non_blocking=True)
    del b
    gc.collect()
    deadline = time.monotonic() + 10
    while _pinning.pinned_bytes() and time.monotonic() < deadline:
        time.sleep(0.05)
        gc.collect()
    assert {"register", "unregister"} <= set(calls) and held == [], (calls, held)


def test_a_device_this_machine_lacks_is_refused():
    """Risk 7: at construction, naming the devices there are."""
    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"device='cuda:{n}': this process sees {n} device.*CUDA_VISIBLE_DEVICES"):
        StorageDataset([], device=f"cuda:{n}")


def test_the_trainer_waits_for_each_copy(files):
    """Risk 7: each copy queued behind a slow kernel on the side stream; the trainer reads at once."""
    from torch_storage_loader._dataloader.hooks import gpu_sleep

    side = _pinning.accelerator().side_stream(torch.device("cuda", torch.cuda.current_device()))
    it = iter(DataLoader(StorageDataset(files, device="cuda"), batch_size=None, num_workers=0))
    for _ in range(3):
        with torch.cuda.stream(side):
            gpu_sleep(GPU_SLEEP_CYCLES // 4)
        s = next(it)
        got = s["obs"].clone()  # on the trainer's stream, queued at once
        assert torch.equal(got, torch.full_like(got, float(s["id"].item()))), "read before the copy was done"
    del it
