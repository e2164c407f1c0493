"""The RDMA transport on pyverbs: RDMA CM listener and connector, one RC QP per NVMe queue.

Target side (`RdmaListener` on an `EventLoop`): each CONNECT_REQUEST carries the
NVMe-oF private data; the handler decides accept or reject (with the NVMe-oF
STS).  An accepted queue gets its own QP, CQ and completion channel on the
project's own device Context and PD (never the CM's: closing a child id breaks
those, docs/protocol.md §7.3 item 4).  Receive buffers, response buffers and data buffers are
registered with local access only: the target initiates every transfer itself.
Data buffers come from one pool per port registered once at start and shared by
its queues (transport/resources.py): a queue is guaranteed a small minimum only
once its NVMe Connect succeeds, takes the rest from the shared part, and its
commands wait for a buffer when none is free.

CM events of every child id arrive on the listener's one channel.  pyverbs 44
does not say which child an event is for, so `_CmEventIds` reads the
`rdma_cm_event.id` pointer out of the pyverbs CMEvent object with ctypes (the
layout is verified at first use against the channel's fd): a DISCONNECTED closes
its queue at once.  A child id is destroyed as soon as its queue is closed or its
connection rejected (every event is acked before it is acted on, so the destroy
never waits, docs/protocol.md §7.3 item 3).

Host side (`RdmaConnector`, in rdma_host.py): one CM id and event channel per queue, so every CM
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
from .resources import BufferPool, PoolShare, ResourceLimits
from .base import ConnectRequest, QueueHandler, ReadDone, RemoteAccessError, TargetQueue, TransportError

log = logging.getLogger(__name__)
# One DEBUG line per capsule received and per work request posted (`target serve -vv`): what a capture
# of the wire must show, in the same order (`nvmeof-roce rdma decode`, docs/two-node.md).
wire_log = logging.getLogger(__name__ + ".wire")

try:  # pyverbs is Debian's python3-pyverbs; import lazily so the rest of the package works without it
    import pyverbs.cm_enums as ce
    import pyverbs.enums as e
    from pyverbs.cmid import AddrInfo, CMEvent, CMEventChannel, CMID, ConnParam
    from pyverbs.cq import CQ, CompChannel
    from pyverbs.device import Context
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.pyverbs_error import PyverbsRDMAError
    from pyverbs.qp import QP, QPCap, QPInitAttr
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
ACK_TIMEOUT = 14  # QP local ACK timeout exponent: 4.096 us << 14 = 67 ms


# Bookworm's pyverbs 44 never frees an SGE or SendWR: their destructor is misnamed `__dealloc` (fixed upstream
# later), so objects made per command leak.  There the data WRITE and READ work requests are made once per queue
# and reused, each pointing at its own SGE's buffer so that updating the SGE changes what is posted; a work request
# may be reused as soon as post_send returns (the provider has copied it).  On a fixed pyverbs that sharing would
# free the buffer twice, so per-command objects (which no longer leak there) are used instead.
WR_LEAKS = PYVERBS_ERROR is None and any(name.endswith("__dealloc") for name in dir(SendWR))


class _DataWR:
    """One reusable RDMA READ or WRITE work request with its SGE (only where WR_LEAKS)."""

    __slots__ = ("wr", "sge")

    def __init__(self, opcode: int, send_flags: int):
        self.sge = SGE(0, 0, 0)
        self.wr = SendWR(wr_id=0, opcode=opcode, num_sge=1, sg=[self.sge], send_flags=send_flags)
        self.wr.sg_list = self.sge  # the WR now reads the SGE's buffer (its own one-entry copy is left unused)

    def set(self, wr_id: int, addr: int, length: int, lkey: int, rkey: int, remote_addr: int):
        sge = self.sge
        sge.addr = addr
        sge.length = length
        sge.lkey = lkey
        wr = self.wr
        wr.wr_id = wr_id
        wr.set_wr_rdma(rkey, remote_addr)
        return wr


def _data_wr(opcode: int, send_flags: int, wr_id: int, addr: int, length: int, lkey: int, rkey: int,
             remote_addr: int):
    """A new work request per command (pyverbs without the leak)."""
    wr = SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[SGE(addr, length, lkey)], send_flags=send_flags)
    wr.set_wr_rdma(rkey, remote_addr)
    return wr


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


# --- which child id a CM event is for ---------------------------------------------------------

_MIN_POINTER = 1 << 16  # no user-space object lives below this: a smaller "pointer" is not one


class _CmEventIds:
    """The `rdma_cm_event.id` pointer of a pyverbs 44 CMEvent, read with ctypes.

    pyverbs keeps the `struct rdma_cm_event *` in a C field of the CMEvent object and
    exposes neither it nor the id.  librdmacm's structs start (rdma_cma.h):
    rdma_cm_event {id, listen_id, event, status, ...}; rdma_cm_id {verbs, channel, ...};
    rdma_event_channel {fd}.  The field's offset in the object is found once, on the
    first event (Cython stores the object's only C field, `event`, last), and accepted only if the chain event -> id -> channel -> fd leads to
    this listener's channel fd and the event type matches: on any other layout the
    attribution is switched off (and logged), never guessed.
    """

    def __init__(self, channel_fd: int):
        self.channel_fd = channel_fd
        self.offset: Optional[int] = None
        self.disabled = False

    @staticmethod
    def _ptr(addr: int) -> int:
        return ctypes.c_void_p.from_address(addr).value or 0

    def _check(self, event, offset: int) -> int:
        ev = self._ptr(id(event) + offset)
        if ev < _MIN_POINTER or ev % 8:
            return 0
        if ctypes.c_int.from_address(ev + 16).value != event.event_type:
            return 0
        cm_id = self._ptr(ev)
        if cm_id < _MIN_POINTER or cm_id % 8:
            return 0
        channel = self._ptr(cm_id + 8)
        if channel < _MIN_POINTER or channel % 4 or ctypes.c_int.from_address(channel).value != self.channel_fd:
            return 0
        return cm_id

    def of(self, event) -> Optional[int]:
        if self.disabled:
            return None
        if self.offset is not None:
            return self._check(event, self.offset) or None
        offset = type(event).__basicsize__ - 8
        cm_id = self._check(event, offset)
        if cm_id:
            self.offset = offset
            log.info("CM events are attributed to their connection (rdma_cm_event at offset %d of CMEvent)", offset)
            return cm_id
        self.disabled = True
        log.warning("cannot read which connection a CM event belongs to (pyverbs layout not recognised): "
                    "a vanished host is found by keep-alive and failed work requests only")
        return None


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
    """Fixed-size data chunks carved from one registration made at start; `accounts` says who may take which."""

    def __init__(self, pd, chunk_size: int, chunks: int, min_per_queue: int):
        self.chunk_size = chunk_size
        self.memory = RegisteredMemory(pd, chunk_size * chunks, e.IBV_ACCESS_LOCAL_WRITE)
        self.accounts = BufferPool(chunks, min_per_queue)

    def view(self, chunk: int, length: int) -> memoryview:
        start = chunk * self.chunk_size
        return self.memory.view[start:start + length]

    def addr(self, chunk: int) -> int:
        return self.memory.addr + chunk * self.chunk_size


# --- the target's event loop ---------------------------------------------------------------

CQ_BUDGET = 64  # completions one queue handles per loop pass before the others get their turn
SLOW_HANDLER = 0.1  # s: a handler that holds the loop this long is logged (other hosts wait meanwhile)


class EventLoop:
    """One selector for every CM channel and completion channel; timers run through handler.tick()."""

    def __init__(self, handler: QueueHandler, tick_interval: float = 0.1):
        self.handler = handler
        self.tick_interval = tick_interval
        self.selector = selectors.DefaultSelector()
        self.listeners: List["RdmaListener"] = []
        self._again: List[Callable] = []  # continuations of handlers that stopped at their budget
        self.longest_pass = 0.0  # seconds: the longest loop pass since start
        self.longest_pass_recent = 0.0  # ... since the caller last reset it (status lines)

    def watch(self, fd: int, callback: Callable[[], None]) -> None:
        self.selector.register(fd, selectors.EVENT_READ, callback)

    def unwatch(self, fd: int) -> None:
        try:
            self.selector.unregister(fd)
        except (KeyError, ValueError):
            pass

    def run_once(self, timeout: float) -> int:
        """One loop pass: wait up to `timeout` (not at all while a handler has work left) and run the
        handlers of every ready fd, then the continuations handlers left last pass; how many ran.

        A handler may return a callable: it stopped at its budget with work left (a busy queue's
        completions), and that callable runs in the next pass, after the other queues had their turn.
        The time the handlers took is the pass: the longest is kept (longest_pass, longest_pass_recent)."""
        again, self._again = self._again, []
        ready = self.selector.select(0 if again else timeout)
        start = time.monotonic()
        callbacks = [key.data for key, _ in ready] + again
        for callback in callbacks:
            began = time.monotonic()
            try:
                more = callback()
                if callable(more) and more not in self._again:
                    self._again.append(more)
            except Exception:  # one broken queue must not stop the target
                log.exception("event handler failed")
            took = time.monotonic() - began
            if took >= SLOW_HANDLER:
                log.warning("one event handler held the loop %.0f ms: %s", took * 1000,
                            getattr(callback, "__qualname__", callback))
        self._account(start)
        return len(callbacks)

    def _account(self, start: float) -> None:
        took = time.monotonic() - start
        if took > self.longest_pass_recent:
            self.longest_pass_recent = took
            if took > self.longest_pass:
                self.longest_pass = took

    def run(self, should_stop: Callable[[], bool]) -> None:
        next_tick = time.monotonic()
        while not should_stop():
            now = time.monotonic()
            self.run_once(max(0.0, min(next_tick - now, self.tick_interval)))
            now = time.monotonic()
            if now >= next_tick:
                # Serve what arrived while the last pass ran (capsules, completions, keep-alives) before
                # the timers look at it, and let the timers judge as of the last moment at which everything
                # that had arrived was served: a slow pass is never charged to the hosts as silence.
                while True:
                    served_until = time.monotonic()
                    if not self.run_once(0) or time.monotonic() - now > self.tick_interval:
                        break  # nothing more was ready, or still busy: the timers run anyway
                start = time.monotonic()
                self.handler.tick(served_until)
                self._account(start)
                next_tick = start + self.tick_interval

    def close(self) -> None:
        for listener in list(self.listeners):
            listener.close()
        self.selector.close()


class RdmaListener:
    """Listens on traddr:trsvcid and turns accepted connections into `RdmaTargetQueue`s."""

    def __init__(self, loop: EventLoop, traddr: str, trsvcid: int = 4420, *, handler: Optional[QueueHandler] = None,
                 port_id: int = 0, in_capsule_size: Optional[int] = None, max_transfer: int = 128 * 1024,
                 limits: Optional[ResourceLimits] = None, remote_invalidate: bool = True):
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
        self.limits = limits or ResourceLimits()
        self.children: Dict[int, "RdmaTargetQueue"] = {}  # rdma_cm_id pointer -> its open queue
        self.cm_ids_created = 0  # child ids made from CONNECT_REQUESTs
        self.cm_ids_destroyed = 0
        self.disconnects_attributed = 0
        self.channel, self.cm_fd = _create_with_fd(CMEventChannel, "rdma_cm")
        self.event_ids = _CmEventIds(self.cm_fd)
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
        self.pool = DataPool(self.pd, max_transfer, self.limits.data_buffers, self.limits.queue_min_buffers)
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
            id_ptr = self.event_ids.of(event)  # read before the ack frees the event
            if kind == ce.RDMA_CM_EVENT_CONNECT_REQUEST:
                private = bytes(event.private_data or b"")
                child = CMID(creator=event, listen_id=self.listen_id)  # before the ack (docs/protocol.md §7.3 item 3)
                self.cm_ids_created += 1
                event.ack_cm_event()
                self._on_connect_request(child, private, id_ptr)
                continue
            name = event.event_str()
            event.ack_cm_event()
            queue = self.children.get(id_ptr) if id_ptr else None
            log.debug("CM event %s on %s:%d (queue %s)", name, self.traddr, self.trsvcid,
                      queue.qid if queue is not None else "?")
            if queue is not None and kind in (ce.RDMA_CM_EVENT_DISCONNECTED, ce.RDMA_CM_EVENT_TIMEWAIT_EXIT):
                # The peer disconnected (or its CM gave up on it): release the queue now, not at keep-alive expiry.
                self.disconnects_attributed += 1
                log.info("queue %d (%s): host disconnected (CM %s)", queue.qid, queue.request.peer, name)
                queue.peer_gone = True
                queue.close()

    def _reject(self, child, sts: int, why: str) -> None:
        log.warning("rejecting a connection on %s:%d: %s (STS %d, %s)", self.traddr, self.trsvcid, why, sts,
                    cmdata.sts_name(sts))
        try:
            child.reject(cmdata.CmReject(0, sts).pack())
        except PyverbsRDMAError as exc:
            log.warning("reject failed: %s", exc)
        self._destroy_id(child)

    def _destroy_id(self, cm_id) -> None:
        """Destroy a child id: its events are all acked by now, so this never waits (docs/protocol.md §7.3 item 3).  Our
        QPs, CQs and MRs live on our own Context and PD, which a child close cannot break (docs/protocol.md §7.3 item 4)."""
        try:
            cm_id.close()
            self.cm_ids_destroyed += 1
        except Exception as exc:
            log.warning("destroying a CM id failed: %s", exc)

    def _on_connect_request(self, child, private: bytes, id_ptr: Optional[int] = None) -> None:
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
        # Nothing but the receive and response rings is committed here: data buffers are guaranteed to a
        # queue only once its NVMe Connect succeeds (connected()), and the target closes a queue that does
        # not get there within its connect timeout.
        try:
            queue = RdmaTargetQueue(self, child, request)
        except _AcceptRefused as exc:
            self._reject(child, exc.sts, str(exc))
            return
        except Exception as exc:
            log.exception("setting up queue %d failed", parsed.qid)
            self._reject(child, cmdata.STS_NO_RESOURCES, f"queue setup failed: {exc}")
            return
        queue.id_ptr = id_ptr
        self.queues[queue.cq_fd] = queue
        if id_ptr:
            self.children[id_ptr] = queue
        self.handler.queue_opened(queue)

    def forget(self, queue: "RdmaTargetQueue") -> None:
        self.queues.pop(queue.cq_fd, None)
        if queue.id_ptr:
            self.children.pop(queue.id_ptr, None)
        self._destroy_id(queue.cm_id)

    def status(self) -> str:
        """One line of figures for `target serve`'s status log."""
        connected = sum(1 for q in self.queues.values() if q.share.guaranteed)
        return (f"{self.traddr}:{self.trsvcid}: {len(self.queues)} queues ({connected} connected), "
                f"{self.cm_ids_created - self.cm_ids_destroyed} CM ids kept ({self.cm_ids_destroyed} destroyed, "
                f"{self.disconnects_attributed} disconnects attributed), "
                f"data buffers {self.pool.accounts.status()}")

    def close(self) -> None:
        for queue in list(self.queues.values()):
            queue.close()
        self.loop.unwatch(self.cm_fd)
        if self in self.loop.listeners:
            self.loop.listeners.remove(self)
        # Drain and ack what is left so destroying the ids cannot wait on an unacked event.
        self._drain_cm_events()
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
                self.cm_ids_created += 1
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

    def __init__(self, listener: RdmaListener, cm_id, request: ConnectRequest):
        self.listener = listener
        self.cm_id = cm_id
        self.id_ptr: Optional[int] = None
        self.request = request
        self.closed = False
        self.peer_gone = False
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
        # Reused data work requests (WR_LEAKS): one READ (posted one at a time), WRITEs as many as one response chains.
        self.read_wr = _DataWR(e.IBV_WR_RDMA_READ, e.IBV_SEND_SIGNALED) if WR_LEAKS else None
        self.write_wrs: List[_DataWR] = []
        self.send_context: Dict[int, tuple] = {}
        self.reads_in_flight = 0
        self.waiting_reads: Deque[tuple] = collections.deque()
        self.pending_writes: List[list] = []  # [addr, key, chunk or unstaged bytes, length] before the next response
        self.deferred: Deque[tuple] = collections.deque()  # responses waiting for chunks or a response slot

        param = ConnParam(resources=0, depth=self.max_reads, flow_control=1, retry=7, rnr_retry=7,
                          qp_num=self.qp.qp_num, data_len=cmdata.ACCEPT_SIZE)
        param.set_private_data(cmdata.CmAccept(0, self.depth).pack())
        cm_id.accept(param)
        # Data buffers: taken from the port's pool per transfer; `held` are this queue's right now.
        self.share: PoolShare = listener.pool.accounts.share(wake=self._resume)
        self.held: set = set()
        listener.loop.watch(self.cq_fd, self._on_cq_event)
        log.info("queue %d accepted on %s:%d: depth %d, in-capsule %d B, %d RDMA READs in flight",
                 request.qid, listener.traddr, listener.trsvcid, self.depth, self.in_capsule_size, self.max_reads)

    # -- completions --

    def _on_cq_event(self):
        try:
            self.comp_channel.get_cq_event(self.cq)
        except PyverbsRDMAError as exc:
            if _eagain(exc):
                return
            raise
        self.cq.ack_events(1)
        self.cq.req_notify()  # re-arm before polling so no completion is missed
        return self.poll_completions()

    def poll_completions(self):
        """Handle up to CQ_BUDGET completions; if the budget ran out, return this method for the event
        loop to call again next pass, so one busy queue cannot hold the loop (EventLoop.run_once)."""
        done = 0
        while not self.closed:
            if done >= CQ_BUDGET:
                return self.poll_completions
            count, wcs = self.cq.poll(num_entries=32)
            if count == 0:
                return None
            done += count
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
        if wire_log.isEnabledFor(logging.DEBUG):
            wire_log.debug("qp %#x qid %d: capsule %d B opc %#04x cid %d", self.qp.qp_num, self.qid, length,
                           capsule[0], int.from_bytes(capsule[2:4], "little"))
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
            self._give([chunk])
            self._resume()

    # -- data buffers from the port's shared pool

    def _take(self, count: int) -> Optional[List[int]]:
        chunks = self.share.take(count)
        if chunks:
            self.held.update(chunks)
        return chunks

    def _give(self, chunks) -> None:
        chunks = [c for c in chunks if c in self.held]
        self.held.difference_update(chunks)
        self.share.give(chunks)

    def _resume(self) -> None:
        """Buffers may be free again: send waiting responses, start waiting reads."""
        self._post_deferred()
        self._start_waiting_reads()

    def connected(self) -> bool:
        """The target accepted this queue's NVMe Connect: guarantee it its minimum of data buffers."""
        return self.share.commit()

    def guarantee_capacity(self) -> Optional[int]:
        return self.listener.pool.accounts.guarantee_capacity()

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
        while self.waiting_reads and self.reads_in_flight < self.max_reads and not self.closed:
            taken = self._take(1)
            if not taken:
                return  # woken by the pool when a buffer is free
            chunk = taken[0]
            addr, key, length, done = self.waiting_reads.popleft()
            wr_id = self._wr_id()
            pool = self.listener.pool
            if self.read_wr is not None:
                wr = self.read_wr.set(wr_id, pool.addr(chunk), length, pool.memory.lkey, key, addr)
            else:
                wr = _data_wr(e.IBV_WR_RDMA_READ, e.IBV_SEND_SIGNALED, wr_id, pool.addr(chunk), length,
                              pool.memory.lkey, key, addr)
            self.send_context[wr_id] = ("read", chunk, length, done)
            self.reads_in_flight += 1
            if wire_log.isEnabledFor(logging.DEBUG):
                wire_log.debug("qp %#x qid %d: RDMA READ va %#x rkey %#x len %d", self.qp.qp_num, self.qid,
                               addr, key, length)
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
        taken = None if self.deferred else self._take(1)
        self.pending_writes.append([addr, key, self._stage(taken[0], data) if taken else bytes(data), length])

    def _stage(self, chunk: int, data) -> int:
        self.listener.pool.view(chunk, len(data))[:] = data
        return chunk

    def _release_chunks(self, chunks) -> None:
        self._give(chunks)
        self._resume()

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
            if not self.free_resp:
                return
            unstaged = [w for w in writes if not isinstance(w[2], int)]
            taken = self._take(len(unstaged)) if unstaged else []
            if taken is None:
                return  # woken by the pool when buffers are free
            for w, chunk in zip(unstaged, taken):
                w[2] = self._stage(chunk, w[2])
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
        for i, (addr, key, chunk, length) in enumerate(reversed(writes)):  # WRITEs unsignaled, before the SEND
            if WR_LEAKS:
                while len(self.write_wrs) <= i:
                    self.write_wrs.append(_DataWR(e.IBV_WR_RDMA_WRITE, 0))
                wr = self.write_wrs[i].set(0, pool.addr(chunk), length, pool.memory.lkey, key, addr)
            else:
                wr = _data_wr(e.IBV_WR_RDMA_WRITE, 0, 0, pool.addr(chunk), length, pool.memory.lkey, key, addr)
                wrs.append(wr)  # kept alive until the SEND completes
            wr.next_wr = head
            head = wr
        self.send_context[wr_id] = ("send", slot, [w[2] for w in writes], wrs)
        if wire_log.isEnabledFor(logging.DEBUG):
            for addr, key, _chunk, length in writes:
                wire_log.debug("qp %#x qid %d: RDMA WRITE va %#x rkey %#x len %d", self.qp.qp_num, self.qid,
                               addr, key, length)
            wire_log.debug("qp %#x qid %d: SEND response cid %d%s", self.qp.qp_num, self.qid,
                           int.from_bytes(cqe[12:14], "little"),
                           f" with invalidate rkey {invalidate_key:#x}" if send.opcode == e.IBV_WR_SEND_WITH_INV
                           else "")
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
            # With the QP gone nothing uses our buffers any more: all of them go back to the pool.
            self.pending_writes.clear()
            self.deferred.clear()
            self._give(list(self.held))
            self.share.close()
            self.recv_mem.close()
            self.resp_mem.close()
            listener.forget(self)
            log.info("queue %d closed", self.qid)
