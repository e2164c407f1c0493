"""I/O engines: how a file or block namespace's commands reach the device without holding the event loop.

The target core is single threaded (target/core.py): a `preadv` that waits 2 ms for a disk on the loop would
serve one command at a time and stall every other queue meanwhile.  An engine takes a namespace's reads,
writes, flushes and long commands, runs them elsewhere with many on the device at once, and hands each
completion back ON THE EVENT LOOP: through the target's `Work` channel (target/work.py), an eventfd the loop
watches (`EventLoop.watch` on RDMA, `LoopbackFabric.watch` in the unit tests, so both drive the same path).

One interface, `IoEngine`; `choose_engine` picks the one that runs and says why (`target status` shows both):

- `ThreadEngine` ("threads"): for each namespace a pool of up to `queue_depth` threads for reads and writes
  (os.preadv/os.pwritev release the GIL while the device works, so up to `queue_depth` commands are on it at
  once), and one *lane* thread of its own for flushes and long commands (fdatasync, fallocate, BLKDISCARD,
  BLKZEROOUT): a host's flush never waits behind reads, reads never wait behind a flush, and one namespace's
  flush never waits for another's.  Consecutive flushes waiting on a lane are served by one fdatasync (each
  of them arrived before it started, so it covers every write completed before each of them).
- io_uring: to come with the native module, behind the same interface (`choose_engine` is where it plugs in).

Back-pressure: at most `queue_depth` reads and writes of a namespace are with the device; a command that
finds it full waits in a FIFO and starts, in arrival order, when one completes.  The FIFO is bounded by the
hosts' queue depths: a waiting command keeps its transport request slot, so a host cannot send more.

Data: reads land in page-aligned buffers of the engine (what O_DIRECT needs) and the transport copies them
into its registered chunk when it sends them; writes are copied into one before they start, since the
transport's chunk goes back to its pool once the data handler returns.  (Reading straight into the registered
chunk needs the transport to keep the chunk until the device is done with it: the native engine's job.)

Without a loop (a Target used directly) every call runs inline and completes before it returns.

Cost: over loopback on a 2-core machine a 4 KiB read at QD32 takes ~27 us of CPU on a file namespace against
~19 us on a RAM one (two thread hand-overs and the GIL).  The interpreter's GIL switch interval (5 ms) is kept:
0.5 ms, to hand completions back sooner, doubled the CPU per command (47-54 us).
"""
from __future__ import annotations

import logging
import mmap
import os
import queue
import threading
from collections import deque
from typing import Callable, Deque, Dict, List, NamedTuple, Optional, Tuple

log = logging.getLogger(__name__)

__all__ = ["IoEngine", "ThreadEngine", "EngineChoice", "choose_engine", "DEFAULT_QUEUE_DEPTH", "MAX_QUEUE_DEPTH"]

DEFAULT_QUEUE_DEPTH = 128  # commands on the device per namespace: what an NVMe SSD needs for its rated IOPS
MAX_QUEUE_DEPTH = 1024

ReadDone = Callable[[Optional[memoryview], Optional[BaseException]], None]
Done = Callable[[Optional[BaseException]], None]


class EngineChoice(NamedTuple):
    name: str  # "threads" (later "io_uring")
    reason: str  # why this one: shown by `target status`


def choose_engine(backend) -> EngineChoice:
    """The engine that serves a file or block namespace, and why.  io_uring (with registered buffers and
    files) is the goal; it comes with the native module, and this is where it plugs in."""
    return EngineChoice("threads", "io_uring engine not built in (native module absent): thread pool")


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

    __slots__ = ("write", "offset", "length", "data", "buf", "fua", "done", "exc")

    def __init__(self, write: bool, offset: int, length: int, data, fua: bool, done):
        self.write = write
        self.offset = offset
        self.length = length
        self.data = data  # a write's bytes while it waits for a slot
        self.buf: Optional[mmap.mmap] = None
        self.fua = fua
        self.done = done
        self.exc: Optional[BaseException] = None


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


class ThreadEngine(IoEngine):
    """Reads and writes on a pool of up to `depth` threads, flushes and long commands on a lane thread."""

    name = "threads"

    def __init__(self, backend, depth: int, channel, reason: str = ""):
        self.backend = backend
        self.depth = depth
        self.reason = reason
        self.channel = channel  # target/work.py's Work: `attached`, post(callback) from any thread
        channel.engines.add(self)  # Work.close closes the engines before it runs their last completions
        self.in_flight = 0  # reads/writes given to the threads, not yet completed on the loop
        self.lane_in_flight = 0  # flushes and long commands not yet completed on the loop
        self.waiting: Deque[_Op] = deque()  # reads/writes that found the namespace full, in arrival order
        self.submitted = 0
        self.most_in_flight = 0  # the highest in_flight seen (tests and status: were commands overlapped?)
        self.waited = 0  # commands that had to wait for a slot
        self._buffers = _Buffers()
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._threads: List[threading.Thread] = []
        self._lane: Deque[tuple] = deque()
        self._lane_cv = threading.Condition()
        self._lane_thread: Optional[threading.Thread] = None
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
        if len(self._threads) < self.in_flight:
            t = threading.Thread(target=self._worker, name=f"nvmeof-roce-io-{len(self._threads)}", daemon=True)
            self._threads.append(t)
            t.start()
        self._jobs.put(op)

    def _run(self, op: _Op) -> None:
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

    def _worker(self) -> None:
        while True:
            op = self._jobs.get()
            if op is None:
                return
            self._run(op)
            self.channel.post(lambda op=op: self._complete(op))

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

    # -- the lane: flushes and long commands
    def flush(self, done):
        self._lane_submit("flush", self.backend.flush, done)

    def zero(self, ranges, deallocate, done):
        op = self.backend.discard if deallocate else self.backend.write_zeroes

        def run():
            for offset, length in ranges:
                op(offset, length)
        self._lane_submit("deallocate" if deallocate else "write zeroes", run, done)

    def _lane_submit(self, kind: str, fn: Callable[[], None], done: Done) -> None:
        if not self.channel.attached:
            done(_call(fn))
            return
        self.lane_in_flight += 1
        with self._lane_cv:
            self._lane.append((kind, fn, done))
            if self._lane_thread is None:
                self._lane_thread = threading.Thread(target=self._lane_worker, name="nvmeof-roce-lane",
                                                     daemon=True)
                self._lane_thread.start()
            self._lane_cv.notify()

    def _lane_worker(self) -> None:
        while True:
            with self._lane_cv:
                while not self._lane:
                    self._lane_cv.wait()
                kind, fn, done = self._lane.popleft()
                if kind is None:
                    return
                dones = [done]
                if kind == "flush":  # every flush waiting now arrived before this fdatasync starts
                    while self._lane and self._lane[0][0] == "flush":
                        dones.append(self._lane.popleft()[2])
            exc = _call(fn)
            for d in dones:
                self.channel.post(lambda d=d: self._lane_complete(d, exc))

    def _lane_complete(self, done: Done, exc: Optional[BaseException]) -> None:
        self.lane_in_flight -= 1
        try:
            done(exc)
        except Exception:
            log.exception("completion of a flush or long command failed")

    # -- figures and shutdown
    @property
    def busy(self) -> int:
        """Commands given to this engine and not yet completed (waiting ones included)."""
        return self.in_flight + len(self.waiting) + self.lane_in_flight

    def status(self) -> dict:
        return {"engine": self.name, "engine_reason": self.reason, "queue_depth": self.depth,
                "in_flight": self.in_flight, "waiting": len(self.waiting), "long_in_flight": self.lane_in_flight,
                "most_in_flight": self.most_in_flight, "threads": len(self._threads)}

    def close(self, timeout: float = 10.0) -> None:
        """Let the calls running finish, then stop the threads.  Completions still due arrive through the
        channel (Work.close runs what is left); waiting commands are answered by their queue's closing."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._jobs.put(None)
        if self._lane_thread is not None:
            with self._lane_cv:
                self._lane.append((None, None, None))
                self._lane_cv.notify()
        for t in self._threads + ([self._lane_thread] if self._lane_thread else []):
            t.join(timeout)
            if t.is_alive():
                log.warning("a device call is still running after %.0f s", timeout)
        self._threads = []
        self._lane_thread = None


def _call(fn: Callable[[], None]) -> Optional[BaseException]:
    try:
        fn()
    except Exception as exc:
        return exc
    return None
