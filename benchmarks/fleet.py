"""A fleet on one machine: many collectors, several trainers, servers that fail; measured, nothing lost.

    python benchmarks/fleet.py --collectors N --trainers M --seconds S --faults all|none|KIND,... \
        [--redis-cluster] [--json]

Starts on 127.0.0.1 a real ``redis-server`` (appendonly; with ``--redis-cluster`` 3 masters + 3
replicas) and a real SeaweedFS (S3), then N collector processes that save trajectories (7 MB and
64 KB kinds, ``--large-fraction`` of them large) to the object store (or ``--store dir``: a shared
directory) and put the handles on one ``RedisStorageQueue``, and M trainer processes, each
``DataLoader(StorageDataset(queue), batch_size=None, num_workers=2)`` with a GPU-like step that
sleeps ``--step-ms`` per sample. Collectors sleep ``--rollout-ms`` per trajectory (the environment).

Faults, spread evenly over the run, each switchable (``--faults collector,redis`` or ``all``):
``collector`` (SIGKILL one, restarted under its producer name), ``trainer`` (SIGKILL one with its
DataLoader, restarted), ``redis`` (SIGKILL redis-server and start it again from its append-only file;
in a cluster: SIGKILL the stream's master, its replica takes over, the old one rejoins), ``store``
(SIGKILL SeaweedFS and start it again) and ``network`` (a TCP proxy on loopback between every client
and the servers drops all connections and refuses new ones for a second; not in front of a cluster).

After ``--seconds`` the collectors stop, the stream is closed and the trainers drain it (at most
``--drain-seconds``). Every collector logs each handle ``put`` acknowledged, every trainer each sample
its loop received (tagged by collector, incarnation and number): ``lost`` counts the acknowledged
handles no trainer ever received (it must be 0), ``duplicates`` the extra deliveries. Throughput,
latency (from just before ``put`` to the trainer's loop, one clock on one machine) and the trainer's
idle fraction (time waiting for data over time waiting plus stepping) are taken over the producing
phase. CPU use per component (redis-server, SeaweedFS, collectors, trainers with their DataLoader
workers) is sampled from /proc to show what saturates. Prints one table (``--json``: its last line
is one JSON object) and draws a PNG (``--plot``: throughput, latency and backlog over time, faults
marked; its data goes beside it as JSON, which ``--replot JSON`` draws again without a run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing as mp
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from _redis_cluster import RedisClusterServers  # noqa: E402  (the tests' servers)
from _redis_server import RedisServer  # noqa: E402
from _s3_server import S3Server  # noqa: E402

KINDS = ("collector", "trainer", "redis", "store", "network")
STREAM = "fleet"
TICK_S = 1.0  # progress, CPU sampling and the plot's bins


# -- collectors and trainers (module level: started through the forkserver) ------------------------


def _die_with_parent() -> None:
    """SIGKILL this process when its parent (the forkserver, gone with the orchestrator) dies.
    SIGUSR1 prints every thread's stack (to see where a stuck process is)."""
    import faulthandler
    import logging

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # s3fs's aiohttp tasks cut by a fault end "never retrieved": asyncio's log, not an error of ours.
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _worker_init(_: int) -> None:
    _die_with_parent()


def _log(path: str):
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)


def _sleep_unless(path: str, seconds: float) -> bool:
    """Sleep ``seconds`` unless file ``path`` exists (or appears meanwhile); whether it does.

    A file, not a multiprocessing.Event: a process SIGKILLed inside Event.wait() holds the Event's
    lock for good, and every other process (and set()) blocks on it."""
    end = time.monotonic() + seconds
    while not os.path.exists(path):
        left = end - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(0.05, left))
    return True


def collector(k: int, incarnation: int, cfg: dict) -> None:
    """Save trajectories and put their handles until ``stop``; log each acknowledged put."""
    _die_with_parent()
    from torch_storage_loader import FileStorageLoader, RedisStorageQueue, configure_object_store

    rng = random.Random(cfg["seed"] * 1000 + k * 10 + incarnation)
    large = np.zeros(int(cfg["large_mb"] * 1e6), np.uint8)
    small = np.zeros(int(cfg["small_kb"] * 1e3), np.uint8)
    if cfg["store"] == "s3":
        configure_object_store(cfg["root"], cfg["s3"], retry_timeout=cfg["retry_s"])
    queue = RedisStorageQueue(
        cfg["url"],
        STREAM,
        cluster=cfg["cluster"],
        replicas=cfg["replicas"],
        retry_timeout=cfg["retry_s"],
        producer_timeout=cfg["producer_timeout"],
    )
    fd = _log(os.path.join(cfg["work"], f"put-{k}-{incarnation}.log"))
    root = f"{cfg['root']}/c{k}" if cfg["store"] == "s3" else os.path.join(cfg["root"], f"c{k}")
    with FileStorageLoader(root, ttl=None, worker_num=1) as loader, queue.producer(f"collector-{k}"):
        for seq in range(cfg["per_collector"]):
            if _sleep_unless(cfg["stop"], rng.uniform(0.5, 1.5) * cfg["rollout_s"]):
                break
            kind = 1 if rng.random() < cfg["large_fraction"] else 0
            data = large if kind else small
            traj = {"obs": data, "meta": np.array([k, incarnation, seq, kind], np.int64)}
            try:
                handle = loader.save(traj)
                t0 = time.time()
                entry = queue.put(handle)
            except Exception as exc:  # noqa: BLE001 -- counted: never acknowledged, so never "produced"
                os.write(fd, f"error {time.time():.6f} {type(exc).__name__}\n".encode())
                continue
            os.write(fd, f"put {k} {incarnation} {seq} {t0:.6f} {time.time():.6f} {data.nbytes} {entry}\n".encode())
    queue.disconnect()


def trainer(j: int, incarnation: int, cfg: dict) -> None:
    """``DataLoader(StorageDataset(queue), num_workers=2)`` until the stream ends; log every sample."""
    _die_with_parent()
    from torch.utils.data import DataLoader

    from torch_storage_loader import RedisStorageQueue, StorageDataset, configure_object_store

    if cfg["store"] == "s3":
        configure_object_store(cfg["root"], cfg["s3"], retry_timeout=cfg["retry_s"])
    queue = RedisStorageQueue(
        cfg["url"],
        STREAM,
        cluster=cfg["cluster"],
        retry_timeout=cfg["retry_s"],
        claim_after=cfg["claim_after"],
        producer_timeout=cfg["producer_timeout"],
        trusted_roots=[cfg["root"]],
    )  # the collectors write under it
    fd = _log(os.path.join(cfg["work"], f"got-{j}-{incarnation}.log"))
    dataset = StorageDataset(queue, on_error="skip")
    # A trainer killed takes its DataLoader workers along (as a crashed node would).
    loader = DataLoader(
        dataset, batch_size=None, num_workers=2, worker_init_fn=_worker_init, multiprocessing_context="fork"
    )  # fast: the trainer has all it needs imported
    os.write(fd, f"start {time.time():.6f}\n".encode())
    ready = time.time()
    for sample in loader:
        got = time.time()
        k, inc, seq, _kind = (int(x) for x in sample["meta"].tolist())
        nbytes = sum(int(v.nbytes) for v in sample.values())
        del sample
        os.write(fd, f"got {k} {inc} {seq} {got:.6f} {got - ready:.6f} {nbytes}\n".encode())
        time.sleep(cfg["step_s"])  # the GPU-like step
        ready = time.time()
    os.write(fd, f"end {time.time():.6f}\n".encode())
    queue.disconnect()


# -- a TCP proxy that can drop every connection ---------------------------------------------------


def proxy(routes: list[tuple[int, int]], commands, ready) -> None:
    """Forward 127.0.0.1:listen -> 127.0.0.1:target for each route; on b"drop", close every connection
    and refuse new ones for a second; on b"stop", exit."""
    _die_with_parent()

    async def main() -> None:
        live: set = set()
        refuse_until = [0.0]

        async def pipe(reader, writer) -> None:
            try:
                while data := await reader.read(1 << 18):
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError, asyncio.CancelledError):
                pass
            finally:
                writer.close()

        def handler(target: int):
            async def handle(reader, writer) -> None:
                if time.monotonic() < refuse_until[0]:
                    writer.transport.abort()
                    return
                try:
                    up_r, up_w = await asyncio.open_connection("127.0.0.1", target)
                except OSError:
                    writer.transport.abort()
                    return
                pair = (writer, up_w)
                live.add(pair)
                try:
                    await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))
                finally:
                    live.discard(pair)

            return handle

        servers = [await asyncio.start_server(handler(t), "127.0.0.1", port) for port, t in routes]
        ready.set()
        loop = asyncio.get_running_loop()
        while True:
            cmd = await loop.run_in_executor(None, commands.recv)
            if cmd == b"stop":
                break
            refuse_until[0] = time.monotonic() + 1.0
            for a, b in list(live):  # RST both sides: clients see a reset connection
                a.transport.abort()
                b.transport.abort()
        for s in servers:
            s.close()

    asyncio.run(main())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the orchestrator ------------------------------------------------------------------------------


class Fleet:
    def __init__(self, args) -> None:
        self.args = args
        self.kinds = list(KINDS) if args.faults == "all" else [] if args.faults == "none" else args.faults.split(",")
        self.work = tempfile.mkdtemp(prefix="tsl-fleet-")
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(
            [
                "numpy",
                "torch",
                "torch_storage_loader.dataset",
                "torch_storage_loader.file_loader",
                "torch_storage_loader.redis_queue",
            ]
        )
        self.collectors: dict[int, tuple[mp.Process, int]] = {}
        self.trainers: dict[int, tuple[mp.Process, int]] = {}
        self.faults: list[tuple[str, float]] = []
        self.redis = self.cluster = self.s3 = self.proxy = None
        self.helpers: list[threading.Thread] = []
        self.cpu: dict[str, float] = {}
        self.cpu_prev: dict[int, float] = {}

    # servers
    def start_servers(self) -> dict:
        a = self.args
        if a.redis_cluster:
            self.cluster = RedisClusterServers()
            for node in self.cluster.nodes.values():
                node.args += ("--appendonly", "yes", "--appendfsync", a.appendfsync)
            self.cluster.start()
            redis_port = int(self.cluster.url.rsplit(":", 1)[1].split("/")[0])
        else:
            d = os.path.join(self.work, "redis")
            os.mkdir(d)
            self.redis = RedisServer(d, appendonly=True, args=("--appendfsync", a.appendfsync)).start()
            redis_port = self.redis.port
        s3_port = None
        if a.store == "s3":
            d = os.path.join(self.work, "s3")
            os.mkdir(d)
            self.s3 = S3Server(d).start()
            self.s3.make_bucket("fleet")
            s3_port = self.s3.port
        routes = []
        if "network" in self.kinds:
            if not a.redis_cluster:
                routes.append((_free_port(), redis_port))
            if s3_port:
                routes.append((_free_port(), s3_port))
            self.proxy_cmd, theirs = self.ctx.Pipe()
            ready = self.ctx.Event()
            self.proxy = self.ctx.Process(target=proxy, args=(routes, theirs, ready), daemon=True)
            self.proxy.start()
            ready.wait(30)
        via = {t: p for p, t in routes}
        url = f"redis://127.0.0.1:{via.get(redis_port, redis_port)}/0"
        cfg = {
            "url": url,
            "cluster": a.redis_cluster,
            "stop": os.path.join(self.work, "stop"),
            "replicas": 1 if a.redis_cluster else 0,
            "store": a.store,
            "work": self.work,
            "seed": a.seed,
            "large_mb": a.large_mb,
            "small_kb": a.small_kb,
            "large_fraction": a.large_fraction,
            "rollout_s": a.rollout_ms / 1000,
            "step_s": a.step_ms / 1000,
            "claim_after": a.claim_after,
            "retry_s": 120.0,
            "producer_timeout": 30.0,
            "per_collector": max(1, math.ceil(a.max_handles / a.collectors)),
        }
        if a.store == "s3":
            endpoint = f"http://127.0.0.1:{via.get(s3_port, s3_port)}"
            cfg.update(
                root="s3://fleet/run", s3={"key": S3Server.KEY, "secret": S3Server.SECRET, "endpoint_url": endpoint}
            )
        else:
            cfg.update(root=os.path.join(self.work, "store"))
        self.direct_url = f"redis://127.0.0.1:{redis_port}/0"
        self.cfg = cfg
        return cfg

    def stop_servers(self) -> None:
        for t in self.helpers:
            t.join(120)
        if self.proxy is not None and self.proxy.is_alive():
            with contextlib.suppress(OSError):
                self.proxy_cmd.send(b"stop")
            self.proxy.join(5)
            if self.proxy.is_alive():
                self.proxy.kill()
                self.proxy.join()
        for server in (self.s3, self.redis, self.cluster):
            if server is not None:
                server.stop()

    # processes
    def start_collector(self, k: int) -> None:
        inc = self.collectors[k][1] + 1 if k in self.collectors else 0
        p = self.ctx.Process(target=collector, args=(k, inc, self.cfg))
        p.start()
        self.collectors[k] = (p, inc)

    def start_trainer(self, j: int) -> None:
        inc = self.trainers[j][1] + 1 if j in self.trainers else 0
        p = self.ctx.Process(target=trainer, args=(j, inc, self.cfg), daemon=False)
        p.start()
        self.trainers[j] = (p, inc)

    def queue(self):
        from torch_storage_loader import RedisStorageQueue

        url = self.cluster.url if self.cluster else self.direct_url
        return RedisStorageQueue(url, STREAM, cluster=self.args.redis_cluster, retry_timeout=120.0)

    # faults
    def fault(self, kind: str, t: float, rng: random.Random) -> None:
        self.faults.append((kind, t))
        if kind == "collector":
            k = rng.randrange(len(self.collectors))
            os.kill(self.collectors[k][0].pid, signal.SIGKILL)
            self.collectors[k][0].join()
            time.sleep(1.0)
            self.start_collector(k)
        elif kind == "trainer":
            j = rng.randrange(len(self.trainers))
            os.kill(self.trainers[j][0].pid, signal.SIGKILL)
            self.trainers[j][0].join()
            self.start_trainer(j)
        elif kind == "redis" and self.cluster is not None:
            port = self.cluster.master_of(STREAM)
            self.cluster.kill(port)

            def back() -> None:
                self.cluster.wait_failover(port, STREAM, timeout=60)
                self.cluster.restart(port)

            self.helpers.append(threading.Thread(target=back, daemon=True))
            self.helpers[-1].start()
        elif kind == "redis":
            self.redis.stop(signal.SIGKILL)
            self.redis.start()
        elif kind == "store":
            self.helpers.append(threading.Thread(target=self.s3.restart, daemon=True))
            self.helpers[-1].start()
        elif kind == "network":
            self.proxy_cmd.send(b"drop")

    # CPU per component, from /proc
    def sample_cpu(self) -> None:
        hz = os.sysconf("SC_CLK_TCK")
        roles: dict[int, str] = {}
        if self.redis is not None and self.redis.pid:
            roles[self.redis.pid] = "redis"
        if self.cluster is not None:
            roles.update({n.pid: "redis" for n in self.cluster.nodes.values() if n.pid})
        if self.s3 is not None and self.s3.pid:
            roles[self.s3.pid] = "store"
        if self.proxy is not None and self.proxy.pid:
            roles[self.proxy.pid] = "proxy"
        roles.update({p.pid: "collectors" for p, _ in self.collectors.values() if p.pid})
        roles.update({p.pid: "trainers" for p, _ in self.trainers.values() if p.pid})
        parent, ticks = {}, {}
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(pid)] = int(fields[1])
            ticks[int(pid)] = (int(fields[11]) + int(fields[12])) / hz
        for pid in ticks:  # DataLoader workers count for their trainer
            p, hops = pid, 0
            while p not in roles and p in parent and hops < 4:
                p, hops = parent[p], hops + 1
            role = roles.get(p)
            if role is not None:
                self.cpu[role] = self.cpu.get(role, 0.0) + max(0.0, ticks[pid] - self.cpu_prev.get(pid, 0.0))
                self.cpu_prev[pid] = ticks[pid]

    def run(self) -> dict:
        a = self.args
        rng = random.Random(a.seed)
        cfg = self.start_servers()
        queue = self.queue()
        queue.delete()
        queue.stats()  # makes the stream and its group
        for j in range(a.trainers):
            self.start_trainer(j)
        for k in range(a.collectors):
            self.start_collector(k)
        schedule = [(a.seconds * (i + 1) / (len(self.kinds) + 1), kind) for i, kind in enumerate(self.kinds)]
        bar = _bar(a.seconds + a.drain_seconds, a.json)
        t_start = time.time()
        self.sample_cpu()
        self.cpu = {}
        cpu_at_end, produce_end, drained = {}, None, False
        while True:
            now = time.time() - t_start
            while schedule and schedule[0][0] <= now:
                self.fault(schedule.pop(0)[1], now, rng)
            if produce_end is None and now >= a.seconds:
                self.sample_cpu()
                cpu_at_end, produce_end = dict(self.cpu), time.time()
                open(cfg["stop"], "w").close()
                for p, _ in self.collectors.values():
                    p.join(cfg["retry_s"] + 30)
                queue.close()
            if produce_end is not None:
                if all(not p.is_alive() for p, _ in self.trainers.values()):
                    drained = True
                    break
                if time.time() - produce_end > a.drain_seconds:
                    break
            time.sleep(min(TICK_S, max(0.01, (schedule[0][0] - now) if schedule else TICK_S)))
            self.sample_cpu()
            _tick(bar, time.time() - t_start, self.work)
        _close_bar(bar)
        for p, _ in list(self.trainers.values()) + list(self.collectors.values()):
            if p.is_alive():
                p.kill()
            p.join()
        redis_stats = queue.stats()
        queue.delete()
        queue.disconnect()
        self.stop_servers()
        return self.figures(t_start, produce_end, drained, cpu_at_end, redis_stats)

    def figures(self, t_start: float, produce_end: float, drained: bool, cpu: dict, redis_stats: dict) -> dict:
        a = self.args
        puts, errors, gets, _starts = _read_logs(self.work)
        produced = {key: (t0, nbytes) for key, t0, nbytes in puts}
        first: dict = {}
        deliveries = 0
        for key, got, wait, nbytes in gets:
            deliveries += 1
            if key not in first or got < first[key][0]:
                first[key] = (got, wait, nbytes)
        lost = [key for key in produced if key not in first]
        window = max(1e-9, produce_end - t_start)
        in_window = [(got, wait, nbytes) for _, got, wait, nbytes in gets if t_start <= got <= produce_end]
        latencies = np.array([(first[key][0] - t0) * 1000 for key, (t0, _) in produced.items() if key in first])
        waits = sum(w for _, w, _ in in_window)
        stepping = len(in_window) * a.step_ms / 1000
        cores = os.cpu_count() or 1
        out = {
            "collectors": a.collectors,
            "trainers": a.trainers,
            "seconds": a.seconds,
            "store": a.store,
            "redis": "cluster" if a.redis_cluster else "single",
            "appendfsync": a.appendfsync,
            "produced": len(produced),
            "delivered": len(first),
            "deliveries": deliveries,
            "duplicates": deliveries - len(first),
            "lost": len(lost),
            "unlogged_delivered": len(
                set(first) - set(produced)
            ),  # put acknowledged to a collector killed before its log line
            "put_errors": len(errors),
            "failed_loads": redis_stats.get("failed", 0),
            "samples_per_s": round(len(in_window) / window, 2),
            "gbps": round(sum(n for _, _, n in in_window) / window / 1e9, 4),
            "latency_p50_ms": round(float(np.percentile(latencies, 50)), 1) if len(latencies) else None,
            "latency_p99_ms": round(float(np.percentile(latencies, 99)), 1) if len(latencies) else None,
            "trainer_idle": round(waits / (waits + stepping), 3) if waits + stepping else None,
            "faults": [f"{kind}:{t:.1f}" for kind, t in self.faults],
            "drained": drained,
            "drain_s": round(max(got for _, got, _, _ in gets) - produce_end, 1) if gets else None,
            "cpu_cores": {k: round(v / window, 2) for k, v in sorted(cpu.items())} | {"machine": cores},
            "redis_stats": {
                k: redis_stats[k]
                for k in (
                    "delivered",
                    "claimed",
                    "acked",
                    "duplicates",
                    "returned",
                    "failed",
                    "refused",
                    "pending",
                    "undelivered",
                )
            },
        }
        self.series = _series(produced, gets, t_start, produce_end)
        self.lost_keys = lost[:20]
        return out


# -- logs, progress, output ------------------------------------------------------------------------


def _kill_descendants() -> None:
    """SIGKILL whatever of ours is still running (but the stdlib's forkserver and resource tracker)."""
    from multiprocessing import forkserver, resource_tracker

    keep = {
        getattr(forkserver._forkserver, "_forkserver_pid", None),
        getattr(resource_tracker._resource_tracker, "_pid", None),
    }
    parent = {}
    for pid in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/stat") as f:
            parent[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
    todo, mine = [os.getpid()], []
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        todo += kids
        mine += [c for c in kids if c not in keep]
    for pid in mine:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in mine:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)


def _read_logs(work: str):
    puts, errors, gets, starts = [], [], [], []
    for name in sorted(os.listdir(work)):
        if not name.endswith(".log"):
            continue
        with open(os.path.join(work, name)) as f:
            for line in f:
                parts = line.split()
                if not line.endswith("\n") or not parts:
                    continue  # a line cut by SIGKILL
                if parts[0] == "put":
                    puts.append(((int(parts[1]), int(parts[2]), int(parts[3])), float(parts[4]), int(parts[6])))
                elif parts[0] == "error":
                    errors.append(float(parts[1]))
                elif parts[0] == "got":
                    gets.append(
                        ((int(parts[1]), int(parts[2]), int(parts[3])), float(parts[4]), float(parts[5]), int(parts[6]))
                    )
                elif parts[0] == "start":
                    starts.append(float(parts[1]))
    return puts, errors, gets, starts


def _series(produced: dict, gets: list, t0: float, t_end: float) -> dict:
    """Per TICK_S bin from t0: samples/s, GB/s, latency p50/p99 of what the trainers received, and the
    backlog at each bin's end (handles put and acknowledged, not yet received by any trainer)."""
    if not gets:
        return {"t": [], "samples": [], "gbps": [], "p50": [], "p99": [], "backlog": []}
    last = max(g for _, g, _, _ in gets)
    n = int((last - t0) / TICK_S) + 1
    samples, nbytes, lat = np.zeros(n), np.zeros(n), [[] for _ in range(n)]
    first: dict = {}
    for key, got, _, size in gets:
        first[key] = min(got, first.get(key, got))
        i = int((got - t0) / TICK_S)
        if 0 <= i < n:
            samples[i] += 1
            nbytes[i] += size
            if key in produced:
                lat[i].append((got - produced[key][0]) * 1000)
    pct = lambda q: [float(np.percentile(x, q)) if x else float("nan") for x in lat]  # noqa: E731
    ends = t0 + (np.arange(n) + 1) * TICK_S
    put_at = np.sort([t for t, _ in produced.values()])
    got_at = np.sort([first[key] for key in produced if key in first])
    backlog = np.searchsorted(put_at, ends, side="right") - np.searchsorted(got_at, ends, side="right")
    return {
        "t": [i * TICK_S for i in range(n)],
        "samples": list(samples / TICK_S),
        "gbps": list(nbytes / TICK_S / 1e9),
        "p50": pct(50),
        "p99": pct(99),
        "backlog": [int(b) for b in backlog],
        "end": t_end - t0,
    }


def _bar(total: float, quiet: bool):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(
        total=round(total),
        unit="s",
        desc="fleet",
        file=sys.stderr,
        dynamic_ncols=True,
        bar_format="{desc}: {n:.0f}/{total:.0f} s |{bar}| {postfix}",
    )


def _tick(bar, elapsed: float, work: str) -> None:
    if bar is None:
        return
    sizes = {"put": 0, "got": 0}
    for name in os.listdir(work):
        kind = name.split("-", 1)[0]
        if kind in sizes:
            with contextlib.suppress(OSError), open(os.path.join(work, name), "rb") as f:
                data = f.read()
            sizes[kind] += data.count(b"\n" + kind.encode()) + data.startswith(kind.encode())
    bar.n = min(bar.total, round(elapsed))
    bar.set_postfix_str(f"put {sizes['put']}, received {sizes['got']}")


def _close_bar(bar) -> None:
    if bar is not None:
        bar.close()


FAULT_LABELS = {  # what each fault did, as the plot marks it
    "collector": "collector SIGKILLed",
    "trainer": "trainer SIGKILLed",
    "redis": "Redis SIGKILLed",
    "store": "SeaweedFS SIGKILLed",
    "network": "connections cut 1 s",
}


def plot(series: dict, faults: list, path: str, title: str) -> None:
    """Delivery over time: received samples/s and GB/s, put-to-trainer latency, backlog; faults marked.

    Drawn at 1000 px wide (the docs' width); ``fleet.py --replot JSON`` redraws it from the JSON saved
    beside the PNG.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    t, end = series["t"], series.get("end")
    with plt.rc_context({"font.size": 11, "axes.titlesize": 11, "legend.fontsize": 10}):
        fig, (top, middle, bottom) = plt.subplots(
            3, 1, figsize=(10, 8.4), sharex=True, gridspec_kw={"height_ratios": [1.1, 1, 0.8]}
        )
        top.plot(t, series["samples"], label="samples/s received (all trainers)", color="tab:blue")
        top.set_ylabel("samples / s")
        right = top.twinx()
        right.plot(t, series["gbps"], label="GB/s received", color="tab:orange", alpha=0.7)
        right.set_ylabel("GB / s")
        top.set_ylim(0, (max(series["samples"], default=0) or 1) * 1.3)  # room for the legend
        right.set_ylim(0, (max(series["gbps"], default=0) or 1) * 1.3)
        seconds = lambda ms: [x / 1000 for x in ms]  # noqa: E731
        middle.plot(t, seconds(series["p50"]), label="p50", color="tab:green", marker=".", markersize=5)
        middle.plot(t, seconds(series["p99"]), label="p99", color="tab:red", marker=".", markersize=5)
        middle.set_yscale("log")
        middle.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g} s"))
        middle.set_ylabel("put -> trainer\nlatency (log)")
        backlog = series.get("backlog")
        if backlog:
            bottom.fill_between(t, backlog, step="post", color="tab:purple", alpha=0.35, linewidth=0)
            bottom.step(t, backlog, where="post", color="tab:purple", label="handles waiting in the stream")
            bottom.set_ylim(bottom=0)
        bottom.set_ylabel("backlog\n(handles)")
        bottom.set_xlabel("seconds since the fleet started (1 s bins)")
        for ax in (top, middle, bottom):
            ax.grid(alpha=0.3)
            if end:
                ax.axvspan(end, max(t or [end]) + TICK_S, color="0.9", zorder=0)
            for f in faults:
                ax.axvline(float(f.split(":")[1]), color="k", linestyle=":", linewidth=1.2)
        marks = [(float(f.split(":")[1]), FAULT_LABELS.get(f.split(":")[0], f.split(":")[0])) for f in faults]
        if end:
            marks.append((end, "collectors stop, trainers drain"))
        if marks:  # named above the plot, on a top axis, where no line or legend hides them
            top.secondary_xaxis("top").set_xticks(
                [at for at, _ in marks], [label.replace(" ", "\n", 1) for _, label in marks], fontsize=9
            )
        lines = top.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
        top.legend(lines, [h.get_label() for h in lines], loc="upper left")
        middle.legend(title="per 1 s bin", loc="upper left")
        if backlog:
            bottom.legend(loc="upper left")
        top.set_title(title, fontsize=11)
        fig.text(
            0.01,
            0.005,
            "Dotted lines: faults injected; grey: the drain. Latency follows the backlog: a handle waits in the "
            "stream behind those put before it.",
            fontsize=9,
            color="0.3",
        )
        fig.tight_layout(rect=(0, 0.02, 1, 1))
        fig.savefig(path, dpi=100)
        plt.close(fig)


def save_series(path: str, series: dict, faults: list, title: str, figures: dict) -> None:
    """What ``plot`` draws, as JSON beside the PNG, so ``--replot`` redraws it without a run."""
    nan_free = {
        k: [None if isinstance(x, float) and math.isnan(x) else x for x in v] if isinstance(v, list) else v
        for k, v in series.items()
    }
    with open(path, "w") as f:
        json.dump({"title": title, "faults": faults, "series": nan_free, "figures": figures}, f, indent=1)


def replot(json_path: str, png: str) -> None:
    with open(json_path) as f:
        saved = json.load(f)
    series = {
        k: [float("nan") if x is None else x for x in v] if isinstance(v, list) else v
        for k, v in saved["series"].items()
    }
    plot(series, saved["faults"], png, saved["title"])


COLUMNS = (
    "collectors",
    "trainers",
    "produced",
    "delivered",
    "duplicates",
    "lost",
    "samples_per_s",
    "gbps",
    "latency_p50_ms",
    "latency_p99_ms",
    "trainer_idle",
)


def table(rows: list[dict]) -> str:
    cols = [(c, [str(r.get(c)) for r in rows]) for c in COLUMNS]
    widths = [max(len(c), *(len(v) for v in vals)) for c, vals in cols]
    lines = ["  ".join(c.rjust(w) for (c, _), w in zip(cols, widths, strict=False))]
    for i in range(len(rows)):
        lines.append("  ".join(vals[i].rjust(w) for (_, vals), w in zip(cols, widths, strict=False)))
    return "\n".join(lines)


def parse(argv: list[str] | None = None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--collectors", type=int, default=16)
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--seconds", type=float, default=30.0, help="producing phase")
    p.add_argument("--faults", default="none", help="all, none, or a comma-separated list of " + ", ".join(KINDS))
    p.add_argument("--redis-cluster", action="store_true", help="3 masters + 3 replicas instead of one redis-server")
    p.add_argument("--json", action="store_true", help="end with one JSON line of every figure")
    p.add_argument("--store", choices=("s3", "dir"), default="s3", help="SeaweedFS over S3, or a shared directory")
    p.add_argument("--large-mb", type=float, default=7.0)
    p.add_argument("--small-kb", type=float, default=64.0)
    p.add_argument("--large-fraction", type=float, default=0.5)
    p.add_argument("--rollout-ms", type=float, default=200.0, help="each collector's time per trajectory")
    p.add_argument("--step-ms", type=float, default=5.0, help="each trainer's GPU-like step per sample")
    p.add_argument("--claim-after", type=float, default=5.0)
    p.add_argument("--drain-seconds", type=float, default=90.0)
    p.add_argument("--max-handles", type=int, default=100_000, help="at most this many puts in all")
    p.add_argument("--appendfsync", choices=("always", "everysec", "no"), default="everysec")
    p.add_argument("--plot", default="fleet.png", help="PNG to draw ('' for none); its data goes beside it, as .json")
    p.add_argument("--replot", metavar="JSON", help="only redraw --plot from a JSON saved beside an earlier PNG")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    bad = [k for k in ([] if a.faults in ("all", "none") else a.faults.split(",")) if k not in KINDS]
    if bad:
        p.error(f"--faults: unknown {bad}; choose from {', '.join(KINDS)}, all or none")
    if a.collectors < 1 or a.trainers < 1 or a.seconds <= 0:
        p.error("--collectors and --trainers must be >= 1, --seconds > 0")
    if a.store == "dir" and "store" in a.faults and a.faults != "all":
        p.error("the store fault needs --store s3")
    return a


def main(argv: list[str] | None = None) -> dict | None:
    args = parse(argv)
    if args.replot:
        replot(args.replot, args.plot)
        print(f"drew {args.plot} from {args.replot}")
        return None
    if args.store == "dir" and args.faults == "all":
        args.faults = ",".join(k for k in KINDS if k != "store")
    fleet = Fleet(args)
    stop_signal = threading.Event()

    def on_signal(signum, frame):  # Ctrl-C / SIGTERM: stop everything, leave nothing behind
        stop_signal.set()
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM,)}
    try:
        out = fleet.run()
    finally:
        for p, _ in list(fleet.trainers.values()) + list(fleet.collectors.values()):
            if p.is_alive():
                p.kill()
                p.join()
        fleet.stop_servers()
        for s, h in old.items():
            signal.signal(s, h)
        _kill_descendants()
        shutil.rmtree(fleet.work, ignore_errors=True)
    if args.plot:
        store = "S3 (SeaweedFS)" if args.store == "s3" else "a shared directory"
        title = (
            f"fleet.py: {args.collectors} collectors x {args.trainers} trainers, {args.seconds:g} s producing, "
            f"{out['redis']} Redis, {store}\nfaults: {args.faults}; {out['cpu_cores']['machine']} cores; "
            f"{out['produced']} put, {out['lost']} lost"
        )
        plot(fleet.series, out["faults"], args.plot, title)
        save_series(os.path.splitext(args.plot)[0] + ".json", fleet.series, out["faults"], title, out)
        out["plot"] = args.plot
    print(table([out]))
    print(
        f"faults: {', '.join(out['faults']) or 'none'}; lost handles: {out['lost']}"
        + (f" (first: {fleet.lost_keys})" if fleet.lost_keys else "")
        + f"; CPU (cores, producing phase): {out['cpu_cores']}"
    )
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
