"""The bench's kernel glue: a RAM-backed nvmet-rdma export and the nvme-cli host side.

The export goes through the project's kernel layer: the config (the one schema, `kernel_config()`) is
applied with `nvmeof_roce.kernel.apply.apply(..., prune=False)`, so only the bench's own objects are added,
and removed through `nvmeof_roce.kernel.nvmet` (the subsystem and the ports that exported it). The host
connects with `nvmeof_roce.kernel.nvme_cli.NvmeCli`. What the kernel layer has no notion of lives here: the
memory-backed null_blk device (configfs nullb), finding the namespace's block device in sysfs, and waiting.

Every object made here is named after the bench (its own NQN, a free port id, its own null_blk device),
so nothing another user configured is touched, and removal is idempotent.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from ..errors import NvmeofError, ToolMissing

log = logging.getLogger(__name__)

CONFIGFS = Path("/sys/kernel/config")
SYSFS = Path("/sys")


def _write(path: Path, value: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except OSError as exc:
        raise NvmeofError(f"writing {value!r} to {path} failed: {exc.strerror or exc}",
                          "see dmesg for the kernel's reason") from exc


def modprobe(*modules: str) -> None:
    """Load kernel modules (nothing to do when already loaded or built in)."""
    from ..kernel import modules as kmodules
    for m in modules:
        try:
            kmodules.ensure(m, "the bench")
        except NvmeofError as exc:
            raise NvmeofError(exc.message,
                              "use a kernel with NVMe-oF/RDMA modules (nvmet, nvmet-rdma, nvme-rdma, null_blk), "
                              "or the lab: nvmeof-roce lab run -- nvmeof-roce bench") from None


def require_root(what: str) -> None:
    if os.geteuid() != 0:
        raise NvmeofError(f"{what} needs root (configfs, nvme connect)", "run it as root (sudo)")


# --- RDMA CM listeners: who is bound to an address and port ------------------------------------------

def rdma_listeners() -> Optional[List[Dict[str, object]]]:
    """[{"addr", "port", "comm"}] of RDMA CM ids in LISTEN state; None when `rdma` cannot tell."""
    from ..kernel.softroce import Rdma
    try:
        res = Rdma().run(["resource", "show", "cm_id"])
    except NvmeofError:  # no rdma tool
        return None
    if not res.ok:
        return None
    return parse_cm_id_listeners(res.stdout)


def parse_cm_id_listeners(text: str) -> Optional[List[Dict[str, object]]]:
    """The LISTEN entries of `rdma -j resource show cm_id`."""
    try:
        entries = json.loads(text or "[]")
    except ValueError:
        return None
    out = []
    for e in entries if isinstance(entries, list) else []:
        if not isinstance(e, dict) or str(e.get("state", "")).upper() != "LISTEN":
            continue
        addr, port = _split_addr(e)
        out.append({"addr": addr, "port": port, "comm": str(e.get("comm", ""))})
    return out


def _split_addr(entry: dict):
    """iproute2 prints "src-addr": "10.99.0.1:4420" ("[fe80::1]:4420" for IPv6); older ones had "src-port"."""
    addr = str(entry.get("src-addr", ""))
    if "src-port" in entry:
        return addr, int(entry["src-port"] or 0)
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        return addr, 0
    return host.strip("[]"), int(port)


def listener_on(traddr: str, trsvcid: int) -> Optional[str]:
    """The process name listening on traddr:trsvcid (or on the wildcard address), '' if none, None if unknown."""
    listeners = rdma_listeners()
    if listeners is None:
        return None
    for entry in listeners:
        if entry["port"] == int(trsvcid) and entry["addr"] in (traddr, "0.0.0.0", "::"):
            return entry["comm"] or "?"
    return ""


# --- RAM-backed block device: null_blk through configfs (memory_backed) ------------------------------

@dataclass
class NullBlk:
    """A memory-backed null_blk device of our own (configfs /sys/kernel/config/nullb/<name>).

    `completion_ns` > 0 models a slower device: every command completes that long after it was submitted
    (null_blk's irqmode=2, a timer per command, completion_nsec), with `queue_depth` commands on it at once
    (hw_queue_depth): 20 µs is a fast NVMe SSD, 100 µs a SATA SSD, 2 ms a disk or a network volume."""

    name: str
    size_mb: int
    block_size: int = 512
    configfs: Path = CONFIGFS
    path: Optional[str] = None
    completion_ns: int = 0
    queue_depth: int = 256

    @property
    def directory(self) -> Path:
        return self.configfs / "nullb" / self.name

    def create(self) -> str:
        if not (self.configfs / "nullb").is_dir():
            # nr_devices=0: no default nullb0 if we are the first to load the module
            from ..kernel import tool
            proc = tool.run("modprobe", ["null_blk", "nr_devices=0"], package="kmod")
            if not proc.ok or not (self.configfs / "nullb").is_dir():
                raise NvmeofError("null_blk's configfs (/sys/kernel/config/nullb) is not available: "
                                  f"{proc.stderr.strip() or 'module loaded without configfs'}",
                                  "load null_blk, mount configfs, or use --kernel-backend file")
        if self.directory.exists():
            self.remove()  # left over by an interrupted run of ours
        self.directory.mkdir()
        timing = (("irqmode", "2"), ("completion_nsec", str(self.completion_ns))) if self.completion_ns else \
            (("irqmode", "0"),)
        for attr, value in (("size", str(self.size_mb)), ("blocksize", str(self.block_size)),
                            ("memory_backed", "1"), ("hw_queue_depth", str(self.queue_depth))) + timing + \
                (("power", "1"),):
            _write(self.directory / attr, value)
        index = (self.directory / "index").read_text().strip()
        # since Linux 6.0 a configfs device's disk takes the directory's name; before, nullb<index>
        candidates = [f"/dev/{self.name}", f"/dev/nullb{index}"]
        _wait_for(lambda: any(_is_our_disk(c, self.size_mb) for c in candidates), 20.0,
                  f"the null_blk disk ({' or '.join(candidates)}) to appear")
        self.path = next(c for c in candidates if _is_our_disk(c, self.size_mb))
        return self.path

    def remove(self) -> None:
        if not self.directory.exists():
            return
        try:
            _write(self.directory / "power", "0")
        except NvmeofError as exc:
            log.warning("%s", exc)
        self.directory.rmdir()


def _is_our_disk(dev: str, size_mb: int) -> bool:
    name = os.path.basename(dev)
    try:
        sectors = int((SYSFS / "block" / name / "size").read_text())
    except (OSError, ValueError):
        return False
    return os.path.exists(dev) and sectors * 512 == size_mb << 20


@dataclass
class TmpfsFile:
    """A file on tmpfs (/dev/shm): nvmet serves it with buffered_io (tmpfs refuses O_DIRECT)."""

    name: str
    size_mb: int
    directory: Path = Path("/dev/shm")
    path: Optional[str] = None

    def create(self) -> str:
        p = self.directory / f"{self.name}.img"
        with open(p, "wb") as f:
            f.truncate(self.size_mb << 20)
        self.path = str(p)
        return self.path

    def remove(self) -> None:
        if self.path and os.path.exists(self.path):
            os.unlink(self.path)


@dataclass
class DiskFile:
    """A file on the machine's own disk (not tmpfs), written through once so every read reaches the disk:
    both targets serve it with O_DIRECT (nvmet's default buffered_io=0; ours with "buffered_io": 0)."""

    name: str
    size_mb: int
    directory: Path = Path("/var/tmp")
    path: Optional[str] = None

    def create(self) -> str:
        p = self.directory / f"nvmeof-roce-{self.name}.img"
        block = bytes(range(256)) * 4096  # 1 MiB, not zeros: a filesystem cannot skip it
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                for _ in range(self.size_mb):
                    os.write(fd, block)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise NvmeofError(f"cannot write the bench's {self.size_mb} MiB file {p}: {exc.strerror}",
                              "free space there, or a smaller --ns-size") from None
        self.path = str(p)
        return self.path

    def remove(self) -> None:
        if self.path and os.path.exists(self.path):
            os.unlink(self.path)


# --- the nvmet export -----------------------------------------------------------------------------

def kernel_config(nqn: str, device_path: str, traddr: str, trsvcid: int, portid: int = 1,
                  buffered_io: bool = False, trtype: str = "rdma") -> dict:
    """The export in the project's config schema (nvmetcli's shape), for `nvmet apply` once it lands."""
    ns = {"nsid": 1, "enable": 1, "device": {"path": device_path}}
    if buffered_io:
        ns["buffered_io"] = 1
    return {"hosts": [],
            "ports": [{"portid": portid, "addr": {"trtype": trtype, "adrfam": "ipv4", "traddr": traddr,
                                                  "trsvcid": str(trsvcid), "treq": "not specified"},
                       "subsystems": [nqn], "referrals": []}],
            "subsystems": [{"nqn": nqn, "attr": {"allow_any_host": "1"}, "allowed_hosts": [],
                            "namespaces": [ns]}]}


@dataclass
class NvmetExport:
    """One subsystem with one namespace on one port (RDMA, or TCP) of the kernel's nvmet."""

    nqn: str
    device_path: str
    traddr: str
    trsvcid: int
    buffered_io: bool = False
    trtype: str = "rdma"
    configfs: Path = CONFIGFS
    portid: Optional[int] = None

    def _root(self, load_modules: bool = True):
        from ..kernel.nvmet import Root
        return Root(str(self.configfs / "nvmet"), load_modules=load_modules)

    def _free_portid(self) -> int:
        used = {int(p.name) for p in (self.configfs / "nvmet" / "ports").iterdir() if p.name.isdigit()}
        n = 1
        while n in used:
            n += 1
        return n

    def config(self):
        from ..config import parse_config
        return parse_config(kernel_config(self.nqn, self.device_path, self.traddr, self.trsvcid,
                                          self.portid or 1, self.buffered_io, self.trtype),
                            source="bench kernel target")

    def create(self) -> None:
        from ..kernel.apply import apply
        root = self._root()
        if (self.configfs / "nvmet" / "subsystems" / self.nqn).exists():
            self.remove()  # left over by an interrupted run of ours (our own NQN)
        self.portid = self._free_portid()
        try:
            apply(root, self.config(), prune=False)  # adds ours, leaves everything else alone
        except NvmeofError as exc:
            raise NvmeofError(f"setting up nvmet-{self.trtype} on {self.traddr}:{self.trsvcid}: {exc.message}",
                              exc.fix or "see dmesg") from None

    def remove(self) -> None:
        """Remove our subsystem and the ports that exported only it (ours: same NQN)."""
        if not (self.configfs / "nvmet").is_dir():
            return
        from ..kernel.nvmet import Port
        root = self._root(load_modules=False)
        ports = []
        subsys_dir = self.configfs / "nvmet" / "subsystems" / self.nqn
        if subsys_dir.is_dir():
            sub = root.subsystem(self.nqn)
            ports = sub.ports
            sub.delete()  # unlinks it from its ports, deletes its namespaces
        if self.portid is not None and (self.configfs / "nvmet" / "ports" / str(self.portid)).is_dir():
            ports.append(Port(root, self.portid, "lookup"))  # made by us, maybe never linked
        for port in ports:
            if port.exists and not port.subsystems:
                port.delete()
        self.portid = None


# --- host side: nvme-cli connect / disconnect, the namespace's block device -------------------------

def nvme_binary() -> str:
    """Where nvme-cli is (the kernel layer also looks in /usr/sbin and /sbin)."""
    for path in (shutil.which("nvme"), "/usr/sbin/nvme", "/sbin/nvme"):
        if path and os.path.exists(path):
            return path
    raise ToolMissing("nvme", "nvme-cli")


def _nvme_cli():
    from ..kernel.nvme_cli import NvmeCli
    return NvmeCli()


def controllers(nqn: str, sysfs: Path = SYSFS) -> List[str]:
    """Names (nvmeN) of the controllers connected to subsystem `nqn`."""
    out = []
    for ctrl in sorted((sysfs / "class" / "nvme").glob("nvme*")):
        try:
            if (ctrl / "subsysnqn").read_text().strip() == nqn:
                out.append(ctrl.name)
        except OSError:
            continue
    return out


def namespace_devices(nqn: str, sysfs: Path = SYSFS) -> List[str]:
    """/dev paths of the block devices of subsystem `nqn`: the multipath heads (nvme-subsysN/nvmeXnY) or,
    without native multipath, the controllers' namespaces (nvmeX/nvmeXnY)."""
    pattern = re.compile(r"^nvme\d+n\d+$")
    devices = []
    for sub in sorted((sysfs / "class" / "nvme-subsystem").glob("nvme-subsys*")):
        try:
            if (sub / "subsysnqn").read_text().strip() != nqn:
                continue
        except OSError:
            continue
        devices += [e.name for e in sorted(sub.iterdir()) if pattern.match(e.name)]
    if not devices:
        for ctrl in controllers(nqn, sysfs):
            devices += [e.name for e in sorted((sysfs / "class" / "nvme" / ctrl).iterdir()) if pattern.match(e.name)]
    return [f"/dev/{d}" for d in sorted(set(devices))]


def _connect_retrying(cli, traddr: str, trsvcid: int, nqn: str, timeout: float, accept_existing: bool,
                      fix: str, trtype: str = "rdma") -> None:
    """`nvme connect` until it succeeds or `timeout` passes (the target may still be starting to listen).
    With accept_existing, a failed connect that nonetheless left a controller of `nqn` counts as connected
    (the first path; a later path's failure is never hidden by the controllers of the earlier ones)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            cli.connect(traddr, nqn, trsvcid=trsvcid, transport=trtype)
            return
        except NvmeofError as exc:
            if accept_existing and controllers(nqn):
                return
            if time.monotonic() > deadline:
                raise NvmeofError(f"nvme connect to {nqn} at {traddr}:{trsvcid} failed: {exc.message}",
                                  exc.fix or fix) from None
            time.sleep(0.5)


def nvme_connect(traddr: str, trsvcid: int, nqn: str, timeout: float = 30.0, device_timeout: float = 20.0,
                 trtype: str = "rdma") -> str:
    """Connect the kernel host to nqn at traddr:trsvcid (over RDMA, or TCP) and return the namespace's block
    device."""
    nvme_binary()
    cli = _nvme_cli()
    if controllers(nqn):
        nvme_disconnect(nqn)  # a stale connection of ours (same NQN) from an interrupted run
    _connect_retrying(cli, traddr, trsvcid, nqn, timeout, accept_existing=True,
                      fix="is the target listening? (rdma resource show cm_id; ss -ltn; dmesg)", trtype=trtype)
    devices: List[str] = []

    def found() -> bool:
        devices[:] = [d for d in namespace_devices(nqn) if os.path.exists(d)]
        return bool(devices)

    try:
        _wait_for(found, device_timeout, f"a block device for {nqn}")
    except NvmeofError:
        nvme_disconnect(nqn)
        raise NvmeofError(f"connected to {nqn} but no namespace block device appeared",
                          "check that the subsystem has an enabled namespace (dmesg)")
    return devices[0]


def nvme_disconnect(nqn: str, timeout: float = 30.0) -> None:
    """Disconnect every controller of `nqn`, and wait until they are gone."""
    if not controllers(nqn):
        return
    problem = ""
    try:
        _nvme_cli().disconnect(nqn=nqn)
    except NvmeofError as exc:
        problem = exc.message
    try:
        _wait_for(lambda: not controllers(nqn), timeout, f"the controllers of {nqn} to go away")
    except NvmeofError:
        raise NvmeofError(f"nvme disconnect -n {nqn} left {', '.join(controllers(nqn))} connected"
                          + (f": {problem}" if problem else ""), f"nvme disconnect -n {nqn}")


def _wait_for(predicate, timeout: float, what: str, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise NvmeofError(f"timed out after {timeout:.0f} s waiting for {what}", "check dmesg")
        time.sleep(interval)


# --- native multipath: one subsystem over several ports (target serve --workers N) -------------------

MULTIPATH_PARAM = SYSFS / "module" / "nvme_core" / "parameters" / "multipath"


def subsystem_dir(nqn: str, sysfs: Path = SYSFS) -> Optional[Path]:
    """/sys/class/nvme-subsystem/nvme-subsysN of `nqn`, None when not connected."""
    for sub in sorted((sysfs / "class" / "nvme-subsystem").glob("nvme-subsys*")):
        try:
            if (sub / "subsysnqn").read_text().strip() == nqn:
                return sub
        except OSError:
            continue
    return None


def controller_trsvcid(ctrl: str, sysfs: Path = SYSFS) -> Optional[str]:
    """The trsvcid of controller `ctrl` (nvmeN), from its sysfs `address` (traddr=..,trsvcid=..)."""
    try:
        addr = (sysfs / "class" / "nvme" / ctrl / "address").read_text().strip()
    except OSError:
        return None
    return dict(kv.split("=", 1) for kv in addr.split(",") if "=" in kv).get("trsvcid")


def path_devices(device: str, sysfs: Path = SYSFS) -> Dict[str, str]:
    """{trsvcid: hidden path disk} of a multipath head /dev/nvmeXnY: its paths are nvmeXcCnY, C being the
    controller instance (nvmeC), whose address names the port (the kernel's nvme_mpath_set_disk_name)."""
    m = re.fullmatch(r"nvme(\d+)n(\d+)", Path(device).name)
    out: Dict[str, str] = {}
    if not m:
        return out
    for p in sorted((sysfs / "block").glob(f"nvme{m.group(1)}c*n{m.group(2)}")):
        c = re.fullmatch(rf"nvme{m.group(1)}c(\d+)n{m.group(2)}", p.name)
        svc = controller_trsvcid(f"nvme{c.group(1)}", sysfs) if c else None
        if svc is not None:
            out[svc] = p.name
    return out


def path_ios(device: str, sysfs: Path = SYSFS) -> Dict[str, int]:
    """{trsvcid: I/Os completed (reads + writes)} per path of a multipath head: what each worker served."""
    from .procstat import parse_block_stat
    out = {}
    for svc, disk in path_devices(device, sysfs).items():
        try:
            out[svc] = parse_block_stat((sysfs / "block" / disk / "stat").read_text())
        except (OSError, ValueError):
            continue
    return out


def live_paths(nqn: str, cli=None) -> Dict[str, str]:
    """{trsvcid: state} of `nqn`'s paths, as `nvme list-subsys` shows them."""
    cli = cli or _nvme_cli()
    return {str(p.get("trsvcid")): str(p.get("state")) for s in cli.list_subsystems() if s["nqn"] == nqn
            for p in s["paths"]}


def nvme_connect_paths(traddr: str, trsvcids: List[int], nqn: str, iopolicy: str = "round-robin",
                       timeout: float = 30.0, device_timeout: float = 20.0) -> str:
    """Connect the kernel host to `nqn` through every port in `trsvcids` (one controller per worker of
    `target serve --workers N`), set the subsystem's iopolicy, check with `nvme list-subsys` that every path
    is live, and return the one namespace head the I/O goes to. Any shortfall disconnects and raises."""
    if MULTIPATH_PARAM.exists() and MULTIPATH_PARAM.read_text().strip() != "Y":
        raise NvmeofError("native NVMe multipath is off (nvme_core multipath=N): the host would make one "
                          "block device per worker instead of spreading I/O over them",
                          "boot the host with nvme_core.multipath=Y")
    nvme_connect(traddr, trsvcids[0], nqn, timeout, device_timeout)  # (clears a stale connection first)
    cli = _nvme_cli()
    try:
        for svc in trsvcids[1:]:
            _connect_retrying(cli, traddr, svc, nqn, timeout, accept_existing=False, fix="is every worker listening?")
        want = sorted(str(s) for s in trsvcids)
        paths: Dict[str, str] = {}

        def all_live() -> bool:
            paths.clear()
            paths.update(live_paths(nqn, cli))
            return sorted(paths) == want and all(s == "live" for s in paths.values())

        try:
            _wait_for(all_live, device_timeout, f"{len(want)} live paths", interval=0.3)
        except NvmeofError:
            raise NvmeofError(f"{nqn}: nvme list-subsys shows paths {paths or 'none'}, expected "
                              f"{', '.join(want)} all live", "check that every worker listens (the target's log) "
                              "and dmesg") from None
        sub = subsystem_dir(nqn)
        if sub is None or not (sub / "iopolicy").exists():
            raise NvmeofError(f"{nqn}: no nvme-subsystem iopolicy in sysfs", "boot with nvme_core.multipath=Y")
        _write(sub / "iopolicy", iopolicy)
        if (sub / "iopolicy").read_text().strip() != iopolicy:
            raise NvmeofError(f"{sub}/iopolicy did not take {iopolicy!r}", "an older kernel? see docs/multipath.md")
        heads = [d for d in namespace_devices(nqn) if os.path.exists(d)]
        if len(heads) != 1 or len(path_devices(heads[0])) != len(want):
            raise NvmeofError(f"{nqn}: expected one namespace head with {len(want)} paths, found "
                              f"{heads} with paths {path_devices(heads[0]) if heads else {}}",
                              "native multipath must join the workers' controllers (same NQN and NGUID)")
        return heads[0]
    except BaseException:
        nvme_disconnect(nqn)
        raise
