"""The main job shown by `make demo`, run inside the lab guest.

Until the benchmark lands, it shows the kernel's NVMe-oF/RDMA path end to end:
nvmet over rxe0 (configfs), `nvme discover`, `nvme connect`, a short fio run on
the new namespace, `nvme disconnect`, and the kernel target torn down again.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import time

from ..errors import NvmeofError
from ..output import progress

NVMET = "/sys/kernel/config/nvmet"
NQN = "nqn.2014-08.org.nvmeof-roce:demo-kernel"
TRADDR = "10.99.0.1"


def _sh(*args: str, check: bool = True) -> str:
    proc = subprocess.run(args, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NvmeofError(f"{' '.join(args)} failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def setup_kernel_target(backing: str) -> None:
    _sh("modprobe", "-a", "nvmet", "nvmet_rdma", "nvme_rdma", "null_blk")
    subsys = f"{NVMET}/subsystems/{NQN}"
    os.mkdir(subsys)
    _write(f"{subsys}/attr_allow_any_host", "1")
    os.mkdir(f"{subsys}/namespaces/1")
    _write(f"{subsys}/namespaces/1/device_path", backing)
    _write(f"{subsys}/namespaces/1/enable", "1")
    port = f"{NVMET}/ports/1"
    os.mkdir(port)
    for attr, value in (("trtype", "rdma"), ("adrfam", "ipv4"), ("traddr", TRADDR), ("trsvcid", "4420")):
        _write(f"{port}/addr_{attr}", value)
    os.symlink(subsys, f"{port}/subsystems/{NQN}")


def teardown_kernel_target() -> None:
    port = f"{NVMET}/ports/1"
    subsys = f"{NVMET}/subsystems/{NQN}"
    for path in (f"{port}/subsystems/{NQN}",):
        if os.path.islink(path):
            os.unlink(path)
    for path in (port, f"{subsys}/namespaces/1", subsys):
        if os.path.isdir(path):
            if path.endswith("/namespaces/1"):
                _write(f"{path}/enable", "0")
            os.rmdir(path)


def wait_for_namespace(nqn: str, timeout: float = 10.0) -> str:
    """The block device of the first namespace of subsystem `nqn` (native multipath naming)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for subsys in glob.glob("/sys/class/nvme-subsystem/nvme-subsys*"):
            if open(f"{subsys}/subsysnqn").read().strip() == nqn:
                disks = sorted(glob.glob(f"{subsys}/nvme*n*"))
                if disks:
                    return "/dev/" + os.path.basename(disks[0])
        time.sleep(0.1)
    raise NvmeofError(f"no namespace of {nqn} appeared within {timeout:.0f} s after nvme connect",
                      "check 'dmesg' in the guest for nvme/rdma errors")


def run_in_guest(runtime: int = 10) -> int:
    backing = "/dev/nullb0"
    progress("demo: kernel nvmet-rdma on rxe0 (10.99.0.1:4420), namespace on null_blk")
    setup_kernel_target(backing)
    connected = False
    try:
        progress("demo: nvme discover -t rdma -a 10.99.0.1 -s 4420")
        print(_sh("nvme", "discover", "-t", "rdma", "-a", TRADDR, "-s", "4420"))
        progress(f"demo: nvme connect -t rdma -n {NQN}")
        _sh("nvme", "connect", "-t", "rdma", "-a", TRADDR, "-s", "4420", "-n", NQN)
        connected = True
        device = wait_for_namespace(NQN)
        print(_sh("nvme", "list"))
        progress(f"demo: fio 4k randread QD32 on {device} for {runtime} s")
        out = _sh("fio", "--name=demo", f"--filename={device}", "--rw=randread", "--bs=4k", "--iodepth=32",
                  "--ioengine=libaio", "--direct=1", "--time_based", f"--runtime={runtime}", "--output-format=json")
        job = json.loads(out)["jobs"][0]["read"]
        pct = job["clat_ns"]["percentile"]
        print(f"fio (kernel host -> kernel nvmet-rdma -> rxe0, 4k randread QD32): "
              f"{job['iops']:.0f} IOPS, {job['bw_bytes'] / 1e6:.1f} MB/s, "
              f"p50 {pct['50.000000'] / 1000:.0f} us, p99 {pct['99.000000'] / 1000:.0f} us")
    finally:
        if connected:
            progress("demo: nvme disconnect")
            _sh("nvme", "disconnect", "-n", NQN, check=False)
        teardown_kernel_target()
    return 0
