"""`nvmeof-roce target serve`: the userspace target on the transports of its config's ports, in the foreground."""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import time
from typing import Dict, List, Optional

from ..errors import NvmeofError
from ..output import address
from ..securefile import write_file
from ..config import TargetConfig, keys, load_userspace_config
from ..engine.reservations import file_for as reservation_file_for
from ..transport import registry
from ..transport.contracts import Listener, ListenOptions, Loop, TransportSettings
from ..transport.resources import ResourceLimits
from ..tunables import CORES, POLL, POLL_SPIN_US, RESOURCE_LIMITS, TRACE
from .ops import Operations, bind_control_socket, persist_changes

log = logging.getLogger(__name__)

DRAIN_SECONDS = 5.0  # how long a stop waits for in-flight commands
CEPH_CLOSE_SECONDS = 15  # how long a stop waits for rbd images to close (a cluster gone: RBD_OP_TIMEOUT and more)
STATUS_INTERVAL = 60.0  # seconds between status lines in the log


class TargetServer:
    """A Target plus one listener per configured port its transports serve, on one event loop."""

    def __init__(self, config: TargetConfig, *, limits: Optional[ResourceLimits] = None,
                 remote_invalidate: bool = True, listen_portids: Optional[List[int]] = None,
                 file_lock: str = "exclusive", data_path: Optional[str] = None, worker: Optional[int] = None,
                 poll: str = POLL.default, cores: int = CORES.default, trace: str = TRACE.default,
                 reservation_file: Optional[str] = None, poll_spin_us: Optional[int] = None):
        from ..engine.core import Target

        served = [p for p in config.ports if registry.serves(p.trtype)]  # transport/registry.py
        if listen_portids is not None:  # a worker of `serve --workers` listens on its own ports only
            served = [p for p in served if p.portid in listen_portids]
        for trtype in sorted({p.trtype for p in served}):
            registry.get(trtype).require()
        if not served:
            trtype = registry.served_trtypes()[0]
            raise NvmeofError(f"{config.source}: no port with trtype {' or '.join(map(repr, registry.served_trtypes()))}",
                              f"add a port like {{\"portid\": 1, \"addr\": {{\"trtype\": \"{trtype}\", "
                              "\"adrfam\": \"ipv4\", \"traddr\": \"10.99.0.1\", \"trsvcid\": \"4420\"}, "
                              "\"subsystems\": [...]}")
        for port in config.ports:
            if not registry.serves(port.trtype):
                log.warning("port %d: trtype %r is not served by the userspace target (%s only); skipped",
                            port.portid, port.trtype, registry.served_labels())
        self.config = config
        self.limits = limits or ResourceLimits()
        # the I/O queues' data path: "python" or "native" (docs/native.md); None: native when it is built
        self.data_path = check_data_path(data_path, worker)
        self.data_path_reason = data_path_reason(data_path, self.data_path, worker)  # said at start and in status
        check_file_buffers(self.limits.queue_file_buffers, self.data_path)
        self.poll = check_poll(poll, self.data_path)  # how native queues find completions (tunables.POLL)
        self.cores = check_cores(cores, self.data_path, self.poll)  # poll-group threads (tunables.CORES)
        self.poll_spin_us = check_poll_spin(poll_spin_us, self.poll)  # an adaptive poll's bound (tunables.POLL_SPIN_US)
        self.trace = check_trace(trace, self.data_path)  # the native queues' per-command trace (tunables.TRACE)
        # reservations kept through power loss (engine/reservations.py), read back here
        self.target = Target(config, file_lock=file_lock, limits=self.limits, reservation_file=reservation_file)
        self.loop: Loop = registry.get(served[0].trtype).event_loop(self.target)
        self.target.attach_loop(self.loop)  # fdatasync and long commands stay off the loop
        self.next_status = time.monotonic() + STATUS_INTERVAL
        self.listeners: List[Listener] = []
        self.stopping = False
        # what each transport makes of the service's settings (its entry's opts_init: RDMA's poll-group threads
        # and trace), given to every listener of its ports, those added live too (service/ops.py)
        self.settings = TransportSettings(remote_invalidate=remote_invalidate, data_path=self.data_path,
                                          poll=self.poll, cores=self.cores, poll_spin_us=self.poll_spin_us,
                                          trace=self.trace)
        self._options: Dict[str, object] = {}
        try:
            for port in served:
                if not port.subsystems:  # it listens once a subsystem is linked to it (control/live.py, Link)
                    log.info("port %d exports no subsystem: not listening until one is linked", port.portid)
                    continue
                self.listeners.append(registry.get(port.trtype).listen(
                    self.loop, port, self.target.port(port.portid), self.listen_options(port.trtype)))
        except BaseException:
            self.close()  # a listener that failed (e.g. memory registration) leaves none behind
            raise

    def listen_options(self, trtype: str) -> ListenOptions:
        """What a listener of `trtype` is given: the engine's limits and its entry's options (made once)."""
        if trtype not in self._options:
            self._options[trtype] = registry.get(trtype).opts_init(self.settings)
        return ListenOptions(max_transfer=self.target.max_transfer, limits=self.limits,
                             transport=self._options[trtype])

    def transport_options(self) -> dict:
        """The options of the transports serving now (each entry's `dump_opts`), for `target status`."""
        merged: dict = {}
        for trtype, opts in self._options.items():
            merged.update(registry.get(trtype).dump_opts(opts))
        return merged

    def addresses(self) -> List[str]:
        return [f"{address(lst.traddr, lst.trsvcid)} ({lst.device_name})" for lst in self.listeners]

    def request_stop(self, *_args) -> None:
        if not self.stopping:
            log.info("stop requested: finishing in-flight commands")
            if self.on_stop is not None:
                self.on_stop()
        self.stopping = True

    on_stop = None  # ops.py: sd_notify STOPPING=1
    exit_code = 0  # what serve() returns: service/group.py's EXIT_FENCED when the group fenced this gateway
    should_stop_hook = None  # ops.py: runs a pending SIGHUP reload on the loop

    def status_line(self, recent: bool = True) -> str:
        """The counts an admin (or a test) checks: queues, controllers, CM ids, data buffers per port, commands
        in flight and the longest loop pass."""
        t = self.target
        longest = self.loop.longest_pass_recent if recent else self.loop.longest_pass
        # the line starts with the target's counts, which scripts and the lab tests parse; the data path after
        return ("status: " + "; ".join([t.status()] + [lst.status_line() for lst in self.listeners])
                + f"; data path {self.data_path}" + (native_poll_text(self.poll, self.cores,
                                                                      self.poll_spin_us)
                                                     if self.data_path == "native" else "")
                + f"; {t.in_flight()} command(s) in flight, longest loop pass {longest * 1000:.1f} ms"
                + (f" (last {STATUS_INTERVAL:.0f} s; {self.loop.longest_pass * 1000:.1f} ms since start)"
                   if recent else " since start"))

    def log_status(self, *_args) -> None:
        log.info("%s", self.status_line(recent=False))

    def _should_stop(self) -> bool:
        now = time.monotonic()
        if now >= self.next_status:
            log.info("%s", self.status_line())
            self.loop.longest_pass_recent = 0.0
            self.next_status = now + STATUS_INTERVAL
        return self.stopping

    def serve(self) -> None:
        self.loop.run(self.should_stop_hook(self._should_stop) if self.should_stop_hook else self._should_stop)
        # Let in-flight commands complete (or fail with a status) before the queues close.
        deadline = time.monotonic() + DRAIN_SECONDS
        while self.target.in_flight() and time.monotonic() < deadline:
            self.loop.run_once(0.05)

    def close(self) -> None:
        for listener in self.listeners:
            listener.close()
        self.listeners = []
        options, self._options = self._options, {}
        for trtype, opts in options.items():  # after the listeners: what their queues used
            registry.get(trtype).close_opts(opts)
        self.target.close()  # flushes and closes the namespaces
        if "nvmeof_roce.engine.backends.rbd" in sys.modules:  # rbd namespaces close on threads of their own
            from ..engine.backends.rbd import wait_closed
            if not wait_closed(CEPH_CLOSE_SECONDS):
                log.warning("Ceph clients still closing after %d s (a cluster that does not answer): exiting "
                            "without them", CEPH_CLOSE_SECONDS)


def serve(path: str, *, ready_file: Optional[str] = None, limits: Optional[ResourceLimits] = None,
          remote_invalidate: bool = True, worker: Optional[int] = None,
          listen_portids: Optional[List[int]] = None, path_groups: Optional[List[str]] = None,
          rpc_socket: Optional[str] = "", metrics: Optional[str] = None, persist: Optional[bool] = None,
          data_path: Optional[str] = None, poll: str = POLL.default, cores: int = CORES.default,
          trace: str = TRACE.default, poll_spin_us: Optional[int] = None, cpus: Optional[str] = None,
          resv_store: Optional[str] = None) -> int:
    config = load_userspace_config(path)  # the same loader and checks as `target check`
    member = None
    if config.group is not None:  # a gateway of a group: the group's subsystems on this file's ports
        config, member = join_group(config, path, worker)
    if worker is None:  # a worker of `serve --workers` is pinned by its supervisor
        pin_process(cpus, config)
    for warning in keys.inline_secret_warnings(config, path):
        log.warning("%s (fix: %s)", warning.message, warning.fix)
    refuse_kernel_ports(config, listen_portids)
    if worker is not None and not rpc_socket:
        rpc_socket = None  # a worker answers only on the socket its supervisor gives it (RUN_DIR/worker-I.sock)
    try:
        socket_path, bound = bind_control_socket(path, rpc_socket)
    except BaseException:
        if member is not None:
            member.close()
        raise
    try:
        server = TargetServer(config, limits=limits, remote_invalidate=remote_invalidate,
                              listen_portids=listen_portids,
                              file_lock="exclusive" if worker is None else "shared", data_path=data_path,
                              worker=worker, poll=poll, cores=cores, trace=trace, poll_spin_us=poll_spin_us,
                              reservation_file=reservation_file_for(path) if worker is None else None)
    except BaseException:
        if bound is not None:
            bound.close()
            os.unlink(socket_path)
        if member is not None:
            member.close()
        raise
    for group in path_groups or ():  # a worker: these ports are one port of the config, one per worker
        ids = [int(x) for x in group.split(",")]
        for portid in ids:
            server.target.discovery_siblings[portid] = ids
    try:
        ops = Operations(server, path, rpc_socket=socket_path if bound is not None else None, metrics=metrics,
                         bound_socket=bound, persist=persist_changes(config, persist, worker))
    except BaseException:
        server.close()
        if member is not None:
            member.close()
        raise
    if worker is not None and resv_store:  # the supervisor's reservations, before this worker serves any host
        from .worker_resv import attach_worker
        try:
            attach_worker(server.target, ops.control, resv_store, worker)
        except BaseException:
            ops.close()
            server.close()
            raise
    if member is not None:
        ops.control.group = member
        if ops.metrics is not None:
            ops.metrics.group = member
        member.attach(server, ops.control)
    server.on_stop, server.should_stop_hook = ops.stopping, ops.should_stop_hook
    previous = {sig: signal.signal(sig, server.request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    # SIGUSR1 logs a status line (queues, controllers, CM ids kept, free data buffers).  The handler runs
    # between two Python statements of the loop, which only reads counts here.
    previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, server.log_status)
    try:
        for sub in config.subsystems:
            log.info("subsystem %s: %d namespace(s)%s", sub.nqn, len(sub.namespaces),
                        "" if sub.allow_any_host else f", hosts {', '.join(sub.allowed_hosts) or 'none'}")
        print(f"nvmeof-roce target: serving {config.source} on {', '.join(server.addresses())}"
              + (f", control socket {ops.socket_path}" if ops.socket_path else "")
              + (f", metrics {ops.metrics_url}" if ops.metrics_url else "")
              + f"; {server.limits.describe()}; data path {server.data_path} ({server.data_path_reason})",
              flush=True)
        if ready_file:
            write_file(ready_file, "ready\n")
        ops.ready()
        server.serve()
    finally:
        ops.close()
        log.info("%s", server.status_line(recent=False))
        if member is not None:
            member.close()  # its leases released: a survivor takes the groups at once
        server.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("nvmeof-roce target: stopped", flush=True)
    return server.exit_code


def join_group(config: TargetConfig, path: str, worker: Optional[int]):
    """Connect to the group's cluster, join it and take the home ANA groups that are free; the config to serve
    (this file's ports with the group's subsystems) and the member (service/group.py)."""
    from .group import GroupMember
    if worker is not None:
        raise NvmeofError("a gateway of a group runs without --workers", "leave --workers out")
    member = GroupMember(config.group, config.to_dict())
    member.connect()
    try:
        merged = member.join()
        return member.parse(merged, path), member
    except BaseException:
        member.close()
        raise


def refuse_kernel_ports(config: TargetConfig, listen_portids: Optional[List[int]] = None) -> None:
    """Both targets run on one machine; only an address both want is a conflict: a port of `config` whose RDMA
    address:port a kernel target's port listens on is refused, naming that port."""
    from ..kernel.nvmet import kernel_port_holding
    for i, port in enumerate(config.ports):
        if not registry.serves(port.trtype) or (listen_portids is not None and port.portid not in listen_portids):
            continue
        held = kernel_port_holding(port.trtype, port.traddr, port.trsvcid_str)
        if held:
            raise NvmeofError(
                f"{config.source}: ports[{i}] ({port.trtype} {port.traddr}:{port.trsvcid_str}): the kernel target "
                f"(nvmet) listens there: its port {held['portid']} ({held['traddr']}:{held['trsvcid']}, "
                f"subsystems {', '.join(held['subsystems'])})",
                f"give this port another trsvcid (e.g. {int(port.trsvcid_str) + 1}) or address, or take the "
                f"kernel's port down (unlink its subsystems in {held['path']}/subsystems, or `nvmeof-roce nvmet "
                "apply` a config without it)")


DATA_PATHS = ("python", "native")


def check_data_path(data_path: Optional[str], worker: Optional[int] = None) -> str:
    """The data path asked for (None: the default), or a clear error when it cannot run here."""
    from .. import native
    if data_path is None:
        data_path = native.default_data_path(worker)
        if data_path == "python" and worker is None:
            log.warning("data path python: %s", native.missing_reason)
        return data_path
    if data_path not in DATA_PATHS:
        raise NvmeofError(f"unknown data path {data_path!r}", f"use one of: {', '.join(DATA_PATHS)}")
    if data_path == "native" and not native.available():
        raise NvmeofError(native.missing_reason or "the native data path is not built",
                          "build it (make venv), or serve with --data-path python")
    return data_path


def data_path_reason(asked: Optional[str], chosen: str, worker: Optional[int] = None) -> str:
    """Why the target runs `chosen`: said in the start line and in `target status`, never left to guess."""
    from .. import native
    if asked is not None:
        return f"--data-path {asked}"
    if chosen == "native":
        return "the native module is built: the default"
    if worker is not None:
        return "a worker of serve --workers runs the Python data path"
    return native.missing_reason or "the native module is not built"


def check_poll(poll: str, data_path: str) -> str:
    """The poll mode asked for, or a clear error: busy polling is the native data path's (never accepted and
    ignored)."""
    POLL.check_option(poll)
    if poll != POLL.default and data_path != "native":
        raise NvmeofError(f"{POLL.option} {poll} needs the native data path (the Python data path is driven by "
                          "completion events only)", f"add --data-path native, or leave {POLL.option} out")
    return poll


def check_poll_spin(spin_us: Optional[int], poll: str) -> int:
    """An adaptive poll's bound in µs (None: the default), or a clear error: it means nothing to the other modes
    (never accepted and ignored)."""
    if spin_us is None:
        return POLL_SPIN_US.default
    POLL_SPIN_US.check_option(spin_us)
    if poll != "adaptive":
        raise NvmeofError(f"{POLL_SPIN_US.option} {spin_us} bounds an adaptive poll's spin ({POLL.option} {poll} "
                          "does not spin)", f"add {POLL.option} adaptive, or leave {POLL_SPIN_US.option} out")
    return spin_us


def pin_process(cpus: Optional[str], config) -> Optional[List[int]]:
    """`serve --cpus LIST` (else the config's nvmeof_roce.cpus) without --workers: this process - its event loop
    and any poll-group threads - runs on those CPUs only (docs/native.md, "A loaded host"); every CPU of the list
    must be one it may run on.  Returns the CPUs, or None (unpinned)."""
    from ..config import parse_cpus, usable_cpus
    from .worker_configs import config_workers
    chosen = parse_cpus(cpus) if cpus else config_workers(config)[1]
    if not chosen:
        return None
    usable_cpus("--cpus", chosen)
    os.sched_setaffinity(0, set(chosen))
    log.info("serving on CPU(s) %s only (--cpus)", ",".join(map(str, sorted(set(chosen)))))
    return sorted(set(chosen))


def check_trace(trace: str, data_path: str) -> str:
    """--trace, or a clear error: it is the native data path's (the Python data path logs its own at -vv)."""
    TRACE.check_option(trace)
    if trace != TRACE.default and data_path != "native":
        raise NvmeofError(f"{TRACE.option} {trace} traces the native data path (the Python data path logs its "
                          "per-command trace at -vv without it)",
                          f"add --data-path native, or leave {TRACE.option} out")
    return trace  # the transport that traces says whether its lines are printed (its opts_init)


def check_file_buffers(queue_file_buffers: int, data_path: str) -> None:
    """--queue-file-buffers sizes the native queues' bounce chunks: refused (never accepted and ignored) on the
    Python data path, whose file commands use the port's data buffers."""
    option = RESOURCE_LIMITS["queue_file_buffers"]
    if queue_file_buffers != option.default and data_path != "native":
        raise NvmeofError(f"{option.option} {queue_file_buffers} sizes the native data path's bounce buffers (the "
                          "Python data path's file commands use the port's --data-buffers)",
                          f"add --data-path native, or leave {option.option} out")


def native_poll_text(poll: str, cores: int, spin_us: int = POLL_SPIN_US.default) -> str:
    """How the native queues are polled, for the status line: " (busy poll, 2 poll-group threads)",
    " (adaptive poll, spin 200 µs)"."""
    return (f" ({poll} poll" + (f", {cores} poll-group threads" if cores > 1 else "")
            + (f", spin {spin_us} µs" if poll == "adaptive" else "") + ")")


def check_cores(cores: int, data_path: str, poll: str) -> int:
    """The number of poll-group threads, or a clear error: they poll native queues, continuously, one per CPU at
    most."""
    CORES.check_option(cores)
    if cores == 1:
        return cores
    if data_path != "native" or poll != "busy":
        raise NvmeofError(f"{CORES.option} {cores} needs the native data path with busy polling (poll-group "
                          "threads poll native queues continuously)",
                          f"add --data-path native --poll busy, or leave {CORES.option} out")
    cpus = len(os.sched_getaffinity(0))
    if cores > cpus:
        raise NvmeofError(f"{CORES.option} {cores}: this process may run on {cpus} CPU(s) only",
                          f"use {CORES.option} {cpus} or fewer (each thread keeps one CPU busy)")
    return cores


def limits_from_args(args) -> ResourceLimits:
    return ResourceLimits(**{name: getattr(args, name) for name in RESOURCE_LIMITS})


def _cmd_serve(args) -> int:
    from .workers import workers_requested, supervise
    # A crash inside pyverbs or a provider (SIGSEGV, SIGABRT) leaves the Python stack on stderr (the journal
    # under systemd) instead of only an exit status.
    faulthandler.enable()
    if workers_requested(args) is not None:
        if args.data_path == "native":
            raise NvmeofError("--data-path native is not available with --workers yet",
                              "leave --workers out, or serve with --data-path python")
        check_poll(args.poll, args.data_path or "python")  # workers run the Python path
        check_file_buffers(args.queue_file_buffers, args.data_path or "python")
        check_cores(args.cores, args.data_path or "python", args.poll)
        check_poll_spin(args.poll_spin_us, args.poll)
        check_trace(args.trace, args.data_path or "python")
        return supervise(args)
    # Connects, disconnects and rejects are logged at INFO: show them unless the user asked for less.
    logging.getLogger("nvmeof_roce").setLevel(logging.DEBUG if args.verbose > 1 else logging.INFO)
    return serve(args.config, ready_file=args.ready_file, limits=limits_from_args(args),
                 remote_invalidate=not args.no_remote_invalidate, worker=args.worker_index,
                 listen_portids=args.listen_port, path_groups=args.path_group,
                 rpc_socket=None if args.no_rpc_socket else (args.rpc_socket or ""), metrics=args.metrics,
                 persist=args.persist, data_path=args.data_path, poll=args.poll, cores=args.cores,
                 trace=args.trace, poll_spin_us=args.poll_spin_us, cpus=args.cpus, resv_store=args.resv_store)


def register_serve(commands) -> None:
    p = commands.add_parser("serve", help="serve a target config over RDMA in the foreground",
                            description="Run the userspace NVMe-oF target on every RDMA port of CONFIG "
                                        "(default service 4420) until SIGINT/SIGTERM. In-flight commands "
                                        "complete, connections close, files are flushed. SIGHUP re-reads "
                                        "CONFIG and applies the differences; the control socket takes "
                                        "live changes (nvmeof-roce rpc, target add-ns ...); under systemd "
                                        "(Type=notify) it reports READY/STATUS/STOPPING. SIGUSR1 logs a status "
                                        "line.")
    p.add_argument("config", metavar="CONFIG.json")
    p.add_argument("--ready-file", metavar="PATH", help="write PATH once listening (for scripts and tests)")
    for t in RESOURCE_LIMITS.values():
        p.add_argument(t.option, type=t.type, default=t.default, metavar=t.metavar,
                       help=f"{t.help} (default {t.default:g})")
    p.add_argument("--data-path", choices=DATA_PATHS, default=None,
                   help="who does the I/O queues' per-command work: the C data path of nvmeof_roce._native "
                        "(native, the default when the module is built: Read/Write/Flush of RAM and null "
                        "namespaces in C, everything else in Python) or the Python target core (python, the "
                        "reference; the default with --workers); docs/native.md")
    p.add_argument(POLL.option, choices=POLL.choices, default=POLL.default,
                   help=f"{POLL.help} (default {POLL.default})")
    p.add_argument(POLL_SPIN_US.option, type=POLL_SPIN_US.type, default=None, metavar=POLL_SPIN_US.metavar,
                   help=f"{POLL_SPIN_US.help} (default {POLL_SPIN_US.default:g})")
    p.add_argument(CORES.option, type=CORES.type, default=CORES.default, metavar=CORES.metavar,
                   help=f"{CORES.help} (default {CORES.default:g})")
    p.add_argument(TRACE.option, choices=TRACE.choices, default=TRACE.default,
                   help=f"{TRACE.help} (default {TRACE.default})")
    p.add_argument("--no-remote-invalidate", action="store_true",
                   help="answer with plain SEND even when the host's key asks for remote invalidation")
    p.add_argument("--rpc-socket", metavar="PATH",
                   help="the JSON-RPC control socket (default /run/nvmeof-roce/NAME.sock for NAME.json; mode 0600)")
    p.add_argument("--no-rpc-socket", action="store_true", help="serve without a control socket")
    keep = p.add_mutually_exclusive_group()
    keep.add_argument("--persist", dest="persist", action="store_true", default=None,
                      help="write every accepted live change (RPC or target add-ns/add-host/...) to CONFIG, "
                           "atomically, so a restart keeps it (default: the config's nvmeof_roce.persist; the "
                           "systemd unit passes --persist)")
    keep.add_argument("--no-persist", dest="persist", action="store_false",
                      help="keep live changes in memory only, whatever the config says")
    p.add_argument("--metrics", metavar="ADDR:PORT",
                   help="serve Prometheus metrics on ADDR:PORT (ADDR defaults to 127.0.0.1: ':9712')")
    from .workers import add_worker_arguments
    add_worker_arguments(p)
    p.set_defaults(func=_cmd_serve)
