"""``StorageQueue``: what its owner process holds, how producers leave, how the stream ends."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import queue
import threading
import time

import pytest

from torch_storage_loader import FileStorage, StorageError, StorageQueue
from torch_storage_loader._proc import pid_alive


def _put_many(q: StorageQueue, start: int, n: int) -> None:
    for i in range(start, start + n):
        q.put(FileStorage(f"sample-{i:06d}.tsl"))


def _consume(q: StorageQueue, out) -> None:
    try:
        out.put(sum(1 for _ in q))
    except StorageError as e:
        out.put(str(e))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_producers_exit_with_their_handles_unread(method):
    """A multiprocessing.Queue's writer cannot exit while its pipe holds unread handles (a 64 KiB
    pipe holds a few hundred); a StorageQueue's producer leaves at once, and nothing is lost."""
    q = StorageQueue()
    ctx = mp.get_context(method)
    procs = [ctx.Process(target=_put_many, args=(q, k * 3000, 3000)) for k in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    q.close()
    names = [s.path for s in q]
    assert sorted(names) == [f"sample-{i:06d}.tsl" for i in range(6000)]


def _put_paths(q: StorageQueue, paths: list[str]) -> None:
    for path in paths:
        q.put(FileStorage(path))


def test_handles_taken_many_at_a_time_arrive_whole_once_in_order():
    """A consumer asking for many handles (a trainer feeding its workers) takes every whole frame
    that is there in one read: handles of every size, some larger than what one read looks at, some
    half written by the owner's thread when read, all arrive whole, once, in the order they were put."""
    sizes = [1, 100, 70_000, 5, 30_000, 65_530, 3, 200_000] * 10 + [10] * 500
    paths = [f"{i:05d}-" + "x" * n for i, n in enumerate(sizes)]
    q = StorageQueue()
    producer = mp.get_context("fork").Process(target=_put_paths, args=(q, paths))
    producer.start()
    got: list[str] = []
    while (taken := q._take(64, 30)) is not None:
        assert 1 <= len(taken) <= 64
        got += [pickle.loads(data).path for data in taken]
        if len(got) == len(paths):
            q.close()
    producer.join(60)
    assert got == paths


def test_a_full_queue_releases_its_producers_when_closed():
    """A bounded queue that nobody reads any more (the trainer stopped) must not strand producers
    blocked in ``put``: closing it lets them finish, and their handles stay for the next consumer."""
    q = StorageQueue(maxsize=4)
    _put_many(q, 0, 4)
    with pytest.raises(queue.Full):
        q.put(FileStorage("x.tsl"), timeout=0.2)
    t = threading.Thread(target=_put_many, args=(q, 4, 3), name="blocked-producer")
    t.start()
    time.sleep(0.3)
    assert t.is_alive(), "the queue is full: put waits"
    q.close()
    t.join(5)
    assert not t.is_alive()
    assert q.closed
    assert sorted(s.path for s in q) == [f"sample-{i:06d}.tsl" for i in range(7)]


def test_the_bound_counts_what_is_in_the_queue():
    q = StorageQueue(maxsize=2)
    _put_many(q, 0, 2)
    assert q.get().path == "sample-000000.tsl"
    q.put(FileStorage("c.tsl"), block=False)  # taking one made room for one
    with pytest.raises(queue.Full):
        q.put(FileStorage("d.tsl"), block=False)
    q.give_back([FileStorage("returned.tsl")])  # what comes back does not count
    q.close()
    assert sorted(s.path for s in q) == ["c.tsl", "returned.tsl", "sample-000001.tsl"]


def test_a_dropped_queue_stops_its_thread():
    q = StorageQueue()
    _put_many(q, 0, 10)
    assert any(t.name == "tsl-queue" for t in threading.enumerate())
    del q
    gc.collect()
    assert not any(t.name == "tsl-queue" for t in threading.enumerate())


def _owner_that_leaves(out) -> None:
    """Makes a queue, hands it to a consumer, and exits without closing it (``os._exit``: no join)."""
    q = StorageQueue()
    consumer = mp.get_context("spawn").Process(target=_consume, args=(q, out))
    consumer.start()
    out.put(consumer.pid)
    time.sleep(1)  # the consumer waits on an empty, open queue when its owner goes
    os._exit(0)


def test_a_consumer_learns_that_the_owner_is_gone():
    """The queue lives in the process that made it: a consumer waiting after that process exited
    gets an error that says so, instead of waiting for ever."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    owner = ctx.Process(target=_owner_that_leaves, args=(out,))
    owner.start()
    consumer = out.get(timeout=60)
    owner.join(60)
    message = out.get(timeout=30)
    assert f"the process that made this StorageQueue (pid {owner.pid}) has exited" in message
    deadline = time.monotonic() + 10
    while pid_alive(consumer) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(consumer)


def _put_until_refused(q: StorageQueue, out) -> None:
    """Puts handles until a put raises; reports what it raised."""
    try:
        for i in range(10**9):
            q.put(FileStorage(f"sample-{i:06d}.tsl"))
            if i == 10:
                out.put("putting")
    except Exception as e:  # noqa: BLE001 - reported to the test whatever it is
        out.put(f"{type(e).__name__}: {e}")


def _owner_that_leaves_a_producer(out) -> None:
    """Makes a queue, starts a producer putting into it, and exits without closing it."""
    q = StorageQueue()
    producer = mp.get_context("spawn").Process(target=_put_until_refused, args=(q, out))
    producer.start()
    assert out.get(timeout=60) == "putting"
    os._exit(0)


def test_a_producer_learns_that_the_owner_is_gone():
    """A producer whose queue's owner exited gets the library's error naming the owner, not a bare
    BrokenPipeError from the pipe nothing reads any more."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    owner = ctx.Process(target=_owner_that_leaves_a_producer, args=(out,))
    owner.start()
    owner.join(60)
    message = out.get(timeout=30)
    assert message.startswith("StorageError: the process that made this StorageQueue"), message
    assert f"(pid {owner.pid})" in message


def _pass_on(q: StorageQueue) -> None:
    """A spawned process hands the queue it was given to a process it starts (a DDP rank's workers)."""
    child = mp.get_context("spawn").Process(target=_put_many, args=(q, 0, 5))
    child.start()
    child.join(60)
    assert child.exitcode == 0


def test_a_queue_travels_on_from_a_process_it_travelled_to():
    q = StorageQueue()
    p = mp.get_context("spawn").Process(target=_pass_on, args=(q,))
    p.start()
    p.join(120)
    assert p.exitcode == 0
    q.close()
    assert [s.path for s in q] == [f"sample-{i:06d}.tsl" for i in range(5)]
