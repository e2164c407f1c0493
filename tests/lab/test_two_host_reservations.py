"""Reservations against our target from two kernel hosts in one guest (docs/reservations.md): two controllers of
one subsystem with their own host NQN and host ID, reached through their controller devices (/dev/nvmeX with
--namespace-id, which go down that controller's path only; the namespace device of the multipath head would pick
one path for both).  The blktests nvme/054 sequence through `nvmeof-roce host resv-*` (nvme-cli), Write
Exclusive and Exclusive Access seen from the other host, the holder's reconnect, preempt and abort under the
preempted host's fio, and PTPL across a restart of the target."""
import copy
import glob
import os
import re
import subprocess
import time

import pytest

from nvmeof_roce.kernel.nvme_cli import NvmeCli, NvmeCliError
from kernel_helpers import save_capture
from targetproc import LAB_IP, ServedTarget, config, disconnect_all_quietly, file_namespace, namespaces_of, nvme

pytestmark = [pytest.mark.lab, pytest.mark.extended]  # about two minutes in the guest: make test-extended

NQN = "nqn.2024-01.io.nvmeof-roce:lab-resv"
HOST_A = ("nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000aa", "00000000-0000-4000-8000-0000000000aa")
HOST_B = ("nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000bb", "00000000-0000-4000-8000-0000000000bb")
PORT_OF = {HOST_A: "4420", HOST_B: "4421"}
KEY_A, KEY_B = 0xA1, 0xB2
WE, EA = 1, 2
CLI = NvmeCli()


def connect(host) -> str:
    """Connect `host` (NQN, ID) and return its controller device."""
    before = set(glob.glob("/sys/class/nvme/nvme*"))
    # Each host on a port of its own: nvme-cli 2.3 (Debian 12) answers "already connected" for a second host on the
    # same address and service id even with --duplicate-connect, as a lab run showed.
    nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", PORT_OF[host], "-n", NQN, "--hostnqn", host[0],
         "--hostid", host[1], "--ctrl-loss-tmo=60", "--reconnect-delay=1")
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        for path in set(glob.glob("/sys/class/nvme/nvme*")) - before:
            try:
                # live, and its namespace scanned (a command on the controller device goes to its namespace)
                if open(f"{path}/hostnqn").read().strip() == host[0] and \
                        open(f"{path}/state").read().strip() == "live" and glob.glob(f"{path}/nvme*n1"):
                    return "/dev/" + os.path.basename(path)
            except OSError:
                continue
        time.sleep(0.1)
    raise AssertionError(f"no live controller of {host[0]}")


def io(dev: str, write: bool, slba: int = 0):
    """One 512-byte Read or Write through this controller: (ok, what nvme-cli said)."""
    args = ["io-passthru", dev, "--namespace-id=1", "--data-len=512", f"--cdw10={slba}", "--cdw12=0"]
    if write:
        args += ["--opcode=0x01", "--write", "--input-file=/dev/urandom"]
    else:
        args += ["--opcode=0x02", "--read"]
    proc = nvme(*args, check=False)
    return proc.returncode == 0, (proc.stderr + proc.stdout if proc.returncode else "")


def conflict(said: str) -> bool:
    """nvme-cli named the status Reservation Conflict (libnvme's text, or nvme-cli 1.x's RESERVATION_CONFLICT)."""
    return re.search(r"reservation.conflict", said, re.I) is not None


def report(dev: str) -> dict:
    return CLI.resv_report(dev, nsid=1)


def hostid_hex(host) -> str:
    return host[1].replace("-", "")


@pytest.fixture
def served(tmp_path):
    image = "/var/tmp/nvmeof-roce-resv.img"
    if os.path.exists(image):
        os.unlink(image)
    ns = file_namespace(1, image, "64M", 512)
    ns["resv"] = {"enable": "1"}
    cfg = config([{"nqn": NQN, "attr": {"allow_any_host": "1"}, "allowed_hosts": [], "namespaces": [ns]}])
    second = copy.deepcopy(cfg["ports"][0])
    second["portid"], second["addr"]["trsvcid"] = 2, PORT_OF[HOST_B]
    cfg["ports"].append(second)
    target = ServedTarget(cfg, str(tmp_path / "resv.json")).start()
    try:
        yield target
    finally:
        disconnect_all_quietly()
        target.stop()


def test_the_nvme_054_sequence_and_the_conflicts_two_hosts_see(served):
    b = connect(HOST_B)
    a = connect(HOST_A)
    r = report(a)
    assert (r["rtype"], r["regctl"], r["registrants"]) == (0, 0, [])
    gen = r["generation"]
    # register, replace, unregister (blktests nvme/054)
    CLI.resv_register(a, nrkey=4, nsid=1)
    r = report(a)
    assert [(g["hostid"], g["rkey"], g["holds"]) for g in r["registrants"]] == [(hostid_hex(HOST_A), 4, False)]
    assert r["generation"] == gen + 1
    CLI.resv_register(a, rrega=2, crkey=4, nrkey=KEY_A, nsid=1)
    assert report(a)["registrants"][0]["rkey"] == KEY_A
    with pytest.raises(NvmeCliError, match="(?i)reservation.conflict"):
        CLI.resv_register(a, rrega=1, crkey=4, nsid=1)  # the old key
    CLI.resv_register(a, rrega=1, crkey=KEY_A, nsid=1)
    assert report(a)["registrants"] == []
    # acquire, release
    CLI.resv_register(a, nrkey=KEY_A, nsid=1)
    CLI.resv_register(b, nrkey=KEY_B, nsid=1)
    CLI.resv_acquire(a, WE, KEY_A, nsid=1)
    r = report(b)
    assert r["rtype"] == WE and [(g["hostid"], g["holds"]) for g in r["registrants"]] == [
        (hostid_hex(HOST_A), True), (hostid_hex(HOST_B), False)]
    save_capture("resv-report-eds.json", nvme("resv-report", b, "--namespace-id=1", "--numd=1023", "--eds",
                                              "--output-format=json").stdout)
    # Write Exclusive: the other host reads, its writes conflict; the holder writes
    assert io(b, write=False)[0]
    ok, said = io(b, write=True)
    assert not ok and conflict(said), said
    assert io(a, write=True)[0]
    CLI.resv_release(a, WE, KEY_A, nsid=1)
    assert report(a)["rtype"] == 0 and io(b, write=True)[0]
    # Exclusive Access: the other host's reads conflict too
    CLI.resv_acquire(a, EA, KEY_A, nsid=1)
    ok, said = io(b, write=False)
    assert not ok and conflict(said), said
    # preempt: B takes it from A (A's registration goes), then clears everything
    CLI.resv_acquire(b, WE, KEY_B, racqa=1, prkey=KEY_A, nsid=1)
    r = report(b)
    assert r["rtype"] == WE and [g["hostid"] for g in r["registrants"]] == [hostid_hex(HOST_B)]
    ok, said = io(a, write=True)
    assert not ok and conflict(said), said
    CLI.resv_release(b, 0, KEY_B, rrela=1, nsid=1)
    r = report(a)
    assert (r["rtype"], r["registrants"]) == (0, []) and io(a, write=True)[0]


def test_held_across_the_holders_reconnect_and_with_ptpl_across_a_target_restart(served):
    b = connect(HOST_B)
    a = connect(HOST_A)
    CLI.resv_register(a, nrkey=KEY_A, cptpl=3, nsid=1)  # persist through power loss
    CLI.resv_acquire(a, WE, KEY_A, nsid=1)
    nvme("disconnect", "-d", os.path.basename(a))
    a = connect(HOST_A)
    assert report(a)["registrants"][0]["holds"] and io(a, write=True)[0]
    assert not io(b, write=True)[0]
    served.stop()
    served.start()
    _wait_live(a)  # both hosts reconnect by themselves (--ctrl-loss-tmo)
    _wait_live(b)
    r = report(b)
    assert r["ptpls"] == 1 and r["rtype"] == WE and r["registrants"][0]["hostid"] == hostid_hex(HOST_A)
    assert not io(b, write=True)[0] and io(a, write=True)[0]


def test_preempt_and_abort_while_the_preempted_host_runs_fio(served):
    b = connect(HOST_B)  # first: the multipath head's I/O goes down B's path
    a = connect(HOST_A)
    (head,) = namespaces_of(NQN)
    CLI.resv_register(a, nrkey=KEY_A, nsid=1)
    CLI.resv_register(b, nrkey=KEY_B, nsid=1)
    CLI.resv_acquire(b, WE, KEY_B, nsid=1)
    fio = subprocess.Popen(["fio", "--name=fenced", f"--filename={head}", "--rw=randwrite", "--bs=4k", "--size=32M",
                            "--iodepth=16", "--ioengine=libaio", "--direct=1", "--time_based", "--runtime=30",
                            "--verify_state_save=0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(3)
        assert fio.poll() is None, fio.stdout.read()
        CLI.resv_acquire(a, WE, KEY_A, racqa=2, prkey=KEY_B, nsid=1)  # preempt and abort
        out, _ = fio.communicate(timeout=60)
    finally:
        if fio.poll() is None:
            fio.kill()
    # the fenced host's writes fail from then on: fio stops with an error long before its 30 s
    assert fio.returncode != 0, out
    r = report(a)
    assert r["rtype"] == WE and [g["hostid"] for g in r["registrants"]] == [hostid_hex(HOST_A)]
    assert io(a, write=True)[0] and not io(b, write=True)[0]
    assert served.proc.poll() is None  # the target serves on


def _live(dev: str) -> bool:
    try:
        return open(f"/sys/class/nvme/{os.path.basename(dev)}/state").read().strip() == "live"
    except OSError:
        return False


def _wait_live(dev: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not _live(dev):
        if time.monotonic() > deadline:
            raise AssertionError(f"{dev} did not reconnect in {timeout} s")
        time.sleep(0.2)
