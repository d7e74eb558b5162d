"""Trust boundary, round 2 (issue 30): failures past the parser are refused like failures in it.

A file or a name that passes the parser's checks may still fail later: where the sample is built
(the trainer's unpickle), where samples are stacked, where a source renames a claim. Each test
here is one way that used to hang a DataLoader, lose good samples, leak a slot or read outside the
trusted roots; each must now end in a ``StorageError`` naming the sample, under ``on_error``.
"""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest
import torch
from _redis_server import fresh_redis_server, redis_server  # noqa: F401  (fixtures)
from conftest import traj
from test_hostile import craft
from torch.utils.data import DataLoader

from torch_storage_loader import (
    DirectorySource,
    FileStorage,
    ObjectStorage,
    RedisStorageQueue,
    StorageCorruptError,
    StorageDataset,
    StorageError,
    UntrustedStorageError,
    register_storage_type,
)

TIMEOUT = 10  # a DataLoader's timeout: a hang becomes a RuntimeError


def _good(directory, i: int) -> FileStorage:
    s = FileStorage(os.path.join(str(directory), f"good-{i:03d}.tsl"))
    s.save(traj(i))
    return s


def _ids(out, batched: bool) -> list[int]:
    if batched:
        return sorted(int(i) for s in out for i in s["info"]["id"])
    return sorted(int(s["info"]["id"]) for s in out)


# Files whose header is valid but whose sample cannot be built (or stacked) from them.
def _bad_string(path) -> FileStorage:
    """A str scalar whose code point is not one (numpy refuses to make the str)."""
    header = {"arrays": [["numpy_scalar", "<U1", [], 0, 4]], "tree": ["d", ["info"], [["a", 0]]]}
    return FileStorage(craft(path, header, b"\xff\xff\xff\xff" + bytes(60)))


def _unstackable(path) -> FileStorage:
    """Valid alone (an empty array of a huge shape); two of them stacked make a shape numpy refuses."""
    header = {"arrays": [["numpy", "<f4", [0, 2**60], 0, 0]], "tree": ["d", ["x"], [["a", 0]]]}
    return FileStorage(craft(path, header, b""))


# ------------------------------------------------------------------ class 1: failures after the worker
@pytest.mark.parametrize("on_error", ["skip", "raise"])
@pytest.mark.parametrize("loader_batch", [None, 2])
def test_a_sample_that_cannot_be_built_is_refused_in_the_worker(tmp_path, on_error, loader_batch):
    handles = [_good(tmp_path, 0), _bad_string(tmp_path / "bad.tsl"), _good(tmp_path, 1), _good(tmp_path, 2)]
    ds = StorageDataset(handles, on_error=on_error)
    loader = DataLoader(ds, batch_size=loader_batch, num_workers=1, timeout=TIMEOUT)
    if on_error == "raise":
        it = iter(loader)
        with pytest.raises(StorageCorruptError) as info:
            for _ in range(4):
                next(it)
        assert handles[1].path in str(info.value)
        list(it)  # what follows comes (or the data ends), never a wait for the lost item
        return
    out = list(loader)
    assert _ids(out, loader_batch is not None) == [0, 1, 2]  # the good samples batched with it too
    assert ds.stats()["skipped"] == 1  # with DataLoader-side batching too (the worker counts it)


@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_files_that_cannot_be_stacked_are_refused_in_the_worker(tmp_path, on_error):
    a, b = _unstackable(tmp_path / "a.tsl"), _unstackable(tmp_path / "b.tsl")
    handles = [a, b]
    for i in range(4):
        handles.append(FileStorage(tmp_path / f"x{i}.tsl"))
        handles[-1].save({"x": np.zeros((0, 2**60), np.float32)[:, :1] + i})
    ds = StorageDataset(handles, on_error=on_error, batch_size=2)
    loader = DataLoader(ds, batch_size=None, num_workers=1, timeout=TIMEOUT)
    if on_error == "raise":
        with pytest.raises(StorageError) as info:
            list(loader)
        assert a.path in str(info.value)
        return
    out = list(loader)
    assert len(out) == 2 and all(s["x"].shape == (2, 0, 1) for s in out)
    assert ds.stats()["skipped"] == 2  # the batch's two files: each loads alone, they cannot be stacked


# ------------------------------------------------------------- class 4: a slot leased on the fast path
def test_a_batch_whose_arrays_match_but_whose_tree_does_not_leaks_no_slot(tmp_path):
    from torch_storage_loader import SampleMismatchError
    from torch_storage_loader._shm.filling import SlotFiller

    goods = []
    for i in range(2):
        goods.append(FileStorage(tmp_path / f"g{i}.tsl"))
        goods[-1].save({"x": np.arange(4, dtype=np.float32) + i})
    other = FileStorage(tmp_path / "other.tsl")
    other.save({"y": np.arange(4, dtype=np.float32)})  # same arrays, same size: read on the fast path
    assert os.path.getsize(other.path) == os.path.getsize(goods[0].path)
    filler = SlotFiller(2, budget=1 << 26)
    try:
        del filler.materialize_here(filler.fill_batch(goods)[1])["x"]  # the layout the fast path guesses
        ring = filler.alloc.rings[0]
        assert ring.free_slots() == 2
        for _ in range(3):
            with pytest.raises(SampleMismatchError):
                filler.fill_batch([goods[0], other])
        assert ring.free_slots() == 2, "a refused batch kept its slot"
    finally:
        filler.close()


# ------------------------------------------------------------------ class 7: bool leaves are 0 or 1
@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_bool_leaf_whose_bytes_are_not_0_or_1_is_refused(tmp_path, num_workers):
    header = {"arrays": [["numpy", "|b1", [4], 0, 4]], "tree": ["d", ["done"], [["a", 0]]]}
    bad = FileStorage(craft(tmp_path / "bad.tsl", header, b"\x00\x01\x02\xff" + bytes(60)))
    with pytest.raises(StorageCorruptError, match="bool"):
        bad.load()
    made = FileStorage(tmp_path / "made.tsl")  # bool made from other bytes: saved as its truth values
    raw = np.array([0, 1, 2, 255], np.uint8)
    made.save({"t": torch.from_numpy(raw.copy()).view(torch.bool), "n": raw.view(bool)})
    back = made.load()
    assert back["t"].view(torch.uint8).tolist() == [0, 1, 1, 1] and back["n"].view(np.uint8).tolist() == [0, 1, 1, 1]
    handles = [_good(tmp_path, 0), bad, _good(tmp_path, 1)]
    ds = StorageDataset(handles, on_error="skip")
    out = list(DataLoader(ds, batch_size=None, num_workers=num_workers, timeout=TIMEOUT if num_workers else 0))
    assert _ids(out, False) == [0, 1] and ds.stats()["skipped"] == 1


# ----------------------------------------------- class 3: confinement by what is loaded, not by class
@register_storage_type
class MyStorage(FileStorage):
    """The register_storage_type docstring's example: the library's own file load path."""


@register_storage_type
class MyObjectStorage(ObjectStorage):
    pass


def test_a_registered_subclass_is_confined_to_the_trusted_roots(redis_server, tmp_path):
    ok, other = tmp_path / "run", tmp_path / "elsewhere"
    ok.mkdir()
    other.mkdir()
    MyStorage(str(other / "secret.tsl")).save(traj(7))
    MyStorage(str(ok / "a.tsl")).save(traj(1))
    q = RedisStorageQueue(
        redis_server.url, f"trust-{uuid.uuid4().hex[:12]}", trusted_roots=[str(ok), "s3://bucket/run"]
    )
    try:
        outside = [MyStorage(str(other / "secret.tsl")), MyObjectStorage("s3://bucket/secret.tsl")]
        for h in [MyStorage(str(ok / "a.tsl")), *outside]:
            q.put(h)
        _, inside = q.get(timeout=5)
        assert type(inside) is MyStorage and int(inside.load()["info"]["id"]) == 1
        for _ in outside:
            with pytest.raises(UntrustedStorageError, match="trusted_roots"):
                q.get(timeout=5)
        assert q.stats()["refused"] == len(outside)
    finally:
        q.delete()


# ------------------------------------------------------------------ class 6: no file text in messages
def test_stacking_errors_and_skip_logs_never_quote_keys_from_files(tmp_path, caplog):
    from torch_storage_loader import SampleMismatchError

    pairs = [
        ({"SECRET-a": np.zeros(3, np.float32)}, {"SECRET-b": np.zeros(3, np.float32)}),  # other keys
        ({"SECRET-x": np.zeros((3, 2), np.float32)}, {"SECRET-x": np.zeros((4, 2), np.float32)}),  # shapes
        ({"SECRET-x": [np.zeros(2, np.float32)]}, {"SECRET-x": [np.zeros(2, np.float32)] * 2}),  # lengths
    ]
    handles = []
    for i, (a, b) in enumerate(pairs):
        handles += [FileStorage(tmp_path / f"{i}a.tsl"), FileStorage(tmp_path / f"{i}b.tsl")]
        handles[-2].save(a)
        handles[-1].save(b)
        with pytest.raises(SampleMismatchError) as info:
            next(iter(StorageDataset(handles[-2:], batch_size=2)))
        assert "SECRET" not in str(info.value) and "at <root>" in str(info.value), str(info.value)
    ds = StorageDataset(handles, batch_size=2, on_error="skip")
    with caplog.at_level("WARNING", logger="torch_storage_loader"):
        assert list(DataLoader(ds, batch_size=None)) == []
    assert ds.stats()["skipped"] == 2 * len(pairs) and "cannot stack" in caplog.text  # counted per file
    assert "SECRET" not in caplog.text, caplog.text


# -------------------------------------------------- class 2: names in a watched directory are data
def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_hostile_names_in_a_watched_directory_never_end_the_dataloader(tmp_path, on_error):
    import socket

    from torch_storage_loader import end_directory_stream

    host, dead = socket.gethostname(), _dead_pid()
    watched = tmp_path / "w"
    watched.mkdir()
    (watched / "sub").mkdir()
    (watched / "sub" / "x").write_bytes(b"")
    for original in (".", "..", "sub"):  # dead claims whose release renames onto a directory
        (watched / f"{original}.claimed-{host}-{dead}-{dead}").write_bytes(b"")
    for i in range(3):
        _good(watched, i)
        os.makedirs(watched / f"good-{i:03d}.tsl.loaded" / "x")  # where an acknowledged file is renamed to
    if on_error == "skip":
        craft(watched / "bad.tsl", {"arrays": [], "tree": ["x"]})  # refused: renamed to .failed
        os.makedirs(watched / "bad.tsl.failed" / "x")  # ... which is a directory
        os.makedirs(watched / "dir.tsl" / "x")  # a directory to claim, then refuse, then fail
        os.makedirs(watched / "dir.tsl.failed" / "x")
    end_directory_stream(watched)
    ds = StorageDataset(DirectorySource(watched, delete_after_load=False), on_error=on_error)
    out = list(DataLoader(ds, batch_size=None, num_workers=1, timeout=TIMEOUT))
    assert _ids(out, False) == [0, 1, 2]
    stats = ds.stats()
    assert stats["refused"] >= 3 and stats["skipped"] == (2 if on_error == "skip" else 0), stats


# ----------------------------------------------------- class 5: private memory is bounded too
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_a_sparse_file_claiming_more_than_max_shm_bytes_is_refused_without_workers(tmp_path, on_error):
    from torch_storage_loader import SampleTooLargeError

    big = 256 << 20
    header = {"arrays": [["numpy", "|u1", [big], 0, big]], "tree": ["d", ["x"], [["a", 0]]]}
    sparse = FileStorage(craft(tmp_path / "sparse.tsl", header, b"", data_size=big))
    with open(sparse.path, "r+b") as f:
        f.truncate(os.path.getsize(sparse.path) + big)  # a few KiB of disk, 256 MiB of data section
    handles = [_good(tmp_path, 0), sparse, _good(tmp_path, 1)]
    ds = StorageDataset(handles, on_error=on_error, max_shm_bytes=64 << 20)
    before = _rss()
    if on_error == "raise":
        with pytest.raises(SampleTooLargeError, match="max_shm_bytes") as info:
            list(DataLoader(ds, batch_size=None, num_workers=0))
        assert sparse.path in str(info.value)
    else:
        assert _ids(list(DataLoader(ds, batch_size=None, num_workers=0)), False) == [0, 1]
        assert ds.stats()["skipped"] == 1
    assert _rss() - before < 64 << 20


# ------------------------------------------- the Redis ACL recipe of the security guide, as written
def _producer_acl() -> list[str]:
    """docs/guides/security.md's recipe, as written there (for stream ``run-1``), split as redis-cli does."""
    import pathlib
    import shlex

    guide = pathlib.Path(__file__).parent.parent / "docs" / "guides" / "security.md"
    line = next(x for x in guide.read_text().splitlines() if x.startswith("ACL SETUSER producer "))
    return shlex.split(line.replace(">PASSWORD", ">producer-pw"))


def test_the_redis_acl_recipe_lets_a_producer_append_and_nothing_more(fresh_redis_server, tmp_path):
    import redis

    server = fresh_redis_server()
    stream = "run-1"
    consumer = RedisStorageQueue(server.url, stream, trusted_roots=[str(tmp_path)])
    admin = redis.Redis.from_url(server.url)
    try:
        consumer.stats()  # the consumer makes the stream and its group first
        admin.execute_command(*_producer_acl())
        url = f"redis://producer:producer-pw@127.0.0.1:{server.port}/0"
        producer = RedisStorageQueue(url, stream)
        with producer.producer("collector-0"):
            producer.put(_good(tmp_path, 4))
        assert int(consumer.get(timeout=5)[1].load()["info"]["id"]) == 4
        raw = redis.Redis.from_url(url)
        meta = f"tsl:{{{stream}}}:meta"
        for cmd in (
            ("XTRIM", stream, "MAXLEN", "0"),
            ("XDEL", stream, "0-1"),
            ("DEL", stream),
            ("XACK", stream, "g", "0-1"),
            ("XGROUP", "DESTROY", stream, "g"),
            ("XREADGROUP", "GROUP", "g", "c", "STREAMS", stream, ">"),
            ("HSET", meta, "closed", "1"),
            ("EVAL", "return redis.call('HSET', KEYS[1], 'closed', '1')", "1", meta),
            ("EVAL", "return redis.call('XADD', KEYS[1], '*', 'h', 'x')", "1", "other-stream"),
            ("XADD", "other-stream", "*", "h", "x"),
        ):
            with pytest.raises(redis.ResponseError, match="permission"):
                raw.execute_command(*cmd)
        raw.close()
        producer.disconnect()
    finally:
        consumer.delete()
        admin.close()
