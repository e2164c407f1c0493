"""NVM I/O commands (docs/protocol.md §6): Read, Write, Flush, Write Zeroes, Dataset Management."""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import List

from .command import FLAGS_SGL, NVM_DSM, NVM_FLUSH, NVM_READ, NVM_WRITE, NVM_WRITE_ZEROES, SQE, Command
from .sgl import SglDescriptor

# Read/Write control (CDW12 bits 31:16, i.e. SQE bytes 50..51)
CONTROL_LR = 1 << 15
CONTROL_FUA = 1 << 14
CONTROL_PRINFO_MASK = 0xF << 10
CONTROL_DEAC = 1 << 9  # Write Zeroes: deallocate

# DSM attributes (CDW11)
DSM_IDR = 1 << 0
DSM_IDW = 1 << 1
DSM_AD = 1 << 2
DSM_MAX_RANGES = 256
DSM_RANGE_SIZE = 16


@dataclass
class ReadWriteCommand(Command):
    """Read (0x02) / Write (0x01) / Write Zeroes (0x08): NSID 4, SLBA 40 (8), NLB 48 (2, 0's based),
    CONTROL 50 (2), DSMGMT 52, REFTAG 56, APPTAG 60, APPMASK 62."""

    opcode: int = NVM_READ
    cid: int = 0
    nsid: int = 1
    slba: int = 0
    nlb: int = 0
    control: int = 0
    dsmgmt: int = 0
    reftag: int = 0
    apptag: int = 0
    appmask: int = 0
    sgl: SglDescriptor = field(default_factory=SglDescriptor.no_data)
    flags: int = FLAGS_SGL

    @property
    def blocks(self) -> int:
        return self.nlb + 1

    def to_sqe(self) -> SQE:
        return SQE(opc=self.opcode, flags=self.flags, cid=self.cid, nsid=self.nsid, sgl=self.sgl,
                   cdw10=self.slba & 0xFFFFFFFF, cdw11=(self.slba >> 32) & 0xFFFFFFFF,
                   cdw12=(self.nlb & 0xFFFF) | ((self.control & 0xFFFF) << 16), cdw13=self.dsmgmt,
                   cdw14=self.reftag, cdw15=(self.apptag & 0xFFFF) | ((self.appmask & 0xFFFF) << 16))

    @classmethod
    def from_sqe(cls, sqe: SQE) -> "ReadWriteCommand":
        return cls(opcode=sqe.opc, cid=sqe.cid, nsid=sqe.nsid, slba=sqe.cdw10 | (sqe.cdw11 << 32),
                   nlb=sqe.cdw12 & 0xFFFF, control=sqe.cdw12 >> 16, dsmgmt=sqe.cdw13, reftag=sqe.cdw14,
                   apptag=sqe.cdw15 & 0xFFFF, appmask=sqe.cdw15 >> 16, sgl=sqe.sgl, flags=sqe.flags)


def read_command(cid: int, nsid: int, slba: int, nlb: int, sgl: SglDescriptor, control: int = 0):
    return ReadWriteCommand(NVM_READ, cid, nsid, slba, nlb, control, sgl=sgl)


def write_command(cid: int, nsid: int, slba: int, nlb: int, sgl: SglDescriptor, control: int = 0):
    return ReadWriteCommand(NVM_WRITE, cid, nsid, slba, nlb, control, sgl=sgl)


def write_zeroes_command(cid: int, nsid: int, slba: int, nlb: int, control: int = 0):
    return ReadWriteCommand(NVM_WRITE_ZEROES, cid, nsid, slba, nlb, control)


@dataclass
class FlushCommand(Command):
    """Flush (0x00): NSID only."""

    cid: int = 0
    nsid: int = 1
    flags: int = FLAGS_SGL

    def to_sqe(self) -> SQE:
        return SQE(opc=NVM_FLUSH, flags=self.flags, cid=self.cid, nsid=self.nsid)

    @classmethod
    def from_sqe(cls, sqe: SQE) -> "FlushCommand":
        return cls(cid=sqe.cid, nsid=sqe.nsid, flags=sqe.flags)


@dataclass
class DsmCommand(Command):
    """Dataset Management (0x09): NR at 40 (CDW10 7:0, 0's based range count), attributes CDW11 (AD bit 2)."""

    cid: int = 0
    nsid: int = 1
    nr: int = 0
    attributes: int = DSM_AD
    sgl: SglDescriptor = field(default_factory=SglDescriptor.no_data)
    flags: int = FLAGS_SGL

    @property
    def ranges_length(self) -> int:
        return (self.nr + 1) * DSM_RANGE_SIZE

    def to_sqe(self) -> SQE:
        return SQE(opc=NVM_DSM, flags=self.flags, cid=self.cid, nsid=self.nsid, sgl=self.sgl,
                   cdw10=self.nr & 0xFF, cdw11=self.attributes)

    @classmethod
    def from_sqe(cls, sqe: SQE) -> "DsmCommand":
        return cls(cid=sqe.cid, nsid=sqe.nsid, nr=sqe.cdw10 & 0xFF, attributes=sqe.cdw11, sgl=sqe.sgl,
                   flags=sqe.flags)


DSM_RANGE_STRUCT = struct.Struct("<IIQ")


@dataclass
class DsmRange:
    """16 bytes: context attributes 0 (4), NLB 4 (4, 1's based block count), SLBA 8 (8)."""

    slba: int = 0
    nlb: int = 0
    attributes: int = 0

    def pack(self) -> bytes:
        return DSM_RANGE_STRUCT.pack(self.attributes, self.nlb, self.slba)

    @classmethod
    def unpack(cls, buf, offset: int = 0) -> "DsmRange":
        attributes, nlb, slba = DSM_RANGE_STRUCT.unpack_from(buf, offset)
        return cls(slba, nlb, attributes)


def pack_dsm_ranges(ranges: List[DsmRange]) -> bytes:
    return b"".join(r.pack() for r in ranges)


def unpack_dsm_ranges(buf, count: int) -> List[DsmRange]:
    return [DsmRange.unpack(buf, i * DSM_RANGE_SIZE) for i in range(count)]
