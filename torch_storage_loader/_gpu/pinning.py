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
  costs about 0.1 s per GB, too much for memory used once. A refusal (``RLIMIT_MEMLOCK``, a
  container) disables pinning in the process with one ``SlotPinningWarning`` naming the limit and
  the fix; samples then take the unpinned path, as before. ``TORCH_STORAGE_LOADER_PIN_SLOTS=0``
  turns pinning off.
- **Deferred release.** Torch tracks in-flight asynchronous copies only for memory from its own
  pinned allocator. A slot of a registered ring whose last view is dropped may still be read by a
  copy queued on the GPU (``.to("cuda", non_blocking=True)``): its release records an event on the
  releasing thread's current stream, and a thread (``tsl-slot-release``) gives the slot back once
  that event completed (copies to ``device=`` record theirs after the copy). Work queued on other
  streams is not covered: whoever copies on a stream of their own makes the current stream wait
  for it (``torch.cuda.current_stream().wait_stream(s)``) before dropping the last view.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import resource
import threading
import warnings
from collections.abc import Callable
from typing import Any, Protocol

from .._proc import after_fork_in_child
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
    """What the GPU path needs from a device runtime (``cuda.CudaAccelerator`` is the real one)."""

    name: str

    def in_use(self) -> bool:
        """This process uses the accelerator now (registration is attempted only then)."""

    def register(self, address: int, size: int) -> None:
        """Page-lock ``size`` bytes at ``address`` in place; raise ``PinRefused`` if refused."""

    def unregister(self, address: int) -> None: ...

    def sees_pinned(self, address: int) -> bool:
        """Whether the framework reports memory at ``address`` as pinned (checked once)."""

    def record_event(self) -> Event:
        """An event after the work queued so far on the calling thread's current stream."""

    def handles(self, device: Any) -> bool:
        """Whether ``device=`` datasets may target ``device`` (a ``torch.device``)."""

    def stage(self, device: Any) -> Any:
        """A context manager for one sample's copies to ``device``, issued on a side stream: its
        value has ``copy(host_u8, path)`` (one copy of a 1-D uint8 array; raises
        ``SampleTooLargeForDeviceError``), ``move(cpu_tensor)``, ``owned`` (what it allocated) and,
        after the block, ``event`` (recorded after the copies)."""

    def consume(self, owned: list, event: Any, device: Any) -> None:
        """On the consumer's thread: its current stream waits for ``event``; ``owned`` memory is
        not reused before the work that stream queues next is done."""


# --------------------------------------------------------------------------- the process's state
class _State:
    def __init__(self, backend: Accelerator | None = None) -> None:
        self.lock = threading.Lock()
        self.backend = backend
        self.resolved = backend is not None
        self.disabled = os.environ.get(ENV_PIN, "").strip().lower() in ("0", "false", "no", "off")
        self.checked = False  # the first registration was checked against the framework's view
        self.registered: dict[int, int] = {}  # address -> bytes
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
    return sum(_state.registered.values())


# ------------------------------------------------------------------------------ registration
def pin(ring: Any) -> bool | None:
    """Register ``ring`` (a receiver's mapped ring: ``mm``, ``address``, ``nbytes``) if this process
    uses the accelerator: True once registered, False if it never will be, None to ask again later."""
    st = _state
    if st.disabled:
        return False
    if not st.resolved and not _cuda_initialized():
        return None  # not asking torch.cuda.is_available() (it starts CUDA's driver) in a process without CUDA
    backend = accelerator()
    if backend is None:
        return False
    if not backend.in_use():
        return None  # the process may start using it later: the next reference asks again
    try:
        ring.mm.madvise(_MADV_POPULATE_WRITE)  # fault every page in now, in one call
    except (OSError, ValueError):
        pass  # an older kernel: registration faults them in itself
    try:
        backend.register(ring.address, ring.nbytes)
    except PinRefused as exc:
        _refused(st, ring.nbytes, str(exc))
        return False
    with st.lock:
        st.registered[ring.address] = ring.nbytes
        first = not st.checked
        st.checked = True
    if first and not backend.sees_pinned(ring.address + ring.nbytes // 2):
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
    with st.lock:
        st.registered.pop(address, None)
    try:
        backend.unregister(address)
    except PinRefused as exc:  # the memory stays locked until the process exits; nothing else breaks
        logger.warning("could not unregister a shared-memory ring from %s: %s", backend.name, exc)


def _refused(st: _State, nbytes: int, why: str) -> None:
    st.disabled = True
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else _human(soft)
    _warn(
        f"could not page-lock a shared-memory ring of {_human(nbytes)} in place for copies to the GPU "
        f"({why}); RLIMIT_MEMLOCK (ulimit -l) is {limit}. Samples reach the GPU the slower way (torch's "
        "pin thread copies them into pinned memory; device= copies pageable memory). To fix: raise the "
        "limit (ulimit -l unlimited; docker run --ulimit memlock=-1; a Kubernetes pod with IPC_LOCK), "
        f"or set {ENV_PIN}=0 to not try"
    )


def _warn(message: str) -> None:
    try:
        warnings.warn(message, SlotPinningWarning, stacklevel=3)
    except SlotPinningWarning:
        # Warnings are errors here, and this may run in the DataLoader's pin thread, where raising
        # would stop the loader: say it loudly instead, and carry on unpinned.
        logger.error("%s", message)


# --------------------------------------------------------------------------- deferred release
def defer(callback: Callable[[], None], event: Event | None = None) -> None:
    """Run ``callback`` once ``event`` completed (default: an event recorded now on the current stream)."""
    st = _state
    backend = st.backend
    if event is None:
        if backend is None:
            callback()
            return
        try:
            event = backend.record_event()
        except Exception as exc:  # noqa: BLE001 - the runtime is going away (interpreter exit) or broken
            logger.debug("releasing at once, no event could be recorded: %s", exc)
            callback()
            return
    st.releases.put(event, callback)


class ReleaseQueue:
    """Callbacks waiting for their events, run in order by a thread that exits when idle."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._pending: collections.deque = collections.deque()
        self._busy = False  # the thread holds one it took from _pending
        self._thread: threading.Thread | None = None

    def put(self, event: Event, callback: Callable[[], None]) -> None:
        with self._cond:
            self._pending.append((event, callback))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tsl-slot-release", daemon=True)
                self._thread.start()
            else:
                self._cond.notify_all()

    def pending(self) -> int:
        """Callbacks not run yet."""
        with self._cond:
            return len(self._pending) + self._busy

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._pending:
                    self._cond.wait(_IDLE_S)
                    if not self._pending:
                        self._thread = None
                        self._cond.notify_all()
                        return
                event, callback = self._pending.popleft()
                self._busy = True
            try:
                event.synchronize()  # sleeps until the GPU is there (the GIL is released meanwhile)
            except Exception as exc:  # noqa: BLE001 - a failed event: the device is gone with what it was copying
                logger.warning("a slot's copy event failed (%s); releasing the slot", exc)
            try:
                callback()
            except Exception:
                logger.exception("releasing a slot failed")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def drain(self) -> None:
        """Wait until every callback queued so far has run."""
        with self._cond:
            while self._pending or self._busy:
                self._cond.wait(0.1)


_state = _State()


@after_fork_in_child
def _start_clean_in_child() -> None:
    # Registrations and pending events belong to the parent's CUDA context; a child starts clean.
    global _state
    _state = _State()
