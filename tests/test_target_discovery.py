"""Discovery controller: Identify, log page 70h with offsets, features, AEN on discovery changes."""

from __future__ import annotations

import asyncio

import pytest
from target_host import HOSTNQN, SUBNQN, admin_session, make_target, open_loop

from nvmeof import defaults
from nvmeof.spec import identify as idf
from nvmeof.spec.fabrics import DiscoveryLogEntry, DiscoveryLogHeader, SubType
from nvmeof.spec.identify import IdentifyController
from nvmeof.spec.nvme import AdminOpcode, Command
from nvmeof.status import Status
from target.model import Listener, Referral, Subsystem


@pytest.fixture
async def target():
    tgt = make_target()
    tgt.listeners["io"] = Listener("tcp", "ipv4", "192.0.2.10", 4420, portid=1)
    tgt.listeners["disc"] = Listener("tcp", "ipv4", "192.0.2.10", 8009, portid=2, discovery=True)
    hidden = Subsystem(nqn="nqn.2026-01.com.example:hidden", serial="SN2", allow_any_host=False)
    tgt.subsystems[hidden.nqn] = hidden
    tgt.referrals.append(Referral("tcp", "ipv4", "192.0.2.99", 8009, portid=7))
    yield tgt
    await tgt.close()


def get_log(length: int, offset: int = 0, lid: int = 0x70) -> Command:
    numd = length // 4 - 1
    return Command(AdminOpcode.GET_LOG_PAGE, cdw10=lid | ((numd & 0xFFFF) << 16), cdw11=numd >> 16,
                   cdw12=offset)


async def read_log(host) -> bytes:
    header = (await host.cmd(get_log(1024), read_len=1024)).data
    numrec = DiscoveryLogHeader.parse(header).numrec
    size = 1024 * (1 + numrec)
    # read the log in two pieces with an offset, as nvme-cli does for large logs
    first_len = min(2048, size)
    first = (await host.cmd(get_log(first_len), read_len=first_len)).data
    if first_len == size:
        return first
    rest = (await host.cmd(get_log(size - first_len, offset=first_len), read_len=size - first_len)).data
    return first + rest


async def test_discovery_identify_and_log(target):
    host, cntlid = await admin_session(target, defaults.DISCOVERY_NQN)
    idc = IdentifyController.parse((await host.cmd(Command(AdminOpcode.IDENTIFY, cdw10=1), read_len=4096)).data)
    assert idc.cntrltype == idf.CNTRLTYPE_DISCOVERY and idc.cntlid == cntlid
    assert idc.subnqn == defaults.DISCOVERY_NQN and idc.oaes == idf.OAES_DISC_CHANGE and idc.kas == 1
    assert idc.lpa == idf.LPA_EXT_DATA and idc.maxcmd > 0
    page = await read_log(host)
    hdr = DiscoveryLogHeader.parse(page[:1024])
    assert hdr.genctr == target.genctr and hdr.recfmt == 0
    entries = [DiscoveryLogEntry.parse(page[1024 * (i + 1):1024 * (i + 2)]) for i in range(hdr.numrec)]
    nvm = [e for e in entries if e.subtype == SubType.NVME]
    assert [(e.subnqn, e.trsvcid, e.traddr, e.portid) for e in nvm] == [(SUBNQN, "4420", "192.0.2.10", 1)]
    assert nvm[0].trtype == 3 and nvm[0].adrfam == 1 and nvm[0].cntlid == 0xFFFF and nvm[0].asqsz == 32
    refs = [e for e in entries if e.subtype == SubType.REFERRAL]
    assert [(e.traddr, e.trsvcid, e.subnqn) for e in refs] == [("192.0.2.99", "8009", defaults.DISCOVERY_NQN)]
    assert hdr.numrec == 2   # loop connections come through no listener: no "current" entry


async def test_discovery_lists_allowed_subsystem_and_current_entry(target):
    target.subsystems["nqn.2026-01.com.example:hidden"].hosts.add(HOSTNQN)
    host, _ = await admin_session(target, defaults.DISCOVERY_NQN)
    host_conn = next(iter(target.controllers.values())).queues[0]
    host_conn.listener = target.listeners["disc"]
    page = await read_log(host)
    hdr = DiscoveryLogHeader.parse(page[:1024])
    entries = [DiscoveryLogEntry.parse(page[1024 * (i + 1):1024 * (i + 2)]) for i in range(hdr.numrec)]
    assert {e.subnqn for e in entries if e.subtype == SubType.NVME} == {SUBNQN, "nqn.2026-01.com.example:hidden"}
    current = [e for e in entries if e.subtype == SubType.CURRENT]
    assert len(current) == 1 and current[0].trsvcid == "8009" and current[0].subnqn == defaults.DISCOVERY_NQN


async def test_discovery_command_limits(target):
    host, _ = await admin_session(target, defaults.DISCOVERY_NQN)
    res = await host.cmd(Command(AdminOpcode.IDENTIFY, cdw10=0, nsid=1), read_len=4096)
    assert res.status == Status.INVALID_FIELD
    assert (await host.cmd(get_log(512, lid=0x02), read_len=512)).status == Status.INVALID_LOG_PAGE
    assert (await host.cmd(get_log(64, offset=2), read_len=64)).status == Status.INVALID_FIELD
    assert (await host.cmd(Command(AdminOpcode.ABORT))).status == Status.INVALID_OPCODE
    assert (await host.cmd(Command(AdminOpcode.KEEP_ALIVE))).status == 0
    assert (await host.cmd(Command(AdminOpcode.SET_FEATURES, cdw10=0x07, cdw11=1))).status == Status.INVALID_FIELD
    assert (await host.cmd(Command(AdminOpcode.SET_FEATURES, cdw10=0x0F, cdw11=30000))).status == 0
    assert (await host.cmd(Command(AdminOpcode.GET_FEATURES, cdw10=0x0F))).cqe.dw0 == 30000
    assert (await host.cmd(Command(AdminOpcode.SET_FEATURES, cdw10=0x0B, cdw11=1 << 8))).status == Status.INVALID_FIELD
    # discovery controllers have no I/O queues
    q = await open_loop(target)
    cntlid = next(iter(target.controllers))
    res = await q.connect(defaults.DISCOVERY_NQN, qid=1, cntlid=cntlid)
    assert res.status == Status.CONNECT_INVALID_PARAM
    assert target.controllers[cntlid].kato_ms == 30000
    assert (await host.cmd(Command(AdminOpcode.FORMAT_NVM))).status == Status.INVALID_OPCODE


async def test_discovery_change_aen(target):
    host, cntlid = await admin_session(target, defaults.DISCOVERY_NQN)
    assert target.controllers[cntlid].kato_ms == 120_000
    aer = host.send(Command(AdminOpcode.ASYNC_EVENT_REQUEST))
    before = target.genctr
    target.discovery_changed()
    res = await asyncio.wait_for(aer, 2)
    assert res.cqe.dw0 == 0x2 | (0xF0 << 8) | (0x70 << 16)
    hdr = DiscoveryLogHeader.parse((await host.cmd(get_log(1024), read_len=1024)).data)
    assert hdr.genctr == before + 1
    # reading the log re-arms the event
    aer = host.send(Command(AdminOpcode.ASYNC_EVENT_REQUEST))
    target.discovery_changed()
    assert (await asyncio.wait_for(aer, 2)).cqe.dw0 == 0x70F002
    # I/O controllers get no discovery events
    io_host, _ = await admin_session(target, SUBNQN)
    io_aer = io_host.send(Command(AdminOpcode.ASYNC_EVENT_REQUEST))
    target.discovery_changed()
    await asyncio.sleep(0.02)
    assert not io_aer.done()


async def test_peer_listeners_are_listed_and_a_change_bumps_genctr(target):
    """A gateway group member's peers (Target.set_peer_listeners) are entries of its discovery log; setting
    the same peers again is no change."""
    peer = Listener("tcp", "ipv4", "192.0.2.20", 4420, portid=3)
    genctr = target.genctr
    target.set_peer_listeners([peer])
    assert target.genctr == genctr + 1
    target.set_peer_listeners([Listener("tcp", "ipv4", "192.0.2.20", 4420, portid=3)])
    assert target.genctr == genctr + 1 and target.peer_listeners == [peer]
    host, _ = await admin_session(target, defaults.DISCOVERY_NQN)
    page = await read_log(host)
    hdr = DiscoveryLogHeader.parse(page[:1024])
    entries = [DiscoveryLogEntry.parse(page[1024 * (i + 1):1024 * (i + 2)]) for i in range(hdr.numrec)]
    assert [(e.traddr, e.portid) for e in entries if e.subtype == SubType.NVME] == [("192.0.2.10", 1),
                                                                                 ("192.0.2.20", 3)]
    target.set_peer_listeners([])
    assert target.genctr == genctr + 2 and target.peer_listeners == []
