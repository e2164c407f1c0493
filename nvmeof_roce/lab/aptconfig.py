"""What the lab takes from this machine's apt: the Debian mirror and the kernel package.

The mirror is read from the machine's own apt sources (deb822 `*.sources` or
one-line `sources.list`), so the lab uses whatever mirror this machine is set up
with; no host name is built in.  A generation whose suite the machine's sources
do not name (trixie, unstable on a bookworm machine) is read from the same mirror
through a private apt state under the lab cache (`apt/SUITE/`): the machine's own
apt configuration is not changed.
"""
from __future__ import annotations

import glob
import os
import re
import subprocess
from dataclasses import dataclass
from typing import Iterator, List

from ..errors import NvmeofError
from .aptresolve import AptArchive, KernelPlan, kernel_plan
from .cache import cache_root

GUEST_SUITE = "bookworm"  # the default lab guest is Debian 12 with its 6.1 kernel (or the 6.12 one it also ships)


@dataclass(frozen=True)
class Generation:
    """One `--kernel` choice: the Debian suite of the guest's userland and where its kernel comes from."""

    name: str
    suite: str  # debootstrap's suite: the guest's rdma-core, nvme-cli, fio, python3
    kernel_suite: str  # the suite whose kernel meta package is resolved
    kernel_meta: str  # the meta package that names the newest kernel build of that suite
    python: str  # the guest's python3 (its dist-packages directory)


# Kernel generations the lab offers.  6.1 is bookworm's own kernel (no CONFIG_NVME_AUTH), 6.12 the long-term
# kernel bookworm ships too (NVME_HOST_AUTH, NVME_TARGET_AUTH, NVME_RDMA, NVME_TARGET_RDMA and RDMA_RXE as
# modules).  trixie is Debian 13 with its own 6.12 kernel (rdma-core 56, nvme-cli 2.13, fio 3.39, Python 3.13);
# unstable is the same Debian 13 userland booting Debian unstable's newest kernel.
GENERATIONS = {
    "6.1": Generation("6.1", "bookworm", "bookworm", "linux-image-amd64", "3.11"),
    "6.12": Generation("6.12", "bookworm", "bookworm", "linux-image-6.12-amd64", "3.11"),
    "trixie": Generation("trixie", "trixie", "trixie", "linux-image-amd64", "3.13"),
    "unstable": Generation("unstable", "trixie", "sid", "linux-image-amd64", "3.13"),
}
KERNEL_META_PACKAGES = {name: g.kernel_meta for name, g in GENERATIONS.items()}
DEFAULT_KERNEL = "6.1"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"


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
    """The URI of the Debian archive that serves `suite` with component main.  A suite the sources do not name
    (trixie or sid on a bookworm machine) is taken from the archive that serves bookworm: one Debian mirror
    carries every suite."""
    sources = apt_sources(root)
    for wanted in dict.fromkeys((suite, GUEST_SUITE)):
        for src in sources:
            if wanted in src.suites and "main" in src.components and "security" not in src.uri:
                return src.uri.rstrip("/")
    raise NvmeofError(
        f"no apt source for Debian '{suite}' main found in {root.rstrip('/')}/etc/apt",
        f"add a Debian {suite} mirror to /etc/apt/sources.list.d/ (the lab's guest is Debian {suite})",
    )


def generation(kernel: str) -> Generation:
    try:
        return GENERATIONS[kernel]
    except KeyError:
        raise NvmeofError(f"--kernel {kernel}: the lab offers kernels {', '.join(GENERATIONS)}",
                          f"use --kernel {' or --kernel '.join(GENERATIONS)}")


def apt_options(suite: str) -> List[str]:
    """apt-get/apt-cache options that read `suite` from the machine's Debian mirror.  The machine's own suite
    needs none (its apt state is used as it is); another suite gets a private state under the lab cache, made
    and updated once here."""
    if suite == GUEST_SUITE:
        return []
    state = cache_root() / "apt" / suite
    for sub in ("lists/partial", "cache/archives/partial", "parts", "preferences.d"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    sources = state / "sources.list"
    line = f"deb [signed-by={KEYRING}] {debian_mirror(suite=suite)} {suite} main\n"
    if not sources.exists() or sources.read_text() != line:
        sources.write_text(line)
        for old in (state / "lists").glob("*_dists_*"):
            old.unlink()
    (state / "status").touch()
    options = [f"-oDir::Etc::SourceList={sources}", f"-oDir::Etc::SourceParts={state / 'parts'}",
               f"-oDir::Etc::Preferences={state / 'preferences'}",
               f"-oDir::Etc::PreferencesParts={state / 'preferences.d'}",
               f"-oDir::State::Lists={state / 'lists'}", f"-oDir::State::Status={state / 'status'}",
               f"-oDir::Cache={state / 'cache'}", "-oAPT::Architecture=amd64", "-oAPT::Architectures=amd64"]
    if not any((state / "lists").glob("*_Packages*")):
        _apt(["apt-get", *options, "update", "-qq"])
    return options


def _apt(args: List[str]) -> str:
    try:
        return subprocess.run(args, check=True, capture_output=True, text=True).stdout
    except FileNotFoundError:
        raise NvmeofError(f"{args[0]}: not found", "the lab is built on a Debian machine with apt")
    except subprocess.CalledProcessError as exc:
        raise NvmeofError(f"{' '.join(args)} failed: {exc.stderr.strip()}", "run 'apt-get update' and retry")


def archive(suite: str = GUEST_SUITE) -> AptArchive:
    """What apt offers of `suite` (the machine's own apt state for bookworm, a private one otherwise)."""
    return AptArchive(apt_options(suite))


def kernel_meta_package(kernel: str) -> str:
    return generation(kernel).kernel_meta


def resolve_kernel(kernel: str = DEFAULT_KERNEL) -> KernelPlan:
    """The kernel of a generation as the archive has it today: the image package the meta package depends on,
    at the version it names, with the packages that hold its parts (aptresolve.kernel_plan)."""
    gen = generation(kernel)
    offered = archive(gen.kernel_suite)
    if not offered.versions(gen.kernel_meta):  # empty package lists on a fresh machine
        subprocess.run(["apt-get", *apt_options(gen.kernel_suite), "update", "-qq"], check=False)
        offered = archive(gen.kernel_suite)
    if not offered.versions(gen.kernel_meta):
        raise NvmeofError(
            f"apt offers no {gen.kernel_meta} (the kernel of --kernel {kernel}) from Debian {gen.kernel_suite}",
            "run 'apt-get update' (the lab needs Debian's linux-image-*-amd64 from the machine's apt sources)",
        )
    return kernel_plan(gen.kernel_meta, offered)


def kernel_generation(release: str) -> str:
    """6.1.0-56-amd64 -> 6.1, 6.12.117+deb12-amd64 -> 6.12 (which --kernel an image belongs to)."""
    m = re.match(r"(\d+)\.(\d+)", release)
    return f"{m.group(1)}.{m.group(2)}" if m else release


def kernel_release(package: str) -> str:
    """linux-image-6.1.0-56-amd64 -> 6.1.0-56-amd64"""
    return package[len("linux-image-"):]
