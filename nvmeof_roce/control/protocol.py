"""The control socket's protocol: JSON-RPC 2.0 error codes, `RpcError`, the socket's places and limits, cutting
a byte stream into requests (`RequestFramer`) and answering each (`answer_framed`, `handle_request`), shared by
the methods (methods.py), the server (server.py), the client (client.py) and the supervisor of
`serve --workers` (fanout.py).
"""
from __future__ import annotations

import json
import logging
import os
import re
from typing import Any, Callable, List, Optional

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


class RequestFramer:
    """Cuts a byte stream into complete JSON values (objects or batches), as they arrive in any pieces: a
    value split inside a token or a UTF-8 sequence waits for its rest.  The bytes are scanned once, counting
    brackets outside strings, so depth and size are known before anything is parsed."""

    _OUTSIDE = re.compile(rb'[{}\[\]"]')
    _INSIDE = re.compile(rb'["\\]')

    def __init__(self):
        self.buf = bytearray()
        self.pos = 0  # scanned up to here
        self.depth = 0
        self.in_string = False

    def feed(self, data: bytes) -> List[tuple]:
        """("value", bytes) for each complete value, ("error", why, fatal) for a stream that cannot go on
        as it is: a value that is not an object or array (the buffer is dropped), or one nested deeper than
        MAX_REQUEST_DEPTH or larger than MAX_REQUEST_BYTES (fatal: the connection cannot be resynchronised)."""
        self.buf += data
        out: List[tuple] = []
        while True:
            if self.pos == 0 and self.depth == 0:
                stripped = len(self.buf) - len(self.buf.lstrip())
                del self.buf[:stripped]
                if not self.buf:
                    return out
                if self.buf[0] not in b"{[":
                    self.buf.clear()
                    out.append(("error", "a request is a JSON object (or a batch: an array of them)", False))
                    return out
            end = self._scan()
            if end is None:
                if len(self.buf) > MAX_REQUEST_BYTES:
                    out.append(("error", f"request larger than {MAX_REQUEST_BYTES} bytes", True))
                elif self.depth > MAX_REQUEST_DEPTH:
                    out.append(("error", f"request nested more than {MAX_REQUEST_DEPTH} levels deep", True))
                return out
            out.append(("value", bytes(self.buf[:end])))
            del self.buf[:end]
            self.pos = 0

    def _scan(self) -> Optional[int]:
        """The end of the first complete value, or None (more bytes needed, or a limit passed)."""
        buf = self.buf
        while self.pos < len(buf):
            if self.depth > MAX_REQUEST_DEPTH or self.pos > MAX_REQUEST_BYTES:
                return None
            if self.in_string:
                m = self._INSIDE.search(buf, self.pos)
                if m is None:
                    self.pos = len(buf)
                    return None
                if buf[m.start()] == 0x5C:  # a backslash escapes the next byte
                    if m.start() + 1 >= len(buf):
                        self.pos = m.start()
                        return None
                    self.pos = m.start() + 2
                    continue
                self.in_string = False
                self.pos = m.end()
                continue
            m = self._OUTSIDE.search(buf, self.pos)
            if m is None:
                self.pos = len(buf)
                return None
            c = buf[m.start()]
            self.pos = m.end()
            if c == 0x22:  # "
                self.in_string = True
            elif c in b"{[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth <= 0:
                    self.depth = 0
                    return self.pos
        return None


def error_response(why: str, code: int = PARSE_ERROR) -> dict:
    """The answer to bytes that are not a request (there is no id to answer to)."""
    return {"jsonrpc": "2.0", "id": None,
            "error": RpcError(why, "", "send one JSON-RPC 2.0 object per request", code).to_dict()}


def answer_framed(call: Callable[[str, Any], Any], item: tuple) -> Optional[dict]:
    """The response to one item of `RequestFramer.feed`: an error item's, or `handle_request(call, request)` for
    a value that decodes (None for a notification): `call(method, params)` is the one dispatch."""
    if item[0] == "error":
        _, why, fatal = item
        return error_response(why, INVALID_REQUEST if fatal else PARSE_ERROR)
    try:
        request = json.loads(item[1].decode("utf-8"))
    except UnicodeDecodeError:
        return error_response("request is not UTF-8")
    except ValueError as exc:
        return error_response(f"invalid JSON: {exc}")
    return handle_request(call, request)
