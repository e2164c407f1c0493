"""The queue contract every transport implements (loopback, RDMA; transport/registry.py lists them).

One NVMe queue (admin or I/O) is one reliable connection.  The target sees a
`TargetQueue`; the host (initiator) sees a `HostQueue`.  Both are driven by a
single-threaded event loop: no call here blocks, results arrive as callbacks
(target) or through `poll()` (host).

Data movement follows RDMA's rules: the host registers memory and advertises
(addr, key, length) in a keyed SGL; the *target* moves the data with
`read_host` (RDMA READ) and `complete` (RDMA WRITE, then the response SEND).  A bad key, an
out-of-bounds range or a missing access right is a `RemoteAccessError`, and on
RDMA it also kills the connection (the QP goes to the error state).
"""
from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Callable, Optional, Protocol


class TransportError(Exception):
    """A transfer or connection failed (the queue is, or will be, torn down)."""


class RemoteAccessError(TransportError):
    """The peer's memory could not be accessed: unknown key, out of bounds, or no access right."""


class ConnectRejected(TransportError):
    """The target rejected the connection with an NVMe-oF RDMA CM reject status (STS)."""

    def __init__(self, status: int, message: str = ""):
        super().__init__(message or f"connection rejected by the target: CM reject status {status}")
        self.status = status


class Refusal(enum.Enum):
    """Why the target refuses to open a queue, in no transport's words: each transport says it on its wire
    (transport/registry.py `TransportOps.reject_status`; RDMA: the CM reject STS of nvme/cm.py)."""

    INVALID_RECFMT = "invalid_recfmt"
    INVALID_QID = "invalid_qid"
    INVALID_HSQSIZE = "invalid_hsqsize"
    INVALID_HRQSIZE = "invalid_hrqsize"
    NO_RESOURCES = "no_resources"


@dataclass(frozen=True)
class ConnectRequest:
    """What the host asked for when it opened a queue (the RDMA CM private data)."""

    recfmt: int
    qid: int
    hrqsize: int  # host receive queue size, 1's based
    hsqsize: int  # host send queue size, 0's based
    cntlid: int  # controller ID for I/O queues on recent kernels, else 0
    peer: str = ""  # the host's "address:port" ("[address]:port" for IPv6), for logs and per-address limits
    port_id: int = 0  # the config port (portid) whose listener accepted it
    trtype: str = "rdma"  # the transport it came on (its transport/registry.py entry)

    @property
    def peer_address(self) -> str:
        """The host's address without the port ("" when the transport does not know it)."""
        return self.peer.rsplit(":", 1)[0] if ":" in self.peer else self.peer


# Completion callback for RDMA READ: data is valid only during the call.
ReadDone = Callable[[Optional[memoryview], Optional[TransportError]], None]


class TargetQueue(abc.ABC):
    """The target's end of one NVMe queue."""

    trtype = "rdma"  # its transport's registry entry (transport/registry.py): the core asks it how to map SGLs
    request: ConnectRequest
    in_capsule_size: int  # bytes of in-capsule data accepted after the 64-byte SQE (0 on admin queues)
    local_address = ""  # the address the host connected to, where the transport knows it (discovery log entries)

    @property
    def qid(self) -> int:
        return self.request.qid

    @abc.abstractmethod
    def read_host(self, addr: int, key: int, length: int, done: ReadDone, tx=None) -> None:
        """RDMA READ `length` bytes of host memory; `done(data, None)` or `done(None, error)` later.
        `tx`: the transport's request handed over with the capsule (capsule_received), if any."""

    @abc.abstractmethod
    def complete(self, cqe: bytes, data=None, addr: int = 0, key: int = 0, invalidate_key: Optional[int] = None,
                 tx=None, source=None) -> None:
        """The end of a command in one call: RDMA WRITE `data` (if any; only borrowed for this call) to
        (addr, key), ordered before the SEND of the 16-byte CQE, with remote invalidation of `invalidate_key`
        if given.  `tx` is the transport's request of the capsule (capsule_received).  `source` =
        (backend, offset) says `data` is that RAM backend's memory at offset (RamBackend.pin): a transport that
        registers it sends from there.  Raises TransportError, before sending anything, when the data cannot
        be sent (too long): the caller then answers without it."""

    def data_buffer(self, length: int, tx=None) -> Optional[memoryview]:
        """A buffer for controller-to-host data that complete() then sends without a copy (an RDMA transport's
        registered chunk), or None: the caller uses its own.  Only for the complete() of this `tx`."""
        return None

    def responses_in_flight(self) -> int:
        """Commands the core completed whose data or response has not yet left (a graceful stop waits)."""
        return 0

    @abc.abstractmethod
    def close(self) -> None:
        """Disconnect this queue.  The handler's `queue_closed` is called once."""

    def connected(self) -> bool:
        """The target accepted this queue's NVMe Connect: commit what a connected queue is guaranteed
        (transport/resources.py).  False if the transport cannot guarantee it; the Connect then fails."""
        return True

    def guarantee_capacity(self) -> Optional[int]:
        """How many more queues this queue's port can guarantee their data buffers (None: unbounded)."""
        return None

    # -- the native data path (docs/native.md): a queue that serves some I/O commands itself, without the core.
    # The core keeps such a queue's view current (engine/native_view.py); on any other queue these do nothing.

    data_path = "python"  # "native": the queue may serve commands itself, as its view allows
    serves_files = False  # its view may list file and block namespaces (on its own io_uring)

    def region_of(self, backend) -> Optional[tuple]:
        """(address, lkey) of a RAM backend's memory registered with this queue's device, or None."""
        return None

    def set_view(self, ready: bool, namespaces, sq_entries: int = 0, sq_head: int = 0,
                 sqflow_disabled: bool = False, paused: bool = False,
                 drain_check: Optional[Callable[[], None]] = None) -> dict:
        """Replace what the queue serves itself (built by engine/native_view.py).  `paused`: new commands go to
        the core; `drain_check` is called after each poll that completed commands meanwhile.  Returns the
        figures of the commands it served since they were last taken, as `take_native_stats`."""
        return {}

    def native_in_flight(self) -> dict:
        """{namespace generation: commands} the queue serves itself and has in flight."""
        return {}

    def take_native_stats(self) -> dict:
        """The figures of the commands the queue served itself since the last call, per namespace: {nsid: (reads,
        writes, flushes, bytes read, bytes written, read latency buckets, write latency buckets)}."""
        return {}

    def native_traffic(self) -> bool:
        """Whether the queue served a command itself since the last call (keep-alive traffic for the core)."""
        return False


class Listener(abc.ABC):
    """A transport's end of one config port: it accepts the port's queues (transport/registry.py `listen`)."""

    @abc.abstractmethod
    def status(self) -> dict:
        """Its figures for `target status`: "address" (traddr:trsvcid), "portid", "queues" (open now),
        "wc_errors" (failed work completions, flushes not counted; None where the transport does not count them),
        and "pool" where it has a data-buffer pool (transport/resources.py `BufferPool.figures`)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close its queues and stop listening."""


class QueueHandler(Protocol):
    """Implemented by the target: the transport calls these from its event loop."""

    def check_connect(self, request: ConnectRequest) -> Optional[Refusal]:
        """None to accept a new queue, else why not (the transport words it: registry `reject_status`)."""

    def queue_opened(self, queue: TargetQueue) -> None:
        """The queue's connection is accepted; capsules may follow."""

    def capsule_received(self, queue: TargetQueue, capsule: memoryview, tx=None, handed_back: bool = False) -> None:
        """A command capsule: the 64-byte SQE, then any in-capsule data.  Valid only during the call.
        `tx`: the transport's own request for it, handed back with read_host and complete.  `handed_back`: not a
        new command but one the native data path started and its device failed, for the core to do again (it
        was running before a pause that began meanwhile, which drains it rather than holding it)."""

    def queue_closed(self, queue: TargetQueue) -> None:
        """The connection is gone (disconnect, transport error, or close())."""

    def tick(self, now: float) -> None:
        """Called periodically (about every 100 ms) for timers such as keep-alive expiry."""


@dataclass
class HostBuffer:
    """Host memory registered for remote read and write by the target."""

    addr: int
    key: int
    view: memoryview


class HostQueue(abc.ABC):
    """The host's end of one NVMe queue."""

    qid: int
    crqsize: int  # controller receive queue size from the accept private data

    @abc.abstractmethod
    def register(self, size: int) -> HostBuffer:
        """Allocate and register `size` bytes the target may READ and WRITE."""

    @abc.abstractmethod
    def send(self, capsule: bytes) -> None:
        """SEND one command capsule (64-byte SQE + optional in-capsule data)."""

    @abc.abstractmethod
    def poll(self, timeout: float) -> list:
        """Return the 16-byte CQEs received, waiting up to `timeout` seconds for at least one."""

    def defer_sends(self) -> None:
        """Until `flush()`, the transport may hold SENDs and post them together (one doorbell); the
        initiator brackets the callbacks of one poll batch with the two."""

    def flush(self) -> None:
        """Post whatever `defer_sends()` let the transport hold, and stop holding."""

    @abc.abstractmethod
    def close(self) -> None:
        """Disconnect."""


class Connector(abc.ABC):
    """Opens host queues to one target address."""

    @abc.abstractmethod
    def connect(self, qid: int, hrqsize: int, hsqsize: int, cntlid: int = 0) -> HostQueue:
        """Open queue `qid`; raises ConnectRejected or TransportError."""

    def close(self) -> None:
        """Release what the connector holds itself (its queues are closed by their owner)."""
