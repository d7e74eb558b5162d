"""Save samples synchronously, load them asynchronously through reusable shared-memory slots.

Public names are imported on first use, so that worker processes, which only read files into
shared memory, start without importing torch. They are listed once, in ``__init__.pyi``: type
checkers read that stub, and this module reads it to build ``__all__`` and the lazy imports.
"""

from __future__ import annotations

import ast
import importlib
import os

__version__ = "0.1.0"


def _read_exports() -> dict[str, str]:
    """Public name -> the module (relative to this package) that defines it, from ``__init__.pyi``."""
    with open(os.path.join(os.path.dirname(__file__), "__init__.pyi"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return {
        alias.asname or alias.name: node.module or ""
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.level == 1
        for alias in node.names
    }


_EXPORTS = _read_exports()

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
