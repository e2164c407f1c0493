"""`nvmeof-roce target serve`: the userspace target on the RDMA transport, in the foreground."""
from __future__ import annotations

import logging
import os
import signal
import time
from typing import List, Optional

from ..errors import NvmeofError
from ..config import TargetConfig, load_config
from .ops import Operations, bind_control_socket

log = logging.getLogger(__name__)

DRAIN_SECONDS = 5.0  # how long a stop waits for in-flight commands


class TargetServer:
    """A Target plus one RDMA listener per configured port, on one event loop."""

    def __init__(self, config: TargetConfig, *, data_chunks: int = 512, remote_invalidate: bool = True):
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
        self.data_chunks, self.remote_invalidate = data_chunks, remote_invalidate  # for ports added live
        self.target = Target(config)
        self.loop = EventLoop(self.target)
        self.listeners = []
        try:
            for port in rdma_ports:
                self.listeners.append(RdmaListener(
                    self.loop, port.traddr, port.trsvcid, handler=self.target.port(port.portid), port_id=port.portid,
                    max_transfer=self.target.max_transfer, data_chunks=data_chunks,
                    remote_invalidate=remote_invalidate))
        except BaseException:
            self.close()
            raise
        self.stopping = False

    def addresses(self) -> List[str]:
        return [f"{lst.traddr}:{lst.trsvcid} ({lst.device_name})" for lst in self.listeners]

    def request_stop(self, *_args) -> None:
        if not self.stopping:
            log.info("stop requested: finishing in-flight commands")
            if self.on_stop is not None:
                self.on_stop()
        self.stopping = True

    on_stop = None  # ops.py: sd_notify STOPPING=1
    should_stop_hook = None  # ops.py: runs a pending SIGHUP reload on the loop

    def serve(self) -> None:
        should_stop = lambda: self.stopping  # noqa: E731
        self.loop.run(self.should_stop_hook(should_stop) if self.should_stop_hook else should_stop)
        # Let in-flight commands complete (or fail with a status) before the queues close.
        deadline = time.monotonic() + DRAIN_SECONDS
        while self.target.in_flight() and time.monotonic() < deadline:
            self.loop.run_once(0.05)

    def close(self) -> None:
        for listener in self.listeners:
            listener.close()
        self.listeners = []
        self.target.close()  # flushes and closes the namespaces


def serve(path: str, *, ready_file: Optional[str] = None, data_chunks: int = 512,
          remote_invalidate: bool = True, rpc_socket: Optional[str] = "", metrics: Optional[str] = None) -> int:
    config = load_config(path)
    socket_path, bound = bind_control_socket(path, rpc_socket)
    try:
        server = TargetServer(config, data_chunks=data_chunks, remote_invalidate=remote_invalidate)
    except BaseException:
        if bound is not None:
            bound.close()
            os.unlink(socket_path)
        raise
    try:
        ops = Operations(server, path, rpc_socket=socket_path if bound is not None else None, metrics=metrics,
                         bound_socket=bound)
    except BaseException:
        server.close()
        raise
    server.on_stop, server.should_stop_hook = ops.stopping, ops.should_stop_hook
    previous = {sig: signal.signal(sig, server.request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for sub in config.subsystems:
            log.warning("subsystem %s: %d namespace(s)%s", sub.nqn, len(sub.namespaces),
                        "" if sub.allow_any_host else f", hosts {', '.join(sub.allowed_hosts) or 'none'}")
        print(f"nvmeof-roce target: serving {config.source} on {', '.join(server.addresses())}"
              + (f", control socket {ops.socket_path}" if ops.socket_path else "")
              + (f", metrics {ops.metrics_url}" if ops.metrics_url else ""), flush=True)
        if ready_file:
            with open(ready_file, "w") as f:
                f.write("ready\n")
        ops.ready()
        server.serve()
    finally:
        ops.close()
        server.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("nvmeof-roce target: stopped", flush=True)
    return 0


def _cmd_serve(args) -> int:
    # Connects, disconnects and rejects are logged at INFO: show them unless the user asked for less.
    logging.getLogger("nvmeof_roce").setLevel(logging.DEBUG if args.verbose > 1 else logging.INFO)
    return serve(args.config, ready_file=args.ready_file, data_chunks=args.data_buffers,
                 remote_invalidate=not args.no_remote_invalidate,
                 rpc_socket=None if args.no_rpc_socket else (args.rpc_socket or ""), metrics=args.metrics)


def register_serve(commands) -> None:
    p = commands.add_parser("serve", help="serve a target config over RDMA in the foreground",
                            description="Run the userspace NVMe-oF target on every RDMA port of CONFIG "
                                        "(default service 4420) until SIGINT/SIGTERM. In-flight commands "
                                        "complete, connections close, files are flushed. SIGHUP re-reads "
                                        "CONFIG and applies the differences; the control socket takes "
                                        "live changes (nvmeof-roce rpc, target add-ns ...); under systemd "
                                        "(Type=notify) it reports READY/STATUS/STOPPING.")
    p.add_argument("config", metavar="CONFIG.json")
    p.add_argument("--ready-file", metavar="PATH", help="write PATH once listening (for scripts and tests)")
    p.add_argument("--data-buffers", type=int, default=512, metavar="N",
                   help="data buffers registered at start, per port, each MDTS bytes (default 512)")
    p.add_argument("--no-remote-invalidate", action="store_true",
                   help="answer with plain SEND even when the host's key asks for remote invalidation")
    p.add_argument("--rpc-socket", metavar="PATH",
                   help="the JSON-RPC control socket (default /run/nvmeof-roce/NAME.sock for NAME.json; mode 0600)")
    p.add_argument("--no-rpc-socket", action="store_true", help="serve without a control socket")
    p.add_argument("--metrics", metavar="ADDR:PORT",
                   help="serve Prometheus metrics on ADDR:PORT (ADDR defaults to 127.0.0.1: ':9712')")
    p.set_defaults(func=_cmd_serve)
