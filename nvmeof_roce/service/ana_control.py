"""Changing ANA states of a running target: a state file in the run directory and SIGUSR2.

    RUN_DIR/target.pid          the serving process (the supervisor with --workers)
    RUN_DIR/ana-state.json      {"generation": G, "workers": N, "ports": {"1": {"1": "optimized", ...}}}
    RUN_DIR/ana-applied.<i>     the generation worker i (0 without --workers) has applied

`nvmeof-roce target ana-state` rewrites the file under a lock with the next generation, sends SIGUSR2 to the
serving process (a supervisor forwards it to its workers), and waits until every worker wrote that generation
to its applied file.  A worker (re)started later applies the file as it finds it, so a restarted worker comes
back in the states set at run time.  The signal handler only sets a flag: the event loop applies the change
between events (`poll`), never inside another command.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import stat
import time
from typing import Dict

from ..config import ANA_STATES
from ..errors import NvmeofError
from ..securefile import write_file
from ..engine.ana import AnaTable, apply_states

log = logging.getLogger(__name__)

STATE_FILE = "ana-state.json"
PID_FILE = "target.pid"
LOCK_FILE = "ana-state.lock"
APPLY_TIMEOUT = 10.0


def default_run_dir() -> str:
    if os.geteuid() == 0:
        return "/run/nvmeof-roce"
    return os.path.join(os.environ.get("XDG_RUNTIME_DIR") or "/tmp", f"nvmeof-roce-{os.getuid()}")


@contextlib.contextmanager
def _locked(run_dir: str):
    with open(os.path.join(run_dir, LOCK_FILE), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _private_directory(run_dir: str) -> None:
    """Create the run directory 0700, or accept an existing one only if it is ours and no one else may write
    to it: without root it is under /tmp, where another local user could have made it first."""
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


MAX_STATE_BYTES = 1 << 20  # 65535 ports x 128 groups would not fit; a real file is a few hundred bytes


def read_state(run_dir: str) -> dict:
    """The state file, checked: NvmeofError naming the problem for a file that is missing, not JSON, or not
    the shape `publish` writes (the run directory may be under /tmp, and a file can be cut short)."""
    path = os.path.join(run_dir, STATE_FILE)
    bad = "remove it and restart the target (it writes a new one), or set the states again with target ana-state"
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_STATE_BYTES + 1)
    except FileNotFoundError:
        raise NvmeofError(f"{path}: no ANA state file: no target serving with run directory {run_dir}",
                          "start 'nvmeof-roce target serve CONFIG' (with the same --run-dir), or pass the "
                          "--run-dir the target uses") from None
    except OSError as exc:
        raise NvmeofError(f"{path}: cannot read the ANA state file: {exc.strerror}", bad) from None
    if len(raw) > MAX_STATE_BYTES:
        raise NvmeofError(f"{path}: the ANA state file is larger than {MAX_STATE_BYTES} bytes", bad)
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise NvmeofError(f"{path}: the ANA state file is not valid JSON: {exc}", bad) from None
    try:
        _states_of(data)
        int(data.get("generation", 0))
        int(data.get("workers", 1))
    except (AttributeError, TypeError, ValueError):
        raise NvmeofError(f"{path}: the ANA state file is not what the target writes ({{\"generation\": G, "
                          f"\"workers\": N, \"ports\": {{PORTID: {{GRPID: STATE}}}}}})", bad) from None
    return data


def _states_of(data: dict) -> Dict[int, Dict[int, str]]:
    ports = data.get("ports", {})
    if not isinstance(ports, dict) or not all(isinstance(g, dict) for g in ports.values()):
        raise TypeError("ports must map port IDs to {group ID: state}")
    return {int(p): {int(g): str(s) for g, s in groups.items()} for p, groups in ports.items()}


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


def publish(run_dir: str, table: AnaTable, workers: int) -> None:
    """The serving process (or supervisor) at start: pid file and the configured states, generation 0."""
    _private_directory(run_dir)
    pid_path = os.path.join(run_dir, PID_FILE)
    try:
        with open(pid_path) as f:
            other = int(f.read().strip() or 0)
    except (FileNotFoundError, ValueError):
        other = 0
    if other and other != os.getpid() and pid_alive(other):
        raise NvmeofError(f"{run_dir}: another target (pid {other}) uses this run directory",
                          "stop it, or give this target its own --run-dir")
    with _locked(run_dir):
        for name in os.listdir(run_dir):
            if name.startswith("ana-applied."):
                os.unlink(os.path.join(run_dir, name))
        ports = {str(p): {str(g): s for g, s in groups.items()} for p, groups in table.states().items()}
        write_file(os.path.join(run_dir, STATE_FILE),
                      json.dumps({"generation": 0, "workers": workers, "ports": ports}, indent=1) + "\n")
        write_file(pid_path, f"{os.getpid()}\n")


def unpublish(run_dir: str) -> None:
    for name in (PID_FILE, STATE_FILE):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(run_dir, name))


class AnaControl:
    """In a serving process: applies the state file when SIGUSR2 arrives (and once at start)."""

    def __init__(self, run_dir: str, target, worker: int = 0):
        self.run_dir = run_dir
        self.target = target
        self.worker = worker
        self.pending = True  # apply what the file says at start (a restarted worker)
        self._previous = signal.signal(signal.SIGUSR2, self._on_signal)

    def _on_signal(self, *_args) -> None:
        self.pending = True

    def poll(self) -> None:
        if not self.pending:
            return
        self.pending = False
        try:
            with _locked(self.run_dir):
                data = read_state(self.run_dir)
        except (NvmeofError, OSError, ValueError) as exc:
            log.error("ANA: cannot read the state file: %s", exc)
            return
        for problem in apply_states(self.target, _states_of(data)):
            log.error("ANA: %s", problem)
        try:
            write_file(os.path.join(self.run_dir, f"ana-applied.{self.worker}"),
                       f"{int(data.get('generation', 0))}\n")
        except OSError as exc:  # the states are applied; only `target ana-state` waits for this file
            log.error("ANA: cannot write %s/ana-applied.%d: %s", self.run_dir, self.worker, exc.strerror)

    def record(self) -> None:
        """States changed through the control socket (nvmf_subsystem_listener_set_ana_state, a reload): written
        to the state file (same generation: nothing to apply), so a later `target ana-state` starts from them
        rather than setting the old ones back."""
        try:
            with _locked(self.run_dir):
                data = read_state(self.run_dir)
                data["ports"] = {str(p): {str(g): s for g, s in groups.items()}
                                 for p, groups in self.target.ana.states().items()}
                write_file(os.path.join(self.run_dir, STATE_FILE), json.dumps(data, indent=1) + "\n")
        except (NvmeofError, OSError) as exc:
            log.error("ANA: cannot record the new states in the state file: %s", exc)

    def close(self) -> None:
        signal.signal(signal.SIGUSR2, self._previous)


def change_state(run_dir: str, portid: int, grpid: int, state: str,
                 timeout: float = APPLY_TIMEOUT) -> int:
    """Set (port, group) to `state` in a running target and wait until every worker applied it; returns the
    number of workers that did."""
    if state not in ANA_STATES:
        raise NvmeofError(f"unknown ANA state {state!r}", f"use one of: {', '.join(ANA_STATES)}")
    with _locked(run_dir):
        data = read_state(run_dir)
        ports = data.get("ports", {})
        if str(portid) not in ports:
            raise NvmeofError(f"port {portid} is not a port of the running target",
                              f"use one of its portids: {', '.join(sorted(ports, key=int))}")
        if str(grpid) not in ports[str(portid)]:
            raise NvmeofError(f"ANA group {grpid} does not exist in the running target",
                              f"use one of its groups: {', '.join(sorted(ports[str(portid)], key=int))}")
        ports[str(portid)][str(grpid)] = state
        data["generation"] = generation = int(data.get("generation", 0)) + 1
        write_file(os.path.join(run_dir, STATE_FILE), json.dumps(data, indent=1) + "\n")
    pid = _target_pid(run_dir)
    try:
        os.kill(pid, signal.SIGUSR2)
    except ProcessLookupError:
        raise NvmeofError(f"the target (pid {pid}) in {run_dir} is not running",
                          "start it again; the state file keeps the change for the next start of a worker") from None
    workers = int(data.get("workers", 1))
    deadline = time.monotonic() + timeout
    while True:
        done = sum(1 for i in range(workers) if _applied(run_dir, i) >= generation)
        if done == workers:
            return done
        if time.monotonic() > deadline:
            raise NvmeofError(f"only {done} of {workers} worker(s) applied the change within {timeout:.0f} s",
                              "check the target's log; a restarting worker applies it when it comes back")
        time.sleep(0.05)


def _target_pid(run_dir: str) -> int:
    try:
        with open(os.path.join(run_dir, PID_FILE)) as f:
            return int(f.read().strip())
    except (FileNotFoundError, ValueError):
        raise NvmeofError(f"{run_dir}: no target pid file", "is the target running with this --run-dir?") from None


def _applied(run_dir: str, worker: int) -> int:
    try:
        with open(os.path.join(run_dir, f"ana-applied.{worker}")) as f:
            return int(f.read().strip() or -1)
    except (FileNotFoundError, ValueError):
        return -1


def current_states(run_dir: str) -> Dict[int, Dict[int, str]]:
    return _states_of(read_state(run_dir))
