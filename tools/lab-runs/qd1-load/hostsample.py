"""Host side: every second, each QEMU thread's schedstat (on-CPU ns, run-delay ns, timeslices), JSON lines."""
import glob, json, os, sys, time
out = open(sys.argv[1], "a")
while True:
    rec = {"t": time.time(), "threads": {}}
    for d in glob.glob("/proc/[0-9]*"):
        try:
            with open(d + "/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if not comm.startswith("qemu-system"):
            continue
        for t in glob.glob(d + "/task/*"):
            try:
                name = open(t + "/comm").read().strip()
                ss = open(t + "/schedstat").read().split()
            except OSError:
                continue
            rec["threads"][f"{os.path.basename(d)}/{os.path.basename(t)}/{name}"] = [int(x) for x in ss[:3]]
    if rec["threads"]:
        out.write(json.dumps(rec) + "\n")
        out.flush()
    time.sleep(1.0)
