"""Fabrics commands (docs/protocol.md §4): Connect, Property Get/Set, Disconnect, and the dispatch of
Authentication Send/Receive (the DH-HMAC-CHAP exchange itself is auth.py's).

Each handler returns an Outcome (engine/request.py).  The core (core.py) picks the table: `connect` on a queue
without a controller, `ADMIN` or `IO` by the queue once it has one, and only `BEFORE_AUTHENTICATION` until a
queue that must authenticate has.
"""
from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

from ..config import NQN_MAX_BYTES
from ..nvme import fabrics as F
from ..nvme import status as S
from . import auth
from .controller import Controller
from .queue import QueueState
from .request import LOC_CDW10, LOC_CDW11, LOC_DPTR, LOC_OPCODE, Outcome, Request

if TYPE_CHECKING:
    from .core import Target

log = logging.getLogger(__name__)

NQN_FIELD_SIZE = 256  # SUBNQN and HOSTNQN fields of the Connect data

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def escape_controls(text: str) -> str:
    """`text` with each control character as \\xNN (C0, DEL, C1)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)



def connect(t: Target, req: Request) -> Outcome:
    """Connect on a queue without a controller: its 1024 bytes of data, then `_connect_with_data`."""
    if req.transfer_len != F.CONNECT_DATA_SIZE:
        return t.complete(req, S.SGL_INVALID_DATA | S.DNR, location=LOC_DPTR)
    return t.fetch(req, F.CONNECT_DATA_SIZE, _connect_with_data)


def _connect_with_data(t: Target, req: Request, data) -> Outcome:
    qs = req.queue
    if qs.ctrl is not None:  # a second Connect raced the first on this queue
        return t.complete(req, S.CONNECT_CTRL_BUSY | S.DNR, location=LOC_OPCODE)
    recfmt = req.cdw10 & 0xFFFF
    qid = req.cdw10 >> 16
    sqsize = req.cdw11 & 0xFFFF
    cattr = (req.cdw11 >> 16) & 0xFF
    kato = req.cdw12
    if recfmt != 0:
        return t.complete(req, S.CONNECT_FORMAT | S.DNR, location=LOC_CDW10)
    d = F.ConnectData.unpack(data)
    # The NQNs are the host's words: every log line and status shows them, so a control character (a newline
    # forging a log line, a terminal escape) is escaped here, once.  A configured NQN has none (config/loader.py),
    # so matching the allow-list is unchanged.
    d.hostnqn, d.subnqn = escape_controls(d.hostnqn), escape_controls(d.subnqn)

    def invalid(iattr: int) -> Outcome:
        return t.complete(req, S.CONNECT_INVALID_PARAM | S.DNR, result=iattr)

    if qid != qs.qid:
        log.warning("Connect for QID %d on the queue opened as QID %d", qid, qs.qid)
        return invalid(F.iattr_sqe(F.CONNECT_SQE_OFF_QID))
    raw = bytes(data)
    for offset, name in ((F.CONNECT_DATA_OFF_SUBNQN, "SUBNQN"), (F.CONNECT_DATA_OFF_HOSTNQN, "HOSTNQN")):
        # An NQN is at most 223 bytes and NUL-terminated within its 256-byte field (NVMe base spec, NQN).
        end = raw.find(b"\0", offset, offset + NQN_FIELD_SIZE)
        if end < 0 or end - offset > NQN_MAX_BYTES:
            log.warning("Connect with a %s that is %s", name,
                        "not NUL-terminated" if end < 0 else f"{end - offset} bytes (more than {NQN_MAX_BYTES})")
            return invalid(F.iattr_data(offset))
    sub = t.find_subsystem(qs.port, d.subnqn)
    if sub is None:
        log.warning("Connect from %s to unknown or unexported subsystem %r", d.hostnqn, d.subnqn)
        return invalid(F.iattr_data(F.CONNECT_DATA_OFF_SUBNQN))
    if not sub.host_allowed(d.hostnqn):
        log.warning("Connect to %s from host %r, which is not allowed", sub.nqn, d.hostnqn)
        return t.complete(req, S.CONNECT_INVALID_HOST | S.DNR,
                          result=F.iattr_data(F.CONNECT_DATA_OFF_HOSTNQN))
    if sqsize == 0:
        return invalid(F.iattr_sqe(F.CONNECT_SQE_OFF_SQSIZE))

    if qid == 0:
        if d.cntlid != F.DYNAMIC_CNTLID:
            return invalid(F.iattr_data(F.CONNECT_DATA_OFF_CNTLID))
        max_kato = t.config.settings.max_kato
        if kato > max_kato * 1000:
            log.warning("Connect to %s from %s with KATO %d ms, above the target's max_kato of %d s",
                        sub.nqn, d.hostnqn, kato, max_kato)
            return invalid(F.iattr_sqe(F.CONNECT_SQE_OFF_KATO))
        if sqsize > F.ADMIN_QUEUE_DEPTH - 1:
            return invalid(F.iattr_sqe(F.CONNECT_SQE_OFF_SQSIZE))
        refusal = t.controller_cap(sub, d.hostnqn)
        if refusal:
            log.warning("Connect from %s to %s: %s", d.hostnqn, sub.nqn, refusal)
            return t.complete(req, S.CONNECT_CTRL_BUSY)
        cntlid = sub.alloc_cntlid()
        if cntlid is None:
            log.warning("%s: no free controller ID", sub.nqn)
            return t.complete(req, S.CONNECT_CTRL_BUSY | S.DNR)
        if not t._commit_queue(qs):
            return t.complete(req, S.CONNECT_CTRL_BUSY)
        cap = F.make_cap(qs.port.mqes)
        settings = t.config.settings
        ctrl = Controller(sub, cntlid, d.hostnqn, d.hostid, kato, qs.port, cap, t.clock(),
                          max_kato=settings.max_kato, discovery_idle=settings.discovery_idle_limit)
        ctrl.max_io_qid = min(ctrl.max_io_qid, t.limits.max_queues_per_ctrl)
        sub.controllers[cntlid] = ctrl
        ctrl.admin_queue = qs
        ctrl.auth = auth.settings_for(t, sub, d.hostnqn)
        _install_queue(qs, ctrl, sqsize, cattr)
        log.info("controller %d created for %s, host %s (KATO %d ms)%s", cntlid, sub.nqn, d.hostnqn, ctrl.kato_ms,
                 " with DH-HMAC-CHAP" if ctrl.auth else "")
        return t.complete(req, 0, result=_connect_result(ctrl))

    ctrl = sub.controllers.get(d.cntlid)
    if ctrl is None or ctrl.dead:
        log.warning("I/O Connect for controller %d of %s from %s: no such controller",
                    d.cntlid, sub.nqn, d.hostnqn)
        return invalid(F.iattr_data(F.CONNECT_DATA_OFF_CNTLID))
    # The I/O queue belongs to the host that made the controller: same host NQN and host ID.
    if ctrl.hostnqn != d.hostnqn:
        log.warning("I/O Connect for controller %d of %s from %s: the controller belongs to host %s",
                    d.cntlid, sub.nqn, d.hostnqn, ctrl.hostnqn)
        return invalid(F.iattr_data(F.CONNECT_DATA_OFF_HOSTNQN))
    if ctrl.hostid != d.hostid:
        log.warning("I/O Connect for controller %d of %s from %s: host ID %s is not the controller's %s",
                    d.cntlid, sub.nqn, d.hostnqn, bytes(d.hostid).hex(), bytes(ctrl.hostid).hex())
        return invalid(F.iattr_data(F.CONNECT_DATA_OFF_HOSTID))
    if qid > ctrl.max_io_qid:
        return invalid(F.iattr_sqe(F.CONNECT_SQE_OFF_QID))
    if sqsize > F.cap_mqes(ctrl.cap):
        return invalid(F.iattr_sqe(F.CONNECT_SQE_OFF_SQSIZE))
    if qid in ctrl.io_queues:
        return t.complete(req, S.CMD_SEQ_ERROR | S.DNR, location=LOC_CDW10)
    if t.host_io_queues(ctrl.hostnqn) >= t.limits.max_queues_per_host:
        log.warning("I/O Connect from %s: the host has %d I/O queues (--max-queues-per-host)", ctrl.hostnqn,
                    t.limits.max_queues_per_host)
        return invalid(F.iattr_sqe(F.CONNECT_SQE_OFF_QID))
    if not t._commit_queue(qs):
        return t.complete(req, S.CONNECT_CTRL_BUSY)
    ctrl.io_queues[qid] = qs
    _install_queue(qs, ctrl, sqsize, cattr)
    log.debug("controller %d: I/O queue %d connected (SQSIZE %d)", ctrl.cntlid, qid, sqsize)
    return t.complete(req, 0, result=_connect_result(ctrl))


def _connect_result(ctrl: Controller) -> int:
    """Connect response DW0: CNTLID, and AUTHREQ.ATR when the host must authenticate (nvmet_connect_result)."""
    return ctrl.cntlid | (auth.A.CONNECT_AUTHREQ_ATR if ctrl.auth else 0)


def _install_queue(qs: QueueState, ctrl: Controller, sqsize: int, cattr: int) -> None:
    qs.ctrl = ctrl
    qs.install(sqsize)
    qs.sqhd = 0
    qs.sqflow_disabled = bool(cattr & F.CATTR_DISABLE_SQFLOW)
    if ctrl.auth is not None:
        qs.auth = auth.QueueAuth(ctrl.auth, qs.qid, ctrl.cntlid, ctrl.hostnqn, ctrl.subsystem.nqn,
                                 qs.target.clock())


def _property_get(t: Target, req: Request) -> Outcome:
    if req.transfer_len:
        return t.complete(req, S.SGL_INVALID_DATA | S.DNR, location=LOC_DPTR)
    ctrl = req.queue.ctrl
    offset = req.cdw11
    if req.cdw10 & 1:  # 8-byte property: only CAP
        if offset != F.PROP_CAP:
            return t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW11)
        value = ctrl.cap
    elif offset == F.PROP_VS:
        value = ctrl.subsystem.version
    elif offset == F.PROP_CC:
        value = ctrl.cc
    elif offset == F.PROP_CSTS:
        value = ctrl.csts
    else:
        return t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW11)
    return t.complete(req, 0, result=value & 0xFFFFFFFF, dw1=value >> 32)


def _property_set(t: Target, req: Request) -> Outcome:
    if req.transfer_len:
        return t.complete(req, S.SGL_INVALID_DATA | S.DNR, location=LOC_DPTR)
    if req.cdw10 & 1 or req.cdw11 != F.PROP_CC:  # only CC is writable, as a 4-byte property
        return t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW10 if req.cdw10 & 1 else LOC_CDW11)
    ctrl = req.queue.ctrl
    was_shutting_down = ctrl.shutting_down
    ctrl.set_cc(req.cdw12, t.clock())
    outcome = t.complete(req, 0)
    if ctrl.shutting_down and not was_shutting_down:
        # The host disconnects its I/O queues before it shuts the controller down (docs/protocol.md §1.8).
        for qs in list(ctrl.io_queues.values()):
            t._close_queue(qs, f"controller {ctrl.cntlid} shut down", logging.INFO)
        t.shutdown_flush(ctrl)
    return outcome


def _disconnect(t: Target, req: Request) -> Outcome:
    """Disconnect (I/O queues only): complete, then close the queue."""
    if req.transfer_len:
        return t.complete(req, S.SGL_INVALID_DATA | S.DNR, location=LOC_DPTR)
    if req.cdw10 & 0xFFFF:
        return t.complete(req, S.CONNECT_FORMAT | S.DNR, location=LOC_CDW10)
    qs = req.queue
    outcome = t.complete(req, 0)
    t._close_queue(qs, "host sent Disconnect", logging.INFO)
    return outcome


def _already_connected(t: Target, req: Request) -> Outcome:
    return t.complete(req, S.CONNECT_CTRL_BUSY | S.DNR, location=LOC_OPCODE)


# Fabrics commands by FCTYPE on a connected queue: the admin queue's and an I/O queue's.
ADMIN = {F.FCTYPE_PROPERTY_GET: _property_get, F.FCTYPE_PROPERTY_SET: _property_set,
         F.FCTYPE_CONNECT: _already_connected,
         F.FCTYPE_AUTH_SEND: auth.auth_send, F.FCTYPE_AUTH_RECV: auth.auth_receive}
IO = {F.FCTYPE_DISCONNECT: _disconnect, F.FCTYPE_CONNECT: _already_connected,
      F.FCTYPE_AUTH_SEND: auth.auth_send, F.FCTYPE_AUTH_RECV: auth.auth_receive}
# What a queue that must authenticate accepts before it has (Property Set is not among them: an
# unauthenticated host cannot enable the controller).
BEFORE_AUTHENTICATION = {F.FCTYPE_AUTH_SEND, F.FCTYPE_AUTH_RECV, F.FCTYPE_PROPERTY_GET, F.FCTYPE_CONNECT,
                          F.FCTYPE_DISCONNECT}
