"""The native data path (csrc/queue.c) through the fake verbs provider (tests/native/fakeprov.c).

The engine's own behaviour (what it serves without Python, batching, signaling, waiting for send-queue entries,
the view) and the differential test: the same capsules through the C queue and through the Python data path over
loopback, every CQE and every byte moved compared.
"""
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loopback_env import SUB_4K, SUB_NULL, SUB_RAM, null_ns, port, ram_ns, standard_config
from native_diff import HOST_BUFFER, LoopbackEndpoint, NativeEndpoint, close_all, io_capsule, pattern
from native_fake import needs_native, pump

pytestmark = needs_native

READ, WRITE, FLUSH = 0x02, 0x01, 0x00


@pytest.fixture
def native_ep():
    ep = NativeEndpoint(standard_config(), SUB_RAM)
    yield ep
    ep.close()


def status_of(cqe: bytes) -> int:
    return int.from_bytes(cqe[14:16], "little") >> 1


def test_reads_and_writes_are_served_without_python(native_ep):
    ep = native_ep
    before = ep.queue.stats()
    data = pattern(4096, seed=3)
    ep.buf.view[65536:65536 + 4096] = data
    (w,) = ep.exchange(io_capsule(ep, WRITE, 1, 8, 7, 4096, offset=65536, cid=9))
    (r,) = ep.exchange(io_capsule(ep, READ, 1, 8, 7, 4096, offset=0, cid=10))
    (f,) = ep.exchange(io_capsule(ep, FLUSH, 1, 0, 0, 0, cid=11))
    assert [status_of(c) for c in (w, r, f)] == [0, 0, 0]
    assert [int.from_bytes(c[12:14], "little") for c in (w, r, f)] == [9, 10, 11]
    assert ep.host_bytes()[:4096] == data
    assert ep.namespace_bytes(SUB_RAM, 1)[8 * 512:8 * 512 + 4096] == data
    after = ep.queue.stats()
    assert after["native_commands"] - before["native_commands"] == 3
    assert after["python_commands"] == before["python_commands"]
    # the figures reach the namespace when the core collects them (its tick)
    ns = ep.env.target.subsystem(SUB_RAM).namespaces[1]
    reads_before = ns.read_commands
    ep.env.target.tick(ep.env.clock())
    assert ns.read_commands == reads_before + 1 and ns.bytes_written >= 4096


def test_a_write_with_in_capsule_data_is_served_without_python(native_ep):
    ep = native_ep
    python_before = ep.queue.stats()["python_commands"]
    data = pattern(1024, seed=11)
    (cqe,) = ep.exchange(io_capsule(ep, WRITE, 1, 100, 1, 1024, sgl_id=0x01, offset=0, extra=data))
    assert status_of(cqe) == 0
    assert ep.namespace_bytes(SUB_RAM, 1)[100 * 512:100 * 512 + 1024] == data
    assert ep.queue.stats()["python_commands"] == python_before
    # past what arrived: the core's answer (SGL Data Block Invalid)
    (cqe,) = ep.exchange(io_capsule(ep, WRITE, 1, 100, 1, 1024, sgl_id=0x01, offset=0, extra=data[:512]))
    assert status_of(cqe) == 0x400F
    assert ep.queue.stats()["python_commands"] == python_before + 1


def test_a_read_posts_write_and_send_in_one_doorbell_with_inline_response(native_ep):
    ep = native_ep
    dev = ep.device.counters()
    ep.exchange(io_capsule(ep, READ, 1, 0, 7, 4096))
    now = ep.device.counters()
    assert now["post_send"] - dev["post_send"] == 1  # WRITE chained to the SEND: one post
    assert now["wrs"] - dev["wrs"] == 2
    assert now["post_recv"] - dev["post_recv"] == 1  # the receive re-posted in the same poll
    assert now["recvs_posted"] == dev["recvs_posted"]


def test_a_batch_of_32_reads_is_one_doorbell_and_few_signaled_sends(native_ep):
    ep = native_ep
    for cid in range(32):
        assert ep.device.deliver(io_capsule(ep, READ, 1, cid * 8, 7, 4096, offset=cid * 4096, cid=cid)) == 0
    before = ep.device.counters()
    assert ep.queue.poll() == 32
    after = ep.device.counters()
    assert after["post_send"] - before["post_send"] == 1
    assert after["post_recv"] - before["post_recv"] == 1
    assert after["wrs"] - before["wrs"] == 64
    pump(ep.queue)
    cqes = [c for c, _ in ep.device.responses()]
    assert sorted(int.from_bytes(c[12:14], "little") for c in cqes) == list(range(32))
    stats = ep.queue.stats()
    assert stats["native_in_flight"] == 0 and stats["send_queue_used"] == 0
    assert ep.host_bytes()[:32 * 4096] == ep.namespace_bytes(SUB_RAM, 1)[:32 * 4096]


def test_invalidate_keyed_sgl_is_answered_with_send_with_invalidate(native_ep):
    ep = native_ep
    assert ep.device.deliver(io_capsule(ep, READ, 1, 0, 0, 512, sgl_id=0x4F)) == 0
    pump(ep.queue)
    ((cqe, invalidated),) = ep.device.responses()
    assert status_of(cqe) == 0 and invalidated == ep.buf_key


def test_errors_and_other_commands_go_to_the_core(native_ep):
    ep = native_ep
    python_before = ep.queue.stats()["python_commands"]
    cases = [
        (io_capsule(ep, READ, 1, 4096, 7, 4096), 0x80),  # LBA out of range (2 MiB = 4096 blocks)
        (io_capsule(ep, READ, 1, 0, 7, 2048), 0x0F),  # SGL length != NLB x block size
        (io_capsule(ep, READ, 9, 0, 7, 4096), 0x0B),  # no such namespace
        (io_capsule(ep, READ, 1, 0, 7, 4096, sgl_id=0x41), 0x02),  # keyed SGL with a bad subtype
        (io_capsule(ep, READ, 1, 0, 7, 4096, flags=0x41), 0x02),  # FUSE
        (io_capsule(ep, 0x08, 1, 0, 7, 0), 0x00),  # Write Zeroes: the core's
        (io_capsule(ep, 0x7E, 1, 0, 0, 0), 0x01),  # unknown opcode
    ]
    for capsule, status in cases:
        (cqe,) = ep.exchange(capsule)
        assert status_of(cqe) & 0x7FF == status, (capsule[:2].hex(), hex(status_of(cqe)))
    assert ep.queue.stats()["python_commands"] - python_before == len(cases)
    # the core logged them as it does on the Python path (the error log's entries)
    ctrl = next(iter(ep.env.target.controllers()))
    assert len(ctrl.error_log) >= 5


def test_a_bad_remote_key_fails_the_queue_as_on_rdma(native_ep):
    ep = native_ep
    assert ep.device.deliver(io_capsule(ep, READ, 1, 0, 7, 4096, bad_key=True)) == 0
    pump(ep.queue)
    assert ep.queue.closed
    assert ep.device.counters()["qp_error"] == 1


def test_a_removed_namespace_leaves_the_view_at_once(native_ep):
    ep = native_ep
    target = ep.env.target
    target.remove_namespace(SUB_RAM, 2)
    python_before = ep.queue.stats()["python_commands"]
    (cqe,) = ep.exchange(io_capsule(ep, READ, 2, 0, 0, 512))
    assert status_of(cqe) == 0x400B  # Invalid Namespace | DNR, from the core
    assert ep.queue.stats()["python_commands"] == python_before + 1


@pytest.mark.parametrize("restriction", ["qos", "visibility"])
def test_a_namespace_with_a_qos_limit_or_per_host_visibility_is_left_to_the_core(native_ep, restriction):
    """The core enforces QoS holds and per-host visibility (target/qos.py, core._start): the view leaves such
    a namespace out, so its commands reach Python."""
    from nvmeof_roce.target import native_view
    ep = native_ep
    target = ep.env.target
    ns = target.subsystems[SUB_RAM].namespaces[1]
    if restriction == "qos":
        ns.qos = object()  # any limiter: the view only asks whether there is one
    else:
        ns.visible_to = lambda hostnqn: False
    native_view.refresh_all(target)
    python_before = ep.queue.stats()["python_commands"]
    ep.exchange(io_capsule(ep, READ, 1, 0, 0, 512))
    assert ep.queue.stats()["python_commands"] == python_before + 1


def test_a_disabled_controller_stops_native_service(native_ep):
    ep = native_ep
    from loopback_env import raw_enable
    from nvmeof_roce.nvme import fabrics as F
    raw_enable(ep.admin, F.CC_DEFAULT)  # CC.EN = 0
    python_before = ep.queue.stats()["python_commands"]
    (cqe,) = ep.exchange(io_capsule(ep, READ, 1, 0, 0, 512))
    assert status_of(cqe) == 0x400C  # Command Sequence Error | DNR: the core's answer to a disabled controller
    assert ep.queue.stats()["python_commands"] == python_before + 1


def test_responses_wait_for_send_queue_entries_and_none_is_lost():
    ep = NativeEndpoint(standard_config(), SUB_RAM, depth=8)
    try:
        # a depth-8 queue has 40 send entries, 30 of them native: 9 reads (18 entries) then the rest in later
        # polls as completions free entries
        for rnd in range(4):
            for cid in range(8):
                assert ep.device.deliver(io_capsule(ep, READ, 1, cid, 0, 512, offset=cid * 512, cid=cid)) == 0
            pump(ep.queue)
            cqes = [c for c, _ in ep.device.responses()]
            assert sorted(int.from_bytes(c[12:14], "little") for c in cqes) == list(range(8)), rnd
        assert ep.queue.stats()["native_in_flight"] == 0
    finally:
        ep.close()


def test_the_view_refuses_kinds_it_does_not_serve(native_ep):
    with pytest.raises(ValueError, match="kind file is served by Python"):
        native_ep.queue.native.set_view(True, 4096, [(1, "file", 9, 100, 0, 0, 1, None)], sq_entries=32)
    with pytest.raises(ValueError, match="appears twice"):
        native_ep.queue.native.set_view(True, 4096, [(1, "null", 9, 100, 0, 0, 1, None)] * 2, sq_entries=32)


# ---------------------------------------------------------------------------------------------- differential

DIFF_CONFIG = {
    "hosts": [],
    "ports": [port(1, "10.99.0.1:4420", [SUB_RAM, SUB_4K, SUB_NULL])],
    "subsystems": [
        {"nqn": SUB_RAM, "namespaces": [ram_ns(1, "1M"), ram_ns(2, "1M", 4096), null_ns(3, "1G"),
                                        ram_ns(4, "256K")]},
        {"nqn": SUB_4K, "namespaces": [ram_ns(1, "4M", 4096)]},
        {"nqn": SUB_NULL, "namespaces": [null_ns(1)]},
    ],
}
NS_BLOCKS = {1: (2048, 9), 2: (256, 12), 3: (1 << 21, 9), 4: (512, 9)}

templates = st.fixed_dictionaries({
    "opc": st.sampled_from([READ, READ, WRITE, WRITE, FLUSH, 0x08, 0x09, 0x05, 0x80]),
    "nsid": st.sampled_from([1, 1, 2, 3, 4, 0, 9, 0xFFFFFFFF]),
    "flags": st.sampled_from([0x40, 0x40, 0x40, 0x80, 0x00, 0x41, 0xC0]),
    "sgl_id": st.sampled_from([0x40, 0x40, 0x4F, 0x41, 0x01, 0x00, 0x20, 0x5F]),
    "slba": st.one_of(st.integers(0, 600), st.sampled_from([2047, 2048, 255, 256, 511, (1 << 64) - 1,
                                                             (1 << 63), (1 << 21) - 1])),
    "nlb": st.one_of(st.integers(0, 15), st.sampled_from([0xFFFF, 255, 63])),
    "length": st.sampled_from(["match", "match", "match", "short", "long", "zero", "huge"]),
    "offset": st.sampled_from([0, 4096, 8192, HOST_BUFFER - 4096, HOST_BUFFER - 100, HOST_BUFFER]),
    "bad_key": st.sampled_from([False] * 12 + [True]),
    "fua": st.booleans(),
})


def _length(t) -> int:
    lbads = NS_BLOCKS.get(t["nsid"], (0, 9))[1]
    n = ((t["nlb"] & 0xFFFF) + 1) << lbads
    return {"match": n, "short": max(0, n - 512), "long": n + 512, "zero": 0, "huge": 0xFFFFFF}[t["length"]]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(templates, min_size=5, max_size=40), st.integers(0, 1 << 30))
def test_native_and_python_paths_answer_and_move_bytes_identically(commands, seed):
    python = native = None
    try:
        python = LoopbackEndpoint(DIFF_CONFIG, SUB_RAM)
        native = NativeEndpoint(DIFF_CONFIG, SUB_RAM)
        rng = random.Random(seed)
        for i, t in enumerate(commands):
            capsules = []
            for ep in (python, native):
                extra = b""
                length = _length(t)
                if t["sgl_id"] == 0x01:
                    length = min(length, 4096)
                    extra = pattern(length, seed=i)
                capsules.append(io_capsule(ep, t["opc"], t["nsid"], t["slba"], t["nlb"], length, flags=t["flags"],
                                           sgl_id=t["sgl_id"], offset=t["offset"], bad_key=t["bad_key"],
                                           cid=i, cdw12_hi=0x4000 if t["fua"] else 0, extra=extra))
            got_python = python.exchange(capsules[0])
            got_native = native.exchange(capsules[1])
            assert got_native == got_python, (i, t, got_python, got_native)
            assert python.alive == native.alive, (i, t, python.alive)
            if not python.alive:
                break
            assert python.host_bytes() == native.host_bytes(), (i, t)
            if t["sgl_id"] == 0x4F and got_python:
                python.fresh_buffer()  # its key was invalidated with the response
                native.fresh_buffer()
        for nsid in (1, 2, 4):
            assert python.namespace_bytes(SUB_RAM, nsid) == native.namespace_bytes(SUB_RAM, nsid), nsid
    finally:
        close_all(python, native)


def test_serve_names_the_data_path_and_refuses_one_it_cannot_run(monkeypatch):
    from nvmeof_roce import native
    from nvmeof_roce.errors import NvmeofError
    from nvmeof_roce.service.serve import check_data_path
    assert check_data_path("native") == "native" and check_data_path("python") == "python"
    assert check_data_path(None) == "native"  # the default, with the module built
    assert check_data_path(None, worker=0) == "python"  # a worker of serve --workers
    with pytest.raises(NvmeofError, match="unknown data path 'fast'"):
        check_data_path("fast")
    monkeypatch.setattr(native, "module", None)
    monkeypatch.setattr(native, "missing_reason", "the native data path is not built (no module); install "
                                                  "libibverbs-dev librdmacm-dev liburing-dev and reinstall")
    with pytest.raises(NvmeofError, match="libibverbs-dev"):
        check_data_path("native")
    assert check_data_path(None) == "python"  # the default falls back, and says why at start


def test_target_status_says_which_data_path_runs(native_ep):
    from types import SimpleNamespace
    from nvmeof_roce.service.stats import target_status
    target = native_ep.env.target
    assert target_status(target)["data_path"] == "python"  # no server: the loopback target's own path
    assert target_status(target, server=SimpleNamespace(data_path="native", listeners=[]))["data_path"] == "native"
