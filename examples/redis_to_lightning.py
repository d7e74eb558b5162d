"""Collectors on other machines -> Redis Streams + shared payloads -> Lightning Trainer.fit.

Collector processes stand in for other machines: each saves samples where every machine can read
them (a shared filesystem, or an s3:// prefix) and puts the handles into a RedisStorageQueue. The
trainer reads them through StorageDataModule; its queue trusts handles only under the payload root
(trusted_roots=). How the stream starts: the first put makes it (one stream name per run). How it
ends: the trainer, which started the collectors, closes the stream once they have all exited; fit
ends when the stream is closed and drained (or at --steps). How everything shuts down: fit stops the
DataLoader's workers (entries they took and did not deliver go back to the stream), the collectors
exit on their own (joined with a timeout, exit code 0), and the run's stream is deleted.

    python examples/redis_to_lightning.py [--url redis://127.0.0.1:6379] [--payloads DIR_OR_S3_URL] [--steps N]

The URL defaults to $TSL_REDIS_URL, else redis://127.0.0.1:6379. An s3:// payload prefix takes its
storage options (key, secret, endpoint_url) as JSON from $TSL_S3_OPTIONS.
"""

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import threading
import uuid

import lightning.pytorch as pl
import torch

from torch_storage_loader import FileStorageLoader, RedisStorageQueue, configure_object_store
from torch_storage_loader.lightning import StorageDataModule

COLLECTORS, SAMPLES_PER_COLLECTOR, BATCH_SIZE = 2, 200, 8


def collect(queue: RedisStorageQueue, payloads: str, collector: int, options: dict | None) -> None:
    """A collector (another machine): save each sample where the trainer can read it, put its handle."""
    with (
        FileStorageLoader(f"{payloads}/collector-{collector}", ttl=None, storage_options=options) as loader,
        queue.producer(f"collector-{collector}"),  # a collector that dies is an error, not a hang
    ):
        for step in range(SAMPLES_PER_COLLECTOR):
            sample_id = collector * SAMPLES_PER_COLLECTOR + step
            queue.put(loader.save({"obs": torch.randn(4), "id": torch.tensor(sample_id)}))


def close_when_done(queue: RedisStorageQueue, collectors: list) -> None:
    for p in collectors:
        p.join()
    queue.close()  # after the last collector: consumers end once every entry was delivered


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.seen: set[int] = set()

    def training_step(self, batch, batch_idx):
        self.seen.update(batch["id"].tolist())
        return self.net(batch["obs"]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("TSL_REDIS_URL", "redis://127.0.0.1:6379"))
    parser.add_argument("--payloads", default=None, help="a shared directory or s3:// prefix (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=-1, help="stop after this many batches (-1: read to the end)")
    args = parser.parse_args()
    s3 = str(args.payloads).startswith("s3://")
    options = json.loads(os.environ.get("TSL_S3_OPTIONS", "{}")) if s3 else None
    with tempfile.TemporaryDirectory(prefix="tsl-shared-") as tmp:
        payloads = args.payloads or tmp  # stands in for a filesystem every machine mounts
        run = f"{payloads.rstrip('/')}/run-{uuid.uuid4().hex[:8]}"
        queue = RedisStorageQueue(args.url, f"tsl-example-{uuid.uuid4().hex[:8]}", trusted_roots=[run])
        if s3:
            configure_object_store(run, options)  # the trainer's loader workers reach the bucket with these
        try:
            ctx = mp.get_context("spawn")
            collectors = [
                ctx.Process(target=collect, args=(queue, run, c, options), daemon=True) for c in range(COLLECTORS)
            ]
            for p in collectors:
                p.start()
            closer = threading.Thread(target=close_when_done, args=(queue, collectors), daemon=True)
            closer.start()

            model = Model()
            datamodule = StorageDataModule(queue, batch_size=BATCH_SIZE, num_workers=2)
            trainer = pl.Trainer(
                max_epochs=1,  # a stream is one epoch, ended by close()
                max_steps=args.steps,
                accelerator="cpu",
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
            )
            trainer.fit(model, datamodule=datamodule)

            closer.join(timeout=60)  # it joins every collector, then ends the stream
            codes = None if closer.is_alive() else [p.exitcode for p in collectors]
            if codes != [0] * COLLECTORS:
                raise SystemExit(f"the collectors did not all exit cleanly within a minute (exit codes: {codes})")
            stats = queue.stats()
            produced = COLLECTORS * SAMPLES_PER_COLLECTOR
            print(f"produced {produced}, trained on {len(model.seen)}, left in the stream {stats['undelivered']}")
        finally:
            queue.delete()  # this run's stream and its keys


if __name__ == "__main__":  # the collectors and loader workers import this file again
    main()
