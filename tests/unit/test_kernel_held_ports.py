"""The userspace target runs beside the kernel target (nvmet): its unit does not stop nvmet, and `target serve`
refuses only an RDMA address:port a kernel port listens on, naming that port and the fix."""
import json

import pytest

from nvmeof_roce.errors import NvmeofError
from nvmeof_roce.kernel import nvmet
from nvmeof_roce.kernel.apply import apply
from nvmeof_roce.kernel.nvmet import Root
from nvmeof_roce.config import parse_config
from nvmeof_roce.service.serve import serve
from nvmeof_roce.systemd import render
from fake_nvmet import FakeNvmetFS

KSUB = "nqn.2024-01.io.example:kernel"
USUB = "nqn.2024-01.io.example:userspace"


def rdma_port(portid, traddr, trsvcid, nqn):
    return {"portid": portid, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": traddr, "trsvcid": trsvcid},
            "subsystems": [nqn]}


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    """A kernel target with an RDMA port on 10.99.0.1:4420, a TCP port on 10.99.0.1:4421 and an RDMA port with no
    subsystem (not listening) on 10.99.0.1:4422."""
    dev = tmp_path / "k.img"
    dev.write_bytes(b"\0" * 4096)
    fs = FakeNvmetFS(tmp_path / "cfs", rdma_addrs=("10.99.0.1", "0.0.0.0"))
    (tmp_path / "cfs" / "sys_module" / "nvmet_tcp").mkdir()
    root = Root(fs.root, fs=fs, sys_module=fs.sys_module)
    tcp = rdma_port(2, "10.99.0.1", "4421", KSUB)
    tcp["addr"]["trtype"] = "tcp"
    idle = rdma_port(3, "10.99.0.1", "4422", KSUB)
    idle["subsystems"] = []
    apply(root, parse_config({"ports": [rdma_port(1, "10.99.0.1", "4420", KSUB), tcp, idle],
                              "subsystems": [{"nqn": KSUB, "namespaces": [{"nsid": 1, "device": {"path": str(dev)}}]}]}))
    monkeypatch.setattr(nvmet, "NVMET_ROOT", fs.root)
    return fs


def userspace_config(tmp_path, traddr, trsvcid):
    path = tmp_path / "us.json"
    path.write_text(json.dumps({"ports": [rdma_port(1, traddr, trsvcid, USUB)],
                                "subsystems": [{"nqn": USUB, "namespaces": [
                                    {"nsid": 1, "nvmeof_roce": {"backend": "ram", "size": "1M"}}]}]}))
    return path


def test_the_unit_does_not_stop_the_kernel_target():
    unit = render("nvmeof-roce-target@.service", "/usr/bin/nvmeof-roce")
    assert not [line for line in unit.splitlines() if line.startswith("Conflicts=")]


def test_the_kernel_listeners_are_read_from_configfs(kernel):
    held = nvmet.kernel_port_holding("rdma", "10.99.0.1", "4420")
    assert held and held["portid"] == 1 and held["subsystems"] == [KSUB]
    assert nvmet.kernel_port_holding("rdma", "10.99.0.1", "4421") is None  # a TCP port: another port space
    assert nvmet.kernel_port_holding("rdma", "10.99.0.1", "4422") is None  # no subsystem linked: not listening
    assert nvmet.kernel_port_holding("rdma", "10.99.0.2", "4420") is None


def test_a_kernel_port_on_any_address_holds_every_address(kernel):
    any_addr = nvmet.Root(kernel.root, fs=kernel, load_modules=False).port(1)
    any_addr.remove_subsystem(KSUB)
    any_addr.set_attr("addr", "traddr", "0.0.0.0")
    any_addr.add_subsystem(KSUB)
    assert nvmet.kernel_port_holding("rdma", "10.99.0.7", "4420")["portid"] == 1


def test_no_kernel_target_holds_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(nvmet, "NVMET_ROOT", str(tmp_path / "config" / "nvmet"))
    assert nvmet.kernel_port_holding("rdma", "10.99.0.1", "4420") is None


def test_serve_refuses_an_address_the_kernel_listens_on(kernel, tmp_path):
    with pytest.raises(NvmeofError) as ei:
        serve(str(userspace_config(tmp_path, "10.99.0.1", "4420")), rpc_socket=None)
    assert "ports[0] (rdma 10.99.0.1:4420)" in ei.value.message
    assert "the kernel target (nvmet) listens there: its port 1" in ei.value.message
    assert "trsvcid" in ei.value.fix and f"{kernel.root}/ports/1" in ei.value.fix
