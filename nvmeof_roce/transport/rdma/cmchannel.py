"""The RDMA CM through the native module (csrc/cm_channel.c): events as plain data, ids as handles.

`_native.CmChannel` owns the event channel and every id made on it, and calls only librdmacm's public API
(rdma_cma.h).  It decides nothing: `CmChannel.events()` hands each event over as a `CmEvent` (its type, the id's
handle, the peer's address, the private data, the responder resources and initiator depth), already
acknowledged, and Python answers with `accept`/`reject` (the NVMe-oF private data packed by nvme/cm.py),
`disconnect` and `destroy`.  A `CmId` is one id of a channel, with the calls the queues make on it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ... import native
from ..contracts import TransportError

EVENT_NAMES = ("ADDR_RESOLVED", "ADDR_ERROR", "ROUTE_RESOLVED", "ROUTE_ERROR", "CONNECT_REQUEST",
               "CONNECT_RESPONSE", "CONNECT_ERROR", "UNREACHABLE", "REJECTED", "ESTABLISHED", "DISCONNECTED",
               "DEVICE_REMOVAL", "ADDR_CHANGE", "TIMEWAIT_EXIT")


class Events:
    """librdmacm's event numbers by name, as the module was built with them (`Events.CONNECT_REQUEST`, ...)."""

    def __init__(self, module):
        self.names: Dict[int, str] = {}
        for name in EVENT_NAMES:
            value = getattr(module, "CM_EVENT_" + name)
            setattr(self, name, value)
            self.names[value] = name

    def name(self, kind: int) -> str:
        return self.names.get(kind, f"CM event {kind}")


@dataclass(frozen=True)
class CmEvent:
    kind: int
    name: str
    id: int  # the id's handle on its channel
    listen_id: int  # a connect request's listening id, else 0
    status: int
    peer: str  # "address:port" of the other end, "" when unknown
    local: str
    private_data: bytes
    responder_resources: int
    initiator_depth: int


class CmChannel:
    """One CM event channel of the native module and its ids; `fd` goes into the event loop (or a poll)."""

    def __init__(self, module=None):
        module = module or native.module
        if module is None:
            raise TransportError(native.missing_reason or "the native module is not built")
        self.module = module
        self.events_by = Events(module)
        try:
            self.channel = module.CmChannel()
        except OSError as exc:
            raise TransportError(f"cannot open an RDMA CM event channel: {exc} (is an RDMA device present? "
                                 "'nvmeof-roce rdma status')") from None
        self.fd = self.channel.fileno()

    def events(self) -> List[CmEvent]:
        names = self.events_by
        return [CmEvent(ev["event"], names.name(ev["event"]), ev["id"], ev["listen_id"], ev["status"], ev["peer"],
                        ev["local"], ev["private_data"], ev["responder_resources"], ev["initiator_depth"])
                for ev in self.channel.events()]

    def listen(self, address: str, port: int, backlog: int = 128) -> "CmId":
        return CmId(self, self.channel.listen(address, port, backlog))

    def create_id(self) -> "CmId":
        return CmId(self, self.channel.create_id())

    def stats(self) -> dict:
        return self.channel.stats()

    def close(self) -> None:
        self.channel.close()


class CmId:
    """One id of a `CmChannel`: `handle` names it on that channel only, and never another id, even after it is
    destroyed; the native queues' QP helpers take both (create_cm_qp(channel.channel, handle, ...),
    create_host_qp)."""

    def __init__(self, channel: CmChannel, handle: int):
        self.channel = channel
        self.handle = handle
        self.closed = False

    @property
    def dev_name(self) -> str:
        return self.channel.channel.device(self.handle)

    @property
    def peer(self) -> str:
        return self.channel.channel.peer(self.handle)

    def accept(self, private_data: bytes, responder_resources: int, initiator_depth: int, qp_num: int = 0) -> None:
        self.channel.channel.accept(self.handle, private_data, responder_resources, initiator_depth, qp_num)

    def accept_rts(self, private_data: bytes, responder_resources: int, initiator_depth: int, rnr_retry: int,
                   max_ack_timeout: int) -> dict:
        """Accept on an id whose QP librdmacm made (create_cm_qp): the QP is taken to RTR and RTS here, its RNR
        retry count `rnr_retry` and its ACK timeout at most `max_ack_timeout`, before rdma_accept (which then
        leaves it alone); the RTS attributes set."""
        return self.channel.channel.accept_rts(self.handle, private_data, responder_resources, initiator_depth,
                                               rnr_retry, max_ack_timeout)

    def connect(self, private_data: bytes, responder_resources: int, initiator_depth: int, qp_num: int = 0) -> None:
        self.channel.channel.connect(self.handle, private_data, responder_resources, initiator_depth, qp_num)

    def reject(self, private_data: bytes) -> None:
        self.channel.channel.reject(self.handle, private_data)

    def establish(self) -> None:
        self.channel.channel.establish(self.handle)

    def disconnect(self) -> None:
        self.channel.channel.disconnect(self.handle)

    def resolve_addr(self, src: Optional[str], address: str, port: int, timeout_ms: int) -> None:
        self.channel.channel.resolve_addr(self.handle, src or None, address, port, timeout_ms)

    def resolve_route(self, timeout_ms: int) -> None:
        self.channel.channel.resolve_route(self.handle, timeout_ms)

    def qp_attr(self, state: int) -> Tuple[dict, int]:
        """The QP attributes and mask the CM sets for `state` (rdma_init_qp_attr), as a dict."""
        return self.channel.channel.qp_attr(self.handle, state)

    def close(self) -> None:
        """Destroy the id (its events were all acked as they were taken, so this never waits)."""
        if not self.closed:
            self.closed = True
            self.channel.channel.destroy(self.handle)
