"""`nvmeof-roce lab blktests`: blktests' nvme group in one lab boot, against kernel nvmet and against the
userspace target through its NVME_TARGET_CONTROL script, then the two side by side (docs/conformance.md).

blktests is taken at a pinned upstream revision into the lab's cache, never into the repository.  Debian does not
package blktests, and the lab machines reach no other source, so the cache is seeded once from a copy of
upstream's repository (`--source`: a git directory or a checkout, `BLKTESTS_SRC` for `make test-blktests`);
later runs use the cache.  Its C helpers (src/) are built on this machine with its compiler (the bookworm
guests have none; what Debian 12 builds runs on Debian 13 too): none of the nvme tests that can run over RDMA
uses them.

The guest gets, for this run only: xfsprogs, bsdextrautils and gawk with what they need that the image lacks
(.debs of the guest's own suite, resolved by apt against the image's installed packages and installed at boot),
the kernel's config (from the kernel packages the image was built from: linux-image-RELEASE, or linux-base-RELEASE
where Debian splits the kernel) at /boot, and a scratch disk
for blktests' images (ext4: nvmet's file backend opens with O_DIRECT, which tmpfs refuses before 6.6).  The boot
adds `tsc=reliable`: under TCG the clocksource watchdog can mark the TSC unstable mid-run, and the text poke
that follows has crashed the 6.12 guest.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from ..errors import NvmeofError
from ..output import progress
from . import aptconfig, guest_native
from . import image as lab_image
from .vm import LabRun, run_in_guest

BLKTESTS_REVISION = "a608cb56341e0f4cacf473f5e0ac6052f1f12de9"  # upstream master, 2026-08-21
# What blktests needs that the image lacks (mkfs.xfs: nvme/012, 047; column: ./check's summary; gawk); apt adds
# the libraries they need from the guest's own suite (bookworm or trixie: their names differ, libicu72 and 76)
EXTRA_PACKAGES = ["xfsprogs", "bsdextrautils", "gawk"]
MODES = ("kernel", "ours")
BOOT_CMDLINE = "tsc=reliable"
SCRATCH_BYTES = 8 << 30  # a sparse file: blktests' images and mkfs targets
GUEST_SCRIPT = Path(__file__).with_name("blktests-guest.sh")
PROJECT = Path(__file__).resolve().parents[2]  # the checkout mounted at /mnt/project

# A test that passes on nvmet and not on ours is a defect of ours unless it is listed here with the reason it
# cannot pass against an external target, quoting blktests' own lines (docs/conformance.md has the longer form).
NOT_APPLICABLE: Dict[str, str] = {
    "nvme/030": "writes nvmet's configfs itself and requires it: `_require_kernel_nvme_target` (\"Linux kernel "
                "soft target not available\" with NVME_TARGET_CONTROL); its steps run against ours in "
                "tests/unit/test_blktests_control.py",
    "nvme/048": "changes the queue count by writing nvmet's configfs: `echo \"${qid_max}\" > "
                "\"${cfs_path}/attr_qid_max\"`, else SKIP \"missing attr_qid_max feature\"; ours takes it through "
                "RPC (nvmeof_subsystem_set_qid_max), tested in tests/unit/test_blktests_control.py",
    "nvme/042": "sets each new key in nvmet's configfs: `_set_nvmet_hostkey` writes "
                "`${NVMET_CFS}/hosts/${nvmet_hostnqn}/dhchap_key`; the key types and lengths against ours: "
                "tests/lab/test_auth.py",
    "nvme/043": "sets the hash and DH group in nvmet's configfs: `_set_nvmet_hash`, `_set_nvmet_dhgroup`; each hash "
                "and group against ours: tests/lab/test_auth.py",
    "nvme/044": "sets the DH group in nvmet's configfs: `_set_nvmet_dhgroup \"${def_hostnqn}\" \"ffdhe2048\"`; "
                "bidirectional and wrong controller keys against ours: tests/lab/test_auth.py",
    "nvme/045": "rotates keys in nvmet's configfs: `_set_nvmet_hostkey`, `_set_nvmet_ctrlkey`, `_set_nvmet_dhgroup`",
    "nvme/051": "enables and disables the namespace in nvmet's configfs: "
                "`ns=\"${NVMET_CFS}/subsystems/${def_subsysnqn}/namespaces/${def_nsid}\"`, `ns_enable_disable_loop`",
    "nvme/054": "reservations (`_nvmet_target_setup --blkdev file --resv_enable`, which the hook does not pass) "
                "and nvmet's `subsys_path=\"${NVMET_CFS}/subsystems/${def_subsysnqn}\"`; its sequence against ours: "
                "tests/lab/test_two_host_reservations.py",
    "nvme/057": "ANA states set in nvmet's configfs: `_setup_nvmet_port_ana \"${port}\" 1 \"optimized\"`; ours "
                "changes ANA states through RPC (tests/unit/test_ana.py)",
    "nvme/058": "ANA groups and namespaces remapped in nvmet's configfs: `_setup_nvmet_port_ana`, "
                "`_set_nvmet_ns_uuid`; ours: tests/unit/test_ana.py",
    "nvme/065": "exports a scsi_debug disk through nvmet's configfs: `_create_nvmet_subsystem --blkdev "
                "\"/dev/${SCSI_DEBUG_DEVICES[0]}\"`",
}

# Tests that exercise nvmet's configfs only, even through the hook: the same result on both says nothing of ours.
NVMET_ONLY: Dict[str, str] = {
    "nvme/038": "tests nvmet's configfs only (`mkdir -p \"${subsys_path}\"; rmdir \"${subsys_path}\"` under "
                "${NVMET_CFS}, `_create_nvmet_port`): in our mode it is nvmet's result (the module is loaded there "
                "for nvme/031's port), not ours",
}

_RUNTIME = re.compile(r"\.\.\.\s+([0-9.]+)s\s*$")  # `runtime  LAST  ...  THIS`: this run's time
_RESULT_LINE = re.compile(r"^(?P<test>[a-z]+/\d+)(?: => \S+)?\s+(?:\((?P<cond>[a-z]+=[^)]*)\)\s+)?.*"
                          r"\[(?P<status>passed|failed|not run)\]\s*$")


def blktests_cache() -> Path:
    return lab_image.cache_root() / "blktests"


def blktests_tree(source: Optional[str]) -> Path:
    """blktests at BLKTESTS_REVISION, extracted and built in the cache; seeded from `source` if not there yet."""
    tree = blktests_cache() / BLKTESTS_REVISION[:12]
    if (tree / ".built").exists():
        return tree
    if not source:
        raise NvmeofError(f"blktests {BLKTESTS_REVISION[:7]} is not in the lab cache ({tree})",
                          "give a copy of upstream's repository once: --source DIR (a git directory or checkout "
                          "of linux-blktests/blktests; `make test-blktests BLKTESTS_SRC=DIR`)")
    src = Path(source).expanduser().resolve()
    git_dir = src / ".git" if (src / ".git").exists() else src
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    progress(f"blktests: extracting {BLKTESTS_REVISION[:12]} from {src}")
    archive = subprocess.run(["git", f"--git-dir={git_dir}", "archive", BLKTESTS_REVISION], capture_output=True)
    if archive.returncode != 0:
        shutil.rmtree(tree, ignore_errors=True)
        raise NvmeofError(f"{src}: git archive {BLKTESTS_REVISION[:12]} failed: {archive.stderr.decode().strip()}",
                          "give a clone of linux-blktests/blktests that has this revision (git fetch)")
    with tempfile.TemporaryFile() as tmp:
        tmp.write(archive.stdout)
        tmp.seek(0)
        with tarfile.open(fileobj=tmp) as tar:
            tar.extractall(tree)
    # The C helpers: best effort (some need liburing's headers); no nvme test over RDMA uses them.
    build = subprocess.run(["make", "-C", str(tree / "src"), "-k"], capture_output=True, text=True)
    (tree / "build.log").write_text(build.stdout + build.stderr)
    progress(f"blktests: src/ helpers built (exit {build.returncode}, {tree / 'build.log'})")
    (tree / ".built").write_text(BLKTESTS_REVISION + "\n")
    return tree


def image_dpkg_status(image: lab_image.LabImage, out: Path) -> Path:
    """The image's /var/lib/dpkg/status (what its guest has installed), read off its root disk with debugfs:
    nothing is mounted."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    try:
        run = subprocess.run(["debugfs", "-R", f"dump /var/lib/dpkg/status {out}", str(image.disk)],
                             capture_output=True, text=True)
    except FileNotFoundError:
        raise NvmeofError("debugfs: command not found", "install the Debian package 'e2fsprogs'") from None
    if run.returncode != 0 or not out.exists() or out.stat().st_size == 0:
        raise NvmeofError(f"cannot read /var/lib/dpkg/status from the image's disk {image.disk}: "
                          f"{run.stderr.strip()}", "rebuild the image: nvmeof-roce lab build --force --kernel "
                          f"{lab_image.image_kernel(image)}")
    return out


def extra_debs(image: lab_image.LabImage) -> List[Path]:
    """The .debs the guest installs for blktests (EXTRA_PACKAGES and what they need that the image lacks), from
    the guest's own Debian suite (bookworm, or trixie for the Debian 13 guests): apt resolves them against the
    image's installed packages.  Downloaded once per image into the cache."""
    suite, _ = image.suites()
    debs = blktests_cache() / "debs" / image.directory.name
    done = debs / ".resolved"
    if done.exists():
        have = [debs / name for name in done.read_text().split()]
        if all(p.exists() for p in have):
            return have
    shutil.rmtree(debs, ignore_errors=True)
    (debs / "partial").mkdir(parents=True)
    status = image_dpkg_status(image, debs / "partial" / "status")
    progress(f"blktests: apt-get install --download-only {' '.join(EXTRA_PACKAGES)} (Debian {suite}, "
             f"against the image's installed packages)")
    # the suite's apt state (the machine's own for bookworm, the lab's private one for trixie), with the
    # image's status file in place of the machine's: apt adds just what the guest lacks, from the guest's suite
    args = ["apt-get", *aptconfig.apt_options(suite), f"-oDir::State::Status={status}",
            f"-oDir::Cache::Archives={debs}", "-oDebug::NoLocking=1", "-oAPT::Install-Recommends=false",
            "-q", "-y", "--download-only", "install", *EXTRA_PACKAGES]
    run = subprocess.run(args, capture_output=True, text=True)
    if run.returncode != 0:
        tail = "\n".join((run.stderr or run.stdout).strip().splitlines()[-12:])
        raise NvmeofError(f"apt-get cannot download blktests' extra packages for the {suite} guest "
                          f"({', '.join(EXTRA_PACKAGES)}):\n{tail}",
                          "run 'apt-get update' (and 'rm -r " + str(lab_image.cache_root() / "apt") + "' to "
                          "refresh the lab's private apt states)")
    have = sorted(debs.glob("*.deb"))
    missing = [name for name in EXTRA_PACKAGES if not any(p.name.startswith(f"{name}_") for p in have)
               and not _installed(status, name)]
    if missing:
        raise NvmeofError(f"apt-get downloaded no {', '.join(missing)} for the {suite} guest ({debs})",
                          "run 'apt-get update' and 'nvmeof-roce lab blktests' again")
    done.write_text("\n".join(p.name for p in have) + "\n")
    return have


def _installed(status: Path, package: str) -> bool:
    for stanza in status.read_text(errors="replace").split("\n\n"):
        if re.search(rf"^Package: {re.escape(package)}$", stanza, re.M) and \
                re.search(r"^Status: install ok installed$", stanza, re.M):
            return True
    return False


# Where the kernel's config is in its packages: /boot/config-RELEASE in the image package (bookworm, trixie);
# /usr/lib/modules/RELEASE/config in linux-base-RELEASE where Debian splits the kernel (unstable).
KERNEL_CONFIG_PLACES = [("linux-image-{release}", "boot/config-{release}"),
                        ("linux-image-{release}", "usr/lib/modules/{release}/config"),
                        ("linux-base-{release}", "usr/lib/modules/{release}/config"),
                        ("linux-base-{release}", "boot/config-{release}")]


def _deb_member(deb: Path, member: str) -> Optional[bytes]:
    """One file of a .deb's data, or None if the package does not hold it."""
    tar = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    found = None
    try:
        with tarfile.open(fileobj=tar.stdout, mode="r|") as archive:
            for info in archive:
                if info.name.removeprefix("./") == member and info.isfile():
                    found = archive.extractfile(info).read()
                    break
    except tarfile.TarError as exc:
        raise NvmeofError(f"{deb}: cannot read its files: {exc}", f"remove {deb} and rebuild the image "
                          "(nvmeof-roce lab build --force)") from None
    finally:
        tar.kill()
        tar.wait()
    return found


def kernel_config(image: lab_image.LabImage) -> Path:
    """config-RELEASE from the kernel packages the image was built from (blktests' _have_kernel_option reads
    /boot/config-RELEASE)."""
    release = image.manifest()["kernel_release"]
    out = blktests_cache() / f"config-{release}"
    if out.exists():
        return out
    debs_dir = lab_image.cache_root() / "debs"
    versions = dict(image.inputs().get("kernel_parts") or {})  # the versions it was built from
    looked = []
    for package, place in KERNEL_CONFIG_PLACES:
        package, place = package.format(release=release), place.format(release=release)
        version = versions.get(package)
        debs = sorted(debs_dir.glob(f"{package}_{version.replace(':', '%3a') if version else '*'}_*.deb"))
        looked.append(f"{place} in {debs[-1].name if debs else package + ' (not downloaded)'}")
        if not debs:
            continue
        data = _deb_member(debs[-1], place)
        if data is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(out.name + ".tmp")
            tmp.write_bytes(data)
            tmp.replace(out)
            return out
    raise NvmeofError(f"no kernel config for {release} in the lab's packages ({debs_dir}): looked for "
                      + "; ".join(dict.fromkeys(looked)),
                      f"rebuild the image, which downloads its kernel packages again: nvmeof-roce lab build "
                      f"--force --kernel {lab_image.image_kernel(image)}")


@dataclass
class Result:
    test: str           # nvme/029, or nvme/006 (bd=file) for a test run once per condition
    status: str         # passed, failed, not run
    reasons: List[str] = field(default_factory=list)  # blktests' skip reasons
    seconds: Optional[float] = None  # the run's time, from its `runtime ... 14.471s` line


def parse_check_log(text: str) -> Dict[str, Result]:
    """./check's console: one `TEST (cond) (description) [status]` line per run, skip reasons indented below."""
    results: Dict[str, Result] = {}
    last: Optional[Result] = None
    for line in text.splitlines():
        m = _RESULT_LINE.match(line)
        if m:
            # tr=rdma is every run's transport: only the other conditions (bd=device|file) tell runs apart
            cond = " ".join(c for c in (m.group("cond") or "").split() if not c.startswith("tr="))
            key = m.group("test") + (f" ({cond})" if cond else "")
            last = results[key] = Result(key, m.group("status"))
        elif last is not None and line.startswith("    ") and line.strip().startswith("runtime"):
            t = _RUNTIME.search(line)
            last.seconds = float(t.group(1)) if t else None
        elif last is not None and line.startswith("    ") and last.status == "not run":
            last.reasons.append(line.strip())
        elif line.strip() and not line.startswith(" "):
            last = None
    return results


def why(test: str, kernel: Optional[Result], ours: Optional[Result]) -> str:
    k = kernel.status if kernel else "absent"
    o = ours.status if ours else "absent"
    base = test.split(" ")[0]
    if base in NVMET_ONLY:
        return NVMET_ONLY[base]
    if k == o:
        return ""
    if ours is None and "bd=device" in test:
        return ("one run per block device type: the hook answers --show-blkdev-type with `file` (our namespaces "
                "are files), so blktests runs the bd=file variant only")
    if base in NOT_APPLICABLE:
        return "not applicable to an external target: " + NOT_APPLICABLE[base]
    k_reasons = f" ({'; '.join(kernel.reasons)})" if kernel and kernel.reasons else ""
    if o == "passed":
        return f"passes on ours; nvmet: {k}{k_reasons}"
    if k != "passed":
        return f"nvmet: {k}{k_reasons}; ours: {o}"
    if o == "not run" and ours and ours.reasons:  # a skip on ours is a defect too until it is listed above
        return "DEFECT of ours until shown otherwise (skipped: " + "; ".join(ours.reasons) + ")"
    return "DEFECT of ours until shown otherwise"


def compare(kernel: Dict[str, Result], ours: Dict[str, Result]) -> List[dict]:
    def order(t: str):
        m = re.match(r"[a-z]+/(\d+)", t)
        return (int(m.group(1)) if m else 0, t)
    rows = []
    for test in sorted(set(kernel) | set(ours), key=order):
        k, o = kernel.get(test), ours.get(test)
        rows.append({"test": test, "kernel": k.status if k else "-", "ours": o.status if o else "-",
                     "kernel_seconds": k.seconds if k else None, "ours_seconds": o.seconds if o else None,
                     "why": why(test, k, o)})
    return rows


def table_markdown(rows: List[dict], kernel: str, seconds: Dict[str, object]) -> str:
    counts = {mode: sum(1 for r in rows if r[mode] == "passed") for mode in MODES}
    both = sum(1 for r in rows if r["kernel"] == r["ours"] == "passed")
    lines = [f"blktests {BLKTESTS_REVISION[:7]}, nvme group over rxe, kernel {kernel}: nvmet passed {counts['kernel']}, "
             f"ours {counts['ours']}, both {both}; ./check took {seconds.get('kernel', '?')} s (nvmet) and "
             f"{seconds.get('ours', '?')} s (ours)", "",
             "| test | nvmet | ours | nvmet s | ours s | why they differ |", "|---|---|---|---:|---:|---|"]

    def secs(value) -> str:
        return "-" if value is None else f"{value:.0f}"
    for r in rows:
        lines.append(f"| {r['test']} | {r['kernel']} | {r['ours']} | {secs(r.get('kernel_seconds'))} | "
                     f"{secs(r.get('ours_seconds'))} | {r['why']} |")
    return "\n".join(lines) + "\n"


def run(kernel: str, modes: List[str], tests: List[str], source: Optional[str], out: Path,
        timeout: float, memory_mb: int) -> int:
    """Boot once, run the modes, write OUT/table.md and OUT/table.json; exit code 1 if a test passed on nvmet
    and not on ours without a reason listed."""
    tree = blktests_tree(source)
    image = lab_image.build(force=False, kernel=kernel)
    debs = extra_debs(image)
    guest_native.ensure(image, PROJECT)  # our target's native data path for a Python 3.13 guest
    config = kernel_config(image)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel.release").write_text(image.manifest()["kernel_release"] + "\n")
    inp = out / "input"
    shutil.rmtree(inp, ignore_errors=True)
    (inp / "debs").mkdir(parents=True)
    for deb in debs:
        shutil.copy2(deb, inp / "debs")
    shutil.copy2(config, inp)
    shutil.copytree(tree, inp / "blktests", symlinks=True)
    scratch = out / "scratch.img"
    with open(scratch, "wb") as f:
        f.truncate(SCRATCH_BYTES)
    started = time.monotonic()
    try:
        code = run_in_guest(image, LabRun(
            command=["bash", "nvmeof_roce/lab/blktests-guest.sh", "/mnt/share", " ".join(modes), *tests],
            project=PROJECT, share=out, timeout=timeout, memory_mb=memory_mb,
            cmdline=BOOT_CMDLINE,
            extra_args=["-drive", f"file={scratch},if=virtio,format=raw,cache=unsafe"]))
    finally:
        scratch.unlink(missing_ok=True)
        shutil.rmtree(inp, ignore_errors=True)
    boot_seconds = round(time.monotonic() - started)
    (out / "boot.seconds").write_text(f"{boot_seconds}\n")
    if code != 0:
        raise NvmeofError(f"the blktests run in the guest failed (exit {code})",
                          f"see the guest's output above; what finished is in {out} "
                          f"(nvmeof-roce lab blktests --table-only --out {out} tables it)")
    progress(f"blktests: boot took {boot_seconds} s")
    return write_table(out, modes)


def write_table(out: Path, modes: List[str]) -> int:
    """OUT/table.md and OUT/table.json from OUT/MODE.log; exit code 1 if a test passed on nvmet and not on ours
    without a reason listed.  A mode whose log is missing compares as absent."""
    release = out / "kernel.release"
    kernel_release = release.read_text().strip() if release.exists() else "?"
    results = {}
    seconds: Dict[str, object] = {}
    boot = out / "boot.seconds"
    if boot.exists():
        seconds["boot"] = int(boot.read_text())
    for mode in modes:
        log = out / f"{mode}.log"
        results[mode] = parse_check_log(log.read_text(errors="replace")) if log.exists() else {}
        sec = out / f"{mode}.seconds"
        seconds[mode] = int(sec.read_text()) if sec.exists() else "?"
    rows = compare(results.get("kernel", {}), results.get("ours", {}))
    (out / "table.md").write_text(table_markdown(rows, kernel_release, seconds))
    (out / "table.json").write_text(json.dumps({"blktests": BLKTESTS_REVISION, "kernel": kernel_release,
                                                "seconds": seconds, "rows": rows}, indent=2) + "\n")
    print((out / "table.md").read_text())
    progress(f"blktests: table in {out / 'table.md'}")
    defects = [r["test"] for r in rows if r["why"].startswith("DEFECT") and r["kernel"] == "passed"]
    if defects and set(modes) == set(MODES):
        progress(f"blktests: passed on nvmet, not on ours, unexplained: {', '.join(defects)}")
        return 1
    return 0
