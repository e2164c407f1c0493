"""The initiator's native queue (csrc/hostq.c) on a fake verbs provider and NVMe target (tests/native/hostq_fake.c).

`FakeHost` builds the fake into a small .so once per source version (gcc, as the extension's build needs anyway),
gives a `_native.HostQueue` the fake's QP and CQ, and reads back what the fake saw.
"""
from __future__ import annotations

import ctypes
import hashlib
import mmap
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "tests" / "native" / "hostq_fake.c"
STATS = ("commands", "reads", "writes", "bad", "cid_reuse", "errors_sent", "rnr", "post_send_calls",
         "post_recv_calls", "sends", "signaled", "inline", "max_outstanding", "outstanding", "other", "polls",
         "recvs_posted", "arms")
RKEY = 0x1234
MISBEHAVIOURS = ("short", "foreign_cid", "duplicate")


def library() -> ctypes.CDLL:
    tag = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    out = ROOT / "build" / "tests" / f"hostq_fake-{tag}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        subprocess.run(["gcc", "-O1", "-g", "-shared", "-fPIC", "-Wall", "-o", str(tmp), str(SOURCE)], check=True)
        tmp.rename(out)
    lib = ctypes.CDLL(str(out))
    for name in ("fake_new", "fake_qp", "fake_cq", "fake_channel"):
        getattr(lib, name).restype = ctypes.c_void_p
    for name in ("fake_qp", "fake_cq", "fake_free", "fake_stat", "fake_first_bad", "fake_bad_reason",
                 "fake_expect", "fake_inject", "fake_misbehave", "fake_channel", "fake_respond_at_arm"):
        getattr(lib, name).argtypes = [ctypes.c_void_p] + {
            "fake_stat": [ctypes.c_int],
            "fake_expect": [ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_uint64,
                            ctypes.c_uint64, ctypes.c_uint32],
            "fake_inject": [ctypes.c_uint32, ctypes.c_uint16, ctypes.c_uint32],
            "fake_misbehave": [ctypes.c_int, ctypes.c_uint64],
            "fake_respond_at_arm": [ctypes.c_int]}.get(name, [])
    lib.fake_stat.restype = ctypes.c_uint64
    lib.fake_first_bad.restype = ctypes.c_uint64
    return lib


def _address(mapping: mmap.mmap) -> int:
    anchor = ctypes.c_char.from_buffer(mapping)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


class FakeHost:
    """A HostQueue of `slots` slots on the fake; `data` is the registered data buffer of `depth` blocks."""

    def __init__(self, module, *, slots: int = 64, recv_count: int = 64, inline_max: int = 64, interval: int = 16,
                 slot_size: int = 64 + 1024, sq_size: int = 0, channel: bool = False):
        self.lib = library()
        self.fake = self.lib.fake_new()
        self.recv = mmap.mmap(-1, recv_count * 16)
        self.send = mmap.mmap(-1, slots * slot_size)
        # with a completion channel, perf sleeps on it after its empty polls (a sleep ends only at its timeout)
        extra = (self.lib.fake_channel(self.fake),) if channel else ()
        self.queue = module.HostQueue(self.lib.fake_qp(self.fake), self.lib.fake_cq(self.fake), _address(self.recv),
                                      1, recv_count, _address(self.send), 2, slots, slot_size, inline_max,
                                      sq_size or 2 * slots + 2, interval, *extra)

    def respond_at_arm(self) -> None:
        """Hold every response back until the host arms the CQ: it lands just before the arm, raising no event."""
        self.lib.fake_respond_at_arm(self.fake, 1)

    def expect(self, *, nsid: int, nlb: int, block_size: int, nblocks: int, depth: int) -> dict:
        self.data = mmap.mmap(-1, depth * block_size)
        addr = _address(self.data)
        self.lib.fake_expect(self.fake, nsid, nlb, block_size, nblocks, addr, depth * block_size, RKEY)
        return {"data_addr": addr, "data_rkey": RKEY}

    def inject(self, *, error_every: int = 0, status: int = 0, fail_after: int = 0) -> None:
        self.lib.fake_inject(self.fake, error_every, status, fail_after)

    def misbehave(self, kind: str, at: int) -> None:
        """Command `at` (from 1) gets a hostile response: "short" (15 bytes), "foreign_cid" (a CID no command has)
        or "duplicate" (sent again at the next poll, when its CID may name a newer command)."""
        self.lib.fake_misbehave(self.fake, MISBEHAVIOURS.index(kind) + 1, at)

    def stats(self) -> dict:
        out = {name: self.lib.fake_stat(self.fake, i) for i, name in enumerate(STATS)}
        out["first_bad"] = self.lib.fake_first_bad(self.fake)
        out["bad_reason"] = self.lib.fake_bad_reason(self.fake)
        return out

    def close(self) -> None:
        self.queue = None
        self.lib.fake_free(self.fake)
