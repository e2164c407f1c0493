"""The native data path's per-command trace (csrc/trace.h, docs/native.md "The per-command trace").

As SPDK's tracepoints: while the trace is on, each native queue has a ring of fixed-size records that C fills at
each event of a command (received, data posted, data done, response posted, response done, handed to the core);
the event loop takes them at each poll and tick (`NativeTargetQueue.log_trace`) and prints them on the Python data
path's trace logger (transport/rdma/queue.py's `wire_log`, debug level: `-vv`), in its lines, so a capture is
read against either path the same way (docs/two-node.md).  Each line starts with the event's CLOCK_MONOTONIC time.

The trace is the process's, as SPDK's tracepoint mask is: `target serve --trace on` (tunables.TRACE) or the RPC
`trace_enable_tpoint_group` turns it on for every native queue, open and to come; off (the default) a queue has
no ring and each event costs one predictable branch in C.
"""
from __future__ import annotations

import logging
import struct
import weakref
from typing import Iterator, List

from .queue import wire_log

# csrc/trace.h's struct nt_record: ns, addr, length, nsid, key, cid, status, event, opcode, flags
RECORD = struct.Struct("=QQIIIHHBBB5x")
RECEIVED, DATA_POSTED, DATA_DONE, RESPONSE_POSTED, RESPONSE_DONE, TO_CORE = range(1, 7)
FLAG_RDMA_READ, FLAG_INVALIDATE, FLAG_FILE = 1, 2, 4
NO_CID = 0xFFFF
RECORDS = 4096  # per queue: a ring this size holds 4096 events between two takes (a take per poll and tick)
GROUP = "nvmf_rdma"  # SPDK's tracepoint group of the RDMA transport, the name the RPC takes

log = logging.getLogger(__name__)


def format_record(qp_num: int, qid: int, ns: int, addr: int, length: int, nsid: int, key: int, cid: int,
                  status: int, event: int, opcode: int, flags: int) -> str:
    """One record as the Python data path's trace line (the events it has no line for in words of their own)."""
    if event == RECEIVED:
        text = f"capsule {length} B opc {opcode:#04x} cid {cid}"
    elif event == DATA_POSTED:
        text = f"RDMA {'READ' if flags & FLAG_RDMA_READ else 'WRITE'} va {addr:#x} rkey {key:#x} len {length}"
    elif event == RESPONSE_POSTED:
        text = f"SEND response cid {cid}" + (f" with invalidate rkey {key:#x}" if flags & FLAG_INVALIDATE else "")
    elif event == DATA_DONE and flags & FLAG_FILE:
        result = length - (1 << 32) if length >= 1 << 31 else length  # a negative errno
        text = f"device {'read' if opcode == 0x02 else 'write'} done cid {cid} result {result}"
    elif event == DATA_DONE:
        text = f"data in cid {cid} len {length}"
    elif event == RESPONSE_DONE:
        text = f"response done cid {cid} status {status:#x}"
    elif event == TO_CORE:
        text = f"to the core: opc {opcode:#04x} cid {cid} nsid {nsid}"
    else:
        text = f"event {event} cid {cid}"
    return f"{ns / 1e9:.6f} qp {qp_num:#x} qid {qid}: {text}"


def lines(qid: int, taken) -> Iterator[str]:
    """The trace lines of what `Queue.take_trace()` returned: (qp_num, dropped, records)."""
    qp_num, dropped, data = taken
    if dropped:
        yield f"qp {qp_num:#x} qid {qid}: {dropped} trace events dropped (the ring was full)"
    for fields in RECORD.iter_unpack(data):
        yield format_record(qp_num, qid, *fields)


class Tracing:
    """Whether the trace is on, and the native queues it is on for (open ones; closed ones drop out)."""

    def __init__(self):
        self.enabled = False
        self.queues: "weakref.WeakSet" = weakref.WeakSet()

    def attach(self, queue) -> None:
        """A native queue opened: its ring now if the trace is on."""
        self.queues.add(queue)
        if self.enabled:
            queue.set_trace(RECORDS)

    def set_enabled(self, enabled: bool) -> int:
        """On or off for every open native queue and those to come; the number of open ones."""
        self.enabled = enabled
        queues: List = [q for q in self.queues if not q.closed]
        for q in queues:
            if not enabled:
                q.log_trace()  # what was recorded before it went off
            q.set_trace(RECORDS if enabled else 0)
        log.info("per-command trace of the native data path %s (%d open native queues)",
                 "on" if enabled else "off", len(queues))
        return len(queues)


TRACING = Tracing()


def printed() -> bool:
    """Whether trace lines reach the log (the trace logger at debug level: `-vv`)."""
    return wire_log.isEnabledFor(logging.DEBUG)


def log_lines(qid: int, taken) -> None:
    """Print what a queue's `take_trace()` returned on the trace logger (nothing unless at debug level)."""
    if taken is None or not (taken[1] or taken[2]) or not printed():
        return
    for line in lines(qid, taken):
        wire_log.debug("%s", line)
