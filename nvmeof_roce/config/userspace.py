"""What the userspace target serves of the config: `validate_for_userspace` names every key it does not
implement or cannot hold (one ConfigError each, with the fix), and `load_userspace_config` is the loader plus
those checks, as `target check` and `target serve` read a config.  The kernel path (`nvmet apply`) serves these
keys and does not call them."""
import os
import stat
from typing import Any, Callable, Dict, List, Optional

from ..transport.registry import served_labels, served_quoted, serves
from .errors import ConfigError, raise_all
from .loader import load_config_collect
from .model import DEFAULT_TRTYPE, DISCOVERY_NQN, USERSPACE_KEY, SubsystemConfig, TargetConfig, parse_flag


USERSPACE_FIX = "remove it, or serve this config with the kernel target: `nvmeof-roce nvmet apply`"
USERSPACE_MAX_NSID = 1024           # the userspace target's Identify Controller NN
# traddrs that name no single RDMA device: the userspace target refuses them as `target serve` would fail on them
WILDCARD_TRADDRS = ("0.0.0.0", "::", "[::]")
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
        trtype = addr.get("trtype", DEFAULT_TRTYPE)
        if not serves(trtype):
            errors.append(ConfigError(cfg.source, f"{where}.addr.trtype",
                                      f"{trtype!r}: the userspace target serves {served_labels()} only",
                                      f"use {served_quoted()}, or {USERSPACE_FIX}"))
        traddr = str(addr.get("traddr", "") or "").strip()
        if serves(trtype) and traddr in WILDCARD_TRADDRS:
            # rdma_cm binds a wildcard to no device, so `target serve` cannot listen there (transport/rdma/cm.py)
            errors.append(ConfigError(cfg.source, f"{where}.addr.traddr",
                                      f"{traddr!r} is a wildcard address: an RDMA listener needs the address of "
                                      "one RDMA netdev", "give that netdev's IP address (`nvmeof-roce rdma status` "
                                                         "lists them); add one port per address to serve several"))
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
            elif k == "pi_enable" and _truthy(v):
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

    namespaces_of = _namespace_checker(cfg, memory)
    for i, s in enumerate(cfg.subsystems):
        where = f"subsystems[{i}]"
        for k, v in (s.raw.get("attr") or {}).items():
            if k not in _US_SUBSYS_ATTRS:
                refuse(f"{where}.attr.{k}", f"subsystem attribute {k!r}",
                       f"remove it (known: {', '.join(sorted(_US_SUBSYS_ATTRS))}), or serve this config with the "
                       "kernel target: `nvmeof-roce nvmet apply`")
            elif k == "pi_enable" and _truthy(v):
                refuse(f"{where}.attr.pi_enable", "protection information")
        if passthru_configured(s.raw.get("passthru")):
            refuse(f"{where}.passthru", "passthru (a subsystem that forwards to a local NVMe controller)")
        for k in s.userspace:
            refuse(f"{where}.{USERSPACE_KEY}.{k}", f"subsystem setting {k!r}", "remove it")
        errors += namespaces_of(i, s)
    return errors


def namespace_problems(cfg: TargetConfig, memory: Optional[int] = None) -> List[ConfigError]:
    """What the userspace target cannot serve of `cfg`'s namespaces (part of validate_for_userspace; an RPC that
    adds or resizes one namespace checks the config it makes with this): an NSID above USERSPACE_MAX_NSID,
    p2pmem, two namespaces on one backing, RAM namespaces larger than the machine's memory."""
    check = _namespace_checker(cfg, memory)
    return [e for i, s in enumerate(cfg.subsystems) for e in check(i, s)]


def _namespace_checker(cfg: TargetConfig,
                       memory: Optional[int]) -> Callable[[int, SubsystemConfig], List[ConfigError]]:
    """namespace_problems one subsystem at a time, in order (a backing or the RAM total counts across them)."""
    paths: Dict[tuple, str] = {}
    ram_total = 0
    memory = _physical_memory() if memory is None else memory

    def check(i: int, s: SubsystemConfig) -> List[ConfigError]:
        nonlocal ram_total
        errors: List[ConfigError] = []
        for j, n in enumerate(s.namespaces):
            nw = f"subsystems[{i}].namespaces[{j}]"
            if n.nsid > USERSPACE_MAX_NSID:
                errors.append(ConfigError(cfg.source, f"{nw}.nsid",
                                          f"{n.nsid} is above {USERSPACE_MAX_NSID}, the highest NSID the userspace "
                                          "target serves", f"use an NSID in 1..{USERSPACE_MAX_NSID}"))
            # "resv": {"enable": "1"} (nvmet's resv_enable) is served: engine/reservations.py
            if _truthy(n.raw.get("p2pmem", 0) or 0):
                errors.append(ConfigError(cfg.source, f"{nw}.p2pmem", "peer-to-peer memory: the userspace target "
                                          "does not implement it", USERSPACE_FIX))
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
    return check


def _truthy(v: Any) -> bool:
    f = parse_flag(v)
    return bool(v) if f is None else f


def load_userspace_config(path) -> TargetConfig:
    """`target check` and `target serve`: read, parse and check what the userspace target serves; every
    problem is reported at once (ConfigErrors)."""
    cfg, errors = load_config_collect(path)
    if cfg is not None:
        errors.extend(validate_for_userspace(cfg))
    raise_all(errors)
    return cfg
