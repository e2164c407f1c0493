"""Running external programs (nvme, rdma, modprobe, ibv_devinfo, ...) with subprocess.

Each tool has its own small wrapper module (nvme_cli.py, rdma.py, modules.py) built on `run()`:
a missing program becomes `ToolMissing` (naming the Debian package), a failed call a `ToolResult`
the caller turns into a message that names the cause.
"""
import logging
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from typing import Optional, Sequence

from ..errors import NvmeofError, ToolMissing

log = logging.getLogger(__name__)


@dataclass
class ToolResult:
    argv: list
    exit_code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def cmdline(self) -> str:
        return " ".join(str(a) for a in self.argv)


def run(tool: str, args: Sequence, package: str, timeout: Optional[float] = 60,
        env: Optional[dict] = None) -> ToolResult:
    """Run `tool args...`; never raises for a non-zero exit (check `.ok`)."""
    path = shutil.which(tool) or (f"/usr/sbin/{tool}" if os.path.exists(f"/usr/sbin/{tool}") else None) \
        or (f"/sbin/{tool}" if os.path.exists(f"/sbin/{tool}") else None)
    if path is None:
        raise ToolMissing(tool, package)
    args = [str(a) for a in args]
    run_env = dict(os.environ)
    run_env.update({"LC_ALL": "C", "LANG": "C"})
    if env:
        run_env.update(env)
    log.debug("run: %s %s", tool, " ".join(args))
    try:
        proc = subprocess.run([path] + args, stdin=subprocess.DEVNULL, capture_output=True, env=run_env,
                              timeout=timeout)
    except FileNotFoundError:
        raise ToolMissing(tool, package) from None
    except subprocess.TimeoutExpired:
        raise NvmeofError(f"{tool} {' '.join(args)}: timed out after {timeout} s",
                          "check the target is reachable; see dmesg for the kernel's view") from None
    if proc.returncode < 0:
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:
            name = str(-proc.returncode)
        raise NvmeofError(f"{tool} {' '.join(args)}: killed by a signal ({name})", "see dmesg")
    out = proc.stdout.decode("utf-8", "replace")
    err = proc.stderr.decode("utf-8", "replace")
    res = ToolResult([tool] + args, proc.returncode, out, err)
    log.debug("exit %d, stdout %r, stderr %r", res.exit_code, out[:200], err[:200])
    return res
