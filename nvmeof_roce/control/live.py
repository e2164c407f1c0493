"""Live changes to a running userspace target: plan the difference between two configs, then apply it.

Every change -- an RPC on the control socket, or a reload of the config file (SIGHUP) -- is expressed as a
new `TargetConfig`, validated by the one config loader (config.py), and applied here:

    plan(old, new)        the list of `Change`s, or ConfigError for a difference that cannot be made live
                          (a port's queue size, a subsystem's serial...: those need a restart)
    apply(target, new)    prepare every change that can fail (open backends, allocate a resized RAM
                          namespace, open listeners), and only when all are ready commit them; a failure
                          undoes what was prepared, so the running target stays as it was

Each kind of change is a small `Change` subclass: what it acts on, its text for a person, and its steps
(`prepare` / `undo` / `commit` / `install`); `apply` runs the steps in order and does what is common to
every change after them (controllers that lost access, namespace and discovery notices).

After the commit the hosts are told (NVMe 2.0 base spec §5.2 Asynchronous Event Request):
  - Namespace Attribute Changed notices with the Changed Namespace List log (0x04) when a namespace is added,
    removed or resized (nvmet_ns_changed);
  - Discovery Log Page Change notices for discovery controllers whose log changed and that enabled the event
    (persistent discovery controllers; nvmet_port_disc_changed);
  - controllers of a host that lost access (allow-list, subsystem removed from its port, subsystem deleted)
    are ended, as nvmet does when a host is unlinked from a subsystem.
"""
from __future__ import annotations

import logging
from typing import Callable, ClassVar, Dict, List, Optional, Tuple

from ..config import ConfigError, NamespaceConfig, PortConfig, SubsystemConfig, TargetConfig
from ..nvme import admin as A
from ..engine import auth
from ..engine.ana import DEFAULT_GRPID, set_ana_state
from ..engine.backends import BackendError, open_backend
from ..engine.core import PortContext, PortHandler
from ..engine.discovery import discovery_entries
from ..engine.limits import MAX_NSID
from ..engine.subsystem import Namespace, Subsystem, max_qid_of

log = logging.getLogger(__name__)

# Subsystem attributes a running controller has already reported (Identify): changing them needs a restart.
_FIXED_SUBSYSTEM_ATTRS = ("serial", "model", "version", "cntlid_min", "cntlid_max", "pi_enable")


class Listeners:
    """How ports are opened and closed: the RDMA server (serve.py) or a test's loopback fabric implements it."""

    def open(self, target, port: PortConfig) -> None:
        """Listen on `port` with `target.port(port.portid)` (raise to refuse)."""
        raise ConfigError("", f"port {port.portid}", "ports cannot be added to this running target",
                          "restart the target with the new port in its config")

    def close(self, portid: int) -> None:
        """Stop listening on port `portid` (its queues close)."""


class Change:
    """One step of a plan: `action` and what it acts on; `text` says it for a person.

    A subclass per kind of change. Its steps, run by `apply`: `prepare` (everything that can fail on the
    user's input; raises ConfigError), `undo` (gives back what `prepare` made, when another change failed),
    `commit` (in plan order, cannot fail), then `install` (after every commit: what a host sees appear).
    """
    action: ClassVar[str] = ""
    # the discovery log of some host may change, even if no discovery controller is connected to see it
    changes_discovery: ClassVar[bool] = False

    def __init__(self, nqn: str = "", nsid: int = 0, portid: int = -1, host: str = "", text: str = ""):
        self.nqn, self.nsid, self.portid, self.host, self.text = nqn, nsid, portid, host, text

    def prepare(self, run: "_Apply") -> None:
        pass

    def undo(self, run: "_Apply") -> None:
        pass

    def commit(self, run: "_Apply") -> None:
        pass

    def install(self, run: "_Apply") -> None:
        pass

    def to_dict(self) -> dict:
        d = {"action": self.action, "text": self.text}
        if self.nqn:
            d["nqn"] = self.nqn
        if self.nsid:
            d["nsid"] = self.nsid
        if self.portid >= 0:
            d["portid"] = self.portid
        if self.host:
            d["host"] = self.host
        return d

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.to_dict()!r})"


class RemoveSubsystem(Change):
    action = "remove-subsystem"
    changes_discovery = True

    def __init__(self, sub: SubsystemConfig):
        super().__init__(nqn=sub.nqn, text=f"delete subsystem {sub.nqn} ({len(sub.namespaces)} namespace(s)); "
                                           "its controllers are ended")

    def commit(self, run):
        sub = run.target.subsystems.pop(self.nqn)
        run.ended.extend((c, "subsystem deleted") for c in list(sub.controllers.values()))
        for ns in sub.namespaces.values():
            ns.removed = True
        run.removed_subsystems.append(sub)


class AddSubsystem(Change):
    action = "add-subsystem"
    changes_discovery = True

    def __init__(self, sub: SubsystemConfig):
        super().__init__(nqn=sub.nqn, text=f"create subsystem {sub.nqn} with "
                                           f"{len([n for n in sub.namespaces if n.enabled])} namespace(s)")
        self.made: Optional[Subsystem] = None

    def prepare(self, run):
        cfg = run.new_subs[self.nqn]
        self.made = Subsystem(cfg)
        for n in cfg.namespaces:
            if n.enabled:
                ns = _open_ns(run.new, self.nqn, n, run.target.file_lock)
                self.made.namespaces[ns.nsid] = ns

    def undo(self, run):
        if self.made is not None:
            self.made.close()
            self.made = None

    def commit(self, run):
        run.target.subsystems[self.nqn], self.made = self.made, None


class QidMax(Change):
    """nvmet's attr_qid_max: the controllers are ended, the hosts reconnect with it."""
    action = "qid-max"

    def __init__(self, sub: SubsystemConfig):
        super().__init__(nqn=sub.nqn, text=f"{sub.nqn}: at most {sub.attrs.get('qid_max', 'the default')} "
                                           "I/O queues per controller; its controllers are ended to reconnect with it")

    def commit(self, run):
        sub = run.target.subsystems[self.nqn]
        sub.max_qid = max_qid_of(run.new_subs[self.nqn])
        run.ended.extend((c, "qid_max changed") for c in list(sub.controllers.values()))


class RemoveNamespace(Change):
    action = "remove-namespace"

    def __init__(self, nqn: str, nsid: int, verb: str = "remove"):
        super().__init__(nqn=nqn, nsid=nsid, text=f"{nqn}: {verb} namespace {nsid}")

    def commit(self, run):
        run.remove_namespace(self.nqn, self.nsid)


class AddNamespace(Change):
    action = "add-namespace"

    def __init__(self, nqn: str, nsid: int, verb: str = "add"):
        super().__init__(nqn=nqn, nsid=nsid, text=f"{nqn}: {verb} namespace {nsid}")
        self.made: Optional[Namespace] = None

    def _replaces(self, run) -> Optional[Namespace]:
        return None

    def prepare(self, run):
        n = run.new_subs[self.nqn].namespace(self.nsid)
        self.made = _open_ns(run.new, self.nqn, n, run.target.file_lock, self._replaces(run))

    def undo(self, run):
        if self.made is not None:
            _close_quietly(self.made)
            self.made = None

    def install(self, run):
        sub = run.target.subsystems[self.nqn]
        sub.namespaces[self.nsid], self.made = self.made, None
        sub._active_nsids = None
        run.namespace_changed(self.nqn, self.nsid)


class ReplaceNamespace(AddNamespace):
    """A namespace whose device or identifiers changed: the old one goes at the commit, the new one is
    installed with the other new namespaces (a file kept as it was hands its lock over)."""
    action = "replace-namespace"

    def __init__(self, nqn: str, nsid: int):
        super().__init__(nqn, nsid)
        self.text = f"{nqn}: replace namespace {nsid} (its device or identifiers changed)"

    def _replaces(self, run) -> Optional[Namespace]:
        return run.target.subsystems[self.nqn].namespaces.get(self.nsid)

    def commit(self, run):
        run.remove_namespace(self.nqn, self.nsid)


class ResizeNamespace(Change):
    action = "resize-namespace"

    def __init__(self, nqn: str, n: NamespaceConfig):
        super().__init__(nqn=nqn, nsid=n.nsid, text=f"{nqn}: resize namespace {n.nsid} to {n.size_bytes} bytes")
        self.ns: Optional[Namespace] = None
        self.resize: Optional[Callable[[], None]] = None

    def prepare(self, run):
        self.ns = run.target.subsystems[self.nqn].namespaces[self.nsid]
        size = run.new_subs[self.nqn].namespace(self.nsid).size_bytes
        try:
            self.resize = self.ns.backend.prepare_resize(size)
        except BackendError as exc:
            raise ConfigError(run.new.source, f"{_ns_where(run.new, self.nqn, self.nsid)}.nvmeof_roce.size",
                              exc.message, exc.fix) from None

    def install(self, run):
        ns = self.ns
        self.resize()
        ns.num_blocks = ns.backend.num_blocks
        ns.direct_view = getattr(ns.backend, "buffer", None)
        ns.config = run.new_subs[self.nqn].namespace(self.nsid)
        run.namespace_changed(self.nqn, self.nsid)


class NamespaceVisibility(Change):
    """nvmeof_roce.visible_hosts (SPDK's nvmf_ns_add_host / nvmf_ns_remove_host): the subsystem's controllers
    get a Namespace Attribute Changed notice, the hosts that gained or lost the namespace re-read their lists."""
    action = "namespace-visibility"

    def __init__(self, nqn: str, n: NamespaceConfig):
        who = "every host" if n.visible_hosts is None else (", ".join(n.visible_hosts) or "no host")
        super().__init__(nqn=nqn, nsid=n.nsid, text=f"{nqn}: namespace {n.nsid} visible to {who}")

    def commit(self, run):
        run.namespace_changed(self.nqn, self.nsid)


class NamespaceQos(Change):
    """nvmeof_roce.qos (SPDK's bdev_set_qos_limit): the new limits apply from the next command (engine/qos.py)."""
    action = "namespace-qos"

    def __init__(self, nqn: str, n: NamespaceConfig):
        limits = ", ".join(f"{k} {v}" for k, v in sorted(n.qos.items())) or "no limit"
        super().__init__(nqn=nqn, nsid=n.nsid, text=f"{nqn}: namespace {n.nsid} QoS: {limits}")


class AllowAnyHost(Change):
    action = "allow-any-host"
    changes_discovery = True

    def __init__(self, sub: SubsystemConfig):
        super().__init__(nqn=sub.nqn, text=f"{sub.nqn}: "
                                           f"{'allow any host' if sub.allow_any_host else 'enforce the allow-list'}")


class RemoveHost(Change):
    action = "remove-host"
    changes_discovery = True

    def __init__(self, nqn: str, host: str):
        super().__init__(nqn=nqn, host=host, text=f"{nqn}: remove host {host}; its controllers are ended")


class AddHost(Change):
    action = "add-host"
    changes_discovery = True

    def __init__(self, nqn: str, host: str):
        super().__init__(nqn=nqn, host=host, text=f"{nqn}: allow host {host}")


class RemovePort(Change):
    action = "remove-port"
    changes_discovery = True

    def __init__(self, port: PortConfig):
        super().__init__(portid=port.portid, text=f"close port {port.portid} ({port.traddr}:{port.trsvcid_str})")

    def commit(self, run):
        for ctrl in run.target.controllers():
            if getattr(ctrl.port, "portid", None) == self.portid:
                run.ended.append((ctrl, f"port {self.portid} removed"))
        if run.listeners is not None:
            run.listeners.close(self.portid)
        run.target._port_handlers.pop(self.portid, None)


class AddPort(Change):
    action = "add-port"
    changes_discovery = True

    def __init__(self, port: PortConfig):
        super().__init__(portid=port.portid, text=f"listen on port {port.portid} ({port.traddr}:{port.trsvcid_str}) "
                                                  f"for {', '.join(port.subsystems) or 'discovery only'}")
        self.listening = False

    def prepare(self, run):
        port = run.new_ports[self.portid]
        if run.listeners is None:
            run.listeners = Listeners()
        run.target._port_handlers[self.portid] = PortHandler(run.target, PortContext.for_port(run.target, port))
        try:
            run.listeners.open(run.target, port)
            self.listening = True
        except ConfigError as exc:
            raise ConfigError(run.new.source, _port_where(run.new, self.portid), exc.problem, exc.fix) from None
        except Exception as exc:
            raise ConfigError(run.new.source, _port_where(run.new, self.portid), f"cannot listen: {exc}",
                              getattr(exc, "fix", "") or "check the address (nvmeof-roce rdma status)") from None

    def undo(self, run):
        if self.listening:
            self.listening = False
            try:
                run.listeners.close(self.portid)
            except Exception:
                log.exception("closing a listener opened for a refused change")
        run.target._port_handlers.pop(self.portid, None)


class Unlink(Change):
    action = "unlink"
    changes_discovery = True

    def __init__(self, nqn: str, portid: int):
        super().__init__(nqn=nqn, portid=portid,
                         text=f"port {portid}: stop exporting {nqn}; controllers through it are ended")


class Link(Change):
    action = "link"
    changes_discovery = True

    def __init__(self, nqn: str, portid: int):
        super().__init__(nqn=nqn, portid=portid, text=f"port {portid}: export {nqn}")


class Referrals(Change):
    action = "referrals"
    changes_discovery = True

    def __init__(self, portid: int):
        super().__init__(portid=portid, text=f"port {portid}: referrals changed")


class AnaState(Change):
    """A port's ANA group changes state (nvmf_subsystem_listener_set_ana_state, or a reload of a file that says
    so): the port's controllers get the ANA change notice (engine/ana.py set_ana_state)."""
    action = "ana-state"

    def __init__(self, portid: int, grpid: int, state: str):
        super().__init__(portid=portid, text=f"port {portid}: ANA group {grpid} is now {state}")
        self.grpid, self.state = grpid, state

    def commit(self, run):
        set_ana_state(run.target, self.portid, self.grpid, self.state)


class HostKey(Change):
    """DH-HMAC-CHAP settings of a host: read at each admin Connect and re-authentication (auth.settings_for)."""
    action = "host-key"

    def __init__(self, host: str, text: str):
        super().__init__(host=host, text=text)


class Hosts(Change):
    action = "hosts"

    def __init__(self):
        super().__init__(text="top-level host list changed (no effect on access by itself)")


# ----------------------------------------------------------------------------------------------- plan

def _ns_index(sub: SubsystemConfig) -> Dict[int, NamespaceConfig]:
    return {n.nsid: n for n in sub.namespaces}


def _ns_where(config: TargetConfig, nqn: str, nsid: int) -> str:
    for i, s in enumerate(config.subsystems):
        if s.nqn == nqn:
            for j, n in enumerate(s.namespaces):
                if n.nsid == nsid:
                    return f"subsystems[{i}].namespaces[{j}]"
            return f"subsystems[{i}]"
    return "subsystems"


def _sub_where(config: TargetConfig, nqn: str) -> str:
    for i, s in enumerate(config.subsystems):
        if s.nqn == nqn:
            return f"subsystems[{i}]"
    return "subsystems"


def _port_where(config: TargetConfig, portid: int) -> str:
    for i, p in enumerate(config.ports):
        if p.portid == portid:
            return f"ports[{i}]"
    return "ports"


def _ns_identity(n: NamespaceConfig) -> tuple:
    """What a host caches about a namespace: if any of it changes, the namespace is replaced."""
    return (n.enabled, n.backend, n.path, n.block_size, n.uuid, (n.nguid or "").lower(), (n.eui64 or "").lower(),
            n.ana_grpid)


def _ns_size(n: NamespaceConfig) -> Optional[int]:
    return n.size_bytes


def _port_fixed(p: PortConfig) -> tuple:
    return p.trtype, p.adrfam, p.traddr, p.trsvcid, p.treq, sorted(p.params.items())


def _ana_states(p: PortConfig) -> Dict[int, str]:
    """A port's ANA state of every group it names (group 1 is optimized unless listed; engine/ana.py)."""
    states = {DEFAULT_GRPID: "optimized"}
    states.update((a.grpid, a.state) for a in p.ana_groups)
    return states


def plan(old: TargetConfig, new: TargetConfig) -> List[Change]:
    """The changes that turn the running `old` config into `new`, in the order apply() makes them."""
    for i, s in enumerate(new.subsystems):
        for j, n in enumerate(s.namespaces):
            if n.nsid > MAX_NSID:
                raise ConfigError(new.source, f"subsystems[{i}].namespaces[{j}].nsid",
                                  f"{n.nsid} is above {MAX_NSID}, the highest NSID the userspace target serves",
                                  f"use an NSID in 1..{MAX_NSID}")
    changes = _plan_subsystems(old, new) + _plan_ports(old, new) + _plan_host_keys(old, new)
    if old.hosts != new.hosts and not changes:
        changes.append(Hosts())
    return changes


def _plan_subsystems(old: TargetConfig, new: TargetConfig) -> List[Change]:
    changes: List[Change] = []
    old_subs = {s.nqn: s for s in old.subsystems}
    new_subs = {s.nqn: s for s in new.subsystems}
    changes += [RemoveSubsystem(s) for nqn, s in old_subs.items() if nqn not in new_subs]
    for nqn, s in new_subs.items():
        if nqn not in old_subs:
            changes.append(AddSubsystem(s))
            continue
        o = old_subs[nqn]
        for attr in _FIXED_SUBSYSTEM_ATTRS:
            before = o.attrs.get(attr) if attr not in ("serial", "model") else getattr(o, attr)
            after = s.attrs.get(attr) if attr not in ("serial", "model") else getattr(s, attr)
            if before != after:
                raise ConfigError(new.source, f"{_sub_where(new, nqn)}.attr.{attr}",
                                  f"changes from {before!r} to {after!r}, which connected hosts have already read",
                                  "keep the running value, or delete and re-create the subsystem "
                                  "(or restart the target)")
        if o.attrs.get("qid_max") != s.attrs.get("qid_max"):
            changes.append(QidMax(s))
        changes += _plan_namespaces(nqn, o, s)
        if o.allow_any_host != s.allow_any_host:
            changes.append(AllowAnyHost(s))
        changes += [RemoveHost(nqn, h) for h in o.allowed_hosts if h not in s.allowed_hosts]
        changes += [AddHost(nqn, h) for h in s.allowed_hosts if h not in o.allowed_hosts]
    return changes


def _plan_namespaces(nqn: str, o: SubsystemConfig, s: SubsystemConfig) -> List[Change]:
    changes: List[Change] = []
    old_ns, new_ns = _ns_index(o), _ns_index(s)
    for nsid, n in old_ns.items():
        m = new_ns.get(nsid)
        if m is None:
            if n.enabled:
                changes.append(RemoveNamespace(nqn, nsid))
        elif _ns_identity(n) != _ns_identity(m):
            if n.enabled and m.enabled:
                changes.append(ReplaceNamespace(nqn, nsid))
            elif n.enabled:
                changes.append(RemoveNamespace(nqn, nsid, verb="disable"))
            else:
                changes.append(AddNamespace(nqn, nsid, verb="enable"))
        else:
            if m.enabled and _ns_size(n) != _ns_size(m) and _ns_size(m) is not None:
                changes.append(ResizeNamespace(nqn, m))
            if m.enabled and n.visible_hosts != m.visible_hosts:
                changes.append(NamespaceVisibility(nqn, m))
            if m.enabled and n.qos != m.qos:
                changes.append(NamespaceQos(nqn, m))
    changes += [AddNamespace(nqn, nsid) for nsid, m in new_ns.items() if nsid not in old_ns and m.enabled]
    return changes


def _plan_ports(old: TargetConfig, new: TargetConfig) -> List[Change]:
    changes: List[Change] = []
    old_ports = {p.portid: p for p in old.ports}
    new_ports = {p.portid: p for p in new.ports}
    groups = {DEFAULT_GRPID} | {a.grpid for p in old.ports for a in p.ana_groups}  # the running AnaTable's
    changes += [RemovePort(p) for pid, p in old_ports.items() if pid not in new_ports]
    for pid, p in new_ports.items():
        if pid not in old_ports:
            changes.append(AddPort(p))
            continue
        o = old_ports[pid]
        if _port_fixed(o) != _port_fixed(p):
            raise ConfigError(new.source, _port_where(new, pid),
                              "changes its address or parameters, which a running listener cannot take",
                              "add a new port with the new address (and remove the old one), or restart the target")
        before, after = _ana_states(o), _ana_states(p)
        for grpid in sorted(set(before) | set(after)):
            if grpid not in groups:
                raise ConfigError(new.source, f"{_port_where(new, pid)}.ana_groups",
                                  f"ANA group {grpid} does not exist in the running target (groups: "
                                  f"{', '.join(map(str, sorted(groups)))})",
                                  "use an existing group, or restart the target to add one")
            if before.get(grpid, "inaccessible") != after.get(grpid, "inaccessible"):
                changes.append(AnaState(pid, grpid, after.get(grpid, "inaccessible")))
        changes += [Unlink(nqn, pid) for nqn in o.subsystems if nqn not in p.subsystems]
        changes += [Link(nqn, pid) for nqn in p.subsystems if nqn not in o.subsystems]
        if [r.to_dict() for r in o.referrals] != [r.to_dict() for r in p.referrals]:
            changes.append(Referrals(pid))
    return changes


def _plan_host_keys(old: TargetConfig, new: TargetConfig) -> List[Change]:
    changes: List[Change] = []
    old_keys = {h.nqn: h.attrs.get("dhchap") or {} for h in old.host_entries}
    for h in new.host_entries:
        before, after = old_keys.get(h.nqn, {}), h.attrs.get("dhchap") or {}
        if before == after:
            continue
        what = ("added" if after.get("key") and not before.get("key") else
                "removed" if before.get("key") and not after.get("key") else "changed")
        changes.append(HostKey(h.nqn, f"host {h.nqn}: DH-HMAC-CHAP settings {what}; new connections and "
                                      "re-authentications use them, connected controllers keep theirs until they "
                                      "reconnect"))
    for nqn, before in old_keys.items():
        if before.get("key") and nqn not in {h.nqn for h in new.host_entries}:
            changes.append(HostKey(nqn, f"host {nqn}: DH-HMAC-CHAP key removed with the host entry"))
    return changes


# ---------------------------------------------------------------------------------------------- apply

class _Apply:
    """One apply's state, shared by its changes' steps."""

    def __init__(self, target, new: TargetConfig, listeners: Optional[Listeners]):
        self.target, self.new, self.listeners = target, new, listeners
        self.new_subs = {s.nqn: s for s in new.subsystems}
        self.new_ports = {p.portid: p for p in new.ports}
        self.ended: List[Tuple[object, str]] = []  # (controller, reason)
        self.removed_subsystems: List[Subsystem] = []
        self.ns_changed: Dict[str, set] = {}

    def namespace_changed(self, nqn: str, nsid: int) -> None:
        self.ns_changed.setdefault(nqn, set()).add(nsid)

    def remove_namespace(self, nqn: str, nsid: int) -> None:
        _retire_quietly(self.target.subsystems[nqn].remove_namespace(nsid))  # closed now or after its jobs
        self.namespace_changed(nqn, nsid)


def _close_quietly(ns: Namespace) -> None:
    try:
        ns.close()
    except Exception as exc:
        log.error("closing namespace %d: %s", ns.nsid, exc)


def _retire_quietly(ns: Namespace) -> None:
    try:
        ns.retire()
    except Exception as exc:
        log.error("closing namespace %d: %s", ns.nsid, exc)


def _open_ns(config: TargetConfig, nqn: str, n: NamespaceConfig, lock: str, replaces=None) -> Namespace:
    """Open a namespace added live, flocked like one from the config (`replaces`: the namespace it replaces,
    which hands over its lock when the file is the same)."""
    where = _ns_where(config, nqn, n.nsid) + (".device.path" if n.backend == "file" else "")
    try:
        return Namespace(n, open_backend(n, lock=lock, inherit=replaces.backend if replaces is not None else None))
    except BackendError as exc:
        raise exc.config_error(config.source, _ns_where(config, nqn, n.nsid), n) from None
    except OSError as exc:  # what the backend does not name itself: ENOTDIR, ELOOP, ENAMETOOLONG, EIO...
        raise ConfigError(config.source, where, f"{n.path}: cannot open: {exc.strerror or exc}",
                          "give the path of a file or block device") from None


# New namespaces are installed before resized ones take their size (the order hosts are told about them in).
_INSTALL_ORDER = {AddNamespace: 0, ReplaceNamespace: 0, ResizeNamespace: 1}


def apply(target, new: TargetConfig, listeners: Optional[Listeners] = None,
          changes: Optional[List[Change]] = None) -> List[Change]:
    """Make the running `target` serve `new`; returns the changes made. On any error nothing changed."""
    old = target.config
    if changes is None:
        changes = plan(old, new)
    host_auth = auth.host_settings(new)  # ConfigError naming the key before anything changes
    if not changes:
        target.config = new
        target.host_auth = host_auth
        _rebind_configs(target, new)
        return changes
    run = _Apply(target, new, listeners)
    disc_before = {id(c): _disc_view(discovery_entries(target, c)) for c in target.discovery.controllers.values()
                   if c.admin_queue is not None}

    # -- prepare: everything that can fail
    started: List[Change] = []
    try:
        for ch in changes:
            started.append(ch)
            ch.prepare(run)
    except BaseException:
        for ch in started:
            ch.undo(run)
        raise

    # -- commit: nothing below fails on a user's input
    for ch in changes:
        ch.commit(run)
    for ch in sorted(changes, key=lambda c: _INSTALL_ORDER.get(type(c), 0)):
        ch.install(run)

    target.config = new
    target.host_auth = host_auth  # read at each admin Connect and re-authentication (auth.settings_for)
    _rebind_configs(target, new)

    # access: hosts that may no longer reach a subsystem through the port they came in on
    ended = run.ended
    for ctrl in target.controllers():
        sub = ctrl.subsystem
        if sub.is_discovery or ctrl.dead or any(c is ctrl for c, _ in ended):
            continue
        if not sub.host_allowed(ctrl.hostnqn):
            ended.append((ctrl, f"host {ctrl.hostnqn} is no longer allowed"))
        elif not ctrl.port.exports(sub.nqn):
            ended.append((ctrl, f"{sub.nqn} is no longer exported on port {ctrl.port.portid}"))
    for ctrl, reason in ended:
        target._delete_controller(ctrl, reason)
    for sub in run.removed_subsystems:
        for ns in sub.namespaces.values():  # flushed and closed after their controllers ended and their jobs
            _retire_quietly(ns)

    for nqn, nsids in run.ns_changed.items():
        sub = target.subsystems.get(nqn)
        if sub is None:
            continue
        for nsid in sorted(nsids):
            target._namespace_changed(sub, nsid)

    # discovery: tell the controllers whose log page changed
    changed_disc = False
    for ctrl in list(target.discovery.controllers.values()):
        if ctrl.admin_queue is None or ctrl.dead:
            continue
        if disc_before.get(id(ctrl)) != _disc_view(discovery_entries(target, ctrl)):
            if not changed_disc:
                target.genctr += 1
                changed_disc = True
            ctrl.add_event(A.AEN_CFG_DISC_CHANGE,
                           A.aer_result(A.AER_TYPE_NOTICE, A.AER_NOTICE_DISC_CHANGED, A.LID_DISCOVERY))
            target.deliver_events(ctrl)
    if not changed_disc and any(c.changes_discovery for c in changes):
        target.genctr += 1  # what discovery lists changed for some host, even if none is connected now

    for ch in changes:
        log.warning("applied: %s", ch.text)
    return changes


def _rebind_configs(target, new: TargetConfig) -> None:
    """Point the running objects at the new config's parts (ports by portid, subsystems by NQN)."""
    new_subs = {s.nqn: s for s in new.subsystems}
    for nqn, sub in target.subsystems.items():
        cfg = new_subs.get(nqn)
        if cfg is None:
            continue
        sub.config = cfg
        sub.allow_any_host = cfg.allow_any_host
        sub.allowed_hosts = set(cfg.allowed_hosts)
        for ns in sub.namespaces.values():
            n = cfg.namespace(ns.nsid)
            if n is not None:
                ns.config = n
            target.qos.configure(ns)  # its QoS limits as the config now says (engine/qos.py)
    for portid, handler in target._port_handlers.items():
        port = new.port(portid)
        if port is not None:
            handler.ctx.port = port


def _disc_view(entries) -> list:
    return [e.pack() for e in entries]
