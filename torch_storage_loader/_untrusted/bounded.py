"""Bounds on what another process or machine can make a consumer parse, checked before parsing.

Headers, handle records and claim bodies are JSON written by someone else. Before any of them
reaches ``json.loads`` (whose C scanner recurses once per nesting level and raises
``RecursionError`` a thousand levels down, and which builds a Python object of some 50 bytes for
every value however small its text), ``loads`` measures the text with a few C-speed passes: its
size, how deeply it nests and how many values it holds. Whatever is over a bound is refused at
the cost of reading it, never of parsing it. Numbers are bounded too (no 4000-digit integers, no
``NaN``), duplicate keys are refused, and error messages say what was wrong and where, never what
the text said.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from typing import Any

import numpy as np

__all__ = [
    "CLAIM_MAX_BYTES",
    "HEADER_MAX_BYTES",
    "HEADER_MAX_DEPTH",
    "HEADER_MAX_VALUES",
    "MAX_TREE_DEPTH",
    "RECORD_MAX_BYTES",
    "loads",
    "log_refused",
    "measure",
]

# A sample nests at most this many containers deep (dicts, lists, tuples, trees), as saved and loaded.
MAX_TREE_DEPTH = 100
# A file's JSON header (its tree and one entry per array): at most 16 MiB of text (long inline
# strings cost about their size to parse) and 2**18 values, about 17,000 arrays (each array costs
# about 15 values; an inline scalar 3): what the largest real trees need. Parsing one costs at most
# some 30 MB, once, in the worker that reads it.
HEADER_MAX_BYTES = 16 << 20
HEADER_MAX_VALUES = 1 << 18
HEADER_MAX_DEPTH = 2 * MAX_TREE_DEPTH + 8  # a tree level is two JSON levels (the node, its children)
# A handle record is a path and a few options.
RECORD_MAX_BYTES = 64 << 10
RECORD_MAX_DEPTH = 16
RECORD_MAX_VALUES = 4096
# A claim body names its trainer: host, family, pid and a nonce.
CLAIM_MAX_BYTES = 4096
CLAIM_MAX_DEPTH = 2
CLAIM_MAX_VALUES = 64

MAX_NUMBER_CHARS = 32  # the longest integer or float literal accepted (int64 has 20 characters)
INLINE_INT_BOUND = 10**30  # a sample's inline ints and int dict keys are smaller than this in magnitude

_BACKSLASH = re.compile(rb"\\")


_CHUNK = 256 << 10  # measure() scans this many bytes at a time: its memory stays a few MiB, whatever the text
_SMALL = 16 << 10  # below this, regular expressions and a short loop beat numpy's fixed costs
_STRING = re.compile(rb'"[^"]*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _measure_small(s: bytes | bytearray | memoryview) -> tuple[int, int]:
    """``measure`` for short texts without escapes: strings blanked out, then brackets counted."""
    s = _STRING.sub(b"0", s)
    values = s.count(b",") + s.count(b":") + s.count(b"[") + s.count(b"{") + 1
    depth = top = 0
    for b in s.translate(None, _NOT_BRACKETS):
        depth += 1 if b in (0x5B, 0x7B) else -1
        if depth > top:
            top = depth
    return top, values


def measure(raw: bytes | bytearray | memoryview, max_values: int | None = None) -> tuple[int, int]:
    """(nesting depth, number of values) of JSON text (bytes or a memoryview), without parsing it.

    Exact for valid JSON. For invalid text it may overestimate, never underestimate, the part a
    parser would get through before failing: escaped backslashes and quotes are dropped first (so
    quotes pair as a parser pairs them), then a byte counts only outside strings (the parity of the
    quotes before it). Values: containers, commas and colons (one more value each: an element, a
    member's key), plus one. Over ``max_values``, the depth is not measured (returned as 0).
    Vectorized, in chunks of ``_CHUNK`` bytes.
    """
    s = raw
    if _BACKSLASH.search(s):
        s = bytes(s).replace(b"\\\\", b"").replace(b'\\"', b"")
    if len(s) <= _SMALL:
        return _measure_small(s)
    data = np.frombuffer(s, np.uint8)
    inside = False  # in a string at the start of the chunk
    depth = top = values = 0
    for start in range(0, len(data), _CHUNK):
        a = data[start : start + _CHUNK]
        quote = a == 0x22
        parity = np.cumsum(quote, dtype=np.int32) & 1  # odd: after an opening quote of this chunk
        outside = (parity == 1) if inside else (parity == 0)
        outside &= ~quote
        opening = ((a == 0x5B) | (a == 0x7B)) & outside
        closing = ((a == 0x5D) | (a == 0x7D)) & outside
        values += int(np.count_nonzero(((a == 0x2C) | (a == 0x3A)) & outside)) + int(np.count_nonzero(opening))
        if max_values is not None and values >= max_values:
            return 0, values + 1
        steps = opening.view(np.int8) - closing.view(np.int8)
        running = np.cumsum(steps, dtype=np.int32)
        if len(running):
            top = max(top, depth + int(running.max()))
            depth += int(running[-1])
        inside = inside != bool(np.count_nonzero(quote) & 1)
    return top, values + 1


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _int(text: str) -> int:
    if len(text) > MAX_NUMBER_CHARS:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def _float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS:
        raise ValueError(f"a number of {len(text)} characters")
    return float(text)


def _no_float(text: str) -> float:
    raise ValueError("a floating-point number where none belongs")


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("an object with a duplicate key")
    return out


# Integers: Python (3.10.7 and later) refuses over 4300 digits in C, cheaply; callers check ranges.
# Where it does not, a hook bounds them (slower: a Python call per integer).
_INT = None if hasattr(sys, "get_int_max_str_digits") else _int
_DECODERS = {
    floats: json.JSONDecoder(
        parse_int=_INT,
        parse_float=_float if floats else _no_float,
        parse_constant=_no_constant,
        object_pairs_hook=_pairs,
    )
    for floats in (False, True)
}


def loads(
    raw: bytes | bytearray | memoryview, *, max_bytes: int, max_depth: int, max_values: int, floats: bool = True
) -> Any:
    """Parse UTF-8 JSON within bounds; ``ValueError`` says which bound or rule it broke (never the text)."""
    if len(raw) > max_bytes:
        raise ValueError(f"{len(raw)} bytes, over the {max_bytes} accepted")
    depth, values = measure(raw, max_values)
    if values > max_values:
        raise ValueError(f"{values} values, over the {max_values} accepted")
    if depth > max_depth:
        raise ValueError(f"nested {depth} levels deep, over the {max_depth} accepted")
    try:
        text = str(raw, "utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 (at byte {exc.start})") from None
    try:
        return _DECODERS[floats].decode(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at character {exc.pos})") from None
    except RecursionError:  # a thread already deep in its stack: refuse rather than fail
        raise ValueError("nested too deeply for this thread's stack") from None


_refusals = 0


def log_refused(logger: logging.Logger, msg: str, *args: Any) -> None:
    """Log something refused: the first ten in this process, then one in a thousand, with the count
    (a flood of bad input must not flood the logs; the sources count every one)."""
    global _refusals
    _refusals += 1
    if _refusals <= 10 or _refusals % 1000 == 0:
        logger.warning(msg + " (%d refused so far in this process)", *args, _refusals)
