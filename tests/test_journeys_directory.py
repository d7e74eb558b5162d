"""The directory road as a user walks it: collector processes save into a directory and end the
stream; a DataLoader over ``StorageDataset(directory)`` reads it. Each test runs the user's script as
``python example.py`` (``_helpers.run_script``), twice where the user would run it twice (issue 28)."""

from __future__ import annotations

import os

import _helpers

# A collector process saves N samples into a directory and ends the stream while a DataLoader over
# the directory reads it (the trainer starts first, as in a run that trains while collectors collect).
ROAD = """
import multiprocessing as mp
import sys

import torch
from torch.utils.data import DataLoader

from torch_storage_loader import FileStorageLoader, StorageDataset, end_directory_stream{extra_import}


def collect(directory, start, count):
    with FileStorageLoader(directory, ttl=None) as loader:  # ttl=None: files stay until delivered
        for i in range(start, start + count):
            loader.save({{"x": torch.full((4,), float(i))}})
    end_directory_stream(directory)  # no more files: the consumers stop once they delivered them


if __name__ == "__main__":
    directory, start = "incoming", int(sys.argv[1]){start_stream}
    collector = mp.Process(target=collect, args=(directory, start, 200)){dataset_first}
    collector.start(){collector_first}
    seen = []
    for batch in DataLoader(dataset, batch_size=None, num_workers=2):
        seen += [int(v) for v in batch["x"][:, 0]]
    collector.join()
    print("samples", len(seen), "distinct", len(set(seen)), "range", min(seen, default=-1), max(seen, default=-1))
"""

DATASET = """
    dataset = StorageDataset(directory, batch_size=10)"""
START_STREAM = """
    start_directory_stream(directory)  # this run is a new stream: clear the previous run's end marker"""


def test_directory_stream_run_twice_refuses_at_once_naming_the_marker(tmp_path):
    """Run twice on one directory: the first run's end marker is still there. The second run must not
    end at 0 samples in silence: it refuses at once (before its collector starts), naming the marker
    and how to start a new stream."""
    script = ROAD.format(extra_import="", start_stream="", dataset_first=DATASET, collector_first="")
    first = _helpers.run_script(script, tmp_path, timeout=120, args=("0",))
    assert first.returncode == 0, first.stderr[-3000:]
    assert "samples 200 distinct 200 range 0 199" in first.stdout, first.stdout
    second = _helpers.run_script(script, tmp_path, timeout=120, args=("1000",))
    assert second.returncode != 0, f"the second run ended without an error: {second.stdout}"
    assert "StreamEndedError" in second.stderr, second.stderr[-3000:]
    marker = os.path.join("incoming", "_END_OF_STREAM")
    assert marker in second.stderr and "start_directory_stream" in second.stderr, second.stderr[-3000:]


def test_directory_stream_run_twice_collector_first_never_ends_short_in_silence(tmp_path):
    """The same, with the collector started before the dataset is made: by then it may have saved none,
    some or all of its files. The second run either gets all 200 new files (the collector had ended
    its stream again) or refuses at once; never 0, never a part, without an error."""
    script = ROAD.format(extra_import="", start_stream="", dataset_first="", collector_first=DATASET)
    first = _helpers.run_script(script, tmp_path, timeout=120, args=("0",))
    assert first.returncode == 0 and "samples 200 distinct 200 range 0 199" in first.stdout, first.stderr[-3000:]
    second = _helpers.run_script(script, tmp_path, timeout=120, args=("1000",))
    if second.returncode == 0:
        assert "samples 200 distinct 200 range 1000 1199" in second.stdout, second.stdout
    else:
        assert "StreamEndedError" in second.stderr and "start_directory_stream" in second.stderr, second.stderr[-3000:]
        saved = [n for n in os.listdir(tmp_path / "incoming") if n.endswith(".tsl")]
        assert len(saved) == 200, "refused: the collector's files all stay for a consumer of the new stream"


def test_directory_stream_started_anew_each_run_delivers_each_run(tmp_path):
    """The documented fix: a run that calls ``start_directory_stream(directory)`` before its collectors
    and consumers start gets its own files, every time."""
    script = ROAD.format(
        extra_import=", start_directory_stream", start_stream=START_STREAM, dataset_first=DATASET, collector_first=""
    )
    for start in (0, 1000):
        run = _helpers.run_script(script, tmp_path, timeout=120, args=(str(start),))
        assert run.returncode == 0, run.stderr[-3000:]
        assert f"samples 200 distinct 200 range {start} {start + 199}" in run.stdout, run.stdout
    assert os.listdir(tmp_path / "incoming") == ["_END_OF_STREAM"]


# A trainer gets a handle from a collector on another machine, whose file is on that machine's disk.
REMOTE = """
import pickle
import sys

from torch.utils.data import DataLoader

from torch_storage_loader import StorageDataset

if __name__ == "__main__":
    with open(sys.argv[1], "rb") as f:
        handle = pickle.load(f)  # as it came over the network from the collector
    for batch in DataLoader(StorageDataset([handle]), batch_size=None, num_workers=2):
        print("loaded", batch)
"""


def test_a_handle_whose_path_is_on_another_machine_says_so(tmp_path):
    """The error names the missing directory and points at a shared filesystem or Redis + object
    storage; it does not blame an expired ttl."""
    import pickle

    from torch_storage_loader import FileStorage

    elsewhere = FileStorage(str(tmp_path / "collector-7" / "replay" / "0001.tsl"))
    (tmp_path / "handle.pkl").write_bytes(pickle.dumps(elsewhere))
    run = _helpers.run_script(REMOTE, tmp_path, timeout=120, args=("handle.pkl",))
    assert run.returncode != 0 and "StorageNotFoundError" in run.stderr, run.stdout + run.stderr[-3000:]
    tail = run.stderr[run.stderr.rindex("StorageNotFoundError") :]
    assert str(tmp_path / "collector-7" / "replay") + " does not exist on this machine" in tail, tail
    assert "shared filesystem" in tail and "s3://" in tail and "Redis" in tail and "raise ttl" not in tail, tail
