"""The run directory of `serve --workers`: the workers' configs (with the hosts' DH-HMAC-CHAP keys), their
control sockets and ready files, and the supervisor's pid file, which keeps a second target out of it.

It defaults to /run/nvmeof-roce as root (the systemd unit gives /run/nvmeof-roce/NAME); without root it is
under $XDG_RUNTIME_DIR or /tmp, where another local user could have made it first, so it must be this user's
and writable by no one else.
"""
from __future__ import annotations

import contextlib
import os
import stat

from ..errors import NvmeofError
from ..securefile import write_file

PID_FILE = "target.pid"


def default_run_dir() -> str:
    if os.geteuid() == 0:
        return "/run/nvmeof-roce"
    return os.path.join(os.environ.get("XDG_RUNTIME_DIR") or "/tmp", f"nvmeof-roce-{os.getuid()}")


def private_directory(run_dir: str) -> None:
    """Create the run directory 0700, or accept an existing one only if it is ours and no one else may write
    to it."""
    try:
        os.makedirs(run_dir, mode=0o700, exist_ok=True)
        st = os.lstat(run_dir)
    except OSError as exc:
        raise NvmeofError(f"{run_dir}: cannot create the run directory: {exc.strerror}",
                          "give a --run-dir this user can create") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise NvmeofError(f"{run_dir}: the run directory is not a directory of this user that only it may write "
                          f"to (owner {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})",
                          "remove it, or give another --run-dir")
    if st.st_mode & 0o077:
        os.chmod(run_dir, 0o700)  # what is in it (the workers' configs with their keys) is for this user only


def pid_alive(pid: int) -> bool:
    """A process `pid` exists (one of another user's counts); 0 and below name none (kill would signal a group)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def claim(run_dir: str) -> None:
    """The supervisor at start: the run directory made private and its pid file written, unless another live
    target holds it."""
    private_directory(run_dir)
    pid_path = os.path.join(run_dir, PID_FILE)
    try:
        with open(pid_path) as f:
            other = int(f.read().strip() or 0)
    except (FileNotFoundError, ValueError):
        other = 0
    if other and other != os.getpid() and pid_alive(other):
        raise NvmeofError(f"{run_dir}: another target (pid {other}) uses this run directory",
                          "stop it, or give this target its own --run-dir")
    write_file(pid_path, f"{os.getpid()}\n")


def release(run_dir: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(run_dir, PID_FILE))
