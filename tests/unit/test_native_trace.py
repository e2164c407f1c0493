"""The native data path's per-command trace (csrc/trace.c, transport/rdma/native_trace.py) on the fake verbs
provider: with it on, a Read and a Write record their whole sequence of events and print the Python data path's
trace lines; off, nothing is recorded; on and off for open queues and those to come (`--trace`, the RPC)."""
import logging
import re

import pytest

from loopback_env import SUB_RAM, standard_config
from native_diff import NativeEndpoint, io_capsule, pattern
from native_fake import needs_native

from nvmeof_roce.control.methods import Control
from nvmeof_roce.control.protocol import RpcError
from nvmeof_roce.transport.rdma import native_trace as T

pytestmark = needs_native

READ, WRITE = 0x02, 0x01
WIRE = "nvmeof_roce.transport.rdma.queue.wire"


@pytest.fixture
def ep():
    endpoint = NativeEndpoint(standard_config(), SUB_RAM)
    yield endpoint
    T.TRACING.set_enabled(False)
    endpoint.close()


def record_only(ep, records=T.RECORDS):
    """The C queue records; the Python side does not take the records at each poll (the test does)."""
    ep.queue.native.set_trace(records)


def events(ep):
    """(event, cid, opcode, nsid, status, length, addr, key, flags) of each record taken from the C queue."""
    taken = ep.queue.native.take_trace()
    assert taken is not None, "the trace is off"
    _qp, dropped, data = taken
    assert dropped == 0
    return [(event, cid, opc, nsid, status, length, addr, key, flags)
            for (_ns, addr, length, nsid, key, cid, status, event, opc, flags) in T.RECORD.iter_unpack(data)]


def test_a_read_and_a_write_record_their_whole_sequence(ep):
    record_only(ep)
    ep.buf.view[65536:65536 + 4096] = pattern(4096, seed=5)
    (r,) = ep.exchange(io_capsule(ep, READ, 1, 8, 7, 4096, offset=0, cid=10))
    (w,) = ep.exchange(io_capsule(ep, WRITE, 1, 64, 7, 4096, offset=65536, cid=11, sgl_id=0x4F))
    assert r[14:16] == w[14:16] == b"\0\0"
    addr, key = ep.buf_addr, ep.buf_key
    assert events(ep) == [
        (T.RECEIVED, 10, READ, 1, 0, 64, 0, 0, 0),
        (T.DATA_POSTED, 10, 0, 0, 0, 4096, addr, key, 0),  # the RDMA WRITE of the data, chained to
        (T.RESPONSE_POSTED, 10, 0, 0, 0, 0, 0, 0, 0),       # the response SEND
        (T.RESPONSE_DONE, 10, READ, 1, 0, 0, 0, 0, 0),
        (T.RECEIVED, 11, WRITE, 1, 0, 64, 0, 0, 0),
        (T.DATA_POSTED, 11, WRITE, 1, 0, 4096, addr + 65536, key, T.FLAG_RDMA_READ),
        (T.DATA_DONE, 11, WRITE, 1, 0, 4096, 0, 0, 0),
        (T.RESPONSE_POSTED, 11, 0, 0, 0, 0, 0, key, T.FLAG_INVALIDATE),  # SEND with Invalidate
        (T.RESPONSE_DONE, 11, WRITE, 1, 0, 0, 0, 0, 0),
    ]


def test_the_lines_are_the_python_paths_in_order(ep, caplog):
    caplog.set_level(logging.DEBUG, logger=WIRE)
    ep.queue.set_trace(T.RECORDS)
    (r,) = ep.exchange(io_capsule(ep, READ, 1, 8, 7, 4096, offset=0, cid=4, sgl_id=0x4F))
    (w,) = ep.exchange(io_capsule(ep, WRITE, 1, 100, 1, 1024, sgl_id=0x01, offset=0, cid=5,
                                  extra=pattern(1024, seed=1)))
    text = [re.sub(r"^\d+\.\d{6} ", "", rec.getMessage()) for rec in caplog.records if rec.name == WIRE]
    qp = "qp 0x0 qid 1: "
    # as tests/twonode/test_two_node.py reads them: capsule, its transfers, its response (then our own lines)
    assert text == [qp + "capsule 64 B opc 0x02 cid 4",
                    qp + f"RDMA WRITE va {ep.buf_addr:#x} rkey {ep.buf_key:#x} len 4096",
                    qp + f"SEND response cid 4 with invalidate rkey {ep.buf_key:#x}",
                    qp + "response done cid 4 status 0x0",
                    qp + "capsule 1088 B opc 0x01 cid 5",
                    qp + "SEND response cid 5",
                    qp + "response done cid 5 status 0x0"]
    assert all(re.match(r"\d+\.\d{6} qp ", rec.getMessage()) for rec in caplog.records if rec.name == WIRE)


def test_a_command_for_the_core_is_recorded_as_handed_over_and_answered(ep):
    record_only(ep)
    (cqe,) = ep.exchange(io_capsule(ep, READ, 9, 0, 0, 512, cid=21))  # no namespace 9: the core's error
    assert int.from_bytes(cqe[14:16], "little") >> 1 == 0x400B
    got = events(ep)
    assert [e[:2] for e in got] == [(T.RECEIVED, 21), (T.TO_CORE, 21), (T.RESPONSE_POSTED, 21)]
    assert got[1][2:4] == (READ, 9) and got[2][4] == 0x400B


def test_off_nothing_is_recorded(ep, caplog):
    caplog.set_level(logging.DEBUG, logger=WIRE)
    assert ep.queue.native.take_trace() is None and not ep.queue.tracing
    ep.exchange(io_capsule(ep, READ, 1, 8, 7, 4096, cid=3))
    assert ep.queue.native.take_trace() is None
    assert not [rec for rec in caplog.records if rec.name == WIRE]
    ep.queue.set_trace(T.RECORDS)
    ep.queue.set_trace(0)
    ep.exchange(io_capsule(ep, READ, 1, 8, 7, 4096, cid=3))
    assert ep.queue.native.take_trace() is None


def test_a_full_ring_drops_events_not_commands(ep):
    record_only(ep, 4)
    for cid in range(8):
        (cqe,) = ep.exchange(io_capsule(ep, READ, 1, cid * 8, 7, 4096, offset=cid * 4096, cid=cid))
        assert cqe[14:16] == b"\0\0"
    qp, dropped, data = ep.queue.native.take_trace()
    assert len(data) == 4 * T.RECORD.size and dropped == 8 * 4 - 4
    lines = list(T.lines(1, (qp, dropped, data)))
    assert lines[0] == f"qp {qp:#x} qid 1: {dropped} trace events dropped (the ring was full)"


def test_set_trace_refuses_a_ring_too_large(ep):
    with pytest.raises(ValueError, match="set_trace: .* records; 0 \\(off\\) to"):
        ep.queue.native.set_trace(1 << 30)


def test_the_rpc_turns_it_on_for_open_queues_and_those_to_come(ep):
    control = Control(ep.env.target)
    assert control.call("trace_enable_tpoint_group", {"name": "nvmf_rdma"}) is True
    assert ep.queue.tracing and T.TRACING.enabled
    late = NativeEndpoint(standard_config(), SUB_RAM)
    try:
        assert late.queue.tracing  # a queue opened while it is on
    finally:
        late.close()
    assert control.call("trace_disable_tpoint_group", {"name": "all"}) is True
    assert not ep.queue.tracing and ep.queue.native.take_trace() is None
    with pytest.raises(RpcError, match="no tracepoint group 'bdev'"):
        control.call("trace_enable_tpoint_group", {"name": "bdev"})
    with pytest.raises(RpcError, match="missing parameter 'name'"):
        control.call("trace_enable_tpoint_group", {})


def test_serve_takes_the_declared_option_and_refuses_it_on_the_python_path():
    from nvmeof_roce.cli import build_parser
    from nvmeof_roce.errors import NvmeofError
    from nvmeof_roce.service.serve import check_trace
    from nvmeof_roce.tunables import TRACE
    parser = build_parser()
    assert parser.parse_args(["target", "serve", "x.json"]).trace == TRACE.default == "off"
    assert parser.parse_args(["target", "serve", "x.json", "--trace", "on"]).trace == "on"
    assert check_trace("on", "native") == "on" and check_trace("off", "python") == "off"
    with pytest.raises(NvmeofError, match="--trace on traces the native data path") as refused:
        check_trace("on", "python")
    assert "--data-path native" in refused.value.fix
    with pytest.raises(NvmeofError, match="--trace sometimes: not a choice"):
        check_trace("sometimes", "native")


def test_poll_group_threads_record_while_the_loop_takes(caplog):
    # the ring's one writer is the queue's thread, its one reader the loop: every event arrives, in order per queue
    from nvmeof_roce import native
    from nvmeof_roce.transport.eventloop import EventLoop
    from nvmeof_roce.transport.rdma.pollgroups import PollGroups
    caplog.set_level(logging.DEBUG, logger=WIRE)
    eps = [NativeEndpoint(standard_config(), SUB_RAM) for _ in range(2)]
    loop = EventLoop(eps[0].env.target)
    groups = PollGroups(native.module, 2)
    try:
        for ep in eps:
            ep.queue.start_polling(loop, "busy", poll_groups=groups)
        T.TRACING.set_enabled(True)  # while the threads poll
        assert all(ep.queue.tracing for ep in eps)
        per_round, rounds = 16, 4
        per_queue = per_round * rounds
        for r in range(rounds):  # 16 at a time: the queue's receives
            for ep in eps:
                for cid in range(r * per_round, (r + 1) * per_round):
                    assert ep.device.deliver(io_capsule(ep, READ, 1, 8 * cid, 7, 4096, offset=4096 * cid,
                                                        cid=cid)) == 0
            answered = {id(ep): 0 for ep in eps}
            for _ in range(6000):  # a hang guard, no timing
                loop.run_once(0.01)
                for ep in eps:
                    ep.queue.log_trace()
                    answered[id(ep)] += len(ep.device.responses())
                if all(n == per_round for n in answered.values()):
                    break
            assert all(n == per_round for n in answered.values()), answered
        for ep in eps:
            ep.queue.log_trace()
    finally:
        T.TRACING.set_enabled(False)
        for ep in eps:
            ep.close()
        groups.close()
        loop.close()
    text = [rec.getMessage() for rec in caplog.records if rec.name == WIRE]
    assert not [t for t in text if "dropped" in t]
    for cid in range(per_queue):
        assert sum(t.endswith(f": capsule 64 B opc 0x02 cid {cid}") for t in text) == 2
        assert sum(t.endswith(f": SEND response cid {cid}") for t in text) == 2
