"""Boot the lab guest under QEMU, run one command (or a shell) in it, return its exit code.

One boot = one fresh guest: the root disk is opened with snapshot=on, so every
boot starts from the built image.  The guest reaches the host only through
9p shares: `ctl` (the command, its environment, the exit code it reports),
`project` (the checkout, read-write at /mnt/project) and `share` (--share DIR,
at /mnt/share).  QEMU is always killed at the timeout, on Ctrl-C, or on error.
"""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from ..errors import NvmeofError, ToolMissing
from .image import LabImage

QEMU = "qemu-system-x86_64"
SETUP_FAILED = 125  # exit code the guest's init reports when Soft-RoCE setup failed


@dataclass
class LabRun:
    command: List[str]
    project: Path
    share: Optional[Path] = None
    timeout: float = 1800.0
    memory_mb: int = 4096
    cpus: int = 2
    kvm: bool = False
    interactive: bool = False
    rxe: bool = True
    env: Dict[str, str] = field(default_factory=dict)
    cmdline: str = ""                                     # extra kernel parameters (two-node: nvmeof.node=...)
    extra_args: List[str] = field(default_factory=list)   # extra QEMU arguments (two-node: the NIC)
    modules: Dict[str, Path] = field(default_factory=dict)  # kernel modules built for this run (--siw): name -> .ko
    missing_modules: Dict[str, str] = field(default_factory=dict)  # asked for but not to be had: name -> why


def qemu_args(image: LabImage, run: LabRun, ctl: Path) -> List[str]:
    accel = ["-accel", "kvm", "-cpu", "host"] if run.kvm else ["-accel", "tcg,thread=multi", "-cpu", "max"]
    args = [QEMU, *accel, "-smp", str(run.cpus), "-m", f"{run.memory_mb}M",
            "-kernel", str(image.kernel), "-initrd", str(image.initrd),
            "-append", "console=ttyS0 root=/dev/vda rw quiet loglevel=3 panic=-1" + (f" {run.cmdline}" if run.cmdline else ""),
            "-drive", f"file={image.disk},if=virtio,format=raw,snapshot=on,cache=unsafe",
            "-virtfs", f"local,path={ctl},mount_tag=ctl,security_model=none,id=ctl",
            "-virtfs", f"local,path={run.project},mount_tag=project,security_model=none,id=project",
            "-nic", "none", "-no-reboot"]
    if run.share is not None:
        args += ["-virtfs", f"local,path={run.share},mount_tag=share,security_model=none,id=share"]
    args += run.extra_args
    if run.interactive:
        args += ["-nographic"]  # serial and monitor multiplexed on this terminal (Ctrl-A X quits)
    else:
        args += ["-display", "none", "-serial", "stdio", "-monitor", "none"]
    return args


def _write_ctl(ctl: Path, run: LabRun) -> None:
    env_lines = [f"LAB_MODE={'shell' if run.interactive else 'run'}", f"LAB_RXE={1 if run.rxe else 0}"]
    env_lines += [f"export {k}={shlex.quote(v)}" for k, v in run.env.items()]
    # The guest's init installs these before anything runs; a test that needs a missing one skips with the reason.
    if run.modules:
        (ctl / "modules").mkdir(exist_ok=True)
        for name, ko in run.modules.items():
            shutil.copy2(ko, ctl / "modules" / f"{name}.ko")
    env_lines += [f"export NVMEOF_LAB_NO_{name.upper()}={shlex.quote(why)}" for name, why in run.missing_modules.items()]
    (ctl / "env").write_text("\n".join(env_lines) + "\n")
    (ctl / "cmd.sh").write_text("exec " + " ".join(shlex.quote(c) for c in run.command) + "\n" if run.command else "true\n")


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def run_in_guest(image: LabImage, run: LabRun) -> int:
    """Boot, run `run.command` in /mnt/project as root, stream its output, return its exit code."""
    if shutil.which(QEMU) is None:
        raise ToolMissing(QEMU, "qemu-system-x86")
    if run.share is not None:
        run.share.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="nvmeof-lab-ctl-") as tmp:
        ctl = Path(tmp)
        _write_ctl(ctl, run)
        args = qemu_args(image, run, ctl)
        started = time.monotonic()
        if run.interactive:
            proc = subprocess.Popen(args, start_new_session=False)
        else:
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        try:
            if run.interactive:
                proc.wait(timeout=run.timeout)
            else:
                _stream(proc, started + run.timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            raise NvmeofError(f"lab guest did not finish within {run.timeout:.0f} s; QEMU (pid {proc.pid}) was killed",
                              "raise --timeout if the command needs longer, or look at the output above for where it hung")
        finally:
            _kill(proc)
        code_file = ctl / "exit-code"
        if not code_file.exists():
            raise NvmeofError(f"lab guest stopped without reporting an exit code (QEMU exit {proc.returncode})",
                              "look at the guest's console output above (kernel panic, init failure)")
        code = int(code_file.read_text().strip() or SETUP_FAILED)
        if code == SETUP_FAILED:
            raise NvmeofError("lab guest: Soft-RoCE setup failed (see the message above)",
                              "rebuild the image with 'nvmeof-roce lab build --force'")
        return code


def _stream(proc: subprocess.Popen, deadline: float) -> None:
    """Copy the guest's console to our stdout until QEMU exits or the deadline passes."""
    import selectors

    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    out = sys.stdout.buffer
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise subprocess.TimeoutExpired(proc.args, 0)
            if sel.select(timeout=min(remaining, 1.0)):
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                out.write(chunk.replace(b"\r\n", b"\n").replace(b"\r", b""))
                out.flush()
            elif proc.poll() is not None:
                break
    proc.wait()
