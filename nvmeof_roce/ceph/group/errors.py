"""The gateway group's errors: each names what failed and the fix (NvmeofError's message and fix)."""
from __future__ import annotations

import errno as errno_codes
from typing import Optional

from ...errors import NvmeofError


class GroupError(NvmeofError):
    """A gateway group's RADOS state or lease could not be read or changed."""


class GroupConflict(GroupError):
    """An atomic update kept meeting another gateway's change and gave up after its retries."""


class LeaseBusy(GroupError):
    """Another gateway's RADOS client holds the ANA group's lease."""


class LeaseStillHeld(LeaseBusy):
    """A take-over was asked while the previous owner's lease is still running (it may still serve)."""


class LeaseLost(GroupError):
    """The lease is no longer this gateway's (expired, broken by a survivor, or renewed too late): stop serving."""


class Fenced(LeaseLost):
    """The cluster blocklisted this gateway's RADOS client: every operation of it fails with ESHUTDOWN."""


class CephCallFailed(GroupError):
    """A RADOS call failed for a reason other than the ones above (a timeout, a refused cap, ...)."""

    def __init__(self, message: str, fix: str = "", errno: Optional[int] = None):
        super().__init__(message, fix)
        self.errno = errno


def errno_of(exc: BaseException) -> Optional[int]:
    """The positive errno of a `rados` exception (its `errno`), None when it has none."""
    code = getattr(exc, "errno", None)
    return abs(code) if isinstance(code, int) else None


def is_fenced(exc: BaseException) -> bool:
    return errno_of(exc) == errno_codes.ESHUTDOWN


def call_failed(what: str, exc: BaseException) -> GroupError:
    """The error for a failed RADOS call `what`: Fenced for ESHUTDOWN, else CephCallFailed with the usual fix."""
    code = errno_of(exc)
    if code == errno_codes.ESHUTDOWN:
        return Fenced(f"{what}: this gateway's RADOS client is blocklisted by the cluster (ESHUTDOWN)",
                      "stop serving; restart the gateway (a new RADOS client has a new address the blocklist "
                      "does not name)")
    if code == errno_codes.ETIMEDOUT:
        return CephCallFailed(f"{what}: the cluster did not answer in time (ETIMEDOUT)",
                              "check the cluster (ceph -s) and this machine's network to the monitors and OSDs",
                              code)
    if code in (errno_codes.EPERM, errno_codes.EACCES):
        return CephCallFailed(f"{what}: refused by the cluster ({exc})",
                              "give the gateway's client the caps it needs: mon 'profile rbd' (it allows "
                              "'osd blocklist'), osd 'profile rbd pool=POOL'", code)
    return CephCallFailed(f"{what}: {exc}", "check the cluster (ceph -s) and the gateway's log", code)
