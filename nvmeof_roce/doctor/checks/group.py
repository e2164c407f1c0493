"""A gateway group (docs/gateway-group.md): several `target serve` gateways over one Ceph cluster, each ANA group
served by the gateway that holds its lease.  Read from the running gateway's `nvmeof_group_status`, else from the
group's RADOS state (doctor/group_source.py); the checks themselves are functions of that status, so they are
tested on canned answers as well as on a development cluster.

- group.cluster: the group's state can be read (the gateway's keeper read it lately; the doctor's own client
  connects), else the Ceph cluster is unreachable from there: the conf, client and keyring are named.
- group.members: each member and whether it is alive (it renewed its lease lately), and any member the group
  fenced (blocklisted): it exits 75 and systemd restarts it.
- group.ana: each ANA group's home, owner and lease remaining; a group with no owner or whose owner's lease
  lapsed with nobody taking it (its namespaces have no optimized path); a group away from home (the failback
  command); the last failover and how long it took.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

from ..context import Context
from ..group_source import GroupView
from ..result import CheckResult, fail, ok, skipped, warn

EXIT_FENCED = 75  # service/group.py's: a fenced gateway exits EX_TEMPFAIL, its unit's Restart= starts it again
FAILBACK = "nvmeof-roce rpc nvmeof_group_failback '{{\"ana_group\": {grpid}}}'"


def check_gateway_group(ctx: Context) -> List[CheckResult]:
    """A gateway group's health as its running gateway (or its RADOS state) shows it: the cluster reachable,
    the members alive and not fenced, every ANA group owned (an optimized path for its namespaces) and at home."""
    return group_results(ctx.group_view, now=time.time())


def group_results(view: GroupView, now: float) -> List[CheckResult]:
    if view.skipped:
        return [skipped("group", "", view.skipped, view.tried)]
    name = (view.status or {}).get("group") or view.settings.get("name") or ""
    cluster = check_cluster(view, name, now)
    if view.status is None:
        return [cluster]
    return [cluster, check_members(view, name, now), check_ana(view, name, now)]


def _client(settings: Dict[str, Any]) -> str:
    keyring = settings.get("keyring")
    return (f"conf {settings.get('conf')}, client.{settings.get('id')}"
            + (f", keyring {keyring}" if keyring else " (keyring from the conf)")
            + f", pool {settings.get('pool')}" + (f" namespace {settings['namespace']}"
                                                   if settings.get("namespace") else ""))


def _ceph_s(settings: Dict[str, Any]) -> str:
    keyring = settings.get("keyring")
    return (f"ceph -s -c {settings.get('conf')} --id {settings.get('id')}"
            + (f" --keyring {keyring}" if keyring else ""))


def _lease(view: GroupView) -> float:
    return float((view.status or {}).get("lease_seconds") or view.settings.get("lease") or 10)


def check_cluster(view: GroupView, name: str, now: float) -> CheckResult:
    """The Ceph cluster holding the group's state answers: the doctor's own read of it, or the gateway's
    keeper's last pass (it reads the state every lease/6)."""
    settings = view.settings
    evidence = [f"source: {view.source}"] if view.source else []
    evidence += [f"tried: {t}" for t in view.tried]
    evidence.append(f"cluster: {_client(settings)}")
    details = {"source": view.source, "settings": settings}
    if view.status is None:
        return fail("group.cluster", name, f"the group's state cannot be read: {view.error}", evidence,
                    f"{view.fix or 'check the cluster'}; check it with {_ceph_s(settings)}", **details)
    cluster = view.status.get("cluster") or {}
    read_ago, error = cluster.get("read_ago"), cluster.get("error")
    if not view.from_gateway:
        return ok("group.cluster", name, "reachable: the group's state read directly", evidence, **details)
    gateway, lease = view.status.get("gateway"), _lease(view)
    if read_ago is not None:
        evidence.append(f"{gateway}: the group's state last read {read_ago:.1f} s ago (every {lease / 6:.1f} s)")
    if error:
        evidence.append(f"{gateway}: its last read failed: {error}")
    details.update(read_ago=read_ago, error=error)
    if error and (read_ago is None or read_ago > lease):
        return fail("group.cluster", name, f"the Ceph cluster is unreachable from {gateway}: no read of the group's "
                    f"state for {read_ago if read_ago is not None else '?'} s ({error})", evidence,
                    f"check the cluster and {gateway}'s network to its monitors and OSDs: {_ceph_s(settings)}; "
                    f"{gateway} stops serving its ANA groups at its lease's deadline and a survivor fences it",
                    **details)
    if error:
        return warn("group.cluster", name, f"{gateway}'s last read of the group's state failed: {error}", evidence,
                    f"check the cluster: {_ceph_s(settings)}", **details)
    return ok("group.cluster", name, f"reachable from {gateway}"
              + (f" (state read {read_ago:.1f} s ago)" if read_ago is not None else ""), evidence, **details)


def _fenced_by_events(status: Dict[str, Any], record: Dict[str, Any]) -> Optional[dict]:
    """The take-over (this gateway's own events) that blocklisted `record`'s client, when it came after it
    joined: a member that restarted since has a new client and a new record."""
    for event in reversed(status.get("events") or []):
        if event.get("event") == "took_over" and event.get("previous") == record["gateway"] \
                and event.get("at", 0) >= record.get("started", 0):
            return event
    return None


def member_states(status: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Each member: alive (True: it answered, or holds a lease it renewed; False: the recorded owner of an ANA
    group whose lease it does not hold; None: it holds no lease to judge by), blocklisted, and why."""
    states = []
    answering = status.get("gateway")
    groups = status.get("ana_groups") or []
    for record in status.get("member_records") or [{"gateway": g} for g in status.get("members") or []]:
        gw, instance = record["gateway"], record.get("instance_id")
        state = {"gateway": gw, "instance_id": instance, "alive": None, "blocklisted": False, "why": ""}
        held = [g for g in groups if (g.get("holder") or {}).get("instance_id") == instance
                and instance is not None and (g.get("lease_remaining") or 0) > 0]
        lapsed = [g for g in groups if g.get("owner_instance") == instance and instance is not None
                  and g.get("lease_remaining") is not None and g not in held]
        if gw == answering and status.get("fenced"):
            state.update(blocklisted=True, alive=False, why="this gateway was fenced (blocklisted) by the group")
        elif record.get("blocklisted"):
            state.update(blocklisted=True, alive=False,
                         why=f"its client {', '.join(record['blocklisted'])} is in the OSD blocklist")
        elif _fenced_by_events(status, record) is not None and gw != answering:
            event = _fenced_by_events(status, record)
            state.update(blocklisted=True, alive=False,
                         why=f"{answering} blocklisted it when it took ANA group {event.get('ana_group')} over")
        elif gw == answering:
            state.update(alive=True, why="it answered nvmeof_group_status")
        elif held:
            state.update(alive=True, why="renewed its lease of ANA group(s) "
                         + ", ".join(f"{g['ana_group']} ({g['lease_remaining']:.1f} s left)" for g in held))
        elif lapsed:
            state.update(alive=False, why="the recorded owner of ANA group(s) "
                         + ", ".join(str(g["ana_group"]) for g in lapsed) + " but its lease is not held: it "
                         "stopped renewing")
        else:
            state["why"] = "holds no lease (owns no ANA group): nothing to judge it by"
        states.append(state)
    return states


def check_members(view: GroupView, name: str, now: float) -> CheckResult:
    """The members, alive or not, and any the group fenced."""
    states = member_states(view.status)
    evidence = [f"{s['gateway']}: " + {True: "alive", False: "not alive", None: "no lease"}[s["alive"]]
                + (" (BLOCKLISTED)" if s["blocklisted"] else "") + f": {s['why']}" for s in states]
    details = {"members": states}
    fenced = [s["gateway"] for s in states if s["blocklisted"]]
    silent = [s["gateway"] for s in states if s["alive"] is False and not s["blocklisted"]]
    if not states:
        return warn("group.members", name, "the group has no member", evidence,
                    "start the group's gateways (target serve with the group in their config)", **details)
    if fenced:
        return fail("group.members", name, f"fenced (blocklisted) by the group: {', '.join(fenced)}", evidence,
                    f"a fenced gateway serves nothing and exits with status {EXIT_FENCED} (EX_TEMPFAIL); systemd "
                    "restarts it (the unit's Restart=) with a new RADOS client that joins the group again. If it "
                    "stays down: systemctl status nvmeof-roce-target@NAME and journalctl -u "
                    "nvmeof-roce-target@NAME on its machine; then move its ANA groups home with "
                    + FAILBACK.format(grpid="N"), **details)
    if silent:
        return warn("group.members", name, f"not renewing their leases: {', '.join(silent)}", evidence,
                    "look at those gateways (systemctl status nvmeof-roce-target@NAME, their log); a survivor "
                    "takes their ANA groups over once their leases end", **details)
    alive = [s["gateway"] for s in states if s["alive"]]
    return ok("group.members", name, f"{len(states)} member(s): " + ", ".join(
        f"{s['gateway']} ({'alive' if s['alive'] else 'no lease'})" for s in states), evidence,
        alive=alive, **details)


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))


def last_failover(status: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    taken = [e for e in status.get("events") or [] if e.get("event") == "took_over"]
    return taken[-1] if taken else None


def _lapsed(status: Dict[str, Any], g: Dict[str, Any]) -> bool:
    """The owner on record does not hold the group's lease any more, and nobody else does."""
    if g.get("owner") is None:
        return False
    holder = g.get("holder")
    if holder is not None and (g.get("lease_remaining") or 0) > 0:
        return False
    if g.get("lease_remaining") is None:  # not read: only this gateway's own can be told (its lease not serving)
        return g.get("owner") == status.get("gateway") and g.get("here") != "optimized"
    return True


def check_ana(view: GroupView, name: str, now: float) -> CheckResult:
    """Each ANA group owned (its namespaces have an optimized path) and at home."""
    status = view.status
    groups = status.get("ana_groups") or []
    members = {s["gateway"]: s for s in member_states(status)}
    evidence, failures, warnings, fixes = [], [], [], []
    for g in groups:
        grpid, home, owner = g["ana_group"], g["home"], g.get("owner")
        remaining = g.get("lease_remaining")
        left = "lease not read" if remaining is None else f"lease {remaining:.1f} s left"
        if g.get("holder_read_ago"):
            left += f" (read {g['holder_read_ago']:.1f} s ago)"
        evidence.append(f"ANA group {grpid}: home {home}, owner {owner or 'nobody'}"
                        + (f" since {_clock(g['since'])}" if g.get("since") else "") + f", {left}"
                        + (f", failback to {g['failback']} asked" if g.get("failback") else ""))
        if owner is None and g.get("failback"):
            warnings.append(f"ANA group {grpid} is being handed back to {g['failback']}")
        elif owner is None:
            failures.append(f"ANA group {grpid} has no owner: its namespaces have no optimized path")
            fixes.append(f"start ANA group {grpid}'s home gateway {home} (it takes its free group when it starts)")
        elif _lapsed(status, g):
            failures.append(f"ANA group {grpid}: its owner {owner}'s lease lapsed and nobody took it over: its "
                            "namespaces have no optimized path")
            fixes.append(f"a survivor takes ANA group {grpid} over once {owner}'s lease ended, blocklisting it first: "
                         "check that the other gateways run, reach the cluster and have the mon cap 'profile rbd' "
                         "(osd blocklist); read their log (journalctl -u nvmeof-roce-target@NAME)")
        elif owner != home:
            home_state = members.get(home)
            usable = home_state is not None and not home_state["blocklisted"]
            warnings.append(f"ANA group {grpid} is owned by {owner}, away from its home {home}")
            fixes.append((f"once {home} is back, " if not usable else "")
                         + f"move it home: {FAILBACK.format(grpid=grpid)}"
                         + ("" if usable else f" ({home} is {'fenced' if home_state else 'not a member'}: "
                                              "start it first)"))
    failover = last_failover(status)
    if failover is not None:
        evidence.append(f"last failover: ANA group {failover['ana_group']} taken over from "
                        f"{failover.get('previous') or '?'} by {status.get('gateway')} at {_clock(failover['at'])} "
                        f"({now - failover['at']:.0f} s ago), the take-over took {failover.get('seconds', '?')} s "
                        "(blocklist, OSD map, break, lock), after the old owner's lease ended")
    details = {"ana_groups": groups, "last_failover": failover}
    if not groups:
        return warn("group.ana", name, "the group has no ANA group", evidence,
                    "give each gateway its home ANA groups (nvmeof_roce.group.ana_groups)", **details)
    if failures:
        return fail("group.ana", name, "; ".join(failures + warnings), evidence, "\n".join(fixes), **details)
    if warnings:
        return warn("group.ana", name, "; ".join(warnings), evidence, "\n".join(fixes), **details)
    return ok("group.ana", name, ", ".join(
        f"{g['ana_group']}: {g['owner']}" + (f" ({g['lease_remaining']:.1f} s left)"
                                            if g.get("lease_remaining") is not None else "") for g in groups)
        + " (each at home)", evidence, **details)
