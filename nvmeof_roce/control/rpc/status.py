"""The methods that change nothing: subsystems, controllers, queue pairs, figures, the status of
`target status`, the running config (save_config), and the per-command trace's switch.  Mixed into
control/methods.py's `Control`."""
from __future__ import annotations

import json
import os
from typing import List

from ...config import DISCOVERY_NQN
from ...securefile import write_file
from ...transport import registry
from ..protocol import RpcError
from ..server import DeferredAnswer
from ..stats import controller_status, namespace_status, target_status
from .params import Params
from .transports import listen_address


class StatusMethods:
    """nvmf_get_subsystems, nvmf_subsystem_get_controllers, nvmf_subsystem_get_qpairs, nvmf_get_stats,
    nvmeof_get_status, save_config, trace_enable_tpoint_group, trace_disable_tpoint_group."""

    def rpc_nvmf_get_subsystems(self, params) -> List[dict]:
        p = Params("nvmf_get_subsystems", params, ("nqn",))
        nqn = p.str("nqn", required=False)
        if nqn and nqn != DISCOVERY_NQN:
            self._sub(nqn)
        out = []
        if not nqn or nqn == DISCOVERY_NQN:
            out.append({"nqn": DISCOVERY_NQN, "subtype": "Discovery", "listen_addresses": [
                listen_address(port) for port in self.target.config.ports], "allow_any_host": True, "hosts": []})
        for s in self.target.config.subsystems:
            if nqn and s.nqn != nqn:
                continue
            sub = self.target.subsystems[s.nqn]
            out.append({
                "nqn": s.nqn, "subtype": "NVMe",
                "listen_addresses": [listen_address(p) for p in self.target.config.ports if s.nqn in p.subsystems],
                "allow_any_host": s.allow_any_host, "hosts": [{"nqn": h} for h in s.allowed_hosts],
                "serial_number": s.serial, "model_number": s.model,
                "min_cntlid": s.cntlid_min, "max_cntlid": s.cntlid_max,
                "namespaces": [_namespace_info(n, sub.namespaces.get(n.nsid)) for n in s.namespaces],
            })
        return out

    def rpc_nvmf_subsystem_get_controllers(self, params) -> List[dict]:
        p = Params("nvmf_subsystem_get_controllers", params, ("nqn",))
        nqn = p.str("nqn")
        sub = self.target.discovery if nqn == DISCOVERY_NQN else self._sub(nqn)
        return [controller_status(c) for _, c in sorted(sub.controllers.items())]

    def rpc_nvmf_subsystem_get_qpairs(self, params) -> List[dict]:
        p = Params("nvmf_subsystem_get_qpairs", params, ("nqn",))
        nqn = p.str("nqn")
        sub = self.target.discovery if nqn == DISCOVERY_NQN else self._sub(nqn)
        out = []
        for _, ctrl in sorted(sub.controllers.items()):
            port = ctrl.port.port
            for qs in sorted(ctrl.queues(), key=lambda q: q.qid):
                out.append({"cntlid": ctrl.cntlid, "qid": qs.qid, "state": "closed" if qs.closed else "active",
                            "hostnqn": ctrl.hostnqn, "sqsize": qs.sqsize, "outstanding": qs.active,
                            "listen_address": listen_address(port) if port is not None else {}})
        return out

    def rpc_nvmf_get_stats(self, params) -> dict:
        Params("nvmf_get_stats", params, ())
        t = self.target
        admin = io = 0
        for ctrl in t.controllers():
            admin += 1 if ctrl.admin_queue is not None else 0
            io += len(ctrl.io_queues)
        return {
            "tick_rate": 1_000_000,
            "poll_groups": [{"name": "nvmf_tgt_poll_group_000", "current_admin_qpairs": admin,
                             "current_io_qpairs": io, "transports": [{"trtype": t.upper()} for t in registry.served_trtypes()]}],
            "namespaces": [dict(nqn=nqn, **namespace_status(nqn, ns, self.sampler))
                           for nqn, sub in t.subsystems.items() for _, ns in sorted(sub.namespaces.items())],
            "internal_errors": t.internal_errors,
        }

    def rpc_nvmeof_get_status(self, params) -> dict:
        Params("nvmeof_get_status", params, ())
        status = target_status(self.target, self.sampler, self.server, self.socket_path)
        if self.group is not None:
            status["group"] = self.group.status()
        return status

    def rpc_nvmeof_group_status(self, params) -> dict:
        """A gateway group as this gateway sees it: members, each ANA group's home, owner and lease here, the
        last take-overs and hand-backs (docs/gateway-group.md)."""
        Params("nvmeof_group_status", params, ())
        return self._group_member().status()

    def rpc_nvmeof_group_failback(self, params) -> dict:
        """Ask the owner of ANA group `ana_group` to hand it back to its home gateway (it stops serving it, its
        commands drain, it releases the lease, the home takes it)."""
        p = Params("nvmeof_group_failback", params, ("ana_group",))
        grpid = p.int("ana_group", required=True)
        member = self._group_member()
        answer = DeferredAnswer()  # a RADOS update: off the loop
        member.off_loop(lambda: member.request_failback(grpid), answer, "ana_group")
        return answer

    def _group_member(self):
        if self.group is None:
            raise RpcError("this target is not a gateway of a group", "method",
                           'add "group" to the config\'s nvmeof_roce section (docs/gateway-group.md)')
        return self.group

    def rpc_save_config(self, params) -> dict:
        """The running config in the file format (nvmetcli's shape); with `path`, also written there."""
        p = Params("save_config", params, ("path",))
        data = self.target.config.to_dict()
        path = p.str("path", required=False)
        if path:
            if not os.path.isabs(path):
                raise RpcError(f"path must be absolute, got {path!r}", "path",
                               "the target's working directory is not yours: give the full path")
            try:
                write_file(path, json.dumps(data, indent=2) + "\n")  # 0600: it may hold DH-HMAC-CHAP keys
            except OSError as exc:
                raise RpcError(f"cannot write {path}: {exc.strerror}", "path", "pick a writable directory") from None
        return data

    def rpc_trace_enable_tpoint_group(self, params) -> bool:
        """The native data path's per-command trace on (docs/native.md), as SPDK names its tracepoint groups."""
        return self._tpoint_group("trace_enable_tpoint_group", params, True)

    def rpc_trace_disable_tpoint_group(self, params) -> bool:
        return self._tpoint_group("trace_disable_tpoint_group", params, False)

    @staticmethod
    def _tpoint_group(method: str, params, enabled: bool) -> bool:
        name = Params(method, params, ("name",)).str("name")
        switches = registry.trace_switches()  # {SPDK's tracepoint group: the transport's trace}
        if name not in switches and name != "all":
            groups = ", ".join(repr(g) for g in switches)
            raise RpcError(f"no tracepoint group {name!r}: this target traces the native data path's commands "
                           f"({groups})", "name", f'give "name": "{next(iter(switches), "all")}" (or "all")')
        for group, switch in switches.items():
            if name in (group, "all"):
                switch.set_enabled(enabled)
        return True


def _namespace_info(cfg, ns) -> dict:
    d = {"nsid": cfg.nsid, "name": cfg.path or f"{cfg.backend}{cfg.nsid}", "uuid": cfg.uuid,
         "anagrpid": cfg.ana_grpid, "backend": cfg.backend, "enabled": cfg.enabled}
    if cfg.path:
        d["path"] = cfg.path
    if cfg.nguid:
        d["nguid"] = cfg.nguid
    if cfg.eui64:
        d["eui64"] = cfg.eui64
    if cfg.visible_hosts is not None:
        d["no_auto_visible"] = True
        d["visible_hosts"] = list(cfg.visible_hosts)
    if cfg.qos:
        d["qos"] = dict(cfg.qos)
    if ns is not None:
        d.update(block_size=ns.block_size, blocks=ns.num_blocks, size_bytes=ns.num_blocks * ns.block_size)
        if ns.qos is not None:
            d["qos_held"] = len(ns.qos.held)
    return d
