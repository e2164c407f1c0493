"""pyverbs for the RDMA transport: the import shim, the logger cache, and the small helpers every module uses.

pyverbs (Debian's python3-pyverbs) is imported lazily: without it the rest of the package still works, and
`require_pyverbs` says how to install it when the RDMA transport is asked for.  pyverbs 44 exposes neither the CM
channel's nor a completion channel's fd: `create_with_fd` finds the one a new object opened in /proc/self/fd and
makes it non-blocking, so the event loop can watch it (pyverbs holds the GIL in its blocking calls).
"""
from __future__ import annotations

import errno
import fcntl
import functools
import logging
import os
from typing import Callable, Dict

from ...errors import NvmeofError
from ..base import TransportError

# The pyverbs names the target side uses: its modules import them from here (after checking PYVERBS_ERROR), so a
# pyverbs without one of them is found missing in one place.
try:  # pyverbs is Debian's python3-pyverbs; import lazily so the rest of the package works without it
    import pyverbs.cm_enums as ce
    import pyverbs.enums as e
    from pyverbs.cmid import AddrInfo, CMEvent, CMEventChannel, CMID, ConnParam
    from pyverbs.cq import CQ, CompChannel
    from pyverbs.device import Context
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.pyverbs_error import PyverbsRDMAError
    from pyverbs.qp import QP, QPCap, QPEx, QPInitAttr, QPInitAttrEx
    from pyverbs.wr import SGE, RecvWR, SendWR
    PYVERBS_ERROR = None
except ImportError as exc:  # pragma: no cover - depends on the machine
    PYVERBS_ERROR = exc

ADMIN_CAPSULE = 64
RESPONSE_SIZE = 16
CM_TIMEOUT_MS = 3000
SEND_WR_BASE = 1 << 32  # wr_ids below this are receive slots
MIN_POINTER = 1 << 16  # no user-space object lives below this: a smaller "pointer" is not one


class CachedLoggers:
    """The logging module with getLogger cached: what `pyverbs.base` sees as `logging`.

    pyverbs 44 makes a logger for every object it creates (`PyverbsObject.__cinit__` calls logging.getLogger,
    which takes the logging lock): more than half of what a work completion costs (2.1 -> 0.9 µs per `WC` on
    the development host).  A logger is made once per name and lives for ever, so the cache hands out the very
    same objects."""

    def __init__(self, real):
        self._real = real
        self.getLogger = functools.lru_cache(maxsize=None)(real.getLogger)

    def __getattr__(self, name):
        return getattr(self._real, name)


def cache_pyverbs_loggers(base_module) -> bool:
    """Give `base_module` (pyverbs.base) the cached getLogger; False if it does not use the logging module."""
    if getattr(base_module, "logging", None) is not logging:
        return False
    base_module.logging = CachedLoggers(logging)
    return True


if PYVERBS_ERROR is None:
    try:
        import pyverbs.base as _pyverbs_base
    except ImportError:  # the plain-Python stand-ins of benchmarks/fakeverbs.py have no base module
        _pyverbs_base = None
    if _pyverbs_base is not None:
        cache_pyverbs_loggers(_pyverbs_base)


# Bookworm's pyverbs 44 never frees an SGE, SendWR or RecvWR: their destructor is misnamed `__dealloc` (fixed
# upstream later), so such objects made per command leak.  The target's hot path makes none (RdmaTargetQueue).
WR_LEAKS = PYVERBS_ERROR is None and any(name.endswith("__dealloc") for name in dir(SendWR))


def require_pyverbs() -> None:
    if PYVERBS_ERROR is not None:
        raise NvmeofError(f"pyverbs is not available: {PYVERBS_ERROR}",
                          "apt-get install python3-pyverbs rdma-core ibverbs-providers, and make the venv with "
                          "'python3 -m venv --system-site-packages' from the system python3")


# --- file descriptors that pyverbs 44 does not expose ---------------------------------------

def open_fds() -> Dict[str, str]:
    """fd -> what it points to.  (Listing /proc/self/fd uses an fd itself, so compare targets, not numbers.)"""
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[name] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    return fds


def create_with_fd(create: Callable[[], object], expect: str):
    """Create a pyverbs object and return (object, the one fd it opened whose target contains `expect`)."""
    before = open_fds()
    obj = create()
    for name, target in open_fds().items():
        if expect in target and before.get(name) != target:
            fd = int(name)
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
            return obj, fd
    raise TransportError(f"could not find the file descriptor of a new {type(obj).__name__} ({expect})")


def eagain(exc: Exception) -> bool:
    return getattr(exc, "error_code", None) in (errno.EAGAIN, errno.EWOULDBLOCK)


def is_iwarp(device_name: str, sysfs: str = "/sys") -> bool:
    """An iWARP RNIC (siw, Chelsio, Intel's irdma in iWARP mode): sysfs node_type "4: RNIC"."""
    try:
        with open(os.path.join(sysfs, "class/infiniband", device_name, "node_type")) as f:
            return f.read().split(":")[0].strip() == "4"
    except OSError:
        return False
