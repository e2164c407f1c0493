"""The bench runner, report, plots and command, with real fio on plain files standing in for NVMe-oF devices.

`FileTarget` "exports" a file and `FileHost` "connects" by handing its path to fio: everything else (the
interleaving, the cleanup on failures, the JSON, the table, the charts) is the real code.
"""
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from nvmeof_roce.bench import report, runner as runner_mod
from nvmeof_roce.bench.runner import BenchConfig, BenchRunner, select_jobs
from nvmeof_roce.bench.targets import Host, TargetUnderTest
from nvmeof_roce.cli import main
from nvmeof_roce.errors import NvmeofError

needs_fio = pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (apt-get install fio)")


class FileTarget(TargetUnderTest):
    kind = "plain file (test double)"

    def __init__(self, name, directory: Path, events: list, fail_setup=False, check_error=None):
        self.name = name
        super().__init__("127.0.0.1", 4420)
        self.path = directory / f"{name}.img"
        self.events = events
        self.fail_setup = fail_setup
        self.check_error = check_error

    def check(self):
        if self.check_error:
            raise NvmeofError(self.check_error, "a fix")

    def setup(self):
        self.events.append(("setup", self.name))
        if self.fail_setup:
            raise NvmeofError(f"{self.name} failed to start")
        with open(self.path, "wb") as f:
            f.truncate(16 << 20)

    def teardown(self):
        self.events.append(("teardown", self.name))
        if self.path.exists():
            self.path.unlink()


class FileHost(Host):
    name = "file host (test double)"

    def __init__(self, events, fail_on_connect=None):
        self.events = events
        self.connected_to = set()
        self.connects = 0
        self.fail_on_connect = fail_on_connect

    def connect(self, target):
        self.connects += 1
        self.events.append(("connect", target.name))
        self.connected_to.add(target.name)  # like nvme connect: the failure may come after the connection
        if self.fail_on_connect == self.connects:
            raise NvmeofError("no namespace block device appeared")
        if not target.path.exists():
            raise NvmeofError(f"{target.name} is not set up")
        return str(target.path)

    def disconnect(self, target):
        self.events.append(("disconnect", target.name))
        self.connected_to.discard(target.name)


def _o_direct_ok(directory: Path) -> bool:
    try:
        fd = os.open(directory / ".probe", os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(directory / ".probe")
    return True


@pytest.fixture
def work(tmp_path):
    if not _o_direct_ok(tmp_path):
        pytest.skip("no O_DIRECT in the temporary directory")
    return tmp_path


def _config(out, **kw):
    kw.setdefault("runtime", 1)
    kw.setdefault("ramp", 0)
    kw.setdefault("size", "8M")
    kw.setdefault("perftest", False)
    return BenchConfig(out_dir=out, traddr="127.0.0.1", **kw)


MACHINE = {"hostname": "test", "kernel": "x", "lab": False}


def _runner(work, events, targets=None, jobs="randread-4k-qd1,randwrite-4k-qd32", host=None, lines=None, **kw):
    targets = targets or [FileTarget("kernel", work, events), FileTarget("userspace", work, events)]
    cfg_kw = {k: kw.pop(k) for k in list(kw) if k in ("repeats", "runtime", "ramp", "size", "perftest",
                                                      "perftest_tests", "ratio")}
    return BenchRunner(_config(work / "out", **cfg_kw), targets, select_jobs(jobs), host or FileHost(events),
                       progress=(lines.append if lines is not None else (lambda m: None)), machine=MACHINE, **kw)


# --- the full run -----------------------------------------------------------------------------------

@needs_fio
def test_interleaved_run_with_repeats(work):
    events, lines = [], []
    host = FileHost(events)
    result = _runner(work, events, host=host, lines=lines, repeats=2).run()

    # set up both, then job by job A B A B, each job connected and disconnected, then torn down in reverse
    per_job = []
    for _ in range(2):
        for _job in ("randread-4k-qd1", "randwrite-4k-qd32"):
            for t in ("kernel", "userspace"):
                per_job += [("connect", t), ("disconnect", t)]
    assert events == ([("setup", "kernel"), ("setup", "userspace")] + per_job +
                      [("teardown", "userspace"), ("teardown", "kernel")])
    assert host.connected_to == set()

    assert result["schema"] == report.SCHEMA and result["ok"] is True
    assert result["params"]["targets"] == ["kernel", "userspace"] and result["params"]["repeats"] == 2
    assert result["date"].endswith("Z") and result["machine"] == MACHINE
    for name in ("randread-4k-qd1", "randwrite-4k-qd32"):
        job = result["jobs"][name]
        assert job["kind"] == "fio" and job["description"]
        for t in ("kernel", "userspace"):
            slot = job["results"][t]
            assert [r["repeat"] for r in slot["repeats"]] == [1, 2]
            iops = sorted(r["iops"] for r in slot["repeats"])
            assert all(v > 0 for v in iops) and slot["median"]["iops"] == pytest.approx(sum(iops) / 2)
            for r in slot["repeats"]:
                assert (work / "out" / r["raw"]).exists()
                assert set(r["lat_us"]) == {"p50", "p90", "p99", "p99.9"} and r["errors"] == 0
        ratio = job["ratio"]
        k, u = job["results"]["kernel"]["median"], job["results"]["userspace"]["median"]
        assert ratio["numerator"] == "userspace" and ratio["denominator"] == "kernel"
        assert ratio["iops"] == pytest.approx(u["iops"] / k["iops"])
        assert ratio["p99"] == pytest.approx(u["lat_us"]["p99"] / k["lat_us"]["p99"])
    fio_lines = [ln for ln in lines if ln.startswith("bench [")]
    assert len(fio_lines) == 8 and fio_lines[0].startswith("bench [1/8] randread-4k-qd1 on kernel (repeat 1/2): ")
    assert "IOPS" in fio_lines[0] and "p99" in fio_lines[0]

    # it all survives a round trip through the JSON file, and renders
    path = report.write_json(result, work / "out" / "bench.json")
    again = report.load_json(work / "out")
    assert again == json.loads(path.read_text())
    text = report.render(again)
    assert "randwrite-4k-qd32" in text and "userspace/kernel" in text and "x" in text
    # the docs section: one row per job and target from the medians, then the bold ratio row
    md = report.render_markdown(again, "img")
    k = again["jobs"]["randread-4k-qd1"]["results"]["kernel"]["median"]
    assert f"| `randread-4k-qd1` | kernel | {report.fmt_iops(k['iops'])} |" in md
    assert md.count("| | **userspace/kernel** |") == 2
    assert f"**{report.fmt_ratio(again['jobs']['randwrite-4k-qd32']['ratio']['iops'])}**" in md
    assert "![IOPS per job](img/iops.png)" in md and "2 repeat(s)" in md


@needs_fio
def test_failure_mid_run_disconnects_and_tears_everything_down(work):
    events = []
    host = FileHost(events, fail_on_connect=3)
    with pytest.raises(NvmeofError, match="no namespace block device"):
        _runner(work, events, host=host).run()
    assert host.connected_to == set()
    assert events[-3:] == [("disconnect", "kernel"), ("teardown", "userspace"), ("teardown", "kernel")]
    assert not (work / "kernel.img").exists() and not (work / "userspace.img").exists()


@needs_fio
def test_interrupt_during_fio_cleans_up(work):
    events = []
    host = FileHost(events)

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _runner(work, events, host=host, fio_runner=interrupted).run()
    assert host.connected_to == set()
    assert ("teardown", "kernel") in events and ("teardown", "userspace") in events


def test_second_target_failing_to_start_tears_down_the_first(work):
    events = []
    targets = [FileTarget("kernel", work, events), FileTarget("userspace", work, events, fail_setup=True)]
    with pytest.raises(NvmeofError, match="userspace failed to start"):
        _runner(work, events, targets=targets).run()
    assert events == [("setup", "kernel"), ("setup", "userspace"), ("teardown", "userspace"), ("teardown", "kernel")]


@needs_fio
def test_a_fio_failure_is_recorded_and_the_run_goes_on(work):
    events = []
    calls = []

    def flaky(job, device, *a, **k):
        calls.append(job.name)
        if len(calls) == 1:
            raise NvmeofError("fio randread-4k-qd1 failed (exit 1): device vanished")
        return runner_mod.run_fio(job, device, *a, **k)

    result = _runner(work, events, fio_runner=flaky).run()
    assert len(calls) == 4
    bad = result["jobs"]["randread-4k-qd1"]["results"]["kernel"]
    assert bad["errors"] == 1 and "device vanished" in bad["repeats"][0]["error_text"]
    assert bad["median"]["iops"] is None
    assert result["jobs"]["randread-4k-qd1"]["ratio"]["iops"] is None
    assert result["jobs"]["randwrite-4k-qd32"]["results"]["kernel"]["errors"] == 0
    assert result["ok"] is False
    assert "device vanished" in report.render(result)


def test_preflight_lists_every_problem_and_sets_nothing_up(work, monkeypatch):
    events = []
    monkeypatch.setenv("PATH", str(work))  # no fio, no perftest
    targets = [FileTarget("kernel", work, events, check_error="nvmet is not available"),
               FileTarget("userspace", work, events, check_error="the userspace target is not available")]
    with pytest.raises(NvmeofError) as exc:
        _runner(work, events, targets=targets, perftest=True, perftest_tests=("ib_send_lat",)).run()
    msg = str(exc.value)
    for part in ("cannot run here", "fio: command not found", "ib_send_lat: command not found",
                 "nvmet is not available", "the userspace target is not available"):
        assert part in msg
    assert events == []


def test_perftest_results_and_failures_are_recorded(work):
    from nvmeof_roce.bench.perftest import PerftestResult, parse_perftest_output
    fixture = Path(__file__).parent / "fixtures" / "bench" / "perftest-ib_write_lat-rdma_cm.client.txt"
    seen = []

    def fake_perftest(test, address, **kw):
        seen.append((test, kw["port"], kw["raw_output"].name))
        if test == "ib_read_lat":
            raise NvmeofError("ib_read_lat client failed to run")
        return PerftestResult(test=test, device="rxe0", address=address, rdma_cm=True, gid_index=None,
                              rows=parse_perftest_output(fixture.read_text()))

    events = []
    r = _runner(work, events, jobs="randread-4k-qd1", targets=[FileTarget("kernel", work, events)],
                perftest=True, perftest_tests=("ib_write_lat", "ib_read_lat"), perftest_runner=fake_perftest)
    r.jobs = []  # perftest only
    r.preflight = lambda: None  # no perftest binaries or RDMA here; the preflight has its own test
    result = r.run()
    assert [s[0] for s in seen] == ["ib_write_lat", "ib_read_lat"] and seen[0][1] != seen[1][1]
    assert result["perftest"]["ib_write_lat"]["t_typical_us"] > 0
    assert result["perftest"]["ib_read_lat"]["error"].startswith("ib_read_lat client failed")
    assert result["ok"] is False
    text = report.perftest_table(result)
    table_lines, error_lines = text.splitlines()[:4], text.splitlines()[4:]
    assert error_lines == ["ib_read_lat: ib_read_lat client failed to run"]  # under the table, whole
    assert max(len(line) for line in table_lines) < 80  # the message does not widen the table's columns
    assert "ib_read_lat: ib_read_lat client failed to run" in report.render(result)


def test_initiator_perf_jobs_go_through_the_hook(work):
    events = []
    got = []

    def fake_perf(job, target, config, raw):
        got.append((job.name, target.name, job.params["qd"]))
        return {"iops": 1000.0 * job.params["qd"], "bw_bytes": 4096000.0, "lat_us": {"p50": 10.0, "p99": 20.0},
                "errors": 0, "error_text": ""}

    r = _runner(work, events, jobs="uinit-randread-4k-qd1", host=None, initiator_perf=fake_perf)
    r.preflight = lambda: None
    result = r.run()
    assert got == [("uinit-randread-4k-qd1", "kernel", 1), ("uinit-randread-4k-qd1", "userspace", 1)]
    assert "connect" not in [e[0] for e in events]  # our initiator connects by itself
    assert result["jobs"]["uinit-randread-4k-qd1"]["kind"] == "initiator-perf"
    assert result["jobs"]["uinit-randread-4k-qd1"]["ratio"]["iops"] == pytest.approx(1.0)


# --- bench --host-cpus: the host's load on chosen CPUs, the same for every target ----------------------------

AFFINITY = ("import json, os; print(json.dumps({'iops': len(os.sched_getaffinity(0)), 'errors': 0,"
            " 'latency_us': {'p50': min(os.sched_getaffinity(0))}}))")


def test_pinned_to_runs_a_child_on_those_cpus_only():
    import subprocess
    cpu = max(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", AFFINITY], preexec_fn=runner_mod.pinned_to([cpu]),
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["iops"] == 1 and json.loads(out)["latency_us"]["p50"] == cpu
    assert runner_mod.pinned_to(None) is None and runner_mod.pinned_to([]) is None


@needs_fio
def test_host_cpus_reach_fio_and_our_initiator_and_the_record(work, monkeypatch):
    cpu = max(os.sched_getaffinity(0))
    events, seen = [], []

    def fio(job, device, *a, **k):
        seen.append(k.get("cpus"))
        return runner_mod.run_fio(job, device, *a, **k)

    # our initiator's perf replaced by a child that reports the CPUs it may run on
    monkeypatch.setattr(runner_mod, "initiator_perf_command", lambda *a, **k: [sys.executable, "-c", AFFINITY])
    targets = [FileTarget("kernel", work, events)]
    runner = BenchRunner(_config(work / "out", host_cpus=[cpu]), targets,
                         select_jobs("randread-4k-qd1,uinit-randread-4k-qd1"), FileHost(events),
                         progress=lambda m: None, machine=MACHINE, fio_runner=fio)
    runner.preflight = lambda: None
    result = runner.run()
    assert seen == [[cpu]]
    uinit = result["jobs"]["uinit-randread-4k-qd1"]["results"]["kernel"]["repeats"][0]
    assert (uinit["iops"], uinit["lat_us"]["p50"]) == (1, cpu)  # the child ran on that one CPU
    assert result["params"]["host_cpus"] == [cpu]
    assert result["jobs"]["randread-4k-qd1"]["results"]["kernel"]["repeats"][0]["errors"] == 0


def test_host_cpus_outside_the_bench_s_affinity_are_refused():
    from nvmeof_roce.bench.commands import cpu_list
    with pytest.raises(NvmeofError, match=r"--host-cpus 0,4095: this process may not run on CPU\(s\) 4095") as err:
        cpu_list("--host-cpus", "0,4095", here=True)
    assert err.value.fix.startswith("use CPUs of ") and str(min(os.sched_getaffinity(0))) in err.value.fix
    with pytest.raises(NvmeofError, match="--host-cpus 'x': not a list of CPU numbers"):
        cpu_list("--host-cpus", "x", here=True)
    assert cpu_list("--userspace-cpus", "4095") == [4095]  # serve checks its own where it runs


def test_initiator_perf_command_and_output(work):
    t = FileTarget("userspace", work, [])
    cmd = runner_mod.initiator_perf_command(t, {"rw": "randwrite", "bs": 4096, "qd": 32}, 5, 1.5)
    assert cmd[1:5] == ["-m", "nvmeof_roce", "initiator", "perf"]
    opt = {cmd[i]: cmd[i + 1] for i in range(5, len(cmd) - 1, 2)}
    assert opt["--nqn"] == t.subnqn and opt["--trsvcid"] == "4420" and opt["--queue-depth"] == "32"
    assert opt["--read-percent"] == "0" and opt["--runtime"] == "5" and opt["--ramp"] == "1.5"
    assert cmd[-1] == "--json" and "--data-path" not in cmd  # the initiator's default data path
    cmd = runner_mod.initiator_perf_command(t, runner_mod.INITIATOR_PERF_JOBS["uinit-py-randread-4k-qd32"], 5)
    assert cmd[-3:] == ["--data-path", "python", "--json"]
    got = runner_mod.parse_initiator_perf(
        '{"iops": 812.5, "bandwidth_bytes": 3328000.0, "ios": 4062, "errors": 0, "runtime_s": 5.0,'
        ' "latency_us": {"p50": 35000.0, "p90": 52000.0, "p99": 80000.0, "p99.9": 91000.0, "mean": 39000.0}}')
    assert got["iops"] == 812.5 and got["bw_bytes"] == 3328000.0 and got["lat_mean_us"] == 39000.0
    assert got["lat_us"] == {"p50": 35000.0, "p90": 52000.0, "p99": 80000.0, "p99.9": 91000.0}
    assert got["errors"] == 0
    assert runner_mod.parse_initiator_perf('{"iops": 1, "errors": 0}', returncode=1, stderr="boom")["errors"] == 1
    with pytest.raises(NvmeofError, match="no JSON"):
        runner_mod.parse_initiator_perf("Traceback ...", 1, "Traceback ...")


def test_runner_refuses_bad_arguments(work):
    events = []
    with pytest.raises(NvmeofError, match="no target"):
        BenchRunner(_config(work), [], select_jobs(None), FileHost(events))
    with pytest.raises(NvmeofError, match="twice"):
        BenchRunner(_config(work), [FileTarget("kernel", work, events), FileTarget("kernel", work, events)],
                    select_jobs(None), FileHost(events))
    with pytest.raises(NvmeofError, match="repeats"):
        BenchRunner(_config(work, repeats=0), [FileTarget("kernel", work, events)], select_jobs(None),
                    FileHost(events))


def test_select_jobs():
    all_fio = select_jobs(None)
    assert all_fio and all(j.kind == "fio" for j in all_fio)
    assert [j.name for j in select_jobs("all")] == [j.name for j in all_fio]
    assert "soak" not in [j.name for j in all_fio]  # a count, not a time: only when named
    soak = select_jobs("soak")
    assert [(j.name, j.kind) for j in soak] == [("soak", "soak")] and soak[0].fio_job.report == "write"
    picked = select_jobs("seqwrite-128k-qd16, randread-4k-qd1.fio,seqwrite-128k-qd16")
    assert [j.name for j in picked] == ["seqwrite-128k-qd16", "randread-4k-qd1"]
    with pytest.raises(NvmeofError, match="unknown job 'nope'") as exc:
        select_jobs("randread-4k-qd1,nope")
    assert "randread-4k-qd32" in exc.value.fix


# --- report ---------------------------------------------------------------------------------------------

def _result_with(values):
    """values: {target: [(iops, p99), ...]} for one job."""
    res = report.new_result(date="2026-01-01T00:00:00Z", machine=MACHINE,
                            params={"targets": list(values), "repeats": 3, "traddr": "x"}, targets={})
    report.add_job(res, "j", kind="fio")
    for t, reps in values.items():
        for i, (iops, p99) in enumerate(reps, 1):
            report.add_repeat(res, "j", t, report.repeat_record(i, iops=iops, bw_bytes=iops * 4096,
                                                                 lat_us={"p50": p99 / 2, "p99": p99}))
    return report.finalize(res)


def test_medians_and_ratio():
    res = _result_with({"kernel": [(100, 10), (300, 30), (200, 50)], "userspace": [(50, 40), (70, 20), (60, 60)]})
    k = res["jobs"]["j"]["results"]["kernel"]["median"]
    u = res["jobs"]["j"]["results"]["userspace"]["median"]
    assert (k["iops"], k["lat_us"]["p99"], u["iops"], u["lat_us"]["p99"]) == (200, 30, 60, 40)
    r = res["jobs"]["j"]["ratio"]
    assert r["iops"] == pytest.approx(0.3) and r["p99"] == pytest.approx(40 / 30)
    assert r["bw_bytes"] == pytest.approx(0.3) and r["p90"] is None
    table = report.fio_table(res)
    assert "x0.30" in table and "x1.33" in table


def test_ratio_needs_both_targets():
    res = _result_with({"kernel": [(100, 10)]})
    assert res["jobs"]["j"]["ratio"] is None and res["ok"] is True


def test_load_json_rejects_other_files(tmp_path):
    (tmp_path / "x.json").write_text('{"schema": "something-else"}')
    with pytest.raises(NvmeofError, match="not a bench result"):
        report.load_json(tmp_path / "x.json")
    with pytest.raises(NvmeofError, match="no such result file"):
        report.load_json(tmp_path / "missing.json")


def test_formatting():
    assert report.fmt_iops(1234) == "1.23k" and report.fmt_iops(45678) == "45.7k" and report.fmt_iops(2.5e6) == "2.50M"
    assert report.fmt_lat(12.34) == "12.3 µs" and report.fmt_lat(4500) == "4.5 ms" and report.fmt_lat(None) == "-"
    assert report.fmt_mbps(16_200_000) == "16.2" and report.fmt_size(65536) == "64 KiB"


# --- plots ----------------------------------------------------------------------------------------------

def test_plots_are_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    from nvmeof_roce.bench.plot import plot_all
    res = _result_with({"kernel": [(100, 10), (300, 30), (200, 50)], "userspace": [(50, 40), (70, 20), (60, 60)]})
    res["perftest"]["ib_send_lat"] = {"kind": "lat", "bytes": 2, "t_typical_us": 13.2, "t_avg_us": 17.8,
                                      "p99_us": 81.8, "p99_9_us": 323.0}
    made = plot_all(res, tmp_path)
    assert sorted(p.name for p in made) == ["bandwidth.png", "iops.png", "latency.png", "perftest.png"]
    for p in made:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_no_matplotlib_is_a_clear_error(monkeypatch, tmp_path):
    from nvmeof_roce.bench import plot
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(NvmeofError, match="matplotlib is not installed"):
        plot.plot_all(_result_with({"kernel": [(1, 1)]}), tmp_path)


# --- the command ----------------------------------------------------------------------------------------

def test_list_jobs_json(capsys):
    assert main(["bench", "--list-jobs", "--json"]) == 0
    jobs = json.loads(capsys.readouterr().out)
    assert jobs["randread-4k-qd1"]["kind"] == "fio" and jobs["randread-4k-qd1"]["file"].endswith(".fio")
    assert jobs["uinit-randread-4k-qd32"]["kind"] == "initiator-perf"


def test_from_rerenders_a_saved_result(tmp_path, capsys):
    res = _result_with({"kernel": [(100, 10)], "userspace": [(80, 12)]})
    report.write_json(res, tmp_path / "run" / "bench.json")
    code = main(["bench", "--from", str(tmp_path / "run"), "--out", str(tmp_path / "png")])
    out = capsys.readouterr()
    assert code == 0
    assert "userspace/kernel" in out.out and f"results: {tmp_path / 'run' / 'bench.json'}" in out.out
    try:
        import matplotlib  # noqa: F401 - only whether it is there
        assert (tmp_path / "png" / "iops.png").exists() and "plot:" in out.out
    except ImportError:
        assert "no plots" in out.err


def test_bench_refuses_clearly_without_rdma_address(capsys, tmp_path):
    # 192.0.2.1 (TEST-NET-1) is on no RDMA device anywhere: the bench must refuse before touching anything
    code = main(["bench", "--targets", "kernel", "--traddr", "192.0.2.1", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 1
    assert "cannot run here" in err and "fix:" in err
    assert not (tmp_path / "o" / "bench.json").exists()


@pytest.mark.parametrize("args,message", [
    (["--targets", "kernel,spdk"], "unknown target spdk"),
    (["--ns-size", "1500K"], "whole number of MiB"),
    (["--jobs", "nope"], "unknown job"),
    (["--runtime", "0"], "--runtime must be above 0"),
    (["--targets", "kernel,baseline"], "--targets baseline needs --baseline-checkout DIR"),
    (["--baseline-checkout", "/tmp"], "--baseline-checkout is given but 'baseline' is not in --targets"),
    (["--ratio", "userspace"], "--ratio 'userspace' is not two targets as A/B"),
    (["--ratio", "userspace/baseline"], "baseline is not in --targets kernel,userspace"),
    (["--soak-ios", "999"], "--soak-ios 999: the soak needs at least 1000 commands"),
    (["--soak-interval", "0"], "--soak-interval and --soak-timeout must be above 0"),
    (["--soak-ios", "5000", "--soak-skip", "5000"], "--soak-skip 5000 must be from 0 to below --soak-ios (5000)"),
])
def test_bench_argument_errors(args, message, capsys):
    assert main(["bench"] + args) == 1
    assert message in capsys.readouterr().err


def test_parse_initiator_perf_reads_what_the_initiator_writes():
    """The shape `nvmeof-roce initiator perf --json` prints: initiator/perf.py's PerfResult.to_dict()."""
    perf = pytest.importorskip("nvmeof_roce.initiator.perf")
    result = perf.PerfResult(iops=1500.0, bandwidth_bytes=6144000.0, ios=7500, errors=2, runtime_s=5.0,
                             latency_us={"p50": 20.0, "p90": 30.0, "p99": 40.0, "p99.9": 50.0, "mean": 22.0})
    got = runner_mod.parse_initiator_perf(json.dumps(result.to_dict()))
    assert (got["iops"], got["bw_bytes"], got["errors"], got["lat_mean_us"]) == (1500.0, 6144000.0, 2, 22.0)
    assert got["lat_us"] == {"p50": 20.0, "p90": 30.0, "p99": 40.0, "p99.9": 50.0}


def test_baseline_target_runs_another_checkout(tmp_path, capsys):
    """--targets kernel,userspace,baseline: the baseline is our target served from another checkout, on its
    own port and NQN; a directory that is not a checkout is refused in the preflight, naming the option."""
    import argparse
    from nvmeof_roce.bench.commands import build_targets
    args = argparse.Namespace(targets="kernel,userspace,baseline", traddr="10.99.0.1", kernel_port=4420,
                              userspace_port=4421, baseline_port=4422, kernel_backend="null_blk", ns_size="64M",
                              userspace_config=None, baseline_checkout=tmp_path)
    kernel, user, base = build_targets(args, tmp_path / "out")
    assert (base.name, base.trsvcid, base.subnqn) == ("baseline", 4422, "nqn.2014-08.org.nvmeof-roce:bench-baseline")
    assert user.checkout is None and base.checkout == tmp_path.resolve()
    assert base.describe()["checkout"] == str(tmp_path.resolve())
    with pytest.raises(NvmeofError, match="--baseline-checkout .*: no nvmeof_roce/service/serve.py"):
        base.check()


def test_fabric_targets_roce_iwarp_tcp_side_by_side(tmp_path, monkeypatch):
    """--targets kernel,kernel@iwarp,userspace@iwarp,kernel@tcp: each on its own port and NQN, the iWARP ones at
    --iwarp-traddr, the TCP one exported by nvmet-tcp and connected with `nvme connect -t tcp`; our target
    refuses TCP with the fix."""
    import argparse
    from nvmeof_roce.bench import kernel_glue
    from nvmeof_roce.bench.commands import build_targets
    from nvmeof_roce.bench.targets import KernelHost
    args = argparse.Namespace(targets="kernel,kernel@iwarp,userspace@iwarp,kernel@tcp", traddr="10.99.0.1",
                              iwarp_traddr="10.98.0.1", kernel_port=4420, userspace_port=4421, baseline_port=4422,
                              kernel_backend=None, ns_size="64M", userspace_config=None, baseline_checkout=None)
    roce, k_iwarp, u_iwarp, k_tcp = build_targets(args, tmp_path / "out")
    assert [(t.name, t.traddr, t.trsvcid, t.address["trtype"]) for t in (roce, k_iwarp, u_iwarp, k_tcp)] == [
        ("kernel", "10.99.0.1", 4420, "rdma"), ("kernel@iwarp", "10.98.0.1", 4430, "rdma"),
        ("userspace@iwarp", "10.98.0.1", 4431, "rdma"), ("kernel@tcp", "10.99.0.1", 4440, "tcp")]
    assert len({t.subnqn for t in (roce, k_iwarp, u_iwarp, k_tcp)}) == 4 and "@" not in k_tcp.subnqn
    assert k_tcp.describe()["fabric"] == "NVMe/TCP" and k_iwarp.describe()["fabric"] == "iWARP"
    config = kernel_glue.kernel_config(k_tcp.subnqn, "/dev/nullb0", k_tcp.traddr, k_tcp.trsvcid, trtype="tcp")
    assert config["ports"][0]["addr"]["trtype"] == "tcp"
    calls = []
    monkeypatch.setattr(kernel_glue, "modprobe", lambda *mods: calls.append(("modprobe", mods)))
    monkeypatch.setattr(kernel_glue, "nvme_connect",
                        lambda traddr, trsvcid, nqn, trtype="rdma": calls.append((traddr, trsvcid, trtype)) or "/dev/x")
    assert KernelHost().connect(k_tcp) == "/dev/x"
    assert calls == [("modprobe", ("nvme-tcp",)), ("10.99.0.1", 4440, "tcp")]
    args.targets = "userspace@tcp"
    with pytest.raises(NvmeofError, match="serves RDMA only") as ei:
        build_targets(args, tmp_path / "out")
    assert "kernel@tcp" in ei.value.fix
    args.targets = "kernel@infiniband"
    with pytest.raises(NvmeofError, match="unknown target or fabric"):
        build_targets(args, tmp_path / "out")


def test_iwarp_device_is_found_by_its_netdevs_address(tmp_path, monkeypatch):
    """iWARP GIDs hold the MAC, not the IP: the device is found through its netdev's addresses."""
    import subprocess as sp
    from nvmeof_roce.bench import perftest
    for name, node_type in (("rxe0", "1: CA"), ("siw0", "4: RNIC")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "node_type").write_text(node_type + "\n")
    monkeypatch.setattr(perftest, "_rdma_links", lambda: [{"ifname": "rxe0", "port": 1, "netdev": "rxenet0"},
                                                          {"ifname": "siw0", "port": 1, "netdev": "siwnet0"}])
    addrs = {"siwnet0": '[{"addr_info": [{"local": "10.98.0.1", "prefixlen": 24}]}]'}
    monkeypatch.setattr(perftest.subprocess, "run",
                        lambda argv, **kw: sp.CompletedProcess(argv, 0, addrs.get(argv[-1], "[]"), ""))
    assert perftest.iwarp_device_for("10.98.0.1", sysfs=tmp_path) == "siw0"
    with pytest.raises(NvmeofError, match="no iWARP device has the address 10.99.0.1") as ei:
        perftest.iwarp_device_for("10.99.0.1", sysfs=tmp_path)  # rxe0 holds it, but rxe0 is RoCE
    assert "add-siw" in ei.value.fix


class StatusTarget(FileTarget):
    """Our target as the bench sees it: a control socket whose `target status` lists native I/O queues."""

    @property
    def rpc_socket(self):
        return str(self.path) + ".sock"


@needs_fio
def test_a_native_target_s_polling_is_read_before_the_disconnect_and_recorded(work):
    events, lines, asked = [], [], []
    host = FileHost(events)

    def status_call(path, method, params, timeout):
        asked.append((path, method, sorted(host.connected_to)))  # its queues exist only while connected
        if len(asked) == 2:
            raise ConnectionRefusedError("no socket")  # a target that cannot answer: said in the record
        queues = [{"qid": 0}] + [{"qid": q, "polling": {"mode": "adaptive", "polls": 500, "spin_hits": 90,
                                                         "spin_yields": 400, "arms": 10, "arm_catches": 1}}
                                 for q in (1, 2)]
        return {"subsystems": [{"nqn": "nqn.other", "controllers": [{"queues": queues}]},
                               {"nqn": target.subnqn, "controllers": [{"queues": queues}]}]}

    target = StatusTarget("userspace", work, events)
    result = _runner(work, events, targets=[target], host=host, lines=lines, repeats=2, jobs="randread-4k-qd1",
                     status_call=status_call).run()
    assert asked == [(target.rpc_socket, "nvmeof_get_status", ["userspace"])] * 2
    first, second = result["jobs"]["randread-4k-qd1"]["results"]["userspace"]["repeats"]
    # the subsystem's own I/O queues summed, the admin queue and another subsystem's left out
    assert first["polling"] == {"mode": "adaptive", "queues": 2, "polls": 1000, "spin_hits": 180,
                                "spin_yields": 800, "arms": 20, "arm_catches": 2}
    assert second["polling"] == {"error": "target status: no socket"}
    ios = first["cpu"]["ios"]
    job_lines = [ln for ln in lines if ln.startswith("bench [")]
    assert f"polled adaptive: {180 / ios:.2f} spin hits and {20 / ios:.2f} arms per I/O" in job_lines[0]
    assert "polled" not in job_lines[1]


def test_jobs_dir_help_names_the_directory_used_not_the_checkout(monkeypatch, capsys):
    """Under an installed wheel the job files are the package's copy (nvmeof_roce/share/fio-jobs): --jobs-dir's
    help names the directory the default really is, wherever the package runs from."""
    from pathlib import Path
    from nvmeof_roce.bench import fio
    packaged = Path("/usr/lib/python3/dist-packages/nvmeof_roce/share/fio-jobs")
    monkeypatch.setattr(fio, "shipped", lambda name: packaged if name == "fio-jobs" else None)
    monkeypatch.setenv("COLUMNS", "500")  # argparse wraps its help at the terminal's width (and at hyphens)
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"--jobs-dir DIR fio job files (default: {packaged}," in help_text, help_text
