"""File and block namespaces on their I/O engines (engine/ioengine.py), over the loopback fabric: every case
runs on the io_uring engine and on the thread engine.

The device is made slow deterministically, so what is asserted is which commands are with the device, which
wait and which completed while another is held, never a timing: on the thread engine the backend's calls wait
on an event the test sets (HeldDevice); on the io_uring engine each held command sits in the kernel, on the
ring, as a read of a pipe the test writes to when it releases them (HeldRing), and the real call is made then.
"""
import errno
import os
import signal
import subprocess
import sys
import textwrap
import pytest

from held import HeldRing, hold
from loopback_env import HOST_A, HOST_B, Env, file_ns, port, ADDR1
from nvmeof_roce.nvme import nvm
from nvmeof_roce.nvme import status as S
from nvmeof_roce.engine.backends import BackendError
from nvmeof_roce.engine.io import device_status
from nvmeof_roce.nvme.command import NVM_READ, NVM_WRITE, NVM_DSM
from nvmeof_roce.engine.ioengine import uring_unavailable

SUB = "nqn.2024-01.io.test:files"


ENGINES = ["io_uring", "threads"]


def files_config(tmp_path, depth=None, count=2, size="2M", engine=None):
    namespaces = []
    for nsid in range(1, count + 1):
        ns = file_ns(nsid, tmp_path / f"ns{nsid}.img", size)
        if depth is not None:
            ns["nvmeof_roce"]["queue_depth"] = depth
        if engine is not None:
            ns["nvmeof_roce"]["io_engine"] = engine
        namespaces.append(ns)
    return {"hosts": [{"nqn": HOST_A}, {"nqn": HOST_B}], "ports": [port(1, ADDR1, [SUB])],
            "subsystems": [{"nqn": SUB, "namespaces": namespaces}]}


def pump_until(env, cond, rounds=400):
    for _ in range(rounds):
        if cond():
            return
        env.fabric.pump()
        env.fabric.run_watched(0.05)
    assert cond()


@pytest.fixture(params=ENGINES)
def engine_name(request):
    if request.param == "io_uring" and uring_unavailable():
        pytest.skip(f"io_uring: {uring_unavailable()}")
    return request.param


@pytest.fixture
def files(tmp_path, engine_name):
    e = Env(files_config(tmp_path, depth=4, engine=engine_name))
    e.engine_name = engine_name
    yield e
    assert e.target.internal_errors == 0
    e.close()


def test_many_reads_with_the_device_at_once_bounded_by_queue_depth(files):
    """Eight reads on a namespace of queue depth 4: four are with the device at once, four wait in order
    (holding their request slots), then all complete with the right data."""
    ctrl = files.connect(SUB, num_io_queues=1, queue_size=32)
    ns = files.target.subsystem(SUB).namespaces[1]
    ctrl.write(1, 0, bytes(range(256)) * 32)  # 16 blocks of a known pattern
    held = hold(files.target, SUB, 1, "read_into")
    done = {}
    for i in range(8):
        ctrl.submit_read(1, i * 2, 2, lambda c, i=i: done.setdefault(i, (c.status, bytes(c.data))))
    files.fabric.pump()
    held.wait_running(4)
    engine = ns.io
    assert engine.name == files.engine_name and engine.depth == 4
    assert engine.in_flight == 4 and len(engine.waiting) == 4  # the namespace is full: the rest wait
    assert not done  # nothing completed while the device holds them
    assert files.target.status()  # the target still serves its loop meanwhile
    handed = []  # the offsets the engine gives to the device from now on, in its order
    dispatch = engine._dispatch
    engine._dispatch = lambda op: (handed.append(op.offset), dispatch(op))
    held.release.set()
    pump_until(files, lambda: len(done) == 8 or ctrl.poll_completions(0.05) is None)
    ctrl.wait_idle()
    assert held.most == 4
    # The waiting ones are handed to the device in arrival order.  On the thread engine four threads take them,
    # so the order in which they enter the backend's call is the scheduler's (Python 3.13 wakes them otherwise
    # than 3.11): only which ones reached it is asserted there.
    assert handed == sorted(handed) and sorted(held.started[4:]) == handed
    expected = bytes(range(256)) * 32
    for i in range(8):
        assert done[i] == (0, expected[i * 1024:(i + 1) * 1024])
    assert engine.in_flight == 0 and not engine.waiting and engine.most_in_flight == 4
    ctrl.close()


def test_status_shows_engine_and_in_flight(files):
    from nvmeof_roce.control.stats import target_status
    ctrl = files.connect(SUB, num_io_queues=1)
    ns = files.target.subsystem(SUB).namespaces[1]
    before = target_status(files.target)["subsystems"][0]["namespaces"][0]["io"]
    assert before["engine"] == files.engine_name and "io_uring" in before["engine_reason"]
    assert before["in_flight"] == 0
    held = hold(files.target, SUB, 1, "read_into")
    got = []
    for i in range(3):
        ctrl.submit_read(1, i, 1, lambda c: got.append(c.status))
    files.fabric.pump()
    held.wait_running(3)
    io = target_status(files.target)["subsystems"][0]["namespaces"][0]["io"]
    assert io["in_flight"] == 3 and io["queue_depth"] == 4
    held.release.set()
    ctrl.wait_idle()
    assert got == [0, 0, 0]
    ctrl.close()


def test_one_hosts_flush_does_not_hold_another_hosts_reads(files):
    """Host A's Flush is held in fdatasync on the namespace's lane; host B's reads of the same namespace, and a
    Flush of another namespace, complete meanwhile; A's Flush completes once its fdatasync returns."""
    a = files.connect(SUB, hostnqn=HOST_A, num_io_queues=1)
    b = files.connect(SUB, hostnqn=HOST_B, num_io_queues=1)
    ns1 = files.target.subsystem(SUB).namespaces[1]
    b.write(1, 8, b"\x5a" * 4096)
    held = hold(files.target, SUB, 1, "flush")
    a_flush = []
    a.submit_io(nvm.FlushCommand(nsid=1).to_sqe(), lambda c: a_flush.append(c.status))
    files.fabric.pump()
    held.wait_running(1)
    for _ in range(5):  # B reads while A's flush is with the device
        assert b.read(1, 8, 8) == b"\x5a" * 4096
    b.flush(2)  # another namespace's flush has its own lane
    assert a_flush == [] and held.running == 1  # A's flush still outstanding all along
    held.release.set()
    a.wait_idle()
    assert a_flush == [0]
    a.close()
    b.close()


def test_waiting_flushes_share_one_fdatasync(files):
    ctrl = files.connect(SUB, num_io_queues=1)
    held = hold(files.target, SUB, 1, "flush")
    statuses = []
    ctrl.submit_io(nvm.FlushCommand(nsid=1).to_sqe(), lambda c: statuses.append(c.status))
    files.fabric.pump()
    held.wait_running(1)  # the first flush is running
    for _ in range(3):  # these arrive after it started: it may not cover writes completed before them
        ctrl.submit_io(nvm.FlushCommand(nsid=1).to_sqe(), lambda c: statuses.append(c.status))
    files.fabric.pump()
    held.release.set()
    ctrl.wait_idle()
    assert statuses == [0, 0, 0, 0]
    assert len(held.started) == 2  # the first, then one for the three that waited behind it


def test_read_past_the_end_of_a_truncated_file_is_an_error(files, tmp_path):
    """The file shrank under the namespace: nvmet answers a read of the missing part with an error (a short
    read is Internal Error); never zeros with success."""
    ctrl = files.connect(SUB, num_io_queues=1)
    ctrl.write(1, 3000, b"\xab" * 512)
    os.truncate(tmp_path / "ns1.img", 1 << 20)  # 2 MiB namespace, 1 MiB file
    assert ctrl.read(1, 100, 1) == bytes(512)  # still inside the file
    q = ctrl.io_queues[0]
    got = []
    ctrl.submit_read(1, 3000, 1, lambda c: got.append(c.status), qid=q.qid)
    ctrl.wait_idle()
    assert got == [S.INTERNAL | S.DNR]
    ns = files.target.subsystem(SUB).namespaces[1]
    assert ns.stats.errors == 1
    ctrl.close()


def test_device_errors_get_nvmets_statuses(files):
    ctrl = files.connect(SUB, num_io_queues=1)
    ns = files.target.subsystem(SUB).namespaces[1]

    if files.engine_name == "io_uring":  # the ring's write completes with -ENOSPC, as a full device's would
        HeldRing(ns.engine(files.target.work), "write", fail=errno.ENOSPC).release.set()
    else:
        def full(*_a, **_k):
            raise BackendError("no space", "free some", 28)
        ns.backend.write = full
    got = []
    ctrl.submit_write(1, 0, b"x" * 512, lambda c: got.append(c.status))
    ctrl.wait_idle()
    assert got == [S.CAP_EXCEEDED | S.DNR]  # ENOSPC: Capacity Exceeded, as nvmet
    err = ctrl.error_log(1)[0]
    assert err.status == (S.CAP_EXCEEDED | S.DNR) and err.param_location == 48  # CDW12, the length
    ctrl.close()


@pytest.mark.parametrize("code,opc,status", [
    (28, NVM_WRITE, S.CAP_EXCEEDED | S.DNR), (121, NVM_READ, S.LBA_RANGE | S.DNR),
    (95, NVM_DSM, 0x183 | S.DNR), (95, NVM_READ, S.INVALID_OPCODE | S.DNR), (61, NVM_READ, S.ACCESS_DENIED),
    (5, NVM_READ, S.INTERNAL | S.DNR), (None, NVM_READ, S.INTERNAL | S.DNR)])
def test_device_status_table(code, opc, status):
    assert device_status(OSError(code, "x") if code else BackendError("short", ""), opc)[0] == status


def test_write_data_is_copied_before_the_transport_reuses_it(files):
    """The transport lends a write's data only for the handler's call: what reaches the device is what the
    host sent, even when the write waits for a slot first."""
    ctrl = files.connect(SUB, num_io_queues=1, queue_size=32)
    held = hold(files.target, SUB, 1, "write")
    for i in range(8):  # depth 4: four wait with their data
        ctrl.submit_write(1, i * 8, bytes([i + 1]) * 4096, lambda c: None)
    files.fabric.pump()
    held.wait_running(4)
    held.release.set()
    ctrl.wait_idle()
    for i in range(8):
        assert ctrl.read(1, i * 8, 8) == bytes([i + 1]) * 4096
    ctrl.close()


def test_queue_depth_key_is_validated(tmp_path):
    from nvmeof_roce.config import ConfigError, parse_config
    with pytest.raises(ConfigError, match="queue_depth"):
        parse_config(files_config(tmp_path, depth=0), "t")
    bad = files_config(tmp_path)
    bad["subsystems"][0]["namespaces"] = [{"nsid": 1, "nvmeof_roce": {"backend": "ram", "size": "1M",
                                                                      "queue_depth": 8}}]
    with pytest.raises(ConfigError, match="file and block namespaces"):
        parse_config(bad, "t")


CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from loopback_env import Env, HOST_A, file_ns, port, ADDR1
    SUB = "nqn.2024-01.io.test:crash"
    env = Env({{"hosts": [{{"nqn": HOST_A}}], "ports": [port(1, ADDR1, [SUB])],
               "subsystems": [{{"nqn": SUB, "namespaces": [file_ns(1, {path!r}, "4M")]}}]}})
    ctrl = env.connect(SUB, num_io_queues=2)
    ctrl.write(1, 64, bytes(range(256)) * 16 * 8)   # 32 KiB, acknowledged
    ctrl.flush(1)                                   # acknowledged: durable
    print("ACKED", flush=True)
    import time
    time.sleep(60)
""")


def test_acked_write_and_flush_survive_a_killed_target(tmp_path):
    """A target process killed (SIGKILL) right after it acknowledged a write and a Flush: reopened, the data is
    there."""
    path = str(tmp_path / "crash.img")
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(tests=os.path.dirname(__file__), path=path)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line.strip() == "ACKED", child.stderr.read()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    env = Env({"hosts": [{"nqn": HOST_A}], "ports": [port(1, ADDR1, ["nqn.2024-01.io.test:crash"])],
               "subsystems": [{"nqn": "nqn.2024-01.io.test:crash", "namespaces": [file_ns(1, path, "4M")]}]})
    try:
        ctrl = env.connect("nqn.2024-01.io.test:crash", num_io_queues=1)
        assert ctrl.read(1, 64, 64) == bytes(range(256)) * 16 * 8
        ctrl.close()
    finally:
        env.close()


# -- one file, one namespace: the duplicate check compares the storage, the lock covers live changes too

def test_a_hard_link_to_an_exported_file_is_a_duplicate(tmp_path):
    from nvmeof_roce.config import ConfigError, load_userspace_config
    import json
    img = tmp_path / "a.img"
    img.write_bytes(bytes(1 << 20))
    os.link(img, tmp_path / "hard.img")
    data = files_config(tmp_path)
    data["subsystems"][0]["namespaces"] = [file_ns(1, img, None), file_ns(2, tmp_path / "hard.img", None)]
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as ei:
        load_userspace_config(str(path))
    err = getattr(ei.value, "errors", [ei.value])[0]
    assert err.where == "subsystems[0].namespaces[1].device.path"
    assert "is already the backing of subsystems[0].namespaces[0]" in err.problem


def test_a_namespace_added_live_is_locked_and_a_replaced_one_keeps_its_lock(tmp_path):
    from nvmeof_roce.config import parse_config
    from nvmeof_roce.control import live
    from nvmeof_roce.engine.backends import FileBackend
    img = tmp_path / "live.img"
    img.write_bytes(bytes(1 << 20))
    env = Env(files_config(tmp_path, count=1))
    try:
        data = files_config(tmp_path, count=1)
        data["subsystems"][0]["namespaces"].append(file_ns(2, img, None))
        live.apply(env.target, parse_config(data, "add"))
        assert 2 in env.target.subsystem(SUB).namespaces
        with pytest.raises(BackendError, match="in use"):  # a second target cannot take the file
            FileBackend(str(img), lock="exclusive").close()
        # a live change that replaces the namespace (new UUID) on the same file: the lock is handed over
        data["subsystems"][0]["namespaces"][1]["device"]["uuid"] = "12345678-1234-4234-8234-123456789abc"
        old = env.target.subsystem(SUB).namespaces[2]
        live.apply(env.target, parse_config(data, "replace"))
        new = env.target.subsystem(SUB).namespaces[2]
        assert new is not old and old.backend._fd < 0  # the old one closed
        with pytest.raises(BackendError, match="in use"):
            FileBackend(str(img), lock="exclusive").close()
        del data["subsystems"][0]["namespaces"][1]
        live.apply(env.target, parse_config(data, "remove"))
        FileBackend(str(img), lock="exclusive").close()  # free again once removed
    finally:
        env.close()


# -- io_uring: the ring itself, its eventfd, real kernel errors, the choice of engine

needs_uring = pytest.mark.skipif(bool(uring_unavailable()), reason=f"io_uring: {uring_unavailable()}")


@pytest.fixture
def uring(tmp_path):
    e = Env(files_config(tmp_path, depth=4, engine="io_uring"))
    yield e
    e.close()


@needs_uring
def test_uring_completions_wake_the_loop_through_the_rings_eventfd(uring):
    """No thread hands a completion over: the read sits on the ring, the kernel completes it and the ring's
    eventfd (watched by the loop) becomes readable; the command completes when the loop serves that fd."""
    import select
    ctrl = uring.connect(SUB, num_io_queues=1)
    ctrl.write(1, 0, b"\x33" * 512)
    ns = uring.target.subsystem(SUB).namespaces[1]
    engine = ns.io
    assert engine.name == "io_uring" and engine.threads == 0
    efd = engine.ring.fileno()
    assert efd in uring.fabric._watched  # the loop watches the ring's eventfd
    got = []
    ctrl.submit_read(1, 0, 1, lambda c: got.append((c.status, bytes(c.data))))
    uring.fabric.pump(watched=False)  # the capsule reaches the target; no watched fd is served
    assert engine.in_flight == 1 and got == []
    assert select.select([efd], [], [], 10)[0] == [efd]  # the kernel's completion made it readable
    assert engine.in_flight == 1 and got == []  # ... and nothing ran until the loop served it
    ctrl.wait_idle()
    assert got == [(0, b"\x33" * 512)] and engine.in_flight == 0 and engine.threads == 0
    ctrl.close()


@needs_uring
def test_uring_read_across_the_end_of_a_truncated_file_is_an_error(uring, tmp_path):
    """The file ends inside the read: the kernel reads the part that is there (a short read), the engine asks
    for the rest, gets 0 (the end of the file) and answers an error, never zeros and success."""
    ctrl = uring.connect(SUB, num_io_queues=1)
    os.truncate(tmp_path / "ns1.img", 4096 + 1024)  # the namespace is 2 MiB
    got = []
    ctrl.submit_read(1, 8, 8, lambda c: got.append(c.status))  # 4096..8191: 1024 bytes of it are in the file
    ctrl.wait_idle()
    assert got == [S.INTERNAL | S.DNR]
    assert uring.target.subsystem(SUB).namespaces[1].stats.errors == 1
    assert uring.target.internal_errors == 0
    ctrl.close()


@needs_uring
def test_uring_kernel_errors_get_nvmets_statuses_and_the_target_keeps_serving(uring, tmp_path):
    """Real errors from the kernel: writes on a descriptor open read-only fail with EBADF (Internal Error,
    DNR, as nvmet answers an errno it does not map); a failed fdatasync (EIO, the ring's completion of a
    device that lost the data) is Internal Error too; reads go on meanwhile."""
    ctrl = uring.connect(SUB, num_io_queues=1)
    ns = uring.target.subsystem(SUB).namespaces[1]
    ctrl.write(1, 0, b"\x44" * 512)
    readonly = os.open(tmp_path / "ns1.img", os.O_RDONLY)
    saved = ns.backend._fd, ns.backend._dfd
    try:
        ns.backend._fd = ns.backend._dfd = readonly
        got = []
        ctrl.submit_write(1, 0, b"x" * 512, lambda c: got.append(c.status))
        ctrl.wait_idle()
        assert got == [S.INTERNAL | S.DNR]
        assert ctrl.read(1, 0, 1) == b"\x44" * 512  # nothing written; reads are served
    finally:
        ns.backend._fd, ns.backend._dfd = saved
        os.close(readonly)
    HeldRing(ns.io, "flush", fail=errno.EIO).release.set()
    got = []
    ctrl.submit_io(nvm.FlushCommand(nsid=1).to_sqe(), lambda c: got.append(c.status))
    ctrl.wait_idle()
    assert got == [S.INTERNAL | S.DNR]
    assert ns.stats.errors == 2 and uring.target.internal_errors == 0
    ctrl.close()


@needs_uring
def test_uring_fua_write_is_one_dsync_write_on_the_ring(uring):
    """A FUA write goes to the ring with RWF_DSYNC (durable when it completes), not followed by an fdatasync
    of the whole file; a plain write without it."""
    ctrl = uring.connect(SUB, num_io_queues=1)
    ns = uring.target.subsystem(SUB).namespaces[1]
    ring = ns.engine(uring.target.work).ring
    calls = []

    class Recording:
        def __getattr__(self, name):
            return getattr(ring, name)

        def write(self, fd, buf, offset, cookie, fua=False):
            calls.append(("write", offset, fua))
            ring.write(fd, buf, offset, cookie, fua)

        def fsync(self, fd, cookie):
            calls.append(("fsync",))
            ring.fsync(fd, cookie)
    ns.io.ring = Recording()
    ctrl.write(1, 0, b"\x07" * 512, fua=True)
    ctrl.write(1, 1, b"\x08" * 512)
    assert calls == [("write", 0, True), ("write", 512, False)]
    assert ctrl.read(1, 0, 2) == b"\x07" * 512 + b"\x08" * 512
    ctrl.close()


@needs_uring
def test_uring_ring_never_holds_more_than_the_queue_depth(uring):
    """32 reads on a namespace of queue depth 4: the ring (depth 4 + the flush) is never asked for more, the
    rest wait in order; all complete with their data."""
    ctrl = uring.connect(SUB, num_io_queues=1, queue_size=64)
    ns = uring.target.subsystem(SUB).namespaces[1]
    pattern = bytes(range(256)) * 128  # 32 KiB
    ctrl.write(1, 0, pattern)
    engine = ns.io
    assert engine.ring.depth == 5
    held = HeldRing(engine, "read_into")
    done = {}
    for i in range(32):
        ctrl.submit_read(1, i * 2, 2, lambda c, i=i: done.setdefault(i, (c.status, bytes(c.data))))
    uring.fabric.pump()
    assert held.running == 4 and engine.ring.in_flight == 4 and len(engine.waiting) == 28
    held.release.set()
    ctrl.wait_idle()
    assert held.most == 4 and held.started == [i * 1024 for i in range(32)]
    assert all(done[i] == (0, pattern[i * 1024:(i + 1) * 1024]) for i in range(32))
    ctrl.close()


def test_native_ring_refuses_a_command_past_its_depth_and_holds_its_buffers():
    """_native.Uring: EBUSY once `depth` commands are in flight; a buffer on the ring cannot be closed or
    resized under the kernel (the ring holds a buffer export until the completion is reaped); a read needs a
    writable buffer; close() cancels a read that would wait for ever (on an empty pipe)."""
    if uring_unavailable():
        pytest.skip(uring_unavailable())
    import mmap
    from nvmeof_roce import native
    r, w = os.pipe2(os.O_CLOEXEC)
    ring = native.module.Uring(2)
    try:
        bufs = [mmap.mmap(-1, 4096) for _ in range(3)]
        with pytest.raises(BufferError):
            ring.read(r, b"read-only", 0, "d")
        ring.read(r, bufs[0], 0, "a")
        ring.read(r, bufs[1], 0, "b")
        with pytest.raises(OSError) as ei:
            ring.read(r, bufs[2], 0, "c")
        assert ei.value.errno == errno.EBUSY
        assert ring.submit() == 2 and ring.in_flight == 2
        with pytest.raises(BufferError):
            bufs[0].close()  # exported to the ring
        os.write(w, b"x" * 8192)
        got = []
        while len(got) < 2:
            assert ring.wait(10)
            got += ring.reap()
        assert sorted(c for c, _ in got) == ["a", "b"] and ring.in_flight == 0
        bufs[0].close()  # released once reaped
        ring.read(r, bufs[1], 0, "never")  # nothing more comes down the pipe
        assert ring.submit() == 1
    finally:
        ring.close()
        os.close(r)
        os.close(w)
    assert ring.closed


def test_forced_io_uring_where_it_cannot_run_is_refused_naming_the_key(tmp_path, monkeypatch):
    from nvmeof_roce.config import ConfigError
    from nvmeof_roce.engine import ioengine
    monkeypatch.setattr(ioengine, "_uring_checked", True)
    monkeypatch.setattr(ioengine, "_uring_missing", "io_uring_setup failed: Operation not permitted")
    with pytest.raises(ConfigError) as ei:
        Env(files_config(tmp_path, count=1, engine="io_uring"))
    err = getattr(ei.value, "errors", [ei.value])[0]
    assert err.where.endswith("namespaces[0].nvmeof_roce.io_engine")
    assert "Operation not permitted" in err.problem
    import json
    from nvmeof_roce.service.commands import check_config
    path = tmp_path / "forced.json"
    path.write_text(json.dumps(files_config(tmp_path, count=1, engine="io_uring")))
    (tmp_path / "ns1.img").write_bytes(bytes(2 << 20))
    with pytest.raises(ConfigError) as ei:  # `target check` refuses it too
        check_config(str(path))
    err = getattr(ei.value, "errors", [ei.value])[0]
    assert err.where.endswith("nvmeof_roce.io_engine")
    env = Env(files_config(tmp_path, count=1))  # unset: the thread engine, and status says why
    try:
        ctrl = env.connect(SUB, num_io_queues=1)
        ctrl.write(1, 0, b"\x01" * 512)
        io = env.target.subsystem(SUB).namespaces[1].engine_status()
        assert io["engine"] == "threads" and "Operation not permitted" in io["engine_reason"]
        ctrl.close()
    finally:
        env.close()


def test_io_engine_key_is_validated(tmp_path):
    from nvmeof_roce.config import ConfigError, parse_config
    with pytest.raises(ConfigError, match="io_engine.*must be one of io_uring, threads"):
        parse_config(files_config(tmp_path, engine="aio"), "t")
    bad = files_config(tmp_path)
    bad["subsystems"][0]["namespaces"] = [{"nsid": 1, "nvmeof_roce": {"backend": "ram", "size": "1M",
                                                                      "io_engine": "threads"}}]
    with pytest.raises(ConfigError, match="file and block namespaces"):
        parse_config(bad, "t")
    assert parse_config(files_config(tmp_path, engine="threads"), "t").subsystems[0].namespaces[0].io_engine \
        == "threads"
