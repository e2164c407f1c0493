"""The bench's RBD job set (`bench --rbd`): one RBD image served three ways, each measured with the same fio jobs.

- `userspace-rbd` (RbdUserspaceTarget): our target serving the image as an rbd namespace (librbd in the
  target's process).  `rbd_path` picks how: `native` (the default: the namespace's `"native": true`, its
  commands served in C by the native queues through librbd's C API, csrc/be_rbd.c) or `python` (the reference
  path: the core's engine through python3-rbd); `--data-path` the I/O queues' data path.  The run records which
  path served the rbd namespace (`served_by`);
- `kernel-krbd` (KrbdNvmetTarget): the kernel's nvmet serving the image mapped with krbd (`rbd map`, /dev/rbdN);
- `fio-rbd` (FioRbdTarget): no target at all, fio's own `rbd` engine on the image (librbd in fio): the floor of
  what librbd gives here.

The image (`BenchImage`) is shared: created when it does not exist (`--ns-size`, only the `layering` feature, so
no exclusive lock passes between the three clients as they take turns) and removed at the end if the bench created
it; its first `--size` bytes are written once before the first job (so reads find objects on the OSD, not holes).
Every librbd client of the bench runs with its cache off (`rbd_cache = false`), as our target's does (docs/rbd.md),
so neither fio's engine nor ours answers from client memory; krbd has no client cache (O_DIRECT on /dev/rbdN).

The `rbd` tool is called through kernel/rbd_map.py's `RbdTool` (info, create, rm, map, unmap), the project's one
wrapper of it.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

from ..config.rbd import NATIVE_RBD_OPTIONS, RbdSettings
from ..errors import NvmeofError
from ..kernel.rbd_map import RbdTool
from . import kernel_glue
from .fio import FioJobFile
from .targets import ROCE, Fabric, KernelNvmetTarget, TargetUnderTest, UserspaceTarget

log = logging.getLogger(__name__)

USERSPACE, KERNEL, FIO = "userspace-rbd", "kernel-krbd", "fio-rbd"
TARGET_NAMES = (USERSPACE, KERNEL, FIO)
RATIOS = ((USERSPACE, KERNEL), (USERSPACE, FIO))  # the first is the report's headline ratio
JOBS_DIR = "rbd"  # fio-jobs/rbd/: the job set, not in the default selection
JOBS = ("rbd-randread-4k-qd32", "rbd-randwrite-4k-qd32", "rbd-randread-4k-qd1", "rbd-randwrite-4k-qd1")
DEFAULT_IMAGE = "rbd/nvmeof-bench"
DEFAULT_PORT = {USERSPACE: 4460, KERNEL: 4461}
RBD_PATHS = ("native", "python")  # how our target serves the namespace: librbd in C, or the core's python3-rbd
DEFAULT_RBD_PATH = "native"
CEPH_DAEMONS = ("ceph-osd", "ceph-mon")  # sampled for their CPU beside every target (they serve all three)


def default_conf() -> str:
    return os.environ.get("CEPH_CONF") or "/etc/ceph/ceph.conf"


@dataclass(frozen=True)
class RbdImageSpec:
    """Which image, on which cluster, as which client (rbd's own names)."""

    pool: str
    image: str
    conf: str
    client_id: str = "admin"

    @classmethod
    def parse(cls, text: str, conf: Optional[str] = None, client_id: str = "admin") -> "RbdImageSpec":
        pool, sep, image = (text or "").strip().partition("/")
        if not sep or not pool or not image or "/" in image or "@" in image:
            raise NvmeofError(f"--rbd-image {text!r} is not POOL/IMAGE", f"e.g. --rbd-image {DEFAULT_IMAGE}")
        return cls(pool, image, conf or default_conf(), client_id)

    @property
    def spec(self) -> str:
        return f"{self.pool}/{self.image}"

    @property
    def settings(self) -> RbdSettings:
        """The image as kernel/rbd_map.py's RbdTool and our target's config name it."""
        return RbdSettings(pool=self.pool, image=self.image, conf=self.conf, client_id=self.client_id)

    def namespace_config(self, rbd_path: str = DEFAULT_RBD_PATH) -> dict:
        """The rbd namespace of our target's config (docs/rbd.md): `"native": true` on the native RBD path."""
        rbd = {"pool": self.pool, "image": self.image, "conf": self.conf, "id": self.client_id}
        if rbd_path == "native":
            rbd["native"] = True
        return {"nsid": 1, "enable": 1, "nvmeof_roce": {"backend": "rbd", "rbd": rbd}}


Runner = Callable[..., subprocess.CompletedProcess]  # (argv, timeout, env=None): fio's prefill


def _run(args: List[str], timeout: float, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    except FileNotFoundError:
        raise NvmeofError(f"{args[0]} is not installed", "apt-get install fio")
    except subprocess.TimeoutExpired:
        raise NvmeofError(f"{' '.join(args[:3])} did not answer within {timeout:.0f} s", "check the cluster: ceph -s")


def client_conf(conf: str, directory: Path) -> Path:
    """A ceph.conf for fio's librbd: the cluster's own, plus the client settings our target uses (cache off, and
    the native path's own: librbd's dispatch in the caller's thread, librados' throttle off)."""
    try:
        text = Path(conf).read_text()
    except OSError as exc:
        raise NvmeofError(f"cannot read the cluster's ceph.conf {conf}: {exc.strerror}",
                          "--rbd-conf FILE, or set CEPH_CONF (lab run --ceph sets it)")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "ceph-fio-rbd.conf"
    path.write_text(text.rstrip("\n") + "\n\n# nvmeof-roce bench: fio's librbd as our target's (docs/rbd.md)\n"
                    "[client]\nrbd cache = false\n"
                    + "".join(f"{key.replace('_', ' ')} = {value}\n" for key, value in NATIVE_RBD_OPTIONS))
    return path


def rbd_engine_job_text(text: str, spec: RbdImageSpec) -> str:
    """A job file of fio-jobs/ turned to fio's `rbd` engine on `spec`: ioengine=rbd, no filename or direct, and
    the engine's clientname, pool and rbdname in [global].  Everything else (rw, bs, iodepth, size, runtime,
    ramp, percentiles) is the job file's own, so the job is the same one the targets get."""
    out: List[str] = []
    in_global = False
    added = False
    for line in text.splitlines():
        stripped = line.strip()
        key = stripped.split("=", 1)[0].strip().lower() if "=" in stripped else ""
        if stripped.startswith("["):
            in_global = stripped.lower() == "[global]"
            out.append(line)
            if in_global:
                out += [f"clientname={spec.client_id}", f"pool={spec.pool}", f"rbdname={spec.image}"]
                added = True
            continue
        if key in ("filename", "direct", "clientname", "pool", "rbdname"):
            continue
        if key == "ioengine":
            out.append("ioengine=rbd")
            continue
        out.append(line)
    if not added:
        raise NvmeofError("the job file has no [global] section to give fio's rbd engine its image",
                          "add [global] to the job file")
    return "\n".join(out) + "\n"


def rbd_engine_job(job: FioJobFile, spec: RbdImageSpec, directory: Path) -> FioJobFile:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / job.path.name
    path.write_text(rbd_engine_job_text(job.path.read_text(), spec))
    return FioJobFile.load(path)


def prefill_command(spec: RbdImageSpec, size: str) -> List[str]:
    return ["fio", "--output-format=json", "--name=prefill", "--ioengine=rbd", f"--clientname={spec.client_id}",
            f"--pool={spec.pool}", f"--rbdname={spec.image}", "--rw=write", "--bs=128k", "--iodepth=16",
            f"--size={size}"]


class BenchImage:
    """The image every rbd target serves: made ready by the first target's setup (created if missing, its region
    written once), removed by the last one's teardown when the bench created it."""

    def __init__(self, spec: RbdImageSpec, size_mb: int, region: str, work_dir: Path,
                 tool: Optional[RbdTool] = None, runner: Runner = _run, progress: Callable[[str], None] = log.info):
        self.spec = spec
        self.size_mb = int(size_mb)
        self.region = region
        self.work_dir = Path(work_dir)
        self.tool = tool or RbdTool()
        self.runner = runner
        self.progress = progress
        self.users = 0
        self.created = False
        self._fio_conf: Optional[Path] = None

    @property
    def fio_conf(self) -> Path:
        if self._fio_conf is None:
            self._fio_conf = client_conf(self.spec.conf, self.work_dir / "fio-rbd")
        return self._fio_conf

    def check(self) -> None:
        if not os.path.isfile(self.spec.conf):
            raise NvmeofError(f"no ceph.conf at {self.spec.conf}",
                              "--rbd-conf FILE, or CEPH_CONF (in the lab: lab run --ceph)")

    def acquire(self) -> None:
        self.users += 1
        if self.users > 1:
            return
        if not self.tool.exists(self.spec.settings):
            self.progress(f"bench: creating the rbd image {self.spec.spec} ({self.size_mb} MiB, layering only)")
            self.tool.create(self.spec.settings, self.size_mb << 20, features=("layering",))
            self.created = True
        self.progress(f"bench: writing the first {self.region} of {self.spec.spec} once (fio's rbd engine)")
        res = self.runner(prefill_command(self.spec, self.region), 1800, env=dict(os.environ,
                                                                                 CEPH_CONF=str(self.fio_conf)))
        if res.returncode != 0:
            raise NvmeofError(f"writing {self.region} of {self.spec.spec} failed: {res.stderr.strip()[-400:]}",
                              "fio --ioengine=rbd needs fio built with rbd (Debian's is)")

    def release(self) -> None:
        self.users = max(0, self.users - 1)
        if self.users == 0 and self.created:
            self.created = False
            self.tool.remove(self.spec.settings)


def ceph_pids(conf: Optional[str] = None, proc: str = "/proc") -> Dict[str, int]:
    """{daemon: pid} of the cluster's daemons running here (the lab's dev cluster: one of each).  With `conf`,
    those started with that ceph.conf (`-c CONF`) when any is, so another cluster on the machine is not counted."""
    every: Dict[str, int] = {}
    named: Dict[str, int] = {}
    for entry in sorted(Path(proc).iterdir(), key=lambda e: (len(e.name), e.name)):
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
            if comm not in CEPH_DAEMONS:
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        every.setdefault(comm, int(entry.name))
        if conf is not None and os.fsencode(conf) in argv:
            named.setdefault(comm, int(entry.name))
    return named or every


class RbdTarget:
    """What the three rbd targets share: the image, and the Ceph daemons sampled beside them."""

    image: BenchImage
    _acquired = False  # this target holds the image (BenchImage.acquire) and gives it back once

    def side_processes(self) -> Dict[str, int]:
        return ceph_pids(self.image.spec.conf)

    def _acquire_image(self) -> None:
        self.image.acquire()
        self._acquired = True

    def _release_image(self) -> None:
        if self._acquired:
            self._acquired = False
            self.image.release()


class RbdUserspaceTarget(RbdTarget, UserspaceTarget):
    """Our target with one rbd namespace on the image; `rbd_path` native (the namespace's `"native": true`: the
    native queues serve it in C) or python (the core's engine, python3-rbd); `data_path` as `target serve
    --data-path` (the native RBD path needs the native queues: native when not given)."""

    name = USERSPACE

    def __init__(self, traddr: str, image: BenchImage, trsvcid: int = DEFAULT_PORT[USERSPACE],
                 data_path: Optional[str] = None, work_dir: Optional[Path] = None, cpus: Optional[str] = None,
                 fabric: Fabric = ROCE, rbd_path: str = DEFAULT_RBD_PATH):
        if rbd_path not in RBD_PATHS:
            raise NvmeofError(f"--rbd-path {rbd_path!r} is not one of {', '.join(RBD_PATHS)}", "--rbd-path native")
        if rbd_path == "native":
            if data_path == "python":
                raise NvmeofError("--rbd-path native needs the native I/O queues, not --data-path python",
                                  "--rbd-path python for the reference path, or leave --data-path out")
            data_path = "native"
        super().__init__(traddr, trsvcid, name=USERSPACE, work_dir=work_dir, data_path=data_path, cpus=cpus,
                         fabric=fabric)
        self.image = image
        self.rbd_path = rbd_path
        self.kind += f", rbd namespace {image.spec.spec} (librbd, the {rbd_path} RBD path)"

    def describe(self) -> dict:
        d = super().describe()
        how = "librbd's C API from the native queues" if self.rbd_path == "native" else "python3-rbd in the core"
        d["backend"] = f"rbd {self.image.spec.spec} ({how}, cache off)"
        d["data_path_requested"] = self.data_path or "default"
        d["rbd_path_requested"] = self.rbd_path
        return d

    def check(self) -> None:
        self.image.check()
        super().check()

    def served_by(self, status: dict) -> Optional[dict]:
        return served_by(status, self.subnqn)

    def setup(self) -> None:
        self._acquire_image()
        try:
            self.work_dir.mkdir(parents=True, exist_ok=True)
            self.config_path = self.work_dir / f"{self.name}-target.json"
            cfg = {"hosts": [],
                   "ports": [{"portid": 1, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": self.traddr,
                                                    "trsvcid": str(self.trsvcid), "treq": "not specified"},
                              "subsystems": [self.subnqn], "referrals": []}],
                   "subsystems": [{"nqn": self.subnqn, "attr": {"allow_any_host": "1", "model": "nvmeof-roce"},
                                   "allowed_hosts": [],
                                   "namespaces": [self.image.spec.namespace_config(self.rbd_path)]}]}
            self.config_path.write_text(json.dumps(cfg, indent=2) + "\n")
            self.ready_timeout = max(self.ready_timeout, 180.0)  # the image opens before the target listens
            super().setup()
        except BaseException:
            self._release_image()
            raise

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            self._release_image()


class KrbdNvmetTarget(RbdTarget, KernelNvmetTarget):
    """The kernel's nvmet serving the image mapped with krbd."""

    name = KERNEL

    def __init__(self, traddr: str, image: BenchImage, trsvcid: int = DEFAULT_PORT[KERNEL], fabric: Fabric = ROCE):
        super().__init__(traddr, trsvcid, name=KERNEL, fabric=fabric)
        self.image = image
        self.kind = f"kernel nvmet-{fabric.trtype} (configfs) on krbd"
        self.mapped: Optional[str] = None

    def describe(self) -> dict:
        d = super().describe()
        d["backend"] = f"rbd {self.image.spec.spec} mapped with krbd ({self.mapped or '/dev/rbdN'})"
        return d

    def check(self) -> None:
        self.image.check()
        kernel_glue.modprobe("rbd")
        super().check()

    def setup(self) -> None:
        self._acquire_image()
        self.mapped = self.image.tool.map(self.image.spec.settings)  # or the device it is mapped at already
        self._export = kernel_glue.NvmetExport(nqn=self.subnqn, device_path=self.mapped, traddr=self.traddr,
                                               trsvcid=self.trsvcid, trtype=self.fabric.trtype)
        self._export.create()

    def teardown(self) -> None:
        try:
            super().teardown()  # the export (no device object of the parent's)
        finally:
            mapped, self.mapped = self.mapped, None
            try:
                if mapped:
                    self.image.tool.unmap(mapped)
            finally:
                self._release_image()


class FioRbdTarget(RbdTarget, TargetUnderTest):
    """No target: fio's own rbd engine on the image (librbd inside fio)."""

    name = FIO
    kind = "fio --ioengine=rbd (librbd in fio, no target, no fabric)"

    def __init__(self, image: BenchImage):
        super().__init__("-", 0, name=FIO)
        self.image = image

    def describe(self) -> dict:
        return {"kind": self.kind, "fabric": "none", "traddr": "", "trsvcid": "", "subnqn": "",
                "backend": f"rbd {self.image.spec.spec} (librbd in fio, cache off)"}

    def check(self) -> None:
        self.image.check()

    def setup(self) -> None:
        self._acquire_image()

    def teardown(self) -> None:
        self._release_image()

    def direct_job(self, job: FioJobFile, directory: Path) -> FioJobFile:
        return rbd_engine_job(job, self.image.spec, directory)

    def fio_env(self) -> Dict[str, str]:
        return {"CEPH_CONF": str(self.image.fio_conf)}

    @property
    def device_label(self) -> str:
        return f"rbd:{self.image.spec.spec}"


def served_by(status: dict, nqn: str, nsid: int = 1) -> Optional[dict]:
    """Which data path served the rbd namespace `nsid` of `nqn`, from `target status --json`: the I/O queues'
    data path, and the namespace's engine figures. A namespace the native queues serve in C has
    `native_in_flight` in its `io` (its handle is in the queues' view) and `native_most_in_flight`, the C path's
    high-water mark since the target started, above 0 once librbd's C API had a command; `most_in_flight` is the
    reference path's (the core's librbd aio calls).  On the native RBD path the core serves the first commands
    while the handle opens in C (the host's connect and partition scan): its `most_in_flight` is then small and
    stays (a high-water mark), so it is recorded, not taken as the path that served the job."""
    for sub in status.get("subsystems", []):
        if sub.get("nqn") != nqn:
            continue
        for ns in sub.get("namespaces", []):
            if ns.get("nsid") != nsid:
                continue
            io = ns.get("io") or {}
            native = int(io.get("native_most_in_flight") or 0)
            python = int(io.get("most_in_flight") or 0)
            rbd = "native" if "native_in_flight" in io and native else "python"
            return {"queues": status.get("data_path"), "rbd": rbd, "engine": io.get("engine"),
                    "most_in_flight": python, "native_most_in_flight": native if "native_in_flight" in io else None}
    return None


__all__ = ["USERSPACE", "KERNEL", "FIO", "TARGET_NAMES", "RATIOS", "JOBS", "RBD_PATHS", "RbdImageSpec", "BenchImage",
           "RbdUserspaceTarget", "KrbdNvmetTarget", "FioRbdTarget", "rbd_engine_job_text", "served_by",
           "client_conf", "ceph_pids"]
