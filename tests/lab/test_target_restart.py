"""Killing our target under kernel-host I/O: the host reconnects to the restarted target, flushed data survives."""
import glob
import os
import signal
import subprocess
import time

import pytest

from targetproc import LAB_IP, ServedTarget, config, disconnect_all_quietly, file_namespace, namespaces_of, nvme

pytestmark = pytest.mark.lab

NQN = "nqn.2024-01.io.nvmeof-roce:lab-restart"
VERIFY_JOB = ["--name=flushed", "--verify_state_save=0", "--rw=write", "--bs=64k", "--size=8M", "--offset=0", "--verify=crc32c",
              "--ioengine=libaio", "--direct=1", "--iodepth=8"]


def controller_state(nqn):
    for ctrl in glob.glob("/sys/class/nvme/nvme*"):
        try:
            if open(f"{ctrl}/subsysnqn").read().strip() == nqn:
                return open(f"{ctrl}/state").read().strip()
        except OSError:
            continue
    return None


def wait_state(nqn, wanted, timeout):
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        state = controller_state(nqn)
        if not seen or seen[-1] != state:
            seen.append(state)
        if state in wanted:
            return seen
        time.sleep(0.05)
    raise AssertionError(f"controller state never reached {wanted}; saw {seen}")


def test_sigkill_under_io_then_restart_reconnects_and_flushed_data_verifies(tmp_path):
    image = "/var/tmp/nvmeof-roce-restart.img"
    if os.path.exists(image):
        os.unlink(image)
    cfg = config([{"nqn": NQN, "attr": {"allow_any_host": "1"}, "allowed_hosts": [],
                   "namespaces": [file_namespace(1, image, "64M", 512)]}])
    target = ServedTarget(cfg, str(tmp_path / "restart.json")).start()
    load = None
    try:
        nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", "4420", "-n", NQN, "--reconnect-delay=1",
             "--ctrl-loss-tmo=120")
        (dev,) = namespaces_of(NQN)
        written = subprocess.run(["fio", f"--filename={dev}", "--do_verify=0", *VERIFY_JOB], capture_output=True,
                                 text=True, timeout=300)
        assert written.returncode == 0, written.stderr
        nvme("flush", dev, "-n", "1")

        # I/O in flight on another region while the target dies
        load = subprocess.Popen(["fio", "--name=load", f"--filename={dev}", "--rw=randwrite", "--bs=4k",
                                 "--offset=32M", "--size=16M", "--iodepth=16", "--ioengine=libaio", "--direct=1",
                                 "--time_based", "--runtime=60"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        time.sleep(2)
        target.stop(signal.SIGKILL)
        states = wait_state(NQN, {"connecting", "resetting"}, timeout=30)
        assert "connecting" in states or "resetting" in states

        target.start()
        wait_state(NQN, {"live"}, timeout=60)
        load.terminate()
        load.wait(30)
        load = None
        verified = subprocess.run(["fio", f"--filename={dev}", "--verify_only", *VERIFY_JOB], capture_output=True,
                                  text=True, timeout=300)
        assert verified.returncode == 0, f"verify after restart failed:\n{verified.stdout[-3000:]}{verified.stderr}"
        assert "verify" not in verified.stderr.lower() or "bad" not in verified.stderr.lower()
    finally:
        if load is not None:
            load.kill()
        disconnect_all_quietly()
        target.stop()
