"""Gateways of a group (service/group.py) against a real development Ceph cluster (ceph/devcluster.py): each
gateway a Target on the loopback fabric with its own RADOS client, in one process.  The group's subsystems come
from RADOS; each ANA group is optimized on the gateway that holds its lease and inaccessible on the other; a change
by RPC on one gateway reaches the other; a gateway that stops renewing stops serving before its lease ends and the
survivor takes its group only after blocklisting its client (whose writes the cluster then refuses); failback
moves the group home when the admin asks."""
import errno
import time

import pytest

from group_env import Gateway, LEASE, call, dev_cluster, needs_ceph, run
from loopback_env import ADDR1, ADDR2, ram_ns
from nvmeof_roce.control.commands import _print_group
from nvmeof_roce.service import group as member_module
from nvmeof_roce.service.metrics import Metrics

pytestmark = needs_ceph

SUB = "nqn.2024-01.io.test:group"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from dev_cluster(tmp_path_factory)


def seed():
    return [{"nqn": SUB, "attr": {"allow_any_host": "1"},
             "namespaces": [ram_ns(1, ana_grpid=2), ram_ns(2, ana_grpid=3)]}]


def test_two_gateways_serve_the_groups_state_each_optimized_for_its_own_ana_group(cluster, capsys):
    a = Gateway(cluster, "g1", "gw-a", [2], ADDR1, seed=seed())
    b = Gateway(cluster, "g1", "gw-b", [3], ADDR2)  # no subsystems in its file: it takes the group's
    try:
        assert set(b.env.target.subsystems[SUB].namespaces) == {1, 2}
        run([a, b], lambda: (a.state(2), a.state(3), b.state(2), b.state(3)) ==
            ("optimized", "inaccessible", "inaccessible", "optimized"), what="each gateway optimized for its own")
        # a namespace added by RPC on B is served by A too (the group's change, through the watch)
        call(b, [a], "nvmf_subsystem_add_ns",
             {"nqn": SUB, "namespace": {"nsid": 3, "backend": "ram", "size": "1M", "anagrpid": 2}})
        run([a, b], lambda: 3 in a.env.target.subsystems[SUB].namespaces, what="A serving B's new namespace")
        # a host connected to both gateways sees two controllers of one subsystem: two controller IDs (the
        # Linux host refuses a duplicate), from each gateway's own range
        ctrl_a, ctrl_b = a.env.connect(SUB, ADDR1), b.env.connect(SUB, ADDR2)
        (a_low, a_high), (b_low, b_high) = member_module.cntlid_range([2]), member_module.cntlid_range([3])
        assert a_low <= ctrl_a.cntlid <= a_high < b_low <= ctrl_b.cntlid <= b_high, (ctrl_a.cntlid, ctrl_b.cntlid)
        ctrl_a.close()
        ctrl_b.close()
        status = a.member.status()
        assert status["members"] == ["gw-a", "gw-b"]
        assert {g["ana_group"]: g["owner"] for g in status["ana_groups"]} == {2: "gw-a", 3: "gw-b"}
        # `target status` and the metrics show it
        _print_group(status)
        shown = capsys.readouterr().out
        assert "gateway group g1: this gateway gw-a" in shown and "ANA GROUP" in shown, shown
        metrics = Metrics(a.env.target)
        metrics.group = a.member
        metrics.tick()
        text = metrics.text()
        assert 'nvmeof_roce_group_ana_optimized{ana_group="2",group="g1",owner="gw-a"} 1.0' in text, text
        assert 'nvmeof_roce_group_ana_optimized{ana_group="3",group="g1",owner="gw-b"} 0.0' in text, text
        assert 'nvmeof_roce_group_fenced{group="g1"} 0.0' in text
    finally:
        b.close()
        a.close()


def blocklisted(cluster):
    out = cluster.ceph("osd", "blocklist", "ls")
    return [line.split()[0] for line in out.splitlines() if line.strip() and not line.startswith("listed")]


def test_a_gateway_that_stops_renewing_stops_serving_before_the_survivor_fences_it_and_takes_its_group(cluster):
    a = Gateway(cluster, "g2", "gw-a", [2], ADDR1, seed=seed())
    b = Gateway(cluster, "g2", "gw-b", [3], ADDR2)
    try:
        run([a, b], lambda: b.state(3) == "optimized" and a.state(2) == "optimized", what="both serving")
        b_addr = b.member.lease(3).member.addr
        b.kill()  # B's keeper gone: no renewals; its loop still runs (it must stop serving by itself)
        run([a, b], lambda: a.state(3) == "optimized", timeout=4 * LEASE, what="A taking ANA group 3 over")
        # B stopped serving before A took the group (both clocks are this process's monotonic clock)
        stopped = [e for e in b.member.history if e["event"] == "stopped" and e["ana_group"] == 3]
        took = [e for e in a.member.history if e["event"] == "took_over" and e["ana_group"] == 3]
        assert stopped and took and stopped[0]["at"] < took[0]["at"], (b.member.history, a.member.history)
        assert b.state(3) == "inaccessible" and took[0]["previous"] == "gw-b"
        # B's client was blocklisted before A owned the group, and the cluster refuses its writes now
        assert b_addr in blocklisted(cluster), (b_addr, blocklisted(cluster))
        with pytest.raises(Exception) as refused:
            b.member.ioctx.write_full("late-write-from-b", b"stale")
        assert getattr(refused.value, "errno", None) in (errno.ESHUTDOWN, errno.EBLOCKLISTED
                                                         if hasattr(errno, "EBLOCKLISTED") else errno.ESHUTDOWN), \
            refused.value
        status = a.member.status()
        assert {g["ana_group"]: g["owner"] for g in status["ana_groups"]} == {2: "gw-a", 3: "gw-a"}
    finally:
        b.member.fenced = True  # its client is blocklisted: nothing to release
        b.close()
        a.close()


def test_the_keeper_passes_just_after_another_gateways_lease_expires_not_a_whole_interval_later(cluster):
    """The keeper's pass is every lease/6, or sooner: just after the earliest expiry of another gateway's lease
    its last pass read (a dead owner's group is taken up to lease/6 sooner), never more often than every
    EXPIRY_RECHECK seconds (an OSD clock ahead of ours: the lock still held at the pass)."""
    from nvmeof_roce.service.group import EXPIRY_RECHECK
    a = Gateway(cluster, "g6", "gw-a", [2], ADDR1, seed=seed())
    b = Gateway(cluster, "g6", "gw-b", [3], ADDR2)
    try:
        run([a, b], lambda: b.state(3) == "optimized" and a.state(2) == "optimized", what="both serving")
        m = a.member
        interval = m._interval()
        run([a, b], lambda: m._expiries, what="A's keeper reading B's lease")  # B's lease, renewed: in the future
        held = b.member.lease(3).holder().expires
        assert any(abs(e - held) < LEASE for e in m._expiries), (m._expiries, held)
        soon = interval - EXPIRY_RECHECK - 0.1  # expires before the next regular pass
        m._expiries = [m.wall() + soon]
        assert soon <= m._next_pass() <= soon + EXPIRY_RECHECK + 0.05 < interval
        m._expiries = [m.wall() - 5]  # expired by the OSD's clock, held still at the last read
        assert m._next_pass() == EXPIRY_RECHECK
        m._expiries = [m.wall() + 10 * LEASE]
        assert m._next_pass() == interval
    finally:
        b.close()
        a.close()


def test_failback_moves_the_group_home_when_the_admin_asks(cluster):
    a = Gateway(cluster, "g3", "gw-a", [2], ADDR1, seed=seed())
    b = Gateway(cluster, "g3", "gw-b", [3], ADDR2)
    try:
        run([a, b], lambda: b.state(3) == "optimized", what="B serving group 3")
        b.kill()
        run([a, b], lambda: a.state(3) == "optimized", timeout=4 * LEASE, what="A taking group 3 over")
        b.member.fenced = True
        b.close()
        b = Gateway(cluster, "g3", "gw-b", [3], ADDR2, client_id="gw-b-restarted")  # the restarted gateway
        run([a, b], lambda: b.member.snapshot is not None, what="B rejoined")
        assert b.state(3) == "inaccessible" and a.state(3) == "optimized"  # manual failback: it waits
        answer = b.control.call("nvmeof_group_failback", {"ana_group": 3})
        run([a, b], lambda: answer.part is not None, what="the failback request")
        assert answer.part.get("result", {}).get("requested"), answer.part
        run([a, b], lambda: b.state(3) == "optimized" and a.state(3) == "inaccessible", timeout=4 * LEASE,
            what="group 3 back on B")
        assert any(e["event"] == "handed_back" for e in a.member.history)
        assert not any(e["event"] == "took_over" for e in b.member.history)  # a clean handover: no blocklist
    finally:
        b.close()
        a.close()


def test_every_client_a_gateway_serves_through_is_announced_before_it_serves_and_fenced_on_take_over(cluster):
    """The native data path opens a RADOS client of its own per rbd namespace: it is announced (in the member
    record) before the handle is handed over, and a take-over blocklists it with the gateway's own client."""
    from nvmeof_roce.ceph import clients
    from nvmeof_roce.ceph.bindings import rados_and_rbd
    a = Gateway(cluster, "g4", "gw-a", [2], ADDR1, seed=seed())
    b = Gateway(cluster, "g4", "gw-b", [3], ADDR2)
    rados, _ = rados_and_rbd()
    extra = rados.Rados(conffile=str(cluster.conf), rados_id="gw-b-native")  # stands for B's native handle
    extra.connect()
    try:
        clients.announce(extra.get_addrs())  # what RbdBackend.native_handle does before handing the handle over
        record = a.member.store.read().members["gw-b"]
        assert len(record.fence_addrs) == 1 and record.fence_addrs[0] != record.addr
        b.kill()
        run([a, b], lambda: a.state(3) == "optimized", timeout=4 * LEASE, what="A taking ANA group 3 over")
        assert set([record.addr] + record.fence_addrs) <= set(blocklisted(cluster))
        with extra.open_ioctx("rbd") as ioctx, pytest.raises(Exception) as refused:
            ioctx.write_full("late-write-from-b-native", b"stale")
        assert getattr(refused.value, "errno", None) == errno.ESHUTDOWN, refused.value
    finally:
        extra.shutdown()
        b.member.fenced = True
        b.close()
        a.close()


def test_the_keeper_works_from_the_watchs_latest_read_and_reads_itself_only_when_it_is_old(cluster):
    """The watch reads the group's state at every notify and at least every poll interval; the keeper's passes
    (every lease/6) use that read while it is recent, and read the state themselves once it is not."""
    import threading
    a = Gateway(cluster, "g5", "gw-a", [2], ADDR1, seed=seed())
    reads = []
    real = a.member.store.read

    def counted():
        reads.append(threading.current_thread().name)
        return real()
    a.member.store.read = counted
    try:
        passes = a.member.read_at
        run([a], lambda: a.state(2) == "optimized", what="A serving")
        time.sleep(4 * a.member._interval())
        assert a.member.read_at != passes  # the keeper's passes went on
        assert "group g5" not in reads, reads  # ... on the watch's reads
        a.member._watch.poll_interval = 0.5  # a watch that stops reading: its snapshot grows old
        a.member._watch.close()
        run([a], lambda: "group g5" in reads, timeout=5, what="the keeper reading the state itself")
        assert a.state(2) == "optimized" and a.member.lease(2).may_serve()
    finally:
        a.member.store.read = real
        a.close()
