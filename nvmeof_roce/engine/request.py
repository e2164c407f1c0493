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
    """One command in flight: the SQE fields, its data as the transport mapped it, and where it is in the state
    machine.  The SQE's DPTR (`dptr1`, `dptr2`) is the transport's to read: its `map_sgl` sets `transfer_len`
    (the bytes the command moves) and either `desc` (its data descriptor, handed back to its read_host and
    complete, never read here) or `inline_offset` (the data came in the capsule)."""

    __slots__ = ("queue", "state", "opc", "flags", "cid", "nsid", "cdw2", "cdw3", "mptr",
                 "dptr1", "dptr2", "transfer_len", "cdw10", "cdw11", "cdw12", "cdw13", "cdw14", "cdw15",
                 "inline_offset", "desc", "capsule", "ns", "next_step", "buf", "read_done", "_target",
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
        self.transfer_len = 0  # the bytes its SGL describes (set by the transport's map_sgl)
        self.desc = None  # the transport's data descriptor (set by its map_sgl; TargetQueue.read_host / complete)
        self.buf = bytearray(0)  # reused buffer for controller-to-host data
        self.read_done = self._on_read_done  # bound once, handed to read_host
        self.started_ns = 0  # perf_counter_ns() when an I/O command started (stats.py latency)
        self.tx = None  # the transport's request for this command (TargetQueue.read_host / complete)
        self.handed_back = False  # its transport's fast path failed it on its device: the core does it again

    def parse(self, capsule) -> None:
        (self.opc, self.flags, self.cid, self.nsid, self.cdw2, self.cdw3, self.mptr, self.dptr1, self.dptr2,
         self.cdw10, self.cdw11, self.cdw12, self.cdw13, self.cdw14, self.cdw15) = _unpack_sqe(capsule)
        self.capsule = capsule
        self.transfer_len = 0
        self.inline_offset = -1
        self.desc = None
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
