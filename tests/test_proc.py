"""The process helpers of ``_proc``: locks a forked child gets free, at-fork hooks, and the self-pipe
that wakes a thread waiting in ``select``. Forks are real (``os.fork``), threads hold the locks."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
import warnings

from _helpers import free_for_another_thread, interrupted_constantly

from torch_storage_loader._proc import WakePipe, after_fork_in_child, fork_safe_lock


def _in_forked_child(check, *held_by_a_thread) -> int:
    """Fork, while another thread holds the locks ``held_by_a_thread``, and run ``check()`` in the
    child: its exit status is 0 when ``check`` returns True, 1 otherwise (or killed after 10 s)."""
    held, release = threading.Event(), threading.Event()

    def holder():
        with contextlib.ExitStack() as stack:
            for lock in held_by_a_thread:
                stack.enter_context(lock)
            held.set()
            release.wait(30)

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(10)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork() with threads
            pid = os.fork()
        if pid == 0:
            code = 1
            signal.alarm(10)  # a deadlocked child dies instead of hanging the test
            try:
                code = 0 if check() else 1
            finally:
                os._exit(code)
        deadline = time.monotonic() + 30
        while not (status := os.waitpid(pid, os.WNOHANG))[0]:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                return os.waitpid(pid, 0)[1]
            time.sleep(0.02)
        return status[1]
    finally:
        release.set()
        t.join()


def _exited_ok(status: int) -> bool:
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_a_fork_safe_lock_held_by_another_thread_at_fork_is_free_in_the_child():
    lock, plain = fork_safe_lock(), threading.Lock()

    def child():
        with lock:
            pass
        return not plain.acquire(timeout=0.2)  # a plain lock the parent's thread held stays held

    assert _exited_ok(_in_forked_child(child, lock, plain)), "the child could not take the lock"
    with lock:  # the parent's lock is its own still, free once its thread let go
        pass


def test_a_fork_safe_lock_excludes_threads():
    lock, inside, most = fork_safe_lock(), [0], [0]

    def enter(n):
        for _ in range(n):
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
                time.sleep(0)
                inside[0] -= 1

    threads = [threading.Thread(target=enter, args=(200,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most == [1]


def test_after_fork_in_child_runs_in_the_child_only():
    ran = []

    @after_fork_in_child
    def hook():
        ran.append(os.getpid())

    assert _exited_ok(_in_forked_child(lambda: ran == [os.getpid()]))
    assert ran == [], "the hook ran in the parent"


def test_wake_makes_the_pipe_readable_and_drain_returns_what_was_woken_with():
    pipe = WakePipe()
    try:
        assert not select.select([pipe], [], [], 0)[0]
        assert pipe.drain() == b"", "drain() blocks or reads nothing when nothing woke it"
        pipe.wake(b"a")
        pipe.wake(b"x")
        assert select.select([pipe], [], [], 0)[0] == [pipe]
        assert pipe.drain() == b"ax"
        assert not select.select([pipe], [], [], 0)[0]
        pipe.wake()
        assert pipe.drain() == b"\0"
    finally:
        pipe.close()


def test_a_wake_pipe_never_blocks_nor_leaks_into_exec_and_wake_after_close_does_nothing():
    pipe = WakePipe()
    r = pipe.fileno()
    assert not os.get_blocking(r) and not os.get_inheritable(r)
    for _ in range(70_000):  # more than a 64 KiB pipe holds: the extra wake-ups are dropped
        pipe.wake()
    assert len(pipe.drain()) == 4096
    pipe.close()
    assert pipe.fileno() == -1
    pipe.wake()  # after close: nothing written (its descriptor numbers may be someone else's now)
    pipe.close()


def test_wake_from_another_thread_wakes_a_select():
    pipe = WakePipe()
    try:
        t = threading.Timer(0.1, pipe.wake)
        t.start()
        started = time.monotonic()
        assert select.select([pipe], [], [], 10)[0] == [pipe]
        assert time.monotonic() - started < 5
        t.join()
    finally:
        pipe.close()


def test_a_wake_pipe_closes_in_a_child_forked_while_a_thread_was_waking_it():
    pipe = WakePipe()

    def child():
        pipe.close()  # as WorkerPool.forget does in a forked child
        return pipe.fileno() == -1

    try:
        assert _exited_ok(_in_forked_child(child, pipe._lock))
    finally:
        pipe.close()


def test_an_error_raised_by_a_signal_handler_never_leaves_a_fork_safe_lock_held():
    lock = fork_safe_lock()

    def section():
        for _ in range(50):
            with lock:
                pass

    assert interrupted_constantly(section) > 100
    assert free_for_another_thread(lock), "a signal handler's error left the lock held: the next 'with' hangs"
