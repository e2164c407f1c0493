"""A slow device on demand, for the I/O engines' tests (engine/ioengine.py): the commands of a namespace are
held until the test releases them, so a test asserts which commands are with the device, which wait and which
completed meanwhile, never a timing.

- HeldDevice (the thread engine): the backend's call waits on an event, on the engine's thread.
- HeldRing (the io_uring engine): each held command sits in the kernel, on the ring, as a one-byte read of a
  pipe; `release.set()` writes to the pipe and the real call is made as its completion is reaped.
"""
import os
import threading


class HeldDevice:
    """Patches a backend call so each one waits until released; counts the calls running at once."""

    def __init__(self, backend, name):
        self.real = getattr(backend, name)
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0
        self.started = []  # the first argument (an offset) of each call, in the order they reached the device
        self.arrived = threading.Condition(self.lock)
        setattr(backend, name, self._call)

    def _call(self, *args, **kwargs):
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
            self.started.append(args[0] if args else None)
            self.arrived.notify_all()
        self.release.wait(20)
        try:
            return self.real(*args, **kwargs)
        finally:
            with self.lock:
                self.running -= 1

    def wait_running(self, n, timeout=20.0):
        with self.lock:
            assert self.arrived.wait_for(lambda: self.running >= n, timeout), f"{self.running} of {n} calls arrived"


class _Held:
    """A command the test holds on the ring: what to do once released, and the engine's own cookie."""

    __slots__ = ("kind", "fd", "buf", "offset", "fua", "cookie", "byte")

    def __init__(self, kind, fd, buf, offset, fua, cookie):
        self.kind, self.fd, self.buf, self.offset, self.fua, self.cookie = kind, fd, buf, offset, fua, cookie
        self.byte = bytearray(1)

    def perform(self):
        """The real call, as the kernel would have made it: bytes moved, or -errno."""
        try:
            if self.kind == "read":
                return os.preadv(self.fd, [self.buf], self.offset)
            if self.kind == "write":
                return os.pwritev(self.fd, [self.buf], self.offset, os.RWF_DSYNC if self.fua else 0)
            os.fdatasync(self.fd)
            return 0
        except OSError as exc:
            return -exc.errno


class _Release:
    def __init__(self, fd):
        self.fd = fd

    def set(self):
        os.write(self.fd, b"x" * 4096)  # one byte frees each held command, now and later


class HeldRing:
    """The io_uring engine's ring, with one kind of command held in the kernel until the test releases it:
    each is queued on the real ring as a one-byte read of a pipe, completes when `release.set()` writes to
    it, and is then made for real (or completes with -`fail`).  The same figures as HeldDevice."""

    KINDS = {"read_into": "read", "write": "write", "flush": "fsync"}

    def __init__(self, engine, name, fail=None):
        self.fail = fail  # an errno: the held commands complete with it instead of being made
        self.real = engine.ring
        engine.ring = self
        self.kind = self.KINDS[name]
        self.r, self.w = os.pipe2(os.O_CLOEXEC)
        self.release = _Release(self.w)
        self.running = 0
        self.most = 0
        self.started = []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def _queue(self, kind, fd, buf, offset, cookie, fua=False):
        if kind != self.kind:
            return getattr(self.real, kind)(*((fd, cookie) if kind == "fsync" else (fd, buf, offset, cookie, fua)
                                              if kind == "write" else (fd, buf, offset, cookie)))
        held = _Held(kind, fd, buf, offset, fua, cookie)
        self.real.read(self.r, held.byte, 0, held)
        self.running += 1
        self.most = max(self.most, self.running)
        self.started.append(offset)

    def read(self, fd, buf, offset, cookie):
        self._queue("read", fd, buf, offset, cookie)

    def write(self, fd, buf, offset, cookie, fua=False):
        self._queue("write", fd, buf, offset, cookie, fua)

    def fsync(self, fd, cookie):
        self._queue("fsync", fd, None, None, cookie)

    def reap(self):
        out = []
        for cookie, res in self.real.reap():
            if isinstance(cookie, _Held):
                self.running -= 1
                cookie, res = cookie.cookie, -self.fail if self.fail else cookie.perform()
            out.append((cookie, res))
        return out

    def wait_running(self, n, timeout=20.0):
        assert self.running >= n, f"{self.running} of {n} commands reached the ring"


def hold(target, nqn, nsid, name):
    """Hold a namespace's backend call `name` (read_into, write, flush) on whichever engine serves it."""
    ns = target.subsystem(nqn).namespaces[nsid]
    engine = ns.engine(target.work)
    if engine.name == "io_uring":
        return HeldRing(engine, name)
    return HeldDevice(ns.backend, name)
