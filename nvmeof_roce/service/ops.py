"""Operations around `target serve`: the control socket, SIGHUP reload, metrics and sd_notify.

`Operations(server, ...)` attaches them to a running `TargetServer` (serve.py) and keeps serve.py small:

    ops = Operations(server, config_path, rpc_socket=..., metrics=...)
    ops.ready()            # sd_notify READY=1 + STATUS=, once the listeners and the socket are up
    loop.run(ops.should_stop_hook(server.should_stop))   # a pending SIGHUP reload runs on the loop
    ops.stopping()         # STOPPING=1
    ops.close()
"""
from __future__ import annotations

import logging
import signal
from typing import Callable, Optional

from ..control import live
from ..config import ConfigError
from ..errors import NvmeofError
from ..transport import registry
from ..control.methods import Control
from ..control.protocol import RpcError, default_socket_path
from ..control.server import RpcServer, SocketInUse, bind_unix_socket
from .metrics import Metrics
from .sdnotify import notify

log = logging.getLogger(__name__)


class ServiceControl(Control):
    """The RPC methods of a serving process: Control's, plus its metrics as Prometheus text (the supervisor
    of `serve --workers` serves every worker's through one endpoint)."""

    def __init__(self, *args, metrics: Callable[[], "Metrics"], **kwargs):
        self._metrics = metrics
        super().__init__(*args, **kwargs)

    def rpc_nvmeof_get_metrics(self, params) -> str:
        if params:
            raise RpcError("nvmeof_get_metrics takes no parameters", "params", "call it without parameters")
        return self._metrics().text()


class ServedListeners(live.Listeners):
    """Opens a listener for a port added while the target runs (nvmf_subsystem_add_listener, reload)."""

    def __init__(self, server):
        self.server = server

    def open(self, target, port):
        if not registry.serves(port.trtype):
            served = " or ".join('"trtype": "%s"' % t for t in registry.served_trtypes())
            raise ConfigError("", f"port {port.portid}", f"trtype {port.trtype!r} is not served by the "
                              "userspace target", f"use {served}")
        listener = registry.get(port.trtype).listen(self.server.loop, port, target.port(port.portid),
                                                    self.server.listen_options(port.trtype))
        self.server.listeners.append(listener)

    def close(self, portid):
        for listener in [x for x in self.server.listeners if x.port_id == portid]:
            self.server.listeners.remove(listener)
            listener.close()


def bind_control_socket(config_path: str, rpc_socket: Optional[str]):
    """Bind the control socket first, so a second target for the same socket stops before touching RDMA.

    An explicit --rpc-socket that cannot be bound is an error; the default one (under /run/nvmeof-roce) is
    left out with a warning when its directory cannot be used (not root, read-only /run): the target serves
    without live control rather than not at all."""
    if rpc_socket is None:
        return None, None
    path = rpc_socket or default_socket_path(config_path)
    try:
        return path, bind_unix_socket(path)
    except SocketInUse:
        raise
    except NvmeofError as exc:
        if rpc_socket:
            raise
        log.warning("serving without a control socket: %s (fix: %s)", exc.message, exc.fix)
        return None, None


def persist_changes(config, option: Optional[bool], worker: Optional[int] = None) -> bool:
    """Whether live changes are written to the config file: --persist / --no-persist, else the config's
    nvmeof_roce.persist.  A worker of `serve --workers` never writes: its config is derived, its supervisor
    writes CONFIG once per change.  A gateway of a group never writes either: the group's state in RADOS is
    what keeps its changes (docs/gateway-group.md)."""
    if worker is not None:
        return False
    if config.group is not None:
        if option:
            log.warning("--persist: a gateway of a group keeps its changes in the group (RADOS), not in %s",
                        config.source)
        return False
    return bool(config.settings.persist) if option is None else option


class Operations:
    def __init__(self, server, config_path: str, rpc_socket: Optional[str] = "", metrics: Optional[str] = None,
                 bound_socket=None, persist: bool = False):
        self.server = server
        self.target = server.target
        self.config_path = config_path
        self.control = ServiceControl(self.target, ServedListeners(server), config_path=config_path, server=server,
                                      metrics=self._metrics, persist=persist)
        self.rpc = None
        self.metrics = None
        self.metrics_url = ""
        self._reload_pending = False
        self._previous_hup = None  # SIGHUP's handler before ours, set once the rest is up (close() restores it)
        try:
            if rpc_socket is not None:
                self.rpc = RpcServer(self.control, rpc_socket or default_socket_path(config_path), server.loop,
                                     sock=bound_socket)
            if metrics:
                self.metrics = Metrics(self.target, server)
                self.metrics_url = self.metrics.start(metrics)
        except BaseException:
            self.close()
            raise
        self._previous_hup = signal.signal(signal.SIGHUP, self._on_sighup)

    def _metrics(self) -> Metrics:
        """The metrics, started on first use when --metrics did not start them (a worker's supervisor asks)."""
        if self.metrics is None:
            self.metrics = Metrics(self.target, self.server)
        return self.metrics

    @property
    def socket_path(self) -> str:
        return self.rpc.path if self.rpc else ""

    def _on_sighup(self, *_args) -> None:
        self._reload_pending = True  # the reload itself runs on the loop, between two passes

    def should_stop_hook(self, should_stop: Callable[[], bool]) -> Callable[[], bool]:
        def check() -> bool:
            if self._reload_pending:
                self._reload_pending = False
                self.reload()
            return should_stop()
        return check

    def reload(self) -> dict:
        """Re-read the config file and apply the difference; an invalid file changes nothing."""
        log.info("SIGHUP: reloading %s", self.config_path)
        notify("RELOADING=1", "STATUS=reloading")
        try:
            result = self.control.reload(self.config_path)
        except RpcError as exc:
            log.error("reload refused, the target is unchanged: %s: %s (fix: %s)", exc.field, exc.message, exc.fix)
            notify("READY=1", f"STATUS=reload refused: {exc.field}: {exc.message}")
            return {"applied": False, "error": exc.to_dict()}
        if not result["changes"]:
            log.info("reload: no differences")
        notify("READY=1", f"STATUS={self.status_line()}")
        return result

    def status_line(self) -> str:
        t = self.target
        return (f"serving {len(t.subsystems)} subsystem(s), {sum(len(s.controllers) for s in t.subsystems.values())} "
                f"controller(s) on {', '.join(self.server.addresses())}")

    def ready(self) -> None:
        notify("READY=1", f"STATUS={self.status_line()}")

    def stopping(self) -> None:
        notify("STOPPING=1", "STATUS=stopping: finishing in-flight commands")

    def close(self) -> None:
        if self._previous_hup is not None:
            signal.signal(signal.SIGHUP, self._previous_hup)
            self._previous_hup = None
        if self.rpc is not None:
            self.rpc.close()
            self.rpc = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
