"""nvmeof/tls/openssl.py's TlsSession alone: a client and a server session wired back to back, sans-IO."""

from __future__ import annotations

import os
import random

import pytest

from nvmeof.tls.openssl import TlsError, TlsSession
from nvmeof.tls.psk import HMAC_SHA256, HMAC_SHA384, PskIdentity, TlsKey


def _handshake(client: TlsSession, server: TlsSession) -> None:
    """Start ``client`` and pass the handshake's flights back and forth (TLS 1.3 PSK needs fewer than four)."""
    client.start()
    for _ in range(4):
        if out := client.data_to_send():
            server.receive(out)
        if out := server.data_to_send():
            client.receive(out)


def _pair(key: TlsKey, offered: TlsKey | None = None) -> tuple[TlsSession, TlsSession]:
    ident = (offered or key).identity("nqn.h", "nqn.s", 1)
    client = TlsSession(server=False, identity=str(ident).encode(), psk=(offered or key).tls_psk(ident),
                        cipher=key.cipher)
    server = TlsSession(server=True, lookup=lambda raw: (key.tls_psk(PskIdentity.parse(raw)), key.cipher))
    _handshake(client, server)
    return client, server


@pytest.mark.parametrize(("hmac_id", "suite"), [(HMAC_SHA256, "TLS_AES_128_GCM_SHA256"),
                                                (HMAC_SHA384, "TLS_AES_256_GCM_SHA384")])
def test_stream_survives_any_chunking(hmac_id: int, suite: str) -> None:
    key = TlsKey(os.urandom(32 if hmac_id == 1 else 48), hmac_id)
    client, server = _pair(key)
    assert client.handshake_done and server.handshake_done
    assert server.cipher_name == client.cipher_name == suite and server.version == "TLSv1.3"
    payload = os.urandom(3 << 20)
    for i in range(0, len(payload), 100_000):
        server.send(payload[i:i + 100_000])
    wire = server.data_to_send()
    rng = random.Random(7)
    got, pos = bytearray(), 0
    while pos < len(wire):
        n = rng.randint(1, 70_000)
        got += bytes(client.receive(wire[pos:pos + n]))
        pos += n
    assert got == payload


def test_wrong_psk_fails_the_handshake() -> None:
    key = TlsKey(os.urandom(32), HMAC_SHA256)
    other = TlsKey(os.urandom(32), HMAC_SHA256)
    ident = key.identity("nqn.h", "nqn.s", 0)   # the same identity, another key behind it
    wrong = other.tls_psk(other.identity("nqn.h", "nqn.s", 0))
    client = TlsSession(server=False, identity=str(ident).encode(), psk=wrong, cipher=1)
    server = TlsSession(server=True, lookup=lambda raw: (key.tls_psk(PskIdentity.parse(raw)), 1))
    client.start()
    with pytest.raises(TlsError):
        server.receive(client.data_to_send())
    alert = server.data_to_send()
    with pytest.raises(TlsError):
        client.receive(alert)
    assert not client.handshake_done


@pytest.mark.parametrize(("binder", "suite", "fallback"), [(HMAC_SHA384, "TLS_AES_256_GCM_SHA384", False),
                                                           (HMAC_SHA256, "TLS_AES_128_GCM_SHA256", True)])
def test_sha384_psk_under_a_sha256_binder_gets_a_sha256_suite(binder: int, suite: str, fallback: bool) -> None:
    """A client binding a SHA-384 PSK to SHA-256 (GnuTLS before 3.8.11, as tlshd does) gets the PSK with a SHA-256
    suite from our server; one binding it to SHA-384 (TP 8011) gets TLS_AES_256_GCM_SHA384."""
    key = TlsKey(os.urandom(48), HMAC_SHA384)
    ident = key.identity("nqn.h", "nqn.s", 0)
    psk = key.tls_psk(ident)
    client = TlsSession(server=False, identity=str(ident).encode(), psk=psk, cipher=binder)
    server = TlsSession(server=True, lookup=lambda raw: (key.tls_psk(PskIdentity.parse(raw)), key.cipher))
    _handshake(client, server)
    assert client.handshake_done and server.handshake_done
    assert server.cipher_name == client.cipher_name == suite and server.sha256_binder is fallback
    server.send(b"data")
    assert bytes(client.receive(server.data_to_send())) == b"data"


def test_sha256_binder_with_another_key_still_fails() -> None:
    """The fallback takes the binder's hash, not its word: a SHA-256 binder made with another PSK fails."""
    key = TlsKey(os.urandom(48), HMAC_SHA384)
    ident = key.identity("nqn.h", "nqn.s", 0)
    client = TlsSession(server=False, identity=str(ident).encode(), psk=os.urandom(48), cipher=HMAC_SHA256)
    server = TlsSession(server=True, lookup=lambda raw: (key.tls_psk(PskIdentity.parse(raw)), key.cipher))
    client.start()
    with pytest.raises(TlsError, match="binder"):
        server.receive(client.data_to_send())
    assert not server.handshake_done


@pytest.mark.parametrize(("hmac_id", "suite", "bound"), [(HMAC_SHA384, "TLS_AES_128_GCM_SHA256", True),
                                                         (HMAC_SHA256, "TLS_AES_128_GCM_SHA256", False)])
def test_client_sha256_binder_option(hmac_id: int, suite: str, bound: bool) -> None:
    """TlsSession(sha256_binder=True) offers a SHA-384 PSK under a SHA-256 binder (the server sees a 32-byte binder
    and takes the fallback); a SHA-256 PSK is offered as always."""
    key = TlsKey(os.urandom(48 if hmac_id == HMAC_SHA384 else 32), hmac_id)
    ident = key.identity("nqn.h", "nqn.s", 1)
    client = TlsSession(server=False, identity=str(ident).encode(), psk=key.tls_psk(ident), cipher=key.cipher,
                        sha256_binder=True)
    server = TlsSession(server=True, lookup=lambda raw: (key.tls_psk(PskIdentity.parse(raw)), key.cipher))
    _handshake(client, server)
    assert client.handshake_done and server.handshake_done
    assert server.cipher_name == client.cipher_name == suite
    assert client.sha256_binder is bound and server.sha256_binder is bound
    client.send(b"data")
    assert bytes(server.receive(client.data_to_send())) == b"data"


def test_client_sha256_binder_takes_a_chacha20_only_server() -> None:
    """A server offering only TLS_CHACHA20_POLY1305_SHA256 for the SHA-384 PSK (tlshd 1.0.0's list for a 48-byte
    key) is still met: the client's SHA-256 suites include it."""
    from nvmeof.tls import openssl

    key = TlsKey(os.urandom(48), HMAC_SHA384)
    ident = key.identity("nqn.h", "nqn.s", 0)
    client = TlsSession(server=False, identity=str(ident).encode(), psk=key.tls_psk(ident), cipher=key.cipher,
                        sha256_binder=True)
    server = TlsSession(server=True, lookup=lambda raw: (key.tls_psk(PskIdentity.parse(raw)), key.cipher))
    real = openssl._SHA256_BINDER_SUITES
    openssl._SHA256_BINDER_SUITES = "TLS_CHACHA20_POLY1305_SHA256"   # the server side's list only
    try:
        client.start()
        server.receive(client.data_to_send())
    finally:
        openssl._SHA256_BINDER_SUITES = real
    client.receive(server.data_to_send())
    server.receive(client.data_to_send())
    assert client.handshake_done and server.handshake_done
    assert server.cipher_name == client.cipher_name == "TLS_CHACHA20_POLY1305_SHA256"


def test_sha256_binder_is_a_client_option() -> None:
    with pytest.raises(ValueError, match="client option"):
        TlsSession(server=True, lookup=lambda raw: None, sha256_binder=True)
