"""The native data path's latency histograms and poll modes (csrc/nq_hot.c, transport/rdma/native_queue.py), through the
fake verbs provider (tests/native/fakeprov.c)."""
import logging
import random

import pytest

from loopback_env import SUB_RAM, standard_config
from native_diff import LoopbackEndpoint, NativeEndpoint, close_all, io_capsule
from native_fake import needs_native, pump

from nvmeof_roce import native
from nvmeof_roce.control.stats import target_status
from nvmeof_roce.engine.latency import BUCKET_BOUNDS_US, LatencyHistogram

pytestmark = needs_native

READ, WRITE, FLUSH = 0x02, 0x01, 0x00


def _python_bucket(ns: int) -> int:
    h = LatencyHistogram()
    h.record_ns(ns)
    return h.counts.index(1)


def test_the_native_bucket_of_a_latency_is_the_python_histograms():
    values = set(range(0, 2100)) | {(1 << 62), (1 << 64) - 1}
    for bound in BUCKET_BOUNDS_US:  # each bound's neighbours in ns
        edge = int(bound * 1000)
        values |= {edge - 1, edge, edge + 1}
    rng = random.Random(5)
    values |= {rng.randrange(1 << 40) for _ in range(5000)}
    wrong = [(ns, _python_bucket(ns), native.module.latency_bucket(ns)) for ns in sorted(values)
             if _python_bucket(ns) != native.module.latency_bucket(ns)]
    assert not wrong
    assert native.module.LATENCY_BUCKETS == len(LatencyHistogram().counts)


def _io(ep, count: int) -> None:
    for i in range(count):
        for cqe in ep.exchange(io_capsule(ep, WRITE, 1, 8 * i, 7, 4096, offset=4096 * i, cid=2 * i)):
            assert cqe[14:16] == b"\0\0"
        for cqe in ep.exchange(io_capsule(ep, READ, 1, 8 * i, 7, 4096, offset=65536 + 4096 * i, cid=2 * i + 1)):
            assert cqe[14:16] == b"\0\0"
    ep.exchange(io_capsule(ep, FLUSH, 1, 0, 0, 0, cid=999))  # not a latency of either histogram


def test_native_commands_show_up_in_the_namespace_latencies_and_status():
    python = native_ep = None
    try:
        native_ep = NativeEndpoint(standard_config(), SUB_RAM)
        python = LoopbackEndpoint(standard_config(), SUB_RAM)
        before = native_ep.queue.stats()
        _io(native_ep, 20)
        _io(python, 20)
        assert native_ep.queue.stats()["native_commands"] - before["native_commands"] == 41
        native_ep.env.target.tick(native_ep.env.clock())  # the core collects the native figures
        seen = {}
        for name, ep in (("native", native_ep), ("python", python)):
            ns = ep.env.target.subsystem(SUB_RAM).namespaces[1]
            assert (ns.stats.read_latency.total, ns.stats.write_latency.total) == (20, 20), name
            assert ns.stats.read_latency.sum_us > 0 and ns.stats.write_latency.sum_us > 0, name
            status = next(s for s in target_status(ep.env.target)["subsystems"] if s["nqn"] == SUB_RAM)
            lat = status["namespaces"][0]["read_latency_us"], status["namespaces"][0]["write_latency_us"]
            seen[name] = lat
            for percentiles in lat:
                # a bucket bound between 1 us and 1 s: plausible for a command served in this process
                assert all(v is not None and 1.0 <= v <= 1e6 for v in percentiles.values()), (name, percentiles)
        # the histograms were drained into the namespace once: a second tick adds nothing
        native_ep.env.target.tick(native_ep.env.clock())
        ns = native_ep.env.target.subsystem(SUB_RAM).namespaces[1]
        assert (ns.stats.read_latency.total, ns.stats.write_latency.total) == (20, 20)
    finally:
        close_all(python, native_ep)


def test_a_failed_native_write_records_no_latency():
    ep = NativeEndpoint(standard_config(), SUB_RAM)
    try:
        ns = ep.env.target.subsystem(SUB_RAM).namespaces[1]
        target = ep.env.target
        # the Write's RDMA READ is in flight when its namespace leaves: Invalid Namespace, no latency
        assert ep.device.deliver(io_capsule(ep, WRITE, 1, 0, 7, 4096, cid=5)) == 0
        assert ep.queue.poll() == 1  # the capsule: its RDMA READ posted
        ep.queue.native.set_view(True, ep.queue.max_transfer, [], sq_entries=32)
        pump(ep.queue)
        (cqe, _inv), = ep.device.responses()
        assert int.from_bytes(cqe[14:16], "little") >> 1 == 0x400B
        target.tick(ep.env.clock())
        assert ns.stats.write_latency.total == 0
    finally:
        ep.close()


# -- poll modes

def _status(cqe: bytes) -> int:
    return int.from_bytes(cqe[14:16], "little") >> 1


@pytest.fixture
def busy_ep():
    from nvmeof_roce.transport.eventloop import EventLoop
    ep = NativeEndpoint(standard_config(), SUB_RAM)
    loop = EventLoop(ep.env.target)
    timeouts = []
    select = loop.selector.select

    def recording_select(timeout=None):
        timeouts.append(timeout)
        return select(timeout)

    loop.selector.select = recording_select
    ep.loop, ep.timeouts = loop, timeouts
    yield ep
    ep.close()
    loop.close()


def test_busy_poll_serves_native_and_core_commands_with_no_channel_event(busy_ep):
    ep, loop = busy_ep, busy_ep.loop
    arms = ep.device.counters()["arms"]
    before = ep.queue.stats()
    ep.queue.start_polling(loop, "busy")  # no completion channel is watched: the fake has none to signal
    ep.device.deliver(io_capsule(ep, WRITE, 1, 0, 7, 4096, offset=8192, cid=1))
    ep.device.deliver(io_capsule(ep, READ, 1, 0, 7, 4096, offset=0, cid=2))
    ep.device.deliver(io_capsule(ep, READ, 9, 0, 7, 4096, offset=0, cid=3))  # no NSID 9: the core answers
    for _ in range(8):
        loop.run_once(30.0)  # would sleep 30 s per pass if it waited for an event
    ep.env.fabric.pump()
    cqes = {int.from_bytes(c[12:14], "little"): _status(c) for c, _inv in ep.device.responses()}
    assert cqes == {1: 0, 2: 0, 3: 0x400B}  # Invalid Namespace | DNR from the core
    assert ep.host_bytes()[:4096] == ep.host_bytes()[8192:8192 + 4096]
    after = ep.queue.stats()
    assert (after["native_commands"] - before["native_commands"],
            after["python_commands"] - before["python_commands"]) == (2, 1)
    assert ep.device.counters()["arms"] == arms  # the CQs were never armed
    assert set(ep.timeouts) == {0}  # every pass selected without waiting
    ep.queue.close()
    loop.run_once(0)  # the closed queue leaves the loop's pollers
    ep.timeouts.clear()
    loop.run_once(0.01)
    assert ep.timeouts == [0.01]  # nothing busy left: the loop sleeps on its fds again


def test_interrupt_mode_arms_the_cqs_and_waits_for_their_channel(busy_ep):
    ep, loop = busy_ep, busy_ep.loop
    arms = ep.device.counters()["arms"]
    ep.queue.start_polling(loop, "interrupt", channels=())
    assert ep.device.counters()["arms"] > arms
    ep.device.deliver(io_capsule(ep, READ, 1, 0, 7, 4096, offset=0, cid=2))
    loop.run_once(0.01)
    assert ep.device.responses() == [] and ep.timeouts == [0.01]  # nothing polls without a channel event


def _cids(ep) -> dict:
    return {int.from_bytes(c[12:14], "little"): _status(c) for c, _inv in ep.device.responses()}


def test_adaptive_poll_arms_the_cqs_once_its_spin_finds_nothing(busy_ep):
    ep = busy_ep
    before, arms, polls = ep.queue.stats(), ep.device.counters()["arms"], ep.device.counters()["polls"]
    ep.device.deliver(io_capsule(ep, READ, 1, 0, 7, 4096, offset=0, cid=2))
    done, armed = ep.queue.poll_adaptive(spin_us=200)
    assert done >= 1 and armed
    assert _cids(ep) == {2: 0}
    after = ep.queue.stats()
    assert ep.device.counters()["arms"] - arms == after["arms"] - before["arms"] == 1  # one CQ (shared), armed once
    assert ep.device.counters()["polls"] - polls > 3  # it kept polling before it armed
    # each empty poll of the spin gave the CPU away (a submitter sharing it must not wait for the bound)
    assert 0 < after["spin_yields"] - before["spin_yields"] < ep.device.counters()["polls"] - polls
    polling = ep.queue.polling_status()  # what `target status --json` shows for the queue
    counts = ("spin_hits", "spin_yields", "arms", "arm_catches", "polls")
    assert {k: polling[k] for k in counts} == {k: after[k] for k in counts}
    assert polling["mode"] is None and polling["poll_group"] is False  # polled by hand here, not by a loop
    assert after["arm_catches"] == before["arm_catches"]  # the spin found everything there was
    # nothing came: an event with no completion (a spurious one) arms at once, without spinning
    polls = ep.device.counters()["polls"]
    assert ep.queue.poll_adaptive(spin_us=100000) == (0, True)
    assert ep.device.counters()["polls"] - polls == 2  # one poll, the arm, the poll after the arm


def test_adaptive_poll_serves_the_next_command_it_finds_while_spinning(busy_ep):
    ep = busy_ep
    before, arms = ep.queue.stats(), ep.device.counters()["arms"]
    ep.device.deliver(io_capsule(ep, WRITE, 1, 0, 7, 4096, offset=8192, cid=1))
    ep.device.stage(io_capsule(ep, READ, 1, 0, 7, 4096, offset=0, cid=2), polls=6)  # lands during the spin
    done, armed = ep.queue.poll_adaptive(spin_us=100000)  # a bound far longer than six polls take
    assert armed and not ep.device.staged()
    assert _cids(ep) == {1: 0, 2: 0}  # both answered in the one call, the second without an event
    assert ep.host_bytes()[:4096] == ep.host_bytes()[8192:8192 + 4096]
    after = ep.queue.stats()
    assert after["spin_hits"] - before["spin_hits"] >= 1
    assert ep.device.counters()["arms"] - arms == 1  # armed once, after the second command's spin


def test_adaptive_poll_never_loses_a_completion_that_lands_just_before_the_arm(busy_ep):
    ep = busy_ep
    before = ep.queue.stats()
    ep.device.deliver(io_capsule(ep, READ, 1, 0, 7, 4096, offset=0, cid=5))
    ep.device.stage(io_capsule(ep, READ, 1, 0, 7, 4096, offset=4096, cid=6), polls=0)  # at the arm: no event
    done, armed = ep.queue.poll_adaptive(spin_us=1)
    assert armed and not ep.device.staged()
    ep.device.release()  # the wire delivers the response that poll posted
    assert _cids(ep) == {5: 0, 6: 0}  # the poll after the arm found it
    assert ep.queue.stats()["arm_catches"] - before["arm_catches"] == 1


def test_adaptive_poll_does_not_arm_before_its_budget_is_spent(busy_ep):
    ep = busy_ep
    arms = ep.device.counters()["arms"]
    for cid in range(4):
        ep.device.deliver(io_capsule(ep, READ, 1, 0, 7, 4096, offset=0, cid=cid))
    done, armed = ep.queue.poll_adaptive(spin_us=100000, budget=2)
    assert done >= 2 and not armed  # the caller polls again before it sleeps
    assert ep.device.counters()["arms"] == arms
    while not armed:
        _done, armed = ep.queue.poll_adaptive(spin_us=1, budget=2)
    ep.env.fabric.pump()
    assert _cids(ep) == {0: 0, 1: 0, 2: 0, 3: 0}
    with pytest.raises(ValueError, match="budget must be at least 1"):
        ep.queue.native.poll_adaptive(0, 10)


def test_adaptive_mode_arms_and_watches_the_channels_as_interrupt_mode(busy_ep):
    ep, loop = busy_ep, busy_ep.loop
    arms = ep.device.counters()["arms"]
    ep.queue.start_polling(loop, "adaptive", channels=())
    assert ep.device.counters()["arms"] > arms and ep.queue.poll_mode == "adaptive"
    ep.device.deliver(io_capsule(ep, READ, 1, 0, 7, 4096, offset=0, cid=2))
    loop.run_once(0.01)
    assert ep.device.responses() == [] and ep.timeouts == [0.01]  # asleep until a channel event, as interrupt


def test_serve_takes_poll_spin_us_only_with_poll_adaptive():
    from nvmeof_roce.cli import build_parser
    from nvmeof_roce.errors import NvmeofError
    from nvmeof_roce.service.serve import check_poll, check_poll_spin, native_poll_text
    from nvmeof_roce.tunables import POLL_SPIN_US
    assert check_poll("adaptive", "native") == "adaptive"
    with pytest.raises(NvmeofError, match="--poll adaptive needs the native data path"):
        check_poll("adaptive", "python")
    assert check_poll_spin(None, "interrupt") == POLL_SPIN_US.default
    assert check_poll_spin(50, "adaptive") == 50
    with pytest.raises(NvmeofError, match="--poll-spin-us 50 bounds an adaptive poll's spin") as err:
        check_poll_spin(50, "busy")
    assert "--poll adaptive" in err.value.fix
    with pytest.raises(NvmeofError, match="--poll-spin-us 0: out of range"):
        check_poll_spin(0, "adaptive")
    args = build_parser().parse_args(["target", "serve", "x.json", "--poll", "adaptive", "--poll-spin-us", "50"])
    assert (args.poll, args.poll_spin_us) == ("adaptive", 50)
    assert native_poll_text("adaptive", 1, 50) == " (adaptive poll, spin 50 µs)"


def test_serve_cpus_without_workers_pins_the_process(tmp_path):
    # `serve --cpus` was taken and ignored without --workers; it pins the one process now (and its threads)
    import os
    from types import SimpleNamespace
    from nvmeof_roce.errors import NvmeofError
    from nvmeof_roce.service.serve import pin_process
    allowed = os.sched_getaffinity(0)
    first = min(allowed)
    config = SimpleNamespace(userspace={}, source="t.json")
    try:
        assert pin_process(str(first), config) == [first]
        assert os.sched_getaffinity(0) == {first}
        os.sched_setaffinity(0, allowed)
        assert pin_process(None, SimpleNamespace(userspace={"cpus": [first]}, source="t.json")) == [first]
        assert os.sched_getaffinity(0) == {first}  # the config's nvmeof_roce.cpus alike
        os.sched_setaffinity(0, allowed)
        assert pin_process(None, config) is None and os.sched_getaffinity(0) == allowed
        outside = max(allowed) + 1
        with pytest.raises(NvmeofError, match=f"may not run on CPU\\(s\\) {outside}") as err:
            pin_process(f"{first},{outside}", config)
        assert os.sched_getaffinity(0) == allowed  # refused whole, nothing pinned
        assert str(first) in err.value.fix
    finally:
        os.sched_setaffinity(0, allowed)


def test_serve_takes_poll_busy_only_with_the_native_data_path():
    from nvmeof_roce.cli import build_parser
    from nvmeof_roce.errors import NvmeofError
    from nvmeof_roce.service.serve import check_poll
    from nvmeof_roce.tunables import POLL
    assert check_poll("busy", "native") == "busy" and check_poll("interrupt", "python") == "interrupt"
    with pytest.raises(NvmeofError, match="--poll busy needs the native data path") as err:
        check_poll("busy", "python")
    assert "--data-path native" in err.value.fix
    with pytest.raises(NvmeofError, match="--poll spin: not a choice"):
        check_poll("spin", "native")
    parser = build_parser()
    assert parser.parse_args(["target", "serve", "x.json"]).poll == POLL.default == "interrupt"
    assert parser.parse_args(["target", "serve", "x.json", "--poll", "busy"]).poll == "busy"


def test_target_status_and_the_status_line_say_busy_poll(busy_ep):
    from types import SimpleNamespace
    from nvmeof_roce.control.commands import _data_path
    from nvmeof_roce.service.serve import TargetServer
    served = SimpleNamespace(data_path="native", data_path_reason="", poll="busy", cores=1, listeners=[],
                             loop=SimpleNamespace(longest_pass=0.0), transport_options=dict)  # stats.Served
    status = target_status(busy_ep.env.target, server=served)
    assert (status["data_path"], status["poll"]) == ("native", "busy")
    assert _data_path(status) == "native, busy poll"
    assert _data_path({"data_path": "python", "poll": "interrupt"}) == "python"
    server = SimpleNamespace(target=busy_ep.env.target, loop=busy_ep.loop, listeners=[], data_path="native",
                             poll="busy", cores=1, poll_spin_us=200)
    line = TargetServer.status_line(server)
    assert line.startswith("status: ") and "; data path native (busy poll); " in line
    server.cores = 2
    assert "; data path native (busy poll, 2 poll-group threads); " in TargetServer.status_line(server)
    server.poll, server.cores = "adaptive", 1
    assert "; data path native (adaptive poll, spin 200 µs); " in TargetServer.status_line(server)
    assert _data_path({"data_path": "native", "poll": "busy", "cores": 2}) == "native, busy poll, 2 poll-group threads"


# -- poll groups (--cores): queues polled by threads without the GIL

def _await(loop, eps, want: dict, limit: float = 60.0) -> dict:
    """Run the loop until every endpoint got `want[ep]` responses; {ep: [cqe, ...]} (a hang guard, no timing)."""
    import time
    got = {ep: [] for ep in eps}
    deadline = time.monotonic() + limit
    while any(len(got[ep]) < want[ep] for ep in eps):
        assert time.monotonic() < deadline, {id(ep): len(v) for ep, v in got.items()}
        loop.run_once(0.01)
        for ep in eps:
            ep.env.fabric.pump()  # the target's own work (a Write Zeroes in slices) runs on the loopback's loop
            got[ep] += [cqe for cqe, _inv in ep.device.responses()]
    return got


@pytest.fixture
def grouped():
    from nvmeof_roce.transport.eventloop import EventLoop
    from nvmeof_roce.transport.rdma.pollgroups import PollGroups
    eps = [NativeEndpoint(standard_config(), SUB_RAM) for _ in range(4)]
    loop = EventLoop(eps[0].env.target)
    groups = PollGroups(native.module, 2)
    for ep in eps:
        ep.queue.start_polling(loop, "busy", poll_groups=groups)
    yield eps, loop, groups
    for ep in eps:
        ep.close()
    groups.close()
    loop.close()


def test_poll_group_threads_serve_many_queues_with_correct_cqes_and_data(grouped):
    eps, loop, groups = grouped
    assert [g["queues"] for g in groups.status()] == [2, 2]  # round-robin
    before = {ep: ep.queue.stats() for ep in eps}
    per_round, rounds = 16, 4
    for r in range(rounds):  # writes: host offset k*4 KiB -> LBA k*8
        for ep in eps:
            for i in range(per_round):
                k = r * per_round + i
                assert ep.device.deliver(io_capsule(ep, WRITE, 1, 8 * k, 7, 4096, offset=4096 * k, cid=k)) == 0
        got = _await(loop, eps, {ep: per_round for ep in eps})
        for ep in eps:
            assert sorted(int.from_bytes(c[12:14], "little") for c in got[ep]) == list(
                range(r * per_round, (r + 1) * per_round))
            assert all(c[14:16] == b"\0\0" and int.from_bytes(c[10:12], "little") == 1 for c in got[ep])
    written = rounds * per_round * 4096
    for r in range(rounds):  # reads back into host offset 512 KiB + k*4 KiB
        for ep in eps:
            for i in range(per_round):
                k = r * per_round + i
                ep.device.deliver(io_capsule(ep, READ, 1, 8 * k, 7, 4096, offset=524288 + 4096 * k, cid=1000 + k))
        got = _await(loop, eps, {ep: per_round for ep in eps})
        assert all(c[14:16] == b"\0\0" for ep in eps for c in got[ep])
    for ep in eps:
        host = ep.host_bytes()
        assert host[524288:524288 + written] == host[:written]
        assert ep.namespace_bytes(SUB_RAM, 1)[:written] == host[:written]
    # the core's commands on the same queues: an unknown NSID, a Write Zeroes (not native) of LBA 0-7, and a
    # fabrics Property Get, which belongs on the admin queue: answered as the Python data path answers it
    from nvmeof_roce.nvme.fabrics import PropertyGet
    property_get = PropertyGet(cid=7003, offset=0x14).to_sqe().pack()
    python = LoopbackEndpoint(standard_config(), SUB_RAM)
    try:
        (expected,) = python.exchange(property_get)
    finally:
        close_all(python)
    for ep in eps:
        ep.device.deliver(io_capsule(ep, READ, 9, 0, 7, 4096, cid=7001))
        ep.device.deliver(io_capsule(ep, 0x08, 1, 0, 7, 0, cid=7002))
        ep.device.deliver(property_get)
    got = _await(loop, eps, {ep: 3 for ep in eps})
    for ep in eps:
        statuses = {int.from_bytes(c[12:14], "little"): int.from_bytes(c[14:16], "little") >> 1 for c in got[ep]}
        assert statuses == {7001: 0x400B, 7002: 0, 7003: int.from_bytes(expected[14:16], "little") >> 1}
        assert statuses[7003] != 0  # Invalid Namespace | DNR; success; the fabrics error
        assert ep.namespace_bytes(SUB_RAM, 1)[:4096] == bytes(4096)
        after = ep.queue.stats()
        assert after["threaded"] == 1
        assert after["native_commands"] - before[ep]["native_commands"] == 2 * rounds * per_round
        assert after["python_commands"] - before[ep]["python_commands"] == 3
        with pytest.raises(RuntimeError, match="poll group"):
            ep.queue.native.poll()  # only its thread polls it
    assert all(g["busy_passes"] > 0 for g in groups.status())  # both threads served commands
    # the latencies and counters still reach the namespaces
    eps[0].env.target.tick(eps[0].env.clock())
    ns = eps[0].env.target.subsystem(SUB_RAM).namespaces[1]
    assert (ns.stats.write_latency.total, ns.stats.read_latency.total) == (rounds * per_round, rounds * per_round)


def test_closing_a_queue_while_its_thread_polls_stops_every_poll_of_it(grouped):
    import time
    eps, loop, groups = grouped
    victim, other = eps[0], eps[2]  # both on the first group
    for k in range(16):
        victim.device.deliver(io_capsule(victim, READ, 1, 8 * k, 7, 4096, offset=4096 * k, cid=k))
        other.device.deliver(io_capsule(other, READ, 1, 8 * k, 7, 4096, offset=4096 * k, cid=k))
    victim.queue.close()  # while the thread may be polling it: waits for that poll, then never again
    assert victim.queue.native.stats()["threaded"] == 1 and victim.queue.poll_group is None
    assert [g["queues"] for g in groups.status()] == [1, 2]
    polls = victim.device.counters()["polls"]
    got = _await(loop, [other], {other: 16})  # the group's thread goes on with its other queue
    assert all(c[14:16] == b"\0\0" for c in got[other])
    time.sleep(0.05)
    assert victim.device.counters()["polls"] == polls
    assert victim.queue.native.drain() == 0  # nothing is delivered for a stopped queue
    eps.remove(victim)
    victim.close()


def test_a_failure_on_a_thread_polled_queue_reaches_the_core(grouped):
    eps, loop, groups = grouped
    ep = eps[1]
    ep.device.deliver(io_capsule(ep, READ, 1, 0, 7, 4096, bad_key=True, cid=3))  # the RDMA WRITE fails
    import time
    deadline = time.monotonic() + 60
    while not ep.queue.closed:
        assert time.monotonic() < deadline
        loop.run_once(0.01)
    assert ep.queue.poll_group is None  # the failure closed the queue, which left its group
    assert [g["queues"] for g in groups.status()] == [2, 1]


def test_serve_refuses_cores_it_cannot_honour(monkeypatch):
    import os
    from nvmeof_roce.cli import build_parser
    from nvmeof_roce.errors import NvmeofError
    from nvmeof_roce.service.serve import check_cores
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert check_cores(1, "python", "interrupt") == 1 and check_cores(2, "native", "busy") == 2
    for data_path, poll in (("python", "interrupt"), ("native", "interrupt")):
        with pytest.raises(NvmeofError, match="--cores 2 needs the native data path with busy polling") as err:
            check_cores(2, data_path, poll)
        assert "--data-path native --poll busy" in err.value.fix
    with pytest.raises(NvmeofError, match="--cores 3: this process may run on 2 CPU") as err:
        check_cores(3, "native", "busy")
    assert "--cores 2 or fewer" in err.value.fix
    with pytest.raises(NvmeofError, match="--cores 0: out of range"):
        check_cores(0, "native", "busy")
    assert build_parser().parse_args(["target", "serve", "x.json", "--cores", "2"]).cores == 2


def test_the_bench_measures_the_native_poll_modes_side_by_side(tmp_path):
    import argparse
    from nvmeof_roce.bench.commands import build_targets
    args = argparse.Namespace(targets="kernel,native,native-busy,native-busy-2c", traddr="10.99.0.1",
                              kernel_port=4420, userspace_port=4421, baseline_port=4422, kernel_backend=None,
                              ns_size="64M", userspace_config=None, baseline_checkout=None, device="ram")
    kernel, interrupt, busy, cores = build_targets(args, tmp_path)
    assert {t.data_path for t in (interrupt, busy, cores)} == {"native"}
    assert (interrupt.serve_args, busy.serve_args, cores.serve_args) == (
        [], ["--poll", "busy"], ["--poll", "busy", "--cores", "2"])
    assert [t.trsvcid for t in (interrupt, busy, cores)] == [4490, 4491, 4492]
    assert len({t.subnqn for t in (kernel, interrupt, busy, cores)}) == 4
    assert "--poll busy --cores 2" in cores.kind
    args.targets = "native,native-adaptive,native-adaptive-500us"
    interrupt, adaptive, spin500 = build_targets(args, tmp_path)
    assert (adaptive.serve_args, spin500.serve_args) == (["--poll", "adaptive"],
                                                         ["--poll", "adaptive", "--poll-spin-us", "500"])
    from nvmeof_roce.errors import NvmeofError
    with pytest.raises(NvmeofError, match="poll-group threads poll continuously"):
        build_targets(argparse.Namespace(**{**vars(args), "targets": "native-2c"}), tmp_path)


def test_poll_group_threads_serve_file_namespaces_and_hand_a_failed_command_back(tmp_path):
    """File namespaces on thread-polled queues: their reads and writes on each queue's io_uring (4 bounce chunks for
    24 commands at a time), and a read the device cuts short mailed back to the core, which answers it as the
    Python data path does."""
    import os
    from nvmeof_roce.transport.eventloop import EventLoop
    from nvmeof_roce.transport.rdma.pollgroups import PollGroups
    from test_native_queue import SUB_FILE, file_bytes, file_config
    eps = [NativeEndpoint(file_config(tmp_path / f"ns{i}.img"), SUB_FILE, depth=64, file_buffers=4)
           for i in range(2)]
    loop = EventLoop(eps[0].env.target)
    groups = PollGroups(native.module, 2)
    python = None
    try:
        for ep in eps:
            ep.queue.start_polling(loop, "busy", poll_groups=groups)
        count = 24
        for ep in eps:  # writes: host offset k*4 KiB -> LBA k*8
            for k in range(count):
                assert ep.device.deliver(io_capsule(ep, WRITE, 1, 8 * k, 7, 4096, offset=4096 * k, cid=k)) == 0
        got = _await(loop, eps, {ep: count for ep in eps})
        assert all(_status(c) == 0 for ep in eps for c in got[ep])
        for ep in eps:  # reads back into host offset 512 KiB + k*4 KiB
            for k in range(count):
                ep.device.deliver(io_capsule(ep, READ, 1, 8 * k, 7, 4096, offset=524288 + 4096 * k, cid=100 + k))
        got = _await(loop, eps, {ep: count for ep in eps})
        assert all(_status(c) == 0 for ep in eps for c in got[ep])
        for i, ep in enumerate(eps):
            host = ep.host_bytes()
            assert host[524288:524288 + count * 4096] == host[:count * 4096]
            assert file_bytes(tmp_path / f"ns{i}.img", 0, count * 4096) == host[:count * 4096]
        # the device cuts a read short (the file shrank under the namespace): the core answers it
        python = LoopbackEndpoint(file_config(tmp_path / "python.img"), SUB_FILE)
        os.truncate(tmp_path / "python.img", 64 * 1024)
        (expected,) = python.exchange(io_capsule(python, READ, 1, 120, 15, 8192, cid=900))
        assert _status(expected) != 0
        for i, ep in enumerate(eps):
            os.truncate(tmp_path / f"ns{i}.img", 64 * 1024)
            ep.device.deliver(io_capsule(ep, READ, 1, 120, 15, 8192, cid=900))
            ep.device.deliver(io_capsule(ep, READ, 1, 8, 7, 4096, cid=901))
        got = _await(loop, eps, {ep: 2 for ep in eps})
        for ep in eps:
            answers = {int.from_bytes(c[12:14], "little"): c for c in got[ep]}
            assert answers[900][12:16] == expected[12:16] and _status(answers[901]) == 0  # (SQ heads differ)
            stats = ep.queue.stats()
            assert stats["threaded"] == 1 and stats["file_handed_back"] == 1
            assert stats["file_commands"] == 2 * count + 2 and stats["bounce_chunks_free"] == 4
    finally:
        for ep in eps:
            ep.close()
        if python is not None:
            close_all(python)
        groups.close()
        loop.close()


def test_a_response_in_the_window_after_a_poll_group_thread_failed_the_queue_closes_it(grouped, caplog):
    """A poll-group thread fails the queue (its QP in error); before the loop drains that failure, a command
    the core held (its subsystem paused) starts and answers: the transport says the queue is closed (its
    TransportError), the core closes the queue, and nothing is an internal error."""
    import time
    eps, loop, groups = grouped
    ep = eps[1]
    target = ep.env.target
    paused = target.pause_namespaces([(SUB_RAM, 1)])
    ep.device.deliver(io_capsule(ep, 0x08, 1, 0, 7, 0, cid=7))  # Write Zeroes: the core's, held by the pause
    deadline = time.monotonic() + 60
    while target.in_flight() == 0:  # the loop drained it to the core, which holds it
        assert time.monotonic() < deadline
        loop.run_once(0.01)
    # The thread fails the queue: its QP goes to the error state and the receives come back flushed (a command
    # of the paused subsystem would go to the core now, so a bad key could not fail it).
    ep.device.qp_error()
    while not ep.queue.stats()["failed"]:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert not ep.queue.closed  # the failure is in the mailbox: the loop has not drained it
    internal = target.internal_errors
    target.resume_namespaces(paused)  # the held Write Zeroes runs and answers now, in the window
    ep.env.fabric.pump()  # (its slices run on the loopback's loop)
    assert target.internal_errors == internal
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert ep.queue.closed and ep.queue.poll_group is None
    loop.run_once(0.01)  # the mailed failure finds the queue closed
    assert [g["queues"] for g in groups.status()] == [2, 1]


def test_a_disconnect_on_a_thread_polled_queue_sends_its_poll_s_responses_then_closes(grouped):
    """Reads and a Disconnect on a poll group's queue: the loop answers the Disconnect from the mailbox and closes
    the queue, which posts what was batched, takes nothing more, and is torn down once its thread mailed that the
    send queue emptied (NQ_MAIL_CLOSE_READY)."""
    import time
    from nvmeof_roce.nvme import fabrics as F
    eps, loop, groups = grouped
    ep = eps[1]
    for k in range(8):
        assert ep.device.deliver(io_capsule(ep, READ, 1, 8 * k, 7, 4096, offset=4096 * k, cid=k)) == 0
    assert ep.device.deliver(F.DisconnectCommand(cid=100).to_sqe().pack()) == 0
    got = _await(loop, [ep], {ep: 9})
    assert sorted(int.from_bytes(c[12:14], "little") for c in got[ep]) == list(range(8)) + [100]
    assert all(c[14:16] == b"\0\0" for c in got[ep])
    deadline = time.monotonic() + 10
    while not ep.queue.closed:  # the thread's mail that the send queue emptied tears it down
        assert time.monotonic() < deadline, "the closing queue was never torn down"
        loop.run_once(0.01)
    assert ep.queue.poll_group is None
    eps.remove(ep)
    ep.close()


def test_the_bench_reads_a_native_queue_s_polling_from_the_target_s_status(busy_ep):
    """What `bench` records per job (bench/runner.py queue_polling) is what the queue counted, through the real
    `nvmeof_get_status` method: the I/O queue only, of the subsystem asked for."""
    from nvmeof_roce.bench.runner import POLLING_COUNTS, queue_polling
    from nvmeof_roce.control.methods import Control
    ep = busy_ep
    ep.queue.start_polling(ep.loop, "adaptive", channels=())
    ep.device.deliver(io_capsule(ep, READ, 1, 0, 7, 4096, offset=0, cid=2))
    ep.queue.poll_adaptive(spin_us=200)
    status = Control(ep.env.target).call("nvmeof_get_status", {})
    stats = ep.queue.stats()
    assert queue_polling(status, SUB_RAM) == {"mode": "adaptive", "queues": 1,
                                              **{k: stats[k] for k in POLLING_COUNTS}}
    assert stats["spin_yields"] > 0 and stats["arms"] == 2  # armed when polling started, and after the spin
    assert queue_polling(status, "nqn.2024-01.io.test:none") is None
