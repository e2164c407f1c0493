"""Ceph's Python bindings (`rados`, `rbd`) from Debian's python3-rados and python3-rbd.

They are Debian packages, never PyPI's (as pyverbs is): compiled against the machine's librados/librbd.  The
project's venv runs a Python of the same version (3.11 on Debian 12) that is not Debian's own, so it does not
see /usr/lib/python3/dist-packages; the two extension modules are loaded from there by path, and only those
two, so none of Debian's other Python packages shadow the venv's pinned ones.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Tuple

from ..errors import NvmeofError

DEBIAN_DIST_PACKAGES = Path("/usr/lib/python3/dist-packages")
PACKAGES = {"rados": "python3-rados", "rbd": "python3-rbd"}
# The C libraries under those two modules, as their dynamic linker finds them (Debian's librados2 and librbd1):
# the native data path's RBD entry loads the same ones with dlopen (csrc/be_rbd.c), so the module imports where
# Ceph is absent, and a test can name a fake in their place (tests/unit/fakerbd/).
LIBRADOS = "librados.so.2"
LIBRBD = "librbd.so.1"


def _load(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError:
        pass
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:  # this interpreter's ABI tag only
        path = DEBIAN_DIST_PACKAGES / f"{name}{suffix}"
        if path.exists():
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except ImportError as exc:
                del sys.modules[name]
                raise NvmeofError(f"Ceph's Python binding {path} does not load: {exc}",
                                  f"reinstall {PACKAGES[name]} (apt-get install --reinstall {PACKAGES[name]})")
            return module
    raise NvmeofError(f"Ceph's Python binding '{name}' is not installed for Python "
                      f"{sys.version_info.major}.{sys.version_info.minor}",
                      f"apt-get install {PACKAGES[name]} (an rbd namespace needs librbd through it)")


def rados_and_rbd() -> Tuple[ModuleType, ModuleType]:
    """The `rados` and `rbd` modules, or NvmeofError naming the package to install."""
    rados = _load("rados")  # rbd's module imports rados: load it first
    return rados, _load("rbd")
