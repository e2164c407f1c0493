"""The Ceph layer of a gateway group (nvmeof_roce/ceph/group/, docs/gateway-group.md) against a real development
cluster (ceph/devcluster.py, started once for the module), with two or three RADOS clients in this process
acting as gateways (each client has its own address, so one can be blocklisted alone): a change by one gateway
read and notified to the other, concurrent updates that all land, the lease (acquire, renew, holder as the lock
class reports it), the survivor's take-over that blocklists the silent owner first, the fenced owner's writes
and renew refused by the cluster, the clean failback, atomic reservations; and, without a cluster, the lease's
state machine on an injected clock and the lock class's encoding."""
import json
import struct
import subprocess
import threading
import time
import uuid
from datetime import datetime

import pytest

from group_env import dev_cluster, needs_ceph
from nvmeof_roce.ceph import devcluster
from nvmeof_roce.ceph.group import (AnaLease, Fenced, GroupConflict, GroupError, GroupStore, IllegalLeaseTransition,
                                    LeaseBusy, LeaseLost, LeaseMachine, LeaseState, LeaseStillHeld, LeaseTiming,
                                    ReservationStore, failback_due, hand_back, record_owner, request_failback,
                                    set_home, take_back, fail_over)
from nvmeof_roce.ceph.group import clslock, store as store_module
from nvmeof_roce.ceph.group.records import blocklist_address

NQN = "nqn.2024-01.io.test:group"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if devcluster.missing_tools():
        pytest.skip("Ceph is not installed")
    yield from dev_cluster(tmp_path_factory)


class Gateway:
    """One gateway's RADOS client (its own address and instance id) and pool context."""

    def __init__(self, name, cluster):
        from nvmeof_roce.ceph.bindings import rados_and_rbd
        self.rados_module, self.rbd_module = rados_and_rbd()
        self.name = name
        self.rados = self.rados_module.Rados(conffile=str(cluster.conf), conf={
            "rados_osd_op_timeout": "5", "rados_mon_op_timeout": "5", "rbd_cache": "false"})
        self.rados.connect(timeout=10)
        self.ioctx = self.rados.open_ioctx("rbd")

    @property
    def addr(self):
        return blocklist_address(self.rados.get_addrs())

    def store(self, group):
        return GroupStore(self.ioctx, group)

    def lease(self, group, grpid, duration, **kw):
        return AnaLease(self.ioctx, group, grpid, self.name, duration, cluster=self.rados, **kw)

    def close(self):
        try:
            self.ioctx.close()
        finally:
            self.rados.shutdown()


@pytest.fixture
def gateways(cluster):
    made = []

    def make(name):
        gw = Gateway(name, cluster)
        made.append(gw)
        return gw
    yield make
    for gw in made:
        gw.close()


@pytest.fixture
def group():
    return f"g{uuid.uuid4().hex[:10]}"


def blocklisted(cluster):
    """The addresses in the OSD map's blocklist (`ceph osd blocklist ls`: Ceph 16 prints the entries' JSON list
    and then a second one, of ranges)."""
    entries, _ = json.JSONDecoder().raw_decode(cluster.ceph("osd", "blocklist", "ls", "--format", "json").strip())
    return {entry["addr"] for entry in entries}


def wait_for(condition, timeout=5.0, step=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(step)
    return condition()


class Recording:
    """A stand-in for a client or an ioctx that records the calls made through it, in order."""

    def __init__(self, target, calls):
        self._target, self._calls = target, calls

    def __getattr__(self, name):
        value = getattr(self._target, name)
        if not callable(value):
            return value

        def recorded(*args, **kw):
            self._calls.append((name, args[0] if args else None))
            return value(*args, **kw)
        return recorded


# -- the state object ------------------------------------------------------------------------------------------

@needs_ceph
def test_a_change_by_one_gateway_is_read_and_notified_to_the_other(gateways, group):
    a, b = gateways("gwA"), gateways("gwB")
    seen, arrived = [], threading.Event()

    def on_change(snapshot):
        seen.append(snapshot)
        arrived.set()
    watch = b.store(group).watch(on_change, poll_interval=60)  # a poll would come too late: only the notify counts
    try:
        assert watch.watching
        subsystems = [{"nqn": NQN, "namespaces": [{"nsid": 1, "nvmeof_roce": {"backend": "rbd"}}]}]
        written = a.store(group).update(lambda s: s.config.__setitem__("subsystems", subsystems))
        assert arrived.wait(5), "gateway B's watch was not notified"
        assert watch.notifications >= 1
        assert seen[-1].epoch == written.epoch == 1 and seen[-1].config == {"subsystems": subsystems}
        assert b.store(group).read() == written

        arrived.clear()
        a.store(group).join("gwA", a.rados, ports=[{"traddr": "10.0.0.1", "trsvcid": "4420"}])
        assert arrived.wait(5)
        member = b.store(group).read().members["gwA"]
        assert (member.addr, member.instance_id) == (a.addr, a.rados.get_instance_id())
        assert member.ports == [{"traddr": "10.0.0.1", "trsvcid": "4420"}] and member.started > 0
    finally:
        watch.close()


@needs_ceph
def test_without_a_watch_the_poll_finds_the_change(gateways, group):
    a, b = gateways("gwA"), gateways("gwB")
    arrived = threading.Event()
    watch = b.store(group).watch(lambda s: arrived.set(), poll_interval=0.2, use_watch=False)
    try:
        a.store(group).update(lambda s: s.config.__setitem__("hosts", [{"nqn": "nqn.host:1"}]))
        assert arrived.wait(5)
        assert watch.notifications == 0 and not watch.watching
        assert watch.last.config["hosts"] == [{"nqn": "nqn.host:1"}]
    finally:
        watch.close()


@needs_ceph
def test_a_lost_watch_is_registered_again_and_the_change_made_meanwhile_is_read(gateways, group, monkeypatch):
    a, b = gateways("gwA"), gateways("gwB")
    monkeypatch.setattr(store_module, "WATCH_RETRY", 0.2)
    seen, arrived = [], threading.Event()
    watch = b.store(group).watch(lambda s: (seen.append(s), arrived.set()), poll_interval=60)
    try:
        watch._on_error(0, -107)  # what librados reports when the watch's session is lost (ENOTCONN)
        assert not watch.watching
        a.store(group).update(lambda s: s.config.__setitem__("ports", [{"portid": 1}]))  # nobody watching
        assert arrived.wait(5), "the change made while the watch was lost was not read"
        assert seen[-1].config == {"ports": [{"portid": 1}]}
        assert wait_for(lambda: watch.watching, timeout=3), "the watch was not registered again"
        arrived.clear()
        a.store(group).update(lambda s: s.config.__setitem__("ports", []))
        assert arrived.wait(5) and watch.notifications >= 1
    finally:
        watch.close()


@pytest.mark.parametrize("first", ["object missing", "object present"])
@needs_ceph
def test_an_update_that_meets_another_gateways_change_is_done_again_and_neither_is_lost(gateways, group, first):
    a, b = gateways("gwA"), gateways("gwB")
    if first == "object present":
        a.store(group).ensure()
    calls = []

    def a_adds(state):
        calls.append(list(state.config.get("hosts", [])))
        if len(calls) == 1:  # B's change lands between A's read and A's write
            b.store(group).update(lambda s: s.config.setdefault("hosts", []).append("b"))
        state.config.setdefault("hosts", []).append("a")

    after = a.store(group).update(a_adds)
    assert calls == [[], ["b"]], "A's change was not done again from B's state"
    assert after.config["hosts"] == ["b", "a"] and after.epoch == 2
    assert b.store(group).read().config["hosts"] == ["b", "a"]


@needs_ceph
def test_concurrent_updates_from_two_gateways_all_land(gateways, group):
    a, b = gateways("gwA"), gateways("gwB")
    per_gateway = 15

    def add_many(gw):
        store = gw.store(group)
        for i in range(per_gateway):
            store.update(lambda s, i=i: s.config.setdefault("hosts", []).append(f"{gw.name}-{i}"))

    threads = [threading.Thread(target=add_many, args=(gw,)) for gw in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    final = a.store(group).read()
    assert sorted(final.config["hosts"]) == sorted(f"{gw}-{i}" for gw in ("gwA", "gwB") for i in range(per_gateway))
    assert final.epoch == 2 * per_gateway


@needs_ceph
def test_an_update_that_keeps_meeting_changes_gives_up_naming_it_and_writes_nothing(gateways, group, monkeypatch):
    a, b = gateways("gwA"), gateways("gwB")
    monkeypatch.setattr(store_module, "UPDATE_ATTEMPTS", 3)

    def always_overtaken(state):
        b.store(group).update(lambda s: s.config.__setitem__("n", s.config.get("n", 0) + 1))
        state.config["mine"] = True

    with pytest.raises(GroupConflict) as err:
        a.store(group).update(always_overtaken)
    assert group in err.value.message and "3 attempts" in err.value.message and err.value.fix
    final = a.store(group).read()
    assert "mine" not in final.config and final.config["n"] == 3


# -- the lease -------------------------------------------------------------------------------------------------

@needs_ceph
def test_lease_acquire_renew_release_and_the_holder_as_the_lock_class_reports_it(gateways, group, cluster):
    a, b = gateways("gwA"), gateways("gwB")
    lease_a, lease_b = a.lease(group, 1, 2.5), b.lease(group, 1, 2.5)
    before = time.time()
    lease_a.acquire()
    assert lease_a.state is LeaseState.OWNER and lease_a.may_serve()
    holder = lease_a.holder()
    assert (holder.cookie, holder.instance_id, holder.addr) == ("gwA", a.rados.get_instance_id(), a.addr)
    assert before + 2.5 <= holder.expires < time.time() + 2.5 + 0.2, "the lease's length is not the one asked"

    info = json.loads(subprocess.run(["rados", "-c", str(cluster.conf), "-p", "rbd", "lock", "info", lease_a.object,
                                      "ana", "--format", "json"], capture_output=True, text=True, check=True).stdout)
    [locker] = info["lockers"]
    assert (locker["name"], locker["cookie"], locker["addr"]) == (holder.client, "gwA", holder.addr)
    osd_expiry = datetime.strptime(locker["expiration"], "%Y-%m-%dT%H:%M:%S.%f%z").timestamp()
    assert abs(osd_expiry - holder.expires) < 1e-3
    assert json.loads(locker["description"]) == {"gateway": "gwA", "group": group, "grpid": 1}

    with pytest.raises(LeaseBusy) as err:
        lease_b.acquire()
    assert "gwA" in err.value.message and lease_b.state is LeaseState.STANDBY

    deadline = lease_a.serving_deadline()
    time.sleep(0.3)
    lease_a.renew()
    assert lease_a.serving_deadline() >= deadline + 0.3
    assert lease_a.holder().expires >= holder.expires + 0.3

    lease_a.release()
    assert lease_a.state is LeaseState.STANDBY and not lease_a.may_serve() and lease_a.holder() is None
    with pytest.raises(LeaseLost):
        lease_a.renew()
    lease_b.acquire()
    assert lease_b.holder().cookie == "gwB"


@needs_ceph
def test_a_silent_owner_stops_serving_before_its_lease_ends_and_the_survivor_fences_it_first(
        gateways, group, cluster):
    a, b = gateways("gwA"), gateways("gwB")
    store = a.store(group)
    lease_a = a.lease(group, 1, 1.5, margin=0.4)
    calls = []
    lease_b = AnaLease(Recording(b.ioctx, calls), group, 1, "gwB", 1.5, cluster=Recording(b.rados, calls))
    set_home(store, 1, "gwA")
    lease_a.acquire()
    record_owner(store, lease_a)

    with pytest.raises(LeaseStillHeld):
        fail_over(b.store(group), lease_b)  # A's lease runs: A may still serve, nothing is done
    assert lease_b.state is LeaseState.STANDBY and a.addr not in blocklisted(cluster)

    # A stops renewing.  At its serving deadline it must stop; the OSD still holds its lock then.
    time.sleep(max(0.0, lease_a.serving_deadline() - time.monotonic()))
    assert lease_a.state is LeaseState.LOST and not lease_a.may_serve() and lease_a.serving_deadline() is None
    with pytest.raises(LeaseBusy):
        lease_b.acquire()
    assert wait_for(lambda: lease_b.holder() is None, timeout=3), "A's lock did not expire"

    calls.clear()
    after = fail_over(b.store(group), lease_b)
    assert lease_b.state is LeaseState.OWNER and lease_b.holder().cookie == "gwB"
    assert after.ana_groups[1].owner.gateway == "gwB" and after.ana_groups[1].home == "gwA"
    assert a.addr in blocklisted(cluster)
    names = [name for name, _ in calls]
    blocklist = next(i for i, (name, arg) in enumerate(calls) if name == "mon_command" and "blocklist" in arg)
    assert names.index("wait_for_latest_osdmap") > blocklist
    assert "operate_write_op" not in names[:blocklist], "the lock was touched before the owner was fenced"
    assert names.index("operate_write_op") > names.index("wait_for_latest_osdmap")

    with pytest.raises(a.rados_module.Error) as err:
        a.ioctx.write_full(f"{group}.data", b"late write")
    assert err.value.errno in (108, -108)  # ESHUTDOWN: the cluster refuses the fenced client
    with pytest.raises(LeaseLost):
        lease_a.renew()
    with pytest.raises(IllegalLeaseTransition):
        lease_a.acquire()  # LOST ends the ownership: release first
    lease_a.release()  # the fenced client's unlock fails; the lease is STANDBY all the same
    assert lease_a.state is LeaseState.STANDBY


@needs_ceph
def test_a_forced_take_over_fences_a_live_owner_whose_renew_and_image_writes_then_fail(gateways, group, cluster):
    a, b = gateways("gwA"), gateways("gwB")
    image_name = f"{group}-img"
    cluster.rbd("create", "--size", "4M", f"rbd/{image_name}")
    image = a.rbd_module.Image(a.ioctx, image_name)
    try:
        image.write(b"A" * 4096, 0)
        lease_a, lease_b = a.lease(group, 3, 3.0), b.lease(group, 3, 3.0)
        lease_a.acquire()
        lease_b.take_over(lease_a.member, force=True)
        assert lease_a.may_serve(), "A's own clock has not run out: only the cluster can stop it now"
        with pytest.raises(Fenced):
            lease_a.renew()
        assert lease_a.state is LeaseState.LOST and not lease_a.may_serve()
        assert lease_b.state is LeaseState.OWNER and lease_b.holder().cookie == "gwB"
        assert a.addr in blocklisted(cluster)
        with pytest.raises(a.rados_module.Error) as err:
            a.ioctx.write_full(f"{group}.data", b"x")
        assert abs(err.value.errno) == 108
        with pytest.raises(a.rbd_module.Error) as err:
            image.write(b"B" * 4096, 0)
        assert abs(err.value.errno) == 108
    finally:
        image.close()
    with b.rbd_module.Image(b.ioctx, image_name, read_only=True) as check:
        assert check.read(0, 4096) == b"A" * 4096  # the fenced owner's late write never reached the image


@needs_ceph
def test_take_over_refuses_to_fence_its_own_client_or_a_third_gateway(gateways, group, cluster):
    a, b, c = gateways("gwA"), gateways("gwB"), gateways("gwC")
    lease_a, lease_b, lease_c = a.lease(group, 4, 3.0), b.lease(group, 4, 3.0), c.lease(group, 4, 3.0)
    with pytest.raises(GroupError):
        lease_a.take_over(lease_a.member, force=True)
    lease_c.acquire()  # C took the group over already: B's take-over from A must not fence anyone
    with pytest.raises(LeaseBusy):
        lease_b.take_over(lease_a.member, force=True)
    assert lease_b.state is LeaseState.STANDBY
    assert not {a.addr, c.addr} & blocklisted(cluster)


@needs_ceph
def test_failback_hands_the_group_back_without_a_blocklist(gateways, group, cluster):
    b = gateways("gwB")
    store_b = b.store(group)
    set_home(store_b, 2, "gwA")
    lease_b = b.lease(group, 2, 3.0)
    lease_b.acquire()  # gwA, the home, is away: gwB serves
    owned = record_owner(store_b, lease_b)
    with pytest.raises(GroupError) as err:
        request_failback(store_b, 2)
    assert "gwA" in err.value.message and "not a member" in err.value.message

    a = gateways("gwA")  # the home comes back
    store_a = a.store(group)
    joined = store_a.join("gwA", a.rados)
    started = joined.members["gwA"].started
    assert not failback_due(joined, 2, started + 5, settle=10)
    assert failback_due(joined, 2, started + 10, settle=10)
    assert not failback_due(owned, 2, started + 10, settle=10)  # home not a member in that snapshot

    asked = request_failback(store_a, 2, reason="admin")
    assert asked.failbacks[2].to == "gwA" and not failback_due(asked, 2, started + 99, settle=10)
    lease_a = a.lease(group, 2, 3.0)
    with pytest.raises(LeaseBusy):
        take_back(store_a, lease_a)  # gwB has not let go yet
    assert lease_a.state is LeaseState.STANDBY

    handed = hand_back(store_b, lease_b)
    assert lease_b.state is LeaseState.STANDBY and not lease_b.may_serve()
    assert handed.ana_groups[2].owner is None and lease_b.holder() is None
    back = take_back(store_a, lease_a)
    assert lease_a.state is LeaseState.OWNER and lease_a.holder().cookie == "gwA"
    assert back.ana_groups[2].owner.gateway == "gwA" and 2 not in back.failbacks
    assert not {a.addr, b.addr} & blocklisted(cluster), "a clean handover blocklisted a gateway"


# -- reservations ----------------------------------------------------------------------------------------------

def register(host, key):
    def change(resv):
        resv.registrants[host] = key
        resv.generation += 1
    return change


@needs_ceph
def test_reservation_updates_from_two_gateways_are_atomic_and_read_the_same_everywhere(gateways, group):
    a, b = gateways("gwA"), gateways("gwB")
    resv_a, resv_b = ReservationStore(a.ioctx, group), ReservationStore(b.ioctx, group)
    calls = []

    def a_registers(resv):
        calls.append(dict(resv.registrants))
        if len(calls) == 1:  # B's registration lands between A's read and A's write
            resv_b.update(NQN, 1, register("hb", 2))
        register("ha", 1)(resv)

    after = resv_a.update(NQN, 1, a_registers)
    assert calls == [{}, {"hb": 2}]
    assert after.registrants == {"hb": 2, "ha": 1} and after.generation == 2

    per_gateway = 10

    def many(store, prefix):
        for i in range(per_gateway):
            store.update(NQN, 2, register(f"{prefix}{i}", i + 1))
    threads = [threading.Thread(target=many, args=(s, p)) for s, p in ((resv_a, "a"), (resv_b, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    seen_a, seen_b = resv_a.read(NQN, 2), resv_b.read(NQN, 2)
    assert seen_a == seen_b
    assert len(seen_a.registrants) == 2 * per_gateway and seen_a.generation == 2 * per_gateway

    held = resv_b.update(NQN, 2, lambda r: (setattr(r, "holder", "a0"), setattr(r, "rtype", 1)))
    assert resv_a.read(NQN, 2).holder == "a0" and held.rtype == 1
    snapshot = a.store(group).read()
    assert snapshot.reservations[(NQN, 2)] == held
    assert snapshot.epoch == 0, "a reservation change bumped the group's epoch"

    resv_a.remove(NQN, 2)
    assert resv_b.read(NQN, 2).registrants == {} and (NQN, 2) not in b.store(group).read().reservations


# -- the lease's state machine, on an injected clock (no cluster) ----------------------------------------------

class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def machine(duration=3.0, margin=0.5, renew_interval=1.0):
    clock = Clock()
    return LeaseMachine(LeaseTiming.of(duration, margin, renew_interval), clock), clock


def test_an_owner_that_cannot_renew_goes_lost_before_its_lease_ends():
    m, clock = machine()
    start = clock.now
    m.acquired(m.begin())
    assert m.state is LeaseState.OWNER and m.serving_deadline() == start + 2.5
    clock.now = start + 1.25
    assert m.state is LeaseState.OWNER
    clock.now = start + 1.5  # one renew interval left
    assert m.state is LeaseState.EXPIRING and m.may_serve()
    m.renew_failed(lost=False)  # a timeout: the deadline stands
    assert m.serving_deadline() == start + 2.5
    clock.now = start + 2.5
    assert m.state is LeaseState.LOST and not m.may_serve() and m.serving_deadline() is None
    assert clock.now < start + 3.0, "the gateway stops serving before the lock can end on the OSD"


def test_a_renew_is_timed_from_its_start_and_one_that_returns_after_the_deadline_does_not_count():
    m, clock = machine()
    m.acquired(m.begin())
    clock.now += 1.0
    started = m.begin()
    clock.now += 0.9  # the call took 0.9 s
    assert m.renewed(started)
    assert m.serving_deadline() == started + 2.5 and m.next_renew_at() == started + 1.0

    started = m.begin()
    clock.now = started + 2.6  # the call came back after the deadline
    assert not m.renewed(started)
    assert m.state is LeaseState.LOST and not m.may_serve()


def test_a_renew_that_finds_the_lock_gone_loses_at_once_and_release_leads_back_to_standby():
    m, clock = machine()
    m.acquired(m.begin())
    m.renew_failed(lost=True)
    assert m.state is LeaseState.LOST and not m.may_serve()
    m.begin_release()
    assert m.state is LeaseState.RELEASING and not m.may_serve()
    m.released()
    assert m.state is LeaseState.STANDBY
    m.begin_take_over()
    assert m.state is LeaseState.TAKING_OVER and not m.may_serve()
    m.acquired(m.begin())
    assert m.state is LeaseState.OWNER and m.may_serve()
    with pytest.raises(IllegalLeaseTransition):
        m.begin_take_over()
    m.begin_release()
    assert not m.may_serve(), "a releasing owner serves no more before it unlocks"


def test_lease_timing_that_cannot_work_is_refused_naming_it():
    for duration, margin, renew in ((3, 3, 1), (3, 0, 1), (3, 1, 2), (0, None, None)):
        with pytest.raises(GroupError) as err:
            LeaseTiming.of(duration, margin, renew)
        assert err.value.fix
    assert LeaseTiming.of(3.0) == LeaseTiming(3.0, 0.75, 1.0)


# -- the lock class's encoding (no cluster) --------------------------------------------------------------------

def _frame(payload):
    return struct.pack("<BBI", 1, 1, len(payload)) + payload


def _string(text):
    return struct.pack("<I", len(text)) + text.encode()


def test_the_lock_reply_decodes_both_address_encodings():
    modern = b"\x01" + _frame(struct.pack("<III", 1, 77, 16) + struct.pack("<H", 2) + bytes([0x1a, 0x0a])
                              + bytes([10, 0, 0, 5]) + bytes(8))
    legacy_storage = struct.pack(">H", 10) + struct.pack(">H", 6800) + bytes(4) + \
        bytes.fromhex("fd000000000000000000000000000001") + bytes(128 - 24)
    legacy = b"\x00" + bytes(3) + struct.pack("<I", 9) + legacy_storage
    lockers = b""
    for number, cookie, addr in ((4117, "gwA", modern), (4118, "gwB", legacy)):
        lockers += _frame(struct.pack("<Bq", 8, number) + _string(cookie))
        lockers += _frame(struct.pack("<II", 1795921146, 500_000_000) + addr + _string("d"))
    reply = _frame(struct.pack("<I", 2) + lockers + b"\x01" + _string(""))
    info = clslock.decode_info(reply)
    assert [(l.client, l.cookie, l.addr, l.expires) for l in info.lockers] == [
        ("client.4117", "gwA", "10.0.0.5:6666/77", 1795921146.5),
        ("client.4118", "gwB", "[fd00::1]:6800/9", 1795921146.5)]
    with pytest.raises(ValueError):
        clslock.decode_info(reply[:-9])


def test_the_lock_op_carries_the_exact_duration():
    op = clslock.lock_op("ana", "gwA", "", 1.5, clslock.MUST_RENEW)
    assert op[-9:] == struct.pack("<II", 1, 500_000_000) + bytes([2])
    assert blocklist_address("[v2:10.0.0.1:0/5,v1:10.0.0.1:0/5]") == "10.0.0.1:0/5"
    assert blocklist_address("127.0.0.1:0/3328954605") == "127.0.0.1:0/3328954605"
