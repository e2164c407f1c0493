"""RoCE v2 frames decoded: BTH and its extension headers, CM MADs, and the NVMe-oF capsules inside SENDs.

RoCE v2 is InfiniBand's transport over UDP (destination port 4791):
Ethernet | IPv4 or IPv6 | UDP | BTH (12) | extension headers | payload | pad | ICRC (4).

  BTH   opcode, SE/M/PadCnt/TVer, P_Key, F/B, DestQP (24), A (ack request), PSN (24)
  RETH  VA (8), R_Key (4), DMA length (4)   RDMA WRITE First/Only, RDMA READ Request
  AETH  syndrome (1), MSN (3)               Acknowledge, RDMA READ Response First/Last/Only
  ImmDt immediate data (4)                  ... with Immediate
  IETH  R_Key to invalidate (4)             SEND ... with Invalidate
  DETH  Q_Key (4), source QP (4)            UD (QP1: the CM's MADs)

(IBTA Volume 1 §9.2-9.3 and Annex A17.)  In an NVMe-oF/RDMA association (NVMe
over Fabrics spec, RDMA transport binding) the host SENDs 64-byte command
capsules (plus in-capsule data), the target moves data with RDMA WRITE (reads)
or RDMA READ (writes) against the keyed SGL in the capsule, and SENDs the
16-byte response capsule back, with Invalidate of the host's rkey when the host
asked for it (SGL subtype 0xF).  The CM REQ's private data carries the queue ID,
so a decode that saw the connect names the queue of every capsule.

`decode(packets)` returns a `Decode` with one `Frame` per RoCE frame and a
`FlowSummary` per direction and destination QP.  Pure parsing, no I/O.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

from ..nvme import cm as nvme_cm
from ..nvme.command import ADMIN_FABRICS, CQE, CQE_SIZE, SQE, SQE_SIZE
from ..nvme.fabrics import FCTYPE_CONNECT
from .pcap import LINKTYPE_ETHERNET, LINKTYPE_LINUX_SLL, LINKTYPE_LINUX_SLL2, Packet
from ..nvme.sgl import ID_IN_CAPSULE, SUBTYPE_INVALIDATE_KEY, TYPE_DATA_BLOCK, TYPE_KEYED_DATA_BLOCK
from ..nvme.status import describe as status_describe

ROCE_V2_PORT = 4791
ETH_IPV4 = 0x0800
ETH_IPV6 = 0x86DD
ETH_VLAN = (0x8100, 0x88A8)
IPPROTO_UDP = 17

BTH_SIZE = 12
ICRC_SIZE = 4
PSN_MASK = 0xFFFFFF
PSN_HALF = 0x800000

# RC opcodes (IBTA §9.2, table 38); UD SEND Only is 0x64; 0x81 is the RoCE v2 CNP (Annex A17.9).
RC_OPCODES = {
    0x00: "SEND First", 0x01: "SEND Middle", 0x02: "SEND Last", 0x03: "SEND Last with Immediate",
    0x04: "SEND Only", 0x05: "SEND Only with Immediate",
    0x06: "RDMA WRITE First", 0x07: "RDMA WRITE Middle", 0x08: "RDMA WRITE Last",
    0x09: "RDMA WRITE Last with Immediate", 0x0A: "RDMA WRITE Only", 0x0B: "RDMA WRITE Only with Immediate",
    0x0C: "RDMA READ Request", 0x0D: "RDMA READ Response First", 0x0E: "RDMA READ Response Middle",
    0x0F: "RDMA READ Response Last", 0x10: "RDMA READ Response Only", 0x11: "Acknowledge",
    0x12: "ATOMIC Acknowledge", 0x13: "CmpSwap", 0x14: "FetchAdd",
    0x16: "SEND Last with Invalidate", 0x17: "SEND Only with Invalidate",
}
UD_SEND_ONLY = 0x64
UD_SEND_ONLY_IMM = 0x65
CNP = 0x81

WITH_RETH = {0x06, 0x0A, 0x0B, 0x0C}
WITH_AETH = {0x0D, 0x0F, 0x10, 0x11, 0x12}
WITH_IMM = {0x03, 0x05, 0x09, 0x0B, UD_SEND_ONLY_IMM}
WITH_IETH = {0x16, 0x17}
SEND_FIRST_OR_ONLY = {0x00, 0x04, 0x05, 0x17}
READ_RESPONSES = {0x0D, 0x0E, 0x0F, 0x10}
# Packets that carry a requester's PSN (a repeated one is a retransmission); responses are counted apart.
REQUESTS = {op for op in RC_OPCODES if op not in READ_RESPONSES | {0x11, 0x12}}

# AETH syndrome (IBTA §9.3.5, table 41): bits 7:5 the type, bits 4:0 credits, RNR timer or NAK code.
NAK_CODES = {0: "PSN Sequence Error", 1: "Invalid Request", 2: "Remote Access Error",
             3: "Remote Operational Error", 4: "Invalid RD Request"}

# CM MAD attribute IDs (IBTA §16.7.2 and §12.6); management class 0x07.
MGMT_CLASS_CM = 0x07
CM_ATTRS = {0x0001: "ClassPortInfo", 0x0010: "REQ", 0x0011: "MRA", 0x0012: "REJ", 0x0013: "REP",
            0x0014: "RTU", 0x0015: "DREQ", 0x0016: "DREP", 0x0017: "SIDR_REQ", 0x0018: "SIDR_REP",
            0x0019: "LAP", 0x001A: "APR"}
MAD_HEADER = 24
CM_REQ_PRIVATE = 140   # offsets inside the CM message (after the MAD header), Linux's struct cm_req_msg
CMA_HEADER = 36        # rdma_cm's cma_hdr in a REQ: version, IP version, source port, source and destination IP
RDMA_PS_TCP = 0x0106
CM_REP_PRIVATE = 36
CM_REJ_PRIVATE = 84

ADMIN_OPCODES = {0x00: "Delete I/O SQ", 0x01: "Create I/O SQ", 0x02: "Get Log Page", 0x04: "Delete I/O CQ",
                 0x05: "Create I/O CQ", 0x06: "Identify", 0x08: "Abort", 0x09: "Set Features",
                 0x0A: "Get Features", 0x0C: "Asynchronous Event Request", 0x0D: "Namespace Management",
                 0x18: "Keep Alive", 0x7F: "Fabrics"}
NVM_OPCODES = {0x00: "Flush", 0x01: "Write", 0x02: "Read", 0x04: "Write Uncorrectable", 0x05: "Compare",
               0x08: "Write Zeroes", 0x09: "Dataset Management", 0x7F: "Fabrics"}
FABRICS_TYPES = {0x00: "Property Set", 0x01: "Connect", 0x04: "Property Get", 0x05: "Authentication Send",
                 0x06: "Authentication Receive", 0x08: "Disconnect"}


def opcode_name(opcode: int) -> str:
    if opcode in RC_OPCODES:
        return RC_OPCODES[opcode]
    if opcode == UD_SEND_ONLY:
        return "UD SEND Only"
    if opcode == UD_SEND_ONLY_IMM:
        return "UD SEND Only with Immediate"
    if opcode == CNP:
        return "CNP"
    return f"opcode {opcode:#04x}"


def aeth_describe(syndrome: int) -> Dict[str, object]:
    kind, value = syndrome >> 5, syndrome & 0x1F
    if kind == 0:
        return {"type": "ACK", "credits": value}
    if kind == 1:
        # RNR NAK timer field: an index into IBTA table 45 (0 = 655.36 ms, 1 = 0.01 ms ... 31 = 491.52 ms)
        return {"type": "RNR NAK", "timer": value}
    if kind == 3:
        return {"type": "NAK", "code": value, "reason": NAK_CODES.get(value, f"reserved NAK code {value}")}
    return {"type": f"reserved syndrome {syndrome:#04x}"}


def psn_after(a: int, b: int) -> bool:
    """True if PSN a comes after b in 24-bit serial arithmetic (IBTA §9.7.1)."""
    d = (a - b) & PSN_MASK
    return d != 0 and d < PSN_HALF


def icrc(ip_and_after: bytes, ipv6: bool) -> int:
    """The RoCE v2 ICRC (Annex A17.3.3): CRC-32 over 8 bytes of ones, then the IP header with the
    variant fields (IPv4 ToS, TTL, checksum; IPv6 traffic class, flow label, hop limit) set to ones,
    UDP with its checksum set to ones, the BTH with its reserved byte 4 (FECN, BECN) set to ones, and
    the rest of the packet up to the ICRC.  Linux rxe_icrc_hdr() builds the same pseudo header."""
    b = bytearray(ip_and_after)
    if ipv6:
        b[0] |= 0x0F
        b[1:4] = b"\xff\xff\xff"
        b[7] = 0xFF
        ip_len = 40
    else:
        ip_len = (b[0] & 0x0F) * 4
        b[1] = 0xFF
        b[8] = 0xFF
        b[10:12] = b"\xff\xff"
    b[ip_len + 6:ip_len + 8] = b"\xff\xff"
    b[ip_len + 8 + 4] = 0xFF
    return zlib.crc32(bytes(b), zlib.crc32(b"\xff" * 8)) & 0xFFFFFFFF


@dataclass
class Frame:
    index: int
    time: float
    src: str
    dst: str
    opcode: int
    opname: str
    dest_qp: int
    psn: int
    ack_req: bool
    solicited: bool = False
    pad: int = 0
    length: int = 0          # the frame on the wire (original length)
    payload_len: int = 0     # the IB payload, without pad and ICRC
    reth: Optional[Dict[str, int]] = None
    aeth: Optional[Dict[str, object]] = None
    immediate: Optional[int] = None
    invalidate_rkey: Optional[int] = None
    deth: Optional[Dict[str, int]] = None
    icrc: Optional[Dict[str, object]] = None   # present, value, ok (None when the capture cut it)
    cm: Optional[Dict[str, object]] = None
    nvme: Optional[Dict[str, object]] = None
    retransmit: bool = False
    ecn: int = 0

    def to_dict(self) -> Dict[str, object]:
        d = {"frame": self.index, "time": round(self.time, 6), "src": self.src, "dst": self.dst,
             "opcode": self.opcode, "op": self.opname, "dest_qp": self.dest_qp, "psn": self.psn,
             "ack_req": self.ack_req, "length": self.length, "payload": self.payload_len}
        for key in ("reth", "aeth", "immediate", "invalidate_rkey", "deth", "icrc", "cm", "nvme"):
            value = getattr(self, key)
            if value is not None:
                d[key] = value
        if self.solicited:
            d["solicited"] = True
        if self.ecn:
            d["ecn"] = self.ecn
        if self.retransmit:
            d["retransmit"] = True
        return d

    def line(self) -> str:
        """One human line, tcpdump-like."""
        parts = [f"{self.index:>5} {self.src} > {self.dst} QP {self.dest_qp:#x} PSN {self.psn}",
                 self.opname + (" [A]" if self.ack_req else "")]
        if self.reth:
            parts.append(f"VA {self.reth['va']:#x} rkey {self.reth['rkey']:#x} len {self.reth['length']}")
        if self.aeth:
            a = self.aeth
            if a["type"] == "NAK":
                parts.append(f"NAK {a['reason']} MSN {a['msn']}")
            elif a["type"] == "RNR NAK":
                parts.append(f"RNR NAK timer {a['timer']} MSN {a['msn']}")
            else:
                parts.append(f"{a['type']} MSN {a['msn']}")
        if self.immediate is not None:
            parts.append(f"imm {self.immediate:#x}")
        if self.invalidate_rkey is not None:
            parts.append(f"invalidate rkey {self.invalidate_rkey:#x}")
        if self.cm:
            parts.append("CM " + " ".join(f"{k}={v}" for k, v in self.cm.items()))
        if self.nvme:
            parts.append(_nvme_line(self.nvme))
        if self.payload_len and not self.nvme and not self.cm:
            parts.append(f"{self.payload_len} B")
        if self.icrc is not None and self.icrc.get("ok") is False:
            parts.append("BAD ICRC")
        if self.icrc is None:
            parts.append("(ICRC not captured)")
        if self.retransmit:
            parts.append("RETRANSMIT")
        return "  ".join(parts)


def _nvme_line(n: Dict[str, object]) -> str:
    if n["kind"] == "command":
        s = f"NVMe {n['name']} cid {n['cid']} nsid {n['nsid']:#x}"
        if n.get("qid") is not None:
            s += f" qid {n['qid']}"
        if "slba" in n:
            s += f" slba {n['slba']} nlb {n['nlb']}"
        sgl = n["sgl"]
        if sgl["type"] == "keyed":
            s += f" SGL keyed VA {sgl['addr']:#x} len {sgl['length']} key {sgl['key']:#x}" + \
                 (" (invalidate)" if sgl["invalidate"] else "")
        elif sgl["type"] == "in-capsule":
            s += f" SGL in-capsule offset {sgl['addr']} len {sgl['length']}"
        else:
            s += f" SGL id {sgl['id']:#04x}"
        if n.get("in_capsule_bytes"):
            s += f" +{n['in_capsule_bytes']} B data"
        if n.get("continued"):
            s += " (capsule continues)"
        return s
    s = f"NVMe response cid {n['cid']} sqhd {n['sqhd']} status {n['status_name']}"
    if n.get("for"):
        s += f" (for {n['for']})"
    return s


@dataclass
class FlowSummary:
    src: str
    dst: str
    dest_qp: int
    frames: int = 0
    bytes: int = 0
    retransmitted: List[int] = field(default_factory=list)
    naks: int = 0
    rnr_naks: int = 0
    nak_reasons: Dict[str, int] = field(default_factory=dict)
    ops: Dict[str, int] = field(default_factory=dict)
    qid: Optional[int] = None

    def to_dict(self) -> Dict[str, object]:
        return {"src": self.src, "dst": self.dst, "dest_qp": self.dest_qp, "qid": self.qid,
                "frames": self.frames, "bytes": self.bytes, "retransmitted_psns": len(self.retransmitted),
                "retransmitted": self.retransmitted[:50], "naks": self.naks, "rnr_naks": self.rnr_naks,
                "nak_reasons": self.nak_reasons, "ops": self.ops}


@dataclass
class Decode:
    frames: List[Frame]
    flows: List[FlowSummary]
    packets: int        # packets in the capture
    other: int          # packets that were not RoCE v2
    bad_icrc: int

    def to_dict(self, frames: bool = True) -> Dict[str, object]:
        d = {"packets": self.packets, "roce_frames": len(self.frames), "other_packets": self.other,
             "bad_icrc": self.bad_icrc, "flows": [f.to_dict() for f in self.flows]}
        if frames:
            d["frames"] = [f.to_dict() for f in self.frames]
        return d


# -- link, network and transport layers

def _l3(packet: Packet) -> Optional[Tuple[int, bytes]]:
    """(ethertype, bytes from the IP header on) of a captured frame, or None."""
    data = packet.data
    if packet.linktype == LINKTYPE_ETHERNET:
        if len(data) < 14:
            return None
        etype, off = struct.unpack_from("!H", data, 12)[0], 14
        while etype in ETH_VLAN and len(data) >= off + 4:
            etype, off = struct.unpack_from("!H", data, off + 2)[0], off + 4
    elif packet.linktype == LINKTYPE_LINUX_SLL:
        if len(data) < 16:
            return None
        etype, off = struct.unpack_from("!H", data, 14)[0], 16
    elif packet.linktype == LINKTYPE_LINUX_SLL2:
        if len(data) < 20:
            return None
        etype, off = struct.unpack_from("!H", data, 0)[0], 20
    else:
        return None
    return etype, data[off:]


def _ip_udp(etype: int, ip: bytes):
    """(src, dst, ecn, udp dport, ip+udp+rest, header length to the UDP payload, ipv6) or None."""
    if etype == ETH_IPV4 and len(ip) >= 20 and ip[0] >> 4 == 4:
        ihl = (ip[0] & 0x0F) * 4
        if ip[9] != IPPROTO_UDP or len(ip) < ihl + 8:
            return None
        if struct.unpack_from("!H", ip, 6)[0] & 0x3FFF:
            return None  # an IP fragment: RoCE never fragments (DF is set), not ours
        total = struct.unpack_from("!H", ip, 2)[0]
        src = ".".join(str(b) for b in ip[12:16])
        dst = ".".join(str(b) for b in ip[16:20])
        return src, dst, ip[1] & 3, struct.unpack_from("!H", ip, ihl + 2)[0], ip[:total], ihl + 8, False
    if etype == ETH_IPV6 and len(ip) >= 48 and ip[0] >> 4 == 6:
        if ip[6] != IPPROTO_UDP:
            return None
        import ipaddress
        src = str(ipaddress.IPv6Address(ip[8:24]))
        dst = str(ipaddress.IPv6Address(ip[24:40]))
        ecn = (struct.unpack_from("!I", ip, 0)[0] >> 20) & 3
        total = 40 + struct.unpack_from("!H", ip, 4)[0]
        return src, dst, ecn, struct.unpack_from("!H", ip, 42)[0], ip[:total], 48, True
    return None


def decode_frame(packet: Packet) -> Optional[Frame]:
    """One RoCE v2 frame, or None for anything else."""
    l3 = _l3(packet)
    if l3 is None:
        return None
    parsed = _ip_udp(*l3)
    if parsed is None:
        return None
    src, dst, ecn, dport, ip, hdr_len, ipv6 = parsed
    if dport != ROCE_V2_PORT or len(ip) < hdr_len + BTH_SIZE:
        return None
    # The IP total length tells how long the frame was even if the capture kept less of it.
    ip_total = struct.unpack_from("!H", ip, 2)[0] if not ipv6 else 40 + struct.unpack_from("!H", ip, 4)[0]
    cut = len(ip) < ip_total
    ib = ip[hdr_len:]
    opcode, flags = ib[0], ib[1]
    dest_qp = struct.unpack_from("!I", ib, 4)[0] & 0xFFFFFF
    apsn = struct.unpack_from("!I", ib, 8)[0]
    frame = Frame(index=packet.index, time=packet.time, src=src, dst=dst, opcode=opcode,
                  opname=opcode_name(opcode), dest_qp=dest_qp, psn=apsn & PSN_MASK, ack_req=bool(apsn >> 31),
                  solicited=bool(flags & 0x80), pad=(flags >> 4) & 3, length=packet.orig_len, ecn=ecn)
    off = BTH_SIZE
    try:
        if opcode in (UD_SEND_ONLY, UD_SEND_ONLY_IMM):
            qkey, sqp = struct.unpack_from("!II", ib, off)
            frame.deth = {"qkey": qkey, "src_qp": sqp & 0xFFFFFF}
            off += 8
        if opcode in WITH_RETH:
            va, rkey, length = struct.unpack_from("!QII", ib, off)
            frame.reth = {"va": va, "rkey": rkey, "length": length}
            off += 16
        if opcode in WITH_AETH:
            word = struct.unpack_from("!I", ib, off)[0]
            frame.aeth = {**aeth_describe(word >> 24), "syndrome": word >> 24, "msn": word & 0xFFFFFF}
            off += 4
        if opcode == 0x12:
            off += 8  # AtomicAckETH: original remote data
        if opcode in (0x13, 0x14):
            off += 28  # AtomicETH
        if opcode in WITH_IMM:
            frame.immediate = struct.unpack_from("!I", ib, off)[0]
            off += 4
        if opcode in WITH_IETH:
            frame.invalidate_rkey = struct.unpack_from("!I", ib, off)[0]
            off += 4
        if opcode == CNP:
            off += 16
    except struct.error:
        return frame  # headers cut by the snap length: BTH only
    if cut:  # the payload's length from the IP header, its bytes as far as captured
        frame.payload_len = max(0, ip_total - hdr_len - off - frame.pad - ICRC_SIZE)
        payload = ib[off:]
    else:
        end = len(ib) - ICRC_SIZE
        frame.payload_len = max(0, end - off - frame.pad)
        payload = ib[off:off + frame.payload_len]
        got = struct.unpack_from("<I", ip, len(ip) - ICRC_SIZE)[0]
        want = icrc(ip[:len(ip) - ICRC_SIZE], ipv6)
        frame.icrc = {"present": True, "value": got, "ok": got == want}
    if frame.deth is not None and dest_qp == 1:
        frame.cm = decode_cm(payload)
    elif opcode in SEND_FIRST_OR_ONLY:
        frame.nvme = decode_capsule(payload, frame.payload_len, whole=opcode != 0x00)
    return frame


def decode_cm(mad: bytes) -> Optional[Dict[str, object]]:
    """A CM MAD (IBTA §12.6): the message, communication IDs, QPN, and the NVMe-oF private data."""
    if len(mad) < MAD_HEADER + 8 or mad[1] != MGMT_CLASS_CM:
        return None
    attr = struct.unpack_from("!H", mad, 16)[0]
    msg = mad[MAD_HEADER:]
    cm: Dict[str, object] = {"msg": CM_ATTRS.get(attr, f"attr {attr:#06x}"),
                             "local_comm_id": struct.unpack_from("!I", msg, 0)[0]}
    try:
        if attr == 0x0010:  # REQ
            service_id = struct.unpack_from("!Q", msg, 8)[0]
            if service_id >> 16 == RDMA_PS_TCP:
                cm["port"] = service_id & 0xFFFF  # rdma_cm's service ID: port space << 16 | destination port
            cm["qpn"] = struct.unpack_from("!I", msg, 32)[0] >> 8
            cm["start_psn"] = struct.unpack_from("!I", msg, 44)[0] >> 8
            private = CM_REQ_PRIVATE
            if len(msg) < private + 2:
                return cm  # cut by the capture's snap length: no private data
            if msg[private] == 0 and msg[private + 1] >> 4 in (4, 6):
                private += CMA_HEADER  # rdma_cm's own header (Linux struct cma_hdr) precedes the user's data
            req = nvme_cm.CmConnectRequest.unpack(msg[private:private + nvme_cm.REQUEST_SIZE])
            cm.update(qid=req.qid, hrqsize=req.hrqsize, hsqsize=req.hsqsize)
        elif attr == 0x0013:  # REP
            cm["remote_comm_id"] = struct.unpack_from("!I", msg, 4)[0]
            cm["qpn"] = struct.unpack_from("!I", msg, 12)[0] >> 8
            cm["start_psn"] = struct.unpack_from("!I", msg, 20)[0] >> 8
            cm["crqsize"] = nvme_cm.CmAccept.unpack(msg[CM_REP_PRIVATE:CM_REP_PRIVATE + 4]).crqsize
        elif attr == 0x0012:  # REJ
            cm["remote_comm_id"] = struct.unpack_from("!I", msg, 4)[0]
            cm["reason"] = struct.unpack_from("!H", msg, 10)[0]
            if cm["reason"] == 28:  # consumer reject: the NVMe-oF reject private data
                rej = nvme_cm.CmReject.unpack(msg[CM_REJ_PRIVATE:CM_REJ_PRIVATE + 4])
                cm["nvme_sts"] = nvme_cm.sts_name(rej.sts)
        elif attr in (0x0014, 0x0015, 0x0016):  # RTU, DREQ, DREP
            cm["remote_comm_id"] = struct.unpack_from("!I", msg, 4)[0]
    except (struct.error, ValueError):
        pass
    return cm


def decode_capsule(payload: bytes, length: int, whole: bool = True) -> Optional[Dict[str, object]]:
    """An NVMe-oF capsule in the first packet of a SEND: a 16-byte response or a 64-byte command.
    `whole` is False for a SEND First: the capsule goes on in the next packets (in-capsule data)."""
    if whole and length == CQE_SIZE and len(payload) >= CQE_SIZE:
        cqe = CQE.unpack(payload)
        return {"kind": "response", "cid": cqe.cid, "sqhd": cqe.sqhd, "sqid": cqe.sqid, "status": cqe.status,
                "status_name": status_describe(cqe.status) if cqe.status else "Success", "result": cqe.result}
    if length < SQE_SIZE or len(payload) < SQE_SIZE:
        return None
    sqe = SQE.unpack(payload)
    sgl = sqe.sgl
    if sgl.type == TYPE_KEYED_DATA_BLOCK:
        sgl_d = {"type": "keyed", "addr": sgl.addr, "length": sgl.length, "key": sgl.key,
                 "invalidate": sgl.subtype == SUBTYPE_INVALIDATE_KEY}
    elif sgl.type == TYPE_DATA_BLOCK and sgl.sgl_id == ID_IN_CAPSULE:
        sgl_d = {"type": "in-capsule", "addr": sgl.addr, "length": sgl.length}
    else:
        sgl_d = {"type": "other", "id": sgl.sgl_id, "addr": sgl.addr, "length": sgl.length}
    n: Dict[str, object] = {"kind": "command", "opcode": sqe.opc, "cid": sqe.cid, "nsid": sqe.nsid, "sgl": sgl_d}
    if whole:
        n["in_capsule_bytes"] = length - SQE_SIZE
    else:
        n["continued"] = True  # in-capsule data follows in SEND Middle/Last packets
    if sqe.opc == ADMIN_FABRICS:
        n["fctype"] = sqe.fctype
        if sqe.fctype == FCTYPE_CONNECT:
            n["connect_qid"] = sqe.cdw10 >> 16
    n["_sqe"] = sqe  # for the queue-aware naming in decode(); removed there
    return n


def _name_command(n: Dict[str, object], qid: Optional[int]) -> None:
    sqe: SQE = n.pop("_sqe")
    n["qid"] = qid
    if sqe.opc == ADMIN_FABRICS:
        n["name"] = FABRICS_TYPES.get(sqe.fctype, f"Fabrics type {sqe.fctype:#04x}")
        n["nsid"] = 0
        return
    if qid == 0:
        n["name"] = ADMIN_OPCODES.get(sqe.opc, f"admin opcode {sqe.opc:#04x}")
        return
    io = qid is not None or sqe.nsid not in (0, 0xFFFFFFFF)
    table = NVM_OPCODES if io else ADMIN_OPCODES
    n["name"] = table.get(sqe.opc, f"opcode {sqe.opc:#04x}") + ("" if qid is not None else "?")
    if io and sqe.opc in (0x01, 0x02, 0x05, 0x08):
        n["slba"] = sqe.cdw10 | (sqe.cdw11 << 32)
        n["nlb"] = (sqe.cdw12 & 0xFFFF) + 1


def decode(packets: Iterable[Packet]) -> Decode:
    """Decode a capture: frames in order, queue IDs from the CM exchange, responses matched to commands,
    and per flow (source, destination, destination QP) the frames, bytes, retransmitted PSNs and NAKs."""
    frames: List[Frame] = []
    flows: Dict[Tuple[str, str, int], FlowSummary] = {}
    highest: Dict[Tuple[str, str, int, str], int] = {}
    qp_qid: Dict[Tuple[str, int], int] = {}           # (node address, its QPN) -> NVMe queue ID
    pending_req: Dict[Tuple[str, int], Dict] = {}     # (host address, comm id) -> REQ
    outstanding: Dict[Tuple[str, str, int, int], str] = {}  # (host, target, target QP, cid) -> command name
    peer_qp: Dict[Tuple[str, int], int] = {}          # (target, target QP) -> host QP, from REQ/REP
    total = other = bad = 0
    for packet in packets:
        total += 1
        frame = decode_frame(packet)
        if frame is None:
            other += 1
            continue
        if frame.icrc is not None and not frame.icrc["ok"]:
            bad += 1
        key = (frame.src, frame.dst, frame.dest_qp)
        flow = flows.get(key)
        if flow is None:
            flow = flows[key] = FlowSummary(frame.src, frame.dst, frame.dest_qp)
        flow.frames += 1
        flow.bytes += frame.length
        flow.ops[frame.opname] = flow.ops.get(frame.opname, 0) + 1
        # Retransmission: a request PSN (or READ response PSN) not after the highest seen on this flow.
        seq = "request" if frame.opcode in REQUESTS else "read-response" if frame.opcode in READ_RESPONSES else None
        if seq is not None and frame.deth is None:
            hk = key + (seq,)
            last = highest.get(hk)
            if last is not None and not psn_after(frame.psn, last):
                frame.retransmit = True
                flow.retransmitted.append(frame.psn)
            else:
                # (a READ Request consumes one PSN per response packet; the next request is still after it)
                highest[hk] = frame.psn
        if frame.aeth is not None:
            if frame.aeth["type"] == "NAK":
                flow.naks += 1
                reason = str(frame.aeth["reason"])
                flow.nak_reasons[reason] = flow.nak_reasons.get(reason, 0) + 1
            elif frame.aeth["type"] == "RNR NAK":
                flow.rnr_naks += 1
        if frame.cm:
            _track_cm(frame, pending_req, qp_qid, peer_qp)
        if flow.qid is None:
            flow.qid = qp_qid.get((frame.dst, frame.dest_qp))
        if frame.nvme is not None:
            n = frame.nvme
            if n["kind"] == "command":
                qid = qp_qid.get((frame.dst, frame.dest_qp))
                if qid is None and n.get("connect_qid") is not None:
                    qid = qp_qid[(frame.dst, frame.dest_qp)] = n["connect_qid"]
                _name_command(n, qid)
                if qid is not None:
                    flow.qid = qid
                outstanding[(frame.src, frame.dst, frame.dest_qp, n["cid"])] = n["name"]
            else:
                # the response goes to the host's QP; find the command by CID on the reverse flow
                target_qps = [tqp for (t, tqp), hqp in peer_qp.items() if t == frame.src and hqp == frame.dest_qp]
                for tqp in target_qps or [None]:
                    for (h, t, q, cid), name in list(outstanding.items()):
                        if h == frame.dst and t == frame.src and cid == n["cid"] and (tqp is None or q == tqp):
                            n["for"] = name
                            del outstanding[(h, t, q, cid)]
                            break
                    if "for" in n:
                        break
        frames.append(frame)
    return Decode(frames, list(flows.values()), total, other, bad)


def _track_cm(frame: Frame, pending_req, qp_qid, peer_qp) -> None:
    cm = frame.cm
    if cm["msg"] == "REQ" and "qpn" in cm:
        pending_req[(frame.src, cm["local_comm_id"])] = {"qpn": cm["qpn"], "qid": cm.get("qid")}
        if cm.get("qid") is not None:
            qp_qid[(frame.src, cm["qpn"])] = cm["qid"]
    elif cm["msg"] == "REP" and "qpn" in cm:
        req = pending_req.pop((frame.dst, cm.get("remote_comm_id")), None)
        if req is not None:
            peer_qp[(frame.src, cm["qpn"])] = req["qpn"]
            if req["qid"] is not None:
                qp_qid[(frame.src, cm["qpn"])] = req["qid"]
