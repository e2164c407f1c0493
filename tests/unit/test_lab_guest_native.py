"""lab/guest_native.py: the native module for a Python 3.13 guest, built once per image and sources."""
import argparse
import json
import os
import subprocess
from pathlib import Path

import pytest

from nvmeof_roce.errors import NvmeofError
from nvmeof_roce.lab import commands, guest_native
from nvmeof_roce.lab import image as lab_image

SO_313 = "_native.cpython-313-x86_64-linux-gnu.so"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NVMEOF_ROCE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "lab"


def _image(cache, key, suite="trixie", python="3.13"):
    d = cache / "images" / key
    d.mkdir(parents=True)
    inputs = {"suite": suite}
    if suite != "bookworm":
        inputs.update(python=python, kernel_suite=suite)
    (d / "manifest.json").write_text(json.dumps({"key": key, "kernel_release": "6.12.117+deb13-amd64",
                                                 "inputs": inputs}))
    return lab_image.LabImage(d)


def _project(tmp_path):
    p = tmp_path / "checkout"
    (p / "csrc").mkdir(parents=True)
    (p / "nvmeof_roce").mkdir()
    (p / "setup.py").write_text("setup()\n")
    (p / "csrc" / "module.c").write_text("int x;\n")
    (p / "csrc" / "native.h").write_text("#define N 1\n")
    (p / "nvmeof_roce" / "__init__.py").write_text("")
    (p / "nvmeof_roce" / "_native.cpython-311-x86_64-linux-gnu.so").write_bytes(b"host 3.11 build")
    return p


class FakeBuild:
    """Stands for the chroot build: writes a module whose bytes name the sources it was built from."""

    def __init__(self):
        self.calls = []

    def __call__(self, image, project, out):
        self.calls.append((image.directory.name, guest_native.source_hash(project)))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(f"built for {image.directory.name} from {(project / 'csrc/module.c').read_text()}".encode())


def test_a_bookworm_guest_uses_the_hosts_module_and_builds_nothing(cache, tmp_path):
    build = FakeBuild()
    project = _project(tmp_path)
    assert guest_native.ensure(_image(cache, "b61", suite="bookworm"), project, build=build) is None
    assert build.calls == [] and not (project / "nvmeof_roce" / SO_313).exists()


def test_built_once_per_image_and_sources_and_copied_beside_the_hosts_module(cache, tmp_path):
    build = FakeBuild()
    project = _project(tmp_path)
    trixie = _image(cache, "t1")
    dest = guest_native.ensure(trixie, project, build=build)
    assert dest == project / "nvmeof_roce" / SO_313
    assert dest.read_bytes() == b"built for t1 from int x;\n"
    assert (project / "nvmeof_roce" / "_native.cpython-311-x86_64-linux-gnu.so").read_bytes() == b"host 3.11 build"
    digest = guest_native.source_hash(project)
    assert (cache / "native" / "t1" / digest / SO_313).exists()
    assert len(build.calls) == 1

    # The same image and sources again: nothing is built, not even when a source's time changes.
    os.utime(project / "csrc" / "module.c", (1, 1))
    (project / "nvmeof_roce" / "cli.py").write_text("# not a source of the module\n")
    guest_native.ensure(trixie, project, build=build)
    assert len(build.calls) == 1

    # A C file, a header or setup.py changed: built again, once.
    (project / "csrc" / "module.c").write_text("int y;\n")
    guest_native.ensure(trixie, project, build=build)
    guest_native.ensure(trixie, project, build=build)
    assert len(build.calls) == 2 and dest.read_bytes() == b"built for t1 from int y;\n"
    for changed in ("csrc/native.h", "setup.py"):
        (project / changed).write_text((project / changed).read_text() + "\n")
        guest_native.ensure(trixie, project, build=build)
    assert len(build.calls) == 4

    # Another image (a rebuilt trixie, or unstable): its own build.
    guest_native.ensure(_image(cache, "u1"), project, build=build)
    assert [c[0] for c in build.calls] == ["t1", "t1", "t1", "t1", "u1"]
    assert dest.read_bytes() == b"built for u1 from int y;\n"

    # Back to the first image: the cached module is copied in, replacing the other image's, without a build.
    guest_native.ensure(trixie, project, build=build)
    assert len(build.calls) == 5 and dest.read_bytes() == b"built for t1 from int y;\n"


def test_a_stale_module_in_the_checkout_is_replaced_from_the_cache(cache, tmp_path):
    build = FakeBuild()
    project = _project(tmp_path)
    trixie = _image(cache, "t1")
    guest_native.ensure(trixie, project, build=build)
    (project / "nvmeof_roce" / SO_313).write_bytes(b"a build of older sources by hand")
    guest_native.ensure(trixie, project, build=build)
    assert (project / "nvmeof_roce" / SO_313).read_bytes() == b"built for t1 from int x;\n"
    assert len(build.calls) == 1


def test_a_failed_build_caches_nothing_and_is_tried_again(cache, tmp_path):
    project = _project(tmp_path)
    trixie = _image(cache, "t1")

    def failing(image, project, out):
        raise NvmeofError("building the native module for the guest's Python failed (exit 1)", "fix the build")
    with pytest.raises(NvmeofError, match="failed"):
        guest_native.ensure(trixie, project, build=failing)
    assert not list((cache / "native").rglob("*.so"))
    build = FakeBuild()
    guest_native.ensure(trixie, project, build=build)
    assert len(build.calls) == 1


def test_builds_of_images_gone_from_the_cache_and_old_sources_are_pruned(cache, tmp_path):
    build = FakeBuild()
    project = _project(tmp_path)
    gone = _image(cache, "old")
    guest_native.ensure(gone, project, build=build)
    (cache / "images" / "old" / "manifest.json").unlink()
    (cache / "images" / "old").rmdir()
    trixie = _image(cache, "t1")
    for n in range(5):
        (project / "csrc" / "module.c").write_text(f"int v{n};\n")
        guest_native.ensure(trixie, project, build=build)
    assert not (cache / "native" / "old").exists()
    assert len(list((cache / "native" / "t1").iterdir())) == guest_native.KEEP_PER_IMAGE


def test_a_project_without_the_modules_sources_is_left_alone(cache, tmp_path):
    build = FakeBuild()
    bare = tmp_path / "bare"
    bare.mkdir()
    assert guest_native.ensure(_image(cache, "t1"), bare, build=build) is None
    assert build.calls == []


def test_the_guest_module_is_named_for_its_python_and_ignored_by_git():
    assert guest_native.module_name("3.13") == SO_313
    checkout = Path(__file__).resolve().parents[2]
    if not (checkout / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", "-q", f"nvmeof_roce/{SO_313}"], cwd=checkout)
    assert ignored.returncode == 0


def test_lab_run_builds_the_module_before_the_guest_boots(cache, tmp_path, monkeypatch):
    """`lab run --kernel trixie -- CMD`: the module is in the checkout before QEMU starts."""
    project = _project(tmp_path)
    trixie = _image(cache, "t1")
    build = FakeBuild()
    order = []
    monkeypatch.setattr(lab_image, "build", lambda force=False, kernel="6.1": trixie)
    real_ensure = guest_native.ensure
    monkeypatch.setattr(guest_native, "ensure",
                        lambda image, proj: order.append("ensure") or real_ensure(image, proj, build=build))

    def boot(image, run):
        order.append(("boot", (run.project / "nvmeof_roce" / SO_313).exists()))
        return 0
    monkeypatch.setattr(commands, "run_in_guest", boot)
    parser = argparse.ArgumentParser()
    commands.register(parser.add_subparsers())
    args = parser.parse_args(["lab", "run", "--kernel", "trixie", "--project", str(project), "--", "true"])
    assert args.func(args) == 0
    assert order == ["ensure", ("boot", True)] and len(build.calls) == 1
