"""nvmetcli's, nvme-cli's and SPDK rpc.py's habits as an admin brings them: booleans written either way, the
wildcard address, IPv6 listeners, add_host on an open subsystem, the short options, rpc.py's positional forms,
nvmf_create_transport and `host list -o json` in nvme-cli's schema."""
import json
from pathlib import Path

import pytest

from nvmeof_roce import cli
from nvmeof_roce.control.methods import Control
from nvmeof_roce.control.protocol import RpcError
from nvmeof_roce.kernel.nvmet import Root
from nvmeof_roce.kernel import host_commands, nvme_cli, nvmet_commands
from nvmeof_roce.kernel.tool import ToolResult

from fake_nvmet import FakeNvmetFS
from loopback_env import HOST_A, HOST_B, SUB_RAM, Env

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


# ------------------------------------------------------------------------------------ short options

# nvme-cli's letters and what each must mean in every command (the parameter it fills)
NVME_CLI_LETTERS = {"-t": {"transport"}, "-a": {"traddr", "traddr_opt"}, "-s": {"trsvcid"}, "-n": {"nqn"},
                    "-q": {"hostnqn"}, "-o": {"output_format"},
                    # -c is per command in nvme-cli too: read/write's block count, connect's reconnect delay;
                    # the shell's -c is sh -c's
                    "-c": {"block_count", "reconnect_delay", "command"}}
# where a command mirrors one of nvme-cli's that uses the letter otherwise, nvme-cli's own meaning
NVME_CLI_OWN = {("gen-dhchap-key", "-s"): "secret",  # nvme gen-dhchap-key -s/--secret
                # nvme resv-register/-acquire/-release/-report -n/--namespace-id
                **{(f"host resv-{verb}", "-n"): "nsid" for verb in ("register", "acquire", "release", "report")}}


def _commands():
    parser = cli.build_parser()
    return [(c.prog.split(" ", 1)[1], c) for c in cli.commands(parser)]


def test_nvme_cli_short_options_mean_the_same_in_every_command():
    wrong = []
    for name, command in _commands():
        for letter, dests in NVME_CLI_LETTERS.items():
            action = command._option_string_actions.get(letter)
            if action is None or action.help == "==SUPPRESS==":
                continue
            if action.dest not in dests and NVME_CLI_OWN.get((name, letter)) != action.dest:
                wrong.append(f"{name} {letter}: {action.dest}")
    assert wrong == []
    # the control socket has its own letter; -s there says where it went
    for name, command in _commands():
        socket = command._option_string_actions.get("--socket")
        if socket is not None:
            assert "-S" in socket.option_strings and "-s" not in socket.option_strings, name


def test_target_add_listener_s_is_the_service_id(capsys):
    args = cli.build_parser().parse_args(["target", "add-listener", NQN, "10.0.0.1", "-s", "4421", "-S", "/x.sock"])
    assert (args.trsvcid, args.socket, args.transport) == ("4421", "/x.sock", "rdma")
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["target", "add-ns", NQN, "--ram", "1M", "-s", "/x.sock"])
    assert "-S PATH or --socket PATH" in capsys.readouterr().err


def test_verbose_and_output_format_after_the_command(tmp_path, capsys, monkeypatch):
    seen = {}
    monkeypatch.setattr(cli, "setup_logging", lambda verbose: seen.setdefault("verbose", verbose))
    path = tmp_path / "t.json"
    path.write_text(json.dumps(config()))
    assert cli.main(["-v", "target", "check", str(path), "-v", "-o", "json"]) == 0
    assert seen["verbose"] == 2 and json.loads(capsys.readouterr().out)["ok"] is True


# ---------------------------------------------------------------------------- host list -o json

FIXTURES = Path(__file__).parent / "fixtures"  # recorded in the lab guests (docs/kernel.md)
# nvme-cli 2.3 (Debian 12) and 2.13 (Debian 13, which adds each namespace's character device: GenericPath)
LISTINGS = {"nvme-cli-2.3": "nqn.2024-01.io.example:cap1",
            "nvme-cli-recorded/trixie-2.13": "nqn.2024-01.io.nvmeof-roce:record"}


@pytest.mark.parametrize("version", sorted(LISTINGS))
@pytest.mark.parametrize("listing", ["list-verbose.json", "list.json"])
def test_host_list_o_json_is_nvme_list_o_json(monkeypatch, tmp_path, capsys, listing, version):
    fix = FIXTURES / version
    (tmp_path / "hostnqn").write_text(HOST_A + "\n")
    answers = {"list-subsys": (fix / "list-subsys.json").read_text(), "list": (fix / listing).read_text()}
    monkeypatch.setattr(host_commands, "_cli", lambda args=None: nvme_cli.NvmeCli(
        runner=lambda tool, args, package, timeout=None: ToolResult(["nvme"], 0, answers[args[0]], ""),
        load_modules=False, etc_dir=str(tmp_path), kernel_log=lambda: ""))
    code, out, _ = run(capsys, "host", "list", "-o", "json")
    want = json.loads((fix / "list.json").read_text())  # what `nvme list -o json` printed
    by_path = lambda doc: sorted(doc["Devices"], key=lambda d: d["DevicePath"])
    assert code == 0 and list(json.loads(out)) == ["Devices"] and by_path(json.loads(out)) == by_path(want)
    code, out, _ = run(capsys, "host", "list", "--json")  # this tool's own: subsystems with paths
    assert json.loads(out)["subsystems"][0]["nqn"] == LISTINGS[version]


# ------------------------------------------------------------------------------ rpc.py's forms

def test_rpc_takes_rpc_py_positional_forms(env, tmp_path, capsys):
    from test_target_control import LoopListeners, _serve_while
    from nvmeof_roce.control.server import RpcServer
    path = str(tmp_path / "rpc.sock")
    server = RpcServer(Control(env.target, LoopListeners(env)), path, env.fabric)
    img = tmp_path / "ns.img"
    img.write_bytes(bytes(1 << 20))

    def rpc(*argv):
        code = _serve_while(env, lambda: cli.main(["rpc", "-S", path] + [str(a) for a in argv]))
        out = capsys.readouterr()
        return code, out.out, out.err

    try:
        assert rpc("nvmf_create_subsystem", NQN, "-s", "SN42", "-a")[0] == 0
        code, out, err = rpc("nvmf_subsystem_add_ns", NQN, img, "-n", "3")
        assert code == 0 and json.loads(out) == 3, err
        assert env.target.config.subsystem(NQN).namespaces[0].path == str(img)
        code, out, err = rpc("nvmf_subsystem_add_ns", NQN, "Malloc0")  # a bdev name: none here, said so
        assert code == 1 and "namespace.bdev_name" in err and "no bdevs" in err
        assert "target add-ns NQN --ram 64M" in err and '"backend": "ram"' in err, err
        code, _, err = rpc("nvmf_subsystem_add_listener", NQN, "-t", "rdma", "-a", "10.99.0.2", "-s", "4420")
        assert code == 0, err
        sub = next(s for s in json.loads(rpc("nvmf_get_subsystems", NQN)[1]) if s["nqn"] == NQN)
        assert sub["serial_number"] == "SN42" and sub["allow_any_host"] is True
        assert sub["listen_addresses"][0]["traddr"] == "10.99.0.2" and sub["namespaces"][0]["nsid"] == 3
        code, _, err = rpc("nvmf_subsystem_add_listener", NQN, "-t", "rdma", "-a", "fe80::7", "-s", "4421")
        assert code == 0, err  # an IPv6 literal without rpc.py's -f is IPv6
        code, out, _ = _serve_while(env, lambda: cli.main(["target", "rm-listener", NQN, "-a", "fe80::7", "-s", "4421",
                                                           "-S", path])), capsys.readouterr().out, None
        assert code == 0 and "no longer listening on [fe80::7]:4421" in out
        assert rpc("nvmf_subsystem_add_host", NQN, HOST_B)[0] == 0
        assert rpc("nvmf_subsystem_allow_any_host", NQN, "-d")[0] == 0
        assert env.target.subsystems[NQN].allow_any_host is False
        assert env.target.subsystems[NQN].allowed_hosts == {HOST_B}
        assert rpc("nvmf_subsystem_remove_ns", NQN, "3")[0] == 0
        code, out, _ = rpc("nvmf_get_subsystems", "--param", f"nqn={NQN}")  # the generic form still works
        assert code == 0 and json.loads(out)[0]["namespaces"] == []
    finally:
        server.close()


def test_rpc_py_spellings_of_today_and_of_the_json_parameters(env, tmp_path, capsys, monkeypatch):
    """rpc.py's current --min-cntlid/--max-cntlid, the JSON parameters' spellings (--serial_number,
    --no_auto_visible), keyring_file_add_key NAME PATH, a relative path for add_ns, and Malloc0 refused before
    anything is sent, saying how this target makes a RAM namespace."""
    import os
    from test_target_control import LoopListeners, _serve_while
    from nvmeof_roce.control.server import RpcServer
    from nvmeof_roce.nvme.auth import generate_secret
    path = str(tmp_path / "rpc.sock")
    server = RpcServer(Control(env.target, LoopListeners(env)), path, env.fabric)
    (tmp_path / "ns.img").write_bytes(bytes(1 << 20))
    key = tmp_path / "host.key"
    key.write_text(generate_secret(1, 32) + "\n")
    key.chmod(0o600)
    monkeypatch.chdir(tmp_path)  # the relative paths below are the caller's

    def rpc(*argv):
        code = _serve_while(env, lambda: cli.main(["rpc", "-S", path] + [str(a) for a in argv]))
        out = capsys.readouterr()
        return code, out.out, out.err

    try:
        code, _, err = rpc("nvmf_create_subsystem", NQN, "--serial_number", "SN7", "--min-cntlid", "5",
                           "--max-cntlid", "9")
        assert code == 0, err
        sub = env.target.config.subsystem(NQN)
        assert (sub.serial, sub.cntlid_min, sub.cntlid_max) == ("SN7", 5, 9)
        code, out, err = rpc("nvmf_subsystem_add_ns", NQN, "ns.img", "--no_auto_visible")
        assert code == 0, err
        ns = env.target.config.subsystem(NQN).namespaces[0]
        assert ns.path == str(tmp_path / "ns.img") and ns.visible_hosts == []  # no host sees it yet
        code, _, err = rpc("keyring_file_add_key", "key0", "host.key")
        assert code == 0, err
        assert env.target.config.userspace["keyring"] == {"key0": str(key)}
        assert rpc("keyring_file_remove_key", "key0")[0] == 0
    finally:
        server.close()
    # refused here, before a socket is looked for: nothing of it is sent
    monkeypatch.setattr("nvmeof_roce.control.commands.find_socket", lambda *a: pytest.fail("sent"))
    code, _, err = run(capsys, "rpc", "nvmf_subsystem_add_ns", NQN, "Malloc0")
    assert code == 1 and "'Malloc0' is neither a file nor a block device" in err and "--ram 64M" in err, err
    assert not os.path.exists(tmp_path / "Malloc0")


def test_rpc_add_listener_s_is_rpc_py_s_sock_impl_and_is_refused_not_dropped(capsys):
    """In rpc.py's nvmf_subsystem_add_listener -S is --sock-impl, elsewhere here -S is the control socket: the
    subcommand takes rpc.py's meaning, refuses it (RDMA listeners have no socket implementation, and a setting
    this target does not honour is never taken), and a path given to it is named as the control socket's."""
    base = ["rpc", "nvmf_subsystem_add_listener", NQN, "-t", "rdma", "-a", "10.0.0.1", "-s", "4420"]
    for argv, says in ((["-S", "/run/nvmeof-roce/t.sock"], "give it as --socket /run/nvmeof-roce/t.sock"),
                       (["--sock-impl", "uring"], "the control socket is --socket PATH"),
                       (["--sock_impl", "posix"], "leave it out")):
        with pytest.raises(SystemExit) as exc:
            cli.main(base + argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "--sock-impl picks a TCP listener's socket implementation" in err, err
        assert says in err, err


# ------------------------------------------------------------------------------ nvmf_create_transport

def test_create_transport_applies_what_maps_and_refuses_what_does_not(env):
    control = Control(env.target)
    settings = control.call("nvmf_get_transports")[0]
    assert control.call("nvmf_create_transport", {"trtype": "RDMA", "max_io_size": settings["max_io_size"],
                                                  "no_srq": True, "num_shared_buffers":
                                                  settings["num_shared_buffers"]}) is True
    refusals = {
        ("trtype", "TCP"): "RDMA only",
        ("max_io_size", settings["max_io_size"] * 2): "--mdts",
        ("num_shared_buffers", 1): "--data-buffers",
        ("max_aq_depth", 64): "always 32",
        ("no_srq", False): "own receive queue",
        ("zcopy", True): "zero-copy",
        ("sock_priority", 1): "TCP",
        ("max_queue_depth", 4096): "16..1024",
        ("max_queue_depth", 64): "already listens with max_queue_size 128",
        ("acceptor_poll_rate", 10000): "rdma_cm events",
    }
    before = json.dumps(env.target.config.to_dict(), sort_keys=True)
    for (name, value), says in refusals.items():
        with pytest.raises(RpcError) as exc:
            control.call("nvmf_create_transport", {"trtype": "RDMA", name: value})
        assert exc.value.field == name and says in exc.value.message, (name, exc.value.message)
    assert json.dumps(env.target.config.to_dict(), sort_keys=True) == before


def test_create_transport_sets_the_port_parameters_of_new_listeners():
    from test_target_control import LoopListeners
    env = Env({"subsystems": [{"nqn": NQN, "namespaces": []}], "ports": []})  # as SPDK: the transport first
    control = Control(env.target, LoopListeners(env))
    assert control.call("nvmf_create_transport", {"trtype": "rdma", "max_queue_depth": 64,
                                                  "in_capsule_data_size": 8192}) is True
    control.call("nvmf_subsystem_add_listener", {"nqn": NQN, "listen_address": {
        "trtype": "RDMA", "traddr": "10.99.0.7", "trsvcid": "4420"}})
    port = next(p for p in env.target.config.ports if p.traddr == "10.99.0.7")
    assert (port.max_queue_size, port.inline_data_size) == (64, 8192)
    assert control.call("nvmf_get_transports")[0]["max_queue_depth"] == 64
    env.close()
