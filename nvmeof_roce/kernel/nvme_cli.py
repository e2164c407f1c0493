"""The kernel NVMe host through nvme-cli: discover, connect, connect-all, disconnect, list.

One wrapper for the tool (`NvmeCli`), over `tool.run` (subprocess). JSON output is parsed
by pure functions (`parse_discover`, `parse_list`, `parse_list_subsys`, ...) that accept the shapes
nvme-cli 1.x and 2.x print (Debian bookworm has 2.3 with libnvme 1.3; tests use outputs captured
from it in the lab, tests/unit/fixtures/nvme-cli-2.3/).

nvme-cli reports most connect failures as "Failed to write to /dev/nvme-fabrics: <errno text>";
the kernel log says why. `explain_failure` combines both into a message that names the cause:
module not loaded, nothing listening at the address, host not allowed, no such subsystem.
"""
import json
import logging
import os
import re
from typing import Callable, Dict, List, Optional

from ..errors import NvmeofError
from ..host_identity import CONFIG_JSON, HostIdentity, Paths
from ..host_identity import host_identity as derive_identity
from . import modules, tool

log = logging.getLogger(__name__)

ETC_NVME = "/etc/nvme"
DEV_FABRICS = "/dev/nvme-fabrics"
HOST_MODULES = {"rdma": "nvme_rdma", "tcp": "nvme_tcp", "fc": "nvme_fc", "loop": "nvme_loop"}


class NvmeCliError(NvmeofError):
    pass


# --------------------------------------------------------------------------- host identity

def host_identity(hostnqn: Optional[str] = None, hostid: Optional[str] = None, etc_dir: str = ETC_NVME,
                  config_json: Optional[str] = CONFIG_JSON, paths: Optional[Paths] = None) -> HostIdentity:
    """The host NQN and host ID as nvme-cli (libnvme) derives them: host_identity.py."""
    return derive_identity(hostnqn, hostid, config_json=config_json,
                           paths=paths or Paths(etc_dir=etc_dir))


# --------------------------------------------------------------------------- parsers

def _loads(text: str, what: str):
    text = (text or "").strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        # some versions print a line of text before the JSON
        i = min([j for j in (text.find("{"), text.find("[")) if j >= 0], default=-1)
        if i > 0:
            try:
                return json.loads(text[i:])
            except json.JSONDecodeError:
                pass
        raise NvmeCliError(f"nvme {what}: output is not JSON: {text[:200]!r}",
                           "check nvme-cli's version (nvme version); nvmeof-roce expects nvme-cli >= 1.9") from None


def _g(d: dict, *names, default=None):
    """The first of several key spellings that is present (nvme-cli renamed keys between versions)."""
    for n in names:
        if n in d:
            return d[n]
    lower = {k.lower(): v for k, v in d.items()}
    for n in names:
        if n.lower() in lower:
            return lower[n.lower()]
    return default


def parse_address(addr: str) -> Dict[str, str]:
    """'traddr=10.99.0.1,trsvcid=4420,src_addr=...' -> dict."""
    out = {}
    for part in re.split(r"[,\s]+", addr or ""):
        if "=" in part:
            k, v = part.split("=", 1)
            out[k.strip()] = v.strip()
    return out


_CONF_OPTIONS = {  # discovery.conf options (nvme-cli's long and short names) -> our keyword
    "--transport": "transport", "-t": "transport", "--traddr": "traddr", "-a": "traddr",
    "--trsvcid": "trsvcid", "-s": "trsvcid", "--host-traddr": "host_traddr", "-w": "host_traddr",
    "--hostnqn": "hostnqn", "-q": "hostnqn", "--hostid": "hostid", "-I": "hostid", "--nqn": "nqn", "-n": "nqn",
    "--keep-alive-tmo": "keep_alive_tmo", "-k": "keep_alive_tmo", "--ctrl-loss-tmo": "ctrl_loss_tmo",
    "-l": "ctrl_loss_tmo", "--reconnect-delay": "reconnect_delay", "-c": "reconnect_delay",
    "--nr-io-queues": "nr_io_queues", "-i": "nr_io_queues", "--queue-size": "queue_size", "-Q": "queue_size",
    "--tos": "tos", "-T": "tos", "--host-iface": "host_iface", "-f": "host_iface",
    "--fast_io_fail_tmo": "fast_io_fail_tmo", "-F": "fast_io_fail_tmo",
}
_CONF_FLAGS = {"--persistent": "persistent", "-p": "persistent", "--disable-sqflow": "disable_sqflow",
               "--duplicate-connect": "duplicate_connect", "-D": "duplicate_connect"}
_CONF_INTS = {"keep_alive_tmo", "ctrl_loss_tmo", "reconnect_delay", "nr_io_queues", "queue_size", "tos",
              "fast_io_fail_tmo"}


def parse_discovery_conf(text: str, source: str = "discovery.conf") -> List[dict]:
    """nvme-cli's discovery.conf: one discovery controller per line, as command-line options ('#' comments).

    Each entry is a dict of our keyword names (transport, traddr, trsvcid, ...); an unknown option or a line
    without --traddr is an error naming the line."""
    import shlex
    entries = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            words = shlex.split(line)
        except ValueError as exc:
            raise NvmeCliError(f"{source}:{lineno}: {exc}", "fix the quoting on that line") from None
        entry: dict = {"transport": "rdma", "trsvcid": "4420"}
        i = 0
        while i < len(words):
            word = words[i]
            name, eq, value = word.partition("=")
            if name in _CONF_FLAGS and not eq:
                entry[_CONF_FLAGS[name]] = True
                i += 1
                continue
            if name not in _CONF_OPTIONS:
                raise NvmeCliError(f"{source}:{lineno}: unknown option {name!r}",
                                   "use nvme-cli's options, e.g. --transport=rdma --traddr=10.99.0.1 --trsvcid=4420")
            if not eq:
                if i + 1 >= len(words):
                    raise NvmeCliError(f"{source}:{lineno}: {name} needs a value", f"write {name}=VALUE")
                value = words[i + 1]
                i += 1
            key = _CONF_OPTIONS[name]
            if key in _CONF_INTS:
                try:
                    value = int(value)
                except ValueError:
                    raise NvmeCliError(f"{source}:{lineno}: {name} {value!r} is not a number",
                                       f"give {name} a number") from None
            entry[key] = value
            i += 1
        if not entry.get("traddr"):
            raise NvmeCliError(f"{source}:{lineno}: no --traddr", "every line names a discovery controller: "
                               "--transport=rdma --traddr=10.99.0.1 --trsvcid=4420")
        entries.append(entry)
    return entries


def parse_discover(text: str) -> dict:
    """`nvme discover -o json` -> {"genctr": int, "records": [{trtype, adrfam, subtype, treq, portid, trsvcid,
    subnqn, traddr, ...}]}; portid an int, trsvcid a string, rdma_pkey an int."""
    data = _loads(text, "discover")
    if data is None:
        return {"genctr": 0, "records": []}
    if isinstance(data, list):      # some builds print one object per discovery controller
        data = data[0] if data else {}
    records = []
    for r in _g(data, "records", "Records", default=[]) or []:
        rec = dict(r)
        for k in ("portid", "cntlid", "asqsz"):
            if k in rec:
                try:
                    rec[k] = int(str(rec[k]), 0)
                except ValueError:
                    pass
        if "trsvcid" in rec:
            rec["trsvcid"] = str(rec["trsvcid"]).strip()
        if "rdma_pkey" in rec:
            try:
                rec["rdma_pkey"] = int(str(rec["rdma_pkey"]), 0)
            except ValueError:
                pass
        rec["traddr"] = str(rec.get("traddr", "")).strip()
        rec["subnqn"] = str(rec.get("subnqn", "")).strip()
        records.append(rec)
    genctr = _g(data, "genctr", "Generation counter", default=0)
    try:
        genctr = int(str(genctr), 0)
    except ValueError:
        genctr = 0
    return {"genctr": genctr, "records": records}


# nvme-cli's (libnvme's) names for the numeric fields of a discovery log entry
_TRTYPE_NAMES = {1: "rdma", 2: "fc", 3: "tcp", 254: "loop"}
_ADRFAM_NAMES = {1: "ipv4", 2: "ipv6", 3: "infiniband", 4: "fibre-channel", 254: "intra-host"}
_SUBTYPE_NAMES = {1: "discovery subsystem referral", 2: "nvme subsystem", 3: "current discovery subsystem"}
_TREQ_NAMES = {0: "not specified", 1: "required", 2: "not required"}


def parse_raw_discovery(data: bytes) -> dict:
    """A discovery log page as `nvme discover --raw FILE` saves it (the 1024-byte header, then 1024-byte
    entries) -> the shape parse_discover returns, with nvme-cli's names for the numeric fields."""
    from ..nvme.log import DISC_ENTRY_SIZE, DISC_HEADER_SIZE, DiscoveryLogEntry, DiscoveryLogHeader
    if len(data) < DISC_HEADER_SIZE:
        raise NvmeCliError(f"the raw discovery log is {len(data)} bytes, shorter than its header",
                           "run nvme discover --raw again")
    header = DiscoveryLogHeader.unpack(data)
    records = []
    for i in range(header.numrec):
        offset = DISC_HEADER_SIZE + i * DISC_ENTRY_SIZE
        if offset + DISC_ENTRY_SIZE > len(data):
            break  # nvme-cli saved fewer entries than NUMREC says (the log changed while read)
        e = DiscoveryLogEntry.unpack(data, offset)
        records.append({"trtype": _TRTYPE_NAMES.get(e.trtype, str(e.trtype)),
                        "adrfam": _ADRFAM_NAMES.get(e.adrfam, str(e.adrfam)),
                        "subtype": _SUBTYPE_NAMES.get(e.subtype, str(e.subtype)),
                        "treq": _TREQ_NAMES.get(e.treq & 0x3, str(e.treq)), "portid": e.portid,
                        "trsvcid": e.trsvcid, "subnqn": e.subnqn, "traddr": e.traddr, "cntlid": e.cntlid,
                        "asqsz": e.asqsz, "rdma_pkey": e.rdma_pkey})
    return {"genctr": header.genctr, "records": records}


def parse_connect(text: str) -> Optional[str]:
    """`nvme connect -o json` -> the controller name ('nvme0'), or None if nvme-cli printed nothing."""
    text = (text or "").strip()
    if not text:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        m = re.search(r"\b(nvme\d+)\b", text)   # older: "device: nvme0"
        return m.group(1) if m else None
    if isinstance(data, dict):
        dev = _g(data, "device", "Device")
        if dev:
            return os.path.basename(str(dev))
    return None


def parse_list_subsys(text: str) -> List[dict]:
    """`nvme list-subsys -o json` -> [{"name", "nqn", "hostnqn", "hostid", "paths": [{"name", "transport",
    "address", "traddr", "trsvcid", "state"}]}].

    Accepts 2.x (a list of hosts each with "Subsystems") and 1.x ({"Subsystems": [{"Name","NQN"},
    {"Paths": [...]}, ...]}, where a subsystem's paths follow it as a separate element).
    """
    data = _loads(text, "list-subsys")
    if data is None:
        return []
    hosts = data if isinstance(data, list) else [data]
    out = []
    for h in hosts:
        if not isinstance(h, dict):
            continue
        hostnqn = _g(h, "HostNQN", "hostnqn")
        hostid = _g(h, "HostID", "hostid")
        current = None
        for s in _g(h, "Subsystems", "subsystems", default=[]) or []:
            if not isinstance(s, dict):
                continue
            nqn = _g(s, "NQN", "SubsystemNQN", "nqn")
            if nqn is None and current is not None and _g(s, "Paths", "paths") is not None:
                current["paths"].extend(_paths(_g(s, "Paths", "paths")))   # 1.x: paths in the next element
                continue
            current = {"name": _g(s, "Name", "Subsystem", "name"), "nqn": nqn,
                       "hostnqn": _g(s, "HostNQN", default=hostnqn), "hostid": _g(s, "HostID", default=hostid),
                       "iopolicy": _g(s, "IOPolicy", "iopolicy"),
                       "paths": _paths(_g(s, "Paths", "paths", "Controllers", default=[]))}
            out.append(current)
    return out


def _paths(items) -> List[dict]:
    out = []
    for p in items or []:
        if not isinstance(p, dict):
            continue
        addr = str(_g(p, "Address", "address", default="") or "")
        a = parse_address(addr)
        out.append({"name": _g(p, "Name", "Controller", "name"), "transport": _g(p, "Transport", "transport"),
                    "address": addr, "traddr": a.get("traddr"), "trsvcid": a.get("trsvcid"),
                    "host_traddr": a.get("host_traddr") or a.get("src_addr"),
                    "state": _g(p, "State", "state")})
    return out


def parse_list(text: str) -> List[dict]:
    """`nvme list -o json` (plain or -v) -> [{"device", "generic", "nsid", "controller", "subsystem", "subnqn", "serial",
    "model", "firmware", "size_bytes", "used_bytes", "sector_size", "max_lba"}] (unknown fields None)."""
    data = _loads(text, "list")
    if data is None:
        return []
    devices = _g(data, "Devices", "devices", default=[]) if isinstance(data, dict) else data
    out = []
    for d in devices or []:
        if not isinstance(d, dict):
            continue
        if _g(d, "Subsystems") is not None:       # verbose shape: hosts -> subsystems -> namespaces
            for s in _g(d, "Subsystems", default=[]) or []:
                ctrls = _g(s, "Controllers", default=[]) or []
                c0 = ctrls[0] if ctrls else {}
                for ns in _g(s, "Namespaces", default=[]) or []:
                    out.append(_ns_entry(ns, c0, s))
                for c in ctrls:
                    for ns in _g(c, "Namespaces", default=[]) or []:   # non-multipath: under the controller
                        out.append(_ns_entry(ns, c, s))
            continue
        out.append(_ns_entry(d, d, {}))
    # one entry per device path
    seen, uniq = set(), []
    for e in out:
        if e["device"] not in seen:
            seen.add(e["device"])
            uniq.append(e)
    return sorted(uniq, key=lambda e: _natural(e["device"] or ""))


def _natural(s):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def _int(v):
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _ns_entry(ns: dict, ctrl: dict, subsys: dict) -> dict:
    dev = _g(ns, "DevicePath", "NameSpace", "Namespace")
    if isinstance(dev, int) or dev is None:     # 2.x plain: "NameSpace" is the NSID, DevicePath the path
        dev = _g(ns, "DevicePath")
    dev = str(dev) if dev is not None else None
    if dev and not dev.startswith("/"):
        dev = "/dev/" + dev
    generic = _g(ns, "GenericPath", "Generic")  # the namespace's character device, nvme-cli 2.4+ (ngXnY)
    generic = str(generic) if generic else None
    if generic and not generic.startswith("/"):
        generic = "/dev/" + generic
    nsid = _g(ns, "NSID", "Nsid")
    if nsid is None and isinstance(_g(ns, "NameSpace"), int):
        nsid = _g(ns, "NameSpace")
    if nsid is None and dev:
        m = re.search(r"n(\d+)$", dev)
        nsid = int(m.group(1)) if m else None
    sector = _int(_g(ns, "SectorSize", "sector_size"))
    max_lba = _int(_g(ns, "MaximumLBA", "max_lba"))
    size = _int(_g(ns, "PhysicalSize", "physical_size"))
    ctrl_name = _g(ctrl, "Controller") if ctrl is not ns else None
    if ctrl_name is None and dev:
        m = re.match(r"/dev/(nvme\d+)n\d+$", dev)
        ctrl_name = m.group(1) if m else None
    return {"device": dev, "generic": generic, "nsid": _int(nsid), "controller": ctrl_name,
            "subsystem": _g(subsys, "Subsystem", "Name"), "subnqn": _g(subsys, "SubsystemNQN", "NQN"),
            "serial": (str(_g(ctrl, "SerialNumber", default="") or "").strip() or None),
            "model": (str(_g(ctrl, "ModelNumber", default="") or "").strip() or None),
            "firmware": (str(_g(ctrl, "Firmware", default="") or "").strip() or None),
            "transport": _g(ctrl, "Transport"), "address": _g(ctrl, "Address"),
            "size_bytes": size, "used_bytes": _int(_g(ns, "UsedBytes", "used_bytes")),
            "sector_size": sector, "max_lba": max_lba}


def parse_disconnect(text: str) -> int:
    """'NQN:... disconnected 1 controller(s)' -> 1."""
    m = re.search(r"disconnected\s+(\d+)\s+controller", text or "")
    return int(m.group(1)) if m else 0


# --------------------------------------------------------------------------- failures

def explain_failure(what: str, res: tool.ToolResult, traddr: str = "", trsvcid="", nqn: str = "",
                    hostnqn: str = "", transport: str = "rdma", kernel_log: str = "") -> NvmeCliError:
    """A message that names the cause of a failed nvme discover/connect."""
    text = (res.stderr + "\n" + res.stdout).strip()
    klog = (kernel_log or "").lower()
    target = f"{traddr}:{trsvcid}" if traddr else "the target"
    low = text.lower()
    if "dhchap" in klog and ("unknown parameter" in klog or "invalid" in klog):
        return NvmeCliError(f"{what}: this kernel has no NVMe in-band authentication (CONFIG_NVME_HOST_AUTH), so "
                            "it cannot use --dhchap-secret", "use a kernel with it (Debian's 6.12: lab run --kernel "
                            "6.12), or connect without keys to a target that does not require them")
    if "no key" in klog and "qid" in klog:
        return NvmeCliError(f"{what}: the target requires DH-HMAC-CHAP authentication and no key was given",
                            "give the host key: --dhchap-secret DHHC-1:NN:...: (the target's hosts[].dhchap.key)")
    if "authentication failed" in klog or "authentication setup failed" in klog:
        return NvmeCliError(f"{what}: DH-HMAC-CHAP authentication with {nqn or target} failed",
                            "check --dhchap-secret against the target's key for this host NQN (and "
                            "--dhchap-ctrl-secret against its controller key); the target's log names which. "
                            "A kernel without CONFIG_NVME_HOST_AUTH fails here too (nvmeof-roce doctor shows it)")
    if "already connected" in low:
        return NvmeCliError(f"{what}: already connected to {nqn or target}",
                            "nvmeof-roce host list shows the controller; disconnect it first "
                            f"(nvmeof-roce host disconnect --nqn {nqn or 'NQN'})")
    if "failed to open /dev/nvme-fabrics" in low or "nvme-fabrics: no such file" in low:
        mod = HOST_MODULES.get(transport, "nvme_fabrics")
        return NvmeCliError(f"{what}: /dev/nvme-fabrics does not exist: the kernel module {mod} (and nvme_fabrics) "
                            "is not loaded", f"modprobe {mod.replace('_', '-')} (as root)")
    if "failed to scan topology" in low:
        return NvmeCliError(f"{what}: nvme-cli could not read the NVMe topology ({_errtext(text)})",
                            "load the NVMe host modules: modprobe nvme-rdma (it brings nvme_fabrics and nvme_core)")
    if "no handler found for transport" in klog:
        mod = HOST_MODULES.get(transport, "nvme_" + transport)
        return NvmeCliError(f"{what}: the kernel has no NVMe host driver for transport {transport!r}: "
                            f"module {mod} is not loaded", f"modprobe {mod.replace('_', '-')} (as root)")
    if "is not allowed" in klog or "not allowed" in low:
        return NvmeCliError(f"{what}: the target refused host {hostnqn or '(this host)'}: it is not in the allowed "
                            f"hosts of {nqn or 'the subsystem'}",
                            "on the target, add this host NQN to the subsystem's allowed_hosts (and hosts), or set "
                            "allow_any_host; or connect with the allowed --hostnqn")
    if "connect invalid data parameter" in klog or "invalid subsystem" in klog:
        return NvmeCliError(f"{what}: the target at {target} has no subsystem {nqn!r} on that port",
                            f"check the NQN with nvmeof-roce host discover --traddr {traddr} --trsvcid {trsvcid}")
    if "invalid service id" in klog or "connection refused" in low:
        return NvmeCliError(f"{what}: nothing listens at {target} ({transport}): the RDMA connection was rejected",
                            "check traddr/trsvcid and that the target port is enabled (a subsystem linked to it); "
                            "nvmeof-roce nvmet show on the target")
    if any(s in low for s in ("connection reset by peer", "no route to host", "timed out", "network is unreachable",
                              "cannot assign requested address", "address not available")) or \
            "rdma connection establishment failed" in klog or "address resolve failed" in klog:
        return NvmeCliError(f"{what}: the target at {target} is unreachable over {transport} "
                            f"({_errtext(text) or 'connection failed'})",
                            "check the address and trsvcid, that this host has an RDMA device on that network "
                            "(nvmeof-roce rdma status) and that the target listens there")
    if "input/output error" in low:
        return NvmeCliError(f"{what}: the target at {target} rejected the connect command "
                            f"({_errtext(text)}): the host is not allowed or the subsystem does not exist",
                            "check the NQN (nvmeof-roce host discover) and the subsystem's allowed hosts; dmesg "
                            "shows which")
    if "invalid argument" in low or "invalid arguments" in low:
        return NvmeCliError(f"{what}: the kernel rejected the options ({_errtext(text)})",
                            "check the options (queue size 16..1024, nr-io-queues >= 1); dmesg shows which")
    return NvmeCliError(f"{what} failed (exit {res.exit_code}): {_errtext(text) or 'no output'}",
                        "dmesg shows the kernel's reason")


def _errtext(text: str) -> str:
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    return "; ".join(lines[:2])


# --------------------------------------------------------------------------- the wrapper

Runner = Callable[..., tool.ToolResult]


class NvmeCli:
    """nvme-cli, run through `runner(tool, args, package=..., timeout=...)` (tool.run; tests pass a fake)."""

    def __init__(self, runner: Optional[Runner] = None, sys_module: str = modules.SYS_MODULE,
                 load_modules: bool = True, etc_dir: str = ETC_NVME, kernel_log: Optional[Callable[[], str]] = None,
                 config_json: Optional[str] = None):
        self.runner = runner or tool.run
        self.sys_module = sys_module
        self.load_modules = load_modules
        self.etc_dir = etc_dir
        self.kernel_log = kernel_log or _dmesg_tail
        # -J/--config as given (libnvme's JSON config; "none": not read); without it, ETC/config.json
        self.config_json = config_json

    def _nvme(self, args, timeout=120) -> tool.ToolResult:
        self._klog_before = self._klog()
        return self.runner("nvme", list(args), package="nvme-cli", timeout=timeout)

    def _klog(self) -> List[str]:
        try:
            return (self.kernel_log() or "").lower().splitlines()
        except Exception:   # noqa: BLE001 - the kernel log only refines messages
            return []

    def identity(self, hostnqn=None, hostid=None) -> HostIdentity:
        return host_identity(hostnqn, hostid, self.etc_dir,
                             config_json=self.config_json or os.path.join(self.etc_dir, "config.json"))

    def _config_args(self) -> List[str]:
        """-J as given to us: nvme-cli reads the same file (for its per-controller settings too)."""
        return ["--config", self.config_json] if self.config_json else []

    def _ensure_transport(self, transport: str):
        mod = HOST_MODULES.get(transport)
        if mod and self.load_modules:
            modules.ensure(mod, f"the NVMe host over {transport}", self.sys_module)

    def _addr_args(self, transport, traddr, trsvcid, host_traddr=None, ident: Optional[HostIdentity] = None,
                   host_iface=None):
        args = ["--transport", transport, "--traddr", traddr]
        if trsvcid not in (None, ""):
            args += ["--trsvcid", str(trsvcid)]
        if host_traddr:
            args += ["--host-traddr", host_traddr]
        if host_iface:
            if transport != "tcp":  # libnvme: "host_iface not permitted for rdma or fc"
                raise NvmeCliError(f"--host-iface {host_iface}: the host interface applies to the tcp transport "
                                   f"only (nvme-cli: host_iface not permitted for {transport})",
                                   "for RDMA pick the local RDMA address with -w/--host-traddr")
            args += ["--host-iface", host_iface]
        if ident:
            args += ["--hostnqn", ident.hostnqn, "--hostid", ident.hostid]
        return args

    @staticmethod
    def _tuning_args(nr_io_queues=None, queue_size=None, keep_alive_tmo=None, ctrl_loss_tmo=None,
                     reconnect_delay=None, tos=None, nr_poll_queues=None, nr_write_queues=None,
                     duplicate_connect=False, disable_sqflow=False, persistent=False,
                     dhchap_secret=None, dhchap_ctrl_secret=None, fast_io_fail_tmo=None,
                     hdr_digest=False, data_digest=False):
        args = []
        for flag, v in (("--nr-io-queues", nr_io_queues), ("--queue-size", queue_size),
                        ("--keep-alive-tmo", keep_alive_tmo), ("--ctrl-loss-tmo", ctrl_loss_tmo),
                        ("--fast_io_fail_tmo", fast_io_fail_tmo),
                        ("--reconnect-delay", reconnect_delay), ("--tos", tos),
                        ("--nr-poll-queues", nr_poll_queues), ("--nr-write-queues", nr_write_queues),
                        ("--dhchap-secret", dhchap_secret), ("--dhchap-ctrl-secret", dhchap_ctrl_secret)):
            if v is not None:
                args += [flag, str(v)]
        for flag, on in (("--duplicate-connect", duplicate_connect), ("--disable-sqflow", disable_sqflow),
                         ("--persistent", persistent), ("--hdr-digest", hdr_digest), ("--data-digest", data_digest)):
            if on:
                args.append(flag)
        return args

    def _fail(self, what, res, **kw):
        text = res.stderr + res.stdout
        if "fast_io_fail_tmo" in text and ("unrecognized" in text or "invalid option" in text):
            return NvmeCliError(f"{what}: this nvme-cli has no --fast_io_fail_tmo (it came with nvme-cli 2.4; "
                                "Debian 12 has 2.3)", "upgrade nvme-cli, or connect without -F "
                                "(the kernel then fails I/O only when ctrl-loss-tmo expires)")
        before, after = getattr(self, "_klog_before", []), self._klog()
        new = after
        if before:
            last = before[-1]
            idx = max((i for i, l in enumerate(after) if l == last), default=-1)
            new = after[idx + 1:] if idx >= 0 else after[-40:]
        return explain_failure(what, res, kernel_log="\n".join(new), **kw)

    # commands -----------------------------------------------------------------
    def discovery_conf(self) -> List[dict]:
        """The entries of /etc/nvme/discovery.conf (what nvme discover/connect-all use with no address)."""
        path = os.path.join(self.etc_dir, "discovery.conf")
        try:
            with open(path) as f:
                text = f.read()
        except FileNotFoundError:
            return []
        return parse_discovery_conf(text, path)

    def discover(self, traddr: str, trsvcid=4420, transport="rdma", hostnqn=None, hostid=None,
                 host_traddr=None, persistent: bool = False, host_iface=None, device: Optional[str] = None,
                 raw: Optional[str] = None, quiet: bool = False, nqn: Optional[str] = None) -> dict:
        """nvme discover.  `device`: an existing (persistent) discovery controller, nvmeN or /dev/nvmeN, that
        nvme-cli reads the log through instead of connecting anew ("none": not one); `raw`: nvme-cli saves the
        log page to that file (and prints nothing: the records are read back from it); `quiet`: nvme-cli's
        --quiet (no "already connected" errors); `nqn`: the discovery controller's NQN (nvme-cli's -n/--nqn; by
        default the well-known nqn.2014-08.org.nvmexpress.discovery)."""
        ident = self.identity(hostnqn, hostid)
        self._ensure_transport(transport)
        args = ["discover", *self._addr_args(transport, traddr, trsvcid, host_traddr, ident, host_iface),
                *self._config_args()]
        if nqn:
            args += ["--nqn", nqn]
        if device:
            if device != "none" and not re.fullmatch(r"(/dev/)?nvme\d+", device):
                raise NvmeCliError(f"--device {device!r}: not a controller device",
                                   "give nvmeN or /dev/nvmeN (a persistent discovery controller: host discover -p), "
                                   "or none")
            args += ["--device", device]
        if persistent:
            args.append("--persistent")
        if quiet:
            args.append("--quiet")
        if raw:
            args += ["--raw", raw]
        else:
            args.append("--output-format=json")
        res = self._nvme(args)
        if not res.ok:
            raise self._fail(f"nvme discover {traddr}:{trsvcid}", res, traddr=traddr, trsvcid=trsvcid,
                             hostnqn=ident.hostnqn, transport=transport)
        if raw:
            try:
                with open(raw, "rb") as f:
                    out = parse_raw_discovery(f.read())
            except OSError as exc:
                raise NvmeCliError(f"nvme discover --raw {raw}: nvme-cli wrote no log there ({exc.strerror})",
                                   "check the path is writable") from None
            out["raw"] = raw
        else:
            out = parse_discover(res.stdout)
        out["hostnqn"] = ident.hostnqn
        return out

    def connect(self, traddr: str, nqn: str, trsvcid=4420, transport="rdma", hostnqn=None, hostid=None,
                host_traddr=None, host_iface=None, **tuning) -> dict:
        ident = self.identity(hostnqn, hostid)
        self._ensure_transport(transport)
        res = self._nvme(["connect", *self._addr_args(transport, traddr, trsvcid, host_traddr, ident, host_iface),
                          "--nqn", nqn, *self._config_args(), *self._tuning_args(**tuning), "--output-format=json"])
        if not res.ok:
            raise self._fail(f"nvme connect {nqn} at {traddr}:{trsvcid}", res, traddr=traddr, trsvcid=trsvcid,
                             nqn=nqn, hostnqn=ident.hostnqn, transport=transport)
        ctrl = parse_connect(res.stdout)
        if ctrl is None:   # older nvme-cli prints nothing: find the controller by address
            new = [p["name"] for s in self.list_subsystems() if s["nqn"] == nqn for p in s["paths"]
                   if p["traddr"] == traddr and str(p["trsvcid"]) == str(trsvcid)]
            ctrl = new[-1] if new else None
        return {"controller": ctrl, "nqn": nqn, "traddr": traddr, "trsvcid": str(trsvcid), "transport": transport,
                "hostnqn": ident.hostnqn, "hostid": ident.hostid}

    def connect_all(self, traddr: str, trsvcid=4420, transport="rdma", hostnqn=None, hostid=None,
                    host_traddr=None, host_iface=None, **tuning) -> dict:
        """nvme connect-all; reports what got connected and which discovered subsystems did not."""
        ident = self.identity(hostnqn, hostid)
        self._ensure_transport(transport)
        disc = self.discover(traddr, trsvcid, transport, ident.hostnqn, ident.hostid, host_traddr,
                             host_iface=host_iface)
        tuning = dict(tuning)
        if tuning.pop("duplicate_connect", False):  # nvme connect-all has no --duplicate-connect
            raise NvmeCliError("connect-all cannot duplicate connections", "use host connect -D for one subsystem")
        before = {(s["nqn"], p["name"]) for s in self.list_subsystems() for p in s["paths"]}
        res = self._nvme(["connect-all", *self._addr_args(transport, traddr, trsvcid, host_traddr, ident, host_iface),
                          *self._config_args(), *self._tuning_args(**tuning)])
        if not res.ok and "already connected" not in (res.stderr + res.stdout).lower():
            raise self._fail(f"nvme connect-all {traddr}:{trsvcid}", res, traddr=traddr, trsvcid=trsvcid,
                             hostnqn=ident.hostnqn, transport=transport)
        after = self.list_subsystems()
        connected = [{"nqn": s["nqn"], "controller": p["name"], "traddr": p["traddr"], "trsvcid": p["trsvcid"]}
                     for s in after for p in s["paths"] if (s["nqn"], p["name"]) not in before]
        live = {s["nqn"] for s in after}
        wanted = [r for r in disc["records"] if "discovery" not in str(r.get("subtype", ""))]
        missing = [r["subnqn"] for r in wanted if r["subnqn"] not in live]
        return {"connected": connected, "not_connected": missing, "hostnqn": ident.hostnqn,
                "discovered": [r["subnqn"] for r in wanted]}

    def disconnect(self, nqn: Optional[str] = None, device: Optional[str] = None) -> dict:
        if bool(nqn) == bool(device):
            raise NvmeCliError("disconnect needs exactly one of an NQN or a controller device",
                               "give --nqn NQN or --device nvme0")
        args = ["disconnect", "--nqn", nqn] if nqn else ["disconnect", "--device", os.path.basename(device)]
        res = self._nvme(args)
        if not res.ok:
            raise self._fail(f"nvme disconnect {nqn or device}", res, nqn=nqn or "")
        n = parse_disconnect(res.stdout + res.stderr)
        if n == 0:
            raise NvmeCliError(f"nvme disconnect: no controller of {nqn or device} is connected",
                               "nvmeof-roce host list shows what is connected")
        return {"disconnected": n, "nqn": nqn, "device": device}

    def disconnect_all(self, transport: Optional[str] = None) -> dict:
        """nvme disconnect-all: every fabrics controller (never a PCIe one), or those of `transport` only
        (nvme-cli's -r/--transport); the report lists the controllers so disconnected."""
        before = self.list_subsystems()
        res = self._nvme(["disconnect-all"] + (["--transport", transport] if transport else []))
        if not res.ok:
            raise self._fail("nvme disconnect-all", res)
        return {"disconnected": [{"nqn": s["nqn"], "controller": p["name"], "transport": p["transport"]}
                                 for s in before for p in s["paths"]
                                 if p["transport"] != "pcie" and (transport is None or p["transport"] == transport)],
                "transport": transport}

    def _no_fabrics(self, res) -> bool:
        """nvme-cli cannot scan the topology because no NVMe-oF host module is loaded: nothing is connected."""
        return "scan topology" in (res.stderr + res.stdout).lower() and \
            not modules.is_loaded("nvme_fabrics", self.sys_module)

    def list_subsystems(self) -> List[dict]:
        res = self._nvme(["list-subsys", "--output-format=json"], timeout=60)
        if not res.ok:
            if self._no_fabrics(res):
                return []
            raise self._fail("nvme list-subsys", res)
        return parse_list_subsys(res.stdout)

    def list_namespaces(self) -> List[dict]:
        res = self._nvme(["list", "--output-format=json", "--verbose"], timeout=60)
        if not res.ok and not self._no_fabrics(res):
            res = self._nvme(["list", "--output-format=json"], timeout=60)
        if not res.ok:
            if self._no_fabrics(res):
                return []
            raise self._fail("nvme list", res)
        return parse_list(res.stdout)

    def list(self) -> dict:
        subs = self.list_subsystems()
        nss = self.list_namespaces()
        by_ctrl = {}
        for s in subs:
            for p in s["paths"]:
                by_ctrl[p["name"]] = s
        for n in nss:
            s = by_ctrl.get(n["controller"])
            if s and not n.get("subnqn"):
                n["subnqn"] = s["nqn"]
        for s in subs:
            s["namespaces"] = [n for n in nss if n.get("subnqn") == s["nqn"]]
        return {"subsystems": subs, "namespaces": nss}

    # reservations (docs/reservations.md) ---------------------------------------
    def _resv(self, verb: str, device: str, args: List[str], nsid: Optional[int]) -> tool.ToolResult:
        """One resv-* command; `nsid` for a controller's character device (/dev/nvme0: that controller's path,
        where a namespace device may go down any path of a multipath head)."""
        res = self._nvme([verb, device] + args + ([f"--namespace-id={nsid}"] if nsid else []), timeout=60)
        if not res.ok:
            text = _errtext(res.stderr + res.stdout) or f"exit status {res.exit_code}"
            raise NvmeCliError(f"nvme {verb} {device}: {text}",
                               "Reservation Conflict: another host holds the reservation, or the key is not this "
                               "host's (nvmeof-roce host resv-report shows both); Invalid Opcode: the namespace has "
                               "no reservations (\"resv\": {\"enable\": \"1\"} in the target's config)")
        return res

    def resv_register(self, device: str, rrega: int = 0, nrkey: int = 0, crkey: int = 0, iekey: bool = False,
                      cptpl: Optional[int] = None, nsid: Optional[int] = None) -> dict:
        """nvme resv-register: RREGA 0 register (NRKEY), 1 unregister, 2 replace (CRKEY, or any with IEKEY);
        CPTPL 2 clears, 3 sets persistence through power loss."""
        args = [f"--rrega={rrega}", f"--nrkey={nrkey}", f"--crkey={crkey}"] + (["--iekey"] if iekey else [])
        if cptpl is not None:
            args.append(f"--cptpl={cptpl}")
        self._resv("resv-register", device, args, nsid)
        return {"device": device, "rrega": rrega, "nrkey": nrkey}

    def resv_acquire(self, device: str, rtype: int, crkey: int, racqa: int = 0, prkey: int = 0,
                     nsid: Optional[int] = None) -> dict:
        """nvme resv-acquire: RACQA 0 acquire, 1 preempt, 2 preempt and abort (PRKEY: the key preempted)."""
        self._resv("resv-acquire", device, [f"--rtype={rtype}", f"--racqa={racqa}", f"--crkey={crkey}",
                                            f"--prkey={prkey}"], nsid)
        return {"device": device, "rtype": rtype, "racqa": racqa}

    def resv_release(self, device: str, rtype: int, crkey: int, rrela: int = 0, nsid: Optional[int] = None) -> dict:
        """nvme resv-release: RRELA 0 release (of type RTYPE), 1 clear every registration."""
        self._resv("resv-release", device, [f"--rtype={rtype}", f"--rrela={rrela}", f"--crkey={crkey}"], nsid)
        return {"device": device, "rtype": rtype, "rrela": rrela}

    def resv_report(self, device: str, eds: bool = True, nsid: Optional[int] = None) -> dict:
        """nvme resv-report -o json, as parse_resv_report gives it."""
        res = self._resv("resv-report", device, ["--numd=1023", "--output-format=json"] + (["--eds"] if eds else []),
                         nsid)
        return parse_resv_report(res.stdout)


def parse_resv_report(text: str) -> dict:
    """nvme resv-report's JSON: generation, type, PTPL state and each registrant (controller, holds, key, host
    identifier); nvme-cli names the list regctlext with --eds, regctls without."""
    d = _loads(text, "nvme resv-report")
    regs = _g(d, "regctlext", "regctls", default=[]) or []
    return {"generation": _int(_g(d, "gen", default=0)), "rtype": _int(_g(d, "rtype", default=0)),
            "regctl": _int(_g(d, "regctl", default=len(regs))), "ptpls": _int(_g(d, "ptpls", default=0)),
            "registrants": [{"cntlid": _int(_g(r, "cntlid", default=0)), "holds": bool(_int(_g(r, "rcsts", default=0)) & 1),
                             "rkey": _int(_g(r, "rkey", default=0)),
                             "hostid": str(_g(r, "hostid", default="")).replace("-", "").lower()} for r in regs]}


def _dmesg_tail(lines: int = 200) -> str:
    """The end of the kernel log, to explain a failed connect; '' if unreadable (not root, no dmesg)."""
    try:
        res = tool.run("dmesg", [], package="util-linux", timeout=10)
    except NvmeofError:
        return ""
    if not res.ok:
        return ""
    return "\n".join(res.stdout.splitlines()[-lines:])
