"""The tsl-receive thread's own parts (its use by DataLoader iterators is tested in test_hooks)."""

import threading

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
