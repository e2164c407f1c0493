"""A target controller: registers, keep-alive, asynchronous events, error log (docs/protocol.md §4.3, §5.5, §5.6)."""
from __future__ import annotations

import logging
import math
from collections import deque
from typing import Deque, Dict, List

from ..nvme import admin as A
from ..nvme import fabrics as F
from ..nvme.command import FABRICS_OPCODE, NVM_READ, NVM_WRITE, NVM_WRITE_ZEROES
from ..nvme.log import CHANGED_NS_MAX, ErrorLogEntry
from .limits import ERROR_LOG_ENTRIES
from .request import Request

log = logging.getLogger(__name__)

DISCOVERY_DEFAULT_KATO_MS = 120_000  # nvmet keeps a discovery controller with KATO 0 alive this long
IO_AEN_SUPPORTED = A.AEN_CFG_NS_ATTR
DISCOVERY_AEN_SUPPORTED = A.AEN_CFG_DISC_CHANGE


class Controller:
    """One host's association with a subsystem, created by the admin Connect."""

    def __init__(self, subsystem, cntlid: int, hostnqn: str, hostid: bytes, kato_ms: int, port, cap: int,
                 now: float):
        self.subsystem = subsystem
        self.cntlid = cntlid
        self.hostnqn = hostnqn
        self.hostid = hostid
        self.port = port
        self.is_discovery = subsystem.is_discovery
        if self.is_discovery and kato_ms == 0:
            kato_ms = DISCOVERY_DEFAULT_KATO_MS
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
        self.dead = False

    # -- keep alive
    @property
    def kato_seconds(self) -> int:
        """nvmet rounds KATO up to whole seconds."""
        return math.ceil(self.kato_ms / 1000) if self.kato_ms else 0

    shutdown_at = None  # when the host wrote CC.SHN; the controller is deleted shortly after

    def keep_alive(self, now: float) -> None:
        self.last_traffic = now

    def expired(self, now: float) -> bool:
        return bool(self.kato_ms) and now - self.last_traffic > self.kato_seconds

    # -- registers
    @property
    def ready(self) -> bool:
        return bool(self.cc & F.CC_EN) and bool(self.csts & F.CSTS_RDY)

    def set_cc(self, new: int, now: float) -> None:
        """The EN and SHN handshakes, as nvmet_update_cc does them."""
        old = self.cc
        self.cc = new
        if new & F.CC_EN and not old & F.CC_EN:
            self._start(now)
        if not new & F.CC_EN and old & F.CC_EN:
            self._clear()
        if new & F.CC_SHN_MASK and not old & F.CC_SHN_MASK:
            self._clear()
            self.subsystem_flush()
            self.csts |= F.CSTS_SHST_COMPLETE
            self.shutdown_at = now
        if not new & F.CC_SHN_MASK and old & F.CC_SHN_MASK:
            self.csts &= ~F.CSTS_SHST_COMPLETE
            self.shutdown_at = None

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

    def _clear(self) -> None:
        self.csts &= ~F.CSTS_RDY
        self.cc = 0

    def subsystem_flush(self) -> None:
        """A normal shutdown: make the namespaces' data durable."""
        for ns in list(self.subsystem.namespaces.values()):
            try:
                ns.backend.flush()
            except Exception as exc:
                log.error("controller %d: flush of namespace %d at shutdown failed: %s", self.cntlid, ns.nsid, exc)

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
