"""``DirectorySource`` on an object-store prefix: objects claimed by conditional creation.

An object store has no atomic rename, so a consumer claims ``NAME`` by creating the object
``NAME.claim`` only if no object has that name (a conditional PUT, ``If-None-Match: *``): exactly
one consumer succeeds. The claim's body names its trainer (host, family, pid). Delivery deletes
``NAME`` and then its claim; giving back deletes the claim; a failed load adds ``NAME.failed``
(``NAME.loaded`` with ``delete_after_load=False``), and such objects are never claimed again.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
from typing import Iterator

from . import _limits, _objects
from ._proc import PID_MAX, parse_pid, trainer_alive
from .errors import StorageNotFoundError
from .file_loader import SUFFIX
from .storage import ObjectStorage, Storage

__all__ = ["PrefixSource", "parse_claim_body"]

CLAIM, FAILED, LOADED = ".claim", ".failed", ".loaded"
CLAIM_FIELDS = ("family", "host", "nonce", "pid")

logger = logging.getLogger("torch_storage_loader")


def parse_claim_body(body: bytes) -> dict | None:
    """The owner a claim body names (``{"host", "family", "pid", "nonce"}``, each of its type and in
    range), or None: whoever wrote it may have written anything."""
    try:
        owner = _limits.loads(body, max_bytes=_limits.CLAIM_MAX_BYTES, max_depth=_limits.CLAIM_MAX_DEPTH,
                              max_values=_limits.CLAIM_MAX_VALUES, floats=False)
    except ValueError:
        return None
    if type(owner) is not dict or sorted(owner) != list(CLAIM_FIELDS):
        return None
    host, family, pid, nonce = owner["host"], owner["family"], owner["pid"], owner["nonce"]
    if type(host) is not str or not 0 < len(host) <= 255 or parse_pid(family) is None:
        return None
    if type(pid) is not int or not 1 <= pid <= PID_MAX or type(nonce) is not str or len(nonce) > 64:
        return None
    return owner


class PrefixSource:
    """Objects a ``FileStorageLoader("s3://bucket/prefix")`` publishes, as they land (see the module).

    Consumers stop once ``end_directory_stream(prefix)`` was called and no object is unclaimed or
    claimed by another live trainer. Claims of a trainer that died on this host are deleted (so
    given back) by the next consumer that runs out of objects; those of a trainer that died on
    another host stay until deleted by hand (``NAME.claim``). A claim whose body is over 4 KiB or
    does not name its owner exactly (see ``parse_claim_body``) is ignored and counted (``refused``)
    once: its object is neither delivered nor waited for.
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
        self.refused = 0  # claims refused in this process, each counted once

    def __getstate__(self) -> dict:
        return {**self.__dict__, "refused": 0}

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
                if ended and any(c["family"] != family and (c["host"] != host or _alive(c))
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
                        owners[key] = self._owner(entry)
                    except StorageNotFoundError:
                        continue  # released meanwhile
                if owners[key] is not None:
                    out[entry.url] = owners[key]
        for key in set(owners) - seen:
            del owners[key]
        return out

    def _owner(self, entry: _objects.Entry) -> dict | None:
        """The owner a claim names; None (counted, logged) for one that is too large or does not parse."""
        owner = None
        if entry.size <= _limits.CLAIM_MAX_BYTES:  # never read a large one at all
            owner = parse_claim_body(_objects.read_head(entry.url, _limits.CLAIM_MAX_BYTES + 1))
        if owner is None:
            self.refused += 1
            _limits.log_refused(logger, "prefix %s: ignoring claim %s of %d bytes: it does not name its owner as "
                                "{host, family, pid, nonce}", self.path, entry.url[-300:], entry.size)
        return owner

    def _reclaim_dead(self, claims: dict[str, dict], host: str) -> int:
        n = 0
        for url, owner in claims.items():
            if owner["host"] == host and not _alive(owner):
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
    return trainer_alive(owner["family"], owner["pid"])
