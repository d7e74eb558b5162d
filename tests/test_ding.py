"""DI-engine switches by changing an import: its own middleware and a Parallel pipeline run with this
library's loader. Skipped where DI-engine is not installed (``.ci/run`` installs it)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from _helpers import run_script

pytest.importorskip("ding.framework", reason="DI-engine is not installed (.ci/run installs .ci/ding-requirements.txt)")

IS_DING_STORAGE = """
import {first}, {second}
from ding.data import Storage as DingStorage
from torch_storage_loader import FileStorage
print(isinstance(FileStorage("x.tsl"), DingStorage))
"""


@pytest.mark.parametrize(
    "first,second",
    [("torch_storage_loader.storage", "ding.data"), ("ding.data", "torch_storage_loader.storage")],
    ids=["ours-first", "ding-first"],
)
def test_handles_are_ding_storages_in_either_import_order(first, second):
    source = IS_DING_STORAGE.format(first=first, second=second)
    out = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split()[-1] == "True", out


def test_using_the_library_does_not_import_ding(tmp_path):
    source = """
import sys
import numpy as np
from torch_storage_loader import FileStorageLoader
if __name__ == "__main__":
    with FileStorageLoader(sys.argv[1], worker_num=1) as loader:
        loader.load_async(loader.save({"x": np.arange(3)})).result(timeout=60)
    print(sorted(m for m in sys.modules if m == "ding" or m.startswith("ding.")))
"""
    proc = run_script(source, tmp_path, args=(str(tmp_path / "s"),))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[-2] == "[]", proc.stdout


# DI-engine 0.5.3's ding/framework/middleware/tests/test_distributer.py, with the import changed.
CONTEXT_EXCHANGER = """
import shutil, sys
from os import path
from time import sleep

import numpy as np
from ding.framework import task
from ding.framework.context import OnlineRLContext
from ding.framework.middleware.distributer import ContextExchanger
from ding.framework.parallel import Parallel

from torch_storage_loader import FileStorageLoader

TEMPDIR = sys.argv[1]


def main():
    with task.start(ctx=OnlineRLContext()):
        if task.router.node_id == 0:
            task.add_role(task.role.LEARNER)
        elif task.router.node_id == 1:
            task.add_role(task.role.COLLECTOR)

        storage_loader = FileStorageLoader(dirname=TEMPDIR)
        try:
            task.use(ContextExchanger(skip_n_iter=1, storage_loader=storage_loader))

            if task.has_role(task.role.LEARNER):

                def learner_context(ctx):
                    assert len(ctx.trajectories) == 2
                    assert len(ctx.trajectory_end_idx) == 4
                    assert len(ctx.episodes) == 8
                    assert ctx.env_step > 0
                    assert ctx.env_episode > 0
                    yield
                    ctx.train_iter += 1
                    print("learner step", ctx.train_iter, flush=True)

                task.use(learner_context)
            elif task.has_role(task.role.COLLECTOR):

                def collector_context(ctx):
                    if ctx.total_step > 0:
                        assert ctx.train_iter > 0
                    yield
                    ctx.trajectories = [np.random.rand(10, 10) for _ in range(2)]
                    ctx.trajectory_end_idx = [1 for _ in range(4)]
                    ctx.episodes = [np.random.rand(10, 10) for _ in range(8)]
                    ctx.env_step += 1
                    ctx.env_episode += 1

                task.use(collector_context)

            task.run(max_step=3)
        finally:
            storage_loader.shutdown()
            sleep(1)
            if path.exists(TEMPDIR):
                shutil.rmtree(TEMPDIR, ignore_errors=True)


if __name__ == "__main__":
    Parallel.runner(n_parallel_workers=2)(main)
    print("done", flush=True)
"""


def test_context_exchanger_with_storage_loader(tmp_path):
    proc = run_script(CONTEXT_EXCHANGER, tmp_path, timeout=120, args=(str(tmp_path / "exchange"),))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("learner step") == 3, (proc.stdout, proc.stderr[-4000:])
    assert proc.stdout.rstrip().endswith("done")


# A collector -> learner pipeline in DI-engine's own Parallel (as ding/example/dqn.py, without gym):
# the collector saves transitions through ContextExchanger's storage_loader, the learner fits a
# small Q network on them, and every process exits.
PIPELINE = """
import sys

import torch
from ding.framework import task
from ding.framework.context import OnlineRLContext
from ding.framework.middleware.distributer import ContextExchanger
from ding.framework.parallel import Parallel

from torch_storage_loader import FileStorageLoader

DIRNAME = sys.argv[1]
STEPS = 20


def main():
    torch.manual_seed(0)
    with task.start(ctx=OnlineRLContext()):
        if task.router.node_id == 0:
            task.add_role(task.role.LEARNER)
        else:
            task.add_role(task.role.COLLECTOR)
        task.use(ContextExchanger(skip_n_iter=1, storage_loader=FileStorageLoader(DIRNAME, ttl=60)))
        if task.has_role(task.role.LEARNER):
            model = torch.nn.Linear(4, 2)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            losses = []

            def learner(ctx):
                batch = ctx.trajectories
                obs = torch.stack([t["obs"] for t in batch])
                action = torch.stack([t["action"] for t in batch])
                target = torch.stack([t["reward"] for t in batch])
                q = model(obs).gather(1, action[:, None])[:, 0]
                loss = torch.nn.functional.mse_loss(q, target)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                ctx.train_iter += 1
                yield
                if ctx.train_iter == STEPS:
                    print(f"trained {ctx.train_iter} iterations, loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)

            task.use(learner)
        else:

            def collector(ctx):
                obs = torch.rand(32, 4)
                action = torch.randint(0, 2, (32,))
                ctx.trajectories = [
                    {"obs": o, "action": a, "reward": o.sum() * (a * 2 - 1), "done": torch.tensor(False)}
                    for o, a in zip(obs, action)
                ]
                ctx.env_step += 32
                yield

            task.use(collector)
        task.run(max_step=STEPS)


if __name__ == "__main__":
    Parallel.runner(n_parallel_workers=2)(main)
    print("exited", flush=True)
"""


def test_parallel_collector_learner_pipeline_trains_and_exits(tmp_path):
    proc = run_script(PIPELINE, tmp_path, timeout=150, args=(str(tmp_path / "payloads"),))
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == "exited", proc.stdout
    trained = [line for line in lines if line.startswith("trained 20 iterations")]
    assert len(trained) == 1, (proc.stdout, proc.stderr[-4000:])
    first, last = (float(x) for x in trained[0].split("loss ")[1].split(" -> "))
    assert last < first, trained
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]


# ------------------------------------------------------------------------------------ mixed fleet
def test_a_ding_handle_is_refused_saying_collectors_and_learners_switch_together(tmp_path):
    from ding.data import FileStorage as DingFileStorage

    from torch_storage_loader import FileStorageLoader, PickleNotAllowedError

    handle = DingFileStorage(str(tmp_path / "ding.pkl"))
    handle.save({"obs": np.ones(3)})
    with FileStorageLoader(tmp_path / "own", worker_num=1) as loader:
        with pytest.raises(PickleNotAllowedError, match="Collectors and learners switch together") as info:
            loader.load_async(handle)
        assert "allow_pickle=True" in str(info.value) and info.value.path == handle.path
        assert loader.stats().loads == 0


def test_a_ding_handle_loads_with_its_own_code_where_pickle_is_allowed(tmp_path):
    from ding.data import FileStorage as DingFileStorage
    from easydict import EasyDict

    from torch_storage_loader import FileStorageLoader

    sample = {"obs": np.arange(6, dtype=np.float32).reshape(2, 3), "info": EasyDict(env_id=3, done=False)}
    handle = DingFileStorage(str(tmp_path / "ding.pkl"))
    handle.save(sample)
    with FileStorageLoader(tmp_path / "own", worker_num=1, allow_pickle=True) as loader:
        got = loader.load_async(handle).result(timeout=120)
        assert np.array_equal(got["obs"], sample["obs"])
        assert got["info"] == sample["info"] and isinstance(got["info"], EasyDict)
        del got
