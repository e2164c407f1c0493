"""Subsystems and namespaces of the userspace target (built from the config: nvmeof_roce/config/).

A subsystem and a namespace each have a lifecycle, checked like the controller's and the queue's (every change
goes through `enter`, which raises on an edge the table does not have):

    subsystem  ACTIVE -> REMOVED (Target.remove_subsystem: its controllers are ended)
    namespace  ACTIVE  its I/O commands start as they arrive
               PAUSED  a change to it is waiting (Target.pause_namespaces, SPDK's pause of one namespace): its new
                       I/O commands wait, in arrival order, and start on resume; its commands in flight are the
                       change's fence's (engine/fencing.py)
               REMOVED retired from its subsystem: commands for it answer Invalid Namespace
               ACTIVE -> PAUSED -> ACTIVE (resume); ACTIVE | PAUSED -> REMOVED
"""
from __future__ import annotations

import enum
import itertools
import logging
import re
import uuid as uuidlib
from collections import deque
from typing import Callable, Deque, Dict, List, Optional

from .. import native
from ..nvme.fabrics import DISCOVERY_NQN, MAX_CNTLID, MIN_CNTLID, make_version
from .backends import Backend
from .ioengine import DEFAULT_QUEUE_DEPTH, IoEngine, choose_engine, make_engine
from .latency import NamespaceStats
from .reservations import Reservation
from ..config import NamespaceConfig, SubsystemConfig

log = logging.getLogger(__name__)

DEFAULT_MAX_QID = 128  # I/O queues per controller (nvmet's default)


def max_qid_of(config: SubsystemConfig) -> int:
    """The subsystem's qid_max attribute (nvmet's attr_qid_max): most I/O queues per controller."""
    return int(str(config.attrs.get("qid_max", DEFAULT_MAX_QID)), 0)
DEFAULT_VERSION = make_version(1, 3, 0)  # VS 1.3: the host command sequence of docs/protocol.md §4.3, §5.1


def _hex_bytes(text: Optional[str], size: int) -> Optional[bytes]:
    if not text:
        return None
    raw = bytes.fromhex(re.sub(r"[-:]", "", text))
    return raw if len(raw) == size else None


# Namespace generations: one counter for the engine, never reused while it runs (native_view's identity of a
# namespace: an address or NSID can come back, a generation cannot).
_generations = itertools.count(1)


def next_generation() -> int:
    return next(_generations)


# ---------------------------------------------------------------------------------------------- references
# What a command holds on its namespace while it may touch it: a reference (docs/native.md "References and
# fencing"), as nvmet's per-namespace percpu_ref and SPDK's per-queue namespace channel.
#
# A command of either data path takes its namespace's current `Reference` when it is parsed and checked, and lets
# it go when nothing of it can reach the namespace any more: the Python path when the core frees the request, or,
# when the response's data is sent from the namespace's own memory (a RAM Read), when the transport's WRITE has
# completed; the native path (csrc/nq_hot.c) when the request's slot is freed, i.e. after its last work request
# completed or flushed, a queue of an ended controller included.
#
# A namespace's references are counted per epoch: `Namespace.fence()` starts a new `Reference` for the commands
# that arrive from now on and returns the old one, whose count only goes down.  A change to the namespace (a
# resize, a removal, a reservation taking a host's access away) waits until the old count is 0 (engine/fencing.py
# `Fence`): no command started before the change can still move data into or out of the namespace as it was.
#
# With the native module built the reference is its `_native.Ref` (an atomic count the C queues change without
# Python, and poll-group threads without the GIL); without it, `Reference` below, the same three members.


class Reference:
    """A namespace epoch's count of commands in flight (the Python build's; `_native.Ref` otherwise)."""

    __slots__ = ("count",)

    def __init__(self):
        self.count = 0

    def take(self) -> None:
        self.count += 1

    def put(self) -> None:
        if self.count <= 0:
            raise RuntimeError("a namespace reference was let go more often than it was taken")
        self.count -= 1


def new_reference():
    """A reference for a namespace's new epoch: the native module's when it is built (its queues take it)."""
    return native.module.Ref() if native.module is not None else Reference()


class NamespaceState(enum.Enum):
    ACTIVE = "active"
    PAUSED = "paused"
    REMOVED = "removed"


# For each state, the states a namespace may enter it from (module docstring).
NAMESPACE_ALLOWED_FROM = {
    NamespaceState.ACTIVE: {NamespaceState.PAUSED},
    NamespaceState.PAUSED: {NamespaceState.ACTIVE},
    NamespaceState.REMOVED: {NamespaceState.ACTIVE, NamespaceState.PAUSED},
}


class IllegalNamespaceTransition(RuntimeError):
    """A namespace was moved along no edge of its lifecycle (pausing a paused one, resuming an active one...)."""


class Namespace:
    """One namespace: its backend and the identifiers the host sees."""

    def __init__(self, config: NamespaceConfig, backend: Backend):
        self.config = config
        self.nsid = config.nsid
        self.backend = backend
        self.block_size = backend.block_size
        self.lbads = backend.block_size.bit_length() - 1
        self.num_blocks = backend.num_blocks
        self.uuid = uuidlib.UUID(config.uuid).bytes if config.uuid else uuidlib.uuid4().bytes
        self.nguid = _hex_bytes(config.nguid, 16) or backend.nguid()  # the config's, else its storage's
        self.eui64 = _hex_bytes(config.eui64, 8)
        self.ana_grpid = config.ana_grpid
        self.state = NamespaceState.ACTIVE
        self.removed = False  # REMOVED, and paused PAUSED (kept as flags: each I/O command reads them)
        self.paused = False
        self.held: Deque = deque()  # (request, its capsule) of each I/O command that arrived while PAUSED, in order
        # The commands in flight on it hold `ref`, this epoch's reference ("references" above); fence() starts the
        # next epoch
        self.ref = new_reference()
        self.storage_size: Optional[int] = None  # a resize notice's size, until the namespace is resized
        # Its identity in the native queues' views: a new one when it is installed, replaced or its memory
        # changes (a resize), so a native command of the old one never completes into the new one.
        self.generation = next_generation()
        # Blocking calls and sliced jobs on the backend not yet completed (engine/work.py): a removed namespace
        # closes its backend only after the last one, never under a call running on the worker thread.
        self.jobs = 0
        self._close_when_idle = False
        # RAM namespaces expose their memory: reads are sent straight from it, without a copy.
        self.direct_view = backend.buffer
        # File and block namespaces: their commands go to an I/O engine (engine/ioengine.py), made at the first
        # command (it needs the target's completion channel); which one, and why, is known from the start.
        self.queue_depth = config.queue_depth or DEFAULT_QUEUE_DEPTH
        try:
            self.engine_choice = choose_engine(backend, config.io_engine) if backend.blocking else None
        except BaseException:
            backend.close()  # io_uring forced where it cannot run: the namespace does not open
            raise
        self.io: Optional[IoEngine] = None
        # The native data path's handle on the descriptor (native_view.handle_of: a `_native.File`, made when a native
        # queue first lists the namespace); the C queues hold it while their commands are on their rings.
        self.native_file = None
        # SMART counters (bytes and commands)
        self.bytes_read = 0
        self.bytes_written = 0
        self.read_commands = 0
        self.write_commands = 0
        self.stats = NamespaceStats()  # latency histograms and errors, for status and metrics
        self.qos = None  # qos.Limiter when the config limits the namespace (QosScheduler.configure)
        # Its reservation state when the config enables reservations (engine/reservations.py), else None
        self.resv = Reservation() if config.resv_enabled else None

    def enter(self, new: NamespaceState) -> None:
        """Move to `new`; IllegalNamespaceTransition if the lifecycle has no such edge."""
        if self.state is new and new is NamespaceState.REMOVED:
            return  # retired twice (a subsystem removed with it): already so
        if self.state not in NAMESPACE_ALLOWED_FROM[new]:
            raise IllegalNamespaceTransition(f"namespace {self.nsid}: illegal transition {self.state.value} -> "
                                             f"{new.value}")
        self.state = new
        self.paused = new is NamespaceState.PAUSED
        self.removed = new is NamespaceState.REMOVED

    def fence(self):
        """Start a new epoch of references: commands from now on take the new one.  Returns the old one, whose
        count now only goes down (engine/fencing.py waits for it to reach 0)."""
        old, self.ref = self.ref, new_reference()
        return old

    def visible_to(self, hostnqn: str) -> bool:
        """Whether host `hostnqn` sees the namespace (config nvmeof_roce.visible_hosts; SPDK's no_auto_visible
        and nvmf_ns_add_host): to any other host its NSID is inactive."""
        hosts = self.config.visible_hosts
        return hosts is None or hostnqn in hosts

    def engine(self, channel) -> IoEngine:
        """The namespace's I/O engine, made on first use with the target's completion channel (Work)."""
        if self.io is None:
            self.io = make_engine(self.engine_choice, self.backend, self.queue_depth, channel)
        return self.io

    def engine_status(self) -> Optional[dict]:
        """What `target status` shows: the engine, why, and the commands with the device now."""
        if self.engine_choice is None:
            return None
        if self.io is not None:
            status = self.io.status()
        else:
            status = {"engine": self.engine_choice.name, "engine_reason": self.engine_choice.reason,
                      "queue_depth": self.queue_depth, "in_flight": 0, "waiting": 0, "long_in_flight": 0,
                      "most_in_flight": 0, "threads": 0}
        if self.native_file is not None:  # its Reads and Writes on the native queues' rings (docs/native.md)
            native = self.native_file.status()
            status["native_in_flight"] = native["in_flight"]
            status["native_most_in_flight"] = native["most_in_flight"]
        return status

    def close(self) -> None:
        # The native queues' commands on their rings keep their own descriptor (a dup) until they complete; the
        # File goes with the views that list it (refreshed when the namespace changes).
        self.native_file = None
        try:
            if self.io is not None:
                self.io.close()  # the calls running finish before the file closes
            if not self.backend.asynchronous:  # an asynchronous one flushes in its close, off the loop (librbd's)
                self.backend.flush()
        finally:
            self.backend.close()

    def retire(self) -> None:
        """Removed from its subsystem: no new commands reach it; close the backend now, or when its last
        background job completes (job_done).  As nvmet_ns_disable waits for the I/O in flight before
        closing the device."""
        self.enter(NamespaceState.REMOVED)
        if self.jobs:
            self._close_when_idle = True
        else:
            self.close()

    def job_done(self) -> None:
        """A background job on the backend completed (on the loop); the deferred close of a retired namespace."""
        self.jobs -= 1
        if self.jobs == 0 and self._close_when_idle:
            self._close_when_idle = False
            try:
                self.close()
            except Exception as exc:
                log.error("closing removed namespace %d: %s", self.nsid, exc)

    def __repr__(self) -> str:
        return f"<Namespace {self.nsid} {self.backend!r}>"


class SubsystemState(enum.Enum):
    ACTIVE = "active"
    REMOVED = "removed"


# For each state, the states a subsystem may enter it from (module docstring).
ALLOWED_FROM = {
    SubsystemState.ACTIVE: set(),
    SubsystemState.REMOVED: {SubsystemState.ACTIVE},
}


class IllegalSubsystemTransition(RuntimeError):
    """A subsystem was moved along no edge of its lifecycle (removing a removed one)."""

    def __init__(self, nqn: str, old: SubsystemState, new: SubsystemState):
        super().__init__(f"subsystem {nqn}: illegal transition {old.value} -> {new.value}")
        self.old, self.new = old, new


class Subsystem:
    """An NVM subsystem: namespaces, the hosts allowed in, and its live controllers by CNTLID."""

    is_discovery = False

    def __init__(self, config: SubsystemConfig):
        self.config = config
        self.nqn = config.nqn
        self.serial = config.serial
        self.model = config.model
        self.allow_any_host = config.allow_any_host
        self.allowed_hosts = set(config.allowed_hosts)
        self.version = self._version(config.attrs.get("version"))
        self.cntlid_min = int(str(config.attrs.get("cntlid_min", MIN_CNTLID)), 0)
        self.cntlid_max = int(str(config.attrs.get("cntlid_max", MAX_CNTLID)), 0)
        self.max_qid = max_qid_of(config)
        self.namespaces: Dict[int, Namespace] = {}
        self.controllers: Dict[int, object] = {}
        self._active_nsids: Optional[List[int]] = None
        self._next_cntlid = self.cntlid_min
        self.state = SubsystemState.ACTIVE

    def enter(self, new: SubsystemState) -> None:
        """Move to `new`; IllegalSubsystemTransition if the lifecycle has no such edge."""
        if self.state not in ALLOWED_FROM[new]:
            raise IllegalSubsystemTransition(self.nqn, self.state, new)
        log.debug("subsystem %s: %s -> %s", self.nqn, self.state.value, new.value)
        self.state = new

    def rebind(self, config: SubsystemConfig) -> None:
        """Take the access settings and qid_max of a new config of the same subsystem (the attributes a host has
        read, serial, model, version, CNTLID range, are never changed live: control/live.py refuses it)."""
        self.config = config
        self.allow_any_host = config.allow_any_host
        self.allowed_hosts = set(config.allowed_hosts)
        self.max_qid = max_qid_of(config)

    @staticmethod
    def _version(text: Optional[str]) -> int:
        if not text:
            return DEFAULT_VERSION
        parts = [int(p) for p in text.split(".")] + [0]
        return make_version(parts[0], parts[1], parts[2])

    def host_allowed(self, hostnqn: str) -> bool:
        return self.allow_any_host or hostnqn in self.allowed_hosts

    def alloc_cntlid(self) -> Optional[int]:
        """The next free controller ID, round robin so a just-freed ID is not reused at once."""
        span = self.cntlid_max - self.cntlid_min + 1
        for i in range(span):
            cntlid = self.cntlid_min + (self._next_cntlid - self.cntlid_min + i) % span
            if cntlid not in self.controllers:
                self._next_cntlid = cntlid + 1 if cntlid < self.cntlid_max else self.cntlid_min
                return cntlid
        return None

    # -- namespaces (Target.install_namespace and retire_namespace, engine/api.py, are the verbs that call these)
    def add_namespace(self, ns: Namespace) -> None:
        if ns.nsid in self.namespaces:
            raise ValueError(f"{self.nqn}: NSID {ns.nsid} already exists")
        self.namespaces[ns.nsid] = ns
        self._active_nsids = None

    def remove_namespace(self, nsid: int) -> Namespace:
        ns = self.namespaces.pop(nsid)
        self._active_nsids = None
        return ns

    def active_nsids(self) -> List[int]:
        if self._active_nsids is None:
            self._active_nsids = sorted(self.namespaces)
        return self._active_nsids

    def namespace_for(self, nsid: int, hostnqn: str) -> Optional[Namespace]:
        """The namespace `nsid` as host `hostnqn` sees it: None when it does not exist or is not visible to it."""
        ns = self.namespaces.get(nsid)
        return ns if ns is not None and ns.visible_to(hostnqn) else None

    def visible_namespaces(self, hostnqn: str) -> List[Namespace]:
        """The namespaces host `hostnqn` sees, by NSID (Identify active NS list, ANA log, SMART)."""
        return [ns for ns in (self.namespaces[n] for n in self.active_nsids()) if ns.visible_to(hostnqn)]

    def close(self) -> None:
        for ns in list(self.namespaces.values()):
            try:
                ns.close()
            except Exception as exc:  # one bad backend must not keep the others open
                log.error("%s: closing namespace %d: %s", self.nqn, ns.nsid, exc)
        self.namespaces.clear()
        self._active_nsids = None

    def __repr__(self) -> str:
        return f"<Subsystem {self.nqn} ns={self.active_nsids()}>"


class DiscoverySubsystem(Subsystem):
    """The well-known discovery subsystem: any host may connect, it lists what that host may see."""

    is_discovery = True

    def __init__(self):
        cfg = SubsystemConfig(nqn=DISCOVERY_NQN, allow_any_host=True, serial="discovery",
                              model="nvmeof-roce discovery")
        super().__init__(cfg)
        self.max_qid = 0  # admin queue only
