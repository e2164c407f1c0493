"""Log pages (docs/protocol.md §5.7, §5.8): error, SMART, changed NS list, effects, discovery."""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import List

from .fabrics import DISCOVERY_NQN, decode_nqn, encode_nqn
from .status import from_wire, to_wire

# -- Error Information (LID 0x01), 64 bytes per entry
_ERROR_ENTRY = struct.Struct("<QHHHHQIB3xQ24x")
ERROR_ENTRY_SIZE = 64
assert _ERROR_ENTRY.size == ERROR_ENTRY_SIZE


@dataclass
class ErrorLogEntry:
    """error count 0, SQID 8, CID 10, status 12 (wire format), parameter location 14, LBA 16, NSID 24,
    vendor specific 28, command specific 32.  `status` here is the status code (wire >> 1)."""

    error_count: int = 0
    sqid: int = 0
    cid: int = 0
    status: int = 0
    param_location: int = 0xFFFF
    lba: int = 0
    nsid: int = 0
    vendor: int = 0
    cmd_specific: int = 0

    def pack(self) -> bytes:
        return _ERROR_ENTRY.pack(self.error_count, self.sqid, self.cid, to_wire(self.status),
                                 self.param_location, self.lba, self.nsid, self.vendor, self.cmd_specific)

    @classmethod
    def unpack(cls, buf, offset: int = 0) -> "ErrorLogEntry":
        count, sqid, cid, status, loc, lba, nsid, vendor, cs = _ERROR_ENTRY.unpack_from(buf, offset)
        return cls(count, sqid, cid, from_wire(status), loc, lba, nsid, vendor, cs)


# -- SMART / Health Information (LID 0x02), 512 bytes
SMART_LOG_SIZE = 512
_U128_FIELDS = (
    ("data_units_read", 32), ("data_units_written", 48), ("host_reads", 64), ("host_writes", 80),
    ("ctrl_busy_time", 96), ("power_cycles", 112), ("power_on_hours", 128), ("unsafe_shutdowns", 144),
    ("media_errors", 160), ("num_err_log_entries", 176),
)


@dataclass
class SmartLog:
    """critical warning 0, temperature 1 (Kelvin, 2 bytes), available spare 3, threshold 4, percent used 5,
    then 16-byte little-endian counters from offset 32 (data units are thousands of 512-byte units)."""

    critical_warning: int = 0
    temperature: int = 0
    avail_spare: int = 0
    spare_thresh: int = 0
    percent_used: int = 0
    data_units_read: int = 0
    data_units_written: int = 0
    host_reads: int = 0
    host_writes: int = 0
    ctrl_busy_time: int = 0
    power_cycles: int = 0
    power_on_hours: int = 0
    unsafe_shutdowns: int = 0
    media_errors: int = 0
    num_err_log_entries: int = 0

    def pack(self) -> bytes:
        buf = bytearray(SMART_LOG_SIZE)
        struct.pack_into("<BHBBB", buf, 0, self.critical_warning, self.temperature, self.avail_spare,
                         self.spare_thresh, self.percent_used)
        for name, offset in _U128_FIELDS:
            buf[offset:offset + 16] = getattr(self, name).to_bytes(16, "little")
        return bytes(buf)

    @classmethod
    def unpack(cls, buf) -> "SmartLog":
        buf = bytes(buf[:SMART_LOG_SIZE])
        cw, temp, spare, thresh, used = struct.unpack_from("<BHBBB", buf, 0)
        counters = {name: int.from_bytes(buf[off:off + 16], "little") for name, off in _U128_FIELDS}
        return cls(cw, temp, spare, thresh, used, **counters)


# -- Changed Namespace List (LID 0x04), 4096 bytes
CHANGED_NS_LOG_SIZE = 4096
CHANGED_NS_MAX = 1024
CHANGED_NS_OVERFLOW = 0xFFFFFFFF  # first entry when more than 1024 namespaces changed


@dataclass
class ChangedNsList:
    nsids: List[int] = field(default_factory=list)

    def pack(self) -> bytes:
        ids = list(self.nsids)
        if len(ids) > CHANGED_NS_MAX:
            ids = [CHANGED_NS_OVERFLOW]
        return struct.pack(f"<{len(ids)}I", *ids).ljust(CHANGED_NS_LOG_SIZE, b"\0")

    @classmethod
    def unpack(cls, buf) -> "ChangedNsList":
        out = []
        for (nsid,) in struct.iter_unpack("<I", bytes(buf[:CHANGED_NS_LOG_SIZE])):
            if nsid == 0:
                break
            out.append(nsid)
        return cls(out)


# -- Commands Supported and Effects (LID 0x05), 4096 bytes
EFFECTS_LOG_SIZE = 4096
EFFECT_CSUPP = 1 << 0  # command supported
EFFECT_LBCC = 1 << 1  # logical block content change


@dataclass
class CommandEffectsLog:
    """ACS[256] (admin) at 0, IOCS[256] (I/O) at 1024, one LE32 per opcode."""

    admin: dict = field(default_factory=dict)  # opcode -> effects bits
    io: dict = field(default_factory=dict)

    def pack(self) -> bytes:
        acs = [self.admin.get(op, 0) for op in range(256)]
        iocs = [self.io.get(op, 0) for op in range(256)]
        return struct.pack("<256I256I", *acs, *iocs).ljust(EFFECTS_LOG_SIZE, b"\0")

    @classmethod
    def unpack(cls, buf) -> "CommandEffectsLog":
        values = struct.unpack_from("<256I256I", bytes(buf[:EFFECTS_LOG_SIZE]))
        admin = {op: v for op, v in enumerate(values[:256]) if v}
        io = {op: v for op, v in enumerate(values[256:]) if v}
        return cls(admin, io)


# -- Discovery log (LID 0x70): 1024-byte header, then 1024-byte entries
DISC_HEADER_SIZE = 1024
DISC_ENTRY_SIZE = 1024

TRTYPE_RDMA = 1
TRTYPE_FC = 2
TRTYPE_TCP = 3
TRTYPE_LOOP = 254
TRTYPES = {"rdma": TRTYPE_RDMA, "fc": TRTYPE_FC, "tcp": TRTYPE_TCP, "loop": TRTYPE_LOOP}

ADRFAM_IPV4 = 1
ADRFAM_IPV6 = 2
ADRFAM_IB = 3
ADRFAM_FC = 4
ADRFAM_LOOP = 254
ADRFAMS = {"ipv4": ADRFAM_IPV4, "ipv6": ADRFAM_IPV6, "ib": ADRFAM_IB, "fc": ADRFAM_FC, "loop": ADRFAM_LOOP}

SUBTYPE_REFERRAL = 1
SUBTYPE_NVME = 2
SUBTYPE_CURRENT_DISCOVERY = 3

TREQ_NOT_SPECIFIED = 0
TREQ_REQUIRED = 1
TREQ_NOT_REQUIRED = 2

RDMA_QPTYPE_CONNECTED = 1
RDMA_PRTYPE_NOT_SPECIFIED = 1
RDMA_CMS_RDMA_CM = 1

_DISC_HEADER = struct.Struct("<QQH1006x")
assert _DISC_HEADER.size == DISC_HEADER_SIZE


@dataclass
class DiscoveryLogHeader:
    """GENCTR 0 (8), NUMREC 8 (8), RECFMT 16 (2)."""

    genctr: int = 0
    numrec: int = 0
    recfmt: int = 0

    def pack(self) -> bytes:
        return _DISC_HEADER.pack(self.genctr, self.numrec, self.recfmt)

    @classmethod
    def unpack(cls, buf, offset: int = 0) -> "DiscoveryLogHeader":
        return cls(*_DISC_HEADER.unpack_from(buf, offset))


def _ascii_field(text: str, size: int) -> bytes:
    raw = text.encode("ascii")
    if len(raw) > size:
        raise ValueError(f"{text!r} longer than {size} bytes")
    return raw.ljust(size, b"\0")


# TRTYPE, ADRFAM, SUBTYPE, TREQ, PORTID, CNTLID, ASQSZ, EFLAGS, 20 rsvd, TRSVCID 32, 192 rsvd,
# SUBNQN 256, TRADDR 512, TSAS (RDMA: QPTYPE, PRTYPE, CMS, 5 rsvd, PKEY, 246 rsvd)
_DISC_ENTRY = struct.Struct("<BBBBHHHH20x32s192x256s256sBBB5xH246x")
assert _DISC_ENTRY.size == DISC_ENTRY_SIZE


@dataclass
class DiscoveryLogEntry:
    trtype: int = TRTYPE_RDMA
    adrfam: int = ADRFAM_IPV4
    subtype: int = SUBTYPE_NVME
    treq: int = TREQ_NOT_SPECIFIED
    portid: int = 0
    cntlid: int = 0xFFFF
    asqsz: int = 32
    eflags: int = 0
    trsvcid: str = ""
    subnqn: str = ""
    traddr: str = ""
    rdma_qptype: int = RDMA_QPTYPE_CONNECTED
    rdma_prtype: int = RDMA_PRTYPE_NOT_SPECIFIED
    rdma_cms: int = RDMA_CMS_RDMA_CM
    rdma_pkey: int = 0

    @property
    def is_referral(self) -> bool:
        return self.subtype == SUBTYPE_REFERRAL or self.subnqn == DISCOVERY_NQN

    def pack(self) -> bytes:
        return _DISC_ENTRY.pack(self.trtype, self.adrfam, self.subtype, self.treq, self.portid, self.cntlid,
                                self.asqsz, self.eflags, _ascii_field(self.trsvcid, 32), encode_nqn(self.subnqn),
                                _ascii_field(self.traddr, 256), self.rdma_qptype, self.rdma_prtype,
                                self.rdma_cms, self.rdma_pkey)

    @classmethod
    def unpack(cls, buf, offset: int = 0) -> "DiscoveryLogEntry":
        (trtype, adrfam, subtype, treq, portid, cntlid, asqsz, eflags, trsvcid, subnqn, traddr,
         qptype, prtype, cms, pkey) = _DISC_ENTRY.unpack_from(buf, offset)
        return cls(trtype, adrfam, subtype, treq, portid, cntlid, asqsz, eflags,
                   decode_nqn(trsvcid).rstrip(" "), decode_nqn(subnqn), decode_nqn(traddr).rstrip(" "),
                   qptype, prtype, cms, pkey)

    def to_dict(self) -> dict:
        return {
            "trtype": self.trtype, "adrfam": self.adrfam, "subtype": self.subtype, "treq": self.treq,
            "portid": self.portid, "cntlid": self.cntlid, "asqsz": self.asqsz, "trsvcid": self.trsvcid,
            "subnqn": self.subnqn, "traddr": self.traddr,
        }
