"""StorageLoader / FileStorageLoader with real worker processes, files and shared memory."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch
import treetensor.torch as ttorch
from _helpers import KillStorage, MemoryStorage, SleepStorage, kill_session, run_script
from conftest import START_METHODS, assert_same, traj

from torch_storage_loader import (
    FileStorage,
    FileStorageLoader,
    InsufficientSharedMemoryError,
    LoadCancelledError,
    StorageCorruptError,
    StorageNotFoundError,
    WorkerDiedError,
)
from torch_storage_loader._shm.segments import ShmSegment, shm_dir


def collect(loader, storages, keep=True, timeout=60):
    got, lock = {}, threading.Lock()

    def cb(i):
        def inner(obj):
            with lock:
                got[i] = obj if keep else None

        return inner

    loader.start()  # through the workers (a fresh loader reads its first files itself while they start)
    futures = [loader.load(s, cb(i)) for i, s in enumerate(storages)]
    for f in futures:
        f.result(timeout=timeout)
    return [got[i] for i in range(len(storages))]


@pytest.mark.parametrize("method", START_METHODS)
def test_roundtrip_through_workers(tmp_store, method):
    samples = [
        traj(0),
        ttorch.Tensor({"obs": torch.ones(8, 4, 8, 8), "a": {"b": torch.arange(8)}}),
        [np.arange(5), (torch.tensor(2.5, dtype=torch.bfloat16), None, "s", b"b")],
        torch.zeros(3, 0),
        np.float64(3.0),
        {"deep": [[[{"x": np.ones((2, 2), np.complex64)}]]]},
    ] + [traj(i) for i in range(1, 8)]
    with FileStorageLoader(tmp_store, worker_num=2, mp_context=method) as loader:
        storages = [loader.save(s) for s in samples]
        out = collect(loader, storages)
        stats = loader.stats()
    for a, b in zip(samples, out, strict=False):
        assert_same(a, b)
    assert stats.loads == len(samples) and stats.errors == 0
    # Every load goes through a worker's slots (the first one sizes them).
    assert stats.slot_loads + stats.fallbacks + stats.oversize == len(samples) and stats.slot_loads >= 4
    # Files live until their TTL, shutdown included: other processes may load the handles later.
    assert sorted(os.listdir(tmp_store)) == sorted(os.path.basename(s.path) for s in storages)


def test_kept_samples_are_never_overwritten(tmp_store):
    with FileStorageLoader(tmp_store, worker_num=2, slots_per_worker=2, max_rings_per_worker=2) as loader:
        storages = [loader.save(traj(i)) for i in range(20)]
        out = collect(loader, storages, keep=True)
        more = collect(loader, [loader.save(traj(100 + i)) for i in range(10)], keep=True)
        stats = loader.stats()
    for i, sample in enumerate(out):
        assert_same(traj(i), sample)  # still intact after 10 more loads
    for i, sample in enumerate(more):
        assert_same(traj(100 + i), sample)
    # Rings were added, then samples arrived as private copies (the consumer holds every slot).
    assert stats.copies > 0 and stats.slot_loads >= 8 and stats.regrows >= 2, stats


def test_dropped_samples_free_their_slots(tmp_store):
    # One worker, one ring of one slot, one request at a time: each load can only use the slot if
    # the sample before it was dropped (by the callback) and its lease released. The requests are
    # all queued at once, so each is sent to the worker by the receiving thread, after it let go of
    # the previous sample. A lease that is never released makes every later load a fallback.
    n = 30
    with FileStorageLoader(
        tmp_store, worker_num=1, slots_per_worker=1, max_rings_per_worker=1, max_inflight_per_worker=1
    ) as loader:
        storages = [loader.save(traj(i)) for i in range(n)]
        collect(loader, storages, keep=False)
        stats = loader.stats()
    assert stats.loads == n and stats.errors == 0, stats
    assert stats.slot_loads == n, stats
    assert stats.fallbacks == 0 and getattr(stats, "copies", 0) == 0 and stats.regrows == 0, stats


def test_later_samples_that_differ_are_delivered_exactly(tmp_store):
    samples = [
        traj(0, n=4),  # sizes the rings
        traj(5, n=4),
        traj(1, n=40),  # larger: the ring regrows
        {"obs": np.zeros((3, 3), np.float64)},  # different structure and dtype
        [traj(2, n=2), traj(3, n=3)],  # a list of another length
        traj(4, n=1),  # smaller again
        {"obs": torch.arange(10).reshape(2, 5).T},  # non-contiguous
    ]
    with FileStorageLoader(tmp_store, worker_num=1) as loader:
        out = collect(loader, [loader.save(s) for s in samples])
        stats = loader.stats()
    for a, b in zip(samples, out, strict=False):
        assert_same(a, b)
    assert stats.regrows >= 1 and stats.errors == 0


def test_non_file_storages_use_the_slot_path():
    samples = [traj(i) for i in range(6)]
    with FileStorageLoader("unused", worker_num=2) as loader:
        out = collect(loader, [MemoryStorage(s) for s in samples])
        stats = loader.stats()
    for a, b in zip(samples, out, strict=False):
        assert_same(a, b)
    assert stats.slot_loads == 6


def test_bad_files_fail_their_future_and_the_loader_goes_on(tmp_store, caplog):
    with FileStorageLoader(tmp_store, worker_num=2) as loader:
        good = loader.save(traj(1))
        loader.start()  # the workers, ready: a fresh loader reads its first files on its own thread
        assert_same(traj(1), loader.load_async(good).result(timeout=30))
        truncated, corrupt, foreign = (loader.save(traj(i)) for i in range(3))
        with open(truncated.path, "r+b") as f:
            f.truncate(100)
        with open(corrupt.path, "r+b") as f:
            f.seek(40)
            f.write(b"\xff\xff")
        with open(foreign.path, "wb") as f:
            f.write(b"\x89PNG\r\n\x1a\n" + bytes(100))
        missing = FileStorage(tmp_store / "missing.tsl")
        called = []
        with caplog.at_level(logging.WARNING, logger="torch_storage_loader"):
            futures = {s: loader.load(s, called.append) for s in (truncated, corrupt, foreign, missing)}
            for s, f in futures.items():
                exc = f.exception(timeout=30)
                assert isinstance(exc, StorageCorruptError if s is not missing else StorageNotFoundError)
                assert s.path in str(exc)
                assert "Traceback" in str(exc.__cause__)  # the worker's traceback
        assert called == []
        assert sum(s.path in r.getMessage() for r in caplog.records for s in futures) == 4
        assert_same(traj(1), loader.load_async(good).result(timeout=30))
        assert loader.stats().errors == 4


def test_a_raising_callback_is_logged_and_the_loader_goes_on(tmp_store, caplog):
    def bad(obj):
        raise ValueError("boom in callback")

    with FileStorageLoader(tmp_store, worker_num=1) as loader:
        s = loader.save(traj(1))
        with caplog.at_level(logging.ERROR, logger="torch_storage_loader"):
            loader.load(s, bad).result(timeout=30)
            loader.load(s, bad).result(timeout=30)
        assert_same(traj(1), loader.load_async(s).result(timeout=30))
    assert sum("boom in callback" in (r.exc_text or "") for r in caplog.records) == 2


def test_a_killed_worker_is_replaced_and_its_load_retried(tmp_path):
    with FileStorageLoader(tmp_path / "s", worker_num=2) as loader:
        loader.load_async(MemoryStorage(traj(0))).result(timeout=30)
        once = loader.load_async(KillStorage(str(tmp_path / "marker")))
        assert once.result(timeout=60)["survived"].tolist() == [1]
        always = loader.load_async(KillStorage(None))
        assert isinstance(always.exception(timeout=60), WorkerDiedError)
        assert_same(traj(5), loader.load_async(MemoryStorage(traj(5))).result(timeout=30))
        stats = loader.stats()
    assert stats.worker_restarts == 3 and stats.retries == 2


def test_ttl_spares_queued_files_and_counts_expired_ones(tmp_store):
    never_loaded = pytest.warns(UserWarning, match=r"^1 file FileStorageLoader\(.*before anyone loaded them")
    with never_loaded, FileStorageLoader(tmp_store, ttl=0.3, worker_num=1, max_inflight_per_worker=1) as loader:
        loader.load_async(MemoryStorage(traj(0))).result(timeout=30)  # start the worker
        blocker = loader.load_async(SleepStorage(1.5))
        queued = loader.save(traj(1))
        never = loader.save(traj(2))
        future = loader.load_async(queued)  # waits behind the sleeper well past the ttl
        blocker.result(timeout=30)
        assert_same(traj(1), future.result(timeout=30))
        deadline = time.monotonic() + 10
        while os.path.exists(never.path) or os.path.exists(queued.path):
            assert time.monotonic() < deadline, "expired files were not deleted"
            time.sleep(0.05)
        stats = loader.stats()
    assert stats.expired == 2 and stats.expired_unloaded == 1


def test_shutdown_waits_for_pending_loads(tmp_store):
    loader = FileStorageLoader(tmp_store, worker_num=2)
    storages = [loader.save(traj(i)) for i in range(12)]
    futures = [loader.load_async(s) for s in storages]
    loader.shutdown()
    for i, f in enumerate(futures):
        assert f.done()
        assert_same(traj(i), f.result())


def test_shutdown_timeout_fails_what_is_left(tmp_store):
    loader = FileStorageLoader(tmp_store, worker_num=1)
    loader.load_async(MemoryStorage(traj(0))).result(timeout=30)
    slow = [loader.load_async(SleepStorage(2)) for _ in range(3)]
    loader.shutdown(timeout=0.2)
    for f in slow:
        assert isinstance(f.exception(timeout=0), LoadCancelledError)


def test_loader_is_reusable_after_shutdown(tmp_store):
    loader = FileStorageLoader(tmp_store, worker_num=1)
    for round_ in range(2):
        s = loader.save(traj(round_))
        assert_same(traj(round_), loader.load_async(s).result(timeout=30))
        assert_same(traj(round_), loader.load_async(s).result(timeout=30))
        loader.shutdown()


def test_to_storage_alias_and_validation(tmp_store):
    with pytest.raises(ValueError, match="worker_num=0 must be >= 1"):
        FileStorageLoader(tmp_store, worker_num=0)
    with pytest.raises(ValueError, match="ttl=0 must be > 0"):
        FileStorageLoader(tmp_store, ttl=0)
    with FileStorageLoader(tmp_store) as loader:
        s = loader.to_storage({"a": np.ones(2)})
        assert isinstance(s, FileStorage) and os.path.dirname(s.path) == str(tmp_store)
        with pytest.raises(TypeError, match="Storage handle"):
            loader.load("not a storage", print)


def test_too_little_shared_memory_is_a_clear_error():
    with pytest.raises(InsufficientSharedMemoryError, match="--shm-size") as info:
        ShmSegment(1 << 52)
    assert info.value.needed == 1 << 52


def test_a_segment_never_has_a_name_that_a_kill_could_leave_behind():
    """Segments are opened with O_TMPFILE: no ``tsl-*`` name exists, even for a moment, so a process
    SIGKILLed while it makes one leaves no empty file in /dev/shm (mkstemp + unlink left one)."""
    before = set(os.listdir(shm_dir()))
    seg = ShmSegment(1 << 16)
    try:
        target = os.readlink(f"/proc/self/fd/{seg._fd}")
        assert re.fullmatch(re.escape(os.path.realpath(shm_dir())) + r"/#[0-9]+ \(deleted\)", target), target
    finally:
        seg.close()
    assert set(os.listdir(shm_dir())) <= before


@pytest.fixture
def tiny_shm(tmp_path, monkeypatch):
    where = tmp_path / "tiny"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    monkeypatch.setenv("TORCH_STORAGE_LOADER_SHM_DIR", str(where))
    yield where
    subprocess.run(["umount", str(where)], check=True)


def test_small_dev_shm_fails_the_load_with_the_fix_not_a_bus_error(tmp_store, tiny_shm):
    big = {"obs": np.ones((1 << 20,), np.float32)}  # 4 MiB a slot, 1 MiB of tmpfs
    with FileStorageLoader(tmp_store, worker_num=1) as loader:
        s = loader.save(big)
        exc = loader.load_async(s).exception(timeout=30)
    assert isinstance(exc, InsufficientSharedMemoryError), exc
    assert "shm-size" in str(exc) and str(tiny_shm) in str(exc)


CLEAN_EXIT = """
import numpy as np, sys
from torch_storage_loader import FileStorageLoader
if __name__ == "__main__":
    loader = FileStorageLoader(sys.argv[1], worker_num=2, mp_context=sys.argv[2])
    handles = [loader.save({"x": np.full(1000, i)}) for i in range(10)]
    kept = [loader.load_async(h).result(timeout=60) for h in handles]
    assert [int(k["x"][0]) for k in kept] == list(range(10))
    print("done", flush=True)
    # no shutdown(): interpreter exit must clean up
"""


@pytest.mark.parametrize("method", START_METHODS)
def test_clean_exit_under_dev_mode_and_werror(tmp_path, method):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(CLEAN_EXIT))
    before = set(os.listdir("/dev/shm"))
    proc = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "error", str(script), str(tmp_path / "s"), method],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "done"
    assert proc.stderr == "", proc.stderr
    assert set(os.listdir("/dev/shm")) <= before
    assert len([p for p in (tmp_path / "s").iterdir() if p.name.endswith(".tsl")]) == 10  # kept for their TTL


FIRST_LOAD = """
import sys, time
import numpy as np
import torch  # what a training script imports: forkserver and spawn workers import it again
from torch_storage_loader import FileStorage, FileStorageLoader

if __name__ == "__main__":
    directory, method = sys.argv[1], sys.argv[2]
    handle = FileStorage(directory + "/sample.tsl")
    handle.save({"obs": np.ones((4, 1 << 18), np.float32), "step": 3})  # 4 MiB
    handle.load()  # the page cache and the reader's imports warm, as for the loader
    start = time.perf_counter()
    handle.load()
    plain = time.perf_counter() - start
    loader = FileStorageLoader(directory + "/own", worker_num=2, mp_context=method)
    start = time.perf_counter()
    sample = loader.load_async(handle).result(timeout=60)
    first = time.perf_counter() - start
    assert sample["step"] == 3 and float(sample["obs"].sum()) == 4 * (1 << 18)
    del sample
    for _ in range(10):  # then the workers, once ready, take over
        loader.load_async(handle).result(timeout=60)
    stats = loader.stats()
    loader.shutdown()
    print(f"{plain:.4f} {first:.4f} {dict(stats).get('local_loads', 0)} {stats.slot_loads}")
"""


@pytest.mark.parametrize("method", START_METHODS)
def test_first_load_is_as_fast_as_reading_the_sample(tmp_path, method):
    proc = run_script(FIRST_LOAD, tmp_path, args=(str(tmp_path), method))
    assert proc.returncode == 0, proc.stderr[-4000:]
    plain, first, local_loads, slot_loads = proc.stdout.split()
    # A small multiple of a plain load (tens of ms), not a worker's start (seconds under forkserver).
    assert float(first) < 10 * float(plain) + 0.25, proc.stdout
    assert int(local_loads) >= 1 and int(local_loads) + int(slot_loads) == 11, proc.stdout


CTRL_C = """
import faulthandler, os, signal, sys, time, numpy as np
from torch_storage_loader import FileStorageLoader
if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for stacks if it hangs
    # As in a terminal: a suite run as a background job hands its children SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with FileStorageLoader(sys.argv[1], worker_num=2) as loader:
        h = loader.save({"x": np.zeros(100000)})
        loader.start()  # the workers, ready: the first loads would be read on the loader's own thread
        loader.load_async(h).result()
        loader.load_async(h).result()
        print(*[w.proc.pid for w in loader._workers], flush=True)
        while True:
            loader.load(h, lambda obj: None)
            time.sleep(0.001)
"""


def test_ctrl_c_stops_workers_and_leaves_nothing(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(CTRL_C))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "s")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a session of its own: a hang is cleaned up with killpg, workers included
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # every thread's stack, to stderr
            time.sleep(2)
            kill_session(proc.pid)
            _, err = proc.communicate()
            pytest.fail(f"still running 60 s after Ctrl-C; its stacks and stderr:\n{err[-6000:]}")
    finally:
        if proc.poll() is None:  # failed before it ended: it, its workers and its forkserver go
            kill_session(proc.pid)
            proc.communicate()
    assert "KeyboardInterrupt" in err
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or _state(pid) == "Z"
    # The saved file outlives the interrupted process (its TTL had not expired), whole.
    (saved,) = (tmp_path / "s").iterdir()
    assert FileStorage(saved).load()["x"].shape == (100000,)


def test_shutdown_delivers_a_load_that_ctrl_c_interrupted_before_it_woke_the_loader(tmp_store, monkeypatch):
    """Ctrl-C can land in ``load()`` after the request was queued and before the receiving thread
    was woken (CI saw it: the Ctrl-C test above hung in ``__exit__`` for 60 s, the receiving thread
    asleep with the workers idle). The ``with`` block's ``shutdown()`` must still deliver that load,
    not wait for ever. The signal is placed there by making the wake raise what it would."""
    got = []
    with FileStorageLoader(tmp_store, worker_num=1) as loader:
        h = loader.save({"x": np.arange(10)})
        loader.start()
        loader.load_async(h).result(timeout=30)  # the workers are ready and idle: only a wake wakes it

        def interrupted() -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr(loader._pool, "wake", interrupted)
        with pytest.raises(KeyboardInterrupt):
            loader.load(h, got.append)
        monkeypatch.undo()
        done = threading.Thread(target=loader.shutdown, daemon=True)
        done.start()
        done.join(timeout=30)
        assert not done.is_alive(), "shutdown() waits for a load nobody will dispatch"
    assert len(got) == 1 and np.array_equal(got[0]["x"], np.arange(10))


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def test_stats_read_by_attribute_or_by_name_like_every_stats():
    from torch_storage_loader import LoaderStats

    stats = LoaderStats(loads=3, bytes=10)
    assert stats.loads == stats["loads"] == 3 and dict(stats) == stats.as_dict()
    assert "bytes" in stats and len(stats) == len(stats.as_dict())
    with pytest.raises(KeyError):
        stats["as_dict"]
