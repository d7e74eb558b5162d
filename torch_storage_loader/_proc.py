"""Whether a process on this host is alive (a zombie, dead but not yet reaped, counts as dead),
and the size of the pipes processes talk through.

Claims name their trainer's pid; whoever wrote the claim may have written anything, so pids are
parsed here, ASCII digits only and within the kernel's range, before any ``os.kill`` sees them.
"""

from __future__ import annotations

import fcntl
import os
import re

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


def pipe_capacity(fd: int, want: int) -> int:
    """The size of the pipe ``fd``, raised to ``want`` bytes where the system lets us."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, want)
    except (AttributeError, OSError):
        pass  # not Linux, or over /proc/sys/fs/pipe-max-size: the pipe keeps its size
    try:
        return int(fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ))
    except (AttributeError, OSError):
        return 65536  # POSIX guarantees less, but every system this runs on has at least this
