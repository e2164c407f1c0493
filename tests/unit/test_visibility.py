"""Per-host namespace visibility (SPDK's no_auto_visible, nvmf_ns_add_host / nvmf_ns_remove_host; config
nvmeof_roce.visible_hosts), enforced by the engine: Identify, I/O, the ANA and SMART logs, the change notice."""
import pytest

from nvmeof_roce.config import ConfigError, parse_config
from nvmeof_roce.initiator.controller import NvmeStatusError
from nvmeof_roce.nvme import admin as A
from nvmeof_roce.nvme import status as S
from nvmeof_roce.control.methods import Control, RpcError

from loopback_env import ADDR1, HOST_A, HOST_B, Env, port, ram_ns

SUB = "nqn.2024-01.io.test:shared"


def config(visible=None) -> dict:
    ns2 = ram_ns(2, "1M")
    if visible is not None:
        ns2["nvmeof_roce"]["visible_hosts"] = visible
    return {"hosts": [{"nqn": HOST_A}, {"nqn": HOST_B}], "ports": [port(1, ADDR1, [SUB])],
            "subsystems": [{"nqn": SUB, "namespaces": [ram_ns(1, "1M"), ns2]}]}


@pytest.fixture
def env():
    e = Env(config(visible=[HOST_A]))
    yield e
    e.close()


def _invalid_ns(fn):
    with pytest.raises(NvmeStatusError) as exc:
        fn()
    return exc.value.status == S.INVALID_NS | S.DNR


def test_a_namespace_visible_to_host_a_only(env):
    a = env.connect(SUB, hostnqn=HOST_A)
    b = env.connect(SUB, hostnqn=HOST_B)
    assert a.active_namespaces() == [1, 2]
    assert b.active_namespaces() == [1]
    assert a.identify_namespace(2).nsze == 2048
    ident = b.identify(A.CNS_NAMESPACE, 2)
    assert ident == bytes(len(ident))  # inactive for B: all zero, as SPDK and nvmet answer
    statuses = []
    b.submit_read(2, 0, 1, lambda comp: statuses.append(comp.status), block_size=512)
    b.wait_idle()
    assert statuses == [S.INVALID_NS | S.DNR]
    assert _invalid_ns(lambda: b.namespace_descriptors(2))
    assert _invalid_ns(lambda: b.smart_log(2))
    a.write(2, 0, b"a" * 512)
    assert a.read(2, 0, 1) == b"a" * 512
    assert [g.nsids for g in b.ana_log().groups] == [[1]]
    assert [g.nsids for g in a.ana_log().groups] == [[1, 2]]
    a.close()
    b.close()


def test_rpc_add_ns_no_auto_visible_then_add_and_remove_a_host(env):
    control = Control(env.target)
    a = env.connect(SUB, hostnqn=HOST_A)
    b = env.connect(SUB, hostnqn=HOST_B)
    nsid = control.call("nvmf_subsystem_add_ns", {"nqn": SUB, "namespace": {
        "backend": "ram", "size": "1M", "no_auto_visible": True}})
    assert nsid == 3
    for ctrl in (a, b):
        ctrl.poll_admin()
        ctrl.changed_namespaces()
    assert a.active_namespaces() == [1, 2] and b.active_namespaces() == [1]
    info = control.call("nvmf_get_subsystems", {"nqn": SUB})[0]["namespaces"][2]
    assert info["no_auto_visible"] is True and info["visible_hosts"] == []

    assert control.call("nvmf_ns_add_host", {"nqn": SUB, "nsid": 3, "host": HOST_B}) is True
    b.poll_admin()
    assert b.events[-1] == (A.AER_TYPE_NOTICE, A.AER_NOTICE_NS_CHANGED, A.LID_CHANGED_NS)
    assert b.changed_namespaces() == [3]
    assert b.active_namespaces() == [1, 3] and a.active_namespaces() == [1, 2]
    b.write(3, 1, b"b" * 512)
    assert b.read(3, 1, 1) == b"b" * 512
    assert env.target.config.subsystem(SUB).namespace(3).visible_hosts == [HOST_B]

    assert control.call("nvmf_ns_remove_host", {"nqn": SUB, "nsid": 3, "host": HOST_B}) is True
    b.poll_admin()
    assert b.changed_namespaces() == [3]
    assert b.active_namespaces() == [1]
    assert _invalid_ns(lambda: b.read(3, 1, 1))
    a.close()
    b.close()


def test_visibility_rpc_errors_name_the_field(env):
    control = Control(env.target)
    for method, params, field in (
            ("nvmf_ns_add_host", {"nqn": SUB, "nsid": 1, "host": HOST_B}, "nsid"),   # visible to every host
            ("nvmf_ns_add_host", {"nqn": SUB, "nsid": 2, "host": HOST_A}, "host"),   # already
            ("nvmf_ns_remove_host", {"nqn": SUB, "nsid": 2, "host": HOST_B}, "host"),  # not there
            ("nvmf_ns_add_host", {"nqn": SUB, "nsid": 9, "host": HOST_B}, "nsid"),
            ("nvmf_ns_add_host", {"nqn": SUB, "nsid": 2, "host": "not an nqn"}, "host"),
            ("nvmf_ns_add_host", {"nqn": SUB, "nsid": 2}, "host"),
            ("nvmf_subsystem_add_ns", {"nqn": SUB, "namespace": {"backend": "ram", "size": "1M",
                                                                 "no_auto_visible": "sometimes"}},
             "namespace.no_auto_visible")):
        with pytest.raises(RpcError) as exc:
            control.call(method, params)
        assert exc.value.field == field, (method, params, exc.value.message)
    assert env.target.config.subsystem(SUB).namespace(2).visible_hosts == [HOST_A]


def test_reload_with_other_visible_hosts_tells_the_hosts(env, tmp_path):
    import json
    control = Control(env.target)
    b = env.connect(SUB, hostnqn=HOST_B)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(config(visible=[HOST_A, HOST_B])))
    result = control.reload(str(path))
    assert [c["action"] for c in result["changes"]] == ["namespace-visibility"]
    b.poll_admin()
    assert b.changed_namespaces() == [2]
    assert b.active_namespaces() == [1, 2]
    b.close()


def test_config_key_is_checked():
    cfg = parse_config(config(visible=[]))
    assert cfg.subsystems[0].namespaces[1].visible_hosts == []
    assert cfg.subsystems[0].namespaces[0].visible_hosts is None
    for bad, where in (([HOST_A, HOST_A], "visible_hosts[1]"), (["x y"], "visible_hosts[0]"),
                       ("all", "visible_hosts")):
        with pytest.raises(ConfigError) as exc:
            parse_config(config(visible=bad))
        assert exc.value.where == f"subsystems[0].namespaces[1].nvmeof_roce.{where}"
