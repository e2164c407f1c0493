"""Registered memory of the RDMA target: our own buffers, a RAM namespace's mapping, and each port's `DataPool`.

Every registration is made on the listener's own PD (never the CM's, docs/protocol.md §7.3 item 4) and pins its
pages against the locked-memory limit (`register` says so when it is too low).  A port's data buffers are one
registration made at start, carved into MDTS-sized chunks; `BufferPool` (transport/resources.py) says which queue
may take which.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import resource
from typing import Optional

from ...errors import NvmeofError
from ..resources import BufferPool
from .verbs import PYVERBS_ERROR

if PYVERBS_ERROR is None:
    from .verbs import MR, PyverbsRDMAError, e


def register(pd, size: int, access: int, addr: int):
    """One MR over [addr, addr + size).  The device pins the pages against the locked-memory limit: siw counts
    them even for root (rxe and hardware drivers let CAP_IPC_LOCK through), so a low `ulimit -l` shows here."""
    try:
        return MR(pd, size, access, address=addr)
    except PyverbsRDMAError as exc:
        if getattr(exc, "error_code", None) not in (errno.ENOMEM, errno.EPERM, errno.EAGAIN):
            raise
        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft >> 10} KiB"
        raise NvmeofError(f"cannot register {size >> 10} KiB of memory with the RDMA device ({exc}); the "
                          f"locked-memory limit (ulimit -l) is {limit}",
                          "raise it: ulimit -l unlimited in the shell that starts the target, LimitMEMLOCK=infinity "
                          "in a systemd unit, '* - memlock unlimited' in /etc/security/limits.d/; or use fewer "
                          "--data-buffers") from exc


def data_buffer_access(iwarp: bool) -> int:
    """Access rights of the target's data buffers, which are the sinks of its RDMA READs (a host's write data).
    On RoCE and InfiniBand a READ response lands in the sink by its lkey: local write is enough.  iWARP carries
    the response as tagged data addressed by the sink's rkey, so the sink must allow remote write (the kernel's
    rdma_rw does the same for iWARP); only then, for least exposure (docs/protocol.md §7.8)."""
    access = e.IBV_ACCESS_LOCAL_WRITE
    return access | e.IBV_ACCESS_REMOTE_WRITE if iwarp else access


class RegisteredMemory:
    """Page-aligned memory we own (a memoryview), registered as one MR."""

    def __init__(self, pd, size: int, access: int):
        self.size = max(size, mmap.PAGESIZE)
        self.map = mmap.mmap(-1, self.size)
        self.view = memoryview(self.map)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.mr = register(pd, self.size, access, self.addr)
        self.lkey = self.mr.lkey
        self.rkey = self.mr.rkey

    def close(self) -> None:
        if self.mr is not None:
            self.mr.close()
            self.mr = None
            self.view.release()
            try:
                self.map.close()
            except BufferError:  # a slice is still referenced somewhere; the GC frees it later
                pass


class MappedRegion:
    """A mapping owned by someone else (a RAM namespace), registered as one MR."""

    def __init__(self, pd, mapping: mmap.mmap, access: int):
        # the address only: the buffer export ends with the temporary ctypes object
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        self.mr = register(pd, len(mapping), access, self.addr)
        self.lkey = self.mr.lkey

    def close(self) -> None:
        if self.mr is not None:
            self.mr.close()
            self.mr = None


class DataPool:
    """Fixed-size data chunks carved from one registration made at start; `accounts` says who may take which."""

    def __init__(self, pd, chunk_size: int, chunks: int, min_per_queue: int, access: Optional[int] = None):
        self.chunk_size = chunk_size
        self.memory = RegisteredMemory(pd, chunk_size * chunks, e.IBV_ACCESS_LOCAL_WRITE if access is None else access)
        self.accounts = BufferPool(chunks, min_per_queue)

    def view(self, chunk: int, length: int) -> memoryview:
        start = chunk * self.chunk_size
        return self.memory.view[start:start + length]

    def addr(self, chunk: int) -> int:
        return self.memory.addr + chunk * self.chunk_size
