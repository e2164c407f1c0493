"""`nvmeof-roce bench`: the kernel target and our userspace target side by side (fio + perftest)."""
from __future__ import annotations

import argparse
import datetime as _dt
import re
import signal
import sys
from pathlib import Path
from typing import List, Optional

from ..errors import NvmeofError
from ..output import emit, progress, table
from . import report
from .fio import default_jobs_dir
from .perftest import DEFAULT_TESTS
from .runner import BenchConfig, BenchRunner, available_jobs, qd_sweep_jobs, rbd_jobs, select_jobs
from . import rbd, twonode
from .perftest import rdma_device_for
from .runner import machine_info
from .targets import DEFAULT_PORTS, FABRICS, DeviceModel, KernelHost, KernelNvmetTarget, TargetUnderTest, \
    UserspaceTarget

LAB_TRADDR = "10.99.0.1"
LAB_IWARP_TRADDR = "10.98.0.1"  # the lab's siw0, when a test or script adds it (docs/lab.md)
TARGET_NAMES = ("kernel", "userspace", "userspace-py", "baseline")  # and userspace-Nw, native... (NATIVE_TARGET)
WORKERS_TARGET = re.compile(r"userspace-(\d+)w")  # our target with `serve --workers N` (docs/multipath.md)
# our target with `serve --data-path native` [--poll busy [--cores N] | --poll adaptive [--poll-spin-us US]]
# (docs/native.md)
NATIVE_TARGET = re.compile(r"native(?:-(busy)|-(adaptive)(?:-(\d+)us)?)?(?:-(\d+)c)?")


def native_serve_args(name: str) -> list:
    """The poll options `target serve --data-path native` gets for a native... target: native, native-busy,
    native-busy-2c, native-adaptive, native-adaptive-500us."""
    m = NATIVE_TARGET.fullmatch(name)
    busy, adaptive, spin, cores = m.groups()
    if cores and not busy:
        raise NvmeofError(f"--targets {name}: poll-group threads poll continuously", f"--targets native-busy-{cores}c")
    if busy:
        return ["--poll", "busy"] + (["--cores", cores] if cores else [])
    if adaptive:
        return ["--poll", "adaptive"] + (["--poll-spin-us", spin] if spin else [])
    return []


def cpu_list(option: str, text: str, *, here: bool = False) -> List[int]:
    """A CPU list option of the bench (--userspace-cpus, --host-cpus); `here`: every CPU must be one this process
    may run on (the children it pins run where it does; serve checks its own --cpus where it runs)."""
    from ..config import parse_cpus, usable_cpus
    try:
        cpus = parse_cpus(text)
    except NvmeofError:
        raise NvmeofError(f"{option} {text!r}: not a list of CPU numbers", f"e.g. {option} 0,1")
    return usable_cpus(option, cpus) if here else cpus


def _size_mb(text: str) -> int:
    from ..config import parse_size  # shared size syntax: 512M, 1G, ...
    try:
        n = parse_size(text)
    except ValueError as exc:
        raise NvmeofError(f"--ns-size {text!r}: {exc}", "e.g. --ns-size 512M")
    if n < (1 << 20) or n % (1 << 20):
        raise NvmeofError(f"--ns-size {text!r} must be a whole number of MiB", "e.g. --ns-size 512M")
    return n >> 20


def _fabric_target(args, name: str, size_mb: int, device: DeviceModel, kernel_backend: Optional[str],
                   out_dir: Path) -> TargetUnderTest:
    """kernel@FABRIC or userspace@FABRIC: the target over iWARP (at --iwarp-traddr) or NVMe/TCP (at --traddr),
    on the target's usual port plus the fabric's offset."""
    base, _, fabric_name = name.partition("@")
    fabric = FABRICS.get(fabric_name)
    if base not in ("kernel", "userspace") or fabric is None:
        raise NvmeofError(f"--targets {name}: unknown target or fabric",
                          f"NAME@FABRIC with NAME kernel or userspace and FABRIC one of {', '.join(FABRICS)}")
    traddr = getattr(args, "iwarp_traddr", LAB_IWARP_TRADDR) if fabric.name == "iwarp" else args.traddr
    if base == "kernel":
        return KernelNvmetTarget(traddr, args.kernel_port + fabric.port_offset, backend=kernel_backend or "null_blk",
                                 size_mb=size_mb, device=device, name=name, fabric=fabric)
    return UserspaceTarget(traddr, args.userspace_port + fabric.port_offset, size_mb=size_mb, work_dir=out_dir,
                           device=device, name=name, fabric=fabric)


def build_targets(args, out_dir: Path) -> List[TargetUnderTest]:
    names = [n.strip() for n in args.targets.split(",") if n.strip()]
    bad = [n for n in names if n not in TARGET_NAMES and not WORKERS_TARGET.fullmatch(n)
           and not NATIVE_TARGET.fullmatch(n) and "@" not in n and n not in rbd.TARGET_NAMES]
    if bad or not names:
        raise NvmeofError(f"--targets {args.targets!r}: unknown target {', '.join(bad) or '(none)'}",
                          "--targets kernel,userspace[,userspace-py][,baseline][,userspace-2w][,kernel@iwarp,"
                          "userspace@iwarp,kernel@tcp][,native,native-busy,native-busy-2c,native-adaptive[-500us]] "
                          "(any of them, in the order to interleave; userspace-py: our target on its Python data "
                          "path; userspace-Nw: our target with N workers; NAME@FABRIC: over iWARP or NVMe/TCP instead "
                          "of RoCE v2; native...: our target on the native data path, interrupt, busy or adaptively "
                          "polled (a spin of US µs), on N poll-group threads; userspace-rbd, kernel-krbd, fio-rbd: "
                          "one RBD image three ways, bench --rbd)")
    if len(set(names)) != len(names):
        raise NvmeofError(f"--targets {args.targets!r} names a target twice", "name each target once")
    multi = [n for n in names if WORKERS_TARGET.fullmatch(n)]
    for n in multi:
        if not 2 <= int(WORKERS_TARGET.fullmatch(n).group(1)) <= 16:
            raise NvmeofError(f"--targets {n}: the worker count must be 2..16", "e.g. --targets userspace-2w")
    cpus = getattr(args, "userspace_cpus", None)
    if multi and args.userspace_config:
        raise NvmeofError(f"--userspace-config is for the single-process userspace target, not {multi[0]} (a "
                          "multi-worker target serves the generated RAM namespace on its own ports)",
                          "drop --userspace-config, or measure userspace-Nw in a run of its own")
    if cpus is not None:
        cpu_list("--userspace-cpus", cpus)
        if not any(n in ("userspace", "userspace-py") or WORKERS_TARGET.fullmatch(n) or NATIVE_TARGET.fullmatch(n)
                   for n in names):
            raise NvmeofError("--userspace-cpus pins our target (serve --cpus), and --targets has none of ours",
                              "add e.g. userspace or native-busy to --targets, or drop --userspace-cpus")
    size_mb = _size_mb(args.ns_size)
    device = DeviceModel.parse(getattr(args, "device", None) or "ram")
    kernel_backend = getattr(args, "kernel_backend", None)
    if device.kind != "ram" and kernel_backend:
        raise NvmeofError(f"--kernel-backend and --device {device.label} both say what the kernel target's "
                          "namespace is", "drop --kernel-backend: --device makes the same device for both targets")
    if device.kind != "ram" and multi:
        raise NvmeofError(f"--device {device.label} is for the kernel, userspace and baseline targets",
                          "measure userspace-Nw on the default RAM device")
    data_path = getattr(args, "data_path", None)
    if data_path and rbd.USERSPACE not in names:
        raise NvmeofError(f"--data-path {data_path} is for the {rbd.USERSPACE} target (bench --rbd)",
                          "add userspace-rbd to --targets, or measure the data paths with --targets native,userspace-py")
    rbd_path = getattr(args, "rbd_path", None)
    if rbd_path and rbd.USERSPACE not in names:
        raise NvmeofError(f"--rbd-path {rbd_path} is for the {rbd.USERSPACE} target (bench --rbd)",
                          "add userspace-rbd to --targets")
    image = _rbd_image(args, size_mb, out_dir) if any(n in rbd.TARGET_NAMES for n in names) else None
    targets: List[TargetUnderTest] = []
    for name in names:
        if name == rbd.USERSPACE:
            targets.append(rbd.RbdUserspaceTarget(args.traddr, image, work_dir=out_dir, data_path=data_path, cpus=cpus,
                                                  rbd_path=rbd_path or rbd.DEFAULT_RBD_PATH))
        elif name == rbd.KERNEL:
            targets.append(rbd.KrbdNvmetTarget(args.traddr, image))
        elif name == rbd.FIO:
            targets.append(rbd.FioRbdTarget(image))
        elif "@" in name:
            targets.append(_fabric_target(args, name, size_mb, device, kernel_backend, out_dir))
        elif name == "kernel":
            targets.append(KernelNvmetTarget(args.traddr, args.kernel_port, backend=kernel_backend or "null_blk",
                                             size_mb=size_mb, device=device))
        elif WORKERS_TARGET.fullmatch(name):
            # the k-th multi-worker target: ports workers_port + 16 k onwards, one per worker
            port = getattr(args, "workers_port", DEFAULT_PORTS["workers"]) + 16 * multi.index(name)
            targets.append(UserspaceTarget(args.traddr, port, size_mb=size_mb, work_dir=out_dir, name=name,
                                           workers=int(WORKERS_TARGET.fullmatch(name).group(1)), cpus=cpus))
        elif name == "userspace":
            targets.append(UserspaceTarget(args.traddr, args.userspace_port, size_mb=size_mb, work_dir=out_dir,
                                           config_path=args.userspace_config, device=device, cpus=cpus))
        elif name == "userspace-py":  # the same target on its Python data path (the reference), own port and NQN
            targets.append(UserspaceTarget(args.traddr, getattr(args, "userspace_py_port",
                                                                DEFAULT_PORTS["userspace-py"]),
                                           size_mb=size_mb, work_dir=out_dir, name=name, device=device,
                                           data_path="python", cpus=cpus))
        elif NATIVE_TARGET.fullmatch(name):  # the k-th native target: port 4490 + k
            natives = [n for n in names if NATIVE_TARGET.fullmatch(n)]
            targets.append(UserspaceTarget(args.traddr, DEFAULT_PORTS["native"] + natives.index(name),
                                           size_mb=size_mb, work_dir=out_dir, name=name, device=device,
                                           data_path="native", serve_args=tuple(native_serve_args(name)),
                                           cpus=cpus))
        else:
            if not args.baseline_checkout:
                raise NvmeofError("--targets baseline needs --baseline-checkout DIR (the checkout whose target "
                                  "is the 'before')", "git worktree add results/baseline <commit>, then "
                                  "--baseline-checkout results/baseline")
            targets.append(UserspaceTarget(args.traddr, args.baseline_port, size_mb=size_mb, work_dir=out_dir,
                                           name="baseline", checkout=args.baseline_checkout, device=device))
    if args.baseline_checkout and "baseline" not in names:
        raise NvmeofError("--baseline-checkout is given but 'baseline' is not in --targets",
                          "--targets kernel,userspace,baseline")
    return targets


def _rbd_image(args, size_mb: int, out_dir: Path) -> "rbd.BenchImage":
    """The image the rbd targets share (bench --rbd): --rbd-image on --rbd-conf as --rbd-id, --ns-size when it is
    created, its first --size written once."""
    spec = rbd.RbdImageSpec.parse(getattr(args, "rbd_image", None) or rbd.DEFAULT_IMAGE,
                                  getattr(args, "rbd_conf", None), getattr(args, "rbd_id", None) or "admin")
    return rbd.BenchImage(spec, size_mb, getattr(args, "size", "256M"), out_dir, progress=progress)


def _rbd_config(targets: List[TargetUnderTest], ratio) -> dict:
    """BenchConfig's ratios and rbd record when rbd targets are measured: every pair of rbd.RATIOS both of whose
    targets are (after the headline ratio's), and the image and data path."""
    names = [t.name for t in targets]
    image = next((t.image for t in targets if t.name in rbd.TARGET_NAMES), None)
    if image is None:
        return {}
    ratios = [tuple(ratio)] + [p for p in rbd.RATIOS if p != tuple(ratio)]
    ours = next((t for t in targets if t.name == rbd.USERSPACE), None)
    return {"ratios": [p for p in ratios if all(n in names for n in p)],
            "rbd": {"image": image.spec.spec, "conf": image.spec.conf, "client": f"client.{image.spec.client_id}",
                    "image_size_mb": image.size_mb, "region": image.region,
                    "data_path_requested": (ours.data_path or "default") if ours else None,
                    "rbd_path_requested": ours.rbd_path if ours else None}}


def _default_out() -> Path:
    return Path("results") / f"bench-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def _plots(result: dict, out_dir: Path) -> List[Path]:
    from .plot import plot_all
    try:
        return plot_all(result, out_dir)
    except NvmeofError as exc:
        progress(f"bench: no plots: {exc}")
        return []


def _print_paths(json_path: Path, pngs: List[Path], to_stderr: bool) -> None:
    lines = [f"results: {json_path}"] + [f"plot:    {p}" for p in pngs]
    for line in lines:
        print(line, file=sys.stderr if to_stderr else sys.stdout)


def cmd_list_jobs(args) -> int:
    jobs = available_jobs(args.jobs_dir)

    def human(_):
        print(table(["job", "kind", "description"], [[j.name, j.kind, j.description] for j in jobs.values()]))
    emit({n: {"kind": j.kind, "description": j.description,
              "file": str(j.fio_job.path) if j.fio_job else None, "params": j.params}
          for n, j in jobs.items()}, args.json, human)
    return 0


def cmd_from(args) -> int:
    """Re-print the table of an earlier run and (re)draw its plots next to it."""
    result = report.load_json(args.from_result)
    src = Path(args.from_result)
    json_path = src / "bench.json" if src.is_dir() else src
    out_dir = Path(args.out) if args.out else json_path.parent
    return _show(result, json_path, out_dir, args)


def _show(result: dict, json_path: Path, out_dir: Path, args) -> int:
    """Draw a result's plots into out_dir and print it as --markdown/--json ask; 0 if it went well, else 1."""
    pngs = [] if args.no_plots else _plots(result, out_dir)
    if args.markdown is not None:
        print(report.render_markdown(result, args.markdown), end="")
        return 0 if result.get("ok") else 1
    emit(result, args.json, lambda r: print(report.render(r)))
    _print_paths(json_path, pngs, args.json)
    return 0 if result.get("ok") else 1


def cmd_bench(args) -> int:
    if args.list_jobs:
        return cmd_list_jobs(args)
    if args.from_result:
        return cmd_from(args)
    if args.runtime <= 0 or args.ramp < 0:
        raise NvmeofError("--runtime must be above 0 and --ramp not negative", "e.g. --runtime 10 --ramp 2")
    if args.capture and not (args.two_node or args.node):
        raise NvmeofError("--capture needs --two-node: on one node rxe loops its packets back inside the kernel, "
                          "there is no wire to capture", "nvmeof-roce bench --two-node --capture")
    if args.soak_ios < 1000:
        raise NvmeofError(f"--soak-ios {args.soak_ios}: the soak needs at least 1000 commands to fit a line",
                          "e.g. --soak-ios 200000 in the lab, --soak-ios 3000000 on RDMA hardware")
    if args.soak_change_interval < 0:
        raise NvmeofError(f"--soak-change-interval {args.soak_change_interval} is below 0",
                          "give the seconds between the soak's live changes, e.g. 3, or 0 for none")
    if args.soak_interval <= 0 or args.soak_timeout <= 0:
        raise NvmeofError("--soak-interval and --soak-timeout must be above 0",
                          "e.g. --soak-interval 2 --soak-timeout 7200")
    if args.soak_skip is not None and not 0 <= args.soak_skip < args.soak_ios:
        raise NvmeofError(f"--soak-skip {args.soak_skip} must be from 0 to below --soak-ios ({args.soak_ios})",
                          "e.g. --soak-skip 20000")
    use_rbd = getattr(args, "rbd", False)
    if args.targets is None:
        args.targets = ",".join(rbd.TARGET_NAMES) if use_rbd else "kernel,userspace"
    if use_rbd and not args.ratio:
        args.ratio = "/".join(rbd.RATIOS[0])
    ratio = tuple(x.strip() for x in (args.ratio or "/".join(report.DEFAULT_RATIO)).split("/"))
    if len(ratio) != 2 or not all(ratio) or ratio[0] == ratio[1]:
        raise NvmeofError(f"--ratio {args.ratio!r} is not two targets as A/B", "e.g. --ratio userspace/baseline")
    out_dir = Path(args.out) if args.out else _default_out()
    if getattr(args, "qd_sweep", False):  # the sweep, after any --jobs named
        jobs = (select_jobs(args.jobs, args.jobs_dir) if args.jobs else []) + qd_sweep_jobs(args.jobs_dir)
    elif use_rbd and not args.jobs:
        jobs = rbd_jobs(args.jobs_dir)
    else:
        jobs = select_jobs(args.jobs, args.jobs_dir)
    if args.two_node and not args.node:
        return _two_node_on_machine(args, out_dir)
    perftest_tests = tuple(t.strip() for t in args.perftest_tests.split(",") if t.strip())
    if args.node == "target":
        args.traddr = twonode.TARGET_NODE
        if args.userspace_config:  # the same config, listening on this node's address
            args.userspace_config = twonode.config_on_target_node(args.userspace_config, out_dir)
        return twonode.serve_targets(build_targets(args, out_dir), () if args.no_perftest else perftest_tests,
                                     args.perftest_iterations, BenchConfig.perftest_port, args.timeout)
    remote = args.node == "host"
    targets = twonode.remote_targets(600) if remote else build_targets(args, out_dir)
    config = BenchConfig(out_dir=out_dir, traddr=twonode.TARGET_NODE if remote else args.traddr,
                         runtime=args.runtime, ramp=args.ramp, size=args.size,
                         repeats=args.repeats, perftest=not args.no_perftest, perftest_tests=perftest_tests,
                         perftest_iterations=args.perftest_iterations, perftest_rdma_cm=args.perftest_gid is None,
                         perftest_gid=args.perftest_gid,
                         rdma_device=args.rdma_device or (rdma_device_for(twonode.HOST_NODE) if remote else None),
                         topology=twonode.topology() if remote else None, soak_ios=args.soak_ios,
                         soak_interval=args.soak_interval, soak_timeout=args.soak_timeout,
                         soak_skip=args.soak_skip, soak_change_interval=args.soak_change_interval, ratio=ratio,
                         host_cpus=cpu_list("--host-cpus", args.host_cpus, here=True)
                         if getattr(args, "host_cpus", None) else None,
                         **_rbd_config(targets, ratio))
    if not remote and args.node is None:
        missing = [r for r in ratio if r not in [t.name for t in targets]]
        if missing and args.ratio:  # the default ratio is simply left out when a target is not measured
            raise NvmeofError(f"--ratio {args.ratio}: {', '.join(missing)} is not in --targets {args.targets}",
                              "name two of the measured targets, e.g. --ratio userspace/kernel")
    host = None
    if any(j.kind in ("fio", "soak") for j in jobs):
        host = twonode.CapturingHost(out_dir) if args.capture else KernelHost()
    extra = {"perftest_runner": twonode.remote_perftest, "machine": machine_info(twonode.HOST_NODE)} if remote else {}
    runner = BenchRunner(config, targets, jobs, host=host, **extra)

    # SIGTERM (a CI timeout, the lab) unwinds like Ctrl-C, through the runner's finally blocks.
    def on_term(signum, frame):
        raise KeyboardInterrupt
    old = signal.signal(signal.SIGTERM, on_term)
    try:
        result = runner.run()
    finally:
        signal.signal(signal.SIGTERM, old)
        if remote:
            twonode.done()  # the target node tears down

    json_path = report.write_json(result, out_dir / "bench.json")
    status = _show(result, json_path, out_dir, args)
    if status and args.markdown is None:
        progress("bench: finished with errors (see above)")
    return status


def _two_node_on_machine(args, out_dir: Path) -> int:
    """bench --two-node on this machine: boot the two lab nodes, then report what the host node measured."""
    import os
    if os.environ.get("NVMEOF_LAB") == "1":
        raise NvmeofError("bench --two-node boots two lab guests: run it on the machine, not inside a guest",
                          "exit the guest and run nvmeof-roce bench --two-node there")
    argv = sys.argv[sys.argv.index("bench") + 1:] if "bench" in sys.argv else []
    code = twonode.run_on_machine(argv, out_dir, args.timeout)
    result = report.load_json(out_dir / "bench.json")
    pngs = [] if args.no_plots else _plots(result, out_dir)
    emit(result, args.json, lambda r: print(report.render(r)))
    _print_paths(out_dir / "bench.json", pngs, args.json)
    return code or (0 if result.get("ok") else 1)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="benchmark the kernel target and the userspace target side by side (fio, perftest)",
        description="Set up the targets, measure the RDMA link with perftest, run fio jobs through the kernel "
                    "host against each target interleaved job by job, tear everything down, and write a table, "
                    "a JSON file and PNG charts. Needs root and an RDMA device; in the lab: "
                    "nvmeof-roce lab run -- nvmeof-roce bench.")
    p.add_argument("--jobs", metavar="LIST", help="comma-separated jobs (default: every fio job; see --list-jobs)")
    p.add_argument("--targets", metavar="LIST",
                   help="targets to measure, in interleaving order (default kernel,userspace, or with --rbd "
                        "userspace-rbd,kernel-krbd,fio-rbd; userspace-2w: our target with --workers 2, reported as "
                        "scaling over userspace, docs/multipath.md)")
    p.add_argument("--rbd", action="store_true",
                   help="the RBD job set (4 KiB random read and write at QD32 and QD1) on one RBD image three ways: "
                        "our target's rbd namespace (userspace-rbd), kernel nvmet on the image mapped with krbd "
                        "(kernel-krbd), and fio's own rbd engine (fio-rbd, no target); docs/rbd.md")
    p.add_argument("--rbd-image", metavar="POOL/IMAGE", default=rbd.DEFAULT_IMAGE,
                   help=f"the image of the rbd targets (default {rbd.DEFAULT_IMAGE}: created at --ns-size with the "
                        "layering feature when missing, removed at the end); its first --size is written once first")
    p.add_argument("--rbd-conf", metavar="FILE", help="the cluster's ceph.conf (default $CEPH_CONF, else "
                                                      "/etc/ceph/ceph.conf; lab run --ceph sets CEPH_CONF)")
    p.add_argument("--rbd-id", metavar="ID", default="admin", help="the Ceph client's id (default admin)")
    p.add_argument("--rbd-path", choices=rbd.RBD_PATHS,
                   help="how userspace-rbd serves the image: native (the default: the namespace's \"native\": true, "
                        "librbd's C API from the native queues) or python (the reference path: the core through "
                        "python3-rbd); the report says which one served it")
    p.add_argument("--data-path", choices=("native", "python"),
                   help="the I/O queues' data path of userspace-rbd (target serve --data-path; default: native with "
                        "--rbd-path native, else the target's own)")
    p.add_argument("--ratio", metavar="A/B",
                   help="the ratio the report leads with (default userspace/kernel; before and after: "
                        "userspace/baseline)")
    p.add_argument("--repeats", type=int, default=1, metavar="N", help="runs of every job on every target (default 1)")
    p.add_argument("--runtime", type=float, default=10.0, metavar="S", help="seconds measured per fio job (default 10)")
    p.add_argument("--ramp", type=float, default=2.0, metavar="S", help="seconds of warm-up before measuring (default 2)")
    p.add_argument("--size", default="256M", help="region of the namespace fio exercises (fio size, default 256M)")
    p.add_argument("-a", "--traddr", default=LAB_TRADDR, metavar="IP",
                   help=f"RDMA address both targets listen on (default {LAB_TRADDR}, the lab's rxe0)")
    p.add_argument("--iwarp-traddr", default=LAB_IWARP_TRADDR, metavar="IP",
                   help=f"address of the iWARP device for the NAME@iwarp targets (default {LAB_IWARP_TRADDR}, the "
                        "lab's siw0 once added: docs/lab.md)")
    p.add_argument("--kernel-port", type=int, default=DEFAULT_PORTS["kernel"], metavar="N",
                   help=f"kernel target's trsvcid (default {DEFAULT_PORTS['kernel']})")
    p.add_argument("--userspace-port", type=int, default=DEFAULT_PORTS["userspace"], metavar="N",
                   help=f"userspace target's trsvcid (default {DEFAULT_PORTS['userspace']})")
    p.add_argument("--baseline-port", type=int, default=DEFAULT_PORTS["baseline"], metavar="N",
                   help=f"baseline target's trsvcid (default {DEFAULT_PORTS['baseline']})")
    p.add_argument("--userspace-py-port", type=int, default=DEFAULT_PORTS["userspace-py"], metavar="N",
                   help=f"trsvcid of userspace-py, our target on its Python data path (default "
                        f"{DEFAULT_PORTS['userspace-py']})")
    p.add_argument("--baseline-checkout", type=Path, metavar="DIR",
                   help="with --targets ...,baseline: another checkout whose 'target serve' is measured as "
                        "'baseline' (the before of a change, e.g. a git worktree of an older commit)")
    p.add_argument("--workers-port", type=int, default=DEFAULT_PORTS["workers"], metavar="N",
                   help=f"first trsvcid of a userspace-Nw target (worker i listens on N + i; default "
                        f"{DEFAULT_PORTS['workers']})")
    p.add_argument("--userspace-cpus", metavar="LIST",
                   help="pin our targets to CPUs (their serve --cpus): a userspace-Nw target's worker i to CPU "
                        "LIST[i %% len], the single-process ones (userspace, userspace-py, native...) to LIST; "
                        "e.g. 2,3")
    p.add_argument("--host-cpus", metavar="LIST",
                   help="run the host's load (fio, our initiator's perf) on these CPUs only, for every target "
                        "alike; e.g. 0 (with --userspace-cpus 1: the target on a CPU of its own)")
    p.add_argument("--kernel-backend", choices=("null_blk", "file"),
                   help="with the default --device ram: the kernel namespace on a memory-backed null_blk "
                        "(default) or a file on tmpfs (buffered_io)")
    p.add_argument("--device", default="ram", metavar="MODEL",
                   help="what both targets' namespace sits on, one device each with the same settings: ram "
                        "(default: the targets alone), null_blk:LATENCY (a null_blk whose commands complete "
                        "after LATENCY, e.g. 20us for an NVMe SSD, 100us, 2ms for a disk), file (a file on this "
                        "machine's disk, O_DIRECT); docs/devices.md")
    p.add_argument("--qd-sweep", action="store_true",
                   help="4 KiB random read at queue depths 1, 4, 16, 32 and 128 (after any --jobs), plotted "
                        "as IOPS against queue depth (qd_sweep.png)")
    p.add_argument("--ns-size", default="512M", help="namespace size of both targets (default 512M)")
    p.add_argument("--userspace-config", type=Path, metavar="FILE",
                   help="config for the userspace target instead of the generated RAM one (address from ports[0])")
    p.add_argument("--out", metavar="DIR", help="output directory (default results/bench-<timestamp>/)")
    p.add_argument("--json", action="store_true", help="print the result JSON instead of the table")
    p.add_argument("--no-perftest", action="store_true", help="skip the perftest link measurements")
    p.add_argument("--perftest-tests", default=",".join(DEFAULT_TESTS), metavar="LIST",
                   help=f"perftest programs to run (default {','.join(DEFAULT_TESTS)})")
    p.add_argument("--perftest-iterations", type=int, metavar="N", help="perftest -n (default: perftest's own)")
    p.add_argument("--perftest-gid", type=int, metavar="N",
                   help="run perftest without rdma_cm, with this GID index (-x N); default: rdma_cm (-R)")
    p.add_argument("--rdma-device", metavar="DEV", help="RDMA device for perftest (default: the one holding --traddr)")
    p.add_argument("--soak-ios", type=int, default=10_000_000, metavar="N",
                   help="commands the soak job (--jobs soak) runs, verified writes and their reads (default "
                        "10000000: about an hour in the emulated lab; `make soak SOAK_IOS=1000000` for a shorter "
                        "one)")
    p.add_argument("--soak-interval", type=float, default=2.0, metavar="S",
                   help="seconds between the soak's RSS samples (default 2)")
    p.add_argument("--soak-timeout", type=float, default=7200.0, metavar="S",
                   help="cap on the soak's duration; it ends at the count or the cap (default 7200)")
    p.add_argument("--soak-change-interval", type=float, default=3.0, metavar="S",
                   help="seconds between the soak's live changes on our target: a scratch namespace added, "
                        "resized, removed by RPC (default 3; 0: none)")
    p.add_argument("--soak-skip", type=int, metavar="N",
                   help="commands at the soak's start left out of the RSS fit (default: the first tenth)")
    p.add_argument("--no-plots", action="store_true", help="no PNG charts")
    p.add_argument("--two-node", action="store_true",
                   help="boot two lab nodes: both targets on one (10.99.1.1), nvme-cli + fio on the other "
                        "(10.99.1.2), one virtual wire between (docs/two-node.md)")
    p.add_argument("--capture", action="store_true",
                   help=f"with --two-node: keep a tcpdump capture (first {twonode.CAPTURE_PACKETS} frames) of each "
                        "fio run and its decoded summary under OUT/captures/")
    p.add_argument("--timeout", type=float, default=3600, metavar="S",
                   help="with --two-node: lab time limit in seconds (default 3600)")
    p.add_argument("--node", choices=("target", "host"), help=argparse.SUPPRESS)  # inside the two-node lab
    p.add_argument("--jobs-dir", type=Path, metavar="DIR",
                   help=f"fio job files (default: {default_jobs_dir()}, the checkout's fio-jobs/ or the copy an "
                        "installed package carries)")
    p.add_argument("--list-jobs", action="store_true", help="list the jobs and exit")
    p.add_argument("--from", dest="from_result", metavar="RESULT",
                   help="re-print an earlier run's table and re-draw its plots (bench.json or its directory)")
    p.add_argument("--markdown", metavar="PLOTS_DIR", nargs="?", const="",
                   help="with --from: print a results section for docs/benchmarks.md (plots linked from PLOTS_DIR)")
    p.set_defaults(func=cmd_bench)
