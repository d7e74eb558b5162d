"""The grammar of a sample's tree spec, as a file's header stores it: one table of its tags
(``TAGS``), which ``tree`` writes and builds samples by, ``batch`` merges specs by, and ``check_tree``
validates what a file says by.

A spec node is a JSON list whose first item is its tag: ``["a", i]`` array leaf ``i``; mappings
``[tag, [keys], [children]]`` (dict, OrderedDict, treetensor torch / numpy tree; a key is a string
or ``["int", n]``); sequences ``[tag, [children]]`` (list, tuple); inline scalars ``[tag, *fields]``
(None, bool, int, str, and float and complex in hex); and, in a stacked batch only,
``["v", [scalar, ...]]`` (one per sample).
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from .._untrusted import bounded as _bounded
from ..errors import StorageCorruptError

__all__ = ["ARRAY", "MAPPINGS", "SCALARS", "SEQUENCES", "TAGS", "TREES", "VALUES", "check_tree", "corrupt", "spec_key"]


class Tag(NamedTuple):
    """What the nodes of one tag hold; for a scalar, how its value is written, read back and checked."""

    family: str  # array, mapping, sequence, scalar, or values (a stacked batch's inline scalars)
    name: str  # what the node holds, in words (errors)
    type: Any = None  # the Python type written as this tag and built from it; a treetensor tree: its arrays' kind
    size: int = 2  # a scalar node's length
    write: Callable[[Any], list[Any]] | None = None  # a scalar: its value -> the node's fields after the tag
    read: Callable[[list[Any]], Any] | None = None  # a scalar: its node -> its value
    valid: Callable[[list[Any]], bool] = lambda node: False  # a scalar: whether a node of its size holds its type


def _is_inline_int(v: Any) -> bool:
    return type(v) is int and -_bounded.INLINE_INT_BOUND < v < _bounded.INLINE_INT_BOUND


def _is_hex_float(v: Any) -> bool:
    if type(v) is not str or len(v) > 32:
        return False
    try:
        float.fromhex(v)
    except (ValueError, OverflowError):
        return False
    return True


def _scalar(
    type_: type,
    write: Callable[[Any], list[Any]],
    read: Callable[[list[Any]], Any],
    valid: Callable[[list[Any]], bool],
    size: int = 2,
) -> Tag:
    return Tag("scalar", "scalar", type_, size, write, read, valid)


_field = operator.itemgetter(1)
TAGS: dict[str, Tag] = {
    "a": Tag("array", "array"),
    "d": Tag("mapping", "dict", dict),
    "od": Tag("mapping", "dict", collections.OrderedDict),
    "tt": Tag("mapping", "tree", "torch"),
    "tn": Tag("mapping", "tree", "numpy"),
    "l": Tag("sequence", "list", list),
    "t": Tag("sequence", "tuple", tuple),
    "n": _scalar(type(None), lambda x: [], lambda node: None, lambda node: True, 1),
    "b": _scalar(bool, lambda x: [x], _field, lambda node: type(node[1]) is bool),
    "i": _scalar(int, lambda x: [x], _field, lambda node: _is_inline_int(node[1])),
    "s": _scalar(str, lambda x: [x], _field, lambda node: type(node[1]) is str),
    "f": _scalar(float, lambda x: [x.hex()], lambda node: float.fromhex(node[1]), lambda node: _is_hex_float(node[1])),
    "c": _scalar(
        complex,
        lambda x: [x.real.hex(), x.imag.hex()],
        lambda node: complex(float.fromhex(node[1]), float.fromhex(node[2])),
        lambda node: _is_hex_float(node[1]) and _is_hex_float(node[2]),
        3,
    ),
    "v": Tag("values", "scalars"),
}
# The table by family, for the walks (membership in a short tuple is what they test per node).
ARRAY, VALUES = "a", "v"
MAPPINGS = tuple(tag for tag, t in TAGS.items() if t.family == "mapping")
SEQUENCES = tuple(tag for tag, t in TAGS.items() if t.family == "sequence")
SCALARS = tuple(tag for tag, t in TAGS.items() if t.family == "scalar")
TREES = {tag: TAGS[tag].type for tag in MAPPINGS if type(TAGS[tag].type) is str}  # -> the kind of their arrays


def spec_key(k: Any) -> Any:
    """A mapping's key as the spec stores it (a str, or ``["int", n]``) back to the key."""
    return k[1] if type(k) is list else k


def corrupt(path: str, why: str) -> StorageCorruptError:
    """The error for a file or object whose bytes are not what this library writes (names it, says the fix)."""
    return StorageCorruptError(
        f"{path}: {why}; it was not written completely by torch_storage_loader (or was damaged "
        "since): delete it, or save the sample again",
        path=path,
    )


def check_tree(spec: Any, arrays: Sequence[Any], path: str) -> None:
    """Check a file's tree spec node by node, exactly as ``tree.encode`` writes it, or raise
    ``StorageCorruptError``: known tags with their arity and value types (``bool`` is not an
    ``int``; inline ints below ``_bounded.INLINE_INT_BOUND``), finite or infinite hexadecimal floats,
    dict keys of one length with their children, treetensor trees holding only arrays of their kind
    and subtrees of their own, at most ``MAX_TREE_DEPTH`` containers deep, and array leaves numbered
    0, 1, 2... in depth-first order, each array used exactly once. What passes builds."""
    leaves = 0
    stack: list[tuple[Any, int, str | None]] = [(spec, 0, None)]
    pop, push = stack.pop, stack.append
    while stack:
        node, depth, tree = pop()  # tree: the tag of the treetensor tree holding this node, if any
        if type(node) is not list or not node:
            raise _bad_node(path, depth, "is not a non-empty list")
        tag = node[0]
        if tag == ARRAY:
            if len(node) != 2 or type(node[1]) is not int or node[1] != leaves:
                raise _bad_node(path, depth, f"is not array leaf {leaves} (leaves are numbered in depth-first order)")
            if leaves >= len(arrays):
                raise corrupt(path, f"its tree uses more arrays than the {len(arrays)} its header lists")
            if tree is not None and arrays[leaves].kind != TREES[tree]:
                raise _bad_node(path, depth, "is an array of another kind than its treetensor tree holds")
            leaves += 1
            continue
        if type(tag) is not str:
            raise _bad_node(path, depth, "has no tag")
        if tree is not None and tag != tree:
            raise _bad_node(path, depth, "is neither an array nor a subtree, inside a treetensor tree")
        if tag in MAPPINGS or tag in SEQUENCES:
            if depth >= _bounded.MAX_TREE_DEPTH:
                raise _bad_node(path, depth, f"is nested over {_bounded.MAX_TREE_DEPTH} levels deep")
            if tag in SEQUENCES:
                if len(node) != 2 or type(node[1]) is not list:
                    raise _bad_node(path, depth, "is not [tag, [children]]")
                children = node[1]
            else:
                if (
                    len(node) != 3
                    or type(node[1]) is not list
                    or type(node[2]) is not list
                    or len(node[1]) != len(node[2])
                ):
                    raise _bad_node(path, depth, "is not [tag, [keys], [children]] with one child per key")
                keyed_by_int = tag not in TREES  # a treetensor tree's keys are attribute names
                for k in node[1]:
                    if type(k) is not str and not (
                        keyed_by_int and type(k) is list and len(k) == 2 and k[0] == "int" and _is_inline_int(k[1])
                    ):
                        raise _bad_node(path, depth, "has a key that is neither a string nor an int")
                children = node[2]
            inner = tag if tag in TREES else None
            for child in reversed(children):
                push((child, depth + 1, inner))
            continue
        scalar = TAGS.get(tag)
        if scalar is None or scalar.family != "scalar" or scalar.size != len(node):
            raise _bad_node(path, depth, "has an unknown tag, or the wrong number of fields for its tag")
        if not scalar.valid(node):
            raise _bad_node(
                path, depth, f"holds no {scalar.type.__name__} as its tag says (ints under 10**30, floats in hex)"
            )
    if leaves != len(arrays):
        raise corrupt(path, f"its tree uses {leaves} arrays but its header lists {len(arrays)}")


def _bad_node(path: str, depth: int, why: str) -> StorageCorruptError:
    return corrupt(path, f"a node of its tree {depth} levels down {why}")
