"""The file and block backends (registry entries "file" and "block", config/backends.py; native entry "file",
csrc/be_uring.c): a regular file or a block device.

O_DIRECT for a block device (as nvmet, whose block namespaces bypass the page cache), buffered for a file, unless
the namespace's `buffered_io` says otherwise (0: O_DIRECT, refused with a clear error where the filesystem has
none, e.g. tmpfs; 1: buffered).  A block device's logical block size is the namespace's unless the config sets
one.  Reads go into the caller's memoryview with os.preadv (the I/O engine passes page-aligned buffers,
engine/ioengine.py); an access O_DIRECT refuses (unaligned buffer or offset) falls back to a second, buffered
descriptor.  A read or write that ends short is an error (never zeros with success); flush = fdatasync; Write
Zeroes and deallocate are BLKZEROOUT and BLKDISCARD on a block device, fallocate(ZERO_RANGE / PUNCH_HOLE) on a
file.  These calls wait for the device: the target never makes them on its event loop (`blocking`).  "file"
takes a file or a block device; "block" only a block device.
"""
import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import stat
import struct
from typing import Optional

from ... import native
from ...config import NamespaceConfig
from ...config.devices import create_file_command, empty_block_device, in_system_tree, missing_device
from .base import Backend, BackendError, check_new_size

log = logging.getLogger(__name__)

# linux/fs.h
BLKGETSIZE64 = 0x80081272
BLKSSZGET = 0x1268
BLKDISCARD = 0x1277
BLKZEROOUT = 0x127F
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10

_ZERO_CHUNK = 1 << 20

_libc = None


def _close_quietly(fd: int) -> int:
    """Close `fd` if it is open (an error closing it is of no use to anyone); -1, what the backend keeps."""
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass
    return -1


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
    native = "file"  # the C entry (csrc/be_uring.c): the C queue's io_uring, through its bounce chunks (csrc/be_uring.c)
    _fd = _dfd = _lock_fd = -1  # the open descriptors (-1: none); close() closes what is open

    @classmethod
    def open(cls, ns: NamespaceConfig, lock: Optional[str] = None, inherit: Optional[Backend] = None):
        if not ns.path:
            raise BackendError(f"namespace {ns.nsid}: {cls.kind} backend without device.path",
                               "set device.path to a file or block device")
        direct = None if ns.buffered_io is None else not ns.buffered_io
        return cls(ns.path, ns.block_size, create_size=None if cls.block_only else ns.size_bytes, direct=direct,
                   lock=lock, inherit=inherit if isinstance(inherit, FileBackend) else None,
                   device_block_size="block_size" not in ns.userspace)  # unless the config sets one

    block_only = False  # "block": device.path must be a block device

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
        if self.block_only and not self.is_block:
            raise BackendError(f"{path}: not a block device", "a \"block\" namespace's device.path names a block "
                               "device (e.g. /dev/nvme0n1); use \"backend\": \"file\" for a file")
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

    def native_handle(self, engine, depth):
        """The C queue's `_native.File` (a dup of the descriptor reads and writes go to) when the namespace's
        engine is io_uring (the native entry shares its rules); None otherwise, or once closed."""
        fd = self.io_fd
        if engine != "io_uring" or fd < 0 or native.module is None:
            return None
        return native.module.File(fd, depth)

    def storage_size(self):
        """The file's or the device's size now (a file grown, a volume extended outside the target)."""
        if self._fd < 0:
            return None
        if self.is_block:
            return struct.unpack("Q", fcntl.ioctl(self._fd, BLKGETSIZE64, b"\0" * 8))[0]
        return os.fstat(self._fd).st_size

    def identity(self) -> tuple:
        """What makes two backends the same storage (config.backing_identity, from the open descriptor)."""
        st = os.fstat(self._fd)
        return ("blockdev", st.st_rdev) if stat.S_ISBLK(st.st_mode) else ("inode", st.st_dev, st.st_ino)

    def _take_lock(self, mode: str, inherit: Optional["FileBackend"]) -> None:
        if inherit is not None and inherit._lock_fd >= 0 and inherit.identity() == self.identity():
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
        check_new_size("file", size_bytes, self.block_size)
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
        self._dfd = _close_quietly(self._dfd)
        self._fd = _close_quietly(self._fd)
        self._lock_fd = _close_quietly(self._lock_fd)


class BlockBackend(FileBackend):
    """A block device only (registry entry "block"): "file" takes one too; "block" refuses anything else."""
    kind = "block"
    block_only = True
