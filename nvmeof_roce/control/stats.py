"""Figures of a running target: per-namespace latency percentiles, rates, and the status snapshot.

The I/O path only adds to counters and one histogram bucket per command (`engine/latency.py`); rates and
percentiles are computed when someone asks (`target status`, the metrics endpoint), from samples the event
loop takes once a second (`Sampler.tick`).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Deque, Dict, List, Optional, Protocol, Tuple

from ..transport import registry
from ..transport.contracts import Listener, Loop
from ..tunables import CORES, POLL


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
    polling = qs.transport.polling_status()  # a queue that polls (transport/contracts.py TargetQueue)
    if polling is not None:
        status["polling"] = polling
    return status


def controller_status(ctrl) -> dict:
    queues = [queue_status(q) for q in sorted(ctrl.queues(), key=lambda q: q.qid)]
    return {"cntlid": ctrl.cntlid, "hostnqn": ctrl.hostnqn, "hostid": bytes(ctrl.hostid).hex() if ctrl.hostid else "",
            "portid": ctrl.port.portid, "kato_ms": ctrl.kato_ms, "ready": ctrl.ready,
            "num_io_qpairs": len(ctrl.io_queues), "queues": queues}


class Served(Protocol):
    """What `target status` reads of the service that runs the target (service/serve.py `TargetServer`)."""

    loop: Loop
    listeners: List[Listener]
    data_path: str  # the I/O queues' data path (docs/native.md)
    data_path_reason: str  # why that one
    poll: str  # how queues that poll find completions (tunables.POLL)
    cores: int  # poll-group threads (tunables.CORES)

    def transport_options(self) -> dict:
        """The served transports' options (each entry's `dump_opts`), merged."""


def transport_status(server: Optional[Served]) -> dict:
    """The event loop's longest pass, each listener's figures (transport/contracts.py `Listener.status`) and
    the figures of every registered transport (`TransportOps.figures`)."""
    if server is None:
        return {"loop": {}, "listeners": []}
    return {"loop": {"longest_pass_s": server.loop.longest_pass},
            "listeners": [lst.status() for lst in server.listeners], **registry.figures()}


def port_status(target) -> List[dict]:
    """Every configured port: its address, its subsystems and the state of each ANA group there (engine/ana.py),
    what `target ana-state` shows and changes."""
    states = target.ana.states()
    return [{"portid": p.portid, "trtype": p.trtype, "adrfam": p.adrfam, "traddr": p.traddr,
             "trsvcid": p.trsvcid_str, "subsystems": list(p.subsystems),
             "ana_groups": [{"grpid": g, "state": s} for g, s in sorted(states.get(p.portid, {}).items())]}
            for p in target.config.ports]


def target_status(target, sampler: Optional[Sampler] = None, server: Optional[Served] = None,
                  socket_path: str = "") -> dict:
    subsystems = []
    for nqn, sub in target.subsystems.items():
        ports = [p.portid for p in target.config.ports if nqn in p.subsystems]
        subsystems.append({
            "nqn": nqn, "allow_any_host": sub.allow_any_host, "allowed_hosts": sorted(sub.allowed_hosts),
            "ports": ports,
            "namespaces": [namespace_status(nqn, ns, sampler) for _, ns in sorted(sub.namespaces.items())],
            # namespaces whose storage did not answer yet (engine/pending.py): not seen by hosts, retried
            "pending_namespaces": target.pending.status(nqn),
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
        # without a service (the unit tests' loopback target): the Python data path, nothing polled
        "data_path": server.data_path if server is not None else "python",  # the I/O queues' (docs/native.md)
        "data_path_reason": server.data_path_reason if server is not None else "",  # why (service/serve.py)
        "poll": server.poll if server is not None else POLL.default,
        "cores": server.cores if server is not None else CORES.default,
        "poll_groups": server.transport_options().get("poll_groups", []) if server is not None else [],
    }
