"""Worker supervision: start-up off the caller's thread, deaths, retries, fork safety, budgets."""

from __future__ import annotations

import collections
import multiprocessing as mp
import os
import random
import signal
import threading
import time
import traceback

import numpy as np
import pytest
import torch
from _helpers import EpisodeMissing, KillStorage, RaisingStorage, SleepStorage
from conftest import assert_same, traj

import torch_storage_loader.loader as loader_module
from torch_storage_loader import FileStorageLoader, WorkerDiedError
from torch_storage_loader.errors import RemoteTraceback


def test_the_first_load_returns_at_once_and_its_callback_fires(tmp_path):
    got = []
    with FileStorageLoader(tmp_path / "s", worker_num=2) as loader:
        start = time.monotonic()
        future = loader.load(SleepStorage(2), got.append)
        returned = time.monotonic() - start
        assert future.result(timeout=60) is None
        assert time.monotonic() - start >= 2
    assert returned < 0.5, f"the first load() blocked for {returned:.2f} s"
    assert [g["slept"].tolist() for g in got] == [[2.0]]


def test_errors_raised_on_purpose_reach_the_caller_as_they_are(tmp_path):
    with FileStorageLoader(tmp_path / "s", worker_num=1) as loader:
        exc = loader.load_async(RaisingStorage("ep-7")).exception(timeout=60)
        assert type(exc) is EpisodeMissing and "episode ep-7 is gone" in str(exc)
        assert isinstance(exc.__cause__, RemoteTraceback) and "in load" in str(exc.__cause__)
        handle = loader.save(traj(3))
        assert_same(traj(3), loader.load_async(handle).result(timeout=60))
        assert loader.stats().worker_restarts == 0


def test_a_load_that_kills_every_worker_fails_with_worker_died_error_naming_it(tmp_path):
    with FileStorageLoader(tmp_path / "s", worker_num=2) as loader:
        storage = KillStorage(None)
        exc = loader.load_async(storage).exception(timeout=60)
        handle = loader.save(traj(1))
        assert_same(traj(1), loader.load_async(handle).result(timeout=60))  # the loader goes on
        stats = loader.stats()
    assert type(exc) is WorkerDiedError and repr(storage) in str(exc) and exc.storage == storage
    assert stats.retries == 1 and stats.worker_restarts == 2 and stats.errors == 1


def test_replies_sent_before_a_worker_died_are_delivered_not_retried(tmp_path):
    # One worker gets a sample and then a handle that kills it: the sample's reply (descriptors
    # included) is already in the socket when the parent learns of the death.
    with FileStorageLoader(tmp_path / "s", worker_num=1, max_inflight_per_worker=2) as loader:
        for i in range(5):
            handle = loader.save({"x": np.full(300_000, i, np.int32)})
            sample = loader.load_async(handle)
            killer = loader.load_async(KillStorage(str(tmp_path / f"marker{i}")))
            assert int(sample.result(timeout=60)["x"][0]) == i
            assert killer.result(timeout=60)["survived"].tolist() == [1]
        stats = loader.stats()
    assert stats.retries == 5 and stats.errors == 0


# ------------------------------------------------------------------------------------------- soak
def _varied_sample(rng: np.random.Generator, i: int):
    """A tree of one of several structures, from empty to about 2 MB, tagged with ``i``."""
    kind = i % 6
    n = int(rng.integers(0, 64))
    if kind == 0:
        return traj(i, n=max(1, n))
    if kind == 1:
        dtype = rng.choice([np.float32, np.float64, np.int8, np.uint16, np.int64, np.bool_, np.complex64])
        return {"x": rng.random((n, int(rng.integers(1, 300)))).astype(dtype), "i": i}
    if kind == 2:
        return [{"obs": np.full((k + 1, 3), i, np.float32), "r": float(k)} for k in range(n % 12)]
    if kind == 3:
        return (torch.arange(n * 100, dtype=torch.int32) + i, None, f"tag-{i}", b"\x00" * (n % 5))
    if kind == 4:
        return {"big": np.full(int(rng.integers(100_000, 500_000)), i, np.float32), "meta": {"i": i}}
    return {"empty": np.zeros((0, 4)), "scalar": np.float64(i), "nested": [[{"t": torch.ones(n % 7, 2) * i}]]}


@pytest.mark.slow
def test_soak_random_sigkills_lose_and_corrupt_nothing(tmp_path):
    loads, samples_n, window = 2000, 200, 24
    rng = np.random.default_rng(7)
    samples = [_varied_sample(rng, i) for i in range(samples_n)]
    order = [i for i in range(samples_n) for _ in range(loads // samples_n)]
    random.Random(7).shuffle(order)
    kills, done = [0], threading.Event()

    with FileStorageLoader(tmp_path / "s", ttl=None, worker_num=3) as loader:
        handles = [loader.save(s) for s in samples]

        def killer():
            pick = random.Random(11)
            while not done.wait(pick.uniform(0.05, 0.3)):
                pids = [w.proc.pid for w in loader._workers]
                if pids:
                    try:
                        os.kill(pick.choice(pids), signal.SIGKILL)
                        kills[0] += 1
                    except ProcessLookupError:
                        pass

        thread = threading.Thread(target=killer, name="soak-killer")
        delivered, failures, others = 0, [], []
        kept = collections.deque(maxlen=64)  # held while later loads run: none may overwrite them
        started = time.monotonic()
        thread.start()
        try:
            inflight = collections.deque()
            submitted = 0

            def settle() -> None:
                nonlocal delivered
                j, future = inflight.popleft()
                exc = future.exception(timeout=120)  # raises TimeoutError if the load was lost
                if isinstance(exc, WorkerDiedError):
                    failures.append(exc)
                elif exc is not None:
                    others.append("".join(traceback.format_exception(exc)))
                else:
                    obj = future.result()
                    assert_same(samples[j], obj)
                    kept.append((j, obj))
                    delivered += 1

            # At least `loads` loads and 20 kills: a quiet machine gets through 2,000 loads in 2 s.
            while submitted < loads or (kills[0] < 20 and submitted < 20 * loads):
                i = order[submitted % len(order)]
                submitted += 1
                inflight.append((i, loader.load_async(handles[i])))
                while len(inflight) > window:
                    settle()
            while inflight:
                settle()
        finally:
            done.set()
            thread.join()
        elapsed = time.monotonic() - started
        stats = loader.stats()
    for j, obj in kept:
        assert_same(samples[j], obj)
    print(
        f"\nsoak: {submitted} loads in {elapsed:.1f} s, {kills[0]} workers SIGKILLed, {stats.retries} retries, "
        f"{stats.worker_restarts} restarts, {len(failures)} WorkerDiedError, {len(others)} other errors, "
        f"{delivered} delivered intact; {stats.slot_loads} slot, {stats.fallbacks} fallback, "
        f"{stats.oversize} oversize, {stats.copies} copied"
    )
    assert not others, others[0]
    assert delivered + len(failures) == submitted
    assert len(failures) < submitted / 100, [str(f) for f in failures[:3]]
    assert kills[0] >= 20 and stats.retries > 0


# ------------------------------------------------------------------------------------------- fork
def _use_inherited_loader(loader, handle, expected) -> None:
    """In a forked child: the parent's loader is a fresh one here, with workers of its own."""
    assert loader._workers == [] and not loader_module._live
    loader_module._shutdown_live_loaders()  # what the child's interpreter exit would run
    loader.shutdown()
    assert_same(expected, loader.load_async(handle).result(timeout=120))
    assert loader.stats().loads == 1
    loader.shutdown()


def _forked_child(loader, handle, expected) -> None:
    code = 1
    try:
        _use_inherited_loader(loader, handle, expected)
        import multiprocessing.util

        multiprocessing.util._exit_function()  # multiprocessing's own exit hook: it must not stop them either
        code = 0
    except BaseException:  # noqa: BLE001 - report, never return into pytest
        traceback.print_exc()
    finally:
        os._exit(code)


@pytest.mark.parametrize("how", ["os.fork", "fork context"])
def test_a_forked_child_never_acts_for_the_parents_workers(tmp_path, how):
    with FileStorageLoader(tmp_path / "s", ttl=None, worker_num=2) as loader:
        handle = loader.save(traj(4))
        loader.start()
        held = loader.load_async(handle).result(timeout=60)
        pids = sorted(w.proc.pid for w in loader._workers)
        if how == "os.fork":
            pid = os.fork()
            if pid == 0:
                _forked_child(loader, handle, traj(4))
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
        else:
            proc = mp.get_context("fork").Process(target=_use_inherited_loader, args=(loader, handle, traj(4)))
            proc.start()
            proc.join(120)
            assert proc.exitcode == 0
        assert sorted(w.proc.pid for w in loader._workers) == pids
        for p in pids:
            os.kill(p, 0)  # still running
        for _ in range(6):
            assert_same(traj(4), loader.load_async(handle).result(timeout=60))
        assert_same(traj(4), held)
        stats = loader.stats()
    assert stats.worker_restarts == 0 and stats.loads == 7 and stats.errors == 0


# ------------------------------------------------------------------------------------------ budget
def test_max_shm_bytes_is_validated_and_split_between_workers(tmp_path):
    with pytest.raises(ValueError, match="max_shm_bytes=0 must be >= 1"):
        FileStorageLoader(tmp_path / "s", max_shm_bytes=0)
    with FileStorageLoader(tmp_path / "s", worker_num=2, max_shm_bytes=2 << 20) as loader:
        small, big = loader.save({"x": np.ones(1000)}), loader.save({"x": np.ones(1 << 18)})  # 8 KB, 2 MiB
        assert_same({"x": np.ones(1000)}, loader.load_async(small).result(timeout=60))
        exc = loader.load_async(big).exception(timeout=60)
        stats = loader.stats()
    assert exc is not None and getattr(exc, "budget", None) == 1 << 20, exc  # each worker's share
    assert {"copies", "oversize", "fallbacks"} <= set(stats.as_dict())
