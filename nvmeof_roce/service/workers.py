"""`target serve --workers N`: one subsystem served by N processes, one RDMA listener each (docs/multipath.md).

A Python process uses one core, and an RDMA connection cannot move between processes; the Linux host spreads
I/O over several controllers of one subsystem itself (native NVMe multipath, steered by ANA).  So the
supervisor runs N workers that each serve the same subsystems on their own port:

- every RDMA port P of the config becomes N ports: worker i listens on trsvcid P + i (worker 0 keeps P's
  portid, the others get new portids after the highest configured one); every worker knows all of them, so
  the discovery log of any worker lists every path (`nvme connect-all` finds them all);
- each subsystem's CNTLID range (attr cntlid_min..cntlid_max) is split into N disjoint ranges: the host
  refuses two controllers with one CNTLID in a subsystem;
- NQN, serial, namespace UUID/NGUID/EUI-64 are the config's on every worker (the UUID derives from NQN+NSID);
- a RAM namespace lives in one shared file under /dev/shm that every worker opens (a worker restarted after a
  crash finds the data there); file and block namespaces are opened by each worker.  Flush is fdatasync of
  the shared file, so it covers writes any worker made; FUA likewise;
- ANA states are per port (engine/ana.py); `target ana-state` changes them in every worker (ana_control.py);
- a worker that dies is restarted; SIGTERM/SIGINT stop all workers, which drain their commands;
- the supervisor owns the control socket: a call is answered from every worker (lists joined, counts added),
  a change is made on every worker in turn, and `nvmeof_reload_config` (SIGHUP, `target reload`, the unit's
  ExecReload) re-derives the workers' configs from CONFIG, checks them on every worker (dry run) and then
  applies them on every worker, answering only when all have; `--metrics` serves every worker's figures
  with a `worker` label (each worker hands its own over its socket, RUN_DIR/worker-I.sock);
- under systemd (Type=notify) the supervisor alone notifies: READY=1 once every worker listens, RELOADING=1
  and READY=1 around a reload, STOPPING=1; the workers do not see $NOTIFY_SOCKET.

Config: a top-level ``"nvmeof_roce": {"workers": 2, "cpus": [0, 1]}``, or ``--workers`` / ``--cpus``.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..config import USERSPACE_KEY, ConfigError, TargetConfig, load_userspace_config, parse_config, parse_cpus
from ..errors import NvmeofError
from ..transport import registry
from ..nvme.fabrics import MAX_CNTLID, MIN_CNTLID
from ..securefile import write_file
from ..tunables import RESOURCE_LIMITS, WORKERS
from ..engine.ana import AnaTable
from .ana_control import default_run_dir, publish, unpublish
from ..engine.backends import open_backend
from ..control.client import call as rpc_call
from ..control.protocol import MAX_REQUEST_BYTES, PARSE_ERROR, RpcError, handle_request
from ..control.server import bind_unix_socket
from .sdnotify import notify

log = logging.getLogger(__name__)

MAX_WORKERS = WORKERS.high
SHM_DIR = "/dev/shm"
RESTART_DELAY = 0.5       # seconds before a dead worker is started again
RESTART_DELAY_MAX = 10.0  # a worker that keeps dying at start is retried at most this often
STOP_TIMEOUT = 15.0       # after SIGTERM, how long workers get to drain before SIGKILL
READY_TIMEOUT = 120.0
WORKER_RPC_TIMEOUT = 60.0  # one forwarded call to one worker


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=WORKERS.type, metavar=WORKERS.metavar, help=WORKERS.help)
    p.add_argument("--cpus", metavar="LIST", help="pin worker i to CPU LIST[i %% len] (e.g. 0,1); "
                                                  "default: the config's nvmeof_roce.cpus, else unpinned")
    p.add_argument("--run-dir", metavar="DIR",
                   help="where the target keeps its pid and ANA state for 'target ana-state' "
                        "(default /run/nvmeof-roce as root)")
    # set by the supervisor for its workers
    p.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)
    p.add_argument("--listen-port", type=int, action="append", help=argparse.SUPPRESS)
    p.add_argument("--path-group", action="append", help=argparse.SUPPRESS)


def _config_workers(config: TargetConfig) -> Tuple[Optional[int], Optional[List[int]]]:
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


def workers_requested(args) -> Optional[int]:
    """The worker count when serve should supervise workers, else None (one process, or a worker itself)."""
    if args.worker_index is not None:
        return None
    if args.workers is not None:
        if not WORKERS.in_range(args.workers):
            raise NvmeofError(f"--workers {args.workers}: must be {WORKERS.range_text}", "e.g. --workers 2")
        return args.workers
    workers, _ = _config_workers(load_userspace_config(args.config))
    return workers


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
    base.pop(USERSPACE_KEY, None)
    rdma = [p for p in base["ports"] if registry.serves(p.get("addr", {}).get("trtype", "rdma"))]
    if not rdma:
        raise NvmeofError(f"{config.source}: no port with trtype 'rdma' to give the workers",
                          "add an rdma port; each worker listens on its trsvcid + worker index")
    next_portid = max(p["portid"] for p in base["ports"]) + 1
    listen: Dict[int, List[int]] = {i: [] for i in range(n)}
    groups: List[List[int]] = []
    ports = []
    for p in base["ports"]:
        if p not in rdma:
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


def _create_shm(config: TargetConfig, run_dir: str, keep_existing: bool = False) -> List[str]:
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


# How the supervisor answers a control call: methods whose answers are joined from every worker; methods it
# refuses because a worker-wide meaning would differ from the single-process one; the rest go to every worker.
GATHERED = ("rpc_get_methods", "nvmf_get_subsystems", "nvmf_subsystem_get_controllers", "nvmf_subsystem_get_qpairs",
            "nvmf_get_stats", "nvmeof_get_status")
NAMESPACE_SUMS = ("read_commands", "write_commands", "bytes_read", "bytes_written", "errors", "iops",
                  "read_bytes_per_s", "write_bytes_per_s")
REFUSED = {
    "nvmf_subsystem_add_listener": "each worker listens on its own port (trsvcid + worker index)",
    "nvmf_subsystem_remove_listener": "each worker listens on its own port (trsvcid + worker index)",
    "save_config": "the workers' configs are derived from CONFIG (ports and CNTLID ranges split per worker)",
    "nvmf_subsystem_listener_set_ana_state": "each worker listens on its own port, and 'target ana-state' sets "
                                             "a state on every worker's port at once",
}


class SupervisorControl:
    """The control socket of `serve --workers`: the same JSON-RPC methods as one process, answered by all
    workers (`call_worker(i, method, params)` reaches worker i's socket)."""

    def __init__(self, workers: int, call_worker: Callable[[int, str, Any], Any],
                 reload: Callable[[str, bool], dict], metrics_text: Callable[[], str],
                 saved: Callable[[int], None] = lambda i: None, identity: Callable[[], dict] = dict,
                 changed: Callable[[], None] = lambda: None):
        self.workers = workers
        self._identity = identity  # {"config": CONFIG, "socket": the supervisor's socket} for the status
        self.call_worker = call_worker
        self._reload = reload
        self._metrics_text = metrics_text
        self._saved = saved  # after a change: the supervisor keeps worker i's running config for its restart
        self._changed = changed  # after a change every worker made: CONFIG is written once (--persist)

    def handle(self, request: Any) -> Optional[dict]:
        return handle_request(self.call, request)

    def call(self, method: str, params: Any = None) -> Any:
        if method == "nvmeof_reload_config":
            p = params or {}
            if not isinstance(p, dict) or set(p) - {"path", "dry_run"}:
                raise RpcError("nvmeof_reload_config takes path and dry_run", "params", '{"dry_run": true}')
            return self._reload(p.get("path") or "", bool(p.get("dry_run", False)))
        if method == "nvmeof_get_metrics":
            return self._metrics_text()
        if method in REFUSED:
            raise RpcError(f"{method} is not available under serve --workers: {REFUSED[method]}", "method",
                           "edit CONFIG and run 'nvmeof-roce target reload' (every worker applies it)")
        if method == "nvmf_subsystem_add_ns" and isinstance(params, dict) and \
                (params.get("namespace") or {}).get("backend") == "ram":
            raise RpcError("a RAM namespace added live would be a separate RAM disk in each worker, not one "
                           "namespace", "namespace.backend",
                           "add it to CONFIG and run 'nvmeof-roce target reload' (the workers then share one RAM "
                           "file), or add a file namespace")
        if method in GATHERED:
            return self._gather(method, [self.call_worker(i, method, params) for i in range(self.workers)])
        return self._everywhere(method, params)

    def _everywhere(self, method: str, params: Any) -> Any:
        """A change: worker 0 first (a refusal there changes nothing), then the others in turn."""
        results = []
        for i in range(self.workers):
            try:
                results.append(self.call_worker(i, method, params))
            except (RpcError, NvmeofError) as exc:
                if i == 0:
                    raise
                fix = getattr(exc, "fix", "")
                raise RpcError(f"applied by worker(s) 0..{i - 1}, refused by worker {i}: {exc.message}",
                               getattr(exc, "field", ""), f"{fix}; then 'nvmeof-roce target reload' makes the "
                               "workers agree again with CONFIG".lstrip("; ")) from None
            self._saved(i)
        self._changed()
        return results[0]

    def _gather(self, method: str, answers: List[Any]) -> Any:
        first = answers[0]
        if method in ("rpc_get_methods", "nvmf_get_subsystems"):
            return first  # every worker serves the same subsystems and knows every port
        if method in ("nvmf_subsystem_get_controllers", "nvmf_subsystem_get_qpairs"):
            return [dict(item, worker=i) for i, answer in enumerate(answers) for item in answer]
        if method == "nvmf_get_stats":
            out = dict(first)
            out["poll_groups"] = [dict(g, name=f"worker{i}_{g['name']}") for i, a in enumerate(answers)
                                  for g in a["poll_groups"]]
            out["namespaces"] = _sum_namespaces([a["namespaces"] for a in answers])
            out["internal_errors"] = sum(a["internal_errors"] for a in answers)
            return out
        # nvmeof_get_status
        out = copy.deepcopy(first)
        for key in ("internal_errors", "in_flight"):
            out[key] = sum(a[key] for a in answers)
        out["discovery_controllers"] = [dict(c, worker=i) for i, a in enumerate(answers)
                                        for c in a["discovery_controllers"]]
        for j, sub in enumerate(out["subsystems"]):
            sub["controllers"] = [dict(c, worker=i) for i, a in enumerate(answers)
                                  for c in a["subsystems"][j]["controllers"]]
            sub["namespaces"] = _sum_namespaces([a["subsystems"][j]["namespaces"] for a in answers])
        hosts: Dict[str, dict] = {}
        for i, a in enumerate(answers):
            for h in a["hosts"]:
                entry = hosts.setdefault(h["hostnqn"], {"hostnqn": h["hostnqn"], "controllers": []})
                entry["controllers"] += [dict(c, worker=i) for c in h["controllers"]]
        out["hosts"] = list(hosts.values())
        out["transport"] = {"listeners": [dict(lst, worker=i) for i, a in enumerate(answers)
                                          for lst in a["transport"]["listeners"]],
                            "loop": max((a["transport"]["loop"] for a in answers),
                                        key=lambda loop: loop.get("longest_pass_s") or 0)}
        out["workers"] = [{"worker": i, "config": a["config"], "socket": a["socket"]} for i, a in enumerate(answers)]
        out.update(self._identity())
        return out


def _sum_namespaces(per_worker: List[List[dict]]) -> List[dict]:
    """One namespace list from every worker's: counts and rates added (latency percentiles are worker 0's;
    each worker's own are in its status on RUN_DIR/worker-I.sock)."""
    out = copy.deepcopy(per_worker[0])
    for other in per_worker[1:]:
        by_nsid = {ns["nsid"]: ns for ns in other}
        for ns in out:
            theirs = by_nsid.get(ns["nsid"], {})
            for key in NAMESPACE_SUMS:
                if isinstance(ns.get(key), (int, float)) and isinstance(theirs.get(key), (int, float)):
                    ns[key] += theirs[key]
    return out


class ControlSocket:
    """The supervisor's Unix socket: one request at a time, answered before the next is read."""

    def __init__(self, sock: socket.socket, handle: Callable[[Any], Optional[dict]]):
        self.sock = sock
        self.handle = handle
        self.sock.setblocking(False)

    def serve_one(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        with conn:
            conn.settimeout(5.0)
            buf = b""
            decoder = json.JSONDecoder()
            try:
                while True:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                    if len(buf) > MAX_REQUEST_BYTES:
                        raise ValueError(f"request larger than {MAX_REQUEST_BYTES} bytes")
                    try:
                        request, _ = decoder.raw_decode(buf.decode("utf-8").lstrip())
                        break
                    except json.JSONDecodeError as exc:
                        if exc.msg.startswith("Unterminated") or exc.pos >= len(buf.decode("utf-8").lstrip()):
                            continue
                        raise ValueError(f"invalid JSON: {exc.msg}")
                response = self.handle(request)
            except (ValueError, UnicodeDecodeError) as exc:
                response = {"jsonrpc": "2.0", "id": None, "error": RpcError(
                    str(exc), "", "send one JSON-RPC 2.0 object per request", PARSE_ERROR).to_dict()}
            except OSError:
                return
            if response is not None:
                try:
                    conn.sendall(json.dumps(response).encode("utf-8") + b"\n")
                except OSError:
                    pass


class Supervisor:
    """Starts, watches and restarts the workers; stops them all on SIGTERM/SIGINT; serves the control socket,
    reloads on SIGHUP, serves every worker's metrics and tells systemd where it stands."""

    def __init__(self, config_path: str, n: int, *, cpus: Optional[List[int]], run_dir: str,
                 ready_file: Optional[str], worker_args: List[str], verbose: int = 0,
                 rpc_socket: Optional[str] = None, rpc_socket_explicit: bool = True,
                 metrics: Optional[str] = None, persist: Optional[bool] = None):
        from .ops import persist_changes
        self.config_path = config_path
        self.config = load_userspace_config(config_path)
        self.persist = persist_changes(self.config, persist)
        _, config_cpus = _config_workers(self.config)
        self.n = n
        self.cpus = cpus if cpus is not None else config_cpus
        self.run_dir = run_dir
        self.ready_file = ready_file
        self.worker_args = worker_args
        self.verbose = verbose
        self.rpc_socket = rpc_socket
        self.rpc_socket_explicit = rpc_socket_explicit
        self.metrics_listen = metrics
        os.makedirs(run_dir, exist_ok=True)
        configs = self._derive(self.config)
        self.paths = [os.path.join(run_dir, f"worker-{i}.json") for i in range(n)]
        for path, c in zip(self.paths, configs):
            _write_json(path, c)
        self.sockets = [os.path.join(run_dir, f"worker-{i}.sock") for i in range(n)]
        self.table = AnaTable(parse_config(configs[0], config_path))
        self.procs: List[Optional[subprocess.Popen]] = [None] * n
        self.started_at = [0.0] * n
        self.delay = [RESTART_DELAY] * n
        self.restart_at: Dict[int, float] = {}
        self.restarts = [0] * n
        self.stopping = False
        self.reload_pending = False
        self.shm_files: List[str] = []
        self.control = SupervisorControl(n, self.call_worker, self.reload, self.metrics_text, self._keep_running,
                                         lambda: {"config": self.config_path, "socket": self.rpc_socket or ""},
                                         self._save_change)
        self.registry = None
        self.http = None

    def _derive(self, config: TargetConfig) -> List[dict]:
        """Each worker's config from `config`, each checked as the worker will load it."""
        try:
            configs, self.listen, self.groups = worker_configs(config, self.n, self.run_dir)
        except ValueError as exc:
            raise NvmeofError(f"{config.source}: {exc}", "widen cntlid_min..cntlid_max or use fewer workers")
        for i, c in enumerate(configs):
            parse_config(c, f"{config.source} (worker {i})")  # a clash (e.g. trsvcid+i taken) fails here, named
        return configs

    # -- the workers' control sockets
    def call_worker(self, i: int, method: str, params: Any = None) -> Any:
        return rpc_call(self.sockets[i], method, params, timeout=WORKER_RPC_TIMEOUT)

    def _keep_running(self, i: int) -> None:
        """After a live change: worker i's running config becomes what it starts from if it dies."""
        try:
            _write_json(self.paths[i], self.call_worker(i, "save_config"))
        except (RpcError, NvmeofError, OSError) as exc:
            log.warning("worker %d: could not keep its running config for a restart: %s", i, exc)

    def _save_change(self) -> None:
        """With persist on: CONFIG as it is now, written once after every worker made a live change (worker 0's
        running config turned back into the admin's: its ports, CNTLID ranges and RAM namespaces)."""
        if not self.persist:
            return
        try:
            data = config_from_worker(self.call_worker(0, "save_config"), self.config, self.run_dir)
            new = parse_config(data, self.config_path)
            write_file(self.config_path, json.dumps(data, indent=2) + "\n")
        except (RpcError, NvmeofError, ConfigError, OSError) as exc:
            why = getattr(exc, "strerror", None) or getattr(exc, "message", None) or str(exc)
            log.error("persist: the change is applied on every worker but could not be saved to %s: %s",
                      self.config_path, why)
            raise RpcError(f"the change is applied on every worker but could not be saved to {self.config_path}: "
                           f"{why}", "persist", "fix the cause, then edit CONFIG to match (a restart would lose "
                           "the change)") from None
        self.config = new
        log.info("persist: saved the running config to %s", self.config_path)

    def metrics_text(self) -> str:
        from .metrics import exposition
        return exposition(self._registry())

    def _registry(self):
        if self.registry is None:
            from .metrics import supervisor_registry
            self.registry = supervisor_registry(self.n, lambda i: self.call_worker(i, "nvmeof_get_metrics"))
        return self.registry

    def reload(self, path: str = "", dry_run: bool = False) -> dict:
        """Re-read CONFIG (or `path`), derive the workers' configs, have every worker check its own (dry run),
        then every worker apply it; nothing changes anywhere if any worker refuses."""
        path = path or self.config_path
        try:
            new = load_userspace_config(path)
            workers, _ = _config_workers(new)
        except ConfigError as exc:
            raise RpcError(exc.problem, exc.where or "path", exc.fix) from None
        if workers is not None and workers != self.n:
            raise RpcError(f"nvmeof_roce.workers changed from {self.n} to {workers}: a reload keeps the workers",
                           f"{USERSPACE_KEY}.workers", "restart the target (systemctl restart) to change it")
        saved = (self.listen, self.groups)
        try:
            configs = self._derive(new)
        except (NvmeofError, ConfigError) as exc:
            self.listen, self.groups = saved
            raise RpcError(getattr(exc, "problem", None) or exc.message, getattr(exc, "where", "") or "path",
                           exc.fix) from None
        if (self.listen, self.groups) != saved:
            self.listen, self.groups = saved
            raise RpcError("the reload changes the ports the workers listen on", "ports",
                           "restart the target to add or remove an RDMA port under serve --workers")
        pending = [f"{p}.reload" for p in self.paths]
        answers = []
        try:
            for i, c in enumerate(configs):
                _write_json(pending[i], c)
            self.shm_files += _create_shm(new, self.run_dir, keep_existing=True)
            for i in range(self.n):  # every worker checks first: a refusal leaves them all unchanged
                self.call_worker(i, "nvmeof_reload_config", {"path": pending[i], "dry_run": True})
            if not dry_run:
                for i in range(self.n):
                    os.replace(pending[i], self.paths[i])
                    answers.append(self.call_worker(i, "nvmeof_reload_config", {"path": self.paths[i]}))
        finally:
            for p in pending:
                if os.path.exists(p):
                    os.unlink(p)
        if not dry_run:
            self.config, self.config_path = new, path
        changes = answers[0]["changes"] if answers else []
        return {"config": path, "dry_run": dry_run, "applied": not dry_run, "changes": changes,
                "workers": [{"worker": i, "changes": len(a["changes"])} for i, a in enumerate(answers)]}

    def _on_hup(self, *_args) -> None:
        self.reload_pending = True

    def _reload_on_signal(self) -> None:
        log.info("SIGHUP: reloading %s on %d workers", self.config_path, self.n)
        notify("RELOADING=1", "STATUS=reloading", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")
        try:
            result = self.reload()
        except RpcError as exc:
            log.error("reload refused, the workers are unchanged: %s: %s (fix: %s)", exc.field, exc.message,
                      exc.fix)
            notify("READY=1", f"STATUS=reload refused: {exc.field}: {exc.message}")
            return
        except NvmeofError as exc:
            log.error("reload failed: %s (fix: %s)", exc.message, exc.fix)
            notify("READY=1", f"STATUS=reload failed: {exc.message}")
            return
        log.info("reload: %d change(s) applied on every worker", len(result["changes"]))
        notify("READY=1", f"STATUS={self.status_line()}")

    def status_line(self) -> str:
        return f"{self.n} workers serving {self.config.source}"

    def _spawn(self, i: int) -> None:
        cmd = [sys.executable, "-m", "nvmeof_roce"] + ["-v"] * self.verbose + [
            "target", "serve", self.paths[i], "--worker-index", str(i), "--run-dir", self.run_dir,
            "--ready-file", self._ready(i), "--rpc-socket", self.sockets[i]] + self.worker_args
        for portid in self.listen[i]:
            cmd += ["--listen-port", str(portid)]
        for group in self.groups:
            cmd += ["--path-group", ",".join(map(str, group))]
        cpu = self.cpus[i % len(self.cpus)] if self.cpus else None
        preexec = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
        with_ready = self._ready(i)
        if os.path.exists(with_ready):
            os.unlink(with_ready)
        env = dict(os.environ)
        env.pop("NOTIFY_SOCKET", None)  # systemd hears the supervisor only (NotifyAccess=main)
        self.procs[i] = subprocess.Popen(cmd, preexec_fn=preexec, env=env)
        self.started_at[i] = time.monotonic()
        log.info("worker %d: pid %d, ports %s%s", i, self.procs[i].pid,
                 ", ".join(self._describe_port(p) for p in self.listen[i]),
                 f", CPU {cpu}" if cpu is not None else "")

    def _describe_port(self, portid: int) -> str:
        with open(self.paths[0]) as f:
            ports = {p["portid"]: p for p in json.load(f)["ports"]}
        a = ports[portid]["addr"]
        return f"{portid} ({a['traddr']}:{a['trsvcid']})"

    def _ready(self, i: int) -> str:
        return os.path.join(self.run_dir, f"worker-{i}.ready")

    def _on_stop(self, *_args) -> None:
        self.stopping = True

    def _on_usr2(self, *_args) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGUSR2)

    def run(self) -> int:
        # The control socket first: a second supervisor for the same socket stops before starting workers.
        control = self._bind_control()
        try:
            publish(self.run_dir, self.table, workers=self.n)
        except BaseException:
            if control is not None:
                _close_socket(control.sock, self.rpc_socket)
            raise
        previous = {sig: signal.signal(sig, self._on_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        previous[signal.SIGUSR2] = signal.signal(signal.SIGUSR2, self._on_usr2)
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, self._on_hup)
        selector = selectors.DefaultSelector()
        try:
            self.shm_files = _create_shm(self.config, self.run_dir)
            for i in range(self.n):
                self._spawn(i)
            self._wait_ready()
            if self.metrics_listen:
                from .metrics import MetricsHttpServer
                self.http = MetricsHttpServer(self.metrics_listen, self._registry())
            print(f"nvmeof-roce target: {self.n} workers serving {self.config.source}"
                  + (f", control socket {self.rpc_socket}" if control else "")
                  + (f", metrics {self.http.url}" if self.http else ""), flush=True)
            if self.ready_file:
                write_file(self.ready_file, "ready\n")
            notify("READY=1", f"STATUS={self.status_line()}", f"MAINPID={os.getpid()}")
            if control is not None:
                selector.register(control.sock, selectors.EVENT_READ)
            while not self.stopping:
                if self.reload_pending:
                    self.reload_pending = False
                    self._reload_on_signal()
                self._watch()
                if control is not None:
                    if selector.select(0.1):
                        control.serve_one()
                else:
                    time.sleep(0.1)
            notify("STOPPING=1", "STATUS=stopping: the workers finish their in-flight commands")
        finally:
            selector.close()
            if self.http is not None:
                self.http.close()
            if control is not None:
                _close_socket(control.sock, self.rpc_socket)
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for path in self.shm_files:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            unpublish(self.run_dir)
        print("nvmeof-roce target: stopped", flush=True)
        return 0

    def _bind_control(self) -> Optional[ControlSocket]:
        """As one process does: an explicit --rpc-socket must bind; the default one is left out with a warning
        when its directory cannot be used (not root), and another live target on it stops this one."""
        if not self.rpc_socket:
            return None
        from ..control.server import SocketInUse
        try:
            return ControlSocket(bind_unix_socket(self.rpc_socket), self.control.handle)
        except SocketInUse:
            raise
        except NvmeofError as exc:
            if self.rpc_socket_explicit:
                raise
            log.warning("serving without a control socket: %s (fix: %s)", exc.message, exc.fix)
            self.rpc_socket = None
            return None

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while not all(os.path.exists(self._ready(i)) for i in range(self.n)):
            for i, proc in enumerate(self.procs):
                if proc.poll() is not None:
                    raise NvmeofError(f"worker {i} exited with {proc.returncode} before it was ready",
                                      "its messages are above; 'target check CONFIG' validates the config")
            if self.stopping or time.monotonic() > deadline:
                raise NvmeofError("the workers did not all start listening in time", "see their messages above")
            time.sleep(0.05)

    def _watch(self) -> None:
        now = time.monotonic()
        for i, proc in enumerate(self.procs):
            if i in self.restart_at:
                if now >= self.restart_at[i]:
                    del self.restart_at[i]
                    self.restarts[i] += 1
                    self._spawn(i)
                continue
            code = proc.poll()
            if code is None:
                if now - self.started_at[i] > 30:
                    self.delay[i] = RESTART_DELAY  # ran a while: the next crash restarts quickly again
                continue
            log.error("worker %d (pid %d) exited with %s; restarting in %.1f s", i, proc.pid,
                      f"signal {-code}" if code < 0 else code, self.delay[i])
            notify(f"STATUS=worker {i} exited with {code}; restarting")
            self.restart_at[i] = now + self.delay[i]
            self.delay[i] = min(RESTART_DELAY_MAX, self.delay[i] * 2)

    def _stop_all(self) -> None:
        live = [p for p in self.procs if p is not None and p.poll() is None]
        for proc in live:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        for proc in live:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("worker pid %d did not stop in %.0f s: killing it", proc.pid, STOP_TIMEOUT)
                proc.kill()
                proc.wait()


def _write_json(path: str, data: dict) -> None:
    """A worker's config holds the hosts' DH-HMAC-CHAP keys: written as every secret file is (securefile)."""
    write_file(path, json.dumps(data, indent=1))


def _close_socket(sock: socket.socket, path: str) -> None:
    sock.close()
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def supervise(args) -> int:
    from ..transport.rdma.queue import require_pyverbs
    from ..control.protocol import default_socket_path
    require_pyverbs()  # one clear error here rather than one per worker
    n = workers_requested(args)
    cpus = parse_cpus(args.cpus) if args.cpus else None
    worker_args = []
    for t in RESOURCE_LIMITS.values():  # each worker gets the same resource limits
        worker_args += [t.option, str(getattr(args, t.name))]
    if args.no_remote_invalidate:
        worker_args.append("--no-remote-invalidate")
    logging.getLogger("nvmeof_roce").setLevel(logging.DEBUG if args.verbose > 1 else logging.INFO)
    rpc_socket = None if args.no_rpc_socket else (args.rpc_socket or default_socket_path(args.config))
    sup = Supervisor(args.config, n, cpus=cpus, run_dir=args.run_dir or default_run_dir(),
                     ready_file=args.ready_file, worker_args=worker_args, verbose=args.verbose,
                     rpc_socket=rpc_socket, rpc_socket_explicit=bool(args.rpc_socket), metrics=args.metrics,
                     persist=args.persist)
    return sup.run()
