"""RedisStorageQueue against real redis-server processes (no mocks): delivery, claims, restarts, safety."""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import os
import pickle
import queue as _queue
import signal
import threading
import time
import uuid

import pytest
from _redis_server import EVERYWHERE, fresh_redis_server, redis_server  # noqa: F401  (fixtures)

from torch_storage_loader import (
    FileStorage,
    HandleRecordError,
    ProducerDiedError,
    RedisStorageQueue,
    RedisStreamLostError,
    StorageUnavailableError,
)
from torch_storage_loader.redis_queue import stream_keys


def _stream() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def _raw(url: str):
    import redis

    return redis.Redis.from_url(url)


def _drain(q: RedisStorageQueue, out: list, ack: bool = True) -> None:
    with q:
        for token, storage in q:
            out.append(storage.path)
            if ack:
                q.ack(token)


def _join(procs, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


# -- processes (module-level, so that spawned children can import them) ----------------------------


def produce(q: RedisStorageQueue, k: int, count: int) -> None:
    with q.producer():
        for i in range(count):
            q.put(FileStorage(f"/data/p{k}/{i:04d}.tsl"))


def consume(q: RedisStorageQueue, out) -> None:
    got: list = []
    _drain(q, got)
    out.put(got)


def take_and_hang(q: RedisStorageQueue, n: int, out) -> None:
    tokens = [q.get()[0] for _ in range(n)]
    out.put(tokens)
    time.sleep(600)


def produce_then_die(q: RedisStorageQueue, name: str | None = None) -> None:
    with q.producer(name):
        q.put(FileStorage("/data/last.tsl"))
        os.kill(os.getpid(), signal.SIGKILL)


# -- tests --------------------------------------------------------------------------------------------


def test_put_get_ack_roundtrip(redis_server, handles):
    q = RedisStorageQueue(redis_server.url, _stream(), trusted_roots=EVERYWHERE)
    try:
        ids = [q.put(h) for h in handles[:5]]
        got = [q.get(timeout=5) for _ in range(5)]
        assert [t for t, _ in got] == ids
        assert [s for _, s in got] == handles[:5]
        assert all(type(s) is FileStorage and s.load()["info"]["id"] == i for i, (_, s) in enumerate(got))
        assert q.stats()["pending"] == 5
        assert q.ack(*[t for t, _ in got[:2]]) == 2
        for t, _ in got[2:]:
            assert q.ack(t) == 1
        with pytest.raises(_queue.Empty):
            q.get(timeout=0.3)
        q.close()
        assert q.get() is None
        s = q.stats()
        assert (s["delivered"], s["acked"], s["duplicates"], s["claimed"], s["pending"]) == (5, 5, 0, 0, 0)
        assert s["length"] == 0, "acknowledged entries are trimmed"
    finally:
        q.delete()


def _sockets_to(port: int) -> int:
    """This process's TCP connections to 127.0.0.1:port."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # the descriptor listdir itself used
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    with open("/proc/self/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return sum(int(r[2].split(":")[1], 16) == port and r[9] in inodes for r in rows)


def test_disconnect_closes_sockets_and_the_queue_reconnects(redis_server):
    port = int(redis_server.url.rsplit(":", 1)[1].split("/")[0])
    with RedisStorageQueue(redis_server.url, _stream(), trusted_roots=EVERYWHERE) as q:
        q.put(FileStorage("/d/1.tsl"))
        assert _sockets_to(port) == 1
        q.disconnect()
        assert _sockets_to(port) == 0
        token, storage = q.get(timeout=5)  # reconnects
        assert storage.path == "/d/1.tsl" and q.ack(token) == 1 and _sockets_to(port) == 1
        q.delete()
    assert _sockets_to(port) == 0, "leaving the with block closes the connection"
    q = RedisStorageQueue(redis_server.url, _stream(), trusted_roots=EVERYWHERE)
    q.stats()
    del q
    assert _sockets_to(port) == 0, "a dropped queue closes its connection"


def test_validation_and_pickle(redis_server):
    with pytest.raises(ValueError, match="claim_after=0 must be > 0"):
        RedisStorageQueue(redis_server.url, "s", claim_after=0)
    with pytest.raises(ValueError, match="prefetch=0"):
        RedisStorageQueue(redis_server.url, "s", prefetch=0)
    with pytest.raises(ValueError, match="redis://"):
        RedisStorageQueue("http://example.com", "s")
    q = RedisStorageQueue(redis_server.url, _stream(), claim_after=3, trusted_roots=EVERYWHERE)
    try:
        q.put(FileStorage("/a.tsl"))  # connected
        copy = pickle.loads(pickle.dumps(q))
        assert not copy._redis.connected and copy.consumer != q.consumer and copy.claim_after == 3
        assert copy.get(timeout=5)[1] == FileStorage("/a.tsl")
        with pytest.raises(TypeError, match="Storage handles"):
            q.put("/a.tsl")
    finally:
        q.delete()


def test_retry_for_is_the_old_name_of_retry_timeout():
    with pytest.warns(DeprecationWarning, match="use retry_timeout="):
        q = RedisStorageQueue("redis://127.0.0.1:1/0", "s", retry_for=2.5)
    assert q.retry_timeout == 2.5
    assert pickle.loads(pickle.dumps(q)).retry_timeout == 2.5  # pickled under the new name: no warning
    with pytest.raises(ValueError, match="retry_timeout=-1"):
        RedisStorageQueue("redis://127.0.0.1:1/0", "s", retry_timeout=-1)


def test_ack_and_give_back_take_a_list_as_storage_queue_does(redis_server):
    q = RedisStorageQueue(redis_server.url, _stream(), trusted_roots=EVERYWHERE)
    try:
        for i in range(3):
            q.put(FileStorage(f"/l/{i}.tsl"))
        tokens = [q.get(timeout=5)[0] for _ in range(3)]
        assert q.give_back([tokens[0]]) == 1
        assert q.ack([tokens[1]]) == 1 and q.ack(tokens[2]) == 1 and q.ack([]) == 0
        with pytest.raises(TypeError, match="not both"):
            q.ack([tokens[1]], tokens[2])
        token, storage = q.get(timeout=5)  # the one given back, delivered again
        assert storage == FileStorage("/l/0.tsl") and q.ack([token], failed=True) == 1
        assert q.stats()["failed"] == 1 and q.stats()["returned"] == 1
    finally:
        q.delete()


def test_close_ends_iteration_for_every_consumer(redis_server):
    stream = _stream()
    q = RedisStorageQueue(redis_server.url, stream, trusted_roots=EVERYWHERE)
    try:
        for i in range(30):
            q.put(FileStorage(f"/c/{i}.tsl"))
        outs = [[] for _ in range(3)]
        threads = [
            threading.Thread(
                target=_drain, args=(RedisStorageQueue(redis_server.url, stream, trusted_roots=EVERYWHERE), out)
            )
            for out in outs
        ]
        for t in threads:
            t.start()
        time.sleep(0.3)
        q.close()
        for t in threads:
            t.join(15)
        assert not any(t.is_alive() for t in threads), "a consumer did not stop after close()"
        assert sorted(p for out in outs for p in out) == sorted(f"/c/{i}.tsl" for i in range(30))
        s = q.stats()
        assert (s["delivered"], s["acked"], s["duplicates"], s["pending"]) == (30, 30, 0, 0)
    finally:
        q.delete()


def test_producers_and_consumers_in_processes(redis_server):
    ctx = mp.get_context("spawn")
    q = RedisStorageQueue(redis_server.url, _stream(), trusted_roots=EVERYWHERE)
    out = ctx.Queue()
    try:
        consumers = [ctx.Process(target=consume, args=(q, out)) for _ in range(2)]
        producers = [ctx.Process(target=produce, args=(q, k, 40)) for k in range(3)]
        for p in consumers + producers:
            p.start()
        _join(producers)
        q.close()
        got = [out.get(timeout=60) for _ in consumers]
        _join(consumers)
        everything = [p for g in got for p in g]
        assert sorted(everything) == sorted(f"/data/p{k}/{i:04d}.tsl" for k in range(3) for i in range(40))
        s = q.stats()
        assert (s["delivered"], s["acked"], s["duplicates"], s["pending"]) == (120, 120, 0, 0)
        assert q.dead_producers() == []
    finally:
        out.close()
        out.join_thread()
        q.delete()


def test_killed_consumer_entries_are_claimed(redis_server):
    ctx = mp.get_context("spawn")
    claim_after = 2.0
    q = RedisStorageQueue(redis_server.url, _stream(), claim_after=claim_after, trusted_roots=EVERYWHERE)
    out = ctx.Queue()
    try:
        for i in range(10):
            q.put(FileStorage(f"/k/{i}.tsl"))
        victim = ctx.Process(target=take_and_hang, args=(q, 3, out))
        victim.start()
        taken = out.get(timeout=60)
        os.kill(victim.pid, signal.SIGKILL)
        victim.join()
        killed_at = time.monotonic()
        q.close()
        got, when = {}, {}
        for token, storage in q:
            got[token] = storage.path
            when[token] = time.monotonic() - killed_at
            q.ack(token)
        assert sorted(got.values()) == [f"/k/{i}.tsl" for i in range(10)]
        assert all(when[t] < claim_after + 3 for t in taken), when
        s = q.stats()
        assert (s["claimed"], s["duplicates"], s["acked"], s["delivered"], s["pending"]) == (3, 3, 10, 13, 0)
        q.ack(taken[0])  # a late acknowledgement from the consumer we thought dead: already counted
        assert q.stats()["duplicates"] == 3
    finally:
        out.close()
        out.join_thread()
        q.delete()


def test_dead_producer_raises(redis_server):
    ctx = mp.get_context("spawn")
    q = RedisStorageQueue(redis_server.url, _stream(), producer_timeout=1.0, trusted_roots=EVERYWHERE)
    try:
        p = ctx.Process(target=produce_then_die, args=(q,))
        p.start()
        p.join(60)
        assert p.exitcode == -signal.SIGKILL
        token, storage = q.get(timeout=10)
        assert storage.path == "/data/last.tsl"
        q.ack(token)
        t0 = time.monotonic()
        with pytest.raises(ProducerDiedError, match="forget_dead_producers") as info:
            q.get(timeout=30)
        assert time.monotonic() - t0 < 5
        assert info.value.producers == q.dead_producers() and len(info.value.producers) == 1
        assert q.forget_dead_producers() == info.value.producers
        with pytest.raises(_queue.Empty):
            q.get(timeout=0.5)
    finally:
        q.delete()


def test_producer_heartbeat_thread(redis_server):
    q = RedisStorageQueue(redis_server.url, _stream(), producer_timeout=0.4, trusted_roots=EVERYWHERE)
    try:
        with q.producer():
            assert [t.name for t in threading.enumerate()].count("tsl-redis-heartbeat") == 1
            time.sleep(1.0)  # past the heartbeat's TTL: refreshed meanwhile
            assert q.dead_producers() == []
            q.put(FileStorage("/h.tsl"))
        assert "tsl-redis-heartbeat" not in [t.name for t in threading.enumerate()]
        assert q.get(timeout=5)[1] == FileStorage("/h.tsl")
        with pytest.raises(_queue.Empty):
            q.get(timeout=0.5)  # the producer left: nobody is dead
    finally:
        q.delete()


def test_redis_restart_loses_nothing(fresh_redis_server, caplog):
    caplog.set_level(logging.WARNING, "torch_storage_loader")
    # "always": under "everysec", Redis postpones writing the append-only file (up to 2 s) while a
    # background fsync runs, and replies meanwhile: a put acknowledged just before SIGKILL was lost
    # on a busy machine (CI, stop 39). What Redis loses no queue can give back.
    server = fresh_redis_server(appendonly=True, args=("--appendfsync", "always"))
    stream = _stream()
    q = RedisStorageQueue(server.url, stream, claim_after=2.0, retry_timeout=20.0, trusted_roots=EVERYWHERE)
    n = 300
    outs = [[] for _ in range(2)]
    errors = []

    def run(out):
        try:
            _drain(
                RedisStorageQueue(server.url, stream, claim_after=2.0, retry_timeout=20.0, trusted_roots=EVERYWHERE),
                out,
            )
        except Exception as exc:  # noqa: BLE001 -- reported below
            errors.append(exc)

    consumers = [threading.Thread(target=run, args=(out,)) for out in outs]
    for t in consumers:
        t.start()
    try:
        for i in range(n):
            q.put(FileStorage(f"/r/{i:04d}.tsl"))
            if i == n // 2:
                server.stop(signal.SIGKILL)
                server.start()
            time.sleep(0.002)
        q.close()
        for t in consumers:
            t.join(60)
        assert not any(t.is_alive() for t in consumers)
        assert not errors, errors
        got = [p for out in outs for p in out]
        assert set(got) == {f"/r/{i:04d}.tsl" for i in range(n)}  # redeliveries allowed, losses not
        assert any("retrying" in r.getMessage() for r in caplog.records), "the restart went unnoticed"
        s = q.stats()
        assert s["pending"] == 0 and s["acked"] >= n
    finally:
        q.close()
        for t in consumers:
            t.join(30)


class Evil:
    """Unpickling this would create ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def test_forged_records_are_refused(redis_server, tmp_path):
    from _helpers import MemoryStorage

    from torch_storage_loader import register_storage_type
    from torch_storage_loader._redis import records as _records

    q = RedisStorageQueue(redis_server.url, _stream(), trusted_roots=EVERYWHERE)
    raw = _raw(redis_server.url)
    marker = tmp_path / "unpickled"
    try:
        q.put(FileStorage("/ok/0.tsl"))
        raw.xadd(q.stream, {"h": json.dumps({"type": "os.system", "fields": {"command": f"touch {marker}"}})})
        raw.xadd(q.stream, {"h": pickle.dumps(Evil(str(marker)))})
        raw.xadd(q.stream, {"h": json.dumps({"type": "_helpers.MemoryStorage", "fields": {"path": "m"}})})
        raw.xadd(q.stream, {"h": json.dumps({"type": "FileStorage", "fields": {"path": "/x", "allow_pickle": True}})})
        raw.xadd(q.stream, {"h": json.dumps({"type": "FileStorage", "fields": {"path": "/x", "load": 1}})})
        raw.xadd(q.stream, {"payload": b"\x80\x04junk"})
        q.put(FileStorage("/ok/1.tsl"))

        assert q.get(timeout=5)[1] == FileStorage("/ok/0.tsl")
        with pytest.raises(HandleRecordError, match=r"'os\.system'.*register_storage_type"):
            q.get(timeout=5)
        with pytest.raises(HandleRecordError, match=r"not a JSON handle record.*never as pickles"):
            q.get(timeout=5)
        with pytest.raises(HandleRecordError, match=r"_helpers.MemoryStorage"):
            q.get(timeout=5)
        with pytest.raises(HandleRecordError, match="allow_pickle=True"):
            q.get(timeout=5)
        with pytest.raises(HandleRecordError, match="'load'"):
            q.get(timeout=5)
        with pytest.raises(HandleRecordError, match="not one h field"):
            q.get(timeout=5)
        assert q.get(timeout=5)[1] == FileStorage("/ok/1.tsl")
        assert not marker.exists(), "a payload was unpickled"
        s = q.stats()
        assert s["refused"] == 6 and s["pending"] == 2  # refused entries are acknowledged, never redelivered

        with pytest.raises(HandleRecordError, match=r"_helpers\.MemoryStorage.*register_storage_type"):
            q.put(MemoryStorage([1, 2], "m"))
        try:
            register_storage_type(MemoryStorage)
            q.put(MemoryStorage([1, {"a": None}], "m"))
            assert q.get(timeout=5)[1] == MemoryStorage([1, {"a": None}], "m")
            with pytest.raises(HandleRecordError, match=r"MemoryStorage.value is a bytes"):
                q.put(MemoryStorage(b"raw", "m"))
        finally:
            _records._REGISTRY.pop("_helpers.MemoryStorage", None)
    finally:
        raw.close()
        q.delete()


def test_password_never_shows(fresh_redis_server, caplog):
    password = "pw-9f8e7d6c5b4a"
    server = fresh_redis_server(password=password)
    caplog.set_level(logging.DEBUG)
    q = RedisStorageQueue(server.url, _stream(), trusted_roots=EVERYWHERE)
    try:
        assert password in server.url
        q.put(FileStorage("/p/0.tsl"))
        token, storage = q.get(timeout=5)
        q.ack(token)
        shown = [repr(q), str(q.url), repr(storage), repr(token), repr(q.stats())]
        shown += [repr(e) for e in _raw(server.url).xrange(q.stream)]
        wrong = server.url.replace(password, "wrong-" + password)
        with pytest.raises(StorageUnavailableError, match="refused the credentials") as bad:
            RedisStorageQueue(wrong, _stream(), retry_timeout=0.5, trusted_roots=EVERYWHERE).put(
                FileStorage("/p/1.tsl")
            )
        closed_port = server.url.replace(str(server.port), "1")
        with pytest.raises(StorageUnavailableError, match="unreachable") as down:
            RedisStorageQueue(closed_port, _stream(), retry_timeout=0.5, trusted_roots=EVERYWHERE).put(
                FileStorage("/p/1.tsl")
            )
        shown += [
            str(bad.value),
            str(down.value),
            bad.value.url,
            down.value.url,
            repr(pickle.loads(pickle.dumps(down.value))),
        ]
        shown += [r.getMessage() for r in caplog.records]
        assert any("retrying" in r.getMessage() for r in caplog.records)
        assert "***" in repr(q)
        assert not [s for s in shown if password in s]
    finally:
        q.delete()


def test_trimming_keeps_undelivered_and_pending(redis_server):
    stream = _stream()
    q = RedisStorageQueue(redis_server.url, stream, trusted_roots=EVERYWHERE)
    other = RedisStorageQueue(redis_server.url, stream, group="evaluators", trusted_roots=EVERYWHERE)
    raw = _raw(redis_server.url)
    try:
        other.stats()  # joins the stream first: its group is created from the start
        for i in range(10):
            q.put(FileStorage(f"/t/{i}.tsl"))
        got = [q.get(timeout=5) for _ in range(5)]
        q.ack(got[0][0], got[1][0])
        assert q.trim() == 0 and raw.xlen(stream) == 10  # the evaluators read nothing yet
        for _ in range(10):
            t, _s = other.get(timeout=5)
            other.ack(t)
        q.trim()  # (acknowledging also trims, at most once a second per queue object)
        assert raw.xlen(stream) == 8  # trainers: entry 2 is still pending
        q.ack(*[t for t, _ in got[2:]])
        assert q.trim() == 3 and raw.xlen(stream) == 5  # entries 5.. are undelivered to the trainers
        q.close()
        for t, _s in q:
            q.ack(t)
        assert raw.xlen(stream) == 0
    finally:
        raw.close()
        q.delete()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dataloader_delivers_every_handle_once(redis_server, handles, method):
    from torch.utils.data import DataLoader

    from torch_storage_loader import StorageDataset

    q = RedisStorageQueue(redis_server.url, _stream(), trusted_roots=EVERYWHERE)
    try:
        for h in handles:
            q.put(h)
        q.close()
        dl = DataLoader(StorageDataset(q), batch_size=None, num_workers=2, multiprocessing_context=method)
        ids = sorted(int(s["info"]["id"]) for s in dl)
        del dl
        assert ids == list(range(len(handles)))
        s = q.stats()
        assert (s["delivered"], s["acked"], s["duplicates"], s["pending"], s["failed"]) == (24, 24, 0, 0, 0)
    finally:
        q.delete()


def test_produced_under_a_name_a_restarted_producer_takes_over(redis_server):
    ctx = mp.get_context("spawn")
    q = RedisStorageQueue(redis_server.url, _stream(), producer_timeout=0.5, trusted_roots=EVERYWHERE)
    try:
        p = ctx.Process(target=produce_then_die, args=(q, "collector-7"))
        p.start()
        p.join(60)
        assert p.exitcode == -signal.SIGKILL
        with q.producer("collector-7"):  # restarted under its name: its heartbeat goes on
            time.sleep(1.0)  # twice producer_timeout
            assert q.dead_producers() == []
            token, _ = q.get(timeout=5)
            q.ack(token)
            with pytest.raises(_queue.Empty):
                q.get(timeout=0.3)  # empty, and nobody is dead
        assert q.dead_producers() == []
        with pytest.raises(ValueError, match="name=''"), q.producer(""):
            pass
    finally:
        q.delete()


def _keys_of(raw, *streams: str) -> set:
    """Every key in the database that belongs to one of ``streams`` (either layout)."""
    out = set()
    for key in raw.scan_iter(count=1000):
        key = key.decode()
        if any(key == s or key.startswith((f"tsl:{{{s}}}:", f"tsl:{s}:")) for s in streams):
            out.add(key)
    return out


def test_delete_touches_exactly_its_keys(redis_server):
    """Regression: delete() of stream ``NAME*`` deleted ``NAME-42``'s keys too (a SCAN pattern made of the name)."""
    base = _stream()
    star, neighbour = (
        RedisStorageQueue(redis_server.url, base + "*", trusted_roots=EVERYWHERE),
        RedisStorageQueue(redis_server.url, base + "-42", trusted_roots=EVERYWHERE),
    )
    raw = _raw(redis_server.url)
    producers = contextlib.ExitStack()
    try:
        for q in (star, neighbour):
            producers.enter_context(q.producer("p"))  # registered, heartbeat alive, until the end
            q.put(FileStorage("/d/0.tsl"))
            q.put(FileStorage("/d/1.tsl"))
            token, _ = q.get(timeout=5)
            q.ack(token)
            q.ack(token)  # a duplicate: the dups set exists
            q.close()
            raw.set(f"tsl:{q.stream}:closed", b"1")  # 0.1's layout: removed by name too
        before = _keys_of(raw, neighbour.stream)
        assert before == set(stream_keys(neighbour.stream)) | {f"tsl:{neighbour.stream}:closed"}
        neighbour_stats = neighbour.stats()
        star.delete()
        assert _keys_of(raw, star.stream) == set(), "delete() left keys of its own"
        assert _keys_of(raw, neighbour.stream) == before, "delete() touched another stream's keys"
        assert neighbour.stats() == neighbour_stats
        token, storage = neighbour.get(timeout=5)
        assert storage == FileStorage("/d/1.tsl")
        neighbour.ack(token)
        assert neighbour.get(timeout=5) is None, "the neighbour is still closed"
        star.put(FileStorage("/d/again.tsl"))  # a deleted stream starts afresh
        assert star.get(timeout=5)[1] == FileStorage("/d/again.tsl")
    finally:
        producers.close()
        raw.close()
        star.delete()
        neighbour.delete()
    assert _keys_of(_raw(redis_server.url), star.stream, neighbour.stream) == set()


def test_keys_of_a_stream_share_one_cluster_slot():
    from redis.crc import key_slot

    for name in ("run-42", "a:b", "x*y", "ünï"):
        assert {key_slot(k.encode()) for k in stream_keys(name)} == {key_slot(name.encode())}
    with pytest.raises(ValueError, match="may not contain"):
        RedisStorageQueue("redis://127.0.0.1:1/0", "run-{42}")


def test_a_stream_of_the_old_layout_is_refused_with_a_way_out(redis_server):
    from torch_storage_loader._redis import records as _records

    stream = _stream()
    raw = _raw(redis_server.url)
    try:  # what 0.1 left: the stream under its name, its group, tsl:NAME:... keys
        raw.xadd(stream, {"h": _records.encode(FileStorage("/old/0.tsl"))})
        raw.xgroup_create(stream, "trainers", id="0")
        raw.set(f"tsl:{stream}:closed", b"1")
        raw.hset(f"tsl:{stream}:producers", "host-1-abc", "host pid 1")
        raw.set(f"tsl:{stream}:hb:host-1-abc", b"1")
        raw.hset(f"tsl:{stream}:trainers:stats", "delivered", 1)
        raw.set(f"tsl:{stream}-other:closed", b"1")  # another stream's: never touched
        q = RedisStorageQueue(redis_server.url, stream, trusted_roots=EVERYWHERE)
        with pytest.raises(RedisStreamLostError, match=r"not made by this version.*\.delete\(\)") as info:
            q.get(timeout=1)
        assert info.value.stream == stream and pickle.loads(pickle.dumps(info.value)).stream == stream
        with pytest.raises(RedisStreamLostError):
            q.put(FileStorage("/new/0.tsl"))
        q.delete()
        assert _keys_of(raw, stream) == set() and raw.exists(f"tsl:{stream}-other:closed")
        q.put(FileStorage("/new/0.tsl"))
        assert q.get(timeout=5)[1] == FileStorage("/new/0.tsl")
    finally:
        raw.delete(f"tsl:{stream}-other:closed")
        raw.close()
        RedisStorageQueue(redis_server.url, stream).delete()


def train_until_lost(q: RedisStorageQueue, out, restarted) -> None:
    """A trainer: DataLoader(StorageDataset(q), num_workers=2); report its first sample, then how it ended."""
    from torch.utils.data import DataLoader

    from torch_storage_loader import StorageDataset

    it = iter(DataLoader(StorageDataset(q), batch_size=None, num_workers=2))
    out.put(("first", int(next(it)["info"]["id"])))
    restarted.wait(60)
    t0 = time.monotonic()
    try:
        n = sum(1 for _ in it)
        out.put(("ended", n, time.monotonic() - t0))
    except Exception as exc:  # noqa: BLE001 -- the child reports what it raised to the parent test
        out.put(("raised", type(exc).__name__, time.monotonic() - t0))
    import faulthandler

    # Should this process not exit, the test's captured stderr shows where each thread is.
    faulthandler.dump_traceback_later(40, exit=False)


def test_restart_without_persistence_is_an_error_not_an_end(fresh_redis_server, handles):
    """Redis restarted empty: consumers, producers and DataLoaders raise RedisStreamLostError (no hang, no end)."""
    server = fresh_redis_server(appendonly=False)
    stream = _stream()
    q = RedisStorageQueue(server.url, stream, retry_timeout=10.0, trusted_roots=EVERYWHERE)
    producer = RedisStorageQueue(server.url, stream, retry_timeout=10.0, trusted_roots=EVERYWHERE)
    for h in handles[:10]:
        producer.put(h)
    held = [q.get(timeout=5) for _ in range(3)]  # delivered, not acknowledged
    ctx = mp.get_context("spawn")
    out, restarted = ctx.Queue(), ctx.Event()
    trainer = ctx.Process(target=train_until_lost, args=(q, out, restarted))
    trainer.start()
    try:
        kind, first = out.get(timeout=120)
        assert kind == "first" and 3 <= first < 10
        copy = pickle.loads(pickle.dumps(q))  # knows the stream too, though it never connected

        server.stop(signal.SIGKILL)
        server.start()  # empty: no stream, no group, no epoch
        restarted.set()
        t0 = time.monotonic()
        with pytest.raises(RedisStreamLostError, match=r"identity key .* is gone.*appendonly") as info:
            q.get(timeout=30)
        assert time.monotonic() - t0 < 10, "the loss was noticed late"
        assert info.value.stream == stream and info.value.url == server.url
        with pytest.raises(RedisStreamLostError):
            q.ack(held[0][0])
        with pytest.raises(RedisStreamLostError):
            producer.put(handles[10])
        with pytest.raises(RedisStreamLostError):
            producer.close()
        ended = out.get(timeout=60)  # the DataLoader raises; it never ends as if the stream were drained
        assert ended[:2] == ("raised", "RedisStreamLostError") and ended[2] < 15, ended
        trainer.join(60)
        assert trainer.exitcode == 0

        fresh = RedisStorageQueue(
            server.url, stream, trusted_roots=EVERYWHERE
        )  # a new process starts the stream anew (a new epoch)
        fresh.put(handles[11])
        with pytest.raises(RedisStreamLostError, match="made anew"):
            copy.get(timeout=30)
        with pytest.raises(RedisStreamLostError, match="made anew"):
            q.get(timeout=30)
        assert fresh.get(timeout=5)[1] == handles[11]
        fresh.delete()
    finally:
        if trainer.is_alive():
            trainer.kill()
        trainer.join()
        out.close()
        out.join_thread()


def test_entries_another_trainer_holds_do_not_hold_the_end_back(redis_server):
    """Regression (found by benchmarks/fleet.py): two trainers each with an in-order DataLoader deadlocked at
    the end of a stream: each held one worker's sample back until its other worker ended, and that worker
    waited for the other trainer's held entry to be acknowledged."""
    from torch_storage_loader.redis_queue import _family

    stream = _stream()
    q = RedisStorageQueue(redis_server.url, stream, trusted_roots=EVERYWHERE)
    trainer_b = RedisStorageQueue(redis_server.url, stream, trusted_roots=EVERYWHERE)
    worker_a = RedisStorageQueue(redis_server.url, stream, trusted_roots=EVERYWHERE)
    try:
        q.put(FileStorage("/e/0.tsl"))
        q.put(FileStorage("/e/1.tsl"))
        q.close()
        held, _ = trainer_b.get(timeout=5)
        trainer_b.keep_alive(held, family=_family("b"))  # trainer B's DataLoader has it, not yet trained on
        worker_a.join_trainer("a")  # as a StorageDataset worker of trainer A does
        token, _ = worker_a.get(timeout=5)
        worker_a.ack(token)
        assert worker_a.get(timeout=5) is None, "trainer A's worker waited for trainer B's sample"
        assert trainer_b.ack(held) == 1
        assert q.get(timeout=5) is None
    finally:
        q.delete()


# -- issue 28: a consumer that trusts no root loses nothing; what is refused is counted -----------------


def test_a_consumer_trusting_no_root_raises_and_leaves_the_entry_for_a_configured_one(redis_server, tmp_path):
    from torch_storage_loader import UntrustedStorageError

    stream = _stream()
    forgot = RedisStorageQueue(redis_server.url, stream, prefetch=3)  # no trusted_roots
    configured = RedisStorageQueue(redis_server.url, stream, trusted_roots=[str(tmp_path)])
    try:
        paths = [str(tmp_path / f"{i}.tsl") for i in range(3)]
        for p in paths:
            forgot.put(FileStorage(p))
        forgot.close()
        for _ in range(2):  # refused again each time: it never gives up the entries, nor consumes them
            with pytest.raises(UntrustedStorageError, match="trusted_roots=") as info:
                forgot.get(timeout=5)
            assert any(p in str(info.value) for p in paths), info.value
        s = forgot.stats()
        assert (s["acked"], s["refused"], s["pending"], s["delivered"]) == (0, 0, 0, 0), s
        got = []
        for token, storage in configured:  # at once: nothing waits for claim_after
            got.append(storage.path)
            configured.ack(token)
        assert sorted(got) == paths
        s = configured.stats()
        assert (s["delivered"], s["acked"], s["refused"], s["pending"]) == (3, 3, 0, 0), s
    finally:
        forgot.delete()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dataset_trusting_no_root_raises_out_of_next_and_loses_nothing(redis_server, handles, num_workers):
    from torch.utils.data import DataLoader

    from torch_storage_loader import StorageDataset, UntrustedStorageError

    stream, store = _stream(), os.path.dirname(handles[0].path)
    q = RedisStorageQueue(redis_server.url, stream)
    try:
        for h in handles[:6]:
            q.put(h)
        q.close()
        it = iter(
            DataLoader(StorageDataset(q), batch_size=None, num_workers=num_workers, timeout=60 if num_workers else 0)
        )
        started = time.monotonic()
        with pytest.raises(UntrustedStorageError, match="trusted_roots=") as info:
            next(it)
        message = str(info.value)
        del info, it  # the traceback holds the iterator: its workers stop once both are gone
        assert store in message and time.monotonic() - started < 30
        configured = RedisStorageQueue(redis_server.url, stream, trusted_roots=[store])
        ids = sorted(int(s["info"]["id"]) for s in DataLoader(StorageDataset(configured), batch_size=None))
        assert ids == list(range(6))
        s = q.stats()
        assert (s["delivered"], s["acked"], s["refused"], s["pending"], s["failed"]) == (6, 6, 0, 0, 0), s
    finally:
        q.delete()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_dataset_counts_what_its_source_refused(redis_server, handles, tmp_path, num_workers):
    """Handles outside the configured roots stay refused and acknowledged, and the dataset counts them,
    also those refused after a worker's last sample, or with no sample at all."""
    from torch.utils.data import DataLoader

    from torch_storage_loader import StorageDataset

    store = os.path.dirname(handles[0].path)
    for goods in (0, 2):
        q = RedisStorageQueue(redis_server.url, _stream(), trusted_roots=[store])
        try:
            for h in handles[:goods]:
                q.put(h)
            for i in range(5):
                q.put(FileStorage(tmp_path / "elsewhere" / f"{i}.tsl"))
            q.close()
            ds = StorageDataset(q)
            got = list(DataLoader(ds, batch_size=None, num_workers=num_workers, timeout=60 if num_workers else 0))
            assert len(got) == goods
            del got
            assert q.stats()["refused"] == 5
            assert ds.stats()["refused"] == 5, ds.stats()
        finally:
            q.delete()


def test_forked_workers_do_not_count_the_trainers_refusals_again(redis_server, tmp_path):
    from torch.utils.data import DataLoader

    from torch_storage_loader import StorageDataset

    q = RedisStorageQueue(redis_server.url, _stream(), trusted_roots=[str(tmp_path / "mine")])
    try:
        for i in range(5):
            q.put(FileStorage(tmp_path / "elsewhere" / f"{i}.tsl"))
        q.close()
        ds = StorageDataset(q)
        assert list(DataLoader(ds, batch_size=None, num_workers=0)) == []
        assert ds.stats()["refused"] == 5
        # the stream is drained: forked workers (which inherit the trainer's source) end at once
        assert list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=60)) == []
        assert ds.stats()["refused"] == 5, ds.stats()
    finally:
        q.delete()
