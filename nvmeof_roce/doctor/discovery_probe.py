"""The doctor's live discovery probe: our userspace initiator fetches the target's discovery log.

Apart from the checks so that `context.py` (which defaults to it) and `checks/nvme.py` (which reads its
results) do not import each other."""
from __future__ import annotations

from typing import Optional


def discover_with_userspace_initiator(traddr: str, trsvcid: int, timeout: float, hostnqn: Optional[str]) -> list:
    """Connect to the target's discovery controller with our userspace initiator and fetch the
    discovery log.  Raises ImportError when pyverbs is not available."""
    from nvmeof_roce.initiator.discovery import discover
    from nvmeof_roce.transport.rdma import host as rdma_host, verbs as rdma

    if rdma.PYVERBS_ERROR is not None:  # the transport imports without pyverbs and fails on first use
        raise ImportError(f"pyverbs is not available: {rdma.PYVERBS_ERROR}")
    connector = rdma_host.RdmaConnector(traddr, trsvcid=trsvcid, timeout=timeout)
    try:
        return list(discover(connector, hostnqn=hostnqn, timeout=timeout))
    finally:
        connector.close()
