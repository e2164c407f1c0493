"""The lease of one ANA group on RADOS: a cls_lock exclusive lock with a duration, renewed by its owner, taken
over by a survivor only after fencing the previous owner's client (blocklist first).

`AnaLease(ioctx, group, grpid, gateway, duration, cluster=...)` (blocking calls: off the event loop):

- `acquire()`: take the lease when nobody holds it (LeaseBusy when another client does).
- `renew()`: extend it (cls_lock's MUST_RENEW: fails with LeaseLost when the lock is not ours any more —
  expired, broken — and Fenced when the cluster blocklisted this client; a transient failure raises
  CephCallFailed and the serving deadline stands).
- `release()`: stop serving (RELEASING), unlock, STANDBY.
- `holder()`: who holds the lock and until when (the OSD's clock), or None.
- `take_over(previous, force=False)`: `osd blocklist add` the previous owner's address, wait until this client
  has an OSD map with that entry (`wait_for_latest_osdmap`), break the previous owner's lock, acquire.
- `machine`: the LeaseMachine (lease.py) the calls report to: `may_serve()`, `serving_deadline()`, `state`.

Every lock call is timed from its start (the machine's clock): the serving deadline is the start of the last
successful acquire/renew + duration - margin.  The lock lives on its own object,
`nvmeof_roce.group.<group>.ana.<grpid>` (so lock traffic never changes the group's state object), named "ana",
with the gateway's name as its cookie: the locker is (client.<instance id>, gateway).
"""
from __future__ import annotations

import errno as errno_codes
import json
import logging
import time
from typing import Optional, Protocol

from . import clslock
from .errors import CephCallFailed, Fenced, GroupError, LeaseBusy, LeaseLost, LeaseStillHeld, call_failed, errno_of
from .lease import SERVING, Clock, IllegalLeaseTransition, LeaseMachine, LeaseState, LeaseTiming
from .records import Member, blocklist_address, check_name, lease_object
from .store import rados_module

log = logging.getLogger(__name__)

LOCK_NAME = "ana"


class ClientIdentity(Protocol):
    """A gateway's RADOS client: a `Member` record, a `clslock.Locker`."""
    instance_id: int
    addr: str


class AnaLease:
    def __init__(self, ioctx, group: str, grpid: int, gateway: str, duration: float, *, cluster,
                 margin: Optional[float] = None, renew_interval: Optional[float] = None,
                 clock: Clock = time.monotonic):
        self.ioctx = ioctx
        self.cluster = cluster  # the connected rados.Rados of ioctx: blocklist, OSD map, instance id
        self.group = check_name("group", group)
        self.grpid = int(grpid)
        self.gateway = check_name("gateway", gateway)
        self.object = lease_object(group, grpid)
        self.machine = LeaseMachine(LeaseTiming.of(duration, margin, renew_interval), clock)
        self._member: Optional[Member] = None

    def __repr__(self) -> str:
        return f"<AnaLease {self.group}/{self.grpid} {self.gateway} {self.machine.state.value}>"

    @property
    def what(self) -> str:
        return f"ANA group {self.grpid} of gateway group {self.group}"

    @property
    def member(self) -> Member:
        """This gateway's client, as a member record (what a survivor would blocklist)."""
        if self._member is None:
            self._member = Member.of(self.gateway, self.cluster)
        return self._member

    # -- what the engine asks ----------------------------------------------------------------------------------

    @property
    def state(self) -> LeaseState:
        return self.machine.state

    def may_serve(self) -> bool:
        return self.machine.may_serve()

    def serving_deadline(self) -> Optional[float]:
        return self.machine.serving_deadline()

    # -- the lock --------------------------------------------------------------------------------------------

    def _lock(self, flags: int) -> None:
        description = clslock.description_of(self.gateway, self.group, self.grpid)
        clslock.write_call(self.ioctx, self.object, "lock",
                           clslock.lock_op(LOCK_NAME, self.gateway, description, self.machine.timing.duration,
                                           flags))

    def acquire(self) -> None:
        """Take the lease (STANDBY -> OWNER).  LeaseBusy when another client holds it."""
        state = self.machine.state
        if state not in (LeaseState.STANDBY, *SERVING):
            raise IllegalLeaseTransition(f"{self.what}: acquire while the lease is {state.value}",
                                         "release() first (after LOST: once the engine stopped serving)")
        rados = rados_module()
        started = self.machine.begin()
        try:
            self._lock(0)
        except rados.Error as exc:
            if errno_of(exc) == errno_codes.EEXIST:  # ours already (this client, this cookie): renew it
                started = self.machine.begin()
                try:
                    self._lock(clslock.MUST_RENEW)
                except rados.Error as again:
                    raise self._lock_error("acquire", again)
            else:
                raise self._lock_error("acquire", exc)
        self.machine.acquired(started)

    def renew(self) -> None:
        """Extend the lease from this call's start.  LeaseLost/Fenced: stop serving (the machine is LOST);
        CephCallFailed: try again before the serving deadline."""
        if self.machine.state not in SERVING:
            raise LeaseLost(f"{self.what}: not renewed, the lease is {self.machine.state.value}",
                            "stop serving the ANA group; release() and acquire() again to own it anew")
        rados = rados_module()
        started = self.machine.begin()
        try:
            self._lock(clslock.MUST_RENEW)
        except rados.Error as exc:
            code = errno_of(exc)
            lost = code in (errno_codes.ENOENT, errno_codes.ESHUTDOWN, errno_codes.EBUSY)
            self.machine.renew_failed(lost)
            if code == errno_codes.ENOENT:
                raise LeaseLost(f"{self.what}: the lease is not this gateway's any more (expired, or broken by "
                                "a gateway that took the group over)",
                                "stop serving the ANA group (the engine's ANA state inaccessible)")
            raise self._lock_error("renew", exc)
        if not self.machine.renewed(started):
            raise LeaseLost(f"{self.what}: renewed only after the serving deadline had passed",
                            "stop serving the ANA group; release() and acquire() again (renew more often, or "
                            "lower the client's rados_osd_op_timeout under the renew interval)")

    def release(self) -> None:
        """Stop serving (RELEASING) and unlock; STANDBY.  A lock already gone (expired, broken) is not an error;
        a failed unlock is raised after the machine is in STANDBY (the lock then ends with its duration)."""
        if self.machine.state == LeaseState.STANDBY:
            return
        self.machine.begin_release()
        rados = rados_module()
        try:
            clslock.write_call(self.ioctx, self.object, "unlock", clslock.unlock_op(LOCK_NAME, self.gateway))
        except rados.Error as exc:
            if errno_of(exc) not in (errno_codes.ENOENT, errno_codes.ESHUTDOWN):
                raise call_failed(f"{self.what}: unlock", exc)
        finally:
            self.machine.released()

    def holder(self) -> Optional[clslock.Locker]:
        """The client that holds the lease now and until when (`expires`, the OSD's wall clock), or None
        (never taken, released, or expired: the lock class drops expired lockers when it reads the lock)."""
        rados = rados_module()
        try:
            info = clslock.get_info(self.ioctx, self.object, LOCK_NAME)
        except rados.Error as exc:
            raise call_failed(f"{self.what}: reading the lock", exc)
        except ValueError as exc:
            raise GroupError(f"{self.what}: the lock class's answer does not decode: {exc}",
                             "report it with the Ceph version: clslock.py knows Ceph 16.2's encoding")
        return info.lockers[0] if info and info.lockers else None

    def take_over(self, previous: Optional[ClientIdentity], force: bool = False) -> None:
        """Own the ANA group after its owner `previous` (a Member record, or None: whoever holds the lock):
        blocklist its client's address first, then break its lock and acquire.  Refused (LeaseStillHeld) while
        `previous`'s lease runs unless `force`; LeaseBusy when another client than `previous` holds it."""
        rados = rados_module()
        self.machine.begin_take_over()
        try:
            me = self.member
            holder = self.holder()
            if previous is None:
                previous = holder
            if previous is not None and previous.instance_id == me.instance_id:
                raise GroupError(f"{self.what}: a take-over from this gateway's own client",
                                 "take over from the previous owner's member record, never from one's own")
            if holder is not None:
                if holder.instance_id != previous.instance_id:
                    raise LeaseBusy(f"{self.what}: held by {holder.cookie} ({holder.client}, {holder.addr}), "
                                    "not by the previous owner", "another gateway took it over: follow it")
                if not force:
                    raise LeaseStillHeld(f"{self.what}: {holder.cookie}'s lease runs until {holder.expires:.3f} "
                                         "(the OSD's clock)", "wait for it to expire (it may still serve), or "
                                         "force the take-over (it is fenced first)")
            if previous is not None:
                for addr in [previous.addr] + list(getattr(previous, "fence_addrs", [])):
                    self._fence(addr)  # every client it served through: the native path's too
            if holder is not None:
                self._break(holder)
            started = self.machine.begin()
            try:
                self._lock(0)
            except rados.Error as exc:
                raise self._lock_error("take over", exc)
            self.machine.acquired(started)
        except BaseException:
            self.machine.take_over_failed()
            raise
        log.warning("%s: taken over by %s from %s", self.what, self.gateway,
                    getattr(previous, "addr", None) or "nobody")

    # -- fencing -----------------------------------------------------------------------------------------------

    def _fence(self, addr: str) -> None:
        """`osd blocklist add ADDR`, then this client's OSD map at least as new as the entry: an OSD sees the
        map epoch our next op carries and refuses the fenced client's ops from then on."""
        target = blocklist_address(addr)
        command = json.dumps({"prefix": "osd blocklist", "blocklistop": "add", "addr": target})
        rados = rados_module()
        try:
            ret, _out, status = self.cluster.mon_command(command, b"")
        except rados.Error as exc:
            raise call_failed(f"{self.what}: osd blocklist add {target}", exc)
        if ret != 0:
            raise CephCallFailed(f"{self.what}: osd blocklist add {target} failed ({ret}): {status}",
                                 "give the gateway's client the mon cap 'profile rbd' (it allows the blocklist)",
                                 abs(ret))
        try:
            ret = self.cluster.wait_for_latest_osdmap()
        except rados.Error as exc:
            raise call_failed(f"{self.what}: waiting for the OSD map with {target} blocklisted", exc)
        if ret is not None and ret < 0:
            raise CephCallFailed(f"{self.what}: waiting for the OSD map with {target} blocklisted ({ret})",
                                 "check the cluster (ceph -s)", abs(ret))
        log.warning("%s: blocklisted %s", self.what, target)

    def _break(self, holder: clslock.Locker) -> None:
        rados = rados_module()
        try:
            clslock.write_call(self.ioctx, self.object, "break_lock",
                               clslock.break_op(LOCK_NAME, holder.instance_id, holder.cookie))
        except rados.Error as exc:
            if errno_of(exc) != errno_codes.ENOENT:  # expired meanwhile: nothing to break
                raise call_failed(f"{self.what}: breaking {holder.client}'s lock", exc)

    def _lock_error(self, what: str, exc: BaseException) -> GroupError:
        if errno_of(exc) == errno_codes.EBUSY:
            holder = None
            try:
                holder = self.holder()
            except GroupError:
                pass
            who = f"{holder.cookie} ({holder.client}, {holder.addr}) until {holder.expires:.3f}" if holder else \
                "another client"
            return LeaseBusy(f"{self.what}: {what}: the lease is held by {who}",
                             "wait for the owner to release it, or for it to expire and take it over")
        if errno_of(exc) == errno_codes.ESHUTDOWN:
            return Fenced(f"{self.what}: {what}: this gateway's RADOS client is blocklisted (ESHUTDOWN)",
                          "stop serving; restart the gateway with a new RADOS client")
        return call_failed(f"{self.what}: {what}", exc)
