"""Per-namespace QoS limits (SPDK's `bdev_set_qos_limit`): token buckets refilled by the clock; commands
over a limit are held, not failed, and started in arrival order when the tokens come back.

A namespace's `nvmeof_roce.qos` (config/model.py QOS_LIMITS) gives up to four limits per second: commands
(rw_ios_per_sec), MiB read and written (rw_mbytes_per_sec), MiB read (r_mbytes_per_sec), MiB written
(w_mbytes_per_sec); 0 or absent is unlimited.  Each limit is a bucket of tokens:

- it holds at most one timeslice of its rate (TIMESLICE, as SPDK's QoS counts per timeslice; at least one
  token) and starts full; while commands wait, a late wake-up is made up for (up to CATCH_UP), so the loop's
  lateness does not lower the rate;
- the clock refills it at its rate; a command may start when every bucket that applies to it holds a token
  (a command, a byte), and then takes its cost (1 command, its bytes) from each, possibly going below zero: a
  command larger than a timeslice's bytes still starts, and the debt delays the next ones (as in SPDK);
- while one command of the namespace waits, later ones wait behind it (FIFO: no overtaking, no starvation).

Read and Write are counted (a command and their bytes), Write Zeroes as a command (it moves no data);
Flush and Dataset Management pass.  A held command keeps its queue slot (the host cannot send more than its
queue depth); it is started by `QosScheduler.release` from the target's tick and from a wake-up at the moment
the first waiting command's tokens are due (a timer thread that only posts to the event loop: no busy wait).
A command held on a queue that closes is dropped when its turn comes; one of a namespace removed meanwhile
answers Invalid Namespace, as any command that outlives its namespace.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Deque, Dict, Optional, Tuple

from ..nvme.command import NVM_READ, NVM_WRITE, NVM_WRITE_ZEROES

log = logging.getLogger(__name__)

TIMESLICE = 0.01  # seconds: a bucket holds this much of its rate (the largest burst after an idle time)
# While commands wait, a late wake-up (a busy loop, a slow machine) is made up for, up to this much time: the
# waiting commands were due, so the rate holds; once none waits the bucket is back to one timeslice at most.
CATCH_UP = 0.1
MIB = 1 << 20
ROUNDING = 1e-6  # tokens short of a whole one by float rounding of the clock count as whole
# what a command counts as: r(ead) or w(rite), and whether its blocks count as bytes moved
_COUNTED = {NVM_READ: ("r", True), NVM_WRITE: ("w", True), NVM_WRITE_ZEROES: ("w", False)}


class Bucket:
    """Tokens (commands or bytes) refilled at `rate` per second up to `capacity`; starts full.  A command may
    start while at least one token is there (one command, one byte), and takes its whole cost."""

    __slots__ = ("rate", "capacity", "tokens", "last")

    def __init__(self, rate: float, now: float):
        self.rate = float(rate)
        self.capacity = max(1.0, self.rate * TIMESLICE)
        self.tokens = self.capacity
        self.last = now

    def refill(self, now: float, catch_up: bool = False) -> None:
        if now > self.last:
            cap = max(self.capacity, self.rate * CATCH_UP) if catch_up else self.capacity
            self.tokens = min(max(cap, self.tokens), self.tokens + (now - self.last) * self.rate)
            self.last = now

    def wait(self) -> float:
        """Seconds until a command may start (0: now)."""
        return 0.0 if self.tokens + ROUNDING >= 1 else (1 - self.tokens) / self.rate


class Limiter:
    """One namespace's buckets and the commands it holds."""

    def __init__(self, limits: Dict[str, int], now: float):
        self.limits: Dict[str, int] = {}
        self.buckets: Dict[str, Bucket] = {}
        self.held: Deque[Tuple[object, Callable]] = deque()
        self.held_total = 0  # commands that had to wait, since start (status, tests)
        self.set_limits(limits, now)

    def set_limits(self, limits: Dict[str, int], now: float) -> None:
        """New limits (a live change): buckets of unchanged limits keep their balance."""
        buckets = {}
        for name, value in limits.items():
            if not value:
                continue
            old = self.buckets.get(name)
            rate = value * (MIB if name.endswith("mbytes_per_sec") else 1)
            if old is not None and old.rate == rate:
                buckets[name] = old
            else:
                buckets[name] = Bucket(rate, now)
        self.limits = {k: v for k, v in limits.items() if v}
        self.buckets = buckets

    def _applies(self, kind: str) -> list:
        b = self.buckets
        out = []
        for name in ("rw_ios_per_sec", "rw_mbytes_per_sec", "r_mbytes_per_sec" if kind == "r" else "w_mbytes_per_sec"):
            bucket = b.get(name)
            if bucket is not None:
                out.append((bucket, name == "rw_ios_per_sec"))
        return out

    def _try(self, req, now: float, catch_up: bool = False) -> bool:
        counted = _COUNTED.get(req.opc)
        if counted is None:
            return True
        kind, moves_data = counted
        applies = self._applies(kind)
        for bucket, _ in applies:
            bucket.refill(now, catch_up)
            if bucket.tokens + ROUNDING < 1:
                return False
        nbytes = _bytes(req) if moves_data else 0
        for bucket, per_command in applies:
            bucket.tokens -= 1 if per_command else nbytes
        return True

    def admit(self, req, now: float, start: Callable) -> bool:
        """True: `req` may start now (its tokens taken).  False: it waits; `start(req)` runs at its turn."""
        if not self.held and self._try(req, now):
            return True
        self.held.append((req, start))
        self.held_total += 1
        return False

    def release(self, now: float) -> int:
        """Start the waiting commands whose tokens are there, in order; how many started."""
        started = 0
        while self.held:
            req, start = self.held[0]
            if not _gone(req) and not self._try(req, now, catch_up=True):
                break
            self.held.popleft()
            started += 1
            start(req)
        if not self.held:
            for bucket in self.buckets.values():
                bucket.tokens = min(bucket.tokens, bucket.capacity)
        return started

    def next_due(self, now: float) -> Optional[float]:
        """Seconds from `now` until the first waiting command may start (None: nothing waits)."""
        if not self.held:
            return None
        kind = _COUNTED.get(self.held[0][0].opc, ("r", True))[0]
        longest = 0.0
        for bucket, _ in self._applies(kind):
            bucket.refill(now, catch_up=True)  # commands wait: a plain refill would drop what a late loop is owed
            longest = max(longest, bucket.wait())
        return longest

    def status(self) -> dict:
        return {"limits": dict(self.limits), "held": len(self.held), "held_total": self.held_total}


def _gone(req) -> bool:
    """Its queue closed or its namespace was removed: `start` drops or answers it at no cost."""
    queue, ns = req.queue, req.ns
    return (queue is not None and queue.closed) or (ns is not None and ns.removed)


def _bytes(req) -> int:
    """The data a counted command moves: (NLB + 1) blocks of its namespace."""
    ns = req.ns
    return ((req.cdw12 & 0xFFFF) + 1) * (ns.block_size if ns is not None else 512)


class _Waker:
    """A thread that sleeps until the earliest deadline asked for, then posts `callback` to the event loop
    (Work.post: thread-safe, runs on the loop).  Started at the first deadline; one for the whole target."""

    def __init__(self, post: Callable[[Callable], None], callback: Callable[[], None]):
        self._post, self._callback = post, callback
        self._cv = threading.Condition()
        self._deadline: Optional[float] = None
        self._closed = False
        self._thread: Optional[threading.Thread] = None

    def at(self, delay: float) -> None:
        with self._cv:
            if self._closed:
                return
            deadline = time.monotonic() + delay
            if self._deadline is None or deadline < self._deadline:
                self._deadline = deadline
                self._cv.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="nvmeof-roce-qos", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        with self._cv:
            while not self._closed:
                if self._deadline is None:
                    self._cv.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
                self._deadline = None
                self._post(self._callback)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=2)


class QosScheduler:
    """The target's QoS: each namespace's limiter (`ns.qos`), and when to start the commands they hold."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.waiting: Dict[int, Limiter] = {}  # id(limiter) -> limiter, for those holding commands
        self._waker: Optional[_Waker] = None

    def attach(self, work) -> None:
        """With an event loop (Target.attach_loop): wake at the moment tokens are due, not only at the tick."""
        self._waker = _Waker(work.post, lambda: self.release(self.clock()))

    def configure(self, ns) -> None:
        """Give `ns` the limiter its config asks for (or none); commands it held start if it has no limit now."""
        limits = dict(ns.config.qos or {})
        current = ns.qos
        if not limits:
            if current is not None:
                ns.qos = None
                self.waiting.pop(id(current), None)
                while current.held:
                    req, start = current.held.popleft()
                    start(req)
            return
        now = self.clock()
        if current is None:
            ns.qos = Limiter(limits, now)
        else:
            current.set_limits(limits, now)
            self._arm(current, now)

    def admit(self, ns, req, start: Callable) -> bool:
        limiter = ns.qos
        now = self.clock()
        if limiter.admit(req, now, start):
            return True
        self.waiting[id(limiter)] = limiter
        self._arm(limiter, now)
        return False

    def _arm(self, limiter: Limiter, now: float) -> None:
        due = limiter.next_due(now)
        if due is not None and self._waker is not None:
            self._waker.at(due)

    def release(self, now: float) -> None:
        """Start what the tokens allow (the tick and the waker call it on the loop)."""
        for key, limiter in list(self.waiting.items()):
            limiter.release(now)
            if limiter.held:
                self._arm(limiter, now)
            else:
                del self.waiting[key]

    def held(self) -> int:
        return sum(len(lim.held) for lim in self.waiting.values())

    def close(self) -> None:
        if self._waker is not None:
            self._waker.close()
