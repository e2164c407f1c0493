"""The shared target config schema (nvmeof_roce.config)."""
import copy
import json
from pathlib import Path

import pytest

from nvmeof_roce.config import (
    ConfigError, load_config, parse_config, parse_size, namespace_uuid, subsystem_serial, userspace_only_keys,
)

FIXTURES = Path(__file__).parent / "fixtures"
TARGETS = Path(__file__).parents[2] / "targets"
SUB = "nqn.2024-01.io.example:sub1"
HOST = "nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555"


def minimal(**ns_extra):
    ns = {"nsid": 1, "nvmeof_roce": {"backend": "ram", "size": "64M"}}
    ns.update(ns_extra)
    return {
        "hosts": [{"nqn": HOST}],
        "ports": [{"portid": 1, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": "10.99.0.1",
                                         "trsvcid": "4420"}, "subsystems": [SUB]}],
        "subsystems": [{"nqn": SUB, "namespaces": [ns]}],
    }


def error_of(data, source="targets/x.json"):
    with pytest.raises(ConfigError) as ei:
        parse_config(data, source)
    return ei.value


# ---------------------------------------------------------------- nvmetcli compatibility

def test_nvmetcli_saved_config_loads_unchanged():
    raw = json.loads((FIXTURES / "nvmetcli-saved.json").read_text())
    cfg = load_config(FIXTURES / "nvmetcli-saved.json")
    assert cfg.to_dict() == raw
    assert cfg.raw == raw
    assert cfg.userspace_only_keys() == []
    s1 = cfg.subsystem("nqn.2024-01.io.example:lab1")
    assert s1.allow_any_host is False
    assert s1.allowed_hosts == [cfg.hosts[0]]
    assert s1.serial == "c1a6b3e8f3a9d1c0e3b2" and s1.model == "Linux" and s1.version == "1.3"
    assert [(n.nsid, n.enabled, n.backend, n.path) for n in s1.namespaces] == [
        (1, True, "file", "/dev/nullb0"), (2, False, "file", "/tmp/ns2.img")]
    assert s1.namespaces[0].uuid == "5f0c5a0e-7b52-4bb4-9d8c-2a6b7ad7e0c1"
    p1, p2 = cfg.ports
    assert (p1.portid, p1.trtype, p1.adrfam, p1.traddr, p1.trsvcid) == (1, "rdma", "ipv4", "10.99.0.1", 4420)
    assert p1.params == {"inline_data_size": "16384", "pi_enable": "0"}
    assert p2.trtype == "loop" and p2.trsvcid == 0 and p2.referrals[0].traddr == "10.99.0.2"


def test_nvmetcli_upstream_example_shape(tmp_path):
    # nvmetcli's own rdma.json, with spec-conforming NQNs (its "testnqn" is not an NQN)
    data = {"hosts": [{"nqn": HOST}],
            "ports": [{"addr": {"adrfam": "ipv4", "traddr": "192.168.6.68", "treq": "not specified",
                                "trsvcid": "4420", "trtype": "rdma"}, "portid": 2, "referrals": [],
                       "subsystems": [SUB]}],
            "subsystems": [{"allowed_hosts": [], "attr": {"allow_any_host": "1"},
                            "namespaces": [{"device": {"nguid": "ef90689c-6c46-d44c-89c1-4067801309a8",
                                                       "path": "/dev/nvme0n1"}, "enable": 1, "nsid": 1}],
                            "nqn": SUB}]}
    f = tmp_path / "rdma.json"
    f.write_text(json.dumps(data))
    cfg = load_config(f)
    out = cfg.to_dict()
    # everything given comes back; generated values are added
    ns = out["subsystems"][0]["namespaces"][0]
    assert ns["device"]["path"] == "/dev/nvme0n1"
    assert ns["device"]["uuid"] == namespace_uuid(SUB, 1)
    assert out["subsystems"][0]["attr"]["serial"] == subsystem_serial(SUB)
    # to_dict() is a fixed point
    assert parse_config(out, "again").to_dict() == out


def test_example_targets_load():
    names = sorted(p.name for p in TARGETS.glob("*.json"))
    assert {"ram.json", "file.json", "two-subsystems.json", "demo.json"} <= set(names)
    for p in TARGETS.glob("*.json"):
        cfg = load_config(p)
        # the lab's rxe0 address; the demo serves on 4421 because the kernel target holds 4420 beside it
        port = 4421 if p.name == "demo.json" else 4420
        assert cfg.ports and all(pt.traddr == "10.99.0.1" and pt.trsvcid == port for pt in cfg.ports), p.name
    two = load_config(TARGETS / "two-subsystems.json")
    assert len(two.subsystems) == 2
    assert any(s.allowed_hosts and not s.allow_any_host for s in two.subsystems)
    ram = load_config(TARGETS / "ram.json")
    assert ram.subsystems[0].namespaces[0].backend == "ram"
    assert ram.userspace_only_keys() == ["subsystems[0].namespaces[0].nvmeof_roce"]


# ---------------------------------------------------------------- the model

def test_ram_namespace_model():
    cfg = parse_config(minimal(), "m.json")
    ns = cfg.subsystems[0].namespaces[0]
    assert (ns.backend, ns.size_bytes, ns.block_size, ns.path) == ("ram", 64 << 20, 512, None)
    assert ns.enabled is True
    assert cfg.subsystems[0].model == "nvmeof-roce"
    assert cfg.subsystems[0].allow_any_host is True
    assert cfg.ports[0].subsystems == [SUB]


def test_generated_uuid_and_serial_are_stable():
    a = parse_config(minimal(), "a").subsystems[0]
    b = parse_config(minimal(), "b").subsystems[0]
    assert a.namespaces[0].uuid == b.namespaces[0].uuid == namespace_uuid(SUB, 1)
    assert namespace_uuid(SUB, 1) != namespace_uuid(SUB, 2)
    assert namespace_uuid(SUB, 1) != namespace_uuid(SUB + "x", 1)
    assert a.serial == b.serial and len(a.serial) <= 20


def test_explicit_uuid_kept_and_lowercased():
    u = "5F0C5A0E-7B52-4BB4-9D8C-2A6B7AD7E0C1"
    cfg = parse_config(minimal(device={"uuid": u}), "m")
    assert cfg.subsystems[0].namespaces[0].uuid == u.lower()


def test_file_namespace_and_4k():
    data = minimal()
    data["subsystems"][0]["namespaces"] = [
        {"nsid": 7, "device": {"path": "/var/lib/ns.img"}},
        {"nsid": 8, "device": {"path": "/var/lib/ns8.img"},
         "nvmeof_roce": {"backend": "file", "size": "1G", "block_size": 4096}},
        {"nsid": 9, "nvmeof_roce": {"backend": "null", "size": 1 << 30}},
    ]
    ns7, ns8, ns9 = parse_config(data, "m").subsystems[0].namespaces
    assert (ns7.backend, ns7.path, ns7.size_bytes, ns7.block_size) == ("file", "/var/lib/ns.img", None, 512)
    assert (ns8.backend, ns8.size_bytes, ns8.block_size) == ("file", 1 << 30, 4096)
    assert (ns9.backend, ns9.size_bytes) == ("null", 1 << 30)


@pytest.mark.parametrize("text,value", [("64M", 64 << 20), ("1G", 1 << 30), ("4k", 4096), ("4KiB", 4096),
                                        ("512", 512), (4096, 4096), ("2 GiB", 2 << 30), ("1T", 1 << 40)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["", "M", "1.5G", "-1", "12Q", True, None, [1]])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_userspace_only_keys_listed():
    data = minimal()
    data["nvmeof_roce"] = {"workers": 2}
    data["ports"][0]["nvmeof_roce"] = {"inline": 8192}
    assert sorted(userspace_only_keys(data)) == ["nvmeof_roce", "ports[0].nvmeof_roce",
                                                 "subsystems[0].namespaces[0].nvmeof_roce"]


def test_hosts_as_strings_accepted():
    data = minimal()
    data["hosts"] = [HOST]
    cfg = parse_config(data, "m")
    assert cfg.hosts == [HOST]
    assert cfg.to_dict()["hosts"] == [{"nqn": HOST}]


# ---------------------------------------------------------------- errors name the field

def mutate(fn):
    data = minimal()
    fn(data)
    return data


BAD = [
    # (mutation, field path in the message, words in the message)
    (lambda d: d["subsystems"][0]["namespaces"][0].update(nsid=0),
     "subsystems[0].namespaces[0].nsid", "must be 1..0xFFFFFFFE, got 0"),
    (lambda d: d["subsystems"][0]["namespaces"][0].update(nsid=0xFFFFFFFF),
     "subsystems[0].namespaces[0].nsid", "must be 1..0xFFFFFFFE"),
    (lambda d: d["subsystems"][0]["namespaces"].append({"nsid": 1, "nvmeof_roce": {"backend": "null", "size": "1M"}}),
     "subsystems[0].namespaces[1].nsid", "duplicate nsid 1"),
    (lambda d: d["subsystems"][0].update(nqn="nqn.testnqn"), "subsystems[0].nqn", "is not an NQN"),
    (lambda d: d["subsystems"][0].update(nqn="blktests/1"), "subsystems[0].nqn", "'/' or ','"),
    (lambda d: d["subsystems"][0].update(nqn="blktests 1"), "subsystems[0].nqn", "contains whitespace"),
    (lambda d: d["subsystems"][0].update(nqn="b" * 224), "subsystems[0].nqn", "longer than the 223-byte"),
    (lambda d: d["subsystems"][0].update(nqn="nqn.2024-13.io.example:x"), "subsystems[0].nqn", "month 13"),
    (lambda d: d["subsystems"][0].update(nqn="nqn.2024-01.io.example:" + "x" * 220), "subsystems[0].nqn",
     "longer than the 223-byte"),
    (lambda d: d["subsystems"][0].update(nqn="nqn.2014-08.org.nvmexpress:uuid:nope"), "subsystems[0].nqn",
     "UUID after 'uuid:'"),
    (lambda d: d["subsystems"][0].update(nqn="nqn.2014-08.org.nvmexpress.discovery"), "subsystems[0].nqn",
     "discovery NQN"),
    (lambda d: d["subsystems"].append(copy.deepcopy(d["subsystems"][0])), "subsystems[1].nqn", "duplicate subsystem"),
    (lambda d: d["ports"][0]["subsystems"].append("nqn.2024-01.io.example:nope"), "ports[0].subsystems[1]",
     "is not defined in 'subsystems'"),
    (lambda d: d["ports"].append(copy.deepcopy(d["ports"][0])), "ports[1].portid", "duplicate portid 1"),
    (lambda d: (d["ports"].append(copy.deepcopy(d["ports"][0])), d["ports"][1].update(portid=2)),
     "ports[1].addr", "already used by ports[0]"),
    (lambda d: d["subsystems"][0].update(allowed_hosts=["nqn.2024-01.io.example:stranger"]),
     "subsystems[0].allowed_hosts[0]", "not in the top-level 'hosts'"),
    (lambda d: d["subsystems"][0]["namespaces"][0]["nvmeof_roce"].update(size="64X"),
     "subsystems[0].namespaces[0].nvmeof_roce.size", "is not a size"),
    (lambda d: d["subsystems"][0]["namespaces"][0]["nvmeof_roce"].update(size="1000"),
     "subsystems[0].namespaces[0].nvmeof_roce.size", "not a multiple of the block size 512"),
    (lambda d: d["subsystems"][0]["namespaces"][0]["nvmeof_roce"].update(block_size=1024),
     "subsystems[0].namespaces[0].nvmeof_roce.block_size", "must be 512 or 4096"),
    (lambda d: d["subsystems"][0]["namespaces"][0]["nvmeof_roce"].pop("size"),
     "subsystems[0].namespaces[0].nvmeof_roce.size", "is required for a ram namespace"),
    (lambda d: d["subsystems"][0]["namespaces"][0]["nvmeof_roce"].update(backend="tape"),
     "subsystems[0].namespaces[0].nvmeof_roce.backend", "must be one of ram, file, null"),
    (lambda d: d["subsystems"][0]["namespaces"][0].pop("nvmeof_roce"),
     "subsystems[0].namespaces[0].device.path", "is required"),
    (lambda d: d["subsystems"][0]["namespaces"][0].update(device={"path": "rel/x.img"}, nvmeof_roce={}),
     "subsystems[0].namespaces[0].device.path", "must be an absolute path"),
    (lambda d: d["subsystems"][0]["namespaces"][0].update(device={"uuid": "xyz"}),
     "subsystems[0].namespaces[0].device.uuid", "is not a UUID"),
    (lambda d: d["subsystems"][0]["namespaces"][0].update(device={"nguid": "12"}),
     "subsystems[0].namespaces[0].device.nguid", "32 hex digits"),
    (lambda d: d["subsystems"][0]["namespaces"][0].update(enable="maybe"),
     "subsystems[0].namespaces[0].enable", "must be 0 or 1"),
    (lambda d: d["subsystems"][0]["namespaces"][0].update(colour="red"),
     "subsystems[0].namespaces[0].colour", "unknown key"),
    (lambda d: d["ports"][0]["addr"].update(adrfam="ipv6"), "ports[0].addr.traddr",
     "is an IPv4 address but adrfam is 'ipv6'"),
    (lambda d: d["ports"][0]["addr"].update(traddr="10.99.0"), "ports[0].addr.traddr", "is not an ipv4 address"),
    (lambda d: d["ports"][0]["addr"].update(traddr="fe80::1"), "ports[0].addr.traddr",
     "is an IPv6 address but adrfam is 'ipv4'"),
    (lambda d: d["ports"][0]["addr"].update(trsvcid="70000"), "ports[0].addr.trsvcid", "port number 1..65535"),
    (lambda d: d["ports"][0]["addr"].update(trtype="iwarp"), "ports[0].addr.trtype", "must be one of"),
    (lambda d: d["ports"][0]["addr"].update(adrfam="fc"), "ports[0].addr.adrfam", "does not go with trtype"),
    (lambda d: d["ports"][0]["addr"].pop("traddr"), "ports[0].addr.traddr", "is required for an rdma port"),
    (lambda d: d["ports"][0].update(portid=70000), "ports[0].portid", "must be 0..65535"),
    (lambda d: d["hosts"].append({"nqn": HOST}), "hosts[1].nqn", "duplicate host"),
    (lambda d: d["hosts"].append({}), "hosts[1]", "missing 'nqn'"),
    (lambda d: d["subsystems"][0].update(attr={"serial": "x" * 21}), "subsystems[0].attr.serial", "1..20 printable"),
    (lambda d: d["subsystems"][0].update(attr={"cntlid_min": "10", "cntlid_max": "5"}),
     "subsystems[0].attr.cntlid_min", "above cntlid_max"),
    (lambda d: d["subsystems"][0].update(attr={"cntlid_max": "0xFFFF"}), "subsystems[0].attr.cntlid_max",
     "must be 1..0xFFEF"),
    (lambda d: d.update(subsystems={}), "subsystems", "must be a list"),
    (lambda d: d.update(targets=[]), "targets", "unknown key"),
]


@pytest.mark.parametrize("mutation,where,words", BAD, ids=[b[1] + ":" + b[2][:20] for b in BAD])
def test_bad_input_names_the_field(mutation, where, words):
    err = error_of(mutate(mutation))
    text = str(err)
    assert text.startswith(f"targets/x.json: {where}: "), text
    assert words in text, text
    assert err.fix, f"no fix for {text}"
    assert err.where == where


def test_nsid_message_exact():
    err = error_of(mutate(lambda d: d["subsystems"][0]["namespaces"][0].update(nsid=0)))
    assert err.message == "targets/x.json: subsystems[0].namespaces[0].nsid: must be 1..0xFFFFFFFE, got 0"


def test_load_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"hosts": [,]}')
    with pytest.raises(ConfigError, match=r"bad.json: line 1 column 12: invalid JSON"):
        load_config(bad)
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_a_key_twice_in_one_object_is_refused_naming_its_path_and_lines(tmp_path):
    """Duplicate keys: json.loads keeps the last one silently (a namespace's second "device" wins); refused with
    the key's JSON path and both lines, in a file and in a text with a later syntax error (reported first)."""
    text = json.dumps(minimal(), indent=2).replace(
        '"nsid": 1,', '"nsid": 1,\n          "device": {"path": "/srv/a.img"},\n          "device": {"path": "/srv/b.img"},')
    path = tmp_path / "dup.json"
    path.write_text(text)
    lines = text.splitlines()
    first, second = [i + 1 for i, line in enumerate(lines) if '"device"' in line]
    with pytest.raises(ConfigError) as ei:
        load_config(path)
    err = ei.value
    assert err.where == "subsystems[0].namespaces[0].device", err
    assert f"appears twice in its object, on lines {first} and {second}" in err.problem, err
    assert f"delete line {first} or line {second}" in err.fix, err
    # at the top level, and in a list of objects
    path.write_text('{"hosts": [],\n "ports": [],\n "hosts": []}')
    with pytest.raises(ConfigError, match=r"dup.json: hosts: appears twice in its object, on lines 1 and 3"):
        load_config(path)
    path.write_text('{"hosts": [{"nqn": "a"},\n {"nqn": "b", "nqn": "c"}]}')
    with pytest.raises(ConfigError, match=r"hosts\[1\]\.nqn: appears twice .* on lines 2 and 2"):
        load_config(path)
    # a syntax error after the duplicate is what is reported: the file is not JSON at all
    path.write_text('{"hosts": [], "hosts": [],\n "ports": [,]}')
    with pytest.raises(ConfigError, match=r"dup.json: line 2 column 12: invalid JSON"):
        load_config(path)
    # the same key in two different objects is no duplicate
    path.write_text(json.dumps(minimal()))
    assert load_config(path).subsystems[0].namespaces[0].nsid == 1


def test_real_kernel_dump_loads_unchanged():
    # `nvmet show --json` on the lab's 6.1 kernel (nvmetcli's shape: discovery, dhchap, ana, resv groups)
    raw = json.loads((FIXTURES / "nvmet-show-6.1.json").read_text())
    cfg = parse_config(raw, "nvmet-show-6.1.json")
    assert cfg.to_dict() == raw
    assert len(cfg.subsystems) == 2 and len(cfg.ports) == 2
    assert any(n.buffered_io for s in cfg.subsystems for n in s.namespaces)


def test_both_json_is_served_by_both_targets(tmp_path, capsys):
    from nvmeof_roce import cli
    from nvmeof_roce.kernel.apply import kernel_dict
    data = json.loads((TARGETS / "both.json").read_text())
    assert data["subsystems"][0]["namespaces"][0]["device"]["path"].startswith("/var/lib/nvmeof-roce/")
    img = tmp_path / "both-ns1.img"
    with open(img, "wb") as f:
        f.truncate(1 << 20)
    data["subsystems"][0]["namespaces"][0]["device"]["path"] = str(img)
    path = tmp_path / "both.json"
    path.write_text(json.dumps(data))
    assert cli.main(["target", "check", str(path)]) == 0, capsys.readouterr()
    capsys.readouterr()
    assert kernel_dict(load_config(path))  # no key only the userspace target serves
    code = cli.main(["nvmet", "--root", str(tmp_path / "none" / "nvmet"), "apply", "--dry-run", "--json", str(path)])
    plan = json.loads(capsys.readouterr().out)
    assert code == 0 and plan["offline"] and not plan["warnings"] and plan["steps"]


def test_targets_readme_names_every_example():
    readme = (TARGETS / "README.md").read_text()
    for p in TARGETS.glob("*.json"):
        assert f"`{p.name}`" in readme, p.name
