"""The control socket of `serve --workers`: the supervisor answers every JSON-RPC call from its workers.

A call is answered from every worker (lists joined, counts added), a change is made on every worker in turn
(worker 0 first: a refusal there changes nothing), and a few methods whose worker-wide meaning would differ
from one process's are refused with the reason.  Requests are read and answered with control/protocol.py's
framing and request handling, as the single-process server (control/server.py) does.
"""
from __future__ import annotations

import copy
import json
import socket
from typing import Any, Callable, Dict, List

from ..errors import NvmeofError
from ..config.backends import facts
from .protocol import METHOD_NOT_FOUND, RequestFramer, RpcError, answer_framed


# How the supervisor answers a control call: methods whose answers are joined from every worker; methods it
# refuses because a worker-wide meaning would differ from the single-process one; the rest go to every worker.
GATHERED = ("rpc_get_methods", "nvmf_get_subsystems", "nvmf_subsystem_get_controllers", "nvmf_subsystem_get_qpairs",
            "nvmf_get_stats", "nvmeof_get_status", "nvmf_get_transports", "keyring_get_keys")
NAMESPACE_SUMS = ("read_commands", "write_commands", "bytes_read", "bytes_written", "errors", "iops",
                  "read_bytes_per_s", "write_bytes_per_s")
REFUSED = {
    "nvmf_subsystem_add_listener": "each worker listens on its own port (trsvcid + worker index)",
    "nvmf_subsystem_remove_listener": "each worker listens on its own port (trsvcid + worker index)",
    "save_config": "the workers' configs are derived from CONFIG (ports and CNTLID ranges split per worker)",
    "nvmf_create_transport": "its port parameters are for listeners added by RPC, which each worker opens on its "
                             "own port",
}
# The supervisor's own call to its workers (service/worker_resv.py: a reservation change pushed to each worker),
# not a method of the control socket: not answered there, nor passed on.
WORKER_RESV_PUSH = "nvmeof_worker_reservations"
# nvmf_subsystem_listener_set_ana_state goes to every worker: each knows every worker's ports (the discovery log
# lists them all), so each sets the state of that port's group, and a worker restarted later starts with it.


class SupervisorControl:
    """The control socket of `serve --workers`: the same JSON-RPC methods as one process, answered by all
    workers (`call_worker(i, method, params)` reaches worker i's socket)."""

    def __init__(self, workers: int, call_worker: Callable[[int, str, Any], Any],
                 reload: Callable[[str, bool], dict], metrics_text: Callable[[], str],
                 saved: Callable[[int], None] = lambda i: None, identity: Callable[[], dict] = dict,
                 changed: Callable[[], None] = lambda: None):
        self.workers = workers
        self._identity = identity  # {"config": CONFIG, "socket": the supervisor's socket} for the status
        self.call_worker = call_worker
        self._reload = reload
        self._metrics_text = metrics_text
        self._saved = saved  # after a change: the supervisor keeps worker i's running config for its restart
        self._changed = changed  # after a change every worker made: CONFIG is written once (--persist)

    def call(self, method: str, params: Any = None) -> Any:
        if method == "nvmeof_reload_config":
            p = params or {}
            if not isinstance(p, dict) or set(p) - {"path", "dry_run"}:
                raise RpcError("nvmeof_reload_config takes path and dry_run", "params", '{"dry_run": true}')
            return self._reload(p.get("path") or "", bool(p.get("dry_run", False)))
        if method == "nvmeof_get_metrics":
            return self._metrics_text()
        if method == WORKER_RESV_PUSH:
            raise RpcError(f"method {method!r} not found", "method",
                           "rpc_get_methods lists the methods (nvmeof-roce rpc rpc_get_methods)", METHOD_NOT_FOUND)
        if method in REFUSED:
            raise RpcError(f"{method} is not available under serve --workers: {REFUSED[method]}", "method",
                           "edit CONFIG and run 'nvmeof-roce target reload' (every worker applies it)")
        if method == "nvmf_subsystem_add_ns" and isinstance(params, dict) and \
                facts((params.get("namespace") or {}).get("backend", "file")).memory:
            raise RpcError("a RAM namespace added live would be a separate RAM disk in each worker, not one "
                           "namespace", "namespace.backend",
                           "add it to CONFIG and run 'nvmeof-roce target reload' (the workers then share one RAM "
                           "file), or add a file namespace")
        if method in GATHERED:
            return self._gather(method, [self.call_worker(i, method, params) for i in range(self.workers)])
        return self._everywhere(method, params)

    def _everywhere(self, method: str, params: Any) -> Any:
        """A change: worker 0 first (a refusal there changes nothing), then the others in turn."""
        results = []
        for i in range(self.workers):
            try:
                results.append(self.call_worker(i, method, params))
            except (RpcError, NvmeofError) as exc:
                if i == 0:
                    raise
                fix = exc.fix
                raise RpcError(f"applied by worker(s) 0..{i - 1}, refused by worker {i}: {exc.message}",
                               exc.field, f"{fix}; then 'nvmeof-roce target reload' makes the "
                               "workers agree again with CONFIG".lstrip("; ")) from None
            self._saved(i)
        self._changed()
        return results[0]

    def _gather(self, method: str, answers: List[Any]) -> Any:
        first = answers[0]
        if method in ("rpc_get_methods", "nvmf_get_subsystems", "nvmf_get_transports", "keyring_get_keys"):
            return first  # every worker serves the same subsystems, knows every port, has the same options and keyring
        if method in ("nvmf_subsystem_get_controllers", "nvmf_subsystem_get_qpairs"):
            return [dict(item, worker=i) for i, answer in enumerate(answers) for item in answer]
        if method == "nvmf_get_stats":
            out = dict(first)
            out["poll_groups"] = [dict(g, name=f"worker{i}_{g['name']}") for i, a in enumerate(answers)
                                  for g in a["poll_groups"]]
            out["namespaces"] = _sum_namespaces([a["namespaces"] for a in answers])
            out["internal_errors"] = sum(a["internal_errors"] for a in answers)
            return out
        # nvmeof_get_status
        out = copy.deepcopy(first)
        for key in ("internal_errors", "in_flight"):
            out[key] = sum(a[key] for a in answers)
        out["discovery_controllers"] = [dict(c, worker=i) for i, a in enumerate(answers)
                                        for c in a["discovery_controllers"]]
        for j, sub in enumerate(out["subsystems"]):
            sub["controllers"] = [dict(c, worker=i) for i, a in enumerate(answers)
                                  for c in a["subsystems"][j]["controllers"]]
            sub["namespaces"] = _sum_namespaces([a["subsystems"][j]["namespaces"] for a in answers])
        hosts: Dict[str, dict] = {}
        for i, a in enumerate(answers):
            for h in a["hosts"]:
                entry = hosts.setdefault(h["hostnqn"], {"hostnqn": h["hostnqn"], "controllers": []})
                entry["controllers"] += [dict(c, worker=i) for c in h["controllers"]]
        out["hosts"] = list(hosts.values())
        out["transport"] = {"listeners": [dict(lst, worker=i) for i, a in enumerate(answers)
                                          for lst in a["transport"]["listeners"]],
                            "loop": max((a["transport"]["loop"] for a in answers),
                                        key=lambda loop: loop.get("longest_pass_s") or 0)}
        out["workers"] = [{"worker": i, "config": a["config"], "socket": a["socket"]} for i, a in enumerate(answers)]
        out.update(self._identity())
        return out


def _sum_namespaces(per_worker: List[List[dict]]) -> List[dict]:
    """One namespace list from every worker's: counts and rates added (latency percentiles are worker 0's;
    each worker's own are in its status on RUN_DIR/worker-I.sock)."""
    out = copy.deepcopy(per_worker[0])
    for other in per_worker[1:]:
        by_nsid = {ns["nsid"]: ns for ns in other}
        for ns in out:
            theirs = by_nsid.get(ns["nsid"], {})
            for key in NAMESPACE_SUMS:
                if isinstance(ns.get(key), (int, float)) and isinstance(theirs.get(key), (int, float)):
                    ns[key] += theirs[key]
    return out


class ControlSocket:
    """The supervisor's Unix socket: one request at a time, answered before the next is read."""

    def __init__(self, sock: socket.socket, call: Callable[[str, Any], Any]):
        self.sock = sock
        self.call = call  # SupervisorControl.call: the one dispatch of a request
        self.sock.setblocking(False)

    def serve_one(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        with conn:
            answer_connection(conn, self.call)


def answer_connection(conn: socket.socket, call: Callable[[str, Any], Any], read_timeout: float = 5.0) -> None:
    """One request read from `conn` and answered (`call(method, params)`), with the single-process server's size
    and depth limits; the caller closes it."""
    conn.settimeout(read_timeout)
    framer = RequestFramer()
    try:
        items: List[tuple] = []
        while not items:
            chunk = conn.recv(65536)
            if not chunk:
                return
            items = framer.feed(chunk)
        response = answer_framed(call, items[0])
    except OSError:
        return
    if response is not None:
        try:
            conn.sendall(json.dumps(response).encode("utf-8") + b"\n")
        except OSError:
            pass
