"""Every error path of the target, with hand-built capsules: each gets its proper NVMe status
(docs/protocol.md §2.2, §3.1, §4, §6.2), a CM reject, or a clean close of that queue only."""
import os

import pytest

from loopback_env import (HOST_A, HOST_B, SUB_FILE, SUB_ONLY_A, SUB_RAM, Env, RawQueue, raw_connect, raw_enable,
                          remove_namespace, standard_config)
from held import hold
from nvmeof_roce.engine.ioengine import uring_unavailable
from nvmeof_roce.nvme import admin as A
from nvmeof_roce.nvme import cm
from nvmeof_roce.nvme import fabrics as F
from nvmeof_roce.nvme import nvm
from nvmeof_roce.nvme import status as S
from nvmeof_roce.nvme.command import SQE
from nvmeof_roce.nvme.sgl import SglDescriptor
from nvmeof_roce.transport.contracts import ConnectRejected, TransportError


@pytest.fixture
def ctrl(env):
    c = env.connect(SUB_RAM, num_io_queues=2)
    yield c
    if not c.closed:
        c.close()


def io(ctrl, n=0) -> RawQueue:
    return RawQueue(ctrl.io_queues[n].transport)


def admin(ctrl) -> RawQueue:
    return RawQueue(ctrl.admin.transport)


def read_cmd(q: RawQueue, nsid=1, slba=0, nlb=1, length=None, sgl=None):
    length = 512 * nlb if length is None else length
    return nvm.read_command(0, nsid, slba, nlb - 1, sgl or q.keyed(length))


def write_cmd(q: RawQueue, nsid=1, slba=0, nlb=1, length=None, sgl=None):
    length = 512 * nlb if length is None else length
    return nvm.write_command(0, nsid, slba, nlb - 1, sgl or q.keyed(length))


# ---------------------------------------------------------------------------- NVM command checks

def test_out_of_range_lba(ctrl):
    q = io(ctrl)
    blocks = 2 * 1024 * 1024 // 512
    assert q.command(read_cmd(q, slba=blocks - 1)).status == 0
    for cmd in (read_cmd(q, slba=blocks), read_cmd(q, slba=blocks - 1, nlb=2), read_cmd(q, slba=1 << 63),
                write_cmd(q, slba=blocks - 3, nlb=8), nvm.write_zeroes_command(0, 1, blocks - 1, 1)):
        cqe = q.command(cmd)
        assert cqe.status == S.LBA_RANGE | S.DNR, cmd


def test_out_of_range_write_moves_no_data(ctrl):
    """Checks come before the RDMA READ: a buffer the target may not read proves no transfer happened."""
    q = io(ctrl)
    no_read = q.transport.register_with_access(4096, remote_read=False)
    sgl = SglDescriptor.keyed(no_read.addr, 4096, no_read.key)
    cqe = q.command(write_cmd(q, slba=1 << 40, nlb=8, sgl=sgl))
    assert cqe.status == S.LBA_RANGE | S.DNR
    assert q.command(read_cmd(q)).status == 0  # the queue is fine


@pytest.mark.parametrize("nsid", [0, 3, 1024, 0xFFFFFFFF])
def test_bad_nsid(ctrl, nsid):
    q = io(ctrl)
    assert q.command(read_cmd(q, nsid=nsid)).status == S.INVALID_NS | S.DNR
    assert q.command(nvm.FlushCommand(nsid=nsid)).status == S.INVALID_NS | S.DNR


def test_wrong_sgl_length(ctrl):
    q = io(ctrl)
    cases = [
        read_cmd(q, nlb=2, length=1023),
        read_cmd(q, nlb=2, length=1025),
        read_cmd(q, nlb=1, length=0),
        write_cmd(q, nlb=4, length=512),
        nvm.FlushCommand(nsid=1).to_sqe(),
        nvm.write_zeroes_command(0, 1, 0, 0),
        nvm.DsmCommand(nsid=1, nr=3, sgl=q.keyed(63)),  # needs (NR+1) * 16 = 64
    ]
    cases[4].sgl = q.keyed(512)
    cases[5].sgl = q.keyed(512)
    for cmd in cases:
        assert q.command(cmd).status == S.SGL_INVALID_DATA | S.DNR, cmd
    a = admin(ctrl)
    assert a.command(A.IdentifyCommand(cns=1, sgl=a.keyed(4095))).status == S.SGL_INVALID_DATA | S.DNR
    assert a.command(A.KeepAliveCommand(), sgl=a.keyed(8)).status == S.SGL_INVALID_DATA | S.DNR
    assert a.command(A.GetLogPageCommand(lid=2, numd=127, sgl=a.keyed(508))).status == S.SGL_INVALID_DATA | S.DNR
    assert a.command(F.PropertyGet(offset=F.PROP_VS), sgl=a.keyed(4)).status == S.SGL_INVALID_DATA | S.DNR


def test_dsm_accepts_a_larger_buffer_as_linux_sends(ctrl):
    q = io(ctrl)
    ranges = nvm.pack_dsm_ranges([nvm.DsmRange(0, 8), nvm.DsmRange(100, 1)]).ljust(4096, b"\0")
    q.buf.view[:4096] = ranges
    assert q.command(nvm.DsmCommand(nsid=1, nr=1, sgl=q.keyed(4096))).status == 0
    q.buf.view[:16] = nvm.DsmRange(4095, 2).pack()
    assert q.command(nvm.DsmCommand(nsid=1, nr=0, sgl=q.keyed(4096))).status == S.LBA_RANGE | S.DNR
    # attributes without AD: nothing to do, success
    assert q.command(nvm.DsmCommand(nsid=1, nr=0, attributes=nvm.DSM_IDR, sgl=q.keyed(16))).status == 0


def test_transfer_above_mdts_is_invalid_field(ctrl):
    q = io(ctrl)
    nlb = (1 << 20) // 512 + 1
    cqe = q.command(read_cmd(q, nlb=nlb, length=nlb * 512))
    assert cqe.status == S.INVALID_FIELD | S.DNR


@pytest.mark.parametrize("sgl_id,expected", [
    (0x20, S.SGL_INVALID_TYPE | S.DNR),  # segment
    (0x30, S.SGL_INVALID_TYPE | S.DNR),  # last segment
    (0x50, S.SGL_INVALID_TYPE | S.DNR),  # transport data block
    (0xF0, S.SGL_INVALID_TYPE | S.DNR),
    (0x41, S.INVALID_FIELD | S.DNR),  # keyed, unknown subtype
    (0x4E, S.INVALID_FIELD | S.DNR),
    (0x00, S.INVALID_FIELD | S.DNR),  # data block with address: not on RDMA
    (0x02, S.INVALID_FIELD | S.DNR),
])
def test_bad_sgl_type_or_subtype(ctrl, sgl_id, expected):
    q = io(ctrl)
    sgl = SglDescriptor(q.buf.addr, 512, q.buf.key, sgl_id)
    assert q.command(read_cmd(q, sgl=sgl)).status == expected
    assert q.command(write_cmd(q, sgl=sgl)).status == expected
    flush = nvm.FlushCommand(nsid=1).to_sqe()
    flush.sgl = SglDescriptor(0, 0, 0, sgl_id)
    assert q.command(flush).status == expected


def test_keyed_invalidate_subtype_invalidates_the_hosts_key_with_the_response(ctrl):
    q = io(ctrl)
    frwr = q.transport.register_with_access(4096, invalidatable=True)
    frwr.view[:512] = b"k" * 512
    sgl = SglDescriptor.keyed(frwr.addr, 512, frwr.key, invalidate=True)
    assert q.command(write_cmd(q, sgl=sgl)).status == 0
    # the key was invalidated by the response (SEND with Invalidate): a new key is needed for the next command
    frwr2 = q.transport.register_with_access(4096, invalidatable=True)
    assert q.command(read_cmd(q, sgl=SglDescriptor.keyed(frwr2.addr, 512, frwr2.key, invalidate=True))).status == 0
    assert bytes(frwr2.view[:512]) == b"k" * 512
    # reusing an invalidated key is a remote access error that tears the queue down
    q.send(read_cmd(q, sgl=SglDescriptor.keyed(frwr.addr, 512, frwr.key)).pack())
    with pytest.raises(TransportError, match="unknown key"):
        q.poll_one()
    assert q.transport.closed


def test_keyed_invalidate_subtype_on_a_plain_registration_breaks_the_connection_like_rxe(ctrl):
    q = io(ctrl)
    sgl = SglDescriptor.keyed(q.buf.addr, 512, q.buf.key, invalidate=True)
    q.send(read_cmd(q, sgl=sgl).pack())
    with pytest.raises(TransportError, match="not an FRWR key"):
        q.poll_one()
    assert q.transport.closed


def test_in_capsule_rules(ctrl):
    q = io(ctrl)
    data = os.urandom(1024)
    ok = write_cmd(q, nlb=2, sgl=SglDescriptor.in_capsule(1024)).pack()
    assert q.exchange(ok, data).status == 0
    assert ctrl.read(1, 0, 2) == data
    # an offset inside the in-capsule area is honoured
    shifted = write_cmd(q, slba=2, nlb=1, sgl=SglDescriptor.in_capsule(512, offset=100)).pack()
    assert q.exchange(shifted, bytes(100) + data[:512]).status == 0
    assert ctrl.read(1, 2, 1) == data[:512]
    # read direction with in-capsule data
    assert q.command(read_cmd(q, sgl=SglDescriptor.in_capsule(512))).status == S.INVALID_FIELD | S.DNR
    # beyond the 4096-byte in-capsule area
    cqe = q.exchange(write_cmd(q, nlb=1, sgl=SglDescriptor.in_capsule(512, offset=3800)).pack(), bytes(4096))
    assert cqe.status == S.SGL_INVALID_OFFSET | S.DNR
    # describes more than the capsule carried
    cqe = q.exchange(write_cmd(q, nlb=2, sgl=SglDescriptor.in_capsule(1024)).pack(), bytes(512))
    assert cqe.status == S.SGL_INVALID_DATA | S.DNR
    # the admin queue has no in-capsule area at all (Set Features is write-direction: opcode bit 0)
    a = admin(ctrl)
    assert a.command(A.SetFeaturesCommand(fid=A.FEAT_KATO, value=5000),
                     sgl=SglDescriptor.in_capsule(0, offset=8)).status == S.SGL_INVALID_OFFSET | S.DNR
    # Property Set is not write-direction (FCTYPE bit 0 clear): in-capsule data there is Invalid Field
    assert a.command(F.PropertySet(offset=F.PROP_CC, value=ctrl.cc),
                     sgl=SglDescriptor.in_capsule(0)).status == S.INVALID_FIELD | S.DNR


def test_oversize_in_capsule_data_tears_down_only_that_queue(env, ctrl):
    q = io(ctrl)
    big = write_cmd(q, nlb=9, sgl=SglDescriptor.in_capsule(4608)).pack() + bytes(4608)
    q.send(big)  # 64 + 4608 > the 64 + 4096 receive buffer: a local length error, fatal
    with pytest.raises(TransportError):
        q.poll_one()
    # the other I/O queue and the admin queue still work
    other = io(ctrl, 1)
    assert other.command(read_cmd(other)).status == 0
    ctrl.identify_controller()
    # so does another controller
    b = env.connect(SUB_RAM, hostnqn=HOST_B)
    b.write(1, 0, bytes(512))
    b.close()


def test_admin_capsule_larger_than_64_bytes_is_fatal(ctrl):
    a = admin(ctrl)
    a.send(A.KeepAliveCommand(cid=1).pack() + b"\0")
    with pytest.raises(TransportError):
        a.poll_one()


def test_short_capsule_closes_the_queue(ctrl):
    q = io(ctrl)
    q.send(b"\x02" * 40)
    with pytest.raises(TransportError):
        q.poll_one()
    assert io(ctrl, 1).command(read_cmd(io(ctrl, 1))).status == 0


# ---------------------------------------------------------------------------- RDMA access errors

def _expect_teardown(q: RawQueue, capsule) -> None:
    q.send(capsule.pack() if hasattr(capsule, "pack") else capsule)
    with pytest.raises(TransportError):
        for _ in range(5):
            q.transport.poll(0)


def test_wrong_key_tears_down_the_queue_only(env, ctrl):
    other_ctrl = env.connect(SUB_RAM, hostnqn=HOST_B)
    q = io(ctrl)
    bogus = SglDescriptor.keyed(q.buf.addr, 512, q.buf.key ^ 0x5A5A)
    _expect_teardown(q, write_cmd(q, sgl=bogus))  # RDMA READ with a bad key
    # same controller: the other I/O queue and the admin queue are unaffected
    ctrl.write(1, 0, b"y" * 512, qid=2)
    assert ctrl.read(1, 0, 1, qid=2) == b"y" * 512
    assert ctrl.identify_controller().cntlid == ctrl.cntlid
    # and another controller
    other_ctrl.write(1, 8, b"z" * 512)
    assert other_ctrl.read(1, 8, 1) == b"z" * 512
    other_ctrl.close()
    # the torn down QID can be connected again
    assert 1 not in env.target.subsystem(SUB_RAM).controllers[ctrl.cntlid].io_queues


def test_read_to_a_bad_key_out_of_bounds_or_read_only_buffer_tears_down(ctrl, env):
    q = io(ctrl)
    _expect_teardown(q, read_cmd(q, sgl=SglDescriptor.keyed(q.buf.addr, 512, 0xDEAD)))  # RDMA WRITE, bad key
    q2 = io(ctrl, 1)
    end = q2.buf.addr + len(q2.buf.view)
    _expect_teardown(q2, read_cmd(q2, nlb=2, sgl=SglDescriptor.keyed(end - 512, 1024, q2.buf.key)))
    c2 = env.connect(SUB_RAM, hostnqn=HOST_B)
    q3 = io(c2)
    read_only = q3.transport.register_with_access(4096, remote_write=False)
    _expect_teardown(q3, read_cmd(q3, sgl=SglDescriptor.keyed(read_only.addr, 512, read_only.key)))
    assert c2.identify_controller().cntlid == c2.cntlid  # the admin queue survives
    c2.close()


def test_connect_data_with_bad_key_tears_down_the_admin_queue(env):
    transport = env.connector().connect(0, 32, 31, 0)
    q = RawQueue(transport)
    _expect_teardown(q, F.ConnectCommand(cid=1, sgl=SglDescriptor.keyed(q.buf.addr, 1024, 0x1234)))
    assert env.target.subsystem(SUB_RAM).controllers == {}


# ---------------------------------------------------------------------------- sequence errors

def test_commands_before_connect_are_invalid_opcode(env):
    transport = env.connector().connect(0, 32, 31, 0)
    q = RawQueue(transport)
    for cmd in (A.IdentifyCommand(cns=1, sgl=q.keyed(4096)), F.PropertyGet(offset=F.PROP_CAP, size8=True),
                A.KeepAliveCommand(), F.PropertySet(offset=F.PROP_CC, value=1), SQE(opc=0x99)):
        assert q.command(cmd).status == S.INVALID_OPCODE | S.DNR
    io_transport = env.connector().connect(1, 32, 31, 0)
    qi = RawQueue(io_transport)
    assert qi.command(read_cmd(qi)).status == S.INVALID_OPCODE | S.DNR


def test_commands_before_enable_are_sequence_errors(env):
    q, cqe = raw_connect(env.connector(), SUB_RAM)
    assert cqe.status == 0
    cntlid = cqe.result & 0xFFFF
    assert q.command(A.IdentifyCommand(cns=1, sgl=q.keyed(4096))).status == S.CMD_SEQ_ERROR | S.DNR
    assert q.command(A.KeepAliveCommand()).status == S.CMD_SEQ_ERROR | S.DNR
    # fabrics commands work before enable
    cap = q.command(F.PropertyGet(offset=F.PROP_CAP, size8=True))
    assert cap.status == 0 and F.cap_mqes(cap.result | cap.dw1 << 32) == 127
    # an I/O queue can connect, but I/O before enable is a sequence error
    qi, cqe = raw_connect(env.connector(), SUB_RAM, qid=1, cntlid=cntlid, sqsize=31)
    assert cqe.status == 0
    assert qi.command(read_cmd(qi)).status == S.CMD_SEQ_ERROR | S.DNR
    assert raw_enable(q) & F.CSTS_RDY
    assert qi.command(read_cmd(qi)).status == 0


def test_bad_cc_sets_cfs(env):
    q, _ = raw_connect(env.connector(), SUB_RAM)
    csts = raw_enable(q, F.CC_EN | (7 << F.CC_IOSQES_SHIFT) | (4 << F.CC_IOCQES_SHIFT))
    assert csts & F.CSTS_CFS and not csts & F.CSTS_RDY
    raw_enable(q, 0)
    assert raw_enable(q, F.CC_EN | F.CC_DEFAULT | (1 << F.CC_MPS_SHIFT)) & F.CSTS_CFS
    raw_enable(q, 0)
    assert raw_enable(q) == F.CSTS_RDY


def test_flags_fuse_and_psdt(ctrl):
    q = io(ctrl)
    assert q.command(read_cmd(q), flags=0x41).status == S.INVALID_FIELD | S.DNR  # fused
    assert q.command(read_cmd(q), flags=0x00).status == S.INVALID_FIELD | S.DNR  # PRP
    assert q.command(read_cmd(q), flags=0xC0).status == S.INVALID_FIELD | S.DNR  # reserved
    assert q.command(read_cmd(q), flags=0x80).status == 0  # PSDT 10: tolerated


def test_unknown_opcodes(ctrl):
    q = io(ctrl)
    assert q.command(SQE(opc=0x7E, nsid=1)).status == S.INVALID_OPCODE | S.DNR
    assert q.command(SQE(opc=0x7F, nsid=F.FCTYPE_PROPERTY_GET)).status == S.INVALID_OPCODE | S.DNR
    a = admin(ctrl)
    for opc in (0x00, 0x01, 0x04, 0x05, 0x0D, 0x10, 0x80, 0xC0):
        assert a.command(SQE(opc=opc)).status == S.INVALID_OPCODE | S.DNR, hex(opc)
    for fctype in (0x02, 0x05, 0x06, 0x08, 0x7F):
        assert a.command(SQE(opc=0x7F, nsid=fctype)).status == S.INVALID_OPCODE | S.DNR


def test_properties(ctrl):
    a = admin(ctrl)
    assert a.command(F.PropertyGet(offset=F.PROP_VS, size8=True)).status == S.INVALID_FIELD | S.DNR
    assert a.command(F.PropertyGet(offset=F.PROP_CAP)).status == S.INVALID_FIELD | S.DNR
    assert a.command(F.PropertyGet(offset=F.PROP_NSSR)).status == S.INVALID_FIELD | S.DNR
    assert a.command(F.PropertySet(offset=F.PROP_CAP, value=1)).status == S.INVALID_FIELD | S.DNR
    assert a.command(F.PropertySet(offset=F.PROP_CC, value=1, size8=True)).status == S.INVALID_FIELD | S.DNR
    vs = a.command(F.PropertyGet(offset=F.PROP_VS))
    assert vs.result == 0x00010300 and vs.dw1 == 0  # DW1 zero on a 4-byte get
    cc = a.command(F.PropertyGet(offset=F.PROP_CC)).result
    assert cc == 0x00460001


# ---------------------------------------------------------------------------- Connect checks

def test_connect_errors(env):
    c = env.connector()
    # RECFMT
    transport = c.connect(0, 32, 31, 0)
    q = RawQueue(transport)
    q.buf.view[:1024] = F.ConnectData(bytes(16), 0xFFFF, SUB_RAM, HOST_A).pack()
    cqe = q.command(F.ConnectCommand(recfmt=1, sgl=q.keyed(1024)))
    assert cqe.status == S.CONNECT_FORMAT | S.DNR
    # data length must be exactly 1024
    assert q.command(F.ConnectCommand(sgl=q.keyed(1023))).status == S.SGL_INVALID_DATA | S.DNR
    assert q.command(F.ConnectCommand(sgl=q.keyed(2048))).status == S.SGL_INVALID_DATA | S.DNR
    # admin CNTLID must be 0xFFFF
    q.buf.view[:1024] = F.ConnectData(bytes(16), 1, SUB_RAM, HOST_A).pack()
    cqe = q.command(F.ConnectCommand(sgl=q.keyed(1024)))
    assert (cqe.status, cqe.result) == (S.CONNECT_INVALID_PARAM | S.DNR, 0x10010)
    # unknown subsystem
    q.buf.view[:1024] = F.ConnectData(bytes(16), 0xFFFF, "nqn.2024-01.io.test:nope", HOST_A).pack()
    cqe = q.command(F.ConnectCommand(sgl=q.keyed(1024)))
    assert (cqe.status, cqe.result) == (S.CONNECT_INVALID_PARAM | S.DNR, 0x10100)
    # SQSIZE 0 and above the admin queue size
    q.buf.view[:1024] = F.ConnectData(bytes(16), 0xFFFF, SUB_RAM, HOST_A).pack()
    for sqsize in (0, 32):
        cqe = q.command(F.ConnectCommand(sqsize=sqsize, sgl=q.keyed(1024)))
        assert (cqe.status, cqe.result) == (S.CONNECT_INVALID_PARAM | S.DNR, 44)
    # QID differs from the queue's
    cqe = q.command(F.ConnectCommand(qid=3, sgl=q.keyed(1024)))
    assert (cqe.status, cqe.result) == (S.CONNECT_INVALID_PARAM | S.DNR, 42)
    # finally a good one, and a second Connect on the connected queue
    cqe = q.command(F.ConnectCommand(sgl=q.keyed(1024)))
    assert cqe.status == 0 and 1 <= cqe.result <= 0xFFEF and cqe.result >> 16 == 0
    assert q.command(F.ConnectCommand(sgl=q.keyed(1024))).status == S.CONNECT_CTRL_BUSY | S.DNR


def test_io_connect_must_match_controller_host_and_subsystem(env):
    admin_q, cqe = raw_connect(env.connector(), SUB_ONLY_A, hostnqn=HOST_A)
    cntlid = cqe.result
    raw_enable(admin_q)
    # wrong CNTLID
    _, cqe = raw_connect(env.connector(), SUB_ONLY_A, qid=1, cntlid=cntlid + 1)
    assert (cqe.status, cqe.result) == (S.CONNECT_INVALID_PARAM | S.DNR, 0x10010)
    # a host that is not allowed
    _, cqe = raw_connect(env.connector(), SUB_ONLY_A, hostnqn=HOST_B, qid=1, cntlid=cntlid)
    assert cqe.status == S.CONNECT_INVALID_HOST | S.DNR
    # the right CNTLID in another subsystem
    _, cqe = raw_connect(env.connector(), SUB_RAM, qid=1, cntlid=cntlid)
    assert cqe.status == S.CONNECT_INVALID_PARAM | S.DNR
    # SQSIZE above MQES
    _, cqe = raw_connect(env.connector(), SUB_ONLY_A, qid=1, cntlid=cntlid, sqsize=128, hsqsize=127)
    assert (cqe.status, cqe.result) == (S.CONNECT_INVALID_PARAM | S.DNR, 44)
    # QID above what Set Features granted
    admin_q.buf.view[:0] = b""
    assert admin_q.command(A.SetFeaturesCommand(fid=A.FEAT_NUM_QUEUES, value=0x00010001)).status == 0
    _, cqe = raw_connect(env.connector(), SUB_ONLY_A, qid=3, cntlid=cntlid)
    assert (cqe.status, cqe.result) == (S.CONNECT_INVALID_PARAM | S.DNR, 42)
    # a good one, then the same QID again on another connection
    q1, cqe = raw_connect(env.connector(), SUB_ONLY_A, qid=2, cntlid=cntlid)
    assert cqe.status == 0
    _, cqe = raw_connect(env.connector(), SUB_ONLY_A, qid=2, cntlid=cntlid)
    assert cqe.status == S.CMD_SEQ_ERROR | S.DNR
    assert q1.command(read_cmd(q1)).status == 0


def test_io_connect_in_capsule(env):
    admin_q, cqe = raw_connect(env.connector(), SUB_RAM)
    raw_enable(admin_q)
    transport = env.connector().connect(1, 32, 31, cqe.result)
    q = RawQueue(transport)
    data = F.ConnectData(bytes(range(16)), cqe.result, SUB_RAM, HOST_A).pack()  # raw_connect's host ID
    cmd = F.ConnectCommand(cid=7, qid=1, sqsize=31, sgl=SglDescriptor.in_capsule(1024))
    reply = q.exchange(cmd.pack(), data)
    assert (reply.status, reply.cid, reply.sqid) == (0, 7, 1)


# ---------------------------------------------------------------------------- CM level

def test_cm_rejects(env):
    c = env.connector()
    with pytest.raises(ConnectRejected) as exc:
        c.connect_raw(cm.CmConnectRequest(recfmt=1).pack())
    assert exc.value.status == cm.STS_INVALID_RECFMT
    with pytest.raises(ConnectRejected) as exc:
        c.connect_raw(cm.CmConnectRequest(qid=0, hrqsize=33, hsqsize=32).pack())
    assert exc.value.status == cm.STS_INVALID_HSQSIZE
    with pytest.raises(ConnectRejected) as exc:
        c.connect_raw(cm.CmConnectRequest(qid=1, hrqsize=129, hsqsize=128).pack())  # above MQES 127
    assert exc.value.status == cm.STS_INVALID_HSQSIZE
    with pytest.raises(ConnectRejected) as exc:
        c.connect_raw(cm.CmConnectRequest(qid=200, hrqsize=32, hsqsize=31).pack())
    assert exc.value.status == cm.STS_INVALID_QID
    with pytest.raises(ConnectRejected) as exc:
        c.connect_raw(cm.CmConnectRequest(qid=0, hrqsize=0, hsqsize=31).pack())
    assert exc.value.status == cm.STS_INVALID_HRQSIZE
    with pytest.raises(ConnectRejected) as exc:
        c.connect_raw(b"\0" * 6)
    assert exc.value.status == cm.STS_INVALID_LEN
    # the 56 bytes a RoCE CONNECT_REQUEST carries are fine
    q = c.connect_raw(cm.CmConnectRequest().pack() + bytes(24))
    assert q.qid == 0 and q.crqsize == 32
    assert all(not qs.closed for qs in env.target.queue_states())


def test_port_queue_size_parameter_sets_mqes():
    config = standard_config()
    config["ports"][0]["param"] = {"max_queue_size": "32", "inline_data_size": "0"}
    env = Env(config)
    ctrl = env.connect(SUB_RAM, queue_size=128)
    assert F.cap_mqes(ctrl.cap) == 31 and ctrl.io_queues[0].depth == 32
    assert not ctrl.id_ctrl.sgls & (1 << 20) and ctrl.id_ctrl.ioccsz == 4  # no in-capsule data
    ctrl.write(1, 0, bytes(512))  # goes keyed
    with pytest.raises(ConnectRejected):
        env.connector().connect(1, 64, 63, ctrl.cntlid)
    ctrl.close()
    env.close()


# ---------------------------------------------------------------------------- logs, keep alive, echo

def test_log_page_errors_and_error_log(ctrl):
    a = admin(ctrl)
    assert a.command(A.GetLogPageCommand(lid=2, numd=127, lpo=2, sgl=a.keyed(512))).status == \
        S.INVALID_FIELD | S.DNR
    assert a.command(A.GetLogPageCommand(lid=0x70, numd=255, sgl=a.keyed(1024))).status == \
        S.INVALID_FIELD | S.DNR  # discovery log from an I/O controller
    assert a.command(A.GetLogPageCommand(lid=0x0C, numd=255, lsp=0x40, sgl=a.keyed(1024))).status == \
        S.INVALID_FIELD | S.DNR  # ANA log with a reserved LSP bit
    assert a.command(A.GetLogPageCommand(lid=0x0D, numd=255, sgl=a.keyed(1024))).status == \
        S.INVALID_FIELD | S.DNR  # a log page we do not have
    q = io(ctrl)
    cqe = q.command(read_cmd(q, slba=1 << 30))
    errors = ctrl.error_log()
    newest = errors[0]
    assert newest.sqid == 1 and newest.cid == cqe.cid and newest.status == S.LBA_RANGE | S.DNR
    assert newest.lba == 1 << 30 and newest.nsid == 1 and newest.param_location == 40
    assert [e.error_count for e in errors] == sorted((e.error_count for e in errors), reverse=True)


def test_keep_alive_with_kato_zero(env):
    ctrl = env.connect(SUB_RAM, kato_ms=0)
    assert admin(ctrl).command(A.KeepAliveCommand()).status == S.KA_TIMEOUT_INVALID | S.DNR
    # nvmet runs no timer with KATO 0; this target bounds it by max_kato (300 s by default), and any
    # command counts as traffic (TBKAS)
    controllers = env.target.subsystem(SUB_RAM).controllers
    env.clock.advance(299)
    env.fabric.tick()
    ctrl.identify(1)
    env.clock.advance(299)
    env.fabric.tick()
    assert ctrl.cntlid in controllers
    env.clock.advance(2)
    env.fabric.tick()
    assert ctrl.cntlid not in controllers  # idle past max_kato: a vanished host is reclaimed


def test_cid_echo_sqid_and_sqhd(ctrl):
    q = io(ctrl)
    heads = []
    for cid in (0, 0x1234, 0xFFFF, 0xF00F):
        cmd = read_cmd(q).to_sqe()
        cmd.cid = cid
        cqe = q.exchange(cmd)
        assert (cqe.cid, cqe.sqid) == (cid, 1)
        heads.append(cqe.sqhd)
    assert heads == [(heads[0] + i) % 32 for i in range(4)]  # advances modulo the queue size


def test_sq_flow_control_disabled_reports_ffff(env):
    q, cqe = raw_connect(env.connector(), SUB_RAM)
    raw_enable(q)
    transport = env.connector().connect(1, 32, 31, cqe.result)
    qi = RawQueue(transport)
    qi.buf.view[:1024] = F.ConnectData(bytes(range(16)), cqe.result, SUB_RAM, HOST_A).pack()
    reply = qi.command(F.ConnectCommand(qid=1, sqsize=31, cattr=F.CATTR_DISABLE_SQFLOW, sgl=qi.keyed(1024)))
    assert reply.status == 0 and reply.sqhd == 0xFFFF
    assert qi.command(read_cmd(qi)).sqhd == 0xFFFF


def test_disconnect_command_closes_the_io_queue(ctrl, env):
    q = io(ctrl)
    assert q.command(F.DisconnectCommand()).status == 0
    with pytest.raises(TransportError):
        q.poll_one()
    assert 1 not in env.target.subsystem(SUB_RAM).controllers[ctrl.cntlid].io_queues
    assert admin(ctrl).command(F.DisconnectCommand()).status == S.INVALID_OPCODE | S.DNR


def test_host_exceeding_queue_depth_is_refused_by_the_transport(ctrl):
    q = io(ctrl)
    from nvmeof_roce.transport.loopback import SendQueueFull
    for _ in range(32):
        q.send(read_cmd(q).pack())
    with pytest.raises(SendQueueFull):
        q.send(read_cmd(q).pack())
    got = []
    for _ in range(3):
        got += q.transport.poll(0)
    assert len(got) == 32


def test_namespace_removed_while_write_data_in_flight(env, ctrl):
    q = io(ctrl)
    q.send(write_cmd(q, nlb=8).pack())  # keyed: the target must RDMA READ first
    env.fabric.pump(max_ops=1)  # the capsule is in, the READ is queued
    remove_namespace(env.target, SUB_RAM, 1)
    cqe = q.poll_one()
    assert cqe.status == S.INVALID_NS | S.DNR


def test_namespace_removed_while_a_sliced_write_zeroes_is_queued(env, ctrl):
    """Write Zeroes on RAM runs in slices on later loop passes (engine/work.py); a namespace removed before its
    first slice must answer Invalid Namespace, not touch the closed memory (an Internal Error)."""
    q = io(ctrl)
    q.send(nvm.write_zeroes_command(0, 1, 0, 7).pack())
    env.fabric.pump(max_ops=1)  # the capsule is in and its job queued; the watched eventfd not yet served
    assert env.target.work.pending == 1
    remove_namespace(env.target, SUB_RAM, 1)
    cqe = q.poll_one()
    assert cqe.status == S.INVALID_NS | S.DNR
    assert env.target.work.pending == 0


def _file_env(tmp_path, engine):
    if engine == "io_uring" and uring_unavailable():
        pytest.skip(uring_unavailable())
    cfg = standard_config(tmp_path)
    next(s for s in cfg["subsystems"] if s["nqn"] == SUB_FILE)["namespaces"][0]["nvmeof_roce"]["io_engine"] = engine
    return Env(cfg)


def _hold_flush(env):
    """Make the file namespace's fdatasync wait (on its engine's lane thread, or in the kernel on its ring)
    until released; (release, wait_held)."""
    held = hold(env.target, SUB_FILE, 1, "flush")
    return held.release.set, lambda: held.wait_running(1) or True


@pytest.mark.parametrize("engine", ["threads", "io_uring"])
def test_namespace_removed_while_its_flush_runs_on_its_lane(tmp_path, engine):
    """A file namespace removed while its Flush runs on the engine's lane (or ring): the Flush answers Invalid
    Namespace and the file is closed only after the device is done with it (never an fd closed, or reused by
    another file, under a running call)."""
    env = _file_env(tmp_path, engine)
    try:
        c = env.connect(SUB_FILE, num_io_queues=1)
        q = io(c)
        ns = env.target.subsystem(SUB_FILE).namespaces[1]
        release, held = _hold_flush(env)
        q.send(nvm.FlushCommand(nsid=1).pack())
        env.fabric.pump(max_ops=1)  # the Flush is on the lane
        assert held()
        remove_namespace(env.target, SUB_FILE, 1)
        assert ns.backend._fd >= 0  # not closed under the running call
        release()
        for _ in range(100):  # until the call came back through the eventfd
            if not ns.jobs:
                break
            env.fabric.run_watched(0.1)
        cqe = q.poll_one()
        assert cqe.status == S.INVALID_NS | S.DNR
        assert ns.backend._fd < 0  # closed once the last call on it completed
        assert env.target.internal_errors == 0
        c.close()
    finally:
        env.close()


@pytest.mark.parametrize("engine", ["threads", "io_uring"])
def test_namespace_removed_during_its_flush_is_closed_at_target_shutdown(tmp_path, engine):
    """The Flush's completion never comes back through the loop (the target shuts down first): the removed
    namespace's file is still closed, once the device finished with it."""
    env = _file_env(tmp_path, engine)
    c = env.connect(SUB_FILE, num_io_queues=1)
    q = io(c)
    ns = env.target.subsystem(SUB_FILE).namespaces[1]
    release, held = _hold_flush(env)
    q.send(nvm.FlushCommand(nsid=1).pack())
    env.fabric.pump(max_ops=1)
    assert held()
    remove_namespace(env.target, SUB_FILE, 1)
    assert ns.backend._fd >= 0
    release()
    env.close()
    assert ns.backend._fd < 0
    assert env.target.internal_errors == 0


def test_unexpected_exception_becomes_internal_error(env, ctrl, monkeypatch):
    ns = env.target.subsystem(SUB_RAM).namespaces[1]
    monkeypatch.setattr(ns, "direct_view", None)

    def failing(*_args):
        raise OSError(5, "Input/output error")

    def broken(*_args):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(ns.backend, "read_into", failing)
    q = io(ctrl)
    # a device error gets nvmet's status for it (errno_to_nvme_status: EIO is Internal Error, DNR), uncounted
    assert q.command(read_cmd(q)).status == S.INTERNAL | S.DNR
    assert env.target.internal_errors == 0
    monkeypatch.setattr(ns.backend, "read_into", broken)
    assert q.command(read_cmd(q)).status == S.INTERNAL | S.DNR  # a bug in the backend is the target's fault
    assert env.target.internal_errors == 1
    monkeypatch.setattr(env.target, "io_commands", {0x02: lambda t, r: 1 / 0})
    assert q.command(read_cmd(q)).status == S.INTERNAL | S.DNR
    assert env.target.internal_errors == 2
    env.target.internal_errors = 0  # expected here; the fixture checks for none
