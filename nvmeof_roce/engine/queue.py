"""The target's view of one queue, and its lifecycle:

    CONNECTING  the transport accepted the connection; the NVMe Connect is awaited (closed after the connect
                timeout, ResourceLimits.connect_timeout)
    LIVE        its Connect succeeded: it belongs to a controller (commands are then gated by the controller's
                CSTS.RDY, engine/controller.py, and by DH-HMAC-CHAP until authenticated, engine/auth.py QueueAuth)
    REFUSED     its Connect failed: it stays open a moment so the host receives the status, then closes (a
                Connect retried meanwhile may still succeed: LIVE)
    CLOSED      closed by the target (Disconnect, controller deleted, a fatal error) or by the transport

Every change goes through `QueueState.enter`, which raises on an edge the lifecycle does not have.
"""
from __future__ import annotations

import enum
from typing import List, Optional

from ..nvme.fabrics import ADMIN_QUEUE_DEPTH
from ..transport import registry
from ..transport.lifecycle import FREE, NEXT, IllegalTransition, move
from .request import Request


class QueueLifecycle(enum.Enum):
    CONNECTING = "connecting"
    LIVE = "live"
    REFUSED = "refused"
    CLOSED = "closed"


# For each state, the states a queue may enter it from.
ALLOWED_FROM = {
    QueueLifecycle.CONNECTING: set(),
    QueueLifecycle.LIVE: {QueueLifecycle.CONNECTING, QueueLifecycle.REFUSED},
    QueueLifecycle.REFUSED: {QueueLifecycle.CONNECTING},
    QueueLifecycle.CLOSED: {QueueLifecycle.CONNECTING, QueueLifecycle.LIVE, QueueLifecycle.REFUSED},
}


class IllegalQueueTransition(RuntimeError):
    """A queue was moved along no edge of its lifecycle."""


def max_queue_entries(port, qid: int) -> int:
    """The most entries a queue may have on `port` (engine/core.py PortContext) until its Connect says: the admin
    queue's fixed depth, an I/O queue's MQES + 1.  A transport checks a size its connection asks for against it."""
    return ADMIN_QUEUE_DEPTH if qid == 0 else port.mqes + 1


class QueueState:
    """The target's view of one queue: its transport end, its controller once connected, its requests."""

    __slots__ = ("transport", "qid", "port", "target", "ctrl", "sqsize", "sqhd", "sqflow_disabled", "depth",
                 "free", "active", "state", "closed", "in_capsule_size", "auth", "ops", "map_sgl", "requests")

    def __init__(self, transport, port, target):
        self.transport = transport
        request = transport.request
        self.qid = request.qid
        self.port = port
        self.target = target
        self.ctrl = None
        # Until the Connect gives SQSIZE (install), the most the port allows; the transport bounds what its
        # host can send meanwhile (RDMA: the receives it posted for the CM's HSQSIZE).
        self.depth = max_queue_entries(port, self.qid)
        self.sqsize = self.depth - 1
        self.sqhd = 0
        self.sqflow_disabled = False
        self.free: List[Request] = [Request(self, target)]  # the Connect's; install() adds the queue's
        self.requests: List[Request] = list(self.free)  # every one made, free or not (holds(): a fence's bound)
        self.active = 0
        self.state = QueueLifecycle.CONNECTING
        self.closed = False  # state is CLOSED (kept as a flag: the hot path reads it)
        self.in_capsule_size = transport.in_capsule_size if self.qid else 0
        self.auth = None  # engine/auth.py's QueueAuth when the host must authenticate this queue
        self.ops = registry.get(transport.trtype)  # what its transport does (transport/registry.py)
        self.map_sgl = self.ops.map_sgl

    def install(self, sqsize: int) -> None:
        """The Connect's SQSIZE (nvmet_install_queue): the host may have SQSIZE + 1 commands outstanding (held
        AERs included)."""
        self.sqsize = sqsize
        self.depth = sqsize + 1
        more = [Request(self, self.target) for _ in range(min(self.depth, 64) - len(self.free))]
        self.free.extend(more)
        self.requests.extend(more)

    def enter(self, new: "QueueLifecycle") -> None:
        """Move to `new`; IllegalQueueTransition if the lifecycle has no such edge (a bug in the core)."""
        if self.state not in ALLOWED_FROM[new]:
            raise IllegalQueueTransition(f"queue {self.qid}: {self.state.value} -> {new.value}")
        self.state = new
        self.closed = new is QueueLifecycle.CLOSED

    def alloc(self) -> Optional[Request]:
        if self.active >= self.depth:
            return None
        self.active += 1
        if self.free:
            return self.free.pop()
        req = Request(self, self.target)  # deeper than the preallocated pool: grow it
        self.requests.append(req)
        return req

    def release(self, req: Request) -> None:
        if FREE not in NEXT[req.state]:  # lifecycle.move, inlined: once per command (a double completion raises)
            raise IllegalTransition(req, FREE)
        req.state = FREE
        ref = req.ref
        if ref is not None:  # the namespace reference it held (engine/subsystem.py "references")
            req.ref = None
            ref.put()
        if req.fence_refs:
            _let_go_fence_refs(req)
        req.capsule = None
        req.ns = None
        req.next_step = None
        req.tx = None
        self.active -= 1
        self.free.append(req)

    def discard(self, req: Request) -> None:
        """Free a request whose queue closed or which will not be answered (no response), letting go of its
        namespace reference."""
        ref = req.ref
        if ref is not None:
            req.ref = None
            ref.put()
        if req.fence_refs:
            _let_go_fence_refs(req)
        move(req, FREE)

    def holds(self, ref) -> int:
        """Commands of this queue holding namespace reference `ref`: the core's and its transport's."""
        return (sum(1 for req in self.requests if (req.ref is ref or ref in req.fence_refs) and req.state != FREE)
                + self.transport.references_held(ref))

    def next_sqhd(self) -> int:
        """SQ head after consuming one entry (0xFFFF when the host disabled SQ flow control)."""
        if self.sqflow_disabled:
            return 0xFFFF
        self.sqhd = (self.sqhd + 1) % (self.sqsize + 1)
        return self.sqhd


def _let_go_fence_refs(req) -> None:
    """A handed-back command's older epochs (core._start) let go with its own reference."""
    olds, req.fence_refs = req.fence_refs, ()
    for old in olds:
        old.put()
