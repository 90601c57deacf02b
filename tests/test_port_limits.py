"""The NVMe/TCP port's resource limits, with real sockets (issue 10, item 4).

A connection must send ICReq within --ic-timeout and its Fabrics Connect within --connect-timeout of
our ICResp; connections are capped per listener and in total (below RLIMIT_NOFILE); receive buffers
start small, grow while reads fill them and shrink back; R2T'd write data of all connections shares
one global budget, granted in turn. The end-to-end test runs `nvmeof serve` under a 256-fd limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from raw_pdu import (
    SUBNQN,
    RawPeer,
    admin_host,
    capsule_cmd,
    connect_pdu,
    h2c_data,
    icreq,
    rw_capsule,
    serve,
    sqe,
    wait_until,
)

from nvmeof import defaults
from nvmeof.spec.nvme import Command, IoOpcode
from target.core import Target
from target.transports.tcp import RECV_BUFFER_MIN, TargetConnection, TcpLimits, TcpPort, fd_headroom
from tests.ports import free_ports

REPO = Path(__file__).resolve().parent.parent
KIB = 1024
SIZE = 128 * KIB
BLOCKS = SIZE // 512
LOGGER = "target.transports.tcp"


@pytest.fixture
async def served():
    s = await serve(ns_size=8 << 20)
    yield s
    await s.target.close()


def _limits(**kw) -> TcpLimits:  # type: ignore[no-untyped-def]
    base = dict(ic_timeout=30.0, connect_timeout=30.0)
    base.update(kw)
    return TcpLimits(**base)  # type: ignore[arg-type]


def _messages(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and text in r.getMessage()]


def _write(cid: int, slba: int, size: int = SIZE) -> bytes:
    return rw_capsule(IoOpcode.WRITE, cid, slba, size)


def _read(cid: int, slba: int, size: int = SIZE) -> bytes:
    return rw_capsule(IoOpcode.READ, cid, slba, size)


def _conn_of(s, peer: RawPeer) -> TargetConnection:  # type: ignore[no-untyped-def]
    local = peer.writer.get_extra_info("sockname")
    want = f"{local[0]}:{local[1]}"
    return next(c for c in s.server.connections if c.queue.peer == want)


async def _io_queue(s, cntlid: int, qid: int) -> tuple[RawPeer, TargetConnection]:  # type: ignore[no-untyped-def]
    peer = await RawPeer.open(s.port)
    await peer.handshake()
    assert (await peer.command(connect_pdu(1, SUBNQN, qid=qid, cntlid=cntlid), 1)).status_code == 0
    return peer, _conn_of(s, peer)


# --- deadlines ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("sent", [b"", icreq()[:60]], ids=["nothing", "half-an-icreq"])
async def test_a_connection_without_icreq_is_closed_at_the_deadline(served, caplog, sent):
    TcpPort.of(served.target).configure(_limits(ic_timeout=0.3))
    peer = await RawPeer.open(served.port)
    await peer.send(sent)
    assert await peer.wait_eof(10), "the target kept a connection that never completed its ICReq"
    assert not peer.out.pdus, "nothing is said to a connection that never sent ICReq"
    local = peer.writer.get_extra_info("sockname")
    lines = _messages(caplog, "sent no ICReq within 0.3 s")
    assert lines and f"{local[0]}:{local[1]}" in lines[0] and "--ic-timeout" in lines[0], lines
    await wait_until(lambda: not served.server.connections and served.server.open == 0, what="the slot to go")


async def test_a_queue_without_connect_is_closed_after_the_icresp(served, caplog):
    TcpPort.of(served.target).configure(_limits(ic_timeout=0.3, connect_timeout=0.5))
    peer = await RawPeer.open(served.port)
    await peer.handshake()
    assert await peer.wait_eof(10), "the target kept a queue that never sent its Fabrics Connect"
    lines = _messages(caplog, "sent no Connect within 0.5 s of our ICResp")
    assert lines and "--connect-timeout" in lines[0], lines


async def test_connected_queues_outlive_the_deadlines(served):
    TcpPort.of(served.target).configure(_limits(ic_timeout=0.2, connect_timeout=0.2))
    admin, cntlid = await admin_host(served.port)
    io, conn = await _io_queue(served, cntlid, 1)
    assert conn._deadline is None, "the deadline timer must go at Connect"
    await asyncio.sleep(0.6)   # past both deadlines
    assert (await io.command(_read(7, 0, 4096), 7)).status_code == 0
    assert not io.eof and cntlid in served.target.controllers
    await io.close()
    admin.close()


# --- connection caps ------------------------------------------------------------------------------------


async def test_past_the_listener_cap_a_new_connection_is_closed(served, caplog):
    port = TcpPort.of(served.target)
    port.configure(_limits(max_connections_per_listener=2))
    port.log_refused.interval = 0.2
    hosts = [await admin_host(served.port) for _ in range(2)]   # both complete Connect: nothing to make room
    peers = [await RawPeer.open(served.port) for _ in range(20)]
    for peer in peers:
        assert await peer.wait_eof(5), "a connection past the cap was kept"
    assert served.server.refused == 20 and served.server.open == 2
    for host, _cntlid in hosts:
        assert (await host.prop_get(0x1C)).status == 0, "a connected host suffered from the refusals"
    await wait_until(lambda: any("more like it" in m for m in _messages(caplog, "refused")), what="the summary")
    lines = _messages(caplog, "refused a connection")
    assert "--max-connections-per-listener 2" in lines[0], lines[0]
    assert len(lines) < 10, f"{len(lines)} log lines for 20 refusals: not rate-limited"
    assert any("20 in all" in m or "19 more" in m or "more like it" in m for m in lines)
    for host, _ in hosts:
        host.close()


async def test_at_the_total_cap_the_oldest_unconnected_makes_room(served, caplog):
    """Half-open connections cannot lock a host out: the oldest one goes, the host gets in."""
    TcpPort.of(served.target).configure(_limits(max_connections=4))
    idle = [await RawPeer.open(served.port) for _ in range(4)]
    await wait_until(lambda: served.server.open == 4, what="4 connections")
    admin, cntlid = await admin_host(served.port)
    assert (await admin.prop_get(0x1C)).status == 0
    assert await idle[0].wait_eof(5), "the oldest unconnected connection was not closed"
    assert not any(p.eof for p in idle[1:]), "younger connections were closed too"
    assert served.server.open == 4 and TcpPort.of(served.target).open == 4
    lines = _messages(caplog, "closing the oldest connection that has not completed Connect")
    assert lines and "the cap of 4 NVMe/TCP connections in all" in lines[0], lines
    # Now all but three are connected hosts: with every slot taken by them, a newcomer is refused.
    hosts = [await admin_host(served.port) for _ in range(3)]
    assert all(p.eof for p in idle)
    late = await RawPeer.open(served.port)
    assert await late.wait_eof(5)
    assert "--max-connections 4" in _messages(caplog, "refused a connection")[-1]
    for host, _ in [*hosts, (admin, cntlid)]:
        host.close()


async def test_the_total_cap_spans_listeners(served):
    from target.model import Listener

    TcpPort.of(served.target).configure(_limits(max_connections=2))
    second = Listener("tcp", "ipv4", "127.0.0.1", free_ports(1)[0], portid=2)
    served.target.listeners[second.id] = second
    other = await served.target.start_listener(second)
    a, _ = await admin_host(served.port)
    b, _ = await admin_host(other.port)
    late = await RawPeer.open(other.port)
    assert await late.wait_eof(5)
    assert other.refused == 1 and served.server.open == 1 and other.open == 1
    a.close()
    b.close()
    await wait_until(lambda: TcpPort.of(served.target).open == 0, what="both slots back")


def test_the_cap_stays_below_rlimit_nofile():
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap, why = fd_headroom(soft + 10)
    assert cap < soft - defaults.TCP_FD_RESERVE and why and "RLIMIT_NOFILE" in why and "ulimit -n" in why
    assert fd_headroom(1) == (1, None)


def test_the_daemon_raises_its_soft_fd_limit_for_the_cap():
    code = textwrap.dedent("""
        import resource
        from target.core import Target
        from target.transports.tcp import TcpLimits, TcpPort
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 4096))
        port = TcpPort.of(Target())
        port.configure(TcpLimits(max_connections=1000), raise_fd_limit=True)
        print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], port.max_total)
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        port.configure(TcpLimits(max_connections=1000), raise_fd_limit=True)
        print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], port.max_total)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    raised, lowered = (line.split() for line in out.stdout.splitlines())
    assert int(raised[0]) >= 1000 + defaults.TCP_FD_RESERVE and int(raised[1]) == 1000
    assert int(lowered[0]) == 256 and int(lowered[1]) < 256 - defaults.TCP_FD_RESERVE
    assert "connection cap lowered from 1000 (--max-connections)" in out.stderr


async def test_queues_handed_to_workers_still_count_against_the_caps():
    """With --workers the main process accepts every connection; a queue living in a worker keeps its slot."""
    import initiator
    from nvmeof.cli.daemon import Daemon, DaemonOptions
    from nvmeof.uri import TransportAddress

    io, disc = free_ports(2)
    daemon = Daemon(DaemonOptions(listen=[TransportAddress("tcp", "127.0.0.1", io)],
                                  discovery=[TransportAddress("tcp", "127.0.0.1", disc)], api=None,
                                  ramdisk_size=4 << 20, workers=1, max_connections=3))
    port = TcpPort.of(daemon.target)
    try:
        await daemon.start()
        async with initiator.connect("127.0.0.1", io, defaults.DEFAULT_SUBSYSTEM_NQN, nr_io_queues=2,
                                     timeout=10) as ctrl:
            pool = daemon.target.pool   # type: ignore[attr-defined]
            await wait_until(lambda: len(pool.placed) == 2, what="both I/O queues in the worker")
            assert port.open == 3, "queues handed to a worker stopped counting"
            late = await RawPeer.open(io)
            assert await late.wait_eof(5), "a fourth connection got past --max-connections 3"
            data = os.urandom(4096)
            await ctrl.write(1, 0, data)
            assert await ctrl.read(1, 0, 8) == data
        await wait_until(lambda: port.open == 0, what="the worker's queues to give their slots back")
    finally:
        await daemon.stop()


def test_each_worker_gets_its_share_of_the_global_budget():
    from target.workers import PooledTarget

    target = PooledTarget(2)
    TcpPort.of(target).configure(_limits(h2c_global_budget=256 << 20))
    assert target.pool.h2c_share() == 128 << 20


# --- receive buffers ----------------------------------------------------------------------------------


async def test_receive_buffers_start_small_grow_and_shrink_back(served, monkeypatch):
    sizes: list[int] = []
    real = TargetConnection.get_buffer

    def spy(self, sizehint):  # type: ignore[no-untyped-def]
        buf = real(self, sizehint)
        sizes.append(len(buf))
        return buf

    monkeypatch.setattr(TargetConnection, "get_buffer", spy)
    admin, cntlid = await admin_host(served.port)
    peer, conn = await _io_queue(served, cntlid, 1)
    assert len(conn._recv) == RECV_BUFFER_MIN <= 16 * KIB, "an idle connection past ICReq holds a big buffer"
    # A burst queued in the socket while the target does not read: its first reads fill the buffer.
    data = os.urandom(8 * KIB)
    burst = b"".join(capsule_cmd(sqe(Command(IoOpcode.WRITE, nsid=1, cdw10=16 * i, cdw12=15), cid=10 + i,
                                     data_len=len(data), incapsule=True), data) for i in range(12))
    conn.transport.pause_reading()
    sizes.clear()
    await peer.send(burst)
    await asyncio.sleep(0.1)
    conn.transport.resume_reading()
    assert await peer.wait_for(lambda o: all(o.done(10 + i) for i in range(12)), 5)
    assert all(peer.out.cqe(10 + i).status_code == 0 for i in range(12))
    assert sizes[0] == RECV_BUFFER_MIN and max(sizes) > RECV_BUFFER_MIN, sizes
    assert (await peer.command(_read(40, 0, 4096), 40)).status_code == 0   # a small read after the burst
    assert len(conn._recv) == RECV_BUFFER_MIN, "the big buffer was kept after the burst"
    assert peer.out.read_data(40) == data[:4096]
    await peer.close()
    admin.close()


async def test_large_h2c_data_is_received_straight_into_the_write_buffer(served):
    admin, cntlid = await admin_host(served.port)
    peer, conn = await _io_queue(served, cntlid, 1)
    await peer.send(_write(10, 0))
    assert await peer.wait_for(lambda o: o.r2t(10) is not None, 5)
    pdu = h2c_data(10, peer.out.r2t(10).fields["ttag"], 0, payload := os.urandom(SIZE), last=True)
    await peer.send(pdu[:24 + 20000])
    # Direct placement: the batch engine's own for a fast-path write (tcp_batch _h2c_dest), the sans-IO
    # connection's for a write on the slow path.
    await wait_until(lambda: conn._h2c_dest is not None or conn.conn.direct_buffer() is not None,
                     what="the payload to be placed directly")
    assert not conn.conn._buf, "the payload went through the receive path's own buffer"
    await peer.send(pdu[24 + 20000:])
    assert await peer.wait_for(lambda o: o.done(10), 5) and peer.out.cqe(10).status_code == 0
    assert (await peer.command(_read(11, 0), 11)).status_code == 0
    assert peer.out.read_data(11) == payload
    await peer.close()
    admin.close()


# --- the global H2C budget -------------------------------------------------------------------------------


async def _two_queues_sharing_two_writes(s):  # type: ignore[no-untyped-def]
    """The port's global budget set to two writes of SIZE; an admin queue and I/O queues 1 and 2 of one
    controller: (port, admin, (peer, connection) of queue 1, of queue 2)."""
    port = TcpPort.of(s.target)
    port.configure(_limits(h2c_global_budget=2 * SIZE))
    admin, cntlid = await admin_host(s.port)
    return port, admin, await _io_queue(s, cntlid, 1), await _io_queue(s, cntlid, 2)


async def test_the_global_budget_is_shared_in_turn(served):
    """Two queues, a global budget of two writes: one queue's 8 writes cannot keep the other's waiting."""
    port, admin, (a, _conn_a), (b, conn_b) = await _two_queues_sharing_two_writes(served)
    peers = {"a": a, "b": b}
    data = {"a": {10 + i: os.urandom(SIZE) for i in range(8)}, "b": {30 + i: os.urandom(SIZE) for i in range(2)}}
    await a.send(b"".join(_write(cid, (cid - 10) * BLOCKS) for cid in data["a"]))
    assert await a.wait_for(lambda o: len(o.of_kind("r2t")) >= 2, 5)
    await b.send(b"".join(_write(cid, (cid - 20) * BLOCKS) for cid in data["b"]))
    await wait_until(lambda: port.h2c.queue and len(conn_b._h2c_waiters) == 2, what="b to queue for the budget")
    assert port.h2c.used == 2 * SIZE and len(a.out.of_kind("r2t")) == 2 and not b.out.of_kind("r2t")

    def r2ts() -> int:
        return sum(len(p.out.of_kind("r2t")) for p in peers.values())

    # Each answered write frees one write's worth of the budget, which goes to exactly one waiting
    # write: the R2Ts come one at a time, so their order is the order of the grants.
    granted = [("a", r) for r in a.out.of_kind("r2t")]
    known = {"a": 2, "b": 0}
    for name, r2t in granted:   # grows while it is walked
        cid = r2t.fields["cccid"]
        before = r2ts()
        await peers[name].send(h2c_data(cid, r2t.fields["ttag"], 0, data[name][cid], last=True))
        assert await peers[name].wait_for(lambda o, cid=cid: o.done(cid), 5)
        assert port.h2c.used <= 2 * SIZE
        if before < 10:
            await wait_until(lambda before=before: r2ts() > before, what="the next grant")
            for other, p in peers.items():
                new = p.out.of_kind("r2t")[known[other]:]
                granted += [(other, r) for r in new]
                known[other] += len(new)
    order = [name for name, _ in granted]
    assert all(p.out.cqe(cid).status_code == 0 for name, p in peers.items() for cid in data[name])
    # b's first write went at the second grant after it queued, its second one turn later: not after a's 8.
    assert order == ["a", "a", "a", "b", "a", "b", "a", "a", "a", "a"], order
    assert port.h2c.used == 0 and not port.h2c.queue
    for name, p in peers.items():
        for cid, expect in data[name].items():
            slba = (cid - 10 if name == "a" else cid - 20) * BLOCKS
            assert (await p.command(_read(cid + 100, slba), cid + 100)).status_code == 0
            assert p.out.read_data(cid + 100) == expect
        await p.close()
    admin.close()


async def test_a_waiting_connection_that_dies_gives_its_budget_back(served):
    port, admin, (a, conn_a), (b, conn_b) = await _two_queues_sharing_two_writes(served)
    await a.send(b"".join(_write(10 + i, i * BLOCKS) for i in range(4)))   # 2 granted (unanswered), 2 waiting
    assert await a.wait_for(lambda o: len(o.of_kind("r2t")) >= 2, 5)
    await b.send(_write(30, 40 * BLOCKS))
    await wait_until(lambda: conn_b._h2c_waiters and port.h2c.queue, what="b to wait")
    await a.close(abort=True)
    assert await b.wait_for(lambda o: o.r2t(30) is not None, 5), "a dead connection kept the global budget"
    await wait_until(lambda: port.h2c.used == SIZE and list(port.h2c.queue) == [], what="a's bytes back")
    assert not conn_a._h2c_waiters and conn_a._h2c_bytes == 0
    await b.send(h2c_data(30, b.out.r2t(30).fields["ttag"], 0, os.urandom(SIZE), last=True))
    assert await b.wait_for(lambda o: o.done(30), 5) and b.out.cqe(30).status_code == 0
    assert port.h2c.used == 0
    await b.close()
    admin.close()


# --- end to end: `nvmeof serve` under a 256-fd limit -------------------------------------------------------


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _health(api: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{api}/health", timeout=5) as resp:
        return resp.status


def test_idle_connections_past_the_fd_limit_do_not_take_the_daemon_down(tmp_path):
    io, disc, api = free_ports(3)
    log_path = tmp_path / "serve.log"

    def limit_fds() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    cmd = [sys.executable, "-m", "nvmeof.cli", "serve", "--listen", f"127.0.0.1:{io}", "--discovery",
           f"127.0.0.1:{disc}", "--api", f"127.0.0.1:{api}", "--ramdisk-size", "16M", "--ic-timeout", "3",
           "--connect-timeout", "3"]
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, preexec_fn=limit_fds)
    idle: list[socket.socket] = []
    try:
        for _ in range(300):
            assert proc.poll() is None, log_path.read_text()
            with contextlib.suppress(OSError):
                if _health(api) == 200:
                    break
            time.sleep(0.1)
        rss_before = _rss_kib(proc.pid)
        for _ in range(300):   # more than 256 fds' worth, half of them past ICReq
            s = socket.create_connection(("127.0.0.1", io))
            if len(idle) % 2:
                s.sendall(icreq())
            idle.append(s)
        time.sleep(0.3)   # the connections made room for are closed by now
        held = _still_open(idle)
        assert 0 < held < 256 - defaults.TCP_FD_RESERVE, held
        rss_held = _rss_kib(proc.pid)
        # While they are held: a host connects and does I/O, and the API answers.
        assert _health(api) == 200
        _host_io(io)
        assert _health(api) == 200
        # Then the deadline closes every idle one.
        deadline = time.monotonic() + 20
        while _still_open(idle) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _still_open(idle), "idle connections outlived --ic-timeout/--connect-timeout"
        _host_io(io)
        rss_after = _rss_kib(proc.pid)
    finally:
        for s in idle:
            s.close()
        proc.terminate()
        proc.wait(20)
    text = log_path.read_text()
    assert "NVMe/TCP connection cap lowered from 1024 (--max-connections)" in text, text
    assert "closing the oldest connection that has not completed Connect" in text
    assert "sent no ICReq within 3 s" in text and "sent no Connect within 3 s" in text
    assert "Too many open files" not in text and "EMFILE" not in text, text
    print(json.dumps({"held": held, "closed_at_once": 300 - held, "rss_kib": [rss_before, rss_held, rss_after]}))


def _still_open(socks: list[socket.socket]) -> int:
    """How many of ``socks`` the daemon has not closed (non-blocking peek; ICResp bytes do not count)."""
    open_ = 0
    for s in socks:
        s.setblocking(False)
        try:
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    break   # EOF: closed by the daemon
        except BlockingIOError:
            open_ += 1
        except OSError:
            pass
        finally:
            s.setblocking(True)
    return open_


def _host_io(io: int) -> None:
    import initiator.sync

    with initiator.sync.connect("127.0.0.1", io, subnqn=defaults.DEFAULT_SUBSYSTEM_NQN) as ctrl:
        data = os.urandom(8192)
        ctrl.write(1, 8, data)
        assert ctrl.read(1, 8, 16) == data



def test_each_target_keeps_its_own_port_state() -> None:
    """TcpPort.of lives in the Target's declared transport_state: one per Target, gone with it."""
    a, b = Target(), Target()
    port = TcpPort.of(a)
    assert TcpPort.of(a) is port and a.transport_state == {"tcp": port}
    assert TcpPort.of(b) is not port and b.transport_state["tcp"] is TcpPort.of(b)
