"""The nvmet configfs model and `nvmet apply` against a fake configfs with 6.1's rules."""
import copy
import json
import os
from pathlib import Path

import pytest

from nvmeof_roce.kernel import apply as applymod
from nvmeof_roce.kernel.nvmet import NvmetError, Root, save_json, fs_type
from nvmeof_roce.config import parse_config, load_config
from fake_nvmet import FakeNvmetFS

FIX = Path(__file__).parent / "fixtures"
H1 = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000a001"
H2 = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000a002"
S1 = "nqn.2024-01.io.example:one"
S2 = "nqn.2024-01.io.example:two"


@pytest.fixture
def env(tmp_path):
    devdir = tmp_path / "dev"
    devdir.mkdir()
    tmpfs = tmp_path / "tmpfs"
    tmpfs.mkdir()
    for name in ("a.img", "b.img", "c.img"):
        (devdir / name).write_bytes(b"")
    (tmpfs / "t.img").write_bytes(b"")
    fs = FakeNvmetFS(tmp_path / "cfs", tmpfs_dirs=[tmpfs], devices={"/dev/nullb0"})
    root = Root(fs.root, fs=fs, sys_module=fs.sys_module)
    return {"fs": fs, "root": root, "dev": devdir, "tmpfs": tmpfs, "tmp": tmp_path}


def two_subsystems(dev):
    return {
        "hosts": [{"nqn": H1}, {"nqn": H2}],
        "ports": [
            {"portid": 1, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": "10.99.0.1", "trsvcid": "4420"},
             "subsystems": [S1, S2]},
            {"portid": 2, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": "10.99.0.1", "trsvcid": "4421"},
             "param": {"inline_data_size": "8192"}, "subsystems": [S2]},
        ],
        "subsystems": [
            {"nqn": S1, "attr": {"allow_any_host": "1"},
             "namespaces": [{"nsid": 1, "device": {"path": str(dev / "a.img")}},
                            {"nsid": 2, "device": {"path": "/dev/nullb0"}}]},
            {"nqn": S2, "attr": {"allow_any_host": "0"}, "allowed_hosts": [H1],
             "namespaces": [{"nsid": 1, "device": {"path": str(dev / "b.img")}}]},
        ],
    }


_KEYS = ("nqn", "portid", "nsid", "name", "grpid")


def _key(item):
    return next((str(item[k]) for k in _KEYS if isinstance(item, dict) and k in item), None)


def is_subset(want, have, path=""):
    """Every key/value of `want` is in `have`; lists of objects matched by nqn/portid/nsid/name/grpid,
    lists of strings as sets (the kernel lists them sorted)."""
    if isinstance(want, dict):
        assert isinstance(have, dict), path
        for k, v in want.items():
            assert k in have, f"{path}.{k} missing"
            is_subset(v, have[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert isinstance(have, list) and len(want) == len(have), f"{path}: {want} vs {have}"
        if all(_key(w) is not None for w in want):
            by = {_key(h): h for h in have}
            for w in want:
                assert _key(w) in by, f"{path}: {_key(w)} missing"
                is_subset(w, by[_key(w)], f"{path}[{_key(w)}]")
        else:
            assert sorted(map(str, want)) == sorted(map(str, have)), f"{path}: {want} vs {have}"
    else:
        assert str(want) == str(have), f"{path}: want {want!r}, have {have!r}"


def apply_dict(root, data, **kw):
    return applymod.apply(root, parse_config(data, "t.json"), **kw)


# ---------------------------------------------------------------- the model

def test_root_missing_configfs(tmp_path):
    with pytest.raises(NvmetError) as ei:
        Root(str(tmp_path / "nope" / "nvmet"), load_modules=False)
    assert "configfs is not mounted" in ei.value.message and "mount -t configfs" in ei.value.fix


def test_root_missing_module(tmp_path):
    (tmp_path / "config").mkdir()
    with pytest.raises(NvmetError) as ei:
        Root(str(tmp_path / "config" / "nvmet"), load_modules=False)
    assert "nvmet module is not loaded" in ei.value.message and "modprobe nvmet" in ei.value.fix


def test_create_lookup_modes(env):
    root = env["root"]
    s = root.subsystem(S1, "create")
    assert s.exists and s.get_attr("attr", "allow_any_host") == "0"
    assert "serial" in s.list_attrs("attr") and "model" in s.list_attrs("attr", writable=True)
    with pytest.raises(NvmetError, match="already exists"):
        root.subsystem(S1, "create")
    with pytest.raises(NvmetError, match="does not exist"):
        root.subsystem(S2, "lookup")
    ns = s.namespace(None, "create")
    assert ns.nsid == 1 and ns.get_enable() == 0
    assert ns.list_attrs("device") == ["nguid", "path", "uuid"]
    assert "revalidate_size" not in json.dumps(ns.dump())    # write-only: not dumped
    assert ns.dump()["device"]["path"] == ""                 # 6.1 prints "(null)"


def test_dump_is_nvmetcli_shape(env):
    apply_dict(env["root"], two_subsystems(env["dev"]))
    d = env["root"].dump()
    assert set(d) == {"discovery", "hosts", "ports", "subsystems"}
    s1 = d["subsystems"][0]
    assert set(s1) == {"attr", "allowed_hosts", "namespaces", "nqn"}
    assert set(s1["namespaces"][0]) == {"ana", "ana_grpid", "device", "enable", "nsid", "resv"}
    assert set(d["ports"][0]) == {"addr", "ana_groups", "param", "portid", "referrals", "subsystems"}
    assert d["ports"][0]["ana_groups"] == [{"ana": {"state": "optimized"}, "grpid": 1}]
    assert d["hosts"][0] == {"dhchap": {}, "nqn": H1}
    # and our config loader takes it back unchanged
    assert parse_config(d, "dump").to_dict() == d


# ---------------------------------------------------------------- apply

def test_apply_two_subsystems_matches_file(env):
    root, fs = env["root"], env["fs"]
    data = two_subsystems(env["dev"])
    steps = apply_dict(root, data)
    assert steps
    cfg = parse_config(data, "t.json")
    is_subset(cfg.to_dict(), root.dump())
    # links, allow-list, enables really happened
    assert root.port(1).subsystems == [S1, S2] and root.port(2).subsystems == [S2]
    assert root.subsystem(S2).allowed_hosts == [H1]
    assert all(n.get_enable() == 1 for s in root.subsystems for n in s.namespaces)
    # the generated serial and namespace UUIDs are what the kernel has
    assert root.subsystem(S1).get_attr("attr", "serial") == cfg.subsystems[0].serial
    assert root.subsystem(S1).namespace(1).get_attr("device", "uuid") == cfg.subsystems[0].namespaces[0].uuid
    # applying again changes nothing
    fs.ops.clear()
    assert apply_dict(root, data) == []
    assert [o for o in fs.ops if o[0] != "read"] == []


def test_dry_run_changes_nothing(env):
    root, fs = env["root"], env["fs"]
    steps = apply_dict(root, two_subsystems(env["dev"]), dry_run=True)
    assert fs.ops == [] and root.dump()["subsystems"] == []
    text = "\n".join(map(str, steps))
    assert f"+ create subsystem {S1}" in text and f"+ link subsystem {S2} to port 2" in text


def test_changed_file_changes_only_the_difference(env):
    root, fs = env["root"], env["fs"]
    data = two_subsystems(env["dev"])
    apply_dict(root, data)
    new = copy.deepcopy(data)
    new["subsystems"][1]["namespaces"][0]["device"]["path"] = str(env["dev"] / "c.img")   # S2 ns1 path
    new["subsystems"][0]["namespaces"].pop()                                               # S1 ns2 gone
    new["subsystems"][1]["allowed_hosts"].append(H2)                                       # allow H2
    new["ports"].pop()                                                                     # port 2 gone
    fs.ops.clear()
    steps = apply_dict(root, new)
    touched = [(op, rel) for op, rel, _ in fs.ops]
    ns1 = f"subsystems/{S1}/namespaces/1"
    # S1's namespace 1 and port 1 are not touched at all
    assert not [t for t in touched if t[1].startswith(ns1)]
    assert not [t for t in touched if t[1].startswith("ports/1")]
    assert ("rmdir", f"subsystems/{S1}/namespaces/2") in touched
    assert ("rmdir", "ports/2") in touched
    # the path change went disable -> path -> enable
    s2 = f"subsystems/{S2}/namespaces/1"
    seq = [(op, rel, v) for op, rel, v in fs.ops if rel.startswith(s2)]
    assert seq == [("write", f"{s2}/enable", "0"), ("write", f"{s2}/device_path", str(env["dev"] / "c.img")),
                   ("write", f"{s2}/enable", "1")]
    assert root.subsystem(S2).allowed_hosts == [H1, H2]
    is_subset(parse_config(new, "n").to_dict(), root.dump())
    assert len(steps) == len([o for o in fs.ops])


def test_port_address_change_relinks(env):
    root, fs = env["root"], env["fs"]
    data = two_subsystems(env["dev"])
    apply_dict(root, data)
    new = copy.deepcopy(data)
    new["ports"][1]["addr"]["trsvcid"] = "4422"
    new["ports"][1]["param"]["inline_data_size"] = "16384"
    fs.ops.clear()
    apply_dict(root, new)
    assert [(op, rel) for op, rel, _ in fs.ops] == [
        ("unlink", f"ports/2/subsystems/{S2}"), ("write", "ports/2/addr_trsvcid"),
        ("write", "ports/2/param_inline_data_size"), ("symlink", f"ports/2/subsystems/{S2}")]
    assert root.port(2).get_attr("addr", "trsvcid") == "4422"


def test_allow_any_host_transitions(env):
    root = env["root"]
    data = two_subsystems(env["dev"])
    apply_dict(root, data)
    open_it = copy.deepcopy(data)
    open_it["subsystems"][1]["attr"]["allow_any_host"] = "1"
    open_it["subsystems"][1]["allowed_hosts"] = []
    apply_dict(root, open_it)          # must drop the links before allow_any_host=1 (EINVAL otherwise)
    s2 = root.subsystem(S2)
    assert s2.allowed_hosts == [] and s2.get_attr("attr", "allow_any_host") == "1"
    apply_dict(root, data)             # and back: allow_any_host=0 before linking
    assert s2.allowed_hosts == [H1] and s2.get_attr("attr", "allow_any_host") == "0"


def test_save_clear_apply_roundtrip(env):
    root = env["root"]
    apply_dict(root, two_subsystems(env["dev"]))
    saved = env["tmp"] / "etc" / "config.json"
    save_json(root.dump(), str(saved))
    assert oct(saved.stat().st_mode & 0o777) == "0o600"
    first = json.loads(saved.read_text())
    root.clear()
    assert root.dump() == {"discovery": {}, "hosts": [], "ports": [], "subsystems": []}
    applymod.apply(root, load_config(saved))
    assert root.dump() == first
    assert not list(saved.parent.glob(".nvmet-*"))      # no temp file left


def test_prune_false_keeps_others(env):
    root = env["root"]
    apply_dict(root, two_subsystems(env["dev"]))
    other = {"ports": [{"portid": 9, "addr": {"trtype": "rdma", "traddr": "10.99.0.1", "trsvcid": "4430"},
                        "subsystems": ["nqn.2024-01.io.example:bench"]}],
             "subsystems": [{"nqn": "nqn.2024-01.io.example:bench",
                             "namespaces": [{"nsid": 1, "device": {"path": "/dev/nullb0"}}]}]}
    apply_dict(root, other, prune=False)
    assert [s.nqn for s in root.subsystems] == ["nqn.2024-01.io.example:bench", S1, S2]
    gone = applymod.remove(root, parse_config(other, "o"))
    assert gone == ["port 9", "subsystem nqn.2024-01.io.example:bench"]
    assert [s.nqn for s in root.subsystems] == [S1, S2] and [p.portid for p in root.ports] == [1, 2]


def test_nvmetcli_saved_file_applies_unchanged(env):
    data = json.loads((FIX / "nvmetcli-saved.json").read_text())
    # point its devices at files of this test; the rest as nvmetcli wrote it
    data["subsystems"][0]["namespaces"][1]["device"]["path"] = str(env["dev"] / "a.img")
    data["ports"][1]["referrals"] = []        # the fake has no loop transport device to check
    root = env["root"]
    applymod.apply(root, parse_config(data, "nvmetcli.json"))
    d = root.dump()
    is_subset(data, d)
    assert d["subsystems"][0]["namespaces"][1]["enable"] == 0


def test_referrals_and_ana_groups(env):
    root = env["root"]
    data = two_subsystems(env["dev"])
    data["ports"][0]["referrals"] = [{"name": "peer", "addr": {"trtype": "rdma", "adrfam": "ipv4",
                                                               "traddr": "10.99.0.2", "trsvcid": "4420"}}]
    data["ports"][0]["ana_groups"] = [{"grpid": 1, "ana": {"state": "optimized"}},
                                      {"grpid": 2, "ana": {"state": "non-optimized"}}]
    data["subsystems"][0]["namespaces"][1]["ana_grpid"] = 2
    apply_dict(root, data)
    p1 = root.port(1)
    assert [r.name for r in p1.referrals] == ["peer"] and p1.referral("peer").get_enable() == 1
    assert [a.grpid for a in p1.ana_groups] == [1, 2]
    assert p1.ana_group(2).get_attr("ana", "state") == "non-optimized"
    assert root.subsystem(S1).namespace(2).grpid == 2
    # change the referral's address: disable, set, enable
    data["ports"][0]["referrals"][0]["addr"]["traddr"] = "10.99.0.3"
    env["fs"].ops.clear()
    apply_dict(root, data)
    assert [(o[0], o[1].rsplit("/", 1)[1], o[2]) for o in env["fs"].ops] == [
        ("write", "enable", "0"), ("write", "addr_traddr", "10.99.0.3"), ("write", "enable", "1")]


# ---------------------------------------------------------------- the kernel's rules as messages

def test_userspace_keys_rejected(env):
    cfg = load_config(Path(__file__).parents[2] / "targets" / "ram.json")
    with pytest.raises(NvmetError) as ei:
        applymod.apply(env["root"], cfg)
    assert "targets/ram.json: subsystems[0].namespaces[0].nvmeof_roce: only the userspace target" in ei.value.message
    assert "device.path" in ei.value.fix


def test_tmpfs_without_buffered_io(env):
    data = two_subsystems(env["dev"])
    data["subsystems"][0]["namespaces"][0]["device"]["path"] = str(env["tmpfs"] / "t.img")
    root = env["root"]
    import nvmeof_roce.kernel.nvmet as nv
    orig = nv.fs_type
    nv.fs_type = lambda p, mountinfo=None: "tmpfs" if str(env["tmpfs"]) in p else "ext4"
    try:
        with pytest.raises(NvmetError) as ei:
            apply_dict(root, data)
        assert "is on tmpfs, which refuses the O_DIRECT" in ei.value.message
        assert "subsystems[0].namespaces[0].enable" in ei.value.message
        assert '"buffered_io": 1' in ei.value.fix
        data["subsystems"][0]["namespaces"][0]["buffered_io"] = 1
        apply_dict(root, data)
        ns = root.subsystem(S1).namespace(1)
        assert ns.get_enable() == 1 and ns.buffered_io == 1
        assert root.dump()["subsystems"][0]["namespaces"][0]["buffered_io"] == 1
    finally:
        nv.fs_type = orig


def test_missing_device_file(env):
    data = two_subsystems(env["dev"])
    data["subsystems"][0]["namespaces"][0]["device"]["path"] = "/nonexistent/x.img"
    with pytest.raises(NvmetError) as ei:
        apply_dict(env["root"], data)
    assert "cannot enable, /nonexistent/x.img does not exist" in ei.value.message
    assert "truncate -s" in ei.value.fix


def test_rdma_module_missing(env):
    env["fs"].unload("nvmet_rdma")
    env["root"].load_modules = False
    with pytest.raises(NvmetError) as ei:
        apply_dict(env["root"], two_subsystems(env["dev"]))
    assert "module nvmet_rdma is not loaded" in ei.value.message and "modprobe nvmet-rdma" in ei.value.fix


def test_address_not_on_rdma_device(env):
    data = two_subsystems(env["dev"])
    data["ports"][0]["addr"]["traddr"] = "10.99.0.5"
    with pytest.raises(NvmetError) as ei:
        apply_dict(env["root"], data)
    assert "could not listen on 10.99.0.5:4420 with RDMA (EADDRNOTAVAIL)" in ei.value.message
    assert "ports[0].subsystems[0]" in ei.value.message and "rdma add-rxe" in ei.value.fix


def test_model_rules_direct(env):
    root = env["root"]
    apply_dict(root, two_subsystems(env["dev"]))
    with pytest.raises(NvmetError) as ei:
        root.port(1).set_attr("addr", "trsvcid", "4499")
    assert "while subsystems are linked to port 1 (EACCES)" in ei.value.message and "unlink" in ei.value.fix
    ns = root.subsystem(S1).namespace(1)
    with pytest.raises(NvmetError) as ei:
        ns.set_attr("device", "path", str(env["dev"] / "c.img"))
    assert "while namespace 1 is enabled (EBUSY)" in ei.value.message and "echo 0 >" in ei.value.fix
    with pytest.raises(NvmetError) as ei:
        ns.set_buffered_io(1)
    assert "buffered_io while namespace 1 is enabled (EINVAL)" in ei.value.message
    s2 = root.subsystem(S2)
    with pytest.raises(NvmetError) as ei:
        s2.set_attr("attr", "allow_any_host", "1")
    assert "allow_any_host=1 while allowed_hosts lists hosts" in ei.value.message
    s1 = root.subsystem(S1)
    with pytest.raises(NvmetError) as ei:
        s1.add_allowed_host(H1)
    assert "while allow_any_host is 1" in ei.value.message
    with pytest.raises(NvmetError) as ei:
        root.subsystem("nqn.2014-08.org.nvmexpress.discovery", "create")
    assert "refuses to create it (EINVAL)" in ei.value.message
    with pytest.raises(NvmetError, match="has no attribute attr_firmware"):
        s1.set_attr("attr", "firmware", "1.0")


def test_attribute_missing_on_this_kernel(env):
    data = two_subsystems(env["dev"])
    data["subsystems"][0]["attr"]["firmware"] = "6.8"
    with pytest.raises(NvmetError) as ei:
        apply_dict(env["root"], data)
    assert "this kernel's nvmet has no such attribute (subsystems[0].attr.firmware)" in ei.value.message


def test_clear_removes_everything(env):
    root = env["root"]
    apply_dict(root, two_subsystems(env["dev"]))
    root.clear()
    assert os.listdir(os.path.join(root.path, "subsystems")) == []
    assert os.listdir(os.path.join(root.path, "ports")) == []
    assert os.listdir(os.path.join(root.path, "hosts")) == []


def test_fs_type(tmp_path):
    mi = tmp_path / "mountinfo"
    mi.write_text("25 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
                  "28 25 0:24 / /tmp rw,relatime - tmpfs tmpfs rw,inode64\n")
    assert fs_type("/tmp/x.img", str(mi)) == "tmpfs"
    assert fs_type("/var/x.img", str(mi)) == "ext4"
    assert fs_type("/tmpx/y", str(mi)) == "ext4"


def test_real_nvmetcli_saved_file(tmp_path):
    # saved by upstream nvmetcli (nvmet/nvme.py save_to_file) from the lab's 6.1 kernel
    raw = json.loads((FIX / "nvmetcli-saved-real-6.1.json").read_text())
    cfg = load_config(FIX / "nvmetcli-saved-real-6.1.json")
    assert cfg.to_dict() == raw
    fs = FakeNvmetFS(tmp_path / "cfs", devices={"/dev/nullb0", "/var/tmp/ca.img", "/var/tmp/cb.img"})
    root = Root(fs.root, fs=fs, sys_module=fs.sys_module)
    applymod.apply(root, cfg)
    is_subset(raw, root.dump())
    assert applymod.apply(root, load_config(FIX / "nvmetcli-saved-real-6.1.json")) == []


def test_inline_data_size_default_is_not_a_difference(env):
    # "-1" (the transport default) reads back as 4096 once nvmet-rdma enabled the port: re-applying must not
    # unlink and relink the port over it
    data = two_subsystems(env["dev"])
    data["ports"][1]["param"]["inline_data_size"] = "-1"
    apply_dict(env["root"], data)
    assert env["root"].port(2).get_attr("param", "inline_data_size") == "4096"
    env["fs"].ops.clear()
    assert apply_dict(env["root"], data) == [] and env["fs"].ops == []


def test_an_empty_passthru_entry_is_not_a_passthru_subsystem(env):
    """Kernels with CONFIG_NVME_TARGET_PASSTHRU (Debian's 6.12) show passthru/ in every subsystem; a save
    from there carries a disabled, device-less passthru entry, which applies like none."""
    cfg = two_subsystems(env["dev"])
    # as 6.12's configfs reads an unset one (captured with nvmet show in the lab)
    cfg["subsystems"][0]["passthru"] = [{"device": {"path": "(null)"}, "enable": 0, "clear_ids": 0,
                                         "admin_timeout": 0, "io_timeout": 0}]
    applymod.apply(env["root"], parse_config(cfg, "saved-612.json"))
    assert S1 in [s.nqn for s in env["root"].subsystems]
    cfg["subsystems"][0]["passthru"] = [{"device": {"path": "/dev/nvme0"}, "enable": 1}]
    with pytest.raises(NvmetError, match="passthru subsystems are not supported"):
        applymod.apply(env["root"], parse_config(cfg, "passthru.json"))


def test_a_missing_device_under_dev_is_not_advised_a_truncate(env):
    data = two_subsystems(env["dev"])
    missing = "/dev/nvmeof-roce-test-missing-n1"
    data["subsystems"][0]["namespaces"][0]["device"]["path"] = missing
    with pytest.raises(NvmetError) as ei:
        apply_dict(env["root"], data)
    assert f"cannot enable, {missing}: no such device" in ei.value.message
    assert "truncate" not in ei.value.fix and "/dev/disk/by-id" in ei.value.fix


def test_reservations_on_a_kernel_without_resv_enable_are_refused_with_the_reason(env):
    data = two_subsystems(env["dev"])
    data["subsystems"][0]["namespaces"][0]["resv"] = {"enable": "1"}
    with pytest.raises(NvmetError) as ei:
        apply_dict(env["root"], data)
    assert "reservations (resv_enable, subsystems[0].namespaces[0].resv.enable) need nvmet of Linux 6.13" in \
        ei.value.message
    assert "target serve" in ei.value.fix
