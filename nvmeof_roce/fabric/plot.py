"""PNG charts of the fabric simulations (matplotlib, Agg backend; the `plot` extra).

- incast.png: without DCQCN (left) and with it (right): each sender's rate, the egress queue with
  the ECN and PFC thresholds, and the PAUSE frames sent so far
- ring.png:   the ring's ingress queues and the bytes delivered, without and with a PFC watchdog
"""
from __future__ import annotations

from pathlib import Path
from typing import List

from ..errors import NvmeofError
from .simulate import IncastResult, RingResult

# Colour-blind-safe colours (Okabe-Ito), as in the bench charts.
COLOURS = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000"]


# How to get matplotlib, installed or from a checkout
INSTALL_MATPLOTLIB = ("pip install 'nvmeof-roce[plot]' (from a checkout: pip install -e '.[plot]'; Debian's own: "
                      "apt-get install python3-matplotlib)")


def require_matplotlib():
    """matplotlib, or NvmeofError saying how to install it: `fabric simulate --plot` asks before it simulates."""
    try:
        import matplotlib
    except ImportError:
        raise NvmeofError("--plot: matplotlib is not installed, so no PNG charts",
                          f"{INSTALL_MATPLOTLIB}, or run without --plot") from None
    return matplotlib


def _pyplot():
    matplotlib = require_matplotlib()
    matplotlib.use("Agg")  # headless: no display needed
    import matplotlib.pyplot as plt
    return plt


def plot_incast(without: IncastResult, with_dcqcn: IncastResult, path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(3, 2, figsize=(12, 9), sharex="col")
    for col, (title, r) in enumerate((("PFC only (no DCQCN)", without), ("PFC + DCQCN", with_dcqcn))):
        ms = [t / 1000 for t in r.times_us]
        ax = axes[0][col]
        for i, series in enumerate(r.rates_gbps):
            ax.plot(ms, series, color=COLOURS[i % len(COLOURS)], linewidth=0.8, label=f"sender {i}")
        ax.axhline(r.fair_share_gbps, color="black", linestyle="--", linewidth=0.8, label="fair share")
        ax.set_ylabel("sending rate (Gb/s)")
        ax.set_title(f"{title}: {r.config['senders']}:1 incast at {r.config['speed_gbps']:g} Gb/s")
        ax.set_ylim(0, r.config["speed_gbps"] * 1.05)
        if col == 1:
            ax.legend(fontsize=7, ncol=3, loc="upper right")
        ax = axes[1][col]
        ax.plot(ms, [q / 1000 for q in r.queue], color="#0072B2", linewidth=0.8, label="egress queue")
        ax.axhline(r.config["kmin"] / 1000, color="#009E73", linestyle=":", label="ECN Kmin")
        ax.axhline(r.config["kmax"] / 1000, color="#D55E00", linestyle=":", label="ECN Kmax")
        ax.axhline(r.config["xoff"] * r.config["senders"] / 1000, color="#CC79A7", linestyle="--",
                   label="PFC xoff x senders")
        ax.set_ylabel("queue (KB)")
        ax.legend(fontsize=7, loc="upper right")
        ax = axes[2][col]
        ax.plot(ms, r.pause_frames_series, color="#E69F00")
        ax.set_ylabel("PAUSE frames sent (total)")
        ax.set_xlabel("time (ms)")
        ax.text(0.02, 0.9, f"{r.pause_frames} PAUSE frames, {r.cnps} CNPs", transform=ax.transAxes, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ring(without: RingResult, with_watchdog: RingResult, path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 6.5), sharex="col")
    for col, (title, r) in enumerate((("no PFC watchdog", without), ("PFC watchdog (drop)", with_watchdog))):
        us = r.times_us
        ax = axes[0][col]
        for j, series in enumerate(r.ring_queues):
            ax.plot(us, [q / 1000 for q in series], color=COLOURS[j % len(COLOURS)], linewidth=0.9,
                    label=f"switch {j} ring ingress")
        ax.axhline(r.config["xoff"] / 1000, color="black", linestyle="--", linewidth=0.8, label="xoff")
        ax.axvline(r.config["burst_us"], color="grey", linestyle=":", linewidth=0.8, label="hosts stop")
        for event in r.watchdog_events:
            ax.axvline(event["detected_us"], color="#D55E00", linewidth=0.6)
        state = "deadlocked" if r.deadlocked else ("drained" if r.drained else "still draining")
        ax.set_title(f"{r.config['switches']} switches in a ring, {title}: {state}")
        ax.set_ylabel("queue (KB)")
        ax.legend(fontsize=7, loc="upper right")
        ax = axes[1][col]
        ax.plot(us, r.delivered_series, color="#009E73", linewidth=0.9)
        ax.set_ylabel("delivered to hosts (Gb/s)")
        ax.set_xlabel("time (us)")
        ax.text(0.02, 0.88, f"delivered {r.delivered_bytes / 1e6:.2f} MB, dropped by watchdog "
                f"{r.dropped_bytes / 1e6:.2f} MB, left {r.left_in_switches / 1e3:.0f} KB",
                transform=ax.transAxes, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(incast: List[IncastResult], ring: List[RingResult], directory: Path) -> List[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    return [plot_incast(incast[0], incast[1], directory / "incast.png"),
            plot_ring(ring[0], ring[1], directory / "ring.png")]
