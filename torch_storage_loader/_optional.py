"""The optional integrations (the package's extras), imported where they are used.

The core needs torch, numpy and di-treetensor only. Lightning (and torchdata), redis-py and the S3
clients come with the extras ``lightning``, ``redis`` and ``s3`` (``all``: the three); a module that
needs one imports it through ``require``, so a missing one fails with the extra to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]

DISTRIBUTION = "torch_storage_loader"


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import ``module`` (``"lightning.pytorch"``); where it is not installed, raise a
    ``ModuleNotFoundError`` saying that ``what`` needs it and which extra installs it.

    Only the module itself (or a package above it) missing is reworded; a module that is there but
    fails to import raises its own error.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or (module != exc.name and not module.startswith(f"{exc.name}.")):
            raise
        top = module.split(".", 1)[0]
        raise ModuleNotFoundError(f"{what} needs {top}: pip install '{DISTRIBUTION}[{extra}]'", name=exc.name) from exc
