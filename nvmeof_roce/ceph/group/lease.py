"""The lease of one ANA group, as the gateway must act on it: a state machine of time alone, no RADOS in it.

One `LeaseMachine` per (gateway, ANA group): the RADOS calls (ana.py's `AnaLease`) tell it when each call
STARTED and how it ended; its clock (injected; `time.monotonic` by default) says what holds now.

    STANDBY --acquired--> OWNER --(fewer than one renew interval to the deadline)--> EXPIRING
    OWNER/EXPIRING --renewed--> OWNER            (the deadline moves to the renew call's start + duration - margin)
    OWNER/EXPIRING --deadline passed, or a renew said "not yours" (broken, expired, fenced)--> LOST
    STANDBY --begin_take_over--> TAKING_OVER --acquired--> OWNER      (--failed--> STANDBY)
    OWNER/EXPIRING/LOST --begin_release--> RELEASING --released--> STANDBY   (failback, leaving, after LOST)

`may_serve()` is true in OWNER and EXPIRING only, and never at or after `serving_deadline()`.

The timing.  A renew (a cls_lock lock call with MUST_RENEW) that starts at local time s is processed by the OSD
at some t >= s, which sets the lock's expiry to t + duration on its own clock: the lock cannot end before
s + duration.  The machine's serving deadline is s + duration - margin, so the gateway stops serving at least
`margin` before any survivor can find the lock expired (the margin covers the gateway's clock running slower
than the OSD's over one duration and the time the target takes to stop accepting commands).  A renew that
succeeds after the deadline does not bring the gateway back: LOST is the end of this ownership; the gateway
releases and acquires again, a new ownership with a new deadline.
"""
from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Optional

from .errors import GroupError

Clock = Callable[[], float]


class LeaseState(enum.Enum):
    STANDBY = "standby"  # not this gateway's: not serving the ANA group
    OWNER = "owner"  # held, serving, renewing on schedule
    EXPIRING = "expiring"  # held and serving, but less than one renew interval to the serving deadline
    LOST = "lost"  # must not serve: the deadline passed without a renew, or the lock is not ours any more
    TAKING_OVER = "taking_over"  # fencing the previous owner (blocklist), breaking its lock, acquiring
    RELEASING = "releasing"  # handing the group back or leaving: not serving, unlocking


S = LeaseState
ALLOWED_FROM: Dict[LeaseState, FrozenSet[LeaseState]] = {
    S.OWNER: frozenset({S.STANDBY, S.TAKING_OVER, S.OWNER, S.EXPIRING}),
    S.EXPIRING: frozenset({S.OWNER}),
    S.LOST: frozenset({S.OWNER, S.EXPIRING, S.LOST}),
    S.TAKING_OVER: frozenset({S.STANDBY}),
    S.RELEASING: frozenset({S.OWNER, S.EXPIRING, S.LOST}),
    S.STANDBY: frozenset({S.RELEASING, S.TAKING_OVER, S.STANDBY}),
}
SERVING = frozenset({S.OWNER, S.EXPIRING})


class IllegalLeaseTransition(GroupError):
    """A lease call in a state that does not allow it (a renew in STANDBY, a take-over while OWNER, ...)."""


@dataclass(frozen=True)
class LeaseTiming:
    """duration: the lock's length on the OSD; margin: how long before the lock's earliest end the gateway stops
    serving; renew_interval: how often the owner renews (a renew every interval keeps the state OWNER)."""
    duration: float
    margin: float
    renew_interval: float

    @classmethod
    def of(cls, duration: float, margin: Optional[float] = None,
           renew_interval: Optional[float] = None) -> "LeaseTiming":
        """Defaults: margin a quarter of the duration, a renew every third."""
        timing = cls(float(duration), duration / 4 if margin is None else float(margin),
                     duration / 3 if renew_interval is None else float(renew_interval))
        timing.check()
        return timing

    def check(self) -> None:
        if not (self.duration > 0 and 0 < self.margin < self.duration):
            raise GroupError(f"lease timing: duration {self.duration} s, margin {self.margin} s",
                             "give a positive duration and a margin between 0 and the duration")
        if not 0 < self.renew_interval < self.duration - self.margin:
            raise GroupError(f"lease timing: a renew every {self.renew_interval} s cannot keep a lease of "
                             f"{self.duration} s with a margin of {self.margin} s",
                             "renew more often than duration - margin (a third of the duration by default)")


class LeaseMachine:
    """The lease's state for one gateway and one ANA group (thread-safe: the renew thread reports, the event
    loop asks `may_serve`)."""

    def __init__(self, timing: LeaseTiming, clock: Clock = time.monotonic):
        timing.check()
        self.timing = timing
        self.clock = clock
        self._state = S.STANDBY
        self._renewed_at: Optional[float] = None  # start of the last successful acquire or renew call
        self._lock = threading.Lock()

    # -- what holds now --------------------------------------------------------------------------------------

    @property
    def state(self) -> LeaseState:
        with self._lock:
            return self._advance()

    def may_serve(self) -> bool:
        """The gateway may accept commands for the ANA group now."""
        return self.state in SERVING

    def serving_deadline(self) -> Optional[float]:
        """When the gateway must have stopped serving if no later renew succeeds (the machine's clock); None
        when it does not own the lease."""
        with self._lock:
            if self._advance() not in SERVING:
                return None
            return self._deadline()

    def next_renew_at(self) -> Optional[float]:
        with self._lock:
            if self._advance() not in SERVING:
                return None
            return self._renewed_at + self.timing.renew_interval

    def _deadline(self) -> float:
        return self._renewed_at + self.timing.duration - self.timing.margin

    def _advance(self) -> LeaseState:
        """Move with time: OWNER -> EXPIRING -> LOST as the deadline nears and passes (under the lock)."""
        if self._state in SERVING:
            now, deadline = self.clock(), self._deadline()
            if now >= deadline:
                self._state = S.LOST
            elif now >= deadline - self.timing.renew_interval:
                self._state = S.EXPIRING
        return self._state

    def _move(self, to: LeaseState) -> None:
        current = self._advance()
        if current not in ALLOWED_FROM[to]:
            raise IllegalLeaseTransition(f"lease: {current.value} -> {to.value} is not a transition of the lease",
                                         "a bug of the caller: acquire from standby, renew as owner, release "
                                         "as owner or after the lease was lost")
        self._state = to

    # -- what the RADOS calls report --------------------------------------------------------------------------

    def begin(self) -> float:
        """The time a call starts: give it back to `acquired` / `renewed`."""
        return self.clock()

    def acquired(self, started: float) -> None:
        """An acquire (or the lock call of a take-over) that started at `started` succeeded."""
        with self._lock:
            self._move(S.OWNER)
            self._renewed_at = started

    def renewed(self, started: float) -> bool:
        """A renew that started at `started` succeeded: True when the gateway may keep serving (the deadline
        moved), False when the deadline had passed first (LOST stays LOST)."""
        with self._lock:
            if self._advance() not in SERVING:
                return False  # the deadline passed while the call was out: it does not count
            self._move(S.OWNER)
            self._renewed_at = max(self._renewed_at, started)
            self._advance()
            return True

    def renew_failed(self, lost: bool) -> None:
        """A renew failed: `lost` when the lock is not ours any more (ENOENT: expired or broken; ESHUTDOWN:
        fenced), else a transient failure (a timeout) and the deadline stands."""
        with self._lock:
            if lost:
                self._move(S.LOST)
            else:
                self._advance()

    def begin_take_over(self) -> None:
        with self._lock:
            self._move(S.TAKING_OVER)

    def take_over_failed(self) -> None:
        with self._lock:
            self._move(S.STANDBY)

    def begin_release(self) -> None:
        """Stop serving now: the unlock follows."""
        with self._lock:
            self._move(S.RELEASING)

    def released(self) -> None:
        with self._lock:
            self._move(S.STANDBY)
            self._renewed_at = None
