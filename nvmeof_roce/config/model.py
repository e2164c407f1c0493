"""The target config's model: the schema's vocabulary and limits, the syntax of its values (sizes, NQNs,
flags, CPU lists), the derived identities (serial, namespace UUID) and the dataclasses a parsed config is
(`TargetConfig` with its ports, subsystems, namespaces, hosts, referrals and ANA groups).

Each dataclass keeps the object it was parsed from (`raw`) and gives it back with `to_dict()`, in nvmetcli's
shape with the generated values filled in."""
import copy
import dataclasses
import hashlib
import os
import re
import uuid as uuidlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

from ..errors import NvmeofError
from ..nvme.command import NSID_MAX  # the schema's limit, for the loader and the config's users
from ..nvme.fabrics import DISCOVERY_NQN, MAX_CNTLID as CNTLID_MAX, NQN_MAX_LENGTH as NQN_MAX_BYTES
from ..transport.registry import FABRICS
from ..tunables import TARGET_SETTINGS
from .errors import ConfigError

if TYPE_CHECKING:
    from .group import GroupSettings

ANA_GRPID_MAX = 128          # NVMET_MAX_ANAGRPS
PORTID_MAX = 0xFFFF          # configfs ports/<u16>
DEFAULT_TRSVCID = 4420
DEFAULT_MODEL = "nvmeof-roce"
BLOCK_SIZES = (512, 4096)
MAX_INLINE_DATA_SIZE = 16384  # nvmet_rdma's NVMET_RDMA_MAX_INLINE_DATA_SIZE (with 4 KiB pages)
MAX_BLOCKS = (1 << 64) - 1    # NSZE is a 64-bit block count
USERSPACE_KEY = "nvmeof_roce"

TRTYPES = tuple(FABRICS)  # rdma, tcp, loop, fc, pcie (transport/registry.py)
ADRFAMS = ("ipv4", "ipv6", "ib", "fc", "loop", "pci", "")
TREQS = ("not specified", "required", "not required")
ANA_STATES = ("optimized", "non-optimized", "inaccessible", "persistent-loss", "change")

# A fixed namespace for uuid5: a namespace's UUID derives from (subsystem NQN, NSID) only.
_UUID_NAMESPACE = uuidlib.uuid5(uuidlib.NAMESPACE_DNS, "nvmeof-roce.namespace")

_NQN_RE = re.compile(
    r"^nqn\.(?P<year>\d{4})-(?P<month>\d{2})\."
    r"(?P<domain>[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*)"
    r"(?::(?P<rest>.+))?$"
)
UUID_RE = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kKmMgGtTpP]?)(i?[bB])?\s*$")
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
# nvmeof_roce.qos of a namespace, SPDK's bdev_set_qos_limit names: limit per second, 0 (or absent) = unlimited
QOS_LIMITS = {"rw_ios_per_sec": "commands", "rw_mbytes_per_sec": "MiB read and written",
              "r_mbytes_per_sec": "MiB read", "w_mbytes_per_sec": "MiB written"}
QOS_MAX = 10_000_000
NS_QUEUE_DEPTHS = (1, 1024)  # nvmeof_roce.queue_depth of a file/block namespace; default 128 (engine/ioengine.py)
# nvmeof_roce.io_engine of a file/block namespace: force one; unset, io_uring where it works, else the threads
NS_IO_ENGINES = ("io_uring", "threads")


# --------------------------------------------------------------------------- values

def parse_size(value: Any) -> int:
    """'64M', '1G', '4KiB', '512', 4096 -> bytes (binary multiples). ValueError if not a size."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"negative size: {value}")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            return int(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    raise ValueError(f"not a size: {value!r}")


def nqn_problem(nqn: Any) -> Optional[str]:
    """Why `nqn` is not a valid NQN, or None."""
    if not isinstance(nqn, str) or not nqn:
        return f"must be a non-empty string, got {nqn!r}"
    if len(nqn.encode("utf-8")) > NQN_MAX_BYTES:
        return f"is {len(nqn.encode('utf-8'))} bytes, longer than the {NQN_MAX_BYTES}-byte NQN limit"
    if any(c.isspace() or ord(c) < 0x20 or c == "/" for c in nqn):
        return f"{nqn!r} contains whitespace, a control character or '/'"
    m = _NQN_RE.match(nqn)
    if not m:
        return f"{nqn!r} is not an NQN (nqn.yyyy-mm.reverse-domain:name or nqn.2014-08.org.nvmexpress:uuid:UUID)"
    if not 1 <= int(m.group("month")) <= 12:
        return f"{nqn!r}: month {m.group('month')} is not 01..12"
    rest = m.group("rest")
    if nqn != DISCOVERY_NQN and not rest:
        return f"{nqn!r} has no ':name' part after the domain"
    if rest and rest.startswith("uuid:") and m.group("domain") == "org.nvmexpress":
        if not UUID_RE.match(rest[5:]):
            return f"{nqn!r}: the uuid form needs a UUID after 'uuid:'"
    return None


def subsystem_nqn_problem(nqn: Any) -> Optional[str]:
    """Why `nqn` cannot name a subsystem, or None.  nvmet's configfs takes any directory name but the discovery
    NQN as a subsystem (blktests names its subsystems `blktests-subsystem-N`), so a name that does not start
    with "nqn." is taken as nvmet takes it; one that does is checked as an NQN, where a malformed one is a typo."""
    if isinstance(nqn, str) and nqn and not nqn.startswith("nqn."):
        if len(nqn.encode("utf-8")) > NQN_MAX_BYTES:
            return f"is {len(nqn.encode('utf-8'))} bytes, longer than the {NQN_MAX_BYTES}-byte NQN limit"
        if any(c.isspace() or ord(c) < 0x20 or c in "/," for c in nqn):
            # '/' cannot name a configfs directory; ',' and whitespace would split the host's connect options
            return f"{nqn!r} contains whitespace, a control character, '/' or ','"
        return None
    return nqn_problem(nqn)


_PLAIN_NAME = "a plain name without whitespace, '/' or ',' (as nvmet's configfs takes)"


def _configfs_name(nqn: Any, source: str, where: str, fix: str) -> str:
    """`nqn` if configfs takes it as a subsystem's or a host's name (subsystem_nqn_problem), else a ConfigError
    naming the field, with `fix`."""
    problem = subsystem_nqn_problem(nqn)
    if problem:
        raise ConfigError(source, where, problem, fix)
    return nqn


def validate_subsystem_nqn(nqn: Any, source: str = "", where: str = "nqn") -> str:
    """A subsystem's name as nvmet takes it (subsystem_nqn_problem), else a ConfigError naming the field."""
    return _configfs_name(nqn, source, where, f"use an NQN like nqn.2014-08.org.example:storage1, or {_PLAIN_NAME}")


def host_nqn_problem(nqn: Any) -> Optional[str]:
    """Why `nqn` cannot name a host (hosts[].nqn, allowed_hosts, visible_hosts), or None.  nvmet's configfs and
    nvmetcli take any directory name as a host, as for a subsystem (nvmetcli's examples name theirs `hostnqn`);
    the host then connects with that name as its host NQN (nvme connect --hostnqn)."""
    return subsystem_nqn_problem(nqn)


def validate_host_nqn(nqn: Any, source: str = "", where: str = "nqn") -> str:
    """A host's name as nvmet takes it (host_nqn_problem), else a ConfigError naming the field."""
    return _configfs_name(nqn, source, where, "use the host's NQN (nvme gen-hostnqn makes one; /etc/nvme/hostnqn "
                          f"holds the host's own), or {_PLAIN_NAME}")


def validate_nqn(nqn: Any, source: str = "", where: str = "nqn") -> str:
    problem = nqn_problem(nqn)
    if problem:
        raise ConfigError(source, where, problem,
                          "use an NQN like nqn.2014-08.org.example:storage1 "
                          "(nvme gen-hostnqn makes a host NQN)")
    return nqn


def namespace_uuid(subsys_nqn: str, nsid: int) -> str:
    """The deterministic UUID of namespace `nsid` in `subsys_nqn` (stable across restarts)."""
    return str(uuidlib.uuid5(_UUID_NAMESPACE, f"{subsys_nqn}#{nsid}"))


def subsystem_serial(nqn: str) -> str:
    """A stable 16-hex-digit serial number derived from the NQN."""
    return hashlib.sha256(nqn.encode("utf-8")).hexdigest()[:16]


def userspace_only_keys(data: Any, path: str = "") -> List[str]:
    """Field paths of every "nvmeof_roce" key in a raw config dict (the kernel rejects them)."""
    found = []
    if isinstance(data, dict):
        for k, v in data.items():
            sub = f"{path}.{k}" if path else k
            if k == USERSPACE_KEY:
                found.append(sub)
            else:
                found.extend(userspace_only_keys(v, sub))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            found.extend(userspace_only_keys(v, f"{path}[{i}]"))
    return found


def parse_flag(v: Any) -> Optional[bool]:
    """'1'/'0'/1/0/true/false -> bool; None if not a flag."""
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in ("1", "0", "true", "false", "yes", "no", "y", "n"):
        return v.strip().lower() in ("1", "true", "yes", "y")
    return None




@dataclass
class HostConfig:
    nqn: str
    attrs: Dict[str, dict] = field(default_factory=dict)   # attribute groups, e.g. "dhchap"

    def to_dict(self) -> dict:
        d = {"nqn": self.nqn}
        d.update(copy.deepcopy(self.attrs))
        return d


@dataclass
class ReferralConfig:
    name: str
    trtype: str
    adrfam: str
    traddr: str
    trsvcid: str
    treq: str = "not specified"
    portid: Optional[int] = None
    enabled: bool = True
    raw: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = copy.deepcopy(self.raw)
        addr = d.setdefault("addr", {})
        addr.update({"trtype": self.trtype, "adrfam": self.adrfam, "traddr": self.traddr,
                     "trsvcid": self.trsvcid, "treq": self.treq})
        if self.portid is not None:
            addr["portid"] = str(self.portid)
        d["name"] = self.name
        d["enable"] = 1 if self.enabled else 0
        return d


@dataclass
class AnaGroupConfig:
    grpid: int
    state: str = "optimized"
    raw: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = copy.deepcopy(self.raw)
        d.setdefault("ana", {})["state"] = self.state
        d["grpid"] = self.grpid
        return d


# A port that names no trtype is an RDMA port (nvmetcli's default, and what this project serves).
DEFAULT_TRTYPE = "rdma"


@dataclass
class PortConfig:
    portid: int
    trtype: str = DEFAULT_TRTYPE
    adrfam: str = "ipv4"
    traddr: str = ""
    trsvcid: int = DEFAULT_TRSVCID      # 0 where the transport has no service id (loop, fc)
    treq: str = "not specified"
    subsystems: List[str] = field(default_factory=list)
    referrals: List[ReferralConfig] = field(default_factory=list)
    params: Dict[str, str] = field(default_factory=dict)   # configfs param_* (inline_data_size, ...)
    inline_data_size: Optional[int] = None  # param_inline_data_size parsed (None or -1: the default)
    max_queue_size: Optional[int] = None    # param_max_queue_size parsed (None or -1: the default)
    ana_groups: List[AnaGroupConfig] = field(default_factory=list)
    userspace: dict = field(default_factory=dict)           # the port's "nvmeof_roce" key
    raw: dict = field(default_factory=dict)

    @property
    def trsvcid_str(self) -> str:
        if self.trsvcid:
            return str(self.trsvcid)
        return str(self.raw.get("addr", {}).get("trsvcid", ""))

    def to_dict(self) -> dict:
        d = copy.deepcopy(self.raw)
        addr = d.setdefault("addr", {})
        addr.update({"trtype": self.trtype, "adrfam": self.adrfam, "traddr": self.traddr,
                     "trsvcid": self.trsvcid_str, "treq": self.treq})
        if self.params or "param" in d:
            d["param"] = dict(self.params)
        d["portid"] = self.portid
        d["subsystems"] = list(self.subsystems)
        d["referrals"] = [r.to_dict() for r in self.referrals]
        if self.ana_groups or "ana_groups" in d:
            d["ana_groups"] = [a.to_dict() for a in self.ana_groups]
        if self.userspace:
            d[USERSPACE_KEY] = copy.deepcopy(self.userspace)
        return d


@dataclass
class NamespaceConfig:
    nsid: int
    enabled: bool = True
    backend: str = "file"               # a kind of the backend registry (config/backends.py)
    path: Optional[str] = None
    size_bytes: Optional[int] = None    # ram/null: required; file: size to create if missing
    block_size: int = 512
    uuid: str = ""
    nguid: Optional[str] = None
    eui64: Optional[str] = None
    ana_grpid: int = 1
    buffered_io: Optional[bool] = None  # nvmet's buffered_io; userspace: unset = O_DIRECT for block devices only
    queue_depth: Optional[int] = None   # userspace file/block: commands on the device at once (engine/ioengine.py)
    io_engine: Optional[str] = None     # userspace file/block: force an I/O engine (NS_IO_ENGINES); unset: chosen
    # nvmeof_roce.visible_hosts: the hosts that see the namespace (SPDK's no_auto_visible + nvmf_ns_add_host);
    # None: every host allowed on the subsystem sees it
    visible_hosts: Optional[List[str]] = None
    qos: Dict[str, int] = field(default_factory=dict)  # nvmeof_roce.qos: QOS_LIMITS -> limit (engine/qos.py)
    userspace: dict = field(default_factory=dict)   # the namespace's "nvmeof_roce" key
    backend_settings: Any = None  # the backend kind's own settings object, parsed (config/backends.py settings_key)
    raw: dict = field(default_factory=dict)

    @property
    def resv_enabled(self) -> bool:
        return resv_enabled_in(self.raw)

    def to_dict(self) -> dict:
        d = copy.deepcopy(self.raw)
        dev = d.setdefault("device", {})
        if self.path is not None:
            dev["path"] = self.path
        dev["uuid"] = self.uuid
        if self.nguid is not None:
            dev["nguid"] = self.nguid
        if self.eui64 is not None:
            dev["eui64"] = self.eui64
        d["enable"] = 1 if self.enabled else 0
        d["nsid"] = self.nsid
        d["ana_grpid"] = self.ana_grpid
        if self.buffered_io is not None:
            d["buffered_io"] = 1 if self.buffered_io else 0
        if self.userspace:
            d[USERSPACE_KEY] = copy.deepcopy(self.userspace)
        return d


@dataclass
class SubsystemConfig:
    nqn: str
    allow_any_host: bool = False
    allowed_hosts: List[str] = field(default_factory=list)
    serial: str = ""
    model: str = DEFAULT_MODEL
    namespaces: List[NamespaceConfig] = field(default_factory=list)
    attrs: Dict[str, str] = field(default_factory=dict)  # every attr_* as given (strings), incl. version, cntlid_*
    userspace: dict = field(default_factory=dict)
    raw: dict = field(default_factory=dict)

    @property
    def version(self) -> Optional[str]:
        return self.attrs.get("version")

    @property
    def cntlid_min(self) -> int:
        return int(self.attrs.get("cntlid_min", 1))

    @property
    def cntlid_max(self) -> int:
        return int(self.attrs.get("cntlid_max", CNTLID_MAX))

    def namespace(self, nsid: int) -> Optional[NamespaceConfig]:
        return next((n for n in self.namespaces if n.nsid == nsid), None)

    def to_dict(self) -> dict:
        d = copy.deepcopy(self.raw)
        attr = dict(self.attrs)
        attr["allow_any_host"] = "1" if self.allow_any_host else "0"
        attr["serial"] = self.serial
        attr["model"] = self.model
        d["attr"] = attr
        d["allowed_hosts"] = list(self.allowed_hosts)
        d["namespaces"] = [n.to_dict() for n in self.namespaces]
        d["nqn"] = self.nqn
        if self.userspace:
            d[USERSPACE_KEY] = copy.deepcopy(self.userspace)
        return d


def resv_enabled_in(section: dict) -> bool:
    """nvmet's resv_enable in a namespace's section, which nvmetcli saves as "resv": {"enable": "1"}: reservations
    on the namespace."""
    group = section.get("resv")
    return isinstance(group, dict) and parse_flag(group.get("enable", 0)) is True


def reserving_namespaces(data: dict) -> Set[Tuple[str, int]]:
    """(subsystem NQN, NSID) of every namespace with reservations on in a config (as a dict)."""
    return {(sub.get("nqn"), int(ns["nsid"])) for sub in data.get("subsystems") or ()
            for ns in sub.get("namespaces") or () if "nsid" in ns and resv_enabled_in(ns)}


def parse_cpus(text: str) -> List[int]:
    """A CPU list as the command line gives it (`--cpus 0,1`), the form of the config's nvmeof_roce.cpus."""
    try:
        cpus = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        cpus = []
    if not cpus or any(c < 0 for c in cpus):
        raise NvmeofError(f"--cpus {text!r}: not a list of CPU numbers", "e.g. --cpus 0,1")
    return cpus


def usable_cpus(option: str, cpus: List[int]) -> List[int]:
    """`cpus` when this process may run on every one of them (what it pins, itself or a child, can run nowhere
    else), or the error naming those it may not and those it may."""
    allowed = os.sched_getaffinity(0)
    missing = sorted(set(cpus) - allowed)
    if missing:
        raise NvmeofError(f"{option} {','.join(map(str, cpus))}: this process may not run on CPU(s) "
                          f"{','.join(map(str, missing))}", f"use CPUs of {','.join(map(str, sorted(allowed)))}")
    return cpus


# `serve --workers` settings in the same object; service/workers.py checks their values
WORKER_KEYS = {"workers", "cpus"}


@dataclass
class TargetSettings:
    max_kato: int = TARGET_SETTINGS["max_kato"].default
    discovery_idle_limit: int = TARGET_SETTINGS["discovery_idle_limit"].default
    drain_timeout: int = TARGET_SETTINGS["drain_timeout"].default
    persist: int = TARGET_SETTINGS["persist"].default


@dataclass
class TargetConfig:
    hosts: List[str] = field(default_factory=list)
    ports: List[PortConfig] = field(default_factory=list)
    subsystems: List[SubsystemConfig] = field(default_factory=list)
    source: str = "<config>"
    raw: dict = field(default_factory=dict)
    host_entries: List[HostConfig] = field(default_factory=list)
    userspace: dict = field(default_factory=dict)
    settings: TargetSettings = field(default_factory=TargetSettings)
    group: Optional["GroupSettings"] = None  # nvmeof_roce.group: a gateway of a group (config/group.py)

    def subsystem(self, nqn: str) -> Optional[SubsystemConfig]:
        return next((s for s in self.subsystems if s.nqn == nqn), None)

    def port(self, portid: int) -> Optional[PortConfig]:
        return next((p for p in self.ports if p.portid == portid), None)

    def with_namespaces(self, nqn: str, namespaces: List[NamespaceConfig]) -> "TargetConfig":
        """This config with subsystem `nqn`'s namespaces replaced by `namespaces` (one namespace added, resized or
        removed by an RPC); every other part is shared, the config itself is not changed."""
        subsystems = [dataclasses.replace(s, namespaces=list(namespaces)) if s.nqn == nqn else s
                      for s in self.subsystems]
        return dataclasses.replace(self, subsystems=subsystems)

    def to_dict(self) -> dict:
        d = {k: copy.deepcopy(v) for k, v in self.raw.items()
             if k not in ("hosts", "ports", "subsystems", USERSPACE_KEY)}
        d["hosts"] = [h.to_dict() for h in self.host_entries]
        d["ports"] = [p.to_dict() for p in self.ports]
        d["subsystems"] = [s.to_dict() for s in self.subsystems]
        if self.userspace:
            d[USERSPACE_KEY] = copy.deepcopy(self.userspace)
        return d

    def userspace_only_keys(self) -> List[str]:
        return userspace_only_keys(self.raw)
