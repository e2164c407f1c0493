"""Our userspace initiator over real rxe: against our target (with a malformed-capsule sweep while a kernel
host's fio verify runs on another controller) and against the kernel's nvmet-rdma configured through configfs."""
import json
import os
import subprocess
import sys

import pytest

from targetproc import (LAB_IP, ServedTarget, config, disconnect_all_quietly, namespaces_of, nvme, ram_namespace)

pytestmark = pytest.mark.lab

NQN_SWEEP = "nqn.2024-01.io.nvmeof-roce:sweep"
NQN_CLEAN = "nqn.2024-01.io.nvmeof-roce:clean"
NQN_KERNEL = "nqn.2024-01.io.nvmeof-roce:kernel-target"
KERNEL_PORT = 4421
NVMET = "/sys/kernel/config/nvmet"


def cli(*args, timeout=300):
    proc = subprocess.run([sys.executable, "-m", "nvmeof_roce", *args], capture_output=True, text=True,
                          timeout=timeout)
    return proc


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ours")
    cfg = config([
        {"nqn": NQN_SWEEP, "attr": {"allow_any_host": "1"}, "allowed_hosts": [],
         "namespaces": [ram_namespace(1, "16M", 512)]},
        {"nqn": NQN_CLEAN, "attr": {"allow_any_host": "1"}, "allowed_hosts": [],
         "namespaces": [ram_namespace(1, "32M", 512)]},
    ])
    target = ServedTarget(cfg, str(tmp / "ours.json")).start()
    yield target
    disconnect_all_quietly()
    assert target.stop() == 0, target.output()


def test_cli_discover_identify_connect_test_against_our_target(ours):
    out = cli("initiator", "discover", "-a", LAB_IP, "--json")
    assert out.returncode == 0, out.stderr
    nqns = {r["subnqn"] for r in json.loads(out.stdout)["records"]}
    assert {NQN_SWEEP, NQN_CLEAN} <= nqns
    out = cli("initiator", "identify", "-a", LAB_IP, "-n", NQN_CLEAN, "--json")
    assert out.returncode == 0, out.stderr
    ident = json.loads(out.stdout)
    assert ident["subnqn"] == NQN_CLEAN and ident["namespaces"][0]["bytes"] == 32 * 2**20
    out = cli("initiator", "connect-test", "-a", LAB_IP, "-n", NQN_CLEAN, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout)
    assert result["ok"] and result["namespaces"] == 1
    out = cli("initiator", "write", "-a", LAB_IP, "-n", NQN_CLEAN, "--slba", "100", "--pattern", "0x5a",
              "--blocks", "3")
    assert out.returncode == 0, out.stderr
    out = cli("initiator", "read", "-a", LAB_IP, "-n", NQN_CLEAN, "--slba", "100", "--blocks", "3", "--json")
    assert bytes.fromhex(json.loads(out.stdout)["hex"]) == b"\x5a" * 1536


def test_cli_errors_name_the_cause(ours):
    out = cli("initiator", "identify", "-a", LAB_IP, "-n", "nqn.2024-01.io.nvmeof-roce:nope")
    assert out.returncode == 1 and "fix:" in out.stderr
    out = cli("initiator", "discover", "-a", LAB_IP, "-s", "4999", "--timeout", "3")
    assert out.returncode == 1 and "10.99.0.1:4999" in out.stderr


class RawIoQueue:
    """An I/O queue of an existing controller, driven with hand-built capsules over RDMA."""

    def __init__(self, connector, ctrl, qid=1, depth=32):
        from nvmeof_roce.nvme import fabrics as F
        self.transport = connector.connect(qid, depth, depth - 1, ctrl.cntlid)
        self.buf = self.transport.register(1 << 20)
        self.cid = 0x200
        data = F.ConnectData(ctrl.hostid, ctrl.cntlid, ctrl.subnqn, ctrl.hostnqn).pack()
        self.buf.view[:1024] = data
        cqe = self.exchange(F.ConnectCommand(qid=qid, sqsize=depth - 1, sgl=self.keyed(1024)).to_sqe())
        assert cqe.status == 0, f"I/O Connect failed: {cqe}"

    def keyed(self, length, offset=0, key=None):
        from nvmeof_roce.nvme.sgl import SglDescriptor
        return SglDescriptor.keyed(self.buf.addr + offset, length, self.buf.key if key is None else key)

    def exchange(self, sqe, extra=b""):
        from nvmeof_roce.nvme.command import CQE
        self.cid = (self.cid + 1) & 0xFFF
        sqe.cid = self.cid
        self.transport.send(sqe.pack() + extra)
        cqes = self.transport.poll(15)
        assert cqes, "no completion within 15 s"
        cqe = CQE.unpack(cqes[0])
        assert cqe.cid == sqe.cid and cqe.sqid == self.transport.qid
        return cqe


def test_malformed_capsule_sweep_while_a_kernel_host_verifies_another_controller(ours):
    from nvmeof_roce.initiator.controller import Controller
    from nvmeof_roce.nvme import nvm
    from nvmeof_roce.nvme import status as S
    from nvmeof_roce.nvme.command import SQE
    from nvmeof_roce.nvme.sgl import SglDescriptor
    from nvmeof_roce.transport.contracts import TransportError
    from nvmeof_roce.transport.rdma.host import RdmaConnector

    nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", "4420", "-n", NQN_CLEAN, "-i", "2")
    fio = None
    try:
        (dev,) = namespaces_of(NQN_CLEAN)
        fio = subprocess.Popen(["fio", "--name=clean", "--verify_state_save=0", f"--filename={dev}", "--rw=randwrite", "--verify=crc32c",
                                "--verify_fatal=1", "--bsrange=4k-64k", "--iodepth=16", "--size=16M",
                                "--ioengine=libaio", "--direct=1", "--output-format=json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        connector = RdmaConnector(LAB_IP, 4420)
        ctrl = Controller.connect(connector, NQN_SWEEP, num_io_queues=0)
        raw = RawIoQueue(connector, ctrl)
        blocks = 16 * 2**20 // 512
        cases = {
            "LBA out of range": (nvm.read_command(0, 1, blocks - 1, 1, raw.keyed(1024)).to_sqe(), S.LBA_RANGE),
            "unknown NSID": (nvm.read_command(0, 99, 0, 0, raw.keyed(512)).to_sqe(), S.INVALID_NS),
            "broadcast NSID": (nvm.read_command(0, 0xFFFFFFFF, 0, 0, raw.keyed(512)).to_sqe(), S.INVALID_NS),
            "SGL length != transfer": (nvm.read_command(0, 1, 0, 7, raw.keyed(512)).to_sqe(), S.SGL_INVALID_DATA),
            "oversize transfer (> MDTS)": (nvm.read_command(0, 1, 0, 511, raw.keyed(512 * 512)).to_sqe(),
                                           S.INVALID_FIELD),
            "unknown opcode": (SQE(opc=0x7E, nsid=1), S.INVALID_OPCODE),
        }
        for name, (sqe, expected) in cases.items():
            cqe = raw.exchange(sqe)
            assert cqe.status & S.CODE_MASK == expected and cqe.status & S.DNR, f"{name}: got {cqe}"
        # bad SGL descriptor types / subtypes
        for sgl_id, expected in ((0x20, S.SGL_INVALID_TYPE), (0x30, S.SGL_INVALID_TYPE), (0x50, S.SGL_INVALID_TYPE),
                                 (0x41, S.INVALID_FIELD)):
            sqe = nvm.read_command(0, 1, 0, 0, raw.keyed(512)).to_sqe()
            packed = bytearray(sqe.pack())
            packed[39] = sgl_id
            cqe = raw.exchange(SQE.unpack(bytes(packed)))
            assert cqe.status & S.CODE_MASK == expected and cqe.status & S.DNR, f"SGL id {sgl_id:#x}: {cqe}"
        # in-capsule descriptor claiming more data than the capsule carries
        sqe = nvm.write_command(0, 1, 0, 7, SglDescriptor.in_capsule(4096)).to_sqe()
        cqe = raw.exchange(sqe, extra=bytes(512))
        assert cqe.status & S.CODE_MASK in (S.SGL_INVALID_OFFSET, S.SGL_INVALID_DATA) and cqe.status & S.DNR, cqe
        # a good write and read still work on the same queue after all that
        raw.buf.view[:512] = b"\xc3" * 512
        assert raw.exchange(nvm.write_command(0, 1, 5, 0, raw.keyed(512)).to_sqe()).status == 0
        raw.buf.view[:512] = bytes(512)
        assert raw.exchange(nvm.read_command(0, 1, 5, 0, raw.keyed(512)).to_sqe()).status == 0
        assert bytes(raw.buf.view[:512]) == b"\xc3" * 512
        # last: a wrong key makes the target's RDMA READ fail: data transfer error or a torn-down queue
        try:
            cqe = raw.exchange(nvm.write_command(0, 1, 0, 0, raw.keyed(512, key=raw.buf.key ^ 0x00F0F000)).to_sqe())
            assert cqe.status & S.CODE_MASK == S.DATA_XFER_ERROR, cqe
        except (TransportError, AssertionError) as exc:
            assert "no completion" in str(exc) or isinstance(exc, TransportError), exc
        try:
            ctrl.close()
        except Exception:
            pass  # the controller may already be gone with its broken queue
        connector.close()

        out, err = fio.communicate(timeout=600)
        assert fio.returncode == 0, f"kernel host fio verify failed:\n{err}\n{out[-2000:]}"
        job = json.loads(out[out.index("{"):])["jobs"][0]
        assert job["error"] == 0 and job["write"]["io_bytes"] == 16 * 2**20
        fio = None
    finally:
        if fio is not None:
            fio.kill()
        nvme("disconnect", "-n", NQN_CLEAN, check=False)
    assert ours.proc.poll() is None, "the target died during the sweep"


@pytest.fixture
def kernel_target(tmp_path):
    """nvmet-rdma on 10.99.0.1:4421 with a 32 MiB file namespace (tmpfs: buffered_io), through configfs."""
    subprocess.run(["modprobe", "-a", "nvmet", "nvmet_rdma"], check=True)
    backing = tmp_path / "kernel-ns.img"
    with open(backing, "wb") as f:
        f.truncate(32 * 2**20)
    subsys = f"{NVMET}/subsystems/{NQN_KERNEL}"
    port = f"{NVMET}/ports/21"

    def write(path, value):
        with open(path, "w") as f:
            f.write(value)

    os.mkdir(subsys)
    write(f"{subsys}/attr_allow_any_host", "1")
    os.mkdir(f"{subsys}/namespaces/1")
    write(f"{subsys}/namespaces/1/device_path", str(backing))
    write(f"{subsys}/namespaces/1/buffered_io", "1")
    write(f"{subsys}/namespaces/1/enable", "1")
    os.mkdir(port)
    for attr, value in (("trtype", "rdma"), ("adrfam", "ipv4"), ("traddr", LAB_IP), ("trsvcid", str(KERNEL_PORT))):
        write(f"{port}/addr_{attr}", value)
    os.symlink(subsys, f"{port}/subsystems/{NQN_KERNEL}")
    yield
    os.unlink(f"{port}/subsystems/{NQN_KERNEL}")
    os.rmdir(port)
    write(f"{subsys}/namespaces/1/enable", "0")
    os.rmdir(f"{subsys}/namespaces/1")
    os.rmdir(subsys)


def test_our_initiator_against_kernel_nvmet(kernel_target):
    out = cli("initiator", "discover", "-a", LAB_IP, "-s", str(KERNEL_PORT), "--json")
    assert out.returncode == 0, out.stderr
    assert NQN_KERNEL in {r["subnqn"] for r in json.loads(out.stdout)["records"]}
    out = cli("initiator", "identify", "-a", LAB_IP, "-s", str(KERNEL_PORT), "-n", NQN_KERNEL, "--json")
    assert out.returncode == 0, out.stderr
    ident = json.loads(out.stdout)
    assert ident["subnqn"] == NQN_KERNEL and ident["model"] == "Linux"
    assert ident["namespaces"][0]["bytes"] == 32 * 2**20
    out = cli("initiator", "connect-test", "-a", LAB_IP, "-s", str(KERNEL_PORT), "-n", NQN_KERNEL,
              "--blocks", "1024", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["ok"]

    from nvmeof_roce.initiator.controller import Controller
    from nvmeof_roce.transport.rdma.host import RdmaConnector
    connector = RdmaConnector(LAB_IP, KERNEL_PORT)
    ctrl = Controller.connect(connector, NQN_KERNEL, num_io_queues=2)
    try:
        bs = ctrl.block_size(1)  # nvmet takes the backing file's block size (4096 on tmpfs)
        data = os.urandom(256 * 1024)
        ctrl.write(1, 16, data)
        ctrl.flush(1)
        assert ctrl.read(1, 16, len(data) // bs) == data
        assert ctrl.read(1, 24, 1) == data[8 * bs:9 * bs]
        # (nvmet's file backend answers Write Zeroes with an error on tmpfs, which lacks FALLOC_FL_ZERO_RANGE)
    finally:
        ctrl.close()
        connector.close()
