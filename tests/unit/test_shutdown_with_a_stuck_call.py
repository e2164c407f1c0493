"""Target.close while a blocking backend call (a flush on the worker thread) is still running past Work.close's
wait: the namespace's file stays open under it, never closed (or its number reused) under a running call."""
import os
import threading

from nvmeof_roce.nvme import nvm
from loopback_env import SUB_FILE, Env, RawQueue, standard_config


def test_close_leaves_the_file_of_a_stuck_call_open(tmp_path, monkeypatch):
    env = Env(standard_config(tmp_path))
    backend = env.target.subsystems[SUB_FILE].namespaces[1].backend
    release, entered = threading.Event(), threading.Event()
    real_flush = backend.flush

    def stuck_flush():
        entered.set()
        release.wait(30)
        real_flush()  # fails with EBADF if the file was closed under it
    monkeypatch.setattr(backend, "flush", stuck_flush)
    ctrl = env.connect(SUB_FILE)
    q = RawQueue(ctrl.io_queues[0].transport)
    q.send(nvm.FlushCommand(nsid=1).to_sqe().pack())
    env.fabric.pump()
    assert entered.wait(10)
    work_close = env.target.work.close
    monkeypatch.setattr(env.target.work, "close", lambda: work_close(timeout=0.2))
    fd = backend._fd
    try:
        env.target.close()
        os.fstat(fd)  # still open: the running flush owns it
        assert backend._fd == fd
    finally:
        release.set()
    backend.close()
