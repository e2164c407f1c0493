"""The bench result: one JSON-ready dict, the side-by-side table, and the userspace/kernel ratio.

Schema `nvmeof-roce-bench/1` (docs/benchmarks.md has the full description)::

    {"schema", "date", "machine": {...}, "params": {...}, "targets": {name: {...}},
     "jobs": {job: {"kind", "description", "report",
                    "results": {target: {"repeats": [{"repeat", "iops", "bw_bytes", "lat_us": {p50 p90 p99 p99.9},
                                                      "lat_mean_us", "errors", "error_text", "raw"}],
                                         "median": {"iops", "bw_bytes", "lat_us": {...}}, "errors"}},
                    "ratio": {"numerator", "denominator", "iops", "bw_bytes", "p50", "p90", "p99", "p99.9"} | null}},
     "perftest": {test: {...} | {"error": "..."}},
     "errors": [...], "ok": bool}

Each repeat also carries `cpu` (procstat.cpu_cost: the userspace target process's user/system seconds and CPU
µs per I/O, the whole guest's busy seconds and µs per I/O), `memory` (procstat.memory: the target's
"rss_end_bytes", "rss_peak_bytes" sampled during the job, "hwm_bytes"; null for the kernel target), and a soak
repeat `soak` (its RSS samples and their growth per million commands, fio's verify errors, its live changes and
the event loop's longest pass); `median` then has `cpu` {"target_us_per_io", "guest_us_per_io",
"target_user_s", "target_system_s"}, `memory` {"rss_end_bytes", "rss_peak_bytes"} and
`rss_growth_bytes_per_million`.

A job measured on a multi-worker target (`userspace-Nw`: `target serve --workers N`, docs/multipath.md) has
`scaling`: [{"target", "workers", "single", "kernel", "iops_over_single", "iops_over_kernel",
"single_over_kernel"}], IOPS medians divided (the scaling figure of N workers over one, and both against the
kernel target); each repeat on it carries `paths` {trsvcid: I/Os the host sent down that path}, and every
userspace repeat's `cpu` carries `processes` {name: {"user_s", "system_s", "cpu_percent"}} (`target`, or
`supervisor` and `worker0`..), whose medians are in `median.processes`.

`bench --rbd` (bench/rbd.py) adds `params.rbd` (the image, the data path asked for) and `params.ratios` (more pairs
than `ratio`); each job then has `ratios`: [{"numerator", "denominator", "iops", "lat_mean_us", "p50", "p99",
"guest_us_per_io"}], each repeat `served` (our rbd namespace's data path, bench/rbd.py served_by) and `cpu.side`
({"ceph-osd", "ceph-mon": {"cpu_s", "us_per_io", "cpu_percent"}}), and `median` `lat_mean_us` and
`side_us_per_io`.

Medians are taken per metric across repeats (the median IOPS and the median p99 may come from different
repeats). A ratio is numerator/denominator of those medians: above 1 means more IOPS or bandwidth, or a
higher (worse) latency, for the numerator.
"""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

from ..errors import NvmeofError
from ..output import table

SCHEMA = "nvmeof-roce-bench/1"
LAT_KEYS = ("p50", "p90", "p99", "p99.9")
CPU_KEYS = ("target_us_per_io", "guest_us_per_io", "target_user_s", "target_system_s")
MEMORY_KEYS = ("rss_end_bytes", "rss_peak_bytes")
DEFAULT_RATIO = ("userspace", "kernel")
WORKERS_TARGET = re.compile(r"userspace-(\d+)w")  # bench --targets userspace-Nw: serve --workers N
SINGLE, KERNEL = "userspace", "kernel"  # what a multi-worker target is compared with


# --- building -------------------------------------------------------------------------------------

def new_result(*, date: str, machine: dict, params: dict, targets: Dict[str, dict],
               ratio: Sequence[str] = DEFAULT_RATIO, ratios: Sequence[Sequence[str]] = ()) -> dict:
    params = dict(params)
    params["ratio"] = list(ratio)
    if ratios:  # more pairs, each job's `ratios` (bench --rbd: ours over nvmet on krbd, ours over fio's rbd engine)
        params["ratios"] = [list(r) for r in ratios]
    return {"schema": SCHEMA, "date": date, "machine": machine, "params": params, "targets": targets,
            "jobs": {}, "perftest": {}, "errors": [], "ok": True}


def add_job(result: dict, name: str, *, kind: str, description: str = "", report: str = "") -> dict:
    job = result["jobs"].setdefault(name, {"kind": kind, "description": description, "report": report,
                                           "results": {}, "ratio": None})
    return job


def repeat_record(repeat: int, *, iops: Optional[float], bw_bytes: Optional[float], lat_us: Dict[str, Any],
                  lat_mean_us: Optional[float] = None, errors: int = 0, error_text: str = "",
                  raw: Optional[str] = None, **extra) -> dict:
    rec = {"repeat": repeat, "iops": iops, "bw_bytes": bw_bytes,
           "lat_us": {k: lat_us.get(k) for k in LAT_KEYS}, "lat_mean_us": lat_mean_us,
           "errors": int(errors), "error_text": error_text, "raw": raw}
    rec.update(extra)
    return rec


def add_repeat(result: dict, job: str, target: str, record: dict) -> None:
    if job not in result["jobs"]:
        add_job(result, job, kind="fio")
    slot = result["jobs"][job]["results"].setdefault(target, {"repeats": [], "median": None, "errors": 0})
    slot["repeats"].append(record)


def _median(values: Iterable[Optional[float]]) -> Optional[float]:
    vals = [float(v) for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or b == 0:
        return None
    return a / b


def finalize(result: dict) -> dict:
    """Medians per job and target, the ratio per job, and the overall `ok`."""
    num, den = (result["params"].get("ratio") or DEFAULT_RATIO)[:2]
    any_errors = bool(result["errors"])
    for job in result["jobs"].values():
        for slot in job["results"].values():
            reps = slot["repeats"]
            # a repeat with errors still counts in the medians: its numbers are real, its errors are reported
            slot["median"] = {
                "iops": _median(r.get("iops") for r in reps),
                "bw_bytes": _median(r.get("bw_bytes") for r in reps),
                "lat_us": {k: _median((r.get("lat_us") or {}).get(k) for r in reps) for k in LAT_KEYS},
                "lat_mean_us": _median(r.get("lat_mean_us") for r in reps),
            }
            sides = [n for r in reps for n in ((r.get("cpu") or {}).get("side") or {})]
            if sides:  # processes beside the target (bench --rbd: the Ceph daemons), µs per I/O
                slot["median"]["side_us_per_io"] = {
                    n: _median((((r.get("cpu") or {}).get("side") or {}).get(n) or {}).get("us_per_io") for r in reps)
                    for n in dict.fromkeys(sides)}
            if any(r.get("cpu") for r in reps):
                slot["median"]["cpu"] = {k: _median((r.get("cpu") or {}).get(k) for r in reps) for k in CPU_KEYS}
            names = [n for r in reps for n in ((r.get("cpu") or {}).get("processes") or {})]
            if names:
                slot["median"]["processes"] = {
                    n: {k: _median((((r.get("cpu") or {}).get("processes") or {}).get(n) or {}).get(k) for r in reps)
                        for k in ("user_s", "system_s", "cpu_percent")} for n in dict.fromkeys(names)}
            if any(r.get("paths") for r in reps):
                svcs = [svc for r in reps for svc in (r.get("paths") or {})]
                slot["median"]["paths"] = {svc: _median((r.get("paths") or {}).get(svc) for r in reps)
                                           for svc in dict.fromkeys(svcs)}
            if any(r.get("memory") for r in reps):
                slot["median"]["memory"] = {k: _median((r.get("memory") or {}).get(k) for r in reps)
                                            for k in MEMORY_KEYS}
            if any(r.get("soak") for r in reps):
                slot["median"]["rss_growth_bytes_per_million"] = _median(
                    ((r.get("soak") or {}).get("rss") or {}).get("growth_bytes_per_million") for r in reps)
            slot["errors"] = sum(int(r.get("errors") or 0) for r in reps)
            any_errors = any_errors or slot["errors"] > 0
        a, b = job["results"].get(num), job["results"].get(den)
        if a and b and a["median"] and b["median"]:
            ratio = {"numerator": num, "denominator": den,
                     "iops": _ratio(a["median"]["iops"], b["median"]["iops"]),
                     "bw_bytes": _ratio(a["median"]["bw_bytes"], b["median"]["bw_bytes"])}
            for k in LAT_KEYS:
                ratio[k] = _ratio(a["median"]["lat_us"][k], b["median"]["lat_us"][k])
            job["ratio"] = ratio
        else:
            job["ratio"] = None
        if result["params"].get("ratios"):
            job["ratios"] = [r for r in (pair_ratio(job, a, b) for a, b in result["params"]["ratios"]) if r]
        job["scaling"] = scaling(job) or None
    for p in result["perftest"].values():
        any_errors = any_errors or bool(p.get("error"))
    result["ok"] = not any_errors
    return result


def pair_ratio(job: dict, num: str, den: str) -> Optional[dict]:
    """num/den of a job's medians: IOPS, mean and p99 latency, and the guest's CPU per I/O; None when either
    target has no result."""
    a, b = (((job["results"].get(n) or {}).get("median")) for n in (num, den))
    if not a or not b:
        return None
    return {"numerator": num, "denominator": den, "iops": _ratio(a.get("iops"), b.get("iops")),
            "lat_mean_us": _ratio(a.get("lat_mean_us"), b.get("lat_mean_us")),
            "p50": _ratio(a["lat_us"].get("p50"), b["lat_us"].get("p50")),
            "p99": _ratio(a["lat_us"].get("p99"), b["lat_us"].get("p99")),
            "guest_us_per_io": _ratio((a.get("cpu") or {}).get("guest_us_per_io"),
                                      (b.get("cpu") or {}).get("guest_us_per_io"))}


def scaling(job: dict) -> List[dict]:
    """Each multi-worker target of a job against the single-process one and the kernel target (IOPS medians)."""
    def iops(name):
        return ((job["results"].get(name) or {}).get("median") or {}).get("iops")

    out = []
    for name in job["results"]:
        m = WORKERS_TARGET.fullmatch(name)
        if not m:
            continue
        out.append({"target": name, "workers": int(m.group(1)), "single": SINGLE, "kernel": KERNEL,
                    "iops_over_single": _ratio(iops(name), iops(SINGLE)),
                    "iops_over_kernel": _ratio(iops(name), iops(KERNEL)),
                    "single_over_kernel": _ratio(iops(SINGLE), iops(KERNEL))})
    return out


# --- files ----------------------------------------------------------------------------------------

def write_json(result: dict, path: Union[str, Path]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def load_json(path: Union[str, Path]) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / "bench.json"
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise NvmeofError(f"{path}: no such result file", "pass a bench.json (or its directory) written by a bench run")
    except ValueError as exc:
        raise NvmeofError(f"{path}: not JSON ({exc})", "pass a bench.json written by a bench run")
    if not isinstance(result, dict) or result.get("schema") != SCHEMA:
        raise NvmeofError(f"{path}: not a bench result (schema is not {SCHEMA})",
                          "pass a bench.json written by a bench run")
    return result


# --- formatting -----------------------------------------------------------------------------------

def fmt_iops(v: Optional[float]) -> str:
    if v is None:
        return "-"
    if v >= 1e6:
        return f"{v / 1e6:.2f}M"
    if v >= 1e4:
        return f"{v / 1e3:.1f}k"
    if v >= 1e3:
        return f"{v / 1e3:.2f}k"
    return f"{v:.0f}" if v >= 10 else f"{v:.1f}"


def fmt_mbps(bw_bytes: Optional[float]) -> str:
    """bytes/s as MB/s (10^6, as fio's 'MB/s')."""
    if bw_bytes is None:
        return "-"
    mb = bw_bytes / 1e6
    return f"{mb:.0f}" if mb >= 100 else f"{mb:.1f}" if mb >= 1 else f"{mb:.2f}"


def fmt_lat(us: Optional[float]) -> str:
    if us is None:
        return "-"
    if us >= 1e6:
        return f"{us / 1e6:.2f} s"
    if us >= 1e3:
        return f"{us / 1e3:.1f} ms" if us < 1e5 else f"{us / 1e3:.0f} ms"
    return f"{us:.1f} µs" if us < 100 else f"{us:.0f} µs"


def fmt_us(us: Optional[float]) -> str:
    """CPU µs per I/O."""
    if us is None:
        return "-"
    return f"{us:.1f}" if us < 100 else f"{us:.0f}"


def fmt_bytes(n: Optional[float]) -> str:
    """A byte count (signed: an RSS growth may be negative) in B, KiB or MiB."""
    if n is None:
        return "-"
    for unit, factor in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= factor:
            return f"{n / factor:.1f} {unit}"
    return f"{n:.0f} B"


def fmt_ratio(r: Optional[float]) -> str:
    return "-" if r is None else f"x{r:.2f}"


def fmt_size(n: Optional[int]) -> str:
    if n is None:
        return "-"
    for unit, factor in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor and n % factor == 0:
            return f"{n // factor} {unit}"
    return f"{n} B"


def _targets_in_order(result: dict, job: dict) -> List[str]:
    """The targets a job has results for: in the run's --targets order, then any others."""
    targets = result["params"].get("targets") or []
    return [t for t in targets if t in job["results"]] + [t for t in job["results"] if t not in targets]


def fio_table(result: dict) -> str:
    """Per job and target: IOPS, MB/s, p50, p99, p99.9, errors; then the ratio row."""
    headers = ["job", "target", "IOPS", "MB/s", "p50", "p99", "p99.9", "errors"]
    rows: List[List[str]] = []
    for name, job in result["jobs"].items():
        first = True
        for t in _targets_in_order(result, job):
            slot = job["results"][t]
            med = slot.get("median") or {}
            lat = med.get("lat_us") or {}
            rows.append([name if first else "", t, fmt_iops(med.get("iops")), fmt_mbps(med.get("bw_bytes")),
                         fmt_lat(lat.get("p50")), fmt_lat(lat.get("p99")), fmt_lat(lat.get("p99.9")),
                         str(slot.get("errors", 0))])
            first = False
        r = job.get("ratio")
        if r:
            rows.append(["", f"{r['numerator']}/{r['denominator']}", fmt_ratio(r["iops"]),
                         fmt_ratio(r["bw_bytes"]), fmt_ratio(r["p50"]), fmt_ratio(r["p99"]),
                         fmt_ratio(r["p99.9"]), ""])
    return table(headers, rows)


def perftest_table(result: dict) -> str:
    headers = ["test", "size", "typical", "avg", "p99", "p99.9", "BW MiB/s", "Mpps"]
    rows = []
    errors = []  # printed under the table: a long message in a cell would stretch its column for every row
    for test, p in result.get("perftest", {}).items():
        if p.get("error"):
            rows.append([test, "", "error", "", "", "", "", ""])
            errors.append(f"{test}: " + str(p["error"]).splitlines()[0])
            continue
        bw = p.get("bw_avg_mb_s")
        rate = p.get("msg_rate_mpps")
        rows.append([test, fmt_size(p.get("bytes")), fmt_lat(p.get("t_typical_us")), fmt_lat(p.get("t_avg_us")),
                     fmt_lat(p.get("p99_us")), fmt_lat(p.get("p99_9_us")),
                     "-" if bw is None else f"{bw:.1f}", "-" if rate is None else f"{rate:.4f}"])
    return "\n".join([table(headers, rows)] + errors)


def _has_cost(result: dict) -> bool:
    return any((slot.get("median") or {}).get("cpu") for job in result.get("jobs", {}).values()
               for slot in job["results"].values())


def _cost_rows(result: dict) -> List[List[str]]:
    """Per job and target: target user s, system s, target CPU µs/IO, guest CPU µs/IO, RSS growth per
    million commands (soak), the target's RSS at the end of the job and the highest sampled during it."""
    rows: List[List[str]] = []
    for name, job in result["jobs"].items():
        first = True
        for t in _targets_in_order(result, job):
            slot = job["results"][t]
            med = slot.get("median") or {}
            cpu = med.get("cpu") or {}
            if not cpu:
                continue
            soak = [(r.get("soak") or {}).get("rss") or {} for r in slot["repeats"] if r.get("soak")]
            growth = ""
            if soak:
                growth = fmt_bytes(med.get("rss_growth_bytes_per_million")) if soak[-1] else "n/a (no process)"
            memory = med.get("memory") or {}
            end, peak = (fmt_bytes(memory.get("rss_end_bytes")), fmt_bytes(memory.get("rss_peak_bytes"))) \
                if memory else ("n/a (no process)", "")
            rows.append([name if first else "", t,
                         "-" if cpu.get("target_user_s") is None else f"{cpu['target_user_s']:.1f}",
                         "-" if cpu.get("target_system_s") is None else f"{cpu['target_system_s']:.1f}",
                         fmt_us(cpu.get("target_us_per_io")) if cpu.get("target_us_per_io") is not None
                         else "n/a (no process)",
                         fmt_us(cpu.get("guest_us_per_io")), growth, end, peak])
            first = False
    return rows


SCALING_HEADERS = ["job", "target", "IOPS", "over userspace (1 worker)", "over kernel", "userspace/kernel",
                   "I/Os per path", "CPU % per process"]


def _scaling_rows(result: dict) -> List[List[str]]:
    rows = []
    for name, job in result.get("jobs", {}).items():
        for sc in job.get("scaling") or []:
            med = (job["results"][sc["target"]].get("median") or {})
            paths = med.get("paths") or {}
            procs = med.get("processes") or {}
            rows.append([name, sc["target"], fmt_iops(med.get("iops")), fmt_ratio(sc["iops_over_single"]),
                         fmt_ratio(sc["iops_over_kernel"]), fmt_ratio(sc["single_over_kernel"]),
                         " ".join(f"{svc}:{fmt_iops(v)}" for svc, v in paths.items()) or "-",
                         " ".join(f"{n} {v['cpu_percent']:.0f}" for n, v in procs.items()
                                  if v.get("cpu_percent") is not None) or "-"])
    return rows


def scaling_table(result: dict) -> str:
    return table(SCALING_HEADERS, _scaling_rows(result))


COST_HEADERS = ["job", "target", "target user s", "target sys s", "target CPU µs/IO", "guest CPU µs/IO",
                "RSS growth /M cmds", "RSS at end", "RSS peak"]


def cost_table(result: dict) -> str:
    return table(COST_HEADERS, _cost_rows(result))



RBD_HEADERS = ["job", "target", "served by", "IOPS", "mean", "p99", "target CPU µs/IO", "guest CPU µs/IO",
               "Ceph µs/IO", "guest - Ceph µs/IO"]


def _served_text(slot: dict) -> str:
    served = [r.get("served") for r in slot["repeats"] if r.get("served")]
    if not served:
        return ""
    if any("error" in s for s in served):
        return "unknown (" + next(s["error"] for s in served if "error" in s)[:60] + ")"
    paths = sorted({str(s.get("rbd", "?")).split(" ")[0] for s in served})
    queues = sorted({str(s.get("queues")) for s in served})
    return f"{'/'.join(paths)} (queues {'/'.join(queues)})"


def rbd_rows(result: dict) -> List[List[str]]:
    """bench --rbd: per job and target IOPS, mean and p99 latency, what served the namespace, the target's CPU
    per I/O (ours: its process; the kernel's has none), the guest's, the Ceph daemons' and the guest's without
    them; then a row per ratio of `ratio` and `ratios` (IOPS, mean, p99, guest CPU)."""
    rows: List[List[str]] = []
    for name, job in result.get("jobs", {}).items():
        first = True
        for t in _targets_in_order(result, job):
            slot = job["results"][t]
            med = slot.get("median") or {}
            cpu = med.get("cpu") or {}
            side = med.get("side_us_per_io") or {}
            ceph = sum(v for v in side.values() if v is not None) if side else None
            guest = cpu.get("guest_us_per_io")
            served = _served_text(slot) or (result.get("targets", {}).get(t, {}).get("served_by") or "")
            rows.append([name if first else "", t, served, fmt_iops(med.get("iops")), fmt_lat(med.get("lat_mean_us")),
                         fmt_lat((med.get("lat_us") or {}).get("p99")),
                         fmt_us(cpu.get("target_us_per_io")) if cpu.get("target_us_per_io") is not None else "-",
                         fmt_us(guest), fmt_us(ceph),
                         fmt_us(guest - ceph) if guest is not None and ceph is not None else "-"])
            first = False
        for r in job.get("ratios") or []:
            rows.append(["", f"{r['numerator']}/{r['denominator']}", "", fmt_ratio(r["iops"]),
                         fmt_ratio(r["lat_mean_us"]), fmt_ratio(r["p99"]), "", fmt_ratio(r["guest_us_per_io"]), "", ""])
    return rows


def topology_text(result: dict) -> str:
    """Which topology was measured: one guest for everything, or two nodes on a wire (bench --two-node)."""
    t = result.get("topology")
    if not t:
        return "one node (the host, both targets and fio on one machine)"
    return (f"two nodes: targets on {t['target_node']}, host and fio on {t['host_node']}, "
            f"{t.get('link', 'one link')}")




def render(result: dict) -> str:
    """The whole terminal report."""
    p = result.get("params", {})
    m = result.get("machine", {})
    reps = p.get("repeats", 1)
    lines = [f"nvmeof-roce bench  {result.get('date', '')}  on {m.get('hostname', '?')} "
             f"({m.get('kernel', '?')}{', lab guest' if m.get('lab') else ''})",
             f"traddr {p.get('traddr', '?')}, runtime {p.get('runtime_s', '?')} s + ramp {p.get('ramp_s', '?')} s, "
             f"size {p.get('size', '?')}, {reps} repeat{'s' if reps != 1 else ''} "
             f"(medians shown; targets interleaved job by job)",
             "topology: " + topology_text(result)]
    for name, t in result.get("targets", {}).items():
        lines.append(f"  {name}: {t.get('kind', '')}, {t.get('traddr', '')}:{t.get('trsvcid', '')} "
                     f"{t.get('subnqn', '')}{'  [' + t['backend'] + ']' if t.get('backend') else ''}")
    if result.get("perftest"):
        lines += ["", "perftest (RDMA link, no NVMe):", perftest_table(result)]
    if result.get("jobs"):
        kinds = {j.get("kind") for j in result["jobs"].values()}
        what = "fio (completion latency" if kinds == {"fio"} else \
            "jobs (fio: completion latency; uinit-*: our initiator's per-command latency"
        lines += ["", f"{what}; ratio above 1 = more IOPS/bandwidth or more latency):", fio_table(result)]
    if result.get("params", {}).get("rbd"):
        lines += ["", "rbd (one image three ways; served by: which data path served our rbd namespace; Ceph: the "
                      "cluster's daemons' CPU, in the guest beside everything; ratios of medians):",
                  table(RBD_HEADERS, rbd_rows(result))]
    if _scaling_rows(result):
        lines += ["", "scaling over workers (target serve --workers N through native multipath, iopolicy round-robin; "
                      "IOPS medians divided; I/Os per path: the host's per-path counts; CPU %: each process's "
                      "user + system over the job, 100 = one core):", scaling_table(result)]
    if _has_cost(result):
        lines += ["", "cost and memory (target: the userspace target's process, from /proc/PID/stat and status; "
                      "guest: the whole machine's busy CPU, fio and the kernel host included; the kernel target "
                      "has no process of its own):", cost_table(result)]
    failures = [(j, t, r) for j, job in result.get("jobs", {}).items() for t, s in job["results"].items()
                for r in s["repeats"] if r.get("errors")]
    if failures or result.get("errors"):
        lines.append("")
        lines.append("errors:")
        for j, t, r in failures:
            lines.append(f"  {j} on {t}, repeat {r.get('repeat')}: {r.get('errors')} error(s): {r.get('error_text')}")
        for e in result.get("errors", []):
            lines.append(f"  {e}")
    return "\n".join(lines)


def render_markdown(result: dict, plots_dir: str = "") -> str:
    """A results section for docs/benchmarks.md: machine, date, command, the side-by-side table, the plots."""
    params, machine = result.get("params", {}), result.get("machine", {})
    num, den = params.get("ratio", ["userspace", "kernel"])
    lines = [f"Measured {result.get('date', '?')} on {machine.get('hostname', '?')} "
             f"({machine.get('os', '?')}, kernel {machine.get('kernel', '?')}, {machine.get('cpu', '?')}, "
             f"{machine.get('cpus', '?')} vCPUs{', lab guest' if machine.get('lab') else ''}); "
             f"{', '.join(f'{k} {v}' for k, v in machine.get('tools', {}).items())}.",
             f"Runtime {params.get('runtime_s')} s + ramp {params.get('ramp_s')} s per job, "
             f"{params.get('repeats')} repeat(s), targets interleaved job by job; medians shown.",
             f"Topology: {topology_text(result)}.", "",
             "| job | target | IOPS | MB/s | p50 | p99 | p99.9 | errors |", "|---|---|---|---|---|---|---|---|"]
    for name, job in result.get("jobs", {}).items():
        for target, res in job.get("results", {}).items():
            med = res.get("median", {})
            lat = med.get("lat_us", {})
            lines.append(f"| `{name}` | {target} | {fmt_iops(med.get('iops'))} | {fmt_mbps(med.get('bw_bytes'))} | "
                         f"{fmt_lat(lat.get('p50'))} | {fmt_lat(lat.get('p99'))} | {fmt_lat(lat.get('p99.9'))} | "
                         f"{res.get('errors', 0)} |")
        ratio = job.get("ratio") or {}
        if ratio:
            lines.append(f"| | **{num}/{den}** | **{fmt_ratio(ratio.get('iops'))}** | {fmt_ratio(ratio.get('bw_bytes'))} | "
                         f"{fmt_ratio(ratio.get('p50'))} | {fmt_ratio(ratio.get('p99'))} | "
                         f"{fmt_ratio(ratio.get('p99.9'))} | |")
    if params.get("rbd"):
        lines += ["", "One RBD image three ways (`bench --rbd`): medians; mean and p99 are fio's completion latency; "
                      "target CPU: our target's process (librbd's threads included); guest CPU: every process and "
                      "the kernel in the guest, fio and the Ceph daemons included; Ceph: the OSD's and the monitor's "
                      "CPU (/proc/PID/stat); ratios: numerator/denominator of the medians.", "",
                  "| " + " | ".join(RBD_HEADERS) + " |", "|" + "---|" * len(RBD_HEADERS)]
        for row in rbd_rows(result):
            cells = [f"`{row[0]}`" if row[0] else ""] + row[1:]
            if "/" in row[1]:
                cells = [cells[0], f"**{row[1]}**", "", f"**{row[3]}**"] + row[4:]
            lines.append("| " + " | ".join(cells) + " |")
    if _scaling_rows(result):
        lines += ["", "Scaling over workers (`target serve --workers N` reached through native NVMe multipath, iopolicy "
                      "round-robin; IOPS medians divided; I/Os per path: the kernel host's per-path counts, median; "
                      "CPU %: each target process's user + system time over the job, 100 = one core busy):", "",
                  "| " + " | ".join(SCALING_HEADERS) + " |", "|" + "---|" * len(SCALING_HEADERS)]
        for row in _scaling_rows(result):
            row = [f"`{row[0]}`", row[1], row[2], f"**{row[3]}**", f"**{row[4]}**"] + row[5:]
            lines.append("| " + " | ".join(row) + " |")
    if _has_cost(result):
        lines += ["", "What each job cost (medians): the userspace target process's CPU (user + system, from "
                      "/proc/PID/stat) per I/O, and the whole guest's busy CPU per I/O (fio and the kernel host "
                      "included; the only figure for the kernel target, which has no process); the soak job's "
                      "target RSS growth per million commands (least-squares fit of VmRSS against commands "
                      "completed); the target's RSS at the end of each job and the highest sampled during it "
                      "(VmRSS every second).", "",
                  "| " + " | ".join(COST_HEADERS) + " |", "|" + "---|" * len(COST_HEADERS)]
        for row in _cost_rows(result):
            cells = [f"`{row[0]}`" if row[0] else ""] + row[1:]
            lines.append("| " + " | ".join(cells) + " |")
    perftest = result.get("perftest") or {}
    if perftest:
        parts = []
        for name, r in perftest.items():
            if not isinstance(r, dict):
                continue
            if r.get("t_typical_us") is not None:
                parts.append(f"{name} {fmt_lat(r['t_typical_us'])} typical ({fmt_size(r.get('bytes'))})")
            elif r.get("bw_avg_mb_s") is not None:
                parts.append(f"{name} {r['bw_avg_mb_s']:.1f} MB/s ({fmt_size(r.get('bytes'))})")
        lines += ["", "RDMA link (perftest): " + ", ".join(parts) + "."]
    if plots_dir:
        lines += ["", f"![latency percentiles per job]({plots_dir}/latency.png)",
                  f"![IOPS per job]({plots_dir}/iops.png)"]
        if _has_cost(result):
            lines.append(f"![CPU per I/O]({plots_dir}/cpu.png)")
        if _scaling_rows(result):
            lines.append(f"![scaling over workers]({plots_dir}/scaling.png)")
        if any(j.get("kind") == "soak" for j in result.get("jobs", {}).values()):
            lines.append(f"![soak: target RSS against commands]({plots_dir}/soak.png)")
    return "\n".join(lines) + "\n"
