"""Admin commands of an I/O controller (docs/protocol.md §5): Identify, logs, features, AER, Keep Alive.

Each handler validates the command, then completes it through the Target
(`t.complete`), or holds it (`t.hold`, the AER).  Lengths are checked against
the SGL exactly as nvmet does (§3.1).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from .. import __version__
from ..nvme import admin as A
from ..nvme import identify as I
from ..nvme import log as L
from ..nvme import status as S
from ..config import ANA_GRPID_MAX
from ..nvme.command import (ADMIN_ABORT, ADMIN_ASYNC_EVENT, ADMIN_GET_FEATURES, ADMIN_GET_LOG_PAGE, ADMIN_IDENTIFY,
                            ADMIN_KEEP_ALIVE, ADMIN_SET_FEATURES, NSID_ALL)
from ..nvme.log import ERROR_ENTRY_SIZE, ChangedNsList, SmartLog
from . import io, reservations
from .ana import ANACAP, ANATT_SECONDS, UNREACHABLE
from .handlers import CommandTable, effects_log
from .limits import ERROR_LOG_ENTRIES, MAX_AER, MAX_NSID
from .request import COMPLETED, LOC_CDW10, LOC_CDW11, LOC_CDW12, LOC_DPTR, LOC_NSID, Outcome, Request

if TYPE_CHECKING:
    from .core import Target

log = logging.getLogger(__name__)

KAS = 10  # keep-alive granularity in 100 ms units
ONCS = I.ONCS_DSM | I.ONCS_WRITE_ZEROES | I.ONCS_RESERVATIONS  # each namespace's RESCAP says if it has them
CTRATT_HOSTID_128 = 1 << 0
CTRATT_TBKAS = 1 << 6  # traffic based keep alive: every command restarts the timer
FIRMWARE_REVISION = __version__[:8]
# Several ports, several controllers, and ANA reporting (which the Linux host needs to use multipath with ANA)
CMIC = I.CMIC_MULTI_PORT | I.CMIC_MULTI_CTRL | I.CMIC_ANA

COMMANDS = CommandTable("admin")  # each handler below declares its opcode and effects


def sgls_for(queue, in_capsule_size: int) -> int:
    """Identify's SGLS: the SGL kinds the transport of the queue the command came on takes (its registry
    entry's `sgls`), for a port with `in_capsule_size` bytes of in-capsule data."""
    return queue.ops.sgls(in_capsule_size)


def firmware_revision(sub) -> str:
    """FR of Identify Controller: the subsystem's attr firmware (nvmet's attr_firmware), else our version."""
    config = sub.config
    return (config.attrs.get("firmware") if config is not None else None) or FIRMWARE_REVISION


def ieee_oui(sub) -> bytes:
    """IEEE of Identify Controller: attr ieee_oui (nvmet's attr_ieee_oui), least significant byte first as
    nvmet_execute_identify_ctrl puts it (put_unaligned_le24); zero when not given."""
    config = sub.config
    value = (config.attrs.get("ieee_oui") if config is not None else None) or "0"
    return int(str(value), 0).to_bytes(3, "little")


def identify_controller(ctrl, queue) -> bytes:
    """Identify Controller as the Linux host wants it (§5.2, §8.1 item 8), asked on `queue`."""
    sub = ctrl.subsystem
    port = ctrl.port
    mqes = port.mqes
    return I.IdentifyController(
        sn=sub.serial, mn=sub.model, fr=firmware_revision(sub), ieee=ieee_oui(sub), rab=6, cmic=CMIC, mdts=port.target.limits.mdts, cntlid=ctrl.cntlid,
        ver=sub.version, oaes=ctrl.supported_aen(), ctratt=CTRATT_HOSTID_128 | CTRATT_TBKAS,
        cntrltype=I.CNTRLTYPE_IO, acl=3, aerl=MAX_AER - 1, frmw=0x03, lpa=0x07, elpe=ERROR_LOG_ENTRIES - 1,
        kas=KAS, anatt=ANATT_SECONDS, anacap=ANACAP, anagrpmax=ANA_GRPID_MAX, nanagrpid=ANA_GRPID_MAX,
        mnan=MAX_NSID, sqes=0x66, cqes=0x44, maxcmd=mqes + 1, nn=MAX_NSID, oncs=ONCS, vwc=1,
        sgls=sgls_for(queue, port.in_capsule_size), subnqn=sub.nqn,
        ioccsz=(64 + port.in_capsule_size) // 16,
        iorcsz=1, icdoff=0, msdbd=1, psd0_max_power=0x09C4, psd0_entry_lat=0x10, psd0_exit_lat=0x4,
    ).pack()


def identify_namespace(ns, ana_state: str = "optimized", rescap: int = 0) -> bytes:
    """Identify Namespace (§5.3): one LBA format, shared (NMIC), NCAP = NSZE, its ANA group; NUSE 0 while
    the namespace cannot be reached through this port (nvmet_execute_identify_ns); RESCAP, the reservation
    types and options it supports (reservations.rescap)."""
    return I.IdentifyNamespace(
        nsze=ns.num_blocks, ncap=ns.num_blocks, nuse=0 if ana_state in UNREACHABLE else ns.num_blocks, nmic=1,
        rescap=rescap,
        lbaf0_lbads=ns.lbads, nguid=ns.nguid or bytes(16), eui64=ns.eui64 or bytes(8), anagrpid=ns.ana_grpid,
    ).pack()


def ns_descriptors(ns) -> bytes:
    """CNS 0x03: EUI-64 and NGUID when configured, always the UUID, then CSI = NVM."""
    descs = []
    if ns.eui64:
        descs.append(I.NsDescriptor(I.NIDT_EUI64, ns.eui64))
    if ns.nguid:
        descs.append(I.NsDescriptor(I.NIDT_NGUID, ns.nguid))
    descs.append(I.NsDescriptor(I.NIDT_UUID, ns.uuid))
    descs.append(I.NsDescriptor(I.NIDT_CSI, b"\0"))
    return I.NsDescriptorList(descs).pack()


@COMMANDS.handles(ADMIN_IDENTIFY)
def _identify(t: Target, req: Request) -> Outcome:
    if req.transfer_len != I.IDENTIFY_SIZE:
        return t.complete(req, S.SGL_INVALID_DATA | S.DNR, location=LOC_DPTR)
    ctrl = req.queue.ctrl
    sub = ctrl.subsystem
    cns = req.cdw10 & 0xFF
    nsid = req.nsid
    if cns == A.CNS_NAMESPACE:
        if nsid == 0 or nsid == NSID_ALL:
            return t.complete(req, S.INVALID_NS | S.DNR, location=LOC_NSID)
        ns = sub.namespace_for(nsid, ctrl.hostnqn)
        data = (identify_namespace(ns, t.ana.state(ctrl.port.portid, ns.ana_grpid), reservations.rescap(t, ns)) if ns
                else bytes(I.IDENTIFY_SIZE))  # inactive (or not visible to this host): all zero (NCAP 0)
    elif cns == A.CNS_CONTROLLER:
        data = identify_controller(ctrl, req.queue)
    elif cns == A.CNS_ACTIVE_NS_LIST:
        if nsid >= NSID_ALL - 1:
            return t.complete(req, S.INVALID_NS | S.DNR, location=LOC_NSID)
        data = I.ActiveNamespaceList([n.nsid for n in sub.visible_namespaces(ctrl.hostnqn) if n.nsid > nsid]).pack()
    elif cns == A.CNS_NS_DESC_LIST:
        ns = sub.namespace_for(nsid, ctrl.hostnqn)
        if ns is None:
            return t.complete(req, S.INVALID_NS | S.DNR, location=LOC_NSID)
        data = ns_descriptors(ns)
    elif cns == A.CNS_CS_CONTROLLER and (req.cdw11 >> 24) == 0:
        data = bytes(I.IDENTIFY_SIZE)  # NVM command set specific: nothing to report
    else:
        return t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW10)
    return t.complete(req, 0, data=data)


# ---------------------------------------------------------------------- Get Log Page

def log_page_request(t: Target, req: Request) -> Optional[A.GetLogPageCommand]:
    """A Get Log Page's fields, or None after completing it with an error (bad length or offset)."""
    cmd = A.GetLogPageCommand.from_dwords(req.cdw10, req.cdw11, req.cdw12, req.cdw13, req.cdw14)
    if req.transfer_len != cmd.length:
        t.complete(req, S.SGL_INVALID_DATA | S.DNR, location=LOC_DPTR)
        return None
    if cmd.length > t.max_transfer:
        t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW10)
        return None
    if cmd.lpo & 3:
        t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW12)
        return None
    return cmd


def window(page: bytes, offset: int, length: int) -> bytes:
    """Bytes [offset, offset + length) of a log page, zero filled past its end (LPO and partial reads)."""
    part = page[offset:offset + length]
    if len(part) < length:
        part = part + bytes(length - len(part))
    return part


def _smart_log(sub, nsid: int, hostnqn: str):
    if nsid in (0, NSID_ALL):
        namespaces = sub.visible_namespaces(hostnqn)
    else:
        ns = sub.namespace_for(nsid, hostnqn)
        if ns is None:
            return None
        namespaces = [ns]
    units = 512 * 1000  # data units are thousands of 512-byte units, rounded up
    read = sum(n.bytes_read for n in namespaces)
    written = sum(n.bytes_written for n in namespaces)
    return SmartLog(temperature=273 + 30, avail_spare=100, spare_thresh=10,
                    data_units_read=-(-read // units), data_units_written=-(-written // units),
                    host_reads=sum(n.read_commands for n in namespaces),
                    host_writes=sum(n.write_commands for n in namespaces),
                    power_cycles=1).pack()


@COMMANDS.handles(ADMIN_GET_LOG_PAGE)
def _get_log_page(t: Target, req: Request) -> Outcome:
    cmd = log_page_request(t, req)
    if cmd is None:
        return COMPLETED
    ctrl = req.queue.ctrl
    lid, retain = cmd.lid, cmd.rae
    if lid == A.LID_ERROR:
        page = b"".join(e.pack() for e in ctrl.error_log).ljust(ERROR_LOG_ENTRIES * ERROR_ENTRY_SIZE, b"\0")
    elif lid == A.LID_SMART:
        page = _smart_log(ctrl.subsystem, req.nsid, ctrl.hostnqn)
        if page is None:
            return t.complete(req, S.INVALID_NS | S.DNR, location=LOC_NSID)
    elif lid == A.LID_FW_SLOT:
        page = bytes(512)
    elif lid == A.LID_CHANGED_NS:
        page = ChangedNsList(ctrl.take_changed_nsids(retain)).pack()
    elif lid == A.LID_CMD_EFFECTS:
        page = EFFECTS
    elif lid == A.LID_ANA:
        if cmd.lsp & ~L.ANA_LSP_RGO:
            return t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW10)
        page = t.ana.log_page(ctrl.port.portid, ctrl.subsystem.visible_namespaces(ctrl.hostnqn),
                              bool(cmd.lsp & L.ANA_LSP_RGO))
        ctrl.ana_log_read(retain)
    elif lid == A.LID_RESERVATION:
        page = reservations.log_page(ctrl, retain)
    else:
        return t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW10)
    return t.complete(req, 0, data=window(page, cmd.lpo, cmd.length))


# ---------------------------------------------------------------------- features

def set_feature_common(t: Target, req: Request, fid: int) -> Optional[Outcome]:
    """Features both controller kinds support (KATO, Async Event Configuration): the outcome, or None if
    `fid` is not one of them."""
    ctrl = req.queue.ctrl
    value = req.cdw11
    if fid == A.FEAT_KATO:
        if value > ctrl.max_kato * 1000:
            log.warning("controller %d: Set Features KATO %d ms is above the target's max_kato of %d s",
                        ctrl.cntlid, value, ctrl.max_kato)
            return t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW11)
        if ctrl.is_discovery and value == 0:
            value = ctrl.discovery_idle * 1000  # KATO 0 would keep a discovery controller forever
        ctrl.kato_ms = value
        ctrl.keep_alive(t.clock())
        return t.complete(req, 0, result=ctrl.kato_seconds)
    if fid == A.FEAT_ASYNC_EVENT:
        if value & ~ctrl.supported_aen():
            return t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW11)
        ctrl.aen_enabled = value
        return t.complete(req, 0, result=value)
    return None


def get_feature_common(t: Target, req: Request, fid: int) -> Optional[Outcome]:
    ctrl = req.queue.ctrl
    if fid == A.FEAT_KATO:
        return t.complete(req, 0, result=ctrl.kato_seconds * 1000)
    if fid == A.FEAT_ASYNC_EVENT:
        return t.complete(req, 0, result=ctrl.aen_enabled)
    return None


@COMMANDS.handles(ADMIN_SET_FEATURES)
def _set_features(t: Target, req: Request) -> Outcome:
    if req.transfer_len:
        return t.complete(req, S.SGL_INVALID_DATA | S.DNR, location=LOC_DPTR)
    fid = req.cdw10 & 0xFF
    outcome = set_feature_common(t, req, fid)
    if outcome is not None:
        return outcome
    ctrl = req.queue.ctrl
    if fid == A.FEAT_NUM_QUEUES:
        nsqr = req.cdw11 & 0xFFFF
        ncqr = req.cdw11 >> 16
        if nsqr == 0xFFFF or ncqr == 0xFFFF:
            return t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW11)
        # 0's based; capped by the subsystem, the resource limits and what the port's pool can guarantee
        granted = t.io_queue_grant(req.queue, min(nsqr, ncqr) + 1) - 1
        ctrl.max_io_qid = granted + 1
        return t.complete(req, 0, result=granted | (granted << 16))
    if fid == A.FEAT_HOST_ID:
        return t.complete(req, S.CMD_SEQ_ERROR | S.DNR, location=LOC_CDW10)
    if fid in (A.FEAT_RESV_MASK, A.FEAT_RESV_PERSIST):
        return reservations.set_feature(t, req, fid)
    return t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW10)


# Mandatory features with nothing to configure here: Get returns 0 (as nvmet does)
_ZERO_FEATURES = {A.FEAT_ARBITRATION, A.FEAT_POWER_MGMT, 0x04, 0x05, 0x08, 0x09, 0x0A}


@COMMANDS.handles(ADMIN_GET_FEATURES)
def _get_features(t: Target, req: Request) -> Outcome:
    fid = req.cdw10 & 0xFF
    ctrl = req.queue.ctrl
    if fid == A.FEAT_HOST_ID:
        if not req.cdw11 & 1:  # only the 128-bit host identifier exists on fabrics
            return t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW11)
        if req.transfer_len != 16:
            return t.complete(req, S.SGL_INVALID_DATA | S.DNR, location=LOC_DPTR)
        return t.complete(req, 0, data=ctrl.hostid)
    if req.transfer_len:
        return t.complete(req, S.SGL_INVALID_DATA | S.DNR, location=LOC_DPTR)
    outcome = get_feature_common(t, req, fid)
    if outcome is not None:
        return outcome
    if fid == A.FEAT_NUM_QUEUES:
        n = ctrl.max_io_qid - 1
        return t.complete(req, 0, result=n | (n << 16))
    if fid == A.FEAT_VOLATILE_WC:
        return t.complete(req, 0, result=1)
    if fid in _ZERO_FEATURES:
        return t.complete(req, 0, result=0)
    if fid in (A.FEAT_RESV_MASK, A.FEAT_RESV_PERSIST):
        return reservations.get_feature(t, req, fid)
    return t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW10)


# ---------------------------------------------------------------------- AER, Keep Alive

@COMMANDS.handles(ADMIN_ASYNC_EVENT)
def async_event(t: Target, req: Request) -> Outcome:
    if req.transfer_len:
        return t.complete(req, S.SGL_INVALID_DATA | S.DNR, location=LOC_DPTR)
    ctrl = req.queue.ctrl
    if len(ctrl.aers) >= MAX_AER:
        return t.complete(req, S.ASYNC_LIMIT | S.DNR)
    outcome = t.hold(req)
    ctrl.aers.append(req)
    t.deliver_events(ctrl)
    return outcome


@COMMANDS.handles(ADMIN_KEEP_ALIVE)
def keep_alive(t: Target, req: Request) -> Outcome:
    if req.transfer_len:
        return t.complete(req, S.SGL_INVALID_DATA | S.DNR, location=LOC_DPTR)
    ctrl = req.queue.ctrl
    if not ctrl.kato_ms:
        return t.complete(req, S.KA_TIMEOUT_INVALID | S.DNR)
    ctrl.keep_alive(t.clock())
    return t.complete(req, 0)


@COMMANDS.handles(ADMIN_ABORT)
def abort(t: Target, req: Request) -> Outcome:
    """Abort: answered as nvmet_execute_abort does, success with DW0 bit 0 set, "command not aborted".  A
    command here is either answered soon or is an AER (which the host frees itself at reset); the Linux host
    sends Abort after an I/O timeout and then resets the controller whatever the answer."""
    if req.transfer_len:
        return t.complete(req, S.SGL_INVALID_DATA | S.DNR, location=LOC_DPTR)
    return t.complete(req, 0, result=1)



# The Commands Supported and Effects log (LID 0x05), generated from the handlers' declarations above and io.py's.
EFFECTS = effects_log(COMMANDS, io.COMMANDS, reservations.COMMANDS)
