"""The notebooks run headless on a real Jupyter kernel, and README's demo command runs end to end."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile

import nbformat
import pytest
from _redis_server import fresh_redis_server  # noqa: F401  (fixture)
from nbclient import NotebookClient

NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # jupyter_client's own


@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.parametrize("name", ["quickstart", "benchmark"])
def test_notebook_runs_on_a_real_kernel(name, method, monkeypatch, tmp_path):
    monkeypatch.setenv("TSL_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("TSL_START_METHOD", method)
    nb = nbformat.read(os.path.join(NOTEBOOKS, f"{name}.ipynb"), as_version=4)
    for cell in nb.cells:
        cell.outputs = [] if cell.cell_type == "code" else cell.get("outputs")
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs)
    assert f"start method: {method}" in text
    if name == "benchmark":
        assert "speedup" in text and any(o.output_type == "display_data" for o in outputs)  # table and plot
    else:
        assert "[0, 1, 2, 3, 4, 5, 6, 7]" in text and "loss" in text


def test_committed_notebooks_carry_outputs_of_a_run():
    for name in ("quickstart", "benchmark"):
        nb = nbformat.read(os.path.join(NOTEBOOKS, f"{name}.ipynb"), as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(c.execution_count for c in code), name
        assert not [o for c in code for o in c.outputs if o.output_type == "error"], name


def test_demo_command_runs_and_cleans_up():
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "tsl-demo-*")))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch_storage_loader",
            "demo",
            "--collectors",
            "2",
            "--trajectories",
            "6",
            "--steps",
            "8",
            "--size",
            "32",
            "--train-steps",
            "4",
            "--no-progress-bar",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "streaming from collectors, StorageDataModule" in proc.stdout
    assert "same files, plain DataLoader" in proc.stdout
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "tsl-demo-*"))) == before


def test_demo_hands_over_through_redis(fresh_redis_server):
    server = fresh_redis_server()  # skips, saying why, where redis-server is missing
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch_storage_loader",
            "demo",
            "--collectors",
            "2",
            "--trajectories",
            "4",
            "--steps",
            "8",
            "--size",
            "32",
            "--train-steps",
            "3",
            "--no-progress-bar",
            "--redis",
            server.url,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "through Redis Streams" in proc.stdout and "same files, plain DataLoader" in proc.stdout
    import redis

    assert not list(redis.Redis.from_url(server.url).keys("tsl-demo-*"))  # the stream was deleted
