"""Live changes under the native data path (docs/native.md, "Live changes"): a namespace change waits until the
native commands of that namespace from before are gone (the engine's fence), a namespace's identity in the view is
a generation, the old memory of a resized RAM namespace and its registration go once drained.

The window is opened with what the C queue has: with one RDMA READ credit (`max_reads=1`) and two Writes, the
second waits for the first's READ to complete, holding its destination in the namespace's memory meanwhile."""
import json
import mmap
import os
import socket
import tempfile
from types import SimpleNamespace

import pytest

from loopback_env import SUB_RAM, standard_config
from native_diff import NativeEndpoint, io_capsule, pattern
from native_fake import needs_native
from nvmeof_roce.config import parse_config
from nvmeof_roce.control import live
from nvmeof_roce.control.methods import Control
from nvmeof_roce.control.server import RpcServer
from nvmeof_roce.engine import fast_path_view
from nvmeof_roce.engine.subsystem import NamespaceState
from nvmeof_roce.transport.rdma import native as rdma_native
from nvmeof_roce.transport.rdma.native import NativePortMemory

pytestmark = needs_native

READ, WRITE = 0x02, 0x01
INVALID_NS = 0x400B


class FakeRegistrations:
    """reg_mr / dereg_mr of the native module on the fake provider: registered with the fake device, counted."""

    def __init__(self, device):
        self.device = device
        self.next = 1
        self.live = {}  # mr -> (addr, length)

    def reg_mr(self, pd, addr, length, access):
        mr, self.next = self.next, self.next + 1
        lkey = self.device.lib.fakehost_reg_local(self.device.dev, addr, length)
        self.live[mr] = (addr, length)
        return mr, lkey, lkey

    def dereg_mr(self, mr):
        del self.live[mr]


class Endpoint(NativeEndpoint):
    """A native queue whose RAM namespaces are registered by the port's own memory (transport/rdma/native.py)."""

    def __init__(self, max_reads: int = 1):
        self.port_memory = None
        super().__init__(standard_config(), SUB_RAM, max_reads=max_reads, region_of=self.port_region)

    def port_region(self, backend):
        if self.port_memory is None:
            self.registrations = FakeRegistrations(self.device)
            data = mmap.mmap(-1, 4 * 4096)
            self._pool = data
            pool = SimpleNamespace(chunk_size=4096, accounts=SimpleNamespace(total=4),
                                   memory=SimpleNamespace(addr=rdma_native._address(data), view=memoryview(data)))
            self.port_memory = NativePortMemory(self.registrations, SimpleNamespace(pool=pool, max_transfer=4096),
                                                pd=7)
        return self.port_memory.region(backend)

    def ram_registrations(self) -> int:
        """Registrations of RAM namespaces the port holds (its own pool, zero and sink buffers are 3)."""
        return len(self.registrations.live) - 3


@pytest.fixture
def ep():
    endpoint = Endpoint()
    yield endpoint
    endpoint.close()


def responses(ep) -> list:
    return [cqe for cqe, _invalidated in ep.device.responses()]


def status_of(cqe: bytes) -> int:
    return int.from_bytes(cqe[14:16], "little") >> 1


def cid_of(cqe: bytes) -> int:
    return int.from_bytes(cqe[12:14], "little")


def with_size(target, nsid: int, size: str):
    data = target.config.to_dict()
    for s in data["subsystems"]:
        if s["nqn"] == SUB_RAM:
            for n in s["namespaces"]:
                if int(str(n["nsid"]), 0) == nsid:
                    n["nvmeof_roce"]["size"] = size
    return parse_config(data, "test")


def two_writes_one_waiting(ep, a: bytes, b: bytes) -> None:
    """Write `a` at LBA 0 and `b` at LBA 8 of namespace 1; after one poll the first's READ is done on the wire and
    the second waits for the READ credit, its destination taken in the namespace's memory."""
    ep.buf.view[0:4096] = a
    ep.buf.view[4096:8192] = b
    assert ep.device.deliver(io_capsule(ep, WRITE, 1, 0, 7, 4096, offset=0, cid=1)) == 0
    assert ep.device.deliver(io_capsule(ep, WRITE, 1, 8, 7, 4096, offset=4096, cid=2)) == 0
    ep.queue.poll()
    assert ep.queue.stats()["native_in_flight"] == 2 and ep.device.responses() == []


def read_back(ep, nsid: int, slba: int, length: int) -> bytes:
    """A native Read into the host's buffer (at 64 KiB), answered success."""
    (cqe,) = ep.exchange(io_capsule(ep, READ, nsid, slba, length // 512 - 1, length, offset=65536, cid=9))
    assert status_of(cqe) == 0
    return ep.host_bytes()[65536:65536 + length]


def test_a_write_waiting_for_its_read_when_a_resize_is_applied_lands_in_the_resized_namespace(ep):
    target = ep.env.target
    a, b = pattern(4096, seed=11), pattern(4096, seed=12)
    two_writes_one_waiting(ep, a, b)
    live.apply(target, with_size(target, 1, "4M"))
    ep.settle()
    cqes = responses(ep)
    assert sorted((cid_of(c), status_of(c)) for c in cqes) == [(1, 0), (2, 0)]
    ns = target.subsystem(SUB_RAM).namespaces[1]
    assert ns.num_blocks == (4 << 20) // 512  # the resize was made
    assert ep.namespace_bytes(SUB_RAM, 1)[:8192] == a + b
    assert read_back(ep, 1, 0, 8192) == a + b  # as the host sees it afterwards, through the resized memory


def test_the_resize_is_committed_once_the_native_commands_drained_and_new_ones_wait_for_it(ep):
    target = ep.env.target
    a, b = pattern(4096, seed=21), pattern(4096, seed=22)
    two_writes_one_waiting(ep, a, b)
    live.apply(target, with_size(target, 1, "4M"))
    ns = target.subsystem(SUB_RAM).namespaces[1]
    assert ns.num_blocks == (2 << 20) // 512  # two Writes in flight: not yet
    assert ns.state is NamespaceState.PAUSED
    # a Read arriving meanwhile is not served natively: the core holds it until the resume
    python_before = ep.queue.stats()["python_commands"]
    assert ep.device.deliver(io_capsule(ep, READ, 1, 0, 15, 8192, offset=65536, cid=3)) == 0
    ep.settle()
    assert ns.num_blocks == (4 << 20) // 512
    assert ep.queue.stats()["python_commands"] == python_before + 1
    cqes = responses(ep)
    assert sorted((cid_of(c), status_of(c)) for c in cqes) == [(1, 0), (2, 0), (3, 0)]
    assert ep.host_bytes()[65536:65536 + 8192] == a + b
    assert ns.state is NamespaceState.ACTIVE


def test_a_namespace_removed_and_added_again_at_its_nsid_does_not_take_a_write_in_flight(ep, monkeypatch):
    """The view's identity of a namespace is its generation, not its address: CPython gives a freed object's
    address to the next one, modelled here by an `id` that answers the same for both namespaces."""
    monkeypatch.setattr(fast_path_view, "id", lambda obj: 0x5EED, raising=False)
    target = ep.env.target
    fast_path_view.refresh_all(target)
    a, b = pattern(4096, seed=31), pattern(4096, seed=32)
    old = target.subsystem(SUB_RAM).namespaces[1]
    old_memory = old.backend.buffer[0:16384]  # the old memory stays mapped: the device may still reach it
    two_writes_one_waiting(ep, a, b)
    config = target.config.subsystem(SUB_RAM).namespace(1)
    target.retire_namespace(SUB_RAM, 1)  # the verbs, without a pause: nothing else fences the Writes
    target.install_namespace(SUB_RAM, target.prepare_namespace(SUB_RAM, config))
    target.namespace_changed(SUB_RAM, 1)
    ep.settle()
    cqes = {cid_of(c): status_of(c) for c in responses(ep) if cid_of(c) in (1, 2)}
    assert cqes == {1: INVALID_NS, 2: INVALID_NS}  # neither succeeded into the old memory
    assert ep.namespace_bytes(SUB_RAM, 1)[:8192] == bytes(8192)
    assert bytes(old_memory[4096:8192]) != b  # the waiting one's READ was not even posted
    old_memory.release()


def test_repeated_resizes_release_the_old_memorys_registration(ep):
    target = ep.env.target
    data = pattern(4096, seed=41)
    ep.buf.view[0:4096] = data
    (cqe,) = ep.exchange(io_capsule(ep, WRITE, 1, 0, 7, 4096, offset=0, cid=1))
    assert status_of(cqe) == 0
    registrations = ep.ram_registrations()  # namespaces 1 and 2
    for size in ("3M", "4M", "1M", "2M", "4M", "3M"):
        live.apply(target, with_size(target, 1, size))
        ep.settle()
        assert read_back(ep, 1, 0, 4096) == data  # served natively, from the new memory
        assert ep.ram_registrations() == registrations, size
        assert len(ep.port_memory.regions) == registrations


def test_commands_that_do_not_come_back_within_the_bound_get_their_queue_torn_down_and_the_change_goes_on(ep, caplog):
    """The drain_timeout bound: the queue whose commands hold the namespace is torn down (its QP in error, its work
    requests flushed: nothing of them lands), which lets go of their references; the change commits.  The host
    reconnects and retries the Writes, which were never answered."""
    target = ep.env.target
    a, b = pattern(4096, seed=51), pattern(4096, seed=52)
    two_writes_one_waiting(ep, a, b)
    applying = live.Applying()
    live.apply(target, with_size(target, 1, "4M"), applying=applying)
    assert not applying.done
    ep.env.clock.advance(target.config.settings.drain_timeout + 1)
    target.tick(ep.env.clock())
    assert applying.done and applying.error is None
    assert ep.queue.closed and "did not complete within" in caplog.text
    ns = target.subsystem(SUB_RAM).namespaces[1]
    assert ns.num_blocks == (4 << 20) // 512 and ns.state is NamespaceState.ACTIVE
    assert responses(ep) == []  # flushed: neither Write was answered, so the host retries both
    assert ep.namespace_bytes(SUB_RAM, 1)[:8192] == bytes(8192)  # and neither landed


class Loop:
    """The event loop's watch / unwatch, served by hand."""

    def __init__(self):
        self.fds = {}

    def watch(self, fd, callback):
        self.fds[fd] = callback

    def unwatch(self, fd):
        self.fds.pop(fd, None)

    def run(self):
        for _ in range(3):
            for callback in list(self.fds.values()):
                callback()


def test_the_control_socket_answers_a_resize_once_it_is_committed(ep):
    target = ep.env.target
    loop = Loop()
    directory = tempfile.mkdtemp()  # a socket path is short
    server = RpcServer(Control(target), os.path.join(directory, "c.sock"), loop)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(server.path)
        client.setblocking(False)
        two_writes_one_waiting(ep, pattern(4096, seed=61), pattern(4096, seed=62))
        client.sendall(json.dumps({"jsonrpc": "2.0", "id": 5, "method": "nvmf_subsystem_resize_ns",
                                   "params": {"nqn": SUB_RAM, "nsid": 1, "size": "4M"}}).encode() + b"\n")
        loop.run()
        with pytest.raises(BlockingIOError):  # two Writes in flight: not answered yet
            client.recv(65536)
        ep.settle()
        blocks = (4 << 20) // 512
        assert json.loads(client.recv(65536)) == {"jsonrpc": "2.0", "id": 5, "result": {
            "nsid": 1, "size_bytes": blocks * 512, "blocks": blocks}}
        assert target.subsystem(SUB_RAM).namespaces[1].num_blocks == blocks
    finally:
        client.close()
        server.close()
        os.rmdir(directory)
