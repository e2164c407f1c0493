"""The initiator's queues and what they give back: `SlotQueue`, the host's side of one NVMe queue (its command
slots, their CIDs and registered buffers), `Completion`, one finished command, and the host's errors.
initiator/controller.py drives them over a transport's HostQueue."""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

from ..errors import NvmeofError
from ..nvme import status as S
from ..nvme.sgl import ID_KEYED
from ..nvme.status import NvmeStatusError
from ..transport.contracts import HostQueue


class HostError(NvmeofError):
    """The initiator cannot continue: a protocol violation by the target, a timeout, a bad argument."""


class CommandTimeout(HostError):
    pass


class QueueFull(HostError):
    """No free command slot on the queue (only raised when submitting with block=False)."""


# ---------------------------------------------------------------------- completions and queues

class Completion:
    """One finished command.  For asynchronous reads `data` is a view valid only during the callback."""

    __slots__ = ("qid", "cid", "status", "result", "dw1", "data", "name")

    def __init__(self, qid: int, cid: int, status: int, result: int, dw1: int, data, name: str):
        self.qid = qid
        self.cid = cid
        self.status = status
        self.result = result
        self.dw1 = dw1
        self.data = data
        self.name = name

    @property
    def ok(self) -> bool:
        return self.status == 0

    @property
    def status_name(self) -> str:
        return S.status_name(self.status)

    @property
    def result64(self) -> int:
        return self.result | (self.dw1 << 32)

    def raise_for_status(self) -> "Completion":
        if self.status:
            raise NvmeStatusError(self.status, self.name, self.result)
        return self

    def __repr__(self) -> str:
        return f"<Completion {self.name} qid={self.qid} cid={self.cid:#x} {S.describe(self.status)}>"


MAX_SLOTS = 1 << 12  # a CID is the slot in its low 12 bits and a 4-bit generation above them


class SlotQueue:
    """The host's side of one NVMe queue: a preallocated table of command slots, each with a slice of one
    registered buffer.  A command's CID is (generation << 12) | slot, so a completion finds its slot without a
    lookup and a stale or forged CID is recognised (its slot is free or carries another generation).  Nothing
    is allocated per command: the per-slot fields are lists indexed by slot."""

    def __init__(self, transport: HostQueue, qid: int, depth: int, slot_size: int, in_capsule_max: int):
        if not 0 < depth <= MAX_SLOTS:
            raise HostError(f"queue {qid}: {depth} command slots; the CID layout allows 1 to {MAX_SLOTS}")
        self.transport = transport
        # a host queue that does not derive from HostQueue may lack these (they are optional there)
        self.defer_sends = getattr(transport, "defer_sends", None)
        self.flush = getattr(transport, "flush", None)
        self.qid = qid
        self.depth = depth
        self.slot_size = slot_size
        self.in_capsule_max = in_capsule_max
        self.memory = transport.register(depth * slot_size)  # registered once, sliced per command
        self.keyed_word = (self.memory.key << 24) | (ID_KEYED << 56)  # a keyed SGL's word, less its length
        self.slot_addrs = [self.memory.addr + slot * slot_size for slot in range(depth)]
        self.free: List[int] = list(range(depth - 1, -1, -1))
        self.generation = [0] * depth
        self.cids = [-1] * depth  # the CID a busy slot's command carries; -1 when free
        self.callbacks: List[Optional[Callable]] = [None] * depth
        self.tags: List[Optional[int]] = [None] * depth  # a tagged command's tag (None: a Completion callback)
        self.data_lens = [0] * depth
        self.names = [""] * depth
        self.bigs: list = [None] * depth  # the big buffer a command's data uses instead of its slot
        self.big = None  # a larger registration for the occasional big synchronous transfer
        self.dead: Optional[str] = None

    @property
    def outstanding(self) -> int:
        return self.depth - len(self.free)

    def take(self) -> Tuple[int, int]:
        """A free slot and the CID of the command that gets it (raises IndexError when none is free)."""
        slot = self.free.pop()
        gen = self.generation[slot] = (self.generation[slot] + 1) & 0xF
        cid = self.cids[slot] = (gen << 12) | slot
        return slot, cid

    def slot_of(self, cid: int) -> int:
        """The slot of the outstanding command `cid`, or -1 if no such command is outstanding."""
        slot = cid & 0xFFF
        return slot if slot < self.depth and self.cids[slot] == cid else -1

    def release(self, slot: int) -> None:
        self.cids[slot] = -1
        self.callbacks[slot] = self.bigs[slot] = None
        self.free.append(slot)

    def release_all(self) -> None:
        for slot in range(self.depth):
            if self.cids[slot] != -1:
                self.release(slot)

    def slot_addr(self, slot: int) -> int:
        return self.slot_addrs[slot]

    def slot_view(self, slot: int) -> memoryview:
        start = slot * self.slot_size
        return self.memory.view[start:start + self.slot_size]

    def big_buffer(self, size: int):
        if self.big is None or len(self.big.view) < size:
            self.big = self.transport.register(max(size, 2 * self.slot_size))
        return self.big
