"""The lab itself: Soft-RoCE is up and pyverbs moves data over it (RC SEND, RDMA WRITE, RDMA READ)."""
import ipaddress
import os
import time

import pytest

pytestmark = pytest.mark.lab

RXE = "/sys/class/infiniband/rxe0/ports/1"
LAB_IP = "10.99.0.1"


def roce_v2_gid_index(address: str = LAB_IP) -> int:
    """Index of the RoCE v2 GID that carries `address` (what show_gids prints)."""
    wanted = ipaddress.IPv6Address("::ffff:" + address)
    for name in sorted(os.listdir(f"{RXE}/gids"), key=int):
        gid = open(f"{RXE}/gids/{name}").read().strip()
        try:
            gtype = open(f"{RXE}/gid_attrs/types/{name}").read().strip()
        except OSError:
            continue
        if gtype == "RoCE v2" and ipaddress.IPv6Address(gid) == wanted:
            return int(name)
    raise AssertionError(f"no RoCE v2 GID for {address} on rxe0")


def test_rxe0_port_active_with_roce_v2_gid():
    assert open(f"{RXE}/state").read().strip() == "4: ACTIVE"
    assert open(f"{RXE}/link_layer").read().strip() == "Ethernet"
    assert roce_v2_gid_index() >= 0
    assert open("/sys/class/infiniband/rxe0/ports/1/gid_attrs/ndevs/%d" % roce_v2_gid_index()).read().strip() == "rxenet0"


def _poll(cq, n=1, timeout=5.0):
    deadline = time.monotonic() + timeout
    wcs = []
    while len(wcs) < n:
        got, batch = cq.poll(num_entries=n - len(wcs))
        wcs += batch[:got]
        assert time.monotonic() < deadline, f"timed out waiting for {n} completions, got {len(wcs)}"
    return wcs


def test_pyverbs_rc_send_write_read_round_trip():
    import pyverbs.enums as e
    from pyverbs.addr import AHAttr, GlobalRoute
    from pyverbs.cq import CQ
    from pyverbs.device import Context
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, RecvWR, SendWR

    gid_index = roce_v2_gid_index()
    access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
    with Context(name="rxe0") as ctx, PD(ctx) as pd, CQ(ctx, 64) as cq_a, CQ(ctx, 64) as cq_b:
        gid = ctx.query_gid(1, gid_index)
        cap = QPCap(max_send_wr=16, max_recv_wr=16, max_send_sge=1, max_recv_sge=1)
        qp_a = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq_a, rcq=cq_a, cap=cap))
        qp_b = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq_b, rcq=cq_b, cap=cap))
        mr_a = MR(pd, 4096, access)
        mr_b = MR(pd, 4096, access)
        for qp, peer in ((qp_a, qp_b), (qp_b, qp_a)):
            init = QPAttr(qp_state=e.IBV_QPS_INIT, port_num=1)
            init.qp_access_flags = access
            init.pkey_index = 0
            qp.to_init(init)
            rtr = QPAttr(qp_state=e.IBV_QPS_RTR, port_num=1)
            rtr.path_mtu = e.IBV_MTU_1024
            rtr.dest_qp_num = peer.qp_num
            rtr.rq_psn = 0
            rtr.max_dest_rd_atomic = 1
            rtr.min_rnr_timer = 12
            rtr.ah_attr = AHAttr(gr=GlobalRoute(dgid=gid, sgid_index=gid_index), is_global=1, port_num=1)
            qp.to_rtr(rtr)
            rts = QPAttr(qp_state=e.IBV_QPS_RTS)
            rts.timeout = 14
            rts.retry_cnt = 7
            rts.rnr_retry = 7
            rts.sq_psn = 0
            rts.max_rd_atomic = 1
            qp.to_rts(rts)

        # SEND a -> b
        message = os.urandom(64)
        qp_b.post_recv(RecvWR(wr_id=1, num_sge=1, sg=[SGE(mr_b.buf, 64, mr_b.lkey)]))
        mr_a.write(message, 64)
        qp_a.post_send(SendWR(wr_id=2, opcode=e.IBV_WR_SEND, num_sge=1, sg=[SGE(mr_a.buf, 64, mr_a.lkey)]))
        (send_wc,) = _poll(cq_a)
        (recv_wc,) = _poll(cq_b)
        assert send_wc.status == e.IBV_WC_SUCCESS and recv_wc.status == e.IBV_WC_SUCCESS
        assert recv_wc.byte_len == 64 and recv_wc.opcode == e.IBV_WC_RECV
        assert mr_b.read(64, 0) == message

        # RDMA WRITE a -> b's memory at offset 1024
        payload = os.urandom(512)
        mr_a.write(payload, 512, 256)
        w = SendWR(wr_id=3, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[SGE(mr_a.buf + 256, 512, mr_a.lkey)])
        w.set_wr_rdma(mr_b.rkey, mr_b.buf + 1024)
        qp_a.post_send(w)
        (wc,) = _poll(cq_a)
        assert wc.status == e.IBV_WC_SUCCESS and wc.opcode == e.IBV_WC_RDMA_WRITE
        assert mr_b.read(512, 1024) == payload

        # RDMA READ: a fetches b's memory at offset 2048
        remote = os.urandom(1000)
        mr_b.write(remote, 1000, 2048)
        r = SendWR(wr_id=4, opcode=e.IBV_WR_RDMA_READ, num_sge=1, sg=[SGE(mr_a.buf + 3000, 1000, mr_a.lkey)])
        r.set_wr_rdma(mr_b.rkey, mr_b.buf + 2048)
        qp_a.post_send(r)
        (wc,) = _poll(cq_a)
        assert wc.status == e.IBV_WC_SUCCESS and wc.opcode == e.IBV_WC_RDMA_READ
        assert mr_a.read(1000, 3000) == remote

        # A wrong rkey is a remote access error, not a silent success.
        bad = SendWR(wr_id=5, opcode=e.IBV_WR_RDMA_READ, num_sge=1, sg=[SGE(mr_a.buf, 16, mr_a.lkey)])
        bad.set_wr_rdma(mr_b.rkey ^ 0x5A5A00, mr_b.buf)
        qp_a.post_send(bad)
        (wc,) = _poll(cq_a)
        assert wc.status == e.IBV_WC_REM_ACCESS_ERR
        qp_a.close()
        qp_b.close()
        mr_a.close()
        mr_b.close()
