"""NVMe TLS PSKs: interchange format, HKDF derivations and identities against libnvme's test vectors
(libnvme test/psk.c, computed by libnvme's derive_retained_key / derive_psk_digest / gen_tls_identity)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import zlib

import pytest

from nvmeof.tls.psk import (
    HMAC_NONE,
    HMAC_SHA256,
    HMAC_SHA384,
    PskIdentity,
    TlsKey,
    format_key,
    generate_key,
    hkdf_expand,
    hkdf_extract,
    hkdf_label,
)

KEY32 = bytes.fromhex("5512DBB6737D0106F65975B773DFB011FFC344BCF442E2DD6D8BC4870B5D5B03")
KEY48 = KEY32 + bytes.fromhex("FFC344BCF442E2DD6D8BC4870B5D5B03")
HOST, SUB = "nqn.psk-test-host", "nqn.psk-test-subsys"


@pytest.mark.parametrize(("key", "hmac_id", "text"), [
    (KEY32, HMAC_NONE, "NVMeTLSkey-1:00:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:"),
    (KEY32, HMAC_SHA256, "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:"),
    (KEY48, HMAC_SHA384,
     "NVMeTLSkey-1:02:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwP/w0S89ELi3W2LxIcLXVsDn8kXZQ==:"),
])
def test_interchange_format_matches_libnvme(key: bytes, hmac_id: int, text: str) -> None:
    assert format_key(key, hmac_id) == text
    parsed = TlsKey.parse(text)
    assert parsed.key == key and parsed.hmac_id == hmac_id
    assert parsed.format() == text


@pytest.mark.parametrize(("key", "hmac_id", "compat", "identity"), [
    (KEY32, HMAC_SHA256, False, f"NVMe1R01 {HOST} {SUB} iSbjiStwJ/1TrTvDlt2fjFmzvsytOJelidNnA+X5lEU="),
    (KEY48, HMAC_SHA384, False,
     f"NVMe1R02 {HOST} {SUB} QhW2+Rp6RzHlNtCslyRxMnwJ11tKKhz8JCAQpQ+XUD8f9td1VeH5h53yz2wKJG1a"),
    (KEY32, HMAC_SHA256, True, f"NVMe1R01 {HOST} {SUB} 66GuqV08TsAGII39teWUfwQwizjv06Jy8jOcX3NAAzM="),
    (KEY48, HMAC_SHA384, True,
     f"NVMe1R02 {HOST} {SUB} RsKmYJ3nAn1ApjjMloJFbAkLPivONDAX/xW327YBUsn2eGShXSjCZvBaOxscLqmz"),
])
def test_identity_matches_libnvme(key: bytes, hmac_id: int, compat: bool, identity: str) -> None:
    """The digest of a version-1 identity is HMAC over the retained PSK: it proves the HKDF retained key."""
    ident = TlsKey(key, hmac_id).identity(HOST, SUB, 1, compat=compat)
    assert str(ident) == identity
    assert PskIdentity.parse(identity) == ident


def test_version0_identity_and_cipher_by_length() -> None:
    assert str(TlsKey(KEY32, HMAC_SHA256).identity(HOST, SUB, 0)) == f"NVMe0R01 {HOST} {SUB}"
    assert str(TlsKey(KEY48, HMAC_NONE).identity(HOST, SUB, 0)) == f"NVMe0R02 {HOST} {SUB}"
    assert TlsKey(KEY48, HMAC_NONE).cipher_suite == "TLS_AES_256_GCM_SHA384"
    assert TlsKey(KEY32, HMAC_NONE).cipher_suite == "TLS_AES_128_GCM_SHA256"


def test_hkdf_rfc5869_case1() -> None:
    """RFC 5869 A.1 (SHA-256)."""
    ikm = bytes.fromhex("0b" * 22)
    salt = bytes.fromhex("000102030405060708090a0b0c")
    info = bytes.fromhex("f0f1f2f3f4f5f6f7f8f9")
    prk = hkdf_extract(HMAC_SHA256, ikm, salt)
    assert prk.hex() == "077709362c2e32df0ddc3f0dc47bba6390b6c73bb50f9c3122ec844ad7c2b3e5"
    okm = hkdf_expand(HMAC_SHA256, prk, info, 42)
    assert okm.hex() == ("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf"
                         "34007208d5b887185865")


def test_hkdf_label_layout() -> None:
    assert hkdf_label("HostNQN", b"nqn.h", 32) == b"\x00\x20\x0dtls13 HostNQN\x05nqn.h"
    assert hkdf_label("HostNQN", b"nqn.h", 32, compat=True) == b"\x20\x00tls13 HostNQNnqn.h"


def test_retained_and_tls_psk_follow_tp8018() -> None:
    """Recompute the chain from the TP 8018 formulas with hmac/hashlib directly (independent of psk.py's HKDF)."""
    def expand_label(h, secret: bytes, label: bytes, ctx: bytes, n: int) -> bytes:
        prk = hmac.new(bytes(h().digest_size), secret, h).digest()
        info = n.to_bytes(2, "big") + bytes([6 + len(label)]) + b"tls13 " + label + bytes([len(ctx)]) + ctx
        return hmac.new(prk, info + b"\x01", h).digest()[:n]

    key = TlsKey(KEY32, HMAC_SHA256)
    retained = expand_label(hashlib.sha256, KEY32, b"HostNQN", HOST.encode(), 32)
    assert key.retained(HOST) == retained
    ident = key.identity(HOST, SUB, 1)
    digest = base64.b64encode(hmac.new(retained, f"{HOST} {SUB} NVMe-over-Fabrics".encode(),
                                       hashlib.sha256).digest()).decode()
    assert ident.digest == digest
    assert key.tls_psk(ident) == expand_label(hashlib.sha256, retained, b"nvme-tls-psk",
                                              f"01 {digest}".encode(), 32)
    ident0 = key.identity(HOST, SUB, 0)
    assert key.tls_psk(ident0) == expand_label(hashlib.sha256, retained, b"nvme-tls-psk", str(ident0).encode(), 32)
    # a configured PSK with hash 00 is its own retained PSK
    assert TlsKey(KEY32, HMAC_NONE).retained(HOST) == KEY32


def test_tls_psk_refuses_foreign_identity() -> None:
    key = TlsKey(KEY32, HMAC_SHA256)
    other = TlsKey(bytes(32), HMAC_SHA256).identity(HOST, SUB, 1)
    with pytest.raises(ValueError, match="digest"):
        key.tls_psk(other)
    with pytest.raises(ValueError, match="hash"):
        key.tls_psk(PskIdentity(0, False, 2, HOST, SUB))


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


@pytest.mark.parametrize(("text", "message"), [
    ("DHHC-1:01:" + _b64(KEY32 + zlib.crc32(KEY32).to_bytes(4, "little")) + ":", "must start with"),
    ("NVMeTLSkey-1:03:" + _b64(KEY32 + zlib.crc32(KEY32).to_bytes(4, "little")) + ":", "hash id 03"),
    ("NVMeTLSkey-1:01:" + _b64(KEY32 + b"\0\0\0\0") + ":", "CRC-32"),
    ("NVMeTLSkey-1:01:" + _b64(KEY32[:16] + zlib.crc32(KEY32[:16]).to_bytes(4, "little")) + ":", "decodes to 20"),
    ("NVMeTLSkey-1:02:" + _b64(KEY32 + zlib.crc32(KEY32).to_bytes(4, "little")) + ":", "needs 48"),
    ("NVMeTLSkey-1:01:" + _b64(KEY32 + zlib.crc32(KEY32).to_bytes(4, "little")), "end with"),
    ("NVMeTLSkey-1:01:!!!!:", "base64"),
])
def test_parse_refuses_bad_keys_without_echoing(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        TlsKey.parse(text)
    assert _b64(KEY32)[:12] not in str(info.value)


def test_key_never_shows_itself() -> None:
    key = TlsKey(KEY32, HMAC_SHA256)
    for text in (repr(key), str(key), f"{key}"):
        assert KEY32.hex() not in text and _b64(KEY32)[:12] not in text


def test_generate_key() -> None:
    assert TlsKey.parse(generate_key()).hmac_id == HMAC_SHA256
    k = TlsKey.parse(generate_key(hmac_id=HMAC_SHA384))
    assert len(k.key) == 48
    assert generate_key(secret=KEY32) == format_key(KEY32, HMAC_SHA256)
    with pytest.raises(ValueError, match="needs 48"):
        generate_key(hmac_id=HMAC_SHA384, secret=KEY32)
    assert generate_key() != generate_key()


@pytest.mark.parametrize("text", ["NVMe2R01 a b", "NVMe0R03 a b", "NVMe1R01 a b", "NVMe0R01 a b c", "garbage"])
def test_identity_parse_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        PskIdentity.parse(text)


def test_target_tells_compat_derivation_from_the_digest() -> None:
    """A version-1 identity made by libnvme < 1.11 (compat) gets the compat TLS PSK with compat=None."""
    key = TlsKey(KEY32, HMAC_SHA256)
    old = key.identity(HOST, SUB, 1, compat=True)
    new = key.identity(HOST, SUB, 1)
    assert old.digest != new.digest
    assert key.tls_psk(old, compat=None) == key.tls_psk(old, compat=True) != key.tls_psk(new)
    assert key.tls_psk(new, compat=None) == key.tls_psk(new)
    with pytest.raises(ValueError, match="digest"):
        key.tls_psk(old)   # compat=False insists on the current derivation
