"""NVM I/O commands (docs/protocol.md §6): Read, Write, Flush, Write Zeroes, Dataset Management.

The NSID was resolved before these run (req.ns).  Every check happens before
any data moves: transfer length against the SGL (SGL Data Length Invalid),
MDTS (Invalid Field), LBA range (LBA Out of Range), all with DNR.

RAM and null namespaces are served inline (long zeroing in slices, engine/work.py).
A file or block namespace's commands go to its I/O engine (engine/ioengine.py) and
complete when the device is done, back on the event loop; a device error becomes
the status nvmet gives it (`device_status`, after nvmet's errno_to_nvme_status).
"""
from __future__ import annotations

import logging
from time import perf_counter_ns
from typing import TYPE_CHECKING

from ..nvme import status as S
from ..nvme.command import NVM_DSM, NVM_FLUSH, NVM_READ, NVM_WRITE, NVM_WRITE_ZEROES
from ..nvme.log import EFFECT_CSUPP, EFFECT_LBCC
from ..nvme.nvm import CONTROL_FUA, DSM_AD, DSM_RANGE_SIZE, DSM_RANGE_STRUCT
import errno

from .backends import BackendError
from .handlers import CommandTable
from .reservations import CONFLICT, conflict_status
from .request import COMPLETED, DEFERRED, LOC_CDW10, LOC_CDW12, LOC_DPTR, LOC_NSID, LOC_OPCODE, Outcome, Request
from .work import SLICE_BYTES

if TYPE_CHECKING:
    from .core import Target

log = logging.getLogger(__name__)

_CONTROL_FUA = CONTROL_FUA << 16  # CDW12 bits 31:16 are the control field

# What a failing backend raises: the device's error, answered with nvmet's status for it (device_status).
# Anything else is a bug in the target; it goes to Target._internal_error, which answers Internal Error and
# counts it in Target.internal_errors.
BACKEND_ERRORS = (OSError, BackendError)

ONCS_NOT_SUPPORTED = 0x183  # NVM command set specific status (Linux NVME_SC_ONCS_NOT_SUPPORTED)

COMMANDS = CommandTable("I/O")  # each handler below declares its opcode and effects


def device_status(exc: BaseException, opc: int):
    """(status, error location) for a device error, as nvmet's errno_to_nvme_status (io-cmd-file.c and, for
    block devices, blk_to_nvme_status): ENOSPC Capacity Exceeded, EREMOTEIO LBA Out of Range, EOPNOTSUPP not
    supported, ENODATA (a medium error) Access Denied, anything else (EIO, a short read or write) Internal
    Error with DNR; and for a networked store (RBD), ETIMEDOUT ANA Transition and ESHUTDOWN (fenced) ANA
    Inaccessible."""
    code = exc.errno if isinstance(exc, (OSError, BackendError)) else None
    if code == errno.ENOSPC:
        return S.CAP_EXCEEDED | S.DNR, LOC_CDW12
    if code == errno.EREMOTEIO:
        return S.LBA_RANGE | S.DNR, LOC_CDW10
    if code == errno.EOPNOTSUPP:
        if opc in (NVM_DSM, NVM_WRITE_ZEROES):
            return ONCS_NOT_SUPPORTED | S.DNR, LOC_OPCODE
        return S.INVALID_OPCODE | S.DNR, LOC_OPCODE
    if code == errno.ENODATA:
        return S.ACCESS_DENIED, LOC_NSID
    # A store behind the namespace that did not answer within its bound (an RBD cluster gone: librados's op
    # timeout) or that fenced this target (librados: ESHUTDOWN to a blocklisted client): path errors without
    # DNR, which the Linux host's multipath retries on another path (nvme_is_path_error).
    if code == errno.ETIMEDOUT:
        return S.ANA_TRANSITION, LOC_NSID
    if code == errno.ESHUTDOWN:
        return S.ANA_INACCESSIBLE, LOC_NSID
    return S.INTERNAL | S.DNR, LOC_OPCODE


def _device_failed(t: Target, req: Request, ns, exc: BaseException, what: str) -> Outcome:
    """Complete `req` after its device call raised `exc`: nvmet's status for a device error, Internal Error
    (counted) for a bug."""
    if not isinstance(exc, BACKEND_ERRORS):
        return t._internal_error(req, exc)
    log.error("namespace %d: %s failed: %s", ns.nsid, what, exc)
    ns.stats.errors += 1
    status, location = device_status(exc, req.opc)
    return t.complete(req, status, location=location)


def _rw_checks(t: Target, req: Request):
    """(byte offset, length) of a Read/Write, or None after completing it with an error."""
    ns = req.ns
    nlb = (req.cdw12 & 0xFFFF) + 1
    length = nlb << ns.lbads
    if req.transfer_len != length:
        t.complete(req, S.SGL_INVALID_DATA | S.DNR, location=LOC_DPTR)
        return None
    if length > t.max_transfer:
        t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW12)
        return None
    slba = req.cdw10 | (req.cdw11 << 32)
    if slba + nlb > ns.num_blocks:
        t.complete(req, S.LBA_RANGE | S.DNR, location=LOC_CDW10)
        return None
    return slba << ns.lbads, length


@COMMANDS.handles(NVM_READ)
def _read(t: Target, req: Request) -> Outcome:
    started = perf_counter_ns()
    checked = _rw_checks(t, req)
    if checked is None:
        return COMPLETED
    offset, length = checked
    ns = req.ns
    if ns.backend.blocking:
        ns.jobs += 1
        ns.engine(t.work).read(offset, length, lambda data, exc: _read_done(t, req, ns, started, data, exc))
        return DEFERRED
    if ns.direct_view is not None:
        data = ns.direct_view[offset:offset + length]  # sent straight from the RAM namespace
        source = (ns.backend, offset)
    else:
        # into the transport's registered buffer when it has one (sent without a copy), else our own
        data = req.queue.transport.data_buffer(length, req.tx) or req.buffer(length)
        source = None
        try:
            ns.backend.read_into(offset, data)
        except BACKEND_ERRORS as exc:
            return _device_failed(t, req, ns, exc, f"read of {length} bytes at {offset}")
    return _read_complete(t, req, ns, started, data, source)


def _read_complete(t: Target, req: Request, ns, started: int, data, source=None) -> Outcome:
    ns.bytes_read += len(data)
    ns.read_commands += 1
    ns.stats.read_latency.record_ns(perf_counter_ns() - started)
    return t.complete(req, 0, data=data, source=source)


def _read_done(t: Target, req: Request, ns, started: int, data, exc) -> None:
    """The engine's read completed (on the loop); `data` is valid during this call only."""
    ns.job_done()
    try:
        if exc is not None:
            return _device_failed(t, req, ns, exc, "read")
        _read_complete(t, req, ns, started, data)
    except Exception:
        t._internal_error(req)


@COMMANDS.handles(NVM_WRITE, EFFECT_CSUPP | EFFECT_LBCC)
def _write(t: Target, req: Request) -> Outcome:
    req.started_ns = perf_counter_ns()
    checked = _rw_checks(t, req)
    if checked is None:
        return COMPLETED
    return t.fetch(req, checked[1], _write_data)


def _write_data(t: Target, req: Request, data) -> Outcome:
    ns = req.ns
    if ns.removed:  # removed while its data was in flight
        return t.complete(req, S.INVALID_NS | S.DNR)
    if ns.resv is not None and conflict_status(ns, req.queue.ctrl, req.opc):  # reserved while its data came
        return t.complete(req, CONFLICT, location=LOC_OPCODE)
    offset = (req.cdw10 | (req.cdw11 << 32)) << ns.lbads
    fua = bool(req.cdw12 & _CONTROL_FUA)
    if ns.backend.blocking:
        ns.jobs += 1
        length = len(data)
        ns.engine(t.work).write(offset, data, fua, lambda exc: _write_done(t, req, ns, length, exc))
        return DEFERRED
    try:
        ns.backend.write(offset, data)
    except BACKEND_ERRORS as exc:
        return _device_failed(t, req, ns, exc, f"write of {len(data)} bytes at {offset}")
    return _write_complete(t, req, ns, len(data))


def _write_complete(t: Target, req: Request, ns, length: int) -> Outcome:
    ns.bytes_written += length
    ns.write_commands += 1
    ns.stats.write_latency.record_ns(perf_counter_ns() - req.started_ns)
    return t.complete(req, 0)


def _write_done(t: Target, req: Request, ns, length: int, exc) -> None:
    ns.job_done()
    try:
        if ns.removed:
            return t.complete(req, S.INVALID_NS | S.DNR)
        if exc is not None:
            return _device_failed(t, req, ns, exc, f"write of {length} bytes")
        _write_complete(t, req, ns, length)
    except Exception:
        t._internal_error(req)


@COMMANDS.handles(NVM_FLUSH)
def _flush(t: Target, req: Request) -> Outcome:
    if req.transfer_len:
        return t.complete(req, S.SGL_INVALID_DATA | S.DNR, location=LOC_DPTR)
    ns = req.ns
    if not ns.backend.blocking:
        try:
            ns.backend.flush()
        except BACKEND_ERRORS as exc:
            return _device_failed(t, req, ns, exc, "flush")
        return t.complete(req, 0)
    ns.jobs += 1  # on the namespace's lane: every write completed before it is made durable
    ns.engine(t.work).flush(lambda exc: _lane_done(t, req, ns, exc, "flush"))
    return DEFERRED


def _lane_done(t: Target, req: Request, ns, exc, what: str) -> None:
    """A flush or long command of the engine's lane completed (on the loop)."""
    ns.job_done()
    try:
        if ns.removed:
            return t.complete(req, S.INVALID_NS | S.DNR)
        if exc is not None:
            return _device_failed(t, req, ns, exc, what)
        t.complete(req, 0)
    except Exception:
        t._internal_error(req)


def flush_namespaces(t: Target, namespaces, done) -> None:
    """Make every namespace durable (CC.SHN): file and block ones on their lanes, all at once; done(errors),
    a list of messages, on the loop after the last."""
    errors = []
    left = [1 + sum(1 for ns in namespaces if ns.backend.blocking and not ns.removed)]

    def one_done(ns, exc) -> None:
        if exc is not None:
            errors.append(f"namespace {ns.nsid}: {exc}")
        left[0] -= 1
        if not left[0]:
            done(errors)

    for ns in namespaces:
        if ns.removed:  # removed meanwhile: Namespace.retire flushes it before closing
            continue
        if ns.backend.blocking:
            ns.jobs += 1
            ns.engine(t.work).flush(lambda exc, ns=ns: (ns.job_done(), one_done(ns, exc)))
            continue
        try:
            ns.backend.flush()
        except BACKEND_ERRORS as exc:
            errors.append(f"namespace {ns.nsid}: {exc}")
    one_done(None, None)  # the inline ones are done


@COMMANDS.handles(NVM_WRITE_ZEROES, EFFECT_CSUPP | EFFECT_LBCC)
def _write_zeroes(t: Target, req: Request) -> Outcome:
    if req.transfer_len:
        return t.complete(req, S.SGL_INVALID_DATA | S.DNR, location=LOC_DPTR)
    ns = req.ns
    nlb = (req.cdw12 & 0xFFFF) + 1
    slba = req.cdw10 | (req.cdw11 << 32)
    if slba + nlb > ns.num_blocks:
        return t.complete(req, S.LBA_RANGE | S.DNR, location=LOC_CDW10)
    return _zero_ranges(t, req, [(slba << ns.lbads, nlb << ns.lbads)], False, "write zeroes")


def _zero_ranges(t: Target, req: Request, ranges, deallocate: bool, what: str) -> Outcome:
    """Zero or deallocate byte ranges without holding the loop: a file or block device on the namespace's
    lane (fallocate, BLKZEROOUT, BLKDISCARD), RAM in slices of SLICE_BYTES across loop passes (engine/work.py)."""
    ns = req.ns
    backend = ns.backend
    if backend.blocking:
        ns.jobs += 1
        ns.engine(t.work).zero(ranges, deallocate, lambda exc: _lane_done(t, req, ns, exc, what))
        return DEFERRED

    def steps():
        for offset, length in ranges:
            yield from backend.zero_steps(offset, length, deallocate, SLICE_BYTES)
    return t.run_sliced(req, steps(), what)


def merge_ranges(ranges):
    """Sort (offset, length) ranges and merge the overlapping and adjacent ones."""
    merged = []
    for offset, length in sorted(ranges):
        if merged and offset <= merged[-1][0] + merged[-1][1]:
            last_offset, last_length = merged[-1]
            merged[-1] = (last_offset, max(last_length, offset + length - last_offset))
        else:
            merged.append((offset, length))
    return merged


@COMMANDS.handles(NVM_DSM, EFFECT_CSUPP | EFFECT_LBCC)
def _dsm(t: Target, req: Request) -> Outcome:
    ranges_len = ((req.cdw10 & 0xFF) + 1) * DSM_RANGE_SIZE
    # The Linux host always sends a 4096-byte buffer: only "at least NR+1 ranges" is required.
    if req.transfer_len < ranges_len:
        return t.complete(req, S.SGL_INVALID_DATA | S.DNR, location=LOC_DPTR)
    if not req.cdw11 & DSM_AD:
        return t.complete(req, 0)  # IDR/IDW hints only: nothing to do
    return t.fetch(req, ranges_len, _dsm_ranges)


def _dsm_ranges(t: Target, req: Request, data) -> Outcome:
    ns = req.ns
    if ns.removed:
        return t.complete(req, S.INVALID_NS | S.DNR)
    if ns.resv is not None and conflict_status(ns, req.queue.ctrl, req.opc):  # reserved while its ranges came
        return t.complete(req, CONFLICT, location=LOC_OPCODE)
    ranges = []
    for pos in range(0, len(data), DSM_RANGE_SIZE):
        _attrs, nlb, slba = DSM_RANGE_STRUCT.unpack_from(data, pos)
        if slba + nlb > ns.num_blocks:
            return t.complete(req, S.LBA_RANGE | S.DNR)
        if nlb:
            ranges.append((slba << ns.lbads, nlb << ns.lbads))
    # At most 256 ranges of up to 2^32 blocks each: merged, the work is bounded by the namespace
    # size, and it is worked off in slices, never in one call.
    return _zero_ranges(t, req, merge_ranges(ranges), True, "deallocate")

