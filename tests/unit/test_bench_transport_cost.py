"""nvmeof_roce.bench.cost.transport still drives the real transport end to end on its fake device.

Not a timed test: it runs the benchmark with a few reads and checks that they went through the RDMA
transport and the core (every read completed with success, the data written first was read back, the
remote invalidation reached the host), and that the fake device behaves like a NIC where the transport
relies on it. The figures themselves are not checked.
"""
import json
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
MODULE = "nvmeof_roce.bench.cost.transport"


def _run(*args):
    proc = subprocess.run([sys.executable, "-m", MODULE, *args], capture_output=True, text=True, timeout=600,
                          cwd=REPO)
    return proc


def test_the_benchmark_runs_reads_through_the_transport():
    proc = _run("--reads", "300", "--rounds", "1", "--batch", "1,8", "--stand-ins", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["benchmark"] == "transport_cost" and out["read_bytes"] == 4096
    assert out["real_pyverbs"] is False and out["pyverbs"].startswith("stand-ins")
    assert [b["batch"] for b in out["by_batch"]] == [1, 8]
    # the reads went through the transport: SEND with Invalidate for the kernel host's keyed SGL with 0xF
    assert out["send_with_invalidate"] is True
    for key in ("rdma_us_per_read", "core_us_per_read", "device_us_per_read"):
        assert out[key] > 0
    assert len(out["rdma_rounds_us"]) == 1 and len(out["core_rounds_us"]) == 1


def test_the_human_output_and_bad_arguments():
    proc = _run("--reads", "100", "--rounds", "1", "--batch", "4", "--stand-ins")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "target core alone" in proc.stdout and "batch   4: RDMA transport + core" in proc.stdout
    bad = _run("--batch", "0")
    assert bad.returncode == 2 and "--batch '0'" in bad.stderr
    bad = _run("--reads", "0")
    assert bad.returncode == 2 and "--reads must be at least 1" in bad.stderr


def test_the_fake_device_moves_data_and_completes_like_a_nic(tmp_path):
    # in a child interpreter: the stand-ins replace pyverbs in sys.modules
    code = r"""
import ctypes, sys
sys.path.insert(0, %r)
import fakeverbs as f
f.install(prefer_real=False)
import pyverbs.enums as e
from pyverbs.wr import SGE, SendWR, RecvWR
ctx = f.Context(); pd = f.PD(ctx)
local = ctypes.create_string_buffer(b"0123456789abcdef" * 4, 64)
mr = f.MR(pd, 64, 0, address=ctypes.addressof(local))
ch = f.CompChannel(ctx); cq = f.CQ(ctx, 16, None, ch, 0)
qp = f.QP(pd, f.QPInitAttr(scq=cq, rcq=cq, sq_sig_all=0))
host = f.HostEnd(); qp.peer = host; host.qp = qp
hbuf, haddr, hkey = f.register_host_memory(64)
# an unsignaled WRITE chained before a signaled SEND: data moved, one completion, the SEND delivered
send = SendWR(wr_id=7, opcode=e.IBV_WR_SEND, num_sge=1, sg=[SGE(mr.buf, 16, mr.lkey)])
write = SendWR(wr_id=0, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[SGE(mr.buf + 16, 32, mr.lkey)], send_flags=0)
write.set_wr_rdma(hkey, haddr); write.next_wr = send
cq.req_notify()
qp.post_send(write)
assert hbuf.raw[:32] == local.raw[16:48]
assert list(host.responses) == [local.raw[:16]]
n, wcs = cq.poll(8)
assert n == 1 and wcs[0].wr_id == 7 and wcs[0].status == e.IBV_WC_SUCCESS and wcs[0].opcode == e.IBV_WC_SEND
assert ch.get_cq_event(cq) is cq  # the armed CQ made its channel readable
try:
    ch.get_cq_event(cq); raise SystemExit("a second event without a completion")
except f.PV.error as exc:
    assert exc.error_code == 11
# a receive: the host's capsule lands in the posted buffer
qp.post_recv(RecvWR(wr_id=3, num_sge=1, sg=[SGE(mr.buf + 48, 16, mr.lkey)]))
host.send(b"capsule!")
n, wcs = cq.poll(8)
assert n == 1 and wcs[0].wr_id == 3 and wcs[0].byte_len == 8 and local.raw[48:56] == b"capsule!"
# a WRITE outside the host's region: a remote access error, and the QP is in error from then on
bad = SendWR(wr_id=9, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[SGE(mr.buf, 16, mr.lkey)], send_flags=0)
bad.set_wr_rdma(hkey, haddr + 60)
qp.post_send(bad)
n, wcs = cq.poll(8)
assert n == 1 and wcs[0].status == e.IBV_WC_REM_ACCESS_ERR
qp.post_send(send)
n, wcs = cq.poll(8)
assert wcs[0].status == e.IBV_WC_WR_FLUSH_ERR
print("ok")
""" % str(REPO / "tests" / "unit")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
