"""`nvmeof-roce rdma ...`: RDMA devices, GIDs, Soft-RoCE and Soft-iWARP links and the RoCE mode."""
from ..errors import NvmeofError
from ..output import add_json_option as _add_json, emit, table
from . import softroce


def cmd_rdma_status(args):
    r = softroce.status()

    def human(r):
        if not r["devices"]:
            print("no RDMA devices (for Soft-RoCE: nvmeof-roce rdma add-rxe NETDEV)")
            return
        for d in r["devices"]:
            kind = ("Soft-iWARP" if d.get("iwarp") else "Soft-RoCE") if d["soft_roce"] else d.get("node_type")
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


def cmd_rdma_add_link(args):
    r = softroce.add_link(args.kind, args.netdev, args.name)
    emit(r, args.json, lambda r: print(f"added {r['name']} on {r['netdev']}"
                                      + ("" if r["active"] else f" (not ACTIVE yet: is {r['netdev']} up?)")))
    return 0 if r["active"] else 1


def cmd_rdma_del_link(args):
    r = softroce.del_link(args.name)
    emit(r, args.json, lambda r: print(f"deleted {r['name']}"))
    return 0


def cmd_rdma_roce_mode(args):
    if args.device is None:
        r = softroce.all_roce_modes()
        emit(r, args.json, lambda r: print(table(["device", "port", "mode"], [[x["device"], x["port"], x["mode"]]
                                                                             for x in r]) if r else "no RoCE ports"))
        return 0
    if args.port is None:
        raise NvmeofError("roce-mode DEV needs a PORT too", "e.g. nvmeof-roce rdma roce-mode rxe0 1 [v1|v2]")
    if args.mode is None:
        r = softroce.get_roce_mode(args.device, args.port)
        emit(r, args.json, lambda r: print(f"{r['device']} port {r['port']}: RoCE {r['mode']}"))
        return 0
    r = softroce.set_roce_mode(args.device, args.port, args.mode)
    emit(r, args.json, lambda r: print(f"{r['device']} port {r['port']}: RoCE {r['mode']} (was {r['was']})"))
    return 0


def register(subparsers) -> None:
    r = subparsers.add_parser("rdma", help="RDMA devices, GIDs, Soft-RoCE links, RoCE mode")
    rs = r.add_subparsers(dest="rdma_cmd", metavar="ACTION")
    rs.required = True
    x = rs.add_parser("status", help="devices, ports, state, MTU, GID table (RoCE version, netdev)")
    _add_json(x)
    x.set_defaults(func=cmd_rdma_status)
    for kind, (_, label) in softroce.SOFTWARE_LINKS.items():
        x = rs.add_parser(f"add-{kind}", help=f"add a {label} device on NETDEV (rdma link add)")
        x.add_argument("netdev", metavar="NETDEV")
        x.add_argument("--name", default=f"{kind}0", help=f"RDMA device name (default {kind}0)")
        _add_json(x)
        x.set_defaults(func=cmd_rdma_add_link, kind=kind)
        x = rs.add_parser(f"del-{kind}", help=f"delete a {label} device (rdma link delete)")
        x.add_argument("name", metavar="NAME")
        _add_json(x)
        x.set_defaults(func=cmd_rdma_del_link)
    x = rs.add_parser("roce-mode", help="rdma_cm's default RoCE mode: all ports, one port, or set v1/v2")
    x.add_argument("device", metavar="DEV", nargs="?")
    x.add_argument("port", metavar="PORT", nargs="?", type=int)
    x.add_argument("mode", metavar="v1|v2", nargs="?", choices=["v1", "v2"])
    _add_json(x)
    x.set_defaults(func=cmd_rdma_roce_mode)
    x = rs.add_parser("decode", help="decode RoCE v2 frames in a pcap/pcapng capture (BTH, RETH, AETH, NVMe capsules)",
                      description="Per frame: the BTH (opcode, dest QP, PSN, ack request), RETH, AETH, ImmDt/IETH, "
                                  "ICRC check, CM messages, and the NVMe-oF command or response inside SENDs; then a "
                                  "per-flow summary (frames, bytes, retransmitted PSNs, NAKs). Capture with e.g. "
                                  "tcpdump -i eth0 -w FILE udp port 4791.")
    x.add_argument("file", metavar="FILE.pcap")
    x.add_argument("--summary", action="store_true", help="only the per-flow summary")
    _add_json(x)
    x.set_defaults(func=cmd_rdma_decode)


def cmd_rdma_decode(args):
    from ..capture import pcap, roce
    try:
        with open(args.file, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise NvmeofError(f"cannot read {args.file}: {exc.strerror}", "check the path") from None
    result = roce.decode(pcap.read_packets(data, args.file))
    if args.json:
        emit(result.to_dict(frames=not args.summary), True)
        return 0
    if not args.summary:
        for frame in result.frames:
            print(frame.line())
        print()
    print(f"{result.packets} packets, {len(result.frames)} RoCE v2 frames, {result.other} other"
          + (f", {result.bad_icrc} with a bad ICRC" if result.bad_icrc else ""))
    if result.flows:
        print(table(["src", "dst", "dest QP", "qid", "frames", "bytes", "retransmitted PSNs", "NAKs", "RNR NAKs"],
                    [[f.src, f.dst, f"{f.dest_qp:#x}", "" if f.qid is None else f.qid, f.frames, f.bytes,
                      len(f.retransmitted), f.naks, f.rnr_naks] for f in result.flows]))
    return 0
