"""`bench --rbd` (bench/rbd.py): the job set turned to fio's rbd engine, the shared image (made and removed through kernel/rbd_map.py's RbdTool), which RBD path our target runs,
which data path served our namespace, the run of a target that is no target (fio-rbd), the Ceph daemons' CPU, the
ratios and the report's rbd table; fio's outputs are recorded ones (tests/unit/fixtures/bench/)."""
import argparse
import copy
import json
import subprocess
from pathlib import Path

import pytest

from nvmeof_roce.bench import rbd, report
from nvmeof_roce.bench.commands import _rbd_config, build_targets
from nvmeof_roce.bench.fio import FioJobFile, parse_fio_json
from nvmeof_roce.bench.runner import BenchConfig, BenchRunner, available_jobs, rbd_jobs, select_jobs, side_cost
from nvmeof_roce.bench.procstat import ProcessCpu
from nvmeof_roce.bench.targets import Host, TargetUnderTest
from nvmeof_roce.errors import NvmeofError
from nvmeof_roce.kernel.rbd_map import RbdTool
from nvmeof_roce.kernel.tool import ToolResult

FIXTURES = Path(__file__).parent / "fixtures" / "bench"
SPEC = rbd.RbdImageSpec("rbd", "img", "/etc/ceph/ceph.conf")


def done(stdout="", returncode=0, stderr=""):
    return subprocess.CompletedProcess([], returncode, stdout, stderr)


# --- the job set --------------------------------------------------------------------------------------------

def test_the_job_set_is_its_own_not_in_the_default_selection():
    jobs = rbd_jobs()
    assert [j.name for j in jobs] == list(rbd.JOBS)
    assert [(j.fio_job.report, j.params) for j in jobs] == [("read", {"rbd": True}), ("write", {"rbd": True})] * 2
    assert not any(j.name.startswith("rbd-") for j in select_jobs(None))
    assert "rbd-randwrite-4k-qd1" in available_jobs() and select_jobs("rbd-randwrite-4k-qd1")[0].params["rbd"]


@pytest.mark.parametrize("name", rbd.JOBS)
def test_a_job_turned_to_fio_s_rbd_engine_is_the_same_job(name, tmp_path):
    job = available_jobs()[name].fio_job
    turned = rbd.rbd_engine_job(job, SPEC, tmp_path)
    text = turned.path.read_text()
    opts = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith(";")]
    assert "ioengine=rbd" in opts and "ioengine=libaio" not in opts
    assert not any(o.startswith(("filename=", "direct=")) for o in opts)
    assert opts[opts.index("[global]") + 1:opts.index("[global]") + 4] == ["clientname=admin", "pool=rbd",
                                                                             "rbdname=img"]
    original = [ln.strip() for ln in job.path.read_text().splitlines()
                if ln.strip() and not ln.startswith(";") and not ln.startswith(("filename=", "direct=", "ioengine="))]
    assert [o for o in opts if not o.startswith(("clientname=", "pool=", "rbdname=", "ioengine="))] == original
    assert (turned.name, turned.report, turned.description) == (job.name, job.report, job.description)


def test_a_job_without_global_cannot_be_turned():
    with pytest.raises(NvmeofError, match="no \\[global\\]"):
        rbd.rbd_engine_job_text("[j]\nrw=read\nioengine=libaio\n", SPEC)


def test_the_image_spec():
    spec = rbd.RbdImageSpec.parse("pool/image", "/c/ceph.conf", "bench")
    assert (spec.spec, spec.conf, spec.client_id) == ("pool/image", "/c/ceph.conf", "bench")
    assert spec.namespace_config("python") == {"nsid": 1, "enable": 1, "nvmeof_roce": {"backend": "rbd", "rbd": {
        "pool": "pool", "image": "image", "conf": "/c/ceph.conf", "id": "bench"}}}
    # the native RBD path by default: the namespace's "native": true (config/rbd.py), which the config parser takes
    native = spec.namespace_config()
    assert native["nvmeof_roce"]["rbd"] == dict(spec.namespace_config("python")["nvmeof_roce"]["rbd"], native=True)
    from nvmeof_roce.config.rbd import parse_rbd
    assert parse_rbd(native["nvmeof_roce"]["rbd"], "t.json", "ns").native is True
    assert spec.settings.spec() == "pool/image" and spec.settings.client_id == "bench"
    for bad in ("image", "/image", "pool/", "a/b/c", "pool/img@snap"):
        with pytest.raises(NvmeofError, match="POOL/IMAGE"):
            rbd.RbdImageSpec.parse(bad)


def test_the_default_conf_is_ceph_conf_s(monkeypatch):
    monkeypatch.setenv("CEPH_CONF", "/run/c/ceph.conf")
    assert rbd.RbdImageSpec.parse("rbd/x").conf == "/run/c/ceph.conf"
    monkeypatch.delenv("CEPH_CONF")
    assert rbd.RbdImageSpec.parse("rbd/x").conf == "/etc/ceph/ceph.conf"


def test_fio_s_client_runs_with_the_cache_off(tmp_path):
    conf = tmp_path / "ceph.conf"
    conf.write_text("[global]\nmon host = 127.0.0.1:6789\n")
    text = rbd.client_conf(str(conf), tmp_path / "out").read_text()
    assert text.startswith("[global]\nmon host = 127.0.0.1:6789\n") and text.endswith("[client]\nrbd cache = false\nrbd non blocking aio = false\n"
                                                 "objecter inflight ops = 0\nobjecter inflight op bytes = 0\n")
    with pytest.raises(NvmeofError, match="cannot read"):
        rbd.client_conf(str(tmp_path / "none"), tmp_path)


# --- the rbd tool: kernel/rbd_map.py's RbdTool, stubbed at the process boundary ---------------------------------

class FakeRbd:
    """`rbd` through RbdTool's runner (tool.run's signature) and fio's prefill through the bench's runner."""

    def __init__(self, answers=None):
        self.calls = []
        self.answers = answers or {}

    def __call__(self, argv, *a, **kw):
        if argv == "rbd":  # RbdTool: runner("rbd", args, package=..., timeout=...)
            argv = ["rbd", *a[0]]
            assert kw["package"] == "ceph-common"
        self.calls.append(argv)
        verb = argv[1] if argv[0] == "rbd" else argv[0]
        answer = self.answers.get(verb, done())
        res = answer(argv) if callable(answer) else answer
        if argv[0] == "rbd":
            return ToolResult(argv, res.returncode, res.stdout, res.stderr)
        return res


# --- the shared image -----------------------------------------------------------------------------------------

def _image(tmp_path, exists, prefill=0):
    conf = tmp_path / "ceph.conf"
    conf.write_text("[global]\n")
    fake = FakeRbd({"info": done("{}") if exists else done(returncode=2, stderr="(2) No such file or directory"),
                    "fio": done(returncode=prefill, stderr="fio: engine rbd not loadable" if prefill else "")})
    spec = rbd.RbdImageSpec("rbd", "img", str(conf))
    return rbd.BenchImage(spec, 64, "32M", tmp_path, tool=RbdTool(fake, udev=False), runner=fake,
                          progress=lambda m: None), fake


def test_the_image_is_made_once_for_every_target_and_removed_by_the_last(tmp_path):
    image, fake = _image(tmp_path, exists=False)
    image.acquire()
    image.acquire()
    verbs = [c[1] if c[0] == "rbd" else c[0] for c in fake.calls]
    assert verbs == ["info", "create", "fio"]  # created and its region written once
    assert fake.calls[1] == ["rbd", "create", "--size", "64M", "--image-feature", "layering",
                             "-c", image.spec.conf, "--id", "admin", "--pool", "rbd", "img"]
    assert fake.calls[-1] == rbd.prefill_command(image.spec, "32M")
    image.release()
    assert len(fake.calls) == 3
    image.release()
    assert fake.calls[-1] == ["rbd", "rm", "--no-progress", "-c", image.spec.conf, "--id", "admin", "--pool", "rbd",
                              "img"]


def test_a_cluster_that_does_not_answer_names_the_fix(tmp_path):
    image, fake = _image(tmp_path, exists=True)
    fake.answers["info"] = done(returncode=110, stderr="rbd: couldn't connect to the cluster!")
    with pytest.raises(NvmeofError, match="rbd info rbd/img: rbd: couldn't connect") as err:
        image.acquire()
    assert "ceph -s" in err.value.fix


def test_an_image_of_the_user_s_is_written_but_never_removed(tmp_path):
    image, fake = _image(tmp_path, exists=True)
    image.acquire()
    image.release()
    assert [c[1] if c[0] == "rbd" else c[0] for c in fake.calls] == ["info", "fio"]


def test_a_failed_prefill_says_why(tmp_path):
    image, _ = _image(tmp_path, exists=True, prefill=1)
    with pytest.raises(NvmeofError, match="engine rbd not loadable"):
        image.acquire()


# --- which data path served it ---------------------------------------------------------------------------------

def _status(io, nqn="nqn.x", data_path="native"):
    return {"data_path": data_path, "subsystems": [{"nqn": "nqn.other", "namespaces": [{"nsid": 1, "io": {}}]},
                                                  {"nqn": nqn, "namespaces": [{"nsid": 1, "io": io}]}]}


def test_served_by_the_reference_path_or_the_native_one():
    core = {"engine": "async", "most_in_flight": 32, "in_flight": 0}
    assert rbd.served_by(_status(core, data_path="python"), "nqn.x") == {
        "queues": "python", "rbd": "python", "engine": "async", "most_in_flight": 32, "native_most_in_flight": None}
    # the native queues, but no native entry for rbd (the core serves it): python
    assert rbd.served_by(_status(core), "nqn.x")["rbd"] == "python"
    native = {"engine": "async", "most_in_flight": 0, "native_in_flight": 0, "native_most_in_flight": 32}
    assert rbd.served_by(_status(native), "nqn.x")["rbd"] == "native"
    both = dict(native, most_in_flight=3)  # the core served the first commands while the handle opened
    assert rbd.served_by(_status(both), "nqn.x")["rbd"] == "native"
    assert rbd.served_by(_status(both), "nqn.x")["most_in_flight"] == 3  # recorded
    opened_late = dict(native, native_most_in_flight=0)  # in the view, but no command went through C
    assert rbd.served_by(_status(opened_late), "nqn.x")["rbd"] == "python"
    assert rbd.served_by(_status(core), "nqn.y") is None


def test_the_ceph_daemons_of_this_cluster(tmp_path):
    for pid, comm, argv in ((10, "ceph-osd", ["ceph-osd", "-c", "/other/ceph.conf", "-i", "0"]),
                            (12, "ceph-osd", ["ceph-osd", "-c", "/c/ceph.conf", "-i", "0"]),
                            (13, "ceph-mon", ["ceph-mon", "-c", "/c/ceph.conf", "-i", "a"]),
                            (14, "python3", ["python3"])):
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "comm").write_text(comm + "\n")
        (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (tmp_path / "self").mkdir()
    assert rbd.ceph_pids("/c/ceph.conf", proc=str(tmp_path)) == {"ceph-osd": 12, "ceph-mon": 13}
    assert rbd.ceph_pids(None, proc=str(tmp_path)) == {"ceph-osd": 10, "ceph-mon": 13}
    assert rbd.ceph_pids("/etc/ceph/ceph.conf", proc=str(tmp_path)) == {"ceph-osd": 10, "ceph-mon": 13}


def test_side_cost():
    before = {"ceph-osd": ProcessCpu(100, 50), "ceph-mon": ProcessCpu(10, 10)}
    after = {"ceph-osd": ProcessCpu(300, 150)}  # the monitor went away
    assert side_cost(before, after, 10_000, 6.0, clk_tck=100) == {
        "ceph-osd": {"cpu_s": 3.0, "us_per_io": 300.0, "cpu_percent": 50.0}}
    assert side_cost(before, after, None, 0.0, clk_tck=100)["ceph-osd"]["us_per_io"] is None


# --- a run: three targets, one of them no target ------------------------------------------------------------------

def _fio_result(job, fixture, scale):
    doc = json.loads((FIXTURES / fixture).read_text())
    doc = copy.deepcopy(doc)
    j = doc["jobs"][0]
    for d in ("read", "write"):
        if j[d]["total_ios"]:
            j[d]["iops"] *= scale
            j[d]["total_ios"] = int(j[d]["total_ios"] * scale)
    if job.report == "write":  # the recorded run read: its numbers as a write's
        j["write"], j["read"] = j["read"], j["write"]
    return parse_fio_json(json.dumps(doc), report=job.report, job=job.name)


class Image:
    """BenchImage's part the targets use, without a cluster."""

    spec = SPEC
    fio_conf = Path("/tmp/fio-ceph.conf")

    def __init__(self):
        self.users = []

    def check(self):
        pass

    def acquire(self):
        self.users.append("+")

    def release(self):
        self.users.append("-")


class FakeOurs(TargetUnderTest):
    name = rbd.USERSPACE

    def setup(self):
        pass

    def teardown(self):
        pass

    @property
    def rpc_socket(self):
        return "/run/ours.sock"

    def side_processes(self):
        return {"ceph-osd": 1}  # this process: its CPU is real

    def served_by(self, status):
        return rbd.served_by(status, self.subnqn)


class FakeKernel(FakeOurs):
    name = rbd.KERNEL

    @property
    def rpc_socket(self):
        return None


class FakeHost(Host):
    def __init__(self):
        self.connected = []

    def connect(self, target):
        self.connected.append(target.name)
        return f"/dev/{target.name}"

    def disconnect(self, target):
        pass


def test_the_three_targets_in_one_run(tmp_path):
    image = Image()
    fio_rbd = rbd.FioRbdTarget(image)
    targets = [FakeOurs("10.0.0.1", 4460), FakeKernel("10.0.0.1", 4461), fio_rbd]
    ran = []
    scale = {rbd.USERSPACE: 0.8, rbd.KERNEL: 1.0, rbd.FIO: 1.25}

    def fio_runner(job, device, runtime, size, ramp, output_path=None, extra_env=None, cpus=None, **kw):
        ran.append((job.path, device, extra_env))
        name = {"/dev/userspace-rbd": rbd.USERSPACE, "/dev/kernel-krbd": rbd.KERNEL}.get(device, rbd.FIO)
        return _fio_result(job, "fio-nvmeof-randread-4k-qd32.json", scale[name])

    def status_call(path, method, params, timeout):
        return _status({"engine": "async", "most_in_flight": 32}, nqn=targets[0].subnqn)

    cfg = BenchConfig(out_dir=tmp_path / "out", runtime=1, ramp=0, perftest=False, ratio=rbd.RATIOS[0],
                      ratios=rbd.RATIOS, rbd={"image": "rbd/img", "data_path_requested": "default"})
    host = FakeHost()
    result = BenchRunner(cfg, targets, rbd_jobs(), host, fio_runner=fio_runner, status_call=status_call,
                         progress=lambda m: None, machine={}).run()
    assert host.connected == [rbd.USERSPACE, rbd.KERNEL] * 4  # fio-rbd connects nothing
    direct = [r for r in ran if r[1] == "rbd:rbd/img"]
    assert len(direct) == 4 and all(env == {"CEPH_CONF": "/tmp/fio-ceph.conf"} for _, _, env in direct)
    assert all(p.parent == tmp_path / "out" / "raw" / rbd.FIO and "ioengine=rbd" in p.read_text()
               for p, _, _ in direct)
    assert image.users == ["+", "-"]
    assert result["ok"] is True and result["params"]["rbd"]["image"] == "rbd/img"
    for name, job in result["jobs"].items():
        ours = job["results"][rbd.USERSPACE]["repeats"][0]
        assert ours["served"]["rbd"] == "python"
        assert "served" not in job["results"][rbd.KERNEL]["repeats"][0]
        assert set(ours["cpu"]["side"]) == {"ceph-osd"}
        fio_rep = job["results"][rbd.FIO]["repeats"][0]
        assert fio_rep["cpu"]["ios"] > 0 and fio_rep["cpu"]["target_us_per_io"] is None
        assert job["ratio"]["iops"] == pytest.approx(0.8)
        (over_kernel, over_fio) = job["ratios"]
        assert (over_kernel["numerator"], over_kernel["denominator"]) == rbd.RATIOS[0]
        assert over_kernel["iops"] == pytest.approx(0.8) and over_fio["iops"] == pytest.approx(0.64)
        assert over_kernel["lat_mean_us"] == pytest.approx(1.0)  # the same recorded latencies
        assert job["results"][rbd.USERSPACE]["median"]["side_us_per_io"]["ceph-osd"] is not None
    text = report.render(result)
    assert "rbd (one image three ways" in text
    rows = report.rbd_rows(result)
    assert rows[0][:3] == ["rbd-randread-4k-qd32", rbd.USERSPACE, "python (queues native)"]
    assert [r[1] for r in rows[:5]] == [rbd.USERSPACE, rbd.KERNEL, rbd.FIO, "userspace-rbd/kernel-krbd",
                                        "userspace-rbd/fio-rbd"]
    assert rows[3][3] == "x0.80" and rows[4][3] == "x0.64"
    md = report.render_markdown(result)
    assert "|  | **userspace-rbd/kernel-krbd** |  | **x0.80** |" in md


def test_a_failed_fio_rbd_run_is_recorded_and_the_run_goes_on(tmp_path):
    image = Image()

    def fio_runner(job, device, *a, **kw):
        raise NvmeofError("fio rbd-randread-4k-qd32 on rbd:rbd/img failed (exit 1): rbd engine not loadable")

    cfg = BenchConfig(out_dir=tmp_path / "out", runtime=1, ramp=0, perftest=False)
    result = BenchRunner(cfg, [rbd.FioRbdTarget(image)], rbd_jobs()[:2], FakeHost(), fio_runner=fio_runner,
                         progress=lambda m: None, machine={}).run()
    assert result["ok"] is False
    for job in result["jobs"].values():
        (rep,) = job["results"][rbd.FIO]["repeats"]
        assert rep["errors"] == 1 and "not loadable" in rep["error_text"]


# --- the command ---------------------------------------------------------------------------------------------

def _args(tmp_path, **kw):
    a = dict(targets=",".join(rbd.TARGET_NAMES), traddr="10.99.0.1", kernel_port=4420, userspace_port=4421,
             baseline_port=4422, baseline_checkout=None, ns_size="512M", userspace_config=None, size="256M",
             rbd_image="rbd/bench", rbd_conf=str(tmp_path / "ceph.conf"), rbd_id="admin", data_path=None,
             rbd_path=None)
    a.update(kw)
    return argparse.Namespace(**a)


def test_build_targets_shares_one_image(tmp_path):
    ours, kernel, fio = build_targets(_args(tmp_path, data_path="python", rbd_path="python"), tmp_path)
    assert (type(ours), type(kernel), type(fio)) == (rbd.RbdUserspaceTarget, rbd.KrbdNvmetTarget, rbd.FioRbdTarget)
    assert ours.image is kernel.image is fio.image
    assert ours.image.spec == rbd.RbdImageSpec("rbd", "bench", str(tmp_path / "ceph.conf"))
    assert (ours.image.size_mb, ours.image.region) == (512, "256M")
    assert (ours.trsvcid, kernel.trsvcid) == (4460, 4461) and ours.data_path == "python"
    assert "--data-path python" in ours.kind
    config = _rbd_config([ours, kernel, fio], rbd.RATIOS[0])
    assert config["ratios"] == list(rbd.RATIOS)
    assert config["rbd"]["data_path_requested"] == "python" and config["rbd"]["image"] == "rbd/bench"
    assert config["rbd"]["rbd_path_requested"] == "python" and ours.rbd_path == "python"
    assert _rbd_config([kernel, fio], ("kernel-krbd", "fio-rbd"))["ratios"] == [("kernel-krbd", "fio-rbd")]


def test_data_path_is_for_our_rbd_target_only(tmp_path):
    with pytest.raises(NvmeofError, match="--data-path native is for the userspace-rbd target"):
        build_targets(_args(tmp_path, targets="kernel,userspace", data_path="native"), tmp_path)
    with pytest.raises(NvmeofError, match="--rbd-path python is for the userspace-rbd target"):
        build_targets(_args(tmp_path, targets="kernel-krbd,fio-rbd", rbd_path="python"), tmp_path)


def test_the_native_rbd_path_is_the_default_on_the_native_queues(tmp_path):
    ours = build_targets(_args(tmp_path), tmp_path)[0]
    assert (ours.rbd_path, ours.data_path) == ("native", "native")
    assert ours.describe()["rbd_path_requested"] == "native" and "native RBD path" in ours.kind
    assert _rbd_config([ours], rbd.RATIOS[0])["rbd"]["rbd_path_requested"] == "native"
    # the reference path keeps the target's own queues unless --data-path says
    ref = build_targets(_args(tmp_path, rbd_path="python"), tmp_path)[0]
    assert (ref.rbd_path, ref.data_path) == ("python", None)
    with pytest.raises(NvmeofError, match="--rbd-path native needs the native I/O queues"):
        build_targets(_args(tmp_path, data_path="python"), tmp_path)


def test_our_rbd_target_writes_its_config_and_gives_the_image_back(tmp_path, monkeypatch):
    image = Image()
    target = rbd.RbdUserspaceTarget("10.99.0.1", image, work_dir=tmp_path)
    started = []
    monkeypatch.setattr(rbd.UserspaceTarget, "setup", lambda self: started.append(self.config_path))
    target.setup()
    cfg = json.loads(started[0].read_text())
    assert cfg["ports"][0]["addr"]["trsvcid"] == "4460"
    assert cfg["subsystems"][0]["namespaces"] == [SPEC.namespace_config("native")]
    assert cfg["subsystems"][0]["namespaces"][0]["nvmeof_roce"]["rbd"]["native"] is True
    target.teardown()
    target.teardown()
    assert image.users == ["+", "-"]

    def fail(self):
        raise NvmeofError("the image did not open")
    monkeypatch.setattr(rbd.UserspaceTarget, "setup", fail)
    with pytest.raises(NvmeofError):
        target.setup()
    target.teardown()
    assert image.users == ["+", "-", "+", "-"]
