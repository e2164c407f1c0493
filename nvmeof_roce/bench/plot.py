"""PNG charts of a bench result (matplotlib, Agg backend; the `plot` extra).

- latency.png:   per job, fio completion-latency percentiles (p50 p90 p99 p99.9), one bar per target
- iops.png:      IOPS per job, one bar per target, the numerator/denominator ratio above each group
- bandwidth.png: MB/s per job, the same layout
- perftest.png:  perftest latencies (typical, avg, p99, p99.9) per test, when perftest ran
- cpu.png:       CPU µs per I/O per job: the userspace target's process, and the whole guest per target
- soak.png:      the soak job: the target's RSS against commands completed, with the fitted line
- qd_sweep.png:  `bench --qd-sweep`: 4 KiB random read IOPS against queue depth, one line per target, with
                 the device model (`--device`) in the title; `plot_qd_sweeps` puts several runs side by side
- scaling.png:   jobs run on a multi-worker target (userspace-Nw): IOPS of kernel, userspace and userspace-Nw
                 with the scaling figures above, and each target process's CPU % (100 = one core)

Bars are the medians across repeats; the whiskers span the lowest to the highest repeat.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import NvmeofError
from .report import LAT_KEYS, fmt_ratio

# Colour-blind-safe colours (Okabe-Ito), one per target in order.
COLOURS = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00"]


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise NvmeofError("matplotlib is not installed, so no PNG charts",
                          "pip install 'nvmeof-roce[plot]' (from a checkout: pip install -e '.[plot]'; Debian's "
                          "own: apt-get install python3-matplotlib), then re-draw: nvmeof-roce bench --from "
                          "RESULT.json")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _targets(result: dict) -> List[str]:
    order = list(result.get("params", {}).get("targets") or [])
    for job in result.get("jobs", {}).values():
        for t in job["results"]:
            if t not in order:
                order.append(t)
    return order


def _spread(values: Sequence[Optional[float]], median: Optional[float]) -> Tuple[float, float]:
    vals = [v for v in values if v is not None]
    if not vals or median is None:
        return 0.0, 0.0
    return max(0.0, median - min(vals)), max(0.0, max(vals) - median)


def _subtitle(result: dict, repeats: bool = True) -> str:
    p = result.get("params", {})
    m = result.get("machine", {})
    reps = p.get("repeats", 1)
    where = "lab guest (emulated: compare ratios, not absolute numbers)" if m.get("lab") else m.get("hostname", "")
    date = str(result.get("date", ""))[:16].replace("T", " ")
    line1 = f"{where}, {date} UTC, traddr {p.get('traddr', '')}"
    if not repeats:
        return line1
    line2 = (f"median of {reps} repeats, whiskers from the lowest to the highest" if reps > 1
             else "one repeat (--repeats N for medians and spread)")
    return line1 + "\n" + line2


def _grouped_bars(ax, groups: List[str], targets: List[str], values: Dict[str, List[Optional[float]]],
                  errs: Dict[str, Tuple[List[float], List[float]]]):
    n = max(1, len(targets))
    width = 0.8 / n
    for i, t in enumerate(targets):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        ys = [v if v is not None else 0.0 for v in values[t]]
        lo, hi = errs[t]
        spread = any(lo) or any(hi)
        ax.bar(xs, ys, width, label=t, color=COLOURS[i % len(COLOURS)], yerr=[lo, hi] if spread else None,
               capsize=3, error_kw={"elinewidth": 1, "ecolor": "#333333"})
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def plot_latency(result: dict, path: Path) -> Optional[Path]:
    plt = _pyplot()
    jobs = [(n, j) for n, j in result.get("jobs", {}).items() if j["results"]]
    if not jobs:
        return None
    targets = _targets(result)
    biggest = max([v for _, j in jobs for s in j["results"].values() for r in s["repeats"]
                   for v in (r.get("lat_us") or {}).values() if v is not None] or [0.0])
    unit, scale = ("ms", 1000.0) if biggest >= 2000 else ("µs", 1.0)

    def conv(us):
        return None if us is None else us / scale

    cols = min(3, len(jobs))
    rows = math.ceil(len(jobs) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.9 * rows), squeeze=False)
    for k, (name, job) in enumerate(jobs):
        ax = axes[k // cols][k % cols]
        present = [t for t in targets if t in job["results"]]
        values, errs = {}, {}
        for t in present:
            slot = job["results"][t]
            med = (slot.get("median") or {}).get("lat_us") or {}
            values[t] = [conv(med.get(q)) for q in LAT_KEYS]
            lo, hi = [], []
            for q in LAT_KEYS:
                a, b = _spread([conv((r.get("lat_us") or {}).get(q)) for r in slot["repeats"]], conv(med.get(q)))
                lo.append(a)
                hi.append(b)
            errs[t] = (lo, hi)
        _grouped_bars(ax, list(LAT_KEYS), present, values, errs)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("completion latency percentile")
        shown = [v for t in present for v in values[t] if v]
        if shown and max(shown) / min(shown) > 20:  # p50 and p99.9 orders of magnitude apart
            from matplotlib.ticker import FuncFormatter, NullFormatter
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.set_ylabel(f"latency ({unit}, log scale)")
        else:
            ax.set_ylabel(f"latency ({unit})")
    for k in range(len(jobs), rows * cols):
        axes[k // cols][k % cols].axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", title="target")
    fig.suptitle("fio completion latency (clat) by percentile, per job\n" + _subtitle(result), fontsize=11)
    fig.tight_layout(rect=(0, 0, 0.9, 1 - 0.75 / (3.9 * rows)))
    return _save(plt, fig, path)


def _per_job_metric(result: dict, path: Path, metric: str, ylabel: str, title: str, scale: float):
    plt = _pyplot()
    jobs = [(n, j) for n, j in result.get("jobs", {}).items() if j["results"]]
    if not jobs:
        return None
    targets = _targets(result)
    present = [t for t in targets if any(t in j["results"] for _, j in jobs)]
    values: Dict[str, List[Optional[float]]] = {t: [] for t in present}
    errs: Dict[str, Tuple[List[float], List[float]]] = {t: ([], []) for t in present}
    for _, job in jobs:
        for t in present:
            slot = job["results"].get(t)
            if not slot:
                values[t].append(None)
                errs[t][0].append(0.0)
                errs[t][1].append(0.0)
                continue
            med = (slot.get("median") or {}).get(metric)
            med = None if med is None else med / scale
            values[t].append(med)
            lo, hi = _spread([None if r.get(metric) is None else r[metric] / scale for r in slot["repeats"]], med)
            errs[t][0].append(lo)
            errs[t][1].append(hi)
    fig, ax = plt.subplots(figsize=(max(9.0, 1.7 * len(jobs) + 2), 5.5))
    _grouped_bars(ax, [n for n, _ in jobs], present, values, errs)
    ax.set_xticklabels([n for n, _ in jobs], rotation=25, ha="right", fontsize=9)
    ax.set_ylabel(ylabel)
    ax.set_xlabel("fio job")
    top = max([v + e for t in present for v, e in zip([x or 0.0 for x in values[t]], errs[t][1])] or [1.0])
    ax.set_ylim(0, top * 1.18 if top > 0 else 1)
    key = "iops" if metric == "iops" else "bw_bytes"
    pair = None
    for g, (_, job) in enumerate(jobs):
        r = job.get("ratio")
        if r and r.get(key) is not None:
            pair = f"{r['numerator']}/{r['denominator']}"
            ax.annotate(fmt_ratio(r[key]), (g, top * 1.06), ha="center", fontsize=9, color="#333333")
    ax.legend(title="target", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if pair:
        title += f" (above each job: {pair})"
    ax.set_title(title + "\n" + _subtitle(result), fontsize=10)
    fig.tight_layout()
    return _save(plt, fig, path)


def plot_iops(result: dict, path: Path) -> Optional[Path]:
    return _per_job_metric(result, path, "iops", "IOPS (I/O per second)", "fio IOPS per job and target", 1.0)


def plot_bandwidth(result: dict, path: Path) -> Optional[Path]:
    return _per_job_metric(result, path, "bw_bytes", "bandwidth (MB/s, 10^6 bytes/s)",
                           "fio bandwidth per job and target", 1e6)


def plot_perftest(result: dict, path: Path) -> Optional[Path]:
    tests = [(n, p) for n, p in result.get("perftest", {}).items()
             if not p.get("error") and p.get("kind") == "lat" and p.get("t_typical_us") is not None]
    if not tests:
        return None
    plt = _pyplot()
    stats = [("typical", "t_typical_us"), ("avg", "t_avg_us"), ("p99", "p99_us"), ("p99.9", "p99_9_us")]
    names = [s for s, _ in stats]
    values = {n: [p.get(k) for _, k in stats] for n, p in tests}
    errs = {n: ([0.0] * len(stats), [0.0] * len(stats)) for n, _ in tests}
    fig, ax = plt.subplots(figsize=(9.0, 5.2))
    _grouped_bars(ax, names, [n for n, _ in tests], values, errs)
    ax.set_ylabel("latency (µs)")
    ax.set_xlabel("perftest statistic (message size: " +
                  ", ".join(sorted({f"{p.get('bytes')} B" for _, p in tests})) + ")")
    ax.legend(title="test", loc="upper left")
    ax.set_title("RDMA link latency (perftest, server and client on one link)\n" + _subtitle(result, repeats=False),
                 fontsize=10)
    fig.tight_layout()
    return _save(plt, fig, path)


def plot_cpu(result: dict, path: Path) -> Optional[Path]:
    """Two panels: the target process's CPU µs per I/O (the userspace target; the kernel target has no
    process) and the whole guest's busy CPU µs per I/O, per job, a bar per target."""
    jobs = [(n, j) for n, j in result.get("jobs", {}).items()
            if any((s.get("median") or {}).get("cpu") for s in j["results"].values())]
    if not jobs:
        return None
    plt = _pyplot()
    targets = _targets(result)
    present = [t for t in targets if any(t in j["results"] for _, j in jobs)]
    fig, axes = plt.subplots(1, 2, figsize=(max(11.0, 2.2 * len(jobs) + 4), 5.5), squeeze=False)
    for ax, key, title in ((axes[0][0], "target_us_per_io", "target process (user + system)"),
                           (axes[0][1], "guest_us_per_io", "whole guest (fio and kernel host included)")):
        values: Dict[str, List[Optional[float]]] = {t: [] for t in present}
        errs: Dict[str, Tuple[List[float], List[float]]] = {t: ([], []) for t in present}
        for _, job in jobs:
            for t in present:
                slot = job["results"].get(t) or {}
                med = ((slot.get("median") or {}).get("cpu") or {}).get(key)
                values[t].append(med)
                lo, hi = _spread([(r.get("cpu") or {}).get(key) for r in slot.get("repeats", [])], med)
                errs[t][0].append(lo)
                errs[t][1].append(hi)
        _grouped_bars(ax, [n for n, _ in jobs], present, values, errs)
        ax.set_xticklabels([n for n, _ in jobs], rotation=25, ha="right", fontsize=9)
        ax.set_ylabel("CPU µs per I/O")
        ax.set_title(title, fontsize=10)
        for g, (_, job) in enumerate(jobs):
            for i, t in enumerate(present):
                if key == "target_us_per_io" and t in job["results"] and values[t][g] is None:
                    n = max(1, len(present))
                    ax.annotate("no process", (g + (i - (n - 1) / 2) * 0.8 / n, 0), ha="center", va="bottom",
                                rotation=90, fontsize=8, color="#555555")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", title="target")
    fig.suptitle("CPU per I/O, per job (lower is cheaper)\n" + _subtitle(result), fontsize=11)
    fig.tight_layout(rect=(0, 0, 0.9, 0.88))
    return _save(plt, fig, path)


def plot_soak(result: dict, path: Path) -> Optional[Path]:
    """The soak job: target RSS (MiB) against commands completed (millions), every repeat, with its fit."""
    series = []
    for name, job in result.get("jobs", {}).items():
        if job.get("kind") != "soak":
            continue
        for t, slot in job["results"].items():
            for r in slot["repeats"]:
                rss = (r.get("soak") or {}).get("rss")
                if rss and rss.get("points"):
                    series.append((t, r.get("repeat"), rss))
    if not series:
        return None
    plt = _pyplot()
    targets = _targets(result)
    fig, ax = plt.subplots(figsize=(9.0, 5.4))
    for t, repeat, rss in series:
        colour = COLOURS[targets.index(t) % len(COLOURS)] if t in targets else "#333333"
        xs = [p[0] / 1e6 for p in rss["points"]]
        ys = [p[1] / (1 << 20) for p in rss["points"]]
        growth = rss.get("growth_bytes_per_million")
        label = f"{t} (repeat {repeat})" + ("" if growth is None else
                                            f": {growth / (1 << 20):+.2f} MiB per million commands")
        ax.plot(xs, ys, "o", ms=3, color=colour, label=label)
        if growth is not None:
            fitted = [p for p in rss["points"] if p[0] >= rss.get("skip_commands", 0)]
            if len(fitted) >= 2:
                x0, x1 = fitted[0][0], fitted[-1][0]
                y0 = sum(p[1] for p in fitted) / len(fitted) - growth / 1e6 * sum(p[0] for p in fitted) / len(fitted)
                ax.plot([x0 / 1e6, x1 / 1e6], [(y0 + growth / 1e6 * x0) / (1 << 20), (y0 + growth / 1e6 * x1) / (1 << 20)],
                        "-", color=colour, lw=1)
    ax.set_xlabel("commands completed (millions)")
    ax.set_ylabel("target RSS (MiB, VmRSS)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("soak: target resident memory against commands (line: least-squares fit)\n"
                 + _subtitle(result, repeats=False), fontsize=10)
    fig.tight_layout()
    return _save(plt, fig, path)


def plot_scaling(result: dict, path: Path) -> Optional[Path]:
    jobs = [(n, j) for n, j in result.get("jobs", {}).items() if j.get("scaling")]
    if not jobs:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(len(jobs), 2, figsize=(12.0, 4.8 * len(jobs)), squeeze=False)
    for k, (name, job) in enumerate(jobs):
        ax, cpu_ax = axes[k]
        shown = [t for t in _targets(result) if t in job["results"]]
        meds = [(job["results"][t].get("median") or {}).get("iops") or 0.0 for t in shown]
        spreads = [_spread([r.get("iops") for r in job["results"][t]["repeats"]],
                           (job["results"][t].get("median") or {}).get("iops")) for t in shown]
        ax.bar(range(len(shown)), meds, 0.6, color=[COLOURS[_targets(result).index(t) % len(COLOURS)] for t in shown],
               yerr=[[a for a, _ in spreads], [b for _, b in spreads]] if any(a or b for a, b in spreads) else None,
               capsize=3)
        ax.set_xticks(range(len(shown)))
        ax.set_xticklabels(shown)
        ax.set_ylabel("IOPS (median)")
        ax.grid(axis="y", alpha=0.3)
        top = max(meds + [1.0])
        ax.set_ylim(0, top * 1.3)
        for sc in job["scaling"]:
            x = shown.index(sc["target"])
            ax.annotate(f"{fmt_ratio(sc['iops_over_single'])} over 1 worker\n"
                        f"{fmt_ratio(sc['iops_over_kernel'])} over kernel", (x, top * 1.05), ha="center",
                        fontsize=9)
        ax.set_title(f"{name}: IOPS", fontsize=10)
        bars = [(t, p, v.get("cpu_percent")) for t in shown
                for p, v in ((job["results"][t].get("median") or {}).get("processes") or {}).items()]
        cpu_ax.bar(range(len(bars)), [v or 0.0 for _, _, v in bars], 0.6,
                   color=[COLOURS[_targets(result).index(t) % len(COLOURS)] for t, _, _ in bars])
        cpu_ax.set_xticks(range(len(bars)))
        cpu_ax.set_xticklabels([f"{t}\n{p}" for t, p, _ in bars], fontsize=8)
        cpu_ax.axhline(100, color="#555555", lw=0.8, ls="--")
        cpu_ax.set_ylabel("CPU % (user + system; 100 = one core)")
        cpu_ax.grid(axis="y", alpha=0.3)
        cpu_ax.set_title(f"{name}: each target process's CPU", fontsize=10)
    fig.suptitle("scaling over worker processes (native NVMe multipath, round-robin)\n" + _subtitle(result),
                 fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.6 / (4.8 * len(jobs))))
    return _save(plt, fig, path)


_SWEEP_JOB = re.compile(r"^sweep-randread-4k-qd(\d+)$")


def sweep_points(result: dict) -> Dict[str, List[Tuple[int, float]]]:
    """{target: [(queue depth, median IOPS), ...]} of a run's QD sweep jobs, by depth."""
    points: Dict[str, List[Tuple[int, float]]] = {}
    for name, job in result.get("jobs", {}).items():
        m = _SWEEP_JOB.match(name)
        if not m:
            continue
        for t, slot in job["results"].items():
            iops = (slot.get("median") or {}).get("iops")
            if iops is not None:
                points.setdefault(t, []).append((int(m.group(1)), iops))
    return {t: sorted(p) for t, p in points.items()}


def _sweep_axes(ax, result: dict, targets: List[str]) -> bool:
    points = sweep_points(result)
    if not points:
        return False
    for i, t in enumerate([t for t in targets if t in points]):
        qds, iops = zip(*points[t])
        ax.plot(qds, iops, marker="o", label=t, color=COLOURS[i % len(COLOURS)])
        for q, v in zip(qds, iops):
            ax.annotate(f"{v:,.0f}", (q, v), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    ax.set_xscale("log", base=2)
    qds = sorted({q for p in points.values() for q, _ in p})
    ax.set_xticks(qds)
    ax.set_xticklabels([str(q) for q in qds])
    ax.set_xlabel("queue depth (fio iodepth, 1 job)")
    ax.set_ylabel("IOPS, 4 KiB random read")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(title="target")
    return True


def plot_qd_sweep(result: dict, path: Path) -> Optional[Path]:
    plt = _pyplot()
    if not sweep_points(result):
        return None
    fig, ax = plt.subplots(figsize=(8, 5.5))
    _sweep_axes(ax, result, _targets(result))
    device = result.get("params", {}).get("device", "ram")
    ax.set_title(f"IOPS against queue depth, device {device}\n" + _subtitle(result), fontsize=10)
    fig.tight_layout()
    return _save(plt, fig, path)


def plot_qd_sweeps(results: List[dict], path: Path) -> Optional[Path]:
    """Several runs' QD sweeps (one device model each) side by side in one PNG."""
    plt = _pyplot()
    runs = [r for r in results if sweep_points(r)]
    if not runs:
        return None
    fig, axes = plt.subplots(1, len(runs), figsize=(5.2 * len(runs), 5.0), squeeze=False)
    for ax, r in zip(axes[0], runs):
        _sweep_axes(ax, r, _targets(r))
        ax.set_title(f"device {r.get('params', {}).get('device', 'ram')}", fontsize=10)
    fig.suptitle("4 KiB random read IOPS against queue depth, kernel target vs userspace target\n"
                 + _subtitle(runs[0]), fontsize=10)
    fig.tight_layout()
    return _save(plt, fig, path)


def _save(plt, fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(result: dict, out_dir: Path) -> List[Path]:
    """Every chart that has data; raises NvmeofError when matplotlib is missing."""
    _pyplot()
    out_dir = Path(out_dir)
    made = [plot_latency(result, out_dir / "latency.png"), plot_iops(result, out_dir / "iops.png"),
            plot_bandwidth(result, out_dir / "bandwidth.png"), plot_perftest(result, out_dir / "perftest.png"),
            plot_cpu(result, out_dir / "cpu.png"), plot_soak(result, out_dir / "soak.png"),
            plot_scaling(result, out_dir / "scaling.png"), plot_qd_sweep(result, out_dir / "qd_sweep.png")]
    return [p for p in made if p is not None]
