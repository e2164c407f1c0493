"""What a job costs: CPU time from /proc, resident memory, I/Os completed, and a straight-line fit.

Sources (proc(5), the kernel's Documentation/block/stat.rst):
- `/proc/PID/stat`: the userspace target's utime (field 14) and stime (field 15) in clock ticks;
- `/proc/PID/status`: its `VmRSS` (resident set, kB) and `VmHWM` (the resident set's peak since the process
  started);
- `/proc/stat`: the `cpu` line, the whole machine's time in ticks per state. The kernel target has no process
  (it runs in softirq and kworkers), so for it only the guest's total busy time says what a job cost; that
  total includes fio and the kernel host, on every target alike;
- `/sys/block/DEV/stat`: read and write I/Os completed on the kernel host's block device: the exact number
  of commands in a sampling window (fio's own count leaves out its ramp, the CPU window does not);
- `/proc/PID/task/*/schedstat` and `/proc/schedstat` (the kernel's Documentation/scheduler/sched-stats.rst): the
  target's threads' time on a CPU, their run delay (runnable, waiting for a CPU: a wake-up's latency, which under
  a hypervisor that does not run the vCPU includes the host's delay) and their timeslices (one per wake-up of a
  sleeping thread); the whole guest's run delay per CPU. Where the target's time goes under load, not only how much.

A `Sample` is one reading of all of them at one moment; `cpu_cost()` turns two samples into seconds and
µs per I/O; `memory()` says what the target held during a job (its RSS at the end, the highest of the job's
samples, the process's peak); `rss_growth()` fits RSS against commands completed (least squares) for the soak job.
"""
from __future__ import annotations

import glob
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# --- parsers (text in, numbers out: unit-tested on real captures) -----------------------------------

@dataclass(frozen=True)
class ProcessCpu:
    utime_ticks: int
    stime_ticks: int


def parse_pid_stat(text: str) -> ProcessCpu:
    """utime and stime of /proc/PID/stat. The command name (field 2) is in parentheses and may itself
    contain spaces or ')', so the fields are counted from the last ')'."""
    end = text.rfind(")")
    if end < 0:
        raise ValueError("not a /proc/PID/stat line (no ')' after the command name)")
    rest = text[end + 1:].split()
    # rest[0] is field 3 (state): field N is rest[N - 3]
    if len(rest) < 13:
        raise ValueError(f"/proc/PID/stat has {len(rest) + 2} fields, expected at least 15")
    return ProcessCpu(utime_ticks=int(rest[14 - 3]), stime_ticks=int(rest[15 - 3]))


def parse_vmrss(text: str, field: str = "VmRSS") -> int:
    """VmRSS (or another Vm* `field`, e.g. VmHWM) of /proc/PID/status, in bytes."""
    for line in text.splitlines():
        if line.startswith(field + ":"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                unit = parts[2].lower() if len(parts) > 2 else "kb"
                return int(parts[1]) * (1024 if unit == "kb" else 1)
    raise ValueError(f"no {field} line in /proc/PID/status (a kernel thread, or the process is a zombie)")


@dataclass(frozen=True)
class SystemCpu:
    busy_ticks: int  # user + nice + system + irq + softirq + steal (guest time is already in user)
    idle_ticks: int  # idle + iowait
    softirq_ticks: int = 0  # of busy_ticks: softirq (rxe's receive path and completions run there)

    @property
    def total_ticks(self) -> int:
        return self.busy_ticks + self.idle_ticks


def parse_proc_stat(text: str) -> SystemCpu:
    """The aggregate `cpu` line of /proc/stat (every CPU summed)."""
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            v = [int(x) for x in parts[1:]] + [0] * 8
            user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
            return SystemCpu(busy_ticks=user + nice + system + irq + softirq + steal, idle_ticks=idle + iowait,
                             softirq_ticks=softirq)
    raise ValueError("no aggregate 'cpu' line in /proc/stat")


@dataclass(frozen=True)
class SchedStat:
    on_cpu_ns: int  # time on a CPU
    run_delay_ns: int  # time runnable, waiting for a CPU
    timeslices: int  # times it was put on a CPU


def parse_task_schedstat(text: str) -> SchedStat:
    """/proc/PID/task/TID/schedstat: on-CPU ns, run-delay ns, timeslices."""
    fields = text.split()
    if len(fields) < 3:
        raise ValueError(f"/proc/PID/schedstat has {len(fields)} fields, expected 3")
    return SchedStat(int(fields[0]), int(fields[1]), int(fields[2]))


def parse_proc_schedstat(text: str) -> SchedStat:
    """/proc/schedstat (version 15 and later): every CPU's running ns, run-delay ns and timeslices, summed (the
    7th to 9th numbers of each cpuN line)."""
    lines = text.splitlines()
    version = next((line.split()[1] for line in lines if line.startswith("version ")), None)
    if version is None or not version.isdigit() or int(version) < 15:
        raise ValueError(f"/proc/schedstat version {version}: expected 15 or later")
    total = [0, 0, 0]
    for line in lines:
        parts = line.split()
        if parts and re.fullmatch(r"cpu\d+", parts[0]) and len(parts) >= 10:
            for i in range(3):
                total[i] += int(parts[7 + i])
    return SchedStat(*total)


def parse_block_stat(text: str) -> int:
    """Read plus write I/Os completed, from /sys/block/DEV/stat (fields 1 and 5)."""
    fields = text.split()
    if len(fields) < 11:
        raise ValueError(f"/sys/block/DEV/stat has {len(fields)} fields, expected at least 11")
    return int(fields[0]) + int(fields[4])


# --- readers --------------------------------------------------------------------------------------------

def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _parsed(path: str, parse):
    """`parse` of a file's text; None where the file cannot be read or does not parse (a thread that ended, a
    kernel without that file)."""
    text = _read(path)
    try:
        return parse(text) if text else None
    except ValueError:
        return None


def process_cpu(pid: int, proc: str = "/proc") -> Optional[ProcessCpu]:
    text = _read(f"{proc}/{pid}/stat")
    return parse_pid_stat(text) if text else None


def process_rss(pid: int, proc: str = "/proc", field: str = "VmRSS") -> Optional[int]:
    text = _read(f"{proc}/{pid}/status")
    try:
        return parse_vmrss(text, field) if text else None
    except ValueError:
        return None


def process_memory(pid: int, proc: str = "/proc") -> Tuple[Optional[int], Optional[int]]:
    """(VmRSS, VmHWM) of one reading of /proc/PID/status.  The kernel updates the high-water mark lazily (not at
    every page fault), so it may lag the resident set: the peak is taken as the larger of the two."""
    text = _read(f"{proc}/{pid}/status")
    try:
        rss = parse_vmrss(text) if text else None
    except ValueError:
        return None, None
    try:
        hwm = parse_vmrss(text, "VmHWM")
    except ValueError:
        hwm = None
    return rss, max(rss, hwm) if hwm is not None else None


def process_sched(pid: int, proc: str = "/proc") -> Optional[SchedStat]:
    """Every thread's schedstat of a process, summed (None where the kernel keeps none)."""
    total, seen = [0, 0, 0], False
    for path in glob.glob(f"{proc}/{pid}/task/*/schedstat"):
        one = _parsed(path, parse_task_schedstat)
        if one is not None:
            seen = True
            total = [total[0] + one.on_cpu_ns, total[1] + one.run_delay_ns, total[2] + one.timeslices]
    return SchedStat(*total) if seen else None


def system_sched(proc: str = "/proc") -> Optional[SchedStat]:
    return _parsed(f"{proc}/schedstat", parse_proc_schedstat)


def system_cpu(proc: str = "/proc") -> Optional[SystemCpu]:
    text = _read(f"{proc}/stat")
    return parse_proc_stat(text) if text else None


def stat_files(device: str, sysfs: str = "/sys") -> List[str]:
    """The /sys/block/*/stat files that count a device's I/Os. A native-multipath head (nvmeXnY) is counted by
    its paths (nvmeXcCnY, hidden disks that do the requests): heads keep no statistics before Linux 6.3."""
    name = Path(device).name
    m = re.fullmatch(r"nvme(\d+)n(\d+)", name)
    if m:
        paths = sorted(glob.glob(f"{sysfs}/block/nvme{m.group(1)}c*n{m.group(2)}/stat"))
        if paths:
            return paths
    return [f"{sysfs}/block/{name}/stat"]


def block_device_ios(device: str, sysfs: str = "/sys") -> Optional[int]:
    """I/Os completed on a block device (/dev/nvme0n1: its multipath paths, or /sys/block/nvme0n1/stat),
    None if unknown."""
    total = None
    for path in stat_files(device, sysfs):
        n = _parsed(path, parse_block_stat)
        if n is not None:
            total = (total or 0) + n
    return total


@dataclass
class Sample:
    t: float  # time.monotonic()
    pid_cpu: Optional[ProcessCpu] = None
    rss_bytes: Optional[int] = None
    hwm_bytes: Optional[int] = None  # VmHWM: the resident set's peak since the process started
    system: Optional[SystemCpu] = None
    ios: Optional[int] = None
    procs: Optional[Dict[str, ProcessCpu]] = None  # each process of a target (a supervisor and its workers)
    sched: Optional[SchedStat] = None  # the target process's threads' schedstat, summed
    system_sched: Optional[SchedStat] = None  # every CPU's (/proc/schedstat)
    unix: float = 0.0  # time.time(): to line a job up with what was measured outside the guest


def take_sample(pid: Optional[int], io_counter: Optional[Callable[[], Optional[int]]] = None,
                processes: Optional[Dict[str, int]] = None) -> Sample:
    """One reading. With `processes` ({name: pid}), each is read and the target's CPU (`pid_cpu`) is their
    sum: a target served by several processes costs what all of them spent."""
    procs = None
    pid_cpu = process_cpu(pid) if pid else None
    if processes:
        procs = {name: c for name, p in processes.items() if (c := process_cpu(p)) is not None}
        pid_cpu = ProcessCpu(sum(c.utime_ticks for c in procs.values()),
                             sum(c.stime_ticks for c in procs.values())) if procs else None
    rss, hwm = process_memory(pid) if pid else (None, None)
    return Sample(t=time.monotonic(), pid_cpu=pid_cpu, rss_bytes=rss, hwm_bytes=hwm,
                  system=system_cpu(), ios=io_counter() if io_counter else None, procs=procs,
                  sched=process_sched(pid) if pid else None, system_sched=system_sched(), unix=time.time())


# --- what two samples say ---------------------------------------------------------------------------------

def cpu_cost(before: Sample, after: Sample, ios: Optional[int], ios_source: str = "",
             clk_tck: int = CLK_TCK) -> dict:
    """The JSON record of a job's CPU cost between two samples.

    target_*: the userspace target process (None for a target without one); guest_*: the whole machine
    (every CPU, every process, the kernel). µs per I/O are None when no I/O completed. The schedstat figures
    (target_run_delay_us_per_io, target_wakeups_per_io: timeslices; guest_run_delay_us_per_io) and the guest's
    softirq time per I/O say where the time went (docs/native.md, "A loaded host")."""
    wall = after.t - before.t
    out: Dict[str, object] = {"wall_s": round(wall, 3), "start_unix": round(before.unix, 1), "ios": ios,
                              "ios_source": ios_source,
                              "target_user_s": None, "target_system_s": None, "target_cpu_s": None,
                              "target_us_per_io": None, "target_cpu_percent": None,
                              "guest_busy_s": None, "guest_us_per_io": None, "guest_busy_percent": None}
    per_io = (lambda secs: secs * 1e6 / ios) if ios else (lambda secs: None)
    if before.pid_cpu and after.pid_cpu:
        user = (after.pid_cpu.utime_ticks - before.pid_cpu.utime_ticks) / clk_tck
        system = (after.pid_cpu.stime_ticks - before.pid_cpu.stime_ticks) / clk_tck
        out.update(target_user_s=round(user, 3), target_system_s=round(system, 3),
                   target_cpu_s=round(user + system, 3), target_us_per_io=_round(per_io(user + system)),
                   target_cpu_percent=_round(100.0 * (user + system) / wall) if wall > 0 else None)
    if before.system and after.system:
        busy = (after.system.busy_ticks - before.system.busy_ticks) / clk_tck
        total = (after.system.total_ticks - before.system.total_ticks) / clk_tck
        out.update(guest_busy_s=round(busy, 3), guest_us_per_io=_round(per_io(busy)),
                   guest_busy_percent=_round(100.0 * busy / total) if total > 0 else None)
    if before.system and after.system:
        softirq = (after.system.softirq_ticks - before.system.softirq_ticks) / clk_tck
        out["guest_softirq_us_per_io"] = _round(per_io(softirq))
    if before.sched and after.sched:
        out["target_run_delay_us_per_io"] = _round(per_io((after.sched.run_delay_ns - before.sched.run_delay_ns) / 1e9))
        out["target_on_cpu_us_per_io"] = _round(per_io((after.sched.on_cpu_ns - before.sched.on_cpu_ns) / 1e9))
        out["target_wakeups_per_io"] = _round((after.sched.timeslices - before.sched.timeslices) / ios, 2) \
            if ios else None
    if before.system_sched and after.system_sched:
        out["guest_run_delay_us_per_io"] = _round(per_io(
            (after.system_sched.run_delay_ns - before.system_sched.run_delay_ns) / 1e9))
    if before.procs and after.procs:  # per process: is each worker busy (100 % is its one core)?
        out["processes"] = {}
        for name in before.procs:
            if name not in after.procs:
                continue  # it died (and was restarted under another pid) in the window
            b, a = before.procs[name], after.procs[name]
            user, system = (a.utime_ticks - b.utime_ticks) / clk_tck, (a.stime_ticks - b.stime_ticks) / clk_tck
            out["processes"][name] = {"user_s": round(user, 3), "system_s": round(system, 3),
                                      "cpu_percent": _round(100.0 * (user + system) / wall) if wall > 0 else None}
    return out


def _round(v: Optional[float], digits: int = 1) -> Optional[float]:
    return None if v is None else round(v, digits)


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> Tuple[float, float, Optional[float]]:
    """Least-squares y = slope * x + intercept; returns (slope, intercept, r²) (r² None when y is flat)."""
    n = len(xs)
    if n != len(ys) or n < 2:
        raise ValueError("a line needs at least two points")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("every point has the same x: no slope")
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    slope = sxy / sxx
    intercept = my - slope * mx
    syy = sum((y - my) ** 2 for y in ys)
    r2 = None if syy == 0 else 1.0 - sum((y - (slope * x + intercept)) ** 2 for x, y in zip(xs, ys)) / syy
    return slope, intercept, r2


def memory(samples: Sequence[Sample]) -> Optional[dict]:
    """The target's resident memory over a job's samples: `rss_end_bytes` (the last sample's VmRSS),
    `rss_peak_bytes` (the highest VmRSS sampled during the job: a peak between two samples is missed) and
    `hwm_bytes` (the process's own peak since it started, every job before included: VmHWM, or a sampled RSS
    above it, the kernel updating the mark lazily).
    None without a process (the kernel target)."""
    rss = [s.rss_bytes for s in samples if s.rss_bytes is not None]
    if not rss:
        return None
    hwm = [s.hwm_bytes for s in samples if s.hwm_bytes is not None]
    return {"rss_end_bytes": rss[-1], "rss_peak_bytes": max(rss), "hwm_bytes": max(hwm + rss) if hwm else None,
            "samples": len(rss)}


def rss_growth(samples: Sequence[Sample], skip_commands: int = 0) -> Optional[dict]:
    """RSS growth per million commands: the slope of RSS against commands completed, by least squares.

    `skip_commands`: leave out the samples before this many commands (the warm-up, where the pools and
    caches fill once). The points themselves are kept (`points`: [commands, RSS bytes]) for the plot."""
    pts = [(s.ios, s.rss_bytes) for s in samples if s.ios is not None and s.rss_bytes is not None]
    if not pts:
        return None
    base = pts[0][0]
    points = [[ios - base, rss] for ios, rss in pts]
    fitted = [p for p in points if p[0] >= skip_commands]
    out = {"points": points, "samples": len(points), "skip_commands": skip_commands,
           "commands": points[-1][0], "rss_start_bytes": points[0][1], "rss_end_bytes": points[-1][1],
           "rss_max_bytes": max(p[1] for p in points), "growth_bytes_per_million": None, "r2": None}
    try:
        slope, _, r2 = linear_fit([p[0] for p in fitted], [p[1] for p in fitted])
    except ValueError:
        return out
    out["growth_bytes_per_million"] = round(slope * 1e6)
    out["r2"] = None if r2 is None else round(r2, 4)
    return out


class Sampler:
    """Samples in the background every `interval` seconds (for the soak's RSS curve), plus on demand."""

    def __init__(self, pid: Optional[int], io_counter: Optional[Callable[[], Optional[int]]] = None,
                 interval: float = 2.0, processes: Optional[Dict[str, int]] = None,
                 on_sample: Optional[Callable[["Sample"], None]] = None):
        self.pid = pid
        self.processes = processes
        self.io_counter = io_counter
        self.interval = interval
        self.on_sample = on_sample  # told of every background sample (the soak's progress line)
        self.samples: List[Sample] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def sample(self) -> Sample:
        s = take_sample(self.pid, self.io_counter, self.processes)
        self.samples.append(s)
        return s

    def start(self) -> "Sampler":
        self.sample()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            s = self.sample()
            if self.on_sample is not None:
                self.on_sample(s)

    def stop(self) -> Sample:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.sample()


__all__ = ["ProcessCpu", "SystemCpu", "SchedStat", "Sample", "parse_task_schedstat", "parse_proc_schedstat",
           "Sampler", "parse_pid_stat", "parse_vmrss", "parse_proc_stat",
           "parse_block_stat", "cpu_cost", "linear_fit", "memory", "rss_growth", "block_device_ios", "take_sample"]
