"""The main job shown by `make demo`: the kernel target and ours, side by side, in the lab.

On the host: boot the lab with a results folder shared in; inside, serve
targets/demo.json with our userspace target (port 4421) and the same-sized
namespace with the kernel's nvmet-rdma (port 4420), connect the kernel host to
each, measure the link with perftest, run a short set of fio jobs and the
userspace initiator's perf against both (interleaved), tear everything down.
Back on the host: print the side-by-side table and draw the plots.
"""
from __future__ import annotations

import time
from pathlib import Path

from ..output import progress

DEMO_CONFIG = "targets/demo.json"
DEMO_JOBS = ",".join([
    "randread-4k-qd1", "randread-4k-qd32", "randwrite-4k-qd32", "seqread-128k-qd16", "verify-crc32c-64k-qd8",
    "uinit-randread-4k-qd1", "uinit-randread-4k-qd32",
])


def bench_argv(out_dir: str, runtime: int) -> list:
    return ["bench", "--jobs", DEMO_JOBS, "--runtime", str(runtime), "--ramp", "1", "--repeats", "1",
            "--userspace-config", DEMO_CONFIG, "--ns-size", "512M", "--size", "128M",
            "--perftest-iterations", "2000", "--out", out_dir, "--no-plots"]


def run_in_guest(out_dir: str, runtime: int) -> int:
    from ..cli import main
    progress(f"demo: kernel nvmet-rdma (10.99.0.1:4420, null_blk) and the userspace target "
             f"({DEMO_CONFIG}, 10.99.0.1:4421) side by side, {runtime} s per job")
    return main(bench_argv(out_dir, runtime))


def run_on_host(project: Path, runtime: int, timeout: float) -> int:
    from ..cli import main
    from . import image as lab_image
    from .vm import LabRun, run_in_guest as boot_and_run

    out = project / "results" / time.strftime("demo-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    image = lab_image.build(force=False)
    progress(f"demo: booting the lab guest; results go to {out}")
    run = LabRun(command=["nvmeof-roce", "demo", "--in-guest", "--out", "/mnt/share", "--runtime", str(runtime)],
                 project=project, share=out, timeout=timeout)
    code = boot_and_run(image, run)
    if not (out / "bench.json").exists():
        progress(f"demo: the lab run ended with exit code {code} and no bench.json")
        return code or 1
    progress("demo: drawing the plots on the host")
    drawn = main(["bench", "--from", str(out / "bench.json"), "--out", str(out)])
    return code or drawn
