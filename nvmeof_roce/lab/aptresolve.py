"""The lab's build inputs resolved as apt resolves them: by the dependency relations the packages state.

Debian's archive moves under the lab every few weeks: a security upload rebuilds `linux-kbuild-6.1` at
6.1.192-3 while the kernel image stays at 6.1.192-2 (the headers package asks only for
`linux-kbuild-6.1 (>= 6.1.192-2)`), an older `linux-source` revision is dropped, the kernel meta package moves
to a new ABI.  So no input is pinned to a version guessed from another package: each is taken by the relation
that names it — the meta package's `Depends` for the kernel image, the headers' `Depends` for kbuild and the
`-common` headers — at the highest version on offer that satisfies it, as apt does without pins.  An input the
archive no longer has at any acceptable version is an `InputUnavailable` naming the package, the versions on
offer and the relation it needed.

Everything here reads `apt-cache show` text through an `AptArchive` (the machine's apt, or a recorded one in the
unit tests), so the same code plans an image from today's archive and from last month's recording.
"""
from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ..errors import NvmeofError


# ---- Debian version ordering (dpkg's verrevcmp; deb-version(7)) ----

def _char_order(c: str) -> int:
    if c == "~":
        return -1
    if c.isalpha():
        return ord(c)
    return ord(c) + 256


def _compare_fragment(a: str, b: str) -> int:
    i = j = 0
    while i < len(a) or j < len(b):
        while (i < len(a) and not a[i].isdigit()) or (j < len(b) and not b[j].isdigit()):
            ac = _char_order(a[i]) if i < len(a) and not a[i].isdigit() else 0
            bc = _char_order(b[j]) if j < len(b) and not b[j].isdigit() else 0
            if ac != bc:
                return -1 if ac < bc else 1
            i, j = i + 1, j + 1
        m = re.match(r"\d*", a[i:]).group(0)
        n = re.match(r"\d*", b[j:]).group(0)
        if int(m or 0) != int(n or 0):
            return -1 if int(m or 0) < int(n or 0) else 1
        i, j = i + len(m), j + len(n)
    return 0


def _split_version(version: str) -> Tuple[int, str, str]:
    epoch, sep, rest = version.partition(":")
    if not sep:
        epoch, rest = "0", version
    upstream, sep, revision = rest.rpartition("-")
    if not sep:
        upstream, revision = rest, ""
    return int(epoch or 0), upstream, revision


def compare_versions(a: str, b: str) -> int:
    """-1, 0 or 1 as Debian version `a` sorts before, with or after `b` (`dpkg --compare-versions`)."""
    ea, ua, ra = _split_version(a)
    eb, ub, rb = _split_version(b)
    if ea != eb:
        return -1 if ea < eb else 1
    return _compare_fragment(ua, ub) or _compare_fragment(ra, rb)


def upstream_version(version: str) -> str:
    """6.1.192-3 -> 6.1.192 (the kernel's own version, without Debian's revision)."""
    return _split_version(version)[1]


# ---- relations ----

_RELATION_OPS = {
    "<<": lambda c: c < 0, "<=": lambda c: c <= 0, "=": lambda c: c == 0, ">=": lambda c: c >= 0,
    ">>": lambda c: c > 0,
}


@dataclass(frozen=True)
class Relation:
    """One alternative of a Depends entry: `linux-kbuild-6.1 (>= 6.1.192-2)`."""

    package: str
    op: Optional[str] = None
    version: Optional[str] = None

    def accepts(self, version: str) -> bool:
        return self.op is None or _RELATION_OPS[self.op](compare_versions(version, self.version))

    def __str__(self) -> str:
        return self.package + (f" ({self.op} {self.version})" if self.op else "")


def parse_depends(field_text: str) -> List[List[Relation]]:
    """A Depends field -> its entries, each a list of alternatives (`a (>= 1) | b`)."""
    entries = []
    for entry in field_text.split(","):
        alternatives = []
        for alt in entry.split("|"):
            alt = re.sub(r"\[[^\]]*\]|<[^>]*>", "", alt).strip()  # architecture and build-profile qualifiers
            m = re.fullmatch(r"([a-z0-9][a-z0-9+.-]*)(?::\w+)?\s*(?:\(\s*(<<|<=|=|>=|>>|<|>)\s*([^)\s]+)\s*\))?", alt)
            if not m:
                continue
            op = {"<": "<=", ">": ">="}.get(m.group(2), m.group(2))  # the old spellings
            alternatives.append(Relation(m.group(1), op, m.group(3)))
        if alternatives:
            entries.append(alternatives)
    return entries


# ---- the archive ----

@dataclass
class PackageVersion:
    package: str
    version: str
    depends: str = ""


def parse_show(text: str) -> List[PackageVersion]:
    """`apt-cache show PACKAGE` (every version it offers) -> its stanzas, newest first, one per version."""
    found: Dict[Tuple[str, str], PackageVersion] = {}
    for stanza in re.split(r"\n\s*\n", text):
        fields: Dict[str, str] = {}
        key = None
        for line in stanza.splitlines():
            if line[:1].isspace() and key:
                fields[key] += " " + line.strip()
            elif ":" in line:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                fields[key] = value.strip()
        if "package" in fields and "version" in fields:
            found.setdefault((fields["package"], fields["version"]),
                             PackageVersion(fields["package"], fields["version"], fields.get("depends", "")))
    return sorted(found.values(), key=_VersionKey, reverse=True)


class _VersionKey:
    def __init__(self, pv: PackageVersion):
        self.version = pv.version

    def __lt__(self, other: "_VersionKey") -> bool:
        return compare_versions(self.version, other.version) < 0


class AptArchive:
    """What apt offers: `apt-cache [OPTIONS] show PACKAGE` for every version.  `options` select a suite's
    private apt state (aptconfig.apt_options); none means the machine's own."""

    def __init__(self, options: Optional[List[str]] = None):
        self.options = list(options or [])
        self._shown: Dict[str, List[PackageVersion]] = {}

    def show_text(self, package: str) -> str:
        proc = subprocess.run(["apt-cache", *self.options, "show", package], capture_output=True, text=True)
        if proc.returncode != 0 and "No packages found" not in proc.stderr:
            raise NvmeofError(f"apt-cache show {package} failed (exit {proc.returncode}): {proc.stderr.strip()}",
                              "run 'apt-get update' and check the machine's apt sources")
        return proc.stdout if proc.returncode == 0 else ""

    def versions(self, package: str) -> List[PackageVersion]:
        """Every version on offer, newest first (empty if the archive has none)."""
        if package not in self._shown:
            self._shown[package] = [pv for pv in parse_show(self.show_text(package)) if pv.package == package]
        return self._shown[package]


class InputUnavailable(NvmeofError):
    """A build input the archive has at no version its relation accepts."""

    def __init__(self, relation: str, offered: List[str], needed_by: str):
        self.relation = relation
        self.offered = offered
        self.needed_by = needed_by
        on_offer = ", ".join(offered) if offered else "none"
        super().__init__(f"{relation} (needed by {needed_by}) cannot be had: the archive offers {on_offer}",
                         "run 'apt-get update'; if the archive still lacks it, Debian has not published it yet "
                         "(the lab goes on without what needs it)")


def resolve(alternatives: List[Relation], archive: AptArchive, needed_by: str) -> PackageVersion:
    """The first alternative the archive can satisfy, at the highest version its relation accepts."""
    offered: List[str] = []
    for rel in alternatives:
        versions = archive.versions(rel.package)
        for pv in versions:
            if rel.accepts(pv.version):
                return pv
        offered += [f"{rel.package} {pv.version}" for pv in versions]
    raise InputUnavailable(" | ".join(map(str, alternatives)), offered, needed_by)


# ---- plans ----

@dataclass
class KernelPlan:
    """The kernel of an image: the concrete image package behind the meta package, and every package that
    holds a part of it (unstable splits it into -base, -binary and -modules), each at its resolved version."""

    meta: str
    package: str
    version: str
    parts: Dict[str, str] = field(default_factory=dict)

    @property
    def release(self) -> str:
        return self.package[len("linux-image-"):]


# Where Debian splits the kernel (unstable), the image package depends on these, each (= its version).
SPLIT_PARTS = ("linux-base-{release}", "linux-binary-{release}", "linux-modules-{release}")


def kernel_plan(meta: str, archive: AptArchive) -> KernelPlan:
    """linux-image-amd64 -> linux-image-6.1.0-56-amd64 6.1.192-2 (its parts with it)."""
    metas = archive.versions(meta)
    if not metas:
        raise InputUnavailable(meta, [], "the lab image")
    for entry in parse_depends(metas[0].depends):
        image_rel = next((r for r in entry if re.fullmatch(r"linux-image-[0-9][\w.+-]*-amd64", r.package)), None)
        if image_rel:
            break
    else:
        raise NvmeofError(f"{meta} {metas[0].version} depends on no linux-image-*-amd64 package",
                          "the lab expects Debian's kernel meta package")
    image = resolve([image_rel], archive, f"{meta} {metas[0].version}")
    plan = KernelPlan(meta, image.package, image.version, {image.package: image.version})
    release = plan.release
    wanted = {p.format(release=release) for p in SPLIT_PARTS}
    for entry in parse_depends(image.depends):
        if entry[0].package in wanted:
            part = resolve(entry, archive, f"{image.package} {image.version}")
            plan.parts[part.package] = part.version
    return plan


@dataclass
class SiwPlan:
    """The packages siw.ko for one kernel is compiled from (name -> version), and what the plan had to accept
    (a source at another Debian revision of the same kernel version)."""

    inputs: Dict[str, str]
    notes: List[str] = field(default_factory=list)


def siw_plan(kernel: KernelPlan, archive: AptArchive) -> SiwPlan:
    """linux-headers-RELEASE at the image's version (the same build: its .config and Module.symvers), what it
    depends on among the headers and kbuild tools (by its own relations), and linux-source-X.Y at the image's
    version, or else the newest revision of the same kernel version (only drivers/infiniband/sw/siw is taken
    from it, and Debian's revisions of one kernel version carry the same driver)."""
    release, version = kernel.release, kernel.version
    needed_by = f"siw.ko for {release}"
    headers = resolve([Relation(f"linux-headers-{release}", "=", version)], archive, needed_by)
    inputs = {headers.package: headers.version}
    for entry in parse_depends(headers.depends):
        if entry[0].package.startswith(("linux-headers-", "linux-kbuild-")):
            dep = resolve(entry, archive, f"{headers.package} {headers.version}")
            inputs[dep.package] = dep.version
    generation = ".".join(upstream_version(version).split(".")[:2])  # 6.1.192-2 -> 6.1
    source_name = f"linux-source-{generation}"
    same_build = Relation(source_name, "=", version)
    sources = archive.versions(source_name)
    source = next((pv for pv in sources if same_build.accepts(pv.version)), None)
    notes = []
    if source is None:
        source = next((pv for pv in sources if upstream_version(pv.version) == upstream_version(version)), None)
        if source is None:
            raise InputUnavailable(f"{same_build} or another revision of {upstream_version(version)}",
                                   [f"{source_name} {pv.version}" for pv in sources], needed_by)
        notes.append(f"{source_name} {version} is gone from the archive; its driver source is taken from "
                     f"{source.version}, a later revision of the same kernel version")
    inputs[source.package] = source.version
    return SiwPlan(inputs, notes)
