"""RedisStorageQueue on a real Redis Cluster (3 masters, 3 replicas) and behind a real Sentinel, on 127.0.0.1."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from _redis_cluster import redis_cluster, redis_sentinel  # noqa: F401  (fixtures)
from _redis_server import EVERYWHERE

from torch_storage_loader import FileStorage, RedisStorageQueue
from torch_storage_loader.redis_queue import stream_keys


def _stream() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def _flow(q: RedisStorageQueue, n: int, fault, *, consumers: int = 2, at: float = 0.5) -> tuple[list, list]:
    """Put ``n`` handles from a producer thread while ``consumers`` threads take and acknowledge them;
    call ``fault()`` once ``at`` of them were put. Returns (ids acknowledged by ``put``, paths got)."""
    import pickle

    put_ids, got, errors = [], [], []

    def consume() -> None:
        try:
            with pickle.loads(pickle.dumps(q)) as mine:
                for token, storage in mine:
                    got.append(storage.path)
                    mine.ack(token)
        except Exception as exc:  # noqa: BLE001 -- reported below
            errors.append(exc)

    threads = [threading.Thread(target=consume) for _ in range(consumers)]
    for t in threads:
        t.start()
    try:
        with q.producer():
            for i in range(n):
                put_ids.append((q.put(FileStorage(f"/c/{i:04d}.tsl")), f"/c/{i:04d}.tsl"))
                if i == int(n * at):
                    fault()
                time.sleep(0.002)
        q.close()
    finally:
        for t in threads:
            t.join(90)
    assert not any(t.is_alive() for t in threads), "a consumer hung"
    assert not errors, errors
    return put_ids, got


def test_cluster_keys_share_a_slot_and_streams_spread_over_masters(redis_cluster):
    import redis

    raw = redis.RedisCluster.from_url(redis_cluster.url)
    names = [_stream() for _ in range(12)]
    try:
        for name in names:
            q = RedisStorageQueue(redis_cluster.url, name, cluster=True, trusted_roots=EVERYWHERE)
            with q.producer("p"):
                q.put(FileStorage("/x/0.tsl"))
                token, storage = q.get(timeout=5)
                assert storage == FileStorage("/x/0.tsl") and q.ack(token) == 1
                q.ack(token)  # a duplicate: every key of the stream exists now
            q.close()
            assert q.get(timeout=5) is None
            s = q.stats()
            assert (s["delivered"], s["acked"], s["duplicates"], s["pending"]) == (1, 1, 1, 0)
            assert len({raw.keyslot(k) for k in stream_keys(name)}) == 1
            q.disconnect()
        masters = {redis_cluster.master_of(name) for name in names}
        assert len(masters) >= 2, "streams of different names should land on different masters"
        with pytest.raises(ValueError, match="cluster=True"):  # a node that holds only some slots
            for name in names:
                RedisStorageQueue(redis_cluster.url, name).put(FileStorage("/x/1.tsl"))
    finally:
        for name in names:
            RedisStorageQueue(redis_cluster.url, name, cluster=True).delete()
        assert not [k for name in names for k in stream_keys(name) if raw.exists(k)]
        raw.close()


@pytest.mark.slow
def test_cluster_master_killed_replica_promoted_nothing_lost(redis_cluster):
    stream = _stream()
    q = RedisStorageQueue(
        redis_cluster.url,
        stream,
        cluster=True,
        replicas=1,
        claim_after=2.0,
        retry_timeout=30.0,
        trusted_roots=EVERYWHERE,
    )
    killed, failover = [], []

    def kill_master() -> None:
        port = redis_cluster.master_of(stream)
        redis_cluster.kill(port)
        killed.append(port)

        def bring_back() -> None:  # as an operator would: it rejoins as the new master's replica
            failover.append(redis_cluster.wait_failover(port, stream))
            redis_cluster.restart(port)

        failover.append(threading.Thread(target=bring_back))
        failover[0].start()

    try:
        put_ids, got = _flow(q, 300, kill_master)
        failover[0].join(60)
        assert killed and failover[1:] and failover[1] != killed[0], "the replica was not promoted"
        assert set(got) == {path for _, path in put_ids}, "a handle acknowledged by put was lost"
        s = q.stats()
        assert s["pending"] == 0 and s["acked"] >= len(put_ids)
    finally:
        if failover:
            failover[0].join(60)
        q.delete()


@pytest.mark.slow
def test_sentinel_url_follows_a_failover_nothing_lost(redis_sentinel):
    stream = _stream()
    url = redis_sentinel.url
    q = RedisStorageQueue(url, stream, replicas=1, claim_after=2.0, retry_timeout=30.0, trusted_roots=EVERYWHERE)
    old = redis_sentinel.master_port()
    assert q.url == url and "sentinel" in repr(q)
    back = []

    def kill_master() -> None:
        redis_sentinel.master.stop()

        def bring_back() -> None:  # as an operator would: Sentinel makes it the new master's replica
            deadline = time.monotonic() + 60
            while redis_sentinel.master_port() == old and time.monotonic() < deadline:
                time.sleep(0.1)
            redis_sentinel.master.start()

        back.append(threading.Thread(target=bring_back))
        back[0].start()

    try:
        try:
            put_ids, got = _flow(q, 200, kill_master)
        except Exception as exc:  # what the servers and the Sentinel did (e.g. failed over twice) says why
            raise AssertionError(f"{exc!r}\n{redis_sentinel.log()}") from exc
        back[0].join(60)
        assert redis_sentinel.master_port() != old, "Sentinel did not fail over"
        assert set(got) == {path for _, path in put_ids}, "a handle acknowledged by put was lost"
    finally:
        if back:
            back[0].join(60)
        q.delete()
        q.disconnect()


def test_sentinel_url_validation():
    with pytest.raises(ValueError, match="SERVICE"):
        RedisStorageQueue("redis+sentinel://127.0.0.1:26379", "s")
    with pytest.raises(ValueError, match="bad Sentinel address"):
        RedisStorageQueue("redis+sentinel://h:x/svc", "s")
    with pytest.raises(ValueError, match="cluster=True needs"):
        RedisStorageQueue("redis+sentinel://h/svc", "s", cluster=True)
    q = RedisStorageQueue("redis+sentinel://user:pw-secret@h1:1,[::1]:2/svc/3", "s")
    assert q.url == "redis+sentinel://***@h1:1,[::1]:2/svc/3" and q.url in repr(q)
