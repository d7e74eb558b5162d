"""The DataLoader hooks check the private torch they wrap, and refuse a torch that differs, loudly."""

import os
import subprocess
import sys
import textwrap

import pytest
from torch.utils.data import dataloader

from torch_storage_loader import UnsupportedTorchError
from torch_storage_loader._dataloader import hooks
from torch_storage_loader._dataloader.items import WorkerItem, collate_items


def test_the_installed_torch_has_what_the_hooks_wrap(handles):
    from torch.utils.data import DataLoader

    from torch_storage_loader import StorageDataset

    ds = StorageDataset(handles[:2])  # installs the hooks
    hooks.install(WorkerItem, collate_items)  # idempotent
    torch_class = dataloader._MultiProcessingDataLoaderIter
    it = iter(DataLoader(ds, batch_size=None, num_workers=1))
    # A StorageDataset's iterator is a subclass of torch's with the hooks; torch's class keeps its methods.
    assert type(it).__bases__ == (torch_class,) and type(it)._process_data is not torch_class._process_data
    assert sorted(int(s["info"]["id"]) for s in it) == [0, 1]


def test_a_profiler_sees_each_next_and_none_runs_without_one(handles):
    """torch annotates each ``__next__`` for profilers (``enumerate(DataLoader)#...``); the hooks skip
    that annotation, which costs the trainer 60-100 us a batch after a GPU step, only while nothing records."""
    import torch
    from torch.utils.data import DataLoader

    from torch_storage_loader import StorageDataset

    assert hooks._unrecorded_next(dataloader._MultiProcessingDataLoaderIter) is not None, (
        f"torch {torch.__version__}'s DataLoader __next__ reads other names: update hooks._NEXT_NAMES"
    )
    loader = DataLoader(StorageDataset(handles[:4]), batch_size=None, num_workers=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = [int(s["info"]["id"]) for s in loader]
    calls = sum(e.count for e in prof.key_averages() if e.key.startswith("enumerate(DataLoader)#"))
    assert (sorted(got), calls) == ([0, 1, 2, 3], 5)  # four items and the call that ends the data
    it = iter(loader)
    assert sorted(int(s["info"]["id"]) for s in it) == [0, 1, 2, 3] and it._num_yielded == 4


class _OldIterator(dataloader._MultiProcessingDataLoaderIter):
    """torch's iterator as releases before out-of-order loading had it: no worker index."""

    def _process_data(self, data):
        return data


def test_an_iterator_without_the_worker_index_is_refused_naming_the_torch_needed():
    with pytest.raises(UnsupportedTorchError, match=r"_process_data\(self, data\).*torch >= 2\.7"):
        hooks.check_iterator(_OldIterator)


class _NoEndCall(dataloader._MultiProcessingDataLoaderIter):
    def _next_data(self):
        raise StopIteration


def test_an_iterator_whose_end_is_not_seen_is_refused():
    with pytest.raises(UnsupportedTorchError, match="no longer calls _shutdown_workers"):
        hooks.check_iterator(_NoEndCall)


def test_a_dataset_made_under_a_changed_torch_raises_unsupported_torch_error():
    # A fresh interpreter whose torch iterator class has the old signature: the library imports (the
    # hooks are not installed at import), and the first StorageDataset, which installs them, is refused.
    code = textwrap.dedent("""
        from torch.utils.data import dataloader

        class _MultiProcessingDataLoaderIter(dataloader._MultiProcessingDataLoaderIter):
            def _process_data(self, data):
                return data

        dataloader._MultiProcessingDataLoaderIter = _MultiProcessingDataLoaderIter
        from torch_storage_loader import StorageDataset, UnsupportedTorchError
        try:
            StorageDataset([])
        except UnsupportedTorchError as exc:
            print("REFUSED", exc)
        else:
            print("INSTALLED")
    """)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("REFUSED"), out.stdout + out.stderr
    assert "_process_data(self, data)" in out.stdout and "torch >= 2.7" in out.stdout


# What a user's script does with a plain IterableDataset, with or without the library's hooks installed
# (a StorageDataset made first): torch's own failure modes must look the same either way (issue 28).
_PLAIN_LOADER = """
import multiprocessing as mp
import os
import signal
import sys

if sys.argv[2] == "hooked":
    from torch_storage_loader import StorageDataset

    StorageDataset([])  # installs the hooks: importing the library alone changes nothing in torch

from torch.utils.data import DataLoader, IterableDataset, get_worker_info


class Numbers(IterableDataset):
    def __init__(self, mode):
        self.mode = mode

    def __iter__(self):
        worker = get_worker_info()
        for i in range(1000):
            if worker.id == 1 and i == 3:
                if self.mode == "raise":
                    raise ValueError("a worker's own error")
                if self.mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
            yield i  # plain ints: no tensor crosses through a file descriptor a killed worker held


if __name__ == "__main__":
    mode = sys.argv[1]
    it = iter(DataLoader(Numbers(mode), batch_size=None, num_workers=2, timeout=60))
    print(type(it).__module__, type(it).__qualname__, flush=True)
    if mode == "drop":
        for _ in range(5):
            next(it)
        del it  # mid-epoch: collected at once, its workers stopped
        print("children after del", len(mp.active_children()), flush=True)
    else:
        for _ in it:
            pass
"""


def _frames(stderr: str) -> list[str]:
    """The traceback's frames (file and function), without line numbers, addresses or pids."""
    return [
        line.split(", line ")[0] + line.rsplit(",", 1)[1] for line in stderr.splitlines() if line.startswith('  File "')
    ]


@pytest.mark.parametrize("mode", ["raise", "kill", "drop"])
def test_the_librarys_hooks_leave_plain_dataloaders_as_torch_has_them(tmp_path, mode):
    from _helpers import run_script

    plain = run_script(_PLAIN_LOADER, tmp_path, timeout=120, args=(mode, "plain"))
    imported = run_script(_PLAIN_LOADER, tmp_path, timeout=120, args=(mode, "hooked"))
    assert imported.stdout == plain.stdout, (plain.stdout, imported.stdout)
    assert imported.stdout.startswith("torch.utils.data.dataloader _MultiProcessingDataLoaderIter\n")
    assert imported.returncode == plain.returncode, imported.stderr[-3000:]
    for run in (plain, imported):
        assert "Exception ignored" not in run.stderr, run.stderr[-3000:]
        assert "torch_storage_loader" not in run.stderr, run.stderr[-3000:]
    last = imported.stderr.strip().splitlines()[-1] if imported.stderr.strip() else ""
    if mode == "raise":  # the worker's error reaches the trainer, through torch's frames only
        assert plain.returncode == 1 and "ValueError: a worker's own error" in imported.stderr
        assert _frames(imported.stderr) == _frames(plain.stderr), imported.stderr[-3000:]
    elif mode == "kill":  # torch's own error for a dead worker
        assert plain.returncode == 1 and last.startswith("RuntimeError: DataLoader worker"), imported.stderr[-3000:]
    else:
        assert plain.returncode == 0 and imported.stderr == plain.stderr == ""
        assert imported.stdout.endswith("children after del 0\n")


_TORCH_CLASSES = """
import inspect

from torch.utils.data import dataloader
from torchdata.stateful_dataloader import stateful_dataloader

classes = [c for m in (dataloader, stateful_dataloader) for c in vars(m).values()
           if inspect.isclass(c) and c.__module__ == m.__name__]
before = {c: dict(vars(c)) for c in classes}


def changed():
    return sorted(f"{c.__qualname__}.{k}" for c in classes for k in set(before[c]) | set(vars(c))
                  if before[c].get(k, None) is not vars(c).get(k, None))


from torch_storage_loader import StorageDataset  # noqa: E402

print(changed())
StorageDataset([])  # installs the hooks
print(changed())
"""


def test_the_hooks_change_no_method_of_torchs_dataloader_classes(tmp_path):
    from _helpers import run_script

    out = run_script(_TORCH_CLASSES, tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    # Importing changes nothing. Once a StorageDataset is made, only the class every DataLoader iterator
    # is made through learns to pick ours for it; for any other dataset it makes torch's own class, as
    # object.__new__ does.
    assert out.stdout.splitlines() == ["[]", "['_BaseDataLoaderIter.__new__']"], out.stdout


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("stateful", [False, True])
def test_a_batching_dataset_under_a_batching_dataloader_is_refused_and_loses_nothing(handles, num_workers, stateful):
    # DataLoader(StorageDataset(h, batch_size=8)) without batch_size=None: torch batches the
    # dataset's batches again, into [1, 8, ...], in silence. Refused where the iterator is made,
    # before any worker starts or any handle is taken from the stream.
    import torch
    from torch.utils.data import DataLoader
    from torchdata.stateful_dataloader import StatefulDataLoader

    from torch_storage_loader import StorageDataset, StorageQueue

    loader_type = StatefulDataLoader if stateful else DataLoader
    q = StorageQueue()
    for h in handles[:8]:
        q.put(h)
    q.close()
    ds = StorageDataset(q, batch_size=4)
    with pytest.raises(ValueError, match=r"batch_size=4.*DataLoader\(\.\.\., batch_size=None\)"):
        iter(loader_type(ds, num_workers=num_workers))
    with pytest.raises(ValueError, match=r"DataLoader\(batch_size=3\)"):
        iter(loader_type(ds, batch_size=3, num_workers=num_workers))
    got = [b["info"]["id"] for b in loader_type(ds, batch_size=None, num_workers=num_workers)]
    assert [tuple(b.shape) for b in got] == [(4,), (4,)] and sorted(torch.cat(got).tolist()) == list(range(8))


def test_dataloader_side_batching_stays_open_to_single_samples_and_collate_fns(handles):
    import torch
    from torch.utils.data import DataLoader

    from torch_storage_loader import StorageDataset

    singles = [b["info"]["id"].tolist() for b in DataLoader(StorageDataset(handles[:4]), batch_size=2)]
    assert singles == [[0, 1], [2, 3]]
    # A collate_fn of one's own receives the dataset's batches as a list, and does what it means to.
    joined = DataLoader(
        StorageDataset(handles[:8], batch_size=2),
        batch_size=2,
        collate_fn=lambda bs: torch.cat([b["action"] for b in bs]),
    )
    assert [tuple(b.shape) for b in joined] == [(4, 8), (4, 8)]  # two dataset batches of 2 trajectories


# A StorageDataset iterator whose worker raised is garbage in a reference cycle (torch's re-raise);
# a DataLoader started before the collector ran forks it into its workers, whose collector then
# ran its shutdown there: torch's "can only test a child process", and the handles the trainer's
# ledger held were given back to the queue once per worker (delivered twice).
_COLLECTED_IN_A_FORK = """import gc

import numpy as np
from torch.utils.data import DataLoader, IterableDataset

from torch_storage_loader import Storage, StorageDataset, StorageQueue


class Flaky(Storage):
    def __init__(self, i):
        super().__init__(str(i))
        self.i = i

    def save(self, data):
        pass

    def load(self):
        if self.i == 5:
            raise ValueError("sample 5 is bad")
        return {"i": np.array([self.i])}


class Collects(IterableDataset):  # a later DataLoader: its forked workers run the garbage collector

    def __iter__(self):
        gc.collect()
        yield 0


if __name__ == "__main__":
    gc.disable()  # the trainer's collector has not run yet when the next DataLoader forks its workers
    q = StorageQueue()
    for i in range(40):
        q.put(Flaky(i))
    q.close()
    seen = []
    try:
        for s in DataLoader(StorageDataset(q), batch_size=None, num_workers=2):
            seen.append(int(s["i"][0]))
    except ValueError:
        print("worker error reached the trainer", flush=True)
    list(DataLoader(Collects(), batch_size=None, num_workers=2))
    gc.collect()
    rest = [int(s["i"][0]) for s in DataLoader(StorageDataset(q), batch_size=None, num_workers=0)]
    print(sorted(seen + rest))
"""


def test_an_iterator_collected_in_a_forked_worker_leaves_the_trainers_workers_and_handles(tmp_path):
    from _helpers import run_script

    out = run_script(_COLLECTED_IN_A_FORK, tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Exception ignored" not in out.stderr, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "worker error reached the trainer"
    assert eval(lines[1]) == [i for i in range(40) if i != 5]  # each once; the bad one raised


# A trainer that stops early and leaves its iterator to the interpreter's exit (a module global).
_LEFT_AT_EXIT = """import sys
import time

import torch
from torch.utils.data import DataLoader

from torch_storage_loader import FileStorageLoader, StorageDataset, end_directory_stream

if __name__ == "__main__":
    directory = "incoming"
    if sys.argv[1] == "save":
        with FileStorageLoader(directory, ttl=None) as loader:
            for i in range(40):
                loader.save({"x": torch.full((4,), float(i))})
    elif sys.argv[1] == "leave":
        it = iter(DataLoader(StorageDataset(directory), batch_size=None, num_workers=2))
        print(int(next(it)["x"][0]), flush=True)
        time.sleep(1)  # the workers have told the trainer what they took (killed mid-claim, one would not)
    else:
        end_directory_stream(directory)
        print(sorted(int(s["x"][0]) for s in DataLoader(StorageDataset(directory), batch_size=None, num_workers=2)))
"""


def test_an_iterator_left_alive_at_exit_gives_back_what_its_workers_took(tmp_path):
    """Regression: an iterator still alive at exit was settled only when the interpreter collected it,
    with modules half gone (its give-back failed, leaving claims for the stale-claim sweep) and the
    ledger's daemon thread frozen, perhaps holding its lock (a trainer hung at exit in ``Ledger.close``)."""
    from _helpers import run_script

    assert run_script(_LEFT_AT_EXIT, tmp_path, args=("save",)).returncode == 0
    left = run_script(_LEFT_AT_EXIT, tmp_path, args=("leave",), timeout=60)
    assert left.returncode == 0, left.stderr[-3000:]
    assert "could not" not in left.stderr and "Exception ignored" not in left.stderr, left.stderr[-3000:]
    first = int(left.stdout.split()[0])
    assert not [n for n in os.listdir(tmp_path / "incoming") if ".claimed" in n], "claims were left behind"
    rest = run_script(_LEFT_AT_EXIT, tmp_path, args=("rest",))
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert eval(rest.stdout) == [i for i in range(40) if i != first]  # each once, the delivered one not again


def test_a_workers_death_is_raised_at_the_trainers_next_not_inside_what_it_was_doing(handles):
    """torch raises a dead worker's error from its SIGCHLD handler wherever the trainer's thread is:
    inside a queue's ``put``, a finalizer or the ledger's bookkeeping, which CI runs saw hang or
    lose a sample. A worker killed while the trainer runs code of its own raises nothing there; the
    next ``next()`` raises torch's error, even once the dead worker was reaped."""
    import signal
    import time

    from torch.utils.data import DataLoader

    from torch_storage_loader import StorageDataset

    it = iter(DataLoader(StorageDataset(handles), batch_size=None, num_workers=2))
    next(it)
    pid = it._workers[0].pid
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the trainer's own code runs as the signal arrives
        sum(range(1000))
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z" and deadline - time.monotonic() > 0.5:
                deadline = time.monotonic() + 0.5  # dead: a while longer, for the handler to run here
    it._workers[0].join(timeout=10)  # reaped meanwhile (multiprocessing does so as any Process starts)
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid \d+\) is killed by signal"):
        next(it)  # (torch's own check, 5 s on, would say "exited unexpectedly")
    del it


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raising KeyboardInterrupt, as in a terminal (a suite run as a background job starts with it ignored)."""
    import signal

    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_ctrl_c_inside_the_ledgers_bookkeeping_loses_nothing(handles, monkeypatch, ctrl_c_raises):
    """Ctrl-C lands wherever the trainer's thread is. Landing in the ledger between taking a
    delivered item off what is owed and settling it, it once lost that item: raised out of
    ``__next__``, the item never reached the trainer, and it was no longer owed, so nothing gave it
    back. It is now held back, and raised after the step (or at the next one's start)."""
    import gc
    import signal

    from torch.utils.data import DataLoader

    from torch_storage_loader import StorageDataset, StorageQueue
    from torch_storage_loader._dataloader.ledger import Ledger

    q = StorageQueue()  # left open until the Ctrl-C: the trainer then waits where it is raised at once
    for h in handles:
        q.put(h)
    settle, fired = Ledger._settle, []

    def settle_after_ctrl_c(self, ack, back, now=False):  # Ctrl-C comes as the first delivered item is settled
        if ack and not fired:
            fired.append(True)
            signal.raise_signal(signal.SIGINT)
        return settle(self, ack, back, now)

    monkeypatch.setattr(Ledger, "_settle", settle_after_ctrl_c)
    batches: list = []
    it = iter(DataLoader(StorageDataset(q, batch_size=4), batch_size=None, num_workers=2))
    try:
        with pytest.raises(KeyboardInterrupt):
            for batch in it:
                batches.append(batch)  # (C: a Ctrl-C sent again lands after it)
    finally:
        q.close()
    assert fired
    got_first = len(batches)  # (not raised inside the step that settled the first item: the trainer got it)
    del it  # what was not delivered goes back to the queue
    gc.collect()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back once no iterator lives
    monkeypatch.undo()
    batches += list(DataLoader(StorageDataset(q, batch_size=4), batch_size=None, num_workers=2))
    assert sorted({int(i) for b in batches for i in b["info"]["id"]}) == list(range(24))  # none lost
    assert got_first
    del batches


def test_ctrl_c_while_the_trainer_waits_for_an_item_is_raised_at_once(ctrl_c_raises):
    """Held back inside a step, Ctrl-C is still raised at once where the trainer waits for the next item."""
    import gc
    import signal
    import threading
    import time

    from torch.utils.data import DataLoader

    from torch_storage_loader import StorageDataset, StorageQueue

    q = StorageQueue()  # open and empty: the trainer waits
    it = iter(DataLoader(StorageDataset(q), batch_size=None, num_workers=2))
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            next(it)
        assert time.monotonic() - t0 < 10
    finally:
        q.close()
        timer.join()
    del it
    gc.collect()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_sigint_handler_that_chains_to_the_one_it_replaced_does_not_loop(handles, ctrl_c_raises):
    """A handler set while an iterator lives that calls the one it replaced (ours), wrapped in turn
    by the next iterator, would call itself through ours for ever: the chain ends at Python's."""
    import gc
    import signal

    from torch.utils.data import DataLoader

    from torch_storage_loader import StorageDataset

    calls = []
    first = iter(DataLoader(StorageDataset(handles), batch_size=None, num_workers=1))
    previous = signal.getsignal(signal.SIGINT)

    def mine(signum, frame):
        calls.append(signum)
        previous(signum, frame)

    signal.signal(signal.SIGINT, mine)
    second = iter(DataLoader(StorageDataset(handles), batch_size=None, num_workers=1))
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
        sum(range(10))  # (the handler runs here, outside any step)
    assert calls == [signal.SIGINT]
    del first, second
    gc.collect()
    with pytest.raises(KeyboardInterrupt):  # theirs is kept, and still ends where it did: once each
        signal.raise_signal(signal.SIGINT)
        sum(range(10))
    assert calls == [signal.SIGINT, signal.SIGINT]
