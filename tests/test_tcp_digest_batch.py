"""Digest connections on the one NVMe/TCP engine: the replies one wake-up releases leave in one write.

Header/data digests keep a connection off the batch engine's fast path (target/transports/tcp_batch.py):
every PDU goes through the sans-IO TcpConnection. The engine used to hand those PDUs over one at a
time, each with its own write; now what the slow path queues during one receive goes out in one
``writelines`` at the wake-up's end (one ``sendmsg`` on SocketTransport), and the replies of I/O commands
the backend lets go in one loop iteration share one write as well. The target's writes and
wake-ups are counted on the I/O queue's connection; the host checks every PDU with its own parser
(tests/raw_pdu.py), digests included.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
from raw_pdu import SUBNQN, RawPeer, admin_host, capsule_cmd, connect_pdu, serve, sqe, wait_until

from nvmeof.spec.nvme import Command, IoOpcode

COMMANDS = 8


def _count(conn: Any) -> dict[str, int]:
    """Count the connection's receive wake-ups and its transport's writes (instance attributes shadow
    the class methods, so only this connection is counted)."""
    seen = {"receives": 0, "writes": 0}
    receive = conn._receive
    writelines = conn.transport.writelines

    def counted_receive(mv: memoryview) -> None:
        seen["receives"] += 1
        receive(mv)

    def counted_writelines(bufs: Any) -> None:
        seen["writes"] += 1
        writelines(bufs)

    conn._receive = counted_receive
    conn.transport.writelines = counted_writelines
    return seen


@contextlib.asynccontextmanager
async def _digest_io_queue(hdgst: bool, ddgst: bool) -> AsyncIterator[tuple[Any, RawPeer, Any]]:
    """A served target (RAM nsid 1), an admin queue and a raw I/O queue with these digests, connected:
    (served, the host's raw peer, the target's connection of that I/O queue)."""
    served = await serve()
    admin = peer = None
    try:
        admin, cntlid = await admin_host(served.port, hdgst=hdgst, ddgst=ddgst)
        peer = await RawPeer.open(served.port)
        await peer.handshake(hdgst=hdgst, ddgst=ddgst)
        cqe = await peer.command(connect_pdu(1, SUBNQN, qid=1, cntlid=cntlid, hdgst=hdgst, ddgst=ddgst), 1)
        assert cqe.status == 0
        (conn,) = [c for c in served.server.connections if c.queue.qid == 1]   # type: ignore[attr-defined]
        assert conn.conn.hdgst == hdgst and conn.conn.ddgst == ddgst
        yield served, peer, conn
    finally:
        if peer is not None:
            await peer.close()
        if admin is not None:
            admin.close()
        await served.target.close()   # type: ignore[attr-defined]


@pytest.mark.parametrize("digests", [(True, False), (False, True), (True, True)])
async def test_digest_replies_of_one_wake_up_leave_in_one_write(digests: tuple[bool, bool]) -> None:
    hdgst, ddgst = digests
    async with _digest_io_queue(hdgst, ddgst) as (_served, peer, conn):
        seen = _count(conn)
        # Half in-capsule writes, half reads of what they wrote, all in one send: one receive on loopback.
        blocks = [random.Random(i).randbytes(512) for i in range(COMMANDS // 2)]
        batch = b""
        for i, data in enumerate(blocks):
            batch += capsule_cmd(sqe(Command(IoOpcode.WRITE, nsid=1, cdw10=i, cdw12=0), cid=10 + i,
                                     data_len=512, incapsule=True), data, hdgst=hdgst, ddgst=ddgst)
        for i in range(COMMANDS // 2):
            batch += capsule_cmd(sqe(Command(IoOpcode.READ, nsid=1, cdw10=i, cdw12=0), cid=20 + i, data_len=512),
                                 hdgst=hdgst, ddgst=ddgst)
        await peer.send(batch)
        cids = [10 + i for i in range(COMMANDS // 2)] + [20 + i for i in range(COMMANDS // 2)]
        assert await peer.wait_for(lambda o: all(o.done(c) for c in cids), 5)
        assert not peer.out.errors, peer.out.errors
        assert peer.out.term is None
        assert all(peer.out.cqe(c).status == 0 for c in cids)   # type: ignore[union-attr]
        got = {p.fields.get("cccid"): p for p in peer.out.of_kind("c2h")}
        for i, data in enumerate(blocks):
            assert got[20 + i].fields["data"] == data
        # One write per wake-up, and fewer wake-ups than commands, so one write per PDU would show.
        assert seen["receives"] < COMMANDS, seen
        assert seen["writes"] == seen["receives"], seen


async def test_digest_replies_completing_together_leave_in_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads that wait for the backend and are let go in one loop iteration: one write for all replies."""
    async with _digest_io_queue(True, True) as (served, peer, conn):
        backend = served.target.subsystems[SUBNQN].namespaces[1].backend   # type: ignore[attr-defined]
        gate = asyncio.Event()
        waiting: list[int] = []
        read = backend.read

        async def gated_read(offset: int, length: int) -> Any:
            waiting.append(offset)
            await gate.wait()
            return await read(offset, length)

        monkeypatch.setattr(backend, "read", gated_read)
        seen = _count(conn)
        cids = list(range(30, 30 + COMMANDS))
        await peer.send(b"".join(capsule_cmd(sqe(Command(IoOpcode.READ, nsid=1, cdw10=i, cdw12=0), cid=cid,
                                                 data_len=512), hdgst=True, ddgst=True)
                                 for i, cid in enumerate(cids)))
        await wait_until(lambda: len(waiting) == COMMANDS, what="every read at the backend")
        assert seen["writes"] == 0, seen
        gate.set()
        assert await peer.wait_for(lambda o: all(o.done(c) for c in cids), 5)
        assert not peer.out.errors and peer.out.term is None, peer.out.errors
        assert all(peer.out.cqe(c).status == 0 for c in cids)   # type: ignore[union-attr]
        assert seen["writes"] == 1, seen
