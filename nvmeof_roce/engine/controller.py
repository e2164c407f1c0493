"""A target controller: its lifecycle, registers, keep-alive, asynchronous events, error log (docs/protocol.md
§4.3, §5.5, §5.6).

The lifecycle uses the Linux host driver's controller states (`enum nvme_ctrl_state`, drivers/nvme/host) and its
transition table (`nvme_change_ctrl_state`), driven by what the host writes to CC as nvmet_update_cc handles it:

    Connect                          -> NEW       (CC.EN = 0, CSTS.RDY = 0)
    CC.EN 0 -> 1, CC valid           -> LIVE      (CSTS.RDY = 1; CC invalid: CSTS.CFS = 1, the state stays)
    CC.EN 1 -> 0 (a reset)           -> RESETTING -> CONNECTING  (CSTS.RDY = 0, CC = 0; waits for CC.EN again)
    CC.SHN 00 -> 01/10 (a shutdown)  -> RESETTING (CSTS.RDY = 0, CSTS.SHST = 01 "occurring" while the
                                                   namespaces flush)
    flush done                       -> CONNECTING (CSTS.SHST = 10 "complete"; the host disconnects next)
    keep-alive expiry, admin queue gone, a fatal error, shutdown linger over
                                     -> DELETING  -> DEAD (CNTLID freed, queues closed)

`change_state` raises IllegalControllerTransition for a transition the table does not have, where the kernel's
refuses it; a caller for which the move may legitimately not apply (a reset of a controller a fatal error is
already deleting) asks `can_enter` first.  One addition to the host's table: NEW -> DELETING, since a target
controller may end before its host ever enables it.
"""
from __future__ import annotations

import enum
import logging
import math
from collections import deque
from typing import Deque, Dict, List

from ..nvme import admin as A
from ..nvme import fabrics as F
from ..nvme.command import FABRICS_OPCODE, NVM_READ, NVM_WRITE, NVM_WRITE_ZEROES
from ..nvme.log import CHANGED_NS_MAX, ErrorLogEntry
from ..nvme.reservation import LOG_EMPTY, NotificationLog
from .limits import ERROR_LOG_ENTRIES
from .request import Request

log = logging.getLogger(__name__)

IO_AEN_SUPPORTED = A.AEN_CFG_NS_ATTR | A.AEN_CFG_ANA_CHANGE
DISCOVERY_IDLE_LIMIT = 120  # s: nvmet keeps a discovery controller with KATO 0 alive this long (NVMET_DISC_KATO_MS)
DEFAULT_MAX_KATO = 300  # s: the longest keep-alive timeout a host may ask for (config: nvmeof_roce.max_kato)
DISCOVERY_AEN_SUPPORTED = A.AEN_CFG_DISC_CHANGE
RESV_LOG_DEPTH = 64  # Reservation Notification log entries kept until read (nvmet keeps as many)


class CtrlState(enum.Enum):
    NEW = "new"
    LIVE = "live"
    RESETTING = "resetting"
    CONNECTING = "connecting"
    DELETING = "deleting"
    DEAD = "dead"


# For each state, the states a controller may enter it from (nvme_change_ctrl_state; NEW -> DELETING added).
ALLOWED_FROM = {
    CtrlState.LIVE: {CtrlState.NEW, CtrlState.RESETTING, CtrlState.CONNECTING},
    CtrlState.RESETTING: {CtrlState.NEW, CtrlState.LIVE},
    CtrlState.CONNECTING: {CtrlState.NEW, CtrlState.RESETTING},
    CtrlState.DELETING: {CtrlState.NEW, CtrlState.LIVE, CtrlState.RESETTING, CtrlState.CONNECTING},
    CtrlState.DEAD: {CtrlState.DELETING},
    CtrlState.NEW: set(),
}


class IllegalControllerTransition(RuntimeError):
    """A controller was moved along no edge of its lifecycle (a bug in the engine)."""

    def __init__(self, cntlid: int, old: CtrlState, new: CtrlState):
        super().__init__(f"controller {cntlid}: illegal transition {old.value} -> {new.value}")
        self.old, self.new = old, new


def cc_en(cc: int) -> bool:
    """CC.EN: the host enables the controller."""
    return bool(cc & F.CC_EN)


def cc_shn(cc: int) -> int:
    """CC.SHN: 00 no notification, 01 normal, 10 abrupt shutdown."""
    return cc & F.CC_SHN_MASK


class Controller:
    """One host's association with a subsystem, created by the admin Connect."""

    def __init__(self, subsystem, cntlid: int, hostnqn: str, hostid: bytes, kato_ms: int, port, cap: int,
                 now: float, max_kato: int = DEFAULT_MAX_KATO, discovery_idle: int = DISCOVERY_IDLE_LIMIT):
        self.subsystem = subsystem
        self.cntlid = cntlid
        self.hostnqn = hostnqn
        self.hostid = hostid
        self.port = port
        self.is_discovery = subsystem.is_discovery
        self.max_kato = max_kato
        self.discovery_idle = discovery_idle
        if self.is_discovery and kato_ms == 0:
            kato_ms = discovery_idle * 1000  # as nvmet_alloc_ctrl does with NVMET_DISC_KATO_MS
        self.kato_ms = kato_ms
        self.last_traffic = now
        self.cap = cap
        self.cc = 0
        self.csts = 0
        self.admin_queue = None
        self.io_queues: Dict[int, object] = {}
        self.max_io_qid = subsystem.max_qid  # lowered by Set Features Number of Queues
        self.aen_enabled = 0
        self.aen_masked = 0  # an event type already reported, until its log page is read
        self.aers: List[Request] = []
        self.pending_events: Deque[int] = deque()
        self.changed_nsids: List[int] = []
        self.error_log: Deque[ErrorLogEntry] = deque(maxlen=ERROR_LOG_ENTRIES)
        self.error_count = 0
        self.state = CtrlState.NEW
        self.auth = None  # engine/auth.py's HostAuth when the host must authenticate each queue
        # Reservations (engine/reservations.py): the notification mask per NSID (feature 0x82), the
        # Reservation Notification log's entries not yet read, its count, those lost, the event's mask.
        self.resv_masks: Dict[int, int] = {}
        self.resv_log: Deque[tuple] = deque()
        self.resv_log_count = 0
        self.resv_lost = 0
        self.resv_event_masked = False

    # -- lifecycle
    def can_enter(self, new: CtrlState) -> bool:
        """Whether the lifecycle allows `new` from the current state."""
        return self.state in ALLOWED_FROM[new]

    def change_state(self, new: CtrlState) -> None:
        """Enter `new`; IllegalControllerTransition (naming both states) if the lifecycle has no such edge."""
        if self.state not in ALLOWED_FROM[new]:
            raise IllegalControllerTransition(self.cntlid, self.state, new)
        log.debug("controller %d: %s -> %s", self.cntlid, self.state.value, new.value)
        self.state = new

    @property
    def dead(self) -> bool:
        """Deleted: its CNTLID is free and its queues are closing."""
        return self.state is CtrlState.DEAD

    # -- keep alive
    @property
    def kato_seconds(self) -> int:
        """nvmet rounds KATO up to whole seconds."""
        return math.ceil(self.kato_ms / 1000) if self.kato_ms else 0

    shutdown_at = None  # when the host wrote CC.SHN; the controller is deleted shortly after

    def keep_alive(self, now: float) -> None:
        self.last_traffic = now

    @property
    def timeout_seconds(self) -> int:
        """How long the target waits for traffic before it deletes the controller.  KATO 0 turns the
        host's keep-alive off; nvmet then runs no timer at all, which keeps a vanished host's queues
        forever: here a discovery controller gets the discovery idle limit and an I/O controller the
        target's max_kato (any command counts, CTRATT.TBKAS)."""
        if self.kato_ms:
            return self.kato_seconds
        return self.discovery_idle if self.is_discovery else self.max_kato

    def expired(self, now: float) -> bool:
        return now - self.last_traffic > self.timeout_seconds

    # -- registers
    @property
    def ready(self) -> bool:
        """CC.EN = 1 and CSTS.RDY = 1: commands other than fabrics ones are accepted."""
        return cc_en(self.cc) and bool(self.csts & F.CSTS_RDY)

    def set_cc(self, new: int, now: float) -> None:
        """Property Set of CC: the CC.EN and CC.SHN handshakes, as nvmet_update_cc does them (module docstring)."""
        old = self.cc
        self.cc = new
        if cc_en(new) and not cc_en(old):  # enable: check CC, then CSTS.RDY (or CSTS.CFS)
            self._start(now)
        if not cc_en(new) and cc_en(old):  # reset
            self._clear()
            if self.can_enter(CtrlState.RESETTING):  # not after a shutdown, nor while a fatal error deletes it
                self.change_state(CtrlState.RESETTING)
                self.change_state(CtrlState.CONNECTING)
        if cc_shn(new) and not cc_shn(old):  # shutdown notification
            # The core flushes the namespaces (off the loop for files), then calls shutdown_complete.
            self._clear()
            self.csts = (self.csts & ~F.CSTS_SHST_MASK) | F.CSTS_SHST_OCCUR
            if self.can_enter(CtrlState.RESETTING):  # a host may notify a controller it never enabled, or reset
                self.change_state(CtrlState.RESETTING)
        if not cc_shn(new) and cc_shn(old):
            self.csts &= ~F.CSTS_SHST_MASK
            self.shutdown_at = None

    @property
    def shutting_down(self) -> bool:
        """CC.SHN was written and the flush it asks for is running (CSTS.SHST = occurring)."""
        return self.csts & F.CSTS_SHST_MASK == F.CSTS_SHST_OCCUR

    def shutdown_complete(self, now: float) -> None:
        """The flush CC.SHN asked for is done: CSTS.SHST = complete."""
        if self.shutting_down:
            self.csts = (self.csts & ~F.CSTS_SHST_MASK) | F.CSTS_SHST_COMPLETE
            self.shutdown_at = now
            if self.can_enter(CtrlState.CONNECTING):  # not once it is being deleted, nor re-enabled meanwhile
                self.change_state(CtrlState.CONNECTING)

    def _start(self, now: float) -> None:
        cc = self.cc
        iosqes = (cc & F.CC_IOSQES_MASK) >> F.CC_IOSQES_SHIFT
        iocqes = (cc & F.CC_IOCQES_MASK) >> F.CC_IOCQES_SHIFT
        css = (cc & F.CC_CSS_MASK) >> F.CC_CSS_SHIFT
        if not self.is_discovery and (iosqes != 6 or iocqes != 4):
            self.csts = F.CSTS_CFS
            return
        if cc & F.CC_MPS_MASK or cc & F.CC_AMS_MASK or css not in (F.CC_CSS_NVM, F.CC_CSS_CSI):
            self.csts = F.CSTS_CFS
            return
        self.csts = F.CSTS_RDY
        self.last_traffic = now  # the keep-alive timer restarts at enable
        if self.can_enter(CtrlState.LIVE):  # not while a fatal error deletes it
            self.change_state(CtrlState.LIVE)

    def _clear(self) -> None:
        self.csts &= ~F.CSTS_RDY
        self.cc = 0

    # -- asynchronous events
    def supported_aen(self) -> int:
        return DISCOVERY_AEN_SUPPORTED if self.is_discovery else IO_AEN_SUPPORTED

    def add_event(self, aen_bit: int, result: int) -> None:
        """Queue an event if the host enabled it and it is not masked (until its log is read)."""
        if not self.aen_enabled & aen_bit or self.aen_masked & aen_bit:
            return
        self.aen_masked |= aen_bit
        self.pending_events.append(result)

    def ns_changed(self, nsid: int) -> None:
        # Past 1024 entries the log reports overflow (ChangedNsList.pack), so stop growing there.
        if len(self.changed_nsids) <= CHANGED_NS_MAX and nsid not in self.changed_nsids:
            self.changed_nsids.append(nsid)
        self.add_event(A.AEN_CFG_NS_ATTR, A.aer_result(A.AER_TYPE_NOTICE, A.AER_NOTICE_NS_CHANGED,
                                                        A.LID_CHANGED_NS))

    def take_changed_nsids(self, retain_event: bool) -> List[int]:
        out, self.changed_nsids = self.changed_nsids, []
        if not retain_event:
            self.aen_masked &= ~A.AEN_CFG_NS_ATTR
        return out

    def add_resv_notice(self, log_type: int, nsid: int) -> None:
        """A Reservation Notification log entry, and its event (I/O command set specific, log page 0x80) unless
        one is already reported and its log not read since.  Past RESV_LOG_DEPTH unread entries, the newest
        are counted as lost: the count of the next entry read tells the host how many."""
        self.resv_log_count = self.resv_log_count % 0xFFFFFFFFFFFFFFFF + 1  # never 0: 0 means an empty log
        if len(self.resv_log) >= RESV_LOG_DEPTH:
            self.resv_lost += 1
        else:
            self.resv_log.append((self.resv_log_count, log_type, nsid))
        if not self.resv_event_masked:
            self.resv_event_masked = True
            self.pending_events.append(A.aer_result(A.AER_TYPE_IO_CMD_SET, A.AER_RESV_LOG_AVAILABLE,
                                                    A.LID_RESERVATION))

    def take_resv_notice(self, retain_event: bool):
        """The oldest Reservation Notification log entry (taken), as nvme/reservation.py's NotificationLog; an
        empty one (count 0) when none is left.  Reading the log re-arms its event unless RAE is set."""
        if not retain_event:
            self.resv_event_masked = False
        if not self.resv_log:
            return NotificationLog(0, LOG_EMPTY, 0, 0)
        count, log_type, nsid = self.resv_log.popleft()
        if not self.resv_log and self.resv_lost:  # the lost ones came after this one
            count, self.resv_lost = count + self.resv_lost, 0
        elif self.resv_log:
            count = self.resv_log[0][0] - 1
        return NotificationLog(count, log_type, min(len(self.resv_log), 255), nsid)

    def ana_log_read(self, retain_event: bool) -> None:
        """Reading the ANA log re-arms the ANA change notice unless RAE is set."""
        if not retain_event:
            self.aen_masked &= ~A.AEN_CFG_ANA_CHANGE

    # -- error log
    def log_error(self, req: Request, status: int, location: int) -> None:
        self.error_count += 1
        is_rw = req.queue.qid and req.opc in (NVM_READ, NVM_WRITE, NVM_WRITE_ZEROES)
        lba = req.cdw10 | (req.cdw11 << 32) if is_rw else 0
        self.error_log.appendleft(ErrorLogEntry(error_count=self.error_count, sqid=req.queue.qid, cid=req.cid,
                                                status=status, param_location=location, lba=lba,
                                                nsid=req.nsid if req.opc != FABRICS_OPCODE else 0))

    def queues(self) -> list:
        out = list(self.io_queues.values())
        if self.admin_queue is not None:
            out.append(self.admin_queue)
        return out

    def __repr__(self) -> str:
        return f"<Controller {self.cntlid} {self.subsystem.nqn} host={self.hostnqn}>"
