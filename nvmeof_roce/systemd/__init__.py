"""systemd units shipped with the package, and `nvmeof-roce install-units` to put them in place.

    nvmeof-roce-nvmet.service       restores the kernel target at boot (nvmet restore / nvmet clear)
    nvmeof-roce-target@.service     the userspace target for /etc/nvmeof-roce/%i.json (Type=notify)

The units name /usr/bin/nvmeof-roce; install-units writes the path of the nvmeof-roce being run instead
(a virtualenv, /usr/local/bin...), then asks systemd to reload its units.  For each config in /etc/nvmeof-roce
it writes a drop-in with the config's block devices (DeviceAllow=) and file directories (ReadWritePaths=), and
refuses, writing nothing, a path the unit's sandbox would still hide (sandbox.py) or an ExecStart in a home
directory (ProtectHome=yes).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

from ..errors import NvmeofError
from ..output import emit

UNIT_DIR = Path(__file__).parent
UNITS = ("nvmeof-roce-nvmet.service", "nvmeof-roce-target@.service")
SHIPPED_EXECUTABLE = "/usr/bin/nvmeof-roce"
DEFAULT_DEST = "/etc/systemd/system"
CONFIG_DIR = "/etc/nvmeof-roce"  # the unit's /etc/nvmeof-roce/%i.json


def executable() -> str:
    """The nvmeof-roce command to put in ExecStart: the one on PATH, else this Python running the module."""
    found = shutil.which("nvmeof-roce")
    if found:
        return os.path.abspath(found)
    return f"{sys.executable} -m nvmeof_roce"


def render(name: str, exe: str) -> str:
    return (UNIT_DIR / name).read_text().replace(SHIPPED_EXECUTABLE, exe)


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as exc:
        raise NvmeofError(f"cannot write {path}: {exc.strerror}", "run as root, or give --dest DIR") from None


def install(dest: str, exe: str) -> List[str]:
    try:
        os.makedirs(dest, exist_ok=True)
    except OSError as exc:
        raise NvmeofError(f"cannot create {dest}: {exc.strerror}", "run as root, or give --dest DIR") from None
    written = []
    for name in UNITS:
        path = os.path.join(dest, name)
        _write(path, render(name, exe))
        written.append(path)
    return written


def plan_drop_ins(dest: str, exe: str, config_dir: str) -> Dict[str, str]:
    """The drop-in of each config in `config_dir` (NAME.json: instance NAME), by path; NvmeofError naming every
    path the unit could still not reach with it (PrivateTmp, ProtectHome), and an ExecStart in a hidden home."""
    from ..config import ConfigError, load_config
    from . import sandbox
    problems = []
    hidden = sandbox.hidden_executable(exe, str(UNIT_DIR.parent))
    if hidden:
        problems.append(f"ExecStart: {hidden}\n  fix: install nvmeof-roce outside /root and /home (python3 -m venv "
                        "--system-site-packages /opt/nvmeof-roce; /opt/nvmeof-roce/bin/pip install ...), then "
                        "install-units with it, or give --executable PATH")
    drop_ins = {}
    template = render("nvmeof-roce-target@.service", exe)
    names = sorted(n for n in (os.listdir(config_dir) if os.path.isdir(config_dir) else []) if n.endswith(".json"))
    for name in names:
        instance, source = name[:-5], os.path.join(config_dir, name)
        try:
            config = load_config(source)
        except ConfigError as exc:
            problems.append(f"{exc}\n  (nvmeof-roce target check {source} lists every problem)")
            continue
        text = sandbox.drop_in_text(config, source)
        path = os.path.join(dest, f"{sandbox.instance_unit(instance)}.d", sandbox.DROP_IN)
        box = sandbox.load_sandbox(instance, dest, template, installed=False, skip=path)
        sandbox.parse_unit(text, instance, box, path)
        for f in sandbox.problems(config, box, instance, dest):
            problems.append(f"{source}: {f.where}: {f.problem}\n  fix: {f.fix}")
        drop_ins[path] = text
    if problems:
        raise NvmeofError("the unit could not serve what these name; nothing was installed:\n" + "\n".join(problems),
                          f"fix each, then run install-units again (nvmeof-roce target check --unit NAME "
                          f"{config_dir}/NAME.json checks one)")
    return drop_ins


def _cmd_install_units(args) -> int:
    exe = args.executable or executable()
    drop_ins = plan_drop_ins(args.dest, exe, args.config_dir)
    written = install(args.dest, exe)
    for path, text in drop_ins.items():
        _write(path, text)
    reloaded = False
    if not args.no_reload and shutil.which("systemctl") and os.path.isdir("/run/systemd/system"):
        reloaded = subprocess.run(["systemctl", "daemon-reload"], capture_output=True).returncode == 0
    emit({"units": written, "drop_ins": sorted(drop_ins), "executable": exe, "daemon_reload": reloaded}, args.json,
         lambda r: print(
             "\n".join(f"installed {p}" for p in written + sorted(drop_ins))
             + ("\nsystemctl daemon-reload: done" if reloaded else "")
             + "\nnext: nvmeof-roce nvmet save && systemctl enable nvmeof-roce-nvmet.service, or put a target config "
               f"in {args.config_dir}/NAME.json, run install-units again (it writes the drop-in for the config's "
               "devices) and systemctl enable --now nvmeof-roce-target@NAME"))
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
    p.add_argument("--config-dir", default=CONFIG_DIR, metavar="DIR",
                   help=f"the userspace target's configs, NAME.json for instance NAME (default {CONFIG_DIR}): each "
                        "is checked against the unit's sandbox and gets a drop-in with its devices and directories")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_cmd_install_units)
