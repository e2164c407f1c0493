"""The host side of the RDMA transport: `RdmaConnector` opens NVMe queues, `RdmaHostQueue` is one of them.

One CM id and event channel per queue, so every CM event belongs to a known
queue (docs/protocol.md §7); the CM is the native module's (transport/rdma/cmchannel.py), which hands each
event over as plain data.  Host memory is registered with remote read and write for the target.  The helpers
shared with the target side live in verbs.py and memory.py.
"""
from __future__ import annotations

import logging
import select
import selectors
import socket
import time
from collections import deque
from typing import List, Optional

from ...nvme import cm as cmdata
from ..contracts import ConnectRejected, Connector, HostBuffer, HostQueue, TransportError
from .cmchannel import CmChannel
from .memory import RegisteredMemory
from .verbs import (ADMIN_CAPSULE, CM_TIMEOUT_MS, PYVERBS_ERROR, QPS_INIT, QPS_RTR, QPS_RTS, RESPONSE_SIZE,
                    SEND_WR_BASE, WR_LEAKS, create_with_fd, eagain, is_iwarp, qp_attr, require_pyverbs)

log = logging.getLogger(__name__)

if PYVERBS_ERROR is None:
    import pyverbs.enums as e
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


class SendAccount:
    """Which SENDs of a host queue are signaled, and when send-queue entries and capsule slots come back.

    Pure bookkeeping (no verbs, unit-tested without a device).  A capsule that fits the QP's
    max_inline_data is copied by the provider at post time, so it holds no buffer and its SEND is left
    unsignaled; every `interval`-th SEND, a SEND from a capsule slot (whose buffer is free only once it
    completes), and the SEND that fills the send queue are signaled.  RC completes work requests in order
    (docs/protocol.md §7.3 item 8), so a signaled completion retires the unsignaled SENDs before it too:
    its wr_id carries how many entries it retires and which slot it frees.
    """

    NO_SLOT = 0xFFFF

    def __init__(self, sq_size: int, slots: int, interval: int):
        if sq_size < 1 or not 0 < interval <= sq_size or slots >= self.NO_SLOT:
            raise ValueError(f"send account: sq_size {sq_size}, slots {slots}, interval {interval}")
        self.sq_size = sq_size
        self.interval = interval
        self.in_sq = 0  # posted and not yet known complete
        self.unsignaled = 0  # posted unsignaled since the last signaled one
        self.free_slots: List[int] = list(range(slots - 1, -1, -1))

    def room(self) -> bool:
        return self.in_sq < self.sq_size

    def post(self, slot: int = NO_SLOT) -> int:
        """Account one SEND (from capsule `slot`, or inline); returns the wr_id to signal it with, or -1 to
        post it unsignaled.  Call only when `room()`."""
        self.in_sq += 1
        retire = self.unsignaled + 1
        if slot == self.NO_SLOT and retire < self.interval and self.in_sq < self.sq_size:
            self.unsignaled = retire
            return -1
        self.unsignaled = 0
        return SEND_WR_BASE + (slot << 16) + retire

    def completed(self, wr_id: int) -> None:
        """A signaled SEND completed: its entry and the unsignaled ones before it are free, and its slot."""
        n = wr_id - SEND_WR_BASE
        self.in_sq -= n & 0xFFFF
        slot = n >> 16
        if slot != self.NO_SLOT:
            self.free_slots.append(slot)


INLINE_CAPSULE = 64  # max_inline_data asked for: a capsule without in-capsule data goes inline
CHAIN = 32  # inline SENDs held between defer_sends() and flush(), posted as one chain (one doorbell)
SIGNAL_INTERVAL = 16  # at most this many SENDs in a row unsignaled
CQ_BATCH = 32  # completions asked for per CQ.poll call
if PYVERBS_ERROR is None:
    SUCCESS = e.IBV_WC_SUCCESS
    SIGNALED = e.IBV_SEND_SIGNALED
    INLINE = e.IBV_SEND_INLINE
    INLINE_SIGNALED = e.IBV_SEND_INLINE | e.IBV_SEND_SIGNALED
UNSIGNALED = SEND_WR_BASE + (SendAccount.NO_SLOT << 16)  # an unsignaled SEND's wr_id (seen only in a flush error)


class _SendWR:
    """One reusable SEND work request with its SGE: on bookworm's pyverbs (WR_LEAKS) it reads its own SGE's
    buffer, so setting the SGE changes what is posted (as `rdma._DataWR` does for data); elsewhere a new
    work request per post (they do not leak there)."""

    __slots__ = ("wr", "sge", "lkey")

    def __init__(self, lkey: int):
        self.lkey = lkey
        if WR_LEAKS:
            self.sge = SGE(0, 0, lkey)
            self.wr = SendWR(wr_id=0, opcode=e.IBV_WR_SEND, num_sge=1, sg=[self.sge], send_flags=0)
            self.wr.sg_list = self.sge
        else:
            self.sge = self.wr = None

    def set(self, wr_id: int, flags: int, addr: int, length: int):
        if not WR_LEAKS:
            return SendWR(wr_id=wr_id, opcode=e.IBV_WR_SEND, num_sge=1, sg=[SGE(addr, length, self.lkey)],
                          send_flags=flags)
        sge = self.sge
        sge.addr = addr
        sge.length = length
        wr = self.wr
        wr.wr_id = wr_id
        wr.send_flags = flags
        return wr


class _InlineChain:
    """CHAIN reusable inline SENDs linked once, wrs[i] -> wrs[i + 1]; the last n of them are a chain of n, so
    posting wrs[CHAIN - n] posts n SENDs with one call (pyverbs cannot unlink a next_wr once set).  Each has its
    own staging spot.  Without WR_LEAKS, new linked work requests per flush."""

    def __init__(self, lkey: int, base_addr: int):
        self.lkey = lkey
        self.base_addr = base_addr
        self.keep: list = []
        self.wrs = [_SendWR(lkey) for _ in range(CHAIN)]
        if WR_LEAKS:
            for i in range(CHAIN - 1):
                self.wrs[i].wr.next_wr = self.wrs[i + 1].wr

    def build(self, held: list, staging, stage: int):
        """Stage `held` [(capsule, wr_id, flags)] at spots CHAIN - n ... CHAIN - 1 of `staging` (from offset
        `stage`) and return the head of their chain."""
        n = len(held)
        first = CHAIN - n
        self.keep = []
        for j in range(n):
            capsule, wr_id, flags = held[j]
            length = len(capsule)
            at = stage + (first + j) * INLINE_CAPSULE
            staging[at:at + length] = capsule
            addr = self.base_addr + (first + j) * INLINE_CAPSULE
            if WR_LEAKS:
                self.wrs[first + j].set(wr_id, flags, addr, length)
            else:
                self.keep.append(SendWR(wr_id=wr_id, opcode=e.IBV_WR_SEND, num_sge=1, send_flags=flags,
                                        sg=[SGE(addr, length, self.lkey)]))
        if WR_LEAKS:
            return self.wrs[first].wr
        for j in range(n - 1):  # the next one must stay referenced until posted (docs/protocol.md §7.2)
            self.keep[j].next_wr = self.keep[j + 1]
        return self.keep[0]

    @property
    def last(self) -> _SendWR:
        """The chain's last SEND (its next is none): one SEND on its own."""
        return self.wrs[CHAIN - 1]


class RdmaHostQueue(HostQueue):
    """One NVMe queue from the host: capsules SENT inline when they fit (else from a registered capsule slot),
    SENDs signaled selectively (`SendAccount`), 16-byte receives re-posted after each poll batch; no pyverbs
    object is made per command on bookworm's pyverbs (docs/protocol.md §7.3 item 10)."""

    def __init__(self, connector: RdmaConnector, qid: int, hrqsize: int, hsqsize: int, cntlid: int):
        self.connector = connector
        self.qid = qid
        self.closed = False
        self._released = False  # close() destroyed the QP, CQ and channel: no pyverbs call on them after
        self.buffers: List[RegisteredMemory] = []
        where = self._resolve()
        ctx, pd = connector._device(self.cm_id.dev_name)
        depth = hsqsize + 1
        self.recv_count = hrqsize
        self.recv_mem = RegisteredMemory(pd, hrqsize * RESPONSE_SIZE, e.IBV_ACCESS_LOCAL_WRITE)
        self.recv_wrs = [RecvWR(wr_id=i, num_sge=1, sg=[SGE(self.recv_mem.addr + i * RESPONSE_SIZE, RESPONSE_SIZE,
                                                              self.recv_mem.lkey)]) for i in range(hrqsize)]
        self.capsule_size = ADMIN_CAPSULE + (connector.max_in_capsule if qid else 0)
        # capsule slots, and past them the spots where inline capsules are staged (copied out at post time)
        self.send_mem = RegisteredMemory(pd, depth * self.capsule_size + CHAIN * INLINE_CAPSULE,
                                         e.IBV_ACCESS_LOCAL_WRITE)
        self.stage = depth * self.capsule_size
        self.held: Optional[list] = None  # inline SENDs held since defer_sends(), None when not deferring
        self.comp_channel, self.cq_fd = create_with_fd(lambda: CompChannel(ctx))
        sq_size = 2 * depth + 2  # unsignaled SENDs hold their entries until a later signaled one completes
        self.cq = CQ(ctx, hrqsize + sq_size + 4, None, self.comp_channel, 0)
        self.cq.req_notify()
        self.qp, self.inline_max = self._create_qp(pd, sq_size, hrqsize)
        self.sends = SendAccount(sq_size, depth, min(SIGNAL_INTERVAL, max(1, depth // 2)))
        self.chain = _InlineChain(self.send_mem.lkey, self.send_mem.addr + self.stage)
        self.inline_wr = self.chain.last
        self.inline_at = self.stage + (CHAIN - 1) * INLINE_CAPSULE
        self.slot_wrs = [_SendWR(self.send_mem.lkey) for _ in range(depth)]
        self.cq_poller = select.poll()
        self.cq_poller.register(self.cq_fd, select.POLLIN)
        resources = max(1, min(16, connector.device.max_qp_rd_atom))
        private = cmdata.CmConnectRequest(0, qid, hrqsize, hsqsize, cntlid).pack()
        # iWARP (docs/protocol.md §7.8): the kernel's iWARP CM takes the QP to RTS itself during the MPA exchange and
        # reports ESTABLISHED, with the accept's private data; so the QP goes to INIT with its receives posted first,
        # and there is no CONNECT_RESPONSE to answer with RTR, RTS and establish().
        iwarp = is_iwarp(self.cm_id.dev_name)
        try:
            if iwarp:
                self._to_init_with_receives()
            self.cm_id.connect(private, resources, 0, self.qp.qp_num)
            event_private = self._wait_event("ESTABLISHED" if iwarp else "CONNECT_RESPONSE",
                                             f"connecting queue {qid} to {where}")
        except (TransportError, PyverbsRDMAError, OSError) as exc:
            self._release_verbs()
            self._close_cm()
            if isinstance(exc, OSError):
                raise TransportError(f"connecting queue {qid} to {where}: {exc}") from None
            raise
        self.crqsize = cmdata.CmAccept.unpack(event_private).crqsize if len(event_private) >= 4 else depth
        if not iwarp:
            self._to_init_with_receives()
            attr, mask = qp_attr(self.cm_id, QPS_RTR)
            self.qp.modify(attr, mask)
            attr, mask = qp_attr(self.cm_id, QPS_RTS)
            self.qp.modify(attr, mask)
            self.cm_id.establish()
        self.responses: List[bytes] = []

    def _resolve(self) -> str:
        """A CM id on an event channel of its own, its address and route resolved; returns "addr:port"."""
        connector = self.connector
        where = f"{connector.traddr}:{connector.trsvcid}"
        self.cm = CmChannel()
        self.cm_fd = self.cm.fd
        self.cm_events: deque = deque()
        try:
            self.cm_id = self.cm.create_id()
            self.cm_id.resolve_addr(numeric_address(connector.src) if connector.src else None,
                                    numeric_address(connector.traddr), connector.trsvcid, CM_TIMEOUT_MS)
            self._wait_event("ADDR_RESOLVED", f"resolving {where}")
            self.cm_id.resolve_route(CM_TIMEOUT_MS)
            self._wait_event("ROUTE_RESOLVED", f"resolving the route to {where}")
        except (OSError, ValueError) as exc:
            self._close_cm()
            raise TransportError(f"cannot reach {where} over RDMA: {exc}")
        except TransportError:
            self._close_cm()
            raise
        return where

    def _to_init_with_receives(self) -> None:
        attr, mask = qp_attr(self.cm_id, QPS_INIT)
        self.qp.modify(attr, mask)
        for wr in self.recv_wrs:
            self.qp.post_recv(wr)

    def _create_qp(self, pd, sq_size: int, hrqsize: int):
        """The RC QP, with room for an inline SQE if the device offers it (else every SEND uses a slot)."""
        for inline in (INLINE_CAPSULE, 0):
            cap = QPCap(max_send_wr=sq_size, max_recv_wr=hrqsize, max_send_sge=1, max_recv_sge=1,
                        max_inline_data=inline)
            try:
                return QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, sq_sig_all=0,
                                         cap=cap)), inline
            except PyverbsRDMAError:
                if not inline:
                    raise
                log.debug("queue %d: no inline data on this device", self.qid)

    def _wait_event(self, wanted: str, what: str, timeout: Optional[float] = None) -> bytes:
        """The private data of the next CM event if it is `wanted` (its name, cmchannel.EVENT_NAMES); a reject or
        any other event raises, naming it."""
        timeout = self.connector.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        selector = selectors.DefaultSelector()
        selector.register(self.cm_fd, selectors.EVENT_READ)
        try:
            while not self.cm_events:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransportError(f"timed out {what} ({timeout:.0f} s)")
                if selector.select(remaining):
                    self.cm_events.extend(self.cm.events())
        finally:
            selector.close()
        event = self.cm_events.popleft()
        if event.name == wanted:
            return event.private_data
        private = event.private_data
        if event.name == "REJECTED":
            if len(private) >= cmdata.REJECT_SIZE:
                sts = cmdata.CmReject.unpack(private).sts
                raise ConnectRejected(sts, f"{what}: rejected by the target: STS {sts} ({cmdata.sts_name(sts)})")
            raise ConnectRejected(0, f"{what}: rejected (no NVMe-oF listener there?)")
        raise TransportError(f"{what}: {event.name} (status {event.status})")

    def register(self, size: int) -> HostBuffer:
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        memory = RegisteredMemory(self.connector.pd, size, access)
        self.buffers.append(memory)
        return HostBuffer(memory.addr, memory.rkey, memory.view[:size])

    def send(self, capsule: bytes) -> None:
        if self.closed:
            raise TransportError("queue is closed")
        length = len(capsule)
        if length > self.capsule_size:
            raise TransportError(f"capsule of {length} bytes exceeds {self.capsule_size}")
        sends = self.sends
        inline = length <= self.inline_max
        if not sends.room() or not (inline or sends.free_slots):
            self._wait_send(length)
        mem = self.send_mem
        if inline:  # staged, copied by the provider at post time: no buffer to hold
            wr_id = sends.post()
            flags = INLINE_SIGNALED
            if wr_id < 0:
                wr_id, flags = UNSIGNALED, INLINE
            held = self.held
            if held is not None:
                held.append((capsule, wr_id, flags))
                if len(held) == CHAIN:
                    self._post_held()
                return
            start = self.inline_at
            mem.map[start:start + length] = capsule
            wr = self.inline_wr.set(wr_id, flags, mem.addr + start, length)
        else:
            if self.held:
                self._post_held()  # SENDs go out in the order they were asked for
            slot = sends.free_slots.pop()
            start = slot * self.capsule_size
            mem.map[start:start + length] = capsule
            wr = self.slot_wrs[slot].set(sends.post(slot), SIGNALED, mem.addr + start, length)
        self.qp.post_send(wr)

    def defer_sends(self) -> None:
        if self.held is None:
            self.held = []

    def flush(self) -> None:
        if self.held and not self._released:  # (a closed queue's QP is gone: its held SENDs go nowhere)
            self._post_held()
        self.held = None

    def _post_held(self) -> None:
        """Post the held inline SENDs as one chain: one post_send, one doorbell (keeps deferring)."""
        held = self.held
        self.held = []
        self.qp.post_send(self.chain.build(held, self.send_mem.map, self.stage))

    def _wait_send(self, length: int) -> None:
        """Reap send completions until a send-queue entry (and a capsule slot, for a capsule too big to
        go inline) is free."""
        if self.held:
            self._post_held()  # what is held may be the signaled SEND that frees the queue
        sends = self.sends
        deadline = time.monotonic() + self.connector.timeout
        while not sends.room() or not (length <= self.inline_max or sends.free_slots):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportError("send queue full: no SEND completed in time")
            self._wait_cq(remaining)

    def _drain(self) -> None:
        """Take every completion on the CQ: SEND completions free their entries and slots, responses are
        copied out, then their receives are re-posted together."""
        if self._released:  # the CQ is closed: pyverbs would dereference NULL
            return
        responses = self.responses
        received = []
        rmap = self.recv_mem.map
        sends = self.sends
        while True:
            count, wcs = self.cq.poll(CQ_BATCH)
            for wc in wcs:
                wr_id = wc.wr_id
                if wc.status != SUCCESS:
                    self.closed = True
                    raise TransportError(f"queue {self.qid}: work completion failed with status {wc.status}"
                                         " (connection lost)")
                if wr_id >= SEND_WR_BASE:
                    sends.completed(wr_id)
                else:
                    start = wr_id * RESPONSE_SIZE
                    responses.append(rmap[start:start + RESPONSE_SIZE])
                    received.append(wr_id)
            if count < CQ_BATCH:
                break
        if received:
            post_recv, recv_wrs = self.qp.post_recv, self.recv_wrs
            for i in received:
                post_recv(recv_wrs[i])

    def _wait_cq(self, timeout: float) -> None:
        """Sleep on the completion channel up to `timeout`, re-arm it, and drain (docs/protocol.md §7.3 item 1)."""
        if self._released:
            raise TransportError(f"queue {self.qid} is closed")
        if self.cq_poller.poll(timeout * 1000):
            try:
                self.comp_channel.get_cq_event(self.cq)
                self.cq.ack_events(1)
            except PyverbsRDMAError as exc:
                if not eagain(exc):
                    raise
            self.cq.req_notify()
        self._drain()

    def poll(self, timeout: float) -> list:
        if self.closed and not self.responses:
            raise TransportError(f"queue {self.qid} is closed")
        self._drain()
        if not self.responses and timeout > 0:
            deadline = time.monotonic() + timeout
            while True:
                self._wait_cq(timeout)
                if self.responses:
                    break
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    break
        out = self.responses
        self.responses = []
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
        self.cm.close()  # every id on the queue's channel, then the channel

    def close(self) -> None:
        if self._released:
            return
        self._released = True
        self.closed = True
        try:  # like the kernel host: the QP stops answering first, then the CM disconnect
            self.qp.modify(QPAttr(qp_state=e.IBV_QPS_ERR), e.IBV_QP_STATE)
        except Exception:
            pass
        try:
            self.cm_id.disconnect()
            self._wait_event("DISCONNECTED", f"disconnecting queue {self.qid}", timeout=2.0)
        except Exception:
            pass
        self._release_verbs()
        self._close_cm()


def numeric_address(host: str) -> str:
    """An IP address for the CM, which takes no names: `host` itself if it is one, else what it resolves to."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
            return host
        except OSError:
            pass
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError) as exc:
        raise TransportError(f"cannot resolve {host}: {exc}") from None
