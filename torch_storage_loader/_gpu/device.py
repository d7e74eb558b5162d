"""Samples delivered on a device: ``StorageDataset(..., device="cuda")``.

Where a sample is received (under DataLoader workers: the DataLoader's pin-memory thread, which
unpickles the workers' results as they arrive, ahead of the trainer), the slot's whole data
section crosses to the device in one copy on a side stream, and the sample is built as views of
that one device buffer at the file's array offsets (64-byte aligned, so any dtype lines up: the
plan's ``build_on``). The
slot goes back to its worker once the copy's event completed (``_pinning.defer``), not when the
host views are dropped. What arrives is a ``DeviceItem``; on the trainer's thread, the DataLoader
iterator hook (``_dataloader.hooks``) calls ``finish``: the trainer's current stream waits for the copy,
and the copy's memory is not reused before the work queued after that is done. That is all the
trainer's thread does per batch.

Leaves that are not tensors (strings, bytes, non-numeric arrays, pickled values) are read from the
slot on the host before it is released; stacked inline scalars become device tensors too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .._format.tree import Plan, map_tensors
from . import pinning as _pinning

__all__ = ["DeviceItem", "arrive", "deliver", "normalize", "to_device"]


class DeviceItem:
    """A sample whose copy to the device is issued but may not be done yet (or the error building it)."""

    __slots__ = ("device", "error", "event", "owned", "sample")

    def __init__(self, sample: Any, owned: list, event: Any, device: Any, error: BaseException | None = None) -> None:
        self.sample, self.owned, self.event, self.device, self.error = sample, owned, event, device, error

    def pin_memory(self, *args: Any, **kwargs: Any) -> DeviceItem:
        return self  # the DataLoader's pin thread hands it on as it is

    def finish(self) -> Any:
        """The sample, for use on the calling thread's current stream (which waits for the copy)."""
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        acc = _pinning.accelerator()
        stream = acc.current_stream(self.device)
        stream.wait_event(self.event)  # what the trainer queues next runs after the copy
        for t in self.owned:
            acc.record_stream(t, stream)  # the copy's memory is not reused before that work is done
        self.owned = []
        return self.sample


def normalize(device: Any) -> str | None:
    """``device=`` as given to a dataset: None (CPU tensors, as without it) or a device this process can copy to."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"{device=} is not a device ({exc}); pass 'cuda', 'cuda:1', a torch.device, or None") from None
    acc = _pinning.accelerator()
    if acc is not None and acc.handles(dev):
        count = acc.device_count()
        if dev.index is not None and not 0 <= dev.index < count:
            seen = (
                f"{count} devices ({dev.type}:0 to {dev.type}:{count - 1})" if count > 1 else f"1 device ({dev.type}:0)"
            )
            raise ValueError(
                f"{device=}: this process sees {seen}; pass one of them, or '{dev.type}' for the current "
                "device (CUDA_VISIBLE_DEVICES renumbers the devices a process sees from 0)"
            )
        return str(dev)
    if dev.type == "cpu":
        return None  # samples are on the CPU already
    raise ValueError(
        f"{device=}: this process cannot copy to {dev.type} (torch.cuda.is_available() is "
        f"{torch.cuda.is_available()}); pass device=None for CPU tensors"
    )


def deliver(plan: Plan, host: np.ndarray, path: str, device: str, release: Callable[[], None]) -> DeviceItem:
    """Issue the copy of ``host`` (a sample's 1-D uint8 data section) to ``device`` and build the
    sample there; ``release()`` is called once ``host`` is no longer read (after the copy's event)."""
    stage = None
    try:
        with _pinning.accelerator().stage(device) as stage:
            sample = plan.build_on(host, path, stage.copy, stage.move)
        return DeviceItem(sample, stage.owned, stage.event, stage.device)
    except Exception as exc:  # noqa: BLE001 - raised on the trainer's thread, by DeviceItem.finish
        return DeviceItem(None, [], None, device, error=exc)
    finally:
        if stage is None or stage.event is None:
            release()  # nothing was issued
        else:
            _pinning.defer(release, stage.event, stage.index)


def to_device(obj: Any, device: str) -> Any:
    """Move every CPU tensor of ``obj`` (a batch a collate_fn of the user's made) to ``device``."""
    dev = torch.device(device)
    return map_tensors(obj, lambda t: t.to(dev) if t.device.type == "cpu" and dev.type != "cpu" else t)


def arrive(item: Any, device: str) -> Any:
    """On the trainer's thread, as the DataLoader hands ``item`` over: the sample on ``device``."""
    if type(item) is DeviceItem:
        return item.finish()
    return to_device(item, device)
