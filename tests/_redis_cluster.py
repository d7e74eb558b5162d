"""Real Redis Cluster and Sentinel deployments on 127.0.0.1 for tests, from Debian's ``redis-server``.

- ``RedisClusterServers``: 3 masters and 3 replicas (``redis-server --cluster-enabled yes``, joined
  by ``redis-cli --cluster create ... --cluster-replicas 1``), with a 1 s node timeout so that a
  killed master's replica takes over within seconds.
- ``SentinelServers``: a master, its replica and one Sentinel (quorum 1) watching them.

Every server daemonizes (see ``_redis_server``): ``stop()`` kills them by pid.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import tempfile
import time

import pytest
from _redis_server import REDIS_SERVER, RedisServer

REDIS_CLI = shutil.which("redis-cli")
BUS_OFFSET = 10000  # a cluster node's bus port is its port + 10000


def _ports(n: int) -> list[int]:
    """n free ports below 55000 whose bus twins (+10000) are free too."""
    from _s3_server import _free

    out: list[int] = []
    while len(out) < n:
        p = random.randint(20000, 44999)
        if p in out or p + BUS_OFFSET in out or p - BUS_OFFSET in out:
            continue
        if _free(p) and _free(p + BUS_OFFSET):
            out.append(p)
    return out


def _client(port: int):
    import redis

    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, decode_responses=True)


def _ask(port: int, *command):
    client = _client(port)
    try:
        return client.execute_command(*command)
    finally:
        client.close()


def _wait(what: str, check, timeout: float = 30.0, log=lambda: ""):
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
            if result:
                return result
        except Exception:  # noqa: BLE001 -- not up yet, or in the middle of a failover
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {timeout} s; logs:\n{log()}")
        time.sleep(0.1)


class RedisClusterServers:
    """3 masters + 3 replicas. ``url`` names one node (any node will do for ``cluster=True``)."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="tsl-redis-cluster-")
        self.nodes: dict[int, RedisServer] = {}
        for port in _ports(6):
            d = os.path.join(self.dir, str(port))
            os.mkdir(d)
            self.nodes[port] = RedisServer(
                d,
                port=port,
                args=(
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "1000",
                    "--cluster-replica-validity-factor",
                    "0",  # a replica takes over however long it was cut off
                    "--repl-diskless-sync-delay",
                    "0",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ),
            )

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{next(iter(self.nodes))}/0"

    def start(self) -> RedisClusterServers:
        for node in self.nodes.values():
            node.start()
        addresses = [f"127.0.0.1:{p}" for p in self.nodes]
        subprocess.run(
            [REDIS_CLI, "--cluster", "create", *addresses, "--cluster-replicas", "1", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        _wait("the cluster did not get ready", self.ready, log=self.log)
        return self

    def ready(self) -> bool:
        live = [p for p, n in self.nodes.items() if n.pid is not None]
        return all("cluster_state:ok" in _ask(p, "CLUSTER", "INFO") for p in live) and len(self.masters()) == 3

    def masters(self) -> dict[int, tuple[int, int]]:
        """{port: (first slot, last slot)} of each live master, as a live node sees it."""
        port = next(p for p, n in self.nodes.items() if n.pid is not None)
        out = {}
        for first, last, master, *_ in _ask(port, "CLUSTER", "SLOTS"):
            out[int(master[1])] = (int(first), int(last))
        return out

    def master_of(self, key: str) -> int:
        port = next(p for p, n in self.nodes.items() if n.pid is not None)
        slot = int(_ask(port, "CLUSTER", "KEYSLOT", key))
        return next(p for p, (a, b) in self.masters().items() if a <= slot <= b)

    def kill(self, port: int) -> None:
        self.nodes[port].stop(signal.SIGKILL)

    def wait_failover(self, old_master: int, key: str, timeout: float = 30.0) -> int:
        """Until ``key``'s slot has a live master other than ``old_master`` and the cluster is ok."""

        def promoted():
            m = self.master_of(key)
            return m if m != old_master and self.ready() else None

        return _wait(f"no replica of {old_master} took over", promoted, timeout, self.log)

    def restart(self, port: int) -> None:
        """Start a killed node again: it rejoins (as a replica of the one that took over)."""
        self.nodes[port].start()

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def log(self) -> str:
        return "\n".join(f"--- {p}\n{n.log()[-1500:]}" for p, n in self.nodes.items())


class SentinelServers:
    """A master, a replica and one Sentinel (quorum 1, down after 3 s) watching service ``SERVICE``.

    Not less: a master that cannot answer the Sentinel's pings for that long on a loaded machine
    (a whole-suite run on 2 cores) is failed over again, and the node it may promote then is the old
    master, just restarted empty (no persistence) and not yet synced: Redis itself loses the stream."""

    SERVICE = "tslmaster"

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="tsl-redis-sentinel-")
        made = []
        for name in ("master", "replica", "sentinel"):
            os.mkdir(os.path.join(self.dir, name))
            made.append(os.path.join(self.dir, name))
        self.master = RedisServer(made[0], args=("--repl-diskless-sync-delay", "0"))
        self.replica = RedisServer(
            made[1], args=("--replicaof", "127.0.0.1", str(self.master.port), "--repl-diskless-sync-delay", "0")
        )
        conf = os.path.join(made[2], "sentinel.conf")  # Sentinel rewrites it: a file of its own
        with open(conf, "w") as f:
            f.write(
                f"sentinel monitor {self.SERVICE} 127.0.0.1 {self.master.port} 1\n"
                f"sentinel down-after-milliseconds {self.SERVICE} 3000\n"
                f"sentinel failover-timeout {self.SERVICE} 10000\n"
            )
        self.sentinel = RedisServer(made[2], config=conf, args=("--sentinel",))

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel.port}/{self.SERVICE}/0"

    def start(self) -> SentinelServers:
        self.master.start()
        self.replica.start()
        _wait(
            "the replica did not sync",
            lambda: _ask(self.replica.port, "INFO", "replication")["master_link_status"] == "up",
            log=self.log,
        )
        self.sentinel.start()
        _wait(
            "the Sentinel does not see the replica",
            lambda: _ask(self.sentinel.port, "SENTINEL", "REPLICAS", self.SERVICE),
            log=self.log,
        )
        return self

    def master_port(self) -> int:
        return int(_ask(self.sentinel.port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.SERVICE)[1])

    def stop(self) -> None:
        for server in (self.sentinel, self.replica, self.master):
            server.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def log(self) -> str:
        return "\n".join(f"--- {s.port}\n{s.log()[-1500:]}" for s in (self.master, self.replica, self.sentinel))


def _need_redis() -> None:
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip(
            "redis-server / redis-cli are not installed (.ci/run installs them: apt-get install -y redis-server)"
        )


@pytest.fixture(scope="module")
def redis_cluster():
    """A fresh 3-master, 3-replica cluster for the module (its tests may kill nodes)."""
    _need_redis()
    servers = RedisClusterServers()
    try:
        yield servers.start()
    finally:
        servers.stop()


@pytest.fixture
def redis_sentinel():
    _need_redis()
    servers = SentinelServers()
    try:
        yield servers.start()
    finally:
        servers.stop()
