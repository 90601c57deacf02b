"""R2T writes on the batch engine's fast path (target/transports/tcp_batch.py).

The batch engine sends the R2T of a Write itself and finishes the write inline once its H2CData is in;
the H2CData is still checked by the sans-IO ``TcpConnection`` (nvmeof/tcp.py, the one statement of the
rules). These tests show:

- 128 KiB and 1 MiB writes (one H2CData per MAXH2CDATA) land whole and read back, through the fast path
  (no Task), with H2CData cut at any byte;
- a bad H2CData for a fast-path write (wrong ttag or cccid, out of order, past the R2T, beyond MAXH2CDATA,
  LAST too early) gets exactly the C2HTermReq (FES, FEI) a bare sans-IO controller gives for the same
  bytes, and the write's budget comes back;
- the engine reads those H2CData headers with one struct (``H2C_FAST``, equal to the construct layout) and
  takes them without the sans-IO events, received straight into the write's buffer when cut; anything but
  the exact expected header (flags, hlen, pdo, plen, datal, ttag, cccid, datao, LAST), also after PDUs it
  took, goes to the sans-IO path, whose TermReq is the one sent;
- with digests the write takes the stream engine and its data still lands;
- a backend that cannot take the data inline gets the write through the command lifecycle.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, NamedTuple

import pytest
from raw_pdu import (
    SUBNQN,
    RawPeer,
    admin_host,
    capsule_cmd,
    connect_pdu,
    h2c_data,
    rw_capsule,
    serve,
    sqe,
    wait_until,
)

from nvmeof import defaults
from nvmeof.spec import tcp as spec
from nvmeof.spec.nvme import Command, IoOpcode
from nvmeof.tcp import ProtocolError, Role, TcpConnection
from target.transports import tcp_batch
from target.transports.tcp import TcpPort

MAXH2C = defaults.MAXH2CDATA
TCP_RECV_MAX = defaults.TCP_RECV_BUFFER_MAX


@pytest.fixture
async def served():
    s = await serve(ns_size=8 << 20)
    yield s
    await s.target.close()


async def _io_peer(s: Any, *, hdgst: bool = False, ddgst: bool = False) -> tuple[Any, RawPeer, Any]:
    admin, cntlid = await admin_host(s.port)
    peer = await RawPeer.open(s.port)
    await peer.handshake(hdgst=hdgst, ddgst=ddgst)
    res = await peer.command(connect_pdu(1, SUBNQN, qid=1, cntlid=cntlid, hdgst=hdgst, ddgst=ddgst), 1)
    assert res.status_code == 0
    conn = next(c for c in s.server.connections if c.queue.qid == 1 and c.queue.ctrl
                and c.queue.ctrl.cntlid == cntlid)
    return admin, peer, conn


async def _r2t(peer: RawPeer, cid: int) -> Any:
    assert await peer.wait_for(lambda o: o.r2t(cid), 5), f"no R2T for cid {cid}"
    r2t = peer.out.r2t(cid)
    assert r2t is not None, peer.out.pdus[-1:]
    return r2t.fields


async def _read_back(peer: RawPeer, cid: int, slba: int, size: int) -> bytes:
    cqe = await peer.command(rw_capsule(IoOpcode.READ, cid, slba, size), cid)
    assert cqe.status_code == 0
    return peer.out.read_data(cid)


@pytest.mark.parametrize("size", [128 * 1024, 1 << 20])
@pytest.mark.parametrize("cut", [False, True])
async def test_large_writes_take_the_fast_path_and_land(served, size, cut):
    admin, peer, conn = await _io_peer(served)
    tasks = conn._tasks
    before = conn.fast_commands
    slow: list[Any] = []
    sansio = conn._on_h2c_data
    conn._on_h2c_data = lambda event: (slow.append(event.ttag), sansio(event))
    blocks = size // 512
    written = []
    for i, cid in enumerate((3, 5, 7)):   # the later writes reuse the first ones' buffers
        data = os.urandom(size)
        written.append(data)
        await peer.send(rw_capsule(IoOpcode.WRITE, cid, 64 + i * blocks, size))
        r2t = await _r2t(peer, cid)
        assert (r2t["offset"], r2t["length"]) == (0, size)   # one R2T for all of it (MAXR2T 0)
        assert type(conn._h2c[r2t["ttag"]]) is tcp_batch._FastWrite and not tasks
        pdus = b"".join(h2c_data(cid, r2t["ttag"], off, data[off:off + MAXH2C], last=off + MAXH2C >= size)
                        for off in range(0, size, MAXH2C))
        await peer.send(pdus, [1, 7, 23, 1000, 17000, 40000, 5] * 30 if cut else None)
        assert await peer.wait_for(lambda o, cid=cid: o.done(cid), 5)
        assert peer.out.cqe(cid).status_code == 0
    assert conn.fast_commands == before + 3 and not conn._h2c and conn._h2c_bytes == 0
    # the engine took every H2CData itself, cut or not: no sans-IO data event for a fast write
    assert not slow, slow
    for i, data in enumerate(written):
        assert await _read_back(peer, 10 + i, 64 + i * blocks, size) == data
    assert not peer.out.errors
    admin.close()
    await peer.close()


def test_h2c_layout_equals_construct() -> None:
    for flags in (0, spec.DATA_LAST):
        pdu = spec.DataPduHeader.build({"ch": {"type": spec.PduType.H2C_DATA, "flags": flags, "hlen": 24, "pdo": 24,
                                               "plen": 24 + 8192}, "cccid": 77, "ttag": 513, "datao": 4096,
                                        "datal": 8192})
        head, plen, cccid, ttag, datao, datal = tcp_batch.H2C_FAST.unpack_from(pdu)
        assert head == (tcp_batch._H2C_HEAD_LAST if flags else tcp_batch._H2C_HEAD)
        assert head == int.from_bytes(pdu[:4], "little") and pdu[:4] == bytes([spec.PduType.H2C_DATA, flags, 24, 24])
        assert (plen, cccid, ttag, datao, datal) == (24 + 8192, 77, 513, 4096, 8192)
    assert tcp_batch.H2C_FAST.size <= spec.DATA_PDU_HEADER_SIZE


def _hdr(cid: int, ttag: int, *, flags: int = 0, hlen: int = 24, pdo: int = 24, plen: int | None = None,
         datao: int = 0, datal: int = 512) -> bytes:
    plen = pdo + datal if plen is None else plen
    return spec.DATA_PDU_HDR.pack(spec.PduType.H2C_DATA.value, flags, hlen, pdo, plen, cid, ttag, datao, datal)


def _bad_h2c(kind: str, cid: int, ttag: int, size: int) -> bytes:
    half = size // 2
    good = h2c_data(cid, ttag, 0, bytes(half), last=False)
    if kind == "hdgstf":
        return _hdr(cid, ttag, flags=spec.HDGSTF) + bytes(512)
    if kind == "ddgstf":
        return _hdr(cid, ttag, flags=spec.DDGSTF) + bytes(512)
    if kind == "hlen":
        return _hdr(cid, ttag, hlen=28) + bytes(512)
    if kind == "pdo":
        return _hdr(cid, ttag, pdo=28) + bytes(512)
    if kind == "plen_vs_datal":
        return _hdr(cid, ttag, plen=24 + 1024) + bytes(1024)
    if kind == "datal_0":
        return _hdr(cid, ttag, plen=24 + 512, datal=0) + bytes(512)
    if kind == "second_out_of_order":   # the first one is taken by the engine: the sans-IO state must follow
        return good + h2c_data(cid, ttag, 0, bytes(512), last=False)
    if kind == "second_past_the_r2t":
        return good + h2c_data(cid, ttag, half, bytes(half + 512), last=True)
    if kind == "second_wrong_cccid":
        return good + h2c_data(cid + 1, ttag, half, bytes(512), last=False)
    if kind == "second_last_too_early":
        return good + h2c_data(cid, ttag, half, bytes(512), last=True)
    if kind == "cut_then_out_of_order":   # the first one is cut and received into the buffer (see _send_bad)
        return good + h2c_data(cid, ttag, half + 512, bytes(512), last=False)
    if kind == "wrong_ttag":
        return h2c_data(cid, ttag + 1, 0, bytes(512), last=False)
    if kind == "wrong_cccid":
        return h2c_data(cid + 1, ttag, 0, bytes(512), last=False)
    if kind == "out_of_order":
        return h2c_data(cid, ttag, 4096, bytes(512), last=False)
    if kind == "past_the_r2t":
        return h2c_data(cid, ttag, 0, bytes(size + 512), last=True)
    if kind == "last_too_early":
        return h2c_data(cid, ttag, 0, bytes(4096), last=True)
    assert kind == "beyond_maxh2cdata"
    hdr = spec.DATA_PDU_HDR.pack(spec.PduType.H2C_DATA.value, spec.DATA_LAST, 24, 24, 24 + MAXH2C + 4096, cid, ttag,
                                 0, MAXH2C + 4096)
    return hdr + bytes(512)   # the header is enough to be refused


def _sansio_verdict(cid: int, ttag: int, size: int, bad: bytes) -> tuple[int, int]:
    """What nvmeof/tcp.py says of ``bad`` after the same R2T: the (FES, FEI) the target must send."""
    ctrl = TcpConnection(Role.CONTROLLER)
    host = TcpConnection(Role.HOST)
    host.send_icreq()
    ctrl.receive_data(b"".join(bytes(b) for b in host.data_to_send()))
    ctrl.send_icresp()
    host.receive_data(b"".join(bytes(b) for b in ctrl.data_to_send()))
    ctrl.send_r2t(cid, ttag, 0, size)
    events = ctrl.receive_data(bad)
    [err] = [e for e in events if isinstance(e, ProtocolError)]
    return err.fes, err.fei


@pytest.mark.parametrize("kind", ["wrong_ttag", "wrong_cccid", "out_of_order", "past_the_r2t", "last_too_early",
                                  "beyond_maxh2cdata", "hdgstf", "ddgstf", "hlen", "pdo", "plen_vs_datal", "datal_0",
                                  "second_out_of_order", "second_past_the_r2t", "second_wrong_cccid",
                                  "second_last_too_early", "cut_then_out_of_order"])
async def test_bad_h2c_for_a_fast_write_is_refused_as_the_sansio_layer_says(served, kind):
    s = served
    admin, peer, conn = await _io_peer(s)
    size = 64 * 1024
    await peer.send(rw_capsule(IoOpcode.WRITE, 3, 0, size))
    r2t = await _r2t(peer, 3)
    ttag = r2t["ttag"]
    assert type(conn._h2c[ttag]) is tcp_batch._FastWrite
    bad = _bad_h2c(kind, 3, ttag, size)
    if kind.startswith("cut"):
        # the first PDU's header and a little of its payload; the rest (over 16 KiB) goes straight to the buffer
        await peer.send(bad[:24 + 1000])
        await wait_until(lambda: conn._h2c_dest is not None, what="the cut H2CData to be taken")
        bad_rest = bad[24 + 1000:]
        await peer.send(bad_rest)
    else:
        await peer.send(bad)
    assert await peer.wait_eof(5), "the target did not close"
    term = peer.out.term
    assert term is not None, peer.out.pdus[-1:]
    assert (term.fields["fes"], term.fields["fei"]) == _sansio_verdict(3, ttag, size, bad)
    assert peer.out.cqe(3) is None   # the write is dropped with the connection
    await wait_until(lambda: conn not in s.server.connections, what="the queue to go")
    assert not conn._h2c and conn._h2c_bytes == 0 and TcpPort.of(s.target).h2c.used == 0
    admin.close()


@pytest.mark.parametrize("digests", [(True, False), (False, True), (True, True)])
async def test_with_digests_r2t_writes_take_the_stream_engine(served, digests):
    hdgst, ddgst = digests
    admin, peer, conn = await _io_peer(served, hdgst=hdgst, ddgst=ddgst)
    size = 256 * 1024
    data = os.urandom(size)
    await peer.send(capsule_cmd(sqe(Command(IoOpcode.WRITE, nsid=1, cdw10=8, cdw12=size // 512 - 1), cid=5,
                                    data_len=size), hdgst=hdgst, ddgst=ddgst))
    r2t = await _r2t(peer, 5)
    assert type(conn._h2c[r2t["ttag"]]) is not tcp_batch._FastWrite
    await peer.send(b"".join(h2c_data(5, r2t["ttag"], off, data[off:off + MAXH2C], last=off + MAXH2C >= size,
                                      hdgst=hdgst, ddgst=ddgst) for off in range(0, size, MAXH2C)))
    assert await peer.wait_for(lambda o: o.done(5), 5)
    assert peer.out.cqe(5).status_code == 0 and not peer.out.errors
    disk = served.target.subsystems[SUBNQN].namespaces[1].backend.memory_view()
    assert bytes(disk[8 * 512:8 * 512 + size]) == data
    admin.close()
    await peer.close()


async def test_a_backend_that_would_wait_gets_the_write_through_the_lifecycle(served, monkeypatch):
    s = served
    admin, peer, conn = await _io_peer(s)
    backend = s.target.subsystems[SUBNQN].namespaces[1].backend
    disk = backend.memory_view()
    # a backend that would wait is not memory either (a cut write is otherwise received into a RAM disk)
    monkeypatch.setattr(backend, "write_nowait", lambda *a, **k: False)
    monkeypatch.setattr(backend, "memory_view", lambda: None)
    size = 128 * 1024
    data = os.urandom(size)
    await peer.send(rw_capsule(IoOpcode.WRITE, 3, 16, size))
    r2t = await _r2t(peer, 3)
    assert type(conn._h2c[r2t["ttag"]]) is tcp_batch._FastWrite
    before = conn.fast_commands
    await peer.send(h2c_data(3, r2t["ttag"], 0, data, last=True))
    assert await peer.wait_for(lambda o: o.done(3), 5)
    cqe = peer.out.cqe(3)
    assert cqe.status_code == 0 and conn.fast_commands == before
    await wait_until(lambda: conn._h2c_bytes == 0 and not conn._tasks, what="the write's budget to come back")
    assert bytes(disk[16 * 512:16 * 512 + size]) == data
    admin.close()
    await peer.close()


# --- a RAM disk's write received straight into the disk -------------------------------------------------

BLOCK = 512


def _inq(conn: Any) -> int:
    """The bytes the target's socket still holds (what it has not received yet)."""
    import fcntl
    import struct
    import termios

    buf = bytearray(4)
    fcntl.ioctl(conn.transport._fd, termios.FIONREAD, buf, True)
    return struct.unpack("i", buf)[0]


def _torn(disk: memoryview, start: int, old: bytes, new: bytes) -> list[int]:
    """The blocks of ``disk[start:]`` that are neither all ``old`` nor all ``new``."""
    now = bytes(disk[start:start + len(new)])
    return [b for b in range(0, len(new), BLOCK)
            if now[b:b + BLOCK] != old[b:b + BLOCK] and now[b:b + BLOCK] != new[b:b + BLOCK]]


async def _send_cut(peer: RawPeer, conn: Any, wire: bytes, cuts: list[int], check: Any) -> None:
    """``wire`` in pieces ending at ``cuts``, each taken by the target (its socket empty again, the loop
    run) before ``check(sent)`` looks at the disk, as any read between two callbacks would."""
    pos = 0
    for cut in cuts:
        await peer.send(wire[pos:cut])
        pos = cut
        await wait_until(lambda: _inq(conn) == 0, what="the target to take the piece")
        for _ in range(5):
            await asyncio.sleep(0)
        check(pos)
    await peer.send(wire[pos:])


# payload bytes at which the pieces end: block boundaries and the middle of blocks, one piece over
# several blocks, pieces shorter than a block, one ending a byte before a block's end
_CUTS = [700, 1024, 1500, 1501, 4096 + 3, 4096 + 511, 40000, 40001, 65536, 100000 + 7, 131071]


async def test_a_cut_write_lands_in_the_ram_disk_a_whole_block_at_a_time(served):
    """A RAM disk's 128 KiB write in one H2CData, cut at any byte: the payload is received into the disk
    itself (no copy out of a write buffer), and between two callbacks of the loop, where any read runs,
    every block of its range is all old or all new (single-block atomicity, AWUN 0)."""
    slba = 256
    admin, peer, conn, _ns, disk, start, size, old, new, wire = await _write_after_r2t(served, 3, slba)
    seen_new: list[int] = []

    def check(sent: int) -> None:
        assert not _torn(disk, start, old, new), f"a torn block with {sent} bytes sent"
        now = bytes(disk[start:start + size])
        seen_new.append(sum(now[b:b + BLOCK] == new[b:b + BLOCK] for b in range(0, size, BLOCK)))

    await _send_cut(peer, conn, wire, [24 + c for c in _CUTS], check)
    assert await peer.wait_for(lambda o: o.done(3), 5)
    assert peer.out.cqe(3).status_code == 0 and not peer.out.errors
    assert bytes(disk[start:start + size]) == new
    # the disk took the data as it came (in whole blocks), not at the end in one copy
    assert seen_new[0] == 700 // BLOCK and seen_new[-2] == 100000 // BLOCK and seen_new[-1] == 131071 // BLOCK
    assert not conn._h2c and conn._h2c_bytes == 0 and conn._h2c_dest is None and not conn._h2c_bs
    assert await _read_back(peer, 9, slba, size) == new
    admin.close()
    await peer.close()


class _Write(NamedTuple):
    admin: Any
    peer: RawPeer
    conn: Any
    ns: Any
    disk: memoryview   # namespace 1's RAM disk
    start: int         # the write's first byte in it
    size: int
    old: bytes         # what the range holds before the write
    new: bytes         # the write's data
    wire: bytes        # its H2CData PDU


async def _write_after_r2t(s: Any, cid: int, slba: int) -> _Write:
    """A 128 KiB write of random data to namespace 1 at ``slba`` from a raw host, sent up to its R2T (the
    data not yet)."""
    admin, peer, conn = await _io_peer(s)
    ns = s.target.subsystems[SUBNQN].namespaces[1]
    disk = ns.backend.memory_view()
    size, start = 128 * 1024, slba * BLOCK
    old, new = bytes(disk[start:start + size]), os.urandom(size)
    await peer.send(rw_capsule(IoOpcode.WRITE, cid, slba, size))
    r2t = await _r2t(peer, cid)
    return _Write(admin, peer, conn, ns, disk, start, size, old, new, h2c_data(cid, r2t["ttag"], 0, new, last=True))


async def test_a_namespace_changed_under_a_write_in_the_disk_takes_the_buffered_road(served):
    """A namespace disabled while a write is received into it: nothing more is placed in the disk, what
    came so far moves to a write buffer, and the write ends as the lifecycle judges it (refused)."""
    admin, peer, conn, ns, disk, start, size, old, new, wire = await _write_after_r2t(served, 5, 512)
    placed = 0

    def check(sent: int) -> None:
        nonlocal placed
        if sent == 24 + 5000:
            now = bytes(disk[start:start + size])
            placed = sum(now[b:b + BLOCK] == new[b:b + BLOCK] for b in range(0, size, BLOCK)) * BLOCK
            ns.enabled = False

    await _send_cut(peer, conn, wire, [24 + 5000, 24 + 5300, 24 + 70000], check)
    assert await peer.wait_for(lambda o: o.done(5), 5)
    assert peer.out.cqe(5).status_code != 0   # the lifecycle refuses a write to a disabled namespace
    assert placed == 4608   # the nine whole blocks that came before the change
    assert bytes(disk[start + placed:start + size]) == old[placed:]
    await wait_until(lambda: conn._h2c_bytes == 0 and not conn._tasks, what="the write's budget to come back")
    assert not conn._h2c_bs and conn._h2c_dest is None
    admin.close()
    await peer.close()


async def test_a_write_whose_data_is_all_there_is_still_received_into_the_disk(served, monkeypatch):
    """While R2Ts wait for data a read takes at most an H2CData header and 4 KiB, even into a grown receive
    buffer and with (most of) the 128 KiB PDU waiting in the socket: the rest is received into the RAM
    disk: 4 KiB are copied out of the receive buffer, the backend copies nothing (write_nowait), and the
    receive that took the header took what was waiting behind it as well (no second trip through the loop)."""
    admin, peer, conn = await _io_peer(served)
    backend = served.target.subsystems[SUBNQN].namespaces[1].backend
    copies: list[int] = []   # payload bytes copied: by the backend, or out of the receive buffer into the disk
    write_nowait = backend.write_nowait
    monkeypatch.setattr(backend, "write_nowait", lambda offset, data, **k: copies.append(len(data))
                        or write_nowait(offset, data, **k))
    place = conn._h2c_place
    monkeypatch.setattr(conn, "_h2c_place", lambda fw, data: copies.append(len(data)) or place(fw, data))
    size, slba = 128 * 1024, 1024
    for cid in (3, 4):
        data = os.urandom(size)
        await peer.send(rw_capsule(IoOpcode.WRITE, cid, slba, size))
        r2t = await _r2t(peer, cid)
        conn._recv = memoryview(bytearray(TCP_RECV_MAX))   # as after reads that filled it
        conn.transport.pause_reading()
        await peer.send(h2c_data(cid, r2t["ttag"], 0, data, last=True))
        # what the socket takes before its window closes (about 128 KB here), so most of the PDU
        await wait_until(lambda: _inq(conn) >= 64 * 1024, what="the PDU in the target's socket")
        await asyncio.sleep(0.05)
        waiting = _inq(conn) - 24
        left: list[int] = []   # payload bytes still to come after each of the transport's receives
        recv_once = conn.transport._recv_once
        monkeypatch.setattr(conn.transport, "_recv_once", lambda recv_once=recv_once, left=left: (
            recv_once(), left.append(0 if conn._h2c_fw is None else conn._h2c_stop - conn._h2c_fw.received))[0])
        conn.transport.resume_reading()
        assert await peer.wait_for(lambda o, cid=cid: o.done(cid), 5)
        assert peer.out.cqe(cid).status_code == 0
        # the receive that took the header (and 4 KiB) took the whole blocks waiting behind it too, into the disk
        assert left[0] <= size - waiting + waiting % BLOCK, (left, waiting)
        monkeypatch.setattr(conn.transport, "_recv_once", recv_once)
        assert await _read_back(peer, 10 + cid, slba, size) == data
    assert copies == [4096, 4096], copies
    admin.close()
    await peer.close()


async def test_a_reservation_taken_before_the_data_keeps_a_write_out_of_the_disk(served):
    """Another host reserves the namespace (Write Exclusive) between a write's R2T and its data: nothing is
    received into the disk (the buffered road), and io.parse's check refuses the write when it executes."""
    from target.reservations import ReservationState

    admin, peer, conn, ns, disk, start, size, old, _new, wire = await _write_after_r2t(served, 6, 768)
    other = b"\xee" * 16   # not the raw host's hostid
    ns.pr = ReservationState(generation=1, registrants=((other, 7),), rtype=1, holder=other)

    def check(sent: int) -> None:
        assert bytes(disk[start:start + size]) == old, f"the disk changed with {sent} bytes sent"

    await _send_cut(peer, conn, wire, [24 + 5000, 24 + 70000], check)
    assert await peer.wait_for(lambda o: o.done(6), 5)
    assert peer.out.cqe(6).status_code == 0x83   # Reservation Conflict
    assert bytes(disk[start:start + size]) == old
    admin.close()
    await peer.close()


async def test_a_namespace_made_read_only_before_the_data_refuses_the_write(served, monkeypatch):
    """The namespace is made read-only between a write's R2T and its data, on the buffered road (a backend
    with no memory view): the write is judged again by the lifecycle and refused, as it is when the data is
    received into the disk (_h2c_unchanged) and as a disabled namespace is; the disk keeps its data."""
    admin, peer, conn = await _io_peer(served)
    ns = served.target.subsystems[SUBNQN].namespaces[1]
    disk = ns.backend.memory_view()
    monkeypatch.setattr(ns.backend, "memory_view", lambda: None)
    size, slba = 128 * 1024, 1024
    start = slba * BLOCK
    old = bytes(disk[start:start + size])
    new = os.urandom(size)
    await peer.send(rw_capsule(IoOpcode.WRITE, 7, slba, size))
    r2t = await _r2t(peer, 7)
    assert type(conn._h2c[r2t["ttag"]]) is tcp_batch._FastWrite
    monkeypatch.setattr(ns, "read_only", True)
    await peer.send(h2c_data(7, r2t["ttag"], 0, new, last=True))
    assert await peer.wait_for(lambda o: o.done(7), 5)
    assert peer.out.cqe(7).status_code == 0x20   # Namespace is Write Protected
    assert bytes(disk[start:start + size]) == old
    await wait_until(lambda: conn._h2c_bytes == 0 and not conn._tasks, what="the write's budget to come back")
    admin.close()
    await peer.close()


class _ShortSocket:
    """The target's socket, but a receive into the disk returns ``short`` bytes fewer than asked (the rest
    stays in the socket): what FIONREAD rules out on Linux TCP (see tcp_batch._h2c_disk_buffer), forced here.
    After each such receive ``check`` runs as the loop's next callback, where any read of the disk may run."""

    def __init__(self, sock: Any, disk: memoryview, short: int, check: Any) -> None:
        self._sock = sock
        self._disk = disk.obj
        self.short = short
        self.check = check
        self.cut = 0

    def recv_into(self, buf: Any, nbytes: int = 0, flags: int = 0) -> int:
        n = nbytes or len(buf)
        if flags or not isinstance(buf, memoryview):
            return self._sock.recv_into(buf, nbytes, flags)
        if buf.obj is self._disk and n > self.short:
            self.cut += 1
            asyncio.get_running_loop().call_soon(self.check, self.cut)
            n -= self.short
        return self._sock.recv_into(buf, n)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


async def test_a_short_receive_into_the_disk_leaves_no_torn_block(served):
    """A receive into the disk that returns less than FIONREAD said, ending inside a block: that block is
    finished (its rest received) before the callback ends, so the next callback, where a read may run, sees
    every block all old or all new; the write lands whole."""
    slba = 2048
    admin, peer, conn, _ns, disk, start, size, old, new, wire = await _write_after_r2t(served, 3, slba)
    torn: list[tuple[int, list[int]]] = []
    transport = conn.transport
    short = _ShortSocket(transport._sock, disk, 300, lambda cut: torn.append((cut, _torn(disk, start, old, new))))
    transport._sock = short
    try:
        await _send_cut(peer, conn, wire, [24 + 700, 24 + 40000, 24 + 100000], lambda sent: None)
        assert await peer.wait_for(lambda o: o.done(3), 5)
    finally:
        transport._sock = short._sock
    assert peer.out.cqe(3).status_code == 0 and not peer.out.errors
    assert short.cut >= 2, short.cut   # receives into the disk were cut
    assert [t for t in torn if t[1]] == [], torn
    assert bytes(disk[start:start + size]) == new
    assert await _read_back(peer, 9, slba, size) == new
    admin.close()
    await peer.close()


# --- writes of several H2CData, each received into the disk ----------------------------------------------


def _h2cs(cid: int, ttag: int, data: bytes, pdu: int) -> list[bytes]:
    return [h2c_data(cid, ttag, off, data[off:off + pdu], last=off + pdu >= len(data))
            for off in range(0, len(data), pdu)]


@pytest.mark.parametrize("pdu", [MAXH2C, 5000])   # 5000: blocks cut by the ends of H2CData
async def test_a_write_of_several_h2c_lands_in_the_ram_disk_a_whole_block_at_a_time(served, monkeypatch, pdu):
    """A RAM disk's 1 MiB write in several H2CData (MAXH2CDATA is 128 KiB), cut at any byte: each H2CData is
    received into the disk itself (no write buffer taken, the disk changes while the data comes), and between
    two callbacks every block of the range is all old or all new, also a block that two H2CData share."""
    admin, peer, conn = await _io_peer(served)
    disk = served.target.subsystems[SUBNQN].namespaces[1].backend.memory_view()
    wbufs: list[int] = []
    take_wbuf = conn._take_wbuf
    monkeypatch.setattr(conn, "_take_wbuf", lambda length: wbufs.append(length) or take_wbuf(length))
    size, slba = 1 << 20, 4096
    start = slba * BLOCK
    old = os.urandom(size)
    disk[start:start + size] = old
    new = os.urandom(size)
    await peer.send(rw_capsule(IoOpcode.WRITE, 3, slba, size))
    r2t = await _r2t(peer, 3)
    wire = b"".join(_h2cs(3, r2t["ttag"], new, pdu))
    seen_new: list[int] = []

    def check(sent: int) -> None:
        assert not _torn(disk, start, old, new), f"a torn block with {sent} bytes sent"
        now = bytes(disk[start:start + size])
        seen_new.append(sum(now[b:b + BLOCK] == new[b:b + BLOCK] for b in range(0, size, BLOCK)))

    cuts = [700, 5023, 5100, 131072 + 24 + 1, 131072 + 48 + 7000, 300001, 524288 + 99, 1000000, len(wire) - 1]
    await _send_cut(peer, conn, wire, cuts, check)
    assert await peer.wait_for(lambda o: o.done(3), 5)
    assert peer.out.cqe(3).status_code == 0 and not peer.out.errors
    assert bytes(disk[start:start + size]) == new
    assert not wbufs, wbufs   # no write buffer: nothing took the buffered road
    assert 0 < seen_new[2] < seen_new[5] < seen_new[-1] < size // BLOCK, seen_new   # the disk took it as it came
    assert not conn._h2c and conn._h2c_bytes == 0 and conn._h2c_dest is None and not conn._h2c_bs
    assert await _read_back(peer, 9, slba, size) == new
    admin.close()
    await peer.close()


async def test_interleaved_h2c_of_two_writes_both_land_in_the_disk(served, monkeypatch):
    """H2CData of two writes interleaved (the protocol allows it), each cutting a block the next one of its
    write finishes: each write keeps its own cut block (its tail) between its H2CData; both land, no buffer."""
    admin, peer, conn = await _io_peer(served)
    disk = served.target.subsystems[SUBNQN].namespaces[1].backend.memory_view()
    wbufs: list[int] = []
    take_wbuf = conn._take_wbuf
    monkeypatch.setattr(conn, "_take_wbuf", lambda length: wbufs.append(length) or take_wbuf(length))
    size = 256 * 1024
    news = {3: os.urandom(size), 4: os.urandom(size)}
    pdus = {}
    for cid, slba in ((3, 8192), (4, 9216)):
        await peer.send(rw_capsule(IoOpcode.WRITE, cid, slba, size))
        pdus[cid] = _h2cs(cid, (await _r2t(peer, cid))["ttag"], news[cid], 100_001)
    for a, b in zip(pdus[3], pdus[4], strict=True):
        await peer.send(a + b, [77, 40000])
    for cid, slba in ((3, 8192), (4, 9216)):
        assert await peer.wait_for(lambda o, cid=cid: o.done(cid), 5)
        assert peer.out.cqe(cid).status_code == 0
        assert bytes(disk[slba * BLOCK:slba * BLOCK + size]) == news[cid]
    assert not wbufs and not peer.out.errors
    admin.close()
    await peer.close()


async def test_an_h2c_the_sansio_path_takes_moves_a_write_from_the_disk_to_a_buffer(served, monkeypatch):
    """The first H2CData of a write was received into the disk; the next one goes through the sans-IO
    connection (the fast path is not ready for it): what was placed, and the block the first one cut, move to
    the write's buffer, and the write lands whole from there."""
    admin, peer, conn = await _io_peer(served)
    disk = served.target.subsystems[SUBNQN].namespaces[1].backend.memory_view()
    size, slba = 256 * 1024, 10240
    new = os.urandom(size)
    await peer.send(rw_capsule(IoOpcode.WRITE, 5, slba, size))
    ttag = (await _r2t(peer, 5))["ttag"]
    pdus = _h2cs(5, ttag, new, 131_000)   # 131,000 bytes: the first one cuts a block
    await peer.send(pdus[0])
    fw = conn._h2c[ttag]
    await wait_until(lambda: fw.received == 131_000, what="the first H2CData")
    assert fw.span is not None and fw.tail is not None and fw.buf is None   # in the disk, a cut block aside
    unplaced: list[int] = []
    unplace = conn._h2c_unplace
    monkeypatch.setattr(conn, "_h2c_unplace", lambda fw, have, staged: unplaced.append(have)
                        or unplace(fw, have, staged))
    monkeypatch.setattr(conn, "_fast_ready", lambda: False)
    await peer.send(b"".join(pdus[1:]))
    assert await peer.wait_for(lambda o: o.done(5), 5)
    assert unplaced == [131_000]
    assert peer.out.cqe(5).status_code == 0 and not peer.out.errors
    assert bytes(disk[slba * BLOCK:slba * BLOCK + size]) == new
    admin.close()
    await peer.close()


async def test_reads_while_an_r2t_waits_are_not_cut_to_the_first_read(served, monkeypatch):
    """While a write's R2T waits for its data, a read from a PDU boundary is cut to an H2CData header and 4 KiB
    only when the socket's next PDU is a large H2CData of a fast-path write (its header peeked at): capsules of
    other commands queued first, or a small H2CData, are taken in one receive as without R2Ts; the large
    H2CData's read is still cut (the rest goes into the disk)."""
    admin, peer, conn = await _io_peer(served)
    size = 128 * 1024
    await peer.send(rw_capsule(IoOpcode.WRITE, 3, 64, size))
    ttag = (await _r2t(peer, 3))["ttag"]
    await peer.send(rw_capsule(IoOpcode.WRITE, 4, 1024, 16384))
    ttag4 = (await _r2t(peer, 4))["ttag"]
    reads: list[int] = []
    updated = conn.buffer_updated
    monkeypatch.setattr(conn, "buffer_updated", lambda n: reads.append(n) or updated(n))

    async def burst(wire: bytes) -> None:
        reads.clear()
        conn.transport.pause_reading()
        await peer.send(wire)
        # (all of it, or what the socket takes before its window closes: about 128 KB here)
        await wait_until(lambda: _inq(conn) >= min(len(wire), 64 * 1024), what="the burst in the target's socket")
        await asyncio.sleep(0.05)
        conn.transport.resume_reading()
        await wait_until(lambda: _inq(conn) == 0, what="the target to take the burst")

    capsules = b"".join(rw_capsule(IoOpcode.READ, 100 + i, i * 8, 4096) for i in range(80))   # 5,760 bytes
    await burst(capsules)
    assert reads[0] == len(capsules), reads
    for i in range(80):
        assert await peer.wait_for(lambda o, i=i: o.done(100 + i), 5)
    small = os.urandom(16384)
    await burst(h2c_data(4, ttag4, 0, small, last=True))
    assert reads[0] > 24 + 4096, reads   # (as much as the receive buffer holds)
    data = os.urandom(size)
    await burst(h2c_data(3, ttag, 0, data, last=True))
    assert reads[0] == 24 + 4096, reads
    for cid in (3, 4):
        assert await peer.wait_for(lambda o, cid=cid: o.done(cid), 5)
        assert peer.out.cqe(cid).status_code == 0
    assert await _read_back(peer, 9, 64, size) == data and await _read_back(peer, 10, 1024, 16384) == small
    admin.close()
    await peer.close()


async def test_the_next_h2c_of_a_write_in_the_disk_is_read_without_a_peek(served, monkeypatch):
    """Once an H2CData of a write received into the disk ends with more of the write due, the next read is cut
    to the first read without peeking at the socket: a 1 MiB write in eight H2CData peeks once, not eight times."""
    admin, peer, conn = await _io_peer(served)
    peeks: list[bool] = []
    peek = conn._h2c_next_is_large
    monkeypatch.setattr(conn, "_h2c_next_is_large", lambda: peeks.append(peek()) or peeks[-1])
    size, slba = 1 << 20, 6144
    data = os.urandom(size)
    await peer.send(rw_capsule(IoOpcode.WRITE, 3, slba, size))
    ttag = (await _r2t(peer, 3))["ttag"]
    await peer.send(b"".join(_h2cs(3, ttag, data, MAXH2C)))
    assert await peer.wait_for(lambda o: o.done(3), 5)
    assert peer.out.cqe(3).status_code == 0
    assert peeks == [True], peeks
    assert await _read_back(peer, 9, slba, size) == data
    admin.close()
    await peer.close()
