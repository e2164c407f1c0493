"""The `nvmet`, `host` and `rdma` commands through nvmeof_roce.cli.main (exit codes, --json, messages)."""
import json
from pathlib import Path

import pytest

from nvmeof_roce import cli
from nvmeof_roce.kernel import host_commands, nvmet_commands, rdma_commands
from nvmeof_roce.kernel import nvme_cli
from nvmeof_roce.kernel.nvmet import Root
from nvmeof_roce.kernel.tool import ToolResult
from fake_nvmet import FakeNvmetFS

FIX = Path(__file__).parent / "fixtures" / "nvme-cli-2.3"
S1 = "nqn.2024-01.io.example:one"


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    (tmp_path / "a.img").write_bytes(b"")
    fs = FakeNvmetFS(tmp_path / "cfs")
    root = Root(fs.root, fs=fs, sys_module=fs.sys_module)
    monkeypatch.setattr(nvmet_commands, "Root", lambda path: root)
    cfg = {"ports": [{"portid": 1, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": "10.99.0.1",
                                            "trsvcid": "4420"}, "subsystems": [S1]}],
           "subsystems": [{"nqn": S1, "namespaces": [{"nsid": 1, "device": {"path": str(tmp_path / "a.img")}}]}]}
    f = tmp_path / "k.json"
    f.write_text(json.dumps(cfg))
    return root, f, tmp_path


def run(capsys, *argv):
    code = cli.main(list(map(str, argv)))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_nvmet_apply_dry_run_then_apply(kernel, capsys):
    root, f, _ = kernel
    code, out, _ = run(capsys, "nvmet", "apply", f, "--dry-run", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["dry_run"] is True and root.subsystems == []
    assert {"op": "mkdir", "path": f"subsystems/{S1}", "description": f"+ create subsystem {S1}",
            "field": "subsystems[0]"} in plan["steps"]
    code, out, _ = run(capsys, "nvmet", "apply", f)
    assert code == 0 and f"+ link subsystem {S1} to port 1" in out
    code, out, _ = run(capsys, "nvmet", "apply", f)
    assert code == 0 and out.strip() == "nothing to change"


def test_nvmet_show_save_clear(kernel, capsys):
    root, f, tmp = kernel
    run(capsys, "nvmet", "apply", f)
    code, out, _ = run(capsys, "nvmet", "show")
    assert code == 0 and f"    {S1}  allow_any_host=1" in out and "1: rdma ipv4 10.99.0.1:4420  enabled" in out
    code, out, _ = run(capsys, "nvmet", "show", "--json")
    assert json.loads(out) == root.dump()
    saved = tmp / "s" / "config.json"
    code, out, _ = run(capsys, "nvmet", "save", saved, "--json")
    assert code == 0 and json.loads(out) == {"file": str(saved), "subsystems": 1, "ports": 1, "hosts": 0}
    assert json.loads(saved.read_text()) == root.dump()
    code, out, _ = run(capsys, "nvmet", "clear", "--json")
    assert json.loads(out) == {"removed": {"subsystems": [S1], "ports": [1], "hosts": []}}
    assert root.dump()["subsystems"] == []


def test_nvmet_restore_and_connected_hosts(kernel, capsys):
    root, f, tmp = kernel
    code, out, _ = run(capsys, "nvmet", "restore", tmp / "missing.json")
    assert code == 0 and "no saved config, nothing to restore" in out
    code, out, _ = run(capsys, "nvmet", "restore", f, "--json")
    assert code == 0 and json.loads(out)["restored"] is True and [s["nqn"] for s in root.dump()["subsystems"]] == [S1]
    code, out, _ = run(capsys, "nvmet", "restore", f)  # the kernel already matches: nothing to do
    assert code == 0 and "(0 change(s))" in out
    # connected hosts: none listed where the kernel has no debugfs nvmet directory
    code, out, _ = run(capsys, "nvmet", "show", "--debugfs", tmp / "no-debugfs")
    assert "connected hosts: unknown: this kernel does not list" in out
    ctrl = tmp / "dbg" / S1 / "ctrl3"
    ctrl.mkdir(parents=True)
    for name, value in (("hostnqn", "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000a001"),
                        ("port", "1"), ("kato", "5"), ("state", "live"), ("host_traddr", "10.99.0.2")):
        (ctrl / name).write_text(value + "\n")
    code, out, _ = run(capsys, "nvmet", "show", "--json", "--connected", "--debugfs", tmp / "dbg")
    d = json.loads(out)
    assert d["config"] == root.dump() and d["connected_hosts"] == [{
        "subnqn": S1, "cntlid": 3, "hostnqn": "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000a001",
        "port": "1", "kato": 5, "state": "live", "host_traddr": "10.99.0.2"}]
    code, out, _ = run(capsys, "nvmet", "show", "--debugfs", tmp / "dbg")
    assert "connected hosts (1)" in out and "controller 3  port 1  10.99.0.2  live" in out


def test_nvmet_errors_exit_1(kernel, capsys):
    root, f, tmp = kernel
    code, _, err = run(capsys, "nvmet", "apply", "targets/ram.json")
    assert code == 1 and "subsystems[0].namespaces[0].nvmeof_roce: only the userspace target" in err
    bad = tmp / "bad.json"
    bad.write_text(json.dumps({"subsystems": [{"nqn": S1, "namespaces": [{"nsid": 0, "device": {"path": "/x"}}]}]}))
    code, _, err = run(capsys, "nvmet", "apply", bad)
    assert code == 1 and f"{bad}: subsystems[0].namespaces[0].nsid: must be 1..0xFFFFFFFE, got 0" in err
    assert "fix:" in err


def fake_cli(monkeypatch, responses, tmp_path):
    (tmp_path / "hostnqn").write_text("nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000a001\n")
    calls = []

    def runner(tool, args, package, timeout=None):
        calls.append(args)
        return responses[args[0]]
    monkeypatch.setattr(host_commands, "_cli", lambda args=None: nvme_cli.NvmeCli(
        runner=runner, load_modules=False, etc_dir=str(tmp_path), kernel_log=lambda: "",
        config_json=getattr(args, "config", None)))
    return calls


def test_host_commands(monkeypatch, tmp_path, capsys):
    ok = lambda name: ToolResult(["nvme"], 0, (FIX / name).read_text(), "")
    calls = fake_cli(monkeypatch, {"discover": ok("discover.json"), "connect": ok("connect.json"),
                                   "list-subsys": ok("list-subsys.json"), "list": ok("list-verbose.json"),
                                   "disconnect": ToolResult(["nvme"], 0, "NQN:x disconnected 1 controller(s)", "")},
                     tmp_path)
    code, out, _ = run(capsys, "host", "discover", "-a", "10.99.0.1", "--json")
    assert code == 0 and [r["subnqn"] for r in json.loads(out)["records"]][1] == "nqn.2024-01.io.example:cap1"
    code, out, _ = run(capsys, "host", "discover", "-a", "10.99.0.1")
    assert "discovery log of 10.99.0.1:4420 (2 records, generation 4)" in out
    code, out, _ = run(capsys, "host", "connect", "-a", "10.99.0.1", "-n", "nqn.2024-01.io.example:cap1",
                       "-i", "2", "--json")
    assert code == 0 and json.loads(out)["controller"] == "nvme0"
    assert "--nr-io-queues" in calls[-1]
    code, out, _ = run(capsys, "host", "list")
    assert "nvme-subsys0  nqn.2024-01.io.example:cap1" in out and "nvme0  rdma  10.99.0.1:4420  live" in out
    assert "/dev/nvme0n1  nsid 1" in out
    code, out, _ = run(capsys, "host", "disconnect", "-n", "x", "--json")
    assert code == 0 and json.loads(out)["disconnected"] == 1
    code, _, err = run(capsys, "host", "disconnect")
    assert code == 1 and "give --nqn NQN or --device nvmeN" in err


def test_host_nvme_cli_habits(monkeypatch, tmp_path, capsys):
    ok = lambda name: ToolResult(["nvme"], 0, (FIX / name).read_text(), "")
    calls = fake_cli(monkeypatch, {"discover": ok("discover.json"), "connect": ok("connect.json"),
                                   "connect-all": ToolResult(["nvme"], 0, "", ""),
                                   "list-subsys": ok("list-subsys.json")}, tmp_path)
    code, out, _ = run(capsys, "host", "connect", "-a", "10.99.0.1", "-n", S1, "-o", "json", "-T", "104", "-P", "1",
                       "-W", "2", "-D", "--disable-sqflow")
    assert code == 0 and json.loads(out)["controller"] == "nvme0"
    args = calls[-1]
    for flag, value in (("--tos", "104"), ("--nr-poll-queues", "1"), ("--nr-write-queues", "2")):
        assert args[args.index(flag) + 1] == value
    assert "--duplicate-connect" in args and "--disable-sqflow" in args
    code, out, _ = run(capsys, "host", "connect", "-a", "10.99.0.1", "-n", S1, "--output-format", "normal")
    assert out.startswith("connected ") and "--tos" not in calls[-1] and "--duplicate-connect" not in calls[-1]
    # discover with no address: every line of discovery.conf, as nvme-cli
    code, _, err = run(capsys, "host", "discover")
    assert code == 1 and "discovery.conf lists no discovery controller" in err
    (tmp_path / "discovery.conf").write_text("# controllers\n--transport=rdma --traddr=10.99.0.1 --trsvcid=4420\n"
                                             "-t rdma -a 10.99.0.2 -s 4421 -p\n")
    code, out, _ = run(capsys, "host", "discover", "-o", "json")
    logs = json.loads(out)
    assert code == 0 and [(r["traddr"], r["trsvcid"]) for r in logs] == [("10.99.0.1", "4420"), ("10.99.0.2", "4421")]
    discovers = [c for c in calls if c[0] == "discover"]
    assert "--persistent" not in discovers[-2] and "--persistent" in discovers[-1]
    code, out, _ = run(capsys, "host", "discover", "-a", "10.99.0.3", "-p")
    assert "--persistent" in calls[-1] and "discovery log of 10.99.0.3:4420" in out
    code, out, _ = run(capsys, "host", "connect-all", "--json")
    assert code == 0 and [c[c.index("--traddr") + 1] for c in calls if c[0] == "connect-all"] == \
        ["10.99.0.1", "10.99.0.2"]
    (tmp_path / "discovery.conf").write_text("--traddr=10.99.0.1 --colour=red\n")
    code, _, err = run(capsys, "host", "discover")
    assert code == 1 and "discovery.conf:1: unknown option '--colour'" in err


def test_host_nvme_cli_letters_verified_in_its_fabrics_c(monkeypatch, tmp_path, capsys):
    """nvme-cli's letters as its fabrics.c defines them (2.3, Debian 12's; 2.13 the same but -d): connect -d is
    --disable-sqflow; -g/-G are NVMe/TCP's digests, passed for tcp and refused for rdma (the kernel's nvme-rdma
    takes no hdr_digest/data_digest); discover -n names the discovery controller's NQN; disconnect-all -r keeps
    to one transport and never counts a PCIe controller."""
    ok = lambda name: ToolResult(["nvme"], 0, (FIX / name).read_text(), "")
    subsystems = json.loads((FIX / "list-subsys.json").read_text())  # the recorded rdma path, and a local drive
    subsystems[0]["Subsystems"].append({"Name": "nvme-subsys1", "NQN": "nqn.2014.08.org.nvmexpress:local-drive",
                                        "Paths": [{"Name": "nvme1", "Transport": "pcie", "Address": "0000:01:00.0",
                                                   "State": "live"}]})
    calls = fake_cli(monkeypatch, {"discover": ok("discover.json"), "connect": ok("connect.json"),
                                   "disconnect-all": ToolResult(["nvme"], 0, "", ""),
                                   "list-subsys": ToolResult(["nvme"], 0, json.dumps(subsystems), "")}, tmp_path)
    code, _, err = run(capsys, "host", "connect", "-a", "10.99.0.1", "-n", S1, "-d")
    assert code == 0 and "--disable-sqflow" in calls[-1] and "--duplicate-connect" not in calls[-1], err
    before = len(calls)
    for letter, name in (("-g", "hdr_digest"), ("-G", "data_digest")):
        code, _, err = run(capsys, "host", "connect", "-a", "10.99.0.1", "-n", S1, letter)
        assert code == 1 and f"{letter}/--{name.replace('_', '-')}: NVMe/TCP's PDU digest" in err, err
        assert f"invalid parameter '{name}'" in err and "-t tcp only" in err
    assert len(calls) == before  # refused before nvme-cli ran
    code, _, err = run(capsys, "host", "connect", "-t", "tcp", "-a", "10.99.0.1", "-n", S1, "-g", "-G")
    assert code == 0 and "--hdr-digest" in calls[-1] and "--data-digest" in calls[-1], err
    unique = "nqn.2014-08.org.example:discovery-a"
    code, out, err = run(capsys, "host", "discover", "-a", "10.99.0.1", "-n", unique, "--json")
    assert code == 0, err
    assert calls[-1][0] == "discover" and calls[-1][calls[-1].index("--nqn") + 1] == unique
    code, out, err = run(capsys, "host", "disconnect-all", "-r", "rdma", "--json")
    assert code == 0 and calls[-1] == ["disconnect-all", "--transport", "rdma"], (calls[-1], err)
    result = json.loads(out)
    assert result["transport"] == "rdma" and result["disconnected"]
    assert all(c["transport"] == "rdma" for c in result["disconnected"])
    code, out, _ = run(capsys, "host", "disconnect-all", "-r", "tcp", "--json")
    assert code == 0 and json.loads(out)["disconnected"] == []  # the recorded host has no tcp path
    code, out, _ = run(capsys, "host", "disconnect-all")  # nvme-cli leaves PCIe controllers alone: so says the count
    assert code == 0 and calls[-1] == ["disconnect-all"] and out.strip() == "disconnected 1 controller(s)", out


def test_host_connect_failure_message(monkeypatch, tmp_path, capsys):
    fake_cli(monkeypatch, {"connect": ToolResult(["nvme"], 1, "", "already connected\n")}, tmp_path)
    code, _, err = run(capsys, "host", "connect", "-a", "10.99.0.1", "-n", S1)
    assert code == 1 and f"already connected to {S1}" in err


@pytest.mark.parametrize("argv,words", [
    (["host", "connect", "-a", "10.99.0.1", "-n", S1, "-s", "99999"], "--trsvcid '99999': must be a port number"),
    (["host", "connect", "-a", "10.99.0.1", "-n", S1, "-Q", "1"], "--queue-size 1: must be at least 2"),
    (["host", "connect", "-a", "10.99.0.1", "-n", S1, "-l", "-5"], "--ctrl-loss-tmo -5: must be -1"),
    (["host", "connect", "-a", "10.99.0.1", "-n", S1, "-T", "300"], "--tos 300: must be 0..255"),
    (["host", "connect", "-a", "10.99.0.1", "-n", S1, "-P", "-1"], "--nr-poll-queues -1: must be 0 or more"),
    (["host", "connect-all", "-a", "10.99.0.1", "-D"], "connect-all cannot duplicate connections"),
    (["rdma", "roce-mode", "rxe0"], "roce-mode DEV needs a PORT too"),
])
def test_bad_options(argv, words, capsys):
    code, _, err = run(capsys, *argv)
    assert code == 1 and words in err


def test_rdma_status_json(monkeypatch, capsys):
    st = {"devices": [{"name": "rxe0", "soft_roce": True, "node_type": "CA", "node_guid": "g",
                       "ports": [{"port": 1, "state": "ACTIVE", "phys_state": "LinkUp", "link_layer": "Ethernet",
                                  "netdev": "rxenet0", "active_mtu": 1024, "default_roce_mode": "v2",
                                  "gids": [{"index": 1, "gid": "::ffff:10.99.0.1", "type": "RoCE v2",
                                            "netdev": "rxenet0", "ip": "10.99.0.1"}]}]}]}
    monkeypatch.setattr(rdma_commands.softroce, "status", lambda: st)
    code, out, _ = run(capsys, "rdma", "status", "--json")
    assert code == 0 and json.loads(out) == st
    code, out, _ = run(capsys, "rdma", "status")
    assert "rxe0  Soft-RoCE" in out and "::ffff:10.99.0.1  RoCE v2" in out


def test_host_connect_passes_dhchap_keys_to_nvme_cli(monkeypatch, tmp_path, capsys):
    from nvmeof_roce.nvme.auth import generate_secret
    key, ctrl_key = generate_secret(1), generate_secret(3)
    ok = lambda name: ToolResult(["nvme"], 0, (FIX / name).read_text(), "")
    calls = fake_cli(monkeypatch, {"connect": ok("connect.json"), "discover": ok("discover.json"),
                                   "list-subsys": ok("list-subsys.json"), "connect-all": ToolResult(["nvme"], 0, "", "")},
                     tmp_path)
    code, out, _ = run(capsys, "host", "connect", "-a", "10.99.0.1", "-n", S1, "-S", key, "-C", ctrl_key, "--json")
    assert code == 0
    args = calls[-1]
    assert args[args.index("--dhchap-secret") + 1] == key and args[args.index("--dhchap-ctrl-secret") + 1] == ctrl_key
    code, out, _ = run(capsys, "host", "connect-all", "-a", "10.99.0.1", "--dhchap-secret", key, "--json")
    assert calls[-2][0] == "connect-all" and key in calls[-2] and "--dhchap-ctrl-secret" not in calls[-2]


@pytest.mark.parametrize("argv,words", [
    (["-S", "DHHC-1:01:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8AAAAA:"], "--dhchap-secret: the key's CRC-32"),
    (["-S", "secret"], "--dhchap-secret: not a DH-HMAC-CHAP secret"),
    (["-C", "DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:"], "--dhchap-ctrl-secret without --dhchap-secret"),
])
def test_host_connect_bad_keys_never_reach_nvme_cli(monkeypatch, tmp_path, capsys, argv, words):
    calls = fake_cli(monkeypatch, {}, tmp_path)
    code, _, err = run(capsys, "host", "connect", "-a", "10.99.0.1", "-n", S1, *argv)
    assert code == 1 and words in err and calls == []


def test_gen_dhchap_key_matches_nvme_cli(capsys):
    # `nvme gen-dhchap-key -s 00010203...1f -m 1 -l 32 -n NQN` (nvme-cli 2.3) prints this
    code, out, _ = run(capsys, "gen-dhchap-key", "-m", "1", "-l", "32", "-s", bytes(range(32)).hex(), "-n",
                       "nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555")
    assert code == 0 and out.strip() == "DHHC-1:01:bOHk6jHoMxpP5YJr/eF6XNOGuPAzh0iRniebpsVb9ydqVuR5:"
    code, _, err = run(capsys, "gen-dhchap-key", "-m", "3", "-l", "32", "-n", "nqn.x")
    assert code == 1 and "does not match the hmac(sha512) transformation" in err
    code, _, err = run(capsys, "gen-dhchap-key", "-s", "zz")
    assert code == 1 and "not hexadecimal" in err
