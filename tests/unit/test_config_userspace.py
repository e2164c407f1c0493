"""The config means what it says for the userspace target (issue 11): one loader for `target check` and
`target serve`, every key it does not implement refused with its path and the fix, all problems at once."""
import copy
import json
import pathlib

import pytest

from nvmeof_roce import cli
from nvmeof_roce.config import (ConfigError, ConfigErrors, load_userspace_config, parse_config,
                                validate_for_userspace)
from nvmeof_roce.engine import backends
from nvmeof_roce.engine.core import Target

NQN = "nqn.2024-01.io.test:cfg"
NQN2 = "nqn.2024-01.io.test:cfg2"
HOST = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000a001"
FIX = "remove it, or serve this config with the kernel target: `nvmeof-roce nvmet apply`"
ROOT = pathlib.Path(__file__).resolve().parents[2]


def base():
    return {"hosts": [{"nqn": HOST}],
            "ports": [{"portid": 1, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": "10.99.0.1",
                                             "trsvcid": "4420"}, "subsystems": [NQN, NQN2]}],
            "subsystems": [{"nqn": NQN, "namespaces": [{"nsid": 1, "nvmeof_roce": {"backend": "ram", "size": "1M"}}]},
                           {"nqn": NQN2, "namespaces": [{"nsid": 1, "nvmeof_roce": {"backend": "null", "size": "1G"}}]}]}


def write(tmp_path, data, name="t.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def userspace_errors(tmp_path, data):
    with pytest.raises(ConfigError) as ei:
        load_userspace_config(write(tmp_path, data))
    exc = ei.value
    return exc.errors if isinstance(exc, ConfigErrors) else [exc]


UNSUPPORTED = [
    (lambda d: d["ports"][0]["addr"].update(treq="required"), "ports[0].addr.treq",
     "treq \"required\" (secure channel)"),
    (lambda d: d["ports"][0]["addr"].update(tsas="tls1.3"), "ports[0].addr.tsas", "tsas 'tls1.3' (transport security)"),
    (lambda d: d["subsystems"][0].update(attr={"alow_any_host": "1"}), "subsystems[0].attr.alow_any_host",
     "subsystem attribute 'alow_any_host'"),
    (lambda d: d["subsystems"][0].update(attr={"ana_grpid": "2"}), "subsystems[0].attr.ana_grpid",
     "subsystem attribute 'ana_grpid'"),
    (lambda d: d["subsystems"][0].update(passthru=[{"device": {"path": "/dev/nvme0"}, "enable": 1}]),
     "subsystems[0].passthru", "passthru (a subsystem that forwards to a local NVMe controller)"),
    (lambda d: d["subsystems"][0].update(attr={"pi_enable": "1"}), "subsystems[0].attr.pi_enable",
     "protection information"),
    (lambda d: d["ports"][0].update(param={"pi_enable": "1"}), "ports[0].param.pi_enable", "protection information"),
]


@pytest.mark.parametrize("mutation,where,what", UNSUPPORTED, ids=[u[1] for u in UNSUPPORTED])
def test_unimplemented_keys_are_refused_with_path_and_fix(tmp_path, mutation, where, what):
    data = base()
    mutation(data)
    parse_config(copy.deepcopy(data), "k.json")  # the kernel path's loader accepts it...
    errors = userspace_errors(tmp_path, data)  # ...the userspace target does not
    assert [(e.where, e.problem) for e in errors] == [(where, f"{what}: the userspace target does not implement it")]
    assert "nvmeof-roce nvmet apply" in errors[0].fix
    if "attr." not in where:
        assert errors[0].fix == FIX


def test_ana_groups_are_served(tmp_path):
    """ANA groups and states are implemented (engine/ana.py): the userspace loader takes them."""
    data = base()
    data["ports"][0]["ana_groups"] = [{"grpid": 1, "ana": {"state": "optimized"}},
                                      {"grpid": 2, "ana": {"state": "inaccessible"}}]
    data["subsystems"][0]["namespaces"][0]["ana_grpid"] = 2
    cfg = load_userspace_config(write(tmp_path, data))
    assert [(g.grpid, g.state) for g in cfg.ports[0].ana_groups] == [(1, "optimized"), (2, "inaccessible")]
    assert cfg.subsystems[0].namespaces[0].ana_grpid == 2


def test_non_rdma_port_is_refused(tmp_path):
    data = base()
    data["ports"][0]["addr"]["trtype"] = "tcp"
    (err,) = userspace_errors(tmp_path, data)
    assert (err.where, err.problem) == ("ports[0].addr.trtype", "'tcp': the userspace target serves RDMA (RoCE) only")
    assert err.fix == f'use "rdma", or {FIX}'


def test_kernel_dump_shape_is_accepted(tmp_path):
    """What `nvmet save` writes for a plain config (empty dhchap/resv groups, the default ANA group,
    pi_enable 0) is served as is."""
    data = base()
    data["hosts"][0]["dhchap"] = {}
    data["ports"][0]["param"] = {"inline_data_size": "4096", "pi_enable": "0"}
    data["ports"][0]["ana_groups"] = [{"grpid": 1, "ana": {"state": "optimized"}}]
    data["subsystems"][0]["attr"] = {"allow_any_host": "1", "pi_enable": "0", "qid_max": "128",
                                     "cntlid_min": "1", "cntlid_max": "65519", "version": "1.3"}
    data["subsystems"][0]["namespaces"][0].update(resv={}, ana_grpid=1)
    assert load_userspace_config(write(tmp_path, data)).ports[0].inline_data_size == 4096


def test_inline_data_size_hex_is_parsed_once_and_used(tmp_path):
    data = base()
    data["ports"][0]["param"] = {"inline_data_size": "0x4000", "max_queue_size": "0x40"}
    cfg = load_userspace_config(write(tmp_path, data))
    assert (cfg.ports[0].inline_data_size, cfg.ports[0].max_queue_size) == (16384, 64)
    target = Target(cfg)
    try:
        handler = target.port(1)
        assert handler.in_capsule_size == 16384 and handler.ctx.mqes == 63
    finally:
        target.close()


def test_inline_data_size_is_capped_at_16k(tmp_path):
    data = base()
    data["ports"][0]["param"] = {"inline_data_size": str(1 << 20)}
    (err,) = userspace_errors(tmp_path, data)
    assert (err.where, err.problem) == ("ports[0].param.inline_data_size", "must be -1..16384, got '1048576'")


def test_max_queue_size_outside_what_is_served(tmp_path):
    data = base()
    data["ports"][0]["param"] = {"max_queue_size": "4096"}
    (err,) = userspace_errors(tmp_path, data)
    assert err.where == "ports[0].param.max_queue_size" and "outside 16..1024" in err.problem


def test_null_namespace_beyond_the_block_count(tmp_path):
    data = base()
    data["subsystems"][1]["namespaces"][0]["nvmeof_roce"]["size"] = "9000000P"
    (err,) = userspace_errors(tmp_path, data)
    assert err.where == "subsystems[1].namespaces[0].nvmeof_roce.size"
    assert "more than the 64-bit block count (NSZE) can hold" in err.problem and err.fix == "give at most 8388607P"


def test_ram_beyond_physical_memory():
    data = base()
    data["subsystems"][0]["namespaces"][0]["nvmeof_roce"]["size"] = "2G"
    cfg = parse_config(data, "m.json")
    (err,) = validate_for_userspace(cfg, memory=1 << 30)
    assert err.where == "subsystems[0].namespaces[0].nvmeof_roce.size"
    assert err.problem == ("the RAM namespaces come to 2147483648 bytes with this one, more than the "
                           "1073741824 bytes of memory this machine has")
    assert validate_for_userspace(cfg, memory=4 << 30) == []


def test_ram_beyond_this_machines_memory_is_refused_by_check(tmp_path, capsys):
    data = base()
    data["subsystems"][0]["namespaces"][0]["nvmeof_roce"]["size"] = "1024T"
    assert cli.main(["target", "check", write(tmp_path, data)]) == 1
    assert "bytes of memory this machine has" in capsys.readouterr().err


def test_duplicate_device_paths_are_refused(tmp_path):
    img = tmp_path / "a.img"
    img.write_bytes(bytes(1 << 20))
    link = tmp_path / "link.img"
    link.symlink_to(img)
    data = base()
    data["subsystems"][0]["namespaces"] = [{"nsid": 1, "device": {"path": str(img)}}]
    data["subsystems"][1]["namespaces"] = [{"nsid": 1, "device": {"path": str(link)}}]
    (err,) = userspace_errors(tmp_path, data)
    assert err.where == "subsystems[1].namespaces[0].device.path"
    assert err.problem == f"{link} is already the backing of subsystems[0].namespaces[0]"


def test_a_served_file_is_locked(tmp_path):
    img = tmp_path / "a.img"
    img.write_bytes(bytes(1 << 20))
    data = base()
    data["subsystems"][0]["namespaces"] = [{"nsid": 1, "device": {"path": str(img)}}]
    cfg = parse_config(data, "lock.json")
    first = Target(cfg)
    try:
        with pytest.raises(ConfigError) as ei:
            Target(cfg)
        assert ei.value.where == "subsystems[0].namespaces[0].device.path"
        assert "is in use: another process holds its lock" in ei.value.problem
    finally:
        first.close()
    Target(cfg).close()  # released with the first target


def test_all_problems_in_one_run(tmp_path, capsys):
    data = base()
    data["subsystems"][0]["namespaces"][0]["p2pmem"] = 1
    data["ports"][0]["addr"]["treq"] = "required"
    data["ports"][0]["param"] = {"inline_data_size": "lots"}
    data["subsystems"][0]["attr"] = {"modle": "x"}
    data["subsystems"][0]["namespaces"].append({"nsid": 2, "nvmeof_roce": {"backend": "ram", "size": "1X"}})
    errors = userspace_errors(tmp_path, data)
    assert sorted(e.where for e in errors) == sorted([
        "ports[0].param.inline_data_size", "subsystems[0].namespaces[1].nvmeof_roce.size",
        "subsystems[0].namespaces[0].p2pmem", "ports[0].addr.treq", "subsystems[0].attr.modle"])
    path = write(tmp_path, data)
    assert cli.main(["target", "check", path]) == 1
    err = capsys.readouterr().err
    assert err.count(path) == 5 and "(5 problems)" in err
    assert cli.main(["target", "check", path, "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] is False and len(result["errors"]) == 5 and all(e["fix"] for e in result["errors"])


def test_check_takes_several_files(tmp_path, capsys):
    good = write(tmp_path, base(), "good.json")
    bad_data = base()
    bad_data["ports"][0]["addr"]["trtype"] = "tcp"
    bad = write(tmp_path, bad_data, "bad.json")
    assert cli.main(["target", "check", good, bad, "--json"]) == 1
    results = json.loads(capsys.readouterr().out)
    assert [(r["config"].endswith(n), r["ok"]) for r, n in zip(results, ("good.json", "bad.json"))] == \
        [(True, True), (True, False)]
    assert cli.main(["target", "check", good, good]) == 0
    assert capsys.readouterr().out.count(": OK") == 2


def test_check_never_allocates_ram(tmp_path, capsys, monkeypatch):
    def refuse(*_args, **_kw):
        raise AssertionError("check allocated a RAM namespace")
    monkeypatch.setattr(backends.RamBackend, "__init__", refuse)
    data = base()
    data["subsystems"][0]["namespaces"][0]["nvmeof_roce"]["size"] = "64M"
    assert cli.main(["target", "check", write(tmp_path, data), "--json"]) == 0
    ns = json.loads(capsys.readouterr().out)["subsystems"][0]["namespaces"][0]
    assert (ns["size_bytes"], ns["blocks"]) == (64 << 20, (64 << 20) // 512)


def test_settings_are_checked(tmp_path):
    data = base()
    data["nvmeof_roce"] = {"max_kato": 0, "max_katoo": 5}
    errors = userspace_errors(tmp_path, data)
    assert sorted((e.where, e.problem) for e in errors) == [
        ("nvmeof_roce.max_kato", "must be 1..3600, got 0"), ("nvmeof_roce.max_katoo", "unknown key")]


def test_shipped_file_example_passes_check_on_a_clean_machine(capsys):
    # its file is created by the target at the size the config gives; check never creates it
    assert cli.main(["target", "check", str(ROOT / "targets" / "file.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]


def test_kernel_loader_keeps_what_the_kernel_supports():
    data = base()
    data["hosts"][0]["dhchap"] = {"key": "DHHC-1:00:abcd:"}
    data["ports"][0]["addr"]["treq"] = "required"
    data["subsystems"][0]["namespaces"][0].update(resv={"enable": 1})
    cfg = parse_config(data, "k.json")
    assert cfg.host_entries[0].attrs["dhchap"]["key"] == "DHHC-1:00:abcd:"
    # DH-HMAC-CHAP and reservations are served by both targets (engine/auth.py, engine/reservations.py); treq
    # only by the kernel's
    assert cfg.subsystems[0].namespaces[0].resv_enabled
    assert [e.where for e in validate_for_userspace(cfg)] == ["ports[0].addr.treq"]


def test_check_refuses_a_malformed_dhchap_key(tmp_path, capsys):
    data = base()
    data["hosts"][0]["dhchap"] = {"key": "DHHC-1:00:abcd:"}
    assert cli.main(["target", "check", write(tmp_path, data), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["field"] == "hosts[0].dhchap.key"


def test_nvmetcli_keys_of_current_kernels_are_taken(tmp_path):
    """What nvmetcli saves from kernels 6.x: RDMA's tsas "connected", attr firmware and ieee_oui, an empty
    disabled passthru block, the top-level discovery NQN: served (the Identify figures in test_target_host)."""
    data = base()
    data["discovery"] = {"nqn": "nqn.2014-08.org.nvmexpress.discovery"}
    data["ports"][0]["addr"]["tsas"] = "connected"
    data["subsystems"][0]["attr"] = {"firmware": "6.12.9", "ieee_oui": "0x00a0b8"}
    data["subsystems"][0]["passthru"] = [{"admin_timeout": 0, "clear_ids": 1, "device": {"path": ""}, "enable": 0,
                                          "io_timeout": 0}]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    cfg = load_userspace_config(str(path))
    assert cfg.subsystems[0].attrs["firmware"] == "6.12.9" and cfg.subsystems[0].attrs["ieee_oui"] == "0x00a0b8"


def test_nvmetcli_keys_the_userspace_target_cannot_serve_say_why(tmp_path):
    data = base()
    data["discovery"] = {"nqn": "nqn.2024-01.io.example:my-discovery"}
    data["ports"][0]["addr"]["tsas"] = "datagram"
    errors = userspace_errors(tmp_path, data)
    assert [e.where for e in errors] == ["discovery.nqn", "ports[0].addr.tsas"]
    assert "answers to the well-known nqn.2014-08.org.nvmexpress.discovery only" in errors[0].problem
    assert "reliable connected" in errors[1].problem and 'use "connected"' in errors[1].fix


@pytest.mark.parametrize("attr,value,problem", [
    ("firmware", "", "must be 1..8 printable ASCII characters"),
    ("firmware", "123456789", "must be 1..8 printable ASCII characters"),
    ("ieee_oui", "0x1000000", "must be 0..0xFFFFFF"),
    ("ieee_oui", "oui", "must be an integer 0..0xFFFFFF"),
])
def test_firmware_and_ieee_oui_are_checked_as_nvmet_does(attr, value, problem):
    data = base()
    data["subsystems"][0]["attr"] = {attr: value}
    with pytest.raises(ConfigError) as exc:
        parse_config(data, "k.json")
    assert exc.value.where == f"subsystems[0].attr.{attr}" and problem in exc.value.problem


def test_check_reports_every_problem_of_one_object(tmp_path):
    data = base()
    data["subsystems"][0]["attr"] = {"serial": "x" * 30, "model": "m" * 50, "cntlid_min": "0", "bogus": "1"}
    data["subsystems"][0]["colour"] = "blue"
    data["ports"][0]["addr"].update(treq="sometimes", trsvcid="99999")
    data["ports"][0]["flavour"] = 1
    data["hosts"][0]["extra"] = {}
    with pytest.raises(ConfigErrors) as exc:
        parse_config(data, "k.json")
    wheres = [e.where for e in exc.value.errors]
    for where in ("subsystems[0].colour", "subsystems[0].attr.serial", "subsystems[0].attr.model",
                  "subsystems[0].attr.cntlid_min", "ports[0].flavour", "ports[0].addr.treq", "ports[0].addr.trsvcid",
                  "hosts[0].extra"):
        assert where in wheres, (where, wheres)
