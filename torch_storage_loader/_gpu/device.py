"""Samples delivered on a device: ``StorageDataset(..., device="cuda")``.

Where a sample is received (under DataLoader workers: the DataLoader's pin-memory thread, which
unpickles the workers' results as they arrive, ahead of the trainer), the slot's whole data
section crosses to the device in one copy on a side stream, and the sample is built as views of
that one device buffer at the file's array offsets (64-byte aligned, so any dtype lines up). The
slot goes back to its worker once the copy's event completed (``_pinning.defer``), not when the
host views are dropped. What arrives is a ``DeviceItem``; on the trainer's thread, the DataLoader
iterator hook (``_dataloader.hooks``) calls ``finish``: the trainer's current stream waits for the copy,
and the copy's memory is not reused before the work queued after that is done. That is all the
trainer's thread does per batch.

Leaves that are not tensors (strings, bytes, non-numeric arrays, pickled values) are read from the
slot on the host before it is released; stacked inline scalars become device tensors too.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .._format.tree import (
    _L_ARRAY,
    _L_SCALAR,
    _L_TENSOR,
    _L_TORCH,
    _L_TORCH_EMPTY,
    _N_TREE,
    _N_VALUES,
    Plan,
    _damaged,
    _treetensor_types,
)
from . import pinning as _pinning

logger = logging.getLogger("torch_storage_loader")

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
        _pinning.accelerator().consume(self.owned, self.event, self.device)
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
            sample = _build(plan, host, path, stage)
        return DeviceItem(sample, stage.owned, stage.event, stage.device)
    except Exception as exc:  # noqa: BLE001 - raised on the trainer's thread, by DeviceItem.finish
        return DeviceItem(None, [], None, device, error=exc)
    finally:
        if stage is None or stage.event is None:
            release()  # nothing was issued
        else:
            _pinning.defer(release, stage.event)


# Per plan: how to make each leaf from the device buffer, and whether inline values need moving.
_recipes: dict[int, tuple[Plan, list, bool]] = {}
_MAX_RECIPES = 256


def _recipe(plan: Plan) -> tuple[list, bool]:
    plan = plan.base or plan  # a plan bound to a sample's inline values has its base's leaves
    hit = _recipes.get(id(plan))
    if hit is not None and hit[0] is plan:
        return hit[1], hit[2]
    leaves = []
    for code, start, end, a, shape in plan.leaves:
        tensorable = code in (_L_TENSOR, _L_SCALAR) and a.kind in "biufc" and a.isnative
        if code == _L_TENSOR or (code == _L_SCALAR and plan.opts.as_tensors and tensorable):
            leaves.append((0, start, end, torch.from_numpy(np.empty(0, a)).dtype, shape))
        elif code == _L_TORCH:
            leaves.append((0, start, end, a, shape))
        elif code == _L_TORCH_EMPTY:
            leaves.append((1, start, end, a, shape))
        elif code == _L_ARRAY:
            leaves.append((2, start, end, a, shape))
        else:
            leaves.append((3, code, start, end, a, shape))
    values = _has_values(plan.tree)
    if len(_recipes) >= _MAX_RECIPES:
        _recipes.clear()
    _recipes[id(plan)] = (plan, leaves, values)
    return leaves, values


def _has_values(node: Any) -> bool:
    if type(node) is int or not isinstance(node, tuple):
        return False
    if node[0] == _N_VALUES:
        return True
    children = node[3] if node[0] == _N_TREE else node[-1]
    return isinstance(children, tuple) and any(_has_values(c) for c in children)


def _build(plan: Plan, host: np.ndarray, path: str, stage: Any) -> Any:
    if plan.error is not None:
        raise _damaged(path, plan.error)
    recipe, values = _recipe(plan)
    dev = stage.copy(host, path)
    leaves: list[Any] = []
    add = leaves.append
    try:
        for r in recipe:
            kind = r[0]
            if kind == 0:
                add(dev[r[1] : r[2]].view(r[3]).view(r[4]))
            elif kind == 1:
                add(torch.empty(r[4], dtype=r[3], device=stage.device))
            elif kind == 2:
                add(host[r[1] : r[2]].view(r[3]).reshape(r[4]).copy())  # the slot goes back: a copy
            else:
                add(plan._other_leaf(host, r[1], r[2], r[3], r[4], r[5], path))
        sample = plan.assemble(leaves)
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as exc:
        raise _damaged(path, f"{type(exc).__name__}: {exc}") from None
    if values:  # stacked inline scalars became host tensors: they go over too
        base = dev.untyped_storage().data_ptr()
        sample = _map_tensors(sample, lambda t: t if t.untyped_storage().data_ptr() == base else stage.move(t))
    return sample


def _map_tensors(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    tx = type(x)
    if tx is torch.Tensor or isinstance(x, torch.Tensor):
        return fn(x)
    if tx is dict or tx is collections.OrderedDict:
        return tx((k, _map_tensors(v, fn)) for k, v in x.items())
    if tx is list:
        return [_map_tensors(v, fn) for v in x]
    if tx is tuple:
        return tuple(_map_tensors(v, fn) for v in x)
    if tx in _treetensor_types():
        return tx({k: _map_tensors(v, fn) for k, v in x.items()})
    return x


def to_device(obj: Any, device: str) -> Any:
    """Move every CPU tensor of ``obj`` (a batch a collate_fn of the user's made) to ``device``."""
    dev = torch.device(device)
    return _map_tensors(obj, lambda t: t.to(dev) if t.device.type == "cpu" and dev.type != "cpu" else t)


def arrive(item: Any, device: str) -> Any:
    """On the trainer's thread, as the DataLoader hands ``item`` over: the sample on ``device``."""
    if type(item) is DeviceItem:
        return item.finish()
    return to_device(item, device)
