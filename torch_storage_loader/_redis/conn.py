"""Connecting ``RedisStorageQueue`` to one Redis, a Redis Cluster, or a master found through Sentinel.

- ``redis://``, ``rediss://``, ``unix://``: one server, as ``redis.Redis.from_url`` reads them.
- the same ``redis://`` / ``rediss://`` URL with ``cluster=True``: any node of a Redis Cluster, as
  ``redis.cluster.RedisCluster.from_url`` reads it (redis-py picks the class, not the URL).
- ``redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/SERVICE[/DB]`` (and
  ``rediss+sentinel://`` for TLS): the master of ``SERVICE`` as the listed Sentinels report it,
  through ``redis.sentinel.Sentinel(...).master_for(SERVICE)``, which follows failovers. The user and
  password are the master's; Sentinels are asked without them (redis-py's default). Port 26379 if
  none is given.

``redact_url`` and ``scrub`` keep the URL's secrets out of every message and log line.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, TypedDict

from .._optional import require

if TYPE_CHECKING:
    import redis
else:
    redis = require("redis", "redis", "RedisStorageQueue")


SINGLE_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
SENTINEL_PORT = 26379


def scheme(url: str) -> str:
    try:
        return urllib.parse.urlsplit(url).scheme
    except ValueError:
        return ""


def check(url: Any, cluster: bool, shown: str) -> None:
    """Raise ``ValueError`` (naming ``shown``, the URL without its password) unless ``url`` can be used."""
    kind = scheme(url) if isinstance(url, str) else ""
    if cluster and kind not in ("redis", "rediss"):
        raise ValueError(f"cluster=True needs a redis:// or rediss:// URL of any cluster node, got {shown!r}")
    if kind not in SINGLE_SCHEMES + SENTINEL_SCHEMES:
        raise ValueError(
            f"url must be a redis://, rediss://, unix:// or redis+sentinel://host:port/SERVICE URL, got {shown!r}"
        )
    if kind in SENTINEL_SCHEMES:
        parse_sentinel(url, shown)


class SentinelURL(NamedTuple):
    hosts: list[tuple[str, int]]
    service: str
    db: int
    username: str | None
    password: str | None
    tls: bool


def parse_sentinel(url: str, shown: str) -> SentinelURL:
    parts = urllib.parse.urlsplit(url)
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, _, pw = userinfo.partition(":")
        username, password = urllib.parse.unquote(user) or None, urllib.parse.unquote(pw) if pw else None
    hosts = []
    for item in filter(None, hostlist.split(",")):
        if item.startswith("["):  # [IPv6]:port
            host, _, rest = item[1:].partition("]")
            port = rest[1:] if rest.startswith(":") else ""
        else:
            host, _, port = item.partition(":")
        if not host or (port and not port.isdigit()):
            raise ValueError(f"bad Sentinel address {item!r} in {shown!r}: expected host[:port][,host[:port]...]")
        hosts.append((host, int(port) if port else SENTINEL_PORT))
    path = [urllib.parse.unquote(p) for p in parts.path.split("/") if p]
    if not hosts or not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(
            f"a Sentinel URL reads redis+sentinel://[[user]:password@]host[:port][,host[:port]...]"
            f"/SERVICE[/DB], got {shown!r}"
        )
    return SentinelURL(
        hosts, path[0], int(path[1]) if len(path) == 2 else 0, username, password, parts.scheme.startswith("rediss")
    )


class Connection(NamedTuple):
    """A client, and how to close every socket it (and a Sentinel behind it) opened."""

    client: Any  # redis.Redis or redis.cluster.RedisCluster
    close: Callable[[], None]
    cluster: bool


class _Options(TypedDict):
    """The keyword arguments every client is made with (named, so that ``**`` lands on them alone)."""

    socket_timeout: float
    socket_connect_timeout: float
    decode_responses: bool


class _TLS(TypedDict, total=False):
    """``ssl=True`` for a ``rediss+sentinel://`` URL; empty otherwise (redis-py's default)."""

    ssl: bool


def connect(
    url: str, *, cluster: bool, shown: str, socket_timeout: float, connect_timeout: float, retry: Any
) -> Connection:
    options: _Options = {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": connect_timeout,
        "decode_responses": False,
    }
    if cluster:
        from redis.cluster import RedisCluster

        nodes = RedisCluster.from_url(url, retry=retry, **options)
        return Connection(nodes, nodes.close, True)
    if scheme(url) in SENTINEL_SCHEMES:
        from redis.sentinel import Sentinel

        s = parse_sentinel(url, shown)
        tls: _TLS = {"ssl": True} if s.tls else {}
        sentinel = Sentinel(
            s.hosts,
            sentinel_kwargs={**options, **tls, "decode_responses": True},
            username=s.username,
            password=s.password,
            db=s.db,
            retry=retry,
            **options,
            **tls,
        )
        master = sentinel.master_for(s.service)

        def close() -> None:
            master.close()
            for node in sentinel.sentinels:
                node.close()

        return Connection(master, close, False)
    client = redis.Redis.from_url(url, retry=retry, **options)
    return Connection(client, client.close, False)


def node_of(connection: Connection, key: str) -> Any:
    """A plain client of the server that holds ``key`` now: commands pipelined through it share one
    connection, as ``WAIT`` needs (it waits for the writes of its own connection)."""
    if not connection.cluster:
        return connection.client
    c = connection.client
    return c.get_redis_connection(c.get_node_from_key(key))


def moved(exc: BaseException) -> bool:
    """A single-node client was answered MOVED/ASK: the server is a Redis Cluster node."""
    from redis.exceptions import AskError  # MovedError is one

    return isinstance(exc, AskError) or (
        isinstance(exc, redis.exceptions.ResponseError) and str(exc).split(" ", 1)[0] in ("MOVED", "ASK")
    )


# Transient while a cluster fails over or a replica is promoted: retried like a lost connection.
TRANSIENT_RESPONSES = ("CLUSTERDOWN", "TRYAGAIN", "MASTERDOWN", "LOADING", "READONLY")


def transient(exc: BaseException) -> bool:
    from redis import exceptions as e

    if isinstance(exc, (getattr(e, "SlotNotCoveredError", ()), getattr(e, "RedisClusterUnreachableError", ()))):
        return True
    if type(exc) is e.RedisClusterException:  # older redis-py: no cluster node reachable
        return "reach" in str(exc) or "connect" in str(exc)
    return isinstance(exc, e.ResponseError) and str(exc).split(" ", 1)[0] in TRANSIENT_RESPONSES


# Query parameters redis-py takes that hold nothing secret; every other one's value is hidden.
_PLAIN_QUERY = frozenset(
    {
        "db",
        "socket_timeout",
        "socket_connect_timeout",
        "socket_keepalive",
        "retry_on_timeout",
        "max_connections",
        "health_check_interval",
        "timeout",
        "protocol",
        "client_name",
        "decode_responses",
        "ssl_cert_reqs",
        "ssl_check_hostname",
        "ssl_ca_certs",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_ca_path",
        "ssl_min_version",
        "ssl_ciphers",
    }
)


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
    return urllib.parse.urlunsplit(
        parts._replace(netloc=netloc, query="&".join(query), fragment="***" if parts.fragment else "")
    )


def secrets(url: str) -> list[str]:
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


def scrub(text: str, url: str) -> str:
    """``text`` with every secret of ``url`` (see ``secrets``) replaced by ``***``."""
    for secret in secrets(url):
        text = text.replace(secret, "***")
    return text
