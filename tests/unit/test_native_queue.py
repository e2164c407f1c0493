"""The native data path (csrc/nq_hot.c, csrc/nq_type.c) through the fake verbs provider (tests/native/fakeprov.c).

The engine's own behaviour (what it serves without Python, batching, signaling, waiting for send-queue entries,
the view) and the differential test: the same capsules through the C queue and through the Python data path over
loopback, every CQE and every byte moved compared.
"""
import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loopback_env import (SUB_4K, SUB_FILE, SUB_NULL, SUB_RAM, file_ns, null_ns, port, ram_ns, remove_namespace,
                           standard_config)
from native_diff import HOST_BUFFER, LoopbackEndpoint, NativeEndpoint, close_all, io_capsule, pattern
from native_fake import needs_native, pump
from nvmeof_roce import native

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
    remove_namespace(target, SUB_RAM, 2)
    python_before = ep.queue.stats()["python_commands"]
    (cqe,) = ep.exchange(io_capsule(ep, READ, 2, 0, 0, 512))
    assert status_of(cqe) == 0x400B  # Invalid Namespace | DNR, from the core
    assert ep.queue.stats()["python_commands"] == python_before + 1


@pytest.mark.parametrize("restriction", ["qos", "visibility"])
def test_a_namespace_with_a_qos_limit_or_per_host_visibility_is_left_to_the_core(native_ep, restriction):
    """The core enforces QoS holds and per-host visibility (engine/qos.py, core._start): the view leaves such
    a namespace out, so its commands reach Python."""
    from nvmeof_roce.engine import native_view
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
    ref = native.module.Ref()
    with pytest.raises(ValueError, match="kind tape is served by Python"):
        native_ep.queue.native.set_view(True, 4096, [(1, "tape", 9, 100, 0, 0, 1, None, ref, False)], sq_entries=32)
    with pytest.raises(ValueError, match="needs its _native.File"):
        native_ep.queue.native.set_view(True, 4096, [(1, "file", 9, 100, 0, 0, 1, None, ref, False)], sq_entries=32)
    with pytest.raises(ValueError, match="appears twice"):
        native_ep.queue.native.set_view(True, 4096, [(1, "null", 9, 100, 0, 0, 1, None, ref, False)] * 2,
                                        sq_entries=32)
    with pytest.raises(TypeError, match="must be a _native.Ref"):
        native_ep.queue.native.set_view(True, 4096, [(1, "null", 9, 100, 0, 0, 1, None, object(), False)],
                                        sq_entries=32)
    assert ref.count == 0  # no view took a command on it, and the refused views let it go


# ---------------------------------------------------------------------------------------------- differential

def diff_config(directory) -> dict:
    """RAM, null, and a file namespace (5) on the io_uring engine: its own file per target."""
    return {
        "hosts": [],
        "ports": [port(1, "10.99.0.1:4420", [SUB_RAM, SUB_4K, SUB_NULL])],
        "subsystems": [
            {"nqn": SUB_RAM, "namespaces": [ram_ns(1, "1M"), ram_ns(2, "1M", 4096), null_ns(3, "1G"),
                                            ram_ns(4, "256K"), file_ns(5, Path(directory) / "ns5.img", "1M")]},
            {"nqn": SUB_4K, "namespaces": [ram_ns(1, "4M", 4096)]},
            {"nqn": SUB_NULL, "namespaces": [null_ns(1)]},
        ],
    }


NS_BLOCKS = {1: (2048, 9), 2: (256, 12), 3: (1 << 21, 9), 4: (512, 9), 5: (2048, 9)}

templates = st.fixed_dictionaries({
    "opc": st.sampled_from([READ, READ, WRITE, WRITE, FLUSH, 0x08, 0x09, 0x05, 0x80]),
    "nsid": st.sampled_from([1, 1, 2, 3, 4, 5, 5, 0, 9, 0xFFFFFFFF]),
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
    directory = tempfile.mkdtemp(prefix="native-diff-")
    try:
        for side in ("python", "native"):
            os.mkdir(Path(directory) / side)
        python = LoopbackEndpoint(diff_config(Path(directory) / "python"), SUB_RAM)
        native = NativeEndpoint(diff_config(Path(directory) / "native"), SUB_RAM)
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
        for nsid in (1, 2, 4, 5):
            assert python.namespace_bytes(SUB_RAM, nsid) == native.namespace_bytes(SUB_RAM, nsid), nsid
    finally:
        close_all(python, native)
        shutil.rmtree(directory, ignore_errors=True)


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
    from nvmeof_roce.control.stats import target_status
    target = native_ep.env.target
    assert target_status(target)["data_path"] == "python"  # no server: the loopback target's own path
    server = SimpleNamespace(data_path="native", data_path_reason="", poll="interrupt", cores=1, listeners=[],
                             loop=SimpleNamespace(longest_pass=0.0), transport_options=dict)  # stats.Served
    assert target_status(target, server=server)["data_path"] == "native"


# ---------------------------------------------------------------------------------------------- file and block

def file_config(path, size="1M", block_size=512, buffered_io=None, **userspace) -> dict:
    ns = file_ns(1, path, size, block_size)
    ns["nvmeof_roce"].update(userspace)
    if buffered_io is not None:
        ns["buffered_io"] = buffered_io
    return {"hosts": [], "ports": [port(1, "10.99.0.1:4420", [SUB_FILE])],
            "subsystems": [{"nqn": SUB_FILE, "namespaces": [ns]}]}


def file_bytes(path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:  # a descriptor of its own: what is in the file, not what the target holds
        f.seek(offset)
        return f.read(length)


def put_file(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def fds_on(path) -> int:
    """This process's descriptors open on `path`."""
    real = os.path.realpath(path)
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == real
        except OSError:
            pass
    return count


@pytest.fixture
def file_ep(tmp_path):
    ep = NativeEndpoint(file_config(tmp_path / "ns.img"), SUB_FILE)
    yield ep
    ep.close()


def _ns(ep):
    return ep.env.target.subsystem(SUB_FILE).namespaces[1]


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "O_DIRECT"])
def test_file_reads_and_writes_are_served_natively_through_io_uring(tmp_path, direct):
    path = tmp_path / "ns.img"
    ep = NativeEndpoint(file_config(path, buffered_io=0 if direct else None), SUB_FILE)
    try:
        assert _ns(ep).backend.direct is direct
        before = ep.queue.stats()
        data = pattern(8192, seed=5)
        ep.buf.view[65536:65536 + 8192] = data
        (w,) = ep.exchange(io_capsule(ep, WRITE, 1, 24, 15, 8192, offset=65536, cid=3))
        assert status_of(w) == 0
        assert file_bytes(path, 24 * 512, 8192) == data  # in the file once acknowledged
        stored = pattern(4096, seed=9)
        put_file(path, 300 * 512, stored)
        (r,) = ep.exchange(io_capsule(ep, READ, 1, 300, 7, 4096, offset=0, cid=4))
        assert status_of(r) == 0 and ep.host_bytes()[:4096] == stored
        after = ep.queue.stats()
        assert after["python_commands"] == before["python_commands"]  # neither went to the core
        assert after["file_commands"] - before["file_commands"] == 2
        ns = _ns(ep)
        ep.env.target.tick(ep.env.clock())  # the native counters folded into the namespace's
        assert (ns.read_commands, ns.write_commands, ns.bytes_read, ns.bytes_written) == (1, 1, 4096, 8192)
    finally:
        ep.close()


def test_a_file_write_with_in_capsule_data_is_served_natively(file_ep):
    ep = file_ep
    before = ep.queue.stats()["python_commands"]
    data = pattern(2048, seed=13)
    (cqe,) = ep.exchange(io_capsule(ep, WRITE, 1, 40, 3, 2048, sgl_id=0x01, offset=0, extra=data))
    assert status_of(cqe) == 0
    assert file_bytes(_ns(ep).backend.path, 40 * 512, 2048) == data
    assert ep.queue.stats()["python_commands"] == before
    assert ep.queue.stats()["file_commands"] == 1


def test_a_file_flush_goes_to_the_core_after_the_acknowledged_writes_are_in_the_file(file_ep):
    """A Flush covers every write acknowledged before it: the C queue answers a Write only once the ring wrote
    it, so the core's fdatasync (on the same file) finds it there."""
    ep = file_ep
    path = _ns(ep).backend.path
    data = pattern(4096, seed=21)
    ep.buf.view[:4096] = data
    python_before = ep.queue.stats()["python_commands"]
    (w,) = ep.exchange(io_capsule(ep, WRITE, 1, 64, 7, 4096, cid=1))
    assert status_of(w) == 0 and file_bytes(path, 64 * 512, 4096) == data
    (f,) = ep.exchange(io_capsule(ep, FLUSH, 1, 0, 0, 0, cid=2))
    assert status_of(f) == 0
    assert ep.queue.stats()["python_commands"] == python_before + 1
    assert _ns(ep).io is not None and _ns(ep).io.submitted == 0  # the core's engine did the flush, no read/write


def test_many_file_commands_are_on_the_ring_at_once_and_the_namespace_depth_bounds_them(tmp_path):
    for depth, expect_ring in ((None, 32), (4, 4)):
        path = tmp_path / f"ns-{depth}.img"
        extra = {} if depth is None else {"queue_depth": depth}
        ep = NativeEndpoint(file_config(path, **extra), SUB_FILE, depth=64)
        try:
            stored = pattern(32 * 1024, seed=depth or 1)
            put_file(path, 0, stored)
            for i in range(32):  # all arrive before one poll: started together, one submission
                assert ep.device.deliver(io_capsule(ep, READ, 1, 2 * i, 1, 1024, offset=1024 * i, cid=i)) == 0
            ep.settle()
            got = ep.device.responses()
            assert sorted(int.from_bytes(c[12:14], "little") for c, _ in got) == list(range(32))
            assert all(status_of(c) == 0 for c, _ in got)
            assert ep.host_bytes()[:32 * 1024] == stored
            stats = ep.queue.stats()
            assert stats["ring_most_in_flight"] == expect_ring
            status = _ns(ep).engine_status()
            assert status["native_most_in_flight"] == expect_ring and status["native_in_flight"] == 0
            assert stats["python_commands"] == 1  # the Connect only
        finally:
            ep.close()


def test_file_commands_wait_for_the_queues_bounce_chunks_and_none_is_lost(tmp_path):
    """--queue-file-buffers 4 and 40 commands at once: at most 4 on the ring, the rest wait in C for a chunk; every
    Read returns its bytes and every Write lands.  An in-capsule Write that finds every chunk taken goes to the core
    (its data must leave the receive buffer at once)."""
    path = tmp_path / "ns.img"
    ep = NativeEndpoint(file_config(path), SUB_FILE, depth=64, file_buffers=4)
    try:
        stored = pattern(16 * 1024, seed=21)
        put_file(path, 0, stored)
        written = pattern(16 * 1024, seed=22)
        ep.buf.view[65536:65536 + len(written)] = written
        inline = pattern(1024, seed=23)
        capsules = []
        for i in range(16):
            capsules.append(io_capsule(ep, READ, 1, 2 * i, 1, 1024, offset=1024 * i, cid=i))
            capsules.append(io_capsule(ep, WRITE, 1, 100 + 2 * i, 1, 1024, offset=65536 + 1024 * i, cid=100 + i))
        capsules.append(io_capsule(ep, WRITE, 1, 200, 1, 1024, sgl_id=0x01, offset=0, extra=inline, cid=300))
        python_before = ep.queue.stats()["python_commands"]
        for capsule in capsules:  # all arrive before one poll
            assert ep.device.deliver(capsule) == 0
        ep.settle()
        got = ep.device.responses()
        assert sorted(int.from_bytes(c[12:14], "little") for c, _ in got) == \
            sorted([*range(16), *range(100, 116), 300])
        assert all(status_of(c) == 0 for c, _ in got)
        assert ep.host_bytes()[:16 * 1024] == stored
        for i in range(16):
            assert file_bytes(path, (100 + 2 * i) * 512, 1024) == written[1024 * i:1024 * (i + 1)]
        assert file_bytes(path, 200 * 512, 1024) == inline
        stats = ep.queue.stats()
        assert stats["bounce_chunks"] == 4 and stats["bounce_chunks_free"] == 4
        # never more on the ring than chunks (a Write holds its chunk through its RDMA READ too)
        assert 1 <= stats["ring_most_in_flight"] <= 4 and stats["chunk_waits"] > 0
        assert stats["file_commands"] == 32  # every keyed Read and Write in C
        assert stats["python_commands"] == python_before + 1  # the in-capsule Write, with every chunk taken
    finally:
        ep.close()


def test_queue_file_buffers_is_taken_only_where_it_is_honoured():
    from nvmeof_roce.cli import build_parser
    from nvmeof_roce.errors import NvmeofError
    from nvmeof_roce.service.serve import check_file_buffers, limits_from_args
    args = build_parser().parse_args(["target", "serve", "x.json", "--queue-file-buffers", "8"])
    assert limits_from_args(args).queue_file_buffers == 8
    check_file_buffers(8, "native")
    check_file_buffers(32, "python")  # the default: nothing asked
    with pytest.raises(NvmeofError, match="--queue-file-buffers 8 sizes the native data path") as err:
        check_file_buffers(8, "python")
    assert "--data-path native" in err.value.fix
    with pytest.raises(NvmeofError, match="--queue-file-buffers 0: out of range"):
        limits_from_args(build_parser().parse_args(["target", "serve", "x.json", "--queue-file-buffers", "0"]))


def test_a_read_past_the_end_of_a_truncated_file_is_the_cores_error_not_zeros(tmp_path):
    eps = []
    try:
        for name, cls in (("python", LoopbackEndpoint), ("native", NativeEndpoint)):
            path = tmp_path / f"{name}.img"
            ep = cls(file_config(path), SUB_FILE)
            eps.append(ep)
            os.truncate(path, 64 * 1024)  # shrank under the namespace (1 MiB)
        python, native = eps
        for cid, (slba, nlb) in enumerate([(1000, 7), (120, 15), (8, 7)]):
            answers = [ep.exchange(io_capsule(ep, READ, 1, slba, nlb, (nlb + 1) * 512, cid=cid)) for ep in eps]
            assert answers[0] == answers[1], (slba, answers)
            expect_error = slba * 512 + (nlb + 1) * 512 > 64 * 1024
            assert (status_of(answers[1][0]) != 0) is expect_error, answers
        assert native.queue.stats()["file_handed_back"] == 2
        assert python.host_bytes() == native.host_bytes()
    finally:
        close_all(*eps)


def test_a_namespace_removed_with_commands_on_the_ring_keeps_its_file_until_they_complete(tmp_path):
    path = tmp_path / "ns.img"
    ep = NativeEndpoint(file_config(path, queue_depth=1), SUB_FILE)
    try:
        stored = pattern(8 * 4096, seed=17)
        put_file(path, 0, stored)
        for i in range(8):
            assert ep.device.deliver(io_capsule(ep, READ, 1, 8 * i, 7, 4096, offset=4096 * i, cid=i)) == 0
        data = pattern(4096, seed=23)
        ep.buf.view[65536:65536 + 4096] = data
        assert ep.device.deliver(io_capsule(ep, WRITE, 1, 200, 7, 4096, offset=65536, cid=8)) == 0
        ep.queue.poll()  # depth 1: one on the ring at a time, the rest wait in the queue's FIFO
        assert ep.queue.stats()["native_in_flight"] > 1
        ns = _ns(ep)
        remove_namespace(ep.env.target, SUB_FILE, 1)
        assert ns.backend.io_fd < 0  # the core closed its descriptors at once...
        assert fds_on(path) == 1  # ...the commands in flight keep the C side's own
        ep.settle()
        got = {int.from_bytes(c[12:14], "little"): status_of(c) for c, _ in ep.device.responses()}
        assert [got[i] for i in range(8)] == [0] * 8  # accepted before the removal: read as nvmet does
        assert ep.host_bytes()[:8 * 4096] == stored
        assert got[8] == 0x4000 | 0x0B  # its data came after the removal: Invalid Namespace, as io._write_data
        assert file_bytes(path, 200 * 512, 4096) != data
        assert fds_on(path) == 0  # the last command out closed it
    finally:
        ep.close()


def test_file_namespaces_stay_with_the_core_on_the_thread_engine_or_without_bounce_memory(tmp_path):
    ep = NativeEndpoint(file_config(tmp_path / "a.img", io_engine="threads"), SUB_FILE)
    try:
        ep.buf.view[:512] = pattern(512)
        (w,) = ep.exchange(io_capsule(ep, WRITE, 1, 0, 0, 512))
        assert status_of(w) == 0 and ep.queue.stats()["file_commands"] == 0
        assert ep.queue.ring_fd is None
    finally:
        ep.close()


class _Namespace2ThroughTheCore(NativeEndpoint):
    """Namespace 2 of SUB_RAM is not registered with the device, so the core serves its Writes (their RDMA READs
    posted through the C queue by the Python side's book); namespace 1 stays native."""

    def region_of(self, backend):
        if backend is self.env.target.subsystem(SUB_RAM).namespaces[2].backend:
            return None
        return super().region_of(backend)


def _reads_in_flight_of_mixed_writes(max_reads: int) -> int:
    """Native and core Writes in one poll: the RDMA READs on the wire at once (held there: no completion is
    generated, so no credit comes back), then every Write answered once the wire runs."""
    ep = _Namespace2ThroughTheCore(standard_config(), SUB_RAM, max_reads=max_reads)
    try:
        for k in range(8):
            ep.device.deliver(io_capsule(ep, 0x01, 1, 8 * k, 7, 4096, offset=4096 * k, cid=k))
            ep.device.deliver(io_capsule(ep, 0x01, 2, 8 * k, 7, 4096, offset=4096 * k, cid=100 + k))
        ep.device.hold()
        ep.queue.poll()
        in_flight = ep.device.on_wire()  # only READs: a Write's response waits for its data
        ep.device.hold(False)
        pump(ep.queue)
        answers = {int.from_bytes(c[12:14], "little"): c[14:16] for c, _inv in ep.device.responses()}
        assert answers == {cid: b"\0\0" for cid in list(range(8)) + list(range(100, 108))}, answers
        host = ep.host_bytes()
        assert ep.namespace_bytes(SUB_RAM, 1)[:8 * 4096] == host[:8 * 4096]
        assert ep.namespace_bytes(SUB_RAM, 2)[:8 * 4096] == host[:8 * 4096]
        assert ep.queue.stats()["python_commands"] >= 8  # the core's Writes did go through the core
        return in_flight
    finally:
        ep.close()


@pytest.mark.parametrize("max_reads", [2, 4, 8])
def test_rdma_reads_in_flight_never_exceed_what_the_host_granted(max_reads):
    assert 0 < _reads_in_flight_of_mixed_writes(max_reads) <= max_reads


def test_a_single_rdma_read_credit_is_never_used_twice():
    assert _reads_in_flight_of_mixed_writes(1) <= 1


def test_a_ram_read_never_waits_behind_a_write_waiting_for_a_read_credit():
    """One READ credit: the first Write's READ holds it, the second Write waits for it; a Read behind them needs
    only send-queue entries, so its data and response go on the wire in the same poll (its own FIFO)."""
    ep = NativeEndpoint(standard_config(), SUB_RAM, max_reads=1)
    try:
        stored = pattern(4096, seed=61)
        ep.env.target.subsystem(SUB_RAM).namespaces[1].backend.buffer[64 * 512:64 * 512 + 4096] = stored
        ep.device.deliver(io_capsule(ep, WRITE, 1, 0, 7, 4096, offset=8192, cid=1))
        ep.device.deliver(io_capsule(ep, WRITE, 1, 8, 7, 4096, offset=12288, cid=2))
        ep.device.deliver(io_capsule(ep, READ, 1, 64, 7, 4096, offset=0, cid=3))
        ep.device.hold()
        ep.queue.poll()
        assert ep.device.on_wire() == 3  # READ of cid 1; WRITE and SEND of cid 3; cid 2 waits for the credit
        assert ep.queue.stats()["reads_free"] == 0
        ep.device.release()
        assert [cid_of(c) for c, _ in ep.device.responses()] == [3]
        assert ep.host_bytes()[:4096] == stored
        ep.device.hold(False)
        pump(ep.queue)
        assert sorted(cid_of(c) for c, _ in ep.device.responses()) == [1, 2]
        assert ep.queue.stats()["reads_free"] == 1
    finally:
        ep.close()


def cid_of(cqe: bytes) -> int:
    return int.from_bytes(cqe[12:14], "little")


def test_responses_batched_before_a_disconnect_are_sent_before_the_native_queue_closes():
    """Reads and a Disconnect in one poll: the Reads' responses and the Disconnect's own leave before the queue
    closes (nvmet answers the Disconnect, then tears the queue down); a capsule behind the Disconnect is not taken."""
    from nvmeof_roce.nvme import fabrics as F
    ep = NativeEndpoint(standard_config(), SUB_RAM)
    try:
        backend = ep.env.target.subsystem(SUB_RAM).namespaces[1].backend
        backend.buffer[:8 * 4096] = pattern(8 * 4096, seed=71)
        for i in range(8):
            assert ep.device.deliver(io_capsule(ep, READ, 1, 8 * i, 7, 4096, offset=4096 * i, cid=i)) == 0
        assert ep.device.deliver(F.DisconnectCommand(cid=100).to_sqe().pack()) == 0
        assert ep.device.deliver(io_capsule(ep, READ, 1, 0, 7, 4096, offset=0, cid=101)) == 0  # after it
        ep.queue.poll()
        assert ep.queue.closing and not ep.queue.closed  # the QP stays until the responses have left
        pump(ep.queue)
        answers = {cid_of(c): status_of(c) for c, _ in ep.device.responses()}
        assert answers == {**{i: 0 for i in range(8)}, 100: 0}, answers
        assert ep.host_bytes()[:8 * 4096] == bytes(backend.buffer[:8 * 4096])
        assert ep.queue.closed
    finally:
        ep.close()


def test_a_disconnect_alone_in_its_poll_is_answered_before_the_native_queue_closes():
    """Nothing else batched: the Disconnect's own response (made inside the core's batch) still leaves first."""
    from nvmeof_roce.nvme import fabrics as F
    ep = NativeEndpoint(standard_config(), SUB_RAM)
    try:
        assert ep.device.deliver(F.DisconnectCommand(cid=100).to_sqe().pack()) == 0
        pump(ep.queue)
        assert [(cid_of(c), status_of(c)) for c, _ in ep.device.responses()] == [(100, 0)]
        assert ep.queue.closed
    finally:
        ep.close()


def test_a_closed_native_queue_is_freed_with_its_memory():
    """The C queue holds its callbacks until it is freed: bound methods of the Python queue would make a cycle the
    collector cannot break (the C type is not in it), and every closed queue would stay, buffers and all."""
    import gc
    import weakref
    ep = NativeEndpoint(standard_config(), SUB_RAM)
    (cqe,) = ep.exchange(io_capsule(ep, READ, 1, 0, 7, 4096))
    assert status_of(cqe) == 0
    (cqe,) = ep.exchange(io_capsule(ep, READ, 9, 0, 7, 4096))  # through the core: the C queue called back
    assert status_of(cqe) == 0x400B
    queue, device = weakref.ref(ep.queue), weakref.ref(ep.device)
    ep.close()
    del ep
    gc.collect()
    assert queue() is None and device() is None


def test_a_native_queue_lives_through_one_checked_lifetime_on_both_sides():
    """SERVING -> CLOSING (a Disconnect's response still leaving) -> CLOSED -> RELEASED on the Python side, the C
    queue's state following it (csrc/nq_life.h); a move along no edge is refused on both sides."""
    from nvmeof_roce.nvme import fabrics as F
    from nvmeof_roce.transport.rdma.native_queue import IllegalQueueMove, QueueLife
    ep = NativeEndpoint(standard_config(), SUB_RAM)
    try:
        q = ep.queue
        assert q.life is QueueLife.SERVING and q.native.state == "SERVING"
        ep.device.hold(True)
        assert ep.device.deliver(F.DisconnectCommand(cid=100).to_sqe().pack()) == 0
        q.poll()
        assert q.life is QueueLife.CLOSING and q.closing and not q.closed and q.native.state == "CLOSING"
        q.peer_gone = True  # the host went meanwhile: nothing more leaves
        assert q.life is QueueLife.PEER_GONE
        with pytest.raises(IllegalQueueMove, match="peer gone -> closing"):
            q._move(QueueLife.CLOSING)
        ep.device.hold(False)
        q.close()
        assert q.life is QueueLife.RELEASED and q.closed and q.native.state == "RELEASED"
        q.peer_gone = True  # too late to matter: ignored
        assert q.life is QueueLife.RELEASED
        with pytest.raises(IllegalQueueMove):
            q._move(QueueLife.SERVING)
    finally:
        ep.close()


def test_the_flush_of_a_queue_whose_qp_went_to_error_is_reaped_before_the_qp_goes():
    """What the RDMA transport does between rdma_disconnect (the QP in the error state) and destroy_cm_qp: every
    work request on the wire flushes, and reap_flushed takes those completions off the CQs, delivering nothing;
    the C queue is FAILED (nothing more is posted), then close lets go of the slots."""
    ep = NativeEndpoint(standard_config(), SUB_RAM)
    try:
        q = ep.queue
        ep.device.hold(True)
        for i in range(4):
            assert ep.device.deliver(io_capsule(ep, READ, 1, 8 * i, 7, 4096, offset=4096 * i, cid=i)) == 0
        q.poll()
        assert q.native.stats()["send_queue_used"] == 4  # four WRITE + SEND pairs on the wire
        ep.device.qp_error()
        assert q.native.reap_flushed(0) == 0  # all of them came back, flushed
        stats = q.native.stats()
        assert q.native.state == "FAILED" and stats["flushed"] >= 8 and stats["failed"] == 5  # IBV_WC_WR_FLUSH_ERR
        with pytest.raises(ConnectionError):
            q.native.post_response(0, bytes(16), True, 0, 0, 0, 0, 0, -1)
        assert q.native.reap_flushed(0) == 0  # again: nothing left
        ep.device.hold(False)
        q.close()
        assert q.native.state == "RELEASED" and ep.device.responses() == []  # none of the flushed ones reached it
    finally:
        ep.close()
