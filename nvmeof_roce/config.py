"""The one target config schema: a superset of nvmetcli's /etc/nvmet/config.json.

Both targets read it: `nvmeof-roce nvmet apply` (the kernel's nvmet through configfs) and
`nvmeof-roce target serve` (the userspace target). The shape is nvmetcli's dump::

    {"hosts": [{"nqn": HOSTNQN}],
     "ports": [{"portid": 1, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": "10.99.0.1",
                                      "trsvcid": "4420", "treq": "not specified"},
                "param": {"inline_data_size": "16384"}, "subsystems": [NQN], "referrals": [],
                "ana_groups": [{"grpid": 1, "ana": {"state": "optimized"}}]}],
     "subsystems": [{"nqn": NQN, "attr": {"allow_any_host": "0", "serial": ..., "model": ...},
                     "allowed_hosts": [HOSTNQN],
                     "namespaces": [{"nsid": 1, "enable": 1, "ana_grpid": 1,
                                     "device": {"path": "/dev/nullb0", "uuid": ..., "nguid": ...}}]}]}

Keys that only the userspace target understands live under ``"nvmeof_roce"`` (on the top
level, a port, a subsystem or a namespace); for example a RAM namespace::

    {"nsid": 1, "nvmeof_roce": {"backend": "ram", "size": "64M", "block_size": 512}}

The kernel path rejects every ``"nvmeof_roce"`` key (see `userspace_only_keys`). A namespace
without it is a file or block device namespace using ``device.path``.

``to_dict()`` gives the config back in nvmetcli's shape with the generated values (serial,
namespace UUID, ...) filled in; for a file nvmetcli saved it equals the file.
"""
import copy
import ipaddress
import json
import os
import stat
import re
import stat
import uuid as uuidlib
import hashlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .errors import NvmeofError
from .transport.registry import FABRICS, fabric, served_labels, serves
from .nvme.command import NSID_MAX
from .nvme.fabrics import DISCOVERY_NQN, MAX_CNTLID as CNTLID_MAX, NQN_MAX_LENGTH as NQN_MAX_BYTES
from .tunables import QID_MAX, TARGET_SETTINGS

__all__ = [
    "ConfigError", "TargetConfig", "PortConfig", "SubsystemConfig", "NamespaceConfig",
    "HostConfig", "ReferralConfig", "AnaGroupConfig", "load_config", "parse_config",
    "parse_size", "validate_nqn", "subsystem_nqn_problem", "userspace_only_keys", "DISCOVERY_NQN", "NSID_MAX",
    "ConfigErrors", "validate_for_userspace", "load_userspace_config", "TargetSettings",
]

ANA_GRPID_MAX = 128          # NVMET_MAX_ANAGRPS
PORTID_MAX = 0xFFFF          # configfs ports/<u16>
DEFAULT_TRSVCID = 4420
DEFAULT_MODEL = "nvmeof-roce"
BLOCK_SIZES = (512, 4096)
MAX_INLINE_DATA_SIZE = 16384  # nvmet_rdma's NVMET_RDMA_MAX_INLINE_DATA_SIZE (with 4 KiB pages)
MAX_BLOCKS = (1 << 64) - 1    # NSZE is a 64-bit block count
BACKENDS = ("ram", "file", "null")
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
_UUID_RE = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kKmMgGtTpP]?)(i?[bB])?\s*$")
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}


class ConfigError(NvmeofError):
    """A bad target config: the message names the file and the field path."""

    def __init__(self, source: str, where: str, problem: str, fix: str = ""):
        location = f"{source}: {where}" if where else source
        super().__init__(f"{location}: {problem}", fix)
        self.source = source
        self.where = where
        self.problem = problem


class ConfigErrors(ConfigError):
    """Several problems in one config, all reported at once (the first one's fields are the attributes)."""

    def __init__(self, errors: List[ConfigError]):
        first = errors[0]
        super().__init__(first.source, first.where, first.problem, first.fix)
        self.errors = list(errors)
        self.message = "\n".join(str(e) for e in errors)
        self.args = (self.message,)

    def __str__(self) -> str:
        return self.message + f"\n({len(self.errors)} problems)"


def raise_all(errors: List[ConfigError]) -> None:
    """Raise the one error, or all of them together; nothing if the list is empty."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigErrors(errors)


# --------------------------------------------------------------------------- helpers

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
        if not _UUID_RE.match(rest[5:]):
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


def validate_subsystem_nqn(nqn: Any, source: str = "", where: str = "nqn") -> str:
    """A subsystem's name as nvmet takes it (subsystem_nqn_problem), else a ConfigError naming the field."""
    problem = subsystem_nqn_problem(nqn)
    if problem:
        raise ConfigError(source, where, problem, "use an NQN like nqn.2014-08.org.example:storage1, or a plain "
                          "name without whitespace, '/' or ',' (as nvmet's configfs takes)")
    return nqn


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


def _flag(v: Any) -> Optional[bool]:
    """'1'/'0'/1/0/true/false -> bool; None if not a flag."""
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in ("1", "0", "true", "false", "yes", "no", "y", "n"):
        return v.strip().lower() in ("1", "true", "yes", "y")
    return None


class _Ctx:
    """Where we are while parsing: the file name and the field path."""

    def __init__(self, source: str):
        self.source = source

    def err(self, where: str, problem: str, fix: str = "") -> ConfigError:
        return ConfigError(self.source, where, problem, fix)

    def dict_at(self, value: Any, where: str, optional=True) -> dict:
        if value is None and optional:
            return {}
        if not isinstance(value, dict):
            raise self.err(where or "(top level)", f"must be an object, got {type(value).__name__} {value!r}",
                           "write it as a JSON object {...} (see targets/*.json)")
        return value

    def list_at(self, value: Any, where: str) -> list:
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.err(where, f"must be a list, got {type(value).__name__} {value!r}",
                           "write it as a JSON list [...] (see targets/*.json)")
        return value

    def int_at(self, value: Any, where: str, lo: int, hi: int, hexrange=False) -> int:
        rng = f"{lo}..{hi:#X}".replace("0X", "0x") if hexrange else f"{lo}..{hi}"
        try:
            if isinstance(value, bool):
                raise ValueError
            n = value if isinstance(value, int) else int(str(value), 0)
        except (TypeError, ValueError):
            raise self.err(where, f"must be an integer {rng}, got {value!r}", f"give an integer in {rng}") from None
        if not lo <= n <= hi:
            raise self.err(where, f"must be {rng}, got {value!r}", f"give an integer in {rng}")
        return n

    def flag_at(self, value: Any, where: str) -> bool:
        f = _flag(value)
        if f is None:
            raise self.err(where, f"must be 0 or 1 (or true/false), got {value!r}", "use 1 to turn it on, 0 to turn it off")
        return f

    def str_at(self, value: Any, where: str) -> str:
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise self.err(where, f"must be a string, got {type(value).__name__} {value!r}", "write it as a JSON string")
        return str(value)

    def unknown(self, d: dict, known, where: str) -> None:
        """Every key of `d` not in `known`, each its own problem."""
        raise_all([self.err(f"{where}.{k}" if where else k, "unknown key",
                            f"remove it; known keys here: {', '.join(sorted(known))}") for k in d if k not in known])


class _Problems:
    """The problems of one object (a host, subsystem or port), all of them: `soft(fn, ...)` runs one check and
    records its problem instead of stopping; `done()` raises them together, if any."""

    def __init__(self):
        self.errors: List[ConfigError] = []

    def add(self, exc: ConfigError) -> None:
        self.errors.extend(getattr(exc, "errors", None) or [exc])

    def soft(self, fn, *args, default=None):
        try:
            return fn(*args)
        except ConfigError as exc:
            self.add(exc)
            return default

    def fatal(self, exc: ConfigError):
        """A problem after which the object cannot be checked further: raise it with those found so far."""
        self.add(exc)
        raise_all(self.errors)

    def done(self) -> None:
        raise_all(self.errors)


# --------------------------------------------------------------------------- the model

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


@dataclass
class PortConfig:
    portid: int
    trtype: str = "rdma"
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
    backend: str = "file"               # 'ram' | 'file' | 'null'
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
    raw: dict = field(default_factory=dict)

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


def parse_cpus(text: str) -> List[int]:
    """A CPU list as the command line gives it (`--cpus 0,1`), the form of the config's nvmeof_roce.cpus."""
    try:
        cpus = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        cpus = []
    if not cpus or any(c < 0 for c in cpus):
        raise NvmeofError(f"--cpus {text!r}: not a list of CPU numbers", "e.g. --cpus 0,1")
    return cpus


# `serve --workers` settings in the same object; service/workers.py checks their values
WORKER_KEYS = {"workers", "cpus"}


@dataclass
class TargetSettings:
    max_kato: int = TARGET_SETTINGS["max_kato"].default
    discovery_idle_limit: int = TARGET_SETTINGS["discovery_idle_limit"].default
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

    def subsystem(self, nqn: str) -> Optional[SubsystemConfig]:
        return next((s for s in self.subsystems if s.nqn == nqn), None)

    def port(self, portid: int) -> Optional[PortConfig]:
        return next((p for p in self.ports if p.portid == portid), None)

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


# --------------------------------------------------------------------------- parsing

_TOP_KEYS = {"hosts", "ports", "subsystems", "discovery", USERSPACE_KEY}
_PORT_KEYS = {"portid", "addr", "param", "subsystems", "referrals", "ana_groups", USERSPACE_KEY}
_ADDR_KEYS = {"trtype", "adrfam", "traddr", "trsvcid", "treq", "tsas", "portid"}
_SUBSYS_KEYS = {"nqn", "attr", "allowed_hosts", "namespaces", "passthru", USERSPACE_KEY}
_NS_KEYS = {"nsid", "enable", "device", "ana_grpid", "ana", "resv", "buffered_io", "p2pmem",
            "revalidate_size", USERSPACE_KEY}
_DEVICE_KEYS = {"path", "uuid", "nguid", "eui64"}
_NS_US_KEYS = {"backend", "size", "block_size", "queue_depth", "io_engine", "visible_hosts", "qos"}
# nvmeof_roce.qos of a namespace, SPDK's bdev_set_qos_limit names: limit per second, 0 (or absent) = unlimited
QOS_LIMITS = {"rw_ios_per_sec": "commands", "rw_mbytes_per_sec": "MiB read and written",
              "r_mbytes_per_sec": "MiB read", "w_mbytes_per_sec": "MiB written"}
QOS_MAX = 10_000_000
NS_QUEUE_DEPTHS = (1, 1024)  # nvmeof_roce.queue_depth of a file/block namespace; default 128 (engine/ioengine.py)
# nvmeof_roce.io_engine of a file/block namespace: force one; unset, io_uring where it works, else the threads
NS_IO_ENGINES = ("io_uring", "threads")
_HOST_KEYS = {"nqn", "dhchap"}  # auth15: dhchap is honoured by both targets (userspace: engine/auth.py)


def load_config(path) -> TargetConfig:
    """Read and validate a target config file (every problem reported at once)."""
    cfg, errors = load_config_collect(path)
    raise_all(errors)
    return cfg


def load_config_collect(path):
    """(config or None, errors) for a config file."""
    try:
        data = _read_json(path)
    except ConfigError as exc:
        return None, [exc]
    return parse_config_collect(data, str(path))


# Bounds of a config document: a config nvmetcli writes is 6 levels deep; a large one (64 subsystems of 1024
# namespaces) is ~15 MB.  Beyond them a document is refused before it is parsed further (docs/security.md).
MAX_CONFIG_BYTES = 32 << 20
MAX_CONFIG_DEPTH = 32


def _read_json(path):
    """The JSON document of a config file, or ConfigError naming what is wrong with the file itself."""
    source = str(path)
    fix_path = ("check the path; example configs are in targets/ "
                "(nvmeof-roce nvmet save FILE writes the kernel's current config)")
    try:
        # O_NONBLOCK: a FIFO or a device node in the config's place must not block a running target's reload
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(source, "", "no such file", fix_path) from None
    except PermissionError:
        raise ConfigError(source, "", "permission denied reading the file",
                          "run as a user who can read it (or as root)") from None
    except ValueError:  # a NUL byte in the path
        raise ConfigError(source, "", "the path contains a NUL byte", "give the path of a .json file") from None
    except OSError as exc:  # ENOTDIR, ELOOP, ENAMETOOLONG, EIO...
        raise ConfigError(source, "", f"cannot open the file: {exc.strerror}", fix_path) from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError(source, "", "is a directory, not a config file", "give the path of a .json file")
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(source, "", "is not a regular file (a FIFO, socket or device)",
                              "give the path of a .json file")
        if st.st_size > MAX_CONFIG_BYTES:
            raise ConfigError(source, "", f"is {st.st_size} bytes, more than the {MAX_CONFIG_BYTES} bytes a config "
                              "may have", "check that this is the config file (a config is a few KB)")
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(source, "", f"cannot read the file: {exc.strerror}", fix_path) from None
    finally:
        os.close(fd)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(source, "", f"is more than the {MAX_CONFIG_BYTES} bytes a config may have",
                          "check that this is the config file (a config is a few KB)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(source, f"line {line} byte {exc.start}", "is not valid UTF-8 text",
                          "save the file as UTF-8 (JSON is UTF-8)") from None
    return parse_json_text(text, source)


def parse_json_text(text: str, source: str):
    """A JSON document from text, with its nesting bounded: ConfigError naming the line for anything else."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(source, f"line {exc.lineno} column {exc.colno}", f"invalid JSON: {exc.msg}",
                          "fix the JSON syntax (python3 -m json.tool FILE shows the error)") from None
    except RecursionError:
        raise ConfigError(source, "", f"invalid JSON: nested more than {MAX_CONFIG_DEPTH} levels deep",
                          "a config is a few levels deep: check the file's brackets") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise ConfigError(source, "", f"invalid JSON: {exc}", "fix the value") from None
    check_depth(data, source)
    return data


def check_depth(data: Any, source: str, limit: int = MAX_CONFIG_DEPTH) -> None:
    """ConfigError if `data` nests lists and objects more than `limit` levels deep (checked without
    recursion, so that no later step recurses too deep on it)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > limit:
            raise ConfigError(source, "", f"nested more than {limit} levels deep",
                              "a config is a few levels deep: check the file's brackets")
        stack.extend((child, depth + 1) for child in children)


def parse_config(data: dict, source: str = "<config>") -> TargetConfig:
    """Validate a config dict (nvmetcli's shape, plus "nvmeof_roce" keys) into a TargetConfig.
    Every problem found is reported (ConfigErrors when there are several)."""
    cfg, errors = parse_config_collect(data, source)
    raise_all(errors)
    return cfg


def parse_config_collect(data: dict, source: str = "<config>"):
    """(config, errors): parse everything that parses and collect every problem of each host, subsystem and
    port (a problem that makes the rest of an object unreadable, such as a missing NQN, ends that object)."""
    ctx = _Ctx(source)
    errors: List[ConfigError] = []
    try:
        data = ctx.dict_at(data, "", optional=False) if data is not None else {}
    except ConfigError as exc:
        return TargetConfig(source=source), [exc]
    cfg = TargetConfig(source=source, raw=copy.deepcopy(data))

    def attempt(fn, *args):
        try:
            return fn(*args)
        except ConfigError as exc:
            errors.extend(getattr(exc, "errors", None) or [exc])  # every problem of that object
            return None

    attempt(ctx.unknown, data, _TOP_KEYS, "")
    attempt(_check_discovery, ctx, data.get("discovery"))
    cfg.userspace = attempt(ctx.dict_at, data.get(USERSPACE_KEY), USERSPACE_KEY) or {}
    attempt(ctx.unknown, cfg.userspace, set(TARGET_SETTINGS) | WORKER_KEYS, USERSPACE_KEY)
    for name, setting in TARGET_SETTINGS.items():
        if name in cfg.userspace:
            value = attempt(ctx.int_at, cfg.userspace[name], f"{USERSPACE_KEY}.{name}", setting.low, setting.high)
            if value is not None:
                setattr(cfg.settings, name, value)

    # hosts
    seen = {}
    for i, h in enumerate(attempt(ctx.list_at, data.get("hosts"), "hosts") or []):
        host = attempt(_parse_host, ctx, h, f"hosts[{i}]", seen)
        if host is not None:
            cfg.host_entries.append(host)
    cfg.hosts = [h.nqn for h in cfg.host_entries]
    # a host that failed to parse must not make every subsystem naming it fail too
    named_hosts = set(cfg.hosts) | {h.get("nqn") if isinstance(h, dict) else h
                                    for h in (data.get("hosts") or [])
                                    if isinstance(h, str) or isinstance(h, dict) and isinstance(h.get("nqn"), str)} \
        if isinstance(data.get("hosts") or [], list) else set()

    # subsystems
    seen = {}
    for i, s in enumerate(attempt(ctx.list_at, data.get("subsystems"), "subsystems") or []):
        sub = attempt(_parse_subsystem, ctx, s, f"subsystems[{i}]", named_hosts, errors)
        if sub is None:
            continue
        if sub.nqn in seen:
            errors.append(ctx.err(f"subsystems[{i}].nqn",
                                  f"duplicate subsystem {sub.nqn!r} (also subsystems[{seen[sub.nqn]}])",
                                  "give each subsystem its own NQN"))
            continue
        seen[sub.nqn] = i
        cfg.subsystems.append(sub)
    raw_subsystems = data.get("subsystems")
    named_subsystems = None if raw_subsystems is not None and not isinstance(raw_subsystems, list) else (
        {s.nqn for s in cfg.subsystems} | {
            s.get("nqn") for s in (raw_subsystems or []) if isinstance(s, dict) and isinstance(s.get("nqn"), str)})

    # ports
    seen = {}
    endpoints = {}
    for i, p in enumerate(attempt(ctx.list_at, data.get("ports"), "ports") or []):
        port = attempt(_parse_port, ctx, p, f"ports[{i}]", named_subsystems)
        if port is None:
            continue
        if port.portid in seen:
            errors.append(ctx.err(f"ports[{i}].portid",
                                  f"duplicate portid {port.portid} (also ports[{seen[port.portid]}])",
                                  "give each port its own portid"))
            continue
        seen[port.portid] = i
        if _ip_service(port.trtype):
            ep = (port.trtype, port.traddr, port.trsvcid)
            if ep in endpoints:
                errors.append(ctx.err(f"ports[{i}].addr", f"{port.trtype} {port.traddr}:{port.trsvcid} is already "
                                      f"used by ports[{endpoints[ep]}]",
                                      "use another trsvcid (e.g. 4421) or list the subsystems on the one port"))
                continue
            endpoints[ep] = i
        cfg.ports.append(port)
    return cfg, errors


def _parse_host(ctx: "_Ctx", h: Any, where: str, seen: dict) -> HostConfig:
    if isinstance(h, str):
        h = {"nqn": h}
    h = ctx.dict_at(h, where, optional=False)
    problems = _Problems()
    problems.soft(ctx.unknown, h, _HOST_KEYS, where)
    if "nqn" not in h:
        problems.fatal(ctx.err(where, "missing 'nqn'", 'add "nqn": HOSTNQN (nvme gen-hostnqn makes one)'))
    nqn = problems.soft(validate_nqn, h["nqn"], ctx.source, f"{where}.nqn")
    if nqn is None:
        problems.done()
    if nqn in seen:
        problems.fatal(ctx.err(f"{where}.nqn", f"duplicate host {nqn!r} (also {seen[nqn]})", "list each host once"))
    seen[nqn] = where
    attrs = {k: problems.soft(ctx.dict_at, v, f"{where}.{k}", default={}) for k, v in h.items() if k != "nqn"}
    problems.done()
    return HostConfig(nqn=nqn, attrs=attrs)


def _check_discovery(ctx: "_Ctx", d: Any) -> None:
    """The top-level "discovery" group nvmetcli saves from kernels 6.7+ (the discovery subsystem's NQN)."""
    d = ctx.dict_at(d, "discovery")
    ctx.unknown(d, {"nqn"}, "discovery")
    if "nqn" in d:
        validate_nqn(d["nqn"], ctx.source, "discovery.nqn")


def _parse_subsystem(ctx: _Ctx, s: Any, where: str, hosts: set, errors: Optional[list] = None) -> SubsystemConfig:
    s = ctx.dict_at(s, where, optional=False)
    problems = _Problems()
    problems.soft(ctx.unknown, s, _SUBSYS_KEYS, where)
    if "nqn" not in s:
        problems.fatal(ctx.err(where, "missing 'nqn'", 'add "nqn": "nqn.2014-08.org.example:name"'))
    nqn = problems.soft(validate_subsystem_nqn, s["nqn"], ctx.source, f"{where}.nqn")
    if nqn is None:
        problems.done()
    if nqn == DISCOVERY_NQN:
        problems.fatal(ctx.err(f"{where}.nqn", "is the discovery NQN; the target provides that subsystem itself",
                               "use another NQN for a storage subsystem"))
    attr = problems.soft(ctx.dict_at, s.get("attr"), f"{where}.attr", default={})
    attrs = {}
    for k, v in attr.items():
        value = problems.soft(ctx.str_at, v, f"{where}.attr.{k}")
        if value is not None:
            attrs[k] = value

    allowed = []
    for j, h in enumerate(problems.soft(ctx.list_at, s.get("allowed_hosts"), f"{where}.allowed_hosts", default=[])):
        hw = f"{where}.allowed_hosts[{j}]"
        if problems.soft(validate_nqn, h, ctx.source, hw) is None:
            continue
        if h not in hosts:
            problems.add(ctx.err(hw, f"host {h!r} is not in the top-level 'hosts' list",
                                 f'add {{"nqn": "{h}"}} to "hosts"'))
        elif h in allowed:
            problems.add(ctx.err(hw, f"host {h!r} is listed twice", "list each allowed host once"))
        else:
            allowed.append(h)

    if "allow_any_host" in attr:
        allow_any = problems.soft(ctx.flag_at, attr["allow_any_host"], f"{where}.attr.allow_any_host",
                                  default=not allowed)
        if allow_any and allowed:
            problems.add(ctx.err(f"{where}.attr.allow_any_host",
                                 "is 1 while allowed_hosts lists hosts (the kernel refuses this too)",
                                 'set "allow_any_host": "0" to use the allow-list, or empty allowed_hosts'))
    else:
        # No explicit choice: a subsystem without an allow-list is open, one with a list is closed.
        allow_any = not allowed

    serial = attrs.get("serial") or subsystem_serial(nqn)
    if len(serial) > 20 or not all(0x20 <= ord(c) < 0x7F for c in serial):
        problems.add(ctx.err(f"{where}.attr.serial", f"must be 1..20 printable ASCII characters, got {serial!r}",
                             "shorten it, or leave it out to get a stable serial derived from the NQN"))
    model = attrs.get("model") or DEFAULT_MODEL
    if len(model) > 40 or not all(0x20 <= ord(c) < 0x7F for c in model):
        problems.add(ctx.err(f"{where}.attr.model", f"must be 1..40 printable ASCII characters, got {model!r}",
                             "shorten it"))
    if "version" in attrs:
        if not re.match(r"^\d+\.\d+(\.\d+)?$", attrs["version"]):
            problems.add(ctx.err(f"{where}.attr.version", f"must look like 1.3 or 2.0.0, got {attrs['version']!r}",
                                 "use MAJOR.MINOR[.TERTIARY]"))
        else:
            # the VS register and Identify Controller VER: MJR 16 bits, MNR 8, TER 8 (NVMe Base 2.0 §3.1.4.2)
            parts = [int(p) for p in attrs["version"].split(".")] + [0]
            if not (1 <= parts[0] <= 0xFFFF and parts[1] <= 0xFF and parts[2] <= 0xFF):
                problems.add(ctx.err(f"{where}.attr.version", f"{attrs['version']!r} does not fit the VS register "
                                     "(major 1..65535, minor and tertiary 0..255)",
                                     "use an NVMe version such as 1.3 or 2.0"))
    # nvmet's attr_firmware: the Firmware Revision of Identify Controller, 1..8 printable characters
    if "firmware" in attrs and not (1 <= len(attrs["firmware"]) <= 8
                                    and all(0x20 <= ord(c) < 0x7F for c in attrs["firmware"])):
        problems.add(ctx.err(f"{where}.attr.firmware",
                             f"must be 1..8 printable ASCII characters, got {attrs['firmware']!r}",
                             'give a firmware revision such as "1.0"'))
    # nvmet's attr_ieee_oui: the IEEE OUI of Identify Controller, 24 bits (decimal or 0x hex, as kstrtou32)
    if "ieee_oui" in attrs:
        problems.soft(ctx.int_at, attrs["ieee_oui"], f"{where}.attr.ieee_oui", 0, 0xFFFFFF, True)
    cmin = cmax = None
    if "cntlid_min" in attrs:
        cmin = problems.soft(ctx.int_at, attrs["cntlid_min"], f"{where}.attr.cntlid_min", 1, CNTLID_MAX, True)
    if "cntlid_max" in attrs:
        cmax = problems.soft(ctx.int_at, attrs["cntlid_max"], f"{where}.attr.cntlid_max", 1, CNTLID_MAX, True)
    if (cmin or 1) > (cmax or CNTLID_MAX):
        problems.add(ctx.err(f"{where}.attr.cntlid_min", f"{cmin} is above cntlid_max {cmax or CNTLID_MAX}",
                             "make cntlid_min <= cntlid_max"))
    for flagname in ("pi_enable",):
        if flagname in attrs:
            problems.soft(ctx.flag_at, attrs[flagname], f"{where}.attr.{flagname}")
    if "qid_max" in attrs:
        problems.soft(ctx.int_at, attrs["qid_max"], f"{where}.attr.qid_max", QID_MAX.low, QID_MAX.high)
    attrs.pop("allow_any_host", None)
    attrs.pop("serial", None)
    attrs.pop("model", None)
    userspace = problems.soft(ctx.dict_at, s.get(USERSPACE_KEY), f"{where}.{USERSPACE_KEY}", default={})
    if errors is None:
        problems.done()

    sub = SubsystemConfig(nqn=nqn, allow_any_host=allow_any, allowed_hosts=allowed, serial=serial,
                          model=model, attrs=attrs, userspace=userspace, raw=copy.deepcopy(s))
    seen = {}
    for j, n in enumerate(ctx.list_at(s.get("namespaces"), f"{where}.namespaces")):
        try:
            ns = _parse_namespace(ctx, n, f"{where}.namespaces[{j}]", nqn)
            if ns.nsid in seen:
                raise ctx.err(f"{where}.namespaces[{j}].nsid",
                              f"duplicate nsid {ns.nsid} (also namespaces[{seen[ns.nsid]}])",
                              "give each namespace of a subsystem its own nsid")
        except ConfigError as exc:
            if errors is None:
                raise
            errors.extend(getattr(exc, "errors", None) or [exc])  # the other namespaces are still checked
            continue
        seen[ns.nsid] = j
        sub.namespaces.append(ns)
    problems.done()  # the subsystem's own problems, after its namespaces were checked too
    return sub


def _parse_namespace(ctx: _Ctx, n: Any, where: str, subsys_nqn: str) -> NamespaceConfig:
    n = ctx.dict_at(n, where, optional=False)
    ctx.unknown(n, _NS_KEYS, where)
    if "nsid" not in n:
        raise ctx.err(where, "missing 'nsid'", f'add "nsid": 1 (1..0x{NSID_MAX:X})')
    nsid = ctx.int_at(n["nsid"], f"{where}.nsid", 1, NSID_MAX, hexrange=True)
    enabled = ctx.flag_at(n.get("enable", 1), f"{where}.enable")
    dev = ctx.dict_at(n.get("device"), f"{where}.device")
    ctx.unknown(dev, _DEVICE_KEYS, f"{where}.device")
    us = ctx.dict_at(n.get(USERSPACE_KEY), f"{where}.{USERSPACE_KEY}")
    ctx.unknown(us, _NS_US_KEYS, f"{where}.{USERSPACE_KEY}")

    backend = us.get("backend", "file")
    if backend not in BACKENDS:
        raise ctx.err(f"{where}.{USERSPACE_KEY}.backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}",
                      "ram keeps data in memory, null discards writes and reads zeros, file uses device.path")
    block_size = 512
    if "block_size" in us:
        bw = f"{where}.{USERSPACE_KEY}.block_size"
        block_size = ctx.int_at(us["block_size"], bw, 1, 1 << 20)
        if block_size not in BLOCK_SIZES:
            raise ctx.err(bw, f"must be 512 or 4096, got {us['block_size']!r}", "use 512 or 4096")
    size = None
    if "size" in us:
        sw = f"{where}.{USERSPACE_KEY}.size"
        try:
            size = parse_size(us["size"])
        except ValueError:
            raise ctx.err(sw, f"is not a size: {us['size']!r}", 'use bytes or K/M/G/T, e.g. "64M" or "1G"') from None
        if size == 0:
            raise ctx.err(sw, "must be more than 0", 'give a size such as "64M"')
        if size % block_size:
            raise ctx.err(sw, f"{size} bytes is not a multiple of the block size {block_size}",
                          f"round it to a multiple of {block_size}")
        if size // block_size > MAX_BLOCKS:
            raise ctx.err(sw, f"{us['size']!r} is {size // block_size} blocks of {block_size} bytes, more than "
                          f"the 64-bit block count (NSZE) can hold",
                          f"give at most {MAX_BLOCKS * block_size >> 50}P")

    queue_depth = None
    if "queue_depth" in us:
        qw = f"{where}.{USERSPACE_KEY}.queue_depth"
        if backend != "file":
            raise ctx.err(qw, f"is for file and block namespaces, not {backend!r} ones (served inline)",
                          "remove queue_depth")
        queue_depth = ctx.int_at(us["queue_depth"], qw, *NS_QUEUE_DEPTHS)
    io_engine = None
    if "io_engine" in us:
        ew = f"{where}.{USERSPACE_KEY}.io_engine"
        if backend != "file":
            raise ctx.err(ew, f"is for file and block namespaces, not {backend!r} ones (served inline)",
                          "remove io_engine")
        io_engine = us["io_engine"]
        if io_engine not in NS_IO_ENGINES:
            raise ctx.err(ew, f"must be one of {', '.join(NS_IO_ENGINES)}, got {io_engine!r}",
                          "use \"io_uring\" or \"threads\", or leave it out: io_uring where it works, else threads")

    path = dev.get("path")
    if path is not None:
        path = ctx.str_at(path, f"{where}.device.path")
    if backend in ("ram", "null"):
        if size is None:
            raise ctx.err(f"{where}.{USERSPACE_KEY}.size", f"is required for a {backend} namespace",
                          'add "size": "64M" (bytes or K/M/G/T)')
        if path:
            raise ctx.err(f"{where}.device.path", f"is set but the backend is {backend!r}",
                          'remove device.path, or use "backend": "file"')
    else:
        if not path:
            if us:
                raise ctx.err(f"{where}.device.path", "is required for a file namespace",
                              'set device.path to a file or block device, or use "backend": "ram" with a "size"')
            raise ctx.err(f"{where}.device.path", "is required (a file or block device)",
                          'set device.path, or add "nvmeof_roce": {"backend": "ram", "size": "64M"} '
                          "for a userspace RAM namespace")
        if "\0" in path:
            raise ctx.err(f"{where}.device.path", f"contains a NUL byte: {path!r}",
                          "no file name holds a NUL byte: write the path without it")
        if not path.startswith("/"):
            raise ctx.err(f"{where}.device.path", f"must be an absolute path, got {path!r}",
                          "the kernel resolves paths from /, write the full path")

    uuid = dev.get("uuid")
    if uuid is not None and uuid != "":
        if not isinstance(uuid, str) or not _UUID_RE.match(uuid):
            raise ctx.err(f"{where}.device.uuid", f"is not a UUID: {uuid!r}",
                          "use the 8-4-4-4-12 hex form, or leave it out for a stable generated one")
        uuid = uuid.lower()
    else:
        uuid = namespace_uuid(subsys_nqn, nsid)
    nguid = dev.get("nguid")
    if nguid is not None:
        hexd = str(nguid).replace("-", "")
        if not re.fullmatch(r"[0-9a-fA-F]{32}", hexd):
            raise ctx.err(f"{where}.device.nguid", f"must be 32 hex digits (dashes allowed), got {nguid!r}",
                          "use a 16-byte value such as 0123456789abcdef0123456789abcdef")
    eui64 = dev.get("eui64")
    if eui64 is not None:
        hexd = str(eui64).replace("-", "").replace(":", "")
        if not re.fullmatch(r"[0-9a-fA-F]{16}", hexd):
            raise ctx.err(f"{where}.device.eui64", f"must be 16 hex digits, got {eui64!r}",
                          "use an 8-byte value such as 0123456789abcdef")
    visible_hosts = None
    if "visible_hosts" in us:
        vw = f"{where}.{USERSPACE_KEY}.visible_hosts"
        visible_hosts = []
        for k, h in enumerate(ctx.list_at(us["visible_hosts"], vw)):
            host = validate_nqn(h, ctx.source, f"{vw}[{k}]")
            if host in visible_hosts:
                raise ctx.err(f"{vw}[{k}]", f"host {host} is listed twice", "list each host once")
            visible_hosts.append(host)
    qos = {}
    if "qos" in us:
        qw = f"{where}.{USERSPACE_KEY}.qos"
        limits = ctx.dict_at(us["qos"], qw, optional=False)
        ctx.unknown(limits, QOS_LIMITS, qw)
        for name, value in limits.items():
            limit = ctx.int_at(value, f"{qw}.{name}", 0, QOS_MAX)
            if limit:
                qos[name] = limit
    grp = n.get("ana_grpid", (n.get("ana") or {}).get("grpid", 1) if isinstance(n.get("ana"), dict) else 1)
    ana_grpid = ctx.int_at(grp, f"{where}.ana_grpid", 1, ANA_GRPID_MAX)
    buffered = None
    if "buffered_io" in n:
        buffered = ctx.flag_at(n["buffered_io"], f"{where}.buffered_io")
    return NamespaceConfig(nsid=nsid, enabled=enabled, backend=backend, path=path if backend == "file" else None,
                           size_bytes=size, block_size=block_size, uuid=uuid, nguid=nguid, eui64=eui64,
                           ana_grpid=ana_grpid, buffered_io=buffered, queue_depth=queue_depth, io_engine=io_engine,
                           userspace=us, visible_hosts=visible_hosts, qos=qos,
                           raw=copy.deepcopy(n))


def _ip_service(trtype: str) -> bool:
    """A port of this trtype is addressed by IP (or IB GID) address and service number (rdma, tcp)."""
    f = fabric(trtype)
    return f is not None and f.ip_service


def _check_addr(ctx: _Ctx, where: str, trtype: str, adrfam: str, traddr: str, trsvcid: Any, ip_required=True):
    """trtype/adrfam/traddr/trsvcid consistency; returns trsvcid as int (0 if not applicable)."""
    if trtype not in TRTYPES:
        raise ctx.err(f"{where}.trtype", f"must be one of {', '.join(TRTYPES)}, got {trtype!r}",
                      'NVMe over RoCE uses "rdma"')
    if adrfam not in ADRFAMS:
        raise ctx.err(f"{where}.adrfam", f"must be one of {', '.join(a for a in ADRFAMS if a)}, got {adrfam!r}",
                      'RoCE over IPv4 uses "ipv4"')
    if _ip_service(trtype):
        if adrfam not in fabric(trtype).adrfams:
            raise ctx.err(f"{where}.adrfam", f"{adrfam!r} does not go with trtype {trtype!r}",
                          'use "ipv4" (or "ipv6")')
        if adrfam in ("ipv4", "ipv6"):
            try:
                ip = ipaddress.ip_address(traddr)
            except ValueError:
                raise ctx.err(f"{where}.traddr", f"{traddr!r} is not an {adrfam} address",
                              f"give the {adrfam} address of the RDMA netdev, e.g. 10.99.0.1") from None
            if (adrfam == "ipv4") != (ip.version == 4):
                raise ctx.err(f"{where}.traddr", f"{traddr!r} is an IPv{ip.version} address but adrfam is {adrfam!r}",
                              f'set adrfam to "ipv{ip.version}"')
        try:
            svc = int(str(trsvcid))
        except ValueError:
            raise ctx.err(f"{where}.trsvcid", f"must be a port number 1..65535, got {trsvcid!r}",
                          "NVMe-oF uses 4420 (8009 for a TCP discovery controller)") from None
        if not 1 <= svc <= 65535:
            raise ctx.err(f"{where}.trsvcid", f"must be a port number 1..65535, got {trsvcid!r}",
                          "NVMe-oF uses 4420")
        return svc
    return 0


def _parse_port(ctx: _Ctx, p: Any, where: str, subsystems: Optional[set]) -> PortConfig:
    p = ctx.dict_at(p, where, optional=False)
    problems = _Problems()
    soft = problems.soft
    soft(ctx.unknown, p, _PORT_KEYS, where)
    if "portid" not in p:
        problems.fatal(ctx.err(where, "missing 'portid'", 'add "portid": 1'))
    portid = soft(ctx.int_at, p["portid"], f"{where}.portid", 0, PORTID_MAX, default=0)
    addr = soft(ctx.dict_at, p.get("addr"), f"{where}.addr", default={})
    soft(ctx.unknown, addr, _ADDR_KEYS, f"{where}.addr")
    trtype = soft(ctx.str_at, addr.get("trtype", "rdma"), f"{where}.addr.trtype", default="rdma")
    adrfam = soft(ctx.str_at, addr.get("adrfam", fabric(trtype).adrfams[0] if _ip_service(trtype) else ""),
                  f"{where}.addr.adrfam", default="ipv4")
    traddr = soft(ctx.str_at, addr.get("traddr", ""), f"{where}.addr.traddr", default="")
    treq = soft(ctx.str_at, addr.get("treq", "not specified"), f"{where}.addr.treq", default="not specified")
    if treq not in TREQS:
        problems.add(ctx.err(f"{where}.addr.treq", f"must be one of {', '.join(TREQS)}, got {treq!r}",
                             'use "not specified"'))
    if "tsas" in addr:
        soft(ctx.str_at, addr["tsas"], f"{where}.addr.tsas")
    svc_raw = addr.get("trsvcid", DEFAULT_TRSVCID if _ip_service(trtype) else "")
    if _ip_service(trtype) and not traddr:
        problems.add(ctx.err(f"{where}.addr.traddr", f"is required for an {trtype} port",
                             "give the IP address of the RDMA netdev, e.g. 10.99.0.1"))
        trsvcid = 0
    else:
        trsvcid = soft(_check_addr, ctx, f"{where}.addr", trtype, adrfam, traddr, svc_raw, default=0)
    params = {}
    for k, v in soft(ctx.dict_at, p.get("param"), f"{where}.param", default={}).items():
        value = soft(ctx.str_at, v, f"{where}.param.{k}")
        if value is not None:
            params[k] = value
    # Parsed once here (decimal or 0x hex, as configfs' kstrtoint accepts); both targets use these values.
    inline = queue_size = None
    if "inline_data_size" in params:
        inline = soft(ctx.int_at, params["inline_data_size"], f"{where}.param.inline_data_size", -1,
                      MAX_INLINE_DATA_SIZE)
    if "max_queue_size" in params:
        queue_size = soft(ctx.int_at, params["max_queue_size"], f"{where}.param.max_queue_size", -1, 1 << 16)

    subs = []
    for j, nqn in enumerate(soft(ctx.list_at, p.get("subsystems"), f"{where}.subsystems", default=[])):
        sw = f"{where}.subsystems[{j}]"
        if subsystems is None or (isinstance(nqn, str) and nqn in subsystems):
            pass  # defined (its own errors, if any, are reported where it is defined)
        elif soft(validate_subsystem_nqn, nqn, ctx.source, sw) is None:
            continue
        else:
            problems.add(ctx.err(sw, f"subsystem {nqn!r} is not defined in 'subsystems'",
                                 "add that subsystem, or remove it from the port"))
            continue
        if nqn in subs:
            problems.add(ctx.err(sw, f"subsystem {nqn!r} is listed twice", "list it once"))
            continue
        subs.append(nqn)

    referrals = []
    names = set()
    for j, r in enumerate(soft(ctx.list_at, p.get("referrals"), f"{where}.referrals", default=[])):
        ref = soft(_parse_referral, ctx, r, f"{where}.referrals[{j}]", names)
        if ref is not None:
            referrals.append(ref)

    anas = []
    for j, a in enumerate(soft(ctx.list_at, p.get("ana_groups"), f"{where}.ana_groups", default=[])):
        group = soft(_parse_ana_group, ctx, a, f"{where}.ana_groups[{j}]", anas)
        if group is not None:
            anas.append(group)

    userspace = soft(ctx.dict_at, p.get(USERSPACE_KEY), f"{where}.{USERSPACE_KEY}", default={})
    problems.done()
    return PortConfig(portid=portid, trtype=trtype, adrfam=adrfam, traddr=traddr, trsvcid=trsvcid, treq=treq,
                      subsystems=subs, referrals=referrals, params=params, ana_groups=anas,
                      inline_data_size=inline, max_queue_size=queue_size, userspace=userspace,
                      raw=copy.deepcopy(p))


def _parse_referral(ctx: _Ctx, r: Any, rw: str, names: set) -> ReferralConfig:
    r = ctx.dict_at(r, rw, optional=False)
    ctx.unknown(r, {"name", "addr", "enable", "portid"}, rw)
    if not r.get("name"):
        raise ctx.err(rw, "missing 'name'", 'add "name": "ref1"')
    name = ctx.str_at(r["name"], f"{rw}.name")
    if name in names:
        raise ctx.err(f"{rw}.name", f"duplicate referral {name!r}", "give each referral its own name")
    names.add(name)
    ra = ctx.dict_at(r.get("addr"), f"{rw}.addr")
    ctx.unknown(ra, _ADDR_KEYS, f"{rw}.addr")
    rt = ctx.str_at(ra.get("trtype", "rdma"), f"{rw}.addr.trtype")
    rf = ctx.str_at(ra.get("adrfam", "ipv4"), f"{rw}.addr.adrfam")
    rtraddr = ctx.str_at(ra.get("traddr", ""), f"{rw}.addr.traddr")
    rsvc = ra.get("trsvcid", DEFAULT_TRSVCID)
    _check_addr(ctx, f"{rw}.addr", rt, rf, rtraddr, rsvc)
    rportid = None
    if "portid" in ra:
        rportid = ctx.int_at(ra["portid"], f"{rw}.addr.portid", 0, PORTID_MAX)
    return ReferralConfig(
        name=name, trtype=rt, adrfam=rf, traddr=rtraddr, trsvcid=str(rsvc),
        treq=ctx.str_at(ra.get("treq", "not specified"), f"{rw}.addr.treq"), portid=rportid,
        enabled=ctx.flag_at(r.get("enable", 1), f"{rw}.enable"), raw=copy.deepcopy(r))


def _parse_ana_group(ctx: _Ctx, a: Any, aw: str, anas: list) -> AnaGroupConfig:
    a = ctx.dict_at(a, aw, optional=False)
    ctx.unknown(a, {"grpid", "ana"}, aw)
    if "grpid" not in a:
        raise ctx.err(aw, "missing 'grpid'", 'add "grpid": 1')
    grpid = ctx.int_at(a["grpid"], f"{aw}.grpid", 1, ANA_GRPID_MAX)
    if any(g.grpid == grpid for g in anas):
        raise ctx.err(f"{aw}.grpid", f"duplicate ANA group {grpid}", "list each group once")
    state = ctx.dict_at(a.get("ana"), f"{aw}.ana").get("state", "optimized")
    if state not in ANA_STATES:
        raise ctx.err(f"{aw}.ana.state", f"must be one of {', '.join(ANA_STATES)}, got {state!r}",
                      'use "optimized"')
    return AnaGroupConfig(grpid=grpid, state=state, raw=copy.deepcopy(a))


# --------------------------------------------------------------------------- the userspace target's subset

USERSPACE_FIX = "remove it, or serve this config with the kernel target: `nvmeof-roce nvmet apply`"
USERSPACE_MAX_NSID = 1024           # the userspace target's Identify Controller NN
USERSPACE_QUEUE_SIZES = (16, 1024)  # param_max_queue_size the userspace target serves
_US_SUBSYS_ATTRS = {"allow_any_host", "serial", "model", "version", "cntlid_min", "cntlid_max", "qid_max",
                    "pi_enable", "firmware", "ieee_oui"}
_US_PORT_PARAMS = {"inline_data_size", "max_queue_size", "pi_enable"}
# addr.tsas values the userspace target serves: none given, or RDMA's own "connected" (the reliable-connected
# QP type nvmet shows for every RDMA port, and what nvmetcli saves from it).  Not "datagram", nor TLS.
_US_TSAS = ("", "none", "not required", "not specified", "connected")


def passthru_configured(entries: Any) -> bool:
    """A passthru entry with a device or enabled.  An empty, disabled one is what nvmetcli saves from a kernel
    with CONFIG_NVME_TARGET_PASSTHRU for every subsystem: no passthru at all."""
    for e in entries if isinstance(entries, list) else [entries] if entries else []:
        path = (e.get("device") or {}).get("path") if isinstance(e, dict) else None
        if not isinstance(e, dict) or path not in (None, "", "(null)") or str(e.get("enable", "0")) not in ("0", ""):
            return True
    return False


def _physical_memory() -> Optional[int]:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def backing_identity(path: str) -> tuple:
    """What makes two device.paths the same backing: the device number of a block device, the (device, inode)
    of a file (so a hard link, a symlink or a bind-mounted path is caught), the resolved path of a file that
    does not exist yet (the target creates it)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        try:
            return ("path", os.path.realpath(path))
        except (OSError, ValueError):
            return ("path", path)
    if stat.S_ISBLK(st.st_mode):
        return ("blockdev", st.st_rdev)
    return ("inode", st.st_dev, st.st_ino)


def validate_for_userspace(cfg: TargetConfig, memory: Optional[int] = None) -> List[ConfigError]:
    """Everything in `cfg` the userspace target (`target check` / `target serve`) does not implement, or
    cannot hold: one ConfigError per key, naming its path and the fix.  The kernel path (`nvmet apply`)
    supports these keys and does not call this."""
    errors: List[ConfigError] = []
    raw = cfg.raw if isinstance(cfg.raw, dict) else {}

    def refuse(where: str, what: str, fix: str = USERSPACE_FIX) -> None:
        errors.append(ConfigError(cfg.source, where, f"{what}: the userspace target does not implement it", fix))

    def truthy(v: Any) -> bool:
        f = _flag(v)
        return bool(v) if f is None else f

    discovery_nqn = (raw.get("discovery") or {}).get("nqn") if isinstance(raw.get("discovery"), dict) else None
    if discovery_nqn not in (None, "", DISCOVERY_NQN):
        errors.append(ConfigError(cfg.source, "discovery.nqn",
                                  f"{discovery_nqn!r}: the userspace target's discovery controller answers to the "
                                  f"well-known {DISCOVERY_NQN} only",
                                  f'use "{DISCOVERY_NQN}" (or leave "discovery" out), or {USERSPACE_FIX}'))
    # hosts[].dhchap (DH-HMAC-CHAP) is served: engine/auth.py checks the keys (`target check` too)

    # ports from the raw config: a port with a problem the loader reported is still checked here
    raw_ports = raw.get("ports") if isinstance(raw.get("ports"), list) else []
    for i, p in enumerate(raw_ports):
        if not isinstance(p, dict):
            continue
        where = f"ports[{i}]"
        addr = p.get("addr") if isinstance(p.get("addr"), dict) else {}
        trtype = addr.get("trtype", "rdma")
        if not serves(trtype):
            errors.append(ConfigError(cfg.source, f"{where}.addr.trtype",
                                      f"{trtype!r}: the userspace target serves {served_labels()} only",
                                      f'use "rdma", or {USERSPACE_FIX}'))
        if addr.get("treq") == "required":
            refuse(f"{where}.addr.treq", "treq \"required\" (secure channel)")
        tsas = str(addr.get("tsas", "") or "").strip().lower()
        if tsas == "datagram":
            refuse(f"{where}.addr.tsas", "tsas \"datagram\" (the unreliable datagram QP type; NVMe/RDMA queues are "
                                         "reliable connected)", 'use "connected", or leave tsas out')
        elif tsas not in _US_TSAS:
            refuse(f"{where}.addr.tsas", f"tsas {addr['tsas']!r} (transport security)")
        params = p.get("param") if isinstance(p.get("param"), dict) else {}
        for k, v in params.items():
            if k not in _US_PORT_PARAMS:
                refuse(f"{where}.param.{k}", f"port parameter {k!r}")
            elif k == "pi_enable" and truthy(v):
                refuse(f"{where}.param.pi_enable", "protection information")
        lo, hi = USERSPACE_QUEUE_SIZES
        try:
            queue_size = int(str(params.get("max_queue_size", -1)), 0)
        except ValueError:
            queue_size = -1  # the loader reported it
        if queue_size != -1 and not lo <= queue_size <= hi:
            errors.append(ConfigError(cfg.source, f"{where}.param.max_queue_size",
                                      f"{queue_size} is outside {lo}..{hi}, the queue sizes the userspace "
                                      "target serves", f"give {lo}..{hi} (or -1 for the default 128)"))
        # ANA groups and states are served (engine/ana.py)
        us = p.get(USERSPACE_KEY) if isinstance(p.get(USERSPACE_KEY), dict) else {}
        for k in us:
            refuse(f"{where}.{USERSPACE_KEY}.{k}", f"port setting {k!r}",
                   "remove it (no port settings exist; target settings go in the top-level \"nvmeof_roce\")")

    paths: Dict[tuple, str] = {}
    ram_total = 0
    memory = _physical_memory() if memory is None else memory
    for i, s in enumerate(cfg.subsystems):
        where = f"subsystems[{i}]"
        for k, v in (s.raw.get("attr") or {}).items():
            if k not in _US_SUBSYS_ATTRS:
                refuse(f"{where}.attr.{k}", f"subsystem attribute {k!r}",
                       f"remove it (known: {', '.join(sorted(_US_SUBSYS_ATTRS))}), or serve this config with the "
                       "kernel target: `nvmeof-roce nvmet apply`")
            elif k == "pi_enable" and truthy(v):
                refuse(f"{where}.attr.pi_enable", "protection information")
        if passthru_configured(s.raw.get("passthru")):
            refuse(f"{where}.passthru", "passthru (a subsystem that forwards to a local NVMe controller)")
        for k in s.userspace:
            refuse(f"{where}.{USERSPACE_KEY}.{k}", f"subsystem setting {k!r}", "remove it")
        for j, n in enumerate(s.namespaces):
            nw = f"{where}.namespaces[{j}]"
            if n.nsid > USERSPACE_MAX_NSID:
                errors.append(ConfigError(cfg.source, f"{nw}.nsid",
                                          f"{n.nsid} is above {USERSPACE_MAX_NSID}, the highest NSID the userspace "
                                          "target serves", f"use an NSID in 1..{USERSPACE_MAX_NSID}"))
            for group, keys in (("resv", ("enable",)), ):
                g = n.raw.get(group)
                if isinstance(g, dict) and any(truthy(g.get(k)) for k in keys):
                    refuse(f"{nw}.{group}.enable", "reservations (resv_enable)")
            if truthy(n.raw.get("p2pmem", 0) or 0):
                refuse(f"{nw}.p2pmem", "peer-to-peer memory")
            if not n.enabled:
                continue
            if n.backend == "file" and n.path:
                ident = backing_identity(n.path)
                if ident in paths:
                    errors.append(ConfigError(cfg.source, f"{nw}.device.path",
                                              f"{n.path} is already the backing of {paths[ident]}",
                                              "give each namespace its own file or device (two namespaces on one "
                                              "file would corrupt each other)"))
                else:
                    paths[ident] = nw
            if n.backend == "ram" and n.size_bytes:
                ram_total += n.size_bytes
                if memory and ram_total > memory:
                    errors.append(ConfigError(
                        cfg.source, f"{nw}.{USERSPACE_KEY}.size",
                        f"the RAM namespaces come to {ram_total} bytes with this one, more than the "
                        f"{memory} bytes of memory this machine has",
                        "make the RAM namespaces smaller, or use a file namespace"))
    return errors


def load_userspace_config(path) -> TargetConfig:
    """`target check` and `target serve`: read, parse and check what the userspace target serves; every
    problem is reported at once (ConfigErrors)."""
    cfg, errors = load_config_collect(path)
    if cfg is not None:
        errors.extend(validate_for_userspace(cfg))
    raise_all(errors)
    return cfg
