"""The engine's administrative verbs: what the control plane (control/live.py) calls to change a running target.

The engine owns its state; the admin layer plans a change and calls verbs, as nvmet's configfs calls
nvmet_ns_enable()/nvmet_ns_disable() and SPDK's RPCs call spdk_nvmf_subsystem_add_ns_ext() between
spdk_nvmf_subsystem_pause() and resume().  `EngineApi` is mixed into `Target` (engine/core.py), so each verb is
called on the target itself: `target.install_namespace(nqn, ns)`.

    namespaces   add_namespace, remove_namespace, set_namespace_size: one whole change each (an RPC's), the
                 running config updated with it; and the steps they and a reload's plan are made of:
                 prepare_namespace (opens the backend: the only place an open error becomes the ConfigError naming
                 the config field), install_namespace, retire_namespace, discard_namespace (prepared, never
                 installed), prepare_resize + resize_namespace, namespace_changed (the hosts' notice)
    subsystems   prepare_subsystem + add_subsystem, remove_subsystem
    fences       pause_namespaces / resume_namespaces, fence (engine/fencing.py), when_drained (pause the
                 namespaces changed, commit once their commands from before are gone, or give up: an `Applying`
                 says which)
    ports        open_port / close_port: the port's queue handler (the listener is the caller's, live.Listeners);
                 set_ana_state (a port's ANA group, its controllers told)
    config       rebind (running objects follow a new config), discovery_views + discovery_changed (genctr, notices)
    controllers  end_controller (engine/core.py): end one now; end_controllers_without_access: after a change, the
                 engine decides whose host lost its way to a subsystem (allow-list, port, export) and ends them

A change fences only the namespaces it changes: they are paused (their new I/O commands wait, never failed,
never dropped, and start on resume in arrival order) and the change commits once the commands that started
before it have let go of their references (engine/subsystem.py "references", engine/fencing.py), whichever queue they are on,
a closing queue of an ended controller included, and whichever data path runs them.  Other namespaces, and other
hosts' commands on them, go on meanwhile.  The wait is checked after each completion, each native poll that
completed something while a fence waits, each queue closed and each tick, never by waiting on the loop.  A
namespace's identity for the native queues is its generation (subsystem.next_generation), new when it is
installed or resized, so a native command of the namespace as it was never completes into the namespace as it is.
"""
from __future__ import annotations

import logging
import threading
import weakref
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from ..config import ConfigError, NamespaceConfig, PortConfig, SubsystemConfig, TargetConfig
from ..config.backends import facts
from ..nvme import admin as A
from ..transport.lifecycle import FREE
from ..errors import NvmeofError
from ..tunables import TARGET_SETTINGS
from . import native_view, reservations
from .ana import DEFAULT_GRPID, set_ana_state as _set_ana_state  # noqa: F401 (DEFAULT_GRPID: for the control plane)
from .backends import BackendError, open_backend
from .discovery import discovery_entries
from .limits import MAX_NSID
from .fencing import Fence
from .subsystem import Namespace, NamespaceState, Subsystem, SubsystemState, next_generation

log = logging.getLogger(__name__)


def namespace_where(config: TargetConfig, nqn: str, nsid: int) -> str:
    """The config field of namespace `nsid` of subsystem `nqn` (`subsystems[i].namespaces[j]`), for errors."""
    for i, s in enumerate(config.subsystems):
        if s.nqn == nqn:
            for j, n in enumerate(s.namespaces):
                if n.nsid == nsid:
                    return f"subsystems[{i}].namespaces[{j}]"
            return f"subsystems[{i}]"
    return "subsystems"


# The bound of a change's wait for the commands in flight on its namespaces (a target setting: engine/fencing.py)
DRAIN_TIMEOUT = TARGET_SETTINGS["drain_timeout"].default


class Applying:
    """A live change under way: `done` once it was committed (`error` None) or given up (`error` says why).  The
    commit of namespace changes waits for the native and Python commands of their subsystems to drain (the
    engine's pause); that is at once when none is in flight, the common case.  `then(fn)` calls `fn(error)`
    when it is done (at once if it is).
    Not control/server.py's DeferredAnswer: this is the change's own outcome, for every caller (an RPC, a reload,
    tests); that is one request's JSON-RPC answer, made from this outcome once the config is saved."""

    def __init__(self):
        self.done = False
        self.error: Optional[Exception] = None
        self._then: List[Callable[[Optional[Exception]], None]] = []

    def then(self, fn: Callable[[Optional[Exception]], None]) -> None:
        if self.done:
            fn(self.error)
        else:
            self._then.append(fn)

    def finish(self, error: Optional[Exception] = None) -> None:
        self.done, self.error = True, error
        callbacks, self._then = self._then, []
        for fn in callbacks:
            fn(error)


class PreparedResize:
    """A namespace's new size, allocated by prepare_resize and not yet in use."""

    def __init__(self, ns: Namespace, ns_config: NamespaceConfig, install: Callable[[], None]):
        self.ns, self.ns_config, self.install = ns, ns_config, install


class EngineApi:
    """The verbs, mixed into Target (module docstring); they use the target's own state, defined in core.py."""

    # -------------------------------------------------------------------------------------------- namespaces
    def add_namespace(self, nqn: str, ns_config: NamespaceConfig, applying: Optional[Applying] = None) -> Applying:
        """Add namespace `ns_config` to running subsystem `nqn` (nvmf_subsystem_add_ns; the caller parsed and checked
        it as the config loader does): its backend opens now (a ConfigError naming its field, and nothing
        changed), then, with the subsystem paused and drained, it is installed, the running config takes it
        and the hosts are told.  The returned `Applying` says when that is done."""
        sub = self.config.subsystem(nqn)
        new = self.config.with_namespaces(nqn, sub.namespaces + [ns_config])
        self._refuse_while_holding(new)
        ns = self.prepare_namespace(nqn, ns_config, new)
        if ns is None:  # configured disabled: nothing to serve
            return self._namespace_change(nqn, ns_config.nsid, new, None, None, applying, "add")
        return self._namespace_change(nqn, ns_config.nsid, new, lambda: self.install_namespace(nqn, ns),
                                      lambda: self.discard_namespace(ns), applying, "add")

    def remove_namespace(self, nqn: str, nsid: int, applying: Optional[Applying] = None) -> Applying:
        """Remove namespace `nsid` from subsystem `nqn` and from the running config (nvmf_subsystem_remove_ns): with
        the subsystem paused and drained, it is retired (commands for it answer Invalid Namespace) and the hosts
        are told.  A namespace configured disabled only leaves the config."""
        sub = self.config.subsystem(nqn)
        new = self.config.with_namespaces(nqn, [n for n in sub.namespaces if n.nsid != nsid])
        self._refuse_while_holding(new)
        running = nsid in self.subsystems[nqn].namespaces
        return self._namespace_change(nqn, nsid, new, (lambda: self.retire_namespace(nqn, nsid)) if running else None,
                                      None, applying, "remove")

    def set_namespace_size(self, nqn: str, ns_config: NamespaceConfig,
                           applying: Optional[Applying] = None) -> Applying:
        """Running namespace `ns_config.nsid` of subsystem `nqn` takes `ns_config`, which differs by its size
        (nvmf_subsystem_resize_ns): the new size is allocated now (a ConfigError naming the size field), and put
        in use with the subsystem paused and drained; the hosts are told.  The same size changes nothing."""
        sub = self.config.subsystem(nqn)
        new = self.config.with_namespaces(nqn, [ns_config if n.nsid == ns_config.nsid else n for n in sub.namespaces])
        self._refuse_while_holding(new)
        if sub.namespace(ns_config.nsid).size_bytes == ns_config.size_bytes or ns_config.size_bytes is None:
            return self._namespace_change(nqn, ns_config.nsid, new, None, None, applying, "")
        resize = self.prepare_resize(nqn, ns_config, new)
        return self._namespace_change(nqn, ns_config.nsid, new, lambda: self.resize_namespace(nqn, resize), None,
                                      applying, f"resize namespace {ns_config.nsid} to {ns_config.size_bytes} bytes")

    def _refuse_while_holding(self, new: TargetConfig) -> None:
        """A change is refused while another one waits for its commands in flight (it was made against a config
        that is about to change)."""
        waiting = self.changing()
        if waiting:
            raise ConfigError(new.source, "", f"a live change to {waiting[0]} is still waiting for its commands in "
                              "flight to finish", "send this change again once that one is applied")

    def _namespace_change(self, nqn: str, nsid: int, new: TargetConfig, step: Optional[Callable[[], None]],
                          undo: Optional[Callable[[], None]], applying: Optional[Applying], verb: str) -> Applying:
        """Make one prepared namespace change: with the namespace paused and its commands from before gone, `step`,
        the running config becomes `new`, resume, the hosts told (Namespace Attribute Changed).  Without a step
        only the config changes, at once."""
        applying = applying or Applying()
        if step is None:
            self.rebind(new, self.host_auth)
            applying.finish()
            return applying

        def commit() -> None:
            step()
            self.rebind(new, self.host_auth)
            self.namespace_changed(nqn, nsid)
            log.warning("applied: %s: %s", nqn, verb if " " in verb else f"{verb} namespace {nsid}")

        self.when_drained([(nqn, nsid)], commit, undo or (lambda: None), applying, new.source)
        return applying

    def prepare_namespace(self, nqn: str, ns_config: NamespaceConfig, config: Optional[TargetConfig] = None,
                          replaces: Optional[Namespace] = None) -> Optional[Namespace]:
        """Open namespace `ns_config` of subsystem `nqn`, not yet seen by any host (None when it is configured
        disabled).  A failure is the ConfigError naming its field in `config` (the one being applied; the
        running one by default).  `replaces`: the namespace it replaces, which hands over its file lock when the
        file is the same."""
        config = config or self.config
        where = namespace_where(config, nqn, ns_config.nsid)
        if not 1 <= ns_config.nsid <= MAX_NSID:
            raise ConfigError(config.source, f"{where}.nsid", f"{nqn}: NSID {ns_config.nsid} is outside 1..{MAX_NSID}",
                              f"use an NSID in 1..{MAX_NSID}")
        if not ns_config.enabled:
            return None
        inherit = replaces.backend if replaces is not None else None
        try:
            return Namespace(ns_config, open_backend(ns_config, lock=self.file_lock, inherit=inherit))
        except BackendError as exc:
            raise exc.config_error(config.source, where, ns_config) from None
        except OSError as exc:  # what the backend does not name itself: ENOTDIR, ELOOP, ENAMETOOLONG, EIO...
            field = f"{where}.device.path" if facts(ns_config.backend).path else where
            raise ConfigError(config.source, field, f"{ns_config.path}: cannot open: {exc.strerror or exc}",
                              "give the path of a file or block device") from None

    def install_namespace(self, nqn: str, ns: Namespace) -> None:
        """A prepared namespace joins subsystem `nqn`: commands reach it from now on (nvmet_ns_enable).  The
        hosts are told by namespace_changed, once the whole change is made."""
        ns.generation = next_generation()
        self.subsystems[nqn].add_namespace(ns)
        self.qos.configure(ns)
        self._watch_storage(nqn, ns)

    def _watch_storage(self, nqn: str, ns: Namespace) -> None:
        # the listener holds the namespace weakly: its backend holds the listener, and a cycle would keep a removed
        # namespace's memory until the collector's next full pass
        ref = weakref.ref(ns)

        def on_loop(size: int) -> None:
            live = ref()
            if live is not None:
                self.storage_resized(nqn, live, size)

        loop_thread = threading.get_ident()  # the engine's: where namespaces are installed

        def listener(_backend, size: int) -> None:  # any thread (an RBD watch's): brought to the loop
            if threading.get_ident() != loop_thread and self.work.attached:
                self.work.post(lambda: on_loop(size))
            else:
                on_loop(size)
        ns.backend.watch_resize(listener)

    def storage_resized(self, nqn: str, ns: Namespace, size_bytes: int) -> None:
        """A backend's resize notice, on the loop: its storage has `size_bytes` now, changed outside the target (a
        file grown, an image resized).  A backend whose size is its storage's (follow_size: an RBD image) is
        followed, grown or shrunk, through the resize path (the namespace paused and fenced, resize_namespace, the
        hosts told: Namespace Attribute Changed); the storage itself is not touched again.  Any other namespace
        keeps its size (hosts see no change) until `target resize-ns`; `storage_size` records it for status."""
        if ns.removed:
            return
        ns.storage_size = size_bytes
        commit = ns.backend.follow_size(size_bytes)
        if commit is None:
            log.warning("%s namespace %d: its storage is %d bytes now, the namespace %d: resize the namespace to "
                        "serve the new size (nvmeof-roce target resize-ns)", nqn, ns.nsid, size_bytes,
                        ns.num_blocks * ns.block_size)
            return
        if size_bytes // ns.block_size == ns.num_blocks:
            ns.storage_size = None
            return
        sub = self.subsystems.get(nqn)
        if sub is None or sub.namespaces.get(ns.nsid) is not ns:
            return
        if ns.paused:  # another change to it is under way: follow once it is applied (the next tick after)
            def later(_now: float) -> None:
                if not ns.paused:
                    self.tick_hooks.remove(later)
                    if ns.storage_size is not None:
                        self.storage_resized(nqn, ns, ns.storage_size)
            self.tick_hooks.append(later)
            return
        before = ns.num_blocks * ns.block_size

        def follow() -> None:
            if not ns.removed:
                self.resize_namespace(nqn, PreparedResize(ns, ns.config, commit))
            self.namespace_changed(nqn, ns.nsid)
            log.warning("%s namespace %d: its storage was resized outside: %d -> %d bytes%s", nqn, ns.nsid, before,
                        ns.num_blocks * ns.block_size, " (shrunk: the blocks past the end are gone)"
                        if ns.num_blocks * ns.block_size < before else "")
        self.when_drained([(nqn, ns.nsid)], follow, lambda: None, Applying(), self.config.source)

    def retire_namespace(self, nqn: str, nsid: int) -> Namespace:
        """Namespace `nsid` leaves subsystem `nqn` (nvmet_ns_disable): commands for it answer Invalid Namespace;
        its backend is flushed and closed now, or after its background jobs (a Flush on an I/O engine's lane, a
        sliced zeroing).  An error closing it is logged: the namespace is gone either way."""
        ns = self.subsystems[nqn].remove_namespace(nsid)
        _retire_quietly(nqn, ns)
        return ns

    @staticmethod
    def discard_namespace(ns: Namespace) -> None:
        """Close a prepared namespace that is not to be installed (another part of the change failed)."""
        try:
            ns.close()
        except Exception as exc:
            log.error("closing namespace %d: %s", ns.nsid, exc)

    def prepare_resize(self, nqn: str, ns_config: NamespaceConfig,
                       config: Optional[TargetConfig] = None) -> PreparedResize:
        """Allocate the new size `ns_config.size_bytes` of a running namespace (the ConfigError naming the size
        field if it cannot be); resize_namespace puts it in use."""
        config = config or self.config
        ns = self.subsystems[nqn].namespaces[ns_config.nsid]
        try:
            install = ns.backend.prepare_resize(ns_config.size_bytes)
        except BackendError as exc:
            raise ConfigError(config.source, f"{namespace_where(config, nqn, ns_config.nsid)}.nvmeof_roce.size",
                              exc.message, exc.fix) from None
        return PreparedResize(ns, ns_config, install)

    def resize_namespace(self, nqn: str, resize: PreparedResize) -> None:
        """Put a prepared size in use: commands see the new capacity from the next one."""
        ns = resize.ns
        resize.install()
        ns.generation = next_generation()  # its memory may have moved: commands of the old size are not its
        ns.num_blocks = ns.backend.num_blocks
        ns.direct_view = ns.backend.buffer
        ns.config = resize.ns_config
        ns.storage_size = None

    def namespace_changed(self, nqn: str, nsid: int) -> None:
        """Tell the controllers of subsystem `nqn` that namespace `nsid` changed (Namespace Attribute Changed,
        the Changed Namespace List log; nvmet_ns_changed)."""
        sub = self.subsystems.get(nqn)
        if sub is None:
            return
        for ctrl in list(sub.controllers.values()):
            if self.native_data_path:
                native_view.refresh(self, ctrl)
            ctrl.ns_changed(nsid)
            self.deliver_events(ctrl)

    # -------------------------------------------------------------------------------------------- subsystems
    def prepare_subsystem(self, sub_config: SubsystemConfig, config: Optional[TargetConfig] = None) -> Subsystem:
        """A subsystem with its enabled namespaces open, not yet reachable (add_subsystem makes it so); on an
        error what it opened is closed.  A namespace whose storage does not answer now (a Ceph cluster down) is
        left pending, tried again in the background (engine/pending.py)."""
        sub = Subsystem(sub_config)
        try:
            for ns_config in sub_config.namespaces:
                try:
                    ns = self.prepare_namespace(sub_config.nqn, ns_config, config)
                except ConfigError as exc:  # a storage not reachable now waits in the background (pending.py)
                    if not self.pending.defer(sub_config.nqn, ns_config, exc):
                        raise
                    continue
                if ns is not None:
                    sub.add_namespace(ns)
                    self._watch_storage(sub_config.nqn, ns)
                    self.qos.configure(ns)
        except BaseException:
            sub.close()
            raise
        return sub

    def add_subsystem(self, sub: Subsystem) -> None:
        """A prepared subsystem becomes reachable (through the ports that export it)."""
        if sub.nqn in self.subsystems:
            raise ValueError(f"subsystem {sub.nqn} already exists")
        self.subsystems[sub.nqn] = sub

    def remove_subsystem(self, nqn: str, reason: str = "subsystem deleted") -> Subsystem:
        """Delete subsystem `nqn`: its controllers are ended now, then its namespaces retired (closed now, or
        after their background jobs)."""
        sub = self.subsystems.pop(nqn)
        sub.enter(SubsystemState.REMOVED)
        for ns in sub.namespaces.values():
            ns.enter(NamespaceState.REMOVED)  # a command still running on one answers Invalid Namespace
        for ctrl in list(sub.controllers.values()):
            self.end_controller(ctrl, reason)
        for ns in sub.namespaces.values():
            while ns.held:  # waiting for a resume that will not come: their queues closed with their controllers
                req, _ = ns.held.popleft()
                if req.state != FREE:
                    req.queue.discard(req)
        for ns in sub.namespaces.values():
            _retire_quietly(nqn, ns)
        return sub

    # -------------------------------------------------------------------------------------------- fences
    def pause_namespaces(self, targets: Iterable[Tuple[str, int]]) -> List[Tuple[str, Namespace]]:
        """Pause the namespaces `targets` names ((nqn, nsid); those that do not exist are skipped): from now on
        their new I/O commands wait, in arrival order, for resume_namespaces (SPDK pauses one namespace of a
        subsystem the same way).  Their native queues hand those commands to the core, which holds them.
        Returns what was paused, for resume_namespaces."""
        paused = []
        for nqn, nsid in targets:
            sub = self.subsystems.get(nqn)
            ns = sub.namespaces.get(nsid) if sub is not None else None
            if ns is not None and not ns.removed and not ns.paused:
                ns.enter(NamespaceState.PAUSED)
                paused.append((nqn, ns))
        for nqn in {nqn for nqn, _ns in paused}:
            self._refresh_native(self.subsystems[nqn])
        return paused

    def resume_namespaces(self, paused: Iterable[Tuple[str, Namespace]]) -> None:
        """Resume what pause_namespaces paused: the commands that waited start, in the order they arrived, from
        their checks again (the namespace may have been replaced or removed meanwhile)."""
        for nqn, ns in paused:
            if ns.paused:
                ns.enter(NamespaceState.ACTIVE)
            if nqn in self.subsystems:
                self._refresh_native(self.subsystems[nqn])
        for _nqn, ns in paused:
            while ns.held and not ns.paused:  # a callback run meanwhile may pause it again
                req, capsule = ns.held.popleft()
                self._start_held(req, capsule)

    def fence(self, namespaces: List[Tuple[str, Namespace]], done: Callable[[Optional[Exception]], None],
              what: str, source: str = "") -> None:
        """Call `done(None)` once no command started before now on `namespaces` ((nqn, ns)) can touch them any
        more, on either data path and on any queue, an ended controller's included (engine/fencing.py); at once
        when none is in flight.  After the drain_timeout the queues still holding such commands are torn down;
        after twice that, `done(error)`."""
        fence = Fence(self, namespaces, done, self.config.settings.drain_timeout, what, source)
        self.fences.append(fence)  # it leaves the list when it finishes
        for nqn in {nqn for nqn, _ns in namespaces}:
            if nqn in self.subsystems:
                self._refresh_native(self.subsystems[nqn])  # the native queues take the new epochs
        fence.check(self.clock())

    @property
    def fencing(self) -> bool:
        """A change is waiting for commands in flight (the native queues then ask after each poll)."""
        return bool(self.fences)

    def check_fences(self) -> None:
        """The fences whose old references are all let go are done (after each completion while one waits, each
        native poll that completed something, each queue closed, each tick)."""
        if not self.fences:
            return
        now = self.clock()
        for fence in list(self.fences):
            fence.check(now)

    def when_drained(self, targets: List[Tuple[str, int]], commit: Callable[[], Optional[list]],
                     undo: Callable[[], None], applying: Applying, source: str = "") -> None:
        """Pause the namespaces `targets` names ((nqn, nsid)) and, once none of their commands from before is in
        flight (at once when none is), call `commit`, resume them and finish `applying` (once the namespaces
        `commit` returns are fenced too: those of controllers it ended, finish_after_fence).  Given up (engine/
        fencing.py's bound), they resume as they were, `undo` gives back what was prepared, and `applying`
        finishes with the ConfigError naming what was still in flight (`source`: the config's file)."""
        paused = self.pause_namespaces(targets)

        def drained(error: Optional[Exception]) -> None:
            if applying.done:
                return
            if error is not None:
                self.resume_namespaces(paused)
                undo()
                log.error("live change given up: %s", error)
                applying.finish(error)
                return
            try:
                after = commit()
            finally:  # a bug above must not leave their commands waiting for good
                self.resume_namespaces(paused)
            self.finish_after_fence(after or [], applying, source)

        what = "a change to " + (", ".join(f"{nqn} namespace {nsid}" for nqn, nsid in targets) or "no namespace")
        self.fence(paused, drained, what, source)

    def finish_after_fence(self, namespaces: List[Tuple[str, Namespace]], applying: Applying,
                           source: str = "") -> None:
        """Finish `applying` once the commands in flight on `namespaces` are gone (at once without any): a change
        that ended controllers (a host removed, a port unlinked) is done when their I/O can no longer land."""
        if not namespaces:
            applying.finish()
            return
        self.fence(namespaces, applying.finish, "the end of controllers that lost their access", source)

    def changing(self) -> List[str]:
        """The namespaces a change is waiting for ("nqn namespace N"): another change is refused meanwhile."""
        return [f"{sub.nqn} namespace {ns.nsid}" for sub in self.subsystems.values()
                for ns in sub.namespaces.values() if ns.paused]

    def commands_running(self, nqn: str) -> int:
        """Commands in flight on subsystem `nqn`'s namespaces, both data paths, by their references."""
        return sum(ns.ref.count for ns in self.subsystems[nqn].namespaces.values())

    def native_in_flight(self, nqn: str) -> Dict[int, int]:
        """{nsid: commands} the native queues of subsystem `nqn` have in flight, found by the namespaces'
        generations (NSID 0: a generation none of its namespaces has any more, a namespace already gone)."""
        sub = self.subsystems[nqn]
        nsid_of = {ns.generation: ns.nsid for ns in sub.namespaces.values()}
        counts: Dict[int, int] = {}
        for qs in self.queue_states():  # a closing one's too, an ended controller's included
            if qs.ctrl is None or qs.ctrl.subsystem is not sub:
                continue
            for generation, n in qs.transport.native_in_flight().items():
                nsid = nsid_of.get(generation, 0)
                counts[nsid] = counts.get(nsid, 0) + n
        return counts

    def _refresh_native(self, sub: Subsystem) -> None:
        if self.native_data_path:
            for ctrl in list(sub.controllers.values()):
                native_view.refresh(self, ctrl)

    # -------------------------------------------------------------------------------------------- reservations
    def save_reservations(self) -> None:
        """Write the reservations that persist through power loss to the reservation file (OSError if it
        cannot be written: the change is then not made)."""
        reservations.save(self.reservation_file, self.subsystems)

    def restore_reservations(self) -> None:
        """Read the reservation file back (at start): NvmeofError naming it if it cannot be read."""
        try:
            n = reservations.restore(self.reservation_file, self.subsystems)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise NvmeofError(f"{self.reservation_file}: cannot read the reservations kept through power loss: "
                              f"{exc}", "repair or remove the file (removing it clears those reservations)") from None
        if n:
            log.info("%s: %d namespace reservation(s) restored", self.reservation_file, n)

    def set_reservations(self, nqn: str, nsid: int, enable: bool) -> None:
        """Reservations on or off for a running namespace (its subsystem paused by the caller; the caller
        refused turning them off while hosts are registered).  Off, a reservation kept through power loss is
        forgotten."""
        ns = self.subsystems[nqn].namespaces[nsid]
        if enable == (ns.resv is not None):
            return
        kept = ns.resv is not None and ns.resv.ptpl
        ns.resv = reservations.Reservation() if enable else None
        if kept and self.reservation_file:
            try:
                self.save_reservations()
            except OSError as exc:
                log.error("%s: cannot forget the reservation of %s namespace %d: %s", self.reservation_file, nqn,
                          nsid, exc)
        self._refresh_native(self.subsystems[nqn])

    def reservation_status(self, nqn: str, nsid: int) -> dict:
        """A namespace's reservation state (the RPC and `target status`); KeyError if there is no such namespace,
        ValueError if it has no reservations."""
        ns = self.subsystems[nqn].namespaces[nsid]
        if ns.resv is None:
            raise ValueError(f"{nqn} namespace {nsid} has no reservations (its config has no \"resv\": "
                             "{\"enable\": \"1\"})")
        return ns.resv.status()

    # -------------------------------------------------------------------------------------------- ports
    def open_port(self, port: PortConfig):
        """The queue handler (core.PortHandler) of a port being added, given to its listener; the port need not
        be in the running config yet."""
        handler = self._port_handlers[port.portid] = self._new_port_handler(port)
        return handler

    def close_port(self, portid: int) -> None:
        """Forget port `portid`'s queue handler (its listener is closed by the caller, its controllers ended)."""
        self._port_handlers.pop(portid, None)

    # -------------------------------------------------------------------------------------------- ANA
    def set_ana_state(self, portid: int, grpid: int, state: str) -> bool:
        """ANA group `grpid` of port `portid` is now `state`: the port's controllers get the ANA change notice
        (engine/ana.py); False when it already was."""
        return _set_ana_state(self, portid, grpid, state)

    # -------------------------------------------------------------------------------------------- config, discovery
    def rebind(self, config: TargetConfig, host_auth: dict) -> None:
        """Serve `config` from now on: the running subsystems, namespaces and ports follow its parts (by NQN,
        NSID and portid), and the hosts' DH-HMAC-CHAP settings are `host_auth` (auth.host_settings(config)),
        read at each admin Connect and re-authentication."""
        self.config = config
        self.host_auth = host_auth
        new_subs = {s.nqn: s for s in config.subsystems}
        for nqn, sub in self.subsystems.items():
            cfg = new_subs.get(nqn)
            if cfg is None:
                continue
            sub.rebind(cfg)
            for ns in sub.namespaces.values():
                n = cfg.namespace(ns.nsid)
                if n is not None:
                    ns.config = n
                self.qos.configure(ns)  # its QoS limits as the config now says (engine/qos.py)
        for portid, handler in self._port_handlers.items():
            port = config.port(portid)
            if port is not None:
                handler.ctx.port = port

    def end_controllers_without_access(self, also: Iterable[Tuple[object, str]] = ()) -> List[Tuple[str, Namespace]]:
        """After a change: end the controllers `also` names ((controller, reason): those the change itself ends,
        such as a new qid_max's), and every controller whose host may no longer reach its subsystem through the
        port it came in on: the port was closed, the host left the allow-list, or the port stopped exporting the
        subsystem (as nvmet ends a host's controllers when it is unlinked).  Returns the namespaces their commands
        may still be in flight on, for finish_after_fence."""
        ended = list(also)
        for ctrl in self.controllers():
            sub = ctrl.subsystem
            if ctrl.dead or any(c is ctrl for c, _ in ended):
                continue
            portid = ctrl.port.portid
            if portid is not None and self.config.port(portid) is None:  # discovery controllers too
                ended.append((ctrl, f"port {portid} removed"))
            elif sub.is_discovery:
                continue
            elif not sub.host_allowed(ctrl.hostnqn):
                ended.append((ctrl, f"host {ctrl.hostnqn} is no longer allowed"))
            elif not ctrl.port.exports(sub.nqn):
                ended.append((ctrl, f"{sub.nqn} is no longer exported on port {ctrl.port.portid}"))
        for ctrl, reason in ended:
            self.end_controller(ctrl, reason)
        # their commands in flight may still land: the change is done once they are gone (finish_after_fence)
        subs = {id(c.subsystem): c.subsystem for c, _ in ended if not c.subsystem.is_discovery}
        return [(sub.nqn, ns) for sub in subs.values() if self.subsystems.get(sub.nqn) is sub
                for ns in sub.namespaces.values()]

    def discovery_views(self) -> Dict[int, List[bytes]]:
        """What the discovery log of each connected discovery controller lists now, for discovery_changed."""
        return {id(c): _discovery_view(self, c) for c in self.discovery.controllers.values()
                if c.admin_queue is not None}

    def discovery_changed(self, before: Dict[int, List[bytes]], listings_changed: bool = False) -> None:
        """After a change: each connected discovery controller whose log differs from `before` (discovery_views)
        gets a Discovery Log Page Change notice if it enabled it (nvmet_port_disc_changed); the log's generation
        counter moves on once if any log differs, or if `listings_changed` (what discovery lists changed for
        some host, even if none is connected now)."""
        changed = False
        for ctrl in list(self.discovery.controllers.values()):
            if ctrl.admin_queue is None or ctrl.dead:
                continue
            if before.get(id(ctrl)) != _discovery_view(self, ctrl):
                if not changed:
                    self.genctr += 1
                    changed = True
                ctrl.add_event(A.AEN_CFG_DISC_CHANGE,
                               A.aer_result(A.AER_TYPE_NOTICE, A.AER_NOTICE_DISC_CHANGED, A.LID_DISCOVERY))
                self.deliver_events(ctrl)
        if not changed and listings_changed:
            self.genctr += 1


def _retire_quietly(nqn: str, ns: Namespace) -> None:
    try:
        ns.retire()
    except Exception as exc:
        log.error("%s: closing namespace %d: %s", nqn, ns.nsid, exc)


def _discovery_view(target, ctrl) -> List[bytes]:
    return [e.pack() for e in discovery_entries(target, ctrl)]
