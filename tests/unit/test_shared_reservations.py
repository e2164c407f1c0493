"""The engine's side of a gateway group's reservations (engine/shared_resv.py), on an in-memory store with the
same contract as the service's RADOS adapter: two targets share it, each a loopback Env, and each is told of the
other's writes as the group's watch tells it (through its Work channel, on its loop).  What the store does on
demand here - hold a call, fail it, have another gateway write between a read and a write - is what the tests
against a development cluster cannot ask of Ceph (test_gateway_group_reservations.py)."""
import copy
import threading

import pytest

from loopback_env import ADDR1, HOST_A, HOST_B, Env, port, ram_ns
from nvmeof_roce.engine.shared_resv import StoreError
from nvmeof_roce.nvme.status import NvmeStatusError
from nvmeof_roce.nvme import identify as I
from nvmeof_roce.nvme import reservation as R
from nvmeof_roce.nvme import status as S
from nvmeof_roce.nvme.command import NVM_RESV_REGISTER, SQE

SUB = "nqn.2024-01.io.test:shared"
ID1 = "00000000-0000-4000-8000-0000000000a1"
ID2 = "00000000-0000-4000-8000-0000000000b2"
HID1, HID2 = (bytes.fromhex(i.replace("-", "")) for i in (ID1, ID2))
K1, K2 = 0x1111, 0x2222
TIMEOUT = 5.0


class MemoryStore:
    """engine/shared_resv.py's SharedReservations in memory: compare-and-swap by version, the watchers told after
    each write.  `hold`: calls wait on it (an event) before `hold_at` ("change": before deciding, "write": after
    deciding, before writing); `fail`: the next call raises it; `between`: called once before the next write, as
    another gateway writing meanwhile (the write then finds the record changed and decides again)."""

    def __init__(self, timeout=TIMEOUT):
        self.timeout = timeout
        self.records = {}
        self.lock = threading.Lock()
        self.targets = []
        self.hold = None
        self.hold_at = "change"
        self.fail = None
        self.between = None
        self.decisions = 0  # times a change was asked to decide
        self.calls = threading.Semaphore(0)  # released as each call starts (a test waits for its call to start)

    def _start(self):
        self.calls.release()
        if self.fail is not None:
            exc, self.fail = self.fail, None
            raise exc

    def read(self, nqn, nsid):
        self._start()
        with self.lock:
            return copy.deepcopy(self.records.get((nqn, nsid)))

    def update(self, nqn, nsid, change):
        self._start()
        key = (nqn, nsid)
        while True:
            with self.lock:
                before = copy.deepcopy(self.records.get(key))
            if self.hold is not None and self.hold_at == "change":
                self.hold.wait(20)
            self.decisions += 1
            after = change(copy.deepcopy(before))
            if self.hold is not None and self.hold_at == "write":
                self.hold.wait(20)
            if self.between is not None:
                between, self.between = self.between, None
                between(self)
            with self.lock:
                if self.records.get(key) != before:
                    continue  # another gateway wrote it: decide again on its record
                if after is None or (before is not None and all(after[k] == before[k] for k in STATE)):
                    return before
                after = dict(after, version=(before or {}).get("version", 0) + 1)
                self.records[key] = after
            self.tell(key, after)
            return copy.deepcopy(after)

    def write(self, key, record):
        """Another gateway's write (a test's): stored and told."""
        with self.lock:
            record = dict(record, version=self.records.get(key, {}).get("version", 0) + 1)
            self.records[key] = record
        self.tell(key, record)

    def tell(self, key, record):
        for t in self.targets:
            t.work.post(lambda t=t: t.shared_reservations_changed({key: copy.deepcopy(record)}))


STATE = ("registrants", "holder", "rtype", "generation")


def config():
    return {"hosts": [{"nqn": HOST_A}, {"nqn": HOST_B}], "ports": [port(1, ADDR1, [SUB])],
            "subsystems": [{"nqn": SUB, "namespaces": [ram_ns(1, resv={"enable": "1"}), ram_ns(2)]}]}


class Gateway:
    def __init__(self, store, records=None):
        self.env = Env(config())
        self.target = self.env.target
        self.target.attach_shared_reservations(store, records or {})
        store.targets.append(self.target)

    @property
    def resv(self):
        return self.target.subsystems[SUB].namespaces[1].resv

    def pump(self):
        self.env.fabric.run_watched(0.01)
        self.env.fabric.pump()

    def close(self):
        self.env.close()


@pytest.fixture
def store():
    return MemoryStore()


@pytest.fixture
def gateways(store):
    made = [Gateway(store), Gateway(store)]
    yield made
    for gw in made:
        gw.close()


def until(gateways, done, what, rounds=500):
    for _ in range(rounds):
        for gw in gateways:
            gw.pump()
        if done():
            return
    raise AssertionError(f"{what} did not happen")


def submit_register(ctrl, key, answers):
    sqe = SQE(opc=NVM_RESV_REGISTER, nsid=1, cdw10=R.register_cdw10(R.REGISTER))
    ctrl.submit_io(sqe, answers.append, data_out=R.KEYS.pack(0, key))


def test_a_change_made_through_one_gateway_is_the_other_gateways_state_report_conflicts_and_notices(gateways):
    a, b = gateways
    h1 = a.env.connect(SUB, hostnqn=HOST_A, hostid=ID1, num_io_queues=1)
    h2 = b.env.connect(SUB, hostnqn=HOST_B, hostid=ID2, num_io_queues=1)
    h1.resv_register(1, nrkey=K1)
    h1.resv_acquire(1, R.WRITE_EXCLUSIVE, K1)
    report = h2.resv_report(1)  # read from the store, whatever B's copy is
    assert (report.generation, report.rtype, [(r.hostid, r.rkey, r.holds) for r in report.registrants]) == \
        (1, R.WRITE_EXCLUSIVE, [(HID1, K1, True)])
    until([a, b], lambda: b.resv.holder == HID1, "B applying A's change")
    with pytest.raises(NvmeStatusError) as refused:
        h2.write(1, 0, b"x" * 512)
    assert refused.value.status & S.CODE_MASK == S.RESERVATION_CONFLICT
    h2.read(1, 0, 1)
    h2.resv_register(1, nrkey=K2)
    h2.resv_acquire(1, R.WRITE_EXCLUSIVE, K2, action=R.PREEMPT, prkey=K1)
    until([a, b], lambda: a.resv.holder == HID2, "A applying B's preempt")
    with pytest.raises(NvmeStatusError) as refused:
        h1.write(1, 0, b"y" * 512)
    assert refused.value.status & S.CODE_MASK == S.RESERVATION_CONFLICT
    # host 1's controller on A is told its registration was preempted (the notice B's change recorded)
    until([a, b], lambda: any(c.resv_log for c in a.target.subsystems[SUB].controllers.values() if c.hostid == HID1),
          "the notice on A")
    assert h1.resv_notification().log_type == R.LOG_REGISTRATION_PREEMPTED
    assert h2.resv_notification().log_type == R.LOG_EMPTY  # the preempting host is not told
    assert a.target.reservation_status(SUB, 1)["shared"] == {"version": 4, "in_force": 4}


def test_a_change_is_decided_again_on_the_record_another_gateway_wrote_meanwhile(store, gateways):
    a, b = gateways
    h1 = a.env.connect(SUB, hostnqn=HOST_A, hostid=ID1, num_io_queues=1)

    def other_gateway_registers(s):
        s.write((SUB, 1), {"registrants": [[HID2.hex(), K2]], "holder": None, "rtype": 0, "generation": 1,
                           "changes": []})
    store.between = other_gateway_registers
    h1.resv_register(1, nrkey=K1)
    assert store.decisions == 2  # decided on the empty record, then again on the one with host 2
    record = store.records[(SUB, 1)]
    assert (sorted(h for h, _k in record["registrants"]), record["generation"], record["version"]) == \
        (sorted([HID1.hex(), HID2.hex()]), 2, 2)
    until([a, b], lambda: b.resv.version == 2 and a.resv.version == 2, "both gateways at version 2")
    assert a.resv.registrants == b.resv.registrants == {HID2: K2, HID1: K1}


def test_a_store_that_does_not_answer_is_answered_namespace_not_ready_and_the_loop_serves_meanwhile(store, gateways):
    a, _b = gateways
    h1 = a.env.connect(SUB, hostnqn=HOST_A, hostid=ID1, num_io_queues=1)
    store.hold = threading.Event()
    answers = []
    submit_register(h1, K1, answers)
    a.pump()
    assert store.calls.acquire(timeout=10)  # its call is on a thread, held
    for i in range(3):  # the loop serves: writes and reads of the same namespace, while the store is held
        done = []
        h1.submit_write(1, i, bytes([i + 1]) * 512, lambda c: done.append((c.status, None)))
        h1.submit_read(1, i, 1, lambda c: done.append((c.status, bytes(c.data or b""))))
        until([a], lambda: h1.poll_completions() >= 0 and len(done) == 2, "a write and a read")
        assert done == [(0, None), (0, bytes([i + 1]) * 512)]
    assert answers == []
    a.env.clock.advance(TIMEOUT)  # the bound, on the target's clock: the tick answers it
    a.target.tick(a.env.clock())
    h1.poll_completions(0.1)
    assert [c.status for c in answers] == [S.NS_NOT_READY]  # no DNR: the host may retry
    assert a.target.resv_sync.timed_out == 1
    store.hold.set()  # the store answers late: its change is not made (the command was answered)
    until([a], lambda: not a.target.resv_sync.jobs and store.decisions == 1, "the late call coming back")
    assert store.records == {}
    store.hold = None
    h1.resv_register(1, nrkey=K1)  # the host's retry
    assert a.resv.registrants == {HID1: K1}


def test_a_change_that_lands_after_its_command_timed_out_is_applied_when_it_comes_back(store, gateways):
    a, _b = gateways
    h1 = a.env.connect(SUB, hostnqn=HOST_A, hostid=ID1, num_io_queues=1)
    store.hold, store.hold_at = threading.Event(), "write"  # decided; the write is on its way
    answers = []
    submit_register(h1, K1, answers)
    a.pump()
    assert store.calls.acquire(timeout=10)
    a.env.clock.advance(TIMEOUT)
    a.target.tick(a.env.clock())
    h1.poll_completions(0.1)
    assert [c.status for c in answers] == [S.NS_NOT_READY]
    store.hold.set()
    until([a], lambda: a.resv.version == 1, "the late change applied")
    assert a.resv.registrants == {HID1: K1}
    with pytest.raises(NvmeStatusError) as again:  # the host's retry finds it registered (with that key: fine)
        h1.resv_register(1, nrkey=K2)
    assert again.value.status & S.CODE_MASK == S.RESERVATION_CONFLICT
    h1.resv_register(1, nrkey=K1)


def test_a_store_error_is_namespace_not_ready_and_a_fenced_gateway_ana_inaccessible(store, gateways):
    a, _b = gateways
    h1 = a.env.connect(SUB, hostnqn=HOST_A, hostid=ID1, num_io_queues=1)
    store.fail = StoreError("the cluster did not answer (ETIMEDOUT)")
    with pytest.raises(NvmeStatusError) as failed:
        h1.resv_register(1, nrkey=K1)
    assert failed.value.status == S.NS_NOT_READY
    store.fail = StoreError("blocklisted", fenced=True)
    with pytest.raises(NvmeStatusError) as failed:
        h1.resv_report(1)
    assert failed.value.status == S.ANA_INACCESSIBLE
    assert a.target.resv_sync.store_errors == 2 and store.records == {}


def test_a_gateway_starts_from_the_stores_records_and_offers_no_ptpl(store):
    store.records[(SUB, 1)] = {"registrants": [[HID2.hex(), K2]], "holder": HID2.hex(), "rtype": 1,
                               "generation": 3, "version": 7, "changes": []}
    gw = Gateway(store, records=dict(store.records))
    try:
        assert (gw.resv.holder, gw.resv.generation, gw.resv.version) == (HID2, 3, 7)
        h1 = gw.env.connect(SUB, hostnqn=HOST_A, hostid=ID1, num_io_queues=1)
        assert not h1.identify_namespace(1).rescap & I.RESCAP_PTPL
        with pytest.raises(NvmeStatusError) as refused:
            h1.resv_register(1, nrkey=K1, cptpl=R.CPTPL_SET)
        assert refused.value.status & S.CODE_MASK == S.INVALID_FIELD
        with pytest.raises(NvmeStatusError) as refused:  # Write Exclusive, held by host 2
            h1.write(1, 0, b"w" * 512)
        assert refused.value.status & S.CODE_MASK == S.RESERVATION_CONFLICT
    finally:
        gw.close()
