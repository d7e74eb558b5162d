"""A ``StorageDataset``'s streaming side (a queue, directory, prefix or Redis stream), at least once.

Every handle taken is settled once: acknowledged once the trainer has its sample, failed, or given
back. Under DataLoader workers each worker reports what it takes to the trainer's ledger
(``ledger``), which settles it, so a killed worker loses nothing and an early stop gives back what
was not delivered; a ``fed_from_trainer`` source is taken from by the trainer, which feeds the
workers (``feed``). Without workers the trainer settles its handles as it loads them.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from typing import Any

from .._sources import Source
from ..storage import Storage
from .items import SKIP, Reader
from .ledger import LedgerRef, LedgerWriter

__all__ = ["Stream"]


class Stream:
    """One streaming dataset's delivery in each of its copies: the ledger its workers write to, and
    what its source refused in this process that the trainer's counts have."""

    def __init__(self, source: Source, reader: Reader) -> None:
        self.source, self.reader = source, reader
        self.ledger: LedgerRef | None = None  # while a DataLoader starts its workers: see hooks
        self._writer: LedgerWriter | None = None  # this worker's end of it
        self._refused_sent = 0  # of the source's refusals in this process, those added to the counts
        self._counting_pid = 0  # the process _refused_sent was last set up for

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_writer": None, "_refused_sent": 0}  # a source unpickles with no refusals yet

    def unsent_refusals(self) -> int:
        """Refusals of this process's source not yet reported (a worker adds them to ``WorkerCounts``)."""
        return getattr(self.source, "refused", 0) - self._refused_sent

    def _report_refusals(self) -> None:
        """In a DataLoader worker (not the trainer): add what the source refused since the last report to the counts."""
        refused = self.unsent_refusals()
        if refused and self.reader.in_worker:
            self._refused_sent += refused
            self.reader.worker_counts.add(self.reader.wid, refused=refused)

    def iterate(self, rank: int, world: int, wid: int, num_workers: int, family: str) -> Iterator[Any]:
        """Worker ``wid``'s handles on rank ``rank`` of trainer ``family`` (``num_workers``: 0 in the trainer), loaded."""
        writer = None
        if num_workers:
            if self._counting_pid != os.getpid():  # what the source refused before is the trainer's to report
                self._counting_pid, self._refused_sent = os.getpid(), getattr(self.source, "refused", 0)
            writer = self._writer_for(self.reader.wid)
        nw = num_workers or 1
        return self.reader.run(num_workers, functools.partial(self._items, writer, rank * nw + wid, world * nw, family))

    def _writer_for(self, wid: int) -> LedgerWriter | None:
        """This worker's ledger writer, restarted for each new iteration (epoch) of the worker."""
        ref = self.ledger
        if ref is None:
            return None
        if self._writer is None or self._writer.ledger_id != ref.id:
            self._writer = LedgerWriter(ref, wid)
        self._writer.restart()
        return self._writer

    def _items(self, writer: LedgerWriter | None, shard: int, shards: int, family: str) -> Iterator[Any]:
        size, per_item = self.reader.opts.batch_size or 1, self.reader.per_item
        fed = writer is not None and writer.feed is not None
        if fed:  # the trainer takes, and feeds (see feed)
            assert writer is not None
            pairs = writer.fed()
        else:  # a worker leaves an iteration the trainer ended while the source waits for more
            stop = writer.iteration_over if writer is not None else None
            pairs = self.source.iterate(shard, shards, family=family, stop=stop)
        made = 0  # samples (or dataset-side batches) yielded; DataLoader item = made // per_item
        group: list[tuple[Any, Storage]] = []
        # Fed: handles read since the last mark. The trainer's feeder holds each handle it gave as
        # given until an item that holds it reaches the trainer, so a worker killed at any point
        # loses nothing; the worker marks how far it has read once per group (before it loads it),
        # and whatever ends the iteration (the ``finally``), so that the item that raised and the
        # last iteration's reads are known to hold what they read.
        unmarked = False
        try:
            for token, storage in pairs:
                group.append((token, storage))
                if fed:
                    unmarked = True
                elif writer is not None:
                    # Each as it is taken, never once per group: a worker that waits for the rest of
                    # its group (a slow stream) must not hold handles the trainer cannot see (a
                    # claimed file).
                    writer.took(made // per_item, [token])
                if len(group) < size:
                    continue
                if unmarked:
                    self._mark(writer, made // per_item)
                    unmarked = False
                self._report_refusals()
                item = self._load(group, writer, made // per_item)
                group = []
                if item is not SKIP:
                    made += 1
                    yield item
                if fed and made % per_item == 0:  # (resumed after a yield: torch sent the item)
                    assert writer is not None
                    writer.finished()
            if unmarked:  # a last, short group, kept or dropped
                self._mark(writer, made // per_item)
                unmarked = False
            left = writer is not None and writer.iteration_over()  # (its handles go back: the trainer's)
            if group and not self.reader.opts.drop_last and not left:
                item = self._load(group, writer, made // per_item)
                group = []
                if item is not SKIP:
                    yield item
        finally:
            pairs.close()  # type: ignore[attr-defined]  # a stream's pairs come from a generator
            if unmarked:  # the feed raised mid-group: the trainer gets this worker's error next
                self._mark(writer, made // per_item)
            if group and writer is None:
                self.source.give_back(
                    [t for t, _ in group]
                )  # taken, never delivered (with a ledger, the trainer does this)
            self._report_refusals()  # those after the last sample, or with none at all

    @staticmethod
    def _mark(writer: LedgerWriter | None, item: int) -> None:
        """A fed worker marks that what it read so far is in ``item`` or earlier."""
        assert writer is not None  # only a fed worker has unmarked reads
        writer.reached(item)

    def _load(self, group: list[tuple[Any, Storage]], writer: LedgerWriter | None, item: int) -> Any:
        """``group`` loaded, its tokens that failed settled as failed; without a ledger (in the trainer)
        those delivered are acknowledged as loaded."""
        tokens = [t for t, _ in group]

        def failed(bad: list[Any]) -> None:
            if writer is None or writer.feed is None:
                self.source.fail(bad)
            if writer is not None:  # (fed: the trainer took them, and fails them)
                writer.dropped(item, bad)

        dropped: list[int] = []  # positions skipped (on_error="skip"): settled as failed, never delivered
        try:
            out = self.reader.load([s for _, s in group], dropped)
        except Exception as exc:  # on_error="raise" ("skip" returns SKIP)
            bad = self.reader.at_fault([s for _, s in group], exc)
            if bad:
                failed([tokens[i] for i in bad])
            group[:] = [g for i, g in enumerate(group) if i not in bad]  # the rest go back: sound files
            raise
        # Anything else (KeyboardInterrupt, the worker stopping) leaves them taken: they go back.
        if dropped:
            failed([tokens[i] for i in dropped])
        if out is not SKIP and writer is None:
            self.source.ack([t for i, t in enumerate(tokens) if i not in dropped])
        return out
