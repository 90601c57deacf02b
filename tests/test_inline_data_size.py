"""A listener's in-capsule data size (nvmet's port param_inline_data_size): Identify's IOCCSZ and what its
I/O queues accept follow it, on both TCP engines, over the loop and real sockets; a capsule over it ends
the connection with the same TermReq from both engines."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from target_host import SUBNQN, TinyHost, make_target, open_tcp
from test_fast_paths import RecordingHost
from test_tcp_batch import _daemon_options, _fast_count, _listen, _use_batch

from nvmeof import defaults
from nvmeof.spec import tcp as spec
from nvmeof.spec.identify import IdentifyController
from nvmeof.spec.nvme import AdminOpcode, Command, IoOpcode
from target import schema
from target.model import Listener
from target.transports import loop as loop_transport

BIG = 128 * 1024


def _listener(size: int) -> Listener:
    return Listener("tcp", "ipv4", "127.0.0.1", 4420, portid=1, inline_data_size=size)


async def _open(tgt: Any, listener: Listener, factory: Any = TinyHost) -> Any:
    _, host = await loop_transport.create_loop_connection(tgt, lambda: factory(incapsule_limit=1 << 20),
                                                          listener=listener)
    await asyncio.wait_for(host.ready, 5)
    return host


async def _session(tgt: Any, listener: Listener, factory: Any = TinyHost) -> tuple[TinyHost, Any, int]:
    admin = await _open(tgt, listener)
    res = await admin.connect(SUBNQN)
    assert res.status == 0
    await admin.enable()
    ident = IdentifyController.parse((await admin.cmd(Command(AdminOpcode.IDENTIFY, cdw10=1), read_len=4096)).data)
    io = await _open(tgt, listener, factory)
    assert (await io.connect(SUBNQN, qid=1, cntlid=res.cqe.dw0 & 0xFFFF, sqsize=31)).status == 0
    return admin, io, ident.ioccsz


def _write(slba: int, data: bytes) -> Command:
    return Command(IoOpcode.WRITE, nsid=1, cdw10=slba, cdw12=len(data) // 512 - 1)


@pytest.mark.parametrize("batch", [False, True], ids=["stream", "batch"])
async def test_ioccsz_and_incapsule_writes_follow_the_listener(monkeypatch: pytest.MonkeyPatch, batch: bool) -> None:
    if batch:
        _use_batch(monkeypatch)
    tgt = make_target()
    try:
        admin, io, ioccsz = await _session(tgt, _listener(BIG))
        assert ioccsz == (64 + BIG) // 16   # nvmet_execute_identify_ctrl
        data = random.Random(1).randbytes(BIG)
        assert (await io.cmd(_write(64, data), data, incapsule=True)).status == 0
        read = await io.cmd(Command(IoOpcode.READ, nsid=1, cdw10=64, cdw12=BIG // 512 - 1), read_len=BIG)
        assert read.status == 0 and read.data == data
        if batch:
            assert _fast_count() >= 2   # the in-capsule write and the read took the fast path
        # the admin queue keeps its own size: a listener's size is for I/O queues
        for h in (admin, io):
            h.close()
        admin, io, ioccsz = await _session(tgt, _listener(0))
        assert ioccsz == 4   # the SQE alone: every write goes by R2T
        assert (await io.cmd(_write(0, data), data, incapsule=False)).status == 0
        for h in (admin, io):
            h.close()
    finally:
        await tgt.close()


async def _over_the_size(size: int) -> bytes:
    tgt = make_target()
    try:
        admin, io, _ = await _session(tgt, _listener(size), RecordingHost)
        data = bytes(size + 512)
        io.send(_write(0, data), data, incapsule=True)
        await asyncio.wait_for(io.lost, 5)
        admin.close()
        return bytes(io.received)
    finally:
        await tgt.close()


@pytest.mark.parametrize("size", [defaults.IO_INCAPSULE_SIZE, BIG])
async def test_capsule_over_the_listener_size_ends_the_connection_alike(monkeypatch: pytest.MonkeyPatch,
                                                                        size: int) -> None:
    stream = await _over_the_size(size)
    _use_batch(monkeypatch)
    batch = await _over_the_size(size)
    assert batch == stream
    assert _pdu_types(stream)[-1] == spec.PduType.C2H_TERM_REQ


def _pdu_types(stream: bytes) -> list[int]:
    """The type of each PDU in ``stream``, walked by the common header's PLEN."""
    types, pos = [], 0
    while pos < len(stream):
        types.append(stream[pos])
        pos += int.from_bytes(stream[pos + 4:pos + 8], "little")
    return types


async def test_socket_engine_serves_large_incapsule_writes_to_the_initiator() -> None:
    import initiator

    tgt = make_target()
    server = await _listen(tgt, 0)
    server.listener.inline_data_size = BIG
    try:
        async with initiator.connect("127.0.0.1", server.port, subnqn=SUBNQN, kato=0) as ctrl:
            assert ctrl.io_incapsule_size == BIG   # IOCCSZ * 16 - 64
            rng = random.Random(7)
            for size in (4096, 16384, BIG, 1 << 20):   # the last by R2T: above the size
                data = rng.randbytes(size)
                await ctrl.write(1, 0, data)
                assert await ctrl.read(1, 0, size // 512) == data
            blocks = [rng.randbytes(BIG) for _ in range(8)]
            await asyncio.gather(*(ctrl.write(1, i * 256, b) for i, b in enumerate(blocks)))
            assert await ctrl.read(1, 0, 8 * 256) == b"".join(blocks)
    finally:
        await server.stop()
        await tgt.close()


def test_rdma_listener_size_is_bounded_as_nvmet_rdma_bounds_it() -> None:
    assert schema.check_inline_data_size(defaults.RDMA_INLINE_DATA_SIZE_MAX, "rdma") == 16384
    with pytest.raises(schema.SchemaError, match="NVMET_RDMA_MAX_INLINE_DATA_SIZE"):
        schema.check_inline_data_size(defaults.RDMA_INLINE_DATA_SIZE_MAX + 16, "rdma")
    assert schema.check_inline_data_size(BIG, "tcp") == BIG


async def test_saved_and_shown(service: Any) -> None:
    from api import render
    from tests.ports import free_port

    port = free_port()
    lst = await service.add_listener("tcp", "127.0.0.1", port, inline_data_size=BIG)
    try:
        saved = service.snapshot()["listeners"]
        assert [item.get("inline_data_size") for item in saved] == [BIG]
        assert render.listener(lst).inline_data_size == BIG
    finally:
        await service.remove_listener(lst.id)
        await service.target.close()


async def test_worker_queues_keep_the_listener_size(tmp_path: Any) -> None:
    """A worker process's queue has no listener: the size comes with the handoff."""
    from nvmeof.cli.daemon import Daemon

    options, port = _daemon_options(tmp_path, workers=1, inline_data_size=BIG)
    daemon = Daemon(options)
    try:
        await daemon.start()
        pool = daemon.target.pool   # type: ignore[attr-defined]
        admin = await open_tcp(port, incapsule_limit=BIG)
        res = await admin.connect(defaults.DEFAULT_SUBSYSTEM_NQN)
        assert res.status == 0
        await admin.enable()
        io = await open_tcp(port, incapsule_limit=BIG)
        assert (await io.connect(defaults.DEFAULT_SUBSYSTEM_NQN, qid=1, cntlid=res.cqe.dw0 & 0xFFFF,
                                 sqsize=31)).status == 0
        data = random.Random(9).randbytes(BIG)
        assert (await io.cmd(_write(0, data), data, incapsule=True)).status == 0
        read = await io.cmd(Command(IoOpcode.READ, nsid=1, cdw10=0, cdw12=BIG // 512 - 1), read_len=BIG)
        assert read.data == data
        assert list(pool.placement().values()) == pool.pids()   # served by the worker
        io.close()
        admin.close()
    finally:
        await daemon.stop()
