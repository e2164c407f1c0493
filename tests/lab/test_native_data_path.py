"""The kernel host (nvme-rdma, fio) against our userspace target on each data path over real rxe: RAM namespaces on
native (the default, which every other lab test of the userspace target runs on) and python (the reference), and
a file and a null_blk block namespace on native (their Reads and Writes on the C queues' io_uring)."""
import json
import subprocess
import sys

import pytest

from nvmeof_roce.bench.kernel_glue import NullBlk
from targetproc import (LAB_IP, ServedTarget, config, disconnect_all_quietly, file_namespace, namespaces_of, nvme,
                        ram_namespace)

pytestmark = pytest.mark.lab

NQN = "nqn.2024-01.io.nvmeof-roce:lab-native"


def fio(device, *args):
    cmd = ["fio", "--name=lab", f"--filename={device}", "--ioengine=libaio", "--direct=1", "--output-format=json",
           "--verify_state_save=0", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"fio failed: {proc.stderr}\n{proc.stdout[-2000:]}"
    return json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0]


@pytest.fixture(scope="module", params=["native", "python"])
def served(request, tmp_path_factory):
    if request.param == "native":
        pytest.importorskip("nvmeof_roce._native")
    tmp = tmp_path_factory.mktemp("target")
    cfg = config([{"nqn": NQN, "attr": {"allow_any_host": "1"},
                   "namespaces": [ram_namespace(1, "64M", 512), ram_namespace(2, "16M", 4096)]}])
    target = ServedTarget(cfg, str(tmp / "target.json"), args=["--data-path", request.param]).start(timeout=240)
    target.data_path = request.param
    yield target
    disconnect_all_quietly()
    assert target.stop() == 0, target.output()


def test_kernel_host_fio_verify_on_each_data_path(served):
    nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", "4420", "-n", NQN, "-i", "2")
    try:
        devices = namespaces_of(NQN, expect=2)
        for device in devices:
            job = fio(device, "--rw=randrw", "--verify=crc32c", "--verify_fatal=1", "--bsrange=4k-128k",
                      "--iodepth=32", "--size=8M", "--numjobs=1")
            assert job["error"] == 0
        # the status line names the data path that ran; on native, the I/O queues were C queues
        assert f"data path {served.data_path}" in served.output()
        if served.data_path == "native":
            assert "native data path" in served.output()
    finally:
        disconnect_all_quietly()


FILE_NQN = "nqn.2024-01.io.nvmeof-roce:lab-native-files"
FILE_PORT = 4432


def test_kernel_host_fio_verify_on_native_file_and_block_namespaces(tmp_path):
    dev = NullBlk(name="lab-native", size_mb=64, completion_ns=2_000_000, block_size=4096)
    path = dev.create()
    sock = str(tmp_path / "ctl.sock")
    cfg = config([{"nqn": FILE_NQN, "attr": {"allow_any_host": "1"},
                   "namespaces": [file_namespace(1, str(tmp_path / "ns1.img"), "64M", 512),
                                  {"nsid": 2, "enable": 1, "device": {"path": path}}]}], port=FILE_PORT)
    target = ServedTarget(cfg, str(tmp_path / "files.json"), args=["--data-path", "native", "--rpc-socket", sock])
    try:
        target.start(timeout=240)
        nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", str(FILE_PORT), "-n", FILE_NQN, "-i", "2")
        devices = namespaces_of(FILE_NQN, expect=2)
        for device in devices:
            job = fio(device, "--rw=randrw", "--verify=crc32c", "--verify_fatal=1", "--bsrange=4k-128k",
                      "--iodepth=32", "--size=8M", "--numjobs=1")
            assert job["error"] == 0
        out = subprocess.run([sys.executable, "-m", "nvmeof_roce", "target", "status", "--json", "--socket", sock],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        engines = {ns["nsid"]: ns["io"] for ns in json.loads(out.stdout)["subsystems"][0]["namespaces"]}
        print(f"engines after fio: {engines}")
        # their Reads and Writes went through the C queues' rings, many at once on the 2 ms device
        assert engines[1]["native_most_in_flight"] >= 1
        assert engines[2]["native_most_in_flight"] > 8, engines[2]
        assert engines[2]["native_in_flight"] == 0
    finally:
        disconnect_all_quietly()
        target.stop()
        dev.remove()
    assert "Traceback" not in target.output()


def test_kernel_host_fio_verify_with_busy_poll_on_two_poll_groups(tmp_path):
    """`--poll busy --cores 2`: two threads poll the native queues (one each), the loop serves the rest; a RAM and
    a file namespace, the file's reads and writes on the threads' rings."""
    pytest.importorskip("nvmeof_roce._native")
    # its own NQN, port and control socket (polled.sock): the module's other target may still be serving
    nqn, port = NQN + "-polled", 4430
    sock = str(tmp_path / "polled.sock")
    cfg = config([{"nqn": nqn, "attr": {"allow_any_host": "1"},
                   "namespaces": [ram_namespace(1, "64M", 512),
                                  file_namespace(2, str(tmp_path / "polled.img"), "64M", 512)]}], port=port)
    target = ServedTarget(cfg, str(tmp_path / "polled.json"),
                          args=["--data-path", "native", "--poll", "busy", "--cores", "2",
                                "--rpc-socket", sock]).start(timeout=240)
    try:
        nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", str(port), "-n", nqn, "-i", "2")
        for device in namespaces_of(nqn, expect=2):
            job = fio(device, "--rw=randrw", "--verify=crc32c", "--verify_fatal=1", "--bsrange=4k-128k",
                      "--iodepth=32", "--size=8M", "--numjobs=2", "--offset_increment=16M", "--group_reporting")
            assert job["error"] == 0
        out = subprocess.run([sys.executable, "-m", "nvmeof_roce", "target", "status", "--json", "--socket", sock],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        engines = {ns["nsid"]: ns["io"] for ns in json.loads(out.stdout)["subsystems"][0]["namespaces"]}
        print(f"engines after fio: {engines}")
        assert engines[2]["native_most_in_flight"] >= 1 and engines[2]["native_in_flight"] == 0, engines[2]
    finally:
        disconnect_all_quietly()
        assert target.stop() == 0, target.output()
    out = target.output()
    assert "polled by poll group 1 of 2" in out and "polled by poll group 2 of 2" in out
    assert "data path native (busy poll, 2 poll-group threads)" in out  # the status line logged at stop
    assert "Traceback" not in out


def test_kernel_host_fio_verify_with_adaptive_poll(tmp_path):
    """`--poll adaptive`: fio's verify at QD1 and QD32 over real rxe, and each I/O queue's polling status (`target
    status --json`): the spin found commands without a channel event (spin_hits), the CQs were armed between
    bursts (arms) and every empty poll of a spin yielded (spin_yields)."""
    pytest.importorskip("nvmeof_roce._native")
    nqn, port = NQN + "-adaptive", 4433
    sock = str(tmp_path / "adaptive.sock")
    cfg = config([{"nqn": nqn, "attr": {"allow_any_host": "1"}, "namespaces": [ram_namespace(1, "64M", 512)]}],
                 port=port)
    target = ServedTarget(cfg, str(tmp_path / "adaptive.json"),
                          args=["--data-path", "native", "--poll", "adaptive", "--poll-spin-us", "1000",
                                "--rpc-socket", sock]).start(timeout=240)
    try:
        nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", str(port), "-n", nqn, "-i", "2")
        device = namespaces_of(nqn, expect=1)[0]
        for depth in (1, 32):
            job = fio(device, "--rw=randrw", "--verify=crc32c", "--verify_fatal=1", "--bsrange=4k-64k",
                      f"--iodepth={depth}", "--size=8M")
            assert job["error"] == 0
        out = subprocess.run([sys.executable, "-m", "nvmeof_roce", "target", "status", "--json", "--socket", sock],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        queues = [q for c in json.loads(out.stdout)["subsystems"][0]["controllers"] for q in c["queues"] if q["qid"]]
        print(f"I/O queues' polling: {[q['polling'] for q in queues]}")
        assert len(queues) == 2 and all(q["polling"]["mode"] == "adaptive" for q in queues)
        assert sum(q["polling"]["spin_hits"] for q in queues) > 0
        assert sum(q["polling"]["spin_yields"] for q in queues) > 0
        assert all(q["polling"]["arms"] > 0 for q in queues)
    finally:
        disconnect_all_quietly()
        assert target.stop() == 0, target.output()
    out = target.output()
    assert "data path native (adaptive poll, spin 1000 µs)" in out  # the status line logged at stop
    assert "Traceback" not in out
