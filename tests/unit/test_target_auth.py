"""DH-HMAC-CHAP in the userspace target, over the loopback transport.

Our initiator against our target for the good paths and the refusals the lab shows with the kernel
host; hand-built Authentication Send / Receive capsules for every malformed or out-of-order message,
each answered with the AUTH_Failure1 reason nvmet gives.
"""
import logging

import pytest

from nvmeof_roce.config import ConfigError
from nvmeof_roce.initiator.auth import HostAuthenticator, HostAuthError
from nvmeof_roce.initiator.controller import HostError
from nvmeof_roce.nvme import auth as A
from nvmeof_roce.nvme import fabrics as F
from nvmeof_roce.nvme import status as S
from nvmeof_roce.nvme.admin import IdentifyCommand
from nvmeof_roce.nvme.command import SQE

from loopback_env import ADDR1, HOST_A, HOST_B, Env, port, raw_connect, ram_ns

SUB = "nqn.2024-01.io.test:auth"
SUB_OPEN = "nqn.2024-01.io.test:open"
KEY = A.generate_secret(1, 32)  # as `nvme gen-dhchap-key -m 1` makes one
CTRL_KEY = A.generate_secret(3, 64)
OTHER_KEY = A.generate_secret(1, 32)


def auth_config(dhchap=None, **extra) -> dict:
    group = {"key": KEY, "hash": "hmac(sha256)", "dhgroup": "null"}
    if dhchap:
        group.update(dhchap)
    return {
        "hosts": [{"nqn": HOST_A, "dhchap": group}, {"nqn": HOST_B}],
        "ports": [port(1, ADDR1, [SUB, SUB_OPEN])],
        "subsystems": [
            {"nqn": SUB, "attr": {"allow_any_host": "0"}, "allowed_hosts": [HOST_A, HOST_B],
             "namespaces": [ram_ns(1, "1M")]},
            {"nqn": SUB_OPEN, "namespaces": [ram_ns(1, "1M")]},
        ],
    }


@pytest.fixture
def make_env():
    envs = []

    def make(dhchap=None):
        env = Env(auth_config(dhchap))
        envs.append(env)
        return env

    yield make
    for env in envs:
        env.close()


def _io_round_trip(ctrl):
    data = bytes(range(256)) * 2
    ctrl.write(1, 3, data)
    assert ctrl.read(1, 3, 1) == data


@pytest.mark.parametrize("hash_name", ["hmac(sha256)", "hmac(sha384)", "hmac(sha512)"])
@pytest.mark.parametrize("dhgroup", ["null", "ffdhe2048", "ffdhe3072"])
def test_initiator_authenticates_every_queue(make_env, hash_name, dhgroup):
    env = make_env({"hash": hash_name, "dhgroup": dhgroup})
    ctrl = env.connect(SUB, dhchap_secret=KEY, num_io_queues=2)
    assert ctrl.authenticated_queues == [0, 1, 2]
    _io_round_trip(ctrl)
    ctrl.close()


@pytest.mark.parametrize("dhgroup", ["null", "ffdhe2048"])
def test_bidirectional_authentication(make_env, dhgroup, caplog):
    env = make_env({"ctrl_key": CTRL_KEY, "hash": "hmac(sha384)", "dhgroup": dhgroup})
    with caplog.at_level(logging.INFO, logger="nvmeof_roce.engine.auth"):
        ctrl = env.connect(SUB, dhchap_secret=KEY, dhchap_ctrl_secret=CTRL_KEY)
    assert ctrl.authenticated_queues == [0, 1]
    assert "authenticated (bidirectional, hmac(sha384)" in caplog.text
    _io_round_trip(ctrl)
    ctrl.close()


def test_a_target_that_authenticates_the_admin_queue_only_lets_bidirectional_hosts_in(make_env, monkeypatch):
    """As Linux 7.2's nvmet does: AUTHREQ.ATR on the admin queue's Connect only, its I/O queues open without
    authentication.  The controller's key was proved on the admin queue, so the host goes on (as Linux's does)."""
    from nvmeof_roce.engine import fabrics as target_fabrics
    install = target_fabrics._install_queue

    def admin_only(qs, ctrl, sqsize, cattr):
        install(qs, ctrl, sqsize, cattr)
        if qs.qid:
            qs.auth = None
    monkeypatch.setattr(target_fabrics, "_install_queue", admin_only)
    result = target_fabrics._connect_result
    monkeypatch.setattr(target_fabrics, "_connect_result",
                        lambda ctrl: result(ctrl) if not ctrl.io_queues else ctrl.cntlid)
    env = make_env({"ctrl_key": CTRL_KEY})
    ctrl = env.connect(SUB, dhchap_secret=KEY, dhchap_ctrl_secret=CTRL_KEY, num_io_queues=2)
    assert ctrl.authenticated_queues == [0]
    _io_round_trip(ctrl)
    ctrl.close()


def test_no_key_is_refused_and_the_target_says_so(make_env, caplog):
    env = make_env()
    with caplog.at_level(logging.WARNING):
        with pytest.raises(HostError, match="requires DH-HMAC-CHAP"):
            env.connect(SUB)
        env.fabric.pump()
    assert "never started DH-HMAC-CHAP" in caplog.text


def test_wrong_host_key_is_refused(make_env, caplog):
    env = make_env()
    with caplog.at_level(logging.WARNING):
        with pytest.raises(HostAuthError, match="refused authentication: authentication failed"):
            env.connect(SUB, dhchap_secret=OTHER_KEY)
    assert "wrong host key" in caplog.text


def test_wrong_controller_key_is_refused(make_env, caplog):
    env = make_env({"ctrl_key": CTRL_KEY})
    with caplog.at_level(logging.WARNING):
        with pytest.raises(HostAuthError, match="controller authentication failed"):
            env.connect(SUB, dhchap_secret=KEY, dhchap_ctrl_secret=A.generate_secret(3, 64))
    assert "wrong controller key" in caplog.text


def test_controller_key_asked_for_but_not_configured(make_env, caplog):
    env = make_env()
    with caplog.at_level(logging.WARNING):
        with pytest.raises(HostAuthError, match="authentication failed"):
            env.connect(SUB, dhchap_secret=KEY, dhchap_ctrl_secret=CTRL_KEY)
    assert "no controller key is configured" in caplog.text


def test_hosts_without_keys_and_open_subsystems_do_not_authenticate(make_env):
    env = make_env()
    ctrl = env.connect(SUB, hostnqn=HOST_B)  # listed, but no key
    assert ctrl.authenticated_queues == []
    ctrl.close()
    ctrl = env.connect(SUB_OPEN, dhchap_secret=KEY)  # allow_any_host: nvmet_setup_auth skips it
    assert ctrl.authenticated_queues == []
    ctrl.close()
    with pytest.raises(HostError, match="cannot prove its controller key"):
        env.connect(SUB_OPEN, dhchap_secret=KEY, dhchap_ctrl_secret=CTRL_KEY)


# ------------------------------------------------------------------ hand-built capsules

def auth_sqe(q, fctype, length, cdw10=None, sgl_len=None):
    return SQE(opc=F.FABRICS_OPCODE, nsid=fctype, cdw10=A.auth_cdw10() if cdw10 is None else cdw10, cdw11=length,
               sgl=q.keyed(length if sgl_len is None else sgl_len))


def send(q, msg: bytes, **kw):
    q.buf.view[:len(msg)] = msg
    return q.command(auth_sqe(q, F.FCTYPE_AUTH_SEND, len(msg), **kw))


def receive(q, al: int = 4096) -> bytes:
    q.buf.view[:al] = bytes(al)
    cqe = q.command(auth_sqe(q, F.FCTYPE_AUTH_RECV, al))
    assert cqe.status == 0, S.describe(cqe.status)
    return bytes(q.buf.view[:al])


def failure_reason(q) -> int:
    msg = receive(q)
    kind = A.message_kind(msg)
    assert kind[:2] == (A.TYPE_COMMON, A.ID_FAILURE1), kind
    return A.Failure.unpack(msg).reason


@pytest.fixture
def raw(make_env):
    def connect(dhchap=None, qid=0):
        env = make_env(dhchap)
        q, cqe = raw_connect(env.connector(), SUB, HOST_A)
        assert cqe.status == 0 and cqe.result & A.CONNECT_AUTHREQ_ATR
        return env, q
    return connect


def test_connect_sets_authreq_and_commands_wait_for_authentication(raw):
    env, q = raw()
    assert q.command(F.PropertyGet(offset=F.PROP_CAP, size8=True)).status == 0
    assert q.command(F.PropertySet(offset=F.PROP_CC, value=F.CC_DEFAULT | F.CC_EN)).status == S.AUTH_REQUIRED | S.DNR
    assert q.command(IdentifyCommand(cns=1)).status == S.AUTH_REQUIRED | S.DNR
    chap = HostAuthenticator(A.parse_secret(KEY), None, HOST_A, SUB, 0)
    assert send(q, chap.negotiate()).status == 0
    assert send(q, chap.reply(receive(q))).status == 0
    assert chap.success1(receive(q)) is None
    assert q.command(F.PropertySet(offset=F.PROP_CC, value=F.CC_DEFAULT | F.CC_EN)).status == 0
    assert q.command(IdentifyCommand(cns=1), sgl=q.keyed(4096)).status == 0


def test_io_queue_authenticates_on_its_own(raw):
    env, q = raw()
    chap = HostAuthenticator(A.parse_secret(KEY), None, HOST_A, SUB, 0)
    send(q, chap.negotiate())
    send(q, chap.reply(receive(q)))
    chap.success1(receive(q))
    q.command(F.PropertySet(offset=F.PROP_CC, value=F.CC_DEFAULT | F.CC_EN))
    cntlid = 1
    ioq, cqe = raw_connect(env.connector(), SUB, HOST_A, qid=1, cntlid=cntlid)
    assert cqe.status == 0 and cqe.result & A.CONNECT_AUTHREQ_ATR
    read = SQE(opc=0x02, nsid=1, sgl=ioq.keyed(512))
    assert ioq.command(read).status == S.AUTH_REQUIRED | S.DNR
    chap = HostAuthenticator(A.parse_secret(KEY), None, HOST_A, SUB, 1)
    send(ioq, chap.negotiate())
    send(ioq, chap.reply(receive(ioq)))
    chap.success1(receive(ioq))
    assert ioq.command(SQE(opc=0x02, nsid=1, sgl=ioq.keyed(512))).status == 0


def test_reauthentication_and_a_failed_one(raw):
    env, q = raw()
    for attempt in range(2):  # authenticate, then re-authenticate on the same queue
        chap = HostAuthenticator(A.parse_secret(KEY), None, HOST_A, SUB, 0, tid=10 + attempt)
        send(q, chap.negotiate())
        send(q, chap.reply(receive(q)))
        chap.success1(receive(q))
        assert q.command(F.PropertySet(offset=F.PROP_CC, value=F.CC_DEFAULT)).status == 0
    chap = HostAuthenticator(A.parse_secret(OTHER_KEY), None, HOST_A, SUB, 0, tid=12)
    send(q, chap.negotiate())
    send(q, chap.reply(receive(q)))
    assert failure_reason(q) == A.FAILURE_FAILED
    assert q.command(F.PropertySet(offset=F.PROP_CC, value=F.CC_DEFAULT)).status == S.AUTH_REQUIRED | S.DNR


@pytest.mark.parametrize("cdw10,al,sgl_len,status", [
    (A.auth_cdw10(secp=0xEA), 16, None, S.INVALID_FIELD | S.DNR),
    (A.auth_cdw10(spsp0=0), 16, None, S.INVALID_FIELD | S.DNR),
    (A.auth_cdw10(spsp1=2), 16, None, S.INVALID_FIELD | S.DNR),
    (None, 0, None, S.INVALID_FIELD | S.DNR),
    (None, 16, 32, S.SGL_INVALID_DATA | S.DNR),
])
def test_bad_command_fields(raw, cdw10, al, sgl_len, status):
    env, q = raw()
    assert q.command(auth_sqe(q, F.FCTYPE_AUTH_RECV, al, cdw10=cdw10, sgl_len=sgl_len)).status == status
    assert q.command(auth_sqe(q, F.FCTYPE_AUTH_SEND, al, cdw10=cdw10, sgl_len=sgl_len)).status == status


def test_auth_commands_on_a_queue_without_authentication(make_env):
    env = make_env()
    q, cqe = raw_connect(env.connector(), SUB, HOST_B)
    assert cqe.status == 0 and not cqe.result & A.CONNECT_AUTHREQ_ATR
    assert send(q, A.Negotiate(1).pack()).status == S.INVALID_OPCODE | S.DNR
    assert q.command(auth_sqe(q, F.FCTYPE_AUTH_RECV, 64)).status == S.INVALID_OPCODE | S.DNR


def _negotiated(raw, dhchap=None):
    env, q = raw(dhchap)
    chap = HostAuthenticator(A.parse_secret(KEY), None, HOST_A, SUB, 0, tid=5)
    send(q, chap.negotiate())
    return q, chap


def _bad_negotiate(mutate):
    msg = bytearray(A.Negotiate(5).pack())
    mutate(msg)
    return bytes(msg)


@pytest.mark.parametrize("message,reason", [
    (A.Negotiate(5).pack()[:40], A.FAILURE_INCORRECT_PAYLOAD),
    (_bad_negotiate(lambda b: b.__setitem__(7, 0)), A.FAILURE_INCORRECT_PAYLOAD),
    (_bad_negotiate(lambda b: b.__setitem__(8, 9)), A.FAILURE_NOT_USABLE),
    (_bad_negotiate(lambda b: b.__setitem__(6, 1)), A.FAILURE_CONCAT_MISMATCH),
    (_bad_negotiate(lambda b: b.__setitem__(10, 40)), A.FAILURE_INCORRECT_PAYLOAD),
    (A.Negotiate(5, hash_ids=[9]).pack(), A.FAILURE_HASH_UNUSABLE),
    (A.Negotiate(5, dhgroup_ids=[A.DHGROUP_2048]).pack(), A.FAILURE_DHGROUP_UNUSABLE),  # target wants null
    (bytes.fromhex("02 00 0000 0500 0000"), A.FAILURE_INCORRECT_MESSAGE),  # unknown AUTH_Type
    (bytes.fromhex("00 05 0000 0500 0000"), A.FAILURE_INCORRECT_MESSAGE),  # unknown common AUTH_Id
    (bytes.fromhex("00 00 00"), A.FAILURE_INCORRECT_PAYLOAD),  # shorter than the header
    (A.Reply(5, bytes(32)).pack(), A.FAILURE_INCORRECT_MESSAGE),  # a reply before the challenge
    (A.Success2(5).pack(), A.FAILURE_INCORRECT_MESSAGE),
    (A.Failure(5, 1, A.ID_FAILURE2).pack(), A.FAILURE_INCORRECT_MESSAGE),
])
def test_malformed_or_early_first_message(raw, message, reason):
    env, q = raw()
    assert send(q, message).status == 0  # the message's fate is in the next Receive, not the status
    assert failure_reason(q) == reason


def _reply_variant(chap, challenge, kind):
    msg = bytearray(chap.reply(challenge))
    if kind == "tid":
        msg[4] = 6
    elif kind == "hl":
        msg[6] = 48
    elif kind == "short":
        msg = msg[:-1]
    elif kind == "cvalid":
        msg[8] = 2
    elif kind == "seqnum0":
        msg[8] = 1
        msg[12:16] = bytes(4)
    elif kind == "response":
        msg[16] ^= 1
    elif kind == "dh_with_null":
        msg[10] = 4
        msg += b"\x01\x02\x03\x04"
    elif kind == "success1_id":
        msg[1] = A.ID_SUCCESS1
    return bytes(msg)


@pytest.mark.parametrize("kind,reason", [
    ("tid", A.FAILURE_INCORRECT_PAYLOAD), ("hl", A.FAILURE_INCORRECT_PAYLOAD), ("short", A.FAILURE_INCORRECT_PAYLOAD),
    ("cvalid", A.FAILURE_INCORRECT_PAYLOAD), ("seqnum0", A.FAILURE_INCORRECT_PAYLOAD),
    ("response", A.FAILURE_FAILED), ("dh_with_null", A.FAILURE_INCORRECT_PAYLOAD),
    ("success1_id", A.FAILURE_INCORRECT_MESSAGE),
])
def test_malformed_reply(raw, kind, reason):
    q, chap = _negotiated(raw)
    challenge = receive(q)
    assert send(q, _reply_variant(chap, challenge, kind)).status == 0
    assert failure_reason(q) == reason


@pytest.mark.parametrize("value,reason", [(b"\x01", A.FAILURE_DHGROUP_UNUSABLE), (b"", A.FAILURE_INCORRECT_PAYLOAD),
                                          (bytes(257), A.FAILURE_INCORRECT_PAYLOAD)])
def test_bad_dh_value_in_the_reply(raw, value, reason):
    q, chap = _negotiated(raw, {"dhgroup": "ffdhe2048"})
    challenge = A.Challenge.unpack(receive(q))
    assert challenge.dhgroup_id == A.DHGROUP_2048 and len(challenge.dh_value) == 256
    msg = A.Reply(5, bytes(32), dh_value=value).pack()
    assert send(q, msg).status == 0
    assert failure_reason(q) == reason


def test_success2_and_failure2_checked(raw):
    q, chap = _negotiated(raw, {"ctrl_key": CTRL_KEY})
    chap.ctrl_secret = A.parse_secret(CTRL_KEY)
    send(q, chap.reply(receive(q)))
    success2 = chap.success1(receive(q))
    assert send(q, success2[:-1]).status == 0  # a Success2 one byte short
    assert failure_reason(q) == A.FAILURE_INCORRECT_PAYLOAD
    # a new controller (the failure ended this one), then a Success2 with the wrong transaction ID
    q, chap = _negotiated(raw, {"ctrl_key": CTRL_KEY})
    chap.ctrl_secret = A.parse_secret(CTRL_KEY)
    send(q, chap.reply(receive(q)))
    chap.success1(receive(q))
    assert send(q, A.Success2(99).pack()).status == 0
    assert failure_reason(q) == A.FAILURE_INCORRECT_PAYLOAD


def test_receive_out_of_turn_and_too_small(raw):
    env, q = raw()
    assert failure_reason(q) == A.FAILURE_INCORRECT_MESSAGE  # nothing negotiated yet
    q2, chap = _negotiated(raw, {"hash": "hmac(sha512)"})
    q2.buf.view[:64] = bytes(64)
    cqe = q2.command(auth_sqe(q2, F.FCTYPE_AUTH_RECV, 16))  # the 80-byte challenge does not fit
    assert cqe.status == 0
    assert A.Failure.unpack(bytes(q2.buf.view[:16])).reason == A.FAILURE_INCORRECT_PAYLOAD
    assert q2.command(auth_sqe(q2, F.FCTYPE_AUTH_RECV, 4)).status == S.INVALID_FIELD | S.DNR


# ------------------------------------------------------------------ the config

@pytest.mark.parametrize("dhchap,where,what", [
    ({"key": "DHHC-1:01:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8AAAAA:"}, "hosts[0].dhchap.key", "CRC"),
    ({"key": "not a key"}, "hosts[0].dhchap.key", "not a DH-HMAC-CHAP secret"),
    ({"ctrl_key": "DHHC-1:00:xx:"}, "hosts[0].dhchap.ctrl_key", "base64"),
    ({"hash": "hmac(md5)"}, "hosts[0].dhchap.hash", "unknown hash"),
    ({"dhgroup": "ffdhe1024"}, "hosts[0].dhchap.dhgroup", "unknown DH group"),
    ({"key": "", "ctrl_key": CTRL_KEY}, "hosts[0].dhchap.ctrl_key", "without a host key"),
    ({"secret": KEY}, "hosts[0].dhchap.secret", "unknown key"),
])
def test_config_errors_name_the_field(dhchap, where, what):
    with pytest.raises(ConfigError) as err:
        Env(auth_config(dhchap))
    assert err.value.where == where and what in err.value.problem


def test_nvmet_save_shape_with_empty_keys_is_no_authentication():
    cfg = auth_config()
    cfg["hosts"][0]["dhchap"] = {"key": "", "ctrl_key": "", "hash": "hmac(sha256)", "dhgroup": "null"}
    env = Env(cfg)
    ctrl = env.connect(SUB)
    assert ctrl.authenticated_queues == []
    ctrl.close()
    env.close()


def test_an_abandoned_transaction_expires(raw, caplog):
    env, q = raw()
    chap = HostAuthenticator(A.parse_secret(KEY), None, HOST_A, SUB, 0, tid=3)
    send(q, chap.negotiate())
    challenge = receive(q)
    env.clock.advance(119)
    env.target.tick(env.clock())
    assert send(q, chap.reply(challenge)).status == 0  # still within 120 s (no KATO on this raw connect)
    with caplog.at_level(logging.WARNING):
        env.clock.advance(121)
        env.target.tick(env.clock())
    assert "transaction 3 expired in the success1 step" in caplog.text
    assert failure_reason(q) == A.FAILURE_INCORRECT_MESSAGE  # the Success1 is gone with it
    q, _ = raw_connect(env.connector(), SUB, HOST_A)  # that ended the controller; a new one works
    chap = HostAuthenticator(A.parse_secret(KEY), None, HOST_A, SUB, 0, tid=4)
    send(q, chap.negotiate())
    send(q, chap.reply(receive(q)))
    assert chap.success1(receive(q)) is None


# ------------------------------------------------------------------ keys changed while the target runs

def _reload(env, control, tmp_path, dhchap):
    """Reload the running target with HOST_A's dhchap group replaced (None: no key)."""
    data = env.target.config.to_dict()
    if dhchap is None:
        data["hosts"][0].pop("dhchap", None)
    else:
        data["hosts"][0]["dhchap"] = dict({"hash": "hmac(sha256)", "dhgroup": "null"}, **dhchap)
    path = tmp_path / "reloaded.json"
    path.write_text(__import__("json").dumps(data))
    return control.call("nvmeof_reload_config", {"path": str(path)})


@pytest.fixture
def keyed(make_env):
    from nvmeof_roce.control.methods import Control
    env = make_env()
    return env, Control(env.target)


def test_a_key_rotated_by_reload_refuses_the_old_key_and_keeps_connected_hosts(keyed, tmp_path):
    env, control = keyed
    before = env.connect(SUB, dhchap_secret=KEY)
    result = _reload(env, control, tmp_path, {"key": OTHER_KEY})
    assert [c["action"] for c in result["changes"]] == ["host-key"]
    assert KEY not in str(result) and OTHER_KEY not in str(result)  # no key material in the answer
    with pytest.raises(HostAuthError):
        env.connect(SUB, dhchap_secret=KEY)
    after = env.connect(SUB, dhchap_secret=OTHER_KEY)
    assert after.authenticated_queues == [0, 1]
    _io_round_trip(before)  # connected with the old key: unaffected until it reconnects (as nvmet)
    _io_round_trip(after)
    before.close()
    after.close()


def test_a_key_added_by_reload_is_required_and_one_removed_is_not(keyed, tmp_path):
    env, control = keyed
    _reload(env, control, tmp_path, None)
    plain = env.connect(SUB)  # no key configured: no authentication
    assert plain.authenticated_queues == []
    _reload(env, control, tmp_path, {"key": OTHER_KEY})
    with pytest.raises(HostError, match="requires DH-HMAC-CHAP"):
        env.connect(SUB)
    ctrl = env.connect(SUB, dhchap_secret=OTHER_KEY)
    assert ctrl.authenticated_queues == [0, 1]
    _io_round_trip(plain)
    _reload(env, control, tmp_path, None)
    again = env.connect(SUB)
    assert again.authenticated_queues == []
    for c in (plain, ctrl, again):
        c.close()


def test_reauthentication_of_a_connected_admin_queue_uses_the_new_key(keyed, tmp_path):
    """nvmet calls nvmet_setup_auth again on a Negotiate on the admin queue: re-authentication takes the
    key as it is now."""
    env, control = keyed
    ctrl = env.connect(SUB, dhchap_secret=KEY)
    _reload(env, control, tmp_path, {"key": OTHER_KEY})
    ctrl.dhchap_secret = A.parse_secret(OTHER_KEY)
    ctrl._authenticate(ctrl.admin)
    assert ctrl.authenticated_queues[-1] == 0
    _io_round_trip(ctrl)
    ctrl.close()


def test_a_key_rotated_by_rpc(keyed):
    env, control = keyed
    before = env.connect(SUB, dhchap_secret=KEY)
    assert control.call("nvmf_subsystem_set_keys", {"nqn": SUB, "host": HOST_A, "dhchap_key": OTHER_KEY,
                                                    "dhchap_ctrlr_key": CTRL_KEY}) is True
    assert env.target.config.host_entries[0].attrs["dhchap"]["key"] == OTHER_KEY
    with pytest.raises(HostAuthError):
        env.connect(SUB, dhchap_secret=KEY)
    after = env.connect(SUB, dhchap_secret=OTHER_KEY, dhchap_ctrl_secret=CTRL_KEY)
    assert after.authenticated_queues == [0, 1]
    _io_round_trip(before)
    err = pytest.raises(Exception, control.call, "nvmf_subsystem_set_keys",
                        {"nqn": SUB, "host": HOST_A, "dhchap_key": "DHHC-1:01:bad:"}).value
    assert err.field == "dhchap_key" and "base64" in err.message
    control.call("nvmf_subsystem_set_keys", {"nqn": SUB, "host": HOST_A})  # cleared
    assert env.connect(SUB).authenticated_queues == []
    before.close()
    after.close()


@pytest.mark.parametrize("qid", [0, 1])
def test_a_failed_authentication_ends_the_controller(make_env, qid):
    """As nvmet (nvmet_execute_auth_receive -> nvmet_ctrl_fatal_error): after AUTH_Failure1 the controller
    reports CSTS.CFS and goes away with all its queues; the host cannot retry on it."""
    env = make_env({"dhgroup": "ffdhe2048"})
    q, cqe = raw_connect(env.connector(), SUB, HOST_A)
    failing = q
    if qid:
        chap = HostAuthenticator(A.parse_secret(KEY), None, HOST_A, SUB, 0)
        send(q, chap.negotiate())
        send(q, chap.reply(receive(q)))
        chap.success1(receive(q))
        failing, cqe = raw_connect(env.connector(), SUB, HOST_A, qid=1, cntlid=cqe.result & 0xFFFF)
    chap = HostAuthenticator(A.parse_secret(OTHER_KEY), None, HOST_A, SUB, qid)
    send(failing, chap.negotiate())
    send(failing, chap.reply(receive(failing)))
    assert failure_reason(failing) == A.FAILURE_FAILED
    assert q.command(F.PropertyGet(offset=F.PROP_CSTS)).result & F.CSTS_CFS
    # a retry on the same queue gets no new challenge (no DH computed for it)
    chap = HostAuthenticator(A.parse_secret(KEY), None, HOST_A, SUB, qid, tid=7)
    assert send(failing, chap.negotiate()).status == 0
    assert A.message_kind(receive(failing))[1] == A.ID_FAILURE1
    env.clock.advance(1)
    env.target.tick(env.clock())
    env.fabric.pump()
    assert env.target.subsystems[SUB].controllers == {}
    assert env.target.queue_count() == 0
    assert env.connect(SUB, dhchap_secret=KEY).authenticated_queues == [0, 1]  # a new controller is fine


def test_a_host_rejecting_the_controller_ends_it(raw):
    """AUTH_Failure2 from the host ends the controller too (nvmet_execute_auth_send)."""
    env, q = raw({"ctrl_key": CTRL_KEY})
    chap = HostAuthenticator(A.parse_secret(KEY), A.parse_secret(A.generate_secret(3, 64)), HOST_A, SUB, 0)
    send(q, chap.negotiate())
    send(q, chap.reply(receive(q)))
    with pytest.raises(HostAuthError) as err:
        chap.success1(receive(q))
    assert send(q, err.value.failure2).status == 0
    env.clock.advance(1)
    env.target.tick(env.clock())
    assert env.target.subsystems[SUB].controllers == {}


def test_reauthentication_after_the_key_was_removed_fails_and_ends_the_controller(keyed, tmp_path):
    env, control = keyed
    ctrl = env.connect(SUB, dhchap_secret=KEY)
    _reload(env, control, tmp_path, None)
    _io_round_trip(ctrl)  # still connected with the key it authenticated with
    with pytest.raises(HostAuthError):
        ctrl._authenticate(ctrl.admin)
    env.clock.advance(1)
    env.target.tick(env.clock())
    assert env.target.subsystems[SUB].controllers == {}
