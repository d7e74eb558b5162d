"""Ring lifetimes (issue 7, bug 1): samples that grow, shrink, jump (outliers) or are empty, kept
or dropped, through every way of loading. Every sample must arrive exact, kept samples must never
change, and nothing may hang.

Each sample is tagged with its index ``i``: ``id`` (a Python int, stored in the header), ``x``
(float32 values derived from ``i``) and ``b`` (bytes derived from ``i``), so any slot reused under
a sample still held, or any reference mapped onto the wrong ring, shows up as a wrong value.
"""

from __future__ import annotations

import tempfile
from concurrent.futures import wait

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from torch_storage_loader import FileStorage, FileStorageLoader, StorageDataset

UNIT = 1024  # float32 values per size unit (4 KiB)
BYTES_UNIT = 1001  # bytes per bytes unit (odd: bytes leaves are not aligned)
TIMEOUT = 60  # DataLoader(timeout=...) and Future.result(timeout=...): a hang is a failure, not a stuck run

SETTINGS = dict(
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)


# ----------------------------------------------------------------------------------- samples
def x_of(i: int, n: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) * 7 + i * 131) % 10007).astype(np.float32)


def b_of(i: int, nb: int) -> bytes:
    return ((np.arange(nb, dtype=np.int64) * 13 + i) % 256).astype(np.uint8).tobytes()


def make_sample(i: int, n: int, nb: int | None) -> dict:
    """Sample ``i``: ``n`` float32 values and ``nb`` bytes (both may be 0: then the data section is
    empty); ``nb=None``: no bytes leaf (bytes leaves cannot be stacked)."""
    if nb is None:
        return {"id": i, "x": x_of(i, n)}
    return {"id": i, "x": x_of(i, n), "b": b_of(i, nb)}


def as_numpy(x) -> np.ndarray:
    return x.numpy() if isinstance(x, torch.Tensor) else x


def check_sample(got, i: int, n: int, nb: int, *, tensors: bool) -> None:
    assert type(got) is dict and list(got) == ["id", "x", "b"], got
    assert got["id"] == i, (got["id"], i)
    x = got["x"]
    assert type(x) is (torch.Tensor if tensors else np.ndarray), type(x)
    x = as_numpy(x)
    assert x.dtype == np.float32 and x.shape == (n,), (i, x.dtype, x.shape, n)
    assert x.tobytes() == x_of(i, n).tobytes(), f"sample {i}: x changed"
    assert type(got["b"]) is bytes and got["b"] == b_of(i, nb), f"sample {i}: b changed"


def save_all(directory: str, sizes: list[tuple[int, int]]) -> list[FileStorage]:
    handles = []
    for i, (n, nb) in enumerate(sizes):
        h = FileStorage(f"{directory}/{i:05d}.tsl")
        h.save(make_sample(i, n, nb))
        handles.append(h)
    return handles


@st.composite
def size_plans(draw, max_len: int = 28) -> list[tuple[int, int]]:
    """(float32 count, bytes count) per sample: growing, shrinking or random, with 0-2 outliers 20-50x."""
    base = draw(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 3)), min_size=1, max_size=max_len))
    order = draw(st.sampled_from(["random", "grow", "shrink"]))
    if order == "grow":
        base.sort()
    elif order == "shrink":
        base.sort(reverse=True)
    top = max(1, max(u for u, _ in base))
    for _ in range(draw(st.integers(0, 2))):
        base.insert(draw(st.integers(0, len(base))), (draw(st.integers(20, 50)) * top, draw(st.integers(0, 3))))
    return [(u * UNIT, bu * BYTES_UNIT) for u, bu in base]


# ----------------------------------------------------------------------- FileStorageLoader
@settings(max_examples=25, **SETTINGS)
@given(sizes=size_plans(), keep=st.booleans(), window=st.integers(1, 12), use_callback=st.booleans())
def test_loader_ring_lifetime(sizes, keep, window, use_callback):
    with tempfile.TemporaryDirectory() as d:
        handles = save_all(d, sizes)
        kept: list = []
        errors: list = []
        with FileStorageLoader(d, ttl=None, worker_num=2, slots_per_worker=2, max_rings_per_worker=2) as loader:
            for start in range(0, len(handles), window):
                batch = list(range(start, min(start + window, len(handles))))
                if use_callback:

                    def callback(s, errors=errors):
                        try:
                            i = s["id"]
                            check_sample(s, i, *sizes[i], tensors=False)
                        except BaseException as exc:  # noqa: BLE001 - the loader would only log it
                            errors.append(exc)
                        if keep:
                            kept.append(s)

                    futures = [loader.load(handles[i], callback) for i in batch]
                    _done, not_done = wait(futures, timeout=TIMEOUT)
                    assert not not_done, "loads did not complete within 60 s"
                    for f in futures:
                        assert f.result() is None
                else:
                    futures = [loader.load_async(handles[i]) for i in batch]
                    for i, f in zip(batch, futures, strict=False):
                        s = f.result(timeout=TIMEOUT)
                        check_sample(s, i, *sizes[i], tensors=False)
                        if keep:
                            kept.append(s)
                        del s
                    del futures, f
                assert not errors, errors[0]
            stats = loader.stats()
        assert stats.loads == len(sizes) and stats.errors == 0, stats
        # Kept samples never change, even after the loader stopped and its rings were retired.
        assert sorted(s["id"] for s in kept) == (list(range(len(sizes))) if keep else [])
        for s in kept:
            check_sample(s, s["id"], *sizes[s["id"]], tensors=False)


# ----------------------------------------------------------------------- DataLoader, single samples
def _dataloader(dataset, num_workers: int, **kw) -> DataLoader:
    if num_workers:
        kw.update(num_workers=num_workers, timeout=TIMEOUT, multiprocessing_context="fork")
    return DataLoader(dataset, **kw)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_ring_lifetime(num_workers):
    @settings(max_examples=15 if num_workers else 30, **SETTINGS)
    @given(sizes=size_plans(), keep=st.booleans(), slots=st.integers(1, 3))
    def run(sizes, keep, slots):
        with tempfile.TemporaryDirectory() as d:
            handles = save_all(d, sizes)
            ds = StorageDataset(handles, slots_per_worker=slots, max_rings_per_worker=2)
            kept, seen = [], []
            for s in _dataloader(ds, num_workers, batch_size=None):
                i = s["id"]
                check_sample(s, i, *sizes[i], tensors=True)
                seen.append(i)
                if keep:
                    kept.append(s)
                del s
            assert sorted(seen) == list(range(len(sizes)))
            for s in kept:
                check_sample(s, s["id"], *sizes[s["id"]], tensors=True)
            stats = ds.stats()
            assert stats["loads"] == len(sizes), stats

    run()


# ------------------------------------------------------------------ dataset-side batching
def pad_collate(samples: list) -> dict:
    """Ragged samples (tensors, as the dataset hands them) into one padded batch."""
    lengths = [s["x"].shape[0] for s in samples]
    n = max(lengths)
    return {
        "id": torch.tensor([s["id"] for s in samples]),
        "len": torch.tensor(lengths),
        "x": torch.stack([torch.nn.functional.pad(s["x"], (0, n - s["x"].shape[0])) for s in samples]),
        "b": [s["b"] for s in samples],
    }


def check_padded_batch(batch: dict, sizes) -> list[int]:
    ids = batch["id"].tolist()
    assert batch["len"].tolist() == [sizes[i][0] for i in ids]
    assert batch["x"].shape == (len(ids), max(sizes[i][0] for i in ids))
    for j, i in enumerate(ids):
        n, nb = sizes[i]
        row = batch["x"][j].numpy()
        assert row[:n].tobytes() == x_of(i, n).tobytes(), f"sample {i}: x changed"
        assert not row[n:].any(), f"sample {i}: padding changed"
        assert batch["b"][j] == b_of(i, nb), f"sample {i}: b changed"
    return ids


def check_stacked_batch(batch: dict, sizes) -> list[int]:
    assert list(batch) == ["id", "x"], list(batch)
    ids = batch["id"].tolist() if isinstance(batch["id"], torch.Tensor) else list(batch["id"])
    n = sizes[ids[0]][0]
    assert batch["x"].shape == (len(ids), n)
    for j, i in enumerate(ids):
        assert sizes[i][0] == n
        assert batch["x"][j].numpy().tobytes() == x_of(i, n).tobytes(), f"sample {i}: x changed"
    return ids


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataset_side_batching_ring_lifetime(num_workers):
    @settings(max_examples=12 if num_workers else 25, **SETTINGS)
    @given(sizes=size_plans(), keep=st.booleans(), k=st.integers(1, 4), stack=st.booleans())
    def run(sizes, keep, k, stack):
        if stack:
            # Samples of one batch share their shape (and have no bytes leaf): stacked into one slot.
            # Worker w of W batches handles w, w+W, w+2W, ... (a finite source is dealt round-robin),
            # so handle j is the (j // W)-th of its worker's and lands in that worker's batch j // W // k.
            w = max(num_workers, 1)
            sizes = [(sizes[min(len(sizes) - 1, (j // w // k) * k)][0], None) for j in range(len(sizes))]
        check = check_stacked_batch if stack else check_padded_batch
        with tempfile.TemporaryDirectory() as d:
            handles = save_all(d, sizes)
            ds = StorageDataset(
                handles,
                batch_size=k,
                collate_fn=None if stack else pad_collate,
                slots_per_worker=2,
                max_rings_per_worker=2,
            )
            drain(_dataloader(ds, num_workers, batch_size=None), lambda b: check(b, sizes), keep, len(sizes))

    run()


def drain(batches, check, keep: bool, n: int) -> None:
    """Check every batch as it comes (keeping them all, or dropping each), then every kept one again."""
    kept, seen = [], []
    for batch in batches:
        seen += check(batch)
        if keep:
            kept.append(batch)
        del batch
    assert sorted(seen) == list(range(n))
    for batch in kept:
        check(batch)


# ------------------------------------------------------------------ DataLoader-side batching
def bytes_sample(i: int, nb: int) -> dict:
    """Sizes carried by a bytes leaf, so that DataLoader's default collate takes ragged samples."""
    return {"id": i, "b": b_of(i, nb), "y": np.full(3, i, np.int32)}


def check_default_collated(batch: dict, sizes_b) -> list[int]:
    ids = batch["id"].tolist()
    assert batch["y"].shape == (len(ids), 3) and batch["y"].dtype == torch.int32
    for j, i in enumerate(ids):
        assert batch["y"][j].tolist() == [i] * 3, f"sample {i}: y changed"
        assert batch["b"][j] == b_of(i, sizes_b[i]), f"sample {i}: b changed"
    return ids


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_side_batching_ring_lifetime(num_workers):
    @settings(max_examples=12 if num_workers else 25, **SETTINGS)
    @given(sizes=size_plans(), keep=st.booleans(), k=st.integers(1, 4))
    def run(sizes, keep, k):
        sizes_b = [4 * n + nb for n, nb in sizes]
        with tempfile.TemporaryDirectory() as d:
            handles = []
            for i, nb in enumerate(sizes_b):
                handles.append(FileStorage(f"{d}/{i:05d}.tsl"))
                handles[-1].save(bytes_sample(i, nb))
            ds = StorageDataset(handles, slots_per_worker=2, max_rings_per_worker=2)
            drain(
                _dataloader(ds, num_workers, batch_size=k),
                lambda b: check_default_collated(b, sizes_b),
                keep,
                len(sizes_b),
            )

    run()


# ------------------------------------------------------------------ the reported cases, exactly
STEP = (4, 16, 16)  # one step of an episode (scaled down from 4x84x84): 4 KiB of float32


def episode(i: int, steps: int) -> dict:
    return {
        "obs": np.full((steps, *STEP), i, np.float32) + np.arange(steps, dtype=np.float32)[:, None, None, None],
        "id": np.array([i], np.int64),
    }


def check_episode(s: dict, steps_of: dict) -> int:
    i = int(s["id"][0])
    steps = steps_of[i]
    assert s["obs"].shape == (steps, *STEP), (i, s["obs"].shape)
    assert torch.equal(s["obs"], torch.from_numpy(episode(i, steps)["obs"])), f"episode {i} changed"
    return i


@pytest.mark.parametrize("keep", [False, True], ids=["dropped", "kept"])
def test_sorted_growing_episodes_through_dataloader(tmp_path, keep):
    """Issue 7: 1..60-step episodes sorted by length, 2 workers; used to hang on a released descriptor."""
    steps_of = {}
    handles = []
    for i, steps in enumerate(range(1, 61)):
        steps_of[i] = steps
        handles.append(FileStorage(tmp_path / f"{i:03d}.tsl"))
        handles[-1].save(episode(i, steps))
    ds = StorageDataset(handles)
    kept, seen = [], []
    for s in DataLoader(ds, batch_size=None, num_workers=2, timeout=TIMEOUT):
        seen.append(check_episode(s, steps_of))
        if keep:
            kept.append(s)
        del s
    assert sorted(seen) == list(range(60))
    for s in kept:
        check_episode(s, steps_of)
    stats = ds.stats()
    # Growth is geometric: a handful of regrows per worker, not one per episode.
    assert stats["loads"] == 60 and stats["regrows"] <= 2 * 8 + (16 if keep else 0), stats


@pytest.mark.parametrize("keep", [False, True], ids=["dropped", "kept"])
def test_growing_bytes_leaves_with_dataloader_batching(tmp_path, keep):
    """Issue 7: the same regrow under DataLoader(dataset, batch_size=4) ('ring was replaced')."""
    handles, sizes_b = [], []
    for i in range(60):
        sizes_b.append(4096 * (i + 1) + i)
        handles.append(FileStorage(tmp_path / f"{i:03d}.tsl"))
        handles[-1].save(bytes_sample(i, sizes_b[-1]))
    kept, seen = [], []
    for batch in DataLoader(StorageDataset(handles), batch_size=4, num_workers=2, timeout=TIMEOUT):
        seen += check_default_collated(batch, sizes_b)
        if keep:
            kept.append(batch)
        del batch
    assert sorted(seen) == list(range(60))
    for batch in kept:
        check_default_collated(batch, sizes_b)


@pytest.mark.parametrize("keep", [False, True], ids=["dropped", "kept"])
def test_sorted_growing_episodes_through_loader(tmp_path, keep):
    steps_of, handles = {}, []
    for i, steps in enumerate(range(1, 61)):
        steps_of[i] = steps
        handles.append(FileStorage(tmp_path / f"{i:03d}.tsl"))
        handles[-1].save(episode(i, steps))
    kept = []
    with FileStorageLoader(tmp_path, ttl=None, worker_num=2) as loader:
        futures = [loader.load_async(h) for h in handles]  # all in flight at once
        for i, f in enumerate(futures):
            s = f.result(timeout=TIMEOUT)
            s = {"obs": torch.from_numpy(s["obs"]), "id": s["id"]}
            assert check_episode(s, steps_of) == i
            if keep:
                kept.append(s)
            futures[i] = None
            del s, f
    for s in kept:
        check_episode(s, steps_of)


def test_dataloader_collate_fn_receives_samples(tmp_path):
    """A collate_fn given to the DataLoader sees samples (dicts of tensors), with or without workers."""
    sizes = [(UNIT * (i + 1), BYTES_UNIT * (i % 3)) for i in range(12)]
    handles = save_all(str(tmp_path), sizes)
    for num_workers in (0, 2):
        seen = []
        for batch in _dataloader(StorageDataset(handles), num_workers, batch_size=4, collate_fn=pad_collate):
            seen += check_padded_batch(batch, sizes)
        assert sorted(seen) == list(range(12)), num_workers


def test_a_forked_child_receives_through_its_own_ring_registry():
    """``slots`` gives a forked child a new registry; receiving (``refs``) must use it, not the
    parent's copy, whose lock another parent thread may have held at the fork (the child then hung)."""
    import os
    import threading
    import time
    import types

    from torch_storage_loader._shm import refs, slots

    ring = types.SimpleNamespace(pin=None, pinning=True, nbytes=4096, address=0, uid="0" * 32, device=None)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with slots._registry.lock:
            held.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        held.wait()
        pid = os.fork()
        if pid == 0:  # the child: a pin's bookkeeping takes the registry's lock
            try:
                refs._pin(ring)
            finally:
                os._exit(0)
        deadline = time.monotonic() + 20
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0, (
            "the child hung on its parent's registry lock"
        )
    finally:
        release.set()
        holder.join()


def test_an_error_raised_by_a_signal_handler_never_leaves_the_ring_registry_locked():
    # torch raises a dead worker's error from its SIGCHLD handler wherever the trainer's thread is;
    # a section of the registry it interrupts must let go of the lock (the reaper and the
    # pin-memory thread take it too).
    from _helpers import free_for_another_thread, interrupted_constantly

    from torch_storage_loader._shm import slots

    def section():
        for _ in range(20):
            slots.retire_rings()

    assert interrupted_constantly(section) > 100
    assert free_for_another_thread(slots._registry.lock), "a signal handler's error left the registry locked"
