"""The transport methods: nvmf_get_transports and nvmf_create_transport (an emulation of SPDK's transport
settings: the transports exist from the start, sized by `target serve`'s options), and a listen address as the
RPCs give it, checked against the transports the target serves (transport/registry.py).  Mixed into
control/methods.py's `Control`."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from ...config import DEFAULT_TRSVCID, MAX_INLINE_DATA_SIZE, USERSPACE_QUEUE_SIZES
from ...nvme.cm import ADMIN_QUEUE_DEPTH
from ...output import address
from ...transport import registry
from ..protocol import RpcError
from .params import Params


def served(joined: str = ", ") -> str:
    """The transports the target serves, as the RPCs name them (transport/registry.py): "RDMA"."""
    return joined.join(t.upper() for t in registry.served_trtypes())


def default_trtype() -> Optional[str]:
    """The trtype a listen address without one means: the one the target serves (None when it serves several)."""
    trtypes = registry.served_trtypes()
    return trtypes[0] if len(trtypes) == 1 else None


class TransportMethods:
    """nvmf_get_transports, nvmf_create_transport."""

    def _transport_settings(self, trtype: str) -> dict:
        """A served transport's settings in force, in nvmf_create_transport's names."""
        limits = self.target.limits
        return {"trtype": trtype.upper(), "max_queue_depth": self.transport_params.get(
                    "max_queue_size", self.target.default_queue_size),
                "in_capsule_data_size": self.transport_params.get(
                    "inline_data_size", self.target.default_in_capsule_size),
                "max_io_qpairs_per_ctrlr": limits.max_queues_per_ctrl, "max_io_size": limits.max_transfer,
                "io_unit_size": limits.max_transfer, "num_shared_buffers": limits.data_buffers,
                "max_aq_depth": ADMIN_QUEUE_DEPTH, "no_srq": True, "zcopy": False}

    def rpc_nvmf_get_transports(self, params) -> List[dict]:
        p = Params("nvmf_get_transports", params, ("trtype",))
        trtype = p.str("trtype", required=False)
        if trtype and not registry.serves(trtype.lower()):
            raise RpcError(f"no transport {trtype!r}: this target serves {served()} only", "trtype",
                           f'give "{served(" or ")}"')
        return [self._transport_settings(t) for t in registry.served_trtypes() if not trtype or t == trtype.lower()]

    def rpc_nvmf_create_transport(self, params) -> bool:
        """SPDK's method.  The transport exists from the start (`target serve`'s options size it), so each
        parameter is accepted when it is what the target does, applied when it is a port parameter (the
        listeners added after the call get it), and refused with the reason and the option to restart with
        otherwise: a setting is never taken without being honoured."""
        p = Params("nvmf_create_transport", params, ("trtype",) + tuple(_TRANSPORT_PARAMS))
        trtype = p.str("trtype")
        if not registry.serves(trtype.lower()):
            raise RpcError(f"trtype {trtype!r}: this target serves {served()} only", "trtype",
                           f'give "trtype": "{served(" or ")}"')
        in_force = self._transport_settings(trtype)
        ports: Dict[str, int] = {}
        for name in _TRANSPORT_PARAMS:
            if not p.has(name):
                continue
            how = _TRANSPORT_PARAMS[name]
            if isinstance(how, bool):  # a switch: what the target does is the only value it takes
                if p.bool(name) != how:
                    raise RpcError(f"{name} {str(not how).lower()}: {_TRANSPORT_SWITCHES[name]}", name,
                                   f"leave {name} out, or give {str(how).lower()}")
                continue
            if how is None:
                raise RpcError(f"{name}: {_TRANSPORT_REFUSED[name]}", name, f"leave {name} out")
            value = p.int(name)
            if how.startswith("port:"):
                key = how[5:]
                lo, hi = _TRANSPORT_PORT_RANGES[key]
                if not lo <= value <= hi:
                    raise RpcError(f"{name} {value}: this target takes {lo}..{hi}", name, f"give {lo}..{hi}")
                for port in self.target.config.ports:
                    have = getattr(port, key)
                    have = in_force[name] if have is None or have < 0 else have
                    if have != value:
                        raise RpcError(f"{name} {value}: port {port.portid} ({address(port.traddr, port.trsvcid)})"
                                       f" already listens with {key} {have}; the transport's setting is for "
                                       "the listeners added after it", name,
                                       f"give {have}, or set ports[].param.{key} in the config and reload "
                                       "with that port removed and added again")
                ports[key] = value
            elif how == "fixed" and value != in_force[name]:
                raise RpcError(f"{name} {value}: this target's is always {in_force[name]}", name,
                               f"give {in_force[name]}, or leave {name} out")
            elif value != in_force[name]:
                raise RpcError(f"{name} {value}: the running target was started with {in_force[name]} ({how}), "
                               "which a running target cannot change", name,
                               f"give {in_force[name]}, or restart `target serve` with {how} set to match")
        self.transport_params.update(ports)
        return True


# nvmf_create_transport's parameters (SPDK's names, of its RDMA transport: the one this target serves) -> "port:KEY" (a port parameter of the listeners added
# afterwards), the `target serve` option whose value in force is the only one taken, True/False (a switch: the
# one value that is what this target does), or None (refused: _TRANSPORT_REFUSED says why).
_TRANSPORT_PARAMS: Dict[str, Any] = {
    "max_queue_depth": "port:max_queue_size", "in_capsule_data_size": "port:inline_data_size",
    "max_io_qpairs_per_ctrlr": "--max-queues-per-ctrl", "max_io_size": "--mdts",
    "io_unit_size": "--mdts", "num_shared_buffers": "--data-buffers (per port)",
    "no_srq": True, "zcopy": False, "dif_insert_or_strip": False, "c2h_success": True,
    "max_aq_depth": "fixed", "buf_cache_size": None, "num_cqe": None, "max_srq_depth": None, "sock_priority": None,
    "acceptor_backlog": None, "abort_timeout_sec": None, "no_wr_batching": None, "control_msg_num": None,
    "acceptor_poll_rate": None, "ack_timeout": None, "data_wr_pool_size": None, "disable_command_passthru": None,
    "kas": None, "min_kato": None, "disable_mappable_bar0": None, "disable_adaptive_irq": None,
    "disable_shadow_doorbells": None,
}
_TRANSPORT_PORT_RANGES = {"max_queue_size": USERSPACE_QUEUE_SIZES, "inline_data_size": (0, MAX_INLINE_DATA_SIZE)}
_TRANSPORT_SWITCHES = {
    "no_srq": "each queue of this target has its own receive queue (no shared receive queue)",
    "zcopy": "this target copies through its registered data buffers (no zero-copy from the backend)",
    "dif_insert_or_strip": "this target has no protection information (TCP's DIF insert/strip in SPDK)",
    "c2h_success": "a TCP setting (SPDK ignores it on RDMA); this target serves RDMA",
}
_TCP = "a TCP setting; this target serves RDMA"
_VFIO = "a vfio-user setting; this target serves RDMA"
_TRANSPORT_REFUSED = {
    "buf_cache_size": "no per-poll-group buffer cache: each queue is guaranteed "
                    "--queue-min-buffers of the port's pool", "num_cqe": "the completion queues are sized by the "
                    "queue depth", "max_srq_depth": "no shared receive queue", "sock_priority": _TCP,
    "acceptor_backlog": "the listen backlog is fixed at 128", "abort_timeout_sec": "Abort is answered at once "
    "(the command is not aborted)", "no_wr_batching": "work requests are posted as the data path decides",
    "control_msg_num": _TCP, "acceptor_poll_rate": "connections arrive as rdma_cm events, not by polling",
    "ack_timeout": "the RDMA ACK timeout is the device's default", "data_wr_pool_size": "no WR pool setting",
    "disable_command_passthru": "no command passthru exists to turn off", "kas": "keep alive is always "
    "supported (the host's KATO, up to nvmeof_roce.max_kato)", "min_kato": "no minimum keep-alive timeout "
    "(nvmeof_roce.max_kato is the maximum)", "disable_mappable_bar0": _VFIO, "disable_adaptive_irq": _VFIO,
    "disable_shadow_doorbells": _VFIO,
}


def listen_address(port) -> dict:
    """A config port as the RPCs give a listen address."""
    return {"trtype": port.trtype.upper(), "adrfam": port.adrfam.upper() if port.adrfam.startswith("ip") else
            port.adrfam, "traddr": port.traddr, "trsvcid": port.trsvcid_str}


def listen_params(la: dict) -> dict:
    """An RPC's listen_address, checked: the trtype one the target serves (the one it serves when not given)."""
    for k in la:
        if k not in ("trtype", "adrfam", "traddr", "trsvcid"):
            raise RpcError(f"listen_address: unknown key {k!r}", f"listen_address.{k}",
                           "give trtype, adrfam, traddr, trsvcid")
    trtype = str(la.get("trtype", default_trtype())).lower()
    if not registry.serves(trtype):
        raise RpcError(f"listen_address.trtype must be {served(' or ')}, got {la.get('trtype')!r}",
                       "listen_address.trtype",
                       f'the userspace target serves {served()} only: "trtype": "{served(" or ")}"')
    if not la.get("traddr"):
        raise RpcError("listen_address.traddr is required", "listen_address.traddr",
                       "give the IP address of an RDMA netdev, e.g. 10.99.0.1")
    adrfam = la.get("adrfam") or ("ipv6" if ":" in str(la["traddr"]) else "ipv4")  # an IPv6 literal says so
    return {"trtype": trtype, "adrfam": str(adrfam).lower(), "traddr": str(la["traddr"]),
            "trsvcid": str(la.get("trsvcid", DEFAULT_TRSVCID))}


def find_port(d: dict, la: dict) -> Optional[dict]:
    """The port of config dict `d` at listen address `la` (listen_params'), or None."""
    for port in d["ports"]:
        a = port.get("addr", {})
        if (a.get("trtype"), a.get("traddr"), str(a.get("trsvcid", DEFAULT_TRSVCID))) == \
                (la["trtype"], la["traddr"], la["trsvcid"]):
            return port
    return None
