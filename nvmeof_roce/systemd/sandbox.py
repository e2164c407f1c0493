"""What the userspace target's unit lets it reach, against what a config names.

nvmeof-roce-target@.service runs the target in a sandbox: `PrivateTmp=yes` (the unit's /tmp and /var/tmp are its
own, deleted when it stops and at boot), `ProtectHome=yes` (/root, /home and /run/user are empty),
`ProtectSystem=strict` (everything read-only but the unit's directories and `ReadWritePaths=`) and
`DevicePolicy=closed` (no device but those of `DeviceAllow=`).  A namespace there works by hand and is lost or
refused under the unit.  `problems` names each such path, the setting that hides it and the fix;
`drop_in` writes the `DeviceAllow=` and `ReadWritePaths=` lines a config's devices and directories need.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ..config import TargetConfig, keys
from ..config.backends import facts

TARGET_UNIT = "nvmeof-roce-target@.service"
DROP_IN = "nvmeof-roce-paths.conf"  # the drop-in install-units writes for an instance's config
HOME_DIRS = ("/root", "/home", "/run/user")
PRIVATE_TMP_DIRS = ("/tmp", "/var/tmp")
STATE_DIR = "/var/lib/nvmeof-roce"  # the unit's StateDirectory=nvmeof-roce: the place for file images


def under(path: str, dirs) -> Optional[str]:
    """The first of `dirs` that `path` lies in (or is), else None."""
    p = os.path.normpath(os.path.abspath(path))
    return next((d for d in dirs if p == d or p.startswith(d.rstrip("/") + "/")), None)


@dataclass
class Sandbox:
    """The settings of the [Service] section that decide which paths the target reaches."""
    private_tmp: bool = False
    protect_home: str = "no"
    protect_system: str = "no"
    device_policy: str = "auto"
    device_allow: List[str] = field(default_factory=list)
    read_write_paths: List[str] = field(default_factory=list)
    state_dirs: List[str] = field(default_factory=list)
    runtime_dirs: List[str] = field(default_factory=list)
    sources: List[str] = field(default_factory=list)

    def writable(self) -> List[str]:
        return ([p.lstrip("-+") for p in self.read_write_paths] + [f"/var/lib/{d}" for d in self.state_dirs]
                + [f"/run/{d}" for d in self.runtime_dirs] + list(PRIVATE_TMP_DIRS) + ["/dev"])


_YES = ("yes", "true", "1", "on")


def parse_unit(text: str, instance: str, sandbox: Optional[Sandbox] = None, source: str = "") -> Sandbox:
    """Add the [Service] settings of one unit file or drop-in to `sandbox` (%i is `instance`).  As systemd does,
    a list setting given empty clears what came before."""
    box = sandbox or Sandbox()
    box.sources.append(source)
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
            continue
        if section != "[Service]" or "=" not in line:
            continue
        key, value = (s.strip() for s in line.split("=", 1))
        value = value.replace("%i", instance)
        lists = {"DeviceAllow": box.device_allow, "ReadWritePaths": box.read_write_paths,
                 "StateDirectory": box.state_dirs, "RuntimeDirectory": box.runtime_dirs}
        if key in lists:
            if not value:
                lists[key].clear()
            elif key == "DeviceAllow":
                lists[key].append(value)
            else:
                lists[key].extend(value.split())
        elif key == "PrivateTmp":
            box.private_tmp = value.lower() in _YES
        elif key == "ProtectHome":
            box.protect_home = "yes" if value.lower() in _YES else value.lower()
        elif key == "ProtectSystem":
            box.protect_system = "yes" if value.lower() in _YES else value.lower()
        elif key == "DevicePolicy":
            box.device_policy = value
    return box


def instance_unit(instance: str) -> str:
    return TARGET_UNIT.replace("@", f"@{instance}")


def load_sandbox(instance: str, unit_dir: str, shipped_text: str, installed: bool = True,
                 skip: str = "") -> Sandbox:
    """The unit as systemd would run instance `instance`: the installed template in `unit_dir` (else, or with
    installed False, `shipped_text`), then the template's and the instance's drop-ins in name order (but `skip`,
    a drop-in about to be rewritten)."""
    path = os.path.join(unit_dir, TARGET_UNIT)
    try:
        if not installed:
            raise FileNotFoundError(path)
        with open(path) as f:
            box = parse_unit(f.read(), instance, source=path)
    except OSError:
        box = parse_unit(shipped_text, instance, source=f"the shipped {TARGET_UNIT}")
    drop_ins: Dict[str, str] = {}
    for d in (f"{TARGET_UNIT}.d", f"{instance_unit(instance)}.d"):
        full = os.path.join(unit_dir, d)
        try:
            names = sorted(n for n in os.listdir(full) if n.endswith(".conf"))
        except OSError:
            continue
        for n in names:
            drop_ins[n] = os.path.join(full, n)  # an instance's drop-in replaces the template's of that name
    for n in sorted(drop_ins):
        if drop_ins[n] == skip:
            continue
        try:
            with open(drop_ins[n]) as f:
                parse_unit(f.read(), instance, box, drop_ins[n])
        except OSError:
            continue
    return box


def _block_device(path: str) -> Optional[os.stat_result]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st if stat.S_ISBLK(st.st_mode) else None


def _device_allowed(box: Sandbox, path: str) -> bool:
    st = _block_device(path)
    for entry in box.device_allow:
        spec = entry.split()[0]
        if spec.startswith("/"):
            if os.path.normpath(spec) == os.path.normpath(path):
                return True
            allowed = _block_device(spec)
            if st is not None and allowed is not None and allowed.st_rdev == st.st_rdev:
                return True
        elif spec.startswith("block-") and st is not None and spec[6:] == _block_major_name(os.major(st.st_rdev)):
            return True
    return False


def _block_major_name(major: int) -> str:
    """The driver's name of a block major in /proc/devices (DeviceAllow=block-NAME)."""
    try:
        with open("/proc/devices") as f:
            text = f.read().split("Block devices:", 1)[1]
    except (OSError, IndexError):
        return ""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == str(major):
            return parts[1]
    return ""


@dataclass
class Finding:
    where: str      # the config's field
    path: str
    problem: str
    fix: str
    drop_in: Tuple[str, str] = ("", "")  # a drop-in line that fixes it: (setting, value); none: move the path


def namespace_paths(config: TargetConfig) -> List[Tuple[str, str]]:
    """(field, path) of every enabled file or block-device namespace."""
    out = []
    for i, sub in enumerate(config.subsystems):
        for j, ns in enumerate(sub.namespaces):
            if ns.enabled and facts(ns.backend).path and ns.path:
                out.append((f"subsystems[{i}].namespaces[{j}].device.path", ns.path))
    return out


def key_file_paths(config: TargetConfig) -> List[Tuple[str, str]]:
    """(field, path) of every DH-HMAC-CHAP key file the config names, directly or through its keyring."""
    ring = keys.keyring_of(config)
    out = [(f"{keys.USERSPACE_KEY}.{keys.KEYRING}.{name}", path) for name, path in sorted(ring.items())]
    for i, host in enumerate(config.host_entries):
        for name in ("key", "ctrl_key"):
            value = (host.attrs.get("dhchap") or {}).get(name)
            if isinstance(value, str) and keys.kind(value) == "file":
                out.append((f"hosts[{i}].dhchap.{name}", value))
    return out


def problems(config: TargetConfig, box: Sandbox, instance: str, drop_in_dir: str) -> List[Finding]:
    """Every namespace path of `config` the unit's sandbox hides, makes read-only or keeps from being opened, and
    every key file it hides."""
    drop_in = os.path.join(drop_in_dir, f"{instance_unit(instance)}.d", DROP_IN)
    move = f"move it to {STATE_DIR} (the unit's StateDirectory, kept across restarts and boots)"
    found = []
    for where, path in key_file_paths(config):  # only read: hidden is the one way to lose one
        tmp = under(path, PRIVATE_TMP_DIRS) if box.private_tmp else None
        home = under(path, HOME_DIRS) if box.protect_home in ("yes", "tmpfs") else None
        if tmp or home:
            setting = "PrivateTmp=yes" if tmp else f"ProtectHome={box.protect_home}"
            found.append(Finding(where, path, f"key file {path} is in {tmp or home}, which {setting} hides from the "
                                 "unit", "move it to /etc/nvmeof-roce/keys/ (mode 0600) and name that path"))
    for where, path in namespace_paths(config):
        tmp = under(path, PRIVATE_TMP_DIRS)
        home = under(path, HOME_DIRS)
        if box.private_tmp and tmp:
            found.append(Finding(where, path, f"{path} is in {tmp}, which PrivateTmp=yes makes the unit's own: "
                                 "the target would serve an empty private copy, deleted when the unit stops and at "
                                 "boot", move))
        elif box.protect_home in ("yes", "read-only", "tmpfs") and home:
            found.append(Finding(where, path, f"{path} is in {home}, which ProtectHome={box.protect_home} hides "
                                 "from the unit", move))
        elif under(path, ("/dev",)) or _block_device(path):
            if box.device_policy in ("closed", "strict") and not _device_allowed(box, path):
                found.append(Finding(where, path, f"{path}: DevicePolicy={box.device_policy} keeps the unit from "
                                     "opening it (no DeviceAllow= names it)",
                                     f"add DeviceAllow={path} rw in {drop_in} (nvmeof-roce install-units writes "
                                     "it), then systemctl daemon-reload", ("DeviceAllow", f"{path} rw")))
        elif box.protect_system == "strict" and not under(path, box.writable()):
            directory = os.path.dirname(os.path.normpath(os.path.abspath(path)))
            found.append(Finding(where, path, f"{path}: ProtectSystem=strict makes {directory} read-only for the "
                                 "unit", f"add ReadWritePaths=-{directory} in {drop_in} (nvmeof-roce install-units "
                                 f"writes it), or {move}", ("ReadWritePaths", directory)))
        elif box.protect_system in ("yes", "full") and under(path, ("/usr", "/boot", "/efi")
                                                            + (("/etc",) if box.protect_system == "full" else ())):
            found.append(Finding(where, path, f"{path}: ProtectSystem={box.protect_system} makes it read-only for "
                                 "the unit", move))
    return found


def drop_in_text(config: TargetConfig, source: str) -> str:
    """The drop-in for `config`'s devices and directories: DeviceAllow= for each block device and
    ReadWritePaths= for each file namespace's directory outside the unit's own."""
    box = parse_unit("[Service]\nStateDirectory=nvmeof-roce\n", "")
    lines = []
    for _where, path in namespace_paths(config):
        if under(path, ("/dev",)) or _block_device(path):
            line = f"DeviceAllow={path} rw"
        elif under(path, PRIVATE_TMP_DIRS + HOME_DIRS) or under(path, box.writable()):
            continue
        else:
            # "-": a directory not made yet is skipped, not a unit that fails to start (the target then names it)
            line = f"ReadWritePaths=-{os.path.dirname(os.path.normpath(os.path.abspath(path)))}"
        if line not in lines:
            lines.append(line)
    return (f"# Written by nvmeof-roce install-units for {source}: its block devices and the directories of its\n"
            "# files, which the unit's DevicePolicy=closed and ProtectSystem=strict keep out otherwise.\n"
            "[Service]\n" + "".join(f"{line}\n" for line in lines))


def hidden_executable(exe: str, package_dir: str) -> Optional[str]:
    """Why the unit could not run `exe` (the ExecStart command) with ProtectHome=yes, or None: the command or
    the package it runs lies in a home directory."""
    command = exe.split()[0]
    for what, path in (("the command", command), ("the nvmeof_roce package it runs", package_dir)):
        home = under(path, HOME_DIRS)
        if home:
            return f"{what}, {path}, is in {home}, which the unit's ProtectHome=yes hides"
    return None
