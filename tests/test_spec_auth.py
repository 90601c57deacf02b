"""Sizes, offsets and build/parse of the DH-HMAC-CHAP messages and the Authentication Send/Receive SQEs.

Offsets are those of Linux include/linux/nvme.h ``struct nvmf_auth_*`` (the kernel is the peer we must match).
"""

import pytest
from construct import Container

from nvmeof.spec import auth as a
from nvmeof.spec import fabrics as f
from nvmeof.spec.nvme import FabricsType

STRUCTS = [
    (a.AuthHeader, 6), (a.ProtocolDescriptor, 64), (a.Negotiate, 8), (a.Challenge, 16), (a.Reply, 16),
    (a.Success1, 16), (a.Success2, 16), (a.Failure, 8), (f.AuthSendCommand, 64), (f.AuthReceiveCommand, 64),
]


@pytest.mark.parametrize(("struct", "size"), STRUCTS, ids=lambda s: getattr(s, "name", None) or str(s))
def test_size_and_roundtrip(struct, size):
    assert struct.sizeof() == size
    raw = bytes(size)
    if struct in (f.AuthSendCommand, f.AuthReceiveCommand):
        raw = b"\x7f" + raw[1:]
    parsed = struct.parse(raw)
    assert struct.build(parsed) == raw


def test_constants_match_linux_nvme_h():
    assert a.SECP_DHCHAP == 0xE9 and a.SPSP0_DHCHAP == 1 and a.SPSP1_DHCHAP == 1
    assert a.AuthType.COMMON == 0x00 and a.AuthType.DHCHAP == 0x01
    assert [int(x) for x in a.AuthId] == [0, 1, 2, 3, 4, 0xF0, 0xF1]
    assert [int(x) for x in a.HashId] == [1, 2, 3]
    assert [int(x) for x in a.DhGroupId] == [0, 1, 2, 3, 4, 5]
    assert [int(x) for x in a.FailureReason] == list(range(1, 8))
    assert a.CONNECT_AUTHREQ_ATR == 1 << 17 and a.CONNECT_AUTHREQ_ASCR == 1 << 18
    assert FabricsType.AUTH_SEND == 0x05 and FabricsType.AUTH_RECEIVE == 0x06


def test_auth_send_receive_sqe_offsets():
    # nvmf_auth_send_command: resv3 @40, spsp0 @41, spsp1 @42, secp @43, tl (le32) @44
    raw = f.AuthSendCommand.build(Container(rsvd1=0, cid=0x1234, fctype=FabricsType.AUTH_SEND, rsvd2=bytes(19),
                                            dptr=bytes(16), rsvd3=0, spsp0=1, spsp1=1, secp=0xE9, tl=0x11223344,
                                            rsvd4=bytes(16)))
    assert raw[0] == 0x7F and raw[2:4] == b"\x34\x12" and raw[4] == 0x05
    assert raw[41:44] == b"\x01\x01\xe9" and raw[44:48] == bytes.fromhex("44332211")
    raw = f.AuthReceiveCommand.build(Container(rsvd1=0, cid=1, fctype=FabricsType.AUTH_RECEIVE, rsvd2=bytes(19),
                                               dptr=bytes(16), rsvd3=0, spsp0=1, spsp1=1, secp=0xE9, al=4096,
                                               rsvd4=bytes(16)))
    assert raw[4] == 0x06 and raw[43] == 0xE9 and int.from_bytes(raw[44:48], "little") == 4096
    assert f.AuthReceiveCommand.parse(raw).al == 4096


def test_challenge_and_reply_offsets():
    raw = a.Challenge.build(dict(auth_type=1, auth_id=1, t_id=0xBEEF, hl=48, hashid=2, dhgid=3, dhvlen=512,
                                 seqnum=0x01020304))
    # auth_type, auth_id, rsvd1[2], t_id @4, hl @6, rsvd2 @7, hashid @8, dhgid @9, dhvlen @10, seqnum @12
    assert raw[:2] == b"\x01\x01" and raw[4:6] == b"\xef\xbe" and raw[6] == 48 and raw[8] == 2 and raw[9] == 3
    assert raw[10:12] == (512).to_bytes(2, "little") and raw[12:16] == bytes.fromhex("04030201")
    raw = a.Reply.build(dict(auth_type=1, auth_id=2, t_id=7, hl=32, cvalid=1, dhvlen=256, seqnum=9))
    # hl @6, cvalid @8, rsvd3 @9, dhvlen @10, seqnum @12
    assert raw[6] == 32 and raw[8] == 1 and raw[9] == 0 and raw[10:12] == b"\x00\x01" and raw[12] == 9


def test_negotiate_success_failure_offsets():
    raw = a.Negotiate.build(dict(auth_type=0, auth_id=0, t_id=3, sc_c=0, napd=1))
    assert raw == b"\x00\x00\x00\x00\x03\x00\x00\x01"
    desc = a.ProtocolDescriptor.build(dict(authid=1, halen=3, dhlen=6, idlist=bytes(60)))
    assert desc[:4] == b"\x01\x00\x03\x06"
    raw = a.Success1.build(dict(auth_type=1, auth_id=3, t_id=3, hl=64, rvalid=1))
    assert raw[6] == 64 and raw[8] == 1 and raw[9:] == bytes(7)
    raw = a.Failure.build(dict(auth_type=0, auth_id=0xF1, t_id=3, rescode=1, rescode_exp=6))
    assert raw == b"\x00\xf1\x00\x00\x03\x00\x01\x06"
    assert a.Failure.parse(raw).rescode_exp == 6
