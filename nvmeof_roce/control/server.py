"""The control socket's server: JSON-RPC 2.0 over a Unix socket, on the target's event loop.

It never blocks the loop (`loop.watch(fd, callback)`): requests are read as they arrive and cut into JSON values
before anything is parsed (size and depth limits, control_protocol.py), a reply that does not fit in the socket
buffer is finished on later ticks. The socket is created 0600 and a live owner of the path is never displaced.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import socket
import stat
from typing import Dict, List, Optional

from ..errors import NvmeofError
from .protocol import (MAX_PENDING_REPLY_BYTES, MAX_REQUEST_BYTES, MAX_REQUEST_DEPTH, PARSE_ERROR, INVALID_REQUEST,
                       RpcError)

log = logging.getLogger(__name__)


class _Framer:
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


class _Conn:
    __slots__ = ("sock", "framer", "outbuf")

    def __init__(self, sock):
        self.sock = sock
        self.framer = _Framer()
        self.outbuf = b""


class RpcServer:
    """Serves a `Control` (control.py) on a Unix socket from an event loop with watch(fd, cb) / unwatch(fd)."""

    def __init__(self, control, path: str, loop, sock: Optional[socket.socket] = None):
        self.control = control
        self.path = path
        self.loop = loop
        self.conns: Dict[int, _Conn] = {}
        self.sock = sock if sock is not None else bind_unix_socket(path)  # serve.py binds it before the listeners
        self.sock.setblocking(False)
        loop.watch(self.sock.fileno(), self._accept)
        control.target.tick_hooks.append(self._flush_pending)
        control.socket_path = path
        log.info("control socket %s", path)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("control socket accept: %s", exc)
                return
            sock.setblocking(False)
            conn = _Conn(sock)
            self.conns[sock.fileno()] = conn
            self.loop.watch(sock.fileno(), lambda c=conn: self._readable(c))

    def _readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        for item in conn.framer.feed(data):
            if item[0] == "error":
                _, why, fatal = item
                self._bad(conn, why, INVALID_REQUEST if fatal else PARSE_ERROR)
                if fatal:
                    log.warning("control socket: dropping a client: %s", why)
                    self._close(conn)
                return
            try:
                request = json.loads(item[1].decode("utf-8"))
            except UnicodeDecodeError:
                self._bad(conn, "request is not UTF-8")
                continue
            except ValueError as exc:
                self._bad(conn, f"invalid JSON: {exc}")
                continue
            response = self.control.handle(request)
            if response is not None:
                self._send(conn, response)
            if conn.sock.fileno() < 0:
                return  # dropped while sending

    def _bad(self, conn: _Conn, why: str, code: int = PARSE_ERROR) -> None:
        self._send(conn, {"jsonrpc": "2.0", "id": None,
                          "error": RpcError(why, "", "send one JSON-RPC 2.0 object per request", code).to_dict()})

    def _send(self, conn: _Conn, response: dict) -> None:
        conn.outbuf += json.dumps(response).encode("utf-8") + b"\n"
        self._write(conn)
        if len(conn.outbuf) > MAX_PENDING_REPLY_BYTES:
            # a client that sends requests and does not read the answers would grow this without bound
            log.warning("control socket: dropping a client that does not read its replies (%d bytes waiting)",
                        len(conn.outbuf))
            self._close(conn)

    def _write(self, conn: _Conn) -> None:
        while conn.outbuf:
            try:
                n = conn.sock.send(conn.outbuf)
            except (BlockingIOError, InterruptedError):
                return  # the rest goes on a later tick
            except OSError:
                self._close(conn)
                return
            conn.outbuf = conn.outbuf[n:]

    def _flush_pending(self, _now: float) -> None:
        for conn in list(self.conns.values()):
            if conn.outbuf:
                self._write(conn)

    def _close(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if fd >= 0:
            self.loop.unwatch(fd)
            self.conns.pop(fd, None)
        conn.sock.close()

    def close(self) -> None:
        for conn in list(self.conns.values()):
            self._close(conn)
        self.loop.unwatch(self.sock.fileno())
        self.sock.close()
        try:
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)
        except OSError:
            pass
        try:
            self.control.target.tick_hooks.remove(self._flush_pending)
        except ValueError:
            pass


class SocketInUse(NvmeofError):
    """Another live target answers on the control socket."""


def bind_unix_socket(path: str) -> socket.socket:
    """Bind and listen on `path` (mode 0600); refuse if a live server holds it, remove a stale one."""
    directory = os.path.dirname(path) or "."
    try:
        os.makedirs(directory, mode=0o755, exist_ok=True)
    except OSError as exc:
        raise NvmeofError(f"cannot create {directory} for the control socket: {exc.strerror}",
                          "run as root, or give --rpc-socket PATH in a directory you can write") from None
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise NvmeofError(f"{path} exists and is not a socket", "remove it or give another --rpc-socket PATH")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise NvmeofError(f"{path}: cannot tell whether another target uses it: {exc.strerror}",
                                  "give another --rpc-socket PATH") from None
            log.warning("removing the stale control socket %s", path)
            os.unlink(path)
        else:
            raise SocketInUse(f"another target is running with the control socket {path}",
                              "stop that target, or give this one another --rpc-socket PATH")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket is created 0600: root (the owner) only
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise NvmeofError(f"cannot bind the control socket {path}: {exc.strerror}",
                          "give another --rpc-socket PATH") from None
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(16)
    return sock
