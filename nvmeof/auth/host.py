"""HostTransaction: the host side of one queue's DH-HMAC-CHAP transaction, sans-IO.

The initiator sends what ``next_send()`` returns with Authentication Send and gives the payload of each
Authentication Receive to ``receive()``. Steps mirror drivers/nvme/host/auth.c nvme_queue_auth_work:

  Negotiate -> (Challenge) -> Reply -> (Success1) -> Success2 if bidirectional

``receive`` raises AuthFailure when the controller sent Failure1 or an unexpected message (like the
kernel, no Failure2 follows: nvme_auth_receive_validate), and when the host itself refuses the challenge
or the controller's response; in that last case ``next_send()`` then returns the Failure2 to send
(the kernel's fail2 path). Unlike the kernel, a controller that omits its response (RVALID 0) when the
host asked for one is refused: bidirectional means the controller must prove it holds its key.
"""

from __future__ import annotations

import hmac as _hmac
from collections.abc import Sequence

from nvmeof.auth import messages as msg
from nvmeof.auth.dhchap import (
    DHGROUP_BITS,
    HASH_LENGTHS,
    DhExchange,
    controller_response,
    dh_value_len,
    host_response,
    random_challenge,
)
from nvmeof.auth.errors import AuthFailure
from nvmeof.auth.names import dhgroup_name, hash_name
from nvmeof.auth.secret import DhchapSecret
from nvmeof.spec.auth import AuthId, AuthType, FailureReason


class HostTransaction:
    def __init__(self, *, hostnqn: str, subnqn: str, qid: int, host_secret: DhchapSecret,
                 ctrl_secret: DhchapSecret | None, hashes: Sequence[int] = (3, 2, 1),
                 dhgroups: Sequence[int] = (5, 4, 3, 2, 1, 0), seqnum: int, t_id: int) -> None:
        self.hostnqn = hostnqn
        self.subnqn = subnqn
        self.qid = qid
        self._host_secret = host_secret
        self._ctrl_secret = ctrl_secret
        self._hashes = tuple(int(h) for h in hashes)
        self._dhgroups = tuple(int(g) for g in dhgroups)
        if not self._hashes or any(h not in HASH_LENGTHS for h in self._hashes):
            raise ValueError(f"DH-HMAC-CHAP hashes {list(self._hashes)}: use 1 (sha256), 2 (sha384), 3 (sha512)")
        if not self._dhgroups or any(g != 0 and g not in DHGROUP_BITS for g in self._dhgroups):
            raise ValueError(f"DH-HMAC-CHAP DH groups {list(self._dhgroups)}: use 0 (null), 1..5 (ffdhe2048..8192)")
        self._s2 = seqnum & 0xFFFFFFFF
        if ctrl_secret is not None and self._s2 == 0:
            raise ValueError("bidirectional authentication needs a non-zero sequence number (seqnum)")
        self.t_id = t_id & 0xFFFF
        self.state = "negotiate"    # negotiate, challenge, reply, success1, success2, done, failure2, failed
        self.authenticated = False
        self.failure: AuthFailure | None = None
        self.hash_id: int | None = None
        self.dhgroup_id: int | None = None
        self._pending: bytes | None = None
        self._c2: bytes | None = None
        self._session_key: bytes | None = None

    @property
    def bidirectional(self) -> bool:
        return self._ctrl_secret is not None

    def next_send(self) -> bytes | None:
        """The next Authentication Send payload, or None while the host waits or when it is finished."""
        if self.state == "negotiate":
            self.state = "challenge"
            return msg.build_negotiate(self.t_id, list(self._hashes), list(self._dhgroups))
        if self.state in ("reply", "success2", "failure2"):
            out, self._pending = self._pending, None
            if self.state == "reply":
                self.state = "success1"
            elif self.state == "success2":
                self.state = "done"
                self.authenticated = True
            else:
                self.state = "failed"
            return out
        return None

    def receive(self, data: bytes) -> None:
        """One Authentication Receive payload (Challenge, Success1 or Failure1)."""
        data = bytes(data)
        if self.state not in ("challenge", "success1"):
            raise self._stop(FailureReason.INCORRECT_MESSAGE,
                             f"qid {self.qid}: no authentication message expected in state {self.state!r}")
        expected = AuthId.CHALLENGE if self.state == "challenge" else AuthId.SUCCESS1
        try:
            auth_type, auth_id, t_id = msg.header(data)
        except AuthFailure as exc:
            raise self._stop(exc.reason_code, f"qid {self.qid}: {exc.message}") from None
        if auth_type == AuthType.COMMON and auth_id == AuthId.FAILURE1:
            reason = msg.parse_failure(data)[1] if len(data) >= 8 else FailureReason.FAILED
            raise self._stop(reason, f"qid {self.qid}: the controller refused authentication "
                             "with DH-HMAC-CHAP_Failure1")
        if auth_type != AuthType.DHCHAP or auth_id != expected:
            raise self._stop(FailureReason.INCORRECT_MESSAGE, f"qid {self.qid}: message {auth_type:#04x}/"
                             f"{auth_id:#04x} arrived, {AuthId(expected).name} expected")
        if t_id != self.t_id:
            raise self._stop(FailureReason.INCORRECT_MESSAGE,
                             f"qid {self.qid}: transaction id {t_id} does not match ours ({self.t_id})")
        try:
            if expected == AuthId.CHALLENGE:
                self._challenge(data)
            else:
                self._success1(data)
        except AuthFailure as exc:
            self._pending = msg.build_failure(AuthId.FAILURE2, self.t_id, exc.reason_code)
            self.state = "failure2"
            self.failure = exc
            self._session_key = None
            raise

    def _stop(self, reason: int, message: str) -> AuthFailure:
        self.failure = AuthFailure(reason, message)
        self.state = "failed"
        self.authenticated = False
        self._session_key = None
        return self.failure

    def _challenge(self, data: bytes) -> None:
        ch = msg.parse_challenge(data)
        q = f"qid {self.qid}"
        if ch.hash_id not in self._hashes:
            raise AuthFailure(FailureReason.HASH_UNUSABLE,
                              f"{q}: the controller chose hash {hash_name(ch.hash_id)}, which this host did not offer")
        hl = HASH_LENGTHS[ch.hash_id]
        if len(ch.challenge) != hl:
            raise AuthFailure(FailureReason.HASH_UNUSABLE,
                              f"{q}: challenge HL {len(ch.challenge)} does not match {hash_name(ch.hash_id)}'s {hl}")
        if ch.dhgroup_id not in self._dhgroups:
            raise AuthFailure(FailureReason.DHGROUP_UNUSABLE, f"{q}: the controller chose DH group "
                              f"{dhgroup_name(ch.dhgroup_id)}, which this host did not offer")
        if ch.dhgroup_id == 0 and ch.dh_value:
            raise AuthFailure(FailureReason.INCORRECT_PAYLOAD, f"{q}: challenge carries a DH value for the null group")
        self.hash_id, self.dhgroup_id = ch.hash_id, ch.dhgroup_id
        dh_value = b""
        if ch.dhgroup_id:
            if len(ch.dh_value) != dh_value_len(ch.dhgroup_id):
                raise AuthFailure(FailureReason.DHGROUP_UNUSABLE, f"{q}: challenge DH value is {len(ch.dh_value)} "
                                  f"bytes, {dhgroup_name(ch.dhgroup_id)} needs {dh_value_len(ch.dhgroup_id)}")
            exchange = DhExchange(ch.dhgroup_id)
            try:
                self._session_key = exchange.shared(ch.dh_value)
            except ValueError as exc:
                raise AuthFailure(FailureReason.DHGROUP_UNUSABLE, f"{q}: controller DH value refused: {exc}") from None
            dh_value = exchange.public
        response = host_response(ch.hash_id, self._host_secret.transformed(self.hostnqn), ch.challenge, ch.seqnum,
                                 self.t_id, self.hostnqn, self.subnqn, session_key=self._session_key)
        if self._ctrl_secret is not None:
            self._c2 = random_challenge(ch.hash_id)
        self._pending = msg.build_reply(self.t_id, response, self._c2, self._s2 if self._c2 else 0, dh_value)
        self.state = "reply"

    def _success1(self, data: bytes) -> None:
        s1 = msg.parse_success1(data)
        q = f"qid {self.qid}"
        assert self.hash_id is not None
        if s1.hl != HASH_LENGTHS[self.hash_id]:
            raise AuthFailure(FailureReason.HASH_UNUSABLE, f"{q}: Success1 HL {s1.hl} does not match "
                              f"{hash_name(self.hash_id)}")
        if self._ctrl_secret is None:
            self.state = "done"
            self.authenticated = True
            self._session_key = None
            return
        if not s1.rvalid:
            raise AuthFailure(FailureReason.FAILED, f"{q}: the controller did not answer the host's challenge "
                              "(bidirectional authentication requested with --dhchap-ctrl-secret)")
        assert self._c2 is not None
        expected = controller_response(self.hash_id, self._ctrl_secret.transformed(self.subnqn), self._c2, self._s2,
                                       self.t_id, self.subnqn, self.hostnqn, session_key=self._session_key)
        self._session_key = None
        if not _hmac.compare_digest(expected, s1.response):
            raise AuthFailure(FailureReason.FAILED, f"{q}: the controller's response does not match: it does not "
                              "hold the controller key given (--dhchap-ctrl-secret)")
        self._pending = msg.build_success2(self.t_id)
        self.state = "success2"

    def __repr__(self) -> str:
        return (f"HostTransaction(qid={self.qid}, state={self.state!r}, t_id={self.t_id}, "
                f"hash={self.hash_id}, dhgroup={self.dhgroup_id})")
