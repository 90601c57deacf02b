"""I/O command set and the NVMe/TCP data paths (in-capsule, R2T/H2CData, C2HData, digests), loop transport."""

from __future__ import annotations

import asyncio
import errno
import os

import pytest
from target_host import NS_SIZE, SUBNQN, admin_session, io_session, make_target, open_loop

from nvmeof import defaults
from nvmeof.spec.nvme import DSM_AD, RW_FUA, SGL_ID_INCAPSULE, WZ_DEAC, AdminOpcode, Command, DsmRange, IoOpcode
from nvmeof.spec.tcp import FatalErrorStatus
from nvmeof.status import Status
from target.backends.base import BackendError
from target.backends.ram import RamBackend
from target.model import Namespace

BLOCKS = NS_SIZE // 512


@pytest.fixture
async def target():
    tgt = make_target()
    yield tgt
    await tgt.close()


async def session(target, **kwargs):
    admin, cntlid = await admin_session(target, SUBNQN, **kwargs)
    io = await io_session(target, SUBNQN, cntlid, **kwargs)
    return admin, io


def rw(op: int, slba: int, nlb: int, nsid: int = 1, cdw12_extra: int = 0) -> Command:
    return Command(op, nsid=nsid, cdw10=slba & 0xFFFFFFFF, cdw11=slba >> 32, cdw12=((nlb - 1) & 0xFFFF) | cdw12_extra)


async def write(io, slba, data, **kw):
    return await io.cmd(rw(IoOpcode.WRITE, slba, len(data) // 512, **kw), data)


async def read(io, slba, nlb, **kw):
    return await io.cmd(rw(IoOpcode.READ, slba, nlb, **kw), read_len=nlb * 512)


async def test_write_read_roundtrip_incapsule(target):
    _, io = await session(target)
    data = os.urandom(4096)
    res = await write(io, 10, data)
    assert res.status == 0 and io.r2ts == []
    res = await read(io, 10, 8)
    assert res.status == 0 and res.data == data
    ns = target.subsystems[SUBNQN].namespaces[1]
    assert ns.stats.writes == 1 and ns.stats.write_bytes == 4096
    assert ns.stats.reads == 1 and ns.stats.read_bytes == 4096 and ns.stats.read_latency_ns > 0


async def test_large_write_uses_one_r2t_and_h2c_pieces(target):
    _, io = await session(target)
    data = os.urandom(512 * 1024)    # 4 H2CData PDUs of MAXH2CDATA
    res = await io.cmd(rw(IoOpcode.WRITE, 100, len(data) // 512), data)
    assert res.status == 0
    assert len(io.r2ts) == 1 and io.r2ts[0].offset == 0 and io.r2ts[0].length == len(data)
    res = await read(io, 100, len(data) // 512)
    assert res.data == data


async def test_small_write_via_r2t(target):
    _, io = await session(target)
    data = os.urandom(512)
    res = await io.cmd(rw(IoOpcode.WRITE, 0, 1), data, incapsule=False)
    assert res.status == 0 and len(io.r2ts) == 1
    assert (await read(io, 0, 1)).data == data


async def test_concurrent_commands_complete(target):
    _, io = await session(target)
    blobs = [os.urandom(8192) for _ in range(16)]
    results = await asyncio.gather(*(io.cmd(rw(IoOpcode.WRITE, i * 16, 16), b, incapsule=i % 2 == 0)
                                     for i, b in enumerate(blobs)))
    assert all(r.status == 0 for r in results)
    reads = await asyncio.gather(*(read(io, i * 16, 16) for i in range(16)))
    assert [r.data for r in reads] == blobs


@pytest.mark.parametrize(("hdgst", "ddgst"), [(True, False), (False, True), (True, True)])
async def test_digests(target, hdgst, ddgst):
    _, io = await session(target, hdgst=hdgst, ddgst=ddgst)
    assert io.conn.hdgst == hdgst and io.conn.ddgst == ddgst
    small = os.urandom(2048)
    big = os.urandom(300 * 1024)
    assert (await write(io, 0, small)).status == 0
    assert (await io.cmd(rw(IoOpcode.WRITE, 8, len(big) // 512), big)).status == 0
    assert (await read(io, 0, 4)).data == small
    assert (await read(io, 8, len(big) // 512)).data == big


async def test_h2c_data_digest_error_fails_command(target):
    _, io = await session(target, ddgst=True)
    io.corrupt_h2c_digest = True
    res = await io.cmd(rw(IoOpcode.WRITE, 0, 8), os.urandom(4096), incapsule=False)
    assert res.status == Status.TRANSIENT_TR_ERR and not res.cqe.dnr
    io.corrupt_h2c_digest = False
    assert (await read(io, 0, 8)).data == bytes(4096)   # nothing was written


async def test_c2h_success_flag_only_without_sqflow(target):
    _admin, cntlid = await admin_session(target, SUBNQN)
    io = await io_session(target, SUBNQN, cntlid, cattr=1 << 2)
    data = os.urandom(1024)
    assert (await write(io, 0, data)).status == 0
    res = await read(io, 0, 2)
    assert res.data == data and res.cqe.sqhd == 0xFFFF
    assert io.success_flags == [res.cqe.cid]
    io_flow = await io_session(target, SUBNQN, cntlid, qid=2)
    res = await read(io_flow, 0, 2)
    assert res.data == data and io_flow.success_flags == []


async def _in_capsule_write(io, cid: int, *, nlb: int, sgl_length: int) -> int:
    """A Write of ``nlb`` blocks whose in-capsule SGL says ``sgl_length`` bytes, sent with 512 bytes of
    capsule data whatever they say: the completion's status."""
    cmd = rw(IoOpcode.WRITE, 0, nlb)
    cmd.cid = cid
    cmd.dptr = Command.make_sgl(SGL_ID_INCAPSULE, 0, sgl_length)
    fut = asyncio.get_running_loop().create_future()
    io.pending[cid] = fut
    io.conn.send_command(cmd.to_bytes(), bytes(512))
    io.flush()
    return (await asyncio.wait_for(fut, 2)).status


async def test_read_write_errors(target):
    _, io = await session(target)
    assert (await read(io, BLOCKS - 1, 2)).status == Status.LBA_RANGE
    assert (await read(io, BLOCKS, 1)).status == Status.LBA_RANGE
    assert (await read(io, 1 << 40, 1)).status == Status.LBA_RANGE
    assert (await write(io, BLOCKS - 1, bytes(1024))).status == Status.LBA_RANGE
    res = await read(io, BLOCKS - 1, 1)
    assert res.status == 0
    assert (await read(io, 0, 1, nsid=9)).status == Status.INVALID_NS
    res = await io.cmd(Command(0x7E, nsid=1))
    assert res.status == Status.INVALID_OPCODE and res.cqe.dnr
    # SGL length disagreeing with NLB
    res = await io.cmd(rw(IoOpcode.READ, 0, 2), read_len=512)
    assert res.status == Status.SGL_INVALID_DATA
    # beyond MDTS (on a namespace big enough that the range itself is fine)
    target.subsystems[SUBNQN].namespaces[3] = Namespace(3, RamBackend(4 << 20))
    too_big = defaults.MAX_TRANSFER // 512 + 8
    res = await io.cmd(rw(IoOpcode.READ, 0, too_big, nsid=3), read_len=too_big * 512)
    assert res.status == Status.INVALID_FIELD
    # an in-capsule SGL announcing more than the queue accepts
    assert await _in_capsule_write(io, 900, nlb=32, sgl_length=16384) == Status.SGL_INVALID_OFFSET
    # in-capsule SGL length and capsule data disagree
    assert await _in_capsule_write(io, 901, nlb=2, sgl_length=1024) == Status.SGL_INVALID_DATA
    # a keyed SGL makes no sense on TCP
    cmd = rw(IoOpcode.READ, 0, 1)
    cmd.dptr = Command.make_sgl(0x40, 0x1000, 512, key=7)
    assert (await io.cmd(cmd)).status == Status.SGL_INVALID_TYPE
    # more in-capsule data than the connection accepts is a framing error: C2HTermReq, connection closed
    io.conn.send_command(rw(IoOpcode.WRITE, 0, 32).to_bytes(), bytes(16384))
    io.flush()
    await asyncio.wait_for(io.lost, 2)
    assert io.term_reqs[0].fes == FatalErrorStatus.DATA_LIMIT_EXCEEDED


async def test_read_only_namespace(target):
    target.subsystems[SUBNQN].namespaces[2] = Namespace(2, RamBackend(1 << 20), read_only=True)
    _, io = await session(target)
    assert (await write(io, 0, bytes(512), nsid=2)).status == Status.NS_WRITE_PROTECTED
    assert (await io.cmd(rw(IoOpcode.WRITE_ZEROES, 0, 1, nsid=2))).status == Status.NS_WRITE_PROTECTED
    assert (await read(io, 0, 1, nsid=2)).status == 0


async def test_flush_fua_and_vwc_disabled(target):
    admin, io = await session(target)
    assert (await io.cmd(Command(IoOpcode.FLUSH, nsid=1))).status == 0
    assert (await io.cmd(Command(IoOpcode.FLUSH, nsid=0xFFFFFFFF))).status == 0
    assert (await io.cmd(Command(IoOpcode.FLUSH, nsid=5))).status == Status.INVALID_NS
    assert (await write(io, 0, b"\x5a" * 512, cdw12_extra=RW_FUA)).status == 0
    assert (await admin.cmd(Command(AdminOpcode.SET_FEATURES, cdw10=0x06, cdw11=0))).status == 0
    assert (await io.cmd(Command(IoOpcode.FLUSH, nsid=1))).status == 0
    assert (await read(io, 0, 1)).data == b"\x5a" * 512


async def test_write_zeroes_and_deallocate(target):
    _, io = await session(target)
    data = os.urandom(8 * 512)
    assert (await write(io, 0, data)).status == 0
    assert (await io.cmd(rw(IoOpcode.WRITE_ZEROES, 2, 2))).status == 0
    got = (await read(io, 0, 8)).data
    assert got == data[:1024] + bytes(1024) + data[2048:]
    assert (await io.cmd(rw(IoOpcode.WRITE_ZEROES, 6, 2, cdw12_extra=WZ_DEAC))).status == 0
    assert (await read(io, 0, 8)).data == data[:1024] + bytes(1024) + data[2048:3072] + bytes(1024)
    assert (await io.cmd(rw(IoOpcode.WRITE_ZEROES, BLOCKS - 1, 2))).status == Status.LBA_RANGE


async def test_dataset_management(target):
    _, io = await session(target)
    data = os.urandom(64 * 512)
    assert (await write(io, 0, data)).status == 0
    ranges = b"".join(DsmRange.build({"cattr": 0, "nlb": nlb, "slba": slba}) for slba, nlb in ((0, 8), (32, 16)))
    res = await io.cmd(Command(IoOpcode.DATASET_MANAGEMENT, nsid=1, cdw10=1, cdw11=DSM_AD), ranges)
    assert res.status == 0
    got = (await read(io, 0, 64)).data
    assert got == bytes(8 * 512) + data[8 * 512:32 * 512] + bytes(16 * 512) + data[48 * 512:]
    # without AD it is only a hint
    assert (await write(io, 0, data)).status == 0
    res = await io.cmd(Command(IoOpcode.DATASET_MANAGEMENT, nsid=1, cdw10=1, cdw11=1), ranges)
    assert res.status == 0 and (await read(io, 0, 64)).data == data
    # a range past the end fails the whole command and changes nothing
    bad = DsmRange.build({"cattr": 0, "nlb": 8, "slba": 0}) + DsmRange.build({"cattr": 0, "nlb": 2, "slba": BLOCKS - 1})
    res = await io.cmd(Command(IoOpcode.DATASET_MANAGEMENT, nsid=1, cdw10=1, cdw11=DSM_AD), bad)
    assert res.status == Status.LBA_RANGE and (await read(io, 0, 64)).data == data
    # NR says 2 ranges, the data holds 1
    res = await io.cmd(Command(IoOpcode.DATASET_MANAGEMENT, nsid=1, cdw10=1, cdw11=DSM_AD), ranges[:16])
    assert res.status == Status.SGL_INVALID_DATA
    # one range in a 4 KiB buffer, as mkfs.xfs sends it (blktests nvme/012): only NR+1 ranges are read
    padded = DsmRange.build({"cattr": 0, "nlb": 4, "slba": 60}) + os.urandom(4096 - 16)
    res = await io.cmd(Command(IoOpcode.DATASET_MANAGEMENT, nsid=1, cdw10=0, cdw11=DSM_AD), padded)
    assert res.status == 0 and (await read(io, 0, 64)).data == data[:60 * 512] + bytes(4 * 512)
    too_long = await io.cmd(Command(IoOpcode.DATASET_MANAGEMENT, nsid=1, cdw10=0, cdw11=DSM_AD), bytes(4112))
    assert too_long.status == Status.SGL_INVALID_DATA


async def test_compare(target):
    _, io = await session(target)
    data = os.urandom(1024)
    assert (await write(io, 4, data)).status == 0
    assert (await io.cmd(rw(IoOpcode.COMPARE, 4, 2), data)).status == 0
    other = bytes([data[0] ^ 1]) + data[1:]
    res = await io.cmd(rw(IoOpcode.COMPARE, 4, 2), other)
    assert res.status == Status.COMPARE_FAILED


async def test_backend_error_is_internal(target, monkeypatch):
    _, io = await session(target)
    ns = target.subsystems[SUBNQN].namespaces[1]

    async def broken(offset, length):
        raise BackendError("ram backend is closed (its namespace was removed)")

    monkeypatch.setattr(ns.backend, "read", broken)
    res = await read(io, 0, 1)
    assert res.status == Status.INTERNAL


async def test_h2c_data_with_wrong_offset_gets_term_req(target):
    _, io = await session(target)
    data = os.urandom(4096)
    cmd = rw(IoOpcode.WRITE, 0, 8)
    fut = io.send(cmd, data, incapsule=False)
    # answer the R2T ourselves with a bad offset: swap the outgoing data for a PDU at offset 512
    await asyncio.sleep(0)
    io.outgoing[cmd.cid] = data
    # intercept: the host logic replies automatically; instead send a bad PDU first
    io.conn.send_h2c_data(cmd.cid, 0, 512, data[:512], last=False)
    io.flush()
    await asyncio.wait_for(io.lost, 2)
    assert io.term_reqs and io.term_reqs[0].fes == FatalErrorStatus.DATA_OUT_OF_RANGE
    with pytest.raises(ConnectionError):
        await fut


async def test_h2c_data_with_unknown_ttag_gets_term_req(target):
    _, io = await session(target)
    io.conn.send_h2c_data(1, 77, 0, bytes(512), last=True)
    io.flush()
    await asyncio.wait_for(io.lost, 2)
    assert io.term_reqs and io.term_reqs[0].fes == FatalErrorStatus.INVALID_HEADER_FIELD


async def test_malformed_pdu_gets_term_req_and_others_keep_working(target):
    _admin, io = await session(target)
    bad = await open_loop(target)
    assert bad.transport is not None
    bad.transport.write(bytes([0x04, 0, 72, 0]) + (60).to_bytes(4, "little"))   # CapsuleCmd, plen < hlen
    await asyncio.wait_for(bad.lost, 2)
    assert bad.term_reqs and bad.term_reqs[0].fes == FatalErrorStatus.INVALID_HEADER_FIELD
    data = os.urandom(512)
    assert (await write(io, 0, data)).status == 0 and (await read(io, 0, 1)).data == data


async def test_disconnect_mid_write_leaves_no_controller(target):
    admin, io = await session(target)
    data = os.urandom(256 * 1024)
    cmd = rw(IoOpcode.WRITE, 0, len(data) // 512)

    def half_then_vanish(r2t) -> bool:
        # one H2CData PDU of the two the R2T asks for, then the host is gone
        io.conn.send_h2c_data(r2t.cccid, r2t.ttag, 0, data[:128 * 1024], last=False)
        io.flush()
        assert io.transport is not None
        io.transport.close()
        return True

    io.r2t_hook = half_then_vanish
    fut = io.send(cmd, data, incapsule=False)
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(fut, 2)
    assert io.r2ts
    ctrl = next(iter(target.controllers.values()))
    await asyncio.sleep(0.01)
    assert 1 not in ctrl.queues       # the I/O queue is gone, the controller stays for its admin queue
    assert (await read(await io_session(target, SUBNQN, ctrl.cntlid), 0, 8)).data == bytes(4096)
    admin.close()
    await asyncio.wait_for(admin.lost, 2)
    await asyncio.sleep(0.01)
    assert not target.controllers


async def test_namespace_block_size_4096(target):
    target.subsystems[SUBNQN].namespaces[4] = Namespace(4, RamBackend(1 << 20), block_size=4096)
    _, io = await session(target)
    data = os.urandom(8192)
    assert (await io.cmd(rw(IoOpcode.WRITE, 3, 2, nsid=4), data)).status == 0
    assert (await io.cmd(rw(IoOpcode.READ, 3, 2, nsid=4), read_len=8192)).data == data
    assert (await io.cmd(rw(IoOpcode.READ, 255, 2, nsid=4), read_len=8192)).status == Status.LBA_RANGE


async def test_flood_of_commands_pauses_reading(target, monkeypatch):
    from target.transports.tcp import MAX_INFLIGHT

    _, io = await session(target)
    ns = target.subsystems[SUBNQN].namespaces[1]
    gate = asyncio.Event()
    real_read = ns.backend.read

    async def slow_read(offset, length):
        await gate.wait()
        return await real_read(offset, length)

    monkeypatch.setattr(ns.backend, "read", slow_read)
    futs = [io.send(rw(IoOpcode.READ, i, 1), read_len=512) for i in range(MAX_INFLIGHT + 40)]
    await asyncio.sleep(0.05)
    ctrl = next(iter(target.controllers.values()))
    conn = ctrl.queues[1].close.__self__
    assert conn._read_paused and len(conn._tasks) == MAX_INFLIGHT
    gate.set()
    results = await asyncio.wait_for(asyncio.gather(*futs), 5)
    assert all(r.status == 0 for r in results)
    assert not conn._read_paused


@pytest.mark.parametrize(("code", "status"), [(errno.ENOSPC, Status.CAP_EXCEEDED), (errno.EDQUOT, Status.CAP_EXCEEDED),
                                              (errno.EIO, Status.INTERNAL)])
@pytest.mark.parametrize("inline", [True, False])
async def test_file_write_errors_map_to_nvme_status_inline_and_on_the_pool(target, tmp_path, monkeypatch, code, status,
                                                                           inline):
    # nvmet errno_to_nvme_status: ENOSPC is Capacity Exceeded with DNR, anything else Internal Error;
    # the same whether the write ran on the event loop (InlinePolicy) or on the thread pool.
    from target.backends.file import FileBackend
    from target.backends.inline import InlinePolicy

    backend = FileBackend(tmp_path / "f.img", size=1 << 20, create=True)
    backend._nowait_write = False   # as on ext4: plain buffered writes, inline while fast ...
    backend._write_policy = InlinePolicy(slow_ns=1 << 50)   # ... however slow they are on a loaded machine
    if not inline:
        backend._inline_write_max = 0
    target.subsystems[SUBNQN].namespaces[6] = Namespace(6, backend)
    _, io = await session(target)
    try:
        assert (await write(io, 0, b"\x5a" * 4096, nsid=6)).status == 0
        real = os.pwritev

        def failing(fd, buffers, offset, flags=0):
            if fd == backend.fileno():
                raise OSError(code, os.strerror(code))
            return real(fd, buffers, offset, flags)

        monkeypatch.setattr(os, "pwritev", failing)
        res = await write(io, 8, b"\xa5" * 4096, nsid=6)
        assert res.status == status and res.cqe.dnr
        counts = backend.io_counts()
        assert (counts["inline"], counts["thread"]) == ((1, 0) if inline else (0, 2))
        monkeypatch.setattr(os, "pwritev", real)
        res = await read(io, 0, 16, nsid=6)
        assert res.status == 0 and res.data == b"\x5a" * 4096 + bytes(4096)
    finally:
        backend.close()
