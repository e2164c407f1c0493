"""DH-HMAC-CHAP keys in 0600 files and in the keyring (config/keys.py), over the loopback transport.

A key file readable by its group or others is refused, naming the file, its mode and the chmod; a key rotated
by replacing its file and reloading refuses the old key and takes the new one while a connected host goes on;
SPDK's keyring RPCs; `target check` warns about inline secrets in a file others can read; `nvmet apply` writes
a key file's key into configfs and never shows it.  No key material reaches an answer, an error or the log.
"""
import json
import logging
import os

import pytest

from nvmeof_roce.config import ConfigError, parse_config
from nvmeof_roce.control.methods import Control
from nvmeof_roce.control.protocol import RpcError
from nvmeof_roce.engine import auth
from nvmeof_roce.initiator.auth import HostAuthError
from nvmeof_roce.initiator.controller import HostError
from nvmeof_roce.kernel import apply as applymod
from nvmeof_roce.kernel.nvmet import NvmetError, Root
from nvmeof_roce.nvme import auth as A
from nvmeof_roce.service.commands import check_config
from nvmeof_roce.service.worker_configs import worker_configs

from fake_nvmet import FakeNvmetFS
from loopback_env import ADDR1, HOST_A, HOST_B, Env, port, ram_ns

SUB = "nqn.2024-01.io.test:keys"
KEY = A.generate_secret(1, 32)
NEW_KEY = A.generate_secret(1, 32)
CTRL_KEY = A.generate_secret(3, 64)


def key_file(path, secret: str, mode: int = 0o600):
    """Write `secret` to `path` as an admin replaces a key: a new file renamed over the old one."""
    tmp = f"{path}.new"
    with open(tmp, "w") as f:
        f.write(secret + "\n")  # as `nvmeof-roce gen-dhchap-key > FILE` leaves it
    os.chmod(tmp, mode)
    os.rename(tmp, path)
    return str(path)


def config(key, ctrl_key=None, keyring=None) -> dict:
    group = {"key": key, "hash": "hmac(sha256)", "dhgroup": "null"}
    if ctrl_key:
        group["ctrl_key"] = ctrl_key
    data = {
        "hosts": [{"nqn": HOST_A, "dhchap": group}, {"nqn": HOST_B}],
        "ports": [port(1, ADDR1, [SUB])],
        "subsystems": [{"nqn": SUB, "attr": {"allow_any_host": "0"}, "allowed_hosts": [HOST_A, HOST_B],
                        "namespaces": [ram_ns(1, "1M")]}],
    }
    if keyring:
        data["nvmeof_roce"] = {"keyring": keyring}
    return data


def write_config(path, data, mode=0o600) -> str:
    path.write_text(json.dumps(data))
    os.chmod(path, mode)
    return str(path)


def round_trip(ctrl):
    data = bytes(range(256)) * 2
    ctrl.write(1, 5, data)
    assert ctrl.read(1, 5, 1) == data


@pytest.fixture
def envs():
    made = []

    def make(data):
        made.append(Env(data))
        return made[-1]

    yield make
    for env in made:
        env.close()


@pytest.fixture
def no_key_in_log(caplog):
    caplog.set_level(logging.DEBUG)
    yield
    for secret in (KEY, NEW_KEY, CTRL_KEY):
        assert secret not in caplog.text
        assert secret.split(":")[2][:20] not in caplog.text


# ------------------------------------------------------------------------------------ the file's mode

@pytest.mark.parametrize("mode,who", [(0o644, "others"), (0o640, "its group"), (0o604, "others"),
                                      (0o660, "its group")])
def test_a_key_file_others_may_read_is_refused_naming_the_file_its_mode_and_the_chmod(tmp_path, mode, who):
    path = key_file(tmp_path / "host-a.key", KEY, mode)
    cfg = parse_config(config(path), "c.json")
    with pytest.raises(ConfigError) as ei:
        auth.host_settings(cfg)
    err = ei.value
    assert err.where == "hosts[0].dhchap.key"
    assert f"key file {path}: is mode {mode:04o}: {who} may access it" in err.problem
    assert err.fix == f"chmod 600 {path}"
    assert KEY not in str(err)
    conf = write_config(tmp_path / "c.json", config(path))
    with pytest.raises(ConfigError, match=f"is mode {mode:04o}"):  # target check says the same
        check_config(conf)


def test_a_private_key_file_is_taken_and_its_host_authenticates(envs, tmp_path, no_key_in_log):
    path = key_file(tmp_path / "host-a.key", KEY, 0o400)
    ctrl_path = key_file(tmp_path / "ctrl.key", CTRL_KEY)
    env = envs(config(path, ctrl_path))
    settings = env.target.host_auth[HOST_A]
    assert (settings.key_origin, settings.ctrl_origin) == (f"key file {path}", f"key file {ctrl_path}")
    assert "bytes" in repr(settings) and KEY not in repr(settings)
    with pytest.raises(HostAuthError):
        env.connect(SUB, dhchap_secret=NEW_KEY)
    ctrl = env.connect(SUB, dhchap_secret=KEY, dhchap_ctrl_secret=CTRL_KEY)
    assert ctrl.authenticated_queues == [0, 1]
    round_trip(ctrl)
    ctrl.close()


@pytest.mark.parametrize("make,problem", [
    (lambda p: None, "No such file or directory"),
    (lambda p: os.mkfifo(p, 0o600), "is not a regular file"),
    (lambda p: key_file(p, ""), "is empty"),
    (lambda p: key_file(p, "x" * 5000), "more than a key"),
    (lambda p: key_file(p, KEY[:-5] + "AAAA:"), "CRC-32 does not match"),
])
def test_a_key_file_that_is_not_a_key_is_refused_without_blocking(tmp_path, make, problem):
    path = str(tmp_path / "host-a.key")
    make(path)
    with pytest.raises(ConfigError) as ei:
        auth.host_settings(parse_config(config(path), "c.json"))
    assert ei.value.where == "hosts[0].dhchap.key" and path in ei.value.problem and problem in ei.value.problem


def test_a_value_of_no_known_form_is_refused_without_echoing_it(tmp_path):
    mangled = "DHHC-l" + KEY[6:]  # a typo in the prefix: neither a secret, a path nor a key name
    with pytest.raises(ConfigError) as ei:
        auth.host_settings(parse_config(config(mangled), "c.json"))
    assert "is not a DH-HMAC-CHAP secret (DHHC-1:NN:...:), the absolute path" in ei.value.problem
    assert KEY[7:] not in str(ei.value)
    with pytest.raises(ConfigError, match="no key 'key0' in the keyring"):
        auth.host_settings(parse_config(config("key0"), "c.json"))


# ------------------------------------------------------------------------- rotation by file and reload

def test_a_key_file_replaced_and_reloaded_refuses_the_old_key_and_keeps_connected_hosts(envs, tmp_path,
                                                                                        no_key_in_log):
    path = key_file(tmp_path / "host-a.key", KEY)
    conf = write_config(tmp_path / "target.json", config(path))
    env = envs(config(path))
    ops = env.operations(conf)
    before = env.connect(SUB, dhchap_secret=KEY)
    key_file(path, NEW_KEY)  # replaced; the target has not read it yet
    assert env.connect(SUB, dhchap_secret=KEY).authenticated_queues == [0, 1]
    result = ops.reload()  # what the loop runs after SIGHUP
    assert [c["action"] for c in result["changes"]] == ["host-key"]
    assert f"key changed in key file {path}" in result["changes"][0]["text"]
    assert KEY not in json.dumps(result) and NEW_KEY not in json.dumps(result)
    with pytest.raises(HostAuthError):
        env.connect(SUB, dhchap_secret=KEY)
    after = env.connect(SUB, dhchap_secret=NEW_KEY, num_io_queues=2)
    assert after.authenticated_queues == [0, 1, 2]
    round_trip(before)  # connected with the old key: goes on until it reconnects (as nvmet)
    round_trip(after)
    assert ops.reload()["changes"] == []  # the same file again: nothing to do
    before.close()
    after.close()


def test_a_replaced_key_file_with_a_bad_mode_is_refused_and_the_old_key_stays(envs, tmp_path):
    path = key_file(tmp_path / "host-a.key", KEY)
    conf = write_config(tmp_path / "target.json", config(path))
    env = envs(config(path))
    ops = env.operations(conf)
    key_file(path, NEW_KEY, 0o644)
    control = Control(env.target)
    with pytest.raises(RpcError) as ei:
        control.call("nvmeof_reload_config", {"path": conf})
    assert ei.value.field == "hosts[0].dhchap.key" and "is mode 0644" in ei.value.message
    assert ei.value.fix == f"chmod 600 {path}"
    refused = ops.reload()  # SIGHUP: the same refusal, logged; the target keeps serving
    assert refused["applied"] is False and refused["error"]["data"]["field"] == "hosts[0].dhchap.key"
    ctrl = env.connect(SUB, dhchap_secret=KEY)  # the running key is the one read before
    assert ctrl.authenticated_queues == [0, 1]
    ctrl.close()


# ----------------------------------------------------------------------------------------- the keyring

def test_keyring_rpcs_as_spdk_names_them(envs, tmp_path, no_key_in_log):
    env = envs(config(KEY))
    control = Control(env.target)
    k0 = key_file(tmp_path / "key0", NEW_KEY)
    k1 = key_file(tmp_path / "key1", CTRL_KEY)
    assert control.call("keyring_file_add_key", {"name": "key0", "path": k0}) is True
    assert control.call("keyring_file_add_key", {"name": "key1", "path": k1}) is True
    keys = control.call("keyring_get_keys")
    assert keys == [{"name": "key0", "module": "keyring_file", "removed": False, "probed": False, "refcnt": 1,
                     "path": k0},
                    {"name": "key1", "module": "keyring_file", "removed": False, "probed": False, "refcnt": 1,
                     "path": k1}]
    # SPDK's nvmf_subsystem_set_keys with keyring names
    before = env.connect(SUB, dhchap_secret=KEY)
    assert control.call("nvmf_subsystem_set_keys", {"nqn": SUB, "host": HOST_A, "dhchap_key": "key0",
                                                    "dhchap_ctrlr_key": "key1"}) is True
    assert [k["refcnt"] for k in control.call("keyring_get_keys")] == [2, 2]
    with pytest.raises(HostAuthError):
        env.connect(SUB, dhchap_secret=KEY)
    ctrl = env.connect(SUB, dhchap_secret=NEW_KEY, dhchap_ctrl_secret=CTRL_KEY)
    assert ctrl.authenticated_queues == [0, 1]
    round_trip(before)
    # a key in use cannot go; once unused it can
    with pytest.raises(RpcError) as ei:
        control.call("keyring_file_remove_key", {"name": "key0"})
    assert ei.value.field == "name" and f"in use by host {HOST_A}" in ei.value.message
    control.call("nvmf_subsystem_set_keys", {"nqn": SUB, "host": HOST_A, "dhchap_key": KEY})
    assert control.call("keyring_file_remove_key", {"name": "key0"}) is True
    assert [k["name"] for k in control.call("keyring_get_keys")] == ["key1"]
    # save_config keeps the keyring and the names, never a key file's contents
    saved = control.call("save_config")
    assert saved["nvmeof_roce"]["keyring"] == {"key1": k1}
    assert CTRL_KEY not in json.dumps(saved) and NEW_KEY not in json.dumps(saved)
    for c in (before, ctrl):
        c.close()


@pytest.mark.parametrize("params,field,problem", [
    ({"name": "k", "path": "relative.key"}, "path", "is not an absolute path"),
    ({"name": "k", "path": "/nonexistent/k.key"}, "path", "No such file or directory"),
    ({"name": "k", "path": "WIDE"}, "path", "is mode 0644"),
    ({"name": "k", "path": "JUNK"}, "path", "not a DH-HMAC-CHAP secret"),
    ({"name": "a:b", "path": "GOOD"}, "name", "is not a key name"),
    ({"name": "dup", "path": "GOOD"}, "name", "key 'dup' already exists"),
    ({"name": "k"}, "path", "missing parameter 'path'"),
    ({"name": "k", "path": "GOOD", "module": "x"}, "module", "unknown parameter"),
])
def test_keyring_file_add_key_refusals(envs, tmp_path, params, field, problem):
    env = envs(config(KEY, keyring={"dup": key_file(tmp_path / "dup", KEY)}))
    control = Control(env.target)
    files = {"GOOD": key_file(tmp_path / "good", NEW_KEY), "WIDE": key_file(tmp_path / "wide", NEW_KEY, 0o644),
             "JUNK": key_file(tmp_path / "junk", "not a key")}
    params = {k: files.get(v, v) for k, v in params.items()}
    with pytest.raises(RpcError) as ei:
        control.call("keyring_file_add_key", params)
    assert ei.value.field == field and problem in ei.value.message
    assert NEW_KEY not in str(ei.value)
    assert [k["name"] for k in control.call("keyring_get_keys")] == ["dup"]  # unchanged


def test_add_host_takes_a_keyring_key_as_spdk_does(envs, tmp_path):
    data = config(KEY)
    data["subsystems"][0]["allowed_hosts"] = [HOST_A]
    env = envs(data)
    control = Control(env.target)
    control.call("keyring_file_add_key", {"name": "hostb", "path": key_file(tmp_path / "hostb", NEW_KEY)})
    with pytest.raises(RpcError) as ei:
        control.call("nvmf_subsystem_add_host", {"nqn": SUB, "host": HOST_B, "dhchap_key": "nokey"})
    assert ei.value.field == "dhchap_key" and "no key 'nokey' in the keyring (keys: hostb)" in ei.value.message
    assert control.call("nvmf_subsystem_add_host", {"nqn": SUB, "host": HOST_B, "dhchap_key": "hostb"}) is True
    assert env.target.config.host_entries[1].attrs["dhchap"] == {"key": "hostb"}
    with pytest.raises(HostError, match="requires DH-HMAC-CHAP"):
        env.connect(SUB, hostnqn=HOST_B)
    ctrl = env.connect(SUB, hostnqn=HOST_B, dhchap_secret=NEW_KEY)
    assert ctrl.authenticated_queues == [0, 1]
    ctrl.close()
    with pytest.raises(RpcError, match="dhchap_ctrlr_key without dhchap_key"):
        control.call("nvmf_subsystem_add_host", {"nqn": SUB, "host": HOST_A, "dhchap_ctrlr_key": "hostb"})


def test_a_keyring_key_rotated_by_replacing_its_file_and_reloading(envs, tmp_path):
    path = key_file(tmp_path / "key0", KEY)
    data = config("key0", keyring={"key0": path})
    conf = write_config(tmp_path / "target.json", data)
    env = envs(data)
    before = env.connect(SUB, dhchap_secret=KEY)
    key_file(path, NEW_KEY)
    result = Control(env.target).call("nvmeof_reload_config", {"path": conf})
    assert f"keyring key key0 ({path})" in result["changes"][0]["text"]
    with pytest.raises(HostAuthError):
        env.connect(SUB, dhchap_secret=KEY)
    env.connect(SUB, dhchap_secret=NEW_KEY).close()
    round_trip(before)
    before.close()


def test_the_keyring_s_shape_is_checked_by_the_loader():
    with pytest.raises(ConfigError) as ei:
        parse_config(config(KEY, keyring={"key0": "relative"}), "c.json")
    assert ei.value.where == "nvmeof_roce.keyring.key0" and "absolute path" in ei.value.problem
    with pytest.raises(ConfigError, match="must be an object of key names"):
        parse_config(config(KEY, keyring=["/k"]), "c.json")


def test_workers_keep_the_keyring(tmp_path):
    path = key_file(tmp_path / "key0", KEY)
    data = config("key0", keyring={"key0": path})
    data["nvmeof_roce"]["workers"] = 2
    configs, _, _ = worker_configs(parse_config(data, "c.json"), 2, str(tmp_path))
    for c in configs:
        assert c["nvmeof_roce"]["keyring"] == {"key0": path}
        assert auth.host_settings(parse_config(c, "w.json"))[HOST_A].key == A.parse_secret(KEY)


# ------------------------------------------------------------------------------ target check's warning

def test_target_check_warns_about_inline_secrets_in_a_file_others_can_read(tmp_path):
    wide = write_config(tmp_path / "wide.json", config(KEY, CTRL_KEY), 0o644)
    warnings = check_config(wide)["warnings"]
    assert [w["field"] for w in warnings] == ["hosts[0].dhchap.key", "hosts[0].dhchap.ctrl_key"]
    assert "an inline secret in a file others may read (mode 0644)" in warnings[0]["warning"]
    assert warnings[0]["fix"].startswith(f"chmod 600 {wide}, or put the key in a 0600 file")
    assert KEY not in json.dumps(warnings)
    group = write_config(tmp_path / "group.json", config(KEY), 0o640)
    assert "its group may read" in check_config(group)["warnings"][0]["warning"]
    assert check_config(write_config(tmp_path / "private.json", config(KEY), 0o600))["warnings"] == []
    by_file = write_config(tmp_path / "by-file.json", config(key_file(tmp_path / "k", KEY)), 0o644)
    assert check_config(by_file)["warnings"] == []  # a path is no secret


# ----------------------------------------------------------------------------------- nvmet apply

def test_nvmet_apply_writes_a_key_file_s_key_and_never_shows_it(tmp_path):
    fs = FakeNvmetFS(tmp_path / "cfs", dhchap=True, devices={"/dev/nullb0"})
    root = Root(fs.root, fs=fs, sys_module=fs.sys_module)
    path = key_file(tmp_path / "host-a.key", KEY)
    data = config(path)
    data["subsystems"][0]["namespaces"] = [{"nsid": 1, "device": {"path": "/dev/nullb0"}}]
    cfg = parse_config(data, "k.json")
    planned = applymod.apply(root, cfg, dry_run=True)
    shown = json.dumps([s.to_dict() for s in planned]) + "\n".join(map(str, planned))
    assert "dhchap_key = <secret>" in shown and KEY not in shown
    applymod.apply(root, cfg)
    with open(os.path.join(fs.root, "hosts", HOST_A, "dhchap_key")) as f:
        assert f.read().strip() == KEY
    key_file(path, NEW_KEY)  # rotated: the next apply writes the new key, and shows neither
    steps = applymod.apply(root, cfg)
    assert [s.rel for s in steps] == [f"hosts/{HOST_A}/dhchap_key"]
    assert "(was <secret>)" in str(steps[0]) and KEY not in str(steps[0]) and NEW_KEY not in str(steps[0])
    with open(os.path.join(fs.root, "hosts", HOST_A, "dhchap_key")) as f:
        assert f.read().strip() == NEW_KEY
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="is mode 0644"):
        applymod.apply(root, cfg, dry_run=True)
    with pytest.raises(NvmetError, match="names a keyring key, which only the userspace target has"):
        applymod.kernel_dict(parse_config(dict(data, hosts=[{"nqn": HOST_A, "dhchap": {"key": "key0"}},
                                                            {"nqn": HOST_B}]), "k.json"))


# ------------------------------------------------------------------------------------ the unit's sandbox

def test_target_check_unit_names_a_key_file_the_unit_would_not_see(tmp_path, capsys):
    from nvmeof_roce import cli
    if not str(tmp_path).startswith("/tmp/"):
        pytest.skip("the test's directory is not under /tmp here")
    path = key_file(tmp_path / "host-a.key", KEY)
    ring_path = key_file(tmp_path / "key0", NEW_KEY)
    data = config(path, keyring={"key0": ring_path})
    data["hosts"][1]["dhchap"] = {"key": "key0"}
    conf = write_config(tmp_path / "disk1.json", data)
    code = cli.main(["target", "check", "--json", "--unit", "disk1", "--unit-dir", str(tmp_path / "units"), conf])
    result = json.loads(capsys.readouterr().out)
    assert code == 1
    assert {e["field"]: e["error"] for e in result["errors"]} == {
        "nvmeof_roce.keyring.key0": f"{conf}: nvmeof_roce.keyring.key0: key file {ring_path} is in /tmp, which "
                                    "PrivateTmp=yes hides from the unit",
        "hosts[0].dhchap.key": f"{conf}: hosts[0].dhchap.key: key file {path} is in /tmp, which PrivateTmp=yes "
                               "hides from the unit"}
    assert "/etc/nvmeof-roce/keys/" in result["errors"][0]["fix"]
    assert cli.main(["target", "check", conf]) == 0  # served by hand, the same files are fine


# ------------------------------------------------------------------------------ a key file through a link

def test_a_linked_key_file_is_checked_on_its_target_and_every_message_names_link_and_target(tmp_path):
    """The policy (config/keys.py): a link is followed once; the mode and owner are those of the real file, and a
    refusal names the link and the file it points to, with the chmod aimed at that file."""
    (tmp_path / "secrets").mkdir()
    real = key_file(tmp_path / "secrets" / "host-a.key", KEY, 0o644)
    link = tmp_path / "host-a.key"
    link.symlink_to(real)
    with pytest.raises(ConfigError) as ei:
        auth.host_settings(parse_config(config(str(link)), "c.json"))
    err = ei.value
    assert err.where == "hosts[0].dhchap.key"
    assert f"key file {link} (a link to {real}): is mode 0644: others may access it" in err.problem, err.problem
    assert err.fix == f"chmod 600 {real}"
    assert KEY not in str(err)
    # the link's own mode (0777) is not what counts: a private target is taken, its origin names both
    os.chmod(real, 0o600)
    settings = auth.host_settings(parse_config(config(str(link)), "c.json"))[HOST_A]
    assert settings.key_origin == f"key file {link} (a link to {real})"
    # a dangling link names the target that is missing
    os.unlink(real)
    with pytest.raises(ConfigError) as ei:
        auth.host_settings(parse_config(config(str(link)), "c.json"))
    assert f"key file {link} (a link to {real}): No such file or directory" in ei.value.problem
