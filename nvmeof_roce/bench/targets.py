"""The targets under test and the host that reaches them.

A `TargetUnderTest` exports one namespace at `address` (traddr, trsvcid, subnqn): `check()` refuses clearly
when it cannot run here, `setup()` brings it up, `teardown()` takes it down again (idempotent, safe after a
half-done setup). The two real ones:

- `KernelNvmetTarget`: the kernel's nvmet-rdma over configfs, namespace on a memory-backed null_blk device
  (or a file on tmpfs served with buffered_io), default port 4420;
- `UserspaceTarget`: our target, `nvmeof-roce target serve CONFIG.json` as a child process, with a RAM
  namespace, default port 4421; as `baseline` (default port 4422) the same from another checkout
  (`--baseline-checkout DIR`, e.g. a git worktree of the commit before a change), so a before and an after
  run in one boot, interleaved; as `userspace-py` (default port 4423) the same served with `--data-path python`,
  the reference path beside the default native one;
- `UserspaceTarget(workers=N)`: the same with `target serve --workers N` (the `userspace-Nw` targets, default
  port 4424): N worker processes, worker i listening on trsvcid + i, one subsystem; the host connects every
  port and native NVMe multipath (iopolicy round-robin) spreads the I/O over the workers (docs/multipath.md);
- `UserspaceTarget(data_path="native", serve_args=...)`: the same with `--data-path native` and its poll
  options (the `native`, `native-busy`, `native-busy-Nc` targets, default ports 4490 onwards; docs/native.md).

Both use their own NQN and port, so they can be up at the same time on one address.

A `Host` turns a target into a block device for fio: `KernelHost` connects the kernel's nvme-rdma with
nvme-cli and finds the namespace's /dev/nvmeXnY.
"""
from __future__ import annotations

import abc
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from ..errors import NvmeofError
from ..transport import registry
from . import kernel_glue
from .perftest import iwarp_device_for, rdma_device_for

log = logging.getLogger(__name__)

NQN_PREFIX = "nqn.2014-08.org.nvmeof-roce:bench-"


@dataclass(frozen=True)
class Fabric:
    """`bench --targets NAME@FABRIC`: the fabric a target is measured over.  RoCE v2 is the default (the lab's
    rxe); iWARP needs an iWARP device holding --iwarp-traddr (the lab's siw: docs/lab.md); NVMe/TCP needs no RDMA
    device at all and is served by the kernel target only."""

    name: str
    trtype: str
    label: str
    port_offset: int  # added to the target's default port, so one target on every fabric can be up at once


FABRICS = {"roce": Fabric("roce", "rdma", "RoCE v2", 0), "iwarp": Fabric("iwarp", "rdma", "iWARP", 10),
           "tcp": Fabric("tcp", "tcp", "NVMe/TCP", 20)}
ROCE = FABRICS["roce"]
DEFAULT_PORTS = {"kernel": 4420, "userspace": 4421, "baseline": 4422, "userspace-py": 4423, "workers": 4424,
                 "native": 4490}


# --- device models: what the namespace of each target sits on --------------------------------------------

_LATENCY = re.compile(r"^(\d+(?:\.\d+)?)(ns|us|µs|ms)$")
_UNIT_NS = {"ns": 1, "us": 1000, "µs": 1000, "ms": 1000_000}


@dataclass(frozen=True)
class DeviceModel:
    """`bench --device`: the storage under both targets' namespace, one device of the same settings each.

    - `ram` (the default): the kernel target on a memory-backed null_blk, ours on a RAM namespace: the targets
      alone, nothing waits for a device;
    - `null_blk:LATENCY` (e.g. 20us, 100us, 2ms): a memory-backed null_blk per target whose commands complete
      LATENCY after submission, many at once (an SSD, a disk); ours serves it as a block namespace;
    - `file`: a file per target on the machine's own disk, both served with O_DIRECT."""

    kind: str = "ram"
    completion_ns: int = 0

    @classmethod
    def parse(cls, text: str) -> "DeviceModel":
        text = (text or "ram").strip()
        if text in ("ram", "file"):
            return cls(text)
        kind, _, latency = text.partition(":")
        m = _LATENCY.match(latency.strip())
        if kind == "null_blk" and m:
            ns = int(float(m.group(1)) * _UNIT_NS[m.group(2)])
            if 0 < ns <= 10_000_000_000:
                return cls("null_blk", ns)
        raise NvmeofError(f"--device {text!r} is not a device model",
                          "ram, file, or null_blk:LATENCY with LATENCY like 20us, 100us or 2ms")

    @property
    def label(self) -> str:
        if self.kind != "null_blk":
            return self.kind
        ns = self.completion_ns
        return f"null_blk:{ns // 1000_000}ms" if ns % 1000_000 == 0 else f"null_blk:{ns / 1000:g}us"

    def describe(self, size_mb: int) -> str:
        if self.kind == "null_blk":
            return (f"null_blk, memory-backed, {size_mb} MiB, completions after {self.completion_ns / 1000:g} µs "
                    f"(irqmode=2), hw_queue_depth 256")
        return f"file on the disk (/var/tmp), O_DIRECT, {size_mb} MiB"

    def make(self, name: str, size_mb: int):
        """The device object (create() -> path, remove()) of one target."""
        if self.kind == "null_blk":
            return kernel_glue.NullBlk(name=name, size_mb=size_mb, completion_ns=self.completion_ns)
        if self.kind == "file":
            return kernel_glue.DiskFile(name=name, size_mb=size_mb)
        raise ValueError(f"no device for model {self.kind}")


RAM = DeviceModel()


class TargetUnderTest(abc.ABC):
    """One NVMe-oF target the bench measures."""

    name = "target"
    kind = ""

    def __init__(self, traddr: str, trsvcid: int, subnqn: Optional[str] = None, name: Optional[str] = None,
                 fabric: Fabric = ROCE):
        if name:
            self.name = name
        self.traddr = traddr
        self.trsvcid = int(trsvcid)
        self.fabric = fabric
        self.subnqn = subnqn or NQN_PREFIX + self.name.replace("@", "-")

    @property
    def address(self) -> Dict[str, str]:
        return {"trtype": self.fabric.trtype, "adrfam": "ipv4", "traddr": self.traddr,
                "trsvcid": str(self.trsvcid), "subnqn": self.subnqn}

    def check(self) -> None:
        """Raise NvmeofError (with the fix) when this target cannot run here."""

    @abc.abstractmethod
    def setup(self) -> None:
        ...

    @abc.abstractmethod
    def teardown(self) -> None:
        ...

    def describe(self) -> dict:
        d = {"kind": self.kind, "fabric": self.fabric.label}
        d.update(self.address)
        return d

    @property
    def pid(self) -> Optional[int]:
        """The process serving this target, whose CPU time and RSS the bench samples; None when the target
        has no process of its own (the kernel target runs in softirq and kworkers)."""
        return None

    @property
    def rpc_socket(self) -> Optional[str]:
        """The control socket the soak's live changes are made on (bench/soak.py); None: none to use."""
        return None

    @property
    def trsvcids(self) -> List[int]:
        """Every port the host connects for this target (one per worker of a multi-worker target)."""
        return [self.trsvcid]

    def processes(self) -> Dict[str, int]:
        """{name: pid} of every process serving this target, each sampled for its CPU time (procstat)."""
        return {"target": self.pid} if self.pid else {}

    def _check_device(self) -> None:
        """An RDMA device of the target's fabric holds its address (none needed for NVMe/TCP)."""
        if self.fabric.name == "iwarp":
            iwarp_device_for(self.traddr)
        elif registry.fabric(self.fabric.trtype).rdma_device:
            rdma_device_for(self.traddr)

    def _check_address_free(self) -> None:
        who = kernel_glue.listener_on(self.traddr, self.trsvcid)
        if who:
            raise NvmeofError(f"{self.traddr}:{self.trsvcid} is already in use by {who}",
                              f"stop it, or give the {self.name} target another port "
                              f"(--{self.name}-port)")


class Host(abc.ABC):
    """Something that turns a target into a block device fio can use."""

    name = "host"

    def check(self) -> None:
        """Raise NvmeofError when the host side cannot run here (missing tool, module)."""

    @abc.abstractmethod
    def connect(self, target: TargetUnderTest) -> str:
        """Connect and return the device path."""

    @abc.abstractmethod
    def disconnect(self, target: TargetUnderTest) -> None:
        """Disconnect (idempotent)."""

    def connected(self, target: TargetUnderTest) -> bool:
        return False

    def path_ios(self, device: str) -> Dict[str, int]:
        """{trsvcid: I/Os completed} per path of a multipath device (empty when it has one path)."""
        return {}


# --- the kernel target --------------------------------------------------------------------------------

class KernelNvmetTarget(TargetUnderTest):
    name = "kernel"

    def __init__(self, traddr: str, trsvcid: int = DEFAULT_PORTS["kernel"], subnqn: Optional[str] = None,
                 backend: str = "null_blk", size_mb: int = 512, name: Optional[str] = None,
                 device: DeviceModel = RAM, fabric: Fabric = ROCE):
        super().__init__(traddr, trsvcid, subnqn, name, fabric)
        if backend not in ("null_blk", "file"):
            raise NvmeofError(f"kernel backend {backend!r} is not null_blk or file", "--kernel-backend null_blk|file")
        self.backend = backend
        self.device = device
        self.size_mb = int(size_mb)
        self.kind = f"kernel nvmet-{fabric.trtype} (configfs)"
        self._device = None
        self._export: Optional[kernel_glue.NvmetExport] = None

    def describe(self) -> dict:
        d = super().describe()
        if self.device.kind != "ram":
            d["backend"] = self.device.describe(self.size_mb)
            d["device"] = self.device.label
            return d
        d["backend"] = (f"null_blk, memory-backed, {self.size_mb} MiB" if self.backend == "null_blk"
                        else f"file on tmpfs, buffered_io, {self.size_mb} MiB")
        return d

    def check(self) -> None:
        kernel_glue.require_root("the kernel target")
        self._check_device()
        if not kernel_glue.CONFIGFS.is_dir() or not os.path.ismount(kernel_glue.CONFIGFS):
            raise NvmeofError("configfs is not mounted on /sys/kernel/config",
                              "mount -t configfs none /sys/kernel/config")
        kernel_glue.modprobe("nvmet", f"nvmet-{self.fabric.trtype}")
        if not (kernel_glue.CONFIGFS / "nvmet").is_dir():
            raise NvmeofError("nvmet is loaded but /sys/kernel/config/nvmet is missing", "check dmesg")
        self._check_address_free()

    def setup(self) -> None:
        name = self.subnqn.rsplit(":", 1)[-1]
        if self.device.kind != "ram":
            self._device = self.device.make(name, self.size_mb)
        elif self.backend == "null_blk":
            self._device = kernel_glue.NullBlk(name=name, size_mb=self.size_mb)
        else:
            self._device = kernel_glue.TmpfsFile(name=name, size_mb=self.size_mb)
        path = self._device.create()
        self._export = kernel_glue.NvmetExport(nqn=self.subnqn, device_path=path, traddr=self.traddr,
                                               trsvcid=self.trsvcid,
                                               buffered_io=self.device.kind == "ram" and self.backend == "file",
                                               trtype=self.fabric.trtype)
        self._export.create()

    def teardown(self) -> None:
        errors = []
        export = self._export or kernel_glue.NvmetExport(nqn=self.subnqn, device_path="", traddr=self.traddr,
                                                         trsvcid=self.trsvcid, trtype=self.fabric.trtype)
        for step in (export.remove, self._device.remove if self._device else None):
            if step is None:
                continue
            try:
                step()
            except (OSError, NvmeofError) as exc:
                errors.append(str(exc))
        self._export = None
        self._device = None
        if errors:
            raise NvmeofError("kernel target teardown: " + "; ".join(errors),
                              f"remove it by hand under /sys/kernel/config/nvmet ({self.subnqn})")


# --- our userspace target -----------------------------------------------------------------------------

def userspace_config(traddr: str, trsvcid: int, subnqn: str, size_mb: int, block_size: int = 512,
                     device_path: Optional[str] = None, direct: bool = False) -> dict:
    """The project's config schema (targets/ram.json's shape): one RAM namespace on one RDMA port, or with
    `device_path` a file or block device namespace (`direct`: a file with O_DIRECT, "buffered_io": 0)."""
    ns = {"nsid": 1, "enable": 1, "nvmeof_roce": {"backend": "ram", "size": f"{size_mb}M", "block_size": block_size}}
    if device_path:
        ns = {"nsid": 1, "enable": 1, "device": {"path": device_path}, "nvmeof_roce": {"backend": "file"}}
        if direct:
            ns["buffered_io"] = 0
    return {"hosts": [],
            "ports": [{"portid": 1, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": traddr,
                                             "trsvcid": str(trsvcid), "treq": "not specified"},
                       "subsystems": [subnqn], "referrals": []}],
            "subsystems": [{"nqn": subnqn, "attr": {"allow_any_host": "1", "model": "nvmeof-roce"},
                            "allowed_hosts": [],
                            "namespaces": [ns]}]}


def _cli() -> list:
    return [sys.executable, "-m", "nvmeof_roce"]


class UserspaceTarget(TargetUnderTest):
    name = "userspace"

    def __init__(self, traddr: str, trsvcid: int = DEFAULT_PORTS["userspace"], subnqn: Optional[str] = None,
                 size_mb: int = 512, work_dir: Optional[Path] = None, config_path: Optional[Path] = None,
                 ready_timeout: float = 60.0, name: Optional[str] = None, checkout: Optional[Path] = None,
                 workers: int = 1, cpus: Optional[str] = None, device: DeviceModel = RAM,
                 fabric: Fabric = ROCE, data_path: Optional[str] = None, serve_args: tuple = ()):
        if not registry.serves(fabric.trtype):
            served = " and ".join(t.upper() for t in registry.served_trtypes())
            raise NvmeofError(f"the userspace target serves {served} only, not {fabric.label}",
                              "measure NVMe/TCP with the kernel target: --targets kernel@tcp")
        self.config_path = Path(config_path) if config_path else None
        if self.config_path:
            traddr, trsvcid, subnqn = self._address_from_config(self.config_path)
        super().__init__(traddr, trsvcid, subnqn, name, fabric)
        # another checkout's target (the baseline): its package first on the child's path
        self.checkout = Path(checkout).resolve() if checkout else None
        self.size_mb = int(size_mb)
        self.work_dir = Path(work_dir) if work_dir else Path.cwd()
        self.ready_timeout = ready_timeout
        if not 1 <= int(workers) <= 64:
            raise NvmeofError(f"{self.name}: {workers} workers is not 1..64", "e.g. --targets userspace-2w")
        self.workers = int(workers)
        if self.workers > 1:  # N + 1 interpreters start (over 9p under emulation in the lab)
            self.ready_timeout = max(ready_timeout, 150.0)
        self.cpus = cpus
        self.device = device
        self.data_path = data_path  # serve --data-path; None: the target's default (native when it is built)
        if device.kind != "ram" and (self.config_path or self.workers > 1):
            raise NvmeofError(f"--device {device.label} makes the {self.name} target's namespace: it cannot be "
                              "combined with --userspace-config or a multi-worker target",
                              "drop one of them")
        self._device = None
        self.serve_args = list(serve_args)  # more `target serve` options (the native data path's)
        self.kind = "nvmeof-roce userspace target (target serve" + (
            f" --workers {self.workers}" if self.workers > 1 else "") + (
            f" --data-path {data_path}" if data_path else "") + "".join(" " + a for a in self.serve_args) + ")"
        self._proc: Optional[subprocess.Popen] = None
        self._log = None
        self.log_path: Optional[Path] = None
        self._socket_dir: Optional[str] = None

    @staticmethod
    def _address_from_config(path: Path):
        try:
            cfg = json.loads(path.read_text())
            port = cfg["ports"][0]
            nqn = port["subsystems"][0]
            return port["addr"]["traddr"], int(port["addr"]["trsvcid"]), nqn
        except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise NvmeofError(f"{path}: cannot take the address from it ({exc})",
                              "give a config with ports[0].addr.traddr/trsvcid and ports[0].subsystems[0]")

    def describe(self) -> dict:
        d = super().describe()
        d["backend"] = (f"config {self.config_path}" if self.config_path else
                        self.device.describe(self.size_mb) if self.device.kind != "ram" else f"ram, {self.size_mb} MiB")
        if self.device.kind != "ram":
            d["device"] = self.device.label
        if self.checkout:
            d["checkout"] = str(self.checkout)
        d["data_path"] = self.data_path or self._default_data_path()
        if self.workers > 1:
            d["workers"] = self.workers
            d["trsvcids"] = [str(p) for p in self.trsvcids]
        if self.cpus:
            d["cpus"] = self.cpus
        return d

    def _default_data_path(self) -> str:
        if self.checkout is not None:
            return "default"  # another checkout's: its own default
        from ..native import default_data_path  # the same module `target serve` asks
        return default_data_path(0 if self.workers > 1 else None)

    @property
    def trsvcids(self) -> List[int]:
        return [self.trsvcid + i for i in range(self.workers)]

    def check(self) -> None:
        # `target serve` is service/serve.py, or target/serve.py in a checkout from before the service package
        if self.checkout is not None and not any((self.checkout / "nvmeof_roce" / d / "serve.py").is_file()
                                                 for d in ("service", "target")):
            raise NvmeofError(f"--{self.name}-checkout {self.checkout}: no nvmeof_roce/service/serve.py "
                              "(nor target/serve.py) there",
                              "give a checkout of nvmeof-roce with the userspace target, e.g. "
                              "git worktree add results/baseline <commit>")
        self._check_device()
        if self.workers == 1:
            self._check_address_free()
            return
        for svc in self.trsvcids:
            who = kernel_glue.listener_on(self.traddr, svc)
            if who:
                raise NvmeofError(f"{self.traddr}:{svc} (worker {svc - self.trsvcid} of the {self.name} target) "
                                  f"is already in use by {who}", "stop it, or move the workers' ports "
                                  "(--workers-port)")

    def setup(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        config = self.config_path
        if config is None:
            path = None
            if self.device.kind != "ram":  # a device of its own, the same settings as the kernel target's
                self._device = self.device.make(self.subnqn.rsplit(":", 1)[-1], self.size_mb)
                path = self._device.create()
            config = self.work_dir / f"{self.name}-target.json"
            config.write_text(json.dumps(userspace_config(self.traddr, self.trsvcid, self.subnqn, self.size_mb,
                                                          device_path=path, direct=self.device.kind == "file"),
                                         indent=2) + "\n")
        self.log_path = self.work_dir / f"{self.name}-target.log"
        self._log = open(self.log_path, "w")
        cmd = _cli() + ["target", "serve", str(config)] + self.serve_args
        if self.workers > 1:  # its own run directory: two targets' ANA state and pid files must not meet
            cmd += ["--workers", str(self.workers), "--run-dir", str(self.work_dir / f"{self.name}-run")]
        if self.cpus:  # worker i on CPU i % len, or the single process on the list (bench --userspace-cpus)
            cmd += ["--cpus", self.cpus]
        if self.data_path:
            cmd += ["--data-path", self.data_path]
        if self.workers == 1 and self.checkout is None:  # the soak's live changes (a socket path is short)
            self._socket_dir = tempfile.mkdtemp(prefix="nvmeof-bench-")
            cmd += ["--rpc-socket", os.path.join(self._socket_dir, "control.sock")]
        ready = None
        if self.checkout is None:  # another checkout's target may not know --ready-file: wait on `rdma` for it
            ready = self.work_dir / f"{self.name}-target.ready"
            if ready.exists():
                ready.unlink()
            cmd += ["--ready-file", str(ready)]
        log.info("starting %s", " ".join(cmd))
        env = None
        if self.checkout is not None:
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join([str(self.checkout)] + [p for p in env.get("PYTHONPATH", "").split(
                os.pathsep) if p])
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=env, cwd=str(self.checkout) if self.checkout else None)
        self._wait_listening(ready)

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def rpc_socket(self) -> Optional[str]:
        return os.path.join(self._socket_dir, "control.sock") if self._socket_dir and self.pid else None

    def processes(self) -> Dict[str, int]:
        """One process, or the supervisor and its workers (`worker0`, `worker1`, ...: each a core's worth)."""
        pid = self.pid
        if pid is None:
            return {}
        if self.workers == 1:
            return {"target": pid}
        out = {"supervisor": pid}
        for child in _children(pid):
            try:
                argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"--worker-index" in argv:
                out[f"worker{int(argv[argv.index(b'--worker-index') + 1])}"] = child
        return out

    def _wait_listening(self, ready: Optional[Path]) -> None:
        """Until the ready file appears (the target writes it once it listens), or else until `rdma` shows
        the listener; the process dying meanwhile is an error with its log."""
        deadline = time.monotonic() + self.ready_timeout
        while True:
            if self._proc.poll() is not None:
                raise NvmeofError(f"the userspace target exited with code {self._proc.returncode} while starting: "
                                  f"{self._log_tail()}", f"see {self.log_path}")
            if ready is not None:
                if ready.exists():
                    return
            else:
                who = kernel_glue.listener_on(self.traddr, self.trsvcid)
                if who is None:  # `rdma` cannot tell: give it a moment, the host retries its connect anyway
                    time.sleep(2.0)
                    return
                if who:
                    return
            if time.monotonic() > deadline:
                raise NvmeofError(f"the userspace target is not listening on {self.traddr}:{self.trsvcid} after "
                                  f"{self.ready_timeout:.0f} s: {self._log_tail()}", f"see {self.log_path}")
            time.sleep(0.2)

    def _log_tail(self, n: int = 5) -> str:
        try:
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except (OSError, AttributeError):
            return "no log"
        return " | ".join(lines[-n:]) or "no output"

    def teardown(self) -> None:
        proc, self._proc = self._proc, None
        try:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:  # a supervisor gives its workers 15 s to drain (service/workers.py STOP_TIMEOUT)
                    proc.wait(15 if self.workers == 1 else 40)
                except subprocess.TimeoutExpired:
                    log.warning("userspace target (pid %d) ignored SIGTERM; killing it", proc.pid)
                    proc.kill()
                    proc.wait(10)
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None
            device, self._device = self._device, None
            if device is not None:
                device.remove()
            socket_dir, self._socket_dir = self._socket_dir, None
            if socket_dir is not None:
                shutil.rmtree(socket_dir, ignore_errors=True)


def _children(pid: int) -> List[int]:
    """The child processes of `pid` (/proc/PID/task/*/children, proc(5))."""
    out: List[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return sorted(set(out))


# --- the kernel host ----------------------------------------------------------------------------------

class KernelHost(Host):
    """The kernel's nvme-rdma host, driven with nvme-cli."""

    name = "kernel nvme-rdma (nvme-cli)"

    def check(self) -> None:
        kernel_glue.require_root("the kernel host (nvme connect)")
        kernel_glue.nvme_binary()
        kernel_glue.modprobe("nvme-rdma")
        if not os.path.exists("/dev/nvme-fabrics"):
            raise NvmeofError("/dev/nvme-fabrics is missing", "modprobe nvme-fabrics nvme-rdma")

    def connect(self, target: TargetUnderTest) -> str:
        if len(target.trsvcids) > 1:  # every worker's port, one namespace head, round-robin over the paths
            return kernel_glue.nvme_connect_paths(target.traddr, target.trsvcids, target.subnqn)
        host_fabric = registry.fabric(target.fabric.trtype)
        if not host_fabric.rdma_device:  # nvme-rdma is loaded with the RDMA setup
            kernel_glue.modprobe(host_fabric.host_module)
        return kernel_glue.nvme_connect(target.traddr, target.trsvcid, target.subnqn, trtype=target.fabric.trtype)

    def disconnect(self, target: TargetUnderTest) -> None:
        kernel_glue.nvme_disconnect(target.subnqn)

    def connected(self, target: TargetUnderTest) -> bool:
        return bool(kernel_glue.controllers(target.subnqn))

    def path_ios(self, device: str) -> Dict[str, int]:
        return kernel_glue.path_ios(device)
