"""A Ceph cluster small enough for the lab and the tests: one monitor and one OSD on the in-memory object store.

Debian 12's Ceph 16.2 (Pacific) packages: `ceph-mon`, `ceph-osd`, `ceph-common` (the `ceph` and `rbd` CLIs).
No authentication, one size-1 pool `rbd`, every file (config, monitor store, OSD data, logs, pid files, admin
sockets) under one directory, so a cluster is started and thrown away like a temporary directory.  It starts in
seconds and takes about 110 MB of memory (monitor ~30 MB, OSD ~77 MB with `memstore device bytes`).

    with DevCluster(Path("/run/ceph-lab")) as cluster:
        cluster.rbd("create", "--size", "64M", "rbd/img1")
        ...                              # cluster.conf is the ceph.conf clients use

`ceph -s` says HEALTH_WARN (no manager, msgr2 off, insecure global_id reclaim, one replica): harmless here.
This is a cluster for testing, never for data: no replication, no authentication, the OSD's data is in memory.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import List, Optional

from ..errors import NvmeofError, ToolMissing
from ..output import progress

# The daemons and tools a cluster needs, each with the Debian package that has it.
TOOLS = {"ceph-mon": "ceph-mon", "ceph-osd": "ceph-osd", "monmaptool": "ceph-mon", "ceph": "ceph-common",
         "rbd": "ceph-common"}
DEFAULT_PORT = 6789
DEFAULT_MEMSTORE_BYTES = 1 << 30  # the OSD's whole store, in memory
START_TIMEOUT = 60.0  # seconds for each daemon to answer (a TCG guest is slow)


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def missing_tools() -> List[str]:
    """The Debian packages to install before a cluster can start (empty when it can)."""
    return sorted({pkg for tool, pkg in TOOLS.items() if shutil.which(tool) is None})


class DevCluster:
    """One monitor (`mon.a`) and one memstore OSD (`osd.0`) under `directory`, at `addr:port`."""

    def __init__(self, directory: Path, addr: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 memstore_bytes: int = DEFAULT_MEMSTORE_BYTES, pool: str = "rbd"):
        self.directory = Path(directory)
        self.addr = addr
        self.port = port or _free_port(addr)  # 0: any free port (tests beside another cluster)
        self.memstore_bytes = memstore_bytes
        self.pool = pool

    @property
    def conf(self) -> Path:
        return self.directory / "ceph.conf"

    def _pid_file(self, daemon: str) -> Path:
        return self.directory / "run" / f"{daemon}.pid"

    def _config_text(self, fsid: str) -> str:
        d = self.directory
        return "\n".join([
            "[global]",
            f"fsid = {fsid}",
            f"mon host = {self.addr}:{self.port}",
            "auth cluster required = none", "auth service required = none", "auth client required = none",
            "osd pool default size = 1", "osd pool default min size = 1",
            "osd objectstore = memstore", f"memstore device bytes = {self.memstore_bytes}",
            "osd crush chooseleaf type = 0", "mon allow pool size one = true",
            # the OSD's own crush updates at start race its first monitor session on a slow (emulated) machine
            # ("wrong fsid"); the crush entry is made here instead
            "osd crush update on start = false", "osd class update on start = false",
            "mon allow pool delete = true", "mon warn on pool no redundancy = false",
            # A PG's read lease (ratio x osd_heartbeat_grace 20 s; 16 s by default) runs out while the OSD is frozen
            # (pause()); a one-OSD cluster has no peer to renew it with, and Ceph 16.2 does not always look at such a
            # "laggy" PG again: its ops wait "for readable" for good (ceph-container issue 1682), as the lab's frozen
            # cluster test met after a 15 s pause.  With one OSD the lease guards nothing (no other replica serves
            # reads), so it is made longer than any pause here: 10 minutes.
            "osd pool default read lease ratio = 30",
            f"run dir = {d / 'run'}", f"log file = {d / 'log' / '$name.log'}",
            f"pid file = {d / 'run' / '$name.pid'}", f"admin socket = {d / 'run' / '$name.asok'}",
            "", "[mon.a]", f"mon data = {d / 'mon'}", f"public addr = {self.addr}:{self.port}",
            "", "[osd.0]", f"osd data = {d / 'osd0'}", "",
        ])

    def _run(self, args: List[str], what: str, timeout: float = START_TIMEOUT) -> str:
        try:
            proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise NvmeofError(f"{what}: no answer within {timeout:.0f} s ({' '.join(args[:4])} ...)",
                              f"look at the daemons' logs in {self.directory / 'log'}")
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
            raise NvmeofError(f"{what} failed (exit {proc.returncode}): {tail}",
                              f"look at the daemons' logs in {self.directory / 'log'}")
        return proc.stdout

    def ceph(self, *args: str, timeout: float = START_TIMEOUT) -> str:
        """The `ceph` CLI against this cluster."""
        return self._run(["ceph", "-c", str(self.conf), "--connect-timeout", str(int(timeout)), *args],
                         f"ceph {' '.join(args)}", timeout + 5)

    def rbd(self, *args: str, timeout: float = START_TIMEOUT) -> str:
        """The `rbd` CLI against this cluster."""
        return self._run(["rbd", "-c", str(self.conf), *args], f"rbd {' '.join(args)}", timeout)

    def running(self) -> bool:
        return all(self._alive(d) for d in ("mon.a", "osd.0"))

    def _alive(self, daemon: str) -> bool:
        pid = self._pid(daemon)
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    def _pid(self, daemon: str) -> Optional[int]:
        try:
            return int(self._pid_file(daemon).read_text().strip())
        except (OSError, ValueError):
            return None

    def start(self) -> "DevCluster":
        """Make and start the cluster (about 7 s on a host, longer in an emulated guest); the pool is ready."""
        missing = missing_tools()
        if missing:
            raise ToolMissing(next(t for t, p in TOOLS.items() if p == missing[0]), " ".join(missing))
        if self.running():
            return self
        started = time.monotonic()
        progress(f"ceph: starting a one-monitor, one-OSD (memstore) cluster at {self.addr}:{self.port} "
                 f"under {self.directory}")
        if self.directory.exists():
            shutil.rmtree(self.directory)
        for sub in ("run", "log", "mon", "osd0"):
            (self.directory / sub).mkdir(parents=True)
        fsid = str(uuid.uuid4())
        self.conf.write_text(self._config_text(fsid))
        monmap = self.directory / "monmap"
        self._run(["monmaptool", "--create", "--add", "a", f"{self.addr}:{self.port}", "--fsid", fsid, str(monmap)],
                  "monmaptool --create")
        self._run(["ceph-mon", "-c", str(self.conf), "--mkfs", "-i", "a", "--monmap", str(monmap)], "ceph-mon --mkfs")
        self._run(["ceph-mon", "-c", str(self.conf), "-i", "a"], "ceph-mon -i a")
        self._wait("the monitor to answer", lambda: self.ceph("mon", "stat", timeout=10))
        osd_id = self.ceph("osd", "create").strip()
        if osd_id != "0":
            raise NvmeofError(f"ceph osd create gave id {osd_id!r}, expected 0", f"remove {self.directory} and retry")
        self._run(["ceph-osd", "-c", str(self.conf), "-i", "0", "--mkfs"], "ceph-osd --mkfs")
        self.ceph("osd", "crush", "add", "osd.0", "1.0", "host=localhost", "root=default")
        self._run(["ceph-osd", "-c", str(self.conf), "-i", "0"], "ceph-osd -i 0")
        self._wait("osd.0 to be up", self._osd_up)
        self.ceph("osd", "pool", "create", self.pool, "8")
        self.ceph("osd", "pool", "application", "enable", self.pool, "rbd")
        self.rbd("pool", "init", self.pool)
        progress(f"ceph: cluster up in {time.monotonic() - started:.1f} s (conf {self.conf})")
        return self

    def _osd_up(self) -> None:
        if json.loads(self.ceph("osd", "stat", "--format", "json", timeout=10)).get("num_up_osds") != 1:
            raise NvmeofError("osd.0 is not up yet")

    def _wait(self, what: str, probe) -> None:
        """Call `probe` until it stops raising (a daemon just started answers after a moment)."""
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                probe()
                return
            except NvmeofError as exc:
                if time.monotonic() > deadline:
                    raise NvmeofError(f"ceph: waited {START_TIMEOUT:.0f} s for {what}: {exc.message}",
                                      f"look at the daemons' logs in {self.directory / 'log'}")
                time.sleep(0.3)

    def status(self) -> dict:
        """`ceph status` as JSON, with whether the daemons run."""
        out = {"directory": str(self.directory), "conf": str(self.conf), "mon": f"{self.addr}:{self.port}",
               "running": self.running()}
        if out["running"]:
            out["status"] = json.loads(self.ceph("status", "--format", "json"))
        return out

    def stop(self, timeout: float = 20.0) -> None:
        """Stop both daemons (SIGTERM, then SIGKILL after `timeout`); the directory stays."""
        for daemon in ("osd.0", "mon.a"):
            pid = self._pid(daemon)
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + timeout
            while self._alive(daemon) and time.monotonic() < deadline:
                time.sleep(0.1)
            if self._alive(daemon):
                os.kill(pid, signal.SIGKILL)

    def pause(self) -> None:
        """Freeze both daemons (SIGSTOP): to clients the cluster is gone, nothing of it is lost.  Returns once
        every thread of theirs is stopped (a signal takes effect as each thread next runs: a request sent at once
        could still be answered)."""
        pids = [pid for pid in (self._pid(d) for d in ("osd.0", "mon.a")) if pid is not None]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not all(_stopped(pid) for pid in pids):
            time.sleep(0.01)

    def resume(self) -> None:
        for daemon in ("mon.a", "osd.0"):
            pid = self._pid(daemon)
            if pid is not None:
                os.kill(pid, signal.SIGCONT)

    def __enter__(self) -> "DevCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _stopped(pid: int) -> bool:
    """Every thread of `pid` stopped (state T in /proc), or the process gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for tid in tasks:
        try:
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()
        except OSError:
            continue
        if stat[stat.rindex(")") + 2] not in "Tt":
            return False
    return True
