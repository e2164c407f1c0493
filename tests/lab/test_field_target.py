"""The userspace target under field load (issue 11), with the real kernel host over rxe: one host's heavy
traffic or long commands must not get another host's idle controller expired by keep-alive."""
import json
import os
import re
import subprocess
import time

import pytest

from targetproc import LAB_IP, ServedTarget, config, disconnect_all_quietly, namespaces_of, nvme, ram_namespace

pytestmark = pytest.mark.lab

NQN_BUSY = "nqn.2024-01.io.nvmeof-roce:field-busy"
NQN_IDLE = "nqn.2024-01.io.nvmeof-roce:field-idle"
# a second host on the same machine: its own host NQN and host ID
HOST2 = "nqn.2014-08.org.nvmexpress:uuid:2a2a2a2a-0000-4000-8000-000000000002"
HOST2_ID = "2a2a2a2a-0000-4000-8000-000000000002"
NS_BLOCKS = 65536  # 256 MiB of 4 KiB blocks


@pytest.fixture
def served(tmp_path):
    cfg = config([
        {"nqn": NQN_BUSY, "attr": {"allow_any_host": "1"}, "namespaces": [ram_namespace(1, "256M", 4096)]},
        {"nqn": NQN_IDLE, "attr": {"allow_any_host": "1"}, "namespaces": [ram_namespace(1, "16M", 512)]},
    ])
    target = ServedTarget(cfg, str(tmp_path / "field.json")).start()
    yield target
    disconnect_all_quietly()
    target.stop()


def connect_idle(kato: int) -> str:
    nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", "4420", "-n", NQN_IDLE, "-q", HOST2, "-I", HOST2_ID,
         "-k", str(kato))
    return namespaces_of(NQN_IDLE)[0]


def controller_state(nqn: str) -> str:
    for ctrl in os.listdir("/sys/class/nvme"):
        base = f"/sys/class/nvme/{ctrl}"
        if open(f"{base}/subsysnqn").read().strip() == nqn:
            return open(f"{base}/state").read().strip()
    return "gone"


def assert_idle_controller_kept(target, device):
    out = target.output()
    assert "keep-alive timeout" not in out, out[-3000:]
    assert controller_state(NQN_IDLE) == "live"
    nvme("flush", device, "-n", "1")  # the idle controller still works afterwards


def longest_pass_ms(target) -> float:
    """The figure `target serve` logs at shutdown."""
    assert target.stop() == 0
    m = re.search(r"longest loop pass ([0-9.]+) ms since start", target.output())
    assert m, target.output()[-2000:]
    return float(m.group(1))


@pytest.mark.long
def test_idle_controller_survives_a_minute_of_full_load_on_another_subsystem(served):
    nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", "4420", "-n", NQN_BUSY)
    busy = namespaces_of(NQN_BUSY)[0]
    idle = connect_idle(kato=5)
    proc = subprocess.run(["fio", "--name=load", f"--filename={busy}", "--ioengine=libaio", "--direct=1",
                           "--rw=randrw", "--bsrange=4k-128k", "--iodepth=8", "--numjobs=2", "--size=128M",
                           "--time_based", "--runtime=60", "--group_reporting", "--output-format=json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    job = json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0]
    assert job["error"] == 0 and job["read"]["io_bytes"] > 0 and job["write"]["io_bytes"] > 0
    assert_idle_controller_kept(served, idle)
    print(f"\nfield: 60 s fio randrw QD8 x2: read {job['read']['io_bytes'] >> 20} MiB, "
          f"write {job['write']['io_bytes'] >> 20} MiB; longest loop pass {longest_pass_ms(served):.1f} ms")


def test_long_commands_do_not_expire_another_hosts_controller(served):
    nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", "4420", "-n", NQN_BUSY)
    busy = namespaces_of(NQN_BUSY)[0]
    idle = connect_idle(kato=2)
    # fill the namespace so deallocation has pages to give back
    subprocess.run(["dd", "if=/dev/urandom", f"of={busy}", "bs=1M", "count=256", "oflag=direct"],
                   check=True, capture_output=True, timeout=300)
    whole = ",".join(["0"] * 256)
    blocks = ",".join([str(NS_BLOCKS)] * 256)
    started = time.monotonic()
    for _ in range(3):
        nvme("dsm", busy, "-n", "1", "--ad", "-s", whole, "-b", blocks)  # 256 ranges, each the whole namespace
        nvme("write-zeroes", busy, "-n", "1", "-s", "0", "-c", str(NS_BLOCKS - 1))  # 256 MiB in one command
    took = time.monotonic() - started
    time.sleep(3)  # more than the idle host's KATO: its keep-alives must have been answered throughout
    head = subprocess.run(["dd", f"if={busy}", "bs=1M", "count=1", "iflag=direct"], capture_output=True,
                          timeout=60).stdout
    assert head == bytes(1 << 20)
    assert_idle_controller_kept(served, idle)
    print(f"\nfield: 3 x (256-range whole-namespace DSM + 256 MiB Write Zeroes) in {took:.1f} s; "
          f"longest loop pass {longest_pass_ms(served):.1f} ms")
