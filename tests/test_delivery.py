"""At-least-once delivery: DataLoaders that stop early, workers that die, trainers that die."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import threading
import time
import uuid

import _helpers
import numpy as np
import pytest
from _redis_server import EVERYWHERE, redis_server  # noqa: F401  (fixture)
from _s3_server import s3_bucket, s3_server  # noqa: F401  (fixtures)
from conftest import traj
from torch.utils.data import DataLoader

from torch_storage_loader import FileStorage, StorageDataset, StorageError, StorageQueue, end_directory_stream
from torch_storage_loader.errors import StorageUnavailableError

N = 600


def _save_all(directory, n: int = N, suffix: str = ".tsl") -> list[FileStorage]:
    os.makedirs(directory, exist_ok=True)
    out = []
    for i in range(n):
        path = os.path.join(directory, f"{i:04d}{suffix}")
        s = FileStorage(path + ".part")
        s.save(traj(i, n=2))
        os.rename(path + ".part", path)  # a directory source must never see half a file
        out.append(FileStorage(path))
    return out


def _ids(item) -> list[int]:
    ids = item["info"]["id"]
    return [int(i) for i in ids] if hasattr(ids, "__len__") and not isinstance(ids, str) else [int(ids)]


def _stop_early_then_drain(dl: DataLoader, rounds: int = 10, take: int = 40) -> list[int]:
    """What a trainer sees: ``rounds`` loops that ``break`` after ``take`` items, then one to the end."""
    got: list[int] = []
    for _ in range(rounds):
        for k, item in enumerate(dl):
            got += _ids(item)
            if k + 1 == take:
                break
    for item in dl:
        got += _ids(item)
    return got


def test_storage_queue_give_back_after_the_end(tmp_path):
    a, b = _save_all(tmp_path / "files", n=2)
    q = StorageQueue()
    q.put(a)
    q.close()
    assert q.get(timeout=5) == a
    q.give_back([a, b])
    assert [q.get(timeout=5), q.get(timeout=5)] == [a, b], "given back after the end, still delivered"
    t0 = time.monotonic()
    assert q.get() is None and time.monotonic() - t0 < 1.0


LOADERS = {
    "2 workers": dict(batch_size=None, num_workers=2),
    "persistent, out of order": dict(batch_size=None, num_workers=2, persistent_workers=True, in_order=False),
    "DataLoader batches": dict(batch_size=4, num_workers=2),
    "in the trainer": dict(batch_size=None, num_workers=0),
}


@pytest.mark.parametrize("options", LOADERS.values(), ids=LOADERS.keys())
def test_storage_queue_stopped_early_ten_times_loses_nothing(tmp_path, options):
    q = StorageQueue()
    for s in _save_all(tmp_path / "files"):
        q.put(s)
    q.close()
    dl = DataLoader(StorageDataset(q), timeout=60 if options["num_workers"] else 0, **options)
    got = _stop_early_then_drain(dl)
    del dl
    assert sorted(got) == list(range(N)), "a handle was lost or delivered twice"


def test_stateful_dataloader_stopped_early_loses_nothing(tmp_path):
    from torchdata.stateful_dataloader import StatefulDataLoader

    q = StorageQueue()
    for s in _save_all(tmp_path / "files"):
        q.put(s)
    q.close()
    dl = StatefulDataLoader(StorageDataset(q), batch_size=None, num_workers=2, timeout=60)
    got = _stop_early_then_drain(dl)
    del dl
    assert sorted(got) == list(range(N))


def test_dataset_side_batches_from_a_queue_loses_nothing(tmp_path):
    q = StorageQueue()
    for s in _save_all(tmp_path / "files", n=N - 1):  # each worker's last batch may be short
        q.put(s)
    q.close()
    got = _stop_early_then_drain(
        DataLoader(StorageDataset(q, batch_size=3), batch_size=None, num_workers=2, timeout=60)
    )
    assert sorted(got) == list(range(N - 1))
    assert q.get(timeout=5) is None, "a delivered handle was given back to the queue"


def test_dataset_side_batches_from_a_queue_with_persistent_workers_stopped_early_lose_nothing(tmp_path):
    # Each early stop leaves a worker's batch half read; its next iteration must not mix those
    # handles up with the ones it reads next (lost, or delivered twice).
    q = StorageQueue()
    for s in _save_all(tmp_path / "files"):
        q.put(s)
    q.close()
    dl = DataLoader(
        StorageDataset(q, batch_size=3), batch_size=None, num_workers=2, persistent_workers=True, timeout=60
    )
    got = _stop_early_then_drain(dl, take=7)
    del dl
    assert sorted(got) == list(range(N)), "a handle was lost or delivered twice"


def test_directory_stopped_early_ten_times_loses_nothing(tmp_path):
    d = str(tmp_path / "dir")
    _save_all(d)
    end_directory_stream(d)
    got = _stop_early_then_drain(DataLoader(StorageDataset(d), batch_size=None, num_workers=2, timeout=60))
    assert sorted(got) == list(range(N))
    assert os.listdir(d) == ["_END_OF_STREAM"], "delivered files are deleted, and only those"


def test_redis_stopped_early_ten_times_loses_nothing(tmp_path, redis_server):
    from torch_storage_loader import RedisStorageQueue

    with RedisStorageQueue(redis_server.url, f"s-{uuid.uuid4().hex[:8]}", trusted_roots=EVERYWHERE) as q:
        try:
            for s in _save_all(tmp_path / "files"):
                q.put(s)
            q.close()
            got = _stop_early_then_drain(DataLoader(StorageDataset(q), batch_size=None, num_workers=2, timeout=60))
            assert sorted(got) == list(range(N))
            stats = q.stats()
            assert stats["returned"] > 0, "stopping ten times gave nothing back: the check cannot fail"
            assert (stats["pending"], stats["duplicates"], stats["acked"]) == (0, 0, N)
        finally:
            q.delete()


@pytest.mark.parametrize("kind", ["queue", "directory"])
def test_killed_worker_loses_nothing(tmp_path, kind):
    """A worker SIGKILLed mid-stream holds nothing the trainer does not know: what it was fed goes
    back (a directory's files too: the trainer claims them, so no claim names a dead worker)."""
    files = _save_all(tmp_path / "files", n=200)
    if kind == "queue":
        source = q = StorageQueue()
        for s in files:
            q.put(s)
        q.close()
    else:
        end_directory_stream(tmp_path / "files")
        source = str(tmp_path / "files")
    dl = DataLoader(StorageDataset(source), batch_size=None, num_workers=2, timeout=60)
    got: list[int] = []
    it = iter(dl)
    for _ in range(30):
        got += _ids(next(it))
    os.kill(it._workers[0].pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"exited unexpectedly|killed by signal"):
        for item in it:
            got += _ids(item)
    del it
    gc.collect()  # the RuntimeError's traceback holds the iterator (a cycle): it gives back when collected
    for item in dl:
        got += _ids(item)
    assert sorted(set(got)) == list(range(200))
    if kind == "directory":
        assert os.listdir(tmp_path / "files") == ["_END_OF_STREAM"], "a file was left claimed or undelivered"


def test_consumers_killed_while_waiting_do_not_stop_the_others(tmp_path):
    """A consumer SIGKILLed while it waits on an empty StorageQueue holds none of its locks: the
    others still take every handle, and the end."""
    ctx = mp.get_context("spawn")
    q, out = StorageQueue(), ctx.Queue()
    readies = [ctx.Event() for _ in range(6)]
    consumers = [ctx.Process(target=_helpers.consume_queue, args=(q, out, r)) for r in readies]
    for c in consumers:
        c.start()
    try:
        assert all(r.wait(60) for r in readies)
        for victim in consumers[:4]:  # each waits on the empty queue, polling it, when killed
            time.sleep(0.25)
            victim.kill()
            victim.join()
        handles = _save_all(tmp_path / "files", n=40)
        for s in handles:
            q.put(s)
        q.close()
        got = [p for _ in consumers[4:] for p in out.get(timeout=30)]
        assert sorted(got) == sorted(s.path for s in handles)
    finally:
        for c in consumers:
            c.kill()
            c.join()


@pytest.mark.parametrize(("n", "batch_size"), [(8, None), (5, None), (13, None), (6, 2), (9, 3)])
def test_an_open_queue_feeds_the_worker_the_trainer_waits_on(tmp_path, n, batch_size):
    """What a queue holds is shared out an item's worth at a time, to the worker holding the fewest:
    none sits with a worker the trainer is not waiting on while the one it waits on has none, for
    any count (every item the handles make arrives with the stream still open)."""
    q = StorageQueue()
    for s in _save_all(tmp_path / "files", n=n):
        q.put(s)
    it = iter(DataLoader(StorageDataset(q, batch_size=batch_size), batch_size=None, num_workers=2, timeout=30))
    got = [i for _ in range(n // (batch_size or 1)) for i in _ids(next(it))]
    assert sorted(got) == list(range(n))
    q.close()
    assert list(it) == []


@pytest.mark.parametrize("batch_size", [3, 4])
def test_handles_that_trickle_in_make_whole_items(tmp_path, batch_size):
    """Handles put one at a time into an open queue are shared out so that every item's worth of them
    makes an item while the stream is still open, not split across the workers as parts of items
    none can make (the trainer then waited on handles the workers held)."""
    n = 3 * batch_size
    q = StorageQueue()
    handles = _save_all(tmp_path / "files", n=n)
    it = iter(DataLoader(StorageDataset(q, batch_size=batch_size), batch_size=None, num_workers=2, timeout=30))

    def trickle() -> None:
        for s in handles:
            q.put(s)
            time.sleep(0.03)

    feeder = threading.Thread(target=trickle)
    feeder.start()
    got = [i for _ in range(3) for i in _ids(next(it))]
    feeder.join()
    assert sorted(got) == list(range(n))
    q.close()
    assert list(it) == []


def test_a_handle_too_large_to_feed_is_refused_by_name(tmp_path):
    """The trainer feeds its workers through pipes that never block it: a "handle" that carries
    megabytes is refused with an error naming it, and the handles around it still arrive."""
    small = _save_all(tmp_path / "files", n=6)
    q = StorageQueue()
    for s in [*small[:3], _helpers.MemoryStorage(np.zeros(1 << 20), tag="huge"), *small[3:]]:
        q.put(s)
    q.close()
    got: list[int] = []
    with pytest.raises(TypeError, match=r"MemoryStorage\) is too large to feed a DataLoader worker"):
        for item in DataLoader(StorageDataset(q), batch_size=None, num_workers=1, timeout=60):
            got += _ids(item)
    gc.collect()  # the exception's traceback held the iterator (a cycle): it gives back as it goes
    for item in DataLoader(StorageDataset(q), batch_size=None, num_workers=1, timeout=60):
        got += _ids(item)
    assert sorted(got) == list(range(6))


def test_a_batch_cut_short_by_the_feeds_error_goes_back_under_persistent_workers(tmp_path):
    """A fed worker marks what it read once per batch; the feed's error mid-batch (a handle
    refused) still marks what the half batch read, so those handles go back, and the next epoch of
    the same workers neither loses them nor takes the ones it reads next for them."""
    small = _save_all(tmp_path / "files", n=40)
    q = StorageQueue()
    for s in [*small[:14], _helpers.MemoryStorage(np.zeros(1 << 20), tag="huge"), *small[14:]]:
        q.put(s)
    q.close()
    dl = DataLoader(
        StorageDataset(q, batch_size=4), batch_size=None, num_workers=1, persistent_workers=True, timeout=60
    )
    got: list[int] = []
    with pytest.raises(TypeError, match="too large to feed"):
        for item in dl:
            got += _ids(item)
    assert len(got) < 14, "the batch the error cut short was delivered"
    for item in dl:
        got += _ids(item)
    del dl
    gc.collect()
    assert sorted(got) == list(range(40)), "a handle was lost or delivered twice"


def test_top_ups_larger_than_a_feed_pipe_arrive_whole(tmp_path):
    """A worker may be topped up with more than its feed's pipe holds (here up to 64 handles of 40 KB,
    through 64 KiB):
    the trainer writes what the pipe takes and the rest as the worker reads, never waiting on it, and
    the stop still reaches workers whose feed is full: stopping early loses nothing."""
    q = StorageQueue()
    for i in range(96):
        q.put(_helpers.MemoryStorage({"info": {"id": i}, "x": np.full(5000, i)}))
    q.close()
    got = _stop_early_then_drain(DataLoader(StorageDataset(q), batch_size=16, num_workers=2, timeout=60), 3, 2)
    assert sorted(got) == list(range(96)), "a handle was lost or delivered twice"


def test_a_handle_that_does_not_unpickle_in_a_worker_fails_alone(tmp_path):
    """The trainer passes a queue's handles on pickled: one that a worker cannot unpickle is that
    handle's error, under on_error, and the handles after it in the same burst still arrive."""
    small = _save_all(tmp_path / "files", n=6)
    q = StorageQueue()
    for s in [*small[:3], _helpers.WorkerFails({"x": np.zeros(2)}, tag="odd"), *small[3:]]:
        q.put(s)
    q.close()
    ds = StorageDataset(q, on_error="skip")
    got = [i for item in DataLoader(ds, batch_size=None, num_workers=1, timeout=60) for i in _ids(item)]
    assert sorted(got) == list(range(6))
    assert ds.stats()["skipped"] == 1
    q2 = StorageQueue()
    for s in [*small[:2], _helpers.WorkerFails({"x": np.zeros(2)}, tag="odd")]:
        q2.put(s)
    q2.close()
    with pytest.raises(StorageError, match="does not unpickle in a DataLoader worker: ImportError"):
        for _ in DataLoader(StorageDataset(q2), batch_size=None, num_workers=1, timeout=60):
            pass


def test_killed_trainer_gives_its_claims_back(tmp_path):
    d = str(tmp_path / "dir")
    _save_all(d, n=100)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    other = ctx.Process(target=_helpers.consume_and_block, args=(d, ready))
    other.start()
    try:
        assert ready.wait(60)
        claimed = [n for n in os.listdir(d) if ".claimed-" in n]
        assert claimed, "prefetched samples are held as claims"
        # Its five are acknowledged (deleted) off its trainer's thread, in the background: killed
        # before, they would come again (at least once), and the count below would not be exact.
        deadline = time.monotonic() + 30
        while len(os.listdir(d)) > 95 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(other.pid, signal.SIGKILL)
        other.join()
        end_directory_stream(d)
        got = [
            i for item in DataLoader(StorageDataset(d), batch_size=None, num_workers=2, timeout=60) for i in _ids(item)
        ]
    finally:
        if other.is_alive():
            other.kill()
            other.join()
    delivered_before = set(range(100)) - set(got)
    assert len(delivered_before) == 5, f"the killed trainer had 5 samples; {sorted(delivered_before)} are missing"


def test_redis_killed_trainer_pending_reach_the_other_trainer(tmp_path, redis_server):
    from torch_storage_loader import RedisStorageQueue

    claim_after = 3.0
    q = RedisStorageQueue(
        redis_server.url, f"s-{uuid.uuid4().hex[:8]}", claim_after=claim_after, trusted_roots=EVERYWHERE
    )
    ctx = mp.get_context("spawn")
    ready, out = ctx.Event(), ctx.Queue()
    other = ctx.Process(target=_helpers.consume_redis_and_block, args=(q, 10, out, ready))
    try:
        for s in _save_all(tmp_path / "files", n=200):
            q.put(s)
        q.close()
        other.start()
        assert ready.wait(60)
        theirs = out.get(timeout=10)
        assert q.stats()["pending"] > 0, "the other trainer holds prefetched entries: the check cannot fail"
        os.kill(other.pid, signal.SIGKILL)
        other.join()
        killed = time.monotonic()
        mine = [
            i for item in DataLoader(StorageDataset(q), batch_size=None, num_workers=2, timeout=60) for i in _ids(item)
        ]
        took = time.monotonic() - killed
        assert sorted(set(theirs + mine)) == list(range(200)), "an entry was lost"
        assert took < claim_after + 15, f"the dead trainer's entries took {took:.1f} s to come back"
        stats = q.stats()
        # After a crash duplicates may happen (samples the killed trainer got, its acks not yet
        # sent), and each is counted.
        assert stats["claimed"] > 0 and stats["duplicates"] == stats["claimed"], stats
        assert len(theirs + mine) - 200 <= stats["duplicates"], stats
        assert stats["pending"] == 0
    finally:
        if other.is_alive():
            other.kill()
            other.join()
        q.delete()
        q.disconnect()


def test_a_failed_dataloader_batch_gives_its_good_samples_back(tmp_path):
    d = str(tmp_path / "dir")
    _save_all(d, n=40)
    with open(os.path.join(d, "0017.tsl"), "r+b") as f:
        f.truncate(100)  # corrupt: its DataLoader batch raises
    end_directory_stream(d)
    got: list[int] = []
    with pytest.raises(Exception, match="0017"):
        for item in DataLoader(StorageDataset(d), batch_size=4, num_workers=2, timeout=60):
            got += _ids(item)
    # The exception's traceback held the iterator (a cycle): until it is collected, its workers hold
    # their claims, which a DataLoader of the same process (the same trainer) does not wait for.
    gc.collect()
    got += [i for item in DataLoader(StorageDataset(d), batch_size=None, num_workers=2, timeout=60) for i in _ids(item)]
    assert sorted(got) == [i for i in range(40) if i != 17], "the failed batch's good samples were acknowledged"
    assert sorted(os.listdir(d)) == ["0017.tsl.failed", "_END_OF_STREAM"]


def _ragged_stream(tmp_path, kind: str, n: int = 40):
    """``n`` samples whose lengths differ (1 to 3 steps), in a closed queue or an ended directory."""
    d = str(tmp_path / "dir")
    os.makedirs(d)
    handles = []
    for i in range(n):
        path = os.path.join(d, f"{i:04d}.tsl")
        FileStorage(path + ".part").save(traj(i, n=1 + i % 3))
        os.rename(path + ".part", path)
        handles.append(FileStorage(path))
    if kind == "directory":
        end_directory_stream(d)
        return d, d
    q = StorageQueue()
    for h in handles:
        q.put(h)
    q.close()
    return q, d


@pytest.mark.parametrize("kind", ["queue", "directory"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_batch_that_cannot_be_stacked_gives_every_handle_back(tmp_path, kind, num_workers):
    """Samples whose shapes differ, batched by the dataset: the error says so, and the files are sound,
    so nothing is set aside as failed; the same stream read with the fix delivers every sample."""
    source, d = _ragged_stream(tmp_path, kind)
    timeout = 60 if num_workers else 0
    with pytest.raises(StorageError, match="cannot stack the batch"):
        for _ in DataLoader(
            StorageDataset(source, batch_size=8), batch_size=None, num_workers=num_workers, timeout=timeout
        ):
            pass
    gc.collect()  # the traceback held the iterator: collected, it gives back what its workers held
    assert not [n for n in os.listdir(d) if n.endswith(".failed")]
    fixed = DataLoader(StorageDataset(source), batch_size=None, num_workers=num_workers, timeout=timeout)
    assert sorted(i for item in fixed for i in _ids(item)) == list(range(40))
    if kind == "directory":
        assert os.listdir(d) == ["_END_OF_STREAM"]


class _Unreachable(FileStorage):
    """A handle whose store is down: loading it raises what an outage raises."""

    def load(self):
        raise StorageUnavailableError(f"{self.path}: the store did not answer (an outage)")


def _key_error(samples):
    raise KeyError("a collate_fn bug")


@pytest.mark.parametrize("case", ["collate_fn bug, batches of 1", "store unreachable"])
def test_an_error_that_is_no_files_fault_sets_none_aside(tmp_path, case):
    """A collate_fn that raises (even over batches of one) or an unreachable store says nothing
    against the files: under on_error="raise" their handles go back, none is set aside as failed, and
    none is read again one by one (an outage would be waited out once more per handle)."""
    hs = _save_all(tmp_path / "files", n=4)
    if case == "store unreachable":
        hs = [_Unreachable(h.path) for h in hs]
        ds = StorageDataset(_closed_queue(hs), batch_size=4)
        expected: type[Exception] = StorageUnavailableError
    else:
        ds = StorageDataset(_closed_queue(hs), batch_size=1, collate_fn=_key_error)
        expected = KeyError
    q = ds.source.queue
    with pytest.raises(expected):
        for _ in DataLoader(ds, batch_size=None, num_workers=1, timeout=30):
            pass
    gc.collect()
    assert sorted(h.path for h in q) == sorted(h.path for h in hs)  # all back, none failed


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_bad_file_in_a_failed_dataset_batch_is_the_only_one_set_aside(tmp_path, num_workers):
    """Under on_error="raise", a dataset batch holding a damaged file raises naming it; that file is
    kept as failed, and the good files batched with it are delivered by the next run."""
    d = str(tmp_path / "dir")
    _save_all(d, n=40)
    with open(os.path.join(d, "0017.tsl"), "r+b") as f:
        f.truncate(100)
    end_directory_stream(d)
    timeout = 60 if num_workers else 0
    got: list[int] = []
    with pytest.raises(StorageError, match="0017"):
        for item in DataLoader(
            StorageDataset(d, batch_size=8), batch_size=None, num_workers=num_workers, timeout=timeout
        ):
            got += _ids(item)
    gc.collect()
    again = DataLoader(StorageDataset(d, batch_size=8), batch_size=None, num_workers=num_workers, timeout=timeout)
    got += [i for item in again for i in _ids(item)]
    assert sorted(got) == [i for i in range(40) if i != 17]
    assert sorted(os.listdir(d)) == ["0017.tsl.failed", "_END_OF_STREAM"]


def _closed_queue(handles) -> StorageQueue:
    q = StorageQueue()
    for h in handles:
        q.put(h)
    q.close()
    return q


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_stream_that_ends_inside_a_dataloader_batch_ends_it(tmp_path, drop_last):
    """DataLoader-side batching over a fed source whose end falls inside a batch: the worker, holding
    half a batch, is told the end (it used to wait for that batch to reach the trainer first, for
    ever), and the short batch comes out or, with drop_last, its handle goes back."""
    q = _closed_queue(_save_all(tmp_path / "files", n=5))
    dl = DataLoader(StorageDataset(q), batch_size=2, drop_last=drop_last, num_workers=1, timeout=30)
    got = sorted(i for batch in dl for i in _ids(batch))
    assert got == ([0, 1, 2, 3] if drop_last else [0, 1, 2, 3, 4])
    del dl
    gc.collect()
    assert [int(h.path[-8:-4]) for h in q] == ([4] if drop_last else [])


@pytest.mark.parametrize("closed", [True, False])
def test_persistent_workers_stopped_while_waiting_for_handles_start_again(tmp_path, closed):
    """Persistent workers, a loop that breaks while its worker waits for a handle for its next item
    (the stream ended, or is idle): the next loop starts at once (the worker used to wait on in the
    old iteration, and torch for its acknowledgement, for ever) and delivers the rest."""
    hs = _save_all(tmp_path / "files", n=3)
    q = StorageQueue()
    for h in hs[:2] if closed else hs[:1]:
        q.put(h)
    if closed:
        q.close()
    dl = DataLoader(StorageDataset(q), batch_size=None, num_workers=1, persistent_workers=True, timeout=30)
    got = []
    for item in dl:
        got += _ids(item)
        time.sleep(0.5)  # the worker goes on to its next item, and waits for a handle
        break
    it = iter(dl)
    if not closed:
        q.put(hs[2])
        q.close()
    got += [i for item in it for i in _ids(item)]
    assert sorted(got) == ([0, 1] if closed else [0, 2])
    del it, dl


class _SelfTakingStream:
    """A stream whose DataLoader workers take their handles themselves (no trainer feeds them): a
    Redis stream on a real server, or an object-store prefix on a real S3 server. ``add(i)`` saves
    sample ``i`` to it; ``end()`` ends it."""

    def __init__(self, kind: str, request, tmp_path) -> None:
        from torch_storage_loader import RedisStorageQueue, configure_object_store

        self.kind, self.tmp_path = kind, tmp_path
        if kind == "redis":
            server = request.getfixturevalue("redis_server")
            self.queue = RedisStorageQueue(server.url, f"s-{uuid.uuid4().hex[:8]}", trusted_roots=EVERYWHERE)
            request.addfinalizer(self.queue.delete)
            self.dataset = lambda: StorageDataset(self.queue)
        else:
            server = request.getfixturevalue("s3_server")
            self.prefix = f"s3://{request.getfixturevalue('s3_bucket')}/stream"
            configure_object_store(self.prefix, server.storage_options)
            self.dataset = lambda: StorageDataset(self.prefix, storage_options=server.storage_options)

    def add(self, i: int) -> None:
        from torch_storage_loader import ObjectStorage
        from torch_storage_loader.file_loader import new_file_name

        if self.kind == "redis":
            handle = FileStorage(str(self.tmp_path / f"{i:04d}.tsl"))
            handle.save(traj(i, n=2))
            self.queue.put(handle)
            return
        ObjectStorage(f"{self.prefix}/{new_file_name()}").save(traj(i, n=2))

    def end(self) -> None:
        if self.kind == "redis":
            self.queue.close()
        else:
            end_directory_stream(self.prefix)


@pytest.mark.parametrize("kind", ["redis", "prefix"])
def test_persistent_workers_that_take_themselves_leave_an_idle_stream_for_the_next_loop(tmp_path, request, kind):
    """As above, where workers take from the source themselves: persistent workers, a loop that
    breaks while its worker polls an idle stream; the next loop starts at once (it used to wait
    until the next entry came: ``RedisStorageQueue.get`` with no timeout, a prefix's poll loop)."""
    stream = _SelfTakingStream(kind, request, tmp_path)
    stream.add(0)
    dl = DataLoader(stream.dataset(), batch_size=None, num_workers=1, persistent_workers=True, timeout=30)
    got = []
    for item in dl:
        got += _ids(item)
        time.sleep(1.0)  # the worker goes on to its next item, and polls the idle stream
        break
    it = iter(dl)  # timed out after 30 s before
    stream.add(1)
    stream.end()
    got += [i for item in it for i in _ids(item)]
    assert got == [0, 1]
    del it, dl


@pytest.mark.parametrize("kind", ["redis", "prefix"])
def test_workers_that_take_themselves_exit_when_a_loop_breaks_on_an_idle_stream(tmp_path, request, kind):
    """A loop that breaks while its workers poll an idle stream: they leave it and exit when torch
    tells them to (torch used to wait 5 s for each, then terminate it: a 10 s ``break``)."""
    stream = _SelfTakingStream(kind, request, tmp_path)
    stream.add(0)
    it = iter(DataLoader(stream.dataset(), batch_size=None, num_workers=2, timeout=30))
    assert _ids(next(it)) == [0]
    time.sleep(1.0)  # both poll the idle stream
    started = time.monotonic()
    del it
    gc.collect()
    # Not a speed check: the exit code cannot tell (a torch worker told SIGTERM by its parent exits
    # with 0), but torch waits 5 s for a worker before it terminates it.
    assert time.monotonic() - started < 4.0
    stream.add(1)
    stream.end()
    assert [i for item in DataLoader(stream.dataset(), batch_size=None, num_workers=2) for i in _ids(item)] == [1]


@pytest.mark.parametrize("kind", ["redis", "prefix"])
def test_each_sample_of_a_trickle_arrives_whichever_worker_took_it(tmp_path, request, kind):
    """Two workers take from a stream that gets one sample at a time: each reaches the trainer as
    soon as it is loaded (in torch's order, one that the other worker took waited behind the worker
    whose turn it was, which polled the idle stream: a stall until more came)."""
    stream = _SelfTakingStream(kind, request, tmp_path)
    it = iter(DataLoader(stream.dataset(), batch_size=None, num_workers=2, timeout=20))
    for i in range(8):
        stream.add(i)
        assert _ids(next(it)) == [i]
    stream.end()
    assert list(it) == []
    del it


def test_a_worker_that_skips_all_it_holds_is_fed_again(tmp_path, caplog):
    """on_error="skip", one worker: a run of handles that fail, longer than what it holds, between
    good ones. Skipping them makes no item, so the trainer learns it holds nothing from its reports
    of what it skipped (it used to learn that from arriving items only, and the stream stalled)."""
    good = _save_all(tmp_path / "files", n=30)
    bad = [FileStorage(str(tmp_path / f"missing-{i}.tsl")) for i in range(40)]
    ds = StorageDataset(_closed_queue([good[0], *bad, *good[1:]]), on_error="skip")
    got = [i for item in DataLoader(ds, batch_size=None, num_workers=1, timeout=30) for i in _ids(item)]
    assert sorted(got) == list(range(30))
    assert ds.stats()["skipped"] == 40


def test_two_iterators_over_one_directory_dataset_share_its_files(tmp_path):
    """Two DataLoader iterators over one StorageDataset of a directory at once (an old one still held,
    say, by an exception's traceback): each file reaches one of them, once (their feeders used to
    share one claim loop unguarded: "generator already executing")."""
    d = str(tmp_path / "dir")
    _save_all(d, n=400)
    end_directory_stream(d)
    ds = StorageDataset(d)
    its = [iter(DataLoader(ds, batch_size=None, num_workers=1, timeout=30)) for _ in range(2)]
    got: list[int] = []
    live = list(its)
    while live:
        for it in list(live):
            try:
                got += _ids(next(it))
            except StopIteration:
                live.remove(it)
    assert sorted(got) == list(range(400))
    del its, live, it
    assert os.listdir(d) == ["_END_OF_STREAM"]


def test_many_handles_in_flight_never_block_a_worker(tmp_path):
    """Each handle a worker takes is written to the trainer's ledger: far more than a pipe holds here."""
    q = StorageQueue()
    for s in _save_all(tmp_path / "files", n=3000):
        q.put(s)
    q.close()
    dl = DataLoader(StorageDataset(q, batch_size=500), batch_size=None, num_workers=2, timeout=60)
    got = _stop_early_then_drain(dl, rounds=2, take=1)
    assert sorted(got) == list(range(3000))


def test_redis_entries_a_slow_trainer_holds_are_not_claimed(tmp_path, redis_server):
    from torch_storage_loader import RedisStorageQueue

    stream = f"s-{uuid.uuid4().hex[:8]}"
    q = RedisStorageQueue(redis_server.url, stream, claim_after=2.0, trusted_roots=EVERYWHERE)
    other = RedisStorageQueue(redis_server.url, stream, claim_after=2.0, trusted_roots=EVERYWHERE)
    theirs: list[int] = []
    try:
        for s in _save_all(tmp_path / "files", n=16):
            q.put(s)
        mine = []
        for item in DataLoader(StorageDataset(q), batch_size=None, num_workers=2, timeout=60):
            mine += _ids(item)
            if len(mine) == 2:  # another consumer comes, looking for idle entries to claim
                for _ in range(30):
                    try:
                        token, storage = other.get(timeout=0.2)
                    except Exception:  # noqa: BLE001 -- nothing to take yet, or the peer is gone: try again
                        continue
                    theirs.append(int(os.path.basename(storage.path)[:4]))
                    other.ack(token)
                q.close()
            time.sleep(0.5)  # what the workers prefetched (4 items) waits longer than claim_after
        assert sorted(mine + theirs) == list(range(16)), "claimed from a live trainer, and delivered twice"
        stats = q.stats()
        assert stats["claimed"] == 0 and stats["duplicates"] == 0, stats
    finally:
        q.delete()
        q.disconnect()
        other.disconnect()


_ITERATOR_ALIVE_AT_EXIT = """
import sys
from torch.utils.data import DataLoader
from torch_storage_loader import FileStorage, StorageDataset

handles = [FileStorage(p) for p in sys.argv[2:]]
persistent = sys.argv[1] == "persistent"  # torch keeps the iterator, and its workers, to the end
it = iter(DataLoader(StorageDataset(handles), batch_size=None, num_workers=2, persistent_workers=persistent))
first = next(it)  # the iterator and its workers are still alive when the interpreter exits
print(int(first["info"]["id"]))
"""


@pytest.mark.parametrize("workers", ["plain", "persistent"])
def test_an_iterator_alive_at_interpreter_exit_shuts_down_quietly(handles, workers):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-X", "dev", "-c", _ITERATOR_ALIVE_AT_EXIT, workers, *[h.path for h in handles[:6]]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "0"
    assert "Exception ignored" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]


KILLED_MID_FEED = """
import sys, time
sys.path.insert(0, {tests!r})
import numpy as np
from torch.utils.data import DataLoader
from _helpers import MemoryStorage
from torch_storage_loader import StorageDataset, StorageQueue

if __name__ == "__main__":
    q = StorageQueue()
    for i in range(2000):  # about 60 KB pickled each: a top-up of 128 is 7.7 MB, fed through 1 MB pipes
        q.put(MemoryStorage({{"x": np.full(15000, i, np.float32)}}))
    q.close()
    dl = DataLoader(StorageDataset(q, batch_size=64), batch_size=None, num_workers=2, multiprocessing_context="fork")
    for k, _ in enumerate(dl):
        if k == 2:
            print("ready", flush=True)
"""


def test_workers_of_a_trainer_killed_mid_feed_exit(tmp_path):
    # A worker reading a message its trainer had written only part of when it was killed must see
    # the feed end (EOF), not wait for the rest for ever: forked workers must not hold the
    # trainer's write ends of the feeds (their own, or each other's).
    import subprocess
    import sys

    script = tmp_path / "trainer.py"
    script.write_text(KILLED_MID_FEED.format(tests=os.path.dirname(__file__)))
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        assert proc.stdout.readline() == b"ready\n", proc.stderr.read().decode()[-3000:]
        time.sleep(0.2)  # feeding: top-ups of 7.7 MB cross the pipes a megabyte at a time
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            left = {p: c for p, c in _helpers.session_processes(proc.pid).items() if "resource_tracker" not in c}
            if not left:
                break
            time.sleep(0.1)
        assert not left, f"the killed trainer's workers still run 30 s later: {left}"
    finally:
        _helpers.kill_session(proc.pid)
        proc.stdout.close()
        proc.stderr.close()
