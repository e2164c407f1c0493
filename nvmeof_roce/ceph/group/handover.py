"""Moving an ANA group between gateways: the survivor's take-over after a failure, and the clean failback.

Failover (the owner went silent, its lease expired):
    `fail_over(store, lease)`: the ANA record's owner is the client to fence; `lease.take_over(owner)`
    blocklists it first, breaks its lock, acquires; the record names the new owner.

Failback (the home gateway is back; an admin asks, or `failback_due` says its settle time has passed):
    1. `request_failback(store, grpid, reason)`: record `failback.<grpid>`: "hand it to <home>".
    2. The owner, told by its watch, stops serving the ANA group (its engine's ANA state), then
       `hand_back(store, lease)`: releases the lease (RELEASING -> unlock -> STANDBY), the record's owner
       becomes nobody.
    3. The home gateway, told by its watch, `take_back(store, lease)`: acquires the free lease (no blocklist: the
       owner let go itself), the record names it owner, the request is removed.
    An owner that dies between 1 and 2 keeps its lock until it expires: the home gateway then fails over to it
    (blocklist and all) instead of taking it back.

Each step is a blocking call: off the event loop.
"""
from __future__ import annotations

import time
from typing import Callable, Mapping

from .ana import AnaLease
from .errors import GroupError
from .records import AnaGroup, FailbackRequest
from .store import GroupSnapshot, GroupState, GroupStore

Now = Callable[[], float]


def _ana(ana_groups: Mapping[int, AnaGroup], grpid: int, group: str) -> AnaGroup:
    ana = ana_groups.get(grpid)
    if ana is None:
        raise GroupError(f"gateway group {group}: ANA group {grpid} has no record (no home gateway)",
                         "give the ANA group a home first (an `ana.<grpid>` record with its home gateway)")
    return ana


def set_home(store: GroupStore, grpid: int, home: str, now: Now = time.time) -> GroupSnapshot:
    """Make `home` the ANA group's home gateway (a new group has no owner yet)."""
    def change(state: GroupState) -> None:
        ana = state.ana_groups.get(grpid)
        state.ana_groups[grpid] = AnaGroup(grpid, home, ana.owner if ana else None, ana.since if ana else now())
    return store.update(change, f"ana {grpid} home")


def record_owner(store: GroupStore, lease: AnaLease, now: Now = time.time) -> GroupSnapshot:
    """The ANA record names `lease`'s client as the owner (after an acquire or a take-over)."""
    member = lease.member

    def change(state: GroupState) -> None:
        ana = _ana(state.ana_groups, lease.grpid, store.group)
        if ana.owner != member:
            state.ana_groups[lease.grpid] = AnaGroup(lease.grpid, ana.home, member, now())
    return store.update(change, f"ana {lease.grpid} owner")


def fail_over(store: GroupStore, lease: AnaLease, force: bool = False, now: Now = time.time) -> GroupSnapshot:
    """Take the ANA group from its recorded owner: fence it, break its lock, own it, record it."""
    snapshot = store.read()
    previous = _ana(snapshot.ana_groups, lease.grpid, store.group).owner
    member = snapshot.members.get(previous.gateway) if previous is not None else None
    if member is not None and member.instance_id == previous.instance_id:
        previous = member  # its record now: every client it announced since it took the group (fence_addrs)
    lease.take_over(previous, force=force)
    return record_owner(store, lease, now)


def request_failback(store: GroupStore, grpid: int, reason: str = "admin", now: Now = time.time) -> GroupSnapshot:
    """Ask the ANA group's owner to hand it back to its home gateway."""
    def change(state: GroupState) -> None:
        ana = _ana(state.ana_groups, grpid, store.group)
        if ana.owner is not None and ana.owner.gateway == ana.home:
            return  # at home already
        if ana.home not in state.members:
            raise GroupError(f"gateway group {store.group}: ANA group {grpid}'s home {ana.home} is not a member",
                             f"start {ana.home} (target serve --group {store.group}) before failing back to it")
        state.failbacks[grpid] = FailbackRequest(grpid, ana.home, reason, now())
    return store.update(change, f"failback {grpid}")


def failback_due(snapshot: GroupSnapshot, grpid: int, now: float, settle: float) -> bool:
    """The owner should ask for the ANA group's failback itself: the home gateway is a member and joined at
    least `settle` seconds ago (wall clock), the group is away from home, and no request is pending."""
    ana = snapshot.ana_groups.get(grpid)
    if ana is None or ana.owner is None or ana.owner.gateway == ana.home or grpid in snapshot.failbacks:
        return False
    home = snapshot.members.get(ana.home)
    return home is not None and now - home.started >= settle


def hand_back(store: GroupStore, lease: AnaLease, now: Now = time.time) -> GroupSnapshot:
    """The owner's part of a failback: call it once the engine stopped serving the ANA group.  Releases the
    lease and records that nobody owns the group, for its home gateway to take."""
    request = store.read().failbacks.get(lease.grpid)
    if request is None:
        raise GroupError(f"gateway group {store.group}: no failback of ANA group {lease.grpid} was asked",
                         "request_failback first (an admin, or failback_due)")
    lease.release()

    def change(state: GroupState) -> None:
        ana = _ana(state.ana_groups, lease.grpid, store.group)
        if ana.owner is not None and ana.owner.gateway == lease.gateway:
            state.ana_groups[lease.grpid] = AnaGroup(lease.grpid, ana.home, None, now())
    return store.update(change, f"ana {lease.grpid} handed back")


def take_back(store: GroupStore, lease: AnaLease, now: Now = time.time) -> GroupSnapshot:
    """The home gateway's part: acquire the lease the owner released (LeaseBusy while it has not yet), record
    the group as owned by its home, and drop the request."""
    snapshot = store.read()
    request = snapshot.failbacks.get(lease.grpid)
    if request is None or request.to != lease.gateway:
        raise GroupError(f"gateway group {store.group}: no failback of ANA group {lease.grpid} to "
                         f"{lease.gateway} was asked", "request_failback first")
    lease.acquire()
    member = lease.member

    def change(state: GroupState) -> None:
        ana = _ana(state.ana_groups, lease.grpid, store.group)
        state.ana_groups[lease.grpid] = AnaGroup(lease.grpid, ana.home, member, now())
        state.failbacks.pop(lease.grpid, None)
    return store.update(change, f"ana {lease.grpid} back home")
