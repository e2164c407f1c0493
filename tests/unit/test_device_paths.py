"""A path under /dev, /sys or /proc names what the kernel provides: the target never creates a file there, and a
missing device is an error that says which devices exist and the likely typo (config/devices.py)."""
import json
import os
import stat

import pytest

from nvmeof_roce import cli
from nvmeof_roce.config import devices
from nvmeof_roce.engine.backends import BackendError, FileBackend

MISSING = f"/dev/nvmeof-roce-test-missing-{os.getpid()}n1"


def _remove_if_made(path):
    if os.path.lexists(path) and not stat.S_ISBLK(os.lstat(path).st_mode):
        os.unlink(path)


def test_a_missing_device_with_a_size_is_not_created():
    try:
        with pytest.raises(BackendError) as ei:
            FileBackend(MISSING, create_size=1 << 20)
        assert not os.path.lexists(MISSING)
    finally:
        _remove_if_made(MISSING)
    assert ei.value.message.startswith(f"{MISSING}: no such device")
    assert "truncate" not in ei.value.fix and "nvmeof_roce.size" not in ei.value.fix
    assert "never creates" in ei.value.message


def test_target_check_refuses_a_missing_device_instead_of_promising_to_create_it(tmp_path, capsys):
    cfg = {"ports": [{"portid": 1, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": "10.99.0.1",
                                            "trsvcid": "4420"}, "subsystems": ["nqn.2024-01.io.example:d"]}],
           "subsystems": [{"nqn": "nqn.2024-01.io.example:d", "namespaces": [
               {"nsid": 1, "device": {"path": MISSING}, "nvmeof_roce": {"size": "1M"}}]}]}
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(cfg))
    try:
        code = cli.main(["target", "check", "--json", str(path)])
    finally:
        _remove_if_made(MISSING)
    result = json.loads(capsys.readouterr().out)
    assert code == 1 and not result["ok"], result
    assert result["field"] == "subsystems[0].namespaces[0].device.path"
    assert "no such device" in result["error"] and "truncate" not in result["fix"]


def test_a_typo_in_a_by_id_name_is_answered_with_the_names_that_exist(tmp_path, monkeypatch):
    by_id = tmp_path / "by-id"
    by_id.mkdir()
    real = "nvme-Samsung_SSD_980_PRO_1TB_S5GXNF0R123456"
    for name in (real, "nvme-eui.002538b111b2c3d4", "ata-ST4000DM004-2CV104_ZFN0ABCD"):
        os.symlink("../../nvme0n1", by_id / name)
    monkeypatch.setattr(devices, "BY_ID_DIR", str(by_id))
    typo = "/dev/disk/by-id/nvme-Samsung_SSD_980_PRO_1TB_S5GXNF0R123465"
    problem, fix = devices.missing_device(typo)
    assert problem.startswith(f"{typo}: no such device")
    assert f"did you mean {by_id}/{real}?" in fix
    assert "ata-ST4000DM004-2CV104_ZFN0ABCD" in fix  # what exists, by id


def test_a_typo_of_a_device_node_suggests_the_node(monkeypatch, tmp_path):
    if not os.path.exists("/dev/loop0") or not stat.S_ISBLK(os.stat("/dev/loop0").st_mode):
        pytest.skip("no /dev/loop0 here")
    monkeypatch.setattr(devices, "BY_ID_DIR", str(tmp_path / "none"))
    with pytest.raises(BackendError) as ei:
        FileBackend("/dev/lop0", create_size=1 << 20)
    assert not os.path.lexists("/dev/lop0")
    assert "did you mean /dev/loop0?" in ei.value.fix


def test_an_unattached_loop_device_is_not_advised_a_truncate():
    dev = "/dev/loop7"
    try:
        size = int(open("/sys/block/loop7/size").read())
    except OSError:
        pytest.skip("no loop7 here")
    if size or not os.access(dev, os.W_OK):
        pytest.skip("loop7 is attached, or not writable here")
    with pytest.raises(BackendError) as ei:
        FileBackend(dev)
    assert "truncate" not in ei.value.fix and "losetup" in ei.value.fix, ei.value.fix


@pytest.mark.parametrize("path,inside", [("/dev/nvme0n1", True), ("/sys/block/x", True), ("/proc/x", True),
                                         ("/dev", True), ("/device/x", False), ("/var/lib/x.img", False),
                                         ("/dev/../var/x.img", False)])
def test_system_trees(path, inside):
    assert devices.in_system_tree(path) is inside
