"""What every check gets: the machine, the user's options, and facts read once and shared."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Dict, List, Optional

from .group_source import GroupView, InspectFunction, RpcFunction, read_group_view
from .machine import Machine
from .sysfs import Device, Netdev, Port, read_devices, read_netdev
from .tools import Route, ip_route_get

DEFAULT_TRSVCID = 4420
DEFAULT_INTERVAL = 1.0
DEFAULT_CONNECT_TIMEOUT = 5.0


@dataclass
class DoctorOptions:
    device: Optional[str] = None  # only this RDMA device (default: all)
    traddr: Optional[str] = None  # the target's address, to check routing, GIDs and reachability
    trsvcid: int = DEFAULT_TRSVCID
    interval: float = DEFAULT_INTERVAL  # seconds between the two counter samples (0: one sample)
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    plan: Optional[dict] = None  # a fabric plan (`fabric plan --save`) to compare the host with
    config: Optional[str] = None  # a target config: its nvmeof_roce.group is the gateway group to check
    socket: Optional[str] = None  # a running target's control socket (default: the only one under /run/nvmeof-roce)


# discover(traddr, trsvcid, timeout, hostnqn) -> list of discovery log entries.
# Raises ImportError when pyverbs is not available.
DiscoverFunction = Callable[[str, int, float, Optional[str]], list]


class Context:
    """Shared state for one doctor run.  Facts are read lazily and cached."""

    def __init__(self, machine: Machine, options: Optional[DoctorOptions] = None,
                 discover: Optional[DiscoverFunction] = None, group_rpc: Optional[RpcFunction] = None,
                 group_inspect: Optional[InspectFunction] = None):
        self.machine = machine
        self.options = options or DoctorOptions()
        if discover is None:
            from .discovery_probe import discover_with_userspace_initiator as discover
        self.discover = discover
        self.group_rpc, self.group_inspect = group_rpc, group_inspect  # None: the control socket, RADOS
        self._netdevs: Dict[str, Netdev] = {}
        self.roce_priority: Dict[str, int] = {}  # port name -> priority RoCE traffic uses, when known

    @cached_property
    def all_devices(self) -> List[Device]:
        return read_devices(self.machine)

    @cached_property
    def devices(self) -> List[Device]:
        """The devices to check: --device only, else all."""
        if self.options.device:
            return [d for d in self.all_devices if d.name == self.options.device]
        return self.all_devices

    @property
    def ports(self) -> List[Port]:
        return [port for device in self.devices for port in device.ports]

    @property
    def all_ports(self) -> List[Port]:
        return [port for device in self.all_devices for port in device.ports]

    def netdev(self, name: str) -> Netdev:
        if name not in self._netdevs:
            self._netdevs[name] = read_netdev(self.machine, name)
        return self._netdevs[name]

    @property
    def traddr(self) -> Optional[str]:
        return self.options.traddr

    @cached_property
    def traddr_ip(self):
        """--traddr as an ip_address (None when absent or not an IP literal)."""
        if not self.traddr:
            return None
        try:
            return ipaddress.ip_address(self.traddr.split("%")[0])
        except ValueError:
            return None

    @cached_property
    def route_to_traddr(self) -> Route:
        """`ip route get TRADDR`; raises like the tool wrapper (ToolMissing, ToolFailed)."""
        return ip_route_get(self.machine, self.traddr)

    @cached_property
    def group_view(self) -> GroupView:
        """The gateway group to check (group_source.py): the running gateway's status, else --config's RADOS
        state.  A captured tree (--root) asks no running target unless --socket names one."""
        o = self.options
        return read_group_view(o.config, o.socket, o.connect_timeout, self.machine.is_live, self.group_rpc,
                               self.group_inspect)

    @cached_property
    def hostnqn(self) -> Optional[str]:
        return self.machine.read("/etc/nvme/hostnqn") or None

    @property
    def uses_soft_roce(self) -> bool:
        return any(d.is_soft_roce for d in self.devices)
