"""Lossless fabric: PFC and the RoCE priority, ECN/DCQCN, pause/discard/error counters."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ...errors import ToolMissing
from ..context import Context
from ..machine import ToolNotRun, missing_tool_reason
from ..result import CheckResult, ok, skipped, warn
from ..sysfs import NET_CLASS, Port, read_counters
from ..tools import ToolFailed, dcb_app_dscp, dcb_pfc, ethtool_stats, lldptool_pfc_priorities, mlnx_qos
from .addressing import RDMA_CM_CONFIGFS

PRIORITIES = range(8)


def _pfc_not_applicable(ctx: Context, port: Port, check: str) -> Optional[CheckResult]:
    """Skip reasons shared by the fabric checks: not RoCE, no netdev, Soft-RoCE on a virtual netdev."""
    if not port.is_ethernet:
        return skipped(check, port.name, "not a RoCE port")
    if not port.netdev:
        return skipped(check, port.name, "no netdev found for this port")
    netdev = ctx.netdev(port.netdev)
    if port.device.is_soft_roce and not netdev.is_physical:
        return skipped(check, port.name, f"Soft-RoCE over virtual netdev {netdev.name}: no DCB/PFC/ECN there")
    return None


def _roce_dscp(ctx: Context, port: Port) -> Tuple[int, str]:
    """The DSCP RoCE connections use by default: rdma_cm default_roce_tos >> 2 (0 when unset)."""
    path = f"{RDMA_CM_CONFIGFS}/{port.device.name}/ports/{port.number}/default_roce_tos"
    tos = ctx.machine.read(path)
    if tos is not None and tos.isdigit():
        return int(tos) >> 2, f"{path}: {tos}"
    return 0, f"{path}: unset, so ToS 0 unless the application sets one (nvme connect --tos)"


@dataclass
class PfcReading:
    """What the DCB tools said about one netdev (priorities None: no tool could answer)."""

    priorities: Optional[List[int]] = None
    dscp_to_prio: Optional[Dict[int, int]] = None  # only when traffic is classified by DSCP
    trust: Optional[str] = None
    evidence: List[str] = field(default_factory=list)
    unsupported: List[str] = field(default_factory=list)  # "Operation not supported": no DCB in the driver
    unavailable: List[str] = field(default_factory=list)  # tool missing, not recorded, or other failures
    delay: Optional[int] = None  # dcb's PFC delay field: mlx5's cable length in metres (None: not read)


def _pfc_from_dcb(ctx: Context, netdev: str) -> PfcReading:
    pfc = dcb_pfc(ctx.machine, netdev)
    prios = pfc.priorities
    reading = PfcReading(prios, delay=pfc.delay, evidence=[
        f"dcb -j pfc show dev {netdev}: PFC on priorities {prios or 'none'}, delay {pfc.delay}"])
    try:
        mapping = dcb_app_dscp(ctx.machine, netdev)
    except (ToolMissing, ToolNotRun, ToolFailed, ValueError):
        mapping = {}
    if mapping:
        reading.dscp_to_prio, reading.trust = mapping, "dscp"
        reading.evidence.append(f"dcb -j app show dev {netdev}: dscp-prio {_format_mapping(mapping)}")
    return reading


def _pfc_from_mlnx_qos(ctx: Context, netdev: str) -> PfcReading:
    qos = mlnx_qos(ctx.machine, netdev)
    return PfcReading(qos.pfc_priorities, qos.dscp_to_prio if qos.trust == "dscp" else None, qos.trust,
                      [f"mlnx_qos -i {netdev}: PFC on priorities {qos.pfc_priorities or 'none'}, trust {qos.trust}"])


def _pfc_from_lldptool(ctx: Context, netdev: str) -> PfcReading:
    prios = lldptool_pfc_priorities(ctx.machine, netdev)
    return PfcReading(prios, evidence=[f"lldptool -t -i {netdev} -V PFC: PFC enabled {prios or 'none'}"])


def _read_pfc(ctx: Context, netdev: str) -> PfcReading:
    """Ask dcb (iproute2, any DCB-capable driver), then mlnx_qos (NVIDIA), then lldptool (lldpad)."""
    failed = PfcReading()
    for ask in (_pfc_from_dcb, _pfc_from_mlnx_qos, _pfc_from_lldptool):
        try:
            return ask(ctx, netdev)
        except (ToolMissing, ToolNotRun) as exc:
            failed.unavailable.append(missing_tool_reason(exc))
        except ToolFailed as exc:
            (failed.unsupported if exc.not_supported else failed.unavailable).append(str(exc))
        except ValueError as exc:  # output not understood
            failed.unavailable.append(f"{ask.__name__}: output not understood ({exc})")
    failed.evidence = failed.unsupported + failed.unavailable
    return failed


def _format_mapping(mapping: Dict[int, int]) -> str:
    return " ".join(f"{d}:{p}" for d, p in sorted(mapping.items()))


def check_pfc(ctx: Context, port: Port) -> CheckResult:
    """Detects a lossy RoCE fabric on the host side: PFC (802.1Qbb) enabled on no priority, or
    RoCE traffic (its DSCP, from rdma_cm's default ToS) mapped to a priority without PFC.  RoCE's
    go-back-N retransmission collapses under drops; unless the fabric is designed for lossy RoCE
    with ECN, the RoCE priority must be lossless on the NIC and every switch port."""
    skip = _pfc_not_applicable(ctx, port, "fabric.pfc")
    if skip:
        return skip
    netdev = port.netdev
    reading = _read_pfc(ctx, netdev)
    evidence = list(reading.evidence)
    if reading.priorities is None:
        if reading.unsupported:
            return skipped("fabric.pfc", port.name, f"{netdev} does not support DCB (driver "
                           f"{ctx.netdev(netdev).driver or '?'})", evidence)
        return skipped("fabric.pfc", port.name, "; ".join(reading.unavailable), evidence)
    prios, mapping, trust = reading.priorities, reading.dscp_to_prio, reading.trust
    dscp, dscp_line = _roce_dscp(ctx, port)
    evidence.append(dscp_line)
    details = {"netdev": netdev, "pfc_priorities": prios, "trust": trust, "roce_dscp": dscp}
    fix_enable = (f"enable PFC on the RoCE priority (3 by convention) on the NIC and on the switch ports: "
                  f"dcb pfc set dev {netdev} prio-pfc 3:on (or mlnx_qos -i {netdev} --pfc 0,0,0,1,0,0,0,0 "
                  f"--trust dscp), map RoCE's DSCP to it, and set rdma_cm's ToS: "
                  f"echo 106 > {RDMA_CM_CONFIGFS}/{port.device.name}/ports/{port.number}/default_roce_tos "
                  f"(DSCP 26; mkdir {RDMA_CM_CONFIGFS}/{port.device.name} first)")
    if not prios:
        return warn("fabric.pfc", port.name, f"PFC is off on every priority of {netdev}: RoCE runs lossy",
                    evidence, fix_enable + "; or, for a lossy design, make sure ECN/DCQCN is on end to end",
                    **details)
    if mapping:
        priority = mapping.get(dscp, dscp >> 3)  # unmapped DSCPs follow the default DSCP>>3 mapping
        details["roce_priority"] = priority
        ctx.roce_priority[port.name] = priority
        if priority not in prios:
            return warn("fabric.pfc", port.name, f"RoCE traffic (DSCP {dscp}) maps to priority {priority}, "
                        f"but PFC is on {prios}", evidence,
                        f"make the RoCE DSCP map to a PFC priority: set rdma_cm's ToS to DSCP 26 (echo 106 > "
                        f"{RDMA_CM_CONFIGFS}/{port.device.name}/ports/{port.number}/default_roce_tos) and map "
                        f"DSCP 26 to priority {prios[0]} (dcb app add dev {netdev} dscp-prio 26:{prios[0]})",
                        **details)
        return ok("fabric.pfc", port.name, f"PFC on priority {', '.join(map(str, prios))}; RoCE DSCP {dscp} -> "
                  f"priority {priority}", evidence, **details)
    if len(prios) == 1:
        ctx.roce_priority[port.name] = prios[0]
    return ok("fabric.pfc", port.name, f"PFC on priority {', '.join(map(str, prios))} (DSCP mapping not shown; "
              "trust pcp or unknown)", evidence, **details)


def check_ecn(ctx: Context, port: Port) -> CheckResult:
    """Detects ECN/DCQCN congestion control switched off where the driver exposes it in sysfs
    (/sys/class/net/X/ecn/roce_np/enable/N: notification point, answers ECN marks with CNPs;
    roce_rp/enable/N: reaction point, slows down on CNPs).  Without it a congested switch can
    only pause (PFC) or drop; DCQCN keeps queues short and avoids pause storms."""
    skip = _pfc_not_applicable(ctx, port, "fabric.ecn")
    if skip:
        return skip
    base = f"{NET_CLASS}/{port.netdev}/ecn"
    if not ctx.machine.is_dir(base):
        return skipped("fabric.ecn", port.name, f"{base} absent: this driver does not expose ECN in sysfs "
                       "(upstream mlx5 keeps DCQCN on by default; see its debugfs cc_params)")
    states: Dict[str, Dict[int, Optional[str]]] = {}
    for point in ("roce_np", "roce_rp"):
        states[point] = {p: ctx.machine.read(f"{base}/{point}/enable/{p}") for p in PRIORITIES}
    priority = ctx.roce_priority.get(port.name)
    wanted = [priority] if priority is not None else list(PRIORITIES)
    evidence = [f"{base}/{point}/enable/0-7: {' '.join(v if v is not None else '-' for v in values.values())}"
                for point, values in states.items()]
    details = {point: {str(p): v for p, v in values.items()} for point, values in states.items()}
    details["priority"] = priority
    off = [f"{point} priority {p}" for point, values in states.items() for p in wanted if values[p] == "0"]
    on_anywhere = any(v == "1" for values in states.values() for v in values.values())
    where = f"priority {priority}" if priority is not None else "any priority"
    fix = (f"for p in {' '.join(map(str, wanted))}; do echo 1 > {base}/roce_np/enable/$p; "
           f"echo 1 > {base}/roce_rp/enable/$p; done (and ECN marking on the switch queues)")
    if priority is None and not on_anywhere:
        return warn("fabric.ecn", port.name, "ECN/DCQCN is off on every priority", evidence, fix, **details)
    if priority is not None and off:
        return warn("fabric.ecn", port.name, f"ECN/DCQCN off on the RoCE priority: {', '.join(off)}", evidence,
                    fix, **details)
    return ok("fabric.ecn", port.name, f"ECN/DCQCN on ({where}: notification and reaction points)", evidence,
              **details)


# Counter names by what their growth means.
PAUSE = re.compile(r"pause|pfc", re.I)
CONGESTION = re.compile(r"cnp|ecn_marked", re.I)
TROUBLE = re.compile(r"discard|drop|_err|error|out_of_buffer|out_of_sequence|retry|retrans|timeout|link_downed|"
                     r"duplicate|seq_err|rnr|crc|symbol|storm", re.I)
# XDP drops are deliberate; flush errors only follow a queue pair's teardown.
NOT_TROUBLE = re.compile(r"xdp|flush", re.I)


def classify_counter(name: str) -> Optional[str]:
    """"pause", "congestion", "errors", or None for traffic counters (bytes, packets, requests)."""
    if PAUSE.search(name) and "storm" not in name:
        return "pause"
    if CONGESTION.search(name):
        return "congestion"
    if TROUBLE.search(name) and not NOT_TROUBLE.search(name):
        return "errors"
    return None


def _sample(ctx: Context, port: Port, tool_notes: List[str]) -> Dict[str, int]:
    """One reading of every counter for a port: RDMA port counters, hw_counters, ethtool -S."""
    values: Dict[str, int] = {}
    for directory in ("counters", "hw_counters"):
        for name, value in read_counters(ctx.machine, f"{port.sysfs}/{directory}").items():
            values[f"{directory}/{name}"] = value
    if port.netdev and ctx.netdev(port.netdev).is_physical:
        try:
            for name, value in ethtool_stats(ctx.machine, port.netdev).items():
                values[f"ethtool/{name}"] = value
        except (ToolMissing, ToolNotRun, ToolFailed) as exc:
            note = f"ethtool -S {port.netdev}: {missing_tool_reason(exc)}"
            if note not in tool_notes:
                tool_notes.append(note)
    return values


def check_error_counters(ctx: Context) -> List[CheckResult]:
    """Detects pause frames, discards and transport errors that are growing right now: reads
    every port's RDMA counters (ports/N/counters, ports/N/hw_counters) and `ethtool -S` twice,
    `--interval` seconds apart.  Non-zero but static counters are history (shown in details);
    growing pause counters mean congestion backpressure or a pause storm, growing discards or
    retransmissions mean packet loss.  Growing CNP/ECN counters mean DCQCN is reacting to
    congestion: reported, not a warning."""
    ports = [p for p in ctx.ports if p.is_ethernet]
    if not ports:
        return [skipped("fabric.counters", "", "no RoCE port to sample")]
    notes: Dict[str, List[str]] = {p.name: [] for p in ports}
    first = {p.name: _sample(ctx, p, notes[p.name]) for p in ports}
    interval = ctx.options.interval
    if interval > 0:
        ctx.machine.sleep(interval)
        second = {p.name: _sample(ctx, p, notes[p.name]) for p in ports}
    else:
        second = first
    results = []
    for port in ports:
        results.append(_counter_result(port, first[port.name], second[port.name], interval, notes[port.name]))
    return results


def _counter_result(port: Port, before: Dict[str, int], after: Dict[str, int], interval: float,
                    notes: List[str]) -> CheckResult:
    growth: Dict[str, Dict[str, int]] = {"pause": {}, "errors": {}, "congestion": {}}
    nonzero: Dict[str, int] = {}
    for name, value in after.items():
        kind = classify_counter(name.split("/", 1)[1])
        if kind is None:
            continue
        if value:
            nonzero[name] = value
        delta = value - before.get(name, value)
        if delta > 0:
            growth[kind][name] = delta
    where = f"{port.sysfs}/{{counters,hw_counters}}" + (", ethtool -S " + port.netdev if port.netdev else "")
    evidence = [f"sampled {len(after)} counters twice, {interval:g} s apart: {where}"] if interval > 0 else [
        f"sampled {len(after)} counters once (--interval 0): growth not measured"]
    evidence += notes
    for kind in ("pause", "errors", "congestion"):
        for name, delta in sorted(growth[kind].items()):
            evidence.append(f"{name}: +{delta} in {interval:g} s (now {after[name]})")
    static = {n: v for n, v in nonzero.items() if not any(n in g for g in growth.values())}
    if static:
        evidence.append("non-zero, not growing: " + ", ".join(f"{n}={v}" for n, v in sorted(static.items())))
    details = {"interval": interval, "growing": growth, "nonzero": nonzero, "counters": len(after)}
    if not after:
        return skipped("fabric.counters", port.name, "no counters readable", evidence + notes, **details)
    problems, fixes = [], []
    if growth["pause"]:
        problems.append(f"pause frames growing ({', '.join(_short(n) for n in sorted(growth['pause']))})")
        fixes.append("pause frames mean a receiver (this NIC or the switch) is out of buffer: find the congested "
                     "link; a steady stream with no load is a pause storm (a stuck receiver); enable ECN/DCQCN so "
                     "senders slow down before PFC triggers; check the switch's PFC watchdog")
    if growth["errors"]:
        problems.append(f"discards/errors growing ({', '.join(_short(n) for n in sorted(growth['errors']))})")
        fixes.append("packets are being lost or retransmitted: check PFC on the RoCE priority (fabric.pfc), MTU "
                     "end to end (port.mtu), cabling (CRC/symbol errors) and `ethtool -S` on both ends; "
                     "out_of_buffer/rnr means receive queues ran empty (the application is too slow to repost)")
    if problems:
        return warn("fabric.counters", port.name, "; ".join(problems), evidence, "\n".join(fixes), **details)
    summary = "no pause, discard or error counter growing" if interval > 0 else "counters read (growth not measured)"
    if growth["congestion"]:
        summary += "; CNPs flowing (DCQCN reacting to congestion)"
    return ok("fabric.counters", port.name, summary, evidence, **details)


def _short(name: str) -> str:
    return name.split("/", 1)[1]


# --- a host against a saved plan (`doctor --plan FILE`) -------------------------------------


def _ecn_knob(ctx: Context, netdev: str, knob: str) -> Optional[str]:
    point = "roce_np" if knob in ("min_time_between_cnps", "cnp_dscp", "cnp_802p_prio") else "roce_rp"
    return ctx.machine.read(f"{NET_CLASS}/{netdev}/ecn/{point}/{knob}")


def check_plan(ctx: Context, port: Port) -> List[CheckResult]:
    """Compares a host's live lossless-fabric settings with a plan saved by `fabric plan --save`
    (only with `doctor --plan FILE`): link speed, MTU, the PFC priorities and PFC delay (mlx5's
    cable length, from which the driver sizes the headroom of buffers it owns), DSCP trust and the DSCP ->
    priority map, rdma_cm's ToS, ECN on the lossless priority, and the DCQCN knobs the plan sets.
    Each difference is named with the command that fixes it (the same commands `fabric plan`
    prints).  Settings no tool or file shows here are listed as not verified."""
    plan = ctx.options.plan
    if plan is None:
        return []
    skip = _pfc_not_applicable(ctx, port, "fabric.plan")
    if skip:
        return [skip]
    from ...fabric import apply

    host = plan["host"]
    netdev_name = port.netdev
    netdev = ctx.netdev(netdev_name)
    differences: List[Dict[str, object]] = []
    unverified: List[str] = []
    evidence: List[str] = []

    def differ(setting: str, wanted, live, fix: str) -> None:
        differences.append({"setting": setting, "plan": wanted, "live": live, "fix": fix})

    inputs = plan.get("inputs", {})
    if netdev.speed is None:
        unverified.append("link speed (no speed in sysfs)")
    else:
        evidence.append(f"{NET_CLASS}/{netdev_name}/speed: {netdev.speed}")
        if netdev.speed != host["speed_mbps"]:
            differ("link speed (Mb/s)", host["speed_mbps"], netdev.speed,
                   f"the plan was made for {host['speed_mbps'] // 1000} Gb/s: re-plan for this link: nvmeof-roce fabric "
                   f"plan --speed {netdev.speed // 1000}G --cable {inputs.get('cable_m', '?')}m --mtu {host['mtu']} "
                   "--save FILE")
    evidence.append(f"{NET_CLASS}/{netdev_name}/mtu: {netdev.mtu}")
    if netdev.mtu != host["mtu"]:
        differ("MTU", host["mtu"], netdev.mtu, apply.mtu_command(netdev_name, host["mtu"]))

    reading = _read_pfc(ctx, netdev_name)
    evidence += reading.evidence
    priority = host["priority"]
    if reading.priorities is None:
        unverified.append("PFC priorities, DSCP map, PFC delay (" + "; ".join(reading.unavailable + reading.unsupported)
                          + ")")
    else:
        if sorted(reading.priorities) != sorted(host["pfc_priorities"]):
            differ("PFC priorities", host["pfc_priorities"], reading.priorities,
                   apply.pfc_command(netdev_name, priority))
        if reading.delay is None:
            unverified.append("PFC delay / cable length (only dcb shows it)")
        elif reading.delay != host["pfc_delay"]:
            differ("PFC delay (mlx5: cable length, m)", host["pfc_delay"], reading.delay,
                   apply.pfc_delay_command(netdev_name, host["pfc_delay"]))
        if reading.trust is not None and reading.trust != host.get("trust", "dscp"):
            differ("trust", host.get("trust", "dscp"), reading.trust,
                   f"mlnx_qos -i {netdev_name} --trust dscp (or: {apply.dscp_command(netdev_name, host['dscp'], priority)})")
        mapping = reading.dscp_to_prio or {}
        for dscp_text, wanted in sorted(host["dscp_to_priority"].items(), key=lambda kv: int(kv[0])):
            dscp = int(dscp_text)
            live = mapping.get(dscp)
            if live != wanted:
                differ(f"DSCP {dscp} -> priority", wanted, live if live is not None else "not mapped",
                       apply.dscp_command(netdev_name, dscp, wanted))

    live_dscp, tos_line = _roce_dscp(ctx, port)
    evidence.append(tos_line)
    if live_dscp != host["dscp"]:
        differ("rdma_cm default ToS (DSCP)", host["dscp"], live_dscp,
               apply.tos_command(port.device.name, port.number, host["tos"]))

    base = f"{NET_CLASS}/{netdev_name}/ecn"
    if ctx.machine.is_dir(base):
        for p in host["ecn_priorities"]:
            for point in ("roce_np", "roce_rp"):
                value = ctx.machine.read(f"{base}/{point}/enable/{p}")
                evidence.append(f"{base}/{point}/enable/{p}: {value}")
                if value != "1":
                    differ(f"ECN {point} on priority {p}", 1, value, apply.ecn_command(netdev_name, point, p))
    else:
        unverified.append(f"ECN enable ({base} absent: upstream mlx5 keeps DCQCN on by default)")
    for knob, wanted in host["dcqcn"].items():
        value = _ecn_knob(ctx, netdev_name, knob)
        if value is None:
            unverified.append(f"DCQCN {knob} (no MLNX_OFED sysfs file; upstream: debugfs cc_params/"
                              f"{apply.DEBUGFS_NAMES.get(knob, knob)})")
            continue
        evidence.append(f"{base}: {knob} = {value}")
        if not value.isdigit() or int(value) != wanted:
            differ(f"DCQCN {knob}", wanted, value, apply.dcqcn_sysfs_command(netdev_name, knob, wanted))

    if unverified:
        evidence.append("not verified here: " + "; ".join(unverified))
    details = {"netdev": netdev_name, "differences": differences, "unverified": unverified,
               "plan_inputs": inputs}
    if differences:
        summary = f"{len(differences)} setting(s) differ from the plan: " + ", ".join(
            f"{d['setting']} {d['live']} (plan {d['plan']})" for d in differences)
        fix = "\n".join(str(d["fix"]) for d in differences)
        return [warn("fabric.plan", port.name, summary, evidence, fix, **details)]
    checked = "settings match the plan" + (f" ({len(unverified)} not verifiable here)" if unverified else "")
    return [ok("fabric.plan", port.name, checked, evidence, **details)]
