"""Slots on their way to an accelerator: rings page-locked in place, and slots given back to their
worker only once the device copies that may read them are done.

This is the CPU-side logic; the device itself is an ``Accelerator`` (``cuda.CudaAccelerator`` in a
process that can use CUDA). Tests substitute one of their own (``use``), so that registration
bookkeeping, refusals and deferred releases are exercised without a GPU.

Per process (a trainer that maps rings):

- **Registration.** Once the process uses the accelerator, each ring it maps is registered once,
  whole (one range; pre-faulted first), and unregistered before it is unmapped. So the registered
  bytes never exceed the mapped rings, which the loaders' and datasets' slot budgets bound
  (``pinned_bytes``). One-off segments (outliers, fallbacks) are never registered: registering
  costs about 0.1 s per GB, too much for memory used once. A refusal (the memory to lock, a
  platform that cannot register host memory) disables pinning in the process with one
  ``SlotPinningWarning`` naming the likely cause and the fix; samples then take the unpinned path,
  as before. ``TORCH_STORAGE_LOADER_PIN_SLOTS=0`` turns pinning off.
- **Deferred release.** Torch tracks in-flight asynchronous copies only for memory from its own
  pinned allocator. A slot of a registered ring whose last view is dropped may still be read by a
  copy queued on the GPU (``.to("cuda:1", non_blocking=True)``, on any device): its release records
  an event on the releasing thread's current stream of every device with a context, and a thread
  (``tsl-slot-release``) gives the slot back once they completed (copies to ``device=`` record
  theirs after the copy, on their device). Work queued on other streams is not covered: whoever
  copies on a stream of their own makes the current stream wait for it
  (``torch.cuda.current_stream().wait_stream(s)``) before dropping the last view.
- **Devices.** Every call runs on a device that already has a context (the trainer's), chosen by
  the GPU path: the threads it starts (release, ring reaper, a loader's receiving thread) never
  call the GPU on their own current device (0), which would create a context there: under DDP,
  every rank would hold one on GPU 0.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import mmap
import os
import resource
import threading
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

from .._proc import after_fork_in_child, signal_safe_condition
from .._shm.segments import _human
from ..errors import PinRefused, SlotPinningWarning

__all__ = ["Accelerator", "Event", "accelerator", "defer", "pin", "pinned_bytes", "unpin", "use"]

logger = logging.getLogger("torch_storage_loader")

ENV_PIN = "TORCH_STORAGE_LOADER_PIN_SLOTS"
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; Python 3.12 names it
_IDLE_S = 0.5  # the release thread lingers this long for more work, then exits


class Event(Protocol):
    def synchronize(self) -> None:
        """Return once the work queued before the event is done."""


class Accelerator(Protocol):
    """What the GPU path needs from a device runtime (``cuda.CudaAccelerator`` is the real one).

    Calls run on the calling thread's current device, which creates a context there if it had
    none: the GPU path makes each call inside ``on_device`` of a device that has one (the
    trainer's), never on the current device of a thread of its own (0, for a fresh thread).
    """

    name: str

    def devices_in_use(self) -> list[int]:
        """The devices with a context in this process, ascending (asking creates none)."""

    def current_device(self) -> int:
        """The calling thread's current device."""

    def device_count(self) -> int:
        """How many devices this process sees."""

    def on_device(self, index: int) -> AbstractContextManager:
        """Inside, the calling thread's current device is ``index``."""

    def register(self, address: int, size: int) -> None:
        """Page-lock ``size`` bytes at ``address`` in place; raise ``PinRefused`` if refused."""

    def unregister(self, address: int) -> None: ...

    def sees_pinned(self, address: int) -> bool:
        """Whether the framework reports memory at ``address`` as pinned (checked once)."""

    def record_event(self) -> Event:
        """An event after the work queued so far on the current device's current stream."""

    def handles(self, device: Any) -> bool:
        """Whether ``device=`` datasets may target ``device`` (a ``torch.device``)."""

    def stage(self, device: Any) -> Any:
        """A context manager for one sample's copies to ``device``, issued on a side stream: its
        value has ``copy(host_u8, path)`` (one copy of a 1-D uint8 array; raises
        ``SampleTooLargeForDeviceError``), ``move(cpu_tensor)``, ``owned`` (what it allocated),
        ``device`` and ``index`` (where they go) and, after the block, ``event`` (recorded after
        the copies, on that device)."""

    def current_stream(self, device: Any) -> Any:
        """The calling thread's current stream on ``device``: ``wait_event(event)`` makes the
        work it queues next wait for ``event``."""

    def record_stream(self, tensor: Any, stream: Any) -> None:
        """``tensor``'s memory is not reused before the work queued on ``stream`` so far is done."""


# --------------------------------------------------------------------------- the process's state
class _State:
    def __init__(self, backend: Accelerator | None = None) -> None:
        self.lock = threading.Lock()
        self.backend = backend
        self.resolved = backend is not None
        self.disabled = os.environ.get(ENV_PIN, "").strip().lower() in ("0", "false", "no", "off")
        self.checked = False  # the first registration was checked against the framework's view
        self.registered: dict[int, tuple[int, int]] = {}  # address -> (bytes, the device it was registered on)
        self.releases = ReleaseQueue()


def accelerator() -> Accelerator | None:
    """This process's accelerator: the one given to ``use``, else CUDA where torch has it, else None."""
    st = _state
    if not st.resolved:
        with st.lock:
            if not st.resolved:
                st.backend = _default_backend()
                st.resolved = True
    return st.backend


def _default_backend() -> Accelerator | None:
    import torch

    if not torch.cuda.is_available():
        return None
    from .cuda import CudaAccelerator

    return CudaAccelerator()


def _cuda_initialized() -> bool:
    import torch

    return torch.cuda.is_initialized()


def use(backend: Accelerator | None) -> Accelerator | None:
    """Use ``backend`` in this process from now on (tests); returns the one used before.

    Call it while no ring is mapped: registrations and pending releases belong to their backend.
    """
    global _state
    before = _state.backend if _state.resolved else None
    _state.releases.drain()
    _state = _State(backend)
    if backend is None:
        _state.resolved = False
    return before


def pinned_bytes() -> int:
    """Bytes of shared memory currently registered with the accelerator in this process."""
    return sum(n for n, _ in _state.registered.values())


# ------------------------------------------------------------------------------ registration
def may_pin() -> bool:
    """Whether ``pin`` could register a ring now: what it checks before asking the driver (cheap)."""
    st = _state
    return not st.disabled and (st.resolved or _cuda_initialized())


def pin(ring: Any) -> bool | None:
    """Register ``ring`` (a receiver's mapped ring: ``mm``, ``address``, ``nbytes``) if this process
    uses the accelerator: True once registered, False if it never will be, None to ask again later.

    Registered on the calling thread's current device if it has a context, else on the first device
    that has one (the trainer's: the calling thread may be one of the library's, whose current
    device is 0). Registered memory is page-locked for every device; the device is the context the
    call runs in, and is kept to unregister the ring in the same one."""
    st = _state
    if st.disabled:
        return False
    if not st.resolved and not _cuda_initialized():
        return None  # not asking torch.cuda.is_available() (it starts CUDA's driver) in a process without CUDA
    backend = accelerator()
    if backend is None:
        return False
    devices = backend.devices_in_use()
    if not devices:
        return None  # the process may start using it later: the next reference asks again
    current = backend.current_device()
    device = current if current in devices else devices[0]
    try:
        ring.mm.madvise(_MADV_POPULATE_WRITE)  # fault every page in now, in one call
    except (OSError, ValueError):
        pass  # an older kernel: registration faults them in itself
    try:
        with backend.on_device(device):
            backend.register(ring.address, ring.nbytes)
    except PinRefused as exc:
        _refused(st, ring.nbytes, str(exc))
        return False
    with st.lock:
        st.registered[ring.address] = (ring.nbytes, device)
        first = not st.checked
        st.checked = True
    if first:
        with backend.on_device(device):
            seen = backend.sees_pinned(ring.address + ring.nbytes // 2)
        if not seen:
            _unregister(st, backend, ring.address)
            st.disabled = True
            _warn(
                f"{backend.name} accepted a shared-memory ring, but torch does not report it as pinned "
                "(is_pinned() is False): this torch checks pinned memory another way. Slots are not pinned "
                f"in this process (copies to the GPU go through torch's pin thread); set {ENV_PIN}=0 to not try"
            )
            return False
    return True


def unpin(ring: Any) -> None:
    """Unregister ``ring`` (before it is unmapped)."""
    st = _state
    backend = st.backend
    if backend is not None and ring.address in st.registered:
        _unregister(st, backend, ring.address)


def _unregister(st: _State, backend: Accelerator, address: int) -> None:
    """Unregister ``address`` in the context it was registered in (on whichever thread calls it)."""
    with st.lock:
        entry = st.registered.pop(address, None)
    if entry is None:
        return
    try:
        with backend.on_device(entry[1]):
            backend.unregister(address)
    except PinRefused as exc:  # the memory stays locked until the process exits; nothing else breaks
        logger.warning("could not unregister a shared-memory ring from %s: %s", backend.name, exc)


def _refused(st: _State, nbytes: int, why: str) -> None:
    st.disabled = True
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else _human(soft)
    _warn(
        f"could not page-lock a shared-memory ring of {_human(nbytes)} in place for copies to the GPU "
        f"({why}). The NVIDIA driver locks the pages without charging RLIMIT_MEMLOCK; what refuses it is "
        "usually the memory it would lock (free RAM, the container's or cgroup's memory limit: shared "
        "memory counts against it), or a platform that cannot register host memory (WSL, some virtual "
        f"GPUs); ulimit -l ({limit} here) matters only where another driver charges it. Samples reach the "
        "GPU the slower way (torch's pin thread copies them into pinned memory; device= copies pageable "
        "memory). To fix: lock less (a lower max_shm_bytes or slots_per_worker), give the machine or "
        f"container more memory, or set {ENV_PIN}=0 to not try"
    )


def _warn(message: str) -> None:
    try:
        warnings.warn(message, SlotPinningWarning, stacklevel=3)
    except SlotPinningWarning:
        # Warnings are errors here, and this may run in the DataLoader's pin thread, where raising
        # would stop the loader: say it loudly instead, and carry on unpinned.
        logger.error("%s", message)


# --------------------------------------------------------------------------- deferred release
def defer(callback: Callable[[], None], event: Event | None = None, device: int | None = None) -> None:
    """Run ``callback`` once the GPU is past the copies that may read a slot: ``event`` (recorded on
    ``device``), or by default the work queued so far on the current stream of every device with a
    context: a slot's views may have been copied to any of them (to cuda:1 while cuda:0 is current)."""
    st = _state
    backend = st.backend
    if backend is None:
        callback()
        return
    if event is not None:
        events = [(device, event)]
    else:
        try:
            events = []
            for d in backend.devices_in_use():
                with backend.on_device(d):
                    events.append((d, backend.record_event()))
        except Exception as exc:  # noqa: BLE001 - the runtime is going away (interpreter exit) or broken
            logger.debug("releasing at once, no event could be recorded: %s", exc)
            events = []
        if not events:
            callback()
            return
    st.releases.put(backend, events, callback)


class ReleaseQueue:
    """Callbacks waiting for their events, run in order by a thread that exits when idle.

    The thread waits for each event on the event's device (a fresh thread's current device is 0:
    waiting there would create a context on a device the trainer may not use)."""

    def __init__(self) -> None:
        self._lock, self._cond = signal_safe_condition()  # entered as ``with self._lock``
        self._pending: collections.deque = collections.deque()
        self._current: tuple | None = None  # the one the thread took from _pending (kept reachable: see fork)
        self._thread: threading.Thread | None = None

    def put(self, backend: Accelerator, events: list[tuple[int | None, Event]], callback: Callable[[], None]) -> None:
        """Run ``callback`` once each ``(device, event)`` of ``events`` completed."""
        with self._lock:
            self._pending.append((backend, events, callback))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tsl-slot-release", daemon=True)
                self._thread.start()
            else:
                self._cond.notify_all()

    def pending(self) -> int:
        """Callbacks not run yet."""
        with self._lock:
            return len(self._pending) + (self._current is not None)

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    self._cond.wait(_IDLE_S)
                    if not self._pending:
                        self._thread = None
                        self._cond.notify_all()
                        return
                item = self._current = self._pending.popleft()
            backend, events, callback = item
            for device, event in events:
                try:
                    with backend.on_device(device) if device is not None else contextlib.nullcontext():
                        event.synchronize()  # sleeps until the GPU is there (the GIL is released meanwhile)
                except Exception as exc:  # noqa: BLE001 - a failed event: the device is gone with what it was copying
                    logger.warning("a slot's copy event failed (%s); releasing the slot", exc)
            try:
                callback()
            except Exception:
                logger.exception("releasing a slot failed")
            finally:
                del backend, events, callback
                with self._lock:
                    self._current = None
                    self._cond.notify_all()
                del item  # the events are destroyed here, outside the lock (each on its own device)

    def drain(self) -> None:
        """Wait until every callback queued so far has run."""
        with self._lock:
            while self._pending or self._current is not None:
                self._cond.wait(0.1)


_state = _State()
_inherited: list[_State] = []  # in a forked child: the parent's states, never freed (see below)


@after_fork_in_child
def _start_clean_in_child() -> None:
    # Registrations and pending events belong to the parent's CUDA context; a child starts clean.
    # The parent's state is kept, never freed: a deliberate leak, one per fork, of memory the child
    # shares copy-on-write. Freeing it would run the destructors of its pending events (and of the
    # one being waited for) in the child, CUDA calls in a forked child of a CUDA process, which fail.
    global _state
    _inherited.append(_state)
    _state = _State()
