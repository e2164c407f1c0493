"""A small discrete-time model of a lossless priority: an N:1 incast with PFC and DCQCN, and a
PFC deadlock in a ring of switches with and without a PFC watchdog.

Time advances in steps of 1 us; bytes are a fluid within a step (a 100 Gb/s link moves 12.5 KB
per step), packets are counted only where a decision is per packet (ECN marking).  The random
choices (which packet RED marks) come from a seeded generator, so a run is repeatable.

Incast (`run_incast`): N senders, each on its own link into one switch whose egress port runs at
the same speed.  The switch keeps per-ingress byte counts of the lossless priority; an ingress at
or above `xoff` sends a PAUSE to its sender (refreshed while it stays there), at or below `xon`
the pause ends.  A sender sees a PAUSE `pause_delay_us` after the switch decides it: the bytes it
sends in between are what the headroom absorbs.  The egress marks ECN with RED on the whole
queue (Kmin, Kmax, Pmax); the receiver (notification point) sends a flow at most one CNP per
`cnp_interval_us`; the sender (reaction point) runs DCQCN as in Zhu et al., SIGCOMM 2015:

  on a CNP:        RT = RC;  RC = RC (1 - alpha / 2);  alpha = (1 - g) alpha + g;  counters reset
  no CNP for K:    alpha = (1 - g) alpha
  every T, or B bytes sent (counters iT, iB), an increase event:
    fast recovery  max(iT, iB) < F:    RC = (RT + RC) / 2
    additive       otherwise:          RT = RT + Rai;          RC = (RT + RC) / 2
    hyper          min(iT, iB) > F:    RT = RT + i Rhai, i = min(iT, iB) - F;  RC = (RT + RC) / 2

The egress serves the ingress counts in proportion to their share of the queue (FIFO, as a
fluid).  Without DCQCN the senders stay at line rate and only PFC holds them back.

Ring (`run_ring`): switches 0..n-1 in a ring, link j from switch j to j+1.  The hosts on switch
j send to the hosts two switches on (j -> j+1 -> j+2), so every ring link carries its hosts' flow
and one in transit; the switch serves its input ports round robin, so with two hosts per switch
the transit flow gets a third of the link while it arrives at two thirds.  Each switch's ring ingress is one FIFO queue of the
lossless priority: a transit packet at its head waits for the next link, and everything behind
it waits too.  When every ring ingress is above xoff, every ring link is paused and every head
is a transit packet: a cyclic buffer dependency, and nothing ever moves again.  A PFC watchdog
(SONiC's pfcwd, action drop) that sees a queue paused for `detect_us` with packets waiting drops
them and ignores PAUSE for `restore_us`, which breaks the cycle.
"""
from __future__ import annotations

import random
from collections import deque
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

from ..errors import NvmeofError
from .plan import PAPER_DCQCN, DcqcnParams

BYTES_PER_US_PER_GBPS = 125.0  # 1 Gb/s = 125 bytes per microsecond
ROCE_FRAME = 4096 + 78  # a full RoCE v2 frame: 4096 B payload + Eth/IP/UDP/BTH/ICRC/FCS
PAUSE_QUANTA_BITS = 512
MAX_QUANTA = 65535


def pause_refresh_us(speed_gbps: float) -> float:
    """A switch re-sends XOFF before the peer's pause (65535 quanta) runs out: at half of it."""
    return MAX_QUANTA * PAUSE_QUANTA_BITS / (speed_gbps * 1000) / 2


@dataclass
class IncastConfig:
    senders: int = 8
    speed_gbps: float = 100.0
    duration_us: int = 40000
    xoff: int = 100_000  # bytes per ingress: the switch pauses that sender at this fill
    xon: int = 100_000 - 2 * 9216  # ... and resumes it at this fill
    headroom: int = 76767  # bytes above xoff the ingress may take without loss (the plan's)
    pause_delay_us: int = 1  # XOFF decided -> sender stops (cable both ways + reaction)
    kmin: int = 12_500  # egress RED/ECN: no marks below, linear to pmax at kmax, all above
    kmax: int = 500_000
    pmax: float = 0.01
    dcqcn: Optional[DcqcnParams] = PAPER_DCQCN  # None: no congestion control, PFC only
    frame: int = ROCE_FRAME
    stagger_us: int = 1000  # sender i starts at i x stagger_us (they join one by one, as in the paper)
    marking: str = "fluid"  # "fluid": exactly p of each flow's packets; "random": each packet with probability p
    seed: int = 1  # for "random" marking
    sample_us: int = 20  # one sample of the time series every this many steps

    def check(self) -> None:
        if not 1 <= self.senders <= 256:
            raise NvmeofError(f"--senders {self.senders}: out of range", "give 1..256 senders")
        if not 1 <= self.duration_us <= 2_000_000:
            raise NvmeofError(f"--duration {self.duration_us} us: out of range", "give 1 us .. 2 s")
        if not 0 < self.xon < self.xoff:
            raise NvmeofError(f"xon {self.xon} must be below xoff {self.xoff} and above 0",
                              "give --xoff above --xon (the gap is at least one MTU)")
        if self.marking not in ("fluid", "random"):
            raise NvmeofError(f"--marking {self.marking!r}: unknown", "give fluid or random")
        if not 0 <= self.stagger_us * (self.senders - 1) < self.duration_us // 2:
            raise NvmeofError(f"--stagger {self.stagger_us} us: the last sender would start after half the run",
                              "give a shorter --stagger or a longer --duration")
        if not 0 <= self.kmin < self.kmax or not 0 < self.pmax <= 1:
            raise NvmeofError(f"ECN Kmin {self.kmin}, Kmax {self.kmax}, Pmax {self.pmax}: need Kmin < Kmax, 0 < Pmax <= 1",
                              "give --kmin below --kmax and --pmax in (0, 1]")


@dataclass
class IncastResult:
    config: dict
    times_us: List[float]
    queue: List[int]  # egress queue (bytes) at each sample
    rates_gbps: List[List[float]]  # per flow: sending rate RC at each sample
    throughput_gbps: List[List[float]]  # per flow: delivered in each sample interval
    pause_frames_series: List[int]  # XOFF frames sent so far, at each sample
    pause_frames: int  # XOFF frames (first and refreshes) sent to all senders
    resume_frames: int
    cnps: int
    max_queue: int
    max_headroom_used: int  # the most an ingress went above xoff
    lost_bytes: int  # bytes beyond xoff + headroom (a headroom too small for the delay)
    fair_share_gbps: float
    tail_rates_gbps: List[float]  # per flow: mean RC over the last quarter
    tail_throughput_gbps: List[float]  # per flow: mean delivered over the last quarter
    tail_pause_frames: int

    @property
    def worst_deviation(self) -> float:
        """The largest relative distance of a flow's tail throughput and rate from the fair share."""
        values = self.tail_throughput_gbps + (self.tail_rates_gbps if self.config["dcqcn"] else [])
        return max(abs(v - self.fair_share_gbps) / self.fair_share_gbps for v in values)

    def summary(self) -> dict:
        return {"senders": self.config["senders"], "dcqcn": self.config["dcqcn"] is not None,
                "fair_share_gbps": self.fair_share_gbps, "tail_throughput_gbps": self.tail_throughput_gbps,
                "tail_rates_gbps": self.tail_rates_gbps, "worst_deviation": self.worst_deviation,
                "pause_frames": self.pause_frames, "tail_pause_frames": self.tail_pause_frames,
                "resume_frames": self.resume_frames, "cnps": self.cnps, "max_queue": self.max_queue,
                "max_headroom_used": self.max_headroom_used, "headroom": self.config["headroom"],
                "lost_bytes": self.lost_bytes}


class _ReactionPoint:
    """One sender's DCQCN state (rates in bytes per us)."""

    def __init__(self, line: float, p: DcqcnParams):
        self.p = p
        self.line = line
        self.rc = line  # current rate
        self.rt = line  # target rate
        self.alpha = 1.0
        self.active = False  # rate control starts with the first CNP
        self.alpha_clock = 0.0
        self.timer_clock = 0.0
        self.byte_count = 0.0
        self.i_t = 0
        self.i_b = 0
        self.rai = p.rai_mbps / 8  # Mb/s -> bytes per us
        self.rhai = p.rhai_mbps / 8
        self.min_rate = p.min_rate_mbps / 8

    def cnp(self) -> None:
        p = self.p
        self.active = True
        self.rt = self.rc
        self.rc = max(self.min_rate, self.rc * (1 - self.alpha / 2))
        self.alpha = (1 - p.g) * self.alpha + p.g
        self.alpha_clock = self.timer_clock = self.byte_count = 0.0
        self.i_t = self.i_b = 0

    def step(self, sent: float) -> None:
        """One microsecond passed and `sent` bytes went out."""
        if not self.active:
            return
        p = self.p
        self.alpha_clock += 1
        if self.alpha_clock >= p.alpha_timer_us:
            self.alpha_clock -= p.alpha_timer_us
            self.alpha *= 1 - p.g
        self.timer_clock += 1
        if self.timer_clock >= p.rate_timer_us:
            self.timer_clock -= p.rate_timer_us
            self.i_t += 1
            self._increase()
        self.byte_count += sent
        if self.byte_count >= p.byte_counter:
            self.byte_count -= p.byte_counter
            self.i_b += 1
            self._increase()

    def _increase(self) -> None:
        f = self.p.fast_recovery_steps
        if min(self.i_t, self.i_b) > f:
            self.rt += (min(self.i_t, self.i_b) - f) * self.rhai
        elif max(self.i_t, self.i_b) >= f:
            self.rt += self.rai
        self.rt = min(self.rt, self.line)
        self.rc = min((self.rt + self.rc) / 2, self.line)


def run_incast(cfg: IncastConfig) -> IncastResult:
    cfg.check()
    rng = random.Random(cfg.seed)
    n = cfg.senders
    line = cfg.speed_gbps * BYTES_PER_US_PER_GBPS
    rps = [_ReactionPoint(line, cfg.dcqcn) for _ in range(n)] if cfg.dcqcn else None
    rates = [line] * n
    ingress = [0.0] * n
    pausing = [False] * n
    delay = max(1, cfg.pause_delay_us)
    seen = [deque([False] * delay) for _ in range(n)]  # what each sender sees: the switch's state `delay` ago
    since_xoff = [0.0] * n
    refresh = pause_refresh_us(cfg.speed_gbps)
    packet_credit = [0.0] * n
    mark_credit = [0.0] * n
    fluid = cfg.marking == "fluid"
    starts = [i * cfg.stagger_us for i in range(n)]
    last_cnp = [-1e18] * n
    cnp_interval = cfg.dcqcn.cnp_interval_us if cfg.dcqcn else 0
    pause_frames = resume_frames = cnps = 0
    max_queue = max_over = lost = 0.0
    times: List[float] = []
    queue_series: List[int] = []
    rate_series = [[] for _ in range(n)]
    tput_series = [[] for _ in range(n)]
    pause_series: List[int] = []
    delivered = [0.0] * n
    tail_start = cfg.duration_us - cfg.duration_us // 4
    tail_delivered = [0.0] * n
    tail_rate = [0.0] * n
    tail_pause_start = None
    span = cfg.kmax - cfg.kmin
    for t in range(cfg.duration_us):
        queue = sum(ingress)
        if queue <= cfg.kmin:
            mark = 0.0
        elif queue >= cfg.kmax:
            mark = 1.0
        else:
            mark = cfg.pmax * (queue - cfg.kmin) / span
        for i in range(n):
            if t < starts[i]:
                continue
            paused = seen[i][0]
            sent = 0.0 if paused else rates[i]
            if sent:
                ingress[i] += sent
                if mark and rps is not None:
                    marked = False
                    if fluid:
                        mark_credit[i] += sent / cfg.frame * mark
                        if mark_credit[i] >= 1:
                            marked = True
                            mark_credit[i] -= int(mark_credit[i])
                    else:
                        packet_credit[i] += sent / cfg.frame
                        while packet_credit[i] >= 1:
                            packet_credit[i] -= 1
                            marked = marked or rng.random() < mark
                    if marked and t - last_cnp[i] >= cnp_interval:
                        last_cnp[i] = t
                        cnps += 1
                        rps[i].cnp()
            if rps is not None:
                rps[i].step(sent)
                rates[i] = rps[i].rc
            if t >= tail_start:
                tail_rate[i] += rates[i]
        # the egress port: one step of line rate, shared in proportion to each ingress's bytes
        queue = sum(ingress)
        max_queue = max(max_queue, queue)
        if queue > 0:
            share = min(1.0, line / queue)
            for i in range(n):
                out = ingress[i] * share
                ingress[i] -= out
                delivered[i] += out
                if t >= tail_start:
                    tail_delivered[i] += out
        # PFC per ingress
        for i in range(n):
            level = ingress[i]
            over = level - cfg.xoff
            if over > max_over:
                max_over = over
            if over > cfg.headroom:
                lost += over - cfg.headroom
                ingress[i] = cfg.xoff + cfg.headroom
            if not pausing[i] and level >= cfg.xoff:
                pausing[i] = True
                since_xoff[i] = 0.0
                pause_frames += 1
            elif pausing[i] and level <= cfg.xon:
                pausing[i] = False
                resume_frames += 1
            elif pausing[i]:
                since_xoff[i] += 1
                if since_xoff[i] >= refresh:
                    since_xoff[i] = 0.0
                    pause_frames += 1
            seen[i].append(pausing[i])
            seen[i].popleft()
        if t == tail_start:
            tail_pause_start = pause_frames
        if t % cfg.sample_us == cfg.sample_us - 1:
            times.append(t + 1)
            queue_series.append(int(sum(ingress)))
            pause_series.append(pause_frames)
            for i in range(n):
                rate_series[i].append(rates[i] / BYTES_PER_US_PER_GBPS)
                tput_series[i].append(delivered[i] / cfg.sample_us / BYTES_PER_US_PER_GBPS)
                delivered[i] = 0.0
    tail_len = cfg.duration_us - tail_start
    config = asdict(cfg)
    return IncastResult(
        config=config, times_us=times, queue=queue_series, rates_gbps=rate_series, throughput_gbps=tput_series,
        pause_frames_series=pause_series, pause_frames=pause_frames, resume_frames=resume_frames, cnps=cnps,
        max_queue=int(max_queue), max_headroom_used=int(max(0.0, max_over)), lost_bytes=int(lost),
        fair_share_gbps=cfg.speed_gbps / n,
        tail_rates_gbps=[r / tail_len / BYTES_PER_US_PER_GBPS for r in tail_rate],
        tail_throughput_gbps=[d / tail_len / BYTES_PER_US_PER_GBPS for d in tail_delivered],
        tail_pause_frames=pause_frames - (tail_pause_start or 0))


# --- the ring: a cyclic buffer dependency -------------------------------------------------


@dataclass
class RingConfig:
    switches: int = 3
    speed_gbps: float = 100.0
    duration_us: int = 3000
    burst_us: int = 500  # the hosts send at line rate this long, then stop
    hosts_per_switch: int = 2  # each sends at line rate: the ring links are oversubscribed
    xoff: int = 100_000
    xon: int = 100_000 - 2 * 9216
    pause_delay_us: int = 1
    watchdog_detect_us: Optional[int] = None  # None: no PFC watchdog
    watchdog_restore_us: int = 200
    sample_us: int = 5

    def check(self) -> None:
        if not 2 <= self.switches <= 16:
            raise NvmeofError(f"--switches {self.switches}: out of range", "give 2..16 switches in the ring")
        if not 0 < self.xon < self.xoff:
            raise NvmeofError(f"xon {self.xon} must be below xoff {self.xoff} and above 0", "give --xoff above --xon")
        if not 1 <= self.hosts_per_switch <= 8:
            raise NvmeofError(f"--hosts {self.hosts_per_switch}: out of range", "give 1..8 hosts per switch")
        if self.burst_us >= self.duration_us:
            raise NvmeofError(f"--burst {self.burst_us} us must be shorter than --duration {self.duration_us} us",
                              "leave time after the burst to see whether the ring drains")


@dataclass
class RingResult:
    config: dict
    times_us: List[float]
    ring_queues: List[List[int]]  # per switch: bytes in its ring ingress at each sample
    delivered_series: List[float]  # Gb/s delivered to all hosts in each sample interval
    delivered_bytes: int
    dropped_bytes: int  # by the watchdog
    left_in_switches: int  # bytes still queued at the end
    watchdog_events: List[Dict[str, float]]
    deadlocked_at_us: Optional[float]  # first time every ring link was paused with a transit head
    delivered_after_burst: int  # bytes delivered in the last half of the time after the burst

    @property
    def deadlocked(self) -> bool:
        """Still stuck at the end: bytes left in the switches and none delivered in the final stretch."""
        return self.left_in_switches > 0 and self.delivered_after_burst == 0

    @property
    def drained(self) -> bool:
        return self.left_in_switches == 0

    def summary(self) -> dict:
        return {"switches": self.config["switches"], "watchdog": self.config["watchdog_detect_us"] is not None,
                "deadlocked_at_us": self.deadlocked_at_us, "deadlocked": self.deadlocked, "drained": self.drained,
                "delivered_bytes": self.delivered_bytes, "dropped_bytes": self.dropped_bytes,
                "left_in_switches": self.left_in_switches, "watchdog_events": self.watchdog_events}


def _take(fifo: deque, flow_filter, budget: float) -> float:
    """Take up to `budget` bytes from the head of `fifo` while the head segment passes `flow_filter`."""
    taken = 0.0
    while fifo and budget > 0:
        seg = fifo[0]
        if not flow_filter(seg[0]):
            break
        amount = min(seg[1], budget)
        seg[1] -= amount
        budget -= amount
        taken += amount
        if seg[1] <= 1e-9:
            fifo.popleft()
    return taken


def run_ring(cfg: RingConfig) -> RingResult:
    cfg.check()
    n = cfg.switches
    line = cfg.speed_gbps * BYTES_PER_US_PER_GBPS
    host_q = [0.0] * n  # switch j's ingress from host j (all flow j, bound for link j)
    ring_q: List[deque] = [deque() for _ in range(n)]  # switch j's ingress from link j-1: [flow, bytes]
    ring_level = [0.0] * n
    link_paused = [False] * n  # switch j+1 pauses link j (its ring ingress is full)
    host_paused = [False] * n  # switch j pauses host j
    delay = max(1, cfg.pause_delay_us)
    link_seen = [deque([False] * delay) for _ in range(n)]
    host_seen = [deque([False] * delay) for _ in range(n)]
    paused_for = [0] * n  # how long link j has been paused with bytes waiting
    storm_until = [-1] * n  # watchdog: link j ignores PAUSE and drops its queue until then
    in_flight: List[List[tuple]] = [[] for _ in range(n)]  # bytes on link j this step -> ring_q[j+1]
    delivered = dropped = 0.0
    delivered_window = 0.0
    late_delivered = 0.0
    late_start = cfg.burst_us + (cfg.duration_us - cfg.burst_us) // 2
    deadlocked_at = None
    events: List[Dict[str, float]] = []
    times: List[float] = []
    queues_series = [[] for _ in range(n)]
    delivered_series: List[float] = []
    for t in range(cfg.duration_us):
        # hosts inject
        if t < cfg.burst_us:
            for j in range(n):
                if not host_seen[j][0]:
                    host_q[j] += line * cfg.hosts_per_switch
        # links deliver what they carried last step
        for j in range(n):
            nxt = (j + 1) % n
            for flow, amount in in_flight[j]:
                q = ring_q[nxt]
                if q and q[-1][0] == flow:
                    q[-1][1] += amount
                else:
                    q.append([flow, amount])
                ring_level[nxt] += amount
            in_flight[j] = []
        # each switch forwards
        for j in range(n):
            transit_flow = (j - 1) % n  # flow arriving from link j-1 that goes on over link j
            storm = t < storm_until[j]
            link_open = storm or not link_seen[j][0]
            q = ring_q[j]
            # local delivery from the head of the ring queue, up to the host link's rate
            budget_host = line
            budget_link = line if link_open else 0.0
            want_host = host_q[j] > 0
            want_transit = any(seg[0] == transit_flow for seg in q)
            if want_host and want_transit:  # round robin over the input ports: each host port and the ring port
                share_transit = budget_link / (cfg.hosts_per_switch + 1)
                share_host = budget_link - share_transit
            else:
                share_host = budget_link if want_host else 0.0
                share_transit = budget_link if want_transit else 0.0
            while q:
                head_flow = q[0][0]
                if head_flow == transit_flow:
                    if share_transit <= 0:
                        break  # head-of-line blocked
                    got = _take(q, lambda f: f == transit_flow, share_transit)
                    share_transit -= got
                    ring_level[j] -= got
                    if storm:
                        dropped += got
                    else:
                        in_flight[j].append((transit_flow, got))
                else:
                    if budget_host <= 0:
                        break
                    got = _take(q, lambda f: f != transit_flow, budget_host)
                    budget_host -= got
                    ring_level[j] -= got
                    delivered += got
                    delivered_window += got
                    if t >= late_start:
                        late_delivered += got
            # the host's own flow onto link j (with the transit share it did not use)
            take = min(host_q[j], share_host + max(0.0, share_transit))
            if take > 0:
                host_q[j] -= take
                if storm:
                    dropped += take
                else:
                    in_flight[j].append((j, take))
            if storm and q:  # the watchdog's drop action: what waits for link j goes
                for seg in list(q):
                    if seg[0] == transit_flow:
                        dropped += seg[1]
                        ring_level[j] -= seg[1]
                        q.remove(seg)
            # the watchdog: link j paused with bytes waiting for it
            waiting = host_q[j] > 0 or any(seg[0] == transit_flow for seg in q)
            if link_seen[j][0] and waiting and not storm:
                paused_for[j] += 1
                if cfg.watchdog_detect_us is not None and paused_for[j] >= cfg.watchdog_detect_us:
                    storm_until[j] = t + cfg.watchdog_restore_us
                    events.append({"switch": j, "detected_us": t, "restore_us": t + cfg.watchdog_restore_us})
                    paused_for[j] = 0
            else:
                paused_for[j] = 0
        # PFC decisions: switch j+1 about link j, switch j about host j
        for j in range(n):
            nxt = (j + 1) % n
            level = ring_level[nxt]
            if not link_paused[j] and level >= cfg.xoff:
                link_paused[j] = True
            elif link_paused[j] and level <= cfg.xon:
                link_paused[j] = False
            if not host_paused[j] and host_q[j] >= cfg.xoff:
                host_paused[j] = True
            elif host_paused[j] and host_q[j] <= cfg.xon:
                host_paused[j] = False
            link_seen[j].append(link_paused[j])
            link_seen[j].popleft()
            host_seen[j].append(host_paused[j])
            host_seen[j].popleft()
        if deadlocked_at is None and all(link_paused) and all(
                ring_q[(j + 1) % n] and ring_q[(j + 1) % n][0][0] == j for j in range(n)):
            deadlocked_at = float(t)
        if t % cfg.sample_us == cfg.sample_us - 1:
            times.append(t + 1)
            for j in range(n):
                queues_series[j].append(int(ring_level[j]))
            delivered_series.append(delivered_window / cfg.sample_us / BYTES_PER_US_PER_GBPS)
            delivered_window = 0.0
    left = sum(ring_level) + sum(host_q) + sum(a for link in in_flight for _f, a in link)
    return RingResult(
        config=asdict(cfg), times_us=times, ring_queues=queues_series, delivered_series=delivered_series,
        delivered_bytes=int(delivered), dropped_bytes=int(dropped), left_in_switches=int(round(left)),
        watchdog_events=events, deadlocked_at_us=deadlocked_at, delivered_after_burst=int(late_delivered))
