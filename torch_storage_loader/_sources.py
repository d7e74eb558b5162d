"""Where a StorageDataset's handles come from: a finite list, a queue, or a directory."""

from __future__ import annotations

import errno
import logging
import multiprocessing.queues
import os
import queue as _queue
import re
import socket
import time
from typing import Any, Iterator

import torch

from . import _limits, _objects
from ._prefix import PrefixSource
from ._proc import parse_pid, trainer_alive
from .file_loader import SUFFIX
from .queue import StorageQueue
from .storage import FileStorage, Storage

__all__ = ["DirectorySource", "END_OF_STREAM", "ListSource", "QueueSource", "as_source", "end_directory_stream"]

END_OF_STREAM = "_END_OF_STREAM"

logger = logging.getLogger("torch_storage_loader")


class ListSource:
    """A finite sequence: each handle once per epoch, split evenly across ranks, then across workers.

    Like ``DistributedSampler``: the (optionally shuffled) order is the same on every rank; rank
    ``r`` takes positions ``r, r + world, ...``, after the order was padded with handles from its
    start to a multiple of ``world`` (or cut to one, with ``drop_last``), so that every rank gets
    the same number of samples and so of batches. A rank's samples are cut into groups of
    ``batch`` (the last may be short, or dropped with ``drop_last``) and dealt to its workers in turn.
    """

    finite = True

    def __init__(self, handles) -> None:
        self.handles = list(handles)
        for i, h in enumerate(self.handles):
            if not isinstance(h, Storage):
                raise TypeError(f"source[{i}] is a {type(h).__name__}, not a Storage handle")

    def __len__(self) -> int:
        return len(self.handles)

    def samples_per_rank(self, world: int, drop_last: bool) -> int:
        n = len(self.handles)
        return n // world if drop_last else -(-n // world)

    def items_per_rank(self, world: int, batch: int, drop_last: bool) -> int:
        """Groups (samples, or batches of ``batch``) each rank yields per epoch."""
        per = self.samples_per_rank(world, drop_last)
        return per // batch if drop_last else -(-per // batch)

    def padded(self, rank: int, world: int, drop_last: bool) -> int:
        """Handles rank ``rank`` repeats each epoch so that every rank gets as many as the others."""
        n = len(self.handles)
        if drop_last or n == 0:
            return 0
        return sum(1 for pos in range(rank, self.samples_per_rank(world, False) * world, world) if pos >= n)

    def order(self, epoch: int, shuffle: bool, seed: int) -> list[int]:
        """Positions in epoch order: a permutation of (seed, epoch), as ``DistributedSampler`` draws it."""
        if not shuffle:
            return list(range(len(self.handles)))
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        return torch.randperm(len(self.handles), generator=g).tolist()

    def groups(self, rank: int, world: int, worker: int, num_workers: int, *, epoch: int, shuffle: bool,
               seed: int, batch: int, drop_last: bool) -> list[list[Storage]]:
        """What worker ``worker`` of ``num_workers`` on rank ``rank`` of ``world`` loads this epoch."""
        order = self.order(epoch, shuffle, seed)
        total = self.samples_per_rank(world, drop_last) * world
        if order and total > len(order):
            order = (order * -(-total // len(order)))[:total]  # pad from the start, cyclically
        mine = [self.handles[i] for i in order[rank:total:world]]
        cut = self.items_per_rank(world, batch, drop_last) * batch
        groups = [mine[i:i + batch] for i in range(0, min(cut, len(mine)), batch)]
        return groups[worker::num_workers]

class QueueSource:
    """A ``StorageQueue``, or a ``queue.Queue`` / multiprocessing queue ending at a ``None``.

    Handles a DataLoader took but did not deliver are put back: ``StorageQueue.give_back`` (its
    consumers wait for them at the end of the stream), else after a plain queue's ``None``, which
    consumers look past briefly.
    """

    finite = False
    keep_alive_every = None
    ack_in_background = False

    def __init__(self, q: Any) -> None:
        self.queue = q

    def iterate(self, shard: int, num_shards: int, skip: int = 0, *, family: str = "") -> Iterator[tuple[Any, Storage]]:
        q = self.queue
        if isinstance(q, StorageQueue):
            for storage in q:
                yield storage, storage
            return
        if isinstance(q, _queue.Queue) and _in_child_process():
            raise TypeError("a queue.Queue is not shared with DataLoader worker processes; use a "
                            "StorageQueue or a multiprocessing Queue with num_workers > 0")
        while True:
            item = q.get()
            if item is None:
                try:
                    item = q.get(timeout=0.05)  # a handle given back after the end
                except _queue.Empty:
                    item = None
                q.put(None)  # every consumer must see the end
                if item is None:
                    return
            if not isinstance(item, Storage):
                raise TypeError(f"queue yielded a {type(item).__name__}, not a Storage handle or None")
            yield item, item

    def ack(self, tokens: list) -> None:
        pass

    def fail(self, tokens: list) -> None:
        pass

    def give_back(self, tokens: list) -> None:
        if isinstance(self.queue, StorageQueue):
            self.queue.give_back(tokens)
            return
        for storage in tokens:
            self.queue.put(storage)


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

    Whoever can write into the directory is not trusted: a name that cannot be claimed (too long
    to rename, say) and a claim whose name does not parse (``HOST-TRAINER-PID``, ASCII digits in
    the kernel's pid range) are ignored and counted (``refused``) once each; files are opened
    without following links, and a FIFO or device is refused, not read (see ``_format``).

    ``path`` may be an object-store prefix (``s3://bucket/prefix``): the source is then a
    ``PrefixSource``, which claims objects by conditional creation instead of renaming.
    """

    finite = False
    keep_alive_every = None
    ack_in_background = False

    def __new__(cls, path: str | os.PathLike | None = None, **options: Any):  # None: unpickling
        if cls is DirectorySource and path is not None and _objects.is_url(os.fspath(path)):
            return PrefixSource(os.fspath(path), **options)  # claims by conditional creation: see _prefix
        return super().__new__(cls)

    def __init__(self, path: str | os.PathLike, *, delete_after_load: bool = True,
                 poll_interval: float = 0.05) -> None:
        if poll_interval <= 0:
            raise ValueError(f"{poll_interval=} must be > 0")
        self.path = os.fspath(path)
        self.delete_after_load = delete_after_load
        self.poll_interval = poll_interval
        self.refused = 0  # names refused in this process, each counted once
        self._refused: set[str] = set()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "refused": 0, "_refused": set()}

    def _refuse(self, name: str, why: str) -> None:
        if name in self._refused:
            return
        if len(self._refused) >= 1 << 16:
            self._refused.clear()  # bounded: a name seen again then is counted again
        self._refused.add(name)
        self.refused += 1
        _limits.log_refused(logger, "directory %s: ignoring %r: %s", self.path, name[:300], why)

    def _names(self) -> list[str]:
        try:
            return sorted(os.listdir(self.path))
        except FileNotFoundError:
            return []

    def iterate(self, shard: int, num_shards: int, skip: int = 0, *, family: str = "") -> Iterator[tuple[str, Storage]]:
        host = socket.gethostname()
        family = family or str(os.getpid())
        tag = f"{CLAIM}{host}-{family}-{os.getpid()}"
        while True:
            ended = os.path.exists(os.path.join(self.path, END_OF_STREAM))
            names = self._names()
            unclaimed = [n for n in names if n.endswith(SUFFIX) and not n.startswith(".") and n not in self._refused]
            if not unclaimed:
                claims = self._claims(names)
                if self._reclaim_dead(claims, host):
                    continue
                if ended and not self._claimed_by_others(claims, host, family):
                    return
                time.sleep(self.poll_interval)
                continue
            for name in unclaimed:
                src = os.path.join(self.path, name)
                try:
                    os.rename(src, src + tag)  # atomic: exactly one consumer wins each file
                except FileNotFoundError:
                    continue
                except OSError as exc:  # e.g. a name too long to take the claim's suffix
                    self._refuse(name, f"it cannot be claimed ({errno.errorcode.get(exc.errno, exc.errno)})")
                    continue
                yield src + tag, FileStorage(src + tag)

    def _claims(self, names: list[str]) -> list[tuple[str, str, str, str, int]]:
        """The valid claims among ``names``: (name, original name, host, family, pid); the others are refused."""
        out = []
        for name in names:
            if CLAIM not in name:
                continue
            claim = _parse_claim(name)
            if claim is None:
                self._refuse(name, "its claim is not NAME.claimed-HOST-TRAINER-PID with pids in range")
            else:
                out.append((name, *claim))
        return out

    def _reclaim_dead(self, claims: list, host: str) -> int:
        """Rename back the claims of trainers on this host that died; returns how many.

        A claim's worker may be gone while its trainer lives: the trainer gives it back (or
        acknowledges it) itself.
        """
        n = 0
        for name, original, claim_host, family, pid in claims:
            if claim_host != host or trainer_alive(family, pid):
                continue
            try:
                os.rename(os.path.join(self.path, name), os.path.join(self.path, original))
                n += 1
            except FileNotFoundError:
                pass
        return n

    def _claimed_by_others(self, claims: list, host: str, family: str) -> bool:
        return any(claim_family != family and (claim_host != host or trainer_alive(claim_family, pid))
                   for _, _, claim_host, claim_family, pid in claims)

    def ack(self, tokens: list) -> None:
        for path in tokens:
            try:
                if self.delete_after_load:
                    os.remove(path)
                else:
                    os.rename(path, path.rsplit(CLAIM, 1)[0] + ".loaded")
            except FileNotFoundError:
                pass  # reclaimed meanwhile as a dead process's: it will be delivered again

    def fail(self, tokens: list) -> None:
        for path in tokens:
            try:
                os.rename(path, path.rsplit(CLAIM, 1)[0] + ".failed")
            except FileNotFoundError:
                pass

    def give_back(self, tokens: list) -> None:
        for path in tokens:
            try:
                os.rename(path, path.rsplit(CLAIM, 1)[0])
            except FileNotFoundError:
                pass


CLAIM = ".claimed-"


_CLAIM_TAIL = re.compile(r"(.+)-([0-9]{1,7})-([0-9]{1,7})")  # HOST (may hold dashes)-FAMILY-PID


def _parse_claim(name: str) -> tuple[str, str, str, int] | None:
    """``NAME.claimed-HOST-FAMILY-PID`` -> (NAME, HOST, FAMILY, PID), or None (not a valid claim).

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
    return original, match[1], match[2], pid


def end_directory_stream(path: str | os.PathLike) -> None:
    """Tell the consumers of a directory source (or object-store prefix) that no more files will come."""
    if _objects.is_url(os.fspath(path)):
        _objects.put(f"{os.fspath(path).rstrip('/')}/{END_OF_STREAM}", [b""])
        return
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, END_OF_STREAM), "w"):
        pass


def as_source(source: Any, trusted_roots: Any = None):
    """The source behind ``source``; ``trusted_roots`` are added to a network source's own."""
    if isinstance(source, (ListSource, QueueSource, DirectorySource, PrefixSource)):
        return source
    import sys

    redis_queue = sys.modules.get(f"{__package__}.redis_queue")  # imported only by its users: redis is heavy
    if redis_queue is not None and isinstance(source, redis_queue.RedisSource):
        return source.queue.as_source(trusted_roots) if trusted_roots else source
    if redis_queue is not None and isinstance(source, redis_queue.RedisStorageQueue):
        return source.as_source(trusted_roots)
    if isinstance(source, (StorageQueue, _queue.Queue, multiprocessing.queues.Queue)):
        return QueueSource(source)
    if isinstance(source, (str, os.PathLike)):
        return DirectorySource(source)
    if hasattr(source, "get") and hasattr(source, "put"):
        return QueueSource(source)  # e.g. a manager's queue proxy
    try:
        return ListSource(source)
    except TypeError as exc:
        raise TypeError(f"source must be a list of Storage handles, a StorageQueue, a RedisStorageQueue, a "
                        f"queue, or a directory path; got {type(source).__name__} ({exc})") from None


def _in_child_process() -> bool:
    import torch.utils.data

    return torch.utils.data.get_worker_info() is not None
