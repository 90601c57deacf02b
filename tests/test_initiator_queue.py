"""HostQueue against a small scripted controller built from TcpConnection(Role.CONTROLLER) over TCP.

The fake controller serves a RAM buffer with Read (0x02) and Write (0x01), never answers opcode 0x7E,
and can be told to misbehave (bad C2H offset, corrupted data digest, SUCCESS-flag completions, a
TermReq, dropping the connection), so each host-side rule is checked against real PDUs.
"""

from __future__ import annotations

import asyncio
import struct

import pytest

from initiator.queue import CommandTimeout, HostQueue, TransportError, open_queue
from nvmeof.spec import tcp as tcp_spec
from nvmeof.spec.nvme import SGL_ID_INCAPSULE, SGL_ID_TRANSPORT, Command, pack_cqe
from nvmeof.spec.tcp import FatalErrorStatus
from nvmeof.status import NvmeError, Status, encode_status
from nvmeof.tcp import CommandReceived, H2CDataReceived, ICReqReceived, Role, TcpConnection, TermReqReceived

HANG = 0x7E
FAIL = 0x7D


class FakeController(asyncio.Protocol):
    def __init__(self, server: FakeServer) -> None:
        self.server = server
        self.conn = TcpConnection(Role.CONTROLLER, maxh2cdata=server.maxh2cdata)
        self.writes: dict[int, tuple[Command, bytearray, int]] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.server.connections.append(self)

    def flush(self) -> None:
        out = self.conn.data_to_send()
        if out and not self.transport.is_closing():
            self.transport.writelines(out)

    def data_received(self, data: bytes) -> None:
        for ev in self.conn.receive_data(data):
            if isinstance(ev, ICReqReceived):
                self.conn.send_icresp(self.server.maxh2cdata)
            elif isinstance(ev, CommandReceived):
                self.on_command(Command.from_bytes(ev.sqe), ev.data, ev.digest_ok)
            elif isinstance(ev, H2CDataReceived):
                cmd, buf, got = self.writes[ev.cccid]
                self.server.h2c_pdus.append((ev.offset, len(ev.data), ev.last))
                buf[ev.offset:ev.offset + len(ev.data)] = ev.data
                got += len(ev.data)
                self.writes[ev.cccid] = (cmd, buf, got)
                if got == len(buf):
                    del self.writes[ev.cccid]
                    self.store(cmd, buf)
            else:
                self.server.other_events.append(ev)
        self.flush()

    def respond(self, cid: int, status: int = 0, dw0: int = 0) -> None:
        self.conn.send_response(pack_cqe(cid, encode_status(status), dw0=dw0))

    def store(self, cmd: Command, data: bytes | bytearray | memoryview) -> None:
        off = cmd.cdw10 * 512
        self.server.ram[off:off + len(data)] = data
        self.respond(cmd.cid)

    def on_command(self, cmd: Command, data: memoryview | None, ok: bool) -> None:
        srv = self.server
        srv.commands.append(cmd)
        sgl = cmd.sgl()
        if cmd.opcode == HANG:
            return
        if cmd.opcode == FAIL:
            self.respond(cmd.cid, Status.LBA_RANGE | 0, dw0=0x1234)
            return
        if srv.action == "termreq":
            self.conn.send_term_req(FatalErrorStatus.INVALID_HEADER_FIELD, 8)
            self.flush()
            self.transport.close()
            return
        if srv.action == "drop":
            self.transport.abort()
            return
        if cmd.opcode == 0x01:
            if sgl.sgl_id == SGL_ID_INCAPSULE:
                assert data is not None and len(data) == sgl.length
                self.store(cmd, data)
            else:
                assert sgl.sgl_id == SGL_ID_TRANSPORT
                self.writes[cmd.cid] = (cmd, bytearray(sgl.length), 0)
                self.conn.send_r2t(cmd.cid, 7, 0, sgl.length + (512 if srv.action == "bad_r2t" else 0))
        elif cmd.opcode == 0x02:
            off = cmd.cdw10 * 512
            payload = bytes(srv.ram[off:off + sgl.length])
            if srv.action == "bad_offset":
                self.conn.send_c2h_data(cmd.cid, 512, payload[:512], last=True, success=False)
                return
            success = srv.action == "success"
            step = srv.c2h_pdu
            for start in range(0, len(payload), step):
                chunk = payload[start:start + step]
                final = start + step >= len(payload)
                self.conn.send_c2h_data(cmd.cid, start, chunk, last=final, success=success and final)
            if srv.action == "bad_digest":
                # Flip one payload byte after the digest was computed over the original.
                out = self.conn.data_to_send()
                for i, part in enumerate(out):
                    if len(part) == len(payload[:step]) and bytes(part) == payload[:step]:
                        b = bytearray(part)
                        b[0] ^= 0xFF
                        out[i] = bytes(b)
                        break
                self.transport.writelines(out)
            if not success:
                self.respond(cmd.cid)
        else:
            self.respond(cmd.cid, Status.INVALID_OPCODE)


class FakeServer:
    def __init__(self, maxh2cdata: int = 8192) -> None:
        self.maxh2cdata = maxh2cdata
        self.ram = bytearray(1 << 20)
        self.commands: list[Command] = []
        self.h2c_pdus: list[tuple[int, int, bool]] = []
        self.other_events: list[object] = []
        self.connections: list[FakeController] = []
        self.action = ""
        self.c2h_pdu = 4096

    async def start(self) -> int:
        loop = asyncio.get_running_loop()
        self.srv = await loop.create_server(lambda: FakeController(self), "127.0.0.1", 0)
        return self.srv.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self.srv.close()
        for c in self.connections:
            c.transport.abort()
        await self.srv.wait_closed()


@pytest.fixture
async def server():
    srv = FakeServer()
    srv.port = await srv.start()
    yield srv
    await srv.stop()


async def open_host(srv: FakeServer, *, queue_size: int = 16, digests: bool = False, incapsule: int = 4096,
                    timeout: float | None = 5.0) -> HostQueue:
    loop = asyncio.get_running_loop()
    q = HostQueue(1, queue_size=queue_size, name="fake qid 1", hdr_digest=digests, data_digest=digests,
                  incapsule_size=incapsule, timeout=timeout)
    return await open_queue(lambda pf: loop.create_connection(pf, "127.0.0.1", srv.port), q, 5.0)


def rw(opcode: int, slba: int) -> Command:
    return Command(opcode, nsid=1, cdw10=slba)


@pytest.mark.parametrize("digests", [False, True])
async def test_write_incapsule_and_r2t_then_read(server: FakeServer, digests: bool) -> None:
    q = await open_host(server, digests=digests)
    small = bytes(range(256)) * 8            # 2048 B: in-capsule
    large = bytes((i * 7) & 0xFF for i in range(20000))  # R2T, 3 H2CData PDUs of <= 8192
    await q.submit(rw(0x01, 0), data_out=small)
    await q.submit(rw(0x01, 8), data_out=memoryview(large))
    assert server.commands[0].sgl().sgl_id == SGL_ID_INCAPSULE
    assert server.commands[1].sgl().sgl_id == SGL_ID_TRANSPORT
    assert server.h2c_pdus == [(0, 8192, False), (8192, 8192, False), (16384, 3616, True)]
    buf = bytearray(len(large))
    cqe = await q.submit(rw(0x02, 8), data_in=buf)
    assert cqe.status_code == 0 and bytes(buf) == large
    buf2 = bytearray(2048)
    await q.submit(rw(0x02, 0), data_in=memoryview(buf2))
    assert bytes(buf2) == small
    q.close()


async def test_many_in_flight_bounded_by_queue_size(server: FakeServer) -> None:
    q = await open_host(server, queue_size=4)
    for i in range(40):
        server.ram[i * 512:(i + 1) * 512] = bytes([i]) * 512
    bufs = [bytearray(512) for _ in range(40)]
    await asyncio.gather(*(q.submit(rw(0x02, i), data_in=bufs[i]) for i in range(40)))
    assert all(bytes(b) == bytes([i]) * 512 for i, b in enumerate(bufs))
    assert {c.cid for c in server.commands} <= {0, 1, 2}   # queue_size 4 keeps at most 3 in flight
    assert q.inflight == 0


async def test_nvme_status_raises_with_details(server: FakeServer) -> None:
    q = await open_host(server)
    with pytest.raises(NvmeError) as info:
        await q.submit(Command(FAIL))
    assert info.value.status == Status.LBA_RANGE and info.value.result == 0x1234
    assert "LBA_RANGE" in str(info.value)
    # the queue stays usable after a status error
    await q.submit(rw(0x01, 0), data_out=bytes(512))


async def test_success_flag_completes_without_response(server: FakeServer) -> None:
    q = await open_host(server)
    server.ram[:1024] = b"\xab" * 1024
    server.action = "success"
    buf = bytearray(1024)
    cqe = await asyncio.wait_for(q.submit(rw(0x02, 0), data_in=buf), 2)
    assert cqe.status_code == 0 and bytes(buf) == b"\xab" * 1024


async def test_data_digest_error_fails_the_command(server: FakeServer) -> None:
    q = await open_host(server, digests=True)
    server.action = "bad_digest"
    server.ram[:4096] = b"\x11" * 4096
    with pytest.raises(NvmeError) as info:
        await q.submit(rw(0x02, 0), data_in=bytearray(4096))
    assert info.value.status == Status.DATA_XFER_ERROR and "digest" in str(info.value)
    server.action = ""
    await q.submit(rw(0x02, 0), data_in=bytearray(4096))  # queue still works


async def _term_req_seen(server: FakeServer) -> TermReqReceived:
    for _ in range(200):
        terms = [ev for ev in server.other_events if isinstance(ev, TermReqReceived)]
        if terms:
            return terms[0]
        await asyncio.sleep(0.01)
    raise AssertionError(f"no H2CTermReq reached the controller: {server.other_events}")


async def test_bad_c2h_offset_breaks_queue(server: FakeServer) -> None:
    q = await open_host(server)
    server.action = "bad_offset"
    with pytest.raises(TransportError, match="offset 512"):
        await q.submit(rw(0x02, 0), data_in=bytearray(4096))
    with pytest.raises(TransportError):
        await q.submit(rw(0x02, 0), data_in=bytearray(512))
    # The H2CTermReq names the field in error: the C2HData's DATAO (it said FEI 0 before).
    term = await _term_req_seen(server)
    assert (term.fes, term.fei) == (FatalErrorStatus.DATA_OUT_OF_RANGE, tcp_spec.OFF_DATAO)


async def test_r2t_beyond_the_write_breaks_queue(server: FakeServer) -> None:
    q = await open_host(server)
    server.action = "bad_r2t"
    with pytest.raises(TransportError, match="asks offset 0 length 16896; the command has 16384 bytes"):
        await q.submit(rw(0x01, 0), data_out=bytes(16384))
    term = await _term_req_seen(server)
    assert (term.fes, term.fei) == (FatalErrorStatus.DATA_OUT_OF_RANGE, tcp_spec.OFF_R2TL)


async def test_termreq_fails_all_in_flight(server: FakeServer) -> None:
    q = await open_host(server)
    hung = [asyncio.create_task(q.submit(Command(HANG))) for _ in range(3)]
    await asyncio.sleep(0.05)
    server.action = "termreq"
    with pytest.raises(TransportError, match=r"C2HTermReq.*INVALID_HEADER_FIELD"):
        await q.submit(rw(0x02, 0), data_in=bytearray(512))
    for t in hung:
        with pytest.raises(TransportError, match="fake qid 1"):
            await t


async def test_drop_fails_all_in_flight_promptly(server: FakeServer) -> None:
    q = await open_host(server, queue_size=4)
    hung = [asyncio.create_task(q.submit(Command(HANG))) for _ in range(3)]
    waiting = asyncio.create_task(q.submit(Command(HANG)))  # waits for a free cid
    await asyncio.sleep(0.05)
    assert not waiting.done()
    for c in server.connections:
        c.transport.abort()
    done, _ = await asyncio.wait([*hung, waiting], timeout=2)
    assert len(done) == 4
    for t in done:
        assert isinstance(t.exception(), TransportError)


async def test_timeout_raises_command_timeout_and_breaks_queue(server: FakeServer) -> None:
    q = await open_host(server, timeout=0.2)
    other = asyncio.create_task(q.submit(Command(HANG), timeout=None))
    with pytest.raises(CommandTimeout, match=r"got no completion in 0\.2 s"):
        await q.submit(Command(HANG))
    with pytest.raises(TransportError, match="timed out"):
        await other
    assert q.broken is not None


async def test_cancelled_command_keeps_cid_until_answered(server: FakeServer) -> None:
    q = await open_host(server, queue_size=3)
    task = asyncio.create_task(q.submit(Command(HANG)))
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert q.inflight == 1          # the controller may still answer cid 0: it is not reused
    await q.submit(rw(0x01, 0), data_out=bytes(512))
    assert server.commands[-1].cid == 1


async def test_icresp_digest_mismatch_is_reported() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(128)
        # An ICResp that drops the requested header digest.
        writer.write(struct.pack("<BBBBIHBBI112x", 1, 0, 128, 0, 128, 0, 0, 0, 8192))
        await writer.drain()
        await asyncio.sleep(1)
        writer.close()

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    q = HostQueue(0, queue_size=4, name="ic test", hdr_digest=True)
    with pytest.raises(TransportError, match=r"ic test: .*digest"):
        await open_queue(lambda pf: loop.create_connection(pf, "127.0.0.1", port), q, 2.0)
    srv.close()


async def test_connect_refused_is_transport_error() -> None:
    sock_srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = sock_srv.sockets[0].getsockname()[1]
    sock_srv.close()
    await sock_srv.wait_closed()
    loop = asyncio.get_running_loop()
    q = HostQueue(0, queue_size=4, name="refused")
    with pytest.raises(TransportError, match="refused: cannot connect"):
        await open_queue(lambda pf: loop.create_connection(pf, "127.0.0.1", port), q, 2.0)


async def test_submit_argument_errors(server: FakeServer) -> None:
    q = await open_host(server)
    with pytest.raises(ValueError, match="one direction"):
        await q.submit(rw(0x01, 0), data_out=b"x", data_in=bytearray(1))
    with pytest.raises(ValueError, match="writable"):
        await q.submit(rw(0x02, 0), data_in=memoryview(b"abc"))
