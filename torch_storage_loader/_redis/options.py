"""``RedisStorageQueue``'s options, validated once, and the timings of its consumers."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from .._options import check_option
from .._untrusted import trust as _trust
from . import conn as _conn

__all__ = ["IDLE_POLL_S", "MAX_OUTSTANDING", "POLL_S", "TRIM_EVERY_S", "Options"]

POLL_S = 0.25  # how often an idle consumer looks at close() and dead producers
IDLE_POLL_S = (0.005, 0.05)  # an idle consumer asks for new entries this often (doubling from the first)
TRIM_EVERY_S = 1.0
MAX_OUTSTANDING = 65536


@dataclass(frozen=True)
class Options:
    """What a ``RedisStorageQueue`` was made with, checked as it is made: the one list and check of
    its options (its signature holds their defaults), and its pickled state, less the stream's epoch."""

    url: str
    stream: str
    group: str
    claim_after: float
    producer_timeout: float
    retry_timeout: float
    prefetch: int
    allow_pickle: bool
    trusted_roots: _trust.Roots  # given as the queue's trusted_roots= (a list, None), kept checked
    cluster: bool
    replicas: int

    def __post_init__(self) -> None:
        """Raise ``ValueError``/``TypeError`` naming the first option that is wrong; keep the durations as floats."""
        check_option("cluster", self.cluster, bool)
        _conn.check(self.url, self.cluster, _conn.redact_url(str(self.url)))
        stream, group = self.stream, self.group
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
        check_option("claim_after", self.claim_after, float, above=0)
        check_option("producer_timeout", self.producer_timeout, float, above=0)
        check_option("retry_timeout", self.retry_timeout, float, least=0)
        check_option("prefetch", self.prefetch, int, least=1)
        check_option("replicas", self.replicas, int, least=0)
        check_option("allow_pickle", self.allow_pickle, bool)
        object.__setattr__(self, "trusted_roots", _trust.roots(self.trusted_roots))  # ValueError naming it
        for name in ("claim_after", "producer_timeout", "retry_timeout"):
            object.__setattr__(self, name, float(getattr(self, name)))

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
