"""A lossless-priority plan for one RoCE link (host NIC <-> switch port): PFC headroom and
thresholds, ECN marking, DCQCN parameters.

Headroom is the buffer a receiver keeps free above its xoff threshold: after it decides to send
a PFC PAUSE, bytes keep arriving until the PAUSE has crossed the cable, the peer has reacted and
the last frames on the wire have landed.  Two published formulas size it, shown side by side
(docs/fabric.md walks through both for 100 GbE, 100 m, MTU 9216):

- the mlx5 driver's `calculate_xoff()` (Linux, drivers/net/ethernet/mellanox/mlx5/core/en/
  port_buffer.c), which sizes the host NIC's receive buffer, reproduced in its integer arithmetic;
- SONiC's dynamic buffer calculation for Mellanox ASICs (sonic-swss cfgmgr/
  buffer_headroom_mellanox.lua), which sizes a switch port's ingress priority group.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

from ..errors import NvmeofError

PLAN_FORMAT = "nvmeof-roce fabric plan"
PLAN_VERSION = 1

DEFAULT_PRIORITY = 3  # the RoCE priority by convention (NVIDIA, SONiC's lossless queues 3 and 4)
DEFAULT_DSCP = 26  # RoCE traffic's DSCP by convention (ToS 106)
CNP_DSCP = 48  # mlx5's default DSCP and priority for CNPs (np_cnp_dscp, np_cnp_prio)
CNP_PRIORITY = 6

# --- mlx5 (port_buffer.c, en_dcbnl.c) ------------------------------------------------------
MLX5_MIN_SPEED_MBPS = 40000  # calculate_xoff: "minimum speed value is 40Gbps"
MLX5_MINIMUM_MAX_MTU = 9216  # mlx5e_port_manual_buffer_config: max_mtu >= MINIMUM_MAX_MTU
MLX5_MAX_CABLE_LENGTH = 1000  # en_dcbnl.c: a PFC delay (cable length) of 1000 m or more is ignored
MLX5_CELL_SIZE = 128  # bytes per port-buffer cell (1 << MLX5E_BUFFER_CELL_SHIFT before firmware reported it)
MLX5_DEFAULT_CABLE_LEN = 7  # MLX5E_DEFAULT_CABLE_LEN: what the driver assumes until told

# --- SONiC (buffer_headroom_mellanox.lua, the ASIC_TABLE of sonic-buildimage) ---------------
SPEED_OF_LIGHT = 198000000  # m/s in the cable, as the Lua script has it
MINIMAL_PACKET_SIZE = 64
# Pause quanta a peer may take to stop, per operating speed (IEEE 802.3 Annex 31B.3.7), in Mb/s.
PAUSE_QUANTA_PER_SPEED = {800000: 905, 400000: 905, 200000: 453, 100000: 394, 50000: 147, 40000: 118,
                          25000: 80, 10000: 67, 1000: 2, 100: 1}


@dataclass(frozen=True)
class SwitchAsic:
    """The ASIC_TABLE entry SONiC reads (sizes in KiB as SONiC writes them)."""

    name: str
    cell_size: int  # bytes
    pipeline_latency_kib: float  # becomes xon
    mac_phy_delay_kib: float  # bytes held in the switch's egress pipeline and PHY when XOFF is generated
    peer_response_time_kib: float  # used only for a speed missing from PAUSE_QUANTA_PER_SPEED


ASICS = {
    "spectrum": SwitchAsic("Spectrum", 96, 18, 0.8, 3.8),
    "spectrum2": SwitchAsic("Spectrum-2/3", 144, 18, 0.8, 3.8),
}
DEFAULT_ASIC = "spectrum2"
SONIC_LOSSLESS_MTU = 1024  # LOSSLESS_TRAFFIC_PATTERN|AZURE mtu, SONiC's default
SONIC_SMALL_PACKET_PERCENTAGE = 100  # LOSSLESS_TRAFFIC_PATTERN|AZURE small_packet_percentage

# --- ECN and DCQCN (Zhu et al., "Congestion Control for Large-Scale RDMA Deployments", SIGCOMM 2015)
PAPER_SPEED_GBPS = 40  # the paper's testbed; its marking thresholds are for 40 Gb/s
PAPER_KMIN = 5 * 1000  # bytes
PAPER_KMAX = 200 * 1000
PAPER_PMAX = 0.01


@dataclass(frozen=True)
class DcqcnParams:
    """The reaction point's and notification point's parameters, in the paper's terms."""

    g: float = 1 / 256  # alpha gain: alpha = (1 - g) alpha + g on a CNP
    cnp_interval_us: float = 50  # N: at most one CNP per flow per interval
    alpha_timer_us: float = 55  # K: alpha decays when no CNP came for this long
    rate_timer_us: float = 55  # T: rate-increase timer
    byte_counter: int = 10 * 1000 * 1000  # B: rate-increase byte counter
    fast_recovery_steps: int = 5  # F
    rai_mbps: float = 40  # additive increase step
    rhai_mbps: float = 400  # hyper increase step (10 x Rai, the ratio of the mlx5 defaults 5/50)
    min_rate_mbps: float = 100  # floor of a throttled flow (the paper's simulations use 100 Mb/s)


PAPER_DCQCN = DcqcnParams()

# mlx5 firmware defaults (mlxconfig ROCE_CC_* names; the same knobs are the kernel's debugfs
# cc_params rp_*/np_* and MLNX_OFED's /sys/class/net/X/ecn/roce_rp|roce_np files).
# (knob, default, unit, what it is, the paper's value in the knob's unit or None)
MLX5_DCQCN_KNOBS = [
    ("rpg_time_reset", 300, "us", "rate-increase timer T", 55),
    ("rpg_byte_reset", 32767, "bytes", "rate-increase byte counter B", None),
    ("rpg_threshold", 1, "events", "fast-recovery steps F", 5),
    ("rpg_ai_rate", 5, "Mb/s", "additive increase Rai", 40),
    ("rpg_hai_rate", 50, "Mb/s", "hyper increase Rhai", 400),
    ("rpg_gd", 11, "log2", "rate cut scale: rate x (1 - alpha / 2^gd) on a CNP", None),
    ("rpg_min_dec_fac", 50, "%", "largest cut on one CNP", None),
    ("rpg_min_rate", 1, "Mb/s", "floor of a throttled flow", None),
    ("dce_tcp_g", 1019, "1/1024", "alpha gain g (fixed point, firmware's encoding)", None),
    ("dce_tcp_rtt", 1, "us", "alpha update period K", None),
    ("initial_alpha_value", 1023, "1/1024", "alpha at the first CNP", None),
    ("rate_reduce_monitor_period", 4, "us", "shortest time between two rate cuts", None),
    ("min_time_between_cnps", 4, "us", "notification point: CNP interval N (firmware 2-4)", 50),
]
# The knobs a plan may set from the paper's values (units the kernel documents for them).
PAPER_TO_MLX5 = {knob: paper for knob, _d, _u, _w, paper in MLX5_DCQCN_KNOBS if paper is not None}


@dataclass
class Term:
    """One term of a headroom formula: its value in bytes, how it is computed, what it stands for."""

    name: str
    value: float
    formula: str
    meaning: str


@dataclass
class Headroom:
    """A formula's result: the headroom, the xoff/xon thresholds, and the terms that make it up."""

    formula: str
    source: str
    applies_to: str
    terms: List[Term]
    headroom: int  # bytes reserved for what arrives after XOFF
    xoff: int  # bytes: see `meaning` of each formula for where it is measured from
    xon: int
    buffer: int  # the buffer this priority needs (bytes)
    thresholds: str  # how xoff/xon are expressed in this model
    notes: List[str] = field(default_factory=list)


@dataclass(frozen=True)
class LinkInputs:
    """What the plan is computed from."""

    speed_mbps: int
    cable_m: float
    mtu: int  # the host port's MTU
    peer_mtu: int  # the switch port's MTU
    priority: int = DEFAULT_PRIORITY
    dscp: int = DEFAULT_DSCP
    asic: str = DEFAULT_ASIC
    lossless_mtu: int = SONIC_LOSSLESS_MTU
    small_packet_percentage: int = SONIC_SMALL_PACKET_PERCENTAGE
    nic_buffer: Optional[int] = None  # bytes of the NIC's lossless buffer (default: the smallest the driver takes)
    dcqcn: str = "nic-defaults"  # or "paper"

    @property
    def speed_gbps(self) -> float:
        return self.speed_mbps / 1000


# --- parsing the command line's units ------------------------------------------------------


def parse_speed(text: str) -> int:
    """"100G", "100Gb/s", "25g", "400G", "100000" (Mb/s) -> Mb/s."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([gGmM]?)(?:b(?:/s|ps)?|bE)?\s*", str(text))
    if not m:
        raise NvmeofError(f"--speed {text!r}: not a link speed", "give it as 100G, 25G, 400G (or in Mb/s: 100000)")
    value, unit = float(m.group(1)), m.group(2).lower()
    mbps = value * 1000 if unit == "g" else value
    if unit == "" and value < 1000:
        mbps = value * 1000  # a bare "100" means 100 Gb/s
    if not 100 <= mbps <= 1600000:
        raise NvmeofError(f"--speed {text!r}: {mbps:g} Mb/s is out of range", "give an Ethernet speed from 100M to 1600G")
    return int(mbps)


def parse_length(text: str) -> float:
    """"100m", "100", "2.5m", "1km" -> metres."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(m|km)?\s*", str(text), re.I)
    if not m:
        raise NvmeofError(f"--cable {text!r}: not a length", "give it in metres: 100m (or 1km)")
    metres = float(m.group(1)) * (1000 if (m.group(2) or "").lower() == "km" else 1)
    if not 0 < metres <= 10000:
        raise NvmeofError(f"--cable {text!r}: {metres:g} m is out of range", "give a cable length from 1 m to 10 km")
    return metres


def check_mtu(value: int, option: str) -> int:
    if not 576 <= value <= 16384:
        raise NvmeofError(f"{option} {value}: not an Ethernet MTU", f"give {option} between 576 and 16384 (RoCE: 1500..9216)")
    return value


# --- the two headroom formulas -------------------------------------------------------------


def mlx5_headroom(link: LinkInputs) -> Headroom:
    """The mlx5 driver's lossless receive buffer: calculate_xoff() and update_xoff_threshold().

    xoff = (301 + 216 * cable_len / 100) * speed / 1000 + 272 * mtu / 100   [bytes, C integers]
    i.e. (301 + 2.16 x length[m]) x speed[Gb/s] + 2.72 x MTU, speed at least 40 Gb/s.  The
    buffer's xoff threshold is then size - xoff and its xon threshold xoff_threshold - max_mtu."""
    speed = max(link.speed_mbps, MLX5_MIN_SPEED_MBPS)
    cable = math.ceil(link.cable_m)  # the driver keeps whole metres (the PFC delay field)
    mtu = link.mtu
    per_metre = 216 * cable // 100
    xoff = (301 + per_metre) * speed // 1000 + 272 * mtu // 100
    fixed = 301 * speed / 1000
    on_cable = per_metre * speed / 1000
    frames = 272 * mtu // 100
    max_mtu = max(mtu, link.peer_mtu, MLX5_MINIMUM_MAX_MTU)
    minimum = xoff + max_mtu + MLX5_CELL_SIZE
    size = link.nic_buffer or minimum
    notes = []
    if link.speed_mbps < MLX5_MIN_SPEED_MBPS:
        notes.append(f"the driver counts any speed below 40 Gb/s as 40 Gb/s: computed for {speed // 1000} Gb/s")
    if cable != link.cable_m:
        notes.append(f"the driver takes whole metres: {link.cable_m:g} m counted as {cable} m")
    if cable >= MLX5_MAX_CABLE_LENGTH:
        notes.append(f"the driver ignores a cable length of {MLX5_MAX_CABLE_LENGTH} m or more (keeps its previous one, "
                     f"{MLX5_DEFAULT_CABLE_LEN} m by default): size the NIC buffer by hand (dcb buffer)")
    if link.peer_mtu > mtu:
        notes.append(f"the switch port's MTU ({link.peer_mtu}) is above this port's ({mtu}); the driver sizes for "
                     f"its own MTU, 2.72 x {link.peer_mtu - mtu} bytes short: give both ends the same MTU")
    if link.nic_buffer is not None and link.nic_buffer < minimum:
        raise NvmeofError(f"--nic-buffer {link.nic_buffer}: the mlx5 driver needs at least xoff + max_mtu + cell = "
                          f"{minimum} bytes for a lossless buffer (update_xoff_threshold)",
                          f"give --nic-buffer {minimum} or more, or leave it out")
    if link.nic_buffer is None:
        notes.append(f"thresholds shown for the smallest buffer the driver accepts ({minimum} B)")
    notes.append("the driver applies this xoff only to buffers it owns (after `dcb buffer set`, or buffers the "
                 "firmware reports as software-owned); in the default firmware-owned mode the firmware sizes the "
                 "buffers and the driver only records the cable length")
    speed_g = speed // 1000
    terms = [
        Term("fixed delays", fixed, f"301 x {speed_g} Gb/s",
             "PHY, MAC and the peer's reaction to the PAUSE: 301 B per Gb/s, i.e. about 2.4 us of line time"),
        Term("cable", on_cable, f"floor(216 x {cable} m / 100) x {speed_g} Gb/s",
             "bytes on the wire both ways: 2.16 B per metre per Gb/s, about 17 ns per metre "
             "(light in the cable needs about 10 ns per metre there and back: the driver keeps a margin)"),
        Term("frames", frames, f"floor(272 x {mtu} / 100)",
             "2.72 x MTU: the frame this port is sending when it decides to pause, the frame the peer has started, "
             "and room for the part-used buffer cells they occupy"),
    ]
    return Headroom(
        formula="mlx5", source="Linux mlx5 driver, calculate_xoff() in en/port_buffer.c",
        applies_to="the host NIC's receive buffer for the lossless priority",
        terms=terms, headroom=xoff, xoff=size - xoff, xon=size - xoff - max_mtu, buffer=size,
        thresholds=(f"thresholds count from the empty buffer of {size} B: PAUSE when the fill reaches size - headroom, "
                    f"resume below that minus max_mtu ({max_mtu})"),
        notes=notes)


def sonic_headroom(link: LinkInputs) -> Headroom:
    """SONiC's headroom of a lossless priority group on a Mellanox switch (buffer_headroom_mellanox.lua),
    without a gearbox and with shared headroom pool off, in the script's own arithmetic."""
    asic = ASICS[link.asic]
    speed = link.speed_mbps
    cell = asic.cell_size
    if cell > 2 * MINIMAL_PACKET_SIZE:
        worst_case_factor = cell / MINIMAL_PACKET_SIZE
    else:
        worst_case_factor = (2 * cell) / (1 + cell)
    pct = link.small_packet_percentage
    cell_occupancy = (100 - pct + pct * worst_case_factor) / 100
    quanta = PAUSE_QUANTA_PER_SPEED.get(speed)
    if quanta is not None:
        peer_response = quanta * 512 / 8
        response_formula = f"{quanta} pause quanta x 512 bit / 8"
    else:
        peer_response = asic.peer_response_time_kib * 1024
        response_formula = f"{asic.peer_response_time_kib} KiB (ASIC_TABLE peer_response_time)"
    bytes_on_cable = 2 * link.cable_m * speed * 1000000000 / SPEED_OF_LIGHT / (8 * 1024)
    mac_phy = asic.mac_phy_delay_kib * 1024
    port_mtu = link.peer_mtu
    propagation = port_mtu + bytes_on_cable + mac_phy + peer_response
    xoff = link.lossless_mtu + propagation * cell_occupancy
    xoff = math.ceil(xoff / 1024) * 1024
    xon = math.ceil(asic.pipeline_latency_kib * 1024 / 1024) * 1024
    size = math.ceil((xoff + xon) / 1024) * 1024
    terms = [
        Term("port MTU", port_mtu, f"{port_mtu}",
             "the frame the switch is sending when it decides to pause: the PAUSE waits behind it"),
        Term("cable", bytes_on_cable, f"2 x {link.cable_m:g} m x {speed} Mb/s x 10^9 / {SPEED_OF_LIGHT} m/s / 8192",
             "bytes on the wire there and back (the script's units give about 0.98 B per byte in flight)"),
        Term("MAC/PHY delay", mac_phy, f"{asic.mac_phy_delay_kib} KiB (ASIC_TABLE mac_phy_delay)",
             "bytes held in the switch's egress pipeline and PHY when XOFF is generated"),
        Term("peer response", peer_response, response_formula,
             "the time the peer may take to stop after the PAUSE arrives (IEEE 802.3 Annex 31B)"),
        Term("cell occupancy", cell_occupancy,
             f"(100 - {pct} + {pct} x {worst_case_factor:g}) / 100",
             f"a multiplier, not bytes: {pct} % of small packets, each filling a {cell} B cell "
             f"(worst case factor {worst_case_factor:g})"),
        Term("lossless MTU", link.lossless_mtu, f"{link.lossless_mtu} (LOSSLESS_TRAFFIC_PATTERN mtu)",
             "the lossless frame that crossed the threshold"),
        Term("xon (pipeline latency)", xon, f"{asic.pipeline_latency_kib} KiB (ASIC_TABLE pipeline_latency)",
             "bytes still coming through the switch pipeline: reserved on top of xoff"),
    ]
    notes = [f"ASIC {asic.name}: cell {cell} B; xoff = lossless MTU + (port MTU + cable + MAC/PHY + peer response) x "
             "cell occupancy, rounded up to KiB; size = xoff + xon"]
    if quanta is None:
        notes.append(f"{speed} Mb/s is not in the pause-quanta table: the ASIC's default peer response time is used")
    return Headroom(
        formula="sonic", source="SONiC dynamic buffer calculation, sonic-swss cfgmgr/buffer_headroom_mellanox.lua",
        applies_to="the switch port's ingress priority group (BUFFER_PROFILE xoff, xon, size)",
        terms=terms, headroom=size, xoff=xoff, xon=xon, buffer=size,
        thresholds="xoff is the headroom reserved above the point the PG pauses; xon the level it resumes below",
        notes=notes)


# --- ECN and DCQCN -------------------------------------------------------------------------


@dataclass
class EcnPlan:
    """Switch egress marking (RED/ECN on the lossless queue) and the host's ECN points."""

    kmin: int
    kmax: int
    pmax: float
    paper_kmin: int = PAPER_KMIN
    paper_kmax: int = PAPER_KMAX
    paper_pmax: float = PAPER_PMAX
    rule: str = ""


def ecn_plan(link: LinkInputs) -> EcnPlan:
    """The paper's thresholds (for 40 Gb/s), scaled with the link speed so they mark at the same
    queueing delay: Kmin = 5 KB x speed / 40G, Kmax = 200 KB x speed / 40G, Pmax 1 %."""
    scale = link.speed_gbps / PAPER_SPEED_GBPS
    return EcnPlan(
        kmin=int(round(PAPER_KMIN * scale)), kmax=int(round(PAPER_KMAX * scale)), pmax=PAPER_PMAX,
        rule=("ECN must act before PFC: the switch must mark (egress queue above Kmin) well before any ingress "
              "reaches its PFC xoff point, or senders are paused instead of slowed; with N senders into one port "
              "each ingress holds about 1/N of the egress queue"))


def dcqcn_table(link: LinkInputs) -> List[Dict[str, object]]:
    """The mlx5 knobs beside the paper's values; `plan` is what the saved plan sets (None: left alone)."""
    rows = []
    for knob, default, unit, what, paper in MLX5_DCQCN_KNOBS:
        rows.append({"knob": knob, "what": what, "unit": unit, "nic_default": default, "paper": paper,
                     "plan": paper if link.dcqcn == "paper" and paper is not None else None})
    return rows


# --- the whole plan ------------------------------------------------------------------------


def make_plan(link: LinkInputs) -> dict:
    """Everything `fabric plan` prints and saves, as a JSON-ready dict."""
    if not 0 <= link.priority <= 7:
        raise NvmeofError(f"--priority {link.priority}: not an 802.1p priority", "give 0..7 (3 by convention)")
    if not 0 <= link.dscp <= 63:
        raise NvmeofError(f"--dscp {link.dscp}: not a DSCP", "give 0..63 (26 by convention)")
    if link.dscp == CNP_DSCP:
        raise NvmeofError(f"--dscp {link.dscp}: that is the DSCP of CNPs on mlx5", "give RoCE data its own DSCP (26)")
    if link.dcqcn not in ("nic-defaults", "paper"):
        raise NvmeofError(f"--dcqcn {link.dcqcn!r}: unknown", "give nic-defaults (keep the firmware's) or paper")
    nic, switch = mlx5_headroom(link), sonic_headroom(link)
    ecn = ecn_plan(link)
    low, high = sorted((nic.headroom, switch.headroom))
    dcqcn_rows = dcqcn_table(link)
    host = {
        "priority": link.priority,
        "dscp": link.dscp,
        "tos": link.dscp << 2 | 2,  # ECT(0) in the two ECN bits: 106 for DSCP 26
        "mtu": link.mtu,
        "speed_mbps": link.speed_mbps,
        "pfc_priorities": [link.priority],
        "pfc_delay": min(math.ceil(link.cable_m), 65535),
        "dscp_to_priority": {str(link.dscp): link.priority, str(CNP_DSCP): CNP_PRIORITY},
        "trust": "dscp",
        "ecn_priorities": [link.priority],
        "dcqcn": {row["knob"]: row["plan"] for row in dcqcn_rows if row["plan"] is not None},
    }
    return {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "inputs": asdict(link),
        "headroom": {"low": low, "high": high, "mlx5": asdict(nic), "sonic": asdict(switch)},
        "ecn": asdict(ecn),
        "dcqcn": {"paper": asdict(PAPER_DCQCN), "knobs": dcqcn_rows},
        "host": host,
    }


def save_plan(plan: dict, path: str) -> None:
    """Write the plan as JSON, atomically (a half-written plan must never be read back)."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            json.dump(plan, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise NvmeofError(f"cannot write the plan to {path}: {exc.strerror or exc}",
                          "give --save a path in a writable directory")


def load_plan(path: str) -> dict:
    """Read a plan saved by `fabric plan --save`; errors name the problem and the fix."""
    try:
        with open(path) as f:
            plan = json.load(f)
    except OSError as exc:
        raise NvmeofError(f"cannot read the plan {path}: {exc.strerror or exc}",
                          "make one with: nvmeof-roce fabric plan --speed 100G --cable 100m --mtu 9216 --save FILE")
    except ValueError as exc:
        raise NvmeofError(f"{path} is not JSON: {exc}", "give a file written by nvmeof-roce fabric plan --save")
    if not isinstance(plan, dict) or plan.get("format") != PLAN_FORMAT:
        raise NvmeofError(f"{path} is not a fabric plan (no \"format\": \"{PLAN_FORMAT}\")",
                          "give a file written by nvmeof-roce fabric plan --save")
    if plan.get("version") != PLAN_VERSION:
        raise NvmeofError(f"{path}: plan version {plan.get('version')} is not {PLAN_VERSION}",
                          "re-make the plan with this version: nvmeof-roce fabric plan ... --save FILE")
    host = plan.get("host")
    required = {"priority": int, "dscp": int, "mtu": int, "speed_mbps": int, "pfc_priorities": list,
                "pfc_delay": int, "dscp_to_priority": dict, "ecn_priorities": list, "dcqcn": dict}
    if not isinstance(host, dict):
        raise NvmeofError(f"{path}: no \"host\" section", "re-make the plan: nvmeof-roce fabric plan ... --save FILE")
    for key, kind in required.items():
        if not isinstance(host.get(key), kind):
            raise NvmeofError(f"{path}: host.{key} is missing or not a {kind.__name__}",
                              "re-make the plan: nvmeof-roce fabric plan ... --save FILE")
    return plan
