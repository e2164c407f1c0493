"""The subsystem methods: create, delete, allow any host, qid_max, and the listeners (a subsystem exported on a
port; an ANA state of its groups there).  Each edits the running config and applies the difference
(control/methods.py `Control._edit`).  Mixed into control/methods.py's `Control`."""
from __future__ import annotations

from ...config import ANA_STATES, DISCOVERY_NQN
from ...output import address
from ..protocol import RpcError
from .params import Params
from .transports import find_port, listen_params


class SubsystemMethods:
    """nvmf_create_subsystem, nvmf_delete_subsystem, nvmf_subsystem_allow_any_host, nvmeof_subsystem_set_qid_max,
    nvmf_subsystem_add_listener, nvmf_subsystem_remove_listener, nvmf_subsystem_listener_set_ana_state."""

    def rpc_nvmf_create_subsystem(self, params) -> bool:
        p = Params("nvmf_create_subsystem", params, ("nqn", "serial_number", "model_number", "allow_any_host",
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
        p = Params("nvmf_delete_subsystem", params, ("nqn",))
        nqn = p.str("nqn")

        def edit(d):
            del d["subsystems"][self._subsystem_index(d, nqn)]
            for port in d["ports"]:
                if nqn in port["subsystems"]:
                    port["subsystems"].remove(nqn)

        self._edit(edit)
        return True

    def rpc_nvmf_subsystem_allow_any_host(self, params) -> bool:
        p = Params("nvmf_subsystem_allow_any_host", params, ("nqn", "allow_any_host"))
        nqn = p.str("nqn")
        allow = p.bool("allow_any_host", required=True)
        self._sub(nqn)

        def edit(d):
            d["subsystems"][self._subsystem_index(d, nqn)]["attr"]["allow_any_host"] = "1" if allow else "0"

        self._edit(edit, lambda where: "allow_any_host" if where.endswith("allow_any_host") else where)
        return True

    def rpc_nvmeof_subsystem_set_qid_max(self, params) -> bool:
        """The most I/O queues a controller of the subsystem may have (nvmet's attr_qid_max).  As nvmet does,
        the subsystem's controllers are ended, so their hosts reconnect and are granted the new count."""
        p = Params("nvmeof_subsystem_set_qid_max", params, ("nqn", "qid_max"))
        nqn, qid_max = p.str("nqn"), p.int("qid_max")
        self._sub(nqn)

        def edit(d):
            d["subsystems"][self._subsystem_index(d, nqn)].setdefault("attr", {})["qid_max"] = str(qid_max)

        self._edit(edit, lambda where: "qid_max" if where.endswith("qid_max") else where)
        return True

    def rpc_nvmf_subsystem_add_listener(self, params) -> bool:
        p = Params("nvmf_subsystem_add_listener", params, ("nqn", "listen_address"))
        nqn = p.str("nqn")
        la = listen_params(p.dict("listen_address"))
        if nqn != DISCOVERY_NQN:
            self._sub(nqn)

        def edit(d):
            port = find_port(d, la)
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

    def rpc_nvmf_subsystem_remove_listener(self, params) -> bool:
        p = Params("nvmf_subsystem_remove_listener", params, ("nqn", "listen_address"))
        nqn = p.str("nqn")
        la = listen_params(p.dict("listen_address"))
        self._sub(nqn)

        def edit(d):
            port = find_port(d, la)
            if port is None or nqn not in port["subsystems"]:
                raise RpcError(f"{nqn} does not listen on {address(la['traddr'], la['trsvcid'])}", "listen_address",
                               "nvmf_get_subsystems lists each subsystem's listen_addresses")
            port["subsystems"].remove(nqn)

        self._edit(edit)
        return True

    def rpc_nvmf_subsystem_listener_set_ana_state(self, params) -> bool:
        """SPDK's method: the ANA state of the listener's groups (`anagrpid`, or every group the subsystem's
        namespaces use).  ANA state here is per port and group (engine/ana.py), so it applies to every subsystem
        of that group on that port.  Same effect as `target ana-state`, through the config: with persist on,
        it is saved; a reload of a file with other states applies the file's."""
        p = Params("nvmf_subsystem_listener_set_ana_state", params,
                    ("nqn", "listen_address", "ana_state", "anagrpid"))
        nqn = p.str("nqn")
        la = listen_params(p.dict("listen_address"))
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
            port = find_port(d, la)
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


def _sub_field(where: str, names: dict) -> str:
    tail = where.split("]", 1)[1].lstrip(".") if where.startswith("subsystems[") else where
    return names.get(tail, where)
