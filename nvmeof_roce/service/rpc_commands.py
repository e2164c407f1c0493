"""Clients of a running target's control socket (service/control.py): `nvmeof-roce rpc` and the target verbs.

    nvmeof-roce rpc METHOD [--param KEY=VALUE ...] [JSON]       any method, SPDK's names
    nvmeof-roce target add-ns NQN (--path FILE | --ram SIZE | --null SIZE) [--nsid N] [--block-size B]
    nvmeof-roce target rm-ns NQN NSID
    nvmeof-roce target resize-ns NQN NSID SIZE
    nvmeof-roce target add-host NQN HOSTNQN
    nvmeof-roce target rm-host NQN HOSTNQN
    nvmeof-roce target status [--json]
    nvmeof-roce target reload [--dry-run] [CONFIG]

Every command takes `--socket PATH` (default: the only socket under /run/nvmeof-roce).
"""
from __future__ import annotations

import json
import sys
from typing import Any, Dict, Optional

from ..errors import NvmeofError
from ..output import emit, table
from .control_client import call, find_socket
from .control_protocol import RpcError


def _call(args, method: str, params: Optional[dict] = None) -> Any:
    path = find_socket(getattr(args, "socket", None))
    try:
        return call(path, method, params, timeout=args.timeout)
    except RpcError as exc:
        where = f" ({exc.field})" if exc.field else ""
        raise NvmeofError(f"{method}{where}: {exc.message}", exc.fix) from None


def _value(text: str) -> Any:
    """--param values: numbers, true/false, objects and lists as JSON; anything else (even "null") a string."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, (bool, int, float, dict, list)) else text


def parse_params(pairs, json_text: Optional[str]) -> Optional[Dict[str, Any]]:
    params: Dict[str, Any] = {}
    if json_text:
        try:
            loaded = json.loads(json_text)
        except ValueError as exc:
            raise NvmeofError(f"params: invalid JSON: {exc}", "give an object, e.g. '{\"nqn\": \"nqn...\"}'") \
                from None
        if not isinstance(loaded, dict):
            raise NvmeofError("params: must be a JSON object", "give an object, e.g. '{\"nqn\": \"nqn...\"}'")
        params.update(loaded)
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise NvmeofError(f"--param {pair!r}: not KEY=VALUE", "e.g. --param nqn=nqn.2014-08.org.example:x")
        node = params
        parts = key.split(".")  # namespace.size=64M builds {"namespace": {"size": "64M"}}
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise NvmeofError(f"--param {pair!r}: {part} is not an object", "do not mix a value and sub-keys")
        node[parts[-1]] = _value(value)
    return params if (params or json_text) else None


def _cmd_rpc(args) -> int:
    result = _call(args, args.method, parse_params(args.param, args.params))
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


def _done(args, result, text: str) -> int:
    emit(result if result is not True else {"ok": True}, args.json, lambda _r: print(text))
    return 0


def _cmd_add_ns(args) -> int:
    ns: Dict[str, Any] = {}
    if args.nsid is not None:
        ns["nsid"] = args.nsid
    if args.path:
        ns["path"] = args.path
        if args.size:
            ns["size"] = args.size  # created with this size if missing
    elif args.ram or args.null:
        ns["backend"] = "ram" if args.ram else "null"
        ns["size"] = args.ram or args.null
    if args.block_size:
        ns["block_size"] = args.block_size
    for key in ("uuid", "nguid", "eui64"):
        if getattr(args, key):
            ns[key] = getattr(args, key)
    nsid = _call(args, "nvmf_subsystem_add_ns", {"nqn": args.nqn, "namespace": ns})
    return _done(args, {"nqn": args.nqn, "nsid": nsid}, f"{args.nqn}: namespace {nsid} added")


def _cmd_rm_ns(args) -> int:
    result = _call(args, "nvmf_subsystem_remove_ns", {"nqn": args.nqn, "nsid": args.nsid})
    return _done(args, result, f"{args.nqn}: namespace {args.nsid} removed")


def _cmd_resize_ns(args) -> int:
    result = _call(args, "nvmf_subsystem_resize_ns", {"nqn": args.nqn, "nsid": args.nsid, "size": args.size})
    return _done(args, result, f"{args.nqn}: namespace {args.nsid} is now {result['size_bytes']} bytes "
                               f"({result['blocks']} blocks)")


def _cmd_add_host(args) -> int:
    result = _call(args, "nvmf_subsystem_add_host", {"nqn": args.nqn, "host": args.host})
    return _done(args, result, f"{args.nqn}: host {args.host} allowed")


def _cmd_rm_host(args) -> int:
    result = _call(args, "nvmf_subsystem_remove_host", {"nqn": args.nqn, "host": args.host})
    return _done(args, result, f"{args.nqn}: host {args.host} removed; its controllers were ended")


def _cmd_reload(args) -> int:
    params: Dict[str, Any] = {"dry_run": args.dry_run}
    if args.config:
        import os
        params["path"] = os.path.abspath(args.config)
    result = _call(args, "nvmeof_reload_config", params)
    emit(result, args.json, _print_plan)
    return 0


def _print_plan(result: dict) -> None:
    verb = "would apply" if result["dry_run"] else "applied"
    if not result["changes"]:
        print(f"{result['config']}: no differences from the running target")
        return
    print(f"{result['config']}: {verb} {len(result['changes'])} change(s):")
    for c in result["changes"]:
        print(f"  {c['action']:<18} {c['text']}")


def _fmt_bytes(n) -> str:
    n = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _print_status(s: dict) -> None:
    print(f"target {s['config']}  (socket {s['socket']}, discovery generation {s['genctr']}, "
          f"{s['in_flight']} command(s) in flight, {s['internal_errors']} internal error(s), "
          f"data path {s.get('data_path', 'python')})")
    rows = []
    for sub in s["subsystems"]:
        hosts = "any host" if sub["allow_any_host"] else (", ".join(sub["allowed_hosts"]) or "no host")
        if not sub["namespaces"]:
            rows.append([sub["nqn"], "-", "", "", "", "", "", "", "", hosts])
        for ns in sub["namespaces"]:
            lat = ns["read_latency_us"], ns["write_latency_us"]
            eng = ns.get("io")
            rows.append([sub["nqn"], ns["nsid"], f"{ns['backend']}{' ' + ns['path'] if ns['path'] else ''}",
                         _fmt_bytes(ns["size_bytes"]),
                         f"{eng['engine']} {eng['in_flight']}/{eng['queue_depth']}" if eng else "inline",
                         f"{ns.get('iops', 0):g}",
                         f"{_fmt_bytes(ns.get('read_bytes_per_s', 0))}/s r, "
                         f"{_fmt_bytes(ns.get('write_bytes_per_s', 0))}/s w",
                         f"{lat[0]['p50'] or '-'}/{lat[0]['p99'] or '-'}",
                         f"{lat[1]['p50'] or '-'}/{lat[1]['p99'] or '-'}", hosts])
    print()
    print(table(["SUBSYSTEM", "NSID", "BACKEND", "SIZE", "ENGINE IN-FLIGHT/DEPTH", "IOPS", "THROUGHPUT", "READ p50/p99 us",
                 "WRITE p50/p99 us", "HOSTS"], rows))
    reasons = sorted({ns["io"]["engine_reason"] for sub in s["subsystems"] for ns in sub["namespaces"]
                      if ns.get("io")})
    for reason in reasons:
        print(f"I/O engine: {reason}")
    rows = []
    for sub in s["subsystems"]:
        for c in sub["controllers"]:
            io = [q for q in c["queues"] if q["qid"]]
            rows.append([c["hostnqn"], sub["nqn"], c["cntlid"], c["portid"], len(io),
                         ",".join(str(q["sqsize"] + 1) for q in io[:1]) or "-",
                         sum(q["active"] for q in c["queues"])])
    print()
    if rows:
        print(table(["HOST", "SUBSYSTEM", "CNTLID", "PORT", "IO QUEUES", "DEPTH", "OUTSTANDING"], rows))
    else:
        print("no host connected")
    t = s["transport"]
    lines = []
    for lst in t["listeners"]:
        pool = lst.get("pool") or {}
        lines.append(f"listener {lst['address']}: {lst['queues']} queue(s), data buffers "
                     f"{pool.get('in_use', '?')}/{pool.get('chunks', '?')} in use, RDMA errors "
                     f"{lst['wc_errors'] if lst.get('wc_errors') is not None else 'not counted'}")
    longest = t["loop"].get("longest_pass_s")
    lines.append("longest loop pass: " + (f"{longest * 1000:.1f} ms" if longest is not None else "not measured"))
    print()
    print("\n".join(lines))


def _cmd_status(args) -> int:
    emit(_call(args, "nvmeof_get_status"), args.json, _print_status)
    return 0


def _common(p, json_flag: bool = True) -> None:
    p.add_argument("--socket", "-s", metavar="PATH",
                   help="the target's control socket (default: the only one in /run/nvmeof-roce)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S", help="seconds to wait for the answer")
    if json_flag:
        p.add_argument("--json", action="store_true", help="print the result as JSON")


def register_rpc(subparsers) -> None:
    p = subparsers.add_parser("rpc", help="call a method on a running target's control socket",
                              description="Call a JSON-RPC method of a running `target serve` (SPDK's method "
                                          "and parameter names: nvmf_get_subsystems, nvmf_subsystem_add_ns, ...; "
                                          "rpc_get_methods lists them). Parameters come from a JSON object "
                                          "and/or --param KEY=VALUE (dots nest: namespace.size=64M).")
    p.add_argument("method")
    p.add_argument("params", nargs="?", metavar="JSON",
                   help="the parameters as one JSON object (right after METHOD, before any option)")
    p.add_argument("--param", "-p", action="append", metavar="KEY=VALUE", help="one parameter (repeatable)")
    _common(p, json_flag=False)
    p.set_defaults(func=_cmd_rpc)


def register_target_verbs(commands) -> None:
    p = commands.add_parser("add-ns", help="add a namespace to a running target",
                            description="Add a namespace to subsystem NQN of the running target; connected "
                                        "hosts see it without reconnecting (Namespace Attribute Changed).")
    p.add_argument("nqn")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--path", metavar="FILE", help="a file or block device")
    src.add_argument("--ram", metavar="SIZE", help="a RAM namespace of SIZE (e.g. 64M)")
    src.add_argument("--null", metavar="SIZE", help="a null namespace of SIZE (reads zeros, drops writes)")
    p.add_argument("--size", metavar="SIZE", help="with --path: create the file with this size if missing")
    p.add_argument("--nsid", type=int, help="the NSID (default: the lowest free one)")
    p.add_argument("--block-size", type=int, choices=(512, 4096))
    p.add_argument("--uuid")
    p.add_argument("--nguid")
    p.add_argument("--eui64")
    _common(p)
    p.set_defaults(func=_cmd_add_ns)

    p = commands.add_parser("rm-ns", help="remove a namespace from a running target")
    p.add_argument("nqn")
    p.add_argument("nsid", type=int)
    _common(p)
    p.set_defaults(func=_cmd_rm_ns)

    p = commands.add_parser("resize-ns", help="resize a namespace of a running target",
                            description="RAM and null namespaces are resized in place (data kept up to the "
                                        "smaller size); a file is truncated or extended; a block device "
                                        "must be resized first and is then re-read.")
    p.add_argument("nqn")
    p.add_argument("nsid", type=int)
    p.add_argument("size", help="the new size (bytes or K/M/G/T)")
    _common(p)
    p.set_defaults(func=_cmd_resize_ns)

    for verb, fn, what in (("add-host", _cmd_add_host, "allow a host on"), ("rm-host", _cmd_rm_host,
                                                                           "remove a host from")):
        p = commands.add_parser(verb, help=f"{what} a subsystem's allow-list (running target)")
        p.add_argument("nqn")
        p.add_argument("host", metavar="HOSTNQN")
        _common(p)
        p.set_defaults(func=fn)

    p = commands.add_parser("status", help="subsystems, hosts, queues and I/O figures of a running target")
    _common(p)
    p.set_defaults(func=_cmd_status)

    p = commands.add_parser("reload", help="apply a config file's differences to a running target",
                            description="Compare CONFIG (default: the file the target was started with) with "
                                        "the running target and apply the differences, as SIGHUP does. "
                                        "--dry-run prints the plan only. An invalid file changes nothing.")
    p.add_argument("config", nargs="?", metavar="CONFIG.json")
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    _common(p)
    p.set_defaults(func=_cmd_reload)

