"""The SGL kinds of the RDMA transport (nvmet_rdma_map_sgl, docs/protocol.md §2.2): keyed descriptors of host
memory the target reads and writes by RDMA, and in-capsule data.  The loopback fabric, which keeps RDMA's
rules, takes the same."""
from __future__ import annotations

from typing import Optional, Tuple

from ...nvme import identify as I
from ...nvme import status as S
from ...nvme.command import SQE_SIZE, is_write_direction
from ...nvme.sgl import SUBTYPE_ADDRESS, SUBTYPE_INVALIDATE_KEY, SUBTYPE_OFFSET, TYPE_DATA_BLOCK, \
    TYPE_KEYED_DATA_BLOCK

INVALIDATE_KEYED_ID = (TYPE_KEYED_DATA_BLOCK << 4) | SUBTYPE_INVALIDATE_KEY  # 0x4F


def keyed_or_in_capsule_sgls(in_capsule_size: int) -> int:
    """Identify's SGLS: keyed descriptors, and offset descriptors (in-capsule data) where the port takes any."""
    sgls = I.SGLS_SUPPORTED | I.SGLS_KEYED
    if in_capsule_size:
        sgls |= I.SGLS_OFFSET
    return sgls


# The RDMA transport's data descriptor of a command (`req.desc`, which the engine hands back to read_host and
# complete without reading it): the keyed SGL's (host address, key, the key the response invalidates or None).  A
# plain tuple, made once per command.  The loopback fabric, which keeps RDMA's SGL kinds, takes the same.
KeyedData = Tuple[int, int, Optional[int]]


def keyed_data(addr: int, key: int, invalidate: Optional[int] = None) -> KeyedData:
    """A keyed descriptor's data descriptor (for callers outside map_sgl: tests, benchmarks)."""
    return (addr, key, invalidate)


NO_DATA: KeyedData = (0, 0, None)  # what complete() takes for a command with no descriptor: nothing to invalidate


def map_keyed_or_in_capsule(req) -> int:
    """nvmet_rdma_map_sgl: a keyed descriptor (0x40, or 0x4F asking the response to invalidate the host's key:
    SEND with Invalidate, which saves the host a local invalidation) or in-capsule data (0x01); 0 or the
    NVMe status.  Sets `req.transfer_len`, and `req.desc` (a `KeyedData`) for a keyed descriptor or
    `req.inline_offset` for in-capsule data."""
    word = req.dptr2
    sgl_id = word >> 56
    sgl_type = sgl_id >> 4
    if sgl_type == TYPE_KEYED_DATA_BLOCK:
        subtype = sgl_id & 0xF
        if subtype == SUBTYPE_ADDRESS:
            req.transfer_len = word & 0xFFFFFF
            req.desc = (req.dptr1, (word >> 24) & 0xFFFFFFFF, None)
            return 0
        if subtype == SUBTYPE_INVALIDATE_KEY:
            length = req.transfer_len = word & 0xFFFFFF
            key = (word >> 24) & 0xFFFFFFFF
            req.desc = (req.dptr1, key, key if length else None)
            return 0
        return S.INVALID_FIELD | S.DNR
    if sgl_type == TYPE_DATA_BLOCK:
        if sgl_id & 0xF != SUBTYPE_OFFSET:
            return S.INVALID_FIELD | S.DNR
        if not is_write_direction(req.opc, req.fctype):
            return S.INVALID_FIELD | S.DNR
        offset = req.dptr1
        length = word & 0xFFFFFFFF
        end = offset + length
        if end > req.queue.in_capsule_size:
            return S.SGL_INVALID_OFFSET | S.DNR
        if SQE_SIZE + end > len(req.capsule):
            return S.SGL_INVALID_DATA | S.DNR  # the descriptor promises more than the capsule carried
        req.transfer_len = length
        req.inline_offset = offset
        return 0
    return S.SGL_INVALID_TYPE | S.DNR
