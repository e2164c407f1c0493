"""doctor checks against recorded hosts: a healthy mlx5 RoCE host and one overlay per fault.

The trees under fixtures/doctor/ hold sysfs/procfs/configfs files as the kernel prints them
and tool outputs as the tools print them (fixtures/doctor/README.md says where each comes from).
"""
import json

import pytest

from doctor_fixtures import build_tree, diagnose, sleep_then_apply, status_of
from nvmeof_roce.doctor.result import Status

TRADDR = "192.168.100.2"  # a target across the fabric; this host is 192.168.100.1 on ens1f0np0


@pytest.fixture
def healthy(tmp_path):
    return diagnose(build_tree(tmp_path), traddr=TRADDR)


def test_healthy_hardware_host_has_no_warning_or_failure(healthy):
    problems = {k: (r.status.value, r.summary) for k, r in healthy.items() if r.status in (Status.WARN, Status.FAIL)}
    assert problems == {}
    assert status_of(healthy, "nvme.target 192.168.100.2:4420") == "skipped"  # no initiator in unit tests


@pytest.mark.parametrize("label, expected", [
    ("stack.modules", "mlx5_ib"),
    ("stack.device_files", "not world-writable"),
    ("stack.memlock", "unlimited"),
    ("device.present", "mlx5_0"),
    ("device.soft_roce mlx5_0", "MT4119"),
    ("port.state mlx5_0/1", "ACTIVE, LinkUp, 100 Gb/sec"),
    ("port.link_layer mlx5_0/1", "Ethernet"),
    ("port.mtu mlx5_0/1", "RoCE MTU 4096, ens1f0np0 MTU 9000"),
    ("address.gids mlx5_0/1", "192.168.100.1 (IPv4, gid 3"),
    ("address.roce_mode mlx5_0/1", "RoCE v2, ToS 106 (DSCP 26)"),
    ("address.traddr_gid", "192.168.100.1 (IPv4) has RoCE v2 GID 3 on mlx5_0/1"),
    ("address.route", "leaves through ens1f0np0 (mlx5_0/1)"),
    ("fabric.pfc mlx5_0/1", "PFC on priority 3; RoCE DSCP 26 -> priority 3"),
    ("fabric.ecn mlx5_0/1", "priority 3"),
    ("fabric.counters mlx5_0/1", "no pause, discard or error counter growing"),
    ("nvme.host_identity", "nqn.2014-08.org.nvmexpress:uuid:4c4c4544"),
    ("nvme.firewall", "no rule drops UDP 4791"),
    ("kernel.messages", "no RDMA/NVMe-oF errors"),
])
def test_healthy_host_each_check_ok(healthy, label, expected):
    result = healthy[label]
    assert result.status is Status.OK, (result.summary, result.evidence)
    assert expected in result.summary
    assert result.evidence, "every result says what it read"


def test_healthy_ipv6_gid_is_listed(healthy):
    assert "fd00:100::1 (IPv6, gid 5" in healthy["address.gids mlx5_0/1"].summary


def test_static_nonzero_counters_are_history_not_warnings(healthy):
    result = healthy["fabric.counters mlx5_0/1"]
    assert result.details["nonzero"]["ethtool/rx_prio3_pause"] == 1188
    assert any("non-zero, not growing" in e for e in result.evidence)


def test_port_down(tmp_path):
    results = diagnose(build_tree(tmp_path, "port-down"), traddr=TRADDR)
    state = results["port.state mlx5_0/1"]
    assert state.status is Status.FAIL
    assert "1: DOWN" in state.summary and "3: Disabled" in state.summary
    assert "ip link set ens1f0np0 up" in state.fix
    assert any("operstate down" in e for e in state.evidence)
    # the address's only GID is on that port: rdma_cm cannot use it either
    gid = results["address.traddr_gid"]
    assert gid.status is Status.FAIL and "not ACTIVE" in gid.summary


def test_missing_gid_for_the_address(tmp_path):
    """192.168.100.1 sits on br0 (a bridge over the NIC): no RoCE GID exists for it."""
    results = diagnose(build_tree(tmp_path, "missing-gid"), traddr=TRADDR)
    gid = results["address.traddr_gid"]
    assert gid.status is Status.FAIL
    assert "192.168.100.1 has no RoCE GID on any RDMA port (the route uses br0)" in gid.summary
    assert "ens1f0np0" in gid.fix and "bridges" in gid.fix
    route = results["address.route"]
    assert route.status is Status.FAIL and "br0, which has no RDMA device" in route.summary
    assert "ip route add 192.168.100.2 dev NETDEV" in route.fix
    port_gids = results["address.gids mlx5_0/1"]
    assert port_gids.status is Status.FAIL and "only link-local" in port_gids.summary
    assert "ip addr add ADDRESS/PREFIX dev ens1f0np0" in port_gids.fix


def test_missing_gid_without_traddr_still_fails_the_port(tmp_path):
    results = diagnose(build_tree(tmp_path, "missing-gid"))
    assert status_of(results, "address.gids mlx5_0/1") == "fail"
    assert status_of(results, "address.traddr_gid") == "skipped"
    assert status_of(results, "address.route") == "skipped"


def test_low_mtu(tmp_path):
    results = diagnose(build_tree(tmp_path, "low-mtu"))
    mtu = results["port.mtu mlx5_0/1"]
    assert mtu.status is Status.WARN
    assert mtu.summary.startswith("RoCE MTU 1024, ens1f0np0 MTU 1500: below 4200")
    assert "ip link set ens1f0np0 mtu 9000" in mtu.fix and "switch" in mtu.fix
    assert mtu.details["active_mtu"] == 1024 and mtu.details["netdev_mtu"] == 1500


def test_rxe_fallback_on_a_hardware_nic(tmp_path):
    """mlx5_ib never loaded and rxe0 was created on the ConnectX netdev: a silent software fallback."""
    results = diagnose(build_tree(tmp_path, "rxe-fallback"))
    soft = results["device.soft_roce rxe0"]
    assert soft.status is Status.WARN
    assert "Soft-RoCE" in soft.summary and "mlx5_core NIC" in soft.summary and "mlx5_ib is not in use" in soft.summary
    assert "modprobe mlx5_ib" in soft.fix and "rdma link delete rxe0" in soft.fix
    assert any("parent: ens1f0np0" in e for e in soft.evidence)
    assert "device.soft_roce mlx5_0" not in results
    # Soft-RoCE needs no jumbo frames warning, and its (unset) ToS lands outside the PFC priority
    assert status_of(results, "port.mtu rxe0/1") == "ok"
    pfc = results["fabric.pfc rxe0/1"]
    assert pfc.status is Status.WARN and "DSCP 0) maps to priority 0" in pfc.summary
    assert status_of(results, "stack.modules") == "ok"
    assert "rdma_rxe" in results["stack.modules"].summary


def test_pause_counters_growing_between_two_samples(tmp_path):
    root = build_tree(tmp_path, "pause-growing")
    sleep = sleep_then_apply(root, "pause-growing")
    results = diagnose(root, sleep=sleep, interval=2.0)
    assert sleep.calls == [2.0]
    counters = results["fabric.counters mlx5_0/1"]
    assert counters.status is Status.WARN
    assert "pause frames growing" in counters.summary and "rx_prio3_pause" in counters.summary
    assert "ethtool/rx_prio3_pause: +4203 in 2 s (now 5391)" in counters.evidence
    assert "pause storm" in counters.fix and "ECN/DCQCN" in counters.fix
    # CNPs grew too: reported as DCQCN at work, not as a problem of their own
    assert counters.details["growing"]["congestion"] == {"hw_counters/np_cnp_sent": 146,
                                                         "hw_counters/np_ecn_marked_roce_packets": 150}
    assert "errors" not in counters.summary


def test_one_sample_when_interval_is_zero(tmp_path):
    root = build_tree(tmp_path, "pause-growing")
    sleep = sleep_then_apply(root, "pause-growing")
    results = diagnose(root, sleep=sleep, interval=0)
    assert sleep.calls == []
    counters = results["fabric.counters mlx5_0/1"]
    assert counters.status is Status.OK and "growth not measured" in counters.summary


def test_firewall_drop_warns_on_hardware_and_fails_on_soft_roce(tmp_path):
    hardware = diagnose(build_tree(tmp_path / "hw", "firewall-drop"))
    firewall = hardware["nvme.firewall"]
    assert firewall.status is Status.WARN
    assert "-p udp -m udp --dport 4791 -j DROP" in firewall.summary and "bypasses" in firewall.summary
    assert any("nft not installed (apt-get install nftables)" in e for e in firewall.evidence)
    soft = diagnose(build_tree(tmp_path / "rxe", "rxe-fallback", "firewall-drop"))["nvme.firewall"]
    assert soft.status is Status.FAIL
    assert "udp dport 4791 accept" in soft.fix and "iptables -I INPUT -p udp --dport 4791 -j ACCEPT" in soft.fix


def test_kernel_defaults_world_writable_uverbs_and_low_memlock(tmp_path):
    results = diagnose(build_tree(tmp_path, "defaults-unhardened"))
    files = results["stack.device_files"]
    assert files.status is Status.WARN and "/dev/infiniband/uverbs0" in files.summary
    assert "crw-rw-rw-" in " ".join(files.evidence)
    assert 'MODE="0660"' in files.fix
    memlock = results["stack.memlock"]
    assert memlock.status is Status.WARN and "8 MiB" in memlock.summary
    assert "memlock unlimited" in memlock.fix and "LimitMEMLOCK=infinity" in memlock.fix


def test_kernel_errors_are_explained(tmp_path):
    results = diagnose(build_tree(tmp_path, "kernel-errors"))
    messages = results["kernel.messages"]
    assert messages.status is Status.WARN
    errors = messages.details["errors"]
    assert set(errors) == {"connection establishment failed", "connect rejected, no listener",
                           "transport retry exceeded", "work requests flushed", "host not allowed"}
    assert "never acknowledged" in errors["transport retry exceeded"]["meaning"]
    assert "allowed_hosts" in messages.fix
    assert "nothing listens" in errors["connect rejected, no listener"]["meaning"]


def test_kernel_log_falls_back_to_dev_kmsg_when_dmesg_is_restricted(tmp_path):
    results = diagnose(build_tree(tmp_path, "dmesg-restricted"))
    messages = results["kernel.messages"]
    assert messages.status is Status.WARN
    assert messages.details["source"] == "/dev/kmsg"
    assert list(messages.details["errors"]) == ["transport retry exceeded"]
    assert messages.details["lines"] == 2  # the continuation lines (" SUBSYSTEM=...") are not messages


def test_device_filter(tmp_path):
    results = diagnose(build_tree(tmp_path), device="mlx9_9")
    present = results["device.present"]
    assert present.status is Status.FAIL and "no RDMA device named mlx9_9" in present.summary
    assert "mlx5_0" in present.fix


def test_empty_host_fails_with_the_fix(tmp_path):
    root = tmp_path / "empty"
    (root / "proc").mkdir(parents=True)
    (root / "proc" / "modules").write_text("")
    results = diagnose(root)
    assert status_of(results, "device.present") == "fail"
    assert "rdma link add rxe0 type rxe netdev" in results["device.present"].fix
    assert status_of(results, "stack.modules") == "fail"
    # every tool is reported as not run on a tree without recordings
    assert status_of(results, "nvme.firewall") == "skipped"


class FakeEntry:
    def __init__(self, subnqn, traddr, trsvcid):
        self.subnqn, self.traddr, self.trsvcid = subnqn, traddr, trsvcid


def test_target_reachable(tmp_path):
    calls = []

    def discover(traddr, trsvcid, timeout, hostnqn):
        calls.append((traddr, trsvcid, timeout, hostnqn))
        return [FakeEntry("nqn.2014-08.org.nvmexpress.discovery", TRADDR, "4420"),
                FakeEntry("nqn.2024-01.io.example:storage01", TRADDR, "4420")]

    results = diagnose(build_tree(tmp_path), traddr=TRADDR, discover=discover, connect_timeout=3.0)
    target = results["nvme.target 192.168.100.2:4420"]
    assert target.status is Status.OK and "2 entries" in target.summary
    assert "nqn.2024-01.io.example:storage01 at 192.168.100.2:4420" in target.evidence
    assert calls == [(TRADDR, 4420, 3.0, "nqn.2014-08.org.nvmexpress:uuid:4c4c4544-0051-3610-8052-b4c04f4a4d32")]


def test_target_unreachable_fails_with_the_likely_causes(tmp_path):
    class ConnectRejected(Exception):
        status = 8

    def discover(*args):
        raise ConnectRejected("connection rejected by the target: CM reject status 8")

    results = diagnose(build_tree(tmp_path), traddr=TRADDR, trsvcid=4421, discover=discover)
    target = results["nvme.target 192.168.100.2:4421"]
    assert target.status is Status.FAIL
    assert "cannot reach 192.168.100.2:4421: ConnectRejected" in target.summary
    assert "nothing listens on 192.168.100.2:4421" in target.fix and "allowed_hosts" in target.fix
    assert "UDP 4791" in target.fix


def test_target_timeout_points_at_the_path(tmp_path):
    def discover(*args):
        raise TimeoutError("RDMA CM connect timed out after 5 s")

    target = diagnose(build_tree(tmp_path), traddr=TRADDR, discover=discover)["nvme.target 192.168.100.2:4420"]
    assert target.status is Status.FAIL and "no answer from 192.168.100.2:4420" in target.fix


def test_target_skipped_when_the_initiator_is_missing(tmp_path):
    def discover(*args):
        raise ModuleNotFoundError("No module named 'pyverbs'")

    target = diagnose(build_tree(tmp_path), traddr=TRADDR, discover=discover)["nvme.target 192.168.100.2:4420"]
    assert target.status is Status.SKIPPED and "pyverbs" in target.summary


def test_traddr_must_be_an_ip_literal(tmp_path):
    results = diagnose(build_tree(tmp_path), traddr="storage01.example")
    assert status_of(results, "address.route") == "fail"
    assert "not an IP address" in results["address.route"].summary


def test_a_crashing_check_is_reported_not_fatal(tmp_path, monkeypatch):
    from nvmeof_roce.doctor.checks import stack

    def broken(ctx):
        raise RuntimeError("boom")

    monkeypatch.setattr(stack, "check_memlock_limit", broken)
    from nvmeof_roce.doctor import checks
    monkeypatch.setattr(checks, "CHECKS", [("host", "stack.memlock", broken)] + checks.CHECKS[3:4])
    results = diagnose(build_tree(tmp_path))
    assert results["stack.memlock"].status is Status.WARN
    assert "RuntimeError: boom" in results["stack.memlock"].summary
    assert results["device.present"].status is Status.OK


def test_real_lab_rxe0_capture_replays(tmp_path):
    """fixtures/doctor/rxe0-lab was captured in the lab guest with `doctor --capture --traddr 10.99.0.1`."""
    from doctor_fixtures import FIXTURES

    results = diagnose(FIXTURES / "rxe0-lab", traddr="10.99.0.1", interval=0)
    expected = {
        "stack.modules": "ok", "stack.device_files": "warn", "stack.memlock": "ok", "stack.nvme_auth": "ok",
        "stack.native": "skipped",  # about the installation running doctor, not a captured tree
        "device.present": "ok",
        "device.soft_roce rxe0": "warn", "port.state rxe0/1": "ok", "port.link_layer rxe0/1": "ok",
        "port.mtu rxe0/1": "ok", "address.gids rxe0/1": "ok", "address.roce_mode rxe0/1": "ok",
        "address.traddr_gid": "ok", "address.route": "ok", "address.path_mtu": "skipped",
        "fabric.pfc rxe0/1": "skipped",
        "fabric.ecn rxe0/1": "skipped", "fabric.counters rxe0/1": "ok",
        "nvme.host_identity": "warn",  # the lab image's hostid is not the UUID of its hostnqn
        "nvme.firewall": "ok", "nvme.target 10.99.0.1:4420": "skipped", "kernel.messages": "ok",
        "group": "skipped",  # a captured tree, no --config: no gateway group to check
    }
    assert {k: r.status.value for k, r in results.items()} == expected
    assert results["address.gids rxe0/1"].summary == "RoCE v2 GIDs: 10.99.0.1 (IPv4, gid 1, rxenet0)"
    assert results["port.state rxe0/1"].summary == "ACTIVE, LinkUp, 2.5 Gb/sec (1X SDR)"
    assert results["address.route"].details["local"] is True
    assert "rxenet0" in results["device.soft_roce rxe0"].summary


def test_captured_tree_never_probes_the_live_network(tmp_path):
    from nvmeof_roce.doctor.discovery_probe import discover_with_userspace_initiator

    results = diagnose(build_tree(tmp_path), traddr=TRADDR, discover=discover_with_userspace_initiator)
    target = results["nvme.target 192.168.100.2:4420"]
    assert target.status is Status.SKIPPED and "captured tree" in target.summary


def test_ipv6_traddr(tmp_path):
    results = diagnose(build_tree(tmp_path), traddr="fd00:100::2")
    gid = results["address.traddr_gid"]
    assert gid.status is Status.OK and gid.summary.startswith("fd00:100::1 (IPv6) has RoCE v2 GID 5 on mlx5_0/1")
    route = results["address.route"]
    assert route.status is Status.OK and route.details["family"] == "IPv6"


def test_pfc_off_everywhere(tmp_path):
    from doctor_fixtures import record_tool

    root = build_tree(tmp_path)
    record_tool(root, ["dcb", "-j", "pfc", "show", "dev", "ens1f0np0"],
                '{"pfc_cap":8,"macsec_bypass":false,"delay":0,"prio_pfc":[false,false,false,false,false,false,false,false]}\n')
    pfc = diagnose(root)["fabric.pfc mlx5_0/1"]
    assert pfc.status is Status.WARN and "PFC is off on every priority of ens1f0np0" in pfc.summary
    assert "dcb pfc set dev ens1f0np0 prio-pfc 3:on" in pfc.fix and "default_roce_tos" in pfc.fix


def test_pfc_from_mlnx_qos_when_dcb_is_missing(tmp_path):
    from doctor_fixtures import mark_missing, record_tool
    from test_doctor_parsers import MLNX_QOS

    root = build_tree(tmp_path)
    mark_missing(root, "dcb")
    record_tool(root, ["mlnx_qos", "-i", "ens1f0np0"], MLNX_QOS)
    pfc = diagnose(root)["fabric.pfc mlx5_0/1"]
    assert pfc.status is Status.OK, pfc.evidence
    assert pfc.summary == "PFC on priority 3; RoCE DSCP 26 -> priority 3"
    assert pfc.evidence[0] == "mlnx_qos -i ens1f0np0: PFC on priorities [3], trust dscp"


def test_pfc_from_lldptool_last(tmp_path):
    from doctor_fixtures import mark_missing, record_tool

    root = build_tree(tmp_path)
    mark_missing(root, "dcb", "mlnx_qos")
    record_tool(root, ["lldptool", "-t", "-i", "ens1f0np0", "-V", "PFC"],
                "IEEE 8021QAZ PFC TLV\n\t Willing: yes\n\t MACsec Bypass Capable: no\n"
                "\t PFC capable traffic classes: 8\n\t PFC enabled: 3\n")
    pfc = diagnose(root)["fabric.pfc mlx5_0/1"]
    assert pfc.status is Status.OK and pfc.summary.startswith("PFC on priority 3")


def test_pfc_skipped_when_no_dcb_tool_is_installed(tmp_path):
    from doctor_fixtures import mark_missing

    root = build_tree(tmp_path)
    mark_missing(root, "dcb", "mlnx_qos", "lldptool")
    pfc = diagnose(root)["fabric.pfc mlx5_0/1"]
    assert pfc.status is Status.SKIPPED
    assert "dcb not installed (apt-get install iproute2)" in pfc.summary
    assert "lldptool not installed (apt-get install lldpad)" in pfc.summary
    assert "mlnx_qos not installed" in pfc.summary


def test_pfc_skipped_when_the_driver_has_no_dcb(tmp_path):
    from doctor_fixtures import record_tool

    root = build_tree(tmp_path)
    record_tool(root, ["dcb", "-j", "pfc", "show", "dev", "ens1f0np0"], "", 1, "Attribute read: Operation not supported\n")
    pfc = diagnose(root)["fabric.pfc mlx5_0/1"]
    assert pfc.status is Status.SKIPPED and "ens1f0np0 does not support DCB (driver mlx5_core)" in pfc.summary


def test_ecn_off_on_the_roce_priority(tmp_path):
    root = build_tree(tmp_path)
    for point in ("roce_np", "roce_rp"):
        (root / f"sys/class/net/ens1f0np0/ecn/{point}/enable/3").write_text("0\n")
    ecn = diagnose(root)["fabric.ecn mlx5_0/1"]
    assert ecn.status is Status.WARN
    assert ecn.summary == "ECN/DCQCN off on the RoCE priority: roce_np priority 3, roce_rp priority 3"
    assert "echo 1 > /sys/class/net/ens1f0np0/ecn/roce_np/enable/$p" in ecn.fix


def test_roce_v1_mode_warns(tmp_path):
    root = build_tree(tmp_path)
    (root / "sys/kernel/config/rdma_cm/mlx5_0/ports/1/default_roce_mode").write_text("IB/RoCE v1\n")
    mode = diagnose(root)["address.roce_mode mlx5_0/1"]
    assert mode.status is Status.WARN and "not routable" in mode.summary
    assert "echo 'RoCE v2' > /sys/kernel/config/rdma_cm/mlx5_0/ports/1/default_roce_mode" in mode.fix


def test_missing_host_identity(tmp_path):
    root = build_tree(tmp_path)
    (root / "etc/nvme/hostnqn").unlink()
    identity = diagnose(root)["nvme.host_identity"]
    assert identity.status is Status.WARN and "/etc/nvme/hostnqn missing" in identity.summary
    assert "nvme gen-hostnqn > /etc/nvme/hostnqn" in identity.fix


def test_missing_userspace_modules_fail(tmp_path):
    root = build_tree(tmp_path)
    modules = root / "proc/modules"
    modules.write_text("".join(l + "\n" for l in modules.read_text().splitlines()
                               if not l.startswith(("ib_uverbs ", "rdma_ucm "))))
    for name in ("ib_uverbs", "rdma_ucm"):
        (root / "sys/module" / name / "initstate").unlink()
        (root / "sys/module" / name / "refcnt").unlink()
        (root / "sys/module" / name).rmdir()
    result = diagnose(root)["stack.modules"]
    assert result.status is Status.FAIL and "ib_uverbs, rdma_ucm not loaded" in result.summary
    assert "modprobe -a ib_uverbs rdma_ucm" in result.fix
    assert result.details["modules"]["ib_uverbs"] == "available"  # in modules.dep: loadable


class PathRunner:
    """The recorded tools, plus a live-looking `ping` across a path whose largest frame is `path_mtu`."""

    def __init__(self, root, path_mtu, iputils=True):
        from nvmeof_roce.doctor.machine import RecordedRunner
        self.recorded = RecordedRunner(root / "recorded-tools")
        self.path_mtu, self.iputils, self.pings = path_mtu, iputils, []

    def run(self, argv, timeout=10.0):
        from nvmeof_roce.doctor.machine import ToolResult
        from nvmeof_roce.errors import ToolMissing
        if argv[0] == "ping" and not self.iputils:
            raise ToolMissing("ping", "iputils-ping")
        if argv[0] in ("ping", "busybox"):
            size = int(argv[argv.index("-s") + 1])
            self.pings.append(argv)
            return ToolResult(list(argv), 0 if size + 28 <= self.path_mtu else 1, "")
        return self.recorded.run(argv, timeout)


def _path_mtu_check(root, runner):
    from nvmeof_roce.doctor.checks.addressing import check_path_mtu
    from nvmeof_roce.doctor.context import Context, DoctorOptions
    from nvmeof_roce.doctor.machine import Machine
    machine = Machine(str(root), runner=runner, sleep=lambda s: None)
    return check_path_mtu(Context(machine, DoctorOptions(traddr=TRADDR, interval=0)))


def test_path_mtu_mismatch_is_named(tmp_path):
    root = build_tree(tmp_path)  # ens1f0np0 at MTU 9000
    runner = PathRunner(root, path_mtu=1500)
    r = _path_mtu_check(root, runner)
    assert r.status is Status.FAIL, r.summary
    assert r.summary == f"MTU mismatch: ens1f0np0 has MTU 9000 but frames larger than 1500 bytes do not reach {TRADDR}"
    assert r.details["path_mtu"] == 1500 and "ip link set ens1f0np0 mtu 1500" in r.fix
    assert len(runner.pings) == 4  # 56 bytes, the full 9000, then 4200 (no) and 1500 (yes)
    assert "RoCE MTU 4096" in r.fix and "carries 1024" in r.fix
    assert runner.pings[1][:4] == ["ping", "-M", "do", "-c"] and "8972" in runner.pings[1]


def test_path_mtu_ok_and_busybox_fallback(tmp_path):
    root = build_tree(tmp_path)
    runner = PathRunner(root, path_mtu=9000, iputils=False)
    r = _path_mtu_check(root, runner)
    assert r.status is Status.OK and r.summary == f"9000-byte frames reach {TRADDR} over ens1f0np0"
    assert all(p[:2] == ["busybox", "ping"] for p in runner.pings) and len(runner.pings) == 2


def test_path_mtu_skipped_without_any_reply(tmp_path):
    root = build_tree(tmp_path)
    r = _path_mtu_check(root, PathRunner(root, path_mtu=0))
    assert r.status is Status.SKIPPED and "no ping reply" in r.summary


def test_path_mtu_below_the_common_sizes_is_bisected(tmp_path):
    root = build_tree(tmp_path)
    r = _path_mtu_check(root, PathRunner(root, path_mtu=1400))
    assert r.status is Status.FAIL and 1392 <= r.details["path_mtu"] <= 1400, r.summary
def test_nvme_auth_support_from_the_kernel_config(tmp_path):
    """Debian's 6.12 config has both sides; 6.1's has neither (lines as the two kernels' /boot/config-* have them)."""
    root = build_tree(tmp_path)
    release = (root / "proc/sys/kernel/osrelease").read_text().strip()
    (root / "boot").mkdir(exist_ok=True)
    config = root / "boot" / f"config-{release}"
    config.write_text("CONFIG_NVME_AUTH=m\nCONFIG_NVME_HOST_AUTH=y\nCONFIG_NVME_TARGET_AUTH=y\n")
    result = diagnose(root, traddr=TRADDR)["stack.nvme_auth"]
    assert result.status is Status.OK and result.summary.endswith("host and target")
    assert result.details["host"] is True and result.details["target"] is True
    config.write_text("# CONFIG_NVME_HOST_AUTH is not set\n# CONFIG_NVME_TARGET_AUTH is not set\n")
    result = diagnose(root, traddr=TRADDR)["stack.nvme_auth"]
    assert "no kernel support (host and target missing" in result.summary
    assert "linux-image-6.12-amd64" in result.fix
    assert any("CONFIG_NVME_HOST_AUTH=not set" in e for e in result.evidence)


def test_the_native_module_check_says_whether_the_fast_path_and_the_cm_are_built(monkeypatch):
    """On the live host: ok with the module's path when built; fail naming every build dependency when not."""
    from nvmeof_roce import native
    from nvmeof_roce.doctor.checks.stack import check_native_module
    from nvmeof_roce.doctor.context import Context
    from nvmeof_roce.doctor.machine import Machine
    from nvmeof_roce.transport.rdma import verbs
    ctx = Context(Machine("/"))
    monkeypatch.setattr(verbs, "PYVERBS_ERROR", None)  # pyverbs importable: the RDMA transport can run
    monkeypatch.setattr(native, "module", type("M", (), {"__file__": "/x/_native.so"})())
    result = check_native_module(ctx)
    assert result.status is Status.OK and result.details["path"] == "/x/_native.so"
    monkeypatch.setattr(native, "module", None)
    monkeypatch.setattr(native, "missing_reason", "the native data path is not built (No module named x)")
    result = check_native_module(ctx)
    assert result.status is Status.FAIL and "cannot listen on RDMA" in result.summary
    assert "gcc python3-dev libibverbs-dev librdmacm-dev liburing-dev" in result.fix
    assert result.evidence == ["the native data path is not built (No module named x)"]


def test_the_native_check_fails_where_pyverbs_cannot_be_imported_as_target_serve_would(monkeypatch, tmp_path):
    """The native module built but pyverbs not importable (a venv without --system-site-packages, no
    python3-pyverbs): `target serve` refuses its RDMA port, so doctor must not say ok; its fix is serve's."""
    from nvmeof_roce import native
    from nvmeof_roce.config import load_config
    from nvmeof_roce.doctor.checks.stack import check_native_module
    from nvmeof_roce.doctor.context import Context
    from nvmeof_roce.doctor.machine import Machine
    from nvmeof_roce.errors import NvmeofError
    from nvmeof_roce.service.serve import TargetServer
    from nvmeof_roce.transport.rdma import verbs
    monkeypatch.setattr(native, "module", type("M", (), {"__file__": "/x/_native.so"})())
    monkeypatch.setattr(verbs, "PYVERBS_ERROR", ImportError("No module named 'pyverbs'"))
    result = check_native_module(Context(Machine("/")))
    assert result.status is Status.FAIL, result
    assert "No module named 'pyverbs'" in result.summary and "target serve" in result.summary
    assert "python3-pyverbs" in result.fix and "--system-site-packages" in result.fix
    # the very refusal serve gives for the same machine
    config = tmp_path / "t.json"
    config.write_text(json.dumps({"ports": [{"portid": 1, "addr": {"trtype": "rdma", "adrfam": "ipv4",
                                             "traddr": "10.99.0.1", "trsvcid": "4420"}, "subsystems": []}],
                                  "subsystems": []}))
    with pytest.raises(NvmeofError) as refused:
        TargetServer(load_config(str(config)))
    assert refused.value.fix == result.fix
