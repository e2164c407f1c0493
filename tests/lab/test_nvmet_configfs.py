"""`nvmeof-roce nvmet apply/show/save/clear` against the real kernel nvmet (6.1, and 6.12) over Soft-RoCE.

Two subsystems with file (tmpfs, buffered_io) and block (loop) namespaces, two RDMA ports
(10.99.0.1:4420 and :4421), an allow-list; show == file; discovery over rxe sees it; a changed file
changes only the difference while a connected host's I/O on an unchanged namespace goes on; save ->
clear -> apply round-trips exactly. Everything made here is removed at the end.
"""
import copy
import json
import os
import subprocess

import pytest

from kernel_helpers import (HOSTNQN, LAB_IP, block_device_of, cli, disconnect_quietly, is_subset, loop_detach,
                            loop_device, modprobe, save_capture, sparse_file)
from nvmeof_roce.config import parse_config

pytestmark = pytest.mark.lab

SA = "nqn.2024-01.io.nvmeof-roce:kt-a"
SB = "nqn.2024-01.io.nvmeof-roce:kt-b"
OTHER_HOST = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000b2"
PORT_A, PORT_B = 101, 102


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    modprobe("nvmet", "nvmet_rdma", "nvme_rdma")
    d = "/tmp/nvmeof-kt"          # /tmp is tmpfs in the guest: file namespaces need buffered_io
    os.makedirs(d, exist_ok=True)
    files = {n: sparse_file(f"{d}/{n}.img", 32) for n in ("a1", "b1", "b1new")}
    loop = loop_device(f"{d}/loop.img", 32)
    cfgdir = tmp_path_factory.mktemp("kt")
    env = {"dir": d, "files": files, "loop": loop, "cfgdir": cfgdir}
    yield env
    disconnect_quietly(SA, SB)
    # remove exactly what this module made (others' objects stay); nothing of ours may stay
    from nvmeof_roce.kernel import apply as applymod
    from nvmeof_roce.kernel.nvmet import Root
    applymod.remove(Root(), parse_config(config(env), "kt.json"))
    left = cli("nvmet", "show", "--json")
    assert not [s for s in left["subsystems"] if s["nqn"] in (SA, SB)]
    assert not [p for p in left["ports"] if p["portid"] in (PORT_A, PORT_B)]
    loop_detach(loop)


def _write(path, data):
    path.write_text(json.dumps(data, indent=2))
    return str(path)


def config(env):
    f = env["files"]
    return {
        "hosts": [{"nqn": HOSTNQN}, {"nqn": OTHER_HOST}],
        "ports": [
            {"portid": PORT_A, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": LAB_IP, "trsvcid": "4420",
                                        "treq": "not specified"}, "subsystems": [SA, SB]},
            {"portid": PORT_B, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": LAB_IP, "trsvcid": "4421",
                                        "treq": "not specified"}, "param": {"inline_data_size": "8192"},
             "subsystems": [SB]},
        ],
        "subsystems": [
            {"nqn": SA, "attr": {"allow_any_host": "1", "serial": "kt-a-serial", "model": "nvmeof-roce lab"},
             "namespaces": [{"nsid": 1, "device": {"path": f["a1"]}, "buffered_io": 1},
                            {"nsid": 2, "device": {"path": env["loop"]}}]},
            {"nqn": SB, "attr": {"allow_any_host": "0"}, "allowed_hosts": [HOSTNQN],
             "namespaces": [{"nsid": 1, "device": {"path": f["b1"]}, "buffered_io": 1}]},
        ],
    }


def mine(dump):
    """The part of a kernel dump this module owns."""
    return {"subsystems": [s for s in dump["subsystems"] if s["nqn"] in (SA, SB)],
            "ports": [p for p in dump["ports"] if p["portid"] in (PORT_A, PORT_B)],
            "hosts": [h for h in dump["hosts"] if h["nqn"] in (HOSTNQN, OTHER_HOST)]}


def test_1_apply_two_subsystems_and_show_equals_file(lab):
    data = config(lab)
    path = _write(lab["cfgdir"] / "kt.json", data)
    plan = cli("nvmet", "apply", path, "--dry-run", "--no-prune", "--json")
    assert plan["dry_run"] and any(s["description"] == f"+ create subsystem {SA}" for s in plan["steps"])
    assert mine(cli("nvmet", "show", "--json"))["subsystems"] == []      # the dry run changed nothing
    done = cli("nvmet", "apply", path, "--json")
    assert done["steps"]
    shown = cli("nvmet", "show", "--json")
    save_capture("nvmet-show.json", json.dumps(shown, indent=2))
    # what we wrote in the file is exactly what the kernel reports (plus the kernel's other attributes)
    is_subset(data, shown)
    expanded = parse_config(data, path).to_dict()    # generated serial/uuids included
    is_subset(expanded, mine(shown))
    sa = next(s for s in shown["subsystems"] if s["nqn"] == SA)
    assert [n["enable"] for n in sa["namespaces"]] == [1, 1] and sa["namespaces"][0]["buffered_io"] == 1
    sb = next(s for s in shown["subsystems"] if s["nqn"] == SB)
    assert sb["allowed_hosts"] == [HOSTNQN] and sb["attr"]["allow_any_host"] == "0"
    # apply again: nothing to change
    assert cli("nvmet", "apply", path, "--json")["steps"] == []


def test_2_discover_over_rxe_sees_both_ports(lab):
    d4420 = cli("host", "discover", "-a", LAB_IP, "-s", "4420", "--json")
    nqns = {r["subnqn"] for r in d4420["records"]}
    assert {SA, SB} <= nqns, nqns
    d4421 = cli("host", "discover", "-a", LAB_IP, "-s", "4421", "--json")
    recs = {(r["subnqn"], r["trsvcid"], r["portid"]) for r in d4421["records"]}
    assert (SB, "4421", PORT_B) in recs and (SA, "4421", PORT_B) not in recs
    # the allow-list: another host does not see SB
    other = cli("host", "discover", "-a", LAB_IP, "-s", "4420", "-q", OTHER_HOST, "--json")
    assert SB not in {r["subnqn"] for r in other["records"]} and SA in {r["subnqn"] for r in other["records"]}


def test_3_changed_file_changes_only_the_difference_while_io_runs(lab):
    data = config(lab)
    cli("host", "connect", "-a", LAB_IP, "-s", "4420", "-n", SA, "--json")
    try:
        dev = block_device_of(SA, 2)                 # the loop-backed namespace, unchanged below
        pattern = os.urandom(1 << 20)
        with open(dev, "r+b", buffering=0) as f:
            f.write(pattern)
            os.fsync(f.fileno())
        # continuous reads on the unchanged namespace while the file changes other things
        dd = subprocess.Popen(["dd", f"if={dev}", "of=/dev/null", "bs=64k", "count=2000", "iflag=direct"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        new = copy.deepcopy(data)
        new["subsystems"][1]["namespaces"][0]["device"]["path"] = lab["files"]["b1new"]   # SB ns1: new file
        new["subsystems"][1]["allowed_hosts"].append(OTHER_HOST)                        # SB: allow a host
        new["ports"][1]["param"]["inline_data_size"] = "16384"                           # port B param
        path = _write(lab["cfgdir"] / "kt2.json", new)
        plan = cli("nvmet", "apply", path, "--dry-run", "--json")["steps"]
        touched = {s["path"] for s in plan}
        assert not [p for p in touched if p.startswith(f"subsystems/{SA}")], touched
        assert not [p for p in touched if p.startswith(f"ports/{PORT_A}")], touched
        assert [s["path"].rsplit("/", 1)[1] for s in plan if s["path"].startswith(f"subsystems/{SB}/namespaces/1")] \
            == ["enable", "device_path", "enable"]
        assert {f"ports/{PORT_B}/subsystems/{SB}", f"ports/{PORT_B}/param_inline_data_size"} <= touched
        assert f"subsystems/{SB}/allowed_hosts/{OTHER_HOST}" in touched
        done = cli("nvmet", "apply", path, "--json")["steps"]
        assert [s["path"] for s in done] == [s["path"] for s in plan if s["op"] != "module"]
        out, err = dd.communicate(timeout=300)
        assert dd.returncode == 0, f"I/O on the unchanged namespace failed during apply: {err}"
        with open(dev, "rb", buffering=0) as f:
            assert f.read(1 << 20) == pattern
        shown = cli("nvmet", "show", "--json")
        is_subset(new, shown)
        # the controller stayed live the whole time
        subs = cli("host", "list", "--json")["subsystems"]
        assert [p["state"] for s in subs if s["nqn"] == SA for p in s["paths"]] == ["live"]
    finally:
        cli("host", "disconnect", "-n", SA, ok=None)


def test_4_save_clear_apply_round_trips_exactly(lab):
    saved = lab["cfgdir"] / "saved.json"
    cli("nvmet", "save", saved, "--json")
    first = json.loads(saved.read_text())
    assert oct(saved.stat().st_mode & 0o777) == "0o600"
    assert first == cli("nvmet", "show", "--json")
    cleared = cli("nvmet", "clear", "--json")
    assert SA in cleared["removed"]["subsystems"]
    empty = cli("nvmet", "show", "--json")
    assert empty["subsystems"] == [] and empty["ports"] == [] and empty["hosts"] == []
    cli("nvmet", "apply", saved, "--json")
    assert cli("nvmet", "show", "--json") == first
    cli("nvmet", "save", lab["cfgdir"] / "saved2.json")
    assert json.loads((lab["cfgdir"] / "saved2.json").read_text()) == first


def test_5_kernel_rules_come_back_as_clear_errors(lab):
    bad = config(lab)
    bad["subsystems"][0]["namespaces"][0].pop("buffered_io")       # tmpfs file without buffered_io
    bad["subsystems"][0]["namespaces"][0]["nsid"] = 9
    release = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    if release < (6, 6):  # tmpfs does O_DIRECT since Linux 6.6: there nvmet takes the file as it is
        p = cli("nvmet", "apply", _write(lab["cfgdir"] / "bad.json", bad), ok=False)
        assert "is on tmpfs, which refuses the O_DIRECT nvmet uses" in p.stderr and '"buffered_io": 1' in p.stderr
    ram = cli("nvmet", "apply", "targets/ram.json", ok=False)
    assert "subsystems[0].namespaces[0].nvmeof_roce: only the userspace target" in ram.stderr
    wrong = config(lab)
    wrong["ports"][0]["addr"]["traddr"] = "10.99.0.77"
    p = cli("nvmet", "apply", _write(lab["cfgdir"] / "wrong.json", wrong), ok=False)
    assert "could not listen on 10.99.0.77:4420 with RDMA" in p.stderr and "rdma add-rxe" in p.stderr
    # the tree is still the good one for everything but the failed step's own objects
    cli("nvmet", "apply", _write(lab["cfgdir"] / "good.json", config(lab)), "--json")
    is_subset(config(lab), cli("nvmet", "show", "--json"))
