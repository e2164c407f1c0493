"""Addressing: RoCE v2 GIDs for IP addresses, the rdma_cm RoCE mode, the route to --traddr."""
from __future__ import annotations

import ipaddress
import json
from typing import List, Optional, Tuple

from ...errors import ToolMissing
from ...roce import roce_mtu_for_netdev_mtu
from ..context import Context
from ..machine import ToolNotRun, missing_tool_reason
from ..result import CheckResult, fail, ok, skipped, warn
from ..sysfs import Gid, Port
from ..tools import ToolFailed

RDMA_CM_CONFIGFS = "/sys/kernel/config/rdma_cm"


def _family(ip) -> str:
    return f"IPv{ip.version}"


def check_roce_v2_gids(ctx: Context, port: Port) -> CheckResult:
    """Detects a RoCE port that rdma_cm cannot use for IP addressing: no RoCE v2 GID carrying an
    IPv4/IPv6 address.  GIDs are made by the kernel from the netdev's addresses, one per address
    and RoCE version; an address on another netdev (a bridge, macvlan, a bond without RoCE LAG)
    gets no GID, and connecting to or from it fails in address resolution."""
    if not port.is_ethernet:
        return skipped("address.gids", port.name, f"link layer is {port.link_layer or 'unknown'}, not Ethernet")
    evidence = [f"{port.sysfs}/gids/{g.index}: {g.gid} ({g.type or '?'}, {g.ndev or '?'}) = {g.ip}"
                for g in port.gids]
    if not evidence:
        evidence = [f"{port.sysfs}/gids: no populated entry"]
    v2 = [g for g in port.gids if g.is_roce_v2]
    v2_ip = [g for g in v2 if not g.is_link_local]
    details = {"roce_v2": [{"index": g.index, "ip": str(g.ip), "ndev": g.ndev} for g in v2],
               "all": [{"index": g.index, "gid": g.gid, "type": g.type, "ndev": g.ndev} for g in port.gids]}
    if v2_ip:
        addresses = ", ".join(f"{g.ip} ({_family(g.ip)}, gid {g.index}, {g.ndev})" for g in v2_ip)
        return ok("address.gids", port.name, f"RoCE v2 GIDs: {addresses}", evidence, **details)
    if not port.gids:
        return fail("address.gids", port.name, "GID table is empty", evidence,
                    f"bring {port.netdev or 'the netdev'} up and give it an address; for rxe recreate the link "
                    f"(rdma link delete {port.device.name}; rdma link add ...)", **details)
    if port.gids and not v2:
        return fail("address.gids", port.name, "no RoCE v2 GID (only RoCE v1: not routable over IP)", evidence,
                    "RoCE v2 needs a device/driver that supports it (mlx5, irdma, bnxt_re, rxe all do): update "
                    "the driver/firmware", **details)
    return fail("address.gids", port.name,
                f"no IP address on {port.netdev or 'the netdev'}: only link-local RoCE v2 GIDs", evidence,
                f"ip addr add ADDRESS/PREFIX dev {port.netdev or 'NETDEV'} (GIDs appear for every address "
                "on the RDMA netdev or its VLANs)", **details)


def check_roce_mode(ctx: Context, port: Port) -> CheckResult:
    """Detects rdma_cm set to RoCE v1 for this port (configfs rdma_cm default_roce_mode), which
    is L2-only and not routable; RoCE v2 (UDP/IP, port 4791) is the kernel's default when the
    device supports it.  Also reports default_roce_tos, the ToS (DSCP << 2) rdma_cm connections
    use, which must map to the lossless priority."""
    if not port.is_ethernet:
        return skipped("address.roce_mode", port.name, "not a RoCE port")
    base = f"{RDMA_CM_CONFIGFS}/{port.device.name}/ports/{port.number}"
    mode = ctx.machine.read(f"{base}/default_roce_mode")
    tos = ctx.machine.read(f"{base}/default_roce_tos")
    if mode is None:
        where = (f"{RDMA_CM_CONFIGFS}/{port.device.name}: not created" if ctx.machine.is_dir(RDMA_CM_CONFIGFS)
                 else f"{RDMA_CM_CONFIGFS}: absent (configfs not mounted or rdma_cm not loaded)")
        return ok("address.roce_mode", port.name, "RoCE v2 (kernel default; no rdma_cm override)", [where],
                  mode="RoCE v2", configured=False, tos=None)
    evidence = [f"{base}/default_roce_mode: {mode}"]
    details = {"mode": mode, "configured": True, "tos": None}
    tos_text = ""
    if tos is not None and tos.isdigit():
        details["tos"] = int(tos)
        evidence.append(f"{base}/default_roce_tos: {tos} (DSCP {int(tos) >> 2})")
        tos_text = f", ToS {tos} (DSCP {int(tos) >> 2})"
    if mode.strip().lower() == "roce v2":
        return ok("address.roce_mode", port.name, f"RoCE v2{tos_text}", evidence, **details)
    return warn("address.roce_mode", port.name, f"rdma_cm uses {mode}{tos_text}: RoCE v1 is not routable",
                evidence, f"echo 'RoCE v2' > {base}/default_roce_mode (or: cma_roce_mode -d {port.device.name} "
                f"-p {port.number} -m 2)", **details)


def _gids_for(ctx: Context, ip) -> List[Tuple[Port, Gid]]:
    return [(port, gid) for port in ctx.all_ports for gid in port.gids if gid.ip == ip]


def _local_address_for_traddr(ctx: Context):
    """(address this host uses toward --traddr, how we know, route or None).

    The target's own address when --traddr is local (we are the target), else the route's
    source address (we are the host).  Raises ToolMissing/ToolFailed from `ip route get`.
    """
    if _gids_for(ctx, ctx.traddr_ip):
        return ctx.traddr_ip, "--traddr is an address of this host (target side)", None
    route = ctx.route_to_traddr
    if route.is_local:
        return ctx.traddr_ip, "--traddr is an address of this host (target side)", route
    if not route.prefsrc:
        return None, f"ip route get {ctx.traddr}: no source address", route
    return ipaddress.ip_address(route.prefsrc), f"source address toward {ctx.traddr} (host side)", route


def _traddr_preconditions(ctx: Context, check: str) -> Optional[CheckResult]:
    if not ctx.traddr:
        return skipped(check, "", "no --traddr given")
    if ctx.traddr_ip is None:
        return fail(check, "", f"--traddr {ctx.traddr} is not an IP address", [],
                    "NVMe/RDMA addresses are IPv4 or IPv6 literals (trtype rdma, adrfam ipv4/ipv6)")
    return None


def check_gid_for_traddr(ctx: Context) -> CheckResult:
    """Detects that the address used for NVMe-oF has no RoCE v2 GID on an active port: the
    target's --traddr (when it is local) or this host's source address toward it.  rdma_cm
    binds to the GID of that address; without one, the kernel target cannot listen
    ("binding CM ID ... failed (-99)") and the host's connect fails in address resolution."""
    problem = _traddr_preconditions(ctx, "address.traddr_gid")
    if problem:
        return problem
    try:
        address, role, route = _local_address_for_traddr(ctx)
    except (ToolMissing, ToolNotRun, ToolFailed) as exc:
        return skipped("address.traddr_gid", "", f"cannot find the source address: {missing_tool_reason(exc)}")
    evidence = [f"{role}: {address}"]
    if route is not None:
        evidence.append(f"ip -j route get {ctx.traddr}: {json.dumps(route.raw)}")
    if address is None:
        return fail("address.traddr_gid", "", f"no source address toward {ctx.traddr}", evidence,
                    f"give the RDMA netdev an address in {ctx.traddr}'s subnet, or a route to it")
    matches = _gids_for(ctx, address)
    evidence += [f"{port.sysfs}/gids/{gid.index}: {gid.describe()}, port {port.state}" for port, gid in matches]
    details = {"address": str(address), "gids": [{"port": p.name, "index": g.index, "type": g.type} for p, g in matches]}
    good = [(p, g) for p, g in matches if g.is_roce_v2 and p.is_active]
    if good:
        port, gid = good[0]
        return ok("address.traddr_gid", "", f"{address} ({_family(address)}) has RoCE v2 GID {gid.index} on "
                  f"{port.name} ({gid.ndev}), port ACTIVE", evidence, **details)
    if any(g.is_roce_v2 for _, g in matches):
        port = next(p for p, g in matches if g.is_roce_v2)
        return fail("address.traddr_gid", "", f"{address} has a RoCE v2 GID only on {port.name}, which is "
                    f"not ACTIVE ({port.state})", evidence, "see port.state for this port", **details)
    if matches:
        return fail("address.traddr_gid", "", f"{address} has only RoCE v1 GIDs", evidence,
                    "RoCE v2 GIDs are missing: the device or driver does not offer RoCE v2", **details)
    on = f" (the route uses {route.dev})" if route is not None and route.dev and route.dev != "lo" else ""
    rdma_netdevs = sorted({n for p in ctx.all_ports for n in p.netdevs})
    return fail("address.traddr_gid", "", f"{address} has no RoCE GID on any RDMA port{on}", evidence,
                f"put {address} on an RDMA netdev ({', '.join(rdma_netdevs) or 'none found'}) or a VLAN of one: "
                "ip addr add ADDRESS/PREFIX dev NETDEV (and remove it from the other interface); addresses on "
                "bridges, macvlans or bonds without RoCE LAG get no GID", **details)


def check_route_to_traddr(ctx: Context) -> CheckResult:
    """Detects a route to --traddr that leaves through a netdev with no RDMA device under it
    (`ip -j route get`): rdma_cm resolves the destination through the routing table, so the
    connection would be attempted on a port that cannot do RDMA and fails ("address resolution
    failed", -EADDRNOTAVAIL / -ENODEV) even though ping works."""
    problem = _traddr_preconditions(ctx, "address.route")
    if problem:
        return problem
    try:
        route = ctx.route_to_traddr
    except (ToolMissing, ToolNotRun) as exc:
        return skipped("address.route", "", missing_tool_reason(exc))
    except ToolFailed as exc:
        return fail("address.route", "", f"no route to {ctx.traddr}", [str(exc)],
                    f"add an address in {ctx.traddr}'s subnet to the RDMA netdev, or a route: "
                    f"ip route add {ctx.traddr} via GATEWAY dev NETDEV")
    evidence = [f"ip -j route get {ctx.traddr}: {json.dumps(route.raw)}"]
    details = {"dev": route.dev, "prefsrc": route.prefsrc, "gateway": route.gateway, "local": route.is_local,
               "family": _family(ctx.traddr_ip)}
    if route.is_local:
        owners = _gids_for(ctx, ctx.traddr_ip)
        if owners:
            port, gid = owners[0]
            return ok("address.route", "", f"{ctx.traddr} ({_family(ctx.traddr_ip)}) is this host's own address on "
                      f"{gid.ndev} ({port.name}): target side, loopback RDMA", evidence, **details)
        return fail("address.route", "", f"{ctx.traddr} is local but not on an RDMA netdev", evidence,
                    "move the address to the RDMA netdev (see address.traddr_gid)", **details)
    ports = [p for p in ctx.all_ports if route.dev in p.netdevs]
    via = f" via {route.gateway}" if route.gateway else ""
    if ports:
        return ok("address.route", "", f"{ctx.traddr} ({_family(ctx.traddr_ip)}) leaves through {route.dev}{via} "
                  f"({ports[0].name}), source {route.prefsrc}", evidence, **details)
    rdma_netdevs = sorted({n for p in ctx.all_ports for n in p.netdevs})
    return fail("address.route", "", f"{ctx.traddr} leaves through {route.dev}{via}, which has no RDMA device",
                evidence,
                f"route {ctx.traddr} through an RDMA netdev ({', '.join(rdma_netdevs) or 'none found'}): move this "
                f"host's address to it, or ip route add {ctx.traddr} dev NETDEV [via GATEWAY]", **details)


COMMON_MTUS = (9000, 4200, 1500)
# ICMP echo overhead: IPv4 header 20 + ICMP 8; IPv6 header 40 + ICMPv6 8.
PING_OVERHEAD = {4: 28, 6: 48}


def _ping(ctx: Context, size: int) -> Tuple[bool, str]:
    """One echo of `size` payload bytes to --traddr, not fragmented: (reply seen, the command).
    iputils ping sets DF (-M do); busybox ping (no -M) sends one unfragmented frame as long as
    it fits the local MTU, which is all this probe sends."""
    family = ["-6"] if _family(ctx.traddr_ip) == "IPv6" else []
    try:
        r = ctx.machine.run(["ping", *family, "-M", "do", "-c", "1", "-W", "2", "-s", str(size), ctx.traddr],
                            timeout=10)
    except ToolMissing:
        r = ctx.machine.run(["busybox", "ping", *family, "-c", "1", "-W", "2", "-s", str(size), ctx.traddr],
                            timeout=10)
    return r.returncode == 0, r.command


def check_path_mtu(ctx: Context) -> CheckResult:
    """Detects an MTU mismatch on the path to --traddr: pings of the full MTU of the netdev the route
    uses, unfragmented.  If small pings come back and full-size ones do not, a hop (the peer or a
    switch port) has a smaller MTU than this node: RoCE packets sized for this node's MTU are dropped
    silently (no ICMP for RoCE), so connects may work while data transfers time out and retry."""
    problem = _traddr_preconditions(ctx, "address.path_mtu")
    if problem:
        return problem
    try:
        route = ctx.route_to_traddr
    except (ToolMissing, ToolNotRun, ToolFailed) as exc:
        return skipped("address.path_mtu", "", f"no route to {ctx.traddr}: {missing_tool_reason(exc)}")
    if route.is_local:
        return skipped("address.path_mtu", "", f"{ctx.traddr} is this host's own address: no path to measure")
    netdev = ctx.netdev(route.dev) if route.dev else None
    if netdev is None or netdev.mtu is None:
        return skipped("address.path_mtu", "", f"the MTU of {route.dev or 'the route netdev'} is not readable")
    overhead = PING_OVERHEAD[6 if _family(ctx.traddr_ip) == "IPv6" else 4]
    evidence = [f"ip route get {ctx.traddr}: dev {route.dev}, MTU {netdev.mtu}"]
    try:
        small, cmd = _ping(ctx, 56)
        evidence.append(f"{cmd}: {'reply' if small else 'no reply'}")
        if not small:
            return skipped("address.path_mtu", "", f"no ping reply from {ctx.traddr} at all: cannot measure the "
                           "path MTU (ICMP filtered, or no connectivity: see address.route)", evidence)
        full, cmd = _ping(ctx, netdev.mtu - overhead)
        evidence.append(f"{cmd}: {'reply' if full else 'no reply'}")
    except (ToolMissing, ToolNotRun) as exc:
        return skipped("address.path_mtu", "", missing_tool_reason(exc), evidence)
    details = {"dev": route.dev, "mtu": netdev.mtu}
    if full:
        return ok("address.path_mtu", "", f"{netdev.mtu}-byte frames reach {ctx.traddr} over {route.dev}",
                  evidence, **details)
    # The largest frame that does get through: the common MTUs first (one of them, usually), else bisection.
    lo, hi = 56 + overhead, netdev.mtu
    for common in (m for m in COMMON_MTUS if m < netdev.mtu):
        reply, cmd = _ping(ctx, common - overhead)
        evidence.append(f"{cmd}: {'reply' if reply else 'no reply'}")
        if reply:
            lo = common
            break
        hi = common
    while lo not in COMMON_MTUS and hi - lo > 8:
        mid = (lo + hi) // 2
        reply, cmd = _ping(ctx, mid - overhead)
        evidence.append(f"{cmd}: {'reply' if reply else 'no reply'}")
        lo, hi = (mid, hi) if reply else (lo, mid)
    details["path_mtu"] = lo
    ours, theirs = roce_mtu_for_netdev_mtu(netdev.mtu), roce_mtu_for_netdev_mtu(lo)
    return fail("address.path_mtu", "", f"MTU mismatch: {route.dev} has MTU {netdev.mtu} but frames larger than "
                f"{lo} bytes do not reach {ctx.traddr}", evidence,
                f"use one MTU end to end: lower this node (ip link set {route.dev} mtu {lo if lo < 1500 else 1500}) "
                f"or raise the peer and every switch port to {netdev.mtu}. Until then RoCE packets sized for this "
                f"node's RoCE MTU {ours} are dropped on the way (the path carries {theirs}), so I/O stalls in "
                "retransmissions while connects still work", **details)
