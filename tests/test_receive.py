"""The tsl-receive thread's own parts (its use by DataLoader iterators is tested in test_hooks)."""

import errno
import threading

import pytest

from torch_storage_loader._dataloader import receive


def test_a_receive_thread_stuck_in_a_read_does_not_hang_the_shutdown(monkeypatch, caplog):
    """torch's shutdown joins the thread without a timeout: one stuck reading (a worker killed halfway
    through a large result) is left behind after ``RECEIVE_JOIN_S``, and a warning says so."""
    monkeypatch.setattr(receive, "RECEIVE_JOIN_S", 0.2)
    stuck = threading.Event()
    thread = receive.ReceiveThread(target=stuck.wait, name="tsl-receive")
    thread.start()
    thread.join()  # as torch's _shutdown_workers calls it
    assert thread.is_alive() and "did not stop within" in caplog.text
    stuck.set()
    thread.join(10)
    assert not thread.is_alive()


class _NoDescriptorsLeft:
    """A result queue whose reading fails as torch's does when the process is out of descriptors."""

    def get(self, timeout: float) -> None:
        raise OSError(errno.EMFILE, "Too many open files")


def test_what_breaks_the_threads_reading_is_raised_on_the_trainers_thread():
    """torch's ``_try_get_data`` reads it as its own queue's error (it names ``ulimit`` for EMFILE)."""
    handoff = receive.Handoff()
    thread = receive.ReceiveThread(target=receive.receive, args=(_NoDescriptorsLeft(), handoff, handoff.done))
    thread.start()
    for _ in range(2):  # every later get too: nothing waits for a result that cannot come
        with pytest.raises(OSError, match="Too many open files"):
            handoff.get(timeout=30)
    thread.join(10)
    assert not thread.is_alive()


def test_an_iterator_collected_on_its_own_receive_thread_does_not_join_itself():
    """A reference cycle collected while the thread unpickles runs torch's shutdown there: its join
    returns, and the thread ends once back in its loop."""
    errors = []

    def run() -> None:
        try:
            threading.current_thread().join()
        except RuntimeError as exc:  # "cannot join current thread"
            errors.append(exc)

    thread = receive.ReceiveThread(target=run, name="tsl-receive")
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and errors == []
