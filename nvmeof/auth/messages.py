"""Build and parse the DH-HMAC-CHAP messages (layouts in nvmeof.spec.auth).

Parsers check every length against the bytes received and raise AuthFailure(INCORRECT_PAYLOAD) naming
the field; they do not judge the values (the transactions do).
"""

from __future__ import annotations

from dataclasses import dataclass

from nvmeof.auth.errors import AuthFailure
from nvmeof.spec import auth as spec
from nvmeof.spec.auth import AuthId, AuthType, FailureReason


def _short(what: str, got: int, need: int) -> AuthFailure:
    return AuthFailure(FailureReason.INCORRECT_PAYLOAD, f"{what} is {got} bytes, shorter than the {need} it needs")


def header(data: bytes) -> tuple[int, int, int]:
    """(auth_type, auth_id, t_id) of any message."""
    if len(data) < spec.AUTH_HEADER_SIZE:
        raise _short("authentication message", len(data), spec.AUTH_HEADER_SIZE)
    h = spec.AuthHeader.parse(data)
    return h.auth_type, h.auth_id, h.t_id


def is_negotiate(data: bytes) -> bool:
    """True for an AUTH_Negotiate (a (re)start of the transaction on this queue)."""
    return len(data) >= 2 and data[0] == AuthType.COMMON and data[1] == AuthId.NEGOTIATE


@dataclass
class NegotiateMsg:
    t_id: int
    sc_c: int
    napd: int
    authid: int
    hash_ids: list[int]
    dhgroup_ids: list[int]


def build_negotiate(t_id: int, hash_ids: list[int], dhgroup_ids: list[int], sc_c: int = 0) -> bytes:
    idlist = bytearray(60)
    idlist[:len(hash_ids)] = bytes(hash_ids)
    idlist[spec.MAX_HASH_IDS:spec.MAX_HASH_IDS + len(dhgroup_ids)] = bytes(dhgroup_ids)
    head = spec.Negotiate.build(dict(auth_type=AuthType.COMMON, auth_id=AuthId.NEGOTIATE, t_id=t_id,
                                     sc_c=sc_c, napd=1))
    desc = spec.ProtocolDescriptor.build(dict(authid=spec.AUTH_ID_DHCHAP, halen=len(hash_ids),
                                              dhlen=len(dhgroup_ids), idlist=bytes(idlist)))
    return head + desc


def parse_negotiate(data: bytes) -> NegotiateMsg:
    need = spec.NEGOTIATE_SIZE + spec.PROTOCOL_DESCRIPTOR_SIZE
    if len(data) < need:   # nvmet_auth_negotiate: header plus one protocol descriptor
        raise _short("AUTH_Negotiate", len(data), need)
    head = spec.Negotiate.parse(data)
    desc = spec.ProtocolDescriptor.parse(data[spec.NEGOTIATE_SIZE:need])
    halen, dhlen = desc.halen, desc.dhlen
    if halen > spec.MAX_HASH_IDS or dhlen > spec.MAX_DH_IDS:
        raise AuthFailure(FailureReason.INCORRECT_PAYLOAD,
                          f"AUTH_Negotiate lists {halen} hashes and {dhlen} DH groups; at most 30 of each fit")
    ids = desc.idlist
    return NegotiateMsg(head.t_id, head.sc_c, head.napd, desc.authid, list(ids[:halen]),
                        list(ids[spec.MAX_HASH_IDS:spec.MAX_HASH_IDS + dhlen]))


@dataclass
class ChallengeMsg:
    t_id: int
    hash_id: int
    dhgroup_id: int
    seqnum: int
    challenge: bytes
    dh_value: bytes


def build_challenge(t_id: int, hash_id: int, dhgroup_id: int, seqnum: int, challenge: bytes,
                    dh_value: bytes) -> bytes:
    return spec.Challenge.build(dict(auth_type=AuthType.DHCHAP, auth_id=AuthId.CHALLENGE, t_id=t_id,
                                     hl=len(challenge), hashid=hash_id, dhgid=dhgroup_id,
                                     dhvlen=len(dh_value), seqnum=seqnum)) + challenge + dh_value


def parse_challenge(data: bytes) -> ChallengeMsg:
    if len(data) < spec.CHALLENGE_SIZE:
        raise _short("DH-HMAC-CHAP_Challenge", len(data), spec.CHALLENGE_SIZE)
    m = spec.Challenge.parse(data)
    end = spec.CHALLENGE_SIZE + m.hl + m.dhvlen
    if end > len(data):
        raise _short(f"DH-HMAC-CHAP_Challenge with HL {m.hl} and DHVLEN {m.dhvlen}", len(data), end)
    cval = data[spec.CHALLENGE_SIZE:spec.CHALLENGE_SIZE + m.hl]
    return ChallengeMsg(m.t_id, m.hashid, m.dhgid, m.seqnum, bytes(cval),
                        bytes(data[spec.CHALLENGE_SIZE + m.hl:end]))


@dataclass
class ReplyMsg:
    t_id: int
    hl: int
    cvalid: int
    seqnum: int
    response: bytes
    challenge: bytes
    dh_value: bytes


def build_reply(t_id: int, response: bytes, challenge: bytes | None, seqnum: int, dh_value: bytes) -> bytes:
    hl = len(response)
    c2 = challenge if challenge is not None else bytes(hl)
    return spec.Reply.build(dict(auth_type=AuthType.DHCHAP, auth_id=AuthId.REPLY, t_id=t_id, hl=hl,
                                 cvalid=1 if challenge is not None else 0, dhvlen=len(dh_value),
                                 seqnum=seqnum)) + response + c2 + dh_value


def parse_reply(data: bytes) -> ReplyMsg:
    if len(data) < spec.REPLY_SIZE:
        raise _short("DH-HMAC-CHAP_Reply", len(data), spec.REPLY_SIZE)
    m = spec.Reply.parse(data)
    end = spec.REPLY_SIZE + 2 * m.hl + m.dhvlen    # nvmet_auth_reply: hl and dhvlen must fit in TL
    if end > len(data):
        raise _short(f"DH-HMAC-CHAP_Reply with HL {m.hl} and DHVLEN {m.dhvlen}", len(data), end)
    base = spec.REPLY_SIZE
    return ReplyMsg(m.t_id, m.hl, m.cvalid, m.seqnum, bytes(data[base:base + m.hl]),
                    bytes(data[base + m.hl:base + 2 * m.hl]), bytes(data[base + 2 * m.hl:end]))


@dataclass
class Success1Msg:
    t_id: int
    hl: int
    rvalid: int
    response: bytes


def build_success1(t_id: int, hl: int, response: bytes | None) -> bytes:
    return spec.Success1.build(dict(auth_type=AuthType.DHCHAP, auth_id=AuthId.SUCCESS1, t_id=t_id, hl=hl,
                                    rvalid=1 if response is not None else 0)) + (response or b"")


def parse_success1(data: bytes) -> Success1Msg:
    if len(data) < spec.SUCCESS1_SIZE:
        raise _short("DH-HMAC-CHAP_Success1", len(data), spec.SUCCESS1_SIZE)
    m = spec.Success1.parse(data)
    rval = b""
    if m.rvalid:
        end = spec.SUCCESS1_SIZE + m.hl
        if end > len(data):
            raise _short(f"DH-HMAC-CHAP_Success1 with HL {m.hl}", len(data), end)
        rval = bytes(data[spec.SUCCESS1_SIZE:end])
    return Success1Msg(m.t_id, m.hl, m.rvalid, rval)


def build_success2(t_id: int) -> bytes:
    return spec.Success2.build(dict(auth_type=AuthType.DHCHAP, auth_id=AuthId.SUCCESS2, t_id=t_id))


def build_failure(auth_id: int, t_id: int, reason: int) -> bytes:
    return spec.Failure.build(dict(auth_type=AuthType.COMMON, auth_id=auth_id, t_id=t_id,
                                   rescode=spec.FAILURE_REASON_FAILED, rescode_exp=reason))


def parse_failure(data: bytes) -> tuple[int, int]:
    """(t_id, rescode_exp) of a Failure1/Failure2."""
    if len(data) < spec.FAILURE_SIZE:
        raise _short("DH-HMAC-CHAP failure message", len(data), spec.FAILURE_SIZE)
    m = spec.Failure.parse(data)
    return m.t_id, m.rescode_exp


def fit(message: bytes, alloc_len: int) -> bytes:
    """The Authentication Receive payload: the message in a zeroed buffer of exactly alloc_len bytes
    (nvmet_execute_auth_receive kzalloc(al) + copy of al bytes), cut when the buffer is shorter."""
    if alloc_len <= 0:
        return b""
    return message[:alloc_len].ljust(alloc_len, b"\0")
