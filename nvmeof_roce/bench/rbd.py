"""The bench's RBD job set (`bench --rbd`): one RBD image served three ways, each measured with the same fio jobs.

- `userspace-rbd` (RbdUserspaceTarget): our target serving the image as an rbd namespace (librbd in the
  target's process; `--data-path native|python` picks the I/O queues' data path, and the run records which of
  them served the rbd namespace: `served_by`);
- `kernel-krbd` (KrbdNvmetTarget): the kernel's nvmet serving the image mapped with krbd (`rbd map`, /dev/rbdN);
- `fio-rbd` (FioRbdTarget): no target at all, fio's own `rbd` engine on the image (librbd in fio): the floor of
  what librbd gives here.

The image (`BenchImage`) is shared: created when it does not exist (`--ns-size`, only the `layering` feature, so
no exclusive lock passes between the three clients as they take turns) and removed at the end if the bench created
it; its first `--size` bytes are written once before the first job (so reads find objects on the OSD, not holes).
Every librbd client of the bench runs with its cache off (`rbd_cache = false`), as our target's does (docs/rbd.md),
so neither fio's engine nor ours answers from client memory; krbd has no client cache (O_DIRECT on /dev/rbdN).

The `rbd` tool is called through `RbdCli` (map, unmap, create, rm, info): kernel/rbd_map.py, the project's
wrapper of `rbd map` for `nvmet apply`, was not on main when this was written; this one is the bench's own, small,
with `--options noudev` where no udevd runs (the lab's guest), as that one does.
"""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from ..errors import NvmeofError
from . import kernel_glue
from .fio import FioJobFile
from .targets import DEFAULT_PORTS, ROCE, Fabric, KernelNvmetTarget, TargetUnderTest, UserspaceTarget

log = logging.getLogger(__name__)

USERSPACE, KERNEL, FIO = "userspace-rbd", "kernel-krbd", "fio-rbd"
TARGET_NAMES = (USERSPACE, KERNEL, FIO)
RATIOS = ((USERSPACE, KERNEL), (USERSPACE, FIO))  # the first is the report's headline ratio
JOBS_DIR = "rbd"  # fio-jobs/rbd/: the job set, not in the default selection
JOBS = ("rbd-randread-4k-qd32", "rbd-randwrite-4k-qd32", "rbd-randread-4k-qd1", "rbd-randwrite-4k-qd1")
DEFAULT_IMAGE = "rbd/nvmeof-bench"
DEFAULT_PORT = {USERSPACE: 4460, KERNEL: 4461}
UDEV_CONTROL = "/run/udev/control"
CEPH_DAEMONS = ("ceph-osd", "ceph-mon")  # sampled for their CPU beside every target (they serve all three)
_DEVICE = re.compile(r"/dev/rbd\d+")


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

    def namespace_config(self) -> dict:
        """The rbd namespace of our target's config (docs/rbd.md)."""
        return {"nsid": 1, "enable": 1,
                "nvmeof_roce": {"backend": "rbd", "rbd": {"pool": self.pool, "image": self.image, "conf": self.conf,
                                                          "id": self.client_id}}}


Runner = Callable[..., subprocess.CompletedProcess]  # (argv, timeout, env=None)


def _run(args: List[str], timeout: float, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    except FileNotFoundError:
        raise NvmeofError(f"{args[0]} is not installed", "apt-get install ceph-common fio")
    except subprocess.TimeoutExpired:
        raise NvmeofError(f"{' '.join(args[:3])} did not answer within {timeout:.0f} s", "check the cluster: ceph -s")


class RbdCli:
    """The `rbd` tool for one image (`runner(argv, timeout)`: subprocess.run; the tests pass a fake)."""

    def __init__(self, spec: RbdImageSpec, runner: Runner = _run, udev: Optional[bool] = None):
        self.spec = spec
        self.runner = runner
        # without udevd (the lab's guest: devtmpfs only) `rbd map` would wait for an event no one sends
        self.udev = os.path.exists(UDEV_CONTROL) if udev is None else udev

    def _rbd(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return self.runner(["rbd", "-c", self.spec.conf, "--id", self.spec.client_id, *args], timeout)

    def _check(self, res: subprocess.CompletedProcess, what: str, fix: str) -> str:
        if res.returncode != 0:
            raise NvmeofError(f"rbd {what} {self.spec.spec}: {(res.stderr or res.stdout).strip()[-400:]}", fix)
        return res.stdout

    def exists(self) -> bool:
        res = self._rbd("info", "--format", "json", self.spec.spec)
        if res.returncode == 0:
            return True
        if "No such file" in res.stderr or "(2)" in res.stderr:
            return False
        self._check(res, "info", "check the cluster (ceph -s) and --rbd-conf")
        return False

    def create(self, size_mb: int) -> None:
        self._check(self._rbd("create", "--size", f"{size_mb}M", "--image-feature", "layering", self.spec.spec),
                    "create", "check the pool exists (ceph osd pool ls) and has room")

    def remove(self) -> None:
        self._check(self._rbd("rm", "--no-progress", self.spec.spec), "rm", "rbd status: who still has it open")

    def _options(self) -> List[str]:
        return [] if self.udev else ["--options", "noudev"]

    def showmapped(self) -> List[dict]:
        out = self._check(self._rbd("showmapped", "--format", "json"), "showmapped", "modprobe rbd")
        mapped = json.loads(out or "[]")
        return list(mapped.values()) if isinstance(mapped, dict) else list(mapped)  # older rbd: {id: entry}

    def mapped_device(self) -> Optional[str]:
        for m in self.showmapped():
            if (m.get("pool"), m.get("name"), m.get("snap", "-"), m.get("namespace") or "") == \
                    (self.spec.pool, self.spec.image, "-", ""):
                return m.get("device")
        return None

    def map(self) -> str:
        """krbd maps the image: its /dev/rbdN."""
        res = self._rbd("map", *self._options(), self.spec.spec)
        out = self._check(res, "map", "the kernel's rbd module (modprobe rbd), and an image whose features krbd "
                                      "has (rbd info; rbd feature disable ... object-map fast-diff deep-flatten)")
        device = out.strip().splitlines()[-1].strip() if out.strip() else ""
        if not _DEVICE.fullmatch(device):
            raise NvmeofError(f"rbd map {self.spec.spec} printed no /dev/rbdN: {out.strip()[-200:]!r}",
                              "rbd showmapped")
        return device

    def unmap(self, device: str) -> None:
        self._check(self._rbd("unmap", *self._options(), device), "unmap",
                    "something holds the device open (nvmet's namespace, fio): close it, then rbd unmap")


def client_conf(conf: str, directory: Path) -> Path:
    """A ceph.conf for fio's librbd: the cluster's own, plus the client settings our target uses (cache off)."""
    try:
        text = Path(conf).read_text()
    except OSError as exc:
        raise NvmeofError(f"cannot read the cluster's ceph.conf {conf}: {exc.strerror}",
                          "--rbd-conf FILE, or set CEPH_CONF (lab run --ceph sets it)")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "ceph-fio-rbd.conf"
    path.write_text(text.rstrip("\n") + "\n\n# nvmeof-roce bench: fio's librbd as our target's (docs/rbd.md)\n"
                    "[client]\nrbd cache = false\n")
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
                 cli: Optional[RbdCli] = None, runner: Runner = _run, progress: Callable[[str], None] = log.info):
        self.spec = spec
        self.size_mb = int(size_mb)
        self.region = region
        self.work_dir = Path(work_dir)
        self.cli = cli or RbdCli(spec)
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
        if not self.cli.exists():
            self.progress(f"bench: creating the rbd image {self.spec.spec} ({self.size_mb} MiB, layering only)")
            self.cli.create(self.size_mb)
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
            self.cli.remove()


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

    def side_processes(self) -> Dict[str, int]:
        return ceph_pids(self.image.spec.conf)


class RbdUserspaceTarget(RbdTarget, UserspaceTarget):
    """Our target with one rbd namespace on the image; `data_path` as `target serve --data-path`."""

    name = USERSPACE

    def __init__(self, traddr: str, image: BenchImage, trsvcid: int = DEFAULT_PORT[USERSPACE],
                 data_path: Optional[str] = None, work_dir: Optional[Path] = None, cpus: Optional[str] = None,
                 fabric: Fabric = ROCE):
        super().__init__(traddr, trsvcid, name=USERSPACE, work_dir=work_dir, data_path=data_path, cpus=cpus,
                         fabric=fabric)
        self.image = image
        self.kind += f", rbd namespace {image.spec.spec} (librbd)"
        self._acquired = False

    def describe(self) -> dict:
        d = super().describe()
        d["backend"] = f"rbd {self.image.spec.spec} (librbd in the target, cache off)"
        d["data_path_requested"] = self.data_path or "default"
        return d

    def check(self) -> None:
        self.image.check()
        super().check()

    def served_by(self, status: dict) -> Optional[dict]:
        return served_by(status, self.subnqn)

    def setup(self) -> None:
        self.image.acquire()
        self._acquired = True
        try:
            self.work_dir.mkdir(parents=True, exist_ok=True)
            self.config_path = self.work_dir / f"{self.name}-target.json"
            cfg = {"hosts": [],
                   "ports": [{"portid": 1, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": self.traddr,
                                                    "trsvcid": str(self.trsvcid), "treq": "not specified"},
                              "subsystems": [self.subnqn], "referrals": []}],
                   "subsystems": [{"nqn": self.subnqn, "attr": {"allow_any_host": "1", "model": "nvmeof-roce"},
                                   "allowed_hosts": [], "namespaces": [self.image.spec.namespace_config()]}]}
            self.config_path.write_text(json.dumps(cfg, indent=2) + "\n")
            self.ready_timeout = max(self.ready_timeout, 180.0)  # the image opens before the target listens
            super().setup()
        except BaseException:
            self._acquired = False
            self.image.release()
            raise

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            if self._acquired:
                self._acquired = False
                self.image.release()


class KrbdNvmetTarget(RbdTarget, KernelNvmetTarget):
    """The kernel's nvmet serving the image mapped with krbd."""

    name = KERNEL

    def __init__(self, traddr: str, image: BenchImage, trsvcid: int = DEFAULT_PORT[KERNEL], fabric: Fabric = ROCE):
        super().__init__(traddr, trsvcid, name=KERNEL, fabric=fabric)
        self.image = image
        self.kind = f"kernel nvmet-{fabric.trtype} (configfs) on krbd"
        self.mapped: Optional[str] = None
        self._acquired = False

    def describe(self) -> dict:
        d = super().describe()
        d["backend"] = f"rbd {self.image.spec.spec} mapped with krbd ({self.mapped or '/dev/rbdN'})"
        return d

    def check(self) -> None:
        self.image.check()
        kernel_glue.modprobe("rbd")
        super().check()

    def setup(self) -> None:
        self.image.acquire()
        self._acquired = True
        self.mapped = self.image.cli.mapped_device() or self.image.cli.map()
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
                    self.image.cli.unmap(mapped)
            finally:
                if self._acquired:
                    self._acquired = False
                    self.image.release()


class FioRbdTarget(RbdTarget, TargetUnderTest):
    """No target: fio's own rbd engine on the image (librbd inside fio)."""

    name = FIO
    kind = "fio --ioengine=rbd (librbd in fio, no target, no fabric)"

    def __init__(self, image: BenchImage):
        super().__init__("-", 0, name=FIO)
        self.image = image
        self._acquired = False

    def describe(self) -> dict:
        return {"kind": self.kind, "fabric": "none", "traddr": "", "trsvcid": "", "subnqn": "",
                "backend": f"rbd {self.image.spec.spec} (librbd in fio, cache off)"}

    def check(self) -> None:
        self.image.check()

    def setup(self) -> None:
        self.image.acquire()
        self._acquired = True

    def teardown(self) -> None:
        if self._acquired:
            self._acquired = False
            self.image.release()

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
    `native_in_flight` in its `io` (its handle is in the queues' view); `most_in_flight` is the reference path's
    (the engine's librbd aio calls) high-water mark since the target started, `native_most_in_flight` the C
    path's."""
    for sub in status.get("subsystems", []):
        if sub.get("nqn") != nqn:
            continue
        for ns in sub.get("namespaces", []):
            if ns.get("nsid") != nsid:
                continue
            io = ns.get("io") or {}
            native = int(io.get("native_most_in_flight") or 0)
            python = int(io.get("most_in_flight") or 0)
            if "native_in_flight" in io and native:
                rbd = "native" if not python else "native (the core's engine served some: most_in_flight " \
                                                  f"{python})"
            else:
                rbd = "python"
            return {"queues": status.get("data_path"), "rbd": rbd, "engine": io.get("engine"),
                    "most_in_flight": python, "native_most_in_flight": native if "native_in_flight" in io else None}
    return None


__all__ = ["USERSPACE", "KERNEL", "FIO", "TARGET_NAMES", "RATIOS", "JOBS", "RbdImageSpec", "RbdCli", "BenchImage",
           "RbdUserspaceTarget", "KrbdNvmetTarget", "FioRbdTarget", "rbd_engine_job_text", "served_by",
           "client_conf", "ceph_pids"]
