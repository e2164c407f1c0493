"""`nvmeof-roce nvmet ...`: the kernel NVMe target through configfs."""
import argparse
import os

from ..config import load_config
from ..output import add_json_option as _add_json, emit
from . import apply as applymod
from .nvmet import DEFAULT_SAVE_FILE, NVMET_ROOT, NvmetError, Root, save_json
from .nvmet_hosts import DEBUGFS_NVMET, NOT_EXPOSED, connected_hosts


def _root(args) -> Root:
    return Root(getattr(args, "root", None) or NVMET_ROOT)




def _missing_devices(cfg) -> list:
    """What the kernel would take in the file but not enable: namespaces whose device is not on this machine."""
    warnings = []
    for i, s in enumerate(cfg.subsystems):
        for j, ns in enumerate(s.namespaces):
            if ns.enabled and ns.path and not os.path.exists(ns.path):
                warnings.append(f"subsystems[{i}].namespaces[{j}].device.path: {ns.path} does not exist here; "
                                "the kernel takes the namespace but cannot enable it until it does")
    return warnings


def cmd_nvmet_apply(args):
    cfg = load_config(args.file)
    applymod.kernel_dict(cfg)  # its refusals before anything is mapped or changed
    offline = ""
    try:
        root = _root(args)
        current = root.dump()
    except NvmetError as exc:
        if not args.dry_run:
            raise
        # the offline check of a kernel config: no kernel target here, so the plan is against an empty one
        offline, current = exc.message, {"hosts": [], "ports": [], "subsystems": []}
    mapped, devices = applymod.map_rbd(cfg, dry_run=args.dry_run)  # rbd namespaces: krbd devices
    desired = applymod.kernel_dict(cfg, devices)
    steps = applymod.plan(current, desired, prune=args.prune)
    if args.dry_run:
        warnings = _missing_devices(cfg)
        steps = mapped + steps + applymod.unmap_released(
            current, applymod._planned_after(current, desired, args.prune), dry_run=True)

        def text(_r):
            if offline:
                print(f"offline: {offline}; planned against an empty kernel target")
            print("\n".join(str(s) for s in steps) if steps else "nothing to change")
            for w in warnings:
                print(f"warning: {w}")
        emit({"file": args.file, "dry_run": True, "offline": bool(offline), "offline_reason": offline,
              "warnings": warnings, "steps": [s.to_dict() for s in steps]}, args.json, text)
        return 0
    done = mapped + applymod.execute(root, steps)
    done += applymod.unmap_released(current, root.dump())
    emit({"file": args.file, "dry_run": False, "steps": [s.to_dict() for s in done]}, args.json,
         lambda r: print("\n".join(str(s) for s in done) if done else "nothing to change"))
    return 0


def cmd_nvmet_restore(args):
    """nvmetcli restore: make the kernel match FILE (default /etc/nvmet/config.json); no file is not an error."""
    path = args.file or DEFAULT_SAVE_FILE
    if not os.path.exists(path):
        emit({"file": path, "restored": False, "reason": "no such file"}, args.json,
             lambda r: print(f"{path}: no saved config, nothing to restore"))
        return 0
    cfg = load_config(path)
    root = _root(args)
    done = applymod.apply(root, cfg)
    emit({"file": path, "restored": True, "steps": [s.to_dict() for s in done]}, args.json,
         lambda r: print(f"restored {len(cfg.subsystems)} subsystem(s), {len(cfg.ports)} port(s) from {path}"
                         f" ({len(done)} change(s))"))
    return 0


def cmd_nvmet_save(args):
    root = _root(args)
    data = root.dump()
    path = args.file or DEFAULT_SAVE_FILE
    save_json(data, path)
    emit({"file": path, "subsystems": len(data["subsystems"]), "ports": len(data["ports"]),
          "hosts": len(data["hosts"])}, args.json,
         lambda r: print(f"saved {r['subsystems']} subsystem(s), {r['ports']} port(s), {r['hosts']} host(s) to {path}"))
    return 0


def cmd_nvmet_clear(args):
    root = _root(args)
    before = root.dump()
    root.clear()
    applymod.unmap_released(before, {})  # krbd devices its namespaces used (nvmet apply of rbd namespaces)
    emit({"removed": {"subsystems": [s["nqn"] for s in before["subsystems"]],
                      "ports": [p["portid"] for p in before["ports"]],
                      "hosts": [h["nqn"] for h in before["hosts"]]}}, args.json,
         lambda r: print(f"removed {len(before['subsystems'])} subsystem(s), {len(before['ports'])} port(s), "
                         f"{len(before['hosts'])} host(s)"))
    return 0


def show_text(d: dict, root_path: str = NVMET_ROOT) -> str:
    lines = [f"nvmet ({root_path})"]
    lines.append(f"  hosts ({len(d['hosts'])})")
    for h in d["hosts"]:
        lines.append(f"    {h['nqn']}")
    lines.append(f"  subsystems ({len(d['subsystems'])})")
    for s in d["subsystems"]:
        a = s.get("attr", {})
        lines.append(f"    {s['nqn']}  allow_any_host={a.get('allow_any_host')} serial={a.get('serial')} "
                     f"model={a.get('model')}")
        for n in s.get("namespaces", []):
            dev = n.get("device", {})
            flags = "enabled" if n.get("enable") else "disabled"
            if n.get("buffered_io"):
                flags += ", buffered_io"
            lines.append(f"      namespace {n['nsid']}: {dev.get('path') or '(no device)'}  {flags}  "
                         f"uuid={dev.get('uuid')}  ana_grpid={n.get('ana_grpid')}")
        for h in s.get("allowed_hosts", []):
            lines.append(f"      allowed host {h}")
    lines.append(f"  ports ({len(d['ports'])})")
    for p in d["ports"]:
        a = p.get("addr", {})
        state = "enabled" if p.get("subsystems") else "not enabled (no subsystem linked)"
        lines.append(f"    {p['portid']}: {a.get('trtype')} {a.get('adrfam')} {a.get('traddr')}:{a.get('trsvcid')}  "
                     f"{state}")
        for nqn in p.get("subsystems", []):
            lines.append(f"      subsystem {nqn}")
        for r in p.get("referrals", []):
            ra = r.get("addr", {})
            lines.append(f"      referral {r['name']}: {ra.get('trtype')} {ra.get('traddr')}:{ra.get('trsvcid')}")
    return "\n".join(lines)


def connected_text(hosts) -> str:
    if hosts is None:
        return f"  connected hosts: unknown: {NOT_EXPOSED}"
    lines = [f"  connected hosts ({len(hosts)})"]
    for h in hosts:
        lines.append(f"    {h['hostnqn']}  {h['subnqn']} controller {h['cntlid']}  port {h['port']}  "
                     f"{h['host_traddr'] or '?'}  {h['state']}  kato {h['kato']}")
    return "\n".join(lines)


def cmd_nvmet_show(args):
    root = _root(args)
    d = root.dump()
    hosts = connected_hosts(args.debugfs)
    if args.json and args.connected:  # beside the config, which stays nvmetcli's format without --connected
        emit({"config": d, "connected_hosts": hosts, "connected_hosts_note": "" if hosts is not None
              else NOT_EXPOSED}, True)
        return 0
    emit(d, args.json, lambda r: print(show_text(r, root.path) + "\n" + connected_text(hosts)))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("nvmet", help="the kernel NVMe target (nvmet) through configfs",
                              description="Apply, save, clear and show the kernel target's configuration. The file "
                              "format is nvmetcli's /etc/nvmet/config.json (see docs/kernel.md).")
    p.add_argument("--root", default=NVMET_ROOT, help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="nvmet_cmd", metavar="ACTION")
    sub.required = True
    a = sub.add_parser("apply", help="make the kernel match FILE: create, change and remove only what differs")
    a.add_argument("file", metavar="FILE")
    a.add_argument("--dry-run", action="store_true", help="print the plan, change nothing; without a kernel target here (no "
                   "configfs or nvmet), the offline check of FILE: planned against an empty target")
    a.add_argument("--no-prune", dest="prune", action="store_false",
                   help="do not remove subsystems, ports or hosts that FILE does not name")
    _add_json(a)
    a.set_defaults(func=cmd_nvmet_apply)
    r = sub.add_parser("restore", help=f"apply FILE (default {DEFAULT_SAVE_FILE}) as at boot; no file: exit 0",
                       description="What nvmetcli restore does at boot: make the kernel target match FILE. A "
                                   "missing FILE is not an error (nothing was saved yet).")
    r.add_argument("file", metavar="FILE", nargs="?")
    _add_json(r)
    r.set_defaults(func=cmd_nvmet_restore)
    s = sub.add_parser("save", help=f"write the running config to FILE (default {DEFAULT_SAVE_FILE}), atomically")
    s.add_argument("file", metavar="FILE", nargs="?")
    _add_json(s)
    s.set_defaults(func=cmd_nvmet_save)
    c = sub.add_parser("clear", help="remove every port, subsystem and host")
    _add_json(c)
    c.set_defaults(func=cmd_nvmet_clear)
    sh = sub.add_parser("show", help="show the running config and connected hosts (--json: nvmetcli's format)")
    _add_json(sh)
    sh.add_argument("--connected", action="store_true",
                    help="with --json: {config, connected_hosts} (hosts listed where the kernel exposes them)")
    sh.add_argument("--debugfs", default=DEBUGFS_NVMET, help=argparse.SUPPRESS)
    sh.set_defaults(func=cmd_nvmet_show)
