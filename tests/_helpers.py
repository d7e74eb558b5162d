"""Storage types for tests; a module of their own so that spawned workers can import them."""

from __future__ import annotations

import os
import signal
import time

import numpy as np

from torch_storage_loader import Storage


class MemoryStorage(Storage):
    """Holds its sample in the handle: exercises the generic (non-file) worker path."""

    def __init__(self, value, tag: str = "mem") -> None:
        super().__init__(tag)
        self.value = value

    def save(self, data) -> None:
        self.value = data

    def load(self):
        return self.value


class SleepStorage(Storage):
    def __init__(self, seconds: float, tag: str = "sleep") -> None:
        super().__init__(tag)
        self.seconds = seconds

    def save(self, data) -> None:
        raise NotImplementedError

    def load(self):
        time.sleep(self.seconds)
        return {"slept": np.array([self.seconds])}


class KillStorage(Storage):
    """Kills the worker that loads it; with ``marker``, only the first time."""

    def __init__(self, marker: str | None) -> None:
        super().__init__(marker or "always")
        self.marker = marker

    def save(self, data) -> None:
        raise NotImplementedError

    def load(self):
        if self.marker is None or not os.path.exists(self.marker):
            if self.marker is not None:
                open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return {"survived": np.array([1])}
