"""One number in shared memory that one process writes and others read, with no message.

The trainer's delivery ledger says through one how many iterations of its DataLoader it has ended,
to workers that wait on their source (a Redis stream, an object-store prefix) in a loop and could
not also wait on a pipe. An aligned 8-byte word: a reader sees the old value or the new, never half.
"""

from __future__ import annotations

from typing import Any

from .segments import ShmSegment

__all__ = ["SharedWord"]


class SharedWord:
    """An int64 in its own segment, 0 at first; picklable (sends the segment's descriptor)."""

    def __init__(self, *, purpose: str, segment: ShmSegment | None = None) -> None:
        self.segment = segment or ShmSegment(8, purpose=purpose)
        self._word = memoryview(self.segment.mm).cast("q")

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (self.segment,)

    @property
    def value(self) -> int:
        return self._word[0]

    @value.setter
    def value(self, value: int) -> None:
        self._word[0] = value

    def close(self) -> None:
        self._word.release()
        self.segment.close()


def _rebuild(segment: ShmSegment) -> SharedWord:
    return SharedWord(purpose="", segment=segment)
