"""What the I/O path counts per namespace: latency histograms in logarithmic buckets and the error count.

Cheap on the I/O path (one bucket per command, no allocation); the service's `stats.py` turns them into
percentiles, rates and the status snapshot.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

# Latency buckets: upper bounds in microseconds, 4 per power of two from 1 us to ~67 s.
_STEPS_PER_OCTAVE = 4
BUCKET_BOUNDS_US: List[float] = [2 ** (i / _STEPS_PER_OCTAVE) for i in range(0, 26 * _STEPS_PER_OCTAVE + 1)]
PERCENTILES = (50.0, 90.0, 99.0, 99.9)


class LatencyHistogram:
    """Command latencies (ns in, us out) in logarithmic buckets; percentiles are bucket upper bounds."""

    __slots__ = ("counts", "total", "sum_us")

    def __init__(self):
        self.counts = [0] * (len(BUCKET_BOUNDS_US) + 1)  # the last bucket is +Inf
        self.total = 0
        self.sum_us = 0.0

    def record_ns(self, ns: int) -> None:
        us = ns / 1000.0
        if us <= 1.0:
            i = 0
        else:
            i = min(len(BUCKET_BOUNDS_US), math.ceil(math.log2(us) * _STEPS_PER_OCTAVE))
        self.counts[i] += 1
        self.total += 1
        self.sum_us += us

    def add_buckets(self, sum_ns: int, buckets) -> None:
        """Fold in counts kept elsewhere in the same buckets: (bucket index, count) pairs and their latencies' sum
        (a transport's fast path's: the RDMA C queue's, csrc/nq_hot.c)."""
        for i, n in buckets:
            self.counts[i] += n
            self.total += n
        self.sum_us += sum_ns / 1000.0

    def percentile(self, p: float) -> Optional[float]:
        """The latency (us) at or below which p percent of the commands completed (None if none yet)."""
        if not self.total:
            return None
        rank = math.ceil(self.total * p / 100.0)
        seen = 0
        for i, n in enumerate(self.counts):
            seen += n
            if seen >= rank:
                return BUCKET_BOUNDS_US[i] if i < len(BUCKET_BOUNDS_US) else math.inf
        return math.inf

    def percentiles(self) -> Dict[str, Optional[float]]:
        return {f"p{p:g}": _round(self.percentile(p)) for p in PERCENTILES}

    def cumulative(self) -> List[Tuple[float, int]]:
        """(upper bound in seconds, cumulative count) pairs, for a Prometheus histogram."""
        out, seen = [], 0
        for bound, n in zip(BUCKET_BOUNDS_US, self.counts):
            seen += n
            out.append((bound / 1e6, seen))
        out.append((math.inf, self.total))
        return out


def _round(v: Optional[float]) -> Optional[float]:
    if v is None or math.isinf(v):
        return v
    return round(v, 1)


class NamespaceStats:
    """What the I/O path counts for one namespace besides the SMART counters on `Namespace`."""

    __slots__ = ("read_latency", "write_latency", "errors")

    def __init__(self):
        self.read_latency = LatencyHistogram()
        self.write_latency = LatencyHistogram()
        self.errors = 0
