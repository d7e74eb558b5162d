"""FileStorageLoader's file lifetimes: TTL, shutdown, files left by other processes, ``clean``, fork."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time
import uuid

import pytest
from _helpers import MemoryStorage, SleepStorage
from conftest import assert_same, traj

from torch_storage_loader import FileStorage, FileStorageLoader, StorageQueue
from torch_storage_loader.file_loader import new_file_name

HOUR = 3600.0


def produce_and_exit(queue, directory: str, count: int) -> None:
    """A collector process as users write it: save, hand the handles on, end (shutdown included)."""
    with FileStorageLoader(directory, ttl=30, worker_num=1) as loader, queue.producer():
        for i in range(count):
            queue.put(loader.save(traj(i)))
    queue.close()


SAVE_AND_EXIT = """
import sys, numpy as np
from torch_storage_loader import FileStorageLoader
with FileStorageLoader(sys.argv[1], ttl=30, worker_num=1) as loader:
    for i in range(int(sys.argv[2])):
        loader.save({"i": np.full(4, i)})
"""


def wait_until(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def age(path: str, seconds: float) -> None:
    """Set ``path``'s mtime ``seconds`` in the past."""
    t = time.time() - seconds
    os.utime(path, (t, t))


def old_name(seconds: float) -> str:
    """A name ``new_file_name()`` gave ``seconds`` ago (names start with their save time)."""
    return f"{time.time_ns() - int(seconds * 1e9):020d}-{os.getpid()}-{uuid.uuid4().hex[:12]}.tsl"


def make_old(path: str, seconds: float) -> str:
    """Turn a file just saved into one saved ``seconds`` ago: its name and its mtime; returns its path."""
    new = os.path.join(os.path.dirname(path), old_name(seconds))
    os.rename(path, new)
    age(new, seconds)
    return new


def test_handles_outlive_the_producer_that_saved_them(tmp_path):
    directory = str(tmp_path / "store")
    queue = StorageQueue()
    proc = mp.get_context("spawn").Process(target=produce_and_exit, args=(queue, directory, 6))
    proc.start()
    handles = list(queue)  # until the producer's close()
    proc.join(timeout=60)
    assert proc.exitcode == 0 and len(handles) == 6
    with FileStorageLoader(directory, ttl=30, worker_num=1) as loader:
        for i, handle in enumerate(handles):
            assert_same(traj(i), loader.load_async(handle).result(timeout=60))
        assert loader.stats().errors == 0


def test_files_expire_after_their_ttl_but_not_while_their_load_is_queued(tmp_store):
    never_loaded = pytest.warns(UserWarning, match=r"^1 file FileStorageLoader\(.*before anyone loaded them")
    with never_loaded, FileStorageLoader(tmp_store, ttl=0.3, worker_num=1, max_inflight_per_worker=1) as loader:
        loader.load_async(MemoryStorage(traj(0))).result(timeout=60)  # start the worker
        unloaded = loader.save(traj(1))
        pinned = loader.save(traj(2))
        blocker = loader.load_async(SleepStorage(1.2))
        future = loader.load_async(pinned)  # queued behind the sleeper, well past the TTL
        wait_until(lambda: not os.path.exists(unloaded.path), "an expired file was not deleted")
        assert not future.done() and os.path.exists(pinned.path)  # expired, but its load is queued
        blocker.result(timeout=60)
        assert_same(traj(2), future.result(timeout=60))
        # (the cleaner counts a file once it deleted it: wait for the count, not only the file)
        wait_until(lambda: loader.stats().expired == 2, "a loaded, expired file was not deleted")
        assert not os.path.exists(pinned.path)
        stats = loader.stats()
    assert stats.expired == 2 and stats.expired_unloaded == 1 and stats.errors == 0


def test_shutdown_keeps_files_until_their_ttl_unless_asked_to_remove_them(tmp_store):
    with FileStorageLoader(tmp_store, ttl=30, worker_num=1) as loader:
        kept = [loader.save(traj(i)) for i in range(3)]
    assert all(os.path.exists(h.path) for h in kept)
    with FileStorageLoader(tmp_store, ttl=30, worker_num=1, remove_on_shutdown=True) as loader:
        removed = [loader.save(traj(i)) for i in range(3)]
        assert_same(traj(0), loader.load_async(removed[0]).result(timeout=60))
    assert not any(os.path.exists(h.path) for h in removed)
    assert all(os.path.exists(h.path) for h in kept)  # another loader's files are not its to remove


def test_a_new_loader_removes_expired_files_a_dead_process_left(tmp_store):
    done = subprocess.run(
        [sys.executable, "-c", SAVE_AND_EXIT, str(tmp_store), "5"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    left = sorted(str(tmp_store / n) for n in os.listdir(tmp_store))
    assert len(left) == 5  # a collector that ended keeps its files for their TTL
    stale, fresh = left[:3], left[3:]
    others = {  # name -> age in seconds: none of these is the scan's to delete
        "notes.txt": HOUR,
        "0001.tsl": HOUR,
        old_name(HOUR) + ".loaded": HOUR,
        old_name(HOUR) + ".claimed-host-123": HOUR,  # a DirectorySource consumer claimed it
        f".{old_name(120)}.{uuid.uuid4().hex}.tmp": 120,  # being written: a temporary gets 10 minutes
    }
    dead_tmp = f".{old_name(2 * HOUR)}.{uuid.uuid4().hex}.tmp"  # its writer died two hours ago
    for name, seconds in [*others.items(), (dead_tmp, 2 * HOUR)]:
        (tmp_store / name).write_bytes(b"x")
        age(str(tmp_store / name), seconds)

    stale = [make_old(stale[0], HOUR), make_old(stale[1], HOUR), make_old(stale[2], HOUR)]
    age(stale[2], 0)  # expires only once its load is queued

    with FileStorageLoader(tmp_store, ttl=60, worker_num=1, max_inflight_per_worker=1) as loader:
        loader.load_async(MemoryStorage(traj(0))).result(timeout=60)  # start the worker (and the cleaner)
        blocker = loader.load_async(SleepStorage(1.0))
        future = loader.load_async(FileStorage(stale[2]))  # queued behind the sleeper
        age(stale[2], HOUR)
        loader.clean_expired()  # what the cleaner thread does every second
        assert not any(os.path.exists(p) for p in [*stale[:2], tmp_store / dead_tmp])
        assert os.path.exists(stale[2]) and not future.done()  # expired, but its load is queued
        blocker.result(timeout=60)
        assert future.result(timeout=60)["i"].tolist() == [2] * 4
        wait_until(lambda: not os.path.exists(stale[2]), "the loaded stale file was not removed")
        stats = loader.stats()
    assert stats.expired == 4 and stats.expired_unloaded == 0
    assert sorted(os.listdir(tmp_store)) == sorted([*others, *map(os.path.basename, fresh)])
    for name in others:
        os.remove(tmp_store / name)  # (the fixture checks that no test leaves a temporary behind)


def test_ttl_none_keeps_every_file(tmp_store):
    tmp_store.mkdir()
    old = str(tmp_store / new_file_name())
    FileStorage(old).save(traj(0))
    age(old, HOUR)
    with FileStorageLoader(tmp_store, ttl=None, worker_num=1) as loader:
        mine = loader.save(traj(1))
        assert_same(traj(0), loader.load_async(FileStorage(old)).result(timeout=60))
        assert loader.clean_expired() == 0
    assert os.path.exists(old) and os.path.exists(mine.path)


def run_clean(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch_storage_loader", "clean", *args], capture_output=True, text=True, timeout=60
    )


def test_clean_command(tmp_store):
    tmp_store.mkdir()
    old = [str(tmp_store / old_name(120)) for _ in range(2)]
    young = str(tmp_store / new_file_name())
    for path in [*old, young]:
        FileStorage(path).save(traj(0))
    for path in old:
        age(path, 120)
    foreign = tmp_store / "keep.txt"
    foreign.write_text("x")
    age(str(foreign), HOUR)

    dry = run_clean(str(tmp_store), "--older-than", "60", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines() == [f"would remove {p}" for p in old] + [
        f"would remove 2 files older than 60 s from {tmp_store}"
    ]
    assert all(os.path.exists(p) for p in [*old, young])

    real = run_clean(str(tmp_store), "--older-than", "60")
    assert real.returncode == 0, real.stderr
    assert real.stdout.splitlines() == [f"removed {p}" for p in old] + [
        f"removed 2 files older than 60 s from {tmp_store}"
    ]
    assert sorted(os.listdir(tmp_store)) == sorted([os.path.basename(young), "keep.txt"])

    again = run_clean(str(tmp_store), "--older-than", "60")
    assert again.returncode == 0 and again.stdout.strip().startswith("removed 0 files")

    missing = run_clean(str(tmp_store / "nope"), "--older-than", "60")
    assert missing.returncode != 0 and "nope" in missing.stderr and "not a directory" in missing.stderr
    assert missing.stdout == ""


def test_help_describes_demo_and_clean():
    out = subprocess.run(
        [sys.executable, "-m", "torch_storage_loader", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "demo" in out.stdout and "clean DIR --older-than SECONDS" in out.stdout


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_never_deletes_the_parents_files(tmp_store):
    from torch_storage_loader import loader as loader_module

    loader = FileStorageLoader(tmp_store, ttl=30, worker_num=1, remove_on_shutdown=True)
    try:
        handles = [loader.save(traj(i)) for i in range(3)]  # the TTL cleaner thread runs now
        pid = os.fork()
        if pid == 0:  # the child: shut the inherited loader down, then run the exit hook, and leave
            code = 1
            try:
                loader.shutdown()
                loader_module._shutdown_live_loaders()
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert all(os.path.exists(h.path) for h in handles)
        for i, h in enumerate(handles):
            assert_same(traj(i), loader.load_async(h).result(timeout=60))
    finally:
        loader.shutdown()
    assert not any(os.path.exists(h.path) for h in handles)  # the parent's own shutdown still removes them


# Issue 28: files that expired before anyone loaded them were deleted in silence; the user only saw
# a StorageNotFoundError at the load that came too late.
UNLOADED = r"5 files FileStorageLoader\(.*\) saved were deleted by its ttl=1 s before anyone loaded them"


def _expiry_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "before anyone loaded them" in str(w.message)]


def test_files_that_expire_unloaded_are_warned_about_once_per_loader(tmp_store):
    with (
        pytest.warns(UserWarning, match=UNLOADED) as record,
        FileStorageLoader(tmp_store, ttl=1, worker_num=1) as loader,
    ):
        handles = [loader.save(traj(i)) for i in range(5)]
        wait_until(lambda: not any(os.path.exists(h.path) for h in handles), "the ttl deleted nothing")
        wait_until(lambda: _expiry_warnings(record), "no warning")
        late = [loader.save(traj(i)) for i in range(2)]  # expire unloaded too: counted, not warned again
        wait_until(lambda: not any(os.path.exists(h.path) for h in late), "the ttl deleted nothing")
        assert loader.stats().expired_unloaded == 7
    (message,) = _expiry_warnings(record)
    assert "raise ttl=" in message and "expired_unloaded" in message


def test_files_loaded_in_time_are_not_warned_about(tmp_store):
    with FileStorageLoader(tmp_store, ttl=1, worker_num=1) as loader:
        handles = [loader.save(traj(i)) for i in range(3)]
        for i, handle in enumerate(handles):
            assert_same(traj(i), loader.load_async(handle).result(timeout=60))
        wait_until(lambda: not any(os.path.exists(h.path) for h in handles), "the ttl deleted nothing")
        stats = loader.stats()
    assert stats.expired == 3 and stats.expired_unloaded == 0  # and no warning (an error under pytest)


def test_files_another_loader_loaded_are_not_warned_about(tmp_store):
    # A collector saves and hands the handles on; a learner's loader (here another loader, whose
    # workers are other processes) loads them. The collector's loader never loads, yet its files
    # were read: no warning.
    with FileStorageLoader(tmp_store, ttl=1, worker_num=1) as collector:
        handles = [collector.save(traj(i)) for i in range(3)]
        with FileStorageLoader(tmp_store, ttl=None, worker_num=1) as learner:
            for i, handle in enumerate(handles):
                assert_same(traj(i), learner.load_async(handle).result(timeout=60))
        wait_until(lambda: not any(os.path.exists(h.path) for h in handles), "the ttl deleted nothing")
        stats = collector.stats()
    assert stats.expired == 3 and stats.expired_unloaded == 0


LOAD_TOO_LATE = """
import time
import numpy as np
from torch_storage_loader import FileStorageLoader, StorageNotFoundError

if __name__ == "__main__":
    with FileStorageLoader("replay", ttl=1, worker_num=1) as loader:
        handles = [loader.save({"x": np.full(4, i)}) for i in range(5)]
        time.sleep(2.5)
        try:
            loader.load_async(handles[0]).result(timeout=60)
        except StorageNotFoundError:
            print("not found")
"""


def test_a_script_that_loads_too_late_is_told_how_many_files_expired_and_which_ttl_to_raise(tmp_path):
    from _helpers import run_script

    done = run_script(LOAD_TOO_LATE, tmp_path, timeout=120)
    assert done.returncode == 0 and done.stdout == "not found\n", done.stderr
    assert "UserWarning: 5 files FileStorageLoader('" in done.stderr and "ttl=1 s" in done.stderr, done.stderr
