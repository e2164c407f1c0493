"""The request lifecycle (transport/lifecycle.py) as the core lives it: transitions are checked, a handler
answers with one explicit Outcome, and the effects log is generated from the handlers' declarations."""
import logging

import pytest

from loopback_env import SUB_RAM, Env, RawQueue, raw_connect, raw_enable, standard_config
from nvmeof_roce.nvme import admin as A
from nvmeof_roce.nvme import log as L
from nvmeof_roce.nvme import status as S
from nvmeof_roce.nvme.command import SQE
from nvmeof_roce.engine import admin, io, reservations
from nvmeof_roce.engine.request import Outcome, Request
from nvmeof_roce.transport import lifecycle
from nvmeof_roce.transport.lifecycle import IllegalTransition, RequestState

VENDOR_OPC = 0xC1  # an I/O opcode no handler has: the tests below give it one


def io_queue(env: Env) -> RawQueue:
    admin_q, cqe = raw_connect(env.connector(), SUB_RAM)
    assert cqe.status == 0
    raw_enable(admin_q)
    q, cqe = raw_connect(env.connector(), SUB_RAM, qid=1, cntlid=cqe.result & 0xFFFF, sqsize=15)
    assert cqe.status == 0
    return q


def with_vendor_handler(env: Env, handler) -> None:
    env.target.io_commands = dict(env.target.io_commands)  # a copy: the module's table is shared
    env.target.io_commands[VENDOR_OPC] = handler


def test_move_allows_the_lifecycle_edges_and_raises_on_any_other():
    class Thing:
        state = RequestState.FREE

        def __repr__(self):
            return "<thing>"

    thing = Thing()
    for new in (RequestState.NEW, RequestState.EXECUTING, RequestState.TRANSFERRING_HOST_TO_CONTROLLER,
                RequestState.EXECUTING, RequestState.HELD, RequestState.FREE):
        lifecycle.move(thing, new)
    with pytest.raises(IllegalTransition, match="FREE -> EXECUTING"):
        lifecycle.move(thing, RequestState.EXECUTING)
    with pytest.raises(IllegalTransition, match="FREE -> FREE"):  # a double free
        lifecycle.move(thing, RequestState.FREE)
    assert thing.state == RequestState.FREE


def test_completing_a_request_twice_raises_and_is_counted_not_sent_twice(caplog):
    env = Env(standard_config())
    raised = []

    def twice(t, req: Request):
        outcome = t.complete(req, 0)
        try:
            t.complete(req, 0)
        except IllegalTransition as exc:
            raised.append(exc)
            raise
        return outcome

    with_vendor_handler(env, twice)
    q = io_queue(env)
    with caplog.at_level(logging.ERROR, "nvmeof_roce.engine.core"):
        cqe = q.command(SQE(opc=VENDOR_OPC, nsid=1))
    assert cqe.status == 0  # the one completion that was legal
    assert q.poll_one(tries=2) is None  # and no second one
    assert len(raised) == 1 and "FREE -> FREE" in str(raised[0])
    assert env.target.internal_errors == 1
    assert "illegal request transition" in caplog.text
    env.close()


def test_a_handler_without_an_outcome_is_answered_internal_error_and_frees_its_slot(caplog):
    env = Env(standard_config())
    with_vendor_handler(env, lambda t, req: None)  # a missing branch: neither completes, fetches nor holds
    q = io_queue(env)
    qs = env.target.queue_state(q.transport._conn.target)
    before = qs.active
    with caplog.at_level(logging.ERROR, "nvmeof_roce.engine.core"):
        cqe = q.command(SQE(opc=VENDOR_OPC, nsid=1))
    assert cqe.status == S.INTERNAL | S.DNR
    assert qs.active == before  # the request went back to the queue's pool
    assert env.target.internal_errors == 1
    assert "returned no outcome" in caplog.text
    env.close()


def test_every_handler_returns_an_outcome_on_the_paths_the_host_reaches(env):
    """Wrap every admin and I/O handler: the outcome of each call of a whole session is an Outcome."""
    seen = []

    def wrap(handler):
        def wrapped(t, req):
            outcome = handler(t, req)
            seen.append((handler.__name__, outcome))
            return outcome
        return wrapped

    env.target.admin_commands = {op: wrap(h) for op, h in admin.COMMANDS.handlers.items()}
    env.target.io_commands = {op: wrap(h) for op, h in io.COMMANDS.handlers.items()}
    ctrl = env.connect(SUB_RAM)
    ctrl.write(1, 0, bytes(range(256)) * 4)
    assert ctrl.read(1, 0, 2) == bytes(range(256)) * 4
    ctrl.flush(1)
    ctrl.write_zeroes(1, 0, 1)
    ctrl.dsm_deallocate(1, [(0, 1)])
    ctrl.keep_alive()
    ctrl.get_log_page(A.LID_CMD_EFFECTS, 4096)
    ctrl.close()
    names = {name for name, _ in seen}
    assert {"_read", "_write", "_flush", "_write_zeroes", "_dsm", "_identify", "keep_alive", "async_event",
            "_set_features", "_get_log_page"} <= names
    assert all(isinstance(outcome, Outcome) for _, outcome in seen), seen
    assert ("async_event", Outcome.HELD) in seen


def test_the_effects_log_lists_exactly_the_handled_opcodes(env):
    ctrl = env.connect(SUB_RAM)
    effects = L.CommandEffectsLog.unpack(ctrl.get_log_page(A.LID_CMD_EFFECTS, 4096))
    ctrl.close()
    supported_admin = {op for op, value in effects.admin.items() if value & L.EFFECT_CSUPP}
    supported_io = {op for op, value in effects.io.items() if value & L.EFFECT_CSUPP}
    assert supported_admin == set(admin.COMMANDS.handlers) == set(env.target.admin_commands)
    assert supported_io == set(io.COMMANDS.handlers) | set(reservations.COMMANDS.handlers) == \
        set(env.target.io_commands)
    # what each declares: the commands that change the medium say so (LBCC)
    for op, declared in io.COMMANDS.effects.items():
        assert effects.io[op] == declared
    assert effects.io[0x01] & L.EFFECT_LBCC and not effects.io[0x02] & L.EFFECT_LBCC


def test_a_table_refuses_a_second_handler_for_one_opcode():
    from nvmeof_roce.engine.handlers import CommandTable
    table = CommandTable("test")
    table.handles(0x01)(lambda t, req: None)
    with pytest.raises(ValueError, match="two handlers"):
        table.handles(0x01)(lambda t, req: None)
