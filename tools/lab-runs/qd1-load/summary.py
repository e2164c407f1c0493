"""usage: summary.py BENCH_JSON [HOST_JSONL_GZ]: per repeat, each target's p50, its ratio to the kernel target, the target's CPU,
on-CPU time, run delay and timeslices per I/O, the guest's CPU, softirq and run delay per I/O; with the machine's samples
(hostsample.py), the QEMU threads' CPU and run delay in the job's window."""
import bisect, gzip, json, sys
d = json.load(open(sys.argv[1]))  # a bench.json
host = []
try:
    for line in (gzip.open(sys.argv[2], "rt") if len(sys.argv) > 2 else ()):
        host.append(json.loads(line))
except OSError:
    pass
ht = [h["t"] for h in host]

def host_delay(start, wall):
    """Every QEMU thread: on-CPU and run delay in the window, from the nearest samples."""
    if not host:
        return None
    i = bisect.bisect_left(ht, start); j = bisect.bisect_left(ht, start + wall)
    if i >= len(host) or j >= len(host) or j <= i:
        return None
    a, b = host[i]["threads"], host[j]["threads"]
    dt = host[j]["t"] - host[i]["t"]
    rd = oc = 0
    for k in b:
        if k in a:
            oc += b[k][0] - a[k][0]; rd += b[k][1] - a[k][1]
    return (oc / 1e3 / dt, rd / 1e3 / dt)  # µs per s of wall: on-cpu, run delay (every QEMU thread)

for job, jd in d["jobs"].items():
    res = jd["results"]
    print(f"== {job}")
    targets = list(res)
    n = max(len(res[t]["repeats"]) for t in targets)
    for i in range(n):
        row = []
        k = None
        for t in targets:
            reps = res[t]["repeats"]
            if i >= len(reps):
                continue
            r = reps[i]
            p50 = (r.get("lat_us") or {}).get("p50")
            if t == "kernel":
                k = p50
            c = r.get("cpu") or {}
            hd = host_delay(c.get("start_unix") or 0, c.get("wall_s") or 0)
            ratio = f"x{p50 / k:.2f}" if p50 and k else "-"
            row.append(f"{t}: p50 {p50} {ratio} iops {r.get('iops') and round(r['iops'])} err {r.get('errors')} "
                       f"cpu/io {c.get('target_us_per_io')} oncpu/io {c.get('target_on_cpu_us_per_io')} "
                       f"rundelay/io {c.get('target_run_delay_us_per_io')} wake/io {c.get('target_wakeups_per_io')} "
                       f"guest/io {c.get('guest_us_per_io')} softirq/io {c.get('guest_softirq_us_per_io')} "
                       f"guestrd/io {c.get('guest_run_delay_us_per_io')} "
                       + (f"qemu on {hd[0]/1e3:.0f} rd {hd[1]/1e3:.0f} ms/s, rd/io {hd[1]/(r['iops'] or 1):.0f}us" if hd else ""))
        print(f" r{i}: " + "\n     ".join(row))
