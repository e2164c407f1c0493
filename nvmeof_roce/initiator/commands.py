"""`nvmeof-roce initiator ...`: the userspace initiator over RDMA, against any NVMe-oF/RDMA target.

    initiator discover     -a ADDR [-s 4420]
    initiator identify     -a ADDR -n NQN [--nsid N]
    initiator ana-log      -a ADDR -n NQN [--groups-only]
    initiator read         -a ADDR -n NQN --nsid N --slba LBA (--blocks N | -c N-1) [--output FILE]
    initiator write        -a ADDR -n NQN --nsid N --slba LBA (--input FILE | --pattern BYTE (--blocks N | -c N-1))

(--block-count/-c is nvme-cli's 0-based count, as in `nvme read -c 7` for 8 blocks.)
    initiator connect-test -a ADDR -n NQN     (connect, identify all namespaces, write/read/verify, disconnect)
    initiator perf         -a ADDR -n NQN     (load generator: queue depth, block size, mix, runtime)
"""
from __future__ import annotations

import contextlib
import os
import time

from ..errors import NvmeofError
from ..nvme.log import (ADRFAM_IPV4, ADRFAM_IPV6, SUBTYPE_NVME, SUBTYPE_REFERRAL, TRTYPE_RDMA)
from ..nvme.status import NvmeStatusError
from ..output import emit, progress, table
from ..transport.contracts import ConnectRejected, TransportError

TRTYPES = {TRTYPE_RDMA: "rdma", 2: "fc", 3: "tcp", 254: "loop"}
ADRFAMS = {ADRFAM_IPV4: "ipv4", ADRFAM_IPV6: "ipv6", 3: "ib", 4: "fc"}
SUBTYPES = {SUBTYPE_REFERRAL: "referral", SUBTYPE_NVME: "nvme subsystem", 3: "current discovery subsystem"}


def _connector(args):
    if getattr(args, "data_path", None) == "native":
        from ..transport.rdma.host_native import NativeRdmaConnector
        return NativeRdmaConnector(args.traddr, args.trsvcid, timeout=args.timeout)
    from ..transport.rdma.host import RdmaConnector
    return RdmaConnector(args.traddr, args.trsvcid, timeout=args.timeout)


def _perf_data_path(args) -> str:
    """--data-path: native when the extension is built (the default), python otherwise or when asked."""
    from .. import native
    if args.data_path is None:
        return "native" if native.available() else "python"
    if args.data_path == "native" and not native.available():
        raise NvmeofError(f"--data-path native: {native.missing_reason}", "or use --data-path python")
    return args.data_path


def _explain(exc: Exception, args) -> NvmeofError:
    """Turn a transport or NVMe failure into a message that names the likely cause."""
    where = f"{args.traddr}:{args.trsvcid}"
    if isinstance(exc, ConnectRejected):
        return NvmeofError(f"{where}: {exc}", "the target refused the queue: check its limits and logs")
    if isinstance(exc, NvmeStatusError) and exc.status & 0x7FF == 0x184:
        return NvmeofError(f"{where}: host {getattr(args, 'hostnqn', None) or 'NQN'} is not allowed on "
                           f"{getattr(args, 'nqn', '')}: {exc}", "add the host NQN to the subsystem's allowed hosts")
    if isinstance(exc, NvmeStatusError) and exc.status & 0x7FF == 0x182:
        return NvmeofError(f"{where}: Connect rejected with Invalid Parameters: {exc}",
                           "check the subsystem NQN (is it exported on this port?) with 'initiator discover'")
    if isinstance(exc, NvmeStatusError) and exc.status & 0x7FF == 0x191:
        return NvmeofError(f"{where}: {exc}", "the target requires DH-HMAC-CHAP: give --dhchap-secret")
    if isinstance(exc, TransportError):
        return NvmeofError(f"{where}: {exc}", "check the address and port, that a target listens there, and "
                                              "'nvmeof-roce rdma status' / 'nvmeof-roce doctor --traddr'")
    return NvmeofError(f"{where}: {exc}")


@contextlib.contextmanager
def _controller(args, nqn, **kw):
    from .controller import Controller
    connector = _connector(args)
    ctrl = None
    try:
        try:
            ctrl = Controller.connect(connector, nqn, hostnqn=args.hostnqn, hostid=args.hostid,
                                      timeout=args.timeout, dhchap_secret=getattr(args, "dhchap_secret", None),
                                      dhchap_ctrl_secret=getattr(args, "dhchap_ctrl_secret", None), **kw)
        except (TransportError, NvmeStatusError) as exc:
            raise _explain(exc, args) from None
        yield ctrl
    finally:
        if ctrl is not None:
            ctrl.close()
        connector.close()


def _entry_dict(entry) -> dict:
    return {"trtype": TRTYPES.get(entry.trtype, str(entry.trtype)), "adrfam": ADRFAMS.get(entry.adrfam, str(entry.adrfam)),
            "subtype": SUBTYPES.get(entry.subtype, str(entry.subtype)), "portid": entry.portid,
            "trsvcid": entry.trsvcid.strip(), "subnqn": entry.subnqn, "traddr": entry.traddr.strip(),
            "treq": entry.treq, "cntlid": entry.cntlid, "asqsz": entry.asqsz}


def cmd_discover(args) -> int:
    from .discovery import discover
    connector = _connector(args)
    try:
        try:
            entries = discover(connector, hostnqn=args.hostnqn, hostid=args.hostid, timeout=args.timeout)
        except (TransportError, NvmeStatusError) as exc:
            raise _explain(exc, args) from None
    finally:
        connector.close()
    result = {"traddr": args.traddr, "trsvcid": args.trsvcid, "records": [_entry_dict(e) for e in entries]}

    def human(r):
        print(f"Discovery log from {r['traddr']}:{r['trsvcid']}: {len(r['records'])} record(s)")
        print(table(["SUBNQN", "TYPE", "TRTYPE", "ADDRESS", "PORTID"],
                    [[e["subnqn"], e["subtype"], e["trtype"], f"{e['traddr']}:{e['trsvcid']}", e["portid"]]
                     for e in r["records"]]))
    emit(result, args.json, human)
    return 0


def _namespace_info(ctrl, nsid) -> dict:
    ns = ctrl.identify_namespace(nsid)
    lba = 1 << ns.lbaf0_lbads
    return {"nsid": nsid, "blocks": ns.nsze, "block_size": lba, "bytes": ns.nsze * lba, "capacity_blocks": ns.ncap,
            "nguid": ns.nguid.hex(), "uuid": _ns_uuid(ctrl, nsid)}


def _ns_uuid(ctrl, nsid):
    try:
        descs = ctrl.namespace_descriptors(nsid)
    except NvmeStatusError:
        return None
    for desc in descs.descriptors:
        if desc.nidt == 3:
            import uuid
            return str(uuid.UUID(bytes=bytes(desc.nid)))
    return None


def cmd_identify(args) -> int:
    with _controller(args, args.nqn, num_io_queues=0) as ctrl:
        idc = ctrl.identify_controller()
        nsids = [args.nsid] if args.nsid else ctrl.active_namespaces()
        result = {"subnqn": idc.subnqn, "cntlid": idc.cntlid, "serial": idc.sn.strip(), "model": idc.mn.strip(),
                  "firmware": idc.fr.strip(), "version": f"{ctrl.vs >> 16}.{(ctrl.vs >> 8) & 0xFF}",
                  "mdts_bytes": (4096 << idc.mdts) if idc.mdts else None, "maxcmd": idc.maxcmd,
                  "ioccsz_bytes": idc.ioccsz * 16, "kas_ms": idc.kas * 100, "nn": idc.nn,
                  "namespaces": [_namespace_info(ctrl, n) for n in nsids]}

    def human(r):
        print(f"{r['subnqn']}: controller {r['cntlid']}, {r['model']} (SN {r['serial']}, FR {r['firmware']}, "
              f"NVMe {r['version']})")
        print(f"  max transfer {r['mdts_bytes'] or 'unlimited'} B, MAXCMD {r['maxcmd']}, "
              f"capsule {r['ioccsz_bytes']} B, keep-alive granularity {r['kas_ms']} ms")
        print(table(["NSID", "BLOCKS", "BLOCK", "BYTES", "UUID"],
                    [[n["nsid"], n["blocks"], n["block_size"], n["bytes"], n["uuid"] or ""] for n in r["namespaces"]]))
    emit(result, args.json, human)
    return 0


def ana_log_dict(log) -> dict:
    return {"chgcnt": log.chgcnt, "groups": [{"grpid": g.grpid, "state": g.state_name, "chgcnt": g.chgcnt,
                                               "nsids": g.nsids} for g in log.groups]}


def cmd_ana_log(args) -> int:
    with _controller(args, args.nqn, num_io_queues=0) as ctrl:
        result = ana_log_dict(ctrl.ana_log(groups_only=args.groups_only))
        result["cntlid"] = ctrl.cntlid

    def human(r):
        print(f"ANA log of controller {r['cntlid']} at {args.traddr}:{args.trsvcid}: change count {r['chgcnt']}, "
              f"{len(r['groups'])} group(s)")
        print(table(["GROUP", "STATE", "NSIDS"],
                    [[g["grpid"], g["state"], " ".join(map(str, g["nsids"])) or "-"] for g in r["groups"]]))
    emit(result, args.json, human)
    return 0
def _block_count(args, default=None):
    """--blocks N, or nvme-cli's 0-based --block-count N-1 (-c): the number of blocks."""
    if args.block_count is not None:
        if args.blocks is not None:
            raise NvmeofError("give --blocks (a count) or --block-count (0-based, as nvme-cli), not both",
                              "--block-count 7 is --blocks 8")
        if args.block_count < 0 or args.block_count > 0xFFFF:
            raise NvmeofError(f"--block-count {args.block_count}: must be 0..65535 (0-based: 0 is one block)",
                              "give the number of blocks minus one")
        return args.block_count + 1
    return args.blocks if args.blocks is not None else default


def cmd_read(args) -> int:
    args.blocks = _block_count(args, 1)
    with _controller(args, args.nqn) as ctrl:
        data = ctrl.read(args.nsid, args.slba, args.blocks)
    if args.output:
        with open(args.output, "wb") as f:
            f.write(data)
        progress(f"read {len(data)} bytes from namespace {args.nsid} LBA {args.slba} into {args.output}")
    elif args.json:
        emit({"nsid": args.nsid, "slba": args.slba, "blocks": args.blocks, "hex": data.hex()}, True)
    else:
        for off in range(0, len(data), 16):
            chunk = data[off:off + 16]
            print(f"{off:08x}  {chunk.hex(' '):<47}  {''.join(chr(c) if 32 <= c < 127 else '.' for c in chunk)}")
    return 0


def cmd_write(args) -> int:
    args.blocks = _block_count(args)
    with _controller(args, args.nqn) as ctrl:
        bs = ctrl.block_size(args.nsid)
        if args.input:
            with open(args.input, "rb") as f:
                data = f.read()
            if len(data) % bs:
                data += bytes(bs - len(data) % bs)  # pad the last block with zeros
        else:
            if not args.blocks:
                raise NvmeofError("write: --pattern needs --blocks (or --block-count)",
                                  "e.g. --pattern 0xA5 --blocks 8 (= --block-count 7)")
            data = bytes([args.pattern]) * (args.blocks * bs)
        ctrl.write(args.nsid, args.slba, data)
    emit({"nsid": args.nsid, "slba": args.slba, "bytes": len(data)}, args.json,
         lambda r: print(f"wrote {r['bytes']} bytes to namespace {r['nsid']} at LBA {r['slba']}"))
    return 0


def cmd_connect_test(args) -> int:
    """Connect, identify every namespace, write/read/verify a pattern (restoring the old data), disconnect."""
    started = time.monotonic()
    steps = []
    with _controller(args, args.nqn, num_io_queues=args.queues) as ctrl:
        steps.append({"step": "connect", "ok": True, "detail": f"controller {ctrl.cntlid}, "
                                                               f"{len(ctrl.io_queues)} I/O queue(s)"})
        nsids = ctrl.active_namespaces()
        for nsid in nsids:
            info = _namespace_info(ctrl, nsid)
            blocks = min(args.blocks, info["blocks"])
            slba = max(0, info["blocks"] - blocks) if args.at_end else 0
            saved = ctrl.read(nsid, slba, blocks)
            pattern = os.urandom(blocks * info["block_size"])
            ctrl.write(nsid, slba, pattern)
            back = ctrl.read(nsid, slba, blocks)
            ctrl.write(nsid, slba, saved)  # leave the namespace as we found it
            ok = back == pattern
            steps.append({"step": f"namespace {nsid}", "ok": ok,
                          "detail": f"{info['bytes']} B, {info['block_size']} B blocks; wrote, read and "
                                    f"verified {len(pattern)} B at LBA {slba}" + ("" if ok else ": MISMATCH")})
    result = {"subnqn": args.nqn, "traddr": args.traddr, "ok": all(s["ok"] for s in steps),
              "namespaces": len(nsids), "seconds": round(time.monotonic() - started, 2), "steps": steps}

    def human(r):
        for s in r["steps"]:
            print(f"{'ok  ' if s['ok'] else 'FAIL'} {s['step']}: {s['detail']}")
        print(f"{'PASSED' if r['ok'] else 'FAILED'}: {r['subnqn']} at {r['traddr']} in {r['seconds']} s")
    emit(result, args.json, human)
    return 0 if result["ok"] else 1


def cmd_perf(args) -> int:
    from .perf import run_perf, run_perf_native
    args.data_path = _perf_data_path(args)
    run = run_perf_native if args.data_path == "native" else run_perf
    with _controller(args, args.nqn, num_io_queues=args.queues, queue_size=args.queue_depth + 1) as ctrl:
        progress(f"perf: {args.block_size} B, QD {args.queue_depth} x {len(ctrl.io_queues)} queue(s), "
                 f"{args.read_percent}% reads, {args.runtime} s, {args.data_path} data path")
        extra = {"busy_poll": True} if args.busy_poll else {}
        if args.busy_poll and args.data_path != "native":
            raise NvmeofError("--busy-poll is for the native data path", "drop it, or use --data-path native")
        try:
            result = run(ctrl, args.nsid, block_size=args.block_size, queue_depth=args.queue_depth,
                         read_percent=args.read_percent, runtime=args.runtime, ramp=args.ramp, **extra)
        except TransportError as exc:
            raise _explain(exc, args) from None
    data = result.to_dict()

    def human(r):
        lat = r["latency_us"]
        print(f"IOPS {r['iops']:.0f}  bandwidth {r['bandwidth_bytes'] / 1e6:.2f} MB/s  errors {r['errors']}  "
              f"({r['data_path']} data path)")
        print(f"latency us: mean {lat['mean']:.0f}  p50 {lat['p50']:.0f}  p90 {lat['p90']:.0f}  "
              f"p99 {lat['p99']:.0f}  p99.9 {lat['p99.9']:.0f}")
    emit(data, args.json, human)
    return 1 if result.errors else 0


def _common(p, nqn: bool = True) -> None:
    p.add_argument("-t", "--transport", type=str.lower, choices=("rdma",), default="rdma",
                   help="as nvme-cli's -t: rdma, the transport the userspace initiator speaks")
    p.add_argument("-a", "--traddr", required=True, help="target IP address (an RDMA netdev's address)")
    p.add_argument("-s", "--trsvcid", type=int, default=4420, help="service (port), default 4420")
    if nqn:
        p.add_argument("-n", "--nqn", required=True, help="subsystem NQN")
    p.add_argument("-q", "--hostnqn", help="host NQN (default: /etc/nvme/hostnqn, else generated)")
    p.add_argument("-I", "--hostid", help="host ID UUID (default: /etc/nvme/hostid, else generated)")
    if nqn:
        p.add_argument("-S", "--dhchap-secret", metavar="DHHC-1:NN:...:",
                       help="DH-HMAC-CHAP host key: authenticate when the target asks (as nvme connect -S)")
        p.add_argument("-C", "--dhchap-ctrl-secret", metavar="DHHC-1:NN:...:",
                       help="DH-HMAC-CHAP controller key: also authenticate the target (bidirectional)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per connection step and command")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _int(text: str) -> int:
    return int(text, 0)


def register(subparsers) -> None:
    ini = subparsers.add_parser("initiator", help="the userspace NVMe-oF/RDMA initiator",
                                description="Talk NVMe-oF over RDMA from userspace (pyverbs) to any target: "
                                            "ours or the kernel's nvmet-rdma.")
    sub = ini.add_subparsers(dest="initiator_command", metavar="SUBCOMMAND")
    ini.set_defaults(func=lambda args: ini.print_help() or 2)

    p = sub.add_parser("discover", help="read a discovery controller's log")
    _common(p, nqn=False)
    p.set_defaults(func=cmd_discover)

    p = sub.add_parser("identify", help="identify a controller and its namespaces")
    _common(p)
    p.add_argument("--nsid", type=int, help="only this namespace")
    p.set_defaults(func=cmd_identify)

    p = sub.add_parser("ana-log", help="read the ANA log: each ANA group's state on this path, and its namespaces")
    _common(p)
    p.add_argument("--groups-only", action="store_true", help="RGO: groups and states without the NSID lists")
    p.set_defaults(func=cmd_ana_log)

    p = sub.add_parser("read", help="read blocks (hex dump, or --output FILE)")
    _common(p)
    p.add_argument("--nsid", type=int, default=1)
    p.add_argument("--slba", type=_int, default=0, help="first LBA")
    p.add_argument("--blocks", type=int, help="number of blocks (default 1)")
    p.add_argument("-c", "--block-count", type=int, help="nvme-cli's 0-based count: blocks minus one")
    p.add_argument("--output", metavar="FILE")
    p.set_defaults(func=cmd_read)

    p = sub.add_parser("write", help="write blocks from --input FILE or a --pattern byte")
    _common(p)
    p.add_argument("--nsid", type=int, default=1)
    p.add_argument("--slba", type=_int, default=0, help="first LBA")
    p.add_argument("--input", metavar="FILE")
    p.add_argument("--pattern", type=_int, default=0xA5, help="byte to fill with (default 0xA5)")
    p.add_argument("--blocks", type=int, help="number of blocks for --pattern")
    p.add_argument("-c", "--block-count", type=int, help="nvme-cli's 0-based count for --pattern: blocks minus one")
    p.set_defaults(func=cmd_write)

    p = sub.add_parser("connect-test", help="connect, identify, write/read/verify every namespace, disconnect",
                       description="A non-destructive end-to-end check: the tested blocks are read first and "
                                   "written back afterwards.")
    _common(p)
    p.add_argument("--queues", type=int, default=2, help="I/O queues (default 2)")
    p.add_argument("--blocks", type=int, default=256, help="blocks to test per namespace (default 256)")
    p.add_argument("--at-end", action="store_true", help="test the last blocks instead of the first")
    p.set_defaults(func=cmd_connect_test)

    p = sub.add_parser("perf", help="load generator with latency percentiles (like SPDK perf)")
    _common(p)
    p.add_argument("--nsid", type=int, default=1)
    p.add_argument("--block-size", type=int, default=4096, help="I/O size in bytes (default 4096)")
    p.add_argument("-d", "--queue-depth", type=int, default=32, help="commands in flight per queue (default 32)")
    p.add_argument("-M", "--read-percent", type=int, default=100, help="percent reads (default 100)")
    p.add_argument("--runtime", type=float, default=10.0, help="seconds (default 10)")
    p.add_argument("--ramp", type=float, default=1.0, help="seconds before measuring (default 1)")
    p.add_argument("--queues", type=int, default=1, help="I/O queues (default 1; on the native data path one "
                                                          "thread each)")
    p.add_argument("--data-path", choices=("native", "python"), default=None,
                   help="the I/O queues' loop in C (native, the default when the extension is built) or in Python")
    p.add_argument("--busy-poll", action="store_true",
                   help="native data path: poll the CQ without ever sleeping (default: sleep on the completion "
                        "channel after 64 empty polls, leaving the CPU to a software RDMA device)")
    p.set_defaults(func=cmd_perf)
