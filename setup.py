"""The native data path: one C extension, `nvmeof_roce._native`, built from csrc/ (docs/native.md).

Everything else about the package is in pyproject.toml; only the extension needs setup.py.  It links
libibverbs and librdmacm dynamically (the lab guest and every RDMA host has them) and liburing statically
(so a host without liburing2 still loads it).  The build needs Debian's libibverbs-dev, librdmacm-dev and
liburing-dev (`make deps`); without them the extension is skipped and the target runs its Python data path.

The build also copies the checkout's fio-jobs/ and targets/ into the package (nvmeof_roce/share/), so `bench`
and the messages that name an example config work from an installed wheel (nvmeof_roce.shipped finds them).
"""
import os
from glob import glob

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

SHIPPED = ("fio-jobs", "targets")  # as nvmeof_roce.SHIPPED


class build_py_with_shipped(build_py):
    def run(self):
        super().run()
        for name in SHIPPED:
            self.copy_tree(name, os.path.join(self.build_lib, "nvmeof_roce", "share", name))

native = Extension(
    "nvmeof_roce._native",
    sources=sorted(glob("csrc/*.c")),
    depends=sorted(glob("csrc/*.h")),
    libraries=["ibverbs", "rdmacm"],
    extra_link_args=["-Wl,-Bstatic", "-luring", "-Wl,-Bdynamic"],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-std=gnu11"],
    optional=True,
)

setup(ext_modules=[native], cmdclass={"build_py": build_py_with_shipped})
