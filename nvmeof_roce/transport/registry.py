"""The transports the target can run on, keyed by trtype: what the core, the service and the config ask of each.

Like the kernel's `struct nvmet_fabrics_ops` and SPDK's `spdk_nvmf_transport_ops`, one `TransportOps` entry per
transport says:

- its name (`trtype`) and flags: in-capsule data, keyed SGLs, remote invalidation (Identify's SGLS field and
  the SGL mapping follow them);
- its own connect-time checks (`check_request`: what the transport's connection request carries, the RDMA CM
  private data here) and how it words a refusal on the wire (`reject_status`: the CM reject STS);
- how an SGL descriptor becomes a transfer (`map_sgl`: in the capsule, or keyed host memory the transport moves);
- the event loop it runs on (`event_loop`) and how a listener is made for a configured port (`listen`).

`rdma` (pyverbs; the one `target serve` runs) and `loopback` (in-process, RDMA's rules, the unit tests) are the
two built-in entries; `register` adds another (a test's, or the native data path).  Nothing outside transport/
compares trtype strings: it asks `get(trtype)`, `serves(trtype)` or `fabric(trtype)`.

`FABRICS` holds the addressing facts of every NVMe-oF trtype a config may name (kernel nvmet serves all four;
the userspace target those with a registry entry).

Transport modules are imported lazily by the entries (pyverbs is loaded only for an RDMA listener), and none of
them imports this module, so the registry can import them without a circle.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from ..errors import NvmeofError
from ..tunables import POLL_SPIN_US
from ..nvme import cm
from ..nvme import status as S
from ..nvme.command import SQE_SIZE, is_write_direction
from ..nvme.sgl import SUBTYPE_ADDRESS, SUBTYPE_INVALIDATE_KEY, SUBTYPE_OFFSET, TYPE_DATA_BLOCK, \
    TYPE_KEYED_DATA_BLOCK
from .base import ConnectRequest, Refusal


@dataclass(frozen=True)
class ListenOptions:
    """What the service gives every listener it makes (target serve's options)."""

    max_transfer: int = 128 * 1024
    limits: object = None  # transport/resources.py ResourceLimits, or None for the defaults
    remote_invalidate: bool = True
    data_path: str = "python"  # RDMA I/O queues: "native" runs them in C (transport/rdma/native.py, docs/native.md)
    poll_mode: str = "interrupt"  # native queues: sleep on completion channels, or "busy" (tunables.POLL)
    poll_groups: object = None  # transport/rdma/pollgroups.py PollGroups (--cores > 1): threads poll native queues
    poll_spin_us: int = POLL_SPIN_US.default  # poll_mode "adaptive": the spin's bound (tunables.POLL_SPIN_US)


@dataclass(frozen=True)
class Fabric:
    """Addressing facts of one NVMe-oF trtype (nvme/log.py, docs/protocol.md): what a config port of it needs."""

    trtype: str
    adrfams: Tuple[str, ...]  # address families it takes; the first is the default
    ip_service: bool  # traddr is an IP address (or IB GID) and trsvcid a TCP-style port number
    kernel_module: str  # the nvmet transport module serving it ("" for none)
    host_module: str = ""  # the Linux host's transport module
    rdma_device: bool = False  # it needs an RDMA device behind traddr (a bind failing with EADDRNOTAVAIL means none)


# In the order a config error lists them.
FABRICS: Dict[str, Fabric] = {f.trtype: f for f in (
    Fabric("rdma", ("ipv4", "ipv6", "ib"), True, "nvmet_rdma", "nvme-rdma", rdma_device=True),
    Fabric("tcp", ("ipv4", "ipv6"), True, "nvmet_tcp", "nvme-tcp"),
    Fabric("loop", ("",), False, "nvme_loop", "nvme-loop"),
    Fabric("fc", ("fc",), False, "nvmet_fc", "nvme-fc"),
    Fabric("pcie", ("",), False, ""),
)}


def fabric(trtype: str) -> Optional[Fabric]:
    """The addressing facts of `trtype`, or None if NVMe-oF has no such transport type (or it is no string:
    a config's words are checked by the caller)."""
    return FABRICS.get(trtype) if isinstance(trtype, str) else None


def _cm_reject(refusal: Refusal) -> int:
    return cm.REJECT_STATUS[refusal.value]


def check_cm_request(request: ConnectRequest) -> Optional[Refusal]:
    """What nvmet_rdma_parse_cm_connect_req checks of the private data itself (docs/protocol.md §1.3)."""
    if request.recfmt != 0:
        return Refusal.INVALID_RECFMT
    if request.hrqsize == 0:
        return Refusal.INVALID_HRQSIZE
    return None


INVALIDATE_KEYED_ID = (TYPE_KEYED_DATA_BLOCK << 4) | SUBTYPE_INVALIDATE_KEY  # 0x4F


def map_keyed_or_in_capsule(req) -> int:
    """nvmet_rdma_map_sgl: a keyed descriptor (0x40, or 0x4F asking the response to invalidate the host's key:
    SEND with Invalidate, which saves the host a local invalidation) or in-capsule data (0x01); 0 or the
    NVMe status.  Sets `req.inline_offset` for in-capsule data and `req.invalidate_key` for 0x4F."""
    sgl_type = req.sgl_id >> 4
    subtype = req.sgl_id & 0xF
    if sgl_type == TYPE_KEYED_DATA_BLOCK:
        if subtype == SUBTYPE_ADDRESS:
            return 0
        if subtype == SUBTYPE_INVALIDATE_KEY:
            if req.sgl_len:
                req.invalidate_key = req.sgl_key
            return 0
        return S.INVALID_FIELD | S.DNR
    if sgl_type == TYPE_DATA_BLOCK:
        if subtype != SUBTYPE_OFFSET:
            return S.INVALID_FIELD | S.DNR
        if not is_write_direction(req.opc, req.fctype):
            return S.INVALID_FIELD | S.DNR
        end = req.sgl_addr + req.sgl_len
        if end > req.queue.in_capsule_size:
            return S.SGL_INVALID_OFFSET | S.DNR
        if SQE_SIZE + end > len(req.capsule):
            return S.SGL_INVALID_DATA | S.DNR  # the descriptor promises more than the capsule carried
        req.inline_offset = req.sgl_addr
        return 0
    return S.SGL_INVALID_TYPE | S.DNR


@dataclass(frozen=True)
class TransportOps:
    """One transport's entry: see the module docstring."""

    trtype: str
    description: str
    in_capsule_data: bool  # the host may put write data in the capsule (SGLS offset descriptors, IOCCSZ > 4)
    keyed_sgls: bool  # host memory is addressed by (addr, key, length): the transport moves it
    remote_invalidate: bool  # a response may invalidate the host's key (keyed descriptor subtype 0xF)
    map_sgl: Callable[[object], int]  # (core Request) -> 0 or an NVMe status; called once per command
    check_request: Callable[[ConnectRequest], Optional[Refusal]]  # the transport's own connect-time checks
    reject_status: Callable[[Refusal], int]  # a refusal as the transport says it on the wire
    event_loop: Callable[[object], object]  # (QueueHandler for tick) -> the loop listeners and Work watch fds on
    listen: Callable[..., object]  # (loop, PortConfig, QueueHandler, ListenOptions) -> a base.Listener
    require: Callable[[], None] = lambda: None  # raises NvmeofError naming the fix if it cannot run here
    served_by_target: bool = True  # config ports of this trtype are served by `target serve`
    label: str = ""  # how messages name it ("RDMA (RoCE)"); the trtype if empty


def _rdma_loop(handler):
    from .eventloop import EventLoop
    return EventLoop(handler)


def _rdma_listen(loop, port, handler, options: ListenOptions):
    from .rdma.cm import RdmaListener
    return RdmaListener(loop, port.traddr, port.trsvcid, handler=handler, port_id=port.portid,
                        max_transfer=options.max_transfer, limits=options.limits,
                        remote_invalidate=options.remote_invalidate, data_path=options.data_path,
                        poll_mode=options.poll_mode, poll_groups=options.poll_groups,
                        poll_spin_us=options.poll_spin_us)


def _rdma_require():
    from .rdma.verbs import require_pyverbs
    require_pyverbs()


def _loopback_loop(handler):
    from .loopback import LoopbackFabric
    return LoopbackFabric()


def _loopback_listen(loop, port, handler, options: ListenOptions):
    from .resources import BufferPool
    limits = options.limits
    pool = BufferPool(limits.data_buffers, limits.queue_min_buffers) if limits is not None else None
    return loop.listen(f"{port.traddr}:{port.trsvcid}", handler, pool=pool, port_id=port.portid)


RDMA = TransportOps(
    trtype="rdma", description="NVMe/RDMA on pyverbs (RoCE, iWARP, InfiniBand): one RC QP per NVMe queue",
    in_capsule_data=True, keyed_sgls=True, remote_invalidate=True, map_sgl=map_keyed_or_in_capsule,
    check_request=check_cm_request, reject_status=_cm_reject, event_loop=_rdma_loop, listen=_rdma_listen,
    require=_rdma_require, label="RDMA (RoCE)")

LOOPBACK = TransportOps(
    trtype="loopback", description="in-process fabric with RDMA's rules (unit tests, demos)",
    in_capsule_data=True, keyed_sgls=True, remote_invalidate=True, map_sgl=map_keyed_or_in_capsule,
    check_request=check_cm_request, reject_status=_cm_reject, event_loop=_loopback_loop, listen=_loopback_listen,
    served_by_target=False)

_REGISTRY: Dict[str, TransportOps] = {RDMA.trtype: RDMA, LOOPBACK.trtype: LOOPBACK}


def register(ops: TransportOps) -> None:
    """Add a transport (a test's, the native data path's).  A trtype is registered once."""
    if ops.trtype in _REGISTRY and _REGISTRY[ops.trtype] is not ops:
        raise ValueError(f"transport {ops.trtype!r} is already registered")
    _REGISTRY[ops.trtype] = ops


def unregister(trtype: str) -> None:
    if trtype in (RDMA.trtype, LOOPBACK.trtype):
        raise ValueError(f"the built-in transport {trtype!r} stays registered")
    _REGISTRY.pop(trtype, None)


def get(trtype: str) -> TransportOps:
    """The entry of `trtype`; an NvmeofError naming the registered ones if there is none."""
    ops = _REGISTRY.get(trtype)
    if ops is None:
        raise NvmeofError(f"no transport {trtype!r} in the userspace target",
                          f"use one of: {', '.join(sorted(_REGISTRY))}")
    return ops


def registered() -> Dict[str, TransportOps]:
    return dict(_REGISTRY)


def serves(trtype: str) -> bool:
    """A config port of this trtype is served by `target serve` (the others are kernel nvmet's only)."""
    ops = _REGISTRY.get(trtype) if isinstance(trtype, str) else None
    return ops is not None and ops.served_by_target


def served_trtypes() -> Tuple[str, ...]:
    return tuple(sorted(t for t, ops in _REGISTRY.items() if ops.served_by_target))


def served_labels() -> str:
    """What `target serve` serves, for messages: "RDMA (RoCE)"."""
    return " and ".join(_REGISTRY[t].label or t for t in served_trtypes())


# Read-only queries of what the transports keep, for the control plane (which imports no transport module).

def trace_switches() -> Dict[str, object]:
    """{SPDK tracepoint group: its switch (`set_enabled(bool)`)} of the per-command traces the transports keep:
    the native RDMA queues' (transport/rdma/native_trace.py), what trace_enable_tpoint_group turns on."""
    from .rdma.native_trace import GROUP, TRACING
    return {GROUP: TRACING}


def closing_queues() -> List[dict]:
    """The transports' queues still closing (commands still on a device; transport/rdma/native_queue.py), for
    `target status`."""
    from .rdma.native_queue import closing_queues as native_closing
    return native_closing()
