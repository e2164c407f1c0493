"""`doctor --plan FILE`: a host's live PFC/ECN/DCQCN/MTU/DSCP settings against a saved fabric plan,
on the recorded doctor hosts (fixtures/doctor/)."""
import json

import pytest

from doctor_fixtures import build_tree, diagnose, mark_missing, record_tool
from nvmeof_roce.cli import main
from nvmeof_roce.doctor.result import Status
from nvmeof_roce.fabric.plan import LinkInputs, make_plan, save_plan

DCB_PFC = ["dcb", "-j", "pfc", "show", "dev", "ens1f0np0"]
LABEL = "fabric.plan mlx5_0/1"


def plan_for(**changes):
    link = dict(speed_mbps=100000, cable_m=100, mtu=9216, peer_mtu=9216)
    link.update(changes)
    return make_plan(LinkInputs(**link))


def pfc_json(priorities=(3,), delay=0):
    prio = [p in priorities for p in range(8)]
    return json.dumps({"pfc_cap": 8, "macsec_bypass": False, "delay": delay, "prio_pfc": prio}) + "\n"


def differences(result):
    return {d["setting"]: (d["plan"], d["live"], d["fix"]) for d in result.details["differences"]}


def test_healthy_host_against_the_100g_plan_names_mtu_and_cable_length(tmp_path):
    result = diagnose(build_tree(tmp_path), plan=plan_for())[LABEL]
    assert result.status is Status.WARN
    assert differences(result) == {
        "MTU": (9216, 9000, "ip link set dev ens1f0np0 mtu 9216"),
        "PFC delay (mlx5: cable length, m)": (100, 0, "dcb pfc set dev ens1f0np0 delay 100"),
    }
    assert result.summary.startswith("2 setting(s) differ from the plan: MTU 9000 (plan 9216)")
    assert result.fix == "ip link set dev ens1f0np0 mtu 9216\ndcb pfc set dev ens1f0np0 delay 100"
    assert "dcb -j pfc show dev ens1f0np0: PFC on priorities [3], delay 0" in result.evidence


def test_a_host_set_as_planned_is_ok(tmp_path):
    root = build_tree(tmp_path)
    record_tool(root, DCB_PFC, pfc_json(delay=100))
    result = diagnose(root, plan=plan_for(mtu=9000, peer_mtu=9000))[LABEL]
    assert result.status is Status.OK, result.details["differences"]
    assert result.summary == "settings match the plan"
    assert result.details["unverified"] == []


def test_every_difference_is_named_with_its_fix(tmp_path):
    root = build_tree(tmp_path)
    record_tool(root, DCB_PFC, pfc_json(priorities=(4,), delay=7))
    record_tool(root, ["dcb", "-j", "app", "show", "dev", "ens1f0np0"], '{"dscp_prio":[[26,4]]}\n')
    (root / "sys/kernel/config/rdma_cm/mlx5_0/ports/1/default_roce_tos").write_text("0\n")
    (root / "sys/class/net/ens1f0np0/ecn/roce_rp/enable/3").write_text("0\n")
    (root / "sys/class/net/ens1f0np0/speed").write_text("25000\n")
    result = diagnose(root, plan=plan_for(mtu=9000))[LABEL]
    assert result.status is Status.WARN
    diff = differences(result)
    assert diff["link speed (Mb/s)"][:2] == (100000, 25000)
    assert "nvmeof-roce fabric plan --speed 25G --cable 100" in diff["link speed (Mb/s)"][2]
    assert diff["PFC priorities"] == ([3], [4], "dcb pfc set dev ens1f0np0 prio-pfc all:off 3:on")
    assert diff["PFC delay (mlx5: cable length, m)"] == (100, 7, "dcb pfc set dev ens1f0np0 delay 100")
    assert diff["DSCP 26 -> priority"] == (3, 4, "dcb app add dev ens1f0np0 dscp-prio 26:3")
    assert diff["DSCP 48 -> priority"] == (6, "not mapped", "dcb app add dev ens1f0np0 dscp-prio 48:6")
    assert diff["rdma_cm default ToS (DSCP)"][:2] == (26, 0)
    assert diff["rdma_cm default ToS (DSCP)"][2].endswith("echo 106 > /sys/kernel/config/rdma_cm/mlx5_0/ports/1/"
                                                          "default_roce_tos")
    assert diff["ECN roce_rp on priority 3"] == (1, "0", "echo 1 > /sys/class/net/ens1f0np0/ecn/roce_rp/enable/3")
    assert "ECN roce_np on priority 3" not in diff
    assert len(diff) == 7 and len(result.fix.splitlines()) == 7


def test_dcqcn_knobs_of_a_paper_plan(tmp_path):
    root = build_tree(tmp_path)
    record_tool(root, DCB_PFC, pfc_json(delay=100))
    (root / "sys/class/net/ens1f0np0/ecn/roce_rp/rpg_time_reset").write_text("300\n")
    (root / "sys/class/net/ens1f0np0/ecn/roce_rp/rpg_ai_rate").write_text("40\n")
    result = diagnose(root, plan=plan_for(mtu=9000, dcqcn="paper"))[LABEL]
    diff = differences(result)
    assert diff == {"DCQCN rpg_time_reset": (55, "300", "echo 55 > /sys/class/net/ens1f0np0/ecn/roce_rp/rpg_time_reset")}
    unverified = " ".join(result.details["unverified"])
    assert "DCQCN rpg_threshold (no MLNX_OFED sysfs file; upstream: debugfs cc_params/rp_threshold)" in unverified
    assert "rpg_ai_rate" not in unverified  # read and equal


def test_mlnx_qos_trust_pcp_and_an_unreadable_cable_length(tmp_path):
    from test_doctor_parsers import MLNX_QOS

    root = build_tree(tmp_path)
    mark_missing(root, "dcb")
    record_tool(root, ["mlnx_qos", "-i", "ens1f0np0"], MLNX_QOS.replace("Priority trust state: dscp",
                                                                        "Priority trust state: pcp"))
    result = diagnose(root, plan=plan_for(mtu=9000))[LABEL]
    diff = differences(result)
    assert diff["trust"][:2] == ("dscp", "pcp") and "--trust dscp" in diff["trust"][2]
    assert "PFC delay / cable length (only dcb shows it)" in result.details["unverified"]


def test_no_plan_no_result_and_soft_roce_skips(tmp_path):
    assert not any(label.startswith("fabric.plan") for label in diagnose(build_tree(tmp_path)))
    lab = diagnose(build_tree(tmp_path / "lab", base="rxe0-lab"), plan=plan_for())
    assert lab["fabric.plan rxe0/1"].status is Status.SKIPPED


def test_cli_doctor_plan(tmp_path, capsys):
    plan_file = tmp_path / "plan.json"
    save_plan(plan_for(), str(plan_file))
    root = build_tree(tmp_path)
    assert main(["doctor", "--interval", "0", "--root", str(root), "--plan", str(plan_file), "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    result = next(r for r in results if r["check"] == "fabric.plan")
    assert result["status"] == "warn" and {d["setting"] for d in result["details"]["differences"]} == {
        "MTU", "PFC delay (mlx5: cable length, m)"}


@pytest.mark.parametrize("content,message", [(None, "cannot read the plan"), ("[1, 2]", "is not a fabric plan")])
def test_cli_doctor_bad_plan_file(tmp_path, capsys, content, message):
    plan_file = tmp_path / "plan.json"
    if content is not None:
        plan_file.write_text(content)
    assert main(["doctor", "--interval", "0", "--root", str(build_tree(tmp_path)), "--plan", str(plan_file)]) == 1
    err = capsys.readouterr().err
    assert message in err and "fabric plan" in err
