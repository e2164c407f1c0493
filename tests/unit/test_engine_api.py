"""The engine's administrative verbs (engine/api.py): pause and resume of a namespace, fences (engine/fencing.py),
the lifecycles, and the namespace verbs as a connected host sees them over the loopback fabric."""
import pytest

from loopback_env import SUB_4K, SUB_RAM, Env, RawQueue, ram_ns, standard_config
from nvmeof_roce.config import ConfigError, parse_config
from nvmeof_roce.control.methods import Control
from nvmeof_roce.nvme import admin as A
from nvmeof_roce.nvme import nvm
from nvmeof_roce.nvme import status as S
from nvmeof_roce.nvme.sgl import SglDescriptor
from nvmeof_roce.nvme.status import NvmeStatusError
from nvmeof_roce.engine.subsystem import (IllegalNamespaceTransition, IllegalSubsystemTransition, NamespaceState,
                                          SubsystemState)


@pytest.fixture
def ctrl(env):
    c = env.connect(SUB_RAM, num_io_queues=1)
    yield c
    if not c.closed:
        c.close()


def io(ctrl) -> RawQueue:
    return RawQueue(ctrl.io_queues[0].transport)


def in_capsule_write(q: RawQueue, cid: int, data: bytes, slba: int = 0):
    """A one-block Write whose data travels in the capsule (no RDMA READ to wait for)."""
    sqe = nvm.write_command(0, 1, slba, 0, SglDescriptor.in_capsule(len(data)))
    sqe.cid = cid
    return sqe.pack() + data


def completions(q: RawQueue):
    got = []
    for _ in range(5):
        got += q.transport.poll(0)
    return got


def cids(cqes) -> list:
    return [int.from_bytes(c[12:14], "little") for c in cqes]


def statuses(cqes) -> list:
    return [int.from_bytes(c[14:16], "little") >> 1 for c in cqes]


def new_namespace(nsid: int, size: str = "1M"):
    return parse_config({"subsystems": [{"nqn": SUB_RAM, "namespaces": [ram_ns(nsid, size)]}]}, "api") \
        .subsystems[0].namespaces[0]


# ---------------------------------------------------------------------------------------------- pause, fence

def test_pause_holds_new_commands_and_resume_starts_them_in_order(env, ctrl):
    q = io(ctrl)
    paused = env.target.pause_namespaces([(SUB_RAM, 1)])
    ns = env.target.subsystem(SUB_RAM).namespaces[1]
    assert paused == [(SUB_RAM, ns)] and ns.state is NamespaceState.PAUSED
    for cid, fill in ((0x10, b"a"), (0x11, b"b"), (0x12, b"c")):  # the same block: the last one must win
        q.send(in_capsule_write(q, cid, fill * 512))
    env.fabric.pump()
    assert completions(q) == []  # waiting, not failed
    assert len(ns.held) == 3
    env.target.resume_namespaces(paused)
    env.fabric.pump()
    got = completions(q)
    assert cids(got) == [0x10, 0x11, 0x12] and statuses(got) == [0, 0, 0]
    assert ns.state is NamespaceState.ACTIVE and not ns.held
    assert ctrl.read(1, 0, 1) == b"c" * 512
    assert env.target.internal_errors == 0


def test_a_fence_waits_for_the_commands_in_flight_and_not_for_later_ones(env, ctrl):
    """A RAM Write Zeroes runs in slices on later loop passes (engine/work.py): started before the fence, the fence
    is done once it completed; a Write sent meanwhile (not paused) takes the new reference and is not waited for."""
    q = io(ctrl)
    q.send(nvm.write_zeroes_command(0, 1, 0, 7).pack())
    env.fabric.pump(max_ops=1)  # the capsule is in and its job queued
    assert env.target.work.pending == 1
    ns = env.target.subsystem(SUB_RAM).namespaces[1]
    old = ns.ref
    assert old.count == 1
    fenced = []
    env.target.fence([(SUB_RAM, ns)], lambda error: fenced.append((error, env.target.work.pending)), "a test")
    assert fenced == [] and ns.ref is not old and env.target.fencing
    env.fabric.pump()
    env.fabric.tick()
    assert fenced == [(None, 0)]  # done once the zeroing completed, not before
    assert old.count == 0 and ns.ref.count == 0 and not env.target.fencing
    assert statuses(completions(q)) == [0]


def test_a_fence_on_one_namespace_does_not_wait_for_another(env, ctrl):
    q = io(ctrl)
    q.send(nvm.write_zeroes_command(0, 1, 0, 7).pack())  # on namespace 1
    env.fabric.pump(max_ops=1)
    fenced = []
    env.target.fence([(SUB_RAM, env.target.subsystem(SUB_RAM).namespaces[2])], fenced.append, "a test")
    assert fenced == [None]  # nothing of namespace 2's was in flight
    env.fabric.pump()


def test_pausing_one_namespace_leaves_the_others_running(env, ctrl):
    other = env.connect(SUB_4K, num_io_queues=1)
    paused = env.target.pause_namespaces([(SUB_RAM, 1)])
    ctrl.write(2, 0, b"y" * 512)  # the other namespace of the same subsystem
    assert ctrl.read(2, 0, 1) == b"y" * 512
    other.write(1, 0, b"x" * 4096)  # and another subsystem
    assert other.read(1, 0, 1) == b"x" * 4096
    env.target.resume_namespaces(paused)
    other.close()


def test_commands_held_on_a_queue_that_closed_are_freed_on_resume(env, ctrl):
    q = io(ctrl)
    paused = env.target.pause_namespaces([(SUB_RAM, 1)])
    q.send(in_capsule_write(q, 0x30, b"z" * 512))
    env.fabric.pump()
    ctrl.close()
    env.fabric.pump()
    env.target.resume_namespaces(paused)  # its queue is gone: nothing to answer, nothing leaked
    ns = env.target.subsystem(SUB_RAM).namespaces[1]
    assert not ns.held and ns.ref.count == 0
    assert env.target.internal_errors == 0


def test_illegal_namespace_and_subsystem_moves_raise(env):
    ns = env.target.subsystem(SUB_RAM).namespaces[1]
    with pytest.raises(IllegalNamespaceTransition, match="active -> active"):
        ns.enter(NamespaceState.ACTIVE)
    paused = env.target.pause_namespaces([(SUB_RAM, 1)])
    with pytest.raises(IllegalNamespaceTransition, match="paused -> paused"):
        ns.enter(NamespaceState.PAUSED)
    assert env.target.pause_namespaces([(SUB_RAM, 1)]) == []  # already paused: not twice
    env.target.resume_namespaces(paused)
    sub = env.target.remove_subsystem(SUB_RAM)
    assert sub.state is SubsystemState.REMOVED and SUB_RAM not in env.target.subsystems
    assert ns.state is NamespaceState.REMOVED
    with pytest.raises(IllegalSubsystemTransition, match="removed -> removed"):
        sub.enter(SubsystemState.REMOVED)
    for state in (NamespaceState.ACTIVE, NamespaceState.PAUSED):
        with pytest.raises(IllegalNamespaceTransition, match=f"removed -> {state.value}"):
            ns.enter(state)


def test_removing_a_subsystem_with_a_paused_namespace_ends_its_controllers_and_drops_what_waited(env, ctrl):
    q = io(ctrl)
    env.target.pause_namespaces([(SUB_RAM, 1)])
    q.send(in_capsule_write(q, 0x40, b"r" * 512))
    env.fabric.pump()
    sub = env.target.remove_subsystem(SUB_RAM, "subsystem deleted")
    env.fabric.pump()
    assert not sub.namespaces[1].held and not sub.controllers
    assert all(ns.removed for ns in sub.namespaces.values())
    assert env.target.internal_errors == 0


def test_removing_a_subsystem_while_a_fence_waits_ends_the_fence_once_its_commands_are_gone(env, ctrl):
    q = io(ctrl)
    q.send(nvm.write_zeroes_command(0, 1, 0, 7).pack())
    env.fabric.pump(max_ops=1)  # a sliced job in flight: the fence cannot complete yet
    fenced = []
    env.target.fence([(SUB_RAM, env.target.subsystem(SUB_RAM).namespaces[1])], fenced.append, "a test")
    sub = env.target.remove_subsystem(SUB_RAM)
    env.fabric.pump()
    env.fabric.tick()
    assert sub.state is SubsystemState.REMOVED and fenced == [None]
    assert env.target.internal_errors == 0


# ---------------------------------------------------------------------------------------------- namespace verbs

def test_a_namespace_added_by_the_verbs_is_seen_by_a_connected_host(env, ctrl):
    assert ctrl.active_namespaces() == [1, 2]
    ns = env.target.prepare_namespace(SUB_RAM, new_namespace(7))
    ctrl.poll_admin()
    assert ctrl.events == [] and ctrl.active_namespaces() == [1, 2]  # prepared: no host sees it yet
    env.target.install_namespace(SUB_RAM, ns)
    env.target.namespace_changed(SUB_RAM, 7)
    ctrl.poll_admin()
    assert ctrl.events == [(A.AER_TYPE_NOTICE, A.AER_NOTICE_NS_CHANGED, A.LID_CHANGED_NS)]
    assert ctrl.changed_namespaces() == [7]
    assert ctrl.active_namespaces() == [1, 2, 7]
    ctrl.write(7, 0, b"s" * 512)
    assert ctrl.read(7, 0, 1) == b"s" * 512


def test_a_retired_namespace_answers_invalid_namespace(env, ctrl):
    ns = env.target.subsystem(SUB_RAM).namespaces[2]
    assert env.target.retire_namespace(SUB_RAM, 2) is ns and ns.removed
    env.target.namespace_changed(SUB_RAM, 2)
    ctrl.poll_admin()
    assert ctrl.events == [(A.AER_TYPE_NOTICE, A.AER_NOTICE_NS_CHANGED, A.LID_CHANGED_NS)]
    assert ctrl.changed_namespaces() == [2]
    assert ctrl.active_namespaces() == [1]
    with pytest.raises(NvmeStatusError) as exc:
        ctrl.read(2, 0, 1)
    assert exc.value.status == S.INVALID_NS | S.DNR


def test_a_resize_takes_effect_when_installed(env, ctrl):
    cfg = env.target.config.subsystem(SUB_RAM).namespace(2)
    bigger = parse_config({"subsystems": [{"nqn": SUB_RAM, "namespaces": [ram_ns(2, "4M")]}]}, "api") \
        .subsystems[0].namespaces[0]
    blocks = (1 << 20) // 512
    resize = env.target.prepare_resize(SUB_RAM, bigger)
    assert env.target.subsystem(SUB_RAM).namespaces[2].num_blocks == blocks  # prepared: not in use yet
    env.target.resize_namespace(SUB_RAM, resize)
    ns = env.target.subsystem(SUB_RAM).namespaces[2]
    assert ns.num_blocks == 4 * blocks and ns.config is bigger and ns.config is not cfg
    ctrl.write(2, 4 * blocks - 1, b"e" * 512)
    assert ctrl.read(2, 4 * blocks - 1, 1) == b"e" * 512


def test_a_namespace_that_cannot_open_names_its_config_field(tmp_path):
    data = standard_config()
    env = Env(data)
    try:
        missing = {"nsid": 3, "device": {"path": str(tmp_path / "no" / "such.img")},
                   "nvmeof_roce": {"backend": "file", "block_size": 512}}
        data["subsystems"][0]["namespaces"].append(missing)
        config = parse_config(data, "the-config")
        with pytest.raises(ConfigError) as exc:
            env.target.prepare_namespace(SUB_RAM, config.subsystem(SUB_RAM).namespace(3), config)
        assert exc.value.where == "subsystems[0].namespaces[2].device.path"
        assert SUB_RAM in env.target.subsystems and 3 not in env.target.subsystem(SUB_RAM).namespaces
    finally:
        env.close()


# ---------------------------------------------------------------------------------------------- live.apply

def test_a_live_change_commits_namespace_changes_while_their_namespaces_are_paused(env, ctrl):
    """control/live.py brackets the commit in pause and resume of the namespaces that change (and of no other),
    and leaves them active."""
    seen = []
    pause, resume, install = env.target.pause_namespaces, env.target.resume_namespaces, env.target.install_namespace
    env.target.pause_namespaces = lambda targets: seen.append(("pause", list(targets))) or pause(targets)
    env.target.resume_namespaces = lambda paused: seen.append(("resume", [(n, ns.nsid) for n, ns in paused])) \
        or resume(paused)
    env.target.install_namespace = lambda nqn, ns: seen.append(("install", nqn, ns.nsid)) or install(nqn, ns)
    control = Control(env.target)
    nsid = control.call("nvmf_subsystem_add_ns", {"nqn": SUB_RAM, "namespace": {"backend": "ram", "size": "1M"}})
    # a new NSID: nothing to pause, nothing in flight for it; the install comes between
    assert seen == [("pause", [(SUB_RAM, nsid)]), ("install", SUB_RAM, nsid), ("resume", [])]
    assert all(ns.state is NamespaceState.ACTIVE for ns in env.target.subsystem(SUB_RAM).namespaces.values())
    ctrl.poll_admin()
    assert ctrl.changed_namespaces() == [nsid]
    ctrl.write(nsid, 0, b"l" * 512)
    assert ctrl.read(nsid, 0, 1) == b"l" * 512
