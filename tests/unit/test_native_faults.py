"""The native data path (csrc/nq_hot.c, csrc/nq_type.c) against the fault model: the windows where data could be lost.

The fake verbs provider (tests/native/fakeprov.c) moves a work request's data when its completion is generated,
not when it is posted; a test holds the wire to look between the two, makes a post fail, or moves the QP to the
error state.  The io_uring test hook (`_native.uring_inject`, csrc/uring.c) fails or stalls ring completions.
Each test checks what the host was told against where the data is.
"""
import errno
from typing import Tuple
import logging
import select
import time

import pytest

from loopback_env import HOST_A, RAW_HOSTID, SUB_FILE, SUB_RAM, pause_and_fence, ram_ns, standard_config
from native_diff import LoopbackEndpoint, NativeEndpoint, close_all, io_capsule, pattern
from native_fake import FakeDevice, native_queue, needs_native, pump
from nvmeof_roce import native
from nvmeof_roce.nvme import fabrics as F
from nvmeof_roce.nvme.sgl import SglDescriptor
from nvmeof_roce.transport.rdma.native_queue import CLOSING, closing_queues
from test_native_queue import file_bytes, file_config, put_file, status_of

pytestmark = needs_native

READ, WRITE = 0x02, 0x01
IBV_WC_WR_FLUSH_ERR = 5
INTERNAL_ERROR_DNR = 0x4006


def cid_of(cqe: bytes) -> int:
    return int.from_bytes(cqe[12:14], "little")


@pytest.fixture(autouse=True)
def uring_faults_disarmed():
    """The ring's fault injection is process-wide: every test starts and ends with none armed or held."""
    yield
    native.module.uring_inject("none")
    native.module.uring_release()
    for queue in list(CLOSING.values()):  # a queue a test closed with a held command: its memory let go now
        queue.reap_closed()


@pytest.fixture
def endpoints():
    """`endpoints(config, subnqn, **kw)`: a NativeEndpoint, closed after the test."""
    made = []

    def make(config, subnqn, **kw) -> NativeEndpoint:
        made.append(NativeEndpoint(config, subnqn, **kw))
        return made[-1]

    yield make
    for ep in made:
        ep.close()


@pytest.fixture
def ram_ep(endpoints):
    return endpoints(standard_config(), SUB_RAM)


@pytest.fixture
def file_ep(endpoints, tmp_path):
    return endpoints(file_config(tmp_path / "ns.img"), SUB_FILE)


class OtherQueue:
    """A second native I/O queue of the same controller, on a fake device (a QP) of its own."""

    def __init__(self, ep: NativeEndpoint, qid: int, subnqn: str = SUB_RAM):
        self.device = FakeDevice()
        self.regions = {}
        handler = ep.env.target.port(1)
        self.queue = native_queue(self.device, handler, qid=qid, region_of=self.region_of)
        handler.queue_opened(self.queue)
        self.buf = self.device.remote(1 << 20)
        self.buf_addr, self.buf_key = self.buf.addr, self.buf.lkey
        cntlid = next(iter(ep.env.target.controllers())).cntlid
        self.buf.view[:1024] = F.ConnectData(RAW_HOSTID, cntlid, subnqn, HOST_A).pack()
        sqe = F.ConnectCommand(qid=qid, sqsize=31, sgl=SglDescriptor.keyed(self.buf_addr, 1024, self.buf_key)).to_sqe()
        (answer,) = self.exchange(sqe.pack())
        assert status_of(answer) == 0, answer

    def region_of(self, backend):
        if id(backend) not in self.regions:
            self.regions[id(backend)] = self.device.register_local(backend.pin())
        return self.regions[id(backend)]

    def exchange(self, capsule: bytes):
        assert self.device.deliver(capsule) == 0
        pump(self.queue)
        return [cqe for cqe, _ in self.device.responses()]

    def close(self):
        self.queue.close()
        self.device.close()


def poll_until(ep, done) -> None:
    """Poll the queue, waking on its ring's eventfd, until `done()` (the kernel completes a ring command in its own
    time); at most 10 s."""
    deadline = time.monotonic() + 10
    while not done():
        assert time.monotonic() < deadline, "the ring's commands did not complete in 10 s"
        ep.queue.poll()
        select.select([ep.queue.ring_fd], [], [], 0.05)


def poll_until_stalled(ep, held: int = 1) -> None:
    """Until the ring hook holds `held` completions, then a few polls more (nothing may come of them)."""
    poll_until(ep, lambda: native.module.uring_faults()["held"] >= held)
    for _ in range(3):
        ep.queue.poll()


def stall_on_the_ring(ep, capsule: bytes) -> None:
    """The capsule's command taken by the queue and its ring completion held by the hook (one stall armed)."""
    native.module.uring_inject("stall", 1)
    assert ep.device.deliver(capsule) == 0
    poll_until_stalled(ep)


def read_held_on_the_wire(ep) -> None:
    """A 4 KiB Read of LBA 16 (cid 5) taken with the wire held: its data WRITE, chained to the response SEND, and
    the SEND are posted, neither moved."""
    ep.device.hold()
    assert ep.device.deliver(io_capsule(ep, READ, 1, 16, 7, 4096, cid=5)) == 0
    ep.queue.poll()
    assert ep.device.on_wire() == 2


def pause_behind_a_read_on_the_wire(ep) -> Tuple[list, list]:
    """read_held_on_the_wire, then a pause of its namespace, whose fence waits for it: (the list that gets the count
    of work requests on the wire when the fence is done, what to resume)."""
    read_held_on_the_wire(ep)
    on_wire_when_drained = []
    paused = pause_and_fence(ep.env.target, SUB_RAM, 1, lambda: on_wire_when_drained.append(ep.device.on_wire()))
    assert on_wire_when_drained == []
    return on_wire_when_drained, paused


# ------------------------------------------------------------------------------------------ DMA at completion

def test_a_reads_data_and_response_reach_the_host_only_when_the_wire_completes_them(ram_ep):
    ep = ram_ep
    stored = pattern(4096, seed=41)
    ep.env.target.subsystem(SUB_RAM).namespaces[1].backend.buffer[16 * 512:16 * 512 + 4096] = stored
    before = ep.host_bytes()[:4096]
    assert before != stored
    read_held_on_the_wire(ep)
    for _ in range(3):
        ep.queue.poll()
    assert ep.device.responses() == []
    assert ep.host_bytes()[:4096] == before  # posted is not moved
    assert ep.queue.stats()["native_in_flight"] == 1
    assert ep.device.release(1) == 1  # the WRITE: the data is the host's now, the response still on the wire
    assert ep.host_bytes()[:4096] == stored
    assert ep.device.responses() == []
    assert ep.device.release() == 0
    ((cqe, _),) = ep.device.responses()
    assert cid_of(cqe) == 5 and status_of(cqe) == 0
    ep.device.hold(False)
    pump(ep.queue)
    assert ep.queue.stats()["native_in_flight"] == 0


def test_a_writes_data_lands_only_when_its_rdma_read_completes_and_is_answered_after(ram_ep):
    ep = ram_ep
    data = pattern(4096, seed=43)
    ep.buf.view[65536:65536 + 4096] = data
    before = ep.namespace_bytes(SUB_RAM, 1)[64 * 512:64 * 512 + 4096]
    assert before != data
    ep.device.hold()
    assert ep.device.deliver(io_capsule(ep, WRITE, 1, 64, 7, 4096, offset=65536, cid=6)) == 0
    for _ in range(3):
        ep.queue.poll()
    assert ep.device.on_wire() == 1  # the RDMA READ of the host's data
    assert ep.namespace_bytes(SUB_RAM, 1)[64 * 512:64 * 512 + 4096] == before
    assert ep.device.release() == 0
    assert ep.namespace_bytes(SUB_RAM, 1)[64 * 512:64 * 512 + 4096] == data
    assert ep.device.responses() == []  # not answered before the queue saw the READ complete
    ep.queue.poll()  # reaps the READ's completion, posts the response
    assert ep.device.on_wire() == 1 and ep.device.responses() == []
    ep.device.release()
    ((cqe, _),) = ep.device.responses()
    assert cid_of(cqe) == 6 and status_of(cqe) == 0


def test_a_batch_held_on_the_wire_completes_in_post_order_with_every_byte_right(ram_ep):
    ep = ram_ep
    ns = ep.env.target.subsystem(SUB_RAM).namespaces[1].backend.buffer
    stored = pattern(8 * 4096, seed=47)
    ns[:8 * 4096] = stored
    ep.device.hold()
    for cid in range(8):
        assert ep.device.deliver(io_capsule(ep, READ, 1, 8 * cid, 7, 4096, offset=4096 * cid, cid=cid)) == 0
    ep.queue.poll()
    assert ep.device.on_wire() == 16
    assert ep.device.release(7) == 9  # three whole Reads and the data of a fourth
    assert [cid_of(c) for c, _ in ep.device.responses()] == [0, 1, 2]
    assert ep.host_bytes()[:4 * 4096] == stored[:4 * 4096]
    ep.device.hold(False)
    pump(ep.queue)
    assert [cid_of(c) for c, _ in ep.device.responses()] == [3, 4, 5, 6, 7]
    assert ep.host_bytes()[:8 * 4096] == stored


def test_a_file_writes_ring_write_waits_for_its_rdma_read_to_complete(file_ep, tmp_path):
    ep = file_ep
    path = tmp_path / "ns.img"
    data = pattern(4096, seed=89)
    ep.buf.view[:4096] = data
    before = file_bytes(path, 32 * 512, 4096)
    ep.device.hold()
    assert ep.device.deliver(io_capsule(ep, WRITE, 1, 32, 7, 4096, cid=2)) == 0
    for _ in range(3):
        ep.queue.poll()
    assert ep.device.on_wire() == 1 and ep.queue.stats()["ring_in_flight"] == 0  # the bounce chunk is not filled
    assert file_bytes(path, 32 * 512, 4096) == before
    ep.device.hold(False)
    ep.settle()
    ((cqe, _),) = ep.device.responses()
    assert cid_of(cqe) == 2 and status_of(cqe) == 0
    assert file_bytes(path, 32 * 512, 4096) == data


def test_a_file_reads_bounce_chunk_is_not_reused_while_its_data_is_on_the_wire(endpoints, tmp_path):
    path = tmp_path / "ns.img"
    ep = endpoints(file_config(path), SUB_FILE, file_buffers=1)
    stored = pattern(2 * 4096, seed=97)
    put_file(path, 0, stored)
    ep.device.hold()
    for cid in range(2):
        assert ep.device.deliver(io_capsule(ep, READ, 1, 8 * cid, 7, 4096, offset=4096 * cid, cid=cid)) == 0
    poll_until(ep, lambda: ep.device.on_wire() == 2)  # the first Read's WRITE and SEND, from the one chunk
    for _ in range(3):
        ep.queue.poll()
    stats = ep.queue.stats()
    assert stats["bounce_chunks_free"] == 0 and stats["ring_in_flight"] == 0 and ep.device.on_wire() == 2
    ep.device.hold(False)
    ep.settle()
    assert sorted((cid_of(c), status_of(c)) for c, _ in ep.device.responses()) == [(0, 0), (1, 0)]
    assert ep.host_bytes()[:2 * 4096] == stored
    assert ep.queue.stats()["chunk_waits"] == 1


# ------------------------------------------------------------------------------------------ post failures

@pytest.mark.parametrize("which,err", [("send", errno.ENOMEM), ("send", errno.EINVAL), ("recv", errno.ENOMEM)])
def test_a_failed_post_closes_the_queue_and_the_target_serves_the_others(ram_ep, caplog, which, err):
    ep = ram_ep
    other = OtherQueue(ep, qid=2)
    try:
        ep.device.fail_post(which, err)
        with caplog.at_level(logging.WARNING):
            assert ep.device.deliver(io_capsule(ep, READ, 1, 0, 7, 4096, cid=3)) == 0
            pump(ep.queue)
        assert ep.device.counters()["post_faults"] == 1
        assert ep.queue.closed
        assert ep.device.responses() == []  # a refused post moved nothing and answered nothing
        closing = [r.getMessage() for r in caplog.records if "queue 1" in r.getMessage()]
        assert any(f"posting work requests failed: {errno.errorcode[err]}" in m and "closing the queue" in m
               for m in closing), closing
        # the admin queue and the other I/O queue go on
        assert ep.admin.command(F.PropertyGet(offset=F.PROP_CSTS)).status == 0
        data = pattern(4096, seed=53)
        other.buf.view[:4096] = data
        (w,) = other.exchange(io_capsule(other, WRITE, 1, 300, 7, 4096, cid=1))
        other.buf.view[:4096] = bytes(4096)
        (r,) = other.exchange(io_capsule(other, READ, 1, 300, 7, 4096, cid=2))
        assert status_of(w) == 0 and status_of(r) == 0
        assert bytes(other.buf.view[:4096]) == data
    finally:
        other.close()


def test_the_log_line_of_a_failed_post_names_the_post_and_its_errno(ram_ep, caplog):
    ep = ram_ep
    ep.device.fail_post("send", errno.ENOMEM)
    with caplog.at_level(logging.WARNING):
        assert ep.device.deliver(io_capsule(ep, READ, 1, 0, 7, 4096)) == 0
        pump(ep.queue)
    assert ep.queue.closed
    messages = [r.getMessage() for r in caplog.records]
    assert any("post" in m and "ENOMEM" in m for m in messages), messages


def test_the_nth_post_fails_and_the_ones_before_it_are_served(ram_ep):
    ep = ram_ep
    ep.device.fail_post("send", errno.ENOMEM, nth=2)
    (first,) = ep.exchange(io_capsule(ep, READ, 1, 0, 7, 4096, cid=1))
    assert status_of(first) == 0 and not ep.queue.closed
    assert ep.exchange(io_capsule(ep, READ, 1, 0, 7, 4096, cid=2)) == []
    assert ep.queue.closed


def test_a_queue_a_failed_post_closes_is_off_the_wire_before_a_pending_pause_can_drain(ram_ep):
    """A Read's data WRITE and response are on the wire while a resize pauses the subsystem; then a post fails and
    the queue closes.  The core stops counting the queue's commands when it hears of the close, so the pause may
    drain then and its change let the old memory go: by then nothing of the queue may be left on the wire."""
    ep = ram_ep
    target = ep.env.target
    on_wire_when_drained, paused = pause_behind_a_read_on_the_wire(ep)
    ep.device.fail_post("recv", errno.EINVAL)  # the next capsule's receive is re-posted: refused
    assert ep.device.deliver(io_capsule(ep, READ, 1, 0, 7, 4096, cid=6)) == 0
    ep.queue.poll()
    assert ep.queue.closed and ep.device.counters()["post_faults"] == 1
    assert on_wire_when_drained == [0]  # drained once the QP was gone, not while its work requests were on the wire
    assert ep.device.responses() == []  # flushed: nothing moved or answered after the close
    target.resume_namespaces(paused)


def test_a_queue_closing_on_a_disconnect_counts_its_work_on_the_wire_for_a_pending_pause(ram_ep):
    """The core closes a queue on its Disconnect at once, but the queue still sends what it answered before (a
    Read's data from the namespace's memory): a pause waiting meanwhile drains only when that has left."""
    ep = ram_ep
    target = ep.env.target
    on_wire_when_drained, paused = pause_behind_a_read_on_the_wire(ep)
    assert ep.device.deliver(F.DisconnectCommand(cid=100).to_sqe().pack()) == 0
    ep.queue.poll()
    assert ep.queue.closing and on_wire_when_drained == []  # the Read's data and response still on the wire
    ep.device.release()
    ep.device.hold(False)
    pump(ep.queue)
    assert ep.queue.closed and on_wire_when_drained == [0]
    assert sorted(cid_of(cqe) for cqe, _ in ep.device.responses()) == [5, 100]
    target.resume_namespaces(paused)


# ------------------------------------------------------------------------------------------ QP in error

def test_a_qp_error_flushes_everything_and_no_command_whose_data_never_moved_is_answered(ram_ep, caplog):
    ep = ram_ep
    ns = ep.env.target.subsystem(SUB_RAM).namespaces[1].backend.buffer
    stored = bytes(ns[:4 * 4096])
    host_before = ep.host_bytes()[:4 * 4096]
    ep.buf.view[512 * 1024:512 * 1024 + 4 * 4096] = pattern(4 * 4096, seed=59)
    ep.device.hold()
    for cid in range(4):  # four Reads (WRITE + SEND each) and four Writes (an RDMA READ each)
        assert ep.device.deliver(io_capsule(ep, READ, 1, 8 * cid, 7, 4096, offset=4096 * cid, cid=cid)) == 0
        assert ep.device.deliver(io_capsule(ep, WRITE, 1, 8 * cid, 7, 4096, offset=512 * 1024 + 4096 * cid,
                                            cid=10 + cid)) == 0
    ep.queue.poll()
    on_wire, receives = ep.device.on_wire(), ep.device.counters()["recvs_posted"]
    assert on_wire == 12 and receives > 0
    ep.device.qp_error()
    counters = ep.device.counters()
    assert counters["qp_error"] == 1 and counters["on_wire"] == 0 and counters["recvs_posted"] == 0
    assert counters["flushed"] == on_wire + receives  # the receives are flushed too
    with caplog.at_level(logging.WARNING):
        pump(ep.queue)
    assert ep.queue.closed
    assert any(f"status {IBV_WC_WR_FLUSH_ERR}" in r.getMessage() for r in caplog.records)
    assert ep.device.responses() == []  # no command answered: none of their data moved
    assert ep.host_bytes()[:4 * 4096] == host_before
    assert bytes(ns[:4 * 4096]) == stored
    assert ep.device.deliver(io_capsule(ep, READ, 1, 0, 7, 4096)) == -3  # the host cannot send on it either


def test_a_qp_error_after_a_reads_data_moved_loses_only_its_response(ram_ep):
    ep = ram_ep
    ns = ep.env.target.subsystem(SUB_RAM).namespaces[1].backend.buffer
    ns[:4096] = pattern(4096, seed=61)
    ep.device.hold()
    assert ep.device.deliver(io_capsule(ep, READ, 1, 0, 7, 4096, cid=1)) == 0
    ep.queue.poll()
    ep.device.release(1)  # the data WRITE completed, then the link fails before the SEND
    ep.device.qp_error()
    pump(ep.queue)
    assert ep.queue.closed
    assert ep.device.responses() == []
    assert ep.host_bytes()[:4096] == bytes(ns[:4096])


# ------------------------------------------------------------------------------------------ io_uring faults

@pytest.fixture
def file_on_both_paths(tmp_path):
    """A file namespace served by the Python path (loopback) and by the native one, same contents."""
    python = LoopbackEndpoint(file_config(tmp_path / "python.img"), SUB_FILE)
    native_ep = NativeEndpoint(file_config(tmp_path / "native.img"), SUB_FILE)
    for name, ep in (("python", python), ("native", native_ep)):
        put_file(tmp_path / f"{name}.img", 0, pattern(64 * 1024, seed=67))
        ep.buf.view[:4096] = pattern(4096, seed=71)
    yield python, native_ep
    close_all(python, native_ep)


@pytest.mark.parametrize("kind", ["eio", "ecanceled", "eagain"])
@pytest.mark.parametrize("opc", [READ, WRITE])
def test_a_ring_error_is_the_cores_and_answered_as_on_the_python_path(file_on_both_paths, tmp_path, kind, opc):
    """The C queue hands the failed command to the core, whose engine meets the device's error again (the hook's
    second completion); the Python path's engine meets it once.  Both must answer alike."""
    python, native_ep = file_on_both_paths
    answers = []
    for ep, faults in ((python, 1), (native_ep, 2)):
        native.module.uring_inject(kind, faults)
        answers.append(ep.exchange(io_capsule(ep, opc, 1, 8, 7, 4096, cid=9)))
        assert native.module.uring_faults()["remaining"] == 0, ep
    assert answers[0] == answers[1]
    (cqe,) = answers[1]
    if kind == "eio":
        assert status_of(cqe) == INTERNAL_ERROR_DNR  # nvmet's errno_to_nvme_status for EIO
    assert native_ep.queue.stats()["file_handed_back"] == 1
    assert python.host_bytes() == native_ep.host_bytes()
    assert file_bytes(tmp_path / "python.img", 0, 64 * 1024) == file_bytes(tmp_path / "native.img", 0, 64 * 1024)


def test_a_write_the_device_fails_while_a_pause_drains_is_answered_with_the_devices_error_not_held(file_ep, tmp_path):
    """A file Write on the ring when a live change pauses its subsystem; the device fails it (ECANCELED, for the
    native ring and the core's own attempt).  Handed back to the core it is not a new command for the pause to
    hold (and answer after the change, perhaps Invalid Namespace): it was running, so the pause drains it and
    the host gets the device's error, as on the Python path."""
    ep = file_ep
    target = ep.env.target
    ep.buf.view[:4096] = pattern(4096, seed=89)
    native.module.uring_inject("ecanceled", 2)
    assert ep.device.deliver(io_capsule(ep, WRITE, 1, 16, 7, 4096, cid=7)) == 0
    ep.queue.poll()  # taken: its data's RDMA READ posted, the ring's write and its completion to come
    assert ep.queue.stats()["native_in_flight"] == 1 and ep.queue.stats()["file_handed_back"] == 0
    drained = []
    paused = pause_and_fence(target, SUB_FILE, 1, lambda: drained.append(ep.queue.stats()["python_commands"]))
    assert drained == []
    python_before = ep.queue.stats()["python_commands"]
    ep.settle()
    assert ep.queue.stats()["file_handed_back"] == 1
    assert native.module.uring_faults()["remaining"] == 0  # the core did it again and met the device's error
    assert drained == [python_before + 1], "the fence waited for the handed-back Write, which the core ran"
    ((cqe, _),) = ep.device.responses()  # answered while paused: it was not held for the resume
    assert cid_of(cqe) == 7 and status_of(cqe) == INTERNAL_ERROR_DNR
    assert not target.subsystem(SUB_FILE).namespaces[1].held
    target.resume_namespaces(paused)
    ep.settle()
    assert ep.device.responses() == []  # nothing more: it was answered once


def test_a_fence_waits_for_the_cores_redo_of_a_handed_back_write_not_only_for_its_native_slot(file_ep, tmp_path):
    """The C queue frees a failed file command's slot, letting go of the epoch it started in, before the core does
    it again; the core's redo takes the namespace's current reference, a newer epoch than the fence's.  The redo
    holds the fenced epoch too (Request.fence_refs), so the fence is drained only once the redo is done: the change
    (here a test's; a replacement or a shrink in the fuzz, corpus seed 40) never commits under it."""
    ep = file_ep
    target = ep.env.target
    ns = target.subsystem(SUB_FILE).namespaces[1]
    ep.buf.view[:4096] = pattern(4096, seed=97)
    native.module.uring_inject("eio", 2)  # the native ring's attempt and the core's
    assert ep.device.deliver(io_capsule(ep, WRITE, 1, 16, 7, 4096, cid=7)) == 0
    ep.queue.poll()  # taken: its data's RDMA READ posted, the ring's write and its completion to come
    seen = []
    paused = pause_and_fence(target, SUB_FILE, 1, lambda: seen.append((ns.jobs, ns.ref.count)))
    assert seen == []
    ep.settle()
    assert ep.queue.stats()["file_handed_back"] == 1
    assert native.module.uring_faults()["remaining"] == 0  # the core did it again and met the device's error
    assert seen == [(0, 0)], "the fence was drained while the core's redo of the handed-back Write was running"
    ((cqe, _),) = ep.device.responses()
    assert cid_of(cqe) == 7 and status_of(cqe) == INTERNAL_ERROR_DNR
    target.resume_namespaces(paused)


def test_a_ring_error_the_cores_own_attempt_does_not_meet_is_answered_with_the_data(file_ep, tmp_path):
    ep = file_ep
    stored = pattern(4096, seed=83)
    put_file(tmp_path / "ns.img", 24 * 512, stored)
    native.module.uring_inject("eio", 1)  # the native ring's completion only
    (cqe,) = ep.exchange(io_capsule(ep, READ, 1, 24, 7, 4096, cid=8))
    assert status_of(cqe) == 0 and ep.host_bytes()[:4096] == stored
    assert ep.queue.stats()["file_handed_back"] == 1


def test_a_stalled_ring_command_holds_its_slot_until_released_then_completes_right(file_ep, tmp_path):
    ep = file_ep
    path = tmp_path / "ns.img"
    stored = pattern(4096, seed=73)
    put_file(path, 8 * 512, stored)
    free_before = ep.queue.stats()["bounce_chunks_free"]
    stall_on_the_ring(ep, io_capsule(ep, READ, 1, 8, 7, 4096, cid=4))
    stats = ep.queue.stats()
    assert native.module.uring_faults()["held"] == 1
    assert stats["ring_in_flight"] == 1 and stats["native_in_flight"] == 1
    assert stats["bounce_chunks_free"] == free_before - 1  # its chunk stays taken
    assert ep.device.responses() == []
    assert native.module.uring_release() == 1
    pump(ep.queue)
    ((cqe, _),) = ep.device.responses()
    assert cid_of(cqe) == 4 and status_of(cqe) == 0
    assert ep.host_bytes()[:4096] == stored
    stats = ep.queue.stats()
    assert stats["ring_in_flight"] == 0 and stats["bounce_chunks_free"] == free_before
    assert stats["file_handed_back"] == 0


def test_a_stalled_ring_write_is_not_answered_until_released(file_ep, tmp_path):
    ep = file_ep
    path = tmp_path / "ns.img"
    data = pattern(4096, seed=79)
    ep.buf.view[:4096] = data
    stall_on_the_ring(ep, io_capsule(ep, WRITE, 1, 16, 7, 4096, cid=7))
    assert ep.device.responses() == []
    assert file_bytes(path, 16 * 512, 4096) == data  # in the file, and still not answered
    native.module.uring_release()
    pump(ep.queue)
    ((cqe, _),) = ep.device.responses()
    assert cid_of(cqe) == 7 and status_of(cqe) == 0
    assert file_bytes(path, 16 * 512, 4096) == data


def test_a_queue_closed_while_its_device_holds_a_command_returns_at_once_and_frees_its_memory_when_it_is_back(
        tmp_path):
    """A backend I/O that does not come back (the hook holds its completion): the close does not wait for it (the
    event loop goes on: another queue of the namespace keeps serving), the queue is listed as closing with its
    held command and keeps its bounce memory; when the command comes back the ring's eventfd wakes the reap,
    which frees the ring and gives the memory back."""
    path = tmp_path / "ns.img"
    ep = NativeEndpoint(file_config(path), SUB_FILE)
    other = OtherQueue(ep, qid=2, subnqn=SUB_FILE)
    released = []
    ep.queue._on_released = released.append
    try:
        stored = pattern(4096, seed=79)
        put_file(path, 64 * 512, stored)
        stall_on_the_ring(ep, io_capsule(ep, READ, 1, 0, 7, 4096, cid=5))
        ep.queue.close()
        assert ep.queue.closed and ep.queue.held == 1
        assert CLOSING.get(id(ep.queue)) is ep.queue
        assert {"qid": 1, "peer": "fake", "held_commands": 1} in [
            {k: v for k, v in q.items() if k != "closed_s"} for q in closing_queues()]
        assert released == [] and ep.queue.bounce is not None  # the kernel may still write it
        # the loop goes on: the namespace's other queue serves
        (cqe,) = other.exchange(io_capsule(other, READ, 1, 64, 7, 4096, cid=6))
        assert status_of(cqe) == 0 and bytes(other.buf.view[:4096]) == stored
        assert ep.queue.native.reap_closed() == 1  # still held: nothing freed
        assert native.module.uring_release() == 1
        assert select.select([ep.queue.ring_fd], [], [], 10)[0], "the ring's eventfd did not wake the reap"
        ep.queue.reap_closed()
        assert ep.queue.held == 0 and id(ep.queue) not in CLOSING and released == [ep.queue]
        assert ep.queue.bounce is None and ep.queue.ring_fd is None
        assert native.module.uring_faults()["held"] == 0
        assert ep.device.responses() == []  # its queue was closed: the late completion answers nothing
    finally:
        other.close()
        ep.close()
    assert native.module.uring_faults()["held"] == 0


def test_the_ring_fault_hook_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match="unknown io_uring fault 'eperm'"):
        native.module.uring_inject("eperm")


def test_a_ram_read_never_waits_behind_a_file_command_waiting_for_its_namespaces_depth(endpoints, tmp_path):
    """File namespace 1 of depth 1 with its one command held on the ring, a second one waiting for its depth;
    a Read of RAM namespace 2 behind them needs only send-queue entries: it is answered at once."""
    config = file_config(tmp_path / "ns.img", queue_depth=1)
    config["subsystems"][0]["namespaces"].append(ram_ns(2))
    ep = endpoints(config, SUB_FILE)
    stored = pattern(4096, seed=67)
    ep.env.target.subsystem(SUB_FILE).namespaces[2].backend.buffer[:4096] = stored
    stall_on_the_ring(ep, io_capsule(ep, READ, 1, 0, 7, 4096, offset=8192, cid=1))
    assert ep.device.deliver(io_capsule(ep, READ, 1, 8, 7, 4096, offset=12288, cid=2)) == 0
    assert ep.device.deliver(io_capsule(ep, READ, 2, 0, 7, 4096, offset=0, cid=3)) == 0
    for _ in range(3):  # the wire completes what the last poll posted (the ring's command stays held)
        ep.queue.poll()
    assert [cid_of(c) for c, _ in ep.device.responses()] == [3]
    assert ep.host_bytes()[:4096] == stored
    assert native.module.uring_release() == 1
    poll_until(ep, lambda: ep.queue.stats()["native_in_flight"] == 0)
    pump(ep.queue)
    got = {cid_of(c): status_of(c) for c, _ in ep.device.responses()}
    assert got == {1: 0, 2: 0}
