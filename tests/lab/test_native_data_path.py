"""The kernel host (nvme-rdma, fio) against our userspace target with `--data-path native` over real rxe."""
import json
import subprocess

import pytest

from targetproc import LAB_IP, ServedTarget, config, disconnect_all_quietly, namespaces_of, nvme, ram_namespace

pytestmark = pytest.mark.lab

NQN = "nqn.2024-01.io.nvmeof-roce:lab-native"


def fio(device, *args):
    cmd = ["fio", "--name=lab", f"--filename={device}", "--ioengine=libaio", "--direct=1", "--output-format=json",
           "--verify_state_save=0", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"fio failed: {proc.stderr}\n{proc.stdout[-2000:]}"
    return json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pytest.importorskip("nvmeof_roce._native")
    tmp = tmp_path_factory.mktemp("target")
    cfg = config([{"nqn": NQN, "attr": {"allow_any_host": "1"},
                   "namespaces": [ram_namespace(1, "64M", 512), ram_namespace(2, "16M", 4096)]}])
    target = ServedTarget(cfg, str(tmp / "target.json"), args=["--data-path", "native"]).start(timeout=240)
    yield target
    disconnect_all_quietly()
    assert target.stop() == 0, target.output()


def test_kernel_host_fio_verify_on_the_native_data_path(served):
    nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", "4420", "-n", NQN, "-i", "2")
    try:
        devices = namespaces_of(NQN, expect=2)
        for device in devices:
            job = fio(device, "--rw=randrw", "--verify=crc32c", "--verify_fatal=1", "--bsrange=4k-128k",
                      "--iodepth=32", "--size=8M", "--numjobs=1")
            assert job["error"] == 0
        # the admin queue and the rest stayed on the Python path; the I/O went through the C queues
        assert "native data path" in served.output()
    finally:
        disconnect_all_quietly()



def test_kernel_host_fio_verify_with_busy_poll_on_two_poll_groups(tmp_path):
    """`--poll busy --cores 2`: two threads poll the native queues (one each), the loop serves the rest."""
    pytest.importorskip("nvmeof_roce._native")
    # its own NQN, port and control socket (polled.sock): the module's other target may still be serving
    nqn, port = NQN + "-polled", 4430
    cfg = config([{"nqn": nqn, "attr": {"allow_any_host": "1"}, "namespaces": [ram_namespace(1, "64M", 512)]}],
                 port=port)
    target = ServedTarget(cfg, str(tmp_path / "polled.json"),
                          args=["--data-path", "native", "--poll", "busy", "--cores", "2"]).start(timeout=240)
    try:
        nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", str(port), "-n", nqn, "-i", "2")
        (device,) = namespaces_of(nqn, expect=1)
        job = fio(device, "--rw=randrw", "--verify=crc32c", "--verify_fatal=1", "--bsrange=4k-128k",
                  "--iodepth=32", "--size=8M", "--numjobs=2", "--offset_increment=16M", "--group_reporting")
        assert job["error"] == 0
    finally:
        disconnect_all_quietly()
        assert target.stop() == 0, target.output()
    out = target.output()
    assert "polled by poll group 1 of 2" in out and "polled by poll group 2 of 2" in out
    assert "data path native (busy poll, 2 poll-group threads)" in out  # the status line logged at stop
