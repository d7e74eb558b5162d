"""Whether a process on this host is alive (a zombie, dead but not yet reaped, counts as dead)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def trainer_alive(family: str, pid: int) -> bool:
    """Whether the trainer behind a claim lives: its family is its pid (else the claiming process's)."""
    return pid_alive(int(family)) if family.isdigit() else pid_alive(pid)
