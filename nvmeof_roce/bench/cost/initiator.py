"""Python cost of our initiator per 4 KiB read, without a target: `python3 -m nvmeof_roce.bench.cost.initiator`.

Two figures, each the wall time of a perf-style loop (QD commands kept in flight, each completion
resubmitting from its callback, `initiator/perf.py`) divided by the I/Os it completed:

- `controller`: Controller.submit_tagged and the completion path over a host queue that answers every
  capsule at once with a success CQE (the responder's own cost is measured alone and subtracted);
- `rdma_host`: the same through the real `RdmaHostQueue` code (send, inline staging, SendAccount, CQ drain,
  receive re-post) on a minimal fake QP and CQ that complete each SEND with a response. With python3-pyverbs
  installed (the lab guest) the work requests and WC objects are pyverbs' own, so their cost is in the figure;
  without it, plain stand-ins are used and the figure is a lower bound.

Not a test: it asserts nothing, it measures (docs/benchmarks.md, "Our initiator").  Its fakes are its own, but
like the other cost benchmarks it runs from a checkout (nvmeof_roce.bench.cost is left out of the wheel).
"""
from __future__ import annotations

import argparse
import collections
import json
import mmap
import sys
import time
import types

from nvmeof_roce.nvme.command import CQE_STRUCT
from nvmeof_roce.transport.contracts import HostBuffer, HostQueue

CID = __import__("struct").Struct("<H")


class InstantQueue(HostQueue):
    """Answers every capsule with a success CQE for its CID, at once."""

    def __init__(self, qid: int = 1):
        self.qid = qid
        self.crqsize = 1024
        self.cqes = []
        self._bufs = []

    def register(self, size: int) -> HostBuffer:
        buf = bytearray(size)
        self._bufs.append(buf)
        return HostBuffer(0x10000 * (len(self._bufs) + 1), 0x1234, memoryview(buf))

    def send(self, capsule) -> None:
        self.cqes.append(CQE_STRUCT.pack(0, 0, 0, self.qid, CID.unpack_from(capsule, 2)[0], 0))

    def poll(self, timeout: float) -> list:
        out = self.cqes
        self.cqes = []
        return out

    def close(self) -> None:
        pass


def _queue_of(transport, depth: int):
    from nvmeof_roce.initiator.controller import Controller, SlotQueue
    ctrl = Controller.__new__(Controller)
    ctrl.io_queues = [SlotQueue(transport, 1, depth, 4096, 0)]
    return ctrl, ctrl.io_queues[0]


def loop(ctrl, q, ios: int, depth: int) -> float:
    """Seconds per I/O of a perf-style loop of `ios` 4 KiB reads at `depth`."""
    left = [ios]
    submit = ctrl.submit_tagged
    started = [0.0] * depth
    clock = time.perf_counter
    lat = []

    def done(tag, status):
        lat.append(clock() - started[tag])
        if left[0] > 0:
            left[0] -= 1
            started[tag] = clock()
            submit(q, False, 1, tag * 8, 8, 4096, done, tag)

    t0 = clock()
    for tag in range(depth):
        left[0] -= 1
        started[tag] = clock()
        submit(q, False, 1, tag * 8, 8, 4096, done, tag)
    process = ctrl._process_queue
    while q.outstanding:
        process(q, 0.0)
    return (clock() - t0) / len(lat)


def responder_cost(ios: int) -> float:
    q = InstantQueue()
    capsule = bytes(64)
    t0 = time.perf_counter()
    for _ in range(ios):
        q.send(capsule)
        if len(q.cqes) >= 32:
            q.poll(0)
    return (time.perf_counter() - t0) / ios


# --- the real RdmaHostQueue on a minimal fake QP/CQ ---------------------------------------------------------

def _pyverbs():
    try:
        import pyverbs.enums as e
        from pyverbs.cq import WC
        return e, WC, True
    except ImportError:
        e = types.SimpleNamespace(IBV_WC_SUCCESS=0, IBV_SEND_SIGNALED=2, IBV_SEND_INLINE=8, IBV_WR_SEND=2,
                                  IBV_ACCESS_LOCAL_WRITE=1)

        class WC:
            __slots__ = ("wr_id", "status")

            def __init__(self, wr_id=0, status=0, **_):
                self.wr_id, self.status = wr_id, status
        return e, WC, False


def rdma_host_queue(depth: int):
    """An RdmaHostQueue whose QP and CQ are a few lines of Python: every SEND is answered by a response in the
    next posted receive (the CQE for the capsule's CID), and signaled SENDs complete."""
    from nvmeof_roce.transport.rdma import host as rh
    e, WC, real = _pyverbs()
    if not real:  # stand-ins for the names the host queue uses
        class SGE:
            __slots__ = ("addr", "length", "lkey")

            def __init__(self, addr, length, lkey):
                self.addr, self.length, self.lkey = addr, length, lkey

        class SendWR:
            def __init__(self, wr_id=0, opcode=0, num_sge=0, sg=None, send_flags=0):
                self.wr_id, self.send_flags, self.sg_list = wr_id, send_flags, (sg or [None])[0]
                self.next_wr = None

        class RecvWR:
            def __init__(self, wr_id=0, num_sge=0, sg=None):
                self.wr_id = wr_id
        rh.SGE, rh.SendWR, rh.RecvWR, rh.e = SGE, SendWR, RecvWR, e
        rh.SUCCESS, rh.SIGNALED = e.IBV_WC_SUCCESS, e.IBV_SEND_SIGNALED
        rh.INLINE, rh.INLINE_SIGNALED = e.IBV_SEND_INLINE, e.IBV_SEND_INLINE | e.IBV_SEND_SIGNALED
        rh.WR_LEAKS = True

    class Mem:
        def __init__(self, size):
            self.map = mmap.mmap(-1, max(size, mmap.PAGESIZE))
            self.view = memoryview(self.map)
            self.addr, self.lkey, self.rkey = 0x100000, 1, 2

    q = rh.RdmaHostQueue.__new__(rh.RdmaHostQueue)
    hrqsize = depth
    q.qid, q.closed, q._released, q.buffers, q.responses = 1, False, False, [], []
    q.recv_mem = Mem(hrqsize * rh.RESPONSE_SIZE)
    q.recv_wrs = [rh.RecvWR(wr_id=i, num_sge=1, sg=[rh.SGE(0, 16, 1)]) for i in range(hrqsize)]
    q.capsule_size = 64 + 4096
    q.send_mem = Mem(depth * q.capsule_size + rh.CHAIN * rh.INLINE_CAPSULE)
    q.stage = depth * q.capsule_size
    q.inline_max = rh.INLINE_CAPSULE
    sq_size = 2 * depth + 2
    q.sends = rh.SendAccount(sq_size, depth, min(rh.SIGNAL_INTERVAL, max(1, depth // 2)))
    q.slot_wrs = [rh._SendWR(1) for _ in range(depth)]
    q.connector = types.SimpleNamespace(timeout=5.0)
    data = Mem(depth * 4096)
    q.register = lambda size: HostBuffer(data.addr, data.rkey, data.view[:size])  # no MR without a device

    class FakeCQ:
        def __init__(self):
            self.wcs = collections.deque()

        def poll(self, n=1):
            out = []
            wcs = self.wcs
            while wcs and len(out) < n:
                out.append(wcs.popleft())
            return len(out), out

    class FakeQP:
        def __init__(self):
            self.posted = collections.deque(range(hrqsize))

        def post_recv(self, wr):
            self.posted.append(wr.wr_id)

        def post_send(self, wr):
            while wr is not None:  # a chain only with the stand-ins (pyverbs' next_wr getter cannot read one)
                self.one(wr)
                wr = None if real else wr.next_wr

        def one(self, wr):
            flags = wr.send_flags
            if not flags & e.IBV_SEND_INLINE:
                at = ((wr.wr_id - rh.SEND_WR_BASE) >> 16) * q.capsule_size
            else:
                at = q.inline_at if real else wr.sg_list.addr - q.send_mem.addr
            cid = CID.unpack_from(q.send_mem.map, at + 2)[0]
            if flags & e.IBV_SEND_SIGNALED:
                cq.wcs.append(WC(wr_id=wr.wr_id, status=0))
            slot = self.posted.popleft()
            start = slot * 16
            q.recv_mem.map[start:start + 16] = CQE_STRUCT.pack(0, 0, 0, 1, cid, 0)
            cq.wcs.append(WC(wr_id=slot, status=0))

    cq = FakeCQ()
    q.cq, q.qp = cq, FakeQP()
    q.held = None
    q.chain = rh._InlineChain(1, q.send_mem.addr + q.stage)
    q.inline_wr = q.chain.last
    q.inline_at = q.stage + (rh.CHAIN - 1) * rh.INLINE_CAPSULE
    if real:  # posted one by one: this fake cannot follow a real chain
        q.defer_sends = lambda: None
    return q, real


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ios", type=int, default=200_000, help="I/Os per measurement (default 200000)")
    p.add_argument("--depth", type=int, default=32, help="queue depth (default 32)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    out = {"ios": args.ios, "depth": args.depth}
    responder = responder_cost(args.ios)
    ctrl, q = _queue_of(InstantQueue(), args.depth)
    out["controller_us"] = round((loop(ctrl, q, args.ios, args.depth) - responder) * 1e6, 3)
    transport, real = rdma_host_queue(args.depth)
    ctrl, q = _queue_of(transport, args.depth)
    out["rdma_host_us"] = round(loop(ctrl, q, args.ios, args.depth) * 1e6, 3)
    out["pyverbs"] = "real" if real else "stand-ins (pyverbs' own costs left out)"
    if args.json:
        print(json.dumps(out))
    else:
        print(f"controller + perf loop: {out['controller_us']:.2f} us per 4 KiB read (QD {args.depth})")
        print(f"... through RdmaHostQueue on a fake QP/CQ: {out['rdma_host_us']:.2f} us ({out['pyverbs']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
