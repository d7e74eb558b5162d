"""The optional integrations (the extras lightning, redis, s3): the core imports and works without
them, and a feature that needs a missing one says which extra installs it."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from torch_storage_loader import _optional

ROOT = pathlib.Path(__file__).resolve().parents[1]

# What each extra installs, as the modules the package imports.
EXTRAS = {"lightning": ("lightning", "torchdata"), "redis": ("redis",), "s3": ("s3fs", "obstore")}

# Run in a fresh interpreter with the extras' modules (or one extra's) made unimportable: an entry of
# None in sys.modules makes `import name` (and name.sub) raise ModuleNotFoundError, as if not installed.
BLOCK = "import sys\nfor name in {names!r}:\n    sys.modules[name] = None\n"


def _run(names: tuple[str, ...], code: str) -> None:
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", BLOCK.format(names=names) + code],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _raises(expression: str, what: str, extra: str) -> str:
    """Code that asserts ``expression`` raises ModuleNotFoundError naming ``what`` and the extra."""
    return (
        "try:\n"
        f"    {expression}\n"
        "except ModuleNotFoundError as exc:\n"
        f"    assert {what!r} in str(exc) and \"pip install 'torch_storage_loader[{extra}]'\" in str(exc), str(exc)\n"
        "else:\n"
        f"    raise AssertionError({expression!r} + ' worked without the {extra} extra')\n"
    )


ALL_BLOCKED = tuple(name for names in EXTRAS.values() for name in names)


def test_the_core_imports_and_works_without_any_extra(tmp_path):
    code = (
        "import numpy as np\n"
        "import torch_storage_loader as t\n"
        "from torch.utils.data import DataLoader\n"
        "for n in t.__all__:\n"
        "    getattr(t, n) if n != 'RedisStorageQueue' else None\n"
        f"with t.FileStorageLoader({str(tmp_path)!r}, ttl=None, worker_num=1) as loader:\n"
        "    handle = loader.save({'x': np.arange(4)})\n"
        "    assert list(loader.load_async(handle).result()['x']) == [0, 1, 2, 3]\n"
        "batches = list(DataLoader(t.StorageDataset([handle]), batch_size=None))\n"
        "assert list(batches[0]['x']) == [0, 1, 2, 3], batches\n"
        "import torch_storage_loader.dataset, torch_storage_loader.loader, torch_storage_loader.file_loader\n"
        f"assert not {set(ALL_BLOCKED)!r} & {{m.split('.')[0] for m, v in sys.modules.items() if v is not None}}\n"
    )
    _run(ALL_BLOCKED, code)


@pytest.mark.parametrize(
    ("extra", "expression", "what"),
    [
        ("lightning", "from torch_storage_loader.lightning import StorageDataModule", "StorageDataModule"),
        ("lightning", "import torch_storage_loader.demo as d; d._model()", "The demo"),
        ("redis", "from torch_storage_loader import RedisStorageQueue", "RedisStorageQueue"),
        ("redis", "import torch_storage_loader.redis_queue", "RedisStorageQueue"),
        ("s3", "from torch_storage_loader._stores.config import filesystem; filesystem('s3://bucket/x')", "s3://"),
    ],
)
def test_a_feature_without_its_extra_names_the_extra(extra, expression, what):
    _run(EXTRAS[extra], _raises(expression, what, extra))


def test_each_extra_alone_is_enough_for_its_feature():
    """Blocking the other extras leaves a feature working: it needs its own extra only."""
    others = {extra: tuple(n for e, names in EXTRAS.items() if e != extra for n in names) for extra in EXTRAS}
    _run(others["lightning"], "from torch_storage_loader.lightning import StorageDataModule\n")
    _run(others["redis"], "from torch_storage_loader import RedisStorageQueue\n")
    _run(others["s3"], "from torch_storage_loader._stores.config import filesystem; filesystem('s3://bucket/x')\n")


def test_require_rewords_only_the_missing_module_itself():
    with pytest.raises(
        ModuleNotFoundError, match=r"^X needs no_such_tsl_module: pip install 'torch_storage_loader\[e\]'"
    ):
        _optional.require("no_such_tsl_module.sub", "e", "X")
    assert _optional.require("json", "e", "X").dumps(1) == "1"


def test_the_extras_install_what_the_code_imports():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {r.split(">")[0].split("=")[0].split("<")[0].strip() for r in project["dependencies"]}
    assert core == {"torch", "numpy", "di-treetensor"}
    extras = project["optional-dependencies"]
    for extra, modules in EXTRAS.items():
        names = {r.split(">")[0].strip() for r in extras[extra]}
        assert set(modules) <= names, (extra, names)
    assert extras["all"] == ["torch-storage-loader[lightning,redis,s3]"]
    assert "torch-storage-loader[all]" in extras["test"]
