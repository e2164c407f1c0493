"""Golden bytes for every wire structure: the expected bytes are written out by hand
from docs/protocol.md and the NVMe specifications (offsets in the comments), not produced by the code under test."""
import struct
import uuid

import pytest

from nvmeof_roce.nvme import admin, cm, fabrics, identify, log, nvm, status
from nvmeof_roce.nvme.command import CQE, SQE
from nvmeof_roce.nvme.sgl import SglDescriptor


def hexbytes(s: str) -> bytes:
    return bytes.fromhex("".join(s.split()))


def at(buf: bytes, offset: int, expected: bytes) -> None:
    assert buf[offset:offset + len(expected)] == expected, f"at offset {offset}"


# ---------------------------------------------------------------------------- SGL

def test_keyed_sgl_golden():
    d = SglDescriptor.keyed(addr=0x1122334455667788, length=0x012345, key=0xAABBCCDD)
    golden = hexbytes("88 77 66 55 44 33 22 11"  # ADDR LE64
                      "45 23 01"  # LENGTH 24-bit LE
                      "DD CC BB AA"  # KEY LE32
                      "40")  # type 4, subtype 0
    assert d.pack() == golden
    back = SglDescriptor.unpack(golden)
    assert (back.addr, back.length, back.key, back.sgl_id) == (0x1122334455667788, 0x012345, 0xAABBCCDD, 0x40)
    inv = SglDescriptor.keyed(0, 4096, 7, invalidate=True).pack()
    assert inv == hexbytes("00" * 8 + "00 10 00" + "07 00 00 00" + "4F")


def test_in_capsule_sgl_golden():
    d = SglDescriptor.in_capsule(length=4096, offset=0)
    golden = hexbytes("00" * 8 + "00 10 00 00" + "00 00 00" + "01")
    assert d.pack() == golden
    back = SglDescriptor.unpack(hexbytes("10 00 00 00 00 00 00 00" "00 02 00 00" "00 00 00" "01"))
    assert (back.addr, back.length, back.type, back.subtype) == (16, 512, 0, 1)


def test_sgl_rejects_oversize_keyed_length():
    with pytest.raises(ValueError):
        SglDescriptor.keyed(0, 1 << 24, 1)


# ---------------------------------------------------------------------------- SQE / CQE

def test_sqe_golden_layout():
    sqe = SQE(opc=0x02, flags=0x40, cid=0xBEEF, nsid=0x01020304, cdw2=0x11111111, cdw3=0x22222222,
              mptr=0x3333333333333333, sgl=SglDescriptor.keyed(0x1000, 512, 0x55), cdw10=0xA0A0A0A0,
              cdw11=0xA1A1A1A1, cdw12=0xA2A2A2A2, cdw13=0xA3A3A3A3, cdw14=0xA4A4A4A4, cdw15=0xA5A5A5A5)
    golden = hexbytes(
        "02 40 EF BE"  # 0 OPC, 1 FLAGS, 2 CID
        "04 03 02 01"  # 4 NSID
        "11 11 11 11 22 22 22 22"  # 8 CDW2, CDW3
        "33 33 33 33 33 33 33 33"  # 16 MPTR
        "00 10 00 00 00 00 00 00 00 02 00 55 00 00 00 40"  # 24 SGL1
        "A0 A0 A0 A0 A1 A1 A1 A1 A2 A2 A2 A2 A3 A3 A3 A3 A4 A4 A4 A4 A5 A5 A5 A5")  # 40 CDW10..15
    assert sqe.pack() == golden
    assert SQE.unpack(golden) == sqe


def test_cqe_golden_status_shifted():
    cqe = CQE(result=0x00000007, dw1=0, sqhd=5, sqid=1, cid=0x1234, status=status.LBA_RANGE | status.DNR)
    # status code 0x4080 -> wire 0x8100 (code << 1)
    golden = hexbytes("07 00 00 00" "00 00 00 00" "05 00" "01 00" "34 12" "00 81")
    assert cqe.pack() == golden
    back = CQE.unpack(golden)
    assert back.status == 0x4080 and back.cid == 0x1234 and back.sqid == 1


def test_cqe_result64():
    cqe = CQE.unpack(hexbytes("FF 00 00 00 01 00 00 00 00 00 00 00 00 00 00 00"))
    assert cqe.result64 == 0x1000000FF


def test_status_names_and_wire():
    assert status.to_wire(status.CONNECT_INVALID_HOST | status.DNR) == 0x8308
    assert status.from_wire(0x8308) == 0x4184
    assert status.status_name(0x4184) == "Connect Invalid Host"
    assert status.status_name(0x000B) == "Invalid Namespace or Format"
    assert "DNR" in status.describe(0x4002)
    err = status.NvmeStatusError(0x4080, "Read")
    assert err.code == 0x080 and err.dnr and "LBA Out of Range" in str(err)


# ---------------------------------------------------------------------------- fabrics

def test_connect_command_golden():
    cmd = fabrics.ConnectCommand(cid=0x000A, qid=3, sqsize=127, kato=5000, cattr=0,
                                 sgl=SglDescriptor.in_capsule(1024))
    golden = bytearray(64)
    golden[0:4] = hexbytes("7F 40 0A 00")  # OPC, FLAGS, CID
    golden[4] = 0x01  # FCTYPE connect
    golden[24:40] = hexbytes("00" * 8 + "00 04 00 00" + "00 00 00" + "01")
    golden[40:42] = hexbytes("00 00")  # RECFMT
    golden[42:44] = hexbytes("03 00")  # QID
    golden[44:46] = hexbytes("7F 00")  # SQSIZE
    golden[46] = 0  # CATTR
    golden[48:52] = hexbytes("88 13 00 00")  # KATO 5000 ms
    assert cmd.pack() == bytes(golden)
    assert fabrics.ConnectCommand.unpack(bytes(golden)) == cmd


def test_connect_data_golden():
    hostid = uuid.UUID("00112233-4455-6677-8899-aabbccddeeff").bytes
    data = fabrics.ConnectData(hostid=hostid, cntlid=0xFFFF, subnqn="nqn.2014-08.org.example:a",
                               hostnqn="nqn.2014-08.org.example:host")
    raw = data.pack()
    assert len(raw) == 1024
    at(raw, 0, hexbytes("00112233445566778899aabbccddeeff"))
    at(raw, 16, hexbytes("FF FF"))
    assert raw[18:256] == bytes(238)
    at(raw, 256, b"nqn.2014-08.org.example:a\0")
    assert raw[256 + 25:512] == bytes(256 - 25)
    at(raw, 512, b"nqn.2014-08.org.example:host\0")
    assert raw[768:] == bytes(256)
    assert fabrics.ConnectData.unpack(raw) == data


def test_property_get_set_golden():
    get = fabrics.PropertyGet(cid=1, offset=fabrics.PROP_CAP, size8=True).pack()
    golden = bytearray(64)
    golden[0:4] = hexbytes("7F 40 01 00")
    golden[4] = 0x04  # FCTYPE property get
    golden[24:40] = hexbytes("00" * 15 + "40")  # keyed, no data
    golden[40] = 1  # ATTRIB: 8 bytes
    golden[44:48] = hexbytes("00 00 00 00")  # OFFSET CAP
    assert get == bytes(golden)

    put = fabrics.PropertySet(cid=2, offset=fabrics.PROP_CC, value=0x00460001).pack()
    golden = bytearray(64)
    golden[0:4] = hexbytes("7F 40 02 00")
    golden[4] = 0x00  # FCTYPE property set
    golden[24:40] = hexbytes("00" * 15 + "40")
    golden[40] = 0  # 4 bytes
    golden[44:48] = hexbytes("14 00 00 00")  # CC
    golden[48:56] = hexbytes("01 00 46 00 00 00 00 00")
    assert put == bytes(golden)
    assert fabrics.PropertySet.unpack(put).value == 0x00460001


def test_disconnect_golden():
    raw = fabrics.DisconnectCommand(cid=9).pack()
    assert raw[0:5] == hexbytes("7F 40 09 00 08") and raw[40:42] == b"\0\0"


def test_cc_constants_match_linux():
    assert fabrics.CC_DEFAULT == 0x00460000
    assert fabrics.CC_DEFAULT | fabrics.CC_EN == 0x00460001
    assert fabrics.CC_SHN_NORMAL == 0x4000
    assert fabrics.CSTS_SHST_COMPLETE == 0x8
    cap = fabrics.make_cap(127)
    assert cap == 0x20_0F00_007F  # MQES 127, TO 15, CSS bit 37
    assert fabrics.make_version(1, 3) == 0x00010300


# ---------------------------------------------------------------------------- admin

def test_identify_command_golden():
    raw = admin.IdentifyCommand(cid=3, cns=admin.CNS_NS_DESC_LIST, nsid=7, cntid=0x12, csi=0,
                                sgl=SglDescriptor.keyed(0x2000, 4096, 0x99)).pack()
    golden = bytearray(64)
    golden[0:4] = hexbytes("06 40 03 00")
    golden[4:8] = hexbytes("07 00 00 00")
    golden[24:40] = hexbytes("00 20 00 00 00 00 00 00" "00 10 00" "99 00 00 00" "40")
    golden[40] = 0x03  # CNS
    golden[42:44] = hexbytes("12 00")  # CNTID
    assert raw == bytes(golden)


def test_get_log_page_golden():
    cmd = admin.GetLogPageCommand(cid=4, lid=admin.LID_DISCOVERY, numd=0x3FF, nsid=0, lpo=1024, rae=True,
                                  sgl=SglDescriptor.keyed(0, 4096, 1))
    raw = cmd.pack()
    at(raw, 0, hexbytes("02 40 04 00"))
    at(raw, 40, hexbytes("70"))  # LID
    at(raw, 41, hexbytes("80"))  # LSP 0, RAE bit 7
    at(raw, 42, hexbytes("FF 03"))  # NUMDL
    at(raw, 44, hexbytes("00 00"))  # NUMDU
    at(raw, 48, hexbytes("00 04 00 00 00 00 00 00"))  # LPO
    back = admin.GetLogPageCommand.unpack(raw)
    assert back.length == 4096 and back.lpo == 1024 and back.rae


def test_get_log_page_large_numd_and_csi():
    raw = admin.GetLogPageCommand(lid=2, numd=0x12345, csi=0x5).pack()
    at(raw, 42, hexbytes("45 23"))
    at(raw, 44, hexbytes("01 00"))
    at(raw, 59, hexbytes("05"))


def test_features_keepalive_aer_golden():
    raw = admin.SetFeaturesCommand(cid=5, fid=admin.FEAT_NUM_QUEUES, value=0x00030003).pack()
    at(raw, 0, hexbytes("09 40 05 00"))
    at(raw, 40, hexbytes("07 00 00 00"))
    at(raw, 44, hexbytes("03 00 03 00"))
    raw = admin.GetFeaturesCommand(cid=6, fid=admin.FEAT_KATO, select=0).pack()
    at(raw, 0, hexbytes("0A 40 06 00"))
    at(raw, 40, hexbytes("0F 00 00 00"))
    assert admin.KeepAliveCommand(cid=7).pack() == hexbytes("18 40 07 00") + bytes(20) + hexbytes(
        "00" * 15 + "40") + bytes(24)
    assert admin.AsyncEventRequestCommand(cid=31).pack()[0:4] == hexbytes("0C 40 1F 00")
    assert admin.aer_result(admin.AER_TYPE_NOTICE, admin.AER_NOTICE_NS_CHANGED, admin.LID_CHANGED_NS) == 0x040002


# ---------------------------------------------------------------------------- identify data

def test_identify_controller_golden_offsets():
    idc = identify.IdentifyController(
        vid=0x1B36, sn="SN1", mn="Model", fr="0.1", rab=6, cmic=3, mdts=8, cntlid=0x21, ver=0x00010300,
        oaes=0x100, ctratt=0x41, cntrltype=1, acl=3, aerl=3, frmw=3, lpa=7, elpe=63, kas=10, sqes=0x66,
        cqes=0x44, maxcmd=128, nn=1024, oncs=0x0C, vwc=1, sgls=0x00100005, subnqn="nqn.2014-08.org.example:s",
        ioccsz=260, iorcsz=1, icdoff=0, msdbd=1, psd0_max_power=0x09C4, psd0_entry_lat=0x10, psd0_exit_lat=4)
    raw = idc.pack()
    assert len(raw) == 4096
    at(raw, 0, hexbytes("36 1B"))
    at(raw, 4, b"SN1" + b" " * 17)
    at(raw, 24, b"Model" + b" " * 35)
    at(raw, 64, b"0.1     ")
    at(raw, 72, hexbytes("06"))
    at(raw, 76, hexbytes("03 08 21 00"))  # CMIC, MDTS, CNTLID
    at(raw, 80, hexbytes("00 03 01 00"))  # VER 1.3
    at(raw, 92, hexbytes("00 01 00 00"))  # OAES
    at(raw, 96, hexbytes("41 00 00 00"))  # CTRATT
    at(raw, 111, hexbytes("01"))  # CNTRLTYPE
    at(raw, 258, hexbytes("03 03 03 07 3F"))  # ACL AERL FRMW LPA ELPE
    at(raw, 320, hexbytes("0A 00"))  # KAS
    at(raw, 512, hexbytes("66 44 80 00"))  # SQES CQES MAXCMD
    at(raw, 516, hexbytes("00 04 00 00"))  # NN
    at(raw, 520, hexbytes("0C 00"))  # ONCS
    at(raw, 525, hexbytes("01"))  # VWC
    at(raw, 536, hexbytes("05 00 10 00"))  # SGLS
    at(raw, 768, b"nqn.2014-08.org.example:s\0")
    at(raw, 1792, hexbytes("04 01 00 00" "01 00 00 00" "00 00" "00" "01"))  # IOCCSZ IORCSZ ICDOFF FCATT MSDBD
    at(raw, 2048, hexbytes("C4 09"))
    at(raw, 2052, hexbytes("10 00 00 00 04 00 00 00"))
    assert identify.IdentifyController.unpack(raw) == idc


def test_identify_namespace_golden():
    ns = identify.IdentifyNamespace(nsze=0x1000, ncap=0x1000, nuse=0x1000, nmic=1, lbaf0_lbads=12,
                                    nguid=bytes(range(16)), eui64=bytes(range(8, 16)))
    raw = ns.pack()
    at(raw, 0, hexbytes("00 10 00 00 00 00 00 00") * 3)
    at(raw, 25, hexbytes("00 00"))  # NLBAF, FLBAS
    at(raw, 30, hexbytes("01"))
    at(raw, 104, bytes(range(16)))
    at(raw, 120, bytes(range(8, 16)))
    at(raw, 128, hexbytes("00 00 0C 00"))  # LBAF0: MS 0, LBADS 12
    back = identify.IdentifyNamespace.unpack(raw)
    assert back == ns and back.block_size == 4096


def test_active_ns_list_and_descriptors_golden():
    raw = identify.ActiveNamespaceList([1, 2, 0x10]).pack()
    assert raw[:16] == hexbytes("01 00 00 00 02 00 00 00 10 00 00 00 00 00 00 00") and len(raw) == 4096
    assert identify.ActiveNamespaceList.unpack(raw).nsids == [1, 2, 16]
    u = uuid.UUID("12345678-9abc-def0-1234-56789abcdef0").bytes
    dl = identify.NsDescriptorList([identify.NsDescriptor(identify.NIDT_UUID, u),
                                    identify.NsDescriptor(identify.NIDT_CSI, b"\0")])
    raw = dl.pack()
    at(raw, 0, hexbytes("03 10 00 00") + u)
    at(raw, 20, hexbytes("04 01 00 00 00"))
    assert raw[25:] == bytes(4096 - 25)
    assert identify.NsDescriptorList.unpack(raw).find(identify.NIDT_UUID) == u


# ---------------------------------------------------------------------------- logs

def test_error_log_entry_golden():
    e = log.ErrorLogEntry(error_count=2, sqid=1, cid=0x10, status=0x4080, param_location=0x28, lba=0x55,
                          nsid=1)
    raw = e.pack()
    golden = hexbytes("02 00 00 00 00 00 00 00" "01 00" "10 00" "00 81" "28 00"
                      "55 00 00 00 00 00 00 00" "01 00 00 00" "00 000000") + bytes(8 + 24)
    assert raw == golden
    assert log.ErrorLogEntry.unpack(raw) == e


def test_smart_log_golden():
    raw = log.SmartLog(temperature=300, avail_spare=100, data_units_read=3, host_writes=(1 << 70)).pack()
    assert len(raw) == 512
    at(raw, 0, hexbytes("00 2C 01 64 00 00"))
    at(raw, 32, hexbytes("03" + "00" * 15))
    at(raw, 80, hexbytes("00" * 8 + "40" + "00" * 7))


def test_changed_ns_list_golden():
    raw = log.ChangedNsList([5, 9]).pack()
    assert raw[:12] == hexbytes("05 00 00 00 09 00 00 00 00 00 00 00") and len(raw) == 4096
    over = log.ChangedNsList(list(range(1, 1100))).pack()
    assert over[:8] == hexbytes("FF FF FF FF 00 00 00 00")


def test_effects_log_golden():
    raw = log.CommandEffectsLog(admin={0x06: 1}, io={0x01: 3}).pack()
    at(raw, 0x06 * 4, hexbytes("01 00 00 00"))
    at(raw, 1024 + 0x01 * 4, hexbytes("03 00 00 00"))
    assert raw.count(0) == 4096 - 2


def test_discovery_log_golden():
    hdr = log.DiscoveryLogHeader(genctr=7, numrec=2).pack()
    assert hdr[:18] == hexbytes("07 00 00 00 00 00 00 00" "02 00 00 00 00 00 00 00" "00 00") and len(hdr) == 1024
    e = log.DiscoveryLogEntry(trtype=1, adrfam=1, subtype=2, treq=0, portid=1, cntlid=0xFFFF, asqsz=32,
                              trsvcid="4420", subnqn="nqn.2014-08.org.example:s", traddr="10.99.0.1")
    raw = e.pack()
    assert len(raw) == 1024
    at(raw, 0, hexbytes("01 01 02 00" "01 00" "FF FF" "20 00" "00 00"))
    at(raw, 32, b"4420\0")
    at(raw, 256, b"nqn.2014-08.org.example:s\0")
    at(raw, 512, b"10.99.0.1\0")
    at(raw, 768, hexbytes("01 01 01 00 00 00 00 00 00 00"))  # TSAS RDMA: QPTYPE PRTYPE CMS, rsvd, PKEY
    assert log.DiscoveryLogEntry.unpack(raw) == e


# ---------------------------------------------------------------------------- NVM

def test_read_write_golden():
    raw = nvm.write_command(cid=0x21, nsid=1, slba=0x1_0000_0002, nlb=7, control=nvm.CONTROL_FUA,
                            sgl=SglDescriptor.keyed(0x4000, 4096, 0x77)).pack()
    golden = bytearray(64)
    golden[0:4] = hexbytes("01 40 21 00")
    golden[4:8] = hexbytes("01 00 00 00")
    golden[24:40] = hexbytes("00 40 00 00 00 00 00 00" "00 10 00" "77 00 00 00" "40")
    golden[40:48] = hexbytes("02 00 00 00 01 00 00 00")  # SLBA
    golden[48:50] = hexbytes("07 00")  # NLB
    golden[50:52] = hexbytes("00 40")  # control: FUA bit 14
    assert raw == bytes(golden)
    back = nvm.ReadWriteCommand.unpack(raw)
    assert back.slba == 0x1_0000_0002 and back.blocks == 8 and back.control == nvm.CONTROL_FUA


def test_flush_write_zeroes_dsm_golden():
    assert nvm.FlushCommand(cid=1, nsid=2).pack()[:8] == hexbytes("00 40 01 00 02 00 00 00")
    wz = nvm.write_zeroes_command(cid=2, nsid=1, slba=16, nlb=15).pack()
    at(wz, 0, hexbytes("08 40 02 00"))
    at(wz, 40, hexbytes("10 00 00 00 00 00 00 00 0F 00"))
    dsm = nvm.DsmCommand(cid=3, nsid=1, nr=1, attributes=nvm.DSM_AD,
                         sgl=SglDescriptor.keyed(0x100, 4096, 5)).pack()
    at(dsm, 0, hexbytes("09 40 03 00"))
    at(dsm, 40, hexbytes("01 00 00 00" "04 00 00 00"))
    rng = nvm.DsmRange(slba=0x20, nlb=8).pack()
    assert rng == hexbytes("00 00 00 00" "08 00 00 00" "20 00 00 00 00 00 00 00")
    assert nvm.unpack_dsm_ranges(rng * 2, 2)[1] == nvm.DsmRange(0x20, 8)


# ---------------------------------------------------------------------------- CM private data

def test_cm_connect_request_golden():
    req = cm.CmConnectRequest(recfmt=0, qid=2, hrqsize=128, hsqsize=127, cntlid=0x11)
    golden = hexbytes("00 00" "02 00" "80 00" "7F 00" "11 00") + bytes(22)
    assert req.pack() == golden
    # RoCE delivers 56 bytes, zero padded: only the first 10 count
    assert cm.CmConnectRequest.unpack(golden + bytes(24)) == req
    with pytest.raises(cm.PrivateDataError) as exc:
        cm.CmConnectRequest.unpack(b"")
    assert exc.value.sts == cm.STS_INVALID_LEN


def test_cm_accept_and_reject_golden():
    assert cm.CmAccept(crqsize=32).pack() == hexbytes("00 00 20 00") + bytes(28)
    assert cm.CmReject(sts=cm.STS_NO_RESOURCES).pack() == hexbytes("00 00 06 00")
    # a REJECTED event carries 148 bytes: the 4 first, then zeros
    assert cm.CmReject.unpack(hexbytes("00 00 04 00") + bytes(144)).sts == cm.STS_INVALID_HSQSIZE
    assert cm.CmAccept.unpack(hexbytes("00 00 80 00") + bytes(192)).crqsize == 128
    assert struct.calcsize("<HH") == cm.REJECT_SIZE
