"""The wheel is self-sufficient: built as `make dist` builds it and installed alone into a fresh venv, run from a
directory outside the checkout, it has the fio jobs, the example configs and the units; it declares
`cryptography`; and the sdist carries what builds the extension and its tests."""
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(argv, **kw):
    # without PYTHONPATH: the installed package, not this checkout, is the one under test
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=300, env=env, **kw)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    proc = run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", out, ROOT])
    if proc.returncode and "Could not find a version that satisfies the requirement setuptools" in proc.stderr:
        pytest.skip("pip cannot fetch the build backend here (no package index)")
    assert proc.returncode == 0, proc.stderr
    (whl,) = out.glob("nvmeof_roce-*.whl")
    return whl


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """A fresh venv with the wheel alone in it (the system's site-packages beside it, as the brief's admin has)."""
    venv = tmp_path_factory.mktemp("venv")
    proc = run(["python3", "-m", "venv", "--system-site-packages", "--without-pip", venv])
    assert proc.returncode == 0, proc.stderr
    proc = run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q", "--no-deps",
                "--no-index", wheel])
    assert proc.returncode == 0, proc.stderr
    return venv


def in_venv(venv, code, cwd):
    proc = run([venv / "bin" / "python", "-c", code], cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_the_wheel_carries_the_fio_jobs_the_examples_and_the_units(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for f in ("nvmeof_roce/share/fio-jobs/randread-4k-qd1.fio", "nvmeof_roce/share/fio-jobs/qd-sweep/",
              "nvmeof_roce/share/fio-jobs/soak/", "nvmeof_roce/share/targets/ram.json",
              "nvmeof_roce/share/targets/README.md", "nvmeof_roce/systemd/nvmeof-roce-target@.service"):
        assert any(n.startswith(f) for n in names), f


def test_the_wheel_declares_cryptography(wheel):
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist: cryptography")]
    assert requires and "extra ==" not in requires[0], requires
    pins = (ROOT / "constraints.txt").read_text()
    assert "\ncryptography==" in pins


def test_the_installed_package_finds_its_files_outside_the_checkout(installed, tmp_path):
    proc = run([installed / "bin" / "nvmeof-roce", "bench", "--help"], cwd=tmp_path)
    assert proc.returncode == 0 and "--jobs-dir" in proc.stdout, proc.stderr
    found = json.loads(in_venv(installed, (
        "import json; from nvmeof_roce import shipped; from nvmeof_roce.bench.fio import default_jobs_dir; "
        "from nvmeof_roce.bench.runner import available_jobs, qd_sweep_jobs; "
        "print(json.dumps({'jobs': str(default_jobs_dir()), 'targets': str(shipped('targets')), "
        "'names': sorted(available_jobs()), 'sweep': len(qd_sweep_jobs())}))"), tmp_path))
    for key in ("jobs", "targets"):
        assert found[key].startswith(str(installed)), found  # the packaged copy, not the checkout
    assert "randread-4k-qd1" in found["names"] and found["sweep"] > 1
    proc = run([installed / "bin" / "nvmeof-roce", "target", "check", Path(found["targets"]) / "ram.json"],
               cwd=tmp_path)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr
    # a config that is not there points to the examples where they are
    proc = run([installed / "bin" / "nvmeof-roce", "target", "check", "nope.json"], cwd=tmp_path)
    assert proc.returncode == 1 and found["targets"] in proc.stderr, proc.stderr


def test_the_sdist_carries_the_extension_sources_and_the_shipped_directories(tmp_path):
    proc = run([sys.executable, "setup.py", "-q", "sdist", "-d", tmp_path], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    (sdist,) = tmp_path.glob("nvmeof[-_]roce-*.tar.gz")
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    for f in ("csrc/nq_hot.c", "csrc/nq_type.c", "csrc/mailbox.c", "csrc/pollgroup.c", "csrc/uring.c", "tests/native/fakeprov.c", "setup.py",
              "MANIFEST.in", "constraints.txt", "fio-jobs/randread-4k-qd1.fio", "targets/ram.json"):
        assert f in names, f
    assert any(n.startswith("csrc/") and n.endswith(".h") for n in names)


def test_a_build_without_the_native_module_fails_and_names_the_packages_unless_opted_out(tmp_path):
    """No silent slow path: `pip` without a working compiler (or a -dev package) fails and says what to install;
    NVMEOF_ROCE_PURE_PYTHON=1 builds without the extension on purpose.  From a copy of the checkout without its
    build/ (objects an earlier build left there would be up to date, and nothing would be compiled)."""
    import shutil
    source = tmp_path / "src"
    skip = shutil.ignore_patterns(".git", "build", "dist", "results", ".venv", "*.so", "__pycache__", "*.egg-info")
    shutil.copytree(ROOT, source, symlinks=True, ignore=skip)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "NVMEOF_ROCE_PURE_PYTHON")}
    env["CC"] = "/bin/false"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "w"),
                           str(source)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    if proc.returncode and "Could not find a version that satisfies the requirement setuptools" in proc.stderr:
        pytest.skip("pip cannot fetch the build backend here (no package index)")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and not list((tmp_path / "w").glob("*.whl")), out
    assert "cannot build nvmeof_roce._native" in out, out
    assert "apt-get install gcc python3-dev libibverbs-dev librdmacm-dev liburing-dev" in out, out
    assert "NVMEOF_ROCE_PURE_PYTHON=1" in out, out
    # opted out: the same broken compiler, and the build succeeds without the extension
    env["NVMEOF_ROCE_PURE_PYTHON"] = "1"
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "-b", str(tmp_path / "lib"), "-t",
                           str(tmp_path / "tmp")], capture_output=True, text=True, timeout=300, env=env, cwd=source)
    assert proc.returncode == 0, proc.stderr
    assert not list(tmp_path.glob("lib/**/_native*.so"))


def test_make_dist_installs_only_the_build_dependencies(tmp_path):
    """`make dist` on a production host: the wheel's build dependencies, never the lab's QEMU and debootstrap, nor
    a dev venv with the plot extras (a dry run, VENV pointed at a venv that is not there)."""
    proc = subprocess.run(["make", "-n", "-C", str(ROOT), "dist", f"VENV={tmp_path / 'venv'}"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for unwanted in ("qemu-system-x86", "debootstrap", "-m venv", "plot]", "build_ext --inplace"):
        assert unwanted not in proc.stdout, (unwanted, proc.stdout)
    for needed in ("python3-dev", "libibverbs-dev", "librdmacm-dev", "liburing-dev", "gcc", "-m pip wheel"):
        assert needed in proc.stdout, (needed, proc.stdout)
