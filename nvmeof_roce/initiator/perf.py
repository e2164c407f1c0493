"""`nvmeof-roce initiator perf`: a load generator over the userspace initiator, in the manner of SPDK's perf.

Keeps `queue_depth` commands in flight per I/O queue for `runtime` seconds, random
offsets aligned to the block size, a read/write mix, and reports IOPS, bandwidth
and completion-latency percentiles measured around each command.
"""
from __future__ import annotations

import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

from ..errors import NvmeofError
from .controller import Completion, Controller

PERCENTILES = (50.0, 90.0, 99.0, 99.9)


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

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(sorted_values: List[float], pct: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_values:
        return 0.0
    rank = max(0, min(len(sorted_values) - 1, int(round(pct / 100.0 * len(sorted_values) + 0.5)) - 1))
    return sorted_values[rank]


def run_perf(ctrl: Controller, nsid: int, *, block_size: int = 4096, queue_depth: int = 32, read_percent: int = 100,
             runtime: float = 10.0, ramp: float = 0.0, span_bytes: Optional[int] = None,
             seed: Optional[int] = None) -> PerfResult:
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
    rng = random.Random(seed)
    payload = os.urandom(block_size)
    latencies: List[float] = []
    counters = {"reads": 0, "writes": 0, "errors": 0, "ios": 0}
    in_flight = 0
    measuring = [False]

    def submit() -> None:
        nonlocal in_flight
        slba = rng.randrange(slots) * blocks_per_io
        started = time.perf_counter()
        is_read = rng.randrange(100) < read_percent

        def done(comp: Completion) -> None:
            nonlocal in_flight
            in_flight -= 1
            if measuring[0]:
                latencies.append(time.perf_counter() - started)
                counters["ios"] += 1
                counters["reads" if is_read else "writes"] += 1
                if not comp.ok:
                    counters["errors"] += 1

        in_flight += 1
        if is_read:
            ctrl.submit_read(nsid, slba, blocks_per_io, done, block_size=lba_size)
        else:
            ctrl.submit_write(nsid, slba, payload, done, block_size=lba_size)

    total_depth = queue_depth * max(1, len(ctrl.io_queues))
    start = time.monotonic()
    measure_from = start + ramp
    end = measure_from + runtime
    while True:
        now = time.monotonic()
        if not measuring[0] and now >= measure_from:
            measuring[0] = True
            measure_from = now
        if now >= end:
            break
        while in_flight < total_depth:
            submit()
        ctrl.poll_completions(0.01)
        ctrl.maybe_keep_alive()
    measuring[0] = False
    elapsed = time.monotonic() - measure_from
    ctrl.wait_idle()
    latencies.sort()
    lat_us = {f"p{p:g}": percentile(latencies, p) * 1e6 for p in PERCENTILES}
    lat_us["mean"] = (sum(latencies) / len(latencies) * 1e6) if latencies else 0.0
    return PerfResult(iops=counters["ios"] / elapsed if elapsed > 0 else 0.0,
                      bandwidth_bytes=counters["ios"] * block_size / elapsed if elapsed > 0 else 0.0,
                      ios=counters["ios"], errors=counters["errors"], runtime_s=round(elapsed, 3),
                      latency_us=lat_us, reads=counters["reads"], writes=counters["writes"],
                      queue_depth=queue_depth, block_size=block_size, read_percent=read_percent,
                      queues=len(ctrl.io_queues))
