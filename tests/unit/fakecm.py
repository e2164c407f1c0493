"""The fake librdmacm (tests/native/fakecm.c) under the native module's CM: build, load, and the test's end.

`load()` compiles the fake into build/tests/ (once per source version, with gcc as the extension's build needs
anyway) and points `_native`'s CM at it (`_native.cm_load_library`): every CmChannel made afterwards in this
process talks to the fake.  The `fakecm_*` functions are the other end: connect requests from any peer address
with any private data, the events a host's CM or the device would cause, and what our code answered.  They name
an id by its address in the fake (what `connect` returns), the test's own name for it: the channel's handles
(events' `id`) are other numbers, which the test matches to the fake's ids by the peer address.
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import NamedTuple, Optional

from native_fake import compiled_fake

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "tests" / "native" / "fakecm.c"
COUNTERS = ("ids", "destroyed", "posted", "acked", "destroy_unacked", "rejects", "blocking_waits", "destroy_with_qp",
            "qps_made", "qps_destroyed")
QP_STATES = {0: "RESET", 1: "INIT", 2: "RTR", 3: "RTS", 6: "ERR"}
STATES = {0: "pending", 1: "accepted", 2: "rejected", 3: "disconnected", 4: "connecting", 5: "responded",
          -1: "destroyed"}

_LIB: Optional[ctypes.CDLL] = None


class Qp(NamedTuple):
    """An id's QP in the fake (rdma_create_qp's): its state ("RESET" once destroyed), the modifies made, what RTR
    and RTS set, and where its destroy and its id's fell in the fake's one sequence of destroys (0: not yet)."""
    state: str
    modifies: int
    max_dest_rd_atomic: int
    min_rnr_timer: int
    rnr_retry: int
    retry_cnt: int
    timeout: int
    max_rd_atomic: int
    qp_destroyed_at: int
    id_destroyed_at: int
    qp_num: int


class Answer(NamedTuple):
    state: str
    private_data: bytes
    responder_resources: int
    initiator_depth: int
    qp_num: int


def load(module) -> ctypes.CDLL:
    global _LIB
    if _LIB is not None:
        return _LIB
    out = compiled_fake(SOURCE)
    lib = ctypes.CDLL(str(out))
    vp, i = ctypes.c_void_p, ctypes.c_int
    lib.fakecm_connect.restype = vp
    lib.fakecm_connect.argtypes = [ctypes.c_char_p, ctypes.c_uint, ctypes.c_char_p, ctypes.c_uint, ctypes.c_char_p,
                                   i, i, i]
    lib.fakecm_event.argtypes = [vp, i, i]
    lib.fakecm_answer.argtypes = [vp, ctypes.c_char_p, ctypes.POINTER(i), ctypes.POINTER(i), ctypes.POINTER(i),
                                  ctypes.POINTER(ctypes.c_uint32)]
    lib.fakecm_counters.argtypes = [vp]
    lib.fakecm_qp.argtypes = [vp, vp]
    lib.fakecm_fail_get_event.argtypes = [i, i]
    module.cm_load_library(str(out))
    _LIB = lib
    return lib


def connect(address: str, port: int, peer: str, peer_port: int, private_data: bytes, *,
            responder_resources: int = 16, initiator_depth: int = 16) -> int:
    """A connect request from peer:peer_port to the listener on address:port: the child id in the fake (its
    address; 0: none listens there)."""
    return _LIB.fakecm_connect(address.encode(), port, peer.encode(), peer_port, private_data, len(private_data),
                               responder_resources, initiator_depth) or 0


def event(fake_id: int, kind: int, status: int = 0) -> None:
    """An event on an id of the fake as the peer's CM or the device causes it (DISCONNECTED, TIMEWAIT_EXIT, ...)."""
    if _LIB.fakecm_event(fake_id, kind, status) < 0:
        raise AssertionError(f"CM id {fake_id:#x} was destroyed already")


def fail_get_event(err: int, nth: int = 1) -> None:
    """The `nth` rdma_get_cm_event from now fails with errno `err` and takes no event (librdmacm's own failures,
    an allocation or the read of the channel's fd)."""
    _LIB.fakecm_fail_get_event(nth, err)


def bad_channel_fd() -> None:
    """The next event channel's fd is not open: making it non-blocking fails (EBADF)."""
    _LIB.fakecm_bad_channel_fd()


def recycle_next_id() -> None:
    """The next id made takes the address of the id destroyed last, as librdmacm's allocator may."""
    if _LIB.fakecm_recycle_next_id() < 0:
        raise AssertionError("no id was destroyed since the last recycling")


def answer(fake_id: int) -> Answer:
    """What our code answered on an id of the fake (`connect`'s), destroyed or not."""
    data = ctypes.create_string_buffer(256)
    n, res, depth, qpn = ctypes.c_int(), ctypes.c_int(), ctypes.c_int(), ctypes.c_uint32()
    state = _LIB.fakecm_answer(fake_id, data, ctypes.byref(n), ctypes.byref(res), ctypes.byref(depth),
                               ctypes.byref(qpn))
    return Answer(STATES[state], data.raw[:n.value], res.value, depth.value, qpn.value)


def qp(fake_id: int) -> Optional[Qp]:
    """The QP made on an id of the fake (`connect`'s), destroyed or not; None if it never had one."""
    out = (ctypes.c_long * 11)()
    if _LIB.fakecm_qp(fake_id, out) < 0:
        return None
    return Qp(QP_STATES.get(out[0], str(out[0])), *out[1:])


def destroy_order(fake_id: int) -> tuple:
    """(where the id's QP's destroy fell, where the id's did) in the fake's sequence of destroys; 0: not yet."""
    out = (ctypes.c_long * 11)()
    _LIB.fakecm_qp(fake_id, out)
    return out[8], out[9]


def counters() -> dict:
    out = (ctypes.c_long * len(COUNTERS))()
    _LIB.fakecm_counters(out)
    return dict(zip(COUNTERS, out))
