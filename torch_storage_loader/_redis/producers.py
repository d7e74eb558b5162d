"""Producers of one stream: appending and closing, heartbeats, and producers whose heartbeat stopped."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

from ..storage import Storage
from . import records as _records
from .client import Client
from .keys import decode_id, new_name

__all__ = ["Producers"]

logger = logging.getLogger("torch_storage_loader")


class Producers:
    """What producers do to the stream, and what consumers ask about them."""

    def __init__(self, client: Client) -> None:
        self.client = client

    def put(self, storage: Storage) -> str:
        record = _records.encode(storage)
        c, k = self.client, self.client.keys
        return decode_id(c.call(lambda _: c.durable("put", [k.stream, k.meta], [c.epoch, record]), "append a handle"))

    def close(self) -> None:
        c, k = self.client, self.client.keys
        c.call(lambda _: c.durable("close", [k.stream, k.meta], [c.epoch]), "close the stream")

    @contextlib.contextmanager
    def registered(self, name: str | None) -> Iterator[None]:
        """Keep producer ``name`` (default: ``host-pid-tag``) registered, with a heartbeat, within the block."""
        if name is None:
            name = new_name()
        elif not name or not isinstance(name, str):
            raise ValueError(f"{name=} must be a non-empty string")
        c, k, timeout = self.client, self.client.keys, self.client.options.producer_timeout
        ttl_ms = int(timeout * 1000)
        about = f"{socket.gethostname()} pid {os.getpid()}"

        def beat(_: Any) -> None:
            c.script("beat", [k.stream, k.meta, k.producers, k.heartbeats], [c.epoch, name, ttl_ms, about])

        c.call(beat, "register a producer")
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(timeout / 4):
                try:
                    c.call(beat, "refresh a producer heartbeat")
                except Exception as exc:  # noqa: BLE001 -- keep beating: the next try may reach Redis again
                    logger.warning("producer heartbeat for %s failed: %s", k.stream, exc)

        thread = threading.Thread(target=loop, name="tsl-redis-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            self.forget([name])

    def forget(self, names: list[str]) -> None:
        k = self.client.keys

        def leave(c: Any) -> None:
            pipe = c.pipeline(transaction=False)
            pipe.hdel(k.producers, *names)
            pipe.zrem(k.heartbeats, *names)
            pipe.execute()

        self.client.call(leave, "unregister producers", ensure=False)

    def dead(self) -> list[str]:
        """Producers registered with ``producer()`` whose heartbeat expired (their names)."""
        c, k = self.client, self.client.keys
        return [
            decode_id(x) for x in c.call(lambda _: c.script("dead", [k.producers, k.heartbeats], []), "check producers")
        ]

    def forget_dead(self) -> list[str]:
        dead = self.dead()
        if dead:
            self.forget(dead)
        return dead
