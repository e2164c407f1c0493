"""DH-HMAC-CHAP on the host side: the messages the host sends and how it checks the controller's.

Pure protocol (the transport is the caller's): `negotiate()`, then `reply(challenge)`, then
`success1(message)`; each returns the next message to send (or None), and raises `HostAuthError`
when the controller fails us or we fail the controller -- `failure2` then holds the AUTH_Failure2
the host should still send (as the Linux host does in nvme_auth_process_dhchap_success1).
"""
from __future__ import annotations

import secrets
from typing import Optional

from ..errors import NvmeofError
from ..nvme import auth as A

# What the Linux host offers (nvme_auth_set_dhchap_negotiate_data): every hash, every group
OFFERED_HASHES = [A.HASH_SHA256, A.HASH_SHA384, A.HASH_SHA512]
OFFERED_DHGROUPS = [A.DHGROUP_NULL, A.DHGROUP_2048, A.DHGROUP_3072, A.DHGROUP_4096, A.DHGROUP_6144, A.DHGROUP_8192]
RECEIVE_LENGTH = 4096  # Authentication Receive allocation length (the kernel host's CHAP_BUF_SIZE)


class HostAuthError(NvmeofError):
    def __init__(self, message: str, fix: str = "", failure2: Optional[bytes] = None):
        super().__init__(message, fix)
        self.failure2 = failure2


class HostAuthenticator:
    """One DH-HMAC-CHAP transaction of one queue, host side."""

    def __init__(self, secret: A.Secret, ctrl_secret: Optional[A.Secret], hostnqn: str, subnqn: str, qid: int,
                 tid: Optional[int] = None):
        self.secret = secret
        self.ctrl_secret = ctrl_secret
        self.hostnqn = hostnqn
        self.subnqn = subnqn
        self.qid = qid
        self.tid = tid if tid is not None else qid  # the Linux host uses the queue ID as transaction ID
        self.hash_id = 0
        self.dhgroup_id = 0
        self._c2 = b""
        self._s2 = 0
        self._session_key = b""

    def negotiate(self) -> bytes:
        return A.Negotiate(self.tid, OFFERED_HASHES, OFFERED_DHGROUPS).pack()

    def _check_failure1(self, data: bytes) -> None:
        kind = A.message_kind(data)
        if kind[0] == A.TYPE_COMMON and kind[1] == A.ID_FAILURE1:
            failure = A.Failure.unpack(data)
            raise HostAuthError(f"queue {self.qid}: the controller refused authentication: {failure.describe()}",
                                "check the host key (--dhchap-secret) against the target's hosts[].dhchap.key "
                                "and the target's log")

    def _failure2(self, reason: int) -> bytes:
        return A.Failure(self.tid, reason, A.ID_FAILURE2).pack()

    def reply(self, data: bytes) -> bytes:
        """The DH-HMAC-CHAP_Reply to the controller's challenge."""
        try:
            self._check_failure1(data)
            msg = A.Challenge.unpack(data)
        except A.AuthError as exc:
            raise HostAuthError(f"queue {self.qid}: bad DH-HMAC-CHAP_Challenge: {exc.message}",
                                "the target violated the protocol", self._failure2(exc.reason)) from None
        if msg.tid != self.tid:
            raise HostAuthError(f"queue {self.qid}: challenge for transaction {msg.tid}, expected {self.tid}",
                                "the target violated the protocol", self._failure2(A.FAILURE_INCORRECT_PAYLOAD))
        self.hash_id, self.dhgroup_id = msg.hash_id, msg.dhgroup_id
        dh_value = b""
        if msg.dhgroup_id != A.DHGROUP_NULL:
            if len(msg.dh_value) != A.DHGROUP_BITS[msg.dhgroup_id] // 8:
                raise HostAuthError(f"queue {self.qid}: DH value of {len(msg.dh_value)} bytes for "
                                    f"{A.DHGROUP_NAMES[msg.dhgroup_id]}", "the target violated the protocol",
                                    self._failure2(A.FAILURE_INCORRECT_PAYLOAD))
            key = A.dh_generate(msg.dhgroup_id)
            try:
                self._session_key = key.shared_secret(msg.dh_value)
            except A.AuthError as exc:
                raise HostAuthError(f"queue {self.qid}: {exc.message}", "the target violated the protocol",
                                    self._failure2(exc.reason)) from None
            dh_value = key.public_bytes()
        response = A.host_response(self.hash_id, self.secret.transform(self.hostnqn), msg.challenge, msg.seqnum,
                                   self.tid, self.hostnqn, self.subnqn, self._session_key)
        if self.ctrl_secret is not None:
            self._c2 = secrets.token_bytes(A.hash_len(self.hash_id))
            self._s2 = secrets.randbits(32) or 1
        return A.Reply(self.tid, response, self._c2, self._s2, dh_value).pack()

    def success1(self, data: bytes) -> Optional[bytes]:
        """Check Success1; the Success2 to send when we authenticated the controller, else None."""
        try:
            self._check_failure1(data)
            msg = A.Success1.unpack(data)
        except A.AuthError as exc:
            raise HostAuthError(f"queue {self.qid}: bad DH-HMAC-CHAP_Success1: {exc.message}",
                                "the target violated the protocol", self._failure2(exc.reason)) from None
        if self.ctrl_secret is None:
            return None
        if not msg.response:
            raise HostAuthError(f"queue {self.qid}: the controller did not answer our challenge",
                                "the target has no controller key for this host (hosts[].dhchap.ctrl_key)",
                                self._failure2(A.FAILURE_FAILED))
        expected = A.controller_response(self.hash_id, self.ctrl_secret.transform(self.subnqn), self._c2, self._s2,
                                         self.tid, self.hostnqn, self.subnqn, self._session_key)
        if not A.responses_equal(expected, msg.response):
            raise HostAuthError(f"queue {self.qid}: controller authentication failed: its response does not match",
                                "the controller key (--dhchap-ctrl-secret) differs from the target's "
                                "hosts[].dhchap.ctrl_key", self._failure2(A.FAILURE_FAILED))
        return A.Success2(self.tid).pack()
