"""RBD namespaces in the lab: a development Ceph cluster in the guest (ceph/devcluster.py, Debian's Ceph), our
target serving an RBD image beside a RAM namespace, the kernel host writing it over rxe (fio 4-128 KiB at QD32,
crc32c verify), and the data read back from Ceph directly with fio's own rbd engine (`--verify_only`), not
through the target; then the target killed with SIGKILL in the middle of writes: every write fio saw
acknowledged is in the image."""
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
    with c:
        os.environ["CEPH_CONF"] = str(c.conf)  # fio's rbd engine and librados find the cluster by it
        yield c


def rbd_namespace(nsid, cluster, image):
    return {"nsid": nsid, "enable": 1,
            "nvmeof_roce": {"backend": "rbd", "rbd": {"pool": "rbd", "image": image, "conf": str(cluster.conf)}}}


def fio(*args, timeout=900):
    proc = subprocess.run(["fio", "--output-format=json", *args], capture_output=True, text=True, timeout=timeout)
    out = proc.stdout[proc.stdout.find("{"):] if "{" in proc.stdout else ""
    return proc, (json.loads(out)["jobs"][0] if out else None)


# One job definition, run through the target and then read back from Ceph: the same offsets, sizes and data
# (fio's verify pattern and random map follow from the seed, whatever the engine).
WRITE_JOB = ["--name=rbd", "--rw=randwrite", "--bsrange=4k-128k", "--iodepth=32", f"--size={SIZE}",
             "--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0", "--randseed=4242", "--norandommap"]


def served(cluster, tmp_path, image):
    cluster.rbd("create", "--size", SIZE, f"rbd/{image}")
    cfg = config([{"nqn": NQN, "attr": {"allow_any_host": "1"}, "allowed_hosts": [],
                   "namespaces": [rbd_namespace(1, cluster, image), ram_namespace(2, "16M")]}])
    return ServedTarget(cfg, str(tmp_path / "target.json")).start(timeout=120)


def test_the_kernel_host_writes_an_rbd_namespace_and_ceph_holds_what_fio_verified(cluster, tmp_path):
    target = served(cluster, tmp_path, "verified")
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
        # the native data path served it in C (csrc/be_rbd.c: the namespace's handle counts its calls on librbd)
        assert ns["io"].get("native_most_in_flight", 0) > 0, ns
        nvme("disconnect", "-n", NQN)
    finally:
        disconnect_all_quietly()
        code = target.stop()
    assert code == 0 and "Traceback" not in target.output(), target.output()[-3000:]
    # Read back from Ceph itself, with fio's rbd engine: no target in between
    proc, job = fio("--ioengine=rbd", "--clientname=admin", "--pool=rbd", "--rbdname=verified", "--verify_only",
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
