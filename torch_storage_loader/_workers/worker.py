"""The loop a ``StorageLoader`` worker process runs: load each handle into a slot and reply."""

from __future__ import annotations

import os
import signal
import socket
from multiprocessing.connection import Connection

from .._shm.filling import SlotFiller
from .._shm.segments import ENV_DIR
from .._stores import objects as _objects
from ..errors import pack_exception
from .protocol import STOP, Failed, Load, Loaded, Ready, dumps_with_fds, send_fds

__all__ = ["run_worker"]


def run_worker(
    conn: Connection[Ready | Loaded | Failed, Load | None],  # sends, receives
    n_slots: int,
    shm_directory: str,
    max_rings: int = 8,
    budget: int | None = None,
    object_stores: dict[str, _objects.Config] | None = None,
) -> None:
    """A StorageLoader worker: answer each ``Load`` with ``Loaded`` or ``Failed`` until ``STOP`` or EOF.

    ``object_stores``: the parent's object-store options (``_objects.snapshot()``), for ``ObjectStorage``.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops us
    os.environ[ENV_DIR] = shm_directory
    if object_stores:
        _objects.apply(object_stores)
    _objects.use_obstore_here()
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    filler = SlotFiller(n_slots, max_rings=max_rings, budget=budget)
    try:
        conn.send(Ready(os.getpid()))
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg is STOP:
                break
            payload = None
            try:
                info, payload = filler.fill(msg.storage)
                data, fds = dumps_with_fds(payload)
                reply: Loaded | Failed = Loaded(msg.request_id, info, data, len(fds))
            except BaseException as exc:  # noqa: BLE001 - everything goes back to the caller
                payload, fds = None, []
                reply = Failed(msg.request_id, *pack_exception(exc))
            try:
                conn.send(reply)
                if fds:
                    send_fds(sock, fds)
            except OSError:
                break
            finally:
                if payload is not None:
                    filler.sent(payload)
                del payload
    except (BrokenPipeError, ConnectionResetError):
        pass  # the parent is gone
    finally:
        filler.close()
        sock.close()
        conn.close()
