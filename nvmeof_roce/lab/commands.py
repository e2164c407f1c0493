"""`nvmeof-roce lab build | run | shell | status | clean`."""
from __future__ import annotations

import argparse
import re
import shutil
import time
from pathlib import Path

from ..errors import NvmeofError
from ..output import emit, progress
from . import aptconfig, ceph_commands
from . import guest_native
from . import image as lab_image
from .vm import LabRun, run_in_guest


def project_root() -> Path:
    """The checkout that holds this package (mounted at /mnt/project in the guest)."""
    return Path(__file__).resolve().parents[2]


MAX_CPUS = 64  # QEMU's pc machine takes more, but TCG on a small host makes no progress past this
MIN_MEMORY_MB = 512  # the guest's kernel, initrd and tools


def memory_size(text: str) -> int:
    """--memory: '2048', '2048M' or '2G' -> MiB."""
    match = re.fullmatch(r"\s*(\d+)\s*([MmGg]?)(?:i?[Bb])?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use MiB (2048) or a unit (2G, 1536M)")
    mib = int(match.group(1)) * (1024 if match.group(2).lower() == "g" else 1)
    if mib < MIN_MEMORY_MB:
        raise argparse.ArgumentTypeError(f"{text!r}: the guest needs at least {MIN_MEMORY_MB} MiB")
    return mib


def cpu_count(text: str) -> int:
    """--cpus: 1..MAX_CPUS."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of vCPUs") from None
    if not 1 <= n <= MAX_CPUS:
        raise argparse.ArgumentTypeError(f"{n} vCPUs: use 1-{MAX_CPUS}")
    return n


def run_modules(image: lab_image.LabImage, siw_wanted: bool):
    """The out-of-tree modules a run asked for (--siw), built now or from the cache, and those that cannot be
    had with the reason: the run goes on without them (the iWARP tests skip, saying why)."""
    if not siw_wanted:
        return {}, {}
    from . import siw
    try:
        return {"siw": siw.for_image(image)}, {}
    except NvmeofError as exc:
        progress(f"lab: no siw.ko for this run: {exc.message} (iWARP tests will skip)")
        return {}, {"siw": exc.message}


def _lab_run(args, interactive: bool) -> int:
    if args.nodes == 2 or getattr(args, "node", None):
        return _lab_run_two(args, interactive)
    if args.target_cmd or args.host_cmd:
        raise NvmeofError("--target-cmd and --host-cmd need --nodes 2", "e.g. nvmeof-roce lab run --nodes 2 "
                          "--target-cmd 'CMD' --host-cmd 'CMD'")
    args.cpus = args.cpus or 2
    command = list(args.command or [])
    if command and command[0] == "--":
        command = command[1:]
    if not interactive and not command:
        raise NvmeofError("lab run: no command given", "e.g. nvmeof-roce lab run -- ibv_devinfo")
    env = {}
    for item in args.env or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise NvmeofError(f"--env {item!r}: expected NAME=VALUE", "e.g. --env RUNTIME=5")
        env[key] = value
    image = lab_image.build(force=False, kernel=args.kernel)  # the image for the current inputs, built first if needed
    project = Path(args.project).resolve() if args.project else project_root()
    guest_native.ensure(image, project)  # Python 3.13 guests: the native module for their Python, cached
    modules, missing = run_modules(image, args.siw)
    run = LabRun(command=command, project=project,
                 share=Path(args.share).resolve() if args.share else None, timeout=args.timeout,
                 memory_mb=args.memory, cpus=args.cpus, kvm=args.kvm, interactive=interactive,
                 rxe=not args.no_rxe, env=env, modules=modules, missing_modules=missing, ceph=args.ceph)
    progress(f"lab: booting guest ({'KVM' if args.kvm else 'TCG'}, {args.cpus} vCPU, {args.memory} MB, "
             f"timeout {args.timeout:.0f} s)" + (f": {' '.join(command)}" if command else ""))
    started = time.monotonic()
    code = run_in_guest(image, run)
    progress(f"lab: guest finished in {time.monotonic() - started:.1f} s, exit code {code}")
    return code


def _lab_run_two(args, interactive: bool) -> int:
    """Two guests on a virtual wire (twonode.py): target 10.99.1.1, host 10.99.1.2."""
    import tempfile
    from .twonode import NodeSpec, run_two

    if args.nodes not in (1, 2):
        raise NvmeofError(f"--nodes {args.nodes}: the lab has one or two nodes", "use --nodes 2")
    command = list(args.command or [])
    if command and command[0] == "--":
        command = command[1:]
    if command:
        raise NvmeofError("with --nodes 2 the commands are --target-cmd and --host-cmd, not a trailing command",
                          "e.g. --target-cmd 'nvmeof-roce lab wait host.done' --host-cmd 'ibv_devinfo'")
    # By default the target node serves until the host node's command has ended.
    target_cmd = args.target_cmd or "nvmeof-roce lab wait host.done --timeout 86400"
    host_cmd = args.host_cmd or ("true" if not interactive else "")
    if not interactive and not args.host_cmd:
        raise NvmeofError("lab run --nodes 2: no --host-cmd given", "e.g. --host-cmd 'ibv_rc_pingpong -g 1 10.99.1.1'")
    env = {}
    for item in args.env or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise NvmeofError(f"--env {item!r}: expected NAME=VALUE", "e.g. --env RUNTIME=5")
        env[key] = value
    shell_node = (getattr(args, "node", None) or "host") if interactive else None
    specs = {"target": NodeSpec(["sh", "-c", target_cmd], interactive=shell_node == "target"),
             "host": NodeSpec(["sh", "-c", host_cmd], interactive=shell_node == "host")}
    if shell_node:
        specs[shell_node].command = []
    image = lab_image.build(force=False)
    modules, missing = run_modules(image, args.siw)
    cpus = args.cpus or 1
    with tempfile.TemporaryDirectory(prefix="nvmeof-lab-share-") as tmp_share:
        share = Path(args.share).resolve() if args.share else Path(tmp_share)
        base = LabRun(command=[], project=Path(args.project).resolve() if args.project else project_root(),
                      share=share, timeout=args.timeout, memory_mb=args.memory, cpus=cpus, kvm=args.kvm,
                      rxe=not args.no_rxe, env=env, modules=modules, missing_modules=missing, ceph=args.ceph)
        progress(f"lab: booting two guests ({'KVM' if args.kvm else 'TCG'}, {cpus} vCPU and {args.memory} MB each, "
                 f"timeout {args.timeout:.0f} s): target 10.99.1.1, host 10.99.1.2 on a virtual wire")
        started = time.monotonic()
        codes = run_two(image, base, specs)
    progress(f"lab: both guests finished in {time.monotonic() - started:.1f} s, "
             f"exit codes: target {codes['target']}, host {codes['host']}")
    return codes["host"] or codes["target"]


def cmd_signal(args) -> int:
    from .. import rendezvous
    rendezvous.signal(args.name, args.text or "")
    return 0


def cmd_wait(args) -> int:
    from .. import rendezvous
    text = rendezvous.wait(args.name, args.timeout)
    if text:
        print(text)
    return 0


def cmd_blktests(args) -> int:
    from . import blktests
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in blktests.MODES:
            raise NvmeofError(f"--modes: unknown mode {m!r}", "use kernel, ours or kernel,ours")
    if args.table_only:
        if not args.out:
            raise NvmeofError("--table-only needs --out DIR", "name the directory of an earlier run")
        return blktests.write_table(Path(args.out).resolve(), modes)
    out = Path(args.out) if args.out else project_root() / "results" / \
        f"blktests-{args.kernel}-{time.strftime('%Y%m%d-%H%M%S')}"
    return blktests.run(args.kernel, modes, args.tests, args.source, out.resolve(), args.timeout, args.memory)


def cmd_build(args) -> int:
    lab_image.build(force=args.force, kernel=args.kernel)
    return 0


def cmd_run(args) -> int:
    return _lab_run(args, interactive=False)


def cmd_shell(args) -> int:
    return _lab_run(args, interactive=True)


def _image_status(kernel: str) -> dict:
    image = lab_image.current_image(kernel)
    if image is None:
        return None
    manifest = image.manifest()
    status = {
        "path": str(image.directory),
        "key": manifest["key"],
        "built": manifest["built"],
        "age_hours": round((time.time() - image.manifest_path.stat().st_mtime) / 3600, 1),
        "kernel_release": manifest["kernel_release"],
        "disk_bytes": image.disk.stat().st_size,
        "inputs": manifest["inputs"],
    }
    try:
        status["up_to_date"] = lab_image.image_for(lab_image.image_inputs(kernel)).directory == image.directory
    except NvmeofError as exc:
        status["up_to_date"] = None
        status["inputs_error"] = exc.message
    return status


def cmd_status(args) -> int:
    root = lab_image.cache_root()
    kernels = [args.kernel] if args.kernel else list(aptconfig.GENERATIONS)
    # "image" stays the default kernel's image (what scripts read); "images" has every generation.
    images = {kernel: _image_status(kernel) for kernel in kernels}
    status = {"cache": str(root), "image": images.get(aptconfig.DEFAULT_KERNEL), "images": images}

    def human(s):
        print(f"cache: {s['cache']}")
        for kernel, img in s["images"].items():
            if img is None:
                print(f"image --kernel {kernel}: none built (run 'nvmeof-roce lab build --kernel {kernel}')")
                continue
            state = {True: "up to date",
                     False: f"STALE (inputs changed; 'nvmeof-roce lab build --kernel {kernel}' rebuilds)",
                     None: "unknown"}[img["up_to_date"]]
            print(f"image --kernel {kernel}: {img['key']} ({state})")
            print(f"  built:   {img['built']} (last used {img['age_hours']} h ago)")
            print(f"  kernel:  {img['kernel_release']} ({img['inputs']['kernel_package']})")
            print(f"  disk:    {img['disk_bytes'] / 2**20:.0f} MB  {img['path']}")
            print(f"  packages: {', '.join(img['inputs']['packages'])}")
            print(f"  python:   {', '.join(img['inputs']['python_requirements'])}")

    emit(status, args.json, human)
    return 0


def cmd_clean(args) -> int:
    root = lab_image.cache_root()
    target = root if args.all else root / "images"
    if target.exists():
        shutil.rmtree(target)
        progress(f"lab: removed {target}")
    return 0


def _add_kernel_option(p, default=aptconfig.DEFAULT_KERNEL) -> None:
    p.add_argument("--kernel", choices=list(aptconfig.GENERATIONS), default=default,
                   help=f"guest generation (default {default or 'all'}): 6.1 and 6.12 are Debian 12 (bookworm) "
                        "with those kernels (6.12 has NVMe in-band authentication, 6.1 does not); trixie is "
                        "Debian 13 with its 6.12 kernel, nvme-cli 2.13 and Python 3.13; unstable is Debian 13 "
                        "booting Debian unstable's newest kernel")


def _add_run_options(p) -> None:
    _add_kernel_option(p)
    p.add_argument("--share", metavar="DIR", help="host directory mounted read-write at /mnt/share in the guest")
    p.add_argument("--project", metavar="DIR", help="checkout mounted at /mnt/project (default: this one)")
    p.add_argument("--timeout", type=float, default=1800, help="hard limit in seconds; QEMU is killed after it (default 1800)")
    p.add_argument("--memory", type=memory_size, default=4096, metavar="SIZE",
                   help="guest memory: MiB, or with a unit like 2G or 1536M (default 4G)")
    p.add_argument("--cpus", type=cpu_count, default=None, metavar="N",
                   help=f"guest vCPUs, 1-{MAX_CPUS} (default 2; with --nodes 2: 1 per node; TCG runs them on the "
                        "host's cores, so more is slower)")
    p.add_argument("--kvm", action="store_true", help="use KVM instead of TCG emulation (hangs on some VMs)")
    p.add_argument("--no-rxe", action="store_true", help="do not bring up Soft-RoCE (rxe0)")
    p.add_argument("--siw", action="store_true", help="give the guest Soft-iWARP (siw.ko, built for the image's "
                   "kernel on first use and cached; 'nvmeof-roce rdma add-siw' then works in it)")
    p.add_argument("--env", action="append", metavar="NAME=VALUE", help="environment variable for the command")
    p.add_argument("--ceph", action="store_true", help="start a development Ceph cluster (one monitor, one memstore "
                   "OSD, pool 'rbd'; CEPH_CONF is set for the command) before the command; with --nodes 2, on the "
                   "target node's address")
    _add_two_node_options(p)


def _add_two_node_options(p) -> None:
    g = p.add_argument_group("two nodes", "two guests joined by a virtual wire (a QEMU datagram socket): target "
                             "10.99.1.1 and host 10.99.1.2, rxe0 on each eth0; rendezvous with "
                             "'nvmeof-roce lab signal|wait NAME' in the guests (docs/two-node.md)")
    g.add_argument("--nodes", type=int, default=1, choices=[1, 2], help="1 (default) or 2 guests")
    g.add_argument("--target-cmd", metavar="CMD", help="shell command on the target node (default: wait for the "
                   "host node's command to end)")
    g.add_argument("--host-cmd", metavar="CMD", help="shell command on the host node")


def register(subparsers) -> None:
    lab = subparsers.add_parser("lab", help="the QEMU lab: a Debian guest with Soft-RoCE and the NVMe-oF modules",
                                description="A QEMU guest with Debian's kernel, Soft-RoCE (rxe0 on rxenet0, "
                                "10.99.0.1/24), configfs and the NVMe-oF modules; the checkout is at /mnt/project.")
    sub = lab.add_subparsers(dest="lab_command", metavar="LAB_COMMAND")

    p = sub.add_parser("build", help="build (or reuse) the cached lab image")
    p.add_argument("--force", action="store_true", help="rebuild even if the cached image is up to date")
    _add_kernel_option(p)
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("run", help="boot the guest, run a command in /mnt/project, return its exit code",
                       usage="nvmeof-roce lab run [options] -- CMD [ARG ...]")
    _add_run_options(p)
    p.add_argument("command", nargs="...", help="command to run in the guest (after --)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("shell", help="boot the guest with an interactive shell (exit powers off)")
    _add_run_options(p)
    p.add_argument("--node", choices=["host", "target"], help="two nodes: the shell is on this one, the other "
                   "runs its --target-cmd/--host-cmd (default: wait)")
    p.set_defaults(func=cmd_shell, command=None)

    p = sub.add_parser("signal", help="in a two-node guest: create the rendezvous file NAME")
    p.add_argument("name", metavar="NAME")
    p.add_argument("text", metavar="TEXT", nargs="?", help="content (e.g. a port or a QP number)")
    p.set_defaults(func=cmd_signal)

    p = sub.add_parser("wait", help="in a two-node guest: wait for the rendezvous file NAME, print its content")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--timeout", type=float, default=300, help="seconds (default 300)")
    p.set_defaults(func=cmd_wait)

    p = sub.add_parser("status", help="what is cached, its inputs, its age")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _add_kernel_option(p, default=None)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("blktests", help="blktests' nvme group against kernel nvmet and the userspace target, "
                       "side by side (one boot; docs/conformance.md)",
                       description="Boot the lab once and run blktests' nvme group (a pinned upstream revision, "
                       "kept in the lab's cache) against kernel nvmet over rxe and against the userspace target "
                       "through its NVME_TARGET_CONTROL script; write OUT/table.md and OUT/table.json. Exit 1 if "
                       "a test passes on nvmet and not on ours without a documented reason.")
    _add_kernel_option(p)
    p.add_argument("--source", metavar="DIR", help="a git directory or checkout of linux-blktests/blktests, to "
                   "seed the cache once (not needed when it is cached)")
    p.add_argument("--modes", default="kernel,ours", help="kernel, ours or both (default kernel,ours)")
    p.add_argument("--out", metavar="DIR", help="results directory (default results/blktests-KERNEL-TIMESTAMP)")
    p.add_argument("--timeout", type=float, default=3600, help="hard limit in seconds for the boot (default 3600)")
    p.add_argument("--memory", type=memory_size, default=4096, metavar="SIZE", help="guest memory (default 4G)")
    p.add_argument("--table-only", action="store_true", help="no boot: the table again from --out DIR's logs "
                   "(a run cut short, or modes run in separate boots)")
    p.add_argument("tests", nargs="*", default=["nvme"], help="blktests' tests or groups (default: nvme)")
    p.set_defaults(func=cmd_blktests)

    p = sub.add_parser("clean", help="remove cached lab images (--all: also the downloaded packages)")
    p.add_argument("--all", action="store_true")
    p.set_defaults(func=cmd_clean)

    ceph_commands.register(sub)
    lab.set_defaults(func=lambda args: (lab.print_help(), 2)[1])
    register_demo(subparsers)


def cmd_demo(args) -> int:
    """The main job: on the host, boot the lab and run the demo inside it; in the lab, run it."""
    from . import demo
    if args.in_guest:
        return demo.run_in_guest(args.out, args.runtime)
    return demo.run_on_host(project_root(), args.runtime, args.timeout)


def register_demo(subparsers) -> None:
    p = subparsers.add_parser("demo", help="the main job: kernel and userspace targets side by side in the lab",
                              description="Boot the lab, serve targets/demo.json with the userspace target and the "
                                          "same namespace with the kernel's nvmet-rdma, run a short benchmark of "
                                          "both, print the table and write JSON and PNGs under results/.")
    p.add_argument("--runtime", type=int, default=5, help="seconds per fio job (default 5)")
    p.add_argument("--timeout", type=float, default=900, help="lab timeout in seconds (default 900)")
    p.add_argument("--in-guest", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="/mnt/share", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_demo)
