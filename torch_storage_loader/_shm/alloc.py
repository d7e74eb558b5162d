"""Where a worker puts a sample's bytes: a slot of its rings, sized and bounded by a policy.

- Rings are sized from the first sample. A sample larger than the slots gets new
  rings with slots at least ``GROWTH`` times larger (so growing episodes regrow a logarithmic
  number of times); the old rings are retired, never closed under a reference still on its way.
- A sample more than ``OUTLIER`` times above every recent sample travels in a segment of its own
  instead of resizing every ring for good.
- Rings whose slots are ``SHRINK`` times larger than every one of the last ``WINDOW`` samples
  are retired and rebuilt smaller: idle oversized memory is given back.
- While every slot is held, rings are added (up to ``max_rings``, within the budget). Once none
  can be added and the consumer holds a ring's worth of samples, references ask the receiver to
  copy the sample into private memory and free the slot at once (``copy``), and one more ring is
  allowed for those copies to cycle through; so a consumer that keeps everything costs private
  memory, not a mapping per sample, and no fallback segments.
- ``budget`` bounds the shared memory of all rings; a sample above it is refused before anything
  is allocated.
"""

from __future__ import annotations

import collections
import functools
import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._format.file import Header, ReadOptions
from .._options import check_option
from ..errors import SampleTooLargeError, StorageError
from . import slots as _slots
from .refs import BytesRef, OneOffRef, SlotRef, plan_key, tree
from .segments import ENV_DIR, ShmSegment, _human, default_shm_budget, shm_dir
from .slots import CTRL, SlotRing, page_round

__all__ = ["FillInfo", "Lease", "PrivateAllocator", "SlotAllocator"]

GROWTH = 2
OUTLIER = 4
SHRINK = 4
WINDOW = 64


@dataclass(frozen=True)
class FillInfo:
    """What the worker did, for stats.

    ``via``: "slot", "fallback" (no slot free: a segment of its own), "oversize" (an outlier in a
    segment of its own) or "local" (private memory, no worker). ``copied``: the receiver copies
    the sample out of shared memory (the consumer keeps every slot).
    """

    via: str
    nbytes: int
    regrew: bool = False
    copied: bool = False

    def count(self, counters: collections.Counter) -> None:
        """Add this fill to ``counters``: the one place ``StorageLoader.stats()`` and
        ``StorageDataset.stats()`` turn fills into counts."""
        counters["loads"] += 1
        counters["bytes"] += self.nbytes
        counters[_COUNTER_OF[self.via]] += 1
        if self.regrew:
            counters["regrows"] += 1
        if self.copied:
            counters["copies"] += 1


_COUNTER_OF = {"slot": "slot_loads", "fallback": "fallbacks", "oversize": "oversize", "local": "local_loads"}


def check_slot_options(*, slots_per_worker: int, max_rings_per_worker: int, max_shm_bytes: int | None) -> None:
    """Validate the slot options ``StorageLoader`` and ``StorageDataset`` share; raises TypeError
    or ValueError naming the option."""
    check_option("slots_per_worker", slots_per_worker, int, least=1)
    check_option("max_rings_per_worker", max_rings_per_worker, int, least=1)
    check_option("max_shm_bytes", max_shm_bytes, int, least=1, none="for half the shared-memory filesystem")


class Lease:
    """A writable place for one sample: fill ``view``, then ``commit(header)`` for the payload to
    send (a small reference that unpickles into the sample), or ``abort()`` to give it back."""

    def __init__(self, view: memoryview, info: FillInfo, path: str, opts: ReadOptions) -> None:
        self.view, self.info, self.path, self.opts = view, info, path, opts

    def commit(self, header: Header) -> Any:
        """Check that the sample can be built from what was read (``Plan.check``), then hand out its
        payload: nothing the file holds may fail where the payload is received. A refused sample's
        place is given back, and its ``StorageError`` raised here, in the worker, under ``on_error``."""
        error = _refusal(self._data(), header, self.opts, self.path)
        if error is not None:
            self.abort()
            raise error
        return self._commit(header)

    def _commit(self, header: Header) -> Any:
        raise NotImplementedError

    def _data(self) -> memoryview:
        """The bytes read (``view`` itself is released by then)."""
        raise NotImplementedError

    def abort(self) -> None:
        self.view.release()


def _refusal(view: memoryview, header: Header, opts: ReadOptions, path: str) -> Exception | None:
    """Why the sample in ``view`` cannot be built (None: it can). Returned, not raised, with no
    traceback or context: those would keep views of ``view`` (and so the slot's mapping) alive."""
    size = header.data_size
    u8 = np.frombuffer(view[:size], np.uint8) if size else np.empty(0, np.uint8)
    try:
        key, consts = plan_key(header, opts)
        tree().plan_for(key).bind(consts).check(u8, path)
    except StorageError as exc:
        exc.__traceback__ = exc.__context__ = exc.__cause__ = None
        return exc
    return None


class _EmptyLease(Lease):
    def _data(self) -> memoryview:
        return memoryview(bytearray())

    def _commit(self, header: Header) -> BytesRef:
        return BytesRef(header, bytearray(), self.path, self.opts)


class _SlotLease(Lease):
    def __init__(
        self,
        ring: SlotRing,
        slot: tuple[int, int],
        nbytes: int,
        info: FillInfo,
        path: str,
        opts: ReadOptions,
        watch: bool,
    ) -> None:
        super().__init__(ring.view(slot[0], nbytes), info, path, opts)
        self.ring, self.slot, self.watch, self.nbytes = ring, slot, watch, nbytes

    def _data(self) -> memoryview:
        return self.ring.view(self.slot[0], self.nbytes)

    def _commit(self, header: Header) -> SlotRef:
        self.view.release()
        ring = self.ring
        ref = SlotRef(
            ring.uid,
            self.slot[0],
            self.slot[1],
            ring.slot_size,
            header,
            self.path,
            self.opts,
            segment=None if ring.segment_sent else ring.segment,
            copy=self.info.copied,
            watch=self.watch,
        )
        ring.segment_sent = True
        ring.sent += 1
        return ref

    def abort(self) -> None:
        self.view.release()
        self.ring.unacquire(self.slot[0])


class _SegmentLease(Lease):
    def __init__(self, segment: ShmSegment, nbytes: int, info: FillInfo, path: str, opts: ReadOptions) -> None:
        super().__init__(memoryview(segment.mm)[:nbytes], info, path, opts)
        self.segment, self.nbytes = segment, nbytes

    def _data(self) -> memoryview:
        return memoryview(self.segment.mm)[: self.nbytes]

    def _commit(self, header: Header) -> OneOffRef:
        self.view.release()
        return OneOffRef(header, self.segment, self.path, self.opts, copy=self.info.copied)

    def abort(self) -> None:
        self.view.release()
        self.segment.close()


class SlotAllocator:
    """A worker's rings of ``n_slots`` slots, and the policy above."""

    def __init__(self, n_slots: int, *, max_rings: int = 8, budget: int | None = None, watch: bool = False) -> None:
        self.n_slots = n_slots
        self.max_rings = max_rings
        self.budget = default_shm_budget() if budget is None else budget
        self.watch = watch  # receivers forget our rings when this process exits (nobody else tells them)
        self.slot_size = 0
        self.rings: list[SlotRing] = []
        self.retired: list[SlotRing] = []
        self._recent: collections.deque[int] = collections.deque(maxlen=WINDOW)

    def held(self) -> int:
        """Shared memory held by rings, live and retired."""
        return sum(r.nbytes for r in self.rings) + sum(r.nbytes for r in self.retired)

    def lease(self, nbytes: int, path: str, opts: ReadOptions) -> Lease:
        if not nbytes:
            return _EmptyLease(memoryview(bytearray()), FillInfo("slot", 0), path, opts)
        if nbytes > self.budget:
            where = shm_dir()
            raise SampleTooLargeError(
                f"{path}: the sample needs {_human(nbytes)} of shared memory, more than one worker's share "
                f"of max_shm_bytes ({_human(self.budget)}; the default is half the size of {where}). If the "
                f"sample is genuine, raise max_shm_bytes, give {where} more room (docker run --shm-size=<size>) "
                f"or point ${ENV_DIR} at a larger tmpfs; if not, the file's header is damaged",
                path=path,
                needed=nbytes,
                budget=self.budget,
                directory=where,
            )
        self._tidy()
        typical = max(self._recent, default=0)
        self._recent.append(nbytes)
        regrew = False
        if self.rings and nbytes > self.slot_size:
            if nbytes > OUTLIER * max(self.slot_size, typical):
                return self._one_off(nbytes, path, opts, "oversize")
            self._retire_rings()
            self.slot_size = page_round(max(nbytes, GROWTH * self.slot_size))
            regrew = True
        elif self.rings and len(self._recent) == WINDOW and self.slot_size > SHRINK * page_round(max(self._recent)):
            self._retire_rings()
            self.slot_size = page_round(max(self._recent))
            regrew = True
        if not self.rings:
            self.slot_size = self.slot_size or page_round(nbytes)
        for ring in self.rings:
            slot = ring.acquire()
            if slot is not None:
                break
        else:
            ring = self._add_ring()
            slot = ring.acquire() if ring is not None else None
            regrew = regrew or (ring is not None and len(self.rings) > 1)
        if slot is None:
            return self._one_off(nbytes, path, opts, "fallback", copy=True, regrew=regrew)
        copy = self._short_of_slots()
        return _SlotLease(ring, slot, nbytes, FillInfo("slot", nbytes, regrew, copy), path, opts, self.watch)

    def find(self, uid: str) -> SlotRing | None:
        return next((r for r in self.rings + self.retired if r.uid == uid), None)

    def close(self) -> None:
        for ring in self.rings + self.retired:
            ring.close()
        self.rings, self.retired = [], []

    # -------------------------------------------------------------------------------- internals
    def _one_off(
        self, nbytes: int, path: str, opts: ReadOptions, via: str, *, copy: bool = False, regrew: bool = False
    ) -> Lease:
        purpose = (
            "a sample far larger than the slots"
            if via == "oversize"
            else "a fallback segment (every slot is still leased)"
        )
        segment = ShmSegment(nbytes, purpose=purpose)
        return _SegmentLease(segment, nbytes, FillInfo(via, nbytes, regrew, copy), path, opts)

    def _ring_fits(self) -> int:
        """How many slots a new ring may have within the budget (0: none)."""
        room = self.budget - self.held() - CTRL
        return max(0, min(self.n_slots, room // self.slot_size))

    def _add_ring(self) -> SlotRing | None:
        # One ring beyond max_rings once the consumer keeps what it gets: its slots only ever
        # hold copies, which free them on arrival, so they keep cycling (no fallbacks).
        if len(self.rings) >= self.max_rings + self._keeping():
            return None
        n = self._ring_fits()
        if not n:
            return None
        self.rings.append(SlotRing(n, self.slot_size))
        return self.rings[-1]

    def _keeping(self, taken: int = 0) -> bool:
        """The consumer holds (received and kept) at least a ring's worth of samples; ``taken``:
        slots leased but not yet sent."""
        held = sum(r.n_slots - r.free_slots() - r.in_flight() for r in self.rings) - taken
        return held >= self.n_slots

    def _short_of_slots(self) -> bool:
        """Rings reached ``max_rings`` (or the budget) and the consumer keeps what it gets: from
        then on samples arrive as copies that free their slot on arrival. A consumer that drops
        what it gets (holding a sample or two) never copies."""
        if len(self.rings) < self.max_rings and self._ring_fits():
            return False
        return self._keeping(taken=1)

    def _retire_rings(self) -> None:
        for ring in self.rings:
            ring.retire()
        self.retired += self.rings
        self.rings = []

    def _tidy(self) -> None:
        for ring in list(self.retired):
            if ring.done():
                self.retired.remove(ring)
                ring.close()
            else:
                ring.trim()


class _PrivateLease(Lease):
    def __init__(self, nbytes: int, path: str, opts: ReadOptions) -> None:
        self.buf = mmap.mmap(-1, nbytes) if nbytes else bytearray()
        super().__init__(memoryview(self.buf), FillInfo("local", nbytes), path, opts)

    def _data(self) -> memoryview:
        return memoryview(self.buf)

    def _commit(self, header: Header) -> Any:
        self.view.release()
        if self.opts.device is not None:  # a _gpu.device.DeviceItem; the buffer lives until the copy is done
            buf = self.buf
            host = np.frombuffer(buf, np.uint8) if len(buf) else np.empty(0, np.uint8)
            return _slots.gpu.deliver(
                tree().Plan(header, self.opts), host, self.path, self.opts.device, functools.partial(_keep, buf)
            )
        return tree().build(header, self.buf, self.opts, path=self.path)


def _keep(buf: Any) -> None:
    """A deferred release's callback that only held ``buf`` alive until the copy reading it was done."""


class PrivateAllocator:
    """For the consuming process itself (``num_workers=0``): private buffers, no slots.

    ``budget`` bounds one sample's private memory as ``max_shm_bytes`` bounds the workers' shared
    memory (None: no bound), so a header cannot make the trainer allocate what it declares."""

    def __init__(self, budget: int | None = None) -> None:
        self.budget = budget

    def lease(self, nbytes: int, path: str, opts: ReadOptions) -> Lease:
        if self.budget is not None and nbytes > self.budget:
            raise SampleTooLargeError(
                f"{path}: the sample needs {_human(nbytes)} of memory, more than max_shm_bytes "
                f"({_human(self.budget)}; the default is half the size of {shm_dir()}), which bounds a "
                "sample read without workers too. If the sample is genuine, raise max_shm_bytes; if not, "
                "the file's header is damaged",
                path=path,
                needed=nbytes,
                budget=self.budget,
                directory=shm_dir(),
            )
        try:
            return _PrivateLease(nbytes, path, opts)
        except (MemoryError, OSError) as exc:  # within the bound, still more than this machine has
            raise SampleTooLargeError(
                f"{path}: the sample needs {_human(nbytes)} of memory, which this process cannot allocate "
                f"({type(exc).__name__}); lower max_shm_bytes to refuse such samples before they are read",
                path=path,
                needed=nbytes,
                budget=self.budget or 0,
                directory=shm_dir(),
            ) from None

    def find(self, uid: str) -> None:
        return None

    def close(self) -> None:
        pass
