"""Shared fixtures: every test must leave no shared memory, process or thread of ours behind."""

from __future__ import annotations

import gc
import math
import multiprocessing as mp
import os
import threading
import time

import numpy as np
import pytest
import torch


def _our_shm() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("tsl-")}
    except FileNotFoundError:
        return set()


def _children() -> set[int]:
    me = str(os.getpid())
    kids = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":
            kids.add(int(pid))
    return kids


def _our_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("tsl-")}


@pytest.fixture(autouse=True)
def no_leaks():
    shm_before, kids_before = _our_shm(), _children()
    yield
    gc.collect()  # a DataLoader iterator caught in an exception's traceback stops its workers on collection
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        mp.active_children()  # reaps finished children
        leaked = (_our_shm() - shm_before, _children() - kids_before - _helpers(), _our_threads())
        if not any(leaked):
            return
        time.sleep(0.05)
    raise AssertionError(f"leaked (shm, child pids, threads): {leaked}")


def _helpers() -> set[int]:
    """Long-lived helper processes the stdlib keeps by design (forkserver, resource tracker)."""
    pids = set()
    from multiprocessing import forkserver, resource_tracker

    for obj in (forkserver._forkserver, resource_tracker._resource_tracker):
        pid = getattr(obj, "_forkserver_pid", None) or getattr(obj, "_pid", None)
        if pid:
            pids.add(pid)
    return pids


def assert_same(a, b, path="<root>"):
    """Deep equality that also checks container types, leaf types, dtypes and exact bytes."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: len {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, (np.ndarray, np.generic)):
        # Files are little-endian: a big-endian input comes back as the same values, little-endian.
        a = np.asarray(a).astype(a.dtype.newbyteorder("<"))
        b = np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), path
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        assert a.contiguous().view(-1).view(torch.uint8).tolist() == b.contiguous().view(-1).view(torch.uint8).tolist() \
            if a.numel() else True, path
    elif type(a).__module__.startswith("treetensor"):
        assert list(a.keys()) == list(b.keys()), path
        for k in a.keys():
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.fixture
def tmp_store(tmp_path):
    d = tmp_path / "store"
    yield d
    assert not d.exists() or not [p for p in d.iterdir() if p.name.endswith(".tmp")], "temporary files left"


@pytest.fixture
def handles(tmp_path):
    """24 saved trajectories, tagged 0..23."""
    from torch_storage_loader import FileStorage

    d = tmp_path / "store"
    d.mkdir()
    out = []
    for i in range(24):
        s = FileStorage(d / f"{i:04d}.tsl")
        s.save(traj(i))
        out.append(s)
    return out


def traj(i: int, n: int = 8) -> dict:
    """A small RL trajectory tagged with ``i`` everywhere."""
    return {
        "obs": np.full((n, 4, 8, 8), i, np.float32),
        "action": torch.full((n,), i, dtype=torch.int64),
        "reward": np.full(n, i, np.float32),
        "done": np.zeros(n, bool),
        "info": {"id": i, "name": f"traj-{i}"},
    }


START_METHODS = [m for m in ("fork", "spawn", "forkserver") if m in mp.get_all_start_methods()]
