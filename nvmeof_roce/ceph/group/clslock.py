"""Ceph's lock object class (cls_lock) called directly: `lock`, `unlock`, `break_lock`, `get_info`.

Why not the Python binding's calls (Ceph 16.2's python3-rados):
- `Ioctx.lock_exclusive(duration=N)` fills a `struct timeval`'s seconds and leaves its microseconds
  uninitialised: the OSD gets N s plus whatever the stack held (a 1 s lease measured 4.3 s on the OSD).  A lease
  whose length is unknown cannot time a stop-serving deadline, so the lock op is encoded here, with the
  duration exact (whole and fractional seconds: utime_t).
- It has no `list_lockers` nor `break_lock` (librados' C API has both).

Of the three ways around that — `Ioctx.execute` of the class's methods with their Ceph encoding, ctypes on
librados' `rados_list_lockers`/`rados_break_lock` (which need a `rados_ioctx_t` of a second client, since the
binding gives its handles to nobody), or the `rados lock info/break` CLI (a process per call, and a third client
address per call) — the first is used: the same client as the lease, the same errors, no process, and the
encoding is small and fixed (ENCODE_START framing: u8 version, u8 compat, u32 length; strings u32 length + bytes;
utime_t u32 seconds + u32 nanoseconds; entity_name_t u8 type + le64 number; entity_addr_t below).
`tests/unit/test_ceph_group.py` checks the decoding against `rados lock info`'s JSON.
"""
from __future__ import annotations

import ipaddress
import json
import struct
from dataclasses import dataclass
from typing import List, Optional, Tuple

CLS = "lock"
EXCLUSIVE = 1
ENTITY_CLIENT = 0x08  # CEPH_ENTITY_TYPE_CLIENT
MAY_RENEW = 0x1  # LOCK_FLAG_MAY_RENEW: take it, or renew it when it is ours
MUST_RENEW = 0x2  # LOCK_FLAG_MUST_RENEW: renew it, ENOENT when it is not ours (expired, broken) any more


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<I", len(raw)) + raw


def _frame(payload: bytes, version: int = 1, compat: int = 1) -> bytes:
    return struct.pack("<BBI", version, compat, len(payload)) + payload


def _utime(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("<II", whole, int(round((seconds - whole) * 1e9)))


def lock_op(name: str, cookie: str, description: str, duration: float, flags: int = 0, tag: str = "") -> bytes:
    """cls_lock_lock_op: an exclusive lock `name` for this client and `cookie`, for `duration` seconds."""
    return _frame(_string(name) + bytes([EXCLUSIVE]) + _string(cookie) + _string(tag) + _string(description)
                  + _utime(duration) + bytes([flags]))


def unlock_op(name: str, cookie: str) -> bytes:
    return _frame(_string(name) + _string(cookie))


def break_op(name: str, instance_id: int, cookie: str) -> bytes:
    """cls_lock_break_op: remove the locker (client.`instance_id`, `cookie`), whoever asks."""
    return _frame(_string(name) + struct.pack("<Bq", ENTITY_CLIENT, instance_id) + _string(cookie))


def get_info_op(name: str) -> bytes:
    return _frame(_string(name))


@dataclass(frozen=True)
class Locker:
    """One locker of a lock, as the OSD reports it (expired lockers are never reported: the class drops them
    when it reads the lock)."""
    entity_type: int
    instance_id: int  # the client's global id: the locker is `client.<instance_id>`
    cookie: str
    expires: float  # the OSD's wall clock (0: never)
    addr: str  # the client's address, "IP:PORT/NONCE" (what `osd blocklist add` takes)
    description: str

    @property
    def client(self) -> str:
        return f"client.{self.instance_id}"


@dataclass(frozen=True)
class LockInfo:
    lockers: List[Locker]
    lock_type: int
    tag: str


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.pos = bytes(data), 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError(f"cls_lock reply truncated at byte {self.pos} (+{n} of {len(self.data)})")
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def unpack(self, fmt: str) -> Tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def u8(self) -> int:
        return self.unpack("<B")[0]

    def u32(self) -> int:
        return self.unpack("<I")[0]

    def string(self) -> str:
        return self.take(self.u32()).decode(errors="replace")

    def framed(self) -> "_Reader":
        """The payload of an ENCODE_START frame, as a reader of its own (fields a newer version adds are
        skipped with the rest of the frame)."""
        self.u8(), self.u8()
        return _Reader(self.take(self.u32()))


def _address(reader: _Reader) -> str:
    marker = reader.u8()
    if marker == 1:  # entity_addr_t with MSG_ADDR2: frame(type, nonce, sockaddr as u32 length + le16 family ...)
        frame = reader.framed()
        _addr_type, nonce, length = frame.unpack("<III")
        sockaddr = frame.take(length)
        family = struct.unpack_from("<H", sockaddr)[0] if length >= 2 else 0
        body = sockaddr[2:]
    else:  # legacy: u32 0 (the marker was its first byte), nonce, sockaddr_storage with a big-endian family
        reader.take(3)
        nonce = reader.u32()
        storage = reader.take(128)
        family, body = struct.unpack_from(">H", storage)[0], storage[2:]
    if family == 2 and len(body) >= 6:  # AF_INET: port (network order), address
        return f"{ipaddress.IPv4Address(body[2:6])}:{struct.unpack_from('>H', body)[0]}/{nonce}"
    if family == 10 and len(body) >= 22:  # AF_INET6: port, flow info, address
        return f"[{ipaddress.IPv6Address(body[6:22])}]:{struct.unpack_from('>H', body)[0]}/{nonce}"
    return f"-/{nonce}"  # no address (the type none)


def decode_info(data: bytes) -> LockInfo:
    """cls_lock_get_info_reply: frame(map<locker_id_t, locker_info_t>, u8 lock type, string tag)."""
    reply = _Reader(data).framed()
    lockers = []
    for _ in range(reply.u32()):
        ident = reply.framed()
        entity_type, number = ident.unpack("<Bq")
        cookie = ident.string()
        info = reply.framed()
        seconds, nanos = info.unpack("<II")
        addr = _address(info)
        description = info.string()
        lockers.append(Locker(entity_type, number, cookie, seconds + nanos / 1e9, addr, description))
    return LockInfo(lockers, reply.u8(), reply.string())


def description_of(gateway: str, group: str, grpid: int) -> str:
    return json.dumps({"gateway": gateway, "group": group, "grpid": grpid}, sort_keys=True)


def read_call(ioctx, obj: str, method: str, data: bytes) -> bytes:
    """Run the lock class's `method` on `obj` (a blocking call); its output.  Errors: the binding's exceptions
    (their `errno`), whatever message they carry (`Ioctx.execute`'s says "failed to read" for every method)."""
    _ret, out = ioctx.execute(obj, CLS, method, data)
    return bytes(out or b"")


def get_info(ioctx, obj: str, name: str) -> Optional[LockInfo]:
    """The lock's lockers now (None: the object does not exist, so nobody ever locked it)."""
    from ..bindings import rados_and_rbd
    rados = rados_and_rbd()[0]
    try:
        return decode_info(read_call(ioctx, obj, "get_info", get_info_op(name)))
    except rados.ObjectNotFound:
        return None


def write_call(ioctx, obj: str, method: str, data: bytes) -> None:
    """Run a method of the lock class that changes the object (lock, unlock, break_lock) as a write op."""
    from ..bindings import rados_and_rbd
    rados = rados_and_rbd()[0]
    with rados.WriteOpCtx() as op:
        op.execute(CLS, method, data)
        ioctx.operate_write_op(op, obj)
