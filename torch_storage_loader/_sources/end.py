"""The end of a directory (or object-store prefix) stream: a marker object producers write, and
remove again when a new stream starts in the same place."""

from __future__ import annotations

import os

from .._stores import clean as _clean
from .._stores import objects as _objects

__all__ = ["END_OF_STREAM", "end_directory_stream", "marker_path", "start_directory_stream"]

END_OF_STREAM = "_END_OF_STREAM"


def marker_path(path: str | os.PathLike[str]) -> str:
    """Where the end marker of the stream in ``path`` (a directory or object-store prefix URL) lives."""
    path = os.fspath(path)
    if _objects.is_url(path):
        return f"{path.rstrip('/')}/{END_OF_STREAM}"
    return os.path.join(path, END_OF_STREAM)


def end_directory_stream(path: str | os.PathLike[str]) -> None:
    """Tell the consumers of a directory source (or object-store prefix) that no more files will come.

    Writes the marker ``_END_OF_STREAM`` into it (or writes it again: it is then newer than every file
    saved before); consumers stop once it exists and every file was delivered (or is held by another
    live trainer). Call it once, after the last save of every producer. The marker stays: to stream
    through the same place again, call ``start_directory_stream(path)`` first.

    Args:
        path: The directory (created if missing) or object-store prefix URL the producers save into.
    """
    marker = marker_path(path)
    if _objects.is_url(marker):
        _objects.put(marker, [b""])
        return
    os.makedirs(path, exist_ok=True)
    with open(marker, "w"):
        pass
    os.utime(marker)  # an existing marker is rewritten too: it must be newer than the files it ends


def start_directory_stream(path: str | os.PathLike[str]) -> bool:
    """Start a new stream in a directory (or object-store prefix) where an earlier one ended.

    Removes the end marker that ``end_directory_stream`` left: without this, a consumer of the new
    stream refuses to start (``StreamEndedError``), because the old marker would stop it before the
    new stream's producers are done. Call it before the new stream's producers and consumers start,
    once no consumer of the earlier stream runs (one still running would then wait for the new
    stream's end). Files left in ``path`` (undelivered ones of the earlier stream) are delivered in
    the new stream.

    Args:
        path: The directory or object-store prefix URL the producers save into.

    Returns:
        Whether there was a marker to remove.
    """
    return _clean.remove(marker_path(path))
