"""The control socket's methods: what a running userspace target answers over JSON-RPC 2.0.

Method and parameter names are SPDK's (`scripts/rpc.py nvmf_*`) where SPDK has the operation, so an SPDK user
recognises them; the few of our own are named `nvmf_subsystem_resize_ns`, `nvmeof_reload_config` and
`nvmeof_get_status`.  `Control` is the one registry of the method names: every `rpc_NAME` of the families it is
made of, one module each in control/rpc/ (subsystems, namespaces, hosts and keys, transports, status; `params`
checks their parameters).

A namespace added, resized or removed is one call of the engine's verb (control/rpc/namespaces.py); every other
change is made by editing a copy of the running config (`_edit`), validating it with the config loader (the same
rules as a file), and applying the difference with live.py, as a reload does.  A refused change answers a
JSON-RPC error whose `data` names the field and the fix, and leaves the target as it was.

The server is server.py, the client client.py, the protocol's pieces protocol.py.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Callable, Dict, List, Optional

from ..config import ConfigError, load_userspace_config, parse_config, raise_all, validate_for_userspace
from ..engine import auth
from ..securefile import write_file
from . import live
from .protocol import METHOD_NOT_FOUND, RpcError
from .rpc.hosts import HostMethods
from .rpc.namespaces import NamespaceMethods
from .rpc.params import Params, config_error, rpc_error
from .rpc.status import StatusMethods
from .rpc.subsystems import SubsystemMethods
from .rpc.transports import TransportMethods
from .server import DeferredAnswer
from .stats import Sampler

log = logging.getLogger(__name__)

__all__ = ["Control", "RpcError"]


class Control(SubsystemMethods, NamespaceMethods, HostMethods, TransportMethods, StatusMethods):
    """The RPC methods over one running Target (no sockets here: `call()` takes and returns dicts)."""

    def __init__(self, target, listeners: Optional[live.Listeners] = None, config_path: str = "",
                 server=None, socket_path: str = "", persist: bool = False):
        self.target = target
        # --persist (or nvmeof_roce.persist): every accepted change is written to config_path (docs/target.md)
        self.persist = persist
        self.listeners = listeners
        self.config_path = config_path or target.config.source
        self.server = server
        self.socket_path = socket_path
        self.sampler = Sampler(target)
        target.tick_hooks.append(self.sampler.tick)
        self._applying: Optional[live.Applying] = None  # the change the method being called made, if any
        self.transport_params: Dict[str, int] = {}  # nvmf_create_transport's port parameters, for new listeners
        self.group = None  # service/group.py GroupMember: this target is a gateway of a group
        self.methods: Dict[str, Callable[[Any], Any]] = {}
        # A serving process's own methods for its supervisor (service/worker_resv.py), not listed for users
        self.internal: Dict[str, Callable[[Any], Any]] = {}
        for name in dir(self):
            if name.startswith("rpc_"):
                self.methods[name[4:]] = getattr(self, name)

    # -- dispatch: the server's one call per request (protocol.py answers it)
    def call(self, method: str, params: Any = None) -> Any:
        if self.group is not None and self.group.shares(method):
            # a gateway of a group: the change is made under the group's lock and published before the answer
            answer = DeferredAnswer()
            self.group.run_change(lambda: self._call(method, params), answer)
            return answer
        return self._call(method, params)

    def _call(self, method: str, params: Any = None) -> Any:
        fn = self.methods.get(method) or self.internal.get(method)
        if fn is None:
            raise RpcError(f"method {method!r} not found", "method",
                           "rpc_get_methods lists the methods (nvmeof-roce rpc rpc_get_methods)", METHOD_NOT_FOUND)
        self._applying = None
        result = fn(params)
        applying, self._applying = self._applying, None
        if applying is None or applying.done:
            return result() if callable(result) else result
        # Its commit waits for commands in flight to drain: the answer (a callable result: computed then) comes
        # once it is made, and the running config is saved then.
        answer = DeferredAnswer()

        def committed(error: Optional[Exception]) -> None:
            try:
                if error is not None:
                    raise rpc_error(error)
                self.save_running()
                answer.settle(result() if callable(result) else result)
            except RpcError as exc:
                answer.fail(exc)

        applying.then(committed)
        return answer

    def _settle(self, applying: live.Applying) -> None:
        """A change accepted: the running config is saved now if it is made, else once it is (call())."""
        if applying.done:
            self.save_running()
        else:
            self._applying = applying

    # -- editing the running config
    def _edit(self, edit: Callable[[dict], None], rpc_fields: Optional[Callable[[str], str]] = None) -> List[dict]:
        data = self.target.config.to_dict()
        edit(data)
        return self._apply_dict(data, rpc_fields)

    def _apply_dict(self, data: dict, rpc_fields=None, source: str = "") -> List[dict]:
        try:
            new = parse_config(data, source or self.target.config.source)
            # the same checks as `target check` / `serve`: nothing the userspace target cannot honour
            raise_all(validate_for_userspace(new))
            changes, host_auth = live.plan_change(self.target, new)
            applying = live.Applying()
            live.apply(self.target, new, self.listeners, changes, host_auth, applying)
        except ConfigError as exc:
            raise config_error(exc, rpc_fields) from None
        self._settle(applying)
        return [c.to_dict() for c in changes]

    def save_running(self) -> None:
        """With persist on: write the running config over the config file (atomic, 0600, fsynced: it may hold
        DH-HMAC-CHAP keys), in the format `target check` and `serve` read.  Called only after a change was
        applied; a refused change never gets here."""
        if not self.persist:
            return
        path = self.config_path
        try:
            write_file(path, json.dumps(self.target.config.to_dict(), indent=2) + "\n")
        except OSError as exc:
            log.error("persist: the change is applied but could not be saved to %s: %s", path, exc.strerror)
            raise RpcError(f"the change is applied but could not be saved to {path}: {exc.strerror}", "persist",
                           "free space or fix the permissions of that directory, then call save_config with "
                           f'"path": "{path}" so a restart keeps the change') from None
        log.info("persist: saved the running config to %s", path)

    def _subsystem_index(self, data: dict, nqn: str) -> int:
        for i, s in enumerate(data["subsystems"]):
            if s["nqn"] == nqn:
                return i
        known = ", ".join(s["nqn"] for s in data["subsystems"]) or "none"
        raise RpcError(f"no subsystem {nqn!r}", "nqn", f"use one of: {known} (nvmf_get_subsystems lists them)")

    def _sub(self, nqn: str):
        sub = self.target.subsystems.get(nqn)
        if sub is None:
            known = ", ".join(self.target.subsystems) or "none"
            raise RpcError(f"no subsystem {nqn!r}", "nqn", f"use one of: {known} (nvmf_get_subsystems lists them)")
        return sub

    # -- the registry itself, and the reload
    def rpc_rpc_get_methods(self, params) -> List[str]:
        Params("rpc_get_methods", params, ("current",))
        return sorted(self.methods)

    def rpc_nvmeof_reload_config(self, params) -> dict:
        """Re-read the config file (or `path`) and apply the difference; `dry_run` only plans."""
        p = Params("nvmeof_reload_config", params, ("path", "dry_run"))
        path = p.str("path", required=False) or self.config_path
        dry_run = p.bool("dry_run")
        return self.reload(path, dry_run)

    def reload(self, path: str, dry_run: bool = False) -> dict:
        try:
            new = load_userspace_config(path) if self.group is None else self.group.config_with(path)
            host_auth = auth.host_settings(new)
        except ConfigError as exc:
            raise RpcError(exc.problem, exc.where or "path", exc.fix) from None
        try:
            changes = live.plan(self.target.config, new, self.target.host_auth, host_auth)
            if not dry_run:
                applying = live.Applying()
                live.apply(self.target, new, self.listeners, changes, host_auth, applying)
                self._applying = None if applying.done else applying  # answered once committed (call())
        except ConfigError as exc:
            raise RpcError(exc.problem, exc.where, exc.fix) from None
        if not dry_run:
            self.config_path = path
        return {"config": path, "dry_run": dry_run, "applied": not dry_run,
                "changes": [c.to_dict() for c in changes]}
