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
Python binding has no update watch): a resize made outside reaches the engine through `check_size`.
"""
from __future__ import annotations

import collections
import errno
import logging
import os
import threading
import uuid
from typing import Callable, Deque, Optional, Tuple

from ...ceph.bindings import rados_and_rbd
from ...config import NamespaceConfig
from ...config.rbd import RbdSettings
from .base import Backend, BackendError, Op

log = logging.getLogger(__name__)

__all__ = ["RbdBackend", "RBD_OP_TIMEOUT", "EBLOCKLISTED"]

RBD_OP_TIMEOUT = 10  # seconds: an OSD or monitor operation that takes longer fails (ETIMEDOUT)
RBD_CONNECT_TIMEOUT = 10  # seconds to reach the monitors when the namespace opens
EBLOCKLISTED = errno.ESHUTDOWN  # what librados returns to a client the cluster has blocklisted (fenced)

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
    return BackendError(f"rbd {settings.spec()}: {what}: {exc}",
                        fixes.get(code, f"check {settings.conf} and the cluster (ceph -s)"), errno=code,
                        field="nvmeof_roce.rbd")


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
        self.block_size = block_size
        self.path = settings.spec()
        self.client = self.ioctx = None
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

    def _connect(self) -> None:
        rados, rbd = rados_and_rbd()
        conf = {"rbd_cache": "false", "rados_osd_op_timeout": str(RBD_OP_TIMEOUT),
                "rados_mon_op_timeout": str(RBD_OP_TIMEOUT), "client_mount_timeout": str(RBD_CONNECT_TIMEOUT)}
        if self.settings.keyring:
            conf["keyring"] = self.settings.keyring
        self.client = rados.Rados(conffile=self.settings.conf, rados_id=self.settings.client_id, conf=conf)
        self.client.connect(timeout=RBD_CONNECT_TIMEOUT)
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
        timeouts, by a thread (`native_opening`: librados waits for the cluster up to its mount timeout, never on
        the loop).  None until it has opened (the core serves the namespace meanwhile; the view takes the handle
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
                       ("client_mount_timeout", str(RBD_CONNECT_TIMEOUT))]
            if s.keyring:
                options.append(("keyring", s.keyring))
            args = (bindings.LIBRADOS, bindings.LIBRBD, s.conf, f"client.{s.client_id}", s.pool, s.namespace,
                    s.image, options, depth)

            def open_native():
                try:
                    self._native_result = native.module.RbdImage(*args)
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
        """Close the image (librbd waits for its aio calls) and the client; completions still queued run, so
        every command submitted is answered (or its queue has gone)."""
        # a stand-in image (no client: the unit tests') is the caller's to close
        image = self.image if self.client is not None else None
        for what, close in (("the image", image and image.close), ("the pool", self.ioctx and self.ioctx.close),
                            ("the client", self.client and self.client.shutdown)):
            if close:
                try:
                    close()
                except Exception as exc:
                    log.warning("%s: closing %s: %s", self.describe(), what, exc)
        self.image = self.ioctx = self.client = None
        if self._efd >= 0:
            self.reap()
            os.close(self._efd)
            self._efd = -1
