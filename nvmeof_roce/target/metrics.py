"""The opt-in Prometheus endpoint of `target serve --metrics ADDR:PORT` (prometheus_client).

The HTTP server runs in prometheus_client's own thread; it never touches the target's objects.  The event
loop takes a snapshot of the figures once a second (`Metrics.tick`, a Target tick hook) and the collector
reads only the latest snapshot, so a scrape neither blocks nor races the loop.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Optional, Tuple

from ..errors import NvmeofError
from .stats import transport_status

log = logging.getLogger(__name__)

PROMETHEUS_BUCKET_STEP = 4  # every 4th latency bucket of stats.py: the powers of two, 1 us .. 67 s


def parse_listen(text: str) -> Tuple[str, int]:
    """'ADDR:PORT', ':PORT' or 'PORT' -> (addr, port); the address defaults to 127.0.0.1 (local only)."""
    addr, _, port = text.rpartition(":")
    addr = addr.strip("[]") or "127.0.0.1"
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not 1 <= number <= 65535:
        raise NvmeofError(f"--metrics {text!r}: not ADDR:PORT", "give e.g. --metrics 127.0.0.1:9712 (or :9712)")
    return addr, number


class Metrics:
    """Counters and histograms for every namespace, controller and queue, from the latest snapshot."""

    def __init__(self, target, server=None, clock=time.monotonic):
        self.target = target
        self.server = server
        self.clock = clock
        self.snapshot: Optional[dict] = None
        self._last = -math.inf
        self.http = None
        self.thread = None

    def tick(self, _now: float = 0.0) -> None:
        now = self.clock()
        if now - self._last >= 1.0:
            self._last = now
            self.snapshot = self.take_snapshot()

    def take_snapshot(self) -> dict:
        namespaces = []
        for nqn, sub in self.target.subsystems.items():
            for nsid, ns in sub.namespaces.items():
                namespaces.append({
                    "labels": (nqn, str(nsid)), "reads": ns.read_commands, "writes": ns.write_commands,
                    "bytes_read": ns.bytes_read, "bytes_written": ns.bytes_written, "errors": ns.stats.errors,
                    "size": ns.num_blocks * ns.block_size,
                    "read_latency": (ns.stats.read_latency.cumulative(), ns.stats.read_latency.sum_us / 1e6),
                    "write_latency": (ns.stats.write_latency.cumulative(), ns.stats.write_latency.sum_us / 1e6),
                })
        controllers = {}
        queues = {}
        for ctrl in self.target.controllers():
            key = (ctrl.subsystem.nqn, ctrl.hostnqn)
            controllers[key] = controllers.get(key, 0) + 1
            queues[key] = queues.get(key, 0) + len(ctrl.queues())
        return {"namespaces": namespaces, "controllers": controllers, "queues": queues,
                "internal_errors": self.target.internal_errors, "transport": transport_status(self.server)}

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
        snap = self.snapshot
        if snap is None:
            return
        ns_labels = ["subnqn", "nsid"]
        fams = {
            "reads": CounterMetricFamily("nvmeof_roce_namespace_reads", "Read commands completed", labels=ns_labels),
            "writes": CounterMetricFamily("nvmeof_roce_namespace_writes", "Write commands completed",
                                          labels=ns_labels),
            "bytes_read": CounterMetricFamily("nvmeof_roce_namespace_read_bytes", "Bytes read", labels=ns_labels),
            "bytes_written": CounterMetricFamily("nvmeof_roce_namespace_written_bytes", "Bytes written",
                                                 labels=ns_labels),
            "errors": CounterMetricFamily("nvmeof_roce_namespace_io_errors", "Backend read/write failures",
                                          labels=ns_labels),
        }
        size = GaugeMetricFamily("nvmeof_roce_namespace_size_bytes", "Namespace size", labels=ns_labels)
        lat = {kind: HistogramMetricFamily(f"nvmeof_roce_namespace_{kind}_latency_seconds",
                                           f"{kind.capitalize()} command latency inside the target",
                                           labels=ns_labels, unit="")
               for kind in ("read", "write")}
        for ns in snap["namespaces"]:
            labels = list(ns["labels"])
            for key, fam in fams.items():
                fam.add_metric(labels, ns[key])
            size.add_metric(labels, ns["size"])
            for kind in ("read", "write"):
                cumulative, total_s = ns[f"{kind}_latency"]
                buckets = [(_le(b), n) for i, (b, n) in enumerate(cumulative)
                           if i % PROMETHEUS_BUCKET_STEP == 0 or math.isinf(b)]
                lat[kind].add_metric(labels, buckets, total_s)
        yield from fams.values()
        yield size
        yield from lat.values()
        ctrls = GaugeMetricFamily("nvmeof_roce_controllers", "Connected controllers", labels=["subnqn", "hostnqn"])
        qs = GaugeMetricFamily("nvmeof_roce_queues", "Connected queues (admin and I/O)", labels=["subnqn", "hostnqn"])
        for key, n in snap["controllers"].items():
            ctrls.add_metric(list(key), n)
            qs.add_metric(list(key), snap["queues"][key])
        yield ctrls
        yield qs
        yield CounterMetricFamily("nvmeof_roce_internal_errors", "Commands answered with Internal Error",
                                  value=snap["internal_errors"])
        transport = snap["transport"]
        longest = transport["loop"].get("longest_pass_s")
        if longest is not None:
            yield GaugeMetricFamily("nvmeof_roce_loop_longest_pass_seconds", "Longest event loop pass",
                                    value=longest)
        pool_free = GaugeMetricFamily("nvmeof_roce_pool_free_chunks", "Free data buffers", labels=["listener"])
        pool_used = GaugeMetricFamily("nvmeof_roce_pool_used_chunks", "Data buffers in use", labels=["listener"])
        wc_err = CounterMetricFamily("nvmeof_roce_rdma_errors", "Failed RDMA work completions", labels=["listener"])
        for lst in transport["listeners"]:
            pool = lst.get("pool") or {}
            if pool.get("free") is not None:
                pool_free.add_metric([lst["address"]], pool["free"])
            if pool.get("in_use") is not None:
                pool_used.add_metric([lst["address"]], pool["in_use"])
            if lst.get("wc_errors") is not None:
                wc_err.add_metric([lst["address"]], lst["wc_errors"])
        yield pool_free
        yield pool_used
        yield wc_err

    def start(self, listen: str) -> str:
        """Serve /metrics on `listen` (ADDR:PORT); returns the URL."""
        try:
            import prometheus_client
        except ImportError:
            raise NvmeofError("--metrics needs the prometheus_client library, which is not installed",
                              "install it (pip install prometheus_client; it is a dependency of nvmeof-roce)") \
                from None
        addr, port = parse_listen(listen)
        registry = prometheus_client.CollectorRegistry(auto_describe=False)
        registry.register(self)
        self.snapshot = self.take_snapshot()
        self.target.tick_hooks.append(self.tick)
        try:
            self.http, self.thread = prometheus_client.start_http_server(port, addr, registry)
        except OSError as exc:
            raise NvmeofError(f"--metrics {listen}: cannot listen: {exc.strerror}",
                              "pick a free port, or an address of this machine") from None
        url = f"http://{addr}:{port}/metrics"
        log.warning("metrics on %s", url)
        return url

    def close(self) -> None:
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
            self.http = None


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(bound)
