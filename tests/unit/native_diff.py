"""Two targets with one config, the same I/O queue opened on each: over loopback (the Python data path) and through
the native queue on the fake provider (the C data path, with the core behind it).  `Endpoint.exchange` sends one
capsule and returns the CQEs it produced; the differential tests compare them and every byte moved."""
from __future__ import annotations

import ctypes
import functools
import time
from typing import List, Optional

from loopback_env import ADDR1, Env, HOST_A, RAW_HOSTID, raw_connect, raw_enable
from native_fake import FakeDevice, native_queue, pump
from nvmeof_roce.nvme import fabrics as F
from nvmeof_roce.nvme.command import SQE_STRUCT
from nvmeof_roce.nvme.sgl import SglDescriptor

HOST_BUFFER = 1 << 20


@functools.lru_cache(maxsize=64)
def pattern(size: int, seed: int = 7) -> bytes:
    block = bytes((i * 131 + seed + (i >> 9)) & 0xFF for i in range(min(size, 1 << 16)))
    return (block * (size // len(block) + 1))[:size] if size else b""


def engine_busy(env) -> bool:
    """A file or block namespace's command is with the core's I/O engine (its completion comes on the loop)."""
    return any(ns.jobs for sub in env.target.subsystems.values() for ns in sub.namespaces.values())


def settle(env, more=lambda: False, timeout: float = 10.0) -> None:
    """Run the loopback fabric (and its watched fds: the engines' eventfds) until the engines are idle."""
    deadline = time.monotonic() + timeout
    env.fabric.pump()
    while engine_busy(env) or more():
        assert time.monotonic() < deadline, "the I/O engines did not finish in 10 s"
        env.fabric.run_watched(0.05)
        env.fabric.pump()


class Endpoint:
    """One I/O queue of one target and the host memory its capsules point at."""

    alive: bool
    buf_addr: int
    buf_key: int

    def host_bytes(self) -> bytes:
        raise NotImplementedError

    def exchange(self, capsule: bytes) -> List[bytes]:
        raise NotImplementedError

    def fresh_buffer(self) -> None:
        """A new registration with the same contents (after the target invalidated the old key)."""
        raise NotImplementedError


class LoopbackEndpoint(Endpoint):
    def __init__(self, config: dict, subnqn: str, host_buffer: int = HOST_BUFFER, kato: int = 0):
        self.host_buffer = host_buffer
        self.env = Env(config)
        admin, cqe = raw_connect(self.env.connector(ADDR1), subnqn, HOST_A, kato=kato)
        assert cqe.status == 0
        raw_enable(admin)
        self.admin = admin
        self.io, cqe = raw_connect(self.env.connector(ADDR1), subnqn, HOST_A, qid=1, cntlid=cqe.result & 0xFFFF)
        assert cqe.status == 0, cqe
        self.transport = self.io.transport
        self._register(pattern(host_buffer))

    def _register(self, contents: bytes) -> None:
        self.buf = self.transport.register_with_access(self.host_buffer, invalidatable=True)
        self.buf.view[:] = contents
        self.buf_addr, self.buf_key = self.buf.addr, self.buf.key

    def fresh_buffer(self) -> None:
        self._register(bytes(self.buf.view))

    @property
    def alive(self) -> bool:
        return not self.transport.closed

    def host_bytes(self) -> bytes:
        return bytes(self.buf.view)

    def exchange(self, capsule: bytes) -> List[bytes]:
        if not self.alive:
            return []
        self.transport._outstanding = 0  # the differential sends one at a time; the host never runs out
        self.transport.send(capsule)
        settle(self.env)
        return list(self.transport.poll(0)) if self.alive else []

    def namespace_bytes(self, subnqn: str, nsid: int) -> bytes:
        return namespace_bytes(self.env, subnqn, nsid)


def namespace_bytes(env, subnqn: str, nsid: int) -> bytes:
    backend = env.target.subsystem(subnqn).namespaces[nsid].backend
    if backend.kind == "file":
        with open(backend.path, "rb") as f:
            return f.read()
    return bytes(backend.buffer)


class NativeEndpoint(Endpoint):
    def __init__(self, config: dict, subnqn: str, depth: int = 32, file_buffers: int = 32, max_reads: int = 16,
                 region_of=None, host_buffer: int = HOST_BUFFER, kato: int = 0):
        """`kato`: the admin queue's keep-alive timeout in ms (0: none asked for, the target's max_kato)."""
        self.host_buffer = host_buffer
        self.env = Env(config)
        admin, cqe = raw_connect(self.env.connector(ADDR1), subnqn, HOST_A, kato=kato)
        assert cqe.status == 0
        raw_enable(admin)
        self.admin = admin
        self.device = FakeDevice()
        self.regions = {}
        handler = self.env.target.port(1)
        self.queue = native_queue(self.device, handler, depth=depth, region_of=region_of or self.region_of,
                                  file_buffers=file_buffers, max_reads=max_reads)
        handler.queue_opened(self.queue)
        self._register(pattern(host_buffer))
        connect_data = F.ConnectData(RAW_HOSTID, cqe.result & 0xFFFF, subnqn, HOST_A).pack()
        self.buf.view[:1024] = connect_data
        sgl = SglDescriptor.keyed(self.buf_addr, 1024, self.buf_key)
        sqe = F.ConnectCommand(qid=1, sqsize=depth - 1, sgl=sgl).to_sqe()
        sqe.cid = 0x77
        (answer,) = self.exchange(sqe.pack())
        assert answer[14:16] == b"\0\0", answer
        self.buf.view[:1024] = pattern(host_buffer)[:1024]

    def region_of(self, backend):
        mapping = backend.pin()  # a new object once a resize changed the memory: registered anew
        key = id(backend)
        if key not in self.regions or self.regions[key][0] is not mapping:
            self.regions[key] = (mapping, self.device.register_local(mapping))
        return self.regions[key][1]

    def _register(self, contents: bytes) -> None:
        self.buf = self.device.remote(self.host_buffer)
        self.buf.view[:] = contents
        self.buf_addr, self.buf_key = self.buf.addr, self.buf.lkey

    def fresh_buffer(self) -> None:
        self._register(bytes(self.buf.view))

    @property
    def alive(self) -> bool:
        return not self.queue.closed

    def host_bytes(self) -> bytes:
        return bytes(self.buf.view)

    def exchange(self, capsule: bytes) -> List[bytes]:
        if not self.alive:
            return []
        assert self.device.deliver(capsule) == 0, "no receive posted"
        self.settle()
        return [cqe for cqe, _inv in self.device.responses()]

    def settle(self) -> None:
        """Until the C queue, its ring and the core's engines are all idle."""
        for _ in range(100):
            pump(self.queue)
            settle(self.env)
            if not pump(self.queue):
                return
        raise AssertionError("the native queue kept completing work")

    def namespace_bytes(self, subnqn: str, nsid: int) -> bytes:
        return namespace_bytes(self.env, subnqn, nsid)

    def close(self) -> None:
        self.queue.close()
        self.env.close()
        self.device.close()


def io_capsule(ep: Endpoint, opc: int, nsid: int, slba: int, nlb: int, sgl_len: int, *, flags: int = 0x40,
               sgl_id: int = 0x40, offset: int = 0, bad_key: bool = False, cid: int = 1, cdw12_hi: int = 0,
               extra: bytes = b"") -> bytes:
    addr = ep.buf_addr + offset
    key = (ep.buf_key ^ 0x5A5A5A) if bad_key else ep.buf_key
    if sgl_id >> 4 == 0:  # in-capsule data block: ADDR is the offset, 4-byte length
        dptr2 = sgl_len | (sgl_id << 56)
        addr = offset
    else:
        dptr2 = (sgl_len & 0xFFFFFF) | ((key & 0xFFFFFFFF) << 24) | (sgl_id << 56)
    cdw12 = (nlb & 0xFFFF) | ((cdw12_hi & 0xFFFF) << 16)
    return SQE_STRUCT.pack(opc, flags, cid, nsid, 0, 0, 0, addr & ((1 << 64) - 1), dptr2,
                           slba & 0xFFFFFFFF, (slba >> 32) & 0xFFFFFFFF, cdw12, 0, 0, 0) + extra


def close_all(*eps: Optional[Endpoint]) -> None:
    for ep in eps:
        if ep is None:
            continue
        try:
            if isinstance(ep, NativeEndpoint):
                ep.close()
            else:
                ep.env.close()
        except Exception:
            pass


def as_bytes(view) -> bytes:
    return ctypes.string_at(ctypes.addressof(view), len(view))
