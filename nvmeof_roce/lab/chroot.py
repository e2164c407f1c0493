"""The unit tier on a lab image's Python without booting a guest (`make test-unit-py313`: Debian 13's 3.13).

The image's root disk is loop-mounted read-only under an overlay (the image stays as it was), /proc, /sys,
/dev and a /tmp of its own are mounted inside, this checkout's files (`git ls-files`, uncommitted ones
included) are copied to /src, and the command runs there under `chroot`.  The default command builds the native
module for that Python (`build_ext --inplace`), writes the package's metadata (`egg_info`: the lab's own tests
read the project's requirements from it, as the venv's editable install gives them on the host) and runs
`python3 -m pytest -m "not lab" tests/unit`.  The rootfs has the compiler, the -dev packages and the pinned
test dependencies the trixie guest builds with (image.py TRIXIE_BUILD_PACKAGES, python_requirements).
Everything is unmounted and removed afterwards.

    python -m nvmeof_roce.lab.chroot [--kernel trixie] [-- COMMAND...]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator, List

from ..errors import NvmeofError
from ..output import progress
from . import aptconfig
from . import image as lab_image

CHECKOUT = Path(__file__).resolve().parents[2]
UNIT_TIER = ('python3 setup.py -q build_ext --inplace && python3 setup.py -q egg_info && '
             'python3 -m pytest -p no:cacheprovider -rs --durations=12 -m "not lab" tests/unit')


def _mount(args: List[str]) -> None:
    try:
        subprocess.run(["mount", *args], check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as exc:
        raise NvmeofError(f"mount {' '.join(args)} failed: {exc.stderr.strip()}",
                          "the chroot needs root, loop devices and overlayfs")


def _copy_checkout(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=CHECKOUT,
                           check=True, capture_output=True).stdout
    tar = subprocess.run(["tar", "--null", "-T", "-", "-cf", "-"], cwd=CHECKOUT, input=files, check=True,
                         capture_output=True).stdout
    subprocess.run(["tar", "-xf", "-", "-C", str(dest)], input=tar, check=True)


@contextlib.contextmanager
def image_root(image: lab_image.LabImage) -> Iterator[Path]:
    """A writable root of `image` for chroot: its disk loop-mounted read-only under an overlay (the image
    stays as it was), with /proc, /sys, /dev and a /tmp of its own; unmounted and removed on exit."""
    if os.geteuid() != 0:
        raise NvmeofError("the chroot needs root (mount, chroot)", "run it as root or with sudo")
    work = Path(tempfile.mkdtemp(prefix="nvmeof-roce-chroot-", dir="/var/tmp"))
    lower, upper, scratch, root = (work / name for name in ("lower", "upper", "scratch", "root"))
    for d in (lower, upper, scratch, root):
        d.mkdir()
    mounted: List[Path] = []
    try:
        _mount(["-o", "loop,ro", str(image.disk), str(lower)])
        mounted.append(lower)
        _mount(["-t", "overlay", "overlay", "-o", f"lowerdir={lower},upperdir={upper},workdir={scratch}", str(root)])
        mounted.append(root)
        _mount(["-t", "proc", "proc", str(root / "proc")])
        for fs in ("sys", "dev"):
            _mount(["--rbind", f"/{fs}", str(root / fs)])
            _mount(["--make-rslave", str(root / fs)])
        _mount(["-t", "tmpfs", "tmpfs", str(root / "tmp")])
        yield root
    finally:
        for point in reversed(mounted):
            subprocess.run(["umount", "-R", str(point)], check=False)
        if any(os.path.ismount(p) for p in (lower, root, root / "dev", root / "sys", root / "proc")):
            progress(f"lab chroot: {work} is still mounted; left in place")  # never remove through a bind of /dev
        else:
            subprocess.run(["rm", "-rf", "--one-file-system", str(work)], check=False)


def in_chroot(root: Path, command: str, **kw) -> subprocess.CompletedProcess:
    """`command` (a shell line) in /src of `root` under chroot, with a plain root environment."""
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
           "LANG": "C.UTF-8", "PYTHONPATH": "/src"}
    return subprocess.run(["chroot", str(root), "sh", "-c", f"cd /src && {command}"], env=env, **kw)


def run(kernel: str, command: str) -> int:
    """`command` (a shell line) in /src of a chroot of the `kernel` generation's image; its exit code."""
    image = lab_image.build(kernel=kernel)  # a no-op when the image of these inputs is there
    with image_root(image) as root:
        (root / "src").mkdir()
        _copy_checkout(root / "src")
        progress(f"lab chroot: {image.directory.name} ({kernel}): {command}")
        return in_chroot(root, command).returncode


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m nvmeof_roce.lab.chroot", description=__doc__.split("\n")[0])
    parser.add_argument("--kernel", default="trixie", choices=sorted(aptconfig.GENERATIONS))
    parser.add_argument("command", nargs="*", help=f"default: {UNIT_TIER}")
    args = parser.parse_args(argv)
    try:
        return run(args.kernel, shlex.join(args.command) if args.command else UNIT_TIER)
    except NvmeofError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
