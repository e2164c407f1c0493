"""`fabric simulate`: the paper's qualitative results in the incast model, the PFC deadlock ring,
and the CLI with its PNGs."""
import json
from dataclasses import replace

import pytest

from nvmeof_roce.cli import main
from nvmeof_roce.errors import NvmeofError
from nvmeof_roce.fabric.plan import PAPER_DCQCN
from nvmeof_roce.fabric.simulate import IncastConfig, RingConfig, _ReactionPoint, run_incast, run_ring

INCAST = IncastConfig(senders=8, speed_gbps=100, duration_us=60000, stagger_us=1000)


@pytest.fixture(scope="module")
def incast_runs():
    return run_incast(replace(INCAST, dcqcn=None)), run_incast(INCAST)


def test_incast_converges_to_fair_share_with_dcqcn(incast_runs):
    _, dcqcn = incast_runs
    fair = dcqcn.fair_share_gbps
    assert fair == 12.5
    for rate, tput in zip(dcqcn.tail_rates_gbps, dcqcn.tail_throughput_gbps):
        assert abs(rate - fair) / fair < 0.10, dcqcn.tail_rates_gbps
        assert abs(tput - fair) / fair < 0.10, dcqcn.tail_throughput_gbps
    assert dcqcn.cnps > 0 and dcqcn.lost_bytes == 0


def test_the_incast_is_not_fair_from_the_start():
    """The staggered starts make the test above mean something: early in the run the senders are far apart."""
    early = run_incast(replace(INCAST, duration_us=20000))
    assert early.worst_deviation > 0.2, early.tail_rates_gbps


def test_dcqcn_cuts_pause_frames(incast_runs):
    pfc_only, dcqcn = incast_runs
    assert dcqcn.pause_frames < pfc_only.pause_frames / 10, (dcqcn.pause_frames, pfc_only.pause_frames)
    # once converged DCQCN keeps the queue below the PFC point: no PAUSE at all in the last quarter
    assert dcqcn.tail_pause_frames == 0 and pfc_only.tail_pause_frames > 1000
    # without congestion control PFC alone holds the senders at line rate and pauses them all the time
    assert pfc_only.tail_rates_gbps == [100.0] * 8 and pfc_only.cnps == 0


def test_headroom_from_the_plan_absorbs_the_pause_delay(incast_runs):
    for run in incast_runs:
        assert 0 < run.max_headroom_used <= run.config["headroom"] and run.lost_bytes == 0
    # a headroom smaller than what arrives during the pause delay loses bytes (the model is not lossless by fiat)
    short = run_incast(replace(INCAST, dcqcn=None, duration_us=3000, stagger_us=0, pause_delay_us=4, headroom=20000))
    assert short.lost_bytes > 0


def test_reaction_point_follows_the_paper():
    line = 12500.0  # 100 Gb/s in bytes per us
    rp = _ReactionPoint(line, PAPER_DCQCN)
    rp.cnp()  # alpha starts at 1: the first CNP halves the rate
    assert rp.rc == line / 2 and rp.rt == line and rp.alpha == pytest.approx(1.0)
    for _ in range(55 * 4):  # four timer periods: fast recovery, RC halfway to RT each time
        rp.step(0)
    assert rp.rc == pytest.approx(line - line / 2 / 16)
    assert rp.alpha == pytest.approx((1 - 1 / 256) ** 4)  # alpha decays every 55 us without a CNP
    for _ in range(55):  # the fifth event: iT = F, additive increase of Rai (40 Mb/s = 5 bytes/us); RT capped
        rp.step(0)
    assert rp.rt == line
    before, alpha = rp.rc, rp.alpha
    rp.cnp()  # RT = RC; RC = RC (1 - alpha / 2); alpha = (1 - g) alpha + g
    assert rp.rt == before and rp.rc == pytest.approx(before * (1 - alpha / 2))
    assert rp.alpha == pytest.approx((1 - 1 / 256) * alpha + 1 / 256)
    for _ in range(55 * 6):  # four fast-recovery events, then two additive ones: RT + 2 x Rai
        rp.step(0)
    assert rp.rt == pytest.approx(before + 2 * 5)


def test_ring_deadlocks_without_a_watchdog():
    r = run_ring(RingConfig())
    assert r.deadlocked_at_us is not None  # every link paused, every head a transit packet
    assert r.deadlocked and not r.drained
    assert r.delivered_after_burst == 0 and r.left_in_switches > 0 and r.dropped_bytes == 0


def test_ring_drains_with_a_watchdog():
    r = run_ring(RingConfig(watchdog_detect_us=200))
    assert r.deadlocked_at_us is not None  # the same cycle forms...
    assert r.watchdog_events and r.watchdog_events[0]["detected_us"] >= 200
    assert r.drained and not r.deadlocked  # ... and the watchdog breaks it
    assert r.dropped_bytes > 0  # at the price of the packets it drops


def test_ring_without_oversubscription_does_not_deadlock():
    """One host per switch: each ring link carries what it can, no queue reaches xoff, no cycle."""
    r = run_ring(RingConfig(hosts_per_switch=1))
    assert r.deadlocked_at_us is None and r.drained


@pytest.mark.parametrize("cfg,message", [
    (replace(INCAST, xon=200_000), "xon 200000 must be below xoff"),
    (replace(INCAST, kmin=600_000), "need Kmin < Kmax"),
    (replace(INCAST, stagger_us=10_000), "the last sender would start after half the run"),
])
def test_incast_config_errors(cfg, message):
    with pytest.raises(NvmeofError, match=message):
        run_incast(cfg)


@pytest.mark.parametrize("args,message", [
    (["--xoff", "20000"], "--xoff 20000: the pause point must leave room for xon"),
    (["--senders", "0"], "--senders 0: out of range"),
    (["--duration", "1", "--stagger", "1000"], "the last sender would start after half the run"),
    (["--speed", "slow"], "--speed 'slow': not a link speed"),
])
def test_cli_bad_input(capsys, args, message):
    assert main(["fabric", "simulate", "--scenario", "incast", *args]) == 1
    assert message in capsys.readouterr().err


def test_cli_json(capsys):
    assert main(["fabric", "simulate", "--json", "--duration", "20", "--stagger", "200", "--cable", "100m"]) == 0
    out = json.loads(capsys.readouterr().out)
    pfc_only, dcqcn = out["incast"]
    assert not pfc_only["dcqcn"] and dcqcn["dcqcn"]
    assert dcqcn["pause_frames"] < pfc_only["pause_frames"]
    assert out["inputs"]["pause_delay_us"] == 2  # 100 m both ways at 5 ns/m, plus 1 us
    assert dcqcn["headroom"] == 126976  # the plan's switch headroom for 100G, 100 m, MTU 9216
    no_wd, wd = out["ring"]
    assert no_wd["deadlocked"] and wd["drained"]


def test_cli_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["fabric", "simulate", "--duration", "10", "--stagger", "500", "--plot", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in ("incast.png", "ring.png"):
        png = tmp_path / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
        assert f"plot: {png}" in out
    assert "deadlocked" in out and "drained" in out


def test_plot_without_matplotlib_is_said_before_the_simulation_with_the_installed_package_s_fix(
        monkeypatch, tmp_path, capsys):
    """No matplotlib: `fabric simulate --plot` refuses before it simulates (not after minutes of it), naming the
    extra of the installed package and the distribution's package, not a command that works in a checkout only."""
    import sys
    from nvmeof_roce.fabric import commands
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    ran = []
    monkeypatch.setattr(commands, "run_incast", lambda *a, **k: ran.append("incast"))
    monkeypatch.setattr(commands, "run_ring", lambda *a, **k: ran.append("ring"))
    assert main(["fabric", "simulate", "--duration", "10", "--plot", str(tmp_path / "png")]) == 1
    err = capsys.readouterr().err
    assert ran == [] and not (tmp_path / "png").exists()
    assert "matplotlib is not installed" in err and "pip install 'nvmeof-roce[plot]'" in err, err
    assert "apt-get install python3-matplotlib" in err and "or run without --plot" in err
