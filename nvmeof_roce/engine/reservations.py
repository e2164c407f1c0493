"""NVMe reservations of a namespace (docs/reservations.md): registrants, holder, type, generation, PTPL.

A namespace whose config enables them (nvmet's resv_enable, `"resv": {"enable": "1"}`) has a `Reservation`
(`Namespace.resv`; None otherwise, and its reservation commands answer Invalid Opcode as nvmet's do).

    registrants   keyed by host identifier (the 128-bit hostid of the Connect, as nvmet keys them), so one
                  host's several controllers share one registration and a reconnect keeps it
    holder        the host holding the reservation (None: not reserved); for the All Registrants types every
                  registrant holds it
    generation    PRGENERATION: one more at each Register, Unregister, Replace, Preempt and Clear that succeeds
    ptpl          persist through power loss: the state is written (securefile, 0600) to the target's
                  reservation file at each change and read back when the target starts (Target.restore_reservations)

`ALLOWED` is the conflict table: what a host may do (read, write) for each type and role (holder, registrant,
other).  `conflict_status` is the one question the I/O path asks, at the command's start (core._start) and again
when a Write's or a Dataset Management's data arrived (engine/io.py), so a command that started before a
reservation changed never reaches the medium after it in conflict.  A transport's fast path serves a namespace for
a controller only where its host may both read and write (`may_read_write`, engine/fast_path_view.py); each change
replaces the views of the subsystem's fast-path queues before the command that made it completes.

The commands decide on a state alone (`decide_register`, `decide_acquire`, `decide_release`: a `Decision`), so
that the gateways of a group decide on the state the group's store holds, each change made atomically there and
applied by every gateway (engine/shared_resv.py; `Target.shared_reservations`, None for a target alone).
"""
from __future__ import annotations

import json
import logging
import os
from functools import partial
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

from ..nvme import admin as A
from ..nvme import identify as I
from ..nvme import reservation as R
from ..nvme import status as S
from ..nvme.command import (NSID_ALL, NVM_DSM, NVM_FLUSH, NVM_READ, NVM_RESV_ACQUIRE, NVM_RESV_REGISTER,
                            NVM_RESV_RELEASE, NVM_RESV_REPORT, NVM_WRITE, NVM_WRITE_ZEROES)
from ..securefile import write_file
from .handlers import CommandTable
from .request import (COMPLETED, DEFERRED, LOC_CDW10, LOC_CDW11, LOC_DPTR, LOC_NSID, LOC_OPCODE, NO_LOCATION, Outcome,
                      Request)

if TYPE_CHECKING:
    from .core import Target

log = logging.getLogger(__name__)

READ, WRITE = "read", "write"
HOLDER, REGISTRANT, OTHER = "holder", "registrant", "other"
_RW = frozenset((READ, WRITE))
_R = frozenset((READ,))
_NONE = frozenset()

# The conflict table of the NVMe base specification: (type, role) -> what that host may do.
ALLOWED = {
    (R.WRITE_EXCLUSIVE, HOLDER): _RW, (R.WRITE_EXCLUSIVE, REGISTRANT): _R, (R.WRITE_EXCLUSIVE, OTHER): _R,
    (R.EXCLUSIVE_ACCESS, HOLDER): _RW, (R.EXCLUSIVE_ACCESS, REGISTRANT): _NONE, (R.EXCLUSIVE_ACCESS, OTHER): _NONE,
    (R.WRITE_EXCLUSIVE_REG_ONLY, HOLDER): _RW, (R.WRITE_EXCLUSIVE_REG_ONLY, REGISTRANT): _RW,
    (R.WRITE_EXCLUSIVE_REG_ONLY, OTHER): _R,
    (R.EXCLUSIVE_ACCESS_REG_ONLY, HOLDER): _RW, (R.EXCLUSIVE_ACCESS_REG_ONLY, REGISTRANT): _RW,
    (R.EXCLUSIVE_ACCESS_REG_ONLY, OTHER): _NONE,
    (R.WRITE_EXCLUSIVE_ALL_REGS, HOLDER): _RW, (R.WRITE_EXCLUSIVE_ALL_REGS, REGISTRANT): _RW,
    (R.WRITE_EXCLUSIVE_ALL_REGS, OTHER): _R,
    (R.EXCLUSIVE_ACCESS_ALL_REGS, HOLDER): _RW, (R.EXCLUSIVE_ACCESS_ALL_REGS, REGISTRANT): _RW,
    (R.EXCLUSIVE_ACCESS_ALL_REGS, OTHER): _NONE,
}

# What each command of ours does to the medium (the spec's read and write command groups; Compare, Verify and
# Copy are not served by this target).  Other commands (the reservation commands themselves) are not checked here.
ACCESS_OF = {NVM_READ: READ, NVM_WRITE: WRITE, NVM_FLUSH: WRITE, NVM_WRITE_ZEROES: WRITE, NVM_DSM: WRITE}

CONFLICT = S.RESERVATION_CONFLICT | S.DNR
RESCAP_TYPES = sum(1 << t for t in R.TYPES)  # bit n: type n supported


class Reservation:
    """One namespace's reservation state (module docstring)."""

    def __init__(self):
        self.registrants: Dict[bytes, int] = {}  # host identifier -> reservation key, in registration order
        self.holder: Optional[bytes] = None
        self.rtype = 0
        self.generation = 0
        self.ptpl = False
        # A gateway group's (engine/shared_resv.py): the version of the group's record this state is (0: none)
        self.version = 0

    # -- the conflict table
    def role(self, hostid: bytes) -> str:
        if hostid in self.registrants:
            if hostid == self.holder or self.rtype in R.ALL_REGISTRANTS:
                return HOLDER
            return REGISTRANT
        return OTHER

    def allowed(self, hostid: bytes) -> frozenset:
        """What host `hostid` may do now: read and write when nothing is reserved."""
        if self.holder is None:
            return _RW
        return ALLOWED[(self.rtype, self.role(hostid))]

    def may_read_write(self, hostid: bytes) -> bool:
        """Whether the host may read and write: a fast path serves the namespace for it then."""
        return self.holder is None or self.allowed(hostid) == _RW

    def holds(self, hostid: bytes) -> bool:
        return self.holder is not None and self.role(hostid) == HOLDER

    # -- state changes (the commands below call them)
    def unregister(self, hostid: bytes) -> List[Tuple[bytes, int]]:
        """Remove a registrant: a holder leaving releases the reservation, except under an All Registrants
        type while others remain.  Returns the notices [(hostid, log type)]."""
        del self.registrants[hostid]
        if hostid != self.holder:
            return []
        if self.rtype in R.ALL_REGISTRANTS and self.registrants:
            self.holder = next(iter(self.registrants))
            return []
        rtype = self.rtype
        self.holder, self.rtype = None, 0
        if rtype in (R.WRITE_EXCLUSIVE_REG_ONLY, R.EXCLUSIVE_ACCESS_REG_ONLY):
            return [(h, R.LOG_RESERVATION_RELEASED) for h in self.registrants]
        return []

    def snapshot(self) -> dict:
        return {"registrants": [[h.hex(), k] for h, k in self.registrants.items()],
                "holder": self.holder.hex() if self.holder is not None else None, "rtype": self.rtype,
                "generation": self.generation, "ptpl": self.ptpl}

    def restore(self, state: dict) -> None:
        self.registrants = {bytes.fromhex(h): int(k) for h, k in state["registrants"]}
        holder = state.get("holder")
        self.holder = bytes.fromhex(holder) if holder else None
        self.rtype = int(state.get("rtype", 0)) if self.holder is not None else 0
        self.generation = int(state.get("generation", 0))
        self.ptpl = bool(state.get("ptpl", False))

    def status(self) -> dict:
        """What `target status` and the RPC show."""
        return {"holder": self.holder.hex() if self.holder is not None else None,
                "type": R.TYPE_NAMES.get(self.rtype, str(self.rtype)), "generation": self.generation,
                "ptpl": self.ptpl,
                "registrants": [{"hostid": h.hex(), "rkey": k, "holds": self.holds(h)}
                                for h, k in self.registrants.items()]}


def conflict_status(ns, ctrl, opc: int) -> int:
    """0, or Reservation Conflict when the namespace's reservation does not let the controller's host run `opc`."""
    resv = ns.resv
    if resv is None or resv.holder is None:
        return 0
    access = ACCESS_OF.get(opc)
    if access is None or access in resv.allowed(ctrl.hostid):
        return 0
    return CONFLICT


def rescap(t: "Target", ns) -> int:
    """Identify Namespace RESCAP: every type and IEKEY, and PTPL when the target offers it (`ptpl_offered`)."""
    if ns.resv is None:
        return 0
    return RESCAP_TYPES | I.RESCAP_IEKEY_13 | (I.RESCAP_PTPL if ptpl_offered(t) else 0)


def ptpl_offered(t: "Target") -> bool:
    """Whether hosts may ask for PTPL: the target has a reservation file to keep the state in, and is no gateway
    of a group (whose state lives in RADOS, outliving any one gateway, whatever a host asks)."""
    return bool(t.reservation_file) and t.resv_sync is None


# ---------------------------------------------------------------------------------------------------- commands

COMMANDS = CommandTable("reservation")  # I/O commands, dispatched with engine/io.py's (core.Target)


def _reservation(t: "Target", req: Request, data_len: int) -> Optional[Reservation]:
    """The namespace's reservation, or None after answering: Invalid Opcode where reservations are not enabled
    (as nvmet), Data SGL Length Invalid when the data is not `data_len` bytes."""
    resv = req.ns.resv
    if resv is None:
        t.complete(req, S.INVALID_OPCODE | S.DNR, location=LOC_OPCODE)
        return None
    if req.transfer_len != data_len:
        t.complete(req, S.SGL_INVALID_DATA | S.DNR, location=LOC_DPTR)
        return None
    return resv


class Decision:
    """What a Register, Acquire or Release decided on a reservation state (the `decide_*` functions): a status
    (0: done; then the state was changed in place if `changed`), the notices to send, and the hosts whose waiting
    commands a Preempt and Abort aborts.  Computed on the state alone, so that a gateway group computes it again
    on the state as the group's store has it (engine/shared_resv.py)."""

    __slots__ = ("status", "location", "notices", "aborted", "changed")

    def __init__(self, status: int = 0, location: int = NO_LOCATION, notices: Optional[list] = None,
                 aborted: Optional[list] = None, changed: bool = False):
        self.status, self.location, self.changed = status, location, changed
        self.notices: List[Tuple[bytes, int]] = notices or []
        self.aborted: List[bytes] = aborted or []


UNCHANGED = Decision()


def _key_status(resv: Reservation, hostid: bytes, key: int, iekey: bool = False,
                unregistered_ok: bool = False) -> int:
    """The check Register, Acquire and Release make on the state: 0 if the host is registered with `key` (with
    any key under IEKEY; or not registered at all, for Register's register action), else Reservation Conflict."""
    current = resv.registrants.get(hostid)
    allowed = unregistered_ok if current is None else iekey or current == key
    return 0 if allowed else CONFLICT


@COMMANDS.handles(NVM_RESV_REGISTER)
def _register(t: "Target", req: Request) -> Outcome:
    if _reservation(t, req, R.KEY_DATA_SIZE) is None:
        return COMPLETED
    action, cptpl = req.cdw10 & 7, req.cdw10 >> R.CPTPL_SHIFT
    if action > R.REPLACE or cptpl == 1:
        return t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW10)
    if cptpl == R.CPTPL_SET and not ptpl_offered(t):
        log.warning("namespace %d: a host asked for PTPL, but the target has no reservation file to keep it in "
                    "(`target serve` keeps it beside its config; a gateway group keeps the state in RADOS and "
                    "offers no PTPL)", req.ns.nsid)
        return t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW10)
    return t.fetch(req, R.KEY_DATA_SIZE, _register_data)


def _register_data(t: "Target", req: Request, data) -> Outcome:
    crkey, nrkey = R.KEYS.unpack(bytes(data[:R.KEY_DATA_SIZE]))
    return _decide(t, req, partial(decide_register, hostid=req.queue.ctrl.hostid, cdw10=req.cdw10, crkey=crkey,
                                   nrkey=nrkey))


def decide_register(resv: Reservation, hostid: bytes, cdw10: int, crkey: int, nrkey: int) -> Decision:
    action, iekey, cptpl = cdw10 & 7, bool(cdw10 & R.IEKEY), cdw10 >> R.CPTPL_SHIFT
    # Register: a host registered already may only repeat its key (Replace changes it)
    status = _key_status(resv, hostid, nrkey, unregistered_ok=True) if action == R.REGISTER else \
        _key_status(resv, hostid, crkey, iekey)
    if status:
        return Decision(status)
    notices: List[Tuple[bytes, int]] = []
    if action == R.REGISTER:
        resv.registrants[hostid] = nrkey
    elif action == R.UNREGISTER:
        notices = resv.unregister(hostid)
    else:
        resv.registrants[hostid] = nrkey  # Replace: the holder stays the holder
    resv.generation += 1
    if cptpl == R.CPTPL_SET:
        resv.ptpl = True
    elif cptpl == R.CPTPL_CLEAR:
        resv.ptpl = False
    return Decision(notices=notices, changed=True)


@COMMANDS.handles(NVM_RESV_ACQUIRE)
def _acquire(t: "Target", req: Request) -> Outcome:
    if _reservation(t, req, R.KEY_DATA_SIZE) is None:
        return COMPLETED
    action, rtype = req.cdw10 & 7, (req.cdw10 >> 8) & 0xFF
    # IEKEY is reserved for Acquire since NVMe 1.3 (nvmet refuses it too)
    if action > R.PREEMPT_AND_ABORT or rtype not in R.TYPES or req.cdw10 & R.IEKEY:
        return t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW10)
    return t.fetch(req, R.KEY_DATA_SIZE, _acquire_data)


def _acquire_data(t: "Target", req: Request, data) -> Outcome:
    crkey, prkey = R.KEYS.unpack(bytes(data[:R.KEY_DATA_SIZE]))
    return _decide(t, req, partial(decide_acquire, hostid=req.queue.ctrl.hostid, cdw10=req.cdw10, crkey=crkey,
                                   prkey=prkey))


def decide_acquire(resv: Reservation, hostid: bytes, cdw10: int, crkey: int, prkey: int) -> Decision:
    status = _key_status(resv, hostid, crkey)
    if status:
        return Decision(status)
    action, rtype = cdw10 & 7, (cdw10 >> 8) & 0xFF
    if action == R.ACQUIRE:
        if resv.holder is not None:
            if resv.holds(hostid) and resv.rtype == rtype:
                return UNCHANGED  # already held as asked: nothing changes
            return Decision(CONFLICT)
        resv.holder, resv.rtype = hostid, rtype
        return Decision(changed=True)
    outcome = _preempt(resv, hostid, rtype, prkey)
    if isinstance(outcome, int):
        return Decision(outcome, LOC_CDW10 if outcome & ~S.DNR == S.INVALID_FIELD else NO_LOCATION)
    preempted, notices = outcome
    resv.generation += 1
    return Decision(notices=notices, aborted=preempted if action == R.PREEMPT_AND_ABORT else [], changed=True)


def _preempt(resv: Reservation, hostid: bytes, rtype: int, prkey: int):
    """Preempt as the spec's Reservation Acquire, Preempt: (the preempted host identifiers, notices), or a
    status."""
    def unregister_by_key(key: int, keep_self: bool):
        hosts = [h for h, k in resv.registrants.items() if k == key and not (keep_self and h == hostid)]
        return hosts, _unregister_all(resv, hosts, hostid)

    holder = resv.holder
    if holder is None:  # not reserved: remove the registrants with that key
        hosts, notices = unregister_by_key(prkey, keep_self=False)
        return (hosts, notices) if hosts else CONFLICT
    if resv.rtype in R.ALL_REGISTRANTS:
        if prkey == 0:  # every other registrant goes; the preempting host holds it, of the type asked
            resv.holder, resv.rtype = hostid, rtype
            hosts = [h for h in resv.registrants if h != hostid]
            return hosts, _unregister_all(resv, hosts, hostid)
        hosts, notices = unregister_by_key(prkey, keep_self=False)
        return (hosts, notices) if hosts else CONFLICT
    if prkey == resv.registrants.get(holder):
        released = []
        if holder == hostid:  # the holder preempting itself changes the type (the others are told if it did)
            hosts = []
        else:
            hosts = [h for h, k in resv.registrants.items() if k == prkey and h != hostid]
        if resv.rtype != rtype:
            released = [(h, R.LOG_RESERVATION_RELEASED) for h in resv.registrants
                        if h != hostid and h not in hosts]
        resv.holder, resv.rtype = hostid, rtype
        return hosts, _unregister_all(resv, hosts, hostid) + released
    if prkey == 0:
        return S.INVALID_FIELD | S.DNR  # a zero key may not preempt a holder that has another key
    hosts, notices = unregister_by_key(prkey, keep_self=False)
    return (hosts, notices) if hosts else CONFLICT


def _unregister_all(resv: Reservation, hosts: List[bytes], sender: bytes) -> List[Tuple[bytes, int]]:
    notices = []
    for h in hosts:
        notices.extend(resv.unregister(h))
        if h != sender:
            notices.append((h, R.LOG_REGISTRATION_PREEMPTED))
    return notices


def _abort_waiting(t: "Target", ns, hosts: List[bytes]) -> None:
    """Preempt and abort: the preempted hosts' commands for the namespace that wait in the core (a paused
    namespace's, those over a QoS limit) are answered Command Aborted due to Preempt and Abort now.  Those already
    started are fenced (_changed): the preempt is answered once they are gone; a Write whose data is still
    arriving by the Python path is checked again when it arrives (conflict_status), and every later command of
    theirs conflicts."""
    if not hosts:
        return
    gone = set(hosts)
    keep = []
    for req, capsule in ns.held:
        ctrl = req.queue.ctrl
        if ctrl is not None and ctrl.hostid in gone and not req.queue.closed:
            t.complete(req, S.PREEMPT_ABORT)
        else:
            keep.append((req, capsule))
    ns.held.clear()
    ns.held.extend(keep)
    limiter = ns.qos
    if limiter is not None:
        waiting = list(limiter.held)
        limiter.held.clear()
        for req, start in waiting:
            ctrl = req.queue.ctrl
            if ctrl is not None and ctrl.hostid in gone and not req.queue.closed:
                t.complete(req, S.PREEMPT_ABORT)
            else:
                limiter.held.append((req, start))


@COMMANDS.handles(NVM_RESV_RELEASE)
def _release(t: "Target", req: Request) -> Outcome:
    if _reservation(t, req, R.RELEASE_DATA_SIZE) is None:
        return COMPLETED
    if req.cdw10 & 7 > R.CLEAR or req.cdw10 & R.IEKEY:
        return t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW10)
    return t.fetch(req, R.RELEASE_DATA_SIZE, _release_data)


def _release_data(t: "Target", req: Request, data) -> Outcome:
    crkey = int.from_bytes(bytes(data[:8]), "little")
    return _decide(t, req, partial(decide_release, hostid=req.queue.ctrl.hostid, cdw10=req.cdw10, crkey=crkey))


def decide_release(resv: Reservation, hostid: bytes, cdw10: int, crkey: int) -> Decision:
    status = _key_status(resv, hostid, crkey)
    if status:
        return Decision(status)
    action, rtype = cdw10 & 7, (cdw10 >> 8) & 0xFF
    if action == R.CLEAR:
        notices = [(h, R.LOG_RESERVATION_PREEMPTED) for h in resv.registrants if h != hostid]
        resv.registrants.clear()
        resv.holder, resv.rtype = None, 0
        resv.generation += 1
        return Decision(notices=notices, changed=True)
    if not resv.holds(hostid):
        return UNCHANGED  # nothing of this host's to release
    if rtype != resv.rtype:
        return Decision(S.INVALID_FIELD | S.DNR, LOC_CDW10)
    old = resv.rtype
    resv.holder, resv.rtype = None, 0
    notices = []
    if old not in (R.WRITE_EXCLUSIVE, R.EXCLUSIVE_ACCESS):
        notices = [(h, R.LOG_RESERVATION_RELEASED) for h in resv.registrants if h != hostid]
    return Decision(notices=notices, changed=True)


def _decide(t: "Target", req: Request, decide: Callable[[Reservation], Decision]) -> Outcome:
    """A Register, Acquire or Release whose data arrived: `decide` on the namespace's state, then answer.  In a
    gateway group (`t.resv_sync`) it is decided on the state as the group's store has it, off the loop
    (engine/shared_resv.py); here, on the target's own state, and a change goes through `_changed`."""
    ns = req.ns
    if ns.removed:  # removed since the command started
        return t.complete(req, S.INVALID_NS | S.DNR)
    if t.resv_sync is not None:
        return t.resv_sync.run(req, decide)
    resv = ns.resv
    before = resv.snapshot()
    decision = decide(resv)
    if decision.status:
        return t.complete(req, decision.status, location=decision.location)
    if not decision.changed:
        return t.complete(req, 0)
    _abort_waiting(t, ns, decision.aborted)
    return _changed(t, req, before, decision.notices)


@COMMANDS.handles(NVM_RESV_REPORT)
def _report(t: "Target", req: Request) -> Outcome:
    length = 4 * (req.cdw10 + 1)  # NUMD, 0's based
    if _reservation(t, req, length) is None:
        return COMPLETED
    if not req.cdw11 & R.EDS:  # our host identifiers are 128 bits: only the extended structure holds them
        return t.complete(req, S.HOST_ID_INCONSISTENT | S.DNR, location=LOC_CDW11)
    if length > t.max_transfer:
        return t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW10)
    if t.resv_sync is not None:  # a gateway group: the state as the group's store has it now
        return t.resv_sync.report(req, lambda resv: t.complete(req, 0, data=report(resv).pack(length)))
    return t.complete(req, 0, data=report(req.ns.resv).pack(length))


def report(resv: Reservation) -> R.ReservationStatus:
    regs = [R.Registrant(R.CNTLID_DYNAMIC, resv.holds(h), k, h) for h, k in resv.registrants.items()]
    return R.ReservationStatus(resv.generation, resv.rtype if resv.holder is not None else 0, resv.ptpl, regs,
                               len(regs))


def _changed(t: "Target", req: Request, before: dict, notices: List[Tuple[bytes, int]]) -> Outcome:
    """A reservation changed: kept (PTPL), every fast-path queue of the subsystem given its new view, the hosts
    told; then the command completes, so no command the host sends after this answer meets the old state.  A
    change that takes an access away from a host (a preempt, an acquire by another host, a clear) is fenced
    first: it is answered once every command started before it on the namespace is gone (engine/fencing.py),
    so a preempted host's Write whose data is still landing never lands after the answer, on either data path,
    as nvmet completes a Preempt and Abort only after the preempted controllers' commands."""
    ns = req.ns
    resv = ns.resv
    if resv.ptpl or before.get("ptpl"):
        try:
            t.save_reservations()
        except OSError as exc:
            resv.restore(before)  # not kept: not done
            log.error("namespace %d: cannot keep the reservation state in %s: %s", ns.nsid,
                      t.reservation_file, exc)
            return t.complete(req, S.INTERNAL | S.DNR)
    sub = req.queue.ctrl.subsystem
    if not _access_taken(t, sub, ns, before):
        t._refresh_views(sub)
        notify(t, sub, ns, notices)
        return t.complete(req, 0)

    def fenced(error) -> None:
        if error is not None:  # the queues holding them were torn down, and a device still has some
            log.error("%s namespace %d: the reservation change is answered with commands from before it still on "
                      "the device: %s", sub.nqn, ns.nsid, error)
        notify(t, sub, ns, notices)
        t.complete(req, 0)

    t.fence([(sub.nqn, ns)], fenced, f"a reservation change on {sub.nqn} namespace {ns.nsid}")
    return DEFERRED


def _access_taken(t: "Target", sub, ns, before: dict) -> bool:
    """Whether the change from `before` took an access away from a host with a queue on the subsystem (one of
    an ended controller included: its commands may still be in flight)."""
    old = Reservation()
    old.restore(before)
    hosts = {qs.ctrl.hostid for qs in t.queue_states() if qs.ctrl is not None and qs.ctrl.subsystem is sub}
    return any(old.allowed(h) - ns.resv.allowed(h) for h in hosts)


def notify(t: "Target", sub, ns, notices: List[Tuple[bytes, int]]) -> None:
    """A Reservation Notification log entry and its event to each controller of the hosts told (unless their
    mask for the namespace masks that type)."""
    for hostid, log_type in notices:
        for ctrl in list(sub.controllers.values()):
            if ctrl.hostid == hostid and not ctrl.dead and not ctrl.resv_masks.get(ns.nsid, 0) & (1 << log_type):
                ctrl.add_resv_notice(log_type, ns.nsid)
                t.deliver_events(ctrl)


# ---------------------------------------------------------------------------------------------------- features

def set_feature(t: "Target", req: Request, fid: int) -> Outcome:
    """Set Features Reservation Notification Mask (0x82) and Reservation Persistence (0x83)."""
    ctrl = req.queue.ctrl
    value = req.cdw11
    if fid == A.FEAT_RESV_MASK:
        if value & ~R.MASK_ALL:
            return t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW11)
        if req.nsid == NSID_ALL:
            for ns in ctrl.subsystem.visible_namespaces(ctrl.hostnqn):
                if ns.resv is not None:
                    ctrl.resv_masks[ns.nsid] = value
            return t.complete(req, 0, result=value)
        ns = _feature_namespace(t, req)
        if ns is None:
            return COMPLETED
        ctrl.resv_masks[ns.nsid] = value
        return t.complete(req, 0, result=value)
    ns = _feature_namespace(t, req)
    if ns is None:
        return COMPLETED
    resv = ns.resv
    ptpl = bool(value & 1)
    if ptpl and not ptpl_offered(t):
        return t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW11)
    if ptpl != resv.ptpl:
        before = resv.snapshot()
        resv.ptpl = ptpl
        try:
            t.save_reservations()
        except OSError as exc:
            resv.restore(before)
            log.error("namespace %d: cannot keep the reservation state in %s: %s", ns.nsid, t.reservation_file, exc)
            return t.complete(req, S.INTERNAL | S.DNR)
    return t.complete(req, 0, result=1 if ptpl else 0)


def get_feature(t: "Target", req: Request, fid: int) -> Outcome:
    ns = _feature_namespace(t, req)
    if ns is None:
        return COMPLETED
    if fid == A.FEAT_RESV_MASK:
        return t.complete(req, 0, result=req.queue.ctrl.resv_masks.get(ns.nsid, 0))
    return t.complete(req, 0, result=1 if ns.resv.ptpl else 0)


def _feature_namespace(t: "Target", req: Request):
    """The namespace a reservation feature names, or None after answering (Invalid Namespace; Invalid Field
    where it has no reservations, as nvmet)."""
    ctrl = req.queue.ctrl
    ns = ctrl.subsystem.namespace_for(req.nsid, ctrl.hostnqn) if req.nsid not in (0, NSID_ALL) else None
    if ns is None:
        t.complete(req, S.INVALID_NS | S.DNR, location=LOC_NSID)
        return None
    if ns.resv is None:
        t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW10)
        return None
    return ns


def log_page(ctrl, retain: bool) -> bytes:
    """The Reservation Notification log (LID 0x80): the oldest entry, taken; zeros when there is none."""
    return ctrl.take_resv_notice(retain).pack()


# ---------------------------------------------------------------------------------------------------- persistence

def save(path: str, subsystems) -> None:
    """Write the state of every namespace whose reservation persists through power loss (atomically, 0600)."""
    state = {}
    for sub in subsystems.values():
        for ns in sub.namespaces.values():
            if ns.resv is not None and ns.resv.ptpl:
                state.setdefault(sub.nqn, {})[str(ns.nsid)] = dict(ns.resv.snapshot(), uuid=ns.uuid.hex())
    write_file(path, json.dumps({"version": 1, "reservations": state}, indent=1) + "\n")


def restore(path: str, subsystems) -> int:
    """Read back what `save` wrote (none: nothing to restore); a namespace whose UUID changed since is left
    clear.  Returns how many were restored."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except FileNotFoundError:
        return 0
    restored = 0
    for nqn, namespaces in (data.get("reservations") or {}).items():
        sub = subsystems.get(nqn)
        for nsid, state in namespaces.items():
            ns = sub.namespaces.get(int(nsid)) if sub is not None else None
            if ns is None or ns.resv is None:
                log.warning("%s: reservation of namespace %s not restored: it has no reservations now", path, nsid)
                continue
            if state.get("uuid") != ns.uuid.hex():
                log.warning("%s: reservation of %s namespace %s not restored: its UUID changed", path, nqn, nsid)
                continue
            ns.resv.restore(state)
            restored += 1
    return restored


def file_for(config_path: str) -> str:
    """Where `target serve` keeps the reservations that persist: beside its config file."""
    return os.path.join(os.path.dirname(os.path.abspath(config_path)),
                        f".{os.path.basename(config_path)}.reservations")
