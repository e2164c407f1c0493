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

import ctypes
import errno
import fcntl
import functools
import logging
import mmap
import os
import resource
import socket
import time
from typing import Callable, Dict, List, Optional

from ...errors import NvmeofError
from ...nvme import cm as cmdata
from ..resources import BufferPool, PoolShare, ResourceLimits, registered_region
from .requests import RequestBook, TxRequest
from ..eventloop import EventLoop
from ..base import ConnectRequest, QueueHandler, ReadDone, RemoteAccessError, TargetQueue, TransportError

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
    from pyverbs.qp import QP, QPCap, QPEx, QPInitAttr, QPInitAttrEx
    from pyverbs.wr import SGE, RecvWR, SendWR
    PYVERBS_ERROR = None
except ImportError as exc:  # pragma: no cover - depends on the machine
    PYVERBS_ERROR = exc

ADMIN_CAPSULE = 64
RESPONSE_SIZE = 16
CM_TIMEOUT_MS = 3000
SEND_WR_BASE = 1 << 32  # wr_ids below this are receive slots
WRITE_WR_ID = SEND_WR_BASE + (1 << 31)  # target: the unsignaled data WRITEs (SEND_WR_BASE + n: request n)
# QP local ACK timeout exponent, at most (4.096 us << 19 = 2.1 s): what rdma_cm computes for RoCE here and what
# the Linux host asks for in its REQ, so the target retransmits no sooner than nvmet_rdma or the host do.
ACK_TIMEOUT = 19
POLL_BATCH = 32  # completions asked of one CQ.poll
CQ_BUDGET = 64  # completions one queue handles per loop pass before the others get their turn


class _CachedLoggers:
    """The logging module with getLogger cached: what `pyverbs.base` sees as `logging`.

    pyverbs 44 makes a logger for every object it creates (`PyverbsObject.__cinit__` calls logging.getLogger,
    which takes the logging lock): more than half of what a work completion costs (2.1 -> 0.9 µs per `WC` on
    the development host).  A logger is made once per name and lives for ever, so the cache hands out the very
    same objects."""

    def __init__(self, real):
        self._real = real
        self.getLogger = functools.lru_cache(maxsize=None)(real.getLogger)

    def __getattr__(self, name):
        return getattr(self._real, name)


def cache_pyverbs_loggers(base_module) -> bool:
    """Give `base_module` (pyverbs.base) the cached getLogger; False if it does not use the logging module."""
    if getattr(base_module, "logging", None) is not logging:
        return False
    base_module.logging = _CachedLoggers(logging)
    return True


if PYVERBS_ERROR is None:
    try:
        import pyverbs.base as _pyverbs_base
    except ImportError:  # the plain-Python stand-ins of benchmarks/fakeverbs.py have no base module
        _pyverbs_base = None
    if _pyverbs_base is not None:
        cache_pyverbs_loggers(_pyverbs_base)


# Bookworm's pyverbs 44 never frees an SGE, SendWR or RecvWR: their destructor is misnamed `__dealloc` (fixed
# upstream later), so such objects made per command leak.  The target's hot path makes none (RdmaTargetQueue).
WR_LEAKS = PYVERBS_ERROR is None and any(name.endswith("__dealloc") for name in dir(SendWR))


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

    def initiator_depth(self, event) -> Optional[int]:
        """The RDMA READs the peer lets us have in flight, from a CONNECT_REQUEST's `param.conn.initiator_depth`
        (rdma_cm_event: id, listen_id, event, status, then rdma_conn_param {private_data, private_data_len,
        responder_resources, initiator_depth, ...} at offset 24): rdma_cm's RTS attributes carry it on InfiniBand
        and RoCE, not on iWARP.  None when the layout was not verified (call `of` first)."""
        if self.offset is None or self.disabled:
            return None
        ev = self._ptr(id(event) + self.offset)
        return ctypes.c_uint8.from_address(ev + 34).value if ev else None

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


def cm_id_peer(cm_id: Optional[int]) -> str:
    """The host's "address:port" of a connection, from its `struct rdma_cm_id` (rdma_cma.h, public ABI):
    `verbs, channel, context, qp` then `route`, whose `addr` starts with two `sockaddr_storage` unions, source
    then destination, so the peer's sockaddr is at offset 32 + 128 = 160.  "" when the id or family is unknown
    (the per-address limits then do not apply to it, rather than lumping every host under one address)."""
    if not cm_id or cm_id < _MIN_POINTER:
        return ""
    sa = cm_id + 160
    family = ctypes.c_uint16.from_address(sa).value
    port = int.from_bytes(ctypes.string_at(sa + 2, 2), "big")
    if family == socket.AF_INET:
        return f"{socket.inet_ntop(socket.AF_INET, ctypes.string_at(sa + 4, 4))}:{port}"
    if family == socket.AF_INET6:
        return f"[{socket.inet_ntop(socket.AF_INET6, ctypes.string_at(sa + 8, 16))}]:{port}"
    return ""


# --- registered memory ---------------------------------------------------------------------

def register(pd, size: int, access: int, addr: int):
    """One MR over [addr, addr + size).  The device pins the pages against the locked-memory limit: siw counts
    them even for root (rxe and hardware drivers let CAP_IPC_LOCK through), so a low `ulimit -l` shows here."""
    try:
        return MR(pd, size, access, address=addr)
    except PyverbsRDMAError as exc:
        if getattr(exc, "error_code", None) not in (errno.ENOMEM, errno.EPERM, errno.EAGAIN):
            raise
        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft >> 10} KiB"
        raise NvmeofError(f"cannot register {size >> 10} KiB of memory with the RDMA device ({exc}); the "
                          f"locked-memory limit (ulimit -l) is {limit}",
                          "raise it: ulimit -l unlimited in the shell that starts the target, LimitMEMLOCK=infinity "
                          "in a systemd unit, '* - memlock unlimited' in /etc/security/limits.d/; or use fewer "
                          "--data-buffers") from exc


def is_iwarp(device_name: str, sysfs: str = "/sys") -> bool:
    """An iWARP RNIC (siw, Chelsio, Intel's irdma in iWARP mode): sysfs node_type "4: RNIC"."""
    try:
        with open(os.path.join(sysfs, "class/infiniband", device_name, "node_type")) as f:
            return f.read().split(":")[0].strip() == "4"
    except OSError:
        return False


def data_buffer_access(iwarp: bool) -> int:
    """Access rights of the target's data buffers, which are the sinks of its RDMA READs (a host's write data).
    On RoCE and InfiniBand a READ response lands in the sink by its lkey: local write is enough.  iWARP carries
    the response as tagged data addressed by the sink's rkey, so the sink must allow remote write (the kernel's
    rdma_rw does the same for iWARP); only then, for least exposure (docs/protocol.md §7.8)."""
    access = e.IBV_ACCESS_LOCAL_WRITE
    return access | e.IBV_ACCESS_REMOTE_WRITE if iwarp else access


class RegisteredMemory:
    """Page-aligned memory we own (a memoryview), registered as one MR."""

    def __init__(self, pd, size: int, access: int):
        self.size = max(size, mmap.PAGESIZE)
        self.map = mmap.mmap(-1, self.size)
        self.view = memoryview(self.map)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.mr = register(pd, self.size, access, self.addr)
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


class _MappedRegion:
    """A mapping owned by someone else (a RAM namespace), registered as one MR."""

    def __init__(self, pd, mapping: mmap.mmap, access: int):
        # the address only: the buffer export ends with the temporary ctypes object
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        self.mr = register(pd, len(mapping), access, self.addr)
        self.lkey = self.mr.lkey

    def close(self) -> None:
        if self.mr is not None:
            self.mr.close()
            self.mr = None


class DataPool:
    """Fixed-size data chunks carved from one registration made at start; `accounts` says who may take which."""

    def __init__(self, pd, chunk_size: int, chunks: int, min_per_queue: int, access: Optional[int] = None):
        self.chunk_size = chunk_size
        self.memory = RegisteredMemory(pd, chunk_size * chunks, e.IBV_ACCESS_LOCAL_WRITE if access is None else access)
        self.accounts = BufferPool(chunks, min_per_queue)

    def view(self, chunk: int, length: int) -> memoryview:
        start = chunk * self.chunk_size
        return self.memory.view[start:start + length]

    def addr(self, chunk: int) -> int:
        return self.memory.addr + chunk * self.chunk_size


class RdmaListener:
    """Listens on traddr:trsvcid and turns accepted connections into `RdmaTargetQueue`s."""

    def __init__(self, loop: EventLoop, traddr: str, trsvcid: int = 4420, *, handler: Optional[QueueHandler] = None,
                 port_id: int = 0, in_capsule_size: Optional[int] = None, max_transfer: int = 128 * 1024,
                 limits: Optional[ResourceLimits] = None, remote_invalidate: bool = True,
                 data_path: str = "python", poll_mode: str = "interrupt", poll_groups=None):
        require_pyverbs()
        self.data_path = data_path  # "native": I/O queues run the C data path (transport/rdma/native.py)
        self.poll_mode = poll_mode  # native queues: "interrupt" (completion channels) or "busy" (tunables.POLL)
        self.poll_groups = poll_groups  # pollgroups.PollGroups: threads poll the native queues (--cores)
        self.native_memory = None  # rdma_native.NativePortMemory, made with the first native queue
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
        self.iwarp = is_iwarp(self.listen_id.dev_name)
        self.pending_initiator_depth: Optional[int] = None  # of the CONNECT_REQUEST being handled
        self.pool = DataPool(self.pd, max_transfer, self.limits.data_buffers, self.limits.queue_min_buffers,
                             access=data_buffer_access(self.iwarp))
        self.regions: Dict[int, tuple] = {}  # id(mapping) -> (mapping, (addr, lkey) or None, its MR)
        loop.watch(self.cm_fd, self._on_cm_events)
        loop.listeners.append(self)
        log.info("listening on %s:%d (%s)", traddr, self.trsvcid, self.listen_id.dev_name)

    @property
    def device_name(self) -> str:
        return self.listen_id.dev_name

    def region(self, backend) -> Optional[tuple]:
        """(address, lkey) of a RAM namespace's memory, registered on first use (local access only: we only
        send from it), or None where it cannot be (then its reads are staged in a chunk).  Kept until the
        listener closes; a resized namespace's new memory is registered anew and the old registration kept
        (WRITEs already posted may still read it), so each resize pins the old size until then."""
        return registered_region(self.regions, backend, self._register_ram)

    def _register_ram(self, pin, mapping) -> tuple:
        try:
            mapping = pin()
            began = time.monotonic()
            # LOCAL_WRITE makes the registration take private pages, never the shared zero page of a
            # mapping not yet written (a later write would then leave the device sending the old page).
            memory = _MappedRegion(self.pd, mapping, e.IBV_ACCESS_LOCAL_WRITE)
            log.info("RAM namespace of %d MiB registered on %s:%d in %.0f ms: its reads are sent straight from it",
                     len(mapping) >> 20, self.traddr, self.trsvcid, (time.monotonic() - began) * 1000)
            return mapping, (memory.addr, memory.lkey), memory
        except Exception as exc:  # e.g. the locked-memory limit (ulimit -l)
            log.warning("cannot register a RAM namespace of %d bytes with the device (%s): its reads are copied "
                        "into data buffers instead", len(mapping) if mapping is not None else 0, exc)
            return mapping, None, None

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
                self.pending_initiator_depth = self.event_ids.initiator_depth(event)
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
                                 peer=cm_id_peer(id_ptr), port_id=self.port_id)
        refusal = self.handler.check_connect(request)
        if refusal is not None:
            self._reject(child, cmdata.REJECT_STATUS[refusal.value],
                         f"QID {parsed.qid} HSQSIZE {parsed.hsqsize} HRQSIZE {parsed.hrqsize}")
            return
        # Nothing but the receive and response rings is committed here: data buffers are guaranteed to a
        # queue only once its NVMe Connect succeeds (connected()), and the target closes a queue that does
        # not get there within its connect timeout.
        try:
            if self.data_path == "native" and parsed.qid and id_ptr and not self.iwarp:
                queue = self._native_queue(child, id_ptr, request)
            else:
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

    def _native_queue(self, child, id_ptr: int, request: ConnectRequest):
        from ... import native
        from .native import NativePortMemory, RdmaNativeQueue

        def memory_of(pd: int) -> NativePortMemory:
            if self.native_memory is None:
                self.native_memory = NativePortMemory(native.module, self, pd)
            elif self.native_memory.pd != pd:
                raise _AcceptRefused(cmdata.STS_NO_RESOURCES, "the CM id's protection domain changed")
            return self.native_memory
        return RdmaNativeQueue(native.module, self, child, id_ptr, request, memory_of)

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
        if self.native_memory is not None:  # before the listen id, whose device keeps librdmacm's PD
            self.native_memory.close()
            self.native_memory = None
        self.listen_id.close()
        self.pool.memory.close()
        for _mapping, _found, memory in self.regions.values():
            if memory is not None:
                memory.close()
        self.regions.clear()

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


class _AcceptRefused(Exception):
    def __init__(self, sts: int, message: str):
        super().__init__(message)
        self.sts = sts


class RdmaTargetQueue(TargetQueue):
    """One accepted NVMe queue: an RC QP with its CQ, receive slots and a `RequestBook` (transport/rdma/requests.py).

    The hot path makes no pyverbs object per command: work requests are built in the QP with the extended API
    (QPEx: wr_start, wr_rdma_read / wr_rdma_write + wr_set_sge on one reused SGE, wr_send / wr_send_inv +
    wr_set_inline_data, wr_complete), so bookworm's leaking SGE and SendWR destructors are never reached per
    command.  The response is inline (no response slot to keep); in one completion poll every receive is
    re-posted first and the responses then go out in one wr_start..wr_complete (one doorbell), data WRITEs
    unsignaled and chained before their SEND, SENDs signaled selectively (rdma_requests.py).
    Completions are polled with CQ.poll: pyverbs 44's extended CQ cannot be armed on a completion channel
    (no req_notify), and a target must sleep until work arrives.
    """

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
        self.to_repost: List[int] = []
        # The response is inline: the provider copies these 16 bytes at wr_set_inline_data.
        self.cqe_buf = ctypes.create_string_buffer(RESPONSE_SIZE)
        self.cqe_addr = ctypes.addressof(self.cqe_buf)
        self.sge = SGE(0, 0, 0)  # the one scatter entry every data work request is built from

        self.comp_channel, self.cq_fd = _create_with_fd(lambda: CompChannel(ctx), "infinibandevent")
        # Send queue: per command a READ, or a WRITE and a SEND.  Twice that, so that a whole queue's responses
        # in one poll leave it at least half free: their SENDs are then signaled selectively, not all
        # (RequestBook.flush signals every one once under a quarter is free).
        self.max_send_wr = 4 * self.depth + 8
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
                raise _AcceptRefused(cmdata.STS_NO_RESOURCES,
                                     f"the device cannot make an extended RC QP with {RESPONSE_SIZE} B inline: {exc}")
            # No extended QP API (siw): a plain RC QP with the same capabilities, posted through LegacyPoster.
            try:
                self.qp = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0))
            except PyverbsRDMAError as exc2:
                self._release_rings()
                raise _AcceptRefused(cmdata.STS_NO_RESOURCES,
                                     f"the device cannot make an RC QP with {RESPONSE_SIZE} B inline: {exc2}")
            self.poster = LegacyPoster(self.qp, self.max_send_wr)
        self.remote_invalidate = listener.remote_invalidate and getattr(self.poster, "can_invalidate", True)

        attr, mask = cm_id.init_qp_attr(e.IBV_QPS_INIT)
        self.qp.modify(attr, mask)
        for wr in self.recv_wrs:
            self.qp.post_recv(wr)
        attr, mask = cm_id.init_qp_attr(e.IBV_QPS_RTR)
        self.qp.modify(attr, mask)
        attr, mask = cm_id.init_qp_attr(e.IBV_QPS_RTS)
        # max_rd_atomic arrives as the host's responder resources: how many RDMA READs we may have in flight.
        # iWARP's CM leaves it 0 there: the connect request's initiator depth says it (as nvmet-rdma takes it).
        offered = attr.max_rd_atomic or (listener.pending_initiator_depth if listener.iwarp else 0) or 0
        self.max_reads = min(offered, listener.device.max_qp_init_rd_atom)
        if self.max_reads < 1:
            self._release_rings()
            raise _AcceptRefused(cmdata.STS_INVALID_IRD, "host offers no RDMA READ resources (responder_resources 0)")
        attr.max_rd_atomic = self.max_reads
        log.debug("queue %d RTS: local ack timeout %d, retry %d, rnr retry %d", request.qid, attr.timeout,
                  attr.retry_cnt, attr.rnr_retry)
        # rdma_cm's ACK timeout, as nvmet_rdma keeps it, bounded: 0 (infinite) would leave a work request to a
        # vanished host pending for ever.  A shorter one (14, 67 ms) retransmitted WRITEs the host had already
        # acknowledged whenever an emulated CPU delayed the ACK (docs/two-node.md, lossy link).
        if attr.timeout == 0 or attr.timeout > ACK_TIMEOUT:
            attr.timeout = ACK_TIMEOUT
        self.qp.modify(attr, mask)

        param = ConnParam(resources=0, depth=self.max_reads, flow_control=1, retry=7, rnr_retry=7,
                          qp_num=self.qp.qp_num, data_len=cmdata.ACCEPT_SIZE)
        param.set_private_data(cmdata.CmAccept(0, self.depth).pack())
        cm_id.accept(param)
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
            if _eagain(exc):
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
            self.close()

    def _on_failed_completion(self, wc) -> None:
        if wc.status != e.IBV_WC_WR_FLUSH_ERR:
            log.warning("queue %d: work completion failed: status %d (vendor error 0x%x): closing the queue",
                        self.qid, wc.status, wc.vendor_err)
        self.close(RemoteAccessError(f"RDMA READ failed with work completion status {wc.status}"))

    def _on_capsule(self, slot: int, length: int) -> None:
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
            self.close()

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
            return
        self.book.respond(tx, cqe, data, addr, key, invalidate_key, source, self.listener.region,
                          self.listener.max_transfer)

    def close(self, error: Optional[TransportError] = None) -> None:
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
