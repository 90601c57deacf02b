"""The host's batch engine (initiator/engine.py) against the scripted controller of test_initiator_queue.

Every HostQueue scenario there runs again on a BatchQueue's submit() path; the slot path (start) gets
the same scenarios with callbacks: data both ways, digests, SUCCESS-flag completions, NVMe status, a
bad C2HData offset (same FES/FEI and H2CTermReq), TermReq, drop, timeout, and hybrid polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import socket
import struct

import pytest

import tests.test_initiator_queue as tq
from initiator.engine import _CMD_PDU, BatchQueue, _pack_h2c, open_batch_queue
from nvmeof.spec import tcp as tcp_spec
from nvmeof.spec.nvme import SGL_ID_INCAPSULE, SGL_ID_TRANSPORT, Command
from nvmeof.spec.tcp import FatalErrorStatus
from nvmeof.status import NvmeError, Status
from nvmeof.tcp import Direction, ProtocolError, R2TReceived, Role, TcpConnection
from tests.test_initiator_queue import FakeServer, server  # noqa: F401 -- the fixture, for the tests below

# An ICResp as a controller sends it: PFV 0, CPDA 0, no digests, MAXH2CDATA 8192.
ICRESP = struct.pack("<BBBBIHBBI112x", 1, 0, 128, 0, 128, 0, 0, 0, 8192)

READ, WRITE = 0x02, 0x01


async def open_batch(srv: FakeServer, *, queue_size: int = 16, digests: bool = False, incapsule: int = 4096,
                     timeout: float | None = 5.0, poll_us: int = 0) -> BatchQueue:
    q = BatchQueue(1, queue_size=queue_size, name="fake qid 1", hdr_digest=digests, data_digest=digests,
                   incapsule_size=incapsule, timeout=timeout, poll_us=poll_us)
    return await open_batch_queue(q, "127.0.0.1", srv.port, 5.0)


@pytest.fixture(autouse=True)
def _batch_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tq, "open_host", open_batch)


# The stream queue's scenarios, run again on the batch engine (its submit() path over its own socket).
for _name, _fn in list(vars(tq).items()):
    if _name.startswith("test_") and callable(_fn) and "open_host(" in inspect.getsource(_fn):
        globals()[f"{_name}_on_batch_engine"] = _fn
del _name, _fn


def test_capsule_layout_matches_command_to_bytes() -> None:
    """The precompiled CapsuleCmd layout builds the bytes TcpConnection.send_command sends for the same SQE."""
    for opcode, slba, nlb, n, sgl_id, write in ((READ, 0x1_2345_6789, 8, 4096, SGL_ID_TRANSPORT, False),
                                                (WRITE, 77, 1, 512, SGL_ID_INCAPSULE, True)):
        cmd = Command(opcode, cid=9, nsid=3, cdw10=slba & 0xFFFFFFFF, cdw11=slba >> 32, cdw12=nlb - 1)
        cmd.dptr = Command.make_sgl(sgl_id, 0, n)
        conn = TcpConnection(Role.HOST)
        conn.send_icreq()
        conn.receive_data(ICRESP)
        conn.data_to_send()   # the ICReq
        conn.send_command(cmd.to_bytes(), b"\0" * n if write else None,
                          direction=Direction.NONE if write else Direction.C2H, data_len=0 if write else n)
        expected = bytes(conn.data_to_send()[0])
        pdu = bytearray(_CMD_PDU.size)
        pdo = _CMD_PDU.size if write else 0
        _CMD_PDU.pack_into(pdu, 0, 4, 0, 72, pdo, 72 + (n if write else 0), opcode, 0x40, 9, 3, 0, 0, 0, 0, n, sgl_id,
                           slba & 0xFFFFFFFF, slba >> 32, nlb - 1, 0, 0, 0)
        assert bytes(pdu) == expected


async def run_slot(q: BatchQueue, opcode: int, slba: int, buf: bytearray | bytes, *,
                   write: bool) -> BaseException | None:
    fut: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

    def done(token: object, err: BaseException | None) -> None:
        assert token == "tok"
        fut.set_result(err)

    q.start(opcode, 1, slba, len(buf) // 512, memoryview(buf), write, done, "tok")
    q.kick()
    return await asyncio.wait_for(fut, 5)


@pytest.mark.parametrize("digests", [False, True])
async def test_slot_writes_and_reads(server: FakeServer, digests: bool) -> None:  # noqa: F811
    q = await open_batch(server, digests=digests)
    small = os.urandom(2048)                 # in-capsule
    large = os.urandom(20480)                # R2T, H2CData of <= 8192
    assert await run_slot(q, WRITE, 0, small, write=True) is None
    assert await run_slot(q, WRITE, 8, large, write=True) is None
    assert server.commands[0].sgl().sgl_id == SGL_ID_INCAPSULE
    assert server.commands[1].sgl().sgl_id == SGL_ID_TRANSPORT
    assert server.h2c_pdus == [(0, 8192, False), (8192, 8192, False), (16384, 4096, True)]
    buf = bytearray(len(large))
    assert await run_slot(q, READ, 8, buf, write=False) is None
    assert bytes(buf) == large
    buf2 = bytearray(2048)
    assert await run_slot(q, READ, 0, buf2, write=False) is None
    assert bytes(buf2) == small
    # the slot commands carried what a submit() of the same command carries
    slot_cmd = server.commands[-1]
    await q.submit(Command(READ, nsid=1, cdw10=0, cdw12=3), data_in=bytearray(2048))
    sub = server.commands[-1]
    slot_cmd.cid = sub.cid
    assert slot_cmd.to_bytes() == sub.to_bytes()
    assert q.inflight == 0 and q.free_slots == 15
    q.close()


async def test_reused_cid_capsule_equals_command_to_bytes(server: FakeServer) -> None:  # noqa: F811
    """One cid (queue_size 2) through commands of changing shape: every capsule carries the SQE
    Command.to_bytes builds for it, whether the cid's PDU was packed whole or only its SLBA rewritten."""
    q = await open_batch(server, queue_size=2)
    big = 0x1_0000_0010   # an SLBA above 32 bits: CDW11 (the fake controller reads at CDW10 * 512)
    steps = [(READ, 1, 8, 4096, False), (READ, 1, 24, 4096, False), (READ, 2, 24, 4096, False),
             (READ, 2, big, 4096, False), (READ, 2, 40, 2048, False), (WRITE, 2, 40, 2048, True),
             (WRITE, 2, 48, 2048, True), (WRITE, 2, 56, 8192, True), (WRITE, 2, 8, 8192, True),
             (READ, 2, 8, 8192, False), (READ, 1, 0, 512, False), (READ, 1, 3, 512, False)]
    for opcode, nsid, slba, n, write in steps:
        buf = memoryview(bytearray(os.urandom(n) if write else n))
        fut: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
        q.start(opcode, nsid, slba, n // 512, buf, write, lambda _t, err, f=fut: f.set_result(err), None)
        q.kick()
        assert await asyncio.wait_for(fut, 5) is None
    assert len(server.commands) == len(steps)
    for got, (opcode, nsid, slba, n, write) in zip(server.commands, steps, strict=True):
        want = Command(opcode, cid=got.cid, nsid=nsid, cdw10=slba & 0xFFFFFFFF, cdw11=slba >> 32, cdw12=n // 512 - 1)
        want.dptr = Command.make_sgl(SGL_ID_INCAPSULE if write and n <= 4096 else SGL_ID_TRANSPORT, 0, n)
        assert got.to_bytes() == want.to_bytes(), (opcode, nsid, slba, n)
    assert {c.cid for c in server.commands} == {0}
    q.close()


async def test_slot_large_read_is_placed_directly(server: FakeServer) -> None:  # noqa: F811
    server.c2h_pdu = 256 * 1024
    data = os.urandom(256 * 1024)
    server.ram[:len(data)] = data
    q = await open_batch(server, queue_size=4)
    bufs = [bytearray(len(data)) for _ in range(3)]
    errs = await asyncio.gather(*(run_slot(q, READ, 0, b, write=False) for b in bufs))
    assert errs == [None, None, None] and all(bytes(b) == data for b in bufs)


async def test_slot_many_in_flight_and_free_slots(server: FakeServer) -> None:  # noqa: F811
    q = await open_batch(server, queue_size=4)
    for i in range(3):
        server.ram[i * 512:(i + 1) * 512] = bytes([i + 1]) * 512
    bufs = [bytearray(512) for _ in range(3)]
    waits = [run_slot(q, READ, i, bufs[i], write=False) for i in range(3)]
    tasks = [asyncio.ensure_future(w) for w in waits]
    await asyncio.sleep(0)
    assert q.free_slots == 0
    with pytest.raises(IndexError):
        q.start(READ, 1, 0, 1, memoryview(bytearray(512)), False, lambda t, e: None, None)
    assert await asyncio.gather(*tasks) == [None] * 3
    assert [bytes(b) for b in bufs] == [bytes([i + 1]) * 512 for i in range(3)]


async def test_slot_success_flag_and_status_error(server: FakeServer) -> None:  # noqa: F811
    q = await open_batch(server)
    server.ram[:1024] = b"\xab" * 1024
    server.action = "success"
    buf = bytearray(1024)
    assert await run_slot(q, READ, 0, buf, write=False) is None
    assert bytes(buf) == b"\xab" * 1024
    server.action = ""
    err = await run_slot(q, 0x7D, 0, bytearray(512), write=False)
    assert isinstance(err, NvmeError) and err.status == Status.LBA_RANGE and err.result == 0x1234
    assert await run_slot(q, READ, 0, bytearray(512), write=False) is None  # the queue still works


async def test_slot_data_digest_error_fails_that_command(server: FakeServer) -> None:  # noqa: F811
    q = await open_batch(server, digests=True)
    server.action = "bad_digest"
    err = await run_slot(q, READ, 0, bytearray(4096), write=False)
    assert isinstance(err, NvmeError) and err.status == Status.DATA_XFER_ERROR and "digest" in str(err)
    server.action = ""
    assert await run_slot(q, READ, 0, bytearray(4096), write=False) is None


async def test_slot_bad_c2h_offset_breaks_queue_with_datao_fei(server: FakeServer) -> None:  # noqa: F811
    q = await open_batch(server)
    server.action = "bad_offset"
    err = await run_slot(q, READ, 0, bytearray(4096), write=False)
    assert isinstance(err, tq.TransportError) and "offset 512" in str(err)
    term = await tq._term_req_seen(server)
    assert (term.fes, term.fei) == (FatalErrorStatus.DATA_OUT_OF_RANGE, tcp_spec.OFF_DATAO)
    with pytest.raises(tq.TransportError):
        q.start(READ, 1, 0, 1, memoryview(bytearray(512)), False, lambda t, e: None, None)


async def test_slot_termreq_and_drop_fail_every_slot(server: FakeServer) -> None:  # noqa: F811
    q = await open_batch(server)
    hung = [asyncio.ensure_future(run_slot(q, tq.HANG, 0, bytearray(512), write=False)) for _ in range(3)]
    await asyncio.sleep(0.05)
    server.action = "termreq"
    err = await run_slot(q, READ, 0, bytearray(512), write=False)
    assert isinstance(err, tq.TransportError) and "C2HTermReq" in str(err)
    for e in await asyncio.gather(*hung):
        assert isinstance(e, tq.TransportError)
    q2 = await open_batch(server)
    server.action = ""
    hung = [asyncio.ensure_future(run_slot(q2, tq.HANG, 0, bytearray(512), write=False)) for _ in range(2)]
    await asyncio.sleep(0.05)
    for c in server.connections:
        c.transport.abort()
    for e in await asyncio.gather(*hung):
        assert isinstance(e, tq.TransportError)
    await asyncio.wait_for(q2.wait_closed(), 2)


async def test_slot_timeout_breaks_queue(server: FakeServer) -> None:  # noqa: F811
    q = await open_batch(server, timeout=0.2)
    err = await run_slot(q, tq.HANG, 0, bytearray(512), write=False)
    assert isinstance(err, tq.CommandTimeout) and "got no completion in 0.2 s" in str(err)
    assert q.broken is not None


async def test_slot_timeout_waits_the_whole_timeout(server: FakeServer) -> None:  # noqa: F811
    """A slot started just before a tick, and submit() deadlines firing the shared timer in between, still
    wait at least the timeout (ticks are timeout/2 apart; failing at the second tick would give ~T/2, and
    counting every firing of the timer as a tick even less)."""
    loop = asyncio.get_running_loop()
    q = await open_batch(server, timeout=0.6)
    t0 = loop.time()
    first = asyncio.ensure_future(run_slot(q, tq.HANG, 0, bytearray(512), write=False))
    await asyncio.sleep(0)
    for t in (0.05, 0.1, 0.15, 0.2):   # answered at once: their deadlines still fire the timer
        await q.submit(Command(READ, nsid=1, cdw10=0), data_in=bytearray(512), timeout=t)
    await asyncio.sleep(0.29 - (loop.time() - t0))   # just before the first tick (0.3 s)
    started = loop.time()
    second = asyncio.ensure_future(run_slot(q, tq.HANG, 0, bytearray(512), write=False))
    err = await asyncio.wait_for(second, 5)
    assert isinstance(err, tq.CommandTimeout)
    assert loop.time() - started >= 0.6, f"timed out after {loop.time() - started:.3f} s of a 0.6 s timeout"
    assert isinstance(await first, tq.CommandTimeout)


def test_start_refuses_bad_lengths_without_taking_a_cid() -> None:
    q = BatchQueue(1, queue_size=4, name="qid 1")
    q._fast = True  # as after the IC exchange; the checks come before anything is queued
    free = len(q._free_cids)
    for nlb, slba in ((0, 0), (0x10001, 0), (1, 1 << 64), (1, -1)):
        with pytest.raises(ValueError, match="nlb"):
            q.start(READ, 1, slba, nlb, memoryview(bytearray(512)), False, lambda t, e: None, None)
    assert len(q._free_cids) == free


@pytest.mark.parametrize("poll_us", [1, 200_000])
async def test_polling_serves_submit_and_slots(server: FakeServer, poll_us: int) -> None:  # noqa: F811
    q = await open_batch(server, poll_us=poll_us)
    data = os.urandom(4096)
    await q.submit(Command(WRITE, nsid=1, cdw10=0), data_out=data)
    buf = bytearray(4096)
    await q.submit(Command(READ, nsid=1, cdw10=0), data_in=buf)
    assert bytes(buf) == data
    buf = bytearray(4096)
    assert await run_slot(q, READ, 0, buf, write=False) is None
    assert bytes(buf) == data
    # a command that is never answered: the poll window ends and the loop goes on
    hung = asyncio.ensure_future(q.submit(Command(tq.HANG), timeout=None))
    await asyncio.sleep(0.3)
    assert not hung.done()
    hung.cancel()


async def test_a_peer_gone_while_polling_breaks_the_queue_at_once() -> None:
    """The polling window asks poll(0) before receiving: a closed peer (POLLIN|POLLHUP) is received as the
    end of the connection inside the window, not polled past for the whole window."""
    mine, peer = socket.socketpair()
    q = BatchQueue(1, queue_size=4, name="poll qid 1", poll_us=10_000_000)
    q.attach(mine)
    q._fast = True
    got: list[BaseException | None] = []
    q.start(READ, 1, 0, 1, memoryview(bytearray(512)), False, lambda t, e: got.append(e), None)
    q._flush()
    peer.close()
    q._poll()   # unnoticed, the end would leave the window after 10 s with the read still in flight
    assert len(got) == 1 and isinstance(got[0], tq.TransportError) and q.broken is not None


def test_poll_us_is_checked() -> None:
    with pytest.raises(ValueError, match="poll_us"):
        BatchQueue(1, queue_size=4, poll_us=-1)


async def test_failing_callback_breaks_the_queue_instead_of_hanging(server: FakeServer) -> None:  # noqa: F811
    q = await open_batch(server)
    other: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

    def boom(token: object, err: BaseException | None) -> None:
        raise RuntimeError("callback bug")

    q.start(tq.HANG, 1, 0, 1, memoryview(bytearray(512)), False, lambda t, e: other.set_result(e), None)
    q.start(READ, 1, 0, 1, memoryview(bytearray(512)), False, boom, None)
    q.kick()
    err = await asyncio.wait_for(other, 5)
    assert isinstance(err, tq.TransportError) and "callback bug" in str(err)
    assert q.broken is not None
    await asyncio.wait_for(q.wait_closed(), 2)


async def test_large_transfers_survive_short_sends_and_many_buffers(server: FakeServer) -> None:  # noqa: F811
    """4 MiB by R2T in 8 KiB H2CData PDUs: more buffers than one sendmsg takes and more bytes than the
    socket buffer holds, so sends are chunked and cut short, and the rest must follow in order."""
    q = await open_batch(server)
    data = os.urandom(4 << 20)
    await asyncio.wait_for(q.submit(Command(WRITE, nsid=1, cdw10=0), data_out=data), 30)
    assert len(server.h2c_pdus) == (4 << 20) // 8192 and bytes(server.ram[:4 << 20]) == data
    buf = bytearray(4 << 20)
    assert await run_slot(q, READ, 0, buf, write=False) is None
    assert bytes(buf) == data
    assert not q._wpend and not q._write_paused


async def test_submit_large_read_is_placed_by_the_connection(server: FakeServer) -> None:  # noqa: F811
    """A submit() read's big C2HData goes to TcpConnection, which places it straight into the caller's
    buffer; the engine then receives into that buffer (direct_buffer) and hands the rest back."""
    server.c2h_pdu = 512 * 1024
    data = os.urandom(1 << 20)
    server.ram[:len(data)] = data
    q = await open_batch(server)
    bufs = [bytearray(len(data)) for _ in range(3)]
    await asyncio.gather(*(q.submit(Command(READ, nsid=1, cdw10=0), data_in=b) for b in bufs))
    assert all(bytes(b) == data for b in bufs)
    small = bytearray(512)
    await q.submit(Command(READ, nsid=1, cdw10=0), data_in=small)
    assert bytes(small) == data[:512]


class RawController:
    """A controller that answers the ICReq, then answers the first CapsuleCmd with ``reply(cid)`` bytes and
    keeps what the host sends after it (the H2CTermReq)."""

    def __init__(self, reply: object) -> None:
        self.reply = reply
        self.after = b""

    async def start(self) -> int:
        self.srv = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        return self.srv.sockets[0].getsockname()[1]

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(128)
        writer.write(ICRESP)
        capsule = await reader.readexactly(72)
        writer.write(self.reply(capsule[10] | capsule[11] << 8))  # type: ignore[operator]
        try:
            self.after = await asyncio.wait_for(reader.read(1024), 5)
        except TimeoutError:
            pass
        writer.close()


def c2h(cid: int, *, flags: int = 0x04, datao: int = 0, datal: int = 512, plen: int | None = None) -> bytes:
    return (tcp_spec.DATA_PDU_HDR.pack(7, flags, 24, 24, plen if plen is not None else 24 + datal, cid, 0, datao,
                                       datal) + bytes(datal))


@pytest.mark.parametrize(("reply", "fes", "fei", "reason"), [
    # framing the fast path does not take: TcpConnection reports it
    (lambda cid: c2h(cid, flags=0x05), FatalErrorStatus.INVALID_HEADER_FIELD, tcp_spec.OFF_FLAGS, "HDGSTF"),
    (lambda cid: tcp_spec.CAPSULE_RESP_HDR.pack(5, 0, 24, 0, 24, bytes(12) + struct.pack("<HH", cid + 1, 0)),
     FatalErrorStatus.INVALID_HEADER_FIELD, tcp_spec.OFF_RSP_CID, "no command in flight"),
    # a slot's C2HData checked by the fast path itself
    (lambda cid: c2h(cid, plen=24 + 600), FatalErrorStatus.INVALID_HEADER_FIELD, tcp_spec.OFF_DATAL,
     "disagrees with plen"),
    (lambda cid: c2h(cid, datal=1024), FatalErrorStatus.DATA_OUT_OF_RANGE, tcp_spec.OFF_DATAL, "512-byte buffer"),
    (lambda cid: c2h(cid, flags=0x08), FatalErrorStatus.INVALID_HEADER_FIELD, tcp_spec.OFF_FLAGS,
     "SUCCESS but not LAST"),
])
async def test_bad_pdus_for_a_slot_fail_like_the_stream_path(reply: object, fes: int, fei: int, reason: str) -> None:
    ctl = RawController(reply)
    port = await ctl.start()
    q = BatchQueue(1, queue_size=8, name="raw qid 1", timeout=5.0)
    await open_batch_queue(q, "127.0.0.1", port, 5.0)
    fut: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
    q.start(READ, 1, 0, 1, memoryview(bytearray(512)), False, lambda t, e: fut.set_result(e), None)
    q.kick()
    err = await asyncio.wait_for(fut, 5)
    assert isinstance(err, tq.TransportError) and reason in str(err)
    for _ in range(200):
        if ctl.after:
            break
        await asyncio.sleep(0.01)
    ptype, _f, _h, _p, _l, got_fes, got_fei = tcp_spec.TERM_REQ_HDR.unpack_from(ctl.after)
    assert (ptype, got_fes, got_fei) == (tcp_spec.PduType.H2C_TERM_REQ, fes, fei)
    ctl.srv.close()


def test_h2c_header_layout_matches_send_h2c_data() -> None:
    """The precompiled H2CData header is the one TcpConnection.send_h2c_data sends (no digests)."""
    conn = TcpConnection(Role.HOST)
    conn.send_icreq()
    conn.receive_data(ICRESP)
    conn.data_to_send()
    data = memoryview(bytes(4096))
    for last in (False, True):
        conn.send_h2c_data(5, 0x1234, 8192, data, last)
        hdr, payload = conn.data_to_send()
        assert _pack_h2c(0x06, 0x04 if last else 0, 24, 24, 24 + 4096, 5, 0x1234, 8192, 4096) == bytes(hdr)
        assert payload is data


async def test_slot_r2t_write_takes_the_fast_path(server: FakeServer) -> None:  # noqa: F811
    """A slot write above the in-capsule size: its R2Ts are parsed and answered by the engine (TcpConnection
    never sees the command), 4 MiB in 8 KiB H2CData PDUs through chunked and short sends."""
    q = await open_batch(server)
    sent: list[object] = []
    q._conn.send_h2c_data = lambda *a: sent.append(a)  # type: ignore[method-assign]
    data = os.urandom(4 << 20)
    assert await run_slot(q, WRITE, 0, data, write=True) is None
    assert not sent and not q._conn._cmds
    assert len(server.h2c_pdus) == (4 << 20) // 8192 and bytes(server.ram[:4 << 20]) == data
    assert server.h2c_pdus[-1] == ((4 << 20) - 8192, 8192, True)
    assert q._wsrc == [None] * len(q._wsrc) and q.inflight == 0
    buf = bytearray(4 << 20)
    assert await run_slot(q, READ, 0, buf, write=False) is None
    assert bytes(buf) == data
    q.close()


def r2t(cid: int, *, r2to: int = 0, r2tl: int = 1024, ttag: int = 3, flags: int = 0, pdo: int = 0) -> bytes:
    return tcp_spec.DATA_PDU_HDR.pack(tcp_spec.PduType.R2T.value, flags, 24, pdo, 24, cid, ttag, r2to, r2tl)


class ByteController(RawController):
    """A RawController that keeps every byte the host sends after the capsule until the host closes, and the
    capsule itself."""

    def __init__(self, reply: object) -> None:
        super().__init__(reply)
        self.capsule = b""
        self.done = asyncio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(128)
        writer.write(ICRESP)
        self.capsule = await reader.readexactly(72)
        writer.write(self.reply(self.capsule[10] | self.capsule[11] << 8))  # type: ignore[operator]
        with contextlib.suppress(TimeoutError, ConnectionError):
            self.after = await asyncio.wait_for(reader.read(), 5)
        self.done.set()
        writer.close()


def sansio_host_sends(capsule: bytes, reply: bytes, write_len: int) -> bytes:
    """What the stream path (HostQueue over TcpConnection) sends after ``capsule`` when ``reply`` comes: H2CData
    for every good R2T (HostQueue._on_r2t), then the H2CTermReq of the first bad PDU."""
    conn = TcpConnection(Role.HOST)
    conn.send_icreq()
    conn.receive_data(ICRESP)
    conn.data_to_send()
    write = capsule[8] == WRITE
    conn.send_command(capsule[8:72], direction=Direction.H2C if write else Direction.C2H, data_len=write_len)
    conn.data_to_send()
    src = bytes(write_len)
    for ev in conn.receive_data(reply):
        if isinstance(ev, R2TReceived):
            offset, end = ev.offset, ev.offset + ev.length
            while offset < end:
                n = min(conn.maxh2cdata, end - offset)
                conn.send_h2c_data(ev.cccid, ev.ttag, offset, src[offset:offset + n], offset + n == end)
                offset += n
        else:
            assert isinstance(ev, ProtocolError), ev
    return b"".join(bytes(b) for b in conn.data_to_send())


@pytest.mark.parametrize(("write", "reply", "fes", "fei"), [
    (True, lambda cid: r2t(cid, r2tl=0), FatalErrorStatus.INVALID_HEADER_FIELD, tcp_spec.OFF_R2TL),
    (True, lambda cid: r2t(cid, r2to=7680, r2tl=1024), FatalErrorStatus.DATA_OUT_OF_RANGE, tcp_spec.OFF_R2TL),
    (True, lambda cid: r2t(cid, r2tl=8704), FatalErrorStatus.DATA_OUT_OF_RANGE, tcp_spec.OFF_R2TL),
    # a good R2T for the first half (its H2CData leaves), then one asking for part of it again
    (True, lambda cid: r2t(cid, r2tl=4096) + r2t(cid, r2to=2048, r2tl=4096), FatalErrorStatus.DATA_OUT_OF_RANGE,
     tcp_spec.OFF_R2TO),
    (False, lambda cid: r2t(cid), FatalErrorStatus.INVALID_HEADER_FIELD, tcp_spec.OFF_CCCID),
    (True, lambda cid: r2t(cid + 1), FatalErrorStatus.INVALID_HEADER_FIELD, tcp_spec.OFF_CCCID),
    # framing the fast path does not take: TcpConnection reports it
    (True, lambda cid: r2t(cid, flags=0x01), FatalErrorStatus.INVALID_HEADER_FIELD, tcp_spec.OFF_FLAGS),
    (True, lambda cid: r2t(cid, pdo=8), FatalErrorStatus.INVALID_HEADER_FIELD, tcp_spec.OFF_PDO),
])
async def test_bad_r2t_for_a_slot_fails_byte_for_byte_like_the_stream_path(write: bool, reply: object, fes: int,
                                                                           fei: int) -> None:
    ctl = ByteController(reply)
    port = await ctl.start()
    q = BatchQueue(1, queue_size=8, name="raw qid 1", timeout=5.0, incapsule_size=4096)
    await open_batch_queue(q, "127.0.0.1", port, 5.0)
    n = 8192
    fut: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
    q.start(WRITE if write else READ, 1, 0, n // 512, memoryview(bytearray(n)), write,
            lambda t, e: fut.set_result(e), None)
    q.kick()
    err = await asyncio.wait_for(fut, 5)
    assert isinstance(err, tq.TransportError) and "protocol error from controller" in str(err)
    await asyncio.wait_for(ctl.done.wait(), 5)
    expected = sansio_host_sends(ctl.capsule, reply(ctl.capsule[10] | ctl.capsule[11] << 8), n)  # type: ignore
    assert ctl.after == expected
    term = ctl.after[-48:]
    ptype, _f, _h, _p, _l, got_fes, got_fei = tcp_spec.TERM_REQ_HDR.unpack_from(term)
    assert (ptype, got_fes, got_fei) == (tcp_spec.PduType.H2C_TERM_REQ, fes, fei)
    ctl.srv.close()
