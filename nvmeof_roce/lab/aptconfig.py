"""What the lab takes from this machine's apt: the Debian mirror and the kernel package.

The mirror is read from the machine's own apt sources (deb822 `*.sources` or
one-line `sources.list`), so the lab uses whatever mirror this machine is set up
with; no host name is built in.
"""
from __future__ import annotations

import glob
import os
import re
import subprocess
from dataclasses import dataclass
from typing import Iterator, List, Optional

from ..errors import NvmeofError

GUEST_SUITE = "bookworm"  # the lab guest is Debian 12 with its 6.1 kernel (or the 6.12 one it also ships)

# Kernel generations the lab offers, each by the Debian meta package that names the newest build:
# 6.1 is bookworm's own kernel (no CONFIG_NVME_AUTH), 6.12 the long-term kernel bookworm ships too
# (NVME_HOST_AUTH, NVME_TARGET_AUTH, NVME_RDMA, NVME_TARGET_RDMA and RDMA_RXE as modules).
KERNEL_META_PACKAGES = {"6.1": "linux-image-amd64", "6.12": "linux-image-6.12-amd64"}
DEFAULT_KERNEL = "6.1"


@dataclass
class AptSource:
    uri: str
    suites: List[str]
    components: List[str]
    origin_file: str


def _deb822_sources(path: str) -> Iterator[AptSource]:
    with open(path, encoding="utf-8", errors="replace") as f:
        stanzas = f.read().split("\n\n")
    for stanza in stanzas:
        fields = {}
        for line in stanza.splitlines():
            if line.startswith("#") or ":" not in line or line[:1].isspace():
                continue
            key, _, value = line.partition(":")
            fields[key.strip().lower()] = value.strip()
        if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes").lower() == "no":
            continue
        for uri in fields.get("uris", "").split():
            yield AptSource(uri, fields.get("suites", "").split(), fields.get("components", "").split(), path)


def _one_line_sources(path: str) -> Iterator[AptSource]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = re.sub(r"\[[^\]]*\]", "", line.split("#", 1)[0]).split()
            if len(line) >= 3 and line[0] == "deb":
                yield AptSource(line[1], [line[2]], line[3:], path)


def apt_sources(root: str = "/") -> List[AptSource]:
    etc = os.path.join(root, "etc/apt")
    found: List[AptSource] = []
    if os.path.exists(os.path.join(etc, "sources.list")):
        found += _one_line_sources(os.path.join(etc, "sources.list"))
    for path in sorted(glob.glob(os.path.join(etc, "sources.list.d/*.sources"))):
        found += _deb822_sources(path)
    for path in sorted(glob.glob(os.path.join(etc, "sources.list.d/*.list"))):
        found += _one_line_sources(path)
    return found


def debian_mirror(root: str = "/", suite: str = GUEST_SUITE) -> str:
    """The URI of the Debian archive that serves `suite` with component main."""
    for src in apt_sources(root):
        if suite in src.suites and "main" in src.components and "security" not in src.uri:
            return src.uri.rstrip("/")
    raise NvmeofError(
        f"no apt source for Debian '{suite}' main found in {root.rstrip('/')}/etc/apt",
        f"add a Debian {suite} mirror to /etc/apt/sources.list.d/ (the lab's guest is Debian {suite})",
    )


def _apt(args: List[str]) -> str:
    try:
        return subprocess.run(args, check=True, capture_output=True, text=True).stdout
    except FileNotFoundError:
        raise NvmeofError(f"{args[0]}: not found", "the lab is built on a Debian machine with apt")
    except subprocess.CalledProcessError as exc:
        raise NvmeofError(f"{' '.join(args)} failed: {exc.stderr.strip()}", "run 'apt-get update' and retry")


def kernel_package(meta: str = "linux-image-amd64") -> Optional[str]:
    """Resolve Debian's kernel meta package to the concrete image package (linux-image-6.1.0-NN-amd64)."""
    out = _apt(["apt-cache", "depends", meta])
    for line in out.splitlines():
        m = re.match(r"\s*Depends:\s*(linux-image-[0-9][\w.+-]*-amd64)\s*$", line)
        if m:
            return m.group(1)
    return None


def kernel_meta_package(kernel: str) -> str:
    try:
        return KERNEL_META_PACKAGES[kernel]
    except KeyError:
        raise NvmeofError(f"--kernel {kernel}: the lab offers kernels {', '.join(KERNEL_META_PACKAGES)}",
                          f"use --kernel {' or --kernel '.join(KERNEL_META_PACKAGES)}")


def resolve_kernel_package(kernel: str = DEFAULT_KERNEL) -> str:
    meta = kernel_meta_package(kernel)
    pkg = kernel_package(meta)
    if pkg is None:  # empty package lists on a fresh machine
        subprocess.run(["apt-get", "update", "-qq"], check=False)
        pkg = kernel_package(meta)
    if pkg is None:
        raise NvmeofError(
            f"apt cannot resolve {meta} to a kernel package",
            "run 'apt-get update' (the lab needs Debian's linux-image-*-amd64 from the machine's apt sources)",
        )
    return pkg


def kernel_generation(release: str) -> str:
    """6.1.0-56-amd64 -> 6.1, 6.12.117+deb12-amd64 -> 6.12 (which --kernel an image belongs to)."""
    m = re.match(r"(\d+)\.(\d+)", release)
    return f"{m.group(1)}.{m.group(2)}" if m else release


def kernel_release(package: str) -> str:
    """linux-image-6.1.0-56-amd64 -> 6.1.0-56-amd64"""
    return package[len("linux-image-"):]
