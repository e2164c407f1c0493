"""NVMe reservations shared by the gateways of a group (docs/gateway-group.md "Reservations").

A target alone keeps each namespace's reservation in memory (engine/reservations.py).  A gateway of a group is
given a store all the gateways share (`SharedReservations`: the service's adapter over RADOS, service/group.py;
the workers of `serve --workers` share their supervisor's the same way, service/worker_resv.py) and keeps in
memory a copy of the store's record of each namespace, which the I/O path checks as before (conflicts at a
command's start and when its data arrived, the fast-path queues' views).

- **A command** (Register, Acquire, Release) is decided on the record as the store has it, inside the store's
  atomic update: `update(nqn, nsid, change)` calls `change(record)` and writes what it returns only if nobody
  wrote the record meanwhile, else calls it again on the new record, so the decision (the same pure function as
  a target alone makes, `reservations.decide_*`) is made again on every record it is given and a change another
  gateway made between is never lost.  A Report reads the record.  The store's calls block on the cluster: they
  run on this module's threads, and what they return comes back to the loop through the target's Work channel
  (engine/work.py), where the command completes (it was DEFERRED until then).
- **A record applied** - the one a command's update returned, or one another gateway wrote (`changed`, called
  by the service when its watch sees the group's records) - replaces the copy when its version is newer: the
  copy restored, the fast-path queues' views refreshed (engine/fast_path_view.py); the Preempt and Abort's hosts'
  commands waiting in the core aborted; and when the change takes an access away from a host with a queue here
  (`reservations._access_taken`: a preempt, an acquire by another host, a clear), the namespace is fenced
  (engine/fencing.py).  From the restore on, new commands of the hosts meet the new state; the change is *in
  force* here, and its notices are sent to this gateway's controllers of the hosts concerned, once no command
  that started before it can touch the namespace.  A command that made a change is answered once its version
  is in force here: on its own gateway, as a target alone answers a change after its fence.
- **The store not answering**: a command waits at most `SharedReservations.timeout` seconds for its store call
  (checked at each tick); then it is answered Namespace Not Ready, without DNR (`NOT_READY`, below), and the
  loop goes on serving meanwhile, the call running on its own thread.  A store that fails says how
  (`StoreError`): Namespace Not Ready again, or ANA Inaccessible when the cluster fenced this gateway.  A change
  that lands after its command was answered is applied when its answer comes back, as another gateway's.

The record (what `SharedReservations` keeps and gives back, JSON-able):

    {"registrants": [[host identifier hex, key], ...], "holder": hex or None, "rtype": int, "generation": int,
     "version": int,            # the store's: one more at each write of the record; 0 or None: no record yet
     "changes": [{"version": v, "notices": [[host hex, log type], ...], "abort": [host hex, ...]}, ...]}

`changes` keeps the last CHANGES_KEPT changes' notices and aborted hosts, so that every gateway that applies a
record tells its own controllers what the change told, even when it sees two changes at once.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Dict, List, Mapping, Optional, Protocol, Tuple

from ..nvme import status as S
from .request import DEFERRED, NO_LOCATION, Outcome, Request
from .reservations import Decision, Reservation, _abort_waiting, _access_taken, notify

if TYPE_CHECKING:
    from .core import Target
    from .subsystem import Namespace

log = logging.getLogger(__name__)

CHANGES_KEPT = 16  # the changes a record remembers the notices of
WORKERS = 4  # threads running the store's calls (a command waits for one at most `timeout` seconds too)
# The store (the group's cluster) did not answer in time, or failed: "the namespace is not ready to be accessed",
# generic, without DNR: the host may retry.  Not ANA Transition: that sends a multipath host to another path,
# whose gateway reaches the same cluster; and a Reservation command sent through the host's passthrough path
# (nvme-cli, the kernel's pr_ops) is not failed over anyway.  Not Internal Error | DNR: nothing is wrong with the
# command, and the same command may well succeed a moment later.
NOT_READY = S.NS_NOT_READY
FENCED = S.ANA_INACCESSIBLE  # the cluster fenced (blocklisted) this gateway: its path is gone, the others serve

Record = Optional[dict]
Change = Callable[[Record], Record]


class SharedReservations(Protocol):
    """The store of a group's reservations, as the engine uses it (the service adapts RADOS to it).  Each call
    blocks on the store: the engine makes them off its event loop, several at once."""

    timeout: float  # seconds the engine waits for a call before answering the command Namespace Not Ready

    def read(self, nqn: str, nsid: int) -> Record:
        """The namespace's record now (None: none yet).  Raises StoreError."""

    def update(self, nqn: str, nsid: int, change: Change) -> Record:
        """Atomically: `change(record)` on the record now, and the record it returns written with the next
        version unless another writer came between (then `change` runs again, on the new record); the record
        after it.  A record returned unchanged (equal registrants, holder, rtype and generation) is not written.
        Raises StoreError, or what `change` raised."""


class StoreError(Exception):
    """The store did not answer (in its own bound) or refused; `fenced` when the cluster fenced this gateway."""

    def __init__(self, message: str, fenced: bool = False):
        super().__init__(message)
        self.fenced = fenced


class Cancelled(Exception):
    """The command was answered (its time ran out) before its change was written: the change is not made."""


def version_of(record: Record) -> int:
    return int(record.get("version") or 0) if record else 0


def state_of(record: Record) -> Reservation:
    """The record as a reservation state (empty without a record)."""
    resv = Reservation()
    if record:
        resv.restore(record)
        resv.version = version_of(record)
    return resv


def record_of(resv: Reservation, version: int, changes: list) -> dict:
    state = resv.snapshot()
    return {"registrants": state["registrants"], "holder": state["holder"], "rtype": state["rtype"],
            "generation": state["generation"], "version": version, "changes": changes}


class Job:
    """A reservation command waiting for the store."""

    __slots__ = ("req", "nqn", "ns", "deadline", "what", "answered", "decision")

    def __init__(self, req: Request, nqn: str, ns: "Namespace", deadline: float, what: str):
        self.req, self.nqn, self.ns, self.deadline, self.what = req, nqn, ns, deadline, what
        self.answered = False  # set on the loop; read by the store's thread (its change then refuses to write)
        self.decision: Optional[Decision] = None  # that of the last `change` run (on the record written)

    def text(self) -> str:
        return f"{self.nqn} namespace {self.ns.nsid}: {self.what}"


class SharedSync:
    """The engine's side of a group's reservations, one per target (`Target.resv_sync`, made by
    `Target.attach_shared_reservations`): runs the commands against the store, applies the records."""

    def __init__(self, target: "Target", store: SharedReservations, workers: int = WORKERS):
        self.target, self.store = target, store
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shared reservations")
        self.jobs: List[Job] = []  # commands waiting for the store
        self.fencing: Dict["Namespace", List[int]] = {}  # ns -> the version each application still fencing came from
        self.waiting: Dict["Namespace", List[Tuple[int, Callable[[], None]]]] = {}  # answers waiting to be in force
        self.timed_out = 0  # commands answered Not Ready after `timeout` (status, tests)
        self.store_errors = 0  # commands the store failed

    # ---------------------------------------------------------------------------------------- commands
    def run(self, req: Request, decide: Callable[[Reservation], Decision]) -> Outcome:
        """Register, Acquire or Release: `decide` on the store's record, atomically; answered when the change
        (if any) is in force here."""
        job = self._job(req, "a reservation change")

        def change(record: Record) -> Record:  # on the store's thread, maybe several times
            if job.answered:
                raise Cancelled()
            resv = state_of(record)
            version = version_of(record)
            decision = job.decision = decide(resv)
            if decision.status or not decision.changed:
                return record
            entry = {"version": version + 1, "notices": [[h.hex(), kind] for h, kind in decision.notices],
                     "abort": [h.hex() for h in decision.aborted]}
            changes = list(record.get("changes") or []) if record else []
            return record_of(resv, version + 1, (changes + [entry])[-CHANGES_KEPT:])

        def answer(record: Record) -> None:
            decision = job.decision
            if decision is None:  # the store wrote without asking `change`: a broken store
                return self.target._internal_error(req, RuntimeError("the reservation store did not call the change"))
            if decision.status:
                self._answer(job, decision.status, decision.location)
            elif not decision.changed:
                self._answer(job, 0)
            else:
                job.answered = True
                self.when_in_force(job.ns, version_of(record), lambda: self.target.complete(req, 0))

        self._submit(job, lambda: self.store.update(job.nqn, job.ns.nsid, change), answer)
        return DEFERRED

    def report(self, req: Request, answer: Callable[[Reservation], Outcome]) -> Outcome:
        """Report: `answer(state)` with the store's record (or this gateway's copy, when it is newer still)."""
        job = self._job(req, "a reservation report")

        def answered(record: Record) -> None:
            job.answered = True
            resv = job.ns.resv
            answer(resv if resv is not None and resv.version >= version_of(record) else state_of(record))

        self._submit(job, lambda: self.store.read(job.nqn, job.ns.nsid), answered)
        return DEFERRED

    def _job(self, req: Request, what: str) -> Job:
        job = Job(req, req.queue.ctrl.subsystem.nqn, req.ns, self.target.clock() + self.store.timeout, what)
        self.jobs.append(job)
        return job

    def _submit(self, job: Job, call: Callable[[], Record], answer: Callable[[Record], None]) -> None:
        post = self.target.work.post

        def work() -> None:  # a thread of the pool
            if job.answered:
                return  # its time ran out while it waited for a thread: nothing asked of the store
            try:
                record = call()
            except BaseException as exc:
                post(lambda exc=exc: self._failed(job, exc))
                return
            post(lambda: self._returned(job, record, answer))
        try:
            self.pool.submit(work)
        except RuntimeError as exc:  # shut down: the target is closing
            self._failed(job, StoreError(f"the reservation store is closed ({exc})"))

    def _returned(self, job: Job, record: Record, answer: Callable[[Record], None]) -> None:
        """On the loop: the store answered."""
        if job in self.jobs:
            self.jobs.remove(job)
        self.apply(job.nqn, job.ns, record)
        if not job.answered:
            answer(record)

    def _failed(self, job: Job, exc: BaseException) -> None:
        """On the loop: the store's call failed."""
        if job in self.jobs:
            self.jobs.remove(job)
        if job.answered:
            return  # answered already (its time ran out), and nothing was written after that (Cancelled)
        if not isinstance(exc, StoreError):
            self.target._internal_error(job.req, exc)
            return
        self.store_errors += 1
        log.error("%s failed: %s: answered %s", job.text(), exc,
                  "ANA Inaccessible (this gateway is fenced)" if exc.fenced else "Namespace Not Ready (retry)")
        self._answer(job, FENCED if exc.fenced else NOT_READY)

    def _answer(self, job: Job, status: int, location: int = NO_LOCATION) -> None:
        job.answered = True
        self.target.complete(job.req, status, location=location)

    def tick(self, now: float) -> None:
        """A tick hook: the commands whose store call outlived `timeout` are answered Namespace Not Ready."""
        for job in [j for j in self.jobs if now >= j.deadline]:
            self.jobs.remove(job)
            if job.answered:
                continue
            self.timed_out += 1
            log.error("%s: the group's reservation store did not answer within %g s: answered Namespace Not Ready "
                      "(the host may retry; a change that still lands is applied when it does)", job.text(),
                      self.store.timeout)
            self._answer(job, NOT_READY)

    # ---------------------------------------------------------------------------------------- records
    def changed(self, records: Mapping[Tuple[str, int], Record], force: bool = False) -> None:
        """On the loop: the store's records ({(nqn, nsid): record}), from another gateway or a read of all; each
        newer than this gateway's copy is applied (`force`: each one, the missing ones as empty: the start)."""
        for sub in list(self.target.subsystems.values()):
            for ns in list(sub.namespaces.values()):
                key = (sub.nqn, ns.nsid)
                if ns.resv is not None and (force or key in records):
                    self.apply(sub.nqn, ns, records.get(key), force)

    def apply(self, nqn: str, ns: "Namespace", record: Record, force: bool = False) -> None:
        """On the loop: make the record this gateway's copy if it is newer (module docstring)."""
        resv = ns.resv
        version = version_of(record)
        if resv is None or (version <= resv.version and not force):
            return
        t = self.target
        before, since = resv.snapshot(), resv.version
        resv.restore(state_of(record).snapshot())
        resv.version = version
        entries = [c for c in (record or {}).get("changes") or () if since < int(c["version"]) <= version]
        notices = [(bytes.fromhex(h), int(kind)) for c in entries for h, kind in c.get("notices") or ()]
        _abort_waiting(t, ns, [bytes.fromhex(h) for c in entries for h in c.get("abort") or ()])
        sub = t.subsystems.get(nqn)
        if sub is None or sub.namespaces.get(ns.nsid) is not ns:  # removed meanwhile: nobody to fence or tell
            self._in_force(ns)
            return
        if not _access_taken(t, sub, ns, before):
            t._refresh_views(sub)
            notify(t, sub, ns, notices)
            self._in_force(ns)
            return
        self.fencing.setdefault(ns, []).append(since)

        def fenced(error: Optional[Exception]) -> None:
            if error is not None:
                log.error("%s namespace %d: the group's reservation change (version %d) is in force here with "
                          "commands from before it still on the device: %s", nqn, ns.nsid, version, error)
            notify(t, sub, ns, notices)
            starts = self.fencing.get(ns, [])
            if since in starts:
                starts.remove(since)
            if not starts:
                self.fencing.pop(ns, None)
            self._in_force(ns)
        t.fence([(nqn, ns)], fenced, f"the group's reservation change on {nqn} namespace {ns.nsid}")

    def in_force(self, ns: "Namespace") -> int:
        """The version of the namespace's record in force here: restored, and no command from before it (or an
        older one still fencing) can touch the namespace any more."""
        starts = self.fencing.get(ns)
        if starts:
            return min(starts)
        return ns.resv.version if ns.resv is not None else 0

    def when_in_force(self, ns: "Namespace", version: int, then: Callable[[], None]) -> None:
        if ns.resv is None or self.in_force(ns) >= version:
            then()
        else:
            self.waiting.setdefault(ns, []).append((version, then))

    def _in_force(self, ns: "Namespace") -> None:
        waiting = self.waiting.get(ns)
        if not waiting:
            return
        now = self.in_force(ns) if ns.resv is not None else float("inf")
        due = [then for version, then in waiting if version <= now]
        waiting[:] = [(version, then) for version, then in waiting if version > now]
        if not waiting:
            del self.waiting[ns]
        for then in due:
            then()

    def status(self, ns: "Namespace") -> dict:
        return {"version": ns.resv.version if ns.resv is not None else 0, "in_force": self.in_force(ns)}

    def close(self, wait: bool = False) -> None:
        """No more store calls: those not started are dropped, the running ones waited for if `wait`."""
        self.pool.shutdown(wait=wait, cancel_futures=True)
