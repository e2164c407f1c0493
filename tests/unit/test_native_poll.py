"""The native data path's latency histograms and poll modes (csrc/queue.c, transport/native_queue.py), through the
fake verbs provider (tests/native/fakeprov.c)."""
import random

import pytest

from loopback_env import SUB_RAM, standard_config
from native_diff import LoopbackEndpoint, NativeEndpoint, close_all, io_capsule
from native_fake import needs_native, pump

from nvmeof_roce import native
from nvmeof_roce.service.stats import target_status
from nvmeof_roce.target.latency import BUCKET_BOUNDS_US, LatencyHistogram

pytestmark = needs_native

READ, WRITE, FLUSH = 0x02, 0x01, 0x00


def _python_bucket(ns: int) -> int:
    h = LatencyHistogram()
    h.record_ns(ns)
    return h.counts.index(1)


def test_the_native_bucket_of_a_latency_is_the_python_histograms():
    values = set(range(0, 2100)) | {(1 << 62), (1 << 64) - 1}
    for bound in BUCKET_BOUNDS_US:  # each bound's neighbours in ns
        edge = int(bound * 1000)
        values |= {edge - 1, edge, edge + 1}
    rng = random.Random(5)
    values |= {rng.randrange(1 << 40) for _ in range(5000)}
    wrong = [(ns, _python_bucket(ns), native.module.latency_bucket(ns)) for ns in sorted(values)
             if _python_bucket(ns) != native.module.latency_bucket(ns)]
    assert not wrong
    assert native.module.LATENCY_BUCKETS == len(LatencyHistogram().counts)


def _io(ep, count: int) -> None:
    for i in range(count):
        for cqe in ep.exchange(io_capsule(ep, WRITE, 1, 8 * i, 7, 4096, offset=4096 * i, cid=2 * i)):
            assert cqe[14:16] == b"\0\0"
        for cqe in ep.exchange(io_capsule(ep, READ, 1, 8 * i, 7, 4096, offset=65536 + 4096 * i, cid=2 * i + 1)):
            assert cqe[14:16] == b"\0\0"
    ep.exchange(io_capsule(ep, FLUSH, 1, 0, 0, 0, cid=999))  # not a latency of either histogram


def test_native_commands_show_up_in_the_namespace_latencies_and_status():
    python = native_ep = None
    try:
        native_ep = NativeEndpoint(standard_config(), SUB_RAM)
        python = LoopbackEndpoint(standard_config(), SUB_RAM)
        before = native_ep.queue.stats()
        _io(native_ep, 20)
        _io(python, 20)
        assert native_ep.queue.stats()["native_commands"] - before["native_commands"] == 41
        native_ep.env.target.tick(native_ep.env.clock())  # the core collects the native figures
        seen = {}
        for name, ep in (("native", native_ep), ("python", python)):
            ns = ep.env.target.subsystem(SUB_RAM).namespaces[1]
            assert (ns.stats.read_latency.total, ns.stats.write_latency.total) == (20, 20), name
            assert ns.stats.read_latency.sum_us > 0 and ns.stats.write_latency.sum_us > 0, name
            status = next(s for s in target_status(ep.env.target)["subsystems"] if s["nqn"] == SUB_RAM)
            lat = status["namespaces"][0]["read_latency_us"], status["namespaces"][0]["write_latency_us"]
            seen[name] = lat
            for percentiles in lat:
                # a bucket bound between 1 us and 1 s: plausible for a command served in this process
                assert all(v is not None and 1.0 <= v <= 1e6 for v in percentiles.values()), (name, percentiles)
        # the histograms were drained into the namespace once: a second tick adds nothing
        native_ep.env.target.tick(native_ep.env.clock())
        ns = native_ep.env.target.subsystem(SUB_RAM).namespaces[1]
        assert (ns.stats.read_latency.total, ns.stats.write_latency.total) == (20, 20)
    finally:
        close_all(python, native_ep)


def test_a_failed_native_write_records_no_latency():
    ep = NativeEndpoint(standard_config(), SUB_RAM)
    try:
        ns = ep.env.target.subsystem(SUB_RAM).namespaces[1]
        target = ep.env.target
        # the Write's RDMA READ is in flight when its namespace leaves: Invalid Namespace, no latency
        assert ep.device.deliver(io_capsule(ep, WRITE, 1, 0, 7, 4096, cid=5)) == 0
        assert ep.queue.poll() == 1  # the capsule: its RDMA READ posted
        ep.queue.native.set_view(True, ep.queue.max_transfer, [], sq_entries=32)
        pump(ep.queue)
        (cqe, _inv), = ep.device.responses()
        assert int.from_bytes(cqe[14:16], "little") >> 1 == 0x400B
        target.tick(ep.env.clock())
        assert ns.stats.write_latency.total == 0
    finally:
        ep.close()
