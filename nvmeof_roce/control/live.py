"""Live changes to a running userspace target: plan the difference between two configs, then apply it.

A reload of the config file (SIGHUP, `nvmeof_reload_config`) and the RPCs that edit more than one namespace are
expressed as a new `TargetConfig`, validated by the one config loader (config/), and applied here (an RPC that
adds, resizes or removes one namespace calls the engine's verb for it instead: control/rpc/namespaces.py):

    plan_change(target, new)  the hosts' keys read once (engine/auth.py host_settings) and `plan` run once:
                          the list of `Change`s, or ConfigError for a difference that cannot be made live
                          (a port's queue size, a subsystem's serial...: those need a restart)
    apply(target, new)    prepare every change that can fail (open backends, check a resized RAM
                          namespace, open listeners), and only when all are ready commit them; a failure
                          undoes what was prepared, so the running target stays as it was.  The commit
                          waits for the changed namespaces' commands in flight (the engine's
                          `when_drained`; the `Applying` says when)

Each kind of change is a small `Change` subclass: what it acts on, its text for a person, and its steps
(`prepare` / `undo` / `commit` / `install`); `apply` runs the steps in order and does what is common to
every change after them (namespace and discovery notices).  This module only plans and calls the engine's
verbs (engine/api.py): it never changes the engine's objects itself, and which controllers lose access is the
engine's decision (`end_controllers_without_access`).  The commit of namespace changes is bracketed by pause
and resume of the namespaces they change, and made once their commands from before (the native data path's too)
are gone; a change that ends controllers is done once their commands can no longer land (engine/fencing.py).

After the commit the hosts are told (NVMe 2.0 base spec §5.2 Asynchronous Event Request):
  - Namespace Attribute Changed notices with the Changed Namespace List log (0x04) when a namespace is added,
    removed or resized (nvmet_ns_changed);
  - Discovery Log Page Change notices for discovery controllers whose log changed and that enabled the event
    (persistent discovery controllers; nvmet_port_disc_changed);
  - controllers of a host that lost access (allow-list, subsystem removed from its port, subsystem deleted,
    port closed) are ended, as nvmet does when a host is unlinked from a subsystem.
"""
from __future__ import annotations

import logging
from typing import ClassVar, Dict, List, Optional, Tuple

from ..config import ConfigError, NamespaceConfig, PortConfig, SubsystemConfig, TargetConfig
from ..engine import auth
from ..engine.api import (DEFAULT_GRPID, DRAIN_TIMEOUT, MAX_NSID, Applying, Namespace,  # noqa: F401 (DRAIN_TIMEOUT
                          PreparedResize, Subsystem, namespace_where)                   # and Applying re-exported)
from ..errors import NvmeofError
from .protocol import RpcError

log = logging.getLogger(__name__)

# Subsystem attributes a running controller has already reported (Identify): changing them needs a restart.
_FIXED_SUBSYSTEM_ATTRS = ("serial", "model", "version", "cntlid_min", "cntlid_max", "pi_enable")


def _fixed_attr(s: SubsystemConfig, attr: str):
    """One of _FIXED_SUBSYSTEM_ATTRS of `s`: serial and model are fields of their own, the others attrs."""
    if attr == "serial":
        return s.serial
    if attr == "model":
        return s.model
    return s.attrs.get(attr)


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
    # changes a namespace of a running subsystem: committed while that namespace is paused
    pauses: ClassVar[bool] = False

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
        run.target.remove_subsystem(self.nqn, "subsystem deleted")


class AddSubsystem(Change):
    action = "add-subsystem"
    changes_discovery = True

    def __init__(self, sub: SubsystemConfig):
        super().__init__(nqn=sub.nqn, text=f"create subsystem {sub.nqn} with "
                                           f"{len([n for n in sub.namespaces if n.enabled])} namespace(s)")
        self.made: Optional[Subsystem] = None

    def prepare(self, run):
        self.made = run.target.prepare_subsystem(run.new_subs[self.nqn], run.new)

    def undo(self, run):
        if self.made is not None:
            self.made.close()
            self.made = None

    def commit(self, run):
        run.target.add_subsystem(self.made)
        self.made = None


class QidMax(Change):
    """nvmet's attr_qid_max: the controllers are ended, the hosts reconnect with it."""
    action = "qid-max"

    def __init__(self, sub: SubsystemConfig):
        super().__init__(nqn=sub.nqn, text=f"{sub.nqn}: at most {sub.attrs.get('qid_max', 'the default')} "
                                           "I/O queues per controller; its controllers are ended to reconnect with it")

    def commit(self, run):  # the subsystem takes the new qid_max with the new config (Target.rebind)
        run.ended.extend((c, "qid_max changed") for c in list(run.target.subsystem(self.nqn).controllers.values()))


class RemoveNamespace(Change):
    action = "remove-namespace"
    pauses = True

    def __init__(self, nqn: str, nsid: int, verb: str = "remove"):
        super().__init__(nqn=nqn, nsid=nsid, text=f"{nqn}: {verb} namespace {nsid}")

    def commit(self, run):
        run.remove_namespace(self.nqn, self.nsid)


class AddNamespace(Change):
    action = "add-namespace"
    pauses = True

    def __init__(self, nqn: str, nsid: int, verb: str = "add"):
        super().__init__(nqn=nqn, nsid=nsid, text=f"{nqn}: {verb} namespace {nsid}")
        self.made: Optional[Namespace] = None

    def _replaces(self, run) -> Optional[Namespace]:
        return None

    def prepare(self, run):
        n = run.new_subs[self.nqn].namespace(self.nsid)
        self.made = run.target.prepare_namespace(self.nqn, n, run.new, replaces=self._replaces(run))

    def undo(self, run):
        if self.made is not None:
            run.target.discard_namespace(self.made)
            self.made = None

    def install(self, run):
        run.target.install_namespace(self.nqn, self.made)
        self.made = None
        run.namespace_changed(self.nqn, self.nsid)


class ReplaceNamespace(AddNamespace):
    """A namespace whose device or identifiers changed: the old one goes at the commit, the new one is
    installed with the other new namespaces (a file kept as it was hands its lock over)."""
    action = "replace-namespace"

    def __init__(self, nqn: str, nsid: int):
        super().__init__(nqn, nsid)
        self.text = f"{nqn}: replace namespace {nsid} (its device or identifiers changed)"

    def _replaces(self, run) -> Optional[Namespace]:
        return run.target.subsystem(self.nqn).namespaces.get(self.nsid)

    def commit(self, run):
        run.remove_namespace(self.nqn, self.nsid)


class ResizeNamespace(Change):
    action = "resize-namespace"
    pauses = True

    def __init__(self, nqn: str, n: NamespaceConfig):
        super().__init__(nqn=nqn, nsid=n.nsid, text=f"{nqn}: resize namespace {n.nsid} to {n.size_bytes} bytes")
        self.resize: Optional[PreparedResize] = None

    def prepare(self, run):
        self.resize = run.target.prepare_resize(self.nqn, run.new_subs[self.nqn].namespace(self.nsid), run.new)

    def install(self, run):
        run.target.resize_namespace(self.nqn, self.resize)
        run.namespace_changed(self.nqn, self.nsid)


class NamespaceVisibility(Change):
    """nvmeof_roce.visible_hosts (SPDK's nvmf_ns_add_host / nvmf_ns_remove_host): the subsystem's controllers
    get a Namespace Attribute Changed notice, the hosts that gained or lost the namespace re-read their lists."""
    action = "namespace-visibility"
    pauses = True

    def __init__(self, nqn: str, n: NamespaceConfig):
        who = "every host" if n.visible_hosts is None else (", ".join(n.visible_hosts) or "no host")
        super().__init__(nqn=nqn, nsid=n.nsid, text=f"{nqn}: namespace {n.nsid} visible to {who}")

    def commit(self, run):
        run.namespace_changed(self.nqn, self.nsid)


class NamespaceQos(Change):
    """nvmeof_roce.qos (SPDK's bdev_set_qos_limit): the new limits apply from the next command (engine/qos.py)."""
    action = "namespace-qos"
    pauses = True

    def __init__(self, nqn: str, n: NamespaceConfig):
        limits = ", ".join(f"{k} {v}" for k, v in sorted(n.qos.items())) or "no limit"
        super().__init__(nqn=nqn, nsid=n.nsid, text=f"{nqn}: namespace {n.nsid} QoS: {limits}")


class NamespaceReservations(Change):
    """"resv": {"enable": ...} of a running namespace (nvmet's resv_enable), with the namespace paused: refused
    while hosts are registered (their registrations would vanish), as nvmet refuses it on an enabled namespace."""
    action = "namespace-reservations"
    pauses = True

    def __init__(self, nqn: str, n: NamespaceConfig):
        self.enable = n.resv_enabled
        super().__init__(nqn=nqn, nsid=n.nsid,
                         text=f"{nqn}: namespace {n.nsid} reservations {'enabled' if self.enable else 'disabled'}")

    def prepare(self, run):
        ns = run.target.subsystem(self.nqn).namespaces.get(self.nsid)
        if ns is not None and not self.enable and ns.resv is not None and ns.resv.registrants:
            raise ConfigError(run.new.source, f"{namespace_where(run.new, self.nqn, self.nsid)}.resv.enable",
                              f"{self.nqn} namespace {self.nsid}: {len(ns.resv.registrants)} host(s) are registered "
                              "for its reservation; disabling reservations would drop their registrations",
                              "have the hosts unregister (nvme resv-register --rrega=1) or clear the reservation "
                              "(nvme resv-release --rrela=1), then disable it")

    def commit(self, run):
        run.target.set_reservations(self.nqn, self.nsid, self.enable)
        run.namespace_changed(self.nqn, self.nsid)  # RESCAP changed


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


def _listen(run, port: PortConfig) -> None:
    """Open `port`'s listener; a failure is a ConfigError naming the port."""
    try:
        run.listeners.open(run.target, port)
    except ConfigError as exc:
        raise ConfigError(run.new.source, _port_where(run.new, port.portid), exc.problem, exc.fix) from None
    except Exception as exc:
        raise ConfigError(run.new.source, _port_where(run.new, port.portid), f"cannot listen: {exc}",
                          (exc.fix if isinstance(exc, (NvmeofError, RpcError)) else "")
                          or "check the address (nvmeof-roce rdma status)") from None


class RemovePort(Change):
    action = "remove-port"
    changes_discovery = True

    def __init__(self, port: PortConfig):
        super().__init__(portid=port.portid, text=f"close port {port.portid} ({port.traddr}:{port.trsvcid_str})")

    def commit(self, run):  # its controllers are ended after the commit (Target.end_controllers_without_access)
        if run.listeners is not None:
            run.listeners.close(self.portid)
        run.target.close_port(self.portid)


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
        run.target.open_port(port)
        if not port.subsystems:
            return  # it listens once a subsystem is linked to it (Link), as nvmet enables a port
        _listen(run, port)
        self.listening = True

    def undo(self, run):
        if self.listening:
            self.listening = False
            try:
                run.listeners.close(self.portid)
            except Exception:
                log.exception("closing a listener opened for a refused change")
        run.target.close_port(self.portid)


# A port listens only while it exports a subsystem (nvmet_port_subsys_allow_link enables a port with its first
# subsystem, nvmet_port_subsys_drop_link disables it with its last): a host reconnecting to a subsystem that left
# meets no listener and retries, where an NVMe Connect would be answered "unknown subsystem" with DNR and the
# host would delete its controller.

class Unlink(Change):
    action = "unlink"
    changes_discovery = True

    def __init__(self, nqn: str, portid: int):
        super().__init__(nqn=nqn, portid=portid,
                         text=f"port {portid}: stop exporting {nqn}; controllers through it are ended")

    def commit(self, run):
        if run.new_ports[self.portid].subsystems or self.portid in run.stopped_listening:
            return
        run.stopped_listening.add(self.portid)
        if run.listeners is not None:
            run.listeners.close(self.portid)  # its queues close; its handler stays for the port's config


class Link(Change):
    action = "link"
    changes_discovery = True

    def __init__(self, nqn: str, portid: int):
        super().__init__(nqn=nqn, portid=portid, text=f"port {portid}: export {nqn}")
        self.listening = False

    def prepare(self, run):
        if run.listeners is None or run.old_ports[self.portid].subsystems or self.portid in run.started_listening:
            return
        _listen(run, run.new_ports[self.portid])
        self.listening = True
        run.started_listening.add(self.portid)

    def undo(self, run):
        if self.listening:
            self.listening = False
            run.started_listening.discard(self.portid)
            try:
                run.listeners.close(self.portid)
            except Exception:
                log.exception("closing a listener opened for a refused change")


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
        run.target.set_ana_state(self.portid, self.grpid, self.state)


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


def plan(old: TargetConfig, new: TargetConfig, old_auth: Optional[dict] = None,
         new_auth: Optional[dict] = None) -> List[Change]:
    """The changes that turn the running `old` config into `new`, in the order apply() makes them.  `old_auth`
    and `new_auth` (auth.host_settings: the keys as read) show a key whose file was replaced while the config
    still names the same file."""
    for i, s in enumerate(new.subsystems):
        for j, n in enumerate(s.namespaces):
            if n.nsid > MAX_NSID:
                raise ConfigError(new.source, f"subsystems[{i}].namespaces[{j}].nsid",
                                  f"{n.nsid} is above {MAX_NSID}, the highest NSID the userspace target serves",
                                  f"use an NSID in 1..{MAX_NSID}")
    changes = _plan_subsystems(old, new) + _plan_ports(old, new) + _plan_host_keys(old, new, old_auth, new_auth)
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
            before, after = _fixed_attr(o, attr), _fixed_attr(s, attr)
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
            if m.enabled and n.resv_enabled != m.resv_enabled:
                changes.append(NamespaceReservations(nqn, m))
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


def _plan_host_keys(old: TargetConfig, new: TargetConfig, old_auth: Optional[dict],
                    new_auth: Optional[dict]) -> List[Change]:
    changes: List[Change] = []
    old_keys = {h.nqn: h.attrs.get("dhchap") or {} for h in old.host_entries}
    for h in new.host_entries:
        before, after = old_keys.get(h.nqn, {}), h.attrs.get("dhchap") or {}
        if before == after:
            was, now = (old_auth or {}).get(h.nqn), (new_auth or {}).get(h.nqn)
            if old_auth is not None and new_auth is not None and was != now and was and now:
                files = [o for o, k0, k1 in ((now.key_origin, was.key, now.key),
                                             (now.ctrl_origin, was.ctrl_key, now.ctrl_key)) if k0 != k1]
                changes.append(HostKey(h.nqn, f"host {h.nqn}: DH-HMAC-CHAP key changed in {' and '.join(files)}; "
                                              "new connections and re-authentications use it, connected "
                                              "controllers keep theirs until they reconnect"))
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
        self.old_ports = {p.portid: p for p in target.config.ports}
        self.started_listening: set = set()  # ports whose first subsystem is linked now (Link)
        self.stopped_listening: set = set()  # ports whose last subsystem leaves now (Unlink)
        self.ended: List[Tuple[object, str]] = []  # (controller, reason)
        self.ns_changed: Dict[str, set] = {}

    def namespace_changed(self, nqn: str, nsid: int) -> None:
        self.ns_changed.setdefault(nqn, set()).add(nsid)

    def remove_namespace(self, nqn: str, nsid: int) -> None:
        self.target.retire_namespace(nqn, nsid)  # closed now or after its jobs
        self.namespace_changed(nqn, nsid)


# New namespaces are installed before resized ones take their size (the order hosts are told about them in).
_INSTALL_ORDER = {AddNamespace: 0, ReplaceNamespace: 0, ResizeNamespace: 1}


def plan_change(target, new: TargetConfig) -> Tuple[List[Change], dict]:
    """(the changes that make the running `target` serve `new`, the hosts' DH-HMAC-CHAP settings of `new`): each
    computed once, the keys read first (a ConfigError naming a key before anything is planned)."""
    host_auth = auth.host_settings(new)
    return plan(target.config, new, target.host_auth, host_auth), host_auth


def apply(target, new: TargetConfig, listeners: Optional[Listeners] = None,
          changes: Optional[List[Change]] = None, host_auth: Optional[dict] = None,
          applying: Optional[Applying] = None) -> List[Change]:
    """Make the running `target` serve `new`; returns the changes.  A failure to prepare raises and changes
    nothing.  The commit follows once the namespaces that change have no command from before in flight (at once
    when nothing is in flight); `applying` is told when it is made, or that it was given up after twice the
    drain_timeout (the namespaces resumed, nothing changed).  `changes` and `host_auth`: plan_change(target, new), when the caller
    has them (computed here otherwise, once)."""
    applying = applying or Applying()
    if changes is None:
        changes, host_auth = plan_change(target, new)
    elif host_auth is None:
        host_auth = auth.host_settings(new)  # ConfigError naming the key before anything changes
    if not changes:
        target.rebind(new, host_auth)
        applying.finish()
        return changes
    waiting = target.changing()
    if waiting:  # planned against a config that is about to change
        raise ConfigError(new.source, "", f"a live change to {waiting[0]} is still waiting for its commands in "
                          "flight to finish", "send this change again once that one is applied")
    run = _Apply(target, new, listeners)
    disc_before = target.discovery_views()

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

    # -- commit, once the namespaces that change are paused and their commands from before are gone: no command,
    # native or Python, still uses a namespace as it was (a Write's RDMA READ still lands in the memory it was
    # given).  Other namespaces go on meanwhile.
    paused = sorted({(ch.nqn, ch.nsid) for ch in changes if ch.pauses})
    commit = _Commit(run, changes, host_auth, disc_before)
    if not paused:
        target.finish_after_fence(commit() or [], applying, new.source)
        return changes
    target.when_drained(paused, commit, commit.undo, applying, new.source)
    return changes


class _Commit:
    """The commit of a prepared plan, and its undo when the drain is given up.  An object, not closures (see
    engine/api.py _Drain: a resized or removed namespace's memory must not be kept by a reference cycle)."""

    def __init__(self, run: "_Apply", changes: List[Change], host_auth: dict, disc_before):
        self.run, self.changes, self.host_auth, self.disc_before = run, changes, host_auth, disc_before

    def __call__(self) -> list:
        return _commit(self.run, self.changes, self.host_auth, self.disc_before)

    def undo(self) -> None:
        for ch in self.changes:
            ch.undo(self.run)


def _commit(run: _Apply, changes: List[Change], host_auth: dict, disc_before) -> list:
    """Commit the prepared changes (nothing here fails on a user's input; the caller resumes the paused
    namespaces), then tell the hosts.  Returns the namespaces the controllers it ended may still have commands
    in flight on (the change is done once they are gone: EngineApi.finish_after_fence)."""
    target, new = run.target, run.new
    for ch in changes:
        ch.commit(run)
    for ch in sorted(changes, key=lambda c: _INSTALL_ORDER.get(type(c), 0)):
        ch.install(run)
    target.rebind(new, host_auth)  # a namespace's visibility and QoS limits come with its new config

    # access: the engine ends the controllers whose hosts may no longer reach their subsystem
    fence = target.end_controllers_without_access(run.ended)

    for nqn, nsids in run.ns_changed.items():
        for nsid in sorted(nsids):
            target.namespace_changed(nqn, nsid)

    # discovery: tell the controllers whose log page changed
    target.discovery_changed(disc_before, any(c.changes_discovery for c in changes))

    for ch in changes:
        log.warning("applied: %s", ch.text)
    return fence
