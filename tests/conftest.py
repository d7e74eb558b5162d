"""Shared fixtures: every test must leave no shared memory, process or thread of ours behind."""

from __future__ import annotations

import gc
import logging
import math
import multiprocessing as mp
import os
import re
import sys
import threading
import time

import numpy as np
import pytest
import torch

LEAK_WAIT_S = 10.0  # DataLoader workers exit, reaper threads unmap, finalizers run: all asynchronously

# Our segments: opened with O_TMPFILE in the shm directory, so a mapping or descriptor of one reads
# "<shm dir>/#<inode> (deleted)"; where a filesystem refuses O_TMPFILE, ``tempfile.mkstemp(prefix="tsl-")``
# unlinked at once, ".../tsl-XXXXXXXX (deleted)" (see ``_shm.segments._open_unnamed``). Unnamed files
# count in /dev/shm and in $TORCH_STORAGE_LOADER_SHM_DIR as it is when the fixture looks (never in /tmp,
# where pytest's own capture files are unnamed too); "tsl-" files in any directory.
_NAMED = re.compile(r"/tsl-[a-z0-9_]{8} \(deleted\)$")
_UNNAMED = re.compile(r"(/.*)/#[0-9]+ \(deleted\)$")


def is_segment(target: str) -> bool:
    """Whether ``target`` (a /proc link target, or the path column of /proc/<pid>/maps) is one of our segments."""
    if _NAMED.search(target):
        return True
    unnamed = _UNNAMED.fullmatch(target)
    if unnamed is None:
        return False
    dirs = {"/dev/shm", os.environ.get("TORCH_STORAGE_LOADER_SHM_DIR", "/dev/shm")}
    return unnamed.group(1) in {os.path.realpath(d) for d in dirs}


def _our_mappings() -> set[str]:
    """Lines of /proc/self/maps that map one of our segments (the address range tells them apart)."""
    with open("/proc/self/maps") as f:
        lines = [line.rstrip("\n") for line in f]
    return {line for line in lines if len(parts := line.split(None, 5)) == 6 and is_segment(parts[5])}


def _our_fds() -> set[str]:
    """'fd -> target' for each open descriptor of one of our segments."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (or the descriptor of the listing itself)
        if is_segment(target):
            out.add(f"{fd} -> {target}")
    return out


def _children() -> set[str]:
    """'pid (command line)' for each live (not zombie) descendant, less the stdlib's long-lived helpers.

    Descendants, not just children: workers started through the forkserver are its children.
    """
    helpers = _helpers()
    parent, state, cmd = {}, {}, {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd[int(pid)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        parent[int(pid)], state[int(pid)] = int(fields[1]), fields[0]
    kids, todo = set(), [os.getpid()]
    while todo:
        p = todo.pop()
        for pid, ppid in parent.items():
            if ppid == p:
                todo.append(pid)
                if pid not in helpers and state[pid] != "Z":
                    kids.add(f"{pid} ({cmd[pid][:200]})")
    return kids


def _helpers() -> set[int]:
    """Long-lived helper processes the stdlib keeps by design (forkserver, resource tracker)."""
    pids = set()
    from multiprocessing import forkserver, resource_tracker

    for obj in (forkserver._forkserver, resource_tracker._resource_tracker):
        pid = getattr(obj, "_forkserver_pid", None) or getattr(obj, "_pid", None)
        if pid:
            pids.add(pid)
    return pids


def _our_threads() -> set[str]:
    return {f"{t.name} (ident {t.ident})" for t in threading.enumerate() if t.name.startswith("tsl-")}


# Where each of our segments this process mapped came from (inode -> test, size, stack), for the leak
# report: a mapping outliving its ShmSegment is held by views gc cannot see (numpy, torch storages).
_origins: dict[int, str] = {}
_current_test = "<no test>"


def _record_origins() -> None:
    import traceback

    from torch_storage_loader._shm import segments

    init = segments.ShmSegment.__init__

    def traced(self, size, *args, **kwargs):
        init(self, size, *args, **kwargs)
        try:
            ino = os.fstat(self._fd).st_ino
        except OSError:
            return
        stack = "".join(traceback.format_stack(limit=14)[:-1])
        _origins[ino] = f"{size} bytes, mapped during {_current_test} at:\n{stack}"
        if len(_origins) > 4096:
            del _origins[next(iter(_origins))]

    segments.ShmSegment.__init__ = traced


_record_origins()


def _origin_lines(mappings: set[str]) -> list[str]:
    out = []
    for line in sorted(mappings):
        fields = line.split()
        ino = int(fields[4]) if len(fields) > 4 and fields[4].isdigit() else -1
        out.append(f"origin of inode {ino}: {_origins.get(ino, 'unknown (not mapped through ShmSegment here)')}")
    return out


_KINDS = {
    "shared-memory mappings (/proc/self/maps)": _our_mappings,
    "shared-memory descriptors (/proc/self/fd)": _our_fds,
    "child processes": _children,
    "tsl-* threads": _our_threads,
}

# What a test was already blamed for (or left after failing anyway): not blamed again on the tests after
# it. Nothing else is excused, so anything of ours present when a test starts that nobody was blamed
# for (created at import or collection, or between tests) is reported by that test: the goal is
# zero after every test, not "no more than before".
_excused: dict[str, set[str]] = {kind: set() for kind in _KINDS}


def _what_holds(mappings: set[str]) -> list[str]:
    """For a leak report: what the receiver knows of the leaked mappings, and which of our objects
    over shared memory are still alive (segments, mapped rings) and what refers to them."""
    from torch_storage_loader._shm import segments, slots

    reg = slots._registry
    out = [
        f"receiver: {len(reg.rings)} ring(s) registered, watching pids {sorted(reg.watched)}, "
        f"reaper {'alive' if reg.reaper is not None and reg.reaper.is_alive() else 'not running'}"
    ]
    for obj in gc.get_objects():  # mmap objects are not tracked by gc: look for what holds them
        if type(obj) is segments.ShmSegment:
            what = f"ShmSegment({obj.size} bytes, fd {obj._fd}, {'unmapped' if obj.mm.closed else 'mapped'})"
        elif type(obj) is slots._MappedRing:
            what = (
                f"ring {obj.uid[:8]} of pid {obj.owner_pid} ({obj.nbytes} bytes, leases {obj.leases}, "
                f"forgotten {obj.forgotten}, registered {reg.rings.get(obj.uid) is obj})"
            )
        else:
            continue
        holders = sorted({type(r).__name__ for r in gc.get_referrers(obj)} - {"list"})
        out.append(f"alive: {what}, referred to by {holders}")
    return out


def _views_into(mappings: set[str]) -> list[str]:
    """What refers to memory inside the leaked mappings: mmaps, arrays, memoryviews and tensors
    (none of them tracked by gc, so found among the referents of what is), and who holds them."""
    import ctypes
    import mmap

    ranges = []
    for line in mappings:
        lo, hi = line.split()[0].split("-")
        ranges.append((int(lo, 16), int(hi, 16)))

    def inside(addr: int) -> bool:
        return any(lo <= addr < hi for lo, hi in ranges)

    def address(obj) -> int | None:
        try:
            if isinstance(obj, torch.Tensor):
                return obj.untyped_storage().data_ptr()
            if isinstance(obj, np.ndarray):
                return obj.__array_interface__["data"][0]
            if isinstance(obj, memoryview):
                return None if obj.nbytes == 0 else np.frombuffer(obj, np.uint8).__array_interface__["data"][0]
            if isinstance(obj, mmap.mmap) and not obj.closed and len(obj):
                return ctypes.addressof(ctypes.c_char.from_buffer(obj))
        except (TypeError, ValueError, BufferError, RuntimeError):
            return None
        return None

    kinds = (torch.Tensor, np.ndarray, memoryview, mmap.mmap)
    out, seen = [], set()
    for holder in gc.get_objects():
        # type(), not isinstance(): some objects warn when their __class__ is read (torch's reduce_op)
        # (memoryviews and mmaps are tracked themselves: one that nothing tracked holds is a candidate)
        own = issubclass(type(holder), (torch.Tensor, memoryview, mmap.mmap))
        candidates = [holder] if own else gc.get_referents(holder)
        # Containers that hold only untracked objects (a dict of arrays) are untracked themselves.
        for _ in range(3):
            inner = [
                x
                for c in candidates
                if type(c) in (dict, list, tuple) and not gc.is_tracked(c)
                for x in gc.get_referents(c)
            ]
            if not inner:
                break
            candidates = candidates + inner
        for obj in candidates:
            if id(obj) in seen or not issubclass(type(obj), kinds):
                continue
            addr = address(obj)
            if addr is None or not inside(addr):
                continue
            seen.add(id(obj))
            holders = sorted({type(r).__name__ for r in gc.get_referrers(obj)} - {"list"})
            text = "" if own else object.__repr__(holder)
            if type(holder) is dict and isinstance(holder.get("__name__"), str):
                text = f"(the globals of {holder['__name__']})"
            elif type(holder).__name__ == "frame":
                text = f"(frame of {holder.f_code.co_name}, {holder.f_code.co_filename}:{holder.f_lineno})"
            out.append(
                f"view: {type(obj).__name__} at {addr:#x}, held by {type(holder).__name__} {text}; referrers {holders}"
            )
            if len(out) >= 20:
                return out
    running = _thread_frames_holding(inside, address, kinds)
    if not out and len(running) == 1:
        out.append("no array, tensor, memoryview or mmap found among what gc tracks refers into it")
    return out + running


def _thread_frames_holding(inside, address, kinds) -> list[str]:
    """Views held by the locals of a frame that is running in some thread: such frames are not
    objects gc tracks (Python 3.11 makes one only when asked), so the scan above cannot see them."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = [f"threads alive: {sorted(names.values())}"]
    for ident, frame in sys._current_frames().items():
        while frame is not None:
            for name, value in frame.f_locals.items():
                if issubclass(type(value), kinds) and (addr := address(value)) is not None and inside(addr):
                    out.append(
                        f"view: {type(value).__name__} {name!r} in a running frame of thread "
                        f"{names.get(ident, ident)}: {frame.f_code.co_name}, {frame.f_code.co_filename}:{frame.f_lineno}"
                    )
            frame = frame.f_back
    return out


def _snapshot() -> dict[str, set[str]]:
    return {kind: probe() for kind, probe in _KINDS.items()}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "call":
        item._tsl_call_failed = outcome.get_result().failed


def _drop_captured_tracebacks(item) -> None:
    """Let go of the tracebacks in log records pytest keeps for this test's report (caplog).

    A logged exception's traceback holds its frames, and so whatever they held (a sample, its
    slot's mapping) for as long as pytest keeps the record, i.e. past this fixture. Its text is
    already in the report; only pytest's own reference goes. The same holds for an exception
    passed as an argument (``logger.warning("loading %r failed: %s", storage, error)``): raised
    later in the test, its traceback holds the test's frame, and with it every local the test
    ended with (a dataset, a loader). Such records keep their message, rendered, not the exception.
    """
    try:
        from _pytest.logging import caplog_records_key
    except ImportError:  # a pytest that keeps them elsewhere: a leak reported here may be pytest's
        return
    for records in item.stash.get(caplog_records_key, {}).values():
        for record in records:
            if isinstance(record.args, tuple) and any(isinstance(a, BaseException) for a in record.args):
                record.msg, record.args = record.getMessage(), None
            if record.exc_info:
                if not record.exc_text:
                    record.exc_text = logging.Formatter().formatException(record.exc_info)
                record.exc_info = None


@pytest.fixture(autouse=True)
def no_leaks(request):
    global _current_test
    _current_test = request.node.nodeid
    before = _snapshot()
    for kind, items in before.items():
        _excused[kind] &= items  # forget what went away
    stale = {kind: items - _excused[kind] for kind, items in before.items()}
    yield
    _drop_captured_tracebacks(request.node)
    deadline = time.monotonic() + LEAK_WAIT_S
    while True:
        gc.collect()  # e.g. a DataLoader iterator caught in an exception's traceback stops its workers on collection
        mp.active_children()  # reaps finished children
        now = _snapshot()
        leaked = {kind: items - _excused[kind] for kind, items in now.items()}
        if not any(leaked.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if not any(leaked.values()):
        return
    for kind, items in leaked.items():
        _excused[kind] |= items
    lines = []
    for kind, items in leaked.items():
        if items:
            lines.append(f"{kind}:")
            lines += [
                f"    {x}" + ("   [already there when the test started]" if x in stale[kind] else "")
                for x in sorted(items)
            ]
    if leaked["shared-memory mappings (/proc/self/maps)"]:
        lines += _what_holds(leaked["shared-memory mappings (/proc/self/maps)"])
        lines += _origin_lines(leaked["shared-memory mappings (/proc/self/maps)"])
        lines += _views_into(leaked["shared-memory mappings (/proc/self/maps)"])
    report = (
        f"{request.node.nodeid} left these behind (still there after {LEAK_WAIT_S:.0f} s and gc.collect()):\n"
        + "\n".join(lines)
    )
    known = request.node.get_closest_marker("known_mapping_leak")
    mapped = {x.split()[-2] for x in leaked["shared-memory mappings (/proc/self/maps)"]}  # "/dev/shm/#<inode>"
    only_mappings = not any(
        items
        for kind, items in leaked.items()
        if kind != "shared-memory mappings (/proc/self/maps)"
        # (the mapping's own descriptor, when it comes with it: one leak, not two)
        and not (kind == "shared-memory descriptors (/proc/self/fd)" and {x.split()[-2] for x in items} <= mapped)
    )
    if getattr(request.node, "_tsl_call_failed", False):
        # The test's traceback may hold the samples; its failure is what to look at first.
        request.node.add_report_section("teardown", "leaks (the test failed already)", report)
    elif known is not None and only_mappings:
        # An open bug, reported (pytest -rA shows it) rather than failed; anything else still fails.
        request.node.add_report_section("teardown", f"known mapping leak ({known.args[0]})", report)
    else:
        pytest.fail(report, pytrace=False)


def assert_same(a, b, path="<root>"):
    """Deep equality that also checks container types, leaf types, dtypes and exact bytes."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: len {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, (np.ndarray, np.generic)):
        # Files are little-endian: a big-endian input comes back as the same values, little-endian.
        a = np.asarray(a).astype(a.dtype.newbyteorder("<"))
        b = np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), path
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        assert (
            a.contiguous().view(-1).view(torch.uint8).tolist() == b.contiguous().view(-1).view(torch.uint8).tolist()
            if a.numel()
            else True
        ), path
    elif type(a).__module__.startswith("treetensor"):
        # treevalue orders a tree's keys itself, by string hash: the order differs between
        # interpreters (PYTHONHASHSEED), even for the same tree, so only the key sets must match.
        assert sorted(a.keys()) == sorted(b.keys()), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.fixture
def tmp_store(tmp_path):
    d = tmp_path / "store"
    yield d
    assert not d.exists() or not [p for p in d.iterdir() if p.name.endswith(".tmp")], "temporary files left"


@pytest.fixture
def handles(tmp_path):
    """24 saved trajectories, tagged 0..23."""
    from torch_storage_loader import FileStorage

    d = tmp_path / "store"
    d.mkdir()
    out = []
    for i in range(24):
        s = FileStorage(d / f"{i:04d}.tsl")
        s.save(traj(i))
        out.append(s)
    return out


def traj(i: int, n: int = 8) -> dict:
    """A small RL trajectory tagged with ``i`` everywhere."""
    return {
        "obs": np.full((n, 4, 8, 8), i, np.float32),
        "action": torch.full((n,), i, dtype=torch.int64),
        "reward": np.full(n, i, np.float32),
        "done": np.zeros(n, bool),
        "info": {"id": i, "name": f"traj-{i}"},
    }


START_METHODS = [m for m in ("fork", "spawn", "forkserver") if m in mp.get_all_start_methods()]
