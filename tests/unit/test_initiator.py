"""The initiator on its own terms: what it puts on the wire (docs/protocol.md §8.2), its host
identity, and its asynchronous API."""
import os
import uuid

import pytest

from loopback_env import HOST_A, SUB_RAM
from nvmeof_roce.initiator import controller as initiator
from nvmeof_roce.initiator.controller import CommandTimeout, Controller, HostError, QueueFull
from nvmeof_roce.nvme import status as S
from nvmeof_roce.nvme.command import SQE
from nvmeof_roce.nvme.status import NvmeStatusError
from nvmeof_roce.transport.loopback import LoopbackFabric, LoopbackHostQueue


@pytest.fixture
def recorded(monkeypatch):
    """Every capsule any loopback host queue sends: (qid, bytes)."""
    capsules = []
    original = LoopbackHostQueue.send

    def send(self, capsule):
        capsules.append((self.qid, bytes(capsule)))
        return original(self, capsule)

    monkeypatch.setattr(LoopbackHostQueue, "send", send)
    return capsules


def test_wire_discipline(env, recorded):
    ctrl = env.connect(SUB_RAM, num_io_queues=2)
    ctrl.write(1, 0, os.urandom(512 * 4))  # in-capsule
    ctrl.write(1, 8, os.urandom(512 * 64))  # keyed
    ctrl.read(1, 0, 72)
    ctrl.flush(1)
    ctrl.write_zeroes(1, 0, 1)
    ctrl.dsm_deallocate(1, [(0, 1)])
    ctrl.get_log_page(0x02, 512)
    ctrl.keep_alive()
    ctrl.close()
    assert len(recorded) > 20
    for qid, raw in recorded:
        sqe = SQE.unpack(raw)
        assert sqe.flags == 0x40, sqe  # PSDT 01, FUSE 0 on every command
        assert sqe.sgl.sgl_id in (0x40, 0x01), sqe  # keyed 0x40 (never 0x4F) or in-capsule
        if sqe.sgl.sgl_id == 0x01:
            assert qid != 0, "in-capsule data on the admin queue"
            assert sqe.opc & 1 or (sqe.opc == 0x7F and sqe.fctype & 1), "in-capsule data on a read"
            assert len(raw) == 64 + sqe.sgl.length <= 64 + 4096
        else:
            assert len(raw) == 64
            if sqe.sgl.length == 0:
                assert sqe.sgl.addr == 0 and sqe.sgl.key == 0
    admin = [SQE.unpack(raw) for qid, raw in recorded if qid == 0]
    connect = admin[0]
    assert connect.opc == 0x7F and connect.fctype == 1 and connect.sgl.length == 1024
    assert connect.cdw11 & 0xFFFF == 31 and connect.cdw12 == 5000  # SQSIZE 31, KATO 5000 ms
    # the enable sequence: CAP, CC (EN 0), CAP, CC (EN 1), CSTS...
    props = [(s.fctype, s.cdw11, s.cdw12) for s in admin[1:6]]
    assert props == [(4, 0x00, 0), (0, 0x14, 0x00460000), (4, 0x00, 0), (0, 0x14, 0x00460001), (4, 0x1C, 0)]
    identify = next(s for s in admin if s.opc == 0x06)
    assert identify.sgl.length == 4096
    io_connects = [SQE.unpack(raw) for qid, raw in recorded if qid and raw[0] == 0x7F]
    assert len(io_connects) == 2 and all(s.sgl.sgl_id == 0x01 for s in io_connects)  # in-capsule: IOCCSZ >= 68
    # the last admin commands: CC with SHN = 01, then CSTS polled
    assert (admin[-2].fctype, admin[-2].cdw12) == (0, 0x00464001)
    assert (admin[-1].fctype, admin[-1].cdw11) == (4, 0x1C)


def _identity_paths(tmp_path, **kw):
    from nvmeof_roce.host_identity import Paths
    return Paths(etc_dir=str(tmp_path), product_uuid=str(tmp_path / "none"), dmi_entries=str(tmp_path / "none"),
                 device_tree_uuid=str(tmp_path / "none"), environ={}, **kw)


def test_default_host_identity_files(tmp_path, monkeypatch):
    (tmp_path / "hostnqn").write_text("nqn.2014-08.org.nvmexpress:uuid:12345678-1234-1234-1234-123456789abc\n")
    (tmp_path / "hostid").write_text("abcdefab-cdef-abcd-efab-cdefabcdefab\n")
    monkeypatch.setattr(initiator, "IDENTITY_PATHS", _identity_paths(tmp_path))
    monkeypatch.setattr(initiator, "_default_identity", None)
    nqn, hostid = initiator.default_host_identity()
    assert nqn == "nqn.2014-08.org.nvmexpress:uuid:12345678-1234-1234-1234-123456789abc"
    assert hostid == uuid.UUID("abcdefab-cdef-abcd-efab-cdefabcdefab").bytes
    # no hostid file: the UUID of the NQN
    (tmp_path / "hostid").unlink()
    monkeypatch.setattr(initiator, "_default_identity", None)
    assert initiator.default_host_identity()[1] == uuid.UUID("12345678-1234-1234-1234-123456789abc").bytes


def test_default_host_identity_from_the_machine_as_nvme_cli(tmp_path, monkeypatch):
    """No /etc/nvme files: the DMI product UUID, as libnvme (not a UUID of our own making)."""
    (tmp_path / "product_uuid").write_text("4c4c4544-0042-3510-8052-b4c04f4e4d32\n")
    monkeypatch.setattr(initiator, "IDENTITY_PATHS", _identity_paths(tmp_path / "etc"))
    initiator.IDENTITY_PATHS.product_uuid = str(tmp_path / "product_uuid")
    monkeypatch.setattr(initiator, "_default_identity", None)
    nqn, hostid = initiator.default_host_identity()
    assert nqn == "nqn.2014-08.org.nvmexpress:uuid:4c4c4544-0042-3510-8052-b4c04f4e4d32"
    assert hostid == uuid.UUID("4c4c4544-0042-3510-8052-b4c04f4e4d32").bytes
    assert initiator.default_host_identity() == (nqn, hostid)  # stable within the process


def test_async_errors_reach_the_callback(env):
    ctrl = env.connect(SUB_RAM)
    got = []
    ctrl.submit_read(1, 1 << 30, 1, got.append)
    ctrl.submit_read(1, 0, 1, got.append)
    ctrl.wait_idle()
    assert [c.status for c in got] == [S.LBA_RANGE | S.DNR, 0]
    assert got[0].status_name == "LBA Out of Range" and not got[0].ok
    with pytest.raises(NvmeStatusError) as exc:
        got[0].raise_for_status()
    assert exc.value.name == "LBA Out of Range" and exc.value.command == "Read"
    with pytest.raises(NvmeStatusError):
        ctrl.read(1, (2 << 20) // 512, 1)
    ctrl.close()


def test_nonblocking_submit_and_slot_limits(env):
    ctrl = env.connect(SUB_RAM, queue_size=16)
    for _ in range(16):
        ctrl.submit_read(1, 0, 1, None, block=False)
    with pytest.raises(QueueFull):
        ctrl.submit_read(1, 0, 1, None, block=False)
    ctrl.wait_idle()
    with pytest.raises(HostError):  # larger than one command slot: use read(), which splits
        ctrl.submit_read(1, 0, 1024, None)
    with pytest.raises(HostError):
        ctrl.write(1, 0, b"not a block")
    ctrl.close()


def test_cids_unique_in_flight_and_reused_with_a_new_generation(env):
    ctrl = env.connect(SUB_RAM, queue_size=16)
    cids = [ctrl.submit_read(1, 0, 1, None)[1] for _ in range(16)]
    assert len(set(cids)) == 16
    ctrl.wait_idle()
    again = [ctrl.submit_read(1, 0, 1, None)[1] for _ in range(16)]
    assert set(c & 0xFFF for c in again) == set(c & 0xFFF for c in cids) and not set(again) & set(cids)
    ctrl.wait_idle()
    ctrl.close()


def test_unanswered_command_times_out():
    class Silent:
        in_capsule_size = 0

        def check_connect(self, request):
            return None

        def queue_opened(self, queue):
            pass

        def capsule_received(self, queue, capsule):
            pass  # never answers

        def queue_closed(self, queue):
            pass

        def tick(self, now):
            pass

    fabric = LoopbackFabric()
    fabric.listen("10.0.0.1:4420", Silent())
    with pytest.raises(CommandTimeout):
        Controller.connect(fabric.connector("10.0.0.1:4420"), SUB_RAM, hostnqn=HOST_A, timeout=0.2)


def test_context_manager_closes(env):
    with env.connect(SUB_RAM) as ctrl:
        ctrl.write(1, 0, bytes(512))
    assert ctrl.closed and env.target.subsystem(SUB_RAM).controllers == {}
