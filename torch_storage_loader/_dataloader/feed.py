"""The trainer takes from a queue source and feeds its DataLoader workers (``Feeder``, ``fed``).

Taking from a queue removes the handle before the taker can record it anywhere: a worker that
took a handle and was killed before telling the ledger would lose it, and one killed while
waiting on a queue's lock would leave every other consumer waiting. So for a ``fed_from_trainer``
source the trainer's ``tsl-feeder`` thread takes, records each handle as given to worker ``w``,
and only then writes it to that worker's feed pipe.

A worker reads its pipe (``FeedReader``) in order, so a count says what it read: before it loads a
DataLoader item, and whatever ends its iteration, it writes how many it has read to shared memory
(``_shm.marks``; see ``stream``). As that item reaches the trainer, the ledger takes the item's
handles off what was given (``in_item``). Whatever was given and is in no item that reached the
trainer is still known to the trainer, and goes back when the iterator stops.

The marks are also the one flow control, and no worker ever asks: the trainer knows what each
worker holds unread (given, less its last mark), and the thread tops a worker up to the high
``watermarks`` once it holds the low one or fewer (``delivered`` notices, as each item arrives). So
a worker never waits on a round trip while the source has handles (asking, as workers once did,
cost a round trip of 0.5 ms, median, every 4 small samples), and none holds more than a top-up beyond the
items it was asked for. What comes in is shared out an item's worth at a time, each to the worker
that holds the fewest, so what trickles in goes to the worker the trainer is waiting on, not to one
that runs ahead on prefetched indices while the trainer waits on another, with the stream open.

The pipe adds no flow control: the trainer's end is non-blocking, and what a pipe cannot take at
once waits, in order, in the feeder's buffer for that feed (bounded by the high watermark) until
the pipe drains; the thread writes it again every ``FLUSH_S`` while some waits. So no write blocks
the thread, whether a worker is dead or no longer reads; the messages that end a stream always fit,
after what is there (the stop is still written after ``stop()``, until ``close()``); and nothing
models the kernel's pipe pages.

A feed carries ``("fed", [pickled handle, ...])`` (a pickled handle is its own token), ``("end",
incarnation)`` (the source ended; a worker in an older incarnation stops, a newer one skips it), ``("error", exception,
incarnation)`` (taking failed, or a handle was refused: the worker raises it, and the trainer
receives it as the worker's; a newer incarnation skips it) and ``("stop",)`` (the iterator is
shutting down: stop now, whatever the incarnation).

Size: about 430 lines (270 of code), the trainer's feeding and the worker's reading of one protocol.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import pickle
import pickletools
import queue as _queue
import threading
from collections.abc import Callable, Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any

from .._proc import frame, pid_alive, raise_pipe, signal_safe_condition
from .._shm.marks import FeedMarks
from ..errors import StorageError
from ..storage import Storage

logger = logging.getLogger("torch_storage_loader")

FED, END, ERROR, STOP = "fed", "end", "error", "stop"
TAKE_WAIT_S = 0.1  # how long one take waits: the thread checks for a stop this often
TRAINER_CHECK_S = 2.0  # how often a waiting worker checks that its trainer still lives
PIPE_MAX = 1 << 20  # the most a feed's pipe is raised to (Linux's default limit for unprivileged users)
LOW_MIN, TOP_UP_MIN = 8, 16  # the least low watermark, and the least top-up (see watermarks)
HANDLE_BYTES = 1024  # what a pipe is sized for per handle it may hold (a FileStorage pickles to ~150)
HANDLE_MAX = 64 << 10  # the largest pickled handle fed: a handle names where a sample is
FLUSH_S = 0.005  # how often the thread writes again to a feed whose pipe was full
STOP_WAIT_S = 30.0  # how long stop() waits for the thread before it says so and goes on


# Size: about 280 lines, one thread's state under one lock: taking, sharing out by the marks, and
# telling the end once nothing given can come back.
class Feeder:
    """Trainer side: one thread that takes from ``source`` and writes to the workers' feeds.

    Each worker is kept between the ``watermarks`` of handles given and not read, never blocked on
    (see the module). Pipes are raised to hold the high watermark (up to 1 MiB, where the system
    allows), so the buffer is rarely used. A handle larger than ``HANDLE_MAX`` pickled is refused:
    the stream ends with a ``TypeError``.
    """

    def __init__(self, source: Any, feeds: list[Any], *, item: int, ahead: int) -> None:
        self.source, self._feeds, self._item = source, feeds, item
        self._low, self._high = watermarks(item)
        # A worker is at most ``ahead`` items (the DataLoader's prefetch) past what reached the
        # trainer: a ring twice as long, and some, is never overwritten before it is read.
        self.marks = FeedMarks(len(feeds), 2 * ahead + 16)
        for f in feeds:
            raise_pipe(f.fileno(), min(PIPE_MAX, max(1 << 16, self._high * HANDLE_BYTES)))
            os.set_blocking(f.fileno(), False)
        self._out = [bytearray() for _ in feeds]  # framed messages each pipe has not taken yet (the thread's)
        self._given: list[collections.deque[bytes]] = [collections.deque() for _ in feeds]  # in no item yet
        self._base = [0] * len(feeds)  # the feed position of each _given's first handle
        self._settled: list[collections.Counter[bytes]] = [collections.Counter() for _ in feeds]  # by the worker
        self._turn = 0  # the worker first in line among those that hold as few (see _share)
        self._part = [0] * len(feeds)  # handles given to each past its last whole item's worth (see _share)
        self._incarnation = 0
        self._done = False  # the source ended (or failed) for this incarnation, and the workers were told
        self._ending: tuple[Any, ...] | None = None  # its end, not told to every worker yet: see _drained
        self._told: set[int] = set()  # the workers told it
        self._returning = 0  # items failed on their way in whose handles are going back to the source
        self._leaving = False  # the trainer starts the next iteration: tell every worker this one's end now
        self._stopped = self._closing = False
        # Entered as ``with self._lock``, never ``with self._cond``: see ``_proc.signal_safe_condition``.
        self._lock, self._cond = signal_safe_condition()
        self._thread = threading.Thread(target=self._run, name="tsl-feeder", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ called by the ledger
    def in_item(self, worker: int, item: int, *, returning: bool = False) -> list[bytes]:
        """The handles in worker ``worker``'s item ``item`` of this iteration, which just reached the
        trainer (the worker's mark for it says how far they go); forgotten here. Nothing once closed.
        ``returning``: the item failed on its way in, and the caller gives its handles back to the
        source, then calls ``returned``; until then no worker is told the source's end."""
        if returning:  # (counted even once closed: returned() follows)
            with self._lock:
                self._returning += 1
        if self._closing:
            return []
        return self._upto(worker, self.marks.item(worker, item))

    def returned(self) -> None:
        """The handles of an item ``in_item`` was told is ``returning`` are back in the source."""
        with self._lock:
            self._returning -= 1
            self._cond.notify()

    def read_in(self, incarnation: int) -> list[bytes]:
        """The handles the workers read in ``incarnation`` (now over) in no item that reached the trainer."""
        if self._closing:
            return []
        return [t for w in range(len(self._feeds)) for t in self._upto(w, self.marks.last(w, incarnation))]

    def _upto(self, worker: int, position: int) -> list[bytes]:
        """The handles given to worker ``worker`` up to its feed position ``position``, those it
        settled itself left out; forgotten here."""
        with self._lock:
            given, settled = self._given[worker], self._settled[worker]
            n = min(position - self._base[worker], len(given))
            if n <= 0:
                return []
            self._base[worker] += n
            out = [given.popleft() for _ in range(n)]
            if self._unread(worker) <= self._low:
                self._cond.notify()  # the thread tops this worker up
            return _without(out, settled) if settled else out

    def _unread(self, worker: int) -> int:
        """Handles given to ``worker`` past its last mark (under the lock): not read yet, or in the group it reads."""
        return self._base[worker] + len(self._given[worker]) - self.marks.latest(worker)

    def settled(self, worker: int, tokens: list[bytes]) -> None:
        """Worker ``worker`` settled ``tokens`` itself (they failed to load): never acknowledged or given back."""
        with self._lock:
            self._settled[worker].update(tokens)
            if self._unread(worker) <= self._low:
                self._cond.notify()  # it may have skipped all it held: no item arrives to say so (_upto)

    def restart(self, incarnation: int) -> None:
        """Persistent workers began iteration ``incarnation``: take from the source again (what was
        given back before this call is taken again). Handles still in a feed stay given."""
        with self._lock:
            self._incarnation, self._done, self._ending, self._told = incarnation, False, None, set()
            self._leaving = False
            # A new iteration groups from where each worker reads on: what it holds unread comes first.
            self._part = [self._unread(w) % self._item for w in range(len(self._feeds))]
            self._cond.notify()

    def end_iteration(self) -> None:
        """The trainer is about to start the next iteration of persistent workers: tell each worker
        the end of this one now, whatever it holds or waits for, and feed no more until ``restart``.
        (What they read in it and never delivered goes back then; what they hold unread stays given,
        and they read it first in the next.)"""
        with self._lock:
            if not self._done:
                self._leaving = True
                self._cond.notify()

    def stop(self) -> None:
        """Stop taking and tell every worker to stop (idempotent); what a pipe had no room for is
        still written as the worker reads, until ``close``."""
        with self._lock:
            self._stopped = True
            self._cond.notify()

    def undelivered(self) -> list[Any]:
        """After ``close``: every handle given to a worker and in no item that reached the trainer; forgotten here."""
        with self._lock:
            out = [
                t
                for given, settled in zip(self._given, self._settled, strict=True)
                for t in _without(list(given), settled)
            ]
            for given in self._given:
                given.clear()
        return out

    def close(self) -> None:
        """Stop, and once the thread is done, close the trainer's ends of the feeds."""
        with self._lock:
            self._stopped = self._closing = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(STOP_WAIT_S)
            if self._thread.is_alive():
                logger.warning("the tsl-feeder thread did not stop within %.0f s; going on without it", STOP_WAIT_S)
        for feed in self._feeds:
            feed.close()
        self.marks.close()

    # ------------------------------------------------------------------ the thread
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
            while self._flush() and not self._closing:  # a worker that reads gets to the stop
                with self._lock:
                    self._cond.wait(FLUSH_S)

    def _step(self) -> bool:
        waiting = self._flush()
        with self._lock:
            if self._stopped:
                return False
            if self._leaving and self._ending is None:
                self._ending = (END, self._incarnation)
            ending = self._ending
            if self._leaving:
                tell = [w for w in range(len(self._feeds)) if w not in self._told]
            else:
                telling = ending is not None and not self._returning  # (a handle going back is fed first)
                tell = [w for w in range(len(self._feeds)) if self._drained(w)] if telling else []
            if tell:
                self._told.update(tell)
                if len(self._told) == len(self._feeds):
                    self._ending, self._done = None, True
            feeding = [w for w in range(len(self._feeds)) if w not in self._told]
            unread = [self._unread(w) for w in feeding]
            if not tell and (self._done or min(unread) > self._low):
                # An end not told yet is looked at again soon: the workers' waits change no lock.
                self._cond.wait(FLUSH_S if waiting or self._ending is not None else None)
                return True
            incarnation, quota = self._incarnation, sum(max(0, self._high - u) for u in unread)
        if tell:
            assert ending is not None  # told only while an end waits
            framed = frame(ForkingPickler.dumps(ending))
            for w in tell:
                self._out[w] += framed
            return True
        burst, last = self._take(quota, incarnation)
        if burst:
            with self._lock:
                stopped: bool = self._stopped  # bool: stop() may have run since the check above
                shares = {} if stopped else self._share(burst)  # given before sent: a worker killed now loses nothing
            if stopped:
                self.source.give_back(burst)
                return False
            for w, share in shares.items():
                self._out[w] += frame(pickle.dumps((FED, share), pickle.HIGHEST_PROTOCOL))  # bytes: plain pickle
        if last is not None:
            self._finish(incarnation, last)
        return True

    def _share(self, burst: list[bytes]) -> dict[int, list[bytes]]:
        """Give ``burst`` (no more than the workers have room for) to the workers, one item's worth
        at a time, each to the one that holds the fewest unread (under the lock): what trickles in
        goes round the workers as the DataLoader asks them for items, not all to one."""
        shares: dict[int, list[bytes]] = {}
        nw = len(self._feeds)
        unread = [self._unread(w) for w in range(nw)]
        feeding = [w for w in range(nw) if w not in self._told]  # (told the end: fed no more)
        i = 0
        while i < len(burst):
            # A worker given part of an item's worth is given the rest first: handles that trickle in
            # must not end up split across workers as parts of items none of them can make.
            room = [v for v in feeding if unread[v] < self._high]  # (some: the burst fits, see _step)
            partial = [v for v in room if self._part[v]]
            w = partial[0] if partial else min(room, key=lambda v: (unread[v], (v - self._turn) % nw))
            n = min(self._item - self._part[w], self._high - unread[w], len(burst) - i)
            shares.setdefault(w, []).extend(burst[i : i + n])
            self._given[w].extend(burst[i : i + n])
            unread[w] += n
            i += n
            self._part[w] = (self._part[w] + n) % self._item
            if not self._part[w]:
                self._turn = (w + 1) % nw
        return shares

    def _take(self, quota: int, incarnation: int) -> tuple[list[bytes], tuple[Any, ...] | None]:
        """Up to ``quota`` pickled handles (the source's ``take_pickled``: a pickled handle is its own
        token): waits for the first, then takes what is there; and the message that ends the
        stream, if it ended."""
        burst: list[bytes] = []
        while len(burst) < quota and not self._stopped:
            try:
                got = self.source.take_pickled(quota - len(burst), 0.0 if burst else TAKE_WAIT_S)
            except _queue.Empty:
                break
            except Exception as exc:  # noqa: BLE001 - e.g. ProducerDiedError: raised by each worker, in the trainer
                return burst, (ERROR, exc, incarnation)
            if got is None:
                return burst, (END, incarnation)
            for i, data in enumerate(got):
                if len(data) > HANDLE_MAX:
                    self.source.fail([data])
                    self.source.give_back(got[i + 1 :])  # taken with it: taken again after a restart
                    why = (
                        f"a handle of {len(data)} bytes pickled ({_type_name(data)}) is too large to feed a "
                        f"DataLoader worker (at most {HANDLE_MAX}): a handle names where a sample is; "
                        "save the data itself"
                    )
                    return burst, (ERROR, TypeError(why), incarnation)
                burst.append(data)
        return burst, None

    def _finish(self, incarnation: int, msg: tuple[Any, ...]) -> None:
        with self._lock:
            if self._incarnation != incarnation:
                return  # restarted meanwhile: take again
            if msg[0] == END:
                if self._ending is None:
                    self._ending = msg  # told each worker once nothing given it can come back (_drained)
                self._cond.wait(FLUSH_S)  # then the source is looked at again (a handle given back)
                return
            self._ending, self._done = None, True
        self._send_all(msg)

    def _drained(self, w: int) -> bool:
        """Whether worker ``w``, not told the end yet, waits having read all it was given, and the
        items it finished reached the trainer (those it skipped whole need not: it settled their
        handles; the one it is making goes out only once told), under the lock. Until then one of
        those items may fail on its way (its handles go back to the source, to be fed again in this
        iteration), so the source's end is not told it yet. (Each worker apart: the trainer waiting
        on one worker's item may hold back the others'.)"""
        given = self._given[w]
        waiting, complete = self.marks.waiting_at(w)
        if w in self._told or waiting != self._base[w] + len(given):
            return False
        settled = collections.Counter(self._settled[w])
        for t in itertools.islice(given, max(0, complete - self._base[w])):
            if settled[t] <= 0:
                return False  # in an item on its way
            settled[t] -= 1
        return True

    def _send_all(self, msg: tuple[Any, ...]) -> None:
        try:
            data = ForkingPickler.dumps(msg)
        except Exception:  # noqa: BLE001 - an exception that does not pickle: send its text
            data = ForkingPickler.dumps((ERROR, RuntimeError(f"taking from the source failed: {msg[1]!r}"), msg[2]))
        framed = frame(data)
        for out in self._out:
            out += framed

    def _flush(self) -> bool:
        """Write to each feed what its pipe takes now; True while some feed has more to write."""
        for feed, out in zip(self._feeds, self._out, strict=True):
            try:
                while out:
                    del out[: os.write(feed.fileno(), out)]
            except BlockingIOError:
                pass  # the pipe is full: the rest waits for the worker to read
            except OSError:
                out.clear()  # no worker reads this pipe any more, or the feed is closed: nothing to tell
        return any(self._out)


def watermarks(item: int) -> tuple[int, int]:
    """``(low, high)``: the feeder tops a worker up to ``high`` handles given and not read once it
    holds ``low`` or fewer, ``item`` handles making one DataLoader item. ``low`` is two items'
    worth (at least ``LOW_MIN``), so a worker never waits for handles while the source has them
    (its marks, which the trainer reads as items arrive, lag by at most the group it reads); a
    top-up is two items' worth, at least ``TOP_UP_MIN``, so the thread wakes once per many small
    samples, and a worker holds at most that much more than what it was asked for."""
    low = max(LOW_MIN, 2 * item)
    return low, low + max(TOP_UP_MIN, 2 * item)


class FeedReader:
    """Worker side: one worker's feed, and what it read off it and did not yield yet.

    It outlives an iteration (persistent workers start a new one each epoch), so nothing read is
    dropped, and its position counts on.
    """

    def __init__(self, feed: Any, trainer_pid: int, wait_at: Callable[[int], None]) -> None:
        self.feed, self._trainer_pid, self._wait_at = feed, trainer_pid, wait_at
        self.waiting: collections.deque[tuple[Any, Any]] = collections.deque()
        self.position = 0  # handles yielded so far: the trainer counts what it gave the same way

    def pairs(self, incarnation: int) -> Iterator[tuple[Any, Any]]:
        """The ``(token, handle)`` pairs the trainer feeds this worker in ``incarnation``; ends at the
        source's end (or the iterator's stop, or the trainer's death); raises what taking raised."""
        while True:
            while self.waiting:
                self.position += 1
                yield self.waiting.popleft()
            self._wait_at(self.position)
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


def _without(tokens: list[bytes], settled: collections.Counter[bytes]) -> list[bytes]:
    """``tokens`` less one of each that ``settled`` counts (those are taken off it)."""
    out = []
    for t in tokens:
        if settled[t] > 0:
            settled[t] -= 1
            if not settled[t]:
                del settled[t]
        else:
            out.append(t)
    return out


def _pair(data: Any) -> tuple[Any, Any]:
    """A pickled handle as the trainer fed it: ``(token, handle)``, the token being the bytes.

    One that does not unpickle here (its class cannot be imported in the worker, say) still comes
    out as a pair, so that it is counted read like the others and then fails where it is loaded."""
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
