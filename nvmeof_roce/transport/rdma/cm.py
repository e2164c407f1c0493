"""The target's RDMA CM: `RdmaListener` accepts or rejects connections and turns accepted ones into queues.

The CM is the native module's (csrc/cm_channel.c, through transport/rdma/cmchannel.py): librdmacm's public API
only.  Each CONNECT_REQUEST arrives as plain data -- the child id's handle, the peer's address, the NVMe-oF
private data, the initiator depth -- and the listener decides accept or reject (with the NVMe-oF STS).  An
accepted queue is an `RdmaTargetQueue` (transport/rdma/queue.py), or on a listener whose data path is native an
I/O queue of transport/rdma/native.py.  The listener owns what its queues share: the device Context and PD (its
own, never the CM's: closing a child id breaks those, docs/protocol.md §7.3 item 4), the port's data buffers
(`DataPool`, transport/rdma/memory.py) and the registrations of RAM namespaces.

CM events of every child id arrive on the listener's one channel, each naming its id: a DISCONNECTED,
TIMEWAIT_EXIT, DEVICE_REMOVAL or ADDR_CHANGE closes its queue at once.  Every event is acked before Python sees
it, so a child id is destroyed as soon as its queue is closed or its connection rejected and the destroy never
waits (docs/protocol.md §7.3 item 3).  Connect requests from one address beyond --max-connecting-per-address,
counted while their queues await the NVMe Connect, are refused at once (the engine, engine/core.py).
"""
from __future__ import annotations

import logging
import time
from typing import Dict, Optional

from ...errors import NvmeofError
from ...output import address
from ...tunables import POLL_SPIN_US
from ...nvme import cm as cmdata
from ..contracts import Listener, QueueHandler, TransportError
from ..eventloop import EventLoop
from ..resources import ResourceLimits, registered_region
from .cmchannel import CmChannel, CmEvent, CmId
from .connect import RdmaConnectRequest, reject_status
from .memory import DataPool, MappedRegion, data_buffer_access
from .queue import AcceptRefused, RdmaTargetQueue
from .verbs import PYVERBS_ERROR, is_iwarp, require_pyverbs

if PYVERBS_ERROR is None:
    from .verbs import Context, PD, e

log = logging.getLogger(__name__)

# A child id's events that end its queue: the host went, or the device or address under it did.
ENDING = ("DISCONNECTED", "TIMEWAIT_EXIT", "DEVICE_REMOVAL", "ADDR_CHANGE")


class RdmaListener(Listener):
    """Listens on traddr:trsvcid and turns accepted connections into `RdmaTargetQueue`s."""

    def __init__(self, loop: EventLoop, traddr: str, trsvcid: int = 4420, *, handler: Optional[QueueHandler] = None,
                 port_id: int = 0, in_capsule_size: Optional[int] = None, max_transfer: int = 128 * 1024,
                 limits: Optional[ResourceLimits] = None, remote_invalidate: bool = True,
                 data_path: str = "python", poll_mode: str = "interrupt", poll_groups=None,
                 poll_spin_us: int = POLL_SPIN_US.default):
        require_pyverbs()
        self.data_path = data_path  # "native": I/O queues run the C data path (transport/rdma/native.py)
        self.poll_mode = poll_mode  # native queues: "interrupt" (completion channels) or "busy" (tunables.POLL)
        self.poll_groups = poll_groups  # pollgroups.PollGroups: threads poll the native queues (--cores)
        self.poll_spin_us = poll_spin_us  # "adaptive": µs a native queue polls after its last completion
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
        self.children: Dict[int, "RdmaTargetQueue"] = {}  # child id's handle -> its open queue
        self.cm_ids_created = 0  # child ids made from CONNECT_REQUESTs
        self.cm_ids_destroyed = 0
        self.disconnects_attributed = 0
        try:
            self.cm = CmChannel()
        except TransportError as exc:
            raise NvmeofError(f"cannot listen on {traddr}:{trsvcid}: {exc}",
                              "build the package with its native module (docs/native.md) and check "
                              "'nvmeof-roce rdma status'")
        self.cm_fd = self.cm.fd
        try:
            self.listen_id = self.cm.listen(traddr, self.trsvcid, 128)
        except (OSError, ValueError) as exc:
            self.cm.close()
            raise NvmeofError(f"cannot listen on {traddr}:{trsvcid}: {exc}",
                              "use an IP address of an RDMA netdev (not 0.0.0.0), check the port is free "
                              "(kernel nvmet may hold it: 'nvmeof-roce nvmet show') and 'nvmeof-roce rdma status'")
        # Our own Context/PD on the listener's device: CQs, QPs and MRs never use the CM's.
        self.dev_name = self.listen_id.dev_name
        self.context = Context(name=self.dev_name)
        self.pd = PD(self.context)
        self.device = self.context.query_device()
        self.iwarp = is_iwarp(self.dev_name)
        self.pending_initiator_depth: Optional[int] = None  # of the CONNECT_REQUEST being handled
        self.pool = DataPool(self.pd, max_transfer, self.limits.data_buffers, self.limits.queue_min_buffers,
                             access=data_buffer_access(self.iwarp))
        self.regions: Dict[int, tuple] = {}  # id(backend) -> (backend, mapping, (addr, lkey) or None, its MR)
        loop.watch(self.cm_fd, self._on_cm_events)
        loop.listeners.append(self)
        log.info("listening on %s:%d (%s)", traddr, self.trsvcid, self.dev_name)

    @property
    def device_name(self) -> str:
        return self.dev_name

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
        for event in self.cm.events():  # each already acked (docs/protocol.md §7.3 item 3)
            if event.name == "CONNECT_REQUEST":
                self.cm_ids_created += 1
                self._on_connect_request(CmId(self.cm, event.id), event)
                continue
            if event.id == self.listen_id.handle:
                if event.name in ("DEVICE_REMOVAL", "ADDR_CHANGE"):
                    log.warning("%s:%d: CM %s on the listening id: new connections may not arrive here any more "
                                "(check 'nvmeof-roce rdma status', then restart the target or re-add the port)",
                                self.traddr, self.trsvcid, event.name)
                continue
            queue = self.children.get(event.id)
            log.debug("CM event %s on %s:%d (queue %s)", event.name, self.traddr, self.trsvcid,
                      queue.qid if queue is not None else "?")
            if queue is not None and event.name in ENDING:
                # The peer disconnected (or its CM gave up on it, or the device or address went): release the
                # queue now, not at keep-alive expiry.
                self.disconnects_attributed += 1
                log.info("queue %d (%s): host disconnected (CM %s)", queue.qid, queue.request.peer, event.name)
                queue.peer_gone = True
                queue.close()

    def _reject(self, child: CmId, sts: int, why: str) -> None:
        log.warning("rejecting a connection on %s:%d: %s (STS %d, %s)", self.traddr, self.trsvcid, why, sts,
                    cmdata.sts_name(sts))
        try:
            child.reject(cmdata.CmReject(0, sts).pack())
        except OSError as exc:
            log.warning("reject failed: %s", exc)
        self._destroy_id(child)

    def _destroy_id(self, cm_id: CmId) -> None:
        """Destroy a child id: its events are all acked by now, so this never waits (docs/protocol.md §7.3 item 3).  Our
        QPs, CQs and MRs live on our own Context and PD, which a child close cannot break (docs/protocol.md §7.3 item 4)."""
        try:
            cm_id.close()
            self.cm_ids_destroyed += 1
        except Exception as exc:
            log.warning("destroying a CM id failed: %s", exc)

    def _on_connect_request(self, child: CmId, event: CmEvent) -> None:
        self.pending_initiator_depth = event.initiator_depth
        try:
            parsed = cmdata.CmConnectRequest.unpack(event.private_data)
        except cmdata.PrivateDataError as exc:
            self._reject(child, exc.sts, str(exc))
            return
        request = RdmaConnectRequest(qid=parsed.qid, recfmt=parsed.recfmt, hrqsize=parsed.hrqsize,
                                     hsqsize=parsed.hsqsize, cntlid=parsed.cntlid, peer=event.peer,
                                     port_id=self.port_id)
        refusal = self.handler.check_connect(request)
        if refusal is not None:
            self._reject(child, reject_status(refusal),
                         f"QID {parsed.qid} HSQSIZE {parsed.hsqsize} HRQSIZE {parsed.hrqsize}")
            return
        # Nothing but the receive and response rings is committed here: data buffers are guaranteed to a
        # queue only once its NVMe Connect succeeds (connected()), and the target closes a queue that does
        # not get there within its connect timeout.
        try:
            if self.data_path == "native" and parsed.qid and not self.iwarp:
                queue = self._native_queue(child, request)
            else:
                queue = RdmaTargetQueue(self, child, request)
        except AcceptRefused as exc:
            self._reject(child, exc.sts, str(exc))
            return
        except Exception as exc:
            log.exception("setting up queue %d failed", parsed.qid)
            self._reject(child, cmdata.STS_NO_RESOURCES, f"queue setup failed: {exc}")
            return
        queue.cm_handle = child.handle
        self.queues[queue.cq_fd] = queue
        self.children[child.handle] = queue
        self.handler.queue_opened(queue)

    def _native_queue(self, child: CmId, request: RdmaConnectRequest):
        from ... import native
        from .native import NativePortMemory, RdmaNativeQueue

        def memory_of(pd: int) -> NativePortMemory:
            if self.native_memory is None:
                self.native_memory = NativePortMemory(native.module, self, pd)
            elif self.native_memory.pd != pd:
                raise AcceptRefused(cmdata.STS_NO_RESOURCES, "the CM id's protection domain changed")
            return self.native_memory
        return RdmaNativeQueue(native.module, self, child, request, memory_of)

    def forget(self, queue: "RdmaTargetQueue") -> None:
        self.queues.pop(queue.cq_fd, None)
        if queue.cm_handle:
            self.children.pop(queue.cm_handle, None)
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
        # Connect requests still pending are refused with a status, not left to time out.
        for event in self.cm.events():
            if event.name == "CONNECT_REQUEST":
                self.cm_ids_created += 1
                self._reject(CmId(self.cm, event.id), cmdata.STS_NO_RESOURCES, "target shutting down")
        if self.native_memory is not None:  # before the listen id, whose device keeps librdmacm's PD
            self.native_memory.close()
            self.native_memory = None
        self.cm.close()  # the listening id, then the channel
        self.pool.memory.close()
        for _backend, _mapping, _found, memory in self.regions.values():
            if memory is not None:
                memory.close()
        self.regions.clear()
