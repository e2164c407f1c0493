"""Reservation commands on the wire (NVMe base specification, Reservations): the CDW10 fields of Register,
Acquire, Release and Report, their data, the Reservation Status data structure (extended: 128-bit host
identifiers) and the Reservation Notification log page (LID 0x80).  Used by the target (engine/reservations.py)
and by the initiator (initiator/controller.py's resv_* helpers)."""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import List

# Reservation types (RTYPE)
WRITE_EXCLUSIVE = 1
EXCLUSIVE_ACCESS = 2
WRITE_EXCLUSIVE_REG_ONLY = 3
EXCLUSIVE_ACCESS_REG_ONLY = 4
WRITE_EXCLUSIVE_ALL_REGS = 5
EXCLUSIVE_ACCESS_ALL_REGS = 6
TYPES = (WRITE_EXCLUSIVE, EXCLUSIVE_ACCESS, WRITE_EXCLUSIVE_REG_ONLY, EXCLUSIVE_ACCESS_REG_ONLY,
         WRITE_EXCLUSIVE_ALL_REGS, EXCLUSIVE_ACCESS_ALL_REGS)
TYPE_NAMES = {0: "none", WRITE_EXCLUSIVE: "write-exclusive", EXCLUSIVE_ACCESS: "exclusive-access",
              WRITE_EXCLUSIVE_REG_ONLY: "write-exclusive-registrants-only",
              EXCLUSIVE_ACCESS_REG_ONLY: "exclusive-access-registrants-only",
              WRITE_EXCLUSIVE_ALL_REGS: "write-exclusive-all-registrants",
              EXCLUSIVE_ACCESS_ALL_REGS: "exclusive-access-all-registrants"}
ALL_REGISTRANTS = (WRITE_EXCLUSIVE_ALL_REGS, EXCLUSIVE_ACCESS_ALL_REGS)  # every registrant holds it

# Register action (RREGA), Acquire action (RACQA), Release action (RRELA): CDW10 bits 2:0
REGISTER, UNREGISTER, REPLACE = 0, 1, 2
ACQUIRE, PREEMPT, PREEMPT_AND_ABORT = 0, 1, 2
RELEASE, CLEAR = 0, 1
IEKEY = 1 << 3  # CDW10 bit 3: ignore existing key
# Register's CPTPL, CDW10 bits 31:30: 00 no change, 10 clear PTPL, 11 set it (01 reserved)
CPTPL_SHIFT = 30
CPTPL_NO_CHANGE, CPTPL_CLEAR, CPTPL_SET = 0, 2, 3
EDS = 1  # Report CDW11 bit 0: extended data structure (128-bit host identifiers)

KEYS = struct.Struct("<QQ")  # Register: CRKEY, NRKEY; Acquire: CRKEY, PRKEY (Release: CRKEY, 8 bytes)
KEY_DATA_SIZE = KEYS.size
RELEASE_DATA_SIZE = 8

STATUS_HEADER = struct.Struct("<IBH2xB")  # GEN, RTYPE, REGCTL, 2 reserved, PTPLS; 24 bytes (64 extended)
STATUS_SIZE = 24
STATUS_EXT_SIZE = 64
REGCTL_EXT = struct.Struct("<HB5xQ16s32x")  # CNTLID, RCSTS, 5 reserved, RKEY, HOSTID, 32 reserved: 64 bytes
RCSTS_HOLDS = 1
CNTLID_DYNAMIC = 0xFFFF  # the controller of a registrant, as nvmet reports it: registration is per host

# Reservation Notification log page: count, type, available pages, 2 reserved, NSID, 48 reserved
LOG = struct.Struct("<QBB2xI48x")
LOG_SIZE = LOG.size
LOG_EMPTY, LOG_REGISTRATION_PREEMPTED, LOG_RESERVATION_RELEASED, LOG_RESERVATION_PREEMPTED = 0, 1, 2, 3
# Reservation Notification Mask (feature 0x82): a set bit masks that log type
MASK_ALL = (1 << LOG_REGISTRATION_PREEMPTED) | (1 << LOG_RESERVATION_RELEASED) | (1 << LOG_RESERVATION_PREEMPTED)


def register_cdw10(action: int, iekey: bool = False, cptpl: int = CPTPL_NO_CHANGE) -> int:
    return (action & 7) | (IEKEY if iekey else 0) | (cptpl << CPTPL_SHIFT)


def acquire_cdw10(action: int, rtype: int, iekey: bool = False) -> int:
    return (action & 7) | (IEKEY if iekey else 0) | (rtype << 8)


release_cdw10 = acquire_cdw10  # the same layout: action 2:0, IEKEY, RTYPE 15:8


@dataclass
class Registrant:
    cntlid: int
    holds: bool
    rkey: int
    hostid: bytes


@dataclass
class ReservationStatus:
    """The Reservation Report's data (extended data structure)."""
    generation: int
    rtype: int
    ptpls: bool
    registrants: List[Registrant] = field(default_factory=list)
    regctl: int = 0  # how many are registered (the list may be cut short by the host's buffer)

    def pack(self, length: int) -> bytes:
        out = bytearray(max(length, STATUS_EXT_SIZE))
        STATUS_HEADER.pack_into(out, 0, self.generation & 0xFFFFFFFF, self.rtype, len(self.registrants),
                                1 if self.ptpls else 0)
        pos = STATUS_EXT_SIZE
        for r in self.registrants:
            if pos + REGCTL_EXT.size > len(out):
                break
            REGCTL_EXT.pack_into(out, pos, r.cntlid, RCSTS_HOLDS if r.holds else 0, r.rkey, r.hostid)
            pos += REGCTL_EXT.size
        return bytes(out[:length])

    @classmethod
    def unpack(cls, data: bytes) -> "ReservationStatus":
        gen, rtype, regctl, ptpls = STATUS_HEADER.unpack_from(data, 0)
        regs = []
        pos = STATUS_EXT_SIZE
        for _ in range(regctl):
            if pos + REGCTL_EXT.size > len(data):
                break
            cntlid, rcsts, rkey, hostid = REGCTL_EXT.unpack_from(data, pos)
            regs.append(Registrant(cntlid, bool(rcsts & RCSTS_HOLDS), rkey, hostid))
            pos += REGCTL_EXT.size
        return cls(gen, rtype, bool(ptpls & 1), regs, regctl)


@dataclass
class NotificationLog:
    count: int
    log_type: int
    available: int
    nsid: int

    def pack(self) -> bytes:
        return LOG.pack(self.count, self.log_type, self.available, self.nsid)

    @classmethod
    def unpack(cls, data: bytes) -> "NotificationLog":
        return cls(*LOG.unpack_from(data, 0))
