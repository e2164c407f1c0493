"""RDMA devices and ports: presence, Soft-RoCE fallback, port state, link layer, MTU."""
from __future__ import annotations

from typing import Optional

from ...errors import ToolMissing
from ...roce import ROCE_HEADER_OVERHEAD, roce_mtu_for_netdev_mtu
from ..context import Context
from ..machine import ToolNotRun, missing_tool_reason
from ..result import CheckResult, fail, ok, skipped, warn
from ..sysfs import IB_CLASS, NET_CLASS, RDMA_DRIVER_FOR_NIC, Device, Port
from ..tools import ToolFailed, ibv_devinfo, mtu_bytes

# RoCE MTU 4096 needs 4096 + the RoCE headers (ROCE_HEADER_OVERHEAD, 96 bytes) <= netdev MTU;
# 4200 is the usual round figure above that.
NETDEV_MTU_FOR_ROCE_4096 = 4200


def check_rdma_devices(ctx: Context) -> CheckResult:
    """Detects the absence of any RDMA device (/sys/class/infiniband is empty: no provider
    driver bound, or no rxe link created) or a --device name that does not exist."""
    names = [d.name for d in ctx.all_devices]
    evidence = [f"{IB_CLASS}: {' '.join(names) or '(empty)'}"]
    evidence += [f"{d.name}: {d.kind}" for d in ctx.all_devices]
    if not names:
        return fail("device.present", "", "no RDMA device", evidence,
                    "load the NIC's RDMA driver (mlx5_ib, irdma, bnxt_re, ...; `rdma link` lists what exists), "
                    "or create Soft-RoCE: modprobe rdma_rxe && rdma link add rxe0 type rxe netdev ETH")
    if ctx.options.device and not ctx.devices:
        return fail("device.present", "", f"no RDMA device named {ctx.options.device}", evidence,
                    f"pick one of: {', '.join(names)} (--device)")
    summary = ", ".join(f"{d.name} ({d.kind})" for d in ctx.devices)
    return ok("device.present", "", summary, evidence, devices=[d.name for d in ctx.devices])


def _hardware_device_on(ctx: Context, netdev: str) -> Optional[Device]:
    for other in ctx.all_devices:
        if not other.is_software and any(netdev in p.netdevs for p in other.ports):
            return other
    return None


def check_soft_roce(ctx: Context, device: Device) -> CheckResult:
    """Detects Soft-RoCE (rxe): RDMA done in software by the kernel over an ordinary netdev.
    Fine for labs and tests, but CPU-bound, slow and without PFC/ECN offload; a production
    deployment silently using it (hardware driver not loaded, rxe link left over) loses
    everything RoCE is for.  Identified by the device's `parent` attribute and no PCI driver."""
    base = f"{IB_CLASS}/{device.name}"
    evidence = []
    if device.parent:
        evidence.append(f"{base}/parent: {device.parent}")
    evidence.append(f"{base}/device/driver: {device.driver or 'absent (no PCI device)'}")
    if device.hca_type:
        evidence.append(f"{base}/hca_type: {device.hca_type}")
    if device.fw_ver:
        evidence.append(f"{base}/fw_ver: {device.fw_ver}")
    if not device.is_soft_roce:
        return ok("device.soft_roce", device.name, device.kind, evidence, kind="hardware", driver=device.driver)

    netdev = ctx.netdev(device.parent) if device.parent else None
    details = {"kind": "rxe", "netdev": device.parent}
    fix = ("for a lab or test this is expected; in production use a RoCE-capable NIC with its RDMA driver "
           f"and remove the software device: rdma link delete {device.name}")
    summary = f"Soft-RoCE: RDMA in software over {device.parent or '?'}"
    if netdev is not None and netdev.driver:
        evidence.append(f"{NET_CLASS}/{netdev.name}/device/driver: {netdev.driver}")
        rdma_driver = RDMA_DRIVER_FOR_NIC.get(netdev.driver)
        hardware = _hardware_device_on(ctx, netdev.name)
        if hardware is not None:
            summary += f", on the same netdev as hardware device {hardware.name}"
            fix = (f"{hardware.name} already provides hardware RoCE on {netdev.name}; the two devices share GIDs "
                   f"and rdma_cm may pick either: rdma link delete {device.name}")
        elif rdma_driver:
            summary += f" — a {netdev.driver} NIC, whose hardware RoCE driver {rdma_driver} is not in use"
            fix = (f"modprobe {rdma_driver} (check `dmesg` if no device appears: firmware/RoCE disabled?), "
                   f"then rdma link delete {device.name}")
    return warn("device.soft_roce", device.name, summary, evidence, fix, **details)


def _port_only_ethernet(port: Port, check: str) -> Optional[CheckResult]:
    """A 'skipped' result for checks that only make sense on RoCE (Ethernet) ports."""
    if not port.is_ethernet:
        return skipped(check, port.name, f"link layer is {port.link_layer or 'unknown'}, not Ethernet (RoCE)")
    return None


def check_port_state(ctx: Context, port: Port) -> CheckResult:
    """Detects a port that cannot carry traffic: logical state not ACTIVE ("4: ACTIVE") or
    physical state not LinkUp.  For RoCE the port follows its netdev: a netdev that is down,
    has no carrier, or an rxe link whose netdev is down gives a DOWN port."""
    evidence = [f"{port.sysfs}/state: {port.state or '?'}",
                f"{port.sysfs}/phys_state: {port.phys_state or '?'}"]
    if port.rate:
        evidence.append(f"{port.sysfs}/rate: {port.rate}")
    netdev = ctx.netdev(port.netdev) if port.netdev else None
    if netdev is not None:
        evidence.append(f"{NET_CLASS}/{netdev.name}: operstate {netdev.operstate or '?'}, carrier {netdev.carrier or '?'}")
    details = {"state": port.state, "phys_state": port.phys_state, "netdev": port.netdev}
    if port.is_active and "linkup" in port.phys_state.replace(" ", "").lower():
        speed = f", {port.rate}" if port.rate else ""
        return ok("port.state", port.name, f"ACTIVE, LinkUp{speed}", evidence, **details)
    fixes = []
    if netdev is not None and netdev.operstate == "down" and netdev.carrier != "0":
        fixes.append(f"bring the interface up: ip link set {netdev.name} up")
    if "disabled" in port.phys_state.lower():
        fixes.append(f"the port is administratively disabled: ip link set {port.netdev or 'NETDEV'} up")
    if "polling" in port.phys_state.lower() or (netdev is not None and netdev.carrier == "0"):
        fixes.append(f"no link: check the cable/transceiver and the switch port (ethtool {port.netdev or 'NETDEV'} "
                     "shows 'Link detected'); speed/FEC must match the switch")
    if port.device.is_soft_roce:
        fixes.append(f"rxe follows its netdev: ip link set {port.netdev or 'NETDEV'} up")
    if not fixes:
        fixes.append(f"ip link set {port.netdev or 'NETDEV'} up; check the link with ethtool and the switch port")
    return fail("port.state", port.name, f"port not usable: {port.state or '?'}, {port.phys_state or '?'}",
                evidence, "\n".join(dict.fromkeys(fixes)), **details)


def check_link_layer(ctx: Context, port: Port) -> CheckResult:
    """Detects a port that is not RoCE: link layer InfiniBand (NVMe-oF RDMA works there too, but
    the RoCE checks — GID types, PFC, netdev MTU — do not apply)."""
    evidence = [f"{port.sysfs}/link_layer: {port.link_layer or '?'}"]
    if port.is_ethernet:
        return ok("port.link_layer", port.name, f"Ethernet (RoCE) on {port.netdev or '?'}", evidence,
                  netdev=port.netdev)
    return warn("port.link_layer", port.name, f"link layer {port.link_layer or 'unknown'}: not RoCE", evidence,
                "RoCE checks are skipped on this port; on a VPI adapter (ConnectX) switch it to Ethernet "
                "with mlxconfig -d DEV set LINK_TYPE_P1=2 if RoCE was intended")


def _active_mtu_from_ibv_devinfo(ctx: Context, port: Port):
    """(active_mtu, max_mtu, evidence line or skip reason) from ibv_devinfo when installed."""
    try:
        info = ibv_devinfo(ctx.machine, port.device.name).get(port.number, {})
    except (ToolMissing, ToolNotRun, ToolFailed) as exc:
        return None, None, f"ibv_devinfo: {missing_tool_reason(exc)}"
    active, maximum = mtu_bytes(info.get("active_mtu")), mtu_bytes(info.get("max_mtu"))
    return active, maximum, (f"ibv_devinfo -d {port.device.name}: port {port.number} "
                             f"active_mtu {info.get('active_mtu', '?')}, max_mtu {info.get('max_mtu', '?')}")


def check_port_mtu(ctx: Context, port: Port) -> CheckResult:
    """Detects a RoCE MTU held down by the netdev MTU.  The RoCE path MTU is the largest IB MTU
    (256..4096) that fits in the netdev MTU minus the RoCE headers, so a 1500-byte netdev gives
    1024-byte RoCE packets: four times the packets per I/O.  On hardware the netdev MTU should be
    at least 4200 (for RoCE 4096), usually 9000, end to end through the switches."""
    skip = _port_only_ethernet(port, "port.mtu")
    if skip:
        return skip
    if not port.netdev:
        return skipped("port.mtu", port.name, "no netdev found for this port")
    netdev = ctx.netdev(port.netdev)
    if netdev.mtu is None:
        return skipped("port.mtu", port.name, f"{NET_CLASS}/{port.netdev}/mtu is not readable")
    active, maximum, devinfo_line = _active_mtu_from_ibv_devinfo(ctx, port)
    derived = roce_mtu_for_netdev_mtu(netdev.mtu)
    active = active or derived
    evidence = [f"{NET_CLASS}/{netdev.name}/mtu: {netdev.mtu}", devinfo_line,
                f"RoCE MTU for netdev MTU {netdev.mtu}: {derived} (netdev MTU - {ROCE_HEADER_OVERHEAD} header bytes, rounded down to an IB MTU)"]
    details = {"netdev": netdev.name, "netdev_mtu": netdev.mtu, "active_mtu": active, "max_mtu": maximum}
    summary = f"RoCE MTU {active}, {netdev.name} MTU {netdev.mtu}"
    if port.device.is_soft_roce:
        return ok("port.mtu", port.name, summary + " (Soft-RoCE: no jumbo frames needed)", evidence, **details)
    if netdev.mtu < NETDEV_MTU_FOR_ROCE_4096:
        return warn("port.mtu", port.name, summary + f": below {NETDEV_MTU_FOR_ROCE_4096}, RoCE cannot use 4096",
                    evidence,
                    f"ip link set {netdev.name} mtu 9000 (persist it in the network configuration); the switch "
                    "ports and the peer need jumbo frames too (at least 4200), or large transfers are dropped",
                    **details)
    return ok("port.mtu", port.name, summary, evidence, **details)
