"""Clients of a running target's control socket (control/methods.py): `nvmeof-roce rpc` and the target verbs.

    nvmeof-roce rpc METHOD [--param KEY=VALUE ...] [JSON]       any method, SPDK's names
    nvmeof-roce target add-ns NQN (--path FILE | --ram SIZE | --null SIZE) [--nsid N] [--block-size B]
                              [--queue-depth N] [--io-engine io_uring|threads]
    nvmeof-roce target rm-ns NQN NSID
    nvmeof-roce target resize-ns NQN NSID SIZE
    nvmeof-roce target add-host NQN HOSTNQN
    nvmeof-roce target rm-host NQN HOSTNQN
    nvmeof-roce target create-subsystem NQN [--serial S] [--model M] [--allow-any-host] [--min-cntlid N] ...
    nvmeof-roce target delete-subsystem NQN
    nvmeof-roce target add-listener NQN TRADDR [-s 4420] [-t rdma] [--adrfam ipv4|ipv6]   (or -a TRADDR)
    nvmeof-roce target rm-listener NQN TRADDR [-s 4420]
    nvmeof-roce target listener-ana-state NQN TRADDR STATE [-s 4420] [--group GRPID]
    nvmeof-roce target ns-add-host NQN NSID HOSTNQN        (a namespace added with --no-auto-visible)
    nvmeof-roce target ns-rm-host NQN NSID HOSTNQN
    nvmeof-roce target set-qos NQN NSID [--rw-ios-per-sec N] [--rw-mbytes-per-sec N] [--r-mbytes-per-sec N]
                                        [--w-mbytes-per-sec N]          (0 removes a limit)
    nvmeof-roce target status [--json]
    nvmeof-roce target reload [--dry-run] [CONFIG]

Every command takes `-S PATH` / `--socket PATH` (default: the only socket under /run/nvmeof-roce); `-s` is
nvme-cli's service id (trsvcid) here as in every command.  The one exception is rpc.py's own: in `rpc
nvmf_subsystem_add_listener ...` -S is rpc.py's --sock-impl (refused: RDMA listeners have none), --socket the
control socket.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, Optional

from ..config import NS_IO_ENGINES
from ..errors import NvmeofError
from ..output import address, emit, table
from ..transport import registry
from .client import call, find_socket
from .protocol import RpcError


def _call(args, method: str, params: Optional[dict] = None) -> Any:
    path = find_socket(args.socket)
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


class _NoSockImpl(argparse.Action):
    """rpc.py's -S/--sock-impl of nvmf_subsystem_add_listener (a TCP listener's socket implementation: posix, uring,
    ssl): nothing here honours it, so it is refused, and a path given to it is named as the control socket."""

    def __call__(self, parser, namespace, values, option_string=None):
        socket = (f" {values!r} looks like a control socket's path: give it as --socket {values} (in this "
                  "subcommand, as in rpc.py, -S is --sock-impl)." if "/" in values or values.endswith(".sock")
                  else " In this subcommand, as in rpc.py, -S is --sock-impl; the control socket is --socket PATH.")
        parser.error(f"{option_string} {values}: rpc.py's --sock-impl picks a TCP listener's socket implementation "
                     "(posix, uring, ssl); this target's listeners are RDMA and have none, so it is not taken: "
                     f"leave it out.{socket}")


# rpc.py's command lines for the methods this target answers (SPDK's python/spdk/cli/nvmf.py and keyring.py):
# METHOD -> (positionals, options), an option as (flags, parameter, argparse keywords). `rpc METHOD ARGS...` reads
# ARGS as rpc.py does for METHOD, its letters included (rpc.py's -s of nvmf_create_subsystem is the serial number);
# every long option is also taken spelled as its JSON parameter (--serial_number beside --serial-number,
# --min_cntlid as older rpc.py spelled it); a JSON object or --param after METHOD is the generic form. A parameter
# this target does not take is sent as given, so the method names it in its refusal.
_FLAG = {"action": "store_true"}
_INT = {"type": int}
_TGT = (("-t", "--tgt-name"), "tgt_name", {})
_LISTEN = [(("-t", "--trtype"), "trtype", {"required": True}), (("-a", "--traddr"), "traddr", {"required": True}),
           (("-p", "--tgt-name"), "tgt_name", {}), (("-f", "--adrfam"), "adrfam", {}),
           (("-s", "--trsvcid"), "trsvcid", {})]
_NQN = ("nqn", {})
_NSID = ("nsid", _INT)
_HOST = ("host", {})
_KEYS = [(("--dhchap-key",), "dhchap_key", {}), (("--dhchap-ctrlr-key",), "dhchap_ctrlr_key", {})]
RPC_FORMS: Dict[str, tuple] = {
    "nvmf_get_subsystems": ([("nqn", {"nargs": "?"})], [_TGT]),
    "nvmf_create_subsystem": ([_NQN], [
        _TGT, (("-s", "--serial-number"), "serial_number", {}), (("-d", "--model-number"), "model_number", {}),
        (("-a", "--allow-any-host"), "allow_any_host", _FLAG), (("-m", "--max-namespaces"), "max_namespaces", _INT),
        (("-r", "--ana-reporting"), "ana_reporting", _FLAG), (("-i", "--min-cntlid"), "min_cntlid", _INT),
        (("-I", "--max-cntlid"), "max_cntlid", _INT)]),
    "nvmf_delete_subsystem": ([_NQN], [_TGT]),
    "nvmf_subsystem_add_listener": ([_NQN], _LISTEN + [
        (("-k", "--secure-channel"), "secure_channel", _FLAG), (("-n", "--ana-state"), "ana_state", {}),
        (("-S", "--sock-impl"), "sock_impl", {"action": _NoSockImpl})]),
    "nvmf_subsystem_remove_listener": ([_NQN], _LISTEN),
    "nvmf_subsystem_listener_set_ana_state": ([_NQN], _LISTEN + [
        (("-n", "--ana-state"), "ana_state", {"required": True}), (("-g", "--anagrpid"), "anagrpid", _INT)]),
    "nvmf_subsystem_add_ns": ([_NQN, ("bdev_name", {"metavar": "PATH"})], [
        _TGT, (("-p", "--ptpl-file"), "ptpl_file", {}), (("-n", "--nsid"), "nsid", _INT),
        (("-g", "--nguid"), "nguid", {}), (("-e", "--eui64"), "eui64", {}), (("-u", "--uuid"), "uuid", {}),
        (("-a", "--anagrpid"), "anagrpid", _INT), (("-i", "--no-auto-visible"), "no_auto_visible", _FLAG),
        (("-N", "--hide-metadata"), "hide_metadata", _FLAG)]),
    "nvmf_subsystem_remove_ns": ([_NQN, _NSID], [_TGT]),
    "nvmf_ns_add_host": ([_NQN, _NSID, _HOST], [_TGT]),
    "nvmf_ns_remove_host": ([_NQN, _NSID, _HOST], [_TGT]),
    "nvmf_subsystem_add_host": ([_NQN, _HOST], [_TGT, (("--psk",), "psk", {})] + _KEYS),
    "nvmf_subsystem_remove_host": ([_NQN, _HOST], [_TGT]),
    "nvmf_subsystem_set_keys": ([_NQN, _HOST], [_TGT] + _KEYS),
    "nvmf_subsystem_allow_any_host": ([_NQN], [
        _TGT, (("-e", "--enable"), "enable", _FLAG), (("-d", "--disable"), "disable", _FLAG)]),
    "nvmf_subsystem_get_controllers": ([_NQN], [_TGT]),
    "nvmf_subsystem_get_qpairs": ([_NQN], [_TGT]),
    "nvmf_get_stats": ([], [_TGT]),
    "keyring_file_add_key": ([("name", {}), ("path", {})], []),
    "keyring_file_remove_key": ([("name", {})], []),
    "nvmf_create_transport": ([], [
        (("-t", "--trtype"), "trtype", {"required": True}), (("-g", "--tgt-name"), "tgt_name", {}),
        (("-q", "--max-queue-depth"), "max_queue_depth", _INT),
        (("-m", "--max-io-qpairs-per-ctrlr"), "max_io_qpairs_per_ctrlr", _INT),
        (("-c", "--in-capsule-data-size"), "in_capsule_data_size", _INT),
        (("-i", "--max-io-size"), "max_io_size", _INT), (("-u", "--io-unit-size"), "io_unit_size", _INT),
        (("-a", "--max-aq-depth"), "max_aq_depth", _INT), (("-n", "--num-shared-buffers"), "num_shared_buffers", _INT),
        (("-b", "--buf-cache-size"), "buf_cache_size", _INT), (("-z", "--zcopy"), "zcopy", _FLAG),
        (("-d", "--num-cqe"), "num_cqe", _INT), (("-s", "--max-srq-depth"), "max_srq_depth", _INT),
        (("-r", "--no-srq"), "no_srq", _FLAG), (("-o", "--c2h-success"), "c2h_success", {"action": "store_false"}),
        (("-f", "--dif-insert-or-strip"), "dif_insert_or_strip", _FLAG),
        (("-y", "--sock-priority"), "sock_priority", _INT), (("-l", "--acceptor-backlog"), "acceptor_backlog", _INT),
        (("-x", "--abort-timeout-sec"), "abort_timeout_sec", _INT), (("-w", "--no-wr-batching"), "no_wr_batching", _FLAG),
        (("-e", "--control-msg-num"), "control_msg_num", _INT),
        (("--acceptor-poll-rate",), "acceptor_poll_rate", _INT), (("--ack-timeout",), "ack_timeout", _INT),
        (("--data-wr-pool-size",), "data_wr_pool_size", _INT),
        (("--disable-command-passthru",), "disable_command_passthru", _FLAG),
        (("--kas",), "kas", _INT), (("--min-kato",), "min_kato", _INT)]),
}
_NS_FORM_KEYS = ("bdev_name", "ptpl_file", "nsid", "nguid", "eui64", "uuid", "anagrpid", "no_auto_visible",
                 "hide_metadata")


def _form_parser(method: str) -> argparse.ArgumentParser:
    positionals, options = RPC_FORMS[method]
    p = argparse.ArgumentParser(prog=f"nvmeof-roce rpc {method}", argument_default=argparse.SUPPRESS,
                                description=f"rpc.py's arguments for {method}")
    for name, kwargs in positionals:
        p.add_argument(name, **kwargs)
    for flags, dest, kwargs in options:
        as_parameter = f"--{dest}"  # the JSON parameter's spelling: --serial_number, --no_auto_visible
        flags = flags + ((as_parameter,) if as_parameter not in flags else ())
        p.add_argument(*flags, dest=dest, **kwargs)
    socket_options(p, short="-S" not in p._option_string_actions)
    return p


def _namespace_source(name: str) -> dict:
    """rpc.py's bdev_name positional of nvmf_subsystem_add_ns: here a file or block device (a relative path made
    absolute: the target's working directory is not the caller's); a bdev name (SPDK's Malloc0, Nvme0n1) is
    refused saying how this target makes such a namespace, as it has no bdev layer."""
    if name.startswith("/") or "/" in name or os.path.exists(name):
        return {"path": os.path.abspath(name)}
    raise NvmeofError(
        f"nvmf_subsystem_add_ns (namespace.bdev_name): {name!r} is neither a file nor a block device, and this "
        "target has no bdevs (nothing like SPDK's bdev_malloc_create makes one)",
        "give the path of a file or block device; for a RAM namespace (SPDK's malloc bdev): nvmeof-roce target "
        "add-ns NQN --ram 64M, or rpc nvmf_subsystem_add_ns '{\"nqn\": \"NQN\", \"namespace\": {\"backend\": "
        "\"ram\", \"size\": \"64M\"}}'")


def form_params(method: str, argv) -> tuple:
    """rpc.py's command line for `method` -> (its JSON-RPC params, the --socket/--timeout given among them)."""
    values = vars(_form_parser(method).parse_args(argv))
    given = {k: values.pop(k) for k in ("socket", "timeout") if k in values}
    if method == "nvmf_subsystem_add_ns":  # rpc.py groups these as "namespace"; a bdev name here is a path
        ns = {k: values.pop(k) for k in _NS_FORM_KEYS if k in values}
        ns.update(_namespace_source(ns.pop("bdev_name")))
        values["namespace"] = ns
    elif "traddr" in values:  # rpc.py groups the address as "listen_address"
        values["listen_address"] = {k: values.pop(k) for k in ("trtype", "traddr", "trsvcid", "adrfam")
                                    if k in values}
    elif method == "keyring_file_add_key":  # the caller's relative path, as the target (elsewhere) must read it
        values["path"] = os.path.abspath(values["path"])
    elif method == "nvmf_subsystem_allow_any_host":  # as rpc.py: on unless --disable
        values.pop("enable", None)
        values["allow_any_host"] = not values.pop("disable", False)
    if values.get("nqn") == "discovery":  # rpc.py's shortcut
        values["nqn"] = "nqn.2014-08.org.nvmexpress.discovery"
    return values, given


def _generic_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nvmeof-roce rpc METHOD", argument_default=argparse.SUPPRESS)
    p.add_argument("params", nargs="?", metavar="JSON")
    p.add_argument("--param", "-p", action="append", metavar="KEY=VALUE")
    socket_options(p)
    return p


def _generic_form(argv) -> bool:
    """A JSON object or --param after METHOD: the generic form, not rpc.py's."""
    return bool(argv) and (argv[0].lstrip().startswith("{") or any(
        a == "--param" or a.startswith("--param=") or (a == "-p" and i + 1 < len(argv) and "=" in argv[i + 1])
        for i, a in enumerate(argv)))


def _cmd_rpc(args) -> int:
    if args.method in RPC_FORMS and args.args and not args.param and not _generic_form(args.args):
        params, given = form_params(args.method, args.args)
    else:
        values = vars(_generic_parser().parse_args(args.args))
        given = {k: values[k] for k in ("socket", "timeout") if k in values}
        params = parse_params((args.param or []) + values.get("param", []), values.get("params"))
    for key, value in given.items():
        setattr(args, key, value)
    result = _call(args, args.method, params)
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
    if args.queue_depth:
        ns["queue_depth"] = args.queue_depth
    if args.io_engine:
        ns["io_engine"] = args.io_engine
    for key, value in (("uuid", args.uuid), ("nguid", args.nguid), ("eui64", args.eui64)):
        if value:
            ns[key] = value
    if args.no_auto_visible:
        ns["no_auto_visible"] = True
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


def _cmd_create_subsystem(args) -> int:
    params: Dict[str, Any] = {"nqn": args.nqn, "allow_any_host": args.allow_any_host}
    for key, value in (("serial_number", args.serial), ("model_number", args.model),
                       ("min_cntlid", args.min_cntlid), ("max_cntlid", args.max_cntlid)):
        if value is not None:
            params[key] = value
    result = _call(args, "nvmf_create_subsystem", params)
    return _done(args, result, f"{args.nqn}: created ({'any host' if args.allow_any_host else 'no host allowed yet'}"
                               "; add-listener exports it)")


def _cmd_delete_subsystem(args) -> int:
    result = _call(args, "nvmf_delete_subsystem", {"nqn": args.nqn})
    return _done(args, result, f"{args.nqn}: deleted; its controllers were ended")


def _listen_address(args) -> dict:
    """The listener's address from TRADDR or nvme-cli's -a, -s and -t; the address family from the address."""
    if args.rest is not None:  # listener-ana-state: [TRADDR] STATE
        if len(args.rest) > 2 or len(args.rest) < (1 if args.traddr_opt else 2):
            raise NvmeofError(f"{args.target_command}: give TRADDR STATE, or -a TRADDR and STATE",
                              f"e.g. nvmeof-roce target {args.target_command} {args.nqn} 10.0.0.1 optimized")
        args.state = args.rest[-1]
        args.traddr = args.rest[0] if len(args.rest) == 2 else None
    if args.traddr and args.traddr_opt and args.traddr != args.traddr_opt:
        raise NvmeofError(f"{args.target_command}: two addresses, {args.traddr} and -a {args.traddr_opt}",
                          "give the address once")
    args.traddr = args.traddr or args.traddr_opt
    if not args.traddr:
        raise NvmeofError(f"{args.target_command}: no address given",
                          f"e.g. nvmeof-roce target {args.target_command} {args.nqn} 10.0.0.1 -s 4420 "
                          "(or -a 10.0.0.1)")
    if args.transport is None:  # the target serves several transports
        raise NvmeofError(f"{args.target_command}: no transport given", "give it with -t TRTYPE")
    adrfam = args.adrfam or ("ipv6" if ":" in args.traddr else "ipv4")
    return {"trtype": args.transport.upper(), "adrfam": adrfam, "traddr": args.traddr, "trsvcid": str(args.trsvcid)}


def _cmd_add_listener(args) -> int:
    listen = _listen_address(args)
    result = _call(args, "nvmf_subsystem_add_listener", {"nqn": args.nqn, "listen_address": listen})
    return _done(args, result, f"{args.nqn}: listening on {address(args.traddr, args.trsvcid)}")


def _cmd_rm_listener(args) -> int:
    listen = _listen_address(args)
    result = _call(args, "nvmf_subsystem_remove_listener", {"nqn": args.nqn, "listen_address": listen})
    return _done(args, result, f"{args.nqn}: no longer listening on {address(args.traddr, args.trsvcid)}; controllers "
                               "through it were ended")


def _cmd_listener_ana_state(args) -> int:
    listen = _listen_address(args)  # sets args.state too: [TRADDR] STATE
    params = {"nqn": args.nqn, "listen_address": listen, "ana_state": args.state}
    if args.group is not None:
        params["anagrpid"] = args.group
    result = _call(args, "nvmf_subsystem_listener_set_ana_state", params)
    groups = f"group {args.group}" if args.group is not None else "its namespaces' groups"
    return _done(args, result, f"{args.nqn} on {address(args.traddr, args.trsvcid)}: {groups} {args.state}")


def _cmd_ns_host(args) -> int:
    add = args.target_command == "ns-add-host"
    result = _call(args, "nvmf_ns_add_host" if add else "nvmf_ns_remove_host",
                   {"nqn": args.nqn, "nsid": args.nsid, "host": args.host})
    return _done(args, result, f"{args.nqn}: namespace {args.nsid} is {'now' if add else 'no longer'} visible to "
                               f"{args.host}")


def _cmd_set_qos(args) -> int:
    from ..config import QOS_LIMITS
    params: Dict[str, Any] = {"nqn": args.nqn, "nsid": args.nsid}
    for key in QOS_LIMITS:
        value = getattr(args, key)
        if value is not None:
            params[key] = value
    if len(params) == 2:
        raise NvmeofError("set-qos: no limit given",
                          "give --rw-ios-per-sec, --rw-mbytes-per-sec, --r-mbytes-per-sec or --w-mbytes-per-sec "
                          "(0 removes that limit)")
    result = _call(args, "bdev_set_qos_limit", params)
    limits = ", ".join(f"{k} {v if v else 'unlimited'}" for k, v in params.items() if k in QOS_LIMITS)
    return _done(args, result, f"{args.nqn}: namespace {args.nsid}: {limits}")


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


def _engine_cell(eng) -> str:
    """The engine, its commands in flight and its depth; the native data path's own Reads and Writes beside."""
    if not eng:
        return "inline"
    native = f" +{eng['native_in_flight']} native" if "native_in_flight" in eng else ""
    return f"{eng['engine']} {eng['in_flight']}/{eng['queue_depth']}{native}"


def _fmt_bytes(n) -> str:
    n = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _data_path(s: dict) -> str:
    path = s.get("data_path", "python")
    why = f": {s['data_path_reason']}" if s.get("data_path_reason") else ""
    if path != "native":
        return path + why
    cores = s.get("cores", 1)
    return (f"{path}, {s.get('poll', 'interrupt')} poll" + (f", {cores} poll-group threads" if cores > 1 else "")
            + why)


def _print_status(s: dict) -> None:
    print(f"target {s['config']}  (socket {s['socket']}, discovery generation {s['genctr']}, "
          f"{s['in_flight']} command(s) in flight, {s['internal_errors']} internal error(s), "
          f"data path {_data_path(s)})")
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
                         _engine_cell(eng),
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
    for sub in s["subsystems"]:
        for p in sub.get("pending_namespaces", []):  # storage not reachable yet (engine/pending.py)
            print(f"{sub['nqn']} namespace {p['nsid']} ({p['backend']}): not served yet, {p['state']} (attempt "
                  f"{p['attempts']}, next in {p['next_try_s']:g} s): {p['reason']}" + (f"\n  fix: {p['fix']}"
                                                                                     if p.get("fix") else ""))
    resv_rows = []
    for sub in s["subsystems"]:
        for ns in sub["namespaces"]:
            r = ns.get("reservation")
            if r is not None:
                regs = ", ".join(f"{g['hostid']} key {g['rkey']:#x}{' (holds)' if g['holds'] else ''}"
                                 for g in r["registrants"]) or "none"
                resv_rows.append([sub["nqn"], ns["nsid"], r["holder"] or "-", r["type"] if r["holder"] else "-",
                                  r["generation"], "yes" if r["ptpl"] else "no", regs])
    if resv_rows:
        print()
        print(table(["SUBSYSTEM", "NSID", "RESERVATION HOLDER", "TYPE", "GEN", "PTPL", "REGISTRANTS"], resv_rows))
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
    for q in t.get("closing_queues", []):
        lines.append(f"queue {q['qid']} of {q['peer']} closed {q['closed_s']} s ago, still closing: "
                     f"{q['held_commands']} command(s) held by the device (only its own memory is kept)")
    longest = t["loop"].get("longest_pass_s")
    lines.append("longest loop pass: " + (f"{longest * 1000:.1f} ms" if longest is not None else "not measured"))
    print()
    print("\n".join(lines))


def _cmd_status(args) -> int:
    emit(_call(args, "nvmeof_get_status"), args.json, _print_status)
    return 0


class _NotTheSocket(argparse.Action):
    """-s where a command has no service id: say where the control socket went instead of "unrecognized"."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error("-s is the service id (trsvcid) in every nvmeof-roce command, as in nvme-cli; give the "
                     "control socket as -S PATH or --socket PATH")


def socket_options(p, short: bool = True) -> None:
    """--socket/-S and --timeout of a control socket's client; -s there says that it is the service id."""
    p.add_argument("--socket", *(["-S"] if short else []), metavar="PATH",
                   help="the target's control socket (default: the only one in /run/nvmeof-roce)")
    if "-s" not in p._option_string_actions:
        p.add_argument("-s", action=_NotTheSocket, metavar="PATH", help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, metavar="S", help="seconds to wait for the answer (default 60)")


def _common(p, json_flag: bool = True) -> None:
    socket_options(p)
    p.set_defaults(timeout=60.0)
    if json_flag:
        p.add_argument("--json", action="store_true", help="print the result as JSON")


def _listener_options(p) -> None:
    """nvme-cli's letters for a listener's address, as in `host connect`."""
    p.add_argument("-a", "--traddr", dest="traddr_opt", metavar="TRADDR", help="the address, as nvme-cli's -a")
    p.add_argument("-s", "--trsvcid", default="4420", help="the service (port) number (default 4420)")
    served = registry.served_trtypes()  # the transports `target serve` serves (transport/registry.py)
    p.add_argument("-t", "--transport", type=str.lower, choices=served,
                   default=served[0] if len(served) == 1 else None,
                   help=f"the transport: {' or '.join(served)}, what the userspace target serves")
    p.add_argument("--adrfam", choices=("ipv4", "ipv6"), help="the address family (default: from the address)")


def register_rpc(subparsers) -> None:
    p = subparsers.add_parser("rpc", help="call a method on a running target's control socket",
                              description="Call a JSON-RPC method of a running `target serve` (SPDK's method "
                                          "and parameter names: nvmf_get_subsystems, nvmf_subsystem_add_ns, ...; "
                                          "rpc_get_methods lists them). Parameters come from a JSON object "
                                          "and/or --param KEY=VALUE (dots nest: namespace.size=64M).")
    p.add_argument("method")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS",
                   help="the parameters: one JSON object and/or --param KEY=VALUE, or rpc.py's arguments for METHOD "
                        "(e.g. nvmf_subsystem_add_ns NQN PATH -n 2; `rpc METHOD -h` lists them)")
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
    p.add_argument("--queue-depth", type=int, metavar="N",
                   help="with --path: commands on the device at once (nvmeof_roce.queue_depth, default 128)")
    p.add_argument("--io-engine", choices=NS_IO_ENGINES,
                   help="with --path: force the I/O engine (nvmeof_roce.io_engine; default io_uring where it "
                        "works, else threads)")
    p.add_argument("--uuid")
    p.add_argument("--nguid")
    p.add_argument("--eui64")
    p.add_argument("--no-auto-visible", action="store_true",
                   help="no host sees the namespace until ns-add-host makes it visible to one (SPDK's "
                        "no_auto_visible)")
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

    p = commands.add_parser("create-subsystem", help="create a subsystem in a running target",
                            description="Create subsystem NQN (no namespace, no listener yet: add-ns and "
                                        "add-listener follow). SPDK's nvmf_create_subsystem.")
    p.add_argument("nqn")
    p.add_argument("--serial", help="serial number (default: derived from the NQN)")
    p.add_argument("--model", help="model number")
    p.add_argument("--allow-any-host", action="store_true", help="any host may connect (default: add-host each)")
    p.add_argument("--min-cntlid", type=int, metavar="N")
    p.add_argument("--max-cntlid", type=int, metavar="N")
    _common(p)
    p.set_defaults(func=_cmd_create_subsystem)

    p = commands.add_parser("delete-subsystem", help="delete a subsystem of a running target (its controllers end)")
    p.add_argument("nqn")
    _common(p)
    p.set_defaults(func=_cmd_delete_subsystem)

    for verb, fn, what in (("add-listener", _cmd_add_listener, "export a subsystem on an RDMA address (a new "
                                                                "address opens a port)"),
                           ("rm-listener", _cmd_rm_listener, "stop exporting a subsystem on an address")):
        p = commands.add_parser(verb, help=f"{what} (running target)")
        p.add_argument("nqn")
        p.add_argument("traddr", nargs="?", metavar="TRADDR", help="the IP address of an RDMA netdev")
        _listener_options(p)
        _common(p)
        p.set_defaults(func=fn, rest=None)  # _listen_address: no [TRADDR] STATE here

    p = commands.add_parser("listener-ana-state", help="set the ANA state of a listener's groups (running target)",
                            description="SPDK's nvmf_subsystem_listener_set_ana_state: the ANA state of group "
                                        "--group (default: every group NQN's namespaces use) on the port at "
                                        "TRADDR:TRSVCID. Hosts connected through that port get an ANA change "
                                        "notice. `target ana-state` does the same by port ID.")
    p.add_argument("nqn")
    p.add_argument("rest", nargs="+", metavar="[TRADDR] STATE",
                   help="the listener's address (or -a) and the state: optimized, non_optimized, inaccessible, "
                        "persistent_loss or change")
    _listener_options(p)
    p.add_argument("--group", type=int, metavar="GRPID", help="one ANA group (SPDK's anagrpid)")
    _common(p)
    p.set_defaults(func=_cmd_listener_ana_state)

    for verb, method, what in (("ns-add-host", "nvmf_ns_add_host", "make a namespace visible to a host"),
                               ("ns-rm-host", "nvmf_ns_remove_host", "hide a namespace from a host")):
        p = commands.add_parser(verb, help=f"{what} (running target; the namespace was added with "
                                           "--no-auto-visible)",
                                description=f"SPDK's {method}: the host's connected controllers get a Namespace "
                                            "Attribute Changed notice and see the namespace appear or go.")
        p.add_argument("nqn")
        p.add_argument("nsid", type=int)
        p.add_argument("host", metavar="HOSTNQN")
        _common(p)
        p.set_defaults(func=_cmd_ns_host)

    p = commands.add_parser("set-qos", help="limit a namespace's IOPS and MiB/s (running target)",
                            description="SPDK's bdev_set_qos_limit for namespace NSID of NQN: limits per second; "
                                        "0 removes a limit, a limit not given keeps its value. Commands over a "
                                        "limit wait in the target (they are not failed).")
    p.add_argument("nqn")
    p.add_argument("nsid", type=int)
    for key in ("rw_ios_per_sec", "rw_mbytes_per_sec", "r_mbytes_per_sec", "w_mbytes_per_sec"):
        p.add_argument("--" + key.replace("_", "-"), dest=key, type=int, metavar="N")
    _common(p)
    p.set_defaults(func=_cmd_set_qos)

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

