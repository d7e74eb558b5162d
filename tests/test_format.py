"""The on-disk format: exact bytes, defensive header parsing, atomic writes, and a fuzzer."""

from __future__ import annotations

import os
import pickle
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_storage_loader import FileStorage, PickleNotAllowedError, StorageCorruptError, StorageNotFoundError
from torch_storage_loader._format import file as _format


def test_exact_bytes(tmp_path):
    path = tmp_path / "a.tsl"
    FileStorage(path).save({"a": np.array([1, 2], dtype="<i2"), "b": 1.5})
    header = b'{"arrays":[["numpy","<i2",[2],0,4]],"tree":["d",["a","b"],[["a",0],["f","0x1.8000000000000p+0"]]]}'
    data_offset = -(-(32 + len(header)) // 64) * 64
    expected = (
        b"TSLSTOR\x00"
        + struct.pack("<IIQQ", 1, len(header), data_offset, 64)
        + header
        + bytes(data_offset - 32 - len(header))
        + b"\x01\x00\x02\x00"
        + bytes(60)
    )
    assert path.read_bytes() == expected


def test_arrays_are_aligned_and_little_endian(tmp_path):
    path = tmp_path / "a.tsl"
    big = np.arange(5, dtype=">u4")
    FileStorage(path).save([np.zeros(3, np.uint8), big, torch.arange(3, dtype=torch.int16)])
    header = FileStorage(path).read_header()
    assert header.data_offset % 64 == 0
    assert [e.offset % 64 for e in header.arrays] == [0, 0, 0]
    raw = path.read_bytes()
    e = header.arrays[1]
    assert e.dtype == "<u4"
    start = header.data_offset + e.offset
    assert raw[start : start + e.nbytes] == np.arange(5, dtype="<u4").tobytes()
    back = FileStorage(path).load()
    assert back[1].dtype == np.dtype("<u4") and back[1].tolist() == [0, 1, 2, 3, 4]


def test_deterministic(tmp_path):
    obj = {"z": np.arange(3), "a": [torch.ones(2), "s", None]}
    FileStorage(tmp_path / "1").save(obj)
    FileStorage(tmp_path / "2").save(obj)
    assert (tmp_path / "1").read_bytes() == (tmp_path / "2").read_bytes()


def _saved(tmp_path) -> bytes:
    path = tmp_path / "good.tsl"
    FileStorage(path).save({"obs": np.arange(100, dtype=np.float32), "n": 3})
    return path.read_bytes()


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda b: b[:-1], "truncated"),
        (lambda b: b[:20], "truncated"),
        (lambda b: b[:5], "truncated"),
        (lambda b: b + b"x", "trailing"),
        (lambda b: b"PK\x03\x04" + b[4:], "not a torch_storage_loader file"),
        (lambda b: b"", "truncated"),
        (lambda b: b[:8] + struct.pack("<I", 9) + b[12:], "version 9"),
        (lambda b: b[:40] + b"\xff" + b[41:], "header is damaged"),
    ],
)
def test_bad_files_name_the_path(tmp_path, mutate, words):
    path = tmp_path / "bad.tsl"
    path.write_bytes(mutate(_saved(tmp_path)))
    with pytest.raises(StorageCorruptError) as info:
        FileStorage(path).load()
    assert str(path) in str(info.value) and words in str(info.value)
    assert info.value.path == str(path)


def test_pickle_of_a_header_cannot_sneak_in(tmp_path):
    raw = _saved(tmp_path)
    bad = raw.replace(b'"numpy","<f4"', b'"numpy","|O8"')
    (tmp_path / "obj.tsl").write_bytes(bad)
    with pytest.raises(StorageCorruptError):
        FileStorage(tmp_path / "obj.tsl").load()


def test_missing_file(tmp_path):
    with pytest.raises(StorageNotFoundError, match="no such storage file"):
        FileStorage(tmp_path / "nope.tsl").load()


def test_pickle_leaf_needs_opt_in_to_load(tmp_path):
    path = tmp_path / "p.tsl"
    FileStorage(path, allow_pickle=True).save({"f": {1, 2}})
    with pytest.raises(PickleNotAllowedError, match="allow_pickle=True"):
        FileStorage(path).load()
    assert FileStorage(path, allow_pickle=True).load() == {"f": {1, 2}}


def test_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "a.tsl"
    FileStorage(path).save({"old": np.zeros(4)})

    def broken_writev(fd, bufs):
        os.write(fd, b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_format.os, "writev", broken_writev)
    with pytest.raises(OSError, match="No space"):
        FileStorage(path).save({"new": np.ones(1000)})
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind
    assert list(FileStorage(path).load()) == ["old"]  # the old content is intact


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_fuzz_damaged_files_raise_only_corrupt_errors(tmp_path_factory, data):
    tmp = tmp_path_factory.mktemp("fuzz")
    raw = bytearray(_saved(tmp))
    for _ in range(data.draw(st.integers(1, 4))):
        action = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        pos = data.draw(st.integers(0, max(len(raw) - 1, 0)))
        if action == "flip" and raw:
            raw[pos] ^= data.draw(st.integers(1, 255))
        elif action == "cut":
            del raw[pos:]
        else:
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
    path = tmp / "f.tsl"
    path.write_bytes(bytes(raw))
    try:
        FileStorage(path).load()
    except StorageCorruptError as exc:
        assert str(path) in str(exc)


def test_samples_that_differ_only_in_inline_values_share_one_plan(tmp_path):
    """An episode id or a float reward kept inline makes every header unique; the receiver still
    decodes and checks one plan for all of them (``_format.tree.split``), and each sample, single
    or stacked, gets its own values back (ints past int64 stay Python ints in a batch)."""
    from torch.utils.data import DataLoader

    from torch_storage_loader import StorageDataset
    from torch_storage_loader._format import tree as _tree

    handles = []
    for i in range(24):
        handles.append(FileStorage(tmp_path / f"{i}.tsl"))
        big = 10**20 if i == 23 else i
        handles[-1].save({"x": np.full(3, i, np.float32), "id": i, "r": i / 4, "ok": i % 2 == 0, "big": big})
    _tree._plans.clear()
    singles = list(DataLoader(StorageDataset(handles[:8]), batch_size=None, num_workers=0))
    assert len(_tree._plans) == 1
    assert [(s["id"], s["r"], s["ok"]) for s in singles] == [(i, i / 4, i % 2 == 0) for i in range(8)]
    assert all(s["x"].tolist() == [float(s["id"])] * 3 for s in singles)
    batches = list(DataLoader(StorageDataset(handles, batch_size=8), batch_size=None, num_workers=1))
    assert [b["id"].tolist() for b in batches] == [list(range(k, k + 8)) for k in (0, 8, 16)]
    assert batches[1]["r"].tolist() == [i / 4 for i in range(8, 16)]
    assert batches[0]["ok"].dtype == torch.bool and batches[0]["big"].tolist() == list(range(8))
    assert batches[2]["big"] == [*range(16, 23), 10**20]  # past int64: a list, never an error


def test_a_tree_leaf_past_the_header_arrays_is_a_corrupt_error():
    """Found by test_fuzz: a treetensor tree whose leaf names an array the header does not list
    raised IndexError from the tree check instead of our error."""
    doc = b'{"arrays":[],"tree":["tt",["b","a"],[["tt",["c"],[["a",0]]],["a",1]]]}'
    raw = b"TSLSTOR\x00\x01\x00\x00\x00F\x00\x00\x00\x80" + bytes(15) + doc + bytes(26)
    with pytest.raises(StorageCorruptError, match="more arrays than the 0 its header lists"):
        _format.parse_header(raw, "fuzz.tsl", len(raw))


def _with_doc(raw: bytes, doc: bytes) -> bytes:
    """``raw`` (a saved file) with its header document replaced by ``doc`` (the same data section)."""
    data_offset, data_size = _format.FIXED.unpack_from(raw)[3:]
    data = raw[data_offset:]
    offset = _format.align(_format.FIXED.size + len(doc))
    fixed = _format.FIXED.pack(_format.MAGIC, _format.VERSION, len(doc), offset, data_size)
    return (fixed + doc).ljust(offset, b"\0") + data


def _doc(raw: bytes) -> bytes:
    _, _, header_len, _, _ = _format.FIXED.unpack_from(raw)
    return raw[_format.FIXED.size : _format.FIXED.size + header_len]


def _parse(raw: bytes, path: str = "x.tsl"):
    return _format.parse_header(raw, path, len(raw))


def test_plan_keys_of_headers_that_share_a_table_are_each_their_own(tmp_path, monkeypatch):
    """Headers parsed from files that share an array table share its arrays object, and their plan
    keys are looked up by it: each key is still exactly the one made from that header alone, so
    samples whose names or structure differ over the same table never share a plan."""
    from torch_storage_loader._format import tree as _tree

    samples = [
        {"obs": np.full((4, 2), 1, np.float32), "id": 1},
        {"obs": np.full((4, 2), 2, np.float32), "id": 2},
        {"obz": np.full((4, 2), 3, np.float32), "id": 3},
        {"obs": np.full((4, 2), 4, np.float32), "id": True},
        {"obs": np.full((4, 2), 5, np.float32), "id": [5]},
        {"obs": np.full((4, 2), 6, np.float32), "id": 6},
    ]
    _format._tables.clear()
    _format._tables_seen.clear()
    _format._parsed.clear()
    for i in range(2):  # the table is kept the second time it is parsed
        FileStorage(tmp_path / f"t{i}.tsl").save({"obs": np.zeros((4, 2), np.float32), "id": 100 + i})
        _parse((tmp_path / f"t{i}.tsl").read_bytes())
    headers = []
    for i, x in enumerate(samples):
        FileStorage(tmp_path / f"{i}.tsl").save(x)
        headers.append(_parse((tmp_path / f"{i}.tsl").read_bytes()))
    assert all(h.arrays is headers[0].arrays for h in headers)  # the kept table's object
    opts = _format.ReadOptions(as_tensors=True)

    def alone(h):
        skeleton, consts = _tree.split(h.spec)
        bare = _format.Header(skeleton, h.arrays, h.data_offset, h.data_size)
        return pickle.dumps((bare, opts), protocol=pickle.HIGHEST_PROTOCOL), consts

    keys = [_tree._key(h, opts) for h in headers]
    assert keys == [alone(h) for h in headers]
    assert keys[0][0] == keys[1][0] == keys[5][0]  # the same skeleton: one plan, the ids as consts
    assert len({k for k, _ in keys}) == 3  # obs, obz, and an id that is a list
    for h, (key, consts) in zip(headers, keys, strict=True):
        u8 = np.zeros(h.data_size, np.uint8)
        assert _tree.plan_for(key).bind(consts).build(u8, "x")["id"] == _tree.build(h, u8.copy(), opts)["id"]
    # What the cache keeps is bounded in bytes too: the keys come out the same, and it holds no more.
    monkeypatch.setattr(_tree, "_MAX_SHAPE_BYTES", len(keys[0][0]) + 100)
    _tree._keys_by_shape.clear()
    monkeypatch.setattr(_tree, "_shape_bytes", 0)
    assert [_tree._key(h, opts) for h in headers] == keys
    assert 0 < _tree._shape_bytes <= _tree._MAX_SHAPE_BYTES and len(_tree._keys_by_shape) == 1
    # A header whose table is not a kept one (a file loaded once, a sample built in memory) is not kept.
    _tree._keys_by_shape.clear()
    own = _format.Header(headers[0].spec, (*headers[0].arrays,), headers[0].data_offset, headers[0].data_size)
    assert _tree._key(own, opts) == keys[0] and not _tree._keys_by_shape


def _refusal(raw: bytes, good: list[bytes]) -> str:
    """What parsing ``raw`` raises, after parsing ``good`` (files of one array table: kept the second
    time), or with no table kept (``good`` empty)."""
    _format._tables.clear()
    _format._tables_seen.clear()
    _format._parsed.clear()
    for r in good:
        _parse(r)
    assert bool(_format._tables) == bool(good)
    with pytest.raises(StorageCorruptError) as info:
        _parse(raw)
    return str(info.value)


def test_headers_that_share_an_array_table_parse_only_their_trees(tmp_path):
    """Samples of one structure share their array table while inline values (an id) make each header
    unique: from the third on (a table is kept the second time), only the tree is parsed. Each still
    gets its own tree; a tree that is damaged, over the depth bound, or followed by more keys or
    bytes is refused exactly as without the table kept (the whole header is then parsed, and says
    why)."""
    for i in range(3):
        FileStorage(tmp_path / f"{i}.tsl").save({"obs": np.full((4, 2), i, np.float32), "id": i})
    raws_good = [(tmp_path / f"{i}.tsl").read_bytes() for i in range(3)]
    _format._tables.clear()
    _format._tables_seen.clear()
    _format._parsed.clear()
    trees = [_parse(r).spec for r in raws_good]  # the table: parsed, parsed and kept, used
    assert [t[2][1] for t in trees] == [["i", 0], ["i", 1], ["i", 2]]  # (tree: ["d", keys, [leaves]])
    assert len(_format._tables) == 1 and len(_format._parsed) == 3

    good = _doc(raws_good[0])
    table, tree = good.split(b',"tree":')
    deep = _format._bounded.HEADER_MAX_DEPTH
    cases = {
        "damaged tree": table + b',"tree":["d",["obs","id"],[["a",0],["i",]]]}',
        "leaf past the table": table + b',"tree":["d",["obs","id"],[["a",0],["a",1]]]}',
        "a key after the tree": table + b',"tree":' + tree[:-1] + b',"arrays":[]}',
        "over the depth bound": table + b',"tree":' + b"[" * deep + b"]" * deep + b"}",
        "a value after the tree": table + b',"tree":' + tree[:-1] + b" 1}",
        "a brace too many": table + b',"tree":' + tree + b"}",
    }
    for name, doc in cases.items():
        raw = _with_doc(raws_good[0], doc)
        assert _refusal(raw, raws_good[1:]) == _refusal(raw, []), name
    # (The values bound cannot be passed by a header short enough for the tables: 256 KiB.)
