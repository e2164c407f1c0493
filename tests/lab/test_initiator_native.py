"""Our initiator's native I/O queues (csrc/hostq.c, transport/rdma/host_native.py) against the kernel's nvmet-rdma
over rxe, on a memory-backed null_blk namespace (the bench's kernel target): the Connect and the initiator's own
read/write through them, `perf` in C on one and two queues, and the comparison with the Python data path and with
fio through the kernel host, in one bench run (the figures go to docs/native.md; no speed is asserted here)."""
import json
import os

import pytest

from nvmeof_roce.bench.targets import KernelNvmetTarget
from nvmeof_roce.cli import main

pytestmark = pytest.mark.lab

LAB_IP = "10.99.0.1"
PORT = 4423


@pytest.fixture
def kernel_target():
    target = KernelNvmetTarget(LAB_IP, PORT, size_mb=64, name="hostq")
    target.check()
    target.setup()
    yield target
    target.teardown()


def test_native_queues_connect_read_write_and_run_perf(kernel_target):
    from nvmeof_roce.initiator.controller import Controller
    from nvmeof_roce.initiator.perf import run_perf_native
    from nvmeof_roce.transport.rdma.host_native import NativeHostQueue, NativeRdmaConnector
    connector = NativeRdmaConnector(LAB_IP, PORT)
    ctrl = Controller.connect(connector, kernel_target.subnqn, num_io_queues=2, queue_size=33)
    try:
        assert all(isinstance(q.transport, NativeHostQueue) for q in ctrl.io_queues)
        bs = ctrl.block_size(1)
        data = os.urandom(64 * 1024)
        ctrl.write(1, 64, data)  # the initiator's own commands, through the C queue's send/poll
        assert ctrl.read(1, 64, len(data) // bs) == data
        r = run_perf_native(ctrl, 1, queue_depth=32, read_percent=70, runtime=1.0, seed=3)
        assert r.errors == 0 and r.ios > 0 and r.queues == 2 and r.data_path == "native"
        assert r.reads > r.writes > 0
        assert 0 < r.latency_us["p50"] <= r.latency_us["p99"]
        assert ctrl.read(1, 64, len(data) // bs) is not None  # the queues still answer after the loop
    finally:
        ctrl.close()
        connector.close()


@pytest.mark.extended  # a bench run of minutes: make test-extended
def test_native_python_and_fio_in_one_bench_run(tmp_path, capsys):
    out = tmp_path / "bench"
    runtime = os.environ.get("HOSTQ_RUNTIME", "3")
    code = main(["bench", "--targets", "kernel", "--jobs",
                 "randread-4k-qd32,uinit-randread-4k-qd32,uinit-py-randread-4k-qd32", "--runtime", runtime,
                 "--ramp", "1", "--repeats", "1", "--size", "32M", "--ns-size", "64M", "--no-perftest",
                 "--no-plots", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err + captured.out
    result = json.loads((out / "bench.json").read_text())
    figures = {}
    jobs = ("randread-4k-qd32", "uinit-randread-4k-qd32", "uinit-py-randread-4k-qd32")
    for job in jobs:
        (rep,) = result["jobs"][job]["results"]["kernel"]["repeats"]
        figures[job] = {"iops": round(rep["iops"]), "p50_us": rep["lat_us"]["p50"], "p99_us": rep["lat_us"]["p99"],
                        "errors": rep["errors"]}
    fio = figures["randread-4k-qd32"]["iops"]
    figures["native/fio"] = round(figures["uinit-randread-4k-qd32"]["iops"] / fio, 3)
    figures["python/fio"] = round(figures["uinit-py-randread-4k-qd32"]["iops"] / fio, 3)
    share = os.environ.get("HOSTQ_SHARE")
    if share:
        with open(os.path.join(share, "hostq-figures.json"), "w") as f:
            json.dump({"figures": figures, "bench": result}, f, indent=1)
    print("HOSTQ FIGURES", json.dumps(figures))
    for job in jobs:
        assert figures[job]["errors"] == 0 and figures[job]["iops"] > 0, (job, figures[job])
