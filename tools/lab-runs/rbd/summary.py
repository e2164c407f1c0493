"""Print a `bench --rbd` run's figures as docs/rbd.md "Figures" gives them: per job the medians of our target, kernel
nvmet over krbd and fio's rbd engine (IOPS, target and guest CPU per I/O, the OSD's), the two IOPS ratios, ours/nvmet
per repeat, and what served our namespace (the core's high-water mark beside the C path's).

    python3 tools/lab-runs/rbd/summary.py results/rbd/native/bench.json [--markdown]
"""
import json
import sys

OURS, KERNEL, FIO = "userspace-rbd", "kernel-krbd", "fio-rbd"


def fmt(v, digits=0):
    return "-" if v is None else f"{v:,.{digits}f}"


def main(path, markdown=False):
    d = json.load(open(path))
    print(f"# {path}: rbd path {d['params'].get('rbd', {}).get('rbd_path_requested')}, "
          f"{d['params'].get('repeats')} repeats")
    if markdown:
        print("| job | ours IOPS | nvmet IOPS | fio-rbd IOPS | ours/nvmet | ours/fio-rbd | ours/nvmet per repeat "
              "| target CPU µs/IO | guest CPU µs/IO ours / nvmet | OSD µs/IO ours / nvmet |")
        print("|---|---|---|---|---|---|---|---|---|---|")
    for name, job in d["jobs"].items():
        res = job["results"]
        med = {t: res[t]["median"] for t in (OURS, KERNEL, FIO) if t in res}
        ratios = {r["denominator"]: r for r in job.get("ratios", [])}
        per = [o["iops"] / k["iops"] if o.get("iops") and k.get("iops") else None
               for o, k in zip(res[OURS]["repeats"], res[KERNEL]["repeats"])]
        served = [r.get("served") or {} for r in res[OURS]["repeats"]]
        row = [name, fmt(med[OURS]["iops"]), fmt(med[KERNEL]["iops"]), fmt(med[FIO]["iops"]),
               f"x{ratios[KERNEL]['iops']:.2f}", f"x{ratios[FIO]['iops']:.2f}",
               ", ".join(fmt(p, 2) for p in per), fmt(med[OURS]["cpu"]["target_us_per_io"]),
               f"{fmt(med[OURS]['cpu']['guest_us_per_io'])} / {fmt(med[KERNEL]['cpu']['guest_us_per_io'])}",
               f"{fmt(med[OURS]['side_us_per_io'].get('ceph-osd'))} / "
               f"{fmt(med[KERNEL]['side_us_per_io'].get('ceph-osd'))}"]
        if markdown:
            print("| " + " | ".join(row) + " |")
        else:
            print("  ".join(row))
            print("    served:", [(s.get("rbd"), s.get("most_in_flight"), s.get("native_most_in_flight"))
                                  for s in served])


if __name__ == "__main__":
    main(sys.argv[1], "--markdown" in sys.argv)
