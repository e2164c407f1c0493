"""bench --device and --qd-sweep: the device models, what each target is given, the sweep's jobs and plot."""
import argparse

import pytest

from nvmeof_roce.bench import kernel_glue as kg
from nvmeof_roce.bench.commands import build_targets
from nvmeof_roce.bench.runner import QD_SWEEP_DEPTHS, available_jobs, qd_sweep_jobs, select_jobs
from nvmeof_roce.bench.targets import DeviceModel, userspace_config
from nvmeof_roce.config import parse_config
from nvmeof_roce.errors import NvmeofError


@pytest.mark.parametrize("text,kind,ns,label", [
    ("ram", "ram", 0, "ram"), ("file", "file", 0, "file"), ("null_blk:20us", "null_blk", 20_000, "null_blk:20us"),
    ("null_blk:100us", "null_blk", 100_000, "null_blk:100us"), ("null_blk:2ms", "null_blk", 2_000_000, "null_blk:2ms"),
    ("null_blk:1.5ms", "null_blk", 1_500_000, "null_blk:1500us")])
def test_device_models_parse(text, kind, ns, label):
    m = DeviceModel.parse(text)
    assert (m.kind, m.completion_ns, m.label) == (kind, ns, label)


@pytest.mark.parametrize("text", ["nullblk:2ms", "null_blk", "null_blk:2", "null_blk:0us", "disk", "null_blk:20s"])
def test_bad_device_models_are_refused_with_the_syntax(text):
    with pytest.raises(NvmeofError, match="not a device model") as ei:
        DeviceModel.parse(text)
    assert "null_blk:LATENCY" in ei.value.fix


def _args(tmp_path, **kw):
    a = dict(targets="kernel,userspace", traddr="10.99.0.1", kernel_port=4420, userspace_port=4421,
             baseline_port=4422, kernel_backend=None, ns_size="64M", userspace_config=None, baseline_checkout=None,
             device="null_blk:2ms")
    a.update(kw)
    return argparse.Namespace(**a)


def test_both_targets_get_a_device_of_the_same_settings(tmp_path):
    kernel, user = build_targets(_args(tmp_path), tmp_path)
    assert kernel.device == user.device == DeviceModel("null_blk", 2_000_000)
    k, u = kernel.device.make("bench-kernel", 64), user.device.make("bench-userspace", 64)
    assert isinstance(k, kg.NullBlk) and (k.completion_ns, k.queue_depth) == (u.completion_ns, u.queue_depth)
    assert k.name != u.name  # one device per target
    assert "2 µs" not in kernel.describe()["backend"] and "2000 µs" in kernel.describe()["backend"]
    assert user.describe()["device"] == "null_blk:2ms"


def test_the_python_data_path_target_gets_its_own_device_port_and_serve_flag(tmp_path, monkeypatch):
    kernel, user, python = build_targets(_args(tmp_path, targets="kernel,userspace,userspace-py",
                                               userspace_py_port=4423), tmp_path)
    assert (python.name, python.trsvcid, python.data_path, user.data_path) == ("userspace-py", 4423, "python",
                                                                                None)
    assert python.device == kernel.device and python.subnqn != user.subnqn  # a null_blk of its own
    assert "--data-path python" in python.kind
    started = []

    class NotStarted(Exception):
        pass

    def popen(cmd, **kw):
        started.append(cmd)
        raise NotStarted

    monkeypatch.setattr("subprocess.Popen", popen)
    python.device = DeviceModel.parse("ram")  # no device to make on the host
    with pytest.raises(NotStarted):
        python.setup()
    assert started[0][started[0].index("--data-path") + 1] == "python"


def test_device_conflicts_are_refused(tmp_path):
    with pytest.raises(NvmeofError, match="--kernel-backend and --device"):
        build_targets(_args(tmp_path, kernel_backend="file"), tmp_path)
    with pytest.raises(NvmeofError, match="--device null_blk:2ms is for the kernel, userspace and baseline"):
        build_targets(_args(tmp_path, targets="userspace,userspace-2w", workers_port=4424), tmp_path)


def test_null_blk_with_latency_is_timer_completed(tmp_path, monkeypatch):
    """configfs nullb attributes: irqmode 2 with completion_nsec for a model (irqmode 0 for the RAM one)."""
    root = tmp_path / "configfs"
    (root / "nullb").mkdir(parents=True)
    written = {}

    def fake_write(path, value):
        written.setdefault(path.parent.name, {})[path.name] = value
        if path.name == "power":
            (path.parent / "index").write_text("0\n")

    def no_disk(*_a):
        raise NvmeofError("no disk here", "")
    monkeypatch.setattr(kg, "_write", fake_write)
    monkeypatch.setattr(kg, "_wait_for", no_disk)
    for name, latency in (("slow", 100_000), ("ram", 0)):
        with pytest.raises(NvmeofError, match="no disk"):
            kg.NullBlk(name, 64, configfs=root, completion_ns=latency).create()
    assert written["slow"]["irqmode"] == "2" and written["slow"]["completion_nsec"] == "100000"
    assert written["slow"]["memory_backed"] == "1" and written["slow"]["hw_queue_depth"] == "256"
    assert written["ram"]["irqmode"] == "0" and "completion_nsec" not in written["ram"]


def test_userspace_device_config_is_a_block_or_direct_file_namespace():
    blk = parse_config(userspace_config("10.99.0.1", 4421, "nqn.2014-08.org.nvmeof-roce:bench-userspace", 64,
                                        device_path="/dev/bench-userspace"), "u").subsystems[0].namespaces[0]
    assert (blk.backend, blk.path, blk.buffered_io) == ("file", "/dev/bench-userspace", None)
    f = parse_config(userspace_config("10.99.0.1", 4421, "nqn.2014-08.org.nvmeof-roce:bench-userspace", 64,
                                      device_path="/var/tmp/x.img", direct=True), "u").subsystems[0].namespaces[0]
    assert f.buffered_io is False  # O_DIRECT, as nvmet's default


def test_qd_sweep_jobs_are_separate_from_the_default_selection():
    sweep = qd_sweep_jobs()
    assert [j.name for j in sweep] == [f"sweep-randread-4k-qd{q}" for q in QD_SWEEP_DEPTHS]
    assert not any(j.name.startswith("sweep-") for j in select_jobs(None))
    assert "sweep-randread-4k-qd16" in available_jobs()
    for j in sweep:
        text = j.fio_job.path.read_text()
        assert f"iodepth={j.name.rsplit('qd', 1)[1]}" in text and "rw=randread" in text and "bs=4k" in text


def test_qd_sweep_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from nvmeof_roce.bench.plot import plot_qd_sweep, plot_qd_sweeps, sweep_points
    jobs = {}
    for qd, (k, u) in zip(QD_SWEEP_DEPTHS, [(300, 280), (1200, 1100), (2300, 2100), (2300, 2200), (2400, 2300)]):
        jobs[f"sweep-randread-4k-qd{qd}"] = {"results": {"kernel": {"median": {"iops": k}, "repeats": []},
                                                         "userspace": {"median": {"iops": u}, "repeats": []}}}
    jobs["randread-4k-qd1"] = {"results": {"kernel": {"median": {"iops": 5}, "repeats": []}}}
    result = {"params": {"targets": ["kernel", "userspace"], "device": "null_blk:2ms"}, "jobs": jobs, "machine": {}}
    assert sweep_points(result)["userspace"] == [(1, 280), (4, 1100), (16, 2100), (32, 2200), (128, 2300)]
    assert plot_qd_sweep(result, tmp_path / "qd.png").stat().st_size > 1000
    assert plot_qd_sweeps([result, result], tmp_path / "all.png").stat().st_size > 1000
    assert plot_qd_sweep({"jobs": {}}, tmp_path / "none.png") is None


def test_userspace_py_is_our_target_on_its_python_data_path_beside_the_default(tmp_path, monkeypatch):
    """--targets kernel,userspace,userspace-py: the Python path measured in the same run, on its own port and NQN."""
    from nvmeof_roce.bench import targets as bench_targets
    kernel, native, python = build_targets(_args(tmp_path, targets="kernel,userspace,userspace-py",
                                                 userspace_py_port=4423, device="ram"), tmp_path)
    assert (python.name, python.trsvcid, python.data_path) == ("userspace-py", 4423, "python")
    assert python.subnqn != native.subnqn and native.data_path is None
    assert python.describe()["data_path"] == "python"
    assert native.describe()["data_path"] in ("native", "python")  # the target's default: native when built
    started = []

    class Started(Exception):
        pass

    def popen(cmd, **_kw):
        started.append(cmd)
        raise Started()

    monkeypatch.setattr(bench_targets.subprocess, "Popen", popen)
    for target in (native, python):
        with pytest.raises(Started):
            target.setup()
    assert "--data-path" not in started[0]
    assert started[1][started[1].index("--data-path") + 1] == "python"
