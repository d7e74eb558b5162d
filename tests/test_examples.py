"""The scripts a user copies, run as the user runs them (``python example.py``, its own session, a hard
time limit): the streaming roads of ``examples/``, and what a script without its main guard is told."""

from __future__ import annotations

import pytest
from _helpers import run_script

MAIN_GUARD = 'if __name__ == "__main__":'

UNGUARDED = """
import torch
from torch_storage_loader import FileStorageLoader

with FileStorageLoader("samples", ttl=None, worker_num=2, mp_context="{method}") as loader:  # no main guard
    handle = loader.save({"obs": torch.zeros(4)})
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
