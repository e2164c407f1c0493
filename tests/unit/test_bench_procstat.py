"""CPU, RSS and I/O counters from /proc and /sys (real captures from the lab guest), the fit, and the soak
job and CPU figures in a real bench run (fio on plain files standing in for NVMe-oF devices)."""
import os
import random
from pathlib import Path

import pytest

from nvmeof_roce.bench import procstat, report
from nvmeof_roce.bench.procstat import ProcessCpu, Sample, SystemCpu
from nvmeof_roce.bench.runner import BenchConfig, BenchRunner, select_jobs

from test_bench_runner import MACHINE, FileHost, FileTarget, needs_fio, work  # noqa: F401 (fixture)

PROC = Path(__file__).parent / "fixtures" / "bench" / "proc"


# --- parsers on real captures -------------------------------------------------------------------------------

def test_pid_stat_of_the_target_process():
    # `python3 -m nvmeof_roce target serve` in the lab guest, starting up, then after 2000 reads
    before = procstat.parse_pid_stat((PROC / "target-serve.stat").read_text())
    after = procstat.parse_pid_stat((PROC / "target-serve-after.stat").read_text())
    assert before == ProcessCpu(utime_ticks=664, stime_ticks=116)
    assert after == ProcessCpu(utime_ticks=1102, stime_ticks=316)


def test_pid_stat_with_spaces_and_parentheses_in_the_command_name():
    line = (PROC / "target-serve.stat").read_text().replace("(python3)", "(a b) (c)")
    assert procstat.parse_pid_stat(line) == ProcessCpu(664, 116)
    with pytest.raises(ValueError, match="no '\\)'"):
        procstat.parse_pid_stat("154 python3 R 1 2 3")
    with pytest.raises(ValueError, match="expected at least 15"):
        procstat.parse_pid_stat("154 (python3) R 153 0 0")


def test_vmrss_of_the_target_process():
    assert procstat.parse_vmrss((PROC / "target-serve.status").read_text()) == 26976 * 1024
    assert procstat.parse_vmrss((PROC / "target-serve-after.status").read_text()) == 32872 * 1024
    kthread = "\n".join(ln for ln in (PROC / "target-serve.status").read_text().splitlines()
                        if not ln.startswith(("VmRSS", "Rss")))
    with pytest.raises(ValueError, match="no VmRSS"):
        procstat.parse_vmrss(kthread)
    assert procstat.parse_vmrss((PROC / "target-serve-after.status").read_text(), "VmHWM") == 32872 * 1024


def test_memory_of_a_job_is_its_last_rss_the_highest_sampled_and_the_process_peak():
    samples = [Sample(t=0, rss_bytes=30 << 20, hwm_bytes=40 << 20), Sample(t=1, rss_bytes=36 << 20, hwm_bytes=40 << 20),
               Sample(t=2, rss_bytes=None), Sample(t=3, rss_bytes=33 << 20, hwm_bytes=41 << 20)]
    assert procstat.memory(samples) == {"rss_end_bytes": 33 << 20, "rss_peak_bytes": 36 << 20,
                                        "hwm_bytes": 41 << 20, "samples": 3}
    # the kernel's high-water mark lags the resident set: the peak is never below a sampled RSS
    lagging = [Sample(t=0, rss_bytes=30 << 20, hwm_bytes=29 << 20)]
    assert procstat.memory(lagging)["hwm_bytes"] == 30 << 20
    assert procstat.memory([Sample(t=0), Sample(t=1)]) is None  # no process: the kernel target


def test_proc_stat_of_the_lab_guest():
    # cpu  795 0 786 1326 7 0 6 0 0 0: user nice system idle iowait irq softirq steal guest guest_nice
    s = procstat.parse_proc_stat((PROC / "lab-guest.proc-stat").read_text())
    assert s == SystemCpu(busy_ticks=795 + 0 + 786 + 0 + 6 + 0, idle_ticks=1326 + 7, softirq_ticks=6)
    assert s.total_ticks == 795 + 786 + 6 + 1326 + 7
    with pytest.raises(ValueError, match="no aggregate"):
        procstat.parse_proc_stat("cpu0 1 2 3 4\nintr 5\n")


def test_block_stat():
    # /sys/block/vda/stat: reads completed is field 1, writes completed field 5
    assert procstat.parse_block_stat((PROC / "vda.block-stat").read_text()) == 775252 + 2460351
    with pytest.raises(ValueError, match="expected at least 11"):
        procstat.parse_block_stat("1 2 3")


def test_block_device_ios_of_a_multipath_head_counts_its_paths(tmp_path):
    real = (PROC / "vda.block-stat").read_text()
    zero = " ".join(["0"] * 17) + "\n"
    for name, text in (("nvme1n1", zero), ("nvme1c1n1", real), ("nvme1c3n1", real), ("nvme1c1n2", real),
                       ("sda", real)):
        (tmp_path / "block" / name).mkdir(parents=True)
        (tmp_path / "block" / name / "stat").write_text(text)
    one = 775252 + 2460351
    # the head keeps no statistics (before Linux 6.3): its two paths to namespace 1 do
    assert procstat.block_device_ios("/dev/nvme1n1", sysfs=str(tmp_path)) == 2 * one
    assert procstat.block_device_ios("/dev/sda", sysfs=str(tmp_path)) == one
    assert procstat.block_device_ios("/dev/nvme9n1", sysfs=str(tmp_path)) is None


def test_readers_on_this_machine():
    me = os.getpid()
    cpu = procstat.process_cpu(me)
    assert cpu is not None and cpu.utime_ticks + cpu.stime_ticks > 0
    assert procstat.process_rss(me) > 1 << 20
    assert procstat.system_cpu().total_ticks > 0
    assert procstat.process_cpu(2 ** 22 + 12345) is None  # no such process (pid_max is at most 2^22)
    assert procstat.block_device_ios("/dev/no-such-disk") is None


# --- from two samples to a cost -----------------------------------------------------------------------------

def _sample(name: str, t: float, ios: int) -> Sample:
    suffix = "-after" if name == "after" else ""
    return Sample(t=t, pid_cpu=procstat.parse_pid_stat((PROC / f"target-serve{suffix}.stat").read_text()),
                  rss_bytes=procstat.parse_vmrss((PROC / f"target-serve{suffix}.status").read_text()),
                  system=procstat.parse_proc_stat((PROC / f"lab-guest{suffix}.proc-stat").read_text()), ios=ios)


def test_cpu_cost_between_the_two_captures():
    cost = procstat.cpu_cost(_sample("before", 100.0, 0), _sample("after", 110.0, 2000), 2000, "test",
                             clk_tck=100)
    # target: user 1102-664 = 438 ticks, system 316-116 = 200 ticks -> 6.38 s for 2000 I/Os
    assert cost["target_user_s"] == 4.38 and cost["target_system_s"] == 2.0 and cost["target_cpu_s"] == 6.38
    assert cost["target_us_per_io"] == 3190.0 and cost["target_cpu_percent"] == 63.8
    # guest: busy (1319+1231+31) - (795+786+6) = 994 ticks; idle (1608+32) - (1326+7) = 307 ticks
    assert cost["guest_busy_s"] == 9.94 and cost["guest_us_per_io"] == 4970.0
    assert cost["guest_busy_percent"] == pytest.approx(100 * 994 / (994 + 307), abs=0.05)
    assert cost["ios"] == 2000 and cost["wall_s"] == 10.0 and cost["ios_source"] == "test"


def test_cpu_cost_without_a_process_or_without_io():
    before, after = _sample("before", 0.0, 0), _sample("after", 5.0, 0)
    before.pid_cpu = after.pid_cpu = None  # the kernel target
    cost = procstat.cpu_cost(before, after, None)
    assert cost["target_cpu_s"] is None and cost["target_us_per_io"] is None
    assert cost["guest_busy_s"] == 9.94 and cost["guest_us_per_io"] is None


def test_schedstat_of_a_task_and_a_process_s_threads_summed(tmp_path):
    # a capture of /proc/PID/task/TID/schedstat: on-CPU ns, run-delay ns, timeslices
    one = procstat.parse_task_schedstat((PROC / "shell-task.schedstat").read_text())
    assert one == procstat.SchedStat(424662616, 1481080484, 986)
    with pytest.raises(ValueError, match="expected 3"):
        procstat.parse_task_schedstat("12 34\n")
    for tid, text in (("10", "100 20 3\n"), ("11", "1000 200 30\n"), ("12", "")):  # 12: it ended while read
        (tmp_path / "10" / "task" / tid).mkdir(parents=True)
        (tmp_path / "10" / "task" / tid / "schedstat").write_text(text)
    assert procstat.process_sched(10, proc=str(tmp_path)) == procstat.SchedStat(1100, 220, 33)
    assert procstat.process_sched(99, proc=str(tmp_path)) is None


def test_schedstat_of_the_lab_guest_every_cpu_summed():
    # cpuN: 6 counters, then running ns, run-delay ns, timeslices (version 15); domain lines are not CPUs
    s = procstat.parse_proc_schedstat((PROC / "lab-guest.schedstat").read_text())
    assert s == procstat.SchedStat(7330756914 + 6781932931, 629965750 + 435452689, 1129 + 1020)
    with pytest.raises(ValueError, match="version 14: expected 15 or later"):
        procstat.parse_proc_schedstat("version 14\ncpu0 1 2 3 4 5 6 7 8 9\n")


def test_where_the_time_went_per_io():
    before = Sample(t=0.0, sched=procstat.SchedStat(1_000_000, 2_000_000, 10),
                    system_sched=procstat.SchedStat(0, 5_000_000, 0), system=SystemCpu(100, 100, 10))
    after = Sample(t=1.0, sched=procstat.SchedStat(3_000_000, 6_000_000, 1010),
                   system_sched=procstat.SchedStat(0, 13_000_000, 0), system=SystemCpu(150, 150, 12))
    cost = procstat.cpu_cost(before, after, 1000, clk_tck=100)
    assert cost["target_on_cpu_us_per_io"] == 2.0 and cost["target_run_delay_us_per_io"] == 4.0
    assert cost["target_wakeups_per_io"] == 1.0  # one timeslice per I/O: woken for each
    assert cost["guest_run_delay_us_per_io"] == 8.0 and cost["guest_softirq_us_per_io"] == 20.0
    cost = procstat.cpu_cost(before, after, None, clk_tck=100)
    assert cost["target_run_delay_us_per_io"] is None and cost["target_wakeups_per_io"] is None


# --- the fit --------------------------------------------------------------------------------------------

def test_linear_fit_exact_and_noisy():
    slope, intercept, r2 = procstat.linear_fit([0, 1, 2, 3], [5, 7, 9, 11])
    assert (slope, intercept, r2) == (2.0, 5.0, 1.0)
    rng = random.Random(12)
    xs = list(range(0, 1_000_000, 10_000))
    ys = [30e6 + 64 * x + rng.gauss(0, 50_000) for x in xs]
    slope, intercept, r2 = procstat.linear_fit(xs, ys)
    assert slope == pytest.approx(64, rel=0.01) and intercept == pytest.approx(30e6, rel=0.001) and r2 > 0.99
    assert procstat.linear_fit([0, 1, 2], [3, 3, 3]) == (0.0, 3.0, None)
    with pytest.raises(ValueError, match="two points"):
        procstat.linear_fit([1], [1])
    with pytest.raises(ValueError, match="same x"):
        procstat.linear_fit([1, 1], [1, 2])


def test_rss_growth_per_million_commands_skips_the_warm_up():
    # a warm-up step of 8 MiB in the first 20k commands, then 64 B per command (64 MiB per million: today's leak)
    samples = []
    for i, ios in enumerate(range(1000, 221_000, 10_000)):
        rss = 40 << 20 if ios - 1000 < 20_000 else (48 << 20) + 64 * (ios - 1000)
        samples.append(Sample(t=float(i), rss_bytes=rss, ios=ios))
    samples.append(Sample(t=99.0, rss_bytes=None, ios=None))  # a sample without a reading is left out
    got = procstat.rss_growth(samples, skip_commands=20_000)
    assert got["growth_bytes_per_million"] == 64_000_000 and got["r2"] == 1.0
    assert got["points"][0] == [0, 40 << 20] and got["commands"] == 210_000 and got["samples"] == 22
    assert got["rss_start_bytes"] == 40 << 20 and got["rss_max_bytes"] == got["rss_end_bytes"]
    # without the skip, the warm-up step bends the line upwards
    assert procstat.rss_growth(samples)["growth_bytes_per_million"] > 64_000_000
    flat = procstat.rss_growth([Sample(t=0, rss_bytes=1 << 20, ios=5), Sample(t=1, rss_bytes=1 << 20, ios=5)])
    assert flat["growth_bytes_per_million"] is None  # one x only: no slope
    assert procstat.rss_growth([Sample(t=0)]) is None


def test_sampler_samples_in_the_background():
    counter = iter(range(1000))
    sampler = procstat.Sampler(os.getpid(), lambda: next(counter), interval=0.01).start()
    import time
    time.sleep(0.2)
    last = sampler.stop()
    assert len(sampler.samples) >= 3 and sampler.samples[-1] is last
    assert [s.ios for s in sampler.samples] == list(range(len(sampler.samples)))
    assert all(s.rss_bytes and s.pid_cpu and s.system for s in sampler.samples)


def test_formatting_of_cost():
    assert report.fmt_us(23.456) == "23.5" and report.fmt_us(1234.5) == "1234" and report.fmt_us(None) == "-"
    assert report.fmt_bytes(64 << 20) == "64.0 MiB" and report.fmt_bytes(-2048) == "-2.0 KiB"
    assert report.fmt_bytes(12) == "12 B" and report.fmt_bytes(None) == "-"


# --- in a run: every job's cost, the soak's RSS ----------------------------------------------------------

class ProcessTarget(FileTarget):
    """A file target "served" by this test process, so the bench has a real PID to sample."""

    @property
    def pid(self):
        return os.getpid()


@needs_fio
def test_run_records_cpu_per_job_and_the_soak(work):  # noqa: F811 (fixture)
    pytest.importorskip("matplotlib")
    events, lines = [], []
    targets = [FileTarget("kernel", work, events), ProcessTarget("userspace", work, events)]
    cfg = BenchConfig(out_dir=work / "out", traddr="127.0.0.1", runtime=1, ramp=0, size="8M", perftest=False,
                      soak_ios=3000, soak_interval=0.05, soak_skip=0)
    result = BenchRunner(cfg, targets, select_jobs("randread-4k-qd1,soak"), FileHost(events),
                         progress=lines.append, machine=MACHINE).run()
    assert result["ok"], result["errors"]
    assert result["params"]["soak_ios"] == 3000
    job = result["jobs"]["randread-4k-qd1"]
    for t in ("kernel", "userspace"):
        cpu = job["results"][t]["repeats"][0]["cpu"]
        assert cpu["ios"] > 0 and cpu["guest_busy_s"] >= 0 and cpu["guest_us_per_io"] is not None
        # a plain file has no block-device statistics of its own: fio's count is used and said so
        assert cpu["ios_source"].startswith("fio's count")
    assert job["results"]["kernel"]["repeats"][0]["cpu"]["target_us_per_io"] is None
    assert job["results"]["userspace"]["median"]["cpu"]["target_us_per_io"] is not None

    soak = result["jobs"]["soak"]
    assert soak["kind"] == "soak"
    k = soak["results"]["kernel"]["repeats"][0]
    u = soak["results"]["userspace"]["repeats"][0]
    # writes and their verify reads together; fio ends the batch of writes it is in (verify_backlog 1024)
    for rec in (k, u):
        done = rec["soak"]["commands_done"]
        assert 3000 <= done < 3000 + 2 * 1024
        assert rec["soak"]["verify_errors"] == 0 and rec["soak"]["live_changes"] is None
        assert "this target has no control socket" in rec["soak"]["note"]
    assert k["soak"]["rss"] is None and "no target process" in k["soak"]["note"]
    rss = u["soak"]["rss"]
    assert rss["samples"] >= 2 and rss["points"][-1][0] == u["soak"]["commands_done"]
    assert rss["growth_bytes_per_million"] is not None
    # every job says what the target held: its RSS at the end and the highest sampled (this process's own)
    for name in ("randread-4k-qd1", "soak"):
        memory = result["jobs"][name]["results"]["userspace"]["repeats"][0]["memory"]
        assert 0 < memory["rss_end_bytes"] <= memory["rss_peak_bytes"] <= memory["hwm_bytes"]
        assert result["jobs"][name]["results"]["userspace"]["median"]["memory"]["rss_end_bytes"] == \
            memory["rss_end_bytes"]
        assert result["jobs"][name]["results"]["kernel"]["repeats"][0]["memory"] is None
    assert soak["results"]["userspace"]["median"]["rss_growth_bytes_per_million"] == rss["growth_bytes_per_million"]
    assert any("RSS" in ln and "per million commands" in ln for ln in lines)
    # the region was written once before each target's soak, outside the sampled window
    assert (work / "out" / "raw" / "soak-prefill.userspace.json").exists()
    assert sum("writing the 8M region once first" in ln for ln in lines) == 2

    text = report.render(result)
    assert "cost and memory" in text and "n/a (no process)" in text and "RSS growth /M cmds" in text
    assert "RSS peak" in text and report.fmt_bytes(memory["rss_end_bytes"]) in text
    md = report.render_markdown(result, "img")
    assert "| `soak` | kernel |" in md and "![soak: target RSS against commands](img/soak.png)" in md
    from nvmeof_roce.bench.plot import plot_all
    made = {p.name for p in plot_all(result, work / "plots")}
    assert {"cpu.png", "soak.png"} <= made
