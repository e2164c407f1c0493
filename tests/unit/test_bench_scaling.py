"""The bench's scaling job set (issue 13): a `userspace-Nw` target (`target serve --workers N`) beside the
kernel and single-process targets, its per-path I/O counts, per-process CPU, and the scaling figures in the
JSON, the table, the markdown and the plot.

The runner test uses real fio on plain files (the multipath host's per-path counters are given by the test
double); the sysfs readers run on a sysfs-shaped tree; the process lookup runs on real processes.
"""
import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nvmeof_roce.bench import kernel_glue, procstat, report
from nvmeof_roce.bench.commands import build_targets
from nvmeof_roce.bench.runner import BenchConfig, BenchRunner, select_jobs
from nvmeof_roce.bench.targets import Host, TargetUnderTest, UserspaceTarget
from nvmeof_roce.errors import NvmeofError

needs_fio = pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (apt-get install fio)")
MACHINE = {"hostname": "test", "kernel": "x", "lab": False}


# --- the report ---------------------------------------------------------------------------------------

def _result(values, paths=None, procs=None):
    """values: {target: [iops per repeat]} for the job 'j'."""
    res = report.new_result(date="2026-01-01T00:00:00Z", machine=MACHINE,
                            params={"targets": list(values), "repeats": 3, "traddr": "x"}, targets={})
    report.add_job(res, "j", kind="fio")
    for t, reps in values.items():
        for i, iops in enumerate(reps, 1):
            extra = {}
            if paths and t in paths:
                extra["paths"] = paths[t][i - 1]
            if procs and t in procs:
                extra["cpu"] = {"target_us_per_io": 10.0, "processes": procs[t][i - 1]}
            report.add_repeat(res, "j", t, report.repeat_record(i, iops=iops, bw_bytes=iops * 4096,
                                                                 lat_us={"p50": 100.0}, **extra))
    return report.finalize(res)


def _proc(pct):
    return {"user_s": pct / 100, "system_s": 0.0, "cpu_percent": pct}


RESULT_VALUES = {"kernel": [1000, 1100, 900], "userspace": [200, 220, 180], "userspace-2w": [390, 350, 360]}
PATHS = {"userspace-2w": [{"4424": 100, "4425": 90}, {"4424": 120, "4425": 110}, {"4424": 80, "4425": 70}]}
PROCS = {"userspace": [{"target": _proc(99)}] * 3,
         "userspace-2w": [{"supervisor": _proc(1), "worker0": _proc(95), "worker1": _proc(97)}] * 3}


def test_scaling_figures_are_medians_divided():
    res = _result(RESULT_VALUES, PATHS, PROCS)
    (sc,) = res["jobs"]["j"]["scaling"]
    assert (sc["target"], sc["workers"], sc["single"], sc["kernel"]) == ("userspace-2w", 2, "userspace", "kernel")
    assert sc["iops_over_single"] == pytest.approx(360 / 200)
    assert sc["iops_over_kernel"] == pytest.approx(360 / 1000)
    assert sc["single_over_kernel"] == pytest.approx(0.2)
    med = res["jobs"]["j"]["results"]["userspace-2w"]["median"]
    assert med["paths"] == {"4424": 100, "4425": 90}
    assert med["processes"]["worker1"] == {"user_s": 0.97, "system_s": 0.0, "cpu_percent": 97}
    assert list(med["processes"]) == ["supervisor", "worker0", "worker1"]
    assert res["jobs"]["j"]["results"]["userspace"]["median"]["processes"]["target"]["cpu_percent"] == 99


def test_scaling_is_none_without_a_multi_worker_target_and_missing_when_a_peer_is_missing():
    assert _result({"kernel": [1], "userspace": [2]})["jobs"]["j"]["scaling"] is None
    (sc,) = _result({"userspace-4w": [400]})["jobs"]["j"]["scaling"]
    assert sc["workers"] == 4 and sc["iops_over_single"] is None and sc["iops_over_kernel"] is None


def test_scaling_in_the_table_and_the_markdown():
    res = _result(RESULT_VALUES, PATHS, PROCS)
    text = report.render(res)
    assert "scaling over workers" in text
    row = next(ln for ln in text.splitlines() if ln.lstrip().startswith("j ") and "userspace-2w" in ln)
    assert "x1.80" in row and "x0.36" in row and "x0.20" in row
    assert "4424:100 4425:90" in row and "worker0 95 worker1 97" in row
    md = report.render_markdown(res, "plots")
    assert "| `j` | userspace-2w | 360 | **x1.80** | **x0.36** | x0.20 |" in md
    assert "![scaling over workers](plots/scaling.png)" in md
    plain = report.render(_result({"kernel": [1], "userspace": [2]}))
    assert "scaling over workers" not in plain


def test_scaling_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from nvmeof_roce.bench.plot import plot_all, plot_scaling
    res = _result(RESULT_VALUES, PATHS, PROCS)
    path = plot_scaling(res, tmp_path / "scaling.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert tmp_path / "s" / "scaling.png" in plot_all(res, tmp_path / "s")
    assert plot_scaling(_result({"kernel": [1], "userspace": [2]}), tmp_path / "none.png") is None


# --- procstat: every process of a target --------------------------------------------------------------

def test_cpu_cost_per_process_and_their_sum():
    before = procstat.Sample(t=0.0, procs={"worker0": procstat.ProcessCpu(100, 10),
                                           "worker1": procstat.ProcessCpu(200, 20)},
                             pid_cpu=procstat.ProcessCpu(300, 30))
    after = procstat.Sample(t=2.0, procs={"worker0": procstat.ProcessCpu(250, 30),
                                          "worker1": procstat.ProcessCpu(300, 40)},
                            pid_cpu=procstat.ProcessCpu(550, 70))
    cost = procstat.cpu_cost(before, after, ios=1000, clk_tck=100)
    assert cost["processes"]["worker0"] == {"user_s": 1.5, "system_s": 0.2, "cpu_percent": 85.0}
    assert cost["processes"]["worker1"] == {"user_s": 1.0, "system_s": 0.2, "cpu_percent": 60.0}
    assert cost["target_cpu_s"] == pytest.approx(2.9) and cost["target_us_per_io"] == pytest.approx(2900.0)
    # a worker that died in the window (restarted: another pid) is left out, not given a negative time
    del after.procs["worker1"]
    assert list(procstat.cpu_cost(before, after, ios=1000, clk_tck=100)["processes"]) == ["worker0"]


def test_take_sample_sums_the_processes():
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        s = procstat.take_sample(None, processes={"me": os.getpid(), "child": child.pid})
        assert set(s.procs) == {"me", "child"}
        assert s.pid_cpu.utime_ticks == s.procs["me"].utime_ticks + s.procs["child"].utime_ticks
        assert s.rss_bytes is None  # no single process to read it from
    finally:
        child.kill()
        child.wait()


# --- the target and the arguments ------------------------------------------------------------------------

def _args(tmp_path, targets, **kw):
    base = dict(targets=targets, traddr="10.99.0.1", kernel_port=4420, userspace_port=4421, baseline_port=4422,
                workers_port=4424, kernel_backend="null_blk", ns_size="64M", userspace_config=None,
                baseline_checkout=None, userspace_cpus=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_build_targets_with_a_two_worker_target(tmp_path):
    kernel, user, multi = build_targets(_args(tmp_path, "kernel,userspace,userspace-2w", userspace_cpus="2,3"),
                                        tmp_path)
    assert (user.workers, user.trsvcids, user.processes()) == (1, [4421], {})
    assert (multi.name, multi.workers, multi.trsvcid, multi.trsvcids) == ("userspace-2w", 2, 4424, [4424, 4425])
    assert multi.subnqn.endswith(":bench-userspace-2w") and multi.cpus == "2,3"
    d = multi.describe()
    assert (d["workers"], d["trsvcids"], d["cpus"]) == (2, ["4424", "4425"], "2,3")
    assert "--workers 2" in d["kind"]
    assert kernel.trsvcids == [4420]
    # two multi-worker targets do not share ports
    a, b = build_targets(_args(tmp_path, "userspace-2w,userspace-3w"), tmp_path)
    assert (a.trsvcids, b.trsvcids) == ([4424, 4425], [4440, 4441, 4442])


def test_userspace_cpus_pin_every_target_of_ours_and_not_the_kernel_s(tmp_path):
    kernel, user, busy, py = build_targets(_args(tmp_path, "kernel,userspace,native-busy,userspace-py",
                                                 userspace_cpus="1"), tmp_path)
    assert [t.cpus for t in (user, busy, py)] == ["1", "1", "1"]
    assert [t.describe()["cpus"] for t in (user, busy, py)] == ["1", "1", "1"]
    assert not hasattr(kernel, "cpus") or kernel.cpus is None
    assert "cpus" not in build_targets(_args(tmp_path, "native"), tmp_path)[0].describe()


@pytest.mark.parametrize("targets, kw, message", [
    ("kernel,userspace-1w", {}, "worker count must be 2..16"),
    ("kernel,userspace-x", {}, "unknown target userspace-x"),
    ("kernel,userspace-Nw", {}, "unknown target userspace-Nw"),
    ("userspace,userspace", {}, "names a target twice"),
    ("kernel", {"userspace_cpus": "0,1"}, "--userspace-cpus pins our target .serve --cpus., and --targets has none"),
    ("userspace-2w", {"userspace_cpus": "a,b"}, "--userspace-cpus 'a,b': not a list of CPU numbers"),
    ("userspace,userspace-2w", {"userspace_config": Path("x.json")}, "--userspace-config is for the single"),
])
def test_build_targets_refuses(tmp_path, targets, kw, message):
    with pytest.raises(NvmeofError, match=message):
        build_targets(_args(tmp_path, targets, **kw), tmp_path)


def test_processes_of_a_supervisor_are_its_workers(tmp_path):
    """A supervisor-shaped process tree: the workers are found by their --worker-index argument."""
    code = ("import subprocess, sys, time\n"
            "kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '--worker-index', str(i)])"
            " for i in range(2)]\n"
            "time.sleep(60)\n")
    t = UserspaceTarget("10.99.0.1", 4424, work_dir=tmp_path, name="userspace-2w", workers=2)
    t._proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 20
        while len(t.processes()) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        procs = t.processes()
        assert sorted(procs) == ["supervisor", "worker0", "worker1"] and procs["supervisor"] == t._proc.pid
        assert len(set(procs.values())) == 3
    finally:
        t._proc.kill()  # the children sleep out on their own
        t._proc.wait()
    assert t.processes() == {}


# --- sysfs: the paths of a multipath head ------------------------------------------------------------------

def _sysfs(tmp_path, paths):
    """paths: {controller instance: (trsvcid, reads, writes)} of subsystem 0's namespace 1."""
    for c, (svc, reads, writes) in paths.items():
        ctrl = tmp_path / "class" / "nvme" / f"nvme{c}"
        ctrl.mkdir(parents=True)
        (ctrl / "address").write_text(f"traddr=10.99.0.1,trsvcid={svc}\n")
        disk = tmp_path / "block" / f"nvme0c{c}n1"
        disk.mkdir(parents=True)
        (disk / "stat").write_text(f"{reads} 0 {reads * 8} 5 {writes} 0 {writes * 8} 7 0 9 9 0 0 0 0 0 0\n")
    (tmp_path / "block" / "nvme0n1").mkdir(parents=True, exist_ok=True)
    return tmp_path


def test_path_ios_per_trsvcid(tmp_path):
    sysfs = _sysfs(tmp_path, {2: ("4424", 1000, 3), 3: ("4425", 900, 0)})
    assert kernel_glue.path_devices("/dev/nvme0n1", sysfs) == {"4424": "nvme0c2n1", "4425": "nvme0c3n1"}
    assert kernel_glue.path_ios("/dev/nvme0n1", sysfs) == {"4424": 1003, "4425": 900}
    assert kernel_glue.path_ios("/dev/nvme1n1", sysfs) == {}
    assert kernel_glue.path_ios("/tmp/file.img", sysfs) == {}


# --- the runner: per-path counts recorded, an idle path or a path not live fails the job ----------------------

class FileTarget(TargetUnderTest):
    kind = "plain file (test double)"

    def __init__(self, name, directory, ports):
        self.name = name
        super().__init__("127.0.0.1", ports[0])
        self.ports = ports
        self.path = directory / f"{name}.img"

    @property
    def trsvcids(self):
        return self.ports

    def setup(self):
        with open(self.path, "wb") as f:
            f.truncate(16 << 20)

    def teardown(self):
        self.path.unlink()


class PathsHost(Host):
    """Hands fio the file; its 'paths' count what the test says each path carried."""

    def __init__(self, per_path, refuse=None):
        self.per_path = per_path  # {target: {svc: I/Os per job}}
        self.refuse = refuse
        self.counts = {}
        self.disconnects = []

    def connect(self, target):
        if self.refuse == target.name:
            raise NvmeofError(f"{target.subnqn}: nvme list-subsys shows paths {{'4425': 'connecting'}}, "
                              "expected 4424, 4425 all live", "check that every worker listens")
        return str(target.path)

    def disconnect(self, target):
        self.disconnects.append(target.name)

    def path_ios(self, device):
        name = Path(device).stem
        got = self.counts.setdefault(name, {svc: 0 for svc in self.per_path.get(name, {})})
        out = dict(got)
        for svc, n in self.per_path.get(name, {}).items():  # the next reading is after the job
            got[svc] += n
        return out


def _run(tmp_path, host, targets):
    cfg = BenchConfig(out_dir=tmp_path / "out", traddr="127.0.0.1", runtime=1, ramp=0, size="8M", perftest=False)
    return BenchRunner(cfg, targets, select_jobs("randread-4k-qd32"), host, progress=lambda m: None,
                       machine=MACHINE).run()


@needs_fio
def test_runner_records_what_each_path_carried(tmp_path):
    targets = [FileTarget("userspace", tmp_path, [4421]), FileTarget("userspace-2w", tmp_path, [4424, 4425])]
    host = PathsHost({"userspace-2w": {"4424": 500, "4425": 480}})
    res = _run(tmp_path, host, targets)
    job = res["jobs"]["randread-4k-qd32"]
    (rep,) = job["results"]["userspace-2w"]["repeats"]
    assert rep["paths"] == {"4424": 500, "4425": 480} and rep["errors"] == 0
    assert "paths" not in job["results"]["userspace"]["repeats"][0]
    assert res["ok"] is True and job["scaling"][0]["iops_over_single"] is not None


@needs_fio
def test_an_idle_path_fails_the_job(tmp_path):
    host = PathsHost({"userspace-2w": {"4424": 500, "4425": 0}})
    res = _run(tmp_path, host, [FileTarget("userspace-2w", tmp_path, [4424, 4425])])
    (rep,) = res["jobs"]["randread-4k-qd32"]["results"]["userspace-2w"]["repeats"]
    assert rep["errors"] == 1 and "path(s) 4425 carried no I/O" in rep["error_text"]
    assert res["ok"] is False


@needs_fio
def test_a_path_not_live_fails_that_job_and_the_run_goes_on(tmp_path):
    host = PathsHost({}, refuse="userspace-2w")
    targets = [FileTarget("userspace-2w", tmp_path, [4424, 4425]), FileTarget("userspace", tmp_path, [4421])]
    res = _run(tmp_path, host, targets)
    job = res["jobs"]["randread-4k-qd32"]["results"]
    (bad,) = job["userspace-2w"]["repeats"]
    assert bad["errors"] == 1 and bad["iops"] is None
    assert "expected 4424, 4425 all live (fix: check that every worker listens)" in bad["error_text"]
    assert job["userspace"]["repeats"][0]["iops"] > 0  # the next target still ran
    assert host.disconnects == ["userspace-2w", "userspace"] and res["ok"] is False


def test_two_node_host_connects_every_worker_port():
    from nvmeof_roce.bench.twonode import RemoteTarget
    info = {"name": "userspace-2w", "kind": "k", "traddr": "10.99.1.1", "trsvcid": 4424, "subnqn": "nqn.x",
            "describe": {"trsvcids": ["4424", "4425"], "workers": 2}}
    assert RemoteTarget(info).trsvcids == [4424, 4425]
    info["describe"] = {}
    assert RemoteTarget(info).trsvcids == [4424]
