"""`nvmeof-roce target ...`: commands for the userspace target.

    nvmeof-roce target check CONFIG.json [--json]

validates the config, opens every namespace backend (without creating missing
files), and prints the subsystems, namespaces and ports.  Errors name the file
and the field; the exit code is 1 on any error.
"""
from __future__ import annotations

import argparse
import os

from ..output import emit, table
from .backends import BackendError, open_backend
from ..config import ConfigError, TargetConfig, load_config
from .limits import MAX_NSID
from .serve import register_serve


def check_config(path: str) -> dict:
    """Validate `path` and open its backends; a summary dict, or ConfigError naming file and field."""
    config = load_config(path)
    return summarize(config)


def summarize(config: TargetConfig) -> dict:
    subsystems = []
    for i, sub in enumerate(config.subsystems):
        namespaces = []
        for j, ns in enumerate(sub.namespaces):
            where = f"subsystems[{i}].namespaces[{j}]"
            if ns.nsid > MAX_NSID:
                raise ConfigError(config.source, f"{where}.nsid",
                                  f"{ns.nsid} is above {MAX_NSID}, the highest NSID the userspace target serves",
                                  f"use an NSID in 1..{MAX_NSID}")
            namespaces.append(_open_namespace(config, where, ns))
        subsystems.append({
            "nqn": sub.nqn, "allow_any_host": sub.allow_any_host, "allowed_hosts": list(sub.allowed_hosts),
            "serial": sub.serial, "model": sub.model, "namespaces": namespaces,
            "ports": [p.portid for p in config.ports if sub.nqn in p.subsystems],
        })
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
    if ns.backend == "file" and ns.path and not os.path.exists(ns.path) and ns.size_bytes:
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
        if ns.backend == "file" and not backend.direct:
            info["note"] = "buffered I/O (no O_DIRECT here)"
    finally:
        backend.close()
    return info


def _print_summary(summary: dict) -> None:
    print(f"{summary['config']}: OK")
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
                [[p["portid"], p["trtype"], f"{p['traddr']}:{p['trsvcid']}", ", ".join(p["subsystems"])]
                 for p in summary["ports"]]))


def _cmd_check(args: argparse.Namespace) -> int:
    """Check every file given; the exit code is 1 if any of them is bad (each error is reported)."""
    results, failed = [], 0
    for path in args.config:
        try:
            results.append(check_config(path))
        except ConfigError as exc:
            failed += 1
            if not args.json and len(args.config) == 1:
                raise
            results.append({"config": path, "ok": False, "error": exc.message, "field": exc.where, "fix": exc.fix})

    def human(rs):
        for i, r in enumerate(rs):
            if i:
                print()
            if r["ok"]:
                _print_summary(r)
            else:
                print(f"{r['error']}\n  fix: {r['fix']}" if r["fix"] else r["error"])

    emit(results[0] if len(results) == 1 else results, args.json,
         human if len(results) > 1 else (lambda r: _print_summary(r)))
    return 1 if failed else 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("target", help="the userspace NVMe-oF target",
                                   description="Check and serve target configs with the userspace target.")
    commands = parser.add_subparsers(dest="target_command", metavar="SUBCOMMAND")
    parser.set_defaults(func=lambda args: parser.print_help() or 2)

    check = commands.add_parser("check", help="validate a target config and open its backends",
                                description="Validate CONFIG (nvmetcli JSON superset) and open every "
                                            "namespace backend; print the subsystems, namespaces and ports.")
    check.add_argument("config", metavar="CONFIG.json", nargs="+", help="one or more configs")
    check.add_argument("--json", action="store_true", help="print the result as JSON")
    check.set_defaults(func=_cmd_check)

    register_serve(commands)  # `target serve` lives in serve.py

    # the control socket's clients: `target add-ns ...` verbs and the top-level `rpc`
    from .rpc_commands import register_rpc, register_target_verbs
    register_target_verbs(commands)
    register_rpc(subparsers)
