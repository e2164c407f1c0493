"""The native queue on the fake verbs provider (tests/native/fakeprov.c): a target queue and a host, no device.

`fake_library()` compiles the provider with gcc into build/ (once per source change) and loads it with ctypes.
`NativeEnv` puts a `NativeTargetQueue` (transport/rdma/native_queue.py) on it, in front of a loopback `Env`'s Target:
the admin queue goes over loopback, the I/O queue through the C queue.  `FakeHost` is the host end: it registers
memory (rkeys), sends capsules and collects the responses the C queue SENT.
"""
from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import select
import subprocess
from pathlib import Path
from typing import List, Optional, Tuple

import pytest

from nvmeof_roce import native
from nvmeof_roce.transport.rdma.connect import RdmaConnectRequest
from nvmeof_roce.transport.rdma.native_queue import ChunkPool, NativeTargetQueue, NativeVerbs, Region
from nvmeof_roce.transport.resources import BufferPool

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "tests" / "native" / "fakeprov.c"

needs_native = pytest.mark.skipif(not native.available(), reason=native.missing_reason or "")


def compiled_fake(source: Path) -> Path:
    """`source` (a fake library under tests/native/) built into build/tests/ once per source version and flags
    (NVMEOF_FAKEPROV_CFLAGS: the sanitizer builds set them), atomically so parallel runs never load half a file."""
    text = source.read_bytes()
    flags = os.environ.get("NVMEOF_FAKEPROV_CFLAGS", "-O2 -g")
    tag = hashlib.sha256(text + flags.encode()).hexdigest()[:12]
    out = ROOT / "build" / "tests" / f"{source.stem}-{tag}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run(["gcc", "-shared", "-fPIC", "-Wall", "-Werror", *flags.split(), "-o", str(tmp), str(source)],
                       check=True)
        os.replace(tmp, out)
    return out


def fake_library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(compiled_fake(SOURCE)))
    vp, u32, u64 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64
    for name, res, args in (("fakehost_new", vp, [ctypes.c_int]), ("fakehost_free", None, [vp]), ("fakehost_qp", vp, [vp]),
                            ("fakehost_send_cq", vp, [vp]), ("fakehost_recv_cq", vp, [vp]),
                            ("fakehost_reg_local", u32, [vp, u64, u64]), ("fakehost_reg_remote", u32, [vp, u64, u64]),
                            ("fakehost_deliver", ctypes.c_int, [vp, ctypes.c_char_p, u32]),
                            ("fakehost_responses", u32, [vp, vp, u32]), ("fakehost_counters", None, [vp, vp]),
                            ("fakehost_hold", None, [vp, ctypes.c_int]), ("fakehost_release", u32, [vp, u32]),
                            ("fakehost_fail_post", None, [vp, ctypes.c_int, ctypes.c_int, u32]),
                            ("fakehost_qp_error", None, [vp]),
                            ("fakehost_stage", ctypes.c_int, [vp, ctypes.c_char_p, u32, u32]),
                            ("fakehost_staged", ctypes.c_int, [vp]),
                            ("fakehost_on_wire_into", u32, [vp, u64, u64])):
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    return lib


_LIB: Optional[ctypes.CDLL] = None


def lib() -> ctypes.CDLL:
    global _LIB
    if _LIB is None:
        _LIB = fake_library()
    return _LIB


COUNTERS = ("post_send", "post_recv", "polls", "arms", "wrs", "rnr", "reads", "writes", "recvs_posted",
            "qp_error", "cq_overflow", "on_wire", "flushed", "post_faults")


class FakeDevice:
    """One fake QP with its CQs, the target's and the host's registrations."""

    def __init__(self, shared_cq: bool = True):
        self.lib = lib()
        self.dev = self.lib.fakehost_new(1 if shared_cq else 0)
        self.buffers = []  # keep every registered buffer alive

    def verbs(self, max_reads: int = 16) -> NativeVerbs:
        return NativeVerbs(self.lib.fakehost_qp(self.dev), self.lib.fakehost_send_cq(self.dev), self.lib.fakehost_recv_cq(self.dev),
                           max_reads)

    def _buffer(self, size: int):
        buf = (ctypes.c_char * size)()
        self.buffers.append(buf)
        return buf, ctypes.addressof(buf)

    def local(self, size: int) -> Region:
        buf, addr = self._buffer(size)
        return Region(addr, self.lib.fakehost_reg_local(self.dev, addr, size), size, memoryview(buf).cast("B"))

    def register_local(self, view) -> Tuple[int, int]:
        """(addr, lkey) of memory someone else owns (a RAM namespace's mapping)."""
        addr = ctypes.addressof(ctypes.c_char.from_buffer(view))
        return addr, self.lib.fakehost_reg_local(self.dev, addr, len(view))

    def bounce(self, size: int) -> Region:
        """Page-aligned registered memory (an anonymous mapping, as the RDMA transport's bounce chunks)."""
        mapping = mmap.mmap(-1, size)
        self.buffers.append(mapping)
        addr, lkey = self.register_local(mapping)
        return Region(addr, lkey, size)

    def remote(self, size: int) -> Region:
        buf, addr = self._buffer(size)
        return Region(addr, self.lib.fakehost_reg_remote(self.dev, addr, size), size, memoryview(buf).cast("B"))

    def deliver(self, capsule: bytes) -> int:
        """0, or -1: no receive posted (RNR), -2: longer than the receive buffer, -3: the QP is in error."""
        return self.lib.fakehost_deliver(self.dev, capsule, len(capsule))

    def responses(self) -> List[Tuple[bytes, Optional[int]]]:
        """(CQE, invalidated rkey or None) of every response SENT since the last call."""
        out = (ctypes.c_char * (24 * 4096))()
        got = []
        while True:
            n = self.lib.fakehost_responses(self.dev, out, 4096)
            raw = bytes(out[:24 * n])
            for i in range(n):
                rec = raw[24 * i:24 * i + 24]
                got.append((rec[:16], int.from_bytes(rec[16:20], "little") if rec[20] & 1 else None))
            if n < 4096:
                return got

    def counters(self) -> dict:
        out = (ctypes.c_uint64 * len(COUNTERS))()
        self.lib.fakehost_counters(self.dev, out)
        return dict(zip(COUNTERS, out))

    # -- the fault model (tests/native/fakeprov.c)

    def hold(self, on: bool = True) -> None:
        """Hold the wire: posted work requests stay on it (no completion, no data moved) until `release`.
        Not held (the default), every CQ poll generates the completions of everything on the wire first."""
        self.lib.fakehost_hold(self.dev, 1 if on else 0)

    def release(self, n: Optional[int] = None) -> int:
        """Complete the next `n` work requests on the wire (all when None), their data moved now; how many
        are left on it."""
        return self.lib.fakehost_release(self.dev, 0xFFFFFFFF if n is None else n)

    def on_wire(self) -> int:
        return self.counters()["on_wire"]

    def on_wire_into(self, addr: int, length: int) -> int:
        """Work requests on the wire whose local memory overlaps [addr, addr + length): completing them would
        move data there."""
        return self.lib.fakehost_on_wire_into(self.dev, addr, length)

    def fail_post(self, which: str, err: int, nth: int = 1) -> None:
        """The `nth` ibv_post_send (`which` "send") or ibv_post_recv ("recv") from now returns `err` (an
        errno), with *bad at its first work request and none of them posted."""
        if which not in ("send", "recv"):
            raise ValueError(f"which must be 'send' or 'recv', not {which!r}")
        self.lib.fakehost_fail_post(self.dev, 1 if which == "recv" else 0, err, nth)

    def stage(self, capsule: bytes, polls: int = 0) -> None:
        """Hold `capsule` back until the `polls`th poll_cq from now, or (0) the next arm of a CQ: a completion
        that lands between the target's last poll and its arm."""
        assert self.lib.fakehost_stage(self.dev, capsule, len(capsule), polls) == 0

    def staged(self) -> bool:
        return bool(self.lib.fakehost_staged(self.dev))

    def qp_error(self) -> None:
        """Move the QP to the error state: every work request on the wire and every posted receive completes
        with IBV_WC_WR_FLUSH_ERR, and so does every later post."""
        self.lib.fakehost_qp_error(self.dev)

    def destroy_qp(self) -> None:
        """What the RDMA transport's destroy_cm_qp is to a native queue that closes (its on_close): the QP in the
        error state, so nothing on the wire moves data any more."""
        if self.dev:
            self.qp_error()

    def close(self) -> None:
        if self.dev:
            self.lib.fakehost_free(self.dev)
            self.dev = None


def native_queue(device: FakeDevice, handler, qid: int = 1, depth: int = 32, in_capsule_size: int = 4096,
                 max_transfer: int = 128 * 1024, chunks: int = 64, max_reads: int = 16,
                 region_of=None, files: bool = True, file_buffers: int = 32) -> NativeTargetQueue:
    """A NativeTargetQueue on the fake device, as the RDMA transport would make it."""
    request = RdmaConnectRequest(recfmt=0, qid=qid, hrqsize=depth, hsqsize=depth - 1, cntlid=0, peer="fake")
    recv = device.local((depth + 1) * (64 + in_capsule_size))
    pool_region = device.local(chunks * max_transfer)
    pool = BufferPool(chunks, 4)
    zero = device.local(max_transfer)
    sink = device.local(max_transfer)
    return NativeTargetQueue(native.module, handler, request, device.verbs(max_reads), in_capsule_size=in_capsule_size,
                             recv=recv, chunks=ChunkPool(pool_region, max_transfer), share=pool.share(),
                             max_transfer=max_transfer, zero=zero, sink=sink,
                             on_close=lambda queue: device.destroy_qp(),
                             region_of=region_of or (lambda backend: None),
                             bounce_of=device.bounce if files else None, file_buffers=file_buffers)


def pump(queue: NativeTargetQueue, rounds: int = 64) -> int:
    """Poll until nothing completes (each poll generates the completions of what the last one posted, unless the
    wire is held); file and block commands
    on the queue's io_uring are waited for (its eventfd, up to 10 s)."""
    total = 0
    for _ in range(rounds):
        n = queue.poll()
        total += n
        if not n:
            if queue.closed or queue.ring_fd is None or not queue.native.stats()["ring_in_flight"]:
                return total
            ready, _, _ = select.select([queue.ring_fd], [], [], 10)
            assert ready, "the io_uring gave no completion in 10 s"
            try:
                os.read(queue.ring_fd, 8)
            except BlockingIOError:
                pass
    raise AssertionError("the queue kept completing work for 64 polls")
