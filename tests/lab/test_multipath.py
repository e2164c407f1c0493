"""Native NVMe multipath from the kernel host against `target serve --workers 2`: two paths to one namespace
head, round-robin I/O over both, a killed worker, and ANA steering (docs/multipath.md)."""
import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from nvmeof_roce.kernel.nvme_cli import parse_list_subsys
from targetproc import LAB_IP, ServedTarget, config, disconnect_all_quietly, nvme, ram_namespace

pytestmark = pytest.mark.lab

NQN = "nqn.2024-01.io.nvmeof-roce:lab-multipath"
PORTS = {"4420": 1, "4421": 2}  # trsvcid -> portid: worker 0 keeps portid 1, worker 1 gets portid 2


def cli(*args, timeout=60):
    proc = subprocess.run([sys.executable, "-m", "nvmeof_roce", *args], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"nvmeof-roce {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}"
    return proc.stdout


def subsys_dir():
    for d in glob.glob("/sys/class/nvme-subsystem/nvme-subsys*"):
        if open(f"{d}/subsysnqn").read().strip() == NQN:
            return d
    return None


def controllers():
    """{trsvcid: (controller name, state)} of our subsystem's controllers."""
    out = {}
    d = subsys_dir()
    for ctrl in glob.glob(f"{d}/nvme[0-9]*") if d else []:
        name = os.path.basename(ctrl)
        if not os.path.exists(f"/sys/class/nvme/{name}/address"):
            continue  # a namespace head, not a controller
        addr = open(f"/sys/class/nvme/{name}/address").read().strip()
        svc = dict(kv.split("=", 1) for kv in addr.split(",") if "=" in kv).get("trsvcid")
        out[svc] = (name, open(f"/sys/class/nvme/{name}/state").read().strip())
    return out


def wait_paths_live(timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        ctrls = controllers()
        if sorted(ctrls) == sorted(PORTS) and all(s == "live" for _, s in ctrls.values()):
            return ctrls
        if time.monotonic() > deadline:
            raise AssertionError(f"two live paths expected, have {ctrls}")
        time.sleep(0.2)


def head_device():
    d = subsys_dir()
    heads = [os.path.basename(p) for p in glob.glob(f"{d}/nvme*n*") if "c" not in os.path.basename(p)[4:]]
    assert len(heads) == 1, f"one namespace head expected, found {heads}"
    return "/dev/" + heads[0]


def read_commands(ctrl_name):
    """Reads this path's worker served: its SMART log counts the commands that reached it."""
    log = json.loads(nvme("smart-log", f"/dev/{ctrl_name}", "-o", "json").stdout)
    return int(log["host_read_commands"]), int(log["host_write_commands"])


def fio(dev, *args, timeout=600):
    return subprocess.run(["fio", "--name=mp", f"--filename={dev}", "--ioengine=libaio", "--direct=1",
                           "--verify_state_save=0", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def multipath_target(tmp_path):
    mp = open("/sys/module/nvme_core/parameters/multipath").read().strip()
    assert mp == "Y", "the guest kernel needs nvme_core multipath=Y for these tests"
    run_dir = str(tmp_path / "run")
    control_socket = str(tmp_path / "mp.sock")
    cfg = config([{"nqn": NQN, "attr": {"allow_any_host": "1"}, "allowed_hosts": [],
                   "namespaces": [ram_namespace(1, "64M")]}])
    target = ServedTarget(cfg, str(tmp_path / "mp.json"), args=["--workers", "2", "--run-dir", run_dir,
                                                                "--rpc-socket", control_socket]).start(timeout=150)
    try:
        nvme("connect-all", "-t", "rdma", "-a", LAB_IP, "-s", "4420", "--reconnect-delay=1", "--ctrl-loss-tmo=60")
        ctrls = wait_paths_live()
        with open(f"{subsys_dir()}/iopolicy", "w") as f:
            f.write("round-robin")
        yield target, control_socket, ctrls
    finally:
        disconnect_all_quietly()
        code = target.stop()
        print(target.output()[-6000:])  # the supervisor's and workers' log, for the record (-s)
        assert code == 0, target.output()


def test_connect_all_gives_one_head_with_two_live_paths_and_verify_runs_on_both(multipath_target):
    target, control_socket, ctrls = multipath_target
    subs = [s for s in parse_list_subsys(nvme("list-subsys", "-o", "json").stdout) if s["nqn"] == NQN]
    assert len(subs) == 1
    assert sorted(p["trsvcid"] for p in subs[0]["paths"]) == ["4420", "4421"]
    assert all(p["state"] == "live" for p in subs[0]["paths"])
    assert open(f"{subsys_dir()}/iopolicy").read().strip() == "round-robin"
    dev = head_device()
    before = {svc: read_commands(name) for svc, (name, _) in ctrls.items()}
    run = fio(dev, "--rw=randwrite", "--bs=4k", "--size=16M", "--iodepth=16", "--verify=crc32c", "--do_verify=1")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr
    after = {svc: read_commands(name) for svc, (name, _) in ctrls.items()}
    print("reads, writes per path:", {svc: (after[svc][0] - before[svc][0], after[svc][1] - before[svc][1])
                                      for svc in PORTS})
    for svc in PORTS:  # both workers served reads and writes
        assert after[svc][0] > before[svc][0] and after[svc][1] > before[svc][1], (before, after)
    # nvme-cli and our initiator read the ANA log: group 1 optimized on both paths
    for svc, (name, _) in ctrls.items():
        assert "optimized" in nvme("ana-log", f"/dev/{name}").stdout.lower()
    ours = json.loads(cli("initiator", "ana-log", "-a", LAB_IP, "-s", "4421", "-n", NQN, "--json"))
    assert [(g["grpid"], g["state"], g["nsids"]) for g in ours["groups"]] == [(1, "optimized", [1])]


def _worker_pid(target, index):
    for child in open(f"/proc/{target.proc.pid}/task/{target.proc.pid}/children").read().split():
        cmd = open(f"/proc/{child}/cmdline").read().split("\0")
        if "--worker-index" in cmd and cmd[cmd.index("--worker-index") + 1] == str(index):
            return int(child)
    raise AssertionError(f"no worker {index} under the supervisor:\n{target.output()}")


def test_kill_9_of_a_worker_during_verify_then_its_path_comes_back(multipath_target):
    target, control_socket, ctrls = multipath_target
    dev = head_device()
    job = subprocess.Popen(["fio", "--name=mp", f"--filename={dev}", "--ioengine=libaio", "--direct=1",
                            "--verify_state_save=0", "--rw=randwrite", "--bs=4k", "--size=48M", "--iodepth=16",
                            "--verify=crc32c", "--do_verify=1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    time.sleep(3)
    assert job.poll() is None, "fio finished before the kill: make the job longer"
    victim = _worker_pid(target, 1)
    os.kill(victim, signal.SIGKILL)
    out, err = job.communicate(timeout=600)
    assert job.returncode == 0, out[-3000:] + err
    assert "err= 0" in out
    print([line for line in out.splitlines() if "err=" in line or "verify" in line.lower()])
    # the supervisor restarted worker 1 and the host reconnected its path
    assert _worker_pid(target, 1) != victim
    wait_paths_live(timeout=90)
    assert "worker 1 (pid %d) exited with signal 9" % victim in target.output()


@pytest.mark.extended  # over 90 s under emulation: make test-extended (make test keeps the other multipath cases)
def test_ana_inaccessible_moves_io_to_the_other_path_and_back(multipath_target):
    target, control_socket, ctrls = multipath_target
    dev = head_device()
    one, two = ctrls["4420"][0], ctrls["4421"][0]
    job = subprocess.Popen(["fio", "--name=mp", f"--filename={dev}", "--ioengine=libaio", "--direct=1",
                            "--rw=randread", "--bs=4k", "--size=16M", "--iodepth=8", "--time_based",
                            "--runtime=100"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(2)
        print(cli("target", "ana-state", "--socket", control_socket, "--port", "2", "--group", "1", "inaccessible"))
        assert "inaccessible" in nvme("ana-log", f"/dev/{two}").stdout.lower()
        time.sleep(2)  # the host read the ANA log after the notice; requests in flight have drained
        r1, r2 = read_commands(one)[0], read_commands(two)[0]
        time.sleep(4)
        s1, s2 = read_commands(one)[0], read_commands(two)[0]
        print(f"inaccessible: reads in 4 s through 4420 {s1 - r1}, through 4421 {s2 - r2}")
        assert s2 == r2, f"path 4421 is inaccessible but served {s2 - r2} reads"
        assert s1 > r1
        ours = json.loads(cli("initiator", "ana-log", "-a", LAB_IP, "-s", "4421", "-n", NQN, "--json"))
        assert ours["groups"][0]["state"] == "inaccessible"
        shown = cli("target", "ana-state", "--socket", control_socket)
        assert "inaccessible" in shown and "optimized" in shown

        print(cli("target", "ana-state", "--socket", control_socket, "--port", "2", "--group", "1", "optimized"))
        time.sleep(2)
        r1, r2 = read_commands(one)[0], read_commands(two)[0]
        time.sleep(4)
        s1, s2 = read_commands(one)[0], read_commands(two)[0]
        print(f"optimized again: reads in 4 s through 4420 {s1 - r1}, through 4421 {s2 - r2}")
        assert job.poll() is None, "fio ended before the measurement: make its runtime longer"
        assert s1 > r1 and s2 > r2, "both paths serve again after optimized"
    finally:
        out, err = job.communicate(timeout=120)
    assert job.returncode == 0 and "err= 0" in out, out[-3000:] + err
