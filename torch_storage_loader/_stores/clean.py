"""Finding this library's expired files in a directory (``FileStorageLoader``'s scan, the ``clean`` command).

Only names that ``_format.names.new_file_name()`` makes count (``<20-digit ns time>-<pid>-<12 hex>.tsl``),
and the temporaries ``_format.write`` renames into them (``.<that name>.<32 hex>.tmp``). Anything
else is never touched: other programs' files, files a ``DirectorySource`` consumer claimed
(``*.tsl.claimed-*``), kept as ``*.tsl.loaded`` / ``*.tsl.failed``, or written under other names.
Age is judged by mtime. A temporary is a file being written, so it only goes once older than
``max(older_than, TMP_GRACE_S)``: by then its writer has died. On an object-store prefix
(``s3://bucket/prefix``) the same names count, aged by the store's last-modified time; objects
are published whole, so there are no temporaries there.
"""

from __future__ import annotations

import os
import stat
import time

from .._format.names import SAVED_NAME, TEMP_NAME
from . import objects as _objects

__all__ = ["TMP_GRACE_S", "expired_files", "read_since_written", "remove"]

TMP_GRACE_S = 600.0


def expired_files(dirname: str, older_than: float, *, now: float | None = None) -> list[str]:
    """Paths of this library's files in ``dirname`` (a directory, or an object-store prefix URL) last
    modified over ``older_than`` s ago, oldest first.

    One ``os.scandir`` pass; a name younger than the cutoff (names start with their save time) is
    skipped without a ``stat``. Files that vanish meanwhile, and a missing directory, are no error.
    """
    now = time.time() if now is None else now
    cutoff = now - older_than
    if _objects.is_url(dirname):
        return [
            e.url
            for e in sorted(_objects.listing(dirname), key=lambda e: e.mtime)
            if SAVED_NAME.fullmatch(e.url.rsplit("/", 1)[-1]) and e.mtime <= cutoff
        ]
    tmp_cutoff = now - max(older_than, TMP_GRACE_S)
    found: list[tuple[float, str]] = []
    try:
        entries = os.scandir(dirname)
    except (FileNotFoundError, NotADirectoryError):
        return []
    with entries:
        for entry in entries:
            name = entry.name
            match = SAVED_NAME.fullmatch(name)
            limit = cutoff
            if match is None:
                match = TEMP_NAME.fullmatch(name)
                if match is None:
                    continue
                limit = tmp_cutoff
            if int(match.group(1)) / 1e9 > limit:
                continue  # saved after the cutoff by its writer's clock: too young, no stat needed
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_mtime <= limit:
                found.append((st.st_mtime, entry.path))
    found.sort()
    return [path for _, path in found]


def remove(path: str) -> bool:
    """Delete ``path``; False when it was gone already (another cleaner or a consumer took it)."""
    if _objects.is_url(path):
        return _objects.remove(path)
    try:
        os.remove(path)
    except FileNotFoundError:
        return False
    return True


def read_since_written(path: str) -> bool | None:
    """Whether anyone read ``path`` (any process: a loader's worker, a learner's) since it was written.

    A read moves a file's access time past its modification time (Linux's default ``relatime``
    mounts record the first read after a write). A file gone already was taken (claimed by a
    consumer, or deleted): True. None where reads leave no trace: an object store, or a directory
    mounted ``noatime``.
    """
    if _objects.is_url(path):
        return None
    try:
        st = os.stat(path)
        if os.statvfs(path).f_flag & os.ST_NOATIME:
            return None
    except FileNotFoundError:
        return True
    return st.st_atime_ns > st.st_mtime_ns
