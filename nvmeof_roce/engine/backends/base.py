"""The backend contract: what the engine asks of every namespace backend (docs/architecture.md "The backend seam").

Offsets and lengths are in bytes and the caller (the target core) has already checked them against LBA ranges — a
backend still refuses an out-of-range access with `BackendError` instead of touching memory it does not own.

The contract, in the order of a namespace's life:

- **open**: `Backend.open(ns_config, lock=, inherit=)`, a classmethod; the registry entry (config/backends.py) names
  the class, `open_backend` (engine/backends/__init__.py) finds it there.  A backend that cannot open raises
  `BackendError` naming its config field.
- **geometry**: `block_size`, `num_blocks` (`size_bytes`), and the storage's identity: `identity()` (what makes two
  backends the same storage: a second namespace on it is refused) and `nguid()` (an NGUID the storage carries,
  used when the config gives none).
- **submit**: `read_into`, `write` (FUA: `dsync`), `flush`, `write_zeroes`, `discard` (and `zero_steps`, the same
  in slices).  How each completes is declared by the backend:
  - `blocking = False`: the call completes before it returns; the core makes it on the event loop (RAM, null).
  - `blocking = True`: the call waits for a device; an I/O engine (engine/ioengine.py) makes it off the loop and
    brings the completion back on the loop (file, block).
  - `asynchronous = True`: the backend completes later on its own (librbd's aio, #48): `submit(op, done)` starts
    an `Op` and returns; the backend makes `completion_fd()` readable when completions wait, and the engine's loop
    calls `reap()`, which calls each op's `done(exc)` on the loop.  The native data path's twin is the C entry's
    `reap` (csrc/backend.h): completions delivered to the queue's poll through an eventfd or a mailbox.
- **native**: `native` names the C entry (csrc/backend.c `nq_backends[]`) the native data path serves the
  namespace with, or None (the core serves it).  `addressable`: the device reads and writes the backend's memory
  in place (`pin()` gives it to register: RAM).  A staged backend (neither addressable nor null) gives the C queue
  a handle (`native_handle`): its reads and writes go through the queue's bounce chunks.
- **resize**: `prepare_resize(size)` for a resize the target makes; a size changed outside (a file grown, an RBD
  image resized) is the backend's **resize notice**: it calls `notice_resize(size)` (from any thread), which tells
  the listener the engine set with `watch_resize` (engine/api.py: on the loop, the namespace follows when the
  backend's `follow_size` says its size is its storage's, and the hosts are told).
- **close**: `close()`; every descriptor and mapping let go (a registration not yet released keeps its own).
"""
import logging
from typing import Callable, Iterator, NamedTuple, Optional

from ...errors import NvmeofError
from ...config import ConfigError, NamespaceConfig
from ...config.backends import kind_of

log = logging.getLogger(__name__)

__all__ = ["Backend", "BackendError", "Op", "check_new_size"]

_ZERO_CHUNK = 1 << 20


class BackendError(NvmeofError):
    """A namespace backend failed; the message names the path (or backend) and the fix.  `errno`: the
    device's error number when there is one (the NVMe status follows from it, engine/io.py).  `transient`: the
    storage is not reachable now (a Ceph cluster that does not answer): an open that fails so at start is
    tried again in the background (engine/pending.py) instead of failing the target."""

    transient = False

    def __init__(self, message: str, fix: str = "", errno: Optional[int] = None, field: Optional[str] = None):
        super().__init__(message, fix)
        self.errno = errno
        self.field = field  # the namespace's config key at fault, when it is not device.path

    def config_error(self, source: str, where: str, ns: NamespaceConfig) -> ConfigError:
        """A backend that cannot open is a bad config: blame its field, else the file's device.path, else the
        namespace."""
        kind = kind_of(ns.backend)
        field = f"{where}.{self.field}" if self.field else f"{where}.device.path" if kind and kind.path else where
        err = ConfigError(source, field, self.message, self.fix)
        err.transient = self.transient
        return err



class Op(NamedTuple):
    """One command for an asynchronous backend's `submit`: what ("read", "write", "flush", "write_zeroes",
    "discard"), where, its data (a writable buffer for a read, the bytes for a write), FUA."""
    what: str
    offset: int = 0
    length: int = 0
    data: object = None
    fua: bool = False


class Backend:
    """The contract the target core codes against (the module's docstring); a subclass is one registry entry."""

    kind = "?"  # its registry entry's name (config/backends.py)
    blocking = False  # True if calls may wait for a device (an I/O engine runs them off the event loop)
    asynchronous = False  # True if it completes later on its own: submit / completion_fd / reap
    native: Optional[str] = None  # the C entry the native data path serves it with (csrc/backend.c), or None
    addressable = False  # the device reads and writes its memory in place (pin)
    block_size: int
    num_blocks: int
    path: Optional[str] = None
    buffer: Optional[memoryview] = None  # the whole namespace in memory (ram): reads are served from it directly
    direct = False  # the file backend opened it with O_DIRECT
    io_fd = -1  # the descriptor an I/O engine that makes the calls itself (io_uring) uses; -1: none
    _resize_listener: Optional[Callable[["Backend", int], None]] = None

    # -- open
    @classmethod
    def open(cls, ns: NamespaceConfig, lock: Optional[str] = None, inherit: Optional["Backend"] = None) -> "Backend":
        """The backend a namespace config describes (`lock` "exclusive" or "shared": flock its storage for as long
        as it is open; `inherit`: the backend of the namespace this one replaces, which hands over its lock)."""
        return cls(ns.size_bytes, ns.block_size)

    # -- geometry
    def identity(self) -> Optional[tuple]:
        """What makes two backends the same storage (None: its own, never shared)."""
        return None

    def nguid(self) -> Optional[bytes]:
        """The 16-byte NGUID its storage carries (an image's id), used when the config sets none; None: none."""
        return None

    # -- completion of an asynchronous backend (asynchronous = True)
    def submit(self, op: Op, done: Callable[[Optional[BaseException]], None]) -> None:
        """Start `op`; `done(exc)` is called on the loop from `reap` once it completes.  A synchronous backend
        completes it here."""
        self.complete_inline(op, done)

    def complete_inline(self, op: Op, done: Callable[[Optional[BaseException]], None]) -> None:
        """`op` through the blocking calls, `done(exc)` before returning (a target without a loop)."""
        exc = None
        try:
            if op.what == "read":
                self.read_into(op.offset, op.data)
            elif op.what == "write":
                self.write(op.offset, op.data, dsync=op.fua)
            elif op.what == "flush":
                self.flush()
            elif op.what == "write_zeroes":
                self.write_zeroes(op.offset, op.length)
            elif op.what == "discard":
                self.discard(op.offset, op.length)
            else:
                raise ValueError(f"{self.describe()}: no such operation {op.what!r}")
        except BackendError as e:
            exc = e
        done(exc)

    def completion_fd(self) -> Optional[int]:
        """Readable while completions wait for `reap` (an eventfd); None for a backend that completes inline."""
        return None

    def reap(self) -> int:
        """Call `done` of every op that completed, on the loop; the number."""
        return 0

    # -- the native data path
    def native_handle(self, engine: Optional[str], depth: int):
        """A staged backend's handle for the C queue (a `_native.File` for the file entry, csrc/be_uring.c), or None when the core
        serves it (`engine`: the name of the namespace's I/O engine)."""
        return None

    # -- resize notice
    def watch_resize(self, listener: Optional[Callable[["Backend", int], None]]) -> None:
        """`listener(backend, size_bytes)` is called when the storage's size changes outside the target."""
        self._resize_listener = listener

    def notice_resize(self, size_bytes: int) -> None:
        """The storage now has `size_bytes` (seen by the backend: an update watch, a size check): the listener is
        told, on whatever thread saw it (the engine's listener brings it to the loop); the namespace keeps its
        size until the engine resizes it (follow_size, prepare_resize)."""
        if size_bytes != self.size_bytes and self._resize_listener is not None:
            self._resize_listener(self, size_bytes)

    def follow_size(self, size_bytes: int) -> Optional[Callable[[], None]]:
        """A backend whose size is its storage's (an RBD image) follows a resize made outside: `commit()`, as
        prepare_resize's, which takes `size_bytes` (in whole blocks) without changing the storage; None: the
        namespace keeps its size until resized (a file, whose size the config gives)."""
        return None

    def storage_size(self) -> Optional[int]:
        """The storage's size now, read from it (None: only the target sizes it).  `check_size` compares."""
        return None

    def check_size(self) -> Optional[int]:
        """Read the storage's size and give a resize notice when it changed; the size, or None."""
        size = self.storage_size()
        if size is not None:
            self.notice_resize(size)
        return size

    @property
    def size_bytes(self) -> int:
        return self.block_size * self.num_blocks

    def _check(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size_bytes:
            raise BackendError(f"{self.describe()}: access {offset}+{length} is outside 0..{self.size_bytes}",
                               "the caller must check LBA ranges against num_blocks")

    def describe(self) -> str:
        return f"{self.kind} namespace" + (f" {self.path}" if self.path else "")

    def read_into(self, offset: int, buf: memoryview) -> None:
        raise NotImplementedError

    def read(self, offset: int, length: int) -> bytes:
        out = bytearray(length)
        self.read_into(offset, memoryview(out))
        return bytes(out)

    def write(self, offset: int, data, dsync: bool = False) -> None:
        """Write `data`; with `dsync` durable before it returns (a FUA write)."""
        raise NotImplementedError

    def flush(self) -> None:
        pass

    def write_zeroes(self, offset: int, length: int) -> None:
        raise NotImplementedError

    def discard(self, offset: int, length: int) -> None:
        """Deallocate; reads of the range return zeros afterwards."""
        self.write_zeroes(offset, length)

    def zero_steps(self, offset: int, length: int, deallocate: bool, slice_bytes: int) -> Iterator[int]:
        """Zero (or deallocate) a range in slices of at most `slice_bytes`; yields each slice's size.

        The target runs one slice per event loop pass (engine/work.py)."""
        self._check(offset, length)
        end = offset + length
        while offset < end:
            n = min(slice_bytes, end - offset)
            if deallocate:
                self.discard(offset, n)
            else:
                self.write_zeroes(offset, n)
            offset += n
            yield n
    def prepare_resize(self, size_bytes: int):
        """Check a new size and get ready for it; returns `commit()`, which switches to it and cannot fail.

        A live resize (nvmeof-roce target resize-ns) prepares every change first and commits only when all
        are ready, so a refused change leaves the running target as it was."""
        raise BackendError(f"{self.describe()}: this backend cannot be resized",
                           "remove the namespace and add it again with the new size")

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<{type(self).__name__} {self.describe()} {self.num_blocks}x{self.block_size}>"


def check_new_size(kind: str, size_bytes: int, block_size: int) -> None:
    if size_bytes <= 0 or size_bytes % block_size:
        raise BackendError(f"{kind} namespace: size {size_bytes} is not a positive multiple of the block size "
                           f"{block_size}", f"give a multiple of {block_size} bytes")
