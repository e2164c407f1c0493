"""Soft-iWARP (siw) for the lab, built when a run asks for it (`lab run --siw`, `lab shell --siw`,
`make test-extended`): Debian's 6.1 and 6.12 kernels are built without CONFIG_RDMA_SIW, so `siw.ko` is
compiled out of tree for the exact kernel of an image.  It is not part of the image: an image builds and boots
whether or not siw's inputs can be had today.

Inputs (aptresolve.siw_plan), Debian packages resolved by the relations they state, taken with `apt-get
download` from the machine's own apt sources: `linux-headers-RELEASE` at the image's version (the kernel's
.config and Module.symvers), the `-common` headers and `linux-kbuild-*` tools it depends on, at the versions
its Depends accept, and `linux-source-X.Y` (only `drivers/infiniband/sw/siw/` is unpacked from it).  The module
is compiled with the host's gcc (Debian 12's gcc 12, the compiler these kernels were built with); a trixie
kernel (built with gcc 14, its kbuild tools linked against trixie's libc) is compiled in a chroot of the trixie
image (lab/chroot.py), with the compiler that image carries; unstable's kernel needs a compiler no lab rootfs
has, so there is no siw for it.  The module is cached per kernel release under the lab cache
(`siw/RELEASE/siw.ko`, its inputs in `siw.json` beside it); a run that asks for it gets it through its control
share, and the guest's init installs it under `/lib/modules/RELEASE/extra/` before `depmod`.  It is unsigned:
the kernel loads it and marks itself tainted (`module.sig_enforce` is off in the lab).
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import List, Optional

from ..errors import NvmeofError
from ..output import progress
from . import aptconfig, chroot as lab_chroot
from . import image as lab_image
from .aptresolve import AptArchive, KernelPlan, siw_plan
from .cache import cache_root

SIW_SOURCE_DIR = "drivers/infiniband/sw/siw"


def _run(args: List[str], what: str, **kw) -> str:
    try:
        return subprocess.run(args, check=True, capture_output=True, text=True, **kw).stdout
    except FileNotFoundError:
        raise NvmeofError(f"{what}: {args[0]} not found", "apt-get install gcc make (the lab builds siw.ko on the host)")
    except subprocess.CalledProcessError as exc:
        tail = "\n".join((exc.stderr or exc.stdout or "").strip().splitlines()[-15:])
        raise NvmeofError(f"{what} failed (exit {exc.returncode}):\n{tail}",
                          "check the machine's apt sources (the kernel's headers and source must be downloadable)")


def module_path(cache: Path, release: str) -> Path:
    return cache / "siw" / release / "siw.ko"


def build_module(kernel: KernelPlan, cache: Path, debs: Path, work: Path, apt: Optional[List[str]] = None,
                 chroot: Optional[Path] = None) -> Path:
    """siw.ko for `kernel`, from the cache or built now (about 10 s of compiling after the downloads).
    `apt`: options selecting the kernel's suite (aptconfig.apt_options); `chroot`: a rootfs with the compiler
    the kernel was built with, to compile in (the host's own gcc otherwise).  InputUnavailable when the
    archive lacks an input at every version its relation accepts."""
    release = kernel.release
    out = module_path(cache, release)
    if out.exists():
        return out
    plan = siw_plan(kernel, AptArchive(apt))
    packages = plan.inputs
    progress(f"lab: siw.ko for {release} (out of tree: "
             f"{', '.join(f'{name} {version}' for name, version in sorted(packages.items()))})")
    for note in plan.notes:
        progress(f"lab: siw.ko: {note}")
    if chroot is not None:  # the tree must be inside the rootfs: paths below are the chroot's
        work = chroot / "tmp"
    root = work / "siw-root"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for name, version in packages.items():
        deb = lab_image.download(name, version, debs, apt or [])
        _run(["dpkg-deb", "-x", str(deb), str(root)], f"dpkg-deb -x {deb.name}")
    headers = root / "usr/src" / f"linux-headers-{release}"
    # The flavour's Makefile includes the -common tree by its installed path; point it into our unpacked root.
    makefile = headers / "Makefile"
    inside = Path("/") / root.relative_to(chroot) if chroot is not None else root
    makefile.write_text(makefile.read_text().replace("/usr/src/", f"{inside}/usr/src/"))
    source = next(iter(sorted((root / "usr/src").glob("linux-source-*.tar.*"))), None)
    if source is None:
        raise NvmeofError(f"linux-source for {release}: no source tarball in the package", "run 'apt-get update'")
    src = work / "siw-src"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir()
    # linux-source-6.1/drivers/infiniband/sw/siw/FILE: five components to strip
    _run(["tar", "-xf", str(source), "-C", str(src), "--wildcards", f"*/{SIW_SOURCE_DIR}/*",
          f"--strip-components={SIW_SOURCE_DIR.count('/') + 2}"], f"unpack {SIW_SOURCE_DIR} from {source.name}")
    if not (src / "Makefile").exists():
        raise NvmeofError(f"{source.name} has no {SIW_SOURCE_DIR}", "the lab expects Debian's linux-source")
    # No BTF for an out-of-tree module: it needs pahole and the vmlinux with its debug info, which the lab lacks.
    make = ["make", "-C", str(headers), f"M={src}", "CONFIG_RDMA_SIW=m", "CONFIG_DEBUG_INFO_BTF_MODULES=", "modules"]
    if chroot is not None:
        make = ["chroot", str(chroot), "make", "-C", str(Path("/") / headers.relative_to(chroot)),
                f"M={Path('/') / src.relative_to(chroot)}", *make[4:]]
    _run(make, f"make siw.ko for {release}")
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src / "siw.ko", out)
    (out.parent / "siw.json").write_text(json.dumps({"inputs": packages, "notes": plan.notes}, indent=2) + "\n")
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(src, ignore_errors=True)
    return out


def for_image(image: "lab_image.LabImage") -> Path:
    """siw.ko for the kernel `image` boots, from the cache or built now.  NvmeofError saying why where it
    cannot be had (an input gone from the archive, no compiler for that kernel in the lab)."""
    kernel = lab_image.kernel_plan_of(image)
    cached = module_path(cache_root(), kernel.release)
    if cached.exists():
        return cached
    suite, kernel_suite = image.suites()
    if kernel_suite != suite:  # unstable's kernel is built with a newer gcc than the trixie rootfs has
        raise NvmeofError(f"no siw.ko for {kernel.release}: the compiler its kernel was built with is not in the "
                          f"{suite} rootfs", "use --kernel 6.1, 6.12 or trixie for iWARP")
    root = cache_root()
    debs = root / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    apt = aptconfig.apt_options(kernel_suite)
    if suite == aptconfig.GUEST_SUITE:
        work = root / "siw-work"
        work.mkdir(parents=True, exist_ok=True)
        try:
            return build_module(kernel, root, debs, work, apt=apt)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    with lab_chroot.image_root(image) as rootfs:
        return build_module(kernel, root, debs, rootfs / "tmp", apt=apt, chroot=rootfs)
