"""The one claim loop of the directory and prefix sources.

Each consumer claims what no one claimed (a rename, a conditional creation: exactly one consumer
wins each), gives back the claims of trainers that died on its host whenever it runs out of
work, and stops once the producers' end marker exists and nothing is unclaimed or claimed by
another live trainer. A ``ClaimStore`` says how one kind of storage lists, claims and releases.
"""

from __future__ import annotations

import functools
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal, NamedTuple, Protocol, overload

from .._proc import trainer_alive
from ..storage import Storage

__all__ = ["Claim", "ClaimStore", "Owner", "Scan", "claim_loop"]


class Owner(NamedTuple):
    """Who claims: the host, the trainer (``family``: its pid) and the claiming process."""

    host: str
    family: str
    pid: int


class Claim(NamedTuple):
    """A valid claim found in a listing: what ``_release`` needs, and whose it is."""

    ref: Any
    host: str
    family: str
    pid: int


class Scan(NamedTuple):
    """One listing: whether the end marker is there, what is unclaimed (in claim order), and the rest."""

    ended: bool
    unclaimed: list[Any]
    listing: Any


class ClaimStore(Protocol):
    poll_interval: float
    spread: bool  # consumers start apart in the unclaimed list (fewer lost races where a claim is dear)

    def _scan(self) -> Scan: ...

    def _claims_in(self, scan: Scan) -> list[Claim]: ...

    def _release(self, claim: Claim) -> bool: ...

    def _claim(self, entry: Any, owner: Owner) -> tuple[Any, Storage] | None: ...


JUMP_AT = 8  # 4 claims lost in a row, or about 8 of 16 (see claim_loop)


@overload
def claim_loop(
    store: ClaimStore,
    shard: int,
    num_shards: int,
    family: str = ...,
    *,
    wait: Literal[True] = ...,
    stop: Callable[[], bool] | None = ...,
) -> Iterator[tuple[Any, Storage]]: ...
@overload
def claim_loop(
    store: ClaimStore, shard: int, num_shards: int, family: str = ..., *, wait: Literal[False]
) -> Iterator[tuple[Any, Storage] | None]: ...
def claim_loop(
    store: ClaimStore,
    shard: int,
    num_shards: int,
    family: str = "",
    *,
    wait: bool = True,
    stop: Callable[[], bool] | None = None,
) -> Iterator[tuple[Any, Storage] | None]:
    """``(token, handle)`` pairs claimed for consumer ``shard`` of ``num_shards`` of trainer ``family``;
    with ``wait=False``, None where it would wait ``poll_interval`` for more (the caller waits).
    ``stop``, asked before each such wait: True ends the loop there."""
    host = socket.gethostname()
    me = Owner(host, family or str(os.getpid()), os.getpid())
    while True:
        scan = store._scan()
        if not scan.unclaimed:
            claims = store._claims_in(scan)
            # Once per trainer and scan, not per claim: a waiting consumer lists every poll_interval,
            # and the claims in flight (hundreds) are a handful of trainers' (a /proc read each).
            alive = functools.cache(trainer_alive)
            dead = [c for c in claims if c.host == host and not alive(c.family, c.pid)]
            if sum(bool(store._release(c)) for c in dead):
                continue
            if scan.ended and not any(
                c.family != me.family and (c.host != host or alive(c.family, c.pid)) for c in claims
            ):
                return
            if stop is not None and stop():
                return
            if wait:
                time.sleep(store.poll_interval)
            else:
                yield None
            continue
        unclaimed = scan.unclaimed
        if store.spread:
            start = shard * len(unclaimed) // max(1, num_shards)
            unclaimed = unclaimed[start:] + unclaimed[:start]
        # Consumers claim from spread-out starts and then on through the list, so one that reaches
        # the stretch another is claiming would lose its claims there, in lockstep with the other
        # (half of all claims, for two; or every other one, both claiming the same stretch): once
        # it lost more than it won lately, it jumps to the middle of what is left. What it skips is
        # the other's; anything left unclaimed is in the next listing.
        i, losing = 0, 0  # +2 a claim lost, -1 a claim won: a jump at JUMP_AT
        while i < len(unclaimed):
            got = store._claim(unclaimed[i], me)
            i += 1
            if got is not None:
                losing = max(0, losing - 1)
                yield got
                continue
            losing += 2
            if losing >= JUMP_AT:
                i, losing = i + (len(unclaimed) - i) // 2, 0
