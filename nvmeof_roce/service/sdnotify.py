"""sd_notify(3) with the standard library: tell systemd (Type=notify) when the target is ready or stopping.

systemd passes the address of its notification socket in $NOTIFY_SOCKET: a path, or an abstract socket name
starting with '@'.  Each message is one datagram of NEWLINE-separated KEY=VALUE assignments.  Without
$NOTIFY_SOCKET (not under systemd) every call does nothing.
"""
from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(*assignments: str, environ=None) -> bool:
    """Send e.g. notify("READY=1", "STATUS=serving"); False when there is no $NOTIFY_SOCKET or it failed."""
    env = os.environ if environ is None else environ
    address = env.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # the abstract namespace
    elif not address.startswith("/"):
        log.warning("NOTIFY_SOCKET %r is neither a path nor an abstract name: not notifying", address)
        return False
    message = "\n".join(assignments).encode("utf-8")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(message, address)
    except OSError as exc:
        log.warning("sd_notify to %s failed: %s", env.get("NOTIFY_SOCKET"), exc)
        return False
    return True
