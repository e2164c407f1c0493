"""nvme-cli wrapper: parsers on outputs captured from nvme-cli 2.3 (Debian bookworm) in the lab, other
2.x/1.x shapes, failure messages (stderr + kernel log captured in the lab), argv built for nvme."""
import json
from pathlib import Path

import pytest

from nvmeof_roce.kernel import nvme_cli
from nvmeof_roce.kernel.nvme_cli import (
    NvmeCli, NvmeCliError, explain_failure, host_identity, parse_connect, parse_discover, parse_list,
    parse_list_subsys, parse_disconnect,
)
from nvmeof_roce.errors import NvmeofError
from nvmeof_roce.kernel.tool import ToolResult

FIX = Path(__file__).parent / "fixtures" / "nvme-cli-2.3"
CAP1 = "nqn.2024-01.io.example:cap1"


def fx(name):
    return (FIX / name).read_text()


# ---------------------------------------------------------------- parsers, real 2.3 output

def test_discover_23():
    d = parse_discover(fx("discover.json"))
    assert d["genctr"] == 4 and len(d["records"]) == 2
    disc, sub = d["records"]
    assert disc["subtype"] == "current discovery subsystem"
    assert (sub["subnqn"], sub["traddr"], sub["trsvcid"], sub["portid"], sub["trtype"]) == \
        (CAP1, "10.99.0.1", "4420", 1, "rdma")
    assert sub["rdma_pkey"] == 0


def test_connect_23():
    assert parse_connect(fx("connect.json")) == "nvme0"
    assert parse_connect("") is None
    assert parse_connect("device: nvme3\n") == "nvme3"


def test_list_23_plain():
    ns = parse_list(fx("list.json"))
    assert [n["device"] for n in ns] == ["/dev/nvme0n1", "/dev/nvme0n2"]
    n1, n2 = ns
    assert (n1["nsid"], n1["controller"], n1["sector_size"], n1["size_bytes"]) == (1, "nvme0", 512, 268435456000)
    assert (n2["nsid"], n2["sector_size"], n2["max_lba"], n2["serial"]) == (2, 4096, 16384, "serialX")
    assert parse_list(fx("list-empty.json")) == []


def test_list_23_verbose_has_subsystem():
    ns = parse_list(fx("list-verbose.json"))
    assert [(n["device"], n["nsid"], n["subnqn"], n["controller"]) for n in ns] == [
        ("/dev/nvme0n1", 1, CAP1, "nvme0"), ("/dev/nvme0n2", 2, CAP1, "nvme0")]
    assert ns[0]["transport"] == "rdma" and ns[0]["size_bytes"] == 268435456000


def test_list_subsys_23():
    subs = parse_list_subsys(fx("list-subsys.json"))
    assert len(subs) == 1
    s = subs[0]
    assert (s["name"], s["nqn"]) == ("nvme-subsys0", CAP1)
    assert s["hostnqn"].startswith("nqn.2014-08.org.nvmexpress:uuid:")
    assert s["paths"] == [{"name": "nvme0", "transport": "rdma", "address": "traddr=10.99.0.1,trsvcid=4420",
                           "traddr": "10.99.0.1", "trsvcid": "4420", "host_traddr": None, "state": "live"}]
    assert parse_list_subsys(fx("list-subsys-empty.json")) == []


# ---------------------------------------------------------------- other versions' shapes

def test_list_subsys_1x_shape():
    text = json.dumps({"Subsystems": [
        {"Name": "nvme-subsys0", "NQN": CAP1},
        {"Paths": [{"Name": "nvme0", "Transport": "rdma", "Address": "traddr=10.99.0.1 trsvcid=4420", "State": "live"}]},
        {"Name": "nvme-subsys1", "NQN": "nqn.2024-01.io.example:b"},
        {"Paths": [{"Name": "nvme1", "Transport": "rdma", "Address": "traddr=10.99.0.1,trsvcid=4421",
                    "State": "connecting"}]}]})
    subs = parse_list_subsys(text)
    assert [(s["nqn"], [p["name"] for p in s["paths"]]) for s in subs] == [
        (CAP1, ["nvme0"]), ("nqn.2024-01.io.example:b", ["nvme1"])]
    assert subs[1]["paths"][0]["trsvcid"] == "4421" and subs[1]["paths"][0]["state"] == "connecting"
    assert subs[0]["paths"][0]["traddr"] == "10.99.0.1" and subs[0]["paths"][0]["trsvcid"] == "4420"


def test_list_subsys_later_2x_shape():
    # nvme-cli 2.8+: IOPolicy, src_addr in Address
    text = json.dumps([{"HostNQN": "h", "HostID": "i", "Subsystems": [
        {"Name": "nvme-subsys0", "NQN": CAP1, "IOPolicy": "numa",
         "Paths": [{"Name": "nvme0", "Transport": "rdma",
                    "Address": "traddr=10.99.0.1,trsvcid=4420,src_addr=10.99.0.1", "State": "live"}]}]}])
    s = parse_list_subsys(text)[0]
    assert s["iopolicy"] == "numa" and s["paths"][0]["host_traddr"] == "10.99.0.1"


def test_list_later_2x_shape():
    text = json.dumps({"Devices": [{"NameSpace": 1, "DevicePath": "/dev/nvme1n1", "GenericPath": "/dev/ng1n1",
                                    "Firmware": "6.1", "Index": 1, "ModelNumber": "Linux", "SerialNumber": "abc",
                                    "UsedBytes": 4096, "MaximumLBA": 8, "PhysicalSize": 4096, "SectorSize": 512}]})
    (n,) = parse_list(text)
    assert (n["device"], n["nsid"], n["controller"], n["model"]) == ("/dev/nvme1n1", 1, "nvme1", "Linux")


def test_discover_other_shapes():
    d = parse_discover(json.dumps({"genctr": "7", "records": [{"subnqn": "x", "portid": "2", "trsvcid": 4420,
                                                             "rdma_pkey": "0x0000", "traddr": "10.0.0.1 "}]}))
    r = d["records"][0]
    assert (d["genctr"], r["portid"], r["trsvcid"], r["rdma_pkey"], r["traddr"]) == (7, 2, "4420", 0, "10.0.0.1")
    assert parse_discover("") == {"genctr": 0, "records": []}
    with pytest.raises(NvmeCliError, match="not JSON"):
        parse_discover("Discovery Log Number of Records 2")


def test_disconnect_count():
    assert parse_disconnect(f"NQN:{CAP1} disconnected 1 controller(s)\n") == 1
    assert parse_disconnect("NQN:x disconnected 0 controller(s)") == 0


# ---------------------------------------------------------------- failures (stderr and dmesg from the lab)

FAB_EIO = ("Failed to write to /dev/nvme-fabrics: Input/output error\n"
           "could not add new controller: failed to write to nvme-fabrics device\n")
FAB_RESET = ("Failed to write to /dev/nvme-fabrics: Connection reset by peer\n"
             "could not add new controller: failed to write to nvme-fabrics device\n")
FAB_NOOPEN = ("Failed to open /dev/nvme-fabrics: No such file or directory\n"
              "could not add new controller: failed to open nvme-fabrics device\n")
DEAD = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000dead"


def fail(stderr, stdout=""):
    return ToolResult(["nvme", "connect"], 1, stdout, stderr)


def test_failure_host_not_allowed():
    klog = (f"[17.776951] nvmet: connect by host {DEAD} for subsystem {CAP1} not allowed\n"
            f"[17.777927] nvme nvme0: Connect for subsystem {CAP1} is not allowed, hostnqn: {DEAD}\n")
    e = explain_failure("nvme connect", fail(FAB_EIO), "10.99.0.1", "4420", CAP1, DEAD, kernel_log=klog)
    assert f"refused host {DEAD}: it is not in the allowed hosts of {CAP1}" in e.message
    assert "allowed_hosts" in e.fix


def test_failure_no_such_subsystem():
    klog = ('[120.660824] nvme nvme0: Connect Invalid Data Parameter, subsysnqn "nqn.2024-01.io.example:nosuch"\n')
    e = explain_failure("nvme connect", fail(FAB_EIO), "10.99.0.1", "4420", "nqn.2024-01.io.example:nosuch",
                        kernel_log=klog)
    assert "has no subsystem 'nqn.2024-01.io.example:nosuch'" in e.message and "host discover" in e.fix


def test_failure_eio_without_kernel_log():
    e = explain_failure("nvme connect", fail(FAB_EIO), "10.99.0.1", "4420", CAP1)
    assert "rejected the connect command" in e.message and "not allowed or the subsystem does not exist" in e.message


def test_failure_nothing_listening():
    klog = "[120.383997] nvme nvme0: Connect rejected: status 8 (invalid service ID).\n"
    e = explain_failure("nvme connect", fail(FAB_RESET), "10.99.0.1", "4499", CAP1, kernel_log=klog)
    assert "nothing listens at 10.99.0.1:4499" in e.message


def test_failure_unreachable():
    klog = "[120.208563] nvme nvme0: rdma connection establishment failed (-104)\n"
    e = explain_failure("nvme connect", fail(FAB_RESET), "10.99.0.9", "4420", CAP1, kernel_log=klog)
    assert "the target at 10.99.0.9:4420 is unreachable over rdma" in e.message and "rdma status" in e.fix


def test_failure_module_not_loaded():
    e = explain_failure("nvme connect", fail(FAB_NOOPEN), "10.99.0.1", "4420", CAP1)
    assert "module nvme_rdma (and nvme_fabrics) is not loaded" in e.message and e.fix == "modprobe nvme-rdma (as root)"
    e = explain_failure("nvme connect", fail("Failed to write to /dev/nvme-fabrics: Invalid argument"), "x", "1",
                        kernel_log="nvme_fabrics: no handler found for transport rdma.")
    assert "module nvme_rdma is not loaded" in e.message


def test_failure_already_connected():
    e = explain_failure("nvme connect", fail("already connected\n"), "10.99.0.1", "4420", CAP1)
    assert f"already connected to {CAP1}" in e.message and "disconnect" in e.fix


# ---------------------------------------------------------------- host identity

def test_identity_from_etc(tmp_path):
    (tmp_path / "hostnqn").write_text("nqn.2014-08.org.nvmexpress:uuid:e3e6337d-2b0c-4d0f-afc9-bd8228773684\n")
    (tmp_path / "hostid").write_text("77adfae5-a959-4eec-8a09-ad1cef47789e\n")
    i = host_identity(etc_dir=str(tmp_path))
    assert i.hostnqn.endswith("e3e6337d-2b0c-4d0f-afc9-bd8228773684") and i.hostid.startswith("77adfae5")
    assert str(tmp_path / "hostnqn") in i.source
    j = host_identity(hostnqn="nqn.2024-01.io.example:h", etc_dir=str(tmp_path))
    assert j.hostnqn == "nqn.2024-01.io.example:h" and j.hostid.startswith("77adfae5")


def test_identity_without_etc_is_the_machines_dmi_uuid_as_libnvme(tmp_path):
    from nvmeof_roce.host_identity import Paths
    (tmp_path / "product_uuid").write_text("4c4c4544-0042-3510-8052-b4c04f4e4d32\n")
    p = Paths(etc_dir=str(tmp_path / "none"), product_uuid=str(tmp_path / "product_uuid"),
              dmi_entries=str(tmp_path / "none"), device_tree_uuid=str(tmp_path / "none"), environ={})
    a = host_identity(etc_dir=str(tmp_path / "none"), paths=p)
    assert a.hostid == "4c4c4544-0042-3510-8052-b4c04f4e4d32"  # what nvme-cli uses, not a UUID of our own
    assert a.hostnqn == "nqn.2014-08.org.nvmexpress:uuid:" + a.hostid
    assert "product_uuid" in a.source
    with pytest.raises(NvmeofError, match="host ID 'nope' .*is not a UUID"):
        host_identity(hostid="nope", etc_dir=str(tmp_path))


# ---------------------------------------------------------------- the wrapper with a fake nvme

class FakeNvme:
    def __init__(self, responses):
        self.responses = responses    # list of (match-first-arg, ToolResult)
        self.calls = []

    def __call__(self, tool, args, package, timeout=None):
        assert tool == "nvme" and package == "nvme-cli"
        self.calls.append(args)
        for key, res in self.responses:
            if args[0] == key:
                return res
        raise AssertionError(f"unexpected nvme {args}")


def ok(out=""):
    return ToolResult(["nvme"], 0, out, "")


@pytest.fixture
def etc(tmp_path):
    (tmp_path / "hostnqn").write_text("nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000a001\n")
    (tmp_path / "hostid").write_text("00000000-0000-4000-8000-00000000a001\n")
    return str(tmp_path)


def test_connect_argv_and_result(etc):
    fake = FakeNvme([("connect", ok(fx("connect.json")))])
    cli = NvmeCli(runner=fake, load_modules=False, etc_dir=etc, kernel_log=lambda: "")
    r = cli.connect("10.99.0.1", CAP1, 4420, nr_io_queues=2, queue_size=64, keep_alive_tmo=5, ctrl_loss_tmo=-1,
                    reconnect_delay=2)
    assert r["controller"] == "nvme0" and r["hostnqn"].endswith("a001")
    assert fake.calls == [["connect", "--transport", "rdma", "--traddr", "10.99.0.1", "--trsvcid", "4420",
                           "--hostnqn", "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000a001",
                           "--hostid", "00000000-0000-4000-8000-00000000a001", "--nqn", CAP1,
                           "--nr-io-queues", "2", "--queue-size", "64", "--keep-alive-tmo", "5",
                           "--ctrl-loss-tmo", "-1", "--reconnect-delay", "2", "--output-format=json"]]


def test_connect_failure_uses_new_kernel_log_lines_only(etc):
    logs = iter(["[1.0] old: Connect for subsystem x is not allowed, hostnqn: y",
                 "[1.0] old: Connect for subsystem x is not allowed, hostnqn: y\n"
                 "[2.0] nvme nvme0: Connect rejected: status 8 (invalid service ID)."])
    fake = FakeNvme([("connect", ToolResult(["nvme"], 1, "", FAB_RESET))])
    cli = NvmeCli(runner=fake, load_modules=False, etc_dir=etc, kernel_log=lambda: next(logs))
    with pytest.raises(NvmeCliError) as ei:
        cli.connect("10.99.0.1", CAP1, 4499)
    assert "nothing listens at 10.99.0.1:4499" in ei.value.message


def test_disconnect_none_is_an_error(etc):
    fake = FakeNvme([("disconnect", ok("NQN:nqn.2024-01.io.example:nope disconnected 0 controller(s)\n"))])
    cli = NvmeCli(runner=fake, load_modules=False, etc_dir=etc, kernel_log=lambda: "")
    with pytest.raises(NvmeCliError, match="no controller of nqn.2024-01.io.example:nope is connected"):
        cli.disconnect(nqn="nqn.2024-01.io.example:nope")
    fake.responses = [("disconnect", ok(f"NQN:{CAP1} disconnected 1 controller(s)\n"))]
    assert cli.disconnect(nqn=CAP1)["disconnected"] == 1
    with pytest.raises(NvmeCliError, match="exactly one"):
        cli.disconnect()


def test_connect_all_reports_not_connected(etc):
    subs = iter([fx("list-subsys-empty.json"), fx("list-subsys.json")])
    disc = json.loads(fx("discover.json"))
    disc["records"].append(dict(disc["records"][1], subnqn="nqn.2024-01.io.example:closed"))

    def runner(tool, args, package, timeout=None):
        if args[0] == "discover":
            return ok(json.dumps(disc))
        if args[0] == "list-subsys":
            return ok(next(subs))
        if args[0] == "connect-all":
            return ok("")
        raise AssertionError(args)
    cli = NvmeCli(runner=runner, load_modules=False, etc_dir=etc, kernel_log=lambda: "")
    r = cli.connect_all("10.99.0.1", 4420)
    assert r["connected"] == [{"nqn": CAP1, "controller": "nvme0", "traddr": "10.99.0.1", "trsvcid": "4420"}]
    assert r["not_connected"] == ["nqn.2024-01.io.example:closed"]
    assert r["discovered"] == [CAP1, "nqn.2024-01.io.example:closed"]


def test_list_joins_namespaces(etc):
    fake = FakeNvme([("list-subsys", ok(fx("list-subsys.json"))), ("list", ok(fx("list.json")))])
    cli = NvmeCli(runner=fake, load_modules=False, etc_dir=etc, kernel_log=lambda: "")
    r = cli.list()
    assert [n["device"] for n in r["subsystems"][0]["namespaces"]] == ["/dev/nvme0n1", "/dev/nvme0n2"]
    assert all(n["subnqn"] == CAP1 for n in r["namespaces"])


def test_missing_nvme_tool(etc, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(nvme_cli.tool.os.path, "exists", lambda p: False)
    cli = NvmeCli(load_modules=False, etc_dir=etc, kernel_log=lambda: "")
    with pytest.raises(Exception) as ei:
        cli.list_subsystems()
    assert "nvme: command not found" in str(ei.value) and "nvme-cli" in str(ei.value)


# The 6.12 host's messages (nvmf_connect_admin_queue, nvme_auth_negotiate) for a refused authentication
@pytest.mark.parametrize("klog,words", [
    ("[  41.1] nvme nvme0: qid 0: authentication failed, error -13\n", "DH-HMAC-CHAP authentication with"),
    ("[  41.1] nvme nvme0: qid 0: no key\n[  41.1] nvme nvme0: qid 0: authentication setup failed\n",
     "requires DH-HMAC-CHAP authentication and no key was given"),
    ("[  12.3] nvme_fabrics: unknown parameter or missing value 'dhchap_secret=DHHC-1:01:x:' in ctrl creation "
     "request\n", "no NVMe in-band authentication"),
])
def test_authentication_failures_are_named(klog, words):
    e = explain_failure("nvme connect", fail(FAB_EIO), "10.99.0.1", "4420", CAP1, kernel_log=klog)
    assert words in e.message, e.message
    assert e.fix


# ---------------------------------------------------------------- nvme-cli's options: -F, -f, -J, -d, -r, --quiet

HOSTNQN_A001 = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000a001"


def test_connect_passes_fast_io_fail_tmo_host_iface_and_config(etc, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps([{"hostnqn": "nqn.2024-01.io.example:json-host",
                                   "hostid": "0b5e0000-0000-4000-8000-0000000000a1"}]))
    fake = FakeNvme([("connect", ok(fx("connect.json")))])
    cli = NvmeCli(runner=fake, load_modules=False, etc_dir=etc, kernel_log=lambda: "", config_json=str(config))
    r = cli.connect("10.99.0.1", CAP1, 4420, transport="tcp", host_iface="eth1", fast_io_fail_tmo=5)
    assert r["hostnqn"] == "nqn.2024-01.io.example:json-host"  # the -J file's first host comes before /etc/nvme
    assert fake.calls == [["connect", "--transport", "tcp", "--traddr", "10.99.0.1", "--trsvcid", "4420",
                           "--host-iface", "eth1", "--hostnqn", "nqn.2024-01.io.example:json-host",
                           "--hostid", "0b5e0000-0000-4000-8000-0000000000a1", "--nqn", CAP1,
                           "--config", str(config), "--fast_io_fail_tmo", "5", "--output-format=json"]]


def test_host_iface_is_refused_for_rdma_as_libnvme_does(etc):
    cli = NvmeCli(runner=FakeNvme([]), load_modules=False, etc_dir=etc, kernel_log=lambda: "")
    with pytest.raises(NvmeCliError, match="tcp transport only .*not permitted for rdma") as exc:
        cli.connect("10.99.0.1", CAP1, 4420, host_iface="eth1")
    assert "--host-traddr" in exc.value.fix


def test_an_nvme_cli_without_fast_io_fail_tmo_is_named(etc):
    # what Debian 12's nvme-cli 2.3 printed in the lab for the option it does not have (exit 1)
    fake = FakeNvme([("connect", ToolResult(["nvme"], 1, "", fx("connect-fast-io-fail.stderr")))])
    cli = NvmeCli(runner=fake, load_modules=False, etc_dir=etc, kernel_log=lambda: "")
    with pytest.raises(NvmeCliError, match="this nvme-cli has no --fast_io_fail_tmo") as exc:
        cli.connect("10.99.0.1", CAP1, 4420, fast_io_fail_tmo=5)
    assert "upgrade nvme-cli" in exc.value.fix


def _raw_log(entries, genctr=7):
    from nvmeof_roce.nvme.log import DiscoveryLogEntry, DiscoveryLogHeader
    head = DiscoveryLogHeader(genctr=genctr, numrec=len(entries)).pack().ljust(1024, b"\0")
    return head + b"".join(DiscoveryLogEntry(**e).pack() for e in entries)


def test_discover_device_raw_and_quiet(etc, tmp_path):
    raw = tmp_path / "disc.raw"

    def nvme(tool, args, package, timeout=None):
        fake.calls.append(args)
        raw.write_bytes(_raw_log([{"portid": 1, "trsvcid": "4420", "subnqn": CAP1, "traddr": "10.99.0.1"},
                                  {"portid": 1, "trsvcid": "4420", "subtype": 3, "traddr": "10.99.0.1",
                                   "subnqn": "nqn.2014-08.org.nvmexpress.discovery"}]))
        return ok("")  # with --raw nvme-cli prints nothing

    fake = FakeNvme([])
    cli = NvmeCli(runner=nvme, load_modules=False, etc_dir=etc, kernel_log=lambda: "")
    r = cli.discover("10.99.0.1", 4420, device="/dev/nvme3", raw=str(raw), quiet=True)
    assert fake.calls == [["discover", "--transport", "rdma", "--traddr", "10.99.0.1", "--trsvcid", "4420",
                           "--hostnqn", HOSTNQN_A001, "--hostid", "00000000-0000-4000-8000-00000000a001",
                           "--device", "/dev/nvme3", "--quiet", "--raw", str(raw)]]
    assert r["genctr"] == 7 and r["raw"] == str(raw)
    assert [(x["subtype"], x["subnqn"], x["trtype"], x["adrfam"], x["trsvcid"], x["portid"]) for x in r["records"]] == [
        ("nvme subsystem", CAP1, "rdma", "ipv4", "4420", 1),
        ("current discovery subsystem", "nqn.2014-08.org.nvmexpress.discovery", "rdma", "ipv4", "4420", 1)]
    with pytest.raises(NvmeCliError, match="not a controller device"):
        cli.discover("10.99.0.1", 4420, device="sda")


def test_discover_options_through_the_cli(etc, monkeypatch, capsys):
    from nvmeof_roce import cli as main_cli
    seen = {}

    class Recorder(NvmeCli):
        def discover(self, *a, **kw):
            seen.update(kw, config=self.config_json)
            return {"genctr": 1, "records": [], "hostnqn": HOSTNQN_A001}

    monkeypatch.setattr(nvme_cli, "NvmeCli", Recorder)
    code = main_cli.main(["host", "discover", "-a", "10.99.0.1", "-d", "nvme2", "-r", "/tmp/x.raw", "--quiet",
                          "-J", "none", "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["genctr"] == 1
    assert (seen["device"], seen["raw"], seen["quiet"], seen["config"]) == ("nvme2", "/tmp/x.raw", True, "none")
    with pytest.raises(SystemExit):
        main_cli.main(["host", "connect", "-a", "10.99.0.1", "-n", CAP1, "-F", "x"])
    code = main_cli.main(["host", "connect", "-a", "10.99.0.1", "-n", CAP1, "-F", "-2"])
    assert code == 1 and "must be -1 (off) or >= 0" in capsys.readouterr().err


def test_raw_discovery_log_saved_by_nvme_cli():
    """`nvme discover --raw` of nvmet on 6.1 in the lab (the nvmetcli corpus' port; the guest's host NQN is not
    on nvmetcli-auth's allow-list, so the log lists the open subsystem and the discovery subsystem)."""
    from nvmeof_roce.kernel.nvme_cli import parse_raw_discovery
    r = parse_raw_discovery((FIX / "discover.raw").read_bytes())
    assert sorted((x["subnqn"], x["subtype"], x["trtype"], x["adrfam"], x["traddr"], x["trsvcid"], x["portid"])
                  for x in r["records"]) == [
        ("nqn.2014-08.org.nvmexpress.discovery", "current discovery subsystem", "rdma", "ipv4", "10.99.0.1", "4420", 1),
        ("nqn.2024-01.io.nvmeof-roce:nvmetcli-open", "nvme subsystem", "rdma", "ipv4", "10.99.0.1", "4420", 1)]
    assert r["genctr"] >= 1
    with pytest.raises(NvmeCliError, match="shorter than its header"):
        parse_raw_discovery(b"\0" * 100)


def test_resv_commands_argv_and_a_conflict(etc):
    fake = FakeNvme([("resv-acquire", ok()), ("resv-register", ok()), ("resv-release", ok())])
    cli = NvmeCli(runner=fake, load_modules=False, etc_dir=etc, kernel_log=lambda: "")
    cli.resv_register("/dev/nvme1", nrkey=0xA1, cptpl=3, nsid=1)
    cli.resv_acquire("/dev/nvme0n1", 1, 0xA1, racqa=2, prkey=0xB2)
    cli.resv_release("/dev/nvme1", 1, 0xA1, rrela=1, nsid=1)
    assert fake.calls == [
        ["resv-register", "/dev/nvme1", "--rrega=0", "--nrkey=161", "--crkey=0", "--cptpl=3", "--namespace-id=1"],
        ["resv-acquire", "/dev/nvme0n1", "--rtype=1", "--racqa=2", "--crkey=161", "--prkey=178"],
        ["resv-release", "/dev/nvme1", "--rtype=1", "--rrela=1", "--crkey=161", "--namespace-id=1"]]
    fake.responses = [("resv-acquire", ToolResult(["nvme"], 1, "", "NVMe status: Reservation Conflict: The command "
                                                  "was aborted due to a conflict with a reservation held on the "
                                                  "accessed namespace(0x4083)\n"))]
    with pytest.raises(NvmeCliError) as ei:
        cli.resv_acquire("/dev/nvme0n1", 1, 0xA1)
    assert "nvme resv-acquire /dev/nvme0n1: NVMe status: Reservation Conflict" in ei.value.message
    assert "another host holds the reservation" in ei.value.fix
