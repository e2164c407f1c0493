"""The control socket's server: JSON-RPC 2.0 over a Unix socket, on the target's event loop.

It never blocks the loop (`loop.watch(fd, callback)`): requests are read as they arrive and cut into JSON values
before anything is parsed (size and depth limits, protocol.py), a reply that does not fit in the socket
buffer is finished on later ticks. The socket is created 0600 and a live owner of the path is never displaced.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import socket
import stat
from typing import Callable, Dict, Optional

from ..errors import NvmeofError
from .protocol import MAX_PENDING_REPLY_BYTES, RequestFramer, RpcError, answer_framed

log = logging.getLogger(__name__)


class DeferredAnswer:
    """The result of a method whose answer comes later: a live change whose commit waits for its subsystems'
    commands in flight to drain (engine/api.py Applying).  The server answers the request when it settles.
    Not the Applying itself: that is the change's outcome, for any caller; this is the answer Control.call makes
    from it (the config saved, the result computed or the error as an RpcError), sent once on one connection."""

    def __init__(self):
        self.part: Optional[dict] = None  # {"result": ...} or {"error": ...}, once settled
        self._send: Optional[Callable[[dict], None]] = None

    def settle(self, result) -> None:
        self._finish({"result": result})

    def fail(self, error: RpcError) -> None:
        self._finish({"error": error.to_dict()})

    def _finish(self, part: dict) -> None:
        self.part = part
        if self._send is not None:
            self._send(part)

    def when_done(self, send: Callable[[dict], None]) -> None:
        if self.part is not None:
            send(self.part)
        else:
            self._send = send


class _Conn:
    __slots__ = ("sock", "framer", "outbuf")

    def __init__(self, sock):
        self.sock = sock
        self.framer = RequestFramer()
        self.outbuf = b""


class RpcServer:
    """Serves a `Control` (methods.py) on a Unix socket from an event loop with watch(fd, cb) / unwatch(fd)."""

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
            response = answer_framed(self.control.call, item)
            if response is not None and isinstance(response.get("result"), DeferredAnswer):
                deferred = response.pop("result")
                deferred.when_done(lambda part, conn=conn, head=response: self._answer_later(conn, dict(head, **part)))
            elif response is not None:
                self._send(conn, response)
            if item[0] == "error":
                if item[2]:  # fatal: the stream cannot be resynchronised
                    log.warning("control socket: dropping a client: %s", item[1])
                    self._close(conn)
                return
            if conn.sock.fileno() < 0:
                return  # dropped while sending

    def _answer_later(self, conn: _Conn, response: dict) -> None:
        if conn.sock.fileno() >= 0:  # the client may have gone meanwhile: the change is made all the same
            self._send(conn, response)

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
