"""ControllerTransaction: the controller side of one queue's DH-HMAC-CHAP transaction, sans-IO.

The target feeds it the payload of each Authentication Send (``send``) and asks it for the payload of
each Authentication Receive (``receive``). It mirrors drivers/nvme/target/fabrics-cmd-auth.c
(nvmet_execute_auth_send / nvmet_execute_auth_receive, nvmet_auth_negotiate, nvmet_auth_reply,
nvmet_auth_challenge, nvmet_auth_success1, nvmet_auth_failure1):

  negotiate --Send(Negotiate)--> challenge --Receive(Challenge)--> reply --Send(Reply)--> success1
  success1 --Receive(Success1)--> done            (unidirectional, or the host asked no C2)
  success1 --Receive(Success1)--> success2 --Send(Success2)--> done   (bidirectional)

A Negotiate in any state restarts the transaction (host-initiated re-authentication). A bad message never
raises: the transaction moves to "failed" with ``failure`` set; the next ``receive`` returns Failure1.
``teardown`` turns True when the kernel would call nvmet_ctrl_fatal_error: after Failure1 was delivered,
after a Failure2 from the host, or on a message out of order (the kernel's done_failure1 path).
Secrets, challenges and responses never appear in ``failure.message``.
"""

from __future__ import annotations

import hmac as _hmac
from collections.abc import Callable, Sequence

from nvmeof.auth import messages as msg
from nvmeof.auth.dhchap import (
    DHGROUP_BITS,
    HASH_LENGTHS,
    DhExchange,
    controller_response,
    host_response,
    random_challenge,
)
from nvmeof.auth.errors import AuthFailure, reason_text
from nvmeof.auth.names import dhgroup_name, hash_name, next_seqnum
from nvmeof.auth.secret import DhchapSecret
from nvmeof.spec import auth as spec
from nvmeof.spec.auth import AuthId, AuthType, FailureReason

_EXPECTED = {
    "negotiate": "AUTH_Negotiate (Authentication Send)",
    "challenge": "Authentication Receive of DH-HMAC-CHAP_Challenge",
    "reply": "DH-HMAC-CHAP_Reply (Authentication Send)",
    "success1": "Authentication Receive of DH-HMAC-CHAP_Success1",
    "success2": "DH-HMAC-CHAP_Success2 (Authentication Send)",
    "done": "nothing (authenticated; a new AUTH_Negotiate re-authenticates)",
}
_SEND_STEP = {"reply": AuthId.REPLY, "success2": AuthId.SUCCESS2}


def _check_ids(hashes: Sequence[int], dhgroups: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    hs, gs = tuple(int(h) for h in hashes), tuple(int(g) for g in dhgroups)
    if not hs or any(h not in HASH_LENGTHS for h in hs):
        raise ValueError(f"DH-HMAC-CHAP hashes {list(hs)}: give at least one of 1 (sha256), 2 (sha384), 3 (sha512)")
    if not gs or any(g != 0 and g not in DHGROUP_BITS for g in gs):
        raise ValueError(f"DH-HMAC-CHAP DH groups {list(gs)}: give at least one of 0 (null), 1..5 (ffdhe2048..8192)")
    return hs, gs


class ControllerTransaction:
    def __init__(self, *, subnqn: str, hostnqn: str, qid: int, host_secret: DhchapSecret,
                 ctrl_secret: DhchapSecret | None, hashes: Sequence[int], dhgroups: Sequence[int],
                 seqnum: int) -> None:
        self.subnqn = subnqn
        self.hostnqn = hostnqn
        self.qid = qid
        self._host_secret = host_secret
        self._ctrl_secret = ctrl_secret
        self._hashes, self._dhgroups = _check_ids(hashes, dhgroups)
        # S1 of the first challenge; later challenges (re-authentication) draw fresh ones (nvme_auth_get_seqnum)
        self._next_s1 = (seqnum & 0xFFFFFFFF) or next_seqnum()
        self.authenticated = False
        self.teardown = False
        self.failure: AuthFailure | None = None
        self.bidirectional = False
        self._reset()

    # ---- state -------------------------------------------------------------------------------------
    def _reset(self) -> None:
        self.state = "negotiate"
        self.t_id: int | None = None
        self.hash_id: int | None = None
        self.dhgroup_id: int | None = None
        self._c1 = b""
        self._s1 = 0
        self._c2: bytes | None = None
        self._s2 = 0
        self._dh: DhExchange | None = None
        self._session_key: bytes | None = None
        self._failure1_pending = False

    @property
    def expected_next(self) -> str:
        if self.state == "failed":
            return ("Authentication Receive of DH-HMAC-CHAP_Failure1" if self._failure1_pending
                    else "nothing (the transaction failed; a new AUTH_Negotiate restarts it)")
        return _EXPECTED[self.state]

    def _first_offered(self, allowed: Sequence[int], offered: Sequence[int], what: str, name: Callable[[int], str],
                       reason: int) -> int | None:
        """The first of ``allowed`` (the controller's preference order) that the host offers; None, having
        failed with ``reason``, when it offers none of them."""
        chosen = next((x for x in allowed if x in offered), None)
        if chosen is None:
            self._fail(reason, f"the host offers {what} {[name(x) for x in offered]}, none of the allowed "
                               f"{[name(x) for x in allowed]}")
        return chosen

    def _fail(self, reason: int, message: str, *, teardown: bool = False) -> None:
        self.failure = AuthFailure(reason, message)
        self.state = "failed"
        self.authenticated = False
        self._failure1_pending = not teardown
        self.teardown = self.teardown or teardown
        self._dh = None
        self._session_key = None

    # ---- Authentication Send -----------------------------------------------------------------------
    def send(self, data: bytes) -> None:
        """Consume one Authentication Send payload (Negotiate, Reply, Success2 or Failure2)."""
        data = bytes(data)
        try:
            auth_type, auth_id, t_id = msg.header(data)
        except AuthFailure as exc:
            self._fail(exc.reason_code, exc.message)
            return
        if auth_type == AuthType.COMMON and auth_id == AuthId.NEGOTIATE:
            self._negotiate(data)
            return
        if auth_type == AuthType.COMMON and auth_id == AuthId.FAILURE2:
            reason = msg.parse_failure(data)[1] if len(data) >= spec.FAILURE_SIZE else FailureReason.FAILED
            self._fail(reason, f"the host ended the transaction with Failure2: {reason_text(reason)}", teardown=True)
            return
        expected = _SEND_STEP.get(self.state)
        if auth_type != AuthType.DHCHAP or auth_id != expected:
            self._fail(FailureReason.INCORRECT_MESSAGE,
                       f"message type {auth_type:#04x}/{auth_id:#04x} arrived while expecting {self.expected_next}",
                       teardown=True)
            return
        if t_id != self.t_id:
            self._fail(FailureReason.INCORRECT_PAYLOAD,
                       f"transaction id {t_id} does not match this transaction's {self.t_id}")
            return
        if auth_id == AuthId.REPLY:
            self._reply(data)
        else:
            self.state = "done"
            self.authenticated = True

    def _negotiate(self, data: bytes) -> None:
        self._reset()
        self.failure = None
        self.teardown = False
        try:
            neg = msg.parse_negotiate(data)
        except AuthFailure as exc:
            self._fail(exc.reason_code, exc.message)
            return
        self.t_id = neg.t_id
        if neg.sc_c != spec.SC_C_NONE:
            self._fail(FailureReason.CONCAT_MISMATCH,
                       f"AUTH_Negotiate asks secure channel concatenation (SC_C {neg.sc_c}), which is not supported")
            return
        if neg.napd != 1:
            self._fail(FailureReason.HASH_UNUSABLE, f"AUTH_Negotiate carries {neg.napd} protocol descriptors, "
                       "1 (DH-HMAC-CHAP) is expected")
            return
        if neg.authid != spec.AUTH_ID_DHCHAP:
            self._fail(FailureReason.INCORRECT_PAYLOAD,
                       f"AUTH_Negotiate protocol descriptor AUTHID {neg.authid} is not DH-HMAC-CHAP (1)")
            return
        hash_id = self._first_offered(self._hashes, neg.hash_ids, "hashes", hash_name, FailureReason.HASH_UNUSABLE)
        if hash_id is None:
            return
        dhgroup_id = self._first_offered(self._dhgroups, neg.dhgroup_ids, "DH groups", dhgroup_name,
                                         FailureReason.DHGROUP_UNUSABLE)
        if dhgroup_id is None:
            return
        self.hash_id, self.dhgroup_id = hash_id, dhgroup_id
        self.state = "challenge"

    def _reply(self, data: bytes) -> None:
        try:
            rep = msg.parse_reply(data)
        except AuthFailure as exc:
            self._fail(exc.reason_code, exc.message)
            return
        assert self.hash_id is not None
        hl = HASH_LENGTHS[self.hash_id]
        if rep.hl != hl:
            self._fail(FailureReason.INCORRECT_PAYLOAD,
                       f"DH-HMAC-CHAP_Reply HL {rep.hl} does not match {hash_name(self.hash_id)}'s {hl}")
            return
        if self._dh is None:
            if rep.dh_value:
                self._fail(FailureReason.INCORRECT_PAYLOAD, "DH-HMAC-CHAP_Reply carries a DH value but the "
                           "negotiated DH group is null")
                return
        else:
            if not rep.dh_value:
                self._fail(FailureReason.INCORRECT_PAYLOAD, f"DH-HMAC-CHAP_Reply carries no DH value for "
                           f"{dhgroup_name(self._dh.dhgroup_id)}")
                return
            try:
                self._session_key = self._dh.shared(rep.dh_value)
            except ValueError as exc:
                self._fail(FailureReason.DHGROUP_UNUSABLE, f"host DH value refused: {exc}")
                return
        expected = host_response(self.hash_id, self._host_secret.transformed(self.hostnqn), self._c1, self._s1,
                                 self.t_id or 0, self.hostnqn, self.subnqn, session_key=self._session_key)
        if not _hmac.compare_digest(expected, rep.response):
            self._fail(FailureReason.FAILED, "the host's response does not match: it does not hold the "
                       "host key configured for it (wrong --dhchap-secret?)")
            return
        # nvmet_auth_reply: SEQNUM 0 means no bidirectional authentication even with a challenge.
        if rep.cvalid and rep.seqnum:
            self._c2, self._s2 = rep.challenge, rep.seqnum
            self.bidirectional = True
        else:
            self.bidirectional = False
        self.state = "success1"

    # ---- Authentication Receive --------------------------------------------------------------------
    def receive(self, alloc_len: int) -> bytes:
        """The payload of the next Authentication Receive, exactly ``alloc_len`` bytes (zero-padded/cut)."""
        if self.state == "challenge":
            return msg.fit(self._challenge(alloc_len), alloc_len)
        if self.state == "success1":
            return msg.fit(self._success1(), alloc_len)
        if self.state != "failed":
            self._fail(FailureReason.FAILED, f"Authentication Receive arrived while expecting {self.expected_next}")
        return msg.fit(self._failure1(), alloc_len)

    def _challenge(self, alloc_len: int) -> bytes:
        assert self.hash_id is not None and self.dhgroup_id is not None
        self._s1, self._next_s1 = self._next_s1, next_seqnum()
        self._c1 = random_challenge(self.hash_id)
        self._dh = DhExchange(self.dhgroup_id) if self.dhgroup_id else None
        dh_value = self._dh.public if self._dh else b""
        message = msg.build_challenge(self.t_id or 0, self.hash_id, self.dhgroup_id, self._s1, self._c1, dh_value)
        if alloc_len < len(message):
            self._fail(FailureReason.INCORRECT_PAYLOAD, f"Authentication Receive allocation length {alloc_len} is "
                       f"shorter than the {len(message)}-byte DH-HMAC-CHAP_Challenge")
            return self._failure1()
        self.state = "reply"
        return message

    def _success1(self) -> bytes:
        assert self.hash_id is not None
        hl = HASH_LENGTHS[self.hash_id]
        response = None
        if self._c2 is not None:
            if self._ctrl_secret is None:
                # nvmet_auth_success1: the host asked for bidirectional but no controller key is configured
                self._fail(FailureReason.FAILED, "the host asks bidirectional authentication but no controller "
                           "key is configured for it (dhchap_ctrl_key)")
                return self._failure1()
            response = controller_response(self.hash_id, self._ctrl_secret.transformed(self.subnqn), self._c2,
                                           self._s2, self.t_id or 0, self.subnqn, self.hostnqn,
                                           session_key=self._session_key)
        message = msg.build_success1(self.t_id or 0, hl, response)
        if response is None:
            self.state = "done"
            self.authenticated = True
        else:
            self.state = "success2"
        self._dh = None
        self._session_key = None
        return message

    def _failure1(self) -> bytes:
        reason = self.failure.reason_code if self.failure else FailureReason.FAILED
        self._failure1_pending = False
        self.teardown = True
        return msg.build_failure(AuthId.FAILURE1, self.t_id or 0, reason)

    def expire(self) -> None:
        """The host stopped half-way (the kernel's nvmet_auth_expired_work, after KATO or 120 s)."""
        if self.state not in ("done", "failed"):
            self._fail(FailureReason.FAILED, f"the transaction timed out waiting for {self.expected_next}",
                       teardown=True)

    def __repr__(self) -> str:
        return (f"ControllerTransaction(qid={self.qid}, state={self.state!r}, t_id={self.t_id}, "
                f"hash={self.hash_id}, dhgroup={self.dhgroup_id})")
