"""The transports the target can run on, keyed by trtype: what the engine, the service and the config ask of each.

Like the kernel's `struct nvmet_fabrics_ops` and SPDK's `spdk_nvmf_transport_ops`, each transport is one
`TransportOps` entry (transport/contracts.py): its SGL kinds, its connect checks and how it words a refusal, its
options (`opts_init`, `dump_opts`), its event loop and its listener.  The entry lives in the transport's own
package; `BUILT_IN` below is the one line a new built-in transport adds here, and `register` adds another at run
time (a test's).  Nothing outside transport/ compares trtype strings or imports a transport's package: it asks
`get(trtype)`, `serves(trtype)` or `fabric(trtype)`.

`FABRICS` holds the addressing facts of every NVMe-oF trtype a config may name (kernel nvmet serves all four;
the userspace target those with a registry entry).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ..errors import NvmeofError
from .contracts import ListenOptions, TransportOps, TransportSettings  # noqa: F401  (the entry's vocabulary)
from .loopback import LOOPBACK
from .rdma.entry import RDMA

BUILT_IN: Tuple[TransportOps, ...] = (RDMA, LOOPBACK)  # the transports of the package: one entry each


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


_REGISTRY: Dict[str, TransportOps] = {ops.trtype: ops for ops in BUILT_IN}


def register(ops: TransportOps) -> None:
    """Add a transport (a test's).  A trtype is registered once."""
    if ops.trtype in _REGISTRY and _REGISTRY[ops.trtype] is not ops:
        raise ValueError(f"transport {ops.trtype!r} is already registered")
    _REGISTRY[ops.trtype] = ops


def unregister(trtype: str) -> None:
    if any(ops.trtype == trtype for ops in BUILT_IN):
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


def served_quoted() -> str:
    """The served trtypes as a config writes them, for a fix: '"rdma"'."""
    return " or ".join('"%s"' % t for t in served_trtypes())


def served_labels() -> str:
    """What `target serve` serves, for messages: "RDMA (RoCE)"."""
    return " and ".join(_REGISTRY[t].label or t for t in served_trtypes())


def figures() -> Dict[str, object]:
    """Every registered transport's own figures (`TransportOps.figures`), merged, for `target status`."""
    merged: Dict[str, object] = {}
    for ops in _REGISTRY.values():
        merged.update(ops.figures())
    return merged


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
