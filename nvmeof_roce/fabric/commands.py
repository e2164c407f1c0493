"""`nvmeof-roce fabric plan` and `nvmeof-roce fabric simulate`: the command line."""
from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path
from typing import List

from ..errors import NvmeofError
from ..output import add_json_option, emit, progress, table
from .apply import host_commands, switch_settings
from .plan import (ASICS, DEFAULT_ASIC, DEFAULT_DSCP, DEFAULT_PRIORITY, PAPER_DCQCN, SONIC_LOSSLESS_MTU, LinkInputs,
                   check_mtu, make_plan, parse_length, parse_speed, save_plan)
from .simulate import IncastConfig, RingConfig, run_incast, run_ring


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "fabric", help="plan a lossless RoCE priority (PFC headroom, ECN, DCQCN) and simulate it",
        description="Plan the PFC headroom, ECN marking and DCQCN parameters of a lossless RoCE priority, "
        "with the commands that apply them; simulate an incast with and without DCQCN and a PFC deadlock.")
    sub = parser.add_subparsers(dest="fabric_command", metavar="COMMAND")
    sub.required = True

    plan = sub.add_parser(
        "plan", help="PFC headroom and thresholds, ECN and DCQCN for a link, and the commands to apply them",
        description="Compute the PFC headroom of a lossless priority by the mlx5 driver's formula (the host NIC) "
        "and SONiC's (the switch port), side by side with every term, the ECN marking thresholds and DCQCN "
        "parameters (the DCQCN paper's and the NIC's defaults), and print the commands that apply them. "
        "--save writes the plan for `nvmeof-roce doctor --plan FILE`.")
    _link_options(plan)
    plan.add_argument("--nic-buffer", type=int, metavar="BYTES",
                      help="the NIC's lossless buffer size, for its xoff/xon thresholds (default: the smallest the "
                      "mlx5 driver accepts)")
    plan.add_argument("--dcqcn", choices=("nic-defaults", "paper"), default="nic-defaults",
                      help="what the plan sets on the NIC: keep the firmware's DCQCN defaults (default) or the "
                      "DCQCN paper's values where a knob has them")
    plan.add_argument("--netdev", default="$NETDEV", help="the RoCE netdev, written into the commands")
    plan.add_argument("--rdma-dev", default="$RDMA_DEV", help="the RDMA device, written into the commands")
    plan.add_argument("--pci", help="the NIC's PCI address, for the debugfs paths of the upstream mlx5 driver")
    plan.add_argument("--save", metavar="FILE", help="write the plan as JSON, for `doctor --plan FILE`")
    add_json_option(plan)
    plan.set_defaults(func=run_plan)

    sim = sub.add_parser(
        "simulate", help="an incast with PFC with and without DCQCN, and a PFC deadlock with and without a watchdog",
        description="A discrete-time model (1 us steps) of N senders into one switch port on a lossless priority, "
        "PFC from the plan's thresholds, ECN marking and DCQCN as in the paper; and a ring of switches whose "
        "PFC pauses form a cycle, with and without a PFC watchdog. Prints a summary; --plot DIR draws PNGs.")
    _link_options(sim)
    sim.add_argument("--senders", type=int, default=8, help="senders into one port (default 8)")
    sim.add_argument("--duration", type=float, default=60.0, metavar="MS",
                     help="simulated time of the incast, in ms (default 60)")
    sim.add_argument("--stagger", type=float, default=1000.0, metavar="US",
                     help="sender i starts at i x this many us (default 1000)")
    sim.add_argument("--xoff", type=int, default=100_000, metavar="BYTES",
                     help="the switch's PFC xoff point per ingress (default 100000); xon is two MTUs below")
    sim.add_argument("--marking", choices=("fluid", "random"), default="fluid",
                     help="ECN marks exactly p of the packets (fluid, default) or each with probability p (random)")
    sim.add_argument("--seed", type=int, default=1, help="seed of the random marking")
    sim.add_argument("--switches", type=int, default=3, help="switches in the deadlock ring (default 3)")
    sim.add_argument("--watchdog", type=int, default=200, metavar="US",
                     help="the PFC watchdog's detection time in the ring run with it (default 200 us)")
    sim.add_argument("--scenario", choices=("all", "incast", "ring"), default="all")
    sim.add_argument("--plot", metavar="DIR", help="write incast.png and ring.png into DIR (matplotlib)")
    add_json_option(sim)
    sim.set_defaults(func=run_simulate)


def _link_options(parser) -> None:
    parser.add_argument("--speed", default="100G", help="link speed: 10G, 25G, 100G, 400G ... (default 100G)")
    parser.add_argument("--cable", default="3m", help="cable length: 3m, 100m, 1km (default 3m)")
    parser.add_argument("--mtu", type=int, default=9216, help="the host port's MTU (default 9216)")
    parser.add_argument("--peer-mtu", type=int, help="the switch port's MTU (default: --mtu)")
    parser.add_argument("--priority", type=int, default=DEFAULT_PRIORITY,
                        help=f"the lossless priority (default {DEFAULT_PRIORITY})")
    parser.add_argument("--dscp", type=int, default=DEFAULT_DSCP, help=f"RoCE traffic's DSCP (default {DEFAULT_DSCP})")
    parser.add_argument("--asic", choices=sorted(ASICS), default=DEFAULT_ASIC,
                        help=f"the switch ASIC for SONiC's formula (default {DEFAULT_ASIC})")
    parser.add_argument("--lossless-mtu", type=int, default=SONIC_LOSSLESS_MTU,
                        help=f"SONiC's LOSSLESS_TRAFFIC_PATTERN mtu (default {SONIC_LOSSLESS_MTU}, SONiC's own)")


def _link(args) -> LinkInputs:
    mtu = check_mtu(args.mtu, "--mtu")
    peer = check_mtu(args.peer_mtu, "--peer-mtu") if args.peer_mtu is not None else mtu
    return LinkInputs(speed_mbps=parse_speed(args.speed), cable_m=parse_length(args.cable), mtu=mtu, peer_mtu=peer,
                      priority=args.priority, dscp=args.dscp, asic=args.asic,
                      lossless_mtu=check_mtu(args.lossless_mtu, "--lossless-mtu"),
                      nic_buffer=getattr(args, "nic_buffer", None), dcqcn=getattr(args, "dcqcn", "nic-defaults"))


# --- plan ----------------------------------------------------------------------------------


def run_plan(args: argparse.Namespace) -> int:
    plan = make_plan(_link(args))
    host = host_commands(plan, netdev=args.netdev, rdma_dev=args.rdma_dev, pci=args.pci)
    switch = switch_settings(plan)
    if args.save:
        save_plan(plan, args.save)
        if not args.json:
            progress(f"plan written to {args.save} (compare a host with it: nvmeof-roce doctor --plan {args.save})")
    result = dict(plan, commands={"host": [c.to_json() for c in host], "switch": [c.to_json() for c in switch]})
    emit(result, args.json, human=print_plan)
    return 0


def _kb(value: float) -> str:
    return f"{value:,.0f} B ({value / 1024:.1f} KiB)"


def print_plan(result: dict) -> None:
    link = result["inputs"]
    speed = link["speed_mbps"] / 1000
    print(f"Lossless priority {link['priority']} (DSCP {link['dscp']}) on a {speed:g} Gb/s link, "
          f"{link['cable_m']:g} m of cable, MTU {link['mtu']} (switch port {link['peer_mtu']})")
    print()
    nic, sw = result["headroom"]["mlx5"], result["headroom"]["sonic"]
    print("PFC headroom: the buffer kept free above the pause point for what still arrives after a PAUSE")
    print(table(["", "host NIC (mlx5 calculate_xoff)", "switch PG (SONiC buffer_headroom_mellanox)"], [
        ["headroom", _kb(nic["headroom"]), _kb(sw["headroom"])],
        ["xoff", f"{nic['xoff']:,} B fill", f"{sw['xoff']:,} B"],
        ["xon", f"{nic['xon']:,} B fill", f"{sw['xon']:,} B"],
        ["buffer", _kb(nic["buffer"]), _kb(sw["buffer"])],
    ]))
    print(f"range of the two formulas: {result['headroom']['low'] / 1000:.1f} .. "
          f"{result['headroom']['high'] / 1000:.1f} KB")
    for h in (nic, sw):
        print()
        print(f"{h['source']} - {h['applies_to']}")
        print(table(["term", "bytes", "computed as", "what it is"],
                    [[t["name"], f"{t['value']:,.2f}".rstrip("0").rstrip("."), t["formula"], t["meaning"]]
                     for t in h["terms"]]))
        print(f"  {h['thresholds']}")
        for note in h["notes"]:
            print(f"  note: {note}")
    ecn = result["ecn"]
    print()
    print("ECN marking on the switch's lossless egress queue (RED/WRED with ECN)")
    print(table(["", "plan", "DCQCN paper (40 Gb/s)"], [
        ["Kmin", f"{ecn['kmin']:,} B", f"{ecn['paper_kmin']:,} B"],
        ["Kmax", f"{ecn['kmax']:,} B", f"{ecn['paper_kmax']:,} B"],
        ["Pmax", f"{ecn['pmax'] * 100:g} %", f"{ecn['paper_pmax'] * 100:g} %"],
    ]))
    print(f"  scaled with the link speed so marking starts at the same queueing delay; {ecn['rule']}")
    print()
    p = result["dcqcn"]["paper"]
    print(f"DCQCN (Zhu et al., SIGCOMM 2015): g = 1/{round(1 / p['g'])}, CNP interval {p['cnp_interval_us']:g} us, "
          f"alpha timer {p['alpha_timer_us']:g} us, rate timer {p['rate_timer_us']:g} us, byte counter "
          f"{p['byte_counter'] / 1e6:g} MB, F = {p['fast_recovery_steps']}, Rai {p['rai_mbps']:g} Mb/s, "
          f"Rhai {p['rhai_mbps']:g} Mb/s")
    print(table(["mlx5 knob", "what", "unit", "NIC default", "paper", "plan sets"],
                [[r["knob"], r["what"], r["unit"], r["nic_default"], "" if r["paper"] is None else r["paper"],
                  "(keep)" if r["plan"] is None else r["plan"]] for r in result["dcqcn"]["knobs"]]))
    print()
    print("Host commands (as root):")
    for c in result["commands"]["host"]:
        print(f"  # {c['why']}")
        print(f"  {c['command']}")
    print()
    print("Switch port (SONiC CLI shown; other switches need the same settings):")
    for c in result["commands"]["switch"]:
        print(f"  # {c['why']}")
        print(f"  {c['command']}")


# --- simulate ------------------------------------------------------------------------------


def run_simulate(args: argparse.Namespace) -> int:
    link = _link(args)
    plan = make_plan(link)
    line_bytes_per_us = link.speed_mbps / 8
    # XOFF decided -> sender stops: the cable both ways at about 5 ns/m, plus 1 us for the frames in
    # progress and the peer's reaction; at least one step
    pause_delay = max(1, math.ceil(2 * link.cable_m * 0.005 + 1))
    frame = max(link.mtu, link.peer_mtu)
    if args.xoff <= 3 * frame:
        raise NvmeofError(f"--xoff {args.xoff}: the pause point must leave room for xon two MTUs below it",
                          f"give --xoff above {3 * frame} (3 x MTU {frame})")
    xon = args.xoff - 2 * frame
    incast = IncastConfig(senders=args.senders, speed_gbps=link.speed_mbps / 1000,
                          duration_us=int(args.duration * 1000), xoff=args.xoff, xon=xon,
                          headroom=plan["headroom"]["sonic"]["headroom"], pause_delay_us=pause_delay,
                          kmin=plan["ecn"]["kmin"], kmax=plan["ecn"]["kmax"], pmax=plan["ecn"]["pmax"],
                          stagger_us=int(args.stagger), marking=args.marking, seed=args.seed)
    ring = RingConfig(switches=args.switches, speed_gbps=link.speed_mbps / 1000, xoff=args.xoff, xon=xon,
                      pause_delay_us=pause_delay)
    if args.plot:  # before the simulations: a missing matplotlib is said now, not after them
        from .plot import require_matplotlib
        require_matplotlib()
    result: dict = {"inputs": {"pause_delay_us": pause_delay, "line_bytes_per_us": line_bytes_per_us}}
    incast_runs, ring_runs = [], []
    if args.scenario in ("all", "incast"):
        incast.check()
        for dcqcn in (None, PAPER_DCQCN):
            if not args.json:
                progress(f"incast {args.senders}:1, {'with' if dcqcn else 'without'} DCQCN, {args.duration:g} ms")
            incast_runs.append(run_incast(replace(incast, dcqcn=dcqcn)))
        result["incast"] = [r.summary() for r in incast_runs]
    if args.scenario in ("all", "ring"):
        ring.check()
        for watchdog in (None, args.watchdog):
            ring_runs.append(run_ring(replace(ring, watchdog_detect_us=watchdog)))
        result["ring"] = [r.summary() for r in ring_runs]
    if args.plot:
        from .plot import plot_incast, plot_ring
        directory = Path(args.plot)
        directory.mkdir(parents=True, exist_ok=True)
        written = []
        if incast_runs:
            written.append(str(plot_incast(incast_runs[0], incast_runs[1], directory / "incast.png")))
        if ring_runs:
            written.append(str(plot_ring(ring_runs[0], ring_runs[1], directory / "ring.png")))
        result["plots"] = written
    emit(result, args.json, human=print_simulation)
    return 0


def print_simulation(result: dict) -> None:
    if "incast" in result:
        rows: List[list] = []
        for s in result["incast"]:
            rows.append(["with DCQCN" if s["dcqcn"] else "PFC only",
                         " ".join(f"{v:.1f}" for v in s["tail_throughput_gbps"]),
                         " ".join(f"{v:.1f}" for v in s["tail_rates_gbps"]),
                         f"{s['worst_deviation'] * 100:.1f} %", s["pause_frames"], s["tail_pause_frames"], s["cnps"],
                         f"{s['max_headroom_used']:,} / {s['headroom']:,}"])
        first = result["incast"][0]
        print(f"Incast {first['senders']}:1, fair share {first['fair_share_gbps']:g} Gb/s; rates are the means over "
              "the last quarter of the run")
        print(table(["run", "throughput per sender (Gb/s)", "sending rate per sender (Gb/s)", "worst off fair share",
                     "PAUSE frames", "in last quarter", "CNPs", "headroom used / planned (B)"], rows))
    if "ring" in result:
        print()
        rows = []
        for s in result["ring"]:
            state = "deadlocked" if s["deadlocked"] else ("drained" if s["drained"] else "draining")
            rows.append(["PFC watchdog" if s["watchdog"] else "no watchdog", state,
                         "-" if s["deadlocked_at_us"] is None else f"{s['deadlocked_at_us']:g} us",
                         f"{s['delivered_bytes']:,}", f"{s['dropped_bytes']:,}", f"{s['left_in_switches']:,}",
                         len(s["watchdog_events"])])
        print(f"PFC ring of {result['ring'][0]['switches']} switches (cyclic buffer dependency)")
        print(table(["run", "end state", "cycle closed at", "delivered (B)", "dropped (B)", "left in switches (B)",
                     "watchdog triggers"], rows))
    for path in result.get("plots", []):
        print(f"plot: {path}")
