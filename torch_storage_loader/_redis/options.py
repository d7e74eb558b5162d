"""``RedisStorageQueue``'s options, validated once, and the timings of its consumers."""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

from .._format import trust as _trust
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
        _conn.check(url, cluster, _conn.redact_url(str(url)))
        if not stream or not isinstance(stream, str):
            raise ValueError(f"{stream=} must be a non-empty string")
        if "{" in stream or "}" in stream:
            raise ValueError(
                f"{stream=} may not contain '{{' or '}}': the queue puts the name in braces "
                "(a Redis Cluster hash tag) so that all the stream's keys share one slot"
            )
        if not group or not isinstance(group, str):
            raise ValueError(f"{group=} must be a non-empty string")
        if not claim_after > 0:
            raise ValueError(f"{claim_after=} must be > 0")
        if not producer_timeout > 0:
            raise ValueError(f"{producer_timeout=} must be > 0")
        if not retry_timeout >= 0:
            raise ValueError(f"{retry_timeout=} must be >= 0")
        if not (isinstance(prefetch, int) and prefetch >= 1):
            raise ValueError(f"{prefetch=} must be an int >= 1")
        if not isinstance(cluster, bool):
            raise TypeError(f"{cluster=} must be a bool")
        if not (isinstance(replicas, int) and replicas >= 0):
            raise ValueError(f"{replicas=} must be an int >= 0")
        if not isinstance(allow_pickle, bool):
            raise TypeError(f"{allow_pickle=} must be a bool")
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
