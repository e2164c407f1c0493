"""Files the target writes (securefile.py) and reads back (the ANA state file): private, atomic, durable,
and a broken one never stops the target."""
import json
import os
import stat

import pytest

from nvmeof_roce import securefile
from nvmeof_roce.service import ana_control
from nvmeof_roce.service.ana_control import AnaControl, publish
from nvmeof_roce.control.methods import Control

from loopback_env import ADDR1, Env, port, ram_ns

SUB = "nqn.2024-01.io.test:state"


@pytest.fixture
def fsyncs(monkeypatch):
    """Every fsync, as 'file' or 'dir', in order (with the rename between them as 'rename')."""
    seen = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        seen.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    def replace(a, b):
        seen.append("rename")
        real_replace(a, b)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return seen


def test_save_config_is_0600_fsynced_and_follows_no_planted_link(env, tmp_path, fsyncs):
    os.umask(0o022)
    target = tmp_path / "saved.json"
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    os.symlink(str(victim), f"{target}.tmp.{os.getpid()}")  # the old predictable temporary name
    Control(env.target).call("save_config", {"path": str(target)})
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    assert victim.read_text() == "keep me"
    assert fsyncs == ["file", "rename", "dir"]
    assert json.loads(target.read_text())["subsystems"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary left


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "f"
    path.write_text("old")

    def full(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        securefile.write_file(str(path), "new")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def _ana_env():
    return Env({"ports": [port(1, ADDR1, [SUB])], "subsystems": [{"nqn": SUB, "namespaces": [ram_ns(1)]}]})


def test_ana_state_and_pid_files_are_private_and_durable(tmp_path, fsyncs):
    env = _ana_env()
    run_dir = str(tmp_path / "run")
    publish(run_dir, env.target.ana, workers=1)
    try:
        for name in (ana_control.STATE_FILE, ana_control.PID_FILE):
            assert stat.S_IMODE(os.stat(os.path.join(run_dir, name)).st_mode) == 0o600
        assert fsyncs == ["file", "rename", "dir"] * 2
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
    finally:
        ana_control.unpublish(run_dir)
        env.close()


def test_a_run_directory_others_may_read_becomes_private(tmp_path):
    """serve --workers writes the workers' configs (with the DH-HMAC-CHAP keys) into the run directory."""
    env = _ana_env()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.chmod(run_dir, 0o755)
    publish(str(run_dir), env.target.ana, workers=1)
    try:
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
    finally:
        ana_control.unpublish(str(run_dir))
        env.close()


def test_a_run_directory_others_may_write_is_refused(tmp_path):
    env = _ana_env()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.chmod(run_dir, 0o777)
    with pytest.raises(Exception, match="only it may write"):
        publish(str(run_dir), env.target.ana, workers=1)
    env.close()


@pytest.mark.parametrize("content", [
    b"{not json", b"\xff\xfe", b"[1, 2]", b'{"ports": [1]}', b'{"ports": {"1": "optimized"}}',
    b'{"ports": {"x": {"1": "optimized"}}}', b'{"generation": "soon", "ports": {}}', b"[" * 100000,
])
def test_a_malformed_ana_state_file_is_logged_and_the_target_keeps_serving(tmp_path, content, caplog):
    env = _ana_env()
    run_dir = str(tmp_path / "run")
    publish(run_dir, env.target.ana, workers=1)
    control = AnaControl(run_dir, env.target)
    try:
        ctrl = env.connect(SUB)
        with open(os.path.join(run_dir, ana_control.STATE_FILE), "wb") as f:
            f.write(content)
        control.pending = True
        control.poll()  # what the loop runs after SIGUSR2
        assert "ANA: cannot read the state file" in caplog.text
        ctrl.write(1, 0, b"s" * 512)
        assert ctrl.read(1, 0, 1) == b"s" * 512
        assert env.target.ana.state(1, 1) == "optimized"
        ctrl.close()
    finally:
        control.close()
        ana_control.unpublish(run_dir)
        env.close()
