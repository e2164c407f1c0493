"""`nvmeof-roce rdma decode`: pcap/pcapng reading and RoCE v2 frame decoding.

The frames are built here byte by byte from the IBTA layouts (BTH 12 bytes, RETH 16, AETH 4, IETH 4) and the
NVMe-oF capsule layouts, independently of the decoder, then written into pcap files."""
import json
import struct
import subprocess
import sys

import pytest

from nvmeof_roce.errors import NvmeofError
from nvmeof_roce.capture import pcap, roce

HOST, TARGET = "10.99.1.2", "10.99.1.1"
HOST_QP, TARGET_QP = 0x11, 0x12


def ip4(addr):
    return bytes(int(x) for x in addr.split("."))


def frame(src, dst, opcode, qp, psn, ext=b"", payload=b"", ack=False, pad=0, fix_icrc=True):
    """Ethernet | IPv4 | UDP 4791 | BTH | ext | payload | pad | ICRC."""
    bth = struct.pack("!BBHII", opcode, (pad << 4), 0xFFFF, qp & 0xFFFFFF, (ack << 31) | psn)
    ib = bth + ext + payload + b"\0" * pad
    udp_len = 8 + len(ib) + 4
    total = 20 + udp_len
    iph = struct.pack("!BBHHHBBH4s4s", 0x45, 0x02, total, 0, 0x4000, 64, 17, 0, ip4(src), ip4(dst))
    udp = struct.pack("!HHHH", 49152, 4791, udp_len, 0)
    body = iph + udp + ib
    crc = roce.icrc(body, ipv6=False) if fix_icrc else 0xDEADBEEF
    eth = b"\x52\x54\x00\x00\x00\x02" + b"\x52\x54\x00\x00\x00\x01" + b"\x08\x00"
    return eth + body + struct.pack("<I", crc)


def reth(va, rkey, length):
    return struct.pack("!QII", va, rkey, length)


def aeth(syndrome, msn):
    return struct.pack("!I", (syndrome << 24) | msn)


def sqe(opc, cid, nsid=0, sgl_addr=0, sgl_word=0, cdw10=0, cdw11=0, cdw12=0):
    return struct.pack("<BBHIIIQQQ6I", opc, 0x40, cid, nsid, 0, 0, 0, sgl_addr, sgl_word,
                       cdw10, cdw11, cdw12, 0, 0, 0)


def keyed(addr, length, key, invalidate=False):
    return addr, length | (key << 24) | ((0x4F if invalidate else 0x40) << 56)


def cqe(cid, status=0, sqhd=1):
    return struct.pack("<IIHHHH", 0, 0, sqhd, 1, cid, status << 1)


def cm_mad(attr, body):
    hdr = struct.pack("!BBBBHHQHHI", 1, 0x07, 2, 0x03, 0, 0, 0x1234, attr, 0, 0)
    return hdr + body.ljust(232, b"\0")


def cm_req(comm_id, qpn, qid, port=4421):
    msg = bytearray(232)
    struct.pack_into("!I", msg, 0, comm_id)
    struct.pack_into("!Q", msg, 8, 0x0106 << 16 | port)  # service ID: RDMA_PS_TCP, port
    struct.pack_into("!I", msg, 32, qpn << 8)
    # private data: rdma_cm's header (version 0, IPv4, source port, ::ffff-less IPv4 in the last 4 of 16 bytes)
    struct.pack_into("!BBH12x4s12x4s", msg, 140, 0, 0x40, 0xABCD, ip4(HOST), ip4(TARGET))
    struct.pack_into("<HHHH", msg, 176, 0, qid, 128, 127)  # then NVMe-oF's: RECFMT QID HRQSIZE HSQSIZE
    return cm_mad(0x0010, bytes(msg))


def cm_rep(comm_id, remote_comm_id, qpn):
    msg = bytearray(232)
    struct.pack_into("!II", msg, 0, comm_id, remote_comm_id)
    struct.pack_into("!I", msg, 12, qpn << 8)
    struct.pack_into("<HH", msg, 36, 0, 128)
    return cm_mad(0x0013, bytes(msg))


def ud(src, dst, psn, mad):
    return frame(src, dst, 0x64, 1, psn, struct.pack("!II", 0x80010000, 1), mad)


def nvme_exchange():
    """CM connect of I/O queue 1, a 4 KiB read (RDMA WRITE + SEND with Invalidate) and a 4 KiB write
    (RDMA READ), in the order the wire carries them."""
    data = bytes(range(256)) * 16
    return [
        ud(HOST, TARGET, 0, cm_req(0xAAAA, HOST_QP, 1)),
        ud(TARGET, HOST, 0, cm_rep(0xBBBB, 0xAAAA, TARGET_QP)),
        # read: capsule, data by RDMA WRITE (4 packets at MTU 1024), response SEND with Invalidate
        frame(HOST, TARGET, 0x04, TARGET_QP, 100, payload=sqe(0x02, 7, 1, *keyed(0x7f00_0000_1000, 4096, 0x1234, True),
                                                              cdw10=8, cdw12=7)),
        frame(TARGET, HOST, 0x11, HOST_QP, 100, aeth(0x1F, 1)),
        frame(TARGET, HOST, 0x06, HOST_QP, 500, reth(0x7f00_0000_1000, 0x1234, 4096), data[:1024]),
        frame(TARGET, HOST, 0x07, HOST_QP, 501, payload=data[1024:2048]),
        frame(TARGET, HOST, 0x07, HOST_QP, 502, payload=data[2048:3072]),
        frame(TARGET, HOST, 0x08, HOST_QP, 503, payload=data[3072:], ack=True),
        frame(TARGET, HOST, 0x17, HOST_QP, 504, struct.pack("!I", 0x1234), cqe(7), ack=True),
        frame(HOST, TARGET, 0x11, TARGET_QP, 504, aeth(0x1F, 2)),
        # write: capsule with a keyed SGL, the target RDMA READs it, then responds
        frame(HOST, TARGET, 0x04, TARGET_QP, 101, payload=sqe(0x01, 8, 1, *keyed(0x7f00_0000_2000, 4096, 0x5678),
                                                              cdw10=16, cdw12=7)),
        frame(TARGET, HOST, 0x0C, HOST_QP, 505, reth(0x7f00_0000_2000, 0x5678, 4096), ack=True),
        frame(HOST, TARGET, 0x0D, TARGET_QP, 505, aeth(0x1F, 3), data[:1024]),
        frame(HOST, TARGET, 0x0E, TARGET_QP, 506, payload=data[1024:2048]),
        frame(HOST, TARGET, 0x0E, TARGET_QP, 507, payload=data[2048:3072]),
        frame(HOST, TARGET, 0x0F, TARGET_QP, 508, aeth(0x1F, 3), data[3072:]),
        frame(TARGET, HOST, 0x04, HOST_QP, 509, payload=cqe(8, sqhd=2), ack=True),
        # a 512-byte write with in-capsule data (data block SGL, offset 0)
        frame(HOST, TARGET, 0x04, TARGET_QP, 102, payload=sqe(0x01, 9, 1, 0, 512 | (0x01 << 56), cdw10=24)
              + b"\xab" * 512, pad=0),
        frame(TARGET, HOST, 0x04, HOST_QP, 510, payload=cqe(9, status=0x80 | 0x4000, sqhd=3), ack=True),
    ]


def write(tmp_path, frames, name="c.pcap"):
    path = tmp_path / name
    path.write_bytes(pcap.write_pcap([(1000.0 + i * 0.001, f) for i, f in enumerate(frames)]))
    return path


def test_decode_nvme_read_and_write_in_order(tmp_path):
    d = roce.decode(pcap.read_packets(write(tmp_path, nvme_exchange()).read_bytes()))
    assert d.packets == 19 and len(d.frames) == 19 and d.other == 0 and d.bad_icrc == 0
    f = d.frames
    assert f[0].cm["msg"] == "REQ" and f[0].cm["qid"] == 1 and f[0].cm["qpn"] == HOST_QP and f[0].cm["port"] == 4421
    assert (f[0].cm["hrqsize"], f[0].cm["hsqsize"]) == (128, 127)
    assert f[1].cm["msg"] == "REP" and f[1].cm["qpn"] == TARGET_QP and f[1].cm["crqsize"] == 128
    read = f[2].nvme
    assert f[2].opname == "SEND Only" and f[2].dest_qp == TARGET_QP and f[2].psn == 100
    assert read["name"] == "Read" and read["cid"] == 7 and read["nsid"] == 1 and read["qid"] == 1
    assert read["sgl"] == {"type": "keyed", "addr": 0x7f00_0000_1000, "length": 4096, "key": 0x1234,
                           "invalidate": True}
    assert read["slba"] == 8 and read["nlb"] == 8
    assert f[3].aeth == {"type": "ACK", "credits": 31, "syndrome": 0x1F, "msn": 1}
    assert f[4].opname == "RDMA WRITE First" and f[4].reth == {"va": 0x7f00_0000_1000, "rkey": 0x1234, "length": 4096}
    assert f[4].payload_len == 1024 and f[7].opname == "RDMA WRITE Last" and f[7].ack_req
    assert f[8].opname == "SEND Only with Invalidate" and f[8].invalidate_rkey == 0x1234
    assert f[8].nvme["kind"] == "response" and f[8].nvme["cid"] == 7 and f[8].nvme["status_name"] == "Success"
    assert f[8].nvme["for"] == "Read"
    write_cmd = f[10].nvme
    assert write_cmd["name"] == "Write" and write_cmd["sgl"]["key"] == 0x5678 and not write_cmd["sgl"]["invalidate"]
    assert f[11].opname == "RDMA READ Request" and f[11].reth["rkey"] == 0x5678 and f[11].reth["length"] == 4096
    assert [x.opname for x in f[12:16]] == ["RDMA READ Response First", "RDMA READ Response Middle",
                                          "RDMA READ Response Middle", "RDMA READ Response Last"]
    assert f[16].nvme["for"] == "Write" and f[16].invalidate_rkey is None
    inline = f[17].nvme
    assert inline["sgl"] == {"type": "in-capsule", "addr": 0, "length": 512} and inline["in_capsule_bytes"] == 512
    assert f[18].nvme["status_name"] == "LBA Out of Range (0x80, DNR)"
    assert all(x.icrc["ok"] for x in f) and not any(x.retransmit for x in f)
    flows = {(x.src, x.dest_qp): x for x in d.flows}
    assert flows[(HOST, TARGET_QP)].qid == 1 and flows[(HOST, TARGET_QP)].naks == 0
    assert flows[(TARGET, HOST_QP)].frames == 9 and flows[(TARGET, HOST_QP)].qid == 1


def test_nak_rnr_and_retransmission_counted_per_flow(tmp_path):
    frames = [
        frame(HOST, TARGET, 0x04, TARGET_QP, 10, payload=b"x" * 64),
        frame(HOST, TARGET, 0x04, TARGET_QP, 12, payload=b"x" * 64),   # 11 was lost on the wire
        frame(TARGET, HOST, 0x11, HOST_QP, 10, aeth(0x60, 5)),            # NAK PSN sequence error, expect 11
        frame(HOST, TARGET, 0x04, TARGET_QP, 11, payload=b"x" * 64),   # go-back-N: 11 and 12 again
        frame(HOST, TARGET, 0x04, TARGET_QP, 12, payload=b"x" * 64),
        frame(TARGET, HOST, 0x11, HOST_QP, 12, aeth(0x2E, 6)),            # RNR NAK, timer 14
        frame(TARGET, HOST, 0x11, HOST_QP, 12, aeth(0x62, 6)),            # NAK remote access error
        frame(HOST, TARGET, 0x04, TARGET_QP, 13, payload=b"x" * 64),
    ]
    d = roce.decode(pcap.read_packets(write(tmp_path, frames).read_bytes()))
    assert [x.retransmit for x in d.frames] == [False, False, False, True, True, False, False, False]
    assert d.frames[2].aeth["type"] == "NAK" and d.frames[2].aeth["reason"] == "PSN Sequence Error"
    assert d.frames[5].aeth == {"type": "RNR NAK", "timer": 14, "syndrome": 0x2E, "msn": 6}
    host_flow = next(x for x in d.flows if x.src == HOST)
    target_flow = next(x for x in d.flows if x.src == TARGET)
    assert host_flow.retransmitted == [11, 12] and host_flow.frames == 5
    assert target_flow.naks == 2 and target_flow.rnr_naks == 1
    assert target_flow.nak_reasons == {"PSN Sequence Error": 1, "Remote Access Error": 1}


def test_psn_wraps_at_24_bits():
    assert roce.psn_after(0, 0xFFFFFF) and not roce.psn_after(0xFFFFFF, 0) and not roce.psn_after(5, 5)


def test_bad_icrc_and_cut_frames_and_other_traffic():
    good = frame(HOST, TARGET, 0x04, TARGET_QP, 1, payload=cqe(1))
    bad = frame(HOST, TARGET, 0x04, TARGET_QP, 2, payload=cqe(2), fix_icrc=False)
    arp = b"\xff" * 6 + b"\x52\x54\x00\x00\x00\x01" + b"\x08\x06" + b"\0" * 28
    cut = frame(HOST, TARGET, 0x0A, TARGET_QP, 3, reth(0x1000, 0x99, 2048), b"d" * 2048)[:14 + 20 + 8 + 12 + 16 + 10]
    d = roce.decode(pcap.read_packets(pcap.write_pcap([(1.0, good), (1.1, bad), (1.2, arp), (1.3, cut)])))
    assert d.packets == 4 and d.other == 1 and d.bad_icrc == 1
    assert d.frames[0].icrc["ok"] and not d.frames[1].icrc["ok"]
    assert d.frames[2].icrc is None and d.frames[2].reth == {"va": 0x1000, "rkey": 0x99, "length": 2048}
    assert "BAD ICRC" in d.frames[1].line() and "ICRC not captured" in d.frames[2].line()


def test_pcapng_big_endian_nanoseconds_and_vlan(tmp_path):
    f = frame(HOST, TARGET, 0x04, TARGET_QP, 42, payload=sqe(0x18, 3))
    tagged = f[:12] + b"\x81\x00\x00\x05" + f[12:]

    def block(btype, body):
        body = body + b"\0" * (-len(body) % 4)
        return struct.pack(">II", btype, len(body) + 12) + body + struct.pack(">I", len(body) + 12)
    shb = block(0x0A0D0D0A, struct.pack(">IHHq", 0x1A2B3C4D, 1, 0, -1))
    idb = block(1, struct.pack(">HHI", 1, 0, 0) + struct.pack(">HHB3x", 9, 1, 9) + struct.pack(">HH", 0, 0))
    ts = 1_700_000_000_123_456_789
    epb = block(6, struct.pack(">IIIII", 0, ts >> 32, ts & 0xFFFFFFFF, len(tagged), len(tagged)) + tagged)
    packets = list(pcap.read_packets(shb + idb + epb))
    assert len(packets) == 1 and packets[0].time == pytest.approx(1_700_000_000.123456789)
    d = roce.decode(packets)
    assert d.frames[0].psn == 42 and d.frames[0].nvme["cid"] == 3 and d.frames[0].icrc["ok"]
    assert d.frames[0].nvme["name"] == "Keep Alive?"  # no CM seen: the queue is unknown, the guess is marked


def test_not_a_capture_is_named(tmp_path):
    with pytest.raises(NvmeofError, match="x.pcap: unknown file magic"):
        list(pcap.read_packets(b"hello world, not a pcap at all", "x.pcap"))
    with pytest.raises(NvmeofError, match="too short"):
        list(pcap.read_packets(b"\xd4\xc3"))
    r = subprocess.run([sys.executable, "-m", "nvmeof_roce", "rdma", "decode", str(tmp_path / "missing.pcap")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "cannot read" in r.stderr and "missing.pcap" in r.stderr


def test_cli_decode_json_and_summary(tmp_path):
    path = write(tmp_path, nvme_exchange())
    out = subprocess.run([sys.executable, "-m", "nvmeof_roce", "rdma", "decode", str(path), "--json"],
                         capture_output=True, text=True, check=True).stdout
    d = json.loads(out)
    assert d["roce_frames"] == 19 and d["frames"][8]["invalidate_rkey"] == 0x1234
    assert d["frames"][2]["nvme"]["name"] == "Read"
    text = subprocess.run([sys.executable, "-m", "nvmeof_roce", "rdma", "decode", str(path), "--summary"],
                          capture_output=True, text=True, check=True).stdout
    assert "19 RoCE v2 frames" in text and "retransmitted PSNs" in text and "SEND Only" not in text
    full = subprocess.run([sys.executable, "-m", "nvmeof_roce", "rdma", "decode", str(path)],
                          capture_output=True, text=True, check=True).stdout
    assert "NVMe Read cid 7 nsid 0x1 qid 1" in full and "invalidate rkey 0x1234" in full


# Three frames as rxe put them on the lab's wire (tcpdump in the host guest): the capsule of a 4 KiB read, its
# response SEND with Invalidate, and the RDMA READ Request of a 4 KiB write.  Their ICRCs were computed by the
# kernel's rxe, so these check our ICRC against an independent implementation.
REAL_READ_CAPSULE = bytes.fromhex(
    "52540099010152540099010208004500006c9ef24000401184c60a6301020a630101e64012b7005800000400ffff0000001880"
    "7097a9024064000100000000000000000000000000000000000000003001068188ffff0010003c6701004f0008000000000000"
    "0700000000000000000000000000000042f712c7")
REAL_SEND_WITH_INV = bytes.fromhex(
    "52540099010252540099010108004500004066e140004011bd030a6301010a630102e64012b7002c00001700ffff0000001880"
    "f049d20001673c00000000000000000500010064000000f57638fb")
REAL_READ_REQUEST = bytes.fromhex(
    "52540099010252540099010108004500003c681340004011bbd50a6301010a630102ea5212b7002800000c00ffff0000001a80"
    "4227e6ffff8881072bd000000208d800001000e92886c5")


def test_real_rxe_frames():
    d = roce.decode(pcap.read_packets(pcap.write_pcap([(1.0, REAL_READ_CAPSULE), (1.1, REAL_SEND_WITH_INV),
                                                       (1.2, REAL_READ_REQUEST)])))
    cap, resp, read = d.frames
    assert all(f.icrc["ok"] for f in d.frames)
    assert (cap.src, cap.dst, cap.dest_qp, cap.psn, cap.ack_req) == (HOST, TARGET, 0x18, 7378857, True)
    assert cap.nvme["cid"] == 100 and cap.nvme["slba"] == 2048 and cap.nvme["nlb"] == 8
    assert cap.nvme["sgl"] == {"type": "keyed", "addr": 0xffff888106013000, "length": 4096, "key": 0x1673c,
                               "invalidate": True}
    assert resp.opname == "SEND Only with Invalidate" and resp.invalidate_rkey == 0x1673c
    assert resp.nvme["cid"] == 100 and resp.nvme["for"] == "Read?"
    assert read.reth == {"va": 0xffff8881072bd000, "rkey": 0x208d8, "length": 4096} and read.ack_req
    broken = bytearray(REAL_SEND_WITH_INV)
    broken[-20] ^= 1  # one bit of the CQE
    assert not roce.decode_frame(pcap.Packet(1, 0.0, pcap.LINKTYPE_ETHERNET, bytes(broken), len(broken))).icrc["ok"]
    # the variant fields are outside the ICRC: ECN marking by a switch (IP ToS) and the TTL
    marked = bytearray(REAL_SEND_WITH_INV)
    marked[15] |= 0x03
    marked[22] = 17
    assert roce.decode_frame(pcap.Packet(1, 0.0, pcap.LINKTYPE_ETHERNET, bytes(marked), len(marked))).icrc["ok"]


def test_capsule_across_packets_is_marked_continued():
    """64 + 4096 bytes at RoCE MTU 1024: SEND First carries the SQE and the start of the data."""
    capsule = sqe(0x01, 5, 1, 0, 4096 | (0x01 << 56), cdw10=4096, cdw12=7) + b"\xcd" * 4096
    frames = [frame(HOST, TARGET, 0x00, TARGET_QP, 1, payload=capsule[:1024]),
              frame(HOST, TARGET, 0x01, TARGET_QP, 2, payload=capsule[1024:2048]),
              frame(HOST, TARGET, 0x01, TARGET_QP, 3, payload=capsule[2048:3072]),
              frame(HOST, TARGET, 0x01, TARGET_QP, 4, payload=capsule[3072:4096]),
              frame(HOST, TARGET, 0x02, TARGET_QP, 5, payload=capsule[4096:], ack=True)]
    d = roce.decode(pcap.read_packets(pcap.write_pcap([(1.0, f) for f in frames])))
    first = d.frames[0].nvme
    assert first["sgl"] == {"type": "in-capsule", "addr": 0, "length": 4096} and first["continued"]
    assert "in_capsule_bytes" not in first and "(capsule continues)" in d.frames[0].line()
    assert all(f.nvme is None for f in d.frames[1:])  # Middle/Last carry data, not capsules


def test_cm_and_capsules_cut_by_a_short_snap_length():
    """tcpdump -s 160: the REQ loses its private data, the capsule keeps its 64-byte SQE."""
    req = ud(HOST, TARGET, 0, cm_req(0xAAAA, HOST_QP, 1))[:160]
    cap = frame(HOST, TARGET, 0x04, TARGET_QP, 100, payload=sqe(0x02, 7, 1, *keyed(0x1000, 4096, 0x1234, True),
                                                                cdw10=8, cdw12=7) + b"\0" * 200)[:160]
    d = roce.decode(pcap.read_packets(pcap.write_pcap([(1.0, req), (1.1, cap)])))
    assert d.frames[0].cm == {"msg": "REQ", "local_comm_id": 0xAAAA, "port": 4421, "qpn": HOST_QP,
                              "start_psn": 0}
    assert d.frames[1].nvme["cid"] == 7 and d.frames[1].icrc is None
    assert d.frames[1].payload_len == 264 and d.frames[1].nvme["in_capsule_bytes"] == 200  # from the IP length
