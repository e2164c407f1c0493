"""The config means what it says for the userspace target (issue 11): one loader for `target check` and
`target serve`, every key it does not implement refused with its path and the fix, all problems at once."""
import copy
import json
import pathlib

import pytest

from nvmeof_roce import cli
from nvmeof_roce.config import (ConfigError, ConfigErrors, load_userspace_config, parse_config,
                                validate_for_userspace)
from nvmeof_roce.target import backends
from nvmeof_roce.target.core import Target

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
    (lambda d: d["hosts"][0].update(dhchap={"key": "DHHC-1:00:abcd:"}), "hosts[0].dhchap.key",
     "dhchap key (in-band authentication)"),
    (lambda d: d["ports"][0]["addr"].update(treq="required"), "ports[0].addr.treq",
     "treq \"required\" (secure channel)"),
    (lambda d: d["ports"][0]["addr"].update(tsas="tls1.3"), "ports[0].addr.tsas", "tsas 'tls1.3' (transport security)"),
    (lambda d: d["ports"][0].update(ana_groups=[{"grpid": 1, "ana": {"state": "optimized"}},
                                                {"grpid": 2, "ana": {"state": "inaccessible"}}]),
     "ports[0].ana_groups[1]", "ANA group 2 (inaccessible)"),
    (lambda d: d["subsystems"][0]["namespaces"][0].update(ana_grpid=2), "subsystems[0].namespaces[0].ana_grpid",
     "ANA group 2"),
    (lambda d: d["subsystems"][0]["namespaces"][0].update(resv={"enable": 1}),
     "subsystems[0].namespaces[0].resv.enable", "reservations (resv_enable)"),
    (lambda d: d["subsystems"][0].update(attr={"alow_any_host": "1"}), "subsystems[0].attr.alow_any_host",
     "subsystem attribute 'alow_any_host'"),
    (lambda d: d["subsystems"][0].update(attr={"ieee_oui": "0x001122"}), "subsystems[0].attr.ieee_oui",
     "subsystem attribute 'ieee_oui'"),
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
    if "attr." not in where and "ana_groups" not in where:
        assert errors[0].fix == FIX


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
    data["hosts"][0]["dhchap"] = {"key": "DHHC-1:00:abcd:"}
    data["ports"][0]["addr"]["treq"] = "required"
    data["ports"][0]["param"] = {"inline_data_size": "lots"}
    data["subsystems"][0]["attr"] = {"modle": "x"}
    data["subsystems"][0]["namespaces"].append({"nsid": 2, "nvmeof_roce": {"backend": "ram", "size": "1X"}})
    errors = userspace_errors(tmp_path, data)
    assert sorted(e.where for e in errors) == sorted([
        "ports[0].param.inline_data_size", "subsystems[0].namespaces[1].nvmeof_roce.size",
        "hosts[0].dhchap.key", "ports[0].addr.treq", "subsystems[0].attr.modle"])
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
    assert len(validate_for_userspace(cfg)) == 3
