"""Namespaces under the unit's sandbox: `target check --unit NAME` and `install-units` name every path the unit's
PrivateTmp, ProtectHome, ProtectSystem or DevicePolicy would hide, with the setting and the drop-in that fixes it;
install-units writes the DeviceAllow=/ReadWritePaths= drop-in and refuses an ExecStart in a hidden home."""
import json
import os
import stat

import pytest

from nvmeof_roce import cli

SUB = "nqn.2024-01.io.example:disk"


def config_with(tmp_path, *paths, name="disk1", size="1M"):
    namespaces = [{"nsid": i + 1, "device": {"path": p}} for i, p in enumerate(paths)]
    for ns in namespaces:
        if size and not ns["device"]["path"].startswith("/dev/"):
            ns["nvmeof_roce"] = {"size": size}
    cfg = {"ports": [{"portid": 1, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": "10.99.0.1",
                                            "trsvcid": "4420"}, "subsystems": [SUB]}],
           "subsystems": [{"nqn": SUB, "namespaces": namespaces}]}
    d = tmp_path / "etc-nvmeof-roce"
    d.mkdir(exist_ok=True)
    path = d / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return path


def check(capsys, path, unit_dir, name="disk1"):
    code = cli.main(["target", "check", "--json", "--unit", name, "--unit-dir", str(unit_dir), str(path)])
    return code, json.loads(capsys.readouterr().out)


def loop_device():
    for dev in ("/dev/loop0", "/dev/loop1"):
        if os.path.exists(dev) and stat.S_ISBLK(os.stat(dev).st_mode):
            return dev
    pytest.skip("no loop device node here")


def test_a_file_in_var_tmp_is_refused_for_the_unit(tmp_path, capsys):
    path = config_with(tmp_path, "/var/tmp/nvmeof-roce-test-ns1.img")
    code, result = check(capsys, path, tmp_path / "units")
    assert code == 1
    (err,) = result["errors"]
    assert err["field"] == "subsystems[0].namespaces[0].device.path"
    assert "PrivateTmp=yes" in err["error"] and "/var/lib/nvmeof-roce" in err["fix"]
    assert not os.path.exists("/var/tmp/nvmeof-roce-test-ns1.img")


def test_without_unit_the_same_config_checks_ok(tmp_path, capsys):
    path = config_with(tmp_path, "/var/tmp/nvmeof-roce-test-ns1.img")
    assert cli.main(["target", "check", str(path)]) == 0, capsys.readouterr()


def test_a_file_in_a_home_is_refused_for_the_unit(tmp_path, capsys):
    path = config_with(tmp_path, "/root/nvmeof-roce-test-ns1.img")
    code, result = check(capsys, path, tmp_path / "units")
    assert code == 1 and "ProtectHome=yes" in result["errors"][0]["error"]


def test_a_file_outside_the_units_directories_needs_read_write_paths(tmp_path, capsys):
    path = config_with(tmp_path, "/srv/nvmeof-roce-test/ns1.img")
    code, result = check(capsys, path, tmp_path / "units")
    assert code == 1
    (err,) = result["errors"]
    assert "ProtectSystem=strict" in err["error"]
    drop_in = tmp_path / "units" / "nvmeof-roce-target@disk1.service.d" / "nvmeof-roce-paths.conf"
    assert "ReadWritePaths=-/srv/nvmeof-roce-test" in err["fix"] and str(drop_in) in err["fix"]


def test_the_state_directory_is_the_place_for_file_images(tmp_path, capsys):
    path = config_with(tmp_path, "/var/lib/nvmeof-roce/nvmeof-roce-test-ns1.img")
    code, result = check(capsys, path, tmp_path / "units")
    assert code == 0 and result["ok"], result


def test_a_block_device_needs_device_allow_and_install_units_writes_it(tmp_path, capsys):
    dev = loop_device()
    path = config_with(tmp_path, dev, "/srv/nvmeof-roce-test/ns2.img")
    units = tmp_path / "units"
    code, result = check(capsys, path, units)
    policy = [e for e in result["errors"] if "DevicePolicy=closed" in e["error"]]
    assert code == 1 and policy and f"DeviceAllow={dev} rw" in policy[0]["fix"], result
    code = cli.main(["install-units", "--dest", str(units), "--executable", "/usr/bin/nvmeof-roce", "--no-reload",
                     "--config-dir", str(path.parent), "--json"])
    installed = json.loads(capsys.readouterr().out)
    drop_in = units / "nvmeof-roce-target@disk1.service.d" / "nvmeof-roce-paths.conf"
    assert code == 0 and str(drop_in) in installed["drop_ins"]
    lines = drop_in.read_text().splitlines()
    assert f"DeviceAllow={dev} rw" in lines and "ReadWritePaths=-/srv/nvmeof-roce-test" in lines
    code, result = check(capsys, path, units)
    # the sandbox lets both in now; what is left is the device itself (an unattached loop device is empty)
    assert not [e for e in result.get("errors", []) if "DevicePolicy" in e["error"] or "ProtectSystem" in e["error"]]


def test_install_units_refuses_a_config_no_drop_in_can_fix(tmp_path, capsys):
    path = config_with(tmp_path, "/var/tmp/nvmeof-roce-test-ns1.img")
    units = tmp_path / "units"
    code = cli.main(["install-units", "--dest", str(units), "--executable", "/usr/bin/nvmeof-roce", "--no-reload",
                     "--config-dir", str(path.parent)])
    err = capsys.readouterr().err
    assert code != 0 and "PrivateTmp=yes" in err and f"{path}" in err and "/var/lib/nvmeof-roce" in err
    assert not units.exists()  # nothing written


def test_install_units_refuses_an_executable_in_a_hidden_home(tmp_path, capsys):
    code = cli.main(["install-units", "--dest", str(tmp_path / "units"), "--executable",
                     "/root/nvmeof-roce/.venv/bin/nvmeof-roce", "--no-reload", "--config-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code != 0 and "ProtectHome=yes" in err and "/root" in err and "--executable" in err
    assert not (tmp_path / "units").exists()
