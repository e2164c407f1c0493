"""The userspace NVMe-oF target core: transport independent, single threaded, never blocking.

`Target` implements transport/contracts.py's `QueueHandler`.  A transport calls it
from its event loop; every capsule becomes a `Request` that runs through the
lifecycle of transport/lifecycle.py (each change checked by `move`):

    parse (FREE -> NEW)  ->  checks (flags, connected?, enabled?, NSID, opcode)
           ->  SGL mapping by the queue's transport entry (transport/registry.py)  ->  EXECUTING
           ->  command handler: validates its fields and lengths, then returns one Outcome (request.py):
                 COMPLETED at once; FETCHING host data (in-capsule at once, or read_host: the request waits in
                 TRANSFERRING_HOST_TO_CONTROLLER, then its next step runs); HELD (the AER); DEFERRED (its device
                 call or slices run, and their completion answers it)
           ->  complete: controller-to-host data + CQE + invalidate key, one call  ->  FREE

A handler that returns no Outcome is a missing branch: answered Internal Error
and counted, never left holding its request.  Every malformed input ends in an
NVMe status (or a refused queue, or a clean close of that one queue).  An
unexpected exception inside a handler is caught, counted in `internal_errors`,
logged, and answered with Internal Error, so it never escapes into the transport.

Queues (engine/queue.py) and controllers (engine/controller.py) have their own
lifecycles; the fabrics commands are engine/fabrics.py's.

Ports: the Target itself handles queues arriving on *any* configured port (a
subsystem is reachable if some port exports it).  `target.port(portid)` gives a
handler bound to one port, for a transport listening on that port's address.

The verbs that change a running target (namespaces, subsystems, ports, pause and
resume) are engine/api.py's, mixed into Target.
"""
from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from typing import Callable, Dict, List, Optional

from ..nvme import fabrics as F
from ..nvme import status as S
from ..nvme.command import (CQE_STRUCT, FABRICS_OPCODE, FLAGS_FUSE_MASK, FLAGS_PSDT_MASK, PSDT_SGL_MPTR_CONTIG,
                            PSDT_SGL_MPTR_SGL, SQE_SIZE)
from ..transport import registry
from ..transport.contracts import Refusal, TransportError
from ..transport.lifecycle import EXECUTING, FREE, HELD, NEXT, TRANSFERRING_HOST_TO_CONTROLLER, IllegalTransition, move
from ..transport.resources import ResourceLimits
from .backends import BackendError
from ..config import PortConfig, TargetConfig
from . import auth
from . import native_view
from .api import EngineApi
from .controller import Controller, CtrlState
from .ana import AnaTable
from . import admin, discovery, fabrics, io, reservations
from .limits import (DEFAULT_IN_CAPSULE_SIZE, DEFAULT_QUEUE_SIZE, MAX_CONTROLLERS_PER_HOST, MAX_DISCOVERY_CONTROLLERS,
                     MAX_DISCOVERY_CONTROLLERS_PER_HOST, MAX_QUEUE_SIZE, MAX_QUEUES, MIN_QUEUE_SIZE)
from .request import (COMPLETED, DEFERRED, FETCHING, HELD_OUTCOME, LOC_DPTR, LOC_FLAGS, LOC_NSID, LOC_OPCODE,
                      NO_LOCATION, Outcome, Request)
from .queue import QueueLifecycle, QueueState, max_queue_entries
from .fencing import Fence
from .subsystem import DiscoverySubsystem, Subsystem
from .pending import PendingNamespaces
from .work import Work
from .qos import QosScheduler

log = logging.getLogger(__name__)

Handler = Callable[["Target", Request], Outcome]


class MissingOutcome(RuntimeError):
    """A command handler, or a next step of one, returned no Outcome (engine/request.py): a missing branch."""
SHUTDOWN_LINGER = 2.0  # seconds a shut-down controller keeps its admin queue for the last CSTS reads
REFUSED_LINGER = 0.5  # seconds a queue whose Connect failed stays open so the host receives the status


class PortContext:
    """Where queues arrive: one configured port, or every port (port None)."""

    def __init__(self, target: "Target", port: Optional[PortConfig], in_capsule_size: int, queue_size: int):
        self.target = target
        self.port = port
        self.portid = port.portid if port else None
        self.in_capsule_size = in_capsule_size
        self.mqes = queue_size - 1

    def ports(self) -> List[PortConfig]:
        return [self.port] if self.port else list(self.target.config.ports)

    def discovery_ports(self) -> List[PortConfig]:
        """The ports a discovery log read through this port lists: the port itself, and under `serve --workers`
        the same port of every other worker (Target.discovery_siblings), so that every path is discovered."""
        if self.port is None:
            return self.ports()
        siblings = self.target.discovery_siblings.get(self.portid)
        if not siblings:
            return [self.port]
        return [p for p in self.target.config.ports if p.portid in siblings]

    def exports(self, nqn: str) -> bool:
        return any(nqn in p.subsystems for p in self.ports())

    @classmethod
    def for_port(cls, target: "Target", port: PortConfig) -> "PortContext":
        # parsed (decimal or hex) and bounded by the loader: nvmeof_roce/config/
        inline = port.inline_data_size
        if inline is None or inline < 0:
            inline = target.default_in_capsule_size
        queue_size = port.max_queue_size
        if queue_size is None or queue_size < 0:
            queue_size = target.default_queue_size
        return cls(target, port, inline, max(MIN_QUEUE_SIZE, min(MAX_QUEUE_SIZE, queue_size)))


class PortHandler:
    """A QueueHandler for one port: what a transport listening on that port's address is given."""

    def __init__(self, target: "Target", ctx: PortContext):
        self.target = target
        self.ctx = ctx

    @property
    def in_capsule_size(self) -> int:
        return self.ctx.in_capsule_size

    def check_connect(self, request) -> Optional[object]:
        return self.target._check_connect(self.ctx, request)

    def queue_opened(self, queue) -> None:
        self.target._queue_opened(self.ctx, queue)

    def capsule_received(self, queue, capsule, tx=None, handed_back: bool = False) -> None:
        self.target.capsule_received(queue, capsule, tx, handed_back)

    def queue_closed(self, queue) -> None:
        self.target.queue_closed(queue)

    def tick(self, now: float) -> None:
        self.target.tick(now)


class Target(EngineApi):
    """Subsystems, namespaces and controllers, driven by transports through the QueueHandler calls and changed
    by the control plane through the verbs of engine/api.py."""

    def __init__(self, config: TargetConfig, clock: Callable[[], float] = time.monotonic,
                 in_capsule_size: int = DEFAULT_IN_CAPSULE_SIZE, queue_size: int = DEFAULT_QUEUE_SIZE,
                 file_lock: str = "exclusive", limits: Optional[ResourceLimits] = None,
                 reservation_file: Optional[str] = None):
        self.config = config
        # Where reservations that persist through power loss are kept (engine/reservations.py); None: a host's
        # PTPL is refused, and a restart clears every reservation
        self.reservation_file = reservation_file
        self.file_lock = file_lock  # "shared" in the workers of `serve --workers` (backends.FileBackend._lock)
        self.clock = clock
        self.limits = limits or ResourceLimits()
        # Queues without a successful Connect, by deadline (each dict is in deadline order): closed in tick().
        self._awaiting_connect: "OrderedDict[QueueState, float]" = OrderedDict()
        self._connect_refused: "OrderedDict[QueueState, float]" = OrderedDict()
        # Queues awaiting Connect per peer address: a connect flood from one address is refused, not everyone.
        self._unconnected_by_address: Counter = Counter()
        self._flood_logged: set = set()
        # Controllers ended by a fatal error (a failed authentication), by deadline: deleted in tick().
        self._ending: "OrderedDict[Controller, tuple]" = OrderedDict()
        self.default_in_capsule_size = in_capsule_size
        self.default_queue_size = max(MIN_QUEUE_SIZE, min(MAX_QUEUE_SIZE, queue_size))
        self.subsystems: Dict[str, Subsystem] = {}
        self.discovery = DiscoverySubsystem()
        self.genctr = 1  # discovery log generation: changes only when what discovery lists changes
        self.internal_errors = 0
        self.closed = False
        self._queues: Dict[object, QueueState] = {}
        self._any_port = PortContext(self, None, in_capsule_size, self.default_queue_size)
        self._port_handlers: Dict[int, PortHandler] = {}
        self.ana = AnaTable(config)  # ANA groups and their state on each port (engine/ana.py)
        self.discovery_siblings: Dict[int, List[int]] = {}  # portid -> the portids of one path group (workers.py)
        self.work = Work()  # device completions and sliced jobs, back on the loop (work.py)
        self.host_auth = auth.host_settings(config)  # DH-HMAC-CHAP keys by host NQN
        self.native_data_path = False  # a queue of the native data path was opened (engine/native_view.py)
        self.tick_hooks: List[Callable[[float], None]] = []  # e.g. the control socket's (control/methods.py)
        self.qos = QosScheduler(clock)  # per-namespace limits: held commands start from the tick or its waker
        self.tick_hooks.append(self.qos.release)
        self.fences: List[Fence] = []  # changes waiting for their namespaces' commands from before (api.py)
        self.pending = PendingNamespaces(self)  # namespaces whose storage did not answer yet (engine/pending.py)
        try:
            for sub_cfg in config.subsystems:
                self.add_subsystem(self.prepare_subsystem(sub_cfg))
        except BaseException:
            for sub in self.subsystems.values():
                sub.close()
            raise
        if reservation_file:
            self.restore_reservations()
        # The command tables by opcode (engine/handlers.py); a test may install a copy with a vendor command.
        self.admin_commands: Dict[int, Handler] = admin.COMMANDS.handlers
        self.discovery_commands: Dict[int, Handler] = discovery.COMMANDS.handlers
        self.io_commands: Dict[int, Handler] = {**io.COMMANDS.handlers, **reservations.COMMANDS.handlers}

    # ------------------------------------------------------------------ public API
    @property
    def in_capsule_size(self) -> int:
        """In-capsule data bytes an I/O queue accepts (transports size receive buffers to 64 + this)."""
        return self._any_port.in_capsule_size

    @property
    def max_transfer(self) -> int:
        """Largest data transfer of one command (MDTS), for transports sizing their data buffers."""
        return self.limits.max_transfer

    def in_flight(self) -> int:
        """Commands being processed, their data and response until the transport saw them leave (held AERs
        excluded): what a graceful stop waits for."""
        held = sum(len(c.aers) for c in self.controllers())
        active = sum(qs.active + qs.transport.responses_in_flight() for qs in self._queues.values() if not qs.closed)
        return max(0, active - held)

    def queue_count(self) -> int:
        """Queues open (connected or waiting for their Connect)."""
        return sum(1 for qs in self._queues.values() if not qs.closed)

    def port(self, portid: int) -> PortHandler:
        """The QueueHandler for one configured port."""
        handler = self._port_handlers.get(portid)
        if handler is None:
            port = self.config.port(portid)
            if port is None:
                raise KeyError(f"no port {portid} in {self.config.source}")
            handler = self._port_handlers[portid] = self._new_port_handler(port)
        return handler

    def _new_port_handler(self, port: PortConfig) -> PortHandler:
        return PortHandler(self, PortContext.for_port(self, port))

    def subsystem(self, nqn: str) -> Subsystem:
        return self.subsystems[nqn]

    def controllers(self) -> List[Controller]:
        out = list(self.discovery.controllers.values())
        for sub in self.subsystems.values():
            out.extend(sub.controllers.values())
        return out

    def queue_state(self, queue) -> Optional[QueueState]:
        """The engine's state of a transport queue it was told about (None once it closed)."""
        return self._queues.get(queue)

    def queue_states(self) -> List[QueueState]:
        """Every open queue's state, connected or still awaiting its NVMe Connect."""
        return list(self._queues.values())

    def port_ids(self) -> List[int]:
        """The ports the engine has a handler for (opened at start or by `open_port`)."""
        return sorted(self._port_handlers)

    def attach_loop(self, loop) -> None:
        """Give the target its event loop (with `watch(fd, callback)` and `unwatch(fd)`): from then on file and block
        namespaces' commands run on their I/O engines and long RAM commands in slices, their completions coming
        back through the loop."""
        self.work.attach(loop)
        self.qos.attach(self.work)

    def close(self) -> None:
        """Disconnect every controller, then flush and close all backends."""
        if self.closed:
            return
        self.closed = True
        self.pending.close()
        for ctrl in self.controllers():
            self.end_controller(ctrl, "target shutting down")
        for qs in list(self._queues.values()):
            self._close_queue(qs, "target shutting down", logging.INFO)
        self.qos.close()
        self.work.close()  # the I/O engines' running calls finish and complete before the files close
        for sub in self.subsystems.values():
            for nsid, ns in list(sub.namespaces.items()):
                if ns.jobs:
                    # A blocking call outlived Work.close's wait: its file stays open (the process exit closes
                    # it), never closed -- and its number reused -- under the running call.
                    log.warning("%s namespace %d: a blocking call is still running; its file is left open",
                                sub.nqn, nsid)
                    del sub.namespaces[nsid]
            sub.close()

    # ------------------------------------------------------------------ QueueHandler
    def check_connect(self, request) -> Optional[object]:
        return self._check_connect(self._any_port, request)

    def queue_opened(self, queue) -> None:
        self._queue_opened(self._any_port, queue)

    def capsule_received(self, queue, capsule, tx=None, handed_back: bool = False) -> None:
        qs = self._queues.get(queue)
        if qs is None or qs.closed:
            return
        if len(capsule) < SQE_SIZE:
            # nvmet treats a capsule shorter than an SQE as fatal for the queue
            self._close_queue(qs, f"capsule of {len(capsule)} bytes is shorter than an SQE")
            return
        req = qs.alloc()
        if req is None:
            self._close_queue(qs, f"host exceeded the queue depth of {qs.depth} outstanding commands")
            return
        req.parse(capsule)
        req.tx = tx
        req.handed_back = handed_back
        self._begin(qs, req)

    def _begin(self, qs: QueueState, req: Request) -> None:
        """Start a parsed command: its capsule arrived now, or it waited for its paused subsystem's resume."""
        try:
            self._start(req)
        except Exception:
            self._internal_error(req)
        finally:
            req.capsule = None  # valid only during this call
            if self.native_data_path and qs.ctrl is not None:
                native_view.refresh(self, qs.ctrl)  # what the command changed, before the next poll

    def _start_held(self, req: Request, capsule: bytes) -> None:
        """A command that waited while its subsystem was paused starts (resume): from its checks again, since
        its controller may have been reset or its queue closed meanwhile."""
        qs = req.queue
        if qs.closed:
            if req.state != FREE:
                qs.discard(req)
            return
        req.capsule = capsule
        self._begin(qs, req)

    def queue_closed(self, queue) -> None:
        qs = self._queues.pop(queue, None)
        if qs is None:
            return
        if not qs.closed:
            qs.enter(QueueLifecycle.CLOSED)
        self._stop_awaiting_connect(qs)
        self._connect_refused.pop(qs, None)
        ctrl = qs.ctrl
        if qs.auth is not None and not qs.auth.authenticated:
            log.warning("controller %d queue %d: host %s disconnected without authenticating: %s", ctrl.cntlid,
                        qs.qid, ctrl.hostnqn, qs.auth.failure if qs.auth.attempted else
                        "it never started DH-HMAC-CHAP (no key on the host? the target requires hosts[].dhchap.key)")
        if ctrl is None or ctrl.dead:
            return
        if qs.qid == 0:
            self.end_controller(ctrl, "admin queue disconnected")
        elif ctrl.io_queues.get(qs.qid) is qs:
            del ctrl.io_queues[qs.qid]
            log.info("controller %d: I/O queue %d disconnected", ctrl.cntlid, qs.qid)
        if self.fences:
            self.check_fences()  # its commands may have let go of their references with it

    def tick(self, now: float) -> None:
        if self.native_data_path:
            native_view.collect(self)  # native commands count as keep-alive traffic before expiry is checked
        self._close_unconnected(now)
        while self._ending:
            ctrl, (deadline, reason) = next(iter(self._ending.items()))
            if deadline > now:
                break
            del self._ending[ctrl]
            self.end_controller(ctrl, reason)
        for hook in list(self.tick_hooks):  # a hook may remove itself
            hook(now)
        if self.fences:
            self.check_fences()  # the bounds, and responses the transport has seen leave since the last completion
        for ctrl in self.controllers():
            if ctrl.auth is not None:
                for qs in ctrl.queues():
                    if qs.auth is not None:
                        qs.auth.expire(now, ctrl.kato_seconds)
            if ctrl.shutdown_at is not None and now - ctrl.shutdown_at >= SHUTDOWN_LINGER:
                # After CC.SHN the Linux host reads CSTS once more and then disconnects the admin queue.
                # The transport cannot always tell which connection a CM disconnect belongs to
                # (pyverbs), so the controller goes away here, as its host intends.
                self.end_controller(ctrl, "shut down by the host")
            elif ctrl.expired(now):
                log.warning("controller %d (%s, host %s): keep-alive timeout of %d s expired%s",
                            ctrl.cntlid, ctrl.subsystem.nqn, ctrl.hostnqn, ctrl.timeout_seconds,
                            "" if ctrl.kato_ms else " (KATO 0: the target's idle limit)")
                self.end_controller(ctrl, "keep-alive timeout")

    # ------------------------------------------------------------------ connection management
    def _check_connect(self, ctx: PortContext, request) -> Optional[object]:
        """May a queue open: the transport's own checks of its connection request (its registry entry: what it
        carries, and a queue size it asks for against the most entries such a queue may have here), then the
        target's (docs/protocol.md §1.3): resources, QID.  None, or the refusal the transport words on its wire
        (a `Refusal`, or the transport's own)."""
        if self.closed or len(self._queues) >= MAX_QUEUES:
            return Refusal.NO_RESOURCES
        refusal = registry.get(request.trtype).check_request(request, max_queue_entries(ctx, request.qid))
        if refusal is not None:
            return refusal
        address = request.peer_address
        if address and self._unconnected_by_address[address] >= self.limits.connecting_per_address:
            # A host opens at most an admin queue and max_queues_per_host I/O queues before it sends their
            # Connects (nvme-rdma connects every queue's CM first); more from one address is a flood.
            if address not in self._flood_logged:
                self._flood_logged.add(address)
                log.warning("refusing connections from %s: %d of its queues are awaiting their NVMe Connect "
                            "(--max-connecting-per-address %d)", address, self._unconnected_by_address[address],
                            self.limits.connecting_per_address)
            return Refusal.NO_RESOURCES
        if request.qid == 0:
            io_ctrls = sum(len(s.controllers) for s in self.subsystems.values())
            if io_ctrls >= self.limits.max_controllers and \
                    len(self.discovery.controllers) >= MAX_DISCOVERY_CONTROLLERS:
                log.warning("refusing an admin queue: %d controllers and %d discovery controllers exist "
                            "(--max-controllers)", io_ctrls, len(self.discovery.controllers))
                return Refusal.NO_RESOURCES
        else:
            max_qid = max([s.max_qid for s in self.subsystems.values()] or [0])
            if request.qid > max_qid:
                return Refusal.INVALID_QID
        return None

    def _queue_opened(self, ctx: PortContext, queue) -> None:
        qs = self._queues[queue] = QueueState(queue, ctx, self)
        self._awaiting_connect[qs] = self.clock() + self.limits.connect_timeout
        self._unconnected_by_address[queue.request.peer_address] += 1
        if queue.data_path == "native":
            self.native_data_path = True
        log.debug("queue %d opened from %s", queue.request.qid, queue.request.peer or "?")

    # -- resources (transport/resources.py): queues without a Connect, grants, counts

    def _close_unconnected(self, now: float) -> None:
        """Close queues that got no NVMe Connect in time, and those whose Connect was refused."""
        for pending, why in ((self._connect_refused, "its NVMe Connect was refused"),
                             (self._awaiting_connect, f"no NVMe Connect within {self.limits.connect_timeout:g} s")):
            while pending:
                qs, deadline = next(iter(pending.items()))
                if deadline > now:
                    break
                if pending is self._awaiting_connect:
                    self._stop_awaiting_connect(qs)
                else:
                    del pending[qs]
                self._close_queue(qs, why, logging.INFO)

    def _stop_awaiting_connect(self, qs: QueueState) -> bool:
        """The queue no longer awaits its Connect (accepted, refused or closed); False if it was not awaiting it."""
        if self._awaiting_connect.pop(qs, None) is None:
            return False
        address = qs.transport.request.peer_address
        self._unconnected_by_address[address] -= 1
        if self._unconnected_by_address[address] <= 0:
            del self._unconnected_by_address[address]
            self._flood_logged.discard(address)
        return True

    def _connect_failed(self, qs: QueueState) -> None:
        """The Connect on a queue without a controller failed: close it shortly (after the status is sent)."""
        if self._stop_awaiting_connect(qs):
            qs.enter(QueueLifecycle.REFUSED)
            self._connect_refused[qs] = self.clock() + REFUSED_LINGER

    def _commit_queue(self, qs: QueueState) -> bool:
        """The Connect is accepted: the transport commits the queue's guaranteed buffers."""
        if not qs.transport.connected():
            log.warning("queue %d: the data buffer pool cannot guarantee another queue its minimum "
                        "(raise --data-buffers, or lower --max-queues-per-ctrl)", qs.qid)
            return False
        self._stop_awaiting_connect(qs)
        self._connect_refused.pop(qs, None)  # a Connect retried before the refused one's linger ended
        qs.enter(QueueLifecycle.LIVE)
        return True

    def controller_cap(self, sub, hostnqn: str) -> str:
        """Why host `hostnqn` may not have another controller of `sub`'s kind, or "": its own cap first, then
        the target's (engine/limits.py), so one host cannot take what the others need."""
        if sub.is_discovery:
            mine = sum(1 for c in self.discovery.controllers.values() if c.hostnqn == hostnqn and not c.dead)
            if mine >= MAX_DISCOVERY_CONTROLLERS_PER_HOST:
                return f"the host has {mine} discovery controllers, its limit"
            if len(self.discovery.controllers) >= MAX_DISCOVERY_CONTROLLERS:
                return f"{len(self.discovery.controllers)} discovery controllers exist, the target's limit"
            return ""
        all_io = [c for s in self.subsystems.values() for c in s.controllers.values() if not c.dead]
        mine = sum(1 for c in all_io if c.hostnqn == hostnqn)
        if mine >= MAX_CONTROLLERS_PER_HOST:
            return f"the host has {mine} controllers, its limit"
        if len(all_io) >= self.limits.max_controllers:
            return f"{len(all_io)} controllers exist (--max-controllers)"
        return ""

    def host_io_queues(self, hostnqn: str, exclude=None) -> int:
        """I/O queues host `hostnqn` holds over all its controllers (but `exclude`)."""
        return sum(len(c.io_queues) for c in self.controllers()
                   if c.hostnqn == hostnqn and c is not exclude and not c.dead)

    def io_queue_grant(self, qs: QueueState, requested: int) -> int:
        """Set Features Number of Queues: the I/O queues (1's based) controller `qs.ctrl` may create."""
        ctrl = qs.ctrl
        return self.limits.io_queue_grant(requested, ctrl.subsystem.max_qid,
                                          self.host_io_queues(ctrl.hostnqn, exclude=ctrl),
                                          qs.transport.guarantee_capacity())

    def status(self) -> str:
        """One line of counts for `target serve`'s status log."""
        ctrls = self.controllers()
        return (f"{len(self._queues)} queues ({len(self._awaiting_connect)} awaiting Connect, "
                f"{len(self._connect_refused)} refused), {len(ctrls)} controllers "
                f"({sum(1 for c in ctrls if c.is_discovery)} discovery)")

    def _close_queue(self, qs: QueueState, reason: str, level: int = logging.WARNING) -> None:
        if qs.closed:
            return
        log.log(level, "queue %d: closing: %s", qs.qid, reason)
        qs.enter(QueueLifecycle.CLOSED)
        try:
            qs.transport.close()
        except Exception:
            log.exception("queue %d: transport close failed", qs.qid)

    def tear_down_queue(self, qs: QueueState, reason: str) -> None:
        """Tear queue `qs` down now, a closing one included (a second close ends it at once: its QP destroyed, its
        work requests flushed), so its commands let go of what they hold; its host reconnects."""
        self._close_queue(qs, reason)
        try:
            qs.transport.close()
        except Exception:
            log.exception("queue %d: transport close failed", qs.qid)

    def fail_controller(self, ctrl: Controller, reason: str) -> None:
        """A fatal error (nvmet_ctrl_fatal_error): CSTS.CFS at once, the controller and its queues deleted
        shortly after (end_controller), once the response that reported the error has left."""
        if ctrl.dead or ctrl in self._ending:
            return
        ctrl.csts |= F.CSTS_CFS
        ctrl.change_state(CtrlState.DELETING)
        log.warning("controller %d (%s, host %s): ending it: %s", ctrl.cntlid, ctrl.subsystem.nqn, ctrl.hostnqn,
                    reason)
        self._ending[ctrl] = (self.clock() + REFUSED_LINGER, reason)

    def end_controller(self, ctrl: Controller, reason: str) -> None:
        """End the controller now: free its CNTLID and disconnect every queue of it (a no-op once it is dead)."""
        if ctrl.dead:
            return
        if ctrl.state is not CtrlState.DELETING:  # a fatal error may have put it there already (fail_controller)
            ctrl.change_state(CtrlState.DELETING)
        ctrl.change_state(CtrlState.DEAD)
        if ctrl.subsystem.controllers.get(ctrl.cntlid) is ctrl:
            del ctrl.subsystem.controllers[ctrl.cntlid]
        ctrl.aers.clear()
        ctrl.pending_events.clear()
        log.info("controller %d (%s, host %s) deleted: %s", ctrl.cntlid, ctrl.subsystem.nqn, ctrl.hostnqn, reason)
        for qs in ctrl.queues():
            self._close_queue(qs, f"controller {ctrl.cntlid} deleted: {reason}", logging.INFO)

    def find_subsystem(self, ctx: PortContext, nqn: str) -> Optional[Subsystem]:
        """The subsystem named `nqn` if it is exported on this port (the discovery one always is)."""
        if nqn == F.DISCOVERY_NQN:
            return self.discovery
        sub = self.subsystems.get(nqn)
        if sub is None or not ctx.exports(nqn):
            return None
        return sub

    # ------------------------------------------------------------------ the state machine
    def _start(self, req: Request) -> None:
        """NEW: the checks every command gets, in nvmet's order, then the command's handler."""
        qs = req.queue
        ctrl = qs.ctrl
        if ctrl is not None:
            ctrl.last_traffic = self.clock()  # CTRATT.TBKAS: any command counts as keep-alive traffic
        flags = req.flags
        if flags & FLAGS_FUSE_MASK:
            return self.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_FLAGS)
        psdt = flags & FLAGS_PSDT_MASK
        if psdt != PSDT_SGL_MPTR_CONTIG and psdt != PSDT_SGL_MPTR_SGL:
            return self.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_FLAGS)

        opc = req.opc
        ns = None
        if ctrl is None:
            if opc != FABRICS_OPCODE or req.fctype != F.FCTYPE_CONNECT:
                return self.complete(req, S.INVALID_OPCODE | S.DNR, location=LOC_OPCODE)
            handler = fabrics.connect
        elif qs.auth is not None and not qs.auth.authenticated and (
                opc != FABRICS_OPCODE or req.fctype not in fabrics.BEFORE_AUTHENTICATION):
            # nvmet_check_auth_status: nothing but authentication until the queue is authenticated
            return self.complete(req, S.AUTH_REQUIRED | S.DNR, location=LOC_OPCODE)
        elif opc == FABRICS_OPCODE:
            handler = (fabrics.ADMIN if qs.qid == 0 else fabrics.IO).get(req.fctype)
            if handler is None:
                return self.complete(req, S.INVALID_OPCODE | S.DNR, location=LOC_OPCODE)
        else:
            if not ctrl.ready:
                return self.complete(req, S.CMD_SEQ_ERROR | S.DNR, location=LOC_OPCODE)
            if qs.qid == 0:
                table = self.discovery_commands if ctrl.is_discovery else self.admin_commands
            else:
                ns = ctrl.subsystem.namespaces.get(req.nsid)
                if ns is None or not ns.visible_to(ctrl.hostnqn):  # invisible to this host: as if inactive
                    return self.complete(req, S.INVALID_NS | S.DNR, location=LOC_NSID)
                # Paused (api.py): it starts on resume; its capsule is valid only during this call.  A command the
                # native data path hands back (its device failed it) was running before the pause began: it runs
                # now, its native slot still holding the reference the change waits for.
                if ns.paused and not req.handed_back:
                    ns.held.append((req, bytes(req.capsule)))
                    return
                req.ns = ns
                ana_status = self.ana.io_status(ctrl.port.portid, ns.ana_grpid)
                if ana_status:  # this path cannot serve the namespace now (nvmet_check_ana_state)
                    return self.complete(req, ana_status, location=LOC_NSID)
                if ns.resv is not None and reservations.conflict_status(ns, ctrl, opc):
                    return self.complete(req, reservations.CONFLICT, location=LOC_OPCODE)
                table = self.io_commands
            handler = table.get(opc)
            if handler is None:
                return self.complete(req, S.INVALID_OPCODE | S.DNR, location=LOC_OPCODE)

        status = qs.map_sgl(req)  # the transport's: in-capsule or keyed (transport/registry.py)
        if status:
            return self.complete(req, status, location=LOC_DPTR)
        if EXECUTING not in NEXT[req.state]:  # lifecycle.move, inlined: once per command
            raise IllegalTransition(req, EXECUTING)
        req.state = EXECUTING
        # A reservation command never waits behind QoS: a preempt and abort is what frees a fenced host's queue.
        if ns is not None and ns.qos is not None and opc not in reservations.COMMANDS.handlers and \
                not self.qos.admit(ns, req, lambda r: self._resume_held(r, handler)):
            return  # over its namespace's QoS limit: held (EXECUTING), started when the tokens come back (engine/qos.py)
        if ns is not None and opc in reservations.ACCESS_OF:  # it reaches the medium: it holds the namespace
            req.ref = ref = ns.ref  # until nothing of it can touch it any more (subsystem.py "references")
            ref.take()
            if req.handed_back and self.fences:
                # The native path started it before a fence on its namespace may have begun, and its slot let go of
                # the epoch it started in when it handed it back: it holds the epochs the fences on the namespace
                # wait for too (one of them is its own), so none commits while it runs again
                req.fence_refs = olds = [old for fence in self.fences for _nqn, fns, old in fence.olds if fns is ns]
                for old in olds:
                    old.take()
        if handler(self, req) is None:
            self._missing_outcome(req, handler)

    def _resume_held(self, req: Request, handler: Handler) -> None:
        """A command QoS held gets its turn: its queue may have closed, its namespace been removed since."""
        if req.queue.closed or req.state != EXECUTING:
            if req.state != FREE:
                req.queue.discard(req)
            return
        if req.ns is None or req.ns.removed:
            self.complete(req, S.INVALID_NS | S.DNR, location=LOC_NSID)
            return
        if req.ns.resv is not None and reservations.conflict_status(req.ns, req.queue.ctrl, req.opc):
            self.complete(req, reservations.CONFLICT, location=LOC_OPCODE)  # reserved meanwhile
            return
        if req.opc in reservations.ACCESS_OF:
            req.ref = ref = req.ns.ref
            ref.take()
        try:
            if handler(self, req) is None:
                self._missing_outcome(req, handler)
        except Exception:
            self._internal_error(req)

    def _missing_outcome(self, req: Request, step) -> None:
        """A handler or next step returned no Outcome: a missing branch, answered Internal Error and counted
        unless it did answer, so it never keeps the request's slot."""
        self._internal_error(req, MissingOutcome(f"{getattr(step, '__qualname__', step)} returned no outcome"))

    def fetch(self, req: Request, length: int, next_step: Callable) -> Outcome:
        """Get `length` bytes of host data, then call next_step(target, req, data), which returns an Outcome:
        in-capsule data at once (its outcome is returned), else TRANSFERRING_HOST_TO_CONTROLLER until the
        transport has read it (FETCHING)."""
        if req.inline_offset >= 0:
            start = SQE_SIZE + req.inline_offset
            return next_step(self, req, req.capsule[start:start + length])
        move(req, TRANSFERRING_HOST_TO_CONTROLLER)
        req.next_step = next_step
        req.queue.transport.read_host(req.sgl_addr, req.sgl_key, length, req.read_done, req.tx)
        return FETCHING

    def _host_data_arrived(self, req: Request, data, error) -> None:
        """The RDMA READ of a request finished (called by the transport)."""
        qs = req.queue
        if req.state != TRANSFERRING_HOST_TO_CONTROLLER:
            return
        if qs.closed:
            qs.discard(req)
            return
        if error is not None:
            self.complete(req, S.DATA_XFER_ERROR, location=LOC_DPTR)
            self._close_queue(qs, f"RDMA READ failed: {error}")  # as nvmet: a failed transfer ends the queue
            return
        move(req, EXECUTING)
        step, req.next_step = req.next_step, None
        try:
            if step(self, req, data) is None:
                self._missing_outcome(req, step)
        except Exception:
            self._internal_error(req)
        finally:
            if self.native_data_path and qs.ctrl is not None:
                native_view.refresh(self, qs.ctrl)  # e.g. an I/O queue's Connect, whose data came by RDMA READ

    # A namespace may be removed while its command waits for its I/O engine or for its next slice: the command
    # then answers Invalid Namespace (as a Write whose data arrives after the removal, io._write_data), and the
    # backend is closed only once the job completed (Namespace.retire), never under a running call.
    def run_sliced(self, req: Request, steps, what: str) -> Outcome:
        """EXECUTING in slices: one step of `steps` per loop pass, then complete."""
        ns = req.ns
        ns.jobs += 1
        self.work.sliced(_unless_removed(ns, iter(steps)),
                         lambda exc: self._background_done(req, ns, exc, what), what)
        return DEFERRED

    def _background_done(self, req: Request, ns, exc: Optional[BaseException], what: str) -> None:
        ns.job_done()
        if ns.removed:
            return self.complete(req, S.INVALID_NS | S.DNR)
        if isinstance(exc, (OSError, BackendError)):
            log.error("namespace %s: %s failed: %s", ns.nsid, what, exc)
            status, location = io.device_status(exc, req.opc)
            return self.complete(req, status, location=location)
        if exc is not None:  # a bug, not the device: counted and answered like one on the loop
            return self._internal_error(req, exc)
        self.complete(req, 0)

    def shutdown_flush(self, ctrl: Controller) -> None:
        """CC.SHN: make the namespaces durable (CSTS.SHST 'occurring'), then report 'complete'.
        File and block namespaces flush on their own lanes (engine/ioengine.py), so other hosts are served
        meanwhile."""
        def done(errors):
            if errors:
                log.error("controller %d: flush at shutdown failed: %s", ctrl.cntlid, "; ".join(errors))
            ctrl.shutdown_complete(self.clock())

        io.flush_namespaces(self, list(ctrl.subsystem.namespaces.values()), done)

    def hold(self, req: Request) -> Outcome:
        """HELD: no completion until an event arrives (the AER)."""
        move(req, HELD)
        return HELD_OUTCOME

    def complete(self, req: Request, status: int = 0, result: int = 0, data=None, dw1: int = 0,
                 location: int = NO_LOCATION, source=None) -> Outcome:
        """Send controller-to-host data (if any, on success) and the CQE, then free the request.  `source`:
        (RAM backend, offset) when `data` is the namespace's own memory (TargetQueue.complete)."""
        qs = req.queue
        if qs.closed:
            qs.discard(req)
            return COMPLETED
        transport = qs.transport
        if status:
            ctrl = qs.ctrl
            if ctrl is not None and location != NO_LOCATION:
                ctrl.log_error(req, status, location)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("queue %d cid %#x opc %#04x: %s", qs.qid, req.cid, req.opc, S.describe(status))
            data = None
        elif data is not None and not len(data):
            data = None
        sqhd = qs.next_sqhd()
        invalidate = req.invalidate_key  # the transport's map_sgl set it when the host asked (keyed 0x4F)
        tx = req.tx
        addr, key = req.sgl_addr, req.sgl_key
        if source is not None:  # sent from the namespace's memory: the transport lets go of the reference
            source, req.ref = (source[0], source[1], req.ref), None
        qs.release(req)
        # Data, CQE and invalidate key go to the transport in one call (TargetQueue.complete).
        try:
            try:
                transport.complete(CQE_STRUCT.pack(result & 0xFFFFFFFF, dw1 & 0xFFFFFFFF, sqhd, qs.qid, req.cid,
                                                   (status << 1) & 0xFFFF), data, addr, key, invalidate, tx,
                                   source)
            except TransportError as exc:
                if source is not None and source[2] is not None:
                    source[2].put()  # refused before sending anything: the reference did not pass to it
                    source = None
                if data is None:
                    raise
                # e.g. data longer than the transport can send: report it instead of sending data
                log.warning("queue %d cid %#x: RDMA WRITE not possible: %s", qs.qid, req.cid, exc)
                status = S.DATA_XFER_ERROR
                transport.complete(CQE_STRUCT.pack(0, 0, sqhd, qs.qid, req.cid, (status << 1) & 0xFFFF),
                                   None, addr, key, invalidate, tx)
        except TransportError as exc:
            self._close_queue(qs, f"cannot send a completion: {exc}")
        if status and qs.ctrl is None and req.opc == FABRICS_OPCODE and req.fctype == F.FCTYPE_CONNECT:
            self._connect_failed(qs)
        if self.fences:
            self.check_fences()  # this may have been the last command a change waits for
        return COMPLETED

    def _internal_error(self, req: Request, exc: Optional[BaseException] = None) -> Outcome:
        """A bug, not the host or the device: counted, logged with its traceback (`exc`, or the exception being
        handled), and answered Internal Error | DNR."""
        self.internal_errors += 1
        log.error("internal error handling queue %d cid %#x opc %#04x", req.queue.qid, req.cid, req.opc,
                  exc_info=exc if exc is not None else True)
        if req.state != FREE and not req.queue.closed:
            if req.state == HELD:
                ctrl = req.queue.ctrl
                if ctrl is not None and req in ctrl.aers:
                    ctrl.aers.remove(req)
            try:
                self.complete(req, S.INTERNAL | S.DNR)
            except Exception:
                log.exception("could not complete the failed request")
        return COMPLETED

    def deliver_events(self, ctrl: Controller) -> None:
        """Complete held AERs with pending events."""
        while ctrl.aers and ctrl.pending_events:
            req = ctrl.aers.pop(0)
            if req.queue.closed:
                continue
            self.complete(req, 0, result=ctrl.pending_events.popleft())


def _unless_removed(ns, steps):
    """The slices of `steps` until the namespace is removed; checked before each one, since a slice runs
    inside next()."""
    while not ns.removed:
        try:
            n = next(steps)
        except StopIteration:
            return
        yield n
