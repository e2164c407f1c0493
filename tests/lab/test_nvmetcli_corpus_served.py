"""The nvmetcli corpus (tests/unit/fixtures/nvmetcli/: files saved by nvmetcli's own save code on Debian's 6.1
and 6.12 kernels) on the kernel it was saved on: our userspace target serves it to the kernel host (with the
saved DH-HMAC-CHAP keys on 6.12), and `nvmet apply` restores it into the kernel's nvmet, which serves it too.
Only the namespaces' file paths are changed (files made here at the saved sizes, on the root disk)."""
import json
import os
from pathlib import Path

import pytest

from kernel_helpers import LAB_IP, block_device_of, cli, disconnect_quietly, modprobe, sh
from targetproc import ServedTarget

pytestmark = pytest.mark.lab

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "unit" / "fixtures" / "nvmetcli"
SUB_AUTH = "nqn.2024-01.io.nvmeof-roce:nvmetcli-auth"
SUB_OPEN = "nqn.2024-01.io.nvmeof-roce:nvmetcli-open"
HOST_AUTH = "nqn.2014-08.org.nvmexpress:uuid:6f1c2a9e-0000-4000-8000-0000000000a1"
SIZES = {"corpus-ns1.img": 64, "corpus-ns2.img": 32, "corpus-open.img": 16}


def kernel_generation():
    major, minor = os.uname().release.split(".")[:2]
    return f"{major}.{minor}"


@pytest.fixture
def saved(tmp_path):
    path = FIXTURES / f"nvmetcli-{kernel_generation()}.json"
    if not path.exists():
        pytest.skip(f"no nvmetcli save of kernel {kernel_generation()} in the corpus")
    data = json.loads(path.read_text())
    for s in data["subsystems"]:
        for ns in s["namespaces"]:
            name = Path(ns["device"]["path"]).name
            local = f"/var/tmp/nvmeof-corpus-{name}"  # ext4: nvmet opens files with O_DIRECT
            with open(local, "wb") as f:
                f.truncate(SIZES[name] << 20)
            ns["device"]["path"] = local
    out = tmp_path / path.name
    out.write_text(json.dumps(data, indent=2))
    yield data, str(out)
    disconnect_quietly(SUB_AUTH, SUB_OPEN)


def connect(data, svc="4420"):
    host = next(h for h in data["hosts"] if h["nqn"] == HOST_AUTH)
    keys = host.get("dhchap") or {}
    args = ["connect", "-t", "rdma", "-a", LAB_IP, "-s", svc, "-n", SUB_AUTH, "-q", HOST_AUTH,
            "-I", HOST_AUTH.rsplit(":", 1)[1]]
    if keys.get("key"):
        args += ["--dhchap-secret", keys["key"], "--dhchap-ctrl-secret", keys["ctrl_key"]]
    sh("nvme", *args)
    dev = block_device_of(SUB_AUTH, 1)
    sh("dd", f"if={dev}", "of=/dev/null", "bs=4k", "count=64", "iflag=direct")
    return dev


def test_our_target_serves_the_saved_file(saved, tmp_path):
    data, path = saved
    cli("target", "check", path)
    target = ServedTarget(data, path, args=["--no-rpc-socket"]).start(timeout=120)
    try:
        dev = connect(data)
        sub = next(s for s in data["subsystems"] if s["nqn"] == SUB_AUTH)
        ctrl = os.path.basename(dev)[:os.path.basename(dev).rindex("n")]
        idc = json.loads(sh("nvme", "id-ctrl", f"/dev/{ctrl}", "-o", "json").stdout)
        assert idc["sn"].strip() == sub["attr"]["serial"]
        if "firmware" in sub["attr"]:
            assert idc["fr"].strip() == sub["attr"]["firmware"]
            assert idc["ieee"] == int(sub["attr"]["ieee_oui"], 0), idc["ieee"]
        disconnect_quietly(SUB_AUTH)
    finally:
        target.stop()


def test_nvmet_apply_restores_the_saved_file(saved):
    data, path = saved
    modprobe("nvmet", "nvmet_rdma", "nvme_rdma")
    cli("nvmet", "apply", path)
    try:
        connect(data)
        shown = cli("nvmet", "show", "--json")
        sub = next(s for s in shown["subsystems"] if s["nqn"] == SUB_AUTH)
        want = next(s for s in data["subsystems"] if s["nqn"] == SUB_AUTH)
        for key in ("serial", "firmware", "ieee_oui"):
            if key in want["attr"]:
                assert sub["attr"][key] == want["attr"][key], key
        disconnect_quietly(SUB_AUTH)
    finally:
        cli("nvmet", "clear")
