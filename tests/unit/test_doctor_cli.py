"""`nvmeof-roce doctor` end to end: exit code rule, --json shape, the table, --root and --capture."""
import json

import pytest

from doctor_fixtures import build_tree
from nvmeof_roce.cli import main
from nvmeof_roce.doctor.report import render_text
from nvmeof_roce.doctor.result import Status, exit_code, fail, ok, skipped, warn

JSON_KEYS = {"check", "subject", "status", "summary", "evidence", "fix", "details"}


def run_doctor(capsys, *args):
    code = main(["doctor", "--interval", "0", *args])
    out = capsys.readouterr().out
    return code, out


def test_exit_code_rule():
    assert exit_code([ok("a", "", "fine"), warn("b", "", "hmm"), skipped("c", "", "no tool")]) == 0
    assert exit_code([ok("a", "", "fine"), fail("b", "", "broken")]) == 1
    assert exit_code([]) == 0


def test_json_shape_and_exit_0_for_a_healthy_host(tmp_path, capsys):
    code, out = run_doctor(capsys, "--root", str(build_tree(tmp_path)), "--json")
    assert code == 0
    results = json.loads(out)
    assert isinstance(results, list) and len(results) >= 15
    for r in results:
        assert set(r) == JSON_KEYS
        assert r["status"] in ("ok", "warn", "fail", "skipped")
        assert isinstance(r["evidence"], list) and all(isinstance(e, str) for e in r["evidence"])
        assert isinstance(r["fix"], str) and isinstance(r["details"], dict)
    mtu = next(r for r in results if r["check"] == "port.mtu")
    assert mtu["subject"] == "mlx5_0/1" and mtu["details"]["netdev_mtu"] == 9000


def test_warnings_alone_exit_0(tmp_path, capsys):
    code, out = run_doctor(capsys, "--root", str(build_tree(tmp_path, "low-mtu")), "--json")
    assert code == 0
    assert any(r["check"] == "port.mtu" and r["status"] == "warn" for r in json.loads(out))


def test_a_failure_exits_1_and_the_table_shows_the_fix(tmp_path, capsys):
    code, out = run_doctor(capsys, "--root", str(build_tree(tmp_path, "port-down")))
    assert code == 1
    header, rule = out.splitlines()[:2]
    assert header.split() == ["CHECK", "RESULT", "EVIDENCE", "FIX"]
    row = next(line for line in out.splitlines() if line.startswith("port.state mlx5_0/1"))
    assert "fail" in row and "1: DOWN" in row and "bring the interface up" in row
    assert "FAIL port.state mlx5_0/1: port not usable" in out
    assert "    read: /sys/class/infiniband/mlx5_0/ports/1/state: 1: DOWN" in out
    assert "    fix:  bring the interface up: ip link set ens1f0np0 up" in out
    assert "\033[" not in out  # not a terminal: no colours
    assert out.rstrip().endswith("skipped")


def test_colours_only_when_asked():
    results = [ok("a", "", "fine"), fail("b", "x", "broken", ["read this"], "do that")]
    coloured = render_text(results, colour=True)
    assert "\033[1;31mfail" in coloured and "\033[32mok" in coloured
    plain = render_text(results, colour=False)
    assert "\033[" not in plain
    # padding is computed before colouring, so the columns line up either way
    strip = coloured.replace("\033[1;31m", "").replace("\033[32m", "").replace("\033[0m", "")
    assert strip == plain


def test_device_option(tmp_path, capsys):
    code, out = run_doctor(capsys, "--root", str(build_tree(tmp_path)), "--device", "mlx5_1", "--json")
    assert code == 1
    present = next(r for r in json.loads(out) if r["check"] == "device.present")
    assert present["status"] == "fail" and "mlx5_1" in present["summary"]


def test_root_without_recordings_skips_tools_with_the_reason(tmp_path, capsys):
    root = build_tree(tmp_path)
    for f in (root / "recorded-tools").iterdir():
        f.unlink()
    (root / "recorded-tools").rmdir()
    code, out = run_doctor(capsys, "--root", str(root), "--json")
    firewall = next(r for r in json.loads(out) if r["check"] == "nvme.firewall")
    assert firewall["status"] == "skipped"
    assert "was not run: --root points at a captured tree" in firewall["summary"]


def test_capture_then_replay_gives_the_same_report(tmp_path, capsys):
    source = build_tree(tmp_path, "defaults-unhardened")
    capture = tmp_path / "capture"
    code1, first = run_doctor(capsys, "--root", str(source), "--capture", str(capture), "--json",
                              "--traddr", "192.168.100.2")
    assert (capture / "recorded-tools" / "index.json").exists()
    assert json.loads((capture / "recorded-modes.json").read_text())["/dev/infiniband/uverbs0"] == "0o20666"
    assert (capture / "sys/class/infiniband/mlx5_0/ports/1/gid_attrs/types/3").read_text() == "RoCE v2\n"
    assert not (capture / "sys/class/infiniband/mlx5_0/ports/1/gid_attrs/types/6").exists()
    code2, replay = run_doctor(capsys, "--root", str(capture), "--json", "--traddr", "192.168.100.2")
    assert code1 == code2
    assert json.loads(first) == json.loads(replay)


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit):
        main(["doctor", "--help"])
    out = capsys.readouterr().out
    for option in ("--device", "--traddr", "--trsvcid", "--json", "--root", "--interval", "--capture"):
        assert option in out


def test_status_values_are_the_documented_ones():
    assert [s.value for s in Status] == ["ok", "skipped", "warn", "fail"]
