"""The keys of one stream, the one field of its entries, and the names of its consumers.

Key layout (one stream NAME): the stream is the key NAME itself; everything else is under
tsl:{NAME}:..., a fixed set of keys whose hash tag {NAME} puts them in the stream's Redis Cluster
slot, so every script and multi-key command stays on one node (streams spread over masters by
name). ``meta`` holds the stream's epoch (a random identity made with the stream: a process that
knew it and finds it gone or changed knows the stream was lost) and ``closed``; ``producers`` and
``heartbeats`` (deadlines by the server's clock) the registered producers; ``stats`` and ``dups``
every group's counters and duplicate ids, as "GROUP:counter" and "GROUP:id".
"""

from __future__ import annotations

import os
import secrets
import socket
from typing import Any, NamedTuple

__all__ = [
    "COUNTERS",
    "FIELD",
    "LAYOUT",
    "REFUSED",
    "SUFFIXES",
    "TRAINER_SUFFIX",
    "Keys",
    "decode_id",
    "family",
    "legacy_keys",
    "new_name",
    "stream_keys",
]

FIELD = "h"  # the one field of a stream entry: the handle's JSON record
REFUSED = "!"  # the field a read script puts in place of an entry it refused, with why
LAYOUT = "2"  # the key layout, kept in the stream's meta hash
TRAINER_SUFFIX = "/trainer"  # the consumer a trainer's ledger keeps its delivered entries under
SUFFIXES = ("meta", "producers", "heartbeats", "stats", "dups")
COUNTERS = ("delivered", "claimed", "acked", "duplicates", "failed", "refused", "lost", "returned")


def stream_keys(stream: str) -> tuple[str, ...]:
    """Every key of stream ``stream``: the stream itself, then ``tsl:{stream}:SUFFIX`` for each of SUFFIXES."""
    return (stream, *(f"tsl:{{{stream}}}:{suffix}" for suffix in SUFFIXES))


class Keys(NamedTuple):
    """The keys of one stream, by role (see the module)."""

    stream: str
    meta: str
    producers: str
    heartbeats: str
    stats: str
    dups: str

    @classmethod
    def of(cls, stream: str) -> Keys:
        return cls(*stream_keys(stream))

    def counted(self) -> list[str]:
        """KEYS of the scripts that deliver and settle entries: stream, meta, stats, dups."""
        return [self.stream, self.meta, self.stats, self.dups]


def legacy_keys(stream: str) -> tuple[str, str]:
    """The fixed keys of version 0.1's layout: ``tsl:NAME:closed``, ``tsl:NAME:producers``."""
    return f"tsl:{stream}:closed", f"tsl:{stream}:producers"


def decode_id(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def new_name() -> str:
    """A consumer's or producer's default name: ``host-pid-tag``."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def family(trainer: str) -> str:
    """Consumers named ``HOST-TRAINER/...`` read for one trainer process."""
    return f"{socket.gethostname()}-{trainer}"
