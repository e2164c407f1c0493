"""The bench orchestration: targets up, perftest on the link, fio jobs interleaved across targets, all down.

For every repeat, for every job, each target in turn (A B A B ...): connect the kernel host to the target with
nvme-cli, find its namespace's block device, run the fio job, disconnect. Interleaving job by job means slow
drift of the machine (other load, thermal, the emulator) hits every target alike, and `--repeats N` gives
each number a median and a spread. A progress line per job goes to stderr.

Cleanup is in `finally:` blocks: a host is disconnected after every job whatever happened, and every target
that was set up is torn down, also on an error or Ctrl-C.

Job kinds:
- `fio`: a job file from fio-jobs/ run on the kernel host's block device;
- `initiator-perf`: our userspace initiator's load generator (`nvmeof-roce initiator perf`, in the manner of
  SPDK's perf) connecting to the target itself: see `initiator_perf_command()` for the hook.
"""
from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import platform
import re
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from ..errors import NvmeofError
from ..output import progress as _progress
from . import report
from .fio import FioJobFile, FioResult, fio_binary, fio_version, list_job_files, run_fio
from .perftest import (DEFAULT_TESTS, PerftestResult, perftest_binary, perftest_version, rdma_device_for,
                       run_perftest)
from .targets import Host, TargetUnderTest

log = logging.getLogger(__name__)


# --- jobs -----------------------------------------------------------------------------------------

@dataclass
class JobSpec:
    name: str
    kind: str  # "fio" | "initiator-perf"
    description: str = ""
    fio_job: Optional[FioJobFile] = None
    params: Dict[str, object] = field(default_factory=dict)

    @property
    def report(self) -> str:
        return self.fio_job.report if self.fio_job else "auto"


# Our initiator's load generator: not in the default selection, name them in --jobs.
INITIATOR_PERF_JOBS = {
    "uinit-randread-4k-qd1": {"rw": "randread", "bs": 4096, "qd": 1},
    "uinit-randread-4k-qd32": {"rw": "randread", "bs": 4096, "qd": 32},
    "uinit-randwrite-4k-qd32": {"rw": "randwrite", "bs": 4096, "qd": 32},
}


def available_jobs(jobs_dir: Optional[Path] = None) -> Dict[str, JobSpec]:
    jobs = {name: JobSpec(name=name, kind="fio", description=f.description, fio_job=f)
            for name, f in list_job_files(jobs_dir).items()}
    for name, params in INITIATOR_PERF_JOBS.items():
        jobs[name] = JobSpec(name=name, kind="initiator-perf", params=dict(params),
                             description=f"userspace initiator perf: {params['rw']} {params['bs']} B, "
                                         f"queue depth {params['qd']}")
    return jobs


def select_jobs(names: Optional[str], jobs_dir: Optional[Path] = None) -> List[JobSpec]:
    """`names`: comma-separated job names, or None/'all' for every fio job."""
    jobs = available_jobs(jobs_dir)
    if not names or names.strip() == "all":
        chosen = [j for j in jobs.values() if j.kind == "fio"]
        if not chosen:
            raise NvmeofError("no fio job files found", "put *.fio files in fio-jobs/ or pass --jobs-dir")
        return chosen
    out = []
    for name in [n.strip() for n in names.split(",") if n.strip()]:
        if name.endswith(".fio"):
            name = name[:-4]
        if name not in jobs:
            raise NvmeofError(f"unknown job {name!r}", "choose from: " + ", ".join(jobs))
        if jobs[name] not in out:
            out.append(jobs[name])
    if not out:
        raise NvmeofError("--jobs selects no job", "choose from: " + ", ".join(jobs))
    return out


# --- config and machine -----------------------------------------------------------------------------

@dataclass
class BenchConfig:
    out_dir: Path
    traddr: str = "10.99.0.1"
    runtime: float = 10.0
    ramp: float = 2.0
    size: str = "256M"
    repeats: int = 1
    perftest: bool = True
    perftest_tests: Sequence[str] = DEFAULT_TESTS
    perftest_iterations: Optional[int] = None
    perftest_rdma_cm: bool = True
    perftest_gid: Optional[int] = None
    perftest_port: int = 18515
    rdma_device: Optional[str] = None
    ratio: Sequence[str] = report.DEFAULT_RATIO


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _tool_version(cmd: List[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr).strip() else ""


def machine_info(traddr: Optional[str] = None) -> dict:
    cpu = re.search(r"^model name\s*:\s*(.+)$", _read("/proc/cpuinfo"), re.M)
    mem = re.search(r"^MemTotal:\s*(\d+) kB", _read("/proc/meminfo"), re.M)
    osrel = re.search(r'^PRETTY_NAME="?([^"\n]*)', _read("/etc/os-release"), re.M)
    rdma = []
    ib = Path("/sys/class/infiniband")
    for dev in sorted(ib.glob("*")) if ib.is_dir() else []:
        ports = {}
        for port in sorted((dev / "ports").glob("*")):
            ports[port.name] = {"state": _read(str(port / "state")).strip(),
                                "link_layer": _read(str(port / "link_layer")).strip(),
                                "rate": _read(str(port / "rate")).strip()}
        rdma.append({"name": dev.name, "node_type": _read(str(dev / "node_type")).strip(), "ports": ports})
    info = {
        "hostname": socket.gethostname(),
        "kernel": platform.release(),
        "os": osrel.group(1) if osrel else platform.system(),
        "cpu": cpu.group(1).strip() if cpu else platform.processor(),
        "cpus": os.cpu_count(),
        "memory_mb": int(mem.group(1)) // 1024 if mem else None,
        "python": platform.python_version(),
        "lab": os.environ.get("NVMEOF_LAB") == "1" or os.path.exists("/mnt/ctl/env"),
        "rdma_devices": rdma,
        "tools": {"fio": fio_version(), "nvme": _tool_version(["nvme", "version"]),
                  "perftest": perftest_version()},
    }
    if traddr:
        try:
            info["rdma_device"] = rdma_device_for(traddr)
        except NvmeofError:
            info["rdma_device"] = None
    return info


# --- the initiator-perf hook -----------------------------------------------------------------------------

def _cli() -> List[str]:
    return [sys.executable, "-m", "nvmeof_roce"]


READ_PERCENT = {"randread": 100, "randwrite": 0, "randrw": 70}


def initiator_perf_command(target: TargetUnderTest, params: Dict[str, object], runtime: float,
                           ramp: float = 0.0) -> List[str]:
    """The command line of our initiator's load generator (`nvmeof-roce initiator perf`, like SPDK's perf).
    With --json it prints {"iops", "bandwidth_bytes", "errors", "latency_us": {"p50", "p90", "p99", "p99.9",
    "mean"}, ...}."""
    return _cli() + ["initiator", "perf", "--traddr", target.traddr, "--trsvcid", str(target.trsvcid),
                     "--nqn", target.subnqn, "--nsid", "1", "--block-size", str(params["bs"]),
                     "--queue-depth", str(params["qd"]), "--read-percent", str(READ_PERCENT[str(params["rw"])]),
                     "--runtime", _num(runtime), "--ramp", _num(ramp), "--json"]


def run_initiator_perf(job: JobSpec, target: TargetUnderTest, config: BenchConfig, raw: Path) -> dict:
    cmd = initiator_perf_command(target, job.params, config.runtime, config.ramp)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=2 * (config.runtime + config.ramp) + 120)
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(proc.stdout + ("\n" + proc.stderr if proc.stderr else ""))
    return parse_initiator_perf(proc.stdout, proc.returncode, proc.stderr, raw)


def parse_initiator_perf(stdout: str, returncode: int = 0, stderr: str = "", raw: Optional[Path] = None) -> dict:
    """`initiator perf --json` output as a repeat's numbers."""
    try:
        data = json.loads(stdout[stdout.index("{"):])
    except ValueError:
        raise NvmeofError(f"initiator perf gave no JSON (exit {returncode}): {stderr.strip()[-300:]}",
                          f"see {raw}" if raw else "run it by hand with --json")
    lat = dict(data.get("latency_us") or data.get("lat_us") or {})
    errors = int(data.get("errors", 0) or 0) or (1 if returncode else 0)
    return {"iops": data.get("iops"), "bw_bytes": data.get("bandwidth_bytes", data.get("bw_bytes")),
            "lat_us": {k: lat.get(k) for k in report.LAT_KEYS}, "lat_mean_us": lat.get("mean"),
            "errors": errors, "error_text": stderr.strip()[-300:] if errors else ""}


def _num(v: float) -> str:
    v = float(v)
    return str(int(v)) if v.is_integer() else f"{v:g}"


# --- the runner --------------------------------------------------------------------------------------

class BenchRunner:
    """Runs the selected jobs against the targets under test; `run()` returns the result dict."""

    def __init__(self, config: BenchConfig, targets: Sequence[TargetUnderTest], jobs: Sequence[JobSpec],
                 host: Optional[Host] = None, *, fio_runner: Callable[..., FioResult] = run_fio,
                 perftest_runner: Callable[..., PerftestResult] = run_perftest,
                 initiator_perf: Callable[..., dict] = run_initiator_perf,
                 progress: Callable[[str], None] = _progress, machine: Optional[dict] = None):
        if not targets:
            raise NvmeofError("no target to measure", "--targets kernel,userspace")
        names = [t.name for t in targets]
        if len(set(names)) != len(names):
            raise NvmeofError(f"targets named twice: {', '.join(names)}", "name each target once in --targets")
        if config.repeats < 1:
            raise NvmeofError("--repeats must be at least 1", "--repeats 1")
        self.config = config
        self.targets = list(targets)
        self.jobs = list(jobs)
        self.host = host
        self.fio_runner = fio_runner
        self.perftest_runner = perftest_runner
        self.initiator_perf = initiator_perf
        self.progress = progress
        self.machine = machine
        self.raw_dir = Path(config.out_dir) / "raw"

    # -- refusing early ----------------------------------------------------------------------------------

    def preflight(self) -> None:
        """Every reason the bench cannot run here, all at once, before anything is set up."""
        problems: List[NvmeofError] = []

        def check(fn, *args):
            try:
                fn(*args)
            except NvmeofError as exc:
                problems.append(exc)

        kinds = {j.kind for j in self.jobs}
        if "fio" in kinds:
            check(fio_binary)
            if self.host is None:
                problems.append(NvmeofError("fio jobs need a host to connect with", "internal: no host given"))
            else:
                check(self.host.check)
        if self.config.perftest:
            for test in self.config.perftest_tests:
                check(perftest_binary, test)
            check(rdma_device_for, self.config.traddr)
        for t in self.targets:
            check(t.check)
        if problems:
            seen, lines = set(), []
            for p in problems:
                if str(p) not in seen:
                    seen.add(str(p))
                    lines.append(f"  - {p.message}" + (f"\n      fix: {p.fix}" if p.fix else ""))
            raise NvmeofError("the bench cannot run here:\n" + "\n".join(lines),
                              "fix the above, or narrow the run (--targets, --jobs, --no-perftest)")

    # -- running -------------------------------------------------------------------------------------------

    def run(self) -> dict:
        self.preflight()
        cfg = self.config
        Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
        result = report.new_result(
            date=_dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
            machine=self.machine if self.machine is not None else machine_info(cfg.traddr),
            params={"jobs": [j.name for j in self.jobs], "targets": [t.name for t in self.targets],
                    "repeats": cfg.repeats, "runtime_s": cfg.runtime, "ramp_s": cfg.ramp, "size": cfg.size,
                    "traddr": cfg.traddr, "host": self.host.name if self.host else None,
                    "order": "for each repeat, for each job, each target in turn (interleaved)"},
            targets={t.name: t.describe() for t in self.targets}, ratio=cfg.ratio)
        for j in self.jobs:
            report.add_job(result, j.name, kind=j.kind, description=j.description, report=j.report)

        if cfg.perftest:
            self._perftest(result)

        started: List[TargetUnderTest] = []
        try:
            for t in self.targets:
                self.progress(f"bench: setting up the {t.name} target ({t.kind}) on {t.traddr}:{t.trsvcid}")
                started.append(t)
                t.setup()
            total = cfg.repeats * len(self.jobs) * len(self.targets)
            n = 0
            for r in range(1, cfg.repeats + 1):
                for job in self.jobs:
                    for t in self.targets:
                        n += 1
                        rec = self._one(job, t, r)
                        report.add_repeat(result, job.name, t.name, rec)
                        self.progress(f"bench [{n}/{total}] {job.name} on {t.name} (repeat {r}/{cfg.repeats}): "
                                      f"{_summary(rec)}")
        finally:
            for t in reversed(started):
                try:
                    self.progress(f"bench: tearing down the {t.name} target")
                    t.teardown()
                except Exception as exc:  # keep tearing the others down
                    log.error("teardown of %s failed: %s", t.name, exc)
                    result["errors"].append(f"teardown of the {t.name} target failed: {exc}")
        return report.finalize(result)

    def _perftest(self, result: dict) -> None:
        cfg = self.config
        for i, test in enumerate(cfg.perftest_tests):
            self.progress(f"bench: perftest {test} over {cfg.traddr}")
            try:
                res = self.perftest_runner(test, cfg.traddr, device=cfg.rdma_device, rdma_cm=cfg.perftest_rdma_cm,
                                           gid_index=cfg.perftest_gid, iterations=cfg.perftest_iterations,
                                           port=cfg.perftest_port + i,
                                           raw_output=self.raw_dir / f"perftest-{test}.txt")
                result["perftest"][test] = res.to_dict()
            except NvmeofError as exc:
                log.warning("%s: %s", test, exc)
                result["perftest"][test] = {"test": test, "error": exc.message}

    def _one(self, job: JobSpec, target: TargetUnderTest, repeat: int) -> dict:
        cfg = self.config
        raw = self.raw_dir / f"{job.name}.{target.name}.r{repeat}.json"
        rel = str(raw.relative_to(cfg.out_dir))
        if job.kind == "initiator-perf":
            try:
                got = self.initiator_perf(job, target, cfg, raw)
            except NvmeofError as exc:
                got = {"iops": None, "bw_bytes": None, "lat_us": {}, "errors": 1, "error_text": exc.message}
            return report.repeat_record(repeat, raw=rel, **got)

        device = None
        try:
            device = self.host.connect(target)
            try:
                res = self.fio_runner(job.fio_job, device, cfg.runtime, cfg.size, cfg.ramp, output_path=raw)
            except NvmeofError as exc:  # fio could not run at all: record it, go on with the next job
                return report.repeat_record(repeat, iops=None, bw_bytes=None, lat_us={}, errors=1,
                                            error_text=exc.message, raw=rel, device=device)
        finally:
            self.host.disconnect(target)
        return report.repeat_record(
            repeat, iops=res.iops, bw_bytes=res.bw_bytes, lat_us=res.clat_us, lat_mean_us=res.lat_mean_us,
            errors=res.errors, error_text=res.error_text, raw=rel, device=device, headline=res.report,
            directions={d: {"iops": s.iops, "bw_bytes": s.bw_bytes, "lat_us": s.clat_us}
                        for d, s in res.directions.items() if s.total_ios})


def _summary(rec: dict) -> str:
    lat = rec.get("lat_us") or {}
    text = (f"{report.fmt_iops(rec.get('iops'))} IOPS, {report.fmt_mbps(rec.get('bw_bytes'))} MB/s, "
            f"p50 {report.fmt_lat(lat.get('p50'))}, p99 {report.fmt_lat(lat.get('p99'))}")
    if rec.get("errors"):
        text += f", {rec['errors']} error(s): {rec.get('error_text')}"
    return text


__all__ = ["BenchConfig", "BenchRunner", "JobSpec", "available_jobs", "select_jobs", "machine_info",
           "initiator_perf_command", "INITIATOR_PERF_JOBS"]
