"""Discovery: connect to the discovery controller and read its log page (LID 0x70).

Like libnvme 1.16 (docs/protocol.md §5.8): read the 1024-byte header, then the entries
from LPO 1024 in 4096-byte chunks, then the header again; if GENCTR moved in
between, start over.
"""
from __future__ import annotations

import logging
from typing import List, Optional

from ..errors import NvmeofError
from ..nvme import admin as A
from ..nvme.fabrics import DISCOVERY_NQN
from ..nvme.log import DISC_ENTRY_SIZE, DISC_HEADER_SIZE, DiscoveryLogEntry, DiscoveryLogHeader
from ..transport.contracts import Connector
from .controller import DEFAULT_TIMEOUT, Controller

log = logging.getLogger(__name__)

DiscoveryEntry = DiscoveryLogEntry
CHUNK = 4096
MAX_RETRIES = 10


def read_discovery_log(ctrl: Controller) -> List[DiscoveryEntry]:
    """The discovery log of a connected discovery controller, consistent across one GENCTR."""
    for _ in range(MAX_RETRIES):
        header = DiscoveryLogHeader.unpack(ctrl.get_log_page(A.LID_DISCOVERY, DISC_HEADER_SIZE, nsid=0, rae=True))
        total = header.numrec * DISC_ENTRY_SIZE
        raw = bytearray()
        while len(raw) < total:
            length = min(CHUNK, total - len(raw))
            raw += ctrl.get_log_page(A.LID_DISCOVERY, length, nsid=0, offset=DISC_HEADER_SIZE + len(raw), rae=True)
        again = DiscoveryLogHeader.unpack(ctrl.get_log_page(A.LID_DISCOVERY, DISC_HEADER_SIZE, nsid=0))
        if again.genctr == header.genctr:
            return [DiscoveryLogEntry.unpack(raw, i * DISC_ENTRY_SIZE) for i in range(header.numrec)]
        log.info("discovery log changed while reading it (genctr %d -> %d), reading again",
                 header.genctr, again.genctr)
    raise NvmeofError(f"the discovery log kept changing over {MAX_RETRIES} reads", "try again later")


def discover(connector: Connector, hostnqn: Optional[str] = None, hostid=None,
             timeout: float = DEFAULT_TIMEOUT) -> List[DiscoveryEntry]:
    """Connect to the discovery controller behind `connector`, return its entries, shut it down."""
    ctrl = Controller.connect(connector, DISCOVERY_NQN, hostnqn=hostnqn, hostid=hostid, num_io_queues=0,
                              kato_ms=0, timeout=timeout)
    try:
        return read_discovery_log(ctrl)
    finally:
        ctrl.close()
