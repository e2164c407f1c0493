"""The opt-in Prometheus endpoint of `target serve --metrics ADDR:PORT` (prometheus_client).

The HTTP server runs in its own thread; it never touches the target's objects.  The event loop takes a
snapshot of the figures once a second (`Metrics.tick`, a Target tick hook) and the collector reads only the
latest snapshot, so a scrape neither blocks nor races the loop.  The registry also carries the process's own
`process_*` figures and `nvmeof_roce_build_info`.  Under `serve --workers` each worker hands its exposition
to the supervisor over its control socket (`nvmeof_get_metrics`), which serves them all with a `worker`
label (`WorkerMetrics`).

The HTTP server is the standard library's, serving `prometheus_client.generate_latest`: prometheus_client's
own `start_http_server` returns nothing before 0.20 (Debian 12 has 0.16), so it could not be stopped.
"""
from __future__ import annotations

import http.server
import logging
import math
import platform
import threading
import time
from typing import Callable, Iterable, List, Optional, Tuple

from .. import __version__
from ..errors import NvmeofError
from ..control.stats import transport_status

log = logging.getLogger(__name__)

PROMETHEUS_BUCKET_STEP = 4  # every 4th latency bucket of engine/latency.py: the powers of two, 1 us .. 67 s


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
        self.registry = None
        self.group = None  # service/group.py GroupMember of a gateway of a group (serve.py sets it)

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
                "internal_errors": self.target.internal_errors, "transport": transport_status(self.server),
                "group": self.group.status() if self.group is not None else None}

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
        if snap.get("group"):
            yield from group_metrics(snap["group"])

    def attach(self):
        """Start taking snapshots on the target's loop; the registry to expose (this, process_*, build info)."""
        if self.registry is None:
            self.registry = make_registry(self)
            self.snapshot = self.take_snapshot()
            self.target.tick_hooks.append(self.tick)
        return self.registry

    def text(self) -> str:
        """The current figures in Prometheus' text format (what a worker hands its supervisor)."""
        return exposition(self.attach())

    def start(self, listen: str) -> str:
        """Serve /metrics on `listen` (ADDR:PORT); returns the URL."""
        self.http = MetricsHttpServer(listen, self.attach())
        return self.http.url

    def close(self) -> None:
        if self.http is not None:
            self.http.close()
            self.http = None
        try:
            self.target.tick_hooks.remove(self.tick)
        except ValueError:
            pass


def group_metrics(group: dict):
    """A gateway of a group: per ANA group, whether it is optimized here and how long its lease lets this gateway
    serve it; the take-overs and hand-backs counted since start (docs/gateway-group.md)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    served = GaugeMetricFamily("nvmeof_roce_group_ana_optimized", "1 when this gateway serves the ANA group",
                               labels=["group", "ana_group", "owner"])
    lease = GaugeMetricFamily("nvmeof_roce_group_lease_remaining_seconds",
                              "How long this gateway may still serve the ANA group without a renew",
                              labels=["group", "ana_group"])
    for a in group["ana_groups"]:
        served.add_metric([group["group"], str(a["ana_group"]), a["owner"] or ""], 1 if a["here"] == "optimized"
                          else 0)
        if a["serving_for"] is not None:
            lease.add_metric([group["group"], str(a["ana_group"])], a["serving_for"])
    events = CounterMetricFamily("nvmeof_roce_group_events", "Take-overs, hand-backs and stops of ANA groups",
                                 labels=["group", "event"])
    for event, n in sorted(group["event_counts"].items()):
        events.add_metric([group["group"], event], n)
    yield served
    yield lease
    yield events
    yield _fenced(group)


def _fenced(group: dict):
    from prometheus_client.core import GaugeMetricFamily
    fam = GaugeMetricFamily("nvmeof_roce_group_fenced", "1 when the group fenced (blocklisted) this gateway",
                            labels=["group"])
    fam.add_metric([group["group"]], 1 if group["fenced"] else 0)
    return fam


def _prometheus():
    try:
        import prometheus_client
    except ImportError:
        raise NvmeofError("metrics need the prometheus_client library, which is not installed",
                          "install it (pip install prometheus_client; it is a dependency of nvmeof-roce)") from None
    return prometheus_client


class BuildInfo:
    """nvmeof_roce_build_info{version, python} 1: which build answers (the usual *_build_info gauge)."""

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily
        fam = GaugeMetricFamily("nvmeof_roce_build_info", "The nvmeof-roce version and Python running it",
                                labels=["version", "python"])
        fam.add_metric([__version__, platform.python_version()], 1)
        yield fam


def make_registry(*collectors):
    """A registry with `collectors`, this process's process_*/python_info figures and the build info."""
    prometheus_client = _prometheus()
    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    prometheus_client.ProcessCollector(registry=registry)
    prometheus_client.PlatformCollector(registry=registry)
    registry.register(BuildInfo())
    for collector in collectors:
        registry.register(collector)
    return registry


def exposition(registry) -> str:
    """The registry in Prometheus' text format."""
    return _prometheus().generate_latest(registry).decode("utf-8")


class MetricsHttpServer:
    """GET /metrics on ADDR:PORT from a thread of its own, stoppable (close)."""

    def __init__(self, listen: str, registry):
        prometheus_client = _prometheus()
        addr, port = parse_listen(listen)

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path.split("?", 1)[0] not in ("/", "/metrics"):
                    self.send_error(404, "only /metrics is served here")
                    return
                try:
                    body = prometheus_client.generate_latest(registry)
                except Exception as exc:  # a collector failed: say so to the scraper, keep serving
                    log.exception("metrics collection failed")
                    self.send_error(500, f"collection failed: {exc}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", prometheus_client.CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args):  # scrapes are not worth a log line each
                pass

        server_class = http.server.ThreadingHTTPServer
        if ":" in addr:
            server_class = type("ThreadingHTTPServer6", (http.server.ThreadingHTTPServer,),
                                {"address_family": __import__("socket").AF_INET6})
        try:
            self.http = server_class((addr, port), Handler)
        except OSError as exc:
            raise NvmeofError(f"--metrics {listen}: cannot listen: {exc.strerror}",
                              "pick a free port, or an address of this machine") from None
        self.http.daemon_threads = True
        self.thread = threading.Thread(target=self.http.serve_forever, name="metrics-http", daemon=True)
        self.thread.start()
        self.url = f"http://{addr if ':' not in addr else '[' + addr + ']'}:{port}/metrics"
        log.info("metrics on %s", self.url)

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.thread.join(5)


def supervisor_registry(workers: int, fetch: Callable[[int], str]):
    """The registry `serve --workers --metrics` serves: every worker's figures and the supervisor's own
    process_* and build info, one family per name, each sample labelled with its worker (or "supervisor")."""
    prometheus_client = _prometheus()
    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    own = [prometheus_client.ProcessCollector(registry=None), BuildInfo()]
    registry.register(WorkerMetrics(workers, fetch, own))
    return registry


class WorkerMetrics:
    """The supervisor's collector: every worker's families (`fetch(i)` returns its Prometheus text) merged by
    name, each sample labelled worker="i"; a worker that does not answer is left out of that scrape (logged)."""

    def __init__(self, workers: int, fetch: Callable[[int], str], own: List = ()):
        self.workers = workers
        self.fetch = fetch
        self.own = list(own)

    def collect(self) -> Iterable:
        from prometheus_client.core import Metric
        from prometheus_client.parser import text_string_to_metric_families
        merged = {}

        def add(fam, worker: str) -> None:
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for sample in fam.samples:
                out.add_sample(sample.name, dict(sample.labels, worker=worker), sample.value, sample.timestamp)

        for collector in self.own:
            for fam in collector.collect():
                add(fam, "supervisor")
        for i in range(self.workers):
            try:
                text = self.fetch(i)
            except Exception as exc:  # noqa: BLE001 - one silent worker must not hide the others
                log.warning("metrics of worker %d: %s", i, exc)
                continue
            for fam in text_string_to_metric_families(text):
                add(fam, str(i))
        yield from merged.values()


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(bound)
