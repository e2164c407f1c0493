"""--persist: every accepted live change is written to the config file (atomic, 0600), in the format `target
check` reads; a refused change writes nothing; a restart from the file serves the change.  Over loopback."""
import json
import os
import stat

import pytest

from nvmeof_roce.config import load_userspace_config, parse_config
from nvmeof_roce.control.methods import Control, RpcError
from nvmeof_roce.service.ops import persist_changes
from nvmeof_roce.service.commands import check_config

from loopback_env import ADDR1, HOST_A, HOST_B, Env, file_ns, port, ram_ns

SUB = "nqn.2024-01.io.test:keep"
NEW = "nqn.2024-01.io.test:made-live"
KEY = "DHHC-1:00:ia6zGodOr4SEG0Zzaw398rpY0wqipUWj4jWjUh4HWUz6aQ2n:"


def base_config(tmp_path) -> dict:
    return {"hosts": [{"nqn": HOST_A}], "ports": [port(1, ADDR1, [SUB])],
            "subsystems": [{"nqn": SUB, "attr": {"allow_any_host": "0"}, "allowed_hosts": [HOST_A],
                            "namespaces": [file_ns(1, tmp_path / "ns1.img")]}]}


class Served:
    """A target started from CONFIG as `serve --persist CONFIG` does (a loopback Env), with its Control."""

    def __init__(self, path, persist=True):
        self.path = str(path)
        cfg = load_userspace_config(self.path)
        self.env = Env(cfg.to_dict())
        self.env.target.config.source = self.path
        self.control = Control(self.env.target, config_path=self.path, persist=persist)

    def call(self, method, params):
        return self.control.call(method, params)

    def close(self):
        self.env.close()


@pytest.fixture
def served(tmp_path):
    path = tmp_path / "target.json"
    path.write_text(json.dumps(base_config(tmp_path)))
    s = Served(path)
    yield s
    s.close()


def _file(s):
    with open(s.path) as f:
        return json.load(f)


def test_a_live_add_ns_survives_a_restart(served, tmp_path):
    image = tmp_path / "ns2.img"
    ctrl = served.env.connect(SUB, hostnqn=HOST_A)
    assert served.call("nvmf_subsystem_add_ns", {"nqn": SUB, "namespace": {"path": str(image), "size": "1M"}}) == 2
    ctrl.write(2, 5, b"p" * 512)
    ctrl.close()
    assert stat.S_IMODE(os.stat(served.path).st_mode) == 0o600
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".target.json.")]  # no temporary left behind
    served.close()
    assert check_config(served.path)["ok"]  # `target check` reads what was written
    again = Served(served.path)
    try:
        assert sorted(again.env.target.subsystems[SUB].namespaces) == [1, 2]
        ctrl = again.env.connect(SUB, hostnqn=HOST_A)
        assert ctrl.read(2, 5, 1) == b"p" * 512
        ctrl.close()
    finally:
        again.close()


def test_every_kind_of_change_is_written_and_reads_back_the_same(served, tmp_path):
    calls = [
        ("nvmf_subsystem_add_host", {"nqn": SUB, "host": HOST_B}),
        ("nvmf_subsystem_set_keys", {"nqn": SUB, "host": HOST_B, "dhchap_key": KEY}),
        ("nvmf_subsystem_resize_ns", {"nqn": SUB, "nsid": 1, "size": "4M"}),
        ("nvmf_subsystem_add_ns", {"nqn": SUB, "namespace": {"backend": "ram", "size": "1M",
                                                             "no_auto_visible": True}}),
        ("nvmf_ns_add_host", {"nqn": SUB, "nsid": 2, "host": HOST_B}),
        ("bdev_set_qos_limit", {"nqn": SUB, "nsid": 2, "rw_ios_per_sec": 500}),
        ("nvmf_create_subsystem", {"nqn": NEW, "allow_any_host": True}),
        ("nvmf_subsystem_add_listener", {"nqn": NEW, "listen_address": {"traddr": "10.99.0.1",
                                                                        "trsvcid": "4420"}}),
        ("nvmf_subsystem_listener_set_ana_state", {"nqn": SUB, "listen_address": {
            "traddr": "10.99.0.1", "trsvcid": "4420"}, "ana_state": "non_optimized"}),
        ("nvmf_subsystem_remove_listener", {"nqn": NEW, "listen_address": {"traddr": "10.99.0.1",
                                                                           "trsvcid": "4420"}}),
        ("nvmf_delete_subsystem", {"nqn": NEW}),
        ("nvmf_subsystem_remove_ns", {"nqn": SUB, "nsid": 2}),
        ("nvmf_subsystem_remove_host", {"nqn": SUB, "host": HOST_B}),
    ]
    for method, params in calls:
        before = _file(served)
        served.call(method, params)
        saved = _file(served)
        assert saved != before, method
        assert saved == served.env.target.config.to_dict(), method
        parse_config(saved, served.path)  # loads as a config
    cfg = load_userspace_config(served.path)
    assert cfg.port(1).ana_groups[0].state == "non-optimized"
    assert served.env.target.ana.state(1, 1) == "non-optimized"
    assert cfg.subsystem(SUB).namespace(1).size_bytes == 4 << 20
    assert [h.nqn for h in cfg.host_entries if h.attrs.get("dhchap")] == [HOST_B]


def test_a_refused_change_writes_nothing(served):
    before = os.stat(served.path)
    content = open(served.path).read()
    for method, params in (("nvmf_subsystem_add_ns", {"nqn": SUB, "namespace": {"backend": "ram"}}),
                           ("nvmf_subsystem_add_host", {"nqn": SUB, "host": HOST_A}),
                           ("bdev_set_qos_limit", {"nqn": SUB, "nsid": 1, "rw_ios_per_sec": -1}),
                           ("nvmf_subsystem_listener_set_ana_state", {"nqn": SUB, "listen_address": {
                               "traddr": "10.99.0.1", "trsvcid": "4420"}, "ana_state": "sleepy"})):
        with pytest.raises(RpcError):
            served.call(method, params)
    after = os.stat(served.path)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert open(served.path).read() == content


def test_without_persist_the_file_is_left_alone(tmp_path):
    path = tmp_path / "target.json"
    path.write_text(json.dumps(base_config(tmp_path)))
    content = path.read_text()
    s = Served(path, persist=False)
    try:
        s.call("nvmf_subsystem_add_host", {"nqn": SUB, "host": HOST_B})
        assert path.read_text() == content
    finally:
        s.close()


def test_a_change_that_cannot_be_saved_says_so(served, tmp_path):
    served.control.config_path = str(tmp_path / "gone" / "target.json")
    with pytest.raises(RpcError) as exc:
        served.call("nvmf_subsystem_add_host", {"nqn": SUB, "host": HOST_B})
    assert exc.value.field == "persist" and "applied" in exc.value.message and "save_config" in exc.value.fix
    assert HOST_B in served.env.target.subsystems[SUB].allowed_hosts  # applied; the answer says it is not saved


def test_persist_option_and_config_key():
    on = parse_config({"nvmeof_roce": {"persist": 1}})
    off = parse_config({})
    assert persist_changes(on, None) and not persist_changes(off, None)
    assert persist_changes(off, True) and not persist_changes(on, False)
    assert not persist_changes(on, True, worker=0)  # a worker never writes; its supervisor does
    assert parse_config({"nvmeof_roce": {"persist": 0}}).settings.persist == 0
    with pytest.raises(Exception) as exc:
        parse_config({"nvmeof_roce": {"persist": 2}})
    assert exc.value.where == "nvmeof_roce.persist"


def test_the_supervisor_writes_the_admins_config_once_per_change(tmp_path, monkeypatch):
    from test_workers import _Workers, mp_config
    from nvmeof_roce.service import workers
    cfg = mp_config(cntlid_min="5", cntlid_max="200")
    cfg["nvmeof_roce"] = {"workers": 2, "persist": 1}
    w = _Workers(tmp_path, monkeypatch, cfg)
    try:
        assert w.sup.persist
        writes = []
        real = workers.write_file
        monkeypatch.setattr(workers, "write_file", lambda p, d, *a: (writes.append(p), real(p, d, *a)))
        w.call("nvmf_subsystem_add_ns", {"nqn": workers_sub(), "namespace": {"nsid": 4, "backend": "null",
                                                                            "size": "1M"}})
        assert writes.count(str(w.config_path)) == 1
        saved = json.loads(w.config_path.read_text())
        assert [p["portid"] for p in saved["ports"]] == [1]  # the workers' extra ports are not the admin's
        assert saved["ports"][0]["addr"]["trsvcid"] == "4420"
        sub = saved["subsystems"][0]
        assert (sub["attr"]["cntlid_min"], sub["attr"]["cntlid_max"]) == ("5", "200")
        ns1 = sub["namespaces"][0]
        assert ns1["nvmeof_roce"]["backend"] == "ram" and "path" not in ns1["device"]  # RAM, not its /dev/shm file
        assert [n["nsid"] for n in sub["namespaces"]] == [1, 4]
        assert saved["nvmeof_roce"] == {"workers": 2, "persist": 1}
        assert check_config(str(w.config_path))["ok"]
    finally:
        w.close()


def workers_sub():
    from test_workers import SUB as WSUB
    return WSUB
