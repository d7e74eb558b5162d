"""Stacking samples of one structure into one buffer: leaf ``i`` of sample ``j`` lands at
``base_i + j * nbytes_i``, so each leaf of the batch is one contiguous array with a leading batch
dimension, read straight from the files with one scatter ``preadv`` per sample.
"""

from __future__ import annotations

from typing import Any

from ..errors import SampleMismatchError
from .file import BYTE_KINDS, ArrayEntry, Header, align
from .spec import ARRAY, MAPPINGS, SCALARS, SEQUENCES, TAGS, VALUES

__all__ = ["file_iovecs", "plan"]

# Where a node is in a spec, by position: ``i`` the i-th item of a sequence, ``("k", i)`` the i-th
# key's value of a mapping (keys are file text: never shown).
_Path = tuple[int | tuple[str, int], ...]


def _show_path(path: _Path) -> str:
    """``(("k", 1), 0)`` -> ``"<root>{#1}[0]"``: keys by position, never quoted (they are file text)."""
    shown = "".join(f"{{#{p[1]}}}" if type(p) is tuple else f"[{p}]" for p in path[:12])
    return "<root>" + shown + ("..." if len(path) > 12 else "")


def _leaf_positions(spec: list[Any]) -> list[_Path]:
    """The position path (``_show_path``'s) of every array leaf of ``spec``, in leaf order."""
    out: list[_Path] = []

    def walk(node: list[Any], path: _Path) -> None:
        tag = node[0]
        if tag == ARRAY:
            out.append(path)
        elif tag in MAPPINGS:
            for i, child in enumerate(node[2]):
                walk(child, (*path, ("k", i)))
        elif tag in SEQUENCES:
            for i, child in enumerate(node[1]):
                walk(child, (*path, i))

    walk(spec, ())
    return out


def _short(text: str, n: int = 200) -> str:
    return text if len(text) <= n else text[:n] + "..."


def _merge(specs: list[list[Any]], path: _Path, names: list[str]) -> list[Any]:
    """One spec for the batch; inline scalars that vary become a ``["v", [node, ...]]`` list.

    ``path`` is a tuple of positions (``_show_path``), formatted only for an error."""
    first = specs[0]
    tag = first[0]
    if tag in SCALARS and all(s[0] in SCALARS for s in specs):
        return [VALUES, specs]
    for j, s in enumerate(specs[1:], 1):
        if s[0] != tag:
            raise _mismatch(path, names[0], names[j], f"a {TAGS[tag].name}", f"a {TAGS[s[0]].name}")
    if tag == ARRAY:
        return first
    if tag in MAPPINGS:
        for j, s in enumerate(specs[1:], 1):
            if s[1] != first[1]:
                raise _mismatch(
                    path, names[0], names[j], f"a mapping of {len(first[1])} key(s)", f"other key(s): {len(s[1])}"
                )
        return [
            tag,
            first[1],
            [_merge([s[2][i] for s in specs], (*path, ("k", i)), names) for i in range(len(first[1]))],
        ]
    if tag in SEQUENCES:
        for j, s in enumerate(specs[1:], 1):
            if len(s[1]) != len(first[1]):
                raise _mismatch(path, names[0], names[j], f"length {len(first[1])}", f"length {len(s[1])}")
        return [tag, [_merge([s[1][i] for s in specs], path + (i,), names) for i in range(len(first[1]))]]
    raise ValueError("unknown tree node tag")


def _mismatch(path: _Path, name_a: str, name_b: str, a: str, b: str) -> SampleMismatchError:
    shown = _show_path(path)
    return SampleMismatchError(
        f"cannot stack the batch: at {shown} {name_a} has {a} but {name_b} has {b} ({{#i}}: a mapping's "
        "i-th key; keys are file text, never quoted); pass collate_fn= to combine samples whose shapes "
        "differ (or batch_size=None)",
        key_path=shown,
    )


def plan(headers: list[Header], names: list[str]) -> Header:
    """The stacked header of a batch; raises ``SampleMismatchError`` naming the key path."""
    first = headers[0]
    spec = _merge([h.spec for h in headers], (), names)
    k = len(headers)
    arrays: list[ArrayEntry] = []
    offset = 0
    for i, e in enumerate(first.arrays):
        for j, h in enumerate(headers[1:], 1):
            o = h.arrays[i]
            if (o.kind, o.dtype, o.shape) != (e.kind, e.dtype, e.shape):
                raise _mismatch(
                    _leaf_positions(first.spec)[i],
                    names[0],
                    names[j],
                    _short(f"{e.dtype} {list(e.shape)}"),
                    _short(f"{o.dtype} {list(o.shape)}"),
                )
        if e.kind in BYTE_KINDS:
            shown = _show_path(_leaf_positions(first.spec)[i])
            raise SampleMismatchError(
                f"cannot stack the {e.kind} leaf at {shown}; pass collate_fn= to batch such samples", key_path=shown
            )
        arrays.append(
            ArrayEntry("numpy" if e.kind == "numpy_scalar" else e.kind, e.dtype, (k, *e.shape), offset, k * e.nbytes)
        )
        offset = align(offset + k * e.nbytes)
    return Header(spec, tuple(arrays), 0, offset)


def file_iovecs(sample: Header, batch: Header, j: int, target: memoryview, scratch: memoryview) -> list[memoryview]:
    """Buffers for one ``preadv`` of sample ``j``'s data section: its leaves land at their batch place."""
    views: list[memoryview] = []
    pos = 0
    for e, b in zip(sample.arrays, batch.arrays):
        if e.offset > pos:
            views.append(scratch[: e.offset - pos])
        start = b.offset + j * e.nbytes
        views.append(target[start : start + e.nbytes])
        pos = e.offset + e.nbytes
    return views
