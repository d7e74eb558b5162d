"""Looking at and removing a whole stream: the group's counts, and deleting exactly the stream's keys."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from .._optional import require
from .client import Client
from .keys import COUNTERS, decode_id, legacy_keys, stream_keys

if TYPE_CHECKING:
    import redis
else:
    redis = require("redis", "redis", "RedisStorageQueue")

__all__ = ["delete", "stats"]


def stats(client: Client) -> dict[str, int]:
    """The counters of the queue's group (see ``RedisStorageQueue.stats``)."""
    stream, group = client.keys.stream, client.options.group
    fields = [f"{group}:{name}" for name in COUNTERS]

    def look(c: Any) -> list[Any]:
        pipe = c.pipeline(transaction=False)
        pipe.hmget(client.keys.stats, fields)
        pipe.xlen(stream)
        pipe.xinfo_groups(stream)
        return list(pipe.execute())

    counts, length, groups = client.call(look, "read stats")
    out = {name: int(v or 0) for name, v in zip(COUNTERS, counts, strict=False)}
    mine: dict[str, Any] = next((g for g in groups if decode_id(g["name"]) == group), {})
    out["length"] = int(length)
    out["pending"] = int(mine.get("pending", 0))
    lag = mine.get("lag")
    out["undelivered"] = int(lag) if lag is not None else 0
    return out


def delete(client: Client) -> None:
    """Delete the stream and exactly its keys, those of version 0.1's layout included (by name, never by pattern)."""
    stream = client.keys.stream

    def drop(c: Any) -> None:
        closed, producers = legacy_keys(stream)
        groups = {client.options.group}
        with contextlib.suppress(redis.ResponseError):  # no stream (any more), or not a stream
            groups |= {decode_id(g["name"]) for g in c.xinfo_groups(stream)}
        legacy = [closed, producers, *(f"tsl:{stream}:{g}:{kind}" for g in groups for kind in ("stats", "dups"))]
        with contextlib.suppress(redis.ResponseError):
            legacy += [f"tsl:{stream}:hb:{decode_id(p)}" for p in c.hkeys(producers)]
        for key in legacy:  # one by one: in a cluster they live in different slots
            c.delete(key)
        c.delete(*stream_keys(stream))  # one slot

    client.call(drop, "delete the stream", ensure=False)
    client.forget_stream()
