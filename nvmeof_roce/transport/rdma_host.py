"""The host side of the RDMA transport: `RdmaConnector` opens NVMe queues, `RdmaHostQueue` is one of them.

One CM id and event channel per queue, so every CM event belongs to a known
queue (docs/protocol.md §7); host memory is registered with remote read and
write for the target.  The helpers shared with the target side live in rdma.py.
"""
from __future__ import annotations

import collections
import selectors
import time
from typing import Deque, List, Optional

from ..nvme import cm as cmdata
from .base import ConnectRejected, Connector, HostBuffer, HostQueue, TransportError
from .rdma import (ADMIN_CAPSULE, CM_TIMEOUT_MS, PYVERBS_ERROR, RESPONSE_SIZE, SEND_WR_BASE, RegisteredMemory,
                   _create_with_fd, _eagain, require_pyverbs)

if PYVERBS_ERROR is None:
    import pyverbs.cm_enums as ce
    import pyverbs.enums as e
    from pyverbs.cmid import AddrInfo, CMEvent, CMEventChannel, CMID, ConnParam
    from pyverbs.cq import CQ, CompChannel
    from pyverbs.device import Context
    from pyverbs.pd import PD
    from pyverbs.pyverbs_error import PyverbsRDMAError
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, RecvWR, SendWR


class RdmaConnector(Connector):
    """Opens NVMe queues to traddr:trsvcid; all queues share one device Context and PD."""

    def __init__(self, traddr: str, trsvcid: int = 4420, timeout: float = 5.0, src: Optional[str] = None,
                 max_in_capsule: int = 8192):
        require_pyverbs()
        self.traddr, self.trsvcid, self.timeout, self.src = traddr, int(trsvcid), timeout, src
        self.max_in_capsule = max_in_capsule
        self.context = None
        self.pd = None
        self.device = None

    def _device(self, name: str):
        if self.context is None:
            self.context = Context(name=name)
            self.pd = PD(self.context)
            self.device = self.context.query_device()
        return self.context, self.pd

    def connect(self, qid: int, hrqsize: int, hsqsize: int, cntlid: int = 0) -> "RdmaHostQueue":
        return RdmaHostQueue(self, qid, hrqsize, hsqsize, cntlid)

    def close(self) -> None:
        if self.pd is not None:
            self.pd.close()
            self.context.close()
            self.pd = self.context = None


class RdmaHostQueue(HostQueue):
    def __init__(self, connector: RdmaConnector, qid: int, hrqsize: int, hsqsize: int, cntlid: int):
        self.connector = connector
        self.qid = qid
        self.closed = False
        self.buffers: List[RegisteredMemory] = []
        self.channel, self.cm_fd = _create_with_fd(CMEventChannel, "rdma_cm")
        self.cm_id = CMID(creator=self.channel, port_space=ce.RDMA_PS_TCP)
        where = f"{connector.traddr}:{connector.trsvcid}"
        try:
            info = AddrInfo(src=connector.src, dst=connector.traddr, dst_service=str(connector.trsvcid),
                            port_space=ce.RDMA_PS_TCP)
            self.cm_id.resolve_addr(info, CM_TIMEOUT_MS)
            self._wait_event(ce.RDMA_CM_EVENT_ADDR_RESOLVED, f"resolving {where}")
            self.cm_id.resolve_route(CM_TIMEOUT_MS)
            self._wait_event(ce.RDMA_CM_EVENT_ROUTE_RESOLVED, f"resolving the route to {where}")
        except PyverbsRDMAError as exc:
            self._close_cm()
            raise TransportError(f"cannot reach {where} over RDMA: {exc}")
        except TransportError:
            self._close_cm()
            raise
        ctx, pd = connector._device(self.cm_id.dev_name)
        depth = hsqsize + 1
        self.recv_count = hrqsize
        self.recv_mem = RegisteredMemory(pd, hrqsize * RESPONSE_SIZE, e.IBV_ACCESS_LOCAL_WRITE)
        self.recv_wrs = [RecvWR(wr_id=i, num_sge=1, sg=[SGE(self.recv_mem.addr + i * RESPONSE_SIZE, RESPONSE_SIZE,
                                                              self.recv_mem.lkey)]) for i in range(hrqsize)]
        self.capsule_size = ADMIN_CAPSULE + (connector.max_in_capsule if qid else 0)
        self.send_mem = RegisteredMemory(pd, depth * self.capsule_size, e.IBV_ACCESS_LOCAL_WRITE)
        self.free_send: List[int] = list(range(depth))
        self.comp_channel, self.cq_fd = _create_with_fd(lambda: CompChannel(ctx), "infinibandevent")
        self.cq = CQ(ctx, hrqsize + depth + 4, None, self.comp_channel, 0)
        self.cq.req_notify()
        cap = QPCap(max_send_wr=depth + 2, max_recv_wr=hrqsize, max_send_sge=1, max_recv_sge=1)
        self.qp = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, sq_sig_all=1, cap=cap))
        resources = max(1, min(16, connector.device.max_qp_rd_atom))
        param = ConnParam(resources=resources, depth=0, flow_control=1, retry=7, rnr_retry=7,
                          qp_num=self.qp.qp_num, data_len=cmdata.REQUEST_SIZE)
        param.set_private_data(cmdata.CmConnectRequest(0, qid, hrqsize, hsqsize, cntlid).pack())
        try:
            self.cm_id.connect(param)
            event_private = self._wait_event(ce.RDMA_CM_EVENT_CONNECT_RESPONSE, f"connecting queue {qid} to {where}")
        except (TransportError, PyverbsRDMAError):
            self._release_verbs()
            self._close_cm()
            raise
        self.crqsize = cmdata.CmAccept.unpack(event_private).crqsize if len(event_private) >= 4 else depth
        attr, mask = self.cm_id.init_qp_attr(e.IBV_QPS_INIT)
        self.qp.modify(attr, mask)
        for wr in self.recv_wrs:
            self.qp.post_recv(wr)
        attr, mask = self.cm_id.init_qp_attr(e.IBV_QPS_RTR)
        self.qp.modify(attr, mask)
        attr, mask = self.cm_id.init_qp_attr(e.IBV_QPS_RTS)
        self.qp.modify(attr, mask)
        self.cm_id.establish()
        self.responses: Deque[bytes] = collections.deque()

    def _wait_event(self, wanted: int, what: str, timeout: Optional[float] = None) -> bytes:
        timeout = self.connector.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        selector = selectors.DefaultSelector()
        selector.register(self.cm_fd, selectors.EVENT_READ)
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransportError(f"timed out {what} ({timeout:.0f} s)")
                if not selector.select(remaining):
                    continue
                try:
                    event = CMEvent(self.channel)
                except PyverbsRDMAError as exc:
                    if _eagain(exc):
                        continue
                    raise
                kind, private, name = event.event_type, bytes(event.private_data or b""), event.event_str()
                event.ack_cm_event()
                if kind == wanted:
                    return private
                if kind == ce.RDMA_CM_EVENT_REJECTED:
                    if len(private) >= cmdata.REJECT_SIZE:
                        sts = cmdata.CmReject.unpack(private).sts
                        raise ConnectRejected(sts, f"{what}: rejected by the target: STS {sts} "
                                                   f"({cmdata.sts_name(sts)})")
                    raise ConnectRejected(0, f"{what}: rejected (no NVMe-oF listener there?)")
                raise TransportError(f"{what}: {name}")
        finally:
            selector.close()

    def register(self, size: int) -> HostBuffer:
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        memory = RegisteredMemory(self.connector.pd, size, access)
        self.buffers.append(memory)
        return HostBuffer(memory.addr, memory.rkey, memory.view[:size])

    def send(self, capsule: bytes) -> None:
        if self.closed:
            raise TransportError("queue is closed")
        if len(capsule) > self.capsule_size:
            raise TransportError(f"capsule of {len(capsule)} bytes exceeds {self.capsule_size}")
        deadline = time.monotonic() + self.connector.timeout
        while not self.free_send:  # a slot is free once its SEND completes
            self._poll_once(max(0.0, deadline - time.monotonic()))
            if time.monotonic() > deadline and not self.free_send:
                raise TransportError("send queue full: no SEND completed in time")
        slot = self.free_send.pop()
        start = slot * self.capsule_size
        self.send_mem.view[start:start + len(capsule)] = capsule
        wr = SendWR(wr_id=SEND_WR_BASE + slot, opcode=e.IBV_WR_SEND, num_sge=1,
                    sg=[SGE(self.send_mem.addr + start, len(capsule), self.send_mem.lkey)])
        self.qp.post_send(wr)

    def _drain(self) -> None:
        while True:
            count, wcs = self.cq.poll(num_entries=32)
            if count == 0:
                return
            for wc in wcs[:count]:
                if wc.status != e.IBV_WC_SUCCESS:
                    self.closed = True
                    raise TransportError(f"queue {self.qid}: work completion failed with status {wc.status}"
                                         " (connection lost)")
                if wc.wr_id >= SEND_WR_BASE:
                    self.free_send.append(wc.wr_id - SEND_WR_BASE)
                else:
                    start = wc.wr_id * RESPONSE_SIZE
                    self.responses.append(bytes(self.recv_mem.view[start:start + RESPONSE_SIZE]))
                    self.qp.post_recv(self.recv_wrs[wc.wr_id])

    def _poll_once(self, timeout: float) -> None:
        self._drain()
        if self.responses or timeout <= 0:
            return
        import select
        readable, _, _ = select.select([self.cq_fd], [], [], timeout)
        if readable:
            try:
                self.comp_channel.get_cq_event(self.cq)
                self.cq.ack_events(1)
            except PyverbsRDMAError as exc:
                if not _eagain(exc):
                    raise
            self.cq.req_notify()
        self._drain()

    def poll(self, timeout: float) -> list:
        if self.closed and not self.responses:
            raise TransportError(f"queue {self.qid} is closed")
        deadline = time.monotonic() + timeout
        while not self.responses:
            remaining = deadline - time.monotonic()
            self._poll_once(max(0.0, remaining))
            if remaining <= 0:
                break
        out = list(self.responses)
        self.responses.clear()
        return out

    def _release_verbs(self) -> None:
        for resource in (getattr(self, "qp", None), getattr(self, "cq", None), getattr(self, "comp_channel", None)):
            if resource is not None:
                try:
                    resource.close()
                except Exception:
                    pass
        for memory in [getattr(self, "recv_mem", None), getattr(self, "send_mem", None), *self.buffers]:
            if memory is not None:
                memory.close()

    def _close_cm(self) -> None:
        try:
            self.cm_id.close()
        finally:
            self.channel.close()

    def close(self) -> None:
        if getattr(self, "_released", False):
            return
        self._released = True
        self.closed = True
        try:  # like the kernel host: the QP stops answering first, then the CM disconnect
            self.qp.modify(QPAttr(qp_state=e.IBV_QPS_ERR), e.IBV_QP_STATE)
        except Exception:
            pass
        try:
            self.cm_id.disconnect()
            self._wait_event(ce.RDMA_CM_EVENT_DISCONNECTED, f"disconnecting queue {self.qid}", timeout=2.0)
        except Exception:
            pass
        self._release_verbs()
        self._close_cm()
