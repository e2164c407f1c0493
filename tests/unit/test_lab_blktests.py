"""lab/blktests.py: reading ./check's console and comparing the two targets."""
from nvmeof_roce.lab import blktests as B

KERNEL_LOG = """\
./check: gawk is not available. Install GNU awk.
nvme/002 (tr=rdma) (create many subsystems and test discovery) [not run]
    runtime    ...  12.960s
    nvme_trtype=rdma is not supported in this test
nvme/010 (tr=rdma bd=device) (run data verification fio job)
nvme/010 (tr=rdma bd=device) (run data verification fio job) [passed]
    runtime    ...  189.982s
nvme/010 (tr=rdma bd=file) (run data verification fio job)   [passed]
    runtime    ...  180.1s
nvme/029 (tr=rdma) (test userspace IO via nvme-cli read/write interface) [passed]
    runtime  2.1s  ...  2.3s
nvme/030 (tr=rdma) (ensure the discovery generation counter is updated appropriately) [passed]
nvme/031 (tr=rdma) (test deletion of NVMeOF controllers immediately after setup) [passed]
"""
OURS_LOG = """\
nvme/002 (tr=rdma) (create many subsystems and test discovery) [not run]
    nvme_trtype=rdma is not supported in this test
nvme/010 (tr=rdma bd=file) (run data verification fio job)   [passed]
nvme/029 (tr=rdma) (test userspace IO via nvme-cli read/write interface) [failed]
    runtime  2.1s  ...  2.3s
    --- tests/nvme/029.out
nvme/030 (tr=rdma) (ensure the discovery generation counter is updated appropriately) [not run]
    Linux kernel soft target not available
nvme/031 (tr=rdma) (test deletion of NVMeOF controllers immediately after setup) [passed]
"""


def test_parse_keeps_conditions_but_the_transport_and_the_skip_reasons():
    kernel = B.parse_check_log(KERNEL_LOG)
    assert list(kernel) == ["nvme/002", "nvme/010 (bd=device)", "nvme/010 (bd=file)", "nvme/029", "nvme/030",
                            "nvme/031"]
    assert kernel["nvme/002"].status == "not run"
    assert kernel["nvme/002"].reasons == ["nvme_trtype=rdma is not supported in this test"]
    assert kernel["nvme/010 (bd=device)"].status == "passed" and kernel["nvme/010 (bd=device)"].reasons == []
    # each run's time is this run's, not the previous one's (`runtime  LAST  ...  THIS`)
    assert kernel["nvme/010 (bd=device)"].seconds == 189.982 and kernel["nvme/029"].seconds == 2.3
    assert kernel["nvme/030"].seconds is None


def test_compare_explains_each_difference_and_flags_the_unexplained():
    rows = {r["test"]: r for r in B.compare(B.parse_check_log(KERNEL_LOG), B.parse_check_log(OURS_LOG))}
    assert rows["nvme/002"]["why"] == "" and rows["nvme/031"]["why"] == ""
    assert rows["nvme/029"]["why"].startswith("DEFECT")
    assert rows["nvme/030"]["why"].startswith("not applicable") and "_require_kernel_nvme_target" in \
        rows["nvme/030"]["why"]
    assert rows["nvme/010 (bd=device)"]["ours"] == "-" and "bd=file variant only" in rows["nvme/010 (bd=device)"]["why"]
    assert rows["nvme/010 (bd=file)"]["why"] == ""
    md = B.table_markdown(list(rows.values()), "6.1.0-99-amd64", {"kernel": 700, "ours": 650})
    assert "nvmet passed 5, ours 2, both 2" in md and "| nvme/029 | passed | failed | 2 | 2 | DEFECT" in md
    assert "| nvme/010 (bd=file) | passed | passed | 180 | - |  |" in md


def test_write_table_from_the_logs_of_a_run(tmp_path):
    # --table-only: the table again from a run's directory; a missing log compares as absent
    (tmp_path / "kernel.release").write_text("6.12.1-amd64\n")
    (tmp_path / "kernel.log").write_text(KERNEL_LOG)
    (tmp_path / "kernel.seconds").write_text("700\n")
    assert B.write_table(tmp_path, ["kernel"]) == 0  # one mode: nothing to compare
    md = (tmp_path / "table.md").read_text()
    assert "kernel 6.12.1-amd64: nvmet passed 5, ours 0" in md and "700 s (nvmet) and ? s (ours)" in md
    assert B.write_table(tmp_path, ["kernel", "ours"]) == 1  # ours never ran: not a pass
    (tmp_path / "ours.log").write_text(OURS_LOG)
    assert B.write_table(tmp_path, ["kernel", "ours"]) == 1  # nvme/029 passed on nvmet only
    import json
    rows = {r["test"]: r for r in json.loads((tmp_path / "table.json").read_text())["rows"]}
    assert rows["nvme/029"]["kernel_seconds"] == 2.3 and rows["nvme/029"]["ours"] == "failed"


# --- what the guest is given: the kernel's config and the extra packages ---

import json  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402

from nvmeof_roce.errors import NvmeofError  # noqa: E402
from nvmeof_roce.lab import aptconfig  # noqa: E402
from nvmeof_roce.lab import image as lab_image  # noqa: E402

UNSTABLE = "7.2.13+deb14-amd64"


def _image(cache, key, release, suite="bookworm", kernel_suite=None):
    d = cache / "images" / key
    d.mkdir(parents=True)
    inputs = {"suite": suite} if suite == "bookworm" else \
        {"suite": suite, "kernel_suite": kernel_suite or suite, "python": "3.13"}
    (d / "manifest.json").write_text(json.dumps({"key": key, "kernel_release": release, "inputs": inputs}))
    (d / "rootfs.ext4").write_bytes(b"")
    return lab_image.LabImage(d)


def _deb(debs, package, version, files):
    """A real .deb (dpkg-deb --build) holding `files` ({path: text})."""
    root = debs.parent / "deb-trees" / package
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text(f"Package: {package}\nVersion: {version}\nArchitecture: amd64\n"
                                             "Maintainer: lab <lab@example.invalid>\nDescription: test\n")
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    debs.mkdir(parents=True, exist_ok=True)
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(root),
                    str(debs / f"{package}_{version}_amd64.deb")], check=True, capture_output=True)


def test_kernel_config_of_unstables_split_kernel_is_taken_from_linux_base(tmp_path, monkeypatch):
    """Debian unstable (recorded 2026-11-28): linux-image-7.2.13+deb14-amd64 holds only its docs; the config is
    /usr/lib/modules/RELEASE/config in linux-base-RELEASE (with System.map and modules.builtin)."""
    monkeypatch.setenv("NVMEOF_ROCE_CACHE", str(tmp_path))
    cache = tmp_path / "lab"
    _deb(cache / "debs", f"linux-image-{UNSTABLE}", "7.2.13-1", {f"usr/share/doc/linux-image-{UNSTABLE}/x": ""})
    _deb(cache / "debs", f"linux-base-{UNSTABLE}", "7.2.13-1",
         {f"usr/lib/modules/{UNSTABLE}/config": "CONFIG_NVME_TARGET_RDMA=m\n",
          f"usr/lib/modules/{UNSTABLE}/System.map": ""})
    config = B.kernel_config(_image(cache, "u1", UNSTABLE, suite="trixie", kernel_suite="sid"))
    assert config.name == f"config-{UNSTABLE}" and config.read_text() == "CONFIG_NVME_TARGET_RDMA=m\n"


def test_kernel_config_of_a_whole_kernel_package_is_its_boot_config(tmp_path, monkeypatch):
    monkeypatch.setenv("NVMEOF_ROCE_CACHE", str(tmp_path))
    cache = tmp_path / "lab"
    _deb(cache / "debs", "linux-image-6.1.0-56-amd64", "6.1.192-2", {"boot/config-6.1.0-56-amd64": "CONFIG_X=y\n"})
    assert B.kernel_config(_image(cache, "b61", "6.1.0-56-amd64")).read_text() == "CONFIG_X=y\n"


def test_a_missing_kernel_config_names_what_was_looked_for_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("NVMEOF_ROCE_CACHE", str(tmp_path))
    cache = tmp_path / "lab"
    _deb(cache / "debs", f"linux-image-{UNSTABLE}", "7.2.13-1", {f"usr/share/doc/linux-image-{UNSTABLE}/x": ""})
    with pytest.raises(NvmeofError) as exc:
        B.kernel_config(_image(cache, "u1", UNSTABLE, suite="trixie", kernel_suite="sid"))
    assert f"usr/lib/modules/{UNSTABLE}/config in linux-base-{UNSTABLE} (not downloaded)" in exc.value.message
    assert f"boot/config-{UNSTABLE} in linux-image-{UNSTABLE}_7.2.13-1_amd64.deb" in exc.value.message
    assert exc.value.fix.endswith("lab build --force --kernel unstable")


class FakeApt:
    """apt-get as the lab calls it: records the options, 'downloads' the packages into Dir::Cache::Archives."""

    def __init__(self, downloads, returncode=0, stderr=""):
        self.calls, self.downloads, self.returncode, self.stderr = [], downloads, returncode, stderr

    def __call__(self, args, **kw):
        assert args[0] == "apt-get"
        self.calls.append(args)
        archives = next(a.split("=", 1)[1] for a in args if a.startswith("-oDir::Cache::Archives="))
        if self.returncode == 0:
            for name in self.downloads:
                (B.Path(archives) / name).write_bytes(b"")
        return subprocess.CompletedProcess(args, self.returncode, stdout="", stderr=self.stderr)


def _status(image, out):
    out.write_text("Package: libc6\nStatus: install ok installed\nVersion: 2.41-12\n")
    return out


TRIXIE_DEBS = ["xfsprogs_6.13.0-2+deb13u1_amd64.deb", "libicu76_76.1-4_amd64.deb",
               "liburcu8t64_0.15.2-2_amd64.deb", "bsdextrautils_2.41.5-0+deb13u1_amd64.deb",
               "gawk_1%3a5.2.1-2+b1_amd64.deb"]


def test_extra_packages_come_from_the_guests_own_suite(tmp_path, monkeypatch):
    """The trixie guest gets trixie's xfsprogs (libicu76), not bookworm's (libicu72, which trixie lacks): apt
    reads the lab's trixie state with the image's own dpkg status.  A bookworm image keeps the machine's apt."""
    monkeypatch.setenv("NVMEOF_ROCE_CACHE", str(tmp_path))
    cache = tmp_path / "lab"
    suites = []
    monkeypatch.setattr(aptconfig, "apt_options", lambda suite: suites.append(suite) or
                        ([] if suite == "bookworm" else [f"-oDir::Etc::SourceList=/lab/apt/{suite}/sources.list",
                                                         f"-oDir::State::Status=/lab/apt/{suite}/status"]))
    monkeypatch.setattr(B, "image_dpkg_status", _status)
    apt = FakeApt(TRIXIE_DEBS)
    monkeypatch.setattr(B.subprocess, "run", apt)
    trixie = _image(cache, "t1", "6.12.117+deb13-amd64", suite="trixie")
    debs = B.extra_debs(trixie)
    assert suites == ["trixie"]
    args = apt.calls[0]
    assert "-oDir::Etc::SourceList=/lab/apt/trixie/sources.list" in args
    # the image's status replaces the private state's (apt takes the last one given)
    statuses = [a for a in args if a.startswith("-oDir::State::Status=")]
    assert statuses[-1] == f"-oDir::State::Status={cache / 'blktests/debs/t1/partial/status'}"
    assert args[-4:] == ["install", "xfsprogs", "bsdextrautils", "gawk"] and "--download-only" in args
    assert sorted(p.name for p in debs) == sorted(TRIXIE_DEBS)
    assert all(p.parent == cache / "blktests/debs/t1" for p in debs)

    # Cached per image: no apt the second time.
    assert B.extra_debs(trixie) == debs and len(apt.calls) == 1

    bookworm = _image(cache, "b61", "6.1.0-56-amd64")
    apt.downloads = ["xfsprogs_6.1.0-1_amd64.deb", "libicu72_72.1-3_amd64.deb", "bsdextrautils_2.38.1_amd64.deb",
                     "gawk_1%3a5.2.1-2_amd64.deb"]
    B.extra_debs(bookworm)
    assert suites == ["trixie", "bookworm"]
    assert not any(a.startswith("-oDir::Etc::SourceList=") for a in apt.calls[1])


def test_extra_packages_apt_cannot_resolve_end_in_an_error_naming_them(tmp_path, monkeypatch):
    monkeypatch.setenv("NVMEOF_ROCE_CACHE", str(tmp_path))
    cache = tmp_path / "lab"
    monkeypatch.setattr(aptconfig, "apt_options", lambda suite: [])
    monkeypatch.setattr(B, "image_dpkg_status", _status)
    monkeypatch.setattr(B.subprocess, "run", FakeApt([], returncode=100, stderr=(
        "The following packages have unmet dependencies:\n xfsprogs : Depends: libicu72 (>= 72.1~rc-1~) but it "
        "is not installable\nE: Unable to correct problems, you have held broken packages.")))
    with pytest.raises(NvmeofError) as exc:
        B.extra_debs(_image(cache, "t1", "6.12.117+deb13-amd64", suite="trixie"))
    assert "for the trixie guest" in exc.value.message and "libicu72" in exc.value.message
    assert "apt-get update" in exc.value.fix
