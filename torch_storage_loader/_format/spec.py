"""The grammar of a sample's tree spec, as a file's header stores it, in one place.

A spec node is a JSON list whose first item is its tag: ``["a", i]`` array leaf ``i``; mappings
``["d" | "od" | "tt" | "tn", [keys], [children]]`` (dict, OrderedDict, treetensor torch / numpy
tree; a key is a string or ``["int", n]``); sequences ``["l" | "t", [children]]`` (list, tuple);
inline scalars ``["n"]``, ``["b", bool]``, ``["i", int]``, ``["s", str]``, ``["f", hex]``,
``["c", hex, hex]``; and, in a stacked batch only, ``["v", [scalar, ...]]`` (one per sample).
``tree`` writes and builds specs, ``batch`` merges them, ``check_tree`` validates what a file says.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._untrusted import bounded as _bounded
from ..errors import StorageCorruptError

__all__ = ["ARRAY", "MAPPINGS", "SCALARS", "SEQUENCES", "check_tree", "corrupt", "kind_name", "spec_key"]

ARRAY = "a"
MAPPINGS = ("d", "od", "tt", "tn")
SEQUENCES = ("l", "t")
SCALARS = ("n", "b", "i", "f", "c", "s")
_KIND_NAMES = {"a": "array", "d": "dict", "od": "dict", "l": "list", "t": "tuple", "tt": "tree", "tn": "tree"}


def spec_key(k: Any) -> Any:
    """A mapping's key as the spec stores it (a str, or ``["int", n]``) back to the key."""
    return k[1] if type(k) is list else k


def kind_name(node: list[Any]) -> str:
    """What a spec node holds, in words, for an error message."""
    return _KIND_NAMES.get(node[0], "scalar")


def corrupt(path: str, why: str) -> StorageCorruptError:
    """The error for a file or object whose bytes are not what this library writes (names it, says the fix)."""
    return StorageCorruptError(
        f"{path}: {why}; it was not written completely by torch_storage_loader (or was damaged "
        "since): delete it, or save the sample again",
        path=path,
    )


_NODE_LEN = {"n": 1, "b": 2, "i": 2, "s": 2, "f": 2, "c": 3, "a": 2, "l": 2, "t": 2}

_TREE_LEAF_KIND = {"tt": "torch", "tn": "numpy"}  # what a treetensor tree holds: arrays of its kind, subtrees


def check_tree(spec: Any, arrays: Sequence[Any], path: str) -> None:
    """Check a file's tree spec node by node, exactly as ``tree.encode`` writes it, or raise
    ``StorageCorruptError``: known tags with their arity and value types (``bool`` is not an
    ``int``; inline ints below ``_bounded.INLINE_INT_BOUND``), finite or infinite hexadecimal floats,
    dict keys of one length with their children, treetensor trees holding only arrays of their kind
    and subtrees of their own, at most ``MAX_TREE_DEPTH`` containers deep, and array leaves numbered
    0, 1, 2... in depth-first order, each array used exactly once. What passes builds."""
    leaves = 0
    stack: list = [(spec, 0, None)]
    pop, push = stack.pop, stack.append
    while stack:
        node, depth, tree = pop()  # tree: the tag of the treetensor tree holding this node, if any
        if type(node) is not list or not node:
            raise _bad_node(path, depth, "is not a non-empty list")
        tag = node[0]
        if tag == ARRAY:
            if len(node) != 2 or type(node[1]) is not int or node[1] != leaves:
                raise _bad_node(path, depth, f"is not array leaf {leaves} (leaves are numbered in depth-first order)")
            if tree is not None and arrays[leaves].kind != _TREE_LEAF_KIND[tree]:
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
                keyed_by_int = tag == "d" or tag == "od"
                for k in node[1]:
                    if type(k) is not str and not (
                        keyed_by_int and type(k) is list and len(k) == 2 and k[0] == "int" and _is_inline_int(k[1])
                    ):
                        raise _bad_node(path, depth, "has a key that is neither a string nor an int")
                children = node[2]
            inner = tag if tag in _TREE_LEAF_KIND else None
            for child in reversed(children):
                push((child, depth + 1, inner))
            continue
        if _NODE_LEN.get(tag) != len(node):
            raise _bad_node(path, depth, "has an unknown tag, or the wrong number of fields for its tag")
        if tag == "n":
            continue
        value = node[1]
        if tag == "f" or tag == "c":
            for v in node[1:]:
                if not _is_hex_float(v):
                    raise _bad_node(path, depth, "holds a float that is not a finite or infinite double in hex")
        elif (
            (tag == "b" and type(value) is not bool)
            or (tag == "i" and not _is_inline_int(value))
            or (tag == "s" and type(value) is not str)
        ):
            raise _bad_node(path, depth, "holds a value of the wrong type for its tag")
    if leaves != len(arrays):
        raise corrupt(path, f"its tree uses {leaves} arrays but its header lists {len(arrays)}")


def _is_inline_int(v) -> bool:
    return type(v) is int and -_bounded.INLINE_INT_BOUND < v < _bounded.INLINE_INT_BOUND


def _is_hex_float(v) -> bool:
    if type(v) is not str or len(v) > 32:
        return False
    try:
        float.fromhex(v)
    except (ValueError, OverflowError):
        return False
    return True


def _bad_node(path: str, depth: int, why: str) -> StorageCorruptError:
    return corrupt(path, f"a node of its tree {depth} levels down {why}")
