"""The `rbd` tool (ceph-common), the project's one wrapper of it: for the kernel target an rbd namespace of the
config mapped with krbd, so nvmet serves the block device it gives (`nvmeof-roce nvmet apply`, kernel/apply.py);
for `bench --rbd` (bench/rbd.py) the bench's image made, looked at and removed.

    rbd map -c CONF --id ID --pool POOL [--namespace NS] [--keyring K] IMAGE   -> /dev/rbdN
    rbd showmapped --format json                                             -> what is mapped already
    rbd unmap /dev/rbdN
    rbd info --format json -c CONF --id ID --pool POOL ... IMAGE             -> the image, or None when missing
    rbd create --size SIZE --image-feature F[,F] -c CONF ... IMAGE
    rbd rm --no-progress -c CONF ... IMAGE

Without udevd (no /run/udev/control: the lab's guest) map and unmap take `--options noudev`, else rbd waits for
an event no one sends.  Mapping is idempotent: an image already mapped (same pool, RADOS namespace and image, no snapshot) is reused.
The namespace's device_path is the stable udev link /dev/rbd/POOL[/NS]/IMAGE when it exists and leads to that
device (ceph-common's udev rule makes it), else /dev/rbdN.
"""
from __future__ import annotations

import json
import os
import re
from typing import Callable, Dict, List, Optional, Sequence

from ..config.rbd import RbdSettings
from . import tool
from .nvmet import NvmetError

PACKAGE = "ceph-common"
Runner = Callable[..., tool.ToolResult]
_DEVICE = re.compile(r"/dev/rbd\d+")
UDEV_CONTROL = "/run/udev/control"  # udevd's socket: udevd runs


class RbdTool:
    """`rbd` run through `runner(tool, args, package=..., timeout=...)` (tool.run; tests pass a fake)."""

    def __init__(self, runner: Optional[Runner] = None, exists: Callable[[str], bool] = os.path.exists,
                 realpath: Callable[[str], str] = os.path.realpath, udev: Optional[bool] = None):
        self.runner = runner or tool.run
        self.path_exists = exists  # os.path.exists (the udev link); tests pass a fake
        self.realpath = realpath
        # without udevd (the lab's guest: devtmpfs only) `rbd map` would wait for its event: -o noudev
        self.udev = os.path.exists(UDEV_CONTROL) if udev is None else udev

    def _options(self) -> List[str]:
        return [] if self.udev else ["--options", "noudev"]

    def _run(self, args: List[str], timeout: float = 60) -> tool.ToolResult:
        return self.runner("rbd", args, package=PACKAGE, timeout=timeout)

    def showmapped(self) -> List[dict]:
        """What krbd has mapped: [{"pool", "namespace", "name", "snap", "device"}]."""
        res = self._run(["showmapped", "--format", "json"])
        if not res.ok:
            raise NvmetError(f"rbd showmapped: {(res.stderr or res.stdout).strip()}",
                             "check ceph-common is installed and the rbd module loads (modprobe rbd)")
        try:
            mapped = json.loads(res.stdout or "[]")
        except json.JSONDecodeError:
            raise NvmetError(f"rbd showmapped: not JSON: {res.stdout[:200]!r}", "check the rbd tool (rbd --version)")
        return list(mapped.values()) if isinstance(mapped, dict) else list(mapped)  # older rbd: {id: entry}

    def mapped_device(self, settings: RbdSettings, mapped: Optional[List[dict]] = None) -> Optional[str]:
        """The /dev/rbdN the image is mapped at, or None."""
        for m in self.showmapped() if mapped is None else mapped:
            if (m.get("pool"), m.get("namespace") or "", m.get("name"), m.get("snap", "-")) == \
                    (settings.pool, settings.namespace, settings.image, "-"):
                return m.get("device")
        return None

    @staticmethod
    def _image_args(settings: RbdSettings) -> List[str]:
        """Which cluster, as which client, which pool and RADOS namespace (the image itself goes last)."""
        args = ["-c", settings.conf, "--id", settings.client_id, "--pool", settings.pool]
        if settings.namespace:
            args += ["--namespace", settings.namespace]
        if settings.keyring:
            args += ["--keyring", settings.keyring]
        return args

    def map(self, settings: RbdSettings) -> str:
        """Map the image (or find it mapped); its /dev/rbdN."""
        device = self.mapped_device(settings)
        if device:
            return device
        res = self._run(["map"] + self._image_args(settings) + self._options() + [settings.image], timeout=120)
        device = res.stdout.strip().splitlines()[-1].strip() if res.ok and res.stdout.strip() else ""
        if not res.ok or not _DEVICE.fullmatch(device):
            err = (res.stderr or res.stdout).strip()
            fix = "check the cluster (ceph -s), the image (rbd info) and that the rbd module loads (modprobe rbd)"
            if "feature" in err:
                fix = (f"the kernel's rbd lacks a feature of the image: rbd feature disable {settings.spec()} "
                       "object-map fast-diff deep-flatten (or create it with --image-feature layering,exclusive-lock)")
            raise NvmetError(f"rbd map {settings.spec()}: {err or 'no device printed'}", fix)
        return device

    def unmap(self, device: str) -> None:
        res = self._run(["unmap", *self._options(), device])
        if not res.ok:
            raise NvmetError(f"rbd unmap {device}: {(res.stderr or res.stdout).strip()}",
                             "something still holds the device open (lsof, or an nvmet namespace): close it, "
                             "then rbd unmap")

    def info(self, settings: RbdSettings) -> Optional[dict]:
        """`rbd info` of the image (its size, features, id ...), or None when the image does not exist."""
        res = self._run(["info", "--format", "json"] + self._image_args(settings) + [settings.image])
        if not res.ok:
            err = (res.stderr or res.stdout).strip()
            if "(2) No such file" in err:
                return None
            raise NvmetError(f"rbd info {settings.spec()}: {err[-400:]}",
                             "check the cluster (ceph -s), the pool (ceph osd pool ls) and the client's caps")
        try:
            return json.loads(res.stdout)
        except json.JSONDecodeError:
            raise NvmetError(f"rbd info {settings.spec()}: not JSON: {res.stdout[:200]!r}",
                             "check the rbd tool (rbd --version)")

    def exists(self, settings: RbdSettings) -> bool:
        return self.info(settings) is not None

    def create(self, settings: RbdSettings, size_bytes: int, features: Sequence[str] = ("layering",)) -> None:
        """Create the image, `size_bytes` rounded up to MiB, with only `features` (layering alone: krbd maps it
        and no exclusive lock passes between clients that take turns)."""
        size_mb = max(1, -(-int(size_bytes) // (1 << 20)))
        res = self._run(["create", "--size", f"{size_mb}M", "--image-feature", ",".join(features)]
                        + self._image_args(settings) + [settings.image], timeout=120)
        if not res.ok:
            raise NvmetError(f"rbd create {settings.spec()}: {(res.stderr or res.stdout).strip()[-400:]}",
                             "check the pool exists (ceph osd pool ls) and has room (ceph df)")

    def remove(self, settings: RbdSettings) -> None:
        res = self._run(["rm", "--no-progress"] + self._image_args(settings) + [settings.image], timeout=300)
        if not res.ok:
            raise NvmetError(f"rbd rm {settings.spec()}: {(res.stderr or res.stdout).strip()[-400:]}",
                             f"a client still has it open (rbd status {settings.spec()}): close it, then rbd rm")

    def device_path(self, settings: RbdSettings, device: str) -> str:
        """The path nvmet is given: the udev link /dev/rbd/POOL[/NS]/IMAGE when it leads to `device`."""
        link = stable_path(settings)
        if self.path_exists(link) and self.realpath(link) == self.realpath(device):
            return link
        return device

    def is_mapped_device(self, path: str, mapped: List[dict]) -> Optional[str]:
        """The /dev/rbdN `path` is (itself or the udev link to it) when krbd has it mapped, else None."""
        if not path:
            return None
        real = self.realpath(path)
        for m in mapped:
            if m.get("device") and self.realpath(m["device"]) == real:
                return m["device"]
        return None


def stable_path(settings: RbdSettings) -> str:
    return "/dev/rbd/" + "/".join(p for p in (settings.pool, settings.namespace, settings.image) if p)


def rbd_namespaces(cfg) -> Dict[tuple, RbdSettings]:
    """{(nqn, nsid): settings} of the config's enabled rbd namespaces."""
    out = {}
    for s in cfg.subsystems:
        for ns in s.namespaces:
            if ns.backend == "rbd" and ns.enabled:
                out[(s.nqn, ns.nsid)] = ns.backend_settings
    return out
