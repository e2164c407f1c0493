"""A target queue whose per-command work runs in C (`nvmeof_roce._native.Queue`, docs/native.md).

The C queue owns the receive ring and posts every work request on the QP.  Reads, Writes and Flushes of the RAM
and null namespaces in its view never reach Python, nor do Reads and Writes of its file and block namespaces (on
the queue's io_uring, through a bounce chunk per request slot: `bounce_of` gives the registered memory, `watch`
puts the ring's eventfd on the event loop; without `bounce_of` the core serves them); every other capsule comes here (`_on_capsule`) and goes to
the target core as on the Python path, with a `TxRequest` of this queue's `RequestBook`
(transport/rdma/requests.py).  The book's Poster is this class: its READs and responses are posted through the C
queue (`post_read`, `post_response`), so one owner posts on the QP; its send completions come back through
`_on_send_done`.  The send queue is split: the book counts `python_send` entries of it, the C queue the rest.

Nothing here touches a device: the verbs objects (QP, CQs) and the registered memory are handed over as
addresses and keys (`NativeVerbs`), by the RDMA transport on a real device or by the tests' fake provider
(tests/native/fakeprov.c).
"""
from __future__ import annotations

import enum
import errno
import logging
import os
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from ..contracts import QueueHandler, RemoteAccessError, TargetQueue, TransportError
from ...nvme.command import SQE_SIZE
from .connect import RdmaConnectRequest, queue_resources
from .native_trace import TRACING, log_lines
from .requests import RequestBook, TxRequest
from ..resources import PoolShare, ResourceLimits

log = logging.getLogger(__name__)


# Queues closed while their ring still had commands in the kernel (a backend I/O that does not come back): each
# holds its own bounce memory only, until reap_closed finds the last one back.  `target status` lists them.
CLOSING: Dict[int, "NativeTargetQueue"] = {}


def closing_queues() -> List[dict]:
    """The queues still closing, for `target status`: each one's qid, host, commands held and seconds since."""
    now = time.monotonic()
    return [{"qid": q.qid, "peer": q.request.peer, "held_commands": q.held, "closed_s": round(now - q.closed_at, 1)}
            for q in CLOSING.values()]


class QueueLife(enum.Enum):
    """A native queue's lifetime on the Python side; the C queue's follows it (csrc/nq_life.h, `Queue.state`)."""

    SERVING = "serving"
    CLOSING = "closing"  # no new command; the responses already made still leave, the QP stays until they have
    PEER_GONE = "peer gone"  # the host disconnected (the CM said so): nothing more leaves, torn down at once
    CLOSED = "closed"  # torn down: the owner destroyed the QP (on_close), the core told, the C queue's slots let go
    HELD = "held"  # closed with commands still on the device: its bounce memory theirs until they come back
    RELEASED = "released"  # the ring's last command back: everything given back


# For each state, the states a queue may enter it from (as engine/queue.py ALLOWED_FROM).
ALLOWED_FROM = {
    QueueLife.SERVING: set(),
    QueueLife.CLOSING: {QueueLife.SERVING},
    QueueLife.PEER_GONE: {QueueLife.SERVING, QueueLife.CLOSING},
    QueueLife.CLOSED: {QueueLife.SERVING, QueueLife.CLOSING, QueueLife.PEER_GONE},
    QueueLife.HELD: {QueueLife.CLOSED},
    QueueLife.RELEASED: {QueueLife.CLOSED, QueueLife.HELD},
}
_TORN_DOWN = frozenset({QueueLife.CLOSED, QueueLife.HELD, QueueLife.RELEASED})


class IllegalQueueMove(RuntimeError):
    """A native queue was moved along no edge of its lifetime (ALLOWED_FROM)."""


@dataclass
class Region:
    """Registered memory: its address, local key, length and a writable view of it (None: not ours to touch)."""

    addr: int
    lkey: int
    length: int
    view: Optional[memoryview] = None

    def spec(self):
        return (self.addr, self.lkey, self.length)


@dataclass
class NativeVerbs:
    """What the C queue posts and polls on: addresses of the verbs objects (from the CM id, or a fake provider)."""

    qp: int
    send_cq: int
    recv_cq: int
    max_reads: int  # the host's responder resources granted to this QP (RDMA READs in flight)
    remote_invalidate: bool = True


@dataclass
class ChunkPool:
    """The data chunks the Python side's requests stage their transfers in (the port's pool)."""

    region: Region
    chunk_size: int

    def view(self, chunk: int, length: int) -> memoryview:
        start = chunk * self.chunk_size
        return self.region.view[start:start + length]

    def addr(self, chunk: int) -> int:
        return self.region.addr + chunk * self.chunk_size


class NativeTargetQueue(TargetQueue):
    """One NVMe queue served by the C data path, with the Python core behind it for everything else."""

    trtype = "rdma"
    data_path = "native"

    def __init__(self, module, handler: QueueHandler, request: RdmaConnectRequest, verbs: NativeVerbs, *,
                 in_capsule_size: int, recv: Region, chunks: ChunkPool, share: PoolShare, max_transfer: int,
                 zero: Optional[Region] = None, sink: Optional[Region] = None,
                 on_close: Callable[["NativeTargetQueue"], None],
                 region_of: Callable[[object], Optional[tuple]] = lambda backend: None,
                 bounce_of: Optional[Callable[[int], Region]] = None,
                 file_buffers: int = ResourceLimits.queue_file_buffers,
                 watch: Optional[Callable[[int, Callable[[], object]], None]] = None,
                 unwatch: Optional[Callable[[int], None]] = None,
                 on_released: Callable[["NativeTargetQueue"], None] = lambda queue: None):
        self.handler = handler
        self.request = request
        self.in_capsule_size = in_capsule_size
        self.depth = request.hsqsize + 1
        self.recv_size = SQE_SIZE + in_capsule_size
        self.recv_count, self.send_queue = queue_resources(self.depth)
        if recv.length < self.recv_count * self.recv_size:
            raise ValueError(f"receive region of {recv.length} bytes; {self.recv_count} x {self.recv_size} needed")
        self.chunks = chunks
        self.share = share
        self.max_transfer = max_transfer
        self.region_of = region_of  # (addr, lkey) of a RAM backend's registered memory, or None
        self.zero, self.sink = zero, sink
        # The owner's QP destroyed (or put in the error state): after it nothing posted on the QP moves data, and
        # only then is the core told the queue closed (_teardown).  Required: a QP left as it is would go on
        # writing memory the core lets go.
        self._on_close = on_close
        # file and block namespaces: registered bounce memory (asked for when one first enters the view) and the
        # ring's eventfd on the event loop
        self.bounce_of = bounce_of
        self.file_buffers = file_buffers  # bounce chunks (at most one per request slot): memory per queue
        self.watch = watch
        self.unwatch = unwatch
        self._on_released = on_released  # the bounce memory is the owner's again: the ring's last command is back
        self.life = QueueLife.SERVING  # moved by _move only (ALLOWED_FROM)
        self.closed = False  # torn down (CLOSED, HELD, RELEASED): nothing of it is served any more (_move sets it)
        self.closing = False  # closed for new commands, its last responses still leaving (CLOSING; _move sets it)
        self.held = 0  # HELD: this many commands still in the kernel (CLOSING), reaped on the ring's eventfd
        self.closed_at = 0.0
        self.serves_files = bounce_of is not None
        self.bounce: Optional[Region] = None
        self.ring_fd: Optional[int] = None
        self.in_poll = False
        self.refused_post: Optional[ConnectionError] = None  # the C queue refused a post: it failed (flush closes)
        # Send queue as the RDMA transport sizes it (transport/rdma/queue.py): per command a READ, or a WRITE and a SEND,
        # twice over; the Python side's book gets a quarter of it (its commands are the rare ones).
        python_send = max(8, self.send_queue // 4)
        # The host's RDMA READ credits are the C queue's: it counts every READ posted on the QP, its own and the
        # Python side's (post_read takes one, or waits in the C queue for the next one given back), so together
        # they never post more than the host granted, even one.  The book's share only keeps the Python side
        # from taking them all.
        python_reads = max(1, verbs.max_reads // 4)
        self.book = RequestBook(self, share, python_send, python_reads, prealloc=self.recv_count)
        # The C queue keeps its callbacks until it is freed, and this object keeps the C queue: bound methods would
        # make a cycle the collector cannot see into (the C type does not take part in it), so a closed queue, its
        # buffers and its registrations would never be freed.  The callbacks reach this object through a weak
        # reference instead.
        self.native = module.Queue(
            verbs.qp, verbs.send_cq, verbs.recv_cq, qid=request.qid, recv=recv.spec(), recv_count=self.recv_count,
            recv_size=self.recv_size, requests=self.recv_count, send_queue=self.send_queue, python_send=python_send,
            reads=verbs.max_reads, on_capsule=_weak(self._on_capsule), on_send_done=_weak(self._on_send_done),
            on_failure=_weak(self._on_failure), zero=zero.spec() if zero else None,
            sink=sink.spec() if sink else None, remote_invalidate=verbs.remote_invalidate)
        self.view_ready = False
        self.drain_check: Optional[Callable[[], None]] = None  # while a change waits for commands: set_view
        self.native_commands_seen = 0  # the C queue's native_commands at the last native_traffic()
        self.poll_mode = None  # "interrupt", "adaptive" or "busy" once start_polling ran (a test may poll by hand)
        self.poll_group = None  # the _native.PollGroup whose thread polls it (--cores), or None
        self.tracing = False  # the per-command trace is on: its records are taken at each poll and tick
        TRACING.attach(self)

    # -- the lifetime

    def _move(self, new: QueueLife) -> None:
        if self.life not in ALLOWED_FROM[new]:
            raise IllegalQueueMove(f"queue {self.qid}: {self.life.value} -> {new.value}")
        self.life = new
        # Read on every poll: plain attributes.  An Enum member's hash and lookup are Python calls that allocate
        # (make bench-native counted 6 mallocs per poll with them).
        self.closed = new in _TORN_DOWN
        self.closing = new is QueueLife.CLOSING

    @property
    def peer_gone(self) -> bool:
        return self.life is QueueLife.PEER_GONE

    @peer_gone.setter
    def peer_gone(self, gone: bool) -> None:
        """The CM's word that the host disconnected (RdmaListener): the close that follows sends nothing more."""
        if gone and self.life in ALLOWED_FROM[QueueLife.PEER_GONE]:
            self._move(QueueLife.PEER_GONE)

    # -- the C queue's callbacks (during poll(); through _weak)

    def _on_capsule(self, capsule: bytes, handed_back: bool = False) -> None:
        if self.life is not QueueLife.SERVING:
            return  # no new command on a closing queue
        if len(capsule) < SQE_SIZE:
            log.warning("queue %d: capsule of %d bytes (< 64): closing the queue", self.qid, len(capsule))
            self.close()
            return
        book = self.book
        tx = book.received()
        book.delivered(tx)
        book.begin_batch()  # its posts join the C queue's batch; flushed when the poll ends
        try:
            self.handler.capsule_received(self, memoryview(capsule), tx, handed_back)
        finally:
            book.end_batch()

    def _on_send_done(self, index: int) -> None:
        if not self.closed and index < len(self.book.requests):
            self.book.send_completed(self.book.requests[index])

    def _on_failure(self, status: int, wr_id: int) -> None:
        # The C queue reports a refused ibv_post_send/ibv_post_recv as -errno, a failed work completion as its
        # ibv_wc_status (> 0).
        if status < 0:
            what = f"posting work requests failed: {errno.errorcode.get(-status, -status)} ({os.strerror(-status)})"
        else:
            what = f"work completion failed with status {status}"
        log.warning("queue %d: %s: closing the queue", self.qid, what)
        self.close(RemoteAccessError(what))

    # -- driving it

    POLL_BUDGET = 64  # completions per loop pass at most, so one busy queue cannot hold the others

    def poll(self, budget: int = 256) -> int:
        """Handle up to `budget` completions (one doorbell for what they post); 0 when there was none.  A poll
        group's queue is polled by its thread: this delivers what the thread mailed instead."""
        if self.closed:
            return 0
        self.in_poll = True  # a close from a completion of this poll sends what the poll made first
        try:
            done = self.native.drain() if self.poll_group is not None else self.native.poll(budget)
        finally:
            self.in_poll = False
        self.after_poll(done)
        return done

    def poll_adaptive(self, spin_us: float, budget: int = POLL_BUDGET) -> tuple:
        """`--poll adaptive` (csrc/nq_hot.c nq_poll_adaptive): poll, keep polling up to `spin_us` after the last
        completion, then arm the CQs and poll once more.  (handled, armed); not armed: `budget` was spent first,
        call again before sleeping on the channels."""
        if self.closed:
            return 0, False
        self.in_poll = True  # as poll(): a close from a completion of this poll sends what the poll made first
        try:
            done, armed = self.native.poll_adaptive(budget, spin_us)
        finally:
            self.in_poll = False
        self.after_poll(done)
        return done, armed

    def after_poll(self, done: int) -> None:
        """What follows every poll of the C queue (`done` completions handled): the trace, the
        fences' check, the teardown of a closing queue whose last response has left."""
        if self.tracing:
            self.log_trace()
        if done and self.drain_check is not None:
            self.drain_check()  # a change waits for commands in flight: these may have been the last
        if self.closing and self.native.close_ready:
            self._teardown(None)  # the last response of a closing queue has left

    def start_polling(self, loop, mode: str, channels=(), on_channel_event: Optional[Callable] = None,
                      poll_groups=None) -> None:
        """Have `loop` (transport/eventloop.py) drive this queue: "interrupt" arms the CQs and watches their
        completion channels' fds (`on_channel_event` reads the events, re-arms and polls; "adaptive" the same,
        its event handler spinning a bounded time before it re-arms: native.py); "busy" never arms
        them and polls the queue on every loop pass instead, until it closes (tunables.POLL).  With
        `poll_groups` (transport/rdma/pollgroups.py, `--cores`) a poll group's thread busy-polls it without the GIL
        and the loop watches its mailbox's eventfd instead, draining what needs Python."""
        self.poll_mode = mode
        if poll_groups is not None:
            self.poll_group, self._mail_fd = poll_groups.assign(self.native)
            self._loop = loop
            loop.watch(self._mail_fd, self._drain)
            return
        if mode == "busy":
            loop.keep_polling(self._busy_poll)
            return
        self.native.arm()
        for fd in channels:
            loop.watch(fd, on_channel_event)

    def _drain(self) -> None:
        if not self.closed:
            self.in_poll = True
            try:
                self.native.drain()
            finally:
                self.in_poll = False
            if self.tracing:
                self.log_trace()
            if self.closing and self.native.close_ready:
                self._teardown(None)

    # -- the per-command trace (transport/rdma/native_trace.py)

    def set_trace(self, records: int) -> None:
        """The trace on in a ring of `records`, or off (0)."""
        self.native.set_trace(records)
        self.tracing = records > 0

    def log_trace(self) -> None:
        """What the C queue recorded since the last take, printed as the Python data path's trace lines."""
        log_lines(self.qid, self.native.take_trace())

    def _leave_poll_group(self) -> None:
        """Before the QP is destroyed: the group's thread stops polling the queue (it waits for a poll under
        way), and the loop stops watching its mailbox."""
        if self.poll_group is None:
            return
        self._loop.unwatch(self._mail_fd)
        self.poll_group.remove(self.native)
        self.poll_group = None

    def _busy_poll(self) -> bool:
        if self.closed:
            return False  # out of the loop's passes
        self.poll(self.POLL_BUDGET)
        return not self.closed

    def set_view(self, ready: bool, namespaces, sq_entries: int = 0, sq_head: int = 0,
                 sqflow_disabled: bool = False, drain_check: Optional[Callable[[], None]] = None) -> dict:
        """The one call that changes what the C queue serves itself (engine/native_view.py builds it)."""
        if self.closed:
            return {}
        self.drain_check = drain_check
        # The core serves staged namespaces (file, block: an entry with a handle) where the queue cannot: no ring
        # or bounce memory.
        if any(len(entry) > 10 for entry in namespaces) and not self._enable_files():
            namespaces = [entry for entry in namespaces if len(entry) <= 10]
        self.view_ready = ready
        return self.native.set_view(ready, self.max_transfer, namespaces, sq_entries=sq_entries, sq_head=sq_head,
                                    sqflow_disabled=sqflow_disabled)

    def native_in_flight(self) -> dict:
        return {} if self.closed else self.native.in_flight()

    def _enable_files(self) -> bool:
        """The ring and the bounce chunks, made once; False (the core serves file namespaces) where they cannot be."""
        if self.ring_fd is not None:
            return True
        if not self.serves_files:
            return False
        chunk = -(-self.max_transfer // 4096) * 4096
        try:
            bounce = self.bounce_of(min(self.recv_count, self.file_buffers) * chunk)
            self.ring_fd = self.native.enable_files(bounce.spec(), chunk)
        except (OSError, ValueError) as exc:
            log.warning("queue %d: file and block namespaces stay with the core (no io_uring or bounce memory for "
                        "the native data path: %s)", self.qid, exc)
            self.serves_files = False
            return False
        self.bounce = bounce
        if self.watch is not None and self.poll_group is None:  # a poll group's thread reaps the ring itself
            self.watch(self.ring_fd, self._on_ring_event)
        return True

    def _on_ring_event(self):
        """The ring's eventfd is readable: cleared first (a completion after this read signals it again), then
        a poll, which reaps the ring."""
        if self.closed:
            return None
        try:
            os.read(self.ring_fd, 8)
        except BlockingIOError:
            pass
        return self.poll_ring()

    def poll_ring(self):
        """Poll after ring completions; the transport may return a callable to be called again (more to do)."""
        self.poll()
        return None

    def take_native_stats(self) -> dict:
        if self.closed:
            return {}
        if self.tracing:  # a poll group's thread records without mailing anything: taken at the tick
            self.log_trace()
        return self.native.take_stats()

    def native_traffic(self) -> bool:
        seen = self.native.stats()["native_commands"]
        if seen == self.native_commands_seen:
            return False
        self.native_commands_seen = seen
        return True

    def stats(self) -> dict:
        return self.native.stats()

    def polling_status(self) -> dict:
        """How the C queue is polled and what its polls found, for `target status --json` (each I/O queue's
        "polling"): with --poll adaptive, spin_hits against arms says whether the spin catches the next command."""
        if self.closed:
            return {}
        s = self.native.stats()
        return {"mode": self.poll_mode, "poll_group": self.poll_group is not None, "polls": s["polls"],
                "spin_hits": s["spin_hits"], "spin_yields": s["spin_yields"], "arms": s["arms"],
                "arm_catches": s["arm_catches"]}

    # -- the book's Poster: everything goes through the C queue

    # A poll group's thread may fail the queue (a failed work completion) before the loop has drained that
    # failure: the C queue then refuses every post (ConnectionError).  Such a post is as good as flushed, as on a
    # QP in error: the book's flush that follows closes the queue, which ends the request with an error.
    def post_read(self, req: TxRequest) -> None:
        try:
            self.native.post_read(req.index, self.chunks.addr(req.chunk), self.chunks.region.lkey, req.length,
                                  req.addr, req.key)
        except ConnectionError as exc:
            self.refused_post = exc

    def post_response(self, req: TxRequest) -> None:
        laddr = lkey = 0
        if req.length:
            if req.external is not None:
                laddr, lkey = req.external
            else:
                laddr, lkey = self.chunks.addr(req.chunk), self.chunks.region.lkey
        try:
            self.native.post_response(req.index, req.cqe, req.signaled, laddr, lkey, req.length, req.addr, req.key,
                                      -1 if req.invalidate is None else req.invalidate)
        except ConnectionError as exc:
            self.refused_post = exc

    def flush(self) -> None:
        if self.refused_post is not None:
            exc, self.refused_post = self.refused_post, None
            log.warning("queue %d: the native queue failed (%s): closing the queue", self.qid, exc)
            self.close(TransportError(f"queue {self.qid} failed: {exc}"))
        if not self.closed:
            self.native.flush()

    def stage(self, chunk: int, data) -> None:
        self.chunks.view(chunk, len(data))[:] = data

    def chunk_view(self, chunk: int, length: int) -> memoryview:
        return self.chunks.view(chunk, length)

    # -- the TargetQueue contract (the Python core's side)

    def read_host(self, addr: int, key: int, length: int, done, tx=None) -> None:
        if self.closed:
            done(None, TransportError("queue is closed"))
            return
        if length > self.max_transfer:
            done(None, TransportError(f"transfer of {length} bytes exceeds {self.max_transfer}"))
            return
        if tx is None:
            tx = self.book.received()
            self.book.delivered(tx)
        self.book.read(tx, addr, key, length, done)

    def data_buffer(self, length: int, tx=None) -> Optional[memoryview]:
        if tx is None or length > self.max_transfer or not self.book.buffer(tx):
            return None
        return self.chunks.view(tx.chunk, length)

    def complete(self, cqe: bytes, data=None, addr: int = 0, key: int = 0, invalidate_key: Optional[int] = None,
                 tx=None, source=None) -> None:
        if self.closed:
            if tx is not None:
                self.book.dropped(tx)
            if source is not None and source[2] is not None:
                source[2].put()  # nothing is sent: nothing reads the namespace's memory
            return
        self.book.respond(tx, cqe, data, addr, key, invalidate_key, source, self.region_of, self.max_transfer)

    def references_held(self, reference) -> int:
        """Its responses sent from a namespace's memory and its C queue's commands holding `reference` (a closed
        queue's until its slots are let go: native.close, after the QP is gone)."""
        return self.book.holding(reference) + self.native.holding(reference)

    def responses_in_flight(self) -> int:
        if self.closed:
            return 0
        return self.book.completing() + self.native.stats()["native_in_flight"]

    def connected(self) -> bool:
        return self.share.commit()

    def close(self, error: Optional[TransportError] = None) -> None:
        """Close the queue.  An orderly close (no error, the host still there) first sends the responses of the
        commands already executed -- a Disconnect's own among them, made in the poll it arrived in -- and keeps
        the QP until their send completions have come (nvmet answers the Disconnect, then tears the queue down);
        a failed completion, the host's disconnect, a second close or one from outside a poll (the listener's,
        a keep-alive's expiry: nothing is batched then) ends it at once."""
        if self.closed:
            return
        if (error is None and self.in_poll and self.life is QueueLife.SERVING and
                self._send_responses_before_close()):
            self._move(QueueLife.CLOSING)
            log.info("queue %d closing: its last responses are still to leave", self.qid)
            return
        self._teardown(error)

    def _send_responses_before_close(self) -> bool:
        """The responses the book still holds (a Disconnect's own, made inside the book's batch) handed to the C
        queue, which posts them with what its poll batched; True while posted work has to complete."""
        self.book.flush()
        return not self.closed and self.native.begin_close()

    def _teardown(self, error: Optional[TransportError]) -> None:
        if self.closed:
            return
        self._move(QueueLife.CLOSED)
        self._leave_poll_group()  # first: no thread polls or posts on the queue from here on
        try:
            # The owner destroys the QP (or puts it in the error state) before the core hears of the close: from
            # then on the core no longer counts this queue's commands, and a change's fence may commit
            # a live change at once, letting go of memory its work requests still on the wire would write.
            self._on_close(self)
        finally:
            try:
                self.handler.queue_closed(self)
            finally:
                self._release_native(error)

    def _release_native(self, error: Optional[TransportError]) -> None:
        """After the QP is gone: the C queue closed, the book's requests ended, the memory let go."""
        if self.tracing:
            self.log_trace()
        # Never waits for the ring: the commands the kernel still holds (a device that does not answer) are
        # cancelled where they can be and keep only this queue's bounce memory until they come back.
        self.held = self.native.close()
        self.book.close(error or TransportError("queue closed"))
        self.share.close()
        if self.held:
            self._move(QueueLife.HELD)
            self.closed_at = time.monotonic()
            CLOSING[id(self)] = self
            log.warning("queue %d closed with %d commands still on the device: its bounce memory is kept until "
                        "they come back (target status: transport.closing_queues)", self.qid, self.held)
            if self.watch is not None:
                self.watch(self.ring_fd, self.reap_closed)
        else:
            self._released()

    def reap_closed(self) -> None:
        """A closed queue's ring, on its eventfd: what came back reaped; with the last, its memory let go."""
        try:
            os.read(self.ring_fd, 8)
        except (BlockingIOError, OSError):
            pass
        was, self.held = self.held, self.native.reap_closed()
        if self.held:
            return
        CLOSING.pop(id(self), None)
        if self.unwatch is not None:
            self.unwatch(self.ring_fd)
        log.info("queue %d: its last %d commands came back from the device %.1f s after it closed: memory released",
                 self.qid, was, time.monotonic() - self.closed_at)
        self._released()

    def _released(self) -> None:
        self._move(QueueLife.RELEASED)
        self.bounce = None
        self.ring_fd = None
        self._on_released(self)


def _weak(method):
    """`method` of an object, called through a weak reference to it (a no-op once the object is gone)."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        if bound is not None:
            bound(*args)
    return call

