"""The DataLoader hooks check the private torch they wrap, and refuse a torch that differs, loudly."""

import os
import subprocess
import sys
import textwrap

import pytest
from torch.utils.data import dataloader

from torch_storage_loader import UnsupportedTorchError
from torch_storage_loader._dataloader import hooks


def test_the_installed_torch_has_what_the_hooks_wrap():
    hooks.install()  # idempotent
    assert dataloader._MultiProcessingDataLoaderIter._tsl_delivery


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


def test_importing_the_dataset_under_a_changed_torch_raises_unsupported_torch_error():
    # A fresh interpreter whose torch iterator class has the old signature: the hooks install at import.
    code = textwrap.dedent("""
        from torch.utils.data import dataloader

        class _MultiProcessingDataLoaderIter(dataloader._MultiProcessingDataLoaderIter):
            def _process_data(self, data):
                return data

        dataloader._MultiProcessingDataLoaderIter = _MultiProcessingDataLoaderIter
        from torch_storage_loader import UnsupportedTorchError
        try:
            import torch_storage_loader.dataset
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
