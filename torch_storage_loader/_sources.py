"""Where a StorageDataset's handles come from: a finite list, a queue, or a directory."""

from __future__ import annotations

import multiprocessing.queues
import os
import queue as _queue
import socket
import time
from typing import Any, Iterator

from .file_loader import SUFFIX
from .queue import StorageQueue
from .storage import FileStorage, Storage

__all__ = ["DirectorySource", "END_OF_STREAM", "ListSource", "QueueSource", "as_source", "end_directory_stream"]

END_OF_STREAM = "_END_OF_STREAM"


class ListSource:
    """A finite sequence: each handle once per epoch, split across workers and ranks by position."""

    finite = True

    def __init__(self, handles) -> None:
        self.handles = list(handles)
        for i, h in enumerate(self.handles):
            if not isinstance(h, Storage):
                raise TypeError(f"source[{i}] is a {type(h).__name__}, not a Storage handle")

    def __len__(self) -> int:
        return len(self.handles)

    def iterate(self, shard: int, num_shards: int, skip: int = 0) -> Iterator[Storage]:
        mine = self.handles[shard::num_shards]
        yield from mine[skip:]

    def done(self, storage: Storage, ok: bool) -> None:
        pass


class QueueSource:
    """A ``StorageQueue``, or a ``queue.Queue`` / multiprocessing queue ending at a ``None``."""

    finite = False

    def __init__(self, q: Any) -> None:
        self.queue = q

    def iterate(self, shard: int, num_shards: int, skip: int = 0) -> Iterator[Storage]:
        q = self.queue
        if isinstance(q, StorageQueue):
            yield from q
            return
        if isinstance(q, _queue.Queue) and _in_child_process():
            raise TypeError("a queue.Queue is not shared with DataLoader worker processes; use a "
                            "StorageQueue or a multiprocessing Queue with num_workers > 0")
        while True:
            item = q.get()
            if item is None:
                q.put(None)  # every consumer must see the end
                return
            if not isinstance(item, Storage):
                raise TypeError(f"queue yielded a {type(item).__name__}, not a Storage handle or None")
            yield item

    def done(self, storage: Storage, ok: bool) -> None:
        pass


class DirectorySource:
    """Files a ``FileStorageLoader`` (or ``FileStorage.save``) writes into ``path``, as they land.

    Each file is claimed by exactly one consumer, by renaming it atomically (processes on other
    machines sharing the filesystem included); claimed files are deleted once loaded
    (``delete_after_load=False`` keeps them as ``*.loaded``), and files that fail are kept as
    ``*.failed``. Producers end the stream with ``end_directory_stream(path)``: consumers stop once
    the marker exists and no unclaimed file is left. Producers should save with
    ``FileStorageLoader(path, ttl=None)`` so that nothing is deleted
    before a consumer claims it.
    """

    finite = False

    def __init__(self, path: str | os.PathLike, *, delete_after_load: bool = True,
                 poll_interval: float = 0.05) -> None:
        if poll_interval <= 0:
            raise ValueError(f"{poll_interval=} must be > 0")
        self.path = os.fspath(path)
        self.delete_after_load = delete_after_load
        self.poll_interval = poll_interval

    def _unclaimed(self) -> list[str]:
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return []
        return sorted(n for n in names if n.endswith(SUFFIX) and not n.startswith("."))

    def iterate(self, shard: int, num_shards: int, skip: int = 0) -> Iterator[Storage]:
        tag = f".claimed-{socket.gethostname()}-{os.getpid()}"
        while True:
            ended = os.path.exists(os.path.join(self.path, END_OF_STREAM))
            names = self._unclaimed()
            if not names:
                if ended:
                    return
                time.sleep(self.poll_interval)
                continue
            for name in names:
                src = os.path.join(self.path, name)
                try:
                    os.rename(src, src + tag)  # atomic: exactly one consumer wins each file
                except FileNotFoundError:
                    continue
                yield FileStorage(src + tag)

    def done(self, storage: Storage, ok: bool) -> None:
        path = storage.path
        if ok and self.delete_after_load:
            os.remove(path)
        else:
            os.rename(path, path.rsplit(".claimed-", 1)[0] + (".loaded" if ok else ".failed"))


def end_directory_stream(path: str | os.PathLike) -> None:
    """Tell the consumers of a directory source that no more files will come."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, END_OF_STREAM), "w"):
        pass


def as_source(source: Any):
    if isinstance(source, (ListSource, QueueSource, DirectorySource)):
        return source
    if isinstance(source, (StorageQueue, _queue.Queue, multiprocessing.queues.Queue)):
        return QueueSource(source)
    if isinstance(source, (str, os.PathLike)):
        return DirectorySource(source)
    if hasattr(source, "get") and hasattr(source, "put"):
        return QueueSource(source)  # e.g. a manager's queue proxy
    try:
        return ListSource(source)
    except TypeError as exc:
        raise TypeError(f"source must be a list of Storage handles, a StorageQueue, a queue, or a "
                        f"directory path; got {type(source).__name__} ({exc})") from None


def _in_child_process() -> bool:
    import torch.utils.data

    return torch.utils.data.get_worker_info() is not None
