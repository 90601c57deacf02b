"""NVMe/TCP over TLS 1.3 with PSKs, target and initiator of this project over 127.0.0.1 (TP 8011 / 8018).

Both engines of the target (batch: the default listener; stream) serve TLS; the initiator runs TLS queues
on its batch engine (tests/test_tls_batch.py checks both ends' fast paths). Refusals: a wrong key, clear
NVMe/TCP to a TLS-only listener, TLS to a clear listener, and a Connect naming another host than the PSK
identity.
"""

from __future__ import annotations

import asyncio
import logging
import os

import pytest
from target_host import SUBNQN, serve_tls

import initiator
from initiator.queue import TransportError
from nvmeof import defaults
from nvmeof.status import NvmeError
from nvmeof.tls.psk import HMAC_SHA256, HMAC_SHA384, TlsKey, generate_key
from target.transports import tcp

HOST = "nqn.2014-08.org.nvmexpress:uuid:0f0f0f0f-1111-2222-3333-444444444444"
KEY = generate_key(hmac_id=HMAC_SHA256)
KEY384 = generate_key(hmac_id=HMAC_SHA384)


async def _serve(mode: str, *, engine: str = "batch", key: str = KEY, allow: bool = True):  # type: ignore[no-untyped-def]
    tgt, server = await serve_tls(mode, key, hostnqn=HOST, engine=engine, allow=allow)
    return tgt, server.port


async def _rw(ctrl) -> None:  # type: ignore[no-untyped-def]
    for size in (4096, 128 * 1024, 600 * 1024):
        data = os.urandom(size)
        await ctrl.write(1, 0, data)
        assert bytes(await ctrl.read(1, 0, size // 512)) == data


@pytest.mark.parametrize("engine", ["batch", "stream"])
@pytest.mark.parametrize(("key", "version"), [(KEY, 1), (KEY, 0), (KEY384, 1)])
async def test_tls_loopback_reads_and_writes(engine: str, key: str, version: int) -> None:
    tgt, port = await _serve("required", engine=engine, key=key)
    try:
        async with initiator.connect("127.0.0.1", port, SUBNQN, hostnqn=HOST, nr_io_queues=2, tls_key=key,
                                     tls_identity_version=version) as ctrl:
            await _rw(ctrl)
    finally:
        await tgt.close()


async def test_tls_queue_carries_identity_and_suite() -> None:
    tgt, port = await _serve("required", key=KEY384)
    seen = []
    real = tcp.TargetConnection._tls_received

    def spy(self, data):  # type: ignore[no-untyped-def]
        real(self, data)
        if self._tls is not None and self._tls.handshake_done:
            seen.append((str(self.queue.tls), self._tls.cipher_name))
    try:
        tcp.TargetConnection._tls_received = spy  # type: ignore[method-assign]
        async with initiator.connect("127.0.0.1", port, SUBNQN, hostnqn=HOST, tls_key=KEY384) as ctrl:
            await _rw(ctrl)
    finally:
        tcp.TargetConnection._tls_received = real  # type: ignore[method-assign]
        await tgt.close()
    ident = str(TlsKey.parse(KEY384).identity(HOST, SUBNQN, 1))
    assert (ident, "TLS_AES_256_GCM_SHA384") in seen


@pytest.mark.parametrize("engine", ["batch", "stream"])
async def test_sha384_key_offered_with_a_sha256_binder(engine: str, caplog: pytest.LogCaptureFixture) -> None:
    """connect(tls_sha256_binder=True), the interop option for tlshd/GnuTLS < 3.8.11 targets: every queue offers
    the SHA-384 PSK under a SHA-256 binder, our target takes it with TLS_AES_128_GCM_SHA256 (its INFO line says
    so) and I/O runs; without the option the same key gets TLS_AES_256_GCM_SHA384 (see the test above)."""
    tgt, port = await _serve("required", engine=engine, key=KEY384)
    seen = []
    real = tcp.TargetConnection._tls_received

    def spy(self, data):  # type: ignore[no-untyped-def]
        real(self, data)
        if self._tls is not None and self._tls.handshake_done:
            seen.append((self._tls.cipher_name, self._tls.sha256_binder))
    try:
        tcp.TargetConnection._tls_received = spy  # type: ignore[method-assign]
        with caplog.at_level(logging.INFO):
            async with initiator.connect("127.0.0.1", port, SUBNQN, hostnqn=HOST, nr_io_queues=2, tls_key=KEY384,
                                         tls_sha256_binder=True) as ctrl:
                assert ctrl.tls_sha256_binder
                assert {q._tls.cipher_name for q in [ctrl.admin, *ctrl.io_queues]} == {"TLS_AES_128_GCM_SHA256"}
                await _rw(ctrl)
    finally:
        tcp.TargetConnection._tls_received = real  # type: ignore[method-assign]
        await tgt.close()
    assert set(seen) == {("TLS_AES_128_GCM_SHA256", True)}
    assert KEY384.split(":")[2][:16] not in caplog.text


def test_tls_sha256_binder_needs_a_key() -> None:
    from initiator.controller import HostController
    with pytest.raises(ValueError, match="tls_sha256_binder needs tls_key"):
        HostController("127.0.0.1", 4420, SUBNQN, tls_sha256_binder=True)


async def test_wrong_key_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    tgt, port = await _serve("required")
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(TransportError, match="TLS handshake failed"):
            await initiator.connect("127.0.0.1", port, SUBNQN, hostnqn=HOST, tls_key=generate_key(), timeout=5)
        assert not tgt.controllers
    finally:
        await tgt.close()
    assert any("TLS handshake" in r.getMessage() for r in caplog.records)
    assert KEY.split(":")[2][:16] not in caplog.text


async def test_unknown_host_is_refused_by_identity(caplog: pytest.LogCaptureFixture) -> None:
    tgt, port = await _serve("required")
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(TransportError, match="unknown psk identity"):
            await initiator.connect("127.0.0.1", port, SUBNQN, hostnqn=HOST + "x", tls_key=KEY, timeout=5)
    finally:
        await tgt.close()
    assert any("is not allowed on" in r.getMessage() for r in caplog.records)


async def test_clear_host_to_required_listener_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    tgt, port = await _serve("required")
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(TransportError):
            await initiator.connect("127.0.0.1", port, SUBNQN, hostnqn=HOST, timeout=5)
    finally:
        await tgt.close()
    lines = [r.getMessage() for r in caplog.records if "requires TLS" in r.getMessage()]
    assert len(lines) == 1


@pytest.mark.parametrize("engine", ["batch", "stream"])
async def test_tls_host_to_clear_listener_is_refused(engine: str, caplog: pytest.LogCaptureFixture) -> None:
    tgt, port = await _serve("none", engine=engine)
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(TransportError):
            await initiator.connect("127.0.0.1", port, SUBNQN, hostnqn=HOST, tls_key=KEY, timeout=5)
    finally:
        await tgt.close()
    lines = [r.getMessage() for r in caplog.records if "starts a TLS handshake" in r.getMessage()]
    assert len(lines) == 1


async def test_optional_listener_takes_both() -> None:
    tgt, port = await _serve("optional")
    try:
        async with initiator.connect("127.0.0.1", port, SUBNQN, hostnqn=HOST, tls_key=KEY) as ctrl:
            await _rw(ctrl)
        async with initiator.connect("127.0.0.1", port, SUBNQN, hostnqn=HOST) as ctrl:
            await _rw(ctrl)
    finally:
        await tgt.close()


async def test_connect_must_name_the_identity_host(caplog: pytest.LogCaptureFixture) -> None:
    """A host holding a valid PSK cannot Connect as another host on that TLS queue."""
    tgt, port = await _serve("required")
    other = "nqn.2014-08.org.nvmexpress:uuid:99999999-1111-2222-3333-444444444444"
    tgt.subsystems[SUBNQN].hosts.add(other)
    key = TlsKey.parse(KEY)
    from initiator.controller import HostController

    class Impostor(HostController):
        def _tls_session(self):  # type: ignore[no-untyped-def]
            real, self.hostnqn = self.hostnqn, HOST
            try:
                return super()._tls_session()
            finally:
                self.hostnqn = real
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(NvmeError, match="CONNECT_INVALID_HOST"):
            await Impostor("127.0.0.1", port, SUBNQN, hostnqn=other, tls_key=key, timeout=5).open()
        assert not tgt.controllers
    finally:
        await tgt.close()
    assert any("is not the TLS PSK identity's" in r.getMessage() for r in caplog.records)


async def test_handshake_deadline(caplog: pytest.LogCaptureFixture) -> None:
    tgt, port = await _serve("required")
    tcp.TcpPort.of(tgt).limits.ic_timeout = 0.2
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        with caplog.at_level(logging.WARNING):
            writer.write(b"\x16\x03\x01\x00\x10")   # a TLS record header, then nothing
            assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
    finally:
        await tgt.close()
    assert any("did not complete its TLS handshake" in r.getMessage() for r in caplog.records)


def test_tls_needs_key_and_tcp() -> None:
    from initiator.controller import HostController
    with pytest.raises(ValueError, match="tls needs tls_key"):
        HostController("127.0.0.1", 4420, SUBNQN, tls=True)
    with pytest.raises(ValueError, match="tls_key"):
        HostController("127.0.0.1", 4420, SUBNQN, tls_key="NVMeTLSkey-1:01:bad:")
    ctrl = HostController("127.0.0.1", 4420, SUBNQN, tls_key=KEY)
    assert ctrl.tls and ctrl.engine == "batch"   # TLS queues run the batch engine (issue 26)
    assert defaults.TLS_MODES == ("none", "optional", "required")


async def test_compat_host_is_recognised_by_its_digest() -> None:
    tgt, port = await _serve("required")
    try:
        async with initiator.connect("127.0.0.1", port, SUBNQN, hostnqn=HOST, tls_key=KEY, tls_compat=True) as ctrl:
            await _rw(ctrl)
    finally:
        await tgt.close()


@pytest.mark.parametrize("engine", ["batch", "stream"])
async def test_compat_host_without_digest_needs_tls_compat(engine: str, caplog: pytest.LogCaptureFixture) -> None:
    """An NVMe0R identity whose PSK was derived the libnvme compat way (nvme-cli 2.13 inserting a key for the
    kernel host): refused with a log line naming tls_compat while the host entry is not marked, served once it is;
    a host marked tls_compat offering an RFC 8446-derived NVMe0R PSK is then refused with the opposite hint."""
    tgt, port = await _serve("required", engine=engine)
    entry = tgt.subsystems[SUBNQN].host_auth[HOST]
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(TransportError):
            await initiator.connect("127.0.0.1", port, SUBNQN, hostnqn=HOST, tls_key=KEY, tls_compat=True,
                                    tls_identity_version=0, timeout=5)
        lines = [r.getMessage() for r in caplog.records if r.name.startswith("target.")]
        assert len(lines) == 1 and "--tls-compat" in lines[0] and HOST in lines[0]
        assert KEY.split(":")[2] not in caplog.text
        entry.tls_compat = True
        async with initiator.connect("127.0.0.1", port, SUBNQN, hostnqn=HOST, tls_key=KEY, tls_compat=True,
                                     tls_identity_version=0) as ctrl:
            await _rw(ctrl)
        # the digest still decides for NVMe1R identities: an RFC-derived NVMe1R key works on a compat host
        async with initiator.connect("127.0.0.1", port, SUBNQN, hostnqn=HOST, tls_key=KEY, nr_io_queues=1) as ctrl:
            await _rw(ctrl)
        caplog.clear()
        with caplog.at_level(logging.WARNING), pytest.raises(TransportError):
            await initiator.connect("127.0.0.1", port, SUBNQN, hostnqn=HOST, tls_key=KEY, tls_identity_version=0,
                                    timeout=5)
        assert any("--no-tls-compat" in r.getMessage() for r in caplog.records)
    finally:
        await tgt.close()
