"""Files the target writes (securefile.py) and the run directory of `serve --workers` (service/run_dir.py):
private, atomic, durable."""
import json
import os
import stat

import pytest

from nvmeof_roce import securefile
from nvmeof_roce.service import run_dir as run_directory
from nvmeof_roce.control.methods import Control


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


def test_the_pid_file_is_private_and_durable_and_removed_at_release(tmp_path, fsyncs):
    run_dir = str(tmp_path / "run")
    run_directory.claim(run_dir)
    pid_file = os.path.join(run_dir, run_directory.PID_FILE)
    try:
        assert stat.S_IMODE(os.stat(pid_file).st_mode) == 0o600
        assert open(pid_file).read() == f"{os.getpid()}\n"
        assert fsyncs == ["file", "rename", "dir"]
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
    finally:
        run_directory.release(run_dir)
    assert not os.path.exists(pid_file)


def test_a_run_directory_others_may_read_becomes_private(tmp_path):
    """serve --workers writes the workers' configs (with the DH-HMAC-CHAP keys) into the run directory."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.chmod(run_dir, 0o755)
    run_directory.claim(str(run_dir))
    try:
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
    finally:
        run_directory.release(str(run_dir))


def test_a_run_directory_others_may_write_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.chmod(run_dir, 0o777)
    with pytest.raises(Exception, match="only it may write"):
        run_directory.claim(str(run_dir))
