"""An in-process fabric with RDMA's rules, for tests and demos without RDMA hardware.

Everything is single-threaded: the target's data transfers and completions, and
the delivery of capsules, are queued as operations on the `LoopbackFabric` and
run when it is pumped (a host `poll()` pumps it).  So many commands can be
outstanding and the target sees the same asynchronous pattern as on RDMA:
`read_host` completes later, `respond` reaches the host later.

RDMA rules it enforces (docs/protocol.md §2.3, §3):
  - host memory is reachable only through registered regions, by key, within
    bounds and with the right access; anything else is a `RemoteAccessError`
    and, as on RDMA, puts the connection in the error state (both ends torn down);
  - a capsule larger than the target's receive buffer (64 bytes on the admin
    queue, 64 + in_capsule_size on I/O queues) is fatal (local length error);
  - a response must be exactly 16 bytes (the host's receive buffers are 16 bytes);
  - the host may have at most HSQSIZE + 1 commands outstanding;
  - responses beyond the host's HRQSIZE posted receives wait (RNR retry) until
    the host polls;
  - SEND with Invalidate of a plain registered region is fatal (it is not an
    FRWR key), exactly as rxe does.

Usage::

    fabric = LoopbackFabric(clock=FakeClock())
    fabric.listen("10.0.0.1:4420", target)          # any base.QueueHandler
    ctrl = Controller.connect(fabric.connector("10.0.0.1:4420"), subnqn)
"""
from __future__ import annotations

import logging
import select
import time
from collections import deque
from typing import Callable, Dict, List, Optional

from ..nvme.cm import CmConnectRequest, PrivateDataError
from ..nvme.command import SQE_SIZE
from .resources import BufferPool
from .contracts import (ConnectRejected, Connector, HostBuffer, HostQueue, ListenOptions, Listener, QueueHandler,
                        RemoteAccessError, TargetQueue, TransportError, TransportOps)
from .rdma.connect import RdmaConnectRequest, check_cm_request, reject_status
from .rdma.sgl import keyed_or_in_capsule_sgls, map_keyed_or_in_capsule

log = logging.getLogger(__name__)

CQE_SIZE = 16
DEFAULT_IN_CAPSULE_SIZE = 4096
TICK_INTERVAL = 0.1

ACCESS_REMOTE_READ = 1
ACCESS_REMOTE_WRITE = 2


class SendQueueFull(TransportError):
    """The host tried to exceed HSQSIZE + 1 outstanding commands (the queue stays usable)."""


class FakeClock:
    """A clock tests advance by hand (for keep-alive expiry)."""

    def __init__(self, start: float = 1000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class _Region:
    __slots__ = ("addr", "key", "buf", "access", "valid", "invalidatable")

    def __init__(self, addr: int, key: int, size: int, access: int, invalidatable: bool = False):
        self.addr = addr
        self.key = key
        self.buf = bytearray(size)
        self.access = access
        self.valid = True
        self.invalidatable = invalidatable  # a fast-registration (FRWR) key, as the Linux host uses


class _ProtectionDomain:
    """The host's registered memory: shared by all queues of one connector (like one PD)."""

    _next_pd = 0

    def __init__(self, fabric: "LoopbackFabric"):
        _ProtectionDomain._next_pd += 1
        self._fabric = fabric
        self._regions: Dict[int, _Region] = {}
        self._next_addr = 0x7F00_0000_0000 + (_ProtectionDomain._next_pd << 36)

    def register(self, size: int, access: int, invalidatable: bool = False) -> _Region:
        if size <= 0:
            raise ValueError("cannot register an empty region")
        region = _Region(self._next_addr, self._fabric._new_key(), size, access, invalidatable)
        self._next_addr += (size + 0xFFFF) & ~0xFFF  # page aligned, with a gap between regions
        self._regions[region.key] = region
        return region

    def deregister(self, key: int) -> None:
        region = self._regions.pop(key, None)
        if region is not None:
            region.valid = False

    def resolve(self, addr: int, key: int, length: int, access: int) -> memoryview:
        """The bytes behind (addr, key, length), or RemoteAccessError."""
        region = self._regions.get(key)
        if region is None or not region.valid:
            raise RemoteAccessError(f"remote access error: unknown key {key:#x}")
        if not region.access & access:
            right = "read" if access == ACCESS_REMOTE_READ else "write"
            raise RemoteAccessError(f"remote access error: key {key:#x} has no remote {right} right")
        start = addr - region.addr
        if start < 0 or length < 0 or start + length > len(region.buf):
            raise RemoteAccessError(f"remote access error: {addr:#x}+{length} is outside key {key:#x} "
                                    f"({region.addr:#x}+{len(region.buf)})")
        return memoryview(region.buf)[start:start + length]


class _Connection:
    """One queue: the two ends and the connection state."""

    def __init__(self, fabric: "LoopbackFabric", listener: "LoopbackListener", pd: _ProtectionDomain,
                 request: RdmaConnectRequest):
        self.fabric = fabric
        self.listener = listener
        self.pd = pd
        self.request = request
        self.state = "open"  # open -> closing -> closed
        self.error: Optional[str] = None
        self.target = LoopbackTargetQueue(self)
        self.host = LoopbackHostQueue(self)
        self._closed_reported = False

    @property
    def usable(self) -> bool:
        return self.state == "open"

    def fail(self, reason: str) -> None:
        """A fatal transport error: both ends go down now (pending work is flushed)."""
        if self.state == "closed":
            return
        log.debug("loopback queue %d: %s", self.request.qid, reason)
        self.error = self.error or reason
        self.state = "closed"
        self.fabric._post(self._report_closed)

    def disconnect(self, by: str) -> None:
        """An orderly disconnect: work already queued still runs, then both ends close."""
        if self.state != "open":
            return
        self.state = "closing"

        def finish():
            if self.state != "closed":
                self.state = "closed"
                self.error = self.error or f"disconnected by the {by}"
                self._report_closed()

        self.fabric._post(finish)

    def _report_closed(self) -> None:
        if not self._closed_reported:
            self._closed_reported = True
            self.listener.connections.discard(self)
            if self.target.share is not None:
                self.target.share.close()
            self.listener.handler.queue_closed(self.target)


class LoopbackTargetQueue(TargetQueue):
    trtype = "loopback"

    def __init__(self, conn: _Connection):
        self._conn = conn
        self.request = conn.request
        self.in_capsule_size = conn.listener.in_capsule_size if conn.request.qid else 0
        self.local_address = conn.listener.traddr
        self.transport = "loopback"
        pool = conn.listener.pool  # accounting only: loopback transfers need no registered buffers
        self.share = pool.share() if pool is not None else None

    def connected(self) -> bool:
        return self.share.commit() if self.share is not None else True

    def guarantee_capacity(self) -> Optional[int]:
        return self.share.pool.guarantee_capacity() if self.share is not None else None

    @property
    def receive_size(self) -> int:
        return SQE_SIZE + self.in_capsule_size

    def read_host(self, addr: int, key: int, length: int, done, tx=None) -> None:
        conn = self._conn
        if conn.state == "closed":
            return  # flushed: a dead QP completes nothing useful

        def op():
            if conn.state == "closed":
                return
            try:
                data = conn.pd.resolve(addr, key, length, ACCESS_REMOTE_READ) if length else memoryview(b"")
            except RemoteAccessError as exc:
                conn.fail(str(exc))
                done(None, exc)
                return
            done(memoryview(bytes(data)), None)  # a copy: the host may reuse its buffer afterwards

        conn.fabric._post(op)

    def write_host(self, addr: int, key: int, data) -> None:
        conn = self._conn
        if conn.state == "closed":
            return
        payload = bytes(data)  # the data is consumed now; the caller may reuse its buffer

        def op():
            if conn.state == "closed":
                return
            try:
                dest = conn.pd.resolve(addr, key, len(payload), ACCESS_REMOTE_WRITE) if payload else None
            except RemoteAccessError as exc:
                conn.fail(str(exc))
                return
            if dest is not None:
                dest[:] = payload

        conn.fabric._post(op)

    def respond(self, cqe: bytes, invalidate_key: Optional[int] = None) -> None:
        conn = self._conn
        if conn.state == "closed":
            return
        cqe = bytes(cqe)

        def op():
            if conn.state == "closed":
                return
            if len(cqe) != CQE_SIZE:
                conn.fail(f"response of {len(cqe)} bytes into a 16-byte receive buffer")
                return
            if invalidate_key is not None:
                # Only fast-registration keys can be invalidated remotely; a plain registration
                # (ibv_reg_mr) fails the receive and the connection, as rxe does (docs/protocol.md §3.2).
                region = conn.pd._regions.get(invalidate_key)
                if region is None or not region.valid or not region.invalidatable:
                    conn.fail(f"SEND with Invalidate of key {invalidate_key:#x}, which is not an FRWR key")
                    return
                region.valid = False
            conn.host._deliver(cqe)

        conn.fabric._post(op)

    def complete(self, cqe: bytes, data=None, addr: int = 0, key: int = 0, invalidate_key: Optional[int] = None,
                 tx=None, source=None) -> None:
        if data is not None and len(data):
            self.write_host(addr, key, data)  # copied now
        if source is not None and source[2] is not None:
            source[2].put()  # nothing reads the namespace's memory after this call
        self.respond(cqe, invalidate_key)

    def close(self) -> None:
        self._conn.disconnect("target")

    @property
    def closed(self) -> bool:
        return self._conn.state != "open"


class LoopbackHostQueue(HostQueue):
    def __init__(self, conn: _Connection):
        self._conn = conn
        self.qid = conn.request.qid
        self.crqsize = conn.request.hsqsize + 1  # nvmet's answer
        self._cqes: deque = deque()
        self._rnr_backlog: deque = deque()  # responses waiting for a posted receive
        self._outstanding = 0

    @property
    def depth(self) -> int:
        return self._conn.request.hsqsize + 1

    @property
    def waiting(self) -> int:
        """Completions received and not yet polled (looking does not pump the fabric)."""
        return len(self._cqes) + len(self._rnr_backlog)

    @property
    def error(self) -> Optional[str]:
        return self._conn.error

    @property
    def closed(self) -> bool:
        return self._conn.state != "open"

    def register(self, size: int) -> HostBuffer:
        return self.register_with_access(size)

    def register_with_access(self, size: int, remote_read: bool = True, remote_write: bool = True,
                             invalidatable: bool = False) -> HostBuffer:
        """Loopback extra: register with only some remote access rights (to test the target's errors), or
        as an FRWR-like key that the target may invalidate with its response."""
        access = (ACCESS_REMOTE_READ if remote_read else 0) | (ACCESS_REMOTE_WRITE if remote_write else 0)
        region = self._conn.pd.register(size, access, invalidatable)
        return HostBuffer(region.addr, region.key, memoryview(region.buf))

    def deregister(self, buf: HostBuffer) -> None:
        self._conn.pd.deregister(buf.key)

    def send(self, capsule: bytes) -> None:
        conn = self._conn
        if conn.state != "open":
            raise TransportError(f"queue {self.qid} is disconnected: {conn.error or 'closed'}")
        if self._outstanding >= self.depth:
            raise SendQueueFull(f"queue {self.qid}: {self._outstanding} commands outstanding, "
                                f"the queue holds {self.depth}")
        self._outstanding += 1
        capsule = bytes(capsule)
        tq = conn.target

        def op():
            if conn.state == "closed":
                return
            if len(capsule) > tq.receive_size:
                conn.fail(f"capsule of {len(capsule)} bytes into a {tq.receive_size}-byte receive buffer "
                          "(local length error)")
                return
            conn.listener.handler.capsule_received(tq, memoryview(capsule))

        conn.fabric._post(op)

    def _deliver(self, cqe: bytes) -> None:
        if len(self._cqes) >= self._conn.request.hrqsize:
            self._rnr_backlog.append(cqe)
        else:
            self._cqes.append(cqe)

    def poll(self, timeout: float = 0.0) -> List[bytes]:
        fabric = self._conn.fabric
        fabric.pump()
        if not self._cqes and timeout > 0 and fabric.run_watched(timeout):
            fabric.pump()  # a worker thread finished something meanwhile
        out = list(self._cqes)
        self._cqes.clear()
        while self._rnr_backlog and len(self._cqes) < self._conn.request.hrqsize:
            self._cqes.append(self._rnr_backlog.popleft())
        self._outstanding = max(0, self._outstanding - len(out))
        if not out and self._conn.state == "closed":
            raise TransportError(f"queue {self.qid} is disconnected: {self._conn.error or 'closed'}")
        return out

    def close(self) -> None:
        self._conn.disconnect("host")
        self._conn.fabric.pump()


class LoopbackListener(Listener):
    def __init__(self, fabric: "LoopbackFabric", address: str, handler: QueueHandler, in_capsule_size: int,
                 pool: Optional[BufferPool] = None, port_id: Optional[int] = None):
        self.fabric = fabric
        self.pool = pool
        self.address = address
        self.port_id = port_id
        self.traddr = address.rsplit(":", 1)[0].strip("[]")
        self.trsvcid = address.rsplit(":", 1)[1] if ":" in address else ""
        self.handler = handler
        self.in_capsule_size = in_capsule_size
        self.connections = set()

    def status(self) -> dict:
        d = {"address": self.address, "portid": self.port_id, "queues": len(self.connections), "wc_errors": None}
        if self.pool is not None:
            d["pool"] = self.pool.figures()
        return d

    def close(self) -> None:
        for conn in list(self.connections):
            conn.fail("listener closed")
        self.fabric._listeners.pop(self.address, None)
        self.fabric.pump()


class LoopbackConnector(Connector):
    """Opens queues to one listener address; all its queues share one protection domain."""

    _next_port = 40000

    def __init__(self, fabric: "LoopbackFabric", address: str):
        self.fabric = fabric
        self.address = address
        self.pd = _ProtectionDomain(fabric)
        LoopbackConnector._next_port += 1
        self.peer = f"192.0.2.{LoopbackConnector._next_port % 250 + 1}:{LoopbackConnector._next_port}"

    def connect(self, qid: int, hrqsize: int, hsqsize: int, cntlid: int = 0) -> LoopbackHostQueue:
        return self._establish(RdmaConnectRequest(qid=qid, hrqsize=hrqsize, hsqsize=hsqsize, cntlid=cntlid,
                                                  peer=self.peer, trtype="loopback"))

    def connect_raw(self, private_data: bytes) -> LoopbackHostQueue:
        """Loopback extra: connect with arbitrary CM private data (parsed as the RDMA transport does)."""
        try:
            req = CmConnectRequest.unpack(private_data)
        except PrivateDataError as exc:
            raise ConnectRejected(exc.sts, f"connection rejected: {exc}") from None
        return self._establish(RdmaConnectRequest(recfmt=req.recfmt, qid=req.qid, hrqsize=req.hrqsize,
                                                  hsqsize=req.hsqsize, cntlid=req.cntlid, peer=self.peer,
                                                  trtype="loopback"))

    def _establish(self, request: RdmaConnectRequest) -> LoopbackHostQueue:
        listener = self.fabric._listeners.get(self.address)
        if listener is None:
            raise TransportError(f"{self.address}: no listener (connection refused)")
        refusal = listener.handler.check_connect(request)
        if refusal is not None:  # worded as the RDMA CM would (the rules loopback keeps)
            raise ConnectRejected(reject_status(refusal))
        conn = _Connection(self.fabric, listener, self.pd, request)
        listener.connections.add(conn)
        listener.handler.queue_opened(conn.target)
        return conn.host


class LoopbackFabric:
    """The in-process network: listeners by address, and the queue of pending operations."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, tick_interval: float = TICK_INTERVAL):
        self.clock = clock
        self.tick_interval = tick_interval
        self._ops: deque = deque()
        self._listeners: Dict[str, LoopbackListener] = {}
        self._next_key = 0x1000
        self._pumping = False
        self._last_tick = clock()
        self.ops_run = 0
        self._watched: Dict[int, Callable[[], None]] = {}  # fd -> callback, like EventLoop.watch
        # contracts.Loop: pumped by its hosts, it does not time passes
        self.longest_pass = self.longest_pass_recent = None

    @property
    def listeners(self) -> List[LoopbackListener]:
        return list(self._listeners.values())

    def _new_key(self) -> int:
        self._next_key = (self._next_key + 0x1F3) & 0xFFFFFFFF  # keys that are not simply 1, 2, 3
        return self._next_key

    def _post(self, op: Callable[[], None]) -> None:
        self._ops.append(op)

    def listen(self, address: str, handler: QueueHandler, in_capsule_size: Optional[int] = None,
               pool: Optional[BufferPool] = None, port_id: Optional[int] = None) -> LoopbackListener:
        """Accept queues at `address` ("traddr:trsvcid").  The I/O receive buffers hold 64 +
        in_capsule_size bytes; by default the handler's `in_capsule_size` attribute, else 4096.
        `pool`: account data-buffer guarantees as the RDMA transport does (transport/resources.py).
        `port_id`: the config port it serves, for its status."""
        if address in self._listeners:
            raise TransportError(f"{address}: address already in use")
        if in_capsule_size is None:
            in_capsule_size = getattr(handler, "in_capsule_size", DEFAULT_IN_CAPSULE_SIZE)
        listener = LoopbackListener(self, address, handler, in_capsule_size, pool, port_id)
        self._listeners[address] = listener
        return listener

    def connector(self, address: str) -> LoopbackConnector:
        return LoopbackConnector(self, address)

    @property
    def idle(self) -> bool:
        return not self._ops

    def watch(self, fd: int, callback: Callable[[], None]) -> None:
        """Call `callback` when `fd` is readable (checked whenever the fabric is pumped), as the RDMA
        EventLoop does: the target's worker thread reports through such an fd."""
        self._watched[fd] = callback

    def unwatch(self, fd: int) -> None:
        self._watched.pop(fd, None)

    def run_watched(self, timeout: float = 0.0) -> int:
        """One pass over the watched fds: run the callbacks of the readable ones (waiting up to
        `timeout` for one); the number run."""
        if not self._watched:
            return 0
        ready, _, _ = select.select(list(self._watched), [], [], timeout)
        for fd in ready:
            callback = self._watched.get(fd)
            if callback is not None:
                callback()
        return len(ready)

    def pump(self, max_ops: Optional[int] = None, watched: bool = True) -> int:
        """Run queued operations until none are left (or `max_ops`); tick the handlers on time.
        Without `max_ops` (and unless `watched` is False), readable watched fds are served too, in
        passes between the operations, until neither has anything left."""
        if self._pumping:  # called from inside an operation: the outer loop will get to it
            return 0
        self._pumping = True
        ran = 0
        try:
            while True:
                while self._ops and (max_ops is None or ran < max_ops):
                    self._ops.popleft()()
                    ran += 1
                if max_ops is not None or not watched or not self.run_watched(0):
                    break
            self.ops_run += ran
        finally:
            self._pumping = False
        self._maybe_tick()
        return ran

    def _maybe_tick(self) -> None:
        now = self.clock()
        if now - self._last_tick >= self.tick_interval:
            self.tick()

    def tick(self) -> None:
        """Call every handler's tick(now) once, then run what that queued."""
        now = self.clock()
        self._last_tick = now
        seen = set()
        for listener in list(self._listeners.values()):
            if id(listener.handler) not in seen:
                seen.add(id(listener.handler))
                listener.handler.tick(now)
        if self._ops and not self._pumping:
            self.pump()


def _loop(handler) -> LoopbackFabric:
    return LoopbackFabric()


def _listen(loop: LoopbackFabric, port, handler, options: ListenOptions) -> LoopbackListener:
    limits = options.limits
    pool = BufferPool(limits.data_buffers, limits.queue_min_buffers) if limits is not None else None
    return loop.listen(f"{port.traddr}:{port.trsvcid}", handler, pool=pool, port_id=port.portid)


# Its entry in transport/registry.py: RDMA's SGL kinds and connect rules, its own loop (pumped, not run).
LOOPBACK = TransportOps(
    trtype="loopback", description="in-process fabric with RDMA's rules (unit tests, demos)",
    sgls=keyed_or_in_capsule_sgls, map_sgl=map_keyed_or_in_capsule, check_request=check_cm_request,
    reject_status=reject_status, event_loop=_loop, listen=_listen, served_by_target=False)
