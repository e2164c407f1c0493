"""`nvmeof-roce host ...`: the Linux kernel NVMe-oF host, through nvme-cli.

(The userspace initiator is `nvmeof-roce initiator`, in nvmeof_roce/initiator/.)"""
from ..errors import NvmeofError
from ..output import add_output_format, address, emit, table
from ..transport import registry
from . import nvme_cli


def _add_json(p):
    p.add_argument("--json", action="store_true", help="print the result as JSON (= -o json)")
    add_output_format(p)


def _cli(args=None) -> nvme_cli.NvmeCli:
    return nvme_cli.NvmeCli(config_json=getattr(args, "config", None))


def _addr_opts(p, nqn=False, nqn_required=True, traddr_required=True):
    p.add_argument("-t", "--transport", default="rdma", choices=["rdma", "tcp", "fc", "loop"],
                   help="transport (default rdma)")
    p.add_argument("-a", "--traddr", required=traddr_required,
                   help="target address, e.g. 10.99.0.1" + ("" if traddr_required else
                                                            " (default: every line of /etc/nvme/discovery.conf)"))
    p.add_argument("-s", "--trsvcid", default="4420", help="target service id (port), default 4420")
    p.add_argument("-w", "--host-traddr", help="local address to connect from")
    p.add_argument("-f", "--host-iface", help="local network interface to connect from (tcp only, as nvme-cli)")
    p.add_argument("-q", "--hostnqn", help="host NQN (default: as nvme-cli: the -J file's first host, "
                                           "/etc/nvme/hostnqn, else from the machine's DMI UUID)")
    p.add_argument("-I", "--hostid", help="host ID (default: as nvme-cli: the -J file's first host, /etc/nvme/hostid, "
                                          "the host NQN's UUID, else the machine's DMI UUID)")
    p.add_argument("-J", "--config", metavar="FILE",
                   help="libnvme's JSON config (default /etc/nvme/config.json; 'none' to not read it): its first "
                        "host gives the host NQN and ID, and nvme-cli reads it too")
    if nqn:
        p.add_argument("-n", "--nqn", required=nqn_required, help="subsystem NQN")


def _tuning_opts(p):
    p.add_argument("-i", "--nr-io-queues", type=int, help="number of I/O queues")
    p.add_argument("-Q", "--queue-size", type=int, help="I/O queue depth")
    p.add_argument("-k", "--keep-alive-tmo", type=int, help="keep-alive timeout, seconds")
    p.add_argument("-l", "--ctrl-loss-tmo", type=int, help="controller loss timeout, seconds (-1: forever)")
    p.add_argument("-F", "--fast_io_fail_tmo", "--fast-io-fail-tmo", dest="fast_io_fail_tmo", type=int,
                   metavar="SECONDS", help="fail I/O this long after the connection is lost, before ctrl-loss-tmo "
                                           "(default off, -1; needs nvme-cli 2.4 or later)")
    p.add_argument("-c", "--reconnect-delay", type=int, help="seconds between reconnect attempts")
    p.add_argument("-T", "--tos", type=int,
                   help="IP type of service of the RDMA connections (DSCP << 2): pick the DSCP that maps to the "
                        "priority `nvmeof-roce doctor` reports PFC on")
    p.add_argument("-P", "--nr-poll-queues", type=int, help="number of polling I/O queues")
    p.add_argument("-W", "--nr-write-queues", type=int, help="number of I/O queues for writes only")
    p.add_argument("-D", "--duplicate-connect", action="store_true",
                   help="allow a second controller to the same subsystem and address")
    p.add_argument("-d", "--disable-sqflow", action="store_true",
                   help="ask the target for SQ flow control off (-d as nvme-cli 2.3, Debian 12's; 2.13 has the "
                        "long option only)")
    p.add_argument("-g", "--hdr-digest", action="store_true",
                   help="NVMe/TCP PDU header digest (tcp only: RDMA has no PDUs to digest, RoCE's ICRC checks "
                        "every packet)")
    p.add_argument("-G", "--data-digest", action="store_true", help="NVMe/TCP PDU data digest (tcp only, as -g)")


def _auth_opts(p):
    p.add_argument("-S", "--dhchap-secret", metavar="DHHC-1:NN:...:",
                   help="DH-HMAC-CHAP host key (nvme connect --dhchap-secret; nvmeof-roce gen-dhchap-key makes one)")
    p.add_argument("-C", "--dhchap-ctrl-secret", metavar="DHHC-1:NN:...:",
                   help="DH-HMAC-CHAP controller key: authenticate the target too (bidirectional)")


def _auth(args):
    """Check the keys here, with a clear message, before nvme-cli and the kernel see them."""
    from ..nvme.auth import SecretError, parse_secret
    out = {}
    for name in ("dhchap_secret", "dhchap_ctrl_secret"):
        value = getattr(args, name, None)
        if value:
            try:
                parse_secret(value)
            except SecretError as exc:
                raise NvmeofError(f"--{name.replace('_', '-')}: {exc}",
                                  "give the whole DHHC-1:NN:...: string (nvmeof-roce gen-dhchap-key)") from None
            out[name] = value
    if out.get("dhchap_ctrl_secret") and not out.get("dhchap_secret"):
        raise NvmeofError("--dhchap-ctrl-secret without --dhchap-secret",
                          "bidirectional authentication needs the host key too")
    return out


def _tuning(args):
    for name, lo in (("nr_io_queues", 1), ("queue_size", 2), ("keep_alive_tmo", 0), ("reconnect_delay", 1)):
        v = getattr(args, name)
        if v is not None and v < lo:
            raise NvmeofError(f"--{name.replace('_', '-')} {v}: must be at least {lo}",
                              f"give --{name.replace('_', '-')} >= {lo}")
    for name in ("nr_poll_queues", "nr_write_queues"):
        v = getattr(args, name)
        if v is not None and v < 0:
            raise NvmeofError(f"--{name.replace('_', '-')} {v}: must be 0 or more", "give a count >= 0")
    if args.tos is not None and not 0 <= args.tos <= 255:
        raise NvmeofError(f"--tos {args.tos}: must be 0..255 (an IP TOS byte: DSCP << 2)",
                          "e.g. -T 104 for DSCP 26; `nvmeof-roce doctor` shows which priority has PFC")
    if args.ctrl_loss_tmo is not None and args.ctrl_loss_tmo < -1:
        raise NvmeofError(f"--ctrl-loss-tmo {args.ctrl_loss_tmo}: must be -1 (forever) or >= 0", "give -1 or more")
    if args.fast_io_fail_tmo is not None and args.fast_io_fail_tmo < -1:
        raise NvmeofError(f"--fast_io_fail_tmo {args.fast_io_fail_tmo}: must be -1 (off) or >= 0 seconds",
                          "give -1 or more")
    for name, letter in (("hdr_digest", "-g"), ("data_digest", "-G")):
        if getattr(args, name) and args.transport != "tcp":  # the kernel's nvme-rdma refuses the option
            raise NvmeofError(f"{letter}/--{name.replace('_', '-')}: NVMe/TCP's PDU digest; the {args.transport} "
                              "transport has no such option (the kernel refuses it: invalid parameter "
                              f"'{name}'); RDMA's data integrity is the link's (RoCE's ICRC on every packet)",
                              f"leave {letter} out for {args.transport}; it applies with -t tcp only")
    return {k: getattr(args, k) for k in ("nr_io_queues", "queue_size", "keep_alive_tmo", "ctrl_loss_tmo",
                                          "reconnect_delay", "tos", "nr_poll_queues", "nr_write_queues",
                                          "duplicate_connect", "disable_sqflow", "fast_io_fail_tmo",
                                          "hdr_digest", "data_digest")}


def _check_svc(args):
    fabric = registry.fabric(args.transport)
    if fabric is not None and fabric.ip_service:  # rdma, tcp
        try:
            v = int(args.trsvcid)
            assert 1 <= v <= 65535
        except (ValueError, AssertionError):
            raise NvmeofError(f"--trsvcid {args.trsvcid!r}: must be a port number 1..65535",
                              "NVMe-oF uses 4420") from None


def _conf_entries(cli) -> list:
    entries = cli.discovery_conf()
    if not entries:
        raise NvmeofError(f"no --traddr, and {cli.etc_dir}/discovery.conf lists no discovery controller",
                          f"give -a ADDR, or add a line like '--transport=rdma --traddr=10.99.0.1 --trsvcid=4420' "
                          f"to {cli.etc_dir}/discovery.conf")
    return entries


def _print_discovery(r):
    print(f"discovery log of {address(r['traddr'], r['trsvcid'])} ({len(r['records'])} records, generation {r['genctr']})")
    print(table(["subtype", "subnqn", "trtype", "traddr", "trsvcid", "portid"],
                [[x.get("subtype"), x.get("subnqn"), x.get("trtype"), x.get("traddr"), x.get("trsvcid"),
                  x.get("portid")] for x in r["records"]]))


def cmd_host_discover(args):
    cli = _cli(args)
    if not args.traddr:  # as nvme-cli: every discovery controller of /etc/nvme/discovery.conf
        if args.device or args.raw:
            raise NvmeofError("--device and --raw need one discovery controller", "give -a ADDR (and -s PORT)")
        results = []
        for e in _conf_entries(cli):
            r = cli.discover(e["traddr"], e.get("trsvcid", "4420"), e.get("transport", "rdma"),
                             e.get("hostnqn", args.hostnqn), e.get("hostid", args.hostid), e.get("host_traddr"),
                             persistent=args.persistent or e.get("persistent", False),
                             host_iface=e.get("host_iface", args.host_iface), quiet=args.quiet,
                             nqn=e.get("nqn", args.nqn))
            r.update(traddr=e["traddr"], trsvcid=str(e.get("trsvcid", "4420")))
            results.append(r)
        emit(results, args.json, lambda rs: [_print_discovery(r) for r in rs])
        return 0
    _check_svc(args)
    r = cli.discover(args.traddr, args.trsvcid, args.transport, args.hostnqn, args.hostid, args.host_traddr,
                     persistent=args.persistent, host_iface=args.host_iface, device=args.device, raw=args.raw,
                     quiet=args.quiet, nqn=args.nqn)
    r.update(traddr=args.traddr, trsvcid=str(args.trsvcid))
    emit(r, args.json, _print_discovery)
    return 0


def cmd_host_connect(args):
    _check_svc(args)
    r = _cli(args).connect(args.traddr, args.nqn, args.trsvcid, args.transport, args.hostnqn, args.hostid,
                           args.host_traddr, host_iface=args.host_iface, **_tuning(args), **_auth(args))
    emit(r, args.json, lambda r: print(f"connected {r['nqn']} at {address(r['traddr'], r['trsvcid'])} as {r['controller']}"))
    return 0


def cmd_host_connect_all(args):
    if args.duplicate_connect:
        raise NvmeofError("connect-all cannot duplicate connections (nvme connect-all has no -D)",
                          "use host connect -D for the one subsystem you want twice")
    cli = _cli(args)
    tuning = _tuning(args)
    tuning["persistent"] = args.persistent
    auth = _auth(args)
    if not args.traddr:  # as nvme-cli: every discovery controller of /etc/nvme/discovery.conf
        r = {"connected": [], "not_connected": [], "discovered": []}
        for e in _conf_entries(cli):
            t = dict(tuning)
            t.update({k: v for k, v in e.items() if k in t and v is not None})
            one = cli.connect_all(e["traddr"], e.get("trsvcid", "4420"), e.get("transport", "rdma"),
                                  e.get("hostnqn", args.hostnqn), e.get("hostid", args.hostid), e.get("host_traddr"),
                                  e.get("host_iface", args.host_iface), **t, **auth)
            for key in ("connected", "not_connected", "discovered"):
                r[key] += one[key]
            r["hostnqn"] = one["hostnqn"]
    else:
        _check_svc(args)
        r = cli.connect_all(args.traddr, args.trsvcid, args.transport, args.hostnqn, args.hostid, args.host_traddr,
                            args.host_iface, **tuning, **auth)

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
    r = _cli().disconnect_all(args.transport)
    of = f" over {args.transport}" if args.transport else ""
    emit(r, args.json, lambda r: print(f"disconnected {len(r['disconnected'])} controller(s){of}"))
    return 0


def nvme_list_document(namespaces) -> dict:
    """`nvme list -o json`'s document for these namespaces: nvme-cli 2.x's "Devices" list, field for field as
    the installed nvme-cli prints it: Debian 12's 2.3 (tests/unit/fixtures/nvme-cli-2.3/list.json) or, with the
    namespace's character device as "GenericPath", Debian 13's 2.13 (fixtures/nvme-cli-recorded/trixie-2.13)."""
    def device(n):
        generic = {"GenericPath": n["generic"]} if n.get("generic") else {}
        return {"NameSpace": n["nsid"], "DevicePath": n["device"], **generic, "Firmware": n["firmware"],
                "ModelNumber": n["model"], "SerialNumber": n["serial"], "UsedBytes": n["used_bytes"],
                "MaximumLBA": n["max_lba"], "PhysicalSize": n["size_bytes"], "SectorSize": n["sector_size"]}
    return {"Devices": [device(n) for n in namespaces]}


def cmd_host_list(args):
    r = _cli().list()
    if getattr(args, "output_format", None) == "json":  # -o json: nvme-cli's schema; --json: subsystems and paths
        emit(nvme_list_document([n for s in r["subsystems"] for n in s.get("namespaces", [])]), True)
        return 0

    def human(r):
        if not r["subsystems"]:
            print("no NVMe-oF subsystems connected")
            return
        for s in r["subsystems"]:
            print(f"{s['name']}  {s['nqn']}")
            for p in s["paths"]:
                print(f"  {p['name']}  {p['transport']}  {address(p['traddr'], p['trsvcid'])}  {p['state']}")
            for n in s.get("namespaces", []):
                size = n.get("size_bytes")
                print(f"  {n['device']}  nsid {n['nsid']}  {size if size is not None else '?'} bytes  "
                      f"{n.get('sector_size')}-byte sectors")
    emit(r, args.json, human)
    return 0


RTYPE_HELP = ("reservation type: 1 write exclusive, 2 exclusive access, 3/4 the same for registrants only, "
              "5/6 for all registrants")


def cmd_host_resv_register(args):
    r = _cli().resv_register(args.device, args.rrega, args.nrkey, args.crkey, args.iekey, args.cptpl, args.nsid)
    emit(r, args.json, lambda r: print(f"{args.device}: reservation register action {args.rrega} done"))
    return 0


def cmd_host_resv_acquire(args):
    r = _cli().resv_acquire(args.device, args.rtype, args.crkey, args.racqa, args.prkey, args.nsid)
    emit(r, args.json, lambda r: print(f"{args.device}: reservation acquire action {args.racqa} "
                                      f"(type {args.rtype}) done"))
    return 0


def cmd_host_resv_release(args):
    r = _cli().resv_release(args.device, args.rtype, args.crkey, args.rrela, args.nsid)
    emit(r, args.json, lambda r: print(f"{args.device}: reservation release action {args.rrela} done"))
    return 0


def cmd_host_resv_report(args):
    r = _cli().resv_report(args.device, nsid=args.nsid)

    def human(r):
        print(f"{args.device}: generation {r['generation']}, type {r['rtype'] or 'none'}, "
              f"{r['regctl']} registrant(s), PTPL {'on' if r['ptpls'] else 'off'}")
        for g in r["registrants"]:
            print(f"  host {g['hostid']}  key {g['rkey']:#x}{'  holds' if g['holds'] else ''}")
    emit(r, args.json, human)
    return 0


def _key(text: str) -> int:
    return int(text, 0)


def cmd_gen_dhchap_key(args):
    """As `nvme gen-dhchap-key`: a random (or given) key, transformed with the host NQN for a hash, encoded."""
    from ..nvme.auth import HASH_NAMES, SecretError, generate_secret
    key = None
    if args.secret:
        try:
            key = bytes.fromhex(args.secret)
        except ValueError:
            raise NvmeofError(f"--secret {args.secret!r}: not hexadecimal", "give the key as hex digits") from None
    length = args.key_length or (len(key) if key else {0: 32, 1: 32, 2: 48, 3: 64}[args.hmac])
    nqn = None
    if args.hmac:
        nqn = args.nqn or nvme_cli.host_identity().hostnqn  # nvme-cli transforms with this host's NQN too
    try:
        text = generate_secret(args.hmac, length, nqn=nqn, key=key)
    except SecretError as exc:
        raise NvmeofError(f"gen-dhchap-key: {exc}", "use --key-length 32, 48 or 64 (matching --hmac: 1 = 32, "
                                                    "2 = 48, 3 = 64) and a --secret of that many bytes") from None
    r = {"key": text, "hmac": HASH_NAMES.get(args.hmac, "none"), "key_length": length, "nqn": nqn}
    emit(r, args.json, lambda r: print(r["key"]))
    return 0


def register(subparsers) -> None:
    g = subparsers.add_parser("gen-dhchap-key", help="make a DH-HMAC-CHAP key (as nvme gen-dhchap-key)",
                              description="A DHHC-1 secret for NVMe in-band authentication: put it in the target "
                                          "config (hosts[].dhchap.key or ctrl_key) and give it to the host "
                                          "(--dhchap-secret / --dhchap-ctrl-secret). See docs/auth.md.")
    g.add_argument("-m", "--hmac", type=int, default=0, choices=[0, 1, 2, 3],
                   help="hash for the key transformation: 0 none (default), 1 SHA-256, 2 SHA-384, 3 SHA-512")
    g.add_argument("-l", "--key-length", type=int, choices=[32, 48, 64],
                   help="key bytes (default: the hash's length, 32 without one)")
    g.add_argument("-n", "--nqn", help="host NQN for the transformation (default: this host's)")
    g.add_argument("-s", "--secret", metavar="HEX", help="the key bytes instead of random ones")
    _add_json(g)
    g.set_defaults(func=cmd_gen_dhchap_key)

    h = subparsers.add_parser("host", help="the kernel NVMe host through nvme-cli: discover, connect, list",
                              description="The Linux kernel's NVMe-oF host driver, through nvme-cli. (The userspace "
                              "initiator is `nvmeof-roce initiator`.)")
    hs = h.add_subparsers(dest="host_cmd", metavar="ACTION")
    hs.required = True
    x = hs.add_parser("discover", help="read a discovery controller's log")
    _addr_opts(x, traddr_required=False)
    x.add_argument("-n", "--nqn", help="the discovery controller's NQN, as nvme-cli's -n (default: the well-known "
                                       "nqn.2014-08.org.nvmexpress.discovery)")
    x.add_argument("-p", "--persistent", action="store_true",
                   help="keep the discovery controller connected (Discovery Log Change events)")
    x.add_argument("-d", "--device", metavar="DEV",
                   help="read the log through this existing discovery controller (nvmeN, /dev/nvmeN; none: not one)")
    x.add_argument("-r", "--raw", metavar="FILE", help="save the raw discovery log page to FILE (as nvme-cli)")
    x.add_argument("--quiet", action="store_true", help="as nvme-cli: no 'already connected' errors")
    _add_json(x)
    x.set_defaults(func=cmd_host_discover)
    x = hs.add_parser("connect", help="connect to a subsystem")
    _addr_opts(x, nqn=True)
    _tuning_opts(x)
    _auth_opts(x)
    _add_json(x)
    x.set_defaults(func=cmd_host_connect)
    x = hs.add_parser("connect-all", help="connect to every subsystem a discovery controller lists")
    _addr_opts(x, traddr_required=False)
    _tuning_opts(x)
    _auth_opts(x)
    x.add_argument("-p", "--persistent", action="store_true",
                   help="keep the discovery controller connected (Discovery Log Change events)")
    _add_json(x)
    x.set_defaults(func=cmd_host_connect_all)
    x = hs.add_parser("disconnect", help="disconnect a subsystem (--nqn) or a controller (--device)")
    x.add_argument("-n", "--nqn", help="subsystem NQN")
    x.add_argument("-d", "--device", help="controller, e.g. nvme0")
    _add_json(x)
    x.set_defaults(func=cmd_host_disconnect)
    x = hs.add_parser("disconnect-all", help="disconnect every NVMe-oF controller (never a PCIe one)")
    x.add_argument("-r", "--transport", choices=["rdma", "tcp", "fc", "loop"],
                   help="only the controllers of this transport (nvme-cli's -r)")
    _add_json(x)
    x.set_defaults(func=cmd_host_disconnect_all)
    x = hs.add_parser("list", help="connected subsystems, their paths and namespaces",
                      description="The connected NVMe-oF subsystems, their paths and namespaces. --json prints "
                                  "them as subsystems with paths; -o json prints their namespaces as `nvme list -o "
                                  "json` does (nvme-cli's \"Devices\" schema).")
    _add_json(x)
    x.set_defaults(func=cmd_host_list)
    # reservations, through nvme-cli's resv-* commands (docs/reservations.md)
    x = hs.add_parser("resv-register", help="register, unregister or replace a reservation key (nvme resv-register)")
    x.add_argument("device", help="namespace device (/dev/nvme0n1), or a controller (/dev/nvme0) with --nsid")
    x.add_argument("-n", "--nsid", type=int, help="namespace ID, with a controller device")
    x.add_argument("--rrega", type=int, default=0, choices=[0, 1, 2], help="0 register, 1 unregister, 2 replace")
    x.add_argument("--nrkey", type=_key, default=0, help="the new key (register, replace)")
    x.add_argument("--crkey", type=_key, default=0, help="the current key (unregister, replace)")
    x.add_argument("--iekey", action="store_true", help="ignore the current key")
    x.add_argument("--cptpl", type=int, choices=[2, 3], help="2 clear, 3 set persistence through power loss")
    _add_json(x)
    x.set_defaults(func=cmd_host_resv_register)
    x = hs.add_parser("resv-acquire", help="acquire or preempt a reservation (nvme resv-acquire)")
    x.add_argument("device", help="namespace device (/dev/nvme0n1), or a controller (/dev/nvme0) with --nsid")
    x.add_argument("-n", "--nsid", type=int, help="namespace ID, with a controller device")
    x.add_argument("--rtype", type=int, required=True, choices=range(1, 7), help=RTYPE_HELP)
    x.add_argument("--crkey", type=_key, required=True, help="this host's key")
    x.add_argument("--racqa", type=int, default=0, choices=[0, 1, 2], help="0 acquire, 1 preempt, 2 preempt and abort")
    x.add_argument("--prkey", type=_key, default=0, help="the key preempted")
    _add_json(x)
    x.set_defaults(func=cmd_host_resv_acquire)
    x = hs.add_parser("resv-release", help="release or clear a reservation (nvme resv-release)")
    x.add_argument("device", help="namespace device (/dev/nvme0n1), or a controller (/dev/nvme0) with --nsid")
    x.add_argument("-n", "--nsid", type=int, help="namespace ID, with a controller device")
    x.add_argument("--rtype", type=int, default=0, choices=range(0, 7), help=RTYPE_HELP)
    x.add_argument("--crkey", type=_key, required=True, help="this host's key")
    x.add_argument("--rrela", type=int, default=0, choices=[0, 1], help="0 release, 1 clear every registration")
    _add_json(x)
    x.set_defaults(func=cmd_host_resv_release)
    x = hs.add_parser("resv-report", help="a namespace's reservation and registrants (nvme resv-report --eds)")
    x.add_argument("device", help="namespace device (/dev/nvme0n1), or a controller (/dev/nvme0) with --nsid")
    x.add_argument("-n", "--nsid", type=int, help="namespace ID, with a controller device")
    _add_json(x)
    x.set_defaults(func=cmd_host_resv_report)
