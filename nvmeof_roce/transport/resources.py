"""What the target commits to its queues: the shared data-buffer pool and the queue limits.

Plain Python, no device: the RDMA transport carves these buffer numbers out of one
registered region, the target core asks `ResourceLimits` how many I/O queues it may
grant, and unit tests drive both directly.

The pool (one per listening port) is shared by all of that port's queues.  A queue
gets a small guaranteed minimum once its NVMe Connect succeeds (so a busy neighbour
can delay it but never starve it); anything beyond comes from the shared rest, first
come first served, and a command that finds nothing free waits for a buffer (its
RDMA READ, or its data and response).  Before Connect a queue holds at most one
buffer (the RDMA READ of the Connect data) and is guaranteed nothing, so idle or
refused connections cannot take buffers from connected hosts.

No holder ever waits for a second buffer while keeping the first (a READ ends and
returns its buffer before the command's response needs one), so waiting cannot
deadlock: the guarantee is about fairness, not progress.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, List, Optional

from ..errors import NvmeofError
from ..tunables import RESOURCE_LIMITS as _LIMITS

PRE_CONNECT_BUFFERS = 1  # a queue without a successful Connect: the Connect data's RDMA READ only
# MDTS in units of the 4 KiB minimum page size (docs/protocol.md §3.4): 2^5 x 4 KiB = 128 KiB per command, SPDK's
# default; nvmet-rdma's is 8 (1 MiB). Each data buffer is one command's largest transfer.
DEFAULT_MDTS = _LIMITS["mdts"].default
MAX_MDTS = _LIMITS["mdts"].high


@dataclass(frozen=True)
class ResourceLimits:
    """The target's resource settings (`target serve` options; docs/target.md "Resources").

    Sized for the field: 64 hosts with up to 128 CPUs each.  A host asks for one I/O
    queue per CPU; the grant is capped by these and by what the pool can still
    guarantee, and the Linux host then spreads its CPUs over the queues it got.
    """

    # Defaults and ranges are the tunables' (nvmeof_roce/tunables.py RESOURCE_LIMITS), declared once there.
    data_buffers: int = _LIMITS["data_buffers"].default  # per port, each MDTS bytes: 128 MiB registered per port
    queue_min_buffers: int = _LIMITS["queue_min_buffers"].default  # guaranteed to each connected queue
    max_queues_per_ctrl: int = _LIMITS["max_queues_per_ctrl"].default  # the Number of Queues grant's cap
    max_queues_per_host: int = _LIMITS["max_queues_per_host"].default  # over all of one host NQN's controllers
    max_controllers: int = _LIMITS["max_controllers"].default  # I/O controllers (other caps: engine/limits.py)
    max_connecting_per_address: int = _LIMITS["max_connecting_per_address"].default  # 0: max_queues_per_host + 1
    connect_timeout: float = _LIMITS["connect_timeout"].default  # seconds without a successful NVMe Connect
    queue_file_buffers: int = _LIMITS["queue_file_buffers"].default  # native queues' bounce chunks (files, blocks)
    mdts: int = _LIMITS["mdts"].default  # largest command: 4 KiB << mdts, the size of each data buffer

    def __post_init__(self):
        for tunable in _LIMITS.values():
            tunable.check_option(getattr(self, tunable.name))
        if self.queue_min_buffers * 2 > self.data_buffers:
            raise NvmeofError(f"--queue-min-buffers {self.queue_min_buffers} with --data-buffers "
                              f"{self.data_buffers}: not even two queues could be guaranteed their minimum",
                              "lower --queue-min-buffers or raise --data-buffers")

    @property
    def connecting_per_address(self) -> int:
        """Connections one peer address may hold before their NVMe Connect: the option, or by default what one
        host opens (an admin queue and --max-queues-per-host I/O queues: nvme-rdma connects every CM first)."""
        return self.max_connecting_per_address or self.max_queues_per_host + 1

    @property
    def max_transfer(self) -> int:
        """Bytes of the largest command (MDTS), the size of each data buffer."""
        return 4096 << self.mdts

    def describe(self) -> str:
        return (f"{self.data_buffers} data buffers per port, {self.max_transfer >> 10} KiB each "
                f"({self.queue_min_buffers} guaranteed per queue), "
                f"at most {self.max_queues_per_ctrl} I/O queues per controller and {self.max_queues_per_host} "
                f"per host, {self.max_controllers} controllers, NVMe Connect within {self.connect_timeout:g} s")

    def io_queue_grant(self, requested: int, subsystem_max: int, host_queues_elsewhere: int,
                       pool_capacity: Optional[int]) -> int:
        """How many I/O queues (1's based) Set Features Number of Queues grants.

        `host_queues_elsewhere`: I/O queues the host holds on its other controllers;
        `pool_capacity`: how many more queues the port's pool can guarantee (None: no pool).
        Never below 1: the grant is 0's based, so 1 is the least it can say.
        """
        cap = min(requested, subsystem_max, self.max_queues_per_ctrl,
                  self.max_queues_per_host - host_queues_elsewhere)
        if pool_capacity is not None:
            cap = min(cap, pool_capacity)
        return max(1, cap)


class PoolShare:
    """One queue's account with a `BufferPool`."""

    __slots__ = ("pool", "guaranteed", "in_use", "limit", "wake", "closed")

    def __init__(self, pool: "BufferPool", wake: Optional[Callable[[], None]] = None):
        self.pool = pool
        self.guaranteed = 0
        self.in_use = 0
        self.limit: Optional[int] = PRE_CONNECT_BUFFERS
        self.wake = wake  # called when buffers this queue waited for may be free
        self.closed = False

    def commit(self) -> bool:
        """The queue's NVMe Connect succeeded: guarantee it the minimum, lift the pre-Connect limit.
        False (and nothing changes) when the pool cannot guarantee the minimum any more."""
        return self.pool._commit(self)

    def take(self, count: int = 1) -> Optional[List[int]]:
        """`count` buffers at once, or None (then the queue waits and is woken by `wake`)."""
        return self.pool._take(self, count)

    def give(self, buffers: List[int]) -> None:
        self.pool._give(self, buffers)

    def close(self) -> None:
        """The queue is gone: its guarantee returns to the pool (its buffers come back through `give`)."""
        self.pool._close(self)


class BufferPool:
    """Buffer numbers 0..total-1 and who may take them."""

    def __init__(self, total: int, min_per_queue: int):
        self.total = total
        self.min_per_queue = min_per_queue
        self.free: List[int] = list(range(total))
        self.committed = 0  # sum of the guarantees of open queues
        self.reserved_unused = 0  # guaranteed but not in use: the shared part may not hand these out
        self.shares = 0  # open queues (connected or not)
        self.waiting: "OrderedDict[PoolShare, None]" = OrderedDict()

    # -- figures
    @property
    def free_count(self) -> int:
        return len(self.free)

    @property
    def shared_free(self) -> int:
        return len(self.free) - self.reserved_unused

    def guarantee_capacity(self) -> int:
        """How many more queues could be guaranteed their minimum now."""
        return max(0, (self.total - self.committed) // self.min_per_queue)

    def status(self) -> str:
        return (f"{self.free_count}/{self.total} free, {self.committed} guaranteed to queues, "
                f"{len(self.waiting)} queues waiting")

    def figures(self) -> dict:
        """What `target status` shows of the pool (a listener's "pool")."""
        return {"chunks": self.total, "free": self.free_count, "in_use": self.total - self.free_count,
                "guaranteed": self.committed}

    # -- shares
    def share(self, wake: Optional[Callable[[], None]] = None) -> PoolShare:
        self.shares += 1
        return PoolShare(self, wake)

    def _unused(self, share: PoolShare) -> int:
        return max(0, share.guaranteed - share.in_use)

    def _commit(self, share: PoolShare) -> bool:
        if share.closed:
            return False
        if share.guaranteed:
            return True
        if self.total - self.committed < self.min_per_queue:
            return False
        before = self._unused(share)
        share.guaranteed = self.min_per_queue
        share.limit = None
        self.committed += share.guaranteed
        self.reserved_unused += self._unused(share) - before
        return True

    def _take(self, share: PoolShare, count: int) -> Optional[List[int]]:
        if share.closed or count <= 0:
            return [] if count == 0 else None
        if share.limit is not None and share.in_use + count > share.limit:
            return None
        own = min(count, self._unused(share))  # from the queue's guarantee first
        if count - own > self.shared_free:
            self.waiting[share] = None
            return None
        taken, self.free = self.free[-count:], self.free[:-count]
        share.in_use += count
        self.reserved_unused -= own
        self.waiting.pop(share, None)
        return taken

    def _give(self, share: PoolShare, buffers: List[int]) -> None:
        if not buffers:
            return
        before = self._unused(share)
        share.in_use -= len(buffers)
        self.free.extend(buffers)
        if not share.closed:
            self.reserved_unused += self._unused(share) - before
        if self.waiting and self.shared_free > 0:
            self._wake_waiters()

    def _close(self, share: PoolShare) -> None:
        if share.closed:
            return
        self.reserved_unused -= self._unused(share)
        self.committed -= share.guaranteed
        share.closed = True
        share.guaranteed = 0
        self.shares -= 1
        self.waiting.pop(share, None)
        if self.waiting and self.shared_free > 0:
            self._wake_waiters()

    def _wake_waiters(self) -> None:
        # Oldest waiter first; each takes what it needs inside wake() and leaves the list if it got it.
        for share in list(self.waiting):
            if self.shared_free <= 0:
                return
            self.waiting.pop(share, None)
            if share.wake is not None and not share.closed:
                share.wake()


def registered_region(regions: dict, backend, register: Callable, release: Callable) -> Optional[tuple]:
    """(addr, lkey) of a RAM namespace's memory registered with a device, or None where it cannot be: the one
    cache both RDMA listeners (transport/rdma/cm.py, transport/rdma/native.py) keep, one entry per backend.

    A backend whose memory changed (a resize) is registered anew and its old registration released: the engine
    commits a resize only once the namespace's commands drained (the pause, engine/api.py), so no work request
    still uses the old one, and the old memory is not kept pinned (repeated resizes leave memory flat).  The
    registrations of closed backends (removed namespaces, drained the same way) are released here too.
    `register(pin, mapping)` pins the memory and registers it, and returns (the pinned mapping, or `mapping`
    when pinning failed; (addr, lkey) or None; what to keep with it, given to `release` when it goes); the
    cache holds {id(backend): (backend, mapping, found, kept)}."""
    for key, (other, _mapping, _found, kept) in list(regions.items()):
        if other is not backend and getattr(other, "closed", False):
            del regions[key]
            release(kept)
    pin = getattr(backend, "pin", None)
    if pin is None:
        return None
    mapping = backend.buffer.obj if backend.buffer is not None else None
    entry = regions.get(id(backend))
    if entry is not None and entry[0] is backend:
        if entry[1] is mapping:
            return entry[2]
        del regions[id(backend)]
        release(entry[3])
    mapping, found, kept = register(pin, mapping)
    regions[id(backend)] = (backend, mapping, found, kept)
    return found
