"""`nvmeof-roce lab build | run | shell | status | clean`."""
from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from ..errors import NvmeofError
from ..output import emit, progress
from . import aptconfig
from . import image as lab_image
from .vm import LabRun, run_in_guest


def project_root() -> Path:
    """The checkout that holds this package (mounted at /mnt/project in the guest)."""
    return Path(__file__).resolve().parents[2]


def _lab_run(args, interactive: bool) -> int:
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
    run = LabRun(command=command, project=Path(args.project).resolve() if args.project else project_root(),
                 share=Path(args.share).resolve() if args.share else None, timeout=args.timeout,
                 memory_mb=args.memory, cpus=args.cpus, kvm=args.kvm, interactive=interactive,
                 rxe=not args.no_rxe, env=env)
    progress(f"lab: booting guest ({'KVM' if args.kvm else 'TCG'}, {args.cpus} vCPU, {args.memory} MB, "
             f"timeout {args.timeout:.0f} s)" + (f": {' '.join(command)}" if command else ""))
    started = time.monotonic()
    code = run_in_guest(image, run)
    progress(f"lab: guest finished in {time.monotonic() - started:.1f} s, exit code {code}")
    return code


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
    kernels = [args.kernel] if args.kernel else list(aptconfig.KERNEL_META_PACKAGES)
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
    p.add_argument("--kernel", choices=list(aptconfig.KERNEL_META_PACKAGES), default=default,
                   help=f"Debian kernel generation of the guest (default {default or 'all'}; 6.12 has NVMe "
                        "in-band authentication, 6.1 does not)")


def _add_run_options(p) -> None:
    _add_kernel_option(p)
    p.add_argument("--share", metavar="DIR", help="host directory mounted read-write at /mnt/share in the guest")
    p.add_argument("--project", metavar="DIR", help="checkout mounted at /mnt/project (default: this one)")
    p.add_argument("--timeout", type=float, default=1800, help="hard limit in seconds; QEMU is killed after it (default 1800)")
    p.add_argument("--memory", type=int, default=4096, metavar="MB", help="guest memory (default 4096)")
    p.add_argument("--cpus", type=int, default=2, help="guest vCPUs (default 2)")
    p.add_argument("--kvm", action="store_true", help="use KVM instead of TCG emulation (hangs on some VMs)")
    p.add_argument("--no-rxe", action="store_true", help="do not bring up Soft-RoCE (rxe0)")
    p.add_argument("--env", action="append", metavar="NAME=VALUE", help="environment variable for the command")


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
    p.set_defaults(func=cmd_shell, command=None)

    p = sub.add_parser("status", help="what is cached, its inputs, its age")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _add_kernel_option(p, default=None)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("clean", help="remove cached lab images (--all: also the downloaded packages)")
    p.add_argument("--all", action="store_true")
    p.set_defaults(func=cmd_clean)

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
