"""The native data path (`nvmeof_roce._native`, built from csrc/ by the package's build), or why it is absent."""
from __future__ import annotations

from typing import Optional

try:
    from . import _native as module
    missing_reason: Optional[str] = None
except ImportError as exc:  # not built: the Python data path is the one that runs
    module = None
    missing_reason = (f"the native data path is not built ({exc}); install libibverbs-dev librdmacm-dev "
                      f"liburing-dev and reinstall the package (`make venv` or `pip install -e .`)")


def available() -> bool:
    return module is not None
