"""TLS queues on the batch engines (issue 26): past the handshake both ends run their fast paths on the plaintext
the TLS session decrypts into their receive buffers, and encrypt what one wake-up sends together.

- target: tests/test_tcp_batch.py's scripted session (reads, in-capsule and R2T writes, errors, admin commands,
  SQ flow control on and off) over TLS, the host's PDUs cut into records of odd sizes and its records into odd
  writes, gives the host exactly the plaintext the same session gets in the clear, and the fast path ran;
- host: TLS queues are BatchQueues; a batch of slot commands leaves in one encryption and one sendmsg, and their
  CapsuleResp/C2HData/R2T never reach the sans-IO TcpConnection;
- `nvmeof bench --verify crc32c` over TLS for 4 KiB and 128 KiB reads and writes, on the bench's batch path,
  and a corrupted block is still caught.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import socket
from typing import Any

import pytest
from target_host import HOSTNQN, SUBNQN, admin_session, serve_tls
from test_fast_paths import RecordingHost, _batch
from test_tcp_batch import _send_cut, script_batches

import initiator
from initiator.bench import ConnectSpec, JobSpec, run_bench
from initiator.engine import BatchQueue
from nvmeof.spec.nvme import Command, IoOpcode
from nvmeof.tls.openssl import TlsError, TlsSession
from nvmeof.tls.psk import HMAC_SHA256, TlsKey, generate_key
from target.backends.ram import RamBackend
from target.model import Namespace
from target.transports import tcp_batch
from target.transports.tcp_batch import BatchConnection, BatchTcpListener

KEY = generate_key(hmac_id=HMAC_SHA256)


async def _serve(tls: str) -> tuple[Any, BatchTcpListener]:
    """target_host.serve_tls on the batch engine's listener, HOSTNQN allowed with the TLS PSK KEY, and a namespace 2
    of 8 MiB beside namespace 1 (1 MiB)."""
    tgt, server = await serve_tls(tls, KEY)
    tgt.subsystems[SUBNQN].namespaces[2] = Namespace(2, RamBackend(8 << 20))
    assert isinstance(server, BatchTcpListener)
    return tgt, server


def _io_conns(server: BatchTcpListener) -> list[BatchConnection]:
    return [c for c in server.connections if isinstance(c, BatchConnection) and c.queue.qid]


# --- target: the scripted session over TLS gives the clear session's bytes ---------------------------------------


class TlsRecordingHost(RecordingHost):
    """RecordingHost over TLS 1.3 on a real socket: ICReq after the handshake; every flush cut into records of odd
    sizes (PDUs span records) and the ciphertext into odd writes; ``received`` keeps the plaintext."""

    def __init__(self, rng: random.Random, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        key = TlsKey.parse(KEY)
        ident = key.identity(HOSTNQN, SUBNQN, 1)
        self.tls = TlsSession(server=False, identity=str(ident).encode(), psk=key.tls_psk(ident), cipher=key.cipher)
        self.rng = rng

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.tls.start()
        self._write(self.tls.data_to_send())

    def data_received(self, data: bytes) -> None:
        was_done = self.tls.handshake_done
        try:
            plain = self.tls.receive(data)
        except TlsError:   # the target's alert
            assert self.transport is not None
            self.transport.close()
            return
        self._write(self.tls.data_to_send())   # our Finished
        if not was_done and self.tls.handshake_done:
            self.conn.send_icreq(hdgst=self.hdgst, ddgst=self.ddgst)
            self.flush()
        if plain:
            super().data_received(bytes(plain))

    def flush(self) -> None:
        if self.hold or self.transport is None or self.transport.is_closing():
            return
        plain = b"".join(bytes(b) for b in self.conn.data_to_send())
        pos = 0
        while pos < len(plain):
            n = self.rng.choice((1, 7, 23, 72, 73, 500, 4096, 20000))
            self.tls.send(plain[pos:pos + n])
            pos += n
        self._write(self.tls.data_to_send())

    def _write(self, cipher: bytes) -> None:
        assert self.transport is not None
        pos = 0
        while pos < len(cipher):
            n = self.rng.choice((5, 100, 1000, 16000, 70000))
            self.transport.write(cipher[pos:pos + n])
            pos += n


async def _open(port: int, tls: bool, rng: random.Random) -> RecordingHost:
    loop = asyncio.get_running_loop()
    _, host = await loop.create_connection(lambda: TlsRecordingHost(rng) if tls else RecordingHost(),
                                           "127.0.0.1", port)
    assert isinstance(host, RecordingHost)
    await asyncio.wait_for(host.ready, 5)
    return host


async def _script(tls: bool, sqflow_off: bool) -> tuple[bytes, list[Any], int]:
    """tests/test_tcp_batch.py's session on an I/O queue over TCP: the plaintext the host received, the results,
    and the commands the target's fast path completed."""
    tgt, server = await _serve("required" if tls else "none")
    sub = tgt.subsystems[SUBNQN]
    sub.namespaces[3] = Namespace(3, RamBackend(1 << 20, read_only=True))
    sub.allow_any_host = True   # the admin queue runs over the loop transport (no TLS there)
    rng = random.Random(11)
    admin, cntlid = await admin_session(tgt, SUBNQN)
    rec = await _open(server.port, tls, rng)
    res = await rec.connect(SUBNQN, qid=1, cntlid=cntlid, sqsize=63, cattr=4 if sqflow_off else 0)
    assert res.status == 0, res
    batches = script_batches()
    seen: list[Any] = []
    for i, sends in enumerate(batches):
        rec.next_cid = 1
        if tls or i % 2 == 0:
            seen += await _batch(rec, sends)
        else:
            results = await asyncio.wait_for(asyncio.gather(*_send_cut(rec, sends, rng)), 10)
            seen += [(r.status, r.data) for r in results]
    (conn,) = _io_conns(server)
    fast = conn.fast_commands
    for h in (admin, rec):
        h.close()
    await asyncio.sleep(0.05)
    await tgt.close()
    return bytes(rec.received), seen, fast


@pytest.mark.parametrize("sqflow_off", [False, True])
async def test_tls_session_gives_the_clear_bytes_on_the_fast_path(sqflow_off: bool) -> None:
    clear = await _script(False, sqflow_off)
    tls = await _script(True, sqflow_off)
    assert tls[1] == clear[1]
    assert tls[0] == clear[0]
    statuses = [s for s, _ in tls[1]]
    assert statuses.count(0) < len(statuses)   # the errors were answered as errors
    # the fast path ran over TLS (on main every TLS PDU took the stream path: 0)
    assert clear[2] >= 150 and tls[2] >= 150


async def _tls_io(tgt: Any, server: BatchTcpListener, seed: int) -> tuple[Any, RecordingHost, BatchConnection]:
    """An admin queue over the loop transport and a TLS I/O queue over TCP."""
    tgt.subsystems[SUBNQN].allow_any_host = True
    admin, cntlid = await admin_session(tgt, SUBNQN)
    io = await _open(server.port, True, random.Random(seed))
    assert (await io.connect(SUBNQN, qid=1, cntlid=cntlid, sqsize=31)).status == 0
    (conn,) = _io_conns(server)
    return admin, io, conn


async def test_tls_batch_past_its_time_budget_is_taken_up_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """test_tcp_batch's time-budget case over TLS: every batch stops after its first backend call and holds the rest;
    the release parses it and decrypts what the session still holds (no socket read announces it), so 32
    in-capsule writes and 32 reads sent at once are all answered, in order, on the fast path."""
    monkeypatch.setattr(tcp_batch, "_TIME_BUDGET_NS", 0)
    tgt, server = await _serve("required")
    try:
        admin, io, conn = await _tls_io(tgt, server, 5)
        blocks = [random.Random(i).randbytes(4096) for i in range(32)]
        done = conn.fast_commands
        io.hold = True
        futs = [io.send(Command(IoOpcode.WRITE, nsid=1, cdw10=8 * i, cdw12=7), blocks[i], incapsule=True)
                for i in range(32)]
        futs += [io.send(Command(IoOpcode.READ, nsid=1, cdw10=8 * i, cdw12=7), read_len=4096) for i in range(32)]
        io.hold = False
        io.flush()
        results = await asyncio.wait_for(asyncio.gather(*futs), 20)
        assert all(r.status == 0 for r in results)
        assert [r.data for r in results[32:]] == blocks
        assert conn.fast_commands - done == 64
        assert not conn._held and not conn._carry
        admin.close()
        io.close()
    finally:
        await server.stop()
        await tgt.close()


async def test_tls_host_that_does_not_read_gets_a_bounded_backlog() -> None:
    """test_tcp_batch's backlog case over TLS: 150 reads of 128 KiB from a host that stopped reading; the target
    encrypts and writes as each batch reaches the high-water mark, holds the rest while the socket is full, and
    answers everything, whole and in order, once the host reads again."""
    from nvmeof import defaults

    tgt, server = await _serve("required")
    try:
        admin, io, conn = await _tls_io(tgt, server, 6)
        data = random.Random(6).randbytes(1 << 20)
        assert (await io.cmd(Command(IoOpcode.WRITE, nsid=1, cdw10=0, cdw12=2047), data)).status == 0
        assert io.transport is not None
        conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 * 1024)
        io.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 * 1024)
        io.transport.pause_reading()
        count = 150
        done = conn.fast_commands
        io.hold = True
        futs = [io.send(Command(IoOpcode.READ, nsid=1, cdw10=256 * (i % 8), cdw12=255), read_len=128 * 1024)
                for i in range(count)]
        io.hold = False
        io.flush()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while conn.transport.get_write_buffer_size() == 0 and loop.time() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)   # more wake-ups, were the connection still reading
        queued = conn.transport.get_write_buffer_size()
        # as in the clear, plus the records' overhead (22 bytes per 16 KiB)
        bound = 2 * defaults.TCP_WRITE_HIGH_WATER + 128 * 1024 + 4096 + 8192
        assert 0 < queued <= bound, f"{queued} bytes queued"
        assert conn.fast_commands - done < count
        io.transport.resume_reading()
        results = await asyncio.wait_for(asyncio.gather(*futs), 30)
        for i, r in enumerate(results):
            assert r.status == 0 and r.data == data[(i % 8) * 128 * 1024:(i % 8 + 1) * 128 * 1024]
        assert conn.fast_commands - done == count
        admin.close()
        io.close()
    finally:
        await server.stop()
        await tgt.close()


async def test_tls_bad_record_and_close_notify_on_the_batch_path(caplog: pytest.LogCaptureFixture) -> None:
    """Past the handshake the batch engine opens the records itself: a record that fails its MAC closes that
    connection with the one WARNING line the stream path gave (the others keep being served), and the host's
    close_notify closes the connection."""
    tgt, server = await _serve("required")
    try:
        admin, io, conn = await _tls_io(tgt, server, 7)
        assert isinstance(io, TlsRecordingHost)
        assert (await io.cmd(Command(IoOpcode.READ, nsid=1, cdw10=0, cdw12=7), read_len=4096)).status == 0
        assert conn._tls_records and conn._tls_plain   # the batch engine decrypts this queue's records
        cntlid = conn.queue.ctrl.cntlid
        other = await _open(server.port, True, random.Random(8))
        with caplog.at_level(logging.WARNING):
            assert io.transport is not None
            io.transport.write(b"\x17\x03\x03\x00\x20" + bytes(32))   # application data that fails its MAC
            await asyncio.wait_for(io.lost, 5)
        assert any(r.getMessage().startswith("NVMe/TCP TLS from ") and "failed" in r.getMessage()
                   for r in caplog.records)
        # the other connection is still served; its close_notify ends it
        assert (await other.connect(SUBNQN, qid=2, cntlid=cntlid, sqsize=31)).status == 0
        assert (await other.cmd(Command(IoOpcode.READ, nsid=1, cdw10=0, cdw12=7), read_len=4096)).status == 0
        assert isinstance(other, TlsRecordingHost)
        other.tls.close_notify()
        other._write(other.tls.data_to_send())
        await asyncio.wait_for(other.lost, 5)
        admin.close()
    finally:
        await server.stop()
        await tgt.close()


# --- both ends over real sockets ------------------------------------------------------------------------------


async def test_tls_slot_commands_take_both_fast_paths() -> None:
    """Batches of 32 slot commands (4 KiB and 128 KiB reads, in-capsule and R2T writes) on a TLS queue: one sendmsg
    per batch, nothing through the host's sans-IO connection, every command on the target's fast path, and (4 KiB
    reads) no more writes on the target than socket reads (wake-ups)."""
    tgt, server = await _serve("required")
    try:
        async with initiator.connect("127.0.0.1", server.port, SUBNQN, hostnqn=HOSTNQN, nr_io_queues=1,
                                     tls_key=KEY, kato=0) as ctrl:
            assert ctrl.engine == "batch"
            (q,) = ctrl.io_queues
            assert isinstance(q, BatchQueue) and q._tls is not None and q._tls.handshake_done
            (conn,) = _io_conns(server)
            reads = writes = 0
            real_update, real_write = conn._tls_update, conn.transport.write   # type: ignore[union-attr]

            def updated(n: int) -> None:
                nonlocal reads
                reads += 1
                real_update(n)

            def write(data: Any) -> None:
                nonlocal writes
                writes += 1
                real_write(data)

            conn._tls_update = updated   # type: ignore[method-assign]   # one per socket read of records
            conn.transport.write = write    # type: ignore[union-attr,method-assign]
            to_sansio: list[int] = []
            real_receive = q._conn.receive_data

            def receive(data: Any) -> Any:
                to_sansio.append(len(data))
                return real_receive(data)

            q._conn.receive_data = receive   # type: ignore[method-assign]
            # A RAM disk's cut write is received into the disk straight from the socket (FIONREAD, recv_into) on
            # clear queues only: under TLS the socket holds ciphertext, so the plaintext takes the buffered road.
            placed: list[bool] = []
            real_direct = conn._h2c_direct_start

            def direct(fw: Any) -> None:
                real_direct(fw)
                placed.append(fw.span is not None)

            conn._h2c_direct_start = direct   # type: ignore[method-assign]
            rng = random.Random(4)
            mixed = [4096 if i % 2 else 128 * 1024 for i in range(32)]
            datas = [rng.randbytes(n) for n in mixed]
            lbas = [i * 256 for i in range(32)]
            for round_ in ("write", "read", "read 4k"):
                sizes = [4096] * 32 if round_ == "read 4k" else mixed
                bufs = [memoryview(bytearray(n)) for n in sizes]
                done: list[Any] = []
                record = done.append
                fast_before, sends = conn.fast_commands, q._sends
                reads = writes = 0
                for i in range(32):
                    buf = memoryview(datas[i]) if round_ == "write" else bufs[i]
                    q.start(IoOpcode.WRITE if round_ == "write" else IoOpcode.READ, 2, lbas[i], sizes[i] // 512,
                            buf, round_ == "write", lambda tok, err, record=record: record((tok, err)), i)
                q.kick()
                assert q._sends == sends + 1   # the batch: one encryption, one sendmsg
                for _ in range(500):
                    if len(done) == 32:
                        break
                    await asyncio.sleep(0.01)
                assert sorted(done) == [(i, None) for i in range(32)]
                assert conn.fast_commands - fast_before == 32
                if round_ != "write":
                    assert [bytes(b) for b in bufs] == [d[:len(b)] for d, b in zip(datas, bufs, strict=True)]
            assert not to_sansio   # every CapsuleResp, C2HData and R2T was the host's fast parser's
            assert placed and not any(placed), "a TLS write was placed in the disk from the socket's ciphertext"
            # 32 reads of 4 KiB (replies below the high-water mark, past which a batch writes what it has so far):
            # the replies of one socket read leave in one write
            assert 0 < writes <= reads
    finally:
        await tgt.close()


# --- nvmeof bench --verify crc32c over TLS ----------------------------------------------------------------------


async def test_bench_verify_over_tls(driver_runs: list[Any]) -> None:
    tgt, server = await _serve("required")
    try:
        cspec = ConnectSpec(traddr="127.0.0.1", trsvcid=server.port, subnqn=SUBNQN, hostnqn=HOSTNQN,
                            tls_key=TlsKey.parse(KEY))
        # the plain phase on the bench's batch path (slots on BatchQueue), over TLS
        (r,) = (await run_bench(cspec, JobSpec(rw="randread", bs=4096, iodepth=32, size=1 << 20, nsid=2))).results
        assert r.read.ios == 256 and driver_runs and driver_runs[0] is not None
        # ... and with hybrid polling (the session's plaintext is parsed inside the polling window too)
        polled = dataclasses.replace(cspec, poll_us=50)
        (r,) = (await run_bench(polled, JobSpec(rw="randread", bs=4096, iodepth=32, size=1 << 20, nsid=2))).results
        assert r.read.ios == 256 and driver_runs[-1] is not None
        for bs, depth in ((4096, 32), (128 * 1024, 8)):
            spec = JobSpec(rw="randwrite" if bs == 4096 else "write", bs=bs, iodepth=depth, size=2 << 20,
                           verify="crc32c", nsid=2)
            (r,) = (await run_bench(cspec, spec)).results
            assert r.verify is not None and r.verify.errors == 0 and r.verify.blocks == (2 << 20) // bs
            check = JobSpec(rw="randread" if bs == 4096 else "read", bs=bs, iodepth=depth, size=2 << 20,
                            verify="crc32c", nsid=2)
            (r,) = (await run_bench(cspec, check)).results
            assert r.verify is not None and r.verify.errors == 0 and r.verify.blocks == (2 << 20) // bs
        # a block changed behind the bench's back is caught over TLS too
        backend = tgt.subsystems[SUBNQN].namespaces[2].backend
        await backend.write(5 * 131072 + 77, os.urandom(4))
        report = await run_bench(cspec, JobSpec(rw="read", bs=131072, iodepth=8, size=2 << 20, verify="crc32c",
                                                nsid=2))
        (r,) = report.results
        assert report.failed and r.verify.errors == 1 and r.verify.first.block == 5
    finally:
        await tgt.close()
