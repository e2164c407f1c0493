"""DH-HMAC-CHAP in the userspace target: the hosts' keys, one state machine per queue, the commands.

A host that has a `dhchap` key in the config and is listed in a subsystem's allowed_hosts must
authenticate every queue it connects to that subsystem (nvmet_setup_auth): the Connect response
carries AUTHREQ.ATR, and until the queue is authenticated only Authentication Send / Receive,
Property Get (and Connect / Disconnect) are accepted; anything else is answered with
Authentication Required (nvmet_check_auth_status).

The config is the host entry `nvmet save` writes from configfs::

    {"nqn": HOSTNQN, "dhchap": {"key": "DHHC-1:01:...:", "ctrl_key": "DHHC-1:03:...:",
                                "hash": "hmac(sha256)", "dhgroup": "ffdhe2048"}}

`key` is the host's secret, `ctrl_key` (optional) the controller's for bidirectional
authentication (each inline, the path of a 0600 key file, or a keyring key's name: config/keys.py),
`hash` and `dhgroup` what the controller picks when the host offers it (the kernel's defaults:
hmac(sha256), null).

The exchange (NVMe Base 2.0 §8.13.5, the kernel's nvmet_execute_auth_send / _receive):

    Send AUTH_Negotiate -> Receive DH-HMAC-CHAP_Challenge -> Send _Reply -> Receive _Success1
    [-> Send _Success2, or AUTH_Failure2 when the host refuses the controller's response]

A message that is malformed or out of order moves the queue to FAILURE1: the next Receive returns
AUTH_Failure1 with the reason.  A Negotiate on an authenticated queue re-authenticates it.
"""
from __future__ import annotations

import logging
import secrets
import threading
from dataclasses import dataclass
from typing import Dict, Optional

from ..config import ConfigError, TargetConfig, keys
from ..nvme import auth as A
from ..nvme import status as S
from .request import COMPLETED, LOC_CDW10, LOC_CDW11, LOC_DPTR, Outcome

log = logging.getLogger(__name__)

MAX_MESSAGE = 8192  # the largest message is a Reply with an ffdhe8192 value: 16 + 2 * 64 + 1024 bytes

DEFAULT_HASH = "hmac(sha256)"  # configfs defaults of a host's dhchap_hash / dhchap_dhgroup
DEFAULT_DHGROUP = "null"
_KNOWN = {"key", "ctrl_key", "hash", "dhgroup"}


@dataclass(frozen=True)
class HostAuth:
    """One host's DH-HMAC-CHAP settings; `key_origin` / `ctrl_origin` say where each key was read (inline, a key
    file, a keyring key: config/keys.py), never the key."""

    key: A.Secret
    ctrl_key: Optional[A.Secret]
    hash_id: int
    dhgroup_id: int
    key_origin: str = "inline"
    ctrl_origin: str = ""


def host_settings(config: TargetConfig) -> Dict[str, HostAuth]:
    """The hosts with a DH-HMAC-CHAP key, by NQN; ConfigError naming the field for anything unusable.  A key
    given as a file path or a keyring name is read now (config/keys.py): a replaced file takes effect at the
    next load of the config (a reload, an RPC change)."""
    out: Dict[str, HostAuth] = {}
    ring = keys.keyring_of(config)
    for i, host in enumerate(config.host_entries):
        group = host.attrs.get("dhchap")
        if not group:
            continue
        where = f"hosts[{i}].dhchap"

        def bad(field: str, problem: str, fix: str):
            return ConfigError(config.source, f"{where}.{field}", problem, fix)

        def secret(field: str, value) -> tuple:
            if not isinstance(value, str):
                raise bad(field, f"must be a string, got {type(value).__name__}",
                          "give the DHHC-1:NN:...: key, a key file's absolute path or a keyring key's name")
            text, origin = keys.secret_text(value, ring, config.source, f"{where}.{field}")
            try:
                return A.parse_secret(text), origin
            except A.SecretError as exc:
                if origin == "inline":
                    raise bad(field, str(exc), "paste the whole DHHC-1:NN:...: string (nvmeof-roce gen-dhchap-key)")
                raise bad(field, f"{origin}: {exc}", "the file must hold the whole DHHC-1:NN:...: string "
                          "(nvmeof-roce gen-dhchap-key ... > FILE)") from None

        for name in group:
            if name not in _KNOWN:
                raise bad(name, "unknown key", f"remove it; known keys here: {', '.join(sorted(_KNOWN))}")
        key_text = group.get("key") or ""
        ctrl_text = group.get("ctrl_key") or ""
        if not key_text:
            if ctrl_text:
                raise bad("ctrl_key", "a controller key without a host key",
                          "set dhchap.key too (nvmeof-roce gen-dhchap-key makes one)")
            continue  # nvmet save writes empty attributes for a host without keys
        key, key_origin = secret("key", key_text)
        ctrl_key, ctrl_origin = secret("ctrl_key", ctrl_text) if ctrl_text else (None, "")
        hash_text = group.get("hash") or DEFAULT_HASH
        hash_id = A.hash_id_by_name(hash_text)
        if hash_id is None:
            raise bad("hash", f"unknown hash {hash_text!r}", "use hmac(sha256), hmac(sha384) or hmac(sha512)")
        dh_text = group.get("dhgroup") or DEFAULT_DHGROUP
        dhgroup_id = A.dhgroup_id_by_name(dh_text)
        if dhgroup_id is None:
            raise bad("dhgroup", f"unknown DH group {dh_text!r}",
                      "use null, ffdhe2048, ffdhe3072, ffdhe4096, ffdhe6144 or ffdhe8192")
        out[host.nqn] = HostAuth(key, ctrl_key, hash_id, dhgroup_id, key_origin, ctrl_origin)
    return out


def settings_for(target, sub, hostnqn: str) -> Optional[HostAuth]:
    """The DH-HMAC-CHAP settings host `hostnqn` must use on `sub` now, or None (nvmet_setup_auth): only a
    host listed in allowed_hosts authenticates, never on the discovery subsystem or with allow_any_host.
    Read at each admin Connect and each re-authentication of an admin queue, so a key added, rotated or
    removed by a reload or an RPC applies from the next one; controllers keep the key they started with."""
    if sub.is_discovery or sub.allow_any_host or hostnqn not in sub.allowed_hosts:
        return None
    return target.host_auth.get(hostnqn)


_seqnum_lock = threading.Lock()
_seqnum = 0


def next_seqnum() -> int:
    """S1: random start, then incremented, never 0 (nvme_auth_get_seqnum)."""
    global _seqnum
    with _seqnum_lock:
        _seqnum = secrets.randbits(32) if _seqnum == 0 else (_seqnum + 1) & 0xFFFFFFFF
        if _seqnum == 0:
            _seqnum = 1
        return _seqnum


# steps: what the queue expects next
NEGOTIATE = "negotiate"  # a Send: AUTH_Negotiate
CHALLENGE = "challenge"  # a Receive: we answer with the challenge
REPLY = "reply"  # a Send: DH-HMAC-CHAP_Reply
SUCCESS1 = "success1"  # a Receive: Success1
SUCCESS2 = "success2"  # a Send: Success2 or Failure2
FAILURE1 = "failure1"  # a Receive: AUTH_Failure1 with `reason`
DONE = "done"


DEFAULT_EXPIRY = 120  # seconds a transaction may take without KATO (nvmet_execute_auth_send)


class QueueAuth:
    """The DH-HMAC-CHAP state of one queue: pure protocol, fed the messages the commands carry."""

    def __init__(self, settings: HostAuth, qid: int, cntlid: int, hostnqn: str, subnqn: str, now: float = 0.0):
        self.settings = settings
        self.qid = qid
        self.cntlid = cntlid
        self.hostnqn = hostnqn
        self.subnqn = subnqn
        self.step = NEGOTIATE
        self.authenticated = False
        self.attempted = False  # the host sent at least one Negotiate
        self.settings_removed = False  # the host's key was removed from the config since the Connect
        self.ended = False  # the transaction failed: the controller is being ended (nvmet_ctrl_fatal_error)
        self.tid = 0
        self.reason = 0
        self.failure = ""  # why the last attempt failed, for the log
        self.hash_id = settings.hash_id
        self.dhgroup_id = settings.dhgroup_id
        self._c1 = b""
        self._s1 = 0
        self._c2 = b""
        self._s2 = 0
        self._dh: Optional[A.DhKey] = None
        self._session_key = b""
        self.last_step_at = now

    def expire(self, now: float, kato_seconds: int) -> bool:
        """A transaction idle for KATO (120 s without one) is abandoned, as nvmet_auth_expired_work does:
        the queue waits for a new AUTH_Negotiate.  True if this one was."""
        if self.step in (NEGOTIATE, DONE) or now - self.last_step_at <= (kato_seconds or DEFAULT_EXPIRY):
            return False
        log.warning("%s: DH-HMAC-CHAP transaction %d expired in the %s step", self._who(), self.tid, self.step)
        self.failure = f"the host left the DH-HMAC-CHAP transaction in the {self.step} step until it expired"
        self.step = NEGOTIATE
        return True

    def _who(self) -> str:
        return f"controller {self.cntlid} queue {self.qid} (host {self.hostnqn})"

    def _fail(self, reason: int, why: str, level: int = logging.WARNING) -> None:
        self.step = FAILURE1
        self.reason = reason
        self.failure = why
        self.authenticated = False
        log.log(level, "%s: DH-HMAC-CHAP failed: %s (AUTH_Failure1: %s)", self._who(), why,
                A.FAILURE_NAMES.get(reason, hex(reason)))

    # ------------------------------------------------------------------ Authentication Send
    def send(self, data: bytes, now: Optional[float] = None) -> None:
        """A message from the host (Authentication Send)."""
        if now is not None:
            self.last_step_at = now
        if self.ended:
            return  # the controller is going away: no more work (and no DH) for this host
        try:
            auth_type, auth_id, tid = A.message_kind(data)
        except A.AuthError as exc:
            return self._fail(exc.reason, exc.message)
        if auth_type not in (A.TYPE_COMMON, A.TYPE_DHCHAP):
            return self._fail(A.FAILURE_INCORRECT_MESSAGE, f"unknown AUTH_Type {auth_type:#x}")
        if auth_type == A.TYPE_COMMON and auth_id == A.ID_NEGOTIATE:
            return self._negotiate(data)  # allowed at any time: starts (or restarts) a transaction
        if auth_type == A.TYPE_COMMON and auth_id == A.ID_FAILURE2:
            return self._failure2(data, tid)
        if auth_type == A.TYPE_COMMON:
            return self._fail(A.FAILURE_INCORRECT_MESSAGE, f"unexpected AUTH_Id {auth_id:#x} from the host")
        expected = {REPLY: A.ID_REPLY, SUCCESS2: A.ID_SUCCESS2}.get(self.step)
        if auth_id != expected:
            return self._fail(A.FAILURE_INCORRECT_MESSAGE,
                              f"DH-HMAC-CHAP message {auth_id:#x} while waiting for the {self.step} step")
        if tid != self.tid:
            return self._fail(A.FAILURE_INCORRECT_PAYLOAD, f"transaction ID {tid}, expected {self.tid}")
        if auth_id == A.ID_REPLY:
            return self._reply(data)
        try:
            A.Success2.unpack(data)
        except A.AuthError as exc:
            return self._fail(exc.reason, exc.message)
        self.step = DONE
        self.authenticated = True
        log.info("%s: authenticated (bidirectional, %s, %s)", self._who(), A.HASH_NAMES[self.hash_id],
                 A.DHGROUP_NAMES[self.dhgroup_id])

    def _negotiate(self, data: bytes) -> None:
        self.attempted = True
        self.tid = A.message_kind(data)[2]
        self._c2, self._s2, self._session_key, self._dh = b"", 0, b"", None
        try:
            msg = A.Negotiate.unpack(data)
        except A.AuthError as exc:
            return self._fail(exc.reason, exc.message)
        if self.settings_removed:
            return self._fail(A.FAILURE_FAILED, "the host's DH-HMAC-CHAP key was removed from the config "
                                                "(hosts[].dhchap.key); it must connect again")
        offered = [h for h in msg.hash_ids if h in A.HASHES]
        if self.settings.hash_id in msg.hash_ids:
            self.hash_id = self.settings.hash_id
        elif offered:  # nvmet falls back to the first hash the host offers that it has
            self.hash_id = offered[0]
            log.info("%s: host does not offer %s, using %s", self._who(), A.HASH_NAMES[self.settings.hash_id],
                     A.HASH_NAMES[self.hash_id])
        else:
            return self._fail(A.FAILURE_HASH_UNUSABLE, f"the host offers no usable hash ({msg.hash_ids})")
        if self.settings.dhgroup_id not in msg.dhgroup_ids:
            return self._fail(A.FAILURE_DHGROUP_UNUSABLE,
                              f"the host does not offer the configured DH group "
                              f"{A.DHGROUP_NAMES[self.settings.dhgroup_id]} (it offers {msg.dhgroup_ids})")
        self.dhgroup_id = self.settings.dhgroup_id
        self.step = CHALLENGE

    def _reply(self, data: bytes) -> None:
        try:
            msg = A.Reply.unpack(data, A.hash_len(self.hash_id))
        except A.AuthError as exc:
            return self._fail(exc.reason, exc.message)
        if self.dhgroup_id == A.DHGROUP_NULL:
            if msg.dh_value:
                return self._fail(A.FAILURE_INCORRECT_PAYLOAD, "a DH value in the reply with the null DH group")
        else:
            if not msg.dh_value:
                return self._fail(A.FAILURE_INCORRECT_PAYLOAD,
                                  f"no DH value in the reply with {A.DHGROUP_NAMES[self.dhgroup_id]}")
            try:
                self._session_key = self._dh.shared_secret(msg.dh_value)
            except A.AuthError as exc:
                return self._fail(exc.reason, exc.message)
        expected = A.host_response(self.hash_id, self.settings.key.transform(self.hostnqn), self._c1, self._s1,
                                   self.tid, self.hostnqn, self.subnqn, self._session_key)
        if not A.responses_equal(expected, msg.response):
            return self._fail(A.FAILURE_FAILED, "the host's response does not match: wrong host key "
                                                "(the host's --dhchap-secret differs from hosts[].dhchap.key)")
        if msg.challenge:
            if self.settings.ctrl_key is None:
                return self._fail(A.FAILURE_FAILED, "the host asks to authenticate the controller, but no "
                                                    "controller key is configured (hosts[].dhchap.ctrl_key)")
            self._c2, self._s2 = msg.challenge, msg.seqnum
        self.step = SUCCESS1

    def _failure2(self, data: bytes, tid: int) -> None:
        try:
            msg = A.Failure.unpack(data)
        except A.AuthError as exc:
            return self._fail(exc.reason, exc.message)
        if self.step != SUCCESS2 or tid != self.tid:
            return self._fail(A.FAILURE_INCORRECT_MESSAGE, f"AUTH_Failure2 in the {self.step} step")
        self.step = NEGOTIATE
        self.authenticated = False
        self.ended = True
        self.failure = (f"the host rejected the controller's response ({msg.describe()}): wrong controller key "
                        "(the host's --dhchap-ctrl-secret differs from hosts[].dhchap.ctrl_key)")
        log.warning("%s: DH-HMAC-CHAP failed: %s", self._who(), self.failure)

    # ------------------------------------------------------------------ Authentication Receive
    def receive(self, now: Optional[float] = None) -> bytes:
        """The message for the host (Authentication Receive)."""
        if now is not None:
            self.last_step_at = now
        if self.step == CHALLENGE:
            return self._challenge()
        if self.step == SUCCESS1:
            return self._success1()
        if self.step != FAILURE1:
            self._fail(A.FAILURE_INCORRECT_MESSAGE, f"Authentication Receive in the {self.step} step")
        msg = A.Failure(self.tid, self.reason).pack()
        # The transaction failed: nvmet ends the controller after sending AUTH_Failure1
        # (nvmet_execute_auth_receive -> nvmet_ctrl_fatal_error), so a host cannot retry on it.
        self.step = FAILURE1
        self.ended = True
        return msg

    def _challenge(self) -> bytes:
        hl = A.hash_len(self.hash_id)
        self._s1 = next_seqnum()
        self._c1 = secrets.token_bytes(hl)
        dh_value = b""
        if self.dhgroup_id != A.DHGROUP_NULL:
            self._dh = A.dh_generate(self.dhgroup_id)
            dh_value = self._dh.public_bytes()
        self.step = REPLY
        return A.Challenge(self.tid, self.hash_id, self.dhgroup_id, self._s1, self._c1, dh_value).pack()

    def _success1(self) -> bytes:
        hl = A.hash_len(self.hash_id)
        if not self._c2:
            self.step = DONE
            self.authenticated = True
            log.info("%s: authenticated (%s, %s)", self._who(), A.HASH_NAMES[self.hash_id],
                     A.DHGROUP_NAMES[self.dhgroup_id])
            return A.Success1(self.tid, hl).pack()
        response = A.controller_response(self.hash_id, self.settings.ctrl_key.transform(self.subnqn), self._c2,
                                         self._s2, self.tid, self.hostnqn, self.subnqn, self._session_key)
        self.step = SUCCESS2
        return A.Success1(self.tid, hl, response).pack()


# ---------------------------------------------------------------------- the fabrics commands

def _check_command(t, req, length: int) -> bool:
    """SECP/SPSP0/SPSP1 and the length field, as nvmet_execute_auth_send / _receive check them."""
    secp, spsp0, spsp1 = A.split_cdw10(req.cdw10)
    if secp != A.SECP_DHCHAP or spsp0 != A.SPSP or spsp1 != A.SPSP:
        t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW10)
        return False
    if length == 0 or length > MAX_MESSAGE:
        t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW11)
        return False
    if req.transfer_len != length:  # nvmet_check_transfer_len
        t.complete(req, S.SGL_INVALID_DATA | S.DNR, location=LOC_DPTR)
        return False
    return True


def auth_send(t, req) -> Outcome:
    """Authentication Send (fabrics 0x05): a message from the host."""
    qs = req.queue
    if qs.auth is None:
        # No key for this host here: as a target without authentication (nvmet built without
        # CONFIG_NVME_TARGET_AUTH), the command does not exist for this queue.
        log.info("queue %d: Authentication Send from host %s, which has no DH-HMAC-CHAP key for %s",
                 qs.qid, qs.ctrl.hostnqn, qs.ctrl.subsystem.nqn)
        return t.complete(req, S.INVALID_OPCODE | S.DNR, location=0)
    if not _check_command(t, req, req.cdw11):
        return COMPLETED
    return t.fetch(req, req.cdw11, _send_with_data)


def _send_with_data(t, req, data) -> Outcome:
    qs = req.queue
    data = bytes(data)
    if qs.qid == 0 and _is_negotiate(data):
        _refresh_settings(t, qs)
    qs.auth.send(data, t.clock())
    outcome = t.complete(req, 0)
    _end_if_failed(t, qs)
    return outcome


def _end_if_failed(t, qs) -> None:
    if qs.auth is not None and qs.auth.ended and qs.ctrl is not None:
        t.fail_controller(qs.ctrl, f"DH-HMAC-CHAP failed on queue {qs.qid}: {qs.auth.failure}")


def _is_negotiate(data: bytes) -> bool:
    try:
        auth_type, auth_id, _ = A.message_kind(data)
    except A.AuthError:
        return False
    return auth_type == A.TYPE_COMMON and auth_id == A.ID_NEGOTIATE


def _refresh_settings(t, qs) -> None:
    """A (re-)authentication on the admin queue takes the host's key as the config has it now (nvmet calls
    nvmet_setup_auth again); the controller's I/O queues connected later use the same."""
    ctrl = qs.ctrl
    current = settings_for(t, ctrl.subsystem, ctrl.hostnqn)
    if current is None:
        qs.auth.settings_removed = True
        return
    qs.auth.settings_removed = False
    if current is not ctrl.auth:
        ctrl.auth = current
        qs.auth.settings = current


def auth_receive(t, req) -> Outcome:
    """Authentication Receive (fabrics 0x06): the controller's next message."""
    qs = req.queue
    if qs.auth is None:
        # No key for this host here: as a target without authentication (nvmet built without
        # CONFIG_NVME_TARGET_AUTH), the command does not exist for this queue.
        log.info("queue %d: Authentication Receive from host %s, which has no DH-HMAC-CHAP key for %s",
                 qs.qid, qs.ctrl.hostnqn, qs.ctrl.subsystem.nqn)
        return t.complete(req, S.INVALID_OPCODE | S.DNR, location=0)
    al = req.cdw11
    if not _check_command(t, req, al):
        return COMPLETED
    msg = qs.auth.receive(t.clock())
    if len(msg) > al:
        if al < 8:  # not even room for an AUTH_Failure1
            return t.complete(req, S.INVALID_FIELD | S.DNR, location=LOC_CDW11)
        auth = qs.auth
        auth._fail(A.FAILURE_INCORRECT_PAYLOAD, f"allocation length {al} is too small for a {len(msg)}-byte message")
        msg = auth.receive()
    outcome = t.complete(req, 0, data=msg)
    _end_if_failed(t, qs)
    return outcome
