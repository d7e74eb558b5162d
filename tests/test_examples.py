"""The scripts a user copies, run as the user runs them (``python example.py``, its own session, a hard
time limit): the streaming roads of ``examples/``, and what a script without its main guard is told.

Each road runs to the end of its stream (every sample produced is trained on, once) and stops early
(the trainer's steps are trained on, the rest is still in the queue, directory or stream); either way
every process exits, and the script with code 0."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from _helpers import run_script
from _redis_server import redis_server  # noqa: F401  (fixture)
from _s3_server import s3_bucket, s3_server  # noqa: F401  (fixtures)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
COUNTS = re.compile(r"^produced (\d+), trained on (\d+), left in the \w+ (\d+)$", re.M)
BATCH_SIZE = 8  # the examples' batch size

MAIN_GUARD = 'if __name__ == "__main__":'

UNGUARDED = """
import time

import torch
from torch_storage_loader import FileStorageLoader

with FileStorageLoader("samples", ttl=None, worker_num=2, mp_context="{method}") as loader:  # no main guard
    handle = loader.save({"obs": torch.zeros(4)})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the first loads are read here while the workers start
        loader.load_async(handle).result()
"""


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_script_without_main_guard_gets_one_error_that_names_it(tmp_path, method):
    result = run_script(UNGUARDED.replace("{method}", method), tmp_path, timeout=120)
    lines = result.stderr.splitlines()
    assert result.returncode == 1, result.stderr
    assert lines[-1].startswith("torch_storage_loader.errors.WorkerDiedError") and MAIN_GUARD in lines[-1], lines[-1]
    # One error, not each worker's re-run of the script (500+ lines of tracebacks before).
    assert len(lines) <= 15 and "bootstrapping phase" not in result.stderr, result.stderr
    # Its two workers, once: no later load starts more (each would run the script again).
    assert sum("died with exit code 87" in line for line in lines) <= 2, result.stderr


ROADS = [
    *(
        pytest.param(name, steps, id=f"{name}-{mode}")
        for name in ("queue_to_dataloader", "directory_to_dataloader", "redis_to_lightning")
        for steps, mode in ((None, "to-the-end"), (5, "early-stop"))
    ),
    pytest.param("redis_to_lightning-s3", None, id="redis_to_lightning-s3-to-the-end"),  # payloads in a bucket
]


@pytest.mark.parametrize(("name", "steps"), ROADS)
def test_streaming_road_runs_as_a_script_and_loses_nothing(tmp_path, request, name, steps):
    args: tuple[str, ...] = ("--steps", str(steps)) if steps else ()
    env = {}
    if name.startswith("redis"):
        args += ("--url", request.getfixturevalue("redis_server").url)
    if name.endswith("-s3"):
        name = name.removesuffix("-s3")
        args += ("--payloads", f"s3://{request.getfixturevalue('s3_bucket')}/payloads")
        env["TSL_S3_OPTIONS"] = json.dumps(request.getfixturevalue("s3_server").storage_options)
    result = run_script((EXAMPLES / f"{name}.py").read_text(), tmp_path, timeout=240, env=env, args=args)
    assert result.returncode == 0, f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr[-6000:]}"
    match = COUNTS.search(result.stdout)
    assert match, result.stdout
    produced, trained, left = map(int, match.groups())
    if steps:
        assert (trained, left) == (steps * BATCH_SIZE, produced - trained), match.group(0)
    else:
        assert (trained, left) == (produced, 0), match.group(0)


HANGS_WITH_A_SEMAPHORE = """
import multiprocessing as mp
import sys
import time


def child(q):
    lock = mp.get_context("spawn").Lock()  # named: the resource tracker unlinks it if this process dies
    q.put(lock._semlock.name)
    time.sleep(600)


if __name__ == "__main__":
    spawn = mp.get_context("spawn")
    q = spawn.Queue()
    spawn.Process(target=child, args=(q,)).start()
    print(q.get(), flush=True)
    time.sleep(600)  # a hang
"""


def test_a_killed_example_leaves_no_semaphore_behind(tmp_path):
    """run_script kills a hung script's session, but lets multiprocessing's resource tracker outlive
    the rest, so that it unlinks what the killed processes left (killed with them, it left eleven
    /dev/shm/sem.mp-* files per hung fleet example)."""
    with pytest.raises(pytest.fail.Exception, match="a hang") as info:
        run_script(HANGS_WITH_A_SEMAPHORE, tmp_path, timeout=20)
    name = re.search(r"/(mp-\S+)", str(info.value)).group(1)
    assert not os.path.exists(f"/dev/shm/sem.{name}"), f"/dev/shm/sem.{name} was left behind"


UNGUARDED_AND_RETRIED = """
import torch
from torch_storage_loader import FileStorageLoader, WorkerDiedError

with FileStorageLoader("samples", ttl=None, worker_num=2, mp_context="forkserver") as loader:  # no main guard
    handle = loader.save({"obs": torch.zeros(4)})
    failed = 0
    while failed < 4:  # a user who retries: every load after the first failure fails too, at once
        try:
            loader.load_async(handle).result(timeout=60)
        except WorkerDiedError:
            failed += 1
    print("failed", failed)
"""


def test_loads_after_an_unguarded_start_fail_without_starting_workers_again(tmp_path):
    result = run_script(UNGUARDED_AND_RETRIED, tmp_path, timeout=120)
    assert "failed 4" in result.stdout, result.stderr[-3000:]
    # The two workers of the first start, and no more: each new one would run the script again.
    assert result.stderr.count("died with exit code 87") <= 2, result.stderr[-3000:]
