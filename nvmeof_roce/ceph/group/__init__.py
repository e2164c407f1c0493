"""The Ceph side of a gateway group: several `target serve` machines over one Ceph cluster (docs/gateway-group.md).

The group's state (config sections, members, ANA groups' homes and owners, failback requests, reservations)
lives in one RADOS object's omap; each ANA group's ownership is a cls_lock lease on an object of its own.  No
consensus or lease protocol of ours: omap_cmp for atomic changes, watch/notify for news, cls_lock for leases,
the OSD blocklist for fencing.  Every call here blocks on the cluster: run it off the target's event loop.

The API (everything else in the package is internal):

    store = GroupStore(ioctx, group)                       # store.py
        store.read() -> GroupSnapshot                      # epoch, config, members, ana_groups, failbacks, reservations
        store.update(change: Callable[[GroupState], None]) -> GroupSnapshot   # atomic, retried; notifies
        store.watch(callback: Callable[[GroupSnapshot], None], poll_interval=5.0) -> GroupWatch  # .close()
        store.join(gateway, cluster, ports) / store.leave(gateway) -> GroupSnapshot

    lease = AnaLease(ioctx, group, grpid, gateway, duration, cluster=rados_client,
                     margin=None, renew_interval=None, clock=time.monotonic)   # ana.py
        lease.acquire() / lease.renew() / lease.release() -> None
        lease.holder() -> Optional[Locker]                 # .cookie (gateway), .client, .addr, .expires
        lease.take_over(previous_member, force=False)      # blocklist first, then break and acquire
        lease.may_serve() -> bool; lease.serving_deadline() -> Optional[float]; lease.state -> LeaseState
        lease.machine: LeaseMachine                        # lease.py: the pure, clock-injectable state machine

    resv = ReservationStore(ioctx, group)                  # reservations.py
        resv.read(nqn, nsid) -> Reservation; resv.update(nqn, nsid, change) -> Reservation; resv.remove(nqn, nsid)

    handover.py: set_home, record_owner, fail_over, request_failback, failback_due, hand_back, take_back

Errors are GroupError subclasses (errors.py): GroupConflict, LeaseBusy, LeaseStillHeld, LeaseLost, Fenced,
CephCallFailed; each has a message and a fix.
"""
from .ana import AnaLease
from .clslock import Locker
from .errors import CephCallFailed, Fenced, GroupConflict, GroupError, LeaseBusy, LeaseLost, LeaseStillHeld
from .handover import fail_over, failback_due, hand_back, record_owner, request_failback, set_home, take_back
from .lease import IllegalLeaseTransition, LeaseMachine, LeaseState, LeaseTiming
from .records import AnaGroup, FailbackRequest, Member, Reservation
from .reservations import ReservationStore
from .store import GroupSnapshot, GroupState, GroupStore, GroupWatch

__all__ = [
    "AnaGroup", "AnaLease", "CephCallFailed", "FailbackRequest", "Fenced", "GroupConflict", "GroupError",
    "GroupSnapshot", "GroupState", "GroupStore", "GroupWatch", "IllegalLeaseTransition", "LeaseBusy",
    "LeaseLost", "LeaseMachine", "LeaseState", "LeaseStillHeld", "LeaseTiming", "Locker", "Member",
    "Reservation", "ReservationStore", "fail_over", "failback_due", "hand_back", "record_owner",
    "request_failback", "set_home", "take_back",
]
