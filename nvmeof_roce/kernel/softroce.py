"""RDMA devices, Soft-RoCE and Soft-iWARP links and the RoCE mode of rdma_cm.

- `devices()`: every device under /sys/class/infiniband with its ports: state, physical state, link
  layer, rate, MTU, netdev and the GID table with each entry's RoCE version and netdev (what
  `show_gids` prints: gids/N, gid_attrs/types/N, gid_attrs/ndevs/N).
- `add_link()` (`add_rxe()`, `add_siw()`) / `del_link()`: Soft-RoCE and Soft-iWARP links through the `rdma` tool
  (`rdma link add NAME type rxe|siw netdev ETH`), the one wrapper for it (`Rdma`), which reads `rdma -j` JSON.
- `get_roce_mode()` / `set_roce_mode()`: rdma_cm's default RoCE mode for connections it makes, in
  its configfs: mkdir /sys/kernel/config/rdma_cm/DEV creates ports/N/default_roce_mode.

The sysfs and configfs roots are parameters, so tests run against a fake tree.
"""
import errno
import ipaddress
import json
import logging
import os
import time
from typing import Callable, Dict, List, Optional

from ..errors import NvmeofError
from ..roce import roce_mtu_for_netdev_mtu
from . import modules, tool

log = logging.getLogger(__name__)

SYSFS = "/sys"
CONFIGFS = "/sys/kernel/config"
ROCE_MODES = {"v1": "IB/RoCE v1", "v2": "RoCE v2"}
_ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


class RdmaError(NvmeofError):
    pass


def _read(path: str) -> Optional[str]:
    try:
        with open(path, "r", encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _state(v: Optional[str]) -> Optional[str]:
    """'4: ACTIVE' -> 'ACTIVE'."""
    if v is None:
        return None
    return v.split(":", 1)[1].strip() if ":" in v else v


def gid_to_ip(gid: str) -> Optional[str]:
    """The IP address a RoCE GID carries: ::ffff:a.b.c.d -> a.b.c.d; a non-link-local IPv6 as itself."""
    try:
        ip = ipaddress.IPv6Address(gid)
    except ValueError:
        return None
    if ip.ipv4_mapped:
        return str(ip.ipv4_mapped)
    if ip.is_link_local:
        return None
    return str(ip)


def roce_version(gid_type: Optional[str]) -> Optional[str]:
    if not gid_type:
        return None
    if "v2" in gid_type:
        return "v2"
    if "v1" in gid_type or gid_type.strip() == "IB/RoCE":
        return "v1"
    return None


def _ibmtu(v) -> Optional[int]:
    """'4096 (5)' -> 4096."""
    if v is None:
        return None
    try:
        return int(str(v).split()[0])
    except (ValueError, IndexError):
        return None


def parse_ibv_devinfo(text: str) -> Dict[str, Dict[int, dict]]:
    """`ibv_devinfo` text -> {dev: {port: {"active_mtu": 4096, "max_mtu": 4096, "state": ...}}}."""
    out: Dict[str, Dict[int, dict]] = {}
    dev, port = None, None
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("hca_id:"):
            dev = s.split(":", 1)[1].strip()
            out[dev] = {}
            port = None
        elif s.startswith("port:") and dev:
            try:
                port = int(s.split(":", 1)[1])
            except ValueError:
                port = None
            if port is not None:
                out[dev][port] = {}
        elif port is not None and dev and ":" in s:
            k, v = s.split(":", 1)
            k, v = k.strip(), v.strip()
            if k in ("active_mtu", "max_mtu"):
                out[dev][port][k] = _ibmtu(v)
            elif k in ("state", "link_layer"):
                out[dev][port][k] = v
    return out


class Rdma:
    """The `rdma` tool (iproute2), JSON output."""

    def __init__(self, runner: Optional[Callable[..., tool.ToolResult]] = None):
        self.runner = runner or tool.run

    def run(self, args, json_out=True):
        res = self.runner("rdma", (["-j"] if json_out else []) + list(args), package="iproute2", timeout=30)
        return res

    def links(self) -> List[dict]:
        res = self.run(["link", "show"])
        if not res.ok:
            raise RdmaError(f"rdma link show failed: {(res.stderr or res.stdout).strip()}",
                            "load the RDMA core (modprobe ib_core ib_uverbs) and check iproute2 has rdma")
        return json.loads(res.stdout or "[]")

    def link_add(self, name: str, netdev: str, kind: str = "rxe") -> None:
        res = self.run(["link", "add", name, "type", kind, "netdev", netdev], json_out=False)
        if res.ok:
            return
        err = (res.stderr or res.stdout).strip()
        low = err.lower()
        if "no such device" in low:
            raise RdmaError(f"rdma link add {name}: netdev {netdev} does not exist ({err})",
                            "give an existing Ethernet netdev (ip -br link); rxe over lo is not supported")
        if "file exists" in low:
            raise RdmaError(f"rdma link add {name}: an RDMA device named {name} already exists, or {netdev} "
                            f"already has a Soft-RoCE device ({err})",
                            "nvmeof-roce rdma status lists them; pick another --name or delete the old one")
        if "operation not supported" in low or "unknown" in low:
            raise RdmaError(f"rdma link add {name}: the kernel refused type {kind} ({err})",
                            f"modprobe rdma_{kind} (Debian: the -amd64 kernel flavour has it, -cloud does not)")
        raise RdmaError(f"rdma link add {name} type {kind} netdev {netdev} failed: {err or 'exit ' + str(res.exit_code)}",
                        "see dmesg")

    def link_delete(self, name: str) -> None:
        res = self.run(["link", "delete", name], json_out=False)
        if res.ok:
            return
        err = (res.stderr or res.stdout).strip()
        if "wrong device name" in err.lower() or "no such" in err.lower():
            raise RdmaError(f"rdma link delete {name}: no RDMA device {name} ({err})",
                            "nvmeof-roce rdma status lists the devices")
        raise RdmaError(f"rdma link delete {name} failed: {err}",
                        "only Soft-RoCE (rxe) and siw links can be deleted; hardware devices go with their driver")


def devices(sysfs: str = SYSFS, devinfo: Optional[Dict[str, Dict[int, dict]]] = None) -> List[dict]:
    """RDMA devices, their ports and GID tables, from sysfs."""
    base = os.path.join(sysfs, "class", "infiniband")
    if not os.path.isdir(base):
        return []
    out = []
    for dev in sorted(os.listdir(base)):
        d = os.path.join(base, dev)
        node_type = _read(os.path.join(d, "node_type"))
        entry = {"name": dev, "node_type": _state(node_type), "node_guid": _read(os.path.join(d, "node_guid")),
                 "fw_ver": _read(os.path.join(d, "fw_ver")), "parent": _read(os.path.join(d, "parent")),
                 "soft_roce": _is_software(d), "iwarp": _state(node_type) == "RNIC", "ports": []}
        pdir = os.path.join(d, "ports")
        for p in sorted(os.listdir(pdir) if os.path.isdir(pdir) else [], key=lambda x: int(x) if x.isdigit() else 0):
            entry["ports"].append(_port(dev, os.path.join(pdir, p), int(p), sysfs, (devinfo or {}).get(dev, {})))
        out.append(entry)
    return out


def _is_software(devdir: str) -> bool:
    """Soft-RoCE (rxe) and siw devices have no bus device behind them, only a 'parent' netdev name."""
    return not os.path.exists(os.path.join(devdir, "device"))


def _port(dev: str, pdir: str, num: int, sysfs: str, devinfo: Dict[int, dict]) -> dict:
    gids = []
    gdir = os.path.join(pdir, "gids")
    netdev = None
    for idx in sorted((int(x) for x in os.listdir(gdir) if x.isdigit()) if os.path.isdir(gdir) else []):
        gid = _read(os.path.join(gdir, str(idx)))
        if not gid or gid == _ZERO_GID:
            continue
        gtype = _read(os.path.join(pdir, "gid_attrs", "types", str(idx)))   # EINVAL for empty entries
        ndev = _read(os.path.join(pdir, "gid_attrs", "ndevs", str(idx)))
        try:
            a6 = ipaddress.IPv6Address(gid)
            gid_c = f"::ffff:{a6.ipv4_mapped}" if a6.ipv4_mapped else str(a6)   # same on every Python
        except ValueError:
            gid_c = gid
        gids.append({"index": idx, "gid": gid_c, "type": gtype, "roce": roce_version(gtype), "netdev": ndev,
                     "ip": gid_to_ip(gid)})
        netdev = netdev or ndev
    link_layer = _read(os.path.join(pdir, "link_layer"))
    netdev_mtu = None
    if netdev:
        try:
            netdev_mtu = int(_read(os.path.join(sysfs, "class", "net", netdev, "mtu")) or "")
        except ValueError:
            netdev_mtu = None
    info = devinfo.get(num, {})
    derived_mtu = roce_mtu_for_netdev_mtu(netdev_mtu) if netdev_mtu and link_layer == "Ethernet" else None
    active_mtu = info.get("active_mtu") or derived_mtu
    return {"port": num, "state": _state(_read(os.path.join(pdir, "state"))),
            "phys_state": _state(_read(os.path.join(pdir, "phys_state"))), "link_layer": link_layer,
            "rate": _read(os.path.join(pdir, "rate")), "active_mtu": active_mtu, "max_mtu": info.get("max_mtu"),
            "netdev": netdev, "netdev_mtu": netdev_mtu, "gids": gids}


def ibv_devinfo(runner=None) -> Dict[str, Dict[int, dict]]:
    """MTUs from ibv_devinfo when it is installed; {} otherwise."""
    try:
        res = (runner or tool.run)("ibv_devinfo", [], package="ibverbs-utils", timeout=20)
    except NvmeofError:
        return {}
    return parse_ibv_devinfo(res.stdout) if res.ok else {}


def status(sysfs: str = SYSFS, configfs: str = CONFIGFS, runner=None, with_devinfo: bool = True) -> dict:
    info = ibv_devinfo(runner) if with_devinfo else {}
    devs = devices(sysfs, info)
    links = {}
    if devs:
        try:
            links = {(l.get("ifname"), l.get("port")): l for l in Rdma(runner).links()}
        except (NvmeofError, ValueError):
            links = {}
    for d in devs:
        for p in d["ports"]:
            link = links.get((d["name"], p["port"]), {})
            p["netdev"] = p["netdev"] or link.get("netdev") or d.get("parent")
            p["default_roce_mode"] = _peek_roce_mode(configfs, d["name"], p["port"])
    return {"devices": devs}


def _peek_roce_mode(configfs: str, dev: str, port: int) -> Optional[str]:
    v = _read(os.path.join(configfs, "rdma_cm", dev, "ports", str(port), "default_roce_mode"))
    return roce_version(v) if v else None


def wait_active(name: str, sysfs: str = SYSFS, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = _state(_read(os.path.join(sysfs, "class", "infiniband", name, "ports", "1", "state")))
        if st == "ACTIVE":
            return True
        time.sleep(0.1)
    return False


# The software RDMA drivers `rdma link add` can put on a netdev: module and what users call it.
SOFTWARE_LINKS = {"rxe": ("rdma_rxe", "Soft-RoCE"), "siw": ("siw", "Soft-iWARP")}


def add_link(kind: str, netdev: str, name: str, sysfs: str = SYSFS, rdma: Optional[Rdma] = None,
             load_modules: bool = True, sys_module: str = modules.SYS_MODULE, timeout: float = 10.0) -> dict:
    """A software RDMA device on `netdev`: Soft-RoCE (rxe, RoCE v2) or Soft-iWARP (siw, iWARP over TCP)."""
    module, label = SOFTWARE_LINKS[kind]
    if not os.path.isdir(os.path.join(sysfs, "class", "net", netdev)):
        raise RdmaError(f"netdev {netdev} does not exist", "give an existing Ethernet netdev (ip -br link); "
                        f"for a test: ip link add {kind}net0 type dummy; ip addr add 10.99.0.1/24 dev {kind}net0; "
                        f"ip link set {kind}net0 up")
    if netdev == "lo":
        raise RdmaError(f"{label} over lo is not supported by {module}", "use a dummy or Ethernet netdev")
    if os.path.isdir(os.path.join(sysfs, "class", "infiniband", name)):
        raise RdmaError(f"an RDMA device named {name} already exists", f"pick another --name, or del-{kind} it first")
    if load_modules:
        modules.ensure(module, label, sys_module)
    (rdma or Rdma()).link_add(name, netdev, kind)
    active = wait_active(name, sysfs, timeout)
    dev = next((d for d in devices(sysfs) if d["name"] == name), None)
    if not active:
        log.warning("%s is not ACTIVE after %.0f s (is %s up? ip link set %s up)", name, timeout, netdev, netdev)
    return {"name": name, "kind": kind, "netdev": netdev, "active": active, "device": dev}


def add_rxe(netdev: str, name: str = "rxe0", **kw) -> dict:
    return add_link("rxe", netdev, name, **kw)


def add_siw(netdev: str, name: str = "siw0", **kw) -> dict:
    return add_link("siw", netdev, name, **kw)


def del_link(name: str, sysfs: str = SYSFS, rdma: Optional[Rdma] = None) -> dict:
    if not os.path.isdir(os.path.join(sysfs, "class", "infiniband", name)):
        raise RdmaError(f"no RDMA device {name}", "nvmeof-roce rdma status lists the devices")
    (rdma or Rdma()).link_delete(name)
    return {"name": name, "deleted": True}


del_rxe = del_link  # the older name


# --------------------------------------------------------------------------- RoCE mode (rdma_cm configfs)

class _CmaDir:
    """mkdir rdma_cm/DEV for the duration of a read or write; removed again if we created it."""

    def __init__(self, configfs: str, dev: str, load_modules: bool, sys_module: str):
        self.base = os.path.join(configfs, "rdma_cm")
        self.path = os.path.join(self.base, dev)
        self.dev = dev
        self.created = False
        if not os.path.isdir(self.base):
            if load_modules:
                modules.ensure("rdma_cm", "rdma_cm's configfs", sys_module)
            if not os.path.isdir(self.base):
                if not os.path.isdir(configfs):
                    raise RdmaError(f"{configfs} does not exist: configfs is not mounted",
                                    f"mount -t configfs none {configfs}")
                raise RdmaError(f"{self.base} does not exist: rdma_cm is not loaded", "modprobe rdma_cm")

    def __enter__(self):
        if not os.path.isdir(self.path):
            try:
                os.mkdir(self.path)
            except OSError as exc:
                if exc.errno == errno.ENODEV:
                    raise RdmaError(f"no RDMA device {self.dev} (mkdir {self.path}: ENODEV)",
                                    "nvmeof-roce rdma status lists the devices") from None
                if exc.errno in (errno.EPERM, errno.EACCES):
                    raise RdmaError(f"mkdir {self.path}: permission denied", "run as root") from None
                raise RdmaError(f"mkdir {self.path} failed: {exc.strerror}", "see dmesg") from None
            self.created = True
        return self

    def __exit__(self, *exc):
        if self.created:
            try:
                os.rmdir(self.path)
            except OSError:
                pass

    def port_file(self, port: int) -> str:
        f = os.path.join(self.path, "ports", str(port), "default_roce_mode")
        if not os.path.isfile(f):
            ports = sorted(os.listdir(os.path.join(self.path, "ports"))) if os.path.isdir(
                os.path.join(self.path, "ports")) else []
            raise RdmaError(f"{self.dev} has no port {port}", f"ports of {self.dev}: {', '.join(ports) or 'none'}")
        return f


def get_roce_mode(dev: str, port: int = 1, configfs: str = CONFIGFS, load_modules: bool = True,
                  sys_module: str = modules.SYS_MODULE) -> dict:
    with _CmaDir(configfs, dev, load_modules, sys_module) as c:
        raw = _read(c.port_file(port))
    return {"device": dev, "port": port, "mode": roce_version(raw), "raw": raw}


def set_roce_mode(dev: str, port: int, mode: str, configfs: str = CONFIGFS, sysfs: str = SYSFS,
                  load_modules: bool = True, sys_module: str = modules.SYS_MODULE) -> dict:
    m = mode.lower().replace("roce", "").replace(" ", "").lstrip("-")
    if m not in ROCE_MODES:
        raise RdmaError(f"RoCE mode {mode!r} is not v1 or v2", "give v1 or v2")
    with _CmaDir(configfs, dev, load_modules, sys_module) as c:
        f = c.port_file(port)
        before = _read(f)
        try:
            with open(f, "w", encoding="utf-8") as fh:
                fh.write(ROCE_MODES[m])
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                types = {g["roce"] for p in (next((d for d in devices(sysfs) if d["name"] == dev), {}) or {}).get(
                    "ports", []) if p["port"] == port for g in p["gids"]}
                why = (f"its GID table has only RoCE {', '.join(sorted(t for t in types if t))} entries"
                       if types else "the device does not support it")
                raise RdmaError(f"{dev} port {port} refuses RoCE {m} (EINVAL): {why}",
                                "Soft-RoCE (rxe) supports RoCE v2 only; use v2, or a device with RoCE v1 GIDs"
                                ) from None
            raise RdmaError(f"writing {f} failed: {exc.strerror}", "run as root; see dmesg") from None
        after = _read(f)
    return {"device": dev, "port": port, "mode": roce_version(after), "was": roce_version(before), "raw": after}


def all_roce_modes(sysfs: str = SYSFS, configfs: str = CONFIGFS, load_modules: bool = True,
                   sys_module: str = modules.SYS_MODULE) -> List[dict]:
    out = []
    for d in devices(sysfs):
        for p in d["ports"]:
            if p["link_layer"] != "Ethernet":
                continue
            out.append(get_roce_mode(d["name"], p["port"], configfs, load_modules, sys_module))
    return out
