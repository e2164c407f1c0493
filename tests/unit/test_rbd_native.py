"""RBD namespaces on the native data path (csrc/be_rbd.c) through the fake verbs provider (tests/native/fakeprov.c)
and the fake librbd (tests/unit/fakerbd/fakerbd.c): kernel-host-like commands served by the C queue through
librbd's C API, the data correct in the image; librbd's completions on another thread; each error window's NVMe
status (engine/io.py device_status); a queue closed, or freed, with librbd's calls still out; the namespace's
depth; an image that does not open in C left to the core."""
import errno
import gc
import logging

import pytest

from native_diff import io_capsule, pattern
from native_fake import needs_native
from rbd_fake import SUB, collect, cid_of, rbd_endpoint, rbd_ns, status_of, use_fake_rbd
from nvmeof_roce.nvme import status as S
from nvmeof_roce.transport.rdma import native_queue as nq_module

pytestmark = needs_native

READ, WRITE, FLUSH, WRITE_ZEROES = 0x02, 0x01, 0x00, 0x08
DEAC = 1 << 25
FUA = 1 << 30
SIZE = 4 << 20


@pytest.fixture
def rbd(monkeypatch):
    fake = use_fake_rbd(monkeypatch, {"img": SIZE})
    ep = rbd_endpoint([rbd_ns(1, "img")])
    yield fake, ep
    ep.close()


def image(fake, offset: int, length: int) -> bytes:
    return bytes(fake.images["img"][offset:offset + length])


def write(ep, slba, nlb, offset, cid, fua=False):
    return io_capsule(ep, WRITE, 1, slba, nlb - 1, nlb * 512, offset=offset, cid=cid, cdw12_hi=FUA >> 16 if fua else 0)


def read(ep, slba, nlb, offset, cid):
    return io_capsule(ep, READ, 1, slba, nlb - 1, nlb * 512, offset=offset, cid=cid)


def exchange(ep, *capsules):
    for capsule in capsules:
        assert ep.device.deliver(capsule) == 0
    return collect(ep, len(capsules))


def test_reads_writes_flush_and_write_zeroes_go_through_librbd_in_c(rbd):
    fake, ep = rbd
    data = pattern(8192, seed=5)
    ep.buf.view[65536:65536 + 8192] = data
    (w,) = exchange(ep, write(ep, 100, 16, 65536, cid=1, fua=True))
    assert status_of(w) == 0 and cid_of(w) == 1
    assert image(fake, 100 * 512, 8192) == data  # in the image once acknowledged
    fake.images["img"][300 * 512:300 * 512 + 4096] = pattern(4096, seed=9)
    (r,) = exchange(ep, read(ep, 300, 8, 0, cid=2))
    assert status_of(r) == 0 and ep.host_bytes()[:4096] == pattern(4096, seed=9)
    (f,) = exchange(ep, io_capsule(ep, FLUSH, 1, 0, 0, 0, cid=3))
    assert status_of(f) == 0
    # Write Zeroes, with and without DEAC: rbd_aio_write_zeroes both times (reads give zeros either way)
    (z1, z2) = exchange(ep, io_capsule(ep, WRITE_ZEROES, 1, 100, 7, 0, cid=4),
                        io_capsule(ep, WRITE_ZEROES, 1, 108, 7, 0, cid=5, cdw12_hi=DEAC >> 16))
    assert status_of(z1) == status_of(z2) == 0
    assert image(fake, 100 * 512, 8192) == bytes(8192)
    stats = ep.queue.stats()
    assert stats["python_commands"] == 1  # the Connect alone: every I/O command was the C queue's
    assert stats["file_commands"] == 5 and stats["file_handed_back"] == 0
    assert [fake.counter(k) for k in ("write", "read", "flush", "zeroes", "discard")] == [1, 1, 1, 2, 0]
    # the client the C entry opened: the namespace's settings, the cache off and the timeouts, as the Python path
    assert fake.conf("rbd_cache") == "false" and fake.conf("rados_osd_op_timeout") == "10"
    assert fake.conf("rados_mon_op_timeout") == "10" and fake.conf("name") == "client.admin"
    assert fake.conf("pool") == "rbd"
    # and its own: librbd dispatches in the poll's thread, librados' throttle (which would sleep there) off
    assert fake.conf("rbd_non_blocking_aio") == "false"
    assert fake.conf("objecter_inflight_ops") == fake.conf("objecter_inflight_op_bytes") == "0"
    # the figures reach the namespace, the native handle's status with them
    ns = ep.env.target.subsystem("nqn.2024-01.io.test:rbd-native").namespaces[1]
    ep.env.target.tick(ep.env.clock())
    assert ns.read_commands == 1 and ns.write_commands == 1 and ns.bytes_written == 8192
    assert ns.engine_status()["native_in_flight"] == 0


def test_in_capsule_writes_and_many_at_once_are_all_in_the_image(rbd):
    fake, ep = rbd
    inline = pattern(2048, seed=11)
    (w,) = exchange(ep, io_capsule(ep, WRITE, 1, 40, 3, 2048, sgl_id=0x01, offset=0, cid=7, extra=inline))
    assert status_of(w) == 0 and image(fake, 40 * 512, 2048) == inline
    fake.hold()
    data = pattern(32 * 4096, seed=12)
    ep.buf.view[:len(data)] = data
    for i in range(32):
        assert ep.device.deliver(write(ep, 1000 + 8 * i, 8, 4096 * i, cid=100 + i)) == 0
    collect(ep, 0)
    assert fake.held() == 32  # every one on librbd at once (the namespace's depth is 32... and the queue's)
    fake.release()
    answers = collect(ep, 32)
    assert sorted(cid_of(c) for c in answers) == list(range(100, 132)) and not any(map(status_of, answers))
    assert image(fake, 1000 * 512, len(data)) == data


def test_a_write_gives_its_bounce_chunk_back_once_librbd_has_it_so_in_capsule_writes_stay_in_c(monkeypatch):
    # One chunk, the responses held on the wire: the first Write's chunk goes back when librbd completes it, not
    # when its response's SEND completes, so the next in-capsule Write (whose data has nowhere to wait for a
    # chunk) is the C queue's too instead of the core's (bench --rbd's 4 KiB writes at QD32 on 32 chunks).
    fake = use_fake_rbd(monkeypatch, {"img": SIZE})
    ep = rbd_endpoint([rbd_ns(1, "img")], file_buffers=1)
    try:
        first, second = pattern(4096, seed=21), pattern(4096, seed=22)
        ep.device.hold()
        assert ep.device.deliver(io_capsule(ep, WRITE, 1, 8, 7, 4096, sgl_id=0x01, offset=0, cid=1,
                                            extra=first)) == 0
        collect(ep, 0)  # librbd completed it: its response is on the (held) wire
        assert ep.queue.stats()["bounce_chunks_free"] == 1
        assert ep.device.deliver(io_capsule(ep, WRITE, 1, 16, 7, 4096, sgl_id=0x01, offset=0, cid=2,
                                            extra=second)) == 0
        collect(ep, 0)
        ep.device.hold(False)
        ep.device.release()
        answers = collect(ep, 2)
        assert sorted(map(cid_of, answers)) == [1, 2] and not any(map(status_of, answers))
        assert image(fake, 8 * 512, 4096) == first and image(fake, 16 * 512, 4096) == second
        stats = ep.queue.stats()
        assert stats["python_commands"] == 1 and stats["file_commands"] == 2  # the Connect alone went to the core
        assert stats["bounce_chunks_free"] == 1
    finally:
        ep.close()


def test_a_reads_data_is_what_the_image_holds_when_librbd_completes_it(rbd):
    """The fake moves a held Read's bytes at completion time, into the buffer it was given: the bounce chunk the
    queue sends from afterwards."""
    fake, ep = rbd
    fake.hold()
    assert ep.device.deliver(read(ep, 0, 8, 0, cid=1)) == 0
    collect(ep, 0)
    assert fake.held() == 1
    fake.images["img"][:4096] = pattern(4096, seed=21)  # written after the call, before its completion
    fake.release()
    (r,) = collect(ep, 1)
    assert status_of(r) == 0 and ep.host_bytes()[:4096] == pattern(4096, seed=21)


@pytest.mark.parametrize("err, status", [(errno.ETIMEDOUT, S.ANA_TRANSITION), (errno.ESHUTDOWN, S.ANA_INACCESSIBLE)])
@pytest.mark.parametrize("opc", [READ, WRITE, FLUSH, WRITE_ZEROES])
def test_a_cluster_that_times_out_or_fenced_us_is_a_path_error_answered_in_c(rbd, err, status, opc, caplog):
    """As engine/io.py device_status: ANA Transition (ETIMEDOUT) and ANA Inaccessible (ESHUTDOWN), no DNR, so the
    host's multipath retries elsewhere; answered at once, not done again (the Python path would wait again); the
    C path counts it and the namespace logs it (Namespace.log_store_errors, from the target's tick), once."""
    fake, ep = rbd
    ep.buf.view[:4096] = pattern(4096, seed=2)
    before = image(fake, 0, 4096)
    fake.hold()
    length = 4096 if opc in (READ, WRITE) else 0
    assert ep.device.deliver(io_capsule(ep, opc, 1, 0, 7, length, cid=5)) == 0
    collect(ep, 0)
    fake.release(err=err)
    (c,) = collect(ep, 1)
    assert status_of(c) == status and not status_of(c) & S.DNR
    assert image(fake, 0, 4096) == before  # a failed write moved nothing
    assert ep.queue.stats()["file_handed_back"] == 0 and fake.stand_ins["img"].calls == 0
    ns = ep.env.target.subsystem(SUB).namespaces[1]
    counted = ns.native_file.status()
    assert (counted["timed_out"], counted["fenced"]) == ((1, 0) if err == errno.ETIMEDOUT else (0, 1))
    with caplog.at_level(logging.ERROR, logger="nvmeof_roce.engine.subsystem"):
        ns.log_store_errors()
        ns.log_store_errors()  # nothing new: said once
    said = [r.getMessage() for r in caplog.records if "native data path" in r.getMessage()]
    assert len(said) == 1 and ("timed out" if err == errno.ETIMEDOUT else "fenced") in said[0], said
    fake.hold(False)
    (again,) = exchange(ep, read(ep, 0, 8, 0, cid=6))  # the queue goes on
    assert status_of(again) == 0


@pytest.mark.parametrize("how", ["completion", "submission"])
def test_any_other_error_goes_to_the_core_which_does_it_again_on_the_reference_path(rbd, how):
    fake, ep = rbd
    data = pattern(4096, seed=8)
    ep.buf.view[:4096] = data
    (fake.fail if how == "completion" else fake.refuse)(errno.EIO)
    (w,) = exchange(ep, write(ep, 16, 8, 0, cid=1))
    assert status_of(w) == 0 and image(fake, 16 * 512, 4096) == data  # the core's librbd write did it
    assert ep.queue.stats()["file_handed_back"] == 1 and fake.stand_ins["img"].calls == 1
    # the core fails too: its status and error log (Internal Error, DNR), as for any device error
    fake.fail(errno.EIO)
    fake.stand_ins["img"].fail_next = errno.EIO
    (r,) = exchange(ep, read(ep, 16, 8, 0, cid=2))
    assert status_of(r) == S.INTERNAL | S.DNR


def test_a_queue_closed_with_a_stalled_completion_keeps_its_memory_until_librbd_lets_go(rbd, caplog):
    """A write acknowledged, then a write and a read stalled on librbd when the queue closes: the close does not
    wait (the loop goes on) and reports them; the acknowledged write is in the image; the late completions touch
    nothing of the queue (ASan, make test-native), the late write's bytes still come from its chunk, kept; the
    image closes once the namespace goes and the calls are back."""
    fake, ep = rbd
    data = pattern(8192, seed=31)
    ep.buf.view[:8192] = data
    (w,) = exchange(ep, write(ep, 0, 8, 0, cid=1))
    assert status_of(w) == 0
    fake.hold()
    for capsule in (write(ep, 64, 8, 4096, cid=2), read(ep, 0, 8, 65536, cid=3)):
        assert ep.device.deliver(capsule) == 0
    collect(ep, 0)
    assert fake.held() == 2
    queue = ep.queue
    with caplog.at_level(logging.WARNING):
        queue.close()
    assert queue.held == 2 and "2 commands still on the device" in caplog.text
    assert queue.bounce is not None and nq_module.closing_queues()
    fake.release(1)  # the write: its data still read from the kept chunk
    queue.reap_closed()
    assert queue.held == 1
    fake.release()
    queue.reap_closed()
    assert queue.held == 0 and queue.bounce is None
    ns = ep.env.target.subsystem("nqn.2024-01.io.test:rbd-native").namespaces[1]
    assert ns.native_file.status()["in_flight"] == 0  # the namespace's depth is whole again
    assert image(fake, 0, 4096) == data[:4096]  # acknowledged before the close
    assert image(fake, 64 * 512, 4096) == data[4096:]  # completed after it, from its kept chunk
    ep.env.close()
    gc.collect()
    assert fake.counter("open_images") == 0 and fake.counter("shutdowns") == fake.counter("connects")


def test_the_namespace_removed_and_the_queue_freed_with_calls_out_close_the_image_after_them(rbd):
    """The worst order: the queue closed and freed and the namespace gone while librbd holds calls; their
    completions arrive last.  The per-queue state is freed by the last completion, the image closed by its own
    thread once its calls are back (the fake aborts on an rbd_close under held calls)."""
    fake, ep = rbd
    fake.hold()
    for i in range(3):
        assert ep.device.deliver(read(ep, 8 * i, 8, 4096 * i, cid=i)) == 0
    collect(ep, 0)
    queue = ep.queue
    queue.close()
    assert queue.held == 3
    nq_module.CLOSING.clear()  # nobody waits for it any more: the C queue is freed below
    native = queue.native
    queue.native = None
    del native
    gc.collect()
    ep.env.close()
    gc.collect()
    assert fake.counter("open_images") == 1  # its calls are out: not closed under them
    fake.release()
    for _ in range(200):
        if fake.counter("open_images") == 0:
            break
        import time
        time.sleep(0.01)
    assert fake.counter("open_images") == 0


def test_the_namespaces_depth_bounds_its_calls_on_librbd(monkeypatch):
    fake = use_fake_rbd(monkeypatch, {"img": SIZE})
    ep = rbd_endpoint([rbd_ns(1, "img", queue_depth=2)])
    try:
        fake.hold()
        for i in range(8):
            assert ep.device.deliver(read(ep, 8 * i, 8, 4096 * i, cid=i)) == 0
        collect(ep, 0)
        answered = []
        for _ in range(8):
            assert fake.held() <= 2
            fake.release(1)
            answered += collect(ep, 1)
            if len(answered) == 8:
                break
        assert sorted(map(cid_of, answered)) == list(range(8)) and not any(map(status_of, answered))
        assert ep.queue.stats()["file_commands"] == 8
    finally:
        ep.close()


def test_an_image_the_c_entry_cannot_open_is_served_by_the_core(monkeypatch, caplog):
    fake = use_fake_rbd(monkeypatch, {"img": SIZE})
    fake.connect_error(errno.ETIMEDOUT)
    with caplog.at_level(logging.WARNING):
        ep = rbd_endpoint([rbd_ns(1, "img")])
    try:
        ep.buf.view[:4096] = pattern(4096, seed=4)
        (w,) = exchange(ep, write(ep, 8, 8, 0, cid=1))
        assert status_of(w) == 0 and image(fake, 8 * 512, 4096) == pattern(4096, seed=4)
        assert ep.queue.stats()["file_commands"] == 0 and fake.stand_ins["img"].calls == 1
        assert "the native data path cannot open it" in caplog.text
        assert fake.counter("connects") == 1  # tried once, not on every view
    finally:
        ep.close()


def test_the_module_loads_without_librbd_and_names_what_is_missing():
    from nvmeof_roce import native
    with pytest.raises(OSError, match="cannot load /nonexistent/librados.so.2"):
        native.module.RbdImage("/nonexistent/librados.so.2", "/nonexistent/librbd.so.1", None, "client.admin",
                               "rbd", "", "img", [], 32)


def test_poll_group_threads_serve_rbd_namespaces_while_librbd_completes_on_its_own_thread(monkeypatch):
    """Two queues on poll-group threads (--cores) and librbd's completions from the fake's thread at the same
    time (make test-native runs this under TSan): every write in the image, every read back, a path error
    answered on the thread, an EIO mailed to the core."""
    import threading
    from nvmeof_roce import native
    from nvmeof_roce.transport.eventloop import EventLoop
    from nvmeof_roce.transport.rdma.pollgroups import PollGroups
    from test_native_poll import _await
    fake = use_fake_rbd(monkeypatch, {"img0": SIZE, "img1": SIZE})
    eps = [rbd_endpoint([rbd_ns(1, f"img{i}")], depth=64, file_buffers=8) for i in range(2)]
    loop = EventLoop(eps[0].env.target)
    groups = PollGroups(native.module, 2)
    stop = threading.Event()

    def librbd():  # completes what is held, one call at a time, while the groups' threads poll
        while not stop.is_set():
            if not fake.release(1):
                stop.wait(0.0005)
    completer = threading.Thread(target=librbd)
    try:
        for ep in eps:
            ep.queue.start_polling(loop, "busy", poll_groups=groups)
        fake.hold()
        completer.start()
        count = 24
        for i, ep in enumerate(eps):
            ep.buf.view[:count * 4096] = pattern(count * 4096, seed=50 + i)
            for k in range(count):
                assert ep.device.deliver(write(ep, 8 * k, 8, 4096 * k, cid=k)) == 0
        got = _await(loop, eps, {ep: count for ep in eps})
        assert all(status_of(c) == 0 for ep in eps for c in got[ep])
        for i, ep in enumerate(eps):
            assert bytes(fake.images[f"img{i}"][:count * 4096]) == pattern(count * 4096, seed=50 + i)
            for k in range(count):
                assert ep.device.deliver(read(ep, 8 * k, 8, 524288 + 4096 * k, cid=100 + k)) == 0
        got = _await(loop, eps, {ep: count for ep in eps})
        assert all(status_of(c) == 0 for ep in eps for c in got[ep])
        for i, ep in enumerate(eps):
            assert ep.host_bytes()[524288:524288 + count * 4096] == pattern(count * 4096, seed=50 + i)
        for ep in eps:  # one at a time: which call the fake fails is then known
            fake.fail(errno.ETIMEDOUT)
            assert ep.device.deliver(read(ep, 0, 8, 0, cid=900)) == 0
            (c,) = _await(loop, [ep], {ep: 1})[ep]
            assert status_of(c) == S.ANA_TRANSITION
            fake.fail(errno.EIO)
            assert ep.device.deliver(read(ep, 0, 8, 0, cid=901)) == 0
            (c,) = _await(loop, [ep], {ep: 1})[ep]
            assert status_of(c) == 0  # the core did it again, through the stand-in
            stats = ep.queue.stats()
            assert stats["threaded"] == 1 and stats["file_handed_back"] == 1 and stats["file_commands"] == 2 * count + 2
    finally:
        stop.set()
        if completer.is_alive():
            completer.join()
        fake.hold(False)
        fake.release()
        for ep in eps:
            ep.close()
        groups.close()
        loop.close()


def test_the_image_opens_in_c_off_the_loop_and_the_core_serves_it_meanwhile(monkeypatch):
    """A cluster slow to answer the C entry's connect: the view refresh does not wait for it (a thread opens the
    image); the namespace's commands are the core's until the handle is there, then the C queue's."""
    import time
    from nvmeof_roce.engine import fast_path_view
    fake = use_fake_rbd(monkeypatch, {"img": SIZE})
    fake.hold_connect()
    started = time.monotonic()
    ep = rbd_endpoint([rbd_ns(1, "img")], wait=False)
    try:
        assert time.monotonic() - started < 5
        ns = ep.env.target.subsystem("nqn.2024-01.io.test:rbd-native").namespaces[1]
        assert ns.backend.native_opening.is_alive() and ns.native_file is None
        ep.buf.view[:4096] = pattern(4096, seed=61)
        (w,) = exchange(ep, write(ep, 8, 8, 0, cid=1))
        assert status_of(w) == 0 and image(fake, 8 * 512, 4096) == pattern(4096, seed=61)
        assert ep.queue.stats()["file_commands"] == 0  # the core's, through the reference path
        fake.hold_connect(False)
        ns.backend.native_opening.join(10)
        fast_path_view.refresh_all(ep.env.target)  # as the core's next capsule does
        (r,) = exchange(ep, read(ep, 8, 8, 65536, cid=2))
        assert status_of(r) == 0 and ep.host_bytes()[65536:65536 + 4096] == pattern(4096, seed=61)
        assert ep.queue.stats()["file_commands"] == 1 and ns.native_file is not None
    finally:
        fake.hold_connect(False)
        ep.close()


def test_a_namespace_removed_with_calls_on_librbd_keeps_its_image_until_they_complete(rbd):
    """The namespace retired while reads are held on librbd: they were accepted before the removal and complete as
    nvmet's would; the image stays open under them (the fake aborts on an rbd_close under held calls) and closes
    once the last is back and the namespace is gone."""
    from loopback_env import remove_namespace
    fake, ep = rbd
    stored = pattern(4 * 4096, seed=71)
    fake.images["img"][:len(stored)] = stored
    fake.hold()
    for i in range(4):
        assert ep.device.deliver(read(ep, 8 * i, 8, 4096 * i, cid=i)) == 0
    collect(ep, 0)
    assert fake.held() == 4
    remove_namespace(ep.env.target, "nqn.2024-01.io.test:rbd-native", 1)
    gc.collect()
    assert fake.counter("open_images") == 1  # the C side's image is still open under its calls
    fake.release()
    answers = collect(ep, 4)
    assert sorted(cid_of(c) for c in answers) == [0, 1, 2, 3] and not any(map(status_of, answers))
    assert ep.host_bytes()[:len(stored)] == stored
    gc.collect()
    for _ in range(200):  # the last reference went with the last command: closed (a thread if calls were out)
        if fake.counter("open_images") == 0:
            break
        import time
        time.sleep(0.01)
    assert fake.counter("open_images") == 0


def test_the_native_handle_names_its_rados_clients_address_for_fencing(rbd):
    """A gateway group fences a gateway by blocklisting every RADOS client it serves through, the native
    handle's own client too: the handle gives its address as librados words it (rados_getaddrs)."""
    fake, ep = rbd
    ns = ep.env.target.subsystem(SUB).namespaces[1]
    assert ns.native_file.addrs() == "[v2:127.0.0.1:0/4242,v1:127.0.0.1:0/4242]"
