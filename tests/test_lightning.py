"""StorageDataModule with a real Lightning Trainer: finite and streaming sources, resume, DDP."""

from __future__ import annotations

import pickle

import _helpers
import lightning.pytorch as pl
import pytest
from _redis_server import EVERYWHERE, redis_server  # noqa: F401  (fixture)
from _s3_server import s3_bucket, s3_server  # noqa: F401  (fixtures)
from conftest import traj

from torch_storage_loader import StorageDataset, StorageQueue
from torch_storage_loader.lightning import StorageDataModule, StorageStatsCallback

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*GPU available but not used:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*Checkpoint directory.*exists and is not empty:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*isinstance.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:lightning"),
    pytest.mark.filterwarnings("ignore:.*You are using a CUDA device.*"),
    pytest.mark.filterwarnings("ignore:.*The number of training batches.*:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*consider setting `persistent_workers=True`.*:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*restarting mid-epoch.*:UserWarning"),
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`:UserWarning"),
]


def trainer(tmp_path, **kw):
    kw.setdefault("max_steps", 6)
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=pl.loggers.CSVLogger(tmp_path / "logs"),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[StorageStatsCallback()] + kw.pop("callbacks", []),
        **kw,
    )


def test_fit_finite_source_with_epochs(tmp_path, handles):
    dm = StorageDataModule(handles, batch_size=4, num_workers=2)
    model = _helpers.tiny_model()
    t = trainer(tmp_path, max_epochs=2, max_steps=-1)
    t.fit(model, datamodule=dm)
    assert sorted(model.seen) == sorted(list(range(24)) * 2)
    logged = t.logged_metrics
    assert "loss" in logged and "loader/slot_loads" in logged and "loader/gb_per_s" in logged
    assert float(logged["loader/slot_loads"]) > 0
    dm.teardown("fit")


def test_fit_streaming_source_fed_by_producers(tmp_path):
    q = StorageQueue()
    producers = _helpers.start_producers(q, tmp_path, 12)
    dm = StorageDataModule(q, batch_size=2, num_workers=2)
    model = _helpers.tiny_model()
    t = trainer(tmp_path, max_steps=8)
    t.fit(model, datamodule=dm)
    for p in producers:
        p.join()
    assert len(model.seen) == 16 and len(set(model.seen)) == 16
    assert set(model.seen) <= set(range(12)) | set(range(100, 112))
    dm.teardown("fit")
    q.close()


def test_fit_from_an_object_store_prefix_keeps_credentials_out_of_checkpoints(tmp_path, s3_server, s3_bucket):
    from torch_storage_loader import FileStorageLoader, end_directory_stream

    prefix = f"s3://{s3_bucket}/fit"
    with FileStorageLoader(prefix, ttl=None, worker_num=1, storage_options=s3_server.storage_options) as loader:
        for i in range(12):
            loader.save(traj(i))
    end_directory_stream(prefix)
    dm = StorageDataModule(prefix, batch_size=2, num_workers=2, storage_options=s3_server.storage_options)
    model = _helpers.tiny_model()
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer(tmp_path, max_epochs=1, max_steps=-1, callbacks=[ckpt]).fit(model, datamodule=dm)
    dm.teardown("fit")
    assert sorted(model.seen) == list(range(12))
    saved = (tmp_path / "ckpt" / "last.ckpt").read_bytes() + b"".join(
        p.read_bytes() for p in (tmp_path / "logs").rglob("hparams.yaml")
    )
    assert s3_server.SECRET.encode() not in saved and b"batch_size" in saved


def test_resume_from_mid_epoch_checkpoint(tmp_path, handles):
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    dm = StorageDataModule(handles, batch_size=2, num_workers=2)
    first = _helpers.tiny_model()
    trainer(tmp_path, max_steps=3, callbacks=[ckpt]).fit(first, datamodule=dm)
    dm.teardown("fit")
    path = next((tmp_path / "ckpt").glob("*.ckpt"))
    dm2 = StorageDataModule(handles, batch_size=2, num_workers=2)
    second = _helpers.tiny_model()
    trainer(tmp_path, max_epochs=1, max_steps=-1).fit(second, datamodule=dm2, ckpt_path=str(path))
    dm2.teardown("fit")
    assert sorted(first.seen + second.seen) == list(range(24))


def test_ddp_spawn_splits_a_finite_source(tmp_path, handles):
    dm = StorageDataModule(handles, batch_size=2, num_workers=1)
    rec = tmp_path / "rec"
    rec.mkdir()
    t = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    t.fit(_helpers.tiny_model(str(rec)), datamodule=dm)
    seen = [[int(x) for x in (rec / f"rank{r}.txt").read_text().split()] for r in range(2)]
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(24))


def _closed_queue(tmp_path, n: int) -> StorageQueue:
    """A closed StorageQueue of ``n`` saved trajectories tagged 0..n-1."""
    from conftest import traj

    from torch_storage_loader import FileStorage

    q = StorageQueue()
    for i in range(n):
        s = FileStorage(tmp_path / f"{i:03d}.tsl")
        s.save(traj(i))
        q.put(s)
    q.close()
    return q


@pytest.mark.parametrize("persistent", [True, False])
def test_fit_stopped_at_max_steps_three_times_then_drained_trains_on_everything_once(tmp_path, persistent):
    """Lightning fetches a batch ahead: the one fetched at max_steps goes back to the queue."""
    q = _closed_queue(tmp_path, 60)
    dm = StorageDataModule(q, batch_size=2, num_workers=2, persistent_workers=persistent)
    seen = []
    for max_steps in (5, 5, 5, -1):
        model = _helpers.tiny_model()
        trainer(tmp_path, max_steps=max_steps, max_epochs=1).fit(model, datamodule=dm)
        dm.teardown("fit")
        seen += model.seen
    assert sorted(seen) == list(range(60)), "a sample was lost, or trained on twice"
    assert q.get(timeout=5) is None, "the last batch was trained on, and given back too"


def test_unconfirmed_batches_beyond_two_count_as_used(tmp_path):
    """A loop that never marks batches consumed (training_step(self, dataloader_iter)): at most the
    two batches fetched last go back, so nothing is lost and at most two are seen twice."""
    from torch_storage_loader import StorageDataset
    from torch_storage_loader._dataloader.consumed import ConsumedStateLoader

    q = _closed_queue(tmp_path, 30)
    loader = ConsumedStateLoader(StorageDataset(q), confirm_delivery=True, batch_size=None, num_workers=2)
    got = []
    for k, sample in enumerate(loader):
        got.append(int(sample["info"]["id"]))
        if k == 9:
            break
    loader._iterator._shutdown_workers()
    got += [int(s["info"]["id"]) for s in StorageDataset(q)]
    assert sorted(set(got)) == list(range(30)) and len(got) == 32, sorted(got)


def test_ddp_spawn_shared_stream_gives_each_handle_to_one_rank(tmp_path):
    q = StorageQueue()
    producers = _helpers.start_producers(q, tmp_path, 20)
    rec = tmp_path / "rec"
    rec.mkdir()
    dm = StorageDataModule(q, batch_size=2, num_workers=1)
    t = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=5,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    t.fit(_helpers.tiny_model(str(rec)), datamodule=dm)
    for p in producers:
        p.join()
    q.close()
    seen = [[int(x) for x in (rec / f"rank{r}.txt").read_text().split()] for r in range(2)]
    assert len(seen[0]) == len(seen[1]) == 10
    assert not set(seen[0]) & set(seen[1])


def test_ddp_spawn_over_redis_trains_on_each_sample_once(tmp_path, redis_server):
    import uuid

    from conftest import traj
    from torch.utils.data import DataLoader

    from torch_storage_loader import FileStorage, RedisStorageQueue, StorageDataset

    q = RedisStorageQueue(redis_server.url, f"s-{uuid.uuid4().hex[:8]}", trusted_roots=EVERYWHERE)
    try:
        for i in range(60):
            s = FileStorage(tmp_path / f"{i:03d}.tsl")
            s.save(traj(i))
            q.put(s)
        q.close()
        rec = tmp_path / "rec"
        rec.mkdir()
        t = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy="ddp_spawn",
            max_steps=10,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            default_root_dir=tmp_path,
        )
        t.fit(_helpers.tiny_model(str(rec)), datamodule=StorageDataModule(q, batch_size=2, num_workers=1))
        seen = [[int(x) for x in (rec / f"rank{r}.txt").read_text().split()] for r in range(2)]
        assert len(seen[0]) == len(seen[1]) == 20
        rest = [int(s["info"]["id"]) for s in DataLoader(StorageDataset(q), batch_size=None, timeout=0)]
        assert sorted(seen[0] + seen[1] + rest) == list(range(60)), "a sample was lost, or trained on twice"
        stats = q.stats()
        assert (stats["pending"], stats["duplicates"], stats["acked"]) == (0, 0, 60), stats
    finally:
        q.delete()
        q.disconnect()


def test_exception_in_fit_leaves_nothing_behind(tmp_path, handles):
    dm = StorageDataModule(handles, batch_size=2, num_workers=2)
    with pytest.raises(ValueError, match="boom in training_step"):
        trainer(tmp_path).fit(_helpers.tiny_model(fail_at=2), datamodule=dm)
    # the no_leaks fixture checks that the workers and shared memory are gone


def test_datamodule_is_picklable_and_saves_hyperparameters(handles):
    dm = StorageDataModule(handles, batch_size=4, num_workers=2)
    back = pickle.loads(pickle.dumps(dm))
    assert back.batch_size == 4 and dm.hparams["batch_size"] == 4 and dm.hparams["num_workers"] == 2
    with pytest.raises(ValueError, match="num_workers=-1 must be >= 0"):
        StorageDataModule(handles, num_workers=-1)


def test_finite_source_sizes_epochs_and_shuffles_each_epoch(tmp_path, handles):
    import torch

    dm = StorageDataModule(handles, batch_size=4, num_workers=2, shuffle=True, seed=3)
    model = _helpers.tiny_model()
    t = trainer(tmp_path, max_epochs=3, max_steps=-1)
    t.fit(model, datamodule=dm)
    assert t.num_training_batches == len(dm.train_dataset) == 6
    epochs = [model.seen[24 * e : 24 * (e + 1)] for e in range(3)]
    for e, seen in enumerate(epochs):  # the trainer's epoch reached the persistent workers
        g = torch.Generator()
        g.manual_seed(3 + e)
        assert seen == torch.randperm(24, generator=g).tolist()
    dm.teardown("fit")


@pytest.mark.parametrize("drop_last", [False, True])
def test_ddp_spawn_uneven_source_same_batches_on_every_rank(tmp_path, handles, drop_last):
    # 5 handles, 2 ranks, batches of 2: 3 samples (one repeated) and 2 batches per rank, or with
    # drop_last 2 samples and 1 batch. Uneven batch counts would hang DDP's all-reduce.
    dm = StorageDataModule(handles[:5], batch_size=2, num_workers=1, shuffle=True, drop_last=drop_last)
    rec = tmp_path / "rec"
    rec.mkdir()
    t = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    t.fit(_helpers.TinyCounting(str(rec)), datamodule=dm)
    seen = [[int(x) for x in (rec / f"rank{r}.txt").read_text().split()] for r in range(2)]
    counts = [tuple(int(x) for x in (rec / f"rank{r}.batches").read_text().split()) for r in range(2)]
    per_rank, samples = (1, 2) if drop_last else (2, 3)
    assert counts == [(per_rank, 2 * per_rank)] * 2  # num_training_batches, steps over 2 epochs
    assert len(seen[0]) == len(seen[1]) == 2 * samples
    for e in range(2):
        epoch = [s[samples * e : samples * (e + 1)] for s in seen]
        if drop_last:
            assert len(set(epoch[0] + epoch[1])) == 4
        else:
            assert set(epoch[0] + epoch[1]) == set(range(5))  # every handle trained on, one twice


def test_data_module_offers_every_dataset_option_and_checks_them_when_made():
    import inspect

    def keyword_only(fn):
        return {n for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY}

    assert keyword_only(StorageDataset.__init__) <= keyword_only(StorageDataModule.__init__)
    with pytest.raises(ValueError, match="slots_per_worker=0 must be >= 1"):
        StorageDataModule([], slots_per_worker=0)
    with pytest.raises(ValueError, match="max_shm_bytes=0 must be >= 1"):
        StorageDataModule([], max_shm_bytes=0)
    with pytest.raises(TypeError, match="shuffle=1 must be a bool"):
        StorageDataModule([], shuffle=1)
