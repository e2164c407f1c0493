"""`nvmeof-roce target serve`: the userspace target on the RDMA transport, in the foreground."""
from __future__ import annotations

import logging
import signal
import time
from typing import List, Optional

from ..errors import NvmeofError
from ..config import TargetConfig, load_config
from ..transport.resources import ResourceLimits

log = logging.getLogger(__name__)

DRAIN_SECONDS = 5.0  # how long a stop waits for in-flight commands


class TargetServer:
    """A Target plus one RDMA listener per configured port, on one event loop."""

    def __init__(self, config: TargetConfig, *, limits: Optional[ResourceLimits] = None,
                 remote_invalidate: bool = True):
        from ..transport.rdma import EventLoop, RdmaListener, require_pyverbs
        from .core import Target

        require_pyverbs()
        rdma_ports = [p for p in config.ports if p.trtype == "rdma"]
        if not rdma_ports:
            raise NvmeofError(f"{config.source}: no port with trtype 'rdma'",
                              "add a port like {\"portid\": 1, \"addr\": {\"trtype\": \"rdma\", \"adrfam\": \"ipv4\", "
                              "\"traddr\": \"10.99.0.1\", \"trsvcid\": \"4420\"}, \"subsystems\": [...]}")
        for port in config.ports:
            if port.trtype != "rdma":
                log.warning("port %d: trtype %r is not served by the userspace target (RDMA only); skipped",
                            port.portid, port.trtype)
        self.config = config
        self.limits = limits or ResourceLimits()
        self.target = Target(config, limits=self.limits)
        self.loop = EventLoop(self.target)
        self.listeners = []
        try:
            for port in rdma_ports:
                self.listeners.append(RdmaListener(
                    self.loop, port.traddr, port.trsvcid, handler=self.target.port(port.portid), port_id=port.portid,
                    max_transfer=self.target.max_transfer, limits=self.limits,
                    remote_invalidate=remote_invalidate))
        except BaseException:
            self.close()
            raise
        self.stopping = False

    def addresses(self) -> List[str]:
        return [f"{lst.traddr}:{lst.trsvcid} ({lst.device_name})" for lst in self.listeners]

    def status(self) -> str:
        """The counts an admin (or a test) checks: queues, controllers, CM ids, data buffers per port."""
        return "; ".join([self.target.status()] + [lst.status() for lst in self.listeners])

    def log_status(self, *_args) -> None:
        log.warning("status: %s", self.status())

    def request_stop(self, *_args) -> None:
        if not self.stopping:
            log.info("stop requested: finishing in-flight commands")
        self.stopping = True

    def serve(self) -> None:
        self.loop.run(lambda: self.stopping)
        # Let in-flight commands complete (or fail with a status) before the queues close.
        deadline = time.monotonic() + DRAIN_SECONDS
        while self.target.in_flight() and time.monotonic() < deadline:
            self.loop.run_once(0.05)

    def close(self) -> None:
        for listener in self.listeners:
            listener.close()
        self.listeners = []
        self.target.close()  # flushes and closes the namespaces


def serve(path: str, *, ready_file: Optional[str] = None, limits: Optional[ResourceLimits] = None,
          remote_invalidate: bool = True) -> int:
    config = load_config(path)
    server = TargetServer(config, limits=limits, remote_invalidate=remote_invalidate)
    previous = {sig: signal.signal(sig, server.request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    # SIGUSR1 logs a status line (queues, controllers, CM ids kept, free data buffers).  The handler runs
    # between two Python statements of the loop, which only reads counts here.
    previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, server.log_status)
    try:
        for sub in config.subsystems:
            log.warning("subsystem %s: %d namespace(s)%s", sub.nqn, len(sub.namespaces),
                        "" if sub.allow_any_host else f", hosts {', '.join(sub.allowed_hosts) or 'none'}")
        print(f"nvmeof-roce target: serving {config.source} on {', '.join(server.addresses())}; "
              f"{server.limits.describe()}", flush=True)
        if ready_file:
            with open(ready_file, "w") as f:
                f.write("ready\n")
        server.serve()
    finally:
        server.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.warning("status: %s", server.status())
    print("nvmeof-roce target: stopped", flush=True)
    return 0


def _cmd_serve(args) -> int:
    # Connects, disconnects and rejects are logged at INFO: show them unless the user asked for less.
    logging.getLogger("nvmeof_roce").setLevel(logging.DEBUG if args.verbose > 1 else logging.INFO)
    limits = ResourceLimits(data_buffers=args.data_buffers, queue_min_buffers=args.queue_min_buffers,
                            max_queues_per_ctrl=args.max_queues_per_ctrl, max_queues_per_host=args.max_queues_per_host,
                            max_controllers=args.max_controllers, connect_timeout=args.connect_timeout)
    return serve(args.config, ready_file=args.ready_file, limits=limits,
                 remote_invalidate=not args.no_remote_invalidate)


def register_serve(commands) -> None:
    p = commands.add_parser("serve", help="serve a target config over RDMA in the foreground",
                            description="Run the userspace NVMe-oF target on every RDMA port of CONFIG "
                                        "(default service 4420) until SIGINT/SIGTERM. In-flight commands "
                                        "complete, connections close, files are flushed.")
    p.add_argument("config", metavar="CONFIG.json")
    p.add_argument("--ready-file", metavar="PATH", help="write PATH once listening (for scripts and tests)")
    d = ResourceLimits()
    p.add_argument("--data-buffers", type=int, default=d.data_buffers, metavar="N",
                   help=f"data buffers registered at start per port, each MDTS (128 KiB) bytes, shared by the "
                        f"port's queues (default {d.data_buffers})")
    p.add_argument("--queue-min-buffers", type=int, default=d.queue_min_buffers, metavar="N",
                   help=f"data buffers guaranteed to each queue once its NVMe Connect succeeds "
                        f"(default {d.queue_min_buffers})")
    p.add_argument("--max-queues-per-ctrl", type=int, default=d.max_queues_per_ctrl, metavar="N",
                   help=f"most I/O queues Set Features Number of Queues grants one controller "
                        f"(default {d.max_queues_per_ctrl}; also capped by the subsystem's qid_max and the pool)")
    p.add_argument("--max-queues-per-host", type=int, default=d.max_queues_per_host, metavar="N",
                   help=f"most I/O queues of one host NQN over all its controllers (default {d.max_queues_per_host})")
    p.add_argument("--max-controllers", type=int, default=d.max_controllers, metavar="N",
                   help=f"most controllers, discovery included (default {d.max_controllers})")
    p.add_argument("--connect-timeout", type=float, default=d.connect_timeout, metavar="SECONDS",
                   help=f"close a connection without a successful NVMe Connect after this long "
                        f"(default {d.connect_timeout:g})")
    p.add_argument("--no-remote-invalidate", action="store_true",
                   help="answer with plain SEND even when the host's key asks for remote invalidation")
    p.set_defaults(func=_cmd_serve)
