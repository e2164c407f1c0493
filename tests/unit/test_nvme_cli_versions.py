"""nvme-cli's output as each lab generation's version prints it, read by the `host` wrapper's parsers.

The fixtures under fixtures/nvme-cli-recorded/ were recorded in the lab against our target by
tests/lab/record_nvme_cli.py (one subsystem, NSID 1: 64 MiB of 512-byte blocks, NSID 2: 32 MiB of 4096-byte
blocks): bookworm-2.3 in the Debian 12 guest (nvme-cli 2.3 with libnvme 1.3, packaged as 2.4+really2.3;
kernel 6.12), trixie-2.13 in the Debian 13 guest (nvme-cli 2.13 with libnvme 1.13; kernel 6.12).  Each
directory's origin.txt names the kernel, `nvme version` and the guest's host NQN and ID files.
"""
import re
from pathlib import Path

import pytest

from nvmeof_roce.kernel import nvme_cli

RECORDED = Path(__file__).parent / "fixtures" / "nvme-cli-recorded"
VERSIONS = sorted(p.name for p in RECORDED.iterdir() if p.is_dir())
NQN = "nqn.2024-01.io.nvmeof-roce:record"


def read(version, name):
    return (RECORDED / version / name).read_text()


def origin(version):
    return dict(re.findall(r"^(/etc/nvme/host\w+): (\S+)$", read(version, "origin.txt"), re.M))


def test_both_generations_are_recorded():
    assert {"bookworm-2.3", "trixie-2.13"} <= set(VERSIONS)
    for version in VERSIONS:
        cli = version.rsplit("-", 1)[1]
        assert f"nvme version {cli} " in read(version, "version.txt")


@pytest.mark.parametrize("version", VERSIONS)
def test_discover(version):
    log = nvme_cli.parse_discover(read(version, "discover.json"))
    rec = next(r for r in log["records"] if r["subnqn"] == NQN)
    assert (rec["trtype"], rec["adrfam"], rec["traddr"], rec["trsvcid"], rec["portid"]) == \
        ("rdma", "ipv4", "10.99.0.1", "4420", 1)
    assert rec["subtype"] == "nvme subsystem" and log["genctr"] >= 1


@pytest.mark.parametrize("version", VERSIONS)
def test_connect_names_the_controller_and_a_second_connect_is_refused(version):
    assert nvme_cli.parse_connect(read(version, "connect.json")) == "nvme0"
    again = read(version, "connect-again.stderr")
    assert again.startswith("exit 1\n") and "already connected" in again
    assert nvme_cli.parse_disconnect(read(version, "disconnect.txt")) == 1


@pytest.mark.parametrize("version", VERSIONS)
def test_list_subsys_gives_the_subsystem_its_live_path_and_the_host_identity(version):
    ids = origin(version)
    [subsys] = nvme_cli.parse_list_subsys(read(version, "list-subsys.json"))
    assert subsys["nqn"] == NQN and subsys["name"] == "nvme-subsys0"
    assert subsys["hostnqn"] == ids["/etc/nvme/hostnqn"] and subsys["hostid"] == ids["/etc/nvme/hostid"]
    [path] = subsys["paths"]
    assert (path["name"], path["transport"], path["traddr"], path["trsvcid"], path["state"]) == \
        ("nvme0", "rdma", "10.99.0.1", "4420", "live")
    assert nvme_cli.parse_list_subsys(read(version, "list-subsys-empty.json")) == []


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("listing", ["list.json", "list-verbose.json"])
def test_list_gives_both_namespaces_with_their_geometry(version, listing):
    entries = nvme_cli.parse_list(read(version, listing))
    assert [(e["device"], e["nsid"], e["sector_size"], e["size_bytes"]) for e in entries] == \
        [("/dev/nvme0n1", 1, 512, 64 << 20), ("/dev/nvme0n2", 2, 4096, 32 << 20)]
    assert all(e["serial"] == "REC00001" and e["model"] == "nvmeof-roce lab" for e in entries)
    if listing == "list-verbose.json":
        assert all(e["subnqn"] == NQN and e["controller"] == "nvme0" for e in entries)
    assert nvme_cli.parse_list(read(version, "list-empty.json")) == []
