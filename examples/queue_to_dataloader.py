"""Collector processes -> StorageQueue -> DataLoader, on one machine.

How the stream starts: the trainer makes the queue and starts the collectors; each saves samples with
a FileStorageLoader and puts their handles. How it ends: the trainer, which started the collectors,
closes the queue once they have all exited (one closer, after every producer); the DataLoader ends
when the queue is closed and drained. How everything shuts down: the DataLoader's workers with the
loop (a `break` or its end), the collectors on their own (joined with a timeout, exit code 0).

    python examples/queue_to_dataloader.py             # read to the end: every sample trained on
    python examples/queue_to_dataloader.py --steps 5   # stop after 5 batches; the rest stay queued
"""

import argparse
import multiprocessing as mp
import tempfile
import threading

import torch
from torch.utils.data import DataLoader

from torch_storage_loader import FileStorageLoader, StorageDataset, StorageQueue

COLLECTORS, SAMPLES_PER_COLLECTOR, BATCH_SIZE = 2, 400, 8


def collect(queue: StorageQueue, directory: str, collector: int) -> None:
    """A collector process: save each sample, put its handle, leave."""
    with FileStorageLoader(directory, ttl=None) as loader, queue.producer():  # producer(): a crash is an error
        for step in range(SAMPLES_PER_COLLECTOR):
            sample_id = collector * SAMPLES_PER_COLLECTOR + step
            queue.put(loader.save({"obs": torch.randn(4), "id": torch.tensor(sample_id)}))


def close_when_done(queue: StorageQueue, collectors: list) -> None:
    for p in collectors:
        p.join()
    queue.close()  # after the last collector: consumers end once every handle was taken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=0, help="stop after this many batches (0: read to the end)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tsl-queue-") as workdir:  # the collectors' files
        queue = StorageQueue()
        ctx = mp.get_context("spawn")
        collectors = [
            ctx.Process(target=collect, args=(queue, f"{workdir}/collector-{c}", c), daemon=True)
            for c in range(COLLECTORS)
        ]
        for p in collectors:
            p.start()
        closer = threading.Thread(target=close_when_done, args=(queue, collectors), daemon=True)
        closer.start()

        seen: set[int] = set()
        dataset = StorageDataset(queue, batch_size=BATCH_SIZE)  # the dataset batches: DataLoader batch_size=None
        for step, batch in enumerate(DataLoader(dataset, batch_size=None, num_workers=2), start=1):
            seen.update(batch["id"].tolist())  # train on batch["obs"] here
            if step == args.steps:
                break  # the DataLoader's workers stop; the handles they held go back to the queue

        closer.join(timeout=60)  # it joins every collector, then ends the stream
        codes = None if closer.is_alive() else [p.exitcode for p in collectors]
        if codes != [0] * COLLECTORS:
            raise SystemExit(f"the collectors did not all exit cleanly within a minute (exit codes: {codes})")
        left = sum(1 for _ in queue)  # what the trainer did not read is still there, up to the end
        produced = COLLECTORS * SAMPLES_PER_COLLECTOR
        print(f"produced {produced}, trained on {len(seen)}, left in the queue {left}")


if __name__ == "__main__":  # the collectors and loader workers import this file again
    main()
