"""DH-HMAC-CHAP core: secrets (nvme-cli compatible), the computations' byte order, both transactions.

The HostTransaction and ControllerTransaction are run against each other in memory; the Linux kernel
referees the same code in the VM interop suite.
"""

import base64
import hashlib
import hmac
import logging
import shutil
import struct
import subprocess
import zlib

import pytest

from nvmeof.auth import (
    DHGROUP_IDS,
    HASH_IDS,
    AuthFailure,
    ControllerTransaction,
    DhchapSecret,
    HostTransaction,
    generate_secret,
    is_negotiate,
    next_seqnum,
    parse_dhgroup,
    parse_hash,
)
from nvmeof.auth import messages as msg
from nvmeof.auth.dhchap import DhExchange, augmented_challenge, controller_response, dh_value_len, host_response
from nvmeof.auth.ffdhe import FFDHE_PRIMES
from nvmeof.spec.auth import AuthId, FailureReason

HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000001"
SUBNQN = "nqn.2024-01.io.nvmeof:auth-test"

# `nvme gen-dhchap-key --secret HEX --hmac N --key-length L --nqn NQN` (nvme-cli 2.3, libnvme 1.3, Debian 12),
# secret byte i = (i * 7 + N) & 0xFF
NVME_CLI_VECTORS = [
    (0, 32, HOSTNQN, "DHHC-1:00:AAcOFRwjKjE4P0ZNVFtiaXB3foWMk5qhqK+2vcTL0tk/PUPo:"),
    (1, 32, HOSTNQN, "DHHC-1:01:o5h8NUfudrYnLb+UkjLiM53j6rXAyUVJe/Txwxx06rFZU/5k:"),
    (2, 48, "nqn.2023-01.io.example:host-a",
     "DHHC-1:02:rNue121bjLp8xw/j7JvgrmRaAChhFisli+zf3QiB9epI60kh+JQo9oRvK5wqVb/M+PJQ5Q==:"),
    (3, 64, "nqn.2023-01.io.example:host-b",
     "DHHC-1:03:GCd33bLzpVnVZtFQzBoHaxL7hGvP9NnCpKti4sEA1ROK6hoU3XR1TPTv2hlQPME78XAyW4YGB/5dn5NNb/1Ka8EX47M=:"),
    (0, 64, "nqn.x", "DHHC-1:00:AAcOFRwjKjE4P0ZNVFtiaXB3foWMk5qhqK+2vcTL0tng5+71/AMKERgfJi00O0JJUFdeZWxzeoGIj5adpKuyud"
     "SnJNM=:"),
]


def _vector_secret(hmac_id: int, key_len: int) -> bytes:
    return bytes((i * 7 + hmac_id) & 0xFF for i in range(key_len))


def _encode(key: bytes, hmac_id: int = 0, crc: int | None = None) -> str:
    crc = zlib.crc32(key) if crc is None else crc
    return f"DHHC-1:{hmac_id:02x}:" + base64.b64encode(key + crc.to_bytes(4, "little")).decode() + ":"


# ---- secrets -------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("hmac_id", "key_len", "nqn", "expected"), NVME_CLI_VECTORS)
def test_generate_matches_nvme_cli_vectors(hmac_id, key_len, nqn, expected):
    secret = _vector_secret(hmac_id, key_len)
    assert generate_secret(key_len=key_len, hmac_id=hmac_id, nqn=nqn, secret=secret) == expected
    parsed = DhchapSecret.parse(expected)
    assert parsed.hmac_id == hmac_id and len(parsed.key) == key_len
    assert parsed.format() == expected


@pytest.mark.skipif(shutil.which("nvme") is None, reason="nvme-cli not installed")
@pytest.mark.parametrize(("hmac_id", "key_len"), [(0, 32), (0, 48), (1, 32), (2, 48), (3, 64)])
def test_generate_matches_installed_nvme_cli(hmac_id, key_len):
    secret = bytes(range(100, 100 + key_len))
    out = subprocess.run(["nvme", "gen-dhchap-key", "--secret", secret.hex(), "--hmac", str(hmac_id),
                          "--key-length", str(key_len), "--nqn", "nqn.2024-02.io.example:cli"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert generate_secret(key_len=key_len, hmac_id=hmac_id, nqn="nqn.2024-02.io.example:cli", secret=secret) == out


def test_generate_defaults_and_random():
    a, b = generate_secret(), generate_secret()
    assert a != b and DhchapSecret.parse(a).hmac_id == 0 and len(DhchapSecret.parse(a).key) == 32
    assert len(DhchapSecret.parse(generate_secret(hmac_id=2, nqn=HOSTNQN)).key) == 48   # hmac fixes the length
    assert len(DhchapSecret.parse(generate_secret(key_len=64)).key) == 64


@pytest.mark.parametrize(("kwargs", "needle"), [
    (dict(hmac_id=4), "--hmac"),
    (dict(hmac_id=1, key_len=64, nqn=HOSTNQN), "--key-length 32"),
    (dict(key_len=33), "--key-length"),
    (dict(key_len=32, secret=b"\0" * 2), "--secret is 2 bytes"),
    (dict(hmac_id=3), "--nqn"),
])
def test_generate_refuses_like_nvme_cli(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        generate_secret(**kwargs)


def test_parse_accepts_newline_and_missing_trailing_colon():
    text = NVME_CLI_VECTORS[1][3]
    assert DhchapSecret.parse(text + "\n") == DhchapSecret.parse(text[:-1])


@pytest.mark.parametrize(("text", "needle"), [
    ("DHHC-2:00:" + base64.b64encode(bytes(36)).decode() + ":", "DHHC-1:"),
    ("dhchap:00:abc:", "DHHC-1:"),
    ("DHHC-1:04:" + _encode(bytes(32))[10:], "hash id 04"),
    ("DHHC-1:1:" + _encode(bytes(32))[10:], "two-digit"),
    ("DHHC-1:zz:" + _encode(bytes(32))[10:], "two-digit"),
    ("DHHC-1:00:not*base64!:", "base64"),
    (_encode(bytes(16)), "32, 48 or 64"),
    (_encode(bytes(40)), "32, 48 or 64"),
    (_encode(bytes(range(32)), crc=0x12345678), "CRC-32"),
    ("DHHC-1:00:" + _encode(bytes(32))[10:-1] + ":extra:", "more than one"),
])
def test_parse_errors_name_the_problem_without_the_secret(text, needle):
    with pytest.raises(ValueError, match=needle) as info:
        DhchapSecret.parse(text)
    body = text[10:].strip(":")
    assert not body or body not in str(info.value)


def test_crc_is_zlib_crc32_little_endian():
    key = bytes(range(32))
    raw = base64.b64decode(NVME_CLI_VECTORS[0][3][10:-1])
    vec = DhchapSecret.parse(NVME_CLI_VECTORS[0][3])
    assert raw[-4:] == zlib.crc32(vec.key).to_bytes(4, "little")
    assert DhchapSecret.parse(_encode(key)).key == key


def test_secret_never_shown(caplog):
    text = NVME_CLI_VECTORS[3][3]
    s = DhchapSecret.parse(text)
    b64 = text[10:-1]
    shown = [repr(s), str(s), f"{s}", f"{s!r}", repr([s]), repr({"k": s})]
    logging.getLogger("test.auth").warning("secret %s %r", s, s)
    shown.append(caplog.text)
    for out in shown:
        assert b64 not in out and s.key.hex() not in out and "DHHC-1:03:" not in out
        assert repr(s.key) not in out
    assert repr(s) == "DhchapSecret(hmac=3, 64 bytes)"


@pytest.mark.parametrize(("hmac_id", "name"), [(1, "sha256"), (2, "sha384"), (3, "sha512")])
def test_transform_per_hash(hmac_id, name):
    key = bytes(range(7, 7 + 32))
    s = DhchapSecret(key=key, hmac_id=hmac_id)
    want = hmac.new(key, HOSTNQN.encode() + b"NVMe-over-Fabrics", name).digest()
    assert s.transformed(HOSTNQN) == want and len(want) == {1: 32, 2: 48, 3: 64}[hmac_id]
    assert DhchapSecret(key=key, hmac_id=0).transformed(HOSTNQN) == key


def test_names_parse_configfs_forms():
    assert HASH_IDS == {"sha256": 1, "sha384": 2, "sha512": 3}
    assert list(DHGROUP_IDS.values()) == [0, 1, 2, 3, 4, 5]
    assert parse_hash("hmac(sha384)") == 2 and parse_hash("SHA512") == 3
    assert parse_dhgroup("ffdhe8192") == 5 and parse_dhgroup("null") == 0
    with pytest.raises(ValueError, match="sha256"):
        parse_hash("md5")
    with pytest.raises(ValueError, match="ffdhe2048"):
        parse_dhgroup("modp2048")


def test_seqnum_never_zero_and_increments():
    a, b = next_seqnum(), next_seqnum()
    assert a != 0 and b != 0 and (b == (a + 1) & 0xFFFFFFFF or b == 1)


# ---- computations --------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [2048, 3072, 4096, 6144, 8192])
def test_ffdhe_primes_have_rfc7919_shape(bits):
    p = FFDHE_PRIMES[bits]
    assert p.bit_length() == bits
    assert p >> (bits - 64) == (1 << 64) - 1 and p & ((1 << 64) - 1) == (1 << 64) - 1
    assert format(p, "X").startswith("FFFFFFFFFFFFFFFFADF85458A2BB4A9AAFDC5620273D3CF1")


def test_response_byte_order_matches_kernel():
    # drivers/nvme/host/auth.c nvme_auth_dhchap_setup_host_response / setup_ctrl_response, spelled out
    key, c = b"k" * 32, bytes(range(32))
    r1 = hmac.new(key, c + struct.pack("<I", 0x01020304) + struct.pack("<H", 0x0506) + b"\0" + b"HostHost"
                  + HOSTNQN.encode() + b"\0" + SUBNQN.encode(), "sha256").digest()
    assert host_response(1, key, c, 0x01020304, 0x0506, HOSTNQN, SUBNQN) == r1
    r2 = hmac.new(key, c + struct.pack("<I", 7) + struct.pack("<H", 9) + b"\0" + b"Controller"
                  + SUBNQN.encode() + b"\0" + HOSTNQN.encode(), "sha256").digest()
    assert controller_response(1, key, c, 7, 9, SUBNQN, HOSTNQN) == r2
    # nvme_auth_augmented_challenge: HMAC(H(Ks), C)
    ks = bytes(range(256))
    aug = hmac.new(hashlib.sha384(ks).digest(), c + c[:16], "sha384").digest()
    assert augmented_challenge(2, ks, c + c[:16]) == aug
    assert host_response(1, key, c, 1, 2, HOSTNQN, SUBNQN, session_key=ks) == host_response(
        1, key, augmented_challenge(1, ks, c), 1, 2, HOSTNQN, SUBNQN)


@pytest.mark.parametrize("group", [1, 2])
def test_dh_exchange_agrees_and_refuses_bad_values(group):
    a, b = DhExchange(group), DhExchange(group)
    assert len(a.public) == dh_value_len(group) == {1: 256, 2: 384}[group]
    assert a.shared(b.public) == b.shared(a.public)
    p = FFDHE_PRIMES[{1: 2048, 2: 3072}[group]]
    for bad in (bytes(a.size), (1).to_bytes(a.size, "big"), (p - 1).to_bytes(a.size, "big"), a.public[1:]):
        with pytest.raises(ValueError):
            a.shared(bad)


# ---- transactions --------------------------------------------------------------------------------------

HOST_KEY = DhchapSecret.parse(NVME_CLI_VECTORS[1][3])
CTRL_KEY = DhchapSecret.parse(NVME_CLI_VECTORS[3][3])
OTHER_KEY = DhchapSecret.parse(NVME_CLI_VECTORS[0][3])


def make(*, hashes=(1, 2, 3), dhgroups=(0, 1, 2, 3, 4, 5), host_key=HOST_KEY, ctrl_key=CTRL_KEY,
         ctrl_side_ctrl_key=CTRL_KEY, bidi=True, host_hashes=(3, 2, 1), host_groups=(5, 4, 3, 2, 1, 0), qid=0):
    ctrl = ControllerTransaction(subnqn=SUBNQN, hostnqn=HOSTNQN, qid=qid, host_secret=HOST_KEY,
                                 ctrl_secret=ctrl_side_ctrl_key, hashes=hashes, dhgroups=dhgroups,
                                 seqnum=next_seqnum())
    host = HostTransaction(hostnqn=HOSTNQN, subnqn=SUBNQN, qid=qid, host_secret=host_key,
                           ctrl_secret=ctrl_key if bidi else None, hashes=host_hashes, dhgroups=host_groups,
                           seqnum=next_seqnum(), t_id=0x42)
    return host, ctrl


def drive(host, ctrl, alloc_len=4096):
    """Run the exchange the way the initiator does: send what the host has, else receive for it."""
    while True:
        out = host.next_send()
        if out is not None:
            ctrl.send(out)
            continue
        if host.state in ("done", "failed"):
            return
        try:
            host.receive(ctrl.receive(alloc_len))
        except AuthFailure:
            failure2 = host.next_send()
            if failure2 is not None:
                ctrl.send(failure2)
            raise


@pytest.mark.parametrize("bidi", [False, True], ids=["uni", "bidi"])
@pytest.mark.parametrize("group", [0, 1, 2])
@pytest.mark.parametrize("hash_id", [1, 2, 3])
def test_host_and_controller_authenticate(hash_id, group, bidi):
    host, ctrl = make(hashes=(hash_id,), dhgroups=(group,), bidi=bidi)
    drive(host, ctrl)
    assert host.authenticated and ctrl.authenticated
    assert host.state == ctrl.state == "done" and not ctrl.teardown and ctrl.failure is None
    assert (ctrl.hash_id, ctrl.dhgroup_id) == (host.hash_id, host.dhgroup_id) == (hash_id, group)
    assert ctrl.bidirectional is bidi and ctrl.t_id == host.t_id == 0x42


@pytest.mark.parametrize("group", [3, 5])
def test_large_groups(group):
    host, ctrl = make(hashes=(3,), dhgroups=(group,))
    drive(host, ctrl)
    assert host.authenticated and ctrl.authenticated


def test_controller_preference_order_wins():
    host, ctrl = make(hashes=(2, 1), dhgroups=(3, 0))
    drive(host, ctrl)
    assert (ctrl.hash_id, ctrl.dhgroup_id) == (2, 3)


def test_wrong_host_key_refused_with_failure1():
    host, ctrl = make(host_key=OTHER_KEY, dhgroups=(1,))
    with pytest.raises(AuthFailure) as info:
        drive(host, ctrl)
    assert info.value.reason_code == FailureReason.FAILED and "Failure1" in str(info.value)
    assert ctrl.state == "failed" and ctrl.teardown and not ctrl.authenticated
    assert "host key" in ctrl.failure.message
    assert host.next_send() is None    # like the kernel, no Failure2 after a Failure1


def test_wrong_controller_key_refused_by_host_with_failure2():
    host, ctrl = make(ctrl_key=OTHER_KEY)
    with pytest.raises(AuthFailure, match="controller's response does not match") as info:
        drive(host, ctrl)
    assert info.value.reason_code == FailureReason.FAILED and not host.authenticated
    assert ctrl.state == "failed" and ctrl.teardown and not ctrl.authenticated
    assert ctrl.failure.reason_code == FailureReason.FAILED and "Failure2" in ctrl.failure.message


def test_bidirectional_without_controller_key_configured():
    host, ctrl = make(ctrl_side_ctrl_key=None)
    with pytest.raises(AuthFailure, match="Failure1"):
        drive(host, ctrl)
    assert "dhchap_ctrl_key" in ctrl.failure.message and ctrl.teardown


def test_unidirectional_host_against_controller_with_ctrl_key():
    host, ctrl = make(bidi=False)
    drive(host, ctrl)
    assert host.authenticated and ctrl.authenticated and not ctrl.bidirectional


def test_no_common_hash():
    host, ctrl = make(hashes=(3,), host_hashes=(1,))
    with pytest.raises(AuthFailure) as info:
        drive(host, ctrl)
    assert info.value.reason_code == FailureReason.HASH_UNUSABLE
    assert ctrl.failure.reason_code == FailureReason.HASH_UNUSABLE and "sha256" in ctrl.failure.message


def test_no_common_dhgroup():
    host, ctrl = make(dhgroups=(3,), host_groups=(0, 1))
    with pytest.raises(AuthFailure) as info:
        drive(host, ctrl)
    assert info.value.reason_code == FailureReason.DHGROUP_UNUSABLE


def test_host_refuses_challenge_for_unoffered_group():
    host, ctrl = make(dhgroups=(2,))
    ctrl.send(host.next_send())
    challenge = bytearray(ctrl.receive(4096))
    host._dhgroups = (0, 1)   # the host offered ffdhe3072 on the wire but now only takes null/ffdhe2048
    with pytest.raises(AuthFailure) as info:
        host.receive(bytes(challenge))
    assert info.value.reason_code == FailureReason.DHGROUP_UNUSABLE
    failure2 = host.next_send()
    assert failure2[:2] == b"\x00\xf0" and failure2[7] == FailureReason.DHGROUP_UNUSABLE
    ctrl.send(failure2)
    assert ctrl.state == "failed" and ctrl.teardown


def test_replayed_reply_is_out_of_order():
    host, ctrl = make(dhgroups=(0,), bidi=False)
    ctrl.send(host.next_send())
    host.receive(ctrl.receive(4096))
    reply = host.next_send()
    ctrl.send(reply)
    assert ctrl.state == "success1"
    ctrl.send(reply)
    assert ctrl.state == "failed" and ctrl.teardown
    assert ctrl.failure.reason_code == FailureReason.INCORRECT_MESSAGE


def test_reply_replayed_into_a_new_transaction_fails():
    host, ctrl = make(dhgroups=(0,), bidi=False)
    negotiate = host.next_send()
    ctrl.send(negotiate)
    host.receive(ctrl.receive(4096))
    old_reply = host.next_send()
    ctrl.send(negotiate)          # the host restarts; the controller draws a new C1 / S1
    ctrl.receive(4096)
    ctrl.send(old_reply)
    assert ctrl.state == "failed" and ctrl.failure.reason_code == FailureReason.FAILED
    assert ctrl.receive(64)[:2] == b"\x00\xf1" and ctrl.teardown


@pytest.mark.parametrize("cut", [0, 5, 15, 40])
def test_truncated_reply(cut):
    host, ctrl = make(dhgroups=(1,), bidi=False)
    ctrl.send(host.next_send())
    host.receive(ctrl.receive(4096))
    ctrl.send(host.next_send()[:cut])
    assert ctrl.state == "failed" and ctrl.failure.reason_code == FailureReason.INCORRECT_PAYLOAD
    failure1 = ctrl.receive(4096)
    assert len(failure1) == 4096 and failure1[:2] == b"\x00\xf1" and failure1[7] == FailureReason.INCORRECT_PAYLOAD
    assert failure1[8:] == bytes(4088)


def test_truncated_negotiate_and_challenge():
    host, ctrl = make()
    negotiate = host.next_send()
    assert is_negotiate(negotiate) and len(negotiate) == 72
    ctrl.send(negotiate[:71])
    assert ctrl.failure.reason_code == FailureReason.INCORRECT_PAYLOAD
    host, ctrl = make(dhgroups=(1,))
    ctrl.send(host.next_send())
    challenge = ctrl.receive(4096).rstrip(b"\0")
    with pytest.raises(AuthFailure) as info:
        host.receive(challenge[:100])
    assert info.value.reason_code == FailureReason.INCORRECT_PAYLOAD


def test_out_of_order_messages():
    host, ctrl = make()
    ctrl.send(msg.build_success2(0x42))                     # Success2 before Negotiate
    assert ctrl.state == "failed" and ctrl.teardown and ctrl.failure.reason_code == FailureReason.INCORRECT_MESSAGE
    host, ctrl = make()
    failure1 = ctrl.receive(4096)                           # Receive before Negotiate
    assert failure1[:2] == b"\x00\xf1" and ctrl.teardown
    host, ctrl = make()
    ctrl.send(host.next_send())
    ctrl.send(host._pending or msg.build_success2(0x42))   # Send while the challenge is due
    assert ctrl.failure.reason_code == FailureReason.INCORRECT_MESSAGE
    host, ctrl = make()
    ctrl.send(b"\x07\x00\x00\x00\x42\x00")                  # unknown auth_type
    assert ctrl.failure.reason_code == FailureReason.INCORRECT_MESSAGE and ctrl.teardown


def test_wrong_transaction_id():
    host, ctrl = make(dhgroups=(0,))
    ctrl.send(host.next_send())
    host.receive(ctrl.receive(4096))
    reply = bytearray(host.next_send())
    reply[4:6] = (0x43).to_bytes(2, "little")
    ctrl.send(bytes(reply))
    assert ctrl.failure.reason_code == FailureReason.INCORRECT_PAYLOAD and "transaction id" in ctrl.failure.message
    # the host checks the controller's t_id too
    host, ctrl = make(dhgroups=(0,))
    ctrl.send(host.next_send())
    challenge = bytearray(ctrl.receive(4096))
    challenge[4] ^= 1
    with pytest.raises(AuthFailure) as info:
        host.receive(bytes(challenge))
    assert info.value.reason_code == FailureReason.INCORRECT_MESSAGE


def test_receive_allocation_length():
    host, ctrl = make(dhgroups=(1,), hashes=(1,))
    ctrl.send(host.next_send())
    out = ctrl.receive(16 + 32 + 256 + 10)
    assert len(out) == 314 and out[-10:] == bytes(10) and ctrl.state == "reply"
    host, ctrl = make(dhgroups=(1,), hashes=(1,))
    ctrl.send(host.next_send())
    out = ctrl.receive(100)                                   # shorter than the 304-byte challenge
    assert len(out) == 100 and out[:2] == b"\x00\xf1" and ctrl.state == "failed"
    assert ctrl.receive(4) == b"\x00\xf1\x00\x00"


def test_reauthentication_keeps_queue_authenticated_until_it_fails():
    host, ctrl = make(dhgroups=(1,))
    drive(host, ctrl)
    assert ctrl.authenticated
    host2 = HostTransaction(hostnqn=HOSTNQN, subnqn=SUBNQN, qid=0, host_secret=HOST_KEY, ctrl_secret=CTRL_KEY,
                            seqnum=next_seqnum(), t_id=0x43)
    ctrl.send(host2.next_send())
    assert ctrl.state == "challenge" and ctrl.authenticated and ctrl.t_id == 0x43
    host2.receive(ctrl.receive(4096))
    drive(host2, ctrl)
    assert ctrl.authenticated and host2.authenticated
    bad = HostTransaction(hostnqn=HOSTNQN, subnqn=SUBNQN, qid=0, host_secret=OTHER_KEY, ctrl_secret=None,
                          seqnum=0, t_id=0x44)
    with pytest.raises(AuthFailure):
        drive(bad, ctrl)
    assert not ctrl.authenticated and ctrl.teardown


def test_expire_times_out_half_way():
    host, ctrl = make()
    ctrl.send(host.next_send())
    ctrl.receive(4096)
    ctrl.expire()
    assert ctrl.state == "failed" and ctrl.teardown and "timed out" in ctrl.failure.message
    assert "Reply" in ctrl.failure.message


def test_bad_dh_value_from_host():
    host, ctrl = make(hashes=(3,), dhgroups=(1,), bidi=False)
    ctrl.send(host.next_send())
    host.receive(ctrl.receive(4096))
    reply = bytearray(host.next_send())
    reply[16 + 2 * 64:] = bytes(256)               # sha512 was chosen: DH value after R1 and C2
    ctrl.send(bytes(reply))
    assert ctrl.failure.reason_code == FailureReason.DHGROUP_UNUSABLE


def test_failure_messages_never_carry_secrets():
    host, ctrl = make(host_key=OTHER_KEY)
    with pytest.raises(AuthFailure) as info:
        drive(host, ctrl)
    texts = [str(info.value), ctrl.failure.message, repr(ctrl), repr(host)]
    for key in (HOST_KEY, OTHER_KEY, CTRL_KEY):
        for t in texts:
            assert key.key.hex() not in t and key.format()[10:-1] not in t


def test_messages_parse_what_they_build():
    n = msg.parse_negotiate(msg.build_negotiate(9, [1, 2, 3], [0, 1, 5]))
    assert (n.t_id, n.napd, n.authid, n.hash_ids, n.dhgroup_ids) == (9, 1, 1, [1, 2, 3], [0, 1, 5])
    c = msg.parse_challenge(msg.build_challenge(9, 1, 1, 77, b"c" * 32, b"d" * 256))
    assert (c.seqnum, c.challenge, c.dh_value) == (77, b"c" * 32, b"d" * 256)
    r = msg.parse_reply(msg.build_reply(9, b"r" * 48, None, 0, b""))
    assert (r.hl, r.cvalid, r.challenge, r.seqnum) == (48, 0, bytes(48), 0)
    s = msg.parse_success1(msg.build_success1(9, 32, b"x" * 32))
    assert s.rvalid == 1 and s.response == b"x" * 32
    assert msg.parse_failure(msg.build_failure(AuthId.FAILURE2, 9, 5)) == (9, 5)
