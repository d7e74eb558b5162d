"""Every file-name rule in one place: the names saved files get, their temporaries, and the
markers that sources append to claim or settle a file. ``clean`` deletes only names that match here."""

from __future__ import annotations

import os
import re
import time
import uuid

__all__ = [
    "DIR_CLAIM",
    "FAILED",
    "LOADED",
    "OBJECT_CLAIM",
    "SAVED_NAME",
    "SUFFIX",
    "TEMP_NAME",
    "new_file_name",
    "temp_name",
]

SUFFIX = ".tsl"
# A saved file: <20-digit ns time>-<pid>-<12 hex>.tsl, so names sort in save order.
SAVED_NAME = re.compile(r"(\d{20})-\d+-[0-9a-f]{12}\.tsl")
# Its temporary while being written: .<that name>.<32 hex>.tmp, renamed into place when complete.
TEMP_NAME = re.compile(r"\.(\d{20})-\d+-[0-9a-f]{12}\.tsl\.[0-9a-f]{32}\.tmp")
# Appended by sources: a directory claim NAME.claimed-HOST-TRAINER-PID, an object-store claim NAME.claim,
# and the settled states NAME.loaded (delete_after_load=False) and NAME.failed.
DIR_CLAIM, OBJECT_CLAIM, LOADED, FAILED = ".claimed-", ".claim", ".loaded", ".failed"


def new_file_name() -> str:
    """A unique name that sorts in save order (nanosecond clock first)."""
    return f"{time.time_ns():020d}-{os.getpid()}-{uuid.uuid4().hex[:12]}{SUFFIX}"


def temp_name(path: str) -> str:
    """Where ``path`` is written before it is renamed into place (same directory, so the rename is atomic)."""
    return os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
