"""`nvmeof-roce initiator perf`: a load generator over the userspace initiator, in the manner of SPDK's perf.

Keeps `queue_depth` commands in flight per I/O queue for `runtime` seconds, random
offsets aligned to the block size, a read/write mix, and reports IOPS, bandwidth
and completion-latency percentiles measured around each command.
"""
from __future__ import annotations

import os
import random
import threading
import time
from array import array
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

from ..errors import NvmeofError
from .controller import Controller

PERCENTILES = (50.0, 90.0, 99.0, 99.9)
ADMIN_INTERVAL = 0.1  # s between the loop's visits to the admin queue (KATO is seconds)


@dataclass
class PerfResult:
    iops: float
    bandwidth_bytes: float
    ios: int
    errors: int
    runtime_s: float
    latency_us: Dict[str, float] = field(default_factory=dict)  # "p50", "p90", "p99", "p99.9", "mean"
    reads: int = 0
    writes: int = 0
    queue_depth: int = 0
    block_size: int = 0
    read_percent: int = 100
    queues: int = 1
    data_path: str = "python"

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(sorted_values: List[float], pct: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_values:
        return 0.0
    rank = max(0, min(len(sorted_values) - 1, int(round(pct / 100.0 * len(sorted_values) + 0.5)) - 1))
    return sorted_values[rank]


def _check(ctrl: Controller, nsid: int, block_size: int, queue_depth: int, read_percent: int,
           span_bytes: Optional[int]):
    """The run's shape, every bad setting refused with its fix: (LBA size, blocks per I/O, aligned slots)."""
    if not 0 <= read_percent <= 100:
        raise NvmeofError(f"read percent {read_percent} is not 0 to 100", "use --read-percent 0 to 100")
    lba_size = ctrl.block_size(nsid)
    if block_size % lba_size:
        raise NvmeofError(f"block size {block_size} is not a multiple of the namespace's {lba_size}-byte LBA",
                          f"use --block-size {max(lba_size, 4096)}")
    ns = ctrl.identify_namespace(nsid)
    capacity = ns.nsze * lba_size
    span = min(capacity, span_bytes or capacity)
    blocks_per_io = block_size // lba_size
    slots = span // block_size
    if slots < 1:
        raise NvmeofError(f"namespace {nsid} ({capacity} bytes) is smaller than one {block_size}-byte I/O")
    queues = ctrl.io_queues
    if not queues:
        raise NvmeofError(f"{ctrl.subnqn}: no I/O queues to run perf on", "connect with at least one I/O queue")
    for q in queues:
        if block_size > q.slot_size:
            raise NvmeofError(f"block size {block_size} exceeds the initiator's {q.slot_size}-byte command slot",
                              f"use --block-size {q.slot_size} or less")
        if queue_depth > q.depth:
            raise NvmeofError(f"queue depth {queue_depth} exceeds the {q.depth} command slots of I/O queue {q.qid} "
                              "(the controller's MQES or MAXCMD)", f"use --queue-depth {q.depth} or less")
    if queue_depth < 1:
        raise NvmeofError(f"queue depth {queue_depth}: keep at least one command in flight", "use --queue-depth 1")
    return lba_size, blocks_per_io, slots


def run_perf(ctrl: Controller, nsid: int, *, block_size: int = 4096, queue_depth: int = 32, read_percent: int = 100,
             runtime: float = 10.0, ramp: float = 0.0, span_bytes: Optional[int] = None,
             seed: Optional[int] = None) -> PerfResult:
    """The Python data path: every command issued and completed by the initiator's Python code."""
    _, blocks_per_io, slots = _check(ctrl, nsid, block_size, queue_depth, read_percent, span_bytes)
    queues = ctrl.io_queues
    rng = random.Random(seed)
    payload = os.urandom(block_size)
    total_depth = queue_depth * len(queues)

    # Preallocated per-tag tables, one tag per command kept in flight: nothing is built per I/O but the
    # capsule (docs/benchmarks.md, "Our initiator").  A completion resubmits from its own callback, as SPDK's
    # perf does, so the queue depth stays full with one Python call per completion.
    started = [0.0] * total_depth
    is_write = [False] * total_depth
    queue_of = [queues[tag % len(queues)] for tag in range(total_depth)]
    latencies: List[float] = []
    record = latencies.append
    counts = [0, 0, 0]  # reads, writes, errors (measured I/Os only)
    measuring, running = False, True
    clock = time.perf_counter
    random_ = rng.random
    submit = ctrl.submit_tagged
    write_fraction = (100 - read_percent) / 100.0
    mixed = 0 < read_percent < 100
    all_writes = read_percent == 0

    def issue(tag: int) -> None:
        write = (random_() < write_fraction) if mixed else all_writes
        is_write[tag] = write
        slba = int(random_() * slots) * blocks_per_io
        started[tag] = clock()
        submit(queue_of[tag], write, nsid, slba, blocks_per_io, block_size, done, tag, payload if write else None)

    def done(tag: int, status: int) -> None:
        if measuring:
            record(clock() - started[tag])
            counts[is_write[tag]] += 1
            if status:
                counts[2] += 1
        if running:
            issue(tag)

    for tag in range(total_depth):
        issue(tag)
    start = time.monotonic()
    measure_from = start + ramp
    end = measure_from + runtime
    poll = ctrl.poll_completions
    keep_alive = ctrl.maybe_keep_alive
    now = next_admin = start
    while now < end:
        if not measuring and now >= measure_from:
            measuring = True
            measure_from = now
        poll(0.01, False)
        now = time.monotonic()
        if now >= next_admin:  # the admin queue (keep-alive, AERs) every ADMIN_INTERVAL, not per pass
            keep_alive()
            next_admin = now + ADMIN_INTERVAL
    running = measuring = False
    elapsed = time.monotonic() - measure_from
    ctrl.wait_idle()
    ios = len(latencies)
    latencies.sort()
    lat_us = {f"p{p:g}": percentile(latencies, p) * 1e6 for p in PERCENTILES}
    lat_us["mean"] = (sum(latencies) / len(latencies) * 1e6) if latencies else 0.0
    return PerfResult(iops=ios / elapsed if elapsed > 0 else 0.0,
                      bandwidth_bytes=ios * block_size / elapsed if elapsed > 0 else 0.0,
                      ios=ios, errors=counts[2], runtime_s=round(elapsed, 3),
                      latency_us=lat_us, reads=counts[0], writes=counts[1],
                      queue_depth=queue_depth, block_size=block_size, read_percent=read_percent,
                      queues=len(ctrl.io_queues))


# --- the native data path: the measured loop in C, one thread per I/O queue -----------------------------------------

def native_ready(ctrl: Controller) -> bool:
    """Every I/O queue of `ctrl` runs on the native data path (transport/rdma/host_native.py)."""
    return bool(ctrl.io_queues) and all(hasattr(q.transport, "perf") for q in ctrl.io_queues)


def hist_percentile(hist, sub_buckets: int, n: int, pct: float) -> float:
    """Nearest-rank percentile (ns) of csrc/hostq.c's log-linear histogram: the middle of the bucket, as C does."""
    if not n:
        return 0.0
    rank = min(n, max(1, -int(-pct / 100.0 * n // 1)))
    seen = 0
    for idx, count in enumerate(hist):
        seen += count
        if seen >= rank:
            if idx < sub_buckets:
                return float(idx)
            exponent, mantissa = divmod(idx, sub_buckets)
            width = float(1 << (exponent - 1))
            return (sub_buckets + mantissa) * width + width / 2
    return 0.0


def run_perf_native(ctrl: Controller, nsid: int, *, block_size: int = 4096, queue_depth: int = 32,
                    read_percent: int = 100, runtime: float = 10.0, ramp: float = 0.0,
                    span_bytes: Optional[int] = None, seed: Optional[int] = None,
                    max_ios: int = 0, busy_poll: bool = False) -> PerfResult:
    """As `run_perf`, each I/O queue's loop in C (`_native.HostQueue.perf`) on a thread of its own with the GIL
    released; this thread keeps the admin queue (keep-alive) meanwhile.  `max_ios` (per queue) ends a run early.
    The loop polls its CQ and, after 64 empty polls, sleeps on its completion channel; `busy_poll` never sleeps."""
    _, blocks_per_io, slots = _check(ctrl, nsid, block_size, queue_depth, read_percent, span_bytes)
    if not native_ready(ctrl):
        raise NvmeofError("the I/O queues are not on the native data path", "connect with --data-path native")
    queues = ctrl.io_queues
    rng = random.Random(seed)
    results: List[Optional[dict]] = [None] * len(queues)
    failures: List[BaseException] = []
    jobs = []
    for i, q in enumerate(queues):
        buffer = q.transport.register(queue_depth * block_size)  # one data buffer per run, sliced per tag
        kw = dict(nsid=nsid, nlb=blocks_per_io, block_size=block_size, span_slots=slots, queue_depth=queue_depth,
                  read_percent=read_percent, data_addr=buffer.addr, data_rkey=buffer.key, runtime=runtime,
                  ramp=ramp, max_ios=max_ios, seed=rng.getrandbits(63) | 1, busy_poll=busy_poll)

        def job(i=i, q=q, kw=kw):
            try:
                results[i] = q.transport.perf(**kw)
            except BaseException as exc:  # reported on the calling thread
                failures.append(exc)
        jobs.append(threading.Thread(target=job, name=f"perf-q{q.qid}", daemon=True))
    for t in jobs:
        t.start()
    while True:
        alive = [t for t in jobs if t.is_alive()]
        if not alive:
            break
        ctrl.maybe_keep_alive()
        alive[0].join(ADMIN_INTERVAL)
    if failures:
        raise NvmeofError(f"perf on the native data path: {failures[0]}", "check the connection and the target") \
            from failures[0]
    return _merge(results, block_size, queue_depth, read_percent)


def _merge(results: List[dict], block_size: int, queue_depth: int, read_percent: int) -> PerfResult:
    """One PerfResult from the queues' counts and histograms (IOPS summed, each over its own window)."""
    ios = sum(r["ios"] for r in results)
    sub = results[0]["sub_buckets"]
    hist = array("Q", bytes(len(results[0]["hist"])))
    for r in results:
        for idx, count in enumerate(array("Q", r["hist"])):
            if count:
                hist[idx] += count
    iops = sum(r["ios"] / (r["elapsed_ns"] / 1e9) for r in results if r["elapsed_ns"])
    elapsed = max(r["elapsed_ns"] for r in results) / 1e9
    lat_us = {f"p{p:g}": hist_percentile(hist, sub, ios, p) / 1e3 for p in PERCENTILES}
    lat_us["mean"] = (sum(r["mean"] * r["ios"] for r in results) / ios) if ios else 0.0
    return PerfResult(iops=iops, bandwidth_bytes=iops * block_size, ios=ios,
                      errors=sum(r["errors"] for r in results), runtime_s=round(elapsed, 3), latency_us=lat_us,
                      reads=sum(r["reads"] for r in results), writes=sum(r["writes"] for r in results),
                      queue_depth=queue_depth, block_size=block_size, read_percent=read_percent,
                      queues=len(results), data_path="native")
