"""nvmetcli's, nvme-cli's and SPDK rpc.py's habits as an admin brings them: booleans written either way, the
wildcard address, IPv6 listeners, add_host on an open subsystem, the short options, rpc.py's positional forms,
nvmf_create_transport and `host list -o json` in nvme-cli's schema."""
import json

import pytest

from nvmeof_roce import cli
from nvmeof_roce.control.methods import Control
from nvmeof_roce.control.protocol import RpcError
from nvmeof_roce.kernel.nvmet import Root
from nvmeof_roce.kernel import nvmet_commands

from fake_nvmet import FakeNvmetFS
from loopback_env import HOST_A, HOST_B, SUB_ONLY_A, SUB_RAM

NQN = "nqn.2024-01.io.test:habits"
HOST = "nqn.2024-01.io.test:host1"


def config(traddr="10.99.0.1", adrfam="ipv4", attr=None, param=None, allowed=()):
    return {"hosts": [{"nqn": h} for h in allowed],
            "ports": [{"portid": 1, "addr": {"trtype": "rdma", "adrfam": adrfam, "traddr": traddr,
                                             "trsvcid": "4420"}, "param": param or {}, "subsystems": [NQN]}],
            "subsystems": [{"nqn": NQN, "attr": attr or {}, "allowed_hosts": list(allowed),
                            "namespaces": [{"nsid": 1, "enable": True,
                                            "nvmeof_roce": {"backend": "ram", "size": "1M"}}]}]}


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def check(tmp_path, capsys, cfg, *extra):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(cfg))
    return run(capsys, "target", "check", path, *extra)


# ------------------------------------------------------------------------------------------ booleans

def test_json_booleans_are_taken_where_nvmetcli_writes_1_or_0(tmp_path, capsys):
    cfg = config(attr={"allow_any_host": False, "pi_enable": False}, param={"pi_enable": False}, allowed=[HOST])
    code, out, err = check(tmp_path, capsys, cfg, "--json")
    assert code == 0, err
    sub = json.loads(out)["subsystems"][0]
    assert sub["allow_any_host"] is False and sub["allowed_hosts"] == [HOST]
    code, out, _ = check(tmp_path, capsys, config(attr={"allow_any_host": True}), "--json")
    assert code == 0 and json.loads(out)["subsystems"][0]["allow_any_host"] is True
    code, _, err = check(tmp_path, capsys, config(attr={"allow_any_host": "maybe"}))
    assert code == 1 and "subsystems[0].attr.allow_any_host" in err and "0 or 1" in err


def test_json_booleans_reach_the_kernel_as_1_and_0(tmp_path, capsys, monkeypatch):
    fs = FakeNvmetFS(tmp_path / "cfs")
    root = Root(fs.root, fs=fs, sys_module=fs.sys_module)
    monkeypatch.setattr(nvmet_commands, "Root", lambda path: root)
    img = tmp_path / "a.img"
    img.write_bytes(bytes(4096))
    cfg = config(attr={"allow_any_host": False}, allowed=[HOST])
    cfg["subsystems"][0]["namespaces"] = [{"nsid": 1, "enable": True, "device": {"path": str(img)}}]
    path = tmp_path / "k.json"
    path.write_text(json.dumps(cfg))
    code, out, err = run(capsys, "nvmet", "apply", path, "--dry-run", "--json")
    assert code == 0, err
    writes = {s["path"]: s["value"] for s in json.loads(out)["steps"] if s["op"] == "write"}
    assert writes[f"subsystems/{NQN}/attr_allow_any_host"] == "0"
    assert writes[f"subsystems/{NQN}/namespaces/1/enable"] == "1"


def test_rpc_booleans_take_nvmetcli_strings(env):
    control = Control(env.target)
    control.call("nvmf_create_subsystem", {"nqn": NQN, "allow_any_host": "0"})
    assert env.target.subsystems[NQN].allow_any_host is False
    control.call("nvmf_subsystem_allow_any_host", {"nqn": NQN, "allow_any_host": "1"})
    assert env.target.subsystems[NQN].allow_any_host is True
    nsid = control.call("nvmf_subsystem_add_ns", {"nqn": NQN, "namespace": {"backend": "ram", "size": "1M",
                                                                           "no_auto_visible": "1"}})
    assert env.target.config.subsystem(NQN).namespaces[0].visible_hosts == [] and nsid == 1
    with pytest.raises(RpcError) as exc:
        control.call("nvmf_subsystem_allow_any_host", {"nqn": NQN, "allow_any_host": "sometimes"})
    assert exc.value.field == "allow_any_host" and '"1"/"0"' in exc.value.fix


# ---------------------------------------------------------------------------------------- addresses

@pytest.mark.parametrize("traddr,adrfam", [("0.0.0.0", "ipv4"), ("::", "ipv6")])
def test_check_refuses_the_wildcard_address_as_serve_does(tmp_path, capsys, traddr, adrfam):
    code, _, err = check(tmp_path, capsys, config(traddr=traddr, adrfam=adrfam))
    assert code == 1
    assert "ports[0].addr.traddr" in err and "wildcard" in err and "rdma status" in err


def test_ipv6_listeners_print_in_brackets(tmp_path, capsys):
    code, out, err = check(tmp_path, capsys, config(traddr="fe80::1", adrfam="ipv6"))
    assert code == 0, err
    assert "[fe80::1]:4420" in out and "fe80::1:4420" not in out.replace("[fe80::1]:4420", "")


# ------------------------------------------------------------------------------------------ add_host

def test_add_host_on_a_subsystem_that_allows_any_host_lists_it_as_spdk_does(env):
    control = Control(env.target)
    assert env.target.subsystems[SUB_RAM].allow_any_host
    assert control.call("nvmf_subsystem_add_host", {"nqn": SUB_RAM, "host": HOST_B}) is True
    sub = next(s for s in control.call("nvmf_get_subsystems") if s["nqn"] == SUB_RAM)
    assert sub["allow_any_host"] is True and sub["hosts"] == [{"nqn": HOST_B}]
    env.connect(SUB_RAM, hostnqn=HOST_A).close()  # still open to any host
    control.call("nvmf_subsystem_allow_any_host", {"nqn": SUB_RAM, "allow_any_host": False})
    env.connect(SUB_RAM, hostnqn=HOST_B).close()  # the list it was given is the one enforced now
    with pytest.raises(Exception):
        env.connect(SUB_RAM, hostnqn=HOST_A)


def test_the_kernel_path_still_refuses_allow_any_host_with_an_allow_list(tmp_path, capsys, monkeypatch):
    fs = FakeNvmetFS(tmp_path / "cfs")
    monkeypatch.setattr(nvmet_commands, "Root", lambda path: Root(fs.root, fs=fs, sys_module=fs.sys_module))
    img = tmp_path / "a.img"
    img.write_bytes(bytes(4096))
    cfg = config(attr={"allow_any_host": "1"}, allowed=[HOST])
    cfg["subsystems"][0]["namespaces"] = [{"nsid": 1, "device": {"path": str(img)}}]
    path = tmp_path / "k.json"
    path.write_text(json.dumps(cfg))
    code, _, err = run(capsys, "nvmet", "apply", path, "--dry-run")
    assert code == 1 and "subsystems[0].attr.allow_any_host" in err and "kernel refuses" in err
