"""The native module (`nvmeof_roce._native`) for a guest whose Python is not the host's.

The bookworm guests (`--kernel 6.1`, `6.12`) run Python 3.11, as the host's venv does: the module the host
builds in place (`make venv`: `_native.cpython-311-x86_64-linux-gnu.so`) is the one they import.  The Debian 13
guests (`--kernel trixie`, `unstable`) run Python 3.13, which needs a build of its own, with the image's gcc and
-dev packages.  Before such a guest boots, `ensure` builds it once in a chroot of the image's root disk
(lab/chroot.py: read-only under an overlay, no guest boot, the host's own CPU) and caches it under
`LAB_CACHE/native/IMAGE_KEY/SOURCE_HASH/`, the source hash covering csrc/*.c, csrc/*.h and setup.py.  The
cached module is then copied into the mounted checkout as `nvmeof_roce/_native.cpython-313-x86_64-linux-gnu.so`,
beside the host's 3.11 one (the ABI tags keep them apart; .gitignore covers *.so), where the guest's Python
imports it.  A later boot with the same image and sources builds nothing.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import time
from pathlib import Path
from typing import Callable, List, Optional

from ..errors import NvmeofError
from ..output import progress
from . import aptconfig
from .cache import cache_root
from .image import LabImage, image_kernel

SOURCE_PATTERNS = ("csrc/*.c", "csrc/*.h", "setup.py")  # what the module is built from (besides the image)
BUILD_COMMAND = "python3 setup.py -q build_ext --inplace && python3 -c 'import nvmeof_roce._native'"
KEEP_PER_IMAGE = 3  # source versions kept per image (a branch switch back and forth builds nothing)


def guest_python(image: LabImage) -> Optional[str]:
    """The guest's Python version where it differs from the bookworm guests' (whose module the host builds);
    None for a bookworm image."""
    if image.suites()[0] == aptconfig.GUEST_SUITE:
        return None
    return str(image.inputs().get("python") or "") or None


def module_name(python: str) -> str:
    """3.13 -> _native.cpython-313-x86_64-linux-gnu.so (the name that guest's Python imports)."""
    return f"_native.cpython-{python.replace('.', '')}-x86_64-linux-gnu.so"


def source_files(project: Path) -> List[Path]:
    return sorted({p for pattern in SOURCE_PATTERNS for p in project.glob(pattern) if p.is_file()})


def source_hash(project: Path) -> str:
    """A hash of the module's sources: their paths and contents (not their times)."""
    digest = hashlib.sha256()
    for path in source_files(project):
        digest.update(str(path.relative_to(project)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


def cache_dir() -> Path:
    return cache_root() / "native"


def cached_module(image: LabImage, digest: str, python: str) -> Path:
    return cache_dir() / image.directory.name / digest / module_name(python)


def _copy_sources(project: Path, dest: Path) -> None:
    """What setup.py needs to build the extension in place: itself, pyproject.toml (and the README it names),
    csrc/ and the package's Python files (no built modules)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("setup.py", "pyproject.toml", "README.md", "MANIFEST.in"):
        if (project / name).is_file():
            shutil.copy2(project / name, dest / name)
    shutil.copytree(project / "csrc", dest / "csrc")
    shutil.copytree(project / "nvmeof_roce", dest / "nvmeof_roce",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__", "*.pyc", "*.tmp"))


def build_in_chroot(image: LabImage, project: Path, out: Path) -> None:
    """Build the module in a chroot of `image`'s root disk; write it to `out` (its log beside it)."""
    from . import chroot
    log = out.parent / "build.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    with chroot.image_root(image) as root:
        src = root / "src"
        _copy_sources(project, src)
        run = chroot.in_chroot(root, BUILD_COMMAND, capture_output=True, text=True)
        log.write_text(f"$ {BUILD_COMMAND}\n{run.stdout}{run.stderr}exit {run.returncode}\n")
        built = src / "nvmeof_roce" / out.name
        if run.returncode != 0 or not built.exists():
            tail = "\n".join((run.stderr or run.stdout or "").strip().splitlines()[-12:])
            kernel = image_kernel(image)
            raise NvmeofError(f"building the native module for the guest's Python failed (exit {run.returncode}; "
                              f"{log}):\n{tail}", f"fix the build (the same error shows in 'python -m "
                              f"nvmeof_roce.lab.chroot --kernel {kernel}'), or rebuild the image: nvmeof-roce lab "
                              f"build --force --kernel {kernel}")
        tmp = out.with_name(out.name + ".tmp")
        shutil.copy2(built, tmp)
        os.replace(tmp, out)


def _prune(image_dir: Path, keep: Path) -> None:
    """Drop the module builds of images no longer in the cache, and all but the newest KEEP_PER_IMAGE source
    versions of this image."""
    images = cache_root() / "images"
    for other in cache_dir().iterdir():
        if other.is_dir() and other != image_dir and not (images / other.name).exists():
            shutil.rmtree(other, ignore_errors=True)
    versions = sorted((d for d in image_dir.iterdir() if d.is_dir() and d != keep),
                      key=lambda d: d.stat().st_mtime, reverse=True)
    for old in versions[KEEP_PER_IMAGE - 1:]:
        shutil.rmtree(old, ignore_errors=True)


def _same(a: Path, b: Path) -> bool:
    return a.exists() and b.exists() and a.stat().st_size == b.stat().st_size and a.read_bytes() == b.read_bytes()


def ensure(image: LabImage, project: Path,
           build: Callable[[LabImage, Path, Path], None] = build_in_chroot) -> Optional[Path]:
    """Make `project`'s checkout carry the native module for `image`'s Python, built once per (image, sources)
    and cached; return its path in the checkout, or None where the guest's Python is the host's (bookworm) or
    `project` is not a checkout with the module's sources.  A failed build raises NvmeofError."""
    python = guest_python(image)
    if python is None:
        return None
    if not (project / "setup.py").is_file() or not list(project.glob("csrc/*.c")):
        progress(f"lab: {project} has no setup.py and csrc/: no native module for the guest's Python {python}")
        return None
    digest = source_hash(project)
    cached = cached_module(image, digest, python)
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two lab commands at once build it once
        if not cached.exists():
            progress(f"lab: building the native module for the guest's Python {python} (image "
                     f"{image.directory.name}, sources {digest}: csrc/, setup.py) in a chroot of the image; "
                     f"once per image and sources, seconds")
            started = time.monotonic()
            build(image, project, cached)
            progress(f"lab: native module for Python {python} built in {time.monotonic() - started:.0f} s, "
                     f"cached in {cached.parent}")
            _prune(cached.parent.parent, keep=cached.parent)
        else:
            os.utime(cached.parent)  # newest first when pruning
    dest = project / "nvmeof_roce" / cached.name
    if not _same(cached, dest):
        tmp = dest.with_name(dest.name + ".tmp")
        try:
            shutil.copy2(cached, tmp)
            os.replace(tmp, dest)
        except OSError as exc:
            raise NvmeofError(f"cannot put the guest's native module into {dest}: {exc}",
                              "mount a writable checkout (--project DIR)") from None
        progress(f"lab: {dest.relative_to(project)} (Python {python}) from the cache, sources {digest}")
    return dest
