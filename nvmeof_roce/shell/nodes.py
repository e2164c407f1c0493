"""configshell-fb nodes over the kernel nvmet tree (nvmeof_roce.kernel.nvmet), in the manner of nvmetcli.

    /                       saveconfig, restoreconfig, clearconfig
    /subsystems             create [NQN], delete NQN
    /subsystems/NQN         get/set attr ...        (allow_any_host, serial, model, version, ...)
      namespaces            create [NSID], delete NSID
        NSID                get/set device ..., get/set ns buffered_io|ana_grpid, enable, disable
      allowed_hosts         create HOSTNQN, delete HOSTNQN
    /ports                  create [PORTID], delete PORTID
    /ports/N                get/set addr ..., get/set param ...
      subsystems            create NQN, delete NQN  (link a subsystem to the port)
      referrals             create NAME, delete NAME; NAME: get/set addr ..., enable, disable
      ana_groups            create GRPID, delete GRPID; GRPID: get/set ana state
    /hosts                  create HOSTNQN, delete HOSTNQN

Children are read from configfs whenever they are listed, so the tree always shows the kernel's state.
The kernel's refusals come back as the model's messages (what failed and the fix).
"""
import uuid

import configshell
from configshell import ExecutionError

from ..errors import NvmeofError
from ..kernel import apply as applymod
from ..kernel.nvmet import DEFAULT_SAVE_FILE, Root, save_json, Subsystem, Port
from ..config import load_config, nqn_problem

ATTR_HELP = {
    "attr": {"allow_any_host": "1: any host may connect; 0: only allowed_hosts",
             "serial": "serial number reported to hosts (<= 20 characters)",
             "model": "model number reported to hosts (<= 40 characters)",
             "version": "NVMe version reported to hosts, e.g. 1.3",
             "cntlid_min": "lowest controller id", "cntlid_max": "highest controller id",
             "pi_enable": "protection information", "qid_max": "most I/O queues a host may create"},
    "device": {"path": "backing file or block device", "uuid": "namespace UUID", "nguid": "namespace GUID"},
    "ns": {"buffered_io": "1: page cache I/O (needed for files on tmpfs); set while disabled",
           "ana_grpid": "ANA group of the namespace"},
    "addr": {"trtype": "transport: rdma, tcp, loop, fc", "adrfam": "address family: ipv4, ipv6, ib, fc",
             "traddr": "address to listen on, e.g. 10.99.0.1", "trsvcid": "service id (port), e.g. 4420",
             "treq": "transport requirements", "portid": "port id the referral points at"},
    "param": {"inline_data_size": "in-capsule data size, bytes", "pi_enable": "protection information"},
    "ana": {"state": "optimized, non-optimized, inaccessible, persistent-loss, change"},
}


def _nqn_ok(nqn):
    problem = nqn_problem(nqn)
    if problem:
        raise ExecutionError(f"NQN {problem}; use e.g. nqn.2014-08.org.example:name")


class UINode(configshell.ConfigNode):
    """A node; `cfnode` is the nvmet object behind it (or None for a plain folder)."""

    groups = ()   # configfs attribute groups shown with get/set

    def __init__(self, name, parent=None, cfnode=None, shell=None):
        super().__init__(name, parent, shell)
        self.cfnode = cfnode
        for g in self.groups:
            for attr in self._group_attrs(g):
                self.define_config_group_param(g, attr, "string", ATTR_HELP.get(g, {}).get(attr, ""), True)

    # attribute groups --------------------------------------------------------------
    def _group_attrs(self, group):
        if group == "ns":
            return [a for a in ("buffered_io", "ana_grpid")
                    if self.cfnode.root.fs.isfile(f"{self.cfnode.path}/{a}")]
        return self.cfnode.list_attrs(group, writable=True)

    def __getattr__(self, name):
        for prefix in ("ui_getgroup_", "ui_setgroup_"):
            if name.startswith(prefix) and name[len(prefix):] in type(self).groups:
                group = name[len(prefix):]
                if prefix == "ui_getgroup_":
                    return lambda attr: self._get(group, attr)
                return lambda attr, value: self._set(group, attr, value)
        raise AttributeError(name)

    def _get(self, group, attr):
        if group == "ns":
            v = self.cfnode.root._read(f"{self.cfnode.relpath}/{attr}")
            return None if v is None else v.strip()
        return self.cfnode.get_attr(group, attr)

    def _set(self, group, attr, value):
        if value is None:
            value = ""
        if group == "ns":
            self.cfnode.root._write(f"{self.cfnode.relpath}/{attr}", value)
        else:
            self.cfnode.set_attr(group, attr, value)

    # the kernel's messages -----------------------------------------------------------
    def execute_command(self, command, pparams=[], kparams={}):   # noqa: B006 - configshell's signature
        try:
            return super().execute_command(command, pparams, kparams)
        except NvmeofError as exc:
            raise ExecutionError(str(exc)) from None

    # children are always read from configfs
    def refresh(self):
        pass

    def _list_children(self):
        self._children = set()
        self.refresh()
        return self._children

    children = property(_list_children)

    def get_child(self, name):
        self._list_children()
        return super().get_child(name)

    def ui_command_refresh(self):
        """Re-read this part of the tree from configfs."""
        self.refresh()

    @property
    def root_ui(self):
        n = self
        while n.parent is not None:
            n = n.parent
        return n

    def ui_command_saveconfig(self, savefile=DEFAULT_SAVE_FILE):
        """Save the whole configuration (nvmetcli's JSON format) to savefile, atomically."""
        root = self.root_ui.cfnode
        save_json(root.dump(), savefile)
        self.shell.log.info(f"Configuration saved to {savefile}")


class UIRoot(UINode):
    def __init__(self, shell, root: Root):
        super().__init__("/", None, root, shell)

    def refresh(self):
        UISubsystems(self)
        UIPorts(self)
        UIHosts(self)

    def summary(self):
        d = self.cfnode
        return (f"{len(d.subsystems)} subsystems, {len(d.ports)} ports, {len(d.hosts)} hosts", None)

    def ui_command_restoreconfig(self, savefile=DEFAULT_SAVE_FILE, clear_existing="false"):
        """Make the kernel match savefile: only what differs changes (clear_existing=true clears first)."""
        cfg = load_config(savefile)
        if str(clear_existing).lower() in ("1", "true", "yes"):
            self.cfnode.clear()
        steps = applymod.apply(self.cfnode, cfg)
        self.shell.log.info(f"Configuration restored from {savefile}: {len(steps)} change(s)")

    def ui_command_clearconfig(self, confirm=None):
        """Remove every port, subsystem and host (confirm=true)."""
        if str(confirm).lower() not in ("1", "true", "yes"):
            raise ExecutionError("clearconfig removes everything: run it as 'clearconfig confirm=true'")
        self.cfnode.clear()
        self.shell.log.info("All subsystems, ports and hosts removed")


# --------------------------------------------------------------------------- subsystems

class UISubsystems(UINode):
    def __init__(self, parent):
        super().__init__("subsystems", parent)

    def refresh(self):
        for s in self.parent.cfnode.subsystems:
            UISubsystem(self, s)

    def summary(self):
        return (f"{len(self.parent.cfnode.subsystems)} subsystems", None)

    def ui_command_create(self, nqn=None):
        """Create a subsystem (no NQN: a generated uuid NQN)."""
        if nqn is None:
            nqn = f"nqn.2014-08.org.nvmexpress:uuid:{uuid.uuid4()}"
        _nqn_ok(nqn)
        Subsystem(self.parent.cfnode, nqn, "create")
        self.shell.log.info(f"Created subsystem {nqn}")

    def ui_command_delete(self, nqn):
        """Delete a subsystem with its namespaces, allowed hosts and port links."""
        self.parent.cfnode.subsystem(nqn, "lookup").delete()
        self.shell.log.info(f"Deleted subsystem {nqn}")

    def ui_complete_delete(self, parameters, text, current_param):
        return _complete([s.nqn for s in self.parent.cfnode.subsystems], text) if current_param == "nqn" else []


class UISubsystem(UINode):
    groups = ("attr",)

    def __init__(self, parent, subsystem):
        super().__init__(subsystem.nqn, parent, subsystem)

    def refresh(self):
        UINamespaces(self)
        UIAllowedHosts(self)

    def summary(self):
        s = self.cfnode
        info = [f"version={s.get_attr('attr', 'version')}", f"allow_any={s.get_attr('attr', 'allow_any_host')}",
                f"serial={s.get_attr('attr', 'serial')}", f"{len(s.namespaces)} namespaces"]
        return (", ".join(info), bool(s.ports) or None)


class UINamespaces(UINode):
    def __init__(self, parent):
        super().__init__("namespaces", parent)

    def refresh(self):
        for ns in self.parent.cfnode.namespaces:
            UINamespace(self, ns)

    def ui_command_create(self, nsid=None):
        """Create a namespace (no NSID: the next free one). Then: set device path=..., enable."""
        ns = self.parent.cfnode.namespace(nsid, "create")
        self.shell.log.info(f"Created namespace {ns.nsid}")

    def ui_command_delete(self, nsid):
        """Delete a namespace (a connected host loses it)."""
        self.parent.cfnode.namespace(nsid, "lookup").delete()
        self.shell.log.info(f"Deleted namespace {nsid}")

    def ui_complete_delete(self, parameters, text, current_param):
        return _complete([str(n.nsid) for n in self.parent.cfnode.namespaces], text) if current_param == "nsid" else []


class UINamespace(UINode):
    groups = ("device", "ns")

    def __init__(self, parent, ns):
        super().__init__(str(ns.nsid), parent, ns)

    def summary(self):
        ns = self.cfnode
        path = ns.get_attr("device", "path")
        info = [f"path={'' if path == '(null)' else path}", f"uuid={ns.get_attr('device', 'uuid')}",
                f"grpid={ns.grpid}"]
        if ns.buffered_io:
            info.append("buffered_io")
        en = ns.get_enable()
        info.append("enabled" if en else "disabled")
        return (", ".join(info), bool(en))

    def ui_command_enable(self):
        """Enable the namespace (opens device path)."""
        if self.cfnode.get_enable():
            self.shell.log.info("The namespace is already enabled")
            return
        self.cfnode.set_enable(1)
        self.shell.log.info("The namespace has been enabled")

    def ui_command_disable(self):
        """Disable the namespace."""
        if not self.cfnode.get_enable():
            self.shell.log.info("The namespace is already disabled")
            return
        self.cfnode.set_enable(0)
        self.shell.log.info("The namespace has been disabled")


class UIAllowedHosts(UINode):
    def __init__(self, parent):
        super().__init__("allowed_hosts", parent)

    def refresh(self):
        for h in self.parent.cfnode.allowed_hosts:
            UINode(h, self)

    def ui_command_create(self, nqn):
        """Allow host NQN (it must exist under /hosts) to connect to this subsystem."""
        self.parent.cfnode.add_allowed_host(nqn)
        self.shell.log.info(f"Allowed host {nqn}")

    def ui_complete_create(self, parameters, text, current_param):
        if current_param != "nqn":
            return []
        have = set(self.parent.cfnode.allowed_hosts)
        return _complete([h.nqn for h in self.root_ui.cfnode.hosts if h.nqn not in have], text)

    def ui_command_delete(self, nqn):
        """Disallow host NQN."""
        self.parent.cfnode.remove_allowed_host(nqn)
        self.shell.log.info(f"Disallowed host {nqn}")

    def ui_complete_delete(self, parameters, text, current_param):
        return _complete(self.parent.cfnode.allowed_hosts, text) if current_param == "nqn" else []


# --------------------------------------------------------------------------- ports

class UIPorts(UINode):
    def __init__(self, parent):
        super().__init__("ports", parent)

    def refresh(self):
        for p in self.parent.cfnode.ports:
            UIPort(self, p)

    def summary(self):
        ports = self.parent.cfnode.ports
        return (f"{len(ports)} ports, {sum(1 for p in ports if p.enabled)} enabled", None)

    def ui_command_create(self, portid=None):
        """Create a port (no PORTID: the next free one). Then: set addr trtype=rdma adrfam=ipv4 traddr=... trsvcid=4420."""
        if portid is None:
            used = {p.portid for p in self.parent.cfnode.ports}
            portid = next(i for i in range(1, 65536) if i not in used)
        Port(self.parent.cfnode, portid, "create")
        self.shell.log.info(f"Created port {portid}")

    def ui_command_delete(self, portid):
        """Delete a port (its subsystem links, referrals and ANA groups too)."""
        self.parent.cfnode.port(portid, "lookup").delete()
        self.shell.log.info(f"Deleted port {portid}")

    def ui_complete_delete(self, parameters, text, current_param):
        return _complete([str(p.portid) for p in self.parent.cfnode.ports], text) if current_param == "portid" else []


class UIPort(UINode):
    groups = ("addr", "param")

    def __init__(self, parent, port):
        super().__init__(str(port.portid), parent, port)

    def refresh(self):
        UIPortSubsystems(self)
        UIReferrals(self)
        if self.cfnode.root.fs.isdir(f"{self.cfnode.path}/ana_groups"):
            UIAnaGroups(self)

    def summary(self):
        p = self.cfnode
        a = {k: p.get_attr("addr", k) for k in ("trtype", "traddr", "trsvcid")}
        info = [f"trtype={a['trtype']}", f"traddr={a['traddr']}", f"trsvcid={a['trsvcid']}"]
        if p.has_attr("param", "inline_data_size"):
            info.append(f"inline_data_size={p.get_attr('param', 'inline_data_size')}")
        return (", ".join(info), True if p.enabled else None)


class UIPortSubsystems(UINode):
    def __init__(self, parent):
        super().__init__("subsystems", parent)

    def refresh(self):
        for nqn in self.parent.cfnode.subsystems:
            UINode(nqn, self)

    def ui_command_create(self, nqn):
        """Link subsystem NQN to this port (the first link enables the port)."""
        self.parent.cfnode.add_subsystem(nqn)
        self.shell.log.info(f"Linked subsystem {nqn}")

    def ui_complete_create(self, parameters, text, current_param):
        if current_param != "nqn":
            return []
        have = set(self.parent.cfnode.subsystems)
        return _complete([s.nqn for s in self.root_ui.cfnode.subsystems if s.nqn not in have], text)

    def ui_command_delete(self, nqn):
        """Unlink subsystem NQN from this port."""
        self.parent.cfnode.remove_subsystem(nqn)
        self.shell.log.info(f"Unlinked subsystem {nqn}")

    def ui_complete_delete(self, parameters, text, current_param):
        return _complete(self.parent.cfnode.subsystems, text) if current_param == "nqn" else []


class UIReferrals(UINode):
    def __init__(self, parent):
        super().__init__("referrals", parent)

    def refresh(self):
        for r in self.parent.cfnode.referrals:
            UIReferral(self, r)

    def ui_command_create(self, name):
        """Create a referral. Then: set addr ..., enable."""
        self.parent.cfnode.referral(name, "create")
        self.shell.log.info(f"Created referral {name}")

    def ui_command_delete(self, name):
        """Delete a referral."""
        self.parent.cfnode.referral(name, "lookup").delete()
        self.shell.log.info(f"Deleted referral {name}")

    def ui_complete_delete(self, parameters, text, current_param):
        return _complete([r.name for r in self.parent.cfnode.referrals], text) if current_param == "name" else []


class UIReferral(UINode):
    groups = ("addr",)

    def __init__(self, parent, ref):
        super().__init__(ref.name, parent, ref)

    def summary(self):
        r = self.cfnode
        en = r.get_enable()
        return (f"{r.get_attr('addr', 'trtype')} {r.get_attr('addr', 'traddr')}:{r.get_attr('addr', 'trsvcid')}, "
                f"{'enabled' if en else 'disabled'}", bool(en))

    def ui_command_enable(self):
        """Enable the referral."""
        self.cfnode.set_enable(1)

    def ui_command_disable(self):
        """Disable the referral."""
        self.cfnode.set_enable(0)


class UIAnaGroups(UINode):
    def __init__(self, parent):
        super().__init__("ana_groups", parent)

    def refresh(self):
        for a in self.parent.cfnode.ana_groups:
            UIAnaGroup(self, a)

    def ui_command_create(self, grpid):
        """Create ANA group GRPID (2..128; group 1 always exists)."""
        self.parent.cfnode.ana_group(grpid, "create")

    def ui_command_delete(self, grpid):
        """Delete ANA group GRPID."""
        self.parent.cfnode.ana_group(grpid, "lookup").delete()


class UIAnaGroup(UINode):
    groups = ("ana",)

    def __init__(self, parent, grp):
        super().__init__(str(grp.grpid), parent, grp)

    def summary(self):
        st = self.cfnode.get_attr("ana", "state")
        return (f"state={st}", st == "optimized")


# --------------------------------------------------------------------------- hosts

class UIHosts(UINode):
    def __init__(self, parent):
        super().__init__("hosts", parent)

    def refresh(self):
        for h in self.parent.cfnode.hosts:
            UIHost(self, h)

    def summary(self):
        return (f"{len(self.parent.cfnode.hosts)} hosts", None)

    def ui_command_create(self, nqn):
        """Create host NQN (then allow it in a subsystem's allowed_hosts)."""
        _nqn_ok(nqn)
        self.parent.cfnode.host(nqn, "create")
        self.shell.log.info(f"Created host {nqn}")

    def ui_command_delete(self, nqn):
        """Delete host NQN (remove it from allowed_hosts first)."""
        self.parent.cfnode.host(nqn, "lookup").delete()
        self.shell.log.info(f"Deleted host {nqn}")

    def ui_complete_delete(self, parameters, text, current_param):
        return _complete([h.nqn for h in self.parent.cfnode.hosts], text) if current_param == "nqn" else []


class UIHost(UINode):
    groups = ("dhchap",)

    def __init__(self, parent, host):
        super().__init__(host.nqn, parent, host)


def _complete(options, text):
    matches = [o for o in options if o.startswith(text or "")]
    if len(matches) == 1:
        return [matches[0] + " "]
    return matches
