"""The discovery controller (docs/protocol.md §5.8, §8.1 item 14).

It accepts what nvmet's does: fabrics commands, Identify CNS 1, Get Log Page
0x70 (honouring LPO and partial lengths), Set/Get Features KATO and Async
Event Configuration, AER, Keep Alive.  The log lists, for each port in scope,
the subsystems that port exports and the connecting host may access, plus the
port's referrals.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, List

from .. import __version__
from ..nvme import admin as A
from ..nvme import identify as I
from ..nvme import log as L
from ..nvme import status as S
from ..nvme.command import (ADMIN_ASYNC_EVENT, ADMIN_GET_FEATURES, ADMIN_GET_LOG_PAGE, ADMIN_IDENTIFY, ADMIN_KEEP_ALIVE,
                            ADMIN_SET_FEATURES)
from ..nvme.fabrics import DISCOVERY_NQN
from .admin import (KAS, async_event, get_feature_common, keep_alive, log_page_request, set_feature_common, sgls_for,
                    window)
from .limits import MAX_AER
from .handlers import CommandTable
from .request import COMPLETED, LOC_CDW10, LOC_DPTR, Outcome, Request

if TYPE_CHECKING:
    from .core import Target

WILDCARD_ADDRESSES = ("", "0.0.0.0", "::", "[::]")
COMMANDS = CommandTable("discovery")  # each handler below declares its opcode
COMMANDS.handles(ADMIN_ASYNC_EVENT)(async_event)  # as an I/O controller's
COMMANDS.handles(ADMIN_KEEP_ALIVE)(keep_alive)
_TREQ = {"not specified": L.TREQ_NOT_SPECIFIED, "required": L.TREQ_REQUIRED, "not required": L.TREQ_NOT_REQUIRED}


def identify_discovery_controller(ctrl, queue) -> bytes:
    sub = ctrl.subsystem
    return I.IdentifyController(
        sn=sub.serial, mn=sub.model, fr=__version__[:8], rab=6, mdts=0, cntlid=ctrl.cntlid, ver=sub.version,
        cntrltype=I.CNTRLTYPE_DISCOVERY, aerl=MAX_AER - 1, lpa=0x04, elpe=0, kas=KAS, sqes=0x66, cqes=0x44,
        maxcmd=32, sgls=sgls_for(queue, ctrl.port.in_capsule_size),
        subnqn=DISCOVERY_NQN, ioccsz=4, iorcsz=1, icdoff=0, msdbd=1, dctype=1,
    ).pack()


def _entry_address(port, local_address: str) -> str:
    """nvmet never reports a wildcard: it substitutes the address the host connected to."""
    if port.traddr in WILDCARD_ADDRESSES and local_address:
        return local_address
    return port.traddr


def discovery_entries(t: Target, ctrl) -> List[L.DiscoveryLogEntry]:
    local = ctrl.admin_queue.transport.local_address if ctrl.admin_queue else ""
    entries = []
    for port in sorted(ctrl.port.discovery_ports(), key=lambda p: p.portid):
        base = dict(trtype=L.TRTYPES.get(port.trtype, 0), adrfam=L.ADRFAMS.get(port.adrfam, 0),
                    treq=_TREQ.get(port.treq, 0), portid=port.portid, trsvcid=port.trsvcid_str,
                    traddr=_entry_address(port, local))
        for nqn in port.subsystems:
            sub = t.subsystems.get(nqn)
            if sub is not None and sub.host_allowed(ctrl.hostnqn):
                entries.append(L.DiscoveryLogEntry(subtype=L.SUBTYPE_NVME, subnqn=nqn, **base))
        for ref in port.referrals:
            if ref.enabled:
                entries.append(L.DiscoveryLogEntry(
                    trtype=L.TRTYPES.get(ref.trtype, 0), adrfam=L.ADRFAMS.get(ref.adrfam, 0),
                    subtype=L.SUBTYPE_REFERRAL, treq=_TREQ.get(ref.treq, 0),
                    portid=ref.portid if ref.portid is not None else port.portid,
                    trsvcid=str(ref.trsvcid), subnqn=DISCOVERY_NQN, traddr=ref.traddr))
    return entries


def discovery_log(t: Target, ctrl) -> bytes:
    entries = discovery_entries(t, ctrl)
    header = L.DiscoveryLogHeader(genctr=t.genctr, numrec=len(entries))
    return header.pack() + b"".join(e.pack() for e in entries)


@COMMANDS.handles(ADMIN_IDENTIFY)
def _identify(t: Target, req: Request) -> Outcome:
    if req.transfer_len != I.IDENTIFY_SIZE:
        return t.complete(req, S.SGL_INVALID_DATA | S.DNR, location=LOC_DPTR)
    if req.cdw10 & 0xFF != A.CNS_CONTROLLER:
        return t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW10)
    return t.complete(req, 0, data=identify_discovery_controller(req.queue.ctrl, req.queue))


@COMMANDS.handles(ADMIN_GET_LOG_PAGE)
def _get_log_page(t: Target, req: Request) -> Outcome:
    cmd = log_page_request(t, req)
    if cmd is None:
        return COMPLETED
    if cmd.lid != A.LID_DISCOVERY:
        return t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW10)
    ctrl = req.queue.ctrl
    if not cmd.rae:  # RAE clear: a discovery-change event may be reported again
        ctrl.aen_masked &= ~A.AEN_CFG_DISC_CHANGE
    return t.complete(req, 0, data=window(discovery_log(t, ctrl), cmd.lpo, cmd.length))


@COMMANDS.handles(ADMIN_SET_FEATURES)
def _set_features(t: Target, req: Request) -> Outcome:
    if req.transfer_len:
        return t.complete(req, S.SGL_INVALID_DATA | S.DNR, location=LOC_DPTR)
    outcome = set_feature_common(t, req, req.cdw10 & 0xFF)
    if outcome is None:
        return t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW10)
    return outcome


@COMMANDS.handles(ADMIN_GET_FEATURES)
def _get_features(t: Target, req: Request) -> Outcome:
    if req.transfer_len:
        return t.complete(req, S.SGL_INVALID_DATA | S.DNR, location=LOC_DPTR)
    outcome = get_feature_common(t, req, req.cdw10 & 0xFF)
    if outcome is None:
        return t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW10)
    return outcome

