"""Round trips through FileStorage: containers, leaf types, dtypes and shapes come back as they went."""

from __future__ import annotations

import collections
import pickle

import numpy as np
import pytest
import torch
import treetensor.numpy as tnp
import treetensor.torch as ttorch
from conftest import assert_same
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from torch_storage_loader import FileStorage, StorageNotFoundError, UnsupportedLeafError

NUMPY_DTYPES = [
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "<M8[ns]",
    "<m8[s]",
    "<U3",
    "S4",
    ">i4",
    ">f8",
]
TORCH_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]

shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)
numpy_leaves = st.sampled_from(NUMPY_DTYPES).flatmap(lambda dt: hnp.arrays(np.dtype(dt), shapes))


@st.composite
def torch_leaves(draw):
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    shape = draw(shapes)
    raw = draw(hnp.arrays(np.uint8, (int(np.prod(shape)) * dtype.itemsize,)))
    if dtype == torch.bool:
        raw %= 2  # bools are bytes 0 and 1 (others are saved as their truth values: test_trust_boundary)
    t = torch.from_numpy(raw.copy()).view(dtype).reshape(shape) if raw.size else torch.empty(shape, dtype=dtype)
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, 1)  # non-contiguous
    return t


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.complex_numbers(allow_nan=False),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.builds(np.float32, st.floats(width=32)),
    st.builds(np.int64, st.integers(-(2**63), 2**63 - 1)),
)
leaves = st.one_of(numpy_leaves, torch_leaves(), scalars)
trees = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=5), children, max_size=4),
        st.dictionaries(st.integers(-5, 5), children, max_size=3),
    ),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(tree=trees)
def test_roundtrip_random_trees(tmp_path_factory, tree):
    path = tmp_path_factory.mktemp("rt") / "s.tsl"
    FileStorage(path).save(tree)
    assert_same(tree, FileStorage(path).load())


def test_roundtrip_treetensor_and_top_level_leaves(tmp_path):
    cases = [
        ttorch.Tensor({"a": torch.arange(3), "b": {"c": torch.zeros(2, dtype=torch.bfloat16)}}),
        tnp.ndarray({"x": np.arange(4.0), "y": {"z": np.ones((2, 2), bool)}}),
        {"tree": ttorch.Tensor({"obs": torch.ones(2, 3)}), "list": [tnp.ndarray({"a": np.zeros(1)})]},
        np.arange(6).reshape(2, 3)[:, ::2],
        torch.tensor(3.5),
        [1, "two", None],
        collections.OrderedDict([("b", 1), ("a", np.zeros(2))]),
        {},
        [],
        np.zeros((0, 3), np.float32),
    ]
    for i, obj in enumerate(cases):
        s = FileStorage(tmp_path / f"{i}.tsl")
        s.save(obj)
        assert_same(obj, s.load())


def test_numpy_stays_numpy_and_torch_stays_torch(tmp_path):
    s = FileStorage(tmp_path / "a.tsl")
    s.save({"n": np.ones(3, np.float32), "t": torch.ones(3)})
    out = s.load()
    assert type(out["n"]) is np.ndarray and type(out["t"]) is torch.Tensor
    out["n"][0] = 7  # loaded arrays are writable, private copies
    out["t"][0] = 7


@pytest.mark.parametrize(
    "obj, where",
    [
        ({"a": {"b": [1, lambda x: x]}}, "['a']['b'][1]"),
        ({"obs": np.array([object()], dtype=object)}, "['obs']"),
        ([{"k": {1, 2}}], "[0]['k']"),
        ({(1, 2): 3}, "<root>"),
        ({"s": torch.zeros(3).to_sparse()}, "['s']"),
    ],
)
def test_unsupported_leaf_names_key_path(tmp_path, obj, where):
    with pytest.raises(UnsupportedLeafError) as info:
        FileStorage(tmp_path / "a.tsl").save(obj)
    assert where in str(info.value) and info.value.key_path == where
    assert isinstance(info.value, TypeError)
    assert not list(tmp_path.iterdir())


def test_allow_pickle_opt_in(tmp_path):
    s = FileStorage(tmp_path / "a.tsl", allow_pickle=True)
    s.save({"set": {1, 2}, "arr": np.arange(3)})
    out = s.load()
    assert out["set"] == {1, 2} and out["arr"].tolist() == [0, 1, 2]


def test_handle_is_small_and_picklable(tmp_path):
    s = FileStorage(tmp_path / "a.tsl")
    blob = pickle.dumps(s)
    assert len(blob) < 1024
    assert pickle.loads(blob) == s and pickle.loads(blob).path == s.path


def test_errors_pickle_with_attributes():
    exc = UnsupportedLeafError("bad leaf", key_path="['a']")
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is UnsupportedLeafError and str(back) == "bad leaf" and back.key_path == "['a']"


def test_a_handle_from_another_machine_says_so_not_ttl(tmp_path):
    """A path whose directory does not exist here names a file on the machine that saved it: the error
    points at a shared filesystem or object storage (the old message blamed an expired ttl)."""
    elsewhere = tmp_path / "collector-7" / "run" / "0001.tsl"
    with pytest.raises(StorageNotFoundError) as info:
        FileStorage(elsewhere).load()
    message = str(info.value)
    assert info.value.path == str(elsewhere) and str(elsewhere.parent) in message
    assert "does not exist on this machine" in message and "shared filesystem" in message
    assert "s3://" in message and "RedisStorageQueue" in message and "ttl" not in message


def test_a_file_gone_from_its_directory_still_points_at_ttl(tmp_path):
    with pytest.raises(StorageNotFoundError, match="raise ttl") as info:
        FileStorage(tmp_path / "0001.tsl").load()
    assert "another machine" not in str(info.value) and "this machine" not in str(info.value)
