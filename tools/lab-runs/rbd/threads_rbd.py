"""In the lab guest (lab run --ceph): our target alone serving an rbd namespace on RBD path ARG1 (native: the
namespace's "native": true; python: the core through python3-rbd), fio 4 KiB randread and randwrite at QD32 (and
QD1 with --qd1) through the kernel host for 10 s each; per job the IOPS, the target's threads' CPU per I/O
(/proc/PID/task/*/stat: librbd names its threads, Python's are all `python3`), the Ceph daemons' and the whole
guest's.  `--client KEY=VALUE` adds librbd/librados settings to the [client] section of a copy of the cluster's
ceph.conf that the namespace names (e.g. ms_async_op_threads=1); `--poll MODE` is target serve --poll.
Prints the report and writes it to /mnt/share/threads-TAG.txt (results/rbd/threads-*.txt)."""
import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, "/mnt/project")
from nvmeof_roce.bench import kernel_glue  # noqa: E402
from nvmeof_roce.bench.rbd import ceph_pids  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("rbd_path", choices=("native", "python"))
p.add_argument("--client", action="append", default=[], metavar="KEY=VALUE")
p.add_argument("--poll", default="interrupt")
p.add_argument("--qd1", action="store_true")
p.add_argument("--tag", default="")
a = p.parse_args()
tag = a.tag or "-".join([a.rbd_path, a.poll] + [c.replace("=", "") for c in a.client])
OUT = Path("/mnt/share")
conf = os.environ["CEPH_CONF"]
rbdc = ["rbd", "-c", conf]
subprocess.run(rbdc + ["rm", "--no-progress", "rbd/thr"], capture_output=True)
subprocess.run(rbdc + ["create", "--size", "512M", "--image-feature", "layering", "rbd/thr"], check=True)
subprocess.run(["fio", "--name=p", "--ioengine=rbd", "--clientname=admin", "--pool=rbd", "--rbdname=thr",
                "--rw=write", "--bs=128k", "--iodepth=16", "--size=256M", "--output=/dev/null"], check=True,
               env=dict(os.environ, CEPH_CONF=conf))
ns_conf = conf
if a.client:
    ns_conf = f"/tmp/thr-{tag}.conf"
    Path(ns_conf).write_text(Path(conf).read_text().rstrip("\n") + "\n\n[client]\n"
                             + "".join(c.replace("=", " = ", 1) + "\n" for c in a.client))
rbd = {"pool": "rbd", "image": "thr", "conf": ns_conf}
if a.rbd_path == "native":
    rbd["native"] = True
nqn = "nqn.2014-08.org.nvmeof-roce:thr"
cfg = {"hosts": [], "ports": [{"portid": 1, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": "10.99.0.1",
                                                     "trsvcid": "4470", "treq": "not specified"},
                               "subsystems": [nqn], "referrals": []}],
       "subsystems": [{"nqn": nqn, "attr": {"allow_any_host": "1"}, "allowed_hosts": [],
                       "namespaces": [{"nsid": 1, "enable": 1, "nvmeof_roce": {"backend": "rbd", "rbd": rbd}}]}]}
Path("/tmp/thr.json").write_text(json.dumps(cfg))
sock = "/tmp/thr.sock"
if os.path.exists("/tmp/thr.ready"):
    os.unlink("/tmp/thr.ready")
log = open(f"/mnt/share/threads-{tag}.log", "w")
proc = subprocess.Popen([sys.executable, "-m", "nvmeof_roce", "target", "serve", "/tmp/thr.json",
                         "--ready-file", "/tmp/thr.ready", "--rpc-socket", sock, "--data-path", "native",
                         "--poll", a.poll], stdout=log, stderr=subprocess.STDOUT)
while not os.path.exists("/tmp/thr.ready"):
    assert proc.poll() is None, open(f"/mnt/share/threads-{tag}.log").read()
    time.sleep(0.2)


def threads(pid):
    out = {}
    for stat in glob.glob(f"/proc/{pid}/task/*/stat"):
        try:
            text = open(stat).read()
        except OSError:
            continue
        name = text[text.index("(") + 1:text.rindex(")")]
        rest = text[text.rindex(")") + 2:].split()
        out.setdefault(name, [0, 0, 0])
        out[name][0] += int(rest[11])
        out[name][1] += int(rest[12])
        out[name][2] += 1
    return out


def proc_ticks(pid):
    rest = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(rest[11]) + int(rest[12])


def guest():
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return sum(f) - f[3] - f[4], sum(f)  # busy, all


def status():
    r = subprocess.run([sys.executable, "-m", "nvmeof_roce", "target", "status", "--json", "--socket", sock],
                       capture_output=True, text=True)
    return json.loads(r.stdout)


report = [f"# {tag}: our target alone, rbd path {a.rbd_path}, --poll {a.poll}, [client] {a.client or 'as the cluster'}"
          f"; {os.cpu_count()} CPUs"]
ceph = ceph_pids(conf)
try:
    dev = kernel_glue.nvme_connect("10.99.0.1", 4470, nqn)
except Exception:
    proc.kill()
    raise
time.sleep(2)
jobs = [("randread", 32), ("randwrite", 32)] + ([("randread", 1), ("randwrite", 1)] if a.qd1 else [])
for rw, qd in jobs:
    t0, c0, g0, w0 = threads(proc.pid), {n: proc_ticks(p) for n, p in ceph.items()}, guest(), time.monotonic()
    r = subprocess.run(["fio", "--name=j", f"--filename={dev}", "--ioengine=libaio", "--direct=1", f"--rw={rw}",
                        "--bs=4k", f"--iodepth={qd}", "--size=256M", "--time_based", "--runtime=10",
                        "--output-format=json"], capture_output=True, text=True)
    wall = time.monotonic() - w0
    t1, c1, g1 = threads(proc.pid), {n: proc_ticks(p) for n, p in ceph.items()}, guest()
    job = json.loads(r.stdout[r.stdout.index("{"):])["jobs"][0]
    d = job["read" if rw == "randread" else "write"]
    ios = d["total_ios"]
    tot = sum(sum(v[:2]) for v in t1.values()) - sum(sum(v[:2]) for v in t0.values())
    per = lambda ticks: f"{ticks * 1e4 / ios:7.0f} us/IO"  # noqa: E731  (CLK_TCK 100)
    report.append(f"== {rw} QD{qd}: {d['iops']:.0f} IOPS, mean {d['lat_ns']['mean'] / 1000:.0f} us, {ios} I/Os in "
                  f"{wall:.1f} s; target {per(tot)}, guest busy {per(g1[0] - g0[0])} "
                  f"({100 * (g1[0] - g0[0]) / (g1[1] - g0[1]):.0f}% of {os.cpu_count()} CPUs), "
                  + ", ".join(f"{n} {per(c1[n] - c0[n])}" for n in c1))
    for name in sorted(t1, key=lambda n: -(sum(t1[n][:2]) - sum(t0.get(n, [0, 0])[:2]))):
        u = t1[name][0] - t0.get(name, [0, 0])[0]
        s = t1[name][1] - t0.get(name, [0, 0])[1]
        if u + s:
            report.append(f"  {name:22s} x{t1[name][2]:<2d} user {u / 100:6.2f} s  sys {s / 100:6.2f} s  {per(u + s)}")
st = status()
(OUT / f"threads-{tag}.status.json").write_text(json.dumps(st, indent=1))
for sub in st.get("subsystems", []):
    for ns in sub.get("namespaces", []):
        report.append(f"io: {json.dumps(ns.get('io'))}")
kernel_glue.nvme_disconnect(nqn)
proc.send_signal(signal.SIGTERM)
proc.wait(60)
(OUT / f"threads-{tag}.txt").write_text("\n".join(report) + "\n")
subprocess.run(rbdc + ["rm", "--no-progress", "rbd/thr"])
print("\n".join(report))
