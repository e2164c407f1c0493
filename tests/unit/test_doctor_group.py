"""The doctor's gateway group checks (doctor/checks/group.py, doctor/group_source.py): group.cluster, group.members
and group.ana.  Against a development Ceph cluster with loopback gateways as test_gateway_group.py builds them
(group_env): the healthy group, a failover (the group away from home: a warning naming the failback command, the
fenced member a failure), and a group whose owner's lease lapsed with nobody taking it (read from RADOS directly,
as `doctor --config` does when no gateway answers).  The other branches on canned nvmeof_group_status answers."""
import json
import os
import socket
import threading
import time

import pytest

from group_env import LEASE, Gateway, dev_cluster, needs_ceph, run
from loopback_env import ADDR1, ADDR2
from test_gateway_group import seed
from nvmeof_roce.doctor import Context, DoctorOptions, run_checks
from nvmeof_roce.doctor.checks import group as checks
from nvmeof_roce.doctor.group_source import read_group_view
from nvmeof_roce.doctor.machine import Machine
from nvmeof_roce.doctor.report import render_text, to_json
from nvmeof_roce.errors import NvmeofError

GROUP_CHECK = [("host", "group", checks.check_gateway_group)]
FAILBACK_3 = "nvmeof-roce rpc nvmeof_group_failback '{\"ana_group\": 3}'"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from dev_cluster(tmp_path_factory)


def by_check(results):
    return {r.check: r for r in results}


def rpc_of(gw):
    """nvmeof_group_status on `gw`, as its control socket answers it (a method that changes nothing answers at
    once, on the loop), through JSON."""
    def rpc(method, _socket, _timeout):
        return json.loads(json.dumps(gw.control.call(method, {})))
    return rpc


def no_target(method, _socket, _timeout):
    raise NvmeofError("no running target found (no socket in /run/nvmeof-roce)", "start one")


def config_file(tmp_path, cluster, group, gateway, home, **more):
    path = tmp_path / f"{gateway}.json"
    path.write_text(json.dumps({"ports": [], "nvmeof_roce": {"group": {
        "name": group, "gateway": gateway, "ana_groups": home, "conf": str(cluster.conf), "id": gateway,
        "lease": LEASE, **more}}}))
    return str(path)


# ---------------------------------------------------------------------------------------- on the dev cluster

@needs_ceph
def test_a_healthy_group_is_ok_through_the_running_gateways_status(cluster):
    a = Gateway(cluster, "d1", "gw-a", [2], ADDR1, seed=seed())
    b = Gateway(cluster, "d1", "gw-b", [3], ADDR2)
    try:
        run([a, b], lambda: a.state(2) == "optimized" and b.state(3) == "optimized"
            and 3 in a.member.holders and a.member.read_at is not None, what="both serving, A's keeper reading B's lease")
        ctx = Context(Machine("/"), DoctorOptions(), group_rpc=rpc_of(a))
        results = run_checks(ctx, GROUP_CHECK)
        got = by_check(results)
        assert [r.check for r in results] == ["group.cluster", "group.members", "group.ana"], render_text(results)
        assert {r.status.value for r in results} == {"ok"}, render_text(results)
        assert all(r.subject == "d1" for r in results)
        members = {m["gateway"]: m for m in got["group.members"].details["members"]}
        assert members["gw-a"]["alive"] and members["gw-b"]["alive"], members
        assert "renewed its lease of ANA group(s) 3" in members["gw-b"]["why"]
        ana = got["group.ana"]
        assert ana.summary.startswith("2: gw-a (") and "3: gw-b (" in ana.summary, ana.summary
        remaining = {g["ana_group"]: g["lease_remaining"] for g in ana.details["ana_groups"]}
        assert 0 < remaining[2] <= LEASE and 0 < remaining[3] <= LEASE, remaining
        assert "nvmeof_group_status of gateway gw-a" in got["group.cluster"].evidence[0]
        # --json carries them as the other checks
        as_json = {r["check"]: r for r in json.loads(json.dumps(to_json(results)))}
        assert as_json["group.ana"]["status"] == "ok" and as_json["group.ana"]["details"]["ana_groups"]
    finally:
        b.close()
        a.close()


@needs_ceph
def test_after_a_failover_the_group_away_from_home_warns_with_the_failback_command(cluster):
    a = Gateway(cluster, "d2", "gw-a", [2], ADDR1, seed=seed())
    b = Gateway(cluster, "d2", "gw-b", [3], ADDR2)
    try:
        run([a, b], lambda: a.state(2) == "optimized" and b.state(3) == "optimized", what="both serving")
        b.kill()
        run([a, b], lambda: a.state(3) == "optimized", timeout=4 * LEASE, what="A taking ANA group 3 over")
        results = run_checks(Context(Machine("/"), DoctorOptions(), group_rpc=rpc_of(a)), GROUP_CHECK)
        got = by_check(results)
        ana = got["group.ana"]
        assert ana.status.value == "warn", render_text(results)
        assert "ANA group 3 is owned by gw-a, away from its home gw-b" in ana.summary
        assert FAILBACK_3 in ana.fix
        failover = ana.details["last_failover"]
        assert (failover["ana_group"], failover["previous"]) == (3, "gw-b") and failover["seconds"] > 0
        assert any(e.startswith("last failover: ANA group 3 taken over from gw-b by gw-a") for e in ana.evidence)
        # B was blocklisted by the take-over: a failure, and what becomes of it
        members = got["group.members"]
        assert members.status.value == "fail" and "gw-b" in members.summary
        assert "exits with status 75" in members.fix and "systemd restarts it" in members.fix
        assert got["group.cluster"].status.value == "ok"
    finally:
        b.member.fenced = True
        b.close()
        a.close()


@needs_ceph
def test_an_owner_whose_lease_lapsed_with_nobody_taking_it_fails_read_from_rados(cluster, tmp_path):
    """The only gateway stops renewing (its keeper gone): nobody takes its group.  No gateway answers the control
    socket, so the doctor reads the group from RADOS with --config's settings; then the cluster stops answering."""
    a = Gateway(cluster, "d3", "gw-a", [2], ADDR1, seed=seed())
    config = config_file(tmp_path, cluster, "d3", "gw-a", [2])
    try:
        run([a], lambda: a.state(2) == "optimized", what="A serving")
        view = read_group_view(config, None, 5.0, True, rpc=no_target)
        assert view.status is not None and not view.from_gateway, view
        assert {r.status.value for r in checks.group_results(view, time.time())} == {"ok"}
        a.kill()
        run([a], lambda: a.member.lease(2).holder() is None, timeout=3 * LEASE, what="A's lease lapsing")
        options = DoctorOptions(config=config, connect_timeout=5.0)
        results = run_checks(Context(Machine("/"), options, group_rpc=no_target), GROUP_CHECK)
        got = by_check(results)
        ana = got["group.ana"]
        assert ana.status.value == "fail", render_text(results)
        assert "ANA group 2: its owner gw-a's lease lapsed and nobody took it over" in ana.summary
        assert "no optimized path" in ana.summary and "blocklist" in ana.fix
        assert got["group.members"].status.value == "warn" and "gw-a" in got["group.members"].summary
        assert got["group.cluster"].status.value == "ok"
        assert "read as client.gw-a of " + str(cluster.conf) in got["group.cluster"].evidence[0]
        assert any("no running target found" in e for e in got["group.cluster"].evidence)
        cluster.pause()
        try:
            view = read_group_view(config, None, 2.0, True, rpc=no_target)
        finally:
            cluster.resume()
        (result,) = checks.group_results(view, time.time())
        assert (result.check, result.status.value) == ("group.cluster", "fail"), result
        assert str(cluster.conf) in result.summary and "client.gw-a" in result.summary, result.summary
        assert f"ceph -s -c {cluster.conf} --id gw-a" in result.fix
    finally:
        a.close()


# ---------------------------------------------------------------------------------------- canned answers

def status(**more):
    """nvmeof_group_status of gw-a in a healthy two-member group (service/group.py GroupMember.status)."""
    now = time.time()
    s = {"group": "g", "gateway": "gw-a", "instance_id": 11, "epoch": 7, "lease_seconds": 10, "failback": "manual",
         "fenced": False, "members": ["gw-a", "gw-b"],
         "member_records": [{"gateway": "gw-a", "addr": "10.0.0.1:0/1", "instance_id": 11, "started": now - 100,
                             "fence_addrs": []},
                            {"gateway": "gw-b", "addr": "10.0.0.2:0/2", "instance_id": 22, "started": now - 100,
                             "fence_addrs": []}],
         "ana_groups": [
             {"ana_group": 2, "home": "gw-a", "owner": "gw-a", "owner_instance": 11, "since": now - 90,
              "here": "optimized", "lease": "owner", "serving_for": 6.0, "lease_remaining": 6.0,
              "holder": {"gateway": "gw-a", "instance_id": 11}, "holder_read_ago": None, "failback": None},
             {"ana_group": 3, "home": "gw-b", "owner": "gw-b", "owner_instance": 22, "since": now - 90,
              "here": "inaccessible", "lease": "standby", "serving_for": None, "lease_remaining": 8.0,
              "holder": {"gateway": "gw-b", "instance_id": 22}, "holder_read_ago": 0.5, "failback": None}],
         "events": [], "event_counts": {},
         "cluster": {"conf": "/etc/ceph/ceph.conf", "id": "admin", "keyring": "/etc/ceph/k", "pool": "rbd",
                     "namespace": "", "read_ago": 1.0, "error": None}}
    s.update(more)
    return s


def results_of(s):
    view = read_group_view(None, None, 1.0, True, rpc=lambda *_: s)
    return by_check(checks.group_results(view, time.time()))


def test_canned_healthy_status_is_ok():
    got = results_of(status())
    assert {r.status.value for r in got.values()} == {"ok"}
    assert got["group.members"].summary == "2 member(s): gw-a (alive), gw-b (alive)"


def test_a_group_with_no_owner_fails_and_one_being_handed_back_warns():
    s = status()
    s["ana_groups"][1].update(owner=None, owner_instance=None, holder=None, lease_remaining=0.0)
    ana = results_of(s)["group.ana"]
    assert ana.status.value == "fail" and "ANA group 3 has no owner: its namespaces have no optimized path" \
        in ana.summary
    assert "start ANA group 3's home gateway gw-b" in ana.fix
    s["ana_groups"][1]["failback"] = "gw-b"
    ana = results_of(s)["group.ana"]
    assert ana.status.value == "warn" and "being handed back to gw-b" in ana.summary


def test_a_fenced_gateway_answering_fails_with_its_exit_and_restart():
    got = results_of(status(fenced=True))
    members = got["group.members"]
    assert members.status.value == "fail" and "gw-a" in members.summary
    assert "exits with status 75" in members.fix and "systemd restarts it" in members.fix


def test_a_member_blocklisted_in_rados_fails_and_a_silent_owner_warns():
    s = status(gateway=None)  # as ceph/group/inspect.py reads it: no answering gateway
    s["member_records"][1]["blocklisted"] = ["10.0.0.2:0/2"]
    assert results_of(s)["group.members"].status.value == "fail"
    s = status()
    s["ana_groups"][1].update(holder=None, lease_remaining=0.0)  # gw-b's lease is nobody's now
    got = results_of(s)
    assert got["group.members"].status.value == "warn" and "gw-b" in got["group.members"].summary
    assert got["group.ana"].status.value == "fail" and "gw-b's lease lapsed" in got["group.ana"].summary


def test_a_gateway_that_cannot_read_the_cluster_fails_naming_its_conf_and_keyring():
    s = status(cluster={"conf": "/etc/ceph/c.conf", "id": "gw", "keyring": "/etc/ceph/gw.keyring", "pool": "rbd",
                        "namespace": "", "read_ago": 31.0, "error": "reading nvmeof_roce.group.g: ETIMEDOUT"})
    cluster = results_of(s)["group.cluster"]
    assert cluster.status.value == "fail" and "unreachable from gw-a" in cluster.summary
    assert "ceph -s -c /etc/ceph/c.conf --id gw --keyring /etc/ceph/gw.keyring" in cluster.fix
    assert any("keyring /etc/ceph/gw.keyring" in e for e in cluster.evidence)
    s["cluster"]["read_ago"] = 1.0  # one failed pass: a warning
    assert results_of(s)["group.cluster"].status.value == "warn"


def test_nothing_to_check_is_one_skipped_line(tmp_path):
    (result,) = checks.group_results(read_group_view(None, None, 1.0, True, rpc=no_target), time.time())
    assert (result.check, result.status.value) == ("group", "skipped") and "--config" in result.summary
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"ports": []}))
    (result,) = checks.group_results(read_group_view(str(plain), None, 1.0, True, rpc=no_target), time.time())
    assert result.status.value == "skipped" and "has no nvmeof_roce.group" in result.summary
    (result,) = checks.group_results(read_group_view(None, None, 1.0, False, rpc=no_target), time.time())
    assert result.status.value == "skipped"  # a captured tree asks no running target


def test_a_config_whose_group_the_running_target_is_not_is_read_from_rados(tmp_path):
    path = tmp_path / "gw.json"
    path.write_text(json.dumps({"nvmeof_roce": {"group": {"name": "other", "gateway": "gw-x", "ana_groups": [4],
                                                          "keyring": "/etc/ceph/x.keyring"}}}))
    seen = []

    def inspect(settings, timeout):
        seen.append(settings)
        raise NvmeofError("cannot reach the Ceph cluster of /etc/ceph/ceph.conf as client.admin", "check it")
    view = read_group_view(str(path), None, 1.0, True, rpc=lambda *_: status(), inspect=inspect)
    assert seen[0]["name"] == "other" and "is a gateway of group g, not of other" in view.tried[0]
    (result,) = checks.group_results(view, time.time())
    assert result.status.value == "fail" and "ceph -s -c /etc/ceph/ceph.conf --id admin --keyring " \
        "/etc/ceph/x.keyring" in result.fix


def test_the_status_comes_over_the_control_socket(tmp_path):
    """The default source: control/client.py's call on --socket."""
    path = str(tmp_path / "t.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    asked = []

    def answer():
        conn, _ = server.accept()
        asked.append(json.loads(conn.recv(65536)))
        conn.sendall(json.dumps({"jsonrpc": "2.0", "id": 1, "result": status()}).encode() + b"\n")
        conn.close()
    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        options = DoctorOptions(socket=path)
        results = run_checks(Context(Machine(str(tmp_path)), options), GROUP_CHECK)  # a captured tree: --socket
    finally:
        thread.join(5)
        server.close()
        os.unlink(path)
    assert asked[0]["method"] == "nvmeof_group_status"
    assert [(r.check, r.status.value) for r in results] == [("group.cluster", "ok"), ("group.members", "ok"),
                                                          ("group.ana", "ok")]
