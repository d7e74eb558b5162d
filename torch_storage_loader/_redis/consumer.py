"""One consumer of the stream: reading, claiming what dead consumers held, handing out, settling, ending.

Entries are read and claimed by scripts that count and bound them in Redis (no blocking XREADGROUP:
it would hand entries over whole, unchecked). A consumer ends once the stream is closed, nothing
new came, and nothing is pending on another live consumer (``drained``).
"""

from __future__ import annotations

import collections
import logging
import os
import queue as _queue
import secrets
import time
from typing import TYPE_CHECKING, Any

from .._untrusted import bounded as _bounded
from ..errors import ProducerDiedError, UntrustedStorageError
from ..storage import Storage
from . import records as _records
from .client import Client
from .keys import TRAINER_SUFFIX, decode_id, family, new_name
from .options import IDLE_POLL_S, MAX_OUTSTANDING, POLL_S, TRIM_EVERY_S
from .producers import Producers

if TYPE_CHECKING:
    import redis  # for annotations only (.client imports it at run time)

__all__ = ["Consumer", "token_list"]

logger = logging.getLogger("torch_storage_loader")


def token_list(tokens: tuple[str | list[str], ...]) -> list[str]:
    """Tokens given as arguments, or as one list (or tuple)."""
    if len(tokens) == 1 and isinstance(tokens[0], (list, tuple)):
        return list(tokens[0])
    if any(isinstance(t, (list, tuple)) for t in tokens):
        raise TypeError("give tokens as arguments (ack(a, b)) or as one list (ack([a, b])), not both")
    return list(tokens)  # type: ignore[arg-type]  # no lists left


class Consumer:
    """This process's consumer of the stream (per-process state, made anew in a forked child)."""

    def __init__(self, client: Client, producers: Producers) -> None:
        self.client, self.producers = client, producers
        self.options, self.keys = client.options, client.keys
        self._reset()
        client.on_new_process(self._reset)

    def _reset(self) -> None:
        self.family = ""  # consumers named FAMILY/... belong to one trainer: see drained
        self.name = new_name()
        self.buffer: collections.deque[tuple[str, Any]] = (
            collections.deque()
        )  # (token, storage | exception) read, not yet handed out
        self.outstanding: collections.OrderedDict[str, Any] = (
            collections.OrderedDict()
        )  # handed out here, not acked here
        self.closed = False  # seen closed
        self._claim_cursor = "0-0"
        self._next_claim = 0.0
        self._next_trim = 0.0

    def join(self, trainer: str) -> None:
        """Read as one of trainer ``trainer``'s consumers, named ``HOST-TRAINER/PID-TAG``."""
        self.client.this_process()  # per-process state first, then the name
        self.family = family(trainer)
        self.name = f"{self.family}/{os.getpid()}-{secrets.token_hex(3)}"

    def get(self, timeout: float | None) -> tuple[str, Storage] | None:
        c, k = self.client, self.keys
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.buffer:
                return self._hand_out()
            now = time.monotonic()
            if now >= self._next_claim:
                self._next_claim = now + max(0.05, self.options.claim_after / 4)
                if self._claim():
                    continue
            if self._read():
                continue
            # Seen closed, then read nothing: every entry put before close() was delivered.
            closed = self.closed or bool(
                c.call(lambda _: c.script("is_closed", [k.stream, k.meta], [c.epoch]), "check the stream")
            )
            if closed and not self.closed:
                self.closed = True
                continue
            if closed:
                if self._drained():
                    self._finish()
                    return None
                wait = 0.05
            else:
                dead = self.producers.dead()
                if dead:
                    raise ProducerDiedError(
                        f"producer(s) {dead} of Redis stream {k.stream!r} stopped their heartbeat without "
                        "leaving queue.producer(); what they did not put is lost. Restart them and call "
                        "queue.forget_dead_producers(), or close() the stream to end it",
                        producers=dead,
                    )
                wait = POLL_S
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _queue.Empty
                wait = min(wait, left)
            if closed:
                time.sleep(wait)
            elif self._wait_for_entries(wait):
                continue

    def ack(self, tokens: list[str], failed: bool) -> int:
        if not tokens:
            return 0
        for t in tokens:
            self.outstanding.pop(t, None)
        c = self.client
        acked, _ = c.call(
            lambda _: c.script(
                "ack", self.keys.counted(), [c.epoch, self.options.group, "1" if failed else "0", *tokens]
            ),
            "acknowledge",
        )
        if time.monotonic() >= self._next_trim:
            self.trim()
        return int(acked)

    def trim(self) -> int:
        self._next_trim = time.monotonic() + TRIM_EVERY_S
        c = self.client
        return int(c.call(lambda _: c.script("trim", [self.keys.stream], []), "trim the stream"))

    def give_back(self, tokens: list[str], family: str | None, *, unread: bool = False) -> int:
        """Append the entries anew, undelivered (``unread``: read here but never handed out)."""
        if not tokens:
            return 0
        for t in tokens:
            self.outstanding.pop(t, None)
        c, group = self.client, self.options.group
        who = f"{family}/" if family else self.name
        return int(
            c.call(
                lambda _: c.script(
                    "return", self.keys.counted(), [c.epoch, group, who, "1" if unread else "0", *tokens]
                ),
                "give entries back",
            )
        )

    def keep_alive(self, tokens: list[str], family: str) -> None:
        stream, group = self.keys.stream, self.options.group
        for i in range(0, len(tokens), 1000):
            chunk = tokens[i : i + 1000]
            self.client.call(
                lambda c: c.xclaim(stream, group, family + TRAINER_SUFFIX, 0, chunk, justid=True),  # noqa: B023 -- call runs the lambda within this iteration
                "keep delivered entries",
            )

    def _hand_out(self) -> tuple[str, Storage]:
        token, item = self.buffer.popleft()
        if isinstance(item, UntrustedStorageError) and not self.options.trusted_roots:
            # Not an attack but a misconfiguration: this consumer trusts no root at all. Loud, and it
            # loses nothing: the entry (and what was read with it) goes back for a configured consumer.
            tokens = [token] + [t for t, _ in self.buffer]
            self.buffer.clear()
            self.give_back(tokens, None, unread=True)
            raise UntrustedStorageError(
                f"Redis stream {self.options.stream!r}: {item}. Nothing is lost: the entry stays in the "
                "stream, undelivered, for a consumer given trusted_roots=",
                path=getattr(item, "path", None),
            )
        if isinstance(item, Exception):
            k, group = self.keys, self.options.group

            def refuse(c: redis.Redis) -> None:
                pipe = c.pipeline(transaction=False)
                pipe.xack(k.stream, group, token)
                pipe.hincrby(k.stats, f"{group}:refused", 1)
                pipe.execute()

            self.client.call(refuse, "acknowledge a refused entry")
            raise item
        self.outstanding[token] = None
        while len(self.outstanding) > MAX_OUTSTANDING:
            self.outstanding.popitem(last=False)
        return token, item

    def take(self, entries: list[Any]) -> int:
        """Decode ``entries`` into the buffer (handles, or the errors refusing them); how many there were."""
        o = self.options
        self.buffer.extend(
            _records.decode_entries(entries, o.stream, allow_pickle=o.allow_pickle, roots=o.trusted_roots)
        )
        return len(entries)

    def _read(self) -> int:
        c, o = self.client, self.options
        reply = c.call(
            lambda _: c.script(
                "read", self.keys.counted(), [c.epoch, o.group, self.name, o.prefetch, _bounded.RECORD_MAX_BYTES]
            ),
            "read",
        )
        if not reply:
            return 0
        return self.take(reply[0][1])

    def _wait_for_entries(self, wait: float) -> int:
        """Ask for new entries every few milliseconds for up to ``wait`` seconds; how many came.

        Not a blocking XREADGROUP: that hands entries over whole, before their size could be
        checked; the read script checks it in Redis.
        """
        deadline = time.monotonic() + wait
        pause = IDLE_POLL_S[0]
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(pause, left))
            got = self._read()
            if got:
                return got
            pause = min(2 * pause, IDLE_POLL_S[1])
        return 0

    def _claim(self) -> int:
        c, o = self.client, self.options
        min_idle = int(o.claim_after * 1000)
        cursor, entries, lost = c.call(
            lambda _: c.script(
                "claim",
                self.keys.counted(),
                [c.epoch, o.group, self.name, min_idle, self._claim_cursor, 100, _bounded.RECORD_MAX_BYTES],
            ),
            "claim",
        )
        self._claim_cursor = decode_id(cursor)
        if lost:
            logger.warning(
                "Redis stream %s: %d pending entries were deleted before anyone acknowledged them "
                "(trimmed by something other than this queue)",
                o.stream,
                lost,
            )
        if entries:
            logger.info("Redis stream %s: claimed %d entries idle for over %g s", o.stream, len(entries), o.claim_after)
        return self.take(entries)

    def _drained(self) -> bool:
        """Nothing left for this consumer: nothing pending except what this process (or its trainer) holds."""
        stream, group = self.keys.stream, self.options.group

        def look(c: redis.Redis) -> tuple[Any, ...]:
            summary = c.xpending(stream, group)
            mine = c.xpending_range(stream, group, "-", "+", 1000, consumername=self.name)
            return summary, mine

        summary, mine = self.client.call(look, "check pending entries")
        if not summary["pending"]:
            return True
        ours = [decode_id(m["message_id"]) for m in mine]
        others = {decode_id(c["name"]): int(c["pending"]) for c in summary.get("consumers") or []}
        others.pop(self.name, None)
        if self.family:  # siblings under one trainer: the trainer acknowledges or gives back their entries
            others = {k: n for k, n in others.items() if not k.startswith(self.family + "/")}
        # Entries another trainer's ledger holds (FAMILY/trainer: its DataLoader has them) are its to
        # acknowledge. Waiting for them could deadlock two trainers: each in-order DataLoader holds
        # one worker's sample back until its other worker, waiting here, yields or ends.
        others = {k: n for k, n in others.items() if not k.endswith(TRAINER_SUFFIX)}
        if sum(others.values()):
            return False  # pending on another consumer: wait for its ack, or claim it after claim_after
        return all(t in self.outstanding for t in ours)  # the rest were read but their reply was lost

    def _finish(self) -> None:
        self.trim()
        c = self.client
        c.call(lambda _: c.script("retire", [self.keys.stream], [self.options.group, self.name]), "retire the consumer")
