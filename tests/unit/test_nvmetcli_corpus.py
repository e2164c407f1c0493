"""Files saved by nvmetcli's own save code on Debian's 6.1 and 6.12 kernels (tests/unit/fixtures/nvmetcli/,
README there) pass `target check` and serve unchanged: only the namespaces' file paths are those of this
machine.  The kernel path applies them too (tests/lab/test_nvmetcli_corpus_served.py, on the real kernels)."""
import json
from pathlib import Path

import pytest

from nvmeof_roce import cli
from nvmeof_roce.config import load_userspace_config

from loopback_env import Env

FIXTURES = Path(__file__).parent / "fixtures" / "nvmetcli"
CORPUS = sorted(FIXTURES.glob("nvmetcli-*.json"))
SUB_AUTH = "nqn.2024-01.io.nvmeof-roce:nvmetcli-auth"
SUB_OPEN = "nqn.2024-01.io.nvmeof-roce:nvmetcli-open"
HOST_AUTH = "nqn.2014-08.org.nvmexpress:uuid:6f1c2a9e-0000-4000-8000-0000000000a1"
HOST_PLAIN = "nqn.2014-08.org.nvmexpress:uuid:6f1c2a9e-0000-4000-8000-0000000000b2"
SIZES = {"corpus-ns1.img": 64 << 20, "corpus-ns2.img": 32 << 20, "corpus-open.img": 16 << 20}


def test_the_corpus_covers_both_kernels_and_the_keys_in_question():
    assert [p.name for p in CORPUS] == ["nvmetcli-6.1.json", "nvmetcli-6.12.json"]
    new = json.loads((FIXTURES / "nvmetcli-6.12.json").read_text())
    sub = next(s for s in new["subsystems"] if s["nqn"] == SUB_AUTH)
    assert new["discovery"]["nqn"] == "nqn.2014-08.org.nvmexpress.discovery"
    assert new["ports"][0]["addr"]["tsas"] == "connected"
    assert sub["attr"]["firmware"] and sub["attr"]["ieee_oui"]
    assert sub["passthru"][0]["device"]["path"] == "(null)" and not sub["passthru"][0].get("enable")
    host = next(h for h in new["hosts"] if h["nqn"] == HOST_AUTH)
    assert host["dhchap"]["key"].startswith("DHHC-1:01:") and host["dhchap"]["ctrl_key"].startswith("DHHC-1:02:")


def relocated(path: Path, tmp_path: Path) -> dict:
    """The saved file with its namespaces' files made here (sparse, the sizes the guest had)."""
    data = json.loads(path.read_text())
    for s in data["subsystems"]:
        for ns in s["namespaces"]:
            name = Path(ns["device"]["path"]).name
            local = tmp_path / name
            with open(local, "wb") as f:
                f.truncate(SIZES[name])
            ns["device"]["path"] = str(local)
    return data


@pytest.mark.parametrize("saved", CORPUS, ids=[p.stem for p in CORPUS])
def test_target_check_takes_the_saved_file(saved, tmp_path, capsys):
    path = tmp_path / saved.name
    path.write_text(json.dumps(relocated(saved, tmp_path)))
    assert cli.main(["target", "check", str(path)]) == 0, capsys.readouterr()
    assert "OK" in capsys.readouterr().out


@pytest.mark.parametrize("saved", CORPUS, ids=[p.stem for p in CORPUS])
def test_the_saved_file_serves(saved, tmp_path):
    data = relocated(saved, tmp_path)
    path = tmp_path / saved.name
    path.write_text(json.dumps(data))
    load_userspace_config(str(path))
    env = Env(data)
    try:
        addr = "{traddr}:{trsvcid}".format(**data["ports"][0]["addr"])
        host = next(h for h in data["hosts"] if h["nqn"] == HOST_AUTH)
        keys = host.get("dhchap") or {}
        kw = {}
        if keys.get("key"):  # the 6.12 save has DH-HMAC-CHAP keys: the host must authenticate (both ways)
            kw = {"dhchap_secret": keys["key"], "dhchap_ctrl_secret": keys.get("ctrl_key") or None}
        ctrl = env.connect(SUB_AUTH, addr, hostnqn=HOST_AUTH, **kw)
        sub = next(s for s in data["subsystems"] if s["nqn"] == SUB_AUTH)
        ident = ctrl.identify_controller()
        assert ident.sn == sub["attr"]["serial"]
        if "firmware" in sub["attr"]:  # served as nvmet does: FR and IEEE of Identify Controller
            assert ident.fr == sub["attr"]["firmware"]
            assert bytes(ident.ieee) == int(sub["attr"]["ieee_oui"], 0).to_bytes(3, "little")
        ctrl.write(1, 8, b"n" * 512)
        assert ctrl.read(1, 8, 1) == b"n" * 512
        ctrl.close()
        other = env.connect(SUB_OPEN, addr, hostnqn=HOST_PLAIN)
        assert other.identify_namespace(1).nsze == SIZES["corpus-open.img"] // 512
        other.close()
    finally:
        env.close()


def _fake_kernel(tmp_path, generation):
    from fake_nvmet import FakeNvmetFS
    from nvmeof_roce.kernel.nvmet import Root
    newer = generation == "6.12"
    fs = FakeNvmetFS(tmp_path / f"cfs-{generation}", devices={f"/var/tmp/{n}" for n in SIZES},
                     dhchap=newer, discovery_nqn=newer, kernel_612=newer)
    return Root(fs.root, fs=fs, sys_module=fs.sys_module)


@pytest.mark.parametrize("generation", ["6.1", "6.12"])
def test_nvmet_apply_restores_the_save_on_its_kernel(generation, tmp_path):
    """The kernel path, on a configfs model of the kernel the file was saved on: everything saved is applied
    and reads back the same; a second apply changes nothing."""
    from nvmeof_roce.config import load_config
    from nvmeof_roce.kernel import apply as applymod
    sys_path = FIXTURES / f"nvmetcli-{generation}.json"
    saved = json.loads(sys_path.read_text())
    root = _fake_kernel(tmp_path, generation)
    applymod.apply(root, load_config(sys_path))
    dumped = root.dump()
    for want in saved["subsystems"]:
        have = next(s for s in dumped["subsystems"] if s["nqn"] == want["nqn"])
        for key in ("serial", "firmware", "ieee_oui", "allow_any_host"):
            if key in want["attr"]:
                assert have["attr"][key] == want["attr"][key], (want["nqn"], key)
        assert sorted(have["allowed_hosts"]) == sorted(want["allowed_hosts"])
    hosts = {h["nqn"]: h for h in dumped["hosts"]}
    for want in saved["hosts"]:
        for k, v in (want.get("dhchap") or {}).items():
            assert hosts[want["nqn"]]["dhchap"][k] == v, k
    assert dumped["ports"][0]["addr"]["traddr"] == "10.99.0.1"
    assert applymod.apply(root, load_config(sys_path)) == []


def test_a_save_from_612_on_a_61_kernel_names_what_that_kernel_lacks(tmp_path):
    from nvmeof_roce.config import load_config
    from nvmeof_roce.kernel import apply as applymod
    from nvmeof_roce.kernel.nvmet import NvmetError
    root = _fake_kernel(tmp_path, "6.1")
    with pytest.raises(NvmetError, match="this kernel's nvmet has no such attribute") as exc:
        applymod.apply(root, load_config(FIXTURES / "nvmetcli-6.12.json"))
    assert "uname -r" in exc.value.fix
