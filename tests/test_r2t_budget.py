"""R2Ts are paced by a per-connection budget of H2C buffer bytes.

A write asking for host data by R2T waits, in arrival order, while the writes that already got their
R2T hold the budget; reads and in-capsule writes do not wait behind it, and a connection closing
with writes waiting leaves no task, buffer or budget behind.
"""

from __future__ import annotations

import asyncio
import os

import pytest
from raw_pdu import (
    SUBNQN,
    RawPeer,
    TargetOutput,
    admin_host,
    capsule_cmd,
    connect_pdu,
    h2c_data,
    io_host,
    rw_capsule,
    serve,
    sqe,
    wait_until,
)

from nvmeof import defaults
from nvmeof.spec.nvme import Command, IoOpcode
from target.transports.tcp import TargetConnection

KIB = 1024
SIZE = 128 * KIB   # one H2CData PDU each (MAXH2CDATA)
BLOCKS = SIZE // 512


@pytest.fixture
async def served():
    s = await serve(ns_size=8 << 20)
    yield s
    await s.target.close()


def _write(cid: int, slba: int, size: int = SIZE) -> bytes:
    return rw_capsule(IoOpcode.WRITE, cid, slba, size)


def _read(cid: int, slba: int, size: int = SIZE) -> bytes:
    return rw_capsule(IoOpcode.READ, cid, slba, size)


def _max_outstanding(out: TargetOutput, cids: set[int]) -> int:
    """The most R2Ts of ``cids`` the host ever held without the command's completion, in stream order."""
    now = peak = 0
    for p in out.pdus:
        if p.kind == "r2t" and p.fields["cccid"] in cids:
            now += 1
        elif p.kind == "cqe" and p.fields["cqe"].cid in cids:
            now -= 1
        peak = max(peak, now)
    return peak


async def _io_peer(s, cntlid: int) -> tuple[RawPeer, TargetConnection]:  # type: ignore[no-untyped-def]
    peer = await RawPeer.open(s.port)
    await peer.handshake()
    assert (await peer.command(connect_pdu(1, SUBNQN, qid=1, cntlid=cntlid), 1)).status_code == 0
    conn = next(c for c in s.server.connections if c.queue.qid == 1 and c.queue.ctrl is not None
                and c.queue.ctrl.cntlid == cntlid)
    return peer, conn


async def _answer_r2ts(peer: RawPeer, data: dict[int, bytes], answered: set[int]) -> None:
    for p in peer.out.of_kind("r2t"):
        cid = p.fields["cccid"]
        if cid in data and cid not in answered:
            answered.add(cid)
            assert p.fields["length"] == len(data[cid]) and p.fields["offset"] == 0
            await peer.send(h2c_data(cid, p.fields["ttag"], 0, data[cid], last=True))


async def _next_pdu(peer: RawPeer, data: dict[int, bytes]) -> None:
    seen = len(peer.out.pdus)
    assert await peer.wait_for(lambda o: len(o.pdus) > seen or all(o.done(c) for c in data), 5), "the target stalled"
    assert not peer.out.errors and peer.out.term is None, (peer.out.errors, peer.out.term)


def test_default_budget_allows_one_mdts_transfer():
    assert TargetConnection.h2c_budget == defaults.TCP_H2C_BUDGET
    assert defaults.TCP_H2C_BUDGET >= defaults.MAX_TRANSFER


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "tasks"])
async def test_r2ts_stay_within_the_budget_and_reads_pass_them(served, monkeypatch, eager):
    monkeypatch.setattr(TargetConnection, "eager", eager)
    s = served
    admin, cntlid = await admin_host(s.port)
    peer, conn = await _io_peer(s, cntlid)
    conn.h2c_budget = 2 * SIZE
    # Something to read behind the writes: in-capsule, which takes no budget and no R2T.
    old = os.urandom(8 * KIB)
    assert (await peer.command(capsule_cmd(sqe(Command(IoOpcode.WRITE, nsid=1, cdw10=8000, cdw12=15), cid=2,
                                               data_len=len(old), incapsule=True), old), 2)).status_code == 0

    data = {10 + i: os.urandom(SIZE) for i in range(16)}
    await peer.send(b"".join(_write(cid, (cid - 10) * BLOCKS) for cid in data) + _read(50, 8000, len(old)))
    assert await peer.wait_for(lambda o: o.done(50) and len(o.of_kind("r2t")) >= 2, 5)
    assert peer.out.cqe(50) is not None and peer.out.cqe(50).status_code == 0
    assert peer.out.read_data(50) == old, "the read behind the waiting writes returned wrong data"
    await asyncio.sleep(0.05)   # nothing more comes while the host sends no data
    assert [p.fields["cccid"] for p in peer.out.of_kind("r2t")] == [10, 11]
    assert not any(peer.out.done(cid) for cid in data)
    assert conn._h2c_bytes == 2 * SIZE and len(conn._h2c_waiters) == 14 and len(conn._h2c) == 2

    answered: set[int] = set()
    while not all(peer.out.done(cid) for cid in data):
        await _answer_r2ts(peer, data, answered)
        await _next_pdu(peer, data)
    assert all(peer.out.cqe(cid).status_code == 0 for cid in data)
    assert _max_outstanding(peer.out, set(data)) == 2
    assert [p.fields["cccid"] for p in peer.out.of_kind("r2t")] == sorted(data), "R2Ts not in arrival order"
    assert conn._h2c_bytes == 0 and not conn._h2c_waiters and not conn._h2c

    for cid, expect in data.items():
        rcid = cid + 100
        assert (await peer.command(_read(rcid, (cid - 10) * BLOCKS), rcid)).status_code == 0
        assert peer.out.read_data(rcid) == expect, f"LBA {(cid - 10) * BLOCKS} read back wrong"
    await peer.close()
    admin.close()


@pytest.mark.parametrize(("budget", "peak"), [(64 * KIB, 1), (3 * SIZE - 512, 2), (4 * SIZE, 4)])
async def test_budget_sets_the_r2ts_in_flight(served, budget, peak):
    """A budget below one transfer still lets one write at a time through."""
    s = served
    admin, cntlid = await admin_host(s.port)
    peer, conn = await _io_peer(s, cntlid)
    conn.h2c_budget = budget
    data = {10 + i: os.urandom(SIZE) for i in range(6)}
    await peer.send(b"".join(_write(cid, (cid - 10) * BLOCKS) for cid in data))
    answered: set[int] = set()
    while not all(peer.out.done(cid) for cid in data):
        await _answer_r2ts(peer, data, answered)
        await _next_pdu(peer, data)
    assert all(peer.out.cqe(cid).status_code == 0 for cid in data)
    assert _max_outstanding(peer.out, set(data)) == peak
    await peer.close()
    admin.close()


async def test_real_host_writes_through_a_small_budget(served):
    """TinyHost answers each R2T when it comes: 16 concurrent large writes complete and read back."""
    s = served
    admin, cntlid = await admin_host(s.port)
    io = await io_host(s.port, cntlid, 1)
    conn = next(c for c in s.server.connections if c.queue.qid == 1)
    conn.h2c_budget = 2 * SIZE
    data = [os.urandom(SIZE) for _ in range(16)]
    results = await asyncio.gather(*(io.cmd(Command(IoOpcode.WRITE, nsid=1, cdw10=i * BLOCKS, cdw12=BLOCKS - 1), d,
                                            incapsule=False, timeout=10) for i, d in enumerate(data)))
    assert all(r.status == 0 for r in results), results
    for i, expect in enumerate(data):
        res = await io.cmd(Command(IoOpcode.READ, nsid=1, cdw10=i * BLOCKS, cdw12=BLOCKS - 1), read_len=SIZE)
        assert res.status == 0 and res.data == expect, f"write {i} read back wrong"
    assert conn._h2c_bytes == 0 and not conn._h2c_waiters
    io.close()
    admin.close()


@pytest.mark.parametrize("how", ["abort", "fin"])
async def test_closing_with_writes_waiting_leaves_nothing(served, how):
    s = served
    admin, cntlid = await admin_host(s.port)
    tasks_before = {t for t in asyncio.all_tasks() if not t.done()}
    peer, conn = await _io_peer(s, cntlid)
    conn.h2c_budget = 2 * SIZE
    await peer.send(b"".join(_write(10 + i, i * BLOCKS) for i in range(16)))
    assert await peer.wait_for(lambda o: len(o.of_kind("r2t")) >= 2, 5)
    r2t = peer.out.r2t(10)
    assert r2t is not None
    await peer.send(h2c_data(10, r2t.fields["ttag"], 0, os.urandom(SIZE), last=True)[:24 + 30000])
    # The payload is received straight into the write's buffer (direct placement: the batch engine's for a
    # fast-path write, its header perhaps still carried) or, in pieces too small for that, buffered by the
    # sans-IO connection.
    await wait_until(lambda: len(conn._h2c_waiters) == 14 and len(conn._h2c) == 2
                     and (conn.conn.direct_buffer() is not None or conn.conn._buf
                          or conn._h2c_dest is not None or conn._carry),
                     what="the first write's data to start arriving")
    await peer.close(abort=how == "abort")
    await wait_until(lambda: conn not in s.server.connections, what="the queue to go")
    await wait_until(lambda: not conn._tasks, what="the queue's commands to end")
    assert not conn._h2c and not conn._h2c_waiters and conn._h2c_bytes == 0
    me = asyncio.current_task()
    await wait_until(lambda: not ({t for t in asyncio.all_tasks() if not t.done()} - tasks_before - {me}),
                     what="no task left behind")
    assert list(s.target.controllers[cntlid].queues) == [0]
    admin.close()


async def test_budget_given_to_a_cancelled_waiter_comes_back(served):
    """A waiter cancelled while queued is skipped; one cancelled after its grant returns the bytes."""
    conn = TargetConnection(served.target)
    conn.h2c_budget = 2 * SIZE
    await conn._reserve_h2c(2 * SIZE)
    waiting = [asyncio.create_task(conn._reserve_h2c(SIZE)) for _ in range(3)]
    await asyncio.sleep(0)
    assert len(conn._h2c_waiters) == 3 and not any(t.done() for t in waiting)
    waiting[0].cancel()                      # still queued: its future is cancelled, its coroutine not yet run
    conn._release_h2c(2 * SIZE)             # grants the next two in order, skipping the cancelled one
    assert conn._h2c_bytes == 2 * SIZE and not conn._h2c_waiters
    waiting[1].cancel()                      # granted, cancelled before it resumed
    for task in waiting[:2]:
        with pytest.raises(asyncio.CancelledError):
            await task
    await waiting[2]
    assert conn._h2c_bytes == SIZE
    conn._release_h2c(SIZE)
    assert conn._h2c_bytes == 0
