"""A gateway group on two lab guests (tests/twonode/group_node.py): the Ceph cluster and gateway gw-a on one, gateway
gw-b and the kernel host on the other; one subsystem, two RBD namespaces in two ANA groups.

`kill`: the owner of ANA group 2 SIGKILLed under fio verify; `cut`: gw-b's node cut from the Ceph cluster (RoCE
still up) for a few leases.
The checks read what the nodes left in the share: results, both gateways' logs."""
import datetime
import re
from pathlib import Path

import pytest

from lab_nodes import two_nodes

pytestmark = pytest.mark.twonode

TARGET_IP, HOST_IP = "10.99.1.1", "10.99.1.2"
LEASE = 10


def group_scenario(tmp_path_factory, scenario: str):
    """Run one scenario of group_node.py on two guests: the share it left and both nodes' results."""
    share = tmp_path_factory.mktemp(f"group-{scenario}")
    proc, results = two_nodes(share, scenario, script="group_node.py", timeout=2400)
    assert proc.returncode == 0 and results["host"] and results["target"], \
        proc.stdout[-6000:] + proc.stderr[-3000:]
    return share, results


def log_time(share: Path, log: str, pattern: str, offset: float) -> float:
    """When `pattern` was first logged in `log`, on the lab host's clock (the guest's offset taken away)."""
    for line in (share / log).read_text().splitlines():
        if re.search(pattern, line):
            stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            return stamp.replace(tzinfo=datetime.timezone.utc).timestamp() - offset
    raise AssertionError(f"{log} has no line matching {pattern!r}")


def two_paths(paths: dict, optimized: str):
    return paths == {f"traddr={optimized}": "optimized",
                     f"traddr={HOST_IP if optimized == TARGET_IP else TARGET_IP}": "inaccessible"}


@pytest.fixture(scope="module")
def kill(tmp_path_factory):
    return group_scenario(tmp_path_factory, "kill")


def test_each_namespace_has_an_optimized_path_through_its_owner_and_an_inaccessible_one(kill):
    _, r = kill
    paths = r["host"]["paths_at_start"]
    assert two_paths(paths["1"], TARGET_IP) and two_paths(paths["2"], HOST_IP), paths


def test_the_owner_killed_under_verify_its_group_moves_fenced_and_nothing_is_lost(kill):
    share, r = kill
    host, target = r["host"], r["target"]
    for nsid in ("1", "2"):
        fio = host[f"fio_{nsid}"]
        assert fio["error"] == 0 and fio["returncode"] == 0 and fio["write_ios"] > 0, fio
    # the path through gw-b is optimized now (the dead gateway's path keeps the last state the host read)
    assert host["paths_after_kill"]["1"][f"traddr={HOST_IP}"] == "optimized", host["paths_after_kill"]
    # gw-a's every RADOS client is blocklisted, before gw-b owned the group (gw-b's log says so, in that order)
    gw_a = target["state_before_take_over"]["members"]["gw-a"]
    assert set([gw_a["addr"]] + gw_a["fence_addrs"]) <= set(target["blocklist"]), (gw_a, target["blocklist"])
    assert gw_a["fence_addrs"], "the native path's clients were not announced"
    log = (share / "gw-b.log").read_text()
    assert re.search(r"blocklisted .*\n(.*\n)*.*ANA group 2 took over from gw-a \(blocklisted first\)", log), log[-3000:]
    took = log_time(share, "gw-b.log", r"ANA group 2 is optimized on gw-b", host["clock_offset"])
    gap = took - target["killed_at"] + target["clock_offset"]
    print(f"failover: gw-a killed -> group 2 optimized on gw-b in {gap:.1f} s (lease {LEASE} s); longest fio write "
          f"{host['fio_1']['max_write_ms'] / 1000:.1f} s on ns 1, {host['fio_2']['max_write_ms'] / 1000:.1f} s on ns 2")
    assert gap < 3 * LEASE, gap
    assert target["state_after_take_over"]["owners"]["2"] == "gw-b"


def test_a_reservation_made_through_one_gateway_is_reported_and_enforced_through_the_other(kill):
    _, r = kill
    host = r["host"]
    through_a, through_b = host["resv_through_a"], host["resv_through_b"]
    assert through_a["rtype"] == 1 and through_a["regctlext"] and through_a["regctlext"][0]["rcsts"] == 1, through_a
    assert through_b == through_a, (through_a, through_b)
    other = host["other_host_write_through_b"]
    assert other["returncode"] != 0 and "Reservation Conflict" in other["output"], other


def test_a_resize_by_rpc_on_one_gateway_reaches_the_host_on_both_paths(kill):
    _, r = kill
    host = r["host"]
    assert "error" not in host["resize"], host["resize"]
    assert host["resized_head_bytes"] == 320 << 20
    assert host["path_sizes_ns2"] and set(host["path_sizes_ns2"].values()) == {320 << 20}, host["path_sizes_ns2"]


def test_the_restarted_gateway_rejoins_and_takes_its_group_back_on_failback(kill):
    _, r = kill
    host, target = r["host"], r["target"]
    assert target["failback"].get("requested") or "result" in target["failback"], target["failback"]
    assert two_paths(host["paths_after_failback"]["1"], TARGET_IP), host["paths_after_failback"]
    assert host["fio_after_failback"]["error"] == 0 and host["fio_after_failback"]["write_ios"] > 0
    assert target["state_at_end"]["owners"] == {"2": "gw-a", "3": "gw-b"}
    assert target["gw_a_exit"] == 0 and host["gw_b_exit"] == 0


@pytest.fixture(scope="module")
def cut(tmp_path_factory):
    return group_scenario(tmp_path_factory, "cut")


def test_the_isolated_gateway_stops_before_the_survivor_takes_over_and_nothing_is_lost(cut):
    share, r = cut
    host, target = r["host"], r["target"]
    stopped = log_time(share, "gw-b.log", r"ANA group 3 is inaccessible on gw-b", host["clock_offset"])
    took = log_time(share, "gw-a.log", r"ANA group 3 took over from gw-b", target["clock_offset"])
    print(f"cut: gw-b stopped serving group 3 {took - stopped:.1f} s before gw-a took it over "
          f"({stopped - host['cut_at'] + host['clock_offset']:.1f} s after the cut)")
    assert stopped < took, (stopped, took)
    assert host["fio_2"]["error"] == 0 and host["fio_2"]["returncode"] == 0, host["fio_2"]
    assert two_paths(host["paths_after_cut"]["2"], TARGET_IP), host["paths_after_cut"]
    assert host["gw_b_exit"] == 75, host["gw_b_exit"]  # fenced: EXIT_FENCED, for its unit to restart it
    assert "fenced" in (share / "gw-b.log").read_text()
    assert target["state_at_end"]["owners"]["3"] == "gw-a"
