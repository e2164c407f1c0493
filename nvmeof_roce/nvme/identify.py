"""Identify data structures, 4096 bytes each (docs/protocol.md §5.2 - §5.4).

Each structure is a dataclass; `_FIELDS` lists (attribute, byte offset, struct
format) so pack() and unpack() read as the offset tables of docs/protocol.md.
Text fields (SN, MN, FR) are ASCII padded with spaces; NQNs are NUL-terminated.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import List, Optional

from .fabrics import decode_nqn, encode_nqn

IDENTIFY_SIZE = 4096

# Controller types (CNTRLTYPE, offset 111)
CNTRLTYPE_IO = 1
CNTRLTYPE_DISCOVERY = 2
CNTRLTYPE_ADMIN = 3

# CMIC bits (offset 76)
CMIC_MULTI_PORT = 1 << 0
CMIC_MULTI_CTRL = 1 << 1
CMIC_ANA = 1 << 3  # the controller reports Asymmetric Namespace Access

# ANACAP bits (offset 343): which ANA states the controller may report
ANACAP_OPTIMIZED = 1 << 0
ANACAP_NON_OPTIMIZED = 1 << 1
ANACAP_INACCESSIBLE = 1 << 2
ANACAP_PERSISTENT_LOSS = 1 << 3
ANACAP_CHANGE = 1 << 4

# SGLS bits
SGLS_SUPPORTED = 0x1  # bits 1:0 = 01: SGLs supported, no alignment requirement
SGLS_KEYED = 1 << 2
SGLS_OFFSET = 1 << 20  # data block with offset: in-capsule data

# ONCS bits
ONCS_DSM = 1 << 2
ONCS_WRITE_ZEROES = 1 << 3
ONCS_RESERVATIONS = 1 << 5

# RESCAP bits of Identify Namespace: PTPL, the six types (bit = type), IEKEY as of NVMe 1.3
RESCAP_PTPL = 1 << 0
RESCAP_IEKEY_13 = 1 << 7

# Namespace identification descriptor types (CNS 0x03)
NIDT_EUI64 = 0x01
NIDT_NGUID = 0x02
NIDT_UUID = 0x03
NIDT_CSI = 0x04
NIDT_LENGTHS = {NIDT_EUI64: 8, NIDT_NGUID: 16, NIDT_UUID: 16, NIDT_CSI: 1}


def pad_ascii(text: str, size: int) -> bytes:
    """ASCII, space padded, truncated to `size` (SN/MN/FR style)."""
    return text.encode("ascii", errors="replace")[:size].ljust(size, b" ")


def strip_ascii(raw) -> str:
    return bytes(raw).decode("ascii", errors="replace").rstrip(" \0")


def _pack_fields(obj, fields, buf: bytearray) -> None:
    for name, offset, fmt in fields:
        struct.pack_into("<" + fmt, buf, offset, getattr(obj, name))


def _unpack_fields(fields, buf) -> dict:
    return {name: struct.unpack_from("<" + fmt, buf, offset)[0] for name, offset, fmt in fields}


@dataclass
class IdentifyController:
    """Identify Controller (CNS 0x01).  Fields not listed here are zero on the wire."""

    vid: int = 0
    ssvid: int = 0
    sn: str = ""
    mn: str = ""
    fr: str = ""
    rab: int = 6
    ieee: bytes = bytes(3)
    cmic: int = 0
    mdts: int = 0
    cntlid: int = 0
    ver: int = 0
    rtd3r: int = 0
    rtd3e: int = 0
    oaes: int = 0
    ctratt: int = 0
    cntrltype: int = 0
    crdt1: int = 0
    crdt2: int = 0
    crdt3: int = 0
    oacs: int = 0
    acl: int = 0
    aerl: int = 0
    frmw: int = 0
    lpa: int = 0
    elpe: int = 0
    npss: int = 0
    avscc: int = 0
    apsta: int = 0
    wctemp: int = 0
    cctemp: int = 0
    kas: int = 0
    anatt: int = 0
    anacap: int = 0
    anagrpmax: int = 0
    nanagrpid: int = 0
    sqes: int = 0
    cqes: int = 0
    maxcmd: int = 0
    nn: int = 0
    oncs: int = 0
    fuses: int = 0
    fna: int = 0
    vwc: int = 0
    awun: int = 0
    awupf: int = 0
    nvscc: int = 0
    nwpc: int = 0
    acwu: int = 0
    sgls: int = 0
    mnan: int = 0
    subnqn: str = ""
    ioccsz: int = 0
    iorcsz: int = 0
    icdoff: int = 0
    fcatt: int = 0
    msdbd: int = 0
    ofcs: int = 0
    dctype: int = 0
    # power state descriptor 0: max power (centiwatts), entry/exit latency (us)
    psd0_max_power: int = 0
    psd0_entry_lat: int = 0
    psd0_exit_lat: int = 0

    _FIELDS = (
        ("vid", 0, "H"), ("ssvid", 2, "H"), ("rab", 72, "B"), ("cmic", 76, "B"), ("mdts", 77, "B"),
        ("cntlid", 78, "H"), ("ver", 80, "I"), ("rtd3r", 84, "I"), ("rtd3e", 88, "I"), ("oaes", 92, "I"),
        ("ctratt", 96, "I"), ("cntrltype", 111, "B"), ("crdt1", 128, "H"), ("crdt2", 130, "H"),
        ("crdt3", 132, "H"), ("oacs", 256, "H"), ("acl", 258, "B"), ("aerl", 259, "B"), ("frmw", 260, "B"),
        ("lpa", 261, "B"), ("elpe", 262, "B"), ("npss", 263, "B"), ("avscc", 264, "B"), ("apsta", 265, "B"),
        ("wctemp", 266, "H"), ("cctemp", 268, "H"), ("kas", 320, "H"), ("anatt", 342, "B"),
        ("anacap", 343, "B"), ("anagrpmax", 344, "I"), ("nanagrpid", 348, "I"), ("sqes", 512, "B"), ("cqes", 513, "B"),
        ("maxcmd", 514, "H"), ("nn", 516, "I"), ("oncs", 520, "H"), ("fuses", 522, "H"), ("fna", 524, "B"),
        ("vwc", 525, "B"), ("awun", 526, "H"), ("awupf", 528, "H"), ("nvscc", 530, "B"), ("nwpc", 531, "B"),
        ("acwu", 532, "H"), ("sgls", 536, "I"), ("mnan", 540, "I"), ("ioccsz", 1792, "I"),
        ("iorcsz", 1796, "I"), ("icdoff", 1800, "H"), ("fcatt", 1802, "B"), ("msdbd", 1803, "B"),
        ("ofcs", 1804, "H"), ("dctype", 1806, "B"),
        ("psd0_max_power", 2048, "H"), ("psd0_entry_lat", 2052, "I"), ("psd0_exit_lat", 2056, "I"),
    )

    def pack(self) -> bytes:
        buf = bytearray(IDENTIFY_SIZE)
        buf[4:24] = pad_ascii(self.sn, 20)
        buf[24:64] = pad_ascii(self.mn, 40)
        buf[64:72] = pad_ascii(self.fr, 8)
        buf[73:76] = bytes(self.ieee)[:3].ljust(3, b"\0")
        buf[768:1024] = encode_nqn(self.subnqn)
        _pack_fields(self, self._FIELDS, buf)
        return bytes(buf)

    @classmethod
    def unpack(cls, buf) -> "IdentifyController":
        buf = bytes(buf[:IDENTIFY_SIZE])
        values = _unpack_fields(cls._FIELDS, buf)
        return cls(sn=strip_ascii(buf[4:24]), mn=strip_ascii(buf[24:64]), fr=strip_ascii(buf[64:72]),
                   ieee=buf[73:76], subnqn=decode_nqn(buf[768:1024]), **values)


@dataclass
class IdentifyNamespace:
    """Identify Namespace (CNS 0x00) with one LBA format (LBAF0)."""

    nsze: int = 0
    ncap: int = 0
    nuse: int = 0
    nsfeat: int = 0
    nlbaf: int = 0
    flbas: int = 0
    mc: int = 0
    dpc: int = 0
    dps: int = 0
    nmic: int = 0
    rescap: int = 0
    fpi: int = 0
    dlfeat: int = 0
    anagrpid: int = 0
    nsattr: int = 0
    nguid: bytes = bytes(16)
    eui64: bytes = bytes(8)
    lbaf0_ms: int = 0
    lbaf0_lbads: int = 9
    lbaf0_rp: int = 0

    _FIELDS = (
        ("nsze", 0, "Q"), ("ncap", 8, "Q"), ("nuse", 16, "Q"), ("nsfeat", 24, "B"), ("nlbaf", 25, "B"),
        ("flbas", 26, "B"), ("mc", 27, "B"), ("dpc", 28, "B"), ("dps", 29, "B"), ("nmic", 30, "B"),
        ("rescap", 31, "B"), ("fpi", 32, "B"), ("dlfeat", 33, "B"), ("anagrpid", 92, "I"), ("nsattr", 99, "B"),
        ("lbaf0_ms", 128, "H"), ("lbaf0_lbads", 130, "B"), ("lbaf0_rp", 131, "B"),
    )

    @property
    def block_size(self) -> int:
        return 1 << self.lbaf0_lbads

    @property
    def present(self) -> bool:
        return self.ncap != 0

    def pack(self) -> bytes:
        buf = bytearray(IDENTIFY_SIZE)
        _pack_fields(self, self._FIELDS, buf)
        buf[104:120] = bytes(self.nguid)[:16].ljust(16, b"\0")
        buf[120:128] = bytes(self.eui64)[:8].ljust(8, b"\0")
        return bytes(buf)

    @classmethod
    def unpack(cls, buf) -> "IdentifyNamespace":
        buf = bytes(buf[:IDENTIFY_SIZE])
        return cls(nguid=buf[104:120], eui64=buf[120:128], **_unpack_fields(cls._FIELDS, buf))


@dataclass
class ActiveNamespaceList:
    """CNS 0x02: up to 1024 ascending LE32 NSIDs, zero filled."""

    nsids: List[int] = field(default_factory=list)

    MAX_ENTRIES = 1024

    def pack(self) -> bytes:
        ids = list(self.nsids)[: self.MAX_ENTRIES]
        return struct.pack(f"<{len(ids)}I", *ids).ljust(IDENTIFY_SIZE, b"\0")

    @classmethod
    def unpack(cls, buf) -> "ActiveNamespaceList":
        nsids = []
        for (nsid,) in struct.iter_unpack("<I", bytes(buf[:IDENTIFY_SIZE])):
            if nsid == 0:
                break
            nsids.append(nsid)
        return cls(nsids)


@dataclass
class NsDescriptor:
    """One namespace identification descriptor: NIDT (1), NIDL (1), 2 reserved, NID (NIDL bytes)."""

    nidt: int
    nid: bytes

    def pack(self) -> bytes:
        return struct.pack("<BBH", self.nidt, len(self.nid), 0) + bytes(self.nid)


@dataclass
class NsDescriptorList:
    """CNS 0x03: descriptors back to back, the rest zero (a zero NIDL ends the list)."""

    descriptors: List[NsDescriptor] = field(default_factory=list)

    def pack(self) -> bytes:
        out = b"".join(d.pack() for d in self.descriptors)
        if len(out) > IDENTIFY_SIZE:
            raise ValueError("namespace descriptor list larger than 4096 bytes")
        return out.ljust(IDENTIFY_SIZE, b"\0")

    @classmethod
    def unpack(cls, buf) -> "NsDescriptorList":
        buf = bytes(buf[:IDENTIFY_SIZE])
        out = []
        pos = 0
        while pos + 4 <= len(buf):
            nidt, nidl = buf[pos], buf[pos + 1]
            if nidl == 0:
                break
            out.append(NsDescriptor(nidt, buf[pos + 4:pos + 4 + nidl]))
            pos += 4 + nidl
        return cls(out)

    def find(self, nidt: int) -> Optional[bytes]:
        for d in self.descriptors:
            if d.nidt == nidt:
                return d.nid
        return None
