"""NVM I/O commands (docs/protocol.md §6): Read, Write, Flush, Write Zeroes, Dataset Management.

The NSID was resolved before these run (req.ns).  Every check happens before
any data moves: transfer length against the SGL (SGL Data Length Invalid),
MDTS (Invalid Field), LBA range (LBA Out of Range), all with DNR.
"""
from __future__ import annotations

import logging
from time import perf_counter_ns
from typing import TYPE_CHECKING

from ..nvme import status as S
from ..nvme.command import NVM_DSM, NVM_FLUSH, NVM_READ, NVM_WRITE, NVM_WRITE_ZEROES
from ..nvme.nvm import CONTROL_FUA, DSM_AD, DSM_RANGE_SIZE, DSM_RANGE_STRUCT
from .backends import BackendError
from .request import LOC_CDW10, LOC_CDW12, LOC_DPTR, Request
from .work import SLICE_BYTES

if TYPE_CHECKING:
    from .core import Target

log = logging.getLogger(__name__)

_CONTROL_FUA = CONTROL_FUA << 16  # CDW12 bits 31:16 are the control field

# What a failing backend raises: a media error for the host.  Anything else is a bug in the target; it
# propagates to Target._internal_error, which answers Internal Error and counts it in Target.internal_errors.
BACKEND_ERRORS = (OSError, BackendError)


def _rw_checks(t: Target, req: Request):
    """(byte offset, length) of a Read/Write, or None after completing it with an error."""
    ns = req.ns
    nlb = (req.cdw12 & 0xFFFF) + 1
    length = nlb << ns.lbads
    if req.sgl_len != length:
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


def _read(t: Target, req: Request) -> None:
    started = perf_counter_ns()
    checked = _rw_checks(t, req)
    if checked is None:
        return
    offset, length = checked
    ns = req.ns
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
            log.error("namespace %d: read of %d bytes at %d failed: %s", ns.nsid, length, offset, exc)
            ns.stats.errors += 1
            return t.complete(req, S.READ_ERROR)
    ns.bytes_read += length
    ns.read_commands += 1
    ns.stats.read_latency.record_ns(perf_counter_ns() - started)
    t.complete(req, 0, data=data, source=source)


def _write(t: Target, req: Request) -> None:
    req.started_ns = perf_counter_ns()
    checked = _rw_checks(t, req)
    if checked is not None:
        t.fetch(req, checked[1], _write_data)


def _write_data(t: Target, req: Request, data) -> None:
    ns = req.ns
    if ns.removed:  # removed while its data was in flight
        return t.complete(req, S.INVALID_NS | S.DNR)
    offset = (req.cdw10 | (req.cdw11 << 32)) << ns.lbads
    try:
        ns.backend.write(offset, data)
    except BACKEND_ERRORS as exc:
        log.error("namespace %d: write of %d bytes at %d failed: %s", ns.nsid, len(data), offset, exc)
        ns.stats.errors += 1
        return t.complete(req, S.WRITE_FAULT)
    ns.bytes_written += len(data)
    ns.write_commands += 1
    ns.stats.write_latency.record_ns(perf_counter_ns() - req.started_ns)
    if req.cdw12 & _CONTROL_FUA:
        return _flush_then_complete(t, req, "FUA write")
    t.complete(req, 0)


def _flush(t: Target, req: Request) -> None:
    if req.sgl_len:
        return t.complete(req, S.SGL_INVALID_DATA | S.DNR, location=LOC_DPTR)
    _flush_then_complete(t, req, "flush")


def _flush_then_complete(t: Target, req: Request, what: str) -> None:
    """Make the namespace durable (fdatasync for files: on the worker thread), then complete."""
    ns = req.ns
    if not ns.backend.blocking:
        try:
            ns.backend.flush()
        except BACKEND_ERRORS as exc:
            log.error("namespace %d: %s failed: %s", ns.nsid, what, exc)
            return t.complete(req, S.WRITE_FAULT)
        return t.complete(req, 0)
    t.run_blocking(req, ns.backend.flush, what)


def _write_zeroes(t: Target, req: Request) -> None:
    if req.sgl_len:
        return t.complete(req, S.SGL_INVALID_DATA | S.DNR, location=LOC_DPTR)
    ns = req.ns
    nlb = (req.cdw12 & 0xFFFF) + 1
    slba = req.cdw10 | (req.cdw11 << 32)
    if slba + nlb > ns.num_blocks:
        return t.complete(req, S.LBA_RANGE | S.DNR, location=LOC_CDW10)
    _zero_ranges(t, req, [(slba << ns.lbads, nlb << ns.lbads)], False, "write zeroes")


def _zero_ranges(t: Target, req: Request, ranges, deallocate: bool, what: str) -> None:
    """Zero or deallocate byte ranges without holding the loop: a file on the worker thread,
    RAM in slices of SLICE_BYTES across loop passes (target/work.py)."""
    backend = req.ns.backend
    if backend.blocking:
        op = backend.discard if deallocate else backend.write_zeroes

        def run():
            for offset, length in ranges:
                op(offset, length)
        return t.run_blocking(req, run, what)

    def steps():
        for offset, length in ranges:
            yield from backend.zero_steps(offset, length, deallocate, SLICE_BYTES)
    t.run_sliced(req, steps(), what)


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


def _dsm(t: Target, req: Request) -> None:
    ranges_len = ((req.cdw10 & 0xFF) + 1) * DSM_RANGE_SIZE
    # The Linux host always sends a 4096-byte buffer: only "at least NR+1 ranges" is required.
    if req.sgl_len < ranges_len:
        return t.complete(req, S.SGL_INVALID_DATA | S.DNR, location=LOC_DPTR)
    if not req.cdw11 & DSM_AD:
        return t.complete(req, 0)  # IDR/IDW hints only: nothing to do
    t.fetch(req, ranges_len, _dsm_ranges)


def _dsm_ranges(t: Target, req: Request, data) -> None:
    ns = req.ns
    if ns.removed:
        return t.complete(req, S.INVALID_NS | S.DNR)
    ranges = []
    for pos in range(0, len(data), DSM_RANGE_SIZE):
        _attrs, nlb, slba = DSM_RANGE_STRUCT.unpack_from(data, pos)
        if slba + nlb > ns.num_blocks:
            return t.complete(req, S.LBA_RANGE | S.DNR)
        if nlb:
            ranges.append((slba << ns.lbads, nlb << ns.lbads))
    # At most 256 ranges of up to 2^32 blocks each: merged, the work is bounded by the namespace
    # size, and it is worked off in slices, never in one call.
    _zero_ranges(t, req, merge_ranges(ranges), True, "deallocate")


COMMANDS = {
    NVM_FLUSH: _flush,
    NVM_WRITE: _write,
    NVM_READ: _read,
    NVM_WRITE_ZEROES: _write_zeroes,
    NVM_DSM: _dsm,
}
