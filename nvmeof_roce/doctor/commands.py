"""`nvmeof-roce doctor`: the command line."""
from __future__ import annotations

import argparse
import sys

from ..fabric.plan import load_plan
from ..output import emit, progress
from .context import DEFAULT_CONNECT_TIMEOUT, DEFAULT_INTERVAL, DEFAULT_TRSVCID, Context, DoctorOptions
from .machine import CapturingMachine, Machine
from .report import render_text, to_json
from .result import exit_code
from .runner import run_checks


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="diagnose the RoCE fabric and this host's RDMA/NVMe-oF setup",
        description="Check the RDMA stack, devices and ports, RoCE v2 addressing, the lossless fabric "
        "(PFC/ECN/counters), NVMe-oF identity, firewall and target reachability, kernel messages, and a gateway "
        "group's members, ANA groups and cluster. "
        "Each check prints ok / warn / fail / skipped with what it read and the fix. "
        "Exit code 1 when any check fails.",
    )
    parser.add_argument("--device", metavar="DEV", help="check only this RDMA device (default: all)")
    parser.add_argument("-a", "--traddr", metavar="IP", help="target address: check the route, its GID and reach it")
    parser.add_argument("-s", "--trsvcid", type=int, default=DEFAULT_TRSVCID, metavar="PORT",
                        help=f"target port (default {DEFAULT_TRSVCID})")
    parser.add_argument("--interval", type=float, default=DEFAULT_INTERVAL, metavar="SECONDS",
                        help=f"time between the two counter samples (default {DEFAULT_INTERVAL:g}; 0: one sample)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_CONNECT_TIMEOUT, metavar="SECONDS",
                        help=f"connect timeout for --traddr (default {DEFAULT_CONNECT_TIMEOUT:g})")
    parser.add_argument("--root", default="/", metavar="PATH",
                        help="read sysfs/proc/etc under PATH (a captured tree; its recorded-tools/ replaces the tools)")
    parser.add_argument("--capture", metavar="DIR",
                        help="also copy everything read (files, tool outputs) into DIR, replayable with --root DIR")
    parser.add_argument("--plan", metavar="FILE",
                        help="also compare PFC, ECN, DCQCN, MTU and DSCP settings with a plan saved by "
                        "`nvmeof-roce fabric plan --save FILE` (check fabric.plan)")
    parser.add_argument("--config", metavar="FILE",
                        help="a gateway's target config: check its gateway group (nvmeof_roce.group), through the "
                        "running gateway's control socket, else by reading the group's RADOS state (checks group.*)")
    parser.add_argument("-S", "--socket", metavar="PATH",
                        help="the running target's control socket for the group checks (default: the only one "
                        "under /run/nvmeof-roce)")
    parser.add_argument("--json", action="store_true", help="print a JSON list of {check, status, evidence, fix, details}")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan) if args.plan else None
    options = DoctorOptions(device=args.device, traddr=args.traddr, trsvcid=args.trsvcid,
                            interval=max(0.0, args.interval), connect_timeout=args.timeout, plan=plan,
                            config=args.config, socket=args.socket)
    if args.capture:
        machine = CapturingMachine(args.capture, root=args.root)
    else:
        machine = Machine(args.root)
    if not args.json and sys.stderr.isatty():
        progress("running checks" + (f" (counters sampled {options.interval:g} s apart)" if options.interval else ""))
    results = run_checks(Context(machine, options))
    if args.capture:
        machine.finish()
        progress(f"captured what the checks read into {args.capture} (replay: nvmeof-roce doctor --root {args.capture})")
    if args.json:
        emit(to_json(results), as_json=True)
    else:
        print(render_text(results, colour=sys.stdout.isatty()))
    return exit_code(results)
