"""`bench --rbd` for real, short: one RBD image of a development cluster served by our target (librbd), by kernel
nvmet over krbd, and read and written by fio's own rbd engine; the report has every job on every target with
IOPS, both ratios and the data path that served our namespace (the native RBD path, the default), and nothing is
left mapped, exported or created.
A smoke test, not a performance assertion (docs/rbd.md "Figures" has the measured run)."""
import json
import os
import subprocess
from pathlib import Path

import pytest

from nvmeof_roce.bench import rbd
from nvmeof_roce.ceph import devcluster
from nvmeof_roce.ceph.devcluster import DevCluster
from nvmeof_roce.cli import main

pytestmark = [pytest.mark.lab, pytest.mark.extended]

IMAGE = "rbd/bench-smoke"


@pytest.fixture(scope="module")
def ceph_conf():
    """The cluster `lab run --ceph` started (CEPH_CONF), or one of this test's own."""
    conf = os.environ.get("CEPH_CONF")
    if conf and os.path.isfile(conf):
        yield conf
        return
    missing = devcluster.missing_tools()
    if missing:
        pytest.skip(f"this lab image has no Ceph ({', '.join(missing)}): rebuild it (nvmeof-roce lab build --force)")
    # the monitor's default port: krbd (kernel-krbd's `rbd map`) takes a bare monitor address for msgr v1 only
    # there ("failed to get mon address" on any other port)
    with DevCluster(Path("/run/nvmeof-roce/ceph-bench"), memstore_bytes=1 << 30) as c:
        yield str(c.conf)


def rbd_cli(conf, *args):
    return subprocess.run(["rbd", "-c", conf, *args], capture_output=True, text=True, timeout=120)


def test_the_rbd_job_set_on_three_servers_of_one_image(tmp_path, capsys, ceph_conf):
    out = tmp_path / "bench"
    capsys.readouterr()
    code = main(["bench", "--rbd", "--rbd-image", IMAGE, "--rbd-conf", ceph_conf, "--runtime", "2", "--ramp", "1",
                 "--repeats", "1", "--size", "32M", "--ns-size", "64M", "--no-perftest", "--no-plots",
                 "--out", str(out)])  # our target on the native RBD path: the default
    printed = capsys.readouterr()
    assert code == 0, printed.err[-4000:] + printed.out[-4000:]
    result = json.loads((out / "bench.json").read_text())
    assert result["ok"] is True
    assert result["params"]["targets"] == list(rbd.TARGET_NAMES)
    assert result["params"]["rbd"]["image"] == IMAGE
    assert result["params"]["rbd"]["rbd_path_requested"] == "native"
    assert result["params"]["rbd"]["data_path_requested"] == "native"
    assert list(result["jobs"]) == list(rbd.JOBS)
    for name, job in result["jobs"].items():
        for target in rbd.TARGET_NAMES:
            (rep,) = job["results"][target]["repeats"]
            assert rep["errors"] == 0 and rep["iops"] > 0, (name, target, rep)
            assert rep["lat_mean_us"] > 0 and rep["lat_us"]["p99"] > 0
            assert set(rep["cpu"]["side"]) == {"ceph-osd", "ceph-mon"}
        ours = job["results"][rbd.USERSPACE]["repeats"][0]
        assert ours["cpu"]["target_us_per_io"] > 0
        # librbd's C API from the native queues served the job (the core at most the first commands, while the
        # handle opened in C)
        assert ours["served"]["rbd"] == "native" and ours["served"]["queues"] == "native", ours["served"]
        assert ours["served"]["native_most_in_flight"] > 0
        assert [(r["numerator"], r["denominator"]) for r in job["ratios"]] == list(rbd.RATIOS)
        assert all(r["iops"] > 0 for r in job["ratios"])
    assert "userspace-rbd/kernel-krbd" in printed.out and "userspace-rbd/fio-rbd" in printed.out
    # nothing left: no krbd mapping, no nvmet subsystem of the bench's, the image the bench created removed
    assert json.loads(rbd_cli(ceph_conf, "showmapped", "--format", "json").stdout or "[]") in ([], {})
    assert not list(Path("/sys/kernel/config/nvmet/subsystems").glob("*bench-kernel-krbd*"))
    assert "bench-smoke" not in rbd_cli(ceph_conf, "ls", "rbd").stdout
