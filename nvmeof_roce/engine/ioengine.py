"""I/O engines: how a file or block namespace's commands reach the device without holding the event loop.

The target core is single threaded (engine/core.py): a `preadv` that waits 2 ms for a disk on the loop would
serve one command at a time and stall every other queue meanwhile.  An engine takes a namespace's reads,
writes, flushes and long commands, runs them elsewhere with many on the device at once, and hands each
completion back ON THE EVENT LOOP: through the target's `Work` channel (engine/work.py), an eventfd the loop
watches (`EventLoop.watch` on RDMA, `LoopbackFabric.watch` in the unit tests, so both drive the same path).

One interface, `IoEngine`; `choose_engine` picks the one that runs and says why (`target status` shows both):

- `UringEngine` ("io_uring"), where the native module is built and io_uring_setup works: for each namespace
  a ring (csrc/uring.c) of `queue_depth` reads and writes plus its flush.  The loop queues each command on the
  ring and submits it (one io_uring_enter; commands started by completions are submitted together), the
  kernel runs them with many on the device at once, and the ring's eventfd, watched by the loop, brings the
  completions back: no thread and no GIL hand-over per command.  Flush is the ring's fdatasync, which the
  kernel runs on a worker of its own, so reads keep going meanwhile (one at a time per namespace, the flushes
  that arrive while it runs share the next one); Write Zeroes and deallocate run on a lane thread as below.

- `ThreadEngine` ("threads"): for each namespace a pool of up to `queue_depth` threads for reads and writes
  (os.preadv/os.pwritev release the GIL while the device works, so up to `queue_depth` commands are on it at
  once), and one *lane* thread of its own for flushes and long commands (fdatasync, fallocate, BLKDISCARD,
  BLKZEROOUT): a host's flush never waits behind reads, reads never wait behind a flush, and one namespace's
  flush never waits for another's.  Consecutive flushes waiting on a lane are served by one fdatasync (each
  of them arrived before it started, so it covers every write completed before each of them).

- `AsyncEngine` ("async"), for a backend that completes on its own (`asynchronous = True`: librbd's aio, an
  RBD namespace): each read, write, flush and zeroing is `backend.submit`ted and returns at once; the backend
  makes its `completion_fd` readable when completions wait, the loop watches it and `reap` runs each
  completion on the loop.  No thread of ours; the same back-pressure as below.

A namespace's `nvmeof_roce.io_engine` ("io_uring" or "threads") forces one: "threads" always works;
"io_uring" where it does not is refused when the namespace opens, with the reason.

Back-pressure: at most `queue_depth` reads and writes of a namespace are with the device; a command that
finds it full waits in a FIFO and starts, in arrival order, when one completes.  The FIFO is bounded by the
hosts' queue depths: a waiting command keeps its transport request slot, so a host cannot send more.

Data: reads land in page-aligned buffers of the engine (what O_DIRECT needs) and the transport copies them
into its registered chunk when it sends them; writes are copied into one before they start, since the
transport's chunk goes back to its pool once the data handler returns.  (Reading straight into the registered
chunk needs the transport to keep the chunk until the device is done with it: the native data path's job,
through csrc/uring.h.)  A read or write that ends short goes on for the rest; one that meets the end of the
file is an error (never zeros with success).

Without a loop (a Target used directly) every call runs inline and completes before it returns.

Cost: over loopback on a 2-core machine a 4 KiB read at QD32 takes ~27 us of CPU on a file namespace against
~19 us on a RAM one (two thread hand-overs and the GIL).  The interpreter's GIL switch interval (5 ms) is kept:
0.5 ms, to hand completions back sooner, doubled the CPU per command (47-54 us).
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import queue
import threading
import time
from collections import deque
from typing import Callable, Deque, Dict, List, NamedTuple, Optional, Tuple

from .. import native
from ..config import NS_IO_ENGINES
from .backends import BackendError, Op

log = logging.getLogger(__name__)

__all__ = ["IoEngine", "ThreadEngine", "UringEngine", "AsyncEngine", "EngineChoice", "choose_engine", "make_engine",
           "uring_unavailable", "DEFAULT_QUEUE_DEPTH", "MAX_QUEUE_DEPTH"]

DEFAULT_QUEUE_DEPTH = 128  # commands on the device per namespace: what an NVMe SSD needs for its rated IOPS
MAX_QUEUE_DEPTH = 1024

ReadDone = Callable[[Optional[memoryview], Optional[BaseException]], None]
Done = Callable[[Optional[BaseException]], None]


class EngineChoice(NamedTuple):
    name: str  # "io_uring" or "threads"
    reason: str  # why this one: shown by `target status`


_uring_checked = False
_uring_missing: Optional[str] = None


def uring_unavailable() -> Optional[str]:
    """None when io_uring works in this process, else why not (checked once: io_uring_setup and an eventfd
    registration on a ring of one entry)."""
    global _uring_checked, _uring_missing
    if not _uring_checked:
        _uring_checked = True
        if native.module is None:
            _uring_missing = native.missing_reason
        elif not hasattr(native.module, "Uring"):
            _uring_missing = "the native module was built without the io_uring engine (rebuild it: make venv)"
        else:
            try:
                native.module.uring_probe()
            except OSError as exc:
                hint = {errno.ENOSYS: "the kernel has no io_uring (5.1 or later, CONFIG_IO_URING)",
                        errno.EPERM: "forbidden here: sysctl kernel.io_uring_disabled, or a seccomp filter "
                                     "(a container's)"}.get(exc.errno, "")
                _uring_missing = f"io_uring_setup failed: {exc.strerror}" + (f" ({hint})" if hint else "")
        if _uring_missing:
            log.warning("io_uring is not available (%s): file and block namespaces use the thread engine",
                        _uring_missing)
    return _uring_missing


def choose_engine(backend, forced: Optional[str] = None) -> EngineChoice:
    """The engine that serves a file or block namespace, and why: io_uring where it works, else the thread
    pool; `forced` (the namespace's nvmeof_roce.io_engine) picks one, and io_uring forced where it does not
    work is refused (BackendError naming the key), never served by the other."""
    assert forced in (None,) + NS_IO_ENGINES
    if backend.asynchronous:
        if forced:
            raise BackendError(f"{backend.describe()}: nvmeof_roce.io_engine is for file and block namespaces; "
                               f"a {backend.kind} namespace completes through its own asynchronous calls",
                               "remove io_engine", field="nvmeof_roce.io_engine")
        return EngineChoice("async", f"{backend.kind}: its own asynchronous calls (submit, completion fd, reap)")
    if forced == "threads":
        return EngineChoice("threads", 'thread pool: nvmeof_roce.io_engine is "threads" (io_uring not used)')
    missing = uring_unavailable()
    if missing is None:
        return EngineChoice("io_uring", "io_uring" + (' (nvmeof_roce.io_engine is "io_uring")' if forced else
                                                      ": the ring of the native module"))
    if forced == "io_uring":
        raise BackendError(f"{backend.describe()}: nvmeof_roce.io_engine is \"io_uring\" but io_uring cannot "
                           f"run here: {missing}",
                           "leave io_engine out (the thread pool serves where io_uring cannot) or set it to "
                           "\"threads\"", field="nvmeof_roce.io_engine")
    return EngineChoice("threads", f"thread pool: io_uring unavailable ({missing})")


def make_engine(choice: EngineChoice, backend, depth: int, channel) -> "IoEngine":
    if choice.name == "async":
        return AsyncEngine(backend, depth, channel, choice.reason)
    if choice.name == "io_uring":
        return UringEngine(backend, depth, channel, choice.reason)
    return ThreadEngine(backend, depth, channel, choice.reason)


class _Buffers:
    """Page-aligned buffers (anonymous mmaps) by size class, reused: what O_DIRECT wants."""

    def __init__(self):
        self._free: Dict[int, List[mmap.mmap]] = {}

    @staticmethod
    def _size_class(length: int) -> int:
        size = mmap.PAGESIZE
        while size < length:
            size <<= 1
        return size

    def take(self, length: int) -> mmap.mmap:
        size = self._size_class(length)
        free = self._free.get(size)
        return free.pop() if free else mmap.mmap(-1, size)

    def give(self, buf: mmap.mmap) -> None:
        self._free.setdefault(len(buf), []).append(buf)

    def close(self) -> None:
        for bufs in self._free.values():
            for b in bufs:
                try:
                    b.close()
                except BufferError:
                    pass
        self._free.clear()


class _Op:
    """One read or write: where, its aligned buffer, the outcome, and its completion."""

    __slots__ = ("write", "offset", "length", "data", "buf", "fua", "done", "exc", "fd", "moved", "flush_after")

    def __init__(self, write: bool, offset: int, length: int, data, fua: bool, done):
        self.write = write
        self.offset = offset
        self.length = length
        self.data = data  # a write's bytes while it waits for a slot
        self.buf: Optional[mmap.mmap] = None
        self.fua = fua
        self.done = done
        self.exc: Optional[BaseException] = None
        self.fd = -1  # io_uring: the descriptor it goes to (the buffered one after O_DIRECT refused it)
        self.moved = 0  # io_uring: bytes read or written so far (a short transfer goes on for the rest)
        self.flush_after = False  # io_uring: a FUA write where RWF_DSYNC is refused: written, then fdatasync


class IoEngine:
    """What io.py codes against for a file or block namespace.  Every `done` runs on the event loop."""

    name = "?"
    reason = ""
    depth = 0

    def read(self, offset: int, length: int, done: ReadDone) -> None:
        """Read `length` bytes; done(view, None) with a view valid during the call, or done(None, exc)."""
        raise NotImplementedError

    def write(self, offset: int, data, fua: bool, done: Done) -> None:
        """Write `data` (copied before this returns); with `fua` durable before done(None)."""
        raise NotImplementedError

    def flush(self, done: Done) -> None:
        """Make every write completed before this call durable (fdatasync), then done(None)."""
        raise NotImplementedError

    def zero(self, ranges: List[Tuple[int, int]], deallocate: bool, done: Done) -> None:
        """Write Zeroes (or deallocate) byte ranges, on the long-command lane."""
        raise NotImplementedError

    def status(self) -> dict:
        raise NotImplementedError

    def close(self, timeout: float = 10.0) -> None:
        pass


class _Lane:
    """A namespace's thread for flushes and long commands (fdatasync, fallocate, BLKDISCARD, BLKZEROOUT), one
    at a time; each completion is posted back to the loop.  Consecutive flushes waiting on it are served by
    one fdatasync (each of them arrived before it started, so it covers every write completed before each)."""

    def __init__(self, channel):
        self.channel = channel
        self.in_flight = 0  # submitted, not yet completed on the loop
        self._jobs: Deque[tuple] = deque()
        self._cv = threading.Condition()
        self._thread: Optional[threading.Thread] = None

    @property
    def threads(self) -> int:
        return 1 if self._thread is not None else 0

    def submit(self, kind: str, fn: Callable[[], None], done: Done) -> None:
        if not self.channel.attached:
            done(_call(fn))
            return
        self.in_flight += 1
        with self._cv:
            self._jobs.append((kind, fn, done))
            if self._thread is None:
                self._thread = threading.Thread(target=self._worker, name="nvmeof-roce-lane", daemon=True)
                self._thread.start()
            self._cv.notify()

    def _worker(self) -> None:
        while True:
            with self._cv:
                while not self._jobs:
                    self._cv.wait()
                kind, fn, done = self._jobs.popleft()
                if kind is None:
                    return
                dones = [done]
                if kind == "flush":  # every flush waiting now arrived before this fdatasync starts
                    while self._jobs and self._jobs[0][0] == "flush":
                        dones.append(self._jobs.popleft()[2])
            exc = _call(fn)
            for d in dones:
                self.channel.post(lambda d=d: self._complete(d, exc))

    def _complete(self, done: Done, exc: Optional[BaseException]) -> None:
        self.in_flight -= 1
        try:
            done(exc)
        except Exception:
            log.exception("completion of a flush or long command failed")

    def close(self, timeout: float) -> None:
        if self._thread is None:
            return
        with self._cv:
            self._jobs.append((None, None, None))
            self._cv.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("a flush or long command is still running after %.0f s", timeout)
        self._thread = None


class _QueuedEngine(IoEngine):
    """What both engines share: at most `depth` reads and writes with the device, the FIFO of those that wait,
    the aligned buffers, completions on the loop, the lane for long commands, status and figures.  A subclass
    gives `_dispatch(op)` (hand a started op to the device; `_complete(op)` on the loop when it is done)."""

    def __init__(self, backend, depth: int, channel, reason: str = ""):
        self.backend = backend
        self.depth = depth
        self.reason = reason
        self.channel = channel  # engine/work.py's Work: `attached`, post(callback) from any thread
        channel.engines.add(self)  # Work.close closes the engines before it runs their last completions
        self.in_flight = 0  # reads/writes given to the device, not yet completed on the loop
        self.waiting: Deque[_Op] = deque()  # reads/writes that found the namespace full, in arrival order
        self.submitted = 0
        self.most_in_flight = 0  # the highest in_flight seen (tests and status: were commands overlapped?)
        self.waited = 0  # commands that had to wait for a slot
        self._buffers = _Buffers()
        self._lane = _Lane(channel)
        self._closed = False

    # -- reads and writes
    def read(self, offset, length, done):
        self._admit(_Op(False, offset, length, None, False, done))

    def write(self, offset, data, fua, done):
        op = _Op(True, offset, len(data), None, fua, done)
        if (self.in_flight >= self.depth or self.waiting) and self.channel.attached:
            op.data = bytes(data)  # waits for a slot: the caller's buffer is only lent for this call
            self.waited += 1
            self.waiting.append(op)
            return
        self._start(op, data)

    def _admit(self, op: _Op) -> None:
        if (self.in_flight >= self.depth or self.waiting) and self.channel.attached:
            self.waited += 1
            self.waiting.append(op)
            return
        self._start(op, None)

    def _start(self, op: _Op, data) -> None:
        op.buf = self._buffers.take(op.length)
        if op.write:
            op.buf[:op.length] = data if data is not None else op.data
            op.data = None
        self.submitted += 1
        if not self.channel.attached:  # no loop: inline
            self._run(op)
            self._finish(op)
            return
        self.in_flight += 1
        if self.in_flight > self.most_in_flight:
            self.most_in_flight = self.in_flight
        self._dispatch(op)

    def _dispatch(self, op: _Op) -> None:
        raise NotImplementedError

    def _run(self, op: _Op) -> None:
        """The op through the backend's own (blocking) calls."""
        view = memoryview(op.buf)[:op.length]
        try:
            if op.write:
                self.backend.write(op.offset, view, dsync=op.fua)
            else:
                self.backend.read_into(op.offset, view)
        except Exception as exc:  # reported on the loop; a bug is told apart there (io.py)
            op.exc = exc
        finally:
            view.release()

    def _complete(self, op: _Op) -> None:
        """On the loop: the op's completion, then the next waiting command gets its slot."""
        self.in_flight -= 1
        try:
            self._finish(op)
        finally:
            while self.waiting and self.in_flight < self.depth:
                self._start(self.waiting.popleft(), None)

    def _finish(self, op: _Op) -> None:
        buf, op.buf = op.buf, None
        view = memoryview(buf)[:op.length]
        try:
            if op.write:
                op.done(op.exc)
            else:
                op.done(None if op.exc else view, op.exc)
        except Exception:
            log.exception("completion of a %s failed", "write" if op.write else "read")
        finally:
            view.release()
            self._buffers.give(buf)

    # -- the lane: long commands (and the thread engine's flushes)
    def flush(self, done):
        self._lane.submit("flush", self.backend.flush, done)

    def zero(self, ranges, deallocate, done):
        op = self.backend.discard if deallocate else self.backend.write_zeroes

        def run():
            for offset, length in ranges:
                op(offset, length)
        self._lane.submit("deallocate" if deallocate else "write zeroes", run, done)

    @property
    def lane_in_flight(self) -> int:
        """Flushes and long commands not yet completed on the loop."""
        return self._lane.in_flight

    # -- figures
    @property
    def busy(self) -> int:
        """Commands given to this engine and not yet completed (waiting ones included)."""
        return self.in_flight + len(self.waiting) + self.lane_in_flight

    @property
    def threads(self) -> int:
        return self._lane.threads

    def status(self) -> dict:
        return {"engine": self.name, "engine_reason": self.reason, "queue_depth": self.depth,
                "in_flight": self.in_flight, "waiting": len(self.waiting), "long_in_flight": self.lane_in_flight,
                "most_in_flight": self.most_in_flight, "threads": self.threads}


class ThreadEngine(_QueuedEngine):
    """Reads and writes on a pool of up to `depth` threads, flushes and long commands on a lane thread."""

    name = "threads"

    def __init__(self, backend, depth: int, channel, reason: str = ""):
        super().__init__(backend, depth, channel, reason)
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._threads: List[threading.Thread] = []

    def _dispatch(self, op: _Op) -> None:
        if len(self._threads) < self.in_flight:
            t = threading.Thread(target=self._worker, name=f"nvmeof-roce-io-{len(self._threads)}", daemon=True)
            self._threads.append(t)
            t.start()
        self._jobs.put(op)

    def _worker(self) -> None:
        while True:
            op = self._jobs.get()
            if op is None:
                return
            self._run(op)
            self.channel.post(lambda op=op: self._complete(op))

    @property
    def threads(self) -> int:
        return len(self._threads) + self._lane.threads

    def close(self, timeout: float = 10.0) -> None:
        """Let the calls running finish, then stop the threads.  Completions still due arrive through the
        channel (Work.close runs what is left); waiting commands are answered by their queue's closing."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join(timeout)
            if t.is_alive():
                log.warning("a device call is still running after %.0f s", timeout)
        self._threads = []
        self._lane.close(timeout)


_FLUSH = "flush"  # the cookie of a namespace's fdatasync on its ring


class UringEngine(_QueuedEngine):
    """Reads, writes and flushes on an io_uring (csrc/uring.c) whose eventfd the loop watches; long commands
    on a lane thread."""

    name = "io_uring"

    def __init__(self, backend, depth: int, channel, reason: str = ""):
        super().__init__(backend, depth, channel, reason)
        self.ring = native.module.Uring(depth + 1)  # the reads and writes, and the namespace's one fdatasync
        self.flushes_in_flight = 0  # Flush commands not yet completed on the loop
        self._flushes: List[Done] = []  # flushes waiting for the next fdatasync
        self._flushing: Optional[List[Done]] = None  # the flushes the running fdatasync answers
        self._queued = 0  # commands on the ring not yet submitted
        self._reaping = False  # in _on_ready: submit once at its end
        self._watched = False

    def _watch(self) -> None:
        if not self._watched:
            self.channel.watch(self.ring.fileno(), self._on_ready)
            self._watched = True

    # -- reads and writes
    def _dispatch(self, op: _Op) -> None:
        op.fd = self.backend.io_fd
        self._watch()
        self._queue(op)

    def _queue(self, op: _Op) -> None:
        """Put the op's remaining transfer on the ring."""
        moved = op.moved
        buf = op.buf if moved == 0 and op.length == len(op.buf) else memoryview(op.buf)[moved:op.length]
        if op.write:
            self.ring.write(op.fd, buf, op.offset + moved, op, op.fua)
        else:
            self.ring.read(op.fd, buf, op.offset + moved, op)
        self._queued += 1
        if not self._reaping:
            self._submit()

    def _submit(self) -> None:
        try:
            self.ring.submit()
            self._queued = 0
        except OSError as exc:  # EAGAIN, ENOMEM: the kernel is short of memory; they stay queued, try again soon
            log.warning("io_uring submission failed (%s): retrying", exc.strerror)
            self.channel.post(self._retry_submit)

    def _retry_submit(self) -> None:
        if self._queued and not self.ring.closed:
            self._submit()

    def _on_ready(self) -> None:
        """On the loop, the eventfd readable: every completion ready, then one submission for what they started
        (the waiting commands given a slot, the rest of short transfers, the next fdatasync)."""
        self._reaping = True
        try:
            for cookie, res in self.ring.reap():
                if cookie is _FLUSH:
                    self._flush_done(res)
                else:
                    self._transferred(cookie, res)
        finally:
            self._reaping = False
            if self._queued:
                self._submit()

    def _transferred(self, op: _Op, res: int) -> None:
        backend = self.backend
        if res < 0:
            err = -res
            if err == errno.EINVAL and op.fd != backend.buffered_fd:
                op.fd = backend.buffered_fd  # unaligned for O_DIRECT: the buffered descriptor, as the backend
                return self._queue(op)
            if err in (errno.EOPNOTSUPP, errno.EINVAL) and op.write and op.fua:
                op.fua, op.flush_after = False, True  # no RWF_DSYNC here: write, then fdatasync
                return self._queue(op)
            op.exc = backend.io_error("write" if op.write else "read", op.offset, op.length,
                                      OSError(err, os.strerror(err)))
        elif res == 0:  # nothing more: the end of the file (it shrank under the namespace), or a device
            op.exc = (backend.short_write_error if op.write else backend.short_read_error)(
                op.offset, op.length, op.moved)
        else:
            op.moved += res
            if op.moved < op.length:
                return self._queue(op)  # a short transfer: the rest
            if op.flush_after:
                return self.flush(lambda exc: self._flushed_write(op, exc))
        self._complete(op)

    def _flushed_write(self, op: _Op, exc: Optional[BaseException]) -> None:
        op.exc = exc
        self._complete(op)

    # -- flushes: the ring's fdatasync, run by the kernel on a worker of its own
    def flush(self, done):
        if not self.channel.attached:
            done(_call(self.backend.flush))
            return
        self.flushes_in_flight += 1
        self._flushes.append(done)
        if self._flushing is None:
            self._start_flush()

    def _start_flush(self) -> None:
        # every flush waiting now arrived before this fdatasync starts: it covers the writes completed before each
        self._flushing, self._flushes = self._flushes, []
        self._watch()
        self.ring.fsync(self.backend.buffered_fd, _FLUSH)
        self._queued += 1
        if not self._reaping:
            self._submit()

    def _flush_done(self, res: int) -> None:
        dones, self._flushing = self._flushing or [], None
        exc = None if res >= 0 else self.backend.flush_error(OSError(-res, os.strerror(-res)))
        if self._flushes:
            self._start_flush()
        for done in dones:
            self.flushes_in_flight -= 1
            try:
                done(exc)
            except Exception:
                log.exception("completion of a flush failed")

    @property
    def lane_in_flight(self) -> int:
        return self._lane.in_flight + self.flushes_in_flight

    def close(self, timeout: float = 10.0) -> None:
        """Let the commands in flight complete (their completions run here, on the loop: Target.close), at
        most `timeout` seconds, then free the ring.  A ring with commands still in flight after that is kept
        (the kernel may still write into its buffers), with a warning."""
        if self._closed:
            return
        self._closed = True
        self._lane.close(timeout)
        deadline = time.monotonic() + timeout
        if self._queued:
            self._submit()
        while self.ring.in_flight and time.monotonic() < deadline:
            if self.ring.wait(max(0.0, deadline - time.monotonic())):
                self._on_ready()
        if self._watched:
            self.channel.unwatch(self.ring.fileno())
            self._watched = False
        if self.ring.in_flight:
            log.warning("%d command(s) still with the device after %.0f s: the ring is left open",
                        self.ring.in_flight, timeout)
            return
        self.ring.close()
        self._buffers.close()


class AsyncEngine(_QueuedEngine):
    """A backend that completes on its own (the module's docstring): submit, completion fd, reap on the loop."""

    name = "async"

    def __init__(self, backend, depth: int, channel, reason: str = ""):
        super().__init__(backend, depth, channel, reason)
        self._long_in_flight = 0
        self._fd = backend.completion_fd()
        if channel.attached and self._fd is not None:
            channel.watch(self._fd, backend.reap)

    def _dispatch(self, op: _Op) -> None:
        view = memoryview(op.buf)[:op.length]

        def done(exc, op=op, view=view):
            view.release()
            op.exc = exc
            self._complete(op)
        self.backend.submit(Op("write" if op.write else "read", op.offset, op.length, view, op.fua), done)

    def _long(self, op: Op, done: Done) -> None:
        if not self.channel.attached:  # no loop: the backend's blocking calls
            self.backend.complete_inline(op, done)
            return
        self._long_in_flight += 1

        def finished(exc):
            self._long_in_flight -= 1
            done(exc)
        self.backend.submit(op, finished)

    def flush(self, done):
        try:
            self._long(Op("flush"), done)
        except Exception as exc:
            done(exc)

    def zero(self, ranges, deallocate, done):
        """Every range at once; done(the first error, or None) after the last."""
        if not ranges:
            done(None)
            return
        left = [len(ranges)]
        first: List[Optional[BaseException]] = [None]

        def one(exc):
            if exc is not None and first[0] is None:
                first[0] = exc
            left[0] -= 1
            if left[0] == 0:
                done(first[0])
        what = "discard" if deallocate else "write_zeroes"
        for offset, length in ranges:
            try:
                self._long(Op(what, offset, length), one)
            except Exception as exc:
                one(exc)

    @property
    def lane_in_flight(self) -> int:
        return self._long_in_flight

    def close(self, timeout: float = 10.0) -> None:
        """Stop watching; completions still due are reaped by the backend's close (their commands' queues have
        gone or go with the target)."""
        if self._closed:
            return
        self._closed = True
        if self._fd is not None:
            self.channel.unwatch(self._fd)


def _call(fn: Callable[[], None]) -> Optional[BaseException]:
    try:
        fn()
    except Exception as exc:
        return exc
    return None
