"""The bench for real in the lab guest: kernel nvmet-rdma over rxe0, nvme-cli, fio, perftest.

Short on purpose (every lab test shares one guest boot): runtime 1-2 s, one job, and everything is checked
to be gone afterwards (no controller connected, no configfs object, no null_blk device of ours).
"""
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from nvmeof_roce.bench import kernel_glue
from nvmeof_roce.bench.perftest import DEFAULT_TESTS, run_perftest
from nvmeof_roce.bench.runner import BenchConfig, BenchRunner, select_jobs
from nvmeof_roce.bench.targets import NQN_PREFIX, KernelHost, KernelNvmetTarget
from nvmeof_roce.cli import main
from nvmeof_roce.errors import NvmeofError

pytestmark = pytest.mark.lab

LAB_IP = "10.99.0.1"
NVMET = Path("/sys/kernel/config/nvmet")
NULLB = Path("/sys/kernel/config/nullb")


class Ran:
    def __init__(self, returncode, out, err):
        self.returncode, self.stdout, self.stderr = returncode, out, err


@pytest.fixture
def bench(capsys):
    """`nvmeof-roce bench ARGS` through the real entry point, in this process: a new interpreter would spend
    half a minute importing the package over 9p in the emulated guest."""
    def run(*args):
        capsys.readouterr()
        code = main(["bench", *args])
        out = capsys.readouterr()
        return Ran(code, out.out, out.err)
    return run


def leftovers():
    """Everything of the bench's that could outlive it."""
    left = []
    for ctrl in Path("/sys/class/nvme").glob("nvme*"):
        nqn = (ctrl / "subsysnqn").read_text().strip()
        if nqn.startswith(NQN_PREFIX):
            left.append(f"controller {ctrl.name} -> {nqn}")
    left += [f"nvmet subsystem {p.name}" for p in (NVMET / "subsystems").glob(NQN_PREFIX + "*")]
    for port in (NVMET / "ports").glob("*"):
        left += [f"nvmet port {port.name} -> {s.name}" for s in (port / "subsystems").glob(NQN_PREFIX + "*")]
    left += [f"null_blk {p.name}" for p in NULLB.glob("bench-*")]
    left += [f"tmpfs file {p}" for p in Path("/dev/shm").glob("bench-*.img")]
    return left


@pytest.fixture(autouse=True)
def nothing_left_behind():
    assert leftovers() == []
    yield
    assert leftovers() == []


def test_short_bench_against_the_kernel_target(tmp_path, bench):
    out = tmp_path / "bench"
    proc = bench("--targets", "kernel", "--jobs", "randread-4k-qd32", "--runtime", "2", "--ramp", "0",
                 "--repeats", "1", "--size", "32M", "--ns-size", "64M", "--perftest-iterations", "100", "--no-plots",
                 "--out", str(out))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "bench [1/1] randread-4k-qd32 on kernel (repeat 1/1): " in proc.stderr
    assert f"results: {out / 'bench.json'}" in proc.stdout
    assert "randread-4k-qd32" in proc.stdout and "ib_write_bw" in proc.stdout  # the table

    result = json.loads((out / "bench.json").read_text())
    assert result["schema"] == "nvmeof-roce-bench/1" and result["ok"] is True
    assert result["machine"]["lab"] is True and result["machine"]["rdma_device"] == "rxe0"
    assert result["machine"]["tools"]["fio"].startswith("fio-")
    assert result["params"]["runtime_s"] == 2 and result["params"]["traddr"] == LAB_IP
    t = result["targets"]["kernel"]
    assert (t["traddr"], t["trsvcid"], t["subnqn"]) == (LAB_IP, "4420", NQN_PREFIX + "kernel")
    slot = result["jobs"]["randread-4k-qd32"]["results"]["kernel"]
    (rep,) = slot["repeats"]
    assert rep["errors"] == 0 and rep["iops"] > 0 and rep["bw_bytes"] == pytest.approx(rep["iops"] * 4096, rel=0.02)
    assert rep["device"].startswith("/dev/nvme")
    lat = rep["lat_us"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["p99.9"]
    assert slot["median"]["iops"] == rep["iops"] and slot["median"]["lat_us"] == lat
    assert result["jobs"]["randread-4k-qd32"]["ratio"] is None  # one target: nothing to compare
    raw = json.loads((out / rep["raw"]).read_text())
    assert raw["global options"]["filename"] == rep["device"]
    for test in DEFAULT_TESTS:
        p = result["perftest"][test]
        assert "error" not in p, p
        if test.endswith("_lat"):
            assert 0 < p["t_typical_us"] <= p["p99_us"] <= p["p99_9_us"]
        else:
            assert p["bw_avg_mb_s"] > 0 and p["bytes"] == 65536


def test_two_real_targets_interleaved_with_a_ratio(tmp_path):
    """Two kernel exports (null_blk and a tmpfs file) stand in for the pair: interleaving, repeats, ratio."""
    lines = []
    targets = [KernelNvmetTarget(LAB_IP, 4420, size_mb=64),
               KernelNvmetTarget(LAB_IP, 4422, size_mb=64, backend="file", name="kernel-file")]
    cfg = BenchConfig(out_dir=tmp_path / "pair", traddr=LAB_IP, runtime=1, ramp=0, size="16M", repeats=2,
                      perftest=False, ratio=("kernel-file", "kernel"))
    result = BenchRunner(cfg, targets, select_jobs("randread-4k-qd1"), KernelHost(), progress=lines.append).run()
    order = [ln.split(" on ")[1].split(" ")[0] for ln in lines if ln.startswith("bench [")]
    assert order == ["kernel", "kernel-file", "kernel", "kernel-file"]
    job = result["jobs"]["randread-4k-qd1"]
    assert result["ok"] is True
    for name in ("kernel", "kernel-file"):
        assert len(job["results"][name]["repeats"]) == 2
    devices = {r["device"] for name in job["results"] for r in job["results"][name]["repeats"]}
    assert len(devices) >= 1
    k, f = job["results"]["kernel"]["median"], job["results"]["kernel-file"]["median"]
    assert job["ratio"]["iops"] == pytest.approx(f["iops"] / k["iops"])


def test_perftest_without_rdma_cm_finds_the_gid(tmp_path):
    res = run_perftest("ib_write_lat", LAB_IP, rdma_cm=False, iterations=200, port=19111,
                       raw_output=tmp_path / "raw.txt")
    assert res.device == "rxe0" and res.gid_index is not None
    assert f"-x {res.gid_index}" in " ".join(res.command) and "-R" not in res.command
    assert res.row.iterations == 200 and res.row.t_typical_us > 0
    assert "#bytes" in (tmp_path / "raw.txt").read_text()


def test_bench_refuses_when_a_tool_is_missing(tmp_path, bench, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no fio, no perftest (nvme-cli and modprobe are found in /usr/sbin)
    proc = bench("--targets", "kernel", "--jobs", "randread-4k-qd1", "--out", str(tmp_path / "o"))
    assert proc.returncode == 1
    assert "the bench cannot run here" in proc.stderr
    assert "fio: command not found" in proc.stderr and "apt-get install fio" in proc.stderr
    assert "ib_send_lat: command not found" in proc.stderr and "apt-get install perftest" in proc.stderr
    assert not (tmp_path / "o" / "bench.json").exists()


def test_bench_refuses_a_busy_target_address(tmp_path, bench):
    """Someone else's nvmet port on 10.99.0.1:4420: the kernel target cannot run there, the bench says so."""
    other = kernel_glue.NvmetExport(nqn="nqn.2014-08.org.example:someone-else", device_path="/dev/null",
                                    traddr=LAB_IP, trsvcid=4420)
    kernel_glue.modprobe("nvmet", "nvmet-rdma")
    subsys = NVMET / "subsystems" / other.nqn
    try:
        # a subsystem without namespace is enough to enable the port
        subsys.mkdir()
        other.portid = other._free_portid()
        port = NVMET / "ports" / str(other.portid)
        port.mkdir()
        for attr, value in (("trtype", "rdma"), ("adrfam", "ipv4"), ("traddr", LAB_IP), ("trsvcid", "4420")):
            (port / f"addr_{attr}").write_text(value)
        os.symlink(subsys, port / "subsystems" / other.nqn)
        proc = bench("--targets", "kernel", "--jobs", "randread-4k-qd1", "--no-perftest",
                     "--out", str(tmp_path / "o"))
        assert proc.returncode == 1
        assert "10.99.0.1:4420 is already in use by nvmet_rdma" in proc.stderr
        assert "--kernel-port" in proc.stderr
    finally:
        other.remove()
    assert not subsys.exists()


def test_connect_without_a_namespace_device_is_refused_and_disconnected():
    nqn = NQN_PREFIX + "nodev"
    null = kernel_glue.NullBlk(name="bench-nodev", size_mb=16)
    export = kernel_glue.NvmetExport(nqn=nqn, device_path=null.create(), traddr=LAB_IP, trsvcid=4423)
    try:
        export.create()
        (NVMET / "subsystems" / nqn / "namespaces" / "1" / "enable").write_text("0")
        with pytest.raises(NvmeofError, match="no namespace block device appeared"):
            kernel_glue.nvme_connect(LAB_IP, 4423, nqn, timeout=10, device_timeout=3)
        assert kernel_glue.controllers(nqn) == []
    finally:
        kernel_glue.nvme_disconnect(nqn)
        export.remove()
        null.remove()


def test_sigterm_mid_run_leaves_nothing_connected(tmp_path, bench):
    """SIGTERM while fio runs: the command unwinds like Ctrl-C (exit 130), fio is stopped, the host disconnected
    and the target torn down (the autouse fixture checks nothing is left)."""
    sent = []

    def terminate_when_fio_runs():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if _fio_running() and any(Path("/sys/class/nvme").glob("nvme*")):
                time.sleep(1.0)
                sent.append(time.monotonic())
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.2)

    before = signal.getsignal(signal.SIGTERM)
    watcher = threading.Thread(target=terminate_when_fio_runs, daemon=True)
    watcher.start()
    started = time.monotonic()
    proc = bench("--targets", "kernel", "--jobs", "randread-4k-qd32", "--runtime", "60", "--ramp", "0",
                 "--size", "16M", "--ns-size", "32M", "--no-perftest", "--no-plots", "--out", str(tmp_path / "o"))
    watcher.join(5)
    assert sent, "fio never started"
    assert proc.returncode == 130, proc.stderr
    assert time.monotonic() - started < 60  # it did not wait for the 60 s run to end
    assert "interrupted" in proc.stderr and "tearing down the kernel target" in proc.stderr
    assert not _fio_running()
    assert signal.getsignal(signal.SIGTERM) == before  # the command put the previous handler back


def _fio_running() -> bool:
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().strip() == "fio":
                return True
        except OSError:
            continue
    return False
