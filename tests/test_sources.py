"""Every streaming source keeps one contract; a directory source on a URL is still a DirectorySource."""

import pickle
import queue

import pytest

from torch_storage_loader import DirectorySource, StorageQueue
from torch_storage_loader._sources import ListSource, PrefixSource, QueueSource, Source, as_source


@pytest.mark.parametrize(
    "make",
    [lambda tmp: tmp, lambda tmp: "s3://bucket/prefix", lambda tmp: StorageQueue(), lambda tmp: queue.Queue()],
    ids=["directory", "prefix", "storage-queue", "queue"],
)
def test_streaming_sources_keep_the_source_contract(tmp_path, make):
    source = as_source(make(str(tmp_path)))
    assert isinstance(source, Source) and source.finite is False
    assert type(source) in (DirectorySource, PrefixSource, QueueSource)


def test_a_finite_list_is_not_a_stream():
    assert isinstance(as_source([]), ListSource) and not isinstance(as_source([]), Source)


def test_directory_source_on_a_url_is_a_directory_source_that_claims_objects():
    source = DirectorySource("s3://bucket/prefix/", poll_interval=0.5)
    assert isinstance(source, DirectorySource) and isinstance(source, PrefixSource)
    assert (source.path, source.poll_interval, source.ack_in_background) == ("s3://bucket/prefix", 0.5, True)
    again = pickle.loads(pickle.dumps(source))
    assert type(again) is PrefixSource and again.path == source.path
