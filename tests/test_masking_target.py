"""Per-host namespace visibility (masking) at the target: two controllers of two host NQNs on one subsystem
see different namespace lists (Identify CNS 02h, CNS 00h zeros, CNS 03h, log 0Ch), I/O to a masked NSID
answers Invalid Namespace (on the batch fast path too), and a visibility change sends Namespace Attribute
Changed (log 04h) and the ANA change event to exactly the controllers whose view changed.

One Target behind a real TCP listener (the default batch engine), driven by tests/target_host.py's host.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from ports import free_ports
from target_host import TinyHost, open_tcp

from nvmeof.spec.identify import IdentifyNamespace
from nvmeof.spec.logs import parse_ana_log
from nvmeof.spec.nvme import AdminOpcode, Command, IoOpcode
from nvmeof.status import Status
from target.core import Target
from target.service import TargetService

SUB = "nqn.2026-01.com.example:masking"
HOST_A = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-0000-0000-000000000001"
HOST_B = "nqn.2014-08.org.nvmexpress:uuid:bbbbbbbb-0000-0000-0000-000000000002"
AEN_NS_ATTR = 0x2 | (0x00 << 8) | (0x04 << 16)   # NOTICE, namespace attribute changed, log 04h
AEN_ANA = 0x2 | (0x03 << 8) | (0x0C << 16)
DEADLINE = 10.0
QUIET = 0.1   # how long a controller that must hear nothing is watched


def identify(cns: int, nsid: int = 0) -> Command:
    return Command(AdminOpcode.IDENTIFY, nsid=nsid, cdw10=cns)


def get_log(lid: int, length: int = 4096, *, rae: bool = False) -> Command:
    numd = length // 4 - 1
    return Command(AdminOpcode.GET_LOG_PAGE, nsid=0xFFFFFFFF, cdw10=lid | (int(rae) << 15) | (numd << 16))


def read(nsid: int) -> Command:
    return Command(IoOpcode.READ, nsid=nsid, cdw12=0)


def nsid_list(page: bytes) -> list[int]:
    out = []
    for (nsid,) in struct.iter_unpack("<I", page):
        if not nsid:
            break
        out.append(nsid)
    return out


@dataclass
class Ctrl:
    host: TinyHost
    io: TinyHost

    async def active(self) -> list[int]:
        return nsid_list((await self.host.cmd(identify(2), read_len=4096)).data)

    async def ana_nsids(self) -> dict[int, list[int]]:
        log = parse_ana_log((await self.host.cmd(get_log(0x0C), read_len=4096)).data)
        return {g.anagrpid: g.nsids for g in log.groups}

    async def changed(self) -> list[int]:
        return nsid_list((await self.host.cmd(get_log(0x04), read_len=4096)).data)

    def aers(self, n: int = 2) -> list[asyncio.Future]:
        return [self.host.send(Command(AdminOpcode.ASYNC_EVENT_REQUEST)) for _ in range(n)]


@dataclass
class Rig:
    tgt: Target
    svc: TargetService
    port: int

    async def ctrl(self, hostnqn: str) -> Ctrl:
        host = await open_tcp(self.port)
        res = await host.connect(SUB, hostnqn=hostnqn)
        assert res.status == 0, res
        await host.enable()
        io = await open_tcp(self.port)
        assert (await io.connect(SUB, qid=1, cntlid=res.cqe.dw0 & 0xFFFF, hostnqn=hostnqn)).status == 0
        return Ctrl(host, io)


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    tgt = Target()
    svc = TargetService(tgt)
    await svc.add_subsystem(SUB, serial="MASK1", hosts=[HOST_A, HOST_B])
    await svc.add_namespace(SUB, backend="ram", size=1 << 20, nsid=1)                      # everyone
    await svc.add_namespace(SUB, backend="ram", size=1 << 20, nsid=2, auto_visible=False, hosts=[HOST_A])
    await svc.add_namespace(SUB, backend="ram", size=1 << 20, nsid=3, anagrpid=2, auto_visible=False,
                            hosts=[HOST_B])
    port = free_ports(1)[0]
    await svc.add_listener("tcp", "127.0.0.1", port)
    yield Rig(tgt, svc, port)
    await tgt.close()


async def test_each_host_sees_its_own_namespaces(rig):
    a, b = await rig.ctrl(HOST_A), await rig.ctrl(HOST_B)
    assert await a.active() == [1, 2]
    assert await b.active() == [1, 3]
    # log 0Ch: only visible namespaces; group 2 holds only NSID 3, so A's log has no group 2 at all
    assert await a.ana_nsids() == {1: [1, 2]}
    assert await b.ana_nsids() == {1: [1], 2: [3]}
    # CNS 00h: a masked NSID is an inactive NSID for that host, which reads as zeros (success)
    hidden = await a.host.cmd(identify(0, nsid=3), read_len=4096)
    assert hidden.status == 0 and hidden.data == bytes(4096)
    assert IdentifyNamespace.parse((await b.host.cmd(identify(0, nsid=3), read_len=4096)).data).nsze == 2048
    # CNS 03h and I/O: Invalid Namespace or Format, as for an NSID nobody has
    assert (await a.host.cmd(identify(3, nsid=3), read_len=4096)).status == Status.INVALID_NS
    assert (await a.host.cmd(identify(3, nsid=9), read_len=4096)).status == Status.INVALID_NS
    assert (await b.host.cmd(identify(3, nsid=3), read_len=4096)).status == 0
    for ctrl, hidden_nsid, seen in ((a, 3, 2), (b, 2, 3)):
        bad = await ctrl.io.cmd(read(hidden_nsid), read_len=512)
        assert bad.status == Status.INVALID_NS and bad.cqe.dnr, bad
        assert (await ctrl.io.cmd(read(seen), read_len=512)).status == 0
        assert (await ctrl.io.cmd(read(1), read_len=512)).status == 0
        write = Command(IoOpcode.WRITE, nsid=hidden_nsid, cdw12=0)
        assert (await ctrl.io.cmd(write, bytes(512))).status == Status.INVALID_NS
        resv_report = Command(IoOpcode.RESV_REPORT, nsid=hidden_nsid, cdw10=(4096 // 4) - 1, cdw11=1)
        assert (await ctrl.io.cmd(resv_report, read_len=4096)).status == Status.INVALID_NS


async def test_host_add_and_remove_reach_exactly_that_controller(rig):
    a, b = await rig.ctrl(HOST_A), await rig.ctrl(HOST_B)
    aer_a, aer_b = a.aers(), b.aers()
    await rig.svc.add_namespace_host(SUB, 3, HOST_A)
    got = sorted([(await asyncio.wait_for(f, DEADLINE)).cqe.dw0 for f in aer_a])
    assert got == sorted([AEN_NS_ATTR, AEN_ANA])
    await asyncio.sleep(QUIET)
    assert not any(f.done() for f in aer_b)       # B's view did not change
    assert await a.changed() == [3]               # log 04h (read without RAE: re-arms the event)
    assert await a.active() == [1, 2, 3]
    assert (await a.io.cmd(read(3), read_len=512)).status == 0
    assert await a.ana_nsids() == {1: [1, 2], 2: [3]}
    await a.host.cmd(get_log(0x0C), read_len=4096)   # re-arms the ANA event too

    aer_a = a.aers()
    await rig.svc.remove_namespace_host(SUB, 3, HOST_A)
    assert sorted([(await asyncio.wait_for(f, DEADLINE)).cqe.dw0 for f in aer_a]) == sorted([AEN_NS_ATTR, AEN_ANA])
    assert not any(f.done() for f in aer_b)
    assert await a.changed() == [3]
    assert await a.active() == [1, 2]
    assert (await a.io.cmd(read(3), read_len=512)).status == Status.INVALID_NS
    assert await b.changed() == []


async def test_auto_visible_switch_tells_only_the_hosts_whose_view_changed(rig):
    a, b = await rig.ctrl(HOST_A), await rig.ctrl(HOST_B)
    aer_a, aer_b = a.aers(1), b.aers(1)
    await rig.svc.set_namespace_auto_visible(SUB, 2, True)    # A saw it already: only B is told
    assert (await asyncio.wait_for(aer_b[0], DEADLINE)).cqe.dw0 in (AEN_NS_ATTR, AEN_ANA)
    await asyncio.sleep(QUIET)
    assert not aer_a[0].done()
    assert await b.changed() == [2] and await b.active() == [1, 2, 3]
    assert rig.svc.get_namespace(SUB, 2).hosts == set()
    # off again with nobody listed: both lose it
    await rig.svc.set_namespace_auto_visible(SUB, 2, False)
    assert (await asyncio.wait_for(aer_a[0], DEADLINE)).cqe.dw0 in (AEN_NS_ATTR, AEN_ANA)
    assert await a.changed() == [2] and await a.active() == [1]
    assert await b.changed() == [2] and await b.active() == [1, 3]


async def test_new_masked_namespace_and_its_removal_are_told_only_to_its_host(rig):
    a, b = await rig.ctrl(HOST_A), await rig.ctrl(HOST_B)
    aer_a = a.aers()
    await rig.svc.add_namespace(SUB, backend="ram", size=1 << 20, nsid=4, auto_visible=False, hosts=[HOST_B])
    await rig.svc.remove_namespace(SUB, 4)
    await asyncio.sleep(QUIET)
    assert not any(f.done() for f in aer_a)
    assert await a.changed() == []           # A never learns NSID 4 was in use
    assert await b.changed() == [4]
    # a change to a masked namespace (disable) reaches only the hosts that see it
    await rig.svc.set_namespace_enabled(SUB, 3, False)
    assert await a.changed() == [] and await b.changed() == [3]


async def test_ana_group_move_of_a_masked_namespace_is_told_only_to_its_hosts(rig):
    a, b = await rig.ctrl(HOST_A), await rig.ctrl(HOST_B)
    aer_a, aer_b = a.aers(1), b.aers(1)
    await rig.svc.set_namespace_anagrpid(SUB, 3, 1)      # NSID 3 is B's only: A's log 0Ch does not change
    assert (await asyncio.wait_for(aer_b[0], DEADLINE)).cqe.dw0 == AEN_ANA
    await asyncio.sleep(QUIET)
    assert not aer_a[0].done()
    assert await b.ana_nsids() == {1: [1, 3]} and await a.ana_nsids() == {1: [1, 2]}
    # a namespace every host sees: both are told
    aer_b = b.aers(1)
    await rig.svc.set_namespace_anagrpid(SUB, 1, 2)
    for fut in (aer_a[0], aer_b[0]):
        assert (await asyncio.wait_for(fut, DEADLINE)).cqe.dw0 == AEN_ANA


async def test_statistics_leak_no_masked_namespace(rig, tmp_path):
    from nvmeof.spec.logs import SmartLog

    a, b = await rig.ctrl(HOST_A), await rig.ctrl(HOST_B)
    assert (await b.io.cmd(Command(IoOpcode.WRITE, nsid=3, cdw12=0), bytes(512))).status == 0
    smart = {}
    for who, ctrl in (("a", a), ("b", b)):
        page = (await ctrl.host.cmd(get_log(0x02, 512), read_len=512)).data
        smart[who] = SmartLog.parse(page).host_writes
    assert smart == {"a": 0, "b": 1}   # NSID FFFFFFFFh sums the namespaces the host sees
    smart_one = Command(AdminOpcode.GET_LOG_PAGE, nsid=3, cdw10=0x02 | ((512 // 4 - 1) << 16))
    assert (await a.host.cmd(smart_one, read_len=512)).status == Status.INVALID_NS


async def test_reservation_notice_skips_a_host_that_no_longer_sees_the_namespace():
    from target_host import make_target
    from test_target_reservations import connect

    from nvmeof.spec.reservations import ReservationType

    tgt = make_target()   # one subsystem allowing any host, NSID 1 seen by everyone
    try:
        ns = tgt.subsystems[next(iter(tgt.subsystems))].namespaces[1]
        a = await connect(tgt, bytes([0xA] * 16), HOST_A)
        b = await connect(tgt, bytes([0xB] * 16), HOST_B)
        assert (await a.register(0xA1)).status == 0 and (await b.register(0xB1)).status == 0
        ns.auto_visible, ns.hosts = False, {HOST_B}   # A keeps its registration but no longer sees NSID 1
        assert (await a.register(0xA2, crkey=0xA1, rrega=2)).status == Status.INVALID_NS
        # B preempts A: A's host would be sent "registration preempted" for NSID 1; masked, it is not
        res = await b.acquire(0xB1, ReservationType.WRITE_EXCLUSIVE, prkey=0xA1, racqa=1)
        assert res.status == 0, res
        assert (await a.resv_log()).count == 0
        ns.auto_visible = True   # the control: visible again, the next preemption reaches it
        assert (await a.register(0xA3)).status == 0
        assert (await b.acquire(0xB1, ReservationType.WRITE_EXCLUSIVE, prkey=0xA3, racqa=1)).status == 0
        assert (await a.resv_log()).count != 0
    finally:
        await tgt.close()
