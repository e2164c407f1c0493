"""pyverbs for the RDMA transport: the import shim, the logger cache, and the small helpers every module uses.

pyverbs (Debian's python3-pyverbs) is imported lazily: without it the rest of the package still works, and
`require_pyverbs` says how to install it when the RDMA transport is asked for.  The CM is the native module's
(transport/rdma/cmchannel.py): `qp_attr` turns the attributes it computes for a QP state into pyverbs' QPAttr.
pyverbs 44 does not expose a completion channel's fd: `create_with_fd` takes the lowest free descriptor
number before making one (the number the kernel gives the channel) and checks afterwards that it is a new
anonymous-inode file, as a completion channel is; it then makes it non-blocking for the event loop.
"""
from __future__ import annotations

import errno
import fcntl
import functools
import logging
import os
from typing import Callable

from ...errors import NvmeofError
from ..contracts import TransportError

# The pyverbs names the target side uses: its modules import them from here (after checking PYVERBS_ERROR), so a
# pyverbs without one of them is found missing in one place.
try:  # pyverbs is Debian's python3-pyverbs; import lazily so the rest of the package works without it
    import pyverbs.cm_enums as ce
    import pyverbs.enums as e
    from pyverbs.addr import AHAttr, GID, GlobalRoute
    from pyverbs.cq import CQ, CompChannel
    from pyverbs.device import Context
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.pyverbs_error import PyverbsRDMAError
    from pyverbs.qp import QP, QPAttr, QPCap, QPEx, QPInitAttr, QPInitAttrEx
    from pyverbs.wr import SGE, RecvWR, SendWR
    PYVERBS_ERROR = None
except ImportError as exc:  # pragma: no cover - depends on the machine
    PYVERBS_ERROR = exc

ADMIN_CAPSULE = 64
RESPONSE_SIZE = 16
CM_TIMEOUT_MS = 3000
SEND_WR_BASE = 1 << 32  # wr_ids below this are receive slots
# ibv_qp_state numbers (verbs.h, a stable ABI): the states the CM computes attributes for (CmId.qp_attr)
QPS_INIT, QPS_RTR, QPS_RTS = 1, 2, 3
# QP local ACK timeout exponent, at most (4.096 us << 19 = 2.1 s): what rdma_cm computes for RoCE here and what
# the Linux host asks for in its REQ, so the target retransmits no sooner than nvmet_rdma or the host do.
ACK_TIMEOUT = 19
# The target QPs' RNR retry count (both data paths; docs/native.md "The QP's retries"): the largest finite one (7
# retries for ever).  rdma_init_qp_attr would give the host's REQ's count (the Linux host asks for 7), so a host
# that stops posting receives would hold our responses, and the namespace references of their commands, for ever;
# with 6 the seventh RNR NAK fails the SEND (IBV_WC_RNR_RETRY_EXC_ERR) and the queue closes.  How long that takes
# is the host's to say: each RNR NAK carries its QP's min_rnr_timer (rdma_cm's RTR gives 0, 655.36 ms), so about
# 4 s with a Linux host.
RNR_RETRY = 6


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
    except ImportError:  # the plain-Python stand-ins of tests/unit/fakeverbs.py have no base module
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


# --- what pyverbs 44 does not expose ------------------------------------------------------------------

def _anon_inode() -> tuple:
    """(st_dev, st_ino) of the kernel's one anonymous inode (an eventfd's), which a completion channel shares."""
    fd = os.eventfd(0)
    try:
        st = os.fstat(fd)
        return st.st_dev, st.st_ino
    finally:
        os.close(fd)


def create_with_fd(create: Callable[[], object]):
    """Create a pyverbs completion channel and return (object, its fd, non-blocking).

    The kernel gives a new file the lowest free descriptor number, so the channel's fd is the number free just
    before; it is taken only if it is open afterwards and is an anonymous-inode file (no other thread of the
    target opens files meanwhile: the poll-group threads never do).  Anything else raises, never guessed."""
    probe = os.open(os.devnull, os.O_RDONLY)
    os.close(probe)
    anon = _anon_inode()
    obj = create()
    try:
        st = os.fstat(probe)
    except OSError:
        st = None
    if st is None or (st.st_dev, st.st_ino) != anon:
        close = getattr(obj, "close", None)
        if close is not None:
            close()
        raise TransportError(f"could not find the file descriptor of a new {type(obj).__name__} "
                             f"(fd {probe} is not the anonymous-inode file it should have opened)")
    fcntl.fcntl(probe, fcntl.F_SETFL, fcntl.fcntl(probe, fcntl.F_GETFL) | os.O_NONBLOCK)
    return obj, probe


def gid_text(raw: bytes) -> str:
    """16 GID bytes as pyverbs writes and reads a GID: eight groups of four hex digits."""
    return ":".join(raw[i:i + 2].hex() for i in range(0, 16, 2))


def qp_attr(cm_id, state: int):
    """(pyverbs QPAttr, mask) for moving our own QP to `state` (QPS_INIT, QPS_RTR, QPS_RTS), as the CM computes
    them for the connection (rdma_init_qp_attr through cmchannel.CmId.qp_attr)."""
    fields, mask = cm_id.qp_attr(state)
    attr = QPAttr()
    for name in ("qp_state", "port_num", "qp_access_flags", "pkey_index", "path_mtu", "dest_qp_num", "rq_psn",
                 "sq_psn", "max_dest_rd_atomic", "min_rnr_timer", "max_rd_atomic", "timeout", "retry_cnt",
                 "rnr_retry"):
        setattr(attr, name, fields[name])
    ah = fields["ah_attr"]
    route = None
    if ah["is_global"]:
        route = GlobalRoute(dgid=GID(gid_text(ah["dgid"])), flow_label=ah["flow_label"],
                            sgid_index=ah["sgid_index"], hop_limit=ah["hop_limit"],
                            traffic_class=ah["traffic_class"])
    attr.ah_attr = AHAttr(dlid=ah["dlid"], sl=ah["sl"], src_path_bits=ah["src_path_bits"],
                          static_rate=ah["static_rate"], is_global=ah["is_global"], port_num=ah["port_num"],
                          gr=route)
    return attr, mask


def eagain(exc: Exception) -> bool:
    return getattr(exc, "error_code", None) in (errno.EAGAIN, errno.EWOULDBLOCK)


def is_iwarp(device_name: str, sysfs: str = "/sys") -> bool:
    """An iWARP RNIC (siw, Chelsio, Intel's irdma in iWARP mode): sysfs node_type "4: RNIC"."""
    try:
        with open(os.path.join(sysfs, "class/infiniband", device_name, "node_type")) as f:
            return f.read().split(":")[0].strip() == "4"
    except OSError:
        return False
