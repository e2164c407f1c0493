"""The RDMA transport's entry in transport/registry.py: its SGL kinds, its connect checks and refusals, its
options (`RdmaOptions`: the native data path's and the poll groups', made by `opts_init` as SPDK's transports
do), its event loop and listener.  The modules behind it are imported when first used (pyverbs is loaded only
for an RDMA listener)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from ...tunables import POLL_SPIN_US
from ..contracts import ListenOptions, TransportOps, TransportSettings
from .connect import check_cm_request, reject_status
from .sgl import keyed_or_in_capsule_sgls, map_keyed_or_in_capsule

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RdmaOptions:
    """What every RDMA listener of the target is given besides the engine's limits."""

    remote_invalidate: bool = True  # answer a 0x4F descriptor with SEND with Invalidate
    data_path: str = "python"  # I/O queues: "native" runs them in C (transport/rdma/native.py, docs/native.md)
    poll_mode: str = "interrupt"  # native queues: completion channels, "busy" or "adaptive" (tunables.POLL)
    poll_groups: object = None  # pollgroups.PollGroups (--cores > 1): threads poll native queues
    poll_spin_us: int = POLL_SPIN_US.default  # poll_mode "adaptive": the spin's bound (tunables.POLL_SPIN_US)
    trace: bool = False  # the native queues' per-command trace (native_trace.TRACING)


def opts_init(settings: TransportSettings) -> RdmaOptions:
    """The options of `settings` (checked by the service), with the poll-group threads they ask for made and
    the trace turned on; `close_opts` undoes both."""
    poll_groups = None
    if settings.cores > 1:
        from ... import native
        from .pollgroups import PollGroups
        poll_groups = PollGroups(native.module, settings.cores)
    trace = settings.trace == "on"
    if trace:
        from .native_trace import TRACING, printed
        TRACING.set_enabled(True)
        if not printed():
            log.warning("--trace on: the trace lines are logged at debug level only; add -vv to see them")
    return RdmaOptions(remote_invalidate=settings.remote_invalidate, data_path=settings.data_path,
                       poll_mode=settings.poll, poll_groups=poll_groups, poll_spin_us=settings.poll_spin_us,
                       trace=trace)


def close_opts(opts: RdmaOptions) -> None:
    if opts.poll_groups is not None:  # after the listeners: their queues left their groups as they closed
        opts.poll_groups.close()
    if opts.trace:
        from .native_trace import TRACING
        TRACING.set_enabled(False)


def dump_opts(opts: RdmaOptions) -> dict:
    return {"remote_invalidate": opts.remote_invalidate, "data_path": opts.data_path, "poll": opts.poll_mode,
            "poll_spin_us": opts.poll_spin_us, "trace": opts.trace,
            "poll_groups": opts.poll_groups.status() if opts.poll_groups is not None else []}


def figures() -> dict:
    """Native queues closed while their backend still held commands (docs/native.md, "Closing a queue")."""
    from .native_queue import closing_queues
    return {"closing_queues": closing_queues()}


def _loop(handler):
    from ..eventloop import EventLoop
    return EventLoop(handler)


def _listen(loop, port, handler, options: ListenOptions):
    from .cm import RdmaListener
    opts = options.transport if options.transport is not None else RdmaOptions()
    return RdmaListener(loop, port.traddr, port.trsvcid, handler=handler, port_id=port.portid,
                        max_transfer=options.max_transfer, limits=options.limits,
                        remote_invalidate=opts.remote_invalidate, data_path=opts.data_path,
                        poll_mode=opts.poll_mode, poll_groups=opts.poll_groups, poll_spin_us=opts.poll_spin_us)


def _require():
    from .verbs import require_pyverbs
    require_pyverbs()


RDMA = TransportOps(
    trtype="rdma", description="NVMe/RDMA on pyverbs (RoCE, iWARP, InfiniBand): one RC QP per NVMe queue",
    sgls=keyed_or_in_capsule_sgls, map_sgl=map_keyed_or_in_capsule, check_request=check_cm_request,
    reject_status=reject_status, event_loop=_loop, listen=_listen, require=_require, opts_init=opts_init,
    dump_opts=dump_opts, close_opts=close_opts, figures=figures, label="RDMA (RoCE)")
