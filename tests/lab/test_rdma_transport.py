"""The RDMA transport itself, over real rxe: CM accept/reject with NVMe-oF private data,
capsules, RDMA READ of host data, RDMA WRITE chained with the response SEND, bad keys."""
import os
import struct
import threading
import time

import pytest

from nvmeof_roce.transport.contracts import Refusal
from nvmeof_roce.transport.rdma.sgl import keyed_data

pytestmark = pytest.mark.lab

LAB_IP = "10.99.0.1"
PORT = 4499


class EchoHandler:
    """A minimal target: opcode 1 stores the host's data (RDMA READ), opcode 2 returns it (RDMA WRITE)."""

    def __init__(self):
        self.stored = b""
        self.opened = []
        self.closed = []

    def check_connect(self, request):
        return Refusal.INVALID_QID if request.qid == 7 else None  # on the wire: CM reject STS 3

    def queue_opened(self, queue):
        self.opened.append(queue.qid)
        assert queue.connected()  # no NVMe Connect here: every queue counts as connected

    def queue_closed(self, queue):
        self.closed.append(queue.qid)

    def tick(self, now):
        pass

    def capsule_received(self, queue, capsule, tx=None):
        opc, cid = capsule[0], struct.unpack_from("<H", capsule, 2)[0]
        addr, = struct.unpack_from("<Q", capsule, 24)
        length = int.from_bytes(capsule[32:35], "little")
        key, = struct.unpack_from("<I", capsule, 35)
        desc = keyed_data(addr, key)  # the RDMA transport's data descriptor of a keyed SGL

        def respond(status=0, data=None):
            queue.complete(struct.pack("<IIHHHH", 0, 0, 0, queue.qid, cid, status << 1), data, desc, tx=tx)

        if opc == 1:
            def done(data, error):
                if error is not None:
                    respond(0x04)  # data transfer error
                    return
                self.stored = bytes(data)
                respond()
            queue.read_host(desc, length, done, tx)
        elif opc == 2:
            respond(0, self.stored[:length])
        else:
            respond(0x01)


@pytest.fixture
def target():
    from nvmeof_roce.transport.eventloop import EventLoop
    from nvmeof_roce.transport.rdma.cm import RdmaListener
    handler = EchoHandler()
    loop = EventLoop(handler)
    from nvmeof_roce.transport.resources import ResourceLimits
    handler.listener = RdmaListener(loop, LAB_IP, PORT, limits=ResourceLimits(data_buffers=16, queue_min_buffers=2))
    stop = threading.Event()
    thread = threading.Thread(target=loop.run, args=(stop.is_set,), daemon=True)
    thread.start()
    yield handler
    stop.set()
    thread.join(5)
    loop.close()


def capsule(opc, cid, buf=None, length=0, offset=0):
    sqe = bytearray(64)
    sqe[0], sqe[1] = opc, 0x40
    struct.pack_into("<H", sqe, 2, cid)
    if buf is not None:
        struct.pack_into("<Q", sqe, 24, buf.addr + offset)
        sqe[32:35] = length.to_bytes(3, "little")
        struct.pack_into("<I", sqe, 35, buf.key)
    sqe[39] = 0x40
    return bytes(sqe)


def wait_cqe(queue, timeout=10):
    cqes = queue.poll(timeout)
    assert cqes, "no response"
    return struct.unpack("<IIHHHH", cqes[0])


def test_capsules_rdma_read_and_write_over_rxe(target):
    from nvmeof_roce.transport.rdma.host import RdmaConnector
    conn = RdmaConnector(LAB_IP, PORT)
    queue = conn.connect(qid=1, hrqsize=32, hsqsize=31)
    assert queue.crqsize == 32
    buf = queue.register(128 * 1024)
    payload = os.urandom(100_000)
    buf.view[:len(payload)] = payload
    queue.send(capsule(1, 0x1234, buf, len(payload)))
    _, _, _, sqid, cid, status = wait_cqe(queue)
    assert (sqid, cid, status) == (1, 0x1234, 0)
    assert target.stored == payload
    buf.view[:len(payload)] = bytes(len(payload))
    queue.send(capsule(2, 0x2345, buf, len(payload), offset=0))
    _, _, _, sqid, cid, status = wait_cqe(queue)
    assert (cid, status) == (0x2345, 0)
    assert bytes(buf.view[:len(payload)]) == payload
    queue.close()
    conn.close()


def test_many_outstanding_commands(target):
    from nvmeof_roce.transport.rdma.host import RdmaConnector
    conn = RdmaConnector(LAB_IP, PORT)
    queue = conn.connect(qid=1, hrqsize=32, hsqsize=31)
    buf = queue.register(32 * 4096)
    for i in range(32):
        buf.view[i * 4096:(i + 1) * 4096] = bytes([i]) * 4096
        queue.send(capsule(1, i, buf, 4096, offset=i * 4096))
    seen = set()
    while len(seen) < 32:
        for cqe in queue.poll(10):
            seen.add(struct.unpack("<IIHHHH", cqe)[4])
    assert seen == set(range(32))
    queue.close()
    conn.close()


def test_more_commands_than_data_buffers_wait_for_one_and_all_complete(target):
    """The port has 16 data buffers: 100 outstanding reads returning data must queue for them."""
    from nvmeof_roce.transport.rdma.host import RdmaConnector
    conn = RdmaConnector(LAB_IP, PORT)
    queue = conn.connect(qid=1, hrqsize=128, hsqsize=127)
    buf = queue.register(4096)
    buf.view[:4096] = pattern = os.urandom(4096)
    queue.send(capsule(1, 1, buf, 4096))
    assert wait_cqe(queue)[5] == 0
    out = queue.register(100 * 4096)
    count = 100
    assert count > target.listener.pool.accounts.total
    for i in range(count):
        queue.send(capsule(2, 0x100 + i, out, 4096, offset=i * 4096))
    seen = set()
    while len(seen) < count:
        cqes = queue.poll(10)
        assert cqes, f"only {len(seen)} of {count} completed"
        for cqe in cqes:
            fields = struct.unpack("<IIHHHH", cqe)
            assert fields[5] == 0
            seen.add(fields[4])
    assert all(bytes(out.view[i * 4096:(i + 1) * 4096]) == pattern for i in range(count))
    queue.close()
    conn.close()


def test_reject_carries_the_nvmeof_status(target):
    from nvmeof_roce.transport.contracts import ConnectRejected
    from nvmeof_roce.transport.rdma.host import RdmaConnector
    conn = RdmaConnector(LAB_IP, PORT)
    with pytest.raises(ConnectRejected) as err:
        conn.connect(qid=7, hrqsize=32, hsqsize=31)
    assert err.value.status == 3
    conn.close()


def test_wrong_key_is_a_transfer_error_and_other_queues_go_on(target):
    from nvmeof_roce.transport.contracts import TransportError
    from nvmeof_roce.transport.rdma.host import RdmaConnector
    conn = RdmaConnector(LAB_IP, PORT)
    good = conn.connect(qid=1, hrqsize=32, hsqsize=31)
    bad = conn.connect(qid=2, hrqsize=32, hsqsize=31)
    buf = bad.register(4096)
    sqe = bytearray(capsule(1, 9, buf, 4096))
    struct.pack_into("<I", sqe, 35, buf.key ^ 0x00ABCD00)  # a key that is not ours
    bad.send(bytes(sqe))
    try:
        cqes = bad.poll(10)
        # the target answers Data Transfer Error or the connection dies: never success
        assert cqes and struct.unpack("<IIHHHH", cqes[0])[5] >> 1 == 0x04
    except TransportError:
        pass
    gbuf = good.register(4096)
    gbuf.view[:4] = b"good"
    good.send(capsule(1, 1, gbuf, 4))
    assert wait_cqe(good)[5] == 0
    assert target.stored == b"good"
    good.close()
    bad.close()
    conn.close()


def test_closing_one_queue_leaves_the_others_working(target):
    from nvmeof_roce.transport.rdma.host import RdmaConnector
    conn = RdmaConnector(LAB_IP, PORT)
    stays = conn.connect(qid=1, hrqsize=32, hsqsize=31)
    leaves = conn.connect(qid=2, hrqsize=32, hsqsize=31)
    leaves.close()
    buf = stays.register(4096)
    buf.view[:5] = b"alive"
    stays.send(capsule(1, 3, buf, 5))
    assert wait_cqe(stays)[5] == 0 and target.stored == b"alive"
    stays.close()
    conn.close()


def test_a_host_disconnect_closes_exactly_its_queue(target):
    """CM DISCONNECTED events all arrive on the listener's channel: each must close the queue it is for."""
    import time
    from nvmeof_roce.transport.rdma.host import RdmaConnector
    conn = RdmaConnector(LAB_IP, PORT)
    queues = [conn.connect(qid=q, hrqsize=8, hsqsize=7) for q in (1, 2, 3)]
    listener = target.listener
    free_before = listener.pool.accounts.free_count
    queues[1].close()  # the middle one: neither the first nor the last accepted
    started = time.monotonic()
    while 2 not in target.closed and time.monotonic() - started < 5:
        time.sleep(0.01)
    print(f"queue 2 released {time.monotonic() - started:.3f} s after the host's disconnect")
    assert target.closed == [2]
    assert listener.disconnects_attributed == 1
    assert len(listener.queues) == 2 and listener.pool.accounts.committed == 2 * 2
    assert listener.pool.accounts.free_count == free_before
    for q in (queues[0], queues[2]):  # the others still work
        buf = q.register(4096)
        q.send(capsule(1, 9, buf, 4096))
        assert wait_cqe(q)[5] == 0
        q.close()
    deadline = time.monotonic() + 5
    while len(listener.queues) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(target.closed) == [1, 2, 3] and not listener.queues
    assert listener.pool.accounts.committed == 0 and listener.pool.accounts.free_count == 16
    conn.close()


def test_no_pyverbs_object_per_command_and_every_request_ends_free(target):
    """pyverbs 44 never frees an SGE or SendWR: the target builds its work requests in the QP (QPEx) from one
    SGE per queue, and its requests all return to FREE once their responses' completions came back."""
    from pyverbs.qp import QPEx
    from pyverbs.wr import SGE
    from nvmeof_roce.transport.rdma.host import RdmaConnector
    from nvmeof_roce.transport.rdma.requests import State
    conn = RdmaConnector(LAB_IP, PORT)
    queue = conn.connect(qid=1, hrqsize=32, hsqsize=31)
    # The target (a thread of this process) accepts inside the queue's constructor and files the queue right
    # after: the host's connect can return in between.
    deadline = time.monotonic() + 5
    while not target.listener.queues and time.monotonic() < deadline:
        time.sleep(0.01)
    tq = list(target.listener.queues.values())[-1]  # the queue accepted last
    assert isinstance(tq.qp, QPEx) and isinstance(tq.sge, SGE)
    sge = tq.sge
    buf = queue.register(64 * 1024)
    for i in range(200):  # alternate reads and writes of varying sizes: the one SGE carries each one's values
        size = 512 * (1 + i % 64)
        data = os.urandom(size)
        buf.view[:size] = data
        queue.send(capsule(1, i, buf, size))
        assert wait_cqe(queue)[5] == 0 and target.stored == data
        buf.view[:size] = bytes(size)
        queue.send(capsule(2, i, buf, size))
        assert wait_cqe(queue)[5] == 0 and bytes(buf.view[:size]) == data
    assert tq.sge is sge and len(tq.book.requests) <= tq.recv_count
    deadline = time.monotonic() + 5  # the last response's send completion may still be on its way
    while tq.book.in_flight() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tq.book.in_flight() == 0 and all(r.state == State.FREE for r in tq.book.requests)
    queue.close()
    conn.close()
