"""The trainer takes from a queue source and feeds its DataLoader workers (``Feeder``, ``fed``).

Taking from a queue removes the handle before the taker can record it anywhere: a worker that
took a handle and was killed before telling the ledger would lose it, and one killed while
waiting on a queue's lock would leave every other consumer waiting. So for a ``fed_from_trainer``
source the trainer's ``tsl-feeder`` thread takes, records each handle as given to worker ``w``,
and only then writes it to that worker's feed pipe. A worker asks for what its next items need
(``NEED`` on its ledger pipe) when it has nothing left, so handles go to the worker the trainer is
waiting on, never to one that may not be asked for an item again (asking ahead, before it is
empty, let a worker that runs ahead on prefetched indices take what the trainer then waited for on
another, with the stream open). It reads its pipe (``FeedReader``) and reports what it read to the
ledger, one message per item. Whatever was given and not reported is still
known to the trainer, and goes back when the iterator stops.

A feed carries ``("fed", [pickled handle, ...])`` (a pickled handle is its own token), ``("end",
incarnation)`` (the source ended; a worker in an older incarnation stops, a newer one skips it), ``("error", exception,
incarnation)`` (taking failed, or a handle was refused: the worker raises it, and the trainer
receives it as the worker's; a newer incarnation skips it) and ``("stop",)`` (the iterator is
shutting down: stop now, whatever the incarnation).
"""

from __future__ import annotations

import collections
import logging
import mmap
import pickletools
import queue as _queue
import threading
from collections.abc import Callable, Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any

from .._proc import pid_alive, pipe_capacity
from ..errors import StorageError
from ..storage import Storage

logger = logging.getLogger("torch_storage_loader")

FED, END, ERROR, STOP = "fed", "end", "error", "stop"
TAKE_WAIT_S = 0.1  # how long one take waits: the thread checks for a stop this often
TRAINER_CHECK_S = 2.0  # how often a waiting worker checks that its trainer still lives
PIPE_MAX = 1 << 20  # the most a feed's pipe is raised to (Linux's default limit for unprivileged users)
PAGE = mmap.PAGESIZE  # a pipe stores each write from a fresh page when it does not fit the last one's rest
OVERHEAD = 16  # bytes a burst's message adds per handle, at most
HANDLE_BYTES = 1024  # what a pipe is sized for per handle waiting in it (a FileStorage pickles to ~150)
STOP_WAIT_S = 30.0  # how long stop() waits for the thread before it says so and goes on


class Feeder:
    """Trainer side: one thread that takes from ``source`` and writes to the workers' feeds.

    Workers are served in the order they asked (``need``). A write to a worker's feed never
    blocks: a feed holds at most what fits in its pipe (sized for ``most`` handles, up to 1 MiB,
    where the system allows), counted by the page, less room for the closing message; so the
    thread stops promptly even when a worker is dead or no longer reads. A handle too large for
    that is refused: the stream ends with a ``TypeError``.
    """

    def __init__(self, source: Any, feeds: list[Any], *, most: int) -> None:
        if most < 1:
            raise ValueError(f"{most=} must be >= 1")
        self.source, self._feeds = source, feeds
        want = min(PIPE_MAX, max(16 * PAGE, most * HANDLE_BYTES * 2))
        self._room_bytes = []
        for f in feeds:
            capacity = pipe_capacity(f.fileno(), want)
            self._room_bytes.append(capacity - max(2 * PAGE, capacity // 8))  # the rest: end, error, stop
        if min(self._room_bytes) < 2 * PAGE:
            raise OSError(
                f"a DataLoader worker's feed pipe holds only {min(self._room_bytes) + 2 * PAGE} bytes; raise "
                "/proc/sys/fs/pipe-user-pages-soft (this user's pipes use up its share), or use fewer loaders at once"
            )
        self._given: list[collections.deque[tuple[Any, int]]] = [collections.deque() for _ in feeds]
        self._bytes = [0] * len(feeds)  # of the messages given and not yet reported, per feed
        self._want = [0] * len(feeds)  # handles asked for and not yet sent, per worker
        self._asking: collections.deque[int] = collections.deque()  # workers with a want, oldest first
        self._incarnation = 0
        self._done = False  # the source ended (or failed) for this incarnation
        self._stopped = False
        self._carry: collections.deque[bytes] = collections.deque()  # taken, for the next bursts
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="tsl-feeder", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ called by the ledger
    def need(self, worker: int, n: int) -> None:
        """Worker ``worker`` has nothing left and asks for ``n`` handles (its next item's)."""
        with self._cond:
            if self._want[worker] == 0:
                self._asking.append(worker)
            self._want[worker] += n
            self._cond.notify()

    def reported(self, worker: int, n: int) -> None:
        """Worker ``worker`` read ``n`` more handles off its feed (it told the ledger it took them)."""
        with self._cond:
            given = self._given[worker]
            for _ in range(min(n, len(given))):
                self._bytes[worker] -= given.popleft()[1]
            self._cond.notify()

    def restart(self, incarnation: int) -> None:
        """Persistent workers began iteration ``incarnation``: take from the source again (what was
        given back before this call is taken again). Handles still in a feed stay given."""
        with self._cond:
            self._incarnation, self._done = incarnation, False
            self._cond.notify()

    def stop(self) -> None:
        """Stop taking and tell every worker to stop (idempotent)."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(STOP_WAIT_S)
            if self._thread.is_alive():
                logger.warning("the tsl-feeder thread did not stop within %.0f s; going on without it", STOP_WAIT_S)

    def undelivered(self) -> list[Any]:
        """After ``stop``: every handle given to a worker that it did not report; forgotten here."""
        with self._cond:
            out = [t for given in self._given for t, _ in given]
            for w, given in enumerate(self._given):
                given.clear()
                self._bytes[w] = 0
        return out

    def close(self) -> None:
        """Stop, then close the trainer's ends of the feeds."""
        self.stop()
        for feed in self._feeds:
            feed.close()

    # ------------------------------------------------------------------ the thread
    def _asker(self) -> int | None:
        """The worker that asked first among those whose feed has room (half its pipe) for a burst."""
        for w in self._asking:
            if self._bytes[w] <= self._room_bytes[w] // 2:
                return w
        return None

    def _run(self) -> None:
        try:
            while self._step():
                pass
        except Exception as exc:  # never silent: logged, and raised by the workers in the trainer
            logger.exception("the tsl-feeder thread failed; the stream ends here")
            error = RuntimeError(f"the trainer's tsl-feeder thread failed: {exc!r}")
            self._send_all((ERROR, error, self._incarnation))
        finally:
            self._send_all((STOP,))
            if self._carry:
                self.source.give_back(list(self._carry))
                self._carry.clear()

    def _step(self) -> bool:
        with self._cond:
            while not self._stopped and (self._done or (worker := self._asker()) is None):
                self._cond.wait()
            if self._stopped:
                return False
            incarnation = self._incarnation
            quota = self._want[worker]
            room = self._room_bytes[worker] - self._bytes[worker]
        burst, last = self._take(quota, room, incarnation)
        if burst:
            cost = _pages(sum(len(data) + OVERHEAD for _, data in burst))
            with self._cond:
                stopped = self._stopped
                if not stopped:
                    for i, (token, _) in enumerate(burst):  # before they are sent: a worker killed now loses nothing
                        self._given[worker].append((token, cost if i == 0 else 0))
                    self._bytes[worker] += cost
                    self._want[worker] -= len(burst)
                    if self._want[worker] <= 0:
                        self._want[worker] = 0
                        self._asking.remove(worker)
            if stopped:
                self.source.give_back([t for t, _ in burst])
                return False
            try:
                self._feeds[worker].send((FED, [data for _, data in burst]))
            except (OSError, ValueError) as exc:
                logger.warning(
                    "could not feed DataLoader worker %d (%s); its handles go back when the iterator stops", worker, exc
                )
        if last is not None:
            self._finish(incarnation, last)
        return True

    def _take(self, quota: int, room: int, incarnation: int) -> tuple[list[tuple[Any, bytes]], tuple | None]:
        """Up to ``quota`` handles that fit ``room`` bytes of a pipe, as ``(token, pickled handle)``
        (the source's ``take_pickled``: a pickled handle is its own token): waits for the first,
        then takes what is there (what does not fit waits in ``_carry`` for the next burst); and
        the message that ends the stream, if it ended."""
        burst: list[tuple[Any, bytes]] = []
        used = 0
        limit = min(self._room_bytes) // 4  # a handle's own message: it fits any hungry feed
        carry = self._carry
        while len(burst) < quota and not self._stopped:
            if not carry:
                try:
                    got = self.source.take_pickled(quota - len(burst), 0.0 if burst else TAKE_WAIT_S)
                except _queue.Empty:
                    break
                except Exception as exc:  # noqa: BLE001 - e.g. ProducerDiedError: raised by each worker, in the trainer
                    return burst, (ERROR, exc, incarnation)
                if got is None:
                    return burst, (END, incarnation)
                carry.extend(got)
            data = carry[0]
            if len(data) + OVERHEAD > limit:
                carry.popleft()
                self.source.fail([data])
                why = (
                    f"a handle of {len(data)} bytes pickled ({_type_name(data)}) is too large to feed a "
                    f"DataLoader worker (at most {limit - OVERHEAD}): a handle names where a sample is; "
                    "save the data itself"
                )
                return burst, (ERROR, TypeError(why), incarnation)
            if burst and _pages(used + len(data) + OVERHEAD) > room:
                break
            burst.append((carry.popleft(), data))
            used += len(data) + OVERHEAD
        return burst, None

    def _finish(self, incarnation: int, msg: tuple) -> None:
        with self._cond:
            if self._incarnation != incarnation:
                return  # restarted meanwhile: take again
            self._done = True
        self._send_all(msg)

    def _send_all(self, msg: tuple) -> None:
        for feed in self._feeds:
            try:
                try:
                    feed.send(msg)
                except (OSError, ValueError):
                    raise
                except Exception:  # noqa: BLE001 - an exception that does not pickle: send its text
                    feed.send((ERROR, RuntimeError(f"taking from the source failed: {msg[1]!r}"), msg[2]))
            except (OSError, ValueError):
                pass  # a worker that is gone, or a feed closed: nothing to tell


def _pages(nbytes: int) -> int:
    """What a message of ``nbytes`` may take of a pipe: whole pages, and the rest of the last one."""
    return (nbytes // PAGE + 2) * PAGE


class FeedReader:
    """Worker side: one worker's feed, and what it read off it and did not yield yet.

    It outlives an iteration (persistent workers start a new one each epoch), so nothing read is
    dropped, and a request still being served is not made twice. ``ask(n)`` sends the request.
    """

    def __init__(self, feed: Any, trainer_pid: int, ask: Callable[[int], None]) -> None:
        self.feed, self._trainer_pid, self._ask = feed, trainer_pid, ask
        self.waiting: collections.deque[tuple[Any, Any]] = collections.deque()
        self.outstanding = 0  # asked for, not yet received
        self.chunk = 1  # what one request asks for

    def pairs(self, incarnation: int) -> Iterator[tuple[Any, Any]]:
        """The ``(token, handle)`` pairs the trainer feeds this worker in ``incarnation``; ends at the
        source's end (or the iterator's stop, or the trainer's death); raises what taking raised."""
        while True:
            while self.waiting:
                yield self.waiting.popleft()
            if self.outstanding <= 0:
                self.outstanding = self.chunk
                self._ask(self.chunk)
            if not self.feed.poll(TRAINER_CHECK_S):
                if not pid_alive(self._trainer_pid):
                    return
                continue
            try:
                msg = self.feed.recv()
            except (EOFError, OSError):
                return
            kind = msg[0] if type(msg) is tuple and msg else None
            if kind == FED and len(msg) == 2 and type(msg[1]) is list:
                self.outstanding -= len(msg[1])
                self.waiting.extend(_pair(data) for data in msg[1])
            elif kind == END and len(msg) == 2:
                if msg[1] >= incarnation:
                    return
            elif kind == STOP:
                return
            elif kind == ERROR and len(msg) == 3 and isinstance(msg[1], BaseException):
                if msg[2] >= incarnation:  # an older epoch's error was raised there already
                    raise msg[1]
            else:
                raise RuntimeError(f"the trainer's feed sent {type(msg).__name__} {msg!r:.200}, not a feed message")


def _pair(data: Any) -> tuple[Any, Any]:
    """A pickled handle as the trainer fed it: ``(token, handle)``, the token being the bytes.

    One that does not unpickle here (its class cannot be imported in the worker, say) still comes
    out as a pair, so that it is reported taken like the others and then fails where it is loaded."""
    try:
        handle = ForkingPickler.loads(data) if type(data) is bytes else None
    except Exception as exc:  # noqa: BLE001 - whatever unpickling raised: the handle fails, the feed goes on
        return data, _Unreadable(f"it does not unpickle in a DataLoader worker: {type(exc).__name__}: {exc}")
    if not isinstance(handle, Storage):
        return data, _Unreadable(f"the trainer fed {type(handle).__name__}, not a Storage handle")
    return data, handle


class _Unreadable(Storage):
    """Stands for a fed handle that the worker cannot use: loading it raises ``StorageError``."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why

    def save(self, data: Any) -> Any:
        raise StorageError(f"a handle fed to a DataLoader worker cannot be used: {self.why}")

    def load(self) -> Any:
        raise StorageError(f"a handle fed to a DataLoader worker cannot be used: {self.why}")


def _type_name(data: bytes) -> str:
    """The class a pickled handle names, for an error (never unpickled: it may be anything)."""
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("GLOBAL", "SHORT_BINUNICODE", "BINUNICODE") and isinstance(arg, str) and arg:
                name = arg.split()[-1]
                if name and name[0].isupper():
                    return name
    except Exception:  # noqa: BLE001 - only a name for a message: bytes that do not parse have none
        pass
    return "a pickled handle"
