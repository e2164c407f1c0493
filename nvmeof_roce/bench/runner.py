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
  SPDK's perf) connecting to the target itself: see `initiator_perf_command()` for the hook;
- `soak`: fio-jobs/soak/soak-randrw-verify-4k-qd32.fio, a fixed number of commands (`--soak-ios`), 4 KiB
  random writes each read back and verified in batches (mixed reads and writes), while the target's RSS is
  sampled every `--soak-interval` seconds (its growth per million commands is fitted) and, on our target, a
  scratch namespace is added, resized and removed by RPC every `--soak-change-interval` seconds (soak.py). The
  region is written once first (fio-jobs/soak/prefill-seqwrite-128k.fio), not sampled.

Every job also records what it cost (procstat.py): the userspace target process's user and system CPU time
and CPU µs per I/O, and the whole machine's busy CPU per I/O (the only figure the kernel target, which has
no process, has), sampled just before and just after the job's fio or perf run; and the target's resident
memory (`memory`: its RSS at the end, the highest sampled during the job, its VmHWM), sampled every
MEMORY_INTERVAL seconds while the job runs. A fio job on our native target also records how its I/O queues were
polled (`polling`, from `target status` before the host disconnects: polls, spin hits, spin yields, arms), so an
adaptive target's record says whether its spin caught the next command or it slept per I/O.

`bench --rbd` (rbd.py) adds two things a target may have: `direct_job` (fio-rbd: no host connects, fio runs the
job as the target turns it, with the target's `fio_env`), and `side_processes` (the Ceph daemons, sampled for their
CPU on their own: `cpu.side`); a target with `served_by` records which data path served its namespace (`served`,
from the same `target status` answer as the polling figures).
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

from ..control import client
from ..control.client import RpcError
from ..errors import NvmeofError
from ..output import progress as _progress
from . import report
from .fio import (FioJobFile, FioResult, default_jobs_dir, fio_binary, fio_version, list_job_files, pinned_to,
                  run_fio)
from . import procstat
from .soak import LiveChanges, SoakProgress
from .perftest import (DEFAULT_TESTS, PerftestResult, perftest_binary, perftest_version, rdma_device_for,
                       run_perftest)
from .targets import Host, TargetUnderTest

log = logging.getLogger(__name__)


# --- jobs -----------------------------------------------------------------------------------------

@dataclass
class JobSpec:
    name: str
    kind: str  # "fio" | "initiator-perf" | "soak"
    description: str = ""
    fio_job: Optional[FioJobFile] = None
    params: Dict[str, object] = field(default_factory=dict)

    @property
    def report(self) -> str:
        return self.fio_job.report if self.fio_job else "auto"


# Our initiator's load generator: not in the default selection, name them in --jobs.  uinit-* run its default
# data path (native when the extension is built), uinit-py-* its Python one, for the comparison in one run.
INITIATOR_PERF_JOBS = {
    "uinit-randread-4k-qd1": {"rw": "randread", "bs": 4096, "qd": 1},
    "uinit-randread-4k-qd32": {"rw": "randread", "bs": 4096, "qd": 32},
    "uinit-randwrite-4k-qd32": {"rw": "randwrite", "bs": 4096, "qd": 32},
    "uinit-py-randread-4k-qd1": {"rw": "randread", "bs": 4096, "qd": 1, "data_path": "python"},
    "uinit-py-randread-4k-qd32": {"rw": "randread", "bs": 4096, "qd": 32, "data_path": "python"},
    "uinit-py-randwrite-4k-qd32": {"rw": "randwrite", "bs": 4096, "qd": 32, "data_path": "python"},
}


QD_SWEEP_DIR = "qd-sweep"  # fio-jobs/qd-sweep/sweep-randread-4k-qdN.fio: `bench --qd-sweep`, plotted IOPS vs QD
QD_SWEEP_DEPTHS = (1, 4, 16, 32, 128)
RBD_DIR = "rbd"  # fio-jobs/rbd/rbd-*.fio: `bench --rbd`, one RBD image served three ways (bench/rbd.py)
SOAK_JOB = "soak"
SOAK_FILE = Path("soak") / "soak-randrw-verify-4k-qd32.fio"
SOAK_BLOCK = 4096
PREFILL_FILE = "prefill-seqwrite-128k.fio"  # next to the soak job
MEMORY_INTERVAL = 1.0  # s between the target's memory samples during a job (the soak: --soak-interval)


def available_jobs(jobs_dir: Optional[Path] = None) -> Dict[str, JobSpec]:
    jobs = {name: JobSpec(name=name, kind="fio", description=f.description, fio_job=f)
            for name, f in list_job_files(jobs_dir).items()}
    soak_file = (Path(jobs_dir) if jobs_dir else default_jobs_dir()) / SOAK_FILE
    if soak_file.is_file():  # not in the default selection: it runs for a count, not a time
        soak = FioJobFile.load(soak_file)
        jobs[SOAK_JOB] = JobSpec(name=SOAK_JOB, kind="soak", description=soak.description, fio_job=soak)
    sweep_dir = (Path(jobs_dir) if jobs_dir else default_jobs_dir()) / QD_SWEEP_DIR
    if sweep_dir.is_dir():  # not in the default selection: --qd-sweep names them
        for name, f in list_job_files(sweep_dir).items():
            jobs[name] = JobSpec(name=name, kind="fio", description=f.description, fio_job=f,
                                 params={"sweep": True})
    rbd_dir = (Path(jobs_dir) if jobs_dir else default_jobs_dir()) / RBD_DIR
    if rbd_dir.is_dir():  # not in the default selection: --rbd names them
        for name, f in list_job_files(rbd_dir).items():
            jobs[name] = JobSpec(name=name, kind="fio", description=f.description, fio_job=f, params={"rbd": True})
    for name, params in INITIATOR_PERF_JOBS.items():
        jobs[name] = JobSpec(name=name, kind="initiator-perf", params=dict(params),
                             description=f"userspace initiator perf: {params['rw']} {params['bs']} B, "
                                         f"queue depth {params['qd']}"
                                         + (f", {params['data_path']} data path" if "data_path" in params else ""))
    return jobs


def select_jobs(names: Optional[str], jobs_dir: Optional[Path] = None) -> List[JobSpec]:
    """`names`: comma-separated job names, or None/'all' for every fio job."""
    jobs = available_jobs(jobs_dir)
    if not names or names.strip() == "all":
        chosen = [j for j in jobs.values() if j.kind == "fio" and not j.params.get("sweep")
                  and not j.params.get("rbd")]
        if not chosen:
            raise NvmeofError("no fio job files found", f"put *.fio files in {jobs_dir or default_jobs_dir()} or pass "
                              "--jobs-dir")
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


def qd_sweep_jobs(jobs_dir: Optional[Path] = None) -> List[JobSpec]:
    """`bench --qd-sweep`: 4 KiB random read at each queue depth of QD_SWEEP_DEPTHS, in that order."""
    jobs = available_jobs(jobs_dir)
    names = [f"sweep-randread-4k-qd{qd}" for qd in QD_SWEEP_DEPTHS]
    missing = [n for n in names if n not in jobs]
    if missing:
        raise NvmeofError(f"the QD sweep's job files are missing: {', '.join(missing)}",
                          f"restore them in {jobs_dir or default_jobs_dir()}/{QD_SWEEP_DIR}/, or pass --jobs-dir")
    return [jobs[n] for n in names]


def rbd_jobs(jobs_dir: Optional[Path] = None) -> List[JobSpec]:
    """`bench --rbd`: the RBD job set (bench/rbd.py JOBS), in that order."""
    from .rbd import JOBS
    jobs = available_jobs(jobs_dir)
    missing = [n for n in JOBS if n not in jobs]
    if missing:
        raise NvmeofError(f"the RBD job set's files are missing: {', '.join(missing)}",
                          f"restore them in {jobs_dir or default_jobs_dir()}/{RBD_DIR}/, or pass --jobs-dir")
    return [jobs[n] for n in JOBS]


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
    topology: Optional[dict] = None  # bench --two-node: which node ran what (report.topology_text)
    # the soak job: its command count, how often the target's RSS is sampled, a cap on its duration, and the
    # commands left out of the fit at the start (None: the first tenth, while pools and caches fill once)
    soak_ios: int = 200_000
    soak_interval: float = 2.0
    soak_timeout: float = 7200.0
    soak_skip: Optional[int] = None
    soak_change_interval: float = 3.0  # s between the soak's live changes (0: none)
    host_cpus: Optional[Sequence[int]] = None  # bench --host-cpus: fio and our initiator run on these CPUs only
    ratios: Sequence[Sequence[str]] = ()  # more A/B pairs than `ratio`, each job's `ratios` (bench --rbd)
    rbd: Optional[dict] = None  # bench --rbd: the image and the data path asked for (params["rbd"])


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
                     "--runtime", _num(runtime), "--ramp", _num(ramp)] + \
        (["--data-path", str(params["data_path"])] if params.get("data_path") else []) + ["--json"]


def run_initiator_perf(job: JobSpec, target: TargetUnderTest, config: BenchConfig, raw: Path) -> dict:
    cmd = initiator_perf_command(target, job.params, config.runtime, config.ramp)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=2 * (config.runtime + config.ramp) + 120,
                          preexec_fn=pinned_to(config.host_cpus))
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


POLLING_COUNTS = ("polls", "spin_hits", "spin_yields", "arms", "arm_catches")


def queue_polling(status: dict, nqn: Optional[str]) -> Optional[dict]:
    """The native I/O queues' polling figures of subsystem `nqn` in a `target status --json` answer, summed over
    its queues (control/stats.py `queue_status`); None when it has none (the Python data path, the kernel)."""
    totals = dict.fromkeys(POLLING_COUNTS, 0)
    modes, queues = set(), 0
    for sub in status.get("subsystems", []):
        if nqn and sub.get("nqn") != nqn:
            continue
        for ctrl in sub.get("controllers", []):
            for queue in ctrl.get("queues", []):
                polling = queue.get("polling")
                if not queue.get("qid") or not polling:
                    continue
                queues += 1
                modes.add(str(polling.get("mode")))
                for key in POLLING_COUNTS:
                    totals[key] += int(polling.get(key) or 0)
    if not queues:
        return None
    return {"mode": ",".join(sorted(modes)), "queues": queues, **totals}


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
                 progress: Callable[[str], None] = _progress, machine: Optional[dict] = None,
                 status_call: Callable[..., dict] = client.call):
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
        self.status_call = status_call  # the target's `nvmeof_get_status` (a test passes its own)
        self.raw_dir = Path(config.out_dir) / "raw"
        soak = next((j for j in self.jobs if j.kind == "soak" and j.fio_job), None)
        prefill = soak.fio_job.path.parent / PREFILL_FILE if soak else None
        self.prefill_job = FioJobFile.load(prefill) if prefill and prefill.is_file() else None

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
        if kinds & {"fio", "soak"}:
            check(fio_binary)
            if self.host is None:
                problems.append(NvmeofError("fio jobs need a host to connect with", "internal: no host given"))
            else:
                check(self.host.check)
        if self.config.perftest:
            for test in self.config.perftest_tests:
                check(perftest_binary, test)
            if self.config.rdma_device is None:  # (two-node: the client's own device, given)
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
                    "device": next((getattr(t, "device").label for t in self.targets
                                    if getattr(t, "device", None) is not None), "ram"),
                    "repeats": cfg.repeats, "runtime_s": cfg.runtime, "ramp_s": cfg.ramp, "size": cfg.size,
                    "traddr": cfg.traddr, "host": self.host.name if self.host else None,
                    "soak_ios": cfg.soak_ios if any(j.kind == "soak" for j in self.jobs) else None,
                    "host_cpus": list(cfg.host_cpus) if cfg.host_cpus else None,
                    "clk_tck": procstat.CLK_TCK,
                    "order": "for each repeat, for each job, each target in turn (interleaved)"},
            targets={t.name: t.describe() for t in self.targets}, ratio=cfg.ratio, ratios=cfg.ratios)
        if cfg.rbd:
            result["params"]["rbd"] = dict(cfg.rbd)
        if cfg.topology:
            result["topology"] = dict(cfg.topology)
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
            sampler = procstat.Sampler(target.pid, interval=MEMORY_INTERVAL).start()
            try:
                got = self.initiator_perf(job, target, cfg, raw)
            except NvmeofError as exc:
                got = {"iops": None, "bw_bytes": None, "lat_us": {}, "errors": 1, "error_text": exc.message}
            finally:
                sampler.stop()
            before, after = sampler.samples[0], sampler.samples[-1]
            # no block device to count on: the perf's own rate over its runtime and ramp (an estimate)
            ios = round(got["iops"] * (cfg.runtime + cfg.ramp)) if got.get("iops") else None
            return report.repeat_record(repeat, raw=rel, cpu=procstat.cpu_cost(
                before, after, ios, "estimated: perf IOPS x (runtime + ramp)"),
                memory=procstat.memory(sampler.samples), **got)

        if job.kind == "fio" and callable(getattr(target, "direct_job", None)):
            return self._one_direct(job, target, repeat, raw, rel)
        soak = job.kind == "soak"
        device = None
        sampler = None
        changes = None
        side = _side_processes(target)
        side_before: Dict[str, procstat.ProcessCpu] = {}
        try:
            try:
                device = self.host.connect(target)
            except NvmeofError as exc:
                if len(target.trsvcids) == 1:
                    raise
                # a path not live: this job fails (named), the run goes on with the next
                return report.repeat_record(repeat, iops=None, bw_bytes=None, lat_us={}, errors=1,
                                            error_text=f"{exc.message} (fix: {exc.fix})" if exc.fix
                                            else exc.message, raw=rel)
            if soak:
                prefill = self._soak_prefill(device, target)
                if prefill is not None:
                    return report.repeat_record(repeat, iops=None, bw_bytes=None, lat_us={}, errors=1,
                                                error_text=prefill, raw=rel, device=device)
            if soak and cfg.soak_change_interval > 0 and target.rpc_socket:
                changes = LiveChanges(target.rpc_socket, target.subnqn, cfg.soak_change_interval)
            sampler = procstat.Sampler(target.pid, lambda: procstat.block_device_ios(device),
                                       interval=cfg.soak_interval if soak else MEMORY_INTERVAL,
                                       processes=target.processes(),
                                       on_sample=SoakProgress(target.name, cfg.soak_ios, self.progress, changes)
                                       if soak else None)
            multipath = len(target.trsvcids) > 1
            paths_before = self.host.path_ios(device) if multipath else {}
            sampler.start()  # RSS every soak_interval (or MEMORY_INTERVAL) seconds
            side_before = _side_reading(side)
            if changes is not None:
                changes.start()
            try:
                if soak:
                    res = self.fio_runner(job.fio_job, device, cfg.soak_timeout, cfg.size, 0, output_path=raw,
                                          extra_env={"SOAK_BYTES": str(cfg.soak_ios * SOAK_BLOCK)},
                                          timeout=cfg.soak_timeout + 120, cpus=cfg.host_cpus)
                else:
                    res = self.fio_runner(job.fio_job, device, cfg.runtime, cfg.size, cfg.ramp, output_path=raw,
                                          cpus=cfg.host_cpus)
            except NvmeofError as exc:  # fio could not run at all: record it, go on with the next job
                return report.repeat_record(repeat, iops=None, bw_bytes=None, lat_us={}, errors=1,
                                            error_text=exc.message, raw=rel, device=device)
            finally:
                if changes is not None:
                    changes.stop()
                sampler.stop()
                side_after = _side_reading(side)
            if multipath:  # what each worker's path carried: both must, or the figure is not scaling
                after = self.host.path_ios(device)
                extra_paths = {svc: after[svc] - paths_before.get(svc, 0) for svc in sorted(after)}
            # before the disconnect: the queues' figures go with them
            status = self._status(target)
            polling = self._polling(target, status)
            served = _served(target, status)
        finally:
            self.host.disconnect(target)
        extra = {}
        if polling is not None:
            extra["polling"] = polling
        if served is not None:
            extra["served"] = served
        errors, error_text = res.errors, res.error_text
        if multipath:
            extra["paths"] = extra_paths
            idle = [svc for svc in target.trsvcids if not extra_paths.get(str(svc))]
            if idle:  # the host sent nothing down a path: the figure would not be the workers' scaling
                errors += 1
                error_text = "; ".join(filter(None, [error_text, f"path(s) {', '.join(map(str, idle))} carried "
                                                     f"no I/O (per-path counts {extra_paths}): is iopolicy "
                                                     f"round-robin?"]))
        samples = sampler.samples
        fio_ios = sum(s.total_ios for s in res.directions.values() if s.total_ios) if res.directions else 0
        ios, source = _window_ios(samples, fio_ios, 0.0 if soak else cfg.ramp)
        extra["cpu"] = procstat.cpu_cost(samples[0], samples[-1], ios, source)
        if side:
            extra["cpu"]["side"] = side_cost(side_before, side_after, ios, samples[-1].t - samples[0].t)
        extra["memory"] = procstat.memory(samples)
        if soak:
            extra["soak"] = self._soak_record(samples, fio_ios, target, res, changes)
        return report.repeat_record(
            repeat, iops=res.iops, bw_bytes=res.bw_bytes, lat_us=res.clat_us, lat_mean_us=res.lat_mean_us,
            errors=errors, error_text=error_text, raw=rel, device=device, headline=res.report,
            directions={d: {"iops": s.iops, "bw_bytes": s.bw_bytes, "lat_us": s.clat_us}
                        for d, s in res.directions.items() if s.total_ios}, **extra)

    def _status(self, target: TargetUnderTest) -> Optional[dict]:
        """The target's `target status --json` answer ({"error": ...} when it gave none), None without a socket."""
        if not target.rpc_socket:
            return None
        try:
            return self.status_call(target.rpc_socket, "nvmeof_get_status", {}, timeout=10.0)
        except (RpcError, OSError, NvmeofError) as exc:
            return {"error": f"target status: {exc}"}

    def _polling(self, target: TargetUnderTest, status: Optional[dict] = None) -> Optional[dict]:
        """How the target's native I/O queues were polled since the host connected (queue_polling), or None."""
        if status is None:
            status = self._status(target)
        if status is None:
            return None
        if "error" in status and "subsystems" not in status:
            return {"error": status["error"]}
        return queue_polling(status, target.subnqn)

    def _one_direct(self, job: JobSpec, target: TargetUnderTest, repeat: int, raw: Path, rel: str) -> dict:
        """A job on a target that is no target (bench/rbd.py FioRbdTarget: fio's own rbd engine): fio runs the job
        as the target turns it (`direct_job`), with its environment (`fio_env`); no host connects, and only the
        guest's CPU (and the side processes', the Ceph daemons') says what it cost."""
        cfg = self.config
        side = _side_processes(target)
        sampler = procstat.Sampler(None, interval=MEMORY_INTERVAL)
        try:
            fio_job = target.direct_job(job.fio_job, self.raw_dir / target.name)
            sampler.start()
            side_before = _side_reading(side)
            try:
                res = self.fio_runner(fio_job, target.device_label, cfg.runtime, cfg.size, cfg.ramp, output_path=raw,
                                      extra_env=target.fio_env(), cpus=cfg.host_cpus)
            finally:
                sampler.stop()
                side_after = _side_reading(side)
        except NvmeofError as exc:
            return report.repeat_record(repeat, iops=None, bw_bytes=None, lat_us={}, errors=1, error_text=exc.message,
                                        raw=rel)
        samples = sampler.samples
        ios = sum(s.total_ios for s in res.directions.values() if s.total_ios) if res.directions else 0
        source = "fio's count" + (" (its ramp excluded, so µs per I/O is a little high)" if cfg.ramp else "")
        cpu = procstat.cpu_cost(samples[0], samples[-1], ios or None, source if ios else "")
        if side:
            cpu["side"] = side_cost(side_before, side_after, ios or None, samples[-1].t - samples[0].t)
        return report.repeat_record(
            repeat, iops=res.iops, bw_bytes=res.bw_bytes, lat_us=res.clat_us, lat_mean_us=res.lat_mean_us,
            errors=res.errors, error_text=res.error_text, raw=rel, device=target.device_label, headline=res.report,
            directions={d: {"iops": s.iops, "bw_bytes": s.bw_bytes, "lat_us": s.clat_us}
                        for d, s in res.directions.items() if s.total_ios}, cpu=cpu)

    def _soak_prefill(self, device: str, target: TargetUnderTest) -> Optional[str]:
        """Write the soak's region once, sequentially, before anything is sampled: the RAM namespace's pages
        are then all resident, so neither their first touch nor the kernel's later merging of them into huge
        pages (khugepaged fills a 2 MiB range that has a page in use) shows as growth per command."""
        job = self.prefill_job
        if job is None:
            return None
        self.progress(f"bench: soak on {target.name}: writing the {self.config.size} region once first")
        raw = self.raw_dir / f"soak-prefill.{target.name}.json"
        try:
            res = self.fio_runner(job, device, self.config.soak_timeout, self.config.size, 0, output_path=raw,
                                  timeout=self.config.soak_timeout + 120)
        except NvmeofError as exc:
            return f"the soak's prefill failed: {exc.message}"
        return f"the soak's prefill failed: {res.error_text}" if res.errors else None

    def _soak_record(self, samples: List[procstat.Sample], fio_ios: int, target: TargetUnderTest,
                     res: FioResult, changes: Optional[LiveChanges]) -> dict:
        cfg = self.config
        skip = cfg.soak_skip if cfg.soak_skip is not None else cfg.soak_ios // 10
        if not _counted(samples) and fio_ios and len(samples) >= 2:
            # the block device keeps no statistics here: spread fio's count over the run's time
            t0, t1 = samples[0].t, samples[-1].t
            for s in samples:
                s.ios = round(fio_ios * (s.t - t0) / (t1 - t0)) if t1 > t0 else 0
            source = "fio's count spread evenly over time"
        else:
            source = "block device statistics"
        notes = [] if target.pid else ["no target process: RSS not measured (the kernel target)"]
        if changes is None:
            notes.append("no live changes: " + ("--soak-change-interval 0" if cfg.soak_change_interval <= 0 else
                                                "this target has no control socket"))
        # fio counts a verify failure as an error and goes on (continue_on_error=verify in the job file)
        rec = {"commands_requested": cfg.soak_ios, "commands_done": fio_ios, "interval_s": cfg.soak_interval,
               "commands_source": source, "rss": None, "verify_errors": res.errors,
               "verify_error_text": res.error_text,
               "live_changes": changes.record() if changes is not None else None,
               "note": "; ".join(notes) or None}
        if target.pid or any(s.rss_bytes for s in samples):
            fitted = samples
            if changes is not None:  # the scratch namespace's own memory comes and goes: fit between its lives
                fitted = [s for s in samples if changes.absent_at(s.t)]
            rec["rss"] = procstat.rss_growth(fitted, skip_commands=skip)
            if rec["rss"] is not None and changes is not None:
                rec["rss"]["fitted_on"] = (f"{len(fitted)} of {len(samples)} samples, those taken while the scratch "
                                           f"namespace was out")
        return rec


def _side_processes(target: TargetUnderTest) -> Dict[str, int]:
    """Processes that serve the target without being it (bench/rbd.py: the Ceph daemons), sampled on their own:
    {name: pid}, empty for most targets."""
    fn = getattr(target, "side_processes", None)
    return dict(fn()) if callable(fn) else {}


def _side_reading(side: Dict[str, int]) -> Dict[str, procstat.ProcessCpu]:
    return {name: c for name, pid in side.items() if (c := procstat.process_cpu(pid)) is not None}


def side_cost(before: Dict[str, procstat.ProcessCpu], after: Dict[str, procstat.ProcessCpu], ios: Optional[int],
              wall: float, clk_tck: int = procstat.CLK_TCK) -> Dict[str, dict]:
    """{name: {"cpu_s", "us_per_io", "cpu_percent"}} of each side process between two readings."""
    out = {}
    for name, b in before.items():
        a = after.get(name)
        if a is None:
            continue
        secs = (a.utime_ticks - b.utime_ticks + a.stime_ticks - b.stime_ticks) / clk_tck
        out[name] = {"cpu_s": round(secs, 3), "us_per_io": round(secs * 1e6 / ios, 1) if ios else None,
                     "cpu_percent": round(100.0 * secs / wall, 1) if wall > 0 else None}
    return out


def _served(target: TargetUnderTest, status: Optional[dict]) -> Optional[dict]:
    """Which data path served the target's namespace (bench/rbd.py served_by), for targets that say."""
    fn = getattr(target, "served_by", None)
    if not callable(fn) or status is None:
        return None
    if "subsystems" not in status:
        return {"error": status.get("error", "no status")}
    return fn(status)


def _counted(samples: Sequence[procstat.Sample]) -> bool:
    """The block device counted the I/Os of this window (its statistics may be off or missing)."""
    return (len(samples) >= 2 and samples[0].ios is not None and samples[-1].ios is not None
            and samples[-1].ios > samples[0].ios)


def _window_ios(samples: Sequence[procstat.Sample], fio_ios: int, ramp: float = 0.0):
    """The I/Os completed between the first and last sample, and where the count came from."""
    if _counted(samples):
        return samples[-1].ios - samples[0].ios, "block device statistics"
    if fio_ios:
        return fio_ios, ("fio's count" + (" (its ramp excluded, so µs per I/O is a little high)" if ramp else ""))
    return None, ""


def _summary(rec: dict) -> str:
    lat = rec.get("lat_us") or {}
    text = (f"{report.fmt_iops(rec.get('iops'))} IOPS, {report.fmt_mbps(rec.get('bw_bytes'))} MB/s, "
            f"p50 {report.fmt_lat(lat.get('p50'))}, p99 {report.fmt_lat(lat.get('p99'))}")
    cpu = rec.get("cpu") or {}
    if cpu.get("target_us_per_io") is not None:
        text += f", target CPU {cpu['target_us_per_io']:.0f} µs/IO"
    if cpu.get("guest_us_per_io") is not None:
        text += f", guest CPU {cpu['guest_us_per_io']:.0f} µs/IO"
    polling = rec.get("polling") or {}
    ios = cpu.get("ios")
    if polling.get("polls") is not None and ios:
        text += (f", polled {polling['mode']}: {polling['spin_hits'] / ios:.2f} spin hits and "
                 f"{polling['arms'] / ios:.2f} arms per I/O")
    memory = rec.get("memory") or {}
    if memory.get("rss_end_bytes") is not None:
        text += (f", target RSS {report.fmt_bytes(memory['rss_end_bytes'])} at the end "
                 f"(peak {report.fmt_bytes(memory['rss_peak_bytes'])})")
    soak = rec.get("soak") or {}
    growth = (soak.get("rss") or {}).get("growth_bytes_per_million")
    if growth is not None:
        text += f", RSS {report.fmt_bytes(growth)} per million commands"
    if soak:
        text += f", {soak.get('verify_errors')} verify error(s)"
    changes = soak.get("live_changes") or {}
    if changes:
        text += (f", {changes['made']} live changes ({changes['refused']} refused), loop's longest pass "
                 f"{changes['loop_longest_pass_ms']} ms")
    if rec.get("errors"):
        text += f", {rec['errors']} error(s): {rec.get('error_text')}"
    return text


__all__ = ["BenchConfig", "BenchRunner", "JobSpec", "available_jobs", "select_jobs", "qd_sweep_jobs", "machine_info",
           "initiator_perf_command", "INITIATOR_PERF_JOBS"]
