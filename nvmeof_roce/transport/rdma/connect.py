"""What the RDMA transport's connection request carries and how it refuses one: the NVMe-oF CM private data
(docs/protocol.md §1.3, nvme/cm.py), checked as nvmet_rdma_parse_cm_connect_req checks it, and refused with
the CM reject STS.  The engine sees only the neutral part (transport/contracts.py `ConnectRequest`)."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Tuple

from ...nvme import cm
from ..contracts import ConnectRequest, Refusal


def queue_resources(depth: int) -> Tuple[int, int]:
    """(receives, send-queue entries) of a target queue of `depth` commands (HSQSIZE + 1), both data paths, the
    one home of these sizes: a receive per command the host may have outstanding (docs/protocol.md §1.6: HSQSIZE + 1
    posted at all times) and one spare; per command a READ, or a WRITE and a SEND, twice over so that a whole
    queue's responses in one poll leave the send queue at least half free (their SENDs are then signaled
    selectively, not each one), and 8 more for the core's own posts."""
    return depth + 1, 4 * depth + 8


class CmRefusal(enum.Enum):
    """Why the transport itself refuses a connection request (nvme/cm.py REJECT_STATUS, by value)."""

    INVALID_RECFMT = "invalid_recfmt"
    INVALID_HSQSIZE = "invalid_hsqsize"
    INVALID_HRQSIZE = "invalid_hrqsize"


@dataclass(frozen=True)
class RdmaConnectRequest(ConnectRequest):
    """A queue opened by an RDMA CM CONNECT_REQUEST (or the loopback fabric's, which keeps RDMA's rules)."""

    trtype: str = "rdma"
    recfmt: int = 0
    hrqsize: int = 0  # host receive queue size, 1's based
    hsqsize: int = 0  # host send queue size, 0's based: the queue's depth on the transport
    cntlid: int = 0  # controller ID for I/O queues on recent kernels, else 0


def check_cm_request(request: RdmaConnectRequest, max_entries: int) -> Optional[CmRefusal]:
    """What nvmet_rdma_parse_cm_connect_req checks of the private data itself (docs/protocol.md §1.3): the
    format, a receive queue, and a send queue no deeper than the engine allows this queue (`max_entries`: the
    admin queue's depth, or the port's MQES + 1)."""
    if request.recfmt != 0:
        return CmRefusal.INVALID_RECFMT
    if request.hrqsize == 0:
        return CmRefusal.INVALID_HRQSIZE
    if request.hsqsize + 1 > max_entries:
        return CmRefusal.INVALID_HSQSIZE
    return None


def reject_status(refusal) -> int:
    """A refusal, the engine's (`Refusal`) or the transport's (`CmRefusal`), as the CM reject STS."""
    assert isinstance(refusal, (Refusal, CmRefusal)), refusal
    return cm.REJECT_STATUS[refusal.value]
