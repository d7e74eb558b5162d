"""Payloads in object storage: ObjectStorage, FileStorageLoader and StorageDataset over s3:// against a
real SeaweedFS S3 server (tests/_s3_server.py), plus file:// and memory://."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest
import torch
import treetensor.torch as ttorch
from _helpers import kill_session
from _s3_server import fresh_s3_server, s3_bucket, s3_server  # noqa: F401  (fixtures)
from conftest import assert_same, traj
from torch.utils.data import DataLoader

from torch_storage_loader import (
    FileStorage,
    FileStorageLoader,
    ObjectStorage,
    StorageCorruptError,
    StorageDataset,
    StorageNotFoundError,
    StorageUnavailableError,
    StreamEndedError,
    configure_object_store,
    end_directory_stream,
    start_directory_stream,
)
from torch_storage_loader._stores import objects as _objects


def _tree(i: int, n: int) -> dict:
    return {
        "obs": np.full((n, 64), i, np.float32),
        "act": torch.full((n,), i, dtype=torch.int64),
        "tt": ttorch.Tensor({"a": torch.ones(3) * i}),
        "name": f"t{i}",
        "step": i,
    }


def test_roundtrip_through_loader_workers_small_and_chunked(s3_server, s3_bucket):
    """Samples from 1 KB to over two read chunks come back exact, loaded into the workers' slots."""
    sizes = [1, 100, 5_000, 2 * _objects.CHUNK // 256 + 7]  # the last spans three ranged reads
    with FileStorageLoader(f"s3://{s3_bucket}/run", worker_num=2, storage_options=s3_server.storage_options) as loader:
        samples = [_tree(i, n) for i, n in enumerate(sizes)]
        samples[1]["name"] = "x" * (100 << 10)  # a header over the first ranged read: a second one follows
        handles = [loader.save(x) for x in samples]
        assert all(type(h) is ObjectStorage and h.size > 0 and h.version for h in handles)
        got = [f.result(timeout=60) for f in [loader.load_async(h) for h in handles]]
        stats = loader.stats()
    for x, y in zip(samples, got, strict=False):
        assert_same(x, y)
    assert stats.slot_loads + stats.oversize == len(sizes) and stats.fallbacks == stats.errors == 0


def test_handles_carry_no_credentials_and_load_in_a_fresh_process(s3_server, s3_bucket):
    with FileStorageLoader(f"s3://{s3_bucket}/p", worker_num=1, storage_options=s3_server.storage_options) as loader:
        handle = loader.save(traj(3))
    blob = pickle.dumps(handle)
    assert s3_server.SECRET.encode() not in blob and s3_server.endpoint.encode() not in blob
    assert sorted(vars(handle)) == ["allow_pickle", "path", "size", "version"]
    # Another process with nothing configured reads with the client's defaults: the environment.
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": s3_server.KEY,
        "AWS_SECRET_ACCESS_KEY": s3_server.SECRET,
        "AWS_ENDPOINT_URL": s3_server.endpoint,
    }
    code = (
        "import pickle, sys; x = pickle.loads(sys.stdin.buffer.read()).load(); "
        "print(x['info']['id'], float(x['obs'].sum()))"
    )
    out = subprocess.run([sys.executable, "-c", code], input=blob, env=env, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout.split() == [b"3", str(float(traj(3)["obs"].sum())).encode()]


def _saved(server, bucket: str, folder: str, n: int) -> list[ObjectStorage]:
    """``n`` trajectories saved as objects ``s3://bucket/folder/000.tsl``..., with options configured here."""
    configure_object_store(f"s3://{bucket}", server.storage_options)
    handles = []
    for i in range(n):
        handles.append(ObjectStorage(f"s3://{bucket}/{folder}/{i:03d}.tsl"))
        handles[-1].save(traj(i))
    return handles


def test_dataloader_over_object_handles_with_workers(s3_server, s3_bucket):
    handles = _saved(s3_server, s3_bucket, "d", 12)
    ds = StorageDataset(handles, storage_options=s3_server.storage_options)
    ids = sorted(int(x["info"]["id"]) for x in DataLoader(ds, batch_size=None, num_workers=2))
    assert ids == list(range(12))
    batched = StorageDataset(handles, batch_size=4, storage_options=s3_server.storage_options)
    batches = list(DataLoader(batched, batch_size=None, num_workers=2))
    assert sorted(int(i) for b in batches for i in b["action"][:, 0]) == list(range(12))


def test_missing_truncated_foreign_and_replaced_objects_name_the_url(s3_server, s3_bucket):
    configure_object_store(f"s3://{s3_bucket}", s3_server.storage_options, retry_timeout=5)
    good = ObjectStorage(f"s3://{s3_bucket}/good.tsl")
    good.save(traj(1))
    fs = _objects.filesystem(good.url)
    raw = fs.cat_file(good.url)
    fs.pipe_file(f"s3://{s3_bucket}/cut.tsl", raw[: len(raw) // 2])
    fs.pipe_file(f"s3://{s3_bucket}/foreign.tsl", b"PK\x03\x04 not ours" * 100)

    cases = {
        "missing": (ObjectStorage(f"s3://{s3_bucket}/missing.tsl"), StorageNotFoundError, "no such object"),
        "truncated": (ObjectStorage(f"s3://{s3_bucket}/cut.tsl"), StorageCorruptError, "truncated"),
        "truncated, size from the handle": (
            ObjectStorage(f"s3://{s3_bucket}/cut.tsl", size=len(raw)),
            StorageCorruptError,
            "truncated",
        ),
        "foreign": (ObjectStorage(f"s3://{s3_bucket}/foreign.tsl"), StorageCorruptError, "not a torch_storage_loader"),
    }
    with FileStorageLoader(f"s3://{s3_bucket}/x", worker_num=1) as loader:
        for what, (handle, error, text) in cases.items():
            for load in (handle.load, lambda: loader.load_async(handle).result(timeout=60)):  # noqa: B023 -- called within this iteration
                with pytest.raises(error, match=text) as info:
                    load()
                assert handle.url in str(info.value), what
        # Replaced after its handle was made: the version tag no longer matches.
        fs.pipe_file(good.url, raw)  # same bytes, new upload: the ETag of a single PUT is its MD5
        ObjectStorage(good.url).save(traj(2))
        with pytest.raises(StorageCorruptError, match="replaced"):
            loader.load_async(good).result(timeout=60)
        assert ObjectStorage(good.url).load()["info"]["id"] == 2


def test_ttl_cleans_the_prefix_and_clean_command_takes_a_prefix(s3_server, s3_bucket):
    prefix = f"s3://{s3_bucket}/ttl"
    with FileStorageLoader(prefix, ttl=1, worker_num=1, storage_options=s3_server.storage_options) as loader:
        fs = _objects.filesystem(prefix)
        fs.pipe_file(f"{prefix}/notes.txt", b"not ours")
        kept = [loader.save(traj(i)) for i in range(3)]
        deadline = time.monotonic() + 15
        while loader.stats().expired < 3 and time.monotonic() < deadline:  # the cleaner thread's work
            time.sleep(0.1)
        assert loader.stats().expired == 3
    names = [e.url.rsplit("/", 1)[-1] for e in _objects.listing(prefix)]
    assert names == ["notes.txt"] and not any(_objects.exists(h.url) for h in kept)

    # Left by a producer that is gone: the command deletes by the store's last-modified time.
    for i in range(2):
        ObjectStorage(f"{prefix}/{_new_name()}").save(traj(i))
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": s3_server.KEY,
        "AWS_SECRET_ACCESS_KEY": s3_server.SECRET,
        "AWS_ENDPOINT_URL": s3_server.endpoint,
    }
    run = [sys.executable, "-m", "torch_storage_loader", "clean", prefix, "--older-than", "0"]
    dry = subprocess.run(run + ["--dry-run"], env=env, capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0 and "would remove 2 files" in dry.stdout, dry.stdout + dry.stderr
    done = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "removed 2 files" in done.stdout, done.stdout + done.stderr
    assert [e.url.rsplit("/", 1)[-1] for e in _objects.listing(prefix)] == ["notes.txt"]


def _new_name() -> str:
    from torch_storage_loader.file_loader import new_file_name

    return new_file_name()


def test_prefix_stream_stops_early_then_drains_exactly_once(s3_server, s3_bucket):
    """A DataLoader stopped early gives its claims back; claims of a dead trainer come back too."""
    prefix = f"s3://{s3_bucket}/stream"
    with FileStorageLoader(prefix, ttl=None, worker_num=1, storage_options=s3_server.storage_options) as loader:
        handles = [loader.save(traj(i)) for i in range(40)]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = handles[-1].url + ".claim"
    _objects.put(
        orphan,
        [
            json.dumps(
                {"host": os.uname().nodename, "family": str(dead.pid), "pid": dead.pid, "nonce": "0123456789abcdef"}
            ).encode()
        ],
    )  # as a trainer writes it
    end_directory_stream(prefix)
    seen = []
    for round_ in range(3):  # noqa: B007 -- three identical rounds
        ds = StorageDataset(prefix, storage_options=s3_server.storage_options)
        for k, x in enumerate(DataLoader(ds, batch_size=None, num_workers=2)):
            seen.append(int(x["info"]["id"]))
            if k == 5:
                break
    ds = StorageDataset(prefix, storage_options=s3_server.storage_options)
    seen += [int(x["info"]["id"]) for x in DataLoader(ds, batch_size=None, num_workers=2)]
    assert sorted(seen) == list(range(40))
    assert [e.url.rsplit("/", 1)[-1] for e in _objects.listing(prefix)] == ["_END_OF_STREAM"]


_TRAINER_THEN_WORKERS = """
import json, sys, time
import numpy as np
from torch.utils.data import DataLoader
from torch_storage_loader import ObjectStorage, StorageDataset, configure_object_store, end_directory_stream
from torch_storage_loader.file_loader import new_file_name

import s3fs
bucket, options = sys.argv[1], json.loads(sys.argv[2])
s3fs.S3FileSystem(**options, skip_instance_cache=True).mkdir(bucket)  # its own bucket first (the old code hung only then)
prefix = f"s3://{bucket}/stream"
configure_object_store(prefix, options)
def save(i):
    ObjectStorage(f"{prefix}/{new_file_name()}").save({"id": np.array(i), "obs": np.zeros((64, 4096), np.float32)})
save(0)  # the trainer's connection, back in its pool when the workers fork
it = iter(DataLoader(StorageDataset(prefix, storage_options=options), batch_size=None, num_workers=2))
got = [int(next(it)["id"])]
for i in (1, 2, 3):
    save(i)
    got.append(int(next(it)["id"]))
end_directory_stream(prefix)
got += [int(x["id"]) for x in it]
print(got)
"""


def test_the_trainer_reaches_the_store_after_its_workers_forked(s3_server, s3_bucket):
    """A trainer that used the store, then forked DataLoader workers that use it too, as a script:
    it and its workers go on reaching the store. The workers used to close the connections they
    inherited through a copy of the trainer's event loop, which shares its epoll instance: the
    trainer's pooled socket was no longer watched, and a request on it waited for ever (or 60 s)."""
    run = [sys.executable, "-c", _TRAINER_THEN_WORKERS, f"{s3_bucket}-own", json.dumps(s3_server.storage_options)]
    out = subprocess.run(run, capture_output=True, timeout=90, text=True)  # seconds; it hung before
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-2] == "[0, 1, 2, 3]"


def test_a_drained_prefix_stream_is_refused_until_started_anew(s3_server, s3_bucket):
    """Run again under the same prefix, a stream whose end marker an earlier run left is refused at
    once (the old code: a dataset that yields 0 samples in silence); ``start_directory_stream`` clears it."""
    prefix, options = f"s3://{s3_bucket}/again", s3_server.storage_options

    def stream(tag: int) -> None:
        with FileStorageLoader(prefix, ttl=None, worker_num=1, storage_options=options) as loader:
            loader.save(traj(tag))
        end_directory_stream(prefix)

    def ids() -> list[int]:
        ds = StorageDataset(prefix, storage_options=options)
        return [int(x["info"]["id"]) for x in DataLoader(ds, batch_size=None, num_workers=0)]

    stream(0)
    assert ids() == [0]
    with pytest.raises(StreamEndedError, match="start_directory_stream") as info:
        ids()
    assert info.value.path == f"{prefix}/_END_OF_STREAM" and info.value.path in str(info.value)
    assert start_directory_stream(prefix) is True
    stream(1)
    assert ids() == [1]


def test_prefix_claims_are_exclusive_between_consumers(s3_server, s3_bucket):
    prefix = f"s3://{s3_bucket}/race"
    configure_object_store(prefix, s3_server.storage_options)
    names = [f"{prefix}/{_new_name()}" for _ in range(30)]
    for i, url in enumerate(names):
        ObjectStorage(url).save(traj(i))
    wins = [0] * len(names)

    def claim_all(k):
        for i, url in enumerate(names):
            if _objects.create_if_absent(
                url + ".claim", f'{{"consumer": {k}}}'.encode()
            ):  # bodies differ, as claims do
                wins[i] += 1

    threads = [threading.Thread(target=claim_all, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wins == [1] * len(names)


def test_a_server_that_is_gone_gives_a_clear_error(fresh_s3_server):
    server = fresh_s3_server()
    bucket = server.make_bucket()
    configure_object_store(f"s3://{bucket}", server.storage_options, retry_timeout=2)
    handle = ObjectStorage(f"s3://{bucket}/x.tsl")
    handle.save(traj(0))
    server.stop()
    start = time.monotonic()
    with pytest.raises(StorageUnavailableError) as info:
        handle.load()
    assert time.monotonic() - start < 30
    assert handle.url in str(info.value) and server.endpoint in str(info.value) and "running" in str(info.value)
    with pytest.raises(StorageUnavailableError, match="retry_timeout"):
        ObjectStorage(f"s3://{bucket}/y.tsl").save(traj(1))


def test_loads_ride_out_a_server_restart(fresh_s3_server):
    server = fresh_s3_server()
    bucket = server.make_bucket()
    with FileStorageLoader(
        f"s3://{bucket}/r", worker_num=2, storage_options=server.storage_options, retry_timeout=90
    ) as loader:
        handles = [loader.save(traj(i)) for i in range(10)]
        assert loader.load_async(handles[0]).result(timeout=60)["info"]["id"] == 0  # workers up, clients made
        server.stop()
        futures = [loader.load_async(h) for h in handles]
        time.sleep(1.0)  # the loads are failing and being retried meanwhile
        server.start()
        assert [f.result(timeout=120)["info"]["id"] for f in futures] == list(range(10))


def test_file_and_memory_urls(tmp_path):
    with FileStorageLoader(f"file://{tmp_path}/store", worker_num=1) as loader:
        h = loader.save(traj(5))
        assert type(h) is FileStorage and h.path.startswith(str(tmp_path))
        assert loader.load_async(h).result(timeout=60)["info"]["id"] == 5
    url = f"memory://tsl-{uuid.uuid4().hex[:8]}/a.tsl"
    m = ObjectStorage(url)
    m.save(traj(6))
    assert m.size == os.path.getsize(h.path) and m.load()["info"]["id"] == 6
    ids = [int(x["info"]["id"]) for x in DataLoader(StorageDataset([m, m]), batch_size=None, num_workers=0)]
    assert ids == [6, 6]
    _objects.remove(url)
    with pytest.raises(StorageNotFoundError, match=url):
        m.load()
    with pytest.raises(ValueError, match="not an object-store URL"):
        ObjectStorage(str(tmp_path / "x.tsl"))
    with pytest.raises(ValueError, match="storage_options"):
        FileStorageLoader(tmp_path, storage_options={"key": "k"})


_USES_OBSTORE_ITSELF = """
import json, sys
import obstore
from obstore.store import S3Store
from torch.utils.data import DataLoader
from torch_storage_loader import ObjectStorage, StorageDataset

cfg = json.loads(sys.argv[1])
opts = cfg["options"]
store = S3Store(cfg["bucket"], endpoint=opts["endpoint_url"], access_key_id=opts["key"],
                secret_access_key=opts["secret"], region="us-east-1", client_options={"allow_http": True})
obstore.get(store, cfg["urls"][0].split("/", 3)[3]).bytes()  # the trainer's own use starts obstore's runtime
ds = StorageDataset([ObjectStorage(u) for u in cfg["urls"]], storage_options=opts)
loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
print(sorted(int(x["info"]["id"]) for x in loader))
"""


def test_workers_forked_from_a_trainer_that_uses_obstore_still_load(s3_server, s3_bucket):
    """obstore's runtime hangs in a forked child: workers forked from a process that imported it read with s3fs."""
    urls = [h.url for h in _saved(s3_server, s3_bucket, "f", 6)]
    cfg = json.dumps({"options": s3_server.storage_options, "bucket": s3_bucket, "urls": urls})
    proc = subprocess.Popen(
        [sys.executable, "-c", _USES_OBSTORE_ITSELF, cfg],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)  # its hung workers too
        proc.communicate()
        pytest.fail("DataLoader workers forked from a process using obstore hung")
    assert proc.returncode == 0, err.decode()[-3000:]
    assert out.split(b"\n")[-2] == b"[0, 1, 2, 3, 4, 5]"


def test_claims_survive_a_lost_reply_and_refusals_are_not_retried():
    """A conditional PUT retried after its reply was lost finds its own claim; a taken name fails fast."""
    url = f"memory://tsl-{uuid.uuid4().hex[:8]}/a.tsl.claim"
    configure_object_store(url, {}, retry_timeout=30)
    assert _objects.create_if_absent(url, b'{"nonce": "1"}')
    start = time.monotonic()
    assert _objects.create_if_absent(url, b'{"nonce": "1"}')  # ours: the first reply was lost
    assert not _objects.create_if_absent(url, b'{"nonce": "2"}')  # another consumer's
    assert time.monotonic() - start < 5  # refused at once, not retried for retry_timeout
    _objects.remove(url)


def test_chunked_reads_of_a_missing_object_name_it(tmp_path):
    url = f"memory://tsl-{uuid.uuid4().hex[:8]}/gone.tsl"
    view = memoryview(bytearray(2 * _objects.CHUNK + 5))
    with pytest.raises(StorageNotFoundError, match=url):
        _objects.read_into(url, view, 0, None, memoryview(b""))


def test_configuration_merges_stays_secret_and_bounds_network_handles(s3_server, s3_bucket):
    from torch_storage_loader import UntrustedStorageError
    from torch_storage_loader._redis import records as _records
    from torch_storage_loader._untrusted import trust as _trust

    configure_object_store(f"s3://{s3_bucket}", s3_server.storage_options)
    with FileStorageLoader(f"s3://{s3_bucket}/m", worker_num=1, retry_timeout=60) as loader:
        h = loader.save(traj(4))  # the options set before still apply: retry_timeout alone changed
        assert loader.load_async(h).result(timeout=60)["info"]["id"] == 4
    assert _objects.config_for(h.url) == _objects.Config(s3_server.storage_options, 60)
    assert s3_server.SECRET not in repr(_objects.snapshot())
    roots = _trust.roots([f"s3://{s3_bucket}"])
    assert _records.decode(_records.encode(h), trusted_roots=roots) == h
    for url in ("http://127.0.0.1:1/x.tsl", f"s3://other-{s3_bucket}/m/x.tsl"):  # network handles stay in their roots
        with pytest.raises(UntrustedStorageError, match="trusted_roots"):
            _records.decode(_records.encode(ObjectStorage(url)), trusted_roots=roots)
    with pytest.raises(StorageNotFoundError, match="does not exist"):
        missing = f"s3://nobucket-{uuid.uuid4().hex[:8]}/p"
        next(iter(DataLoader(StorageDataset(missing, storage_options=s3_server.storage_options), batch_size=None)))


_READS_THROUGH_OBSTORE = """
import json, sys
from torch_storage_loader import ObjectStorage
from torch_storage_loader._stores import objects as _objects

cfg = json.loads(sys.argv[1])
_objects.configure_object_store(cfg["url"], cfg["options"])
_objects.use_obstore_here()  # as a loader or DataLoader worker does
store = _objects._obstore(cfg["url"])
print(type(store).__name__, ObjectStorage(cfg["url"], size=cfg["size"], version=cfg["version"]).load()["info"]["id"])
"""


def test_workers_read_s3_through_obstore_with_the_loaders_options(s3_server, s3_bucket):
    """The s3fs options translate to an obstore store (else workers would fall back to s3fs quietly)."""
    (h,) = _saved(s3_server, s3_bucket, "o", 1)
    cfg = json.dumps({"url": h.url, "options": s3_server.storage_options, "size": h.size, "version": h.version})
    out = subprocess.run(
        [sys.executable, "-c", _READS_THROUGH_OBSTORE, cfg], capture_output=True, text=True, timeout=120
    )  # a process of its own: obstore must never start in this one
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["S3Store", "0"]
