"""The control socket's protocol: JSON-RPC 2.0 error codes, `RpcError`, the socket's places and limits, and
answering one request object (`handle_request`), shared by the methods (control.py), the server
(control_server.py), the client (control_client.py) and the supervisor of `serve --workers`.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional

from ..errors import NvmeofError

log = logging.getLogger(__name__)

DEFAULT_SOCKET_DIR = "/run/nvmeof-roce"
UNIT_SOCKET_NAME = "control.sock"  # nvmeof-roce-target@NAME: /run/nvmeof-roce/NAME/control.sock
MAX_REQUEST_BYTES = 1 << 20  # one request (docs/security.md)
MAX_REQUEST_DEPTH = 32  # nesting of one request: a config edit is a few levels deep
MAX_PENDING_REPLY_BYTES = 16 << 20  # replies waiting for a client that does not read: then it is dropped

# JSON-RPC 2.0 error codes (SPDK uses the same ones for bad parameters)
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603


def default_socket_path(config_path: str) -> str:
    """/run/nvmeof-roce/NAME.sock for CONFIG NAME.json (the systemd unit's instance name)."""
    name = os.path.basename(str(config_path))
    if name.endswith(".json"):
        name = name[:-5]
    return os.path.join(DEFAULT_SOCKET_DIR, f"{name or 'target'}.sock")


class RpcError(Exception):
    """A JSON-RPC error: `field` is the parameter (or config field) at fault, `fix` what to do."""

    def __init__(self, message: str, field: str = "", fix: str = "", code: int = INVALID_PARAMS):
        super().__init__(message)
        self.message = message
        self.field = field
        self.fix = fix
        self.code = code

    def to_dict(self) -> dict:
        data = {}
        if self.field:
            data["field"] = self.field
        if self.fix:
            data["fix"] = self.fix
        d = {"code": self.code, "message": self.message}
        if data:
            d["data"] = data
        return d


def handle_request(call: Callable[[str, Any], Any], request: Any) -> Optional[dict]:
    """One JSON-RPC request object -> its response object (None for a notification): `call(method, params)`
    answers it; an RpcError or NvmeofError raised is answered with its message, field and fix, anything else
    as an internal error (and logged with its traceback)."""
    if not isinstance(request, dict) or request.get("jsonrpc") != "2.0" or not isinstance(
            request.get("method"), str):
        return {"jsonrpc": "2.0", "id": request.get("id") if isinstance(request, dict) else None,
                "error": RpcError("not a JSON-RPC 2.0 request", "jsonrpc",
                                  'send {"jsonrpc": "2.0", "method": ..., "params": {...}, "id": 1}',
                                  INVALID_REQUEST).to_dict()}
    try:
        response = {"result": call(request["method"], request.get("params"))}
    except RpcError as exc:
        log.warning("rpc %s: %s", request["method"], exc.message)
        response = {"error": exc.to_dict()}
    except NvmeofError as exc:
        log.warning("rpc %s: %s", request["method"], exc.message)
        response = {"error": RpcError(exc.message, "", exc.fix, INTERNAL_ERROR).to_dict()}
    except Exception as exc:  # noqa: BLE001 - the server answers and keeps serving
        log.exception("rpc %s failed", request["method"])
        response = {"error": RpcError(f"internal error: {exc}", "", "see the target's log",
                                      INTERNAL_ERROR).to_dict()}
    return None if "id" not in request else dict(jsonrpc="2.0", id=request.get("id"), **response)
