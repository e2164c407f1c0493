"""The target's RDMA CM: `RdmaListener` accepts or rejects connections and turns accepted ones into queues.

Each CONNECT_REQUEST carries the NVMe-oF private data; the handler decides accept or reject (with the NVMe-oF
STS).  An accepted queue is an `RdmaTargetQueue` (transport/rdma/queue.py), or on a listener whose data path is
native an I/O queue of transport/rdma/native.py.  The listener owns what its queues share: the device Context and
PD (its own, never the CM's: closing a child id breaks those, docs/protocol.md §7.3 item 4), the port's data
buffers (`DataPool`, transport/rdma/memory.py) and the registrations of RAM namespaces.

CM events of every child id arrive on the listener's one channel.  pyverbs 44
does not say which child an event is for, so `_CmEventIds` reads the
`rdma_cm_event.id` pointer out of the pyverbs CMEvent object with ctypes (the
layout is verified at first use against the channel's fd): a DISCONNECTED closes
its queue at once.  A child id is destroyed as soon as its queue is closed or its
connection rejected (every event is acked before it is acted on, so the destroy
never waits, docs/protocol.md §7.3 item 3).
"""
from __future__ import annotations

import ctypes
import logging
import socket
import time
from typing import Dict, Optional

from ...errors import NvmeofError
from ...output import address
from ...nvme import cm as cmdata
from ..base import ConnectRequest, Listener, QueueHandler
from ..eventloop import EventLoop
from ..resources import ResourceLimits, registered_region
from .memory import DataPool, MappedRegion, data_buffer_access
from .queue import AcceptRefused, RdmaTargetQueue
from .verbs import MIN_POINTER, PYVERBS_ERROR, create_with_fd, eagain, is_iwarp, require_pyverbs

if PYVERBS_ERROR is None:
    from .verbs import AddrInfo, CMEvent, CMEventChannel, CMID, Context, PD, PyverbsRDMAError, ce, e

log = logging.getLogger(__name__)


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
        if ev < MIN_POINTER or ev % 8:
            return 0
        if ctypes.c_int.from_address(ev + 16).value != event.event_type:
            return 0
        cm_id = self._ptr(ev)
        if cm_id < MIN_POINTER or cm_id % 8:
            return 0
        channel = self._ptr(cm_id + 8)
        if channel < MIN_POINTER or channel % 4 or ctypes.c_int.from_address(channel).value != self.channel_fd:
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
    if not cm_id or cm_id < MIN_POINTER:
        return ""
    sa = cm_id + 160
    family = ctypes.c_uint16.from_address(sa).value
    port = int.from_bytes(ctypes.string_at(sa + 2, 2), "big")
    if family == socket.AF_INET:
        return f"{socket.inet_ntop(socket.AF_INET, ctypes.string_at(sa + 4, 4))}:{port}"
    if family == socket.AF_INET6:
        return f"[{socket.inet_ntop(socket.AF_INET6, ctypes.string_at(sa + 8, 16))}]:{port}"
    return ""


class RdmaListener(Listener):
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
        self.channel, self.cm_fd = create_with_fd(CMEventChannel, "rdma_cm")
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
        self.regions: Dict[int, tuple] = {}  # id(backend) -> (backend, mapping, (addr, lkey) or None, its MR)
        loop.watch(self.cm_fd, self._on_cm_events)
        loop.listeners.append(self)
        log.info("listening on %s:%d (%s)", traddr, self.trsvcid, self.listen_id.dev_name)

    @property
    def device_name(self) -> str:
        return self.listen_id.dev_name

    def region(self, backend) -> Optional[tuple]:
        """(address, lkey) of a RAM namespace's memory, registered on first use (local access only: we only
        send from it), or None where it cannot be (then its reads are staged in a chunk).  A resized namespace's
        new memory is registered anew and the old registration released (its commands drained before the resize:
        resources.registered_region)."""
        return registered_region(self.regions, backend, self._register_ram,
                                 lambda memory: memory is not None and memory.close())

    def _register_ram(self, pin, mapping) -> tuple:
        try:
            mapping = pin()
            began = time.monotonic()
            # LOCAL_WRITE makes the registration take private pages, never the shared zero page of a
            # mapping not yet written (a later write would then leave the device sending the old page).
            memory = MappedRegion(self.pd, mapping, e.IBV_ACCESS_LOCAL_WRITE)
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
                if eagain(exc):
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
        except AcceptRefused as exc:
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
                raise AcceptRefused(cmdata.STS_NO_RESOURCES, "the CM id's protection domain changed")
            return self.native_memory
        return RdmaNativeQueue(native.module, self, child, id_ptr, request, memory_of)

    def forget(self, queue: "RdmaTargetQueue") -> None:
        self.queues.pop(queue.cq_fd, None)
        if queue.id_ptr:
            self.children.pop(queue.id_ptr, None)
        self._destroy_id(queue.cm_id)

    def status(self) -> dict:
        return {"address": address(self.traddr, self.trsvcid), "portid": self.port_id, "queues": len(self.queues),
                "wc_errors": None,  # not counted
                "pool": self.pool.accounts.figures()}

    def status_line(self) -> str:
        """One line of figures for `target serve`'s status log."""
        connected = sum(1 for q in self.queues.values() if q.share.guaranteed)
        return (f"{address(self.traddr, self.trsvcid)}: {len(self.queues)} queues ({connected} connected), "
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
        for _backend, _mapping, _found, memory in self.regions.values():
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
