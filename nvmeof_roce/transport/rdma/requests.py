"""The RDMA target's per-command bookkeeping: one state machine from receive to send completion.

Plain Python, no device: `RdmaTargetQueue` (transport/rdma/queue.py) owns a `RequestBook`
and gives it a `Poster` that turns "post this READ" or "post this response" into
verbs; unit tests give it one that records.  Everything a command can wait for is
counted here: data chunks (the port's `BufferPool`, transport/resources.py), RDMA
READ credits (the host's responder resources, i.e. our initiator depth / ORD) and
send-queue entries.

Every command is a `TxRequest` whose `state` is one of transport/lifecycle.py's `RequestState` (the
lifecycle the core's requests share), in the manner of SPDK's `spdk_nvmf_rdma_request_state` (lib/nvmf/rdma.c);
every change is checked by `lifecycle.move`:

    NEW -> EXECUTING (the core has it) -> READY_TO_COMPLETE -> COMPLETING -> FREE
    an RDMA READ of host data on the way:
    EXECUTING -> NEED_BUFFER -> NEED_READ_CREDIT -> TRANSFERRING_HOST_TO_CONTROLLER -> EXECUTING

SPDK's TRANSFERRING_CONTROLLER_TO_HOST and COMPLETING are one state here: the data
WRITE and the response SEND are posted together, the WRITE unsignaled and first
(docs/protocol.md §7).  A state that can block has its own pending queue, served
oldest first; `advance()` is the one function that moves a request on.

Selective signaling: RC completes a send queue's work requests in order, so one
signaled completion retires every earlier unsignaled one (`posted`, in post order).
In each flush the last response is signaled, and every SIGNAL_EVERY-th before it,
so no response is ever left without a later completion that retires it.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Protocol

from ..lifecycle import (COMPLETING, EXECUTING, FREE, NEED_BUFFER, NEED_READ_CREDIT, NEW, READY_TO_COMPLETE,
                         TRANSFERRING_HOST_TO_CONTROLLER, RequestState, move)
from ..contracts import TransportError
from ..resources import PoolShare

log = logging.getLogger(__name__)

RESPONSE_SIZE = 16  # an NVMe completion queue entry

SIGNAL_EVERY = 16  # at most this many responses retired by one send completion


State = RequestState  # the one lifecycle of transport/lifecycle.py; every change goes through move()


# States that block, in the order `resume` serves them: a finishing response frees what a READ waits for.
BLOCKING = (READY_TO_COMPLETE, NEED_BUFFER, NEED_READ_CREDIT)

ReadDone = Callable[[Optional[memoryview], Optional[Exception]], None]


class TxRequest:
    """One command's transport state: the typed work-request context (no tuples; its `index` is the wr_id)."""

    __slots__ = ("index", "state", "chunk", "in_chunk", "length", "addr", "key", "done", "data", "external",
                 "cqe", "invalidate", "signaled", "wrs", "parked", "hold")

    def __init__(self, index: int):
        self.index = index
        self.state = FREE
        self.parked = False  # in its state's pending queue
        self._clear()

    def _clear(self) -> None:
        self.chunk = -1  # the pool chunk it holds, or -1
        self.in_chunk = False  # the core put its data straight into that chunk (buffer())
        self.length = 0  # bytes of the READ, or of the data WRITE before the response
        self.addr = 0  # host address and key of that transfer
        self.key = 0
        self.done: Optional[ReadDone] = None  # the READ's callback
        self.data = None  # data not yet in a chunk (copied when the response must wait)
        self.external = None  # (addr, lkey) of data already in registered memory: WRITE straight from it
        self.hold = None  # the namespace reference of that memory, let go when the request is freed
        self.cqe = b""
        self.invalidate: Optional[int] = None
        self.signaled = False
        self.wrs = 0  # work requests of it on the send queue

    def __repr__(self) -> str:
        return f"<TxRequest {self.index} {RequestState(self.state).name}>"


class Poster(Protocol):
    """What the book asks of the device.  Both calls only queue: `flush` rings the doorbell once."""

    def post_read(self, req: TxRequest) -> None:
        """RDMA READ req.length bytes of host memory (req.addr, req.key) into chunk req.chunk, signaled."""

    def post_response(self, req: TxRequest) -> None:
        """RDMA WRITE of req.length bytes (from req.external, or chunk req.chunk) to (req.addr, req.key) when
        req.length, unsignaled; then the SEND of req.cqe (with invalidate req.invalidate), signaled if
        req.signaled."""

    def flush(self) -> None:
        """Post what was queued (one doorbell)."""

    def stage(self, chunk: int, data) -> None:
        """Copy data into a chunk."""

    def chunk_view(self, chunk: int, length: int) -> memoryview:
        """The first length bytes of a chunk."""


class QueueClosed(Exception):
    pass


class RequestBook:
    """The requests of one queue and what they wait for."""

    def __init__(self, poster: Poster, share: PoolShare, send_slots: int, read_credits: int, prealloc: int = 0,
                 reads_complete_in_order: bool = True):
        self.poster = poster
        # False (iWARP's siw): a send completion may come before the completion of a READ posted earlier
        self.reads_complete_in_order = reads_complete_in_order
        self.share = share
        self.send_slots = send_slots  # free send-queue entries
        self.send_slots_total = send_slots
        self.read_credits = read_credits  # RDMA READs we may still have outstanding
        self.read_credits_total = read_credits
        self.requests: List[TxRequest] = [TxRequest(i) for i in range(prealloc)]
        self.free: List[TxRequest] = list(reversed(self.requests))
        self.pending: Dict[State, Deque[TxRequest]] = {s: deque() for s in BLOCKING}
        self.posted: Deque[TxRequest] = deque()  # on the send queue, in post order
        self.queued: List[TxRequest] = []  # responses queued for the next flush
        self.unsignaled = 0  # responses posted since the last signaled one
        self.batching = 0  # > 0: flush at the end of the batch (one doorbell per completion poll)
        self.closed = False
        self.busy = 0  # requests not FREE

    # -- figures
    def in_flight(self) -> int:
        """Every request not FREE (received, with the core, or its data and response not yet completed)."""
        return self.busy

    def completing(self) -> int:
        """Requests the core is done with whose response has not yet left (a graceful stop waits for them)."""
        return (len(self.pending[READY_TO_COMPLETE]) + len(self.queued)
                + sum(1 for r in self.posted if r.cqe))

    def holding(self, reference) -> int:
        """Requests whose WRITE from a namespace's memory holds `reference`."""
        return sum(1 for req in self.requests if req.hold is reference)

    def count(self, state: State) -> int:
        return sum(1 for r in self.requests if r.state == state)

    # -- entry points
    def received(self) -> TxRequest:
        """A capsule arrived: a request in NEW (from the free list; it grows past its preallocation only for a
        host that keeps more commands outstanding than it asked for, which the core refuses)."""
        if self.free:
            req = self.free.pop()
        else:
            req = TxRequest(len(self.requests))
            self.requests.append(req)
        move(req, NEW)
        self.busy += 1
        return req

    def delivered(self, req: TxRequest) -> None:
        """NEW -> EXECUTING: the core has the capsule."""
        if req.state == NEW:
            move(req, EXECUTING)

    def read(self, req: TxRequest, addr: int, key: int, length: int, done: ReadDone) -> None:
        """EXECUTING -> NEED_BUFFER: the core wants host data."""
        if self.closed:
            done(None, QueueClosed("queue is closed"))
            return
        move(req, NEED_BUFFER)  # only from EXECUTING
        req.addr, req.key, req.length, req.done = addr, key, length, done
        self.advance(req)
        self._maybe_flush()

    def complete(self, req: TxRequest, cqe: bytes, data=None, addr: int = 0, key: int = 0,
                 invalidate: Optional[int] = None, external=None) -> None:
        """EXECUTING -> READY_TO_COMPLETE: the core's answer, the data (if any) and the response in one call.
        `data` is only borrowed for this call; `external` = (addr, lkey) says it already lies in registered
        memory, so the WRITE goes from there."""
        if self.closed:
            self._free(req)
            return
        move(req, READY_TO_COMPLETE)  # only from EXECUTING
        req.cqe = cqe
        req.invalidate = invalidate
        req.length = 0
        if data is not None and len(data):
            req.addr, req.key, req.length = addr, key, len(data)
            if external is not None:
                req.external = external
                self._give(req)  # a buffer the core asked for and did not use
            elif not req.in_chunk:
                req.data = data
        self.advance(req)
        if req.state == READY_TO_COMPLETE and req.data is not None and not isinstance(req.data, bytes):
            req.data = bytes(req.data)  # it waits: the core reuses its buffer once this call returns
        self._maybe_flush()

    def respond(self, req: Optional[TxRequest], cqe: bytes, data, addr: int, key: int, invalidate: Optional[int],
                source, region_of: Callable, max_transfer: int) -> None:
        """A transport's complete() on an open queue (both RDMA queues, Python and native): the response's
        sizes checked, a request made for an answer the core gives without one (a response to nothing it
        started from this book), `source` = (backend, offset) mapped to registered memory when `region_of`
        knows the backend, then complete()."""
        if data is not None and len(data) > max_transfer:
            raise TransportError(f"RDMA WRITE of {len(data)} bytes exceeds the {max_transfer}-byte MDTS")
        if len(cqe) != RESPONSE_SIZE:
            raise TransportError(f"response of {len(cqe)} bytes (a CQE is {RESPONSE_SIZE})")
        if req is None:
            req = self.received()
            self.delivered(req)
        external = None
        if source is not None:
            region = region_of(source[0]) if data is not None else None
            if region is not None:  # sent from the namespace's memory: its reference held until freed
                external = (region[0] + source[1], region[1])
                req.hold = source[2]
            elif source[2] is not None:
                source[2].put()  # copied: nothing of it reads that memory after this call
        self.complete(req, cqe, data, addr, key, invalidate, external)

    def buffer(self, req: TxRequest) -> bool:
        """The core asks for a chunk to put a command's data in (a file read), so complete() needs no copy;
        False when none is free now (the core then uses its own buffer and complete() stages it)."""
        if self.closed or req.state != EXECUTING or req.chunk >= 0 or self.pending[NEED_BUFFER]:
            return False
        if not self._take(req):
            return False
        req.in_chunk = True
        return True

    def dropped(self, req: TxRequest) -> None:
        """The core will not answer this request (its queue is closing): free it."""
        if req.state in (NEW, EXECUTING):
            self._free(req)

    # -- the one function that moves a request on
    def advance(self, req: TxRequest) -> None:
        """Move `req` as far as it can go now; park it in its state's pending queue when it must wait.
        Requests already waiting in that state go first."""
        while not self.closed:
            state = req.state
            if state not in self.pending:
                return  # NEW, EXECUTING, TRANSFERRING_*, COMPLETING, FREE move on an outside event
            pending = self.pending[state]
            if pending and pending[0] is not req:
                if not req.parked:
                    req.parked = True
                    pending.append(req)
                return
            if not self._step(req, state):
                if not req.parked:
                    req.parked = True
                    pending.append(req)
                return
            if req.parked:
                req.parked = False
                pending.popleft()

    def _step(self, req: TxRequest, state: State) -> bool:
        """One transition out of a blocking state; False if what it needs is not there."""
        if state == NEED_BUFFER:
            if not self._take(req):
                return False
            move(req, NEED_READ_CREDIT)
            return True
        if state == NEED_READ_CREDIT:
            if self.read_credits <= 0 or self.send_slots <= 0:
                return False
            self.read_credits -= 1
            self.send_slots -= 1
            req.wrs = 1
            req.signaled = True
            move(req, TRANSFERRING_HOST_TO_CONTROLLER)
            self.posted.append(req)
            self.poster.post_read(req)
            return True
        # READY_TO_COMPLETE: the data staged in a chunk (unless it lies in registered memory), then the
        # WRITE and the SEND need their send-queue entries.
        needed = 2 if req.length else 1
        if self.send_slots < needed:
            return False
        if req.data is not None:
            if req.chunk < 0 and not self._take(req):
                return False
            self.poster.stage(req.chunk, req.data)
            req.data = None
        self.send_slots -= needed
        req.wrs = needed
        move(req, COMPLETING)
        self.queued.append(req)  # into `posted` when flush() writes it: `posted` is the send queue's order
        return True

    def resume(self) -> None:
        """Something was freed: serve every pending queue, oldest first, as far as it goes."""
        for state in BLOCKING:
            pending = self.pending[state]
            while pending and not self.closed:
                head = pending[0]
                self.advance(head)
                if pending and pending[0] is head:
                    break  # still blocked
        self._maybe_flush()

    # -- posting
    def begin_batch(self) -> None:
        self.batching += 1

    def end_batch(self) -> None:
        self.batching -= 1
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if not self.batching:
            self.flush()

    def flush(self) -> None:
        """Post the queued responses: every SIGNAL_EVERY-th and the last signaled, or all signaled once send-queue
        entries run low (then each completion frees its entries at once)."""
        queued = self.queued
        if not queued:
            self.poster.flush()
            return
        self.queued = []
        low = self.send_slots < self.send_slots_total // 4
        last = len(queued) - 1
        for i, req in enumerate(queued):
            self.unsignaled += 1
            if i == last or low or self.unsignaled >= SIGNAL_EVERY:
                req.signaled = True
                self.unsignaled = 0
            self.posted.append(req)
            self.poster.post_response(req)
        self.poster.flush()

    # -- completions
    def send_completed(self, req: TxRequest) -> None:
        """A signaled send completion for `req`: it and every earlier work request have completed."""
        if not req.wrs:
            return  # not on the send queue (cannot happen): never retire the others on its account
        posted = self.posted
        waiting_reads = []  # READs still in flight when their completion may come later (not in order)
        while posted:
            done = posted.popleft()
            if (done is not req and not self.reads_complete_in_order
                    and done.state == TRANSFERRING_HOST_TO_CONTROLLER):
                waiting_reads.append(done)
                continue
            self.send_slots += done.wrs
            done.wrs = 0
            if done.state == TRANSFERRING_HOST_TO_CONTROLLER:
                self.read_credits += 1
                if done is req:
                    self._read_finished(done, self.poster.chunk_view(done.chunk, done.length), None)
                else:  # cannot happen (a READ is signaled, so its completion came first); never hang on it
                    self._read_finished(done, None, QueueClosed("RDMA READ retired without its completion"))
            elif done.state == COMPLETING:
                self._free(done)
            if done is req:
                break
        posted.extendleft(reversed(waiting_reads))
        self.resume()

    def _read_finished(self, req: TxRequest, data, error) -> None:
        """TRANSFERRING_HOST_TO_CONTROLLER -> EXECUTING: hand the data to the core, then give the chunk back."""
        move(req, EXECUTING)
        done, req.done = req.done, None
        try:
            if done is not None:
                done(data, error)
        finally:
            self._give(req)

    # -- chunks
    def _take(self, req: TxRequest) -> bool:
        taken = self.share.take(1)
        if not taken:
            return False
        req.chunk = taken[0]
        return True

    def _give(self, req: TxRequest) -> None:
        if req.chunk >= 0:
            chunk, req.chunk = req.chunk, -1
            self.share.give([chunk])

    def _free(self, req: TxRequest) -> None:
        if req.state == FREE:
            return
        self._give(req)
        hold = req.hold
        req._clear()
        if hold is not None:  # its WRITE from the namespace's memory completed or flushed
            hold.put()
        move(req, FREE)
        req.parked = False
        self.busy -= 1
        self.free.append(req)

    # -- shutdown
    def close(self, error: Exception) -> None:
        """The QP is gone (call this only after it is destroyed: a posted READ may still write its chunk until
        then): every request ends.  A READ's callback gets `error`; every chunk goes back to the pool; a request
        the core still holds is freed here and its later completion is ignored."""
        if self.closed:
            return
        self.closed = True
        for pending in self.pending.values():
            pending.clear()
        self.posted.clear()
        self.queued = []
        for req in self.requests:
            req.parked = False
            done, req.done = req.done, None
            if done is not None:  # NEED_BUFFER, NEED_READ_CREDIT, TRANSFERRING_HOST_TO_CONTROLLER
                move(req, EXECUTING)
                try:
                    done(None, error)
                except Exception:  # a callback's bug must not keep the other requests' chunks
                    log.exception("read callback failed")
            self._free(req)
