"""The bench's scaling job set for real (issue 13): the kernel target, our target, and our target with
`--workers 2` reached through native NVMe multipath, interleaved; one short repeat.

It checks the mechanics, not the figure (the 2-vCPU guest has no spare core for a second worker; the figure
is measured with `lab run --cpus 4`, docs/benchmarks.md): both paths live and round-robin, both carried I/O
(the kernel's per-path counters), every worker's CPU sampled, the scaling figures in bench.json and the table,
and nothing left behind.
"""
import json
from pathlib import Path

import pytest

from nvmeof_roce.bench.targets import NQN_PREFIX
from nvmeof_roce.cli import main

pytestmark = pytest.mark.lab


def _ours_connected():
    return [c.name for c in Path("/sys/class/nvme").glob("nvme*")
            if (c / "subsysnqn").read_text().strip().startswith(NQN_PREFIX)]


@pytest.mark.extended  # a bench run of about a minute: make test-extended
def test_scaling_job_set_spreads_io_over_both_workers(tmp_path, capsys):
    mp = Path("/sys/module/nvme_core/parameters/multipath").read_text().strip()
    assert mp == "Y", "the guest kernel needs nvme_core multipath=Y"
    out = tmp_path / "scaling"
    code = main(["bench", "--targets", "kernel,userspace,userspace-2w", "--jobs", "randread-4k-qd32",
                 "--runtime", "2", "--ramp", "0", "--repeats", "1", "--size", "16M", "--ns-size", "32M",
                 "--no-perftest", "--no-plots", "--out", str(out)])
    got = capsys.readouterr()
    print(got.err[-4000:])
    assert code == 0, got.err + got.out
    assert "scaling over workers" in got.out and "userspace-2w" in got.out

    result = json.loads((out / "bench.json").read_text())
    assert result["ok"] is True
    t = result["targets"]["userspace-2w"]
    assert (t["workers"], t["trsvcids"]) == (2, ["4424", "4425"])
    job = result["jobs"]["randread-4k-qd32"]
    (rep,) = job["results"]["userspace-2w"]["repeats"]
    assert rep["errors"] == 0 and rep["iops"] > 0
    # round-robin over two live paths: each worker's path carried a fair share of the reads
    paths = rep["paths"]
    assert sorted(paths) == ["4424", "4425"], paths
    assert min(paths.values()) > 0.3 * sum(paths.values()), paths
    assert sum(paths.values()) >= rep["iops"] * 2 * 0.9  # the paths carried the job's I/O, all of it
    # every process of the multi-worker target was sampled, and the workers did the work
    procs = rep["cpu"]["processes"]
    assert sorted(procs) == ["supervisor", "worker0", "worker1"], procs
    assert procs["worker0"]["cpu_percent"] > 5 and procs["worker1"]["cpu_percent"] > 5, procs
    assert set(job["results"]["userspace"]["repeats"][0]["cpu"]["processes"]) == {"target"}
    # the figures: medians divided
    (sc,) = job["scaling"]
    med = {n: job["results"][n]["median"]["iops"] for n in ("kernel", "userspace", "userspace-2w")}
    assert sc["iops_over_single"] == pytest.approx(med["userspace-2w"] / med["userspace"])
    assert sc["iops_over_kernel"] == pytest.approx(med["userspace-2w"] / med["kernel"])
    assert _ours_connected() == []
    assert not list(Path("/dev/shm").glob("nvmeof-roce-*"))  # the workers' shared RAM namespace is gone
