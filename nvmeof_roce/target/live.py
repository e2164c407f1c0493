"""Live changes to a running userspace target: plan the difference between two configs, then apply it.

Every change -- an RPC on the control socket, or a reload of the config file (SIGHUP) -- is expressed as a
new `TargetConfig`, validated by the one config loader (config.py), and applied here:

    plan(old, new)        the list of `Change`s, or ConfigError for a difference that cannot be made live
                          (a port's queue size, a subsystem's serial...: those need a restart)
    apply(target, new)    prepare every change that can fail (open backends, allocate a resized RAM
                          namespace, open listeners), and only when all are ready commit them; a failure
                          undoes what was prepared, so the running target stays as it was

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
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from ..config import ConfigError, NamespaceConfig, PortConfig, SubsystemConfig, TargetConfig
from ..nvme import admin as A
from . import auth
from .backends import BackendError, open_backend
from .core import PortContext, PortHandler
from .discovery import discovery_entries
from .limits import MAX_NSID
from .subsystem import Namespace, Subsystem, max_qid_of

log = logging.getLogger(__name__)

# Subsystem attributes a running controller has already reported (Identify): changing them needs a restart.
_FIXED_SUBSYSTEM_ATTRS = ("serial", "model", "version", "cntlid_min", "cntlid_max", "pi_enable")


@dataclass
class Change:
    """One step of a plan: `action` and what it acts on; `text` says it for a person."""
    action: str
    nqn: str = ""
    nsid: int = 0
    portid: int = -1
    host: str = ""
    text: str = ""

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


class Listeners:
    """How ports are opened and closed: the RDMA server (serve.py) or a test's loopback fabric implements it."""

    def open(self, target, port: PortConfig) -> None:
        """Listen on `port` with `target.port(port.portid)` (raise to refuse)."""
        raise ConfigError("", f"port {port.portid}", "ports cannot be added to this running target",
                          "restart the target with the new port in its config")

    def close(self, portid: int) -> None:
        """Stop listening on port `portid` (its queues close)."""


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
    return (p.trtype, p.adrfam, p.traddr, p.trsvcid, p.treq, sorted(p.params.items()),
            sorted((a.grpid, a.state) for a in p.ana_groups))


def plan(old: TargetConfig, new: TargetConfig) -> List[Change]:
    """The changes that turn the running `old` config into `new`, in the order apply() makes them."""
    changes: List[Change] = []
    old_subs = {s.nqn: s for s in old.subsystems}
    new_subs = {s.nqn: s for s in new.subsystems}

    for i, s in enumerate(new.subsystems):
        for j, n in enumerate(s.namespaces):
            if n.nsid > MAX_NSID:
                raise ConfigError(new.source, f"subsystems[{i}].namespaces[{j}].nsid",
                                  f"{n.nsid} is above {MAX_NSID}, the highest NSID the userspace target serves",
                                  f"use an NSID in 1..{MAX_NSID}")

    for nqn, s in old_subs.items():
        if nqn not in new_subs:
            changes.append(Change("remove-subsystem", nqn=nqn, text=f"delete subsystem {nqn} "
                                  f"({len(s.namespaces)} namespace(s)); its controllers are ended"))
    for nqn, s in new_subs.items():
        if nqn not in old_subs:
            changes.append(Change("add-subsystem", nqn=nqn, text=f"create subsystem {nqn} with "
                                  f"{len([n for n in s.namespaces if n.enabled])} namespace(s)"))
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
            changes.append(Change("qid-max", nqn=nqn, text=f"{nqn}: at most {s.attrs.get('qid_max', 'the default')} "
                                  "I/O queues per controller; its controllers are ended to reconnect with it"))
        old_ns, new_ns = _ns_index(o), _ns_index(s)
        for nsid, n in old_ns.items():
            m = new_ns.get(nsid)
            if m is None:
                if n.enabled:
                    changes.append(Change("remove-namespace", nqn=nqn, nsid=nsid,
                                          text=f"{nqn}: remove namespace {nsid}"))
            elif _ns_identity(n) != _ns_identity(m):
                if n.enabled and m.enabled:
                    changes.append(Change("replace-namespace", nqn=nqn, nsid=nsid,
                                          text=f"{nqn}: replace namespace {nsid} (its device or identifiers changed)"))
                elif n.enabled:
                    changes.append(Change("remove-namespace", nqn=nqn, nsid=nsid,
                                          text=f"{nqn}: disable namespace {nsid}"))
                else:
                    changes.append(Change("add-namespace", nqn=nqn, nsid=nsid,
                                          text=f"{nqn}: enable namespace {nsid}"))
            elif m.enabled and _ns_size(n) != _ns_size(m) and _ns_size(m) is not None:
                changes.append(Change("resize-namespace", nqn=nqn, nsid=nsid,
                                      text=f"{nqn}: resize namespace {nsid} to {m.size_bytes} bytes"))
        for nsid, m in new_ns.items():
            if nsid not in old_ns and m.enabled:
                changes.append(Change("add-namespace", nqn=nqn, nsid=nsid, text=f"{nqn}: add namespace {nsid}"))
        if o.allow_any_host != s.allow_any_host:
            changes.append(Change("allow-any-host", nqn=nqn,
                                  text=f"{nqn}: {'allow any host' if s.allow_any_host else 'enforce the allow-list'}"))
        for h in o.allowed_hosts:
            if h not in s.allowed_hosts:
                changes.append(Change("remove-host", nqn=nqn, host=h,
                                      text=f"{nqn}: remove host {h}; its controllers are ended"))
        for h in s.allowed_hosts:
            if h not in o.allowed_hosts:
                changes.append(Change("add-host", nqn=nqn, host=h, text=f"{nqn}: allow host {h}"))

    old_ports = {p.portid: p for p in old.ports}
    new_ports = {p.portid: p for p in new.ports}
    for pid, p in old_ports.items():
        if pid not in new_ports:
            changes.append(Change("remove-port", portid=pid, text=f"close port {pid} ({p.traddr}:{p.trsvcid_str})"))
    for pid, p in new_ports.items():
        if pid not in old_ports:
            changes.append(Change("add-port", portid=pid, text=f"listen on port {pid} ({p.traddr}:{p.trsvcid_str}) "
                                  f"for {', '.join(p.subsystems) or 'discovery only'}"))
            continue
        o = old_ports[pid]
        if _port_fixed(o) != _port_fixed(p):
            raise ConfigError(new.source, _port_where(new, pid),
                              "changes its address or parameters, which a running listener cannot take",
                              "add a new port with the new address (and remove the old one), or restart the target")
        for nqn in o.subsystems:
            if nqn not in p.subsystems:
                changes.append(Change("unlink", nqn=nqn, portid=pid,
                                      text=f"port {pid}: stop exporting {nqn}; controllers through it are ended"))
        for nqn in p.subsystems:
            if nqn not in o.subsystems:
                changes.append(Change("link", nqn=nqn, portid=pid, text=f"port {pid}: export {nqn}"))
        if [r.to_dict() for r in o.referrals] != [r.to_dict() for r in p.referrals]:
            changes.append(Change("referrals", portid=pid, text=f"port {pid}: referrals changed"))
    old_keys = {h.nqn: h.attrs.get("dhchap") or {} for h in old.host_entries}
    for h in new.host_entries:
        before, after = old_keys.get(h.nqn, {}), h.attrs.get("dhchap") or {}
        if before == after:
            continue
        what = ("added" if after.get("key") and not before.get("key") else
                "removed" if before.get("key") and not after.get("key") else "changed")
        changes.append(Change("host-key", host=h.nqn, text=f"host {h.nqn}: DH-HMAC-CHAP settings {what}; new "
                              "connections and re-authentications use them, connected controllers keep theirs "
                              "until they reconnect"))
    for nqn, before in old_keys.items():
        if before.get("key") and nqn not in {h.nqn for h in new.host_entries}:
            changes.append(Change("host-key", host=nqn, text=f"host {nqn}: DH-HMAC-CHAP key removed with the "
                                  "host entry"))
    if old.hosts != new.hosts and not changes:
        changes.append(Change("hosts", text="top-level host list changed (no effect on access by itself)"))
    return changes


# ---------------------------------------------------------------------------------------------- apply

class _Prepared:
    """Everything made ready before the commit, and how to undo it."""

    def __init__(self):
        self.new_subsystems: Dict[str, Subsystem] = {}
        self.new_namespaces: List[Tuple[Subsystem, Namespace]] = []
        self.resizes: List[Tuple[Namespace, Callable[[], None], int]] = []
        self.new_ports: List[int] = []
        self.listeners: Optional[Listeners] = None

    def undo(self) -> None:
        for _sub, ns in self.new_namespaces:
            _close_quietly(ns)
        for sub in self.new_subsystems.values():
            sub.close()
        for portid in self.new_ports:
            try:
                self.listeners.close(portid)
            except Exception:
                log.exception("closing a listener opened for a refused change")


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
    new_subs = {s.nqn: s for s in new.subsystems}
    new_ports = {p.portid: p for p in new.ports}
    disc_before = {id(c): _disc_view(discovery_entries(target, c)) for c in target.discovery.controllers.values()
                   if c.admin_queue is not None}

    # -- prepare: everything that can fail
    ready = _Prepared()
    try:
        for ch in changes:
            if ch.action == "add-subsystem":
                cfg = new_subs[ch.nqn]
                sub = Subsystem(cfg)
                ready.new_subsystems[ch.nqn] = sub
                for n in cfg.namespaces:
                    if n.enabled:
                        ns = _open_ns(new, ch.nqn, n, target.file_lock)
                        sub.namespaces[ns.nsid] = ns
            elif ch.action in ("add-namespace", "replace-namespace"):
                n = new_subs[ch.nqn].namespace(ch.nsid)
                old_ns = target.subsystems[ch.nqn].namespaces.get(ch.nsid) if ch.action == "replace-namespace" else None
                ready.new_namespaces.append((target.subsystems[ch.nqn], _open_ns(new, ch.nqn, n, target.file_lock,
                                                                                 old_ns)))
            elif ch.action == "resize-namespace":
                ns = target.subsystems[ch.nqn].namespaces[ch.nsid]
                size = new_subs[ch.nqn].namespace(ch.nsid).size_bytes
                try:
                    commit = ns.backend.prepare_resize(size)
                except BackendError as exc:
                    raise ConfigError(new.source, f"{_ns_where(new, ch.nqn, ch.nsid)}.nvmeof_roce.size",
                                      exc.message, exc.fix) from None
                ready.resizes.append((ns, commit, size))
            elif ch.action == "add-port":
                port = new_ports[ch.portid]
                if listeners is None:
                    listeners = Listeners()
                target._port_handlers[ch.portid] = PortHandler(target, PortContext.for_port(target, port))
                ready.listeners = listeners
                try:
                    listeners.open(target, port)
                    ready.new_ports.append(ch.portid)
                except ConfigError as exc:
                    raise ConfigError(new.source, _port_where(new, ch.portid), exc.problem, exc.fix) from None
                except Exception as exc:
                    raise ConfigError(new.source, _port_where(new, ch.portid), f"cannot listen: {exc}",
                                      getattr(exc, "fix", "") or "check the address (nvmeof-roce rdma status)") \
                        from None
    except BaseException:
        ready.undo()
        for ch in changes:
            if ch.action == "add-port":
                target._port_handlers.pop(ch.portid, None)
        raise

    # -- commit: nothing below fails on a user's input
    ended: List[Tuple[object, str]] = []  # (controller, reason)
    removed_subsystems: List[Subsystem] = []
    ns_changed: Dict[str, set] = {}
    for ch in changes:
        a = ch.action
        if a == "remove-subsystem":
            sub = target.subsystems.pop(ch.nqn)
            ended.extend((c, "subsystem deleted") for c in list(sub.controllers.values()))
            for ns in sub.namespaces.values():
                ns.removed = True
            removed_subsystems.append(sub)
        elif a == "add-subsystem":
            target.subsystems[ch.nqn] = ready.new_subsystems.pop(ch.nqn)
        elif a == "qid-max":  # nvmet's attr_qid_max: the controllers are ended, the hosts reconnect with it
            sub = target.subsystems[ch.nqn]
            sub.max_qid = max_qid_of(new_subs[ch.nqn])
            ended.extend((c, "qid_max changed") for c in list(sub.controllers.values()))
        elif a in ("remove-namespace", "replace-namespace"):
            sub = target.subsystems[ch.nqn]
            ns = sub.remove_namespace(ch.nsid)
            _retire_quietly(ns)  # closed now or after its background jobs
            ns_changed.setdefault(ch.nqn, set()).add(ch.nsid)
        elif a == "resize-namespace":
            pass  # below, all together
        elif a == "remove-port":
            for ctrl in target.controllers():
                if getattr(ctrl.port, "portid", None) == ch.portid:
                    ended.append((ctrl, f"port {ch.portid} removed"))
            if listeners is not None:
                listeners.close(ch.portid)
            target._port_handlers.pop(ch.portid, None)
    for sub, ns in ready.new_namespaces:
        sub.namespaces[ns.nsid] = ns
        sub._active_nsids = None
        ns_changed.setdefault(sub.nqn, set()).add(ns.nsid)
    for ns, commit, size in ready.resizes:
        commit()
        ns.num_blocks = ns.backend.num_blocks
        ns.direct_view = getattr(ns.backend, "buffer", None)
        ns.config = next(n for n in new_subs[_owner(target, ns)].namespaces if n.nsid == ns.nsid)
        ns_changed.setdefault(_owner(target, ns), set()).add(ns.nsid)

    target.config = new
    target.host_auth = host_auth  # read at each admin Connect and re-authentication (auth.settings_for)
    _rebind_configs(target, new)

    # access: hosts that may no longer reach a subsystem through the port they came in on
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
    for sub in removed_subsystems:
        for ns in sub.namespaces.values():  # flushed and closed after their controllers ended and their jobs
            _retire_quietly(ns)

    for nqn, nsids in ns_changed.items():
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
    if not changed_disc and any(c.action in ("add-port", "remove-port", "link", "unlink", "referrals",
                                             "add-subsystem", "remove-subsystem", "add-host", "remove-host",
                                             "allow-any-host") for c in changes):
        target.genctr += 1  # what discovery lists changed for some host, even if none is connected now

    for ch in changes:
        log.warning("applied: %s", ch.text)
    return changes


def _owner(target, ns: Namespace) -> str:
    for nqn, sub in target.subsystems.items():
        if sub.namespaces.get(ns.nsid) is ns:
            return nqn
    return ""


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
    for portid, handler in target._port_handlers.items():
        port = new.port(portid)
        if port is not None:
            handler.ctx.port = port


def _disc_view(entries) -> list:
    return [e.pack() for e in entries]
