"""`target serve --workers N`: one subsystem served by N processes, one RDMA listener each (docs/multipath.md).

A Python process uses one core, and an RDMA connection cannot move between processes; the Linux host spreads
I/O over several controllers of one subsystem itself (native NVMe multipath, steered by ANA).  So the
supervisor runs N workers that each serve the same subsystems on their own port.  This module is the
supervisor; the workers' configs are derived in worker_configs.py (ports trsvcid + i, split CNTLID ranges, RAM
namespaces in one shared file) and its control socket answers from every worker in control/fanout.py.

- a worker that dies is restarted (from its running config, live changes included); SIGTERM/SIGINT stop all
  workers, which drain their commands;
- the supervisor owns the control socket: a call is answered from every worker, a change (ANA states through
  nvmf_subsystem_listener_set_ana_state, as `target ana-state` makes them, included) is made on every worker
  in turn, and `nvmeof_reload_config` (SIGHUP, `target reload`, the unit's ExecReload) re-derives the
  workers' configs from CONFIG, checks them on every worker (dry run) and then applies them on every worker,
  answering only when all have; `--metrics` serves every worker's figures with a `worker` label (each worker
  hands its own over its socket, RUN_DIR/worker-I.sock);
- NVMe reservations are kept by the supervisor for every worker (worker_resv.py: RUN_DIR/reservations.sock,
  each change in force on every worker before it is answered);
- under systemd (Type=notify) the supervisor alone notifies: READY=1 once every worker listens, RELOADING=1
  and READY=1 around a reload, STOPPING=1; the workers do not see $NOTIFY_SOCKET.

Config: a top-level ``"nvmeof_roce": {"workers": 2, "cpus": [0, 1]}``, or ``--workers`` / ``--cpus``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

from ..config import USERSPACE_KEY, ConfigError, TargetConfig, load_userspace_config, parse_config, parse_cpus
from ..config.model import reserving_namespaces
from ..control.client import call as rpc_call
from ..control.fanout import ControlSocket, SupervisorControl
from ..control.protocol import RpcError
from ..control.server import bind_unix_socket
from ..engine.ana import AnaTable
from ..errors import NvmeofError
from ..securefile import write_file
from ..tunables import RESOURCE_LIMITS, WORKERS
from . import run_dir as run_directory
from .sdnotify import notify
from .worker_resv import SOCKET as RESV_SOCKET
from .worker_resv import BoardServer, ReservationBoard, refuse_kept_reservations
from .worker_configs import config_from_worker, config_workers, create_shared_files, worker_configs

log = logging.getLogger(__name__)

MAX_WORKERS = WORKERS.high
RESTART_DELAY = 0.5       # seconds before a dead worker is started again
RESTART_DELAY_MAX = 10.0  # a worker that keeps dying at start is retried at most this often
STOP_TIMEOUT = 15.0       # after SIGTERM, how long workers get to drain before SIGKILL
READY_TIMEOUT = 120.0
WORKER_RPC_TIMEOUT = 60.0  # one forwarded call to one worker


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=WORKERS.type, metavar=WORKERS.metavar, help=WORKERS.help)
    p.add_argument("--cpus", metavar="LIST", help="pin worker i to CPU LIST[i %% len] (e.g. 0,1); without "
                                                  "--workers, the process to the CPUs of LIST; default: the "
                                                  "config's nvmeof_roce.cpus, else unpinned")
    p.add_argument("--run-dir", metavar="DIR",
                   help="where serve --workers keeps its pid and the workers' configs and sockets "
                        "(default /run/nvmeof-roce as root)")
    # set by the supervisor for its workers
    p.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)
    p.add_argument("--listen-port", type=int, action="append", help=argparse.SUPPRESS)
    p.add_argument("--path-group", action="append", help=argparse.SUPPRESS)
    p.add_argument("--resv-store", help=argparse.SUPPRESS)  # the supervisor's reservation store (worker_resv.py)


def workers_requested(args) -> Optional[int]:
    """The worker count when serve should supervise workers, else None (one process, or a worker itself)."""
    if args.worker_index is not None:
        return None
    if args.workers is not None:
        if not WORKERS.in_range(args.workers):
            raise NvmeofError(f"--workers {args.workers}: must be {WORKERS.range_text}", "e.g. --workers 2")
        return args.workers
    workers, _ = config_workers(load_userspace_config(args.config))
    return workers


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
        _, config_cpus = config_workers(self.config)
        self.n = n
        self.cpus = cpus if cpus is not None else config_cpus
        self.run_dir = run_dir
        self.ready_file = ready_file
        self.worker_args = worker_args
        self.verbose = verbose
        self.rpc_socket = rpc_socket
        self.rpc_socket_explicit = rpc_socket_explicit
        self.metrics_listen = metrics
        run_directory.private_directory(run_dir)  # the workers' configs hold the hosts' keys
        configs = self._derive(self.config)
        self.paths = [os.path.join(run_dir, f"worker-{i}.json") for i in range(n)]
        for path, c in zip(self.paths, configs):
            _write_json(path, c)
        self.sockets = [os.path.join(run_dir, f"worker-{i}.sock") for i in range(n)]
        AnaTable(parse_config(configs[0], config_path))  # a namespace's undefined ANA group, refused once here
        self.procs: List[Optional[subprocess.Popen]] = [None] * n
        self.started_at = [0.0] * n
        self.delay = [RESTART_DELAY] * n
        self.restart_at: Dict[int, float] = {}
        self.restarts = [0] * n
        self.stopping = False
        self.reload_pending = False
        self.shm_files: List[str] = []
        # The workers' reservations: kept here, every change in force on every worker before it is answered
        refuse_kept_reservations(config_path)
        self.resv = ReservationBoard(self._call_worker_within, self._fence)
        self.resv_socket = os.path.join(run_dir, RESV_SOCKET)
        self.resv_server: Optional[BoardServer] = None
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

    def _call_worker_within(self, i: int, method: str, params: Any, timeout: float) -> Any:
        return rpc_call(self.sockets[i], method, params, timeout=timeout)

    def _fence(self, i: int, timeout: float) -> bool:
        """Kill worker i (it did not take a reservation change): True once it is gone.  The watch restarts it."""
        proc = self.procs[i]
        if proc is None:
            return True
        proc.kill()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.error("worker %d (pid %d) killed but not gone after %.1f s", i, proc.pid, timeout)
            return False
        return True

    def serve_reservations(self) -> None:
        """The workers' reservation store on RUN_DIR/reservations.sock (threads of its own)."""
        self.resv_server = BoardServer(self.resv, self.resv_socket)

    def _keep_running(self, i: int) -> None:
        """After a live change: worker i's running config becomes what it starts from if it dies; the
        reservation records of namespaces gone (or without reservations now) are forgotten."""
        try:
            running = self.call_worker(i, "save_config")
            if i == 0:
                self.resv.keep_only(reserving_namespaces(running))
            _write_json(self.paths[i], running)
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
            why = (exc.strerror if isinstance(exc, OSError) else exc.message) or str(exc)
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
            workers, _ = config_workers(new)
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
            problem, where = (exc.problem, exc.where) if isinstance(exc, ConfigError) else (None, "")
            raise RpcError(problem or exc.message, where or "path", exc.fix) from None
        if (self.listen, self.groups) != saved:
            self.listen, self.groups = saved
            raise RpcError("the reload changes the ports the workers listen on", "ports",
                           "restart the target to add or remove an RDMA port under serve --workers")
        pending = [f"{p}.reload" for p in self.paths]
        answers = []
        try:
            for i, c in enumerate(configs):
                _write_json(pending[i], c)
            self.shm_files += create_shared_files(new, self.run_dir, keep_existing=True)
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
        changes = answers[0]["changes"] if answers else []
        if not dry_run:
            self.config, self.config_path = new, path
            renewed = {(c.get("nqn"), c.get("nsid")) for c in changes
                       if c.get("action") in ("add-namespace", "remove-namespace", "replace-namespace")}
            self.resv.keep_only(reserving_namespaces(new.to_dict()), renewed)
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
            "target", "serve", self.paths[i], "--worker-index", str(i),
            "--ready-file", self._ready(i), "--rpc-socket", self.sockets[i],
            "--resv-store", self.resv_socket] + self.worker_args
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

    def run(self) -> int:
        # The control socket first: a second supervisor for the same socket stops before starting workers.
        control = self._bind_control()
        try:
            run_directory.claim(self.run_dir)
        except BaseException:
            if control is not None:
                _close_socket(control.sock, self.rpc_socket)
            raise
        previous = {sig: signal.signal(sig, self._on_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, self._on_hup)
        selector = selectors.DefaultSelector()
        try:
            self.shm_files = create_shared_files(self.config, self.run_dir)
            self.serve_reservations()
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
            if self.resv_server is not None:
                self.resv_server.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for path in self.shm_files:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            run_directory.release(self.run_dir)
        print("nvmeof-roce target: stopped", flush=True)
        return 0

    def _bind_control(self) -> Optional[ControlSocket]:
        """As one process does: an explicit --rpc-socket must bind; the default one is left out with a warning
        when its directory cannot be used (not root), and another live target on it stops this one."""
        if not self.rpc_socket:
            return None
        from ..control.server import SocketInUse
        try:
            return ControlSocket(bind_unix_socket(self.rpc_socket), self.control.call)
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
            self.resv.detach(i)
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
    from ..transport import registry
    from ..control.protocol import default_socket_path
    for trtype in registry.served_trtypes():  # one clear error here rather than one per worker
        registry.get(trtype).require()
    n = workers_requested(args)
    cpus = parse_cpus(args.cpus) if args.cpus else None
    worker_args = []
    for t in RESOURCE_LIMITS.values():  # each worker gets the same resource limits
        worker_args += [t.option, str(getattr(args, t.name))]
    if args.no_remote_invalidate:
        worker_args.append("--no-remote-invalidate")
    logging.getLogger("nvmeof_roce").setLevel(logging.DEBUG if args.verbose > 1 else logging.INFO)
    rpc_socket = None if args.no_rpc_socket else (args.rpc_socket or default_socket_path(args.config))
    sup = Supervisor(args.config, n, cpus=cpus, run_dir=args.run_dir or run_directory.default_run_dir(),
                     ready_file=args.ready_file, worker_args=worker_args, verbose=args.verbose,
                     rpc_socket=rpc_socket, rpc_socket_explicit=bool(args.rpc_socket), metrics=args.metrics,
                     persist=args.persist)
    return sup.run()
