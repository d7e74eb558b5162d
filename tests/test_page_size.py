"""The page size comes from the system: rings are laid out by it, not by 4096.

Many arm64 kernels (NVIDIA Grace Hopper among them) use 64 KiB pages. The test runs a process whose
``mmap.PAGESIZE`` says 64 KiB before the library is imported (the kernel's own pages, 4 KiB here,
divide it, so every call still works) and checks that every slot starts on such a page and that a
DataLoader still delivers through those rings and its feeds (which count no pages).
"""

from __future__ import annotations

from _helpers import run_script

SCRIPT = """
import mmap
mmap.PAGESIZE = 64 << 10  # before the library reads it

import numpy as np
from torch.utils.data import DataLoader

from torch_storage_loader import FileStorageLoader, StorageDataset, StorageQueue
from torch_storage_loader._shm import slots

if __name__ == "__main__":
    assert slots.CTRL % mmap.PAGESIZE == 0, slots.CTRL
    ring = slots.SlotRing(3, 100_000, purpose="page-size test")
    try:
        assert ring.slot_size % mmap.PAGESIZE == 0
        starts = [slots.CTRL + i * ring.slot_size for i in range(3)]
        assert all(s % mmap.PAGESIZE == 0 for s in starts), starts
    finally:
        ring.close()
    with FileStorageLoader("files", ttl=None) as loader:
        queue = StorageQueue()
        for i in range(20):
            queue.put(loader.save({"x": np.full(30_000, i)}))
        queue.close()
        got = [int(s["x"][0]) for s in DataLoader(StorageDataset(queue), batch_size=None, num_workers=2)]
    assert sorted(got) == list(range(20)), got
    print("ok")
"""


def test_rings_and_feeds_follow_a_64k_page_size(tmp_path):
    result = run_script(SCRIPT, tmp_path, timeout=120)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-4000:]
