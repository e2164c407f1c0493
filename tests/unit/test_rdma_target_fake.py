"""The RDMA target queue's real code (transport/rdma/queue.py with its RequestBook) on the fake device of
tests/unit/fakeverbs.py, with the plain-Python pyverbs stand-ins: the project's initiator connects, writes and
reads, and the test looks at what the transport did.  Runs in a child interpreter: the stand-ins replace pyverbs
in sys.modules."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Every child starts so: the stand-ins in place, then the project's imports (SETUP); CONNECT serves a target on the
# fake device and connects the project's initiator with one I/O queue, whose target side is `queue`.
SETUP = r"""
import sys
sys.path.insert(0, %(doubles)r); sys.path.insert(0, %(repo)r)
import fakeverbs
fakeverbs.install(prefer_real=False)
from nvmeof_roce.bench.cost import transport as tc
from nvmeof_roce.config import parse_config
from nvmeof_roce.initiator.controller import Controller
from nvmeof_roce.service.serve import TargetServer
"""
CONNECT = r"""
server = TargetServer(parse_config(tc.config_dict(), source="test"), data_path="python")  # the Python transport
ctrl = Controller.connect(tc.FakeConnector(server.loop), tc.SUBNQN, hostnqn=tc.HOSTNQN, num_io_queues=1,
                          queue_size=32, enable_aen=False)
listener = server.loop.listeners[0]
queue = [q for q in listener.queues.values() if q.qid == 1][0]
"""


def run_child(body: str) -> None:
    """Run SETUP + body in a child interpreter; it must end by printing ok."""
    code = (SETUP + body) % {"doubles": str(REPO / "tests" / "unit"), "repo": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:] + proc.stdout[-2000:]


CHILD = r"""from nvmeof_roce.transport.rdma.requests import SIGNAL_EVERY, State
import pyverbs.enums as e

# count the send completions the target's CQs produce
sends = []
push = fakeverbs.CQ.push
def counting_push(self, wr_id, status, opcode, byte_len=0, qp_num=0):
    if opcode == e.IBV_WC_SEND:
        sends.append(wr_id)
    return push(self, wr_id, status, opcode, byte_len, qp_num)
fakeverbs.CQ.push = counting_push
""" + CONNECT + r"""pool = listener.pool.accounts
data = bytes(range(256)) * 16
ctrl.write(1, 8, data)  # an RDMA READ of the host's data
assert ctrl.read(1, 8, 8) == data  # an RDMA WRITE from the RAM namespace's own registration
assert len(listener.regions) == 1 and list(listener.regions.values())[0][2] is not None  # (backend, mapping, found, MR)
backend = server.target.subsystems[tc.SUBNQN].namespaces[1].backend
assert backend.pinned

# 31 reads in one wake-up: one doorbell, the responses retired by a few signaled SENDs, no chunk taken
host = ctrl.io_queues[0].transport
buf = host.register(4096 * 31)
capsules = tc.read_capsules(31, buf.addr, buf.key)
end = host.end
sends.clear()
free_before = pool.free_count
for c in capsules:
    end.send(c)
while len(end.responses) < 31:
    server.loop.run_once(0)
assert len(end.responses) == 31
assert pool.free_count == free_before  # RAM reads take no data buffer
assert 1 <= len(sends) <= 31 // SIGNAL_EVERY + 1, sends  # every 16th and the last SEND signaled
server.loop.run_once(0)  # the send completions
assert queue.book.in_flight() == 0 and all(r.state == State.FREE for r in queue.book.requests)
assert server.target.in_flight() == 0
# each read delivered its blocks (read_capsules: command i reads LBA 8 i): cid 1 the data written above
assert all(bytes(buf.view[i * 4096:(i + 1) * 4096]) == backend.read(i * 8 * 512, 4096) for i in range(31))
assert bytes(buf.view[4096:8192]) == data
server.close()
print("ok")
"""


def test_reads_and_writes_through_the_rdma_target_queue_on_the_fake_device():
    run_child(CHILD)


CLOSED_IN_THE_SAME_PASS = r"""
import logging, os

failures = []
class Catch(logging.Handler):
    def emit(self, record):
        if record.exc_info:
            failures.append(repr(record.exc_info[1]))
logging.getLogger("nvmeof_roce").addHandler(Catch())

""" + CONNECT + r"""host = ctrl.io_queues[0].transport
buf = host.register(4096)

# What a CM DISCONNECTED does (RdmaListener._on_cm_events closes the queue), ready in the same pass as the
# queue's completion channel, and served first (epoll reports fds in the order they became ready).
closer_r, closer_w = os.pipe()
def disconnected():
    os.read(closer_r, 1)
    queue.peer_gone = True
    queue.close()
server.loop.watch(closer_r, disconnected)
os.write(closer_w, b"d")
host.end.send(tc.read_capsules(1, buf.addr, buf.key)[0])
server.loop.run_once(1.0)
assert queue.closed
queue._on_cq_event()  # a late call on the closed queue touches no verbs object either
server.loop.run_once(0)
assert not failures, failures
server.loop.unwatch(closer_r)
server.close()
print("ok")
"""


def test_a_queue_closed_while_its_completion_fd_is_ready_in_the_same_pass_is_not_served():
    """The 6.12 lab tier's target died once with SIGSEGV after a disconnect: its completion handler ran on a
    queue that a CM event had closed in the same loop pass (pyverbs 44 then polls a NULL channel).  The fake
    device raises where pyverbs would crash."""
    run_child(CLOSED_IN_THE_SAME_PASS)


A_TEARDOWN_STEP_FAILS = r"""
import logging

logged = []
class Catch(logging.Handler):
    def emit(self, record):
        logged.append(record.getMessage())
logging.getLogger("nvmeof_roce").addHandler(Catch())

""" + CONNECT + r"""destroyed = listener.cm_ids_destroyed
def broken():
    raise OSError("deregistering the receive buffers failed")
queue.recv_mem.close = broken
server.loop.run_once(0)  # the Connect's send completion: no response is left to leave, the close is at once
queue.close()
assert queue not in listener.queues.values() and listener.cm_ids_destroyed == destroyed + 1
assert queue.share.closed
assert any("releasing its receive buffers failed" in m for m in logged), logged
server.close()
print("ok")
"""


def test_a_failing_teardown_step_does_not_keep_the_queue_or_its_cm_id():
    """Closing a queue releases its requests, its buffer share, its receive buffers and its CM id; one step that
    fails is logged and the others still happen (the listener must not keep a dead queue and its CM id)."""
    run_child(A_TEARDOWN_STEP_FAILS)


STATUS = CONNECT + r"""from nvmeof_roce.control.stats import target_status
listeners = target_status(server.target, None, server)["transport"]["listeners"]
assert listeners == [{"address": "10.0.0.1:4420", "portid": 1, "queues": 2, "wc_errors": None,
                      "pool": {"chunks": 1024, "free": 1024, "in_use": 0, "guaranteed": 2}}], listeners
assert "10.0.0.1:4420: 2 queues (2 connected)" in server.status_line()
server.close()
print("ok")
"""


def test_the_python_paths_qp_reaches_rts_with_a_finite_rnr_retry():
    """The CM's RTS attributes carry the host's REQ's RNR retry count (7, for ever: the fake CM's, as a Linux
    host's); the Python data path's QP is its own and reaches RTS with verbs.RNR_RETRY (6) instead, the ACK
    timeout bounded and the rest as the CM computed it."""
    run_child(CONNECT + r"""from nvmeof_roce.transport.rdma.verbs import ACK_TIMEOUT, QPS_RTS, RNR_RETRY
attr, mask = queue.qp.modified[QPS_RTS]
assert attr["rnr_retry"] == RNR_RETRY == 6, attr
assert mask & (1 << 11)  # IBV_QP_RNR_RETRY: the CM's mask sets it
assert queue.cm_id.qp_attr(QPS_RTS)[0]["rnr_retry"] == 7  # what the CM would have set
assert 0 < attr["timeout"] <= ACK_TIMEOUT and attr["max_rd_atomic"] == queue.max_reads
print("ok")
""")


def test_the_listener_reports_its_queues_and_pool_in_target_status():
    """`target status` shows each RDMA listener's figures (transport/contracts.py Listener.status)."""
    run_child(STATUS)


LEGACY = r"""import errno
import nvmeof_roce.transport.rdma.queue as R

# a device without the extended QP API, as siw: ibv_create_qp_ex with send_ops_flags fails with EOPNOTSUPP
def no_extended_qp(*args, **kwargs):
    raise R.PyverbsRDMAError("Failed to create QP. Errno: 95, Operation not supported", errno.EOPNOTSUPP)
R.QPEx = no_extended_qp
posted = []
post_send = fakeverbs.QP.post_send
def recording_post_send(self, wr, bad_wr=None):
    posted.extend(fakeverbs.send_chain(wr))
    return post_send(self, wr, bad_wr)
fakeverbs.QP.post_send = recording_post_send
""" + CONNECT + r"""import pyverbs.enums as e
assert isinstance(queue.poster, R.LegacyPoster) and not queue.remote_invalidate
data = bytes(range(256)) * 64
ctrl.write(1, 0, data)                    # RDMA READ of the host's data through a ring WR
assert ctrl.read(1, 0, 32) == data        # RDMA WRITE, then the inline SEND
for i in range(40):                       # more commands than the ring has WRs: every one reused
    block = bytes([i]) * 4096
    ctrl.write(1, 8 * i, block)
    assert ctrl.read(1, 8 * i, 8) == block
opcodes = {w.opcode for w in posted}
assert opcodes == {e.IBV_WR_RDMA_READ, e.IBV_WR_RDMA_WRITE, e.IBV_WR_SEND}, opcodes
assert all(w.opcode != e.IBV_WR_SEND_WITH_INV for w in posted)
assert len({id(wr) for wr in queue.poster.wrs}) == queue.max_send_wr  # made once, at accept
server.loop.run_once(0)  # the last send completions
assert server.target.in_flight() == 0
server.close()
print("ok")
"""


def test_a_device_without_the_extended_qp_api_is_served_through_plain_post_send():
    run_child(LEGACY)


CLOSED_MID_BATCH = r"""import logging
failures = []
class Catch(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.ERROR:
            failures.append(record.getMessage())
logging.getLogger("nvmeof_roce").addHandler(Catch())
""" + CONNECT + r"""host = ctrl.io_queues[0].transport
end = host.end
end.send(b"\x00" * 10)  # a capsule shorter than 64 bytes: the target closes the queue at once
buf = host.register(4096)
end.send(tc.read_capsules(1, buf.addr, buf.key)[0])  # a second receive completion in the same poll
for _ in range(5):
    server.loop.run_once(0)
assert queue.closed
assert not failures, failures  # the second completion was not served from the released receive ring
server.close()
print("ok")
"""


def test_a_completion_that_closes_the_queue_ends_the_poll_batch():
    run_child(CLOSED_MID_BATCH)


DISCONNECT_IN_A_BATCH = CONNECT + r"""from nvmeof_roce.nvme import fabrics as F
from nvmeof_roce.nvme.command import CQE
host = ctrl.io_queues[0].transport
buf = host.register(4096 * 8)
end = host.end
backend = server.target.subsystems[tc.SUBNQN].namespaces[1].backend
reads = tc.read_capsules(8, buf.addr, buf.key)
for capsule in reads:
    end.send(capsule)
end.send(F.DisconnectCommand(cid=100).to_sqe().pack())  # in the same receive poll as the reads
for _ in range(5):
    server.loop.run_once(0)
cids = sorted(CQE.unpack(r).cid for r in end.responses)
assert cids == list(range(8)) + [100], cids  # every Read answered, and the Disconnect
assert all(CQE.unpack(r).status == 0 for r in end.responses)
assert all(bytes(buf.view[i * 4096:(i + 1) * 4096]) == backend.read(i * 8 * 512, 4096) for i in range(8))
assert queue.closed and end.disconnected  # then the queue closed
assert queue not in listener.queues.values()
server.close()
print("ok")
"""


def test_responses_batched_before_a_disconnect_are_sent_before_the_queue_closes():
    """Reads and a Disconnect in one receive poll: the Reads' responses and the Disconnect's own leave before the
    queue closes (nvmet sends the Disconnect's response, then tears the queue down)."""
    run_child(DISCONNECT_IN_A_BATCH)


LISTENER_CLOSED_WITH_A_RESPONSE_ON_THE_WIRE = CONNECT + r"""host = ctrl.io_queues[0].transport
buf = host.register(4096)
host.end.send(tc.read_capsules(1, buf.addr, buf.key)[0])
server.loop.run_once(0)  # the Read answered; its send completion not polled yet
assert queue.book.completing() == 1
server.listeners.remove(listener)
listener.close()  # the listener goes (its port's last subsystem unlinked): its queues with it, at once
assert queue.closed and queue not in listener.queues.values(), (queue.closed, queue.closing)
server.close()
print("ok")
"""


def test_a_closing_listener_ends_its_queues_at_once_even_with_responses_on_the_wire():
    """Only an orderly close of one queue waits for its responses' send completions; a listener that closes (the
    target stopping, its port's last subsystem unlinked) ends its queues before it releases the memory they use."""
    run_child(LISTENER_CLOSED_WITH_A_RESPONSE_ON_THE_WIRE)
