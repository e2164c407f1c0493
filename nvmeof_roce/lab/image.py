"""Build the lab image: Debian's kernel, a Debian rootfs (bookworm, or trixie), a small initramfs, an ext4 disk.

Everything is cached under the user's cache directory and keyed by its inputs
(package list, kernel package, the guest-side files, the pinned Python
dependencies), so a second `lab build` is a no-op and a change to any input
builds a new image.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..errors import NvmeofError, ToolMissing
from ..output import progress
from . import aptconfig, aptresolve
from .cache import cache_root

BUILD_FORMAT = 3  # bump when the build steps change in a way the inputs don't show

GUEST_PACKAGES = [
    "kmod", "iproute2", "rdma-core", "ibverbs-utils", "ibverbs-providers", "rdmacm-utils", "perftest",
    "nvme-cli", "fio", "python3", "python3-pyverbs", "util-linux", "procps", "busybox-static",
    "e2fsprogs", "bash", "less", "strace", "ethtool", "nftables", "iptables", "tcpdump",
]

# Ceph for RBD namespaces in the bookworm guests: the development cluster (`lab run --ceph`, ceph/devcluster.py)
# and librbd's Python binding for the reference path (fio's rbd engine comes with fio's own librbd1).  Not in the
# trixie guests yet: trixie's Ceph pulls in systemd, which debootstrap's first pass cannot set up there (systemd's
# pre-dependency libsystemd-shared is unpacked, not configured), so those images carry no Ceph and the RBD lab
# tests skip there, saying so.
CEPH_PACKAGES = ["ceph-mon", "ceph-osd", "ceph-common", "python3-rbd", "python3-rados"]

# The trixie guest also builds the native extension and the wheel with its own compiler, headers and pip
# (Python 3.13; `pip wheel --no-build-isolation`, the guest has no network); siw.ko for its kernel is compiled
# in a chroot of this rootfs (the kernel was built with trixie's gcc 14; lab/siw.py).
TRIXIE_BUILD_PACKAGES = ["gcc", "make", "libc6-dev", "python3-dev", "python3-setuptools", "python3-pip",
                         "libibverbs-dev", "librdmacm-dev", "liburing-dev"]

# Kernel module trees the guest never needs (keeps the image ~500 MB).
DROPPED_MODULE_DIRS = [
    "kernel/drivers/gpu", "kernel/drivers/media", "kernel/sound", "kernel/drivers/net/wireless",
    "kernel/drivers/usb", "kernel/drivers/bluetooth", "kernel/net/bluetooth", "kernel/drivers/staging",
    "kernel/drivers/iio", "kernel/drivers/hid", "kernel/drivers/input", "kernel/drivers/isdn",
    "kernel/net/mac80211", "kernel/net/wireless", "kernel/drivers/net/can", "kernel/drivers/video",
    "kernel/drivers/platform", "kernel/drivers/hwmon", "kernel/drivers/mmc", "kernel/drivers/thunderbolt",
]

# What the initramfs loads to reach the root disk and the 9p shares.
INITRAMFS_MODULES = ["virtio_pci", "virtio_blk", "ext4", "9pnet_virtio", "9p"]

GUEST_DIR = Path(__file__).with_name("guest")


@dataclass
class LabImage:
    """A built image: kernel, initramfs and root disk, with the inputs it was built from."""

    directory: Path

    @property
    def kernel(self) -> Path:
        return self.directory / "vmlinux"

    @property
    def initrd(self) -> Path:
        return self.directory / "initrd.img"

    @property
    def disk(self) -> Path:
        return self.directory / "rootfs.ext4"

    @property
    def manifest_path(self) -> Path:
        return self.directory / "manifest.json"

    def manifest(self) -> dict:
        return json.loads(self.manifest_path.read_text())

    def inputs(self) -> dict:
        """The inputs it was built from (image_inputs), as its manifest records them."""
        return self.manifest().get("inputs") or {}

    def suites(self) -> Tuple[str, str]:
        """(the guest's Debian suite, the suite its kernel came from): bookworm for both in the 6.1 and 6.12
        images, ("trixie", "sid") in the unstable one."""
        inputs = self.inputs()
        suite = str(inputs.get("suite") or aptconfig.GUEST_SUITE)
        return suite, str(inputs.get("kernel_suite") or suite)

    def complete(self) -> bool:
        return self.manifest_path.exists() and all(p.exists() for p in (self.kernel, self.initrd, self.disk))


CONSTRAINTS = Path(__file__).resolve().parents[2] / "constraints.txt"  # the checkout's exact versions


def python_requirements() -> List[str]:
    """The project's runtime + dev dependencies, each at the exact version of constraints.txt (the same the
    host venv has)."""
    try:
        reqs = metadata.requires("nvmeof-roce") or []
    except metadata.PackageNotFoundError:
        raise NvmeofError("the nvmeof-roce package is not installed", "run 'make venv' (pip install -e '.[dev]')")
    pins = {}
    if CONSTRAINTS.exists():
        for line in CONSTRAINTS.read_text().splitlines():
            name, sep, version = line.split("#", 1)[0].strip().partition("==")
            if sep:
                pins[re.sub(r"[-_.]+", "-", name.strip()).lower()] = version.strip()
    keep = []
    for req in reqs:
        spec, _, marker = req.partition(";")
        if not marker or re.search(r"extra\s*==\s*['\"]dev['\"]", marker):
            name = re.match(r"[A-Za-z0-9_.-]+", spec.strip()).group(0)
            version = pins.get(re.sub(r"[-_.]+", "-", name).lower())
            keep.append(f"{name}=={version}" if version else spec.strip().replace(" ", ""))
    return sorted(keep)


def guest_packages(suite: str) -> List[str]:
    return sorted(GUEST_PACKAGES + (TRIXIE_BUILD_PACKAGES if suite != aptconfig.GUEST_SUITE else CEPH_PACKAGES))


def image_inputs(kernel: str = aptconfig.DEFAULT_KERNEL) -> Dict[str, object]:
    # The kernel generation shows in the bookworm inputs only through its package, so the 6.1 and 6.12 images
    # differ by it; the other generations add their suites and Python.  `kernel_parts` holds the versions the
    # archive resolves today (aptresolve), so a new upload of the kernel builds a new image.
    gen = aptconfig.generation(kernel)
    plan = aptconfig.resolve_kernel(kernel)
    guest_files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(GUEST_DIR.iterdir())}
    inputs = {
        "format": BUILD_FORMAT,
        "suite": gen.suite,
        "kernel_package": plan.package,
        "kernel_parts": dict(plan.parts),
        "packages": guest_packages(gen.suite),
        "python_requirements": python_requirements(),
        "guest_files": guest_files,
    }
    if gen.suite != aptconfig.GUEST_SUITE:
        inputs.update(kernel_suite=gen.kernel_suite, python=gen.python)
    return inputs


def kernel_plan_of(image: "LabImage") -> aptresolve.KernelPlan:
    """The kernel an image was built from (its manifest), as a plan siw.ko can be resolved against."""
    inputs = image.inputs()
    package = str(inputs.get("kernel_package", ""))
    parts = dict(inputs.get("kernel_parts") or {})
    if package not in parts:
        raise NvmeofError(f"image {image.directory.name} does not record its kernel's version",
                          "rebuild it: nvmeof-roce lab build --force")
    return aptresolve.KernelPlan(meta="", package=package, version=parts[package], parts=parts)


def inputs_key(inputs: Dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def image_kernel(image: LabImage) -> str:
    """The --kernel generation an image was built with (6.1, 6.12, trixie, unstable)."""
    suite, kernel_suite = image.suites()
    if suite == aptconfig.GUEST_SUITE:
        return aptconfig.kernel_generation(image.manifest().get("kernel_release", ""))
    for gen in aptconfig.GENERATIONS.values():
        if gen.suite == suite and gen.kernel_suite == kernel_suite:
            return gen.name
    return suite


def current_image(kernel: Optional[str] = None) -> Optional[LabImage]:
    """For `lab status`: the image this checkout's inputs select, if it is built; else the newest complete image
    (of one kernel generation if given), whatever its inputs."""
    try:
        wanted = image_for(image_inputs(kernel or aptconfig.DEFAULT_KERNEL))
        if wanted.complete():
            return wanted
    except NvmeofError:
        pass  # inputs unknown (no apt lists yet): fall back to the newest image
    images = sorted((cache_root() / "images").glob("*/manifest.json"), key=lambda p: p.stat().st_mtime)
    for manifest in reversed(images):
        image = LabImage(manifest.parent)
        if image.complete() and (kernel is None or image_kernel(image) == kernel):
            return image
    return None


def image_for(inputs: Dict[str, object]) -> LabImage:
    return LabImage(cache_root() / "images" / inputs_key(inputs))


def _need(tool: str, package: str) -> None:
    if shutil.which(tool) is None:
        raise ToolMissing(tool, package)


def _run(args: List[str], what: str, **kw) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(args, check=True, capture_output=True, text=True, **kw)
    except subprocess.CalledProcessError as exc:
        tail = "\n".join((exc.stderr or exc.stdout or "").strip().splitlines()[-15:])
        raise NvmeofError(f"{what} failed (exit {exc.returncode}): {' '.join(args[:4])} ...\n{tail}",
                          "check the machine's apt sources and network access to its Debian mirror; then 'nvmeof-roce lab build' again")


def _bzimage_payload(data: bytes) -> bytes:
    """The compressed kernel inside a bzImage (boot protocol 2.08+: payload_offset/payload_length)."""
    setup_sects = data[0x1f1] or 4
    offset = int.from_bytes(data[0x248:0x24c], "little")
    length = int.from_bytes(data[0x24c:0x250], "little")
    start = (setup_sects + 1) * 512 + offset
    return data[start:start + length]


def extract_vmlinux(vmlinuz: Path, out: Path) -> None:
    """Debian's vmlinuz is a bzImage (XZ payload for 6.1, zstd for 6.12); the ELF inside boots through PVH."""
    payload = _bzimage_payload(vmlinuz.read_bytes())
    if payload.startswith(b"\xfd7zXZ\x00"):
        elf = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(payload)
    elif payload.startswith(b"\x28\xb5\x2f\xfd"):
        _need("zstd", "zstd")  # the standard library has no zstd before Python 3.14
        # The kernel build appends the uncompressed size (4 bytes) after the zstd frame.
        elf = subprocess.run(["zstd", "-d", "-c", "-q"], input=payload[:-4], check=True, capture_output=True).stdout
    else:
        raise NvmeofError(f"{vmlinuz}: payload is neither XZ nor zstd", "the lab expects Debian's amd64 kernel image")
    if elf[:4] != b"\x7fELF":
        raise NvmeofError(f"{vmlinuz}: payload is not an ELF kernel", "the lab expects Debian's amd64 kernel image")
    out.write_bytes(elf)


def _modules_closure(rootfs: Path, release: str, modules: List[str]) -> List[str]:
    """Module files (relative to rootfs) in load order, dependencies first."""
    ordered: List[str] = []
    for mod in modules:
        out = _run(["chroot", str(rootfs), "modprobe", "-S", release, "--show-depends", mod], f"modprobe --show-depends {mod}").stdout
        for line in out.splitlines():
            parts = line.split()
            if parts and parts[0] == "insmod" and parts[1] not in ordered:
                ordered.append(parts[1])
    return ordered


def build_initramfs(rootfs: Path, release: str, out: Path, work: Path) -> None:
    tree = work / "initramfs"
    shutil.rmtree(tree, ignore_errors=True)
    (tree / "bin").mkdir(parents=True)
    shutil.copy2(rootfs / "bin/busybox", tree / "bin/busybox")
    order = []
    for rel in _modules_closure(rootfs, release, INITRAMFS_MODULES):
        src = rootfs / rel.lstrip("/")
        dst = tree / rel.lstrip("/")
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.suffix == ".xz":  # busybox insmod takes plain .ko
            dst = dst.with_suffix("")
            dst.write_bytes(lzma.decompress(src.read_bytes()))
        elif src.suffix == ".zst":
            dst = dst.with_suffix("")
            _need("zstd", "zstd")
            dst.write_bytes(subprocess.run(["zstd", "-d", "-c", "-q", str(src)], check=True,
                                           capture_output=True).stdout)
        else:
            shutil.copy2(src, dst)
        order.append("/" + str(dst.relative_to(tree)))
    (tree / "modules.order").write_text("\n".join(order) + "\n")
    shutil.copy2(GUEST_DIR / "initramfs-init", tree / "init")
    files = subprocess.run(["find", "."], cwd=tree, check=True, capture_output=True).stdout
    cpio = subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=tree, input=files, check=True, capture_output=True).stdout
    out.write_bytes(cpio)


def _install_guest_files(rootfs: Path) -> None:
    shutil.copy2(GUEST_DIR / "nvmeof-lab-init", rootfs / "sbin/nvmeof-lab-init")
    shutil.copy2(GUEST_DIR / "nvmeof-roce", rootfs / "usr/local/bin/nvmeof-roce")
    (rootfs / "etc/hostname").write_text("nvmeof-lab\n")
    (rootfs / "etc/hosts").write_text("127.0.0.1 localhost\n10.99.0.1 nvmeof-lab\n")
    (rootfs / "etc/fstab").write_text("")
    # One host identity, as nvme-cli's own generator makes it: the host ID is the UUID inside the host NQN.
    host_uuid = str(uuid.uuid4())
    (rootfs / "etc/nvme").mkdir(parents=True, exist_ok=True)
    (rootfs / "etc/nvme/hostnqn").write_text(f"nqn.2014-08.org.nvmexpress:uuid:{host_uuid}\n")
    (rootfs / "etc/nvme/hostid").write_text(host_uuid + "\n")


def download(package: str, version: str, debs: Path, apt: List[str]) -> Path:
    """The .deb of `package` at `version` from the cache of downloads, fetched with apt-get first if missing."""
    pattern = f"{package}_{version.replace(':', '%3a')}_*.deb"
    found = sorted(debs.glob(pattern))
    if not found:
        _run(["apt-get", *apt, "download", "-q", f"{package}={version}"], f"apt-get download {package}={version}",
             cwd=debs)
        found = sorted(debs.glob(pattern))
    if not found:
        raise NvmeofError(f"apt-get download {package}={version} left no .deb in {debs}", "run 'apt-get update'")
    return found[-1]


def _dir_size(path: Path) -> int:
    out = subprocess.run(["du", "-sb", str(path)], check=True, capture_output=True, text=True).stdout
    return int(out.split()[0])


def build(force: bool = False, kernel: str = aptconfig.DEFAULT_KERNEL) -> LabImage:
    """Build the lab image for one kernel generation if its inputs changed (or `force`); return it."""
    if os.geteuid() != 0:
        raise NvmeofError("building the lab needs root (debootstrap, chroot)", "run it as root or with sudo")
    for tool, pkg in (("debootstrap", "debootstrap"), ("mke2fs", "e2fsprogs"), ("cpio", "cpio"),
                      ("dpkg", "dpkg"), ("apt-get", "apt")):
        _need(tool, pkg)

    progress(f"lab build: resolving inputs (kernel {kernel} package, guest packages, Python pins)")
    inputs = image_inputs(kernel)
    image = image_for(inputs)
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    # One build at a time per cache: two checkouts (or a test run and a shell) share it.
    with open(root / ".build.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress("lab build: another build of this cache is running; waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if image.complete() and not force:
            progress(f"lab build: image {image.directory.name} is up to date, skipping build")
            os.utime(image.manifest_path)
            return image
        return _build_locked(inputs, image, root)


def _build_locked(inputs: Dict[str, object], image: LabImage, root: Path) -> LabImage:
    started = time.monotonic()
    debs = root / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    work = root / "work"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    suite = str(inputs["suite"])
    python = str(inputs.get("python", "3.11"))
    packages = list(inputs["packages"])
    mirror = aptconfig.debian_mirror(suite=suite)
    kernel_apt = aptconfig.apt_options(str(inputs.get("kernel_suite", suite)))
    kernel_pkg = str(inputs["kernel_package"])
    release = aptconfig.kernel_release(kernel_pkg)

    progress(f"lab build [1/6]: downloading {kernel_pkg}")
    kdir = work / "kernel"
    kdir.mkdir()
    for part, version in dict(inputs["kernel_parts"]).items():
        deb = download(part, version, debs, kernel_apt)
        _run(["dpkg-deb", "-x", str(deb), str(kdir)], f"dpkg-deb -x ({part})")

    progress(f"lab build [2/6]: debootstrap {suite} rootfs ({len(packages)} packages; 1-2 min)")
    rootfs = work / "rootfs"
    keyring = [] if suite == aptconfig.GUEST_SUITE else [f"--keyring={aptconfig.KEYRING}"]
    _run(["debootstrap", "--variant=minbase", f"--cache-dir={debs}", *keyring, "--include=" + ",".join(packages),
          suite, str(rootfs), mirror], "debootstrap")

    progress(f"lab build [3/6]: kernel {release}: vmlinux and modules")
    image_tmp = root / "images" / (image.directory.name + ".tmp")
    shutil.rmtree(image_tmp, ignore_errors=True)
    image_tmp.mkdir(parents=True)
    vmlinuz = kdir / "boot" / f"vmlinuz-{release}"
    if not vmlinuz.exists():  # unstable's linux-binary package keeps it beside the modules
        vmlinuz = kdir / "usr/lib/modules" / release / "vmlinuz"
    extract_vmlinux(vmlinuz, image_tmp / "vmlinux")
    mod_src = kdir / "lib/modules" / release
    if not mod_src.exists():  # trixie's kernel package ships them under the merged /usr
        mod_src = kdir / "usr/lib/modules" / release
    for rel in DROPPED_MODULE_DIRS:
        shutil.rmtree(mod_src / rel, ignore_errors=True)
    mod_dst = rootfs / "lib/modules" / release
    shutil.rmtree(mod_dst, ignore_errors=True)
    shutil.copytree(mod_src, mod_dst, symlinks=True)
    # Soft-iWARP (not in Debian's kernels) is not part of the image: lab/siw.py builds it when a run asks for it.
    _run(["chroot", str(rootfs), "depmod", "-a", release], "depmod")

    progress("lab build [4/6]: project Python dependencies (pinned, same as the venv)")
    site = rootfs / f"usr/local/lib/python{python}/dist-packages"
    site.mkdir(parents=True, exist_ok=True)
    target_python = []
    if python != f"{sys.version_info.major}.{sys.version_info.minor}":
        # The guest's Python is not this one: wheels for its version and glibc, binary only.
        target_python = ["--python-version", python, "--implementation", "cp", "--only-binary=:all:",
                         *(f"--platform=manylinux_2_{minor}_x86_64" for minor in (17, 28, 34)),
                         "--platform=manylinux2014_x86_64", "--platform=linux_x86_64"]
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-compile", "--target", str(site), *target_python,
          *inputs["python_requirements"]], "pip install (guest dependencies)")
    _install_guest_files(rootfs)
    # The guest is throwaway; drop apt's caches and docs to keep the disk small.
    for rel in ("var/cache/apt/archives", "usr/share/doc", "usr/share/man", "usr/share/locale"):
        shutil.rmtree(rootfs / rel, ignore_errors=True)

    progress("lab build [5/6]: initramfs")
    build_initramfs(rootfs, release, image_tmp / "initrd.img", work)

    size = _dir_size(rootfs)
    disk_mb = int(size * 1.3 / 2**20) + 200
    progress(f"lab build [6/6]: ext4 root disk ({disk_mb} MB)")
    _run(["mke2fs", "-q", "-t", "ext4", "-L", "nvmeof-lab", "-d", str(rootfs), str(image_tmp / "rootfs.ext4"),
          f"{disk_mb}M"], "mke2fs")

    manifest = {"inputs": inputs, "key": image.directory.name, "kernel_release": release,
                "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "build_seconds": round(time.monotonic() - started, 1), "rootfs_bytes": size}
    (image_tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(image.directory, ignore_errors=True)
    image_tmp.rename(image.directory)
    shutil.rmtree(work, ignore_errors=True)
    _prune_old_images(keep=image.directory)
    progress(f"lab build: done in {manifest['build_seconds']} s -> {image.directory}")
    return image


def _prune_old_images(keep: Path, max_images: int = 2) -> None:
    """Keep `keep` and the newest others of its kernel generation up to `max_images`; images of the other
    generations are side by side and stay (each is pruned when its own generation is rebuilt)."""
    generation = image_kernel(LabImage(keep))
    images = []
    for p in (cache_root() / "images").iterdir():
        if not p.is_dir() or p == keep:
            continue
        image = LabImage(p)
        try:
            same = not image.manifest_path.exists() or image_kernel(image) == generation
        except (OSError, ValueError):
            same = True  # an unreadable manifest: a broken image, fair to remove
        if same:
            images.append(p)
    images.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for old in images[max_images - 1:]:
        shutil.rmtree(old, ignore_errors=True)
