"""Process helpers, each written once: whether a process on this host is alive, the size of the
pipes processes talk through, locks a forked child gets free, and the self-pipe that wakes a thread
waiting in ``select``.

Claims name their trainer's pid; whoever wrote the claim may have written anything, so pids are
parsed here, ASCII digits only and within the kernel's range, before any ``os.kill`` sees them.

Forks. A thread of the parent may hold a lock when another thread forks; the child has no such
thread, so it would wait forever on a plain ``threading.Lock``. ``fork_safe_lock`` is renewed in the
child by one at-fork hook, and ``after_fork_in_child`` registers the hooks that do more (forget the
parent's loaders, rings or CUDA registrations): ``os.register_at_fork`` is called here only.

Processes are watched three ways on purpose, each the cheapest its caller can have: ``pid_alive``
for pids read from claims and queues (any process on the host, checked now and then); the loader's
``WorkerPool`` selects on ``multiprocessing``'s sentinel of each worker it started (there whatever
the start method or platform, at no extra descriptor); the slot registry, which has only the pids
of torch's DataLoader workers, opens a pidfd for each where it can. One helper for the last two
would add a descriptor per loader worker, or take the registry's only way to watch torch's.
"""

from __future__ import annotations

import _thread
import fcntl
import os
import re
import struct
import threading
import weakref
from collections.abc import Callable
from typing import Any

PID_MAX = 1 << 22  # the kernel's largest pid_max (PID_MAX_LIMIT on 64-bit Linux)
_DIGITS = re.compile(r"[0-9]{1,7}")  # ASCII only: str.isdigit() also takes "²" and "٣"


def parse_pid(text: object) -> int | None:
    """The pid ``text`` spells (ASCII digits, 1 to ``PID_MAX``), else None."""
    if type(text) is not str or not _DIGITS.fullmatch(text):
        return None
    pid = int(text)
    return pid if 1 <= pid <= PID_MAX else None


def pid_alive(pid: int) -> bool:
    if type(pid) is not int or not 1 <= pid <= PID_MAX:
        return False  # never reaches os.kill: 0 and -1 would signal process groups
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def trainer_alive(family: str, pid: int) -> bool:
    """Whether the trainer behind a claim lives: its family is its pid (else the claiming process's)."""
    trainer = parse_pid(family)
    return pid_alive(trainer if trainer is not None else pid)


def raise_pipe(fd: int, want: int) -> None:
    """Raise the pipe ``fd`` to ``want`` bytes where the system lets us (else it keeps its size)."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, want)
    except (AttributeError, OSError):
        pass  # not Linux, over /proc/sys/fs/pipe-max-size, or this user's pipes use up its share


def after_fork_in_child(hook: Callable[[], None]) -> Callable[[], None]:
    """Run ``hook`` in every child this process forks, before the child goes on (a decorator)."""
    os.register_at_fork(after_in_child=hook)
    return hook


def before_fork(hook: Callable[[], None]) -> Callable[[], None]:
    """Run ``hook`` in this process before each fork, in the forking thread (a decorator)."""
    os.register_at_fork(before=hook)
    return hook


def fork_safe_lock() -> _thread.RLock:
    """A lock for ``with`` blocks, free in a child forked while another thread held it (the child
    re-initialises it; what it guards is as the parent's holder left it at the fork).

    The C lock itself, not a wrapper: ``with`` takes and lets go of it in C, where a signal
    handler's error (torch raises a dead DataLoader worker's from its SIGCHLD handler, wherever the
    trainer's thread is) cannot come between; raised between a Python ``__enter__``'s acquire and
    its return, it would leave the lock held for ever. Reentrant: a finalizer the garbage collector
    runs inside a section may take it again.
    """
    lock = _thread.RLock()
    _fork_safe_locks.add(lock)
    return lock


_fork_safe_locks: weakref.WeakSet[_thread.RLock] = weakref.WeakSet()


def signal_safe_condition() -> tuple[Any, threading.Condition]:
    """A lock and a condition over it, for state that code on the trainer's thread guards.

    Enter the lock (``with lock``), never the condition: ``Condition.__enter__`` is Python, and a
    signal handler that raises there (torch's SIGCHLD handler for a dead DataLoader worker, Ctrl-C's
    ``KeyboardInterrupt``) after it took the lock leaves the lock held for ever, and every other
    thread that needs it waits for ever (``with condition`` kept the lock in 25 of 72 such signals in
    a test; ``with lock``, taken and entered in C, in none of 9,977). ``condition.wait`` and
    ``notify`` work as usual with the lock held. The lock is reentrant: ``Condition.wait`` lets go of
    an RLock and takes it back in C (a plain Lock's are Python, where an interrupt could leave it
    let go inside the ``with``, whose exit would then release a lock it does not hold).
    """
    lock = threading.RLock()
    return lock, threading.Condition(lock)


@after_fork_in_child
def _renew_locks_in_child() -> None:
    for lock in list(_fork_safe_locks):
        lock._at_fork_reinit()  # type: ignore[attr-defined]  # what CPython's threading does for its own locks in a forked child


class WakePipe:
    """A self-pipe: ``wake()``, from any thread, makes ``fileno()`` readable until ``drain()``.

    Both ends are non-blocking and close on exec (``os.pipe``'s default). A full pipe already holds
    a wake-up, so ``wake`` then drops its bytes; after ``close`` it does nothing (under a lock, so it
    never writes to a descriptor number reused since). What ``wake`` writes is the caller's: one
    that says why it woke (the ledger's ``b"a"`` and ``b"x"``) reads it back from ``drain``.
    """

    __slots__ = ("_lock", "_r", "_w")

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._lock = fork_safe_lock()

    def fileno(self) -> int:
        """The read end, for ``select`` (-1 once closed)."""
        return self._r

    def wake(self, what: bytes = b"\0") -> None:
        with self._lock:
            if self._w >= 0:
                try:
                    os.write(self._w, what)
                except BlockingIOError:
                    pass  # full: the reader is awake anyway

    def drain(self) -> bytes:
        """The bytes woken with since the last drain (at most 4096; b"" if none)."""
        try:
            return os.read(self._r, 4096)
        except BlockingIOError:
            return b""

    def close(self) -> None:
        with self._lock:
            fds, self._r, self._w = (self._r, self._w), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)


def frame(data: bytes | memoryview) -> bytes:
    """``data`` framed as ``multiprocessing.connection.Connection.send_bytes`` frames it (its length,
    4 bytes; or -1 and 8), for ``recv_bytes`` (or ``recv``) at the other end of a pipe written raw."""
    n = len(data)
    return (struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)) + data
