"""The RAM backend (registry entry "ram", config/backends.py; native entry "ram", csrc/be_ram.c): one anonymous
mapping, page aligned, so the target can register it as one memory region; `.buffer` is a writable memoryview of
all of it, for zero-copy reads, and the native data path reads and writes it in place (RDMA straight to and from
it).  Write Zeroes and deallocate give whole pages back to the kernel while no registration pins them."""
import ctypes
import logging
import mmap
import os
from typing import Optional

from .base import Backend, BackendError, check_new_size

log = logging.getLogger(__name__)

_ZERO_CHUNK = 1 << 20
PAGE_SIZE = mmap.PAGESIZE

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
    native = "ram"
    addressable = True
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
        check_new_size("ram", size_bytes, self.block_size)
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

