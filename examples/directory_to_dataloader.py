"""Collector processes -> a watched directory -> DataLoader, on one machine or a shared filesystem.

How the stream starts: collectors save samples into one directory with FileStorageLoader(dir,
ttl=None); the DataLoader's workers claim each new file as it lands (exactly one consumer loads it)
and delete it once the trainer has its sample. How it ends: the trainer, which started the
collectors, calls end_directory_stream(dir) once they have all exited; the DataLoader ends when the
directory is drained. How everything shuts down: the DataLoader's workers with the loop (a `break` or
its end; files they claimed and did not deliver are put back), the collectors on their own (joined
with a timeout, exit code 0). Each run streams through a fresh directory.

    python examples/directory_to_dataloader.py             # read to the end: every sample trained on
    python examples/directory_to_dataloader.py --steps 5   # stop after 5 batches; the rest stay as files
"""

import argparse
import glob
import multiprocessing as mp
import tempfile
import threading

import torch
from torch.utils.data import DataLoader

from torch_storage_loader import FileStorageLoader, StorageDataset, end_directory_stream

COLLECTORS, SAMPLES_PER_COLLECTOR, BATCH_SIZE = 2, 200, 8


def collect(directory: str, collector: int) -> None:
    """A collector process: save each sample into the stream's directory, leave."""
    with FileStorageLoader(directory, ttl=None) as loader:  # ttl=None: files stay until delivered
        for step in range(SAMPLES_PER_COLLECTOR):
            loader.save({"obs": torch.randn(4), "id": torch.tensor(collector * SAMPLES_PER_COLLECTOR + step)})


def end_when_done(directory: str, collectors: list) -> None:
    for p in collectors:
        p.join()
    end_directory_stream(directory)  # after the last collector: consumers end once every file is delivered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=0, help="stop after this many batches (0: read to the end)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tsl-stream-") as stream:  # a fresh directory per run
        ctx = mp.get_context("spawn")
        collectors = [ctx.Process(target=collect, args=(stream, c), daemon=True) for c in range(COLLECTORS)]
        for p in collectors:
            p.start()
        ender = threading.Thread(target=end_when_done, args=(stream, collectors), daemon=True)
        ender.start()

        seen: set[int] = set()
        dataset = StorageDataset(stream, batch_size=BATCH_SIZE)  # the dataset batches: DataLoader batch_size=None
        for step, batch in enumerate(DataLoader(dataset, batch_size=None, num_workers=2), start=1):
            seen.update(batch["id"].tolist())  # train on batch["obs"] here
            if step == args.steps:
                break  # the DataLoader's workers stop; files they claimed go back to the directory

        ender.join(timeout=60)  # it joins every collector, then ends the stream
        codes = None if ender.is_alive() else [p.exitcode for p in collectors]
        if codes != [0] * COLLECTORS:
            raise SystemExit(f"the collectors did not all exit cleanly within a minute (exit codes: {codes})")
        left = len(glob.glob(f"{stream}/*.tsl"))  # what the trainer did not read is still there
        produced = COLLECTORS * SAMPLES_PER_COLLECTOR
        print(f"produced {produced}, trained on {len(seen)}, left in the directory {left}")


if __name__ == "__main__":  # the collectors and loader workers import this file again
    main()
