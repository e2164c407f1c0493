"""The control socket's client: one JSON-RPC call to a running target, and finding its socket."""
from __future__ import annotations

import json
import os
import socket
from typing import Any, Optional

from ..errors import NvmeofError
from . import protocol as control_protocol
from .protocol import INTERNAL_ERROR, RpcError


def call(path: str, method: str, params: Optional[dict] = None, timeout: float = 60.0) -> Any:
    """Call `method` on the target at `path`; the result, or RpcError as the server answered it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except FileNotFoundError:
        sock.close()
        raise NvmeofError(f"no control socket at {path}",
                          "start the target (nvmeof-roce target serve CONFIG) or give -S/--socket PATH") from None
    except PermissionError:
        sock.close()
        raise NvmeofError(f"{path}: permission denied", "the control socket is root-only: run as root") from None
    except ConnectionRefusedError:
        sock.close()
        raise NvmeofError(f"{path}: no target is listening (a stale socket)",
                          "start the target, or remove the stale socket") from None
    try:
        request = {"jsonrpc": "2.0", "method": method, "id": 1}
        if params is not None:
            request["params"] = params
        sock.sendall(json.dumps(request).encode("utf-8"))
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            buf += chunk
    except socket.timeout:
        raise NvmeofError(f"{path}: no answer to {method} within {timeout} s",
                          "check the target's log; it may be stalled") from None
    finally:
        sock.close()
    if not buf:
        raise NvmeofError(f"{path}: the target closed the connection without answering {method}",
                          "check the target's log")
    response = json.loads(buf.decode("utf-8"))
    if "error" in response:
        err = response["error"]
        data = err.get("data") or {}
        raise RpcError(err.get("message", "error"), data.get("field", ""), data.get("fix", ""),
                       err.get("code", INTERNAL_ERROR))
    return response.get("result")


def find_socket(explicit: Optional[str] = None) -> str:
    """The control socket to use: `explicit`, else the only one under /run/nvmeof-roce (NAME.sock of a target
    started by hand, NAME/control.sock of the unit nvmeof-roce-target@NAME)."""
    if explicit:
        return explicit
    directory = control_protocol.DEFAULT_SOCKET_DIR
    try:
        names = os.listdir(directory)
    except OSError:
        names = []
    found = sorted(os.path.join(directory, n) for n in names if n.endswith(".sock"))
    found += sorted(p for p in (os.path.join(directory, n, control_protocol.UNIT_SOCKET_NAME) for n in names)
                    if os.path.exists(p))
    if len(found) == 1:
        return found[0]
    if not found:
        raise NvmeofError(f"no running target found (no socket in {directory})",
                          "start one with nvmeof-roce target serve CONFIG, or give -S/--socket PATH")
    raise NvmeofError(f"several targets are running: {', '.join(found)}", "choose one with -S/--socket PATH")
