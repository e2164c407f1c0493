"""transport/rdma/native.py NativePortMemory: the port's native memory, and the bounce memory closed queues give
back for the next one (registering it anew holds the event loop)."""
import mmap
from types import SimpleNamespace

from nvmeof_roce.transport.rdma import native as rdma_native
from nvmeof_roce.transport.rdma.native import NativePortMemory


class FakeModule:
    """reg_mr / dereg_mr of the native module, counting what is registered."""

    def __init__(self):
        self.next = 1
        self.live = set()
        self.registered = 0

    def reg_mr(self, pd, addr, length, access):
        mr, self.next = self.next, self.next + 1
        self.live.add(mr)
        self.registered += 1
        return mr, 1000 + mr, 2000 + mr

    def dereg_mr(self, mr):
        self.live.remove(mr)


def port_memory(module):
    data = mmap.mmap(-1, 4 * 4096)
    pool = SimpleNamespace(chunk_size=4096, accounts=SimpleNamespace(total=4),
                           memory=SimpleNamespace(addr=rdma_native._address(data), view=memoryview(data)))
    return NativePortMemory(module, SimpleNamespace(pool=pool, max_transfer=4096), pd=7)


def test_a_closed_queues_bounce_memory_serves_the_next_queue_without_registering_again():
    module = FakeModule()
    memory = port_memory(module)
    base = module.registered  # the data pool, the zero and sink buffers
    first = memory.take_bounce(8 * 4096)
    assert module.registered == base + 1 and first.region.addr % 4096 == 0 and first.region.length == 8 * 4096
    memory.give_back_bounce(first)
    again = memory.take_bounce(8 * 4096)
    assert again is first and module.registered == base + 1  # no registration: the loop is not held
    other = memory.take_bounce(16 * 4096)  # another size (another queue depth): its own
    assert other is not first and module.registered == base + 2
    memory.give_back_bounce(again)
    memory.give_back_bounce(other)
    memory.close()  # every spare deregistered with the port's own memory
    assert module.live == set()


def test_spare_bounce_memory_is_bounded_and_let_go_after_the_port_closed(monkeypatch):
    monkeypatch.setattr(rdma_native, "SPARE_BOUNCE", 2)
    module = FakeModule()
    memory = port_memory(module)
    taken = [memory.take_bounce(4096) for _ in range(3)]
    for bounce in taken:
        memory.give_back_bounce(bounce)
    assert len(memory.spare_bounce[4096]) == 2 and taken[2].mr not in module.live  # the third let go at once
    late = memory.take_bounce(4096)
    memory.close()
    memory.give_back_bounce(late)  # a queue closing after its port: deregistered, not kept
    assert module.live == set() and memory.spare_bounce == {}
