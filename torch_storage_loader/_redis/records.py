"""Storage handles as small JSON records, the entries of a Redis stream (never pickles): the record
``put`` appends, and what a consumer makes of each entry it reads.

A record is ``{"type": "FileStorage", "fields": {...}}``: the name of an allow-listed ``Storage``
class and the handle's attributes (JSON values only). ``FileStorage`` and ``ObjectStorage`` are allowed by default; users
allow their own classes with ``register_storage_type(cls)`` (also usable as a class decorator) in
every process that puts or gets them. Anything else is refused on both ends.

Decoding treats a record as data from an untrusted writer: the read scripts refuse, in Redis, an entry
that is not one ``h`` field of at most ``RECORD_MAX_BYTES``; a record's size and nesting are bounded
before it is parsed (``_bounded``), ``FileStorage`` and ``ObjectStorage`` records must match their
exact schema (types, not truthiness: ``allow_pickle`` is a JSON boolean, and ``true`` is refused
unless the consumer allows pickle), and the path or URL they name must lie under the consumer's
trusted roots (``_trust``). Any failure is a ``StorageError`` naming what was wrong, never quoting
the record; ``decode_entries`` returns it in the entry's place (the consumer acknowledges and counts it).
"""

from __future__ import annotations

import json
from typing import Any

from .._proc import fork_safe_lock
from .._untrusted import bounded as _bounded
from .._untrusted import trust as _trust
from ..errors import HandleRecordError, StorageError
from ..storage import FileStorage, ObjectStorage, Storage
from .keys import FIELD, REFUSED, decode_id

__all__ = ["decode", "decode_entries", "encode", "register_storage_type", "registered_storage_types"]


_lock = fork_safe_lock()
_REGISTRY: dict[str, type[Storage]] = {"FileStorage": FileStorage, "ObjectStorage": ObjectStorage}
_JSON_SCALARS = (str, int, float, bool, type(None))
# The exact fields of the built-in handles: name -> (allowed types, required).
_SCHEMAS: dict[type, dict[str, tuple[tuple[type, ...], bool]]] = {
    FileStorage: {"path": ((str,), True), "allow_pickle": ((bool,), False)},
    ObjectStorage: {
        "path": ((str,), True),
        "size": ((int, type(None)), False),
        "version": ((str, type(None)), False),
        "allow_pickle": ((bool,), False),
    },
}
MAX_VERSION_CHARS = 1024


def _show(name: str) -> str:
    """A name from a record, fit for a message: repr'd (escapes control characters) and short."""
    return repr(name if len(name) <= 60 else name[:60] + "...")


def _type_name(cls: type) -> str:
    return cls.__name__ if cls in (FileStorage, ObjectStorage) else f"{cls.__module__}.{cls.__qualname__}"


def register_storage_type(cls: type[Storage]) -> type[Storage]:
    """Allow handles of ``cls`` (a ``Storage`` subclass) through network queues; returns ``cls``.

    Call it (or use it as a class decorator) in every producer and consumer process. The handle's
    attributes must be JSON values (str, numbers, bool, None, lists and dicts of them).

    Args:
        cls: The ``Storage`` subclass to allow.

    Returns:
        ``cls`` itself, so the function works as a decorator.

    Raises:
        TypeError: ``cls`` is not a ``Storage`` subclass.

    Examples:
        >>> from torch_storage_loader import FileStorage, register_storage_type
        >>> @register_storage_type
        ... class MyStorage(FileStorage):
        ...     pass
    """
    if not (isinstance(cls, type) and issubclass(cls, Storage)):
        raise TypeError(f"register_storage_type() takes a Storage subclass, got {cls!r}")
    with _lock:
        _REGISTRY[_type_name(cls)] = cls
    return cls


def registered_storage_types() -> list[str]:
    with _lock:
        return sorted(_REGISTRY)


def _unregistered(name: str, where: str) -> HandleRecordError:
    return HandleRecordError(
        f"{where} names Storage type {name!r}, which is not registered: handles cross the network as "
        f"JSON records of allow-listed Storage classes only (registered: {', '.join(registered_storage_types())}). "
        f"If the class is yours, call torch_storage_loader.register_storage_type(cls) in every process that "
        f"puts or gets it; otherwise something else writes into this stream",
        type_name=name,
    )


def _check_json(value: Any, where: str, depth: int = 0) -> None:
    if depth > 8:
        raise HandleRecordError(f"{where} is nested too deeply for a handle field")
    if isinstance(value, _JSON_SCALARS):
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_json(v, f"{where}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise HandleRecordError(f"{where} has a non-string key of type {type(k).__name__}")
            _check_json(v, f"{where}[{_show(k)}]" if len(where) < 200 else where, depth + 1)
        return
    raise HandleRecordError(f"{where} is a {type(value).__name__}: handle fields must be JSON values")


def encode(storage: Storage) -> str:
    """The record ``put`` appends for ``storage``: ``TypeError`` for anything but a ``Storage`` handle; refuses
    unregistered types and non-JSON fields."""
    if not isinstance(storage, Storage):
        raise TypeError(f"RedisStorageQueue holds Storage handles, got {type(storage).__name__}")
    cls = type(storage)
    name = _type_name(cls)
    with _lock:
        known = _REGISTRY.get(name) is cls
    if not known:
        raise _unregistered(name, "the handle")
    fields = dict(vars(storage))
    for key, value in fields.items():
        try:
            _check_json(value, f"{cls.__name__}.{key}")
        except HandleRecordError as exc:
            raise HandleRecordError(f"cannot send {cls.__name__} across the network: {exc}") from None
    return json.dumps({"type": name, "fields": fields}, separators=(",", ":"), allow_nan=False)


def decode(raw: bytes | str, *, allow_pickle: bool = False, trusted_roots: _trust.Roots | None = None) -> Storage:
    """The handle a record describes. Never unpickles; refuses unknown types, malformed records and
    handles outside ``trusted_roots`` (None: none trusted, so every file and object handle is refused).

    A record that asks for ``allow_pickle=True`` is refused unless ``allow_pickle`` is passed here:
    a remote producer must not be able to make this process unpickle file contents.
    """
    if isinstance(raw, str):
        raw = raw.encode()
    if not isinstance(raw, (bytes, bytearray)):
        raise HandleRecordError(f"a handle record must be bytes or str, got {type(raw).__name__}")
    try:
        record = _bounded.loads(
            raw,
            max_bytes=_bounded.RECORD_MAX_BYTES,
            max_depth=_bounded.RECORD_MAX_DEPTH,
            max_values=_bounded.RECORD_MAX_VALUES,
        )
    except ValueError as exc:
        raise HandleRecordError(
            f"not a JSON handle record ({exc}); handles are put by RedisStorageQueue.put, never as pickles"
        ) from None
    if not (
        type(record) is dict
        and len(record) == 2
        and type(record.get("type")) is str
        and type(record.get("fields")) is dict
    ):
        raise HandleRecordError('a handle record must be {"type": name, "fields": {...}}')
    name, fields = record["type"], record["fields"]
    with _lock:
        cls = _REGISTRY.get(name)
    if cls is None:
        raise _unregistered(_show(name)[1:-1], "a record")
    schema = _SCHEMAS.get(cls)
    if schema is not None:
        _check_schema(name, fields, schema)
    else:
        for key, value in fields.items():
            if key.startswith("__") or callable(getattr(cls, key, None)):
                raise HandleRecordError(f"a {name} record sets {_show(key)}, which is not a data field of {name}")
            _check_json(value, f"{name}.{_show(key)[1:-1]}")
        if "allow_pickle" in fields and type(fields["allow_pickle"]) is not bool:
            raise HandleRecordError(
                f"a {name} record sets allow_pickle to a {type(fields['allow_pickle']).__name__}, "
                "not a JSON boolean; refused"
            )
    if fields.get("allow_pickle") is True and not allow_pickle:
        raise HandleRecordError(
            f"a {name} record asks for allow_pickle=True; refused, since the file it "
            "names would be unpickled. Pass allow_pickle=True to the queue if every producer "
            "is trusted"
        )
    _confine(cls, name, fields, trusted_roots if trusted_roots is not None else _trust.Roots())
    storage = cls.__new__(cls)
    if cls is FileStorage:
        storage.__dict__.update({"path": fields["path"], "allow_pickle": fields.get("allow_pickle", False)})
    elif cls is ObjectStorage:
        storage.__dict__.update(
            {
                "path": fields["path"],
                "size": fields.get("size"),
                "version": fields.get("version"),
                "allow_pickle": fields.get("allow_pickle", False),
            }
        )
    else:
        storage.__dict__.update(fields)
    return storage


def _confine(cls: type, name: str, fields: dict[str, Any], roots: _trust.Roots) -> None:
    """The roots check, by what is loaded rather than by class: any file or object handle (a
    registered subclass too, which keeps the library's own load path) names a path under ``roots``."""
    if not issubclass(cls, (FileStorage, ObjectStorage)):
        return  # the class loads its own bytes: what it reads is its author's to confine
    path = fields.get("path")
    if type(path) is not str or not path or len(path) > _trust.MAX_PATH_CHARS or "\x00" in path:
        raise HandleRecordError(
            f"a {name} record's path is missing, not a string, empty, over {_trust.MAX_PATH_CHARS} "
            "characters, or holds a NUL"
        )
    if issubclass(cls, FileStorage):
        _trust.check_file(path, roots)
    else:
        _trust.check_object(path, roots)


def _check_schema(name: str, fields: dict[str, Any], schema: dict[str, tuple[tuple[type, ...], bool]]) -> None:
    for key, value in fields.items():
        spec = schema.get(key)
        if spec is None:
            raise HandleRecordError(
                f"a {name} record sets {_show(key)}, which is not a field of {name} (its fields: {', '.join(schema)})"
            )
        if type(value) not in spec[0]:
            want = " or ".join("null" if t is type(None) else t.__name__ for t in spec[0])
            raise HandleRecordError(
                f"a {name} record sets {key} to a {type(value).__name__}, not a {want}; "
                "refused (records are checked by type, not by truth)"
            )
    for key, (_, required) in schema.items():
        if required and key not in fields:
            raise HandleRecordError(f"a {name} record has no {key!r}")
    path = fields["path"]
    if not path or len(path) > _trust.MAX_PATH_CHARS or "\x00" in path:
        raise HandleRecordError(
            f"a {name} record's path is empty, over {_trust.MAX_PATH_CHARS} characters, or holds a NUL"
        )
    size = fields.get("size")
    if size is not None and not 0 <= size < 1 << 63:
        raise HandleRecordError(f"a {name} record's size is not in [0, 2**63)")
    version = fields.get("version")
    if version is not None and len(version) > MAX_VERSION_CHARS:
        raise HandleRecordError(f"a {name} record's version is over {MAX_VERSION_CHARS} characters")


def decode_entries(
    entries: list[Any], stream: str, *, allow_pickle: bool, roots: _trust.Roots
) -> list[tuple[str, Any]]:
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
            item: Any = decode(raw, allow_pickle=allow_pickle, trusted_roots=roots)
        except StorageError as exc:
            item = exc
        except Exception as exc:  # noqa: BLE001 - whatever a record provokes, it is refused, never raised
            item = HandleRecordError(f"stream entry {token} could not be decoded ({type(exc).__name__}); refused")
        out.append((token, item))
    return out
