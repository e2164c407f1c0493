"""Namespaces on Ceph RBD images, the reference (Python) path: librbd through Debian's python3-rbd.

`RbdBackend` opens the image with the settings of config/rbd.py (one RADOS client per namespace) and gives the
target its geometry: the size is the image's, the NGUID is derived from the cluster's fsid, the pool's id, the
RADOS namespace and the image's id, so every gateway that serves the image reports the same one.

It is an asynchronous backend (engine/backends/base.py): `submit` starts librbd's aio call and returns; librbd's
completion thread records the outcome and writes the backend's eventfd (`completion_fd`), which the event loop
watches; `reap`, on the loop, runs each command's completion (engine/ioengine.py AsyncEngine).  No thread of
ours, no wait on the loop.  The blocking calls (`read_into`, `write`, ...) serve a Target used without a loop.

Durability: the client runs with librbd's cache off (`rbd_cache = false`), so a write librbd completes is on the
OSDs: FUA holds for every write, and Flush is `aio_flush` (for a cache a conf may turn on).  Write Zeroes and
Deallocate are `aio_write_zeroes` and `aio_discard`.

Bounds: `rados_osd_op_timeout` and `rados_mon_op_timeout` (RBD_OP_TIMEOUT, under the Linux host's 30 s
io_timeout) make an operation on a cluster that went away fail with ETIMEDOUT instead of hanging; a client the
cluster has blocklisted gets ESHUTDOWN.  engine/io.py answers both with a path-related status (ANA Transition,
ANA Inaccessible: no DNR) so the host's multipath can act.  The image's size is read by `storage_size` (the
Python binding of Ceph 16 has no `update_watch`): a resize made outside is seen by a RADOS watch on the image's
header object (`rbd_header.<id>`, which librbd notifies on every header change); the watch's callback only wakes
the namespace's watcher thread, which reads the size from the header (the `rbd.get_size` class method: the OSD's
answer, not librbd's cached one) and gives the resize notice (`notice_resize`); the engine brings it to the loop.

One RADOS client per cluster (ceph/clients.py), shared by its namespaces.  Closing waits for the cluster (librbd
finishes its aio calls, releases its lock, unwatches): it runs on a thread of its own, never on the loop.
"""
from __future__ import annotations

import collections
import errno
import logging
import os
import struct
import threading
import time
import uuid
from typing import Callable, Deque, Optional, Tuple

from ...ceph import clients
from ...ceph.bindings import rados_and_rbd
from ...config import NamespaceConfig
from ...config.rbd import NATIVE_RBD_OPTIONS, RbdSettings
from .base import Backend, BackendError, Op

log = logging.getLogger(__name__)

__all__ = ["RbdBackend", "RBD_OP_TIMEOUT", "EBLOCKLISTED", "wait_closed"]

RBD_OP_TIMEOUT = 10  # seconds: an OSD or monitor operation that takes longer fails (ETIMEDOUT)
RBD_CONNECT_TIMEOUT = 10  # seconds to reach the monitors when the namespace opens
EBLOCKLISTED = errno.ESHUTDOWN  # what librados returns to a client the cluster has blocklisted (fenced)
# errors of a cluster that is not there (yet): an open that fails so is tried again (engine/pending.py)
UNREACHABLE = {errno.ETIMEDOUT, errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENOTCONN}
CEPH_NOSNAP = (1 << 64) - 2  # the image's head, for the rbd class methods

Done = Callable[[Optional[BaseException]], None]


def rbd_error(settings: RbdSettings, what: str, exc: BaseException) -> BackendError:
    """`exc` (a rados/rbd error or an OSError) as a BackendError with its errno and the fix."""
    code = getattr(exc, "errno", None)
    code = abs(code) if isinstance(code, int) else None
    fixes = {
        errno.ENOENT: f"create it (rbd create --size 1G {settings.spec()}), or add \"create\": {{\"size\": \"1G\"}} "
                      "to the namespace's rbd settings",
        errno.ETIMEDOUT: f"the cluster of {settings.conf} did not answer: check it is up and reachable (ceph -s)",
        EBLOCKLISTED: "the cluster has blocklisted this client (fenced): the namespace must be opened again",
        errno.EACCES: f"check client.{settings.client_id}'s caps and keyring",
        errno.EPERM: f"check client.{settings.client_id}'s caps and keyring",
    }
    err = BackendError(f"rbd {settings.spec()}: {what}: {exc}",
                       fixes.get(code, f"check {settings.conf} and the cluster (ceph -s)"), errno=code,
                       field="nvmeof_roce.rbd")
    err.transient = code in UNREACHABLE
    return err


class RbdBackend(Backend):
    """An RBD image as a namespace (the module's docstring)."""

    kind = "rbd"
    blocking = True
    asynchronous = True
    native = "rbd"  # the C entry (csrc/be_rbd.c): librbd's C API through the native queue's bounce chunks
    native_opening: Optional[threading.Thread] = None  # opens the native handle off the loop (native_handle)
    _native_result = None  # what that thread made: the _native.RbdImage until handed over, or the OSError

    @classmethod
    def open(cls, ns: NamespaceConfig, lock: Optional[str] = None, inherit: Optional[Backend] = None) -> "RbdBackend":
        return cls(ns.backend_settings, ns.block_size)

    def __init__(self, settings: RbdSettings, block_size: int = 512, image=None):
        """`image`: an object with librbd's Image calls to use instead of opening one (the unit tests')."""
        self.settings = settings
        if not settings.native:  # "native": false (docs/rbd.md "The native path"): the core serves it
            self.native = None
        self.block_size = block_size
        self.path = settings.spec()
        self.client = self.ioctx = None
        self._shared: Optional[clients.ClusterClient] = None
        self._watch = None  # the RADOS watch on the image's header
        self._watch_ioctx = None
        self._watcher: Optional[threading.Thread] = None
        self._wake = threading.Event()
        self._stopping = False
        self._rewatch = False
        self._done: Deque[Tuple[Done, Optional[BaseException]]] = collections.deque()
        self._lock = threading.Lock()
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.in_flight = 0  # submitted to librbd, not yet reaped
        self._nguid: Optional[bytes] = None
        if image is not None:
            self.image = image
        else:
            self.image = None
            try:
                self._connect()
            except BackendError:
                self.close()
                raise
            except Exception as exc:  # rados.Error, rbd.Error: what the cluster said
                self.close()
                raise rbd_error(settings, "cannot open", exc) from None
        size = self.image.size()
        if size % block_size:
            self.close()
            raise BackendError(f"rbd {settings.spec()}: its size {size} is not a multiple of the block size "
                               f"{block_size}", f"resize it to whole blocks (rbd resize --size {size - size % block_size}B "
                               f"{settings.spec()}), or use block_size 512", field="nvmeof_roce.block_size")
        self.num_blocks = size // block_size
        if self.ioctx is not None:
            self._start_watch()

    def _connect(self) -> None:
        _, rbd = rados_and_rbd()
        conf = {"rbd_cache": "false", "rados_osd_op_timeout": str(RBD_OP_TIMEOUT),
                "rados_mon_op_timeout": str(RBD_OP_TIMEOUT), "client_mount_timeout": str(RBD_CONNECT_TIMEOUT)}
        self._shared = clients.acquire(self.cluster_key(), conf, RBD_CONNECT_TIMEOUT)
        self.client = self._shared.rados
        self.ioctx = self.client.open_ioctx(self.settings.pool)
        if self.settings.namespace:
            self.ioctx.set_namespace(self.settings.namespace)
        try:
            self.image = rbd.Image(self.ioctx, self.settings.image)
        except rbd.ImageNotFound:
            size = self.settings.create_size
            if size is None:
                raise
            if size % self.block_size:
                raise BackendError(f"rbd {self.settings.spec()}: create.size {size} is not a multiple of the block "
                                   f"size {self.block_size}", "give a size in whole blocks",
                                   field="nvmeof_roce.rbd.create.size")
            try:
                rbd.RBD().create(self.ioctx, self.settings.image, size)
                log.info("rbd %s: created (%d bytes)", self.settings.spec(), size)
            except rbd.ImageExists:
                pass  # another gateway made it just now
            self.image = rbd.Image(self.ioctx, self.settings.image)
        fsid = self.client.get_fsid()
        name = f"{fsid}/{self.ioctx.get_pool_id()}/{self.settings.namespace}/{self.image.id()}"
        self._nguid = uuid.uuid5(uuid.NAMESPACE_URL, f"rbd:{name}").bytes

    def cluster_key(self) -> clients.Key:
        """What one shared RADOS client serves: the conf, the client's id, its keyring."""
        return (self.settings.conf, self.settings.client_id, self.settings.keyring)

    # -- the header watch: a resize made outside
    def _start_watch(self) -> None:
        self._header = f"rbd_header.{self.image.id()}"
        self._watch_ioctx = self.ioctx  # the watcher's own reference: the pool closes after it stopped
        try:
            self._watch = self.ioctx.watch(self._header, self._on_notify, self._on_watch_error)
        except Exception as exc:  # the namespace serves; only an outside resize goes unseen until the next one
            log.warning("%s: cannot watch %s (a resize made outside will not be seen): %s", self.describe(),
                        self._header, exc)
            self._rewatch = True
        self._watcher = threading.Thread(target=self._watch_loop, name=f"rbd watch {self.path}"[:60], daemon=True)
        self._watcher.start()

    def _on_notify(self, notify_id, notifier_id, watch_id, data) -> None:
        """librados' thread: wake the watcher (never a cluster call here: librbd's own watch waits behind us)."""
        self._wake.set()

    def _on_watch_error(self, _watch_id, code) -> None:
        """The watch was lost (the cluster went away, a blocklist): the watcher registers it again."""
        log.warning("%s: the watch on %s was lost (%s): watching again", self.describe(), self._header, code)
        self._rewatch = True
        self._wake.set()

    def _watch_loop(self) -> None:
        delay = 1.0
        while True:
            self._wake.wait(delay if self._rewatch else None)
            self._wake.clear()
            if self._stopping:
                return
            if self._rewatch:
                try:
                    if self._watch is not None:
                        self._watch.close()
                except Exception:
                    clients.keep_unclosable(self._watch)
                try:
                    self._watch = self._watch_ioctx.watch(self._header, self._on_notify, self._on_watch_error)
                    self._rewatch, delay = False, 1.0
                except Exception as exc:
                    self._watch, delay = None, min(delay * 2, 30.0)
                    log.debug("%s: watching %s again: %s", self.describe(), self._header, exc)
                    continue
            size = self._settled_size()
            if size is not None:
                self.notice_resize(size)  # a resize missed while the watch was lost is seen here too

    def _settled_size(self) -> Optional[int]:
        """The image's size once librbd's own view agrees with its header's (on the watcher thread).  librbd's
        watch refreshes it on the same notification, maybe after ours, and librbd refuses I/O past the end it
        knows; the header is read again each time (a notification may come before the change it announces: a
        lock request).  None when the namespace closes meanwhile or they do not agree within RBD_OP_TIMEOUT."""
        deadline = time.monotonic() + RBD_OP_TIMEOUT
        while not self._stopping:
            image, header = self.image, self.header_size()
            if image is None or header is None:
                return None
            try:
                seen = image.size()
            except Exception as exc:
                log.warning("%s: reading librbd's size: %s", self.describe(), exc)
                return None
            if seen == header:
                return header
            if time.monotonic() > deadline:
                log.warning("%s: the header says %d bytes, librbd still %d after %d s: the resize is not followed",
                            self.describe(), header, seen, RBD_OP_TIMEOUT)
                return None
            time.sleep(0.05)
        return None

    def header_size(self) -> Optional[int]:
        """The image's size as its header says (the OSD's answer), or None when the cluster did not give it."""
        try:
            ret, out = self._watch_ioctx.execute(self._header, "rbd", "get_size", struct.pack("<Q", CEPH_NOSNAP), 16)
            if ret >= 9:
                return struct.unpack("<BQ", bytes(out[:9]))[1]
        except Exception as exc:
            log.warning("%s: reading its size from %s: %s", self.describe(), self._header, exc)
        return None

    def follow_size(self, size_bytes: int):
        """The namespace takes the image's new size `size_bytes` (resized outside), in whole blocks, without
        resizing the image: `commit()`, as prepare_resize's."""
        blocks = size_bytes // self.block_size

        def commit():
            self.num_blocks = blocks
        return commit

    # -- geometry
    def identity(self) -> Optional[tuple]:
        return ("rbd", self.settings.conf, self.settings.pool, self.settings.namespace, self.settings.image)

    def nguid(self) -> Optional[bytes]:
        return self._nguid

    def describe(self) -> str:
        return f"rbd namespace {self.settings.spec()}"

    def storage_size(self) -> Optional[int]:
        return self._call("size", self.image.size)

    # -- asynchronous completion
    def completion_fd(self) -> Optional[int]:
        return self._efd

    def submit(self, op: Op, done: Done) -> None:
        image = self.image
        if image is None:
            done(BackendError(f"{self.describe()}: closed", "the namespace is being removed", errno=errno.ESHUTDOWN))
            return
        with self._lock:
            self.in_flight += 1
        try:
            if op.what == "read":
                buf = op.data

                def read_done(completion, data, buf=buf, op=op):
                    code = completion.get_return_value()
                    exc = None
                    if code < 0:
                        exc = self._failed("read", code)
                    elif data is None or len(data) != op.length:
                        exc = BackendError(f"{self.describe()}: read {op.offset}+{op.length} returned "
                                           f"{0 if data is None else len(data)} bytes", "check the image (rbd info)",
                                           errno=errno.EIO)
                    else:
                        buf[:op.length] = data
                    self._completed(done, exc)
                image.aio_read(op.offset, op.length, read_done)
            elif op.what == "write":
                image.aio_write(bytes(op.data), op.offset, self._on_complete("write", done))
            elif op.what == "flush":
                image.aio_flush(self._on_complete("flush", done))
            elif op.what == "write_zeroes":
                image.aio_write_zeroes(op.offset, op.length, self._on_complete("write zeroes", done))
            elif op.what == "discard":
                image.aio_discard(op.offset, op.length, self._on_complete("discard", done))
            else:
                raise ValueError(f"{self.describe()}: no such operation {op.what!r}")
        except Exception as exc:  # refused before it started: completes like any other, on the loop
            self._completed(done, rbd_error(self.settings, f"submit {op.what}", exc))

    def _failed(self, what: str, code: int) -> BackendError:
        if -code == EBLOCKLISTED and self._shared is not None:
            self._shared.broken = True  # the next namespace opened on this cluster connects a new client
        return rbd_error(self.settings, what, OSError(-code, os.strerror(-code)))

    def _on_complete(self, what: str, done: Done):
        def completion(c):
            code = c.get_return_value()
            self._completed(done, self._failed(what, code) if code < 0 else None)
        return completion

    def _completed(self, done: Done, exc: Optional[BaseException]) -> None:
        """On librbd's completion thread (or the submitter's): queue the completion, wake the loop."""
        with self._lock:
            self._done.append((done, exc))
        try:
            os.eventfd_write(self._efd, 1)
        except OSError:
            pass  # closed: the namespace has gone

    def reap(self) -> int:
        """On the loop: every queued completion."""
        try:
            os.eventfd_read(self._efd)
        except (BlockingIOError, OSError):
            pass
        with self._lock:
            ready, self._done = self._done, collections.deque()
            self.in_flight -= len(ready)
        for done, exc in ready:
            try:
                done(exc)
            except Exception:
                log.exception("%s: a completion failed", self.describe())
        return len(ready)

    # -- the native data path (docs/rbd.md "The native path")
    def native_handle(self, engine, depth):
        """The C queue's `_native.RbdImage` (csrc/nq_rbd.c): a RADOS client and image of its own, opened in C
        through the dlopen'd librbd (ceph/bindings.py LIBRADOS, LIBRBD) with this client's settings, cache off and
        timeouts (and config/rbd.py NATIVE_RBD_OPTIONS), by a thread (`native_opening`: librados waits for the
        cluster up to its mount timeout, never on the loop).  None until it has opened (the core serves the namespace meanwhile; the view takes the handle
        at a later refresh), when it did not (said once, not tried again), or with no native module or once
        closed.  Handed over once: the namespace holds it (Namespace.native_file)."""
        from ... import native
        from ...ceph import bindings
        if native.module is None or self.image is None:
            return None
        if self.native_opening is None:
            s = self.settings
            options = [("rbd_cache", "false"), ("rados_osd_op_timeout", str(RBD_OP_TIMEOUT)),
                       ("rados_mon_op_timeout", str(RBD_OP_TIMEOUT)),
                       ("client_mount_timeout", str(RBD_CONNECT_TIMEOUT)), *NATIVE_RBD_OPTIONS]
            if s.keyring:
                options.append(("keyring", s.keyring))
            args = (bindings.LIBRADOS, bindings.LIBRBD, s.conf, f"client.{s.client_id}", s.pool, s.namespace,
                    s.image, options, depth)

            def open_native():
                try:
                    handle = native.module.RbdImage(*args)
                    try:
                        clients.announce(handle.addrs() or "")  # a gateway group fences this client too
                    except Exception as exc:
                        raise OSError(errno.EPERM, f"its RADOS client could not be announced: {exc}") from None
                    self._native_result = handle
                except OSError as exc:
                    self._native_result = exc
                    log.warning("%s: the native data path cannot open it (%s): the core serves it",
                                self.describe(), exc)
            self.native_opening = threading.Thread(target=open_native, name=f"rbd-native-open {s.spec()}",
                                                   daemon=True)
            self.native_opening.start()
        handle = self._native_result
        if handle is None or handle is False or isinstance(handle, BaseException):
            return None
        self._native_result = False  # handed over (not None: the thread ran)
        return handle

    # -- the blocking calls (a Target without a loop)
    def _call(self, what: str, fn: Callable, *args):
        try:
            return fn(*args)
        except BackendError:
            raise
        except Exception as exc:
            raise rbd_error(self.settings, what, exc) from None

    def read_into(self, offset, buf):
        self._check(offset, len(buf))
        data = self._call("read", self.image.read, offset, len(buf))
        if len(data) != len(buf):
            raise BackendError(f"{self.describe()}: read {offset}+{len(buf)} returned {len(data)} bytes",
                               "check the image (rbd info)", errno=errno.EIO)
        buf[:] = data

    def write(self, offset, data, dsync=False):
        self._check(offset, len(data))
        self._call("write", self.image.write, bytes(data), offset)  # the cache is off: durable once it returns

    def flush(self):
        self._call("flush", self.image.flush)

    def write_zeroes(self, offset, length):
        self._check(offset, length)
        self._call("write zeroes", self.image.write_zeroes, offset, length)

    def discard(self, offset, length):
        self._check(offset, length)
        self._call("discard", self.image.discard, offset, length)

    def prepare_resize(self, size_bytes):
        if size_bytes <= 0 or size_bytes % self.block_size:
            raise BackendError(f"{self.describe()}: {size_bytes} bytes is not a positive number of "
                               f"{self.block_size}-byte blocks", "give the size in whole blocks")

        def commit():
            if self.image.size() != size_bytes:  # a resize seen from outside is already the image's size
                self.image.resize(size_bytes)
            self.num_blocks = size_bytes // self.block_size
        return commit

    def close(self):
        """Close the image, its pool and its hold on the cluster's client on a thread of their own (librbd waits
        for its aio calls and the cluster: up to RBD_OP_TIMEOUT on one that went away), never on the loop.
        Completions already queued run now, on the caller's thread (the loop's); a command still with librbd
        belongs to a queue that has gone (a namespace is closed once drained, or with its controllers ended):
        its completion is counted and dropped once the image closed."""
        self._stopping = True
        self._wake.set()
        if self._efd >= 0:
            self.reap()
        efd, self._efd = self._efd, -1  # a completion from now on queues without waking anyone
        if self.client is None:  # a stand-in image (the unit tests'): the caller's to close
            self.image = None
            if efd >= 0:
                os.close(efd)
            return
        watcher, image, ioctx, shared = self._watcher, self.image, self.ioctx, self._shared
        self._watcher = self.image = self.ioctx = self.client = self._shared = None

        def stop_watching():
            # the watcher first (it may be reading the size, or registering the watch again: never under a
            # closing image), then the watch it leaves, closed once: a watch whose close failed is never freed
            # (clients.keep_unclosable: its dealloc would close it again)
            if watcher is not None:
                watcher.join()
            held = [self._watch] if self._watch is not None else []
            self._watch = None
            if held:
                watch = held.pop()
                try:
                    watch.close()
                except Exception:
                    clients.keep_unclosable(watch)  # freeing it would close it again: a double free in librados
                    raise
        steps = [("the header watch", stop_watching), ("the image", image and image.close),
                 ("the pool", ioctx and ioctx.close), ("the client", shared and (lambda: clients.release(shared)))]

        def finished():
            with self._lock:
                late, self._done = self._done, collections.deque()
            if late:
                log.info("%s: %d command(s) completed after the namespace closed (their queues had gone)",
                         self.describe(), len(late))
            if efd >= 0:
                os.close(efd)
        clients.close_off_loop(self.describe(), [(n, c) for n, c in steps if c], finished)


def wait_closed(timeout: float) -> bool:
    """Wait up to `timeout` seconds for the rbd namespaces closing on their threads (the service's stop); True
    when none is left."""
    return clients.wait_closed(timeout)
