"""``FileStorageLoader``: one file per ``save`` in a directory, deleted after ``ttl`` seconds."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import os
import threading
import time
import warnings
import weakref
from typing import Any

from ._format.names import new_file_name  # re-exported: file_loader.new_file_name stays
from ._options import check_option
from ._proc import fork_safe_lock
from ._stores import clean as _clean
from ._stores import objects as _objects
from .errors import StorageError
from .loader import StorageLoader
from .storage import FileStorage, ObjectStorage, Storage

__all__ = ["FileStorageLoader", "new_file_name"]

_log = logging.getLogger(__name__)

SHUTDOWN_S = 10.0  # at most this long for shutdown's own clean-up (joining the cleaner, deleting objects)


# Every FileStorageLoader of this process: a directory scan spares what any of them tracks or loads.
_loaders: weakref.WeakSet[FileStorageLoader] = weakref.WeakSet()
_loaders_lock = fork_safe_lock()


def _file_key(path: str) -> str:
    # Handles may spell a path differently (relative, "dir//name"); pin files by one spelling.
    return path if _objects.is_url(path) else os.path.abspath(path)


@dataclasses.dataclass(slots=True)
class _SavedFile:
    """A file this loader saved and tracks until its TTL: when (monotonic clock), whether a load of
    it finished in this process, and the path its handle names."""

    saved_at: float
    path: str
    loaded: bool = False


# Size: 183 lines of code (saving, the directory's lifetime and ttl sweeping); the other 70 are docstrings.
class FileStorageLoader(StorageLoader):
    """Saves each sample to its own file under ``dirname`` (created with parents).

    Files live until they are ``ttl`` seconds old (``ttl=None``: forever), whoever shuts down
    first, so handles stay loadable by other processes after this loader or its process is gone.
    A background cleaner (started by the first ``save`` or ``load``) deletes this loader's files
    once expired, except while a load of the file is queued or in flight in this process, and
    deletes this library's files in ``dirname`` that other loaders left (a process that ended, a
    loader already shut down) once their mtime is ``ttl`` seconds old; it never touches other
    files, files being written, or files a ``DirectorySource`` claimed. Loaders sharing a
    directory should use the same ``ttl``. ``stats().expired`` counts both kinds;
    ``expired_unloaded`` counts this loader's own files that expired before anyone loaded them (in
    any process: a read moves a file's access time; where reads leave no trace, on an object store
    or a ``noatime`` mount, before this loader did). The first of them are reported by one
    ``UserWarning`` per loader, with their count and the ``ttl`` to raise, as the cleaner deletes them.

    ``shutdown`` deletes the loader's files that already expired and keeps the others for their
    TTL; ``remove_on_shutdown=True`` deletes all of them instead (only when no other process
    loads the handles later). A process forked from one holding this loader never deletes the
    parent's files. ``python -m torch_storage_loader clean DIR --older-than SECONDS`` removes
    leftovers by hand.

    ``dirname`` may be an object-store prefix, any fsspec URL (``s3://bucket/prefix``; ``file://``
    is a local path): each sample is then one object, published whole, and ``save`` returns an
    ``ObjectStorage``. ``storage_options`` go to fsspec as they are (for s3fs: ``key``, ``secret``,
    ``endpoint_url``...) and reach the workers, never the handles; without them, what
    ``configure_object_store`` set applies, else the client reads the environment. ``retry_timeout``
    bounds retries of transient errors (default 30 s). Expired objects are found by listing the
    prefix (every 10 s at most) and aged by the store's clock.

    Args:
        dirname: The directory (created with parents on the first ``save``) or object-store prefix URL.
        ttl: Seconds a file lives after it was saved; None keeps files until deleted by hand.
        worker_num: How many worker processes load samples.
        allow_pickle: Let ``save`` pickle values it cannot store as raw bytes, and loads unpickle them;
            leave it off unless every writer of the directory is trusted.
        fsync: Flush each file to disk before it takes its name (slower; survives a crash of the machine).
        remove_on_shutdown: Delete all of this loader's files on ``shutdown``, expired or not.
        storage_options: fsspec options for an object-store ``dirname`` (credentials, endpoint).
        retry_timeout: Seconds to retry transient object-store errors for (default 30); object stores only.
        **loader_options: Passed to ``StorageLoader`` (``slots_per_worker``, ``max_shm_bytes``, ...).

    Raises:
        TypeError: An option has the wrong type (the message names it and the type expected).
        ValueError: ``ttl`` is not positive, or ``storage_options``/``retry_timeout`` are given for a
            local directory.
    """

    def __init__(
        self,
        dirname: str | os.PathLike[str],
        ttl: float | None = 20,
        worker_num: int = 3,
        *,
        allow_pickle: bool = False,
        fsync: bool = False,
        remove_on_shutdown: bool = False,
        storage_options: dict[str, Any] | None = None,
        retry_timeout: float | None = None,
        **loader_options: Any,
    ) -> None:
        check_option("ttl", ttl, float, above=0, none="to keep files forever")
        for name, value in [
            ("allow_pickle", allow_pickle),
            ("fsync", fsync),
            ("remove_on_shutdown", remove_on_shutdown),
        ]:
            check_option(name, value, bool)
        if retry_timeout is not None:
            check_option("retry_timeout", retry_timeout, float, least=0)
        dirname = os.fspath(dirname)
        self.remote = _objects.is_url(dirname)
        if not self.remote and (storage_options or retry_timeout is not None):
            raise ValueError(f"storage_options and retry_timeout are for object-store URLs, not {dirname!r}")
        if self.remote and (storage_options is not None or retry_timeout is not None):
            _objects.configure_object_store(dirname, storage_options, retry_timeout=retry_timeout)
        super().__init__(worker_num, **loader_options)
        self.dirname = dirname.rstrip("/") if self.remote else _objects.local_path(dirname)
        self.ttl = ttl
        self.allow_pickle = allow_pickle
        self.fsync = fsync
        self.remove_on_shutdown = remove_on_shutdown
        self._forget_files()
        with _loaders_lock:
            _loaders.add(self)

    def _forget_files(self) -> None:
        self._files: collections.OrderedDict[str, _SavedFile] = collections.OrderedDict()  # in save order
        self._busy: collections.Counter[str] = collections.Counter()  # key -> loads queued or in flight
        self._files_lock = threading.Lock()
        self._cleaner: threading.Thread | None = None
        self._cleaner_stop = threading.Event()
        self._unloaded_unwarned = 0  # files the ttl deleted unread, not warned of yet (see _warn_unloaded)
        self._unloaded_warned = False

    def save(self, obj: Any) -> FileStorage | ObjectStorage:
        """Write ``obj`` to a new file (or object) atomically and return its handle.

        Args:
            obj: The sample: tensors, arrays and plain values, nested in dicts, lists and tuples.

        Returns:
            A ``FileStorage`` for a directory, an ``ObjectStorage`` for an object-store prefix.

        Raises:
            UnsupportedLeafError: ``obj`` holds a value that needs pickle and ``allow_pickle`` is off.
        """
        if self.remote:
            remote = ObjectStorage(f"{self.dirname}/{new_file_name()}", allow_pickle=self.allow_pickle)
            remote.save(obj)
            with self._files_lock:
                self._files[remote.path] = _SavedFile(time.monotonic(), remote.path)
                self._start_cleaner_locked()
            return remote
        storage = FileStorage(os.path.join(self.dirname, new_file_name()), allow_pickle=self.allow_pickle)
        try:
            storage.save(obj, fsync=self.fsync)
        except FileNotFoundError:  # the directory does not exist (yet, or any more)
            os.makedirs(self.dirname, exist_ok=True)
            storage.save(obj, fsync=self.fsync)
        with self._files_lock:
            self._files[_file_key(storage.path)] = _SavedFile(time.monotonic(), storage.path)
            self._start_cleaner_locked()
        return storage

    def shutdown(self, timeout: float | None = None) -> None:
        """As ``StorageLoader.shutdown``; then deletes the files that expired (all of this loader's
        files not being loaded with ``remove_on_shutdown=True``) and forgets the others, which stay
        until their TTL (another loader on the directory, or ``clean``, deletes them then).

        Args:
            timeout: Seconds to wait for pending loads; None waits for all of them. It also bounds
                the clean-up (at most 10 s in any case).
        """
        super().shutdown(timeout)
        with self._files_lock:
            cleaner, self._cleaner = self._cleaner, None
            self._cleaner_stop.set()  # also cuts short the cleaner's retries of a store that is down
        bound = SHUTDOWN_S if timeout is None else min(SHUTDOWN_S, max(timeout, 0.1))
        if cleaner is not None:
            cleaner.join(bound)
            if cleaner.is_alive():
                _log.warning(
                    "the TTL cleaner of %s did not stop within %g s; it is left to finish alone", self.dirname, bound
                )
        # Object stores may be down: deletions give up after ``bound`` (others, or `clean`, delete them later).
        with _objects.bounded(seconds=bound):
            try:
                if self.remove_on_shutdown:
                    with self._files_lock:
                        doomed = [self._files.pop(key).path for key in [k for k in self._files if not self._busy[k]]]
                    for path in doomed:
                        _clean.remove(path)
                else:
                    self._clean_own()
            except StorageError as exc:
                _log.warning("shutdown left expired files of %s for a later clean-up: %s", self.dirname, exc)
        self._warn_unloaded(0, final=True)
        with self._files_lock:
            for key in [k for k in self._files if not self._busy[k]]:
                del self._files[key]

    def clean_expired(self) -> int:
        """Delete expired files now (the cleaner thread calls this).

        Returns:
            How many files (or objects) were deleted; 0 when ``ttl`` is None.
        """
        if self.ttl is None:
            return 0
        return self._clean_own() + self._clean_directory()

    # ------------------------------------------------------------------------------- internals
    def _start_cleaner_locked(self) -> None:
        if self.ttl is not None and self._cleaner is None:
            self._cleaner_stop = threading.Event()
            self._cleaner = threading.Thread(
                target=self._clean_loop, args=(self._cleaner_stop,), name="tsl-ttl-cleaner", daemon=True
            )
            self._cleaner.start()

    def _on_submit(self, storage: Storage) -> None:
        with self._files_lock:
            if isinstance(storage, (FileStorage, ObjectStorage)):
                self._busy[_file_key(storage.path)] += 1
            self._start_cleaner_locked()  # a loader that only loads cleans its directory too

    def _on_finish(self, storage: Storage) -> None:
        if isinstance(storage, (FileStorage, ObjectStorage)):
            key = _file_key(storage.path)
            with self._files_lock:
                self._busy[key] -= 1
                if self._busy[key] <= 0:
                    del self._busy[key]
                saved = self._files.get(key)
                if saved is not None:
                    saved.loaded = True

    def _clean_own(self) -> int:
        """Delete this loader's files older than ``ttl`` (by the monotonic clock) and not being loaded."""
        if self.ttl is None:
            return 0
        cutoff = time.monotonic() - self.ttl
        doomed: list[_SavedFile] = []
        with self._files_lock:  # decided under the lock: a load queued before this cannot lose its file
            for key, saved in self._files.items():
                if saved.saved_at > cutoff:
                    break
                if not self._busy[key]:
                    doomed.append(saved)
            for saved in doomed:
                del self._files[_file_key(saved.path)]
        # Deleted outside it (an unlink on a slow NFS, a request retried for long): saves and loads go on.
        # A load queued meanwhile names a file that had expired: it fails as if it came a moment later.
        unloaded = unread = 0
        for saved in doomed:
            read = saved.loaded or _clean.read_since_written(saved.path)  # None: reads leave no trace there
            unloaded += not read
            unread += read is False
            _clean.remove(saved.path)
        if doomed:
            with self._lock:
                self._counts["expired"] += len(doomed)
                self._counts["expired_unloaded"] += unloaded
        self._warn_unloaded(unread)
        return len(doomed)

    def _warn_unloaded(self, new: int, *, final: bool = False) -> None:
        """Warn, once per loader, of its files the ttl deleted before anyone read them (``new`` more now).

        Given at the sweep after the first one that deleted some (files saved together but expiring
        across two sweeps are counted together), or at ``shutdown``: while it happens, with nothing
        to call, so that a load finding no file later is explained. ``stats().expired_unloaded``
        goes on counting them.
        """
        with self._lock:
            if self._unloaded_warned:
                return
            earlier = self._unloaded_unwarned
            self._unloaded_unwarned += new
            if not self._unloaded_unwarned or not (earlier or final):
                return
            self._unloaded_warned, count = True, self._unloaded_unwarned
        warnings.warn(
            f"{count} file{'s' if count != 1 else ''} FileStorageLoader({self.dirname!r}) saved were deleted by "
            f"its ttl={self.ttl:g} s before anyone loaded them: raise ttl= (or load them sooner) if they were "
            "wanted. stats().expired_unloaded counts every such file; this warning is given once per loader.",
            UserWarning,
            stacklevel=2,
        )

    def _clean_directory(self) -> int:
        """Delete this library's files in ``dirname`` older than ``ttl`` by mtime that no loader of
        this process tracks or loads (left by a process that ended, or by a loader shut down)."""
        assert self.ttl is not None  # the cleaner runs only with a ttl
        paths = _clean.expired_files(self.dirname, self.ttl)
        if not paths:
            return 0
        with _loaders_lock:
            loaders = sorted(_loaders, key=id)
        doomed = []
        with contextlib.ExitStack() as stack:
            for loader in loaders:  # always in the same order: no deadlock between two scans
                stack.enter_context(loader._files_lock)
            for path in paths:
                key = _file_key(path)
                if not any(key in loader._files or loader._busy[key] for loader in loaders):
                    doomed.append(path)
        removed = sum(_clean.remove(path) for path in doomed)  # outside every loader's lock
        if removed:
            with self._lock:
                self._counts["expired"] += removed
        return removed

    def _clean_loop(self, stop: threading.Event) -> None:
        ttl = self.ttl
        assert ttl is not None  # the cleaner runs only with a ttl
        period = min(1.0, ttl / 4)
        scan_every = math.ceil(min(10.0, ttl) / period) if self.remote else 1  # listings cost requests
        tick = 0
        while not stop.wait(period):
            tick += 1
            try:
                with _objects.bounded(stop=stop):  # shutdown() stops retries of a store that is down
                    if tick % scan_every:
                        self._clean_own()
                    else:
                        self.clean_expired()
            except Exception as exc:  # noqa: BLE001 -- e.g. an object store out of reach: try again at the next tick
                if not stop.is_set():
                    _log.warning("TTL clean-up of %s failed, will retry: %s", self.dirname, exc)

    def _after_fork_in_child(self) -> None:
        """In a forked child: the parent's files are the parent's; never delete them from here."""
        super()._after_fork_in_child()
        self._forget_files()
