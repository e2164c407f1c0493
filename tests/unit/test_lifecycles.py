"""Controller and queue lifecycles (engine/controller.py, engine/queue.py): the kernel's controller states driven
by CC, the queue's from CM accept to close, and what neither lets happen."""
import pytest

from loopback_env import SUB_RAM, RawQueue, raw_connect, raw_enable
from nvmeof_roce.nvme import fabrics as F
from nvmeof_roce.engine.controller import CtrlState, IllegalControllerTransition
from nvmeof_roce.engine.queue import IllegalQueueTransition, QueueLifecycle


def controller_of(env, cqe):
    return env.target.subsystems[SUB_RAM].controllers[cqe.result & 0xFFFF]


def queue_state(env, q: RawQueue):
    return env.target.queue_state(q.transport._conn.target)


def test_enable_reset_and_shutdown_walk_the_kernel_states(env):
    q, cqe = raw_connect(env.connector(), SUB_RAM)
    ctrl = controller_of(env, cqe)
    assert ctrl.state is CtrlState.NEW and not ctrl.ready
    assert raw_enable(q) & F.CSTS_RDY
    assert ctrl.state is CtrlState.LIVE
    # CC.EN 1 -> 0: a reset; the controller waits for CC.EN again
    assert q.command(F.PropertySet(offset=F.PROP_CC, value=F.CC_DEFAULT)).status == 0
    assert ctrl.state is CtrlState.CONNECTING and not ctrl.csts & F.CSTS_RDY
    assert raw_enable(q) & F.CSTS_RDY and ctrl.state is CtrlState.LIVE
    # CC.SHN: RESETTING while the namespaces flush (RAM: at once), CSTS.SHST complete, then CONNECTING
    cc = F.CC_DEFAULT | F.CC_EN | F.CC_SHN_NORMAL
    assert q.command(F.PropertySet(offset=F.PROP_CC, value=cc)).status == 0
    csts = q.command(F.PropertyGet(offset=F.PROP_CSTS)).result
    assert csts & F.CSTS_SHST_MASK == F.CSTS_SHST_COMPLETE
    assert ctrl.state is CtrlState.CONNECTING
    # the host goes: the admin queue's close deletes the controller
    q.transport.close()
    env.fabric.pump()
    assert ctrl.state is CtrlState.DEAD and ctrl.dead


def test_an_invalid_cc_leaves_the_controller_not_live(env):
    q, cqe = raw_connect(env.connector(), SUB_RAM)
    ctrl = controller_of(env, cqe)
    bad = (F.CC_DEFAULT & ~F.CC_IOSQES_MASK) | F.CC_EN  # IOSQES 0: CSTS.CFS, as nvmet_start_ctrl
    assert raw_enable(q, bad) & F.CSTS_CFS
    assert ctrl.state is CtrlState.NEW and not ctrl.ready


def test_keep_alive_expiry_deletes_through_deleting_to_dead(env):
    q, cqe = raw_connect(env.connector(), SUB_RAM, kato=1000)
    ctrl = controller_of(env, cqe)
    raw_enable(q)
    env.clock.advance(5)
    env.fabric.tick()
    assert ctrl.state is CtrlState.DEAD


def test_change_state_refuses_what_the_kernel_table_has_not(env):
    q, cqe = raw_connect(env.connector(), SUB_RAM)
    ctrl = controller_of(env, cqe)
    with pytest.raises(IllegalControllerTransition, match="new -> dead"):  # only from DELETING
        ctrl.change_state(CtrlState.DEAD)
    assert ctrl.state is CtrlState.NEW
    ctrl.change_state(CtrlState.DELETING)
    assert ctrl.state is CtrlState.DELETING
    ctrl.change_state(CtrlState.DEAD)
    assert ctrl.state is CtrlState.DEAD
    with pytest.raises(IllegalControllerTransition, match="dead -> live"):  # a dead controller never comes back
        ctrl.change_state(CtrlState.LIVE)
    assert ctrl.state is CtrlState.DEAD
    q.transport.close()
    env.fabric.pump()


def test_queue_lifecycle_connecting_refused_live_closed(env):
    transport = env.connector().connect(0, 32, 31, 0)
    q = RawQueue(transport)
    qs = queue_state(env, q)
    assert qs.state is QueueLifecycle.CONNECTING
    q.buf.view[:1024] = F.ConnectData(bytes(16), 0xFFFF, "nqn.2024-01.io.test:nope", "nqn.2014-08.org.x:h").pack()
    assert q.command(F.ConnectCommand(sgl=q.keyed(1024))).status  # refused
    assert qs.state is QueueLifecycle.REFUSED
    with pytest.raises(IllegalQueueTransition, match="refused -> connecting"):
        qs.enter(QueueLifecycle.CONNECTING)
    env.clock.advance(1)
    env.fabric.tick()  # the refused queue's linger is over: closed
    assert qs.state is QueueLifecycle.CLOSED and qs.closed
    with pytest.raises(IllegalQueueTransition):
        qs.enter(QueueLifecycle.LIVE)
    _, cqe = raw_connect(env.connector(), SUB_RAM)
    live = [s for s in env.target.queue_states() if s.state is QueueLifecycle.LIVE]
    assert cqe.status == 0 and len(live) == 1 and live[0].ctrl is not None
