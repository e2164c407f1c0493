"""Target.close while a blocking backend call (a flush on the worker thread) is still running past Work.close's
wait: the namespace's file stays open under it, never closed (or its number reused) under a running call."""
import os
import threading

import pytest

from nvmeof_roce.nvme import nvm
from nvmeof_roce.engine.ioengine import uring_unavailable
from held import hold
from loopback_env import SUB_FILE, Env, RawQueue, standard_config


@pytest.mark.parametrize("engine", ["threads", "io_uring"])
def test_close_leaves_the_file_of_a_stuck_call_open(tmp_path, monkeypatch, engine):
    if engine == "io_uring" and uring_unavailable():
        pytest.skip(uring_unavailable())
    cfg = standard_config(tmp_path)
    ns_cfg = next(s for s in cfg["subsystems"] if s["nqn"] == SUB_FILE)["namespaces"][0]
    ns_cfg["nvmeof_roce"]["io_engine"] = engine
    env = Env(cfg)
    backend = env.target.subsystems[SUB_FILE].namespaces[1].backend
    release, entered = threading.Event(), threading.Event()
    if engine == "threads":
        real_flush = backend.flush

        def stuck_flush():
            entered.set()
            release.wait(30)
            real_flush()  # fails with EBADF if the file was closed under it
        monkeypatch.setattr(backend, "flush", stuck_flush)
    else:  # the fdatasync held in the kernel, on the ring
        held = hold(env.target, SUB_FILE, 1, "flush")
    ctrl = env.connect(SUB_FILE)
    q = RawQueue(ctrl.io_queues[0].transport)
    q.send(nvm.FlushCommand(nsid=1).to_sqe().pack())
    env.fabric.pump()
    if engine == "threads":
        assert entered.wait(10)
    else:
        held.wait_running(1)
    work_close = env.target.work.close
    monkeypatch.setattr(env.target.work, "close", lambda: work_close(timeout=0.2))
    fd = backend._fd
    try:
        env.target.close()
        os.fstat(fd)  # still open: the running flush owns it
        assert backend._fd == fd
    finally:
        release.set()
        if engine == "io_uring":
            held.release.set()
    backend.close()
