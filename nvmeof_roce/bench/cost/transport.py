"""Python µs per 4 KiB read through the userspace target: the RDMA transport with the target core, and the
target core alone. A benchmark, not a test: it prints figures and asserts nothing about them.

    python3 -m nvmeof_roce.bench.cost.transport [--reads N] [--batch B] [--rounds R] [--json]
    make bench-transport               (in the lab: lab run -- python3 -m nvmeof_roce.bench.cost.transport)

It runs from a checkout: the fake RDMA device is the unit tier's (tests/unit/fakeverbs.py).

rdma: the real `nvmeof-roce target serve` stack (TargetServer: Target, EventLoop, RdmaListener and its
    queues) on a fake RDMA device (tests/unit/fakeverbs.py). The host end is the project's own initiator for
    the setup (connect, enable, identify, an I/O queue, a 4 KiB write read back and compared); then each
    read capsule is delivered into the target queue's next receive buffer and the target's event loop runs
    once per batch: receive completion -> core -> RDMA WRITE of the data -> response SEND; then it runs until
    idle, so a wake-up for the send completions (if the transport asks for one) is counted as on a NIC, where
    at QD1 the SEND completes long before the next capsule arrives. Nothing below the transport's public entry points is touched, so a change in how the
    transport posts or polls is measured as it is. The fake device's own time is measured inside its calls
    and subtracted (`device_us_per_read` shows it).
core: the same Target on the loopback fabric for the setup; then each read capsule goes straight to the
    handler's capsule_received() with the queue's complete() doing nothing: the core's share.

With python3-pyverbs installed (the lab guest) the transport's work requests, scatter entries and work
completions are real pyverbs objects (their cost, and their leaks, are the point); without it plain-Python
stand-ins are used and the output says so (`pyverbs: stand-ins`): that figure leaves pyverbs' costs out.
`malloc_bytes_per_read` is the C heap still in use after the timed reads (glibc mallinfo2, after a garbage
collection) divided by their number: what pyverbs objects leak shows here exactly; `rss_bytes_per_read` is the
VmRSS growth, which hides small leaks in already resident heap until there are tens of thousands of reads.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

from nvmeof_roce.bench.cost import use_test_doubles

use_test_doubles()
import fakeverbs  # noqa: E402  (must be installed before the transport is imported)

TRADDR, TRSVCID = "10.0.0.1", 4420
SUBNQN = "nqn.2024-01.io.nvmeof-roce:transport-cost"
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000c0571"
BLOCK = 512
READ_BYTES = 4096


def config_dict() -> dict:
    return {"hosts": [],
            "ports": [{"portid": 1, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": TRADDR,
                                             "trsvcid": str(TRSVCID)}, "subsystems": [SUBNQN]}],
            "subsystems": [{"nqn": SUBNQN, "attr": {"allow_any_host": "1"},
                            "namespaces": [{"nsid": 1, "nvmeof_roce": {"backend": "ram", "size": "16M",
                                                                       "block_size": BLOCK}}]}]}


def read_capsules(depth: int, addr: int, key: int, invalidate: bool = True):
    """One 4 KiB read capsule per command id, each into its own 4 KiB of host memory (keyed SGL, with
    remote invalidation as the kernel host asks)."""
    from nvmeof_roce.nvme.nvm import read_command
    from nvmeof_roce.nvme.sgl import SglDescriptor
    nlb = READ_BYTES // BLOCK - 1
    return [read_command(cid, 1, (cid * 8) % 4096, nlb,
                         SglDescriptor.keyed(addr + cid * READ_BYTES, READ_BYTES, key, invalidate)).to_sqe().pack()
            for cid in range(depth)]


def vmrss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_in_use() -> Optional[int]:
    """Bytes the C heap has handed out and not had back (glibc mallinfo2: uordblks + hblkhd), or None. Python's
    own small objects live in pymalloc's arenas, outside it, so this shows what C code (pyverbs) keeps."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    info = fn()
    return info.uordblks + info.hblkhd


def _instrumentation_overhead(n: int = 200_000) -> float:
    """Seconds per timed fake-device call that the device account does not see (the timer calls themselves)."""
    probe = fakeverbs.DeviceTime()
    perf = time.perf_counter
    t0 = perf()
    for _ in range(n):
        t = perf()
        probe.add(t)
    total = perf() - t0
    return max(0.0, (total - probe.spent) / n)


# --- the RDMA transport on the fake device ------------------------------------------------------------------

class FakeHostQueue:
    """A HostQueue (transport/contracts.py) on the fake device, for the project's initiator; poll() runs the
    target's event loop, since both ends live in this process."""

    def __init__(self, loop, qid: int, hrqsize: int, hsqsize: int, cntlid: int):
        from nvmeof_roce.nvme import cm
        from nvmeof_roce.transport.contracts import ConnectRejected, TransportError
        self.loop = loop
        self.qid = qid
        self.buffers = []
        self.end = fakeverbs.connect(TRADDR, TRSVCID, cm.CmConnectRequest(0, qid, hrqsize, hsqsize, cntlid).pack())
        for _ in range(100):
            if self.end.qp is not None or self.end.reject_data is not None:
                break
            loop.run_once(0)
        if self.end.reject_data is not None:
            raise ConnectRejected(cm.CmReject.unpack(self.end.reject_data).sts)
        if self.end.qp is None:
            raise TransportError(f"queue {qid}: the target did not accept")
        self.crqsize = cm.CmAccept.unpack(self.end.accept_data).crqsize

    def register(self, size: int):
        from nvmeof_roce.transport.contracts import HostBuffer
        buf, addr, key = fakeverbs.register_host_memory(size)
        self.buffers.append(buf)
        return HostBuffer(addr, key, memoryview(buf).cast("B")[:size])

    def send(self, capsule) -> None:
        self.end.send(bytes(capsule))

    def poll(self, timeout: float) -> list:
        deadline = time.monotonic() + timeout
        while True:
            self.loop.run_once(0)
            if self.end.responses:
                out = list(self.end.responses)
                self.end.responses.clear()
                return out
            if time.monotonic() >= deadline:
                return []

    def close(self) -> None:
        self.end.disconnected = True


class FakeConnector:
    def __init__(self, loop):
        self.loop = loop

    def connect(self, qid: int, hrqsize: int, hsqsize: int, cntlid: int = 0):
        return FakeHostQueue(self.loop, qid, hrqsize, hsqsize, cntlid)


def _check_cqes(cqes, expected: int, count=None, sent=None) -> None:
    from nvmeof_roce.nvme.command import CQE
    if count is not None and count != sent:
        raise SystemExit(f"transport_cost: {count} completions for {sent} reads")
    if len(cqes) != expected:
        raise SystemExit(f"transport_cost: {len(cqes)} completions for {expected} reads")
    bad = [c for c in (CQE.unpack(x) for x in cqes) if c.status]
    if bad:
        raise SystemExit(f"transport_cost: {len(bad)} reads failed, the first with status {bad[0].status:#x}")


def bench_rdma(reads: int, batch: int, rounds: int, depth: int) -> dict:
    from nvmeof_roce.config import parse_config
    from nvmeof_roce.initiator.controller import Controller
    from nvmeof_roce.service.serve import TargetServer

    server = TargetServer(parse_config(config_dict(), source="transport_cost"), data_path="python")
    try:
        ctrl = Controller.connect(FakeConnector(server.loop), SUBNQN, hostnqn=HOSTNQN, num_io_queues=1,
                                  queue_size=depth, enable_aen=False)
        # the data path both ways, checked: a write (RDMA READ) read back (RDMA WRITE)
        pattern = bytes((i * 7 + 3) & 0xFF for i in range(READ_BYTES))
        for slba in range(0, 4096, 8):
            ctrl.write(1, slba, pattern)
        if ctrl.read(1, 0, READ_BYTES // BLOCK - 1 + 1) != pattern:
            raise SystemExit("transport_cost: the data read back is not what was written")
        host = ctrl.io_queues[0].transport
        qdepth = ctrl.io_queues[0].depth
        batch = min(batch, qdepth - 1)
        buf = host.register(READ_BYTES * batch)
        capsules = read_capsules(batch, buf.addr, buf.key)
        end, loop = host.end, server.loop

        def one_round(n: int):
            """n reads; returns how many completions came back and the last batch's (kept aside, not
            accumulated, so the round's own garbage does not show as RSS growth)."""
            done = completions = 0
            last = []
            while done < n:
                k = min(batch, n - done)
                for c in range(k):
                    end.send(capsules[c])
                while len(end.responses) < k:
                    loop.run_once(0)
                while loop.run_once(0):  # what the device completed after the responses (a SEND's completion):
                    pass  # on a NIC it comes long before the next capsule at QD1, so it costs its own wake-up
                completions += len(end.responses)
                last = list(end.responses)
                end.responses.clear()
                done += k
            return completions, last

        warm = max(batch, reads // 10)
        count, last = one_round(warm)  # warm-up: pools, caches
        _check_cqes(last, len(last), count, warm)
        if bytes(buf.view[:READ_BYTES]) != pattern:
            raise SystemExit("transport_cost: a timed read did not deliver the namespace's data")
        overhead = _instrumentation_overhead()
        per_read, device, rss, heap = [], [], [], []
        for _ in range(rounds):
            gc.collect()
            heap0 = malloc_in_use()
            rss0, dev0, calls0 = vmrss(), fakeverbs.DEVICE.spent, fakeverbs.DEVICE.calls
            t0 = time.perf_counter()
            count, last = one_round(reads)
            wall = time.perf_counter() - t0
            dev = fakeverbs.DEVICE.spent - dev0 + overhead * (fakeverbs.DEVICE.calls - calls0)
            rss.append((vmrss() - rss0) / reads)
            gc.collect()
            heap1 = malloc_in_use()
            if heap0 is not None and heap1 is not None:
                heap.append((heap1 - heap0) / reads)
            _check_cqes(last, len(last), count, reads)
            per_read.append((wall - dev) * 1e6 / reads)
            device.append(dev * 1e6 / reads)
        invalidated = end.invalidated
        return {"us_per_read": statistics.median(per_read), "rounds_us": [round(x, 2) for x in per_read],
                "device_us_per_read": statistics.median(device), "rss_bytes_per_read": statistics.median(rss),
                "malloc_bytes_per_read": statistics.median(heap) if heap else None,
                "batch": batch, "queue_depth": qdepth, "send_with_invalidate": invalidated > 0}
    finally:
        server.close()


# --- the target core alone ------------------------------------------------------------------------------------

class _Capture:
    """A QueueHandler in front of the target's port handler that remembers the queues it sees."""

    def __init__(self, handler):
        self.handler = handler
        self.queues = []
        self.in_capsule_size = handler.in_capsule_size

    def queue_opened(self, queue):
        self.queues.append(queue)
        self.handler.queue_opened(queue)

    def __getattr__(self, name):
        return getattr(self.handler, name)


def bench_core(reads: int, rounds: int, depth: int) -> dict:
    from nvmeof_roce.config import parse_config
    from nvmeof_roce.initiator.controller import Controller
    from nvmeof_roce.engine.core import Target
    from nvmeof_roce.transport.loopback import LoopbackFabric

    target = Target(parse_config(config_dict(), source="transport_cost"))
    fabric = LoopbackFabric()
    handler = target.port(1)
    capture = _Capture(handler)
    address = f"{TRADDR}:{TRSVCID}"
    fabric.listen(address, capture)
    ctrl = Controller.connect(fabric.connector(address), SUBNQN, hostnqn=HOSTNQN, num_io_queues=1,
                              queue_size=depth, enable_aen=False)
    io_queue = [q for q in capture.queues if q.qid == 1][-1]
    host = ctrl.io_queues[0].transport
    buf = host.register(READ_BYTES * depth)
    capsules = [memoryview(c) for c in read_capsules(depth, buf.addr, buf.key)]
    sent = []
    # the transport does nothing: what remains is the core's own work per command
    # (any signature: a --checkout's complete() took the keyed SGL's address, key and invalidate key, ours the
    # transport's data descriptor)
    io_queue.complete = lambda cqe, *args, **kwargs: sent.append(cqe)
    # (a --checkout before complete() existed calls these two instead)
    io_queue.write_host = lambda addr, key, data: None
    io_queue.respond = lambda cqe, invalidate_key=None: sent.append(cqe)
    received = handler.capsule_received
    per_read = []
    for r in range(rounds + 1):
        gc.collect()
        sent.clear()
        t0 = time.perf_counter()
        for i in range(reads):
            received(io_queue, capsules[i % depth])
        wall = time.perf_counter() - t0
        _check_cqes(sent, reads)
        if r:  # the first round warms up
            per_read.append(wall * 1e6 / reads)
    target.close()
    return {"us_per_read": statistics.median(per_read), "rounds_us": [round(x, 2) for x in per_read]}


def use_checkout(checkout: Path) -> None:
    """Import nvmeof_roce from another checkout from here on.  This module is part of this checkout's package,
    so that package is imported already: it is forgotten first (nothing of it is held but this module's code)."""
    sys.path.insert(0, str(checkout.resolve()))
    for name in [n for n in sys.modules if n == "nvmeof_roce" or n.startswith("nvmeof_roce.")]:
        del sys.modules[name]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reads", type=int, default=20000, help="reads per timed round (default 20000)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds; the median is reported (default 5)")
    p.add_argument("--batch", default="1,32", metavar="LIST",
                   help="reads delivered per event-loop wake-up, one measurement each (default 1,32: one at a "
                        "time as at QD1, and 32 per wake-up as at QD32); the first is the headline")
    p.add_argument("--depth", type=int, default=32, help="I/O queue depth asked for at connect (default 32)")
    p.add_argument("--stand-ins", action="store_true", help="use the plain-Python pyverbs stand-ins even "
                                                           "when pyverbs is installed")
    p.add_argument("--checkout", type=Path, metavar="DIR",
                   help="measure the nvmeof_roce package of another checkout (the before of a change: a git "
                        "worktree of an older commit); the fake device stays this one")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    for name in ("reads", "rounds", "depth"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    try:
        batches = [int(b) for b in args.batch.split(",") if b.strip()]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        p.error(f"--batch {args.batch!r}: give whole numbers of at least 1, e.g. --batch 1,32")
    if args.checkout is not None:
        transport = args.checkout / "nvmeof_roce" / "transport"
        if not ((transport / "rdma" / "queue.py").is_file() or (transport / "rdma.py").is_file()):
            p.error(f"--checkout {args.checkout}: no nvmeof_roce/transport/rdma/queue.py (or rdma.py) there")
        use_checkout(args.checkout)
    real = fakeverbs.install(prefer_real=not args.stand_ins)
    import nvmeof_roce
    import logging
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("nvmeof_roce").setLevel(logging.WARNING)
    runs = [bench_rdma(args.reads, b, args.rounds, args.depth) for b in batches]
    rdma = runs[0]
    core = bench_core(args.reads, args.rounds, args.depth)
    pyverbs_version = "stand-ins (pyverbs not installed, or --stand-ins): pyverbs' own costs left out"
    if real:
        try:
            from importlib.metadata import version
            pyverbs_version = f"real ({version('pyverbs')})"
        except Exception:
            pyverbs_version = "real"
    out = {
        "benchmark": "transport_cost", "read_bytes": READ_BYTES, "reads_per_round": args.reads,
        "rounds": args.rounds, "batch": rdma["batch"], "queue_depth": rdma["queue_depth"],
        "pyverbs": pyverbs_version, "real_pyverbs": real,
        "rdma_us_per_read": round(rdma["us_per_read"], 2),
        "core_us_per_read": round(core["us_per_read"], 2),
        "transport_us_per_read": round(rdma["us_per_read"] - core["us_per_read"], 2),
        "device_us_per_read": round(rdma["device_us_per_read"], 2),
        "rss_bytes_per_read": round(rdma["rss_bytes_per_read"], 1),
        "malloc_bytes_per_read": None if rdma["malloc_bytes_per_read"] is None else
        round(rdma["malloc_bytes_per_read"], 1),
        "send_with_invalidate": rdma["send_with_invalidate"],
        "rdma_rounds_us": rdma["rounds_us"], "core_rounds_us": core["rounds_us"],
        "by_batch": [{"batch": r["batch"], "rdma_us_per_read": round(r["us_per_read"], 2),
                      "transport_us_per_read": round(r["us_per_read"] - core["us_per_read"], 2),
                      "device_us_per_read": round(r["device_us_per_read"], 2),
                      "rss_bytes_per_read": round(r["rss_bytes_per_read"], 1),
                      "malloc_bytes_per_read": None if r["malloc_bytes_per_read"] is None else
                      round(r["malloc_bytes_per_read"], 1)} for r in runs],
        "checkout": str(Path(nvmeof_roce.__file__).resolve().parents[1]),
        "python": platform.python_version(), "host": socket.gethostname(),
        "lab": os.path.exists("/mnt/ctl/env") or os.environ.get("NVMEOF_LAB") == "1",
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"transport_cost: {args.reads} reads of {READ_BYTES} B x {args.rounds} rounds, "
          f"pyverbs {pyverbs_version}, Python {out['python']} on {out['host']}, checkout {out['checkout']}")
    print(f"  target core alone                      : {out['core_us_per_read']:8.2f} µs per read")
    for r in out["by_batch"]:
        print(f"  batch {r['batch']:>3}: RDMA transport + core : {r['rdma_us_per_read']:8.2f} µs per read "
              f"(the transport's share {r['transport_us_per_read']:.2f}; fake device's own "
              f"{r['device_us_per_read']:.2f} subtracted)")
        heap = "-" if r["malloc_bytes_per_read"] is None else f"{r['malloc_bytes_per_read']:.1f}"
        print(f"             memory kept: C heap {heap} B per read, RSS {r['rss_bytes_per_read']:.1f} B per read")
    return 0


if __name__ == "__main__":
    sys.exit(main())
