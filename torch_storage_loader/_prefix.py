"""``DirectorySource`` on an object-store prefix: objects claimed by conditional creation.

An object store has no atomic rename, so a consumer claims ``NAME`` by creating the object
``NAME.claim`` only if no object has that name (a conditional PUT, ``If-None-Match: *``): exactly
one consumer succeeds. The claim's body names its trainer (host, family, pid). Delivery deletes
``NAME`` and then its claim; giving back deletes the claim; a failed load adds ``NAME.failed``
(``NAME.loaded`` with ``delete_after_load=False``), and such objects are never claimed again.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from typing import Iterator

from . import _objects
from ._proc import trainer_alive
from .errors import StorageNotFoundError
from .file_loader import SUFFIX
from .storage import ObjectStorage, Storage

__all__ = ["PrefixSource"]

CLAIM, FAILED, LOADED = ".claim", ".failed", ".loaded"


class PrefixSource:
    """Objects a ``FileStorageLoader("s3://bucket/prefix")`` publishes, as they land (see the module).

    Consumers stop once ``end_directory_stream(prefix)`` was called and no object is unclaimed or
    claimed by another live trainer. Claims of a trainer that died on this host are deleted (so
    given back) by the next consumer that runs out of objects; those of a trainer that died on
    another host stay until deleted by hand (``NAME.claim``).
    """

    finite = False
    keep_alive_every = None
    ack_in_background = True  # two requests per delivered sample: off the trainer's thread

    def __init__(self, url: str, *, delete_after_load: bool = True, poll_interval: float = 0.2) -> None:
        if poll_interval <= 0:
            raise ValueError(f"{poll_interval=} must be > 0")
        self.path = url.rstrip("/")
        self.delete_after_load = delete_after_load
        self.poll_interval = poll_interval

    def iterate(self, shard: int, num_shards: int, skip: int = 0, *, family: str = "") -> Iterator[tuple[str, Storage]]:
        from ._sources import END_OF_STREAM

        host = socket.gethostname()
        family = family or str(os.getpid())
        owner = {"host": host, "family": family, "pid": os.getpid()}
        owners: dict[tuple, dict] = {}  # (claim URL, version) -> its body: each claim is read once
        while True:
            entries = {e.url.rsplit("/", 1)[-1]: e for e in _objects.listing(self.path)}
            ended = END_OF_STREAM in entries
            unclaimed = [e for name, e in sorted(entries.items()) if name.endswith(SUFFIX)
                         and not any(name + m in entries for m in (CLAIM, FAILED, LOADED))]
            if not unclaimed:
                claims = self._claims(entries, owners)
                if self._reclaim_dead(claims, host):
                    continue
                if ended and any(c.get("family") != family and (c.get("host") != host or _alive(c))
                                 for c in claims.values()):
                    ended = False
                if ended:
                    return
                time.sleep(self.poll_interval)
                continue
            start = shard * len(unclaimed) // max(1, num_shards)  # consumers start apart: fewer lost races
            for entry in unclaimed[start:] + unclaimed[:start]:
                body = json.dumps({**owner, "nonce": secrets.token_hex(8)}).encode()
                if not _objects.create_if_absent(entry.url + CLAIM, body):
                    continue  # another consumer won it
                if not _objects.exists(entry.url) or any(_objects.exists(entry.url + m) for m in (FAILED, LOADED)):
                    _objects.remove(entry.url + CLAIM)  # settled by another consumer since our listing
                    continue
                yield entry.url, ObjectStorage(entry.url, size=entry.size, version=entry.version)

    def _claims(self, entries: dict, owners: dict[tuple, dict]) -> dict[str, dict]:
        """The owners of the claims among ``entries``, by claim URL (claims that vanish are skipped);
        ``owners`` caches the bodies read before."""
        out, seen = {}, set()
        for name, entry in entries.items():
            if name.endswith(CLAIM) and name[: -len(CLAIM)] in entries:
                key = (entry.url, entry.version, entry.mtime)
                seen.add(key)
                if key not in owners:
                    try:
                        owners[key] = json.loads(_objects.read_all(entry.url))
                    except (ValueError, StorageNotFoundError):
                        continue
                out[entry.url] = owners[key]
        for key in set(owners) - seen:
            del owners[key]
        return out

    def _reclaim_dead(self, claims: dict[str, dict], host: str) -> int:
        n = 0
        for url, owner in claims.items():
            if owner.get("host") == host and not _alive(owner):
                n += _objects.remove(url)
        return n

    def ack(self, tokens: list) -> None:
        for url in tokens:
            if self.delete_after_load:
                _objects.remove(url)
            else:
                _objects.put(url + LOADED, [b""])
            _objects.remove(url + CLAIM)

    def fail(self, tokens: list) -> None:
        for url in tokens:
            _objects.put(url + FAILED, [b""])
            _objects.remove(url + CLAIM)

    def give_back(self, tokens: list) -> None:
        for url in tokens:
            _objects.remove(url + CLAIM)


def _alive(owner: dict) -> bool:
    return trainer_alive(str(owner.get("family", "")), int(owner.get("pid", 0)))
