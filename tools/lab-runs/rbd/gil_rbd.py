"""In the lab guest (lab run --ceph --share DIR): our target serving an rbd namespace without a profiler, with
`sys.setswitchinterval(ARG2)` (default 5 ms, Python's), on data path ARG1; fio 4 KiB randread and randwrite at QD32
and randread at QD1 through the kernel host; the target's threads' CPU split (/proc/PID/task/*/stat).  Writes
/mnt/share/gil-DATAPATH-SWITCH.txt (results/rbd/gil-*.txt)."""
import json, os, signal, subprocess, sys, time, glob, io
from pathlib import Path

sys.path.insert(0, "/mnt/project")
from nvmeof_roce.bench import kernel_glue

OUT = Path("/mnt/share")
conf = os.environ["CEPH_CONF"]
data_path = sys.argv[1] if len(sys.argv) > 1 else "python"
switch = float(sys.argv[2]) if len(sys.argv) > 2 else 0.005
tag = f"{data_path}-{switch * 1000:g}ms"
subprocess.run(["rbd", "-c", conf, "rm", "--no-progress", "rbd/prof"], capture_output=True)
subprocess.run(["rbd", "-c", conf, "create", "--size", "512M", "--image-feature", "layering", "rbd/prof"], check=False)
subprocess.run(["fio", "--name=p", "--ioengine=rbd", "--clientname=admin", "--pool=rbd", "--rbdname=prof",
                "--rw=write", "--bs=128k", "--iodepth=16", "--size=256M", "--output=/dev/null"], check=True)
nqn = "nqn.2014-08.org.nvmeof-roce:prof"
cfg = {"hosts": [], "ports": [{"portid": 1, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": "10.99.0.1",
                                                     "trsvcid": "4470", "treq": "not specified"},
                               "subsystems": [nqn], "referrals": []}],
       "subsystems": [{"nqn": nqn, "attr": {"allow_any_host": "1"}, "allowed_hosts": [],
                       "namespaces": [{"nsid": 1, "enable": 1, "nvmeof_roce": {"backend": "rbd", "rbd": {
                           "pool": "rbd", "image": "prof", "conf": conf}}}]}]}
Path("/tmp/prof.json").write_text(json.dumps(cfg))
sock = "/tmp/prof.sock"
prof = f"/tmp/prof-{data_path}.pstats"
if os.path.exists("/tmp/prof.ready"):
    os.unlink("/tmp/prof.ready")
wrapper = (f"import sys, runpy; sys.setswitchinterval({switch}); sys.argv = ['nvmeof_roce'] + sys.argv[1:]; "
           "runpy.run_module('nvmeof_roce', run_name='__main__', alter_sys=True)")
proc = subprocess.Popen([sys.executable, "-c", wrapper, "target", "serve",
                         "/tmp/prof.json", "--ready-file", "/tmp/prof.ready", "--rpc-socket", sock,
                         "--data-path", data_path], stdout=open(f"/mnt/share/gil-{tag}.log", "w"), stderr=subprocess.STDOUT)
while not os.path.exists("/tmp/prof.ready"):
    assert proc.poll() is None, open(f"/mnt/share/gil-{tag}.log").read()
    time.sleep(0.2)


def threads():
    out = {}
    for stat in glob.glob(f"/proc/{proc.pid}/task/*/stat"):
        try:
            text = open(stat).read()
        except OSError:
            continue
        name = text[text.index("(") + 1:text.rindex(")")]
        rest = text[text.rindex(")") + 2:].split()
        out.setdefault(name, [0, 0])
        out[name][0] += int(rest[11])
        out[name][1] += int(rest[12])
    return out


def status():
    r = subprocess.run([sys.executable, "-m", "nvmeof_roce", "target", "status", "--json", "--socket", sock],
                       capture_output=True, text=True)
    return r.stdout


report = []
try:
    dev = kernel_glue.nvme_connect("10.99.0.1", 4470, nqn)
except Exception:
    proc.kill()
    raise
for rw, qd in (("randread", 32), ("randwrite", 32), ("randread", 1)):
    t0 = threads()
    w0 = time.monotonic()
    r = subprocess.run(["fio", "--name=j", f"--filename={dev}", "--ioengine=libaio", "--direct=1", f"--rw={rw}",
                        "--bs=4k", f"--iodepth={qd}", "--size=256M", "--time_based", "--runtime=10",
                        "--output-format=json"], capture_output=True, text=True)
    wall = time.monotonic() - w0
    t1 = threads()
    job = json.loads(r.stdout[r.stdout.index("{"):])["jobs"][0]
    d = job["read" if rw == "randread" else "write"]
    ios = d["total_ios"]
    report.append(f"== {rw} QD{qd} ({data_path} data path, switch interval {switch * 1000:g} ms): {d['iops']:.0f} IOPS, mean {d['lat_ns']['mean']/1000:.0f} us, "
                  f"{ios} I/Os in {wall:.1f} s")
    for name in sorted(t1, key=lambda n: -(sum(t1[n]) - sum(t0.get(n, [0, 0])))):
        u = t1[name][0] - t0.get(name, [0, 0])[0]
        s = t1[name][1] - t0.get(name, [0, 0])[1]
        if u + s:
            report.append(f"  thread {name:24s} user {u/100:6.2f} s  sys {s/100:6.2f} s  "
                          f"{(u + s) * 1e4 / ios:7.1f} us/IO")
kernel_glue.nvme_disconnect(nqn)
proc.send_signal(signal.SIGTERM)
proc.wait(60)
(OUT / f"gil-{tag}.txt").write_text("\n".join(report) + "\n")
subprocess.run(["rbd", "-c", conf, "rm", "--no-progress", "rbd/prof"])
print("\n".join(report[:40]))
