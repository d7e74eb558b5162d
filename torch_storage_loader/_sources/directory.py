"""Files a ``FileStorageLoader`` writes into a directory, claimed by atomic rename as they land."""

from __future__ import annotations

import errno
import functools
import logging
import os
import pickle
import queue as _queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, NamedTuple

from .._format.names import DIR_CLAIM as CLAIM
from .._format.names import FAILED, LOADED, SUFFIX
from .._proc import parse_pid
from .._stores import objects as _objects
from .._untrusted import bounded as _bounded
from ..errors import StreamEndedError
from ..storage import FileStorage, Storage
from .claims import Claim, Owner, Scan, claim_loop
from .end import END_OF_STREAM, marker_path

__all__ = ["CLAIM", "ClaimedName", "DirectorySource", "parse_claim"]

logger = logging.getLogger("torch_storage_loader")


# Size: about 275 lines, 65 of them the docstring users read: listing, claiming (in workers, or for
# them) and settling one directory's files.
class DirectorySource:
    """Files a ``FileStorageLoader`` (or ``FileStorage.save``) writes into ``path``, as they land.

    Each file is claimed by exactly one consumer, by renaming it atomically to
    ``NAME.claimed-HOST-TRAINER-PID`` (processes on other machines sharing the filesystem
    included). A claimed file is deleted once the trainer received its sample
    (``delete_after_load=False`` keeps it as ``*.loaded``); a file that fails to load is kept as
    ``*.failed``; a claim not delivered when a DataLoader stops is renamed back, and so is a claim
    whose process died on this host (found by any consumer that runs out of files). Producers end
    the stream with ``end_directory_stream(path)``: consumers stop once the marker exists and no
    file is unclaimed or claimed by another live trainer. Producers should save with
    ``FileStorageLoader(path, ttl=None)`` so that nothing is deleted before it is delivered.
    The marker stays: a stream that starts again in the same directory begins with
    ``start_directory_stream(path)``, and a ``StorageDataset`` refuses to start on an ended stream
    (``StreamEndedError``, see ``check_start``) rather than stop at once with nothing.

    Whoever can write into the directory is not trusted: a name that cannot be claimed (too long
    to rename, say) and a claim whose name does not parse (``HOST-TRAINER-PID``, ASCII digits in
    the kernel's pid range) are ignored and counted (``refused``) once each; files are opened
    without following links, and a FIFO or device is refused, not read (see ``_format``).

    ``path`` may be an object-store prefix (``s3://bucket/prefix``): the source is then a
    ``PrefixSource`` (a subclass), which claims objects by conditional creation instead of renaming.

    Pass it as a ``StorageDataset``'s source (a plain path does the same with the defaults). Under
    DataLoader workers the trainer claims (``take_pickled``) and feeds its workers, so a worker
    killed at any point holds no claim the trainer does not know; without workers it ``iterate`` s.
    Each token is settled with ``ack``, ``fail`` or ``give_back``, in the process that took it.

    Args:
        path: The directory the producers save into (or an object-store prefix URL).
        delete_after_load: Delete a file once its sample reached the trainer; False renames it to
            ``*.loaded`` instead, so it is kept but never claimed again.
        poll_interval: Seconds to wait before listing the directory again when nothing is unclaimed.

    Raises:
        ValueError: ``poll_interval`` is not positive.

    Examples:
        >>> import os, torch
        >>> from torch_storage_loader import DirectorySource, FileStorage, StorageDataset, end_directory_stream
        >>> os.makedirs("incoming")
        >>> size = FileStorage("incoming/0.tsl").save(torch.zeros(2))  # a producer saves, then ends the stream
        >>> end_directory_stream("incoming")
        >>> dataset = StorageDataset(DirectorySource("incoming"))
        >>> [batch.shape for batch in torch.utils.data.DataLoader(dataset)]
        [torch.Size([1, 2])]
        >>> os.listdir("incoming")  # delivered, so deleted
        ['_END_OF_STREAM']
    """

    finite = False
    keep_alive_every = None
    ack_in_background = True  # a removal per delivered sample: off the trainer's thread, in batches
    fed_from_trainer = True  # one claimer per trainer: no races between its workers, no message per claim
    spread = False  # a rename is cheap: every consumer walks the names in order

    _for_urls: ClassVar[type[DirectorySource]]  # ``prefix.PrefixSource``, set as the package defines it

    def __init_subclass__(cls, *, for_urls: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if for_urls:
            DirectorySource._for_urls = cls

    def __new__(cls, path: str | os.PathLike[str] | None = None, **options: Any) -> DirectorySource:  # None: unpickling
        if cls is DirectorySource and path is not None and _objects.is_url(os.fspath(path)):
            return super().__new__(DirectorySource._for_urls)  # claims by conditional creation: see prefix
        return super().__new__(cls)

    def __init__(
        self, path: str | os.PathLike[str], *, delete_after_load: bool = True, poll_interval: float = 0.05
    ) -> None:
        if poll_interval <= 0:
            raise ValueError(f"{poll_interval=} must be > 0")
        self.path, self.delete_after_load, self.poll_interval = os.fspath(path), delete_after_load, poll_interval
        self.refused = 0  # names refused in this process, each counted once
        self._refused: set[str] = set()
        self._taking: Iterator[tuple[Any, Storage] | None] | None = None  # the trainer's claims (take_pickled)
        self._fed: dict[bytes, str] = {}  # a pickled handle fed -> its claim, until settled
        self._take_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = {**self.__dict__, "refused": 0, "_refused": set(), "_taking": None, "_fed": {}}
        del state["_take_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._take_lock = threading.Lock()

    def _refuse(self, name: str, why: str) -> None:
        if name in self._refused:
            return
        if len(self._refused) >= 1 << 16:
            self._refused.clear()  # bounded: a name seen again then is counted again
        self._refused.add(name)
        self.refused += 1
        _bounded.log_refused(logger, "directory %s: ignoring %r: %s", self.path, name[:300], why)

    def _names(self) -> list[str]:
        try:
            return sorted(os.listdir(self.path))
        except FileNotFoundError:
            return []

    def iterate(
        self, shard: int, num_shards: int, *, family: str = "", stop: Callable[[], bool] | None = None
    ) -> Iterator[tuple[str, Storage]]:
        """Claim files as they land, until the stream ended and nothing is left to claim.

        Args:
            shard: This consumer's index among ``num_shards`` (spreads consumers over the names).
            num_shards: How many consumers read the source (DataLoader workers times ranks).
            family: The trainer this consumer belongs to (its pid; default: this process's), so
                claims of a live trainer are never taken back.
            stop: Asked each ``poll_interval`` while nothing is left to claim; True ends the
                iteration there (a DataLoader worker whose trainer ended its epoch).

        Yields:
            ``(token, handle)`` per claimed file: settle the token with ``ack``, ``fail`` or ``give_back``.
        """
        return claim_loop(self, shard, num_shards, family, stop=stop)

    def take_pickled(self, most: int, timeout: float) -> list[bytes] | None:
        """In the trainer, feeding its DataLoader workers: claim what is there, up to ``most`` files.

        Args:
            most: The most files to claim now.
            timeout: Seconds to wait for the first, polling every ``poll_interval``.

        Returns:
            Between one and ``most`` claimed files, each as its handle pickled (its own token: settle
            it with ``ack``, ``fail`` or ``give_back`` in this process), or None once the stream ended.

        Raises:
            queue.Empty: Nothing landed within ``timeout`` seconds.
        """
        deadline, out = time.monotonic() + timeout, list[bytes]()
        while True:
            with self._take_lock:  # one claim loop, which two iterators of the same dataset may share
                if self._taking is None:
                    self._taking = claim_loop(self, 0, 1, wait=False)  # (spread is False: shards do not matter)
                got = next(self._taking, _ENDED)
                if got is _ENDED:
                    self._taking = None  # ended: a restart (the next epoch) looks again
                    return out or None
                if isinstance(got, tuple):  # (None: nothing to claim now)
                    # A FileStorage is a path: plain pickle (3 us) suffices; ForkingPickler (10 us, a
                    # copy of its reducer table per call) is for what holds descriptors or tensors.
                    data = pickle.dumps(got[1], pickle.HIGHEST_PROTOCOL)
                    self._fed[data] = got[0]
                    out.append(data)
                    if len(out) < most:
                        continue
                    return out
            if out:
                return out
            left = deadline - time.monotonic()
            if left <= 0:
                raise _queue.Empty
            time.sleep(min(self.poll_interval, left))

    def _claims_of(self, tokens: list[Any]) -> list[str]:
        """The claims ``tokens`` stand for: a claim's path (``iterate``) or a pickled handle fed (``take_pickled``)."""
        return [self._fed.pop(t, "") if type(t) is bytes else t for t in tokens]

    def _scan(self) -> Scan:
        ended = os.path.exists(os.path.join(self.path, END_OF_STREAM))  # first: written after the files
        names = self._names()
        unclaimed = [n for n in names if n.endswith(SUFFIX) and not n.startswith(".") and n not in self._refused]
        return Scan(ended, unclaimed, names)

    def check_start(self) -> None:
        """Refuse to start consuming a stream that ended before this consumer came.

        The end marker says "stop once nothing is left". Left by an earlier stream (the same script run
        again, say), it would stop a consumer of the new stream at once with nothing, or midway, with
        the new files that land later left unread. So the stream is refused when its marker is there
        and either nothing is left to deliver (no unclaimed file, no claim) or a file was saved after
        the marker; a marker with undelivered files saved before it is the normal end, and they are
        drained. A ``StorageDataset`` calls this once, when it is made (not per epoch or worker).

        Raises:
            StreamEndedError: the stream had ended; the message names the marker and
                ``start_directory_stream``. Nothing is read, claimed or deleted.
        """
        scan = self._scan()
        if not scan.ended:
            return
        after = self._saved_after_end(scan)
        if after is not None:
            why = f"{after!r} was saved after it, so it belongs to a stream that started since"
        elif not scan.unclaimed and not self._claimed(scan):
            why = "every file of that stream was delivered before this consumer started"
        else:
            return
        marker = marker_path(self.path)
        raise StreamEndedError(
            f"{marker}: the stream in {self.path} has ended ({why}); a consumer started now would stop at "
            f"once, or midway, and leave the files saved after that marker unread. To stream through the same "
            f"place again, call start_directory_stream({self.path!r}) before the new stream's producers and "
            "consumers start (it removes the marker), or save each stream into a directory of its own",
            path=marker,
        )

    def _saved_after_end(self, scan: Scan) -> str | None:
        """An unclaimed file modified after the end marker (by the filesystem's clock), or None."""
        try:
            end = os.stat(os.path.join(self.path, END_OF_STREAM)).st_mtime_ns
        except FileNotFoundError:
            return None
        name: str
        for name in reversed(scan.unclaimed):  # saved names sort in save order: the newest first
            try:
                if os.stat(os.path.join(self.path, name), follow_symlinks=False).st_mtime_ns > end:
                    return name
            except FileNotFoundError:
                continue  # claimed meanwhile
        return None

    def _claimed(self, scan: Scan) -> bool:
        """Whether any name listed is a claim (a file some trainer holds, or will give back)."""
        return any(CLAIM in name for name in scan.listing)

    def _claims_in(self, scan: Scan) -> list[Claim]:
        """The valid claims among the names listed; the others are refused."""
        out: list[Claim] = []
        for name in scan.listing:
            if CLAIM not in name:
                continue
            claim = parse_claim(name)
            if claim is None:
                self._refuse(name, "its claim is not NAME.claimed-HOST-TRAINER-PID with pids in range")
            else:
                out.append(claim)
        return out

    def _release(self, claim: Claim) -> bool:
        """Rename back the claim of a trainer that died on this host (a claim whose worker is gone while
        its trainer lives is the trainer's to give back or acknowledge)."""
        ref: ClaimedName = claim.ref
        return self._settle(os.rename, os.path.join(self.path, ref.name), os.path.join(self.path, ref.original))

    def _settle(self, op: Callable[..., None], path: str, *to: str) -> bool:
        """``op(path, *to)`` (a rename or a removal) on names a writer controls: whether it was done.

        Gone (another consumer settled it) is not an error; any other refusal (a target that is
        ``.``, ``..`` or a directory, say) is the writer's doing: the name is ignored and counted,
        never raised into the claim loop or the trainer."""
        try:
            op(path, *to)
        except FileNotFoundError:
            return False
        except OSError as exc:
            self._refuse(os.path.basename(path), f"it cannot be settled ({_errno_name(exc)})")
            return False
        return True

    def _claim(self, name: str, owner: Owner) -> tuple[str, Storage] | None:
        src = os.path.join(self.path, name)
        claimed = f"{src}{CLAIM}{owner.host}-{owner.family}-{owner.pid}"
        try:
            os.rename(src, claimed)  # atomic: exactly one consumer wins each file
        except FileNotFoundError:
            return None
        except OSError as exc:  # e.g. a name too long to take the claim's suffix
            self._refuse(name, f"it cannot be claimed ({_errno_name(exc)})")
            return None
        return claimed, FileStorage(claimed)

    def ack(self, tokens: list[str]) -> None:
        """Settle claims whose samples reached the trainer: delete the files (or keep them as ``*.loaded``).

        Args:
            tokens: Tokens from ``iterate``.
        """
        for path in self._claims_of(tokens):  # (gone: reclaimed meanwhile as a dead process's, delivered again)
            if not path:
                continue
            if self.delete_after_load:
                self._settle(os.remove, path)
            else:
                self._settle(os.rename, path, path.rsplit(CLAIM, 1)[0] + LOADED)

    def fail(self, tokens: list[str]) -> None:
        """Settle claims whose files could not be loaded: keep them as ``*.failed``, never claimed again.

        Args:
            tokens: Tokens from ``iterate``.
        """
        for path in self._claims_of(tokens):
            if path:
                self._settle(os.rename, path, path.rsplit(CLAIM, 1)[0] + FAILED)

    def keep_alive(self, tokens: list[str]) -> None:
        """Do nothing: a claim here lasts until its trainer dies (part of the source contract).

        Args:
            tokens: Tokens from ``iterate``.
        """

    def give_back(self, tokens: list[str]) -> None:
        """Release claims that were never delivered: rename the files back, for any consumer to claim.

        Args:
            tokens: Tokens from ``iterate``.
        """
        for path in self._claims_of(tokens):
            if path:
                self._settle(os.rename, path, path.rsplit(CLAIM, 1)[0])


def _errno_name(exc: OSError) -> str:
    """``ENAMETOOLONG`` and the like: the error's name, else its number (or None)."""
    return errno.errorcode.get(exc.errno or 0, str(exc.errno))


_ENDED = object()  # what next() gives for a claim loop that ended
_CLAIM_TAIL = re.compile(r"(.+)-([0-9]{1,7})-([0-9]{1,7})")  # HOST (may hold dashes)-FAMILY-PID


class ClaimedName(NamedTuple):
    """A claimed file's name in the directory, and the name it had before it was claimed."""

    name: str
    original: str


@functools.lru_cache(maxsize=1 << 14)  # a waiting consumer lists every poll_interval, hundreds of claims in flight
def parse_claim(name: str) -> Claim | None:
    """The claim a name ``NAME.claimed-HOST-FAMILY-PID`` makes (its ``ref``: a ``ClaimedName``), or
    None: not a valid claim.

    FAMILY (the trainer's pid) and PID are ASCII digits within the kernel's pid range."""
    if CLAIM not in name:
        return None
    original, rest = name.rsplit(CLAIM, 1)
    match = _CLAIM_TAIL.fullmatch(rest)
    if not original or match is None:
        return None
    pid = parse_pid(match[3])
    if parse_pid(match[2]) is None or pid is None:
        return None
    return Claim(ClaimedName(name, original), match[1], match[2], pid)
