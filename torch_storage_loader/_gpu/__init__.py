"""The GPU path, above shared memory: rings page-locked in place and slots released once the copies
reading them are done (``pinning``, through ``cuda`` and ``cudart``), samples delivered on a device
(``device``). Importing it installs what ``_shm`` receives through (``_shm.slots.gpu``)."""

from typing import Any

from .._shm import slots as _slots
from . import pinning as _pinning


def _deliver(*args: Any) -> Any:
    from .device import deliver  # torch: imported where a sample first goes to a device

    _slots.gpu = _slots.gpu._replace(deliver=deliver)
    return deliver(*args)


_slots.gpu = _slots.GpuPath(_pinning.pin, _pinning.unpin, _pinning.defer, _deliver, _pinning.may_pin)
