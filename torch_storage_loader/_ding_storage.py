"""DI-engine's own handles reaching this library's loader (a fleet that switches collectors and learners
at different times): refused, or with ``allow_pickle=True`` loaded by their own code in a worker."""

from __future__ import annotations

from typing import Any

from .errors import PickleNotAllowedError
from .storage import Storage

__all__ = ["DingStorage", "foreign_storage"]


class DingStorage(Storage):
    """A DI-engine handle (``ding.data.FileStorage``: a pickle file) loaded by its own ``load`` in a
    worker, for a fleet where some collectors still run DI-engine; only with ``allow_pickle=True``."""

    def __init__(self, handle: Any) -> None:
        super().__init__(handle.path)
        self.handle = handle
        self.allow_pickle = True  # its sample is a pickle: storing it in a slot may pickle leaves too

    def save(self, data: Any) -> None:
        self.handle.save(data)

    def load(self) -> Any:
        return self.handle.load()

    def __repr__(self) -> str:
        return f"DI-engine {type(self.handle).__name__}({self.path!r})"


def foreign_storage(handle: object, *, allow_pickle: bool) -> Storage:
    """The handle a loader loads for ``handle``, which is not this library's ``Storage``.

    Raises:
        PickleNotAllowedError: ``handle`` is DI-engine's and ``allow_pickle`` is off.
        TypeError: ``handle`` is not a handle at all.
    """
    kind = type(handle)
    if kind.__module__.split(".")[0] == "ding" and callable(getattr(handle, "load", None)):
        if allow_pickle:
            return DingStorage(handle)
        raise PickleNotAllowedError(
            f"{handle!r} is a DI-engine handle ({kind.__module__}.{kind.__qualname__}) of a pickle file, which "
            "this loader reads only with allow_pickle=True. Collectors and learners switch together: import "
            "FileStorageLoader from torch_storage_loader in the collectors too; while a fleet switches, and only "
            "if every collector is trusted, FileStorageLoader(..., allow_pickle=True) loads DI-engine's files "
            "with DI-engine's own code",
            path=getattr(handle, "path", None),
        )
    raise TypeError(f"storage must be a Storage handle, got {kind.__name__}")
