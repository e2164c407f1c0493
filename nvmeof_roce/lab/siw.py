"""Soft-iWARP (siw) for the lab: Debian's 6.1 and 6.12 kernels are built without CONFIG_RDMA_SIW, so the lab
builds `siw.ko` out of tree for the exact kernel of the image.

Inputs, all Debian packages of the same kernel build, taken with `apt-get download` from the machine's own apt
sources: `linux-headers-RELEASE` (the kernel's .config and Module.symvers), its `-common` headers, the
`linux-kbuild-*` tools, and `linux-source-X.Y` at the kernel's version (only `drivers/infiniband/sw/siw/` is
unpacked from it). The module is compiled with the host's gcc (Debian 12's gcc 12, the compiler these kernels
were built with); a trixie guest's kernel (built with gcc 14, and its kbuild tools linked against trixie's
libc) is compiled inside the trixie rootfs with `chroot`, with the compiler that image carries. It is cached per kernel release under the lab cache (`siw/RELEASE/siw.ko`); the image build
copies it to `/lib/modules/RELEASE/extra/` before `depmod`. It is unsigned: the kernel loads it and marks
itself tainted (`module.sig_enforce` is off in the lab).
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Optional

from ..errors import NvmeofError
from ..output import progress

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


def package_version(package: str, apt: Optional[List[str]] = None) -> str:
    """The candidate version apt would download of `package` (the one the lab's kernel image comes in)."""
    out = _run(["apt-cache", *(apt or []), "show", "--no-all-versions", package], f"apt-cache show {package}")
    m = re.search(r"^Version:\s*(\S+)", out, re.M)
    if not m:
        raise NvmeofError(f"apt knows no version of {package}", "run 'apt-get update'")
    return m.group(1)


def build_inputs(kernel_package: str, apt: Optional[List[str]] = None) -> Dict[str, str]:
    """The packages (name -> version) that siw.ko for this kernel image is built from.

    linux-image-6.1.0-56-amd64 6.1.192-2 -> linux-headers-6.1.0-56-amd64, linux-headers-6.1.0-56-common,
    linux-kbuild-6.1 (as the headers package depends on it) and linux-source-6.1, all at 6.1.192-2."""
    release = kernel_package[len("linux-image-"):]
    version = package_version(kernel_package, apt)
    headers = f"linux-headers-{release}"
    depends = _run(["apt-cache", *(apt or []), "show", "--no-all-versions", headers], f"apt-cache show {headers}")
    line = re.search(r"^Depends:(.*)$", depends, re.M)
    needed = {headers: version}
    for dep in (line.group(1).split(",") if line else []):
        name = dep.split("(")[0].strip().split("|")[0].strip()
        if name.startswith(("linux-headers-", "linux-kbuild-")):
            needed[name] = version
    generation = ".".join(version.split(".")[:2])  # 6.1.192-2 -> 6.1
    needed[f"linux-source-{generation}"] = version
    return needed


def module_path(cache: Path, release: str) -> Path:
    return cache / "siw" / release / "siw.ko"


def build_module(kernel_package: str, cache: Path, debs: Path, work: Path, apt: Optional[List[str]] = None,
                 chroot: Optional[Path] = None) -> Path:
    """siw.ko for `kernel_package`, from the cache or built now (about 10 s of compiling after the downloads).
    `apt`: options selecting the kernel's suite (aptconfig.apt_options); `chroot`: a rootfs with the compiler
    the kernel was built with, to compile in (the host's own gcc otherwise)."""
    release = kernel_package[len("linux-image-"):]
    out = module_path(cache, release)
    if out.exists():
        return out
    packages = build_inputs(kernel_package, apt)
    progress(f"lab build: siw.ko for {release} (out of tree: {', '.join(sorted(packages))})")
    if chroot is not None:  # the tree must be inside the rootfs: paths below are the chroot's
        work = chroot / "tmp"
    root = work / "siw-root"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for name, version in packages.items():
        found = sorted(debs.glob(f"{name}_{version.replace(':', '%3a')}_*.deb"))
        if not found:
            _run(["apt-get", *(apt or []), "download", "-q", f"{name}={version}"], f"apt-get download {name}={version}",
                 cwd=debs)
            found = sorted(debs.glob(f"{name}_*.deb"))
        if not found:
            raise NvmeofError(f"apt-get download {name}={version} left no .deb in {debs}", "run 'apt-get update'")
        _run(["dpkg-deb", "-x", str(found[-1]), str(root)], f"dpkg-deb -x {found[-1].name}")
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
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(src, ignore_errors=True)
    return out
