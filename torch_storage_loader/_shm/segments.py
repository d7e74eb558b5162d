"""Shared memory that cannot leak: a tmpfs file unlinked at birth, passed between processes as an fd.

A ``ShmSegment`` is opened with ``O_TMPFILE``: it never has a name, so no resource tracker is
involved, a process killed at any point leaves nothing behind, and the memory is freed when the last
descriptor and mapping are gone (``/proc/<pid>/maps`` shows it as ``<dir>/#<inode> (deleted)``).
Where the filesystem refuses ``O_TMPFILE``, ``mkstemp`` and an immediate ``unlink`` stand in: a
``tsl-XXXXXXXX`` name for microseconds, and an empty file left if the process is SIGKILLed inside
that window. Pickling one sends a duplicate of its descriptor (``multiprocessing.reduction.DupFd``): to a child being started, or to any process
through the sender's ``resource_sharer``.
"""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
import weakref
from multiprocessing import reduction

from ..errors import InsufficientSharedMemoryError

__all__ = ["ShmSegment", "default_shm_budget", "shm_dir"]

ENV_DIR = "TORCH_STORAGE_LOADER_SHM_DIR"
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def shm_dir() -> str:
    """Where segments live: ``$TORCH_STORAGE_LOADER_SHM_DIR``, else ``/dev/shm``, else the temp dir."""
    env = os.environ.get(ENV_DIR)
    if env:
        return env
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def default_shm_budget() -> int:
    """The default ``max_shm_bytes`` of a loader or dataset: half the size of the shm filesystem."""
    st = os.statvfs(shm_dir())
    return st.f_blocks * st.f_frsize // 2


def free_shm_bytes(where: str | None = None) -> int:
    """Bytes free for unprivileged use in the shm filesystem (``where``, default ``shm_dir()``)."""
    st = os.statvfs(where or shm_dir())
    return st.f_bavail * st.f_frsize


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _too_small(size: int, free: int, where: str, purpose: str) -> InsufficientSharedMemoryError:
    return InsufficientSharedMemoryError(
        f"{purpose} needs {_human(size)} of shared memory in {where}, but only {_human(free)} is free. "
        f"Give it more (docker run --shm-size=<size>, or a Kubernetes emptyDir with medium: Memory "
        f"mounted at /dev/shm), point ${ENV_DIR} at a larger tmpfs, or lower worker_num / "
        "slots_per_worker / batch_size",
        needed=size,
        free=free,
        directory=where,
    )


def _open_unnamed(where: str) -> int:
    """A new empty file in ``where`` that has no name (``O_TMPFILE``), or whose name is already gone."""
    try:
        return os.open(where, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except (AttributeError, OSError) as exc:  # not Linux, or a filesystem without O_TMPFILE support
        if isinstance(exc, OSError) and exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    fd, name = tempfile.mkstemp(prefix="tsl-", dir=where)
    os.unlink(name)
    return fd


def _create_fd(size: int, purpose: str) -> int:
    where = shm_dir()
    free = free_shm_bytes(where)
    if size > free:
        raise _too_small(size, free, where, purpose)
    fd = _open_unnamed(where)
    try:
        try:
            # Reserve every page now: running out later would be a SIGBUS on first touch.
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise _too_small(size, free, where, purpose) from None
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


class ShmSegment:
    """A mapped shared-memory region of ``size`` bytes; picklable (sends a descriptor, not data)."""

    def __init__(self, size: int, *, purpose: str = "a shared-memory slot ring", fd: int | None = None) -> None:
        if size <= 0:
            raise ValueError(f"{size=} must be > 0")
        self.size = size
        creator = fd is None
        fd = _create_fd(size, purpose) if creator else fd
        try:
            # The creator fills every page, so it maps them all in one go instead of one fault each;
            # a receiver faults in only the pages it reads.
            self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | (_POPULATE if creator else 0))
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._close_fd = weakref.finalize(self, os.close, fd)

    def __reduce__(self):
        if self._fd < 0:
            raise ValueError("cannot pickle a ShmSegment whose descriptor was released")
        return _rebuild, (reduction.DupFd(self._fd), self.size)

    def release_fd(self) -> None:
        """Close the descriptor; the mapping stays valid, but the segment can no longer be sent."""
        if self._close_fd.detach():
            os.close(self._fd)
        self._fd = -1

    def close(self) -> None:
        """Close the descriptor and unmap, unless views into it are still alive (then they keep it)."""
        self.release_fd()
        try:
            self.mm.close()
        except BufferError:
            pass  # exported views own the mapping now; it goes away with the last of them


def _rebuild(dupfd, size: int) -> ShmSegment:
    seg = ShmSegment(size, fd=dupfd.detach())
    seg.release_fd()  # a receiver never re-sends; the mapping is all it needs
    return seg
