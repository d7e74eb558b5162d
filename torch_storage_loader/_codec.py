"""Storage handles as small JSON records, for queues that cross the network (never pickles).

A record is ``{"type": "FileStorage", "fields": {...}}``: the name of an allow-listed ``Storage``
class and the handle's attributes (JSON values only). ``FileStorage`` and ``ObjectStorage`` are allowed by default; users
allow their own classes with ``register_storage_type(cls)`` (also usable as a class decorator) in
every process that puts or gets them. Anything else is refused on both ends.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from . import _objects
from .errors import HandleRecordError, UnregisteredStorageTypeError
from .storage import FileStorage, ObjectStorage, Storage

__all__ = ["decode", "encode", "register_storage_type", "registered_storage_types"]

MAX_RECORD_BYTES = 64 * 1024  # a handle is a path and a few options; anything larger is not one

_lock = threading.Lock()
_REGISTRY: dict[str, type[Storage]] = {"FileStorage": FileStorage, "ObjectStorage": ObjectStorage}
_JSON_SCALARS = (str, int, float, bool, type(None))


def _type_name(cls: type) -> str:
    return cls.__name__ if cls in (FileStorage, ObjectStorage) else f"{cls.__module__}.{cls.__qualname__}"


def register_storage_type(cls: type[Storage]) -> type[Storage]:
    """Allow handles of ``cls`` (a ``Storage`` subclass) through network queues; returns ``cls``.

    Call it (or use it as a class decorator) in every producer and consumer process. The handle's
    attributes must be JSON values (str, numbers, bool, None, lists and dicts of them).
    """
    if not (isinstance(cls, type) and issubclass(cls, Storage)):
        raise TypeError(f"register_storage_type() takes a Storage subclass, got {cls!r}")
    with _lock:
        _REGISTRY[_type_name(cls)] = cls
    return cls


def registered_storage_types() -> list[str]:
    with _lock:
        return sorted(_REGISTRY)


def _unregistered(name: str, where: str) -> UnregisteredStorageTypeError:
    return UnregisteredStorageTypeError(
        f"{where} names Storage type {name!r}, which is not registered: handles cross the network as "
        f"JSON records of allow-listed Storage classes only (registered: {', '.join(registered_storage_types())}). "
        f"If the class is yours, call torch_storage_loader.register_storage_type(cls) in every process that "
        f"puts or gets it; otherwise something else writes into this stream", type_name=name)


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
                raise HandleRecordError(f"{where} has a non-string key {k!r}")
            _check_json(v, f"{where}[{k!r}]", depth + 1)
        return
    raise HandleRecordError(f"{where} is a {type(value).__name__}: handle fields must be JSON values")


def encode(storage: Storage) -> str:
    """The JSON record of ``storage``; refuses unregistered types and non-JSON fields."""
    cls = type(storage)
    name = _type_name(cls)
    with _lock:
        known = _REGISTRY.get(name) is cls
    if not known:
        raise _unregistered(name if isinstance(storage, Storage) else f"{cls.__module__}.{cls.__qualname__}",
                            "the handle")
    fields = dict(vars(storage))
    for key, value in fields.items():
        try:
            _check_json(value, f"{cls.__name__}.{key}")
        except HandleRecordError as exc:
            raise HandleRecordError(f"cannot send {cls.__name__} across the network: {exc}") from None
    return json.dumps({"type": name, "fields": fields}, separators=(",", ":"), allow_nan=False)


def decode(raw: bytes | str, *, allow_pickle: bool = False) -> Storage:
    """The handle a record describes. Never unpickles; refuses unknown types and malformed records.

    A record that asks for ``allow_pickle=True`` is refused unless ``allow_pickle`` is passed here:
    a remote producer must not be able to make this process unpickle file contents.
    """
    if isinstance(raw, str):
        raw = raw.encode()
    if not isinstance(raw, (bytes, bytearray)):
        raise HandleRecordError(f"a handle record must be bytes or str, got {type(raw).__name__}")
    if len(raw) > MAX_RECORD_BYTES:
        raise HandleRecordError(f"a handle record of {len(raw)} bytes is over {MAX_RECORD_BYTES}: not a handle")
    try:
        record = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise HandleRecordError(f"not a JSON handle record (starts with {bytes(raw[:16])!r}); handles are "
                                "put by RedisStorageQueue.put, never as pickles") from None
    if not (isinstance(record, dict) and set(record) == {"type", "fields"} and isinstance(record["type"], str)
            and isinstance(record["fields"], dict)):
        raise HandleRecordError('a handle record must be {"type": name, "fields": {...}}, got '
                                f"{str(record)[:200]}")
    name, fields = record["type"], record["fields"]
    with _lock:
        cls = _REGISTRY.get(name)
    if cls is None:
        raise _unregistered(name, "a record")
    for key, value in fields.items():
        if key.startswith("__") or callable(getattr(cls, key, None)):
            raise HandleRecordError(f"a {name} record sets {key!r}, which is not a data field of {name}")
        _check_json(value, f"{name}.{key}")
    if fields.get("allow_pickle") is True and not allow_pickle:
        raise HandleRecordError(f"a {name} record asks for allow_pickle=True; refused, since the file it "
                                "names would be unpickled. Pass allow_pickle=True to the queue if every producer "
                                "is trusted")
    if cls in (FileStorage, ObjectStorage) and not isinstance(fields.get("path"), str):
        raise HandleRecordError(f"a {name} record needs a string 'path', got {fields.get('path')!r}")
    if cls is ObjectStorage and not (_objects.is_url(fields["path"]) and _objects.known_store(fields["path"])):
        raise HandleRecordError(f"an ObjectStorage record names {fields['path']!r}, which is not on an object store "
                                "(s3://, gs://, az://) nor one configured with configure_object_store(url); refused")
    storage = cls.__new__(cls)
    storage.__dict__.update(fields)
    return storage
