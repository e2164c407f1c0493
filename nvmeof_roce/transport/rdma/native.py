"""Native I/O queues on a real RDMA device: the QP made by librdmacm on the CM id, the data path in C (docs/native.md).

`RdmaListener` (transport/rdma/cm.py) keeps the CM: it checks the connect request and, on a listener whose data path
is native, opens each I/O queue here instead of as an `RdmaTargetQueue` (admin queues stay on the Python path).
`_native.create_cm_qp` makes the QP with a send and a receive CQ on their own completion channels, on the PD
librdmacm keeps for the device (`id->pd`); the memory the C queue uses is registered on that PD
(`NativePortMemory`: the port's data pool a second time, zero and sink buffers, RAM namespaces);
`CmId.accept_rts` moves the QP to RTR and RTS with a bounded RNR retry count and ACK timeout (as the Python data
path does), then accepts.  The CQ channels' fds are watched by the event loop (`--poll interrupt`),
or the queue is polled on every loop pass (`--poll busy`: `NativeTargetQueue.start_polling`), or by a poll
group's thread (`--cores N`, transport/rdma/pollgroups.py).
"""
from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass
from typing import Dict, Optional

from ...nvme import cm as cmdata
from ...nvme.command import SQE_SIZE
from ..contracts import TransportError
from .connect import queue_resources
from .native_queue import ChunkPool, NativeTargetQueue, NativeVerbs, QueueLife, Region
from .verbs import ACK_TIMEOUT, QPS_RTS, RNR_RETRY
from ..resources import registered_region

log = logging.getLogger(__name__)

IBV_ACCESS_LOCAL_WRITE = 1
# Bounce memory a closed queue gave back, kept registered for the next queue (per size): registering it anew holds
# the event loop (seconds for 32 MiB in an emulated guest, past a 1 s keep-alive timeout); at most this many are
# kept, so a burst of queues does not stay pinned.
SPARE_BOUNCE = 16
RESPONSE_SIZE = 16
# How long a torn-down queue waits for its QP's flushed work requests (after rdma_disconnect put it in the error
# state) before destroying it: a device flushes at once or within its own tasklet (rxe), so this bounds a stuck one.
FLUSH_WAIT_US = 20_000


class NativePortMemory:
    """What every native queue of one listener shares, registered on librdmacm's PD of the device."""

    def __init__(self, module, listener, pd: int):
        self.module = module
        self.pd = pd
        self.mrs = []
        pool = listener.pool
        size = pool.chunk_size * pool.accounts.total
        mr, lkey, _ = module.reg_mr(pd, pool.memory.addr, size, IBV_ACCESS_LOCAL_WRITE)
        self.mrs.append(mr)
        self.pool = ChunkPool(Region(pool.memory.addr, lkey, size, pool.memory.view), pool.chunk_size)
        self.zero = self._buffer(listener.max_transfer)
        self.sink = self._buffer(listener.max_transfer)
        self.regions: Dict[int, tuple] = {}  # id(backend) -> (backend, mapping, (addr, lkey) or None, its MR)
        self.spare_bounce: Dict[int, list] = {}  # size -> [Bounce], given back by closed queues
        self.closed = False

    def take_bounce(self, size: int) -> "Bounce":
        """Registered, page-aligned bounce memory of `size` bytes: one a closed queue gave back, or made now."""
        spare = self.spare_bounce.get(size)
        if spare:
            return spare.pop()
        mapping = mmap.mmap(-1, size)
        addr = _address(mapping)
        try:
            mr, lkey, _ = self.module.reg_mr(self.pd, addr, size, IBV_ACCESS_LOCAL_WRITE)
        except OSError:
            mapping.close()
            raise
        return Bounce(mapping, mr, Region(addr, lkey, size))

    def give_back_bounce(self, bounce: "Bounce") -> None:
        """From a closed queue (its QP destroyed, its ring's commands complete): kept for the next one, or let go."""
        spare = None if self.closed else self.spare_bounce.setdefault(bounce.region.length, [])
        if spare is None or len(spare) >= SPARE_BOUNCE:
            bounce.release(self.module)
        else:
            spare.append(bounce)

    def _buffer(self, size: int) -> Region:
        mapping = mmap.mmap(-1, size)
        self.keep = getattr(self, "keep", []) + [mapping]
        addr = _address(mapping)
        mr, lkey, _ = self.module.reg_mr(self.pd, addr, size, IBV_ACCESS_LOCAL_WRITE)
        self.mrs.append(mr)
        return Region(addr, lkey, size, memoryview(mapping))

    def region(self, backend) -> Optional[tuple]:
        """(addr, lkey) of a RAM namespace's memory on this PD (registered once; released when its memory
        changed or it closed, its commands drained: resources.registered_region)."""
        return registered_region(self.regions, backend, self._register_ram, self._release_ram)

    def _register_ram(self, pin, _mapping) -> tuple:
        mapping = pin()
        try:
            mr, lkey, _ = self.module.reg_mr(self.pd, _address(mapping), len(mapping), IBV_ACCESS_LOCAL_WRITE)
        except OSError as exc:
            log.warning("cannot register a RAM namespace for the native data path (%s): the core serves it", exc)
            return mapping, None, None
        return mapping, (_address(mapping), lkey), mr

    def _release_ram(self, mr) -> None:
        if mr is None:
            return
        try:
            self.module.dereg_mr(mr)
        except OSError as exc:
            log.warning("deregistering a RAM namespace's old memory failed: %s", exc)

    def close(self) -> None:
        self.closed = True
        for spare in self.spare_bounce.values():
            for bounce in spare:
                bounce.release(self.module)
        self.spare_bounce.clear()
        for mr in self.mrs:
            try:
                self.module.dereg_mr(mr)
            except OSError as exc:
                log.warning("deregistering native memory failed: %s", exc)
        self.mrs = []
        for _backend, _mapping, _found, mr in self.regions.values():
            self._release_ram(mr)
        self.regions.clear()


@dataclass
class Bounce:
    """A native queue's bounce memory: the mapping, its memory region, what the C queue is given."""
    mapping: mmap.mmap
    mr: int
    region: Region

    def release(self, module) -> None:
        try:
            module.dereg_mr(self.mr)
        except OSError as exc:
            log.warning("deregistering bounce memory failed: %s", exc)
        self.mapping.close()


def _address(mapping) -> int:
    import ctypes
    anchor = ctypes.c_char.from_buffer(mapping)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor  # no export left on the mapping (it may be closed or resized later)


class RdmaNativeQueue(NativeTargetQueue):
    """One accepted I/O queue on the native data path."""

    def __init__(self, module, listener, cm_id, request, memory_of):
        self.listener = listener
        self.cm_id = cm_id  # cmchannel.CmId: create_cm_qp and destroy_cm_qp find the id through its channel
        self.cm_handle = cm_id.handle
        self.module = module
        self.recv_mr = None
        self.bounce_memory: Optional[Bounce] = None  # file and block namespaces' bounce memory, the port's
        self.released = False
        self.watched = []
        depth = request.hsqsize + 1
        in_capsule = listener.in_capsule_size if request.qid else 0
        recv_count, send_queue = queue_resources(depth)
        recv_size = SQE_SIZE + in_capsule
        self.objects = module.create_cm_qp(cm_id.channel.channel, cm_id.handle, send_queue, recv_count,
                                           RESPONSE_SIZE)
        try:
            memory: NativePortMemory = memory_of(self.objects["pd"])
            self.memory = memory
            self.recv_map = mmap.mmap(-1, recv_count * recv_size)
            addr = _address(self.recv_map)
            self.recv_mr, lkey, _ = module.reg_mr(self.objects["pd"], addr, len(self.recv_map), IBV_ACCESS_LOCAL_WRITE)
        except Exception:
            self._release()
            raise
        try:  # the host's responder resources: how many RDMA READs we may have in flight
            offered = cm_id.qp_attr(QPS_RTS)[0]["max_rd_atomic"]
        except (OSError, ValueError):
            offered = 0
        max_reads = min(offered or 1, listener.device.max_qp_init_rd_atom)
        share = listener.pool.accounts.share(wake=self._resume)
        super().__init__(module, listener.handler, request,
                         NativeVerbs(self.objects["qp"], self.objects["send_cq"], self.objects["recv_cq"], max_reads,
                                     listener.remote_invalidate),
                         in_capsule_size=in_capsule, recv=Region(addr, lkey, len(self.recv_map)),
                         chunks=memory.pool, share=share, max_transfer=listener.max_transfer, zero=memory.zero,
                         sink=memory.sink, region_of=memory.region, on_close=lambda queue: queue._release(),
                         bounce_of=self._bounce_of, file_buffers=listener.limits.queue_file_buffers,
                         watch=self._watch, unwatch=listener.loop.unwatch,
                         on_released=lambda queue: queue._give_back_bounce())
        self.cq_fd = self.objects["recv_fd"]
        if listener.poll_mode in ("interrupt", "adaptive") and listener.poll_groups is None:
            self.watched = [self.objects["recv_fd"], self.objects["send_fd"]]
        self.start_polling(listener.loop, listener.poll_mode, self.watched, self._on_cq_event,
                           poll_groups=listener.poll_groups)
        # RTR and RTS here, not by rdma_accept: its RTS would take the host's RNR retry count (7: for ever)
        try:
            rts = cm_id.accept_rts(cmdata.CmAccept(0, depth).pack(), 0, max_reads, RNR_RETRY, ACK_TIMEOUT)
        except Exception:
            self._abandon()  # the listener rejects, then destroys the id: its QP must be gone first
            raise
        log.debug("queue %d RTS: local ack timeout %d, retry %d, rnr retry %d", request.qid, rts["timeout"],
                  rts["retry_cnt"], rts["rnr_retry"])
        log.info("queue %d accepted on %s:%d (native data path): depth %d, in-capsule %d B, %d RDMA READs in "
                 "flight", request.qid, listener.traddr, listener.trsvcid, depth, in_capsule, max_reads)

    def _abandon(self) -> None:
        """A queue whose accept failed, never handed to the core: out of the loop and its poll group, its QP
        destroyed, the C queue closed and its memory let go."""
        self._move(QueueLife.CLOSED)
        for fd in self.watched:
            self.listener.loop.unwatch(fd)
        self.watched = []
        self._leave_poll_group()
        self._release()
        self.native.close()
        self.book.close(TransportError(f"queue {self.qid}: the accept failed"))
        self.share.close()
        self._move(QueueLife.RELEASED)
        self._give_back_bounce()

    def _bounce_of(self, size: int) -> Region:
        """The file and block namespaces' bounce chunks: page-aligned (O_DIRECT), registered on the QP's PD."""
        self.bounce_memory = self.memory.take_bounce(size)
        return self.bounce_memory.region

    def _give_back_bounce(self) -> None:
        """After the QP and the ring's last command: nothing writes the bounce memory any more."""
        if self.bounce_memory is not None:
            self.memory.give_back_bounce(self.bounce_memory)
            self.bounce_memory = None

    def _watch(self, fd: int, callback) -> None:
        self.listener.loop.watch(fd, callback)
        self.watched.append(fd)

    def poll_ring(self):
        return self._poll_more()

    def _resume(self) -> None:
        if not self.closed:
            self.book.resume()

    def _on_cq_event(self):
        if self.closed:
            return None
        module, objects = self.module, self.objects
        module.cq_events(objects["recv_channel"])
        module.cq_events(objects["send_channel"])
        if self.poll_mode == "adaptive":
            return self._poll_adaptive()
        self.native.arm()  # re-armed before polling, so no completion is missed
        return self._poll_more()

    def _poll_adaptive(self):
        """--poll adaptive (NativeTargetQueue.poll_adaptive): until the CQs are armed the loop calls again."""
        if self.closed:
            return None
        _done, armed = self.poll_adaptive(self.listener.poll_spin_us)
        return None if armed or self.closed else self._poll_adaptive

    def _poll_more(self):
        if self.closed:
            return None
        done = self.poll(self.POLL_BUDGET)
        again = done >= self.POLL_BUDGET or self.native.ring_unsubmitted  # the ring's submission failed: again
        return self._poll_more if again else None  # the loop calls again next pass

    def in_flight(self) -> int:
        return self.book.in_flight() + (0 if self.closed else self.native.stats()["native_in_flight"])

    def guarantee_capacity(self):
        return self.listener.pool.accounts.guarantee_capacity()

    def _teardown(self, error=None) -> None:
        if self.closed:
            return
        listener = self.listener
        for fd in self.watched:
            listener.loop.unwatch(fd)
        self.watched = []
        try:
            self.cm_id.disconnect()
        except Exception:
            pass
        try:
            super()._teardown(error)  # destroys the QP (on_close) before the requests and buffers are let go
        finally:
            self._release()
            if self.life is not QueueLife.HELD:  # else when the ring's last command is back (reap_closed)
                self._give_back_bounce()
            try:
                listener.forget(self)
            except Exception:
                log.exception("queue %d: releasing its CM id failed", self.qid)
            log.info("queue %d closed", self.qid)

    def _release(self) -> None:
        """The QP (and its CQs) first: nothing may write our buffers afterwards.  A torn-down queue's QP was put in
        the error state by rdma_disconnect (_teardown): the work requests it flushed are reaped first, by the C
        queue (reap_flushed: the queue failed, nothing delivered, a bounded wait), then the QP is destroyed, and
        the CM id only after (listener.forget)."""
        if self.released:
            return
        self.released = True
        native = getattr(self, "native", None)
        if native is not None and self.closed:
            try:
                left = native.reap_flushed(FLUSH_WAIT_US)
                if left:
                    log.warning("queue %d: %d work requests not flushed within %d ms of the disconnect: its QP is "
                                "destroyed anyway", self.qid, left, FLUSH_WAIT_US // 1000)
            except Exception as exc:
                log.warning("queue %d: reaping what its QP flushed failed: %s", self.qid, exc)
        try:
            self.module.destroy_cm_qp(self.cm_id.channel.channel, self.cm_id.handle)
        except Exception as exc:
            log.warning("destroying the native queue's QP failed: %s", exc)
        for name in ("recv_mr",):
            mr = getattr(self, name)
            if mr is not None:
                try:
                    self.module.dereg_mr(mr)
                except OSError:
                    pass
                setattr(self, name, None)
