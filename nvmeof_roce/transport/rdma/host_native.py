"""The initiator's native I/O queues: the CM and the Connect in Python, the data path in C (csrc/hostq.c).

`NativeRdmaConnector` opens the admin queue as `RdmaConnector` does (pyverbs) and each I/O queue as a
`NativeHostQueue`: the native CM (transport/rdma/cmchannel.py) resolves the address and route on the queue's own
CM id, then `_native.create_host_qp` makes the QP on that id with librdmacm (on its PD, one polled CQ), and the
memory the queue uses is registered on that PD.  The CM's connect sends the connect request; since the id has a
QP, librdmacm takes it to RTR and RTS when the response arrives and reports ESTABLISHED.  The Connect command
goes through `send`/`poll` (C, with the GIL), and `perf` runs the whole measured loop in C with the GIL released (docs/native.md, "The host queue").
"""
from __future__ import annotations

import ctypes
import logging
import mmap
from typing import List, Optional

from ... import native
from ...nvme import cm as cmdata
from ..contracts import HostBuffer, TransportError
from .verbs import ADMIN_CAPSULE, RESPONSE_SIZE
from .host import INLINE_CAPSULE, SIGNAL_INTERVAL, RdmaConnector, RdmaHostQueue

IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_WRITE, IBV_ACCESS_REMOTE_READ = 1, 2, 4

log = logging.getLogger(__name__)


class NativeRdmaConnector(RdmaConnector):
    """`RdmaConnector` whose I/O queues are `NativeHostQueue`s (the admin queue stays on the Python path)."""

    def __init__(self, *args, **kw):
        if not native.available():
            raise TransportError(native.missing_reason)
        super().__init__(*args, **kw)

    def connect(self, qid: int, hrqsize: int, hsqsize: int, cntlid: int = 0):
        if qid == 0:
            return super().connect(qid, hrqsize, hsqsize, cntlid)
        return NativeHostQueue(self, qid, hrqsize, hsqsize, cntlid)


class NativeHostQueue(RdmaHostQueue):
    """One I/O queue whose QP, CQ and work requests are C's (`_native.HostQueue`)."""

    def __init__(self, connector: NativeRdmaConnector, qid: int, hrqsize: int, hsqsize: int, cntlid: int):
        from pyverbs.pyverbs_error import PyverbsRDMAError
        module = native.module
        self.module = module
        self.connector = connector
        self.qid = qid
        self.closed = False
        self._released = False
        self.objects: Optional[dict] = None
        self.mrs: List[int] = []
        self.maps: List[mmap.mmap] = []
        self.buffers = []
        self.native = None
        where = self._resolve()
        try:
            _, _ = connector._device(self.cm_id.dev_name)  # the device's limits (RDMA READ resources)
            depth = hsqsize + 1
            sq_size = 2 * depth + 2  # unsignaled SENDs hold their entries until a later signaled one completes
            self.capsule_size = ADMIN_CAPSULE + connector.max_in_capsule
            self.objects = module.create_host_qp(self.cm_id.channel.channel, self.cm_id.handle,
                                                 hrqsize + sq_size + 4, sq_size, hrqsize, INLINE_CAPSULE)
            self.inline_max = self.objects["max_inline"]
            recv_addr, recv_lkey = self._memory(hrqsize * RESPONSE_SIZE, IBV_ACCESS_LOCAL_WRITE)
            send_addr, send_lkey = self._memory(depth * self.capsule_size, IBV_ACCESS_LOCAL_WRITE)
            self.native = module.HostQueue(self.objects["qp"], self.objects["cq"], recv_addr, recv_lkey, hrqsize,
                                           send_addr, send_lkey, depth, self.capsule_size, self.inline_max, sq_size,
                                           min(SIGNAL_INTERVAL, max(1, depth // 2)), self.objects["channel"])
            resources = max(1, min(16, connector.device.max_qp_rd_atom))
            self.cm_id.connect(cmdata.CmConnectRequest(0, qid, hrqsize, hsqsize, cntlid).pack(), resources, 0,
                               self.objects["qp_num"])
            # the id has a QP: librdmacm answers the connect response itself (RTR, RTS) and reports ESTABLISHED
            private = self._wait_event("ESTABLISHED", f"connecting queue {qid} to {where}")
        except (TransportError, PyverbsRDMAError, OSError, ValueError) as exc:
            self._release_verbs()
            self._close_cm()
            if isinstance(exc, TransportError):
                raise
            raise TransportError(f"queue {qid} to {where} (native data path): {exc}") from None
        self.crqsize = cmdata.CmAccept.unpack(private).crqsize if len(private) >= 4 else depth
        self.responses = []

    def _memory(self, size: int, access: int):
        """Anonymous memory registered on the CM id's PD: (address, lkey); its rkey is in self.last_rkey."""
        mapping = mmap.mmap(-1, size)
        self.maps.append(mapping)
        anchor = ctypes.c_char.from_buffer(mapping)
        addr = ctypes.addressof(anchor)
        del anchor  # no export left on the mapping
        mr, lkey, self.last_rkey = self.module.reg_mr(self.objects["pd"], addr, size, access)
        self.mrs.append(mr)
        return addr, lkey

    def register(self, size: int) -> HostBuffer:
        addr, _ = self._memory(size, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE)
        return HostBuffer(addr, self.last_rkey, memoryview(self.maps[-1])[:size])

    def send(self, capsule: bytes) -> None:
        if self.closed:
            raise TransportError("queue is closed")
        try:
            self.native.send(capsule)
        except (OSError, ValueError) as exc:  # ConnectionError and TimeoutError are OSErrors
            if isinstance(exc, ConnectionError):
                self.closed = True
            raise TransportError(f"queue {self.qid}: {exc}") from None

    def poll(self, timeout: float) -> list:
        if self.closed and not self.responses:
            raise TransportError(f"queue {self.qid} is closed")
        try:
            return self.native.poll(max(0.0, timeout))
        except ConnectionError as exc:
            self.closed = True
            self._log_refused_responses()
            raise TransportError(f"queue {self.qid}: {exc}") from None

    def defer_sends(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def perf(self, **kw) -> dict:
        """The measured loop in C (`_native.HostQueue.perf`); a lost connection is a TransportError."""
        try:
            return self.native.perf(**kw)
        except (ConnectionError, TimeoutError) as exc:
            self.closed = True
            self._log_refused_responses()
            raise TransportError(f"queue {self.qid}: {exc}") from None

    def _log_refused_responses(self) -> None:
        """The responses the C queue refused (short, or for no command in flight), each of which failed it."""
        stats = self.native.stats() if self.native is not None else {}
        if stats.get("short_responses") or stats.get("unknown_responses"):
            log.warning("queue %d: refused %d short responses and %d for commands not in flight; the queue failed",
                        self.qid, stats["short_responses"], stats["unknown_responses"])

    def _release_verbs(self) -> None:
        """The QP and CQ first (nothing writes our memory afterwards), then the registrations."""
        self.native = None
        if self.objects is not None:
            try:
                self.module.destroy_host_qp(self.cm_id.channel.channel, self.cm_id.handle, self.objects["cq"],
                                            self.objects["channel"])
            except OSError:
                pass
            self.objects = None
        for mr in self.mrs:
            try:
                self.module.dereg_mr(mr)
            except OSError:
                pass
        self.mrs = []

    def close(self) -> None:
        if self._released:
            return
        self._released = True
        self.closed = True
        try:  # rdma_disconnect moves the QP to the error state, then the CM disconnect
            self.cm_id.disconnect()
            self._wait_event("DISCONNECTED", f"disconnecting queue {self.qid}", timeout=2.0)
        except Exception:
            pass
        self._release_verbs()
        self._close_cm()

