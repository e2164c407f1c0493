"""The loopback transport on its own: RDMA's rules with a scripted handler standing in for the target."""
import pytest

from nvmeof_roce.nvme import cm
from nvmeof_roce.transport.contracts import ConnectRejected, Refusal, RemoteAccessError, TransportError
from nvmeof_roce.transport.loopback import FakeClock, LoopbackFabric, SendQueueFull
from nvmeof_roce.transport.rdma.sgl import keyed_data

ADDR = "10.0.0.1:4420"


class Recorder:
    """A QueueHandler that records everything and lets the test drive the target side."""

    in_capsule_size = 128

    def __init__(self, reject=None):
        self.reject = reject  # a transport.contracts.Refusal, or None to accept
        self.queues = []
        self.capsules = []
        self.closed = []
        self.ticks = []

    def check_connect(self, request):
        return self.reject

    def queue_opened(self, queue):
        self.queues.append(queue)

    def capsule_received(self, queue, capsule):
        self.capsules.append((queue, bytes(capsule)))

    def queue_closed(self, queue):
        self.closed.append(queue)

    def tick(self, now):
        self.ticks.append(now)


@pytest.fixture
def setup():
    clock = FakeClock()
    fabric = LoopbackFabric(clock=clock)
    handler = Recorder()
    fabric.listen(ADDR, handler)
    return fabric, handler, clock


def open_queue(fabric, handler, qid=1, hrqsize=4, hsqsize=3):
    host = fabric.connector(ADDR).connect(qid, hrqsize, hsqsize, 0)
    return host, handler.queues[-1]


def test_connect_request_and_sizes(setup):
    fabric, handler, _ = setup
    host, target = open_queue(fabric, handler, qid=0, hrqsize=32, hsqsize=31)
    assert target.request.qid == 0 and target.request.hsqsize == 31 and target.request.peer
    assert target.in_capsule_size == 0 and host.crqsize == 32
    _, io = open_queue(fabric, handler, qid=1)
    assert io.in_capsule_size == 128 and io.local_address == "10.0.0.1"


def test_reject_and_no_listener():
    fabric = LoopbackFabric()
    fabric.listen(ADDR, Recorder(reject=Refusal.NO_RESOURCES))
    with pytest.raises(ConnectRejected) as exc:
        fabric.connector(ADDR).connect(0, 32, 31)
    assert exc.value.status == cm.STS_NO_RESOURCES
    with pytest.raises(TransportError):
        fabric.connector("10.0.0.2:4420").connect(0, 32, 31)
    with pytest.raises(ConnectRejected) as exc:
        fabric.connector(ADDR).connect_raw(b"")
    assert exc.value.status == cm.STS_INVALID_LEN


def test_capsules_are_delivered_when_pumped(setup):
    fabric, handler, _ = setup
    host, target = open_queue(fabric, handler)
    host.send(b"A" * 64)
    assert handler.capsules == []  # queued, nothing runs until pumped
    fabric.pump()
    assert handler.capsules == [(target, b"A" * 64)]


def test_oversize_capsule_is_fatal(setup):
    fabric, handler, _ = setup
    host, target = open_queue(fabric, handler)
    host.send(b"B" * (64 + 128 + 1))
    fabric.pump()
    assert handler.capsules == [] and handler.closed == [target]
    with pytest.raises(TransportError):
        host.poll(0)
    with pytest.raises(TransportError):
        host.send(b"C" * 64)


def test_rdma_read_and_write_with_keys(setup):
    fabric, handler, _ = setup
    host, target = open_queue(fabric, handler)
    buf = host.register(4096)
    buf.view[:5] = b"hello"
    got = []
    target.read_host(keyed_data(buf.addr, buf.key), 5, lambda data, err: got.append((bytes(data), err)))
    target.write_host(buf.addr + 100, buf.key, b"world")
    target.respond(b"\x01" * 16)
    assert got == [] and host.poll(0) == [b"\x01" * 16]  # poll pumps; WRITE lands before the CQE
    assert got == [(b"hello", None)] and bytes(buf.view[100:105]) == b"world"


def test_complete_writes_where_the_data_descriptor_says_then_invalidates_the_key_it_names(setup):
    fabric, handler, _ = setup
    host, target = open_queue(fabric, handler)
    frwr = host.register_with_access(4096, invalidatable=True)
    target.complete(b"\x05" * 16, b"data", keyed_data(frwr.addr + 8, frwr.key, frwr.key))
    assert host.poll(0) == [b"\x05" * 16] and bytes(frwr.view[8:12]) == b"data"
    target.complete(b"\x06" * 16, b"more", keyed_data(frwr.addr, frwr.key))  # the key is gone: fatal
    fabric.pump()
    assert handler.closed == [target]
    host2, target2 = open_queue(fabric, handler)
    target2.complete(b"\x07" * 16)  # no descriptor (none mapped, or in-capsule data): the response alone
    assert host2.poll(0) == [b"\x07" * 16]


@pytest.mark.parametrize("bad", ["key", "bounds", "right", "deregistered"])
def test_remote_access_errors_tear_the_queue_down(setup, bad):
    fabric, handler, _ = setup
    host, target = open_queue(fabric, handler)
    other_host, other_target = open_queue(fabric, handler)
    buf = host.register(4096)
    addr, key, length = buf.addr, buf.key, 512
    if bad == "key":
        key ^= 1
    elif bad == "bounds":
        addr += 4000
    elif bad == "right":
        ro = host.register_with_access(4096, remote_read=False)
        addr, key = ro.addr, ro.key
    else:
        host.deregister(buf)
    errors = []
    target.read_host(keyed_data(addr, key), length, lambda data, err: errors.append(err))
    target.respond(b"\x02" * 16)  # flushed: the QP is in error
    fabric.pump()
    assert len(errors) == 1 and isinstance(errors[0], RemoteAccessError)
    assert handler.closed == [target]
    with pytest.raises(TransportError):
        host.poll(0)
    # the other queue is fine
    other_target.respond(b"\x03" * 16)
    assert other_host.poll(0) == [b"\x03" * 16]


def test_keys_are_scoped_to_the_connector(setup):
    fabric, handler, _ = setup
    host_a, target_a = open_queue(fabric, handler)
    fabric.connector(ADDR).connect(1, 4, 3)
    target_b = handler.queues[-1]
    buf_a = host_a.register(64)
    target_b.write_host(buf_a.addr, buf_a.key, b"x")  # another host's key: unknown here
    fabric.pump()
    assert handler.closed == [target_b]
    # a second queue of the same connector shares the registrations (one protection domain)
    conn = fabric.connector(ADDR)
    conn.connect(1, 4, 3)
    t1 = handler.queues[-1]
    q2 = conn.connect(2, 4, 3)
    buf = q2.register(64)
    t1.write_host(buf.addr, buf.key, b"shared")
    fabric.pump()
    assert bytes(buf.view[:6]) == b"shared" and t1 not in handler.closed


def test_response_must_be_16_bytes_and_never_invalidate_a_plain_key(setup):
    fabric, handler, _ = setup
    host, target = open_queue(fabric, handler)
    target.respond(b"\0" * 17)
    fabric.pump()
    assert handler.closed == [target]
    host2, target2 = open_queue(fabric, handler)
    buf = host2.register(64)
    target2.respond(b"\0" * 16, invalidate_key=buf.key)
    fabric.pump()
    assert target2 in handler.closed


def test_send_queue_depth_and_rnr_backlog(setup):
    fabric, handler, _ = setup
    host, target = open_queue(fabric, handler, hrqsize=2, hsqsize=2)  # 3 outstanding, 2 receive buffers
    for _ in range(3):
        host.send(b"\0" * 64)
    with pytest.raises(SendQueueFull):
        host.send(b"\0" * 64)
    fabric.pump()
    for i in range(3):
        target.respond(bytes([i]) * 16)
    first = host.poll(0)
    assert first == [bytes([0]) * 16, bytes([1]) * 16]  # only HRQSIZE receives were posted
    assert host.poll(0) == [bytes([2]) * 16]  # the third waited (RNR) until receives were re-posted
    host.send(b"\0" * 64)  # slots are free again


def test_close_from_either_side_reports_once(setup):
    fabric, handler, _ = setup
    host, target = open_queue(fabric, handler)
    target.respond(b"\x07" * 16)
    target.close()  # orderly: the response already posted still arrives
    target.close()
    fabric.pump()
    assert handler.closed == [target]
    assert host.poll(0) == [b"\x07" * 16]
    with pytest.raises(TransportError):
        host.poll(0)
    host2, target2 = open_queue(fabric, handler)
    host2.close()
    assert handler.closed == [target, target2]


def test_tick_follows_the_clock(setup):
    fabric, handler, clock = setup
    fabric.pump()
    assert handler.ticks == []
    clock.advance(0.05)
    fabric.pump()
    assert handler.ticks == []
    clock.advance(0.1)
    fabric.pump()
    assert handler.ticks == [clock()]
    fabric.tick()
    assert len(handler.ticks) == 2


def test_listener_close_fails_its_queues(setup):
    fabric, handler, _ = setup
    host, target = open_queue(fabric, handler)
    listener = fabric._listeners[ADDR]
    listener.close()
    assert handler.closed == [target]
    with pytest.raises(TransportError):
        fabric.connector(ADDR).connect(0, 32, 31)
