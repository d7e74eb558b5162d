"""Hostile input (issue 17): one regression test per way a careless or hostile writer broke a consumer.

Whatever another process or machine wrote (Redis records, files, objects, claim names and bodies)
is used, or refused and counted: it never runs code, reads outside the trusted roots, hangs,
leaks, or stops the stream. The fuzz suite (``test_fuzz.py``) covers the same ground at random.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import struct
import threading
import time
import tracemalloc
import uuid
import warnings

import numpy as np
import pytest
from _redis_server import fresh_redis_server, redis_server  # noqa: F401  (fixtures)
from conftest import traj
from torch.utils.data import DataLoader

from torch_storage_loader import (
    FileStorage,
    FileStorageLoader,
    HandleRecordError,
    ObjectStorage,
    RedisStorageQueue,
    StorageCorruptError,
    StorageDataset,
    StorageError,
    StorageUnavailableError,
    end_directory_stream,
)
from torch_storage_loader._redis import records as _records
from torch_storage_loader._stores import config as _stores_config
from torch_storage_loader._stores import objects as _objects

TIMEOUT = 60
FIXED = struct.Struct("<8sIIQQ")


def _stream() -> str:
    return f"hostile-{uuid.uuid4().hex[:12]}"


def _raw(url: str):
    import redis

    return redis.Redis.from_url(url)


def craft(path, header, data: bytes = b"", *, data_size: int | None = None) -> str:
    """A file with this header (a dict, or raw JSON bytes) and data section, valid fixed part."""
    raw = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    offset = -(-(FIXED.size + len(raw)) // 64) * 64
    size = len(data) if data_size is None else data_size
    head = FIXED.pack(b"TSLSTOR\x00", 1, len(raw), offset, size) + raw
    with open(path, "wb") as f:
        f.write(head + bytes(offset - len(head)) + data)
    return str(path)


def _one_array(tree, *, nbytes=16, shape=(4,), dtype="<f4", offset=0) -> dict:
    return {"arrays": [["numpy", dtype, list(shape), offset, nbytes]], "tree": tree}


def _nested(depth: int) -> bytes:
    """A header whose tree is ``depth`` lists deep (as bytes: json.dumps itself cannot nest that far)."""
    return b'{"arrays":[["numpy","<f4",[4],0,16]],"tree":' + b'["l",[' * depth + b'["a",0]' + b"]]" * depth + b"}"


# Files that are well-formed JSON in our layout, but lie: each must be refused as StorageCorruptError.
CRAFTED = {
    "float overflow": _one_array(["d", ["x", "f"], [["a", 0], ["f", "0x1p99999"]]]),
    "deep tree": _nested(3000),
    "overlapping arrays": {
        "arrays": [["numpy", "<f4", [4], 0, 16], ["numpy", "<f4", [4], 0, 16]],
        "tree": ["l", [["a", 0], ["a", 1]]],
    },
    "float nbytes": _one_array(["a", 0], nbytes=16.0),
    "bool in shape": _one_array(["a", 0], shape=(True, 16), nbytes=64),
    "huge complex": _one_array(["l", [["a", 0], ["c", "0x1p99999", "0x0p+0"]]]),
    "unknown tag": _one_array(["l", [["a", 0], ["SECRETTAG", 1]]]),
    "list in a treetensor tree": {
        "arrays": [["torch", "float32", [4], 0, 16]],
        "tree": ["tt", ["a", "b"], [["a", 0], ["l", []]]],
    },
    "empty but too large to make": {
        "arrays": [["numpy", "<f4", [0, 2**62], 0, 0], ["numpy", "<f4", [4], 0, 16]],
        "tree": ["l", [["a", 0], ["a", 1]]],
    },
}


def _good(directory, i: int) -> FileStorage:
    s = FileStorage(os.path.join(str(directory), f"good-{i:03d}.tsl"))
    s.save(traj(i))
    return s


# -------------------------------------------------------------- code execution with allow_pickle=False
class Evil:
    """Unpickling this creates ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def test_allow_pickle_must_be_a_json_boolean(redis_server, tmp_path):
    marker = tmp_path / "unpickled"
    path = tmp_path / "p.tsl"
    FileStorage(path, allow_pickle=True).save({"x": Evil(str(marker))})
    q = RedisStorageQueue(redis_server.url, _stream())
    raw = _raw(redis_server.url)
    q.stats()  # the queue makes its stream and identity key before raw entries go in
    try:
        for value in (1, 1.0, "no", [0], "true"):
            raw.xadd(
                q.stream,
                {"h": json.dumps({"type": "FileStorage", "fields": {"path": str(path), "allow_pickle": value}})},
            )
        q.close()
        got = list(DataLoader(StorageDataset(q), batch_size=None, num_workers=0))
        assert not marker.exists(), "a record with a truthy non-boolean allow_pickle made the consumer unpickle"
        assert got == [] and q.stats()["refused"] == 5
    finally:
        raw.close()
        q.delete()
    for value in (1, 1.0, "no", [0], None):
        with pytest.raises(HandleRecordError, match="allow_pickle"):
            _records.decode(
                json.dumps({"type": "FileStorage", "fields": {"path": str(path), "allow_pickle": value}}),
                trusted_roots=[str(tmp_path)],
            )


# ---------------------------------------------------------------------------------- confinement
def test_network_handles_are_refused_without_trusted_roots(redis_server, tmp_path):
    secret = tmp_path / "secret.tsl"
    FileStorage(secret).save(traj(7))
    q = RedisStorageQueue(redis_server.url, _stream())
    try:
        for h in (FileStorage(secret), FileStorage("/etc/passwd"), ObjectStorage("s3://someone-else/x.tsl")):
            q.put(h)
            with pytest.raises(StorageError, match="trusted_roots") as info:
                q.get(timeout=5)
            assert "secret" not in str(info.value).replace(str(secret), "")  # names the path, nothing else
        # A consumer trusting no root is misconfigured, not attacked: it consumes nothing (issue 28).
        s = q.stats()
        assert (s["refused"], s["acked"], s["pending"], s["undelivered"]) == (0, 0, 0, 3), s
    finally:
        q.delete()


def test_network_handles_load_only_under_trusted_roots(redis_server, tmp_path):
    ok, other = tmp_path / "run", tmp_path / "run-2"
    ok.mkdir()
    other.mkdir()
    FileStorage(other / "x.tsl").save(traj(1))
    os.symlink(other / "x.tsl", ok / "link.tsl")
    os.symlink(other, ok / "dirlink")
    q = RedisStorageQueue(redis_server.url, _stream(), trusted_roots=[str(ok), "s3://bucket/run"])
    try:
        inside = [FileStorage(ok / "a.tsl"), ObjectStorage("s3://bucket/run/a.tsl", size=64)]
        outside = [
            FileStorage(ok / ".." / "run-2" / "x.tsl"),
            FileStorage(other / "x.tsl"),
            FileStorage(ok / "dirlink" / "x.tsl"),
            FileStorage("relative/x.tsl"),
            ObjectStorage("s3://bucket/run-2/a.tsl"),
            ObjectStorage("s3://other/run/a.tsl"),
            ObjectStorage("s3://bucket/run/../secret.tsl"),
            ObjectStorage("gs://bucket/run/a.tsl"),
        ]
        for h in inside + outside:
            q.put(h)
        assert q.get(timeout=5)[1] == inside[0] and q.get(timeout=5)[1] == inside[1]
        for h in outside:  # noqa: B007 -- only the count of refused entries matters
            with pytest.raises(StorageError, match="trusted_roots"):
                q.get(timeout=5)
        assert q.stats()["refused"] == len(outside)
        # the link itself lies in the root: decoded, but opened without following it
        q.put(FileStorage(ok / "link.tsl"))
        _, link = q.get(timeout=5)
        with pytest.raises(StorageError, match="symbolic link"):
            link.load()
    finally:
        q.delete()
    with pytest.raises(ValueError, match="trusted_roots"):
        RedisStorageQueue(redis_server.url, _stream(), trusted_roots=["relative/dir"])
    with pytest.raises(ValueError, match="trusted_roots"):
        RedisStorageQueue(redis_server.url, _stream(), trusted_roots="/one/string")


def test_dataset_storage_options_apply_to_their_buckets_only():
    before = _objects.snapshot()
    try:
        StorageDataset([ObjectStorage("s3://mine-bucket/a.tsl")], storage_options={"key": "K", "secret": "S"})
        assert _objects.config_for("s3://mine-bucket/b.tsl").storage_options == {"key": "K", "secret": "S"}
        assert _objects.config_for("s3://someone-else/x.tsl").storage_options == {}, (
            "the consumer's credentials would be used for any bucket a handle names"
        )
    finally:
        with _stores_config._lock:
            _stores_config._config.clear()
            _stores_config._config.update(before)


def test_errors_never_quote_file_contents(tmp_path):
    foreign = tmp_path / "foreign.tsl"
    foreign.write_bytes(b"SECRETS! password=hunter2\n" * 4)
    lying = craft(tmp_path / "lying.tsl", _one_array(["a", 0], dtype="<SECRETDTYPE"), bytes(64))
    tagged = craft(tmp_path / "tag.tsl", CRAFTED["unknown tag"], bytes(64))
    for path in (foreign, lying, tagged):
        with pytest.raises(StorageCorruptError) as info:
            FileStorage(path).load()
        assert str(path) in str(info.value)
        assert "SECRET" not in str(info.value).replace(str(path), ""), str(info.value)


def test_a_symlink_in_a_watched_directory_is_not_followed(tmp_path):
    outside, watched = tmp_path / "outside", tmp_path / "watched"
    outside.mkdir()
    watched.mkdir()
    FileStorage(outside / "private.tsl").save(traj(99))
    os.symlink(outside / "private.tsl", watched / "a.tsl")
    FileStorage(watched / "b.tsl").save(traj(1))
    end_directory_stream(watched)
    ds = StorageDataset(str(watched), on_error="skip")
    ids = [int(s["info"]["id"]) for s in DataLoader(ds, batch_size=None, num_workers=0)]
    assert ids == [1], "a symlink in the watched directory loaded a file outside it"
    assert (outside / "private.tsl").exists()
    with pytest.raises(StorageError, match="symbolic link"):
        FileStorage(watched / next(n for n in os.listdir(watched) if n.startswith("a.tsl"))).load()


# ----------------------------------------------------------------------------------- poison entries
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_poison_entries_are_refused_never_raised_from_the_dataloader(redis_server, on_error):
    q = RedisStorageQueue(redis_server.url, _stream())
    raw = _raw(redis_server.url)
    q.stats()  # the queue makes its stream and identity key before raw entries go in
    try:
        poison = [
            {"h": "[" * 5000},
            {"h": "{" * 5000},
            {"h": b"\x80\x04junk"},
            {"a": "1", "b": "2"},
            {"h": json.dumps({"type": "FileStorage", "fields": []})},
            {"h": json.dumps([1] * 10)},
            {"h": json.dumps({"type": "FileStorage", "fields": {"path": "/x", "size": 10**400}})[:-2]},
        ]
        for fields in poison:
            raw.xadd(q.stream, fields)
        q.close()
        ds = StorageDataset(q, on_error=on_error)
        assert list(DataLoader(ds, batch_size=None, num_workers=2, timeout=TIMEOUT)) == []
        s = q.stats()
        assert s["refused"] == len(poison) and s["pending"] == 0, s
    finally:
        raw.close()
        q.delete()


def test_poison_entries_between_good_ones(redis_server, tmp_path):
    goods = [_good(tmp_path, i) for i in range(4)]
    q = RedisStorageQueue(redis_server.url, _stream(), trusted_roots=[str(tmp_path)])
    raw = _raw(redis_server.url)
    q.stats()  # the queue makes its stream and identity key before raw entries go in
    try:
        for g in goods:
            raw.xadd(q.stream, {"h": "[" * 5000})
            q.put(g)
        q.close()
        ds = StorageDataset(q)
        ids = sorted(int(s["info"]["id"]) for s in DataLoader(ds, batch_size=None, num_workers=2, timeout=TIMEOUT))
        assert ids == [0, 1, 2, 3]
        s = q.stats()
        assert (s["refused"], s["acked"], s["pending"]) == (4, 4, 0), s
    finally:
        raw.close()
        q.delete()


# ------------------------------------------------------------------------- crafted files vs workers
@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_a_crafted_file_never_breaks_a_loader_worker(tmp_path, name):
    bad = FileStorage(craft(tmp_path / "bad.tsl", CRAFTED[name], bytes(64)))
    good = _good(tmp_path, 3)
    with FileStorageLoader(
        tmp_path / "own", ttl=None, worker_num=1, slots_per_worker=2, max_rings_per_worker=1
    ) as loader:
        loader.start()  # the workers, ready: a fresh loader's first loads are read on its own thread
        assert int(loader.load_async(good).result(timeout=TIMEOUT)["info"]["id"]) == 3  # rings mapped
        pid = loader._workers[0].proc.pid
        for _ in range(3):
            with pytest.raises(StorageCorruptError) as info:
                loader.load_async(bad).result(timeout=TIMEOUT)
            assert type(info.value) is StorageCorruptError and bad.path in str(info.value)
            assert int(loader.load_async(good).result(timeout=TIMEOUT)["info"]["id"]) == 3
        s = loader.stats()
        assert loader._workers[0].proc.pid == pid and s.worker_restarts == 0
        assert s.fallbacks == 0 and s.errors == 3, s  # no slot was lost to a refused file


@pytest.mark.parametrize("batch_size", [None, 2])
def test_a_crafted_file_is_skipped_under_a_dataloader(tmp_path, batch_size):
    handles = []
    for i, name in enumerate(sorted(CRAFTED)):
        handles += [
            _good(tmp_path, 2 * i),
            FileStorage(craft(tmp_path / f"bad-{i}.tsl", CRAFTED[name], bytes(64))),
            _good(tmp_path, 2 * i + 1),
        ]
    ds = StorageDataset(handles, on_error="skip", batch_size=batch_size)
    out = list(DataLoader(ds, batch_size=None, num_workers=1, timeout=TIMEOUT))
    ids = [int(i) for s in out for i in (s["info"]["id"] if batch_size else [s["info"]["id"]])]
    assert ids and all(0 <= i < 2 * len(CRAFTED) for i in ids)
    if batch_size is None:
        assert sorted(ids) == list(range(2 * len(CRAFTED))) and ds.stats()["skipped"] == len(CRAFTED)


def test_a_pickled_leaf_is_refused_where_it_is_read_and_skipped(tmp_path):
    marker = tmp_path / "unpickled"
    pickled = FileStorage(tmp_path / "p.tsl", allow_pickle=True)
    pickled.save({"x": Evil(str(marker))})
    handles = [_good(tmp_path, 0), FileStorage(pickled.path), _good(tmp_path, 1)]
    ds = StorageDataset(handles, on_error="skip")
    ids = [int(s["info"]["id"]) for s in DataLoader(ds, batch_size=None, num_workers=1, timeout=TIMEOUT)]
    assert ids == [0, 1] and ds.stats()["skipped"] == 1 and not marker.exists()


def test_a_refused_batch_never_leaks_a_slot(tmp_path):
    from torch_storage_loader._shm.filling import SlotFiller

    small = {"x": np.arange(4, dtype=np.float32)}
    goods = []
    for i in range(2):
        goods.append(FileStorage(tmp_path / f"g{i}.tsl"))
        goods[-1].save(small)
    bad = FileStorage(craft(tmp_path / "bad.tsl", _one_array(["d", ["x"], [["a", 0]]], nbytes=16.0), bytes(64)))
    filler = SlotFiller(2, budget=1 << 26)
    try:
        sample = filler.materialize_here(filler.fill_batch(goods)[1])
        assert sample["x"].shape == (2, 4)
        del sample
        ring = filler.alloc.rings[0]
        assert ring.free_slots() == 2
        for _ in range(3):
            with pytest.raises(StorageError):
                filler.fill_batch([bad, goods[0]])
        assert ring.free_slots() == 2, "a refused batch kept its slot"
    finally:
        filler.close()


def test_stacking_files_with_long_keys_costs_what_they_weigh(tmp_path):
    from torch_storage_loader import SampleMismatchError
    from torch_storage_loader._format import batch as _batch
    from torch_storage_loader._format import file as _format

    def chain(tag: str) -> dict:
        sample: dict = {"x": np.zeros(2, np.float32)}
        for level in range(60):
            sample = {f"{tag}{level:02d}" + "k" * (100 << 10): sample}
        return sample

    headers = []
    for name, tag in (("a", "a"), ("b", "a"), ("c", "c")):
        FileStorage(tmp_path / f"{name}.tsl").save(chain(tag))
        with open(tmp_path / f"{name}.tsl", "rb") as f:
            headers.append(_format.read_header(f.fileno(), name))
    peak = _traced_peak(lambda: _batch.plan(headers[:2], ["a", "b"]))
    assert peak < 64 << 20, f"stacking two 6 MB headers took {peak >> 20} MiB"
    with pytest.raises(SampleMismatchError) as info:
        _batch.plan([headers[0], headers[2]], ["a", "c"])
    assert len(str(info.value)) < 2000


def test_a_short_second_header_read_is_a_corrupt_error():
    url = f"memory://tsl-{uuid.uuid4().hex[:8]}/big-header.tsl"
    h = ObjectStorage(url)
    h.save({"s": "x" * (100 << 10), "a": np.zeros(3)})  # a header over the first 64 KiB read
    cut = _objects.read_all(url)[: 70 << 10]
    _objects.filesystem(url).pipe_file(url, cut)
    try:
        with pytest.raises(StorageCorruptError, match=url):
            ObjectStorage(url, size=h.size).load()  # the handle lies about the size
    finally:
        _objects.remove(url)


# --------------------------------------------------------------------------------- FIFOs and others
def test_a_fifo_never_hangs_a_loader(tmp_path):
    fifo = tmp_path / "fifo.tsl"
    os.mkfifo(fifo)
    good = _good(tmp_path, 4)
    with FileStorageLoader(tmp_path / "own", ttl=None, worker_num=1) as loader:
        try:
            for special in (fifo, tmp_path, "/dev/null"):
                with pytest.raises(StorageError, match="regular file") as info:
                    loader.load_async(FileStorage(special)).result(timeout=TIMEOUT)
                assert str(special) in str(info.value)
            assert int(loader.load_async(good).result(timeout=TIMEOUT)["info"]["id"]) == 4
        finally:
            _unblock(fifo)


def test_a_fifo_in_a_watched_directory_never_hangs_the_dataloader(tmp_path):
    watched = tmp_path / "watched"
    watched.mkdir()
    os.mkfifo(watched / "a.tsl")
    FileStorage(watched / "b.tsl").save(traj(2))
    end_directory_stream(watched)
    try:
        ds = StorageDataset(str(watched), on_error="skip")
        ids = [int(s["info"]["id"]) for s in DataLoader(ds, batch_size=None, num_workers=1, timeout=30)]
        assert ids == [2]
        assert [n for n in os.listdir(watched) if n.startswith("a.tsl")] == ["a.tsl.failed"]
    finally:
        for name in os.listdir(watched):
            if name.startswith("a.tsl"):
                _unblock(watched / name)


def _unblock(fifo) -> None:
    """Open a FIFO for writing without blocking: frees a reader stuck opening it (the old code)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # nobody is reading it


# ------------------------------------------------------------------------------------------- claims
def test_claim_names_of_any_kind_never_crash_a_consumer(tmp_path):
    host = socket.gethostname()
    watched = tmp_path / "w"
    watched.mkdir()
    for name in (
        f"a.tsl.claimed-{host}-fam-\u00b2",
        f"b.tsl.claimed-{host}-fam-{10**20}",
        f"c.tsl.claimed-{host}-\u0663-1",
        f"d.tsl.claimed-{host}-{10**30}-1",
        "e.tsl.claimed-",
        f"f.tsl.claimed-{host}--1",
        f"g.tsl.claimed-{host}-fam-0",
    ):
        (watched / name).write_bytes(b"claimed by someone")
    long_name = "x" * (255 - len(".tsl")) + ".tsl"
    FileStorage(watched / "short.tmp").save(traj(8))
    os.rename(watched / "short.tmp", watched / long_name)  # (a temporary name of its own would be too long)
    FileStorage(watched / "good.tsl").save(traj(5))
    end_directory_stream(watched)
    ds = StorageDataset(str(watched))
    ids = [int(s["info"]["id"]) for s in DataLoader(ds, batch_size=None, num_workers=0)]
    assert ids == [5]
    assert (watched / long_name).exists()  # a name the consumer cannot claim stays, ignored and counted
    assert ds.stats()["refused"] >= 8


def _put(url: str, body: bytes) -> None:
    _objects.filesystem(url).pipe_file(url, body)


def test_prefix_claim_bodies_of_any_kind_are_ignored_and_counted():
    from torch_storage_loader._sources import END_OF_STREAM

    host = socket.gethostname()
    prefix = f"memory://tsl-{uuid.uuid4().hex[:8]}/p"
    bodies = {
        "a": b"[1, 2]",
        "b": b"[" * 5000,
        "c": json.dumps({"host": host, "family": "fam", "pid": 10**20, "nonce": "n"}).encode(),
        "d": json.dumps({"host": host, "family": "\u00b2", "pid": 1, "nonce": "n"}).encode(),
        "e": json.dumps({"host": host, "family": "x", "pid": 1, "nonce": "n", "pad": "p" * (2 << 20)}).encode(),
        "f": b"\xff\xfe not json",
        "g": json.dumps({"host": host, "family": "x", "pid": True, "nonce": "n"}).encode(),
    }
    try:
        for name, body in bodies.items():
            ObjectStorage(f"{prefix}/{name}.tsl").save(traj(0))
            _put(f"{prefix}/{name}.tsl.claim", body)
        ObjectStorage(f"{prefix}/z.tsl").save(traj(3))
        _put(f"{prefix}/{END_OF_STREAM}", b"")
        ds = StorageDataset(prefix)
        ids = [int(s["info"]["id"]) for s in DataLoader(ds, batch_size=None, num_workers=0)]
        assert ids == [3]
        assert ds.stats()["refused"] == len(bodies)
    finally:
        _objects.filesystem(prefix).rm(prefix, recursive=True)


# ------------------------------------------------------------------------------------------- memory
def _traced_peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    except StorageError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak


def test_header_parse_cost_is_bounded(tmp_path):
    lists = craft(tmp_path / "lists.tsl", b'{"arrays":[],"tree":["l",[' + b",".join([b"[]"] * (1 << 20)) + b"]]}")
    strings = craft(tmp_path / "strs.tsl", b'{"arrays":[],"tree":["l",[' + b",".join([b'"ab"'] * (1 << 19)) + b"]]}")
    for path in (lists, strings):
        assert os.path.getsize(path) > 2 << 20
        peak = _traced_peak(lambda: FileStorage(path).load())  # noqa: B023 -- called within this iteration
        assert peak < 12 << 20, f"parsing a {os.path.getsize(path) >> 20} MiB header took {peak >> 20} MiB"


def test_parsed_headers_are_cached_within_a_size_bound():
    from torch_storage_loader._format import file as _format
    from torch_storage_loader._format import tree as _tree
    from torch_storage_loader._shm import refs as _refs

    _tree._plans.clear()
    opts = _format.ReadOptions()
    for i in range(40):
        # A huge key is structure (a huge str value travels beside the key, never cached: see split).
        header = _format.Header(["d", [f"{i}" * (1 << 20)], [["n"]]], (), 0, 0)
        _tree.plan_for(_refs.plan_key(header, opts)[0])
    cached = sum(len(k) for k in _tree._plans)
    _tree._plans.clear()
    assert cached <= 16 << 20, f"{cached >> 20} MiB of headers cached"


def test_redis_entries_are_size_checked_before_they_are_read(fresh_redis_server):
    server = fresh_redis_server()
    q = RedisStorageQueue(server.url, _stream())
    raw = _raw(server.url)
    q.stats()  # the queue makes its stream and identity key before raw entries go in
    try:
        raw.xadd(q.stream, {"h": b"x" * (32 << 20)})
        raw.xadd(q.stream, {"h": b"y" * (32 << 20), "other": b"1"})
        q.stats()  # connected, group made

        def sent() -> int:
            return int(raw.info("stats")["total_net_output_bytes"])

        before = sent()
        for _ in range(2):
            with pytest.raises(HandleRecordError, match=r"bytes|field"):
                q.get(timeout=5)
        assert sent() - before < 1 << 20, "the whole entry crossed the network before its size was checked"
        assert q.stats()["refused"] == 2
    finally:
        raw.close()
        q.delete()


def test_object_reads_keep_a_bounded_window_in_flight():
    url = f"memory://tsl-{uuid.uuid4().hex[:8]}/big.tsl"
    h = ObjectStorage(url)
    h.save({"x": np.ones(96 << 20, np.uint8)})
    try:
        peak = _traced_peak(lambda: h.load())
        assert peak < 48 << 20, f"reading a 96 MiB object held {peak >> 20} MiB of ranges at once"
        assert h.load()["x"].sum() == 96 << 20
    finally:
        _objects.remove(url)


# ------------------------------------------------------------------------------------------ secrets
def test_passwords_never_show_whatever_the_url_form(fresh_redis_server, caplog):
    password, user = "pw-1a2b3c4d5e6f", "default"
    server = fresh_redis_server(password=password)
    caplog.set_level(logging.DEBUG)
    port = server.port
    forms = [
        f"redis://127.0.0.1:{port}/0?password={password}",
        f"redis://127.0.0.1:{port}/0?username={user}&password={password}",
        f"redis://{user}:{password}@127.0.0.1:{port}/0",
    ]
    shown = []
    for url in forms:
        q = RedisStorageQueue(url, _stream())
        try:
            q.put(FileStorage("/p/0.tsl"))
            shown += [repr(q), q.url]
        finally:
            q.delete()
        wrong = url.replace(password, "wrong-" + password)
        with pytest.raises(StorageUnavailableError) as bad:
            RedisStorageQueue(wrong, _stream(), retry_timeout=0.5).put(FileStorage("/p/1.tsl"))
        closed = url.replace(str(port), "1")
        with pytest.raises(StorageUnavailableError) as down:
            RedisStorageQueue(closed, _stream(), retry_timeout=0.5).put(FileStorage("/p/1.tsl"))
        shown += [str(bad.value), str(down.value), bad.value.url, down.value.url]
    tls = RedisStorageQueue(f"rediss://127.0.0.1:{port}/0?ssl_password={password}&ssl_keyfile=/k.pem", _stream())
    shown += [repr(tls), tls.url, repr(RedisStorageQueue(f"unix:///tmp/r.sock?db=0&password={password}", "s"))]
    shown += [r.getMessage() for r in caplog.records]
    assert any("retrying" in r.getMessage() for r in caplog.records)
    leaks = [s for s in shown if password in s or f"{user}:" in s]
    assert not leaks, leaks


# --------------------------------------------------------------------------- fork, threads, shutdown
def _hold_then_fork(lock, use) -> int:
    """Fork while another thread holds ``lock``; the child calls ``use()``. Returns the child's status."""
    held, release = threading.Event(), threading.Event()

    def holder():
        with lock:
            held.set()
            release.wait(30)

    t = threading.Thread(target=holder)
    t.start()
    held.wait(10)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork() with threads
            pid = os.fork()
        if pid == 0:  # the child: must not deadlock on the lock its parent's thread held
            code = 1
            signal.alarm(10)
            try:
                use()
                code = 0
            finally:
                os._exit(code)
        deadline = time.monotonic() + 30
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                return os.waitpid(pid, 0)[1]
            time.sleep(0.05)
    finally:
        release.set()
        t.join()


def test_module_locks_are_renewed_at_fork():
    from torch_storage_loader._dataloader import items
    from torch_storage_loader._shm.alloc import FillInfo

    cases = {
        "_stores.config": (lambda: _stores_config._lock, lambda: _objects.snapshot()),
        "_redis.records": (lambda: _records._lock, lambda: _records.registered_storage_types()),
        "dataset": (lambda: items._stats_lock, lambda: items.record("x", FillInfo("slot", 1), 0)),
    }
    for name, (lock, use) in cases.items():
        status = _hold_then_fork(lock(), use)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"{name}: a forked child deadlocked"


def test_the_ledger_thread_survives_garbage_from_a_worker(caplog):
    import multiprocessing as mp

    from torch_storage_loader._dataloader.ledger import Ledger

    class Source:
        keep_alive_every = None
        ack_in_background = False
        fed_from_trainer = False

        def __init__(self):
            self.acked = []

        def ack(self, tokens):
            self.acked += tokens

        def give_back(self, tokens):
            pass

    source = Source()
    ledger = Ledger(source, 1, mp.get_context("fork"))
    try:
        w = ledger.writers[0]
        w.send(("drop", 0, 0, ["never-taken"]))
        w.send(("what", "is", "this"))
        w.send(("take", 0, 0, ["t1"]))
        time.sleep(0.5)
        assert ledger._thread.is_alive(), "the tsl-ledger thread died"
        ledger.delivered(0)
        ledger.handed()
        assert source.acked == ["t1"]
    finally:
        ledger.started()
        ledger.close()


def test_shutdown_is_bounded_while_the_object_store_is_down(tmp_path):
    opts = {"key": "k", "secret": "s", "endpoint_url": "http://127.0.0.1:1"}  # nothing listens there
    loader = FileStorageLoader(
        f"s3://tsl-down-{uuid.uuid4().hex[:6]}/p", ttl=1, worker_num=1, storage_options=opts, retry_timeout=60
    )
    with pytest.raises(StorageError):
        loader.load_async(FileStorage(tmp_path / "missing.tsl")).result(timeout=TIMEOUT)  # starts the cleaner
    time.sleep(1.5)  # its first listing of the prefix is being retried now
    start = time.monotonic()
    loader.shutdown()
    took = time.monotonic() - start
    assert took < 20, f"shutdown waited {took:.0f} s for an object store that is down"


def test_local_unlinks_run_outside_the_loaders_locks(tmp_path, monkeypatch):
    from torch_storage_loader._stores import clean as _clean

    a = FileStorageLoader(tmp_path, ttl=0.5, worker_num=1)
    b = FileStorageLoader(tmp_path, ttl=0.5, worker_num=1)
    # a's files expire unread: it warns once, from a sweep or at shutdown.
    with pytest.warns(UserWarning, match="3 files .* before anyone loaded them"):
        try:
            for i in range(3):
                a.save(traj(i))
            leftover = tmp_path / f"{0:020d}-1-0123456789ab.tsl"  # another (ended) process's old file
            FileStorage(leftover).save(traj(9))
            os.utime(leftover, (1, 1))
            held = []
            real_remove = _clean.os.remove

            def remove(path):
                held.append([lk.locked() for lk in (a._files_lock, b._files_lock)])
                return real_remove(path)

            monkeypatch.setattr(_clean.os, "remove", remove)
            time.sleep(0.6)
            a.clean_expired()
            assert held and not any(any(h) for h in held), f"unlinked under a loader's lock: {held}"
        finally:
            monkeypatch.undo()
            a.shutdown()
            b.shutdown()
