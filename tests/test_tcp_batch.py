"""The NVMe/TCP batch engine (target/transports/tcp_batch.py) against the stream engine it shortcuts.

- its precompiled struct layouts read and write what the construct definitions do;
- scripted sessions (reads and in-capsule writes on a RAM disk, errors, admin commands, R2T writes,
  SQ flow control on and off, PDUs cut at every byte) give the host exactly the bytes the stream
  engine gives, and the fast path really ran;
- over real sockets (its own listener and SocketTransport, with and without --poll-us), the
  initiator reads back what it wrote, digests included (those take the stream engine's PDU code).
"""

from __future__ import annotations

import asyncio
import random
import socket
from typing import Any

import pytest
import test_fast_paths
from target_host import SUBNQN, TinyHost, admin_session, make_target, open_tcp
from test_fast_paths import RecordingHost, _batch, _rd, _wr

from nvmeof.spec import nvme as nvme_spec
from nvmeof.spec import tcp as spec
from nvmeof.spec.nvme import SGL_ID_INCAPSULE, SGL_ID_TRANSPORT, Command, IoOpcode
from target.backends.ram import RamBackend
from target.model import Listener, Namespace
from target.transports import loop as loop_transport
from target.transports import tcp_batch
from target.transports.tcp_batch import CMD_FAST, REPLY_FAST, RESP_FAST, BatchMixin, BatchTcpListener


class BatchLoopConnection(BatchMixin, loop_transport.LoopConnection):
    """The batch engine over the in-memory loop transport (the stream engine's test harness)."""

    instances: list[BatchLoopConnection] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._batch_init()
        BatchLoopConnection.instances.append(self)


def _use_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    BatchLoopConnection.instances = []
    monkeypatch.setattr(loop_transport, "LoopConnection", BatchLoopConnection)


def _fast_count() -> int:
    return sum(c.fast_commands for c in BatchLoopConnection.instances)


# --- layouts --------------------------------------------------------------------------------------


def test_command_layout_equals_construct() -> None:
    rng = random.Random(12)
    for _ in range(50):
        sqe_fields = {"opcode": rng.randrange(256), "flags": rng.randrange(256), "cid": rng.randrange(1 << 16),
                      "nsid": rng.randrange(1 << 32), "cdw2": rng.randrange(1 << 32), "cdw3": rng.randrange(1 << 32),
                      "mptr": rng.randrange(1 << 64), "dptr": rng.randbytes(16), "cdw10": rng.randrange(1 << 32),
                      "cdw11": rng.randrange(1 << 32), "cdw12": rng.randrange(1 << 32), "cdw13": 0, "cdw14": 0,
                      "cdw15": 0}
        sqe = nvme_spec.SQE.build(sqe_fields)
        pdu = spec.CapsuleCmdHeader.build({"ch": {"type": spec.PduType.CAPSULE_CMD, "flags": 0, "hlen": 72,
                                                  "pdo": 0, "plen": 72}, "sqe": sqe})
        head, opflags, cid, nsid, sgl_len, sgl_id, slba, cdw12 = CMD_FAST.unpack_from(pdu)
        opcode, flags = opflags & 0xFF, opflags >> 8
        assert head == int.from_bytes(spec.CommonHeader.build({"type": spec.PduType.CAPSULE_CMD, "flags": 0,
                                                                "hlen": 72, "pdo": 0, "plen": 72}), "little")
        parsed = nvme_spec.SQE.parse(spec.CapsuleCmdHeader.parse(pdu).sqe)
        sgl = nvme_spec.SglDataBlock.parse(parsed.dptr)
        assert (opcode, flags, cid, nsid) == (parsed.opcode, parsed.flags, parsed.cid, parsed.nsid)
        assert (sgl_len, sgl_id) == (sgl.length, parsed.dptr[15])
        assert slba == parsed.cdw10 | parsed.cdw11 << 32 and cdw12 == parsed.cdw12
    assert CMD_FAST.size <= spec.CAPSULE_CMD_HEADER_SIZE


def test_reply_layout_equals_construct() -> None:
    buf = bytearray(REPLY_FAST.size)
    REPLY_FAST.pack_into(buf, 0, spec.PduType.C2H_DATA, 0x0C, 24, 24, 24 + 4096, 77, 0, 0, 4096,
                         spec.PduType.CAPSULE_RESP, 0, 24, 0, 24, 0, 0, 9, 3, 77, 0)
    hdr = spec.DataPduHeader.parse(bytes(buf[:24]))
    assert (hdr.ch.type, hdr.ch.flags, hdr.ch.hlen, hdr.ch.pdo, hdr.ch.plen) == (spec.PduType.C2H_DATA, 0x0C, 24,
                                                                                     24, 24 + 4096)
    assert (hdr.cccid, hdr.ttag, hdr.datao, hdr.datal) == (77, 0, 0, 4096)
    resp = spec.CapsuleResp.parse(bytes(buf[24:]))
    assert (resp.ch.type, resp.ch.hlen, resp.ch.plen) == (spec.PduType.CAPSULE_RESP, 24, 24)
    cqe = nvme_spec.CQE.parse(resp.cqe)
    assert (cqe.dw0, cqe.dw1, cqe.sqhd, cqe.sqid, cqe.cid, cqe.status) == (0, 0, 9, 3, 77, 0)
    # the CapsuleResp alone (writes) is the slot's second half
    alone = bytearray(RESP_FAST.size)
    RESP_FAST.pack_into(alone, 0, spec.PduType.CAPSULE_RESP, 0, 24, 0, 24, 0, 0, 9, 3, 77, 0)
    assert alone == buf[24:]


def test_slot_sqhd_store_equals_the_packed_cqe(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot's SQHD written through its 16-bit view (little-endian hosts) or packed (the fallback) gives the
    CapsuleResp RESP_FAST packs with that SQHD."""
    slots = [tcp_batch._Slot(77, 3, False)]
    monkeypatch.setattr(tcp_batch, "_NATIVE_LE", False)
    slots.append(tcp_batch._Slot(77, 3, False))
    for sqhd in (0, 1, 0x1234, 0xFFFE):
        want = bytearray(RESP_FAST.size)
        RESP_FAST.pack_into(want, 0, spec.PduType.CAPSULE_RESP, 0, 24, 0, 24, 0, 0, sqhd, 3, 77, 0)
        for slot in slots:
            slot.sqhd[0] = sqhd
            assert bytes(slot.resp) == want


# --- byte for byte against the stream engine --------------------------------------------------------


async def test_fast_paths_session_same_bytes(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/test_fast_paths.py's scripted session (RAM and file namespaces, R2T writes, compares,
    admin commands, errors) on both engines."""
    (tmp_path / "s").mkdir()
    (tmp_path / "b").mkdir()
    stream = await test_fast_paths._session(tmp_path / "s", True, monkeypatch)
    _use_batch(monkeypatch)
    batch = await test_fast_paths._session(tmp_path / "b", True, monkeypatch)
    assert batch[:3] == stream[:3]
    assert _fast_count() > 0


async def _io_recording(tgt: Any, cntlid: int, *, sqflow_off: bool) -> RecordingHost:
    _, host = await loop_transport.create_loop_connection(tgt, RecordingHost)
    assert isinstance(host, RecordingHost)
    await asyncio.wait_for(host.ready, 5)
    res = await host.connect(SUBNQN, qid=1, cntlid=cntlid, sqsize=63, cattr=4 if sqflow_off else 0)
    assert res.status == 0
    return host


def _send_cut(host: RecordingHost, sends: list[tuple[Any, ...]], rng: random.Random) -> list[asyncio.Future[Any]]:
    """Queue the commands and deliver their bytes to the target in random pieces (1 byte to 300)."""
    host.hold = True
    futs = [host.send(cmd, data, read_len=read_len) for cmd, data, read_len in sends]
    wire = b"".join(bytes(b) for b in host.conn.data_to_send())
    host.hold = False
    assert host.transport is not None
    pos = 0
    while pos < len(wire):
        n = rng.choice((1, 7, 8, 60, 71, 72, 73, 300, 5000))
        host.transport.write(wire[pos:pos + n])
        pos += n
    return futs


def script_batches() -> list[list[tuple[Any, ...]]]:
    """The scripted session's batches of I/O commands: in-capsule and R2T writes, reads of every size, bad SGLs,
    an unknown and a read-only namespace, a flush, and the same CIDs again (test_tls_batch runs it over TLS)."""
    a = random.Random(1).randbytes(4096)
    big = random.Random(2).randbytes(32 * 1024)   # above the in-capsule size: R2T and H2CData
    bad_sgl = Command(IoOpcode.READ, nsid=1, cdw10=0, cdw12=0)
    bad_sgl.dptr = Command.make_sgl(SGL_ID_INCAPSULE, 0, 512)
    short_sgl = Command(IoOpcode.READ, nsid=1, cdw10=0, cdw12=1)
    short_sgl.dptr = Command.make_sgl(SGL_ID_TRANSPORT, 0, 512)
    batches = [
        [_wr(0, a), _rd(0, 8), _rd(2, 1), _wr(8, a[:512]), _rd(8, 1), _rd(0, 8)],
        [_rd(2047, 2), _rd(0, 1, nsid=9), _rd(5, 3), _wr(0, a, nsid=3), _rd(0, 1, nsid=3), _rd(1, 1)],
        [(bad_sgl, None, 0), (short_sgl, None, 0), _rd(1, 1), (Command(IoOpcode.FLUSH, nsid=1), None, 0), _rd(3, 1)],
        [_wr(100, big), _rd(100, 64), _rd(0, 8)] + [_rd(i, 1) for i in range(40)],
        # the same CIDs again (each batch starts at cid 1): the slots' hot lane, and a length change
        [_rd(100, 64), _rd(0, 8)] + [_rd(i, 1) for i in range(40, 80)],
        [_rd(100, 64), _rd(0, 2)] + [_rd(i, 1) for i in range(40)] + [_rd(3000, 1), _rd(5, 1)],
        # two R2T writes in one batch, then their reads
        [_wr(200, big), _wr(300, big), _rd(200, 64), _rd(300, 64)] + [_rd(i, 1) for i in range(40)],
        [_rd(7, 64), _wr(3, a[:1024]), _rd(0, 8)] + [_rd(i, 1, nsid=3 if i % 5 == 0 else 1) for i in range(40)],
    ]
    return batches


async def _script(sqflow_off: bool, cut: bool) -> tuple[bytes, list[Any]]:
    tgt = make_target()
    sub = tgt.subsystems[SUBNQN]
    sub.namespaces[3] = Namespace(3, RamBackend(1 << 20, read_only=True))
    admin, cntlid = await admin_session(tgt, SUBNQN)
    rec = await _io_recording(tgt, cntlid, sqflow_off=sqflow_off)
    rng = random.Random(3)
    batches = script_batches()
    seen: list[Any] = []
    for sends in batches:
        rec.next_cid = 1   # CIDs are free again once their batch completed
        if cut:
            futs = _send_cut(rec, sends, rng)
            results = await asyncio.wait_for(asyncio.gather(*futs), 10)
            seen += [(r.status, r.data) for r in results]
        else:
            seen += await _batch(rec, sends)
    for h in (admin, rec):
        h.close()
    await asyncio.sleep(0.05)
    await tgt.close()
    return bytes(rec.received), seen


@pytest.mark.parametrize("sqflow_off", [False, True])
@pytest.mark.parametrize("cut", [False, True])
async def test_script_same_bytes(monkeypatch: pytest.MonkeyPatch, sqflow_off: bool, cut: bool) -> None:
    stream = await _script(sqflow_off, cut)
    _use_batch(monkeypatch)
    batch = await _script(sqflow_off, cut)
    assert batch[1] == stream[1]
    assert batch[0] == stream[0]
    assert _fast_count() >= 150
    statuses = [s for s, _ in batch[1]]
    assert statuses.count(0) < len(statuses)   # the errors were answered as errors


# --- real sockets -------------------------------------------------------------------------------------


async def _listen(tgt: Any, poll_us: int) -> BatchTcpListener:
    from target.transports.tcp import TcpLimits, TcpPort

    TcpPort.of(tgt).configure(TcpLimits(poll_us=poll_us))
    server = BatchTcpListener(tgt, Listener("tcp", "ipv4", "127.0.0.1", 0, portid=1))
    await server.start()
    return server


@pytest.mark.parametrize("poll_us", [0, 50])
async def test_socket_engine_serves_the_initiator(poll_us: int) -> None:
    import initiator

    tgt = make_target()
    server = await _listen(tgt, poll_us)
    try:
        async with initiator.connect("127.0.0.1", server.port, subnqn=SUBNQN, kato=0) as ctrl:
            data = random.Random(5).randbytes(256 * 1024)
            await ctrl.write(1, 0, data)
            assert await ctrl.read(1, 0, len(data) // 512) == data
            reads = await asyncio.gather(*(ctrl.read(1, i * 8, 8) for i in range(64)))
            assert b"".join(reads) == data[:64 * 4096]
        conns = [c for c in server.connections]
        assert not conns or all(isinstance(c, tcp_batch.BatchConnection) for c in conns)
    finally:
        await server.stop()
        await tgt.close()


@pytest.mark.parametrize("digests", [(True, False), (False, True), (True, True)])
async def test_socket_engine_with_digests(digests: tuple[bool, bool]) -> None:
    tgt = make_target()
    server = await _listen(tgt, 0)
    try:
        hdgst, ddgst = digests
        admin = await open_tcp(server.port, hdgst=hdgst, ddgst=ddgst)
        res = await admin.connect(SUBNQN)
        assert res.status == 0
        await admin.enable()
        io: TinyHost = await open_tcp(server.port, hdgst=hdgst, ddgst=ddgst)
        assert (await io.connect(SUBNQN, qid=1, cntlid=res.cqe.dw0 & 0xFFFF, sqsize=31)).status == 0
        a = random.Random(7).randbytes(4096)
        assert (await io.cmd(Command(IoOpcode.WRITE, nsid=1, cdw10=0, cdw12=7), a)).status == 0
        got = await io.cmd(Command(IoOpcode.READ, nsid=1, cdw10=0, cdw12=7), read_len=4096)
        assert got.status == 0 and got.data == a
        io.close()
        admin.close()
    finally:
        await server.stop()
        await tgt.close()


# --- the daemon and its workers ---------------------------------------------------------------------


def _daemon_options(tmp_path: Any, **kw: Any) -> Any:
    from nvmeof.cli.daemon import DaemonOptions
    from nvmeof.uri import TransportAddress
    from tests.ports import free_ports

    io, disc = free_ports(2)
    return DaemonOptions(listen=[TransportAddress("tcp", "127.0.0.1", io)],
                         discovery=[TransportAddress("tcp", "127.0.0.1", disc)], api=None, ramdisk_size=4 << 20,
                         backing_dirs=[tmp_path], **kw), io


async def _tinyhost_io(port: int, nqn: str) -> tuple[TinyHost, TinyHost]:
    admin = await open_tcp(port)
    res = await admin.connect(nqn)
    assert res.status == 0
    await admin.enable()
    io = await open_tcp(port)
    assert (await io.connect(nqn, qid=1, cntlid=res.cqe.dw0 & 0xFFFF, sqsize=31)).status == 0
    return admin, io


async def _rw(io: TinyHost) -> None:
    data = [random.Random(i).randbytes(4096) for i in range(8)]
    for i, d in enumerate(data):
        assert (await io.cmd(Command(IoOpcode.WRITE, nsid=1, cdw10=8 * i, cdw12=7), d)).status == 0
    got = await asyncio.gather(*(io.cmd(Command(IoOpcode.READ, nsid=1, cdw10=8 * i, cdw12=7), read_len=4096)
                                 for i in range(8)))
    assert [g.data for g in got] == data


async def test_workers_serve_their_queues_on_the_batch_engine(tmp_path: Any) -> None:
    from nvmeof import defaults
    from nvmeof.cli.daemon import Daemon

    options, port = _daemon_options(tmp_path, workers=1, poll_us=20)
    daemon = Daemon(options)
    try:
        await daemon.start()
        pool = daemon.target.pool   # type: ignore[attr-defined]
        admin, io = await _tinyhost_io(port, defaults.DEFAULT_SUBSYSTEM_NQN)
        await _rw(io)
        assert list(pool.placement().values()) == pool.pids()   # the I/O queue went to the worker
        with open(f"/proc/{pool.pids()[0]}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        assert b"--tcp-engine" not in argv and argv[argv.index(b"--poll-us") + 1] == b"20"
        assert issubclass(daemon.target.transports.get("tcp"), BatchTcpListener)
        io.close()
        admin.close()
    finally:
        await daemon.stop()


async def test_daemon_serves_with_the_one_engine(tmp_path: Any) -> None:
    from nvmeof import defaults
    from nvmeof.cli.daemon import Daemon

    options, port = _daemon_options(tmp_path)
    daemon = Daemon(options)
    try:
        await daemon.start()
        assert daemon.target.transports.get("tcp") is BatchTcpListener   # no --tcp-engine: one engine (issue 26)
        admin, io = await _tinyhost_io(port, defaults.DEFAULT_SUBSYSTEM_NQN)
        await _rw(io)
        io.close()
        admin.close()
    finally:
        await daemon.stop()


def test_poll_us_must_not_be_negative(tmp_path: Any) -> None:
    from nvmeof.cli.daemon import Daemon, DaemonError

    options, _ = _daemon_options(tmp_path, poll_us=-1)
    with pytest.raises(DaemonError, match="--poll-us -1: give 0"):
        Daemon(options)


async def _paused_host(server: BatchTcpListener, seed: int) -> tuple[TinyHost, TinyHost, Any, bytes]:
    """A host whose I/O queue wrote 1 MiB of random data at LBA 0, then stopped reading: (admin, io, the
    target's end of the I/O queue, the data). Small socket buffers on both ends (no autotuning), so that
    megabytes of replies cannot all fit."""
    admin, io = await _tinyhost_io(server.port, SUBNQN)
    data = random.Random(seed).randbytes(1 << 20)
    assert (await io.cmd(Command(IoOpcode.WRITE, nsid=1, cdw10=0, cdw12=2047), data)).status == 0
    assert io.transport is not None
    conn = next(c for c in server.connections if c.queue.qid == 1)
    conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 * 1024)
    io.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 * 1024)
    io.transport.pause_reading()
    return admin, io, conn, data


async def test_socket_backlog_when_the_host_does_not_read() -> None:
    """Replies the socket cannot take wait as views in the backlog (the target stops reading commands
    past its high-water mark) and arrive whole and in order once the host reads again."""
    tgt = make_target()
    server = await _listen(tgt, 0)
    try:
        admin, io, conn, data = await _paused_host(server, seed=9)
        futs = [io.send(Command(IoOpcode.READ, nsid=1, cdw10=256 * (i % 8), cdw12=255), read_len=128 * 1024)
                for i in range(24)]
        deadline = asyncio.get_running_loop().time() + 10
        while conn.transport.get_write_buffer_size() == 0 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert conn.transport.get_write_buffer_size() > 0, "the socket took 3 MiB without the host reading"
        io.transport.resume_reading()
        results = await asyncio.wait_for(asyncio.gather(*futs), 10)
        for i, r in enumerate(results):
            assert r.status == 0 and r.data == data[(i % 8) * 128 * 1024:(i % 8 + 1) * 128 * 1024]
        io.close()
        admin.close()
    finally:
        await server.stop()
        await tgt.close()


# --- review fixes: atomicity, bounded tables and batches, failures, polling ----------------------------


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_r2t_write_leaves_the_disk_alone_until_its_data_is_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """H2CData arrives cut at any byte: placed straight into the RAM disk, a read meanwhile would see
    half a block (AWUN 0 promises single-block atomicity). On the buffered road (this transport is not
    the engine's socket, so the engine cannot ask what it holds) the disk changes only once the write has
    all its data, in one copy when it executes; tests/test_batch_r2t.py shows the road into the disk."""
    _use_batch(monkeypatch)
    tgt = make_target()
    disk = tgt.subsystems[SUBNQN].namespaces[1].backend.memory_view()
    assert disk is not None
    _admin, cntlid = await admin_session(tgt, SUBNQN)
    rec = await _io_recording(tgt, cntlid, sqflow_off=False)
    r2ts: list[Any] = []
    rec.r2t_hook = lambda ev: r2ts.append(ev) or True
    data = random.Random(11).randbytes(64 * 1024)
    before = bytes(disk[:len(data)])
    fut = rec.send(*_wr(0, data)[:2])
    await _settle()
    assert len(r2ts) == 1 and r2ts[0].length == len(data)
    rec.conn.send_h2c_data(r2ts[0].cccid, r2ts[0].ttag, 0, data, last=True)
    wire = b"".join(bytes(b) for b in rec.conn.data_to_send())
    assert rec.transport is not None
    for pos in range(0, len(wire) - 1, 5000):   # all but the last byte, in pieces
        rec.transport.write(wire[pos:min(pos + 5000, len(wire) - 1)])
        await _settle()
        assert bytes(disk[:len(data)]) == before, f"the disk changed with {pos + 5000} of {len(wire)} bytes"
    rec.transport.write(wire[-1:])
    assert (await asyncio.wait_for(fut, 5)).status == 0
    assert bytes(disk[:len(data)]) == data
    await tgt.close()


async def _cid_session() -> tuple[bytes, list[Any]]:
    """Reads and in-capsule writes under CIDs spread over 0..65535, each CID twice (a reply slot's
    second use), through one I/O queue."""
    tgt = make_target()
    _admin, cntlid = await admin_session(tgt, SUBNQN)
    rec = await _io_recording(tgt, cntlid, sqflow_off=False)
    rng = random.Random(4)
    cids = [0, 65535, *rng.sample(range(1, 65535), 298)]
    seen: list[Any] = []
    for _ in range(2):
        for start in range(0, len(cids), 50):
            rec.hold = True
            futs = []
            for cid in cids[start:start + 50]:
                rec.next_cid = cid
                send = _wr(cid % 2000, rng.randbytes(512)) if cid % 7 == 0 else _rd(cid % 2000, 1 + cid % 8)
                futs.append(rec.send(send[0], send[1], read_len=send[2]))
            rec.hold = False
            rec.flush()
            seen += [(r.status, r.data) for r in await asyncio.wait_for(asyncio.gather(*futs), 10)]
    await tgt.close()
    return bytes(rec.received), seen


async def test_reply_slots_stay_within_their_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host cycling through all CIDs keeps only TCP_BATCH_REPLY_SLOTS reply slots per queue (the cap
    made small here); the CIDs past it get replies of their own, byte for byte the stream engine's."""
    stream = await _cid_session()
    _use_batch(monkeypatch)
    monkeypatch.setattr(tcp_batch, "_MAX_SLOTS", 64)
    batch = await _cid_session()
    assert batch[1] == stream[1] and batch[0] == stream[0]
    assert all(status == 0 for status, _ in batch[1])
    io_conn = next(c for c in BatchLoopConnection.instances if c.queue.qid == 1)
    assert len(io_conn._slots) == 64
    assert io_conn.fast_commands == len(batch[1])


async def test_one_wake_up_queues_a_bounded_backlog() -> None:
    """A receive buffer full of 128 KiB reads from a host that does not read its replies: the batch
    stops once its replies pass TCP_WRITE_HIGH_WATER, the rest of the buffer waits, and everything is
    answered, whole and in order, once the host reads again."""
    from nvmeof import defaults

    tgt = make_target()
    server = await _listen(tgt, 0)
    try:
        _admin, io, conn, data = await _paused_host(server, seed=10)
        count = 150   # 10.8 KB of commands (one receive), 18.75 MiB of replies
        done = conn.fast_commands
        flush = io.flush
        io.flush = lambda: None   # type: ignore[method-assign]   # all the commands in one write
        futs = [io.send(Command(IoOpcode.READ, nsid=1, cdw10=256 * (i % 8), cdw12=255), read_len=128 * 1024)
                for i in range(count)]
        io.flush = flush   # type: ignore[method-assign]
        io.flush()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while conn.transport.get_write_buffer_size() == 0 and loop.time() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)   # more wake-ups, were the connection still reading
        queued = conn.transport.get_write_buffer_size()
        # under the high-water mark (still writing), then one more batch: at most the mark and one read more
        bound = 2 * defaults.TCP_WRITE_HIGH_WATER + 128 * 1024 + 4096
        assert 0 < queued <= bound, f"{queued} bytes queued"
        assert conn.fast_commands - done < count
        io.transport.resume_reading()
        results = await asyncio.wait_for(asyncio.gather(*futs), 20)
        for i, r in enumerate(results):
            assert r.status == 0 and r.data == data[(i % 8) * 128 * 1024:(i % 8 + 1) * 128 * 1024]
        assert conn.fast_commands - done == count
    finally:
        await server.stop()
        await tgt.close()


class _Recorder(asyncio.BufferedProtocol):
    """A protocol on a SocketTransport that keeps what it receives, or raises at the first bytes."""

    def __init__(self, fail: bool) -> None:
        from types import SimpleNamespace

        self.fail = fail
        self.buf = bytearray(4096)
        self.got = bytearray()
        self.lost: asyncio.Future[Exception | None] = asyncio.get_running_loop().create_future()
        self.queue = SimpleNamespace(peer="peer-under-test", qid=7)

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self.buf)

    def buffer_updated(self, nbytes: int) -> None:
        if self.fail:
            raise RuntimeError("half a batch done")
        self.got += self.buf[:nbytes]

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.set_result(exc)


async def test_protocol_exception_closes_the_connection(caplog: pytest.LogCaptureFixture) -> None:
    """An exception from the protocol on received bytes closes that connection (logged with its peer
    and queue), does not reach the loop's exception handler, and the loop serves the others on."""
    loop = asyncio.get_running_loop()
    handled: list[Any] = []
    loop.set_exception_handler(lambda _loop, context: handled.append(context))
    bad_sock, bad_peer = socket.socketpair()
    good_sock, good_peer = socket.socketpair()
    try:
        bad, good = _Recorder(True), _Recorder(False)
        bad_transport = tcp_batch.SocketTransport(loop, bad_sock, bad)
        good_transport = tcp_batch.SocketTransport(loop, good_sock, good)
        bad_peer.sendall(b"x")
        good_peer.sendall(b"hello ")
        exc = await asyncio.wait_for(bad.lost, 2)
        assert isinstance(exc, RuntimeError) and bad_transport.is_closing()
        bad_peer.settimeout(5)
        assert bad_peer.recv(1) == b""   # the descriptor is closed: the host sees the FIN
        good_peer.sendall(b"world")
        deadline = loop.time() + 5
        while bytes(good.got) != b"hello world" and loop.time() < deadline:
            await asyncio.sleep(0.01)
        assert bytes(good.got) == b"hello world" and not good.lost.done()
        assert not handled
        assert any("peer-under-test" in r.getMessage() and "qid 7" in r.getMessage() for r in caplog.records)
        good_transport.abort()
        await asyncio.wait_for(good.lost, 2)
    finally:
        loop.set_exception_handler(None)
        for sock in (bad_sock, bad_peer, good_sock, good_peer):
            sock.close()


async def test_a_full_receive_buffer_is_an_error_not_end_of_stream(caplog: pytest.LogCaptureFixture) -> None:
    """A protocol whose get_buffer has no room left closes the connection with that error logged; before,
    recv_into of the empty view returned 0 and the transport took it for the host's FIN (eof_received)."""
    loop = asyncio.get_running_loop()
    sock, peer = socket.socketpair()
    try:
        full = _Recorder(False)
        full.buf = bytearray(0)
        eofs: list[bool] = []
        full.eof_received = lambda: eofs.append(True) or False   # type: ignore[method-assign]
        transport = tcp_batch.SocketTransport(loop, sock, full)
        peer.sendall(b"capsule")
        exc = await asyncio.wait_for(full.lost, 2)
        assert isinstance(exc, RuntimeError) and "no room" in str(exc) and transport.is_closing()
        assert not eofs
        assert any("get_buffer raised RuntimeError" in r.getMessage() for r in caplog.records)
    finally:
        sock.close()
        peer.close()


def test_polling_holds_the_loop_one_slice_at_most(monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection whose every poll finds data polls on only TCP_POLL_SLICE_US per wake-up, however
    long --poll-us is (a clock that moves 10 µs per look, a socket that always has data)."""
    from nvmeof import defaults

    clock = [0]

    def fake_ns() -> int:
        clock[0] += 10_000
        return clock[0]

    loop = asyncio.new_event_loop()
    sock, peer = socket.socketpair()
    try:
        transport = tcp_batch.SocketTransport(loop, sock, _Idle(), poll_us=20_000)
        monkeypatch.setattr(tcp_batch, "_perf_ns", fake_ns)
        monkeypatch.setattr(transport, "_recv_once", lambda: True)
        monkeypatch.setattr(transport, "_poller", type("P", (), {"poll": staticmethod(lambda _t: [(0, 1)])})())
        transport._read_ready()
        assert clock[0] <= (defaults.TCP_POLL_SLICE_US + 30) * 1000
        transport.abort()
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()
        sock.close()
        peer.close()


class _Idle(asyncio.BufferedProtocol):
    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(bytearray(16))

    def buffer_updated(self, nbytes: int) -> None:
        pass


def test_poll_us_above_the_slice_is_refused(tmp_path: Any) -> None:
    from nvmeof import defaults
    from nvmeof.cli.daemon import Daemon, DaemonError

    options, _ = _daemon_options(tmp_path, poll_us=defaults.POLL_US_MAX + 1)
    with pytest.raises(DaemonError, match=rf"--poll-us {defaults.POLL_US_MAX + 1}: give at most "
                                          rf"{defaults.POLL_US_MAX} µs"):
        Daemon(options)
    Daemon(_daemon_options(tmp_path, poll_us=defaults.POLL_US_MAX)[0])


async def test_a_batch_past_its_time_budget_leaves_the_rest_for_the_next_loop_iteration(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Loop stall bound: with a time budget of 0 every batch stops after its first command that called the
    backend; the rest of the received bytes is carried and taken up again by a call_soon (or the next read),
    so one write of 32 in-capsule writes and 32 reads takes a wake-up per write, and all are answered,
    whole, in order, with the replies the fast path makes."""
    monkeypatch.setattr(tcp_batch, "_TIME_BUDGET_NS", 0)
    receives: list[int] = []
    original = BatchMixin._receive

    def counting(self: Any, mv: memoryview) -> None:
        receives.append(len(mv))
        original(self, mv)

    monkeypatch.setattr(BatchMixin, "_receive", counting)
    tgt = make_target()
    server = await _listen(tgt, 0)
    try:
        admin, io = await _tinyhost_io(server.port, SUBNQN)
        conn = next(c for c in server.connections if c.queue.qid == 1)
        count = 32
        blocks = [random.Random(i).randbytes(4096) for i in range(count)]
        done, before = conn.fast_commands, len(receives)
        flush = io.flush
        io.flush = lambda: None   # type: ignore[method-assign]   # all the commands in one send
        writes = [io.send(Command(IoOpcode.WRITE, nsid=1, cdw10=8 * i, cdw12=7), blocks[i], incapsule=True)
                  for i in range(count)]
        reads = [io.send(Command(IoOpcode.READ, nsid=1, cdw10=8 * i, cdw12=7), read_len=4096) for i in range(count)]
        io.flush = flush   # type: ignore[method-assign]
        io.flush()
        results = await asyncio.wait_for(asyncio.gather(*writes, *reads), 20)
        assert all(r.status == 0 for r in results)
        assert [r.data for r in results[count:]] == blocks
        assert conn.fast_commands - done == 2 * count     # every command took the fast path
        assert len(receives) - before >= count            # ... a write per batch at most
        assert not conn._held and not conn._carry
        admin.close()
        io.close()
    finally:
        await server.stop()
        await tgt.close()
