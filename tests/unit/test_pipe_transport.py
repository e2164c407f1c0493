"""Adding a transport is one module and one registry entry: "pipe", a tiny in-process transport defined here and
registered by this test, runs the whole command set through the unchanged target core and the project's own
initiator.

It differs from loopback on purpose, so the core is seen asking the entry rather than assuming RDMA: no
in-capsule data (its SGL mapping takes keyed descriptors only, and Identify says so), no remote invalidation,
a data descriptor of its own (`PipeData`: the buffer's key and the address in it, which the core carries
unread), and its own words for a refused queue.  Its data movement is what any transport owes the core
(transport/contracts.py): `read_host` fetches host memory later and calls back, `complete` writes the data then
delivers the CQE, `close` reports `queue_closed` once.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import pytest

from nvmeof_roce.config import parse_config
from nvmeof_roce.initiator.controller import Controller
from nvmeof_roce.nvme import fabrics as F
from nvmeof_roce.nvme import identify as I
from nvmeof_roce.nvme import status as S
from nvmeof_roce.nvme.command import CQE, NVM_WRITE, SQE
from nvmeof_roce.nvme.sgl import SUBTYPE_ADDRESS, SUBTYPE_INVALIDATE_KEY, TYPE_KEYED_DATA_BLOCK, SglDescriptor
from nvmeof_roce.engine.core import Target
from nvmeof_roce.transport import registry
from nvmeof_roce.transport.contracts import (ConnectRejected, ConnectRequest, Connector, HostBuffer, HostQueue, Refusal,
                                        TargetQueue, TransportError)

HOST = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000e1e01"
SUB = "nqn.2024-01.io.test:pipe"
# The pipe's own words for a refusal: the engine's (Refusal) and the pipe's own checks of its request.
PIPE_REJECT = {"recfmt": 101, Refusal.INVALID_QID: 102, "sqsize": 103, Refusal.NO_RESOURCES: 105}


@dataclass(frozen=True)
class PipeConnectRequest(ConnectRequest):
    """What the pipe's connection carries besides what the engine reads: a format and the host's queue size."""

    trtype: str = "pipe"
    recfmt: int = 0
    hsqsize: int = 0


def pipe_check_request(request: PipeConnectRequest, max_entries: int):
    """The pipe's own checks of its connection request: its format, and the queue size against the engine's."""
    if request.recfmt:
        return "recfmt"
    if request.hsqsize + 1 > max_entries:
        return "sqsize"
    return None


# ---------------------------------------------------------------------- the transport

class PipeFabric:
    """The event loop of the pipe transport: a queue of pending operations, run when the host polls."""

    def __init__(self, handler):
        self.handler = handler
        self.ops = deque()
        self.listeners = {}
        self.memory = {}  # key -> (addr, bytearray): the host's registered buffers
        self.next_key = 0x51

    def pump(self) -> None:
        while self.ops:
            self.ops.popleft()()

    def listen(self, address: str, handler) -> "PipeListener":
        listener = self.listeners[address] = PipeListener(self, address, handler)
        return listener


class PipeListener:
    def __init__(self, fabric: PipeFabric, address: str, handler):
        self.fabric, self.address, self.handler = fabric, address, handler

    def close(self) -> None:
        self.fabric.listeners.pop(self.address, None)


class PipeTargetQueue(TargetQueue):
    trtype = "pipe"
    in_capsule_size = 0  # no in-capsule data on this transport

    def __init__(self, listener: PipeListener, request: ConnectRequest, host: "PipeHostQueue"):
        self.listener, self.request, self.host = listener, request, host
        self.closing = self.closed = False

    def _bytes(self, desc: "PipeData", length: int) -> memoryview:
        base, buf = self.listener.fabric.memory[desc.key]
        return memoryview(buf)[desc.addr - base:desc.addr - base + length]

    def read_host(self, desc, length, done, tx=None) -> None:
        assert isinstance(desc, PipeData), f"the core hands back the pipe's own descriptor, got {desc!r}"

        def op():
            if not self.closed:
                done(memoryview(bytes(self._bytes(desc, length))), None)
        self.listener.fabric.ops.append(op)

    def complete(self, cqe, data=None, desc=None, tx=None, source=None) -> None:
        assert desc is None or isinstance(desc, PipeData), f"not the pipe's descriptor: {desc!r}"
        payload, cqe = (bytes(data) if data is not None else b""), bytes(cqe)
        assert not payload or desc is not None, "data for the host, and no descriptor of where it goes"

        def op():
            if not self.closed:
                if payload:
                    self._bytes(desc, len(payload))[:] = payload
                self.host.cqes.append(cqe)
        self.listener.fabric.ops.append(op)

    def close(self) -> None:
        """An orderly disconnect: what is already queued (the Disconnect's response) goes first."""
        if self.closing:
            return
        self.closing = True

        def op():
            self.closed = self.host.closed = True
            self.listener.handler.queue_closed(self)
        self.listener.fabric.ops.append(op)


class PipeHostQueue(HostQueue):
    def __init__(self, fabric: PipeFabric, qid: int, hsqsize: int):
        self.fabric, self.qid, self.crqsize = fabric, qid, hsqsize + 1
        self.cqes = deque()
        self.closed = False
        self.target = None

    def register(self, size: int) -> HostBuffer:
        key = self.fabric.next_key = self.fabric.next_key + 1
        addr = key << 32
        buf = bytearray(size)
        self.fabric.memory[key] = (addr, buf)
        return HostBuffer(addr, key, memoryview(buf))

    def send(self, capsule: bytes) -> None:
        if self.closed:
            raise TransportError(f"pipe queue {self.qid} is closed")
        capsule = bytes(capsule)
        self.fabric.ops.append(lambda: self.target.listener.handler.capsule_received(self.target,
                                                                                     memoryview(capsule)))

    def poll(self, timeout: float = 0.0) -> list:
        self.fabric.pump()
        out, self.cqes = list(self.cqes), deque()
        if not out and self.closed:
            raise TransportError(f"pipe queue {self.qid} is closed")
        return out

    def close(self) -> None:
        if self.target is not None:
            self.target.close()
        self.fabric.pump()


class PipeConnector(Connector):
    def __init__(self, fabric: PipeFabric, address: str):
        self.fabric, self.address = fabric, address

    def connect(self, qid, hrqsize, hsqsize, cntlid=0) -> PipeHostQueue:
        listener = self.fabric.listeners[self.address]
        request = PipeConnectRequest(qid=qid, hsqsize=hsqsize, peer="pipe-host:1")
        refusal = listener.handler.check_connect(request)
        if refusal is not None:
            raise ConnectRejected(PIPE.reject_status(refusal))
        host = PipeHostQueue(self.fabric, qid, hsqsize)
        host.target = PipeTargetQueue(listener, request, host)
        listener.handler.queue_opened(host.target)
        return host


@dataclass(frozen=True)
class PipeData:
    """The pipe's data descriptor of a command: which registered buffer, and where in it."""

    key: int
    addr: int


def pipe_map_sgl(req) -> int:
    """Keyed descriptors only (0x40, and 0x4F, whose invalidation the pipe does not do), as the pipe's own
    descriptor: the buffer's key and the address in it."""
    sgl = SglDescriptor.from_words(req.dptr1, req.dptr2)
    if sgl.type != TYPE_KEYED_DATA_BLOCK:
        return S.SGL_INVALID_TYPE | S.DNR
    if sgl.subtype not in (SUBTYPE_ADDRESS, SUBTYPE_INVALIDATE_KEY):
        return S.INVALID_FIELD | S.DNR
    req.transfer_len = sgl.length
    req.desc = PipeData(sgl.key, sgl.addr)
    return 0


PIPE = registry.TransportOps(
    trtype="pipe", description="the unit tests' tiny in-process transport",
    sgls=lambda in_capsule_size: I.SGLS_SUPPORTED | I.SGLS_KEYED,  # keyed only: no in-capsule data
    map_sgl=pipe_map_sgl, check_request=pipe_check_request,
    reject_status=PIPE_REJECT.__getitem__, event_loop=PipeFabric,
    listen=lambda loop, port, handler, options: loop.listen(f"{port.traddr}:{port.trsvcid}", handler),
    served_by_target=False)


# ---------------------------------------------------------------------- the tests

@pytest.fixture
def pipe():
    """A target on the pipe transport, built as the service builds one: the entry's event loop and listener."""
    registry.register(PIPE)
    config = parse_config({
        "hosts": [{"nqn": HOST}],
        "ports": [{"portid": 1, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": "10.9.9.9", "trsvcid": "4420"},
                   "subsystems": [SUB]}],
        "subsystems": [{"nqn": SUB, "namespaces": [{"nsid": 1, "nvmeof_roce": {"backend": "ram", "size": "1M",
                                                                               "block_size": 512}}]}]},
        "pipe-test")
    target = Target(config)
    ops = registry.get("pipe")
    loop = ops.event_loop(target)
    port = config.ports[0]
    listener = ops.listen(loop, port, target.port(port.portid), registry.ListenOptions())
    try:
        yield target, loop, PipeConnector(loop, "10.9.9.9:4420")
    finally:
        listener.close()
        target.close()
        registry.unregister("pipe")


def test_the_full_command_set_runs_through_the_core_on_a_third_transport(pipe):
    target, loop, connector = pipe
    ctrl = Controller.connect(connector, SUB, hostnqn=HOST, num_io_queues=1, timeout=2.0)
    # every queue the core holds runs on the pipe's entry
    assert {qs.ops.trtype for qs in target.queue_states()} == {"pipe"}
    # Identify follows the entry's flags: keyed SGLs, no in-capsule data (so the host sends none)
    idc = ctrl.identify_controller()
    assert idc.sgls & I.SGLS_KEYED and not idc.sgls & I.SGLS_OFFSET
    assert ctrl.identify_namespace(1).nsze == 2048
    # properties
    assert ctrl.property_get(F.PROP_CSTS) & F.CSTS_RDY
    assert ctrl.property_get(F.PROP_CAP, size8=True) == target.controllers()[0].cap
    # I/O: write, read back, flush, write zeroes, deallocate
    data = bytes(range(256)) * 8
    ctrl.write(1, 10, data)
    assert ctrl.read(1, 10, 4) == data
    ctrl.flush(1)
    ctrl.write_zeroes(1, 10, 2)
    assert ctrl.read(1, 10, 4) == bytes(1024) + data[1024:]
    ctrl.dsm_deallocate(1, [(12, 2)])
    assert ctrl.read(1, 10, 4) == bytes(2048)
    ctrl.keep_alive()
    # Disconnect of the I/O queue: answered, then the queue closes and leaves its controller
    q = ctrl.io_queues[0]
    ctrl._sync(q, F.DisconnectCommand().to_sqe(), name="Disconnect")
    loop.pump()
    assert not target.controllers()[0].io_queues
    ctrl.io_queues = []
    ctrl.close()  # CC.SHN, CSTS.SHST complete, admin queue closed
    loop.pump()
    assert target.queue_count() == 0
    assert target.internal_errors == 0


def test_a_refused_queue_is_worded_by_the_transport(pipe):
    _target, _loop, connector = pipe
    with pytest.raises(ConnectRejected) as exc:
        connector.connect(0, 64, 63)  # an admin queue deeper than 32
    assert exc.value.status == PIPE_REJECT["sqsize"]


def test_the_core_maps_sgls_with_the_transport_entry(pipe):
    """An in-capsule data descriptor, which RDMA takes (or refuses as too long: SGL Offset Invalid), is an SGL
    type the pipe does not have: the core asked the queue's entry."""
    target, _loop, connector = pipe
    ctrl = Controller.connect(connector, SUB, hostnqn=HOST, num_io_queues=1, timeout=2.0)
    host = ctrl.io_queues[0].transport
    capsule = bytearray(SQE(opc=NVM_WRITE, nsid=1, cid=0xEE7, cdw12=0).pack()) + bytes(512)
    capsule[24 + 8:24 + 12] = (512).to_bytes(4, "little")  # SGL length
    capsule[24 + 15] = 0x01  # SGL identifier: data block, offset subtype (in-capsule data)
    host.send(bytes(capsule))
    cqe = CQE.unpack(host.poll(0)[0])
    assert cqe.cid == 0xEE7 and cqe.status == S.SGL_INVALID_TYPE | S.DNR
    ctrl.close()
    assert target.internal_errors == 0
