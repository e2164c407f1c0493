"""Reconcile the kernel nvmet tree with a target config: `nvmeof-roce nvmet apply`.

`plan(current, desired)` compares two nvmetcli-shaped dicts (the kernel's `Root.dump()` and the
config's `to_dict()`) and returns the configfs operations that turn one into the other: create
what is missing, change what differs, remove what the file no longer has. Anything unchanged is
not touched, so a host's I/O on an unchanged namespace continues while the rest changes.

The kernel's ordering rules are built in: a port's addr_*/param_* only change while no subsystem
is linked (unlink, change, relink); a namespace's device_*/buffered_io only while it is disabled
(disable, change, enable); allow_any_host and the allow-list exclude each other (drop the links
before allowing any host; clear allow_any_host before linking hosts).
"""
import logging
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from ..config import DISCOVERY_NQN, TargetConfig, keys, passthru_configured
from ..config.model import USERSPACE_KEY
from ..errors import NvmeofError
from . import modules, rbd_map
from .nvmet import NvmetError, Root, TRANSPORT_MODULES, ANA_DEFAULT_GROUP

log = logging.getLogger(__name__)

# attribute write order inside one object
_ADDR_ORDER = ["trtype", "adrfam", "traddr", "trsvcid", "treq", "tsas", "portid"]
_DEVICE_ORDER = ["path", "uuid", "nguid", "eui64"]
_HEXID = {("device", "uuid"), ("device", "nguid"), ("device", "eui64")}
_FLAGS = {("attr", "allow_any_host"), ("attr", "pi_enable"), ("param", "pi_enable"), ("resv", "enable")}
# a host's DH-HMAC-CHAP keys: written to configfs, never shown in a plan
_SECRETS = {("dhchap", "key"), ("dhchap", "ctrl_key")}
SECRET_SHOWN = "<secret>"


def _is_secret(rel: str) -> bool:
    return rel.startswith("hosts/") and rel.rsplit("/", 1)[-1] in ("dhchap_key", "dhchap_ctrl_key")


# "-1" asks for the transport's default, which the kernel resolves (and shows) once the port is enabled
_DEFAULT_MINUS_ONE = {("param", "inline_data_size"), ("param", "max_queue_size")}


@dataclass
class Step:
    op: str                      # mkdir | rmdir | write | symlink | unlink | module | rbd_map | rbd_unmap
    rel: str                     # path under the nvmet root (module: the module name)
    value: Any = None            # write: the value
    target: str = ""             # symlink: the path it points to (under the nvmet root)
    was: Any = None              # write: the current value, if known
    field: str = ""              # the config field this comes from
    desc: str = ""
    only_if_differs: bool = True

    def to_dict(self) -> dict:
        d = {"op": self.op, "path": self.rel, "description": self.desc}
        if self.op == "write":
            d["value"] = SECRET_SHOWN if _is_secret(self.rel) else self.value
            if self.was is not None:
                d["was"] = SECRET_SHOWN if _is_secret(self.rel) else self.was
        if self.target:
            d["target"] = self.target
        if self.field:
            d["field"] = self.field
        return d

    def __str__(self):
        return self.desc


def norm(group: str, name: str, value: Any) -> str:
    """Compare attribute values the way the kernel prints them."""
    s = "" if value is None else str(value).strip()
    if (group, name) == ("device", "path") and s == "(null)":
        return ""
    if (group, name) in _HEXID:
        return "".join(c for c in s.lower() if c in "0123456789abcdef")
    if (group, name) in _FLAGS or name in ("enable", "buffered_io"):
        return {"true": "1", "false": "0", "y": "1", "n": "0", "yes": "1", "no": "0"}.get(s.lower(), s)
    return s


def _order(group: str, names) -> List[str]:
    ref = _ADDR_ORDER if group == "addr" else _DEVICE_ORDER if group == "device" else []
    return sorted(names, key=lambda n: (ref.index(n) if n in ref else len(ref), n))


class _Planner:
    def __init__(self):
        self.steps: List[Step] = []

    def add(self, op, rel, desc, **kw):
        self.steps.append(Step(op=op, rel=rel, desc=desc, **kw))

    def write(self, rel, value, desc, was=None, field="", only_if_differs=True):
        self.add("write", rel, desc, value=value, was=was, field=field, only_if_differs=only_if_differs)

    def groups(self, base: str, what: str, desired: dict, current: Optional[dict], groups: List[str],
               fieldbase: str, skip=()):
        """Attribute writes for the groups of one object (current None: a new object)."""
        for g in groups:
            want = desired.get(g) or {}
            have = (current or {}).get(g) or {}
            names = [n for n in want if (g, n) not in skip]
            if g == "attr":
                lo, hi = want.get("cntlid_min"), want.get("cntlid_max")
                if lo is not None and hi is not None and have.get("cntlid_max") is not None and \
                        int(str(lo), 0) > int(str(have["cntlid_max"]), 0):
                    names.sort(key=lambda n: 0 if n == "cntlid_max" else 1)
            for n in _order(g, names):
                v = want[n]
                if current is None and (v is None or str(v) == ""):
                    continue   # a new object starts with empty strings
                if current is not None and n in have and norm(g, n, have[n]) == norm(g, n, v):
                    continue
                if current is not None and n in have and (g, n) in _DEFAULT_MINUS_ONE and str(v).strip() == "-1":
                    continue
                if current is not None and n not in have and str(v) == "":
                    continue   # the kernel lacks it and nothing is asked
                was = have.get(n) if current is not None else None
                shown = (lambda x: SECRET_SHOWN) if (g, n) in _SECRETS else repr
                self.write(f"{base}/{g}_{n}", v,
                           f"~ set {what} {g}_{n} = {shown(v)}" + (f" (was {shown(was)})" if was is not None else ""),
                           was=was, field=f"{fieldbase}.{g}.{n}" if fieldbase else f"{g}.{n}")


def _by(items, key):
    return {str(i[key]): i for i in items or []}


def plan(current: dict, desired: dict, prune: bool = True) -> List[Step]:
    """The configfs operations that make `current` (a Root.dump()) equal `desired` (a config dict).

    prune=False leaves subsystems, ports and hosts the config does not name alone (objects it names
    are still made to match it exactly)."""
    P = _Planner()
    cur_hosts = _by(current.get("hosts"), "nqn")
    cur_subs = _by(current.get("subsystems"), "nqn")
    cur_ports = _by(current.get("ports"), "portid")
    want_hosts = [(i, h if isinstance(h, dict) else {"nqn": h}) for i, h in enumerate(desired.get("hosts") or [])]
    want_subs = list(enumerate(desired.get("subsystems") or []))
    want_ports = list(enumerate(desired.get("ports") or []))
    want_host_names = {h["nqn"] for _, h in want_hosts}
    want_sub_names = {s["nqn"] for _, s in want_subs}
    want_port_ids = {str(p["portid"]) for _, p in want_ports}

    # discovery NQN (root attribute group, kernels 6.7+).  nvmetcli saves the well-known NQN from those
    # kernels; on a kernel without discovery_nqn that is what the kernel answers to anyway: nothing to do.
    want_discovery = dict(desired.get("discovery") or {})
    have_discovery = current.get("discovery") or {}
    if want_discovery.get("nqn") == DISCOVERY_NQN and "nqn" not in have_discovery:
        want_discovery.pop("nqn")
    if want_discovery:
        P.groups("", "nvmet root", {"discovery": want_discovery}, {"discovery": have_discovery},
                 ["discovery"], "")
        for s in P.steps:
            s.rel = s.rel.lstrip("/")

    # 1. hosts that are new
    for i, h in want_hosts:
        rel = f"hosts/{h['nqn']}"
        cur = cur_hosts.get(h["nqn"])
        if cur is None:
            P.add("mkdir", rel, f"+ create host {h['nqn']}", field=f"hosts[{i}]")
        P.groups(rel, f"host {h['nqn']}", h, cur, [g for g in h if g != "nqn"], f"hosts[{i}]")

    # 2. subsystems: create / update (namespaces, attributes, allow-list)
    for i, s in want_subs:
        nqn = s["nqn"]
        rel = f"subsystems/{nqn}"
        fb = f"subsystems[{i}]"
        cur = cur_subs.get(nqn)
        if cur is None:
            P.add("mkdir", rel, f"+ create subsystem {nqn}", field=fb)
        want_attr = dict(s.get("attr") or {})
        any_host = norm("attr", "allow_any_host", want_attr.pop("allow_any_host", "0")) == "1"
        P.groups(rel, f"subsystem {nqn}", {"attr": want_attr}, cur, ["attr"], fb)
        cur_allowed = set((cur or {}).get("allowed_hosts") or [])
        want_allowed = list(s.get("allowed_hosts") or [])
        cur_any = norm("attr", "allow_any_host", ((cur or {}).get("attr") or {}).get("allow_any_host", "0")) == "1"
        for h in sorted(cur_allowed - set(want_allowed)):
            P.add("unlink", f"{rel}/allowed_hosts/{h}", f"- disallow host {h} on subsystem {nqn}", field=f"{fb}.allowed_hosts")
        if any_host != cur_any or cur is None:
            P.write(f"{rel}/attr_allow_any_host", "1" if any_host else "0",
                    f"~ set subsystem {nqn} attr_allow_any_host = {'1' if any_host else '0'}"
                    + (f" (was {'1' if cur_any else '0'})" if cur is not None else ""),
                    was=None if cur is None else ("1" if cur_any else "0"), field=f"{fb}.attr.allow_any_host")
        for j, h in enumerate(want_allowed):
            if h not in cur_allowed:
                P.add("symlink", f"{rel}/allowed_hosts/{h}", f"+ allow host {h} on subsystem {nqn}",
                      target=f"hosts/{h}", field=f"{fb}.allowed_hosts[{j}]")
        cur_ns = _by((cur or {}).get("namespaces"), "nsid")
        want_ns = list(enumerate(s.get("namespaces") or []))
        want_nsids = {str(n["nsid"]) for _, n in want_ns}
        for nsid in sorted(set(cur_ns) - want_nsids, key=int):
            P.add("rmdir", f"{rel}/namespaces/{nsid}", f"- remove namespace {nsid} of subsystem {nqn}", field=f"{fb}.namespaces")
        for j, n in want_ns:
            _plan_namespace(P, rel, nqn, n, cur_ns.get(str(n["nsid"])), f"{fb}.namespaces[{j}]")

    # 3. ports: removed ones first (frees their addresses), then new/changed ones
    for pid in sorted(set(cur_ports) - want_port_ids, key=int) if prune else []:
        _plan_port_removal(P, cur_ports[pid])
    for i, p in want_ports:
        _plan_port(P, p, cur_ports.get(str(p["portid"])), f"ports[{i}]")

    # 4. subsystems the file no longer has (their port links went in step 3)
    for nqn in sorted(set(cur_subs) - want_sub_names) if prune else []:
        cur = cur_subs[nqn]
        rel = f"subsystems/{nqn}"
        for pid, p in sorted(cur_ports.items()):
            if pid in want_port_ids and nqn in (p.get("subsystems") or []):
                pass   # unlinked by _plan_port since the desired port does not list it
        for n in cur.get("namespaces") or []:
            P.add("rmdir", f"{rel}/namespaces/{n['nsid']}", f"- remove namespace {n['nsid']} of subsystem {nqn}")
        for h in cur.get("allowed_hosts") or []:
            P.add("unlink", f"{rel}/allowed_hosts/{h}", f"- disallow host {h} on subsystem {nqn}")
        P.add("rmdir", rel, f"- remove subsystem {nqn}")

    # 5. hosts the file no longer has
    for nqn in sorted(set(cur_hosts) - want_host_names) if prune else []:
        for s in current.get("subsystems") or []:
            if s["nqn"] in want_sub_names and nqn in (s.get("allowed_hosts") or []):
                pass   # unlinked in step 2
        P.add("rmdir", f"hosts/{nqn}", f"- remove host {nqn}")
    return P.steps


def _plan_namespace(P: _Planner, srel: str, nqn: str, n: dict, cur: Optional[dict], fb: str):
    nsid = n["nsid"]
    rel = f"{srel}/namespaces/{nsid}"
    what = f"namespace {nsid} of {nqn}"
    want_enable = norm("", "enable", n.get("enable", 1)) == "1"
    want_grp = n.get("ana_grpid", (n.get("ana") or {}).get("grpid"))
    want_buf = n.get("buffered_io")
    live_groups = [g for g in ("device", "resv") if g in n]
    if cur is None:
        P.add("mkdir", rel, f"+ create {what}", field=fb)
        P.groups(rel, what, n, None, live_groups, fb)
        if want_buf is not None and norm("", "buffered_io", want_buf) == "1":
            P.write(f"{rel}/buffered_io", "1", f"~ set {what} buffered_io = 1", field=f"{fb}.buffered_io")
        if want_grp is not None and str(want_grp) != str(ANA_DEFAULT_GROUP):
            P.write(f"{rel}/ana_grpid", str(want_grp), f"~ set {what} ana_grpid = {want_grp}", field=f"{fb}.ana_grpid")
        if want_enable:
            P.write(f"{rel}/enable", "1", f"+ enable {what}", field=f"{fb}.enable")
        return
    cur_enable = norm("", "enable", cur.get("enable", 0)) == "1"
    sub = _Planner()
    sub.groups(rel, what, n, cur, live_groups, fb)
    cur_buf = norm("", "buffered_io", cur.get("buffered_io", 0)) == "1"
    if want_buf is not None and (norm("", "buffered_io", want_buf) == "1") != cur_buf or want_buf is None and cur_buf:
        v = "1" if want_buf is not None and norm("", "buffered_io", want_buf) == "1" else "0"
        sub.write(f"{rel}/buffered_io", v, f"~ set {what} buffered_io = {v} (was {'1' if cur_buf else '0'})",
                  was="1" if cur_buf else "0", field=f"{fb}.buffered_io")
    needs_disable = bool(sub.steps) and cur_enable
    if needs_disable:
        P.write(f"{rel}/enable", "0", f"~ disable {what} to change {', '.join(s.rel.rsplit('/', 1)[1] for s in sub.steps)}",
                field=f"{fb}.enable", only_if_differs=False)
    P.steps.extend(sub.steps)
    if want_grp is not None and str(want_grp) != str(cur.get("ana_grpid", ANA_DEFAULT_GROUP)):
        P.write(f"{rel}/ana_grpid", str(want_grp), f"~ set {what} ana_grpid = {want_grp} (was {cur.get('ana_grpid')})",
                was=str(cur.get("ana_grpid")), field=f"{fb}.ana_grpid")
    if want_enable and (needs_disable or not cur_enable):
        P.write(f"{rel}/enable", "1", f"+ enable {what}", field=f"{fb}.enable", only_if_differs=False)
    elif not want_enable and cur_enable:
        P.write(f"{rel}/enable", "0", f"- disable {what}", field=f"{fb}.enable")


def _plan_port_removal(P: _Planner, cur: dict):
    pid = cur["portid"]
    rel = f"ports/{pid}"
    for nqn in cur.get("subsystems") or []:
        P.add("unlink", f"{rel}/subsystems/{nqn}", f"- unlink subsystem {nqn} from port {pid}")
    for r in cur.get("referrals") or []:
        P.add("rmdir", f"{rel}/referrals/{r['name']}", f"- remove referral {r['name']} of port {pid}")
    for a in cur.get("ana_groups") or []:
        if int(a["grpid"]) != ANA_DEFAULT_GROUP:
            P.add("rmdir", f"{rel}/ana_groups/{a['grpid']}", f"- remove ANA group {a['grpid']} of port {pid}")
    P.add("rmdir", rel, f"- remove port {pid}")


def _plan_port(P: _Planner, p: dict, cur: Optional[dict], fb: str):
    pid = p["portid"]
    rel = f"ports/{pid}"
    what = f"port {pid}"
    want_links = list(p.get("subsystems") or [])
    cur_links = list((cur or {}).get("subsystems") or [])
    if cur is None:
        P.add("mkdir", rel, f"+ create {what}", field=fb)
    attrs = _Planner()
    attrs.groups(rel, what, p, cur, [g for g in ("addr", "param") if g in p], fb)
    relink = bool(attrs.steps) and bool(cur_links)
    if relink:
        for nqn in cur_links:
            P.add("unlink", f"{rel}/subsystems/{nqn}",
                  f"- unlink subsystem {nqn} from {what} (the kernel changes addr/param only on an unlinked port)")
    else:
        for nqn in cur_links:
            if nqn not in want_links:
                P.add("unlink", f"{rel}/subsystems/{nqn}", f"- unlink subsystem {nqn} from {what}", field=f"{fb}.subsystems")
    P.steps.extend(attrs.steps)

    # ANA groups (group 1 always exists)
    cur_ana = _by((cur or {}).get("ana_groups"), "grpid")
    want_ana = list(enumerate(p.get("ana_groups") or []))
    want_ids = {str(a["grpid"]) for _, a in want_ana}
    for g in sorted(set(cur_ana) - want_ids, key=int):
        if int(g) != ANA_DEFAULT_GROUP:
            P.add("rmdir", f"{rel}/ana_groups/{g}", f"- remove ANA group {g} of {what}")
    for j, a in want_ana:
        g = str(a["grpid"])
        arel = f"{rel}/ana_groups/{g}"
        ac = cur_ana.get(g)
        if ac is None and int(g) != ANA_DEFAULT_GROUP:
            P.add("mkdir", arel, f"+ create ANA group {g} of {what}", field=f"{fb}.ana_groups[{j}]")
        if ac is None and int(g) == ANA_DEFAULT_GROUP and cur is not None:
            ac = {}
        P.groups(arel, f"ANA group {g} of {what}", a, ac, ["ana"], f"{fb}.ana_groups[{j}]")

    # referrals
    cur_ref = _by((cur or {}).get("referrals"), "name")
    want_ref = list(enumerate(p.get("referrals") or []))
    for name in sorted(set(cur_ref) - {r["name"] for _, r in want_ref}):
        P.add("rmdir", f"{rel}/referrals/{name}", f"- remove referral {name} of {what}")
    for j, r in want_ref:
        rrel = f"{rel}/referrals/{r['name']}"
        rc = cur_ref.get(r["name"])
        rw = f"referral {r['name']} of {what}"
        want_en = norm("", "enable", r.get("enable", 1)) == "1"
        if rc is None:
            P.add("mkdir", rrel, f"+ create {rw}", field=f"{fb}.referrals[{j}]")
            P.groups(rrel, rw, r, None, ["addr"], f"{fb}.referrals[{j}]")
            if want_en:
                P.write(f"{rrel}/enable", "1", f"+ enable {rw}", field=f"{fb}.referrals[{j}].enable")
            continue
        sub = _Planner()
        sub.groups(rrel, rw, r, rc, ["addr"], f"{fb}.referrals[{j}]")
        cur_en = norm("", "enable", rc.get("enable", 0)) == "1"
        if sub.steps and cur_en:
            P.write(f"{rrel}/enable", "0", f"~ disable {rw} to change it", only_if_differs=False)
        P.steps.extend(sub.steps)
        if want_en and (not cur_en or (sub.steps and cur_en)):
            P.write(f"{rrel}/enable", "1", f"+ enable {rw}", only_if_differs=False)
        elif not want_en and cur_en:
            P.write(f"{rrel}/enable", "0", f"- disable {rw}")

    # links last: the port is enabled by the first one
    trtype = (p.get("addr") or {}).get("trtype") or ((cur or {}).get("addr") or {}).get("trtype")
    new_links = [n for n in want_links if relink or n not in cur_links]
    if new_links and trtype in TRANSPORT_MODULES:
        P.add("module", TRANSPORT_MODULES[trtype], f"  (load {TRANSPORT_MODULES[trtype]} if needed)")
    for k, nqn in enumerate(want_links):
        if nqn in new_links:
            P.add("symlink", f"{rel}/subsystems/{nqn}", f"+ link subsystem {nqn} to {what}",
                  target=f"subsystems/{nqn}", field=f"{fb}.subsystems[{want_links.index(nqn)}]")


def execute(root: Root, steps: List[Step]) -> List[Step]:
    """Run the steps; returns those that changed something (writes equal to the current value skip)."""
    done = []
    for st in steps:
        if st.op == "module":
            if root.load_modules and not modules.is_loaded(st.rel, root.sys_module):
                modules.ensure(st.rel, "an nvmet port", root.sys_module)
                done.append(st)
            continue
        if st.op == "write":
            path = root.abspath(st.rel)
            if st.only_if_differs and root.fs.isfile(path):
                group, _, name = st.rel.rsplit("/", 1)[1].partition("_")
                cur = (root._read(st.rel) or "").strip()
                if norm(group, name, cur) == norm(group, name, st.value):
                    continue
            if not root.fs.isfile(path):
                if str(st.value) == "":
                    continue
                if st.rel.endswith("/resv_enable"):
                    raise NvmetError(f"{st.rel}: reservations (resv_enable"
                                     + (f", {st.field}" if st.field else "") + ") need nvmet of Linux 6.13 or newer; "
                                     "this kernel's has no such attribute",
                                     "serve this config with the userspace target (nvmeof-roce target serve), which "
                                     "has reservations, or run a newer kernel, or remove \"resv\" from the namespace")
                raise NvmetError(f"{st.rel}: this kernel's nvmet has no such attribute"
                                 + (f" ({st.field})" if st.field else ""),
                                 "remove the key from the config; the running kernel (uname -r) does not support it")
            root._write(st.rel, st.value, st.field)
        elif st.op == "mkdir":
            root._mkdir(st.rel, st.field)
        elif st.op == "rmdir":
            root._rmdir(st.rel, st.field)
        elif st.op == "symlink":
            root._symlink(st.target, st.rel, st.field)
        elif st.op == "unlink":
            root._unlink(st.rel, st.field)
        else:
            raise ValueError(st.op)
        done.append(st)
    return done


def kernel_dict(cfg: TargetConfig, rbd_devices: Optional[Dict[tuple, str]] = None) -> dict:
    """The config for the kernel: refuses keys only the userspace target understands.  An rbd namespace
    (nvmeof_roce.backend "rbd") is the kernel's too: krbd maps it (kernel/rbd_map.py) and its device.path is the
    device `rbd_devices` names for it ((nqn, nsid) -> path; without it, the udev link it would have)."""
    keys = [k for k in cfg.userspace_only_keys() if not _rbd_key(cfg, k)]
    keys += _rbd_extra_keys(cfg)
    if keys:
        raise NvmetError(
            f"{cfg.source}: {keys[0]}: only the userspace target (nvmeof-roce target serve) understands "
            f"\"nvmeof_roce\" keys; the kernel nvmet would ignore them"
            + (f" (also: {', '.join(keys[1:])})" if len(keys) > 1 else ""),
            "for the kernel, remove the \"nvmeof_roce\" keys and give each namespace a device.path (a file, "
            "a loop device or null_blk /dev/nullb0), or an rbd namespace (\"backend\": \"rbd\", \"rbd\": {...}, "
            "mapped with krbd); or serve this file with nvmeof-roce target serve")
    for i, s in enumerate(cfg.subsystems):
        if s.allow_any_host and s.allowed_hosts:
            raise NvmetError(f"{cfg.source}: subsystems[{i}].attr.allow_any_host: is 1 while allowed_hosts lists "
                             "hosts, which the kernel refuses (EINVAL)",
                             'set "allow_any_host": "0" to use the allow-list, or empty allowed_hosts')
        if passthru_configured(s.raw.get("passthru")):
            raise NvmetError(f"{cfg.source}: subsystems[{i}].passthru: passthru subsystems are not supported by "
                             "nvmeof-roce nvmet apply", "use nvmetcli for passthru subsystems")
    d = cfg.to_dict()
    for s, sd in zip(cfg.subsystems, d["subsystems"]):
        for ns, nd in zip(s.namespaces, sd.get("namespaces") or []):
            if ns.backend == "rbd":
                nd.pop(USERSPACE_KEY, None)
                path = (rbd_devices or {}).get((s.nqn, ns.nsid)) or rbd_map.stable_path(ns.backend_settings)
                nd.setdefault("device", {})["path"] = path if ns.enabled else ""
    return _read_key_files(cfg, d)


# What the kernel path takes of an rbd namespace's nvmeof_roce section (block_size: krbd's is 512)
_RBD_KERNEL_KEYS = {"backend", "rbd", "block_size"}
_NS_KEY = re.compile(r"subsystems\[(\d+)\]\.namespaces\[(\d+)\]\.nvmeof_roce")


def _rbd_namespace_raw(cfg: TargetConfig, path: str) -> Optional[dict]:
    m = _NS_KEY.fullmatch(path)
    if not m:
        return None
    ns = cfg.subsystems[int(m.group(1))].namespaces[int(m.group(2))]
    return ns.raw.get(USERSPACE_KEY) if ns.backend == "rbd" else None


def _rbd_key(cfg: TargetConfig, path: str) -> bool:
    return _rbd_namespace_raw(cfg, path) is not None


def _rbd_extra_keys(cfg: TargetConfig) -> List[str]:
    """The keys of rbd namespaces' nvmeof_roce sections the kernel cannot take."""
    out = []
    for path in cfg.userspace_only_keys():
        raw = _rbd_namespace_raw(cfg, path)
        if raw is None:
            continue
        out += [f"{path}.{k}" for k in sorted(set(raw) - _RBD_KERNEL_KEYS)]
        if raw.get("block_size", 512) not in (512, "512"):
            out.append(f"{path}.block_size (krbd's logical block is 512 bytes)")
    return out


def map_rbd(cfg: TargetConfig, dry_run: bool = False, rbd: Optional[rbd_map.RbdTool] = None
            ) -> Tuple[List[Step], Dict[tuple, str]]:
    """Map the config's rbd namespaces with krbd (an image already mapped is reused): the steps that mapped
    one (dry_run: that would) and {(nqn, nsid): the device path nvmet is given}.  No rbd namespace: no call."""
    wanted = rbd_map.rbd_namespaces(cfg)
    if not wanted:
        return [], {}
    rbd = rbd or rbd_map.RbdTool()
    mapped = _showmapped(rbd, dry_run)
    steps, devices = [], {}
    for (nqn, nsid), settings in wanted.items():
        device = rbd.mapped_device(settings, mapped)
        if device is None:
            desc = f"+ map rbd image {settings.spec()} with krbd (rbd map) for namespace {nsid} of {nqn}"
            if dry_run:
                devices[(nqn, nsid)] = rbd_map.stable_path(settings)
                steps.append(Step(op="rbd_map", rel=settings.spec(), desc=desc))
                continue
            device = rbd.map(settings)
            mapped.append({"pool": settings.pool, "namespace": settings.namespace, "name": settings.image,
                           "snap": "-", "device": device})
            steps.append(Step(op="rbd_map", rel=settings.spec(), value=device, desc=f"{desc}: {device}"))
        devices[(nqn, nsid)] = rbd.device_path(settings, device)
    return steps, devices


def _showmapped(rbd: "rbd_map.RbdTool", dry_run: bool) -> list:
    """`rbd showmapped`; a dry run where the tool cannot answer (the offline check) plans as if nothing is mapped."""
    try:
        return rbd.showmapped()
    except NvmeofError:
        if not dry_run:
            raise
        return []


def _device_paths(d: dict) -> set:
    return {(n.get("device") or {}).get("path") or "" for s in d.get("subsystems") or []
            for n in s.get("namespaces") or []} - {""}


def unmap_released(before: dict, after: dict, dry_run: bool = False,
                   rbd: Optional[rbd_map.RbdTool] = None) -> List[Step]:
    """`rbd unmap` each krbd device a namespace of `before` (a Root.dump()) used and none of `after` does (the
    apply removed the namespace or moved it to another device); the steps (dry_run: planned)."""
    gone = {p for p in _device_paths(before) - _device_paths(after) if p.startswith("/dev/rbd")}
    if not gone:
        return []
    rbd = rbd or rbd_map.RbdTool()
    mapped = _showmapped(rbd, dry_run)
    kept = {rbd.is_mapped_device(p, mapped) for p in _device_paths(after)}
    steps = []
    for device in sorted({rbd.is_mapped_device(p, mapped) for p in gone} - kept - {None}):
        if not dry_run:
            rbd.unmap(device)
        steps.append(Step(op="rbd_unmap", rel=device, desc=f"- unmap {device} (rbd unmap): no namespace uses it"))
    return steps


def _read_key_files(cfg: TargetConfig, d: dict) -> dict:
    """The hosts' DH-HMAC-CHAP keys given as key file paths, read (0600 files: config/keys.py): configfs takes
    the key itself.  A keyring name is the userspace target's."""
    for i, host in enumerate(d["hosts"]):
        group = host.get("dhchap") or {}
        for name in ("key", "ctrl_key"):
            value = group.get(name)
            if not isinstance(value, str) or not value:
                continue
            where = f"hosts[{i}].dhchap.{name}"
            if keys.kind(value) == "keyring":
                raise NvmetError(f"{cfg.source}: {where}: {value!r} names a keyring key, which only the userspace "
                                 "target has", "give the key file's absolute path (or the key itself) instead")
            group[name], _ = keys.secret_text(value, {}, cfg.source, where)
    return d


def apply(root: Root, cfg: TargetConfig, dry_run: bool = False, prune: bool = True,
          rbd: Optional[rbd_map.RbdTool] = None) -> List[Step]:
    """Reconcile the kernel with `cfg`; returns the steps run (or, with dry_run, planned): rbd images mapped
    first, the configfs steps, then the krbd devices no namespace uses any more unmapped."""
    kernel_dict(cfg)  # its refusals before anything is mapped
    current = root.dump()
    mapped, devices = map_rbd(cfg, dry_run, rbd)
    desired = kernel_dict(cfg, devices)
    steps = plan(current, desired, prune)
    if dry_run:
        return mapped + steps + unmap_released(current, _planned_after(current, desired, prune), True, rbd)
    done = mapped + execute(root, steps)
    return done + unmap_released(current, root.dump(), rbd=rbd)


def _planned_after(current: dict, desired: dict, prune: bool) -> dict:
    """The namespaces' devices once `desired` is applied (for the dry run's unmaps): the desired subsystems',
    and without prune the other current ones too."""
    names = {s["nqn"] for s in desired.get("subsystems") or []}
    kept = [] if prune else [s for s in current.get("subsystems") or [] if s["nqn"] not in names]
    return {"subsystems": list(desired.get("subsystems") or []) + kept}


def remove(root: Root, cfg: TargetConfig) -> List[str]:
    """Remove exactly the ports, subsystems and hosts `cfg` names (others stay); returns what went."""
    gone = []
    for p in cfg.ports:
        if root.fs.isdir(root.abspath(f"ports/{p.portid}")):
            root.port(p.portid).delete()
            gone.append(f"port {p.portid}")
    before = root.dump()
    for s in cfg.subsystems:
        if root.fs.isdir(root.abspath(f"subsystems/{s.nqn}")):
            root.subsystem(s.nqn).delete()
            gone.append(f"subsystem {s.nqn}")
    gone += [s.rel for s in unmap_released(before, root.dump())]
    for h in cfg.hosts:
        if root.fs.isdir(root.abspath(f"hosts/{h}")) and \
                not any(h in s.allowed_hosts for s in root.subsystems):
            root.host(h).delete()
            gone.append(f"host {h}")
    return gone
