"""The initiator's data path without a device: the command slot table, the tagged submission path the load
generator uses, the perf loop over loopback, and the host RDMA queue's selective-signaling bookkeeping
(`SendAccount`, pure Python, so it runs where pyverbs is missing)."""
import os

import pytest

from loopback_env import SUB_4K, SUB_RAM
from nvmeof_roce.errors import NvmeofError
from nvmeof_roce.initiator.controller import HostError, QueueFull
from nvmeof_roce.initiator.perf import run_perf
from nvmeof_roce.nvme import status as S
from nvmeof_roce.nvme.command import CQE_STRUCT
from nvmeof_roce.transport.rdma.verbs import SEND_WR_BASE
from nvmeof_roce.transport.rdma.host import SendAccount


# ---------------------------------------------------------------------------- the command slot table

def test_slot_table_cids_carry_slot_and_generation(env):
    ctrl = env.connect(SUB_RAM, queue_size=4)
    q = ctrl.io_queues[0]
    before = list(q.generation)  # the Fabrics Connect already used a slot
    taken = [q.take() for _ in range(4)]
    assert sorted(slot for slot, _ in taken) == [0, 1, 2, 3] and q.outstanding == 4
    for slot, cid in taken:
        assert cid & 0xFFF == slot and cid >> 12 == (before[slot] + 1) & 0xF and q.slot_of(cid) == slot
    with pytest.raises(IndexError):  # no free slot: callers check q.free first
        q.take()
    slot, cid = taken[0]
    q.release(slot)
    assert q.slot_of(cid) == -1  # a completion for it now is for an unknown command
    slot2, cid2 = q.take()
    assert slot2 == slot and cid2 >> 12 == ((cid >> 12) + 1) & 0xF and q.slot_of(cid2) == slot
    assert q.slot_of(0xFFF) == -1  # a slot beyond the table
    q.release_all()
    assert q.outstanding == 0 and all(c == -1 for c in q.cids)
    ctrl.close()


def test_slot_table_generation_wraps_in_four_bits(env):
    ctrl = env.connect(SUB_RAM, queue_size=2)
    q = ctrl.io_queues[0]
    gens = []
    for _ in range(20):
        slot, cid = q.take()
        gens.append(cid >> 12)
        q.release(slot)
    assert all(0 <= g <= 0xF for g in gens) and len(set(gens)) == 16
    ctrl.close()


def test_completion_for_a_free_slot_is_a_protocol_error(env):
    ctrl = env.connect(SUB_RAM)
    q = ctrl.io_queues[0]
    forged = CQE_STRUCT.pack(0, 0, 0, q.qid, (3 << 12) | 5, 0)
    q.transport._deliver(forged)  # as if the target answered a command never sent
    with pytest.raises(HostError, match="unknown command ID 0x3005"):
        ctrl._process_queue(q)
    ctrl.close()


# ---------------------------------------------------------------------------- submit_tagged

def test_tagged_writes_and_reads_round_trip(env):
    ctrl = env.connect(SUB_4K, queue_size=8)  # 4 KiB blocks; in-capsule data up to 4096 bytes here
    q = ctrl.io_queues[0]
    small = os.urandom(4096)  # goes in the capsule
    large = os.urandom(8192)  # goes from the command's slot (keyed SGL)
    got = []
    ctrl.submit_tagged(q, True, 1, 3, 1, len(small), lambda tag, st: got.append((tag, st)), 7, small)
    ctrl.submit_tagged(q, True, 1, 10, 2, len(large), lambda tag, st: got.append((tag, st)), 8, large)
    ctrl.wait_idle()
    assert sorted(got) == [(7, 0), (8, 0)]
    assert ctrl.read(1, 3, 1) == small and ctrl.read(1, 10, 2) == large
    got.clear()
    ctrl.submit_tagged(q, False, 1, 1 << 30, 1, 4096, lambda tag, st: got.append((tag, st)), 9)
    ctrl.wait_idle()
    assert got == [(9, S.LBA_RANGE | S.DNR)]
    ctrl.close()


def test_tagged_callback_may_resubmit_into_its_own_slot(env):
    ctrl = env.connect(SUB_RAM, queue_size=4)
    q = ctrl.io_queues[0]
    remaining = [40]
    seen = []

    def done(tag, status):
        seen.append((tag, status, q.outstanding))
        if remaining[0]:
            remaining[0] -= 1
            ctrl.submit_tagged(q, False, 1, tag, 1, 512, done, tag)  # raises QueueFull if the slot were held

    for tag in range(4):
        ctrl.submit_tagged(q, False, 1, tag, 1, 512, done, tag)
    with pytest.raises(QueueFull):
        ctrl.submit_tagged(q, False, 1, 0, 1, 512, done, 99)
    ctrl.wait_idle()
    assert len(seen) == 44 and {s for _, s, _ in seen} == {0}
    assert max(n for _, _, n in seen) == 3  # the finished command's slot was free during its callback
    assert q.outstanding == 0 and len(q.free) == 4
    ctrl.close()


def test_tagged_rejects_a_transfer_larger_than_a_slot(env):
    ctrl = env.connect(SUB_RAM, queue_size=4, io_slot_size=8192)
    q = ctrl.io_queues[0]
    with pytest.raises(HostError, match="exceeds the 8192-byte slot"):
        ctrl.submit_tagged(q, False, 1, 0, 32, 16384, lambda t, s: None, 0)
    assert q.outstanding == 0
    ctrl.close()


# ---------------------------------------------------------------------------- the perf loop

def test_perf_over_loopback_counts_reads_and_writes(env):
    ctrl = env.connect(SUB_RAM, queue_size=16, num_io_queues=2)
    result = run_perf(ctrl, 1, block_size=4096, queue_depth=8, read_percent=70, runtime=0.3, seed=1)
    assert result.ios > 0 and result.errors == 0 and result.ios == result.reads + result.writes
    assert result.reads > result.writes > 0  # 70/30 mix
    assert result.queues == 2 and result.latency_us["p50"] > 0
    assert ctrl.outstanding == 0  # everything in flight was reaped before returning
    ctrl.close()


def test_perf_refuses_a_depth_the_queues_cannot_hold(env):
    ctrl = env.connect(SUB_RAM, queue_size=8)
    with pytest.raises(NvmeofError, match="queue depth 9 exceeds the 8 command slots"):
        run_perf(ctrl, 1, queue_depth=9, runtime=0.1)
    with pytest.raises(NvmeofError, match="block size 3000"):
        run_perf(ctrl, 1, block_size=3000, runtime=0.1)
    ctrl.close()


# ---------------------------------------------------------------------------- SendAccount

def _unpack(wr_id):
    n = wr_id - SEND_WR_BASE
    return n >> 16, n & 0xFFFF  # (slot, entries retired)


def test_send_account_signals_every_interval_and_retires_in_order():
    acct = SendAccount(sq_size=64, slots=8, interval=4)
    assert [acct.post() for _ in range(3)] == [-1, -1, -1]
    wr_id = acct.post()
    assert _unpack(wr_id) == (SendAccount.NO_SLOT, 4) and acct.in_sq == 4
    assert acct.post() == -1 and acct.in_sq == 5
    acct.completed(wr_id)  # retires the signaled one and the three before it, not the later one
    assert acct.in_sq == 1 and len(acct.free_slots) == 8


def test_send_account_slot_sends_are_always_signaled_and_free_their_slot():
    acct = SendAccount(sq_size=64, slots=2, interval=16)
    assert acct.post() == -1
    slot = acct.free_slots.pop()
    wr_id = acct.post(slot)
    assert _unpack(wr_id) == (slot, 2)  # it retires the unsignaled inline SEND before it
    other = acct.free_slots.pop()
    wr2 = acct.post(other)
    assert _unpack(wr2) == (other, 1) and acct.free_slots == []
    acct.completed(wr_id)
    assert acct.free_slots == [slot] and acct.in_sq == 1
    acct.completed(wr2)
    assert sorted(acct.free_slots) == [0, 1] and acct.in_sq == 0


def test_send_account_signals_the_send_that_fills_the_queue():
    acct = SendAccount(sq_size=3, slots=1, interval=3)
    assert acct.post() == -1 and acct.post() == -1
    wr_id = acct.post()  # fills the send queue: signaled, or nothing would ever free it
    assert wr_id != -1 and not acct.room()
    acct.completed(wr_id)
    assert acct.room() and acct.in_sq == 0
    acct = SendAccount(sq_size=2, slots=1, interval=2)
    assert acct.post() == -1 and acct.post() != -1 and not acct.room()


@pytest.mark.parametrize("sq_size,slots,interval", [(0, 1, 1), (4, 1, 0), (4, 1, 5), (4, 0xFFFF, 1)])
def test_send_account_rejects_impossible_sizes(sq_size, slots, interval):
    with pytest.raises(ValueError, match="send account"):
        SendAccount(sq_size, slots, interval)


# ---------------------------------------------------------------------------- RdmaHostQueue on stand-in verbs

def test_rdma_host_queue_chains_held_sends_and_echoes_every_cid():
    """The real RdmaHostQueue send/drain code on benchmarks/initiator_cost.py's fake QP and CQ (stand-in work
    requests): what one poll batch's callbacks submit goes out as one chained post, and every CID comes back."""
    import sys
    from pathlib import Path
    pytest.importorskip("nvmeof_roce.transport.rdma.host")
    try:
        import pyverbs  # noqa: F401
        pytest.skip("with python3-pyverbs the fake posts one by one (it cannot follow a real chain)")
    except ImportError:
        pass
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import initiator_cost
    transport, real = initiator_cost.rdma_host_queue(8)
    posts = []
    original = transport.qp.post_send
    transport.qp.post_send = lambda wr: (posts.append(wr), original(wr))
    ctrl, q = initiator_cost._queue_of(transport, 8)
    seen = []
    left = [200]

    def done(tag, status):
        seen.append((tag, status))
        if left[0]:
            left[0] -= 1
            ctrl.submit_tagged(q, False, 1, 0, 8, 4096, done, tag)

    for tag in range(8):
        ctrl.submit_tagged(q, False, 1, 0, 8, 4096, done, tag)
    while q.outstanding:
        ctrl._process_queue(q)
    assert len(seen) == 208 and {s for _, s in seen} == {0}
    assert len(posts) < 208 // 4  # the resubmissions went out chained, a batch per post
    assert transport.sends.in_sq <= transport.sends.sq_size and transport.held is None
