"""rdma status/add-rxe/del-rxe/roce-mode against a fake sysfs/configfs built from what the lab's rxe0 shows."""
import errno
import json
from pathlib import Path

import pytest

from nvmeof_roce.kernel import softroce as rdma
from nvmeof_roce.kernel.softroce import RdmaError, Rdma
from nvmeof_roce.kernel.tool import ToolResult

FIX = Path(__file__).parent / "fixtures" / "rdma"


def w(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def make_rxe(sysfs: Path, name="rxe0", netdev="rxenet0", ip_hex="0a63:0001"):
    """The files the lab's rxe0 has (captured with ls/cat in the guest)."""
    d = sysfs / "class" / "infiniband" / name
    w(d / "node_type", "1: CA")
    w(d / "node_guid", "ecb6:f3ff:fe16:9456")
    w(d / "fw_ver", "0.0.0")
    w(d / "parent", netdev)
    p = d / "ports" / "1"
    w(p / "state", "4: ACTIVE")
    w(p / "phys_state", "5: LinkUp")
    w(p / "link_layer", "Ethernet")
    w(p / "rate", "2.5 Gb/sec (1X SDR)")
    gids = ["fe80:0000:0000:0000:ecb6:f3ff:fe16:9456", f"0000:0000:0000:0000:0000:ffff:{ip_hex}"] + \
        ["0000:0000:0000:0000:0000:0000:0000:0000"] * 2
    for i, g in enumerate(gids):
        w(p / "gids" / str(i), g)
        if i < 2:   # empty entries: reading types/ndevs gives EINVAL; here they are simply absent
            w(p / "gid_attrs" / "types" / str(i), "RoCE v2")
            w(p / "gid_attrs" / "ndevs" / str(i), netdev)
    w(sysfs / "class" / "net" / netdev / "mtu", "1500")
    return d


def runner_for(outputs):
    calls = []

    def run(tool, args, package, timeout=None):
        calls.append((tool, list(args)))
        key = (tool, " ".join(args))
        if key in outputs:
            return outputs[key]
        if tool == "ibv_devinfo":
            return ToolResult([tool], 0, (FIX / "ibv_devinfo.txt").read_text(), "")
        if key == ("rdma", "-j link show"):
            return ToolResult([tool], 0, (FIX / "rdma-link.json").read_text(), "")
        raise AssertionError(key)
    run.calls = calls
    return run


def test_status_reports_rxe_with_roce_v2_gid(tmp_path):
    make_rxe(tmp_path / "sys")
    st = rdma.status(sysfs=str(tmp_path / "sys"), configfs=str(tmp_path / "cfg"), runner=runner_for({}))
    (dev,) = st["devices"]
    assert (dev["name"], dev["node_type"], dev["soft_roce"], dev["parent"]) == ("rxe0", "CA", True, "rxenet0")
    (port,) = dev["ports"]
    assert (port["state"], port["phys_state"], port["link_layer"], port["netdev"]) == \
        ("ACTIVE", "LinkUp", "Ethernet", "rxenet0")
    assert port["active_mtu"] == 4096 and port["max_mtu"] == 4096       # from ibv_devinfo
    assert port["gids"] == [
        {"index": 0, "gid": "fe80::ecb6:f3ff:fe16:9456", "type": "RoCE v2", "roce": "v2", "netdev": "rxenet0",
         "ip": None},
        {"index": 1, "gid": "::ffff:10.99.0.1", "type": "RoCE v2", "roce": "v2", "netdev": "rxenet0",
         "ip": "10.99.0.1"}]
    json.dumps(st)


def test_status_without_ibv_devinfo_uses_netdev_mtu(tmp_path):
    make_rxe(tmp_path / "sys")
    devs = rdma.devices(str(tmp_path / "sys"))
    assert devs[0]["ports"][0]["active_mtu"] == 1024 and devs[0]["ports"][0]["netdev_mtu"] == 1500


def test_status_without_ibv_devinfo_derives_the_kernels_roce_mtu(tmp_path):
    make_rxe(tmp_path / "sys")
    (tmp_path / "sys" / "class" / "net" / "rxenet0" / "mtu").write_text("4160\n")   # 4096 + 64: 2048 fits, 4096 not
    assert rdma.devices(str(tmp_path / "sys"))[0]["ports"][0]["active_mtu"] == 2048


def test_no_devices(tmp_path):
    assert rdma.status(sysfs=str(tmp_path), configfs=str(tmp_path), runner=runner_for({})) == {"devices": []}


def test_parse_ibv_devinfo():
    info = rdma.parse_ibv_devinfo((FIX / "ibv_devinfo.txt").read_text())
    assert info == {"rxe0": {1: {"state": "PORT_ACTIVE (4)", "max_mtu": 4096, "active_mtu": 4096,
                                 "link_layer": "Ethernet"}}}


def test_roce_version_and_ip():
    assert rdma.roce_version("IB/RoCE v1") == "v1" and rdma.roce_version("RoCE v2") == "v2"
    assert rdma.gid_to_ip("0000:0000:0000:0000:0000:ffff:0a63:0001") == "10.99.0.1"
    assert rdma.gid_to_ip("fe80:0000:0000:0000:ecb6:f3ff:fe16:9456") is None


def test_add_rxe_errors_and_argv(tmp_path):
    sysfs = tmp_path / "sys"
    (sysfs / "class" / "net" / "rxenet0").mkdir(parents=True)
    with pytest.raises(RdmaError) as ei:
        rdma.add_rxe("nosuch", sysfs=str(sysfs), load_modules=False)
    assert "netdev nosuch does not exist" in ei.value.message and "ip link add" in ei.value.fix
    make_rxe(sysfs)
    with pytest.raises(RdmaError, match="an RDMA device named rxe0 already exists"):
        rdma.add_rxe("rxenet0", "rxe0", sysfs=str(sysfs), load_modules=False)
    # the real call: rdma link add NAME type rxe netdev NETDEV, then wait for ACTIVE
    run = runner_for({("rdma", "link add rxe1 type rxe netdev rxenet0"): ToolResult(["rdma"], 0, "", "")})

    class R(Rdma):
        def link_add(self, name, netdev, kind="rxe"):
            super().link_add(name, netdev, kind)
            make_rxe(sysfs, name, netdev)
    r = rdma.add_rxe("rxenet0", "rxe1", sysfs=str(sysfs), rdma=R(run), load_modules=False, timeout=1)
    assert r["active"] and r["device"]["name"] == "rxe1"
    assert ("rdma", ["link", "add", "rxe1", "type", "rxe", "netdev", "rxenet0"]) in run.calls


@pytest.mark.parametrize("stderr,words", [("error: No such device", "does not exist"),
                                          ("error: File exists", "already exists")])
def test_rdma_link_add_failures(stderr, words):
    run = runner_for({("rdma", "link add rxe1 type rxe netdev eth9"): ToolResult(["rdma"], 1, "", stderr)})
    with pytest.raises(RdmaError) as ei:
        Rdma(run).link_add("rxe1", "eth9")
    assert words in ei.value.message and stderr in ei.value.message and ei.value.fix


def test_del_rxe(tmp_path):
    sysfs = tmp_path / "sys"
    make_rxe(sysfs)
    with pytest.raises(RdmaError, match="no RDMA device rxe9"):
        rdma.del_rxe("rxe9", sysfs=str(sysfs))
    run = runner_for({("rdma", "link delete rxe0"): ToolResult(["rdma"], 1, "", "Wrong device name - rxe0")})
    with pytest.raises(RdmaError, match="no RDMA device rxe0"):
        rdma.del_rxe("rxe0", sysfs=str(sysfs), rdma=Rdma(run))
    run = runner_for({("rdma", "link delete rxe0"): ToolResult(["rdma"], 0, "", "")})
    assert rdma.del_rxe("rxe0", sysfs=str(sysfs), rdma=Rdma(run)) == {"name": "rxe0", "deleted": True}


@pytest.fixture
def cma(tmp_path):
    cfg = tmp_path / "cfg"
    w(cfg / "rdma_cm" / "rxe0" / "ports" / "1" / "default_roce_mode", "RoCE v2")
    sysfs = tmp_path / "sys"
    make_rxe(sysfs)
    return cfg, sysfs


def test_roce_mode_get_set(cma, monkeypatch):
    cfg, sysfs = cma
    assert rdma.get_roce_mode("rxe0", 1, configfs=str(cfg), load_modules=False)["mode"] == "v2"
    r = rdma.set_roce_mode("rxe0", 1, "v1", configfs=str(cfg), sysfs=str(sysfs), load_modules=False)
    assert (r["mode"], r["was"], r["raw"]) == ("v1", "v2", "IB/RoCE v1")
    assert (cfg / "rdma_cm" / "rxe0").is_dir()        # it existed before: left in place
    with pytest.raises(RdmaError, match="rxe0 has no port 2"):
        rdma.get_roce_mode("rxe0", 2, configfs=str(cfg), load_modules=False)
    with pytest.raises(RdmaError, match="is not v1 or v2"):
        rdma.set_roce_mode("rxe0", 1, "v3", configfs=str(cfg), load_modules=False)


def test_roce_mode_refused_names_reason(cma, monkeypatch):
    cfg, sysfs = cma
    real_open = open

    def refusing(path, mode="r", *a, **kw):
        if str(path).endswith("default_roce_mode") and "w" in mode:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, mode, *a, **kw)
    monkeypatch.setattr(rdma, "open", refusing, raising=False)
    with pytest.raises(RdmaError) as ei:
        rdma.set_roce_mode("rxe0", 1, "v1", configfs=str(cfg), sysfs=str(sysfs), load_modules=False)
    assert ei.value.message == "rxe0 port 1 refuses RoCE v1 (EINVAL): its GID table has only RoCE v2 entries"
    assert "Soft-RoCE (rxe) supports RoCE v2 only" in ei.value.fix


def test_roce_mode_no_device(tmp_path, monkeypatch):
    cfg = tmp_path / "cfg"
    (cfg / "rdma_cm").mkdir(parents=True)

    def enodev(p, *a):
        raise OSError(errno.ENODEV, "No such device")
    monkeypatch.setattr(rdma.os, "mkdir", enodev)
    with pytest.raises(RdmaError, match=r"no RDMA device nosuch \(mkdir .*ENODEV\)"):
        rdma.get_roce_mode("nosuch", 1, configfs=str(cfg), load_modules=False)


def test_roce_mode_no_rdma_cm(tmp_path):
    (tmp_path / "cfg").mkdir()
    with pytest.raises(RdmaError, match="rdma_cm is not loaded"):
        rdma.get_roce_mode("rxe0", 1, configfs=str(tmp_path / "cfg"), load_modules=False)
    with pytest.raises(RdmaError, match="configfs is not mounted"):
        rdma.get_roce_mode("rxe0", 1, configfs=str(tmp_path / "none"), load_modules=False)


def test_add_siw_runs_rdma_link_add_type_siw_and_status_calls_it_iwarp(tmp_path):
    sysfs = tmp_path / "sys"
    (sysfs / "class" / "net" / "siwnet0").mkdir(parents=True)
    run = runner_for({("rdma", "link add siw0 type siw netdev siwnet0"): ToolResult(["rdma"], 0, "", "")})

    class R(Rdma):
        def link_add(self, name, netdev, kind="rxe"):
            super().link_add(name, netdev, kind)
            d = make_rxe(sysfs, name, netdev)
            w(d / "node_type", "4: RNIC")  # what siw shows: an iWARP RNIC, not an InfiniBand/RoCE CA
    r = rdma.add_siw("siwnet0", sysfs=str(sysfs), rdma=R(run), load_modules=False, timeout=1)
    assert r["kind"] == "siw" and r["active"] and r["device"]["iwarp"]
    assert ("rdma", ["link", "add", "siw0", "type", "siw", "netdev", "siwnet0"]) in run.calls
    rxe = make_rxe(sysfs, "rxe0", "rxenet0")
    by_name = {d["name"]: d for d in rdma.devices(str(sysfs))}
    assert by_name["siw0"]["iwarp"] and not by_name["rxe0"]["iwarp"]
    assert rxe.exists()
    (sysfs / "class" / "net" / "lo").mkdir()
    with pytest.raises(RdmaError, match="Soft-iWARP over lo"):
        rdma.add_siw("lo", sysfs=str(sysfs), load_modules=False)
