"""The lab's build inputs against the ways Debian's archive moves (nvmeof_roce/lab/aptresolve.py), replayed from
recorded `apt-cache show` outputs (fixtures/apt-drift/README.md): each case ends in an image plan or in an error
naming the package, the versions on offer and the relation it needed, never in a traceback."""
import re
from pathlib import Path

import pytest

from nvmeof_roce.errors import NvmeofError
from nvmeof_roce.lab import aptconfig, aptresolve, commands as lab_commands
from nvmeof_roce.lab import image as lab_image
from nvmeof_roce.lab import siw
from nvmeof_roce.lab.aptresolve import (AptArchive, InputUnavailable, Relation, compare_versions, kernel_plan,
                                        parse_depends, siw_plan)

RECORDED = Path(__file__).parent / "fixtures" / "apt-drift" / "2026-11-28-bookworm"


class RecordedArchive(AptArchive):
    """An archive as recorded on one day, with the changes a test applies to it."""

    def __init__(self, directory: Path = RECORDED):
        super().__init__()
        self.texts = {p.name[:-len(".show")]: p.read_text() for p in directory.glob("*.show")}

    def show_text(self, package):
        return self.texts.get(package, "")

    def drop(self, package, *versions):
        stanzas = re.split(r"\n\s*\n", self.texts[package])
        self.texts[package] = "\n\n".join(s for s in stanzas
                                          if not any(f"\nVersion: {v}\n" in f"\n{s}\n" for v in versions))
        self._shown.clear()

    def add(self, package, version, depends=""):
        stanza = f"Package: {package}\nVersion: {version}\n" + (f"Depends: {depends}\n" if depends else "")
        self.texts[package] = stanza + "\n" + self.texts.get(package, "")
        self._shown.clear()

    def offers(self, package, version):
        return any(pv.version == version for pv in self.versions(package))


def test_versions_sort_as_dpkg_sorts_them():
    ordered = ["6.1.176-1", "6.1.192-1", "6.1.192-2", "6.1.192-3", "6.1.192-10", "6.12.117-1~deb12u1",
               "6.12.117-1", "6.12.117-1+b1", "1:0.1-1"]
    for i, a in enumerate(ordered):
        for j, b in enumerate(ordered):
            assert compare_versions(a, b) == (i > j) - (i < j), (a, b)
    assert compare_versions("1.0~rc1-1", "1.0-1") < 0 and compare_versions("1.00", "1.0") == 0


def test_depends_fields_parse_into_relations_with_alternatives():
    entries = parse_depends("linux-headers-6.1.0-56-common (= 6.1.192-2), linux-kbuild-6.1 (>= 6.1.192-2), "
                            "dracut | initramfs-tools (>= 0.120+deb8u2) | linux-initramfs-tool, libc6:any [amd64]")
    assert entries[0] == [Relation("linux-headers-6.1.0-56-common", "=", "6.1.192-2")]
    assert entries[1][0].accepts("6.1.192-3") and not entries[1][0].accepts("6.1.176-1")
    assert [r.package for r in entries[2]] == ["dracut", "initramfs-tools", "linux-initramfs-tool"]
    assert entries[3] == [Relation("libc6")]


def test_todays_kbuild_skew_takes_kbuild_at_the_version_the_headers_accept():
    """2026-11-28: the image and its headers at 6.1.192-2, linux-kbuild-6.1 only at 6.1.192-3.  The lab pinned
    every input to the image's version and asked apt for linux-kbuild-6.1=6.1.192-2, which is not on offer."""
    archive = RecordedArchive()
    kernel = kernel_plan("linux-image-amd64", archive)
    assert (kernel.package, kernel.version) == ("linux-image-6.1.0-56-amd64", "6.1.192-2")
    assert kernel.parts == {"linux-image-6.1.0-56-amd64": "6.1.192-2"}
    plan = siw_plan(kernel, archive)
    assert plan.inputs == {"linux-headers-6.1.0-56-amd64": "6.1.192-2", "linux-headers-6.1.0-56-common": "6.1.192-2",
                           "linux-kbuild-6.1": "6.1.192-3", "linux-source-6.1": "6.1.192-2"}
    assert plan.notes == []
    for name, version in plan.inputs.items():  # every input is one apt-get download can fetch today
        assert archive.offers(name, version), (name, version)


def test_the_6_12_kernel_takes_its_unversioned_kbuild_and_leaves_the_image_alternative_alone():
    archive = RecordedArchive()
    kernel = kernel_plan("linux-image-6.12-amd64", archive)
    assert (kernel.package, kernel.version) == ("linux-image-6.12.117+deb12-amd64", "6.12.117-1~deb12u1")
    plan = siw_plan(kernel, archive)
    assert plan.inputs == {"linux-headers-6.12.117+deb12-amd64": "6.12.117-1~deb12u1",
                           "linux-headers-6.12.117+deb12-common": "6.12.117-1~deb12u1",
                           "linux-kbuild-6.12.117+deb12": "6.12.117-1~deb12u1",
                           "linux-source-6.12": "6.12.117-1~deb12u1"}


def test_a_superseded_source_revision_is_taken_at_the_newer_revision_of_the_same_kernel_version():
    """The recording with linux-source-6.1 6.1.192-2 and -1 gone: 6.1.192-3 carries the same driver."""
    archive = RecordedArchive()
    archive.drop("linux-source-6.1", "6.1.192-2", "6.1.192-1")
    plan = siw_plan(kernel_plan("linux-image-amd64", archive), archive)
    assert plan.inputs["linux-source-6.1"] == "6.1.192-3"
    assert plan.notes and "6.1.192-2 is gone" in plan.notes[0] and "6.1.192-3" in plan.notes[0]


def test_a_source_of_another_kernel_version_is_refused_naming_what_is_on_offer():
    archive = RecordedArchive()
    archive.drop("linux-source-6.1", "6.1.192-3", "6.1.192-2", "6.1.192-1")
    with pytest.raises(InputUnavailable) as err:
        siw_plan(kernel_plan("linux-image-amd64", archive), archive)
    message = str(err.value)
    assert "linux-source-6.1 (= 6.1.192-2)" in message and "6.1.192" in message
    assert "linux-source-6.1 6.1.190-1" in message and "siw.ko for 6.1.0-56-amd64" in message
    assert "fix:" in message


def test_the_meta_package_moved_to_a_new_abi_plans_the_new_kernel_and_a_new_image_key(monkeypatch):
    """The recording with a new upload: linux-image-amd64 6.1.193-1 depends on linux-image-6.1.0-57-amd64."""
    archive = RecordedArchive()
    old_kernel = kernel_plan("linux-image-amd64", archive)
    archive.add("linux-image-amd64", "6.1.193-1", "linux-image-6.1.0-57-amd64 (= 6.1.193-1)")
    archive.add("linux-image-6.1.0-57-amd64", "6.1.193-1", "kmod, linux-base (>= 4.3~)")
    archive.add("linux-headers-6.1.0-57-amd64", "6.1.193-1",
                "linux-headers-6.1.0-57-common (= 6.1.193-1), linux-kbuild-6.1 (>= 6.1.193-1), "
                "linux-compiler-gcc-12-x86")
    archive.add("linux-headers-6.1.0-57-common", "6.1.193-1")
    archive.add("linux-kbuild-6.1", "6.1.193-1")
    archive.add("linux-source-6.1", "6.1.193-1")
    kernel = kernel_plan("linux-image-amd64", archive)
    assert (kernel.package, kernel.version) == ("linux-image-6.1.0-57-amd64", "6.1.193-1")
    assert siw_plan(kernel, archive).inputs == {
        "linux-headers-6.1.0-57-amd64": "6.1.193-1", "linux-headers-6.1.0-57-common": "6.1.193-1",
        "linux-kbuild-6.1": "6.1.193-1", "linux-source-6.1": "6.1.193-1"}
    keys = set()
    for plan in (old_kernel, kernel):
        monkeypatch.setattr(aptconfig, "resolve_kernel", lambda k="6.1", plan=plan: plan)
        inputs = lab_image.image_inputs("6.1")
        assert inputs["kernel_parts"] == plan.parts
        keys.add(lab_image.inputs_key(inputs))
    assert len(keys) == 2


def test_a_new_revision_of_the_same_kernel_package_is_a_new_image(monkeypatch):
    """The cache key holds the versions used: a rebuilt image package at the same ABI builds a new image."""
    keys = set()
    for version in ("6.1.192-2", "6.1.192-3"):
        plan = aptresolve.KernelPlan("linux-image-amd64", "linux-image-6.1.0-56-amd64", version,
                                     {"linux-image-6.1.0-56-amd64": version})
        monkeypatch.setattr(aptconfig, "resolve_kernel", lambda k="6.1", plan=plan: plan)
        keys.add(lab_image.inputs_key(lab_image.image_inputs("6.1")))
    assert len(keys) == 2


def test_an_input_gone_entirely_names_the_package_the_versions_on_offer_and_the_relation():
    """The recording with linux-kbuild-6.1 6.1.192-3 withdrawn: only 6.1.176-1 is left, older than the headers
    accept.  The image still plans (siw.ko is not part of it)."""
    archive = RecordedArchive()
    archive.drop("linux-kbuild-6.1", "6.1.192-3")
    kernel = kernel_plan("linux-image-amd64", archive)
    assert kernel.package == "linux-image-6.1.0-56-amd64"
    with pytest.raises(InputUnavailable) as err:
        siw_plan(kernel, archive)
    assert err.value.relation == "linux-kbuild-6.1 (>= 6.1.192-2)"
    assert err.value.offered == ["linux-kbuild-6.1 6.1.176-1"]
    assert "linux-headers-6.1.0-56-amd64 6.1.192-2" in str(err.value)
    archive.texts.pop("linux-kbuild-6.1")
    archive._shown.clear()
    with pytest.raises(InputUnavailable) as err:
        siw_plan(kernel, archive)
    assert "offers none" in str(err.value)


def test_a_kernel_image_gone_from_the_archive_is_an_error_not_a_traceback():
    archive = RecordedArchive()
    archive.texts.pop("linux-image-6.1.0-56-amd64")
    with pytest.raises(InputUnavailable) as err:
        kernel_plan("linux-image-amd64", archive)
    assert "linux-image-6.1.0-56-amd64 (= 6.1.192-2)" in str(err.value)
    assert "needed by linux-image-amd64 6.1.192-2" in str(err.value)
    archive.texts.pop("linux-image-amd64")
    with pytest.raises(NvmeofError):
        kernel_plan("linux-image-amd64", archive)


def test_a_split_kernel_package_brings_its_binary_and_modules_at_their_versions():
    """Debian unstable splits the kernel: linux-image-RELEASE depends on linux-base-RELEASE (config,
    modules.builtin), linux-binary-RELEASE (vmlinuz) and linux-modules-RELEASE, each (= its version)."""
    archive = RecordedArchive()
    archive.texts = {}
    archive.add("linux-image-amd64", "7.2.13-1", "linux-image-7.2.13+deb14-amd64 (= 7.2.13-1)")
    archive.add("linux-image-7.2.13+deb14-amd64", "7.2.13-1",
                "dracut | initramfs-tools (>= 0.120+deb8u2) | linux-initramfs-tool, linux-base-7.2.13+deb14-amd64 "
                "(= 7.2.13-1), linux-binary-7.2.13+deb14-amd64 (= 7.2.13-1), linux-modules-7.2.13+deb14-amd64 "
                "(= 7.2.13-1)")
    for part in ("base", "binary", "modules"):
        archive.add(f"linux-{part}-7.2.13+deb14-amd64", "7.2.13-1")
    plan = kernel_plan("linux-image-amd64", archive)
    assert plan.parts == {f"linux-{p}-7.2.13+deb14-amd64": "7.2.13-1" for p in ("image", "base", "binary", "modules")}
    archive.drop("linux-modules-7.2.13+deb14-amd64", "7.2.13-1")
    with pytest.raises(InputUnavailable) as err:
        kernel_plan("linux-image-amd64", archive)
    assert "linux-modules-7.2.13+deb14-amd64 (= 7.2.13-1)" in str(err.value)


def test_a_run_that_asks_for_siw_goes_on_without_it_saying_why(monkeypatch, tmp_path):
    """--siw where an input is gone: the run gets no module and the reason, which the iWARP tests print."""
    monkeypatch.setenv("NVMEOF_ROCE_CACHE", str(tmp_path))
    archive = RecordedArchive()
    archive.drop("linux-kbuild-6.1", "6.1.192-3")
    monkeypatch.setattr(siw, "AptArchive", lambda options=None: archive)
    image = lab_image.LabImage(tmp_path / "image")
    image.directory.mkdir()
    image.manifest_path.write_text('{"inputs": {"suite": "bookworm", "kernel_package": "linux-image-6.1.0-56-amd64",'
                                   ' "kernel_parts": {"linux-image-6.1.0-56-amd64": "6.1.192-2"}}}')
    modules, missing = lab_commands.run_modules(image, siw_wanted=True)
    assert modules == {} and "linux-kbuild-6.1 (>= 6.1.192-2)" in missing["siw"]
    assert lab_commands.run_modules(image, siw_wanted=False) == ({}, {})


def test_unstable_has_no_siw_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("NVMEOF_ROCE_CACHE", str(tmp_path))
    image = lab_image.LabImage(tmp_path / "image")
    image.directory.mkdir()
    image.manifest_path.write_text('{"inputs": {"suite": "trixie", "kernel_suite": "sid", "kernel_package": '
                                   '"linux-image-7.2.13+deb14-amd64", "kernel_parts": '
                                   '{"linux-image-7.2.13+deb14-amd64": "7.2.13-1"}}}')
    with pytest.raises(NvmeofError) as err:
        siw.for_image(image)
    assert "compiler" in str(err.value) and "7.2.13+deb14-amd64" in str(err.value)


def test_an_image_without_recorded_kernel_versions_asks_for_a_rebuild(tmp_path):
    image = lab_image.LabImage(tmp_path)
    image.manifest_path.write_text('{"inputs": {"kernel_package": "linux-image-6.1.0-56-amd64"}}')
    with pytest.raises(NvmeofError) as err:
        lab_image.kernel_plan_of(image)
    assert "lab build --force" in str(err.value)
