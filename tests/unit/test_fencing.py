"""Fencing and lifetimes (docs/native.md "References and fencing"): a command holds a reference on its namespace
from its parse until its last work request has completed or flushed; a change to a namespace, a fence (Preempt
and Abort, a host losing access) and the memory of a RAM namespace wait on those references, not on lists of
controllers; a change to one namespace waits only for that namespace's commands.

The windows are opened with the fake provider's wire: held, a native Write's RDMA READ stays on it with its
destination taken in the namespace's memory, and moves its data only when released."""
import os
import subprocess
import sys
import textwrap

import pytest

from loopback_env import HOST_A, HOST_B, RAW_HOSTID, SUB_RAM, standard_config
from native_diff import NativeEndpoint, io_capsule, pattern
from native_fake import needs_native, pump
from nvmeof_roce.control import live
from nvmeof_roce.config import parse_config
from nvmeof_roce.nvme import fabrics as F
from nvmeof_roce.nvme import reservation as R
from nvmeof_roce.nvme.command import SQE

pytestmark = needs_native

READ, WRITE = 0x02, 0x01
NVM_RESV_ACQUIRE = 0x11
ID_A = "00010203-0405-0607-0809-0a0b0c0d0e0f"  # RAW_HOSTID, the native endpoint's host identifier
ID_B = "00000000-0000-4000-8000-0000000000bb"
KEY_A, KEY_B = 0xA, 0xB
assert bytes.fromhex(ID_A.replace("-", "")) == RAW_HOSTID


def status_of(cqe: bytes) -> int:
    return int.from_bytes(cqe[14:16], "little") >> 1


def cid_of(cqe: bytes) -> int:
    return int.from_bytes(cqe[12:14], "little")


def with_size(target, nsid: int, size: str):
    data = target.config.to_dict()
    for s in data["subsystems"]:
        if s["nqn"] == SUB_RAM:
            for n in s["namespaces"]:
                if int(str(n["nsid"]), 0) == nsid:
                    n["nvmeof_roce"]["size"] = size
    return parse_config(data, "test")


def held_write(ep, nsid: int, slba: int, data: bytes, cid: int) -> None:
    """A native Write whose RDMA READ is on the (held) wire: its data has not moved yet."""
    ep.device.hold()
    ep.buf.view[0:len(data)] = data
    assert ep.device.deliver(io_capsule(ep, WRITE, nsid, slba, len(data) // 512 - 1, len(data), cid=cid)) == 0
    ep.queue.poll()
    assert ep.queue.stats()["native_in_flight"] == 1 and ep.device.on_wire() == 1


def resv_config() -> dict:
    config = standard_config()
    config["subsystems"][0]["namespaces"][0]["resv"] = {"enable": "1"}
    return config


def test_preempt_and_abort_completes_after_the_fenced_hosts_native_write_and_its_data_never_lands_after():
    ep = NativeEndpoint(resv_config(), SUB_RAM)
    try:
        env, target = ep.env, ep.env.target
        ns = target.subsystems[SUB_RAM].namespaces[1]
        a = env.connect(SUB_RAM, hostnqn=HOST_A, hostid=ID_A, num_io_queues=1)  # host A's second controller
        a.resv_register(1, nrkey=KEY_A)
        a.resv_acquire(1, R.WRITE_EXCLUSIVE, KEY_A)
        a_data, b_data = pattern(4096, seed=61), pattern(4096, seed=62)
        held_write(ep, 1, 0, a_data, cid=1)  # A's native Write: its READ into the namespace is on the wire

        b = env.connect(SUB_RAM, hostnqn=HOST_B, hostid=ID_B, num_io_queues=1)
        b.resv_register(1, nrkey=KEY_B)
        answers = []
        sqe = SQE(opc=NVM_RESV_ACQUIRE, nsid=1, cdw10=R.acquire_cdw10(R.PREEMPT_AND_ABORT, R.WRITE_EXCLUSIVE))
        b.submit_io(sqe, answers.append, data_out=R.KEYS.pack(KEY_B, KEY_A))
        for _ in range(5):
            env.fabric.pump()
            b.poll_completions()
            ep.queue.poll()
        b_wrote = bool(answers)
        if b_wrote:  # answered with A's Write still in flight: B writes, as a host may once it is answered
            assert answers[0].status == 0
            b.write(1, 0, b_data)
        assert ns.resv.holder == bytes.fromhex(ID_B.replace("-", ""))  # the change itself is made at once
        ep.device.hold(False)
        ep.device.release()  # A's READ lands now
        ep.settle()
        for _ in range(5):
            env.fabric.pump()
            b.poll_completions()
        assert [c.status for c in answers] == [0]
        if not b_wrote:
            b.write(1, 0, b_data)  # the preempt answered only now: B's write comes after it
        # A's Write was answered (before the preempt's answer), success: it started before the preempt and its
        # namespace stayed in A's native view (paused for A) - not Invalid Namespace; and B's acknowledged data is
        # what the medium holds
        assert [(cid_of(c), status_of(c)) for c, _ in ep.device.responses()] == [(1, 0)]
        assert bytes(ns.direct_view[:4096]) == b_data
        assert b.read(1, 0, 8) == b_data
    finally:
        ep.close()


def test_a_preempt_waits_for_the_fenced_write_before_it_answers():
    """The order itself: the Preempt and Abort is not answered while the preempted host's Write can still land."""
    ep = NativeEndpoint(resv_config(), SUB_RAM)
    try:
        env = ep.env
        a = env.connect(SUB_RAM, hostnqn=HOST_A, hostid=ID_A, num_io_queues=1)
        a.resv_register(1, nrkey=KEY_A)
        a.resv_acquire(1, R.WRITE_EXCLUSIVE, KEY_A)
        held_write(ep, 1, 0, pattern(4096, seed=63), cid=1)
        b = env.connect(SUB_RAM, hostnqn=HOST_B, hostid=ID_B, num_io_queues=1)
        b.resv_register(1, nrkey=KEY_B)
        answers = []
        sqe = SQE(opc=NVM_RESV_ACQUIRE, nsid=1, cdw10=R.acquire_cdw10(R.PREEMPT_AND_ABORT, R.WRITE_EXCLUSIVE))
        b.submit_io(sqe, answers.append, data_out=R.KEYS.pack(KEY_B, KEY_A))
        for _ in range(5):
            env.fabric.pump()
            b.poll_completions()
            ep.queue.poll()
        assert answers == []  # A's READ is still on the wire
        ep.device.hold(False)
        ep.device.release()
        ep.settle()
        for _ in range(5):
            env.fabric.pump()
            b.poll_completions()
        assert [c.status for c in answers] == [0]
    finally:
        ep.close()


SHRINK_AFTER_AN_ENDED_CONTROLLER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from test_fencing import shrink_after_an_ended_controller
    shrink_after_an_ended_controller()
    print("survived")
""")


def shrink_after_an_ended_controller() -> None:
    """A Disconnect of the I/O queue, then its admin queue gone (the controller ends), then a shrink: the change
    waits for the READ still landing in the namespace's memory, which the shrink would make inaccessible."""
    ep = NativeEndpoint(standard_config(), SUB_RAM)
    target = ep.env.target
    data = pattern(4096, seed=71)
    held_write(ep, 1, 2048, data, cid=1)  # at 1 MiB: beyond the size the namespace is shrunk to
    disconnect = F.DisconnectCommand(cid=2).to_sqe().pack()
    assert ep.device.deliver(disconnect) == 0
    ep.queue.poll()
    ep.admin.transport.close()  # the admin queue goes: the controller ends
    ep.env.fabric.pump()
    assert not target.subsystems[SUB_RAM].controllers
    applying = live.Applying()
    live.apply(target, with_size(target, 1, "512K"), applying=applying)
    ns = target.subsystems[SUB_RAM].namespaces[1]
    committed_at_once = ns.num_blocks == (512 << 10) // 512
    ep.device.hold(False)
    ep.device.release()  # the READ lands now
    pump(ep.queue)
    ep.env.fabric.pump()
    ep.env.target.tick(ep.env.clock())
    assert not committed_at_once, "the shrink was committed with a READ still landing in the namespace"
    assert applying.done and applying.error is None
    assert ns.num_blocks == (512 << 10) // 512
    ep.close()


def test_a_change_waits_for_the_commands_of_a_controller_that_ended():
    tests = os.path.dirname(os.path.abspath(__file__))
    child = subprocess.run([sys.executable, "-c", SHRINK_AFTER_AN_ENDED_CONTROLLER.format(tests=tests)],
                           capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), tests])))
    assert child.returncode == 0, (child.returncode, child.stdout[-2000:], child.stderr[-4000:])
    assert "survived" in child.stdout


def test_a_change_to_one_namespace_waits_only_for_that_namespaces_commands():
    """Host A's Write on namespace 1 is stuck on the wire; namespace 2 is resized: the resize commits at once, and
    host B's I/O on namespace 2 goes on (nothing of namespace 1's holds it)."""
    ep = NativeEndpoint(standard_config(), SUB_RAM)
    try:
        env, target = ep.env, ep.env.target
        b = env.connect(SUB_RAM, hostnqn=HOST_B, hostid=ID_B, num_io_queues=1)
        held_write(ep, 1, 0, pattern(4096, seed=81), cid=1)
        applying = live.Applying()
        live.apply(target, with_size(target, 2, "2M"), applying=applying)
        assert applying.done and applying.error is None
        assert target.subsystems[SUB_RAM].namespaces[2].num_blocks == (2 << 20) // 512
        b.write(2, 3000, pattern(4096, seed=82))  # beyond the old size: the new one is served
        assert b.read(2, 3000, 8) == pattern(4096, seed=82)
        b.write(1, 100, pattern(512, seed=83))  # namespace 1 itself is not paused either
        ep.device.hold(False)
        ep.device.release()
        ep.settle()
        assert [status_of(c) for c, _ in ep.device.responses()] == [0]
    finally:
        ep.close()
