"""The userspace target under field conditions, over the loopback fabric (issue 11): long commands in
slices, blocking backend calls off the loop, keep-alive bounds, Connect hardening."""
import threading

import pytest

from nvmeof_roce.nvme import admin as A
from nvmeof_roce.nvme import fabrics as F
from nvmeof_roce.nvme import nvm
from nvmeof_roce.nvme import status as S
from nvmeof_roce.nvme.command import CQE, NVM_FLUSH, SQE
from nvmeof_roce.engine.io import merge_ranges
from nvmeof_roce.engine.work import SLICE_BYTES

from loopback_env import ADDR1, HOST_A, HOST_B, Env, RawQueue, port, raw_connect, raw_enable, ram_ns, file_ns

SUB_BIG = "nqn.2024-01.io.test:big"
SUB_OTHER = "nqn.2024-01.io.test:other"
SUB_FILE = "nqn.2024-01.io.test:file"
DISCOVERY = F.DISCOVERY_NQN
MIB = 1 << 20


def config(tmp_path=None, **settings):
    subsystems = [
        # 64 MiB of RAM: an untouched anonymous mapping costs nothing until written
        {"nqn": SUB_BIG, "namespaces": [ram_ns(1, "64M", 4096)]},
        {"nqn": SUB_OTHER, "namespaces": [ram_ns(1, "1M")]},
    ]
    exported = [SUB_BIG, SUB_OTHER]
    if tmp_path is not None:
        # the thread engine: these tests gate the backend's own calls, which it makes on its threads (the
        # io_uring engine's flushes and FUA writes: test_ioengine.py)
        ns = file_ns(1, tmp_path / "f.img", "4M")
        ns["nvmeof_roce"]["io_engine"] = "threads"
        subsystems.append({"nqn": SUB_FILE, "namespaces": [ns]})
        exported.append(SUB_FILE)
    cfg = {"hosts": [{"nqn": HOST_A}, {"nqn": HOST_B}], "ports": [port(1, ADDR1, exported)],
           "subsystems": subsystems}
    if settings:
        cfg["nvmeof_roce"] = settings
    return cfg


@pytest.fixture
def env():
    e = Env(config())
    yield e
    e.close()


# ---------------------------------------------------------------------------- long commands in slices

def test_merge_ranges():
    assert merge_ranges([(0, 10)] * 3) == [(0, 10)]
    assert merge_ranges([(20, 5), (0, 10), (10, 5), (8, 4)]) == [(0, 15), (20, 5)]
    assert merge_ranges([(0, 4), (5, 1)]) == [(0, 4), (5, 1)]


def test_whole_namespace_dsm_is_worked_off_in_bounded_slices(env):
    """256 ranges, each the whole 64 MiB namespace: merged into one range, deallocated 16 MiB per loop
    pass, while another host's command is served between the slices."""
    big = env.connect(SUB_BIG, hostnqn=HOST_A)
    other = env.connect(SUB_OTHER, hostnqn=HOST_B)
    size = 64 * MIB
    blocks = size // 4096
    for lba in (0, blocks // 2, blocks - 1):
        big.write(1, lba, b"\xa5" * 4096)
    q = RawQueue(big.io_queues[0].transport)
    ranges = nvm.pack_dsm_ranges([nvm.DsmRange(0, blocks)] * 256)
    q.buf.view[:len(ranges)] = ranges
    dsm = nvm.DsmCommand(cid=0x77, nsid=1, nr=255, sgl=q.keyed(len(ranges))).to_sqe()
    work = env.target.work
    q.send(dsm.pack())
    env.fabric.pump(watched=False)  # the capsule and the RDMA READ of the ranges, no loop pass yet
    assert work.pending == 1 and work.slices_run == 0 and q.transport.waiting == 0

    # another controller's read is answered while the deallocation is pending
    oq = RawQueue(other.io_queues[0].transport)
    oq.send(nvm.read_command(0x55, 1, 0, 0, oq.keyed(512)).pack())
    env.fabric.pump(watched=False)
    assert oq.transport.waiting == 1 and work.pending == 1

    passes = 0
    while not q.transport.waiting:
        assert env.fabric.run_watched() == 1  # one loop pass over the worker eventfd
        env.fabric.pump(watched=False)
        passes += 1
        assert passes <= 10
    assert work.slices_run == size // SLICE_BYTES == 4  # 256 x 64 MiB merged: 64 MiB, 16 MiB a pass
    assert work.largest_slice == SLICE_BYTES
    assert passes == 5  # 4 slices, then the completion
    cqe = q.poll_one()
    assert (cqe.cid, cqe.status) == (0x77, 0)
    assert oq.poll_one().status == 0
    for lba in (0, blocks // 2, blocks - 1):
        assert big.read(1, lba, 1) == bytes(4096)


def test_write_zeroes_256_mib_in_slices(tmp_path):
    cfg = config()
    cfg["subsystems"][0]["namespaces"] = [ram_ns(1, "256M", 4096)]
    e = Env(cfg)
    try:
        ctrl = e.connect(SUB_BIG)
        ctrl.write(1, 65535, b"\x5a" * 4096)
        ctrl.write(1, 0, b"\x5a" * 4096)
        ctrl.write_zeroes(1, 0, 65536)  # NLB 0xFFFF of 4 KiB: 256 MiB, the most one command asks
        assert e.target.work.slices_run == 16 and e.target.work.largest_slice == SLICE_BYTES
        assert ctrl.read(1, 65535, 1) == bytes(4096) and ctrl.read(1, 0, 1) == bytes(4096)
    finally:
        e.close()


def test_unaligned_zeroing_keeps_the_neighbours(env):
    ctrl = env.connect(SUB_OTHER)
    ctrl.write(1, 0, b"\x11" * 4096 * 3)
    ctrl.write_zeroes(1, 3, 10)  # 512-byte blocks: page edges are zeroed by hand, whole pages by madvise
    data = ctrl.read(1, 0, 24)
    assert data[:3 * 512] == b"\x11" * 1536
    assert data[3 * 512:13 * 512] == bytes(5120)
    assert data[13 * 512:] == b"\x11" * (11 * 512)


# ---------------------------------------------------------------------------- blocking calls off the loop

class Gate:
    """Replaces a backend's flush: blocks the worker thread until opened."""

    def __init__(self, fail=None):
        self.started = threading.Event()
        self.open = threading.Event()
        self.calls = 0
        self.thread = None
        self.fail = fail

    def __call__(self):
        self.calls += 1
        self.thread = threading.current_thread()
        self.started.set()
        assert self.open.wait(10)
        if self.fail:
            raise self.fail


@pytest.fixture
def fenv(tmp_path):
    e = Env(config(tmp_path))
    yield e
    e.close()


def test_flush_runs_off_the_loop(fenv):
    ctrl = fenv.connect(SUB_FILE, hostnqn=HOST_A)
    other = fenv.connect(SUB_OTHER, hostnqn=HOST_B)
    ns = fenv.target.subsystem(SUB_FILE).namespaces[1]
    gate = ns.backend.flush = Gate()
    q = RawQueue(ctrl.io_queues[0].transport)
    q.send(SQE(opc=NVM_FLUSH, cid=0x42, nsid=1).pack())
    fenv.fabric.pump()
    assert gate.started.wait(5)
    # the fdatasync is blocked on the worker thread; the loop serves everyone else meanwhile
    assert other.read(1, 0, 1) == bytes(512)
    ctrl.write(1, 8, b"\x01" * 512)
    assert q.transport.waiting == 0 and ns.io.lane_in_flight == 1  # the flush, on the namespace's lane
    gate.open.set()
    cqe = None
    for _ in range(500):
        cqes = q.transport.poll(0.01)  # waits on the worker's eventfd
        if cqes:
            cqe = CQE.unpack(cqes[0])
            break
    assert cqe is not None and (cqe.cid, cqe.status) == (0x42, 0)
    assert gate.thread is not threading.main_thread()


def test_failed_flush_gets_nvmets_status(fenv):
    """nvmet_file_flush answers errno_to_nvme_status(EIO): Internal Error with DNR."""
    ctrl = fenv.connect(SUB_FILE)
    ns = fenv.target.subsystem(SUB_FILE).namespaces[1]
    gate = ns.backend.flush = Gate(fail=OSError(5, "Input/output error"))
    gate.open.set()
    with pytest.raises(Exception) as ei:
        ctrl.flush(1)
    assert getattr(ei.value, "status", None) == S.INTERNAL | S.DNR
    assert fenv.target.internal_errors == 0  # the device's error, not the target's


def test_fua_write_is_durable_on_its_own_off_the_loop(fenv):
    """A FUA write is written with RWF_DSYNC (durable when it returns) on an engine thread, not followed by a
    flush of the whole file."""
    ctrl = fenv.connect(SUB_FILE)
    ns = fenv.target.subsystem(SUB_FILE).namespaces[1]
    real = ns.backend.write
    calls = []

    def write(offset, data, dsync=False):
        calls.append((offset, dsync, threading.current_thread() is threading.main_thread()))
        return real(offset, data, dsync=dsync)
    ns.backend.write = write
    gate = ns.backend.flush = Gate()
    gate.open.set()
    ctrl.write(1, 0, b"\x07" * 512, fua=True)
    ctrl.write(1, 1, b"\x08" * 512)
    assert calls == [(0, True, False), (512, False, False)] and gate.calls == 0
    assert ctrl.read(1, 0, 2) == b"\x07" * 512 + b"\x08" * 512


def test_shutdown_flush_off_the_loop_reports_shst_occurring(fenv):
    q, cqe = raw_connect(fenv.connector(), SUB_FILE)
    assert cqe.status == 0
    raw_enable(q)
    ns = fenv.target.subsystem(SUB_FILE).namespaces[1]
    gate = ns.backend.flush = Gate()
    assert q.command(F.PropertySet(offset=F.PROP_CC, value=F.CC_DEFAULT | F.CC_EN | F.CC_SHN_NORMAL)).status == 0
    assert gate.started.wait(5)
    csts = q.command(F.PropertyGet(offset=F.PROP_CSTS)).result
    assert csts & F.CSTS_SHST_MASK == F.CSTS_SHST_OCCUR
    gate.open.set()
    for _ in range(500):
        fenv.fabric.run_watched(0.01)
        csts = q.command(F.PropertyGet(offset=F.PROP_CSTS)).result
        if csts & F.CSTS_SHST_MASK == F.CSTS_SHST_COMPLETE:
            break
    assert csts & F.CSTS_SHST_MASK == F.CSTS_SHST_COMPLETE


# ---------------------------------------------------------------------------- keep-alive bounds

def test_connect_kato_above_max_is_refused_with_its_offset(env):
    for kato in (0xFFFFFFFF, 300_001):
        _, cqe = raw_connect(env.connector(), SUB_OTHER, kato=kato)
        assert (cqe.status, cqe.result) == (S.CONNECT_INVALID_PARAM | S.DNR, F.iattr_sqe(F.CONNECT_SQE_OFF_KATO))
    _, cqe = raw_connect(env.connector(), SUB_OTHER, kato=300_000)
    assert cqe.status == 0


def test_max_kato_setting():
    e = Env(config(max_kato=10))
    try:
        _, cqe = raw_connect(e.connector(), SUB_OTHER, kato=10_001)
        assert (cqe.status, cqe.result) == (S.CONNECT_INVALID_PARAM | S.DNR, F.iattr_sqe(F.CONNECT_SQE_OFF_KATO))
        ctrl = e.connect(SUB_OTHER, kato_ms=10_000)
        q = RawQueue(ctrl.admin.transport)
        cqe = q.command(A.SetFeaturesCommand(fid=A.FEAT_KATO, value=11_000))
        assert cqe.status == S.INVALID_FIELD | S.DNR
        assert ctrl.error_log()[0].param_location == 44  # CDW11
        assert q.command(A.SetFeaturesCommand(fid=A.FEAT_KATO, value=2_000)).status == 0
        controllers = e.target.subsystem(SUB_OTHER).controllers
        e.clock.advance(2.5)
        e.fabric.tick()
        assert ctrl.cntlid not in controllers
    finally:
        e.close()


def test_discovery_controller_with_kato_zero_is_reaped_after_the_idle_limit(env):
    q, cqe = raw_connect(env.connector(), DISCOVERY, kato=0)
    assert cqe.status == 0
    raw_enable(q)
    controllers = env.target.discovery.controllers
    env.clock.advance(119)
    env.fabric.tick()
    assert cqe.result in controllers
    env.clock.advance(2)
    env.fabric.tick()
    assert cqe.result not in controllers


def test_discovery_set_features_kato_zero_keeps_the_idle_limit(env):
    q, cqe = raw_connect(env.connector(), DISCOVERY, kato=5000)
    raw_enable(q)
    assert q.command(A.SetFeaturesCommand(fid=A.FEAT_KATO, value=0)).status == 0
    controllers = env.target.discovery.controllers
    env.clock.advance(60)
    env.fabric.tick()
    assert cqe.result in controllers  # not 5 s any more...
    env.clock.advance(61)
    env.fabric.tick()
    assert cqe.result not in controllers  # ...and not forever either: 120 s


def test_any_command_on_any_queue_is_keep_alive_traffic(env):
    ctrl = env.connect(SUB_OTHER, kato_ms=5000)
    controllers = env.target.subsystem(SUB_OTHER).controllers
    for _ in range(4):
        env.clock.advance(4)
        ctrl.read(1, 0, 1)  # I/O queue traffic only
        env.fabric.tick()
        assert ctrl.cntlid in controllers
    env.clock.advance(6)
    env.fabric.tick()
    assert ctrl.cntlid not in controllers


def test_identify_advertises_tbkas_and_kas(env):
    ctrl = env.connect(SUB_OTHER)
    data = ctrl.identify(1)
    ctratt = int.from_bytes(data[96:100], "little")
    kas = int.from_bytes(data[320:322], "little")
    assert ctratt & (1 << 6)  # CTRATT.TBKAS
    assert kas == 10  # 100 ms units


# ---------------------------------------------------------------------------- Connect hardening

def _io_connect(env, hostnqn=HOST_A, hostid=None, subnqn=SUB_OTHER, data=None):
    admin_q, cqe = raw_connect(env.connector(), subnqn)
    assert cqe.status == 0
    raw_enable(admin_q)
    kw = {} if hostid is None else {"hostid": hostid}
    return raw_connect(env.connector(), subnqn, hostnqn=hostnqn, qid=1, cntlid=cqe.result, data=data, **kw)


def test_io_connect_needs_the_controllers_host_id(env):
    _, cqe = _io_connect(env, hostid=bytes(range(1, 17)))
    assert (cqe.status, cqe.result) == (S.CONNECT_INVALID_PARAM | S.DNR, F.iattr_data(F.CONNECT_DATA_OFF_HOSTID))


def test_io_connect_needs_the_controllers_host_nqn(env):
    _, cqe = _io_connect(env, hostnqn=HOST_B)
    assert (cqe.status, cqe.result) == (S.CONNECT_INVALID_PARAM | S.DNR, F.iattr_data(F.CONNECT_DATA_OFF_HOSTNQN))


def test_io_connect_with_the_same_host_nqn_and_id_is_accepted(env):
    _, cqe = _io_connect(env)
    assert cqe.status == 0


def _connect_data(subnqn: bytes, hostnqn: bytes) -> bytes:
    data = bytearray(1024)
    data[0:16] = bytes(range(16))
    data[16:18] = F.DYNAMIC_CNTLID.to_bytes(2, "little")
    data[256:256 + len(subnqn)] = subnqn
    data[512:512 + len(hostnqn)] = hostnqn
    return bytes(data)


@pytest.mark.parametrize("field,subnqn,hostnqn", [
    (F.CONNECT_DATA_OFF_SUBNQN, SUB_OTHER.encode().ljust(256, b"x"), HOST_A.encode()),  # no NUL in 256 bytes
    (F.CONNECT_DATA_OFF_HOSTNQN, SUB_OTHER.encode(), b"nqn.2014-08.org.example:" + b"h" * 200),  # 224 bytes
    (F.CONNECT_DATA_OFF_HOSTNQN, SUB_OTHER.encode(), HOST_A.encode().ljust(256, b"y")),
    (F.CONNECT_DATA_OFF_SUBNQN, b"nqn.2024-01.io.test:" + b"s" * 204, HOST_A.encode()),  # 224 bytes
], ids=["subnqn-unterminated", "hostnqn-224", "hostnqn-unterminated", "subnqn-224"])
def test_connect_nqn_must_end_within_223_bytes(env, field, subnqn, hostnqn):
    _, cqe = raw_connect(env.connector(), SUB_OTHER, data=_connect_data(subnqn, hostnqn))
    assert (cqe.status, cqe.result) == (S.CONNECT_INVALID_PARAM | S.DNR, F.iattr_data(field))


def test_connect_hostnqn_of_223_bytes_is_accepted(env):
    hostnqn = b"nqn.2014-08.org.example:" + b"h" * 199
    assert len(hostnqn) == 223
    _, cqe = raw_connect(env.connector(), SUB_OTHER, data=_connect_data(SUB_OTHER.encode(), hostnqn))
    assert cqe.status == 0


# ---------------------------------------------------------------------------- the RDMA event loop's order

def test_event_loop_serves_ready_fds_before_the_timers():
    """A pass that stalls (here: a handler sleeping past the tick interval) must not make the timers run
    before what arrived meanwhile was served: a keep-alive waiting in a queue would be counted as silence."""
    import os
    import time
    from nvmeof_roce.transport.eventloop import EventLoop

    events = []

    class Handler:
        def tick(self, now):
            events.append("tick")

    loop = EventLoop(Handler(), tick_interval=0.05)
    slow_r, slow_w = os.pipe()
    late_r, late_w = os.pipe()

    def slow():
        os.read(slow_r, 1)
        events.append("slow")
        time.sleep(0.12)  # longer than the tick interval
        os.write(late_w, b"k")  # a capsule arrives while the loop is busy

    def late():
        os.read(late_r, 1)
        events.append("late")

    loop.watch(slow_r, slow)
    loop.watch(late_r, late)
    os.write(slow_w, b"x")
    loop.run(lambda: events.count("tick") >= 2)
    assert events.index("late") < events.index("tick", events.index("slow"))
    assert loop.longest_pass >= 0.12
    for fd in (slow_r, slow_w, late_r, late_w):
        os.close(fd)
    loop.selector.close()


def test_event_loop_gives_a_busy_handler_its_turn_after_the_others():
    """A handler that stops at its budget returns a continuation: it runs in the next pass, and the
    handlers that became ready meanwhile run before it gets another turn."""
    import os
    from nvmeof_roce.transport.eventloop import EventLoop

    class Handler:
        def tick(self, now):
            pass

    loop = EventLoop(Handler())
    events = []
    busy_r, busy_w = os.pipe()
    other_r, other_w = os.pipe()
    work = list(range(3))  # three budgets' worth of completions

    def busy_more():
        events.append(f"busy{work.pop(0)}")
        return busy_more if work else None

    def busy():
        os.read(busy_r, 1)
        os.write(other_w, b"o")  # another queue's capsule arrives meanwhile
        return busy_more()

    def other():
        os.read(other_r, 1)
        events.append("other")

    loop.watch(busy_r, busy)
    loop.watch(other_r, other)
    os.write(busy_w, b"b")
    assert loop.run_once(1.0) == 1 and events == ["busy0"]
    assert loop.run_once(1.0) == 2 and events == ["busy0", "other", "busy1"]  # no wait: work was left
    assert loop.run_once(1.0) == 1 and events == ["busy0", "other", "busy1", "busy2"]
    assert loop.run_once(0) == 0
    for fd in (busy_r, busy_w, other_r, other_w):
        os.close(fd)
    loop.selector.close()


def test_event_loop_skips_a_ready_fd_that_an_earlier_handler_of_the_pass_unwatched():
    """A CM DISCONNECTED closes its queue, completion channel included, while the queue's completion fd is
    ready in the same pass: its handler must not run then (pyverbs 44 dereferences the closed channel's NULL
    pointer: the target died with SIGSEGV).  Whichever of the two runs first unwatches the other; and an fd
    number watched again in the pass, for a new object, is not served for the old readiness either."""
    import os
    from nvmeof_roce.transport.eventloop import EventLoop

    class Handler:
        def tick(self, now):
            pass

    loop = EventLoop(Handler())
    a_r, a_w = os.pipe()
    b_r, b_w = os.pipe()
    ran = []
    reused = []

    def closer(mine, other):
        def handler():
            os.read(mine, 1)
            ran.append(mine)
            loop.unwatch(other)
            loop.watch(other, lambda: reused.append(other))  # the same fd number, a new handler
        return handler

    loop.watch(a_r, closer(a_r, b_r))
    loop.watch(b_r, closer(b_r, a_r))
    os.write(a_w, b"x")
    os.write(b_w, b"x")
    assert loop.run_once(1.0) == 1
    assert len(ran) == 1 and reused == []
    assert loop.run_once(0) == 1 and reused == [ran[0] ^ a_r ^ b_r]  # next pass: the new handler, still readable
    for fd in (a_r, a_w, b_r, b_w):
        os.close(fd)
    loop.selector.close()


def test_pyverbs_loggers_are_cached_and_are_the_same_loggers():
    """pyverbs 44 calls logging.getLogger for every object it makes (a WC per completion): the transport gives
    pyverbs.base a cached getLogger.  The loggers must be the very ones logging hands out, and the rest of the
    logging module must still be there."""
    import logging
    import types
    from nvmeof_roce.transport.rdma.verbs import cache_pyverbs_loggers

    base = types.ModuleType("pyverbs_base_like")
    base.logging = logging
    assert cache_pyverbs_loggers(base)
    first = base.logging.getLogger("CQ")
    assert first is logging.getLogger("CQ") and base.logging.getLogger("CQ") is first
    assert base.logging.getLogger.cache_info().hits == 1
    assert base.logging.DEBUG == logging.DEBUG and base.logging.Logger is logging.Logger
    other = types.ModuleType("no_logging_here")
    assert not cache_pyverbs_loggers(other) and not hasattr(other, "logging")
