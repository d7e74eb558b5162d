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
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from . import _codec, _limits, _redis_conn, _trust
from .errors import (HandleRecordError, RedisStreamLayoutError, RedisStreamLostError, RedisUnavailableError,
                     StorageError, UnregisteredStorageTypeError, UntrustedStorageError)
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
LAYOUT = "2"  # the key layout, kept in the stream's meta hash
TRAINER_SUFFIX = "/trainer"  # the consumer a trainer's ledger keeps its delivered entries under

# Key layout (one stream NAME): the stream is the key NAME itself; everything else is under
# tsl:{NAME}:..., a fixed set of keys whose hash tag {NAME} puts them in the stream's Redis Cluster
# slot, so every script and multi-key command stays on one node (streams spread over masters by
# name). ``meta`` holds the stream's epoch (a random identity made with the stream: a process that
# knew it and finds it gone or changed knows the stream was lost) and ``closed``; ``producers`` and
# ``heartbeats`` (deadlines by the server's clock) the registered producers; ``stats`` and ``dups``
# every group's counters and duplicate ids, as "GROUP:counter" and "GROUP:id".
SUFFIXES = ("meta", "producers", "heartbeats", "stats", "dups")
COUNTERS = ("delivered", "claimed", "acked", "duplicates", "failed", "refused", "lost", "returned")

# Every script that acts on the stream first checks that it is the one this process knew (KEYS[2]
# is the meta hash, ARGV[1] the epoch): a stream lost and made anew is never read or written as if
# it were the same one.
_ALIVE = """
local epoch = redis.call('HGET', KEYS[2], 'epoch')
if epoch ~= ARGV[1] then return redis.error_reply('TSLLOST ' .. (epoch and 'renewed' or 'gone')) end
"""

# Make the stream, its epoch and the group (first use in each process), or check them. ARGV: new
# epoch, group, the epoch this process knew ('' if none). Returns the epoch.
_ENSURE = """
local epoch = redis.call('HGET', KEYS[2], 'epoch')
if ARGV[3] ~= '' and epoch ~= ARGV[3] then return redis.error_reply('TSLLOST ' .. (epoch and 'renewed' or 'gone')) end
local exists = redis.call('EXISTS', KEYS[1]) == 1
if not epoch then
  if exists then return redis.error_reply('TSLLAYOUT ' .. redis.call('TYPE', KEYS[1])['ok']) end
  epoch = ARGV[1]
  redis.call('HSET', KEYS[2], 'epoch', epoch, 'layout', '""" + LAYOUT + """')
elseif not exists then
  return redis.error_reply('TSLLOST stream')
end
local found = false
if exists then
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
    for i = 1, #g, 2 do if g[i] == 'name' and g[i + 1] == ARGV[2] then found = true end end
  end
end
if not found then
  if ARGV[3] ~= '' then return redis.error_reply('TSLLOST group') end
  redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[2], '0', 'MKSTREAM')
end
return epoch
"""

_PUT = _ALIVE + "return redis.call('XADD', KEYS[1], '*', '" + FIELD + "', ARGV[2])"

_CLOSE = _ALIVE + "return redis.call('HSET', KEYS[2], 'closed', '1')"

_IS_CLOSED = _ALIVE + "return redis.call('HEXISTS', KEYS[2], 'closed')"

# Entries are checked in Redis before they are sent: one that is not exactly one 'h' field of at
# most `limit` bytes comes back as {'!', why}, so a huge entry never crosses the network.
_BOUND = """
local function bound(entries, limit)
  for _, e in ipairs(entries) do
    local f = e[2]
    if type(f) == 'table' then
      if #f ~= 2 or f[1] ~= '""" + FIELD + """' then
        e[2] = {'""" + REFUSED + """', 'has ' .. math.floor(#f / 2) .. ' fields, not one """ + FIELD + """ field holding a handle record'}
      elseif string.len(f[2]) > limit then
        e[2] = {'""" + REFUSED + """', 'holds ' .. string.len(f[2]) .. ' bytes, over the ' .. limit .. ' of a handle record'}
      end
    end
  end
end
"""

# Delivery: read undelivered entries, count and bound them, in one round trip (no BLOCK inside a
# script, and no blocking XREADGROUP outside one: it would hand entries over whole, unchecked).
# ARGV[5]: the largest entry sent.
_READ = _ALIVE + _BOUND + """
local r = redis.call('XREADGROUP', 'GROUP', ARGV[2], ARGV[3], 'COUNT', ARGV[4], 'STREAMS', KEYS[1], '>')
if r then
  redis.call('HINCRBY', KEYS[3], ARGV[2] .. ':delivered', #r[1][2])
  bound(r[1][2], tonumber(ARGV[5]))
end
return r
"""

# Take over entries idle on any consumer for over ARGV[4] ms; forget consumers with nothing pending.
# ARGV[7]: the largest entry sent.
_CLAIM = _ALIVE + _BOUND + """
local g = ARGV[2] .. ':'
local r = redis.call('XAUTOCLAIM', KEYS[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], 'COUNT', ARGV[6])
bound(r[2], tonumber(ARGV[7]))
local n, d = #r[2], 0
for _, e in ipairs(r[2]) do
  if redis.call('SADD', KEYS[4], g .. e[1]) == 1 then d = d + 1 end
end
if n > 0 then
  redis.call('HINCRBY', KEYS[3], g .. 'claimed', n)
  redis.call('HINCRBY', KEYS[3], g .. 'delivered', n)
end
if d > 0 then redis.call('HINCRBY', KEYS[3], g .. 'duplicates', d) end
local lost = r[3] and #r[3] or 0
if lost > 0 then redis.call('HINCRBY', KEYS[3], g .. 'lost', lost) end
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[2])) do
  local t = {}
  for i = 1, #c, 2 do t[c[i]] = c[i + 1] end
  if t['pending'] == 0 and t['idle'] > tonumber(ARGV[4]) and t['name'] ~= ARGV[3] then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[2], t['name'])
  end
end
return {r[1], r[2], lost}
"""

# Acknowledge; an entry acknowledged before counts once as a duplicate. ARGV[3]: '1' if failed.
_ACK = _ALIVE + """
local g = ARGV[2] .. ':'
local acked, dups = 0, 0
for i = 4, #ARGV do
  if redis.call('XACK', KEYS[1], ARGV[2], ARGV[i]) == 1 then acked = acked + 1
  elseif redis.call('SADD', KEYS[4], g .. ARGV[i]) == 1 then dups = dups + 1 end
end
if acked > 0 then redis.call('HINCRBY', KEYS[3], g .. 'acked', acked) end
if dups > 0 then redis.call('HINCRBY', KEYS[3], g .. 'duplicates', dups) end
if ARGV[3] == '1' then redis.call('HINCRBY', KEYS[3], g .. 'failed', #ARGV - 3) end
return {acked, dups}
"""

# Give entries back: each still pending on a consumer of the family ARGV[3] (so not claimed by
# another meanwhile) is acknowledged and its record appended again, undelivered.
_RETURN = _ALIVE + """
local n = 0
for i = 4, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[2], ARGV[i], ARGV[i], 1)
  if #p > 0 and string.sub(p[1][2], 1, #ARGV[3]) == ARGV[3] then
    local e = redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i])
    redis.call('XACK', KEYS[1], ARGV[2], ARGV[i])
    if #e > 0 then
      redis.call('XADD', KEYS[1], '*', unpack(e[1][2]))
      n = n + 1
    end
  end
end
if n > 0 then redis.call('HINCRBY', KEYS[3], ARGV[2] .. ':returned', n) end
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

_NOW_MS = "local t = redis.call('TIME')\nlocal now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"

# A producer's heartbeat: (re)register ARGV[2] as ARGV[4], alive until now + ARGV[3] ms (server clock).
_BEAT = _ALIVE + _NOW_MS + """
redis.call('HSET', KEYS[3], ARGV[2], ARGV[4])
return redis.call('ZADD', KEYS[4], now + tonumber(ARGV[3]), ARGV[2])
"""

# Producers registered with producer() whose heartbeat deadline passed.
_DEAD = _NOW_MS + """
local dead = {}
for _, id in ipairs(redis.call('HKEYS', KEYS[1])) do
  local deadline = redis.call('ZSCORE', KEYS[2], id)
  if not deadline or tonumber(deadline) < now then table.insert(dead, id) end
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

_SCRIPTS = {"ensure": _ENSURE, "put": _PUT, "close": _CLOSE, "is_closed": _IS_CLOSED, "read": _READ,
            "claim": _CLAIM, "ack": _ACK, "return": _RETURN, "trim": _TRIM, "beat": _BEAT,
            "dead": _DEAD, "retire": _RETIRE}


# Query parameters redis-py takes that hold nothing secret; every other one's value is hidden.
_PLAIN_QUERY = frozenset({"db", "socket_timeout", "socket_connect_timeout", "socket_keepalive", "retry_on_timeout",
                          "max_connections", "health_check_interval", "timeout", "protocol", "client_name",
                          "decode_responses", "ssl_cert_reqs", "ssl_check_hostname", "ssl_ca_certs", "ssl_certfile",
                          "ssl_keyfile", "ssl_ca_path", "ssl_min_version", "ssl_ciphers"})


def redact_url(url: str) -> str:
    """``url`` without its secrets: user and password (``***@host``; hosts as written, a Sentinel
    URL lists several), and the value of every query parameter but plain settings such as ``db``
    (``?password=***``, ``ssl_password=***``...)."""
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


def _disconnect(close: Callable[[], None], pid: int) -> None:
    if os.getpid() == pid:  # a forked child must not close its parent's sockets
        close()


def stream_keys(stream: str) -> tuple[str, ...]:
    """Every key of stream ``stream``: the stream itself, then ``tsl:{stream}:SUFFIX`` for each of SUFFIXES."""
    return (stream, *(f"tsl:{{{stream}}}:{suffix}" for suffix in SUFFIXES))


def _legacy_keys(stream: str) -> tuple[str, str]:
    """The fixed keys of version 0.1's layout: ``tsl:NAME:closed``, ``tsl:NAME:producers``."""
    return f"tsl:{stream}:closed", f"tsl:{stream}:producers"


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

    Beyond one server: ``cluster=True`` for any node of a Redis Cluster (all the stream's keys share
    the hash tag ``{stream}``, so one slot); ``redis+sentinel://host:port[,host:port...]/SERVICE[/DB]``
    for the master a Sentinel names; ``replicas=N`` makes ``put`` and ``close`` wait until N replicas
    have them (Redis ``WAIT``), so a failover loses nothing acknowledged. A stream lost under a process
    that used it (its epoch, stream or group gone or made anew: a restart without persistence, say)
    raises ``RedisStreamLostError``; consumers never end as if it were drained.
    """

    def __init__(self, url: str, stream: str, *, group: str = "trainers", claim_after: float = 30.0,
                 producer_timeout: float = 10.0, retry_for: float = 5.0, prefetch: int = 1,
                 allow_pickle: bool = False, trusted_roots: list[str] | None = None, cluster: bool = False,
                 replicas: int = 0) -> None:
        _redis_conn.check(url, cluster, redact_url(str(url)))
        if not stream or not isinstance(stream, str):
            raise ValueError(f"{stream=} must be a non-empty string")
        if "{" in stream or "}" in stream:
            raise ValueError(f"{stream=} may not contain '{{' or '}}': the queue puts the name in braces "
                             "(a Redis Cluster hash tag) so that all the stream's keys share one slot")
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
        if not isinstance(cluster, bool):
            raise TypeError(f"{cluster=} must be a bool")
        if not (isinstance(replicas, int) and replicas >= 0):
            raise ValueError(f"{replicas=} must be an int >= 0")
        if not isinstance(allow_pickle, bool):
            raise TypeError(f"{allow_pickle=} must be a bool")
        self._roots = _trust.roots(trusted_roots)  # raises ValueError naming trusted_roots
        self._url, self.stream, self.group = url, stream, group
        self.claim_after, self.producer_timeout, self.retry_for = float(claim_after), float(producer_timeout), float(retry_for)
        self.prefetch, self.allow_pickle, self.cluster, self.replicas = prefetch, allow_pickle, cluster, replicas
        self._k_meta, self._k_producers, self._k_heartbeats, self._k_stats, self._k_dups = stream_keys(stream)[1:]
        self._epoch: str | None = None  # the stream's identity, once this queue (or its pickler) saw it
        self._reset()

    def _reset(self) -> None:
        """Per-process state: made on first use in each process (and after a fork)."""
        self._pid = os.getpid()
        self._client: Any = None
        self._connection: _redis_conn.Connection | None = None
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
                "prefetch": self.prefetch, "allow_pickle": self.allow_pickle, "trusted_roots": self._roots,
                "cluster": self.cluster, "replicas": self.replicas, "epoch": self._epoch}

    def __setstate__(self, state: dict) -> None:
        url, stream, epoch = state.pop("url"), state.pop("stream"), state.pop("epoch", None)
        self.__init__(url, stream, **state)
        self._epoch = epoch  # a copy of a queue that knew the stream knows it too: it never makes a new one

    def __repr__(self) -> str:
        extra = (", cluster=True" if self.cluster else "") + (f", replicas={self.replicas}" if self.replicas else "")
        return (f"RedisStorageQueue({self.url!r}, {self.stream!r}, group={self.group!r}, "
                f"claim_after={self.claim_after}{extra})")

    @property
    def url(self) -> str:
        """The URL without its secrets (user, password, and any query parameter but plain settings)."""
        return redact_url(self._url)

    @property
    def trusted_roots(self) -> list[str]:
        """The directories and ``proto://bucket/prefix`` roots handles read from this queue must lie under."""
        return list(self._roots.dirs) + self._roots.urls()

    # -- connection and retries -----------------------------------------------------------------

    def _conn(self) -> Any:
        if self._pid != os.getpid():
            self._reset()  # forked: never share the parent's sockets or consumer name
        if self._client is None:
            with self._lock:
                if self._client is None:
                    retry = Retry(ExponentialBackoff(cap=0.5, base=0.05), 3) if self.cluster else Retry(NoBackoff(), 0)
                    connection = _redis_conn.connect(
                        self._url, cluster=self.cluster, shown=self.url, connect_timeout=2.0, retry=retry,
                        socket_timeout=5.0 + (self.retry_for if self.replicas else 0.0))
                    client = connection.client
                    self._scripts = {name: client.register_script(src) for name, src in _SCRIPTS.items()}
                    self._connection, self._client = connection, client
                    # backup for a queue dropped without disconnect(): close its sockets, not leave them to gc
                    self._closer = weakref.finalize(self, _disconnect, connection.close, self._pid)
        return self._client

    def disconnect(self) -> None:
        """Close this process's connections to Redis (the stream is untouched; the next call reconnects)."""
        with self._lock:
            closer, self._closer, self._client, self._connection, self._scripts = self._closer, None, None, None, {}
        if closer is not None and self._pid == os.getpid():
            closer()

    def __enter__(self) -> RedisStorageQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.disconnect()

    def _call(self, fn: Callable[[Any], Any], what: str, *, ensure: bool = True) -> Any:
        """Run ``fn(client)``, retrying lost connections for ``retry_for`` seconds."""
        deadline = time.monotonic() + self.retry_for
        delay, tries = 0.05, 0
        while True:
            tries += 1
            try:
                client = self._conn()
                if ensure and not self._group_ready:
                    self._ensure_group(client)
                return fn(client)
            except redis.AuthenticationError as exc:
                raise RedisUnavailableError(
                    f"Redis at {self.url} refused the credentials in the URL while trying to {what} "
                    f"({type(exc).__name__}: {self._scrub(exc)}); check the user and password in the URL",
                    url=self.url) from None
            except (redis.ConnectionError, redis.TimeoutError, redis.RedisError, RedisClusterException) as exc:
                if isinstance(exc, redis.ResponseError) and not _redis_conn.transient(exc):
                    self._response_error(exc, deadline)
                    continue
                if not isinstance(exc, (redis.ConnectionError, redis.TimeoutError)) and not _redis_conn.transient(exc):
                    raise
                if time.monotonic() + delay > deadline:
                    raise RedisUnavailableError(
                        f"Redis at {self.url} is unreachable: could not {what} in {tries} tries over "
                        f"{self.retry_for:g} s ({type(exc).__name__}: {self._scrub(exc)})", url=self.url) from None
                logger.warning("Redis at %s: %s while trying to %s; retrying in %.2f s", self.url,
                               type(exc).__name__, what, delay)
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _response_error(self, exc: redis.ResponseError, deadline: float) -> None:
        """Raise the error a Redis error reply stands for; return to try again (the group is checked first)."""
        text = str(exc)
        if "TSLLOST" in text:
            self._group_ready = False
            raise self._lost(text.split("TSLLOST", 1)[1].split()[0]) from None
        if "TSLLAYOUT" in text:
            kind = text.split("TSLLAYOUT", 1)[1].split()[0]
            raise RedisStreamLayoutError(
                f"Redis key {self.stream!r} at {self.url} exists (a {kind}) but has no {self._k_meta!r}: it was "
                "not made by this version of RedisStorageQueue (0.1 kept its keys as tsl:NAME:*, or it is "
                "something else's key). Finish that run with the version that made it, use another stream "
                f"name, or delete it: RedisStorageQueue(url, {self.stream!r}).delete() removes the keys of "
                "both layouts", stream=self.stream, url=self.url) from None
        if _redis_conn.moved(exc) and not self.cluster:
            raise ValueError(f"Redis at {self.url} is a Redis Cluster node (it redirected to {text}): "
                             "pass cluster=True to RedisStorageQueue") from None
        if ("NOGROUP" in text or "no such key" in text) and time.monotonic() < deadline:
            self._group_ready = False  # the group or the stream is gone: _ensure_group says how
            return
        raise exc

    def _lost(self, why: str) -> RedisStreamLostError:
        what = {"gone": f"its identity key {self._k_meta!r} is gone",
                "renewed": "it was made anew (another epoch) since this process first used it",
                "stream": "its stream key is gone",
                "group": f"its consumer group {self.group!r} is gone"}.get(why, why)
        return RedisStreamLostError(
            f"Redis stream {self.stream!r} at {self.url} was lost while this process used it: {what}. Its "
            "undelivered and unacknowledged handles went with it (Redis restarted without persistence, a "
            "failover lost writes not yet on a replica, FLUSHALL, eviction, or delete()). Run Redis durably "
            "(appendonly yes, maxmemory-policy noeviction; README: 'Running Redis durably') and start a new "
            "stream (another name, or delete() this one first)", stream=self.stream, url=self.url)

    def _scrub(self, exc: BaseException) -> str:
        text = str(exc)
        for secret in _secrets(self._url):
            text = text.replace(secret, "***")
        return text

    def _ensure_group(self, client: Any) -> None:
        """Make (or check) the stream, its epoch and the group, once per process."""
        epoch = self._durable("ensure", [self.stream, self._k_meta],
                              [secrets.token_hex(8), self.group, self._epoch or ""])
        self._epoch = _decode_id(epoch)
        self._group_ready = True

    def _durable(self, script: str, keys: list, args: list) -> Any:
        """Run a writing script; with ``replicas``, return only once that many replicas have its writes."""
        if not self.replicas:
            return self._scripts[script](keys=keys, args=args)
        node = _redis_conn.node_of(self._connection, self.stream)
        try:
            pipe = node.pipeline(transaction=False)
            self._scripts[script](keys=keys, args=args, client=pipe)
            pipe.wait(self.replicas, max(1, int(self.retry_for * 1000)))
            result, copies = pipe.execute()
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as exc:
            if self.cluster and (_redis_conn.moved(exc) or not isinstance(exc, redis.ResponseError)):
                with contextlib.suppress(redis.RedisError, RedisClusterException):
                    self._client.exists(self._k_meta)  # through the cluster client: it learns where the slot went
                raise redis.ConnectionError(f"the stream's node changed ({type(exc).__name__})") from None
            raise
        if copies < self.replicas:
            raise RedisUnavailableError(
                f"Redis at {self.url}: only {copies} of replicas={self.replicas} confirmed a write to stream "
                f"{self.stream!r} within {self.retry_for:g} s; it may be lost if the master fails over now "
                "(or it may be delivered): try again (a duplicate at worst)", url=self.url)
        return result

    def _keys(self) -> list[str]:
        return [self.stream, self._k_meta, self._k_stats, self._k_dups]

    # -- producers ------------------------------------------------------------------------------

    def put(self, storage: Storage, block: bool = True, timeout: float | None = None) -> str:
        """Append a handle; returns its entry id. (``block`` and ``timeout``: as ``StorageQueue``; never blocks.)"""
        if not isinstance(storage, Storage):
            raise TypeError(f"RedisStorageQueue holds Storage handles, got {type(storage).__name__}")
        record = _codec.encode(storage)
        return _decode_id(self._call(lambda c: self._durable("put", [self.stream, self._k_meta],
                                                             [self._epoch, record]), "append a handle"))

    def close(self) -> None:
        """End the stream for every consumer, once every handle put before it is delivered."""
        self._call(lambda c: self._durable("close", [self.stream, self._k_meta], [self._epoch]), "close the stream")

    @contextlib.contextmanager
    def producer(self, name: str | None = None) -> Iterator[RedisStorageQueue]:
        """Register this process as a producer for as long as the block runs (see the class doc).

        ``name`` (default: ``host-pid-tag``) is how consumers and ``dead_producers()`` know it; a
        stable one (a collector's rank, a pod name) lets a restarted producer take over its
        registration: if it is back within ``producer_timeout``, nobody takes it for dead.
        """
        if name is None:
            name = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        elif not name or not isinstance(name, str):
            raise ValueError(f"{name=} must be a non-empty string")
        ttl_ms = int(self.producer_timeout * 1000)
        about = f"{socket.gethostname()} pid {os.getpid()}"

        def beat(c: Any) -> None:
            self._scripts["beat"](keys=[self.stream, self._k_meta, self._k_producers, self._k_heartbeats],
                                  args=[self._epoch, name, ttl_ms, about])

        self._call(beat, "register a producer")
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(self.producer_timeout / 4):
                try:
                    self._call(beat, "refresh a producer heartbeat")
                except Exception as exc:  # keep beating: the next try may reach Redis again
                    logger.warning("producer heartbeat for %s failed: %s", self.stream, exc)

        thread = threading.Thread(target=loop, name="tsl-redis-heartbeat", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()
            self._forget([name])

    def _forget(self, names: list) -> None:
        def leave(c: Any) -> None:
            pipe = c.pipeline(transaction=False)
            pipe.hdel(self._k_producers, *names)
            pipe.zrem(self._k_heartbeats, *names)
            pipe.execute()

        self._call(leave, "unregister producers", ensure=False)

    def dead_producers(self) -> list[str]:
        """Producers registered with ``producer()`` whose heartbeat expired (their names)."""
        return [_decode_id(x) for x in self._call(
            lambda c: self._scripts["dead"](keys=[self._k_producers, self._k_heartbeats]), "check producers")]

    def forget_dead_producers(self) -> list[str]:
        """Unregister the dead producers (after restarting them, say); returns their names."""
        dead = self.dead_producers()
        if dead:
            self._forget(dead)
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
            closed = self._closed or bool(self._call(lambda c: self._scripts["is_closed"](
                keys=[self.stream, self._k_meta], args=[self._epoch]), "check the stream"))
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
        acked, _ = self._call(lambda c: self._scripts["ack"](
            keys=self._keys(), args=[self._epoch, self.group, "1" if failed else "0", *tokens]), "acknowledge")
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
                pipe.hincrby(self._k_stats, f"{self.group}:refused", 1)
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
            keys=self._keys(), args=[self._epoch, self.group, self.consumer, self.prefetch,
                                     _limits.RECORD_MAX_BYTES]), "read")
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
            keys=self._keys(), args=[self._epoch, self.group, self.consumer, min_idle, self._claim_cursor, 100,
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
        # Entries another trainer's ledger holds (FAMILY/trainer: its DataLoader has them) are its to
        # acknowledge. Waiting for them could deadlock two trainers: each in-order DataLoader holds
        # one worker's sample back until its other worker, waiting here, yields or ends.
        others = {k: n for k, n in others.items() if not k.endswith(TRAINER_SUFFIX)}
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
        return int(self._call(lambda c: self._scripts["return"](
            keys=self._keys(), args=[self._epoch, self.group, f"{family}/" if family else self.consumer, *tokens]),
            "give entries back"))

    def keep_alive(self, *tokens: str, family: str) -> None:
        """Reset the idle time of delivered entries (held by ``family``'s trainer), so that no other
        consumer claims them after ``claim_after`` while the trainer still means to use them."""
        ids = list(tokens)
        for i in range(0, len(ids), 1000):
            chunk = ids[i:i + 1000]
            self._call(lambda c: c.xclaim(self.stream, self.group, family + TRAINER_SUFFIX, 0, chunk, justid=True),
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
        fields = [f"{self.group}:{name}" for name in COUNTERS]

        def look(c: Any) -> tuple:
            pipe = c.pipeline(transaction=False)
            pipe.hmget(self._k_stats, fields)
            pipe.xlen(self.stream)
            pipe.xinfo_groups(self.stream)
            return pipe.execute()

        counts, length, groups = self._call(look, "read stats")
        out = {name: int(v or 0) for name, v in zip(COUNTERS, counts)}
        mine = next((g for g in groups if _decode_id(g["name"]) == self.group), {})
        out["length"] = int(length)
        out["pending"] = int(mine.get("pending", 0))
        lag = mine.get("lag")
        out["undelivered"] = int(lag) if lag is not None else 0
        return out

    def delete(self) -> None:
        """Delete the stream and exactly its keys (every group's counts included), and nothing else.

        Also deletes what version 0.1 kept for a stream of this name (``tsl:NAME:closed``,
        ``...:producers``, ``...:hb:PRODUCER`` and ``...:GROUP:stats`` / ``...:GROUP:dups`` of its groups),
        by name, never by pattern.
        """
        def drop(c: Any) -> None:
            closed, producers = _legacy_keys(self.stream)
            groups = {self.group}
            with contextlib.suppress(redis.ResponseError):  # no stream (any more), or not a stream
                groups |= {_decode_id(g["name"]) for g in c.xinfo_groups(self.stream)}
            legacy = [closed, producers, *(f"tsl:{self.stream}:{g}:{kind}" for g in groups for kind in ("stats", "dups"))]
            with contextlib.suppress(redis.ResponseError):
                legacy += [f"tsl:{self.stream}:hb:{_decode_id(p)}" for p in c.hkeys(producers)]
            for key in legacy:  # one by one: in a cluster they live in different slots
                c.delete(key)
            c.delete(*stream_keys(self.stream))  # one slot

        self._call(drop, "delete the stream", ensure=False)
        self._group_ready = False
        self._closed = False
        self._epoch = None

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
