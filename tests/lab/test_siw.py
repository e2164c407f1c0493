"""iWARP: Soft-iWARP (siw, built out of tree for the lab's kernel) on its own netdev; the kernel host over it
against kernel nvmet and against our userspace target (connect, fio crc32c verify, disconnect), and our
initiator against both (connect-test: write, read back, compare, on every I/O queue)."""
import json
import os
import resource
import subprocess

import pytest

from targetproc import ServedTarget, disconnect_all_quietly, namespaces_of, nvme, ram_namespace

pytestmark = [pytest.mark.lab, pytest.mark.extended]  # make test-extended (minutes under TCG)

SIW_NETDEV = "siwnet0"
SIW_IP = "10.98.0.1"
SIW_DEVICE = "siw0"
NQN_OURS = "nqn.2024-01.io.nvmeof-roce:siw-userspace"
NQN_KERNEL = "nqn.2024-01.io.nvmeof-roce:siw-kernel"


def sh(*args):
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=60)


def cli(*args):
    proc = subprocess.run(["nvmeof-roce", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"nvmeof-roce {' '.join(args)}: {proc.stderr}{proc.stdout}"
    return proc.stdout


@pytest.fixture(scope="module")
def siw_link():
    # siw.ko is given to a run that asks for it (lab run --siw); the host says why when it could not build it
    if subprocess.run(["modinfo", "-n", "siw"], capture_output=True).returncode != 0:
        why = os.environ.get("NVMEOF_LAB_NO_SIW") or "this run was started without 'lab run --siw'"
        pytest.skip(f"no siw module for kernel {os.uname().release}: {why}")
    # siw counts pinned pages against RLIMIT_MEMLOCK even for root (rxe lets CAP_IPC_LOCK through): the target
    # and our initiator, started from here, inherit the raised limit
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    sh("ip", "link", "add", SIW_NETDEV, "type", "dummy")
    sh("ip", "addr", "add", f"{SIW_IP}/24", "dev", SIW_NETDEV)
    sh("ip", "link", "set", SIW_NETDEV, "up")
    added = json.loads(cli("rdma", "add-siw", SIW_NETDEV, "--json"))
    assert added["active"], added
    yield added
    disconnect_all_quietly()
    subprocess.run(["nvmeof-roce", "rdma", "del-siw", SIW_DEVICE], capture_output=True)
    subprocess.run(["ip", "link", "del", SIW_NETDEV], capture_output=True)


def fio_verify(device):
    proc = subprocess.run(["fio", "--name=siw", f"--filename={device}", "--ioengine=libaio", "--direct=1",
                           "--rw=randrw", "--bsrange=4k-128k", "--iodepth=16", "--size=16M", "--verify=crc32c",
                           "--verify_fatal=1", "--verify_state_save=0", "--output-format=json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"fio failed: {proc.stderr}\n{proc.stdout[-2000:]}"
    job = json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0]
    assert job["error"] == 0
    assert job["read"]["io_bytes"] > 0 and job["write"]["io_bytes"] > 0
    return job


def initiator_connect_test(port, nqn):
    proc = subprocess.run(["nvmeof-roce", "initiator", "connect-test", "-a", SIW_IP, "-s", str(port), "-n", nqn,
                           "--queues", "2", "--json"], capture_output=True, text=True, timeout=300)
    result = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}
    assert proc.returncode == 0 and result.get("ok"), f"{proc.stderr}\n{proc.stdout}"
    assert any(step["step"].startswith("namespace") and step["ok"] for step in result["steps"]), result


def test_siw_device_is_an_iwarp_rnic_with_its_limits(siw_link):
    status = json.loads(cli("rdma", "status", "--json"))
    siw = next(d for d in status["devices"] if d["name"] == SIW_DEVICE)
    assert siw["iwarp"] and siw["soft_roce"]
    assert siw["ports"][0]["state"] == "ACTIVE"
    info = subprocess.run(["ibv_devinfo", "-v", "-d", SIW_DEVICE], capture_output=True, text=True).stdout
    assert "iWARP" in info  # transport
    assert "max_sge_rd:\t\t\t1" in info.replace(" ", "\t") or "max_sge_rd:" in info


def test_kernel_host_over_siw_against_kernel_nvmet(siw_link, tmp_path):
    backing = tmp_path / "kernel-ns.img"
    cfg = {"hosts": [], "ports": [{"portid": 7, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": SIW_IP,
                                                          "trsvcid": "4430", "treq": "not specified"},
                                   "subsystems": [NQN_KERNEL], "referrals": []}],
           "subsystems": [{"nqn": NQN_KERNEL, "attr": {"allow_any_host": "1"}, "allowed_hosts": [],
                           "namespaces": [{"nsid": 1, "enable": 1, "device": {"path": str(backing)},
                                           "buffered_io": 1}]}]}
    with open(backing, "wb") as f:
        f.truncate(64 << 20)
    path = tmp_path / "kernel.json"
    path.write_text(json.dumps(cfg))
    cli("nvmet", "apply", str(path))
    try:
        nvme("connect", "-t", "rdma", "-a", SIW_IP, "-s", "4430", "-n", NQN_KERNEL)
        (device,) = namespaces_of(NQN_KERNEL)
        fio_verify(device)
        nvme("disconnect", "-n", NQN_KERNEL)
        initiator_connect_test(4430, NQN_KERNEL)
    finally:
        disconnect_all_quietly()
        cli("nvmet", "clear")


def test_kernel_host_over_siw_against_our_target(siw_link, tmp_path):
    cfg = {"hosts": [], "ports": [{"portid": 1, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": SIW_IP,
                                                          "trsvcid": "4431", "treq": "not specified"},
                                   "subsystems": [NQN_OURS], "referrals": []}],
           "subsystems": [{"nqn": NQN_OURS, "attr": {"allow_any_host": "1"}, "allowed_hosts": [],
                           "namespaces": [ram_namespace(1, "64M")]}]}
    target = ServedTarget(cfg, str(tmp_path / "target.json")).start()
    try:
        assert "siw0" in target.output()
        try:
            nvme("connect", "-t", "rdma", "-a", SIW_IP, "-s", "4431", "-n", NQN_OURS)
            (device,) = namespaces_of(NQN_OURS)
            fio_verify(device)
            nvme("disconnect", "-n", NQN_OURS)
            initiator_connect_test(4431, NQN_OURS)
        except AssertionError as exc:
            dmesg = subprocess.run(["dmesg"], capture_output=True, text=True).stdout.splitlines()[-25:]
            raise AssertionError(f"{str(exc)[:600]}\n--- target log:\n{target.output()[-4000:]}\n--- dmesg:\n"
                                 + "\n".join(dmesg)) from None
    finally:
        disconnect_all_quietly()
        code = target.stop()
    assert code == 0, target.output()
    assert "Traceback" not in target.output()
    assert os.path.exists(tmp_path / "target.json")
