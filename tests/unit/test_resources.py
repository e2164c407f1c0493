"""The resource model (transport/resources.py): pool accounting, the Number of Queues grant cap, and queues
without a successful NVMe Connect being closed -- over the loopback transport with a fake clock."""
import pytest

from nvmeof_roce.errors import NvmeofError
from nvmeof_roce.config import parse_config
from nvmeof_roce.nvme import fabrics as F
from nvmeof_roce.nvme import status as S
from nvmeof_roce.nvme.status import NvmeStatusError
from nvmeof_roce.engine.core import Target
from nvmeof_roce.transport.contracts import ConnectRejected
from nvmeof_roce.transport.loopback import FakeClock, LoopbackFabric
from nvmeof_roce.transport.resources import BufferPool, ResourceLimits

from loopback_env import ADDR1, HOST_A, HOST_B, SUB_ONLY_A, SUB_RAM, raw_connect, standard_config


# ---------------------------------------------------------------------- the pool, without a device

def test_a_queue_before_connect_holds_at_most_one_buffer_and_is_guaranteed_nothing():
    pool = BufferPool(8, 2)
    share = pool.share()
    first = share.take()
    assert first is not None and len(first) == 1
    assert share.take() is None  # the pre-Connect limit, not the pool, says no
    assert pool.committed == 0 and pool.guarantee_capacity() == 4
    share.give(first)
    assert pool.free_count == 8


def test_guarantee_is_kept_for_a_queue_while_others_use_the_shared_rest():
    pool = BufferPool(8, 2)
    a, b = pool.share(), pool.share()
    assert a.commit() and b.commit()
    assert pool.committed == 4 and pool.guarantee_capacity() == 2
    hog = a.take(6)  # its 2 guaranteed + the 4 shared
    assert hog is not None and len(hog) == 6
    assert a.take() is None  # nothing shared is left; b's two are not a's
    assert b.take(2) is not None  # b still gets its minimum
    assert b.take() is None
    assert pool.free_count == 0


def test_a_waiting_queue_is_woken_when_a_shared_buffer_comes_back():
    pool = BufferPool(4, 1)
    woken = []
    a = pool.share()
    b = pool.share(wake=lambda: woken.append(b.take()))
    assert a.commit() and b.commit()
    held = a.take(3)
    assert len(b.take(1)) == 1  # b's guaranteed one
    assert b.take(1) is None  # b waits
    a.give(held[:1])
    assert woken and woken[0] is not None and len(woken[0]) == 1


def test_closing_a_queue_returns_its_guarantee_and_its_buffers():
    pool = BufferPool(6, 2)
    a = pool.share()
    assert a.commit()
    held = a.take(5)
    a.close()
    assert pool.committed == 0 and pool.shares == 0
    a.give(held)  # the transport hands back what was in flight once the QP is gone
    assert pool.free_count == 6 and pool.reserved_unused == 0 and pool.shared_free == 6
    assert not a.commit()  # a closed queue gets nothing any more


def test_commit_fails_when_no_minimum_can_be_guaranteed():
    pool = BufferPool(4, 2)
    shares = [pool.share() for _ in range(3)]
    assert shares[0].commit() and shares[1].commit()
    assert not shares[2].commit()
    assert pool.guarantee_capacity() == 0


def test_limits_are_checked_and_named():
    with pytest.raises(NvmeofError, match="--queue-min-buffers 0"):
        ResourceLimits(queue_min_buffers=0)
    with pytest.raises(NvmeofError, match="not even two queues"):
        ResourceLimits(data_buffers=8, queue_min_buffers=8)
    with pytest.raises(NvmeofError, match="--connect-timeout"):
        ResourceLimits(connect_timeout=0)
    text = ResourceLimits().describe()
    assert "1024 data buffers per port" in text and "128 I/O queues per controller" in text


def test_grant_is_the_smallest_cap_and_never_zero():
    limits = ResourceLimits(max_queues_per_ctrl=16, max_queues_per_host=20)
    assert limits.io_queue_grant(128, 128, 0, None) == 16
    assert limits.io_queue_grant(8, 128, 0, None) == 8
    assert limits.io_queue_grant(16, 4, 0, None) == 4  # the subsystem's qid_max
    assert limits.io_queue_grant(16, 128, 16, None) == 4  # the host holds 16 elsewhere
    assert limits.io_queue_grant(16, 128, 0, 3) == 3  # what the pool can still guarantee
    assert limits.io_queue_grant(16, 128, 20, 0) == 1


# ---------------------------------------------------------------------- through the target, over loopback

class PooledEnv:
    """A Target whose port accounts its data buffers like the RDMA transport does."""

    def __init__(self, limits: ResourceLimits):
        self.clock = FakeClock()
        self.target = Target(parse_config(standard_config(), "test-config"), clock=self.clock, limits=limits)
        self.fabric = LoopbackFabric(clock=self.clock)
        self.pool = BufferPool(limits.data_buffers, limits.queue_min_buffers)
        self.fabric.listen(ADDR1, self.target.port(1), pool=self.pool)

    def connect(self, hostnqn=HOST_A, subnqn=SUB_RAM, **kwargs):
        from nvmeof_roce.initiator.controller import Controller
        ctrl = Controller.connect(self.fabric.connector(ADDR1), subnqn, hostnqn=hostnqn, clock=self.clock,
                                  timeout=5.0, **kwargs)
        self.fabric.pump()
        return ctrl

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.fabric.tick()
        self.fabric.pump()


def test_a_connection_without_nvme_connect_is_closed_after_the_connect_timeout():
    env = PooledEnv(ResourceLimits(connect_timeout=5.0))
    idle = env.fabric.connector(ADDR1).connect(1, 32, 31, 0)
    env.fabric.pump()
    assert "1 queues (1 awaiting Connect" in env.target.status()
    env.advance(4.9)
    assert not idle.closed
    env.advance(0.2)
    assert idle.closed
    assert env.target.status().startswith("0 queues")
    assert env.pool.shares == 0 and env.pool.committed == 0


def test_the_loopback_listener_reports_its_queues_and_pool_in_target_status():
    from types import SimpleNamespace
    from nvmeof_roce.control.stats import transport_status
    env = PooledEnv(ResourceLimits(data_buffers=64, queue_min_buffers=2))
    ctrl = env.connect(num_io_queues=1, kato_ms=0)
    listener = env.fabric._listeners[ADDR1]
    assert transport_status(SimpleNamespace(loop=SimpleNamespace(longest_pass=0.0), listeners=[listener]))["listeners"] == [
        {"address": ADDR1, "portid": None, "queues": 2, "wc_errors": None,
         "pool": {"chunks": 64, "free": 64, "in_use": 0, "guaranteed": 4}}]
    ctrl.close()
    env.fabric.pump()
    assert listener.status()["queues"] == 0 and listener.status()["pool"]["guaranteed"] == 0


def test_a_refused_connect_closes_its_queue_and_commits_nothing():
    env = PooledEnv(ResourceLimits())
    q, cqe = raw_connect(env.fabric.connector(ADDR1), SUB_ONLY_A, hostnqn=HOST_B)
    assert cqe.status == S.CONNECT_INVALID_HOST | S.DNR
    assert env.pool.committed == 0
    assert not q.transport.closed  # the host gets to read the status first
    env.advance(0.6)
    assert q.transport.closed and env.target.status().startswith("0 queues")


def test_a_connected_queue_is_not_closed_by_the_connect_timeout_and_holds_its_guarantee():
    env = PooledEnv(ResourceLimits(data_buffers=64, queue_min_buffers=2))
    ctrl = env.connect(num_io_queues=3, kato_ms=0)
    assert env.pool.committed == 4 * 2  # admin + 3 I/O queues
    env.advance(10)
    assert ctrl.identify_controller() is not None
    ctrl.close()
    env.fabric.pump()
    assert env.pool.committed == 0 and env.pool.shares == 0


def test_number_of_queues_grant_is_capped_by_the_limits():
    env = PooledEnv(ResourceLimits(max_queues_per_ctrl=4))
    ctrl = env.connect(num_io_queues=16)
    assert len(ctrl.io_queues) == 4
    ctrl.close()


def test_number_of_queues_grant_is_capped_by_what_the_pool_can_guarantee():
    env = PooledEnv(ResourceLimits(data_buffers=12, queue_min_buffers=2))
    ctrl = env.connect(num_io_queues=16)
    assert len(ctrl.io_queues) == 5  # 12 buffers / 2 = 6 queues, the admin queue is one of them
    assert env.pool.guarantee_capacity() == 0
    ctrl.close()


def test_number_of_queues_grant_counts_the_hosts_other_controllers():
    env = PooledEnv(ResourceLimits(max_queues_per_host=6))
    first = env.connect(num_io_queues=4)
    second = env.connect(num_io_queues=4, subnqn=SUB_RAM)
    assert len(first.io_queues) == 4 and len(second.io_queues) == 2
    other_host = env.connect(hostnqn=HOST_B, num_io_queues=4)
    assert len(other_host.io_queues) == 4
    for c in (first, second, other_host):
        c.close()


def test_max_controllers_refuses_the_next_io_controller_but_not_discovery():
    env = PooledEnv(ResourceLimits(max_controllers=2))
    ctrls = [env.connect(num_io_queues=1), env.connect(hostnqn=HOST_B, num_io_queues=1)]
    with pytest.raises(NvmeStatusError) as err:
        env.connect(num_io_queues=1)
    assert err.value.status == S.CONNECT_CTRL_BUSY  # no DNR: the host tries again later
    disc = env.connect(subnqn=F.DISCOVERY_NQN)  # discovery controllers have their own cap
    disc.close()
    ctrls.pop().close()
    env.fabric.pump()
    env.connect(num_io_queues=1).close()


def test_one_host_cannot_take_every_controller(monkeypatch):
    """Per-host caps come before the target's (engine/limits.py): a host at its cap is refused, another host
    still connects, for I/O and discovery controllers alike; with every kind full the CM refuses."""
    from nvmeof_roce.engine import core
    monkeypatch.setattr(core, "MAX_CONTROLLERS_PER_HOST", 2)
    monkeypatch.setattr(core, "MAX_DISCOVERY_CONTROLLERS_PER_HOST", 1)
    monkeypatch.setattr(core, "MAX_DISCOVERY_CONTROLLERS", 2)
    env = PooledEnv(ResourceLimits(max_controllers=4))
    mine = [env.connect(num_io_queues=1), env.connect(num_io_queues=1)]
    with pytest.raises(NvmeStatusError) as err:
        env.connect(num_io_queues=1)
    assert err.value.status == S.CONNECT_CTRL_BUSY
    other = env.connect(hostnqn=HOST_B, num_io_queues=1)
    mine.append(env.connect(subnqn=F.DISCOVERY_NQN))
    with pytest.raises(NvmeStatusError):
        env.connect(subnqn=F.DISCOVERY_NQN)
    theirs = env.connect(hostnqn=HOST_B, subnqn=F.DISCOVERY_NQN)
    more = env.connect(hostnqn=HOST_B, num_io_queues=1)  # 4 I/O controllers: the target's cap
    with pytest.raises(ConnectRejected) as rej:  # every kind is full: refused before any Connect
        env.connect(hostnqn=HOST_B, num_io_queues=1)
    assert rej.value.status == 6
    for c in mine + [other, theirs, more]:
        c.close()


def test_a_connect_flood_from_one_address_is_refused_and_other_hosts_still_connect(caplog):
    """Connections that never send their NVMe Connect: one address may hold at most what one host needs
    (an admin queue and --max-queues-per-host I/O queues), so a flood is refused at the CM and other
    hosts are not; the address is let in again once its queues time out."""
    from nvmeof_roce.nvme import cm
    env = PooledEnv(ResourceLimits(max_queues_per_host=8, connect_timeout=5.0))
    flooder = env.fabric.connector(ADDR1)
    idle = [flooder.connect(1, 32, 31, 0) for _ in range(9)]
    env.fabric.pump()
    with pytest.raises(ConnectRejected) as rej:
        flooder.connect(1, 32, 31, 0)
    assert rej.value.status == cm.STS_NO_RESOURCES
    assert f"refusing connections from {flooder.peer.rsplit(':', 1)[0]}" in caplog.text
    ctrl = env.connect(num_io_queues=2)  # another address: a whole host connects
    assert len(ctrl.io_queues) == 2 and ctrl.identify_controller() is not None
    env.advance(5.1)
    assert all(q.closed for q in idle)
    again = flooder.connect(1, 32, 31, 0)
    env.fabric.pump()
    assert not again.closed
