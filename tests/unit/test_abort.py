"""Abort (admin 0x08) is answered as nvmet answers it: success, DW0 bit 0 set (command not aborted)."""
from nvmeof_roce.nvme import admin as A
from nvmeof_roce.nvme import log as L
from nvmeof_roce.nvme.command import ADMIN_ABORT, SQE

from loopback_env import SUB_RAM, RawQueue


def test_abort_answers_command_not_aborted_and_is_listed_in_the_effects_log(env):
    ctrl = env.connect(SUB_RAM)
    q = RawQueue(ctrl.admin.transport)
    cqe = q.command(SQE(opc=ADMIN_ABORT, cdw10=(0x1234 << 16) | 1))  # SQID 1, CID 0x1234
    assert cqe.status == 0 and cqe.result & 1 == 1
    effects = ctrl.get_log_page(A.LID_CMD_EFFECTS, 4096)
    assert L.CommandEffectsLog.unpack(effects).admin.get(ADMIN_ABORT, 0) & L.EFFECT_CSUPP
    ctrl.write(1, 0, b"a" * 512)  # the controller goes on
    assert ctrl.read(1, 0, 1) == b"a" * 512
    ctrl.close()
