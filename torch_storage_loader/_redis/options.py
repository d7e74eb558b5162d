"""``RedisStorageQueue``'s options, validated once, and the timings of its consumers."""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

from .._format import trust as _trust
from .._options import check_option
from . import conn as _conn

__all__ = ["IDLE_POLL_S", "MAX_OUTSTANDING", "POLL_S", "TRIM_EVERY_S", "Options"]

POLL_S = 0.25  # how often an idle consumer looks at close() and dead producers
IDLE_POLL_S = (0.005, 0.05)  # an idle consumer asks for new entries this often (doubling from the first)
TRIM_EVERY_S = 1.0
MAX_OUTSTANDING = 65536


class Options(NamedTuple):
    """What a ``RedisStorageQueue`` was made with (its pickled state, less the stream's epoch)."""

    url: str
    stream: str
    group: str
    claim_after: float
    producer_timeout: float
    retry_timeout: float
    prefetch: int
    allow_pickle: bool
    roots: _trust.Roots
    cluster: bool
    replicas: int

    @classmethod
    def check(
        cls,
        url: str,
        stream: str,
        *,
        group: str,
        claim_after: float,
        producer_timeout: float,
        retry_timeout: float,
        prefetch: int,
        allow_pickle: bool,
        trusted_roots: Any,
        cluster: bool,
        replicas: int,
    ) -> Options:
        """The options, or ``ValueError``/``TypeError`` naming the first one that is wrong."""
        check_option("cluster", cluster, bool)
        _conn.check(url, cluster, _conn.redact_url(str(url)))
        check_option("stream", stream, str)
        if not stream:
            raise ValueError(f"{stream=} must be a non-empty string")
        if "{" in stream or "}" in stream:
            raise ValueError(
                f"{stream=} may not contain '{{' or '}}': the queue puts the name in braces "
                "(a Redis Cluster hash tag) so that all the stream's keys share one slot"
            )
        check_option("group", group, str)
        if not group:
            raise ValueError(f"{group=} must be a non-empty string")
        check_option("claim_after", claim_after, float, above=0)
        check_option("producer_timeout", producer_timeout, float, above=0)
        check_option("retry_timeout", retry_timeout, float, least=0)
        check_option("prefetch", prefetch, int, least=1)
        check_option("replicas", replicas, int, least=0)
        check_option("allow_pickle", allow_pickle, bool)
        roots = _trust.roots(trusted_roots)  # raises ValueError naming trusted_roots
        return cls(
            url,
            stream,
            group,
            float(claim_after),
            float(producer_timeout),
            float(retry_timeout),
            prefetch,
            allow_pickle,
            roots,
            cluster,
            replicas,
        )

    @property
    def shown(self) -> str:
        """The URL without its secrets."""
        return _conn.redact_url(self.url)


def renamed_retry_for(retry_timeout: float, retry_for: float | None, stacklevel: int = 3) -> float:
    """``retry_timeout``, or the value of ``retry_for``, its old name (with a ``DeprecationWarning``)."""
    if retry_for is None:
        return retry_timeout
    warnings.warn(
        "RedisStorageQueue(retry_for=...) is deprecated: use retry_timeout=... (the name the rest of "
        "the library uses for how long to retry)",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    return retry_for
