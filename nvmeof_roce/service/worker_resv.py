"""NVMe reservations under `target serve --workers N`: the supervisor is the workers' shared store.

Every worker serves the same namespaces, so a reservation must be one state for all of them: a host preempted
through worker 0's port must not write through worker 1's.  The engine already knows how to share a reservation
with a store (engine/shared_resv.py, made for a gateway group over RADOS); here the store is the supervisor:

- **The supervisor** (`ReservationBoard`, in service/workers.py's process) keeps the records ({(nqn, nsid):
  record}, shared_resv's format, with versions) in memory and answers the workers on RUN_DIR/reservations.sock
  (0600 in the private run directory; not the control socket, which may be absent and answers users) from
  threads of its own, so neither its control loop nor a slow worker holds the others' calls.
- **A worker** (`SupervisorReservations`, the engine's SharedReservations) reads a record, and updates one by
  compare-and-swap: `change` runs on the record read, the result is sent with the version it was decided on, and
  on a mismatch `change` runs again on the record the supervisor returned.  Its calls run on SharedSync's threads,
  never on its loop.  A worker (re)started asks for every record (`attach`) before it serves.
- **Before the supervisor answers a successful compare-and-swap** it pushes the new record to every other worker
  attached (`WORKER_RESV_PUSH` on RUN_DIR/worker-I.sock, `push_records` there) and waits until each has it *in
  force*: restored (new commands meet it) and, when the change took an access away, its fence drained (no command
  from before it can touch the namespace any more).  So a change answered success through one worker is in force
  on every worker before the host sees the answer.
- **A worker that does not answer the push** within `restore_timeout` (stopped, hung) could serve the old state
  whenever it runs again: the supervisor kills it (SIGKILL, reaped) and it is restarted as any dead worker, with
  every record before it serves.  Once it is gone the change is in force everywhere a host can reach, and is
  answered success.  A worker that restored the record but whose fence did not drain by `force_timeout` (a
  command stuck on the device) is left to its fence, which ends within drain_timeout as one process's does; the
  command is then answered Namespace Not Ready (the change is made; the host may retry and Report it).  If the
  supervisor itself does not answer, SharedSync answers Namespace Not Ready after `TIMEOUT`.

No PTPL under --workers: the records live in the supervisor's memory, and the workers do not offer it (Identify
RESCAP without PTPL, CPTPL set answered Invalid Field, as a gateway group's).  `refuse_kept_reservations`
refuses to start over a single process's reservation file that still holds reservations kept through power loss.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ..control.client import call as rpc_call
from ..control.fanout import WORKER_RESV_PUSH, answer_connection
from ..control.protocol import RpcError
from ..control.server import DeferredAnswer, bind_unix_socket
from ..engine import shared_resv
from ..engine.reservations import file_for as reservation_file_for
from ..engine.shared_resv import StoreError, version_of
from ..errors import NvmeofError

log = logging.getLogger(__name__)

TIMEOUT = 10.0  # a reservation command waits this long for the supervisor before it is answered Namespace Not Ready
SOCKET = "reservations.sock"  # in the run directory
STATE = ("registrants", "holder", "rtype", "generation")

Key = Tuple[str, int]
Records = Dict[Key, Optional[dict]]


def records_to_wire(records: Records) -> List[list]:
    return [[nqn, nsid, record] for (nqn, nsid), record in records.items()]


def records_from_wire(wire) -> Records:
    return {(str(nqn), int(nsid)): record for nqn, nsid, record in wire or ()}


def same_state(a: Optional[dict], b: Optional[dict]) -> bool:
    if a is None or b is None:
        return a is b
    return all(a.get(k) == b.get(k) for k in STATE)


# ---------------------------------------------------------------------------------------------------- worker side
class SupervisorReservations:
    """A worker's SharedReservations (engine/shared_resv.py): the supervisor's records over its socket.  Blocking
    calls: the engine makes them on its threads.  `target` gets the record of a change the supervisor made but
    could not confirm everywhere (then the call raises StoreError: the command is answered Namespace Not Ready)."""

    def __init__(self, path: str, worker: int, target=None, timeout: float = TIMEOUT):
        self.path, self.worker, self.target, self.timeout = path, worker, target, timeout

    def _call(self, method: str, params: dict) -> Any:
        try:  # longer than the supervisor's own bounds (below `timeout`): its answer normally comes
            return rpc_call(self.path, method, dict(params, worker=self.worker), timeout=self.timeout + 5.0)
        except (RpcError, NvmeofError, OSError) as exc:
            raise StoreError(f"the supervisor's reservation store ({self.path}): {exc}") from None

    def attach(self) -> Records:
        """Every record, this worker now told of each change (called once, before it serves)."""
        return records_from_wire(self._call("attach", {})["records"])

    def read(self, nqn: str, nsid: int) -> Optional[dict]:
        return self._call("read", {"nqn": nqn, "nsid": nsid})["record"]

    def update(self, nqn: str, nsid: int, change: shared_resv.Change) -> Optional[dict]:
        record = self.read(nqn, nsid)
        while True:
            after = change(copy.deepcopy(record))
            if after is None or same_state(after, record):
                return record
            answer = self._call("cas", {"nqn": nqn, "nsid": nsid, "expected": version_of(record), "record": after})
            if not answer["ok"]:
                record = answer["record"]  # another worker's change came between: decide again on it
                continue
            record = answer["record"]
            if not answer["confirmed"]:
                target = self.target
                if target is not None:  # made: in force here as soon as the loop applies it
                    target.work.post(lambda: target.shared_reservations_changed({(nqn, nsid): record}))
                raise StoreError(f"{nqn} namespace {nsid}: the change (version {version_of(record)}) is made but "
                                 f"not yet in force on every worker: {answer.get('why')}")
            return record


def push_records(target, params) -> Any:
    """Worker: the internal method WORKER_RESV_PUSH: the supervisor's records applied now (as another gateway's);
    {"in_force": bool}.  With "wait": answered once every one of them is in force here (a DeferredAnswer)."""
    if not isinstance(params, dict) or target.resv_sync is None:
        raise RpcError("this worker has no shared reservations", "params", "a worker of serve --workers only")
    records = records_from_wire(params.get("records"))
    target.shared_reservations_changed(records)
    sync = target.resv_sync
    missing = []
    for (nqn, nsid), record in records.items():
        sub = target.subsystems.get(nqn)
        ns = sub.namespaces.get(nsid) if sub is not None else None
        if ns is not None and ns.resv is not None and sync.in_force(ns) < version_of(record):
            missing.append((ns, version_of(record)))
    if not missing or not params.get("wait"):
        return {"in_force": not missing}
    answer = DeferredAnswer()
    left = [len(missing)]

    def one() -> None:
        left[0] -= 1
        if left[0] == 0:
            answer.settle({"in_force": True})
    for ns, version in missing:
        sync.when_in_force(ns, version, one)
    return answer


def attach_worker(target, control, path: str, worker: int, timeout: float = TIMEOUT) -> SupervisorReservations:
    """Worker, before it serves: the supervisor's records become this target's reservations, and its control
    socket answers the supervisor's pushes."""
    store = SupervisorReservations(path, worker, target, timeout)
    try:
        records = store.attach()
    except StoreError as exc:
        raise NvmeofError(f"worker {worker}: cannot read the reservations: {exc}",
                          "the supervisor restarts the worker; see its messages") from None
    target.attach_shared_reservations(store, records)
    control.internal[WORKER_RESV_PUSH] = lambda params: push_records(target, params)
    return store


# ---------------------------------------------------------------------------------------------------- supervisor side
class ReservationBoard:
    """The supervisor's records and the workers' calls on them (`call(method, params)`, from the store socket's
    threads).  `call_worker(i, method, params, timeout)` reaches worker i's socket; `fence(i, timeout)` kills
    worker i and says whether it is gone (reaped) in time."""

    def __init__(self, call_worker: Callable[[int, str, Any, float], Any], fence: Callable[[int, float], bool],
                 timeout: float = TIMEOUT):
        self.call_worker, self.fence = call_worker, fence
        self.records: Records = {}
        self.attached: Set[int] = set()  # the workers told of each change (they asked for every record)
        self.lock = threading.Lock()
        self.timeout = timeout
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="reservation pushes")
        self.killed = 0  # workers killed for not answering a push (status, tests)

    @property
    def restore_timeout(self) -> float:  # a worker must have restored the change by then, or it is killed
        return 0.4 * self.timeout

    @property
    def force_timeout(self) -> float:  # every worker in force by then, or the command is answered Not Ready
        return 0.8 * self.timeout

    def call(self, method: str, params: Any) -> Any:
        p = params if isinstance(params, dict) else {}
        try:
            worker = int(p["worker"])
            if method == "attach":
                with self.lock:
                    self.attached.add(worker)
                    return {"records": records_to_wire(copy.deepcopy(self.records))}
            key = (str(p["nqn"]), int(p["nsid"]))
            if method == "read":
                with self.lock:
                    return {"record": copy.deepcopy(self.records.get(key))}
            if method == "cas":
                return self.cas(worker, key, int(p["expected"]), p["record"])
        except (KeyError, TypeError, ValueError) as exc:
            raise RpcError(f"bad reservation store call {method}: {exc!r}", "params", "a worker's call") from None
        raise RpcError(f"no store method {method!r}", "method", "attach, read or cas")

    def cas(self, worker: int, key: Key, expected: int, record: dict) -> dict:
        start = time.monotonic()
        with self.lock:
            now = self.records.get(key)
            if version_of(now) != expected:
                return {"ok": False, "record": copy.deepcopy(now)}
            record = dict(record, version=expected + 1)
            self.records[key] = record
            others = sorted(self.attached - {worker})
        confirmed, why = self._push(others, {key: record}, start)
        return {"ok": True, "record": copy.deepcopy(record), "confirmed": confirmed, "why": why}

    def _push(self, others: List[int], records: Records, start: float) -> Tuple[bool, str]:
        """Every other worker has `records` in force, or is killed; (all in force, what is not)."""
        wire = records_to_wire(records)
        futures = {i: self.pool.submit(self._push_one, i, wire, start) for i in others}
        late = []
        for i, future in futures.items():
            outcome = future.result()
            if outcome != "in force":
                late.append(f"worker {i}: {outcome}")
        return not late, "; ".join(late)

    def _push_one(self, i: int, wire: list, start: float) -> str:
        try:
            answer = self.call_worker(i, WORKER_RESV_PUSH, {"records": wire}, self.restore_timeout)
        except (RpcError, NvmeofError, OSError) as exc:
            return self._silent(i, exc)
        if not answer["in_force"]:
            left = start + self.force_timeout - time.monotonic()
            try:
                answer = self.call_worker(i, WORKER_RESV_PUSH, {"records": wire, "wait": True}, max(0.01, left))
            except (RpcError, NvmeofError, OSError) as exc:
                log.error("worker %d restored a reservation change but its fence did not drain in %.1f s (%s): the "
                          "command is answered Namespace Not Ready; the fence goes on", i, self.force_timeout, exc)
                return "restored, its fence still draining"
        return "in force"

    def _silent(self, i: int, exc: BaseException) -> str:
        """Worker i did not take the change: killed, so that it never serves the old state."""
        with self.lock:
            if i not in self.attached:
                return "in force"  # gone (died, restarting): it reads every record before it serves again
            self.attached.discard(i)
        log.error("worker %d did not take a reservation change within %.1f s (%s): killing it (it is restarted "
                  "with every reservation)", i, self.restore_timeout, exc)
        self.killed += 1
        if self.fence(i, max(0.5, 0.2 * self.timeout)):
            return "in force"
        return "did not answer and could not be killed in time"

    def detach(self, i: int) -> None:
        """Worker i died: it is told nothing more until it attaches again."""
        with self.lock:
            self.attached.discard(i)

    def keep_only(self, keys: Set[Key], dropped: Set[Key] = frozenset()) -> None:
        """The namespaces with reservations are now `keys`: the other records are forgotten, and those of
        `dropped` (namespaces added, removed or replaced) too."""
        with self.lock:
            for key in [k for k in self.records if k not in keys or k in dropped]:
                del self.records[key]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class BoardServer:
    """The supervisor's RUN_DIR/reservations.sock: each connection answered on a thread of its own (a
    compare-and-swap waits for the other workers, and must not hold their calls)."""

    def __init__(self, board: ReservationBoard, path: str):
        self.board, self.path = board, path
        self.sock = bind_unix_socket(path)
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="reservation store", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.05)
                continue
            threading.Thread(target=self._answer, args=(conn,), name="reservation store call", daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            answer_connection(conn, self.board.call, read_timeout=self.board.timeout)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self.sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self.board.close()


def refuse_kept_reservations(config_path: str) -> None:
    """A single process's reservation file that still holds reservations kept through power loss (PTPL): refused,
    since a worker does not restore them (the supervisor's records are in memory)."""
    path = reservation_file_for(config_path)
    try:
        with open(path, "rb") as f:
            kept = json.loads(f.read()).get("reservations") or {}
    except FileNotFoundError:
        return
    except (OSError, ValueError) as exc:
        raise NvmeofError(f"{path}: cannot read it: {exc}", "repair or remove the file") from None
    names = [f"{nqn} namespace {nsid}" for nqn, namespaces in kept.items() for nsid in namespaces]
    if names:
        raise NvmeofError(f"{path} keeps reservations through power loss (PTPL) for {', '.join(names)}, which serve "
                          "--workers cannot restore (no PTPL under --workers: docs/reservations.md)",
                          "serve this config in one process (without --workers), or remove the file, which clears "
                          "those reservations")
