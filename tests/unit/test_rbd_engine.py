"""RBD namespaces on the asynchronous engine (engine/backends/rbd.py RbdBackend, engine/ioengine.py AsyncEngine)
against a stand-in librbd image whose completions the test releases one by one, from another thread as librbd's
would: the windows where a command could be lost or the loop could wait (a completion with an error, a completion
after the engine closed, a stalled completion, a client the cluster has blocklisted)."""
import errno
import threading

import pytest

from nvmeof_roce.config.rbd import RbdSettings
from nvmeof_roce.engine.backends import BackendError
from nvmeof_roce.engine.backends.rbd import EBLOCKLISTED, RbdBackend
from nvmeof_roce.engine.io import device_status
from nvmeof_roce.engine.ioengine import AsyncEngine, choose_engine, make_engine
from nvmeof_roce.engine.work import Work
from nvmeof_roce.nvme import status as S
from nvmeof_roce.nvme.command import NVM_READ, NVM_WRITE

SIZE = 1 << 20


class Completion:
    def __init__(self, code):
        self.code = code

    def get_return_value(self):
        return self.code


class HeldImage:
    """librbd's Image as the engine uses it: every aio call is held until the test releases it; the release
    runs the callback on a thread of its own, as librbd's completion threads do."""

    def __init__(self):
        self.data = bytearray(SIZE)
        self.held = []
        self.lock = threading.Lock()

    def size(self):
        return SIZE

    def _hold(self, kind, apply, callback, with_data=False):
        with self.lock:
            self.held.append((kind, apply, callback, with_data))

    def aio_write(self, data, offset, callback):
        def apply():
            self.data[offset:offset + len(data)] = data
        self._hold("write", apply, callback)

    def aio_read(self, offset, length, callback):
        self._hold("read", lambda: bytes(self.data[offset:offset + length]), callback, with_data=True)

    def aio_flush(self, callback):
        self._hold("flush", lambda: None, callback)

    def aio_write_zeroes(self, offset, length, callback):
        def apply():
            self.data[offset:offset + length] = bytes(length)
        self._hold("write zeroes", apply, callback)

    def aio_discard(self, offset, length, callback):
        self.aio_write_zeroes(offset, length, callback)

    def release(self, kind=None, code=0):
        """Complete the oldest held call (of `kind`), with `code` (a negative errno fails it, unapplied)."""
        with self.lock:
            i = next(i for i, h in enumerate(self.held) if kind is None or h[0] == kind)
            _, apply, callback, with_data = self.held.pop(i)
        result = apply() if code == 0 else None
        args = (Completion(code if code else 0), result) if with_data else (Completion(code),)
        t = threading.Thread(target=callback, args=args)
        t.start()
        t.join()


class Loop:
    def __init__(self):
        self.watched = {}

    def watch(self, fd, callback):
        self.watched[fd] = callback

    def unwatch(self, fd):
        self.watched.pop(fd, None)


@pytest.fixture
def engine():
    work = Work()
    loop = Loop()
    work.attach(loop)
    image = HeldImage()
    backend = RbdBackend(RbdSettings(pool="rbd", image="held"), image=image)
    choice = choose_engine(backend)
    assert choice.name == "async"
    eng = make_engine(choice, backend, 2, work)
    assert isinstance(eng, AsyncEngine) and loop.watched[backend.completion_fd()] == backend.reap
    yield eng, image, work
    work.close(0.1)


def results():
    got = []
    return got, (lambda *args: got.append(args))


def test_a_write_and_a_read_complete_on_the_loop_not_on_librbds_thread(engine):
    eng, image, work = engine
    got, done = results()
    eng.write(4096, b"\x5a" * 4096, False, lambda exc: got.append(("write", exc)))
    assert eng.in_flight == 1 and image.data[4096] == 0
    image.release("write")
    assert got == [] and eng.backend.in_flight == 1  # queued: nothing ran on librbd's thread
    eng.backend.reap()
    assert got == [("write", None)] and eng.in_flight == 0
    seen = []
    eng.read(4096, 4096, lambda view, exc: seen.append((bytes(view) if view is not None else None, exc)))
    image.release("read")
    eng.backend.reap()
    assert seen == [(b"\x5a" * 4096, None)]


def test_a_completion_with_an_error_fails_that_command_only_and_frees_its_slot(engine):
    eng, image, work = engine
    outcomes = []
    eng.write(0, b"\x01" * 512, False, lambda exc: outcomes.append(exc))
    eng.write(512, b"\x02" * 512, False, lambda exc: outcomes.append(exc))
    eng.write(1024, b"\x03" * 512, False, lambda exc: outcomes.append(exc))  # waits: depth 2
    assert eng.in_flight == 2 and len(eng.waiting) == 1
    image.release("write", code=-errno.EIO)
    eng.backend.reap()
    assert isinstance(outcomes[0], BackendError) and outcomes[0].errno == errno.EIO
    assert device_status(outcomes[0], NVM_WRITE)[0] == S.INTERNAL | S.DNR
    assert eng.in_flight == 2 and not eng.waiting  # the failed one's slot went to the waiting write
    image.release("write")
    image.release("write")
    eng.backend.reap()
    assert outcomes[1:] == [None, None]
    assert image.data[0] == 0 and image.data[512] == 2 and image.data[1024] == 3  # the failed write never landed


def test_a_stalled_read_holds_its_slot_but_not_a_flush_and_the_loop_never_waits(engine):
    eng, image, work = engine
    reads, flushes = [], []
    eng.read(0, 512, lambda view, exc: reads.append(exc))
    eng.read(512, 512, lambda view, exc: reads.append(exc))
    eng.flush(lambda exc: flushes.append(exc))  # not behind the stalled reads
    assert eng.busy == 3 and eng.lane_in_flight == 1
    image.release("flush")
    eng.backend.reap()
    assert flushes == [None] and reads == [] and eng.in_flight == 2
    image.release("read")
    image.release("read")
    eng.backend.reap()
    assert reads == [None, None] and eng.busy == 0


def test_a_completion_after_the_engine_closed_is_reaped_by_the_backends_close(engine):
    eng, image, work = engine
    late = []
    eng.write(0, b"\x07" * 512, False, lambda exc: late.append(exc))
    work.close(0.1)  # the target closing: the engine stops watching
    image.release("write")  # librbd completes afterwards
    assert late == []  # nothing runs on librbd's thread
    eng.backend.image = None  # the stand-in has no close of its own
    eng.backend.close()  # the namespace's close runs what is left, once, on the loop's thread
    assert late == [None] and eng.backend.in_flight == 0
    assert image.data[0] == 7


def test_a_blocklisted_client_is_reported_as_fenced_with_a_path_status(engine):
    eng, image, work = engine
    outcomes = []
    eng.read(0, 512, lambda view, exc: outcomes.append(exc))
    image.release("read", code=-EBLOCKLISTED)
    eng.backend.reap()
    exc = outcomes[0]
    assert isinstance(exc, BackendError) and exc.errno == EBLOCKLISTED and "blocklisted" in exc.fix
    status, _ = device_status(exc, NVM_READ)
    assert status == S.ANA_INACCESSIBLE  # a path error without DNR: the host's multipath retries elsewhere


def test_a_cluster_that_times_out_gives_a_path_status_the_host_retries(engine):
    eng, image, work = engine
    outcomes = []
    eng.write(0, b"\x01" * 512, False, lambda exc: outcomes.append(exc))
    image.release("write", code=-errno.ETIMEDOUT)
    eng.backend.reap()
    assert outcomes[0].errno == errno.ETIMEDOUT and "ceph -s" in outcomes[0].fix
    assert device_status(outcomes[0], NVM_WRITE)[0] == S.ANA_TRANSITION


def test_write_zeroes_over_several_ranges_completes_once_after_the_last(engine):
    eng, image, work = engine
    image.data[:] = b"\xff" * SIZE
    done = []
    eng.zero([(0, 512), (4096, 1024)], False, lambda exc: done.append(exc))
    image.release("write zeroes")
    eng.backend.reap()
    assert done == []
    image.release("write zeroes", code=-errno.EIO)
    eng.backend.reap()
    assert len(done) == 1 and done[0].errno == errno.EIO and eng.lane_in_flight == 0


def test_a_submit_librbd_refuses_completes_on_the_loop_with_the_reason(engine):
    eng, image, work = engine
    image.aio_read = None  # not callable: librbd refusing the call
    outcomes = []
    eng.read(0, 512, lambda view, exc: outcomes.append(exc))
    assert outcomes == []  # never inside the caller's stack
    eng.backend.reap()
    assert isinstance(outcomes[0], BackendError) and "submit read" in str(outcomes[0]) and eng.in_flight == 0
