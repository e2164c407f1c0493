"""Fabrics commands (opcode 0x7F) and controller properties (docs/protocol.md §4).

FCTYPE sits in SQE byte 4, which overlays the low byte of the NSID field.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

from .command import FABRICS_OPCODE, FLAGS_SGL, SQE, Command
from .sgl import SglDescriptor

ADMIN_QUEUE_DEPTH = 32  # NVME_AQ_DEPTH: the admin queue is always 32 entries (SQSIZE 31)

FCTYPE_PROPERTY_SET = 0x00
FCTYPE_CONNECT = 0x01
FCTYPE_PROPERTY_GET = 0x04
FCTYPE_AUTH_SEND = 0x05
FCTYPE_AUTH_RECV = 0x06
FCTYPE_DISCONNECT = 0x08

CONNECT_DATA_SIZE = 1024
DYNAMIC_CNTLID = 0xFFFF  # admin Connect asks the target to allocate a controller ID
MIN_CNTLID = 1
MAX_CNTLID = 0xFFEF

DISCOVERY_NQN = "nqn.2014-08.org.nvmexpress.discovery"
NQN_FIELD_SIZE = 256
NQN_MAX_LENGTH = 223

# Connect CATTR bit 2: the host disables SQ flow control (SQHD reported as 0xFFFF)
CATTR_DISABLE_SQFLOW = 0x04

# Connect status result DW0 for Invalid Parameters: byte offset, bit 16 = in the data
IATTR_IN_DATA = 1 << 16

# Offsets used in Invalid Parameters results
CONNECT_SQE_OFF_QID = 42
CONNECT_SQE_OFF_SQSIZE = 44
CONNECT_SQE_OFF_CATTR = 46
CONNECT_SQE_OFF_KATO = 48
CONNECT_DATA_OFF_HOSTID = 0
CONNECT_DATA_OFF_CNTLID = 16
CONNECT_DATA_OFF_SUBNQN = 256
CONNECT_DATA_OFF_HOSTNQN = 512


def iattr_sqe(offset: int) -> int:
    return offset & 0xFFFF


def iattr_data(offset: int) -> int:
    return IATTR_IN_DATA | (offset & 0xFFFF)


# -- properties (§4.3)
PROP_CAP = 0x00
PROP_VS = 0x08
PROP_CC = 0x14
PROP_CSTS = 0x1C
PROP_NSSR = 0x20
PROP_CRTO = 0x68

PROP_SIZE_4 = 0
PROP_SIZE_8 = 1

CC_EN = 1 << 0
CC_CSS_SHIFT = 4
CC_CSS_MASK = 0x7 << 4
CC_MPS_SHIFT = 7
CC_MPS_MASK = 0xF << 7
CC_AMS_SHIFT = 11
CC_AMS_MASK = 0x7 << 11
CC_SHN_SHIFT = 14
CC_SHN_MASK = 0x3 << 14
CC_SHN_NORMAL = 1 << 14
CC_SHN_ABRUPT = 2 << 14
CC_IOSQES_SHIFT = 16
CC_IOSQES_MASK = 0xF << 16
CC_IOCQES_SHIFT = 20
CC_IOCQES_MASK = 0xF << 20
CC_CSS_NVM = 0
CC_CSS_CSI = 6
# What the Linux host writes: IOSQES 6 (64 B), IOCQES 4 (16 B), NVM command set
CC_DEFAULT = (6 << CC_IOSQES_SHIFT) | (4 << CC_IOCQES_SHIFT)  # 0x00460000

CSTS_RDY = 1 << 0
CSTS_CFS = 1 << 1
CSTS_SHST_MASK = 0x3 << 2
CSTS_SHST_NORMAL = 0 << 2
CSTS_SHST_OCCUR = 1 << 2
CSTS_SHST_COMPLETE = 2 << 2
CSTS_NSSRO = 1 << 4
CSTS_PP = 1 << 5


def cap_mqes(cap: int) -> int:
    return cap & 0xFFFF


def cap_timeout_ms(cap: int) -> int:
    """CAP.TO: worst-case time to CSTS.RDY, in 500 ms units."""
    return ((cap >> 24) & 0xFF) * 500


def make_cap(mqes: int, timeout_units: int = 15) -> int:
    """CAP as recommended for the target: MQES, TO, CSS bit 37 (NVM command set) only."""
    return (mqes & 0xFFFF) | ((timeout_units & 0xFF) << 24) | (1 << 37)


def make_version(major: int, minor: int, tertiary: int = 0) -> int:
    return (major << 16) | (minor << 8) | tertiary


def encode_nqn(nqn: str) -> bytes:
    raw = nqn.encode("ascii")
    if len(raw) >= NQN_FIELD_SIZE:
        raise ValueError(f"NQN longer than {NQN_FIELD_SIZE - 1} bytes: {nqn!r}")
    return raw.ljust(NQN_FIELD_SIZE, b"\0")


def decode_nqn(raw) -> str:
    """A NUL-terminated field as text; bytes that are not ASCII are replaced (never raises)."""
    raw = bytes(raw)
    end = raw.find(b"\0")
    if end >= 0:
        raw = raw[:end]
    return raw.decode("ascii", errors="replace")


def nqn_is_terminated(raw) -> bool:
    return b"\0" in bytes(raw)


def _fabrics_sqe(cid: int, fctype: int, sgl: SglDescriptor = None, flags: int = FLAGS_SGL, **cdws) -> SQE:
    return SQE(opc=FABRICS_OPCODE, flags=flags, cid=cid, nsid=fctype & 0xFF, sgl=sgl, **cdws)


@dataclass
class ConnectCommand(Command):
    """Connect SQE (§4.2): RECFMT 40, QID 42, SQSIZE 44 (0's based), CATTR 46, KATO 48 (ms)."""

    cid: int = 0
    qid: int = 0
    sqsize: int = 31
    kato: int = 0
    cattr: int = 0
    recfmt: int = 0
    sgl: SglDescriptor = field(default_factory=SglDescriptor.no_data)
    flags: int = FLAGS_SGL

    def to_sqe(self) -> SQE:
        return _fabrics_sqe(self.cid, FCTYPE_CONNECT, self.sgl, self.flags,
                            cdw10=self.recfmt | (self.qid << 16),
                            cdw11=self.sqsize | (self.cattr << 16),
                            cdw12=self.kato)

    @classmethod
    def from_sqe(cls, sqe: SQE) -> "ConnectCommand":
        return cls(cid=sqe.cid, qid=sqe.cdw10 >> 16, sqsize=sqe.cdw11 & 0xFFFF, kato=sqe.cdw12,
                   cattr=(sqe.cdw11 >> 16) & 0xFF, recfmt=sqe.cdw10 & 0xFFFF, sgl=sqe.sgl, flags=sqe.flags)


_CONNECT_DATA = struct.Struct("<16sH238x256s256s256x")
assert _CONNECT_DATA.size == CONNECT_DATA_SIZE


@dataclass
class ConnectData:
    """The 1024-byte Connect data: HOSTID 0, CNTLID 16, SUBNQN 256, HOSTNQN 512."""

    hostid: bytes = bytes(16)
    cntlid: int = DYNAMIC_CNTLID
    subnqn: str = ""
    hostnqn: str = ""

    def pack(self) -> bytes:
        if len(self.hostid) != 16:
            raise ValueError("HOSTID must be 16 bytes")
        return _CONNECT_DATA.pack(self.hostid, self.cntlid, encode_nqn(self.subnqn), encode_nqn(self.hostnqn))

    @classmethod
    def unpack(cls, buf, offset: int = 0) -> "ConnectData":
        hostid, cntlid, subnqn, hostnqn = _CONNECT_DATA.unpack_from(buf, offset)
        return cls(hostid, cntlid, decode_nqn(subnqn), decode_nqn(hostnqn))


@dataclass
class PropertyGet(Command):
    """Property Get: ATTRIB 40 (bits 2:0 size: 0 = 4 bytes, 1 = 8 bytes), OFFSET 44."""

    cid: int = 0
    offset: int = 0
    size8: bool = False
    flags: int = FLAGS_SGL

    def to_sqe(self) -> SQE:
        return _fabrics_sqe(self.cid, FCTYPE_PROPERTY_GET, None, self.flags,
                            cdw10=PROP_SIZE_8 if self.size8 else PROP_SIZE_4, cdw11=self.offset)

    @classmethod
    def from_sqe(cls, sqe: SQE) -> "PropertyGet":
        return cls(cid=sqe.cid, offset=sqe.cdw11, size8=bool(sqe.cdw10 & 0x7), flags=sqe.flags)


@dataclass
class PropertySet(Command):
    """Property Set: ATTRIB 40, OFFSET 44, VALUE 48 (8 bytes)."""

    cid: int = 0
    offset: int = 0
    value: int = 0
    size8: bool = False
    flags: int = FLAGS_SGL

    def to_sqe(self) -> SQE:
        return _fabrics_sqe(self.cid, FCTYPE_PROPERTY_SET, None, self.flags,
                            cdw10=PROP_SIZE_8 if self.size8 else PROP_SIZE_4, cdw11=self.offset,
                            cdw12=self.value & 0xFFFFFFFF, cdw13=(self.value >> 32) & 0xFFFFFFFF)

    @classmethod
    def from_sqe(cls, sqe: SQE) -> "PropertySet":
        return cls(cid=sqe.cid, offset=sqe.cdw11, value=sqe.cdw12 | (sqe.cdw13 << 32),
                   size8=bool(sqe.cdw10 & 0x7), flags=sqe.flags)


@dataclass
class DisconnectCommand(Command):
    """Disconnect (FCTYPE 0x08): RECFMT at 40.  Linux never sends it; I/O queues only."""

    cid: int = 0
    recfmt: int = 0
    flags: int = FLAGS_SGL

    def to_sqe(self) -> SQE:
        return _fabrics_sqe(self.cid, FCTYPE_DISCONNECT, None, self.flags, cdw10=self.recfmt)

    @classmethod
    def from_sqe(cls, sqe: SQE) -> "DisconnectCommand":
        return cls(cid=sqe.cid, recfmt=sqe.cdw10 & 0xFFFF, flags=sqe.flags)
