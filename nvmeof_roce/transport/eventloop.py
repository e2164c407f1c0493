"""The target's event loop: one selector for every fd a transport watches (CM channels, completion channels,
the Work eventfd), continuations of handlers that stopped at their budget, and the timers (`handler.tick`).

Transport independent: the RDMA transport's listeners and queues watch their fds here; a transport that needs
its own loop names it in its registry entry (transport/registry.py, `TransportOps.event_loop`).
"""
from __future__ import annotations

import logging
import selectors
import time
from typing import Callable, List

from .contracts import QueueHandler

log = logging.getLogger(__name__)

SLOW_HANDLER = 0.1  # s: a handler that holds the loop this long is logged (other hosts wait meanwhile)


class EventLoop:
    """One selector for every CM channel and completion channel; timers run through handler.tick()."""

    def __init__(self, handler: QueueHandler, tick_interval: float = 0.1):
        self.handler = handler
        self.tick_interval = tick_interval
        self.selector = selectors.DefaultSelector()
        self.listeners: List = []  # what close() closes: the listeners made on this loop
        self._again: List[Callable] = []  # continuations of handlers that stopped at their budget
        self._pollers: List[Callable[[], bool]] = []  # run every pass (keep_polling)
        self._in_pass = False
        self._unwatched: set = set()  # fds unwatched during the current pass (run_once)
        self.longest_pass = 0.0  # seconds: the longest loop pass since start
        self.longest_pass_recent = 0.0  # ... since the caller last reset it (status lines)

    def watch(self, fd: int, callback: Callable[[], None]) -> None:
        self.selector.register(fd, selectors.EVENT_READ, callback)

    def unwatch(self, fd: int) -> None:
        try:
            self.selector.unregister(fd)
        except (KeyError, ValueError):
            return
        if self._in_pass:
            self._unwatched.add(fd)

    def keep_polling(self, poller: Callable[[], bool]) -> None:
        """Run `poller` in every pass, after the ready fds' handlers, until it returns False (busy polling:
        the loop selects with a zero timeout while a poller is kept, so listeners, RPC and timers are still
        served, and never sleeps).  A poller's run does not count as a handler run (`run_once`'s result)."""
        if poller not in self._pollers:
            self._pollers.append(poller)

    def run_once(self, timeout: float) -> int:
        """One loop pass: wait up to `timeout` (not at all while a handler has work left) and run the
        handlers of every ready fd still watched, then the continuations handlers left last pass; how many ran.

        A handler may return a callable: it stopped at its budget with work left (a busy queue's
        completions), and that callable runs in the next pass, after the other queues had their turn.
        The time the handlers took is the pass: the longest is kept (longest_pass, longest_pass_recent)."""
        again, self._again = self._again, []
        ready = self.selector.select(0 if again or self._pollers else timeout)
        start = time.monotonic()
        # A handler may close what another ready fd belongs to (a CM DISCONNECTED closes its queue's completion
        # channel): that fd's handler must not run on the closed object (pyverbs dereferences NULL there).  Its
        # number may even be watched again by now for a new queue, which this readiness is not about.
        unwatched = self._unwatched
        self._in_pass = True
        callbacks = [(key.fd, key.data) for key, _ in ready] + [(-1, more) for more in again]
        ran = 0
        for fd, callback in callbacks:
            if unwatched and fd in unwatched:
                continue
            ran += 1
            began = time.monotonic()
            try:
                more = callback()
                if callable(more) and more not in self._again:
                    self._again.append(more)
            except Exception:  # one broken queue must not stop the target
                log.exception("event handler failed")
            took = time.monotonic() - began
            if took >= SLOW_HANDLER:
                log.warning("one event handler held the loop %.0f ms: %s", took * 1000,
                            getattr(callback, "__qualname__", callback))
        for poller in list(self._pollers):
            try:
                keep = poller()
            except Exception:
                log.exception("poller failed: no longer polled")
                keep = False
            if not keep:
                self._pollers.remove(poller)
        self._in_pass = False
        unwatched.clear()
        self._account(start)
        return ran

    def _account(self, start: float) -> None:
        took = time.monotonic() - start
        if took > self.longest_pass_recent:
            self.longest_pass_recent = took
            if took > self.longest_pass:
                self.longest_pass = took

    def run(self, should_stop: Callable[[], bool]) -> None:
        next_tick = time.monotonic()
        while not should_stop():
            now = time.monotonic()
            self.run_once(max(0.0, min(next_tick - now, self.tick_interval)))
            now = time.monotonic()
            if now >= next_tick:
                # Serve what arrived while the last pass ran (capsules, completions, keep-alives) before
                # the timers look at it, and let the timers judge as of the last moment at which everything
                # that had arrived was served: a slow pass is never charged to the hosts as silence.
                while True:
                    served_until = time.monotonic()
                    if not self.run_once(0) or time.monotonic() - now > self.tick_interval:
                        break  # nothing more was ready, or still busy: the timers run anyway
                start = time.monotonic()
                self.handler.tick(served_until)
                self._account(start)
                next_tick = start + self.tick_interval

    def close(self) -> None:
        for listener in list(self.listeners):
            listener.close()
        self.selector.close()
