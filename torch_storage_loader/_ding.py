"""DI-engine interop: this library's handles count as DI-engine's ``Storage`` wherever DI-engine checks.

DI-engine's middleware tests ``isinstance(payload, ding.data.Storage)`` (``ContextExchanger.put``) to
decide whether a message is a handle to load or a payload to use as it is; its ``Storage`` is an ABC,
so registering ours as a virtual subclass is enough, and then an import change is all a switch takes.
DI-engine is never imported here, nor needed: the registration runs when DI-engine's module is
imported, whichever of the two is imported first (a finder on ``sys.meta_path`` wraps that one
module's loader; if it is already imported, the registration runs at once).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Any

__all__ = ["install"]

DING_STORAGE_MODULE = "ding.data.storage.storage"  # where DI-engine 0.5 defines its Storage ABC

_ours: type | None = None
_lock = threading.Lock()


def _register(module: ModuleType) -> None:
    ding_storage = getattr(module, "Storage", None)
    if _ours is not None and isinstance(ding_storage, type) and hasattr(ding_storage, "register"):
        ding_storage.register(_ours)


class _RegisterAfterExec(importlib.abc.Loader):
    """Runs DI-engine's own loader, then registers our ``Storage`` with the ``Storage`` it defined."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader  # the module looks as if imported normally
        self._loader.exec_module(module)
        _register(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, ...: DI-engine's loader's
        return getattr(self._loader, name)


class _DingStorageFinder(importlib.abc.MetaPathFinder):
    """Finds ``ding.data.storage.storage`` with the other finders and wraps its loader."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname != DING_STORAGE_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _RegisterAfterExec(spec.loader)
            return spec
        return None


def install(ours: type) -> None:
    """Make ``ours`` (this library's ``Storage``) a virtual subclass of DI-engine's ``Storage``, now
    if DI-engine's module is imported, else once it is. Idempotent."""
    global _ours
    with _lock:
        _ours = ours
        if not any(isinstance(f, _DingStorageFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, _DingStorageFinder())
    module = sys.modules.get(DING_STORAGE_MODULE)
    if module is not None:
        _register(module)
