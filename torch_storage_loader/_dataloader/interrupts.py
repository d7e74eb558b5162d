"""Ctrl-C on the trainer's thread while a ``StorageDataset`` iterator steps: held back to a safe point.

Python raises ``KeyboardInterrupt`` between any two bytecodes of the main thread. Inside a
DataLoader iterator's step that can leave a ``multiprocessing`` queue's lock held by no one (the
shutdown that follows waits on it for ever) or a sample taken off the delivery ledger and not yet
settled (lost). ``hooks`` names its steps' functions (``section``); here the SIGINT handler is
wrapped so that a Ctrl-C inside one waits for a safe point, and runs at once where the trainer
only waits for its next item.
"""

from __future__ import annotations

import _thread
import functools
import os
import selectors
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from types import CodeType, FrameType
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


RESEND_S = 0.02  # how often a Ctrl-C held back is sent again, until it lands where it may be raised


class Interrupts:
    """Ctrl-C held back while the trainer's thread is inside a ``StorageDataset`` iterator's step.

    ``KeyboardInterrupt`` is raised wherever the trainer's thread is when Ctrl-C comes, like torch's
    SIGCHLD error (``hooks._Deaths``): inside ``multiprocessing.Queue.put`` between taking the
    queue's lock and the ``with`` that releases it (the iterator's shutdown then waits for ever on
    that lock), or between the ledger taking items off what is owed and settling them (a sample
    lost: a test saw 4 of 24 go that way). So while such an iterator lives, the SIGINT handler
    (Python's, or one the user set) is wrapped. A Ctrl-C whose frames run through a step's function
    (``section``) is held back, except where the step only waits for the next item (a selector, a
    condition, in ``__next__``): there it runs at once. One held back runs at the step's next safe
    point (``raise_held``: before the items processed are handed over, so they go back), and a
    thread sends it again every ``RESEND_S`` until it lands where it may run: that wait, or the
    trainer's own code once the step is over. A second Ctrl-C while one is held runs at once, so a
    step that hangs can still be stopped (inside a ``__del__``, where Python would swallow it, it
    also stays held, to land after). Whether the thread is in a step is read off the frames as the
    signal comes: nothing is counted per step. With no such iterator left, the handler is the one
    it wrapped again."""

    def __init__(self) -> None:
        self.iterators: weakref.WeakSet[Any] = weakref.WeakSet()
        self.handler: Callable[[int, Any], Any] | None = None  # the handler wrapped
        self.pending = False  # a Ctrl-C was held back
        self._sections: dict[CodeType, bool] = {}  # a step's function -> whether its waits let Ctrl-C through
        self._calling = False  # the wrapped handler runs (one that chains back to ours must not loop)
        self._resent = False  # the signal coming is the resending thread's, not a second Ctrl-C
        self._resending = False  # that thread runs
        # Kept here: at interpreter exit, module globals are gone before an iterator's __del__ runs.
        current, main = threading.current_thread, threading.main_thread
        self._on_main = lambda: current() is main()
        self._getsignal = functools.partial(signal.getsignal, signal.SIGINT)
        self._setsignal = functools.partial(signal.signal, signal.SIGINT)
        self._default = signal.default_int_handler
        self._wrapper: Callable[[int, Any], None] | None = None  # _on_sigint, once set

    def section(self, function: Callable[..., Any], *, waits: bool) -> None:
        """Name ``function`` a step: a Ctrl-C while it runs is held back. ``waits``: except where
        the thread waits in a selector or a condition (the trainer waiting for the next item)."""
        self._sections[function.__code__] = waits

    def guard(self, iterator: Any) -> None:
        """Wrap the SIGINT handler (a Python one: not ignored or the system's default) for ``iterator``.

        Wrapped once while iterators live: a handler the user sets meanwhile is theirs (it may call
        ours, which calls the one it wrapped), never wrapped in turn."""
        if not self._on_main():
            return  # signals are handled on the main thread only, and signal.signal works there only
        current = signal.getsignal(signal.SIGINT)
        if current is not _on_sigint and not self.iterators:
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

    def raise_held(self) -> None:
        """At a safe point of a step: run the handler of a Ctrl-C held back (it raises)."""
        if self.pending and self._on_main():
            self.pending = False
            self._call(signal.SIGINT, sys._getframe(1))

    def on_signal(self, signum: int, frame: FrameType | None, safe: frozenset = SAFE_WAITS | _CONDITION_WAIT) -> None:
        resent, self._resent = self._resent, False
        if self.handler is None:
            return
        if self._calling:  # a handler set after ours called ours back: the one first wrapped ends the chain
            self._default(signum, frame)
            return
        if self._getsignal() is not self._wrapper:  # called from a handler set after ours: held, it would
            self.pending = False  # be sent through that one again, each time
            self._call(signum, frame)
            return
        waits, in_del = self._section(frame)
        if resent and in_del:  # a held one must not land in a __del__, where Python would swallow it
            self._resend_while_held()
            self.pending = True
            return
        if waits is not None and not (waits and frame is not None and frame.f_code in safe):
            if not self.pending or resent:  # held (again) for a safe point
                self.pending = True
                self._resend_while_held()
                return
            if in_del:  # a second Ctrl-C inside a __del__: stop what hangs there, and land after it too
                self._resend_while_held()
                self._call(signum, frame)
                return
        self.pending = False
        self._call(signum, frame)

    def _call(self, signum: int, frame: FrameType | None) -> None:
        assert self.handler is not None
        self._calling = True
        try:
            self.handler(signum, frame)
        finally:
            self._calling = False

    def _section(self, frame: FrameType | None) -> tuple[bool | None, bool]:
        """The innermost step ``frame`` runs in (its ``waits``, or None: in none), and whether a
        ``__del__`` is among its callers."""
        sections, waits, in_del = self._sections, None, False
        while frame is not None:
            if waits is None:
                waits = sections.get(frame.f_code)
            if frame.f_code.co_name == "__del__":
                in_del = True
            frame = frame.f_back
        return waits, in_del

    def _resend_while_held(self) -> None:
        """Start the thread that sends a held Ctrl-C again until it lands (one at a time)."""
        if not self._resending:
            self._resending = True
            try:
                _thread.start_new_thread(self._resend, (os.getpid(), signal.SIGINT, os.kill, time.sleep))
            except RuntimeError:  # no thread to be had (the interpreter exits): the next safe point raises it
                self._resending = False

    def _resend(self, pid: int, sigint: int, kill: Callable[[int, int], None], sleep: Callable[[float], None]) -> None:
        while True:
            while self.pending:
                sleep(RESEND_S)
                if not self.pending or self._calling:  # (a handler running: it is not sent into it)
                    continue
                installed = self._getsignal()
                if installed is not self._wrapper:
                    self.pending = False  # ours is gone: the one it wrapped, put back, takes it once
                    if installed is self.handler:
                        kill(pid, sigint)
                    break
                self._resent = True
                kill(pid, sigint)
            self._resending = False
            if not self.pending:
                return
            self._resending = True  # held again as this thread was leaving: it goes on


interrupts = Interrupts()


def _on_sigint(signum: int, frame: Any, interrupts: Interrupts = interrupts) -> None:
    interrupts.on_signal(signum, frame)  # (bound as a default: a signal may come as the interpreter exits)


@after_fork_in_child
def _none_held_in_child() -> None:
    interrupts.iterators, interrupts.pending, interrupts._calling = weakref.WeakSet(), False, False
    interrupts._resent = interrupts._resending = False
