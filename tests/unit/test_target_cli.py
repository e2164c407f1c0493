"""`nvmeof-roce target check CONFIG [--json]`: validates the config, opens the backends."""
import json

import pytest

from nvmeof_roce import cli
from nvmeof_roce.config import ConfigError, parse_config
from nvmeof_roce.engine.core import Target

NQN = "nqn.2024-01.io.test:cli"


def write(tmp_path, config, name="target.json"):
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return str(path)


def base_config(namespaces):
    return {"ports": [{"portid": 1, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": "10.99.0.1",
                                             "trsvcid": "4420"}, "subsystems": [NQN]}],
            "subsystems": [{"nqn": NQN, "namespaces": namespaces}]}


def test_check_ok_human(tmp_path, capsys):
    disk = tmp_path / "disk.img"
    disk.write_bytes(bytes(1 << 20))
    path = write(tmp_path, base_config([
        {"nsid": 1, "nvmeof_roce": {"backend": "ram", "size": "4M"}},
        {"nsid": 2, "device": {"path": str(disk)}},
        {"nsid": 3, "nvmeof_roce": {"backend": "null", "size": "1G", "block_size": 4096}},
    ]))
    assert cli.main(["target", "check", path]) == 0
    out = capsys.readouterr().out
    assert f"{path}: OK" in out
    assert NQN in out and "ram" in out and str(disk) in out and "4096" in out and "10.99.0.1:4420" in out


def test_check_json_reports_sizes(tmp_path, capsys):
    disk = tmp_path / "disk.img"
    disk.write_bytes(bytes(8192))
    path = write(tmp_path, base_config([{"nsid": 1, "device": {"path": str(disk)}},
                                        {"nsid": 2, "enable": 0, "nvmeof_roce": {"backend": "ram", "size": "1M"}}]))
    assert cli.main(["target", "check", path, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] is True
    ns1, ns2 = result["subsystems"][0]["namespaces"]
    assert (ns1["size_bytes"], ns1["blocks"], ns1["block_size"]) == (8192, 16, 512)
    assert ns2["note"] == "disabled" and ns2["blocks"] is None
    assert result["ports"][0]["subsystems"] == [NQN]
    assert result["subsystems"][0]["ports"] == [1]


def test_check_does_not_create_missing_files(tmp_path, capsys):
    disk = tmp_path / "new.img"
    path = write(tmp_path, base_config([{"nsid": 1, "device": {"path": str(disk)},
                                         "nvmeof_roce": {"backend": "file", "size": "1M"}}]))
    assert cli.main(["target", "check", path, "--json"]) == 0
    assert not disk.exists()
    assert "will be created" in json.loads(capsys.readouterr().out)["subsystems"][0]["namespaces"][0]["note"]


def test_check_missing_backend_file_names_file_and_field(tmp_path, capsys):
    path = write(tmp_path, base_config([{"nsid": 1, "device": {"path": str(tmp_path / "absent.img")}}]))
    assert cli.main(["target", "check", path]) == 1
    err = capsys.readouterr().err
    assert path in err and "subsystems[0].namespaces[0].device.path" in err and "no such file" in err


def test_check_json_error(tmp_path, capsys):
    path = write(tmp_path, base_config([{"nsid": 1, "nvmeof_roce": {"backend": "ram", "size": "lots"}}]))
    assert cli.main(["target", "check", path, "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] is False and result["field"] == "subsystems[0].namespaces[0].nvmeof_roce.size"
    assert path in result["error"] and result["fix"]


def test_check_bad_json_and_missing_file(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    assert cli.main(["target", "check", str(bad)]) == 1
    assert "invalid JSON" in capsys.readouterr().err
    assert cli.main(["target", "check", str(tmp_path / "nope.json")]) == 1
    assert "no such file" in capsys.readouterr().err


def test_check_rejects_nsid_the_userspace_target_cannot_serve(tmp_path, capsys):
    path = write(tmp_path, base_config([{"nsid": 5000, "nvmeof_roce": {"backend": "ram", "size": "1M"}}]))
    assert cli.main(["target", "check", path]) == 1
    err = capsys.readouterr().err
    assert "subsystems[0].namespaces[0].nsid" in err and "1024" in err


def test_target_construction_errors_name_the_field(tmp_path):
    cfg = parse_config(base_config([{"nsid": 1, "device": {"path": str(tmp_path / "absent.img")}}]), "cfg.json")
    with pytest.raises(ConfigError) as exc:
        Target(cfg)
    assert exc.value.where == "subsystems[0].namespaces[0].device.path" and "cfg.json" in str(exc.value)


def test_shipped_example_configs_check(capsys):
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[2]
    for name in ("ram.json", "two-subsystems.json"):
        assert cli.main(["target", "check", str(root / "targets" / name), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["ok"]


def test_check_several_files(tmp_path, capsys):
    good = write(tmp_path, base_config([{"nsid": 1, "nvmeof_roce": {"backend": "ram", "size": "4M"}}]), "good.json")
    bad = write(tmp_path, base_config([{"nsid": 1, "nvmeof_roce": {"backend": "ram"}}]), "bad.json")
    assert cli.main(["target", "check", good, bad]) == 1
    captured = capsys.readouterr()
    assert f"{good}: OK" in captured.out
    assert f"{bad}: subsystems[0].namespaces[0].nvmeof_roce.size: is required" in captured.err
    assert cli.main(["target", "check", good, good, "--json"]) == 0
    assert [r["ok"] for r in json.loads(capsys.readouterr().out)] == [True, True]


def test_serve_and_status_say_which_data_path_runs_and_why(monkeypatch):
    """No silent slow path: the start line and `target status` (JSON and text) carry the reason."""
    from nvmeof_roce import native
    from nvmeof_roce.control.commands import _data_path
    from nvmeof_roce.service.serve import data_path_reason
    assert data_path_reason("python", "python") == "--data-path python"
    assert data_path_reason(None, "python", worker=2) == "a worker of serve --workers runs the Python data path"
    monkeypatch.setattr(native, "module", None)
    monkeypatch.setattr(native, "missing_reason", "the native data path is not built (no _native)")
    assert data_path_reason(None, "python") == "the native data path is not built (no _native)"
    assert data_path_reason(None, "native") == "the native module is built: the default"
    assert (_data_path({"data_path": "python", "data_path_reason": "--data-path python"})
            == "python: --data-path python")
    assert (_data_path({"data_path": "native", "poll": "interrupt", "data_path_reason": "the native module is "
                        "built: the default"}) == "native, interrupt poll: the native module is built: the default")


def test_check_refuses_a_file_to_create_larger_than_its_filesystem(tmp_path, capsys):
    """A file namespace of 100P on a filesystem of a few GiB: the field, the size asked, what the filesystem holds
    (its whole size, by os.statvfs of the directory that exists), and the fix."""
    import os
    disk = tmp_path / "not-yet" / "ns.img"  # its directory is not there either: the filesystem above it counts
    path = write(tmp_path, base_config([{"nsid": 1, "device": {"path": str(disk)},
                                         "nvmeof_roce": {"backend": "file", "size": "100P"}}]))
    assert cli.main(["target", "check", path, "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    vfs = os.statvfs(tmp_path)
    assert result["field"] == "subsystems[0].namespaces[0].nvmeof_roce.size", result
    assert str(100 << 50) in result["error"] and str(vfs.f_blocks * vfs.f_frsize) in result["error"], result
    assert str(disk) in result["error"] and str(tmp_path) in result["error"], result
    assert "nvmeof_roce.size" in result["fix"] and "filesystem" in result["fix"], result
    assert not disk.parent.exists()
    # a size the filesystem holds is fine (the file is sparse: its whole size counts, not what is free)
    path = write(tmp_path, base_config([{"nsid": 1, "device": {"path": str(disk)},
                                         "nvmeof_roce": {"backend": "file", "size": "1M"}}]))
    assert cli.main(["target", "check", path, "--json"]) == 0


def test_the_fix_for_a_missing_file_creates_its_directory_when_that_is_missing_too(tmp_path, capsys):
    """both.json's /var/lib/nvmeof-roce/both-ns1.img where /var/lib/nvmeof-roce is not there: a bare
    `truncate -s 1G PATH` fails; the fix makes the directory first, and works when run."""
    import subprocess
    disk = tmp_path / "var-lib" / "both-ns1.img"
    path = write(tmp_path, base_config([{"nsid": 1, "device": {"path": str(disk)}}]))
    assert cli.main(["target", "check", path, "--json"]) == 1
    fix = json.loads(capsys.readouterr().out)["fix"]
    assert f"mkdir -p {disk.parent} && truncate -s 1G {disk}" in fix, fix
    command = fix[fix.index("mkdir -p"):fix.index(disk.name) + len(disk.name)]
    subprocess.run(command, shell=True, check=True)
    assert disk.stat().st_size == 1 << 30
    assert cli.main(["target", "check", path, "--json"]) == 0
    capsys.readouterr()
    # the directory there: the plain truncate
    other = write(tmp_path, base_config([{"nsid": 1, "device": {"path": str(tmp_path / "b.img")}}]), "b.json")
    assert cli.main(["target", "check", other, "--json"]) == 1
    fix = json.loads(capsys.readouterr().out)["fix"]
    assert f"create it (truncate -s 1G {tmp_path / 'b.img'})" in fix, fix
