"""One RADOS client per cluster, shared by the rbd namespaces of that cluster, reference counted.

A cluster is what a client connects with: the ceph.conf, the client's id and its keyring.  The first namespace
of a cluster connects (`acquire`, a blocking call: at start or on a thread, never on the event loop); the others
take the same client; the last `release` shuts it down (blocking: on a closer thread, `close_off_loop`).

A client the cluster has blocklisted (fenced) is marked `broken`: it stays with the namespaces that hold it, and
the next `acquire` connects a new one.  A connection that failed is remembered for FAILED_HOLD seconds, so the
namespaces of one unreachable cluster do not each wait out the connect timeout in turn (the first one does).

Closing is off the loop: `close_off_loop(what, steps)` runs the steps (close an image, an ioctx, release the
client) on a thread of its own; `wait_closed` joins those threads (at the service's end, and at exit).
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from .bindings import rados_and_rbd

log = logging.getLogger(__name__)

FAILED_HOLD = 5.0  # seconds a failed connection is answered from memory

Key = Tuple[str, str, Optional[str]]  # (conf, id, keyring)


class ClusterClient:
    """A connected `rados.Rados` and the namespaces that hold it."""

    def __init__(self, key: Key, rados_client):
        self.key = key
        self.rados = rados_client
        self.refs = 0
        self.broken = False  # blocklisted: new namespaces get a new client

    def __repr__(self) -> str:
        return f"<ClusterClient {self.key[0]} client.{self.key[1]} refs={self.refs}{' broken' if self.broken else ''}>"


_lock = threading.Lock()
_clients: Dict[Key, ClusterClient] = {}
_connecting: Dict[Key, threading.Lock] = {}
_failed: Dict[Key, Tuple[float, BaseException]] = {}
_closers: List[threading.Thread] = []


def acquire(key: Key, conf: Dict[str, str], timeout: float) -> ClusterClient:
    """The cluster's client, connected now if none is (blocking up to `timeout`); raises what librados raised."""
    with _lock:
        gate = _connecting.setdefault(key, threading.Lock())
    with gate:  # one connection at a time per cluster: the others wait for it and share it
        with _lock:
            client = _clients.get(key)
            if client is not None and not client.broken:
                client.refs += 1
                return client
            failed = _failed.get(key)
            if failed is not None and time.monotonic() - failed[0] < FAILED_HOLD:
                raise failed[1]
        rados, _ = rados_and_rbd()
        conffile, client_id, keyring = key
        settings = dict(conf)
        if keyring:
            settings["keyring"] = keyring
        r = rados.Rados(conffile=conffile, rados_id=client_id, conf=settings)
        try:
            r.connect(timeout=timeout)
        except BaseException as exc:
            with _lock:
                _failed[key] = (time.monotonic(), exc)
            _shutdown(r, key)
            raise
        client = ClusterClient(key, r)
        client.refs = 1
        with _lock:
            _failed.pop(key, None)
            old = _clients.get(key)
            _clients[key] = client  # a broken one stays with its holders until they release it
        if old is not None:
            log.warning("ceph %s client.%s: the client was blocklisted; a new one connected", key[0], key[1])
        return client


def release(client: ClusterClient) -> None:
    """One holder less; the last one shuts the client down (blocking: call it off the loop)."""
    with _lock:
        client.refs -= 1
        if client.refs > 0:
            return
        if _clients.get(client.key) is client:
            del _clients[client.key]
    _shutdown(client.rados, client.key)


def forget_failures() -> None:
    """Connect again at the next acquire, whatever failed before (the unit tests)."""
    with _lock:
        _failed.clear()


def held() -> Dict[Key, int]:
    """{cluster: holders} of the clients connected now (status, tests)."""
    with _lock:
        return {k: c.refs for k, c in _clients.items()}


def _shutdown(r, key: Key) -> None:
    try:
        r.shutdown()
    except Exception as exc:
        log.warning("ceph %s client.%s: shutdown: %s", key[0], key[1], exc)


def close_off_loop(what: str, steps: List[Tuple[str, Callable[[], None]]],
                   then: Optional[Callable[[], None]] = None) -> threading.Thread:
    """Run `steps` ((name, call) in order, each error logged) and then `then()` on a thread of their own: a
    librbd close waits for the cluster (up to its op timeout on one that went away), never the loop."""
    def run() -> None:
        for name, call in steps:
            try:
                call()
            except Exception as exc:
                log.warning("%s: closing %s: %s", what, name, exc)
        if then is not None:
            try:
                then()
            except Exception:
                log.exception("%s: after closing", what)

    t = threading.Thread(target=run, name=f"close {what}"[:60], daemon=True)
    with _lock:
        _closers[:] = [c for c in _closers if c.is_alive()]
        _closers.append(t)
    t.start()
    return t


def wait_closed(timeout: float = 15.0) -> bool:
    """Join the closer threads still running (at most `timeout` seconds in all); True when none is left."""
    deadline = time.monotonic() + timeout
    with _lock:
        closers = list(_closers)
    for t in closers:
        t.join(max(0.0, deadline - time.monotonic()))
    with _lock:
        _closers[:] = [c for c in _closers if c.is_alive()]
        return not _closers


atexit.register(wait_closed)
