"""The 64-byte submission queue entry and the 16-byte completion (docs/protocol.md §2.1, §2.4).

`SQE_STRUCT` / `CQE_STRUCT` are precompiled for hot paths that unpack straight
from a receive buffer; `SQE` / `CQE` are the readable classes built on them.
Typed command classes (fabrics.py, admin.py, nvm.py) convert to and from `SQE`.
"""
from __future__ import annotations

import struct

from .sgl import SglDescriptor
from .status import from_wire, to_wire

SQE_SIZE = 64
CQE_SIZE = 16

# opc, flags, cid, nsid, cdw2, cdw3, mptr, sgl addr, sgl word (bytes 32..39), cdw10..cdw15
SQE_STRUCT = struct.Struct("<BBHIIIQQQ6I")
# dw0, dw1, sqhd, sqid, cid, status (wire form: code << 1 | phase)
CQE_STRUCT = struct.Struct("<IIHHHH")
assert SQE_STRUCT.size == SQE_SIZE and CQE_STRUCT.size == CQE_SIZE

# FLAGS byte: bits 1:0 FUSE, bits 7:6 PSDT
FLAGS_FUSE_MASK = 0x03
FLAGS_PSDT_MASK = 0xC0
PSDT_PRP = 0x00
PSDT_SGL_MPTR_CONTIG = 0x40  # what the Linux host sends on every RDMA command
PSDT_SGL_MPTR_SGL = 0x80
FLAGS_SGL = PSDT_SGL_MPTR_CONTIG

NSID_ALL = 0xFFFFFFFF  # broadcast: every namespace, or the controller itself
NSID_MAX = 0xFFFFFFFE  # the highest NSID a namespace may have

# Admin opcodes
ADMIN_DELETE_SQ = 0x00
ADMIN_CREATE_SQ = 0x01
ADMIN_GET_LOG_PAGE = 0x02
ADMIN_DELETE_CQ = 0x04
ADMIN_CREATE_CQ = 0x05
ADMIN_IDENTIFY = 0x06
ADMIN_ABORT = 0x08
ADMIN_SET_FEATURES = 0x09
ADMIN_GET_FEATURES = 0x0A
ADMIN_ASYNC_EVENT = 0x0C
ADMIN_NS_MGMT = 0x0D
ADMIN_KEEP_ALIVE = 0x18
ADMIN_FABRICS = 0x7F

# NVM (I/O) opcodes
NVM_FLUSH = 0x00
NVM_WRITE = 0x01
NVM_READ = 0x02
NVM_WRITE_ZEROES = 0x08
NVM_DSM = 0x09
NVM_RESV_REGISTER = 0x0D
NVM_RESV_REPORT = 0x0E
NVM_RESV_ACQUIRE = 0x11
NVM_RESV_RELEASE = 0x15

FABRICS_OPCODE = 0x7F


def is_write_direction(opcode: int, fctype: int = 0) -> bool:
    """Host-to-controller data: opcode bit 0 (for fabrics commands, FCTYPE bit 0)."""
    if opcode == FABRICS_OPCODE:
        return bool(fctype & 1)
    return bool(opcode & 1)


class SQE:
    """A submission queue entry.  `sgl` is the DPTR descriptor."""

    __slots__ = ("opc", "flags", "cid", "nsid", "cdw2", "cdw3", "mptr", "sgl",
                 "cdw10", "cdw11", "cdw12", "cdw13", "cdw14", "cdw15")

    def __init__(self, opc: int = 0, flags: int = FLAGS_SGL, cid: int = 0, nsid: int = 0,
                 cdw2: int = 0, cdw3: int = 0, mptr: int = 0, sgl: SglDescriptor = None,
                 cdw10: int = 0, cdw11: int = 0, cdw12: int = 0, cdw13: int = 0, cdw14: int = 0, cdw15: int = 0):
        self.opc = opc
        self.flags = flags
        self.cid = cid
        self.nsid = nsid
        self.cdw2 = cdw2
        self.cdw3 = cdw3
        self.mptr = mptr
        self.sgl = sgl if sgl is not None else SglDescriptor.no_data()
        self.cdw10 = cdw10
        self.cdw11 = cdw11
        self.cdw12 = cdw12
        self.cdw13 = cdw13
        self.cdw14 = cdw14
        self.cdw15 = cdw15

    @property
    def fctype(self) -> int:
        """Fabrics command type: byte 4, which overlays the low byte of NSID."""
        return self.nsid & 0xFF

    def pack(self) -> bytes:
        return SQE_STRUCT.pack(self.opc, self.flags, self.cid, self.nsid, self.cdw2, self.cdw3, self.mptr,
                               self.sgl.addr, self.sgl.word, self.cdw10, self.cdw11, self.cdw12,
                               self.cdw13, self.cdw14, self.cdw15)

    @classmethod
    def unpack(cls, buf, offset: int = 0) -> "SQE":
        (opc, flags, cid, nsid, cdw2, cdw3, mptr, sgl_addr, sgl_word,
         cdw10, cdw11, cdw12, cdw13, cdw14, cdw15) = SQE_STRUCT.unpack_from(buf, offset)
        return cls(opc, flags, cid, nsid, cdw2, cdw3, mptr, SglDescriptor.from_words(sgl_addr, sgl_word),
                   cdw10, cdw11, cdw12, cdw13, cdw14, cdw15)

    def __eq__(self, other):
        if not isinstance(other, SQE):
            return NotImplemented
        return self.pack() == other.pack()

    def __repr__(self) -> str:
        return (f"SQE(opc={self.opc:#04x}, flags={self.flags:#04x}, cid={self.cid}, nsid={self.nsid:#x}, "
                f"sgl={self.sgl!r}, cdw10={self.cdw10:#x}, cdw11={self.cdw11:#x}, cdw12={self.cdw12:#x})")


class CQE:
    """A completion queue entry.  `status` is the status code (wire value >> 1), see status.py."""

    __slots__ = ("result", "dw1", "sqhd", "sqid", "cid", "status", "phase")

    def __init__(self, result: int = 0, dw1: int = 0, sqhd: int = 0, sqid: int = 0, cid: int = 0,
                 status: int = 0, phase: int = 0):
        self.result = result
        self.dw1 = dw1
        self.sqhd = sqhd
        self.sqid = sqid
        self.cid = cid
        self.status = status
        self.phase = phase

    @property
    def result64(self) -> int:
        """DW0 and DW1 as one little-endian 64-bit value (8-byte Property Get)."""
        return self.result | (self.dw1 << 32)

    def pack(self) -> bytes:
        return CQE_STRUCT.pack(self.result, self.dw1, self.sqhd, self.sqid, self.cid,
                               to_wire(self.status) | (self.phase & 1))

    @classmethod
    def unpack(cls, buf, offset: int = 0) -> "CQE":
        dw0, dw1, sqhd, sqid, cid, wire = CQE_STRUCT.unpack_from(buf, offset)
        return cls(dw0, dw1, sqhd, sqid, cid, from_wire(wire), wire & 1)

    def __eq__(self, other):
        if not isinstance(other, CQE):
            return NotImplemented
        return self.pack() == other.pack()

    def __repr__(self) -> str:
        return (f"CQE(result={self.result:#x}, dw1={self.dw1:#x}, sqhd={self.sqhd}, sqid={self.sqid}, "
                f"cid={self.cid}, status={self.status:#x})")


class Command:
    """Base of the typed commands (dataclasses): each defines to_sqe() and from_sqe()."""

    def to_sqe(self) -> SQE:
        raise NotImplementedError

    @classmethod
    def from_sqe(cls, sqe: SQE):
        raise NotImplementedError

    def pack(self) -> bytes:
        return self.to_sqe().pack()

    @classmethod
    def unpack(cls, buf, offset: int = 0):
        return cls.from_sqe(SQE.unpack(buf, offset))
