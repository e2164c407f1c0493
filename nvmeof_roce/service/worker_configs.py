"""The configs of `serve --workers N`'s workers, derived from the admin's CONFIG (docs/multipath.md).

- every RDMA port P of the config becomes N ports: worker i listens on trsvcid P + i (worker 0 keeps P's
  portid, the others get new portids after the highest configured one); every worker knows all of them, so
  the discovery log of any worker lists every path (`nvme connect-all` finds them all);
- each subsystem's CNTLID range (attr cntlid_min..cntlid_max) is split into N disjoint ranges: the host
  refuses two controllers with one CNTLID in a subsystem;
- NQN, serial, namespace UUID/NGUID/EUI-64 are the config's on every worker (the UUID derives from NQN+NSID);
- a RAM namespace lives in one shared file under /dev/shm that every worker opens (a worker restarted after a
  crash finds the data there); file and block namespaces are opened by each worker.

`config_from_worker` goes the other way: the admin's config from worker 0's running one (for --persist).
"""
from __future__ import annotations

import copy
import hashlib
import os
from typing import Dict, List, Optional, Tuple

from ..config import USERSPACE_KEY, ConfigError, TargetConfig
from ..config.model import DEFAULT_TRTYPE
from ..config.keys import KEYRING
from ..engine.backends import open_backend
from ..errors import NvmeofError
from ..nvme.fabrics import MAX_CNTLID, MIN_CNTLID
from ..transport import registry
from ..tunables import WORKERS

SHM_DIR = "/dev/shm"


def config_workers(config: TargetConfig) -> Tuple[Optional[int], Optional[List[int]]]:
    """The config's nvmeof_roce.workers and .cpus, checked (None where not given)."""
    us = config.userspace or {}
    workers = us.get("workers")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)
                                or not WORKERS.in_range(workers)):
        raise ConfigError(config.source, f"{USERSPACE_KEY}.workers", f"must be an integer {WORKERS.range_text}, "
                          f"got {workers!r}", "give the number of worker processes, e.g. 2")
    cpus = us.get("cpus")
    if cpus is not None and (not isinstance(cpus, list) or not cpus
                             or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in cpus)):
        raise ConfigError(config.source, f"{USERSPACE_KEY}.cpus", f"must be a list of CPU numbers, got {cpus!r}",
                          'e.g. "cpus": [0, 1]')
    return workers, cpus


def split_cntlid_range(lo: int, hi: int, n: int) -> List[Tuple[int, int]]:
    """[lo, hi] cut into n disjoint, contiguous ranges as equal as possible."""
    span = hi - lo + 1
    if span < n:
        raise ValueError(f"{span} controller IDs ({lo}..{hi}) cannot be split over {n} workers")
    out = []
    start = lo
    for i in range(n):
        size = span // n + (1 if i < span % n else 0)
        out.append((start, start + size - 1))
        start += size
    return out


def shm_path(run_dir: str, nqn: str, nsid: int) -> str:
    tag = hashlib.sha256(f"{os.path.abspath(run_dir)}#{nqn}".encode()).hexdigest()[:12]
    return os.path.join(SHM_DIR, f"nvmeof-roce-{tag}-ns{nsid}")


def worker_configs(config: TargetConfig, n: int, run_dir: str) -> Tuple[List[dict], Dict[int, List[int]],
                                                                         List[List[int]]]:
    """The config each worker serves, the portids worker i listens on, and the path groups (the N portids
    made from one configured port).  Every worker gets the same config but for its subsystems' CNTLID ranges."""
    base = config.to_dict()
    ring = (base.pop(USERSPACE_KEY, None) or {}).get(KEYRING)
    if ring:  # the hosts' keys may name its keys
        base[USERSPACE_KEY] = {KEYRING: ring}
    served = [p for p in base["ports"] if registry.serves(p.get("addr", {}).get("trtype", DEFAULT_TRTYPE))]
    if not served:
        trtypes = " or ".join(map(repr, registry.served_trtypes()))
        raise NvmeofError(f"{config.source}: no port with trtype {trtypes} to give the workers",
                          f"add a port of trtype {trtypes}; each worker listens on its trsvcid + worker index")
    next_portid = max(p["portid"] for p in base["ports"]) + 1
    listen: Dict[int, List[int]] = {i: [] for i in range(n)}
    groups: List[List[int]] = []
    ports = []
    for p in base["ports"]:
        if p not in served:
            ports.append(p)
            continue
        svc = int(p["addr"]["trsvcid"])
        groups.append([])
        for i in range(n):
            q = copy.deepcopy(p)
            if i:
                q["portid"] = next_portid
                next_portid += 1
                q["addr"]["trsvcid"] = str(svc + i)
                if svc + i > 65535:
                    raise NvmeofError(f"{config.source}: port {p['portid']}: trsvcid {svc}+{i} is above 65535",
                                      "use a lower trsvcid or fewer workers")
            listen[i].append(q["portid"])
            groups[-1].append(q["portid"])
            ports.append(q)
    base["ports"] = ports

    for s in base["subsystems"]:
        for ns in s.get("namespaces", []):
            us = ns.get(USERSPACE_KEY) or {}
            if us.get("backend") == "ram" and ns.get("enable", 1):
                path = shm_path(run_dir, s["nqn"], ns["nsid"])
                # one file in shared memory that every worker maps: the same data through every path
                ns["device"]["path"] = path
                ns[USERSPACE_KEY] = {"backend": "file", "block_size": us.get("block_size", 512)}
    configs = []
    for i in range(n):
        c = copy.deepcopy(base)
        for s_cfg, s in zip(config.subsystems, c["subsystems"]):
            ranges = split_cntlid_range(s_cfg.cntlid_min or MIN_CNTLID, s_cfg.cntlid_max or MAX_CNTLID, n)
            s["attr"]["cntlid_min"], s["attr"]["cntlid_max"] = (str(v) for v in ranges[i])
        configs.append(c)
    return configs, listen, groups


def config_from_worker(running: dict, config: TargetConfig, run_dir: str) -> dict:
    """The admin's config again from worker 0's running one (worker_configs in reverse): the configured ports
    only (worker 0 keeps their portids and addresses), each configured subsystem's own CNTLID range, RAM
    namespaces as RAM (not their shared file), the top-level nvmeof_roce object (workers, cpus, persist)."""
    out = copy.deepcopy(running)
    user = config.to_dict()
    portids = {p["portid"] for p in user["ports"]}
    out["ports"] = [p for p in out["ports"] if p["portid"] in portids]
    user_subs = {s["nqn"]: s for s in user["subsystems"]}
    for s in out["subsystems"]:
        u = user_subs.get(s["nqn"])
        if u is None:
            continue  # created live: as the workers have it
        attr = s.setdefault("attr", {})
        for key in ("cntlid_min", "cntlid_max"):
            if key in u.get("attr", {}):
                attr[key] = u["attr"][key]
            else:
                attr.pop(key, None)
        user_ns = {int(str(n["nsid"]), 0): n for n in u.get("namespaces", [])}
        for n in s.get("namespaces", []):
            un = user_ns.get(int(str(n["nsid"]), 0))
            if un is None or (un.get(USERSPACE_KEY) or {}).get("backend") != "ram":
                continue
            if (n.get("device") or {}).get("path") != shm_path(run_dir, s["nqn"], int(str(n["nsid"]), 0)):
                continue
            us = dict(un[USERSPACE_KEY])
            us.update((k, v) for k, v in (n.get(USERSPACE_KEY) or {}).items() if k != "backend")
            n[USERSPACE_KEY] = us
            n["device"].pop("path", None)
    if user.get(USERSPACE_KEY):
        out[USERSPACE_KEY] = copy.deepcopy(user[USERSPACE_KEY])
    else:
        out.pop(USERSPACE_KEY, None)
    return out


def create_shared_files(config: TargetConfig, run_dir: str, keep_existing: bool = False) -> List[str]:
    """Create the shared RAM files (returned, to remove at stop) and any file namespace the config asks to
    create: here, once, rather than by N workers racing to create it.  At a reload (`keep_existing`) the RAM
    files already there are the running namespaces' data: only the missing ones are made."""
    created = []
    for s in config.subsystems:
        for ns in s.namespaces:
            if ns.backend == "file" and ns.enabled and ns.path and not os.path.exists(ns.path):
                open_backend(ns).close()
            if ns.backend == "ram" and ns.enabled:
                path = shm_path(run_dir, s.nqn, ns.nsid)
                if keep_existing and os.path.exists(path):
                    continue
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    os.ftruncate(fd, ns.size_bytes)
                finally:
                    os.close(fd)
                created.append(path)
    return created
