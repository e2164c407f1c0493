"""A block namespace on a real device: null_blk (4 KiB logical blocks, 2 ms completions, so commands pile up
at the device) served by our target, the kernel host writing and verifying it with fio at queue depth 32,
`target status` showing many commands with the device (on the io_uring engine) and the device's block size."""
import json
import subprocess
import sys
import time

import pytest

from nvmeof_roce.bench.kernel_glue import NullBlk
from targetproc import LAB_IP, ServedTarget, config, disconnect_all_quietly, namespaces_of, nvme

pytestmark = pytest.mark.lab

NQN = "nqn.2024-01.io.nvmeof-roce:lab-devices"
PORT = 4431


def test_null_blk_namespace_keeps_many_commands_in_flight_and_verifies(tmp_path):
    dev = NullBlk(name="lab-devices", size_mb=64, completion_ns=2_000_000, block_size=4096)
    path = dev.create()
    sock = str(tmp_path / "ctl.sock")
    target = ServedTarget(config([{"nqn": NQN, "attr": {"allow_any_host": "1"},
                                   "namespaces": [{"nsid": 1, "enable": 1, "device": {"path": path}}]}],
                                 port=PORT), str(tmp_path / "devices.json"), args=["--rpc-socket", sock])
    try:
        target.start()
        nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", str(PORT), "-n", NQN)
        (disk,) = namespaces_of(NQN)
        fio = subprocess.Popen(["fio", "--name=verify", f"--filename={disk}", "--ioengine=libaio", "--direct=1",
                                "--rw=randwrite", "--bs=4k", "--iodepth=32", "--size=16M", "--verify=crc32c",
                                "--do_verify=1", "--verify_fatal=1", "--verify_state_save=0", "--output-format=json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        engine = None
        while fio.poll() is None:
            out = subprocess.run([sys.executable, "-m", "nvmeof_roce", "target", "status", "--json", "--socket",
                                  sock], capture_output=True, text=True, timeout=30)
            if out.returncode == 0:
                ns = json.loads(out.stdout)["subsystems"][0]["namespaces"][0]
                assert ns["block_size"] == 4096  # the device's logical block size (BLKSSZGET), not the default 512
                engine = ns["io"]
            time.sleep(0.2)
        stdout, stderr = fio.communicate()
        assert fio.returncode == 0, stderr + stdout
        job = json.loads(stdout[stdout.index("{"):])["jobs"][0]
        assert job["error"] == 0 and job["write"]["io_bytes"] == 16 << 20 and job["read"]["io_bytes"] == 16 << 20
        print(f"engine {engine}")
        assert engine["engine"] == "io_uring" and engine["queue_depth"] == 128  # the guest's kernel has io_uring
        # The high-water mark of the core's engine, or of the native queues' rings when the default native data
        # path serves the I/O: a status sample lands between two event-loop passes, when the loop may have just
        # reaped every completion, so a sampled in_flight cannot show the overlap.
        most = max(engine["most_in_flight"], engine.get("native_most_in_flight", 0))
        assert most > 8, f"the device never had more than {most} commands: {engine}"
    finally:
        disconnect_all_quietly()
        target.stop()
        dev.remove()
    assert "Traceback" not in target.output()
