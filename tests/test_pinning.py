"""The GPU path's CPU-side logic, on CPU: registration bookkeeping, refusals, deferred release and
``device=``, with an emulated GPU (``_fake_gpu.FakeGPU``) put in place of CUDA through
``_pinning.use``. Real worker processes, files and shared memory; CUDA itself is in test_cuda.py.
"""

from __future__ import annotations

import gc
import os
import threading
import time

import numpy as np
import pytest
import torch
import treetensor.torch as ttorch
from _fake_gpu import FakeEvent, FakeGPU, mapped, torch_sees_an_accelerator
from _helpers import lock_free
from conftest import assert_same
from torch.utils.data import DataLoader

from torch_storage_loader import (
    FileStorage,
    FileStorageLoader,
    SampleTooLargeForDeviceError,
    ShmTransportError,
    SlotPinningWarning,
    StorageDataset,
    StorageQueue,
    end_directory_stream,
)
from torch_storage_loader._gpu import pinning as _pinning
from torch_storage_loader._shm import slots as _slots

# Python 3.12 warns at every fork of a multi-threaded process (CUDA's threads, for one): DataLoader
# workers are forked here on purpose, and pytest.warns would re-raise that warning.
pytestmark = pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")


@pytest.fixture
def gpu(request, monkeypatch):
    marker = request.node.get_closest_marker("fake_gpu")
    fake = FakeGPU(**(marker.kwargs if marker else {}))
    if fake.pin_thread:
        torch_sees_an_accelerator(monkeypatch)
    before = _pinning.use(fake)
    try:
        yield fake
    finally:
        fake.complete_all()
        _pinning.use(before)
        gc.collect()


def save(d, i, **extra):
    s = FileStorage(d / f"{i:04d}.tsl")
    s.save({"obs": np.full((16, 1024), i, np.float32), "id": np.int64(i), **extra})
    return s


@pytest.fixture
def files(tmp_path):
    return [save(tmp_path, i) for i in range(12)]


def data_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# ------------------------------------------------------------------------------- registration
def test_rings_registered_once_each_and_unregistered_before_unmap(gpu, files):
    seen = []
    ds = StorageDataset(files, max_shm_bytes=64 << 20)
    for s in DataLoader(ds, batch_size=None, num_workers=2):
        assert gpu.sees_pinned(s["obs"].data_ptr())  # a view inside a registered ring
        seen.append(int(s["id"]))
        del s
    assert sorted(seen) == list(range(12))
    registered = [e for e in gpu.log if e[0] == "register"]
    addresses = [e[1] for e in registered]
    # Each ring registered once. A worker whose slots are all out (the in-order DataLoader holding
    # the other worker's lead while it lags, on a loaded machine) adds a ring: at least one per worker.
    assert len(addresses) == len(set(addresses)) >= 2
    assert sum(e[2] for e in registered) <= 64 << 20  # within the slot budget
    gc.collect()
    wait_for(lambda: not gpu.registered)  # the workers exited: their rings were forgotten
    unregistered = {e[1]: e[2] for e in gpu.log if e[0] == "unregister"}
    assert set(unregistered) == set(addresses)
    assert all(unregistered.values()), "a ring was unmapped before it was unregistered"
    assert not any(mapped(a, n) for _, a, n in registered)  # and then unmapped
    assert _pinning.pinned_bytes() == 0


def test_registration_waits_until_the_process_uses_the_gpu(gpu, files):
    gpu.used = False
    with FileStorageLoader(os.path.dirname(files[0].path), ttl=None, worker_num=1) as loader:
        loader.start()  # through the workers: a fresh loader reads its first files itself
        a = loader.load_async(files[0]).result()
        assert not gpu.log  # a process that has not touched CUDA is not made to
        gpu.used = True
        b = loader.load_async(files[1]).result()  # the next reference naming the ring registers it
        assert [e[0] for e in gpu.log] == ["register"] and gpu.sees_pinned(a["obs"].ctypes.data)
        c = loader.load_async(files[2]).result()
        assert len(gpu.log) == 1  # once per ring
        del a, b, c
    gc.collect()
    wait_for(lambda: not gpu.registered)


@pytest.mark.fake_gpu(refuse="cudaHostRegister returned 2, out of memory")
def test_refusal_warns_once_and_loads_unpinned(gpu, files):
    with pytest.warns(
        SlotPinningWarning,
        match=r"out of memory\). The NVIDIA driver locks the pages without charging RLIMIT_MEMLOCK; .*free RAM.*"
        r"memory limit.*lower max_shm_bytes",
    ) as w:
        out = [int(s["id"]) for s in DataLoader(StorageDataset(files), batch_size=None, num_workers=2)]
        out += [int(s["id"]) for s in DataLoader(StorageDataset(files), batch_size=None, num_workers=2)]
    assert sorted(out) == sorted(list(range(12)) * 2)
    ours = [x for x in w if issubclass(x.category, SlotPinningWarning)]  # (Python 3.12 adds fork warnings)
    assert len(ours) == 1 and "out of memory" in str(ours[0].message)
    assert [e[0] for e in gpu.log] == ["register"]  # never tried again in this process


@pytest.mark.fake_gpu(sees_pinned=False)
def test_a_torch_that_does_not_see_registered_memory_as_pinned_is_not_used(gpu, files):
    with pytest.warns(SlotPinningWarning, match="does not report it as pinned"):
        out = [int(s["id"]) for s in DataLoader(StorageDataset(files), batch_size=None, num_workers=1)]
    assert sorted(out) == list(range(12))
    assert [e[0] for e in gpu.log] == ["register", "unregister"] and not gpu.registered


def test_pinning_turned_off_by_environment(gpu, files, monkeypatch):
    monkeypatch.setenv(_pinning.ENV_PIN, "0")
    _pinning.use(gpu)  # the setting is read when the process state is made
    out = [int(s["id"]) for s in DataLoader(StorageDataset(files), batch_size=None, num_workers=1)]
    assert sorted(out) == list(range(12)) and not gpu.log


# --------------------------------------------------------------------------- deferred release
@pytest.mark.fake_gpu(auto=False)
def test_slot_not_reused_while_a_copy_from_it_is_queued(gpu, tmp_path):
    """A copy queued behind other work, the sample dropped at once, the worker loading the next
    sample: the copy must still read the old bytes (the slot stays busy until its event)."""
    a, b = save(tmp_path, 1), save(tmp_path, 2)
    with FileStorageLoader(str(tmp_path), ttl=None, worker_num=1, slots_per_worker=1) as loader:
        loader.start()  # through the workers: a fresh loader reads its first files itself
        first = loader.load_async(a).result()
        assert gpu.sees_pinned(first["obs"].ctypes.data)
        on_gpu = gpu.copy_async(torch.from_numpy(first["obs"]))  # queued; the GPU reads it later
        del first  # released at once: an event is recorded after the copy
        gc.collect()
        second = loader.load_async(b).result()  # the worker needs a slot now
        assert int(second["id"]) == 2
        gpu.complete_all()  # the GPU gets to the copy
        assert torch.equal(on_gpu, torch.full((16, 1024), 1.0)), "the slot was refilled before the copy read it"
        del second
        gpu.complete_all()
        wait_for(lambda: _pinning._state.releases.pending() == 0)
        assert loader.stats().slot_loads == 2


@pytest.mark.fake_gpu(auto=False)
def test_device_copy_keeps_its_slot_until_done(gpu, tmp_path):
    """device=: the slot of a batch whose copy is still queued is not given to the next samples."""
    hs = [save(tmp_path, i) for i in range(6)]
    ds = StorageDataset(hs, device="cpu", slots_per_worker=1)
    it = iter(DataLoader(ds, batch_size=None, num_workers=1, prefetch_factor=1))
    got = [next(it) for _ in range(4)]  # copies issued (and pending); the worker went on loading
    assert all(data_ptr(s["obs"]) in gpu.allocated for s in got)
    gpu.complete_all()
    for i, s in enumerate(got):
        assert torch.equal(s["obs"], torch.full((16, 1024), float(i))), f"batch {i} was overwritten before its copy"
    rest = list(it)
    gpu.complete_all()
    assert [int(s["id"]) for s in got + rest] == list(range(6))
    del it, got, rest
    wait_for(lambda: _pinning._state.releases.pending() == 0)


@pytest.mark.fake_gpu(auto=False)
def test_a_gpu_behind_the_trainer_holds_slots_within_the_budget(gpu, files):
    """Pass-through (no ``device=``): a slot whose last view is dropped goes back only once the GPU
    is past the work queued before the drop, however early the copy reading it was. A GPU that
    lags (here: never done until the end) holds every slot the trainer dropped; the worker adds
    rings (each page-locked) up to ``max_rings_per_worker`` (one more for copies), within
    ``max_shm_bytes``, then sends samples as copies or fallback segments: bounded, and it goes on."""
    budget = 2 << 20
    ds = StorageDataset(files, slots_per_worker=2, max_rings_per_worker=2, max_shm_bytes=budget)
    seen = []
    for s in DataLoader(ds, batch_size=None, num_workers=1):
        gpu.copy_async(s["obs"])  # what .to("cuda", non_blocking=True) does; the GPU gets to it later
        seen.append(int(s["id"]))
        assert _pinning.pinned_bytes() <= budget
        del s  # dropped at once: its release waits for an event the GPU has not reached
    assert seen == list(range(12))
    rings = {e[1] for e in gpu.log if e[0] == "register"}
    assert 2 <= len(rings) <= 3  # regrown while slots were held, never past max_rings_per_worker (+1)
    stats = ds.stats()
    assert stats["regrows"] >= 1 and stats["fallbacks"] + stats["copies"] >= 12 - 3 * 2
    gpu.complete_all()  # the GPU catches up: every slot goes back
    wait_for(lambda: _pinning._state.releases.pending() == 0)


# ----------------------------------------------------------------------------------- device=
def rich(i: int) -> dict:
    return {
        "obs": np.full((4, 8), i, np.float32),
        "nested": [{"a": torch.arange(3) + i, "t": (np.int16(i), np.float64(i) / 2)}],
        "tree": ttorch.Tensor({"x": torch.full((2,), float(i)), "y": {"z": torch.ones(2, dtype=torch.bool)}}),
        "name": f"s{i}",
        "raw": b"\x00\x01" * i,
        "chars": np.array(["ab", "c"]),
        "n": i,
        "none": None,
        "empty": torch.empty(0, 3),
        "half": torch.full((5,), i, dtype=torch.bfloat16),
    }


def tensors_of(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict) or type(x).__module__.startswith("treetensor"):
        for v in x.values():
            yield from tensors_of(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from tensors_of(v)


def save_rich(d, stackable=False):
    out = []
    for i in range(6):
        s = FileStorage(d / f"{i}.tsl")
        sample = rich(i)
        if stackable:
            del sample["raw"]  # bytes leaves are not stacked (a collate_fn batches them)
        s.save(sample)
        out.append(s)
    return out


@pytest.fixture
def rich_files(tmp_path):
    return save_rich(tmp_path)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batch_size", [None, 3])
def test_device_samples_match_host_samples(gpu, tmp_path, num_workers, batch_size):
    rich_files = save_rich(tmp_path, stackable=batch_size is not None)
    want = list(DataLoader(StorageDataset(rich_files, batch_size=batch_size), batch_size=None, num_workers=num_workers))
    got = list(
        DataLoader(
            StorageDataset(rich_files, batch_size=batch_size, device="cpu"), batch_size=None, num_workers=num_workers
        )
    )
    assert len(got) == len(want)
    for g, w in zip(
        sorted(got, key=lambda s: s["n"] if batch_size is None else s["n"][0]),
        sorted(want, key=lambda s: s["n"] if batch_size is None else s["n"][0]),
        strict=False,
    ):
        assert_same(w, g)
        for t in tensors_of(g):
            assert data_ptr(t) in gpu.allocated or t.numel() == 0, "a tensor did not go through the device copy"
    assert len(gpu.waits) == len(got)  # each one waited for on the trainer's side


def test_dataloader_side_batching_on_device(gpu, tmp_path):
    rich_files = []
    for i in range(6):  # what default_collate can batch (not treetensor trees, None or string arrays)
        rich_files.append(FileStorage(tmp_path / f"{i}.tsl"))
        rich_files[-1].save({k: v for k, v in rich(i).items() if k not in ("tree", "none", "chars")})
    ds = StorageDataset(rich_files, device="cpu")
    got = list(DataLoader(ds, batch_size=3, num_workers=2))  # each worker batches its own share
    assert sorted(i for b in got for i in b["n"].tolist()) == list(range(6))
    for b in got:
        ids = b["n"].tolist()
        assert torch.equal(b["obs"], torch.stack([torch.full((4, 8), float(i)) for i in ids]))
        assert torch.equal(b["nested"][0]["a"], torch.stack([torch.arange(3) + i for i in ids]))
        assert b["name"] == [f"s{i}" for i in ids] and b["raw"] == [b"\x00\x01" * i for i in ids]
        assert b["half"].dtype == torch.bfloat16 and b["half"][:, 0].tolist() == ids
        assert all(data_ptr(t) in gpu.allocated for t in tensors_of(b) if t.numel())  # it crossed as one copy


def test_user_collate_fn_result_is_moved(gpu, rich_files):
    def collate(samples):
        return {"obs": torch.stack([s["obs"] for s in samples]), "names": [s["name"] for s in samples]}

    got = list(DataLoader(StorageDataset(rich_files, device="cpu"), batch_size=2, num_workers=1, collate_fn=collate))
    assert [b["names"] for b in got] == [["s0", "s1"], ["s2", "s3"], ["s4", "s5"]]
    assert torch.equal(got[1]["obs"][0], torch.full((4, 8), 2.0))


def test_device_with_a_streaming_source(gpu, tmp_path):
    q = StorageQueue()
    for i in range(5):
        q.put(save(tmp_path, i))
    q.close()
    ds = StorageDataset(q, device="cpu", batch_size=2)
    got = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert sorted(int(i) for b in got for i in b["id"]) == list(range(5))
    assert all(data_ptr(b["obs"]) in gpu.allocated for b in got)


@pytest.mark.fake_gpu(capacity=100_000)
@pytest.mark.parametrize("num_workers", [0, 1])
def test_sample_too_large_for_the_device(gpu, files, num_workers):
    it = iter(DataLoader(StorageDataset(files, device="cpu", batch_size=4), batch_size=None, num_workers=num_workers))
    with pytest.raises(SampleTooLargeForDeviceError, match=r"0000\.tsl.* needs 256\.\d KiB on cpu:0, which has"):
        next(it)
    del it


def pin_thread_running() -> bool:
    return any(t.name.endswith("(_pin_memory_loop)") for t in threading.enumerate())


@pytest.mark.fake_gpu(pin_thread=True)
def test_device_copies_are_issued_on_the_pin_thread(gpu, files):
    seen = []
    for s in DataLoader(StorageDataset(files, device="cpu"), batch_size=None, num_workers=2):
        assert pin_thread_running() and data_ptr(s["obs"]) in gpu.allocated
        seen.append(int(s["id"]))
    assert sorted(seen) == list(range(12))


@pytest.mark.parametrize(
    "pin_thread",
    [
        pytest.param(True, marks=pytest.mark.fake_gpu(pin_thread=True), id="pin-thread"),
        pytest.param(False, id="trainer"),
    ],
)
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_sample_that_cannot_be_received_fails_on_the_trainers_thread(gpu, tmp_path, on_error, pin_thread):
    """The trainer forgets its worker's ring (as if the worker had exited), so the worker's next
    reference to it cannot be received: the pin-memory thread, where it is unpickled, must hand the
    error to the trainer's thread (not die: "Pin memory thread exited unexpectedly"), and under
    ``on_error="skip"`` the DataLoader goes on with the next samples (a fallback segment each: the
    lost slot is never freed), counting the one it lost. The same where the trainer's thread
    unpickles (no pin thread), where torch would lose the item and wait for it for ever."""
    q = StorageQueue()
    q.put(save(tmp_path, 0))
    ds = StorageDataset(q, device="cpu", on_error=on_error, slots_per_worker=1, max_rings_per_worker=1)
    it = iter(DataLoader(ds, batch_size=None, num_workers=1))
    assert int(next(it)["id"]) == 0 and pin_thread_running() == pin_thread
    # The slot of sample 0 comes back to the worker once the (fake) copy's event completed, on the
    # release thread: wait for it, or the worker, finding no slot free, maps a new ring for sample 1
    # and sends its descriptor (a loaded CI machine: "DID NOT RAISE").
    _pinning._state.releases.drain()
    _slots.retire_rings()  # the worker's ring is forgotten here: its next reference names an unknown ring
    for i in (1, 2, 3):
        q.put(save(tmp_path, i))
    q.close()
    if on_error == "raise":
        with pytest.raises(ShmTransportError, match="is not mapped in this process"):
            next(it)
        assert sorted(int(s["id"]) for s in it) == [1, 2, 3]  # it goes on; the failed handle was given back
    else:
        assert [int(s["id"]) for s in it] == [2, 3]
        assert ds.stats()["skipped"] == 1
    del it


@pytest.mark.fake_gpu(capacity=100_000)
@pytest.mark.parametrize("num_workers", [0, 1])
def test_sample_too_large_for_the_device_skipped(gpu, files, num_workers, caplog):
    ds = StorageDataset(files, device="cpu", batch_size=4, on_error="skip")
    assert list(DataLoader(ds, batch_size=None, num_workers=num_workers)) == []
    assert ds.stats()["skipped"] == 12 and "needs 256.1 KiB on cpu" in caplog.text


def test_a_kept_leaf_keeps_its_whole_batch_on_the_device(gpu, tmp_path):
    """device=: a batch crosses in one copy, and each tensor leaf is a view of that one buffer, so
    keeping one small leaf (labels for an epoch-end metric) keeps the whole batch's device memory;
    ``.clone()`` keeps only its own (docs/guides/gpu.md says so)."""
    hs = [save(tmp_path, i, label=np.array([i], np.int64)) for i in range(8)]
    kept, cloned = [], []
    for b in DataLoader(StorageDataset(hs, batch_size=4, device="cpu"), batch_size=None, num_workers=1):
        kept.append(b["label"])
        cloned.append(b["label"].clone())
    batch_bytes = 4 * 16 * 1024 * 4  # the batch's obs, at least
    for k, c in zip(kept, cloned, strict=True):
        assert k.nbytes == 4 * 8 and k.untyped_storage().nbytes() > batch_bytes  # the whole batch's buffer
        assert data_ptr(k) in gpu.allocated
        assert c.untyped_storage().nbytes() == c.nbytes and torch.equal(c, k)  # its own bytes only


def test_device_validation():
    with pytest.raises(ValueError, match="is not a device"):
        StorageDataset([], device="warp-drive")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"cannot copy to cuda \(torch.cuda.is_available\(\) is False\)"):
            StorageDataset([], device="cuda")
    assert StorageDataset([], device="cpu").device is None  # nothing to move


def test_release_queue_runs_in_order_and_its_thread_exits(gpu):
    q = _pinning.ReleaseQueue()
    done = []
    events = [FakeEvent(gpu, 0, []) for _ in range(3)]
    for i, e in enumerate(events):
        q.put(gpu, [(0, e)], lambda i=i: done.append(i))
    time.sleep(0.05)
    assert done == [] and q.pending() == 3  # nothing runs before its event
    events[1].complete()
    time.sleep(0.05)
    assert done == []  # in order: the first is still pending
    events[0].complete()
    events[2].complete()
    q.drain()
    assert done == [0, 1, 2]
    wait_for(lambda: not any(t.name == "tsl-slot-release" for t in __import__("threading").enumerate()))


# ------------------------------------------------------------- devices, threads, fork (issue 33)
@pytest.mark.fake_gpu(devices=2, contexts=[1])
def test_threads_of_the_library_call_the_gpu_on_the_trainers_device_only(gpu, tmp_path):
    """The trainer on device 1 (DDP rank 1): the release thread, the ring reaper and a loader's
    receiving thread must not create a context on device 0 (a fresh thread's current device)."""
    files = [save(tmp_path, i) for i in range(6)]
    gpu.set_device(1)
    seen = [int(s["id"]) for s in DataLoader(StorageDataset(files), batch_size=None, num_workers=2)]
    seen += [int(s["id"]) for s in DataLoader(StorageDataset(files, device="cpu"), batch_size=None, num_workers=2)]
    with FileStorageLoader(str(tmp_path), ttl=None, worker_num=1) as loader:
        loader.start()
        seen += [int(loader.load_async(f).result()["id"]) for f in files]
    assert sorted(seen) == sorted(list(range(6)) * 3)
    gc.collect()
    wait_for(lambda: not gpu.registered and _pinning._state.releases.pending() == 0)
    threads = {thread for _, thread, _ in gpu.calls}
    assert {"tsl-slot-release", "tsl-loader-recv"} <= threads  # the library's own threads called it
    assert any(what == "unregister" for what, _, _ in gpu.calls)
    assert gpu.contexts == {1}, [c for c in gpu.calls if c[2] != 1]


@pytest.mark.fake_gpu(devices=2, contexts=[0, 1], late=[1])
def test_slot_not_reused_while_a_copy_to_another_device_is_queued(gpu, tmp_path):
    """A slot tensor copied to device 1 while device 0 is current (device 1 busy, device 0 idle):
    its release must wait for device 1's stream too."""
    a, b = save(tmp_path, 1), save(tmp_path, 2)
    with FileStorageLoader(str(tmp_path), ttl=None, worker_num=1, slots_per_worker=1) as loader:
        loader.start()
        first = loader.load_async(a).result()
        assert gpu.sees_pinned(first["obs"].ctypes.data)
        on_gpu = gpu.copy_async(torch.from_numpy(first["obs"]), device=1)  # cuda:1, with cuda:0 current
        del first
        gc.collect()
        second = loader.load_async(b).result()  # the worker needs a slot now
        assert int(second["id"]) == 2
        gpu.complete_all()
        assert torch.equal(on_gpu, torch.full((16, 1024), 1.0)), "the slot was refilled before the copy read it"
        del second
        gpu.complete_all()
        wait_for(lambda: _pinning._state.releases.pending() == 0)


@pytest.mark.fake_gpu(auto=False)
def test_a_forked_child_never_destroys_the_parents_pending_events(gpu):
    """Releases pending at a fork (a DataLoader starting its workers mid-training): the child must
    not run the destructors of the parent's events (CUDA calls in a forked child)."""
    for _ in range(3):
        _pinning.defer(lambda: None)
    wait_for(lambda: _pinning._state.releases.pending() == 3)
    pid = os.fork()
    if pid == 0:  # the child: report how many of the parent's events it destroyed
        code = 100
        try:
            gc.collect()
            code = min(FakeEvent.destroyed_after_fork, 99)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code == 0, f"the forked child destroyed {code} of its parent's pending events"
    gpu.complete_all()
    _pinning._state.releases.drain()


def test_page_locking_does_not_hold_the_ring_registry(gpu, files):
    """cudaHostRegister / Unregister may wait for the device: the rings' registry stays free meanwhile."""
    held = []
    gpu.during_calls = lambda what: None if lock_free(_slots._registry.lock) else held.append(what)
    seen = [int(s["id"]) for s in DataLoader(StorageDataset(files), batch_size=None, num_workers=2)]
    assert sorted(seen) == list(range(12))
    gc.collect()
    wait_for(lambda: not gpu.registered and _pinning._state.releases.pending() == 0)
    assert {e[0] for e in gpu.log} == {"register", "unregister"}
    assert held == [], f"{held} ran with the ring registry locked"


@pytest.mark.fake_gpu(devices=2)
def test_a_device_this_machine_lacks_is_refused_at_construction(gpu):
    assert StorageDataset([], device="cpu:1").device == "cpu:1"
    with pytest.raises(ValueError, match=r"device='cpu:2'.* 2 devices \(cpu:0 to cpu:1\).*CUDA_VISIBLE_DEVICES"):
        StorageDataset([], device="cpu:2")


@pytest.mark.fake_gpu(auto=False)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_trainer_waits_for_each_copy_it_uses(gpu, files, num_workers):
    """Copies complete late: a trainer whose stream did not wait for the copy would read poison."""
    ds = StorageDataset(files, device="cpu")
    for s in DataLoader(ds, batch_size=None, num_workers=num_workers):
        assert torch.equal(s["obs"], torch.full((16, 1024), float(int(s["id"])))), "read before the copy"
        assert data_ptr(s["obs"]) in gpu.kept  # its memory is not reused before the trainer's work on it


@pytest.mark.fake_gpu(capacity=100_000)
@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_stream_sample_skipped_on_its_way_to_the_device_fails_its_files(gpu, tmp_path, num_workers):
    """A sample skipped after it was loaded (its copy to the device refused) is settled as a failed
    load is: its files renamed *.failed, never acknowledged (deleted: it was never trained on) nor
    left claimed (with no worker, the trainer's own skip settled nothing)."""
    for i in range(8):
        save(tmp_path, i)
    end_directory_stream(tmp_path)
    ds = StorageDataset(str(tmp_path), device="cpu", batch_size=4, on_error="skip")
    assert list(DataLoader(ds, batch_size=None, num_workers=num_workers)) == []
    assert ds.stats()["skipped"] == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["_END_OF_STREAM"] + [f"{i:04d}.tsl.failed" for i in range(8)]
    )
