"""`lab run --nodes 2` from the host side: the QEMU arguments of each node, the CLI's answers to bad input,
and the rendezvous files.  (The boots themselves are tests/lab/test_two_node.py, `make test-two-node`.)"""
import subprocess
import sys
from pathlib import Path

import pytest

from nvmeof_roce.errors import NvmeofError
from nvmeof_roce import rendezvous
from nvmeof_roce.lab.twonode import NodeSpec, node_run
from nvmeof_roce.lab.vm import LabRun, qemu_args


class FakeImage:
    kernel, initrd, disk = Path("/i/vmlinux"), Path("/i/initrd.img"), Path("/i/rootfs.ext4")


def test_each_node_gets_its_role_address_and_one_end_of_the_wire(tmp_path):
    base = LabRun(command=[], project=tmp_path, share=tmp_path / "share", cpus=1)
    wire = tmp_path / "wire"
    runs = {n: node_run(base, n, NodeSpec(["true"], mtu=9000 if n == "host" else 1500), wire)
            for n in ("target", "host")}
    t = qemu_args(FakeImage, runs["target"], tmp_path / "ctl")
    h = qemu_args(FakeImage, runs["host"], tmp_path / "ctl")
    append_t = t[t.index("-append") + 1]
    assert "nvmeof.node=target nvmeof.addr=10.99.1.1/24 nvmeof.peer=10.99.1.2 nvmeof.mtu=1500" in append_t
    assert "nvmeof.node=host nvmeof.addr=10.99.1.2/24 nvmeof.peer=10.99.1.1 nvmeof.mtu=9000" in h[h.index("-append") + 1]
    nt, nh = t[t.index("-netdev") + 1], h[h.index("-netdev") + 1]
    # each side binds its own socket and sends to the other's: a point-to-point wire, no host network
    assert f"local.path={wire / 'target'}" in nt and f"remote.path={wire / 'host'}" in nt
    assert f"local.path={wire / 'host'}" in nh and f"remote.path={wire / 'target'}" in nh
    assert nt.startswith("dgram,") and "inet" not in nt
    assert t[t.index("-smp") + 1] == "1"
    assert "virtio-net-pci,netdev=wire,mac=52:54:00:99:01:01,mrg_rxbuf=off" in t[t.index("-device") + 1]
    assert h[h.index("-device") + 1].endswith("host_mtu=9000")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "nvmeof_roce", *args], capture_output=True, text=True)


def test_cli_rejects_inconsistent_two_node_options():
    r = _cli("lab", "run", "--host-cmd", "true")
    assert r.returncode != 0 and "need --nodes 2" in r.stderr
    r = _cli("lab", "run", "--nodes", "2", "--", "ibv_devinfo")
    assert r.returncode != 0 and "--target-cmd and --host-cmd" in r.stderr
    r = _cli("lab", "run", "--nodes", "3", "--host-cmd", "true")
    assert r.returncode != 0 and "invalid choice" in r.stderr


def test_rendezvous_signal_wait(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_SYNC", str(tmp_path))
    rendezvous.signal("target-ready", "4420")
    assert rendezvous.wait("target-ready", 1) == "4420"
    with pytest.raises(NvmeofError, match="did not appear"):
        rendezvous.wait("never", 0.2)
    with pytest.raises(NvmeofError, match="plain file name"):
        rendezvous.signal("../escape")
    monkeypatch.delenv("LAB_SYNC")
    with pytest.raises(NvmeofError, match="LAB_SYNC"):
        rendezvous.wait("x", 0)


def _fake_guest(script_for):
    """qemu_args replacement: a shell 'guest' that prints, reports an exit code in ctl like the init does."""
    def qemu_args(image, run, ctl):
        node = "target" if "nvmeof.node=target" in run.cmdline else "host"
        return ["sh", "-c", script_for[node].format(ctl=ctl)]
    return qemu_args


def test_run_two_streams_both_consoles_and_returns_both_codes(tmp_path, monkeypatch, capfdbinary):
    from nvmeof_roce.lab import twonode
    monkeypatch.setattr(twonode.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(twonode, "qemu_args", _fake_guest({
        "target": "echo serving; sleep 0.3; echo 0 > {ctl}/exit-code",
        "host": "printf 'step 1\\r\\nstep 2\\n'; echo 3 > {ctl}/exit-code"}))
    base = LabRun(command=[], project=tmp_path, share=tmp_path / "share", timeout=30)
    codes = twonode.run_two(FakeImage, base, {"target": NodeSpec(["true"]), "host": NodeSpec(["true"])})
    assert codes == {"target": 0, "host": 3}
    out = capfdbinary.readouterr().out.decode()
    assert "[target] serving\n" in out and "[host] step 1\n[host] step 2\n" in out
    assert (tmp_path / "share" / ".lab-sync").is_dir()  # the rendezvous directory, fresh for the run


def test_run_two_kills_a_node_that_outlives_its_peer(tmp_path, monkeypatch):
    from nvmeof_roce.lab import twonode
    monkeypatch.setattr(twonode.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(twonode, "qemu_args", _fake_guest({
        "target": "exec sleep 60", "host": "echo 0 > {ctl}/exit-code"}))
    base = LabRun(command=[], project=tmp_path, share=tmp_path / "share", timeout=30)
    codes = twonode.run_two(FakeImage, base, {"target": NodeSpec(["true"]), "host": NodeSpec(["true"])},
                            peer_grace=0.5)
    assert codes == {"target": twonode.KILLED, "host": 0}
