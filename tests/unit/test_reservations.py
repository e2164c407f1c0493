"""NVMe reservations over the loopback fabric (engine/reservations.py): the conflict table for every type, command
and role, the four commands' edge cases, the notification log and its event, PTPL across a restart, preempt and
abort, the config, the live change and the RPC.  Three hosts: A (the holder), B (a registrant), C (neither)."""
from __future__ import annotations

import json
import os

import pytest

from nvmeof_roce.config import ConfigError, parse_config
from nvmeof_roce.config.userspace import validate_for_userspace
from nvmeof_roce.control import live
from nvmeof_roce.nvme import admin as A
from nvmeof_roce.nvme import identify as I
from nvmeof_roce.nvme import reservation as R
from nvmeof_roce.nvme import status as S
from nvmeof_roce.nvme.command import NVM_DSM, NVM_FLUSH, NVM_READ, NVM_WRITE, NVM_WRITE_ZEROES, SQE
from nvmeof_roce.nvme.status import NvmeStatusError

from loopback_env import ADDR1, HOST_A, HOST_B, Env, port, ram_ns

HOST_C = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-00000000c003"
SUB = "nqn.2024-01.io.test:resv"
ID_A = "00000000-0000-4000-8000-0000000000aa"
ID_B = "00000000-0000-4000-8000-0000000000bb"
ID_C = "00000000-0000-4000-8000-0000000000cc"
KEY_A, KEY_B, KEY_C = 0xA1, 0xB2, 0xC3
NS_UUID = "4f1b7c9e-2d3a-4b5c-8d6e-7f8091a2b3c4"
CONFLICT = S.RESERVATION_CONFLICT | S.DNR


def config(resv: bool = True, **ns_extra) -> dict:
    ns = ram_ns(1, "1M", device={"uuid": NS_UUID}, **ns_extra)
    if resv:
        ns["resv"] = {"enable": "1"}
    return {"hosts": [{"nqn": HOST_A}, {"nqn": HOST_B}, {"nqn": HOST_C}], "ports": [port(1, ADDR1, [SUB])],
            "subsystems": [{"nqn": SUB, "attr": {"allow_any_host": "1"}, "namespaces": [ns, ram_ns(2, "1M")]}]}


class Hosts:
    def __init__(self, env: Env):
        self.env = env
        self.a = env.connect(SUB, hostnqn=HOST_A, hostid=ID_A, num_io_queues=1)
        self.b = env.connect(SUB, hostnqn=HOST_B, hostid=ID_B, num_io_queues=1)
        self.c = env.connect(SUB, hostnqn=HOST_C, hostid=ID_C, num_io_queues=1)


@pytest.fixture
def env(tmp_path):
    e = Env(config(), reservation_file=str(tmp_path / "resv.json"))
    yield e
    e.close()


@pytest.fixture
def hosts(env):
    return Hosts(env)


def status_of(fn, *args, **kwargs) -> int:
    """0, or the NVMe status the command failed with (DNR kept)."""
    try:
        fn(*args, **kwargs)
    except NvmeStatusError as exc:
        return exc.status
    return 0


# The spec's table ("Command Behavior in the Presence of a Reservation"), written out by hand: for each type,
# what the holder, a registrant and another host may do, reads and writes.
SPEC = {
    R.WRITE_EXCLUSIVE: {"holder": "rw", "registrant": "r", "other": "r"},
    R.EXCLUSIVE_ACCESS: {"holder": "rw", "registrant": "", "other": ""},
    R.WRITE_EXCLUSIVE_REG_ONLY: {"holder": "rw", "registrant": "rw", "other": "r"},
    R.EXCLUSIVE_ACCESS_REG_ONLY: {"holder": "rw", "registrant": "rw", "other": ""},
    R.WRITE_EXCLUSIVE_ALL_REGS: {"holder": "rw", "registrant": "rw", "other": "r"},
    R.EXCLUSIVE_ACCESS_ALL_REGS: {"holder": "rw", "registrant": "rw", "other": ""},
}
COMMANDS = {NVM_READ: "r", NVM_WRITE: "w", NVM_FLUSH: "w", NVM_WRITE_ZEROES: "w", NVM_DSM: "w"}
PATTERN = b"\x5a" * 512


def run(ctrl, opc: int) -> int:
    if opc == NVM_READ:
        return status_of(ctrl.read, 1, 0, 1)
    if opc == NVM_WRITE:
        return status_of(ctrl.write, 1, 0, b"\xee" * 512)
    if opc == NVM_FLUSH:
        return status_of(ctrl.flush, 1)
    if opc == NVM_WRITE_ZEROES:
        return status_of(ctrl.write_zeroes, 1, 0, 1)
    return status_of(ctrl.dsm_deallocate, 1, [(0, 1)])


@pytest.mark.parametrize("rtype", sorted(SPEC), ids=lambda t: R.TYPE_NAMES[t])
@pytest.mark.parametrize("opc", sorted(COMMANDS), ids=lambda o: {NVM_READ: "read", NVM_WRITE: "write",
                                                                 NVM_FLUSH: "flush", NVM_WRITE_ZEROES: "write-zeroes",
                                                                 NVM_DSM: "dsm"}[o])
@pytest.mark.parametrize("role", ["holder", "registrant", "other"])
def test_conflict_table(hosts, rtype, opc, role):
    a, b, c = hosts.a, hosts.b, hosts.c
    a.write(1, 0, PATTERN)
    a.resv_register(1, nrkey=KEY_A)
    b.resv_register(1, nrkey=KEY_B)
    a.resv_acquire(1, rtype, KEY_A)
    ctrl = {"holder": a, "registrant": b, "other": c}[role]
    allowed = COMMANDS[opc] in SPEC[rtype][role]
    assert run(ctrl, opc) == (0 if allowed else CONFLICT)
    if not allowed and COMMANDS[opc] == "w":
        assert a.read(1, 0, 1) == PATTERN  # the refused command never reached the medium
    # a namespace without reservations is not affected
    assert status_of(ctrl.write, 2, 0, PATTERN) == 0


def test_without_reservation_everything_passes_and_commands_are_invalid_where_not_enabled(hosts):
    a, c = hosts.a, hosts.c
    a.resv_register(1, nrkey=KEY_A)  # registered, nothing held: no restriction
    for opc in COMMANDS:
        assert run(c, opc) == 0
    # namespace 2 has no "resv": its reservation commands are Invalid Opcode, as nvmet's
    assert status_of(a.resv_register, 2, nrkey=1) == S.INVALID_OPCODE | S.DNR
    assert a.identify_namespace(2).rescap == 0
    rescap = a.identify_namespace(1).rescap
    assert rescap == I.RESCAP_PTPL | I.RESCAP_IEKEY_13 | sum(1 << t for t in R.TYPES)
    assert a.identify_controller().oncs & I.ONCS_RESERVATIONS
    assert a.identify_namespace(1).nmic & 1  # may be shared by several controllers


def test_register_edge_cases(hosts):
    a, b = hosts.a, hosts.b
    assert status_of(a.resv_register, 1, nrkey=KEY_A) == 0
    assert status_of(a.resv_register, 1, nrkey=KEY_A) == 0  # again with the same key: nothing changes
    assert status_of(a.resv_register, 1, nrkey=0x99) == CONFLICT  # registered with another key
    # unregister or replace: the current key must match, unless IEKEY
    assert status_of(a.resv_register, 1, R.UNREGISTER, crkey=0x99) == CONFLICT
    assert status_of(a.resv_register, 1, R.REPLACE, crkey=0x99, nrkey=0x77) == CONFLICT
    assert status_of(a.resv_register, 1, R.REPLACE, crkey=KEY_A, nrkey=0x77) == 0
    assert a.resv_report(1).registrants[0].rkey == 0x77
    assert status_of(a.resv_register, 1, R.REPLACE, nrkey=0x78, iekey=True) == 0
    assert a.resv_report(1).registrants[0].rkey == 0x78
    assert status_of(b.resv_register, 1, R.UNREGISTER, crkey=KEY_B) == CONFLICT  # not registered
    assert status_of(b.resv_register, 1, R.REPLACE, nrkey=1, iekey=True) == CONFLICT
    assert status_of(a.resv_register, 1, R.UNREGISTER, iekey=True) == 0
    assert a.resv_report(1).registrants == []
    # a reserved action, a reserved CPTPL
    assert status_of(a.resv_register, 1, 3, nrkey=1) == S.INVALID_FIELD | S.DNR
    assert status_of(a.resv_register, 1, nrkey=1, cptpl=1) == S.INVALID_FIELD | S.DNR


def test_generation_counts_register_preempt_and_clear_only(hosts):
    a, b = hosts.a, hosts.b
    gen = a.resv_report(1).generation
    a.resv_register(1, nrkey=KEY_A)
    b.resv_register(1, nrkey=KEY_B)
    assert a.resv_report(1).generation == gen + 2
    a.resv_acquire(1, R.WRITE_EXCLUSIVE, KEY_A)
    a.resv_release(1, R.WRITE_EXCLUSIVE, KEY_A)
    assert a.resv_report(1).generation == gen + 2  # acquire and release do not count
    b.resv_acquire(1, R.WRITE_EXCLUSIVE, KEY_B, action=R.PREEMPT, prkey=KEY_A)
    assert a.resv_report(1).generation == gen + 3
    b.resv_release(1, 0, KEY_B, action=R.CLEAR)
    assert a.resv_report(1).generation == gen + 4


def test_acquire_edge_cases(hosts):
    a, b = hosts.a, hosts.b
    assert status_of(a.resv_acquire, 1, R.WRITE_EXCLUSIVE, KEY_A) == CONFLICT  # not registered
    a.resv_register(1, nrkey=KEY_A)
    b.resv_register(1, nrkey=KEY_B)
    assert status_of(a.resv_acquire, 1, R.WRITE_EXCLUSIVE, 0x99) == CONFLICT  # wrong key
    assert status_of(a.resv_acquire, 1, 7, KEY_A) == S.INVALID_FIELD | S.DNR  # no such type
    assert status_of(a.resv_acquire, 1, R.WRITE_EXCLUSIVE, KEY_A, action=3) == S.INVALID_FIELD | S.DNR
    assert status_of(a.resv_acquire, 1, R.WRITE_EXCLUSIVE, KEY_A) == 0
    assert status_of(a.resv_acquire, 1, R.WRITE_EXCLUSIVE, KEY_A) == 0  # held already as asked
    assert status_of(a.resv_acquire, 1, R.EXCLUSIVE_ACCESS, KEY_A) == CONFLICT  # held, another type
    assert status_of(b.resv_acquire, 1, R.WRITE_EXCLUSIVE, KEY_B) == CONFLICT  # held by another host
    report = a.resv_report(1)
    assert report.rtype == R.WRITE_EXCLUSIVE
    assert [(r.hostid.hex(), r.holds, r.rkey, r.cntlid) for r in report.registrants] == [
        (ID_A.replace("-", ""), True, KEY_A, R.CNTLID_DYNAMIC), (ID_B.replace("-", ""), False, KEY_B,
                                                                 R.CNTLID_DYNAMIC)]


def test_preempt_with_a_zero_key(hosts):
    a, b, c = hosts.a, hosts.b, hosts.c
    for ctrl, key in ((a, KEY_A), (b, KEY_B), (c, KEY_C)):
        ctrl.resv_register(1, nrkey=key)
    a.resv_acquire(1, R.WRITE_EXCLUSIVE, KEY_A)
    # a zero key may not preempt a holder with another key
    assert status_of(b.resv_acquire, 1, R.WRITE_EXCLUSIVE, KEY_B, action=R.PREEMPT, prkey=0) == \
        S.INVALID_FIELD | S.DNR
    a.resv_release(1, R.WRITE_EXCLUSIVE, KEY_A)
    # All Registrants: a zero key preempts every other registrant, the preempting host holds it
    a.resv_acquire(1, R.WRITE_EXCLUSIVE_ALL_REGS, KEY_A)
    assert b.resv_report(1).registrants[1].holds  # every registrant holds it
    b.resv_acquire(1, R.EXCLUSIVE_ACCESS, KEY_B, action=R.PREEMPT, prkey=0)
    report = b.resv_report(1)
    assert report.rtype == R.EXCLUSIVE_ACCESS
    assert [(r.hostid.hex(), r.holds) for r in report.registrants] == [(ID_B.replace("-", ""), True)]
    assert run(a, NVM_READ) == CONFLICT


def test_preempt_without_a_holder_removes_the_key(hosts):
    a, b = hosts.a, hosts.b
    a.resv_register(1, nrkey=KEY_A)
    b.resv_register(1, nrkey=KEY_B)
    assert status_of(b.resv_acquire, 1, R.WRITE_EXCLUSIVE, KEY_B, action=R.PREEMPT, prkey=0x99) == CONFLICT
    b.resv_acquire(1, R.WRITE_EXCLUSIVE, KEY_B, action=R.PREEMPT, prkey=KEY_A)
    report = b.resv_report(1)
    assert report.rtype == 0 and [r.rkey for r in report.registrants] == [KEY_B]


def test_release_and_clear(hosts):
    a, b, c = hosts.a, hosts.b, hosts.c
    a.resv_register(1, nrkey=KEY_A)
    b.resv_register(1, nrkey=KEY_B)
    a.resv_acquire(1, R.EXCLUSIVE_ACCESS, KEY_A)
    assert status_of(b.resv_release, 1, R.EXCLUSIVE_ACCESS, KEY_B) == 0  # not the holder: nothing to release
    assert b.resv_report(1).rtype == R.EXCLUSIVE_ACCESS
    assert status_of(a.resv_release, 1, R.EXCLUSIVE_ACCESS, 0x99) == CONFLICT  # wrong key
    assert status_of(c.resv_release, 1, R.EXCLUSIVE_ACCESS, 0) == CONFLICT  # not registered
    assert status_of(a.resv_release, 1, R.WRITE_EXCLUSIVE, KEY_A) == S.INVALID_FIELD | S.DNR  # another type
    assert status_of(a.resv_release, 1, R.EXCLUSIVE_ACCESS, KEY_A) == 0
    assert b.resv_report(1).rtype == 0 and run(c, NVM_WRITE) == 0
    a.resv_acquire(1, R.EXCLUSIVE_ACCESS, KEY_A)
    assert status_of(b.resv_release, 1, 0, KEY_B, action=R.CLEAR) == 0
    report = b.resv_report(1)
    assert report.rtype == 0 and report.registrants == []
    assert run(c, NVM_READ) == 0


def test_all_registrants_every_registrant_holds_acquires_and_releases_it(hosts):
    """Under an All Registrants type each registrant is a reservation holder: a second registrant acquiring the
    same type succeeds and changes nothing, and any of them releases it (kernel nvmet answers the first Reservation
    Conflict and takes the second as a no-op: docs/reservations.md, "Compared with kernel nvmet")."""
    a, b = hosts.a, hosts.b
    a.resv_register(1, nrkey=KEY_A)
    b.resv_register(1, nrkey=KEY_B)
    a.resv_acquire(1, R.WRITE_EXCLUSIVE_ALL_REGS, KEY_A)
    gen = a.resv_report(1).generation
    assert status_of(b.resv_acquire, 1, R.WRITE_EXCLUSIVE_ALL_REGS, KEY_B) == 0
    assert status_of(b.resv_acquire, 1, R.EXCLUSIVE_ACCESS_ALL_REGS, KEY_B) == CONFLICT  # another type
    report = a.resv_report(1)
    assert (report.rtype, report.generation, [r.holds for r in report.registrants]) == (
        R.WRITE_EXCLUSIVE_ALL_REGS, gen, [True, True])
    assert status_of(b.resv_release, 1, R.WRITE_EXCLUSIVE_ALL_REGS, KEY_B) == 0
    report = a.resv_report(1)
    assert report.rtype == 0 and [r.holds for r in report.registrants] == [False, False]
    assert a.resv_notification().log_type == R.LOG_RESERVATION_RELEASED  # the other registrant is told
    assert status_of(a.resv_release, 1, R.WRITE_EXCLUSIVE_ALL_REGS, KEY_A) == 0  # nothing left to release


def test_the_holder_preempting_another_hosts_key_unregisters_it_and_keeps_its_type(hosts):
    """A PRKEY that is neither the holder's key nor 0 unregisters the registrants with that key and leaves the
    reservation as it is, also when the holder itself preempts (kernel nvmet changes the type instead)."""
    a, b = hosts.a, hosts.b
    a.resv_register(1, nrkey=KEY_A)
    b.resv_register(1, nrkey=KEY_B)
    a.resv_acquire(1, R.WRITE_EXCLUSIVE, KEY_A)
    gen = a.resv_report(1).generation
    assert status_of(a.resv_acquire, 1, R.EXCLUSIVE_ACCESS, KEY_A, action=R.PREEMPT, prkey=KEY_B) == 0
    report = a.resv_report(1)
    assert (report.rtype, report.generation, [(r.rkey, r.holds) for r in report.registrants]) == (
        R.WRITE_EXCLUSIVE, gen + 1, [(KEY_A, True)])
    assert run(b, NVM_WRITE) == CONFLICT and run(b, NVM_READ) == 0
    # its own key changes the type
    assert status_of(a.resv_acquire, 1, R.EXCLUSIVE_ACCESS, KEY_A, action=R.PREEMPT, prkey=KEY_A) == 0
    assert a.resv_report(1).rtype == R.EXCLUSIVE_ACCESS and run(b, NVM_READ) == CONFLICT


def test_a_reserved_release_action_is_an_invalid_field(hosts):
    a = hosts.a
    a.resv_register(1, nrkey=KEY_A)
    assert status_of(a.resv_release, 1, 0, KEY_A, action=2) == S.INVALID_FIELD | S.DNR  # nvmet: Invalid Opcode


def test_report_needs_the_extended_structure_and_may_be_cut_short(hosts):
    a, b = hosts.a, hosts.b
    a.resv_register(1, nrkey=KEY_A)
    b.resv_register(1, nrkey=KEY_B)
    # our host identifiers are 128 bits: without EDS, Host Identifier Inconsistent Format (as nvmet)
    assert status_of(a.resv_report, 1, eds=False) == S.HOST_ID_INCONSISTENT | S.DNR
    short = a.resv_report(1, length=R.STATUS_EXT_SIZE + 64)  # room for one of the two
    assert short.regctl == 2 and len(short.registrants) == 1


def test_the_holder_keeps_its_reservation_across_a_reconnect_and_a_second_controller(env, hosts):
    a, c = hosts.a, hosts.c
    a.resv_register(1, nrkey=KEY_A)
    a.resv_acquire(1, R.WRITE_EXCLUSIVE, KEY_A)
    a.close()
    env.fabric.pump()
    a2 = env.connect(SUB, hostnqn=HOST_A, hostid=ID_A, num_io_queues=1)  # the same host identifier
    a3 = env.connect(SUB, hostnqn=HOST_A, hostid=ID_A, num_io_queues=1)  # its second controller
    assert a2.resv_report(1).registrants[0].holds
    assert run(a2, NVM_WRITE) == 0 and run(a3, NVM_WRITE) == 0
    assert run(c, NVM_WRITE) == CONFLICT


def test_notification_log_and_event(env, hosts):
    a, b, c = hosts.a, hosts.b, hosts.c
    for ctrl, key in ((a, KEY_A), (b, KEY_B), (c, KEY_C)):
        ctrl.resv_register(1, nrkey=key)
    a.resv_acquire(1, R.WRITE_EXCLUSIVE_REG_ONLY, KEY_A)
    a.resv_release(1, R.WRITE_EXCLUSIVE_REG_ONLY, KEY_A)  # the other registrants are told: released
    env.fabric.pump()
    b.poll_admin()
    assert b.events == [(A.AER_TYPE_IO_CMD_SET, A.AER_RESV_LOG_AVAILABLE, A.LID_RESERVATION)]
    entry = b.resv_notification()
    assert (entry.log_type, entry.nsid, entry.available) == (R.LOG_RESERVATION_RELEASED, 1, 0)
    assert b.resv_notification().count == 0  # taken: the log is empty now
    a.poll_admin()
    assert a.events == [] and a.resv_notification().count == 0  # the releasing host is not told
    # c masks "released" for namespace 1: its log stays empty
    c.resv_notification()  # take the first one
    assert c.admin_command(SQE(opc=0x09, nsid=1, cdw10=A.FEAT_RESV_MASK,
                               cdw11=1 << R.LOG_RESERVATION_RELEASED)).ok
    assert c.admin_command(SQE(opc=0x0A, nsid=1, cdw10=A.FEAT_RESV_MASK)).result == 1 << R.LOG_RESERVATION_RELEASED
    a.resv_acquire(1, R.WRITE_EXCLUSIVE_REG_ONLY, KEY_A)
    a.resv_release(1, R.WRITE_EXCLUSIVE_REG_ONLY, KEY_A)
    assert c.resv_notification().count == 0
    assert b.resv_notification().log_type == R.LOG_RESERVATION_RELEASED
    # a mask bit that does not exist
    assert status_of(c.admin_command, SQE(opc=0x09, nsid=1, cdw10=A.FEAT_RESV_MASK, cdw11=1)) == \
        S.INVALID_FIELD | S.DNR
    # preempted: the preempted host gets "registration preempted"
    a.resv_acquire(1, R.WRITE_EXCLUSIVE, KEY_A)
    a.resv_acquire(1, R.WRITE_EXCLUSIVE, KEY_A, action=R.PREEMPT, prkey=KEY_B)
    entry = b.resv_notification()
    assert (entry.log_type, entry.nsid) == (R.LOG_REGISTRATION_PREEMPTED, 1)


def test_ptpl_across_a_restart(tmp_path):
    path = str(tmp_path / "resv.json")
    env = Env(config(), reservation_file=path)
    a = env.connect(SUB, hostnqn=HOST_A, hostid=ID_A, num_io_queues=1)
    a.resv_register(1, nrkey=KEY_A, cptpl=R.CPTPL_SET)
    a.resv_acquire(1, R.EXCLUSIVE_ACCESS, KEY_A)
    assert a.admin_command(SQE(opc=0x0A, nsid=1, cdw10=A.FEAT_RESV_PERSIST)).result == 1
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    env.close()
    env = Env(config(), reservation_file=path)  # the target restarts
    c = env.connect(SUB, hostnqn=HOST_C, hostid=ID_C, num_io_queues=1)
    report = c.resv_report(1)
    assert (report.rtype, report.ptpls, [r.rkey for r in report.registrants]) == (R.EXCLUSIVE_ACCESS, True, [KEY_A])
    assert run(c, NVM_READ) == CONFLICT
    a = env.connect(SUB, hostnqn=HOST_A, hostid=ID_A, num_io_queues=1)
    assert run(a, NVM_WRITE) == 0
    # PTPL cleared (Set Features 0x83): the next restart forgets it
    assert a.admin_command(SQE(opc=0x09, nsid=1, cdw10=A.FEAT_RESV_PERSIST, cdw11=0)).ok
    assert a.admin_command(SQE(opc=0x0A, nsid=1, cdw10=A.FEAT_RESV_PERSIST)).result == 0
    env.close()
    env = Env(config(), reservation_file=path)
    c = env.connect(SUB, hostnqn=HOST_C, hostid=ID_C, num_io_queues=1)
    report = c.resv_report(1)
    assert report.rtype == 0 and report.registrants == [] and run(c, NVM_WRITE) == 0
    env.close()


def test_without_a_reservation_file_ptpl_is_refused_and_a_restart_clears():
    env = Env(config())
    a = env.connect(SUB, hostnqn=HOST_A, hostid=ID_A, num_io_queues=1)
    assert not a.identify_namespace(1).rescap & I.RESCAP_PTPL
    assert status_of(a.resv_register, 1, nrkey=KEY_A, cptpl=R.CPTPL_SET) == S.INVALID_FIELD | S.DNR
    assert status_of(a.admin_command, SQE(opc=0x09, nsid=1, cdw10=A.FEAT_RESV_PERSIST, cdw11=1)) == \
        S.INVALID_FIELD | S.DNR
    a.resv_register(1, nrkey=KEY_A)
    a.resv_acquire(1, R.EXCLUSIVE_ACCESS, KEY_A)
    env.close()
    env = Env(config())
    c = env.connect(SUB, hostnqn=HOST_C, hostid=ID_C, num_io_queues=1)
    assert c.resv_report(1).registrants == [] and run(c, NVM_WRITE) == 0
    env.close()


def test_a_namespace_whose_uuid_changed_is_not_restored(tmp_path, caplog):
    path = str(tmp_path / "resv.json")
    env = Env(config(), reservation_file=path)
    a = env.connect(SUB, hostnqn=HOST_A, hostid=ID_A, num_io_queues=1)
    a.resv_register(1, nrkey=KEY_A, cptpl=R.CPTPL_SET)
    env.close()
    data = json.load(open(path))
    data["reservations"][SUB]["1"]["uuid"] = "00" * 16
    open(path, "w").write(json.dumps(data))
    env = Env(config(), reservation_file=path)
    assert env.target.subsystems[SUB].namespaces[1].resv.registrants == {}
    assert "its UUID changed" in caplog.text
    env.close()


def test_preempt_and_abort(tmp_path):
    # B's writes over a QoS limit wait in the core; A's preempt and abort answers them, and B's later ones conflict
    env = Env(config(nvmeof_roce={"backend": "ram", "size": "1M", "qos": {"rw_ios_per_sec": 1000}}))
    hosts = Hosts(env)
    a, b = hosts.a, hosts.b
    a.resv_register(1, nrkey=KEY_A)
    b.resv_register(1, nrkey=KEY_B)
    b.resv_acquire(1, R.WRITE_EXCLUSIVE, KEY_B)
    done = []
    for i in range(40):
        b.submit_write(1, i, PATTERN, done.append, block_size=512)
    env.fabric.pump()
    b.poll_completions()
    held = env.target.subsystems[SUB].namespaces[1].qos.held
    assert len(held) > 0  # some wait for their tokens
    waiting = len(held)
    a.resv_acquire(1, R.WRITE_EXCLUSIVE, KEY_A, action=R.PREEMPT_AND_ABORT, prkey=KEY_B)
    env.fabric.pump()
    b.wait_idle()
    statuses = [c.status for c in done]
    assert statuses.count(S.PREEMPT_ABORT) == waiting and statuses.count(0) == 40 - waiting
    assert run(b, NVM_WRITE) == CONFLICT
    assert [r.rkey for r in a.resv_report(1).registrants] == [KEY_A]
    env.close()


def test_a_write_whose_data_arrives_after_a_preempt_conflicts(env, hosts):
    # an 8 KiB write is larger than the in-capsule data: its data comes by RDMA READ after the capsule
    a, b = hosts.a, hosts.b
    a.resv_register(1, nrkey=KEY_A)
    b.resv_register(1, nrkey=KEY_B)
    done = []
    b.submit_write(1, 0, b"\x11" * 8192, done.append, block_size=512)
    ns = env.target.subsystems[SUB].namespaces[1]
    # the capsule reached the target, the data has not: A takes Exclusive Access now, as the engine would
    env.fabric.pump(max_ops=1)
    ns.resv.holder, ns.resv.rtype = bytes.fromhex(ID_A.replace("-", "")), R.EXCLUSIVE_ACCESS
    env.fabric.pump()
    b.wait_idle()
    assert [c.status for c in done] == [CONFLICT]
    assert a.read(1, 0, 16) == bytes(8192)


def test_config_is_served_and_the_live_change_refused_while_registered(env, hosts):
    assert validate_for_userspace(parse_config(config(), "c.json")) == []
    a = hosts.a
    a.resv_register(1, nrkey=KEY_A)
    new = parse_config(config(resv=False), "new.json")
    changes = live.plan(env.target.config, new)
    assert [c.action for c in changes] == ["namespace-reservations"]
    with pytest.raises(ConfigError) as ei:
        live.apply(env.target, new, None, changes)
    assert ei.value.where == "subsystems[0].namespaces[0].resv.enable"
    assert "1 host(s) are registered" in ei.value.problem and "resv-release" in ei.value.fix
    assert env.target.subsystems[SUB].namespaces[1].resv is not None
    a.resv_register(1, R.UNREGISTER, crkey=KEY_A)
    live.apply(env.target, new, None, live.plan(env.target.config, new))
    env.fabric.pump()
    assert env.target.subsystems[SUB].namespaces[1].resv is None
    assert status_of(a.resv_register, 1, nrkey=KEY_A) == S.INVALID_OPCODE | S.DNR
    assert a.identify_namespace(1).rescap == 0


def test_rpc_get_and_set_reservation(env, hosts, tmp_path):
    from nvmeof_roce.control.methods import Control, RpcError
    path = tmp_path / "c.json"
    path.write_text(json.dumps(config()))
    m = Control(env.target, config_path=str(path))
    hosts.a.resv_register(1, nrkey=KEY_A)
    hosts.a.resv_acquire(1, R.WRITE_EXCLUSIVE, KEY_A)
    got = m.call("nvmeof_ns_get_reservation", {"nqn": SUB, "nsid": 1})
    assert got["holder"] == ID_A.replace("-", "") and got["type"] == "write-exclusive"
    assert got["registrants"] == [{"hostid": ID_A.replace("-", ""), "rkey": KEY_A, "holds": True}]
    with pytest.raises(RpcError) as ei:
        m.call("nvmeof_ns_get_reservation", {"nqn": SUB, "nsid": 2})
    assert "has no reservations" in str(ei.value)
    with pytest.raises(RpcError) as ei:
        m.call("nvmeof_ns_set_reservation", {"nqn": SUB, "nsid": 1, "enable": False})
    assert "registered" in str(ei.value)
    assert m.call("nvmeof_ns_set_reservation", {"nqn": SUB, "nsid": 2, "enable": True}) is True
    env.fabric.pump()
    assert m.call("nvmeof_ns_get_reservation", {"nqn": SUB, "nsid": 2})["registrants"] == []


def test_target_status_shows_the_reservation(env, hosts):
    from nvmeof_roce.control.stats import target_status
    hosts.b.resv_register(1, nrkey=KEY_B)
    hosts.b.resv_acquire(1, R.EXCLUSIVE_ACCESS_REG_ONLY, KEY_B)
    ns = target_status(env.target)["subsystems"][0]["namespaces"]
    assert ns[0]["reservation"]["type"] == "exclusive-access-registrants-only"
    assert ns[0]["reservation"]["holder"] == ID_B.replace("-", "")
    assert ns[1]["reservation"] is None
