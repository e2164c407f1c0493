"""The namespace methods.  Adding, resizing or removing a namespace is one change: its parameters are parsed as
the config loader parses a namespace (config/loader.py parse_namespace, userspace.py namespace_problems) and
the engine's verb makes it (engine/api.py add_namespace, set_namespace_size, remove_namespace), with the
running config updated from the engine's state; nothing else of the config is re-read.  A namespace's
visibility, QoS limits and reservations edit the running config and apply the difference (control/methods.py
`Control._edit`).  Mixed into control/methods.py's `Control`."""
from __future__ import annotations

from typing import Any, Dict

from ...config import (QOS_LIMITS, USERSPACE_KEY, ConfigError, namespace_problems, parse_flag, parse_namespace,
                       parse_size, raise_all)
from ...config.backends import facts
from ..protocol import RpcError
from .params import Params, config_error

_NS_PARAMS = {  # RPC namespace key -> (where it goes in the config's namespace object)
    "nsid": ("nsid",), "path": ("device", "path"), "uuid": ("device", "uuid"), "nguid": ("device", "nguid"),
    "eui64": ("device", "eui64"), "anagrpid": ("ana_grpid",), "backend": ("nvmeof_roce", "backend"),
    "size": ("nvmeof_roce", "size"), "block_size": ("nvmeof_roce", "block_size"),
    "queue_depth": ("nvmeof_roce", "queue_depth"), "io_engine": ("nvmeof_roce", "io_engine"),
}
_CONFIG_TO_RPC = {".".join(v): k for k, v in _NS_PARAMS.items()}


class NamespaceMethods:
    """nvmf_subsystem_add_ns, nvmf_subsystem_remove_ns, nvmf_subsystem_resize_ns, nvmf_ns_add_host,
    nvmf_ns_remove_host, bdev_set_qos_limit, nvmeof_ns_get_reservation, nvmeof_ns_set_reservation."""

    def rpc_nvmf_subsystem_add_ns(self, params) -> int:
        p = Params("nvmf_subsystem_add_ns", params, ("nqn", "namespace"))
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

        config = self.target.config
        namespaces = config.subsystem(nqn).namespaces
        if any(str(n.nsid) == str(nsid) for n in namespaces):
            raise RpcError(f"{nqn} already has namespace {nsid}", "namespace.nsid",
                           "pick a free NSID, or leave nsid out to get the lowest free one")
        try:
            ns_config = parse_namespace(ns, config, nqn)
            # the same checks as `target check` / `serve`: nothing the userspace target cannot honour
            raise_all(namespace_problems(config.with_namespaces(nqn, namespaces + [ns_config])))
            applying = self.target.add_namespace(nqn, ns_config)
        except ConfigError as exc:
            raise config_error(exc, ns_field) from None
        self._settle(applying)
        return int(nsid) if not isinstance(nsid, str) else int(nsid, 0)

    def rpc_nvmf_subsystem_remove_ns(self, params) -> bool:
        p = Params("nvmf_subsystem_remove_ns", params, ("nqn", "nsid"))
        nqn, nsid = p.str("nqn"), p.int("nsid")
        self._sub(nqn)
        if all(n.nsid != nsid for n in self.target.config.subsystem(nqn).namespaces):
            raise RpcError(f"{nqn} has no namespace {nsid}", "nsid", "nvmf_get_subsystems lists the namespaces")
        try:
            applying = self.target.remove_namespace(nqn, nsid)
        except ConfigError as exc:
            raise config_error(exc) from None
        self._settle(applying)
        return True

    def rpc_nvmf_subsystem_resize_ns(self, params) -> dict:
        p = Params("nvmf_subsystem_resize_ns", params, ("nqn", "nsid", "size"))
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

        config = self.target.config
        namespaces = config.subsystem(nqn).namespaces
        j = next(j for j, n in enumerate(namespaces) if n.nsid == nsid)
        if facts(namespaces[j].backend).sized_by_storage:  # an RBD image: the image is resized, not the config
            try:
                applying = self.target.resize_storage(nqn, nsid, size)
            except ConfigError as exc:
                raise config_error(exc, lambda where: "size") from None
        else:
            applying = self._resize_configured(config, nqn, namespaces, j, size)
        self._settle(applying)

        def answer() -> dict:  # the size in use: made once the namespace's commands in flight drained (call())
            ns = sub.namespaces[nsid]
            return {"nsid": nsid, "size_bytes": ns.num_blocks * ns.block_size, "blocks": ns.num_blocks}
        return answer

    def _resize_configured(self, config, nqn: str, namespaces, j: int, size: int):
        """A namespace whose config gives its size: the config's size changes and the engine follows it."""
        data = namespaces[j].to_dict()  # as the running config has it, with the new size
        data.setdefault(USERSPACE_KEY, {})["size"] = size
        if data[USERSPACE_KEY].get("backend", "file") == "file":
            data[USERSPACE_KEY]["backend"] = "file"
        try:
            ns_config = parse_namespace(data, config, nqn, index=j)
            resized = namespaces[:j] + [ns_config] + namespaces[j + 1:]
            raise_all(namespace_problems(config.with_namespaces(nqn, resized)))
            return self.target.set_namespace_size(nqn, ns_config)
        except ConfigError as exc:
            raise config_error(exc, lambda where: "size" if where.endswith(".size") else ns_field(where)) from None

    def _ns_entry(self, d: dict, nqn: str, nsid: int) -> dict:
        s = d["subsystems"][self._subsystem_index(d, nqn)]
        for n in s["namespaces"]:
            if int(str(n["nsid"]), 0) == nsid:
                return n
        raise RpcError(f"{nqn} has no namespace {nsid}", "nsid", "nvmf_get_subsystems lists the namespaces")

    def _ns_visibility(self, method: str, params, add: bool) -> bool:
        p = Params(method, params, ("nqn", "nsid", "host"))
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

        self._edit(edit, lambda where: "host" if ".visible_hosts[" in where else ns_field(where))
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
        p = Params("bdev_set_qos_limit", params, ("nqn", "nsid", "name") + tuple(QOS_LIMITS))
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

        self._edit(edit, lambda where: where.rsplit(".", 1)[-1] if ".qos." in where else ns_field(where))
        return True

    # -------------------------------------------------------------------------------- reservations
    # SPDK has no RPC for a namespace's reservations (its state is in each namespace's ptpl file): these are ours.

    def rpc_nvmeof_ns_get_reservation(self, params) -> dict:
        """The reservation of namespace NSID of subsystem NQN: holder, type, generation, PTPL, registrants."""
        p = Params("nvmeof_ns_get_reservation", params, ("nqn", "nsid"))
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
        p = Params("nvmeof_ns_set_reservation", params, ("nqn", "nsid", "enable"))
        nqn, nsid, enable = p.str("nqn"), p.int("nsid"), p.bool("enable", required=True)
        self._sub(nqn)

        def edit(d):
            n = self._ns_entry(d, nqn, nsid)
            if enable:
                n["resv"] = {"enable": "1"}
            else:
                n.pop("resv", None)

        self._edit(edit, lambda where: "enable" if where.endswith("resv.enable") else ns_field(where))
        return True


def ns_field(where: str) -> str:
    """A config loader field path inside the new namespace -> the RPC's namespace.KEY."""
    if ".namespaces[" in where:
        tail = where.split(".namespaces[", 1)[1].split("]", 1)[1].lstrip(".")
        if tail in _CONFIG_TO_RPC:
            return f"namespace.{_CONFIG_TO_RPC[tail]}"
        if tail in ("device", "nvmeof_roce", ""):
            return "namespace"
    return where
