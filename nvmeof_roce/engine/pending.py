"""Namespaces whose storage did not answer when they opened (a Ceph cluster down when the target starts): the
other namespaces serve, these are tried again in the background and come in when they open.

A namespace is pending when its backend's open failed with a `transient` BackendError (engine/backends/base.py:
for rbd, a cluster that does not answer: ETIMEDOUT, ECONNREFUSED...) while its subsystem was prepared (at start,
or a subsystem added live).  A config mistake (a missing image without `create`, a bad keyring) still fails as
before: only a storage that is not there *now* waits.

Meanwhile the host does not see it: its NSID is not in the subsystem, so it is not in the Active Namespace ID
list, Identify Namespace answers it as an inactive NSID (zeros) and I/O to it Invalid Namespace.  `target status`
(nvmeof_get_status) lists it under the subsystem's `pending_namespaces` with the reason, the attempts and when
the next one is.  Each attempt opens the backend on a thread of its own (librados' connect waits up to its
timeout; never on the event loop) and hands the result to the loop (Work.post); attempts back off from
RETRY_FIRST to RETRY_MAX seconds.  Once open it is installed as a live add is (its subsystem paused and drained,
install_namespace) and the hosts are told (Namespace Attribute Changed, the Changed Namespace List): Linux
rescans and the namespace appears.  A pending namespace the running config no longer has is dropped.
"""
from __future__ import annotations

import logging
import threading
from typing import Dict, List, Optional, Tuple

from ..config import ConfigError, NamespaceConfig
from ..errors import NvmeofError
from .backends import open_backend

log = logging.getLogger(__name__)

RETRY_FIRST = 2.0  # seconds before the first retry; doubled after each failure
RETRY_MAX = 60.0


class PendingNamespace:
    def __init__(self, nqn: str, config: NamespaceConfig, error: ConfigError, now: float):
        self.nqn = nqn
        self.config = config
        self.reason = error.problem
        self.fix = error.fix
        self.since = now
        self.attempts = 1  # the open that failed
        self.delay = RETRY_FIRST
        self.next_try = now + self.delay
        self.opening = False  # an attempt's thread is running
        self.opened = None  # a backend open, waiting for its subsystem to be free of another change

    @property
    def nsid(self) -> int:
        return self.config.nsid

    def status(self, now: float) -> dict:
        return {"nsid": self.nsid, "backend": self.config.backend, "state": "opening" if self.opening else "waiting",
                "reason": self.reason, "fix": self.fix, "attempts": self.attempts,
                "pending_s": round(now - self.since, 1), "next_try_s": round(max(0.0, self.next_try - now), 1)}


class PendingNamespaces:
    """The target's pending namespaces (the module's docstring): `defer` one, `tick` retries, `status` shows."""

    def __init__(self, target):
        self.target = target
        self.entries: Dict[Tuple[str, int], PendingNamespace] = {}
        self.closed = False
        self._hooked = False

    def defer(self, nqn: str, ns_config: NamespaceConfig, error: ConfigError) -> bool:
        """Keep namespace `ns_config` of subsystem `nqn` pending when `error` (its open's) says its storage is
        not reachable now; False (the caller raises `error`) for any other failure."""
        if not error.transient or self.closed:
            return False
        entry = PendingNamespace(nqn, ns_config, error, self.target.clock())
        self.entries[(nqn, ns_config.nsid)] = entry
        if not self._hooked:
            self.target.tick_hooks.append(self.tick)
            self._hooked = True
        log.warning("%s namespace %d: not served yet: %s (%s); the other namespaces serve, this one is tried again "
                    "in the background and the hosts are told when it opens", nqn, ns_config.nsid, error.problem,
                    error.fix)
        return True

    def status(self, nqn: str) -> List[dict]:
        now = self.target.clock()
        return [e.status(now) for (n, _), e in sorted(self.entries.items()) if n == nqn]

    def tick(self, now: float) -> None:
        for key, entry in list(self.entries.items()):
            if not self._wanted(entry):
                self._drop(key, entry, "the running config no longer has it")
            elif entry.opened is not None:
                self._install(entry)
            elif not entry.opening and now >= entry.next_try:
                self._attempt(entry)

    def retry_now(self) -> None:
        """Every waiting namespace is tried at the next tick (a reload, tests)."""
        for entry in self.entries.values():
            entry.next_try = 0.0

    def close(self) -> None:
        """The target closes: attempts still running close what they open."""
        self.closed = True
        for entry in self.entries.values():
            if entry.opened is not None:
                _close(entry.opened)
                entry.opened = None
        self.entries.clear()

    # -- one attempt: open on a thread, the outcome on the loop
    def _attempt(self, entry: PendingNamespace) -> None:
        entry.opening = True
        target = self.target

        def run() -> None:
            backend, error = None, None
            try:
                backend = open_backend(entry.config, lock=target.file_lock)
            except Exception as exc:
                error = exc
            if self.closed or not target.work.attached:
                if backend is not None:
                    _close(backend)
                return
            target.work.post(lambda: self._outcome(entry, backend, error))
        threading.Thread(target=run, name=f"open ns {entry.nsid}", daemon=True).start()

    def _outcome(self, entry: PendingNamespace, backend, error: Optional[BaseException]) -> None:
        entry.opening = False
        key = (entry.nqn, entry.nsid)
        if self.closed or self.entries.get(key) is not entry:
            if backend is not None:
                _close(backend)
            return
        now = self.target.clock()
        if error is not None:
            entry.attempts += 1
            entry.reason = error.message if isinstance(error, NvmeofError) else str(error)
            entry.fix = (error.fix if isinstance(error, NvmeofError) else "") or entry.fix
            entry.delay = min(entry.delay * 2, RETRY_MAX)
            entry.next_try = now + entry.delay
            log.info("%s namespace %d: still not served (attempt %d): %s; next attempt in %.0f s", entry.nqn,
                     entry.nsid, entry.attempts, entry.reason, entry.delay)
            return
        entry.opened = backend
        self._install(entry)

    def _wanted(self, entry: PendingNamespace) -> bool:
        """Its subsystem still runs, the running config still has it as it was, and no namespace took its NSID."""
        t = self.target
        sub = t.subsystems.get(entry.nqn)
        cfg = t.config.subsystem(entry.nqn) if sub is not None else None
        return sub is not None and cfg is not None and cfg.namespace(entry.nsid) == entry.config and \
            entry.nsid not in sub.namespaces

    def _install(self, entry: PendingNamespace) -> None:
        key = (entry.nqn, entry.nsid)
        if not self._wanted(entry):
            self._drop(key, entry, "the running config no longer has it")
            return
        t = self.target
        if t.changing():
            return  # another change is under way: the next tick
        from .api import Applying
        from .subsystem import Namespace
        backend, entry.opened = entry.opened, None
        del self.entries[key]
        try:
            ns = Namespace(entry.config, backend)
        except Exception as exc:
            log.error("%s namespace %d: opened, but cannot serve it: %s", entry.nqn, entry.nsid, exc)
            _close(backend)
            return

        def commit() -> None:
            t.install_namespace(entry.nqn, ns)
            t.namespace_changed(entry.nqn, entry.nsid)
            log.warning("%s namespace %d: opened after %d attempt(s): served now, the hosts told", entry.nqn,
                        entry.nsid, entry.attempts + 1)
        t.when_drained([(entry.nqn, entry.nsid)], commit, lambda: t.discard_namespace(ns), Applying(),
                       t.config.source)

    def _drop(self, key, entry: PendingNamespace, why: str) -> None:
        del self.entries[key]
        if entry.opened is not None:
            _close(entry.opened)
            entry.opened = None
        log.info("%s namespace %d: no longer pending: %s", entry.nqn, entry.nsid, why)


def _close(backend) -> None:
    try:
        backend.close()
    except Exception as exc:
        log.warning("%s: closing: %s", backend.describe(), exc)
