"""Reading packet captures with the standard library: classic pcap and pcapng.

Classic pcap (what `tcpdump -w` and QEMU's filter-dump write): a 24-byte file
header (magic 0xa1b2c3d4 for microseconds, 0xa1b23c4d for nanoseconds, in
either byte order), then a 16-byte record header per packet.  pcapng: blocks
of (type, length, body, length); we read the Section Header, Interface
Description (link type per interface), Enhanced and Simple Packet blocks.

`read_packets(bytes)` yields `Packet(index, time, linktype, data, orig_len)`;
`data` may be shorter than `orig_len` when the capture's snap length cut it.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterator, List

from ..errors import NvmeofError

LINKTYPE_ETHERNET = 1
LINKTYPE_LINUX_SLL = 113
LINKTYPE_LINUX_SLL2 = 276

PCAP_MAGIC_US = 0xA1B2C3D4
PCAP_MAGIC_NS = 0xA1B23C4D
PCAPNG_SHB = 0x0A0D0D0A
PCAPNG_BYTE_ORDER = 0x1A2B3C4D
PCAPNG_IDB = 0x00000001
PCAPNG_SPB = 0x00000003
PCAPNG_EPB = 0x00000006


@dataclass
class Packet:
    index: int          # 1-based, as Wireshark and tcpdump -r number them
    time: float         # seconds since the epoch
    linktype: int
    data: bytes
    orig_len: int


def _bad(path, what: str) -> NvmeofError:
    return NvmeofError(f"{path}: {what}", "give a capture written by tcpdump -w (pcap or pcapng) "
                                          "or QEMU's -object filter-dump")


def read_packets(buf: bytes, name: str = "capture") -> Iterator[Packet]:
    """The packets of a pcap or pcapng file, from its bytes (`name` for the error messages)."""
    buf = bytes(buf)
    if len(buf) < 4:
        raise _bad(name, f"{len(buf)} bytes is too short for a capture file header")
    magic_le = struct.unpack_from("<I", buf)[0]
    if magic_le == PCAPNG_SHB:
        return _read_pcapng(buf, name)
    return _read_pcap(buf, name)


def _read_pcap(buf: bytes, name: str) -> Iterator[Packet]:
    if len(buf) < 24:
        raise _bad(name, "shorter than the 24-byte pcap file header")
    for endian in "<>":
        magic = struct.unpack_from(endian + "I", buf)[0]
        if magic in (PCAP_MAGIC_US, PCAP_MAGIC_NS):
            break
    else:
        raise _bad(name, f"unknown file magic {buf[:4].hex()} (neither pcap nor pcapng)")
    scale = 1e-9 if magic == PCAP_MAGIC_NS else 1e-6
    linktype = struct.unpack_from(endian + "I", buf, 20)[0] & 0x0FFFFFFF
    record = struct.Struct(endian + "IIII")

    def gen():
        off, index = 24, 0
        while off + record.size <= len(buf):
            sec, frac, incl, orig = record.unpack_from(buf, off)
            off += record.size
            if off + incl > len(buf):
                return  # a capture cut off mid-record (tcpdump killed): keep what was complete
            index += 1
            yield Packet(index, sec + frac * scale, linktype, buf[off:off + incl], orig)
            off += incl
    return gen()


def _read_pcapng(buf: bytes, name: str) -> Iterator[Packet]:
    def gen():
        off, index = 0, 0
        endian = "<"
        linktypes: List[int] = []
        scales: List[float] = []
        while off + 12 <= len(buf):
            btype = struct.unpack_from(endian + "I", buf, off)[0]
            if btype == PCAPNG_SHB:
                bom = struct.unpack_from("<I", buf, off + 8)[0]
                endian = "<" if bom == PCAPNG_BYTE_ORDER else ">"
                linktypes, scales = [], []
            blen = struct.unpack_from(endian + "I", buf, off + 4)[0]
            if blen < 12 or off + blen > len(buf):
                return
            body = buf[off + 8:off + blen - 4]
            if btype == PCAPNG_IDB:
                linktypes.append(struct.unpack_from(endian + "H", body)[0])
                scales.append(_idb_resolution(body[8:], endian))
            elif btype == PCAPNG_EPB:
                iface, hi, lo, incl, orig = struct.unpack_from(endian + "IIIII", body)
                index += 1
                scale = scales[iface] if iface < len(scales) else 1e-6
                yield Packet(index, ((hi << 32) | lo) * scale, linktypes[iface] if iface < len(linktypes) else
                             LINKTYPE_ETHERNET, body[20:20 + incl], orig)
            elif btype == PCAPNG_SPB:
                orig = struct.unpack_from(endian + "I", body)[0]
                index += 1
                yield Packet(index, 0.0, linktypes[0] if linktypes else LINKTYPE_ETHERNET,
                             body[4:4 + orig], orig)
            off += blen
    return gen()


def _idb_resolution(options: bytes, endian: str) -> float:
    """The if_tsresol option (code 9) of an Interface Description Block; default microseconds."""
    off = 0
    while off + 4 <= len(options):
        code, length = struct.unpack_from(endian + "HH", options, off)
        if code == 0:
            break
        if code == 9 and length >= 1:
            v = options[off + 4]
            return 2.0 ** -(v & 0x7F) if v & 0x80 else 10.0 ** -v
        off += 4 + ((length + 3) & ~3)
    return 1e-6


def write_pcap(packets, linktype: int = LINKTYPE_ETHERNET, snaplen: int = 262144) -> bytes:
    """A classic pcap file (microseconds, little-endian) of (time, frame bytes) pairs."""
    out = [struct.pack("<IHHiIII", PCAP_MAGIC_US, 2, 4, 0, 0, snaplen, linktype)]
    for t, frame in packets:
        sec = int(t)
        out.append(struct.pack("<IIII", sec, int(round((t - sec) * 1e6)), len(frame), len(frame)))
        out.append(frame)
    return b"".join(out)
