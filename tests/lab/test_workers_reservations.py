"""Reservations under `target serve --workers 2` from the kernel host (docs/reservations.md, "--workers"): a real
supervisor and its two worker processes over Soft-RoCE, two host identities each connected to both workers.

The config has two ports, 4420 and 4430, so worker 0 listens on 4420 and 4430 and worker 1 on 4421 and 4431: host A
connects to 4420 (worker 0) and 4421 (worker 1), host B to 4430 (worker 0) and 4431 (worker 1), each host on ports of
its own (nvme-cli 2.3 answers "already connected" for a second host NQN on an address and service id already
connected, as test_two_host_reservations found).  The kernel's native multipath makes one subsystem with one
namespace head over the four paths: I/O on the head (/dev/nvmeXnY) goes down whichever path the kernel picks, for
both hosts alike, and the per-path namespaces (nvmeXcYnZ) are hidden disks with no device node.  So every command
here that must take one path goes through that path's controller device, /dev/nvmeX (nvme-cli's resv-* and
io-passthru with --namespace-id, and A's writes in point 3 by the same ioctl, NVME_IOCTL_IO_CMD, which the kernel
sends on that controller's own I/O queue of the namespace), and each status is the one the kernel host returns.

1. A registers and acquires Write Exclusive through worker 0 (4420); the Reservation Report through worker 1 and
   through B's paths is the same (holder, type, generation).
2. B's writes conflict through worker 1 and worker 0; its reads pass; A's writes pass through worker 1.
3. A writes through worker 0 while B preempts and aborts it through worker 1: 4 threads of 4 KiB passthrough
   writes on A's controller to worker 0 (each command's time and status), and fio (libaio, O_DIRECT, QD16) on the
   namespace head, whose I/O the kernel sends down the first path connected, A's to worker 0 (the kernel's log
   lines name that per-path disk).  Every passthrough write submitted after the preempt's answer gets Reservation
   Conflict, fio stops with an I/O error the kernel logs as the reservation conflict on A's path; B then writes
   its pattern through worker 1 while A's writer keeps trying, and every block reads back B's through both workers.
4. Worker 1 SIGKILLed: the supervisor restarts it, the host reconnects its two paths there, and the Reservation
   Report through it is the one from before the kill; its conflicts are the same.
"""
import fcntl
import glob
import mmap
import os
import re
import signal
import struct
import subprocess
import threading
import time

import pytest

from nvmeof_roce.kernel.nvme_cli import NvmeCli
from nvmeof_roce.nvme import status as S
from targetproc import LAB_IP, ServedTarget, config, disconnect_all_quietly, nvme

pytestmark = pytest.mark.lab  # about 40 s in the guest: make test's lab tier

NQN = "nqn.2024-01.io.nvmeof-roce:lab-workers-resv"
HOST_A = ("nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000aa", "00000000-0000-4000-8000-0000000000aa")
HOST_B = ("nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000bb", "00000000-0000-4000-8000-0000000000bb")
# (host, worker) -> trsvcid: worker i listens on each configured port's trsvcid + i
PATHS = {("A", 0): "4420", ("A", 1): "4421", ("B", 0): "4430", ("B", 1): "4431"}
KEY_A, KEY_B = 0xA1, 0xB2
WE = 1
CLI = NvmeCli()
OK, CONFLICT = 0, S.RESERVATION_CONFLICT
BLOCK = 512
RANGE_LBAS = 2048  # 1 MiB from LBA 0: what A writes in point 3 and B overwrites
IO_LBAS = 8        # 4 KiB per command


def hostid_hex(host) -> str:
    return host[1].replace("-", "")


# ------------------------------------------------------------------------------------------------ the host's paths

def controller_of(host, svc: str):
    """The controller name (nvmeX) of `host` on trsvcid `svc`, and its state; (None, None) if there is none."""
    for path in glob.glob("/sys/class/nvme/nvme*"):
        try:
            if open(f"{path}/subsysnqn").read().strip() != NQN or open(f"{path}/hostnqn").read().strip() != host[0]:
                continue
            addr = open(f"{path}/address").read().strip()
            if dict(kv.split("=", 1) for kv in addr.split(",") if "=" in kv).get("trsvcid") != svc:
                continue
            return os.path.basename(path), open(f"{path}/state").read().strip()
        except OSError:
            continue
    return None, None


def wait_live(host, svc: str, timeout: float = 60.0) -> str:
    """/dev/nvmeX of `host` on `svc` once it is live with its namespace scanned."""
    deadline = time.monotonic() + timeout
    while True:
        name, state = controller_of(host, svc)
        if state == "live" and glob.glob(f"/sys/class/nvme/{name}/nvme*n1"):
            return "/dev/" + name
        if time.monotonic() > deadline:
            raise AssertionError(f"{host[0]} on {svc}: no live controller in {timeout} s (state {state})")
        time.sleep(0.2)


def connect(host, svc: str) -> str:
    nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", svc, "-n", NQN, "--hostnqn", host[0], "--hostid", host[1],
         "--ctrl-loss-tmo=120", "--reconnect-delay=1")
    return wait_live(host, svc, 20)


# ------------------------------------------------------------------------------------------------ I/O on one path

NVME_IOCTL_IO_CMD = 0xC0484E43  # _IOWR('N', 0x43, struct nvme_passthru_cmd)
PASSTHRU = struct.Struct("<BBHIIIQQII6III")  # struct nvme_passthru_cmd, 72 bytes
assert PASSTHRU.size == 72


class Path:
    """One controller's path to namespace 1: NVM Read/Write by NVME_IOCTL_IO_CMD on /dev/nvmeX (the kernel sends it
    on that controller's queue, as nvme-cli's io-passthru does); each returns the NVMe status the host got (DNR
    and More masked off), or -errno."""

    def __init__(self, dev: str):
        self.dev = dev

    def _cmd(self, opcode: int, slba: int, nlb: int, buf: mmap.mmap) -> int:
        import ctypes
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        cmd = bytearray(PASSTHRU.pack(opcode, 0, 0, 1, 0, 0, 0, addr, 0, nlb * BLOCK,
                                      slba & 0xFFFFFFFF, slba >> 32, nlb - 1, 0, 0, 0, 0, 0))
        fd = os.open(self.dev, os.O_RDWR)
        try:
            ret = fcntl.ioctl(fd, NVME_IOCTL_IO_CMD, cmd)
        except OSError as exc:
            return -exc.errno
        finally:
            os.close(fd)
        return ret & S.CODE_MASK if ret > 0 else ret

    def write(self, slba: int, data: bytes) -> int:
        buf = mmap.mmap(-1, max(len(data), mmap.PAGESIZE))
        buf[:len(data)] = data
        return self._cmd(0x01, slba, len(data) // BLOCK, buf)

    def read(self, slba: int, nlb: int):
        buf = mmap.mmap(-1, max(nlb * BLOCK, mmap.PAGESIZE))
        status = self._cmd(0x02, slba, nlb, buf)
        return status, bytes(buf[:nlb * BLOCK])


class Writer:
    """Threads writing 4 KiB at random LBAs of the range through one path until stopped: (start, end, status) of
    each command."""

    def __init__(self, path: Path, threads: int = 4):
        self.path, self.log, self.stop = path, [], threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def _run(self, i: int) -> None:
        import random
        rnd = random.Random(i)
        data = bytes([0xA0 + i]) * (IO_LBAS * BLOCK)
        while not self.stop.is_set():
            slba = rnd.randrange(0, RANGE_LBAS // IO_LBAS) * IO_LBAS
            t0 = time.monotonic()
            status = self.path.write(slba, data)
            self.log.append((t0, time.monotonic(), status))

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(60)


def report(dev: str) -> dict:
    return CLI.resv_report(dev, nsid=1)


def holder_view(r: dict):
    return r["generation"], r["rtype"], [(g["hostid"], g["rkey"], g["holds"]) for g in r["registrants"]]


# ------------------------------------------------------------------------------------------------ the target

def worker_pid(target: ServedTarget, index: int) -> int:
    """Worker `index`'s pid: the supervisor's child with --worker-index INDEX."""
    children = open(f"/proc/{target.proc.pid}/task/{target.proc.pid}/children").read().split()
    for child in children:
        try:
            cmd = open(f"/proc/{child}/cmdline").read().split("\0")
        except OSError:
            continue
        if "--worker-index" in cmd and cmd[cmd.index("--worker-index") + 1] == str(index):
            return int(child)
    raise AssertionError(f"no worker {index} under the supervisor:\n{target.output()[-4000:]}")


@pytest.fixture
def workers_target(tmp_path):
    assert open("/sys/module/nvme_core/parameters/multipath").read().strip() == "Y", "nvme_core multipath=Y needed"
    ns = {"nsid": 1, "enable": 1, "nvmeof_roce": {"backend": "ram", "size": "64M", "block_size": BLOCK},
          "resv": {"enable": "1"}}
    cfg = config([{"nqn": NQN, "attr": {"allow_any_host": "1"}, "allowed_hosts": [], "namespaces": [ns]}])
    second = {**cfg["ports"][0], "portid": 2, "addr": {**cfg["ports"][0]["addr"], "trsvcid": "4430"}}
    cfg["ports"].append(second)
    target = ServedTarget(cfg, str(tmp_path / "wresv.json"),
                          args=["--workers", "2", "--run-dir", str(tmp_path / "run")]).start(timeout=180)
    try:
        yield target
    finally:
        disconnect_all_quietly()
        code = target.stop()
        print(target.output()[-6000:])  # the supervisor's and the workers' log, for the record (-s)
        assert code == 0, target.output()[-6000:]


def topology():
    """Our subsystem as the kernel host sees it: (nvme-subsysN, its controllers, its one namespace head, the head's
    per-path disks nvmeNcXn1)."""
    (subsys,) = [d for d in glob.glob("/sys/class/nvme-subsystem/nvme-subsys*")
                 if open(f"{d}/subsysnqn").read().strip() == NQN]
    names = [os.path.basename(p) for p in glob.glob(f"{subsys}/nvme*")]
    ctrls = sorted(n for n in names if "n" not in n[4:])
    (head,) = [n for n in names if "n" in n[4:]]
    per_path = sorted(os.path.basename(p) for c in ctrls for p in glob.glob(f"/sys/class/nvme/{c}/nvme*c*n*"))
    return os.path.basename(subsys), ctrls, head, per_path


class KernelLog:
    """The kernel's log from now on, read from /dev/kmsg as it comes (the passthrough writes each log the
    kernel's "deprecated NVME_IOCTL_IO_CMD" warning: thousands of lines, which wrap dmesg's ring; they are left
    out here)."""

    NOISE = "deprecated NVME_IOCTL_IO_CMD"

    def __init__(self):
        self.lines, self.noise, self.lost, self.stop = [], 0, 0, threading.Event()
        self.fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
        os.lseek(self.fd, 0, os.SEEK_END)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                record = os.read(self.fd, 8192).decode(errors="replace")
            except BlockingIOError:
                time.sleep(0.005)
                continue
            except BrokenPipeError:  # overwritten before it was read
                self.lost += 1
                continue
            text = record.split(";", 1)[-1].split("\n", 1)[0]
            if self.NOISE in text:
                self.noise += 1
            else:
                self.lines.append(text)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        time.sleep(0.2)
        self.stop.set()
        self.thread.join(5)
        os.close(self.fd)


# ------------------------------------------------------------------------------------------------ the test

def test_a_reservation_is_one_across_two_worker_processes_for_the_kernel_host(workers_target):
    target = workers_target
    t_start = time.monotonic()
    hosts = {"A": HOST_A, "B": HOST_B}
    dev = {}
    for key in (("A", 0), ("A", 1), ("B", 0), ("B", 1)):  # A's path to worker 0 first: the head's first path
        dev[key] = connect(hosts[key[0]], PATHS[key])
    print("paths:", {f"{h} to worker {w} ({PATHS[(h, w)]})": d for (h, w), d in dev.items()})
    subsys, ctrls, head, per_path = topology()
    print(f"one subsystem {subsys}: controllers {ctrls}, one namespace head /dev/{head} over the paths {per_path}")
    assert sorted(ctrls) == sorted(os.path.basename(d) for d in dev.values()) and len(per_path) == 4
    path = {k: Path(d) for k, d in dev.items()}
    a0, a1, b0, b1 = dev["A", 0], dev["A", 1], dev["B", 0], dev["B", 1]

    # 1. A registers and acquires Write Exclusive through worker 0; the report is the same through worker 1
    before = report(a1)
    CLI.resv_register(a0, nrkey=KEY_A, nsid=1)
    CLI.resv_acquire(a0, WE, KEY_A, nsid=1)
    through = {k: report(d) for k, d in dev.items()}
    r0 = through["A", 0]
    assert r0["rtype"] == WE and holder_view(r0)[2] == [(hostid_hex(HOST_A), KEY_A, True)], r0
    assert r0["generation"] == before["generation"] + 1  # the Register; an Acquire does not count
    for k, r in through.items():
        assert holder_view(r) == holder_view(r0), f"through {k}: {r} != worker 0's {r0}"
    print(f"1. A holds Write Exclusive (acquired through worker 0); generation {r0['generation']}, the same report "
          f"through all four paths")

    # 2. host B: its writes conflict through both workers, its reads pass; A writes through worker 1
    CLI.resv_register(b1, nrkey=KEY_B, nsid=1)
    assert report(a0)["regctl"] == 2  # B's Register through worker 1, seen through worker 0
    pattern = os.urandom(IO_LBAS * BLOCK)
    got = {"B writes through worker 1": path["B", 1].write(0, pattern),
           "B writes through worker 0": path["B", 0].write(0, pattern),
           "B reads through worker 1": path["B", 1].read(0, IO_LBAS)[0],
           "B reads through worker 0": path["B", 0].read(0, IO_LBAS)[0],
           "A writes through worker 1": path["A", 1].write(0, pattern),
           "A writes through worker 0": path["A", 0].write(IO_LBAS, pattern)}
    print("2.", {k: S.describe(v) if v > 0 else v for k, v in got.items()})
    assert got == {"B writes through worker 1": CONFLICT, "B writes through worker 0": CONFLICT,
                   "B reads through worker 1": OK, "B reads through worker 0": OK,
                   "A writes through worker 1": OK, "A writes through worker 0": OK}, got
    assert path["B", 0].read(0, IO_LBAS) == (OK, pattern)  # A's write through worker 1, read through worker 0

    # 3. B preempts and aborts A through worker 1 while A writes through worker 0
    # A's writes: the passthrough writer on A's controller to worker 0 (each command's time and status), and fio
    # on the namespace head, whose I/O the kernel sends down the first path connected, A's to worker 0 (the
    # kernel's log lines name the per-path disk, checked below)
    kmsg = KernelLog().__enter__()
    fio = subprocess.Popen(["fio", "--name=holder", f"--filename=/dev/{head}", "--rw=randwrite", "--bs=4k",
                            f"--size={RANGE_LBAS * BLOCK}", "--iodepth=16", "--ioengine=libaio", "--direct=1",
                            "--time_based", "--runtime=60", "--verify_state_save=0"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with Writer(path["A", 0]) as writer:
            time.sleep(2)
            written = sum(1 for _, _, s in writer.log if s == OK)
            assert written > 0 and all(s == OK for _, _, s in writer.log), writer.log[:20]
            assert fio.poll() is None, fio.stdout.read()
            t0 = time.monotonic()
            CLI.resv_acquire(b1, WE, KEY_B, racqa=2, prkey=KEY_A, nsid=1)  # preempt and abort
            answered = time.monotonic()
            fio_out, _ = fio.communicate(timeout=60)  # A's fio fails: it stops at its first error
            fio_ended = time.monotonic()
            fill = 0x5B
            data = bytes([fill]) * (128 * BLOCK)
            b_writes = [path["B", 1].write(slba, data) for slba in range(0, RANGE_LBAS, 128)]
            time.sleep(1)
    finally:
        kmsg.__exit__()
        if fio.poll() is None:
            fio.kill()
            fio.wait()
    log = list(writer.log)
    subsys_no, head_no = re.fullmatch(r"nvme(\d+)n(\d+)", head).groups()
    a0_disk = f"nvme{subsys_no}c{os.path.basename(a0)[4:]}n{head_no}"  # the per-path disk of A's path to worker 0
    assert a0_disk in per_path, (a0_disk, per_path)
    kernel = [x for x in kmsg.lines if "nvme" in x]
    errors = [x for x in kernel if re.search(r"nvme\d+c\d+n\d+", x)]
    print(f"3. fio on /dev/{head} (A's writes down {a0_disk}): exit status {fio.returncode} "
          f"{(fio_ended - answered) * 1000:.0f} ms after the preempt's answer; "
          f"{[x for x in fio_out.splitlines() if 'err=' in x or 'error' in x.lower()][:3]}")
    print("3. the kernel's log:", errors[:6], f"({len(errors)} lines naming a path; {kmsg.noise} deprecated-ioctl "
          f"warnings left out, {kmsg.lost} records overwritten before they were read)")
    assert fio.returncode != 0 and "Invalid exchange" in fio_out, fio_out[-3000:]  # EBADE: the host's errno for it
    assert errors and all(a0_disk in x for x in errors), f"head I/O not on A's path {a0_disk}: {kernel[-20:]}"
    assert any(re.search(r"reservation conflict|sc 0x83|nexus", x, re.I) for x in errors), errors
    before_preempt = [s for _, e, s in log if e < t0]
    in_flight = [s for t, e, s in log if t < answered <= e or t0 <= t < answered]
    after = [s for t, _, s in log if t >= answered]
    print(f"3. A's writes through worker 0: {len(before_preempt)} completed before the preempt was sent (all "
          f"success), {len(in_flight)} in flight while it was answered ({sorted(set(in_flight))}), {len(after)} "
          f"submitted after its answer ({len(answered_statuses := set(after))} status(es): "
          f"{[S.describe(s) if s > 0 else s for s in sorted(answered_statuses)]}); the preempt took "
          f"{(answered - t0) * 1000:.0f} ms (nvme-cli's run included)")
    assert before_preempt and all(s == OK for s in before_preempt)
    assert after and all(s == CONFLICT for s in after), sorted(set(after))
    assert b_writes == [OK] * len(b_writes), b_writes
    for w in (0, 1):  # every block B's, read through each worker (A, unregistered, may read under Write Exclusive)
        reads = [path["A", w].read(slba, 128) for slba in range(0, RANGE_LBAS, 128)]
        assert [s for s, _ in reads] == [OK] * len(reads), [s for s, _ in reads]
        back = b"".join(d for _, d in reads)
        bad = [i for i in range(RANGE_LBAS) if back[i * BLOCK:(i + 1) * BLOCK] != bytes([fill]) * BLOCK]
        assert bad == [], f"through worker {w}: {len(bad)} blocks are not B's (first {bad[:8]})"
    r = report(a0)
    assert r["rtype"] == WE and holder_view(r)[2] == [(hostid_hex(HOST_B), KEY_B, True)], r
    assert holder_view(report(a1)) == holder_view(r)
    assert path["A", 1].write(0, pattern) == CONFLICT  # A's other path too

    # 4. worker 1 SIGKILLed: restarted by the supervisor; the host reconnects; the report through it is the same
    kept = report(a0)
    victim = worker_pid(target, 1)
    os.kill(victim, signal.SIGKILL)
    t_kill = time.monotonic()
    deadline = time.monotonic() + 150
    while True:
        try:
            pid = worker_pid(target, 1)
        except AssertionError:
            pid = None
        if pid and pid != victim and controller_of(HOST_A, PATHS["A", 1])[1] == "live" and controller_of(HOST_B, PATHS["B", 1])[1] == "live":
            break
        assert time.monotonic() < deadline, f"worker 1 not back with both paths live:\n{target.output()[-4000:]}"
        time.sleep(0.5)
    a1, b1 = wait_live(HOST_A, PATHS["A", 1]), wait_live(HOST_B, PATHS["B", 1])
    print(f"4. worker 1 (pid {victim}) killed; pid {pid} serves, both its paths live again after "
          f"{time.monotonic() - t_kill:.1f} s")
    assert f"worker 1 (pid {victim}) exited with signal 9" in target.output()
    again = {"A through worker 1": report(a1), "B through worker 1": report(b1)}
    for k, r in again.items():
        assert holder_view(r) == holder_view(kept), f"{k} after the restart: {r} != {kept}"
    got = {"A writes through worker 1": Path(a1).write(0, pattern),
           "B writes through worker 1": Path(b1).write(0, pattern)}
    assert got == {"A writes through worker 1": CONFLICT, "B writes through worker 1": OK}, got
    print(f"4. after the restart the report through worker 1 is the one from before (holder B, Write Exclusive, "
          f"generation {kept['generation']}); {got}")
    # the host cleans up: B clears, through worker 0
    CLI.resv_release(b0, 0, KEY_B, rrela=1, nsid=1)
    assert report(a1)["registrants"] == []
    print(f"the test took {time.monotonic() - t_start:.1f} s after the target started")
    # the supervisor and the workers: no reservation change late on a worker, nothing logged as an error but the kill
    said = [x for x in target.output().splitlines() if " ERROR: " in x or " WARNING: " in x]
    print("errors and warnings logged by the target:", said)
    expected = (f"worker 1 (pid {victim}) exited with signal 9", "removing the stale control socket")
    assert all(any(e in x for e in expected) for x in said), said
