"""Stacking samples of one structure into one buffer: leaf ``i`` of sample ``j`` lands at
``base_i + j * nbytes_i``, so each leaf of the batch is one contiguous array with a leading batch
dimension, read straight from the files with one scatter ``preadv`` per sample.
"""

from __future__ import annotations

from ._format import BYTE_KINDS, ArrayEntry, Header, align
from .errors import SampleMismatchError

__all__ = ["file_iovecs", "leaf_paths", "plan"]

_SCALARS = ("n", "b", "i", "f", "c", "s")


def leaf_paths(spec: list) -> list[str]:
    """Key path of every array leaf of ``spec``, in leaf order."""
    out: list[str] = []

    def walk(node, path):
        tag = node[0]
        if tag == "a":
            out.append(path or "<root>")
        elif tag in ("d", "od", "tt", "tn"):
            for k, child in zip(node[1], node[2]):
                walk(child, f"{path}[{(k[1] if type(k) is list else k)!r}]")
        elif tag in ("l", "t"):
            for i, child in enumerate(node[1]):
                walk(child, f"{path}[{i}]")

    walk(spec, "")
    return out


def _merge(specs: list[list], path: str, names: list[str]) -> list:
    """One spec for the batch; inline scalars that vary become a ``["v", [node, ...]]`` list."""
    first = specs[0]
    tag = first[0]
    if tag in _SCALARS:
        if all(s[0] in _SCALARS for s in specs):
            return ["v", specs]
    for j, s in enumerate(specs[1:], 1):
        if s[0] != tag:
            raise _mismatch(path, names[0], names[j], f"a {_kind(first)}", f"a {_kind(s)}")
    if tag == "a":
        return first
    if tag in ("d", "od", "tt", "tn"):
        for j, s in enumerate(specs[1:], 1):
            if s[1] != first[1]:
                raise _mismatch(path, names[0], names[j], f"keys {first[1]}", f"keys {s[1]}")
        return [tag, first[1], [_merge([s[2][i] for s in specs], f"{path}[{k[1] if type(k) is list else k!r}]", names)
                                for i, k in enumerate(first[1])]]
    if tag in ("l", "t"):
        for j, s in enumerate(specs[1:], 1):
            if len(s[1]) != len(first[1]):
                raise _mismatch(path, names[0], names[j], f"length {len(first[1])}", f"length {len(s[1])}")
        return [tag, [_merge([s[1][i] for s in specs], f"{path}[{i}]", names) for i in range(len(first[1]))]]
    raise ValueError("unknown tree node tag")


def _kind(node: list) -> str:
    return {"a": "array", "d": "dict", "od": "dict", "l": "list", "t": "tuple", "tt": "tree", "tn": "tree"}.get(
        node[0], "scalar")


def _mismatch(path: str, name_a: str, name_b: str, a: str, b: str) -> SampleMismatchError:
    return SampleMismatchError(
        f"cannot stack the batch: at {path or '<root>'} {name_a} has {a} but {name_b} has {b}; "
        "pass collate_fn= to combine samples whose shapes differ (or batch_size=None)",
        key_path=path or "<root>",
    )


def plan(headers: list[Header], names: list[str]) -> Header:
    """The stacked header of a batch; raises ``SampleMismatchError`` naming the key path."""
    first = headers[0]
    spec = _merge([h.spec for h in headers], "", names)
    paths = leaf_paths(first.spec)
    k = len(headers)
    arrays, offset = [], 0
    for i, e in enumerate(first.arrays):
        for j, h in enumerate(headers[1:], 1):
            o = h.arrays[i]
            if (o.kind, o.dtype, o.shape) != (e.kind, e.dtype, e.shape):
                raise _mismatch(paths[i], names[0], names[j], f"{e.dtype} {list(e.shape)}", f"{o.dtype} {list(o.shape)}")
        if e.kind in BYTE_KINDS:
            raise SampleMismatchError(
                f"cannot stack the {e.kind} leaf at {paths[i]}; pass collate_fn= to batch such samples",
                key_path=paths[i])
        arrays.append(ArrayEntry("numpy" if e.kind == "numpy_scalar" else e.kind, e.dtype, (k, *e.shape),
                                 offset, k * e.nbytes))
        offset = align(offset + k * e.nbytes)
    return Header(spec, tuple(arrays), 0, offset)


def file_iovecs(sample: Header, batch: Header, j: int, target: memoryview, scratch: memoryview) -> list:
    """Buffers for one ``preadv`` of sample ``j``'s data section: its leaves land at their batch place."""
    views, pos = [], 0
    for e, b in zip(sample.arrays, batch.arrays):
        if e.offset > pos:
            views.append(scratch[: e.offset - pos])
        start = b.offset + j * e.nbytes
        views.append(target[start: start + e.nbytes])
        pos = e.offset + e.nbytes
    return views
