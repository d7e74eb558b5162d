"""Flatten a sample into a JSON-safe tree spec plus a list of array leaves, and back.

The spec must be stored in a file that is read without unpickling, so it is plain JSON (lists,
strings, numbers) rather than a pytree library's opaque spec object (its grammar: ``spec``).

Size: about 670 lines (500 of code), because encoding and building are one mapping read in both
directions (each container and leaf kind has its writer and its builder side by side; the tags
themselves are ``spec.TAGS``): split into an encoder and a builder, each kind's two halves would sit
in two files that must change together. Building on a device (``Plan.build_on``) is one more
reading of the same leaves.
"""

from __future__ import annotations

import collections
import functools
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._untrusted.bounded import INLINE_INT_BOUND, MAX_TREE_DEPTH
from ..errors import PickleNotAllowedError, StorageCorruptError, StorageError, UnsupportedLeafError
from .file import DEFAULT_READ, TORCH_ITEMSIZE, Header, ReadOptions, is_kept_table
from .spec import ARRAY, MAPPINGS, SCALARS, SEQUENCES, TAGS, TREES, VALUES, spec_key

_LITTLE = np.little_endian

__all__ = [
    "Leaf",
    "Plan",
    "build",
    "encode",
    "format_path",
    "map_tensors",
    "plan_for",
    "plan_key",
    "split",
    "to_tensors",
]

# numpy dtype kinds stored as raw bytes: bool, ints, floats, complex, timedelta, datetime, str, bytes.
_NUMPY_KINDS = frozenset("biufcmMUS")
# Dense torch dtypes with whole-byte elements that this torch has (older releases lack some float8s).
_TORCH_DTYPES = {name: getattr(torch, name) for name in TORCH_ITEMSIZE if hasattr(torch, name)}


@dataclass(frozen=True)
class Leaf:
    """One array-like leaf: what to write, and what it becomes when read back."""

    kind: str  # numpy | numpy_scalar | torch | bytes | pickle
    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray  # 1-D uint8, C-contiguous, little-endian element bytes

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


def format_path(path: tuple) -> str:
    """``('obs', 0)`` -> ``"['obs'][0]"``; the root is ``"<root>"``."""
    return "".join(f"[{k!r}]" for k in path) or "<root>"


@functools.cache
def _treetensor_types() -> dict[str, type]:
    """The treetensor tree type of each array kind (``spec.TREES``), imported on first use."""
    # treetensor warns at import about numpy/torch internals it uses; that is not the user's to fix.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        import treetensor.numpy as tnp
        import treetensor.torch as ttorch

    return {"torch": ttorch.Tensor, "numpy": tnp.ndarray}


def _numpy_leaf(arr: np.ndarray, kind: str, path: tuple) -> Leaf:
    if arr.dtype.kind not in _NUMPY_KINDS or arr.dtype.fields is not None:
        raise UnsupportedLeafError(
            f"numpy array at {format_path(path)} has dtype {arr.dtype!r}, which cannot be stored "
            "as raw bytes; convert it to a numeric dtype, or pass allow_pickle=True",
            key_path=format_path(path),
        )
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and not _LITTLE):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    data = _bool_bytes(np.ascontiguousarray(arr).reshape(-1).view(np.uint8), arr.dtype.kind == "b")
    return Leaf(kind, arr.dtype.str, tuple(arr.shape), data)


def _bool_bytes(data: np.ndarray, is_bool: bool) -> np.ndarray:
    """A bool leaf's bytes as 0 or 1 (what readers accept): one made from other bytes (a view of
    uint8 data as bool, say) is stored as the truth values torch and numpy mostly give it."""
    if is_bool and data.size and data.max() > 1:
        return (data != 0).view(np.uint8)
    return data


def _torch_leaf(t: torch.Tensor, path: tuple) -> Leaf:
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        raise UnsupportedLeafError(
            f"tensor at {format_path(path)} has layout {t.layout} on {t.device}; only dense tensors "
            "are stored: call .to_dense() first, or pass allow_pickle=True",
            key_path=format_path(path),
        )
    name = str(t.dtype).removeprefix("torch.")
    if name not in _TORCH_DTYPES:
        raise UnsupportedLeafError(
            f"tensor at {format_path(path)} has dtype {t.dtype}, which cannot be stored as raw bytes",
            key_path=format_path(path),
        )
    t = t.detach()
    if t.device.type != "cpu" or t.is_conj() or t.is_neg() or not t.is_contiguous():
        t = t.resolve_conj().resolve_neg().to("cpu").contiguous()
    flat = t.reshape(-1)
    data = flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8)
    return Leaf("torch", name, tuple(t.shape), _bool_bytes(data, t.dtype == torch.bool))


def _keys(mapping, path: tuple) -> list:
    keys = []
    for k in mapping:
        if type(k) is str:
            keys.append(k)
        elif type(k) is int and -INLINE_INT_BOUND < k < INLINE_INT_BOUND:
            keys.append(["int", k])
        else:
            raise UnsupportedLeafError(
                f"dict at {format_path(path)} has key {k!r} of type {type(k).__name__}; "
                "keys must be str or int (or pass allow_pickle=True)",
                key_path=format_path(path),
            )
    return keys


@functools.cache
def _tag_of() -> dict[type, str]:
    """The tag a value of each of these exact types is written as (``spec.TAGS``, and treetensor's trees)."""
    types = _treetensor_types()
    tags = {t.type: tag for tag, t in TAGS.items() if isinstance(t.type, type)}
    return {**tags, **{types[kind]: tag for tag, kind in TREES.items()}}


_WRITE = {tag: TAGS[tag].write for tag in SCALARS}


class _Encoder:
    # A class rather than nested recursive closures: those form reference cycles that would keep
    # every array alive until the cyclic garbage collector runs.
    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.leaves: list[Leaf] = []
        self.tags = _tag_of()

    def add(self, leaf: Leaf) -> list:
        self.leaves.append(leaf)
        return [ARRAY, len(self.leaves) - 1]

    def walk(self, x: Any, path: tuple) -> list:
        tx = type(x)
        tag = self.tags.get(tx)
        if tag is not None:
            write = _WRITE.get(tag)
            if write is not None:  # an inline scalar
                if tx is int and not -INLINE_INT_BOUND < x < INLINE_INT_BOUND:
                    raise UnsupportedLeafError(
                        f"int at {format_path(path)} is over 10**30 in magnitude, more than readers accept inline; "
                        "store it as a str (or pass allow_pickle=True)",
                        key_path=format_path(path),
                    )
                return [tag, *write(x)]
            if len(path) >= MAX_TREE_DEPTH:
                raise UnsupportedLeafError(
                    f"the sample nests containers over {MAX_TREE_DEPTH} levels deep at {format_path(path[:3])}...; "
                    "readers refuse deeper trees (is it a cycle?): flatten it, or store the inner part as bytes",
                    key_path=format_path(path),
                )
            if tag in SEQUENCES:
                return [tag, [self.walk(v, path + (i,)) for i, v in enumerate(x)]]
            if tag in TREES:
                items = list(x.items())
                return [tag, [k for k, _ in items], [self.walk(v, path + (k,)) for k, v in items]]
            return [tag, _keys(x, path), [self.walk(v, path + (k,)) for k, v in x.items()]]
        if tx is np.ndarray:
            return self.add(_numpy_leaf(x, "numpy", path))
        if tx is torch.Tensor or tx is torch.nn.Parameter:
            return self.add(_torch_leaf(x, path))
        if isinstance(x, np.generic) and not isinstance(x, np.object_):
            return self.add(_numpy_leaf(np.asarray(x), "numpy_scalar", path))
        if tx is bytes or tx is bytearray:
            return self.add(Leaf("bytes" if tx is bytes else "bytearray", "|u1", (len(x),), np.frombuffer(x, np.uint8)))
        if self.allow_pickle:
            blob = pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)
            return self.add(Leaf("pickle", "|u1", (len(blob),), np.frombuffer(blob, np.uint8)))
        raise UnsupportedLeafError(
            f"value at {format_path(path)} of type {tx.__module__}.{tx.__qualname__} cannot be stored "
            "without pickle; store arrays, tensors, scalars, str, bytes, None in dict/list/tuple, "
            "or pass allow_pickle=True if you trust every reader",
            key_path=format_path(path),
        )


def encode(obj: Any, *, allow_pickle: bool = False) -> tuple[list, list[Leaf]]:
    """Split ``obj`` into a JSON-safe spec and its array leaves (in depth-first order)."""
    encoder = _Encoder(allow_pickle)
    return encoder.walk(obj, ()), encoder.leaves


@functools.lru_cache(maxsize=256)
def _numpy_dtype(dtype_str: str) -> tuple[np.dtype, bool]:
    dtype = np.dtype(dtype_str)
    return dtype, dtype.kind in "biufc" and dtype.isnative


def _numpy_to_tensor(arr: np.ndarray) -> Any:
    # As DataLoader's default_convert does: numeric arrays become tensors sharing their memory.
    if arr.dtype.kind in "biufc" and arr.dtype.isnative:
        return torch.from_numpy(arr)
    return arr


# Torch dtypes that numpy has too: their leaves are made as numpy views, then one from_numpy
# (cheaper than from_numpy + view + reshape on the tensor).
_TORCH_AS_NUMPY = {
    name: np.dtype(name)
    for name in (
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
    if name in _TORCH_DTYPES
}

# Leaf recipes (codes) and tree node codes of a Plan.
_L_TENSOR, _L_ARRAY, _L_TORCH, _L_TORCH_EMPTY, _L_SCALAR, _L_BYTES, _L_BYTEARRAY, _L_PICKLE = range(8)
_N_DICT, _N_DICT_OF_LEAVES, _N_LIST, _N_TUPLE, _N_CONST, _N_VALUES, _N_ODICT, _N_TREE, _N_SLOT = range(9)
_N_CODE = {dict: _N_DICT, collections.OrderedDict: _N_ODICT, list: _N_LIST, tuple: _N_TUPLE}  # by ``Tag.type``


class Plan:
    """How to rebuild the samples of one header: the per-leaf recipe and the compiled tree.

    Consecutive samples share their structure, so receivers keep plans (``plan_for``) and pay
    for decoding the header's spec once; ``build`` then makes one view per leaf and the tree.
    """

    __slots__ = ("base", "built", "consts", "device", "error", "header", "leaves", "opts", "stacked", "tree", "values")

    def __init__(self, header: Header, opts: ReadOptions = DEFAULT_READ) -> None:
        self.header, self.opts = header, opts
        self.leaves: list[tuple] = []
        self.tree: Any = None
        self.error: str | None = None
        self.built = False  # whether check() built a sample of this plan (its structure holds)
        self.values: list[tuple] = []  # (start, end, dtype) of leaves whose bytes may be no value
        self.consts: tuple = ()  # the inline scalars of ``split`` (their spec nodes), for ``bind``
        self.base: Plan | None = None  # the plan this one binds values to (which keeps the rest)
        self.stacked = False  # whether the tree has a stacked batch's inline values (``VALUES``)
        self.device: list[tuple] | None = None  # ``build_on``'s leaves, made on its first call
        try:
            self.leaves = [self._leaf(i, *entry) for i, entry in enumerate(header.arrays)]
            self.tree = self._node(header.spec)
            self.values = [
                (start, end, a)
                for code, start, end, a, _ in self.leaves
                if code in (_L_TENSOR, _L_ARRAY, _L_SCALAR) and a.kind in "bU" and end > start
            ]
        except Exception as exc:  # noqa: BLE001 - headers are validated where read; this is a backstop
            self.error = type(exc).__name__

    def _leaf(self, i: int, kind: str, dtype_str: str, shape: tuple, offset: int, nbytes: int) -> tuple:
        shape, end = tuple(shape), offset + nbytes
        if kind == "numpy":
            dtype, tensorable = _numpy_dtype(dtype_str)
            return (_L_TENSOR if self.opts.as_tensors and tensorable else _L_ARRAY), offset, end, dtype, shape
        if kind == "torch":
            if not nbytes:
                return _L_TORCH_EMPTY, offset, end, _TORCH_DTYPES[dtype_str], shape
            if dtype_str in _TORCH_AS_NUMPY:
                return _L_TENSOR, offset, end, _TORCH_AS_NUMPY[dtype_str], shape
            return _L_TORCH, offset, end, _TORCH_DTYPES[dtype_str], shape
        if kind == "numpy_scalar":
            return _L_SCALAR, offset, end, np.dtype(dtype_str), shape
        if kind == "bytes":
            return _L_BYTES, offset, end, None, shape
        if kind == "bytearray":
            return _L_BYTEARRAY, offset, end, None, shape
        return _L_PICKLE, offset, end, i, shape

    def _node(self, node: list) -> Any:
        tag = node[0]
        if tag == ARRAY:
            i = node[1]
            if type(i) is not int or not 0 <= i < len(self.leaves):
                raise IndexError("array leaf out of range")
            return i  # a leaf: an index into the sample's leaves
        if tag == _SLOT:  # an inline scalar ``split`` took out: the sample's own, given to ``bind``
            i = node[1]
            if type(i) is not int or i < 0:
                raise IndexError("inline value out of range")
            return _N_SLOT, i
        if tag == VALUES:  # one inline scalar per sample of a stacked batch
            self.stacked = True
            return _N_VALUES, tuple(self._node(v) for v in node[1])
        kind = TAGS.get(tag) if type(tag) is str else None
        if kind is None:
            raise ValueError("unknown tree node tag")
        if tag in SCALARS:
            return _N_CONST, kind.read(node)
        if tag in SEQUENCES:
            return _N_CODE[kind.type], tuple(self._node(v) for v in node[1])
        children = tuple(self._node(v) for v in node[2])
        if tag in TREES:
            want = "torch" if self.opts.as_tensors and self._all_tensors(children) else kind.type
            return _N_TREE, _treetensor_types()[want], tuple(node[1]), children
        keys = tuple(spec_key(k) for k in node[1])
        n = min(len(keys), len(children))
        keys, children = keys[:n], children[:n]
        if kind.type is dict and all(type(c) is int for c in children):
            return _N_DICT_OF_LEAVES, keys, children
        return _N_CODE[kind.type], keys, children

    def _all_tensors(self, children: tuple) -> bool:
        """Whether a tree's leaves all become tensors (a numpy tree of strings stays a numpy tree)."""
        for c in children:
            if type(c) is int:
                if self.leaves[c][0] not in (_L_TENSOR, _L_TORCH, _L_TORCH_EMPTY):
                    return False
            elif not self._all_tensors(c[3]):
                return False
        return True

    def check(self, u8: np.ndarray, path: str = "") -> None:
        """Raise ``StorageCorruptError`` (naming ``path``) unless ``build(u8, path)`` makes the sample.

        What a worker does before it sends a reference: the receiver builds the sample while it
        unpickles the worker's result, where an error has no way back to the sample's handle (a
        DataLoader would wait for that item for ever). A header's structure (shapes numpy and
        torch accept, stacked or not) is checked once per plan, by building a sample; the data of
        each sample, for the leaves whose bytes are not all values: bool (0 or 1: torch's kernels
        assume so) and str (code points up to U+10FFFF). Pickled leaves are unpickled where used.
        """
        self.check_values(u8, path)
        base = self.base or self
        if not base.built:
            self.build(u8, path, probe=True)
            base.built = True

    def bind(self, consts: tuple) -> Plan:
        """This plan for a sample whose inline scalars (``split``'s values) are ``consts``: a copy
        that shares everything else, so samples that differ only in such values share one plan."""
        if not consts:
            return self
        bound = Plan.__new__(Plan)
        for name in ("error", "header", "leaves", "opts", "tree", "values"):  # the rest is read from the base
            setattr(bound, name, getattr(self, name))
        bound.consts, bound.base = consts, self
        return bound

    def check_values(self, u8: np.ndarray, path: str = "") -> None:
        """``check``'s per-sample part: the bytes of bool and str leaves are values of their dtype."""
        if self.error is not None:
            raise _damaged(path, self.error)
        for start, end, dtype in self.values:
            raw = u8[start:end]
            if dtype.kind == "b":
                if raw.max() > 1:
                    raise _bad_values(path, "a bool leaf holds bytes other than 0 and 1")
            elif raw.view(np.dtype(np.uint32).newbyteorder(dtype.byteorder)).max() > 0x10FFFF:
                raise _bad_values(path, "a str leaf holds a code point above U+10FFFF")

    def build(self, u8: np.ndarray, path: str = "", *, probe: bool = False) -> Any:
        """The sample whose data section is ``u8`` (a 1-D uint8 array; the leaves are views of it).

        ``probe``: for ``check``, pickled leaves are left as None, not unpickled."""
        if self.error is not None:
            raise _damaged(path, self.error)
        leaves: list[Any] = []
        add = leaves.append
        try:
            for code, start, end, a, shape in self.leaves:
                if code == _L_TENSOR:
                    add(torch.from_numpy(u8[start:end].view(a).reshape(shape)))
                elif code == _L_ARRAY:
                    add(u8[start:end].view(a).reshape(shape))
                elif code == _L_PICKLE and probe:
                    add(None)
                else:
                    add(_other_leaf(self.opts, u8, code, start, end, a, shape, path))
            return self.assemble(leaves)
        except StorageError:
            raise
        except Exception as exc:  # noqa: BLE001 - a sample or our error, whatever the bytes
            raise _damaged(path, type(exc).__name__) from None

    def build_on(self, host: np.ndarray, path: str, copy: Callable[..., Any], move: Callable[..., Any]) -> Any:
        """The sample with its tensors on a device: ``copy(host, path)`` puts the data section
        ``host`` there in one copy (a 1-D uint8 tensor), and the tensor leaves are views of it; the
        other leaves are read from ``host`` now (arrays copied: ``host`` goes back once the copy is
        done), and tensors made on the host (a stacked batch's inline values) go over by ``move``."""
        if self.error is not None:
            raise _damaged(path, self.error)
        base = self.base or self
        if base.device is None:  # the leaves that become tensors, as torch views (``_L_TORCH``) of the copy
            as_tensor = (_L_TENSOR, _L_SCALAR) if self.opts.as_tensors else (_L_TENSOR,)
            base.device = [
                (_L_TORCH, s, e, torch.from_numpy(np.empty(0, a)).dtype, shape)
                if code in as_tensor and a.kind in "biufc" and a.isnative
                else (code, s, e, a, shape)
                for code, s, e, a, shape in base.leaves
            ]
        dev = copy(host, path)
        leaves: list[Any] = []
        add = leaves.append
        try:
            for code, start, end, a, shape in base.device:
                if code == _L_TORCH:
                    add(dev[start:end].view(a).view(shape))
                elif code == _L_TORCH_EMPTY:
                    add(torch.empty(shape, dtype=a, device=dev.device))
                elif code == _L_ARRAY:
                    add(host[start:end].view(a).reshape(shape).copy())
                else:
                    add(_other_leaf(self.opts, host, code, start, end, a, shape, path))
            sample = self.assemble(leaves)
        except StorageError:
            raise
        except Exception as exc:  # noqa: BLE001 - a sample or our error, whatever the bytes
            raise _damaged(path, f"{type(exc).__name__}: {exc}") from None
        if base.stacked:
            storage = dev.untyped_storage().data_ptr()
            return map_tensors(sample, lambda t: t if t.untyped_storage().data_ptr() == storage else move(t))
        return sample

    def assemble(self, leaves: list) -> Any:
        """The sample's tree around its built ``leaves`` (with this plan's inline values)."""
        tree = self.tree
        if type(tree) is int:
            return leaves[tree]
        if tree[0] == _N_DICT_OF_LEAVES:
            return {k: leaves[i] for k, i in zip(tree[1], tree[2])}
        read = _READ
        return self._walk(tree, leaves, [read[v[0]](v) for v in self.consts])

    def _walk(self, node: Any, leaves: list, consts: list) -> Any:
        if type(node) is int:
            return leaves[node]
        code = node[0]
        if code == _N_DICT_OF_LEAVES:
            return {k: leaves[i] for k, i in zip(node[1], node[2])}
        if code == _N_DICT:
            return {k: self._walk(v, leaves, consts) for k, v in zip(node[1], node[2])}
        if code == _N_LIST:
            return [self._walk(v, leaves, consts) for v in node[1]]
        if code == _N_TUPLE:
            return tuple(self._walk(v, leaves, consts) for v in node[1])
        if code == _N_CONST:
            return node[1]
        if code == _N_SLOT:
            return consts[node[1]]
        if code == _N_VALUES:
            values = [self._walk(v, leaves, consts) for v in node[1]]
            kinds = {type(v) for v in values}
            # Checked once per plan, built for every batch: values that never fail to build.
            # Ints past int64 (headers allow up to 10**30) stay a list of ints.
            tensorable = len(kinds) == 1 and kinds <= {bool, int, float}
            if (
                self.opts.as_tensors
                and tensorable
                and (int not in kinds or all(-(1 << 63) <= v < 1 << 63 for v in values))
            ):
                return torch.tensor(values)
            return values
        if code == _N_ODICT:
            return collections.OrderedDict((k, self._walk(v, leaves, consts)) for k, v in zip(node[1], node[2]))
        return node[1]({k: self._walk(v, leaves, consts) for k, v in zip(node[2], node[3])})


def _other_leaf(
    opts: ReadOptions, u8: np.ndarray, code: int, start: int, end: int, a: Any, shape: tuple, path: str
) -> Any:
    """A leaf that is not a view of the bytes (those ``Plan.build`` makes itself)."""
    raw = u8[start:end]
    if code == _L_TORCH:
        return torch.from_numpy(raw).view(a).reshape(shape)
    if code == _L_TORCH_EMPTY:
        return torch.empty(shape, dtype=a)
    if code == _L_SCALAR:
        value = raw.view(a).reshape(())[()]
        return _numpy_to_tensor(np.asarray(value)) if opts.as_tensors else value
    if code == _L_BYTES:
        return raw.tobytes()
    if code == _L_BYTEARRAY:
        return bytearray(raw)
    if not opts.allow_pickle:
        raise PickleNotAllowedError(
            f"{path}: holds a pickled value (leaf {a}); loading it would run code from the file. "
            "Pass allow_pickle=True only if you trust whoever wrote it",
            path=path,
        )
    return pickle.loads(raw.data)


def _bad_values(path: str, why: str) -> StorageCorruptError:
    return StorageCorruptError(
        f"{path}: its data section is not the values its header declares ({why}); delete the file or "
        "save the sample again",
        path=path,
    )


def _damaged(path: str, why: str) -> StorageCorruptError:
    return StorageCorruptError(
        f"{path}: tree in header is damaged ({why}); delete the file or save the sample again", path=path
    )


_SLOT = "x"  # ``split``'s stand-in for an inline scalar: ``["x", i]``
_INLINE = tuple(tag for tag in SCALARS if TAGS[tag].type is not type(None))  # what ``split`` takes out
_READ = {tag: TAGS[tag].read for tag in SCALARS}  # an inline scalar's node -> its value


def split(spec: list) -> tuple[list, tuple]:
    """``spec`` with its inline scalars replaced by ``["x", i]``, and those scalars' nodes in order.

    Samples that differ only in such values (an episode id, a reward kept as a float) then share
    one skeleton, and so one cached plan (``plan_for``, ``Plan.bind``): without this, each sample
    of a stream of unique ids cost a plan decoded and checked in the worker and again in the trainer.
    """
    values: list = []

    def walk(node: list) -> list:
        tag = node[0]
        if tag in _INLINE:
            values.append(node)
            return [_SLOT, len(values) - 1]
        if tag in MAPPINGS:
            return [tag, node[1], [walk(c) for c in node[2]]]
        if tag in SEQUENCES or tag == VALUES:
            return [tag, [walk(c) for c in node[1]]]
        return node  # an array leaf, None, or a tag the plan reports as damaged

    skeleton = walk(spec)
    return skeleton, tuple(values)


_plans: dict[bytes, Plan] = {}
_MAX_PLANS = 256
_MAX_PLAN_KEY = 256 << 10  # larger headers are decoded each time, never kept
_MAX_PLAN_BYTES = 16 << 20  # all cached keys together
_plan_bytes = 0


def plan_for(key: bytes) -> Plan:
    """The plan of a ``_shm.refs.plan_key``: decoded once per distinct header (and options) in this process.

    Keyed by the key's bytes themselves, so nothing depends on which worker, ring or process
    sent it. The cache is bounded by count (``_MAX_PLANS``) and by size (``_MAX_PLAN_BYTES`` of keys;
    a header over ``_MAX_PLAN_KEY`` is never kept): when full, all are dropped (headers that keep
    changing cost what they cost without a cache).
    """
    global _plan_bytes
    plan = _plans.get(key)
    if plan is None:
        plan = Plan(*pickle.loads(key))
        if len(key) > _MAX_PLAN_KEY:
            return plan
        if len(_plans) >= _MAX_PLANS or _plan_bytes + len(key) > _MAX_PLAN_BYTES:
            _plans.clear()
            _plan_bytes = 0
        _plans[key] = plan
        _plan_bytes += len(key)
    return plan


def plan_key(header: Header, opts: ReadOptions) -> tuple[bytes, tuple]:
    """What a reference carries instead of its header: the receiver's key for a cached build plan
    (``plan_for``) and the sample's inline scalars (``split``), which the
    key leaves out so that samples differing only in them share one plan. The key is plain bytes,
    so that nothing depends on which worker, ring or process sent it; pickling it here keeps torch
    out of the workers. Workers reuse one header object per layout (``filling._Layout``), so its
    key is made once, not per sample."""
    hit = _plan_keys.get(id(header))
    if hit is not None and hit[0] is header and hit[1] == opts:
        return hit[2], hit[3]
    key, consts = _key(header, opts)
    if len(_plan_keys) >= _MAX_PLAN_KEYS:
        _plan_keys.clear()
    _plan_keys[id(header)] = (header, opts, key, consts)  # the header is kept: its id stays its own
    return key, consts


_plan_keys: dict[int, tuple[Header, ReadOptions, bytes, tuple]] = {}
_MAX_PLAN_KEYS = 64


def _key(header: Header, opts: ReadOptions) -> tuple[bytes, tuple]:
    """``plan_key`` without its cache by header object (which would keep headers made once alive).

    Headers whose array table is a kept one (``file._parse_tree_only``) share that table's object:
    their key is looked up by it and by the skeleton's own (exact) pickle, instead of pickling the
    table again for every sample (5 of 8 us, one sample per DataLoader item). Other headers (a file
    loaded once, samples built in memory) make theirs as before. Bounded like ``plan_for``'s cache:
    by count, and by the bytes of the keys and skeletons kept (``_MAX_SHAPE_BYTES``); the tables
    themselves are the kept tables' own."""
    global _shape_bytes
    skeleton, consts = split(header.spec)
    arrays = header.arrays
    if not is_kept_table(arrays):
        bare = Header(skeleton, arrays, header.data_offset, header.data_size)
        return pickle.dumps((bare, opts), pickle.HIGHEST_PROTOCOL), consts
    shape = (id(arrays), header.data_offset, header.data_size, opts, pickle.dumps(skeleton, pickle.HIGHEST_PROTOCOL))
    hit = _keys_by_shape.get(shape)
    if hit is not None and hit[0] is arrays:
        return hit[1], consts
    bare = Header(skeleton, arrays, header.data_offset, header.data_size)  # (after the lookup: 1.5 us)
    key = pickle.dumps((bare, opts), pickle.HIGHEST_PROTOCOL)
    size = len(key) + len(shape[-1])
    if size > _MAX_SHAPE_BYTES:
        return key, consts  # never kept (nor does it push the others out)
    if len(_keys_by_shape) >= _MAX_PLAN_KEYS or _shape_bytes + size > _MAX_SHAPE_BYTES:
        _keys_by_shape.clear()
        _shape_bytes = 0
    _keys_by_shape[shape] = (arrays, key)  # the arrays are kept: their id stays their own
    _shape_bytes += size
    return key, consts


_keys_by_shape: dict[tuple, tuple[tuple, bytes]] = {}
_MAX_SHAPE_BYTES = 4 << 20  # keys and skeletons kept by _key, all together
_shape_bytes = 0


def build(header: Header, buf, opts: ReadOptions = DEFAULT_READ, *, path: str = "") -> Any:
    """Rebuild a sample whose data section lies in ``buf``; leaves are views onto ``buf``.

    ``buf`` must be writable (a bytearray, an mmap, a ctypes array, a uint8 array): the views
    keep it alive.
    """
    u8 = buf if type(buf) is np.ndarray and buf.dtype == np.uint8 else np.frombuffer(buf, np.uint8)
    key, consts = _key(header, opts)  # (a loaded file's header is its own: caching it by id would only pin it)
    plan = plan_for(key).bind(consts)
    plan.check_values(u8, path)
    return plan.build(u8, path)


class _ToTensors:
    def __init__(self) -> None:
        self.tree_types = _treetensor_types()

    def walk(self, x: Any) -> Any:
        tx = type(x)
        if tx is dict or tx is collections.OrderedDict:
            return tx((k, self.walk(v)) for k, v in x.items())
        if tx is list:
            return [self.walk(v) for v in x]
        if tx is tuple:
            return tuple(self.walk(v) for v in x)
        if tx is np.ndarray:
            return _numpy_to_tensor(x)
        if isinstance(x, np.generic):
            return _numpy_to_tensor(np.asarray(x))
        if tx is self.tree_types["numpy"]:
            return self.tree_types["torch"]({k: self.walk(v) for k, v in x.items()})
        return x


def map_tensors(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``x`` with each tensor ``t`` in its containers (those a sample is made of) replaced by ``fn(t)``."""
    tx = type(x)
    if tx is torch.Tensor or isinstance(x, torch.Tensor):
        return fn(x)
    if tx is dict or tx is collections.OrderedDict:
        return tx((k, map_tensors(v, fn)) for k, v in x.items())
    if tx is list:
        return [map_tensors(v, fn) for v in x]
    if tx is tuple:
        return tuple(map_tensors(v, fn) for v in x)
    if tx in _treetensor_types().values():
        return tx({k: map_tensors(v, fn) for k, v in x.items()})
    return x


def to_tensors(obj: Any) -> Any:
    """Numeric numpy leaves to tensors (sharing memory), treetensor numpy trees to torch trees."""
    return _ToTensors().walk(obj)
