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
from typing import Any, TypedDict, cast

from .._format.names import FAILED, LOADED, SUFFIX
from .._format.names import OBJECT_CLAIM as CLAIM
from .._proc import PID_MAX, parse_pid
from .._stores import objects as _objects
from .._untrusted import bounded as _bounded
from ..errors import StorageNotFoundError
from ..storage import ObjectStorage, Storage
from .claims import Claim, Owner, Scan
from .directory import DirectorySource
from .end import END_OF_STREAM

__all__ = ["ClaimBody", "PrefixSource", "parse_claim_body"]

CLAIM_FIELDS = ("family", "host", "nonce", "pid")

logger = logging.getLogger("torch_storage_loader")


class ClaimBody(TypedDict):
    """What a claim's body says (``parse_claim_body`` checked each field)."""

    family: str
    host: str
    nonce: str
    pid: int


def parse_claim_body(body: bytes) -> ClaimBody | None:
    """The owner a claim body names (``{"host", "family", "pid", "nonce"}``, each of its type and in
    range), or None: whoever wrote it may have written anything."""
    try:
        owner = _bounded.loads(
            body,
            max_bytes=_bounded.CLAIM_MAX_BYTES,
            max_depth=_bounded.CLAIM_MAX_DEPTH,
            max_values=_bounded.CLAIM_MAX_VALUES,
            floats=False,
        )
    except ValueError:
        return None
    if type(owner) is not dict or sorted(owner) != list(CLAIM_FIELDS):
        return None
    host, family, pid, nonce = owner["host"], owner["family"], owner["pid"], owner["nonce"]
    if type(host) is not str or not 0 < len(host) <= 255 or parse_pid(family) is None:
        return None
    if type(pid) is not int or not 1 <= pid <= PID_MAX or type(nonce) is not str or len(nonce) > 64:
        return None
    return cast(ClaimBody, owner)


_ClaimKey = tuple[str, str | None, float]  # a claim object's URL, version and mtime: its body is read once per key


class PrefixSource(DirectorySource, for_urls=True):
    """Objects a ``FileStorageLoader("s3://bucket/prefix")`` publishes, as they land (see the module).

    Consumers stop once ``end_directory_stream(prefix)`` was called and no object is unclaimed or
    claimed by another live trainer; ``start_directory_stream(prefix)`` starts a new stream under a
    prefix whose marker an earlier one left (``check_start`` refuses it until then). Claims of a trainer that died on this host are deleted (so
    given back) by the next consumer that runs out of objects; those of a trainer that died on
    another host stay until deleted by hand (``NAME.claim``). A claim whose body is over 4 KiB or
    does not name its owner exactly (see ``parse_claim_body``) is ignored and counted (``refused``)
    once: its object is neither delivered nor waited for.

    ``DirectorySource(url)`` with an object-store URL makes one; ``iterate`` is ``DirectorySource``'s.

    Args:
        url: The prefix the producers publish under (``s3://bucket/prefix``, any fsspec URL).
        delete_after_load: Delete an object (and its claim) once its sample reached the trainer; False
            adds ``NAME.loaded`` instead, so it is kept but never claimed again.
        poll_interval: Seconds to wait before listing the prefix again when nothing is unclaimed
            (each listing is a request, hence a longer default than a directory's).

    Raises:
        ValueError: ``poll_interval`` is not positive.
    """

    ack_in_background = True  # two requests per delivered sample: off the trainer's thread
    fed_from_trainer = False  # its claims are atomic: workers take themselves
    spread = True  # a claim costs requests: consumers start apart, so fewer lose races

    def __init__(self, url: str, *, delete_after_load: bool = True, poll_interval: float = 0.2) -> None:
        if poll_interval <= 0:
            raise ValueError(f"{poll_interval=} must be > 0")
        self.path = os.fspath(url).rstrip("/")
        self.delete_after_load = delete_after_load
        self.poll_interval = poll_interval
        self.refused = 0  # claims refused in this process, each counted once
        self._owners: dict[_ClaimKey, ClaimBody | None] = {}  # (claim URL, version, mtime) -> its owner

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "refused": 0, "_owners": {}}

    def _scan(self) -> Scan:
        entries = {e.url.rsplit("/", 1)[-1]: e for e in _objects.listing(self.path)}
        if END_OF_STREAM in entries:  # a listing is no snapshot: one made after the marker was seen has
            # every file saved before it (this one may have passed their names before they landed)
            entries = {e.url.rsplit("/", 1)[-1]: e for e in _objects.listing(self.path)}
        unclaimed = [
            e
            for name, e in sorted(entries.items())
            if name.endswith(SUFFIX) and not any(name + m in entries for m in (CLAIM, FAILED, LOADED))
        ]
        return Scan(END_OF_STREAM in entries, unclaimed, entries)

    def _saved_after_end(self, scan: Scan) -> str | None:
        """An unclaimed object published after the end marker (by the store's clock), or None."""
        end = scan.listing[END_OF_STREAM].mtime
        return next((e.url.rsplit("/", 1)[-1] for e in reversed(scan.unclaimed) if e.mtime > end), None)

    def _claimed(self, scan: Scan) -> bool:
        return any(name.endswith(CLAIM) and name[: -len(CLAIM)] in scan.listing for name in scan.listing)

    def _claims_in(self, scan: Scan) -> list[Claim]:
        """The claims among the objects listed whose bodies name their owner (claims that vanish are
        skipped); each body is read once (``_owners`` caches them by URL, version and time)."""
        out: list[Claim] = []
        seen: set[_ClaimKey] = set()
        for name, entry in scan.listing.items():
            if name.endswith(CLAIM) and name[: -len(CLAIM)] in scan.listing:
                key = (entry.url, entry.version, entry.mtime)
                seen.add(key)
                if key not in self._owners:
                    try:
                        self._owners[key] = self._owner(entry)
                    except StorageNotFoundError:
                        continue  # released meanwhile
                owner = self._owners[key]
                if owner is not None:
                    out.append(Claim(entry.url, owner["host"], owner["family"], owner["pid"]))
        for key in set(self._owners) - seen:
            del self._owners[key]
        return out

    def _release(self, claim: Claim) -> bool:
        return bool(_objects.remove(claim.ref))

    # The claim loop hands each source the entries of its own ``_scan``: objects here, names in a
    # directory. Typing that link needs a source generic in its entries, which the public
    # ``DirectorySource`` is not (``DirectorySource(url)`` makes a ``PrefixSource``, so one subclasses the other).
    def _claim(self, entry: _objects.Entry, owner: Owner) -> tuple[str, Storage] | None:  # type: ignore[override]
        body = json.dumps({**owner._asdict(), "nonce": secrets.token_hex(8)}).encode()
        if not _objects.create_if_absent(entry.url + CLAIM, body):
            return None  # another consumer won it
        if not _objects.exists(entry.url) or any(_objects.exists(entry.url + m) for m in (FAILED, LOADED)):
            _objects.remove(entry.url + CLAIM)  # settled by another consumer since our listing
            return None
        return entry.url, ObjectStorage(entry.url, size=entry.size, version=entry.version)

    def _owner(self, entry: _objects.Entry) -> ClaimBody | None:
        """The owner a claim names; None (counted, logged) for one that is too large or does not parse."""
        owner = None
        if entry.size <= _bounded.CLAIM_MAX_BYTES:  # never read a large one at all
            owner = parse_claim_body(_objects.read_head(entry.url, _bounded.CLAIM_MAX_BYTES + 1))
        if owner is None:
            self.refused += 1
            _bounded.log_refused(
                logger,
                "prefix %s: ignoring claim %s of %d bytes: it does not name its owner as {host, family, pid, nonce}",
                self.path,
                entry.url[-300:],
                entry.size,
            )
        return owner

    def ack(self, tokens: list[str]) -> None:
        """Settle claims whose samples reached the trainer: delete the objects (or add ``NAME.loaded``)
        and their claims.

        Args:
            tokens: Tokens from ``iterate``.
        """
        for url in tokens:
            if self.delete_after_load:
                _objects.remove(url)
            else:
                _objects.put(url + LOADED, [b""])
            _objects.remove(url + CLAIM)

    def fail(self, tokens: list[str]) -> None:
        """Settle claims whose objects could not be loaded: add ``NAME.failed`` (never claimed again)
        and delete the claims.

        Args:
            tokens: Tokens from ``iterate``.
        """
        for url in tokens:
            _objects.put(url + FAILED, [b""])
            _objects.remove(url + CLAIM)

    def give_back(self, tokens: list[str]) -> None:
        """Release claims that were never delivered: delete the claims, for any consumer to claim the objects.

        Args:
            tokens: Tokens from ``iterate``.
        """
        for url in tokens:
            _objects.remove(url + CLAIM)
