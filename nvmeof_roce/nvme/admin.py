"""Admin command SQEs (docs/protocol.md §5): Identify, Get Log Page, Set/Get Features, Keep Alive, AER."""
from __future__ import annotations

from dataclasses import dataclass, field

from .command import (ADMIN_ASYNC_EVENT, ADMIN_GET_FEATURES, ADMIN_GET_LOG_PAGE, ADMIN_IDENTIFY,
                      ADMIN_KEEP_ALIVE, ADMIN_SET_FEATURES, FLAGS_SGL, SQE, Command)
from .sgl import SglDescriptor

# Identify CNS values
CNS_NAMESPACE = 0x00
CNS_CONTROLLER = 0x01
CNS_ACTIVE_NS_LIST = 0x02
CNS_NS_DESC_LIST = 0x03
CNS_CS_CONTROLLER = 0x06
CNS_CS_INDEP_NAMESPACE = 0x08
IDENTIFY_DATA_SIZE = 4096

# Feature identifiers
FEAT_ARBITRATION = 0x01
FEAT_POWER_MGMT = 0x02
FEAT_VOLATILE_WC = 0x06
FEAT_NUM_QUEUES = 0x07
FEAT_ASYNC_EVENT = 0x0B
FEAT_KATO = 0x0F
FEAT_HOST_ID = 0x81
FEAT_RESV_MASK = 0x82  # Reservation Notification Mask (namespace specific)
FEAT_RESV_PERSIST = 0x83  # Reservation Persistence: PTPL (namespace specific)

# Log page identifiers
LID_ERROR = 0x01
LID_SMART = 0x02
LID_FW_SLOT = 0x03
LID_CHANGED_NS = 0x04
LID_CMD_EFFECTS = 0x05
LID_ANA = 0x0C
LID_DISCOVERY = 0x70
LID_RESERVATION = 0x80  # Reservation Notification

# Asynchronous event completion DW0: type 2:0, info 15:8, log page 23:16
AER_TYPE_ERROR = 0
AER_TYPE_SMART = 1
AER_TYPE_NOTICE = 2
AER_TYPE_IO_CMD_SET = 6  # I/O command set specific: info 0, a Reservation Notification log page is available
AER_RESV_LOG_AVAILABLE = 0x00
AER_NOTICE_NS_CHANGED = 0x00
AER_NOTICE_FW_ACTIVATION = 0x01
AER_NOTICE_ANA = 0x03
AER_NOTICE_DISC_CHANGED = 0xF0

# Async Event Configuration bits (CDW11 of Set Features 0x0B, and OAES)
AEN_CFG_NS_ATTR = 1 << 8
AEN_CFG_FW_ACT = 1 << 9
AEN_CFG_ANA_CHANGE = 1 << 11
AEN_CFG_DISC_CHANGE = 1 << 31


def aer_result(event_type: int, info: int, log_page: int) -> int:
    return (event_type & 0x7) | ((info & 0xFF) << 8) | ((log_page & 0xFF) << 16)


def parse_aer_result(result: int):
    """(type, info, log page) of an AER completion's DW0."""
    return result & 0x7, (result >> 8) & 0xFF, (result >> 16) & 0xFF


@dataclass
class IdentifyCommand(Command):
    """Identify: NSID 4, CNS 40, CNTID 42, CNSSI 44, CSI 47 (byte 3 of CDW11)."""

    cid: int = 0
    cns: int = CNS_CONTROLLER
    nsid: int = 0
    cntid: int = 0
    csi: int = 0
    cnssi: int = 0
    sgl: SglDescriptor = field(default_factory=SglDescriptor.no_data)
    flags: int = FLAGS_SGL

    def to_sqe(self) -> SQE:
        return SQE(opc=ADMIN_IDENTIFY, flags=self.flags, cid=self.cid, nsid=self.nsid, sgl=self.sgl,
                   cdw10=(self.cns & 0xFF) | (self.cntid << 16),
                   cdw11=(self.cnssi & 0xFFFF) | ((self.csi & 0xFF) << 24))

    @classmethod
    def from_sqe(cls, sqe: SQE) -> "IdentifyCommand":
        return cls(cid=sqe.cid, cns=sqe.cdw10 & 0xFF, nsid=sqe.nsid, cntid=sqe.cdw10 >> 16,
                   csi=sqe.cdw11 >> 24, cnssi=sqe.cdw11 & 0xFFFF, sgl=sqe.sgl, flags=sqe.flags)


@dataclass
class GetLogPageCommand(Command):
    """Get Log Page: NSID 4, LID 40, LSP 41 (bits 6:0) + RAE (bit 7), NUMDL 42, NUMDU 44, LSI 46,
    LPO 48 (8 bytes), CSI 59.  `numd` is 0's based: the transfer is (numd + 1) * 4 bytes."""

    cid: int = 0
    lid: int = 0
    numd: int = 0
    nsid: int = 0xFFFFFFFF
    lpo: int = 0
    lsp: int = 0
    rae: bool = False
    lsi: int = 0
    csi: int = 0
    sgl: SglDescriptor = field(default_factory=SglDescriptor.no_data)
    flags: int = FLAGS_SGL

    @property
    def length(self) -> int:
        return (self.numd + 1) * 4

    @staticmethod
    def numd_for(length: int) -> int:
        if length <= 0 or length % 4:
            raise ValueError(f"log page length must be a positive multiple of 4, got {length}")
        return length // 4 - 1

    def to_sqe(self) -> SQE:
        return SQE(opc=ADMIN_GET_LOG_PAGE, flags=self.flags, cid=self.cid, nsid=self.nsid, sgl=self.sgl,
                   cdw10=(self.lid & 0xFF) | ((self.lsp & 0x7F) << 8) | (int(self.rae) << 15)
                   | ((self.numd & 0xFFFF) << 16),
                   cdw11=((self.numd >> 16) & 0xFFFF) | ((self.lsi & 0xFFFF) << 16),
                   cdw12=self.lpo & 0xFFFFFFFF, cdw13=(self.lpo >> 32) & 0xFFFFFFFF,
                   cdw14=(self.csi & 0xFF) << 24)

    @classmethod
    def from_sqe(cls, sqe: SQE) -> "GetLogPageCommand":
        return cls.from_dwords(sqe.cdw10, sqe.cdw11, sqe.cdw12, sqe.cdw13, sqe.cdw14,
                               cid=sqe.cid, nsid=sqe.nsid, sgl=sqe.sgl, flags=sqe.flags)

    @classmethod
    def from_dwords(cls, cdw10: int, cdw11: int, cdw12: int, cdw13: int, cdw14: int,
                    **header) -> "GetLogPageCommand":
        """The command from its dwords 10-14 (the target decodes those without building an SQE);
        `header` gives the other fields (cid, nsid, sgl, flags)."""
        return cls(lid=cdw10 & 0xFF, lsp=(cdw10 >> 8) & 0x7F, rae=bool(cdw10 & (1 << 15)),
                   numd=(cdw10 >> 16) | ((cdw11 & 0xFFFF) << 16), lsi=cdw11 >> 16,
                   lpo=cdw12 | (cdw13 << 32), csi=cdw14 >> 24, **header)


@dataclass
class SetFeaturesCommand(Command):
    """Set Features: FID 40 (CDW10 7:0), SV CDW10 bit 31, value CDW11."""

    cid: int = 0
    fid: int = 0
    value: int = 0
    save: bool = False
    nsid: int = 0
    cdw12: int = 0
    sgl: SglDescriptor = field(default_factory=SglDescriptor.no_data)
    flags: int = FLAGS_SGL

    def to_sqe(self) -> SQE:
        return SQE(opc=ADMIN_SET_FEATURES, flags=self.flags, cid=self.cid, nsid=self.nsid, sgl=self.sgl,
                   cdw10=(self.fid & 0xFF) | (int(self.save) << 31), cdw11=self.value, cdw12=self.cdw12)

    @classmethod
    def from_sqe(cls, sqe: SQE) -> "SetFeaturesCommand":
        return cls(cid=sqe.cid, fid=sqe.cdw10 & 0xFF, value=sqe.cdw11, save=bool(sqe.cdw10 >> 31),
                   nsid=sqe.nsid, cdw12=sqe.cdw12, sgl=sqe.sgl, flags=sqe.flags)


@dataclass
class GetFeaturesCommand(Command):
    """Get Features: FID 40 (CDW10 7:0), SEL CDW10 bits 10:8, CDW11 feature specific."""

    cid: int = 0
    fid: int = 0
    select: int = 0
    cdw11: int = 0
    nsid: int = 0
    sgl: SglDescriptor = field(default_factory=SglDescriptor.no_data)
    flags: int = FLAGS_SGL

    def to_sqe(self) -> SQE:
        return SQE(opc=ADMIN_GET_FEATURES, flags=self.flags, cid=self.cid, nsid=self.nsid, sgl=self.sgl,
                   cdw10=(self.fid & 0xFF) | ((self.select & 0x7) << 8), cdw11=self.cdw11)

    @classmethod
    def from_sqe(cls, sqe: SQE) -> "GetFeaturesCommand":
        return cls(cid=sqe.cid, fid=sqe.cdw10 & 0xFF, select=(sqe.cdw10 >> 8) & 0x7, cdw11=sqe.cdw11,
                   nsid=sqe.nsid, sgl=sqe.sgl, flags=sqe.flags)


@dataclass
class KeepAliveCommand(Command):
    """Keep Alive (0x18): no fields, no data."""

    cid: int = 0
    flags: int = FLAGS_SGL

    def to_sqe(self) -> SQE:
        return SQE(opc=ADMIN_KEEP_ALIVE, flags=self.flags, cid=self.cid)

    @classmethod
    def from_sqe(cls, sqe: SQE) -> "KeepAliveCommand":
        return cls(cid=sqe.cid, flags=sqe.flags)


@dataclass
class AsyncEventRequestCommand(Command):
    """Asynchronous Event Request (0x0C): held by the controller until an event."""

    cid: int = 0
    flags: int = FLAGS_SGL

    def to_sqe(self) -> SQE:
        return SQE(opc=ADMIN_ASYNC_EVENT, flags=self.flags, cid=self.cid)

    @classmethod
    def from_sqe(cls, sqe: SQE) -> "AsyncEventRequestCommand":
        return cls(cid=sqe.cid, flags=sqe.flags)
