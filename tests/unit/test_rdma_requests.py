"""The RDMA target's request state machine (transport/rdma/requests.py) over plain Python: a recording poster
stands for the QP, a real BufferPool for the port's data chunks."""
import pytest

from nvmeof_roce.transport.lifecycle import IllegalTransition
from nvmeof_roce.transport.rdma.requests import SIGNAL_EVERY, RequestBook, State
from nvmeof_roce.transport.resources import BufferPool

CQE = b"\x01" * 16


class Recorder:
    """The book's Poster: what a QP would have been asked to post, and in which doorbell."""

    def __init__(self):
        self.queued = []
        self.doorbells = []  # each: the list of (kind, request index, signaled) posted together
        self.chunks = {}

    def post_read(self, req):
        self.queued.append(("read", req.index, True, req.chunk))

    def post_response(self, req):
        if req.length:
            self.queued.append(("write", req.index, False, req.chunk))
        self.queued.append(("send", req.index, req.signaled, req.invalidate))

    def flush(self):
        if self.queued:
            self.doorbells.append(self.queued)
            self.queued = []

    def stage(self, chunk, data):
        self.chunks[chunk] = bytes(data)

    def chunk_view(self, chunk, length):
        return memoryview(self.chunks.get(chunk, bytes(length)))[:length]


def make(chunks=8, send_slots=64, read_credits=4):
    pool = BufferPool(chunks, 1)
    share = pool.share()
    share.commit()
    poster = Recorder()
    return RequestBook(poster, share, send_slots, read_credits, prealloc=4), poster, pool


def executing(book):
    req = book.received()
    assert req.state == State.NEW
    book.delivered(req)
    assert req.state == State.EXECUTING
    return req


def test_a_read_command_goes_new_executing_completing_free():
    book, poster, pool = make()
    req = executing(book)
    book.complete(req, CQE, b"x" * 4096, addr=0x1000, key=7, invalidate=7)
    assert req.state == State.COMPLETING and book.in_flight() == 1
    assert poster.doorbells == [[("write", req.index, False, req.chunk), ("send", req.index, True, 7)]]
    assert poster.chunks[req.chunk] == b"x" * 4096 and pool.free_count == 7
    book.send_completed(req)
    assert req.state == State.FREE and book.in_flight() == 0 and pool.free_count == 8


def test_a_write_command_reads_host_data_then_completes():
    book, poster, pool = make()
    req = executing(book)
    got = []
    book.read(req, 0x2000, 9, 512, lambda data, err: got.append((bytes(data) if data is not None else None, err)))
    assert req.state == State.TRANSFERRING_HOST_TO_CONTROLLER and book.read_credits == 3
    poster.chunks[req.chunk] = b"d" * 512
    book.send_completed(req)
    assert got == [(b"d" * 512, None)] and req.state == State.EXECUTING and book.read_credits == 4
    assert pool.free_count == 8  # the chunk went back once the core had the data
    book.complete(req, CQE)
    assert poster.doorbells[-1] == [("send", req.index, True, None)]  # no data, no WRITE
    book.send_completed(req)
    assert req.state == State.FREE


def test_a_read_waits_for_read_credits_and_goes_when_one_returns():
    book, poster, _ = make(read_credits=1)
    first, second = executing(book), executing(book)
    book.read(first, 0, 1, 512, lambda d, e: None)
    book.read(second, 0, 1, 512, lambda d, e: None)
    assert first.state == State.TRANSFERRING_HOST_TO_CONTROLLER
    assert second.state == State.NEED_READ_CREDIT and list(book.pending[State.NEED_READ_CREDIT]) == [second]
    book.send_completed(first)
    assert second.state == State.TRANSFERRING_HOST_TO_CONTROLLER and not book.pending[State.NEED_READ_CREDIT]


def test_a_read_waits_for_a_buffer_held_by_another_queue():
    pool = BufferPool(3, 1)
    other = pool.share()
    other.commit()
    share = pool.share(wake=lambda: book.resume())
    share.commit()
    taken = other.take(2)  # its guarantee and the one shared buffer
    book = RequestBook(Recorder(), share, 64, 4)
    first, second = executing(book), executing(book)
    book.read(first, 0, 1, 512, lambda d, e: None)  # this queue's guaranteed buffer
    book.read(second, 0, 1, 512, lambda d, e: None)
    assert first.state == State.TRANSFERRING_HOST_TO_CONTROLLER
    assert second.state == State.NEED_BUFFER and list(book.pending[State.NEED_BUFFER]) == [second]
    other.give(taken)  # the pool wakes the waiting queue
    assert second.state == State.TRANSFERRING_HOST_TO_CONTROLLER and not book.pending[State.NEED_BUFFER]


def test_a_response_waits_for_a_send_slot_then_goes_in_order():
    book, poster, _ = make(send_slots=3)
    a, b, c = executing(book), executing(book), executing(book)
    book.complete(a, CQE, b"a" * 16, 1, 2)  # WRITE + SEND: two slots
    book.complete(b, CQE, b"b" * 16, 1, 2)  # needs two, one left: waits (its data copied: the core reuses its buffer)
    book.complete(c, CQE)  # needs one, but b waits ahead of it
    assert a.state == State.COMPLETING
    assert b.state == State.READY_TO_COMPLETE and c.state == State.READY_TO_COMPLETE
    assert list(book.pending[State.READY_TO_COMPLETE]) == [b, c] and book.completing() == 3
    book.send_completed(a)  # three slots free again: b (two) and then c (one), in one doorbell
    assert b.state == State.COMPLETING and c.state == State.COMPLETING
    assert [(kind, i) for kind, i, _, _ in poster.doorbells[-1]] == [("write", b.index), ("send", b.index),
                                                                     ("send", c.index)]
    assert poster.chunks[b.chunk] == b"b" * 16
    book.send_completed(c)
    assert book.in_flight() == 0 and book.send_slots == 3


def test_responses_of_one_batch_go_in_one_doorbell_with_the_last_signaled():
    book, poster, _ = make()
    reqs = [executing(book) for _ in range(2 * SIGNAL_EVERY + 3)]
    book.begin_batch()
    for r in reqs:
        book.complete(r, CQE)
    assert poster.doorbells == []
    book.end_batch()
    assert len(poster.doorbells) == 1
    signaled = [i for i, (_, _, sig, _) in enumerate(poster.doorbells[0]) if sig]
    assert signaled == [SIGNAL_EVERY - 1, 2 * SIGNAL_EVERY - 1, len(reqs) - 1]
    # one completion of a signaled SEND retires every request posted before it (RC completes in order)
    book.send_completed(reqs[SIGNAL_EVERY - 1])
    assert all(r.state == State.FREE for r in reqs[:SIGNAL_EVERY])
    assert all(r.state == State.COMPLETING for r in reqs[SIGNAL_EVERY:])
    book.send_completed(reqs[-1])
    assert book.in_flight() == 0


def test_every_response_is_signaled_when_send_slots_run_low():
    book, poster, _ = make(send_slots=8)
    reqs = [executing(book) for _ in range(4)]
    book.begin_batch()
    for r in reqs:
        book.complete(r, CQE)
    book.end_batch()
    assert [sig for (_, _, sig, _) in poster.doorbells[0]] == [False, False, False, True]  # 8 -> 4 free: not low
    more = [executing(book) for _ in range(3)]
    book.begin_batch()
    for r in more:
        book.complete(r, CQE)
    book.end_batch()
    assert [sig for (_, _, sig, _) in poster.doorbells[1]] == [True, True, True]  # under a quarter free


def test_shutdown_with_requests_in_every_state():
    pool = BufferPool(2, 1)
    share = pool.share()
    share.commit()
    poster = Recorder()
    book = RequestBook(poster, share, 4, 1)
    errors = []

    def done(data, err):
        errors.append(err)

    new = book.received()
    executing_ = executing(book)
    transferring = executing(book)
    book.read(transferring, 0, 1, 512, done)
    need_credit = executing(book)
    book.read(need_credit, 0, 1, 512, done)  # takes the last chunk, waits for the only read credit
    need_buffer = executing(book)
    book.read(need_buffer, 0, 1, 512, done)
    completing = executing(book)
    book.complete(completing, CQE)  # 4 slots: READ 1 + SEND 1
    ready = executing(book)
    book.complete(ready, CQE, b"z" * 16, 1, 2)  # needs two slots and a chunk: waits
    states = {r.state for r in book.requests}
    assert states >= {State.NEW, State.EXECUTING, State.TRANSFERRING_HOST_TO_CONTROLLER, State.NEED_READ_CREDIT,
                      State.NEED_BUFFER, State.COMPLETING, State.READY_TO_COMPLETE}
    assert book.in_flight() == 7 and pool.free_count == 0
    book.close(ConnectionError("queue closed"))
    assert all(r.state == State.FREE for r in book.requests) and book.in_flight() == 0
    assert len(errors) == 3 and all(isinstance(e, ConnectionError) for e in errors)  # every READ was told
    assert pool.free_count == 2  # every chunk is back
    # what the core does after the close is ignored, not an error
    book.complete(executing_, CQE)
    book.read(new, 0, 1, 512, done)
    assert len(errors) == 4 and book.in_flight() == 0


def test_complete_outside_executing_is_a_bug_not_silence():
    book, _, _ = make()
    req = executing(book)
    book.complete(req, CQE)
    with pytest.raises(IllegalTransition, match="COMPLETING -> READY_TO_COMPLETE"):
        book.complete(req, CQE)


def test_data_put_in_a_chunk_by_the_core_is_sent_without_a_copy():
    book, poster, pool = make()
    req = executing(book)
    assert book.buffer(req) and req.chunk >= 0 and pool.free_count == 7
    assert not book.buffer(req)  # one per request
    book.complete(req, CQE, b"f" * 512, 1, 2)
    assert poster.chunks == {}  # nothing staged: the data already lies in the chunk it is sent from
    assert poster.doorbells[-1][0] == ("write", req.index, False, req.chunk)
    book.send_completed(req)
    assert pool.free_count == 8


def test_data_in_registered_memory_goes_straight_from_there():
    book, poster, pool = make(chunks=2)
    req = executing(book)
    book.complete(req, CQE, b"r" * 4096, 1, 2, external=(0x7000, 5))
    assert req.state == State.COMPLETING and req.chunk == -1 and pool.free_count == 2 and poster.chunks == {}
    book.send_completed(req)
    assert book.in_flight() == 0


def test_a_pinned_ram_namespace_zeroes_by_writing_not_by_dropping_pages():
    from nvmeof_roce.engine.backends import RamBackend
    ram = RamBackend(4 * 4096)
    ram.write(0, b"\xaa" * (4 * 4096))
    mapping = ram.pin()
    assert ram.pinned and len(mapping) == 4 * 4096
    ram.write_zeroes(0, 3 * 4096)
    assert ram.read(0, 3 * 4096) == bytes(3 * 4096) and ram.read(3 * 4096, 4096) == b"\xaa" * 4096
    ram.close()


def test_a_read_posted_before_the_batch_flush_does_not_retire_the_responses_queued_before_it():
    """READs are written to the send queue at once, responses at the flush: `posted` follows the send queue's
    order, so the READ's completion does not retire a response that went on the queue after it."""
    book, poster, _ = make()
    done_req, reader = executing(book), executing(book)
    book.begin_batch()
    book.complete(done_req, CQE)  # waits for the flush
    book.read(reader, 0, 1, 512, lambda d, e: None)  # written to the send queue now
    book.end_batch()
    assert [(kind, i) for kind, i, *_ in poster.doorbells[-1]] == [("read", reader.index), ("send", done_req.index)]
    assert list(book.posted) == [reader, done_req]
    book.send_completed(reader)
    assert done_req.state == State.COMPLETING and reader.state == State.EXECUTING
    book.send_completed(done_req)
    assert done_req.state == State.FREE


def _read_then_a_response(book, poster):
    """Request A reads host data (a signaled READ); request B's response SEND is posted after it."""
    a, b = executing(book), executing(book)
    got = []
    book.read(a, 0x2000, 9, 512, lambda data, err: got.append((bytes(data) if data is not None else None, err)))
    poster.chunks[a.chunk] = b"w" * 512
    book.complete(b, CQE)
    return a, b, got


def test_iwarp_a_send_completion_before_an_earlier_reads_leaves_the_read_in_flight():
    """siw completes a SEND once it is on the wire, before an RDMA READ posted earlier has its data: with
    reads_complete_in_order=False the SEND's completion retires only itself, and the READ finishes on its own
    completion with its data."""
    pool = BufferPool(8, 1)
    share = pool.share()
    share.commit()
    poster = Recorder()
    book = RequestBook(poster, share, 64, 4, prealloc=4, reads_complete_in_order=False)
    a, b, got = _read_then_a_response(book, poster)
    book.send_completed(b)  # out of order: B's SEND first
    assert b.state == State.FREE and got == [] and a.state == State.TRANSFERRING_HOST_TO_CONTROLLER
    assert book.read_credits == 3
    book.send_completed(a)
    assert got == [(b"w" * 512, None)] and a.state == State.EXECUTING and book.read_credits == 4


def test_in_order_completions_a_send_completion_vouches_for_an_earlier_read():
    """RoCE and InfiniBand complete a send queue in order: a SEND completion after a READ means the READ is
    done too, and a READ without its own completion is a transport failure, not a wait."""
    book, poster, pool = make()
    a, b, got = _read_then_a_response(book, poster)
    book.send_completed(b)
    assert b.state == State.FREE and len(got) == 1 and got[0][0] is None and "without its completion" in str(got[0][1])
