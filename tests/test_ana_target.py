"""ANA reporting in the target (issue 15): Identify fields, log page 0Ch per listener (RGO, offsets,
RAE), ANA change AENs only to the affected listener's controllers, the ANA status codes on I/O through
an inaccessible path while another path of the same target serves it, controller ID ranges.

One Target with two real TCP listeners (two ports of one subsystem) driven by tests/target_host.py's
raw NVMe/TCP host, plus the loop transport (no listener: every group optimized).
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from ports import free_ports
from target_host import SUBNQN, TinyHost, admin_session, make_target, open_tcp

from nvmeof import defaults
from nvmeof.spec import identify as idf
from nvmeof.spec.identify import IdentifyController, IdentifyNamespace
from nvmeof.spec.logs import AnaState, ana_log_size, parse_ana_log
from nvmeof.spec.nvme import AdminOpcode, Command, IoOpcode
from nvmeof.status import Status
from target.core import Target
from target.service import TargetService

SUB = "nqn.2026-01.com.example:ana"
AEN_ANA = 0x2 | (0x03 << 8) | (0x0C << 16)   # NOTICE, ANA change, log 0Ch
DEADLINE = 10.0


def identify(cns: int, nsid: int = 0) -> Command:
    return Command(AdminOpcode.IDENTIFY, nsid=nsid, cdw10=cns)


def get_ana_log(length: int = 4096, *, offset: int = 0, rgo: bool = False, rae: bool = False) -> Command:
    numd = length // 4 - 1
    return Command(AdminOpcode.GET_LOG_PAGE, nsid=0xFFFFFFFF,
                   cdw10=0x0C | (int(rgo) << 8) | (int(rae) << 15) | ((numd & 0xFFFF) << 16), cdw11=numd >> 16,
                   cdw12=offset & 0xFFFFFFFF, cdw13=offset >> 32)


def read(nsid: int, slba: int = 0, nlb: int = 0) -> Command:
    return Command(IoOpcode.READ, nsid=nsid, cdw10=slba & 0xFFFFFFFF, cdw11=slba >> 32, cdw12=nlb)


@dataclass
class Path:
    host: TinyHost
    io: TinyHost
    cntlid: int


@dataclass
class Rig:
    tgt: Target
    svc: TargetService
    ports: list[int]
    lids: list[str]

    async def path(self, index: int) -> Path:
        port = self.ports[index]
        host = await open_tcp(port)
        res = await host.connect(SUB)
        assert res.status == 0, res
        await host.enable()
        cntlid = res.cqe.dw0 & 0xFFFF
        io = await open_tcp(port)
        assert (await io.connect(SUB, qid=1, cntlid=cntlid, sqsize=31)).status == 0
        return Path(host, io, cntlid)


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    tgt = Target()
    svc = TargetService(tgt)
    await svc.add_subsystem(SUB, serial="ANA1")
    await svc.add_namespace(SUB, backend="ram", size=1 << 20, nsid=1)
    await svc.add_namespace(SUB, backend="ram", size=1 << 20, nsid=2, anagrpid=2)
    await svc.add_namespace(SUB, backend="ram", size=1 << 20, nsid=3, anagrpid=2)
    ports = free_ports(2)
    lids = [(await svc.add_listener("tcp", "127.0.0.1", port)).id for port in ports]
    yield Rig(tgt, svc, ports, lids)
    await tgt.close()


async def test_identify_reports_ana(rig):
    p = await rig.path(0)
    idc = IdentifyController.parse((await p.host.cmd(identify(1), read_len=4096)).data)
    assert idc.cmic == idf.CMIC_MULTI_PORT | idf.CMIC_MULTI_CTRL | idf.CMIC_ANA
    assert idc.anacap == 0x1F   # optimized, non-optimized, inaccessible, persistent loss, change; bit 6 clear
    assert idc.anatt == defaults.ANATT > 0
    assert idc.anagrpmax == idc.nanagrpid == defaults.ANAGRPMAX
    assert idc.oaes & idf.OAES_ANA and idc.oaes & idf.OAES_NS_ATTR
    assert 0 < idc.mnan <= idc.nn
    # what nvme_mpath_init_identify checks: the worst-case log fits MDTS, or ANA is turned off
    assert ana_log_size(idc.nanagrpid, idc.mnan) <= (1 << idc.mdts) * defaults.PAGE_SIZE
    ids = IdentifyNamespace.parse((await p.host.cmd(identify(0, nsid=2), read_len=4096)).data)
    assert ids.anagrpid == 2 and ids.nmic & idf.NMIC_SHARED
    assert IdentifyNamespace.parse((await p.host.cmd(identify(0, nsid=1), read_len=4096)).data).anagrpid == 1


async def test_ana_log_per_listener_with_and_without_rgo(rig):
    await rig.svc.set_ana_state(rig.lids[1], 2, AnaState.INACCESSIBLE)
    a, b = await rig.path(0), await rig.path(1)
    log_a = parse_ana_log((await a.host.cmd(get_ana_log(), read_len=4096)).data)
    log_b = parse_ana_log((await b.host.cmd(get_ana_log(), read_len=4096)).data)
    assert [(g.anagrpid, g.state, g.nsids) for g in log_a.groups] == [(1, AnaState.OPTIMIZED, [1]),
                                                                      (2, AnaState.OPTIMIZED, [2, 3])]
    assert [(g.anagrpid, g.state, g.nsids) for g in log_b.groups] == [(1, AnaState.OPTIMIZED, [1]),
                                                                      (2, AnaState.INACCESSIBLE, [2, 3])]
    assert log_a.chgcnt == log_b.chgcnt == rig.tgt.ana_chgcnt > 0
    assert log_b.groups[1].chgcnt == rig.tgt.ana_group_chgcnt[2] > 0
    # RGO: the descriptors alone, NNSIDS 0
    page = (await b.host.cmd(get_ana_log(rgo=True), read_len=4096)).data
    rgo = parse_ana_log(page)
    assert [(g.anagrpid, g.state, g.nsids) for g in rgo.groups] == [(1, AnaState.OPTIMIZED, []),
                                                                    (2, AnaState.INACCESSIBLE, [])]
    assert page[16 + 2 * 32:] == bytes(4096 - 16 - 2 * 32)
    # read in pieces (LPO): the same bytes as one read
    whole = (await b.host.cmd(get_ana_log(128), read_len=128)).data
    first = (await b.host.cmd(get_ana_log(64), read_len=64)).data
    rest = (await b.host.cmd(get_ana_log(64, offset=64), read_len=64)).data
    assert first + rest == whole
    assert struct.unpack_from("<H", whole, 8)[0] == 2
    # an offset past the page is refused; a misaligned one too
    bad = await b.host.cmd(get_ana_log(64, offset=4096), read_len=64)
    assert bad.status == Status.INVALID_FIELD
    assert (await b.host.cmd(get_ana_log(64, offset=2), read_len=64)).status == Status.INVALID_FIELD


async def test_loop_transport_has_every_group_optimized():
    tgt = make_target()
    try:
        host, _ = await admin_session(tgt, SUBNQN)
        log = parse_ana_log((await host.cmd(get_ana_log(), read_len=4096)).data)
        assert [(g.anagrpid, g.state, g.nsids) for g in log.groups] == [(1, AnaState.OPTIMIZED, [1])]
    finally:
        await tgt.close()


async def test_aen_only_to_the_affected_listeners_controllers_and_rearmed_by_reading(rig):
    a, b = await rig.path(0), await rig.path(1)
    aer_a = a.host.send(Command(AdminOpcode.ASYNC_EVENT_REQUEST))
    aer_b = b.host.send(Command(AdminOpcode.ASYNC_EVENT_REQUEST))
    await asyncio.sleep(0.05)
    assert not aer_a.done() and not aer_b.done()
    await rig.svc.set_ana_state(rig.lids[1], 2, AnaState.INACCESSIBLE)
    res = await asyncio.wait_for(aer_b, DEADLINE)
    assert res.status == 0 and res.cqe.dw0 == AEN_ANA
    await asyncio.sleep(0.05)
    assert not aer_a.done()   # listener 0's controllers saw no change
    # setting the same state again is no change: no event
    await rig.svc.set_ana_state(rig.lids[1], 2, "inaccessible")
    # masked until log 0Ch is read without RAE; a read with RAE keeps it masked
    aer_b2 = b.host.send(Command(AdminOpcode.ASYNC_EVENT_REQUEST))
    await rig.svc.set_ana_state(rig.lids[1], 2, AnaState.CHANGE)
    await asyncio.sleep(0.05)
    assert not aer_b2.done()
    await b.host.cmd(get_ana_log(rae=True), read_len=4096)
    await rig.svc.set_ana_state(rig.lids[1], 2, AnaState.NON_OPTIMIZED)
    await asyncio.sleep(0.05)
    assert not aer_b2.done()
    await b.host.cmd(get_ana_log(), read_len=4096)
    await rig.svc.set_ana_state(rig.lids[1], 2, AnaState.OPTIMIZED)
    assert (await asyncio.wait_for(aer_b2, DEADLINE)).cqe.dw0 == AEN_ANA
    assert not aer_a.done()


async def test_bulk_states_one_event_per_controller(rig):
    a, b = await rig.path(0), await rig.path(1)
    aer_a = a.host.send(Command(AdminOpcode.ASYNC_EVENT_REQUEST))
    aer_b = b.host.send(Command(AdminOpcode.ASYNC_EVENT_REQUEST))
    await rig.svc.set_ana_states({1: AnaState.NON_OPTIMIZED, 2: AnaState.INACCESSIBLE})   # every I/O listener
    assert (await asyncio.wait_for(aer_a, DEADLINE)).cqe.dw0 == AEN_ANA
    assert (await asyncio.wait_for(aer_b, DEADLINE)).cqe.dw0 == AEN_ANA
    for p in (a, b):
        log = parse_ana_log((await p.host.cmd(get_ana_log(), read_len=4096)).data)
        assert log.states() == {1: AnaState.NON_OPTIMIZED, 2: AnaState.INACCESSIBLE}
    # runtime only: the configuration keeps nothing
    assert all("ana_states" not in lst for lst in rig.svc.snapshot()["listeners"])
    report = {r["listener_id"]: r for r in rig.svc.ana_report()}
    assert report[rig.lids[0]]["states"] == {"1": "non-optimized", "2": "inaccessible"}
    assert report[rig.lids[0]]["saved"] == {}
    # only the named listener
    await rig.svc.set_ana_states({2: "optimized"}, listener_ids=[rig.lids[0]])
    assert rig.tgt.listeners[rig.lids[0]].ana_state(2) == AnaState.OPTIMIZED
    assert rig.tgt.listeners[rig.lids[1]].ana_state(2) == AnaState.INACCESSIBLE


async def test_io_fails_over_with_ana_status_while_the_other_path_serves(rig):
    a, b = await rig.path(0), await rig.path(1)
    for state, status in ((AnaState.INACCESSIBLE, Status.ANA_INACCESSIBLE),
                          (AnaState.PERSISTENT_LOSS, Status.ANA_PERSISTENT_LOSS),
                          (AnaState.CHANGE, Status.ANA_TRANSITION)):
        await rig.svc.set_ana_state(rig.lids[1], 2, state)
        bad = await b.io.cmd(read(2), read_len=512)
        assert bad.status == status and not bad.cqe.dnr, bad   # DNR clear: the host retries on another path
        assert (await a.io.cmd(read(2), read_len=512)).status == 0   # same namespace, other listener
        assert (await b.io.cmd(read(1), read_len=512)).status == 0   # group 1 stays reachable here
        # admin commands still work on the inaccessible path
        assert (await b.host.cmd(identify(0, nsid=2), read_len=4096)).status == 0
    await rig.svc.set_ana_state(rig.lids[1], 2, AnaState.NON_OPTIMIZED)
    assert (await b.io.cmd(read(3), read_len=512)).status == 0


async def test_namespace_group_change_and_new_namespace_send_the_ana_event(rig):
    a = await rig.path(0)
    await rig.svc.set_ana_state(rig.lids[0], 3, AnaState.INACCESSIBLE)
    aer = a.host.send(Command(AdminOpcode.ASYNC_EVENT_REQUEST))
    before = rig.tgt.ana_chgcnt
    await rig.svc.set_namespace_anagrpid(SUB, 3, 3)
    # ANA change (and not NS attribute change): nvmet_ns_ana_grpid_store sends only the ANA event
    assert (await asyncio.wait_for(aer, DEADLINE)).cqe.dw0 == AEN_ANA
    log = parse_ana_log((await a.host.cmd(get_ana_log(), read_len=4096)).data)
    assert [(g.anagrpid, g.state, g.nsids) for g in log.groups] == [
        (1, AnaState.OPTIMIZED, [1]), (2, AnaState.OPTIMIZED, [2]), (3, AnaState.INACCESSIBLE, [3])]
    assert log.chgcnt > before
    assert (await a.io.cmd(read(3), read_len=512)).status == Status.ANA_INACCESSIBLE
    # a new namespace: NS attribute AEN and the ANA AEN (a Linux host with ANA waits for its group in 0Ch)
    events = [a.host.send(Command(AdminOpcode.ASYNC_EVENT_REQUEST)) for _ in range(2)]
    await rig.svc.add_namespace(SUB, backend="ram", size=1 << 20, nsid=4, anagrpid=4)
    got = sorted([(await asyncio.wait_for(e, DEADLINE)).cqe.dw0 for e in events])
    assert got == sorted([AEN_ANA, 0x2 | (0x00 << 8) | (0x04 << 16)])
    log = parse_ana_log((await a.host.cmd(get_ana_log(), read_len=4096)).data)
    assert log.groups[-1].anagrpid == 4 and log.groups[-1].nsids == [4]


async def test_refusals_name_the_field(rig):
    from target.service import ServiceError

    with pytest.raises(ServiceError, match=r"anagrpid 0 is out of range; use 1\.\.128"):
        await rig.svc.set_namespace_anagrpid(SUB, 1, 0)
    with pytest.raises(ServiceError, match="anagrpid 129 is out of range"):
        await rig.svc.add_namespace(SUB, backend="ram", size=1 << 20, anagrpid=129)
    with pytest.raises(ServiceError, match="ANA state 'standby' is not one of"):
        await rig.svc.set_ana_state(rig.lids[0], 1, "standby")
    with pytest.raises(ServiceError, match="no listener"):
        await rig.svc.set_ana_states({1: "inaccessible"}, listener_ids=["tcp:10.9.9.9:1"])
    assert all(not lst.ana_states for lst in rig.tgt.listeners.values())   # nothing half-applied


async def test_cntlid_range_is_respected_and_refused_when_exhausted(rig):
    rig.tgt.set_cntlid_range(2041, 2042)
    a, b = await rig.path(0), await rig.path(1)
    assert {a.cntlid, b.cntlid} == {2041, 2042}
    host = await open_tcp(rig.ports[0])
    res = await host.connect(SUB)
    assert res.status == Status.CONNECT_CTRL_BUSY
    rig.tgt.disconnect_controller(a.cntlid)
    res = await host.connect(SUB)
    assert res.status == 0 and res.cqe.dw0 & 0xFFFF == a.cntlid
    for lo, hi in ((0, 5), (5, 4), (1, 0xFFF0)):
        with pytest.raises(ValueError, match="--cntlid-range"):
            rig.tgt.set_cntlid_range(lo, hi)
