"""The Linux kernel host (nvme-rdma, nvme-cli, fio) against our userspace target over real rxe."""
import json
import os
import subprocess
import time

import pytest

from targetproc import (LAB_IP, ServedTarget, config, disconnect_all_quietly, file_namespace, namespaces_of, nvme,
                        ram_namespace)

pytestmark = pytest.mark.lab

NQN_A = "nqn.2024-01.io.nvmeof-roce:lab-a"
NQN_B = "nqn.2024-01.io.nvmeof-roce:lab-b"
NQN_ALLOWED = "nqn.2024-01.io.nvmeof-roce:lab-allowed"
GOOD_HOST = "nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555"
BAD_HOST = "nqn.2014-08.org.nvmexpress:uuid:99999999-2222-3333-4444-555555555555"
HOSTNQN = open("/etc/nvme/hostnqn").read().strip() if os.path.exists("/etc/nvme/hostnqn") else GOOD_HOST


def fio(device, *args, runtime=None):
    cmd = ["fio", "--name=lab", f"--filename={device}", "--ioengine=libaio", "--direct=1", "--output-format=json",
           "--verify_state_save=0",
           *args]
    if runtime:
        cmd += ["--time_based", f"--runtime={runtime}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"fio failed: {proc.stderr}\n{proc.stdout[-2000:]}"
    job = json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0]
    return job


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("target")
    cfg = config([
        {"nqn": NQN_A, "attr": {"allow_any_host": "1", "serial": "LABA0001", "model": "nvmeof-roce lab"},
         "allowed_hosts": [],
         "namespaces": [ram_namespace(1, "64M", 512), file_namespace(2, str(tmp / "ns2.img"), "32M", 4096)]},
        {"nqn": NQN_ALLOWED, "attr": {"allow_any_host": "0"}, "allowed_hosts": [GOOD_HOST],
         "namespaces": [ram_namespace(1, "16M")]},
    ], hosts=[GOOD_HOST])
    target = ServedTarget(cfg, str(tmp / "target.json")).start()
    yield target
    disconnect_all_quietly()
    assert target.stop() == 0, target.output()


def test_discover_lists_our_subsystems(served):
    out = json.loads(nvme("discover", "-t", "rdma", "-a", LAB_IP, "-s", "4420", "-o", "json").stdout)
    nqns = {rec["subnqn"] for rec in out["records"]}
    assert NQN_A in nqns
    assert NQN_ALLOWED not in nqns  # this host is not on that allow-list
    rec = next(r for r in out["records"] if r["subnqn"] == NQN_A)
    assert rec["trtype"] == "rdma" and rec["traddr"] == LAB_IP and rec["trsvcid"].strip() == "4420"
    out = json.loads(nvme("discover", "-t", "rdma", "-a", LAB_IP, "-s", "4420", "-q", GOOD_HOST,
                          "-o", "json").stdout)
    assert NQN_ALLOWED in {rec["subnqn"] for rec in out["records"]}


def test_connect_identify_fio_verify_admin_commands_and_reconnect(served):
    nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", "4420", "-n", NQN_A, "-i", "2")
    try:
        ram, filens = namespaces_of(NQN_A, expect=2)
        ctrl = json.loads(nvme("id-ctrl", ram, "-o", "json").stdout)
        assert ctrl["subnqn"] == NQN_A
        assert ctrl["sn"].strip() == "LABA0001" and ctrl["mn"].strip() == "nvmeof-roce lab"
        ns1 = json.loads(nvme("id-ns", ram, "-o", "json").stdout)
        assert ns1["nsze"] == 64 * 2**20 // 512 and ns1["lbafs"][ns1["flbas"] & 0xF]["ds"] == 9
        ns2 = json.loads(nvme("id-ns", filens, "-o", "json").stdout)
        assert ns2["nsze"] == 32 * 2**20 // 4096 and ns2["lbafs"][ns2["flbas"] & 0xF]["ds"] == 12
        assert int(open(f"/sys/block/{os.path.basename(ram)}/size").read()) * 512 == 64 * 2**20
        subsys = json.loads(nvme("list-subsys", "-o", "json").stdout)
        assert NQN_A in json.dumps(subsys)

        for device in (ram, filens):
            job = fio(device, "--rw=randrw", "--verify=crc32c", "--verify_fatal=1", "--bsrange=4k-128k",
                      "--iodepth=32", "--size=16M", "--numjobs=1")
            assert job["error"] == 0
            assert job["write"]["io_bytes"] > 0 and job["read"]["io_bytes"] > 0

        nvme("flush", ram, "-n", "1")
        nvme("write-zeroes", ram, "-n", "1", "-s", "0", "-c", "7")
        nvme("dsm", ram, "-n", "1", "-d", "-s", "8", "-b", "8")
        with open(ram, "rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        zeros = subprocess.run(["dd", f"if={ram}", "bs=4096", "count=1", "iflag=direct", "status=none"],
                               capture_output=True).stdout
        assert zeros == bytes(4096)  # blocks 0-7 were write-zeroed
    finally:
        nvme("disconnect", "-n", NQN_A)
    # clean disconnect, then the same subsystem connects again
    time.sleep(0.5)
    nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", "4420", "-n", NQN_A)
    try:
        ram, _ = namespaces_of(NQN_A, expect=2)
        job = fio(ram, "--rw=randread", "--bs=4k", "--iodepth=8", "--size=4M", runtime=2)
        assert job["error"] == 0 and job["read"]["io_bytes"] > 0
    finally:
        nvme("disconnect", "-n", NQN_A)
    assert served.proc.poll() is None


def test_host_not_on_allow_list_is_refused_and_others_still_served(served):
    bad = nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", "4420", "-n", NQN_ALLOWED, "-q", BAD_HOST,
               check=False)
    assert bad.returncode != 0
    nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", "4420", "-n", NQN_ALLOWED, "-q", GOOD_HOST)
    try:
        (dev,) = namespaces_of(NQN_ALLOWED, expect=1)
        job = fio(dev, "--rw=randwrite", "--verify=crc32c", "--bs=4k", "--iodepth=16", "--size=2M")
        assert job["error"] == 0
    finally:
        nvme("disconnect", "-n", NQN_ALLOWED)
    assert served.proc.poll() is None


def test_nvmeof_roce_host_commands_against_our_target(served):
    """`nvmeof-roce host discover/connect/list/disconnect` (nvme-cli underneath) with our target on the other end."""
    from kernel_helpers import cli
    found = cli("host", "discover", "-a", LAB_IP, "-s", "4420", "--json")
    assert NQN_A in {r["subnqn"] for r in found["records"]}
    conn = cli("host", "connect", "-a", LAB_IP, "-s", "4420", "-n", NQN_A, "-i", "1", "-Q", "64", "--json")
    ctrl = conn["controller"]
    try:
        assert int(open(f"/sys/class/nvme/{ctrl}/queue_count").read()) == 2  # admin + 1 I/O queue
        assert int(open(f"/sys/class/nvme/{ctrl}/sqsize").read()) + 1 == 64
        sub = next(s for s in cli("host", "list", "--json")["subsystems"] if s["nqn"] == NQN_A)
        assert [(p["transport"], p["traddr"], p["trsvcid"], p["state"]) for p in sub["paths"]] == \
            [("rdma", LAB_IP, "4420", "live")]
        assert sorted(n["size_bytes"] for n in sub["namespaces"]) == [32 * 2**20, 64 * 2**20]
    finally:
        gone = cli("host", "disconnect", "-n", NQN_A, "--json")
    assert gone["disconnected"] == 1
    assert served.proc.poll() is None
