"""The soak job's live changes (bench/soak.py) made on a running loopback target through its RPC methods: the
scratch namespace appears, takes each size and goes, cycle after cycle, while the soak's own namespace serves."""
import pytest

from loopback_env import Env, SUB_RAM, standard_config
from nvmeof_roce.bench.soak import SCRATCH_NSID, LiveChanges, cycle
from nvmeof_roce.control.methods import Control

MiB = 1 << 20


@pytest.fixture
def served():
    env = Env(standard_config())
    env.target.config.subsystem(SUB_RAM)  # the soak's subsystem: namespaces 1 and 2 ...
    control = Control(env.target)
    control.call("nvmf_subsystem_remove_ns", {"nqn": SUB_RAM, "nsid": SCRATCH_NSID})  # ... 2 is the scratch one
    yield env, control
    env.close()


def through(control, calls):
    def call(path, method, params):
        calls.append((path, method))
        return control.call(method, params)
    return call


def scratch_size(env):
    ns = env.target.subsystem(SUB_RAM).namespaces.get(SCRATCH_NSID)
    return None if ns is None else ns.num_blocks * 512


def test_the_cycle_adds_resizes_and_removes_the_scratch_namespace_and_io_goes_on(served):
    env, control = served
    calls = []
    changes = LiveChanges("/run/x.sock", SUB_RAM, 3.0, call=through(control, calls))
    ctrl = env.connect(SUB_RAM)
    seen = []
    for _ in range(2 * len(cycle(SUB_RAM))):
        changes.step()
        env.fabric.pump()
        seen.append(scratch_size(env))
        data = bytes([len(seen)]) * 4096
        ctrl.write(1, 8 * len(seen), data)  # the soak's namespace serves between the changes
        assert ctrl.read(1, 8 * len(seen), 8) == data
    assert seen == [16 * MiB, 32 * MiB, 8 * MiB, 16 * MiB, None] * 2
    assert changes.made == 10 and changes.refused == 0 and changes.errors == []
    record = changes.record()
    assert record["cycle"] == ["nvmf_subsystem_add_ns"] + ["nvmf_subsystem_resize_ns"] * 3 + \
        ["nvmf_subsystem_remove_ns"]
    assert record["made"] == 10 and record["longest_rpc_ms"] >= 0
    assert calls[-1] == ("/run/x.sock", "nvmeof_get_status")
    ctrl.close()


def test_a_refused_change_is_counted_with_its_message_and_the_cycle_starts_again(served):
    env, control = served
    control.call("nvmf_subsystem_add_ns", {"nqn": SUB_RAM, "namespace": {"nsid": SCRATCH_NSID, "backend": "ram",
                                                                          "size": "1M"}})
    changes = LiveChanges("/run/x.sock", SUB_RAM, 3.0, call=through(control, []))
    changes.step()  # the add: NSID 2 is taken
    assert changes.made == 0 and changes.refused == 1
    assert "already has namespace 2" in changes.errors[0] and changes.errors[0].startswith("nvmf_subsystem_add_ns")
    changes.step()  # the add again, not a resize of a namespace it did not make
    assert changes.refused == 2 and scratch_size(env) == 1 * MiB


def test_stop_removes_the_scratch_namespace_a_cycle_left_in(served):
    env, control = served
    changes = LiveChanges("/run/x.sock", SUB_RAM, 3.0, call=through(control, []))
    changes.step()
    changes.step()
    assert scratch_size(env) == 32 * MiB
    changes.stop()
    assert scratch_size(env) is None and changes.errors == []


def test_the_scratch_namespace_is_known_absent_only_between_a_removal_and_the_next_add(served):
    import time
    env, control = served
    changes = LiveChanges("/run/x.sock", SUB_RAM, 3.0, call=through(control, []))
    marks = [time.monotonic()]
    for _ in range(len(cycle(SUB_RAM)) + 1):  # a whole cycle, then the next add
        changes.step()
        marks.append(time.monotonic())
    assert changes.absent_at(marks[0])  # before the first add
    assert not any(changes.absent_at(t) for t in marks[1:5])  # added, resized three times
    assert changes.absent_at(marks[5])  # removed
    assert not changes.absent_at(marks[6])  # added again


def test_the_progress_line_says_commands_rate_time_left_rss_and_changes():
    """Once a minute of the samples' clock: commands done of the count, the rate and what is left at it."""
    from nvmeof_roce.bench.procstat import Sample
    from nvmeof_roce.bench.soak import SoakProgress

    class Made:
        made, refused = 12, 1

    lines = []
    p = SoakProgress("userspace", 10_000_000, lines.append, Made(), every=60)
    p(Sample(t=100.0, ios=500, rss_bytes=300 << 20))  # the start
    p(Sample(t=130.0, ios=120_500, rss_bytes=301 << 20))  # within the minute: nothing
    p(Sample(t=160.5, ios=240_500, rss_bytes=302 << 20))
    p(Sample(t=170.0, ios=None))  # a sample without a count says nothing
    assert lines == ["bench: soak on userspace: 240,000 of 10,000,000 commands (2%), 3,967/s, about 41 min left, "
                     "target RSS 302.0 MiB, 12 live changes (1 refused)"]
    p(Sample(t=221.0, ios=480_500))
    assert len(lines) == 2 and lines[1].startswith("bench: soak on userspace: 480,000 of") and "RSS" not in lines[1]
    quiet = SoakProgress("kernel", 1000, lines.append)
    quiet(Sample(t=0.0, ios=0))
    quiet(Sample(t=61.0, ios=0))  # nothing done yet: no time left to give, and no live changes to count
    assert lines[-1] == "bench: soak on kernel: 0 of 1,000 commands (0%), 0/s"


def test_a_removed_or_resized_namespace_s_memory_goes_at_once_not_at_the_next_full_collection(served):
    """The soak's RSS once grew in steps of the scratch namespace's size: every live change that paused its
    subsystem left a reference cycle (the drain's closure naming itself) holding the changes, and with them the
    old namespace and its memory, until the garbage collector's next full pass, which may be minutes away on a
    busy target.  Without the collector, each namespace the cycle replaced or removed must be gone once the
    change is applied."""
    import gc
    import weakref

    env, control = served

    def scratch_memory(env):  # a weak reference to the scratch namespace's memory, None while it is out
        ns = env.target.subsystem(SUB_RAM).namespaces.get(SCRATCH_NSID)
        return None if ns is None else weakref.ref(ns.backend._memory)

    changes = LiveChanges("/run/x.sock", SUB_RAM, 3.0, call=lambda path, method, params: control.call(method, params))
    ctrl = env.connect(SUB_RAM)
    gone = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(2 * len(cycle(SUB_RAM))):
            memory = scratch_memory(env)
            changes.step()
            env.fabric.pump()
            ctrl.write(1, 8, bytes(4096))  # the soak's namespace serves between the changes
            if memory is not None and scratch_memory(env) is not memory:
                gone.append(memory() is None)
    finally:
        gc.enable()
        ctrl.close()
    assert changes.made == 10 and changes.refused == 0
    # a resize within the reservation keeps the memory (no copy); the removals let it go
    assert gone == [True, True], gone
