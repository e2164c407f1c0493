"""The native data path's read-only view of a queue: what its C queue may serve without Python (docs/native.md).

A queue whose transport runs the native data path (its `data_path` is "native", transport/rdma/native_queue.py)
serves Read, Write and Flush of the namespaces listed here itself; everything else comes to the core.  The view
lists a namespace only when every check of `Target._start` that does not depend on the command passes for it: the
controller is ready, the queue is an authenticated I/O queue, the namespace is attached, not removed, its ANA group
is optimized or non-optimized on the controller's port, and it is RAM (registered with the device), null, a file
or block namespace on the io_uring engine (given as its backend's native handle, a `_native.File`: a dup of its
descriptor and its depth), or an RBD namespace whose image opened in C (its handle a `_native.RbdImage`: its own
client and image, docs/rbd.md), on a queue that serves staged namespaces (bounce chunks and a ring).  Each
namespace is given with its generation (Namespace.generation), its
identity for the C queue: a command whose namespace's generation left the view answers Invalid Namespace; and with
its reference (`Namespace.ref`, engine/subsystem.py "references"), which each native command takes when it is
parsed and lets go of when its slot is freed; and whether it is paused: its new commands then come to the core, which holds
them until the resume (it stays listed, so the commands in flight still find it).  A namespace whose reservation
does not let the controller's host both read and write is listed the same way, paused for that queue: its new
commands come to the core, which answers their conflicts, and the commands in flight from before the change
finish as they started (the change that took the access is answered after them: engine/fencing.py).  The core calls `refresh` after anything that can change one of those (a capsule it handled,
a namespace change, an ANA change, a reservation change) and before the event loop polls again, so a live change never races a command.
The native counters and latency histograms are folded into the namespaces' own figures (`Namespace.bytes_read`, ...,
`ns.stats`' histograms) when the view is replaced and at each tick.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .controller import Controller
    from .core import Target
    from .request import QueueState


def native_queues(ctrl: "Controller"):
    """The controller's I/O queues whose transport runs the native data path."""
    return [qs for qs in ctrl.io_queues.values() if qs.transport.data_path == "native"]


def view_of(target: "Target", qs: "QueueState") -> tuple:
    """(ready, namespaces) for one queue."""
    ctrl = qs.ctrl
    if (qs.closed or ctrl is None or ctrl.dead or ctrl.is_discovery or not ctrl.ready or qs.qid == 0
            or (qs.auth is not None and not qs.auth.authenticated)):
        return False, []
    portid = ctrl.port.portid
    namespaces = []
    for ns in ctrl.subsystem.namespaces.values():
        if ns.removed or target.ana.io_status(portid, ns.ana_grpid):
            continue
        if ns.qos is not None or not ns.visible_to(ctrl.hostnqn):
            continue  # a QoS limit or per-host visibility: the core enforces them (engine/qos.py, core._start)
        # A reservation that restricts this host: its new commands come to the core, which answers their conflicts
        # (engine/reservations.py); the namespace stays listed, as a paused one, so the commands in flight when the
        # access was taken (a preempt's fence waits for them) still find it instead of answering Invalid Namespace
        paused = ns.paused or (ns.resv is not None and not ns.resv.may_read_write(ctrl.hostid))
        backend = ns.backend
        entry = backend.native  # its C entry (csrc/backend.c), or None: the core serves it
        if entry is None:
            continue
        addr = lkey = 0
        if backend.addressable:  # the device reads and writes its memory in place
            region = qs.transport.region_of(backend)
            if region is None:
                continue  # not registered with the device: the core serves it (staged through chunks)
            addr, lkey = region
        elif backend.blocking:  # staged: through the queue's bounce chunks and the entry's completions
            if not qs.transport.serves_files:
                continue
            handle = handle_of(ns)
            if handle is None:
                continue  # the thread engine was chosen (or forced): the core serves it
            namespaces.append((ns.nsid, entry, ns.lbads, ns.num_blocks, 0, 0, ns.generation, ns, ns.ref, paused,
                               handle))
            continue
        namespaces.append((ns.nsid, entry, ns.lbads, ns.num_blocks, addr, lkey, ns.generation, ns, ns.ref, paused))
    return True, namespaces


def handle_of(ns):
    """The namespace's native handle (made once by its backend: a `_native.File` for the uring entry, a
    `_native.RbdImage` for the rbd entry), or None when its commands stay with the core: an engine the entry does
    not share (nvmeof_roce.io_engine "threads", or io_uring unavailable), an image that did not open in C, or its
    backend closed."""
    if ns.native_file is None:
        choice = ns.engine_choice
        ns.native_file = ns.backend.native_handle(choice.name if choice is not None else None, ns.queue_depth)
    return ns.native_file


def _fold(ctrl: "Controller", figures: dict) -> None:
    for nsid, (reads, writes, _flushes, bytes_read, bytes_written, read_lat, write_lat) in figures.items():
        ns = ctrl.subsystem.namespaces.get(nsid)
        if ns is not None:
            ns.read_commands += reads
            ns.write_commands += writes
            ns.bytes_read += bytes_read
            ns.bytes_written += bytes_written
            ns.stats.read_latency.add_buckets(*read_lat)
            ns.stats.write_latency.add_buckets(*write_lat)


def refresh_queue(target: "Target", qs: "QueueState") -> None:
    ready, namespaces = view_of(target, qs)
    # While a change waits for commands in flight (engine/fencing.py), each poll that completes some asks the
    # engine whether they were the last.
    figures = qs.transport.set_view(ready, namespaces, sq_entries=qs.sqsize + 1, sq_head=qs.sqhd,
                                    sqflow_disabled=qs.sqflow_disabled,
                                    drain_check=target.check_fences if target.fencing else None)
    if qs.ctrl is not None:
        _fold(qs.ctrl, figures)


def refresh(target: "Target", ctrl: "Controller") -> None:
    for qs in native_queues(ctrl):
        refresh_queue(target, qs)


def refresh_all(target: "Target") -> None:
    for ctrl in target.controllers():
        refresh(target, ctrl)


def collect(target: "Target") -> None:
    """Fold the native counters into the namespaces' figures; a native command counts as keep-alive traffic."""
    now = target.clock()
    for ctrl in target.controllers():
        for qs in native_queues(ctrl):
            if qs.transport.native_traffic():
                ctrl.last_traffic = now  # CTRATT.TBKAS, as Target._start does for every command
            _fold(ctrl, qs.transport.take_native_stats())
