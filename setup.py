"""The native data path: one C extension, `nvmeof_roce._native`, built from csrc/ (docs/native.md).

Everything else about the package is in pyproject.toml; only the extension needs setup.py.  It links
libibverbs and librdmacm dynamically (the lab guest and every RDMA host has them) and liburing statically
(so a host without liburing2 still loads it).  The build needs gcc, python3-dev, libibverbs-dev, librdmacm-dev
and liburing-dev (`make deps`).  Without them the build fails and names them: the target's RDMA CM and its fast
data path are this extension, so a package without it would run slowly, or not at all on RDMA, without a word.
NVMEOF_ROCE_PURE_PYTHON=1 builds the package without the extension on purpose (kernel nvmet management, the
loopback transport, the tools; `target serve` then says why it cannot listen on RDMA).

The build also copies the checkout's fio-jobs/ and targets/ into the package (nvmeof_roce/share/), so `bench`
and the messages that name an example config work from an installed wheel (nvmeof_roce.shipped finds them).
"""
import os
from glob import glob

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

SHIPPED = ("fio-jobs", "targets")  # as nvmeof_roce.SHIPPED
BUILD_DEPENDENCIES = "gcc python3-dev libibverbs-dev librdmacm-dev liburing-dev"
PURE_PYTHON = os.environ.get("NVMEOF_ROCE_PURE_PYTHON", "") == "1"


class build_py_with_shipped(build_py):
    def run(self):
        super().run()
        for name in SHIPPED:
            self.copy_tree(name, os.path.join(self.build_lib, "nvmeof_roce", "share", name))


class build_ext_or_say_why(build_ext):
    """A failed build of the extension stops the install with what to install, never a silent slow package."""

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # the compiler's or linker's error (CompileError, LinkError, a missing CC, ...)
            raise SystemExit(
                f"error: cannot build {ext.name}, the native data path and RDMA CM of nvmeof-roce: {exc}\n"
                f"Install the build dependencies (Debian/Ubuntu: apt-get install {BUILD_DEPENDENCIES}) and "
                f"install again; or set NVMEOF_ROCE_PURE_PYTHON=1 to build without it on purpose (no RDMA "
                f"target: kernel nvmet management and the tools only; README.md, 'On a machine with real RDMA')"
            ) from None


native = Extension(
    "nvmeof_roce._native",
    sources=sorted(glob("csrc/*.c")),
    depends=sorted(glob("csrc/*.h")),
    libraries=["ibverbs", "rdmacm"],
    extra_link_args=["-Wl,-Bstatic", "-luring", "-Wl,-Bdynamic"],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-std=gnu11"],
)

setup(ext_modules=[] if PURE_PYTHON else [native],
      cmdclass={"build_py": build_py_with_shipped, "build_ext": build_ext_or_say_why})
