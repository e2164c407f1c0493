"""The contracts every transport implements (loopback, RDMA; transport/registry.py lists them): the queues
(`TargetQueue`, `HostQueue`), the listener of a config port (`Listener`), the event loop the listeners and the
service share (`Loop`), and what the engine gives a transport (`QueueHandler`).  The layers above transport/
use these declared members only, never a probe.

One NVMe queue (admin or I/O) is one reliable connection.  The target sees a
`TargetQueue`; the host (initiator) sees a `HostQueue`.  Both are driven by a
single-threaded event loop: no call here blocks, results arrive as callbacks
(target) or through `poll()` (host).

Data movement, as nvmet's `nvmet_fabrics_ops`: the transport's entry maps the command's SGL
(`TransportOps.map_sgl`) into a data descriptor of its own (`req.desc`; on RDMA the keyed SGL's address, key
and the key to invalidate, transport/rdma/sgl.py), which the engine carries on its request without reading it
and hands back to `read_host` (host data for the target) and `complete` (data for the host, then the
response), where the transport decides how to move it.  A transfer the host's memory refuses (on RDMA: a bad
key, an out-of-bounds range or a missing access right) is a `RemoteAccessError`, and on RDMA it also kills the
connection (the QP goes to the error state).
"""
from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Callable, List, Optional, Protocol

from ..tunables import POLL_SPIN_US


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
    """Why the engine refuses to open a queue, in no transport's words: each transport says it on its wire
    (`TransportOps.reject_status`).  A transport's own checks of its connection request (`check_request`) refuse
    with reasons of its own (RDMA: transport/rdma/connect.py `CmRefusal`), which the engine passes on unread."""

    INVALID_QID = "invalid_qid"
    NO_RESOURCES = "no_resources"


@dataclass(frozen=True)
class ConnectRequest:
    """What the engine needs to know of a queue the host opens, before its NVMe Connect: which queue, from
    where, on which transport.  A transport's connection request carries more (RDMA's CM private data:
    transport/rdma/connect.py `RdmaConnectRequest`); the transport checks that itself (`check_request`), and
    the queue's size is the Connect's SQSIZE (engine/fabrics.py), as nvmet_install_queue learns it."""

    qid: int
    trtype: str  # the transport it came on (its transport/registry.py entry)
    peer: str = ""  # the host's "address:port" ("[address]:port" for IPv6), for logs and per-address limits
    port_id: int = 0  # the config port (portid) whose listener accepted it

    @property
    def peer_address(self) -> str:
        """The host's address without the port ("" when the transport does not know it)."""
        return self.peer.rsplit(":", 1)[0] if ":" in self.peer else self.peer


# Completion callback of read_host: data is valid only during the call.
ReadDone = Callable[[Optional[memoryview], Optional[TransportError]], None]


class TargetQueue(abc.ABC):
    """The target's end of one NVMe queue."""

    trtype: str  # its transport's registry entry (transport/registry.py), set by each queue class
    request: ConnectRequest
    in_capsule_size: int  # bytes of in-capsule data accepted after the 64-byte SQE (0 on admin queues)
    local_address = ""  # the address the host connected to, where the transport knows it (discovery log entries)

    @property
    def qid(self) -> int:
        return self.request.qid

    @abc.abstractmethod
    def read_host(self, desc, length: int, done: ReadDone, tx=None) -> None:
        """Fetch `length` bytes of host data from where `desc` says (the data descriptor the transport's
        `map_sgl` made for the command: an RDMA READ of a keyed SGL); `done(data, None)` or `done(None, error)`
        later.  `tx`: the transport's request handed over with the capsule (capsule_received), if any."""

    @abc.abstractmethod
    def complete(self, cqe: bytes, data=None, desc=None, tx=None, source=None) -> None:
        """The end of a command in one call: `data` (if any; only borrowed for this call) moved to the host
        where `desc` says, ordered before the 16-byte CQE (RDMA: a WRITE to the keyed SGL, then the SEND, with
        Invalidate of the host's key when the descriptor asks for it).  `desc` is the data descriptor the
        transport's `map_sgl` made for the command, or None when none was mapped (a command answered before its
        SGL was, or one whose data came in the capsule).  `tx` is the transport's request of the capsule
        (capsule_received).  `source` = (backend, offset, reference) says `data` is that RAM backend's memory at
        offset (RamBackend.pin): a transport that registers it sends from there.  The command's namespace
        reference (engine/subsystem.py "references") passes to the transport with it: it calls
        `reference.put()` once nothing reads that memory any more (its WRITE completed or flushed; at once when
        it copies the data).  Raises TransportError, before sending anything, when the data cannot be sent (too
        long): the caller then answers without it, and keeps the reference."""

    def data_buffer(self, length: int, tx=None) -> Optional[memoryview]:
        """A buffer for controller-to-host data that complete() then sends without a copy (an RDMA transport's
        registered chunk), or None: the caller uses its own.  Only for the complete() of this `tx`."""
        return None

    def responses_in_flight(self) -> int:
        """Commands the core completed whose data or response has not yet left (a graceful stop waits)."""
        return 0

    def references_held(self, reference) -> int:
        """Commands of this queue that hold namespace `reference` in the transport (responses sent from the
        namespace's memory, the native data path's commands): a fence's bound tears down the queues that do."""
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

    # -- a fast path of the transport's own (RDMA's C queue, docs/native.md): a queue that serves some I/O commands
    # itself, without the core.  The core keeps such a queue's view current (engine/fast_path_view.py); on any
    # other queue these do nothing.

    fast_path = False  # True: the queue may serve commands itself, as its view allows
    serves_files = False  # its view may list file and block namespaces (on its own io_uring)

    def region_of(self, backend) -> Optional[tuple]:
        """(address, lkey) of a RAM backend's memory registered with this queue's device, or None."""
        return None

    def set_view(self, ready: bool, namespaces, sq_entries: int = 0, sq_head: int = 0,
                 sqflow_disabled: bool = False, drain_check: Optional[Callable[[], None]] = None) -> dict:
        """Replace what the queue serves itself (built by engine/fast_path_view.py).  `drain_check` is called
        after each poll that completed commands meanwhile (a change waits for them).  Returns the figures of the
        commands it served since they were last taken, as `take_fast_path_stats`."""
        return {}

    def native_in_flight(self) -> dict:
        """{namespace generation: commands} the queue serves itself and has in flight."""
        return {}

    def take_fast_path_stats(self) -> dict:
        """The figures of the commands the queue served itself since the last call, per namespace: {nsid: (reads,
        writes, flushes, bytes read, bytes written, read latency buckets, write latency buckets)}."""
        return {}

    def fast_path_traffic(self) -> bool:
        """Whether the queue served a command itself since the last call (keep-alive traffic for the core)."""
        return False

    def polling_status(self) -> Optional[dict]:
        """How a queue that polls for its completions is polled, for `target status --json` (each queue's
        "polling"); None for a queue driven by events only."""
        return None


class Listener(abc.ABC):
    """A transport's end of one config port: it accepts the port's queues (transport/registry.py `listen`)."""

    traddr: str  # the address it listens on (the config port's)
    trsvcid: object  # its service (port number) as the transport takes it
    port_id: Optional[int]  # the config port (portid) it serves

    @property
    def device_name(self) -> str:
        """What it listens through, for `target serve`'s start line (an RDMA device; "" where none)."""
        return ""

    @abc.abstractmethod
    def status(self) -> dict:
        """Its figures for `target status`: "address" (traddr:trsvcid), "portid", "queues" (open now),
        "wc_errors" (failed work completions, flushes not counted; None where the transport does not count them),
        and "pool" where it has a data-buffer pool (transport/resources.py `BufferPool.figures`)."""

    def status_line(self) -> str:
        """One line of its figures for `target serve`'s status log."""
        figures = self.status()
        return f"{figures['address']}: {figures['queues']} queues"

    @abc.abstractmethod
    def close(self) -> None:
        """Close its queues and stop listening."""


class Loop(Protocol):
    """The event loop a transport's entry makes (`TransportOps.event_loop`): its listeners and queues watch fds
    on it, and the service runs it (transport/eventloop.py `EventLoop` is the shared one)."""

    listeners: List[Listener]  # the listeners made on it
    longest_pass: Optional[float]  # seconds: the longest pass since start (None: it does not time its passes)
    longest_pass_recent: Optional[float]  # ... since the service last reset it

    def watch(self, fd: int, callback: Callable[[], None]) -> None:
        """Call `callback` on the loop whenever `fd` is readable."""

    def unwatch(self, fd: int) -> None:
        """Stop watching `fd` (nothing if it is not watched)."""

    def keep_polling(self, poller: Callable[[], bool]) -> None:
        """Run `poller` in every pass until it returns False (busy polling)."""

    def run_once(self, timeout: float) -> int:
        """One pass: wait up to `timeout`, run what is ready; how many handlers ran."""

    def run(self, should_stop: Callable[[], bool]) -> None:
        """Passes and the handler's ticks until `should_stop()`."""

    def close(self) -> None:
        """Close its listeners and stop."""


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


@dataclass(frozen=True)
class TransportSettings:
    """The service's settings a transport may take (target serve's options); each entry makes its own options
    of them (`TransportOps.opts_init`) and ignores what it has no use for."""

    remote_invalidate: bool = True  # a response may invalidate the host's key (--no-remote-invalidate)
    data_path: str = "python"  # "native": queues that can serve commands without Python do (docs/native.md)
    poll: str = "interrupt"  # how such queues find completions (tunables.POLL)
    cores: int = 1  # threads that poll them (tunables.CORES)
    poll_spin_us: int = POLL_SPIN_US.default  # poll "adaptive": the spin's bound (tunables.POLL_SPIN_US)
    trace: str = "off"  # their per-command trace (tunables.TRACE)


@dataclass(frozen=True)
class ListenOptions:
    """What the service gives every listener it makes: the engine's limits and the entry's own options."""

    max_transfer: int = 128 * 1024
    limits: object = None  # transport/resources.py ResourceLimits, or None for the defaults
    transport: object = None  # what the entry's opts_init made (None: its defaults)


@dataclass(frozen=True)
class TransportOps:
    """One transport's entry in transport/registry.py, as nvmet's `struct nvmet_fabrics_ops` and SPDK's
    `spdk_nvmf_transport_ops`: everything the engine, the service and the config ask of a transport."""

    trtype: str
    description: str
    sgls: Callable[[int], int]  # (in-capsule bytes of the port) -> Identify's SGLS: the SGL kinds it takes
    # (engine Request) -> 0 or an NVMe status; called once per command, after the engine's checks: from the SQE's
    # DPTR (`req.dptr1`, `req.dptr2`) it sets `req.transfer_len`, and `req.desc` (its own data descriptor, handed
    # back to read_host and complete) or `req.inline_offset` (the data is in the capsule at 64 + that offset)
    map_sgl: Callable[[object], int]
    # (request, the most entries the engine allows such a queue) -> None, or the transport's own refusal: its
    # checks of what its connection request carries
    check_request: Callable[[ConnectRequest, int], Optional[object]]
    reject_status: Callable[[object], int]  # a refusal (the engine's Refusal or its own) as its wire says it
    event_loop: Callable[[object], object]  # (QueueHandler for tick) -> the `Loop` listeners and Work watch fds on
    listen: Callable[..., "Listener"]  # (loop, PortConfig, QueueHandler, ListenOptions) -> a Listener
    require: Callable[[], None] = lambda: None  # raises NvmeofError naming the fix if it cannot run here
    opts_init: Callable[[TransportSettings], object] = lambda settings: None  # its options (ListenOptions.transport)
    dump_opts: Callable[[object], dict] = lambda opts: {}  # its options as `target status` shows them
    close_opts: Callable[[object], None] = lambda opts: None  # release what opts_init made, its listeners closed
    figures: Callable[[], dict] = dict  # transport-wide figures for `target status`'s "transport"
    served_by_target: bool = True  # config ports of this trtype are served by `target serve`
    label: str = ""  # how messages name it ("RDMA (RoCE)"); the trtype if empty


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
