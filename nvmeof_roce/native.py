"""The native data path (`nvmeof_roce._native`, built from csrc/ by the package's build), or why it is absent.

NVMEOF_ROCE_NATIVE_SO=/path/to/_native.so loads another build of the module instead (the sanitizer build of
`make test-native`, a debug build for gdb: docs/native.md)."""
from __future__ import annotations

import os
from typing import Optional


def _load():
    override = os.environ.get("NVMEOF_ROCE_NATIVE_SO")
    if override:
        import importlib.util
        spec = importlib.util.spec_from_file_location("nvmeof_roce._native", override)
        if spec is None or spec.loader is None:
            raise ImportError(f"NVMEOF_ROCE_NATIVE_SO={override} is not a loadable extension module")
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
        return loaded
    from . import _native
    return _native


try:
    module = _load()
    missing_reason: Optional[str] = None
except ImportError as exc:  # built with NVMEOF_ROCE_PURE_PYTHON=1 (setup.py), or an in-place checkout not built
    module = None
    missing_reason = (f"the native data path and RDMA CM are not built ({exc}); install gcc python3-dev "
                      f"libibverbs-dev librdmacm-dev liburing-dev and reinstall the package (`make venv` or "
                      f"`pip install -e .`) without NVMEOF_ROCE_PURE_PYTHON")


def available() -> bool:
    return module is not None


def default_data_path(worker: Optional[int] = None) -> str:
    """What `target serve` runs when --data-path is not given: native when the module is built, else python.
    Workers of `serve --workers` run the Python path (docs/native.md)."""
    return "native" if available() and worker is None else "python"
