"""A gateway of a gateway group (docs/gateway-group.md): this `target serve`'s part in several gateways over one
Ceph cluster.

The group's subsystems, namespaces and hosts live in RADOS (ceph/group: one object with omap); this gateway's
own config file gives its ports and its `nvmeof_roce.group` settings.  What the target serves is the two merged
(`merged_config`): every port exports every subsystem of the group, and lists every ANA group of it, optimized
where this gateway owns the group's lease and inaccessible elsewhere.

Three parts, each on its own side of the event loop:

- the **keeper** thread does every RADOS call (they block, up to the client's op timeout): it renews the leases
  this gateway owns, takes over a group whose owner's lease ended (blocklisting the owner's clients first), takes
  its home groups back on failback, hands a group back when asked, and publishes this gateway's clients;
- the **loop side** (`tick`, and what the keeper posts through the target's Work channel) changes the ANA
  states: a group is served only while its lease machine says `may_serve()`, checked at every tick, so a gateway
  that cannot renew stops serving before its lease ends whatever its keeper is blocked on;
- **changes**: a watch on the group's object brings other gateways' changes; a change by RPC here runs under the
  group's config lock (`run_change`), on the state as the group has it, and is published before it is answered.

A gateway whose RADOS client was blocklisted (fenced by a survivor) stops serving every group and exits with
EXIT_FENCED: its clients are of no use any more, and a restart joins with new ones (systemd's Restart=).
"""
from __future__ import annotations

import copy
import dataclasses
import errno
import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ..ceph.group.errors import errno_of
from ..config.group import GroupSettings
from ..config.model import reserving_namespaces
from ..engine.shared_resv import StoreError
from ..errors import NvmeofError

log = logging.getLogger(__name__)

SHARED_SECTIONS = ("subsystems", "hosts")  # what the group keeps; ports and nvmeof_roce are the gateway's own
GATEWAY_ATTRS = ("cntlid_min", "cntlid_max")  # subsystem attributes each gateway sets for itself
CNTLID_SPAN = 511  # controller IDs per gateway: 128 ANA groups' ranges fit under the largest cntlid (0xffef)
CONNECT_TIMEOUT = 30  # seconds for the group's RADOS client to connect at start
CONFIG_LOCK = "config"  # the cls_lock name a change by RPC holds on the group's object
CONFIG_LOCK_SECONDS = 30  # its duration: a gateway that dies holding it blocks changes that long at most
EXIT_FENCED = 75  # EX_TEMPFAIL: this gateway was blocklisted; restart it to join again
# The RPCs that change the group's shared sections: run under the config lock and published.  The others
# (ports, listeners, ANA states by hand, status) are this gateway's own.
SHARED_CHANGES = frozenset({
    "nvmf_create_subsystem", "nvmf_delete_subsystem", "nvmf_subsystem_allow_any_host",
    "nvmeof_subsystem_set_qid_max", "nvmf_subsystem_add_ns", "nvmf_subsystem_remove_ns", "nvmf_subsystem_resize_ns",
    "nvmf_ns_add_host", "nvmf_ns_remove_host", "bdev_set_qos_limit", "nvmf_subsystem_add_host",
    "nvmf_subsystem_remove_host", "nvmf_subsystem_set_keys", "nvmeof_set_host_keys", "nvmeof_ns_set_reservation"})


EXPIRY_RECHECK = 0.25  # seconds: the keeper's pass after another gateway's lease expiry, and again while it holds


class GroupMemberError(NvmeofError):
    pass


def words(exc: BaseException) -> str:
    """What went wrong, in a log line: an NvmeofError's message, else the exception itself."""
    return exc.message if isinstance(exc, NvmeofError) else str(exc)


def _group():
    from ..ceph import group  # python3-rados is loaded only by a gateway of a group
    return group


def ana_grpids(data: dict, snapshot, home: List[int]) -> List[int]:
    """Every ANA group of the group: those with a home, those its namespaces use, this gateway's homes."""
    used = {int(ns.get("ana_grpid", 1)) for sub in data.get("subsystems", []) for ns in sub.get("namespaces", [])}
    return sorted(set(snapshot.ana_groups) | used | set(home))


def cntlid_range(home: List[int]) -> Tuple[int, int]:
    """This gateway's controller IDs: a host connected to two gateways of one subsystem must see two cntlids (the
    Linux host refuses a duplicate one in a subsystem), so each gateway takes the range of its first home ANA
    group (as ceph-nvmeof gives each gateway its own range)."""
    low = (min(home) - 1) * CNTLID_SPAN + 1
    return low, low + CNTLID_SPAN - 1


def shared_sections(running: dict) -> dict:
    """The group's part of a running config, without what each gateway sets for itself (its cntlid range)."""
    sections = {k: copy.deepcopy(running[k]) for k in SHARED_SECTIONS if k in running}
    for sub in sections.get("subsystems", []):
        attrs = sub.get("attr") or {}
        for key in GATEWAY_ATTRS:
            attrs.pop(key, None)
    return sections


def stale_reservations(before, state) -> Set[Tuple[str, int]]:
    """The reservation records a change by RPC removes with its config (`before`: the group's state when the
    change began, under the config lock; `state`: the update's, the change's config in it): the record of each
    namespace the new config does not have, or has with reservations off (removed: a namespace added later with
    its NSID, or reservations on again, must not inherit its registrants), and the record of each namespace the
    change adds (or turns reservations on for) that was there, unchanged, before it (left by a registration that
    met the removal on another gateway).  A record written since the change began (a host registering with the
    new namespace already) is kept."""
    now, earlier = reserving_namespaces(state.config), reserving_namespaces(before.config)
    return {key for key, raw in state.reservation_values.items()
            if key not in now or (key not in earlier and before.reservation_values.get(key) == raw)}


def merged_config(local: dict, snapshot, serving: Set[int], home: List[int]) -> dict:
    """This gateway's config (ports, settings) with the group's sections; each port exports every subsystem and
    gives each ANA group the state this gateway has for it (optimized where it owns the lease); each subsystem
    gives controller IDs from this gateway's range."""
    data = copy.deepcopy(local)
    for section in SHARED_SECTIONS:
        if section in snapshot.config:
            data[section] = copy.deepcopy(snapshot.config[section])
    low, high = cntlid_range(home)
    for sub in data.get("subsystems", []):
        sub.setdefault("attr", {}).update({"cntlid_min": str(low), "cntlid_max": str(high)})
    nqns = [s["nqn"] for s in data.get("subsystems", [])]
    states = [{"grpid": g, "ana": {"state": "optimized" if g in serving else "inaccessible"}}
              for g in ana_grpids(data, snapshot, home)]
    for port in data.get("ports", []):
        port["subsystems"] = list(nqns)
        port["ana_groups"] = copy.deepcopy(states)
    return data


class SharedReservationStore:
    """The engine's SharedReservations (engine/shared_resv.py) over the group's ReservationStore (ceph/group):
    the engine's records to and from RADOS's, the group's errors as the engine's StoreError.  `timeout`: how long
    the engine lets a call run (`reservation_timeout`)."""

    def __init__(self, store, timeout: float):
        self.store, self.timeout = store, timeout

    @staticmethod
    def record(resv) -> Optional[dict]:
        """A ceph.group Reservation as the engine's record (None: none yet)."""
        if resv.rev == 0 and resv.is_empty():
            return None
        return {"registrants": [[h, k] for h, k in resv.registrants.items()], "holder": resv.holder,
                "rtype": resv.rtype, "generation": resv.generation, "version": resv.rev, "changes": resv.changes}

    def read(self, nqn: str, nsid: int) -> Optional[dict]:
        return self._call(lambda: self.record(self.store.read(nqn, nsid)))

    def update(self, nqn: str, nsid: int, change) -> Optional[dict]:
        def edit(resv) -> None:  # the ReservationStore's copy, edited in place (maybe several times)
            after = change(self.record(resv))
            if after is not None:
                resv.registrants = {h: int(k) for h, k in after["registrants"]}
                resv.holder, resv.rtype, resv.generation = after["holder"], after["rtype"], after["generation"]
                resv.changes = list(after.get("changes") or [])
        return self._call(lambda: self.record(self.store.update(nqn, nsid, edit)))

    @staticmethod
    def _call(fn):
        g = _group()
        try:
            return fn()
        except g.GroupError as exc:
            raise StoreError(words(exc), fenced=isinstance(exc, g.Fenced)) from None


def osd_op_timeout(settings: GroupSettings) -> int:
    """The group's RADOS client's OSD op timeout: a lease's renew never outlasts a renew interval."""
    return max(1, settings.lease // 3)


def reservation_timeout(settings: GroupSettings) -> float:
    """How long a reservation command waits for the group's store before it is answered Namespace Not Ready
    (engine/shared_resv.py): a round of the store's update (a read and a write, each within the OSD op timeout,
    then a notify of at most a second) fits, so the store's own error (a timeout) usually answers first."""
    return 3.0 * osd_op_timeout(settings) + 1.0


class RpcChange:
    """One change by RPC on a gateway of a group (`GroupMember.run_change`), in four steps, each on its side of
    the event loop:

    1. `_lock` (a thread): this gateway's turn (one change at a time), the group's config lock, the group's state;
    2. `_make` (the loop): catch up with that state, then the change itself (`call()`);
    3. `_publish` (the loop, once the call's answer is there): the shared sections as the change left them;
    4. `_write` (a thread): the group's update (the sections, and the records of the namespaces it removed), then
       the answer on the loop; the config lock released whatever happened.

    An error before the change is made answers the RPC with it; one after (the update failed) says the change is
    made here but not published."""

    def __init__(self, member: "GroupMember", call: Callable[[], Any], answer):
        self.member, self.call, self.answer = member, call, answer
        self.before = None  # the group's state under the lock, before the change

    def start(self) -> None:
        threading.Thread(target=self._lock, name="group change", daemon=True).start()

    def _fail(self, message: str, fix: str) -> None:
        from ..control.protocol import RpcError
        self.member._post(lambda: self.answer.fail(RpcError(message, "group", fix)))

    def _lock(self) -> None:
        m = self.member
        m._changes.acquire()
        try:
            m._lock_config()
            self.before = m.store.read()
        except Exception as exc:
            m._changes.release()
            self._fail(f"gateway group {m.settings.name}: the change is not made: {words(exc)}",
                       "check the cluster (ceph -s) and try again")
            return
        m._post(self._make)

    def _make(self) -> None:
        from ..control.protocol import RpcError
        from ..control.server import DeferredAnswer
        m = self.member
        try:
            if self.before.epoch > m.applied_epoch:
                m._apply(self.before)  # catch up first: the change is made on the group's state
            result = self.call()
        except Exception as exc:
            threading.Thread(target=m._unlock_config, daemon=True).start()
            self.answer.fail(exc if isinstance(exc, RpcError) else RpcError(str(exc), "group", "see the log"))
            return
        if isinstance(result, DeferredAnswer):
            result.when_done(self._publish)
        else:
            self._publish({"result": result})

    def _publish(self, part: dict) -> None:
        sections = shared_sections(self.member.target.config.to_dict())
        threading.Thread(target=self._write, args=(part, sections), name="group publish", daemon=True).start()

    def _write(self, part: dict, sections: dict) -> None:
        m = self.member
        try:
            if "error" not in part:
                def put(state):
                    state.config.update(copy.deepcopy(sections))
                    state.dropped_reservations.update(stale_reservations(self.before, state))
                snap = m.store.update(put, "rpc")
                m.applied_epoch = max(m.applied_epoch, snap.epoch)
            m._post(lambda: self.answer._finish(part))
        except Exception as exc:
            log.error("gateway group %s: a change made here was not published: %s", m.settings.name, words(exc))
            self._fail(f"the change is made on {m.settings.gateway} but not published to the group: {words(exc)}",
                       "check the cluster (ceph -s), then make it again")
        finally:
            m._unlock_config()


class GroupMember:
    """This gateway in its group: connect and join (blocking, before serving), then `attach` to the running
    server; `close` leaves (the leases are released, the member record stays for the status)."""

    def __init__(self, settings: GroupSettings, local: dict, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time):
        self.settings = settings
        self.local = copy.deepcopy(local)  # the gateway's own file: ports, settings (shared sections ignored)
        self.clock, self.wall = clock, wall
        self.home = list(settings.ana_groups)
        self.client = None  # ceph.clients.ClusterClient (shared with the rbd namespaces of the same cluster)
        self.ioctx = None
        self.store = None
        self.leases: Dict[int, Any] = {}  # grpid -> ceph.group.AnaLease, made as groups are seen
        self.serving: Set[int] = set()  # ANA groups optimized here now (loop side)
        self.applied_epoch = 0  # the group's epoch the running config is at
        self.snapshot = None  # the last state the keeper read
        self.server = None
        self.control = None
        self.target = None
        self.fenced = False
        self.instance_id = 0
        self.started = wall()
        self.history: List[dict] = []  # take-overs, hand-backs, losses: for status (the last few)
        self.event_counts: Dict[str, int] = {}  # ... counted since start (metrics)
        self._handing_back: Set[int] = set()
        # other gateways' leases as the keeper last read them: grpid -> (ceph.group.Locker or None, wall time)
        self.holders: Dict[int, Tuple[Any, float]] = {}
        self._expiries: List[float] = []  # another gateway's leases' expiries the keeper's last pass read
        self.read_at: Optional[float] = None  # wall time of the keeper's last pass that read the group's state
        self.read_error: Optional[str] = None  # what the last pass that failed said (None: the last one worked)
        self._stop = threading.Event()
        self._keeper: Optional[threading.Thread] = None
        self._watch = None
        self._changes = threading.Lock()  # one change by RPC at a time on this gateway

    # ---------------------------------------------------------------------------------------- start (blocking)
    def connect(self) -> None:
        from ..ceph import clients
        s = self.settings
        # A renew (an OSD op) never outlasts a renew interval; the monitor's commands (a blocklist entry waits
        # for a new OSD map, about a second each) are a take-over's, which may take longer.
        conf = {"rados_osd_op_timeout": str(osd_op_timeout(s)), "rados_mon_op_timeout": str(s.lease),
                "client_mount_timeout": str(CONNECT_TIMEOUT)}
        try:
            self.client = clients.acquire((s.conf, s.client_id, s.keyring), conf, CONNECT_TIMEOUT)
            self.ioctx = self.client.rados.open_ioctx(s.pool)
        except Exception as exc:
            raise GroupMemberError(f"gateway group {s.name}: cannot reach the Ceph cluster of {s.conf} as "
                                   f"client.{s.client_id} (pool {s.pool}): {exc}",
                                   "check the cluster (ceph -s), the pool (ceph osd pool ls) and the key") from None
        if s.namespace:
            self.ioctx.set_namespace(s.namespace)
        g = _group()
        self.store = g.GroupStore(self.ioctx, s.name)
        self.instance_id = int(self.client.rados.get_instance_id())  # this process's client: its leases' holder

    def lease(self, grpid: int):
        if grpid not in self.leases:
            g = _group()
            self.leases[grpid] = g.AnaLease(self.ioctx, self.settings.name, grpid, self.settings.gateway,
                                            self.settings.lease, cluster=self.client.rados, clock=self.clock)
        return self.leases[grpid]

    def join(self) -> dict:
        """Take the group's state (seeding it from this file when the group is new), become a member, take the
        home ANA groups that are free; the config to serve."""
        g = _group()
        s = self.settings
        self.store.ensure()
        snapshot = self.store.read()
        seed = {k: self.local[k] for k in SHARED_SECTIONS if self.local.get(k)}
        if seed and not snapshot.config:
            def put(state):
                if not state.config:  # another gateway may have seeded it meanwhile
                    state.config.update(copy.deepcopy(seed))
            self.store.update(put, "seed")
            log.info("gateway group %s: seeded with %s's subsystems and hosts", s.name, s.gateway)
        elif seed and any(self.local.get(k) != snapshot.config.get(k) for k in seed):
            log.warning("gateway group %s: the group's subsystems and hosts are served, not this file's (they "
                        "differ; change them by RPC on any gateway)", s.name)
        for grpid in self.home:
            ana = self.store.read().ana_groups.get(grpid)
            if ana is None or ana.home != s.gateway:
                g.set_home(self.store, grpid, s.gateway, now=self.wall)
        self.store.join(s.gateway, self.client.rados, self._port_records(), now=lambda: self.started)
        for grpid in self.home:
            snapshot = self.store.read()
            ana = snapshot.ana_groups.get(grpid)
            if ana is not None and ana.owner is not None and ana.owner.gateway != s.gateway:
                log.info("gateway group %s: ANA group %d is served by %s: this gateway waits for failback",
                         s.name, grpid, ana.owner.gateway)
                continue
            self._acquire(grpid)
        self.snapshot = self.store.read()
        self.applied_epoch = self.snapshot.epoch
        from ..ceph import clients
        clients.announce_hooks.append(self._announce)  # the rbd namespaces' clients, before they serve
        return merged_config(self.local, self.snapshot, self._owned(), self.home)

    def _announce(self, addrs: str) -> None:
        """Another RADOS client of this gateway (an rbd namespace's on the native data path, or one of another
        cluster key): in its member record before it serves, so a survivor's take-over fences it too.
        Blocking (a RADOS update): called on the thread that opened the client."""
        from ..ceph.group.records import blocklist_address
        addr = blocklist_address(addrs)
        if not addr:
            raise GroupMemberError("a RADOS client with no address", "check librados (rados_getaddrs)")
        gateway = self.settings.gateway

        def add(state) -> None:
            member = state.members.get(gateway)
            if member is not None and addr != member.addr and addr not in member.fence_addrs:
                state.members[gateway] = dataclasses.replace(member, fence_addrs=member.fence_addrs + [addr])
        self.store.update(add, f"member {gateway} client")
        log.info("gateway group %s: client %s announced (fenced with this gateway)", self.settings.name, addr)

    def _acquire(self, grpid: int) -> bool:
        """Take a free lease (a home group at start, or one this gateway's lapsed lease left free)."""
        g = _group()
        lease = self.lease(grpid)
        try:
            lease.acquire()
        except g.LeaseBusy as exc:
            log.info("gateway group %s: ANA group %d: %s", self.settings.name, grpid, exc.message)
            return False
        self.snapshot = g.record_owner(self.store, lease, now=self.wall)
        self._note("acquired", grpid)
        return True

    def _owned(self) -> Set[int]:
        return {grpid for grpid, lease in self.leases.items() if lease.may_serve()}

    def _port_records(self) -> List[dict]:
        return [{"portid": p.get("portid"), "traddr": (p.get("addr") or {}).get("traddr"),
                 "trsvcid": (p.get("addr") or {}).get("trsvcid")} for p in self.local.get("ports", [])]

    # ---------------------------------------------------------------------------------------- running
    def attach(self, server, control) -> None:
        """Serve: the ANA states follow the leases from now on, the keeper and the watch run."""
        self.server, self.control, self.target = server, control, server.target
        self.serving = {g for g in self._owned()}
        self.target.tick_hooks.append(self.tick)
        self._watch = self.store.watch(lambda snapshot: self._post(lambda: self._changed(snapshot)))
        # The reservations are the group's: kept in RADOS, the state the watch read first is this gateway's now
        store = SharedReservationStore(_group().ReservationStore(self.ioctx, self.settings.name),
                                       reservation_timeout(self.settings))
        self.target.attach_shared_reservations(store, self._reservations(self._watch.last))
        self._keeper = threading.Thread(target=self._keep, name=f"group {self.settings.name}", daemon=True)
        self._keeper.start()
        log.info("gateway group %s: gateway %s serving ANA group(s) %s; home of %s; lease %d s",
                 self.settings.name, self.settings.gateway, ",".join(map(str, sorted(self.serving))) or "none",
                 ",".join(map(str, self.home)), self.settings.lease)

    def _post(self, fn: Callable[[], None]) -> None:
        if self.target is not None:
            self.target.work.post(fn)

    def tick(self, _now: float) -> None:
        """On the loop: a group whose lease may not serve any more (deadline passed, lost) is inaccessible now."""
        for grpid in list(self.serving):
            if not self.lease(grpid).may_serve():
                self._stop_serving(grpid, f"its lease is {self.lease(grpid).state.value}")

    def _ports(self) -> List[int]:
        return self.target.ana.portids()

    def _serve(self, grpid: int) -> None:
        if grpid in self.serving or not self.lease(grpid).may_serve():
            return
        self.serving.add(grpid)
        for portid in self._ports():
            self._set_state(portid, grpid, "optimized")
        log.warning("gateway group %s: ANA group %d is optimized on %s", self.settings.name, grpid,
                    self.settings.gateway)

    def _set_state(self, portid: int, grpid: int, state: str) -> None:
        if grpid not in self.target.ana.groups:
            return  # no namespace and no port knows it yet: the next config apply lists it
        self.target.set_ana_state(portid, grpid, state)

    def _stop_serving(self, grpid: int, reason: str, then: Optional[Callable[[], None]] = None) -> None:
        """Inaccessible on every port at once (new commands get the ANA status), then fence the group's
        namespaces: `then()` once no command from before can touch them."""
        self.serving.discard(grpid)
        stopped = self.clock()
        for portid in self._ports():
            self._set_state(portid, grpid, "inaccessible")
        log.warning("gateway group %s: ANA group %d is inaccessible on %s: %s", self.settings.name, grpid,
                    self.settings.gateway, reason)
        self._note("stopped", grpid, reason=reason)
        namespaces = [(sub.nqn, ns) for sub in self.target.subsystems.values() for ns in sub.namespaces.values()
                      if ns.config.ana_grpid == grpid]

        def drained(error: Optional[Exception]) -> None:
            if error is not None:
                log.error("gateway group %s: ANA group %d: commands from before it stopped did not drain: %s",
                          self.settings.name, grpid, error)
            else:
                log.info("gateway group %s: ANA group %d drained %.3f s after it stopped", self.settings.name,
                         grpid, self.clock() - stopped)
            if then is not None:
                then()
        self.target.fence(namespaces, drained, f"ANA group {grpid} stopped on this gateway")

    def _note(self, what: str, grpid: int, **more) -> None:
        self.history = (self.history + [{"event": what, "ana_group": grpid, "at": self.wall(), **more}])[-20:]
        self.event_counts[what] = self.event_counts.get(what, 0) + 1

    # ---------------------------------------------------------------------------------------- the keeper
    def _keep(self) -> None:
        while not self._stop.wait(self._next_pass()):
            try:
                self._keep_once()
                self.read_error = None
            except Exception as exc:
                g = _group()
                if isinstance(exc, g.Fenced) or errno_of(exc) == errno.ESHUTDOWN:
                    self._post(self._fenced)
                    return
                self.read_error = words(exc)
                log.warning("gateway group %s: %s", self.settings.name, words(exc))

    def _keep_once(self) -> None:
        g = _group()
        s = self.settings
        for grpid, lease in list(self.leases.items()):  # 1. renew what this gateway serves
            next_at = lease.machine.next_renew_at()
            if next_at is not None and self.clock() >= next_at:
                try:
                    lease.renew()
                except g.Fenced:
                    raise
                except g.LeaseLost as exc:
                    log.error("gateway group %s: ANA group %d: %s", s.name, grpid, exc.message)
                    self._post(lambda grpid=grpid: self._lost(grpid))
                except g.GroupError as exc:  # a timeout: the deadline stands, the loop stops serving at it
                    log.warning("gateway group %s: ANA group %d: renew: %s", s.name, grpid, exc.message)
        snapshot = self.snapshot = self._state()
        self._expiries = []
        for grpid, ana in sorted(snapshot.ana_groups.items()):
            lease = self.lease(grpid)
            request = snapshot.failbacks.get(grpid)
            if lease.may_serve():  # 2. this gateway's: hand it back when asked, or ask for it to go home
                if request is not None and request.to != s.gateway and grpid not in self._handing_back:
                    self._handing_back.add(grpid)
                    self._post(lambda grpid=grpid: self._hand_back(grpid))
                elif (s.failback != "manual" and ana.home != s.gateway
                      and g.failback_due(snapshot, grpid, self.wall(), float(s.failback))):
                    g.request_failback(self.store, grpid, "settle", now=self.wall)
                continue
            if grpid in self._handing_back:
                continue
            mine = ana.owner is not None and ana.owner.instance_id == self.instance_id
            if mine and lease.state == g.LeaseState.LOST and lease.holder() is None:
                # this gateway's lease lapsed (the cluster slow past the deadline) and nobody took the group:
                # it stopped serving at the deadline; owning it anew is a new lease, served from its start
                lease.release()
                if self._acquire(grpid):
                    self._post(lambda grpid=grpid: self._serve(grpid))
            elif ana.home == s.gateway and request is not None and request.to == s.gateway and ana.owner is None:
                self._take(grpid, lambda: g.take_back(self.store, lease, now=self.wall), "took back")
            elif ana.home == s.gateway and ana.owner is None and request is None:
                if self._acquire(grpid):
                    self._post(lambda grpid=grpid: self._serve(grpid))
            elif ana.owner is not None and not mine and request is None:
                # 3. its owner's lease ended (another gateway's, or this gateway's before a restart): fence the
                # owner's clients, then take the group
                holder = lease.holder()
                self.holders[grpid] = (holder, self.wall())
                if holder is not None:
                    self._expiries.append(holder.expires)
                if holder is None:
                    self._take(grpid, lambda: g.fail_over(self.store, lease, now=self.wall), "took over",
                               previous=ana.owner.gateway)

    def _state(self):
        """The group's state for a keeper pass: the watch's latest read when it is recent enough (the watch reads
        at every notify and at least every poll interval: a healthy one's snapshot is never older than that), or
        this gateway's own later one (an update it made), else a read of its own.  Safe with a snapshot some
        seconds old: the lease's serving deadline does not depend on it (renewals follow the lease machine, the
        loop stops serving at the deadline), and every step the keeper takes from it is decided again on the
        cluster (a lock call that fails when another client holds the lease, fail_over's read and holder
        check, an update's compare-and-swap): an old snapshot delays a reaction, it does not make a wrong one."""
        watch = self._watch
        if watch is not None:
            snapshot = watch.fresh(watch.poll_interval + self._interval())
            if snapshot is not None:
                self.read_at = self.wall() - (time.monotonic() - watch.read_at)
                own = self.snapshot
                return own if own is not None and own.epoch > snapshot.epoch else snapshot
        snapshot = self.store.read()
        self.read_at = self.wall()
        return snapshot

    def _interval(self) -> float:
        return max(0.2, self.settings.lease / 6)

    def _next_pass(self) -> float:
        """Seconds to the keeper's next pass: lease/6, or sooner, just after the earliest expiry of another
        gateway's lease it read (a dead owner's group is taken that much sooner: up to lease/6 of a failover's
        gap).  The expiry is the OSD's wall clock: a clock of ours behind it makes the pass early and the lock still
        held, and the passes then come every EXPIRY_RECHECK seconds until it is not."""
        interval = self._interval()
        if not self._expiries:
            return interval
        return min(interval, max(EXPIRY_RECHECK, min(self._expiries) - self.wall() + EXPIRY_RECHECK))

    def _take(self, grpid: int, take: Callable[[], Any], what: str, previous: str = "") -> None:
        g = _group()
        started = self.clock()
        try:
            self.snapshot = take()  # the state with this gateway as the owner
        except g.LeaseBusy:
            return  # another gateway was first
        took = self.clock() - started
        log.warning("gateway group %s: ANA group %d %s%s by %s in %.3f s", self.settings.name, grpid, what,
                    f" from {previous} (blocklisted first)" if previous else "", self.settings.gateway, took)
        self._note(what.replace(" ", "_"), grpid, previous=previous, seconds=round(took, 3))
        self._post(lambda: self._serve(grpid))

    def _lost(self, grpid: int) -> None:
        if grpid in self.serving:
            self._stop_serving(grpid, "the lease is not this gateway's any more")

    def _hand_back(self, grpid: int) -> None:
        """On the loop: stop serving the group, and once its commands drained release it (keeper side)."""
        g = _group()

        def release() -> None:
            def run():
                try:
                    g.hand_back(self.store, self.lease(grpid), now=self.wall)
                    self._note("handed_back", grpid)
                    log.warning("gateway group %s: ANA group %d handed back to its home", self.settings.name,
                                grpid)
                except Exception as exc:
                    log.error("gateway group %s: ANA group %d: hand back: %s", self.settings.name, grpid,
                              words(exc))
                finally:
                    self._handing_back.discard(grpid)
            threading.Thread(target=run, name=f"hand back {grpid}", daemon=True).start()
        self._stop_serving(grpid, "failback to its home gateway", then=release)

    def _fenced(self) -> None:
        """On the loop: this gateway's client was blocklisted: serve nothing, and stop (a restart joins anew)."""
        self.fenced = True
        for grpid in list(self.serving):
            self._stop_serving(grpid, "this gateway was fenced (blocklisted) by the group")
        log.error("gateway group %s: gateway %s was fenced (its RADOS client is blocklisted): stopping; restart it "
                  "to join the group again", self.settings.name, self.settings.gateway)
        if self.server is not None:
            self.server.exit_code = EXIT_FENCED
            self.server.request_stop()

    # ---------------------------------------------------------------------------------------- changes
    def _changed(self, snapshot) -> None:
        """On the loop: what the watch read: the group's config, then its reservations (a namespace the config
        brings gets its record at once)."""
        self._apply_snapshot(snapshot)
        if self.target is not None:
            self.target.shared_reservations_changed(self._reservations(snapshot))

    @staticmethod
    def _reservations(snapshot) -> Dict[Any, Optional[dict]]:
        return {key: SharedReservationStore.record(resv) for key, resv in snapshot.reservations.items()}

    def _apply_snapshot(self, snapshot) -> None:
        """On the loop: another gateway's change (or ours coming back): the running config follows the group's."""
        if snapshot.epoch <= self.applied_epoch or self.control is None:
            return
        self.snapshot = snapshot
        self._apply(snapshot)

    def _apply(self, snapshot) -> None:
        running = shared_sections(self.target.config.to_dict())
        if all(running.get(k) == snapshot.config.get(k, running.get(k)) for k in SHARED_SECTIONS):
            self.applied_epoch = snapshot.epoch
            return
        try:
            changes = self.control._apply_dict(merged_config(self.local, snapshot, self.serving, self.home))
        except Exception as exc:
            log.error("gateway group %s: the group's change (epoch %d) is not served here: %s",
                      self.settings.name, snapshot.epoch, words(exc))
            return
        self.applied_epoch = snapshot.epoch
        log.info("gateway group %s: epoch %d applied: %s", self.settings.name, snapshot.epoch,
                 ", ".join(c.get("text", str(c)) for c in changes) or "no difference")

    def run_change(self, call: Callable[[], Any], answer) -> None:
        """A change by RPC (`call()` on the loop, its result or a DeferredAnswer): under the group's config lock,
        on the group's latest state, published to the group before `answer` settles (RpcChange)."""
        RpcChange(self, call, answer).start()

    def _lock_config(self) -> None:
        deadline = self.clock() + CONFIG_LOCK_SECONDS
        while True:
            try:
                self.ioctx.lock_exclusive(self.store.object, CONFIG_LOCK, self.settings.gateway,
                                          desc="a change by RPC", duration=CONFIG_LOCK_SECONDS)
                return
            except Exception as exc:
                if errno_of(exc) not in (errno.EBUSY, errno.EEXIST) or self.clock() > deadline:
                    raise
                time.sleep(0.1)

    def _unlock_config(self) -> None:
        try:
            self.ioctx.unlock(self.store.object, CONFIG_LOCK, self.settings.gateway)
        except Exception as exc:
            log.warning("gateway group %s: releasing the config lock: %s", self.settings.name, exc)
        finally:
            if self._changes.locked():
                self._changes.release()

    def off_loop(self, fn: Callable[[], Any], answer, field: str) -> None:
        """Run the blocking `fn()` on a thread; `answer` settles on the loop with its result or its error."""
        from ..control.protocol import RpcError

        def run() -> None:
            try:
                result = fn()
            except Exception as exc:
                error = RpcError(words(exc), field, (exc.fix if isinstance(exc, NvmeofError) else "")
                                 or "see nvmeof_group_status")
                self._post(lambda: answer.fail(error))
                return
            self._post(lambda: answer.settle(result))
        threading.Thread(target=run, name="group rpc", daemon=True).start()

    def request_failback(self, grpid: int) -> dict:
        """An admin asks for ANA group `grpid` to go back to its home gateway (blocking: the RPC's thread)."""
        g = _group()
        snap = g.request_failback(self.store, grpid, "admin", now=self.wall)
        ana = snap.ana_groups.get(grpid)
        return {"ana_group": grpid, "home": ana.home if ana else None,
                "owner": ana.owner.gateway if ana and ana.owner else None, "requested": grpid in snap.failbacks}

    def shares(self, method: str) -> bool:
        """The RPC changes the group's shared sections (run_change), not only this gateway."""
        return method in SHARED_CHANGES

    def config_with(self, path: str):
        """A reload (SIGHUP, nvmeof_reload_config): this gateway's file read again, with the group's sections."""
        from ..config import load_userspace_config
        self.local = load_userspace_config(path).to_dict()
        return self.parse(merged_config(self.local, self.snapshot, self.serving, self.home), path)

    @staticmethod
    def parse(data: dict, source: str):
        from ..config import parse_config, raise_all, validate_for_userspace
        config = parse_config(data, source)
        raise_all(validate_for_userspace(config))
        return config

    # ---------------------------------------------------------------------------------------- status, end
    def status(self) -> dict:
        """This gateway's view of the group (nvmeof_group_status, `target status`, the doctor's group checks):
        members, each ANA group's home, owner, state here and lease (this gateway's own deadline, or the holder
        and expiry of another gateway's lease as the keeper last read it), the last events, the cluster."""
        snapshot = self.snapshot
        now = self.wall()
        groups = []
        for grpid in sorted(snapshot.ana_groups if snapshot else []):
            ana = snapshot.ana_groups[grpid]
            lease = self.leases.get(grpid)
            deadline = lease.serving_deadline() if lease is not None else None
            serving_for = round(deadline - self.clock(), 3) if deadline is not None else None
            holder, remaining, read = None, serving_for, None
            if serving_for is not None:
                holder = {"gateway": self.settings.gateway, "instance_id": self.instance_id}
            elif grpid in self.holders:
                locker, read = self.holders[grpid]
                remaining = 0.0
                if locker is not None:
                    holder = {"gateway": locker.cookie, "instance_id": locker.instance_id}
                    remaining = round(max(0.0, locker.expires - now), 3)
            groups.append({"ana_group": grpid, "home": ana.home, "owner": ana.owner.gateway if ana.owner else None,
                           "owner_instance": ana.owner.instance_id if ana.owner else None,
                           "since": ana.since, "here": "optimized" if grpid in self.serving else "inaccessible",
                           "lease": lease.state.value if lease is not None else "standby",
                           "serving_for": serving_for, "holder": holder, "lease_remaining": remaining,
                           "holder_read_ago": round(now - read, 3) if read is not None else None,
                           "failback": snapshot.failbacks[grpid].to if grpid in snapshot.failbacks else None})
        s = self.settings
        records = [{"gateway": m.gateway, "addr": m.addr, "instance_id": m.instance_id, "started": m.started,
                    "fence_addrs": list(m.fence_addrs)}
                   for _, m in sorted(snapshot.members.items())] if snapshot else []
        return {"group": s.name, "gateway": s.gateway, "instance_id": self.instance_id, "epoch": self.applied_epoch,
                "lease_seconds": s.lease, "failback": s.failback, "fenced": self.fenced,
                "members": sorted(snapshot.members) if snapshot else [], "member_records": records,
                "ana_groups": groups, "events": list(self.history), "event_counts": dict(self.event_counts),
                "cluster": {"conf": s.conf, "id": s.client_id, "keyring": s.keyring, "pool": s.pool,
                            "namespace": s.namespace,
                            "read_ago": round(now - self.read_at, 3) if self.read_at is not None else None,
                            "error": self.read_error}}

    def close(self) -> None:
        from ..ceph import clients
        if self._announce in clients.announce_hooks:
            clients.announce_hooks.remove(self._announce)
        self._stop.set()
        if self.target is not None:  # its store calls finish (within their op timeout) before the ioctx closes
            self.target.detach_shared_reservations(wait=True)
        if self._watch is not None:
            self._watch.close()
        if self._keeper is not None:
            self._keeper.join(self.settings.lease)
        if not self.fenced:
            for grpid, lease in self.leases.items():
                try:
                    lease.release()
                except Exception as exc:
                    log.warning("gateway group %s: ANA group %d: release: %s", self.settings.name, grpid, exc)
        if self.ioctx is not None:
            self.ioctx.close()
        if self.client is not None:
            from ..ceph import clients
            clients.release(self.client)

