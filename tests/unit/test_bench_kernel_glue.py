"""The bench's kernel glue that reads data only: sysfs layouts of NVMe-oF hosts, `rdma` cm_id listings.

configfs (nvmet, null_blk) and nvme connect run for real in the lab (tests/lab/test_bench.py).
"""
from pathlib import Path

from nvmeof_roce.bench import kernel_glue as kg
from nvmeof_roce.bench.targets import KernelNvmetTarget, UserspaceTarget, userspace_config
from nvmeof_roce.config import parse_config

FIXTURES = Path(__file__).parent / "fixtures" / "bench"
NQN = "nqn.2014-08.org.nvmeof-roce:bench-kernel"


def _ctrl(sysfs: Path, name: str, nqn: str, address: str, namespaces=()):
    d = sysfs / "class" / "nvme" / name
    d.mkdir(parents=True)
    (d / "subsysnqn").write_text(nqn + "\n")
    (d / "address").write_text(address + "\n")
    for ns in namespaces:
        (d / ns).mkdir()
    return d


def _subsys(sysfs: Path, name: str, nqn: str, heads=()):
    d = sysfs / "class" / "nvme-subsystem" / name
    d.mkdir(parents=True)
    (d / "subsysnqn").write_text(nqn + "\n")
    for h in heads:
        (d / h).mkdir()


def test_namespace_devices_with_native_multipath(tmp_path):
    # multipath: the controller holds hidden nvme1c1n1; the head nvme1n1 lives under the subsystem
    _ctrl(tmp_path, "nvme0", "nqn.2014-08.org.other:disk", "traddr=10.0.0.9,trsvcid=4420", ["nvme0c0n1"])
    _subsys(tmp_path, "nvme-subsys0", "nqn.2014-08.org.other:disk", ["nvme0n1", "nvme0"])
    _ctrl(tmp_path, "nvme1", NQN, "traddr=10.99.0.1,trsvcid=4420", ["nvme1c1n1"])
    _subsys(tmp_path, "nvme-subsys1", NQN, ["nvme1n1", "nvme1"])
    assert kg.controllers(NQN, tmp_path) == ["nvme1"]
    assert kg.namespace_devices(NQN, tmp_path) == ["/dev/nvme1n1"]
    assert kg.namespace_devices("nqn.2014-08.org.none:x", tmp_path) == []


def test_namespace_devices_without_multipath(tmp_path):
    _ctrl(tmp_path, "nvme2", NQN, "traddr=10.99.0.1,trsvcid=4420", ["nvme2n1", "nvme2n2"])
    _subsys(tmp_path, "nvme-subsys2", NQN, ["nvme2"])
    assert kg.namespace_devices(NQN, tmp_path) == ["/dev/nvme2n1", "/dev/nvme2n2"]


def test_rdma_cm_id_listing_from_the_lab():
    text = (FIXTURES / "rdma-res-cm_id-nvmet-listen.json").read_text()
    assert kg.parse_cm_id_listeners(text) == [{"addr": "10.99.0.1", "port": 4420, "comm": "nvmet_rdma"}]
    assert kg.parse_cm_id_listeners("not json") is None
    both = ('[{"state":"LISTEN","comm":"python3","src-addr":"[fe80::1]:4421"},'
            '{"state":"CONNECT","comm":"x","src-addr":"10.99.0.1:4420"},'
            '{"state":"LISTEN","comm":"old","src-addr":"10.0.0.1","src-port":4430}]')
    assert kg.parse_cm_id_listeners(both) == [{"addr": "fe80::1", "port": 4421, "comm": "python3"},
                                              {"addr": "10.0.0.1", "port": 4430, "comm": "old"}]


def test_the_configs_follow_the_project_schema():
    """Both exports are valid configs of the one schema the targets read (nvmeof_roce/config/)."""
    u = parse_config(userspace_config("10.99.0.1", 4421, "nqn.2014-08.org.nvmeof-roce:bench-userspace", 256),
                     source="userspace")
    assert u.ports[0].trsvcid == 4421 and u.subsystems[0].namespaces[0].backend == "ram"
    assert u.subsystems[0].namespaces[0].size_bytes == 256 << 20
    k = parse_config(kg.kernel_config(NQN, "/dev/bench-kernel", "10.99.0.1", 4420), source="kernel")
    assert k.subsystems[0].namespaces[0].path == "/dev/bench-kernel" and k.ports[0].trsvcid == 4420


def test_targets_have_their_own_nqn_and_port():
    k = KernelNvmetTarget("10.99.0.1")
    u = UserspaceTarget("10.99.0.1")
    assert (k.trsvcid, u.trsvcid) == (4420, 4421)
    assert k.subnqn != u.subnqn and k.address["traddr"] == u.address["traddr"] == "10.99.0.1"
    assert "null_blk" in k.describe()["backend"] and "ram" in u.describe()["backend"]
