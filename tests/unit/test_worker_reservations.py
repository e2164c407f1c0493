"""Reservations under `serve --workers` (service/worker_resv.py): the supervisor keeps the records and answers a
change only once it is in force on every other worker.  The workers are loopback targets in this process, each with
its control socket (RUN_DIR/worker-I.sock) and the supervisor's store socket (RUN_DIR/reservations.sock) as `serve
--workers` gives them; the supervisor's store answers on its own threads.  A host's command through one worker
runs its loop in the test's thread while `serving(...)` runs the other workers' loops on a thread of their own: a
worker not served is a stopped one (SIGSTOP)."""
import contextlib
import json
import threading

import pytest

from held import hold
from loopback_env import ADDR1, HOST_A, HOST_B, file_ns, port, ram_ns
from test_workers import _Workers
from nvmeof_roce.errors import NvmeofError
from nvmeof_roce.nvme import identify as I
from nvmeof_roce.nvme import reservation as R
from nvmeof_roce.nvme import status as S
from nvmeof_roce.nvme.command import NVM_RESV_REGISTER, SQE
from nvmeof_roce.nvme.status import NvmeStatusError
from nvmeof_roce.control.protocol import RpcError
from nvmeof_roce.engine.reservations import file_for
from nvmeof_roce.service import worker_configs as wc
from nvmeof_roce.service import workers
from nvmeof_roce.service.worker_resv import attach_worker

SUB = "nqn.2024-01.io.test:mp-resv"
ID1 = "00000000-0000-4000-8000-0000000000a1"
ID2 = "00000000-0000-4000-8000-0000000000b2"
HID1, HID2 = (bytes.fromhex(i.replace("-", "")) for i in (ID1, ID2))
K1, K2 = 0x1111, 0x2222
RESV = {"enable": "1"}
NS_RAM, NS_FILE = 1, 2
TIMEOUT = 4.0  # the store's bound here (seconds): a worker not answering a push is killed after 0.4 of it
W0, W1 = "10.99.0.1:4420", "10.99.0.1:4421"


def config(tmp_path) -> dict:
    return {"hosts": [], "ports": [port(1, ADDR1, [SUB])],
            "subsystems": [{"nqn": SUB, "namespaces": [
                ram_ns(NS_RAM, resv=RESV), dict(file_ns(NS_FILE, tmp_path / "shared.img"), resv=RESV)]}]}


class ResvWorkers(_Workers):
    """Two workers attached to the supervisor's reservation store, as `serve --workers` starts them."""

    def __init__(self, tmp_path, monkeypatch):
        super().__init__(tmp_path, monkeypatch, config(tmp_path))
        self.sup.resv.timeout = TIMEOUT
        self.sup.serve_reservations()
        for i in range(len(self.envs)):
            attach_worker(self.envs[i].target, self.ops[i].control, self.sup.resv_socket, i, timeout=TIMEOUT)

    def restart(self, i):
        """Worker i died and starts again (from its config file, as the supervisor restarts it)."""
        from loopback_env import Env
        self.ops[i].close()
        self.envs[i].close()
        self.sup.resv.detach(i)
        env = Env(json.loads(open(self.sup.paths[i]).read()), file_lock="shared")
        self.envs[i] = env
        self.ops[i] = env.operations(self.sup.paths[i], rpc_socket=self.sup.sockets[i])
        attach_worker(env.target, self.ops[i].control, self.sup.resv_socket, i, timeout=TIMEOUT)

    def resv(self, i, nsid=NS_RAM):
        return self.envs[i].target.subsystems[SUB].namespaces[nsid].resv

    def in_force(self, i, nsid=NS_RAM):
        ns = self.envs[i].target.subsystems[SUB].namespaces[nsid]
        return self.envs[i].target.resv_sync.in_force(ns)

    def close(self):
        if self.sup.resv_server is not None:
            self.sup.resv_server.close()
        super().close()


@pytest.fixture
def w(tmp_path, monkeypatch):
    made = ResvWorkers(tmp_path, monkeypatch)
    yield made
    made.close()


@contextlib.contextmanager
def serving(*envs):
    """These workers' loops run on a thread while the block runs (a host's command through another worker)."""
    stop = threading.Event()

    def pump():
        while not stop.is_set():
            for env in envs:
                env.fabric.run_watched(0.005)
                env.fabric.pump()
    t = threading.Thread(target=pump)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def until(envs, done, what, rounds=2000):
    for _ in range(rounds):
        for env in envs:
            env.fabric.run_watched(0.005)
            env.fabric.pump()
        if done():
            return
    raise AssertionError(f"{what} did not happen")


def hosts(w):
    a = w.envs[0].connect(SUB, W0, hostnqn=HOST_A, hostid=ID1, num_io_queues=1)
    b = w.envs[1].connect(SUB, W1, hostnqn=HOST_B, hostid=ID2, num_io_queues=1)
    return a, b


def a_holds_with_a_write_held(w, a, b, i):
    """Host A (its queue on worker i) holds the file namespace Write Exclusive, host B is registered, and A has a
    Write held on worker i's device: what a preempt through the other worker meets.  Each change is made with the
    other worker's loop run, for it takes the change before the answer."""
    with serving(w.envs[1 - i]):
        a.resv_register(NS_FILE, nrkey=K1)
        a.resv_acquire(NS_FILE, R.WRITE_EXCLUSIVE, K1)
    with serving(w.envs[i]):
        b.resv_register(NS_FILE, nrkey=K2)
    device = hold(w.envs[i].target, SUB, NS_FILE, "write")
    written = []
    a.submit_write(NS_FILE, 0, b"1" * 4096, written.append)
    until([w.envs[i]], lambda: device.running >= 1, f"A's Write on worker {i}'s device")
    return device, written


def conflict(write):
    with pytest.raises(NvmeStatusError) as refused:
        write()
    return refused.value.status & S.CODE_MASK == S.RESERVATION_CONFLICT


def summary(report):
    return report.generation, report.rtype, [(r.hostid, r.rkey, r.holds) for r in report.registrants]


def test_a_reservation_made_through_one_worker_is_every_workers(w):
    a, b = hosts(w)
    with serving(w.envs[1]):
        a.resv_register(NS_RAM, nrkey=K1)
        a.resv_acquire(NS_RAM, R.WRITE_EXCLUSIVE, K1)
    # answered: worker 1 has it in force already (its loop was not run since)
    assert w.resv(1).holder == HID1 and w.in_force(1) == w.resv(1).version == 2
    with serving(w.envs[1]):
        through_0 = summary(a.resv_report(NS_RAM))
    with serving(w.envs[0]):
        through_1 = summary(b.resv_report(NS_RAM))
    assert through_0 == through_1 == (1, R.WRITE_EXCLUSIVE, [(HID1, K1, True)])
    assert conflict(lambda: b.write(NS_RAM, 0, b"b" * 512))  # host B through worker 1: Write Exclusive, A's
    assert b.read(NS_RAM, 0, 1) == bytes(512)
    a.write(NS_RAM, 0, b"a" * 512)  # the holder writes through worker 0
    assert w.sup.resv.records[(SUB, NS_RAM)]["version"] == 2


def test_a_preempt_is_in_force_on_every_worker_before_it_is_answered(w):
    """Host A holds the namespace and has a Write on worker 0's device; host B preempts it through worker 1.
    The Preempt is answered only once worker 0 has the change in force: restored (A's new commands conflict) and
    fenced (A's Write from before gone).  The device is released once worker 0 has the new state: had the
    supervisor answered before its push, worker 0 would still have A as the holder at the answer."""
    a, b = hosts(w)
    device, written = a_holds_with_a_write_held(w, a, b, 0)
    released = []

    def release_once_restored():  # the push reached worker 0: its fence waits for the Write
        for _ in range(2000):
            if w.resv(0, NS_FILE).holder == HID2:
                released.append(w.in_force(0, NS_FILE) < w.resv(0, NS_FILE).version)
                device.release.set()
                return
            threading.Event().wait(0.005)
    releaser = threading.Thread(target=release_once_restored)
    releaser.start()
    with serving(w.envs[0]):
        b.resv_acquire(NS_FILE, R.WRITE_EXCLUSIVE, K2, action=R.PREEMPT_AND_ABORT, prkey=K1)
    releaser.join()
    # at the answer: worker 0 applied it, was fenced while the Write was on the device, and it is in force now
    assert released == [True]
    assert w.resv(0, NS_FILE).holder == HID2 and w.in_force(0, NS_FILE) == w.resv(0, NS_FILE).version
    assert device.running == 0
    assert conflict(lambda: a.write(NS_FILE, 8, b"2" * 4096))  # A's new Write on worker 0
    until([w.envs[0]], lambda: a.poll_completions() >= 0 and written, "A's held Write's answer")
    assert written[0].status == 0  # it started before the preempt: it completed, before the answer


def test_concurrent_registers_through_two_workers_both_land(w):
    """Both workers read the empty record before either writes: one compare-and-swap fails and its Register
    is decided again on the record with the other host: no update lost."""
    a, b = hosts(w)
    both_read = threading.Barrier(2, timeout=10)
    for env in w.envs:
        store = env.target.resv_sync.store
        real = store.read

        def read(nqn, nsid, real=real, store=store):
            record = real(nqn, nsid)
            if store.update_reads is not None:
                store.update_reads.wait()
            return record
        store.read, store.update_reads = read, both_read
    mismatches = []
    real_cas = w.sup.resv.cas

    def cas(worker, key, expected, record):
        answer = real_cas(worker, key, expected, record)
        mismatches.append(not answer["ok"])
        return answer
    w.sup.resv.cas = cas
    answers = []
    for host, key in ((a, K1), (b, K2)):
        sqe = SQE(opc=NVM_RESV_REGISTER, nsid=NS_RAM, cdw10=R.register_cdw10(R.REGISTER))
        host.submit_io(sqe, answers.append, data_out=R.KEYS.pack(0, key))
    until(w.envs, lambda: [h.poll_completions() for h in (a, b)] and len(answers) == 2, "both Registers answered")
    assert [c.status for c in answers] == [0, 0]
    assert sorted(mismatches) == [False, False, True]  # one decided twice
    record = w.sup.resv.records[(SUB, NS_RAM)]
    assert sorted(h for h, _k in record["registrants"]) == sorted([HID1.hex(), HID2.hex()])
    assert record["generation"] == 2 and record["version"] == 2
    assert w.resv(0).registrants == w.resv(1).registrants == {HID1: K1, HID2: K2} or \
        w.resv(0).registrants == w.resv(1).registrants == {HID2: K2, HID1: K1}


def test_a_worker_restarted_starts_with_every_record(w):
    a, _b = hosts(w)
    with serving(w.envs[1]):
        a.resv_register(NS_RAM, nrkey=K1)
        a.resv_acquire(NS_RAM, R.EXCLUSIVE_ACCESS, K1)
    w.restart(1)
    assert (w.resv(1).holder, w.resv(1).rtype, w.resv(1).version) == (HID1, R.EXCLUSIVE_ACCESS, 2)
    b = w.envs[1].connect(SUB, W1, hostnqn=HOST_B, hostid=ID2, num_io_queues=1)
    assert conflict(lambda: b.read(NS_RAM, 0, 1))  # Exclusive Access: not even a read for B
    with serving(w.envs[1]):  # a change after the restart reaches the new worker too
        a.resv_release(NS_RAM, R.EXCLUSIVE_ACCESS, K1)
    assert w.resv(1).holder is None and w.in_force(1) == 3
    assert b.read(NS_RAM, 0, 1) == bytes(512)


def test_a_worker_that_does_not_take_a_change_is_killed_and_the_change_answered(w):
    """Worker 1 stopped (its loop not run): the push gets no answer within 0.4 x the bound, the supervisor
    kills it (here: the kill recorded, the worker then restarted by the test), and A's Register through worker 0
    is answered once worker 1 is gone; worker 0 serves all along; the restarted worker has the record."""
    a, _b = hosts(w)
    killed = []

    def fence(i, timeout):
        killed.append(i)
        return True
    w.sup.resv.fence = fence
    a.resv_register(NS_RAM, nrkey=K1)  # worker 1 never runs meanwhile
    assert killed == [1] and w.sup.resv.killed == 1 and w.sup.resv.attached == {0}
    assert w.resv(1).registrants == {}  # the stopped worker never got it: it is dead (restarted below)
    a.write(NS_RAM, 0, b"a" * 512)
    w.restart(1)
    assert w.resv(1).registrants == {HID1: K1}
    with serving(w.envs[1]):  # and it takes the next change as any worker
        a.resv_acquire(NS_RAM, R.WRITE_EXCLUSIVE, K1)
    assert killed == [1] and w.resv(1).holder == HID1


def test_a_change_not_in_force_on_a_worker_in_time_is_answered_not_ready(w):
    """Worker 1 restores B's preemption at once but its fence waits for A's Write held on its device past the
    bound: B's Preempt through worker 0 is answered Namespace Not Ready (no DNR) within the bound; the change is
    made (every worker refuses A's new writes), the fence ends when the Write does, and both workers go on
    serving."""
    b = w.envs[0].connect(SUB, W0, hostnqn=HOST_B, hostid=ID2, num_io_queues=1)
    a = w.envs[1].connect(SUB, W1, hostnqn=HOST_A, hostid=ID1, num_io_queues=1)
    device, written = a_holds_with_a_write_held(w, a, b, 1)
    with serving(w.envs[1]):
        with pytest.raises(NvmeStatusError) as failed:
            b.resv_acquire(NS_FILE, R.WRITE_EXCLUSIVE, K2, action=R.PREEMPT, prkey=K1)
    assert failed.value.status == S.NS_NOT_READY  # generic, no DNR: the host may retry
    assert w.envs[0].target.resv_sync.store_errors == 1 and w.sup.resv.killed == 0
    record = w.sup.resv.records[(SUB, NS_FILE)]
    assert record["holder"] == HID2.hex()  # made
    until([w.envs[0]], lambda: w.resv(0, NS_FILE).holder == HID2, "worker 0 applying the change made")
    assert w.resv(1, NS_FILE).holder == HID2 and w.in_force(1, NS_FILE) < w.resv(1, NS_FILE).version
    device.release.set()
    until([w.envs[1]], lambda: a.poll_completions() >= 0 and written and
          w.in_force(1, NS_FILE) == w.resv(1, NS_FILE).version, "the Write done and the change in force")
    assert conflict(lambda: a.write(NS_FILE, 8, b"2" * 4096))
    with serving(w.envs[1]):  # the retry's Report shows the change; both workers keep serving
        assert summary(b.resv_report(NS_FILE))[1:] == (R.WRITE_EXCLUSIVE, [(HID2, K2, True)])
        b.write(NS_FILE, 0, b"b" * 4096)


def test_workers_do_not_offer_ptpl(w):
    a, _b = hosts(w)
    assert not a.identify_namespace(NS_RAM).rescap & I.RESCAP_PTPL
    with serving(w.envs[1]):
        with pytest.raises(NvmeStatusError) as refused:
            a.resv_register(NS_RAM, nrkey=K1, cptpl=R.CPTPL_SET)
    assert refused.value.status & S.CODE_MASK == S.INVALID_FIELD
    assert w.sup.resv.records == {}


def test_a_removed_namespace_or_reservations_off_drop_its_record(w):
    a, _b = hosts(w)
    with serving(w.envs[1]):
        a.resv_register(NS_RAM, nrkey=K1)
        a.resv_register(NS_FILE, nrkey=K1)
        a.resv_register(NS_FILE, action=R.UNREGISTER, crkey=K1)
    assert set(w.sup.resv.records) == {(SUB, NS_RAM), (SUB, NS_FILE)}
    w.call("nvmeof_ns_set_reservation", {"nqn": SUB, "nsid": NS_FILE, "enable": False})
    assert set(w.sup.resv.records) == {(SUB, NS_RAM)}
    data = json.loads(w.config_path.read_text())
    data["subsystems"][0]["namespaces"] = [n for n in data["subsystems"][0]["namespaces"] if n["nsid"] != NS_RAM]
    w.config_path.write_text(json.dumps(data))
    w.run(lambda: w.sup.reload())
    assert w.sup.resv.records == {}


def test_the_workers_store_method_is_not_a_control_method(w):
    with pytest.raises(RpcError) as refused:
        w.sup.control.call("nvmeof_worker_reservations", {"records": []})
    assert refused.value.code == -32601
    assert "nvmeof_worker_reservations" not in w.call("rpc_get_methods")


def test_serve_workers_refuses_reservations_kept_through_power_loss(tmp_path, monkeypatch):
    """A single process's reservation file with a PTPL reservation: serve --workers cannot restore it."""
    monkeypatch.setattr(wc, "SHM_DIR", str(tmp_path))
    path = tmp_path / "c.json"
    path.write_text(json.dumps(config(tmp_path)))
    workers.Supervisor(str(path), 2, cpus=None, run_dir=str(tmp_path / "run"), ready_file=None, worker_args=[])
    kept = file_for(str(path))
    with open(kept, "w") as f:
        json.dump({"version": 1, "reservations": {SUB: {"1": {"registrants": [[HID1.hex(), K1]], "ptpl": True}}}}, f)
    with pytest.raises(NvmeofError) as refused:
        workers.Supervisor(str(path), 2, cpus=None, run_dir=str(tmp_path / "run2"), ready_file=None,
                           worker_args=[])
    assert kept in refused.value.message and f"{SUB} namespace 1" in refused.value.message
    assert "without --workers" in refused.value.fix and "remove the file" in refused.value.fix
    with open(kept, "w") as f:  # nothing kept any more (PTPL cleared): served
        json.dump({"version": 1, "reservations": {}}, f)
    workers.Supervisor(str(path), 2, cpus=None, run_dir=str(tmp_path / "run3"), ready_file=None, worker_args=[])
