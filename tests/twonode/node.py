"""One node's side of a two-node lab scenario: `python3 tests/twonode/node.py target|host SCENARIO`.

Runs inside a guest of `nvmeof-roce lab run --nodes 2` (test_two_node.py starts it).  The nodes meet through
rendezvous files (nvmeof_roce.rendezvous); results, logs and captures go to /mnt/share for the host-side
test to check.  Exit code 0 when every step of this node worked; a step that fails raises with its output.

Scenarios:
  basic  perftest over rdma_cm; the kernel host connects to the kernel target (port 4420) and to the
         userspace target (4421: 4 KiB in-capsule data; 4422: no in-capsule data) and runs fio crc32c
         verify; a tcpdump capture of one 4 KiB read, one in-capsule 4 KiB write and one 4 KiB write by RDMA READ.
  loss   fio crc32c verify through the userspace target, 20 s without loss, then 60 s with netem 1 % loss on
         both NICs under capture, doctor sampling the RoCE counters again and again meanwhile.
  mtu    the host node's eth0 at MTU 9000, the target's at 1500: doctor on each node.
  flap   the host node's link down for 8 s in the middle of fio crc32c verify runs through both targets.
  cmflap the same outage without NVMe: perftest over rdma_cm after a flap with nothing open across it, and after
         a flap with a connection open across it (the minimal reproduction of the flap finding).
"""
import glob
import json
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, "/mnt/project")
from nvmeof_roce import native, rendezvous  # noqa: E402

SHARE = "/mnt/share"
TARGET_IP, HOST_IP = "10.99.1.1", "10.99.1.2"
NQN_KERNEL = "nqn.2024-01.io.nvmeof-roce:two-node-kernel"
NQN_USER = "nqn.2024-01.io.nvmeof-roce:two-node-user"
RESULT = {}


def step(name):
    print(f"[two-node] {name}", flush=True)


def sh(*args, check=True, timeout=600, **kw):
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stderr}\n{proc.stdout}")
    return proc


def save():
    with open(f"{SHARE}/{ROLE}-result.json", "w") as f:
        json.dump(RESULT, f, indent=1)


# -- target node

def kernel_target_config(image):
    return {"hosts": [], "ports": [{"portid": 1, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": TARGET_IP,
                                                          "trsvcid": "4420"}, "subsystems": [NQN_KERNEL]}],
            "subsystems": [{"nqn": NQN_KERNEL, "attr": {"allow_any_host": "1"},
                            "namespaces": [{"nsid": 1, "device": {"path": image}, "buffered_io": 1}]}]}


def user_target_config():
    def port(portid, svc, inline):
        return {"portid": portid, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": TARGET_IP, "trsvcid": svc},
                "param": {"inline_data_size": str(inline)}, "subsystems": [NQN_USER], "referrals": []}
    return {"hosts": [], "ports": [port(1, "4421", 4096), port(2, "4422", 0)],
            "subsystems": [{"nqn": NQN_USER, "attr": {"allow_any_host": "1"}, "allowed_hosts": [],
                            "namespaces": [{"nsid": 1, "enable": 1,
                                            "nvmeof_roce": {"backend": "ram", "size": "64M", "block_size": 512}}]}]}


def serve_user_target():
    with open("/tmp/user.json", "w") as f:
        json.dump(user_target_config(), f)
    ready = "/tmp/user.ready"
    log = open(f"{SHARE}/target.log", "w")
    # the native data path's per-command trace (the Python data path's is always logged at -vv): the capture is
    # checked against its lines
    trace = ["--trace", "on"] if native.available() else []
    proc = subprocess.Popen([sys.executable, "-m", "nvmeof_roce", "-vv", "target", "serve", "/tmp/user.json",
                             *trace, "--ready-file", ready], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not os.path.exists(ready):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"userspace target did not start:\n{open(f'{SHARE}/target.log').read()}")
        time.sleep(0.1)
    return proc


def stop_user_target(proc):
    proc.send_signal(signal.SIGTERM)
    RESULT["user_target_exit"] = proc.wait(60)


def target_basic():
    step("perftest server (ib_write_bw over rdma_cm)")
    perf = subprocess.Popen(["ib_write_bw", "-d", "rxe0", "-R", "-F", "-s", "65536", "-n", "200"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(2)
    rendezvous.signal("perf-ready")
    out, _ = perf.communicate(timeout=300)
    RESULT["perftest_server_exit"] = perf.returncode
    step("kernel target (nvmet-rdma) on 4420, userspace target on 4421/4422")
    sh("modprobe", "-a", "nvmet", "nvmet_rdma")
    image = "/tmp/kernel-ns.img"
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    with open("/tmp/kernel.json", "w") as f:
        json.dump(kernel_target_config(image), f)
    sh(sys.executable, "-m", "nvmeof_roce", "nvmet", "apply", "/tmp/kernel.json")
    proc = serve_user_target()
    rendezvous.signal("targets-ready")
    rendezvous.wait("host.done", 1500)
    stop_user_target(proc)
    sh(sys.executable, "-m", "nvmeof_roce", "nvmet", "clear", check=False)
    save()
    if RESULT["perftest_server_exit"] or RESULT["user_target_exit"]:
        raise SystemExit(f"target side failed: {RESULT}\n{out}")


def target_loss():
    proc = serve_user_target()
    rendezvous.signal("targets-ready")
    rendezvous.wait("baseline-done", 600)
    netem("loss", "1%")
    rendezvous.wait("host.done", 1500)
    RESULT["hw_counters"] = hw_counters()
    stop_user_target(proc)
    save()


def target_mtu():
    RESULT["doctor"] = doctor(HOST_IP)
    rendezvous.signal("target-doctor-done")
    rendezvous.wait("host.done", 600)
    save()


# -- host node

def connect(svc, nqn, io_queues=1):
    sh("nvme", "connect", "-t", "rdma", "-a", TARGET_IP, "-s", svc, "-n", nqn, "-i", str(io_queues))
    return connect_wait(nqn)


def connect_wait(nqn):
    """The block device of the connected subsystem `nqn`, once it appears."""
    deadline = time.monotonic() + 30
    while True:
        for subsys in glob.glob("/sys/class/nvme-subsystem/nvme-subsys*"):
            if open(f"{subsys}/subsysnqn").read().strip() == nqn:
                disks = glob.glob(f"{subsys}/nvme*n*")
                if disks:
                    return "/dev/" + os.path.basename(disks[0])
        if time.monotonic() > deadline:
            raise SystemExit(f"no namespace of {nqn} appeared")
        time.sleep(0.1)


def disconnect(nqn):
    sh("nvme", "disconnect", "-n", nqn)


def fio_verify(device, size="16M", runtime=None):
    timed = [f"--runtime={runtime}", "--time_based"] if runtime else []
    proc = sh("fio", "--name=verify", f"--filename={device}", "--ioengine=libaio", "--direct=1", "--rw=randrw",
              "--verify=crc32c", "--verify_fatal=1", "--bsrange=4k-64k", "--iodepth=16", f"--size={size}",
              *timed, "--verify_state_save=0", "--output-format=json", timeout=1200)
    job = json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0]
    return {"error": job["error"], "read_ios": job["read"]["total_ios"], "write_ios": job["write"]["total_ios"],
            "read_bytes": job["read"]["io_bytes"], "write_bytes": job["write"]["io_bytes"]}


def start_capture(path, snaplen=0):
    if os.path.exists(path):
        os.unlink(path)
    proc = subprocess.Popen(["tcpdump", "-i", "eth0", "-U", "-B", "16384", "-s", str(snaplen), "-w", path,
                             "udp", "port", "4791"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while not os.path.exists(path):  # tcpdump writes the file header once it listens
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"tcpdump did not start: {proc.stderr.read().decode()}")
        time.sleep(0.1)
    time.sleep(0.5)
    return proc


def stop_capture(proc):
    # tcpdump reads the kernel's capture ring a block at a time; a block not full is handed over after its timeout
    # (tcpdump's 1 s): stopped sooner, it loses the last packets (the 4 KiB write by RDMA READ and the disconnect
    # went missing from io.pcap so, though counted "received by filter")
    time.sleep(2)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=30)[1].decode()
    return err.strip().splitlines()[-2:] if err.strip() else []


def host_basic():
    step("perftest client")
    rendezvous.wait("perf-ready", 300)
    out = sh("ib_write_bw", "-d", "rxe0", "-R", "-F", "-s", "65536", "-n", "200", TARGET_IP, timeout=300).stdout
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("65536")]
    RESULT["perftest"] = {"bytes": 65536, "iterations": int(rows[0][1]), "bw_peak_MBps": float(rows[0][2]),
                          "bw_avg_MBps": float(rows[0][3])}
    rendezvous.wait("targets-ready", 300)
    sh("modprobe", "-a", "nvme_rdma", "nvme_fabrics")
    step("kernel target: connect, fio crc32c verify")
    dev = connect("4420", NQN_KERNEL, io_queues=1)
    RESULT["fio_kernel"] = fio_verify(dev)
    disconnect(NQN_KERNEL)
    step("userspace target: connect, fio crc32c verify")
    dev = connect("4421", NQN_USER)
    RESULT["fio_userspace"] = fio_verify(dev)
    disconnect(NQN_USER)
    step("capture: 4 KiB read, 4 KiB in-capsule write (4421), 4 KiB write by RDMA READ (4422)")
    with open("/tmp/block", "wb") as f:
        f.write(os.urandom(4096))
    cap = start_capture(f"{SHARE}/io.pcap")
    dev = connect("4421", NQN_USER)
    time.sleep(1)  # the partition scan's reads go first
    sh("dd", f"if={dev}", "of=/dev/null", "bs=4096", "count=1", "skip=256", "iflag=direct")        # LBA 2048
    sh("dd", "if=/tmp/block", f"of={dev}", "bs=4096", "count=1", "seek=512", "oflag=direct")       # LBA 4096
    disconnect(NQN_USER)
    dev = connect("4422", NQN_USER)
    time.sleep(1)
    sh("dd", "if=/tmp/block", f"of={dev}", "bs=4096", "count=1", "seek=768", "oflag=direct")       # LBA 6144
    disconnect(NQN_USER)
    RESULT["tcpdump"] = stop_capture(cap)
    save()
    bad = [k for k in ("fio_kernel", "fio_userspace") if RESULT[k]["error"]]
    if bad:
        raise SystemExit(f"fio verify failed: {bad}: {RESULT}")


def host_loss():
    rendezvous.wait("targets-ready", 300)
    sh("modprobe", "-a", "nvme_rdma", "nvme_fabrics")
    dev = connect("4421", NQN_USER)
    step("baseline: 20 s of fio verify without loss")
    RESULT["fio_baseline"] = fio_verify(dev, size="16M", runtime=20)
    rendezvous.signal("baseline-done")
    netem("loss", "1%")
    before = hw_counters()
    # headers and capsules only (-s 160): full frames at this rate overrun tcpdump on one emulated vCPU
    cap = start_capture(f"{SHARE}/loss.pcap", snaplen=160)
    step("fio verify for 60 s with 1 % loss on both NICs; doctor samples the counters meanwhile")
    started = time.monotonic()
    fio = subprocess.Popen(["fio", "--name=verify", f"--filename={dev}", "--ioengine=libaio", "--direct=1",
                            "--rw=randrw", "--verify=crc32c", "--verify_fatal=1", "--bsrange=4k-64k", "--iodepth=16",
                            "--size=16M", "--runtime=60", "--time_based", "--verify_state_save=0",
                            "--output-format=json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    doctors = []
    while fio.poll() is None:
        # doctor's counter check, 5 s apart, again and again while fio runs: I/O under loss comes in bursts
        # between stalls, and one sample pair may fall into a stall
        doc = sh(sys.executable, "-m", "nvmeof_roce", "doctor", "--json", "--interval", "5", check=False,
                 timeout=300)
        if doc.stdout.strip():
            doctors.append([c for c in json.loads(doc.stdout) if c["check"] == "fabric.counters"])
    out, err = fio.communicate()
    job = json.loads(out[out.index("{"):])["jobs"][0]
    RESULT["fio_userspace"] = {"error": job["error"], "read_ios": job["read"]["total_ios"],
                               "write_ios": job["write"]["total_ios"], "read_bytes": job["read"]["io_bytes"],
                               "write_bytes": job["write"]["io_bytes"], "returncode": fio.returncode}
    RESULT["fio_seconds"] = round(time.monotonic() - started, 1)
    RESULT["doctor_counters"] = doctors
    RESULT["tcpdump"] = stop_capture(cap)
    RESULT["hw_counters_before"], RESULT["hw_counters"] = before, hw_counters()
    RESULT["kernel_log"] = [line for line in sh("dmesg").stdout.splitlines() if "nvme" in line][-20:]
    disconnect(NQN_USER)
    save()
    if RESULT["fio_userspace"]["error"] or fio.returncode:
        raise SystemExit(f"fio verify failed under loss: {RESULT['fio_userspace']}\n{err}")


def target_flap():
    sh("modprobe", "-a", "nvmet", "nvmet_rdma")
    image = "/tmp/kernel-ns.img"
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    with open("/tmp/kernel.json", "w") as f:
        json.dump(kernel_target_config(image), f)
    sh(sys.executable, "-m", "nvmeof_roce", "nvmet", "apply", "/tmp/kernel.json")
    proc = serve_user_target()
    rendezvous.signal("targets-ready")
    rendezvous.wait("host.done", 1500)
    stop_user_target(proc)
    RESULT["kernel_log"] = [line for line in sh("dmesg").stdout.splitlines() if "nvmet" in line][-20:]
    save()


def host_flap():
    """The host node's link goes down for 8 s in the middle of fio verify runs against both targets."""
    rendezvous.wait("targets-ready", 300)
    sh("modprobe", "-a", "nvme_rdma", "nvme_fabrics")
    runs = {}
    for name, svc, nqn in (("kernel", "4420", NQN_KERNEL), ("userspace", "4421", NQN_USER)):
        # give up on a lost controller after 60 s (default 600) so a failed reconnect ends the run
        sh("nvme", "connect", "-t", "rdma", "-a", TARGET_IP, "-s", svc, "-n", nqn, "-i", "1",
           "--ctrl-loss-tmo", "60", "--reconnect-delay", "2")
        dev = connect_wait(nqn)
        runs[name] = subprocess.Popen(
            ["fio", "--name=verify", f"--filename={dev}", "--ioengine=libaio", "--direct=1", "--rw=randrw",
             "--verify=crc32c", "--verify_fatal=1", "--bsrange=4k-64k", "--iodepth=8", "--size=16M",
             "--runtime=45", "--time_based", "--verify_state_save=0", "--output-format=json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(12)
    sh("ip", "link", "set", "eth0", "down")
    RESULT["port_state_down"] = open("/sys/class/infiniband/rxe0/ports/1/state").read().strip()
    time.sleep(8)
    sh("ip", "link", "set", "eth0", "up")
    deadline = time.monotonic() + 240  # fio runs 45 s; a queue that never comes back must not hold the lab
    for name, fio in runs.items():
        try:
            out, err = fio.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            fio.kill()
            try:
                out, err = fio.communicate(timeout=10)
            except subprocess.TimeoutExpired:  # stuck in the kernel on the lost device: leave it, do not wait
                out, err = "", ""
            err = "fio still waiting for I/O 4 minutes after the link came back; killed\n" + err
        job = json.loads(out[out.index("{"):])["jobs"][0] if "{" in out else {}
        RESULT[f"fio_{name}"] = {"error": job.get("error"), "returncode": fio.returncode, "stderr": err[-1500:],
                                 "read_ios": job.get("read", {}).get("total_ios"),
                                 "write_ios": job.get("write", {}).get("total_ios")}
    RESULT["kernel_log"] = [line for line in sh("dmesg").stdout.splitlines() if "nvme" in line][-40:]
    save()
    for nqn in (NQN_KERNEL, NQN_USER):
        sh("nvme", "disconnect", "-n", nqn, check=False, timeout=60)


def diag_state(tag):
    """What the RDMA stack holds: neighbours, CM ids, QPs (QP 1 is the GSI QP that carries the CM's MADs), GIDs,
    rxe counters, and (after) the tasks blocked in the kernel, dumped by sysrq w."""
    out = {}
    for name, cmd in (("neigh", ["ip", "neigh"]), ("cm_id", ["rdma", "res", "show", "cm_id"]),
                      ("qp", ["rdma", "res", "show", "qp"])):
        p = sh(*cmd, check=False)
        out[name] = (p.stdout + p.stderr).splitlines()
    gids = []
    for g in sorted(glob.glob("/sys/class/infiniband/rxe0/ports/1/gids/*"), key=lambda x: int(x.rsplit("/", 1)[1])):
        v = open(g).read().strip()
        if v != "0000:0000:0000:0000:0000:0000:0000:0000":
            gids.append(f"{g.rsplit('/', 1)[1]} {v}")
    out["gids"] = gids
    out["hw_counters"] = hw_counters()
    if tag == "after":
        with open("/proc/sysrq-trigger", "w") as f:
            f.write("w")
        time.sleep(1)
        log = sh("dmesg").stdout.splitlines()
        out["blocked"] = log[max(i for i, line in enumerate(log) if "Show Blocked State" in line):]
        out["rdma_log"] = [line for line in log if "infiniband" in line or "rxe" in line or "ib_mad" in line]
    RESULT[f"diag_{tag}"] = out
    save()


def target_cmflap():
    """perftest servers over rdma_cm, one after another, until the host is done (no NVMe at all)."""
    rendezvous.signal("targets-ready")
    runs = []
    sync = os.environ.get("LAB_SYNC", f"{SHARE}/.lab-sync")
    while not os.path.exists(f"{sync}/host.done"):
        p = subprocess.run(["timeout", "40", "ib_write_bw", "-d", "rxe0", "-R", "-F", "-s", "4096", "-D", "2"],
                           capture_output=True, text=True)
        runs.append({"rc": p.returncode, "tail": (p.stdout + p.stderr).strip().splitlines()[-3:]})
    RESULT["servers"] = runs
    diag_state("after")
    save()


def host_cmflap():
    """The host node's link down for 8 s twice: first with nothing open, then with a perftest connection open
    across it; after each, a new perftest connection over rdma_cm (40 s to make it)."""
    rendezvous.wait("targets-ready", 300)

    def client(tag, duration=2, wait=True):
        args = ["timeout", "40", "ib_write_bw", "-d", "rxe0", "-R", "-F", "-s", "4096", "-D", str(duration), TARGET_IP]
        if not wait:
            return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(3)  # the server restarts between runs
        started = time.monotonic()
        p = subprocess.run(args, capture_output=True, text=True)
        RESULT.setdefault("clients", {})[tag] = {"rc": p.returncode, "s": round(time.monotonic() - started, 1),
                                                 "tail": (p.stdout + p.stderr).strip().splitlines()[-3:]}
        save()

    client("before")
    diag_state("before")
    # 1: flap with no connection open
    sh("ip", "link", "set", "eth0", "down")
    time.sleep(8)
    sh("ip", "link", "set", "eth0", "up")
    time.sleep(2)
    client("after a flap with nothing open")
    # 2: flap with a connection open across it
    time.sleep(3)
    longrun = client("long", duration=20, wait=False)
    time.sleep(6)
    sh("ip", "link", "set", "eth0", "down")
    time.sleep(8)
    sh("ip", "link", "set", "eth0", "up")
    out = longrun.communicate(timeout=60)[0]
    RESULT["long"] = {"rc": longrun.returncode, "tail": out.strip().splitlines()[-3:]}
    time.sleep(2)
    client("after a flap with a connection open")
    diag_state("after")


def host_mtu():
    sh("ip", "link", "set", "eth0", "mtu", "9000")
    rendezvous.wait("target-doctor-done", 600)
    RESULT["doctor"] = doctor(TARGET_IP)
    save()


# -- shared

def netem(*args):
    sh("modprobe", "sch_netem")
    sh("tc", "qdisc", "replace", "dev", "eth0", "root", "netem", *args)
    RESULT.setdefault("netem", []).append(" ".join(args))


def hw_counters():
    d = "/sys/class/infiniband/rxe0/ports/1/hw_counters"
    return {name: int(open(f"{d}/{name}").read()) for name in sorted(os.listdir(d))}


def doctor(traddr):
    proc = sh(sys.executable, "-m", "nvmeof_roce", "doctor", "--json", "--interval", "2", "--traddr", traddr,
              check=False, timeout=600)
    return json.loads(proc.stdout) if proc.stdout.strip() else {"stderr": proc.stderr}


if __name__ == "__main__":
    ROLE, SCENARIO = sys.argv[1], sys.argv[2]
    globals()[f"{ROLE}_{SCENARIO}"]()
