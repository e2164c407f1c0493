"""RBD namespaces in the lab: a development Ceph cluster in the guest (ceph/devcluster.py, Debian's Ceph), our
target serving an RBD image beside a RAM namespace, the kernel host writing it over rxe (fio 4-128 KiB at QD32,
crc32c verify), and the data read back from Ceph directly with fio's own rbd engine (`--verify_only`), not
through the target; then the target killed with SIGKILL in the middle of writes: every write fio saw
acknowledged is in the image.  A cluster that goes away under I/O (SIGSTOP for 15 s): the RAM namespace beside
it never stalls, the rbd one's commands fail within RBD_OP_TIMEOUT with a path status and succeed once the
cluster is back, and nothing acknowledged is lost.  `nvmet apply` of the same kind of namespace: krbd maps the
image and the kernel target serves it (fio verify through it, read back from Ceph), unmapped when removed."""
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from nvmeof_roce.ceph.bindings import rados_and_rbd
from nvmeof_roce.ceph import devcluster
from nvmeof_roce.ceph.devcluster import DevCluster
from nvmeof_roce.engine.backends.rbd import RBD_OP_TIMEOUT
from targetproc import LAB_IP, ServedTarget, config, disconnect_all_quietly, namespaces_of, nvme, ram_namespace

pytestmark = [pytest.mark.lab]

NQN = "nqn.2024-01.io.nvmeof-roce:rbd"
SIZE = "32M"


@pytest.fixture(scope="module")
def cluster():
    missing = devcluster.missing_tools()
    if missing:
        pytest.skip(f"this lab image has no Ceph ({', '.join(missing)}): rebuild it (nvmeof-roce lab build --force)")
    c = DevCluster(Path("/run/nvmeof-roce/ceph-test"), memstore_bytes=1 << 30)
    before = os.environ.get("CEPH_CONF")
    with c:
        os.environ["CEPH_CONF"] = str(c.conf)  # fio's rbd engine and librados find the cluster by it
        try:
            yield c
        finally:  # a later module (test_rbd_bench.py) must not take this stopped cluster for `lab run --ceph`'s
            if before is None:
                os.environ.pop("CEPH_CONF", None)
            else:
                os.environ["CEPH_CONF"] = before


def rbd_namespace(nsid, cluster, image, native=True):
    return {"nsid": nsid, "enable": 1,
            "nvmeof_roce": {"backend": "rbd", "rbd": {"pool": "rbd", "image": image, "conf": str(cluster.conf),
                                                      "native": native}}}


def fio(*args, timeout=900):
    proc = subprocess.run(["fio", "--output-format=json", *args], capture_output=True, text=True, timeout=timeout)
    out = proc.stdout[proc.stdout.find("{"):] if "{" in proc.stdout else ""
    return proc, (json.loads(out)["jobs"][0] if out else None)


# One job definition, run through the target and then read back from Ceph: the same offsets, sizes and data
# (fio's verify pattern and random map follow from the seed, whatever the engine).
WRITE_JOB = ["--name=rbd", "--rw=randwrite", "--bsrange=4k-128k", "--iodepth=32", f"--size={SIZE}",
             "--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0", "--randseed=4242", "--norandommap"]


def served(cluster, tmp_path, image, native=True):
    cluster.rbd("create", "--size", SIZE, f"rbd/{image}")
    cfg = config([{"nqn": NQN, "attr": {"allow_any_host": "1"}, "allowed_hosts": [],
                   "namespaces": [rbd_namespace(1, cluster, image, native), ram_namespace(2, "16M")]}])
    return ServedTarget(cfg, str(tmp_path / "target.json")).start(timeout=120)


@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_the_kernel_host_writes_an_rbd_namespace_and_ceph_holds_what_fio_verified(cluster, tmp_path, native):
    image = f"verified-{'native' if native else 'python'}"
    target = served(cluster, tmp_path, image, native)
    try:
        nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", "4420", "-n", NQN)
        rbd_dev, ram_dev = namespaces_of(NQN, expect=2)
        proc, job = fio(f"--filename={rbd_dev}", "--ioengine=libaio", "--direct=1", *WRITE_JOB)
        assert proc.returncode == 0 and job["error"] == 0, f"{proc.stderr}\n{target.output()[-3000:]}"
        assert job["write"]["io_bytes"] >= 32 << 20
        verified = job["read"]["io_bytes"]  # fio's verify pass through the target: the last write of each block
        assert verified > 0
        status = json.loads(subprocess.run(["nvmeof-roce", "target", "status", "--json"], capture_output=True,
                                           text=True, timeout=60).stdout)
        ns = status["subsystems"][0]["namespaces"][0]
        assert ns["io"]["engine"] == "async", ns
        # "native": true: the native data path served it in C (csrc/be_rbd.c: the handle counts its calls on
        # librbd); by default the core did
        assert (ns["io"].get("native_most_in_flight", 0) > 0) == native, ns
        nvme("disconnect", "-n", NQN)
    finally:
        disconnect_all_quietly()
        code = target.stop()
    assert code == 0 and "Traceback" not in target.output(), target.output()[-3000:]
    # Read back from Ceph itself, with fio's rbd engine: no target in between
    proc, job = fio("--ioengine=rbd", "--clientname=admin", "--pool=rbd", f"--rbdname={image}", "--verify_only",
                    *WRITE_JOB, timeout=600)
    assert proc.returncode == 0 and job["error"] == 0, proc.stderr + proc.stdout[-2000:]
    assert job["read"]["io_bytes"] == verified  # Ceph itself holds every block fio verified through the target


def test_a_target_killed_mid_write_lost_nothing_it_acknowledged(cluster, tmp_path):
    """Eight writers, 64 KiB O_DIRECT writes each with its offset and a sequence number in every sector, each
    write recorded once the kernel host has its completion; SIGKILL to the target while they run; then every
    recorded write is read from the image through librbd (no target) and must hold its data."""
    target = served(cluster, tmp_path, "killed")
    acked = {}
    unanswered = {}  # offset -> the stamp of a write that never got its completion: Ceph may hold either
    lock = threading.Lock()
    stop = threading.Event()
    try:
        nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", "4420", "-n", NQN, "--ctrl-loss-tmo=2",
             "--reconnect-delay=1")
        rbd_dev, _ = namespaces_of(NQN, expect=2)
        size = 32 << 20
        chunk = 64 << 10

        def writer(k):
            fd = os.open(rbd_dev, os.O_WRONLY | os.O_DIRECT)
            buf = __import__("mmap").mmap(-1, chunk)
            try:
                seq = 0
                while not stop.is_set():
                    offset = ((k + 8 * seq) * chunk) % size
                    stamp = f"{offset:016x}:{k}:{seq:08d}".encode().ljust(512, b".")
                    buf[:] = stamp * (chunk // 512)
                    try:
                        os.pwrite(fd, buf, offset)
                    except OSError:
                        with lock:
                            unanswered[offset] = stamp  # never acknowledged: it may or may not have landed
                        return
                    with lock:
                        acked[offset] = stamp  # the latest acknowledged write of this offset
                    seq += 1
            finally:
                os.close(fd)
        threads = [threading.Thread(target=writer, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        time.sleep(6)
        target.proc.send_signal(signal.SIGKILL)
        target.proc.wait(30)
        stop.set()
        for t in threads:
            t.join(120)
    finally:
        stop.set()
        disconnect_all_quietly()
    assert len(acked) > 16, f"only {len(acked)} writes acknowledged before the kill"
    rados, rbd = rados_and_rbd()
    with rados.Rados(conffile=str(cluster.conf)) as client, client.open_ioctx("rbd") as ioctx, \
            rbd.Image(ioctx, "killed", read_only=True) as image:
        lost = [o for o, stamp in acked.items()
                if image.read(o, chunk) not in (stamp * (chunk // 512),
                                                unanswered.get(o, stamp) * (chunk // 512))]
    assert not lost, f"{len(lost)} of {len(acked)} acknowledged writes are not in Ceph: {sorted(lost)[:8]}"


class Stamped:
    """O_DIRECT writers of `chunk`-byte blocks, each sector stamped with its offset, writer and sequence; what
    the host acknowledged and what failed is kept per offset (a failed write may or may not have landed), with
    each write's start, end and outcome."""

    def __init__(self, device, size, chunk=64 << 10, writers=4, verify_reads=False):
        self.device, self.size, self.chunk, self.writers = device, size, chunk, writers
        self.verify_reads = verify_reads  # read each write back at once (the RAM namespace's check)
        self.possible = {}  # offset -> the stamps the block may hold now
        self.acked = 0
        self.errors = []  # (start, end, OSError)
        self.mismatches = []
        self.spans = []  # (start, end, ok)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k,)) for k in range(writers)]

    def start(self):
        for t in self.threads:
            t.start()
        return self

    def join(self, timeout=180):
        """Stop the writers; False when one is still blocked after `timeout` seconds in all."""
        self.stop.set()
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self.threads)

    def _run(self, k):
        import mmap
        fd = os.open(self.device, os.O_RDWR | os.O_DIRECT)
        buf, back = mmap.mmap(-1, self.chunk), mmap.mmap(-1, self.chunk)
        try:
            seq = 0
            while not self.stop.is_set():
                offset = ((k + self.writers * seq) * self.chunk) % self.size
                stamp = f"{offset:016x}:{k}:{seq:08d}".encode().ljust(512, b".")
                buf[:] = stamp * (self.chunk // 512)
                start = time.monotonic()
                try:
                    os.pwrite(fd, buf, offset)
                    if self.verify_reads:
                        os.preadv(fd, [back], offset)
                        if back[:] != buf[:]:
                            with self.lock:
                                self.mismatches.append(offset)
                except OSError as exc:
                    end = time.monotonic()
                    with self.lock:
                        self.errors.append((start, end, exc))
                        self.spans.append((start, end, False))
                        self.possible.setdefault(offset, set()).add(stamp)
                    time.sleep(0.2)
                else:
                    end = time.monotonic()
                    with self.lock:
                        self.possible[offset] = {stamp}  # the latest acknowledged write of this offset
                        self.acked += 1
                        self.spans.append((start, end, True))
                seq += 1
        finally:
            os.close(fd)

    def longest_gap(self, since, until):
        """The longest time within [since, until] without a completed write."""
        ends = sorted(e for _, e, ok in self.spans if ok and since <= e <= until)
        marks = [since] + ends + [until]
        return max(b - a for a, b in zip(marks, marks[1:]))

    def lost(self, read):
        """The offsets whose block holds none of the stamps it may hold (`read(offset, length)`: the image)."""
        return [o for o, stamps in self.possible.items()
                if read(o, self.chunk) not in {st * (self.chunk // 512) for st in stamps}]


@pytest.mark.extended  # minutes of its own: make test-extended (make test stays under 30 minutes)
@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_a_cluster_gone_under_io_stalls_only_its_namespace_and_loses_nothing_acknowledged(cluster, tmp_path, native):
    """Kernel host writers on both namespaces (RAM, verified by reading each write back; RBD, stamped); the
    cluster frozen (SIGSTOP) for 15 s, then thawed: the RAM namespace keeps completing writes throughout, the rbd
    namespace's commands fail with a path status within RBD_OP_TIMEOUT (the target's log says so) and the host
    retries them; they succeed once the cluster is back, and every acknowledged write is in the image."""
    image = f"paused-{'native' if native else 'python'}"
    target = served(cluster, tmp_path, image, native)
    pause_s = 15.0
    try:
        nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", "4420", "-n", NQN)
        rbd_dev, ram_dev = namespaces_of(NQN, expect=2)
        rbd_io = Stamped(rbd_dev, 32 << 20, writers=4).start()
        ram_io = Stamped(ram_dev, 16 << 20, chunk=16 << 10, writers=2, verify_reads=True).start()
        time.sleep(5)
        paused_at = time.monotonic()
        cluster.pause()
        try:
            time.sleep(pause_s)
        finally:
            cluster.resume()
        resumed_at = time.monotonic()
        time.sleep(25)  # the cluster's sessions come back; the host's retries go through
        acked_before_end = rbd_io.acked
        after = [s for s in rbd_io.spans if s[0] > resumed_at + 10 and s[2]]
        if not (rbd_io.join() and ram_io.join()):
            target.proc.send_signal(signal.SIGABRT)  # its faulthandler writes every thread's stack to its output
            target.proc.wait(30)
            raise AssertionError(f"a writer is still blocked; the target's threads:\n{target.output()[-12000:]}")
        end = time.monotonic()
        assert not ram_io.errors and not ram_io.mismatches, (ram_io.errors[:3], ram_io.mismatches[:3])
        gap = ram_io.longest_gap(paused_at - 2, end - 1)
        assert gap < 2.0, f"the RAM namespace stalled {gap:.1f} s while the cluster was frozen"
        assert after, f"no rbd write succeeded after the cluster came back ({acked_before_end} in all)"
        longest = max(e - s for s, e, _ in rbd_io.spans)
        assert longest < pause_s + 2 * RBD_OP_TIMEOUT + 30, f"an rbd write took {longest:.0f} s"
        log = target.output()
        assert "RADOS timed out" in log or "Connection timed out" in log or "timed out" in log, log[-3000:]
        assert "Traceback" not in log, log[-3000:]
        nvme("disconnect", "-n", NQN)
    finally:
        disconnect_all_quietly()
        code = target.stop(timeout=60)
    assert code == 0, target.output()[-3000:]
    rados, rbd = rados_and_rbd()
    with rados.Rados(conffile=str(cluster.conf)) as client, client.open_ioctx("rbd") as ioctx, \
            rbd.Image(ioctx, image, read_only=True) as image:
        lost = rbd_io.lost(image.read)
    assert not lost, f"{len(lost)} of {len(rbd_io.possible)} blocks lost acknowledged writes: {sorted(lost)[:8]}"


KNQN = "nqn.2024-01.io.nvmeof-roce:krbd"


@pytest.mark.extended  # minutes of its own: make test-extended (make test stays under 30 minutes)
def test_nvmet_apply_maps_an_rbd_namespace_with_krbd_and_the_kernel_target_serves_it(cluster, tmp_path):
    """The same rbd namespace config, applied to the kernel target: `nvmet apply` maps the image with krbd and
    points nvmet's namespace at it; the kernel host writes it with fio crc32c verify; fio's rbd engine reads it
    back from Ceph; applying again changes nothing; removing the subsystem unmaps the image."""
    from kernel_helpers import cli, modprobe
    from nvmeof_roce.config import parse_config
    from nvmeof_roce.kernel import apply as applymod
    from nvmeof_roce.kernel.nvmet import Root
    modprobe("rbd", "nvmet", "nvmet_rdma", "nvme_rdma")
    cluster.rbd("create", "--size", SIZE, "--image-feature", "layering,exclusive-lock", "rbd/krbd")
    cfg = {"hosts": [], "ports": [{"portid": 121, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": LAB_IP,
                                                            "trsvcid": "4424", "treq": "not specified"},
                                   "subsystems": [KNQN]}],
           "subsystems": [{"nqn": KNQN, "attr": {"allow_any_host": "1"},
                           "namespaces": [rbd_namespace(1, cluster, "krbd")]}]}
    path = tmp_path / "krbd.json"
    path.write_text(json.dumps(cfg))
    try:
        plan = cli("nvmet", "apply", path, "--dry-run", "--json")
        assert plan["steps"][0]["op"] == "rbd_map", plan
        done = cli("nvmet", "apply", path, "--json")
        assert done["steps"][0]["op"] == "rbd_map", done
        mapped = json.loads(subprocess.run(["rbd", "-c", str(cluster.conf), "showmapped", "--format", "json"],
                                           capture_output=True, text=True, check=True).stdout)
        device = next(m["device"] for m in mapped if m["name"] == "krbd")
        ns = next(s for s in cli("nvmet", "show", "--json")["subsystems"] if s["nqn"] == KNQN)["namespaces"][0]
        assert os.path.realpath(ns["device"]["path"]) == os.path.realpath(device) and ns["enable"] == 1, ns
        assert cli("nvmet", "apply", path, "--json")["steps"] == []  # mapped already: nothing changes
        nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", "4424", "-n", KNQN)
        (disk,) = namespaces_of(KNQN, expect=1)
        proc, job = fio(f"--filename={disk}", "--ioengine=libaio", "--direct=1", *WRITE_JOB)
        assert proc.returncode == 0 and job["error"] == 0, proc.stderr
        verified = job["read"]["io_bytes"]
        nvme("disconnect", "-n", KNQN)
    finally:
        disconnect_all_quietly()
        applymod.remove(Root(), parse_config(cfg, str(path)))
    mapped = json.loads(subprocess.run(["rbd", "-c", str(cluster.conf), "showmapped", "--format", "json"],
                                       capture_output=True, text=True, check=True).stdout)
    assert not [m for m in mapped if m["name"] == "krbd"], mapped  # unmapped with its namespace
    proc, job = fio("--ioengine=rbd", "--clientname=admin", "--pool=rbd", "--rbdname=krbd", "--verify_only",
                    *WRITE_JOB, timeout=600)
    assert proc.returncode == 0 and job["error"] == 0, proc.stderr + proc.stdout[-2000:]
    assert job["read"]["io_bytes"] == verified  # what fio verified through nvmet is in Ceph
