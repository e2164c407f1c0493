"""The target's queue on pyverbs: `RdmaTargetQueue`, one RC QP per NVMe queue, accepted by `RdmaListener`
(transport/rdma/cm.py).

An accepted queue gets its own QP, CQ and completion channel on the listener's device Context and PD.  Receive
buffers and data buffers are registered with local access only: the target initiates every transfer itself.
Data buffers come from one pool per port registered once at start and shared by its queues
(transport/resources.py, transport/rdma/memory.py): a queue is guaranteed a small minimum only once its NVMe
Connect succeeds, takes the rest from the shared part, and its commands wait for a buffer when none is free.

No call here blocks: every completion channel is put in non-blocking mode and watched by the event loop
(transport/rdma/verbs.py `create_with_fd`).  The QP is ours (on the listener's PD), so its INIT, RTR and RTS
attributes come from the CM (`verbs.qp_attr`) and the accept names its QP number.
"""
from __future__ import annotations

import ctypes
import errno
import logging
from typing import TYPE_CHECKING, List, Optional

from ...nvme import cm as cmdata
from ..contracts import ReadDone, RemoteAccessError, TargetQueue, TransportError
from ..resources import PoolShare
from .connect import RdmaConnectRequest, queue_resources
from .memory import RegisteredMemory
from .requests import RequestBook, TxRequest
from .verbs import (ACK_TIMEOUT, ADMIN_CAPSULE, PYVERBS_ERROR, QPS_INIT, QPS_RTR, QPS_RTS, RESPONSE_SIZE, RNR_RETRY,
                    SEND_WR_BASE, create_with_fd, eagain, qp_attr)

if PYVERBS_ERROR is None:
    from .verbs import (CQ, QP, SGE, CompChannel, PyverbsRDMAError, QPCap, QPEx, QPInitAttr, QPInitAttrEx, RecvWR,
                        SendWR, e)

if TYPE_CHECKING:
    from .cm import RdmaListener

log = logging.getLogger(__name__)
# One DEBUG line per capsule received and per work request posted (`target serve -vv`): what a capture
# of the wire must show, in the same order (`nvmeof-roce rdma decode`, docs/two-node.md).
wire_log = logging.getLogger(__name__ + ".wire")

WRITE_WR_ID = SEND_WR_BASE + (1 << 31)  # the unsignaled data WRITEs (SEND_WR_BASE + n: request n)
POLL_BATCH = 32  # completions asked of one CQ.poll
CQ_BUDGET = 64  # completions one queue handles per loop pass before the others get their turn


class AcceptRefused(Exception):
    """A queue could not be set up: the listener rejects its connection with this NVMe-oF CM status (STS)."""

    def __init__(self, sts: int, message: str):
        super().__init__(message)
        self.sts = sts


class LegacyPoster:
    """The QPEx calls this transport makes (wr_start, wr_rdma_read/write, wr_send, wr_set_sge,
    wr_set_inline_data, wr_complete), for a QP of a device without the extended API (siw: EOPNOTSUPP).

    Work requests come from a ring of SendWR objects made once per queue, each pointing at its own SGE
    (`SendWR.sg_list = sge`), so a command allocates nothing.  Each is posted on its own with ibv_post_send
    once it is complete (when the next one starts, or at wr_complete): pyverbs cannot end a chain (no NULL
    `next_wr`), and a reused WR would otherwise still point at the one after it.  The provider copies inline
    data at the post, which happens before the caller overwrites its response buffer for the next SEND.
    No Send with Invalidate: pyverbs 44's SendWR has no invalidate_rkey, so the host invalidates its own key
    (as it does for any target that does not)."""

    can_invalidate = False

    def __init__(self, qp, size: int):
        self.qp = qp
        self.sges = [SGE(0, 0, 0) for _ in range(size)]
        self.wrs = []
        for sge in self.sges:
            wr = SendWR(num_sge=1, sg=[sge])
            wr.sg_list = sge  # the WR now reads this SGE at the post (the copy made by __init__ is unused)
            self.wrs.append(wr)
        self.next = 0
        self.pending = None
        self.sge = None
        self.wr_id = 0
        self.wr_flags = 0

    def wr_start(self) -> None:
        self.pending = None

    def _take(self, opcode: int):
        self._post_pending()
        wr, self.sge = self.wrs[self.next], self.sges[self.next]
        self.next = (self.next + 1) % len(self.wrs)
        wr.opcode, wr.wr_id, wr.send_flags = opcode, self.wr_id, self.wr_flags
        self.pending = wr
        return wr

    def _post_pending(self) -> None:
        if self.pending is not None:
            wr, self.pending = self.pending, None
            self.qp.post_send(wr)

    def wr_rdma_read(self, rkey: int, addr: int) -> None:
        self._take(e.IBV_WR_RDMA_READ).set_wr_rdma(rkey, addr)

    def wr_rdma_write(self, rkey: int, addr: int) -> None:
        self._take(e.IBV_WR_RDMA_WRITE).set_wr_rdma(rkey, addr)

    def wr_send(self) -> None:
        self._take(e.IBV_WR_SEND)

    def wr_send_inv(self, invalidate_rkey: int) -> None:
        raise TransportError("Send with Invalidate needs the extended QP API")

    def wr_set_sge(self, sge) -> None:
        self.sge.addr, self.sge.length, self.sge.lkey = sge.addr, sge.length, sge.lkey

    def wr_set_inline_data(self, addr: int, length: int) -> None:
        self.sge.addr, self.sge.length, self.sge.lkey = addr, length, 0

    def wr_complete(self) -> None:
        self._post_pending()


class RdmaTargetQueue(TargetQueue):
    """One accepted NVMe queue: an RC QP with its CQ, receive slots and a `RequestBook` (transport/rdma/requests.py).

    The hot path makes no pyverbs object per command: work requests are built in the QP with the extended API
    (QPEx: wr_start, wr_rdma_read / wr_rdma_write + wr_set_sge on one reused SGE, wr_send / wr_send_inv +
    wr_set_inline_data, wr_complete), so bookworm's leaking SGE and SendWR destructors are never reached per
    command.  The response is inline (no response slot to keep); in one completion poll every receive is
    re-posted first and the responses then go out in one wr_start..wr_complete (one doorbell), data WRITEs
    unsignaled and chained before their SEND, SENDs signaled selectively (requests.py).
    Completions are polled with CQ.poll: pyverbs 44's extended CQ cannot be armed on a completion channel
    (no req_notify), and a target must sleep until work arrives.
    """

    trtype = "rdma"

    def __init__(self, listener: "RdmaListener", cm_id, request: RdmaConnectRequest):
        self.listener = listener
        self.cm_id = cm_id
        self.cm_handle: Optional[int] = None
        self.request = request
        self.closed = False
        self.closing = False  # closed for new commands; the QP stays until the responses already made have left
        self.peer_gone = False
        self.depth = request.hsqsize + 1
        self.in_capsule_size = listener.in_capsule_size if request.qid else 0
        self.recv_size = ADMIN_CAPSULE + self.in_capsule_size
        pd, ctx = listener.pd, listener.context
        local = e.IBV_ACCESS_LOCAL_WRITE

        # Receive slots and send-queue entries: connect.queue_resources says why these numbers.
        self.recv_count, self.max_send_wr = queue_resources(self.depth)
        self.recv_mem = RegisteredMemory(pd, self.recv_count * self.recv_size, local)
        self.recv_wrs = [RecvWR(wr_id=i, num_sge=1, sg=[SGE(self.recv_mem.addr + i * self.recv_size,
                                                              self.recv_size, self.recv_mem.lkey)])
                         for i in range(self.recv_count)]
        self.to_repost: List[int] = []
        # The response is inline: the provider copies these 16 bytes at wr_set_inline_data.
        self.cqe_buf = ctypes.create_string_buffer(RESPONSE_SIZE)
        self.cqe_addr = ctypes.addressof(self.cqe_buf)
        self.sge = SGE(0, 0, 0)  # the one scatter entry every data work request is built from

        self.comp_channel, self.cq_fd = create_with_fd(lambda: CompChannel(ctx))
        # (RequestBook.flush signals every SEND once under a quarter of the send queue is free.)
        self.cq = CQ(ctx, self.recv_count + self.max_send_wr, None, self.comp_channel, 0)
        self.cq.req_notify()
        cap = QPCap(max_send_wr=self.max_send_wr, max_recv_wr=self.recv_count, max_send_sge=1, max_recv_sge=1,
                    max_inline_data=RESPONSE_SIZE)
        ops = (e.IBV_QP_EX_WITH_RDMA_WRITE | e.IBV_QP_EX_WITH_RDMA_READ | e.IBV_QP_EX_WITH_SEND
               | e.IBV_QP_EX_WITH_SEND_WITH_INV)
        init = QPInitAttrEx(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, sq_sig_all=0, cap=cap, pd=pd,
                            send_ops_flags=ops,
                            comp_mask=e.IBV_QP_INIT_ATTR_PD | e.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS)
        try:
            self.qp = QPEx(ctx, init)
            self.poster = self.qp
        except PyverbsRDMAError as exc:
            if getattr(exc, "error_code", None) != errno.EOPNOTSUPP:
                self._release_rings()
                raise AcceptRefused(cmdata.STS_NO_RESOURCES,
                                    f"the device cannot make an extended RC QP with {RESPONSE_SIZE} B inline: {exc}")
            # No extended QP API (siw): a plain RC QP with the same capabilities, posted through LegacyPoster.
            try:
                self.qp = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0))
            except PyverbsRDMAError as exc2:
                self._release_rings()
                raise AcceptRefused(cmdata.STS_NO_RESOURCES,
                                    f"the device cannot make an RC QP with {RESPONSE_SIZE} B inline: {exc2}")
            self.poster = LegacyPoster(self.qp, self.max_send_wr)
        self.remote_invalidate = listener.remote_invalidate and getattr(self.poster, "can_invalidate", True)

        attr, mask = qp_attr(cm_id, QPS_INIT)
        self.qp.modify(attr, mask)
        for wr in self.recv_wrs:
            self.qp.post_recv(wr)
        attr, mask = qp_attr(cm_id, QPS_RTR)
        self.qp.modify(attr, mask)
        attr, mask = qp_attr(cm_id, QPS_RTS)
        # max_rd_atomic arrives as the host's responder resources: how many RDMA READs we may have in flight.
        # iWARP's CM leaves it 0 there: the connect request's initiator depth says it (as nvmet-rdma takes it).
        offered = attr.max_rd_atomic or (listener.pending_initiator_depth if listener.iwarp else 0) or 0
        self.max_reads = min(offered, listener.device.max_qp_init_rd_atom)
        if self.max_reads < 1:
            self._release_rings()
            raise AcceptRefused(cmdata.STS_INVALID_IRD, "host offers no RDMA READ resources (responder_resources 0)")
        attr.max_rd_atomic = self.max_reads
        log.debug("queue %d RTS: local ack timeout %d, retry %d, rnr retry %d (the host's; %d here)", request.qid,
                  attr.timeout, attr.retry_cnt, attr.rnr_retry, RNR_RETRY)
        # Finite (verbs.RNR_RETRY): the CM gives the host's REQ's count, 7 (for ever) from a Linux host, and a host
        # that stopped posting receives would then hold our responses for ever.  The CM's RTS mask has
        # IBV_QP_RNR_RETRY on RoCE and InfiniBand; iWARP has no RNR NAK (nor the bit), and then this is unused.
        attr.rnr_retry = RNR_RETRY
        # rdma_cm's ACK timeout, as nvmet_rdma keeps it, bounded: 0 (infinite) would leave a work request to a
        # vanished host pending for ever.  A shorter one (14, 67 ms) retransmitted WRITEs the host had already
        # acknowledged whenever an emulated CPU delayed the ACK (docs/two-node.md, lossy link).
        if attr.timeout == 0 or attr.timeout > ACK_TIMEOUT:
            attr.timeout = ACK_TIMEOUT
        self.qp.modify(attr, mask)

        cm_id.accept(cmdata.CmAccept(0, self.depth).pack(), 0, self.max_reads, self.qp.qp_num)
        # Data buffers: taken from the port's pool per transfer (the book takes and gives them).
        self.share: PoolShare = listener.pool.accounts.share(wake=self._resume)
        # siw completes a SEND posted after an RDMA READ as soon as it is on the wire, before the READ's data
        # is back: there a send completion cannot vouch for earlier READs (docs/protocol.md §7.8).
        self.book = RequestBook(self, self.share, self.max_send_wr, self.max_reads, prealloc=self.recv_count,
                                reads_complete_in_order=not listener.iwarp)
        self._posting = False  # between wr_start and wr_complete
        listener.loop.watch(self.cq_fd, self._on_cq_event)
        log.info("queue %d accepted on %s:%d: depth %d, in-capsule %d B, %d RDMA READs in flight",
                 request.qid, listener.traddr, listener.trsvcid, self.depth, self.in_capsule_size, self.max_reads)

    def _release_rings(self) -> None:
        for resource in (getattr(self, "qp", None), self.cq, self.comp_channel):
            if resource is not None:
                try:
                    resource.close()
                except Exception:
                    pass
        self.recv_mem.close()

    # -- completions --

    def _on_cq_event(self):
        if self.closed:  # its channel and CQ are gone: pyverbs would dereference NULL
            return None
        try:
            self.comp_channel.get_cq_event(self.cq)
        except PyverbsRDMAError as exc:
            if eagain(exc):
                return
            raise
        self.cq.ack_events(1)
        self.cq.req_notify()  # re-arm before polling so no completion is missed
        return self.poll_completions()

    def poll_completions(self):
        """Handle up to CQ_BUDGET completions; if the budget ran out, return this method for the event
        loop to call again next pass, so one busy queue cannot hold the loop (EventLoop.run_once).
        Receives are re-posted and responses posted once, at the end (RequestBook batching)."""
        book = self.book
        book.begin_batch()
        try:
            return self._poll()
        finally:
            self._repost()
            if not self.closed:
                book.end_batch()
            if self.closing and not self.closed and not book.completing():
                self._teardown(None)  # the last response of a closing queue has left

    def _poll(self):
        done = 0
        requests = self.book.requests
        send_completed = self.book.send_completed
        while not self.closed:
            if done >= CQ_BUDGET:
                return self.poll_completions
            count, wcs = self.cq.poll(num_entries=POLL_BATCH)
            if count == 0:
                return None
            done += count
            for wc in wcs[:count]:
                if self.closed:  # an earlier completion of this batch closed the queue: its rings are gone
                    return None
                if wc.status != e.IBV_WC_SUCCESS:
                    self._on_failed_completion(wc)
                    return None
                wr_id = wc.wr_id
                if wr_id < SEND_WR_BASE:
                    self._on_capsule(wr_id, wc.byte_len)
                elif wr_id < WRITE_WR_ID:
                    send_completed(requests[wr_id - SEND_WR_BASE])
            if count < POLL_BATCH:
                # Fewer than asked for: the CQ was empty at that moment.  Anything later made the armed CQ's
                # channel readable (it was re-armed before this poll), so the next loop pass finds it.
                return None
        return None

    def _repost(self) -> None:
        slots, self.to_repost = self.to_repost, []
        if self.closed:
            return
        qp, wrs = self.qp, self.recv_wrs
        try:
            for slot in slots:
                qp.post_recv(wrs[slot])
        except PyverbsRDMAError as exc:
            log.warning("queue %d: re-posting a receive failed: %s: closing", self.qid, exc)
            self.close(TransportError(f"re-posting a receive failed: {exc}"))

    def _on_failed_completion(self, wc) -> None:
        if wc.status != e.IBV_WC_WR_FLUSH_ERR:
            log.warning("queue %d: work completion failed: status %d (vendor error 0x%x): closing the queue",
                        self.qid, wc.status, wc.vendor_err)
        self.close(RemoteAccessError(f"RDMA READ failed with work completion status {wc.status}"))

    def _on_capsule(self, slot: int, length: int) -> None:
        if self.closing:
            return  # no new command on a closing queue, and no receive re-posted for one
        start = slot * self.recv_size
        capsule = bytes(self.recv_mem.view[start:start + length])
        self.to_repost.append(slot)  # re-posted before any response of this batch goes out (§3.5)
        if length < ADMIN_CAPSULE:
            log.warning("queue %d: capsule of %d bytes (< 64): closing the queue", self.qid, length)
            self.close()
            return
        if wire_log.isEnabledFor(logging.DEBUG):
            wire_log.debug("qp %#x qid %d: capsule %d B opc %#04x cid %d", self.qp.qp_num, self.qid, length,
                           capsule[0], int.from_bytes(capsule[2:4], "little"))
        book = self.book
        tx = book.received()
        book.delivered(tx)
        self.listener.handler.capsule_received(self, memoryview(capsule), tx)

    # -- the book's Poster: work requests built in the QP, posted by flush() with one doorbell

    def _start(self):
        if self.closed:  # the book stops posting on a closed queue; never reach the destroyed QP (SIGSEGV)
            raise TransportError(f"queue {self.qid} is closed")
        qp = self.poster
        if not self._posting:
            qp.wr_start()
            self._posting = True
        return qp

    def post_read(self, req: TxRequest) -> None:
        qp = self._start()
        pool = self.listener.pool
        if wire_log.isEnabledFor(logging.DEBUG):
            wire_log.debug("qp %#x qid %d: RDMA READ va %#x rkey %#x len %d", self.qp.qp_num, self.qid,
                           req.addr, req.key, req.length)
        qp.wr_id = SEND_WR_BASE + req.index
        qp.wr_flags = e.IBV_SEND_SIGNALED
        qp.wr_rdma_read(req.key, req.addr)
        sge = self.sge
        sge.addr = pool.memory.addr + req.chunk * pool.chunk_size
        sge.length = req.length
        sge.lkey = pool.memory.lkey
        qp.wr_set_sge(sge)

    def post_response(self, req: TxRequest) -> None:
        qp = self._start()
        if req.length:  # the data first, unsignaled: RC delivers it before the SEND that follows
            sge = self.sge
            if req.external is not None:
                sge.addr, sge.lkey = req.external
            else:
                pool = self.listener.pool
                sge.addr = pool.memory.addr + req.chunk * pool.chunk_size
                sge.lkey = pool.memory.lkey
            sge.length = req.length
            qp.wr_id = WRITE_WR_ID
            qp.wr_flags = 0
            qp.wr_rdma_write(req.key, req.addr)
            qp.wr_set_sge(sge)
        qp.wr_id = SEND_WR_BASE + req.index
        qp.wr_flags = (e.IBV_SEND_INLINE | e.IBV_SEND_SIGNALED) if req.signaled else e.IBV_SEND_INLINE
        invalidate = req.invalidate is not None and self.remote_invalidate
        if invalidate:
            qp.wr_send_inv(req.invalidate)  # §7.2: the host's key is invalidated with the response
        else:
            qp.wr_send()
        ctypes.memmove(self.cqe_addr, req.cqe, RESPONSE_SIZE)
        qp.wr_set_inline_data(self.cqe_addr, RESPONSE_SIZE)
        if wire_log.isEnabledFor(logging.DEBUG):
            if req.length:
                wire_log.debug("qp %#x qid %d: RDMA WRITE va %#x rkey %#x len %d", self.qp.qp_num, self.qid,
                               req.addr, req.key, req.length)
            wire_log.debug("qp %#x qid %d: SEND response cid %d%s", self.qp.qp_num, self.qid,
                           int.from_bytes(req.cqe[12:14], "little"),
                           f" with invalidate rkey {req.invalidate:#x}" if invalidate else "")

    def flush(self) -> None:
        if not self._posting or self.closed:  # (a queue closed mid-batch: its QP, half-built batch and all, is gone)
            self._posting = False
            return
        self._posting = False
        try:
            self.poster.wr_complete()
        except PyverbsRDMAError as exc:
            log.warning("queue %d: posting work requests failed: %s: closing", self.qid, exc)
            self.close(TransportError(f"posting work requests failed: {exc}"))

    def stage(self, chunk: int, data) -> None:
        pool = self.listener.pool
        start = chunk * pool.chunk_size
        pool.memory.view[start:start + len(data)] = data

    def chunk_view(self, chunk: int, length: int) -> memoryview:
        return self.listener.pool.view(chunk, length)

    # -- data buffers from the port's shared pool

    def _resume(self) -> None:
        """The pool has buffers again: serve the requests waiting for one."""
        if not self.closed:
            self.book.resume()

    def connected(self) -> bool:
        """The target accepted this queue's NVMe Connect: guarantee it its minimum of data buffers."""
        return self.share.commit()

    def guarantee_capacity(self) -> Optional[int]:
        return self.listener.pool.accounts.guarantee_capacity()

    def in_flight(self) -> int:
        return self.book.in_flight()

    def responses_in_flight(self) -> int:
        return 0 if self.closed else self.book.completing()

    def references_held(self, reference) -> int:
        return self.book.holding(reference)

    # -- the TargetQueue contract --

    def read_host(self, addr: int, key: int, length: int, done: ReadDone, tx=None) -> None:
        if self.closed:
            done(None, TransportError("queue is closed"))
            return
        if length > self.listener.max_transfer:
            done(None, TransportError(f"transfer of {length} bytes exceeds {self.listener.max_transfer}"))
            return
        if tx is None:  # a caller without the request of the capsule (tests): a request of its own
            tx = self.book.received()
            self.book.delivered(tx)
        self.book.read(tx, addr, key, length, done)

    def data_buffer(self, length: int, tx=None) -> Optional[memoryview]:
        if tx is None or length > self.listener.max_transfer or not self.book.buffer(tx):
            return None
        return self.listener.pool.view(tx.chunk, length)

    def complete(self, cqe: bytes, data=None, addr: int = 0, key: int = 0, invalidate_key: Optional[int] = None,
                 tx=None, source=None) -> None:
        if self.closed:
            if tx is not None:
                self.book.dropped(tx)
            if source is not None and source[2] is not None:
                source[2].put()  # nothing is sent: nothing reads the namespace's memory
            return
        self.book.respond(tx, cqe, data, addr, key, invalidate_key, source, self.listener.region,
                          self.listener.max_transfer)

    def close(self, error: Optional[TransportError] = None) -> None:
        """Close the queue.  An orderly close (no error, the host still there) first sends the responses of the
        commands already executed -- a Disconnect's own among them, which ends the poll it arrived in -- and keeps
        the QP until their send completions have come (nvmet answers the Disconnect, then tears the queue down);
        a failed completion, the host's disconnect or a second close ends it at once."""
        if self.closed:
            return
        if error is None and not self.peer_gone and not self.closing and self._send_responses_before_close():
            self.closing = True
            log.info("queue %d closing: %d responses still to leave", self.qid, self.book.completing())
            return
        self._teardown(error)

    def _send_responses_before_close(self) -> bool:
        """Post what this poll has batched (its receives first, §3.5); True when responses are still to leave."""
        self._repost()
        if self.closed:
            return False
        self.book.flush()
        return not self.closed and self.book.completing() > 0

    def _teardown(self, error: Optional[TransportError]) -> None:
        if self.closed:
            return
        self.closed = True
        listener = self.listener
        listener.loop.unwatch(self.cq_fd)
        try:
            self.cm_id.disconnect()
        except Exception:
            pass  # already disconnected by the peer
        try:
            listener.handler.queue_closed(self)
        finally:
            for resource in (self.qp, self.cq, self.comp_channel):
                try:
                    resource.close()
                except Exception:
                    pass
            # With the QP gone nothing uses our buffers any more: every request ends, its chunk goes back.  Each
            # step on its own: one that fails must not keep the others' buffers, nor the CM id and the listener's
            # slot (forget).
            for what, step in (("its requests", lambda: self.book.close(error or TransportError("queue closed"))),
                               ("its data-buffer share", self.share.close),
                               ("its receive buffers", self.recv_mem.close),
                               ("its CM id", lambda: listener.forget(self))):
                try:
                    step()
                except Exception:
                    log.exception("queue %d: releasing %s failed", self.qid, what)
            log.info("queue %d closed", self.qid)
