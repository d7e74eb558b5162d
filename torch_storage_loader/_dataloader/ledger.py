"""At-least-once delivery for streaming sources under DataLoader workers.

A handle taken by a worker counts as delivered only once the trainer's DataLoader iterator hands
its sample to the trainer's code. Each worker writes what it takes to a pipe of its own (before
loading, so that a worker killed mid-load loses nothing) tagged with its incarnation (persistent
workers restart their iterator each epoch) and the index of the DataLoader item it will belong to.
In the trainer, the iterator's ``_process_data`` (the one place every item passes on its way to
the caller, after unpickling, pinning and reordering) counts each worker's items (they reach the
caller in the order the worker made them, so a count per worker says which), and once its
``__next__`` has returned them, what the worker took for them is acknowledged. Not earlier: torch
raises a dead worker's error from its SIGCHLD handler wherever the trainer's thread is, so an item
processed may never be returned. A loader whose ``confirm_delivery`` is true (Lightning's, which
fetches a batch ahead of the one it trains on) acknowledges only when told ``consumed()``, in
the order items were yielded. Whatever is left when the iterator stops (a ``break``, an
exception, workers killed, the next epoch of persistent workers) goes back to the source.

A queue source is ``fed_from_trainer``: the trainer takes its handles and feeds the workers
(``feed``), so that what a worker is given is known before the worker has it. Such a worker writes
no message per item: before loading an item it writes how far it has read its feed to shared memory
(``_shm.marks``), and ``delivered`` takes that item's handles off what the feeder gave it.

The iterator's methods are wrapped by ``hooks`` (every touch of private torch is there); this
module imports no torch: the ledger only reads and writes pipes and calls its source's ``ack``,
``give_back`` and ``keep_alive``.

Size: about 405 lines (250 of code), the trainer's ledger and the worker's writer of one protocol.
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import select
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple

from .._proc import WakePipe, after_fork_in_child
from .._shm.marks import FeedMarks
from .._shm.word import SharedWord
from .feed import Feeder, FeedReader

logger = logging.getLogger("torch_storage_loader")

TAKE, DROP = KINDS = ("take", "drop")
MAX_UNCONFIRMED = 2
# Acknowledgements sent from the thread go in batches: it is woken once this many are due, and sends
# fewer once they waited this long (a wake per small sample cost the thread 81 us of CPU each).
ACK_BATCH, ACK_DELAY_S = 64, 0.05
ALL_ENDED = 2**62  # the count of ended iterations once the workers are to exit


class Entry(NamedTuple):
    """One message of a worker's pipe: the worker took (``TAKE``: from its source, never when fed) or
    settled itself (``DROP``: failed, skipped) ``tokens`` for its DataLoader item ``item`` of its
    iterator ``incarnation``."""

    kind: str
    incarnation: int
    item: int
    tokens: list[Any]


class ItemKey(NamedTuple):
    """One DataLoader item of one worker, in one incarnation of its iterator."""

    worker: int
    incarnation: int
    item: int


class LedgerRef(NamedTuple):
    """What a dataset hands its DataLoader workers: the ledger's id, one pipe end per worker to
    report on, and (for a source the trainer feeds) one to read handles from and the marks of how
    far each read it; for one they take from themselves, how many iterations the trainer ended),
    and the trainer's pid."""

    id: str
    writers: list[Any]
    feeds: list[Any] | None
    marks: FeedMarks | None
    ended: SharedWord | None
    trainer_pid: int


# Size: about 265 lines, one lock's state (what each worker took, until settled) and its thread; the
# feeding and its marks are in feed.
class Ledger:
    """Trainer side: what each worker took, until it is acknowledged or given back.

    A daemon thread (``tsl-ledger``) empties the workers' pipes as they write, so a worker never
    blocks on a full pipe while the trainer waits for its item, and keeps what is held alive at
    sources whose entries expire (``keep_alive``: Redis claims idle entries after ``claim_after``).
    """

    def __init__(
        self, source: Any, num_workers: int, ctx: Any, *, confirm: bool = False, item: int = 1, ahead: int = 2
    ) -> None:
        self.source = source
        self.confirm = confirm  # acknowledge on consumed(), not as the iterator yields
        self._unconfirmed: collections.deque[ItemKey] = collections.deque()  # yielded, not yet confirmed
        self._handing: list[ItemKey] = []  # processed, not yet returned by the iterator
        self.id = secrets.token_hex(8)
        pipes = [ctx.Pipe(duplex=False) for _ in range(num_workers)]
        self._readers: list[Any] = [r for r, _ in pipes]
        self._worker_of = {r.fileno(): i for i, r in enumerate(self._readers)}
        # Registered once (Connection.poll builds a selector a call): _ready for _drain, _waiting the thread's.
        self._ready, self._waiting = select.poll(), select.poll()
        for fd in self._worker_of:
            self._ready.register(fd, select.POLLIN)
            self._waiting.register(fd, select.POLLIN)
        self._waiting_on = set(self._worker_of)
        self._eof: set[int] = set()  # readers whose workers are gone (closed only by close())
        self.writers: list[Any] = [w for _, w in pipes]
        self._taken: dict[ItemKey, list[Any]] = {}  # -> the tokens taken for it
        self._yielded = [0] * num_workers
        self._incarnation = 0
        self._closed = False
        self._lock = threading.Lock()
        self._wake = WakePipe()  # b"a": acknowledgements to send; b"x": stop
        self._waiting.register(self._wake.fileno(), select.POLLIN)
        self._acks: list[Any] = []  # delivered, to acknowledge from the thread (sources with slow acks)
        self._acks_since = 0.0  # when the first of them was added
        self._ack_behind = bool(source.ack_in_background)
        self._keep_every = source.keep_alive_every
        self._feeds: list[Any] | None = None  # the workers' read ends, until they have them
        self._feeder: Feeder | None = None
        # Workers that take from their source themselves wait in its poll loop, not on a pipe: they
        # read how many iterations ended (all, once they are to exit) from shared memory as they wait.
        self._ended: SharedWord | None = None
        if source.fed_from_trainer:
            feeds = [ctx.Pipe(duplex=False) for _ in range(num_workers)]
            self._feeds = [r for r, _ in feeds]
            self._feeder = Feeder(source, [w for _, w in feeds], item=item, ahead=ahead)
        else:
            self._ended = SharedWord(purpose="the delivery ledger's count of ended iterations")
        _ledgers.add(self)
        self._thread = threading.Thread(target=self._run, name="tsl-ledger", daemon=True)
        self._thread.start()

    def ref(self) -> LedgerRef:
        marks = self._feeder.marks if self._feeder is not None else None
        return LedgerRef(self.id, self.writers, self._feeds, marks, self._ended, os.getpid())

    def started(self) -> None:
        """The workers have their pipe ends: drop ours, so a reader sees EOF once they are gone."""
        for w in self.writers:
            w.close()
        for r in self._feeds or ():
            r.close()

    def end_iteration(self) -> None:
        """Persistent workers are about to start the next iteration: each that waits for handles
        leaves this one at once (fed: the feeder tells it the end). torch drops whatever they send
        until they acknowledge the next, and a worker waiting for handles would never take torch's
        message to start it."""
        if self._feeder is not None:
            self._feeder.end_iteration()
        else:
            assert self._ended is not None
            self._ended.value = self._incarnation + 1

    def stop_waits(self) -> None:
        """Before the workers are shut down: they stop waiting for handles, so that they exit when
        torch tells them to (torch waits 5 s for each that does not, then terminates it)."""
        if self._feeder is not None:
            self._feeder.stop()
        else:
            assert self._ended is not None
            self._ended.value = ALL_ENDED

    def _run(self) -> None:
        next_keep = time.monotonic() + (self._keep_every or 0)
        while True:
            try:
                if self._step(next_keep):
                    return
            except Exception:
                logger.exception("the tsl-ledger thread met an error; it goes on")
                time.sleep(0.1)  # an error that repeats must not spin
            if self._keep_every and time.monotonic() >= next_keep:
                next_keep = time.monotonic() + self._keep_every

    def _step(self, next_keep: float) -> bool:
        """One round: wait, drain the pipes, send what is due; True once the ledger is closed."""
        timeout = max(0.0, next_keep - time.monotonic()) if self._keep_every else None
        if self._acks:  # (read unlocked: the wake that added the first one is still to come, at worst)
            left = max(0.0, self._acks_since + ACK_DELAY_S - time.monotonic())
            timeout = left if timeout is None else min(timeout, left)
        for fd in [fd for fd in self._waiting_on if self._worker_of[fd] in self._eof]:  # (_eof only grows)
            self._waiting.unregister(fd)  # a pipe at its end would wake every poll
            self._waiting_on.remove(fd)
        ready = self._waiting.poll(None if timeout is None else timeout * 1000)
        if any(fd == self._wake.fileno() for fd, _ in ready) and b"x" in self._wake.drain():
            return True
        with self._lock:
            if self._closed:
                return True
            self._drain()
            keep = bool(self._keep_every) and time.monotonic() >= next_keep
            held = [t for tokens in self._taken.values() for t in tokens] if keep else []
            acks: list[Any] = []
            if len(self._acks) >= ACK_BATCH or time.monotonic() >= self._acks_since + ACK_DELAY_S:
                acks, self._acks = self._acks, []
        if acks:
            try:
                self.source.ack(acks)
            except Exception as exc:  # noqa: BLE001 - not acknowledged: redelivered after claim_after, counted
                logger.warning("could not acknowledge %d delivered handles: %s", len(acks), exc)
        if keep and held:
            try:
                self.source.keep_alive(held)
            except Exception as exc:  # noqa: BLE001 - the next round may get through
                logger.warning("could not keep %d delivered handles alive: %s", len(held), exc)
        return False

    def _drain(self) -> None:
        """Note every message the workers' pipes hold now (under the lock; one ``poll`` if none)."""
        while ready := self._ready.poll(0):
            for fd, _ in ready:  # POLLIN, or POLLHUP once the worker is gone
                i = self._worker_of[fd]
                try:
                    self._note(i, self._readers[i].recv())
                except (EOFError, OSError):
                    self._eof.add(i)
                    self._ready.unregister(fd)

    def _note(self, worker: int, msg: Any) -> None:
        """Record one message of a worker's pipe; one that is not an ``Entry`` is logged and ignored."""
        if not (type(msg) in (Entry, tuple) and len(msg) == 4 and msg[0] in KINDS and type(msg[3]) is list):
            logger.warning("worker %d wrote a message that is not a ledger entry; ignored", worker)
            return
        msg = Entry._make(msg)
        if self._feeder is not None:  # fed: what a worker took is in its marks; it only drops
            if msg.kind == DROP:
                self._feeder.settled(worker, msg.tokens)
                self.source.fail(msg.tokens)
            else:
                logger.warning("worker %d, fed, wrote a %r entry; ignored", worker, msg.kind)
            return
        taken = self._taken.setdefault(ItemKey(worker, msg.incarnation, msg.item), [])
        if msg.kind == TAKE:
            taken.extend(msg.tokens)
            return
        for t in msg.tokens:
            if t in taken:
                taken.remove(t)

    def delivered(self, worker: int, ok: bool = True, skipped: bool = False) -> None:
        """The iterator is processing worker ``worker``'s next item (``ok``: not an exception); it
        counts as delivered once ``handed()`` says the iterator returned it. ``skipped``: it failed
        on its way into the trainer under ``on_error="skip"``: its handles fail, as a file that
        failed to load does (never acknowledged: the trainer did not get it)."""
        with self._lock:
            self._drain()
            self._yielded[worker] += 1
            key = ItemKey(worker, self._incarnation, self._yielded[worker] - 1)
            if self._feeder is not None:
                self._taken[key] = self._feeder.in_item(worker, key.item, returning=not ok and not skipped)
            if ok and not skipped:
                self._handing.append(key)
                return
            tokens = self._pop([key])  # the item is an exception: what it took never reaches the trainer
        if skipped:
            self.source.fail(tokens)
            return
        try:
            self._settle([], tokens)
        finally:
            if self._feeder is not None:  # (ok is False here)
                self._feeder.returned()

    def handed(self) -> None:
        """The iterator returned the items processed since the last call to the trainer's code.

        Not before: torch raises a dead worker's error from its SIGCHLD handler, at any point of the
        trainer's thread, so an item processed may still never be returned; then it goes back."""
        with self._lock:
            keys, self._handing = self._handing, []
            if not keys:
                return
            # No drain: a worker wrote an item's takes and drops before the item; delivered() read them.
            if self.confirm:
                self._unconfirmed.extend(keys)
                # Lightning holds at most two (the batch it trains, the one fetched ahead); more means
                # nothing confirms (a training_step taking dataloader_iter): treat older ones as used.
                ack = self._pop([self._unconfirmed.popleft() for _ in range(len(self._unconfirmed) - MAX_UNCONFIRMED)])
            else:
                last = {k.worker: k.item for k in keys}
                ack = self._pop(
                    [k for k in self._taken if k.incarnation == self._incarnation and k.item <= last.get(k.worker, -1)]
                )
        self._settle(ack, [])

    def not_handed(self) -> None:
        """The iterator raised after processing items (a dead worker's error): they go back."""
        with self._lock:
            keys, self._handing = self._handing, []
            back = self._pop(keys)
        self._settle([], back)

    def consumed(self) -> None:
        """With ``confirm``: the trainer used the oldest item yielded and not yet confirmed."""
        with self._lock:
            if not self._unconfirmed:
                return
            ack = self._pop([self._unconfirmed.popleft()])
        self._settle(ack, [])

    def next_incarnation(self) -> None:
        """Persistent workers restarted their iterators: what the last epoch left goes back."""
        with self._lock:
            self._drain()
            back = self._pop(
                [k for k in self._taken if k.incarnation <= self._incarnation]
            )  # (workers may be in the next)
            if self._feeder is not None:  # read in the last incarnation, in no item that reached the trainer
                back += self._feeder.read_in(self._incarnation)
            self._incarnation += 1
            self._yielded = [0] * len(self._yielded)
            self._unconfirmed.clear()
            self._handing = []
            incarnation = self._incarnation
        self._settle([], back)
        if self._feeder is not None:
            self._feeder.restart(incarnation)  # after the give-back: the feeder takes those again

    def close(self, exhausted: bool = False) -> None:
        """The iterator stopped: give back what was not delivered. ``exhausted``: it ran to its end, so
        (with ``confirm``) what it yielded is being consumed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake.wake(b"x")  # or, if the pipe is full, the thread finds _closed set
        self._thread.join()
        self._wake.close()
        try:
            if self._feeder is not None:
                self._feeder.close()
            with self._lock:
                self._drain()
                ack = self._acks + (self._pop(list(self._unconfirmed)) if exhausted else [])
                self._acks = []
                back = self._pop(list(self._taken))
            if self._feeder is not None:
                back += self._feeder.undelivered()  # given, never reported: in a feed, or a dead worker's
            try:
                self._settle(ack, back, now=True)
            except Exception as exc:  # noqa: BLE001 - often from __del__: say it, never raise it there
                logger.warning(
                    "could not settle %d delivered and %d undelivered handles when the DataLoader "
                    "stopped (they are delivered again once claimed): %s",
                    len(ack),
                    len(back),
                    exc,
                )
        finally:
            for r in self._readers:
                r.close()
            self._eof = set(range(len(self._readers)))
            if self._ended is not None:
                self._ended.close()

    def _pop(self, keys: list[ItemKey]) -> list[Any]:
        return [t for k in keys for t in self._taken.pop(k, ())]

    def _settle(self, ack: list[Any], back: list[Any], now: bool = False) -> None:
        if ack and self._ack_behind and not now:  # off the trainer's thread, batched (see ACK_BATCH)
            with self._lock:
                first = not self._acks
                if first:
                    self._acks_since = time.monotonic()
                self._acks.extend(ack)
                full = len(self._acks) >= ACK_BATCH > len(self._acks) - len(ack)
            if first or full:
                self._wake.wake(b"a")  # the first: the thread waits ACK_DELAY_S for more
        elif ack:
            self.source.ack(ack)
        if back:
            self.source.give_back(back)


_ledgers: weakref.WeakSet[Ledger] = weakref.WeakSet()


@after_fork_in_child
def _close_trainer_ends_in_child() -> None:
    # A worker forked from the trainer holds copies of the trainer's ends of every worker's pipes,
    # its own included: once the trainer is killed, its feed would never end (a message the trainer
    # had half written would be waited for for ever) and its reports would fill a pipe no one reads.
    for ledger in list(_ledgers):
        for conn in [*ledger._readers, *(ledger._feeder._feeds if ledger._feeder is not None else ())]:
            conn.close()
    _ledgers.clear()


class LedgerWriter:
    """Worker side: worker ``wid``'s pipes (``feed``: None unless the trainer feeds it; then ``marks``
    too), and the incarnation it is in."""

    def __init__(self, ref: LedgerRef, wid: int) -> None:
        self.ledger_id, self._conn, self.incarnation = ref.id, ref.writers[wid], -1
        self.wid, self._marks, self._ended = wid, ref.marks, ref.ended
        self.feed = None if ref.feeds is None else FeedReader(ref.feeds[wid], ref.trainer_pid, self._wait_at)
        self.complete = 0  # fed: the feed position up to which what it read is in items it finished

    def restart(self) -> None:
        self.incarnation += 1
        if self.feed is not None:
            self.complete = self.feed.position  # the last iteration's unfinished item is over

    def iteration_over(self) -> bool:
        """Not fed: the trainer ended this incarnation (the next starts, or the workers exit)."""
        return self._ended is not None and self._ended.value > self.incarnation

    def fed(self) -> Iterator[tuple[Any, Any]]:
        """The ``(token, handle)`` pairs the trainer feeds this worker in this incarnation."""
        assert self.feed is not None  # a fed source's writer
        return self.feed.pairs(self.incarnation)

    def _wait_at(self, position: int) -> None:
        assert self._marks is not None  # a fed source's writer
        self._marks.wait_at(self.wid, position, self.complete)

    def finished(self) -> None:
        """Fed: every item that holds what the worker read so far went out (sent, or skipped)."""
        assert self.feed is not None  # a fed source's writer
        self.complete = self.feed.position

    def took(self, item: int, tokens: list[Any]) -> None:
        """Not fed: the worker took ``tokens`` for ``item`` from its source (told before it loads them)."""
        self._conn.send(Entry(TAKE, self.incarnation, item, tokens))

    def reached(self, item: int) -> None:
        """Fed: what the worker read off its feed so far is in ``item`` or earlier ones (see ``_shm.marks``)."""
        assert self.feed is not None and self._marks is not None  # a fed source's writer
        self._marks.reached(self.wid, self.incarnation, item, self.feed.position)

    def dropped(self, item: int, tokens: list[Any]) -> None:
        self._conn.send(Entry(DROP, self.incarnation, item, tokens))
