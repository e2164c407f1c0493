"""What sysfs says about RDMA devices, their ports, GID tables and Ethernet netdevs.

Layout (kernel Documentation/ABI/stable/sysfs-class-infiniband):

  /sys/class/infiniband/DEV/node_type                 "1: CA"
  /sys/class/infiniband/DEV/parent                    netdev under a software device (rxe, siw)
  /sys/class/infiniband/DEV/device/driver             -> .../drivers/mlx5_core (hardware only)
  /sys/class/infiniband/DEV/ports/N/state             "4: ACTIVE"
  /sys/class/infiniband/DEV/ports/N/phys_state        "5: LinkUp"
  /sys/class/infiniband/DEV/ports/N/link_layer        "Ethernet" | "InfiniBand"
  /sys/class/infiniband/DEV/ports/N/gids/K            "0000:0000:0000:0000:0000:ffff:0a63:0001"
  /sys/class/infiniband/DEV/ports/N/gid_attrs/types/K "RoCE v2" | "IB/RoCE v1" (EINVAL if unused)
  /sys/class/infiniband/DEV/ports/N/gid_attrs/ndevs/K the netdev the GID belongs to
  /sys/class/infiniband/DEV/ports/N/counters/*        port counters (PMA)
  /sys/class/infiniband/DEV/ports/N/hw_counters/*     driver counters (mlx5, rxe, ...)
"""
from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .machine import Machine

IB_CLASS = "/sys/class/infiniband"
NET_CLASS = "/sys/class/net"
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"

# Software RDMA drivers: their ib device has a `parent` attribute naming the netdev.
SOFT_ROCE_PREFIX = "rxe"
SOFT_IWARP_PREFIX = "siw"

# PCI (Ethernet) driver -> the RDMA driver that gives it hardware RoCE.
RDMA_DRIVER_FOR_NIC = {
    "mlx5_core": "mlx5_ib",
    "mlx4_core": "mlx4_ib",
    "mlx4_en": "mlx4_ib",
    "ice": "irdma",
    "i40e": "irdma",
    "bnxt_en": "bnxt_re",
    "qede": "qedr",
    "hns3": "hns_roce_hw_v2",
    "cxgb4": "iw_cxgb4",
    "erdma": "erdma",
    "mana": "mana_ib",
    "vmxnet3": "vmw_pvrdma",
}


@dataclass
class Gid:
    """One populated GID table entry."""

    index: int
    gid: str  # as sysfs prints it: 8 groups of 4 hex digits
    type: str  # "RoCE v2", "IB/RoCE v1", or "" when unreadable
    ndev: str  # netdev, "" when unreadable

    @property
    def address(self) -> ipaddress.IPv6Address:
        return ipaddress.IPv6Address(self.gid)

    @property
    def ip(self):
        """The IP address this GID stands for: IPv4 for ::ffff:a.b.c.d GIDs, else IPv6."""
        addr = self.address
        return addr.ipv4_mapped or addr

    @property
    def is_link_local(self) -> bool:
        return self.address.is_link_local

    @property
    def is_roce_v2(self) -> bool:
        return self.type.strip().lower() == "roce v2"

    def describe(self) -> str:
        return f"gid {self.index} {self.ip} {self.type or '?'} on {self.ndev or '?'}"


@dataclass
class Port:
    device: "Device"
    number: int
    state: str  # "4: ACTIVE"
    phys_state: str  # "5: LinkUp"
    link_layer: str  # "Ethernet"
    rate: str
    gids: List[Gid] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.device.name}/{self.number}"

    @property
    def sysfs(self) -> str:
        return f"{IB_CLASS}/{self.device.name}/ports/{self.number}"

    @property
    def is_active(self) -> bool:
        return self.state.split(":")[-1].strip().upper() == "ACTIVE" or self.state.startswith("4")

    @property
    def is_ethernet(self) -> bool:
        return self.link_layer.strip().lower() == "ethernet"

    @property
    def netdev(self) -> Optional[str]:
        """The Ethernet netdev under this port (software parent, else default GID's netdev)."""
        if self.device.parent:
            return self.device.parent
        for gid in self.gids:
            if gid.ndev:
                return gid.ndev
        return self.device.pci_netdevs[0] if self.device.pci_netdevs else None

    @property
    def netdevs(self) -> List[str]:
        """Every netdev with a GID on this port (the base netdev and its VLANs)."""
        names = []
        for name in [self.netdev] + [g.ndev for g in self.gids]:
            if name and name not in names:
                names.append(name)
        return names


@dataclass
class Device:
    name: str
    node_type: str
    parent: Optional[str]  # netdev of a software device
    driver: Optional[str]  # PCI driver of a hardware device ("mlx5_core")
    hca_type: Optional[str]
    fw_ver: Optional[str]
    pci_netdevs: List[str]
    ports: List[Port] = field(default_factory=list)

    @property
    def is_soft_roce(self) -> bool:
        return self.name.startswith(SOFT_ROCE_PREFIX) or (self.parent is not None and self.driver is None
                                                          and not self.name.startswith(SOFT_IWARP_PREFIX))

    @property
    def is_software(self) -> bool:
        return self.parent is not None or self.is_soft_roce

    @property
    def kind(self) -> str:
        """"Soft-RoCE", "soft-iWARP", or "hardware: MT4119, driver mlx5_core"."""
        if self.is_soft_roce:
            return "Soft-RoCE"
        if self.name.startswith(SOFT_IWARP_PREFIX):
            return "soft-iWARP"
        parts = [p for p in (self.hca_type, self.driver and f"driver {self.driver}") if p]
        return "hardware" + (f": {', '.join(parts)}" if parts else "")


def read_gids(machine: Machine, port_path: str) -> List[Gid]:
    """The populated GID entries of one port.

    The table has a fixed size (rxe: 1024 entries, mlx5: 255); an unused entry prints the zero
    GID and its type fails with EINVAL.  The type is read first, so unused entries cost one
    failed read and a --capture copies only the populated ones.
    """
    gids = []
    for name in machine.listdir(f"{port_path}/gids"):
        if not name.isdigit():
            continue
        gid_type = machine.read(f"{port_path}/gid_attrs/types/{name}")
        if gid_type is None:  # EINVAL: an unused entry
            continue
        value = machine.read(f"{port_path}/gids/{name}")
        if not value or value == ZERO_GID:
            continue
        ndev = machine.read(f"{port_path}/gid_attrs/ndevs/{name}") or ""
        try:
            gids.append(Gid(int(name), value, gid_type, ndev))
        except ValueError:
            continue
    return gids


def read_device(machine: Machine, name: str) -> Device:
    base = f"{IB_CLASS}/{name}"
    driver_link = machine.readlink(f"{base}/device/driver")
    device = Device(
        name=name,
        node_type=machine.read(f"{base}/node_type") or "",
        parent=machine.read(f"{base}/parent"),
        driver=os.path.basename(driver_link) if driver_link else None,
        hca_type=machine.read(f"{base}/hca_type"),
        fw_ver=machine.read(f"{base}/fw_ver"),
        pci_netdevs=machine.listdir(f"{base}/device/net"),
    )
    for port_name in machine.listdir(f"{base}/ports"):
        if not port_name.isdigit():
            continue
        path = f"{base}/ports/{port_name}"
        port = Port(
            device=device,
            number=int(port_name),
            state=machine.read(f"{path}/state") or "",
            phys_state=machine.read(f"{path}/phys_state") or "",
            link_layer=machine.read(f"{path}/link_layer") or "",
            rate=machine.read(f"{path}/rate") or "",
        )
        port.gids = read_gids(machine, path)
        device.ports.append(port)
    return device


def read_devices(machine: Machine) -> List[Device]:
    return [read_device(machine, name) for name in machine.listdir(IB_CLASS)]


@dataclass
class Netdev:
    """An Ethernet interface as /sys/class/net shows it."""

    name: str
    exists: bool
    mtu: Optional[int]
    operstate: Optional[str]
    carrier: Optional[str]
    speed: Optional[int]  # Mb/s
    driver: Optional[str]

    @property
    def is_physical(self) -> bool:
        return self.driver is not None


def read_netdev(machine: Machine, name: str) -> Netdev:
    base = f"{NET_CLASS}/{name}"
    driver_link = machine.readlink(f"{base}/device/driver")
    mtu = machine.read(f"{base}/mtu")
    speed = machine.read(f"{base}/speed")
    return Netdev(
        name=name,
        exists=machine.exists(base),
        mtu=int(mtu) if mtu and mtu.isdigit() else None,
        operstate=machine.read(f"{base}/operstate"),
        carrier=machine.read(f"{base}/carrier"),
        speed=int(speed) if speed and re.fullmatch(r"\d+", speed) else None,
        driver=os.path.basename(driver_link) if driver_link else None,
    )


def read_counters(machine: Machine, directory: str) -> Dict[str, int]:
    """Every numeric file in a counters directory ({} if absent); `lifespan` is not a counter."""
    counters = {}
    for name in machine.listdir(directory):
        if name == "lifespan":
            continue
        value = machine.read(f"{directory}/{name}")
        if value is not None and re.fullmatch(r"\d+", value):
            counters[name] = int(value)
    return counters
