"""How far each DataLoader worker has read the feed its trainer writes to it, in shared memory.

A worker fed by its trainer (``_dataloader.feed``) reads handles off its feed in order, and each
DataLoader item it makes takes the next ones. Before it loads an item it writes here how many
handles it has read so far (its *mark* for that item); the trainer reads the mark when the item
reaches it, and so knows which of the handles it gave that worker the item holds, with no message
per item. A word per item, in a ring per worker: a worker is never more items ahead of the trainer
than the DataLoader's prefetch allows, so a ring a little longer than that is never overwritten
before it is read. Two more words per worker hold its last mark of the current and of the previous
iteration (persistent workers start one per epoch), for what an iteration read and never delivered,
and two where it last waited for more, having read all it was given, and how far the items it
finished went then (when the source ended, the trainer says so once nothing it gave can still come
back: an item it made may yet fail on its way into the trainer, and its handles go back).

Aligned 8-byte words, each written by one process only: a reader sees the old value or the new,
and sees the new once it has received the item the worker sent after writing it.
"""

from __future__ import annotations

from typing import Any

from .segments import ShmSegment

__all__ = ["FeedMarks"]

# Per worker: its last mark by the parity of its iteration (0, 1), where it waits, how far what it read
# is in items it finished (sent or skipped), its ring.
_WAITING, _COMPLETE, _RING = 2, 3, 4


class FeedMarks:
    """``workers`` rows of a ring of ``ring`` marks each; picklable (sends the segment's descriptor)."""

    def __init__(self, workers: int, ring: int, *, segment: ShmSegment | None = None) -> None:
        if workers < 1 or ring < 1:
            raise ValueError(f"{workers=} and {ring=} must be >= 1")
        self.workers, self.ring = workers, ring
        self._row = _RING + ring
        self.segment = segment or ShmSegment(workers * self._row * 8, purpose="the delivery ledger's feed marks")
        self._words = memoryview(self.segment.mm).cast("q")

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (self.workers, self.ring, self.segment)

    def reached(self, worker: int, iteration: int, item: int, position: int) -> None:
        """In worker ``worker``: its item ``item`` of iteration ``iteration`` ends at feed position ``position``."""
        row = worker * self._row
        self._words[row + _RING + item % self.ring] = position
        self._words[row + iteration % 2] = position

    def item(self, worker: int, item: int) -> int:
        """In the trainer: where worker ``worker``'s item ``item`` ends (read once the item arrived)."""
        return self._words[worker * self._row + _RING + item % self.ring]

    def wait_at(self, worker: int, position: int, complete: int) -> None:
        """In worker ``worker``: it read all it was given up to ``position`` and waits for more; what
        it read up to ``complete`` is in items it finished (the rest, in the item it is making)."""
        row = worker * self._row
        self._words[row + _COMPLETE] = complete  # first: whoever sees the new position sees it too
        self._words[row + _WAITING] = position

    def waiting_at(self, worker: int) -> tuple[int, int]:
        """In the trainer: where worker ``worker`` last waited for more (stale once it reads on), and
        how far what it had read then was in items it finished."""
        row = worker * self._row
        position = self._words[row + _WAITING]
        return position, self._words[row + _COMPLETE]

    def latest(self, worker: int) -> int:
        """In the trainer: worker ``worker``'s last mark so far (marks only grow)."""
        row = worker * self._row
        return max(self._words[row], self._words[row + 1])

    def last(self, worker: int, iteration: int) -> int:
        """In the trainer: worker ``worker``'s last mark in iteration ``iteration`` (read once that
        iteration is over for it: torch's workers acknowledge a new one only then)."""
        return self._words[worker * self._row + iteration % 2]

    def close(self) -> None:
        self._words.release()
        self.segment.close()


def _rebuild(workers: int, ring: int, segment: ShmSegment) -> FeedMarks:
    return FeedMarks(workers, ring, segment=segment)
