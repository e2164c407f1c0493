"""A fake RDMA device under pyverbs' names, for measuring the transport's own Python cost.

Everything that needs a device is replaced -- Context, PD, MR, CQ (and CQEX), CompChannel, QP (and QPEx),
the QP and address attribute classes -- and the native module's RDMA CM talks to the fake librdmacm
(tests/native/fakecm.c, loaded by `install`) -- and behaves
like a NIC at the verbs level: a posted RDMA WRITE copies local memory to the host's registered buffer, an
RDMA READ the other way, a SEND lands in the host's receive list, the host's capsule lands in the target's
next posted receive buffer, and every signaled work request (or every one with sq_sig_all) completes on its
CQ, whose completion channel becomes readable once the CQ is armed. So the transport runs unchanged, through
its own event loop, whatever its internals.

What stays real when pyverbs imports (the lab guest, python3-pyverbs): the enums and the objects the
transport builds per command -- SGE, SendWR, RecvWR -- and the WC objects a poll returns, because their cost
is what is measured. The fake reads a real work request's C struct (ibv_send_wr, ibv_recv_wr, ibv_sge from
<infiniband/verbs.h>) with ctypes, since pyverbs does not expose the scatter list or the chain to Python.
Without pyverbs (a development machine) `install_standins()` puts plain-Python stand-ins for the whole
package in sys.modules: the transport then runs, but the cost of pyverbs' objects is not in the figure.

Time spent inside the fake device is accounted in `DEVICE` and subtracted by the benchmark.
"""
from __future__ import annotations

import ctypes
import errno
import itertools
import os
import sys
import time
import types
from collections import deque
from typing import Dict, List, Optional, Tuple

_perf = time.perf_counter


class DeviceTime:
    """Seconds spent inside the fake device, and how many timed calls (for the timer's own overhead)."""

    def __init__(self):
        self.spent = 0.0
        self.calls = 0

    def add(self, t0: float) -> None:
        self.spent += _perf() - t0
        self.calls += 1


DEVICE = DeviceTime()


# --- which pyverbs: the real one (and its error class and enums) or the stand-ins ------------------------------

class _Pv:
    e = None  # pyverbs.enums
    ce = None  # pyverbs.cm_enums
    error = None  # PyverbsRDMAError
    WC = None
    real = False


PV = _Pv()


def _eagain(what: str):
    return PV.error(f"{what}: no event (fake device)", errno.EAGAIN)


# --- reading real work requests: their C structs ------------------------------------------------------------

class _Sge(ctypes.Structure):
    _fields_ = [("addr", ctypes.c_uint64), ("length", ctypes.c_uint32), ("lkey", ctypes.c_uint32)]


class _SendWr(ctypes.Structure):  # struct ibv_send_wr, up to wr.rdma
    _fields_ = [("wr_id", ctypes.c_uint64), ("next", ctypes.c_void_p), ("sg_list", ctypes.POINTER(_Sge)),
                ("num_sge", ctypes.c_int), ("opcode", ctypes.c_int), ("send_flags", ctypes.c_uint),
                ("imm_data", ctypes.c_uint32), ("remote_addr", ctypes.c_uint64), ("rkey", ctypes.c_uint32)]


class _RecvWr(ctypes.Structure):  # struct ibv_recv_wr
    _fields_ = [("wr_id", ctypes.c_uint64), ("next", ctypes.c_void_p), ("sg_list", ctypes.POINTER(_Sge)),
                ("num_sge", ctypes.c_int)]


_OFFSETS: Dict[str, int] = {}
# ctypes views by address: a struct view costs more to make than to read, and a pyverbs WR's struct is at the
# same offset in every object, so a view made for an earlier object at the same address is still right
_SEND_VIEWS: Dict[int, "_SendWr"] = {}
_RECV_VIEWS: Dict[int, "_RecvWr"] = {}
_MARK = 0x5A5A12340ABC0042


def _struct_offset(obj, kind: str) -> int:
    """Where a pyverbs WR object keeps its ibv_*_wr struct: found once by its marked wr_id."""
    raw = ctypes.string_at(id(obj), sys.getsizeof(obj))
    at = raw.find(_MARK.to_bytes(8, "little"))
    if at < 0:
        raise RuntimeError(f"cannot find the {kind} struct inside a pyverbs object")
    return at


def _learn_offsets() -> None:
    from pyverbs.wr import SGE, RecvWR, SendWR
    sge = SGE(0x1111, 16, 0x22)
    send = SendWR(wr_id=_MARK, opcode=PV.e.IBV_WR_SEND, num_sge=1, sg=[sge])
    recv = RecvWR(wr_id=_MARK, num_sge=1, sg=[sge])
    _OFFSETS["send"] = _struct_offset(send, "ibv_send_wr")
    _OFFSETS["recv"] = _struct_offset(recv, "ibv_recv_wr")
    s = _SendWr.from_address(id(send) + _OFFSETS["send"])
    r = _RecvWr.from_address(id(recv) + _OFFSETS["recv"])
    if not (s.num_sge == 1 and s.sg_list[0].addr == 0x1111 and r.num_sge == 1 and r.sg_list[0].lkey == 0x22):
        raise RuntimeError("the ibv_send_wr/ibv_recv_wr layout is not the expected one")


class WorkRequest:
    __slots__ = ("wr_id", "opcode", "flags", "sges", "imm", "remote_addr", "rkey", "inline")

    def __init__(self, wr_id, opcode, flags, sges, imm=0, remote_addr=0, rkey=0, inline=None):
        self.wr_id, self.opcode, self.flags, self.sges = wr_id, opcode, flags, sges
        self.imm, self.remote_addr, self.rkey, self.inline = imm, remote_addr, rkey, inline


def send_chain(wr) -> List[WorkRequest]:
    out = []
    if isinstance(wr, StandinSendWR):
        while wr is not None:
            out.append(WorkRequest(wr.wr_id, wr.opcode, wr.send_flags,
                                   [(s.addr, s.length, s.lkey) for s in wr.sg[:wr.num_sge]], wr.imm_data,
                                   wr.remote_addr, wr.rkey_))
            wr = wr.next_wr
        return out
    at = id(wr) + _OFFSETS["send"]
    s = _SEND_VIEWS.get(at)
    if s is None:
        s = _SEND_VIEWS[at] = _SendWr.from_address(at)
    while True:
        out.append(WorkRequest(s.wr_id, s.opcode, s.send_flags,
                               [(s.sg_list[i].addr, s.sg_list[i].length, s.sg_list[i].lkey)
                                for i in range(s.num_sge)], s.imm_data, s.remote_addr, s.rkey))
        at = s.next
        if not at:
            return out
        s = _SEND_VIEWS.get(at)
        if s is None:
            s = _SEND_VIEWS[at] = _SendWr.from_address(at)


def recv_chain(wr) -> List[Tuple[int, List[Tuple[int, int, int]]]]:
    out = []
    if isinstance(wr, StandinRecvWR):
        while wr is not None:
            out.append((wr.wr_id, [(s.addr, s.length, s.lkey) for s in wr.sg[:wr.num_sge]]))
            wr = wr.next_wr
        return out
    at = id(wr) + _OFFSETS["recv"]
    r = _RECV_VIEWS.get(at)
    if r is None:
        r = _RECV_VIEWS[at] = _RecvWr.from_address(at)
    while True:
        out.append((r.wr_id, [(r.sg_list[i].addr, r.sg_list[i].length, r.sg_list[i].lkey)
                              for i in range(r.num_sge)]))
        at = r.next
        if not at:
            return out
        r = _RECV_VIEWS.get(at)
        if r is None:
            r = _RECV_VIEWS[at] = _RecvWr.from_address(at)


# --- the NIC: registries and the wire -----------------------------------------------------------------------------

class Nic:
    def __init__(self):
        self.names = itertools.count(1)
        self.keys = itertools.count(0x1000)
        self.qpns = itertools.count(0x11)
        self.local: Dict[int, Tuple[int, int]] = {}  # lkey -> (addr, length)
        self.remote: Dict[int, Tuple[int, int]] = {}  # rkey of host memory -> (addr, length)
        self.qps: Dict[int, "QP"] = {}
        self.listeners: Dict[Tuple[str, int], "CMID"] = {}

    def channel_fd(self) -> int:
        """A readable-when-notified fd on an anonymous inode, as a completion channel's (an eventfd)."""
        return os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)


NIC = Nic()


def _notify(fd: int) -> None:
    os.eventfd_write(fd, 1)


def _drain(fd: int) -> int:
    """Notifications taken (all of them: an eventfd counts them)."""
    try:
        return os.eventfd_read(fd)
    except BlockingIOError:
        return 0


def _check(table: Dict[int, Tuple[int, int]], key: int, addr: int, length: int) -> bool:
    region = table.get(key)
    return region is not None and region[0] <= addr and addr + length <= region[0] + region[1]


# --- device objects -----------------------------------------------------------------------------------------

class DeviceAttr:
    """ibv_device_attr of a generous device; fields not listed read as 1024."""

    max_qp_rd_atom = 16
    max_qp_init_rd_atom = 16
    max_res_rd_atom = 1 << 16
    max_qp_wr = 16384
    max_sge = 32
    max_sge_rd = 32
    max_cq = 1 << 16
    max_cqe = 1 << 20
    max_mr = 1 << 20
    max_mr_size = (1 << 64) - 1
    max_pd = 1 << 16
    max_qp = 1 << 16
    max_srq = 0
    device_cap_flags = 0
    fw_ver = "fakeverbs"
    vendor_id = 0
    vendor_part_id = 0
    phys_port_cnt = 1

    def __getattr__(self, name):
        return 1024


class Context:
    def __init__(self, name=None, **kw):
        self.name = name or "fakerdma0"

    def query_device(self, *a, **kw):
        return DeviceAttr()

    def query_port(self, *a, **kw):
        return types.SimpleNamespace(state=4, active_mtu=5, max_mtu=5, gid_tbl_len=16, link_layer=2)

    def close(self):
        pass


class PD:
    def __init__(self, ctx, **kw):
        self.ctx = ctx

    def close(self):
        pass


class MR:
    def __init__(self, pd, length, access, address=None, **kw):
        self._keep = None
        if address is None:
            self._keep = ctypes.create_string_buffer(length)
            address = ctypes.addressof(self._keep)
        self.buf = address
        self.length = length
        self.lkey = self.rkey = next(NIC.keys)
        NIC.local[self.lkey] = (address, length)

    def read(self, length, offset):
        return ctypes.string_at(self.buf + offset, length)

    def write(self, data, length, offset=0):
        ctypes.memmove(self.buf + offset, bytes(data[:length]), length)

    def close(self):
        NIC.local.pop(self.lkey, None)


class UseAfterClose(AssertionError):
    """A call on a closed verbs object: pyverbs 44 sets the object's pointer to NULL at close and passes it to
    the provider anyway, so the real process dies with SIGSEGV here."""


class CompChannel:
    def __init__(self, ctx, **kw):
        self.fd = NIC.channel_fd()

    def get_cq_event(self, cq=None):
        if self.fd < 0:
            raise UseAfterClose("get_cq_event on a closed completion channel")
        t0 = _perf()
        try:
            if not _drain(self.fd):
                raise _eagain("get_cq_event")
            return cq
        finally:
            DEVICE.add(t0)

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class CQ:
    def __init__(self, ctx, cqe=1, cq_context=None, channel=None, comp_vector=0, **kw):
        self.channel = channel
        self.pending: deque = deque()
        self.armed = False
        self.closed = False

    def req_notify(self, solicited_only=False):
        self.armed = True

    def ack_events(self, num_events=1):
        pass

    def push(self, wr_id, status, opcode, byte_len=0, qp_num=0):
        self.pending.append((wr_id, status, opcode, byte_len, qp_num))
        if self.armed and self.channel is not None:
            self.armed = False
            _notify(self.channel.fd)

    def poll(self, num_entries=1):
        if self.closed:
            raise UseAfterClose("poll on a closed CQ")
        t0 = _perf()
        taken = []
        while self.pending and len(taken) < num_entries:
            taken.append(self.pending.popleft())
        DEVICE.add(t0)
        # pyverbs builds a WC object per completion: that cost is the transport's, so it is not subtracted
        wc = PV.WC
        wcs = [wc(wr_id=w, status=s, opcode=o, byte_len=b, qp_num=q) for w, s, o, b, q in taken]
        return len(wcs), wcs

    def close(self):
        self.closed = True


class CqInitAttrEx:
    def __init__(self, cqe=1, cq_context=None, channel=None, comp_vector=0, wc_flags=0, comp_mask=0, flags=0,
                 **kw):
        self.cqe, self.channel = cqe, channel


class CQEX(CQ):
    """The extended CQ (ibv_cq_ex): start_poll / poll_next / end_poll and per-field reads, no WC objects."""

    def __init__(self, ctx, init_attr=None, **kw):
        super().__init__(ctx, channel=getattr(init_attr, "channel", None))
        self.current = None

    def start_poll(self, attr=None):
        if not self.pending:
            raise PV.error("start_poll: CQ is empty", errno.ENOENT)
        self.current = self.pending.popleft()

    def poll_next(self):
        if not self.pending:
            raise PV.error("poll_next: CQ is empty", errno.ENOENT)
        self.current = self.pending.popleft()

    def end_poll(self):
        self.current = None

    @property
    def wr_id(self):
        return self.current[0]

    @property
    def status(self):
        return self.current[1]

    def read_opcode(self):
        return self.current[2]

    def read_byte_len(self):
        return self.current[3]

    def read_qp_num(self):
        return self.current[4]

    def read_vendor_err(self):
        return 0

    def read_wc_flags(self):
        return 0

    def read_imm_data(self):
        return 0


class _Attrs:
    def __init__(self, **kw):
        self.__dict__.update(kw)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return 0


class QPCap(_Attrs):
    pass


class QPInitAttr(_Attrs):
    pass


class QPInitAttrEx(_Attrs):
    pass


class QPAttr(_Attrs):
    pass


class QP:
    """An RC QP on the fake NIC, with the legacy post calls and the extended (QPEx) wr_* calls."""

    def __init__(self, pd_or_ctx, init_attr, qp_attr=None, to_init=False, **kw):
        self.init_attr = init_attr
        self.scq = getattr(init_attr, "scq", None) or getattr(init_attr, "send_cq", None)
        self.rcq = getattr(init_attr, "rcq", None) or getattr(init_attr, "recv_cq", None) or self.scq
        self.sig_all = bool(getattr(init_attr, "sq_sig_all", 0))
        self.qp_num = next(NIC.qpns)
        self.recvs: deque = deque()
        self.peer = None  # the host end (HostEnd) once the CM accepted
        self.error = False
        self.closed = False
        self.qp_state = 0
        self._batch: List[WorkRequest] = []
        self._wr_id = 0
        self._wr_flags = 0
        NIC.qps[self.qp_num] = self

    # legacy verbs
    def modify(self, attr, mask=0):
        self.qp_state = getattr(attr, "qp_state", self.qp_state)
        self.modified = getattr(self, "modified", {})
        self.modified[self.qp_state] = (dict(vars(attr)), mask)  # what each state was reached with

    def to_init(self, *a, **kw):
        pass

    def to_rtr(self, *a, **kw):
        pass

    def to_rts(self, *a, **kw):
        pass

    def _alive(self, call: str) -> None:
        if self.closed:
            raise UseAfterClose(f"{call} on a destroyed QP")

    def post_recv(self, wr, bad_wr=None):
        self._alive("post_recv")
        t0 = _perf()
        self.recvs.extend(recv_chain(wr))
        DEVICE.add(t0)

    def post_send(self, wr, bad_wr=None):
        self._alive("post_send")
        t0 = _perf()
        try:
            for w in send_chain(wr):
                self._execute(w)
        finally:
            DEVICE.add(t0)

    # extended verbs (ibv_wr_*): in pyverbs each is one Cython call into an inline libibverbs function that
    # writes the provider's send queue, so all of the fake's own work in them is device time (the Cython call
    # itself, about 0.05-0.1 µs each, is then left out of the transport's figure)
    @property
    def wr_id(self):
        return self._wr_id

    @wr_id.setter
    def wr_id(self, value):
        t0 = _perf()
        self._wr_id = value
        DEVICE.add(t0)

    @property
    def wr_flags(self):
        return self._wr_flags

    @wr_flags.setter
    def wr_flags(self, value):
        t0 = _perf()
        self._wr_flags = value
        DEVICE.add(t0)

    def wr_start(self):
        self._alive("wr_start")
        t0 = _perf()
        self._batch = []
        DEVICE.add(t0)

    def _new(self, opcode, remote_addr=0, rkey=0, imm=0):
        t0 = _perf()
        self._batch.append(WorkRequest(self._wr_id, opcode, self._wr_flags, [], imm, remote_addr, rkey))
        DEVICE.add(t0)

    def wr_rdma_write(self, rkey, remote_addr):
        self._new(PV.e.IBV_WR_RDMA_WRITE, remote_addr, rkey)

    def wr_rdma_read(self, rkey, remote_addr):
        self._new(PV.e.IBV_WR_RDMA_READ, remote_addr, rkey)

    def wr_send(self):
        self._new(PV.e.IBV_WR_SEND)

    def wr_send_inv(self, invalidate_rkey):
        self._new(PV.e.IBV_WR_SEND_WITH_INV, imm=invalidate_rkey)

    def wr_set_sge(self, sge):  # pyverbs 44: an SGE object, read at the call (the provider copies it)
        t0 = _perf()
        self._batch[-1].sges = [(sge.addr, sge.length, sge.lkey)]
        DEVICE.add(t0)

    def wr_set_sge_list(self, sg_list):
        t0 = _perf()
        self._batch[-1].sges = [(s.addr, s.length, s.lkey) for s in sg_list]
        DEVICE.add(t0)

    def wr_set_inline_data(self, *args):
        t0 = _perf()
        if len(args) == 1:  # data
            self._batch[-1].inline = bytes(args[0])
        else:  # addr, length
            self._batch[-1].inline = ctypes.string_at(args[0], args[1])
        DEVICE.add(t0)

    def wr_complete(self):
        self._alive("wr_complete")
        t0 = _perf()
        try:
            batch, self._batch = self._batch, []
            for w in batch:
                self._execute(w)
        finally:
            DEVICE.add(t0)

    def wr_abort(self):
        self._batch = []

    def close(self):
        self.closed = True
        NIC.qps.pop(self.qp_num, None)

    # the wire
    def _gather(self, w: WorkRequest) -> Optional[bytes]:
        if w.inline is not None:
            return w.inline
        # IBV_SEND_INLINE through the legacy post_send: the provider copies the bytes at the post, no lkey needed
        inline = bool(w.flags & PV.e.IBV_SEND_INLINE)
        parts = []
        for addr, length, lkey in w.sges:
            if not inline and not _check(NIC.local, lkey, addr, length):
                return None
            parts.append(ctypes.string_at(addr, length))
        return b"".join(parts)

    def _execute(self, w: WorkRequest) -> None:
        e = PV.e
        signaled = self.sig_all or bool(w.flags & e.IBV_SEND_SIGNALED)
        if self.error or self.peer is None:
            self.scq.push(w.wr_id, e.IBV_WC_WR_FLUSH_ERR, 0, 0, self.qp_num)
            return
        status, wc_opcode, length = e.IBV_WC_SUCCESS, 0, 0
        if w.opcode == e.IBV_WR_RDMA_WRITE:
            wc_opcode = e.IBV_WC_RDMA_WRITE
            length = sum(s[1] for s in w.sges) if w.inline is None else len(w.inline)
            if not _check(NIC.remote, w.rkey, w.remote_addr, length) or \
                    not all(_check(NIC.local, lk, a, n) for a, n, lk in w.sges):
                status, length = e.IBV_WC_REM_ACCESS_ERR, 0
            elif w.inline is not None:
                ctypes.memmove(w.remote_addr, w.inline, length)
            else:
                dst = w.remote_addr
                for addr, n, _ in w.sges:
                    ctypes.memmove(dst, addr, n)
                    dst += n
        elif w.opcode == e.IBV_WR_RDMA_READ:
            wc_opcode = e.IBV_WC_RDMA_READ
            total = sum(s[1] for s in w.sges)
            if not _check(NIC.remote, w.rkey, w.remote_addr, total) or \
                    not all(_check(NIC.local, lk, a, n) for a, n, lk in w.sges):
                status = e.IBV_WC_REM_ACCESS_ERR
            else:
                src = w.remote_addr
                for addr, n, _ in w.sges:
                    ctypes.memmove(addr, src, n)
                    src += n
                length = total
        elif w.opcode in (e.IBV_WR_SEND, e.IBV_WR_SEND_WITH_INV, e.IBV_WR_SEND_WITH_IMM):
            data = self._gather(w)
            wc_opcode = e.IBV_WC_SEND
            if data is None:
                status = e.IBV_WC_LOC_PROT_ERR
            else:
                self.peer.deliver(data, w.imm if w.opcode == e.IBV_WR_SEND_WITH_INV else None)
                length = len(data)
        else:
            status = e.IBV_WC_LOC_QP_OP_ERR
        if status != e.IBV_WC_SUCCESS:
            self.error = True
            self.scq.push(w.wr_id, status, wc_opcode, 0, self.qp_num)
        elif signaled:
            self.scq.push(w.wr_id, status, wc_opcode, length, self.qp_num)

    def receive(self, capsule: bytes) -> None:
        """The host's SEND arriving: into the next posted receive buffer, completed on the receive CQ."""
        if not self.recvs:
            raise RuntimeError("receiver not ready: the target has no receive posted (RNR)")
        wr_id, sges = self.recvs.popleft()
        addr, length, _ = sges[0]
        if len(capsule) > length:
            self.rcq.push(wr_id, PV.e.IBV_WC_LOC_LEN_ERR, PV.e.IBV_WC_RECV, 0, self.qp_num)
            return
        ctypes.memmove(addr, capsule, len(capsule))
        self.rcq.push(wr_id, PV.e.IBV_WC_SUCCESS, PV.e.IBV_WC_RECV, len(capsule), self.qp_num)


QPEx = QP


# --- the RDMA CM --------------------------------------------------------------------------------------------

class GID:
    def __init__(self, val=None):
        self.gid = val


class GlobalRoute(_Attrs):
    pass


class AHAttr(_Attrs):
    pass


# --- the host end of a queue --------------------------------------------------------------------------------

class HostEnd:
    """What the fake NIC delivers to on the host side: a connect's outcome (read from the fake CM on first use)
    and the target's SENDs."""

    def __init__(self, handle: int = 0):
        self.handle = handle  # the target's child id in the fake CM (0: a QP wired to this end by hand)
        self._qp: Optional[QP] = None
        self._answer = None
        self.closed_here = False
        self.responses: deque = deque()
        self.invalidated = 0  # SENDs with Invalidate (a count: a list would grow the RSS being measured)

    def answer(self):
        """The target's answer so far (fakecm.Answer); once accepted, its QP delivers to this end."""
        if self._answer is None or self._answer.state == "pending":
            import fakecm
            self._answer = fakecm.answer(self.handle)
            if self._answer.state == "accepted" and self._qp is None:
                self._qp = NIC.qps[self._answer.qp_num]
                self._qp.peer = self
        return self._answer

    @property
    def qp(self) -> Optional[QP]:
        if self.handle:
            self.answer()
        return self._qp

    @qp.setter
    def qp(self, qp: QP) -> None:
        self._qp = qp

    @property
    def accept_data(self) -> Optional[bytes]:
        return self.answer().private_data if self.qp is not None else None

    @property
    def reject_data(self) -> Optional[bytes]:
        answer = self.answer()
        return answer.private_data if answer.state == "rejected" else None

    @property
    def disconnected(self) -> bool:
        """The target disconnected this end (or the host closed it: `closed_here`)."""
        import fakecm
        return self.closed_here or fakecm.answer(self.handle).state in ("disconnected", "destroyed")

    @disconnected.setter
    def disconnected(self, value: bool) -> None:
        self.closed_here = value

    def deliver(self, data: bytes, invalidate: Optional[int]):
        self.responses.append(data)
        if invalidate is not None:
            self.invalidated += 1

    def send(self, capsule: bytes) -> None:
        t0 = _perf()
        try:
            self.qp.receive(capsule)
        finally:
            DEVICE.add(t0)


def register_host_memory(size: int):
    """Host memory the target may READ and WRITE: (ctypes buffer, addr, rkey)."""
    buf = ctypes.create_string_buffer(size)
    addr = ctypes.addressof(buf)
    key = next(NIC.keys)
    NIC.remote[key] = (addr, size)
    return buf, addr, key


_PEER_PORTS = itertools.count(40000)


def connect(traddr: str, trsvcid: int, private_data: bytes, peer: str = "10.0.0.99") -> HostEnd:
    """A CONNECT_REQUEST from `peer` to the listener on traddr:trsvcid through the fake CM; the caller runs the
    target's loop."""
    import fakecm
    handle = fakecm.connect(traddr, int(trsvcid), peer, next(_PEER_PORTS), private_data)
    if not handle:
        raise RuntimeError(f"nothing listens on {traddr}:{trsvcid} on the fake device")
    return HostEnd(handle)


# --- installing ---------------------------------------------------------------------------------------------

DEVICE_CLASSES = {
    "pyverbs.device": {"Context": Context},
    "pyverbs.pd": {"PD": PD},
    "pyverbs.mr": {"MR": MR},
    "pyverbs.cq": {"CQ": CQ, "CompChannel": CompChannel, "CQEX": CQEX, "CqInitAttrEx": CqInitAttrEx},
    "pyverbs.qp": {"QP": QP, "QPEx": QPEx, "QPCap": QPCap, "QPInitAttr": QPInitAttr, "QPInitAttrEx": QPInitAttrEx,
                   "QPAttr": QPAttr},
    "pyverbs.addr": {"AHAttr": AHAttr, "GlobalRoute": GlobalRoute, "GID": GID},
}


def install(prefer_real: bool = True) -> bool:
    """Put the fake device under pyverbs' names before the transport is imported. Returns True when the real
    pyverbs (its enums, work requests and WC objects) is in use, False with stand-ins."""
    if "nvmeof_roce.transport.rdma.verbs" in sys.modules:  # every RDMA module takes pyverbs' names from it
        raise RuntimeError("install() must run before nvmeof_roce.transport.rdma.verbs is imported")
    real = False
    if prefer_real:
        try:
            import pyverbs.cm_enums
            import pyverbs.enums
            import pyverbs.cq
            import pyverbs.pyverbs_error
            real = True
        except ImportError:
            real = False
    if not real:
        install_standins()
    import importlib
    for modname, classes in DEVICE_CLASSES.items():
        mod = importlib.import_module(modname)
        for name, cls in classes.items():
            setattr(mod, name, cls)
    PV.e = importlib.import_module("pyverbs.enums")
    PV.ce = importlib.import_module("pyverbs.cm_enums")
    PV.error = importlib.import_module("pyverbs.pyverbs_error").PyverbsRDMAError
    PV.WC = importlib.import_module("pyverbs.cq").WC
    PV.real = real
    if real:
        _learn_offsets()
    import fakecm
    from nvmeof_roce import native
    if native.module is None:
        raise RuntimeError(f"the fake device needs the native module's CM: {native.missing_reason}")
    fakecm.load(native.module)
    return real


# --- stand-ins for a machine without pyverbs ----------------------------------------------------------------

class StandinSGE:
    __slots__ = ("addr", "length", "lkey")

    def __init__(self, addr, length, lkey):
        self.addr, self.length, self.lkey = addr, length, lkey


class StandinRecvWR:
    def __init__(self, wr_id=0, num_sge=0, sg=None, next_wr=None):
        self.wr_id, self.num_sge, self.sg, self.next_wr = wr_id, num_sge, list(sg or []), next_wr


class StandinSendWR:
    def __init__(self, wr_id=0, opcode=None, num_sge=0, imm_data=0, sg=None, send_flags=None, next_wr=None):
        e = sys.modules["pyverbs.enums"]
        self.wr_id = wr_id
        self.opcode = e.IBV_WR_SEND if opcode is None else opcode
        self.num_sge, self.imm_data, self.sg, self.next_wr = num_sge, imm_data, list(sg or []), next_wr
        self.send_flags = e.IBV_SEND_SIGNALED if send_flags is None else send_flags
        self.remote_addr = self.rkey_ = 0

    def set_wr_rdma(self, rkey, addr):
        self.rkey_, self.remote_addr = rkey, addr

    @property
    def sg_list(self):
        return self.sg

    @sg_list.setter
    def sg_list(self, sge):
        self.sg = [sge]


class StandinWC:
    __slots__ = ("wr_id", "status", "opcode", "byte_len", "qp_num", "vendor_err", "imm_data", "wc_flags",
                 "src_qp", "pkey_index", "slid", "sl", "dlid_path_bits")

    def __init__(self, wr_id=0, status=0, opcode=0, vendor_err=0, byte_len=0, qp_num=0, src_qp=0, imm_data=0,
                 wc_flags=0, pkey_index=0, slid=0, sl=0, dlid_path_bits=0):
        self.wr_id, self.status, self.opcode, self.vendor_err, self.byte_len = wr_id, status, opcode, vendor_err, byte_len
        self.qp_num, self.src_qp, self.imm_data, self.wc_flags = qp_num, src_qp, imm_data, wc_flags
        self.pkey_index, self.slid, self.sl, self.dlid_path_bits = pkey_index, slid, sl, dlid_path_bits


class StandinRDMAError(Exception):
    def __init__(self, msg, error_code=-1):
        super().__init__(msg)
        self.error_code = error_code


def _enum_module(name: str, zero: Tuple[str, ...]) -> types.ModuleType:
    """Enum constants made up on first use: distinct powers of two (so flags combine), zero where asked."""
    mod = types.ModuleType(name)
    bits = itertools.count(0)

    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = 0 if attr in zero else 1 << next(bits)
        setattr(mod, attr, value)
        return value

    mod.__getattr__ = __getattr__
    return mod


def install_standins() -> None:
    pkg = types.ModuleType("pyverbs")
    pkg.__path__ = []  # a package, so `import pyverbs.x` looks in sys.modules
    mods = {
        "pyverbs": pkg,
        "pyverbs.enums": _enum_module("pyverbs.enums", ("IBV_WC_SUCCESS",)),
        "pyverbs.cm_enums": _enum_module("pyverbs.cm_enums", ()),
        "pyverbs.pyverbs_error": types.ModuleType("pyverbs.pyverbs_error"),
        "pyverbs.wr": types.ModuleType("pyverbs.wr"),
    }
    for name in DEVICE_CLASSES:
        mods[name] = types.ModuleType(name)
    mods["pyverbs.pyverbs_error"].PyverbsRDMAError = StandinRDMAError
    mods["pyverbs.pyverbs_error"].PyverbsError = StandinRDMAError
    mods["pyverbs.pyverbs_error"].PyverbsUserError = StandinRDMAError
    mods["pyverbs.wr"].SGE = StandinSGE
    mods["pyverbs.wr"].SendWR = StandinSendWR
    mods["pyverbs.wr"].RecvWR = StandinRecvWR
    mods["pyverbs.cq"].WC = StandinWC
    for name, mod in mods.items():
        sys.modules[name] = mod
        if name != "pyverbs":
            setattr(pkg, name.split(".", 1)[1], mod)
