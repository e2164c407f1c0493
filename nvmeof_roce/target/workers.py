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
- ANA states are per port (target/ana.py); `target ana-state` changes them in every worker (ana_control.py);
- a worker that dies is restarted; SIGTERM/SIGINT stop all workers, which drain their commands.

Config: a top-level ``"nvmeof_roce": {"workers": 2, "cpus": [0, 1]}``, or ``--workers`` / ``--cpus``.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

from ..config import USERSPACE_KEY, ConfigError, TargetConfig, load_userspace_config, parse_config
from ..errors import NvmeofError
from ..nvme.fabrics import MAX_CNTLID, MIN_CNTLID
from .ana import AnaTable
from .ana_control import default_run_dir, publish, unpublish
from .backends import open_backend

log = logging.getLogger(__name__)

MAX_WORKERS = 64
SHM_DIR = "/dev/shm"
RESTART_DELAY = 0.5       # seconds before a dead worker is started again
RESTART_DELAY_MAX = 10.0  # a worker that keeps dying at start is retried at most this often
STOP_TIMEOUT = 15.0       # after SIGTERM, how long workers get to drain before SIGKILL
READY_TIMEOUT = 120.0


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, metavar="N",
                   help="serve with N worker processes, one RDMA listener each on trsvcid+i (default: the "
                        "config's nvmeof_roce.workers, else one process)")
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
                                or not 1 <= workers <= MAX_WORKERS):
        raise ConfigError(config.source, f"{USERSPACE_KEY}.workers", f"must be an integer 1..{MAX_WORKERS}, "
                          f"got {workers!r}", "give the number of worker processes, e.g. 2")
    cpus = us.get("cpus")
    if cpus is not None and (not isinstance(cpus, list) or not cpus
                             or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in cpus)):
        raise ConfigError(config.source, f"{USERSPACE_KEY}.cpus", f"must be a list of CPU numbers, got {cpus!r}",
                          'e.g. "cpus": [0, 1]')
    return workers, cpus


def parse_cpus(text: str) -> List[int]:
    try:
        cpus = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        cpus = []
    if not cpus or any(c < 0 for c in cpus):
        raise NvmeofError(f"--cpus {text!r}: not a list of CPU numbers", "e.g. --cpus 0,1")
    return cpus


def workers_requested(args) -> Optional[int]:
    """The worker count when serve should supervise workers, else None (one process, or a worker itself)."""
    if args.worker_index is not None:
        return None
    if args.workers is not None:
        if not 1 <= args.workers <= MAX_WORKERS:
            raise NvmeofError(f"--workers {args.workers}: must be 1..{MAX_WORKERS}", "e.g. --workers 2")
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
    rdma = [p for p in base["ports"] if p.get("addr", {}).get("trtype", "rdma") == "rdma"]
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


def _create_shm(config: TargetConfig, run_dir: str) -> List[str]:
    """Create the shared RAM files (returned, to remove at stop) and any file namespace the config asks to
    create: here, once, rather than by N workers racing to create it."""
    created = []
    for s in config.subsystems:
        for ns in s.namespaces:
            if ns.backend == "file" and ns.enabled and ns.path and not os.path.exists(ns.path):
                open_backend(ns).close()
            if ns.backend == "ram" and ns.enabled:
                path = shm_path(run_dir, s.nqn, ns.nsid)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    os.ftruncate(fd, ns.size_bytes)
                finally:
                    os.close(fd)
                created.append(path)
    return created


class Supervisor:
    """Starts, watches and restarts the workers; stops them all on SIGTERM/SIGINT."""

    def __init__(self, config_path: str, n: int, *, cpus: Optional[List[int]], run_dir: str,
                 ready_file: Optional[str], worker_args: List[str], verbose: int = 0):
        self.config = load_userspace_config(config_path)
        _, config_cpus = _config_workers(self.config)
        self.n = n
        self.cpus = cpus if cpus is not None else config_cpus
        self.run_dir = run_dir
        self.ready_file = ready_file
        self.worker_args = worker_args
        self.verbose = verbose
        os.makedirs(run_dir, exist_ok=True)
        try:
            configs, self.listen, self.groups = worker_configs(self.config, n, run_dir)
        except ValueError as exc:
            raise NvmeofError(f"{self.config.source}: {exc}", "widen cntlid_min..cntlid_max or use fewer workers")
        self.paths = []
        for i, c in enumerate(configs):
            parse_config(c, f"{config_path} (worker {i})")  # a clash (e.g. trsvcid+i taken) fails here, named
            path = os.path.join(run_dir, f"worker-{i}.json")
            with open(path, "w") as f:
                json.dump(c, f, indent=1)
            self.paths.append(path)
        self.table = AnaTable(parse_config(configs[0], config_path))
        self.procs: List[Optional[subprocess.Popen]] = [None] * n
        self.started_at = [0.0] * n
        self.delay = [RESTART_DELAY] * n
        self.restart_at: Dict[int, float] = {}
        self.restarts = [0] * n
        self.stopping = False
        self.shm_files: List[str] = []

    def _spawn(self, i: int) -> None:
        cmd = [sys.executable, "-m", "nvmeof_roce"] + ["-v"] * self.verbose + [
            "target", "serve", self.paths[i], "--worker-index", str(i), "--run-dir", self.run_dir,
            "--ready-file", self._ready(i)] + self.worker_args
        for portid in self.listen[i]:
            cmd += ["--listen-port", str(portid)]
        for group in self.groups:
            cmd += ["--path-group", ",".join(map(str, group))]
        cpu = self.cpus[i % len(self.cpus)] if self.cpus else None
        preexec = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
        with_ready = self._ready(i)
        if os.path.exists(with_ready):
            os.unlink(with_ready)
        self.procs[i] = subprocess.Popen(cmd, preexec_fn=preexec)
        self.started_at[i] = time.monotonic()
        log.warning("worker %d: pid %d, ports %s%s", i, self.procs[i].pid,
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
        publish(self.run_dir, self.table, workers=self.n)
        previous = {sig: signal.signal(sig, self._on_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        previous[signal.SIGUSR2] = signal.signal(signal.SIGUSR2, self._on_usr2)
        try:
            self.shm_files = _create_shm(self.config, self.run_dir)
            for i in range(self.n):
                self._spawn(i)
            self._wait_ready()
            print(f"nvmeof-roce target: {self.n} workers serving {self.config.source}", flush=True)
            if self.ready_file:
                with open(self.ready_file, "w") as f:
                    f.write("ready\n")
            while not self.stopping:
                self._watch()
                time.sleep(0.1)
        finally:
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


def supervise(args) -> int:
    from ..transport.rdma import require_pyverbs
    require_pyverbs()  # one clear error here rather than one per worker
    n = workers_requested(args)
    cpus = parse_cpus(args.cpus) if args.cpus else None
    from .serve import LIMIT_OPTIONS
    worker_args = []
    for name in LIMIT_OPTIONS:  # each worker gets the same resource limits
        worker_args += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    if args.no_remote_invalidate:
        worker_args.append("--no-remote-invalidate")
    logging.getLogger("nvmeof_roce").setLevel(logging.DEBUG if args.verbose > 1 else logging.INFO)
    sup = Supervisor(args.config, n, cpus=cpus, run_dir=args.run_dir or default_run_dir(),
                     ready_file=args.ready_file, worker_args=worker_args, verbose=args.verbose)
    return sup.run()
