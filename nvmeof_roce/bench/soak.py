"""The soak job's live changes: a scratch namespace added, resized and removed by RPC while fio verifies another.

Every `interval` seconds a thread makes the next change of a cycle on the userspace target's control socket
(control/client.py), as an operator would: add namespace SCRATCH_NSID (RAM, SCRATCH_SIZES[0]), resize it to each
of SCRATCH_SIZES[1:], remove it; then again.  Each change pauses the subsystem the soak's namespace is in until
its commands in flight drained (docs/native.md, "Live changes"), so every change is a window where a command
could be lost, held too long or answered into the wrong memory; fio's verify and the target's counters say
whether one was.

The record (`LiveChanges.record()`): how many changes were made and refused (the first refusals' texts), the
longest RPC round trip, and the event loop's longest pass since the target started (nvmeof_get_status
`transport.loop.longest_pass_s`: the longest the loop was away from its queues, the soak's longest stall).

The scratch namespace's own memory (8-32 MiB of RAM) comes and goes with the cycle; `absent_at(t)` says whether
it was out at time `t` (time.monotonic(), as the bench's samples), so the soak's RSS line is fitted through the
samples taken between a removal and the next add only.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, List, Optional, Tuple

from ..control import client
from ..control.client import RpcError
from ..errors import NvmeofError

REFUSED = (NvmeofError, RpcError)  # the socket failed, or the target refused the change (its message)

SCRATCH_NSID = 2
SCRATCH_SIZES = ("16M", "32M", "8M", "16M")
KEPT_ERRORS = 5


def cycle(nqn: str) -> List[Tuple[str, dict]]:
    """The RPC calls of one cycle, in order: add, resize to each further size, remove."""
    calls = [("nvmf_subsystem_add_ns", {"nqn": nqn, "namespace": {"nsid": SCRATCH_NSID, "backend": "ram",
                                                                   "size": SCRATCH_SIZES[0]}})]
    calls += [("nvmf_subsystem_resize_ns", {"nqn": nqn, "nsid": SCRATCH_NSID, "size": size})
              for size in SCRATCH_SIZES[1:]]
    calls.append(("nvmf_subsystem_remove_ns", {"nqn": nqn, "nsid": SCRATCH_NSID}))
    return calls


class LiveChanges:
    """Makes the cycle's next change every `interval` seconds on a thread, from `start()` to `stop()`."""

    def __init__(self, socket_path: str, nqn: str, interval: float, call=client.call):
        self.socket_path, self.nqn, self.interval = socket_path, nqn, interval
        self.call = call
        self.made = 0
        self.refused = 0
        self.errors: List[str] = []
        self.longest_rpc_s = 0.0
        self._calls = cycle(nqn)
        self._next = 0
        self._presence: List[Tuple[float, bool]] = []  # (time, the scratch namespace may be in from then on)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def step(self) -> None:
        """One change: the next call of the cycle."""
        method, params = self._calls[self._next % len(self._calls)]
        self._next += 1
        t0 = time.monotonic()
        if method == "nvmf_subsystem_add_ns":
            self._presence.append((t0, True))
        try:
            self.call(self.socket_path, method, params)
        except REFUSED as exc:
            self.refused += 1
            if len(self.errors) < KEPT_ERRORS:
                self.errors.append(f"{method}: {_message(exc)}")
            if method == "nvmf_subsystem_add_ns":  # not added: its resizes and removal would be refused too
                self._next = 0
                self._presence.append((time.monotonic(), False))
            return
        finally:
            self.longest_rpc_s = max(self.longest_rpc_s, time.monotonic() - t0)
        if method == "nvmf_subsystem_remove_ns":
            self._presence.append((time.monotonic(), False))
        self.made += 1

    def absent_at(self, t: float) -> bool:
        """The scratch namespace was out at time `t`: before the first add, or after a removal (or a refused add)
        and before the next add began."""
        state = False
        for at, present in self._presence:
            if at > t:
                break
            state = present
        return not state

    def start(self) -> "LiveChanges":
        self._thread = threading.Thread(target=self._run, name="bench-soak-changes", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.step()

    def stop(self) -> None:
        """Stop, and remove the scratch namespace if the cycle left it in (the next job starts as this one did)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._next % len(self._calls):
            try:
                self.call(self.socket_path, "nvmf_subsystem_remove_ns", {"nqn": self.nqn, "nsid": SCRATCH_NSID})
            except REFUSED as exc:
                self.errors.append(f"removing the scratch namespace at the end: {_message(exc)}")
            self._presence.append((time.monotonic(), False))
            self._next = 0

    def loop_longest_pass_s(self) -> Optional[float]:
        try:
            status = self.call(self.socket_path, "nvmeof_get_status", None)
        except NvmeofError:
            return None
        longest = ((status.get("transport") or {}).get("loop") or {}).get("longest_pass_s")
        return float(longest) if isinstance(longest, (int, float)) else None

    def record(self) -> dict:
        longest = self.loop_longest_pass_s()
        return {"interval_s": self.interval, "made": self.made, "refused": self.refused, "errors": self.errors,
                "scratch_nsid": SCRATCH_NSID, "cycle": [m for m, _ in self._calls],
                "longest_rpc_ms": round(self.longest_rpc_s * 1000, 1),
                "loop_longest_pass_ms": None if longest is None else round(longest * 1000, 1)}


def _message(exc: Exception) -> str:
    return getattr(exc, "message", None) or str(exc)


class SoakProgress:
    """The soak's progress line, at most once every `every` seconds of the samples' clock: commands done of the
    count, their rate and the time left at that rate, the target's RSS, the live changes made so far.  It is the
    Sampler's `on_sample`; the first sample it sees is the start."""

    def __init__(self, target: str, total: int, progress: Callable[[str], None],
                 changes: Optional[LiveChanges] = None, every: float = 60.0):
        self.target, self.total, self.progress, self.changes, self.every = target, total, progress, changes, every
        self._start = None  # (t, ios) of the first sample
        self._last = 0.0

    def __call__(self, sample) -> None:
        if sample.ios is None:
            return
        if self._start is None:
            self._start = (sample.t, sample.ios)
            self._last = sample.t
            return
        if sample.t - self._last < self.every:
            return
        self._last = sample.t
        done = sample.ios - self._start[1]
        rate = done / max(sample.t - self._start[0], 1e-9)
        left = f", about {max(self.total - done, 0) / rate / 60:.0f} min left" if rate > 0 else ""
        rss = f", target RSS {sample.rss_bytes / 2**20:.1f} MiB" if sample.rss_bytes is not None else ""
        made = f", {self.changes.made} live changes ({self.changes.refused} refused)" if self.changes else ""
        self.progress(f"bench: soak on {self.target}: {done:,} of {self.total:,} commands "
                      f"({100 * done / self.total:.0f}%), {rate:,.0f}/s{left}{rss}{made}")


__all__ = ["LiveChanges", "SoakProgress", "cycle", "SCRATCH_NSID", "SCRATCH_SIZES"]
