"""StorageDataset with real DataLoader workers, files, queues and shared memory."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import threading

import _helpers
import numpy as np
import pytest
import torch
import treetensor.torch as ttorch
from conftest import START_METHODS
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from torch_storage_loader import (
    FileStorage,
    ProducerDiedError,
    SampleMismatchError,
    StorageCorruptError,
    StorageDataset,
    StorageQueue,
    end_directory_stream,
)


def ids_of(samples, batched=False):
    if batched:
        return sorted(int(i) for b in samples for i in b["info"]["id"])
    return sorted(int(s["info"]["id"]) for s in samples)


def check_sample(s, i=None):
    assert type(s["obs"]) is torch.Tensor and s["obs"].dtype == torch.float32  # numpy became torch
    assert type(s["action"]) is torch.Tensor and s["done"].dtype == torch.bool
    k = int(s["info"]["id"]) if i is None else i
    assert torch.equal(s["obs"], torch.full((8, 4, 8, 8), float(k)))
    assert torch.equal(s["action"], torch.full((8,), k))


@pytest.mark.parametrize("num_workers", [0, 1, 2])
@pytest.mark.parametrize("batch_size", [None, 5])
def test_every_handle_once(handles, num_workers, batch_size):
    ds = StorageDataset(handles, batch_size=batch_size)
    out = list(DataLoader(ds, batch_size=None, num_workers=num_workers))
    assert ids_of(out, batch_size is not None) == list(range(24))
    if batch_size is None:
        for s in out:
            check_sample(s)
    else:
        for b in out:
            assert b["obs"].shape[1:] == (8, 4, 8, 8) and b["obs"].shape[0] <= 5
            for j, k in enumerate(b["info"]["id"].tolist()):
                assert torch.equal(b["obs"][j], torch.full((8, 4, 8, 8), float(k)))
            assert b["info"]["name"] == [f"traj-{k}" for k in b["info"]["id"].tolist()]
    stats = ds.stats()
    if num_workers:
        assert stats["slot_loads"] + stats["fallbacks"] == len(out) and stats["slot_loads"] > 0


@pytest.mark.parametrize("method", START_METHODS)
def test_start_methods_epochs_and_persistent_workers(handles, method):
    ds = StorageDataset(handles)
    dl = DataLoader(
        ds, batch_size=None, num_workers=2, persistent_workers=True, prefetch_factor=3, multiprocessing_context=method
    )
    for _ in range(3):
        out = []
        for s in dl:
            check_sample(s)
            out.append(int(s["info"]["id"]))  # drop each sample: slots are reused
        assert sorted(out) == list(range(24))
    del dl
    assert ds.stats()["fallbacks"] == 0


def test_in_order_false(handles):
    out = list(DataLoader(StorageDataset(handles), batch_size=None, num_workers=2, in_order=False))
    assert ids_of(out) == list(range(24))
    for s in out:
        check_sample(s)


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="pin_memory needs an accelerator: without one DataLoader only warns and never pins",
)
def test_in_order_false_and_pin_memory(handles):
    # Kept batches, then more loads while all are kept (as in test_kept_batches_never_change), pinned.
    ds = StorageDataset(handles, slots_per_worker=2, max_rings_per_worker=2)
    kept = list(DataLoader(ds, batch_size=None, num_workers=2, in_order=False, pin_memory=True))
    again = list(DataLoader(ds, batch_size=None, num_workers=2, in_order=False, pin_memory=True))
    assert ids_of(kept) == ids_of(again) == list(range(24))
    for s in kept + again:
        assert s["obs"].is_pinned() and s["action"].is_pinned() and s["reward"].is_pinned()
        check_sample(s)


def test_kept_batches_never_change(handles):
    ds = StorageDataset(handles, slots_per_worker=2, max_rings_per_worker=2)
    kept = list(DataLoader(ds, batch_size=None, num_workers=2))
    again = list(DataLoader(ds, batch_size=None, num_workers=2))  # more loads while all are kept
    for s in kept + again:
        check_sample(s)
    stats = ds.stats()
    # Once every slot is held, samples arrive as private copies: no mapping per kept sample.
    assert stats["copies"] > 0 and stats["regrows"] >= 2, stats


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dataloader_side_batching_still_works(handles, method):
    # The workers collate the dataset's items with the entry the hooks add to default_collate_fn_map:
    # a spawned worker imports nothing of the library but what unpickling the dataset brings (the
    # hooks are not installed at import), and has it all the same.
    out = list(DataLoader(StorageDataset(handles), batch_size=4, num_workers=2, multiprocessing_context=method))
    assert out[0]["obs"].shape == (4, 8, 4, 8, 8)
    assert sorted(int(i) for b in out for i in b["info"]["id"]) == list(range(24))


def test_treetensor_trees_stay_trees(tmp_path):
    handles = []
    for i in range(4):
        s = FileStorage(tmp_path / f"{i}.tsl")
        s.save(ttorch.Tensor({"obs": torch.full((2, 3), float(i)), "a": {"b": torch.tensor([i])}}))
        handles.append(s)
    out = list(DataLoader(StorageDataset(handles), batch_size=None, num_workers=2))
    assert all(type(t) is ttorch.Tensor for t in out)
    assert sorted(int(t.a.b[0]) for t in out) == [0, 1, 2, 3]


def test_mismatched_shapes_name_the_key_path(tmp_path):
    a, b = FileStorage(tmp_path / "a.tsl"), FileStorage(tmp_path / "b.tsl")
    a.save({"obs": np.zeros((3, 2), np.float32)})
    b.save({"obs": np.zeros((4, 2), np.float32)})
    with pytest.raises(SampleMismatchError, match=r"<root>\{#0\}.*\[3, 2\].*\[4, 2\]"):
        list(DataLoader(StorageDataset([a, b], batch_size=2), batch_size=None))
    with pytest.raises(SampleMismatchError, match=r"<root>\{#0\}"):
        list(DataLoader(StorageDataset([a, b], batch_size=2), batch_size=None, num_workers=1))

    def pad(samples):
        n = max(s["obs"].shape[0] for s in samples)
        return {
            "obs": torch.stack([torch.nn.functional.pad(s["obs"], (0, 0, 0, n - s["obs"].shape[0])) for s in samples])
        }

    out = list(DataLoader(StorageDataset([a, b], batch_size=2, collate_fn=pad), batch_size=None, num_workers=1))
    assert out[0]["obs"].shape == (2, 4, 2)


def test_corrupt_file_raises_or_is_skipped(handles):
    with open(handles[5].path, "r+b") as f:
        f.truncate(64)
    with pytest.raises(StorageCorruptError, match=os.path.basename(handles[5].path)):
        list(DataLoader(StorageDataset(handles), batch_size=None, num_workers=2))
    ds = StorageDataset(handles, on_error="skip")
    out = list(DataLoader(ds, batch_size=None, num_workers=0))
    assert ids_of(out) == [i for i in range(24) if i != 5]
    assert ds.stats()["skipped"] == 1


def test_killed_worker_is_a_clear_error_not_a_hang(handles):
    dl = iter(DataLoader(StorageDataset(handles), batch_size=None, num_workers=2, timeout=60))
    next(dl)
    os.kill(dl._workers[0].pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"(?i)worker"):
        for _ in dl:
            pass
    del dl


def test_storage_queue_two_producers_two_workers(tmp_path):
    q = StorageQueue()
    producers = [
        mp.get_context("spawn").Process(target=_helpers.produce, args=(q, str(tmp_path / f"p{k}"), 100 * k, 20))
        for k in range(2)
    ]
    for p in producers:
        p.start()
    dl = DataLoader(StorageDataset(q), batch_size=None, num_workers=2, multiprocessing_context="spawn")
    it = iter(dl)
    got = [int(next(it)["info"]["id"]) for _ in range(10)]
    for p in producers:
        p.join()
    q.close()
    got += [int(s["info"]["id"]) for s in it]
    assert sorted(got) == list(range(20)) + list(range(100, 120))


def test_plain_queues_end_at_none(handles):
    q = queue.Queue()
    for h in handles:
        q.put(h)
    q.put(None)
    assert ids_of(DataLoader(StorageDataset(q), batch_size=None)) == list(range(24))
    mq = mp.get_context("fork").Queue()
    for h in handles:
        mq.put(h)
    mq.put(None)
    assert ids_of(DataLoader(StorageDataset(mq), batch_size=None, num_workers=2)) == list(range(24))
    # The trainer takes from a queue and feeds its workers: a thread's queue.Queue feeds them too.
    tq: queue.Queue = queue.Queue()
    feeder = threading.Thread(target=lambda: [tq.put(h) for h in [*handles, None]])
    it = iter(DataLoader(StorageDataset(tq), batch_size=None, num_workers=2))
    feeder.start()
    assert sorted(int(s["info"]["id"]) for s in it) == list(range(24))
    feeder.join()


def test_dead_producer_is_an_error_not_a_hang(tmp_path):
    q = StorageQueue()
    p = mp.get_context("spawn").Process(target=_helpers.produce_then_die, args=(q, str(tmp_path / "p")))
    p.start()
    with pytest.raises(ProducerDiedError, match=str(p.pid)):
        list(DataLoader(StorageDataset(q), batch_size=None, num_workers=0))
    p.join()


def test_directory_source_claims_each_file_once(tmp_path):
    d = str(tmp_path / "dir")
    ctx = mp.get_context("spawn")
    producers = [ctx.Process(target=_helpers.produce_into_directory, args=(d, 100 * k, 15)) for k in range(2)]
    out = ctx.Queue()
    other = ctx.Process(target=_helpers.consume_directory, args=(d, out))
    for p in producers + [other]:
        p.start()
    mine = []
    it = iter(DataLoader(StorageDataset(d), batch_size=None, num_workers=2))
    for p in producers:
        p.join()
    end_directory_stream(d)
    mine = [int(s["info"]["id"]) for s in it]
    theirs = out.get(timeout=60)
    other.join()
    assert sorted(mine + theirs) == list(range(15)) + list(range(100, 115))
    assert sorted(os.listdir(d)) == ["_END_OF_STREAM"]  # loaded files are deleted


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_neither_repeats_nor_skips(handles, num_workers):
    dl = StatefulDataLoader(StorageDataset(handles, batch_size=2), batch_size=None, num_workers=num_workers)
    first = []
    for i, b in enumerate(dl):
        first += b["info"]["id"].tolist()
        if i == 4:
            state = dl.state_dict()
            break
    del dl
    dl = StatefulDataLoader(StorageDataset(handles, batch_size=2), batch_size=None, num_workers=num_workers)
    dl.load_state_dict(state)
    rest = [i for b in dl for i in b["info"]["id"].tolist()]
    assert sorted(first + rest) == list(range(24))


def test_distributed_ranks_split_a_finite_source(handles, tmp_path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_helpers.ddp_rank, args=(r, 2, str(tmp_path / "init"), handles, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join()
        assert p.exitcode == 0
    assert not set(got[0]) & set(got[1])
    assert sorted(got[0] + got[1]) == list(range(24))


def test_validation_messages():
    with pytest.raises(ValueError, match="batch_size=0 must be >= 1"):
        StorageDataset([], batch_size=0)
    with pytest.raises(ValueError, match="collate_fn needs batch_size"):
        StorageDataset([], collate_fn=list)
    with pytest.raises(TypeError, match=r"source\[1\] is a int"):
        StorageDataset([FileStorage("x"), 3])


# ------------------------------------------------------------------ shuffling, length, even shards
def expected_order(n, seed, epoch, world=1, rank=0, drop_last=False):
    """What DistributedSampler(shuffle=True, seed, drop_last) gives rank ``rank`` in ``epoch``."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    order = torch.randperm(n, generator=g).tolist()
    total = (n // world if drop_last else -(-n // world)) * world
    order = (order * -(-total // n))[:total]
    return order[rank:total:world]


def flat_ids(batches):
    return [
        i
        for b in batches
        for i in (
            b["info"]["id"].tolist()
            if isinstance(b["info"]["id"], torch.Tensor) and b["info"]["id"].dim()
            else [int(b["info"]["id"])]
        )
    ]


@pytest.mark.parametrize(
    "num_workers,persistent,method", [(0, False, None), (2, True, "fork"), (2, False, "spawn"), (2, True, "forkserver")]
)
def test_shuffle_is_a_permutation_of_seed_and_epoch(handles, num_workers, persistent, method):
    ds = StorageDataset(handles, shuffle=True, seed=3)
    dl = DataLoader(
        ds, batch_size=None, num_workers=num_workers, persistent_workers=persistent, multiprocessing_context=method
    )
    # The epoch advances by itself, in fresh (non-persistent) workers too.
    auto = [flat_ids(dl) for _ in range(3)]
    assert auto == [expected_order(24, 3, e) for e in range(3)]
    assert len({tuple(o) for o in auto}) == 3
    # set_epoch wins, and reaches persistent workers.
    ds.set_epoch(7)
    assert flat_ids(dl) == flat_ids(dl) == expected_order(24, 3, 7)
    ds.set_epoch(1)
    assert flat_ids(dl) == auto[1]
    del dl
    # Another dataset with the same seed and epoch: the same order; no shuffle: the list's order.
    other = StorageDataset(handles, shuffle=True, seed=3)
    other.set_epoch(2)
    assert flat_ids(DataLoader(other, batch_size=None)) == auto[2]
    assert flat_ids(DataLoader(StorageDataset(handles), batch_size=None)) == list(range(24))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_len_counts_items_and_never_undercounts(handles, num_workers):
    for batch_size in (None, 5, 24, 30):
        for drop_last in (False, True):
            ds = StorageDataset(handles, batch_size=batch_size, drop_last=drop_last, shuffle=True)
            dl = DataLoader(ds, batch_size=None, num_workers=num_workers)
            n = len(dl)  # torch compares what comes with this (and warns, an error here, when more come)
            got = list(dl)
            b = batch_size or 1
            assert n == len(got) == len(ds) == (24 // b if drop_last else -(-24 // b)), (batch_size, drop_last)
            assert sorted(flat_ids(got)) == (list(range(24)) if not drop_last else sorted(flat_ids(got)))
            assert len(flat_ids(got)) == (n * b if drop_last else 24)
            del got, dl


def test_streaming_sources_have_no_length(tmp_path):
    q = StorageQueue()
    with pytest.raises(TypeError, match="StorageDataset over a QueueSource has no length"):
        len(StorageDataset(q))
    with pytest.raises(TypeError, match="has no length"):
        len(DataLoader(StorageDataset(str(tmp_path / "dir")), batch_size=None))
    with pytest.raises(ValueError, match="shuffle=True needs a finite source"):
        StorageDataset(q, shuffle=True)
    q.close()


def test_shuffle_validation_messages(handles):
    with pytest.raises(TypeError, match="seed='3' must be an int"):
        StorageDataset(handles, seed="3")
    with pytest.raises(TypeError, match="shuffle=1 must be a bool"):
        StorageDataset(handles, shuffle=1)
    with pytest.raises(TypeError, match="drop_last=None must be a bool"):
        StorageDataset(handles, drop_last=None)
    ds = StorageDataset(handles)
    with pytest.raises(ValueError, match="epoch=-1 must be >= 0"):
        ds.set_epoch(-1)
    with pytest.raises(TypeError, match=r"epoch=1.0 must be an int"):
        ds.set_epoch(1.0)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_with_shuffle_and_epochs(handles, num_workers):
    def loader():
        return StatefulDataLoader(
            StorageDataset(handles, batch_size=2, shuffle=True, seed=11), batch_size=None, num_workers=num_workers
        )

    dl = loader()
    epoch0 = flat_ids(dl)  # a whole epoch, then part of the next (the epoch advanced by itself)
    first = []
    for i, b in enumerate(dl):
        first += b["info"]["id"].tolist()
        if i == 4:
            state = dl.state_dict()
            break
    del dl
    dl = loader()
    dl.load_state_dict(state)
    rest = flat_ids(dl)
    assert epoch0 == expected_order(24, 11, 0)
    assert first + rest == expected_order(24, 11, 1)  # neither repeats nor skips, same permutation
    assert flat_ids(dl) == expected_order(24, 11, 2)  # and the epochs go on from there
    del dl


@pytest.mark.parametrize("world", [2, 3])
def test_len_per_rank_for_every_combination(handles, tmp_path, world):
    # 7 handles: uneven over 2 and 3 ranks, over 2 and 3 per batch, over 1 and 3 workers.
    got = _helpers.run_ranks(_helpers.len_rank, world, str(tmp_path / "init"), handles[:7])
    rows = list(zip(*(got[r]["rows"] for r in range(world)), strict=False))
    for per_rank in rows:
        cfg = {k: per_rank[0][k] for k in ("batch_size", "drop_last", "num_workers")}
        b, drop = cfg["batch_size"] or 1, cfg["drop_last"]
        samples = 7 // world if drop else -(-7 // world)
        want = samples // b if drop else -(-samples // b)
        for r, row in enumerate(per_rank):
            assert row["len"] == row["len_ds"] == row["yielded"] == want, (cfg, r, row)
            # The same permutation on every rank, DistributedSampler's positions, in order.
            assert row["ids"] == expected_order(7, 5, 0, world, r, drop)[: want * b], (cfg, r, row)
        if not drop:
            assert set().union(*(row["ids"] for row in per_rank)) == set(range(7)), cfg


@pytest.mark.parametrize(
    "options",
    [
        {"num_workers": 0},
        {
            "batch_size": 2,
            "num_workers": 2,
            "persistent_workers": True,
            "shuffle": True,
            "seed": 3,
            "epochs": 3,
            "set_epoch": True,
        },
        {"batch_size": 2, "num_workers": 2, "shuffle": True, "epochs": 2},
        {"batch_size": 2, "num_workers": 2, "drop_last": True},
    ],
    ids=["samples", "batches-persistent-shuffled", "batches-shuffled-auto-epoch", "drop-last"],
)
def test_ddp_training_on_uneven_data_never_hangs(handles, tmp_path, options):
    # 5 handles over 2 ranks: without even shards one rank takes a step more, and waits in DDP's
    # all-reduce until the process group times out (30 s here).
    got = _helpers.run_ranks(_helpers.ddp_train_rank, 2, str(tmp_path / "init"), handles[:5], options)
    reports = [got[0], got[1]]
    drop = options.get("drop_last", False)
    b = options.get("batch_size") or 1
    steps = (5 // 2) // b if drop else -(-3 // b)
    for r, rep in enumerate(reports):
        assert not rep["warnings"], rep["warnings"]
        assert rep["len"] == steps and [len(e) for e in rep["epochs"]] == [steps] * options.get("epochs", 1)
        assert rep["padded"] == (0 if drop or r == 0 else 1)
    for e in range(options.get("epochs", 1)):
        ids = [[i for batch in rep["epochs"][e] for i in batch] for rep in reports]
        if drop:
            assert len(set(ids[0] + ids[1])) == len(ids[0] + ids[1]) == 2 * steps * b
        else:
            assert set(ids[0] + ids[1]) == set(range(5))  # every handle trained on
        if options.get("shuffle"):
            for r in range(2):
                assert ids[r] == expected_order(5, options.get("seed", 0), e, 2, r, drop)[: steps * b]


def test_storage_options_reach_the_buckets_a_redis_queue_trusts():
    """Regression (issue 28): the dataset read the queue's roots from a private attribute that had
    moved, so a Redis queue trusting s3:// roots named no bucket for ``storage_options``."""
    from torch_storage_loader import RedisStorageQueue
    from torch_storage_loader._stores import config as _stores_config
    from torch_storage_loader._stores import objects as _objects

    before = _objects.snapshot()
    try:
        q = RedisStorageQueue("redis://127.0.0.1:1/0", "never-connected", trusted_roots=["s3://queue-bucket/run"])
        StorageDataset(q, storage_options={"key": "K", "secret": "S"})
        assert _objects.config_for("s3://queue-bucket/run/a.tsl").storage_options == {"key": "K", "secret": "S"}
        assert _objects.config_for("s3://someone-else/x.tsl").storage_options == {}
    finally:
        with _stores_config._lock:
            _stores_config._config.clear()
            _stores_config._config.update(before)


# ------------------------------------------------------- stats() counts what workers skip and refuse
def _hostile_directory(tmp_path, good: int = 16):
    """A watched directory with ``good`` honest files, then (sorting after them, so the last handles of
    each worker's share fail) a link out of the directory, a FIFO, garbage, and a claim name that
    does not parse (refused by a directory source). Returns it and the bad files' paths."""
    from conftest import traj

    watched, outside = tmp_path / "watched", tmp_path / "outside"
    watched.mkdir()
    outside.mkdir()
    FileStorage(outside / "secret.tsl").save(traj(99, 1))
    for i in range(good):
        FileStorage(watched / f"g-{i:02d}.tsl").save(traj(i, 1))
    os.symlink(outside / "secret.tsl", watched / "z-link.tsl")
    os.mkfifo(watched / "z-pipe.tsl")
    (watched / "z-garbage.tsl").write_bytes(b"\x00" * 64)
    (watched / "zz.tsl.claimed-").write_bytes(b"")  # refused: not NAME.claimed-HOST-TRAINER-PID
    return watched, [str(watched / n) for n in ("z-garbage.tsl", "z-link.tsl", "z-pipe.tsl")]


def _source(kind: str, watched, bad: list[str]):
    goods = sorted(str(p) for p in watched.glob("g-*.tsl"))
    handles = [FileStorage(p) for p in goods + bad]
    if kind == "list":
        return handles
    if kind == "queue":
        q: queue.Queue = queue.Queue()
        for h in [*handles, None]:
            q.put(h)
        return q
    end_directory_stream(watched)
    return str(watched)


@pytest.mark.parametrize("kind", ["list", "queue", "directory"])
@pytest.mark.parametrize("num_workers,persistent", [(0, False), (2, False), (2, True)])
def test_stats_count_what_workers_skip_and_refuse(tmp_path, kind, num_workers, persistent):
    """The trainer's stats() counts the skips and refusals of its DataLoader workers, even where no
    sample follows them in that worker (they used to travel with the worker's next sample only)."""
    watched, bad = _hostile_directory(tmp_path)
    ds = StorageDataset(_source(kind, watched, bad), on_error="skip")
    dl = DataLoader(
        ds, batch_size=None, num_workers=num_workers, persistent_workers=persistent, timeout=60 if num_workers else 0
    )
    epochs = 2 if kind == "list" and persistent else 1  # a stream ends once
    for epoch in range(epochs):
        assert ids_of(dl) == list(range(16))
        stats = ds.stats()  # persistent workers are still alive here
        assert stats["skipped"] == len(bad) * (epoch + 1), stats
        # A directory source refuses a name once: the trainer lists and claims, workers or not.
        assert stats["refused"] == (1 if kind == "directory" else 0), stats
    del dl
    if kind == "directory":
        assert sorted(os.listdir(watched)) == sorted(
            ["_END_OF_STREAM", "zz.tsl.claimed-"] + [os.path.basename(p) + ".failed" for p in bad]
        )


@pytest.mark.parametrize("kind", ["list", "directory"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_bad_file_costs_only_its_own_sample_in_a_batch(tmp_path, kind, num_workers):
    """With the dataset's batch_size, a file that fails under on_error="skip" drops itself only: its
    batch comes one sample shorter, and (a stream) the good files batched with it are delivered."""
    from conftest import traj

    watched = tmp_path / "watched"
    watched.mkdir()
    for i in range(8):
        FileStorage(watched / f"g-{i:02d}.tsl").save(traj(i, 1))
    (watched / "g-01x.tsl").write_bytes(b"\x00" * 64)  # sorts between g-01 and g-02: in the first batch
    names = sorted(os.listdir(watched))
    source = [FileStorage(watched / n) for n in names] if kind == "list" else str(watched)
    if kind == "directory":
        end_directory_stream(watched)
    ds = StorageDataset(source, batch_size=4, on_error="skip")
    out = list(DataLoader(ds, batch_size=None, num_workers=num_workers, timeout=60 if num_workers else 0))
    assert ids_of(out, batched=True) == list(range(8))
    if kind == "list":  # fixed groups: [g-00, g-01, bad, g-02], [g-03 .. g-06], [g-07]
        assert sorted(len(b["info"]["id"]) for b in out) == [1, 3, 4]
    assert ds.stats()["skipped"] == 1
    if kind == "directory":
        assert sorted(os.listdir(watched)) == ["_END_OF_STREAM", "g-01x.tsl.failed"]  # the good ones delivered
