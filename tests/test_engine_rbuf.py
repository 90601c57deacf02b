"""The host batch engine's receive buffer (initiator/engine.py ``_rbuf``) against one C2HData as long as it or longer.

A slot read's C2HData that misses less than TCP_DIRECT_PLACEMENT_MIN waits in ``_rbuf`` for its end; one longer
than the buffer (a 512 KiB read from this project's target, one C2HData per command) could fill it to the last
byte and leave the next receive no room: ``recv_into`` of an empty view returns 0, which the clear queue took for
the controller closing the connection, and the TLS queue decrypted nothing into it and hung until the timeout.

Here the buffer is made small (about 32 KiB) and the host reads only once the whole reply is in its socket, so its first
receive fills the buffer: a PDU exactly as long as the buffer, one 24 bytes longer (the header's length: cut at
the buffer's end) and one 8 KiB longer, in the clear and over TLS (the target's records cut to 1000 bytes, so
one receive of records decrypts to nearly the buffer's length).
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import random
import termios
from typing import Any

import pytest
from target_host import HOSTNQN, SUBNQN, serve_tls

import initiator
from initiator import engine
from initiator.engine import BatchQueue
from nvmeof.spec.nvme import IoOpcode
from nvmeof.spec.tcp import DATA_PDU_HEADER_SIZE
from nvmeof.tls.psk import HMAC_SHA256, generate_key

KEY = generate_key(hmac_id=HMAC_SHA256)
SIZE = 32 * 1024   # the read: one C2HData of SIZE + 24 bytes


def _inq(q: BatchQueue) -> int:
    buf = array.array("i", [0])
    assert q._sock is not None
    fcntl.ioctl(q._sock.fileno(), termios.FIONREAD, buf, True)
    return buf[0]


def _small_records(conn: Any) -> None:
    """The target's TLS session writes records of at most 1000 bytes of plaintext (a legal sender's choice)."""
    tls = conn._tls
    real = tls.send

    def send(data: Any) -> None:
        view = memoryview(data)
        for pos in range(0, len(view), 1000):
            real(view[pos:pos + 1000])

    tls.send = send


@pytest.mark.parametrize("tls", [False, True])
@pytest.mark.parametrize("over", [0, DATA_PDU_HEADER_SIZE, 8192])
async def test_a_c2hdata_as_long_as_the_receive_buffer_or_longer_is_received(monkeypatch: pytest.MonkeyPatch,
                                                                             tls: bool, over: int) -> None:
    rbuf = SIZE + DATA_PDU_HEADER_SIZE - over
    monkeypatch.setattr(engine, "RECV_BUFFER_SIZE", rbuf)
    tgt, server = await serve_tls("required" if tls else "none", KEY)
    try:
        async with initiator.connect("127.0.0.1", server.port, SUBNQN, hostnqn=HOSTNQN, nr_io_queues=1, kato=0,
                                     tls_key=KEY if tls else None, timeout=5) as ctrl:
            (q,) = ctrl.io_queues
            assert isinstance(q, BatchQueue) and len(q._rbuf) == rbuf
            (conn,) = [c for c in server.connections if c.queue.qid]
            if tls:
                _small_records(conn)
            size = SIZE
            data = random.Random(over).randbytes(size)
            await ctrl.write(1, 0, data)
            loop = asyncio.get_running_loop()
            for _ in range(2):   # the second read finds the buffer as the first one left it
                buf = memoryview(bytearray(size))
                done: asyncio.Future[BaseException | None] = loop.create_future()
                loop.remove_reader(q._fd)
                try:
                    q.start(IoOpcode.READ, 1, 0, size // 512, buf, False, lambda t, e: t.set_result(e), done)
                    q.kick()
                    # the whole reply (C2HData and CapsuleResp, their records) in the host's socket, then one wake-up
                    for _ in range(500):
                        if _inq(q) >= size + 2 * DATA_PDU_HEADER_SIZE and not conn.transport.get_write_buffer_size():
                            break
                        await asyncio.sleep(0.01)
                    await asyncio.sleep(0.02)
                finally:
                    loop.add_reader(q._fd, q._on_readable)
                assert await asyncio.wait_for(done, 10) is None
                assert bytes(buf) == data
    finally:
        await tgt.close()


async def test_512k_reads_at_the_real_buffer_size() -> None:
    """The case that found it: reads of 512 KiB (one C2HData of 512 KiB + 24 bytes, longer than the 512 KiB buffer)
    through the library API; once the socket held the whole reply, the queue broke as closed by the controller."""
    tgt, server = await serve_tls("none", KEY)
    try:
        async with initiator.connect("127.0.0.1", server.port, SUBNQN, hostnqn=HOSTNQN, nr_io_queues=1, kato=0,
                                     timeout=5) as ctrl:
            data = random.Random(5).randbytes(engine.RECV_BUFFER_SIZE)
            await ctrl.write(1, 0, data)
            for _ in range(20):
                assert bytes(await ctrl.read(1, 0, len(data) // 512)) == data
    finally:
        await tgt.close()
