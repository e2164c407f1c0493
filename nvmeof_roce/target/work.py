"""Work that must not stall the target's event loop: blocking calls and long commands.

The target core is single threaded: while one handler runs, no other queue is
served and no keep-alive is seen.  Two kinds of work would hold the loop too long:

- *blocking backend calls* (`fdatasync` for Flush, FUA and CC.SHN; zeroing or
  punching a file): they run on one worker thread, and their completion comes
  back to the loop;
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
import queue
import threading
from collections import deque
from typing import Callable, Deque, Iterator, Optional, Tuple

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
    """The worker thread, the sliced jobs, and the eventfd that brings both back to the loop."""

    def __init__(self):
        self.fd = -1
        self.attached = False
        self._loop = None
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._finished: Deque[Tuple[Done, Optional[BaseException]]] = deque()
        self._sliced: Deque[SlicedJob] = deque()
        self.blocking_running = 0  # submitted to the thread and not yet completed on the loop
        # figures for status lines and tests
        self.slices_run = 0
        self.largest_slice = 0
        self.blocking_calls = 0

    # -- wiring
    def attach(self, loop) -> None:
        """Give the work an event loop: one with `watch(fd, callback)` and `unwatch(fd)`."""
        if self.attached:
            return
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        loop.watch(self.fd, self.run_ready)
        self._loop = loop
        self.attached = True

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread (after the calls already submitted), complete what is left, close the eventfd.

        Every job gets its completion, even at shutdown: a removed namespace closes its backend only after
        its last job completed (Namespace.retire)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("a blocking backend call is still running after %.0f s", timeout)
            self._thread = None
        with self._lock:
            finished, self._finished = self._finished, deque()
        for done, exc in finished:
            self.blocking_running -= 1
            _complete(done, exc)
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
        """Jobs not yet completed (sliced ones plus blocking calls)."""
        return len(self._sliced) + self.blocking_running

    # -- blocking calls
    def call(self, fn: Callable[[], None], done: Done) -> None:
        """Run fn() off the loop; done(None) or done(exception) later, on the loop."""
        self.blocking_calls += 1
        if not self.attached:
            done(_run(fn))
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._worker, name="nvmeof-roce-backend", daemon=True)
            self._thread.start()
        self.blocking_running += 1
        self._jobs.put((fn, done))

    def _worker(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, done = job
            exc = _run(fn)
            with self._lock:
                self._finished.append((done, exc))
            self._signal()

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
        """Called by the loop when the eventfd is readable: finished calls, then one slice per job."""
        try:
            os.eventfd_read(self.fd)
        except (BlockingIOError, OSError):
            pass
        with self._lock:
            finished, self._finished = self._finished, deque()
        for done, exc in finished:
            self.blocking_running -= 1
            _complete(done, exc)
        for _ in range(len(self._sliced)):
            job = self._sliced.popleft()
            if self._step(job):
                self._sliced.append(job)
        if self._sliced:
            self._signal()  # more slices: the next loop pass comes back here after serving the queues


def _run(fn: Callable[[], None]) -> Optional[BaseException]:
    try:
        fn()
    except Exception as exc:
        return exc
    return None


def _complete(done: Done, exc: Optional[BaseException]) -> None:
    try:
        done(exc)
    except Exception:
        log.exception("completion of a background call failed")
