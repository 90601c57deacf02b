"""The target under load and under misbehaving hosts, over real TCP on 127.0.0.1.

Many hosts at once with verified data; a host that vanishes in the middle of a write; each rejected
command with its precise status and the log line naming the reason; keep-alive expiry of a silent
host while an active one keeps working.
"""

from __future__ import annotations

import asyncio
import logging
import os

import pytest
from raw_pdu import (
    SUBNQN,
    RawPeer,
    admin_host,
    capsule_cmd,
    connect_pdu,
    h2c_data,
    icreq,
    io_host,
    serve,
    sqe,
    wait_until,
    write_read_verify,
)
from target_host import HOSTNQN, open_tcp

from nvmeof.spec.fabrics import CONNECT_IATTR_DATA, Property
from nvmeof.spec.nvme import AdminOpcode, Command, IoOpcode
from nvmeof.status import Status

NS_BLOCKS = (16 << 20) // 512


@pytest.fixture
async def served():
    s = await serve(ns_size=16 << 20)
    yield s
    await s.target.close()


def _pending_tasks() -> set[asyncio.Task]:
    return {t for t in asyncio.all_tasks() if not t.done()}


async def _no_new_tasks(before: set[asyncio.Task]) -> None:
    me = asyncio.current_task()
    await wait_until(lambda: not (_pending_tasks() - before - {me}), what="the target's tasks to finish")


# ------------------------------------------------------------------------------------ many hosts

async def test_many_hosts_concurrent_io(served):
    """16 controllers with 2 I/O queues each write and read distinct regions at once; all data checks."""
    s = served
    nr_hosts, per_queue = 16, 4
    region = 128 * 1024                              # bytes per command; 4 commands per queue
    hosts = []
    for i in range(nr_hosts):
        digests = i % 2 == 1
        admin, cntlid = await admin_host(s.port, hdgst=digests, ddgst=digests)
        res = await admin.cmd(Command(AdminOpcode.SET_FEATURES, cdw10=0x07, cdw11=(1 << 16) | 1))
        assert res.status == 0 and res.cqe.dw0 == (1 << 16) | 1
        queues = [await io_host(s.port, cntlid, qid, hdgst=digests, ddgst=digests) for qid in (1, 2)]
        hosts.append((admin, cntlid, queues))
    assert len(s.target.controllers) == nr_hosts
    assert all(list(c.queues) == [0, 1, 2] for c in s.target.controllers.values())

    async def queue_job(q, index: int) -> dict[int, bytes]:  # type: ignore[no-untyped-def]
        base = index * per_queue * region // 512
        written = {}
        cmds = []
        for k in range(per_queue):
            # Mix in-capsule (8 KiB) and R2T writes (one or two H2CData PDUs).
            size = 8192 if k == 0 else region - k * 4096
            data = os.urandom(size)
            slba = base + k * region // 512
            written[slba] = data
            cmds.append(q.cmd(Command(IoOpcode.WRITE, nsid=1, cdw10=slba, cdw12=size // 512 - 1), data,
                              timeout=30))
        results = await asyncio.gather(*cmds)
        assert all(r.status == 0 for r in results), results
        reads = [q.cmd(Command(IoOpcode.READ, nsid=1, cdw10=slba, cdw12=len(d) // 512 - 1), read_len=len(d),
                       timeout=30) for slba, d in written.items()]
        for (slba, data), res in zip(written.items(), await asyncio.gather(*reads), strict=True):
            assert res.status == 0 and res.data == data, f"queue {index}: LBA {slba} read back wrong"
        return written

    jobs = [queue_job(q, 2 * i + j) for i, (_, _, queues) in enumerate(hosts) for j, q in enumerate(queues)]
    regions = await asyncio.gather(*jobs)
    assert (2 * nr_hosts * per_queue * region) // 512 <= NS_BLOCKS
    # Every region is on the namespace: read each one back through a different host.
    for index, written in enumerate(regions):
        other = hosts[(index // 2 + 1) % nr_hosts][2][index % 2]
        for slba, data in written.items():
            res = await other.cmd(Command(IoOpcode.READ, nsid=1, cdw10=slba, cdw12=len(data) // 512 - 1),
                                  read_len=len(data))
            assert res.status == 0 and res.data == data
    for admin, _, queues in hosts:
        for q in (admin, *queues):
            q.close()
    await wait_until(lambda: not s.target.controllers and not s.server.connections, what="all hosts to go")


# ---------------------------------------------------------------------------- vanishing hosts

async def _bystander(port: int, slba: int, stop: asyncio.Event, done: list[int]) -> None:
    """A host doing verified I/O in a loop until ``stop`` is set."""
    admin, cntlid = await admin_host(port)
    io = await io_host(port, cntlid, 1)
    try:
        while not stop.is_set():
            await write_read_verify(io, slba, os.urandom(64 * 1024), incapsule=False)
            await write_read_verify(io, slba + 256, os.urandom(4096), incapsule=True)
            done.append(1)
            await asyncio.sleep(0)
    finally:
        io.close()
        admin.close()


async def _start_partial_write(port: int, cntlid: int, *, size: int = 256 * 1024) -> RawPeer:
    """An I/O queue that sends a Write, gets its R2T and sends only part of one H2CData PDU."""
    peer = await RawPeer.open(port)
    await peer.handshake()
    assert (await peer.command(connect_pdu(1, SUBNQN, qid=1, cntlid=cntlid), 1)).status_code == 0
    write = sqe(Command(IoOpcode.WRITE, nsid=1, cdw10=4096, cdw12=size // 512 - 1), cid=2, data_len=size)
    await peer.send(capsule_cmd(write))
    assert await peer.wait_for(lambda o: o.r2t(2), 5)
    r2t = peer.out.r2t(2)
    assert r2t is not None and r2t.fields["length"] == size
    pdu = h2c_data(2, r2t.fields["ttag"], 0, os.urandom(65536), last=False)
    await peer.send(pdu[:24 + 30000])   # header and part of the data
    return peer


@pytest.mark.parametrize("how", ["abort", "fin"])
async def test_host_vanishing_mid_write_leaves_nothing(served, how):
    s = served
    stop = asyncio.Event()
    done: list[int] = []
    bystander = asyncio.create_task(_bystander(s.port, 0, stop, done))
    await wait_until(lambda: len(done) >= 1, what="the bystander to run")
    ctrls_before = set(s.target.controllers)
    tasks_before = _pending_tasks()

    admin, cntlid = await admin_host(s.port)
    peer = await _start_partial_write(s.port, cntlid)
    conn = next(c for c in s.server.connections if c.queue.qid == 1 and c.queue.ctrl
                and c.queue.ctrl.cntlid == cntlid)
    # the write waits for its data: a Task on the stream engine, a fast-path entry on the batch engine
    await wait_until(lambda: conn._h2c, what="the write to wait for its data")
    # The host vanishes: both its sockets go at once.
    await peer.close(abort=how == "abort")
    if how == "abort":
        assert admin.transport is not None
        admin.transport.abort()
    else:
        admin.close()
    await wait_until(lambda: cntlid not in s.target.controllers, what="the vanished host's controller to go")
    await wait_until(lambda: conn not in s.server.connections and not conn._tasks and not conn._h2c,
                     what="the vanished queue to be cleaned up")
    progress = len(done)
    await wait_until(lambda: len(done) > progress + 2, what="the bystander to keep going")
    stop.set()
    await bystander
    assert set(s.target.controllers) <= ctrls_before
    await wait_until(lambda: not s.target.controllers and not s.server.connections, what="everyone to go")
    await _no_new_tasks(tasks_before)


async def test_io_queue_vanishing_mid_write_keeps_the_controller(served, caplog):
    """Only the I/O queue dies: its queue and command go, the controller and its admin queue stay."""
    s = served
    caplog.set_level(logging.INFO)
    admin, cntlid = await admin_host(s.port)
    tasks_before = _pending_tasks()
    peer = await _start_partial_write(s.port, cntlid)
    await peer.close(abort=True)
    ctrl = s.target.controllers[cntlid]
    await wait_until(lambda: list(ctrl.queues) == [0] and len(s.server.connections) == 1,
                     what="qid 1 to be dropped")
    await _no_new_tasks(tasks_before)
    assert (await admin.prop_get(Property.CSTS)).cqe.dw0 & 1
    # The host reconnects qid 1 and the write goes through this time.
    io = await io_host(s.port, cntlid, 1)
    await write_read_verify(io, 4096, os.urandom(256 * 1024), incapsule=False)
    io.close()
    admin.close()
    await wait_until(lambda: not s.target.controllers, what="teardown")


async def test_host_vanishing_mid_pdu_header(served):
    """Closed inside a CapsuleCmd header: the connection goes, nothing was allocated for it."""
    s = served
    admin, cntlid = await admin_host(s.port)
    peer = await RawPeer.open(s.port)
    await peer.handshake()
    await peer.send(connect_pdu(1, SUBNQN, qid=1, cntlid=cntlid)[:40])
    await wait_until(lambda: any(c.conn._buf for c in s.server.connections), what="the partial PDU to arrive")
    await peer.close(abort=True)
    await wait_until(lambda: len(s.server.connections) == 1, what="the connection to go")
    assert list(s.target.controllers[cntlid].queues) == [0]
    admin.close()


# -------------------------------------------------------------------- rejected commands are precise

async def _io_pair(port: int):  # type: ignore[no-untyped-def]
    admin, cntlid = await admin_host(port)
    return admin, cntlid, await io_host(port, cntlid, 1)


async def test_lba_out_of_range(served, caplog):
    s = served
    caplog.set_level(logging.INFO)
    admin, _, io = await _io_pair(s.port)
    res = await io.cmd(Command(IoOpcode.READ, nsid=1, cdw10=NS_BLOCKS - 2, cdw12=3), read_len=2048)
    assert res.status == Status.LBA_RANGE and res.cqe.dnr and res.data is None
    assert f"LBA {NS_BLOCKS - 2}+4 ends past namespace 1's {NS_BLOCKS} blocks" in caplog.text
    # A large write past the end is refused before any R2T: no buffer, no data transfer.
    res = await io.cmd(Command(IoOpcode.WRITE, nsid=1, cdw10=NS_BLOCKS - 8, cdw12=255), bytes(128 * 1024),
                       incapsule=False)
    assert res.status == Status.LBA_RANGE and io.r2ts == []
    assert f"LBA {NS_BLOCKS - 8}+256 ends past namespace 1" in caplog.text
    # 64-bit SLBA that wraps nothing: slba near 2**64.
    res = await io.cmd(Command(IoOpcode.READ, nsid=1, cdw10=0xFFFFFFFF, cdw11=0xFFFFFFFF, cdw12=0), read_len=512)
    assert res.status == Status.LBA_RANGE
    await write_read_verify(io, 0, os.urandom(4096))
    io.close()
    admin.close()


async def test_unknown_opcode(served, caplog):
    s = served
    caplog.set_level(logging.INFO)
    admin, _, io = await _io_pair(s.port)
    res = await io.cmd(Command(0x7E, nsid=1))
    assert res.status == Status.INVALID_OPCODE and res.cqe.dnr
    assert "I/O opcode 0x7e is not supported" in caplog.text
    res = await admin.cmd(Command(0x3F))
    assert res.status == Status.INVALID_OPCODE
    assert "opcode 0x3f failed with" in caplog.text
    await write_read_verify(io, 0, os.urandom(4096))
    io.close()
    admin.close()


async def test_commands_before_connect_and_before_enable(served, caplog):
    s = served
    caplog.set_level(logging.INFO)
    # Before Connect: only Connect.
    host = await open_tcp(s.port)
    res = await host.cmd(Command(AdminOpcode.IDENTIFY, cdw10=1), read_len=4096)
    assert res.status == Status.CMD_SEQ_ERROR
    assert "the first command on a queue must be a Fabrics Connect" in caplog.text
    # Connected but CC.EN=0: admin commands other than Fabrics fail.
    res = await host.connect(SUBNQN)
    assert res.status == 0
    cntlid = res.cqe.dw0 & 0xFFFF
    res = await host.cmd(Command(AdminOpcode.IDENTIFY, cdw10=1), read_len=4096)
    assert res.status == Status.CMD_SEQ_ERROR
    assert f"opcode 0x06 on qid 0 of controller {cntlid} before the host enabled it (CC.EN=0" in caplog.text
    # An I/O queue cannot connect before CC.EN.
    io = await open_tcp(s.port)
    res = await io.connect(SUBNQN, qid=1, cntlid=cntlid, sqsize=127)
    assert res.status == Status.CMD_SEQ_ERROR
    assert f"I/O queue 1 Connect before controller {cntlid} was enabled" in caplog.text
    io.close()
    # Enabled, qid 1 connected, then CC.EN=0: I/O fails with Command Sequence Error.
    await host.enable()
    io = await io_host(s.port, cntlid, 1)
    await write_read_verify(io, 0, os.urandom(4096))
    assert (await host.prop_set(Property.CC, 0)).status == 0
    res = await io.cmd(Command(IoOpcode.READ, nsid=1, cdw10=0, cdw12=7), read_len=4096)
    assert res.status == Status.CMD_SEQ_ERROR
    assert f"opcode 0x02 on qid 1 of controller {cntlid} before the host enabled it" in caplog.text
    io.close()
    host.close()


async def test_connect_wrong_nqn(served, caplog):
    s = served
    caplog.set_level(logging.INFO)
    host = await open_tcp(s.port)
    res = await host.connect("nqn.2026-01.com.example:nope")
    assert res.status == Status.CONNECT_INVALID_PARAM and res.cqe.dnr
    assert res.cqe.dw0 == (CONNECT_IATTR_DATA << 16) | 256   # IATTR data, IPO = SUBNQN offset
    assert "Connect from 127.0.0.1:" in caplog.text
    assert "asked for subsystem 'nqn.2026-01.com.example:nope', which does not exist here" in caplog.text
    assert not s.target.controllers
    # The same connection may still connect to the right subsystem.
    assert (await host.connect(SUBNQN)).status == 0
    host.close()


async def test_connect_host_not_allowed(caplog):
    caplog.set_level(logging.INFO)
    allowed = "nqn.2014-08.org.nvmexpress:uuid:99999999-2222-3333-4444-555555555555"
    s = await serve(allow_any_host=False, hosts=(allowed,))
    try:
        host = await open_tcp(s.port)
        res = await host.connect(SUBNQN)
        assert res.status == Status.CONNECT_INVALID_HOST and res.cqe.dnr
        assert res.cqe.dw0 == (CONNECT_IATTR_DATA << 16) | 512   # IATTR data, IPO = HOSTNQN offset
        assert f"host {HOSTNQN} is not allowed to use subsystem {SUBNQN}" in caplog.text
        assert not s.target.controllers
        assert (await host.connect(SUBNQN, hostnqn=allowed)).status == 0
        host.close()
    finally:
        await s.target.close()


# --------------------------------------------------------------------------------- keep-alive

async def test_keep_alive_expiry_spares_the_active_host(caplog):
    caplog.set_level(logging.INFO)
    s = await serve(keep_alive_interval=0.05)
    try:
        silent_admin, silent_cntlid = await admin_host(s.port, kato=200)
        silent_io = await io_host(s.port, silent_cntlid, 1)
        active_admin, active_cntlid = await admin_host(s.port, kato=200)
        active_io = await io_host(s.port, active_cntlid, 1)
        loop = asyncio.get_running_loop()
        start = loop.time()
        rounds = 0
        while silent_cntlid in s.target.controllers:
            assert loop.time() - start < 5, "the silent host's controller was never torn down"
            assert (await active_admin.cmd(Command(AdminOpcode.KEEP_ALIVE))).status == 0
            await write_read_verify(active_io, 64 * rounds % 4096, os.urandom(8192))
            rounds += 1
            await asyncio.sleep(0.05)
        elapsed = loop.time() - start
        # KATO 200 ms plus the target's grace; never before KATO.
        assert elapsed >= 0.2, elapsed
        assert "keep-alive timeout: host" in caplog.text and f"tearing down controller {silent_cntlid}" in caplog.text
        # The silent host's sockets were closed; the active host is untouched and keeps working.
        await asyncio.wait_for(silent_admin.lost, 2)
        await asyncio.wait_for(silent_io.lost, 2)
        assert list(s.target.controllers) == [active_cntlid]
        assert list(s.target.controllers[active_cntlid].queues) == [0, 1]
        for _ in range(3):
            await write_read_verify(active_io, 128, os.urandom(65536), incapsule=False)
        active_io.close()
        active_admin.close()
    finally:
        await s.target.close()


# ------------------------------------------------------------------ nothing runs after a fatal error

class _StuckTransport(asyncio.Transport):
    """A socket whose peer stopped reading: close() waits for a flush that never comes."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closing = False
        self.aborted = False

    def write(self, data) -> None:  # type: ignore[no-untyped-def]
        self.written += data

    def writelines(self, list_of_data) -> None:  # type: ignore[no-untyped-def]
        for data in list_of_data:
            self.write(data)

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return len(self.written)   # nothing ever drains

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name, default=None):  # type: ignore[no-untyped-def]
        return default


async def test_commands_after_a_fatal_pdu_in_the_same_read_are_dropped(caplog):
    """A Connect read together with (after) a bad H2CData must not run on the closed queue.

    Regression: the bad PDU closed the connection, but the events already parsed from the same read
    kept being handled; the Connect then created a controller bound to a dead queue, which stayed
    until the transport reported connection_lost (never, while the peer does not read).
    """
    from target.transports.tcp import TargetConnection

    caplog.set_level(logging.INFO)
    s = await serve()
    try:
        conn = TargetConnection(s.target)
        transport = _StuckTransport()
        conn.connection_made(transport)
        conn.data_received(icreq())
        assert transport.written[:1] == b"\x01"   # ICResp
        conn.data_received(h2c_data(1, 0, 0, bytes(512), last=True) + connect_pdu(7, SUBNQN, qid=0))
        for _ in range(5):
            await asyncio.sleep(0)
        assert transport.closing and transport.written[128:129] == b"\x03"   # C2HTermReq
        assert not conn._tasks
        assert not s.target.controllers, "a command after the fatal PDU created a controller"
        assert "controller 1 created" not in caplog.text
    finally:
        await s.target.close()


def _feed_one_read(s, data: bytes) -> tuple[object, _StuckTransport]:  # type: ignore[no-untyped-def]
    from target.transports.tcp import TargetConnection

    conn = TargetConnection(s.target)
    transport = _StuckTransport()
    conn.connection_made(transport)
    conn.data_received(icreq())
    del transport.written[:128]
    conn.data_received(data)
    return conn, transport


# A bad H2CData followed, in the same read, by a PDU that would itself close the connection (a framing
# error, or the host's H2CTermReq): the H2CData is checked against its R2T while the read is parsed,
# PDU by PDU, so its own C2HTermReq goes out and nothing after it is looked at.
async def test_h2c_error_then_framing_error_in_one_read_reports_the_first():
    s = await serve()
    try:
        bad_h2c = h2c_data(1, 0, 0, bytes(512), last=True)          # no R2T outstanding: ttag unknown
        unknown = bytes([0x0A, 0, 24, 0]) + (24).to_bytes(4, "little") + bytes(16)
        _, transport = _feed_one_read(s, bad_h2c + unknown)
        assert transport.written[:1] == b"\x03" and transport.closing
        fes, fei = int.from_bytes(transport.written[8:10], "little"), int.from_bytes(transport.written[10:14], "little")
        assert (fes, fei) == (1, 10), "the C2HTermReq describes the later PDU, not the bad H2CData"
        # Its data is the bad H2CData's header, and only one TermReq was sent.
        plen = int.from_bytes(transport.written[4:8], "little")
        assert transport.written[24:plen] == bad_h2c[:24] and len(transport.written) == plen
    finally:
        await s.target.close()


async def test_h2c_error_then_term_req_in_one_read_still_gets_c2h_term_req(caplog):
    from raw_pdu import h2c_term_req

    caplog.set_level(logging.INFO)
    s = await serve()
    try:
        bad_h2c = h2c_data(1, 0, 0, bytes(512), last=True)
        _, transport = _feed_one_read(s, bad_h2c + h2c_term_req(1))
        assert "which no outstanding R2T carries; sending C2HTermReq and closing" in caplog.text
        assert transport.written[:1] == b"\x03", "logged 'sending C2HTermReq' but sent nothing"
        assert transport.closing and "terminated the connection" not in caplog.text
    finally:
        await s.target.close()


# ------------------------------------------------------------ a close the peer never lets finish

async def test_close_to_a_peer_that_stopped_reading_is_aborted_after_the_grace(monkeypatch, caplog):
    """After a fatal PDU the close waits for our C2HTermReq to drain; a stuck peer gets an abort instead."""
    from nvmeof import defaults
    from target.transports.tcp import TargetConnection

    assert TargetConnection.close_grace == defaults.TCP_CLOSE_GRACE
    monkeypatch.setattr(TargetConnection, "close_grace", 0.05)
    caplog.set_level(logging.INFO)
    s = await serve()
    try:
        _, stuck = _feed_one_read(s, bytes([0x0A, 0, 24, 0]) + (24).to_bytes(4, "little") + bytes(16))
        assert stuck.closing and not stuck.aborted and stuck.written[:1] == b"\x03"
        await asyncio.sleep(0.2)
        assert stuck.aborted, "the close never finished and nothing aborted it"
        assert "did not read the last 48 bytes within 0.1 s of the close; aborting" in caplog.text
        # A close whose transport reports connection_lost in time is left alone.
        conn, drained = _feed_one_read(s, bytes([0x0A, 0, 24, 0]) + (24).to_bytes(4, "little") + bytes(16))
        conn.connection_lost(None)   # type: ignore[attr-defined]
        await asyncio.sleep(0.2)
        assert drained.closing and not drained.aborted
    finally:
        await s.target.close()


async def test_peer_that_never_reads_cannot_hold_its_socket(served, monkeypatch, caplog):
    """Over a real socket: 192 KiB of reads and a bad PDU in one write, then the host never reads.

    The target answers everything, queues its C2HTermReq behind it and closes; that close cannot
    finish, so the transport is aborted after TargetConnection.close_grace. (The reads stay below
    TCP_WRITE_HIGH_WATER: past it the batch engine leaves the rest of the receive buffer, the bad PDU
    with it, unread until the host has taken the replies.)
    """
    import socket

    from target.transports.tcp import TargetConnection

    grace = 0.5
    monkeypatch.setattr(TargetConnection, "close_grace", grace)
    caplog.set_level(logging.INFO)
    s = served
    admin, cntlid = await admin_host(s.port)
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # a small window: the target's send stalls
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", s.port))

        async def recv_exactly(n: int) -> bytes:
            got = b""
            while len(got) < n:
                chunk = await asyncio.wait_for(loop.sock_recv(sock, n - len(got)), 5)
                assert chunk, "the target closed early"
                got += chunk
            return got

        await loop.sock_sendall(sock, icreq())
        assert (await recv_exactly(128))[:1] == b"\x01"
        await loop.sock_sendall(sock, connect_pdu(1, SUBNQN, qid=1, cntlid=cntlid))
        rsp = await recv_exactly(24)
        assert rsp[:1] == b"\x05" and int.from_bytes(rsp[22:24], "little") >> 1 == 0
        conn = next(c for c in s.server.connections if c.queue.qid == 1)
        # A small send buffer (no autotuning): the kernel cannot take the 192 KiB of replies either.
        conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
        size = 64 * 1024
        reads = b"".join(capsule_cmd(sqe(Command(IoOpcode.READ, nsid=1, cdw10=0, cdw12=size // 512 - 1), cid=10 + i,
                                         data_len=size)) for i in range(3))
        bad = bytes([0x0A, 0, 24, 0]) + (24).to_bytes(4, "little") + bytes(16)
        await loop.sock_sendall(sock, reads + bad)
        start = loop.time()
        await wait_until(lambda: conn._closed, what="the target to close after the bad PDU")
        assert conn in s.server.connections and conn._linger is not None, "the close finished at once"
        await wait_until(lambda: conn not in s.server.connections, timeout=grace + 5,
                         what="the stuck connection to be aborted")
        assert loop.time() - start >= grace * 0.9
        assert "within 0.5 s of the close; aborting" in caplog.text
        # The socket really is gone: reading now ends (reset or EOF) long before 192 KiB arrived.
        received = 0
        try:
            while True:
                chunk = await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 5)
                if not chunk:
                    break
                received += len(chunk)
        except ConnectionResetError:
            pass
        assert received < 3 * size
        assert list(s.target.controllers[cntlid].queues) == [0]
        assert (await admin.prop_get(Property.CSTS)).cqe.dw0 & 1
    finally:
        sock.close()
        admin.close()
