"""The SGL kinds of the RDMA transport (nvmet_rdma_map_sgl, docs/protocol.md §2.2): keyed descriptors of host
memory the target reads and writes by RDMA, and in-capsule data.  The loopback fabric, which keeps RDMA's
rules, takes the same."""
from __future__ import annotations

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


def map_keyed_or_in_capsule(req) -> int:
    """nvmet_rdma_map_sgl: a keyed descriptor (0x40, or 0x4F asking the response to invalidate the host's key:
    SEND with Invalidate, which saves the host a local invalidation) or in-capsule data (0x01); 0 or the
    NVMe status.  Sets `req.inline_offset` for in-capsule data and `req.invalidate_key` for 0x4F."""
    sgl_type = req.sgl_id >> 4
    subtype = req.sgl_id & 0xF
    if sgl_type == TYPE_KEYED_DATA_BLOCK:
        if subtype == SUBTYPE_ADDRESS:
            return 0
        if subtype == SUBTYPE_INVALIDATE_KEY:
            if req.sgl_len:
                req.invalidate_key = req.sgl_key
            return 0
        return S.INVALID_FIELD | S.DNR
    if sgl_type == TYPE_DATA_BLOCK:
        if subtype != SUBTYPE_OFFSET:
            return S.INVALID_FIELD | S.DNR
        if not is_write_direction(req.opc, req.fctype):
            return S.INVALID_FIELD | S.DNR
        end = req.sgl_addr + req.sgl_len
        if end > req.queue.in_capsule_size:
            return S.SGL_INVALID_OFFSET | S.DNR
        if SQE_SIZE + end > len(req.capsule):
            return S.SGL_INVALID_DATA | S.DNR  # the descriptor promises more than the capsule carried
        req.inline_offset = req.sgl_addr
        return 0
    return S.SGL_INVALID_TYPE | S.DNR
