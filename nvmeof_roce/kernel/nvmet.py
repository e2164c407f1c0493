"""An object model over the kernel NVMe target's configfs tree, /sys/kernel/config/nvmet.

In the manner of rtslib-fb's CFSNode (and nvmetcli's nvmet/nvme.py): one class per configfs
directory — Root, Subsystem, Namespace, Port, Host, Referral, AnaGroup — created or looked up
(``mode='create' | 'lookup' | 'any'``), with attributes listed from the filesystem in groups
(``attr_*``, ``device_*``, ``addr_*``, ...). ``dump()`` gives nvmetcli's JSON shape, so what we
save nvmetcli can restore and the other way round.

The kernel's own rules come back as errno values from configfs; `translate()` turns them into
an `NvmetError` that names the object, the attribute and the fix (a port attribute changed while
subsystems are linked, a namespace attribute while enabled, allow_any_host with an allow-list, a
tmpfs file without buffered_io, a missing transport module, ...).

Every filesystem access goes through a `ConfigFS` object, so tests run this code against a fake
tree with the kernel's rules (tests/unit/fake_nvmet.py); the root path is injectable too.
"""
import errno
import ipaddress
import json
import logging
import os
import stat
from typing import List, Optional

from ..config.devices import create_file_command, in_system_tree, missing_device
from ..errors import NvmeofError
from ..nvme.command import NSID_MAX
from ..securefile import write_file
from ..transport.registry import FABRICS, fabric
from . import modules

log = logging.getLogger(__name__)

NVMET_ROOT = "/sys/kernel/config/nvmet"
DEFAULT_SAVE_FILE = "/etc/nvmet/config.json"
ANA_DEFAULT_GROUP = 1

# transport -> the module that provides it in the kernel target
TRANSPORT_MODULES = {f.trtype: f.kernel_module for f in FABRICS.values() if f.kernel_module}


class NvmetError(NvmeofError):
    """A configfs operation the kernel refused, or a tree that is not there."""


# --------------------------------------------------------------------------- filesystem access

class ConfigFS:
    """The file operations the model needs (real configfs). Tests substitute a fake."""

    def isdir(self, p): return os.path.isdir(p)
    def isfile(self, p): return os.path.isfile(p)
    def islink(self, p): return os.path.islink(p)
    def exists(self, p): return os.path.lexists(p)
    def listdir(self, p): return sorted(os.listdir(p))
    def mkdir(self, p): os.mkdir(p)
    def rmdir(self, p): os.rmdir(p)
    def symlink(self, target, link): os.symlink(target, link)
    def unlink(self, p): os.unlink(p)
    def readlink(self, p): return os.readlink(p)

    def writable(self, p):
        return bool(os.stat(p).st_mode & stat.S_IWUSR)

    def readable(self, p):
        return bool(os.stat(p).st_mode & stat.S_IRUSR)

    def read(self, p):
        with open(p, "r", encoding="utf-8", errors="replace") as f:
            return f.read()

    def write(self, p, value):
        # one write() call: configfs attributes take the whole value in one store
        fd = os.open(p, os.O_WRONLY)
        try:
            os.write(fd, str(value).encode("utf-8"))
        finally:
            os.close(fd)


# --------------------------------------------------------------------------- filesystem type

def fs_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> Optional[str]:
    """The filesystem type holding `path` (longest mount point prefix), or None."""
    try:
        with open(mountinfo, "r", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    path = os.path.realpath(path)
    best, best_type = "", None
    for line in lines:
        parts = line.split(" - ", 1)
        if len(parts) != 2:
            continue
        fields = parts[0].split()
        if len(fields) < 5:
            continue
        mnt = fields[4].replace("\\040", " ")
        ftype = parts[1].split()[0]
        if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, best_type = mnt, ftype
    return best_type


# --------------------------------------------------------------------------- error translation

def _errname(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno, str(exc.errno))


def translate(op: str, relpath: str, exc: OSError, root: "Root", value=None, field: str = "") -> NvmetError:
    """Turn an OSError from configfs into a message naming the object, the attribute and the fix.

    op: mkdir, rmdir, write, read, symlink, unlink; relpath: the path under the nvmet root.
    """
    parts = relpath.strip("/").split("/")
    code = exc.errno
    en = _errname(exc)
    where = f" ({field})" if field else ""
    kind = parts[0] if parts else ""
    leaf = parts[-1]
    what = describe(relpath)

    if code == errno.ENOENT and op in ("mkdir", "write", "symlink") and not root.fs.isdir(root.path):
        return NvmetError(f"{root.path} does not exist: the nvmet module is not loaded",
                          "modprobe nvmet nvmet-rdma (as root); configfs must be mounted on /sys/kernel/config")
    if code in (errno.EPERM, errno.EACCES) and os.geteuid() != 0:
        return NvmetError(f"{what}: permission denied ({en}){where}", "run as root (sudo nvmeof-roce ...)")

    # ports/N/addr_* or param_* while the port is enabled (a subsystem is linked)
    if kind == "ports" and len(parts) == 3 and op == "write" and code == errno.EACCES:
        return NvmetError(f"{what}: the kernel refuses to change {leaf} while subsystems are linked to port "
                          f"{parts[1]} (EACCES){where}",
                          f"unlink the subsystems from ports/{parts[1]}/subsystems first, change it, and link "
                          "them again (nvmeof-roce nvmet apply does this), or delete and recreate the port")
    if kind == "ports" and len(parts) == 5 and parts[2] == "referrals" and op == "write" and code == errno.EACCES:
        return NvmetError(f"{what}: the kernel refuses to change {leaf} while the referral is enabled{where}",
                          "write 0 to its enable attribute first, then change it and enable it again")
    # a namespace attribute while enabled
    if kind == "subsystems" and len(parts) == 5 and parts[2] == "namespaces" and op == "write":
        nsdir = "/".join(parts[:4])
        enabled = root._read_int(nsdir + "/enable") == 1
        if leaf == "enable" and str(value).strip() == "1":
            return _enable_failure(root, nsdir, exc, field)
        if enabled and (code == errno.EBUSY or (leaf == "buffered_io" and code == errno.EINVAL)):
            return NvmetError(f"{what}: the kernel refuses to change {leaf} while namespace {parts[3]} is "
                              f"enabled ({en}){where}",
                              f"disable it first (echo 0 > {root.path}/{nsdir}/enable), change it, enable it "
                              "again (nvmeof-roce nvmet apply does this)")
        if leaf in ("device_uuid", "device_nguid") and code == errno.EINVAL:
            return NvmetError(f"{what}: the kernel refuses {value!r} for {leaf} (EINVAL){where}",
                              "give a UUID (8-4-4-4-12 hex digits)" if leaf == "device_uuid"
                              else "give 16 bytes as 32 hex digits")
        if leaf == "ana_grpid" and code == errno.EINVAL:
            return NvmetError(f"{what}: ANA group {value!r} is not valid (EINVAL){where}",
                              "use a group id 1..128 and create the ANA group on the ports (ana_groups)")
    if kind == "subsystems" and len(parts) == 3 and op == "write":
        if leaf == "attr_allow_any_host" and code == errno.EINVAL:
            return NvmetError(f"{what}: the kernel refuses allow_any_host=1 while allowed_hosts lists hosts "
                              f"(EINVAL){where}",
                              f"remove the hosts from subsystems/{parts[1]}/allowed_hosts first, or keep "
                              "allow_any_host=0 and use the allow-list")
        if leaf in ("attr_serial", "attr_model", "attr_firmware", "attr_ieee_oui", "attr_cntlid_min",
                    "attr_cntlid_max", "attr_version") and code in (errno.EINVAL, errno.EBUSY):
            return NvmetError(f"{what}: the kernel refuses {value!r} for {leaf[5:]} ({en}){where}: it is fixed "
                              "once a host has identified the subsystem, or the value is out of range",
                              "delete and recreate the subsystem to change it (disconnect its hosts), or check "
                              "the value (serial <= 20, model <= 40 ASCII characters; cntlid 1..65519)")
    if kind == "subsystems" and len(parts) == 4 and parts[2] == "allowed_hosts" and op == "symlink":
        if code == errno.EINVAL:
            return NvmetError(f"{what}: the kernel refuses an allowed host while allow_any_host is 1 "
                              f"(EINVAL){where}", f"set subsystems/{parts[1]}/attr_allow_any_host to 0 first")
        if code == errno.ENOENT:
            return NvmetError(f"{what}: host {parts[3]} does not exist under hosts/{where}",
                              f"create it first (mkdir {root.path}/hosts/{parts[3]})")
    if kind == "ports" and len(parts) == 4 and parts[2] == "subsystems" and op == "symlink":
        return _link_failure(root, parts[1], parts[3], exc, field)
    if op == "mkdir" and code == errno.EEXIST:
        return NvmetError(f"{what} already exists{where}", "look it up instead of creating it, or delete it first")
    if op == "mkdir" and code == errno.EINVAL:
        return NvmetError(f"{what}: the kernel refuses to create it (EINVAL){where}",
                          "check the name: an NQN (not the discovery NQN), an NSID 1..0xFFFFFFFE, a port id 0..65535,"
                          " an ANA group 1..128")
    if op == "rmdir" and code in (errno.ENOTEMPTY, errno.EBUSY):
        return NvmetError(f"{what}: cannot remove it while it has children or links ({en}){where}",
                          "remove its namespaces, allowed hosts and port links first (nvmeof-roce nvmet clear "
                          "does all of it)")
    if op == "write" and code == errno.EINVAL:
        return NvmetError(f"{what}: the kernel refuses {value!r} for {leaf} (EINVAL){where}",
                          "check the value; dmesg shows the kernel's reason")
    if op in ("read", "write", "mkdir", "rmdir", "symlink", "unlink") and code == errno.ENOENT:
        return NvmetError(f"{what}: no such configfs entry ({relpath}){where}",
                          "this kernel does not have that attribute/object, or it was removed meanwhile "
                          "(remove the key from the file)")
    return NvmetError(f"{what}: {op} failed: {exc.strerror or en} ({en}){where}",
                      "see dmesg for the kernel's reason")


def _enable_failure(root: "Root", nsdir: str, exc: OSError, field: str) -> NvmetError:
    path = (root._read(nsdir + "/device_path") or "").strip()
    if path == "(null)":
        path = ""
    what = describe(nsdir)
    where = f" ({field})" if field else ""
    if not path:
        return NvmetError(f"{what}: cannot enable, device_path is empty{where}",
                          "set device.path to a file or block device first")
    if (exc.errno == errno.ENOENT or not os.path.exists(path)) and in_system_tree(path):
        problem, fix = missing_device(path)
        return NvmetError(f"{what}: cannot enable, {problem}{where}", fix)
    if exc.errno == errno.ENOENT or not os.path.exists(path):
        return NvmetError(f"{what}: cannot enable, {path} does not exist{where}",
                          f"create it ({create_file_command(path)}, or a loop/null_blk device) or fix device.path")
    buffered = root._read_int(nsdir + "/buffered_io")
    if exc.errno == errno.EINVAL and fs_type(path) == "tmpfs" and not buffered:
        return NvmetError(f"{what}: cannot enable, {path} is on tmpfs, which refuses the O_DIRECT nvmet "
                          f"uses (EINVAL){where}",
                          'set buffered_io before enabling ("buffered_io": 1 on the namespace in the config, '
                          f"or echo 1 > {root.path}/{nsdir}/buffered_io)")
    if exc.errno == errno.EBUSY:
        return NvmetError(f"{what}: cannot enable, {path} is in use (EBUSY){where}",
                          "a block device can be exported once: unmount it / remove it from other namespaces")
    return NvmetError(f"{what}: cannot enable it on {path}: {exc.strerror} ({_errname(exc)}){where}",
                      "dmesg shows the kernel's reason; the device must be a regular file or block device "
                      "the kernel can open read-write")


def _link_failure(root: "Root", portid: str, nqn: str, exc: OSError, field: str) -> NvmetError:
    where = f" ({field})" if field else ""
    pdir = f"ports/{portid}"
    trtype = (root._read(pdir + "/addr_trtype") or "").strip()
    traddr = (root._read(pdir + "/addr_traddr") or "").strip()
    trsvcid = (root._read(pdir + "/addr_trsvcid") or "").strip()
    what = f"linking subsystem {nqn} to port {portid} ({trtype} {traddr}:{trsvcid})"
    mod = TRANSPORT_MODULES.get(trtype)
    if exc.errno == errno.ENOENT:
        return NvmetError(f"{what}: subsystem {nqn} does not exist{where}", "create the subsystem first")
    if exc.errno == errno.EEXIST:
        return NvmetError(f"{what}: already linked{where}", "nothing to do")
    if mod and exc.errno == errno.EINVAL and not modules.is_loaded(mod, root.sys_module):
        return NvmetError(f"{what}: the kernel has no {trtype} transport: module {mod} is not loaded (EINVAL){where}",
                          f"modprobe {mod.replace('_', '-')} (install the kernel's full module set if it is missing)")
    if exc.errno == errno.EADDRINUSE:
        return NvmetError(f"{what}: {traddr}:{trsvcid} is already in use (EADDRINUSE){where}",
                          "another nvmet port (or the userspace target) listens there: use another trsvcid")
    if exc.errno in (errno.EADDRNOTAVAIL, errno.ENODEV, errno.EINVAL, errno.ENETUNREACH) and \
            fabric(trtype) is not None and fabric(trtype).rdma_device:
        return NvmetError(f"{what}: the kernel could not listen on {traddr}:{trsvcid} with RDMA "
                          f"({_errname(exc)}){where}: no RDMA device has that address, or addr_* is incomplete",
                          "give traddr an address of an RDMA-capable netdev (nvmeof-roce rdma status); for "
                          "Soft-RoCE: nvmeof-roce rdma add-rxe NETDEV")
    return NvmetError(f"{what}: {exc.strerror} ({_errname(exc)}){where}", "dmesg shows the kernel's reason")


def describe(relpath: str) -> str:
    """A human name for a path under the nvmet root."""
    p = relpath.strip("/").split("/")
    if not p or p == [""]:
        return "nvmet root"
    if p[0] == "subsystems" and len(p) >= 2:
        s = f"subsystem {p[1]}"
        if len(p) >= 4 and p[2] == "namespaces":
            s = f"namespace {p[3]} of {s}"
            if len(p) >= 5:
                s += f" attribute {p[4]}"
        elif len(p) >= 4 and p[2] == "allowed_hosts":
            s = f"allowed host {p[3]} of {s}"
        elif len(p) == 3:
            s += f" attribute {p[2]}"
        return s
    if p[0] == "ports" and len(p) >= 2:
        s = f"port {p[1]}"
        if len(p) >= 4 and p[2] == "subsystems":
            return f"link of subsystem {p[3]} on {s}"
        if len(p) >= 4 and p[2] == "referrals":
            s = f"referral {p[3]} of {s}"
            if len(p) >= 5:
                s += f" attribute {p[4]}"
            return s
        if len(p) >= 4 and p[2] == "ana_groups":
            s = f"ANA group {p[3]} of {s}"
            if len(p) >= 5:
                s += f" attribute {p[4]}"
            return s
        if len(p) == 3:
            s += f" attribute {p[2]}"
        return s
    if p[0] == "hosts" and len(p) >= 2:
        return f"host {p[1]}" + (f" attribute {p[2]}" if len(p) >= 3 else "")
    return relpath


# --------------------------------------------------------------------------- nodes

class CFSNode:
    """One configfs directory. `attr_groups` are the attribute prefixes dump() saves."""

    attr_groups: List[str] = []
    kind = "node"

    def __init__(self, root: "Root", relpath: str, mode: str = "any"):
        if mode not in ("any", "lookup", "create"):
            raise NvmetError(f"bad mode {mode!r}", "use 'any', 'lookup' or 'create'")
        self.root = root
        self.relpath = relpath.strip("/")
        exists = self.exists
        if exists and mode == "create":
            raise NvmetError(f"{describe(self.relpath)} already exists", "look it up, or delete it first")
        if not exists and mode == "lookup":
            raise NvmetError(f"{describe(self.relpath)} does not exist", "create it first (or check the name)")
        if not exists:
            self.root._mkdir(self.relpath)

    @property
    def path(self) -> str:
        return self.root.abspath(self.relpath)

    @property
    def exists(self) -> bool:
        return self.root.fs.isdir(self.path)

    def __eq__(self, other):
        return isinstance(other, CFSNode) and self.path == other.path

    def __hash__(self):
        return hash(self.path)

    def __repr__(self):
        return f"<{type(self).__name__} {self.relpath}>"

    def _check(self):
        if not self.exists:
            raise NvmetError(f"{describe(self.relpath)} no longer exists", "refresh: it was removed meanwhile")

    # attributes --------------------------------------------------------
    def list_attrs(self, group: str, writable: Optional[bool] = None) -> List[str]:
        self._check()
        names = []
        for entry in self.root.fs.listdir(self.path):
            if not entry.startswith(group + "_"):
                continue
            full = f"{self.path}/{entry}"
            if not self.root.fs.isfile(full):
                continue
            w = self.root.fs.writable(full)
            if writable is True and not w or writable is False and w:
                continue
            names.append(entry[len(group) + 1:])
        return sorted(names)

    def has_attr(self, group: str, name: str) -> bool:
        return self.root.fs.isfile(f"{self.path}/{group}_{name}")

    def get_attr(self, group: str, name: str) -> str:
        self._check()
        rel = f"{self.relpath}/{group}_{name}"
        if not self.root.fs.isfile(self.root.abspath(rel)):
            raise NvmetError(f"{describe(self.relpath)} has no attribute {group}_{name}",
                             f"known {group} attributes: {', '.join(self.list_attrs(group)) or 'none'}")
        return self.root._read(rel, strict=True).strip()

    def set_attr(self, group: str, name: str, value, field: str = "") -> None:
        self._check()
        rel = f"{self.relpath}/{group}_{name}"
        if not self.root.fs.isfile(self.root.abspath(rel)):
            raise NvmetError(f"{describe(self.relpath)} has no attribute {group}_{name}{' (' + field + ')' if field else ''}",
                             f"known {group} attributes: {', '.join(self.list_attrs(group)) or 'none'}; "
                             "this kernel may not have it (remove it from the config)")
        self.root._write(rel, value, field)

    def get_enable(self) -> Optional[int]:
        return self.root._read_int(f"{self.relpath}/enable")

    def set_enable(self, value) -> None:
        self._check()
        self.root._write(f"{self.relpath}/enable", int(value))

    def delete(self) -> None:
        if self.exists:
            self.root._rmdir(self.relpath)

    def dump(self) -> dict:
        d = {}
        for group in self.attr_groups:
            a = {}
            for name in self.list_attrs(group, writable=True):
                full = f"{self.path}/{group}_{name}"
                if not self.root.fs.readable(full):
                    continue
                try:
                    a[name] = self.get_attr(group, name)
                except (NvmetError, OSError):
                    continue
            d[group] = a
        en = self.get_enable()
        if en is not None:
            d["enable"] = en
        return d


class Host(CFSNode):
    attr_groups = ["dhchap"]
    kind = "host"

    def __init__(self, root, nqn, mode="any"):
        self.nqn = nqn
        super().__init__(root, f"hosts/{nqn}", mode)

    def dump(self):
        d = super().dump()
        d["nqn"] = self.nqn
        return d


class Namespace(CFSNode):
    attr_groups = ["device", "ana", "resv"]
    kind = "namespace"

    def __init__(self, subsystem: "Subsystem", nsid=None, mode="any"):
        self.subsystem = subsystem
        if nsid is None:
            if mode == "lookup":
                raise NvmetError("need an NSID to look a namespace up", "give the nsid")
            used = {n.nsid for n in subsystem.namespaces}
            nsid = next(i for i in range(1, len(used) + 2) if i not in used)
        try:
            nsid = int(nsid)
        except (TypeError, ValueError):
            raise NvmetError(f"namespace id {nsid!r} is not a number", f"give an NSID 1..0x{NSID_MAX:X}") from None
        if not 1 <= nsid <= NSID_MAX:
            raise NvmetError(f"namespace id {nsid} is out of range", f"give an NSID 1..0x{NSID_MAX:X}")
        self.nsid = nsid
        super().__init__(subsystem.root, f"{subsystem.relpath}/namespaces/{nsid}", mode)

    @property
    def grpid(self) -> int:
        return self.root._read_int(f"{self.relpath}/ana_grpid") or 0

    def set_grpid(self, grpid) -> None:
        self.root._write(f"{self.relpath}/ana_grpid", int(grpid))

    @property
    def buffered_io(self) -> Optional[int]:
        return self.root._read_int(f"{self.relpath}/buffered_io")

    def set_buffered_io(self, value) -> None:
        self.root._write(f"{self.relpath}/buffered_io", int(value))

    def dump(self):
        d = super().dump()
        dev = d.get("device")
        if dev and dev.get("path") == "(null)":   # how 6.1 prints an unset device_path
            dev["path"] = ""
        d["nsid"] = self.nsid
        d["ana_grpid"] = self.grpid
        if self.buffered_io:   # our addition to nvmetcli's shape; nvmetcli ignores it on restore
            d["buffered_io"] = self.buffered_io
        return d


class Subsystem(CFSNode):
    attr_groups = ["attr"]
    kind = "subsystem"

    def __init__(self, root, nqn, mode="any"):
        if not nqn or "/" in nqn:
            raise NvmetError(f"subsystem NQN {nqn!r} is not usable as a configfs name", "give an NQN")
        self.nqn = nqn
        super().__init__(root, f"subsystems/{nqn}", mode)

    @property
    def namespaces(self) -> List[Namespace]:
        self._check()
        d = f"{self.path}/namespaces"
        ids = sorted(int(x) for x in self.root.fs.listdir(d) if x.isdigit())
        return [Namespace(self, i, "lookup") for i in ids]

    def namespace(self, nsid, mode="lookup") -> Namespace:
        return Namespace(self, nsid, mode)

    @property
    def allowed_hosts(self) -> List[str]:
        self._check()
        return sorted(self.root.fs.listdir(f"{self.path}/allowed_hosts"))

    def add_allowed_host(self, nqn: str) -> None:
        self.root._symlink(f"hosts/{nqn}", f"{self.relpath}/allowed_hosts/{nqn}")

    def remove_allowed_host(self, nqn: str) -> None:
        self.root._unlink(f"{self.relpath}/allowed_hosts/{nqn}")

    def has_passthru(self) -> bool:
        return self.root.fs.isdir(f"{self.path}/passthru")

    @property
    def ports(self) -> List["Port"]:
        """Ports this subsystem is linked to."""
        return [p for p in self.root.ports if self.nqn in p.subsystems]

    def delete(self) -> None:
        if not self.exists:
            return
        for p in self.ports:
            p.remove_subsystem(self.nqn)
        for ns in self.namespaces:
            ns.delete()
        for h in self.allowed_hosts:
            self.remove_allowed_host(h)
        super().delete()

    def dump(self):
        d = super().dump()
        d["nqn"] = self.nqn
        d["namespaces"] = [ns.dump() for ns in self.namespaces]
        d["allowed_hosts"] = self.allowed_hosts
        if self.has_passthru():
            pt = {}
            for name in sorted(self.root.fs.listdir(f"{self.path}/passthru")):
                full = f"{self.path}/passthru/{name}"
                if self.root.fs.isfile(full) and self.root.fs.readable(full):
                    pt[name] = self.root._read(f"{self.relpath}/passthru/{name}").strip()
            # Kernels with CONFIG_NVME_TARGET_PASSTHRU (Debian's 6.12) have an empty passthru/ in every
            # subsystem: only a configured one (a device or enabled) is part of the config.
            if pt.get("device_path") == "(null)":  # what an unset passthru device reads as
                pt["device_path"] = ""
            if pt.get("device_path") or int(pt.get("enable", "0") or 0):
                d["passthru"] = [{"device": {"path": pt.get("device_path", "")},
                                  "enable": int(pt.get("enable", "0") or 0),
                                  **{k: int(pt[k]) for k in ("clear_ids", "admin_timeout", "io_timeout")
                                     if pt.get(k, "").lstrip("-").isdigit()}}]
        return d


class Referral(CFSNode):
    attr_groups = ["addr"]
    kind = "referral"

    def __init__(self, port: "Port", name: str, mode="any"):
        self.port = port
        self.name = name
        super().__init__(port.root, f"{port.relpath}/referrals/{name}", mode)

    def dump(self):
        d = super().dump()
        d["name"] = self.name
        return d


class AnaGroup(CFSNode):
    attr_groups = ["ana"]
    kind = "ana group"

    def __init__(self, port: "Port", grpid: int, mode="any"):
        self.port = port
        self.grpid = int(grpid)
        if not port.root.fs.isdir(f"{port.path}/ana_groups"):
            raise NvmetError("this kernel's nvmet has no ANA groups", "remove ana_groups from the config")
        super().__init__(port.root, f"{port.relpath}/ana_groups/{self.grpid}", mode)

    def delete(self):
        if self.grpid != ANA_DEFAULT_GROUP:   # group 1 comes and goes with the port
            super().delete()

    def dump(self):
        d = super().dump()
        d["grpid"] = self.grpid
        return d


class Port(CFSNode):
    attr_groups = ["addr", "param"]
    kind = "port"

    def __init__(self, root, portid, mode="any"):
        try:
            self.portid = int(portid)
        except (TypeError, ValueError):
            raise NvmetError(f"port id {portid!r} is not a number", "give a port id 0..65535") from None
        if not 0 <= self.portid <= 0xFFFF:
            raise NvmetError(f"port id {portid} is out of range", "give a port id 0..65535")
        super().__init__(root, f"ports/{self.portid}", mode)

    @property
    def subsystems(self) -> List[str]:
        self._check()
        return sorted(self.root.fs.listdir(f"{self.path}/subsystems"))

    @property
    def enabled(self) -> bool:
        """The kernel enables a port when the first subsystem is linked to it."""
        return bool(self.subsystems)

    def add_subsystem(self, nqn: str) -> None:
        trtype = self.get_attr("addr", "trtype") if self.has_attr("addr", "trtype") else ""
        mod = TRANSPORT_MODULES.get(trtype)
        if mod and self.root.load_modules:
            modules.ensure(mod, f"an nvmet {trtype} port", self.root.sys_module)
        self.root._symlink(f"subsystems/{nqn}", f"{self.relpath}/subsystems/{nqn}")

    def remove_subsystem(self, nqn: str) -> None:
        self.root._unlink(f"{self.relpath}/subsystems/{nqn}")

    @property
    def referrals(self) -> List[Referral]:
        self._check()
        return [Referral(self, n, "lookup") for n in self.root.fs.listdir(f"{self.path}/referrals")]

    def referral(self, name, mode="lookup") -> Referral:
        return Referral(self, name, mode)

    @property
    def ana_groups(self) -> List[AnaGroup]:
        self._check()
        d = f"{self.path}/ana_groups"
        if not self.root.fs.isdir(d):
            return []
        return [AnaGroup(self, int(g), "lookup") for g in sorted(self.root.fs.listdir(d), key=int)]

    def ana_group(self, grpid, mode="lookup") -> AnaGroup:
        return AnaGroup(self, grpid, mode)

    def delete(self):
        if not self.exists:
            return
        for s in self.subsystems:
            self.remove_subsystem(s)
        for a in self.ana_groups:
            a.delete()
        for r in self.referrals:
            r.delete()
        super().delete()

    def dump(self):
        d = super().dump()
        d["portid"] = self.portid
        d["subsystems"] = self.subsystems
        d["ana_groups"] = [a.dump() for a in self.ana_groups]
        d["referrals"] = [r.dump() for r in self.referrals]
        return d


class Root(CFSNode):
    """The nvmet configfs root. Loads nvmet if the tree is missing (and load_modules)."""

    attr_groups = ["discovery"]
    kind = "root"

    def __init__(self, path: str = NVMET_ROOT, fs: Optional[ConfigFS] = None, load_modules: bool = True,
                 sys_module: str = modules.SYS_MODULE):
        self.root = self
        self.relpath = ""
        self._path = path.rstrip("/")
        self.fs = fs or ConfigFS()
        self.load_modules = load_modules
        self.sys_module = sys_module
        if not self.fs.isdir(self._path):
            cfs = os.path.dirname(self._path)
            if not self.fs.isdir(cfs):
                raise NvmetError(f"{cfs} does not exist: configfs is not mounted",
                                 f"mount -t configfs none {cfs} (as root)")
            if load_modules:
                modules.ensure("nvmet", "the kernel NVMe target", sys_module)
            if not self.fs.isdir(self._path):
                raise NvmetError(f"{self._path} does not exist: the nvmet module is not loaded",
                                 "modprobe nvmet (as root)")

    @property
    def path(self):
        return self._path

    def abspath(self, rel: str) -> str:
        return f"{self._path}/{rel}" if rel else self._path

    # primitive operations with error translation ---------------------------
    def _read(self, rel, strict=False) -> Optional[str]:
        try:
            return self.fs.read(self.abspath(rel))
        except OSError as exc:
            if strict:
                raise translate("read", rel, exc, self) from None
            return None

    def _read_int(self, rel) -> Optional[int]:
        p = self.abspath(rel)
        if not self.fs.isfile(p):
            return None
        v = (self._read(rel) or "").strip()
        try:
            return int(v)
        except ValueError:
            return None

    def _write(self, rel, value, field=""):
        log.debug("write %s = %r", rel, value)
        try:
            self.fs.write(self.abspath(rel), value)
        except OSError as exc:
            raise translate("write", rel, exc, self, value=value, field=field) from None

    def _mkdir(self, rel, field=""):
        log.debug("mkdir %s", rel)
        try:
            self.fs.mkdir(self.abspath(rel))
        except OSError as exc:
            raise translate("mkdir", rel, exc, self, field=field) from None

    def _rmdir(self, rel, field=""):
        log.debug("rmdir %s", rel)
        try:
            self.fs.rmdir(self.abspath(rel))
        except OSError as exc:
            raise translate("rmdir", rel, exc, self, field=field) from None

    def _symlink(self, target_rel, link_rel, field=""):
        log.debug("symlink %s -> %s", link_rel, target_rel)
        try:
            self.fs.symlink(self.abspath(target_rel), self.abspath(link_rel))
        except OSError as exc:
            raise translate("symlink", link_rel, exc, self, field=field) from None

    def _unlink(self, rel, field=""):
        log.debug("unlink %s", rel)
        try:
            self.fs.unlink(self.abspath(rel))
        except OSError as exc:
            raise translate("unlink", rel, exc, self, field=field) from None

    # children -----------------------------------------------------------------
    def _names(self, sub):
        d = self.abspath(sub)
        return self.fs.listdir(d) if self.fs.isdir(d) else []

    @property
    def subsystems(self) -> List[Subsystem]:
        return [Subsystem(self, n, "lookup") for n in sorted(self._names("subsystems"))]

    @property
    def ports(self) -> List[Port]:
        return [Port(self, n, "lookup") for n in sorted(self._names("ports"), key=lambda x: int(x))]

    @property
    def hosts(self) -> List[Host]:
        return [Host(self, n, "lookup") for n in sorted(self._names("hosts"))]

    def subsystem(self, nqn, mode="lookup") -> Subsystem:
        return Subsystem(self, nqn, mode)

    def port(self, portid, mode="lookup") -> Port:
        return Port(self, portid, mode)

    def host(self, nqn, mode="lookup") -> Host:
        return Host(self, nqn, mode)

    def get_enable(self):
        return None

    def delete(self):
        raise NvmetError("the nvmet root cannot be deleted", "use clear()")

    def clear(self) -> None:
        """Remove every port, subsystem and host (like nvmetcli clear)."""
        for p in self.ports:
            p.delete()
        for s in self.subsystems:
            s.delete()
        for h in self.hosts:
            h.delete()

    def dump(self) -> dict:
        d = super().dump()
        d["hosts"] = [h.dump() for h in self.hosts]
        d["ports"] = [p.dump() for p in self.ports]
        d["subsystems"] = [s.dump() for s in self.subsystems]
        return d

    def save_to_file(self, path: str = DEFAULT_SAVE_FILE) -> dict:
        data = self.dump()
        save_json(data, path)
        return data


def save_json(data: dict, path: str) -> None:
    """Write nvmetcli's JSON to `path` with securefile's writer (atomic, 0600: it may hold DH-HMAC-CHAP secrets,
    fsynced); the directory is made if missing."""
    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_file(path, json.dumps(data, sort_keys=True, indent=2) + "\n")
    except OSError as exc:
        raise NvmetError(f"{path}: cannot write: {exc.strerror}", "pick a writable directory, or run as root") from None


# --------------------------------------------------------------------------- beside the userspace target

_ANY_ADDRESS = ("", "0.0.0.0", "::")


def _same_address(a: str, b: str) -> bool:
    """Whether two traddrs meet in one listener: equal, or either one is the any-address."""
    if a in _ANY_ADDRESS or b in _ANY_ADDRESS:
        return True
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return a == b


def kernel_port_holding(trtype: str, traddr: str, trsvcid: str, path: Optional[str] = None,
                        fs: Optional[ConfigFS] = None) -> Optional[dict]:
    """The kernel target's port that listens on trtype traddr:trsvcid, as {"portid", "traddr", "trsvcid",
    "subsystems", "path"}, or None.  The kernel listens on a port once a subsystem is linked to it; only the same
    transport meets (RDMA and TCP ports live in different port spaces).  No kernel target here (configfs not
    mounted, nvmet not loaded): None, and nothing is loaded to look."""
    path = (path or NVMET_ROOT).rstrip("/")
    fs = fs or ConfigFS()
    if not fs.isdir(path):
        return None
    root = Root(path, fs=fs, load_modules=False)
    for port in root.ports:
        try:
            if not port.has_attr("addr", "trtype") or port.get_attr("addr", "trtype") != trtype:
                continue
            theirs = port.get_attr("addr", "traddr"), port.get_attr("addr", "trsvcid")
            subsystems = port.subsystems
        except NvmetError:
            continue  # removed while read
        if subsystems and str(theirs[1]) == str(trsvcid) and _same_address(theirs[0], traddr):
            return {"portid": port.portid, "traddr": theirs[0], "trsvcid": theirs[1], "subsystems": subsystems,
                    "path": port.path}
    return None
