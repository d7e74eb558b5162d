"""The ``tsl-receive`` thread: a DataLoader iterator's worker results received one ahead of the trainer.

Unpickling a worker's result is its receive (the sample built from its slot). This thread does it
while the trainer's thread computes or waits on its GPU, and hands over one result at a time
(``Handoff``); ``hooks`` starts it where torch would start its pin-memory thread, and torch's own
shutdown stops it. No torch here.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
from typing import Any

logger = logging.getLogger("torch_storage_loader")

# A for loop's last sample (held while it asks for the next), the one handed over, the one received
# ahead and the one a worker fills: with fewer slots, the one ahead would read as a consumer that keeps
# what it gets, and the worker would send copies.
AHEAD_MIN_SLOTS = 4
RECEIVE_CHECK_S = 5.0  # how often the tsl-receive thread checks it should stop (torch's pin thread: 5 s)
RECEIVE_JOIN_S = 30.0  # the longest a shutdown waits for it


class ReceiveThread(threading.Thread):
    """A daemon thread whose ``join()`` (torch's shutdown calls it without a timeout) gives up after
    ``RECEIVE_JOIN_S``: a worker killed halfway through writing a large result would leave the thread
    reading the rest for ever, and the trainer's shutdown with it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(daemon=True, **kwargs)

    def join(self, timeout: float | None = None) -> None:
        super().join(RECEIVE_JOIN_S if timeout is None else timeout)
        if timeout is None and self.is_alive():
            logger.warning("the tsl-receive thread did not stop within %.0f s; going on without it", RECEIVE_JOIN_S)


class Handoff:
    """At most one received result, from the ``tsl-receive`` thread to the trainer's; the trainer's
    side is what torch calls on its pin-memory thread's ``queue.Queue``: ``get(timeout=)``."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._result: Any = None
        self._full = False
        self.done = _Done(self._cond)  # torch sets it to stop the thread: that wakes the thread at once

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        with self._cond:
            if not self._cond.wait_for(lambda: self._full, timeout if block else 0):
                raise queue.Empty
            result, self._result, self._full = self._result, None, False
            self._cond.notify_all()
        return result

    def put(self, result: Any) -> None:
        with self._cond:
            self._result, self._full = result, True
            self._cond.notify_all()

    def wait_taken(self) -> bool:
        """Until the trainer took the last result (True), or the iterator is stopping (False)."""
        with self._cond:
            while self._full and not self.done.is_set():
                self._cond.wait(RECEIVE_CHECK_S)
            return not self.done.is_set()


class _Done(threading.Event):
    """The receive thread's stop event: setting it also wakes a thread waiting on ``cond``."""

    def __init__(self, cond: threading.Condition) -> None:
        super().__init__()
        self._wake = cond

    def set(self) -> None:
        super().set()
        with self._wake:
            self._wake.notify_all()


def receive(results: Any, handoff: Handoff, done: threading.Event) -> None:
    """The ``tsl-receive`` thread: torch's pin-memory loop without the pinning, one result ahead."""
    while handoff.wait_taken():
        try:
            r = results.get(timeout=RECEIVE_CHECK_S)
        except queue.Empty:
            continue
        except Exception:  # the queue broke under it: the trainer raises torch's error next
            if not done.is_set() and not sys.is_finalizing():
                logger.exception("the tsl-receive thread stopped")
            return
        if not done.is_set():
            handoff.put(r)
        del r  # nothing kept from one result to the next
