"""systemd units shipped with the package, and `nvmeof-roce install-units` to put them in place.

    nvmeof-roce-nvmet.service       restores the kernel target at boot (nvmet restore / nvmet clear)
    nvmeof-roce-target@.service     the userspace target for /etc/nvmeof-roce/%i.json (Type=notify)

The units name /usr/bin/nvmeof-roce; install-units writes the path of the nvmeof-roce being run instead
(a virtualenv, /usr/local/bin...), then asks systemd to reload its units.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

from ..errors import NvmeofError
from ..output import emit

UNIT_DIR = Path(__file__).parent
UNITS = ("nvmeof-roce-nvmet.service", "nvmeof-roce-target@.service")
SHIPPED_EXECUTABLE = "/usr/bin/nvmeof-roce"
DEFAULT_DEST = "/etc/systemd/system"


def executable() -> str:
    """The nvmeof-roce command to put in ExecStart: the one on PATH, else this Python running the module."""
    found = shutil.which("nvmeof-roce")
    if found:
        return os.path.abspath(found)
    return f"{sys.executable} -m nvmeof_roce"


def render(name: str, exe: str) -> str:
    return (UNIT_DIR / name).read_text().replace(SHIPPED_EXECUTABLE, exe)


def install(dest: str, exe: str) -> List[str]:
    try:
        os.makedirs(dest, exist_ok=True)
    except OSError as exc:
        raise NvmeofError(f"cannot create {dest}: {exc.strerror}", "run as root, or give --dest DIR") from None
    written = []
    for name in UNITS:
        path = os.path.join(dest, name)
        tmp = f"{path}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(render(name, exe))
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except OSError as exc:
            raise NvmeofError(f"cannot write {path}: {exc.strerror}", "run as root, or give --dest DIR") from None
        written.append(path)
    return written


def _cmd_install_units(args) -> int:
    exe = args.executable or executable()
    written = install(args.dest, exe)
    reloaded = False
    if not args.no_reload and shutil.which("systemctl") and os.path.isdir("/run/systemd/system"):
        reloaded = subprocess.run(["systemctl", "daemon-reload"], capture_output=True).returncode == 0
    emit({"units": written, "executable": exe, "daemon_reload": reloaded}, args.json, lambda r: print(
        "\n".join(f"installed {p}" for p in written)
        + ("\nsystemctl daemon-reload: done" if reloaded else "")
        + "\nnext: nvmeof-roce nvmet save && systemctl enable nvmeof-roce-nvmet.service, or put a target config in "
          "/etc/nvmeof-roce/NAME.json and systemctl enable --now nvmeof-roce-target@NAME"))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("install-units", help="install the systemd units (kernel target restore, userspace "
                                                     "target service)",
                              description="Write nvmeof-roce-nvmet.service and nvmeof-roce-target@.service to "
                                          "DEST (default /etc/systemd/system) with this nvmeof-roce's path in "
                                          "ExecStart, then systemctl daemon-reload.")
    p.add_argument("--dest", default=DEFAULT_DEST, metavar="DIR")
    p.add_argument("--executable", metavar="PATH", help="the nvmeof-roce command for ExecStart (default: found)")
    p.add_argument("--no-reload", action="store_true", help="do not run systemctl daemon-reload")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_cmd_install_units)
