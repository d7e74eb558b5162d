"""``FileStorageLoader``: one file per ``save`` in a directory, deleted after ``ttl`` seconds."""

from __future__ import annotations

import collections
import os
import threading
import time
import uuid
from typing import Any

from .loader import StorageLoader
from .storage import FileStorage, Storage

__all__ = ["FileStorageLoader", "new_file_name"]

SUFFIX = ".tsl"


def new_file_name() -> str:
    """A unique name that sorts in save order (nanosecond clock first)."""
    return f"{time.time_ns():020d}-{os.getpid()}-{uuid.uuid4().hex[:12]}{SUFFIX}"


class FileStorageLoader(StorageLoader):
    """Saves each sample to its own file under ``dirname`` (created with parents).

    A background cleaner deletes files this loader saved once they are ``ttl`` seconds old
    (``ttl=None``: never), except while a load of the file is queued or in flight. ``shutdown``
    deletes the remaining ones unless ``remove_on_shutdown=False`` (use that when other
    processes load the handles after this loader is gone).
    """

    def __init__(self, dirname: str | os.PathLike, ttl: float | None = 20, worker_num: int = 3, *,
                 allow_pickle: bool = False, fsync: bool = False, remove_on_shutdown: bool = True,
                 **loader_options: Any) -> None:
        if ttl is not None and ttl <= 0:
            raise ValueError(f"{ttl=} must be > 0, or None to keep files until shutdown")
        super().__init__(worker_num, **loader_options)
        self.dirname = os.fspath(dirname)
        self.ttl = ttl
        self.allow_pickle = allow_pickle
        self.fsync = fsync
        self.remove_on_shutdown = remove_on_shutdown
        self._files: collections.OrderedDict[str, list] = collections.OrderedDict()  # path -> [saved_at, loaded]
        self._busy: collections.Counter = collections.Counter()
        self._files_lock = threading.Lock()
        self._cleaner: threading.Thread | None = None
        self._cleaner_stop = threading.Event()

    def save(self, obj: Any) -> FileStorage:
        """Write ``obj`` to a new file atomically and return its handle."""
        storage = FileStorage(os.path.join(self.dirname, new_file_name()), allow_pickle=self.allow_pickle)
        try:
            storage.save(obj, fsync=self.fsync)
        except FileNotFoundError:  # the directory does not exist (yet, or any more)
            os.makedirs(self.dirname, exist_ok=True)
            storage.save(obj, fsync=self.fsync)
        with self._files_lock:
            self._files[storage.path] = [time.monotonic(), False]
            if self.ttl is not None and self._cleaner is None:
                self._cleaner_stop = threading.Event()
                self._cleaner = threading.Thread(target=self._clean_loop, args=(self._cleaner_stop,),
                                                 name="tsl-ttl-cleaner", daemon=True)
                self._cleaner.start()
        return storage

    def shutdown(self, timeout: float | None = None) -> None:
        super().shutdown(timeout)
        with self._files_lock:
            cleaner, self._cleaner = self._cleaner, None
            self._cleaner_stop.set()
        if cleaner is not None:
            cleaner.join()
        if self.remove_on_shutdown:
            with self._files_lock:
                paths = [p for p in self._files if not self._busy[p]]
                for p in paths:
                    del self._files[p]
            for p in paths:
                _remove(p)

    def _on_submit(self, storage: Storage) -> None:
        if isinstance(storage, FileStorage):
            with self._files_lock:
                self._busy[storage.path] += 1

    def _on_finish(self, storage: Storage) -> None:
        if isinstance(storage, FileStorage):
            with self._files_lock:
                self._busy[storage.path] -= 1
                if self._busy[storage.path] <= 0:
                    del self._busy[storage.path]
                entry = self._files.get(storage.path)
                if entry is not None:
                    entry[1] = True

    def clean_expired(self) -> int:
        """Delete expired files now (the cleaner thread calls this); returns how many went."""
        if self.ttl is None:
            return 0
        cutoff = time.monotonic() - self.ttl
        doomed = []
        with self._files_lock:
            for path, (saved_at, loaded) in self._files.items():
                if saved_at > cutoff:
                    break
                if not self._busy[path]:
                    doomed.append((path, loaded))
            for path, _ in doomed:
                del self._files[path]
        with self._lock:
            self._counts["expired"] += len(doomed)
            self._counts["expired_unloaded"] += sum(not loaded for _, loaded in doomed)
        for path, _ in doomed:
            _remove(path)
        return len(doomed)

    def _clean_loop(self, stop: threading.Event) -> None:
        period = min(1.0, self.ttl / 4)
        while not stop.wait(period):
            self.clean_expired()


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
