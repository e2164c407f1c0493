"""The initiator and the target talking over the loopback fabric: the happy paths and the
behaviours the Linux host depends on (docs/protocol.md §4, §5, §8.1)."""
import os
import uuid

import pytest

from loopback_env import (ADDR1, ADDR2, HOST_A, HOST_B, SUB_4K, SUB_FILE, SUB_HIDDEN, SUB_NULL, SUB_ONLY_A,
                          SUB_RAM, Env, RawQueue, add_namespace, file_ns, port, ram_ns, remove_namespace,
                          standard_config)
from nvmeof_roce.initiator.discovery import discover, read_discovery_log
from nvmeof_roce.initiator.controller import Controller
from nvmeof_roce.nvme import admin as A
from nvmeof_roce.nvme import fabrics as F
from nvmeof_roce.nvme import identify as I
from nvmeof_roce.nvme import log as L
from nvmeof_roce.nvme import status as S
from nvmeof_roce.nvme.status import NvmeStatusError
from nvmeof_roce.config import parse_config
from nvmeof_roce.engine.core import Target
from nvmeof_roce.transport.contracts import TransportError
from nvmeof_roce.transport.loopback import LoopbackFabric


@pytest.fixture
def env(tmp_path):
    e = Env(standard_config(tmp_path))
    yield e
    assert e.target.internal_errors == 0
    e.close()


# ---------------------------------------------------------------------------- connect and identify

def test_connect_enable_and_identify_controller(env):
    ctrl = env.connect(SUB_RAM, num_io_queues=2)
    cap = ctrl.cap
    assert F.cap_mqes(cap) == 127
    assert (cap >> 24) & 0xFF == 15  # TO
    assert (cap >> 37) & 0xFF == 1  # CSS: NVM command set only (not bit 43)
    assert not cap & (1 << 59 | 1 << 60)
    assert (cap >> 48) & 0xF == 0  # MPSMIN 4 KiB
    assert ctrl.vs == 0x00010300
    idc = ctrl.id_ctrl
    assert 1 <= idc.cntlid <= 0xFFEF and idc.cntlid == ctrl.cntlid
    assert idc.subnqn == SUB_RAM
    assert idc.sgls & 0x3 == 1 and idc.sgls & I.SGLS_KEYED and idc.sgls & I.SGLS_OFFSET
    assert idc.icdoff == 0 and idc.ioccsz == (64 + 4096) // 16 and idc.iorcsz == 1
    assert idc.kas != 0 and idc.maxcmd >= 128
    assert idc.cmic == 0x0B and idc.oacs == 0 and idc.apsta == 0
    assert idc.oncs == I.ONCS_DSM | I.ONCS_WRITE_ZEROES | I.ONCS_RESERVATIONS and idc.vwc & 1
    assert idc.cntrltype == I.CNTRLTYPE_IO and idc.ver == ctrl.vs
    assert idc.sqes == 0x66 and idc.cqes == 0x44 and idc.msdbd == 1 and idc.mdts == 5
    assert idc.oaes == A.AEN_CFG_NS_ATTR | A.AEN_CFG_ANA_CHANGE and idc.aerl == 3 and idc.lpa == 0x07 and idc.nn >= 2
    assert idc.sn and idc.mn == "nvmeof-roce"
    assert idc.ctratt & 1  # 128-bit host identifier
    assert len(ctrl.io_queues) == 2
    assert env.target.subsystem(SUB_RAM).controllers[ctrl.cntlid].hostnqn == HOST_A
    ctrl.close()
    assert env.target.subsystem(SUB_RAM).controllers == {}


def test_identify_namespaces_and_descriptors(env):
    ctrl = env.connect(SUB_RAM)
    assert ctrl.active_namespaces() == [1, 2]
    ns = ctrl.identify_namespace(1)
    assert ns.nsze == ns.ncap == ns.nuse == 2 * 1024 * 1024 // 512
    assert ns.lbaf0_lbads == 9 and ns.nlbaf == 0 and ns.flbas == 0 and ns.nmic == 1
    inactive = ctrl.identify_namespace(7)
    assert inactive.ncap == 0 and not inactive.present
    with pytest.raises(NvmeStatusError) as exc:
        ctrl.identify(A.CNS_NAMESPACE, 0xFFFFFFFF)
    assert exc.value.status == S.INVALID_NS | S.DNR
    d1 = ctrl.namespace_descriptors(1)
    d2 = ctrl.namespace_descriptors(2)
    u1, u2 = d1.find(I.NIDT_UUID), d2.find(I.NIDT_UUID)
    assert len(u1) == 16 and u1 != u2
    assert d1.find(I.NIDT_CSI) == b"\0"
    # the UUID is the config's (stable across restarts)
    assert uuid.UUID(bytes=u1) == uuid.UUID(env.config.subsystem(SUB_RAM).namespaces[0].uuid)
    with pytest.raises(NvmeStatusError) as exc:
        ctrl.namespace_descriptors(9)
    assert exc.value.status == S.INVALID_NS | S.DNR
    assert ctrl.identify(A.CNS_CS_CONTROLLER) == bytes(4096)
    with pytest.raises(NvmeStatusError) as exc:
        ctrl.identify(0x08, 1)
    assert exc.value.status == S.INVALID_FIELD | S.DNR
    ctrl.close()


def test_active_ns_list_starts_after_nsid(env):
    ctrl = env.connect(SUB_RAM)
    page = I.ActiveNamespaceList.unpack(ctrl.identify(A.CNS_ACTIVE_NS_LIST, 1)).nsids
    assert page == [2]
    with pytest.raises(NvmeStatusError):
        ctrl.identify(A.CNS_ACTIVE_NS_LIST, 0xFFFFFFFE)
    ctrl.close()


def test_namespace_ids_from_config():
    cfg = {"ports": [port(1, ADDR1, [SUB_RAM])],
           "subsystems": [{"nqn": SUB_RAM, "namespaces": [
               ram_ns(3, device={"nguid": "0123456789abcdef0123456789abcdef", "eui64": "0011223344556677"})]}]}
    env = Env(cfg)
    ctrl = env.connect(SUB_RAM)
    ns = ctrl.identify_namespace(3)
    assert ns.nguid == bytes.fromhex("0123456789abcdef0123456789abcdef")
    assert ns.eui64 == bytes.fromhex("0011223344556677")
    d = ctrl.namespace_descriptors(3)
    assert d.find(I.NIDT_NGUID) == ns.nguid and d.find(I.NIDT_EUI64) == ns.eui64
    ctrl.close()
    env.close()


# ---------------------------------------------------------------------------- data

@pytest.mark.parametrize("subnqn,block_size", [(SUB_RAM, 512), (SUB_4K, 4096), (SUB_FILE, 512)])
def test_write_then_read_back_random_data(env, subnqn, block_size):
    ctrl = env.connect(subnqn, num_io_queues=2)
    assert ctrl.block_size(1) == block_size
    data = os.urandom(block_size * 37)
    ctrl.write(1, 5, data)
    assert ctrl.read(1, 5, 37) == data
    # neighbours untouched
    assert ctrl.read(1, 4, 1) == bytes(block_size)
    assert ctrl.read(1, 42, 1) == bytes(block_size)
    # large transfers are split into slot-sized commands and reassembled in order
    big = os.urandom(block_size * 700)
    ctrl.write(1, 100, big)
    assert ctrl.read(1, 100, 700) == big
    ctrl.flush(1)
    ctrl.close()


def test_in_capsule_and_keyed_writes_both_land(env):
    ctrl = env.connect(SUB_RAM)
    small = os.urandom(512 * 8)  # 4096 bytes: fits in-capsule (IOCCSZ 260)
    large = os.urandom(512 * 9)  # 4608 bytes: keyed SGL, the target RDMA READs it
    ctrl.write(1, 0, small)
    ctrl.write(1, 8, large)
    assert ctrl.read(1, 0, 17) == small + large
    ops_before = env.fabric.ops_run
    ctrl.close()
    assert ops_before > 0


def test_null_backend_reads_zeros_and_accepts_writes(env):
    ctrl = env.connect(SUB_NULL)
    ns = ctrl.identify_namespace(1)
    assert ns.nsze == (1 << 30) // 512
    ctrl.write(1, 1000, os.urandom(4096))
    assert ctrl.read(1, 1000, 8) == bytes(4096)
    ctrl.write_zeroes(1, 0, 100)
    ctrl.dsm_deallocate(1, [(0, 10)])
    ctrl.flush(1)
    ctrl.close()


def test_write_zeroes_and_deallocate(env):
    ctrl = env.connect(SUB_RAM)
    ctrl.write(1, 0, b"\xAA" * 512 * 64)
    ctrl.write_zeroes(1, 4, 4)
    ctrl.dsm_deallocate(1, [(16, 8), (40, 2)])
    got = ctrl.read(1, 0, 64)
    blocks = [got[i * 512:(i + 1) * 512] for i in range(64)]
    zero = bytes(512)
    assert all(b == zero for b in blocks[4:8] + blocks[16:24] + blocks[40:42])
    assert all(b == b"\xAA" * 512 for i, b in enumerate(blocks)
               if not (4 <= i < 8 or 16 <= i < 24 or 40 <= i < 42))
    ctrl.close()


def test_namespaces_and_subsystems_are_isolated(env):
    a = env.connect(SUB_RAM, num_io_queues=1)
    b = env.connect(SUB_4K, num_io_queues=1, hostnqn=HOST_B)
    d1, d2, d3 = os.urandom(4096), os.urandom(4096), os.urandom(4096)
    a.write(1, 0, d1)
    a.write(2, 0, d2)
    b.write(1, 0, d3)
    assert a.read(1, 0, 8) == d1 and a.read(2, 0, 8) == d2 and b.read(1, 0, 1) == d3
    assert a.cntlid != 0 and b.cntlid != 0
    a.close()
    b.close()


def test_multiple_io_queues_share_the_namespace(env):
    ctrl = env.connect(SUB_RAM, num_io_queues=4)
    assert [q.qid for q in ctrl.io_queues] == [1, 2, 3, 4]
    for qid in (1, 2, 3, 4):
        ctrl.write(1, qid * 8, bytes([qid]) * 4096, qid=qid)
    for qid in (1, 2, 3, 4):
        other = qid % 4 + 1
        assert ctrl.read(1, qid * 8, 8, qid=other) == bytes([qid]) * 4096
    ctrl.close()


def test_queue_depth_up_to_mqes_with_many_outstanding(env):
    ctrl = env.connect(SUB_RAM, num_io_queues=1, queue_size=1000)  # clamped to MQES + 1 = 128
    q = ctrl.io_queues[0]
    assert q.depth == 128
    payloads = [os.urandom(512) for _ in range(128)]
    done = []
    for i, p in enumerate(payloads):
        ctrl.submit_write(1, i, p, lambda c: done.append(c.status), block=False)
    assert ctrl.outstanding == 128  # all in flight at once, nothing completed yet
    ctrl.wait_idle()
    assert done == [0] * 128
    reads = {}
    for i in range(128):
        ctrl.submit_read(1, i, 1, lambda c, i=i: reads.__setitem__(i, bytes(c.data)), block=False)
    assert ctrl.outstanding == 128
    ctrl.wait_idle()
    assert [reads[i] for i in range(128)] == payloads
    ctrl.close()


def test_async_submit_blocks_when_queue_full_and_respects_depth(env):
    ctrl = env.connect(SUB_RAM, num_io_queues=2, queue_size=16)
    seen = []
    max_outstanding = 0
    for i in range(500):
        ctrl.submit_read(1, i % 64, 1, lambda c: seen.append(c.status))
        max_outstanding = max(max_outstanding, max(q.outstanding for q in ctrl.io_queues))
    ctrl.wait_idle()
    assert len(seen) == 500 and set(seen) == {0}
    assert max_outstanding == 16
    ctrl.close()


# ---------------------------------------------------------------------------- access control

def test_host_not_allowed_gets_connect_invalid_host(env):
    with pytest.raises(NvmeStatusError) as exc:
        env.connect(SUB_ONLY_A, hostnqn=HOST_B)
    assert exc.value.status == S.CONNECT_INVALID_HOST | S.DNR
    assert exc.value.result == F.iattr_data(F.CONNECT_DATA_OFF_HOSTNQN)
    ctrl = env.connect(SUB_ONLY_A, hostnqn=HOST_A)
    ctrl.close()
    assert env.target.subsystem(SUB_ONLY_A).controllers == {}


def test_subsystem_not_exported_on_the_port(env):
    with pytest.raises(NvmeStatusError) as exc:
        env.connect(SUB_HIDDEN)
    assert exc.value.status == S.CONNECT_INVALID_PARAM | S.DNR
    assert exc.value.result == F.iattr_data(F.CONNECT_DATA_OFF_SUBNQN)
    with pytest.raises(NvmeStatusError):  # port 2 exports only SUB_RAM
        env.connect(SUB_NULL, address=ADDR2)
    env.connect(SUB_RAM, address=ADDR2).close()


def test_discovery_lists_only_what_the_host_may_see(env):
    entries_a = discover(env.connector(ADDR1), hostnqn=HOST_A)
    entries_b = discover(env.connector(ADDR1), hostnqn=HOST_B)
    nqns_a = [e.subnqn for e in entries_a]
    nqns_b = [e.subnqn for e in entries_b]
    assert set(nqns_a) == {SUB_RAM, SUB_4K, SUB_NULL, SUB_ONLY_A, SUB_FILE}
    assert set(nqns_b) == {SUB_RAM, SUB_4K, SUB_NULL, SUB_FILE}
    assert SUB_HIDDEN not in nqns_a
    e = entries_a[0]
    assert e.trtype == L.TRTYPE_RDMA and e.adrfam == L.ADRFAM_IPV4 and e.subtype == L.SUBTYPE_NVME
    assert e.traddr == "10.99.0.1" and e.trsvcid == "4420" and e.portid == 1
    assert e.cntlid == 0xFFFF and e.asqsz == 32
    assert (e.rdma_qptype, e.rdma_prtype, e.rdma_cms) == (1, 1, 1)
    # the discovery controller on port 2 lists port 2 only
    entries = discover(env.connector(ADDR2), hostnqn=HOST_A)
    assert [(x.subnqn, x.portid, x.trsvcid) for x in entries] == [(SUB_RAM, 2, "4421")]
    assert env.target.discovery.controllers == {}  # shut down and disconnected


def test_discovery_controller_identify_and_partial_log_reads(env):
    ctrl = env.connect(F.DISCOVERY_NQN, num_io_queues=0, kato_ms=0)
    idc = ctrl.id_ctrl
    assert idc.cntrltype == I.CNTRLTYPE_DISCOVERY and idc.subnqn == F.DISCOVERY_NQN
    assert idc.cntlid == ctrl.cntlid and idc.sgls & I.SGLS_KEYED and idc.icdoff == 0
    header = L.DiscoveryLogHeader.unpack(ctrl.get_log_page(A.LID_DISCOVERY, 1024, nsid=0, rae=True))
    assert header.numrec == 5 and header.recfmt == 0 and header.genctr != 0
    whole = ctrl.get_log_page(A.LID_DISCOVERY, 1024 * 6, nsid=0)
    assert L.DiscoveryLogHeader.unpack(whole) == header
    # LPO into the middle of an entry, odd partial length: the same bytes as the whole page
    assert ctrl.get_log_page(A.LID_DISCOVERY, 100, nsid=0, offset=1024 + 256) == whole[1280:1380]
    # beyond the end: zeros
    assert ctrl.get_log_page(A.LID_DISCOVERY, 4096, nsid=0, offset=1024 * 6) == bytes(4096)
    assert read_discovery_log(ctrl)[2].subnqn == L.DiscoveryLogEntry.unpack(whole, 3 * 1024).subnqn
    # discovery accepts only Identify CNS 1, LID 0x70, KATO/AEC features
    with pytest.raises(NvmeStatusError) as exc:
        ctrl.identify(A.CNS_NAMESPACE, 1)
    assert exc.value.status == S.INVALID_FIELD | S.DNR
    with pytest.raises(NvmeStatusError) as exc:
        ctrl.get_log_page(A.LID_SMART, 512)
    assert exc.value.status == S.INVALID_FIELD | S.DNR
    with pytest.raises(NvmeStatusError) as exc:
        ctrl.set_features(A.FEAT_NUM_QUEUES, 0)
    assert exc.value.status == S.INVALID_FIELD | S.DNR
    assert ctrl.get_features(A.FEAT_KATO) == 120_000  # KATO 0 on discovery: nvmet's 120 s
    # the log stays stable between reads
    again = L.DiscoveryLogHeader.unpack(ctrl.get_log_page(A.LID_DISCOVERY, 1024, nsid=0))
    assert again.genctr == header.genctr
    ctrl.close()


def test_discovery_referrals_and_wildcard_address():
    cfg = {"ports": [port(1, "0.0.0.0:4420", [SUB_RAM], referrals=[
        {"name": "r1", "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": "10.99.0.9", "trsvcid": "4420"}}])],
           "subsystems": [{"nqn": SUB_RAM, "namespaces": [ram_ns(1)]}]}
    env = Env(cfg)
    entries = discover(env.connector("0.0.0.0:4420"), hostnqn=HOST_A)
    # the loopback listener's own address is the wildcard here, so the port's is kept
    assert [(e.subtype, e.subnqn, e.traddr) for e in entries] == [
        (L.SUBTYPE_NVME, SUB_RAM, "0.0.0.0"), (L.SUBTYPE_REFERRAL, F.DISCOVERY_NQN, "10.99.0.9")]
    env.close()


# ---------------------------------------------------------------------------- controllers

def test_cntlids_are_unique_and_freed(env):
    ctrls = [env.connect(SUB_RAM, num_io_queues=0) for _ in range(4)]
    ids = [c.cntlid for c in ctrls]
    assert len(set(ids)) == 4 and all(1 <= i <= 0xFFEF for i in ids)
    sub = env.target.subsystem(SUB_RAM)
    assert sorted(sub.controllers) == sorted(ids)
    ctrls[1].close()
    assert ids[1] not in sub.controllers
    new = env.connect(SUB_RAM, num_io_queues=0)
    assert new.cntlid not in (ids[0], ids[2], ids[3])
    for c in ctrls[0:1] + ctrls[2:] + [new]:
        c.close()
    assert sub.controllers == {}


def test_cntlid_pool_exhaustion_is_controller_busy():
    cfg = {"ports": [port(1, ADDR1, [SUB_RAM])],
           "subsystems": [{"nqn": SUB_RAM, "attr": {"cntlid_min": "5", "cntlid_max": "6"},
                           "namespaces": [ram_ns(1)]}]}
    env = Env(cfg)
    a = env.connect(SUB_RAM, num_io_queues=0)
    b = env.connect(SUB_RAM, num_io_queues=0)
    assert {a.cntlid, b.cntlid} == {5, 6}
    with pytest.raises(NvmeStatusError) as exc:
        env.connect(SUB_RAM, num_io_queues=0)
    assert exc.value.status == S.CONNECT_CTRL_BUSY | S.DNR
    a.close()
    c = env.connect(SUB_RAM, num_io_queues=0)
    assert c.cntlid == a.cntlid
    b.close()
    c.close()
    env.close()


def test_set_features_number_of_queues(env):
    ctrl = env.connect(SUB_RAM, num_io_queues=0)
    assert ctrl.set_features(A.FEAT_NUM_QUEUES, (3 << 16) | 3) == (3 << 16) | 3
    assert ctrl.get_features(A.FEAT_NUM_QUEUES) == (3 << 16) | 3
    assert ctrl.set_features(A.FEAT_NUM_QUEUES, (500 << 16) | 1) == (1 << 16) | 1  # min of both halves
    assert ctrl.set_features(A.FEAT_NUM_QUEUES, (999 << 16) | 999) == (127 << 16) | 127  # at most 128
    for bad in (0xFFFF, 0xFFFF << 16):
        with pytest.raises(NvmeStatusError) as exc:
            ctrl.set_features(A.FEAT_NUM_QUEUES, bad)
        assert exc.value.status == S.INVALID_FIELD | S.DNR
    ctrl.close()


def test_features_kato_host_id_vwc_and_effects(env):
    hostid = uuid.UUID("11111111-2222-3333-4444-555555555555")
    ctrl = env.connect(SUB_RAM, num_io_queues=0, kato_ms=7000, hostid=hostid)
    assert ctrl.get_features(A.FEAT_KATO) == 7000
    ctrl.set_features(A.FEAT_KATO, 2500)
    assert ctrl.get_features(A.FEAT_KATO) == 3000  # rounded up to seconds, as nvmet does
    assert ctrl.get_features(A.FEAT_VOLATILE_WC) == 1
    sqe = A.GetFeaturesCommand(fid=A.FEAT_HOST_ID, cdw11=1).to_sqe()
    assert ctrl.admin_command(sqe, data_in_len=16).data == hostid.bytes
    with pytest.raises(NvmeStatusError) as exc:
        ctrl.set_features(A.FEAT_HOST_ID, 1)
    assert exc.value.status == S.CMD_SEQ_ERROR | S.DNR
    with pytest.raises(NvmeStatusError) as exc:
        ctrl.set_features(A.FEAT_ASYNC_EVENT, A.AEN_CFG_FW_ACT)
    assert exc.value.status == S.INVALID_FIELD | S.DNR
    effects = L.CommandEffectsLog.unpack(ctrl.get_log_page(A.LID_CMD_EFFECTS, 4096))
    assert effects.admin[A.CNS_CONTROLLER + 5] & L.EFFECT_CSUPP  # Identify (0x06)
    assert effects.io[0x01] == L.EFFECT_CSUPP | L.EFFECT_LBCC and effects.io[0x02] == L.EFFECT_CSUPP
    ctrl.close()


def test_smart_log_counts_io(env):
    ctrl = env.connect(SUB_RAM)
    ctrl.write(1, 0, bytes(512 * 8))
    ctrl.read(1, 0, 8)
    ctrl.read(1, 0, 8)
    smart = ctrl.smart_log()
    assert smart.host_writes == 1 and smart.host_reads == 2
    assert smart.data_units_written == 1 and smart.data_units_read == 1
    assert ctrl.smart_log(nsid=2).host_reads == 0
    with pytest.raises(NvmeStatusError):
        ctrl.smart_log(nsid=9)
    ctrl.close()


# ---------------------------------------------------------------------------- keep-alive and shutdown

def test_kato_expiry_frees_the_controller_and_its_cntlid(env):
    ctrl = env.connect(SUB_RAM, num_io_queues=2, kato_ms=2000)
    sub = env.target.subsystem(SUB_RAM)
    cntlid = ctrl.cntlid
    assert cntlid in sub.controllers
    env.clock.advance(1.5)
    env.fabric.tick()
    assert cntlid in sub.controllers  # not yet
    env.clock.advance(1.0)  # 2.5 s without traffic > KATO 2 s
    env.fabric.tick()
    assert cntlid not in sub.controllers
    for q in [ctrl.admin] + ctrl.io_queues:
        with pytest.raises(TransportError):
            q.transport.poll(0)
    with pytest.raises(TransportError):
        ctrl.read(1, 0, 1)
    assert not env.target.queue_states()  # every queue of the controller is gone
    # the subsystem still works for a new association
    again = env.connect(SUB_RAM)
    again.write(1, 0, bytes(512))
    again.close()


def test_keep_alive_keeps_the_controller(env):
    ctrl = env.connect(SUB_RAM, num_io_queues=1, kato_ms=2000)
    sent = 0
    for _ in range(20):  # 10 seconds in 0.5 s steps with no I/O
        env.clock.advance(0.5)
        sent += ctrl.maybe_keep_alive()
        env.fabric.tick()
    assert sent >= 9  # one per KATO/2
    assert ctrl.cntlid in env.target.subsystem(SUB_RAM).controllers
    ctrl.keep_alive()
    ctrl.write(1, 0, bytes(512))
    ctrl.close()


def test_io_traffic_counts_as_keep_alive(env):
    ctrl = env.connect(SUB_RAM, num_io_queues=1, kato_ms=1000)
    for _ in range(10):
        env.clock.advance(0.8)
        ctrl.read(1, 0, 1)
        env.fabric.tick()
    assert ctrl.cntlid in env.target.subsystem(SUB_RAM).controllers
    ctrl.close()


def test_shutdown_reports_shst_complete(env):
    ctrl = env.connect(SUB_RAM)
    ctrl.write(1, 0, b"x" * 512)
    ctrl.property_set(F.PROP_CC, F.CC_DEFAULT | F.CC_EN | F.CC_SHN_NORMAL)
    csts = ctrl.property_get(F.PROP_CSTS)
    assert csts & F.CSTS_SHST_MASK == F.CSTS_SHST_COMPLETE  # SHST = 10b
    assert not csts & F.CSTS_RDY
    with pytest.raises(NvmeStatusError) as exc:  # after shutdown the controller is not ready
        ctrl.identify_controller()
    assert exc.value.status == S.CMD_SEQ_ERROR | S.DNR
    # re-enable: SHST clears, RDY comes back
    ctrl.property_set(F.PROP_CC, F.CC_DEFAULT | F.CC_EN)
    csts = ctrl.property_get(F.PROP_CSTS)
    assert csts & F.CSTS_RDY and not csts & F.CSTS_SHST_MASK
    ctrl.close()  # the normal path: SHN, wait SHST, disconnect
    assert env.target.subsystem(SUB_RAM).controllers == {}


def test_disable_clears_ready(env):
    ctrl = env.connect(SUB_RAM)
    ctrl.property_set(F.PROP_CC, F.CC_DEFAULT)
    assert ctrl.property_get(F.PROP_CSTS) & F.CSTS_RDY == 0
    with pytest.raises(NvmeStatusError) as exc:
        ctrl.read(1, 0, 1)
    assert exc.value.status == S.CMD_SEQ_ERROR | S.DNR
    ctrl.close()


# ---------------------------------------------------------------------------- events

def test_namespace_add_and_remove_complete_the_aer(env):
    ctrl = env.connect(SUB_RAM)
    assert ctrl._aer_enabled
    ns_cfg = parse_config({"subsystems": [{"nqn": SUB_RAM, "namespaces": [ram_ns(5, "1M")]}]}, "x") \
        .subsystems[0].namespaces[0]
    add_namespace(env.target, SUB_RAM, ns_cfg)
    ctrl.poll_admin()
    assert ctrl.events == [(A.AER_TYPE_NOTICE, A.AER_NOTICE_NS_CHANGED, A.LID_CHANGED_NS)]
    assert ctrl.namespaces_changed
    # a second change before the log is read is not reported again (masked until the read)
    remove_namespace(env.target, SUB_RAM, 2)
    ctrl.poll_admin()
    assert len(ctrl.events) == 1
    assert ctrl.changed_namespaces() == [5, 2]
    assert ctrl.active_namespaces() == [1, 5]
    ctrl.write(5, 0, b"n" * 512)
    assert ctrl.read(5, 0, 1) == b"n" * 512
    with pytest.raises(NvmeStatusError) as exc:
        ctrl.read(2, 0, 1, )
    assert exc.value.status == S.INVALID_NS | S.DNR
    # after the log was read (RAE clear) the next change is reported again
    remove_namespace(env.target, SUB_RAM, 5)
    ctrl.poll_admin()
    assert len(ctrl.events) == 2 and ctrl.changed_namespaces() == [5]
    assert ctrl.changed_namespaces() == []  # reading clears the list
    ctrl.close()


def test_aer_limit_exceeded(env):
    ctrl = env.connect(SUB_RAM, enable_aen=False)
    raw = RawQueue(ctrl.admin.transport)
    for _ in range(4):
        sqe = A.AsyncEventRequestCommand(cid=raw.next_cid()).to_sqe()
        raw.send(sqe.pack())
        assert raw.poll_one(2) is None  # held
    cqe = raw.command(A.AsyncEventRequestCommand())
    assert cqe.status == S.ASYNC_LIMIT | S.DNR
    ctrl.close()


# ---------------------------------------------------------------------------- persistence

def test_file_backend_data_survives_a_target_restart(tmp_path):
    path = tmp_path / "disk.img"
    cfg = {"ports": [port(1, ADDR1, [SUB_FILE])],
           "subsystems": [{"nqn": SUB_FILE, "namespaces": [file_ns(1, path, "4M", 4096)]}]}
    data = os.urandom(4096 * 40)
    env = Env(cfg)
    ctrl = env.connect(SUB_FILE)
    ctrl.write(1, 123, data)
    ctrl.flush(1)
    ctrl.close()
    env.close()
    assert path.stat().st_size == 4 * 1024 * 1024

    env2 = Env(cfg)  # a new Target on the same file
    ctrl = env2.connect(SUB_FILE)
    assert ctrl.identify_namespace(1).block_size == 4096
    assert ctrl.read(1, 123, 40) == data
    ctrl.close()
    env2.close()


def test_target_close_disconnects_hosts_and_refuses_new_queues(env):
    ctrl = env.connect(SUB_RAM)
    env.target.close()
    with pytest.raises(TransportError):
        ctrl.read(1, 0, 1)
    with pytest.raises(TransportError):
        env.connect(SUB_RAM)


def test_target_as_handler_for_any_port():
    config = parse_config(standard_config(), "any-port")
    target = Target(config)
    fabric = LoopbackFabric()
    fabric.listen("192.0.2.9:4420", target)  # the Target itself: every configured port's subsystems
    ctrl = Controller.connect(fabric.connector("192.0.2.9:4420"), SUB_NULL, hostnqn=HOST_B)
    assert ctrl.read(1, 0, 1) == bytes(512)
    ctrl.close()
    entries = discover(fabric.connector("192.0.2.9:4420"), hostnqn=HOST_B)
    assert {(e.portid, e.subnqn) for e in entries} == {(1, SUB_RAM), (1, SUB_4K), (1, SUB_NULL), (2, SUB_RAM)}
    target.close()


def test_controller_is_deleted_shortly_after_shutdown(env):
    """After CC.SHN the host disconnects; the target also ends the association on its own (I/O
    queues at once, the controller after a short linger for the last CSTS reads)."""
    ctrl = env.connect(SUB_RAM, num_io_queues=1)
    sub = env.target.subsystem(SUB_RAM)
    ctrl.property_set(F.PROP_CC, F.CC_DEFAULT | F.CC_EN | F.CC_SHN_NORMAL)
    assert ctrl.property_get(F.PROP_CSTS) & F.CSTS_SHST_MASK == F.CSTS_SHST_COMPLETE
    with pytest.raises(TransportError):
        ctrl.io_queues[0].transport.poll(0)
    assert ctrl.cntlid in sub.controllers
    env.clock.advance(2.5)
    env.fabric.tick()
    assert ctrl.cntlid not in sub.controllers
    with pytest.raises(TransportError):
        ctrl.admin.transport.poll(0)
