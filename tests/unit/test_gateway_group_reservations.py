"""NVMe reservations shared by the gateways of a group (engine/shared_resv.py, service/group.py's adapter over
ceph/group's ReservationStore), against a real development Ceph cluster: two gateways in one process (group_env),
a host connected to each through the loopback fabric.

A namespace is served by the gateway that owns its ANA group's lease, inaccessible on the others; so that both
gateways serve the same namespace (where sharing a reservation matters at every command, not only at a failover),
each test makes ANA group 2 (A's) non-optimized on B by hand, as an admin may."""
import time

import pytest

from group_env import Gateway, call, dev_cluster, needs_ceph, run
from held import hold
from loopback_env import ADDR1, ADDR2, HOST_A, HOST_B, file_ns, ram_ns
from nvmeof_roce.nvme import reservation as R
from nvmeof_roce.nvme import status as S
from nvmeof_roce.nvme.command import NVM_RESV_REGISTER, SQE
from nvmeof_roce.nvme.status import NvmeStatusError
from nvmeof_roce.service.group import reservation_timeout

pytestmark = needs_ceph

SUB = "nqn.2024-01.io.test:group-resv"
ID1 = "00000000-0000-4000-8000-0000000000a1"
ID2 = "00000000-0000-4000-8000-0000000000b2"
HID1, HID2 = (bytes.fromhex(i.replace("-", "")) for i in (ID1, ID2))
K1, K2 = 0x1111, 0x2222
RESV = {"enable": "1"}
NS_RAM, NS_FILE = 1, 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from dev_cluster(tmp_path_factory)


def seed(tmp_path=None):
    namespaces = [ram_ns(NS_RAM, ana_grpid=2, resv=RESV), ram_ns(2, ana_grpid=3)]
    if tmp_path is not None:
        namespaces.append(dict(file_ns(NS_FILE, tmp_path / "shared.img"), ana_grpid=2, resv=RESV))
    return [{"nqn": SUB, "attr": {"allow_any_host": "1"}, "namespaces": namespaces}]


def two_gateways(cluster, group, tmp_path=None):
    """A (home of ANA group 2, with the seed) and B (home of 3), both serving group 2's namespaces."""
    args = {"file_lock": "shared"} if tmp_path is not None else {}
    a = Gateway(cluster, group, "gw-a", [2], ADDR1, seed=seed(tmp_path), **args)
    try:
        b = Gateway(cluster, group, "gw-b", [3], ADDR2, **args)
    except BaseException:
        a.close()
        raise
    run([a, b], lambda: a.state(2) == "optimized" and b.state(3) == "optimized", what="both serving")
    b.env.target.set_ana_state(1, 2, "non-optimized")
    return a, b


def copy_of(gw, nsid=NS_RAM):
    """The gateway's copy of the namespace's reservation (what its I/O path checks)."""
    return gw.env.target.subsystems[SUB].namespaces[nsid].resv


def notices_on(gw, hostid):
    return [n for c in gw.env.target.subsystems[SUB].controllers.values() if c.hostid == hostid for n in c.resv_log]


def conflict(write):
    with pytest.raises(NvmeStatusError) as refused:
        write()
    return refused.value.status & S.CODE_MASK == S.RESERVATION_CONFLICT


def registrants(report):
    return [(r.hostid, r.rkey, r.holds) for r in report.registrants]


def test_a_reservation_made_through_one_gateway_is_the_groups_on_every_gateway(cluster):
    a, b = two_gateways(cluster, "r1")
    try:
        h1 = a.env.connect(SUB, ADDR1, hostnqn=HOST_A, hostid=ID1, num_io_queues=1)
        h2 = b.env.connect(SUB, ADDR2, hostnqn=HOST_B, hostid=ID2, num_io_queues=1)
        h1.resv_register(NS_RAM, nrkey=K1)
        h1.resv_acquire(NS_RAM, R.WRITE_EXCLUSIVE, K1)
        through_a, through_b = h1.resv_report(NS_RAM), h2.resv_report(NS_RAM)
        assert through_b == through_a
        assert (through_b.generation, through_b.rtype, registrants(through_b)) == \
            (1, R.WRITE_EXCLUSIVE, [(HID1, K1, True)])
        # B's I/O path checks its copy: it has A's change once B's watch brought it (a notify away)
        run([a, b], lambda: copy_of(b).holder == HID1, what="B applying A's reservation")
        assert conflict(lambda: h2.write(NS_RAM, 0, b"2" * 512))  # Write Exclusive: host 2 may read only
        h2.read(NS_RAM, 0, 1)
        h2.resv_register(NS_RAM, nrkey=K2)
        h2.resv_acquire(NS_RAM, R.WRITE_EXCLUSIVE, K2, action=R.PREEMPT, prkey=K1)
        run([a, b], lambda: copy_of(a).holder == HID2, what="A applying B's preempt")
        assert conflict(lambda: h1.write(NS_RAM, 0, b"1" * 512))  # host 1 lost its registration, on A too
        h2.write(NS_RAM, 0, b"2" * 512)
        through_a, through_b = h1.resv_report(NS_RAM), h2.resv_report(NS_RAM)
        assert through_a == through_b
        assert (through_a.generation, through_a.rtype, registrants(through_a)) == \
            (3, R.WRITE_EXCLUSIVE, [(HID2, K2, True)])
        # host 1's controller on A is told, as the preempt recorded it; host 2 (the preempting host) is not
        run([a, b], lambda: notices_on(a, HID1), what="the notice to host 1 on A")
        assert h1.resv_notification().log_type == R.LOG_REGISTRATION_PREEMPTED
        assert h2.resv_notification().log_type == R.LOG_EMPTY
        assert a.env.target.reservation_status(SUB, NS_RAM)["shared"] == \
            b.env.target.reservation_status(SUB, NS_RAM)["shared"] == {"version": 4, "in_force": 4}
    finally:
        b.close()
        a.close()


def test_a_report_reads_the_store_whatever_the_gateways_copy(cluster):
    a, b = two_gateways(cluster, "r2")
    try:
        b.member._watch.close()  # B hears of nothing any more: only its commands' reads tell it
        h1 = a.env.connect(SUB, ADDR1, hostnqn=HOST_A, hostid=ID1, num_io_queues=1)
        h2 = b.env.connect(SUB, ADDR2, hostnqn=HOST_B, hostid=ID2, num_io_queues=1)
        h1.resv_register(NS_RAM, nrkey=K1)
        assert copy_of(b).version == 0
        report = h2.resv_report(NS_RAM)
        assert (report.generation, registrants(report)) == (1, [(HID1, K1, False)])
        assert copy_of(b).registrants == {HID1: K1}  # and the record read is B's copy now
    finally:
        b.close()
        a.close()


def test_registrations_made_at_once_through_both_gateways_all_land(cluster):
    a, b = two_gateways(cluster, "r3")
    try:
        hosts = []
        for i in range(6):
            gw, addr = (a, ADDR1) if i % 2 == 0 else (b, ADDR2)
            hostid = f"00000000-0000-4000-8000-0000000001{i:02x}"
            ctrl = gw.env.connect(SUB, addr, hostnqn=f"nqn.2014-08.org.nvmexpress:uuid:{hostid}", hostid=hostid,
                                  num_io_queues=1)
            hosts.append((ctrl, bytes.fromhex(hostid.replace("-", "")), 0x100 + i))
        answers = []
        for ctrl, _hostid, key in hosts:  # all sent before any is answered
            sqe = SQE(opc=NVM_RESV_REGISTER, nsid=NS_RAM, cdw10=R.register_cdw10(R.REGISTER))
            ctrl.submit_io(sqe, answers.append, data_out=R.KEYS.pack(0, key))

        def answered():
            for ctrl, _hostid, _key in hosts:
                ctrl.poll_completions()
            return len(answers) == len(hosts)
        run([a, b], answered, what="every registration answered")
        assert [c.status for c in answers] == [0] * len(hosts)
        want = sorted((hostid, key, False) for _ctrl, hostid, key in hosts)
        for ctrl, _hostid, _key in hosts[:2]:  # one host through A, one through B
            report = ctrl.resv_report(NS_RAM)
            assert (report.generation, sorted(registrants(report))) == (len(hosts), want)
        record = a.member.store.read().reservations[(SUB, NS_RAM)]
        assert (record.generation, record.rev) == (len(hosts), len(hosts))
    finally:
        b.close()
        a.close()


def test_a_gateway_fences_another_gateways_preempt_before_it_is_in_force_there(cluster, tmp_path):
    """What is promised across gateways: B answers its preempt once the change is in the store and in force on
    B; A takes the new state as soon as it hears of it (a notify away), so host 1's new commands conflict on A
    from then on, and considers it in force there - its notices sent - only once host 1's commands that
    started on A before it (here a Write held on A's device) are gone.  B's answer does not wait for A."""
    a, b = two_gateways(cluster, "r4", tmp_path)
    try:
        h1 = a.env.connect(SUB, ADDR1, hostnqn=HOST_A, hostid=ID1, num_io_queues=1)
        h2 = b.env.connect(SUB, ADDR2, hostnqn=HOST_B, hostid=ID2, num_io_queues=1)
        h1.resv_register(NS_FILE, nrkey=K1)
        h1.resv_acquire(NS_FILE, R.WRITE_EXCLUSIVE, K1)
        h2.resv_register(NS_FILE, nrkey=K2)
        device = hold(a.env.target, SUB, NS_FILE, "write")
        written = []
        h1.submit_write(NS_FILE, 0, b"1" * 4096, written.append)
        run([a], lambda: device.running >= 1, what="host 1's Write on A's device")
        h2.resv_acquire(NS_FILE, R.WRITE_EXCLUSIVE, K2, action=R.PREEMPT_AND_ABORT, prkey=K1)
        assert written == [] and device.running == 1  # answered by B with host 1's Write still on A's device
        ns = a.env.target.subsystems[SUB].namespaces[NS_FILE]
        run([a, b], lambda: ns.resv.holder == HID2, what="A applying B's preempt")
        sync = a.env.target.resv_sync
        assert sync.in_force(ns) < ns.resv.version  # fenced: not in force on A while the Write can land
        assert not notices_on(a, HID1)
        late = []
        h1.submit_write(NS_FILE, 8, b"1" * 4096, late.append)  # a new Write of host 1: it meets the new state
        run([a], lambda: h1.poll_completions() >= 0 and late, what="host 1's new Write answered")
        assert late[0].status & S.CODE_MASK == S.RESERVATION_CONFLICT
        assert written == [] and sync.in_force(ns) < ns.resv.version
        device.release.set()
        run([a], lambda: h1.poll_completions() >= 0 and written and sync.in_force(ns) == ns.resv.version,
            what="the held Write completing and the preempt in force on A")
        assert written[0].status == 0  # it started before A applied the preempt: it completes
        assert [kind for _count, kind, _nsid in notices_on(a, HID1)] == [R.LOG_REGISTRATION_PREEMPTED]
    finally:
        b.close()
        a.close()


def test_a_cluster_that_does_not_answer_fails_the_command_within_its_bound_and_io_goes_on(cluster):
    """The cluster frozen: the command's store call times out (the group client's OSD op timeout, lease / 3)
    and the command is answered Namespace Not Ready (engine/shared_resv.py NOT_READY: no DNR, the host may retry
    once the cluster is back), within reservation_timeout at most; meanwhile the loop serves I/O, on the same
    namespace too.  A 9 s lease keeps the ANA group served for several seconds without renewals."""
    a = Gateway(cluster, "r5", "gw-a", [2], ADDR1, seed=seed(), lease=9)
    try:
        run([a], lambda: a.state(2) == "optimized", what="A serving")
        h1 = a.env.connect(SUB, ADDR1, hostnqn=HOST_A, hostid=ID1, num_io_queues=1)
        bound = reservation_timeout(a.member.settings)
        answers = []
        cluster.pause()
        try:
            started = time.monotonic()
            sqe = SQE(opc=NVM_RESV_REGISTER, nsid=NS_RAM, cdw10=R.register_cdw10(R.REGISTER))
            h1.submit_io(sqe, answers.append, data_out=R.KEYS.pack(0, K1))
            io = []
            while not answers and time.monotonic() - started < bound + 5:
                h1.submit_write(NS_RAM, 0, b"w" * 512, lambda c: io.append(c.status))
                h1.submit_read(NS_RAM, 0, 1, lambda c: io.append(c.status))
                a.pump()
                h1.poll_completions(0.05)
            took = time.monotonic() - started
        finally:
            cluster.resume()
        assert [c.status for c in answers] == [S.NS_NOT_READY], answers
        assert took <= bound, (took, bound)
        assert len(io) >= 4 and set(io) == {0}, io  # reads and writes served while the store was frozen
        run([a], lambda: a.member.lease(2).may_serve(), what="A serving again")
    finally:
        a.close()


def set_reservations(gw, others, nsid):
    """Reservations on for a namespace added by RPC (nvmeof_ns_set_reservation: this gateway's own method)."""
    answer = gw.control.call("nvmeof_ns_set_reservation", {"nqn": SUB, "nsid": nsid, "enable": True})
    if hasattr(answer, "part"):
        run([gw] + others, lambda: answer.part is not None, what="reservations on")


def test_a_namespace_removed_from_the_group_takes_its_reservation_record_with_it(cluster):
    """Removed by RPC, the namespace's record goes in the same update as the config; added again with the same
    NSID, it has no registrant.  A record left for an NSID the group does not have (a registration that met the
    removal on another gateway) is dropped when a namespace with that NSID is added."""
    a, b = two_gateways(cluster, "r6")
    try:
        h1 = a.env.connect(SUB, ADDR1, hostnqn=HOST_A, hostid=ID1, num_io_queues=1)
        h1.resv_register(NS_RAM, nrkey=K1)
        h1.resv_acquire(NS_RAM, R.WRITE_EXCLUSIVE, K1)
        assert (SUB, NS_RAM) in a.member.store.read().reservations
        epoch = a.member.store.read().epoch
        call(b, [a], "nvmf_subsystem_remove_ns", {"nqn": SUB, "nsid": NS_RAM})
        after = a.member.store.read()
        assert (SUB, NS_RAM) not in after.reservations and after.epoch == epoch + 1  # one update: both
        run([a, b], lambda: NS_RAM not in a.env.target.subsystems[SUB].namespaces, what="A removing it")
        call(a, [b], "nvmf_subsystem_add_ns",
             {"nqn": SUB, "namespace": {"nsid": NS_RAM, "backend": "ram", "size": "1M", "anagrpid": 2}})
        set_reservations(a, [b], NS_RAM)
        report = h1.resv_report(NS_RAM)
        assert (report.generation, report.rtype, registrants(report)) == (0, 0, [])
        # a stale record for an NSID the group does not have: the namespace added with it does not inherit it
        from nvmeof_roce.ceph.group import ReservationStore
        ReservationStore(a.member.ioctx, "r6").update(SUB, 9, lambda r: r.registrants.__setitem__(ID2, K2))
        call(b, [a], "nvmf_subsystem_add_ns",
             {"nqn": SUB, "namespace": {"nsid": 9, "backend": "ram", "size": "1M", "anagrpid": 2}})
        assert (SUB, 9) not in a.member.store.read().reservations
    finally:
        b.close()
        a.close()


def test_reservations_turned_on_by_rpc_on_one_gateway_are_on_for_the_group_and_off_drops_the_record(cluster):
    """nvmeof_ns_set_reservation is a change of the group's config: made on A, B serves the namespace with
    reservations too (a registration through B is in A's copy); turned off again, the namespace's record
    goes with it, so turning them on later starts from none."""
    a, b = two_gateways(cluster, "r7")
    try:
        assert b.env.target.subsystems[SUB].namespaces[2].resv is None
        set_reservations(a, [b], 2)
        run([a, b], lambda: b.env.target.subsystems[SUB].namespaces[2].resv is not None, what="B turning them on")
        h2 = b.env.connect(SUB, ADDR2, hostnqn=HOST_B, hostid=ID2, num_io_queues=1)
        h2.resv_register(2, nrkey=K2)
        assert registrants(h2.resv_report(2))[0][1:] == (K2, False)
        # A (inaccessible for namespace 2's ANA group 3) keeps the group's record too
        run([a, b], lambda: copy_of(a, 2).generation == 1 and len(copy_of(a, 2).registrants) == 1, what="A's copy")
        assert (SUB, 2) in a.member.store.read().reservations
        h2.resv_register(2, crkey=K2, action=R.UNREGISTER)
        answer = b.control.call("nvmeof_ns_set_reservation", {"nqn": SUB, "nsid": 2, "enable": False})
        if hasattr(answer, "part"):
            run([a, b], lambda: answer.part is not None, what="reservations off")
        run([a, b], lambda: a.env.target.subsystems[SUB].namespaces[2].resv is None, what="A turning them off")
        assert (SUB, 2) not in a.member.store.read().reservations
    finally:
        b.close()
        a.close()
