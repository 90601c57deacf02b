"""The same tiny host over real TCP on 127.0.0.1: listener start/stop, I/O, discovery, teardown."""

from __future__ import annotations

import asyncio
import os

import pytest
from target_host import SUBNQN, make_target, open_tcp

from nvmeof import defaults
from nvmeof.spec.fabrics import DiscoveryLogEntry, DiscoveryLogHeader, SubType
from nvmeof.spec.nvme import AdminOpcode, Command, IoOpcode
from nvmeof.status import Status
from target.model import Listener


@pytest.fixture
async def served():
    tgt = make_target()
    listener = Listener("tcp", "ipv4", "127.0.0.1", 0, portid=1)
    tgt.listeners[listener.id] = listener
    server = await tgt.start_listener(listener)
    yield tgt, server.port
    await tgt.close()


async def test_io_over_tcp(served):
    tgt, port = served
    admin = await open_tcp(port, hdgst=True, ddgst=True)
    res = await admin.connect(SUBNQN, kato=5000)
    assert res.status == 0
    cntlid = res.cqe.dw0 & 0xFFFF
    await admin.enable()
    assert (await admin.cmd(Command(AdminOpcode.SET_FEATURES, cdw10=0x07, cdw11=(1 << 16) | 1))).status == 0
    queues = []
    for qid in (1, 2):
        q = await open_tcp(port, hdgst=True, ddgst=True)
        assert (await q.connect(SUBNQN, qid=qid, cntlid=cntlid, sqsize=127)).status == 0
        queues.append(q)
    info = tgt.controllers_info()[0]
    assert info["peer"].startswith("127.0.0.1:") and info["transport"] == "tcp"
    assert [q["qid"] for q in info["queues"]] == [0, 1, 2]
    data = os.urandom(600 * 1024)
    nlb = len(data) // 512
    res = await queues[0].cmd(Command(IoOpcode.WRITE, nsid=1, cdw10=0, cdw12=nlb - 1), data)
    assert res.status == 0 and len(queues[0].r2ts) == 1
    res = await queues[1].cmd(Command(IoOpcode.READ, nsid=1, cdw10=0, cdw12=nlb - 1), read_len=len(data))
    assert res.status == 0 and res.data == data
    small = os.urandom(4096)
    res = await queues[1].cmd(Command(IoOpcode.WRITE, nsid=1, cdw10=2000, cdw12=7), small)
    assert res.status == 0 and queues[1].r2ts == []
    res = await queues[0].cmd(Command(IoOpcode.READ, nsid=1, cdw10=2047, cdw12=1), read_len=1024)
    assert res.status == Status.LBA_RANGE
    # host vanishes: controller and queues go away
    for q in (admin, *queues):
        assert q.transport is not None
        q.transport.abort()
    for _ in range(100):
        if not tgt.controllers:
            break
        await asyncio.sleep(0.01)
    assert not tgt.controllers


async def test_discovery_over_tcp(served):
    _tgt, port = served
    host = await open_tcp(port)
    assert (await host.connect(defaults.DISCOVERY_NQN)).status == 0
    await host.enable()
    res = await host.cmd(Command(AdminOpcode.GET_LOG_PAGE, cdw10=0x70 | ((4096 // 4 - 1) << 16)), read_len=4096)
    assert res.status == 0
    hdr = DiscoveryLogHeader.parse(res.data[:1024])
    entries = [DiscoveryLogEntry.parse(res.data[1024 * (i + 1):1024 * (i + 2)]) for i in range(hdr.numrec)]
    nvm = [e for e in entries if e.subtype == SubType.NVME]
    assert [(e.subnqn, e.traddr, e.trsvcid) for e in nvm] == [(SUBNQN, "127.0.0.1", str(port))]
    current = [e for e in entries if e.subtype == SubType.CURRENT]
    assert len(current) == 1 and current[0].subnqn == defaults.DISCOVERY_NQN


async def test_stop_listener_closes_connections(served):
    tgt, port = served
    host = await open_tcp(port)
    assert (await host.connect(SUBNQN)).status == 0
    listener = next(iter(tgt.listeners.values()))
    await tgt.stop_listener(listener)
    await asyncio.wait_for(host.lost, 2)
    assert not tgt.controllers
    with pytest.raises(OSError):
        await open_tcp(port)


async def test_bad_icreq_gets_term_req(served):
    _, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    # ICReq with pfv 1: unsupported parameter
    icreq = bytes([0, 0, 128, 0]) + (128).to_bytes(4, "little") + (1).to_bytes(2, "little") + bytes(118)
    writer.write(icreq)
    await writer.drain()
    reply = await asyncio.wait_for(reader.read(), 2)
    assert reply[0] == 0x03 and int.from_bytes(reply[8:10], "little") == 0x06   # C2HTermReq, FES 6
    writer.close()
