"""The control socket's methods: what a running userspace target answers over JSON-RPC 2.0.

Method and parameter names are SPDK's (`scripts/rpc.py nvmf_*`) where SPDK has the operation, so an SPDK user
recognises them; the few of our own are named `nvmf_subsystem_resize_ns`, `nvmeof_reload_config` and
`nvmeof_get_status`.  Every change is made by editing a copy of the running config, validating it with the
config loader (the same rules as a file), and applying the difference with live.py: a refused change answers
a JSON-RPC error whose `data` names the field and the fix, and leaves the target as it was.

The server is control_server.py, the client control_client.py, the protocol's pieces control_protocol.py.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable, Dict, List, Optional

from ..config import (ANA_STATES, MAX_INLINE_DATA_SIZE, QOS_LIMITS, ConfigError, DISCOVERY_NQN, USERSPACE_KEY,
                      USERSPACE_QUEUE_SIZES, load_userspace_config,
                      parse_config, parse_flag, parse_size, raise_all, validate_for_userspace)
from ..nvme.cm import ADMIN_QUEUE_DEPTH
from ..output import address
from ..config import keys
from ..nvme import auth as nvme_auth
from ..securefile import write_file
from ..transport import registry
from ..transport.rdma.native_trace import GROUP as TRACE_GROUP, TRACING
from ..engine import auth
from . import live
from .protocol import METHOD_NOT_FOUND, RpcError, handle_request
from .server import DeferredAnswer
from .stats import Sampler, controller_status, namespace_status, target_status

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------- parameters

class _Params:
    def __init__(self, method: str, params: Any, known: tuple):
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise RpcError(f"{method}: params must be an object (named parameters), got {type(params).__name__}",
                           "params", 'send "params": {"nqn": ...}')
        for k in params:
            if k not in known and k != "tgt_name":
                raise RpcError(f"{method}: unknown parameter {k!r}", k,
                               f"remove it; {method} takes {', '.join(known) or 'no parameters'}")
        if params.get("tgt_name") not in (None, ""):
            raise RpcError("tgt_name: this target process serves one target; it has no named targets", "tgt_name",
                           "leave tgt_name out")
        self.method = method
        self.p = params

    def has(self, name: str) -> bool:
        return self.p.get(name) is not None

    def str(self, name: str, required: bool = True, default: str = "") -> str:
        v = self.p.get(name)
        if v is None:
            if required:
                raise RpcError(f"{self.method}: missing parameter {name!r}", name, f"add \"{name}\": ...")
            return default
        if not isinstance(v, str) or not v:
            raise RpcError(f"{name} must be a non-empty string, got {v!r}", name, f"give {name} as a JSON string")
        return v

    def int(self, name: str, required: bool = True, default: Optional[int] = None) -> Optional[int]:
        v = self.p.get(name)
        if v is None:
            if required:
                raise RpcError(f"{self.method}: missing parameter {name!r}", name, f"add \"{name}\": N")
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            try:
                v = int(str(v), 0)
            except ValueError:
                raise RpcError(f"{name} must be an integer, got {v!r}", name, f"give {name} as a number") from None
        return v

    def bool(self, name: str, required: bool = False, default: bool = False) -> bool:
        v = self.p.get(name)
        if v is None:
            if required:
                raise RpcError(f"{self.method}: missing parameter {name!r}", name, f"add \"{name}\": true or false")
            return default
        flag = parse_flag(v)  # a JSON boolean, or nvmetcli's "1"/"0" as the config takes them
        if flag is None:
            raise RpcError(f"{name} must be true or false, got {v!r}", name,
                           f'give {name} as true or false (or "1"/"0")')
        return flag

    def dict(self, name: str) -> dict:
        v = self.p.get(name)
        if not isinstance(v, dict):
            raise RpcError(f"{self.method}: parameter {name!r} must be an object, got {v!r}", name,
                           f"give \"{name}\": {{...}}")
        return v


# -------------------------------------------------------------------------------------- the methods

_NS_PARAMS = {  # RPC namespace key -> (where it goes in the config's namespace object)
    "nsid": ("nsid",), "path": ("device", "path"), "uuid": ("device", "uuid"), "nguid": ("device", "nguid"),
    "eui64": ("device", "eui64"), "anagrpid": ("ana_grpid",), "backend": ("nvmeof_roce", "backend"),
    "size": ("nvmeof_roce", "size"), "block_size": ("nvmeof_roce", "block_size"),
    "queue_depth": ("nvmeof_roce", "queue_depth"), "io_engine": ("nvmeof_roce", "io_engine"),
}
_CONFIG_TO_RPC = {".".join(v): k for k, v in _NS_PARAMS.items()}


def _rpc_error(error: Exception) -> RpcError:
    """The answer to a live change given up after it was accepted (control/live.py: a drain that did not end)."""
    if isinstance(error, RpcError):
        return error
    if isinstance(error, ConfigError):
        return RpcError(error.problem, error.where, error.fix)
    return RpcError(str(error), "", "see the target's log")


class Control:
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
        self.methods: Dict[str, Callable[[_Params], Any]] = {}
        for name in dir(self):
            if name.startswith("rpc_"):
                self.methods[name[4:]] = getattr(self, name)

    # -- dispatch
    def call(self, method: str, params: Any = None) -> Any:
        fn = self.methods.get(method)
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
                    raise _rpc_error(error)
                self.save_running()
                answer.settle(result() if callable(result) else result)
            except RpcError as exc:
                answer.fail(exc)

        applying.then(committed)
        return answer

    def handle(self, request: Any) -> Optional[dict]:
        """One JSON-RPC request object -> its response object (None for a notification)."""
        return handle_request(self.call, request)

    # -- editing the running config
    def _edit(self, edit: Callable[[dict], None], rpc_fields: Optional[Callable[[str], str]] = None) -> List[dict]:
        data = self.target.config.to_dict()
        edit(data)
        return self._apply_dict(data, rpc_fields)

    def _apply_dict(self, data: dict, rpc_fields=None, dry_run: bool = False, source: str = "") -> List[dict]:
        try:
            new = parse_config(data, source or self.target.config.source)
            # the same checks as `target check` / `serve`: nothing the userspace target cannot honour
            raise_all(validate_for_userspace(new))
            host_auth = auth.host_settings(new)
            changes = live.plan(self.target.config, new, self.target.host_auth, host_auth)
            applying = live.Applying()
            if not dry_run:
                live.apply(self.target, new, self.listeners, changes, host_auth, applying)
        except ConfigError as exc:
            field = rpc_fields(exc.where) if rpc_fields else exc.where
            raise RpcError(exc.problem if field else str(exc), field or exc.where, exc.fix) from None
        if not dry_run:
            if applying.done:
                self.save_running()
            else:
                self._applying = applying  # call() answers, and saves, once it is committed
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

    # -- SPDK's methods
    def rpc_rpc_get_methods(self, params) -> List[str]:
        _Params("rpc_get_methods", params, ("current",))
        return sorted(self.methods)

    def rpc_nvmf_get_subsystems(self, params) -> List[dict]:
        p = _Params("nvmf_get_subsystems", params, ("nqn",))
        nqn = p.str("nqn", required=False)
        if nqn and nqn != DISCOVERY_NQN:
            self._sub(nqn)
        out = []
        if not nqn or nqn == DISCOVERY_NQN:
            out.append({"nqn": DISCOVERY_NQN, "subtype": "Discovery", "listen_addresses": [
                _listen_address(port) for port in self.target.config.ports], "allow_any_host": True, "hosts": []})
        for s in self.target.config.subsystems:
            if nqn and s.nqn != nqn:
                continue
            sub = self.target.subsystems[s.nqn]
            out.append({
                "nqn": s.nqn, "subtype": "NVMe",
                "listen_addresses": [_listen_address(p) for p in self.target.config.ports if s.nqn in p.subsystems],
                "allow_any_host": s.allow_any_host, "hosts": [{"nqn": h} for h in s.allowed_hosts],
                "serial_number": s.serial, "model_number": s.model,
                "min_cntlid": s.cntlid_min, "max_cntlid": s.cntlid_max,
                "namespaces": [_namespace_info(n, sub.namespaces.get(n.nsid)) for n in s.namespaces],
            })
        return out

    def rpc_nvmf_create_subsystem(self, params) -> bool:
        p = _Params("nvmf_create_subsystem", params, ("nqn", "serial_number", "model_number", "allow_any_host",
                                                       "max_namespaces", "ana_reporting", "min_cntlid", "max_cntlid"))
        nqn = p.str("nqn")
        if p.int("max_namespaces", required=False, default=0) not in (0, None):
            raise RpcError("max_namespaces is not supported: a subsystem of this target takes NSIDs 1..1024",
                           "max_namespaces", "leave max_namespaces out (or 0)")
        if p.bool("ana_reporting"):
            raise RpcError("ana_reporting is not supported by the userspace target", "ana_reporting",
                           "leave ana_reporting out")
        attr = {"allow_any_host": "1" if p.bool("allow_any_host") else "0"}
        if p.has("serial_number"):
            attr["serial"] = p.str("serial_number")
        if p.has("model_number"):
            attr["model"] = p.str("model_number")
        if p.has("min_cntlid"):
            attr["cntlid_min"] = str(p.int("min_cntlid"))
        if p.has("max_cntlid"):
            attr["cntlid_max"] = str(p.int("max_cntlid"))

        def edit(d):
            if any(s["nqn"] == nqn for s in d["subsystems"]):
                raise RpcError(f"subsystem {nqn!r} already exists", "nqn",
                               "pick another NQN, or nvmf_delete_subsystem it first")
            d["subsystems"].append({"nqn": nqn, "attr": attr, "allowed_hosts": [], "namespaces": []})

        self._edit(edit, lambda where: _sub_field(where, {"nqn": "nqn", "attr.serial": "serial_number",
                                                          "attr.model": "model_number",
                                                          "attr.cntlid_min": "min_cntlid",
                                                          "attr.cntlid_max": "max_cntlid"}))
        return True

    def rpc_nvmf_delete_subsystem(self, params) -> bool:
        p = _Params("nvmf_delete_subsystem", params, ("nqn",))
        nqn = p.str("nqn")

        def edit(d):
            del d["subsystems"][self._subsystem_index(d, nqn)]
            for port in d["ports"]:
                if nqn in port["subsystems"]:
                    port["subsystems"].remove(nqn)

        self._edit(edit)
        return True

    def rpc_nvmf_subsystem_add_ns(self, params) -> int:
        p = _Params("nvmf_subsystem_add_ns", params, ("nqn", "namespace"))
        nqn = p.str("nqn")
        spec = p.dict("namespace")
        no_auto_visible = parse_flag(spec.get("no_auto_visible", False))
        if no_auto_visible is None:
            raise RpcError(f"namespace.no_auto_visible must be true or false, got {spec['no_auto_visible']!r}",
                           "namespace.no_auto_visible", "give true (no host sees it until nvmf_ns_add_host) or false")
        spec = {k: v for k, v in spec.items() if k != "no_auto_visible"}
        for k in spec:
            if k == "bdev_name":
                raise RpcError("namespace.bdev_name: this target has no bdevs", "namespace.bdev_name",
                               'give "path" (a file or block device), or "backend": "ram" or "null" with a "size"')
            if k not in _NS_PARAMS:
                raise RpcError(f"namespace: unknown key {k!r}", f"namespace.{k}",
                               f"remove it; known keys: {', '.join(_NS_PARAMS)}")
        self._sub(nqn)
        nsid = spec.get("nsid")
        if nsid is None:  # SPDK: the lowest free NSID
            used = {n.nsid for n in self.target.config.subsystem(nqn).namespaces}
            nsid = next(i for i in range(1, len(used) + 2) if i not in used)
        ns: Dict[str, Any] = {"nsid": nsid, "enable": 1}
        for k, v in spec.items():
            if k == "nsid":
                continue
            where = _NS_PARAMS[k]
            target = ns
            for part in where[:-1]:
                target = target.setdefault(part, {})
            target[where[-1]] = v
        if "path" in spec and "backend" not in spec:
            ns.setdefault("nvmeof_roce", {})["backend"] = "file"
        if no_auto_visible:
            ns.setdefault("nvmeof_roce", {})["visible_hosts"] = []

        def edit(d):
            s = d["subsystems"][self._subsystem_index(d, nqn)]
            if any(str(n.get("nsid")) == str(nsid) for n in s["namespaces"]):
                raise RpcError(f"{nqn} already has namespace {nsid}", "namespace.nsid",
                               "pick a free NSID, or leave nsid out to get the lowest free one")
            s["namespaces"].append(ns)

        self._edit(edit, _ns_field)
        return int(nsid) if not isinstance(nsid, str) else int(nsid, 0)

    def rpc_nvmf_subsystem_remove_ns(self, params) -> bool:
        p = _Params("nvmf_subsystem_remove_ns", params, ("nqn", "nsid"))
        nqn, nsid = p.str("nqn"), p.int("nsid")
        self._sub(nqn)

        def edit(d):
            s = d["subsystems"][self._subsystem_index(d, nqn)]
            keep = [n for n in s["namespaces"] if int(str(n["nsid"]), 0) != nsid]
            if len(keep) == len(s["namespaces"]):
                raise RpcError(f"{nqn} has no namespace {nsid}", "nsid",
                               "nvmf_get_subsystems lists the namespaces")
            s["namespaces"] = keep

        self._edit(edit)
        return True

    def rpc_nvmf_subsystem_resize_ns(self, params) -> dict:
        p = _Params("nvmf_subsystem_resize_ns", params, ("nqn", "nsid", "size"))
        nqn, nsid = p.str("nqn"), p.int("nsid")
        raw = p.p.get("size")
        if raw is None:
            raise RpcError("nvmf_subsystem_resize_ns: missing parameter 'size'", "size", 'add "size": "2G" (or bytes)')
        try:
            size = parse_size(raw)
        except ValueError:
            raise RpcError(f"size is not a size: {raw!r}", "size", 'give bytes or K/M/G/T, e.g. "2G"') from None
        sub = self._sub(nqn)
        if nsid not in sub.namespaces:
            raise RpcError(f"{nqn} has no enabled namespace {nsid}", "nsid", "nvmf_get_subsystems lists them")

        def edit(d):
            s = d["subsystems"][self._subsystem_index(d, nqn)]
            for n in s["namespaces"]:
                if int(str(n["nsid"]), 0) == nsid:
                    n.setdefault("nvmeof_roce", {})["size"] = size
                    if n["nvmeof_roce"].get("backend", "file") == "file":
                        n["nvmeof_roce"]["backend"] = "file"

        self._edit(edit, lambda where: "size" if where.endswith(".size") else _ns_field(where))

        def answer() -> dict:  # the size in use: made once the namespace's commands in flight drained (call())
            ns = sub.namespaces[nsid]
            return {"nsid": nsid, "size_bytes": ns.num_blocks * ns.block_size, "blocks": ns.num_blocks}
        return answer

    def rpc_nvmf_subsystem_add_host(self, params) -> bool:
        """SPDK's method; dhchap_key / dhchap_ctrlr_key name keyring keys (keyring_file_add_key) as in SPDK, or are
        a key file's path or the secret itself (config/keys.py).  They become the host's keys (hosts[].dhchap)."""
        p = _Params("nvmf_subsystem_add_host", params, ("nqn", "host", "psk", "dhchap_key", "dhchap_ctrlr_key"))
        nqn, host = p.str("nqn"), p.str("host")
        keys_given = _dhchap_keys(p)
        if p.has("psk"):
            raise RpcError("psk: TLS is not supported on RDMA", "psk", "leave psk out")
        self._sub(nqn)  # on a subsystem that allows any host, the host is listed for when it stops (as SPDK)

        def edit(d):
            if not any(h["nqn"] == host for h in d["hosts"]):
                d["hosts"].append({"nqn": host})
            if keys_given:
                _set_dhchap_keys(next(h for h in d["hosts"] if h["nqn"] == host), *keys_given)
            s = d["subsystems"][self._subsystem_index(d, nqn)]
            if host in s["allowed_hosts"]:
                raise RpcError(f"host {host} is already allowed on {nqn}", "host", "nothing to do")
            s["allowed_hosts"].append(host)

        self._edit(edit, lambda where: _key_field(where) or ("host" if "hosts" in where else where))
        return True

    def rpc_nvmf_subsystem_set_keys(self, params) -> bool:
        """Set (rotate) or clear a host's DH-HMAC-CHAP keys, SPDK's method: each key a keyring key's name (as
        SPDK), a key file's path, or the secret itself (DHHC-1:NN:...:, `nvmeof-roce gen-dhchap-key`).  The key
        belongs to the host (hosts[].dhchap, as nvmet's hosts/NQN/dhchap_key), so it applies on every subsystem
        the host may use.  New connections and re-authentications use it; connected controllers keep theirs
        until they reconnect.  Without dhchap_key the keys are cleared."""
        p = _Params("nvmf_subsystem_set_keys", params, ("nqn", "host", "dhchap_key", "dhchap_ctrlr_key"))
        nqn, host = p.str("nqn"), p.str("host")
        key = p.str("dhchap_key", required=False)
        ctrl_key = p.str("dhchap_ctrlr_key", required=False)
        if ctrl_key and not key:
            raise RpcError("dhchap_ctrlr_key without dhchap_key", "dhchap_ctrlr_key",
                           "give the host key (dhchap_key) too: bidirectional authentication needs both")
        sub = self._sub(nqn)
        if host not in sub.allowed_hosts:
            raise RpcError(f"host {host} is not on the allow-list of {nqn}", "host",
                           f"nvmf_subsystem_add_host with nqn {nqn} and host {host} first")

        def edit(d):
            entry = next(h for h in d["hosts"] if h["nqn"] == host)
            group = dict(entry.get("dhchap") or {})
            group.pop("key", None)
            group.pop("ctrl_key", None)
            if key:
                group["key"] = key
            if ctrl_key:
                group["ctrl_key"] = ctrl_key
            if key:
                entry["dhchap"] = group
            else:
                entry.pop("dhchap", None)

        self._edit(edit, lambda where: {"dhchap.key": "dhchap_key", "dhchap.ctrl_key": "dhchap_ctrlr_key"}.get(
            where.split("]", 1)[1].lstrip(".") if where.startswith("hosts[") else where, where))
        return True

    def rpc_nvmf_subsystem_remove_host(self, params) -> bool:
        p = _Params("nvmf_subsystem_remove_host", params, ("nqn", "host"))
        nqn, host = p.str("nqn"), p.str("host")
        self._sub(nqn)

        def edit(d):
            s = d["subsystems"][self._subsystem_index(d, nqn)]
            if host not in s["allowed_hosts"]:
                raise RpcError(f"host {host} is not on the allow-list of {nqn}", "host",
                               "nvmf_get_subsystems lists the allowed hosts")
            s["allowed_hosts"].remove(host)

        self._edit(edit)
        return True

    def rpc_nvmf_subsystem_allow_any_host(self, params) -> bool:
        p = _Params("nvmf_subsystem_allow_any_host", params, ("nqn", "allow_any_host"))
        nqn = p.str("nqn")
        allow = p.bool("allow_any_host", required=True)
        self._sub(nqn)

        def edit(d):
            d["subsystems"][self._subsystem_index(d, nqn)]["attr"]["allow_any_host"] = "1" if allow else "0"

        self._edit(edit, lambda where: "allow_any_host" if where.endswith("allow_any_host") else where)
        return True

    def rpc_nvmf_subsystem_add_listener(self, params) -> bool:
        p = _Params("nvmf_subsystem_add_listener", params, ("nqn", "listen_address"))
        nqn = p.str("nqn")
        la = _listen_params(p.dict("listen_address"))
        if nqn != DISCOVERY_NQN:
            self._sub(nqn)

        def edit(d):
            port = _find_port(d, la)
            if port is None:
                portid = max([int(str(x["portid"])) for x in d["ports"]] + [0]) + 1
                port = {"portid": portid, "addr": dict(la, treq="not specified"), "subsystems": [], "referrals": []}
                if self.transport_params:  # nvmf_create_transport's port parameters
                    port["param"] = {k: str(v) for k, v in self.transport_params.items()}
                d["ports"].append(port)
            if nqn == DISCOVERY_NQN:
                return  # every port serves discovery
            if nqn in port["subsystems"]:
                raise RpcError(f"{nqn} already listens on {address(la['traddr'], la['trsvcid'])}", "listen_address",
                               "nothing to do")
            port["subsystems"].append(nqn)

        self._edit(edit, lambda where: "listen_address" + where.split(".addr", 1)[1] if ".addr" in where
                   else where)
        return True

    def _transport_settings(self) -> dict:
        """The RDMA transport's settings in force, in nvmf_create_transport's names."""
        limits = self.target.limits
        return {"trtype": "RDMA", "max_queue_depth": self.transport_params.get(
                    "max_queue_size", self.target.default_queue_size),
                "in_capsule_data_size": self.transport_params.get(
                    "inline_data_size", self.target.default_in_capsule_size),
                "max_io_qpairs_per_ctrlr": limits.max_queues_per_ctrl, "max_io_size": limits.max_transfer,
                "io_unit_size": limits.max_transfer, "num_shared_buffers": limits.data_buffers,
                "max_aq_depth": ADMIN_QUEUE_DEPTH, "no_srq": True, "zcopy": False}

    def rpc_nvmf_get_transports(self, params) -> List[dict]:
        p = _Params("nvmf_get_transports", params, ("trtype",))
        trtype = p.str("trtype", required=False)
        if trtype and trtype.lower() != "rdma":
            raise RpcError(f"no transport {trtype!r}: this target serves RDMA only", "trtype", 'give "RDMA"')
        return [self._transport_settings()]

    def rpc_nvmf_create_transport(self, params) -> bool:
        """SPDK's method.  The RDMA transport exists from the start (`target serve`'s options size it), so each
        parameter is accepted when it is what the target does, applied when it is a port parameter (the
        listeners added after the call get it), and refused with the reason and the option to restart with
        otherwise: a setting is never taken without being honoured."""
        p = _Params("nvmf_create_transport", params, ("trtype",) + tuple(_TRANSPORT_PARAMS))
        trtype = p.str("trtype")
        if trtype.lower() != "rdma":
            raise RpcError(f"trtype {trtype!r}: this target serves RDMA only", "trtype", 'give "trtype": "RDMA"')
        in_force = self._transport_settings()
        ports: Dict[str, int] = {}
        for name in _TRANSPORT_PARAMS:
            if not p.has(name):
                continue
            how = _TRANSPORT_PARAMS[name]
            if isinstance(how, bool):  # a switch: what the target does is the only value it takes
                if p.bool(name) != how:
                    raise RpcError(f"{name} {str(not how).lower()}: {_TRANSPORT_SWITCHES[name]}", name,
                                   f"leave {name} out, or give {str(how).lower()}")
                continue
            if how is None:
                raise RpcError(f"{name}: {_TRANSPORT_REFUSED[name]}", name, f"leave {name} out")
            value = p.int(name)
            if how.startswith("port:"):
                key = how[5:]
                lo, hi = _TRANSPORT_PORT_RANGES[key]
                if not lo <= value <= hi:
                    raise RpcError(f"{name} {value}: this target takes {lo}..{hi}", name, f"give {lo}..{hi}")
                for port in self.target.config.ports:
                    have = getattr(port, key)
                    have = in_force[name] if have is None or have < 0 else have
                    if have != value:
                        raise RpcError(f"{name} {value}: port {port.portid} ({address(port.traddr, port.trsvcid)})"
                                       f" already listens with {key} {have}; the transport's setting is for "
                                       "the listeners added after it", name,
                                       f"give {have}, or set ports[].param.{key} in the config and reload "
                                       "with that port removed and added again")
                ports[key] = value
            elif how == "fixed" and value != in_force[name]:
                raise RpcError(f"{name} {value}: this target's is always {in_force[name]}", name,
                               f"give {in_force[name]}, or leave {name} out")
            elif value != in_force[name]:
                raise RpcError(f"{name} {value}: the running target was started with {in_force[name]} ({how}), "
                               "which a running target cannot change", name,
                               f"give {in_force[name]}, or restart `target serve` with {how} set to match")
        self.transport_params.update(ports)
        return True

    def rpc_nvmf_subsystem_remove_listener(self, params) -> bool:
        p = _Params("nvmf_subsystem_remove_listener", params, ("nqn", "listen_address"))
        nqn = p.str("nqn")
        la = _listen_params(p.dict("listen_address"))
        self._sub(nqn)

        def edit(d):
            port = _find_port(d, la)
            if port is None or nqn not in port["subsystems"]:
                raise RpcError(f"{nqn} does not listen on {address(la['traddr'], la['trsvcid'])}", "listen_address",
                               "nvmf_get_subsystems lists each subsystem's listen_addresses")
            port["subsystems"].remove(nqn)

        self._edit(edit)
        return True

    def _ns_entry(self, d: dict, nqn: str, nsid: int) -> dict:
        s = d["subsystems"][self._subsystem_index(d, nqn)]
        for n in s["namespaces"]:
            if int(str(n["nsid"]), 0) == nsid:
                return n
        raise RpcError(f"{nqn} has no namespace {nsid}", "nsid", "nvmf_get_subsystems lists the namespaces")

    def _ns_visibility(self, method: str, params, add: bool) -> bool:
        p = _Params(method, params, ("nqn", "nsid", "host"))
        nqn, nsid, host = p.str("nqn"), p.int("nsid"), p.str("host")
        self._sub(nqn)

        def edit(d):
            us = self._ns_entry(d, nqn, nsid).setdefault(USERSPACE_KEY, {})
            hosts = us.get("visible_hosts")
            if hosts is None:
                raise RpcError(f"namespace {nsid} of {nqn} is visible to every host (it was added without "
                               "no_auto_visible)", "nsid",
                               "remove it and add it again with no_auto_visible true (target add-ns "
                               "--no-auto-visible), or set nvmeof_roce.visible_hosts in CONFIG and reload")
            if add and host in hosts:
                raise RpcError(f"host {host} already sees namespace {nsid} of {nqn}", "host", "nothing to do")
            if not add and host not in hosts:
                raise RpcError(f"host {host} does not see namespace {nsid} of {nqn}", "host",
                               "nvmf_get_subsystems lists each namespace's visible_hosts")
            us["visible_hosts"] = hosts + [host] if add else [h for h in hosts if h != host]

        self._edit(edit, lambda where: "host" if ".visible_hosts[" in where else _ns_field(where))
        return True

    def rpc_nvmf_ns_add_host(self, params) -> bool:
        """SPDK's method: namespace NSID of subsystem NQN (added with no_auto_visible) becomes visible to HOST;
        its connected controllers get a Namespace Attribute Changed notice."""
        return self._ns_visibility("nvmf_ns_add_host", params, add=True)

    def rpc_nvmf_ns_remove_host(self, params) -> bool:
        """SPDK's method: HOST no longer sees the namespace (its NSID reads as inactive, I/O to it fails
        Invalid Namespace or Format)."""
        return self._ns_visibility("nvmf_ns_remove_host", params, add=False)

    def rpc_bdev_set_qos_limit(self, params) -> bool:
        """SPDK's method for a namespace (SPDK names a bdev: here `nqn` and `nsid`): limits per second, 0 removes
        one, a limit not given keeps its value.  Commands over a limit wait (engine/qos.py)."""
        p = _Params("bdev_set_qos_limit", params, ("nqn", "nsid", "name") + tuple(QOS_LIMITS))
        if p.has("name"):
            raise RpcError("name: this target has no bdevs; a namespace is named by its subsystem and NSID", "name",
                           'give "nqn" and "nsid" instead of "name"')
        nqn, nsid = p.str("nqn"), p.int("nsid")
        self._sub(nqn)
        given = {k: p.int(k) for k in QOS_LIMITS if p.has(k)}
        if not given:
            raise RpcError("bdev_set_qos_limit: no limit given", "rw_ios_per_sec",
                           f"give one or more of {', '.join(QOS_LIMITS)} (0 removes that limit)")
        for k, v in given.items():
            if v < 0:
                raise RpcError(f"{k} must be 0 (no limit) or more, got {v}", k, "give a limit per second, or 0")

        def edit(d):
            us = self._ns_entry(d, nqn, nsid).setdefault(USERSPACE_KEY, {})
            qos = dict(us.get("qos") or {})
            qos.update(given)
            qos = {k: v for k, v in qos.items() if v}
            if qos:
                us["qos"] = qos
            else:
                us.pop("qos", None)

        self._edit(edit, lambda where: where.rsplit(".", 1)[-1] if ".qos." in where else _ns_field(where))
        return True

    def rpc_nvmf_subsystem_listener_set_ana_state(self, params) -> bool:
        """SPDK's method: the ANA state of the listener's groups (`anagrpid`, or every group the subsystem's
        namespaces use).  ANA state here is per port and group (engine/ana.py), so it applies to every subsystem
        of that group on that port.  Same effect as `target ana-state`, through the config: with persist on,
        it is saved; a reload of a file with other states applies the file's."""
        p = _Params("nvmf_subsystem_listener_set_ana_state", params,
                    ("nqn", "listen_address", "ana_state", "anagrpid"))
        nqn = p.str("nqn")
        la = _listen_params(p.dict("listen_address"))
        raw_state = p.str("ana_state")
        state = raw_state.lower().replace("_", "-")  # SPDK: non_optimized; nvmet: non-optimized
        if state not in ANA_STATES:
            raise RpcError(f"ana_state {raw_state!r} is not an ANA state", "ana_state",
                           f"use one of: {', '.join(s.replace('-', '_') for s in ANA_STATES)}")
        sub = self._sub(nqn)
        grpid = p.int("anagrpid", required=False)
        if grpid is not None:
            if grpid not in self.target.ana.groups:
                raise RpcError(f"ANA group {grpid} does not exist", "anagrpid",
                               f"use one of {', '.join(map(str, self.target.ana.groups))}")
            groups = [grpid]
        else:
            groups = sorted({ns.ana_grpid for ns in sub.namespaces.values()} or {1})

        def edit(d):
            port = _find_port(d, la)
            if port is None or nqn not in port["subsystems"]:
                raise RpcError(f"{nqn} does not listen on {address(la['traddr'], la['trsvcid'])}", "listen_address",
                               "nvmf_get_subsystems lists each subsystem's listen_addresses")
            entries = port.setdefault("ana_groups", [])
            for g in groups:
                entry = next((a for a in entries if int(str(a.get("grpid")), 0) == g), None)
                if entry is None:
                    entry = {"grpid": g}
                    entries.append(entry)
                entry.setdefault("ana", {})["state"] = state

        self._edit(edit, lambda where: "ana_state" if "ana_groups" in where else where)
        return True

    def rpc_nvmf_subsystem_get_controllers(self, params) -> List[dict]:
        p = _Params("nvmf_subsystem_get_controllers", params, ("nqn",))
        nqn = p.str("nqn")
        sub = self.target.discovery if nqn == DISCOVERY_NQN else self._sub(nqn)
        return [controller_status(c) for _, c in sorted(sub.controllers.items())]

    def rpc_nvmf_subsystem_get_qpairs(self, params) -> List[dict]:
        p = _Params("nvmf_subsystem_get_qpairs", params, ("nqn",))
        nqn = p.str("nqn")
        sub = self.target.discovery if nqn == DISCOVERY_NQN else self._sub(nqn)
        out = []
        for _, ctrl in sorted(sub.controllers.items()):
            port = ctrl.port.port
            for qs in sorted(ctrl.queues(), key=lambda q: q.qid):
                out.append({"cntlid": ctrl.cntlid, "qid": qs.qid, "state": "closed" if qs.closed else "active",
                            "hostnqn": ctrl.hostnqn, "sqsize": qs.sqsize, "outstanding": qs.active,
                            "listen_address": _listen_address(port) if port is not None else {}})
        return out

    def rpc_nvmf_get_stats(self, params) -> dict:
        _Params("nvmf_get_stats", params, ())
        t = self.target
        admin = io = 0
        for ctrl in t.controllers():
            admin += 1 if ctrl.admin_queue is not None else 0
            io += len(ctrl.io_queues)
        return {
            "tick_rate": 1_000_000,
            "poll_groups": [{"name": "nvmf_tgt_poll_group_000", "current_admin_qpairs": admin,
                             "current_io_qpairs": io, "transports": [{"trtype": "RDMA"}]}],
            "namespaces": [dict(nqn=nqn, **namespace_status(nqn, ns, self.sampler))
                           for nqn, sub in t.subsystems.items() for _, ns in sorted(sub.namespaces.items())],
            "internal_errors": t.internal_errors,
        }

    def rpc_save_config(self, params) -> dict:
        """The running config in the file format (nvmetcli's shape); with `path`, also written there."""
        p = _Params("save_config", params, ("path",))
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
        name = _Params(method, params, ("name",)).str("name")
        if name not in (TRACE_GROUP, "all"):
            raise RpcError(f"no tracepoint group {name!r}: this target traces the native data path's commands "
                           f"({TRACE_GROUP!r})", "name", f'give "name": "{TRACE_GROUP}" (or "all")')
        TRACING.set_enabled(enabled)
        return True

    # -- the keyring: SPDK's keyring_file_* methods.  A key is a name for a 0600 key file; the keyring lives in the
    # config (nvmeof_roce.keyring: name -> path), so save_config and --persist keep it, and hosts[].dhchap names
    # its keys (nvmf_subsystem_add_host / nvmf_subsystem_set_keys with dhchap_key: NAME).  The files are read at
    # each load of the config: replace a key's file and reload to rotate it.
    def rpc_keyring_file_add_key(self, params) -> bool:
        p = _Params("keyring_file_add_key", params, ("name", "path"))
        name, path = p.str("name"), p.str("path")
        if not keys.KEY_NAME_RE.match(name):
            raise RpcError("name is not a key name: 1..64 letters, digits, '.', '_' or '-', starting with a letter "
                           "or digit", "name", "pick a name such as key0 or host1-key")
        if name in keys.keyring_of(self.target.config):
            raise RpcError(f"key {name!r} already exists", "name",
                           "pick another name, or keyring_file_remove_key it first")
        try:  # as SPDK: an absolute path to a file only its owner may read; and it must hold a DH-HMAC-CHAP key
            text = keys.read_key_file(path, self.target.config.source, "path")
            nvme_auth.parse_secret(text)
        except ConfigError as exc:
            raise RpcError(exc.problem, "path", exc.fix) from None
        except nvme_auth.SecretError as exc:
            raise RpcError(f"key file {path}: {exc}", "path", "the file must hold the whole DHHC-1:NN:...: key "
                           "(nvmeof-roce gen-dhchap-key ... > FILE)") from None

        def edit(d):
            d.setdefault(USERSPACE_KEY, {}).setdefault(keys.KEYRING, {})[name] = path

        self._edit(edit)
        return True

    def rpc_keyring_file_remove_key(self, params) -> bool:
        """Remove a key from the keyring; refused while a host's keys name it (SPDK would leave such a host
        unable to authenticate)."""
        p = _Params("keyring_file_remove_key", params, ("name",))
        name = p.str("name")
        if name not in keys.keyring_of(self.target.config):
            raise RpcError(f"no key {name!r} in the keyring", "name", "keyring_get_keys lists the keys")
        users = _key_users(self.target.config, name)
        if users:
            raise RpcError(f"key {name!r} is in use by host {', '.join(users)}", "name",
                           "give the host another key first (nvmf_subsystem_set_keys), or remove the host")

        def edit(d):
            ring = d[USERSPACE_KEY][keys.KEYRING]
            del ring[name]
            if not ring:
                del d[USERSPACE_KEY][keys.KEYRING]
            if not d[USERSPACE_KEY]:
                del d[USERSPACE_KEY]

        self._edit(edit)
        return True

    def rpc_keyring_get_keys(self, params) -> List[dict]:
        """The keys as SPDK lists them (name, module, removed, probed, refcnt, path): never their contents.
        refcnt is 1 (the keyring) plus the host keys that name it."""
        _Params("keyring_get_keys", params, ())
        return [{"name": name, "module": "keyring_file", "removed": False, "probed": False,
                 "refcnt": 1 + len(_key_users(self.target.config, name)), "path": path}
                for name, path in sorted(keys.keyring_of(self.target.config).items())]

    # -- our own
    def rpc_nvmeof_reload_config(self, params) -> dict:
        """Re-read the config file (or `path`) and apply the difference; `dry_run` only plans."""
        p = _Params("nvmeof_reload_config", params, ("path", "dry_run"))
        path = p.str("path", required=False) or self.config_path
        dry_run = p.bool("dry_run")
        return self.reload(path, dry_run)

    def reload(self, path: str, dry_run: bool = False) -> dict:
        try:
            new = load_userspace_config(path)
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

    def rpc_nvmeof_get_status(self, params) -> dict:
        _Params("nvmeof_get_status", params, ())
        return target_status(self.target, self.sampler, self.server, self.socket_path)

    def rpc_nvmeof_set_host_keys(self, params) -> bool:
        """A host's DH-HMAC-CHAP settings (hosts[].dhchap; nvmet's hosts/NQN/dhchap_*): the secrets themselves
        (DHHC-1:NN:...:), a key file's path or a keyring key's name.  No dhchap_key clears them: the host connects
        unauthenticated."""
        p = _Params("nvmeof_set_host_keys", params, ("host", "dhchap_key", "dhchap_ctrlr_key", "dhchap_hash",
                                                      "dhchap_dhgroup"))
        host = p.str("host")
        group = {}
        for name, key in (("dhchap_key", "key"), ("dhchap_ctrlr_key", "ctrl_key"), ("dhchap_hash", "hash"),
                          ("dhchap_dhgroup", "dhgroup")):
            if p.p.get(name):  # "" is "not set", as blktests passes an empty key
                group[key] = p.str(name)

        def edit(d):
            entry = next((h for h in d["hosts"] if h["nqn"] == host), None)
            if entry is None:
                if not group:
                    return
                entry = {"nqn": host}
                d["hosts"].append(entry)
            if group:
                entry["dhchap"] = group
            else:
                entry.pop("dhchap", None)

        self._edit(edit, lambda where: {"key": "dhchap_key", "ctrl_key": "dhchap_ctrlr_key", "hash": "dhchap_hash",
                                        "dhgroup": "dhchap_dhgroup"}.get(where.rsplit(".", 1)[-1], "host"))
        return True

    def rpc_nvmeof_subsystem_set_qid_max(self, params) -> bool:
        """The most I/O queues a controller of the subsystem may have (nvmet's attr_qid_max).  As nvmet does,
        the subsystem's controllers are ended, so their hosts reconnect and are granted the new count."""
        p = _Params("nvmeof_subsystem_set_qid_max", params, ("nqn", "qid_max"))
        nqn, qid_max = p.str("nqn"), p.int("qid_max")
        self._sub(nqn)

        def edit(d):
            d["subsystems"][self._subsystem_index(d, nqn)].setdefault("attr", {})["qid_max"] = str(qid_max)

        self._edit(edit, lambda where: "qid_max" if where.endswith("qid_max") else where)
        return True

    # -------------------------------------------------------------------------------- reservations
    # SPDK has no RPC for a namespace's reservations (its state is in each namespace's ptpl file): these are ours.
    def rpc_nvmeof_ns_get_reservation(self, params) -> dict:
        """The reservation of namespace NSID of subsystem NQN: holder, type, generation, PTPL, registrants."""
        p = _Params("nvmeof_ns_get_reservation", params, ("nqn", "nsid"))
        nqn, nsid = p.str("nqn"), p.int("nsid")
        self._sub(nqn)
        try:
            return self.target.reservation_status(nqn, nsid)
        except KeyError:
            raise RpcError(f"{nqn} has no namespace {nsid}", "nsid", "nvmf_get_subsystems lists the namespaces") \
                from None
        except ValueError as exc:
            raise RpcError(str(exc), "nsid", "enable them: nvmeof_ns_set_reservation with enable true") from None

    def rpc_nvmeof_ns_set_reservation(self, params) -> bool:
        """Reservations on or off for a namespace (nvmet's resv_enable, "resv": {"enable": "1"} in the config);
        turning them off is refused while hosts are registered."""
        p = _Params("nvmeof_ns_set_reservation", params, ("nqn", "nsid", "enable"))
        nqn, nsid, enable = p.str("nqn"), p.int("nsid"), p.bool("enable", required=True)
        self._sub(nqn)

        def edit(d):
            n = self._ns_entry(d, nqn, nsid)
            if enable:
                n["resv"] = {"enable": "1"}
            else:
                n.pop("resv", None)

        self._edit(edit, lambda where: "enable" if where.endswith("resv.enable") else _ns_field(where))
        return True


def _dhchap_keys(p: _Params) -> Optional[tuple]:
    """(dhchap_key, dhchap_ctrlr_key) of a method that takes them, or None; each a keyring key's name, a key file's
    path or the secret (config/keys.py checks which when the config is applied)."""
    key = p.str("dhchap_key", required=False)
    ctrl_key = p.str("dhchap_ctrlr_key", required=False)
    if ctrl_key and not key:
        raise RpcError("dhchap_ctrlr_key without dhchap_key", "dhchap_ctrlr_key",
                       "give the host key (dhchap_key) too: bidirectional authentication needs both")
    return (key, ctrl_key) if key else None


def _set_dhchap_keys(entry: dict, key: str, ctrl_key: str) -> None:
    group = dict(entry.get("dhchap") or {})
    group.pop("ctrl_key", None)
    group["key"] = key
    if ctrl_key:
        group["ctrl_key"] = ctrl_key
    entry["dhchap"] = group


def _key_field(where: str) -> str:
    """The RPC parameter of a config error on a host's key, or ''."""
    tail = where.split("]", 1)[1].lstrip(".") if where.startswith("hosts[") else ""
    return {"dhchap.key": "dhchap_key", "dhchap.ctrl_key": "dhchap_ctrlr_key"}.get(tail, "")


def _key_users(config, name: str) -> List[str]:
    """The hosts whose key or controller key is keyring key `name`."""
    return [h.nqn for h in config.host_entries
            if name in ((h.attrs.get("dhchap") or {}).get("key"), (h.attrs.get("dhchap") or {}).get("ctrl_key"))]


def _sub_field(where: str, names: dict) -> str:
    tail = where.split("]", 1)[1].lstrip(".") if where.startswith("subsystems[") else where
    return names.get(tail, where)


def _ns_field(where: str) -> str:
    """A config loader field path inside the new namespace -> the RPC's namespace.KEY."""
    if ".namespaces[" in where:
        tail = where.split(".namespaces[", 1)[1].split("]", 1)[1].lstrip(".")
        if tail in _CONFIG_TO_RPC:
            return f"namespace.{_CONFIG_TO_RPC[tail]}"
        if tail in ("device", "nvmeof_roce", ""):
            return "namespace"
    return where


# nvmf_create_transport's parameters (SPDK's names) -> "port:KEY" (a port parameter of the listeners added
# afterwards), the `target serve` option whose value in force is the only one taken, True/False (a switch: the
# one value that is what this target does), or None (refused: _TRANSPORT_REFUSED says why).
_TRANSPORT_PARAMS: Dict[str, Any] = {
    "max_queue_depth": "port:max_queue_size", "in_capsule_data_size": "port:inline_data_size",
    "max_io_qpairs_per_ctrlr": "--max-queues-per-ctrl", "max_io_size": "--mdts",
    "io_unit_size": "--mdts", "num_shared_buffers": "--data-buffers (per port)",
    "no_srq": True, "zcopy": False, "dif_insert_or_strip": False, "c2h_success": True,
    "max_aq_depth": "fixed", "buf_cache_size": None, "num_cqe": None, "max_srq_depth": None, "sock_priority": None,
    "acceptor_backlog": None, "abort_timeout_sec": None, "no_wr_batching": None, "control_msg_num": None,
    "acceptor_poll_rate": None, "ack_timeout": None, "data_wr_pool_size": None, "disable_command_passthru": None,
    "kas": None, "min_kato": None, "disable_mappable_bar0": None, "disable_adaptive_irq": None,
    "disable_shadow_doorbells": None,
}
_TRANSPORT_PORT_RANGES = {"max_queue_size": USERSPACE_QUEUE_SIZES, "inline_data_size": (0, MAX_INLINE_DATA_SIZE)}
_TRANSPORT_SWITCHES = {
    "no_srq": "each queue of this target has its own receive queue (no shared receive queue)",
    "zcopy": "this target copies through its registered data buffers (no zero-copy from the backend)",
    "dif_insert_or_strip": "this target has no protection information (TCP's DIF insert/strip in SPDK)",
    "c2h_success": "a TCP setting (SPDK ignores it on RDMA); this target serves RDMA",
}
_TCP = "a TCP setting; this target serves RDMA"
_VFIO = "a vfio-user setting; this target serves RDMA"
_TRANSPORT_REFUSED = {
    "buf_cache_size": "no per-poll-group buffer cache: each queue is guaranteed "
                    "--queue-min-buffers of the port's pool", "num_cqe": "the completion queues are sized by the "
                    "queue depth", "max_srq_depth": "no shared receive queue", "sock_priority": _TCP,
    "acceptor_backlog": "the listen backlog is fixed at 128", "abort_timeout_sec": "Abort is answered at once "
    "(the command is not aborted)", "no_wr_batching": "work requests are posted as the data path decides",
    "control_msg_num": _TCP, "acceptor_poll_rate": "connections arrive as rdma_cm events, not by polling",
    "ack_timeout": "the RDMA ACK timeout is the device's default", "data_wr_pool_size": "no WR pool setting",
    "disable_command_passthru": "no command passthru exists to turn off", "kas": "keep alive is always "
    "supported (the host's KATO, up to nvmeof_roce.max_kato)", "min_kato": "no minimum keep-alive timeout "
    "(nvmeof_roce.max_kato is the maximum)", "disable_mappable_bar0": _VFIO, "disable_adaptive_irq": _VFIO,
    "disable_shadow_doorbells": _VFIO,
}


def _listen_address(port) -> dict:
    return {"trtype": port.trtype.upper(), "adrfam": port.adrfam.upper() if port.adrfam.startswith("ip") else
            port.adrfam, "traddr": port.traddr, "trsvcid": port.trsvcid_str}


def _listen_params(la: dict) -> dict:
    for k in la:
        if k not in ("trtype", "adrfam", "traddr", "trsvcid"):
            raise RpcError(f"listen_address: unknown key {k!r}", f"listen_address.{k}",
                           "give trtype, adrfam, traddr, trsvcid")
    trtype = str(la.get("trtype", "rdma")).lower()
    if not registry.serves(trtype):
        raise RpcError(f"listen_address.trtype must be RDMA, got {la.get('trtype')!r}", "listen_address.trtype",
                       'the userspace target serves RDMA only: "trtype": "RDMA"')
    if not la.get("traddr"):
        raise RpcError("listen_address.traddr is required", "listen_address.traddr",
                       "give the IP address of an RDMA netdev, e.g. 10.99.0.1")
    adrfam = la.get("adrfam") or ("ipv6" if ":" in str(la["traddr"]) else "ipv4")  # an IPv6 literal says so
    return {"trtype": "rdma", "adrfam": str(adrfam).lower(), "traddr": str(la["traddr"]),
            "trsvcid": str(la.get("trsvcid", "4420"))}


def _find_port(d: dict, la: dict) -> Optional[dict]:
    for port in d["ports"]:
        a = port.get("addr", {})
        if (a.get("trtype", "rdma"), a.get("traddr"), str(a.get("trsvcid", "4420"))) == \
                (la["trtype"], la["traddr"], la["trsvcid"]):
            return port
    return None


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
