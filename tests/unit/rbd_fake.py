"""RBD namespaces on the native data path without a cluster: the fake librados + librbd (tests/unit/fakerbd/fakerbd.c)
built and loaded with ctypes, named to the C entry (csrc/be_rbd.c) in place of Debian's libraries
(ceph/bindings.py LIBRADOS, LIBRBD), and a stand-in librbd Image over the same bytes for the Python reference path
(engine/backends/rbd.py), which the core uses for what the C queue hands it.

`FakeRbd` is the test's hand on the fake: images, hold and release, errors, counters.  `rbd_endpoint` puts a native
queue on the fake verbs provider (tests/native/fakeprov.c) in front of a Target with one rbd namespace.
"""
from __future__ import annotations

import ctypes
import errno
import os
import select
import time
from pathlib import Path
from typing import List, Optional

from native_diff import NativeEndpoint
from native_fake import compiled_fake, pump

from loopback_env import ADDR1, HOST_A, port

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "tests" / "unit" / "fakerbd" / "fakerbd.c"
SUB = "nqn.2024-01.io.test:rbd-native"

_LIB: Optional[ctypes.CDLL] = None


def fake_path() -> Path:
    return compiled_fake(SOURCE)


def fake_lib() -> ctypes.CDLL:
    global _LIB
    if _LIB is None:
        lib = ctypes.CDLL(str(fake_path()))
        u32, u64, cp, i = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_char_p, ctypes.c_int
        for name, res, args in (("fakerbd_create", ctypes.c_void_p, [cp, u64]), ("fakerbd_reset", None, []),
                                ("fakerbd_hold", None, [i]), ("fakerbd_fail", None, [i, i]),
                                ("fakerbd_refuse", None, [i, i]), ("fakerbd_connect_error", None, [i]),
                                ("fakerbd_hold_connect", None, [i]),
                                ("fakerbd_held", u32, []), ("fakerbd_counter", u64, [cp]),
                                ("fakerbd_conf", cp, [cp]), ("fakerbd_release", u32, [u32, i])):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        _LIB = lib
    return _LIB


class FakeRbd:
    """The fake's controls (tests/unit/fakerbd/fakerbd.c)."""

    def __init__(self):
        self.lib = fake_lib()
        self.lib.fakerbd_reset()
        self.images = {}

    def create(self, name: str, size: int) -> memoryview:
        addr = self.lib.fakerbd_create(name.encode(), size)
        view = memoryview((ctypes.c_char * size).from_address(addr)).cast("B")
        self.images[name] = view
        return view

    def hold(self, on: bool = True) -> None:
        self.lib.fakerbd_hold(1 if on else 0)

    def release(self, n: Optional[int] = None, err: int = 0) -> int:
        """Complete the oldest `n` held calls (all when None) on a thread of the fake's, with -`err` when given;
        the number still held."""
        return self.lib.fakerbd_release(0xFFFFFFFF if n is None else n, -err if err else 0)

    def held(self) -> int:
        return self.lib.fakerbd_held()

    def fail(self, err: int, n: int = 1) -> None:
        """The next `n` calls complete with -err."""
        self.lib.fakerbd_fail(-err, n)

    def refuse(self, err: int, n: int = 1) -> None:
        """The next `n` calls are refused with -err by the call itself."""
        self.lib.fakerbd_refuse(-err, n)

    def connect_error(self, err: int) -> None:
        self.lib.fakerbd_connect_error(-err if err else 0)

    def hold_connect(self, on: bool = True) -> None:
        """rados_connect waits until hold_connect(False): a cluster slow to answer."""
        self.lib.fakerbd_hold_connect(1 if on else 0)

    def counter(self, what: str) -> int:
        return self.lib.fakerbd_counter(what.encode())

    def conf(self, key: str) -> str:
        return self.lib.fakerbd_conf(key.encode()).decode()


class Completion:
    def __init__(self, code):
        self.code = code

    def get_return_value(self):
        return self.code


class StandInImage:
    """python3-rbd's Image as engine/backends/rbd.py uses it, on the fake's bytes: what the core does with the
    commands the C queue hands it reads and writes the same image.  `fail_next`: an errno its next aio call
    fails with."""

    def __init__(self, data: memoryview):
        self.data = data
        self.fail_next = 0
        self.calls = 0

    def size(self):
        return len(self.data)

    def _code(self):
        self.calls += 1
        code, self.fail_next = -self.fail_next, 0
        return code

    def read(self, offset, length):
        return bytes(self.data[offset:offset + length])

    def write(self, data, offset):
        self.data[offset:offset + len(data)] = data

    def flush(self):
        pass

    def write_zeroes(self, offset, length):
        self.data[offset:offset + length] = bytes(length)

    discard = write_zeroes

    def aio_read(self, offset, length, callback):
        code = self._code()
        callback(Completion(code), None if code else self.read(offset, length))

    def aio_write(self, data, offset, callback):
        code = self._code()
        if not code:
            self.write(data, offset)
        callback(Completion(code))

    def aio_flush(self, callback):
        callback(Completion(self._code()))

    def aio_write_zeroes(self, offset, length, callback):
        code = self._code()
        if not code:
            self.write_zeroes(offset, length)
        callback(Completion(code))

    aio_discard = aio_write_zeroes


def use_fake_rbd(monkeypatch, images: dict) -> FakeRbd:
    """The C entry loads the fake; RbdBackend.open gives the Python path a stand-in on the same bytes.  `images`:
    name -> size."""
    from nvmeof_roce.ceph import bindings
    from nvmeof_roce.engine.backends.rbd import RbdBackend
    fake = FakeRbd()
    for name, size in images.items():
        fake.create(name, size)
    path = str(fake_path())
    monkeypatch.setattr(bindings, "LIBRADOS", path)
    monkeypatch.setattr(bindings, "LIBRBD", path)
    stand_ins = {}

    def open_(cls, ns, lock=None, inherit=None):
        settings = ns.backend_settings
        image = stand_ins.setdefault(settings.image, StandInImage(fake.images[settings.image]))
        return cls(settings, ns.block_size, image=image)
    monkeypatch.setattr(RbdBackend, "open", classmethod(open_))
    fake.stand_ins = stand_ins
    return fake


def rbd_ns(nsid: int, image: str, conf: str = "/etc/ceph/ceph.conf", **extra) -> dict:
    ns = {"nsid": nsid, "nvmeof_roce": {"backend": "rbd", "rbd": {"pool": "rbd", "image": image, "conf": conf,
                                                                  "native": True}}}
    ns["nvmeof_roce"].update(extra)
    return ns


def rbd_config(namespaces: list, subnqn: str = SUB) -> dict:
    return {"hosts": [{"nqn": HOST_A}], "ports": [port(1, ADDR1, [subnqn])],
            "subsystems": [{"nqn": subnqn, "namespaces": namespaces}]}


def rbd_endpoint(namespaces: list, depth: int = 32, file_buffers: int = 32, subnqn: str = SUB,
                 wait: bool = True) -> NativeEndpoint:
    ep = NativeEndpoint(rbd_config(namespaces, subnqn), subnqn, depth=depth, file_buffers=file_buffers)
    if wait:
        wait_native(ep, subnqn)
    return ep


def wait_native(ep: NativeEndpoint, subnqn: str = SUB, timeout: float = 30.0) -> None:
    """The rbd namespaces' native handles opened (RbdBackend.native_opening, off the loop), then the views
    refreshed, as the core's next capsule would."""
    from nvmeof_roce.engine import native_view
    for ns in ep.env.target.subsystem(subnqn).namespaces.values():
        thread = getattr(ns.backend, "native_opening", None)
        if thread is not None:
            thread.join(timeout)
            assert not thread.is_alive(), f"namespace {ns.nsid}'s image did not open in C in {timeout} s"
    native_view.refresh_all(ep.env.target)


def collect(ep: NativeEndpoint, n: int, timeout: float = 15.0) -> List[bytes]:
    """Poll the queue (and the core) until `n` responses were sent, waiting on the ring's eventfd (librbd's
    completions write it) between polls."""
    from native_diff import settle
    got: List[bytes] = []
    deadline = time.monotonic() + timeout
    while True:  # at least one round: n == 0 starts what was delivered
        pump(ep.queue)
        settle(ep.env)
        pump(ep.queue)
        got += [cqe for cqe, _inv in ep.device.responses()]
        if len(got) >= n:
            break
        left = deadline - time.monotonic()
        assert left > 0, f"{len(got)} of {n} responses in {timeout} s"
        if ep.queue.ring_fd is not None:
            ready, _, _ = select.select([ep.queue.ring_fd], [], [], min(left, 0.05))
            if ready:
                try:
                    os.read(ep.queue.ring_fd, 8)
                except BlockingIOError:
                    pass
        else:
            time.sleep(0.01)
    return got


def status_of(cqe: bytes) -> int:
    """The status field (SCT and SC, DNR in bit 14) of a CQE."""
    return int.from_bytes(cqe[14:16], "little") >> 1


def cid_of(cqe: bytes) -> int:
    return int.from_bytes(cqe[12:14], "little")


__all__ = ["FakeRbd", "StandInImage", "use_fake_rbd", "rbd_ns", "rbd_config", "rbd_endpoint", "wait_native", "collect",
           "status_of", "cid_of", "SUB", "errno"]
