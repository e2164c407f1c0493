"""`nvmeof-roce doctor` on the lab guest's real Soft-RoCE: rxe0 on dummy netdev rxenet0, 10.99.0.1."""
import importlib.util
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.lab

LAB_IP = "10.99.0.1"


def doctor(*args, timeout=180):
    """Run the real command; returns (exit code, {label: result}, raw stdout)."""
    proc = subprocess.run([sys.executable, "-m", "nvmeof_roce", "doctor", "--json", "--interval", "0.5", *args],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.stdout.strip(), f"doctor printed nothing (exit {proc.returncode}): {proc.stderr}"
    results = json.loads(proc.stdout)
    by_label = {(r["check"] + (" " + r["subject"] if r["subject"] else "")): r for r in results}
    return proc.returncode, by_label, proc


def explain(results):
    return "\n".join(f"{k}: {r['status']}: {r['summary']}" for k, r in results.items())


def test_doctor_reports_rxe0():
    code, results, _ = doctor()
    report = explain(results)
    assert code == 0, report
    assert not [k for k, r in results.items() if r["status"] == "fail"], report

    assert results["stack.modules"]["status"] == "ok", report
    for module in ("ib_uverbs", "rdma_ucm"):
        assert results["stack.modules"]["details"]["modules"][module] in ("loaded", "built-in")
    assert "rdma_rxe" in results["stack.modules"]["details"]["providers"]

    assert results["device.present"]["status"] == "ok" and "rxe0 (Soft-RoCE)" in results["device.present"]["summary"]
    soft = results["device.soft_roce rxe0"]
    assert soft["status"] == "warn" and "Soft-RoCE" in soft["summary"] and "rxenet0" in soft["summary"], report

    assert results["port.state rxe0/1"]["status"] == "ok", report
    assert results["port.link_layer rxe0/1"]["status"] == "ok"
    mtu = results["port.mtu rxe0/1"]
    assert mtu["status"] == "ok" and mtu["details"]["netdev"] == "rxenet0"

    gids = results["address.gids rxe0/1"]
    assert gids["status"] == "ok" and f"{LAB_IP} (IPv4" in gids["summary"], report
    assert results["address.roce_mode rxe0/1"]["status"] == "ok"

    # rxenet0 is a dummy netdev: no DCB, no ECN, no ethtool statistics
    assert results["fabric.pfc rxe0/1"]["status"] == "skipped"
    assert "virtual netdev rxenet0" in results["fabric.pfc rxe0/1"]["summary"]
    assert results["fabric.counters rxe0/1"]["status"] in ("ok", "warn")
    assert results["fabric.counters rxe0/1"]["details"]["counters"] > 0  # rxe's hw_counters were read

    # uverbs0 is 0666 by the kernel's own devnode rule in the guest (no udev): a warning, not a failure
    files = results["stack.device_files"]
    assert files["status"] in ("ok", "warn"), report
    assert results["stack.memlock"]["status"] == "ok"  # root: CAP_IPC_LOCK
    assert results["nvme.firewall"]["status"] == "ok", report


def test_doctor_traddr_local_address_has_a_gid_and_route():
    code, results, _ = doctor("--traddr", LAB_IP, "--trsvcid", "4420")
    report = explain(results)
    assert results["address.traddr_gid"]["status"] == "ok", report
    assert "on rxe0/1 (rxenet0)" in results["address.traddr_gid"]["summary"]
    route = results["address.route"]
    assert route["status"] == "ok" and route["details"]["local"] is True, report


def _initiator_available():
    for module in ("nvmeof_roce.initiator.discovery", "nvmeof_roce.transport.rdma.host"):
        if importlib.util.find_spec(module) is None:
            return False
    return True


needs_initiator = pytest.mark.skipif(not _initiator_available(),
                                     reason="the userspace initiator (nvmeof_roce.initiator.discovery) is not there yet")


@needs_initiator
def test_doctor_traddr_with_no_target_listening_fails_readably():
    code, results, proc = doctor("--traddr", LAB_IP)
    target = results[f"nvme.target {LAB_IP}:4420"]
    assert code == 1, explain(results)
    assert target["status"] == "fail", explain(results)
    assert target["summary"].startswith(f"cannot reach {LAB_IP}:4420: "), target
    assert "nvmeof-roce target serve" in target["fix"]
    human = subprocess.run([sys.executable, "-m", "nvmeof_roce", "doctor", "--interval", "0", "--traddr", LAB_IP],
                           capture_output=True, text=True, timeout=180)
    assert human.returncode == 1
    assert f"FAIL nvme.target {LAB_IP}:4420: cannot reach" in human.stdout


@needs_initiator
def test_doctor_reaches_a_served_userspace_target(tmp_path):
    targetproc = pytest.importorskip("targetproc")
    if importlib.util.find_spec("nvmeof_roce.service.serve") is None:
        pytest.skip("nvmeof_roce target serve is not there yet")
    nqn = "nqn.2024-01.io.nvmeof-roce:doctor"
    subsystem = {"nqn": nqn, "attr": {"allow_any_host": "1"}, "namespaces": [targetproc.ram_namespace(1, "16M")]}
    served = targetproc.ServedTarget(targetproc.config([subsystem]), str(tmp_path / "target.json")).start()
    try:
        code, results, _ = doctor("--traddr", LAB_IP, "--timeout", "20")
    finally:
        served.stop()
    target = results[f"nvme.target {LAB_IP}:4420"]
    assert target["status"] == "ok", (target, served.output()[-3000:])
    assert any(nqn in line for line in target["evidence"]), target
