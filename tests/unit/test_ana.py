"""ANA over the loopback fabric: groups per port, the log page (with and without RGO), Identify fields, the
I/O statuses of each state, the change notice (nvmet_execute_get_log_page_ana, nvmet_check_ana_state)."""
import struct

import pytest

from loopback_env import ADDR1, ADDR2, Env, port, ram_ns
from nvmeof_roce.config import ConfigError, parse_config
from nvmeof_roce.nvme import admin as A
from nvmeof_roce.nvme import identify as I
from nvmeof_roce.nvme import log as L
from nvmeof_roce.nvme import status as S
from nvmeof_roce.nvme.status import NvmeStatusError
from nvmeof_roce.engine.ana import AnaError, set_ana_state
from nvmeof_roce.engine.core import Target

SUB = "nqn.2024-01.io.test:ana"


def ana_config() -> dict:
    """Two ports; namespaces 1 and 3 in group 1, namespace 2 in group 2. Port 1 lists group 2 optimized,
    port 2 lists group 2 non-optimized."""
    return {
        "ports": [port(1, ADDR1, [SUB], ana_groups=[{"grpid": 2, "ana": {"state": "optimized"}}]),
                  port(2, ADDR2, [SUB], ana_groups=[{"grpid": 1, "ana": {"state": "optimized"}},
                                                    {"grpid": 2, "ana": {"state": "non-optimized"}}])],
        "subsystems": [{"nqn": SUB, "namespaces": [ram_ns(1), ram_ns(2, ana_grpid=2), ram_ns(3)]}],
    }


@pytest.fixture
def env():
    e = Env(ana_config())
    yield e
    assert e.target.internal_errors == 0
    e.close()


def test_identify_reports_ana_capabilities(env):
    ctrl = env.connect(SUB)
    idc = ctrl.id_ctrl
    assert idc.cmic == I.CMIC_MULTI_PORT | I.CMIC_MULTI_CTRL | I.CMIC_ANA
    assert idc.anacap == 0x1F  # optimized, non-optimized, inaccessible, persistent loss, change
    assert idc.anatt == 10 and idc.anagrpmax == 128 and idc.nanagrpid == 128
    assert 0 < idc.mnan <= idc.nn  # the Linux host refuses ANA without a valid MNAN
    assert idc.oaes & A.AEN_CFG_ANA_CHANGE
    # the whole log the Linux host reads must fit in one command
    assert L.ANA_HEADER_SIZE + idc.nanagrpid * L.ANA_DESC_SIZE + 4 * idc.mnan <= 4096 << idc.mdts
    assert ctrl.identify_namespace(1).anagrpid == 1
    assert ctrl.identify_namespace(2).anagrpid == 2
    # the raw bytes: ANATT 342, ANACAP 343, ANAGRPMAX 344, NANAGRPID 348; ANAGRPID 92 in the namespace
    raw = ctrl.identify(A.CNS_CONTROLLER)
    assert raw[342] == 10 and raw[343] == 0x1F and struct.unpack_from("<II", raw, 344) == (128, 128)
    assert struct.unpack_from("<I", ctrl.identify(A.CNS_NAMESPACE, 2), 92)[0] == 2
    ctrl.close()


def test_ana_log_page_bytes_per_port(env):
    c1 = env.connect(SUB, ADDR1)
    c2 = env.connect(SUB, ADDR2)
    raw = c1.get_log_page(A.LID_ANA, 16 + 2 * 32 + 12)
    chgcnt, ngrps = struct.unpack_from("<QH", raw, 0)
    assert ngrps == 2 and chgcnt >= 1
    # group 1: NNSIDS 2, state optimized, NSIDs 1 and 3; group 2: one NSID (2)
    assert struct.unpack_from("<IIQB", raw, 16) == (1, 2, chgcnt, L.ANA_STATE_OPTIMIZED)
    assert raw[16 + 17:16 + 32] == bytes(15)
    assert struct.unpack_from("<II", raw, 48) == (1, 3)
    assert struct.unpack_from("<IIQB", raw, 56) == (2, 1, chgcnt, L.ANA_STATE_OPTIMIZED)
    assert struct.unpack_from("<I", raw, 88)[0] == 2
    log2 = c2.ana_log()
    assert [(g.grpid, g.state_name, g.nsids) for g in log2.groups] == \
        [(1, "optimized", [1, 3]), (2, "non-optimized", [2])]
    c1.close()
    c2.close()


def test_ana_log_with_rgo_has_no_nsids(env):
    ctrl = env.connect(SUB, ADDR2)
    raw = ctrl.get_log_page(A.LID_ANA, 16 + 2 * 32 + 8, lsp=L.ANA_LSP_RGO)
    assert struct.unpack_from("<QH", raw, 0)[1] == 2
    assert struct.unpack_from("<IIQB", raw, 16)[:2] == (1, 0)
    assert struct.unpack_from("<IIQB", raw, 48)[1] == 0
    assert raw[48 + 16] == L.ANA_STATE_NON_OPTIMIZED
    assert raw[80:] == bytes(8)  # nothing after the two descriptors
    log = ctrl.ana_log(groups_only=True)
    assert [(g.grpid, g.nsids) for g in log.groups] == [(1, []), (2, [])]
    ctrl.close()


def test_ana_log_reserved_lsp_bits_are_invalid_field(env):
    ctrl = env.connect(SUB)
    with pytest.raises(NvmeStatusError) as exc:
        ctrl.get_log_page(A.LID_ANA, 128, lsp=0x2)
    assert exc.value.status == S.INVALID_FIELD | S.DNR
    ctrl.close()


def test_a_group_a_port_does_not_list_is_inaccessible_there():
    cfg = ana_config()
    cfg["ports"][1]["ana_groups"] = []  # port 2 no longer lists group 2
    env = Env(cfg)
    ctrl = env.connect(SUB, ADDR2)
    states = {g.grpid: g.state_name for g in ctrl.ana_log().groups}
    assert states == {1: "optimized", 2: "inaccessible"}
    with pytest.raises(NvmeStatusError) as exc:
        ctrl.read(2, 0, 1)
    assert exc.value.status == S.ANA_INACCESSIBLE  # no DNR: the host retries on another path
    assert ctrl.read(1, 0, 1) == bytes(512)
    assert ctrl.identify_namespace(2).nuse == 0 and ctrl.identify_namespace(2).nsze > 0
    ctrl.close()
    env.close()


@pytest.mark.parametrize("state, status", [("inaccessible", S.ANA_INACCESSIBLE),
                                           ("persistent-loss", S.ANA_PERSISTENT_LOSS),
                                           ("change", S.ANA_TRANSITION)])
def test_io_status_in_each_state(env, state, status):
    ctrl = env.connect(SUB, ADDR1)
    other = env.connect(SUB, ADDR2)
    ctrl.write(2, 0, b"a" * 512)
    assert set_ana_state(env.target, 1, 2, state)
    env.fabric.pump()
    for op in (lambda: ctrl.read(2, 0, 1), lambda: ctrl.write(2, 0, b"b" * 512), lambda: ctrl.flush(2),
               lambda: ctrl.write_zeroes(2, 0, 1)):
        with pytest.raises(NvmeStatusError) as exc:
            op()
        assert exc.value.status == status and not exc.value.status & S.DNR
        assert exc.value.status >> 8 == 3  # SCT 3: path related
    assert ctrl.error_log()[0].status == status
    # the other group on the same port, and the same group on the other port, still work
    assert ctrl.read(1, 0, 1) == bytes(512)
    assert other.read(2, 0, 1) == b"a" * 512
    # non-optimized serves I/O
    assert set_ana_state(env.target, 1, 2, "non-optimized")
    assert ctrl.read(2, 0, 1) == b"a" * 512
    ctrl.close()
    other.close()


def test_state_change_sends_the_ana_notice_to_that_port_only(env):
    c1 = env.connect(SUB, ADDR1)
    c2 = env.connect(SUB, ADDR2)
    before = c1.ana_log().chgcnt
    assert set_ana_state(env.target, 1, 2, "inaccessible")
    c1.poll_admin()
    c2.poll_admin()
    assert c1.events == [(A.AER_TYPE_NOTICE, A.AER_NOTICE_ANA, A.LID_ANA)] and c1.ana_changed
    assert c2.events == []
    # a second change before the log is read is not reported again (masked until the read)
    assert set_ana_state(env.target, 1, 1, "non-optimized")
    c1.poll_admin()
    assert len(c1.events) == 1
    log = c1.ana_log()
    assert log.chgcnt == before + 2 and all(g.chgcnt == log.chgcnt for g in log.groups)
    assert {g.grpid: g.state_name for g in log.groups} == {1: "non-optimized", 2: "inaccessible"}
    # reading the log re-armed the notice
    assert set_ana_state(env.target, 1, 2, "optimized")
    c1.poll_admin()
    assert len(c1.events) == 2
    # the same state again is no change: no notice, the count stays
    count = env.target.ana.chgcnt
    assert not set_ana_state(env.target, 1, 2, "optimized")
    assert env.target.ana.chgcnt == count
    c1.close()
    c2.close()


def test_ana_log_read_with_rae_keeps_the_notice_masked(env):
    ctrl = env.connect(SUB, ADDR1)
    set_ana_state(env.target, 1, 2, "inaccessible")
    ctrl.poll_admin()
    ctrl.get_log_page(A.LID_ANA, 4096, rae=True)
    set_ana_state(env.target, 1, 2, "optimized")
    ctrl.poll_admin()
    assert len(ctrl.events) == 1
    ctrl.ana_log()  # RAE clear: re-armed
    set_ana_state(env.target, 1, 2, "change")
    ctrl.poll_admin()
    assert len(ctrl.events) == 2
    ctrl.close()


def test_no_notice_unless_the_host_enabled_it(env):
    ctrl = env.connect(SUB, ADDR1)
    ctrl.set_features(A.FEAT_ASYNC_EVENT, A.AEN_CFG_NS_ATTR)  # bit 11 clear
    set_ana_state(env.target, 1, 2, "inaccessible")
    ctrl.poll_admin()
    assert ctrl.events == []
    ctrl.close()


def test_bad_state_changes_name_the_problem(env):
    with pytest.raises(AnaError, match="port 7 is not a port"):
        set_ana_state(env.target, 7, 1, "optimized")
    with pytest.raises(AnaError, match="ANA group 9 does not exist"):
        set_ana_state(env.target, 1, 9, "optimized")
    with pytest.raises(AnaError, match="unknown ANA state 'broken'"):
        set_ana_state(env.target, 1, 1, "broken")


def test_namespace_in_an_undefined_group_is_a_config_error():
    cfg = ana_config()
    cfg["subsystems"][0]["namespaces"].append(ram_ns(4, ana_grpid=5))
    with pytest.raises(ConfigError) as exc:
        Target(parse_config(cfg, "ana.json"))
    assert exc.value.where == "subsystems[0].namespaces[3].ana_grpid"
    assert "ANA group 5 is not defined on any port" in str(exc.value)


def test_ana_log_on_the_kernel_shape_without_groups():
    """A config with no ana_groups: group 1 only, optimized, every namespace in it."""
    env = Env({"ports": [port(1, ADDR1, [SUB])], "subsystems": [{"nqn": SUB, "namespaces": [ram_ns(1), ram_ns(2)]}]})
    ctrl = env.connect(SUB)
    log = ctrl.ana_log()
    assert [(g.grpid, g.state_name, g.nsids) for g in log.groups] == [(1, "optimized", [1, 2])]
    ctrl.close()
    env.close()
