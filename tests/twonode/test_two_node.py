"""Two lab guests on a virtual wire, driven from the host: perftest and the kernel host against both targets
across the wire, a decoded capture checked against the userspace target's own log, and a lossy link.

Each scenario is one `nvmeof-roce lab run --nodes 2` whose nodes run tests/twonode/node.py; the checks here
read what the nodes left in the share (results, target log, pcap)."""
import json
import re
from pathlib import Path

import pytest

from lab_nodes import two_nodes
from nvmeof_roce.capture import pcap, roce

pytestmark = pytest.mark.twonode

TARGET_IP, HOST_IP = "10.99.1.1", "10.99.1.2"


@pytest.fixture(scope="module")
def basic(tmp_path_factory):
    share = tmp_path_factory.mktemp("two-node-basic")
    proc, results = two_nodes(share, "basic")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    return share, results


def test_perftest_and_fio_verify_across_the_wire(basic):
    _, r = basic
    perf = r["host"]["perftest"]
    assert perf["iterations"] == 200 and perf["bw_avg_MBps"] > 0
    for target in ("fio_kernel", "fio_userspace"):
        fio = r["host"][target]
        assert fio["error"] == 0 and fio["read_ios"] > 0 and fio["write_ios"] > 0, fio
    assert r["target"]["user_target_exit"] == 0


def wire_log(share: Path):
    """The userspace target's per-QP wire trace: [(qp, qid, event text)]."""
    pat = re.compile(r"qp (0x[0-9a-f]+) qid (\d+): ((?:capsule|RDMA|SEND response) .*)$")
    out = []
    for line in (share / "target.log").read_text().splitlines():
        m = pat.search(line)
        if m:
            out.append((int(m.group(1), 16), int(m.group(2)), m.group(3)))
    return out


def logged_sequence(log, qp, cid, opc):
    """The target's trace for one command: its capsule line and what it posted for it, up to its response."""
    for i, (q, _qid, text) in enumerate(log):
        if q == qp and re.match(rf"capsule \d+ B opc {opc:#04x} cid {cid}$", text):
            seq = [text]
            for q2, _, t2 in log[i + 1:]:
                if q2 != qp:
                    continue
                seq.append(t2)
                if t2.startswith(f"SEND response cid {cid}"):
                    return seq
    raise AssertionError(f"target log has no complete trace of cid {cid} opc {opc:#x} on QP {qp:#x}")


def command_frame(d, name, slba):
    hits = [f for f in d.frames if f.nvme and f.nvme.get("kind") == "command" and f.nvme.get("name") == name
            and f.nvme.get("slba") == slba]
    assert len(hits) == 1, f"{len(hits)} {name} commands at LBA {slba} in the capture"
    return hits[0]


def frames_after(d, start, src, predicate):
    return [f for f in d.frames if f.index > start.index and f.src == src and predicate(f)]


def test_capture_decodes_read_and_writes_as_the_target_logged_them(basic):
    share, _ = basic
    d = roce.decode(pcap.read_packets((share / "io.pcap").read_bytes()))
    assert d.bad_icrc == 0 and len(d.frames) > 20
    log = wire_log(share)
    # CM: the connect requests carried the queue IDs, so each capsule knows its queue
    reqs = [f for f in d.frames if f.cm and f.cm["msg"] == "REQ"]
    assert {f.cm["qid"] for f in reqs} == {0, 1} and all(f.src == HOST_IP for f in reqs)

    # 4 KiB read: capsule (keyed SGL, invalidate) -> RDMA WRITE of 4096 with its rkey -> SEND with Invalidate
    cmd = command_frame(d, "Read", 2048)
    sgl = cmd.nvme["sgl"]
    assert cmd.src == HOST_IP and cmd.nvme["qid"] == 1 and cmd.nvme["nlb"] == 8
    assert sgl["type"] == "keyed" and sgl["length"] == 4096 and sgl["invalidate"]
    seq = logged_sequence(log, cmd.dest_qp, cmd.nvme["cid"], 0x02)
    assert seq[1:] == [f"RDMA WRITE va {sgl['addr']:#x} rkey {sgl['key']:#x} len 4096",
                       f"SEND response cid {cmd.nvme['cid']} with invalidate rkey {sgl['key']:#x}"]
    writes = frames_after(d, cmd, TARGET_IP, lambda f: f.reth is not None and f.opname.startswith("RDMA WRITE"))
    resp = frames_after(d, cmd, TARGET_IP, lambda f: f.nvme and f.nvme.get("cid") == cmd.nvme["cid"]
                        and f.nvme["kind"] == "response")[0]
    assert writes[0].reth == {"va": sgl["addr"], "rkey": sgl["key"], "length": 4096}
    assert resp.opname == "SEND Only with Invalidate" and resp.invalidate_rkey == sgl["key"]
    assert cmd.index < writes[0].index < resp.index and resp.nvme["status_name"] == "Success"
    data = [f for f in d.frames if writes[0].index <= f.index < resp.index and f.src == TARGET_IP
            and f.opname.startswith("RDMA WRITE")]
    assert sum(f.payload_len for f in data) == 4096

    # 4 KiB write with in-capsule data (port 4421): the data rides in the SEND, no RDMA READ
    cmd = command_frame(d, "Write", 4096)
    assert cmd.nvme["sgl"] == {"type": "in-capsule", "addr": 0, "length": 4096}
    seq = logged_sequence(log, cmd.dest_qp, cmd.nvme["cid"], 0x01)
    assert seq == [f"capsule {64 + 4096} B opc 0x01 cid {cmd.nvme['cid']}", f"SEND response cid {cmd.nvme['cid']}"]
    resp = frames_after(d, cmd, TARGET_IP, lambda f: f.nvme and f.nvme.get("cid") == cmd.nvme["cid"])[0]
    assert resp.opname == "SEND Only" and resp.nvme["for"] == "Write"
    assert not frames_after(d, cmd, TARGET_IP, lambda f: f.opname == "RDMA READ Request" and f.index < resp.index)

    # 4 KiB write without in-capsule data (port 4422): RDMA READ of 4096 with the host's rkey, then SEND w/ Inv
    cmd = command_frame(d, "Write", 6144)
    sgl = cmd.nvme["sgl"]
    assert sgl["type"] == "keyed" and sgl["length"] == 4096 and sgl["invalidate"]
    seq = logged_sequence(log, cmd.dest_qp, cmd.nvme["cid"], 0x01)
    assert seq[1:] == [f"RDMA READ va {sgl['addr']:#x} rkey {sgl['key']:#x} len 4096",
                       f"SEND response cid {cmd.nvme['cid']} with invalidate rkey {sgl['key']:#x}"]
    read = frames_after(d, cmd, TARGET_IP, lambda f: f.opname == "RDMA READ Request")[0]
    assert read.reth == {"va": sgl["addr"], "rkey": sgl["key"], "length": 4096}
    responses = frames_after(d, read, HOST_IP, lambda f: f.opname.startswith("RDMA READ Response"))
    resp = frames_after(d, read, TARGET_IP, lambda f: f.nvme and f.nvme.get("cid") == cmd.nvme["cid"])[0]
    assert resp.opname == "SEND Only with Invalidate" and resp.invalidate_rkey == sgl["key"]
    got = [f for f in responses if f.index < resp.index]
    assert sum(f.payload_len for f in got) == 4096 and got[0].psn == read.psn
    assert cmd.index < read.index < got[-1].index < resp.index
    assert not any(f.retransmit for f in d.frames) and all(f.naks == 0 for f in d.flows)


def test_lossy_link_fio_verify_completes_with_retransmissions(tmp_path):
    share = tmp_path / "two-node-loss"
    proc, r = two_nodes(share, "loss")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    fio = r["host"]["fio_userspace"]
    assert fio["error"] == 0 and fio["read_ios"] > 0 and fio["write_ios"] > 0, fio
    d = roce.decode(pcap.read_packets((share / "loss.pcap").read_bytes()))
    retrans = sum(len(f.retransmitted) for f in d.flows)
    naks = sum(f.naks for f in d.flows)
    assert retrans > 0 and naks > 0, d.to_dict(frames=False)
    # rxe counted them too, on both nodes
    before, after = r["host"]["hw_counters_before"], r["host"]["hw_counters"]
    grew = {k: after[k] - before[k] for k in ("duplicate_request", "out_of_seq_request", "rcvd_seq_err",
                                               "completer_retry_err") if after[k] > before[k]}
    assert grew, (before, after)
    t = r["target"]["hw_counters"]
    assert t["duplicate_request"] + t["out_of_seq_request"] + t["rcvd_seq_err"] + t["completer_retry_err"] > 0, t
    # and doctor, sampling while fio ran, said so with the counters that grew
    warned = [c for run in r["host"]["doctor_counters"] for c in run if c["status"] == "warn"]
    assert warned, r["host"]["doctor_counters"]
    evidence = "\n".join(warned[0]["evidence"])
    assert "discards/errors growing" in warned[0]["summary"]
    assert re.search(r"hw_counters/(duplicate_request|out_of_seq_request|rcvd_seq_err|completer_retry_err): \+\d+",
                     evidence), evidence
    (share / "loss-summary.json").write_text(json.dumps(d.to_dict(frames=False), indent=1))


def test_mtu_mismatch_is_named_on_the_node_that_has_it(tmp_path):
    share = tmp_path / "two-node-mtu"
    proc, r = two_nodes(share, "mtu", timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    host = {c["check"]: c for c in r["host"]["doctor"]}
    target = {c["check"]: c for c in r["target"]["doctor"]}
    assert host["address.path_mtu"]["status"] == "fail", host["address.path_mtu"]
    assert "MTU 9000" in host["address.path_mtu"]["summary"] and TARGET_IP in host["address.path_mtu"]["summary"]
    assert target["address.path_mtu"]["status"] == "ok", target["address.path_mtu"]


# The host node's Soft-RoCE stops receiving CM messages after a MAD was sent while its link was down (a Linux
# rxe/ib_mad defect, not the targets': docs/two-node.md, link down and up), so neither target gets its host back.
RXE_GSI_AFTER_FLAP = ("Linux rxe on the host node: once a CM message was sent while the link was down, the node's "
                      "GSI QP (QP 1) sends but never receives again, so every REP to the host goes unanswered and "
                      "no rdma_cm connection from it completes, to either target (docs/two-node.md, link down and up). "
                      "Not strict: the defect does not show in every run (the kernel target got its host back in two "
                      "of the four flap runs the document records), so a pass says the flap missed it, not that rxe "
                      "is fixed")


@pytest.mark.xfail(strict=False, reason=RXE_GSI_AFTER_FLAP)
def test_link_down_and_up_mid_run_recovers_without_data_errors(tmp_path):
    share = tmp_path / "two-node-flap"
    proc, r = two_nodes(share, "flap")
    host = r["host"]
    assert host is not None, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "DOWN" in host["port_state_down"]
    log = "\n".join(host["kernel_log"])
    for target in ("kernel", "userspace"):
        fio = host[f"fio_{target}"]
        assert fio["error"] == 0 and fio["returncode"] == 0, (target, fio, log)
    # the kernel host lost its queues with the link and reconnected to both once it was back
    assert log.count("Successfully reconnected") >= 2, log


@pytest.fixture(scope="module")
def cmflap(tmp_path_factory):
    """The flap without NVMe: perftest over rdma_cm across the same 8 s outage of the host node's link."""
    share = tmp_path_factory.mktemp("two-node-cmflap")
    proc, results = two_nodes(share, "cmflap", timeout=900)
    host = results["host"]
    assert host is not None and "after a flap with a connection open" in host.get("clients", {}), \
        proc.stdout[-6000:] + proc.stderr[-3000:]
    return host


def test_rdma_cm_connects_after_a_link_flap_with_nothing_open(cmflap):
    clients = cmflap["clients"]
    assert clients["before"]["rc"] == 0, clients
    assert clients["after a flap with nothing open"]["rc"] == 0, clients
    assert cmflap["diag_before"]["hw_counters"]["link_downed"] < cmflap["diag_after"]["hw_counters"]["link_downed"]


@pytest.mark.xfail(strict=False, reason=RXE_GSI_AFTER_FLAP)
def test_rdma_cm_connects_after_a_link_flap_with_a_connection_open(cmflap):
    after = cmflap["clients"]["after a flap with a connection open"]
    assert after["rc"] == 0, (after, cmflap["diag_after"])
