"""Options of the wrong type fail at the constructor with a TypeError naming the option and the
type expected (issue 28: ``batch_size="16"`` used to fail later with ``'<' not supported between
'str' and 'int'``); values of the right type out of range keep their ValueError."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from torch_storage_loader import FileStorage, FileStorageLoader, RedisStorageQueue, StorageDataset, StorageQueue
from torch_storage_loader._dataloader.items import DatasetOptions
from torch_storage_loader._redis.options import Options

HANDLES = [FileStorage("x.tsl")]
REDIS = ("redis://127.0.0.1:1/0", "s")  # never reached: the options are checked first


def _data_module(**options):
    from torch_storage_loader.lightning import StorageDataModule

    return StorageDataModule(HANDLES, **options)


CASES = [  # (constructor, option, wrong value, what the message says is expected)
    *[
        (lambda **o: StorageDataset(HANDLES, **o), name, value, want)
        for name, value, want in [
            ("batch_size", "16", "an int >= 1 (or None)"),
            ("batch_size", True, "an int >= 1 (or None)"),
            ("slots_per_worker", "4", "an int >= 1"),
            ("max_rings_per_worker", 2.0, "an int >= 1"),
            ("max_shm_bytes", "1G", "an int >= 1 (or None)"),
            ("drop_last", "no", "a bool"),
            ("shuffle", 1, "a bool"),
            ("seed", "0", "an int"),
            ("on_error", 1, "a string"),
        ]
    ],
    *[
        (_data_module, name, value, want)
        for name, value, want in [
            ("batch_size", "16", "an int >= 1 (or None)"),
            ("num_workers", "2", "an int >= 0"),
            ("num_workers", True, "an int >= 0"),
            ("prefetch_factor", "2", "an int >= 1 (or None)"),
            ("persistent_workers", "yes", "a bool (or None)"),
            ("pin_memory", 1, "a bool"),
            ("slots_per_worker", 4.0, "an int >= 1"),
            ("seed", 0.5, "an int"),
        ]
    ],
    *[
        (lambda **o: FileStorageLoader("unused", **o), name, value, want)
        for name, value, want in [
            ("ttl", "20", "a number > 0 (or None)"),
            ("ttl", True, "a number > 0 (or None)"),
            ("worker_num", "3", "an int >= 1"),
            ("worker_num", True, "an int >= 1"),
            ("slots_per_worker", "4", "an int >= 1"),
            ("max_rings_per_worker", None, "an int >= 1"),
            ("max_inflight_per_worker", 1.5, "an int >= 1"),
            ("max_shm_bytes", "1G", "an int >= 1 (or None)"),
            ("allow_pickle", "no", "a bool"),
            ("fsync", 1, "a bool"),
            ("remove_on_shutdown", "yes", "a bool"),
        ]
    ],
    *[
        (StorageQueue, name, value, want)
        for name, value, want in [
            ("maxsize", "10", "an int >= 0"),
            ("maxsize", True, "an int >= 0"),
        ]
    ],
    *[
        (lambda **o: RedisStorageQueue(*REDIS, **o), name, value, want)
        for name, value, want in [
            ("group", 5, "a string"),
            ("claim_after", "30", "a number > 0"),
            ("producer_timeout", None, "a number > 0"),
            ("retry_timeout", "5", "a number >= 0"),
            ("prefetch", True, "an int >= 1"),
            ("prefetch", "1", "an int >= 1"),
            ("replicas", 1.0, "an int >= 0"),
            ("cluster", "no", "a bool"),
            ("allow_pickle", 1, "a bool"),
        ]
    ],
]


@pytest.mark.parametrize(
    ("make", "name", "value", "want"), CASES, ids=[f"{i}-{c[1]}={c[2]!r}" for i, c in enumerate(CASES)]
)
def test_a_wrong_option_type_is_a_type_error_naming_it(make, name, value, want):
    with pytest.raises(TypeError) as caught:
        make(**{name: value})
    assert str(caught.value) == f"{name}={value!r} must be {want}, got {type(value).__name__}"


def test_the_stream_name_of_a_redis_queue_must_be_a_string():
    with pytest.raises(TypeError, match=r"^stream=5 must be a string, got int$"):
        RedisStorageQueue(REDIS[0], 5)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: StorageDataset(HANDLES, batch_size=0), "batch_size=0 must be >= 1, or None for single samples"),
        (lambda: FileStorageLoader("unused", worker_num=0), "worker_num=0 must be >= 1"),
        (lambda: FileStorageLoader("unused", ttl=0), "ttl=0 must be > 0, or None to keep files forever"),
        (lambda: StorageQueue(-1), "maxsize=-1 must be >= 0"),
        (lambda: _data_module(num_workers=-1), "num_workers=-1 must be >= 0"),
        (
            lambda: RedisStorageQueue(*REDIS, prefetch=0),
            "prefetch=0 must be >= 1",
        ),  # was "an int >= 1": the type is its own error now
        (lambda: StorageDataset(HANDLES, on_error="ignore"), "on_error='ignore' must be 'raise' or 'skip'"),
    ],
)
def test_a_value_out_of_range_is_still_a_value_error(make, message):
    with pytest.raises(ValueError) as caught:
        make()
    assert str(caught.value) == message


def _keywords(init):
    """A constructor's keyword-only parameters: name -> (default, annotation as written)."""
    parameters = inspect.signature(init).parameters.values()
    return {p.name: (p.default, p.annotation) for p in parameters if p.kind is p.KEYWORD_ONLY}


def test_the_dataset_and_the_data_module_spell_the_dataset_options_alike():
    """Their signatures stay explicit (the docs and IDEs show them): the one definition is
    DatasetOptions, and both mirror it, with the same defaults and annotations."""
    from torch_storage_loader.lightning import StorageDataModule

    dataset = _keywords(StorageDataset.__init__)
    assert list(dataset) == [field.name for field in dataclasses.fields(DatasetOptions)]
    module = _keywords(StorageDataModule.__init__)
    assert {name: module.get(name) for name in dataset} == dataset


def test_the_redis_queue_s_parameters_are_its_options():
    parameters = [name for name in inspect.signature(RedisStorageQueue.__init__).parameters if name != "retry_for"]
    assert parameters == ["self", *(field.name for field in dataclasses.fields(Options))]


@pytest.mark.parametrize(
    "options",
    [
        {"batch_size": "16"},
        {"batch_size": 0},
        {"collate_fn": list},
        {"slots_per_worker": 0},
        {"max_shm_bytes": 0},
        {"on_error": "ignore"},
        {"shuffle": 1},
        {"seed": "0", "drop_last": "no"},  # the first one checked is named by both
    ],
    ids=repr,
)
def test_a_misconfigured_option_raises_the_same_error_from_the_dataset_and_the_data_module(options):
    with pytest.raises((TypeError, ValueError)) as from_dataset:
        StorageDataset(HANDLES, **options)
    with pytest.raises((TypeError, ValueError)) as from_module:
        _data_module(**options)
    assert type(from_module.value) is type(from_dataset.value)
    assert str(from_module.value) == str(from_dataset.value)
