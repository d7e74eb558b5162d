"""Stream entries as handles: the record ``put`` appends, and what a consumer makes of what it reads.

Whoever can write to the stream is not trusted: the read scripts refuse an entry that is not one
``h`` field of at most ``RECORD_MAX_BYTES`` in Redis, and ``decode`` turns each entry into a handle
or the ``StorageError`` that refuses it (never raised here: the consumer acknowledges and counts it).
"""

from __future__ import annotations

from typing import Any

from .._format import codec as _codec
from .._format import trust as _trust
from ..errors import HandleRecordError, StorageError
from ..storage import Storage
from .keys import FIELD, REFUSED, decode_id

__all__ = ["decode", "encode"]


def encode(storage: Storage) -> str:
    """The record ``put`` appends for ``storage``; ``TypeError`` for anything but a ``Storage`` handle."""
    if not isinstance(storage, Storage):
        raise TypeError(f"RedisStorageQueue holds Storage handles, got {type(storage).__name__}")
    return _codec.encode(storage)


def decode(entries: list[Any], stream: str, *, allow_pickle: bool, roots: _trust.Roots) -> list[tuple[str, Any]]:
    """``(token, handle or the StorageError refusing it)`` for each entry still in the stream."""
    out: list[tuple[str, Any]] = []
    for entry_id, fields in entries:
        token = decode_id(entry_id)
        if fields is None:  # deleted while pending
            continue
        if isinstance(fields, list):  # a script's reply: [field, value, ...]
            fields = dict(zip(fields[::2], fields[1::2], strict=False))
        try:
            why = fields.get(REFUSED.encode()) if len(fields) == 1 else None
            if why is not None:  # refused by the read script, in Redis
                raise HandleRecordError(
                    f"stream entry {token} {decode_id(why)}: not an entry RedisStorageQueue.put writes into "
                    f"stream {stream!r}; refused without reading it"
                )
            raw = fields.get(FIELD.encode())
            if raw is None or len(fields) != 1:
                raise HandleRecordError(
                    f"stream entry {token} has {len(fields)} fields, not one {FIELD!r} field holding a handle "
                    f"record: something other than RedisStorageQueue.put writes into stream {stream!r}"
                )
            item: Any = _codec.decode(raw, allow_pickle=allow_pickle, trusted_roots=roots)
        except StorageError as exc:
            item = exc
        except Exception as exc:  # noqa: BLE001 - whatever a record provokes, it is refused, never raised
            item = HandleRecordError(f"stream entry {token} could not be decoded ({type(exc).__name__}); refused")
        out.append((token, item))
    return out
