"""Fences: a change that waits until no command started before it can still touch the namespaces it changes
(docs/native.md "References and fencing").

Every command holds a reference on its namespace (engine/subsystem.py "references") from its checks until nothing of it can
reach the namespace any more, on both data paths and on a queue whose controller has ended.  A fence starts a
new epoch on each namespace it covers (`Namespace.fence`) and waits for the old epochs' counts to reach 0: then
no command from before can move data into or out of the namespace as it was, and the change may free, remap or
shrink its memory, answer a Preempt and Abort, or tell the host that an access was taken away.  Only the
namespaces changed are waited for: other namespaces, and other hosts' commands on them, go on.

Waiting is never done on the loop: the target checks its fences after each completion, after each fast-path poll
that completed something while a fence waits, when a queue closes and at each tick.  A command that has not come
back within the bound (`drain_timeout`, a target setting) gets its queue torn down: the queue's work requests
flush, which lets go of its references, and its host reconnects and retries.  Twice the bound without that (a
device holding a command in the kernel) gives the change up, naming the namespaces and their commands.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

from ..config import ConfigError

if TYPE_CHECKING:
    from .core import Target
    from .subsystem import Namespace

log = logging.getLogger(__name__)

Done = Callable[[Optional[Exception]], None]


class Fence:
    """One change waiting for the references its namespaces' commands held when it began."""

    def __init__(self, target: "Target", namespaces: List[Tuple[str, "Namespace"]], done: Done, bound: float,
                 what: str, source: str = ""):
        self.target, self.done, self.bound, self.what, self.source = target, done, bound, what, source
        self.olds = [(nqn, ns, ns.fence()) for nqn, ns in namespaces]  # new commands take the new epoch
        self.deadline = target.clock() + bound
        self.torn_down = False
        self.finished = False

    def in_flight(self) -> int:
        return sum(ref.count for _nqn, _ns, ref in self.olds)

    def check(self, now: float) -> bool:
        """Finish when the old references are all let go; tear down or give up at the bounds.  True once done."""
        if self.finished:
            return True
        if not self.in_flight():
            self._finish(None)
        elif now >= self.deadline:
            if not self.torn_down:
                self.torn_down = True
                self.deadline = now + self.bound
                self._tear_down_holders()
                if not self.in_flight():
                    self._finish(None)
            else:
                self._finish(self.error())
        return self.finished

    def _finish(self, error: Optional[Exception]) -> None:
        self.finished = True
        if self in self.target.fences:  # first: `done` may complete commands, which check the fences again
            self.target.fences.remove(self)
        self.done(error)

    def holders(self) -> list:
        """The I/O queues (closing ones included) whose commands still hold one of the old references."""
        refs = [ref for _nqn, _ns, ref in self.olds if ref.count]
        return [qs for qs in self.target.queue_states() if qs.qid and any(qs.holds(ref) for ref in refs)]

    def _tear_down_holders(self) -> None:
        for qs in self.holders():
            ctrl = qs.ctrl
            log.warning("controller %s queue %d (host %s): a command on %s did not complete within %g s: tearing the "
                        "queue down (the host reconnects and retries)", ctrl.cntlid if ctrl else "-", qs.qid,
                        ctrl.hostnqn if ctrl else "-", self.namespaces_text(), self.bound)
            self.target.tear_down_queue(qs, f"a command did not complete within drain_timeout ({self.bound:g} s) of "
                                        f"{self.what}")

    def namespaces_text(self) -> str:
        return ", ".join(f"{nqn} namespace {ns.nsid}" for nqn, ns, _ref in self.olds)

    def busy_text(self) -> str:
        busy = [f"{nqn}: namespace {ns.nsid}: {ref.count} command{'s' if ref.count != 1 else ''} in flight"
                for nqn, ns, ref in self.olds if ref.count]
        return "; ".join(busy) or self.namespaces_text()

    def error(self) -> ConfigError:
        return ConfigError(self.source, "", f"not applied: still waiting after {2 * self.bound:g} s for "
                           f"{self.busy_text()} (their queues were torn down after {self.bound:g} s)",
                           "a device that does not complete its commands holds the change: check the namespace's "
                           "device, then send the change again")
