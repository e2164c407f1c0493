"""The request objects of the target's state machine (the queue they belong to: queue.py).

A request's `state` is one of transport/lifecycle.py's `RequestState`, the lifecycle the transports share,
and changes only through `lifecycle.move` or its inlined lookup (an illegal transition raises):

    FREE ─parse─> NEW ─checks, SGL mapped─> EXECUTING ─handler─> one Outcome:
        COMPLETED   response handed to the transport ──> FREE
        FETCHING    EXECUTING ──> TRANSFERRING_HOST_TO_CONTROLLER (RDMA READ) ──> EXECUTING ──> next step
                    (in-capsule data: the next step runs at once)
        HELD        EXECUTING ──> HELD (the AER) ──(event)──> FREE
        DEFERRED    EXECUTING while the device call or the slices run; the completion comes back on the loop

A handler that returns no Outcome is a bug the core answers Internal Error and counts (core.py), rather than
leaving the request's slot taken for ever.

Requests are preallocated per queue (HSQSIZE + 1 of them) and reused, so the
hot path does not allocate a request per command.
"""
from __future__ import annotations

import enum
from typing import Callable, Optional

from ..nvme.command import SQE_STRUCT
from ..nvme.sgl import TYPE_KEYED_DATA_BLOCK
from ..transport.lifecycle import FREE, NEW, NEXT, IllegalTransition, RequestState

# SQE byte offsets reported as the error location (like nvmet's error_loc)
NO_LOCATION = 0xFFFF
LOC_OPCODE = 0
LOC_FLAGS = 1
LOC_NSID = 4
LOC_DPTR = 24
LOC_CDW10 = 40
LOC_CDW11 = 44
LOC_CDW12 = 48



class Outcome(enum.Enum):
    """What a command handler (and each next step of one) returns: how the command goes on."""

    COMPLETED = "completed"  # its response was handed to the transport (or its queue is gone)
    FETCHING = "fetching"  # it waits for host data; its next step runs when the data arrives
    HELD = "held"  # no response until an event (the AER)
    DEFERRED = "deferred"  # its device call or slices run off the handler; their completion answers it


COMPLETED = Outcome.COMPLETED
FETCHING = Outcome.FETCHING
HELD_OUTCOME = Outcome.HELD
DEFERRED = Outcome.DEFERRED

_unpack_sqe = SQE_STRUCT.unpack_from


class Request:
    """One command in flight: the SQE fields, its SGL, and where it is in the state machine."""

    __slots__ = ("queue", "state", "opc", "flags", "cid", "nsid", "cdw2", "cdw3", "mptr",
                 "sgl_addr", "sgl_id", "sgl_len", "sgl_key", "cdw10", "cdw11", "cdw12", "cdw13", "cdw14", "cdw15",
                 "inline_offset", "invalidate_key", "capsule", "ns", "next_step", "buf", "read_done", "_target",
                 "started_ns", "tx", "handed_back", "ref", "fence_refs")

    def __init__(self, queue: "QueueState", target):
        self.queue = queue
        self.state = FREE
        self._target = target
        self.ns = None
        self.ref = None  # its namespace's reference while it may touch it (engine/subsystem.py "references")
        self.fence_refs = ()  # a handed-back command's: the older epochs that fences on its namespace wait for
        self.next_step: Optional[Callable] = None
        self.capsule = None
        self.inline_offset = -1  # >= 0: the data is in the capsule at 64 + this offset
        self.invalidate_key = None  # the host's key the response invalidates (set by the transport's map_sgl)
        self.buf = bytearray(0)  # reused buffer for controller-to-host data
        self.read_done = self._on_read_done  # bound once, handed to read_host
        self.started_ns = 0  # perf_counter_ns() when an I/O command started (stats.py latency)
        self.tx = None  # the transport's request for this command (TargetQueue.read_host / complete)
        self.handed_back = False  # the native data path's device failed it: the core does it again (core._start)

    def parse(self, capsule) -> None:
        (self.opc, self.flags, self.cid, self.nsid, self.cdw2, self.cdw3, self.mptr, self.sgl_addr, word,
         self.cdw10, self.cdw11, self.cdw12, self.cdw13, self.cdw14, self.cdw15) = _unpack_sqe(capsule)
        self.sgl_id = word >> 56
        if (self.sgl_id >> 4) == TYPE_KEYED_DATA_BLOCK:
            self.sgl_len = word & 0xFFFFFF
            self.sgl_key = (word >> 24) & 0xFFFFFFFF
        else:
            self.sgl_len = word & 0xFFFFFFFF
            self.sgl_key = 0
        self.capsule = capsule
        self.inline_offset = -1
        self.invalidate_key = None
        self.ns = None
        self.next_step = None
        if NEW not in NEXT[self.state]:  # lifecycle.move, inlined: once per command
            raise IllegalTransition(self, NEW)
        self.state = NEW

    @property
    def fctype(self) -> int:
        return self.nsid & 0xFF

    def buffer(self, length: int) -> memoryview:
        """A reusable scratch buffer of `length` bytes for data going to the host."""
        if len(self.buf) < length:
            self.buf = bytearray(length)
        return memoryview(self.buf)[:length]

    def _on_read_done(self, data, error) -> None:
        self._target._host_data_arrived(self, data, error)

    def __repr__(self) -> str:
        return (f"<Request qid={self.queue.qid} cid={self.cid:#x} opc={self.opc:#04x} "
                f"{RequestState(self.state).name}>")
