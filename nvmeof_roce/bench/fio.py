"""fio: run one job file with its environment and parse fio's JSON output.

The job files in `fio-jobs/` read four fio environment variables: `${DEVICE}` (a block device or a plain
file), `${RUNTIME}` and `${RAMP}` (seconds) and `${SIZE}` (the region exercised, e.g. `256M`). Their leading
comment block carries two keys this module reads::

    ; description: 4 KiB random read, queue depth 1: latency
    ; report: read            (read | write | mixed | auto: which of fio's sections is the headline)

A `FioResult` holds the headline numbers the report compares (IOPS, bandwidth in bytes/s, completion-latency
percentiles in µs, error count) and every direction fio reported, for the JSON file.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Union

from .. import shipped
from ..errors import NvmeofError, ToolMissing

log = logging.getLogger(__name__)

# The percentiles every job file asks for (percentile_list=50:90:99:99.9), and their names in results.
PERCENTILES = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("p99.9", 99.9))
REPORT_KINDS = ("read", "write", "mixed", "auto")
DIRECTIONS = ("read", "write", "trim", "mixed")


def default_jobs_dir() -> Path:
    """`fio-jobs/` of the checkout, or the copy an installed wheel carries (nvmeof_roce.shipped)."""
    return shipped("fio-jobs")


@dataclass(frozen=True)
class FioJobFile:
    """One job file from fio-jobs/, with the metadata of its leading comment block."""

    path: Path
    name: str
    description: str = ""
    report: str = "auto"

    @classmethod
    def load(cls, path: Union[str, Path]) -> "FioJobFile":
        path = Path(path).resolve()
        meta: Dict[str, str] = {}
        with open(path, encoding="utf-8") as f:
            for line in f:
                stripped = line.strip()
                if not stripped:
                    continue
                if not stripped.startswith((";", "#")):
                    break  # the metadata is the leading comment block only
                m = re.match(r"[;#]\s*([A-Za-z_]+)\s*:\s*(.*)$", stripped)
                if m:
                    meta[m.group(1).lower()] = m.group(2).strip()
        report = meta.get("report", "auto")
        if report not in REPORT_KINDS:
            raise NvmeofError(f"{path}: 'report: {report}' is not one of {', '.join(REPORT_KINDS)}",
                              "fix the job file's leading comment")
        return cls(path=path, name=path.stem, description=meta.get("description", ""), report=report)


def list_job_files(directory: Union[str, Path, None] = None) -> Dict[str, FioJobFile]:
    """Every `*.fio` in `directory` (default: the checkout's fio-jobs/), by name, sorted."""
    directory = Path(directory) if directory else default_jobs_dir()
    if not directory.is_dir():
        raise NvmeofError(f"fio job directory {directory} does not exist",
                          "run from a checkout of nvmeof-roce, or pass --jobs-dir")
    return {p.stem: FioJobFile.load(p) for p in sorted(directory.glob("*.fio"))}


@dataclass
class DirectionStats:
    """One of fio's read/write/trim/mixed sections."""

    iops: float
    bw_bytes: float
    io_bytes: int
    total_ios: int
    clat_us: Dict[str, Optional[float]]
    clat_mean_us: Optional[float]
    lat_mean_us: Optional[float]


@dataclass
class FioResult:
    """The headline numbers of one fio run, plus every direction fio reported."""

    job: str
    report: str  # which section the headline came from: read | write | mixed | read+write
    iops: float
    bw_bytes: float
    clat_us: Dict[str, Optional[float]]  # p50 p90 p99 p99.9, completion latency in µs
    lat_mean_us: Optional[float]
    errors: int
    error_text: str = ""
    runtime_ms: int = 0
    fio_version: str = ""
    directions: Dict[str, DirectionStats] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _us(ns) -> Optional[float]:
    return None if ns is None else float(ns) / 1000.0


def _percentiles(section: Mapping) -> Dict[str, Optional[float]]:
    got = (section.get("clat_ns") or {}).get("percentile") or {}
    by_value = {}
    for key, value in got.items():
        try:
            by_value[round(float(key), 3)] = value
        except ValueError:
            continue
    return {name: _us(by_value.get(round(p, 3))) for name, p in PERCENTILES}


def _direction(section: Mapping) -> DirectionStats:
    total_ios = int(section.get("total_ios", 0) or 0)
    clat = section.get("clat_ns") or {}
    lat = section.get("lat_ns") or {}
    return DirectionStats(
        iops=float(section.get("iops", 0.0) or 0.0),
        bw_bytes=float(section.get("bw_bytes", 0.0) or 0.0),
        io_bytes=int(section.get("io_bytes", 0) or 0),
        total_ios=total_ios,
        clat_us=_percentiles(section) if total_ios else {n: None for n, _ in PERCENTILES},
        clat_mean_us=_us(clat.get("mean")) if total_ios else None,
        lat_mean_us=_us(lat.get("mean")) if total_ios else None,
    )


def _json_document(text: str) -> dict:
    """fio may print notes ("fio: ...") before the JSON document, even with --output: skip them."""
    start = text.find("{")
    if start < 0:
        raise ValueError("no JSON object in fio's output")
    obj, _ = json.JSONDecoder().raw_decode(text[start:])
    return obj


def parse_fio_json(text: str, report: str = "auto", job: Optional[str] = None) -> FioResult:
    """Parse `fio --output-format=json` output into a FioResult.

    `report` picks the headline: `read`, `write`, `mixed` (the combined section of unified_rw_reporting=both,
    or read+write summed when fio did not write one), or `auto`: `mixed` when present, else the only
    direction that did I/O, else read+write with the latency of the busier direction.
    """
    if report not in REPORT_KINDS:
        raise ValueError(f"report must be one of {REPORT_KINDS}")
    try:
        doc = _json_document(text)
        jobs = doc["jobs"]
    except (ValueError, KeyError, TypeError) as exc:
        raise NvmeofError(f"fio's output is not fio JSON ({exc})",
                          "run fio with --output-format=json; see the raw output kept next to the results") from exc
    if not jobs:
        raise NvmeofError("fio's JSON output has no jobs", "check the job file")
    # The job files run one job with group_reporting; if there are several, the first carries the group.
    j = jobs[0]
    dirs = {d: _direction(j[d]) for d in DIRECTIONS if isinstance(j.get(d), Mapping)}
    active = [d for d in ("read", "write", "trim") if d in dirs and dirs[d].total_ios]

    chosen = report
    if report == "auto":
        if "mixed" in dirs and dirs["mixed"].total_ios:
            chosen = "mixed"
        elif len(active) == 1:
            chosen = active[0]
        else:
            chosen = "read+write"
    elif report == "mixed" and not ("mixed" in dirs and dirs["mixed"].total_ios):
        chosen = "read+write"

    if chosen == "read+write":
        parts = [dirs[d] for d in ("read", "write") if d in dirs]
        busiest = max(parts, key=lambda s: s.total_ios) if parts else None
        iops = sum(s.iops for s in parts)
        bw = sum(s.bw_bytes for s in parts)
        clat = dict(busiest.clat_us) if busiest else {n: None for n, _ in PERCENTILES}
        lat_mean = busiest.lat_mean_us if busiest else None
    else:
        head = dirs.get(chosen)
        if head is None:
            raise NvmeofError(f"fio's JSON output has no '{chosen}' section", "check the job file's 'report:' key")
        iops, bw, clat, lat_mean = head.iops, head.bw_bytes, dict(head.clat_us), head.lat_mean_us

    err = int(j.get("error", 0) or 0)
    total_err = int(j.get("total_err", 0) or 0)  # counted when continue_on_error is set
    errors = total_err if total_err else (1 if err else 0)
    error_text = _fio_error_text(err) if err else ""
    return FioResult(
        job=job or str(j.get("jobname", "")),
        report=chosen,
        iops=iops,
        bw_bytes=bw,
        clat_us=clat,
        lat_mean_us=lat_mean,
        errors=errors,
        error_text=error_text,
        runtime_ms=int(j.get("job_runtime", 0) or 0),
        fio_version=str(doc.get("fio version", "")),
        directions=dirs,
    )


def _fio_error_text(err: int) -> str:
    if err == errno.EILSEQ:  # what fio sets when a verify read does not match what was written
        return f"data verification failed (fio error {err}, EILSEQ)"
    return f"fio error {err} ({errno.errorcode.get(err, '?')}: {os.strerror(err)})"


def fio_binary(fio: str = "fio") -> str:
    path = shutil.which(fio)
    if not path:
        raise ToolMissing(fio, "fio")
    return path


def fio_version(fio: str = "fio") -> str:
    try:
        out = subprocess.run([fio_binary(fio), "--version"], capture_output=True, text=True, timeout=10)
    except (NvmeofError, OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip()


def _stderr_summary(stderr: str, limit: int = 6) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    return "; ".join(lines[-limit:])


def pinned_to(cpus: Optional[Sequence[int]]) -> Optional[Callable[[], None]]:
    """A child's preexec_fn that runs it on `cpus` only (None: where the bench itself may run)."""
    if not cpus:
        return None
    allowed = set(cpus)
    return lambda: os.sched_setaffinity(0, allowed)


def run_fio(job: Union[FioJobFile, str, Path], device: str, runtime: float, size: str, ramp: float = 0,
            *, output_path: Union[str, Path, None] = None, fio: str = "fio",
            extra_env: Optional[Mapping[str, str]] = None, timeout: Optional[float] = None,
            cpus: Optional[Sequence[int]] = None) -> FioResult:
    """Run one job file against `device` and return its parsed result.

    The raw JSON is written to `output_path` (kept with the results) or a temporary file. An I/O or verify
    error inside the run is reported in the result (`errors`, `error_text`), not raised; a run that produced
    no JSON at all (fio could not start, a bad job file, a timeout) raises NvmeofError. `cpus` pins fio
    (`bench --host-cpus`).
    """
    if not isinstance(job, FioJobFile):
        job = FioJobFile.load(job)
    binary = fio_binary(fio)
    env = dict(os.environ)
    env.update({"DEVICE": str(device), "RUNTIME": _num(runtime), "RAMP": _num(ramp), "SIZE": str(size)})
    if extra_env:
        env.update(extra_env)
    if timeout is None:
        timeout = 2 * (float(runtime) + float(ramp)) + 120

    tmpdir = None
    if output_path is None:
        tmpdir = tempfile.mkdtemp(prefix="nvmeof-fio-")
        output_path = Path(tmpdir) / f"{job.name}.json"
    output_path = Path(output_path).resolve()
    output_path.parent.mkdir(parents=True, exist_ok=True)
    if output_path.exists():
        output_path.unlink()
    cmd = [binary, "--output-format=json", f"--output={output_path}", str(job.path)]
    log.info("running %s with DEVICE=%s RUNTIME=%s RAMP=%s SIZE=%s", " ".join(cmd), device, runtime, ramp, size)
    try:
        try:
            # cwd: fio may leave files behind (verify state, logs): next to the results, not wherever we are
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                                  cwd=str(output_path.parent), preexec_fn=pinned_to(cpus))
        except subprocess.TimeoutExpired as exc:
            raise NvmeofError(f"fio {job.name} on {device} did not finish within {timeout:.0f} s",
                              "check that the device still answers (dmesg), or raise --runtime limits") from exc
        text = output_path.read_text(encoding="utf-8", errors="replace") if output_path.exists() else ""
        if "{" not in text:
            # Older fio versions print the JSON on stdout whatever --output says.
            text = proc.stdout if "{" in proc.stdout else text
        failed = NvmeofError(
            f"fio {job.name} on {device} failed (exit {proc.returncode}): "
            f"{_stderr_summary(proc.stderr + proc.stdout) or _fio_notes(text) or 'no output'}",
            "check the device path and that it can be opened with O_DIRECT (tmpfs cannot)")
        if "{" not in text:
            raise failed
        try:
            result = parse_fio_json(text, report=job.report, job=job.name)
        except NvmeofError:
            raise failed from None  # fio prints its errors into the JSON document too
        if result.errors and not any(d.total_ios for d in result.directions.values()):
            raise failed  # not one I/O done: fio could not run the job at all
        if proc.returncode != 0:
            result.errors = max(result.errors, 1)
            result.error_text = "; ".join(
                t for t in (result.error_text, _stderr_summary(proc.stderr) or f"fio exit {proc.returncode}") if t)
        elif result.errors and proc.stderr.strip():
            result.error_text = "; ".join(t for t in (result.error_text, _stderr_summary(proc.stderr)) if t)
        return result
    finally:
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)


def _fio_notes(text: str) -> str:
    return "; ".join(ln.strip() for ln in text.splitlines() if ln.startswith("fio:"))[:500]


def _num(value: float) -> str:
    value = float(value)
    return str(int(value)) if value.is_integer() else f"{value:g}"


__all__: List[str] = ["FioJobFile", "FioResult", "DirectionStats", "PERCENTILES", "default_jobs_dir",
                      "list_job_files", "parse_fio_json", "run_fio", "fio_version", "fio_binary", "pinned_to"]
