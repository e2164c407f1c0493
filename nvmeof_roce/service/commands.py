"""`nvmeof-roce target ...`: commands for the userspace target.

    nvmeof-roce target check CONFIG.json [CONFIG.json ...] [--json] [--unit NAME]

validates each config as the userspace target reads it (the same loader as
`target serve`), opens every file namespace (without creating missing files),
and prints the subsystems, namespaces and ports.  RAM and null namespaces are
checked against the config only: nothing is allocated.  Every problem of a file
is reported, each naming the file and the field; the exit code is 1 if any
file has one.  With --unit NAME, the namespaces' paths are checked against the
sandbox of the unit that serves the config as NAME (systemd/sandbox.py).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Optional

from ..errors import NvmeofError
from ..output import address, emit, table
from ..engine import auth
from ..engine.backends import BackendError, open_backend
from ..engine.ioengine import choose_engine
from ..config.devices import filesystem_too_small, in_system_tree
from ..config import ConfigError, ConfigErrors, TargetConfig, keys, load_userspace_config, raise_all
from ..config.backends import facts
from ..systemd import DEFAULT_DEST, SHIPPED_EXECUTABLE, render
from ..systemd.sandbox import TARGET_UNIT, load_sandbox, problems as sandbox_problems
from .serve import register_serve


def check_config(path: str, unit: Optional[str] = None, unit_dir: str = DEFAULT_DEST) -> dict:
    """Validate `path` and open its file backends; a summary dict, or ConfigError(s) naming file and field.
    `unit`: also check its namespaces' paths against instance `unit` of the userspace target's unit as
    installed in `unit_dir` (its sandbox: systemd/sandbox.py)."""
    config = load_userspace_config(path)
    auth.host_settings(config)  # DH-HMAC-CHAP keys parse, with known hashes and groups
    sandbox_errors = []
    if unit:
        box = load_sandbox(unit, unit_dir, render(TARGET_UNIT, SHIPPED_EXECUTABLE))
        sandbox_errors = [ConfigError(config.source, f.where, f.problem, f.fix)
                          for f in sandbox_problems(config, box, unit, unit_dir)]
    try:
        summary = summarize(config)
    except ConfigError as exc:
        raise_all(sandbox_errors + exc.every())
    raise_all(sandbox_errors)
    summary["warnings"] = [{"warning": w.problem, "field": w.where, "fix": w.fix}
                           for w in keys.inline_secret_warnings(config, path)]
    return summary


def summarize(config: TargetConfig) -> dict:
    subsystems = []
    errors = []
    for i, sub in enumerate(config.subsystems):
        namespaces = []
        for j, ns in enumerate(sub.namespaces):
            try:
                namespaces.append(_open_namespace(config, f"subsystems[{i}].namespaces[{j}]", ns))
            except ConfigError as exc:
                errors.append(exc)
        subsystems.append({
            "nqn": sub.nqn, "allow_any_host": sub.allow_any_host, "allowed_hosts": list(sub.allowed_hosts),
            "serial": sub.serial, "model": sub.model, "namespaces": namespaces,
            "ports": [p.portid for p in config.ports if sub.nqn in p.subsystems],
        })
    raise_all(errors)
    ports = [{
        "portid": p.portid, "trtype": p.trtype, "adrfam": p.adrfam, "traddr": p.traddr, "trsvcid": p.trsvcid_str,
        "subsystems": list(p.subsystems), "referrals": [r.name for r in p.referrals],
    } for p in config.ports]
    return {"config": config.source, "ok": True, "hosts": list(config.hosts), "subsystems": subsystems,
            "ports": ports}


def _open_namespace(config: TargetConfig, where: str, ns) -> dict:
    info = {"nsid": ns.nsid, "enabled": ns.enabled, "backend": ns.backend, "path": ns.path,
            "block_size": ns.block_size, "uuid": ns.uuid, "size_bytes": ns.size_bytes, "blocks": None,
            "note": ""}
    if not ns.enabled:
        info["note"] = "disabled"
        return info
    kind = facts(ns.backend)
    if kind.offline_check:  # a store `target check` does not connect to (an RBD cluster): what it can see
        module, _, function = kind.offline_check.partition(":")
        problems, info["note"] = getattr(importlib.import_module(module), function)(ns.backend_settings)
        errors = [ConfigError(config.source, f"{where}.nvmeof_roce.{kind.settings_key}.{key}", problem, fix)
                  for key, problem, fix in problems]
        raise_all(errors)
        return info
    if not facts(ns.backend).path:
        # the loader checked the size against the block count and the machine's memory; never allocate here
        info["blocks"] = ns.size_bytes // ns.block_size
        return info
    if (facts(ns.backend).path and ns.path and not os.path.exists(ns.path) and ns.size_bytes
            and not in_system_tree(ns.path)):  # a missing device is never created: opening it says so
        too_small = filesystem_too_small(ns.path, ns.size_bytes)
        if too_small:
            raise ConfigError(config.source, f"{where}.nvmeof_roce.size", *too_small)
        info["note"] = f"will be created ({ns.size_bytes} bytes)"  # check never creates files
        info["blocks"] = ns.size_bytes // ns.block_size
        return info
    try:
        backend = open_backend(ns)
    except BackendError as exc:
        raise exc.config_error(config.source, where, ns) from None
    try:
        info["size_bytes"] = backend.size_bytes
        info["blocks"] = backend.num_blocks
        info["block_size"] = backend.block_size  # a block device's own unless the config sets one
        if backend.blocking:
            engine = choose_engine(backend, ns.io_engine)  # io_uring forced where it cannot run: refused
            info["note"] = ("O_DIRECT" if backend.direct else "page cache (buffered)") + f", {engine.name}"
    except BackendError as exc:
        raise exc.config_error(config.source, where, ns) from None
    finally:
        backend.close()
    return info


def _print_summary(summary: dict) -> None:
    print(f"{summary['config']}: OK")
    for w in summary.get("warnings", ()):
        print(f"warning: {w['field']}: {w['warning']}\n  fix: {w['fix']}")
    rows = []
    for sub in summary["subsystems"]:
        hosts = "any host" if sub["allow_any_host"] else (", ".join(sub["allowed_hosts"]) or "no host")
        if not sub["namespaces"]:
            rows.append([sub["nqn"], "-", "", "", "", "", hosts])
        for ns in sub["namespaces"]:
            size = "" if ns["size_bytes"] is None else str(ns["size_bytes"])
            rows.append([sub["nqn"], ns["nsid"], ns["backend"] + (f" {ns['path']}" if ns["path"] else ""), size,
                         ns["block_size"], ns["note"], hosts])
    print()
    print(table(["SUBSYSTEM", "NSID", "BACKEND", "BYTES", "BLOCK", "NOTE", "HOSTS"], rows))
    print()
    print(table(["PORT", "TRTYPE", "ADDRESS", "SUBSYSTEMS"],
                [[p["portid"], p["trtype"], address(p["traddr"], p["trsvcid"]), ", ".join(p["subsystems"])]
                 for p in summary["ports"]]))


def _cmd_check(args: argparse.Namespace) -> int:
    results = []
    failed = False
    for path in args.config:
        try:
            results.append(check_config(path, args.unit, args.unit_dir))
        except ConfigError as exc:
            failed = True
            errors = exc.errors if isinstance(exc, ConfigErrors) else [exc]
            results.append({"config": path, "ok": False,
                            "errors": [{"error": e.message, "field": e.where, "fix": e.fix} for e in errors],
                            # the first problem, as before several were reported
                            "error": exc.errors[0].message if isinstance(exc, ConfigErrors) else exc.message,
                            "field": exc.where, "fix": exc.fix})
            if not args.json:
                print(f"nvmeof-roce: error: {exc}", file=sys.stderr)
            continue
        if not args.json:
            _print_summary(results[-1])
            print()
    if args.json:
        emit(results[0] if len(results) == 1 else results, True)
    return 1 if failed else 0


def _cmd_ana_state(args) -> int:
    from ..control.ana_states import ana_states, change_ana_state
    from ..control.client import find_socket
    if (args.port is None) != (args.state is None):
        raise NvmeofError("give both --port and STATE to change a state, or neither to show them",
                          "e.g. nvmeof-roce target ana-state --port 1 --group 1 inaccessible")
    path = find_socket(args.socket)
    if args.port is not None:
        workers = change_ana_state(path, args.port, args.group, args.state, args.timeout)
        print(f"port {args.port} group {args.group}: {args.state} (applied by {workers} worker(s))")
        return 0
    rows = ana_states(path, args.timeout)
    emit(rows, args.json, lambda r: print(table(["PORT", "GROUP", "STATE"],
                                                [[x["portid"], x["grpid"], x["state"]] for x in r])))
    return 0


def register(subparsers) -> None:
    from ..control.commands import register_rpc, register_target_verbs, socket_options
    parser = subparsers.add_parser("target", help="the userspace NVMe-oF target",
                                   description="Check and serve target configs with the userspace target.")
    commands = parser.add_subparsers(dest="target_command", metavar="SUBCOMMAND")
    parser.set_defaults(func=lambda args: parser.print_help() or 2)

    check = commands.add_parser("check", help="validate a target config and open its backends",
                                description="Validate each CONFIG (nvmetcli JSON superset) as `target serve` "
                                            "reads it, open every file namespace (RAM is never allocated), and "
                                            "print the subsystems, namespaces and ports; every problem is listed.")
    check.add_argument("config", metavar="CONFIG.json", nargs="+", help="one or more configs")
    check.add_argument("--json", action="store_true", help="print the result as JSON")
    check.add_argument("--unit", metavar="NAME",
                       help="also check the namespaces' paths against the sandbox of nvmeof-roce-target@NAME as "
                            "installed (PrivateTmp, ProtectHome, ProtectSystem, DeviceAllow), naming the setting "
                            "and the drop-in that fixes each")
    check.add_argument("--unit-dir", default=DEFAULT_DEST, help=argparse.SUPPRESS)
    check.set_defaults(func=_cmd_check)

    register_serve(commands)  # `target serve` lives in serve.py

    ana = commands.add_parser("ana-state", help="show or change the ANA state of a port's group in a running target",
                              description="Without --port: print the running target's ANA states. With --port, "
                                          "--group and STATE: change that group's state on that port in every "
                                          "worker; hosts connected through the port get an ANA change notice. "
                                          "A client of the control socket "
                                          "(nvmf_subsystem_listener_set_ana_state).")
    ana.add_argument("state", nargs="?", metavar="STATE",
                     help="optimized, non-optimized, inaccessible, persistent-loss or change")
    ana.add_argument("--port", type=int, metavar="PORTID", help="the portid (as in the discovery log)")
    ana.add_argument("--group", type=int, default=1, metavar="GRPID", help="the ANA group (default 1)")
    socket_options(ana)
    ana.set_defaults(timeout=60.0)
    ana.add_argument("--json", action="store_true", help="print the states as JSON")
    ana.set_defaults(func=_cmd_ana_state)

    # the control socket's clients: `target add-ns ...` verbs and the top-level `rpc`
    register_target_verbs(commands)
    register_rpc(subparsers)
