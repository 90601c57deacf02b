"""A RAM disk's read held in the batch transport's backlog (the host does not read) against a later write.

The batch engine sends a RAM disk's read as a view of the disk (no copy); what the socket does not take waits
in SocketTransport's backlog as views. A block the socket took only in part is finished from the disk as it is
when the socket drains: a write landing meanwhile (another queue's) makes the host see a block half old, half
new, which single-block atomicity (AWUN 0) rules out.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

import pytest
from raw_pdu import SUBNQN, RawPeer, admin_host, connect_pdu, rw_capsule, serve, wait_until

from nvmeof.spec.nvme import IoOpcode

BLOCK = 512


@pytest.fixture
async def served():
    s = await serve(ns_size=8 << 20)
    yield s
    await s.target.close()


async def test_a_read_in_the_backlog_never_shows_a_torn_block(served):
    admin, cntlid = await admin_host(served.port)
    peer = await RawPeer.open(served.port)
    sock = peer.writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    await peer.handshake()
    res = await peer.command(connect_pdu(1, SUBNQN, qid=1, cntlid=cntlid), 1)
    assert res.status_code == 0
    conn: Any = next(c for c in served.server.connections if c.queue.qid == 1 and c.queue.ctrl
                     and c.queue.ctrl.cntlid == cntlid)
    conn.transport._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    backend = served.target.subsystems[SUBNQN].namespaces[1].backend
    size, reads = 128 * 1024, 16
    old, new = os.urandom(size * reads), os.urandom(size * reads)
    backend.write_nowait(0, old)
    peer.writer.transport.pause_reading()   # the host stops reading: the replies back up in the target
    await peer.send(b"".join(rw_capsule(IoOpcode.READ, 2 + i, i * size // BLOCK, size) for i in range(reads)))
    await wait_until(lambda: conn.transport._backlog_bytes > 0, what="replies in the target's backlog")
    for _ in range(5):
        await asyncio.sleep(0)
    backend.write_nowait(0, new)   # a write of another queue, completed while the reads wait to be sent
    peer.writer.transport.resume_reading()
    assert await peer.wait_for(lambda o: all(o.done(2 + i) for i in range(reads)), 10)
    torn = []
    for i in range(reads):
        data = peer.out.read_data(2 + i)
        assert len(data) == size
        base = i * size
        torn += [base + b for b in range(0, size, BLOCK)
                 if data[b:b + BLOCK] not in (old[base + b:base + b + BLOCK], new[base + b:base + b + BLOCK])]
    assert not torn, f"blocks half old, half new at byte offsets {torn[:4]}"
    admin.close()
    await peer.close()
