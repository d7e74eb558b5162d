"""Real Redis servers for tests: ``redis-server`` on 127.0.0.1, a free port, a temporary directory.

The server daemonizes (``--daemonize yes``): it is reparented away from the test process, so the
leak check in conftest (which looks at our descendants) does not take a session-long server for a
leaked child; ``stop()`` kills it by the pid in its pidfile and waits until it is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

REDIS_SERVER = shutil.which("redis-server")
# trusted_roots for tests of delivery (every directory): confinement itself is test_hostile.py's.
EVERYWHERE = ["/"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


class RedisServer:
    def __init__(
        self,
        directory: str,
        *,
        password: str | None = None,
        appendonly: bool = False,
        port: int | None = None,
        args: tuple = (),
        config: str | None = None,
    ) -> None:
        self.dir, self.password, self.appendonly = directory, password, appendonly
        self.port = port or _free_port()
        self.args, self.config = tuple(args), config  # more arguments; a config file to start from (Sentinel)
        self.pid: int | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 15.0) -> RedisServer:
        pidfile = os.path.join(self.dir, "redis.pid")
        with contextlib.suppress(OSError):
            os.remove(pidfile)
        args = (
            [REDIS_SERVER]
            + ([self.config] if self.config else [])
            + [
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                self.dir,
                "--daemonize",
                "yes",
                "--pidfile",
                pidfile,
                "--logfile",
                os.path.join(self.dir, "redis.log"),
            ]
        )
        if not self.config:
            args += ["--save", "", "--appendonly", "yes" if self.appendonly else "no"]
        if self.password:
            args += ["--requirepass", self.password]
        args += self.args
        subprocess.run(args, check=True, stdout=subprocess.DEVNULL, timeout=timeout)
        deadline = time.monotonic() + timeout
        while not (text := _read(pidfile).strip()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server wrote no pidfile; log:\n{self.log()}")
            time.sleep(0.02)
        self.pid = int(text)
        atexit.register(self.stop)
        self.wait_ready(deadline)
        return self

    def wait_ready(self, deadline: float) -> None:
        import redis

        while True:
            try:
                client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=1)
                try:
                    if client.ping():
                        return
                finally:
                    client.close()
            except (redis.ConnectionError, redis.TimeoutError):  # BusyLoadingError included
                pass
            if time.monotonic() > deadline or self.pid is None or _gone(self.pid):
                raise RuntimeError(f"redis-server on port {self.port} never answered PING; log:\n{self.log()}")
            time.sleep(0.02)

    def stop(self, sig: int = signal.SIGKILL, timeout: float = 10.0) -> None:
        pid, self.pid = self.pid, None
        if pid is None:
            return
        atexit.unregister(self.stop)
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while not _gone(pid):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                deadline += timeout
            time.sleep(0.02)

    def log(self) -> str:
        return _read(os.path.join(self.dir, "redis.log"))[-4000:] or "(no log)"


def start_server(*, password: str | None = None, appendonly: bool = False, args: tuple = ()) -> tuple[RedisServer, str]:
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (.ci/run installs it: apt-get install -y redis-server)")
    directory = tempfile.mkdtemp(prefix="tsl-redis-")
    try:
        return RedisServer(directory, password=password, appendonly=appendonly, args=args).start(), directory
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise


@pytest.fixture(scope="session")
def redis_server():
    """One server for the session (no password, no persistence)."""
    server, directory = start_server()
    yield server
    server.stop()
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def fresh_redis_server():
    """A factory of servers of this test's own (``password=``, ``appendonly=``, ``args=``), stopped at its end."""
    made = []

    def make(**kwargs) -> RedisServer:
        server, directory = start_server(**kwargs)
        made.append((server, directory))
        return server

    yield make
    for server, directory in made:
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)
