"""The memory policy of a worker's slots (``_alloc``), exercised in-process on real shared memory."""

from __future__ import annotations

import gc
import os
import pickle

import numpy as np
import pytest

from torch_storage_loader import FileStorage, FileStorageLoader, SampleTooLargeError
from torch_storage_loader._format.file import ReadOptions
from torch_storage_loader._shm.alloc import GROWTH, OUTLIER, WINDOW, SlotAllocator
from torch_storage_loader._shm.filling import SlotFiller
from torch_storage_loader._shm.segments import shm_dir
from torch_storage_loader._shm.slots import CTRL, page_round, retire_rings

OPTS = ReadOptions()
MiB = 1 << 20


def lease_and_send(alloc: SlotAllocator, nbytes: int):
    """Lease, commit and pickle as a worker does; returns (info, pickled reference)."""
    from torch_storage_loader._format.file import ArrayEntry, Header

    lease = alloc.lease(nbytes, "x.tsl", OPTS)
    lease.view[:] = bytes([nbytes % 251]) * nbytes
    header = Header(["a", 0], (ArrayEntry("numpy", "|u1", (nbytes,), 0, nbytes),), 0, nbytes)
    return lease.info, lease.commit(header)


def shm_used() -> int:
    st = os.statvfs(shm_dir())
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_growing_samples_regrow_geometrically():
    alloc = SlotAllocator(2, budget=1 << 30)
    regrows = 0
    try:
        for n in range(1, 161):  # an episode that grows by one 16 KiB step each time
            info, ref = lease_and_send(alloc, n * 16384)
            regrows += info.regrew
            assert info.via == "slot"
            alloc.rings[0].unacquire(ref.slot)  # the consumer dropped it
            alloc.find(ref.ring_uid).received_here()
        # 1 -> 2 -> 4 -> ... -> 256 steps: log2(160) regrows, not one per size.
        assert regrows <= 9, regrows
        assert alloc.slot_size >= 160 * 16384 and alloc.slot_size <= GROWTH * 160 * 16384
        # Retired rings whose references were all received and slots freed are unmapped.
        alloc.lease(16384, "x.tsl", OPTS).abort()
        assert not alloc.retired
    finally:
        alloc.close()


def test_outlier_travels_alone_and_rings_keep_their_size():
    alloc = SlotAllocator(4, budget=1 << 30)
    try:
        for _ in range(10):
            info, ref = lease_and_send(alloc, 100_000)
            alloc.rings[0].unacquire(ref.slot)
        size = alloc.slot_size
        info, ref = lease_and_send(alloc, (OUTLIER + 1) * size)
        assert info.via == "oversize" and not info.regrew
        assert alloc.slot_size == size and len(alloc.rings) == 1 and not alloc.retired
        sample = pickle.loads(pickle.dumps(ref))  # the receiver maps it; dropping it unmaps it
        assert sample.nbytes == (OUTLIER + 1) * size and sample[0] == ((OUTLIER + 1) * size) % 251
    finally:
        alloc.close()


def test_idle_oversized_rings_are_given_back():
    alloc = SlotAllocator(4, budget=1 << 30)
    try:
        for n in (8 * MiB, 8 * MiB):  # a burst of large samples sizes the rings
            _info, ref = lease_and_send(alloc, n)
            alloc.rings[0].unacquire(ref.slot)
        big = alloc.held()
        for _ in range(WINDOW + 1):  # then only small ones
            _info, ref = lease_and_send(alloc, 64 << 10)
            alloc.find(ref.ring_uid).unacquire(ref.slot)
            alloc.find(ref.ring_uid).received_here()
        alloc.lease(64 << 10, "x.tsl", OPTS).abort()
        assert alloc.slot_size == page_round(64 << 10)
        assert alloc.held() < big / 8, (alloc.held(), big)
    finally:
        alloc.close()


def allocated(ring) -> int:
    """Bytes of shared memory the kernel holds for a ring (tmpfs counts a file's pages)."""
    return os.fstat(ring.segment._fd).st_blocks * 512


def test_retired_ring_gives_back_free_slots_while_one_is_kept():
    alloc = SlotAllocator(8, budget=1 << 30)
    try:
        refs = [lease_and_send(alloc, 4 * MiB)[1] for _ in range(8)]
        ring = alloc.rings[0]
        assert allocated(ring) >= 8 * 4 * MiB
        for ref in refs[1:]:
            ring.unacquire(ref.slot)  # the consumer keeps only the first sample
        lease_and_send(alloc, 6 * MiB)  # larger: the ring is retired, a new one made
        assert alloc.retired == [ring]
        assert ring.nbytes == CTRL + ring.slot_size
        assert allocated(ring) <= CTRL + 4 * MiB  # the 7 free slots went back to the kernel
    finally:
        alloc.close()


def test_budget_bounds_rings_and_refuses_huge_samples_before_allocating():
    alloc = SlotAllocator(4, max_rings=8, budget=10 * MiB)
    try:
        infos = [lease_and_send(alloc, MiB)[0] for _ in range(40)]  # nothing is ever released
        assert alloc.held() <= 10 * MiB
        assert any(i.copied for i in infos)  # past the budget the receiver copies, nothing grows
        before = shm_used()
        with pytest.raises(SampleTooLargeError, match=r"x\.tsl.*max_shm_bytes"):
            alloc.lease(20 << 30, "x.tsl", OPTS)
        assert shm_used() < before + MiB
    finally:
        alloc.close()


def _drop_and_exit(kept) -> None:
    kept.clear()
    gc.collect()


def test_forked_child_dropping_inherited_samples_frees_nothing(tmp_store):
    import multiprocessing as mp

    with FileStorageLoader(tmp_store, worker_num=1, slots_per_worker=4, max_rings_per_worker=2) as loader:
        storages = [loader.save({"x": np.full(50_000, i, np.int64)}) for i in range(12)]
        kept = [loader.load_async(s).result(timeout=60) for s in storages[:4]]
        assert loader.stats().copies == 0  # slot-backed, not private copies
        pid = os.fork()
        if pid == 0:  # the child drops what it inherited, runs its exit hooks, and leaves
            try:
                _drop_and_exit(kept)
                import atexit

                atexit._run_exitfuncs()
            finally:
                os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        child = mp.get_context("fork").Process(target=_drop_and_exit, args=(kept,))
        child.start()
        child.join()
        assert child.exitcode == 0
        for s in storages[4:]:  # if the children had freed our slots, these would overwrite them
            loader.load_async(s).result(timeout=60)
        for i, sample in enumerate(kept):
            assert (sample["x"] == i).all(), f"sample {i} was overwritten after a forked child dropped it"


def test_filler_copies_nothing_when_consumer_drops(tmp_path):
    path = tmp_path / "s.tsl"
    FileStorage(path).save({"a": np.arange(1000)})
    filler = SlotFiller(2, max_rings=1, budget=1 << 30)
    try:
        for _ in range(50):
            info, ref = filler.fill(FileStorage(path))
            sample = pickle.loads(pickle.dumps(ref))
            assert info.via == "slot" and not info.copied
            assert (sample["a"] == np.arange(1000)).all()
            del sample
    finally:
        filler.close()
        retire_rings(os.getpid())  # what a loader does when its worker stops
