"""A native queue closed while its device holds a write: the other controller's keep-alives and fio I/O go on.

Our target serves two subsystems on the native data path over rxe: STALL, a file namespace on an ext4 filesystem
(a loop device), and FREE, a RAM namespace.  The kernel host connects to both.  fio writes to FREE for the whole
test; fio writes to STALL until the filesystem is frozen (`fsfreeze -f`: a write that reaches it then waits in the
kernel, uninterruptibly, until the thaw - a device that does not answer, as a multipath `queue_if_no_path` or a
dead NFS server would).  With STALL's writes held on its queues' io_uring rings, the host disconnects from STALL,
so the target closes those queues.  Closing never waits for the ring (docs/native.md, "Closing a queue"): the
event loop goes on serving FREE (its commands keep completing, its controller stays live through its keep-alives)
and the closed queues are listed by `target status` as closing with their held commands.  After the thaw the held
writes come back, the queues' memory is released and the list empties.

A client asks the control socket every 10 ms during the stall and the close (test_live_resize.LoopProbe): its
longest wait bounds the event loop's longest stall from above; it is printed with the loop's own longest pass.
The host's `nvme disconnect` itself waits for its stuck writes to time out (nvme_core.io_timeout) and tears the
queues down meanwhile; it ends after the thaw.
`make test-extended` runs it.
"""
import json
import os
import signal
import subprocess
import time

import pytest

from kernel_helpers import loop_detach, loop_device, sh
from targetproc import LAB_IP, ServedTarget, config, disconnect_all_quietly, namespaces_of, nvme, ram_namespace
from test_live_resize import LoopProbe

pytestmark = [pytest.mark.lab, pytest.mark.extended]

STALL = "nqn.2024-01.io.nvmeof-roce:stall"
FREE = "nqn.2024-01.io.nvmeof-roce:free"
PORT = 4437
WATCH_S = 8  # how long the loop is watched with the closed queues holding their writes
# The probe's longest wait allowed.  A close that waited for the ring would hold the loop until the thaw (the probe's
# thread would not come back at all); what remains is the loop's ordinary work under TCG, a reconnecting queue's
# bounce memory registered among it (about 1 s for 4 MiB in this guest, docs/native.md "Memory").
STALL_BOUND_MS = 5000


def fio(device, name, runtime_s, rw="randwrite"):
    return subprocess.Popen(["fio", f"--name={name}", f"--filename={device}", "--ioengine=libaio", "--direct=1",
                             f"--rw={rw}", "--bs=4k", "--iodepth=16", "--size=32M", "--time_based",
                             f"--runtime={runtime_s}", "--output-format=json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def status(sock):
    from nvmeof_roce.control import client
    return client.call(sock, "nvmeof_get_status")


def namespace(st, nqn):
    return next(n for s in st["subsystems"] if s["nqn"] == nqn for n in s["namespaces"] if n["nsid"] == 1)


def commands(st, nqn):
    ns = namespace(st, nqn)
    return ns["read_commands"] + ns["write_commands"]


def controller_state(nqn):
    for ctrl in os.listdir("/sys/class/nvme"):
        base = f"/sys/class/nvme/{ctrl}"
        try:
            with open(f"{base}/subsysnqn") as f:
                if f.read().strip() != nqn:
                    continue
            with open(f"{base}/state") as f:
                return f.read().strip()
        except OSError:
            continue
    return "gone"


def wait_for(what, check, timeout):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)


@pytest.fixture
def frozen_fs(tmp_path):
    """An ext4 filesystem on a loop device, mounted; thawed, unmounted and detached at the end whatever happened."""
    dev = loop_device(str(tmp_path / "fs.img"), 256)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    sh("mkfs.ext4", "-q", "-F", dev)
    sh("mount", dev, str(mnt))
    yield mnt
    sh("fsfreeze", "-u", str(mnt), check=False)
    sh("umount", str(mnt), check=False)
    loop_detach(dev)


def test_a_queue_closed_while_its_device_holds_writes_does_not_stall_the_other_hosts_io(tmp_path, frozen_fs):
    pytest.importorskip("nvmeof_roce._native")
    image = frozen_fs / "ns.img"
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    sock = str(tmp_path / "stall.sock")
    cfg = config([{"nqn": STALL, "attr": {"allow_any_host": "1"}, "allowed_hosts": [],
                   "namespaces": [{"nsid": 1, "enable": 1, "device": {"path": str(image)},
                                   "nvmeof_roce": {"backend": "file", "size": "64M", "block_size": 512,
                                                   "io_engine": "io_uring"}}]},
                  {"nqn": FREE, "attr": {"allow_any_host": "1"}, "allowed_hosts": [],
                   "namespaces": [ram_namespace(1, "64M", 512)]}], port=PORT)
    target = ServedTarget(cfg, str(tmp_path / "stall.json"), args=["--rpc-socket", sock]).start(timeout=240)
    stall_fio = free_fio = disconnect = None
    try:
        assert status(sock)["data_path"] == "native"
        for nqn in (STALL, FREE):
            nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", str(PORT), "-n", nqn)
        stall_dev, free_dev = namespaces_of(STALL)[0], namespaces_of(FREE)[0]
        free_fio = fio(free_dev, "free", 900)  # until the end: stopped with SIGINT, which has it print its results
        stall_fio = fio(stall_dev, "stall", 900)
        wait_for("writes reaching both namespaces",
                 lambda: commands(status(sock), STALL) > 100 and commands(status(sock), FREE) > 100, 60)

        sh("fsfreeze", "-f", str(frozen_fs), timeout=60)
        held = wait_for("writes held on the native rings",
                        lambda: (namespace(status(sock), STALL)["io"] or {}).get("native_in_flight", 0), 30)
        print(f"\nfilesystem frozen: {held} native writes of {STALL} held on the rings")

        with LoopProbe(sock) as probe:
            # The host's disconnect waits for its own writes (they time out: nvme_core.io_timeout), and tears the
            # queues down meanwhile: the target closes them with their writes still held.
            t0 = time.monotonic()
            disconnect = subprocess.Popen(["nvme", "disconnect", "-n", STALL], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True)
            closing = wait_for("the closed queues listed as closing",
                               lambda: status(sock)["transport"].get("closing_queues"), 240)
            closed_after_s = time.monotonic() - t0
            before = commands(status(sock), FREE)
            time.sleep(WATCH_S)
            st = status(sock)
            served = commands(st, FREE) - before
            still = st["transport"]["closing_queues"]
            free_state = controller_state(FREE)
        loop_ms = st["transport"]["loop"]["longest_pass_s"] * 1000
        print(f"{len(closing)} queue(s) of {STALL} closed {closed_after_s:.1f} s into the host's disconnect, "
              f"holding {sum(q['held_commands'] for q in closing)} writes: {json.dumps(closing)}")
        print(f"in the next {WATCH_S} s: {FREE} served {served} commands ({served / WATCH_S:.0f}/s), its controller "
              f"{free_state}; the probe's longest wait {probe.longest_ms:.1f} ms; the loop's longest pass since "
              f"start {loop_ms:.1f} ms")
        assert served > 0, f"{FREE} served nothing while {STALL}'s closed queues held their writes"
        assert free_state == "live", free_state
        assert still and sum(q["held_commands"] for q in still) > 0, still
        assert probe.longest_ms < STALL_BOUND_MS, f"the event loop stalled {probe.longest_ms:.0f} ms"

        sh("fsfreeze", "-u", str(frozen_fs))
        t0 = time.monotonic()
        wait_for("the held writes back and the closing queues released",
                 lambda: status(sock)["transport"]["closing_queues"] == [], 60)
        print(f"thawed: the closing queues released {time.monotonic() - t0:.2f} s later")
        out, err = disconnect.communicate(timeout=300)
        print(f"the host's disconnect from {STALL} ended {time.monotonic() - t0:.1f} s after the thaw "
              f"(rc {disconnect.returncode})")

        free_fio.send_signal(signal.SIGINT)
        out, err = free_fio.communicate(timeout=120)
        job = json.loads(out[out.index("{"):])["jobs"][0]
        assert job["error"] == 0, f"fio on {FREE}: error {job['error']}: {err}"
        print(f"fio on {FREE}: {job['write']['io_bytes'] >> 20} MiB written, no error")
        stall_fio.kill()
        stall_fio.communicate(timeout=60)
        log = target.output()
        assert "commands still on the device" in log and "came back from the device" in log, log[-4000:]
        assert "Traceback" not in log, log[-4000:]
        assert status(sock)["internal_errors"] == 0
    finally:
        subprocess.run(["fsfreeze", "-u", str(frozen_fs)], capture_output=True)
        for proc in (stall_fio, free_fio, disconnect):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()
        disconnect_all_quietly()
        assert target.stop() == 0, target.output()[-4000:]
