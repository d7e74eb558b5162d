"""Loader worker processes: the loop each one runs."""

from __future__ import annotations

import os
import signal
from multiprocessing.reduction import ForkingPickler

from ._shm import ENV_DIR
from ._worker import SlotFiller
from .errors import pack_exception

__all__ = ["run_worker"]


def run_worker(conn, n_slots: int, slot_size_hint: int, shm_directory: str, max_rings: int = 8,
               budget: int | None = None) -> None:
    """A StorageLoader worker: serve ``(request_id, storage)`` until ``None`` or the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops us
    os.environ[ENV_DIR] = shm_directory
    filler = SlotFiller(n_slots, slot_size_hint, max_rings=max_rings, budget=budget)
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg is None:
                break
            request_id, storage = msg
            try:
                info, payload = filler.fill(storage)
                # Pickled here, unpickled apart from the envelope: a failure to map the slot in
                # the parent is then that request's error, not a broken pipe.
                reply = (request_id, info, bytes(ForkingPickler.dumps(payload)))
                filler.sent(payload)
                del payload
            except BaseException as exc:  # noqa: BLE001 - everything goes back to the caller
                reply = (request_id, None, pack_exception(exc))
            try:
                conn.send(reply)
            except (BrokenPipeError, OSError):
                break
    finally:
        filler.close()
        conn.close()
