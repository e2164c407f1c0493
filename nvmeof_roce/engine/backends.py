"""Namespace backends for the userspace target: RAM, file/block device, null.

Every backend has the same interface (`Backend`); offsets and lengths are in bytes and the
caller (the target core) has already checked them against LBA ranges — a backend still refuses
an out-of-range access with `BackendError` instead of touching memory it does not own.

- RAM: one anonymous mmap (page aligned, so the target can register it as one memory region);
  `.buffer` is a writable memoryview of all of it, for zero-copy reads.
- file: a regular file or a block device.  O_DIRECT for a block device (as nvmet, whose block
  namespaces bypass the page cache), buffered for a file, unless the namespace's `buffered_io`
  says otherwise (0: O_DIRECT, refused with a clear error where the filesystem has none, e.g.
  tmpfs; 1: buffered).  A block device's logical block size is the namespace's unless the config
  sets one.  Reads go into the caller's memoryview with os.preadv (the I/O engine passes page-
  aligned buffers, engine/ioengine.py); an access O_DIRECT refuses (unaligned buffer or offset)
  falls back to a second, buffered descriptor.  A read or write that ends short is an error
  (never zeros with success); flush = fdatasync; Write Zeroes and deallocate are BLKZEROOUT and
  BLKDISCARD on a block device, fallocate(ZERO_RANGE / PUNCH_HOLE) on a file.  These calls wait
  for the device: the target never makes them on its event loop (`blocking`).
- null: reads zeros, writes are discarded.
"""
import ctypes
import ctypes.util
import errno
import fcntl
import ctypes
import logging
import mmap
import os
import stat
import struct
from typing import Iterator, Optional

from ..errors import NvmeofError
from ..config import ConfigError, NamespaceConfig
from ..config.devices import create_file_command, empty_block_device, in_system_tree, missing_device

log = logging.getLogger(__name__)

__all__ = ["Backend", "BackendError", "RamBackend", "FileBackend", "NullBackend", "open_backend"]

# linux/fs.h
BLKGETSIZE64 = 0x80081272
BLKSSZGET = 0x1268
BLKDISCARD = 0x1277
BLKZEROOUT = 0x127F
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10

_ZERO_CHUNK = 1 << 20
PAGE_SIZE = mmap.PAGESIZE


class BackendError(NvmeofError):
    """A namespace backend failed; the message names the path (or backend) and the fix.  `errno`: the
    device's error number when there is one (the NVMe status follows from it, engine/io.py)."""

    def __init__(self, message: str, fix: str = "", errno: Optional[int] = None, field: Optional[str] = None):
        super().__init__(message, fix)
        self.errno = errno
        self.field = field  # the namespace's config key at fault, when it is not device.path

    def config_error(self, source: str, where: str, ns: NamespaceConfig) -> ConfigError:
        """A backend that cannot open is a bad config: blame its field, else the file's device.path, else the
        namespace."""
        field = f"{where}.{self.field}" if self.field else f"{where}.device.path" if ns.backend == "file" else where
        return ConfigError(source, field, self.message, self.fix)


class Backend:
    """The interface the target core codes against."""

    kind = "?"
    blocking = False  # True if calls may wait for a device (run them off the event loop)
    block_size: int
    num_blocks: int
    path: Optional[str] = None
    buffer: Optional[memoryview] = None  # the whole namespace in memory (ram): reads are served from it directly
    direct = False  # the file backend opened it with O_DIRECT
    io_fd = -1  # the descriptor an I/O engine that makes the calls itself (io_uring) uses; -1: none

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


# A RAM namespace lives in a reservation of address space this large (or its own size, if larger): a resize within
# it maps or unmaps pages at its end, in place, so it copies nothing and its address never changes.  Address
# space only: nothing is committed or resident until written.  Where the reservation cannot be made (an address
# space limit), the namespace's own size is reserved and growing past it copies once into a new reservation.
RAM_RESERVE = 1 << 36
_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
_MAP_ANON = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
_MAP_FIXED = 0x10  # linux/mman.h
_MAP_NORESERVE = 0x4000
_mman = ctypes.CDLL(None, use_errno=True)  # mmap, munmap, madvise
_mman.mmap.restype = ctypes.c_void_p
_mman.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_mman.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_mman.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _map(addr: Optional[int], length: int, prot: int, flags: int) -> int:
    got = _mman.mmap(addr, length, prot, flags, -1, 0)
    if got in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return got


class _Reservation:
    """Address space for one RAM namespace: the first `mapped` bytes readable and writable, the rest inaccessible.
    Unmapped when the last view of it is gone (each `view` keeps it)."""

    def __init__(self, size: int):
        try:
            self.reserved = max(size, RAM_RESERVE)
            self.base = _map(None, self.reserved, _PROT_NONE, _MAP_ANON | _MAP_NORESERVE)
        except OSError:
            self.reserved = size
            self.base = _map(None, self.reserved, _PROT_NONE, _MAP_ANON | _MAP_NORESERVE)
        self.mapped = 0
        try:
            self.map_to(size)
        except OSError:
            _mman.munmap(self.base, self.reserved)
            raise

    def map_to(self, size: int) -> None:
        """Make the first `size` bytes usable: pages past the old end read zeros (fresh anonymous pages); pages
        past the new end go back to the kernel (a registration still pinning them holds them until released)."""
        page = -(-size // PAGE_SIZE) * PAGE_SIZE
        if page > self.mapped:
            _map(self.base + self.mapped, page - self.mapped, _PROT_RW, _MAP_ANON | _MAP_FIXED)
        elif page < self.mapped:
            _map(self.base + page, self.mapped - page, _PROT_NONE, _MAP_ANON | _MAP_FIXED | _MAP_NORESERVE)
        self.mapped = page

    def view(self, size: int) -> memoryview:
        pages = ctypes.cast(self.base, ctypes.POINTER(ctypes.c_char * size)).contents
        pages.reservation = self  # the address space lives as long as any view of it
        return memoryview(pages).cast("B")

    def __del__(self):
        _mman.munmap(self.base, self.reserved)


class RamBackend(Backend):
    kind = "ram"
    pinned = False  # registered with an RDMA device (pin): its pages must stay where they are

    def __init__(self, size_bytes: int, block_size: int = 512):
        if size_bytes <= 0 or size_bytes % block_size:
            raise BackendError(f"ram namespace: size {size_bytes} is not a positive multiple of {block_size}",
                               "give a size that is a multiple of the block size")
        self.block_size = block_size
        self.num_blocks = size_bytes // block_size
        try:
            self._memory = _Reservation(size_bytes)
        except (OSError, OverflowError) as exc:
            raise BackendError(f"ram namespace: cannot allocate {size_bytes} bytes: {exc}",
                               "use a smaller nvmeof_roce.size or a file backend") from None
        self.buffer = self._memory.view(size_bytes)
        self.closed = False

    def read_into(self, offset, buf):
        buf = memoryview(buf).cast("B")
        self._check(offset, len(buf))
        buf[:] = self.buffer[offset:offset + len(buf)]

    def read(self, offset, length):
        self._check(offset, length)
        return bytes(self.buffer[offset:offset + length])

    def write(self, offset, data, dsync=False):
        data = memoryview(data).cast("B")
        self._check(offset, len(data))
        self.buffer[offset:offset + len(data)] = data

    def pin(self):
        """The memory an RDMA transport registers (local access only) to send reads straight from it
        (TargetQueue.complete's `source`): a new object after each resize, so it is registered anew.  From then
        on zeroing writes zeros: a registration keeps the pages it pinned, so pages dropped with madvise would
        leave the device sending their old contents."""
        self.pinned = True
        return self.buffer.obj

    def write_zeroes(self, offset, length):
        self._check(offset, length)
        if self.pinned:
            self._memset(offset, length)
            return
        # Whole pages go back to the kernel: a private anonymous mapping reads zeros afterwards
        # (madvise MADV_DONTNEED), in microseconds per MiB instead of a memset; only while no RDMA
        # registration holds the old pages (pin).
        first = -(-offset // PAGE_SIZE) * PAGE_SIZE
        last = (offset + length) // PAGE_SIZE * PAGE_SIZE
        if last > first:
            self._memset(offset, first - offset)
            _mman.madvise(self._memory.base + first, last - first, mmap.MADV_DONTNEED)
            self._memset(last, offset + length - last)
        else:
            self._memset(offset, length)

    def discard(self, offset, length):
        self.write_zeroes(offset, length)

    def _memset(self, offset, length):
        end = offset + length
        while offset < end:
            n = min(_ZERO_CHUNK, end - offset)
            self.buffer[offset:offset + n] = bytes(n)
            offset += n

    def prepare_resize(self, size_bytes):
        """Within the reservation the new pages are mapped now (the only step that can fail) and the commit
        only changes the size, releasing the pages past a smaller one: no copy, the memory does not move.
        Beyond it (rare: RAM_RESERVE or the address space limit) a new reservation is made now and the
        commit copies the namespace into it."""
        _check_new_size("ram", size_bytes, self.block_size)
        memory = self._memory
        try:
            if size_bytes > memory.reserved:
                memory = _Reservation(size_bytes)
            elif size_bytes > memory.mapped:
                memory.map_to(size_bytes)
        except (OSError, OverflowError) as exc:
            raise BackendError(f"ram namespace: cannot allocate {size_bytes} bytes: {exc}",
                               "use a smaller size") from None

        def commit():
            if memory is not self._memory:
                keep = min(size_bytes, self.size_bytes)
                new = memory.view(size_bytes)
                new[:keep] = self.buffer[:keep]
                self._memory = memory
            elif size_bytes < memory.mapped:
                try:
                    memory.map_to(size_bytes)
                except OSError as exc:  # the pages stay mapped: only memory is not given back
                    log.warning("ram namespace: could not release the pages past %d bytes: %s", size_bytes, exc)
            self.buffer = self._memory.view(size_bytes)
            self.num_blocks = size_bytes // self.block_size
        return commit

    def close(self):
        # The address space goes with the last view of it (a registration not yet released keeps its own).
        self.closed = True


class NullBackend(Backend):
    kind = "null"

    def __init__(self, size_bytes: int, block_size: int = 512):
        if size_bytes <= 0 or size_bytes % block_size:
            raise BackendError(f"null namespace: size {size_bytes} is not a positive multiple of {block_size}",
                               "give a size that is a multiple of the block size")
        self.block_size = block_size
        self.num_blocks = size_bytes // block_size

    def read_into(self, offset, buf):
        buf = memoryview(buf).cast("B")
        self._check(offset, len(buf))
        buf[:] = bytes(len(buf))

    def write(self, offset, data, dsync=False):
        self._check(offset, len(memoryview(data).cast("B")))

    def write_zeroes(self, offset, length):
        self._check(offset, length)

    def zero_steps(self, offset, length, deallocate, slice_bytes):
        self._check(offset, length)
        return iter(())  # nothing stored, nothing to zero
    def prepare_resize(self, size_bytes):
        _check_new_size("null", size_bytes, self.block_size)

        def commit():
            self.num_blocks = size_bytes // self.block_size
        return commit


def _check_new_size(kind: str, size_bytes: int, block_size: int) -> None:
    if size_bytes <= 0 or size_bytes % block_size:
        raise BackendError(f"{kind} namespace: size {size_bytes} is not a positive multiple of the block size "
                           f"{block_size}", f"give a multiple of {block_size} bytes")


_libc = None


def _fallocate(fd: int, mode: int, offset: int, length: int) -> bool:
    """fallocate(2) with flags; False if the filesystem does not support that mode."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    if _libc.fallocate(fd, mode, offset, length) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err))


class FileBackend(Backend):
    kind = "file"
    blocking = True  # every call may wait for the device: the I/O engine runs them (engine/ioengine.py)

    def __init__(self, path: str, block_size: int = 512, create_size: Optional[int] = None,
                 direct: Optional[bool] = None, lock: Optional[str] = None, inherit: Optional["FileBackend"] = None,
                 device_block_size: bool = False):
        """`device_block_size`: a block device's namespace takes the device's logical block size, not
        `block_size` (which a file's always uses).  `direct` None: O_DIRECT for a
        block device (buffered if the device refuses it), buffered for a file; True: O_DIRECT or an error;
        False: buffered.  `lock`: flock "exclusive" or "shared" for as long as it is open; `inherit`: the
        backend this one replaces (a live change of the same namespace) hands over its lock on the same file."""
        self.path = path
        self._fd = self._dfd = self._lock_fd = -1
        self.direct = False
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if in_system_tree(path):  # never a file on devtmpfs, sysfs or procfs: the device is missing
                raise BackendError(*missing_device(path)) from None
            if create_size is None:
                raise BackendError(f"{path}: no such file",
                                   f"create it ({create_file_command(path)}), or set nvmeof_roce.size so the "
                                   "target creates it") from None
            self._create(path, create_size)
            st = os.stat(path)
        except PermissionError:
            raise BackendError(f"{path}: permission denied", "run as root or give this user access to the file") from None
        self.is_block = stat.S_ISBLK(st.st_mode)
        if not (self.is_block or stat.S_ISREG(st.st_mode)):
            raise BackendError(f"{path}: not a regular file or block device",
                               "device.path must name a file or a block device (e.g. /dev/nullb0)")
        self._fd = self._open(os.O_RDWR)
        try:
            if lock:
                self._take_lock(lock, inherit)
            if self.is_block:
                size = struct.unpack("Q", fcntl.ioctl(self._fd, BLKGETSIZE64, b"\0" * 8))[0]
                self.device_block_size = struct.unpack("i", fcntl.ioctl(self._fd, BLKSSZGET, b"\0" * 4))[0]
                if device_block_size:
                    block_size = self.device_block_size
                if block_size < self.device_block_size:
                    raise BackendError(f"{path}: logical block size is {self.device_block_size}, larger than the "
                                       f"namespace's {block_size}",
                                       f"set nvmeof_roce.block_size to {self.device_block_size} (or leave it out: "
                                       "the device's is used)")
            else:
                self.device_block_size = None
                size = st.st_size
                if create_size is not None and size != create_size:
                    log.warning("%s exists with %d bytes; nvmeof_roce.size %d is only used to create it",
                                path, size, create_size)
            self.block_size = block_size
            if size == 0 and self.is_block:
                raise BackendError(*empty_block_device(path))
            if size == 0:
                raise BackendError(f"{path}: is empty (0 bytes)",
                                   f"give it a size (truncate -s 1G {path}) or remove it and set nvmeof_roce.size")
            if size % block_size:
                raise BackendError(f"{path}: size {size} is not a multiple of the block size {block_size}",
                                   f"resize it to a multiple of {block_size} (truncate -s {size - size % block_size or block_size} {path})")
            self.num_blocks = size // block_size
            if direct is None and self.is_block or direct:
                try:
                    self._dfd = self._open(os.O_RDWR | os.O_DIRECT)
                    self.direct = True
                except BackendError:
                    raise
                except OSError as exc:
                    if direct:
                        raise BackendError(f"{path}: O_DIRECT was asked for (buffered_io 0) and the filesystem "
                                           f"refuses it: {exc.strerror}",
                                           "set \"buffered_io\": 1 on this namespace (tmpfs has no O_DIRECT), or "
                                           "move the file to a filesystem that has it") from None
                    log.warning("%s: O_DIRECT refused (%s): served through the page cache", path, exc.strerror)
        except BaseException:
            self.close()
            raise
        log.debug("%s: %d blocks of %d, %s", path, self.num_blocks, block_size,
                  "O_DIRECT" if self.direct else "buffered")

    def identity(self) -> tuple:
        """What makes two backends the same storage (config.backing_identity, from the open descriptor)."""
        st = os.fstat(self._fd)
        return ("blockdev", st.st_rdev) if stat.S_ISBLK(st.st_mode) else ("inode", st.st_dev, st.st_ino)

    def _take_lock(self, mode: str, inherit: Optional["FileBackend"]) -> None:
        if inherit is not None and getattr(inherit, "_lock_fd", -1) >= 0 and inherit.identity() == self.identity():
            # The namespace replaced by a live change holds the lock on this very file until it closes (after its
            # last command): share its lock (the same open file description), so there is no moment without one.
            self._lock_fd = os.dup(inherit._lock_fd)
            return
        self._lock(mode)
        self._lock_fd = os.dup(self._fd)

    def _lock(self, mode: str):
        """A flock for as long as the target serves the file: a second target (or a second namespace) on the
        same file would corrupt it.  "exclusive" for a target; "shared" for the workers of one
        `serve --workers` target, which serve the same file together (they still exclude a lone target)."""
        try:
            fcntl.flock(self._fd, (fcntl.LOCK_SH if mode == "shared" else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BackendError(f"{self.path}: is in use: another process holds its lock (another nvmeof-roce "
                               "target serving it?), or another namespace of this target serves the same file",
                               "stop the other target, or give this namespace its own file") from None

    def _create(self, path, size):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileNotFoundError:
            raise BackendError(f"{path}: cannot create, its directory does not exist",
                               f"create {os.path.dirname(path) or '.'} first") from None
        except PermissionError:
            raise BackendError(f"{path}: permission denied creating the file",
                               "run as root or pick a directory this user can write") from None
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)

    def _open(self, flags):
        try:
            return os.open(self.path, flags | os.O_CLOEXEC)
        except PermissionError:
            raise BackendError(f"{self.path}: permission denied opening it read-write",
                               "run as root or give this user write access (chmod/chown, or the 'disk' group)") from None
        except OSError as exc:
            if flags & os.O_DIRECT:
                raise
            raise BackendError(f"{self.path}: cannot open: {exc.strerror}", "check the path and that it is not in use") from None

    def _io_error(self, what, offset, length, exc):
        return BackendError(f"{self.path}: {what} of {length} bytes at {offset} failed: {exc.strerror or exc}",
                            "check the device (dmesg) and free space", exc.errno)

    # -- what an I/O engine that makes the calls itself (io_uring) needs: the descriptors and the errors
    @property
    def io_fd(self) -> int:
        """The descriptor reads and writes go to: the O_DIRECT one when there is one."""
        return self._dfd if self.direct else self._fd

    @property
    def buffered_fd(self) -> int:
        """The page-cache descriptor: flushes, and accesses O_DIRECT refuses as unaligned (EINVAL)."""
        return self._fd

    def io_error(self, what: str, offset: int, length: int, exc: OSError) -> BackendError:
        return self._io_error(what, offset, length, exc)

    def short_read_error(self, offset: int, length: int, done: int) -> BackendError:
        """A read that met the end of the file: it shrank under the namespace (nvmet: an error too)."""
        return BackendError(f"{self.path}: read of {length} bytes at {offset} got {done}: the file ends at "
                            f"{offset + done}, inside the namespace ({self.size_bytes} bytes)",
                            "restore the file's size (truncate -s), or resize the namespace to the file "
                            "(nvmeof-roce target resize-ns)")

    def short_write_error(self, offset: int, length: int, done: int) -> BackendError:
        return BackendError(f"{self.path}: write of {length} bytes at {offset} wrote {done}",
                            "check the device (dmesg) and free space", errno.EIO)

    def flush_error(self, exc: OSError) -> BackendError:
        return BackendError(f"{self.path}: flush failed: {exc.strerror}", "check the device (dmesg)", exc.errno)

    def read_into(self, offset, buf):
        buf = memoryview(buf).cast("B")
        length = len(buf)
        self._check(offset, length)
        done = 0
        fd = self._dfd if self.direct else self._fd
        while done < length:
            try:
                n = os.preadv(fd, [buf[done:]], offset + done)
            except OSError as exc:
                if exc.errno == errno.EINVAL and fd == self._dfd:
                    fd = self._fd           # unaligned for O_DIRECT: use the buffered descriptor
                    continue
                raise self._io_error("read", offset, length, exc) from None
            if n == 0:  # the end of the file came first: it shrank under the namespace (nvmet: an error too)
                raise self.short_read_error(offset, length, done)
            done += n

    def write(self, offset, data, dsync=False):
        data = memoryview(data).cast("B")
        length = len(data)
        self._check(offset, length)
        done = 0
        fd = self._dfd if self.direct else self._fd
        flags = os.RWF_DSYNC if dsync else 0
        while done < length:
            try:
                n = os.pwritev(fd, [data[done:]], offset + done, flags)
            except OSError as exc:
                if exc.errno == errno.EINVAL and fd == self._dfd:
                    fd = self._fd
                    continue
                if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL) and flags:
                    flags = 0  # no RWF_DSYNC here: write, then fdatasync below
                    continue
                raise self._io_error("write", offset, length, exc) from None
            if n == 0:
                raise self.short_write_error(offset, length, done)
            done += n
        if dsync and not flags:
            self.flush()

    def flush(self):
        try:
            os.fdatasync(self._fd)
        except OSError as exc:
            raise self.flush_error(exc) from None

    def prepare_resize(self, size_bytes):
        _check_new_size("file", size_bytes, self.block_size)
        if self.is_block:
            current = struct.unpack("Q", fcntl.ioctl(self._fd, BLKGETSIZE64, b"\0" * 8))[0]
            if size_bytes != current:
                raise BackendError(f"{self.path}: is a block device of {current} bytes; the target cannot make "
                                   f"it {size_bytes}", "resize the device first (e.g. lvextend), then resize the "
                                   f"namespace to its new size ({current} now)")
        elif size_bytes > self.size_bytes:
            try:  # growing first is harmless: hosts see the old size until the commit
                os.ftruncate(self._fd, size_bytes)
            except OSError as exc:
                raise BackendError(f"{self.path}: cannot grow to {size_bytes} bytes: {exc.strerror}",
                                   "free space on its filesystem or pick a smaller size") from None

        def commit():
            if not self.is_block and size_bytes < self.size_bytes:
                try:
                    os.ftruncate(self._fd, size_bytes)
                except OSError as exc:  # the namespace still shrinks: hosts no longer reach the tail
                    log.error("%s: cannot shrink the file to %d bytes: %s", self.path, size_bytes, exc.strerror)
            self.num_blocks = size_bytes // self.block_size
        return commit

    def _zero_by_writing(self, offset, length):
        zeros = bytes(min(_ZERO_CHUNK, length))
        end = offset + length
        while offset < end:
            n = min(len(zeros), end - offset)
            self.write(offset, memoryview(zeros)[:n])
            offset += n

    def write_zeroes(self, offset, length):
        self._check(offset, length)
        if length == 0:
            return
        try:
            if self.is_block:
                try:
                    fcntl.ioctl(self._fd, BLKZEROOUT, struct.pack("QQ", offset, length))
                    return
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOTTY):
                        raise
            elif _fallocate(self._fd, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, offset, length) or \
                    _fallocate(self._fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length):
                return
        except OSError as exc:
            raise self._io_error("write zeroes", offset, length, exc) from None
        self._zero_by_writing(offset, length)

    def discard(self, offset, length):
        self._check(offset, length)
        if length == 0:
            return
        try:
            if self.is_block:
                try:
                    fcntl.ioctl(self._fd, BLKDISCARD, struct.pack("QQ", offset, length))
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOTTY):
                        raise
                # a discard may leave old data: make the range read back as zeros
                self.write_zeroes(offset, length)
            elif not _fallocate(self._fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length):
                self.write_zeroes(offset, length)
        except OSError as exc:
            raise self._io_error("discard", offset, length, exc) from None

    def close(self):
        for name in ("_dfd", "_fd", "_lock_fd"):
            fd = getattr(self, name, -1)
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
                setattr(self, name, -1)


def open_backend(ns: NamespaceConfig, lock: Optional[str] = None, inherit: Optional[Backend] = None) -> Backend:
    """Open the backend a namespace config describes (`lock` "exclusive" or "shared": flock a file for as
    long as it is open; `inherit`: the backend of the namespace this one replaces, which hands over its lock)."""
    if ns.backend == "ram":
        return RamBackend(ns.size_bytes, ns.block_size)
    if ns.backend == "null":
        return NullBackend(ns.size_bytes, ns.block_size)
    if ns.backend == "file":
        if not ns.path:
            raise BackendError(f"namespace {ns.nsid}: file backend without device.path",
                               "set device.path to a file or block device")
        direct = None if ns.buffered_io is None else not ns.buffered_io
        return FileBackend(ns.path, ns.block_size, create_size=ns.size_bytes, direct=direct, lock=lock,
                           inherit=inherit if isinstance(inherit, FileBackend) else None,
                           device_block_size="block_size" not in ns.userspace)  # unless the config sets one
    raise BackendError(f"namespace {ns.nsid}: unknown backend {ns.backend!r}", "use ram, file or null")
