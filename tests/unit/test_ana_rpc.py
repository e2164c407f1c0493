"""SPDK's nvmf_subsystem_listener_set_ana_state: the one way to change an ANA state at run time (`target
ana-state` calls it), and the states as nvmeof_get_status reports them."""
import json

import pytest

from nvmeof_roce.nvme import admin as A
from nvmeof_roce.nvme import status as S
from nvmeof_roce.nvme.status import NvmeStatusError
from nvmeof_roce.control.methods import Control, RpcError

from loopback_env import ADDR1, ADDR2, Env, port, ram_ns

SUB = "nqn.2024-01.io.test:ana"
LA1 = {"trtype": "RDMA", "adrfam": "IPv4", "traddr": "10.99.0.1", "trsvcid": "4420"}


def config() -> dict:
    return {"ports": [port(1, ADDR1, [SUB], ana_groups=[{"grpid": 2, "ana": {"state": "optimized"}}]),
                      port(2, ADDR2, [SUB])],
            "subsystems": [{"nqn": SUB, "namespaces": [ram_ns(1), ram_ns(2, ana_grpid=2)]}]}


@pytest.fixture
def env():
    e = Env(config())
    yield e
    e.close()


def _reported(control) -> dict:
    """{portid: {grpid: state}} as nvmeof_get_status reports them (what `target ana-state` shows)."""
    return {p["portid"]: {g["grpid"]: g["state"] for g in p["ana_groups"]}
            for p in control.call("nvmeof_get_status")["ports"]}


def test_set_ana_state_notifies_the_port_and_fails_io_on_that_path(env):
    control = Control(env.target)
    ctrl = env.connect(SUB)
    assert control.call("nvmf_subsystem_listener_set_ana_state", {
        "nqn": SUB, "listen_address": LA1, "ana_state": "inaccessible", "anagrpid": 2}) is True
    ctrl.poll_admin()
    assert ctrl.events == [(A.AER_TYPE_NOTICE, A.AER_NOTICE_ANA, A.LID_ANA)]
    assert [g.state_name for g in ctrl.ana_log().groups] == ["optimized", "inaccessible"]
    with pytest.raises(NvmeStatusError) as exc:
        ctrl.read(2, 0, 1)
    assert exc.value.status == S.ANA_INACCESSIBLE
    assert ctrl.read(1, 0, 1) == bytes(512)  # group 1 still optimized
    # the status reports it, so `target ana-state` on another group starts from it
    assert _reported(control)[1] == {1: "optimized", 2: "inaccessible"}
    # without anagrpid: every group the subsystem's namespaces use; SPDK's spelling of the states
    control.call("nvmf_subsystem_listener_set_ana_state", {"nqn": SUB, "listen_address": LA1,
                                                           "ana_state": "non_optimized"})
    assert env.target.ana.states()[1] == {1: "non-optimized", 2: "non-optimized"}
    assert env.target.ana.states()[2][1] == "optimized"  # the other port is another path
    assert _reported(control) == env.target.ana.states()
    ctrl.close()


def test_set_ana_state_errors_name_the_field(env):
    control = Control(env.target)
    before = env.target.ana.states()
    for params, field in (
            ({"nqn": SUB, "listen_address": LA1, "ana_state": "sleepy"}, "ana_state"),
            ({"nqn": SUB, "listen_address": LA1, "ana_state": "optimized", "anagrpid": 7}, "anagrpid"),
            ({"nqn": SUB, "listen_address": dict(LA1, trsvcid="4999"), "ana_state": "optimized"}, "listen_address"),
            ({"nqn": SUB, "listen_address": dict(LA1, trtype="TCP"), "ana_state": "optimized"},
             "listen_address.trtype"),
            ({"nqn": "nqn.2024-01.io.test:none", "listen_address": LA1, "ana_state": "optimized"}, "nqn"),
            ({"nqn": SUB, "listen_address": LA1}, "ana_state")):
        with pytest.raises(RpcError) as exc:
            control.call("nvmf_subsystem_listener_set_ana_state", params)
        assert exc.value.field == field, params
    assert env.target.ana.states() == before


def test_a_reload_applies_the_files_ana_states(env, tmp_path):
    control = Control(env.target)
    ctrl = env.connect(SUB)
    data = config()
    data["ports"][0]["ana_groups"][0]["ana"]["state"] = "change"
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    result = control.reload(str(path))
    assert [(c["action"], c["portid"]) for c in result["changes"]] == [("ana-state", 1)]
    assert env.target.ana.state(1, 2) == "change"
    ctrl.poll_admin()
    assert ctrl.events == [(A.AER_TYPE_NOTICE, A.AER_NOTICE_ANA, A.LID_ANA)]
    data["ports"][0]["ana_groups"].append({"grpid": 5, "ana": {"state": "optimized"}})
    path.write_text(json.dumps(data))
    with pytest.raises(RpcError) as exc:  # a new group needs a restart (the namespaces' groups are fixed)
        control.reload(str(path))
    assert "ANA group 5" in exc.value.message
    ctrl.close()
