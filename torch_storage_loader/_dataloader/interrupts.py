"""Ctrl-C on the trainer's thread while a ``StorageDataset`` iterator steps: held back to a safe point.

Python raises ``KeyboardInterrupt`` between any two bytecodes of the main thread. Inside a
DataLoader iterator's step that can leave a ``multiprocessing`` queue's lock held by no one (the
shutdown that follows waits on it for ever) or a sample taken off the delivery ledger and not yet
settled (lost). ``hooks`` marks the steps (``held``); here the SIGINT handler is wrapped so that a
Ctrl-C inside one waits for a safe point, and runs at once where the thread only waits.
"""

from __future__ import annotations

import _thread
import contextlib
import functools
import os
import selectors
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from .._proc import after_fork_in_child

__all__ = ["SAFE_WAITS", "Interrupts", "interrupts"]

# The selectors' waits (a multiprocessing queue's get, a connection's poll block in one): raised
# there, an error unwinds through with-blocks and try/finally only.
SAFE_WAITS = frozenset(
    c.select.__code__
    for c in vars(selectors).values()
    if isinstance(c, type) and issubclass(c, selectors.BaseSelector) and "select" in vars(c)
)

_CONDITION_WAIT = frozenset((threading.Condition.wait.__code__,))  # a queue.Queue's get (the pin-memory thread's)


class Interrupts:
    """Ctrl-C held back while the trainer's thread is inside a ``StorageDataset`` iterator's step.

    ``KeyboardInterrupt`` is raised wherever the trainer's thread is when Ctrl-C comes, like torch's
    SIGCHLD error (``hooks._Deaths``): inside ``multiprocessing.Queue.put`` between taking the
    queue's lock and the ``with`` that releases it (the iterator's shutdown then waits for ever on
    that lock), or between the ledger taking items off what is owed and settling them (a sample
    lost: a test saw 4 of 24 go that way). So while
    such an iterator lives, the SIGINT handler (Python's, or one the user set) is wrapped: inside
    ``__next__`` or the workers' shutdown (``held``) it runs at once only where the thread waits (a
    selector, a condition: what is unwound there is ``with`` blocks), else it is held back to the
    step's next safe point (before the items processed are handed over: they go back), or sent
    again as the step ends. A second Ctrl-C while one is held runs at once: a step that hangs can
    still be stopped. With no such iterator, the handler is the one it wrapped again."""

    def __init__(self) -> None:
        self.iterators: weakref.WeakSet[Any] = weakref.WeakSet()
        self.handler: Callable[[int, Any], Any] | None = None  # the handler wrapped
        self.depth = 0  # the trainer's thread is this deep in held sections
        self.pending = False  # a Ctrl-C was held back
        # Kept here: at interpreter exit, module globals are gone before an iterator's __del__ runs.
        current, main, start, kill, getpid, sigint = (
            threading.current_thread,
            threading.main_thread,
            _thread.start_new_thread,
            os.kill,
            os.getpid,
            signal.SIGINT,
        )
        self._on_main = lambda: current() is main()
        self._resend = lambda: start(kill, (getpid(), sigint))
        self._getsignal = functools.partial(signal.getsignal, signal.SIGINT)
        self._setsignal = functools.partial(signal.signal, signal.SIGINT)
        self._wrapper: Callable[[int, Any], None] | None = None  # _on_sigint, once set

    def guard(self, iterator: Any) -> None:
        """Wrap the SIGINT handler (a Python one: not ignored or the system's default) for ``iterator``."""
        if threading.current_thread() is not threading.main_thread():
            return  # signals are handled on the main thread only, and signal.signal works there only
        current = signal.getsignal(signal.SIGINT)
        if current is not _on_sigint:
            if not callable(current):
                return  # SIG_IGN, SIG_DFL, or set outside Python: Ctrl-C raises nothing to hold back
            self.handler, self._wrapper = current, _on_sigint
            signal.signal(signal.SIGINT, _on_sigint)
        self.iterators.add(iterator)

    def unguard(self, iterator: Any) -> None:
        """``iterator`` stopped: with no other left, the wrapped handler is put back (if still ours)."""
        self.iterators.discard(iterator)
        if self.iterators or not self._on_main():
            return
        if self._wrapper is not None and self._getsignal() is self._wrapper and self.handler is not None:
            self._setsignal(self.handler)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """A section of the trainer's thread where Ctrl-C waits for a safe point; one held back when
        the outermost section ends is sent again (to land after it)."""
        if not self._on_main():
            yield
            return
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if not self.depth and self.pending:
                self.pending = False
                # From a thread: it lands once this thread lets go of the GIL, in the trainer's own code
                # (threading.Thread would wait here for its start, where it would land inside this).
                try:
                    self._resend()
                except RuntimeError:  # no new thread as the interpreter exits: nothing left to stop
                    pass

    def raise_held(self) -> None:
        """At a safe point of a held section: run the handler of a Ctrl-C held back (it raises)."""
        if self.pending and self.handler is not None:
            self.pending = False
            self.handler(signal.SIGINT, sys._getframe(1))

    def on_signal(self, signum: int, frame: Any, safe: frozenset = SAFE_WAITS | _CONDITION_WAIT) -> None:
        handler = self.handler
        if handler is None:
            return
        if self.depth and not self.pending and not (frame is not None and frame.f_code in safe):
            self.pending = True
            return
        self.pending = False
        handler(signum, frame)


interrupts = Interrupts()


def _on_sigint(signum: int, frame: Any, interrupts: Interrupts = interrupts) -> None:
    interrupts.on_signal(signum, frame)  # (bound as a default: a signal may come as the interpreter exits)


@after_fork_in_child
def _none_held_in_child() -> None:
    interrupts.iterators, interrupts.depth, interrupts.pending = weakref.WeakSet(), 0, False
