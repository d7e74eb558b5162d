"""The end of a directory (or object-store prefix) stream: a marker object producers write."""

from __future__ import annotations

import os

from .._stores import objects as _objects

__all__ = ["END_OF_STREAM", "end_directory_stream"]

END_OF_STREAM = "_END_OF_STREAM"


def end_directory_stream(path: str | os.PathLike) -> None:
    """Tell the consumers of a directory source (or object-store prefix) that no more files will come.

    Writes the marker ``_END_OF_STREAM`` into it; consumers stop once it exists and every file was
    delivered (or is held by another live trainer). Call it once, after the last save.

    Args:
        path: The directory (created if missing) or object-store prefix URL the producers save into.
    """
    if _objects.is_url(os.fspath(path)):
        _objects.put(f"{os.fspath(path).rstrip('/')}/{END_OF_STREAM}", [b""])
        return
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, END_OF_STREAM), "w"):
        pass
