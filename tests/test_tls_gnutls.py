"""Interop with GnuTLS (the TLS library of tlshd, which does the Linux kernel's NVMe/TCP handshakes):
gnutls-cli as the host against our target, our TlsSession as the host against gnutls-serv. Skipped without
Debian's gnutls-bin. GnuTLS before 3.8.11 binds every external PSK to SHA-256 (its binder and its suite): our
target takes a SHA-384 key bound so; our host offers SHA-384 keys as TP 8011 says, so only SHA-256 keys against
gnutls-serv."""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from target_host import SUBNQN, make_target

from nvmeof.tls.openssl import TlsError, TlsSession
from nvmeof.tls.psk import TlsKey, generate_key
from target.model import HostAuth, Listener

pytestmark = pytest.mark.skipif(shutil.which("gnutls-cli") is None or shutil.which("gnutls-serv") is None,
                                reason="needs gnutls-cli and gnutls-serv (Debian package gnutls-bin)")

# NQNs without ':' here: gnutls-serv's PSK file is "identity:hexkey" (the identity is the text before the ':')
HOST, SUB = "nqn.2014-08.org.example.gnutlshost", "nqn.2014-08.org.example.gnutlssub"
PRIORITY = "NORMAL:-VERS-ALL:+VERS-TLS1.3:+PSK:+DHE-PSK:+ECDHE-PSK:%NO_TICKETS"
ICREQ = bytes([0, 0, 128, 0]) + (128).to_bytes(4, "little") + bytes(120)


@pytest.mark.parametrize(("version", "hmac_id"), [(1, 1), (0, 1), (1, 2), (0, 2)])
async def test_gnutls_host_gets_icresp_from_our_target(version: int, hmac_id: int,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """SHA-384 keys too: this GnuTLS binds the PSK to SHA-256 (a 32-byte binder), as tlshd's GnuTLS 3.8.9 does
    in Linux's handshakes; our target then takes the PSK with TLS_AES_128_GCM_SHA256 and logs it."""
    key = TlsKey.parse(generate_key(hmac_id=hmac_id))
    tgt = make_target()
    sub = tgt.subsystems.pop(SUBNQN)
    sub.nqn = SUB
    tgt.subsystems[SUB] = sub
    sub.allow_any_host = False
    sub.hosts.add(HOST)
    sub.host_auth[HOST] = HostAuth(tls_key=key)
    listener = Listener("tcp", "ipv4", "127.0.0.1", 0, portid=1, tls="required")
    tgt.listeners[listener.id] = listener
    server = await tgt.start_listener(listener)
    ident = key.identity(HOST, SUB, version)
    caplog.set_level(logging.INFO)
    proc = await asyncio.create_subprocess_exec(
        "gnutls-cli", "-p", str(server.port), "127.0.0.1", f"--pskusername={ident}",
        f"--pskkey={key.tls_psk(ident).hex()}", f"--priority={PRIORITY}", "--insecure",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        seen = b""
        while b"Handshake was completed" not in seen:
            line = await asyncio.wait_for(proc.stdout.readline(), 10)
            assert line, seen.decode(errors="replace")
            seen += line
        proc.stdin.write(ICREQ)   # an ICReq through the TLS session: the target answers an ICResp (type 1)
        await proc.stdin.drain()
        while b"\x01\x00\x80\x00" not in seen:
            chunk = await asyncio.wait_for(proc.stdout.read(4096), 10)
            assert chunk, seen.decode(errors="replace")
            seen += chunk
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        await tgt.close()
    done = [r.getMessage() for r in caplog.records if "PSK identity" in r.getMessage() and "TLS" in r.getMessage()]
    assert done and "TLS_AES_128_GCM_SHA256" in done[0], done
    assert ("SHA-256 binder" in done[0]) == (hmac_id == 2), done


def _session_against_gnutls_serv(key: TlsKey, version: int, tmp_path: Path, sha256_binder: bool) -> TlsSession:
    """Our client session to gnutls-serv --echo holding the key's TLS PSK under its identity: a line echoed back."""
    ident = key.identity(HOST, SUB, version)
    (tmp_path / "psk.txt").write_text(f"{ident}:{key.tls_psk(ident).hex()}\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = subprocess.Popen(["gnutls-serv", "--echo", "-p", str(port), f"--pskpasswd={tmp_path / 'psk.txt'}",
                            f"--priority={PRIORITY}"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                conn = socket.create_connection(("127.0.0.1", port))
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline, "gnutls-serv did not listen"
                time.sleep(0.1)
        conn.settimeout(10)
        with conn:
            sess = TlsSession(server=False, identity=str(ident).encode(), psk=key.tls_psk(ident), cipher=key.cipher,
                              sha256_binder=sha256_binder)
            sess.start()
            conn.sendall(sess.data_to_send())
            got = b""
            while not sess.handshake_done:
                data = conn.recv(65536)
                if not data:
                    raise TlsError(f"gnutls-serv closed the connection during the handshake ({sess.failure})")
                got += bytes(sess.receive(data))
                if out := sess.data_to_send():
                    conn.sendall(out)
            sess.send(b"nvme-over-tls\n")
            conn.sendall(sess.data_to_send())
            while b"\n" not in got:
                data = conn.recv(65536)
                assert data
                got += bytes(sess.receive(data))
        assert got == b"nvme-over-tls\n"
        return sess
    finally:
        srv.kill()
        srv.wait()


@pytest.mark.parametrize(("version", "hmac_id"), [(1, 1), (0, 1), (1, 2), (0, 2)])
def test_our_host_session_against_gnutls_serv(version: int, hmac_id: int, tmp_path: Path) -> None:
    """SHA-384 keys with sha256_binder=True (connect(tls_sha256_binder=True)), as tlshd's GnuTLS 3.8.9 takes them."""
    key = TlsKey.parse(generate_key(hmac_id=hmac_id))
    sess = _session_against_gnutls_serv(key, version, tmp_path, sha256_binder=hmac_id == 2)
    assert sess.cipher_name in ("TLS_AES_128_GCM_SHA256", "TLS_CHACHA20_POLY1305_SHA256")
    assert sess.sha256_binder is (hmac_id == 2)


def test_our_host_sha384_default_is_refused_by_gnutls_serv(tmp_path: Path) -> None:
    """The default (TP 8011: SHA-384 binder, TLS_AES_256_GCM_SHA384) against GnuTLS before 3.8.11: refused, the
    reason for sha256_binder. A GnuTLS that binds external PSKs to SHA-384 would make this fail."""
    key = TlsKey.parse(generate_key(hmac_id=2))
    with pytest.raises(TlsError):
        _session_against_gnutls_serv(key, 1, tmp_path, sha256_binder=False)
