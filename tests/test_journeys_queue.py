"""The queue road as a user walks it: collector processes put handles into a ``StorageQueue``, a
trainer reads some or all of them, and every process exits. Each script runs as ``python
example.py`` (see ``_helpers.run_script``), with a hard time limit that turns a hang into a failure."""

from __future__ import annotations

import pytest
from _helpers import run_script

COLLECTORS = """
import multiprocessing as mp, os, sys, time
import numpy as np
from torch_storage_loader import FileStorageLoader, StorageQueue, StorageDataset


def collect(queue, root, start, n):
    loader = FileStorageLoader(root, ttl=600)
    with queue.producer():
        for i in range(start, start + n):
            queue.put(loader.save({"obs": np.full(4, i, dtype=np.float32)}))
    loader.shutdown()
"""


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_collectors_exit_when_the_trainer_stops_early(tmp_path, method):
    """Issue 28, row 1: 2 collectors put 400 handles each; the trainer reads 10 batches and stops;
    ``join()`` returns at once (on c0a849d it never did: the collectors' queue feeder threads wait for
    their pipe to be read). What they put is still there for the next consumer."""
    script = (
        COLLECTORS
        + f"""
if __name__ == "__main__":
    from torch.utils.data import DataLoader
    ctx = mp.get_context({method!r})
    queue = StorageQueue()
    procs = [ctx.Process(target=collect, args=(queue, "replay", k * 400, 400)) for k in range(2)]
    for p in procs:
        p.start()
    time.sleep(3)  # the collectors put everything before the trainer reads anything
    seen = []
    loader = DataLoader(StorageDataset(queue, batch_size=8), batch_size=None, num_workers=2)
    for step, batch in enumerate(loader):
        seen += batch["obs"][:, 0].int().tolist()
        if step == 9:
            break
    del loader
    queue.close()
    started = time.monotonic()
    for p in procs:
        p.join(20)
    print("joined in", round(time.monotonic() - started, 2), "s; exit codes", [p.exitcode for p in procs])
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    for h in queue:  # the rest, and what the stopped DataLoader gave back
        seen.append(int(h.load()["obs"][0]))
    assert sorted(seen) == list(range(800)), (len(seen), len(set(seen)))
    print("ok", len(seen))
"""
    )
    result = run_script(script, tmp_path, timeout=150)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "ok 800" in result.stdout, result.stdout


def test_fit_stops_early_and_collectors_exit(tmp_path):
    """Issue 28, row 1 as filed: ``Trainer.fit(max_steps=10)`` over ``StorageDataModule(queue)`` fed
    by 2 collectors of 400 handles each, then ``queue.close(); p.join()``. On c0a849d ``join()`` never
    returned."""
    script = (
        COLLECTORS
        + """
import lightning.pytorch as pl
import torch
from torch_storage_loader.lightning import StorageDataModule


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, i):
        return self.layer(batch["obs"]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


if __name__ == "__main__":
    queue = StorageQueue()
    procs = [mp.Process(target=collect, args=(queue, "replay", k * 400, 400)) for k in range(2)]
    for p in procs:
        p.start()
    trainer = pl.Trainer(max_steps=10, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu")
    trainer.fit(Model(), StorageDataModule(queue, batch_size=8, num_workers=2))
    queue.close()
    started = time.monotonic()
    for p in procs:
        p.join(20)
    print("joined in", round(time.monotonic() - started, 2), "s; exit codes", [p.exitcode for p in procs])
    assert [p.exitcode for p in procs] == [0, 0]
    left = sum(1 for _ in queue)
    print("ok", left)
"""
    )
    result = run_script(script, tmp_path, timeout=200)
    assert result.returncode == 0, result.stderr[-4000:]
    left = int(result.stdout.split("ok ")[-1])
    # 80 trained on (Lightning fetches one batch ahead); what the workers had prefetched came back
    assert 800 - 11 * 8 <= left <= 800 - 80, result.stdout
