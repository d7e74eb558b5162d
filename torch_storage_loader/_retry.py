"""Exponential back-off within a time budget: the one retry loop of the Redis client and the object stores."""

from __future__ import annotations

import threading
import time

__all__ = ["Backoff"]


class Backoff:
    """Waits of ``first`` seconds, doubling up to ``cap``, for as long as ``seconds`` from now allow.

    The caller tries, and on a transient failure asks ``spent()`` (would the next wait end past the
    deadline?) before it ``wait()``s and tries again.
    """

    def __init__(self, seconds: float, *, first: float = 0.05, cap: float = 1.0) -> None:
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.delay = first
        self.cap = cap

    def spent(self, now: float | None = None) -> bool:
        """Whether the next wait would end past the deadline (give up now)."""
        return (time.monotonic() if now is None else now) + self.delay > self.deadline

    def left(self) -> float:
        """Seconds until the deadline (negative once past it)."""
        return self.deadline - time.monotonic()

    def wait(self, stop: threading.Event | None = None) -> None:
        """Sleep the current delay (cut short when ``stop`` is set), then double it up to ``cap``."""
        if stop is not None:
            stop.wait(self.delay)
        else:
            time.sleep(self.delay)
        self.delay = min(self.delay * 2, self.cap)
