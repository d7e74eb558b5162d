"""The train loader ``StorageDataModule`` hands Lightning: its checkpointed state covers what the model consumed."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .._optional import require
from . import hooks

if TYPE_CHECKING:
    from torchdata.stateful_dataloader import StatefulDataLoader
else:
    StatefulDataLoader = require("torchdata.stateful_dataloader", "lightning", "StorageDataModule").StatefulDataLoader

__all__ = ["ConsumedStateLoader"]


class ConsumedStateLoader(StatefulDataLoader):  # type: ignore[misc]  # torchdata ships no type information
    """A ``StatefulDataLoader`` whose ``state_dict`` covers the batches the model consumed.

    Lightning fetches one batch ahead of the one it trains on; a plain loader's state would count
    that batch as used, and a run resumed from a mid-epoch checkpoint would skip it. For the same
    reason a streaming source's handles are acknowledged when their batch is consumed, not when
    it is fetched: the batch fetched ahead at ``max_steps`` goes back to the source.
    """

    def __init__(
        self,
        *args: Any,
        epoch_fn: Callable[[], int | None] | None = None,
        confirm_delivery: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.confirm_delivery = confirm_delivery
        self._epoch_fn = epoch_fn
        self._yielded_states: collections.deque[dict[str, Any]] = collections.deque()
        self._consumed_state: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        epoch = self._epoch_fn() if self._epoch_fn is not None else None
        if epoch is not None:
            self.dataset.set_epoch(epoch)  # Lightning calls set_epoch on samplers only
        self._yielded_states.clear()
        self._consumed_state = None
        for batch in super().__iter__():
            self._yielded_states.append(super().state_dict())
            yield batch

    def mark_consumed(self) -> None:
        if self._yielded_states:
            self._consumed_state = self._yielded_states.popleft()
        ledger = getattr(hooks.loader_iterator(self), "_tsl_ledger", None)
        if ledger is not None:
            ledger.consumed()

    def state_dict(self) -> dict[str, Any]:
        return self._consumed_state if self._consumed_state is not None else super().state_dict()
