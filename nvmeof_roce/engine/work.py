"""Work that must not stall the target's event loop: device completions and long in-memory commands.

The target core is single threaded: while one handler runs, no other queue is
served and no keep-alive is seen.  Two kinds of work come back to the loop here:

- *completions from other threads*: the I/O engines (engine/ioengine.py) run a
  file or block namespace's reads, writes, flushes and long commands on their
  own threads and `post` each completion, which then runs on the loop;
- *long in-memory work* (deallocating or zeroing a large RAM range): it is cut
  into slices of at most `SLICE_BYTES`, one slice per job per loop pass, so
  other queues' capsules and completions are served between slices.

Both come back to the loop through one eventfd: the loop watches it
(`EventLoop.watch` on RDMA, `LoopbackFabric.watch` in tests) and calls
`Work.run_ready` when it is readable.  A pending slice keeps the eventfd
readable, so the loop neither sleeps nor spins on it while other work waits.

Without a loop (a Target used directly), everything runs inline at once.
"""
from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import deque
from typing import Callable, Deque, Iterator, Optional

log = logging.getLogger(__name__)

SLICE_BYTES = 16 << 20  # bytes one slice deallocates or zeroes in RAM (a few ms with madvise)

Done = Callable[[Optional[BaseException]], None]


class SlicedJob:
    """A generator of slices (each yields the bytes it covered) and what to call at the end."""

    __slots__ = ("steps", "done", "what", "slices", "bytes_done")

    def __init__(self, steps: Iterator[int], done: Done, what: str):
        self.steps = steps
        self.done = done
        self.what = what
        self.slices = 0
        self.bytes_done = 0


class Work:
    """The completions posted by other threads, the sliced jobs, and the eventfd that brings both back to the
    loop."""

    def __init__(self):
        self.fd = -1
        self.attached = False
        self._loop = None
        self._lock = threading.Lock()
        self._posted: Deque[Callable[[], None]] = deque()
        self._sliced: Deque[SlicedJob] = deque()
        self.engines: "weakref.WeakSet" = weakref.WeakSet()  # the I/O engines posting here (closed first)
        # figures for status lines and tests
        self.slices_run = 0
        self.largest_slice = 0
        self.posted = 0

    # -- wiring
    def attach(self, loop) -> None:
        """Give the work an event loop: one with `watch(fd, callback)` and `unwatch(fd)`."""
        if self.attached:
            return
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        loop.watch(self.fd, self.run_ready)
        self._loop = loop
        self.attached = True

    def watch(self, fd: int, callback: Callable[[], None]) -> None:
        """Have the loop call callback() when `fd` is readable (an engine's own completion fd: io_uring's)."""
        self._loop.watch(fd, callback)

    def unwatch(self, fd: int) -> None:
        if self._loop is not None:
            self._loop.unwatch(fd)

    def close(self, timeout: float = 10.0) -> None:
        """Run the completions already posted and the slices left (no loop pass will come), close the eventfd.

        The engines are closed first (Target.close): their threads have finished, or `timeout` seconds passed
        each, and every completion they posted runs here, so a removed namespace still closes its backend after
        its last command (Namespace.retire); a call still running keeps its namespace's job count up, and
        Target.close leaves that file open under it."""
        for engine in list(self.engines):
            engine.close(timeout)
        self._run_posted()
        while self._sliced:  # no loop pass will come: the rest inline
            job = self._sliced.popleft()
            while self._step(job):
                pass
        if self.fd >= 0:
            self._loop.unwatch(self.fd)
            os.close(self.fd)
            self.fd = -1
        self.attached = False

    @property
    def pending(self) -> int:
        """Sliced jobs not yet completed plus completions posted and not yet run."""
        return len(self._sliced) + len(self._posted)

    # -- completions from other threads
    def post(self, callback: Callable[[], None]) -> None:
        """Run callback() on the loop (thread-safe: called from an engine's threads)."""
        with self._lock:
            wake = not self._posted
            self._posted.append(callback)
            self.posted += 1
        if wake:  # the loop drains all of them at once: one wake-up per batch
            self._signal()

    def _run_posted(self) -> None:
        with self._lock:
            posted, self._posted = self._posted, deque()
        for callback in posted:
            try:
                callback()
            except Exception:
                log.exception("a posted completion failed")

    # -- sliced jobs
    def sliced(self, steps: Iterator[int], done: Done, what: str) -> SlicedJob:
        """Work off `steps` one slice per loop pass; done(None) or done(exception) after the last."""
        job = SlicedJob(steps, done, what)
        if not self.attached:
            while self._step(job):
                pass
            return job
        self._sliced.append(job)
        self._signal()
        return job

    def _step(self, job: SlicedJob) -> bool:
        """One slice; False once the job has completed (done was called)."""
        try:
            n = next(job.steps)
        except StopIteration:
            _complete(job.done, None)
            return False
        except Exception as exc:
            _complete(job.done, exc)
            return False
        job.slices += 1
        job.bytes_done += n
        self.slices_run += 1
        self.largest_slice = max(self.largest_slice, n)
        return True

    # -- back on the loop
    def _signal(self) -> None:
        if self.fd >= 0:
            try:
                os.eventfd_write(self.fd, 1)
            except OSError:  # closed during shutdown
                pass

    def run_ready(self) -> None:
        """Called by the loop when the eventfd is readable: posted completions, then one slice per job."""
        try:
            os.eventfd_read(self.fd)
        except (BlockingIOError, OSError):
            pass
        self._run_posted()
        for _ in range(len(self._sliced)):
            job = self._sliced.popleft()
            if self._step(job):
                self._sliced.append(job)
        if self._sliced:
            self._signal()  # more slices: the next loop pass comes back here after serving the queues


def _complete(done: Done, exc: Optional[BaseException]) -> None:
    try:
        done(exc)
    except Exception:
        log.exception("completion of a background call failed")
