"""`nvmeof-roce nvmet ...`, `nvmeof-roce host ...` (the kernel host, through nvme-cli) and `nvmeof-roce rdma ...`."""
import argparse

from ..errors import NvmeofError
from ..output import emit, table
from ..target.config import load_config
from . import apply as applymod
from . import nvme_cli, rdma
from .nvmet import DEFAULT_SAVE_FILE, NVMET_ROOT, Root, save_json


# --------------------------------------------------------------------------- nvmet

def _root(args) -> Root:
    return Root(getattr(args, "root", None) or NVMET_ROOT)


def _add_json(p):
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def cmd_nvmet_apply(args):
    cfg = load_config(args.file)
    root = _root(args)
    desired = applymod.kernel_dict(cfg)
    steps = applymod.plan(root.dump(), desired, prune=args.prune)
    if args.dry_run:
        emit({"file": args.file, "dry_run": True, "steps": [s.to_dict() for s in steps]}, args.json,
             lambda r: print("\n".join(str(s) for s in steps) if steps else "nothing to change"))
        return 0
    done = applymod.execute(root, steps)
    emit({"file": args.file, "dry_run": False, "steps": [s.to_dict() for s in done]}, args.json,
         lambda r: print("\n".join(str(s) for s in done) if done else "nothing to change"))
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


def cmd_nvmet_show(args):
    root = _root(args)
    d = root.dump()
    emit(d, args.json, lambda r: print(show_text(r, root.path)))
    return 0


# --------------------------------------------------------------------------- host (kernel nvme-cli)

def _cli() -> nvme_cli.NvmeCli:
    return nvme_cli.NvmeCli()


def _addr_opts(p, nqn=False, nqn_required=True):
    p.add_argument("-t", "--transport", default="rdma", choices=["rdma", "tcp", "fc", "loop"],
                   help="transport (default rdma)")
    p.add_argument("-a", "--traddr", required=True, help="target address, e.g. 10.99.0.1")
    p.add_argument("-s", "--trsvcid", default="4420", help="target service id (port), default 4420")
    p.add_argument("-w", "--host-traddr", help="local address to connect from")
    p.add_argument("-q", "--hostnqn", help="host NQN (default /etc/nvme/hostnqn, else generated from the machine id)")
    p.add_argument("-I", "--hostid", help="host ID (default /etc/nvme/hostid, else generated)")
    if nqn:
        p.add_argument("-n", "--nqn", required=nqn_required, help="subsystem NQN")


def _tuning_opts(p):
    p.add_argument("-i", "--nr-io-queues", type=int, help="number of I/O queues")
    p.add_argument("-Q", "--queue-size", type=int, help="I/O queue depth")
    p.add_argument("-k", "--keep-alive-tmo", type=int, help="keep-alive timeout, seconds")
    p.add_argument("-l", "--ctrl-loss-tmo", type=int, help="controller loss timeout, seconds (-1: forever)")
    p.add_argument("-c", "--reconnect-delay", type=int, help="seconds between reconnect attempts")


def _tuning(args):
    for name, lo in (("nr_io_queues", 1), ("queue_size", 2), ("keep_alive_tmo", 0), ("reconnect_delay", 1)):
        v = getattr(args, name)
        if v is not None and v < lo:
            raise NvmeofError(f"--{name.replace('_', '-')} {v}: must be at least {lo}",
                              f"give --{name.replace('_', '-')} >= {lo}")
    if args.ctrl_loss_tmo is not None and args.ctrl_loss_tmo < -1:
        raise NvmeofError(f"--ctrl-loss-tmo {args.ctrl_loss_tmo}: must be -1 (forever) or >= 0", "give -1 or more")
    return {k: getattr(args, k) for k in ("nr_io_queues", "queue_size", "keep_alive_tmo", "ctrl_loss_tmo",
                                          "reconnect_delay")}


def _check_svc(args):
    if args.transport in ("rdma", "tcp"):
        try:
            v = int(args.trsvcid)
            assert 1 <= v <= 65535
        except (ValueError, AssertionError):
            raise NvmeofError(f"--trsvcid {args.trsvcid!r}: must be a port number 1..65535",
                              "NVMe-oF uses 4420") from None


def cmd_host_discover(args):
    _check_svc(args)
    r = _cli().discover(args.traddr, args.trsvcid, args.transport, args.hostnqn, args.hostid, args.host_traddr)

    def human(r):
        print(f"discovery log of {args.traddr}:{args.trsvcid} ({len(r['records'])} records, generation {r['genctr']})")
        print(table(["subtype", "subnqn", "trtype", "traddr", "trsvcid", "portid"],
                    [[x.get("subtype"), x.get("subnqn"), x.get("trtype"), x.get("traddr"), x.get("trsvcid"),
                      x.get("portid")] for x in r["records"]]))
    emit(r, args.json, human)
    return 0


def cmd_host_connect(args):
    _check_svc(args)
    r = _cli().connect(args.traddr, args.nqn, args.trsvcid, args.transport, args.hostnqn, args.hostid,
                       args.host_traddr, **_tuning(args))
    emit(r, args.json, lambda r: print(f"connected {r['nqn']} at {r['traddr']}:{r['trsvcid']} as {r['controller']}"))
    return 0


def cmd_host_connect_all(args):
    _check_svc(args)
    r = _cli().connect_all(args.traddr, args.trsvcid, args.transport, args.hostnqn, args.hostid, args.host_traddr,
                           **_tuning(args))

    def human(r):
        for c in r["connected"]:
            print(f"connected {c['nqn']} as {c['controller']}")
        for nqn in r["not_connected"]:
            print(f"not connected: {nqn} (already connected elsewhere, or this host is not allowed; see dmesg)")
        if not r["connected"] and not r["not_connected"]:
            print("nothing to connect (every subsystem in the discovery log is already connected)")
    emit(r, args.json, human)
    return 1 if r["not_connected"] and not r["connected"] else 0


def cmd_host_disconnect(args):
    if not args.nqn and not args.device:
        raise NvmeofError("host disconnect: give --nqn NQN or --device nvmeN", "nvmeof-roce host list shows them")
    r = _cli().disconnect(args.nqn, args.device)
    emit(r, args.json, lambda r: print(f"disconnected {r['disconnected']} controller(s) of {args.nqn or args.device}"))
    return 0


def cmd_host_disconnect_all(args):
    r = _cli().disconnect_all()
    emit(r, args.json, lambda r: print(f"disconnected {len(r['disconnected'])} controller(s)"))
    return 0


def cmd_host_list(args):
    r = _cli().list()

    def human(r):
        if not r["subsystems"]:
            print("no NVMe-oF subsystems connected")
            return
        for s in r["subsystems"]:
            print(f"{s['name']}  {s['nqn']}")
            for p in s["paths"]:
                print(f"  {p['name']}  {p['transport']}  {p['traddr']}:{p['trsvcid']}  {p['state']}")
            for n in s.get("namespaces", []):
                size = n.get("size_bytes")
                print(f"  {n['device']}  nsid {n['nsid']}  {size if size is not None else '?'} bytes  "
                      f"{n.get('sector_size')}-byte sectors")
    emit(r, args.json, human)
    return 0


# --------------------------------------------------------------------------- rdma

def cmd_rdma_status(args):
    r = rdma.status()

    def human(r):
        if not r["devices"]:
            print("no RDMA devices (for Soft-RoCE: nvmeof-roce rdma add-rxe NETDEV)")
            return
        for d in r["devices"]:
            kind = "Soft-RoCE" if d["soft_roce"] else d.get("node_type")
            print(f"{d['name']}  {kind}  node_guid {d['node_guid']}")
            for p in d["ports"]:
                print(f"  port {p['port']}: {p['state']} ({p['phys_state']}), {p['link_layer']}, netdev {p['netdev']}, "
                      f"active MTU {p['active_mtu']}, default RoCE mode {p.get('default_roce_mode') or '?'}")
                if p["gids"]:
                    print("    " + table(["index", "gid", "type", "netdev", "ip"],
                                         [[g["index"], g["gid"], g["type"], g["netdev"], g["ip"]] for g in p["gids"]]
                                         ).replace("\n", "\n    "))
    emit(r, args.json, human)
    return 0


def cmd_rdma_add_rxe(args):
    r = rdma.add_rxe(args.netdev, args.name)
    emit(r, args.json, lambda r: print(f"added {r['name']} on {r['netdev']}"
                                      + ("" if r["active"] else f" (not ACTIVE yet: is {r['netdev']} up?)")))
    return 0 if r["active"] else 1


def cmd_rdma_del_rxe(args):
    r = rdma.del_rxe(args.name)
    emit(r, args.json, lambda r: print(f"deleted {r['name']}"))
    return 0


def cmd_rdma_roce_mode(args):
    if args.device is None:
        r = rdma.all_roce_modes()
        emit(r, args.json, lambda r: print(table(["device", "port", "mode"], [[x["device"], x["port"], x["mode"]]
                                                                             for x in r]) if r else "no RoCE ports"))
        return 0
    if args.port is None:
        raise NvmeofError("roce-mode DEV needs a PORT too", "e.g. nvmeof-roce rdma roce-mode rxe0 1 [v1|v2]")
    if args.mode is None:
        r = rdma.get_roce_mode(args.device, args.port)
        emit(r, args.json, lambda r: print(f"{r['device']} port {r['port']}: RoCE {r['mode']}"))
        return 0
    r = rdma.set_roce_mode(args.device, args.port, args.mode)
    emit(r, args.json, lambda r: print(f"{r['device']} port {r['port']}: RoCE {r['mode']} (was {r['was']})"))
    return 0


# --------------------------------------------------------------------------- registration

def register(subparsers) -> None:
    p = subparsers.add_parser("nvmet", help="the kernel NVMe target (nvmet) through configfs",
                              description="Apply, save, clear and show the kernel target's configuration. The file "
                              "format is nvmetcli's /etc/nvmet/config.json (see docs/kernel.md).")
    p.add_argument("--root", default=NVMET_ROOT, help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="nvmet_cmd", metavar="ACTION")
    sub.required = True
    a = sub.add_parser("apply", help="make the kernel match FILE: create, change and remove only what differs")
    a.add_argument("file", metavar="FILE")
    a.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    a.add_argument("--no-prune", dest="prune", action="store_false",
                   help="do not remove subsystems, ports or hosts that FILE does not name")
    _add_json(a)
    a.set_defaults(func=cmd_nvmet_apply)
    s = sub.add_parser("save", help=f"write the running config to FILE (default {DEFAULT_SAVE_FILE}), atomically")
    s.add_argument("file", metavar="FILE", nargs="?")
    _add_json(s)
    s.set_defaults(func=cmd_nvmet_save)
    c = sub.add_parser("clear", help="remove every port, subsystem and host")
    _add_json(c)
    c.set_defaults(func=cmd_nvmet_clear)
    sh = sub.add_parser("show", help="show the running config (--json: nvmetcli's format)")
    _add_json(sh)
    sh.set_defaults(func=cmd_nvmet_show)

    h = subparsers.add_parser("host", help="the kernel NVMe host through nvme-cli: discover, connect, list",
                              description="The Linux kernel's NVMe-oF host driver, through nvme-cli. (The userspace "
                              "initiator is `nvmeof-roce initiator`.)")
    hs = h.add_subparsers(dest="host_cmd", metavar="ACTION")
    hs.required = True
    x = hs.add_parser("discover", help="read a discovery controller's log")
    _addr_opts(x)
    _add_json(x)
    x.set_defaults(func=cmd_host_discover)
    x = hs.add_parser("connect", help="connect to a subsystem")
    _addr_opts(x, nqn=True)
    _tuning_opts(x)
    _add_json(x)
    x.set_defaults(func=cmd_host_connect)
    x = hs.add_parser("connect-all", help="connect to every subsystem a discovery controller lists")
    _addr_opts(x)
    _tuning_opts(x)
    _add_json(x)
    x.set_defaults(func=cmd_host_connect_all)
    x = hs.add_parser("disconnect", help="disconnect a subsystem (--nqn) or a controller (--device)")
    x.add_argument("-n", "--nqn", help="subsystem NQN")
    x.add_argument("-d", "--device", help="controller, e.g. nvme0")
    _add_json(x)
    x.set_defaults(func=cmd_host_disconnect)
    x = hs.add_parser("disconnect-all", help="disconnect every NVMe-oF controller")
    _add_json(x)
    x.set_defaults(func=cmd_host_disconnect_all)
    x = hs.add_parser("list", help="connected subsystems, their paths and namespaces")
    _add_json(x)
    x.set_defaults(func=cmd_host_list)

    r = subparsers.add_parser("rdma", help="RDMA devices, GIDs, Soft-RoCE links, RoCE mode")
    rs = r.add_subparsers(dest="rdma_cmd", metavar="ACTION")
    rs.required = True
    x = rs.add_parser("status", help="devices, ports, state, MTU, GID table (RoCE version, netdev)")
    _add_json(x)
    x.set_defaults(func=cmd_rdma_status)
    x = rs.add_parser("add-rxe", help="add a Soft-RoCE device on NETDEV (rdma link add)")
    x.add_argument("netdev", metavar="NETDEV")
    x.add_argument("--name", default="rxe0", help="RDMA device name (default rxe0)")
    _add_json(x)
    x.set_defaults(func=cmd_rdma_add_rxe)
    x = rs.add_parser("del-rxe", help="delete a Soft-RoCE device (rdma link delete)")
    x.add_argument("name", metavar="NAME")
    _add_json(x)
    x.set_defaults(func=cmd_rdma_del_rxe)
    x = rs.add_parser("roce-mode", help="rdma_cm's default RoCE mode: all ports, one port, or set v1/v2")
    x.add_argument("device", metavar="DEV", nargs="?")
    x.add_argument("port", metavar="PORT", nargs="?", type=int)
    x.add_argument("mode", metavar="v1|v2", nargs="?", choices=["v1", "v2"])
    _add_json(x)
    x.set_defaults(func=cmd_rdma_roce_mode)
