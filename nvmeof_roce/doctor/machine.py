"""Where the checks get their facts: files under a root path, external tools, the clock.

`Machine` is the only thing the checks touch.  On a live host it reads `/` and runs the
real tools; in tests (and with `--root`) it reads a captured tree and replays the tool
outputs recorded beside it, so every check runs unchanged against either.

A captured tree looks like the host's own filesystem (`sys/`, `proc/`, `dev/`, `etc/`,
`lib/modules/...`) plus two files the live host does not have:

  recorded-tools/index.json   the tool runs: [{"argv": [...], "returncode": 0,
                              "stdout_file": "NAME", "stderr": "..."}, ...] and
                              {"missing": ["lldptool", ...]} entries; one argv recorded
                              several times is replayed in order (two counter samples)
  recorded-modes.json         {"/dev/infiniband/uverbs0": "0o20666", ...}: file modes,
                              which git does not keep

`CapturingMachine` writes such a tree from a live host (`nvmeof-roce doctor --capture DIR`).
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from ..errors import NvmeofError, ToolMissing

RECORDED_TOOLS_DIR = "recorded-tools"
RECORDED_MODES_FILE = "recorded-modes.json"

# Debian package (or where to get it) for each external tool the checks run.
TOOL_PACKAGES: Dict[str, str] = {
    "ip": "iproute2",
    "ping": "iputils-ping",
    "dcb": "iproute2",
    "ethtool": "ethtool",
    "nft": "nftables",
    "iptables-save": "iptables",
    "dmesg": "util-linux",
    "ibv_devinfo": "ibverbs-utils",
    "lldptool": "lldpad",
    "mlnx_qos": "mlnx-tools",  # not in Debian: ships with NVIDIA MLNX_OFED / DOCA
}


class ToolNotRun(NvmeofError):
    """A tool was not run: --root points at a tree with no recording of this command."""

    def __init__(self, argv: Sequence[str]):
        super().__init__(f"'{' '.join(argv)}' was not run: --root points at a captured tree with no recording of it")
        self.tool = argv[0]


def missing_tool_reason(exc: Exception) -> str:
    """The one-line 'skipped' reason for a tool that could not be run."""
    if isinstance(exc, ToolMissing):
        if exc.package == "mlnx-tools":
            return f"{exc.tool} not installed (it ships with NVIDIA MLNX_OFED/DOCA: mlnx-tools)"
        return f"{exc.tool} not installed (apt-get install {exc.package})"
    return str(exc)


@dataclass
class ToolResult:
    """What one run of an external tool printed."""

    argv: List[str]
    returncode: int
    stdout: str
    stderr: str = ""

    @property
    def command(self) -> str:
        return " ".join(self.argv)

    @property
    def error(self) -> str:
        """The tool's own complaint: its stderr, else stdout, as one line."""
        text = (self.stderr or self.stdout).strip()
        return " ".join(text.split()) or f"exit status {self.returncode}"


class SubprocessRunner:
    """Runs the real tools.  A tool that is not installed raises ToolMissing."""

    def run(self, argv: Sequence[str], timeout: float = 10.0) -> ToolResult:
        argv = list(argv)
        if shutil.which(argv[0]) is None:
            raise ToolMissing(argv[0], TOOL_PACKAGES.get(argv[0], argv[0]))
        env = dict(os.environ, LC_ALL="C")
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, errors="replace")
        except subprocess.TimeoutExpired:
            return ToolResult(argv, 124, "", f"timed out after {timeout:g} s")
        return ToolResult(argv, proc.returncode, proc.stdout, proc.stderr)


class RecordedRunner:
    """Replays tool outputs recorded in `DIR/index.json` (see the module docstring)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.recordings: Dict[tuple, List[dict]] = {}
        self.missing: set = set()
        index = json.loads((self.directory / "index.json").read_text())
        for entry in index:
            if "missing" in entry:
                self.missing.update(entry["missing"])
            else:
                self.recordings.setdefault(tuple(entry["argv"]), []).append(entry)
        self.replayed: Dict[tuple, int] = {}

    def run(self, argv: Sequence[str], timeout: float = 10.0) -> ToolResult:
        key = tuple(argv)
        entries = self.recordings.get(key)
        if not entries:
            if argv[0] in self.missing:
                raise ToolMissing(argv[0], TOOL_PACKAGES.get(argv[0], argv[0]))
            raise ToolNotRun(argv)
        count = self.replayed.get(key, 0)
        self.replayed[key] = count + 1
        entry = entries[min(count, len(entries) - 1)]
        stdout = ""
        if entry.get("stdout_file"):
            stdout = (self.directory / entry["stdout_file"]).read_text()
        return ToolResult(list(argv), entry.get("returncode", 0), stdout, entry.get("stderr", ""))


class NoToolsRunner:
    """For a --root tree without recordings: every tool is reported as not run."""

    def run(self, argv: Sequence[str], timeout: float = 10.0) -> ToolResult:
        raise ToolNotRun(argv)


class Machine:
    """Read-only access to one host (or a captured copy of it).

    Every path the checks use is absolute as on the host ("/sys/class/infiniband");
    it is resolved under `root`.  Reads never raise: a missing or unreadable file
    is None, a missing directory lists as [].
    """

    def __init__(self, root: str = "/", runner=None, sleep: Callable[[float], None] = time.sleep):
        self.root = Path(root)
        if runner is None:
            runner = self.default_runner(self.root)
        self.runner = runner
        self._sleep = sleep
        self._modes: Optional[Dict[str, int]] = None

    @staticmethod
    def default_runner(root: Path):
        """Real tools on the live root; recorded ones (or none) for a captured tree."""
        if root.resolve() == Path("/"):
            return SubprocessRunner()
        recorded = root / RECORDED_TOOLS_DIR
        if (recorded / "index.json").is_file():
            return RecordedRunner(recorded)
        return NoToolsRunner()

    @property
    def is_live(self) -> bool:
        return self.root.resolve() == Path("/")

    def path(self, host_path: str) -> Path:
        return self.root / host_path.lstrip("/")

    def read(self, host_path: str) -> Optional[str]:
        """The file's text, stripped of surrounding whitespace; None if absent or unreadable."""
        try:
            return self.path(host_path).read_text(errors="replace").strip()
        except (OSError, ValueError):
            return None

    def exists(self, host_path: str) -> bool:
        return os.path.lexists(self.path(host_path))

    def is_dir(self, host_path: str) -> bool:
        return self.path(host_path).is_dir()

    def listdir(self, host_path: str) -> List[str]:
        """Entry names, in natural order ("2" before "10"); [] if absent."""
        try:
            names = os.listdir(self.path(host_path))
        except OSError:
            return []
        return sorted(names, key=natural_key)

    def readlink(self, host_path: str) -> Optional[str]:
        try:
            return os.readlink(self.path(host_path))
        except OSError:
            return None

    def file_mode(self, host_path: str) -> Optional[int]:
        """st_mode of a file (type and permission bits), from recorded-modes.json on a captured tree."""
        if not self.is_live:
            recorded = self._recorded_modes().get(host_path)
            if recorded is not None:
                return recorded
        try:
            return os.stat(self.path(host_path)).st_mode
        except OSError:
            return None

    def _recorded_modes(self) -> Dict[str, int]:
        if self._modes is None:
            try:
                raw = json.loads((self.root / RECORDED_MODES_FILE).read_text())
                self._modes = {k: int(v, 0) for k, v in raw.items()}
            except (OSError, ValueError):
                self._modes = {}
        return self._modes

    def read_kmsg(self) -> Optional[List[str]]:
        """Kernel log records from /dev/kmsg ("PRI,SEQ,USEC,FLAGS;text"), without blocking.

        On a live host /dev/kmsg is a character device read record by record until EAGAIN;
        in a captured tree it is a plain file, one record per line.  None when unreadable.
        """
        path = self.path("/dev/kmsg")
        try:
            mode = os.stat(path).st_mode
        except OSError:
            return None
        if not stat.S_ISCHR(mode):
            text = self.read("/dev/kmsg")
            return None if text is None else text.splitlines()
        records = []
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            while True:
                try:
                    chunk = os.read(fd, 8192)
                except BlockingIOError:
                    break
                except OSError as exc:
                    if exc.errno == errno.EPIPE:  # a record was overwritten while reading: go on
                        continue
                    break
                if not chunk:
                    break
                records.append(chunk.decode(errors="replace").rstrip("\n"))
        finally:
            os.close(fd)
        return records

    def run(self, argv: Sequence[str], timeout: float = 10.0) -> ToolResult:
        """Run an external tool; raises ToolMissing / ToolNotRun when it cannot be run."""
        return self.runner.run(list(argv), timeout=timeout)

    def sleep(self, seconds: float) -> None:
        self._sleep(seconds)


def natural_key(name: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


class CapturingMachine(Machine):
    """A live Machine that also copies everything it reads into `out`, as a replayable tree.

    Files read are copied as regular files, symlinks read with readlink are recreated,
    directories listed are created (so empty ones replay as empty), file modes go to
    recorded-modes.json and tool runs to recorded-tools/.  Nothing else is copied.
    """

    def __init__(self, out: str, root: str = "/", runner=None, sleep=time.sleep):
        super().__init__(root, runner, sleep)
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.tool_index: List[dict] = []
        self.modes: Dict[str, str] = {}
        self.kmsg_records: Optional[List[str]] = None

    def _target(self, host_path: str) -> Path:
        return self.out / host_path.lstrip("/")

    def read(self, host_path: str) -> Optional[str]:
        text = super().read(host_path)
        if text is not None:
            target = self._target(host_path)
            if not target.is_symlink() and not target.is_dir():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text + "\n")
        return text

    def listdir(self, host_path: str) -> List[str]:
        names = super().listdir(host_path)
        if self.is_dir(host_path):
            self._target(host_path).mkdir(parents=True, exist_ok=True)
        return names

    def readlink(self, host_path: str) -> Optional[str]:
        link = super().readlink(host_path)
        target = self._target(host_path)
        if link is not None and not os.path.lexists(target):
            target.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(link, target)
        return link

    def file_mode(self, host_path: str) -> Optional[int]:
        mode = super().file_mode(host_path)
        if mode is not None:
            self.modes[host_path] = oct(mode)
            target = self._target(host_path)
            if not os.path.lexists(target):
                target.parent.mkdir(parents=True, exist_ok=True)
                target.touch()
        return mode

    def read_kmsg(self) -> Optional[List[str]]:
        records = super().read_kmsg()
        if records is not None:
            target = self._target("/dev/kmsg")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("".join(r + "\n" for r in records))
        return records

    def run(self, argv: Sequence[str], timeout: float = 10.0) -> ToolResult:
        try:
            result = super().run(argv, timeout)
        except ToolMissing as exc:
            self.tool_index.append({"missing": [exc.tool]})
            raise
        name = f"{len(self.tool_index):02d}-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", "-".join(argv))[:80] + ".txt"
        tools_dir = self.out / RECORDED_TOOLS_DIR
        tools_dir.mkdir(parents=True, exist_ok=True)
        (tools_dir / name).write_text(result.stdout)
        self.tool_index.append(
            {"argv": list(argv), "returncode": result.returncode, "stdout_file": name, "stderr": result.stderr}
        )
        return result

    def finish(self) -> None:
        """Write the tool index and the recorded file modes."""
        tools_dir = self.out / RECORDED_TOOLS_DIR
        tools_dir.mkdir(parents=True, exist_ok=True)
        (tools_dir / "index.json").write_text(json.dumps(self.tool_index, indent=1) + "\n")
        (self.out / RECORDED_MODES_FILE).write_text(json.dumps(self.modes, indent=1, sort_keys=True) + "\n")
