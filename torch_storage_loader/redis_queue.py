"""``RedisStorageQueue``: at-least-once delivery of storage handles across machines (Redis Streams)."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue as _queue
import secrets
import socket
import threading
import time
import urllib.parse
import weakref
from typing import Any, Callable, Iterator

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from . import _codec, _limits, _trust
from .errors import HandleRecordError, RedisUnavailableError, StorageError, UnregisteredStorageTypeError, UntrustedStorageError
from .queue import ProducerDiedError
from .storage import Storage

__all__ = ["RedisSource", "RedisStorageQueue", "redact_url"]

logger = logging.getLogger("torch_storage_loader")

FIELD = "h"  # the one field of a stream entry: the handle's JSON record
POLL_S = 0.25  # how often an idle consumer looks at close() and dead producers
IDLE_POLL_S = (0.005, 0.05)  # an idle consumer asks for new entries this often (doubling from the first)
REFUSED = "!"  # the field a read script puts in place of an entry it refused, with why
TRIM_EVERY_S = 1.0
MAX_OUTSTANDING = 65536

# Entries are checked in Redis before they are sent: one that is not exactly one 'h' field of at
# most ARGV[limit] bytes comes back as {'!', why}, so a huge entry never crosses the network.
_BOUND = """
local function bound(entries, limit)
  for _, e in ipairs(entries) do
    local f = e[2]
    if type(f) == 'table' then
      if #f ~= 2 or f[1] ~= 'h' then
        e[2] = {'!', 'has ' .. math.floor(#f / 2) .. ' fields, not one h field holding a handle record'}
      elseif string.len(f[2]) > limit then
        e[2] = {'!', 'holds ' .. string.len(f[2]) .. ' bytes, over the ' .. limit .. ' of a handle record'}
      end
    end
  end
end
"""

# Delivery: read undelivered entries and count them, in one round trip (no BLOCK inside a script).
_READ = _BOUND + """
local r = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[3], 'STREAMS', KEYS[1], '>')
if r then
  redis.call('HINCRBY', KEYS[2], 'delivered', #r[1][2])
  bound(r[1][2], tonumber(ARGV[4]))
end
return r
"""

# Take over entries idle on any consumer for over ARGV[3] ms; forget consumers with nothing pending.
_CLAIM = _BOUND + """
local r = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], 'COUNT', ARGV[5])
bound(r[2], tonumber(ARGV[6]))
local n, d = #r[2], 0
for _, e in ipairs(r[2]) do
  if redis.call('SADD', KEYS[3], e[1]) == 1 then d = d + 1 end
end
if n > 0 then
  redis.call('HINCRBY', KEYS[2], 'claimed', n)
  redis.call('HINCRBY', KEYS[2], 'delivered', n)
end
if d > 0 then redis.call('HINCRBY', KEYS[2], 'duplicates', d) end
local lost = r[3] and #r[3] or 0
if lost > 0 then redis.call('HINCRBY', KEYS[2], 'lost', lost) end
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local t = {}
  for i = 1, #c, 2 do t[c[i]] = c[i + 1] end
  if t['pending'] == 0 and t['idle'] > tonumber(ARGV[3]) and t['name'] ~= ARGV[2] then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], t['name'])
  end
end
return {r[1], r[2], lost}
"""

# Acknowledge; an entry acknowledged before counts once as a duplicate.
_ACK = """
local acked, dups = 0, 0
for i = 3, #ARGV do
  if redis.call('XACK', KEYS[1], ARGV[1], ARGV[i]) == 1 then acked = acked + 1
  elseif redis.call('SADD', KEYS[3], ARGV[i]) == 1 then dups = dups + 1 end
end
if acked > 0 then redis.call('HINCRBY', KEYS[2], 'acked', acked) end
if dups > 0 then redis.call('HINCRBY', KEYS[2], 'duplicates', dups) end
if ARGV[2] == '1' then redis.call('HINCRBY', KEYS[2], 'failed', #ARGV - 2) end
return {acked, dups}
"""

# Give entries back: each still pending on a consumer of the family ARGV[2] (so not claimed by
# another meanwhile) is acknowledged and its record appended again, undelivered.
_RETURN = """
local n = 0
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p > 0 and string.sub(p[1][2], 1, #ARGV[2]) == ARGV[2] then
    local e = redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i])
    redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
    if #e > 0 then
      redis.call('XADD', KEYS[1], '*', unpack(e[1][2]))
      n = n + 1
    end
  end
end
if n > 0 then redis.call('HINCRBY', KEYS[2], 'returned', n) end
return n
"""

# Trim below the oldest entry any group still needs: its oldest pending one, or its first undelivered.
_TRIM = """
local function less(a, b)
  local am, as = string.match(a, '(%d+)-(%d+)')
  local bm, bs = string.match(b, '(%d+)-(%d+)')
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am < bm or (am == bm and as < bs)
end
local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[1])
if not ok or #groups == 0 then return 0 end
local keep = nil
for _, g in ipairs(groups) do
  local t = {}
  for i = 1, #g, 2 do t[g[i]] = g[i + 1] end
  local lm, ls = string.match(t['last-delivered-id'], '(%d+)-(%d+)')
  local cand = lm .. '-' .. string.format('%d', tonumber(ls) + 1)
  local p = redis.call('XPENDING', KEYS[1], t['name'])
  if p[1] > 0 and less(p[2], cand) then cand = p[2] end
  if keep == nil or less(cand, keep) then keep = cand end
end
return redis.call('XTRIM', KEYS[1], 'MINID', keep)
"""

# Producers registered with producer() whose heartbeat key expired.
_DEAD = """
local dead = {}
for _, id in ipairs(redis.call('HKEYS', KEYS[1])) do
  if redis.call('EXISTS', KEYS[2] .. id) == 0 then table.insert(dead, id) end
end
return dead
"""

# Forget this consumer if nothing is pending on it (pending entries would be dropped with it).
_RETIRE = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) == 0 then
  return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
end
return -1
"""


# Query parameters redis-py takes that hold nothing secret; every other one's value is hidden.
_PLAIN_QUERY = frozenset({"db", "socket_timeout", "socket_connect_timeout", "socket_keepalive", "retry_on_timeout",
                          "max_connections", "health_check_interval", "timeout", "protocol", "client_name",
                          "decode_responses", "ssl_cert_reqs", "ssl_check_hostname", "ssl_ca_certs", "ssl_certfile",
                          "ssl_keyfile", "ssl_ca_path", "ssl_min_version", "ssl_ciphers"})


def redact_url(url: str) -> str:
    """``url`` without its secrets: user and password (``***@host``), and the value of every query
    parameter but plain settings such as ``db`` (``?password=***``, ``ssl_password=***``...)."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<unparsable redis URL>"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = []
    for item in parts.query.split("&") if parts.query else []:
        key, eq, _ = item.partition("=")
        plain = urllib.parse.unquote(key) in _PLAIN_QUERY
        query.append(item if plain else f"{key}{eq}***" if eq else "***")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query="&".join(query),
                                                  fragment="***" if parts.fragment else ""))


def _secrets(url: str) -> list[str]:
    """Every secret ``redact_url`` hides, as written in ``url`` and as redis-py decodes it, longest first."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return [url]
    found = []
    if "@" in parts.netloc:
        found += parts.netloc.rsplit("@", 1)[0].split(":", 1)
    for item in parts.query.split("&") if parts.query else []:
        key, eq, value = item.partition("=")
        if urllib.parse.unquote(key) not in _PLAIN_QUERY:
            found.append(value if eq else key)
    found.append(parts.fragment)
    found += [urllib.parse.unquote(x) for x in found]
    return sorted({x for x in found if x}, key=len, reverse=True)


def _disconnect(client: redis.Redis, pid: int) -> None:
    if os.getpid() == pid:  # a forked child must not close its parent's sockets
        client.close()


def _decode_id(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisStorageQueue:
    """Handles flow from producers on any machine to consumers on any machine, at least once.

    Built on a Redis stream ``stream`` read by the consumer group ``group`` (created on first use,
    from the start of the stream). ``put(storage)`` appends a handle as a JSON record (an
    allow-listed ``Storage`` type, see ``register_storage_type``; nothing is ever unpickled).
    Each consumer (a process, or a ``RedisStorageQueue`` object within one) reads under a name of
    its own; ``get()`` returns ``(token, storage)`` and ``ack(token)`` acknowledges it, from any
    process. An entry not acknowledged ``claim_after`` seconds after its delivery is claimed by
    another consumer (its reader is taken for dead) and delivered again: acknowledge within
    ``claim_after``, and expect a redelivered handle now and then (``stats()`` counts them).

    ``close()`` ends the stream: a consumer stops (``get`` returns ``None``) once every entry put
    before it was delivered and nothing is pending on another consumer (it claims what a dead one
    held). A closed stream stays closed; use a new stream name per run, or ``delete()``. Producers
    that run ``with queue.producer():`` keep a heartbeat key alive; a consumer that finds the stream
    empty while a registered producer's heartbeat expired (``producer_timeout``) raises
    ``ProducerDiedError``.

    Trimming: acknowledging trims the stream (at most once a second per process, and when a consumer
    stops) below the oldest entry some group still needs, its oldest pending entry or its next
    undelivered one (``XTRIM MINID``), so an undelivered or unacknowledged entry is never dropped,
    and memory holds only those. There is no length cap: a stream nobody reads grows.

    Whoever can write to the stream is not trusted: each entry is checked in Redis before it is
    sent (one ``h`` field of at most 64 KiB), then decoded as data with an exact schema (see
    ``_codec``), and a ``FileStorage`` or ``ObjectStorage`` handle is delivered only if it names a
    file under one of ``trusted_roots`` (absolute directories) or an object under one of them
    (``s3://bucket/prefix``); with none given, every such handle is refused. A refused entry is
    acknowledged and counted (``stats()["refused"]``), never delivered again.

    Connection loss is retried with back-off for ``retry_for`` seconds, then raises
    ``RedisUnavailableError`` naming the URL without its secrets (``rediss://``, users and passwords
    come from the URL, in any form redis-py reads; they are never logged or shown). A ``put`` retried after a lost reply may
    append the handle twice. The queue pickles as its URL and options; each process connects on
    first use. ``disconnect()`` (or leaving ``with queue:``) closes this process's connections; the
    next call reconnects.
    """

    def __init__(self, url: str, stream: str, *, group: str = "trainers", claim_after: float = 30.0,
                 producer_timeout: float = 10.0, retry_for: float = 5.0, prefetch: int = 1,
                 allow_pickle: bool = False, trusted_roots: list[str] | None = None) -> None:
        if not isinstance(url, str) or urllib.parse.urlsplit(url).scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"url must be a redis://, rediss:// or unix:// URL, got {redact_url(str(url))!r}")
        if not stream or not isinstance(stream, str):
            raise ValueError(f"{stream=} must be a non-empty string")
        if not group or not isinstance(group, str):
            raise ValueError(f"{group=} must be a non-empty string")
        if not claim_after > 0:
            raise ValueError(f"{claim_after=} must be > 0")
        if not producer_timeout > 0:
            raise ValueError(f"{producer_timeout=} must be > 0")
        if not retry_for >= 0:
            raise ValueError(f"{retry_for=} must be >= 0")
        if not (isinstance(prefetch, int) and prefetch >= 1):
            raise ValueError(f"{prefetch=} must be an int >= 1")
        if not isinstance(allow_pickle, bool):
            raise TypeError(f"{allow_pickle=} must be a bool")
        self._roots = _trust.roots(trusted_roots)  # raises ValueError naming trusted_roots
        self._url, self.stream, self.group = url, stream, group
        self.claim_after, self.producer_timeout, self.retry_for = float(claim_after), float(producer_timeout), float(retry_for)
        self.prefetch, self.allow_pickle = prefetch, allow_pickle
        base = f"tsl:{stream}"
        self._k_closed, self._k_producers, self._k_heartbeat = f"{base}:closed", f"{base}:producers", f"{base}:hb:"
        self._k_stats, self._k_dups = f"{base}:{group}:stats", f"{base}:{group}:dups"
        self._reset()

    def _reset(self) -> None:
        """Per-process state: made on first use in each process (and after a fork)."""
        self._pid = os.getpid()
        self._client: redis.Redis | None = None
        self._closer: weakref.finalize | None = None
        self._scripts: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.family = ""  # consumers named FAMILY/... belong to one trainer: see _drained
        self.consumer = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self._buffer: collections.deque = collections.deque()  # (token, storage | exception) read, not yet handed out
        self._outstanding: collections.OrderedDict = collections.OrderedDict()  # handed out here, not acked here
        self._closed = False
        self._group_ready = False
        self._claim_cursor = "0-0"
        self._next_claim = 0.0
        self._next_trim = 0.0

    # -- pickling, repr -------------------------------------------------------------------------

    def __getstate__(self) -> dict:
        return {"url": self._url, "stream": self.stream, "group": self.group, "claim_after": self.claim_after,
                "producer_timeout": self.producer_timeout, "retry_for": self.retry_for,
                "prefetch": self.prefetch, "allow_pickle": self.allow_pickle, "trusted_roots": self._roots}

    def __setstate__(self, state: dict) -> None:
        url, stream = state.pop("url"), state.pop("stream")
        self.__init__(url, stream, **state)

    def __repr__(self) -> str:
        return (f"RedisStorageQueue({self.url!r}, {self.stream!r}, group={self.group!r}, "
                f"claim_after={self.claim_after})")

    @property
    def url(self) -> str:
        """The URL without its secrets (user, password, and any query parameter but plain settings)."""
        return redact_url(self._url)

    @property
    def trusted_roots(self) -> list[str]:
        """The directories and ``proto://bucket/prefix`` roots handles read from this queue must lie under."""
        return list(self._roots.dirs) + self._roots.urls()

    # -- connection and retries -----------------------------------------------------------------

    def _conn(self) -> redis.Redis:
        if self._pid != os.getpid():
            self._reset()  # forked: never share the parent's sockets or consumer name
        if self._client is None:
            with self._lock:
                if self._client is None:
                    client = redis.Redis.from_url(self._url, socket_connect_timeout=2.0, socket_timeout=5.0,
                                                  retry=Retry(NoBackoff(), 0), decode_responses=False)
                    self._scripts = {name: client.register_script(src) for name, src in
                                     (("read", _READ), ("claim", _CLAIM), ("ack", _ACK), ("trim", _TRIM),
                                      ("dead", _DEAD), ("retire", _RETIRE), ("return", _RETURN))}
                    self._client = client
                    # backup for a queue dropped without disconnect(): close its sockets, not leave them to gc
                    self._closer = weakref.finalize(self, _disconnect, client, self._pid)
        return self._client

    def disconnect(self) -> None:
        """Close this process's connections to Redis (the stream is untouched; the next call reconnects)."""
        with self._lock:
            closer, self._closer, self._client, self._scripts = self._closer, None, None, {}
        if closer is not None and self._pid == os.getpid():
            closer()

    def __enter__(self) -> RedisStorageQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.disconnect()

    def _call(self, fn: Callable[[redis.Redis], Any], what: str) -> Any:
        """Run ``fn(client)``, retrying lost connections for ``retry_for`` seconds."""
        deadline = time.monotonic() + self.retry_for
        delay, tries = 0.05, 0
        while True:
            tries += 1
            try:
                client = self._conn()
                if not self._group_ready:
                    self._ensure_group(client)
                return fn(client)
            except redis.AuthenticationError as exc:
                raise RedisUnavailableError(
                    f"Redis at {self.url} refused the credentials in the URL while trying to {what} "
                    f"({type(exc).__name__}: {self._scrub(exc)}); check the user and password in the URL",
                    url=self.url) from None
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if time.monotonic() + delay > deadline:
                    raise RedisUnavailableError(
                        f"Redis at {self.url} is unreachable: could not {what} in {tries} tries over "
                        f"{self.retry_for:g} s ({type(exc).__name__}: {self._scrub(exc)})", url=self.url) from None
                logger.warning("Redis at %s: %s while trying to %s; retrying in %.2f s", self.url,
                               type(exc).__name__, what, delay)
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc) or time.monotonic() > deadline:
                    raise
                self._group_ready = False  # the server restarted without our group: create it again

    def _scrub(self, exc: BaseException) -> str:
        text = str(exc)
        for secret in _secrets(self._url):
            text = text.replace(secret, "***")
        return text

    def _ensure_group(self, client: redis.Redis) -> None:
        try:
            client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    def _keys(self) -> list[str]:
        return [self.stream, self._k_stats, self._k_dups]

    # -- producers ------------------------------------------------------------------------------

    def put(self, storage: Storage, block: bool = True, timeout: float | None = None) -> str:
        """Append a handle; returns its entry id. (``block`` and ``timeout``: as ``StorageQueue``; never blocks.)"""
        if not isinstance(storage, Storage):
            raise TypeError(f"RedisStorageQueue holds Storage handles, got {type(storage).__name__}")
        record = _codec.encode(storage)
        return _decode_id(self._call(lambda c: c.xadd(self.stream, {FIELD: record}), "append a handle"))

    def close(self) -> None:
        """End the stream for every consumer, once every handle put before it is delivered."""
        self._call(lambda c: c.set(self._k_closed, b"1"), "close the stream")

    @contextlib.contextmanager
    def producer(self) -> Iterator[RedisStorageQueue]:
        """Register this process as a producer for as long as the block runs (see the class doc)."""
        name = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        ttl_ms = int(self.producer_timeout * 1000)
        key = self._k_heartbeat + name

        def beat(c: redis.Redis) -> None:
            pipe = c.pipeline(transaction=False)
            pipe.set(key, b"1", px=ttl_ms)
            pipe.hset(self._k_producers, name, f"{socket.gethostname()} pid {os.getpid()}")
            pipe.execute()

        self._call(beat, "register a producer")
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(self.producer_timeout / 4):
                try:
                    self._call(lambda c: c.set(key, b"1", px=ttl_ms), "refresh a producer heartbeat")
                except Exception as exc:  # keep beating: the next try may reach Redis again
                    logger.warning("producer heartbeat for %s failed: %s", self.stream, exc)

        thread = threading.Thread(target=loop, name="tsl-redis-heartbeat", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()

            def leave(c: redis.Redis) -> None:
                pipe = c.pipeline(transaction=False)
                pipe.hdel(self._k_producers, name)
                pipe.delete(key)
                pipe.execute()

            self._call(leave, "unregister a producer")

    def dead_producers(self) -> list[str]:
        """Producers registered with ``producer()`` whose heartbeat expired (``host-pid-tag`` names)."""
        return [_decode_id(x) for x in self._call(
            lambda c: self._scripts["dead"](keys=[self._k_producers, self._k_heartbeat]), "check producers")]

    def forget_dead_producers(self) -> list[str]:
        """Unregister the dead producers (after restarting them, say); returns their names."""
        dead = self.dead_producers()
        if dead:
            self._call(lambda c: c.hdel(self._k_producers, *dead), "unregister dead producers")
        return dead

    # -- consumers ------------------------------------------------------------------------------

    def get(self, timeout: float | None = None) -> tuple[str, Storage] | None:
        """The next ``(token, storage)``, or ``None`` once the stream is closed and drained.

        Raises ``queue.Empty`` after ``timeout`` seconds, ``ProducerDiedError`` when the stream is
        empty and a registered producer died, and ``HandleRecordError`` /
        ``UnregisteredStorageTypeError`` / ``UntrustedStorageError`` for an entry that is not a handle
        record, or names a path or bucket outside ``trusted_roots`` (acknowledged, and counted as
        ``refused``: it is never delivered again; a ``StorageDataset`` skips such entries).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._buffer:
                return self._hand_out()
            now = time.monotonic()
            if now >= self._next_claim:
                self._next_claim = now + max(0.05, self.claim_after / 4)
                if self._claim():
                    continue
            if self._read():
                continue
            # Seen closed, then read nothing: every entry put before close() was delivered.
            closed = self._closed or bool(self._call(lambda c: c.exists(self._k_closed), "check the stream"))
            if closed and not self._closed:
                self._closed = True
                continue
            if closed:
                if self._drained():
                    self._finish()
                    return None
                wait = 0.05
            else:
                dead = self.dead_producers()
                if dead:
                    raise ProducerDiedError(
                        f"producer(s) {dead} of Redis stream {self.stream!r} stopped their heartbeat without "
                        "leaving queue.producer(); what they did not put is lost. Restart them and call "
                        "queue.forget_dead_producers(), or close() the stream to end it", producers=dead)
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

    def __iter__(self) -> Iterator[tuple[str, Storage]]:
        while (item := self.get()) is not None:
            yield item

    def ack(self, *tokens: str) -> int:
        """Acknowledge delivered entries by token, from any process; returns how many were pending."""
        return self._ack(tokens, failed=False)

    def _ack(self, tokens: tuple | list, failed: bool) -> int:
        if not tokens:
            return 0
        for t in tokens:
            self._outstanding.pop(t, None)
        args = [self.group, "1" if failed else "0", *tokens]
        acked, _ = self._call(lambda c: self._scripts["ack"](keys=self._keys(), args=args), "acknowledge")
        if time.monotonic() >= self._next_trim:
            self.trim()
        return int(acked)

    def trim(self) -> int:
        """Drop entries no group needs any more (see the class doc); returns how many."""
        self._next_trim = time.monotonic() + TRIM_EVERY_S
        return int(self._call(lambda c: self._scripts["trim"](keys=[self.stream]), "trim the stream"))

    def _hand_out(self) -> tuple[str, Storage]:
        token, item = self._buffer.popleft()
        if isinstance(item, Exception):
            def refuse(c: redis.Redis) -> None:
                pipe = c.pipeline(transaction=False)
                pipe.xack(self.stream, self.group, token)
                pipe.hincrby(self._k_stats, "refused", 1)
                pipe.execute()

            self._call(refuse, "acknowledge a refused entry")
            raise item
        self._outstanding[token] = None
        while len(self._outstanding) > MAX_OUTSTANDING:
            self._outstanding.popitem(last=False)
        return token, item

    def _take(self, entries: list) -> int:
        for entry_id, fields in entries:
            token = _decode_id(entry_id)
            if fields is None:  # deleted while pending
                continue
            if isinstance(fields, list):  # a script's reply: [field, value, ...]
                fields = dict(zip(fields[::2], fields[1::2]))
            try:
                why = fields.get(REFUSED.encode()) if len(fields) == 1 else None
                if why is not None:  # refused by the read script, in Redis
                    raise HandleRecordError(
                        f"stream entry {token} {_decode_id(why)}: not an entry RedisStorageQueue.put writes into "
                        f"stream {self.stream!r}; refused without reading it")
                raw = fields.get(FIELD.encode())
                if raw is None or len(fields) != 1:
                    raise HandleRecordError(
                        f"stream entry {token} has {len(fields)} fields, not one {FIELD!r} field holding a handle "
                        f"record: something other than RedisStorageQueue.put writes into stream {self.stream!r}")
                item: Any = _codec.decode(raw, allow_pickle=self.allow_pickle, trusted_roots=self._roots)
            except StorageError as exc:
                item = exc
            except Exception as exc:  # noqa: BLE001 - whatever a record provokes, it is refused, never raised
                item = HandleRecordError(f"stream entry {token} could not be decoded ({type(exc).__name__}); refused")
            self._buffer.append((token, item))
        return len(entries)

    def _read(self) -> int:
        reply = self._call(lambda c: self._scripts["read"](
            keys=[self.stream, self._k_stats],
            args=[self.group, self.consumer, self.prefetch, _limits.RECORD_MAX_BYTES]), "read")
        if not reply:
            return 0
        return self._take(reply[0][1])

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
        min_idle = int(self.claim_after * 1000)
        cursor, entries, lost = self._call(lambda c: self._scripts["claim"](
            keys=self._keys(), args=[self.group, self.consumer, min_idle, self._claim_cursor, 100,
                                     _limits.RECORD_MAX_BYTES]), "claim")
        self._claim_cursor = _decode_id(cursor)
        if lost:
            logger.warning("Redis stream %s: %d pending entries were deleted before anyone acknowledged them "
                           "(trimmed by something other than this queue)", self.stream, lost)
        if entries:
            logger.info("Redis stream %s: claimed %d entries idle for over %g s", self.stream, len(entries),
                        self.claim_after)
        return self._take(entries)

    def _drained(self) -> bool:
        """Nothing left for this consumer: nothing pending except what this process (or its trainer) holds."""
        def look(c: redis.Redis) -> tuple:
            summary = c.xpending(self.stream, self.group)
            mine = c.xpending_range(self.stream, self.group, "-", "+", 1000, consumername=self.consumer)
            return summary, mine

        summary, mine = self._call(look, "check pending entries")
        if not summary["pending"]:
            return True
        ours = [_decode_id(m["message_id"]) for m in mine]
        others = {_decode_id(c["name"]): int(c["pending"]) for c in summary.get("consumers") or []}
        others.pop(self.consumer, None)
        if self.family:  # siblings under one trainer: the trainer acknowledges or gives back their entries
            others = {k: n for k, n in others.items() if not k.startswith(self.family + "/")}
        if sum(others.values()):
            return False  # pending on another consumer: wait for its ack, or claim it after claim_after
        return all(t in self._outstanding for t in ours)  # the rest were read but their reply was lost

    def give_back(self, *tokens: str, family: str | None = None) -> int:
        """Make delivered entries undelivered again (appended anew), for any consumer; returns how many.

        Only entries still pending on this consumer (or, with ``family``, on a consumer named
        ``FAMILY/...``) are given back: one claimed by another consumer meanwhile is theirs.
        """
        if not tokens:
            return 0
        for t in tokens:
            self._outstanding.pop(t, None)
        args = [self.group, f"{family}/" if family else self.consumer, *tokens]
        return int(self._call(lambda c: self._scripts["return"](keys=[self.stream, self._k_stats], args=args),
                              "give entries back"))

    def keep_alive(self, *tokens: str, family: str) -> None:
        """Reset the idle time of delivered entries (held by ``family``'s trainer), so that no other
        consumer claims them after ``claim_after`` while the trainer still means to use them."""
        ids = list(tokens)
        for i in range(0, len(ids), 1000):
            chunk = ids[i:i + 1000]
            self._call(lambda c: c.xclaim(self.stream, self.group, f"{family}/trainer", 0, chunk, justid=True),
                       "keep delivered entries")

    def _finish(self) -> None:
        self.trim()
        self._call(lambda c: self._scripts["retire"](keys=[self.stream], args=[self.group, self.consumer]),
                   "retire the consumer")

    # -- inspection -----------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Counts for the group, across all processes and machines.

        ``delivered`` (handed out, redeliveries included), ``claimed`` (taken over from a consumer
        idle for ``claim_after``), ``acked``, ``duplicates`` (entries delivered or acknowledged more
        than once), ``failed`` (acknowledged after a failed load), ``refused`` (entries that were not
        handle records), ``lost`` (pending entries deleted by someone else), ``returned`` (given back
        undelivered by a stopped DataLoader, and delivered again); and now: ``length``
        (entries in the stream), ``pending`` (delivered, not acknowledged), ``undelivered``.
        """
        def look(c: redis.Redis) -> tuple:
            pipe = c.pipeline(transaction=False)
            pipe.hgetall(self._k_stats)
            pipe.xlen(self.stream)
            pipe.xinfo_groups(self.stream)
            return pipe.execute()

        counts, length, groups = self._call(look, "read stats")
        out = {k: 0 for k in ("delivered", "claimed", "acked", "duplicates", "failed", "refused", "lost", "returned")}
        out.update({_decode_id(k): int(v) for k, v in counts.items()})
        mine = next((g for g in groups if _decode_id(g["name"]) == self.group), {})
        out["length"] = int(length)
        out["pending"] = int(mine.get("pending", 0))
        lag = mine.get("lag")
        out["undelivered"] = int(lag) if lag is not None else 0
        return out

    def delete(self) -> None:
        """Delete the stream and every key of this queue (all groups' counts included)."""
        def drop(c: redis.Redis) -> None:
            keys = list(c.scan_iter(match=f"tsl:{self.stream}:*", count=1000))
            c.delete(self.stream, *keys)

        self._call(drop, "delete the stream")
        self._group_ready = False
        self._closed = False

    def as_source(self, trusted_roots: list[str] | None = None) -> RedisSource:
        """The queue as a ``StorageDataset`` source; ``trusted_roots`` are added to the queue's own."""
        extra = _trust.roots(trusted_roots)
        if not extra:
            return RedisSource(self)
        state = self.__getstate__()
        state["trusted_roots"] = self._roots | extra
        queue = RedisStorageQueue.__new__(RedisStorageQueue)
        queue.__setstate__(state)
        return RedisSource(queue)


class RedisSource:
    """``StorageDataset``'s view of a ``RedisStorageQueue``: handles in, acknowledgements out.

    DataLoader workers read as consumers named after their trainer; the trainer acknowledges an
    entry once it received its sample, or gives it back (``RedisStorageQueue.give_back``) when its
    DataLoader stops first. A file that cannot be read fails everywhere, so its entry is
    acknowledged too and counted as ``failed``.
    """

    finite = False

    def __init__(self, queue: RedisStorageQueue) -> None:
        self.queue = queue
        self.refused = 0  # entries refused in this process (Redis counts them all: stats()["refused"])

    def __getstate__(self) -> dict:
        return {"queue": self.queue}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["queue"])

    def iterate(self, shard: int, num_shards: int, skip: int = 0, *, family: str = "") -> Iterator[tuple[str, Storage]]:
        q = self.queue
        if family:
            q._conn()  # per-process state first, then the name
            q.family = _family(family)
            q.consumer = f"{q.family}/{os.getpid()}-{secrets.token_hex(3)}"
        while True:
            try:
                item = q.get()
            except (HandleRecordError, UnregisteredStorageTypeError, UntrustedStorageError) as exc:
                self.refused += 1  # acknowledged and counted by get(): never raised out of a DataLoader
                _limits.log_refused(logger, "Redis stream %s: %s", q.stream, exc)
                continue
            if item is None:
                return
            yield item

    ack_in_background = True  # the trainer's ledger thread sends acknowledgements in batches

    @property
    def keep_alive_every(self) -> float:
        return self.queue.claim_after / 3

    def ack(self, tokens: list) -> None:
        self.queue._ack(tokens, failed=False)

    def fail(self, tokens: list) -> None:
        self.queue._ack(tokens, failed=True)

    def give_back(self, tokens: list) -> None:
        self.queue.give_back(*tokens, family=self._family())

    def keep_alive(self, tokens: list) -> None:
        self.queue.keep_alive(*tokens, family=self._family())

    def _family(self) -> str:
        return self.queue.family or _family(str(os.getpid()))  # a worker's, else this trainer's


def _family(trainer: str) -> str:
    """Consumers named ``HOST-TRAINER/...`` read for one trainer process."""
    return f"{socket.gethostname()}-{trainer}"
