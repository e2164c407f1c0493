"""The lab from the host: apt source parsing, and real boots of the cached guest image."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from nvmeof_roce.errors import NvmeofError
from nvmeof_roce.lab import aptconfig, aptresolve, image as lab_image


def test_mirror_from_deb822_sources(tmp_path):
    d = tmp_path / "etc/apt/sources.list.d"
    d.mkdir(parents=True)
    (d / "debian.sources").write_text(textwrap.dedent("""\
        Types: deb
        URIs: http://mirror.example.invalid/debian/
        Suites: bookworm bookworm-updates
        Components: main
        Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

        Types: deb
        URIs: http://mirror.example.invalid/debian-security
        Suites: bookworm-security
        Components: main
        """))
    assert aptconfig.debian_mirror(str(tmp_path)) == "http://mirror.example.invalid/debian"


def test_mirror_from_one_line_sources_list(tmp_path):
    (tmp_path / "etc/apt").mkdir(parents=True)
    (tmp_path / "etc/apt/sources.list").write_text(
        "# comment\ndeb [arch=amd64] http://other.example.invalid/debian bookworm main contrib\n")
    assert aptconfig.debian_mirror(str(tmp_path)) == "http://other.example.invalid/debian"


def test_no_bookworm_source_names_the_fix(tmp_path):
    (tmp_path / "etc/apt").mkdir(parents=True)
    (tmp_path / "etc/apt/sources.list").write_text("deb http://x.invalid/ubuntu jammy main\n")
    with pytest.raises(NvmeofError) as err:
        aptconfig.debian_mirror(str(tmp_path))
    assert "bookworm" in str(err.value) and "fix:" in str(err.value)


def test_kernel_release_from_package():
    assert aptconfig.kernel_release("linux-image-6.1.0-56-amd64") == "6.1.0-56-amd64"


def plan_of(package, version="1"):
    return aptresolve.KernelPlan("linux-image-amd64", package, version, {package: version})


def test_image_inputs_key_changes_with_guest_packages(monkeypatch):
    monkeypatch.setattr(aptconfig, "resolve_kernel", lambda kernel="6.1": plan_of("linux-image-6.1.0-56-amd64"))
    base = lab_image.image_inputs()
    monkeypatch.setattr(lab_image, "GUEST_PACKAGES", lab_image.GUEST_PACKAGES + ["tcpdump"])
    changed = lab_image.image_inputs()
    assert lab_image.inputs_key(base) != lab_image.inputs_key(changed)
    assert "pytest==9.2.0" in base["python_requirements"]


def test_kernel_generations_resolve_to_their_own_package_and_key(monkeypatch):
    packages = {"linux-image-amd64": "linux-image-6.1.0-56-amd64",
                "linux-image-6.12-amd64": "linux-image-6.12.117+deb12-amd64"}
    monkeypatch.setattr(aptconfig, "resolve_kernel",
                        lambda kernel: plan_of(packages[aptconfig.kernel_meta_package(kernel)]))
    old = lab_image.image_inputs("6.1")
    new = lab_image.image_inputs("6.12")
    assert old["kernel_package"] == "linux-image-6.1.0-56-amd64"
    assert new["kernel_package"] == "linux-image-6.12.117+deb12-amd64"
    assert lab_image.inputs_key(old) != lab_image.inputs_key(new)
    assert aptconfig.kernel_generation(aptconfig.kernel_release(new["kernel_package"])) == "6.12"
    assert aptconfig.kernel_generation("6.1.0-56-amd64") == "6.1"


def test_unknown_kernel_generation_names_the_choices():
    with pytest.raises(NvmeofError) as err:
        aptconfig.resolve_kernel("5.10")
    assert "6.1" in str(err.value) and "6.12" in str(err.value)


def test_pruning_keeps_the_other_kernel_generation(tmp_path, monkeypatch):
    monkeypatch.setenv("NVMEOF_ROCE_CACHE", str(tmp_path))
    images = tmp_path / "lab" / "images"
    made = {}
    for i, (name, release) in enumerate([("a61", "6.1.0-56-amd64"), ("b612", "6.12.117+deb12-amd64"),
                                          ("c61", "6.1.0-57-amd64"), ("d61", "6.1.0-58-amd64")]):
        d = images / name
        d.mkdir(parents=True)
        (d / "manifest.json").write_text(json.dumps({"kernel_release": release}))
        os.utime(d, (1000 + i, 1000 + i))
        made[name] = d
    lab_image._prune_old_images(keep=made["d61"])
    assert sorted(p.name for p in images.iterdir()) == ["b612", "c61", "d61"]


def test_trixie_generation_is_read_from_the_bookworm_mirror_through_a_private_apt_state(tmp_path, monkeypatch):
    d = tmp_path / "etc/apt/sources.list.d"
    d.mkdir(parents=True)
    (d / "debian.sources").write_text("Types: deb\nURIs: http://mirror.example.invalid/debian\n"
                                      "Suites: bookworm bookworm-updates\nComponents: main\n")
    # A machine that names only bookworm: trixie and sid come from the same archive.
    assert aptconfig.debian_mirror(str(tmp_path), suite="trixie") == "http://mirror.example.invalid/debian"
    monkeypatch.setenv("NVMEOF_ROCE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(aptconfig, "debian_mirror", lambda root="/", suite="bookworm": "http://m.invalid/debian")
    updates = []
    monkeypatch.setattr(aptconfig, "_apt", lambda args: updates.append(args) or "")
    assert aptconfig.apt_options("bookworm") == []  # the machine's own apt, untouched
    options = aptconfig.apt_options("sid")
    state = tmp_path / "cache/lab/apt/sid"
    assert (state / "sources.list").read_text() == \
        f"deb [signed-by={aptconfig.KEYRING}] http://m.invalid/debian sid main\n"
    assert f"-oDir::Etc::SourceList={state / 'sources.list'}" in options
    assert f"-oDir::State::Lists={state / 'lists'}" in options
    assert updates and updates[0][-2:] == ["update", "-qq"]


def test_bookworm_image_inputs_hold_the_kernel_versions_and_trixie_has_its_own(monkeypatch):
    """The bookworm images' inputs: the guest's packages and Python pins, the kernel package and every part of
    it at the version the archive resolved (a new upload builds a new image); trixie and unstable add their
    suites and Python."""
    packages = {("linux-image-amd64", "bookworm"): "linux-image-6.1.0-56-amd64",
                ("linux-image-6.12-amd64", "bookworm"): "linux-image-6.12.117+deb12-amd64",
                ("linux-image-amd64", "trixie"): "linux-image-6.12.117+deb13-amd64",
                ("linux-image-amd64", "sid"): "linux-image-7.2.13+deb14-amd64"}

    def resolve(kernel):
        gen = aptconfig.generation(kernel)
        return plan_of(packages[gen.kernel_meta, gen.kernel_suite])
    monkeypatch.setattr(aptconfig, "resolve_kernel", resolve)
    for kernel in ("6.1", "6.12"):
        inputs = lab_image.image_inputs(kernel)
        assert sorted(inputs) == ["format", "guest_files", "kernel_package", "kernel_parts", "packages",
                                  "python_requirements", "suite"]
        assert inputs["kernel_parts"] == {inputs["kernel_package"]: "1"}
        assert inputs["suite"] == "bookworm"
        assert inputs["packages"] == sorted(lab_image.GUEST_PACKAGES + lab_image.CEPH_PACKAGES)
    trixie, unstable = lab_image.image_inputs("trixie"), lab_image.image_inputs("unstable")
    assert trixie["suite"] == unstable["suite"] == "trixie" and trixie["python"] == "3.13"
    assert trixie["kernel_package"] == "linux-image-6.12.117+deb13-amd64"
    assert unstable["kernel_package"] == "linux-image-7.2.13+deb14-amd64" and unstable["kernel_suite"] == "sid"
    assert {"gcc", "python3-dev", "libibverbs-dev", "librdmacm-dev", "liburing-dev"} <= set(trixie["packages"])
    assert not set(lab_image.CEPH_PACKAGES) & set(trixie["packages"])  # debootstrap cannot set up its systemd
    keys = {lab_image.inputs_key(lab_image.image_inputs(k)) for k in ("6.1", "6.12", "trixie", "unstable")}
    assert len(keys) == 4


def test_trixie_images_are_their_own_generation_and_pruning_spares_bookworm_6_12(tmp_path, monkeypatch):
    """trixie's kernel is a 6.12 too: building trixie images must not prune the bookworm 6.12 image."""
    monkeypatch.setenv("NVMEOF_ROCE_CACHE", str(tmp_path))
    images = tmp_path / "lab" / "images"
    made = {}
    trixie = {"suite": "trixie", "kernel_suite": "trixie"}
    for i, (name, release, inputs) in enumerate([
            ("b612", "6.12.117+deb12-amd64", {"suite": "bookworm"}),
            ("t1", "6.12.117+deb13-amd64", trixie), ("t2", "6.12.118+deb13-amd64", trixie),
            ("u1", "7.2.13+deb14-amd64", {"suite": "trixie", "kernel_suite": "sid"}),
            ("t3", "6.12.119+deb13-amd64", trixie)]):
        d = images / name
        d.mkdir(parents=True)
        (d / "manifest.json").write_text(json.dumps({"kernel_release": release, "inputs": inputs}))
        os.utime(d, (1000 + i, 1000 + i))
        made[name] = d
    assert [lab_image.image_kernel(lab_image.LabImage(made[n])) for n in ("b612", "t1", "u1")] == \
        ["6.12", "trixie", "unstable"]
    lab_image._prune_old_images(keep=made["t3"])
    assert sorted(p.name for p in images.iterdir()) == ["b612", "t2", "t3", "u1"]


# --- real boots of the lab guest (the image is built by `make test` before this tier runs) ---

def _built_image():
    try:
        image = lab_image.image_for(lab_image.image_inputs())
    except NvmeofError as exc:
        pytest.skip(f"lab inputs unavailable: {exc.message}")
    if not image.complete():
        pytest.skip("lab image not built: run `nvmeof-roce lab build` (make test builds it first)")
    return image


def _lab(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "nvmeof_roce", "lab", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_lab_run_ibv_devinfo_reports_port_active():
    _built_image()
    proc = _lab("run", "--timeout", "300", "--", "ibv_devinfo")
    assert proc.returncode == 0, proc.stderr
    assert "PORT_ACTIVE" in proc.stdout
    assert "link_layer:\t\tEthernet" in proc.stdout


def test_lab_run_passes_the_exit_code_through():
    _built_image()
    assert _lab("run", "--timeout", "300", "--", "false").returncode == 1
    assert _lab("run", "--timeout", "300", "--", "sh", "-c", "exit 7").returncode == 7


def test_lab_run_share_is_writable_from_the_guest(tmp_path):
    _built_image()
    proc = _lab("run", "--share", str(tmp_path), "--timeout", "300", "--",
                "sh", "-c", "cat /sys/class/infiniband/rxe0/ports/1/state > /mnt/share/state")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "state").read_text().strip() == "4: ACTIVE"


def test_hung_guest_is_killed_at_the_timeout_and_no_qemu_remains(tmp_path):
    _built_image()
    marker = tmp_path / "hang-marker"
    marker.mkdir()
    proc = _lab("run", "--share", str(marker), "--timeout", "20", "--", "sleep", "600", timeout=120)
    assert proc.returncode == 1
    assert "did not finish within 20 s" in proc.stderr and "killed" in proc.stderr
    left = subprocess.run(["pgrep", "-f", f"path={marker}"], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"QEMU still running: {left.stdout}"


def test_lab_status_json_describes_the_cached_image():
    image = _built_image()
    proc = _lab("status", "--json")
    assert proc.returncode == 0
    import json
    status = json.loads(proc.stdout)
    assert status["image"]["path"] == str(image.directory)
    assert status["image"]["up_to_date"] is True
    assert status["image"]["kernel_release"].endswith("-amd64")


def test_lab_run_memory_and_cpus_reach_qemu(tmp_path):
    import argparse
    from nvmeof_roce.lab.commands import cpu_count, memory_size
    from nvmeof_roce.lab.vm import LabRun, qemu_args

    assert memory_size("2G") == 2048
    assert memory_size("1536M") == 1536
    assert memory_size("3072") == 3072
    for bad in ("2T", "lots", "256M"):
        with pytest.raises(argparse.ArgumentTypeError):
            memory_size(bad)
    assert cpu_count("16") == 16
    for bad in ("0", "sixteen", "65"):
        with pytest.raises(argparse.ArgumentTypeError):
            cpu_count(bad)
    image = type("Image", (), {"kernel": tmp_path / "k", "initrd": tmp_path / "i", "disk": tmp_path / "d"})()
    args = qemu_args(image, LabRun(command=["true"], project=tmp_path, cpus=16, memory_mb=2048), tmp_path)
    assert args[args.index("-smp") + 1] == "16"
    assert args[args.index("-m") + 1] == "2048M"


