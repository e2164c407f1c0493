"""The RDMA transport on pyverbs: RDMA CM listener and connector, one RC QP per NVMe queue.

Target side (`RdmaListener` on an `EventLoop`): each CONNECT_REQUEST carries the
NVMe-oF private data; the handler decides accept or reject (with the NVMe-oF
STS).  An accepted queue gets its own QP, CQ and completion channel on the
project's own device Context and PD (never the CM's: closing a child id breaks
those, docs/protocol.md §7.3 item 4).  Receive buffers, response buffers and data buffers are
registered with local access only: the target initiates every transfer itself.
Data buffers come from one pool registered once at start; each queue reserves
its share at accept (so no queue starves another) and its commands wait for a
free one beyond that.

Host side (`RdmaConnector`): one CM id and event channel per queue, so every CM
event belongs to a known queue; host memory is registered with remote read and
write for the target.

No call here blocks: the CM channel and every completion channel are put in
non-blocking mode and watched with a selector (pyverbs 44 holds the GIL in its
blocking calls and exposes neither fd, so they are found in /proc/self/fd).
"""
from __future__ import annotations

import collections
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import selectors
import time
from typing import Callable, Deque, Dict, List, Optional

from ..errors import NvmeofError
from ..nvme import cm as cmdata
from .base import (ConnectRejected, ConnectRequest, Connector, HostBuffer, HostQueue, QueueHandler,
                   ReadDone, RemoteAccessError, TargetQueue, TransportError)

log = logging.getLogger(__name__)

try:  # pyverbs is Debian's python3-pyverbs; import lazily so the rest of the package works without it
    import pyverbs.cm_enums as ce
    import pyverbs.enums as e
    from pyverbs.cmid import AddrInfo, CMEvent, CMEventChannel, CMID, ConnParam
    from pyverbs.cq import CQ, CompChannel
    from pyverbs.device import Context
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.pyverbs_error import PyverbsRDMAError
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, RecvWR, SendWR
    PYVERBS_ERROR = None
except ImportError as exc:  # pragma: no cover - depends on the machine
    PYVERBS_ERROR = exc

ADMIN_CAPSULE = 64
RESPONSE_SIZE = 16
CM_TIMEOUT_MS = 3000
SEND_WR_BASE = 1 << 32  # wr_ids below this are receive slots
RESPONSE_WR_BASE = SEND_WR_BASE  # target: + response slot
READ_WR_BASE = 1 << 40  # target: RDMA READs count up from here
ADMIN_CHUNKS = 8  # data buffers reserved for an admin queue
IO_CHUNKS = 32  # data buffers reserved for an I/O queue; commands beyond wait for one (RDMA READ or WRITE)
ACK_TIMEOUT = 14  # QP local ACK timeout exponent: 4.096 us << 14 = 67 ms


def require_pyverbs() -> None:
    if PYVERBS_ERROR is not None:
        raise NvmeofError(f"pyverbs is not available: {PYVERBS_ERROR}",
                          "apt-get install python3-pyverbs rdma-core ibverbs-providers, and make the venv with "
                          "'python3 -m venv --system-site-packages' from the system python3")


# --- file descriptors that pyverbs 44 does not expose ---------------------------------------

def _open_fds() -> Dict[str, str]:
    """fd -> what it points to.  (Listing /proc/self/fd uses an fd itself, so compare targets, not numbers.)"""
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[name] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    return fds


def _create_with_fd(create: Callable[[], object], expect: str):
    """Create a pyverbs object and return (object, the one fd it opened whose target contains `expect`)."""
    before = _open_fds()
    obj = create()
    for name, target in _open_fds().items():
        if expect in target and before.get(name) != target:
            fd = int(name)
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
            return obj, fd
    raise TransportError(f"could not find the file descriptor of a new {type(obj).__name__} ({expect})")


def _eagain(exc: Exception) -> bool:
    return getattr(exc, "error_code", None) in (errno.EAGAIN, errno.EWOULDBLOCK)


# --- registered memory ---------------------------------------------------------------------

class RegisteredMemory:
    """Page-aligned memory we own (a memoryview), registered as one MR."""

    def __init__(self, pd, size: int, access: int):
        self.size = max(size, mmap.PAGESIZE)
        self.map = mmap.mmap(-1, self.size)
        self.view = memoryview(self.map)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.mr = MR(pd, self.size, access, address=self.addr)
        self.lkey = self.mr.lkey
        self.rkey = self.mr.rkey

    def close(self) -> None:
        if self.mr is not None:
            self.mr.close()
            self.mr = None
            self.view.release()
            try:
                self.map.close()
            except BufferError:  # a slice is still referenced somewhere; the GC frees it later
                pass


class DataPool:
    """Fixed-size data chunks carved from one registration made at start."""

    def __init__(self, pd, chunk_size: int, chunks: int):
        self.chunk_size = chunk_size
        self.memory = RegisteredMemory(pd, chunk_size * chunks, e.IBV_ACCESS_LOCAL_WRITE)
        self.free: List[int] = list(range(chunks))

    def reserve(self, count: int) -> Optional[List[int]]:
        if count > len(self.free):
            return None
        taken, self.free = self.free[:count], self.free[count:]
        return taken

    def release(self, chunks: List[int]) -> None:
        self.free.extend(chunks)

    def view(self, chunk: int, length: int) -> memoryview:
        start = chunk * self.chunk_size
        return self.memory.view[start:start + length]

    def addr(self, chunk: int) -> int:
        return self.memory.addr + chunk * self.chunk_size


# --- the target's event loop ---------------------------------------------------------------

class EventLoop:
    """One selector for every CM channel and completion channel; timers run through handler.tick()."""

    def __init__(self, handler: QueueHandler, tick_interval: float = 0.1):
        self.handler = handler
        self.tick_interval = tick_interval
        self.selector = selectors.DefaultSelector()
        self.listeners: List["RdmaListener"] = []

    def watch(self, fd: int, callback: Callable[[], None]) -> None:
        self.selector.register(fd, selectors.EVENT_READ, callback)

    def unwatch(self, fd: int) -> None:
        try:
            self.selector.unregister(fd)
        except (KeyError, ValueError):
            pass

    def run_once(self, timeout: float) -> None:
        for key, _ in self.selector.select(timeout):
            try:
                key.data()
            except Exception:  # one broken queue must not stop the target
                log.exception("event handler failed")

    def run(self, should_stop: Callable[[], bool]) -> None:
        next_tick = time.monotonic()
        while not should_stop():
            now = time.monotonic()
            if now >= next_tick:
                self.handler.tick(now)
                next_tick = now + self.tick_interval
            self.run_once(max(0.0, min(next_tick - now, self.tick_interval)))

    def close(self) -> None:
        for listener in list(self.listeners):
            listener.close()
        self.selector.close()


class RdmaListener:
    """Listens on traddr:trsvcid and turns accepted connections into `RdmaTargetQueue`s."""

    def __init__(self, loop: EventLoop, traddr: str, trsvcid: int = 4420, *, handler: Optional[QueueHandler] = None,
                 port_id: int = 0, in_capsule_size: Optional[int] = None, max_transfer: int = 128 * 1024,
                 data_chunks: int = 1024, remote_invalidate: bool = True):
        require_pyverbs()
        self.loop = loop
        self.handler = handler or loop.handler
        self.traddr, self.trsvcid, self.port_id = traddr, int(trsvcid), port_id
        if in_capsule_size is None:  # what the handler advertises in IOCCSZ
            in_capsule_size = getattr(self.handler, "in_capsule_size", 4096)
        self.in_capsule_size = in_capsule_size
        self.max_transfer = max_transfer
        self.remote_invalidate = remote_invalidate
        self.queues: Dict[int, RdmaTargetQueue] = {}
        self.zombies: List[object] = []  # child CM ids are kept until shutdown (docs/protocol.md §7.3 items 2-4)
        self.channel, self.cm_fd = _create_with_fd(CMEventChannel, "rdma_cm")
        self.listen_id = CMID(creator=self.channel, port_space=ce.RDMA_PS_TCP)
        try:
            self.listen_id.bind_addr(AddrInfo(src=traddr, src_service=str(trsvcid), port_space=ce.RDMA_PS_TCP,
                                              flags=ce.RAI_PASSIVE))
            self.listen_id.listen(128)
        except PyverbsRDMAError as exc:
            raise NvmeofError(f"cannot listen on {traddr}:{trsvcid}: {exc}",
                              "use an IP address of an RDMA netdev (not 0.0.0.0), check the port is free "
                              "(kernel nvmet may hold it: 'nvmeof-roce nvmet show') and 'nvmeof-roce rdma status'")
        # Our own Context/PD on the listener's device: CQs, QPs and MRs never use the CM's.
        self.context = Context(name=self.listen_id.dev_name)
        self.pd = PD(self.context)
        self.device = self.context.query_device()
        self.pool = DataPool(self.pd, max_transfer, data_chunks)
        loop.watch(self.cm_fd, self._on_cm_events)
        loop.listeners.append(self)
        log.info("listening on %s:%d (%s)", traddr, self.trsvcid, self.listen_id.dev_name)

    @property
    def device_name(self) -> str:
        return self.listen_id.dev_name

    def _on_cm_events(self) -> None:
        while True:
            try:
                event = CMEvent(self.channel)
            except PyverbsRDMAError as exc:
                if _eagain(exc):
                    return
                raise
            kind = event.event_type
            if kind == ce.RDMA_CM_EVENT_CONNECT_REQUEST:
                private = bytes(event.private_data or b"")
                child = CMID(creator=event, listen_id=self.listen_id)  # before the ack (§7.3 item 3)
                event.ack_cm_event()
                self._on_connect_request(child, private)
                continue
            name = event.event_str()
            event.ack_cm_event()
            log.debug("CM event %s on %s:%d", name, self.traddr, self.trsvcid)
            # pyverbs cannot tell which child a DISCONNECTED belongs to (docs/protocol.md §7.3 item 2): a queue ends with
            # its controller (CC.SHN, keep-alive expiry) or on a failed work completion.

    def _reject(self, child, sts: int, why: str) -> None:
        log.warning("rejecting a connection on %s:%d: %s (STS %d, %s)", self.traddr, self.trsvcid, why, sts,
                    cmdata.sts_name(sts))
        try:
            child.reject(cmdata.CmReject(0, sts).pack())
        except PyverbsRDMAError as exc:
            log.warning("reject failed: %s", exc)
        self.zombies.append(child)

    def _on_connect_request(self, child, private: bytes) -> None:
        try:
            parsed = cmdata.CmConnectRequest.unpack(private)
        except cmdata.PrivateDataError as exc:
            self._reject(child, exc.sts, str(exc))
            return
        request = ConnectRequest(parsed.recfmt, parsed.qid, parsed.hrqsize, parsed.hsqsize, parsed.cntlid,
                                 peer=f"{self.traddr}:{self.trsvcid}", port_id=self.port_id)
        sts = self.handler.check_connect(request)
        if sts:
            self._reject(child, sts, f"QID {parsed.qid} HSQSIZE {parsed.hsqsize} HRQSIZE {parsed.hrqsize}")
            return
        # Each queue reserves its own chunks, so no queue can starve another; admin commands move a few KiB,
        # one at a time in practice.  Commands beyond a queue's chunks wait for one (reads and responses).
        chunks = self.pool.reserve(min(parsed.hsqsize + 1, ADMIN_CHUNKS if parsed.qid == 0 else IO_CHUNKS))
        if chunks is None:
            self._reject(child, cmdata.STS_NO_RESOURCES, "data buffer pool exhausted")
            return
        try:
            queue = RdmaTargetQueue(self, child, request, chunks)
        except _AcceptRefused as exc:
            self.pool.release(chunks)
            self._reject(child, exc.sts, str(exc))
            return
        except Exception as exc:
            self.pool.release(chunks)
            log.exception("setting up queue %d failed", parsed.qid)
            self._reject(child, cmdata.STS_NO_RESOURCES, f"queue setup failed: {exc}")
            return
        self.queues[queue.cq_fd] = queue
        self.handler.queue_opened(queue)

    def forget(self, queue: "RdmaTargetQueue") -> None:
        self.queues.pop(queue.cq_fd, None)
        self.pool.release(queue.chunks)
        self.zombies.append(queue.cm_id)

    def close(self) -> None:
        for queue in list(self.queues.values()):
            queue.close()
        self.loop.unwatch(self.cm_fd)
        if self in self.loop.listeners:
            self.loop.listeners.remove(self)
        # Drain and ack what is left so destroying the ids cannot wait on an unacked event.
        self._drain_cm_events()
        for child in self.zombies:
            try:
                child.close()
            except Exception:
                pass
        self.zombies.clear()
        self.listen_id.close()
        self.pool.memory.close()

    def _drain_cm_events(self) -> None:
        while True:
            try:
                event = CMEvent(self.channel)
            except PyverbsRDMAError:
                return
            if event.event_type == ce.RDMA_CM_EVENT_CONNECT_REQUEST:
                child = CMID(creator=event, listen_id=self.listen_id)
                event.ack_cm_event()
                self._reject(child, cmdata.STS_NO_RESOURCES, "target shutting down")
            else:
                event.ack_cm_event()


class _AcceptRefused(Exception):
    def __init__(self, sts: int, message: str):
        super().__init__(message)
        self.sts = sts


class RdmaTargetQueue(TargetQueue):
    """One accepted NVMe queue: an RC QP with its CQ, receive slots, response slots and data chunks."""

    def __init__(self, listener: RdmaListener, cm_id, request: ConnectRequest, chunks: List[int]):
        self.listener = listener
        self.cm_id = cm_id
        self.request = request
        self.chunks = chunks
        self.closed = False
        self.depth = request.hsqsize + 1
        self.in_capsule_size = listener.in_capsule_size if request.qid else 0
        self.recv_size = ADMIN_CAPSULE + self.in_capsule_size
        pd, ctx = listener.pd, listener.context
        local = e.IBV_ACCESS_LOCAL_WRITE

        # Receive slots: at least HSQSIZE + 1 posted at all times (§1.6), one spare.
        self.recv_count = self.depth + 1
        self.recv_mem = RegisteredMemory(pd, self.recv_count * self.recv_size, local)
        self.recv_wrs = [RecvWR(wr_id=i, num_sge=1, sg=[SGE(self.recv_mem.addr + i * self.recv_size,
                                                              self.recv_size, self.recv_mem.lkey)])
                         for i in range(self.recv_count)]
        # Response slots: a 16-byte CQE each, busy until its SEND completes.
        self.resp_count = self.depth + 4
        self.resp_mem = RegisteredMemory(pd, self.resp_count * RESPONSE_SIZE, local)
        self.free_resp: List[int] = list(range(self.resp_count))
        # One SEND per response slot, built once: pyverbs objects are costly to create per command.
        self.resp_wrs = [SendWR(wr_id=RESPONSE_WR_BASE + i, opcode=e.IBV_WR_SEND, num_sge=1,
                                sg=[SGE(self.resp_mem.addr + i * RESPONSE_SIZE, RESPONSE_SIZE, self.resp_mem.lkey)],
                                send_flags=e.IBV_SEND_SIGNALED)
                         for i in range(self.resp_count)]
        self.free_chunks: List[int] = list(chunks)

        self.comp_channel, self.cq_fd = _create_with_fd(lambda: CompChannel(ctx), "infinibandevent")
        self.max_send_wr = 3 * self.depth + 8
        self.cq = CQ(ctx, self.recv_count + self.max_send_wr, None, self.comp_channel, 0)
        self.cq.req_notify()
        cap = QPCap(max_send_wr=self.max_send_wr, max_recv_wr=self.recv_count, max_send_sge=1, max_recv_sge=1)
        self.qp = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, sq_sig_all=0, cap=cap))

        attr, mask = cm_id.init_qp_attr(e.IBV_QPS_INIT)
        self.qp.modify(attr, mask)
        for wr in self.recv_wrs:
            self.qp.post_recv(wr)
        attr, mask = cm_id.init_qp_attr(e.IBV_QPS_RTR)
        self.qp.modify(attr, mask)
        attr, mask = cm_id.init_qp_attr(e.IBV_QPS_RTS)
        # max_rd_atomic arrives as the host's responder resources: how many RDMA READs we may have in flight.
        self.max_reads = min(attr.max_rd_atomic, listener.device.max_qp_init_rd_atom)
        if self.max_reads < 1:
            raise _AcceptRefused(cmdata.STS_INVALID_IRD, "host offers no RDMA READ resources (responder_resources 0)")
        attr.max_rd_atomic = self.max_reads
        log.debug("queue %d RTS: local ack timeout %d, retry %d, rnr retry %d", request.qid, attr.timeout,
                  attr.retry_cnt, attr.rnr_retry)
        # A bounded ACK timeout (4.096 us << 14 = 67 ms, times retry_cnt): a vanished host fails our
        # next work request within about a second instead of never (rxe's CM leaves it at 0 = infinite).
        if attr.timeout == 0 or attr.timeout > ACK_TIMEOUT:
            attr.timeout = ACK_TIMEOUT
        self.qp.modify(attr, mask)

        self.next_wr_id = READ_WR_BASE
        self.send_context: Dict[int, tuple] = {}
        self.reads_in_flight = 0
        self.waiting_reads: Deque[tuple] = collections.deque()
        self.pending_writes: List[list] = []  # [addr, key, chunk or unstaged bytes, length] before the next response
        self.deferred: Deque[tuple] = collections.deque()  # responses waiting for chunks or a response slot

        param = ConnParam(resources=0, depth=self.max_reads, flow_control=1, retry=7, rnr_retry=7,
                          qp_num=self.qp.qp_num, data_len=cmdata.ACCEPT_SIZE)
        param.set_private_data(cmdata.CmAccept(0, self.depth).pack())
        cm_id.accept(param)
        listener.loop.watch(self.cq_fd, self._on_cq_event)
        log.info("queue %d accepted on %s:%d: depth %d, in-capsule %d B, %d RDMA READs in flight",
                 request.qid, listener.traddr, listener.trsvcid, self.depth, self.in_capsule_size, self.max_reads)

    # -- completions --

    def _on_cq_event(self) -> None:
        try:
            self.comp_channel.get_cq_event(self.cq)
        except PyverbsRDMAError as exc:
            if _eagain(exc):
                return
            raise
        self.cq.ack_events(1)
        self.cq.req_notify()  # re-arm before polling so no completion is missed
        self.poll_completions()

    def poll_completions(self) -> None:
        while not self.closed:
            count, wcs = self.cq.poll(num_entries=32)
            if count == 0:
                return
            for wc in wcs[:count]:
                if wc.status != e.IBV_WC_SUCCESS:
                    self._on_failed_completion(wc)
                    return
                if wc.wr_id < SEND_WR_BASE:
                    self._on_capsule(wc.wr_id, wc.byte_len)
                else:
                    self._on_send_completion(wc)

    def _on_failed_completion(self, wc) -> None:
        context = self.send_context.pop(wc.wr_id, None)
        if wc.status != e.IBV_WC_WR_FLUSH_ERR:
            log.warning("queue %d: work completion failed: status %d (vendor error 0x%x): closing the queue",
                        self.qid, wc.status, wc.vendor_err)
        if context is not None and context[0] == "read":
            self._finish_read(context, None, RemoteAccessError(
                f"RDMA READ failed with work completion status {wc.status}"))
        self.close()

    def _on_capsule(self, slot: int, length: int) -> None:
        start = slot * self.recv_size
        capsule = bytes(self.recv_mem.view[start:start + length])
        self.qp.post_recv(self.recv_wrs[slot])  # re-post before anything can respond (§3.5)
        if length < ADMIN_CAPSULE:
            log.warning("queue %d: capsule of %d bytes (< 64): closing the queue", self.qid, length)
            self.close()
            return
        self.listener.handler.capsule_received(self, memoryview(capsule))

    def _on_send_completion(self, wc) -> None:
        context = self.send_context.pop(wc.wr_id, None)
        if context is None:
            return
        if context[0] == "read":  # ("read", chunk, length, done)
            self.reads_in_flight -= 1
            self._finish_read(context, self.listener.pool.view(context[1], context[2]), None)
            self._start_waiting_reads()
        else:  # ("send", slot, chunks, WRITE WRs kept alive until posted): slot and chunks are free again
            _, slot, chunks, _keepalive = context
            self.free_resp.append(slot)
            self._release_chunks(chunks)

    def _finish_read(self, context, data, error) -> None:
        chunk, done = context[1], context[3]
        try:
            done(data, error)
        finally:
            self.free_chunks.append(chunk)
            self._post_deferred()

    # -- the TargetQueue contract --

    def _wr_id(self) -> int:
        self.next_wr_id += 1
        return self.next_wr_id

    def read_host(self, addr: int, key: int, length: int, done: ReadDone) -> None:
        if self.closed:
            done(None, TransportError("queue is closed"))
            return
        if length > self.listener.max_transfer:
            done(None, TransportError(f"transfer of {length} bytes exceeds {self.listener.max_transfer}"))
            return
        self.waiting_reads.append((addr, key, length, done))
        self._start_waiting_reads()

    def _start_waiting_reads(self) -> None:
        while self.waiting_reads and self.reads_in_flight < self.max_reads and self.free_chunks and not self.closed:
            addr, key, length, done = self.waiting_reads.popleft()
            chunk = self.free_chunks.pop()
            wr_id = self._wr_id()
            wr = SendWR(wr_id=wr_id, opcode=e.IBV_WR_RDMA_READ, num_sge=1,
                        sg=[SGE(self.listener.pool.addr(chunk), length, self.listener.pool.memory.lkey)],
                        send_flags=e.IBV_SEND_SIGNALED)
            wr.set_wr_rdma(key, addr)
            self.send_context[wr_id] = ("read", chunk, length, done)
            self.reads_in_flight += 1
            try:
                self.qp.post_send(wr)
            except PyverbsRDMAError as exc:
                self.send_context.pop(wr_id)
                self.reads_in_flight -= 1
                self._finish_read(("read", chunk, length, done), None, TransportError(f"post RDMA READ: {exc}"))

    def write_host(self, addr: int, key: int, data) -> None:
        if self.closed:
            return
        length = len(data)
        if length > self.listener.max_transfer:
            raise TransportError(f"RDMA WRITE of {length} bytes exceeds the {self.listener.max_transfer}-byte MDTS")
        # Without a free chunk the data waits (copied) and so does the response that follows it.
        self.pending_writes.append([addr, key, self._stage(data) if self.free_chunks and not self.deferred
                                    else bytes(data), length])

    def _stage(self, data) -> int:
        chunk = self.free_chunks.pop()
        self.listener.pool.view(chunk, len(data))[:] = data
        return chunk

    def _release_chunks(self, chunks) -> None:
        self.free_chunks.extend(chunks)
        self._post_deferred()
        self._start_waiting_reads()

    def respond(self, cqe: bytes, invalidate_key: Optional[int] = None) -> None:
        if self.closed:
            return
        writes, self.pending_writes = self.pending_writes, []
        self.deferred.append((writes, bytes(cqe), invalidate_key))
        self._post_deferred()

    def _post_deferred(self) -> None:
        """Post waiting responses in order, each once its WRITE data is staged in registered chunks."""
        while self.deferred and not self.closed:
            writes, cqe, invalidate_key = self.deferred[0]
            unstaged = [w for w in writes if not isinstance(w[2], int)]
            if len(unstaged) > len(self.free_chunks) or not self.free_resp:
                return
            for w in unstaged:
                w[2] = self._stage(w[2])
            self.deferred.popleft()
            self._post_response(writes, cqe, invalidate_key)

    def _post_response(self, writes, cqe: bytes, invalidate_key: Optional[int]) -> None:
        slot = self.free_resp.pop()
        start = slot * RESPONSE_SIZE
        self.resp_mem.view[start:start + RESPONSE_SIZE] = cqe
        send = self.resp_wrs[slot]
        wr_id = RESPONSE_WR_BASE + slot
        if invalidate_key is not None and self.listener.remote_invalidate:
            send.opcode = e.IBV_WR_SEND_WITH_INV
            send.imm_data = invalidate_key  # the C union shares imm_data with invalidate_rkey (§7.2)
        else:
            send.opcode = e.IBV_WR_SEND
        pool = self.listener.pool
        head, wrs = send, []
        for addr, key, chunk, length in reversed(writes):  # WRITEs unsignaled, chained before the SEND
            wr = SendWR(wr_id=0, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1,
                        sg=[SGE(pool.addr(chunk), length, pool.memory.lkey)], send_flags=0)
            wr.set_wr_rdma(key, addr)
            wr.next_wr = head
            head = wr
            wrs.append(wr)
        self.send_context[wr_id] = ("send", slot, [w[2] for w in writes], wrs)
        try:
            self.qp.post_send(head)
        except PyverbsRDMAError as exc:
            log.warning("queue %d: post SEND failed: %s: closing", self.qid, exc)
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        listener = self.listener
        listener.loop.unwatch(self.cq_fd)
        try:
            self.cm_id.disconnect()
        except Exception:
            pass  # already disconnected by the peer
        waiting, self.waiting_reads = self.waiting_reads, collections.deque()
        for addr, key, length, done in waiting:
            try:
                done(None, TransportError("queue closed"))
            except Exception:
                log.exception("read callback failed")
        for context in list(self.send_context.values()):
            if context[0] == "read":
                try:
                    context[3](None, TransportError("queue closed"))
                except Exception:
                    log.exception("read callback failed")
        self.send_context.clear()
        try:
            listener.handler.queue_closed(self)
        finally:
            for resource in (self.qp, self.cq, self.comp_channel):
                try:
                    resource.close()
                except Exception:
                    pass
            self.recv_mem.close()
            self.resp_mem.close()
            listener.forget(self)
            log.info("queue %d closed", self.qid)


# --- the host side -------------------------------------------------------------------------

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
