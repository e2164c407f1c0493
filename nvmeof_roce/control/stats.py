"""Figures of a running target: per-namespace latency percentiles, rates, and the status snapshot.

The I/O path only adds to counters and one histogram bucket per command (`engine/latency.py`); rates and
percentiles are computed when someone asks (`target status`, the metrics endpoint), from samples the event
loop takes once a second (`Sampler.tick`).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Deque, Dict, List, Optional, Tuple

from ..transport.registry import closing_queues


def ns_counters(ns) -> Tuple[int, int, int, int]:
    return ns.read_commands, ns.write_commands, ns.bytes_read, ns.bytes_written


class Sampler:
    """Keeps a few seconds of counter samples per namespace to report rates (IOPS, bytes per second)."""

    def __init__(self, target, window: float = 5.0, clock=time.monotonic):
        self.target = target
        self.window = window
        self.clock = clock
        self.samples: Deque[Tuple[float, Dict[Tuple[str, int], tuple]]] = deque()
        self._last = 0.0

    def tick(self, _now: float = 0.0) -> None:
        now = self.clock()
        if now - self._last < 1.0:
            return
        self._last = now
        self.samples.append((now, self._snapshot()))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window:
            self.samples.popleft()

    def _snapshot(self) -> Dict[Tuple[str, int], tuple]:
        return {(nqn, nsid): ns_counters(ns) for nqn, sub in self.target.subsystems.items()
                for nsid, ns in sub.namespaces.items()}

    def rates(self, nqn: str, ns) -> Dict[str, float]:
        """Per-second rates over the window (from the oldest sample to now)."""
        now = self.clock()
        current = ns_counters(ns)
        for when, snap in self.samples:
            before = snap.get((nqn, ns.nsid))
            if before is not None and now - when > 0.2:
                span = now - when
                d = [max(0, c - b) for c, b in zip(current, before)]
                return {"read_iops": round(d[0] / span, 1), "write_iops": round(d[1] / span, 1),
                        "iops": round((d[0] + d[1]) / span, 1), "read_bytes_per_s": round(d[2] / span),
                        "write_bytes_per_s": round(d[3] / span), "window_s": round(span, 2)}
        return {"read_iops": 0.0, "write_iops": 0.0, "iops": 0.0, "read_bytes_per_s": 0, "write_bytes_per_s": 0,
                "window_s": 0.0}


# ------------------------------------------------------------------------------------------- status

def namespace_status(nqn: str, ns, sampler: Optional[Sampler]) -> dict:
    stats = ns.stats  # engine/latency.py NamespaceStats
    d = {
        "nsid": ns.nsid, "backend": ns.config.backend, "path": ns.config.path, "block_size": ns.block_size,
        "blocks": ns.num_blocks, "size_bytes": ns.num_blocks * ns.block_size, "uuid": ns.config.uuid,
        "read_commands": ns.read_commands, "write_commands": ns.write_commands,
        "bytes_read": ns.bytes_read, "bytes_written": ns.bytes_written, "errors": stats.errors,
        "read_latency_us": stats.read_latency.percentiles(),
        "write_latency_us": stats.write_latency.percentiles(),
        # file and block namespaces: the I/O engine (engine/ioengine.py), why, and its commands in flight
        "io": ns.engine_status(),
        # its reservation (engine/reservations.py): holder, type, registrants; None without reservations
        "reservation": ns.resv.status() if ns.resv is not None else None,
    }
    d.update(sampler.rates(nqn, ns) if sampler is not None else {})
    return d


def queue_status(qs) -> dict:
    status = {"qid": qs.qid, "depth": qs.depth, "sqsize": qs.sqsize, "active": qs.active,
              "peer": qs.transport.request.peer or ""}
    polling = getattr(qs.transport, "polling_status", None)  # a native queue's (transport/rdma/native_queue.py)
    if polling is not None:
        status["polling"] = polling()
    return status


def controller_status(ctrl) -> dict:
    queues = [queue_status(q) for q in sorted(ctrl.queues(), key=lambda q: q.qid)]
    return {"cntlid": ctrl.cntlid, "hostnqn": ctrl.hostnqn, "hostid": bytes(ctrl.hostid).hex() if ctrl.hostid else "",
            "portid": ctrl.port.portid, "kato_ms": ctrl.kato_ms, "ready": ctrl.ready,
            "num_io_qpairs": len(ctrl.io_queues), "queues": queues}


def transport_status(server) -> dict:
    """The event loop's longest pass, and each listener's figures (transport/base.py `Listener.status`)."""
    if server is None:
        return {"loop": {}, "listeners": []}
    loop = getattr(server, "loop", None)
    longest = getattr(loop, "longest_pass", None)
    return {"loop": {"longest_pass_s": longest if isinstance(longest, (int, float)) else None},
            "listeners": [lst.status() for lst in getattr(server, "listeners", [])],
            # native queues closed while their backend still held commands (docs/native.md, "Closing a queue")
            "closing_queues": closing_queues()}


def port_status(target) -> List[dict]:
    """Every configured port: its address, its subsystems and the state of each ANA group there (engine/ana.py),
    what `target ana-state` shows and changes."""
    states = target.ana.states()
    return [{"portid": p.portid, "trtype": p.trtype, "adrfam": p.adrfam, "traddr": p.traddr,
             "trsvcid": p.trsvcid_str, "subsystems": list(p.subsystems),
             "ana_groups": [{"grpid": g, "state": s} for g, s in sorted(states.get(p.portid, {}).items())]}
            for p in target.config.ports]


def target_status(target, sampler: Optional[Sampler] = None, server=None, socket_path: str = "") -> dict:
    subsystems = []
    for nqn, sub in target.subsystems.items():
        ports = [p.portid for p in target.config.ports if nqn in p.subsystems]
        subsystems.append({
            "nqn": nqn, "allow_any_host": sub.allow_any_host, "allowed_hosts": sorted(sub.allowed_hosts),
            "ports": ports,
            "namespaces": [namespace_status(nqn, ns, sampler) for _, ns in sorted(sub.namespaces.items())],
            "controllers": [controller_status(c) for _, c in sorted(sub.controllers.items())],
        })
    hosts: Dict[str, dict] = {}
    for ctrl in target.controllers():
        h = hosts.setdefault(ctrl.hostnqn, {"hostnqn": ctrl.hostnqn, "controllers": []})
        h["controllers"].append({"subnqn": ctrl.subsystem.nqn, "cntlid": ctrl.cntlid,
                                 "io_queues": sorted(ctrl.io_queues)})
    return {
        "config": target.config.source, "socket": socket_path, "genctr": target.genctr,
        "internal_errors": target.internal_errors, "in_flight": target.in_flight(),
        "subsystems": subsystems, "hosts": list(hosts.values()), "ports": port_status(target),
        "discovery_controllers": [controller_status(c) for c in target.discovery.controllers.values()],
        "transport": transport_status(server),
        "data_path": getattr(server, "data_path", "python"),  # the I/O queues' (docs/native.md)
        "data_path_reason": getattr(server, "data_path_reason", ""),  # why that one (service/serve.py)
        "poll": getattr(server, "poll", "interrupt"),  # how native queues find completions (tunables.POLL)
        "cores": getattr(server, "cores", 1),  # poll-group threads (tunables.CORES)
        "poll_groups": server.poll_groups.status() if getattr(server, "poll_groups", None) is not None else [],
    }
