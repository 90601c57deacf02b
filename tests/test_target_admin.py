"""Admin command set: Identify, Get Log Page, features, keep-alive, AER, Abort (loop transport)."""

from __future__ import annotations

import asyncio
import logging
import math
import uuid

import pytest
from target_host import HOSTID, NS_SIZE, SUBNQN, admin_session, io_session, le32, make_target

from nvmeof import defaults
from nvmeof.spec import identify as idf
from nvmeof.spec.identify import IdentifyController, IdentifyNamespace, parse_active_ns_list
from nvmeof.spec.logs import (
    EFFECTS_CSUPP,
    EFFECTS_LBCC,
    CommandsSupportedEffects,
    ErrorLogEntry,
    FirmwareSlotLog,
    SmartLog,
    parse_changed_ns_list,
)
from nvmeof.spec.nvme import AdminOpcode, Command, IoOpcode
from nvmeof.status import Status
from target.backends.ram import RamBackend
from target.model import Namespace


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def target():
    tgt = make_target()
    yield tgt
    await tgt.close()


def identify(cns: int, nsid: int = 0) -> Command:
    return Command(AdminOpcode.IDENTIFY, nsid=nsid, cdw10=cns)


def get_log(lid: int, length: int, offset: int = 0, rae: bool = False, nsid: int = 0xFFFFFFFF) -> Command:
    numd = length // 4 - 1
    return Command(AdminOpcode.GET_LOG_PAGE, nsid=nsid,
                   cdw10=lid | (int(rae) << 15) | ((numd & 0xFFFF) << 16), cdw11=numd >> 16,
                   cdw12=offset & 0xFFFFFFFF, cdw13=offset >> 32)


def set_feature(fid: int, value: int, sv: bool = False) -> Command:
    return Command(AdminOpcode.SET_FEATURES, cdw10=fid | (int(sv) << 31), cdw11=value)


def get_feature(fid: int, sel: int = 0, cdw11: int = 0) -> Command:
    return Command(AdminOpcode.GET_FEATURES, cdw10=fid | (sel << 8), cdw11=cdw11)


async def test_identify_controller(target):
    host, cntlid = await admin_session(target, SUBNQN)
    res = await host.cmd(identify(1), read_len=4096)
    assert res.status == 0 and len(res.data) == 4096
    idc = IdentifyController.parse(res.data)
    assert idc.cntlid == cntlid
    assert idc.sn == "SN0001" and idc.mn == defaults.MODEL and idc.fr == defaults.FIRMWARE_REVISION
    assert idc.subnqn == SUBNQN
    assert idc.cmic == idf.CMIC_MULTI_PORT | idf.CMIC_MULTI_CTRL | idf.CMIC_ANA   # ANA: tests/test_ana_target.py
    assert idc.mdts == defaults.MDTS
    assert idc.ver == 0x010300
    assert idc.oaes == idf.OAES_NS_ATTR | idf.OAES_ANA
    assert idc.ctratt == idf.CTRATT_HOST_ID_128
    assert idc.cntrltype == idf.CNTRLTYPE_IO
    assert idc.acl == 3 and idc.aerl == 3 and idc.frmw == 3 and idc.elpe == 63
    assert idc.lpa == idf.LPA_CMD_EFFECTS | idf.LPA_EXT_DATA
    assert idc.sqes == 0x66 and idc.cqes == 0x44
    assert idc.maxcmd == defaults.MAX_QUEUE_SIZE
    assert idc.nn == defaults.MAX_NAMESPACES
    assert idc.oncs == idf.ONCS_COMPARE | idf.ONCS_DSM | idf.ONCS_WRITE_ZEROES | idf.ONCS_RESERVATIONS
    assert idc.vwc == 0x7   # present; broadcast Flush supported
    assert idc.sgls & 3 == 1 and not idc.sgls & idf.SGLS_KEYED and idc.sgls & idf.SGLS_OFFSET
    assert idc.kas == 1
    assert idc.ioccsz == (64 + defaults.IO_INCAPSULE_SIZE) // 16 and idc.iorcsz == 1
    assert idc.icdoff == 0 and idc.msdbd == 1
    assert idc.wctemp > 273 and idc.cctemp > idc.wctemp


async def test_identify_namespace(target):
    host, _ = await admin_session(target, SUBNQN)
    res = await host.cmd(identify(0, nsid=1), read_len=4096)
    assert res.status == 0
    ns = IdentifyNamespace.parse(res.data)
    assert ns.nsze == ns.ncap == ns.nuse == NS_SIZE // 512
    assert ns.nlbaf == 0 and ns.flbas == 0 and ns.lbaf[0].lbads == 9
    assert ns.nmic == 1 and ns.nsfeat & idf.NSFEAT_THIN
    assert ns.nguid == bytes(range(1, 17)) and ns.eui64 == bytes(range(1, 9))
    # 4 KiB namespace, read-only
    sub = target.subsystems[SUBNQN]
    sub.namespaces[7] = Namespace(7, RamBackend(1 << 20), block_size=4096, read_only=True)
    ns7 = IdentifyNamespace.parse((await host.cmd(identify(0, nsid=7), read_len=4096)).data)
    assert ns7.nsze == 256 and ns7.lbaf[0].lbads == 12 and ns7.nsattr == 1
    # inactive NSID in range: zeros; NSID 0 / beyond NN: Invalid Namespace
    res = await host.cmd(identify(0, nsid=5), read_len=4096)
    assert res.status == 0 and res.data == bytes(4096)
    assert (await host.cmd(identify(0, nsid=0), read_len=4096)).status == Status.INVALID_NS
    res = await host.cmd(identify(0, nsid=defaults.MAX_NAMESPACES + 1), read_len=4096)
    assert res.status == Status.INVALID_NS


async def test_identify_active_list_and_descriptors(target):
    sub = target.subsystems[SUBNQN]
    sub.namespaces[3] = Namespace(3, RamBackend(1 << 20))
    sub.namespaces[9] = Namespace(9, RamBackend(1 << 20), enabled=False)
    host, _ = await admin_session(target, SUBNQN)
    res = await host.cmd(identify(2, nsid=0), read_len=4096)
    assert parse_active_ns_list(res.data) == [1, 3]
    res = await host.cmd(identify(2, nsid=1), read_len=4096)
    assert parse_active_ns_list(res.data) == [3]
    assert (await host.cmd(identify(2, nsid=0xFFFFFFFE), read_len=4096)).status == Status.INVALID_NS
    res = await host.cmd(identify(3, nsid=1), read_len=4096)
    descs = idf.parse_ns_descriptor_list(res.data)
    assert descs["eui64"] == bytes(range(1, 9)) and descs["nguid"] == bytes(range(1, 17))
    assert descs["uuid"] == sub.namespaces[1].uuid.bytes and "csi" not in descs
    sub.namespaces[3].uuid = uuid.UUID(int=5)
    res = await host.cmd(identify(3, nsid=3), read_len=4096)
    assert set(idf.parse_ns_descriptor_list(res.data)) == {"uuid"}   # zero EUI64/NGUID left out
    assert (await host.cmd(identify(3, nsid=4), read_len=4096)).status == Status.INVALID_NS
    for cns in (0x05, 0x06, 0x08, 0x10):
        assert (await host.cmd(identify(cns, nsid=1), read_len=4096)).status == Status.INVALID_FIELD


async def test_identify_transfer_length_checked(target):
    host, _ = await admin_session(target, SUBNQN)
    res = await host.cmd(identify(1), read_len=512)
    assert res.status == Status.SGL_INVALID_DATA and res.cqe.dnr


async def test_log_pages_offsets_and_split_reads(target):
    host, _ = await admin_session(target, SUBNQN)
    # Commands Supported and Effects, read whole and in two halves with an offset
    whole = (await host.cmd(get_log(0x05, 4096), read_len=4096)).data
    first = (await host.cmd(get_log(0x05, 2048), read_len=2048)).data
    second = (await host.cmd(get_log(0x05, 2048, offset=2048), read_len=2048)).data
    assert first + second == whole
    eff = CommandsSupportedEffects.parse(whole)
    assert eff.acs[AdminOpcode.IDENTIFY] == EFFECTS_CSUPP and eff.acs[AdminOpcode.KEEP_ALIVE] == EFFECTS_CSUPP
    assert eff.iocs[IoOpcode.WRITE] == EFFECTS_CSUPP | EFFECTS_LBCC and eff.iocs[IoOpcode.READ] == EFFECTS_CSUPP
    assert eff.acs[AdminOpcode.FORMAT_NVM] == 0
    # NUMDU: a length whose dword count needs the upper half (> 256 KiB) is assembled right
    res = await host.cmd(get_log(0x05, 0x40000 + 4096), read_len=0x40000 + 4096)
    assert res.status == 0 and res.data[:4096] == whole and res.data[4096:] == bytes(0x40000)
    # firmware slot
    fw = FirmwareSlotLog.parse((await host.cmd(get_log(0x03, 512), read_len=512)).data)
    assert fw.afi == 1 and fw.frs[0] == defaults.FIRMWARE_REVISION
    # misaligned offset, offset past the end, unknown page, discovery page on an I/O controller
    assert (await host.cmd(get_log(0x05, 64, offset=2), read_len=64)).status == Status.INVALID_FIELD
    assert (await host.cmd(get_log(0x05, 64, offset=8192), read_len=64)).status == Status.INVALID_FIELD
    assert (await host.cmd(get_log(0x0D, 64), read_len=64)).status == Status.INVALID_LOG_PAGE
    assert (await host.cmd(get_log(0x70, 64), read_len=64)).status == Status.INVALID_LOG_PAGE
    # beyond MDTS
    res = await host.cmd(get_log(0x05, 4 << 20), read_len=4 << 20)
    assert res.status == Status.INVALID_FIELD


async def test_error_log_records_failures(target):
    host, _ = await admin_session(target, SUBNQN)
    res = await host.cmd(identify(0, nsid=0), read_len=4096)
    assert res.status == Status.INVALID_NS
    failed_cid = res.cqe.cid
    res = await host.cmd(Command(0xC5))
    assert res.status == Status.INVALID_OPCODE
    page = (await host.cmd(get_log(0x01, 4096), read_len=4096)).data
    newest = ErrorLogEntry.parse(page[:64])
    older = ErrorLogEntry.parse(page[64:128])
    assert newest.error_count == 2 and older.error_count == 1
    assert older.cmdid == failed_cid and older.sqid == 0
    assert (older.status_field >> 1) & 0x7FF == Status.INVALID_NS and older.status_field & 0x8000
    assert newest.opcode == 0xC5
    assert page[128:] == bytes(4096 - 128)
    # split read of the second entry only
    part = (await host.cmd(get_log(0x01, 64, offset=64), read_len=64)).data
    assert part == page[64:128]


async def test_smart_log_counts_io(target):
    admin, cntlid = await admin_session(target, SUBNQN)
    io = await io_session(target, SUBNQN, cntlid)
    data = bytes(range(256)) * 8   # 2048 bytes = 4 blocks
    assert (await io.cmd(Command(IoOpcode.WRITE, nsid=1, cdw10=0, cdw12=3), data)).status == 0
    for _ in range(3):
        assert (await io.cmd(Command(IoOpcode.READ, nsid=1, cdw10=0, cdw12=3), read_len=2048)).status == 0
    smart = SmartLog.parse((await admin.cmd(get_log(0x02, 512), read_len=512)).data)
    assert smart.temperature == 300
    assert smart.host_writes == 1 and smart.host_reads == 3
    assert smart.data_units_written == math.ceil(4 / 1000) == 1
    assert smart.data_units_read == 1
    assert smart.power_on_hours == 0
    # partial read at an offset: the 128-bit data units read counter sits at byte 32
    part = (await admin.cmd(get_log(0x02, 16, offset=32), read_len=16)).data
    assert int.from_bytes(part, "little") == 1


async def test_features_roundtrip(target):
    host, _ = await admin_session(target, SUBNQN, kato=5000)
    # Number of Queues: grants min(requested, MAX_IO_QUEUES)
    res = await host.cmd(set_feature(0x07, (3 << 16) | 7))
    assert res.status == 0 and res.cqe.dw0 == (3 << 16) | 7
    assert (await host.cmd(get_feature(0x07))).cqe.dw0 == (3 << 16) | 3
    res = await host.cmd(set_feature(0x07, (1000 << 16) | 1000))
    top = defaults.MAX_IO_QUEUES - 1
    assert res.cqe.dw0 == (top << 16) | top
    assert (await host.cmd(set_feature(0x07, 0xFFFF))).status == Status.INVALID_FIELD
    # Keep Alive Timer
    assert (await host.cmd(get_feature(0x0F))).cqe.dw0 == 5000
    assert (await host.cmd(set_feature(0x0F, 12000))).status == 0
    assert (await host.cmd(get_feature(0x0F))).cqe.dw0 == 12000
    # Async Event Configuration
    assert (await host.cmd(get_feature(0x0B))).cqe.dw0 == idf.OAES_NS_ATTR | idf.OAES_ANA
    assert (await host.cmd(set_feature(0x0B, 0))).status == 0
    assert (await host.cmd(get_feature(0x0B))).cqe.dw0 == 0
    assert (await host.cmd(set_feature(0x0B, 1 << 31))).status == Status.INVALID_FIELD
    # Volatile Write Cache
    assert (await host.cmd(get_feature(0x06))).cqe.dw0 == 1
    assert (await host.cmd(set_feature(0x06, 0))).status == 0
    assert (await host.cmd(get_feature(0x06))).cqe.dw0 == 0
    assert (await host.cmd(get_feature(0x06, sel=1))).cqe.dw0 == 1       # default
    # Arbitration, Power Management, Error Recovery, Interrupt Coalescing
    for fid, value in ((0x01, 0x03020103), (0x02, 0), (0x05, 100), (0x08, 0x0A05)):
        assert (await host.cmd(set_feature(fid, value))).status == 0, hex(fid)
        assert (await host.cmd(get_feature(fid))).cqe.dw0 == value, hex(fid)
    assert (await host.cmd(set_feature(0x02, 1))).status == Status.INVALID_FIELD      # no power state 1
    assert (await host.cmd(set_feature(0x05, 1 << 16))).status == Status.INVALID_FIELD  # DULBE
    # Temperature Threshold: over (default WCTEMP) and under
    assert (await host.cmd(get_feature(0x04))).cqe.dw0 == 343
    assert (await host.cmd(set_feature(0x04, 350))).status == 0
    assert (await host.cmd(set_feature(0x04, (1 << 20) | 260))).status == 0
    assert (await host.cmd(get_feature(0x04))).cqe.dw0 == 350
    assert (await host.cmd(get_feature(0x04, cdw11=1 << 20))).cqe.dw0 == (1 << 20) | 260
    assert (await host.cmd(set_feature(0x04, 2 << 16))).status == Status.INVALID_FIELD  # sensor 2
    # Host Identifier: 128-bit via data; cannot be set
    res = await host.cmd(get_feature(0x81, cdw11=1), read_len=16)
    assert res.status == 0 and res.data == HOSTID
    assert (await host.cmd(get_feature(0x81, cdw11=0), read_len=16)).status == Status.INVALID_FIELD
    assert (await host.cmd(set_feature(0x81, 1))).status == Status.CMD_SEQ_ERROR
    # capabilities select, saveable, unknown features
    assert (await host.cmd(get_feature(0x06, sel=3))).cqe.dw0 == 1 << 2
    assert (await host.cmd(set_feature(0x06, 1, sv=True))).status == Status.FEATURE_NOT_SAVEABLE
    assert (await host.cmd(set_feature(0x0E, 0))).status == Status.INVALID_FIELD
    assert (await host.cmd(get_feature(0x0C))).status == Status.INVALID_FIELD


async def test_keep_alive_abort_and_unsupported_opcodes(target):
    host, _ = await admin_session(target, SUBNQN)
    assert (await host.cmd(Command(AdminOpcode.KEEP_ALIVE))).status == 0
    res = await host.cmd(Command(AdminOpcode.ABORT, cdw10=5))
    assert res.status == 0 and res.cqe.dw0 & 1
    for op in (AdminOpcode.CREATE_SQ, AdminOpcode.DELETE_CQ, AdminOpcode.FORMAT_NVM, AdminOpcode.NS_MANAGEMENT):
        assert (await host.cmd(Command(op))).status == Status.INVALID_OPCODE


async def test_keep_alive_expiry_tears_down(caplog):
    clock = FakeClock()
    tgt = make_target(clock=clock, keep_alive_interval=0.01)
    try:
        admin, cntlid = await admin_session(tgt, SUBNQN, kato=2000)
        io = await io_session(tgt, SUBNQN, cntlid)
        clock.now += 2.5   # within KATO + grace
        await asyncio.sleep(0.05)
        assert cntlid in tgt.controllers
        assert (await admin.cmd(Command(AdminOpcode.KEEP_ALIVE))).status == 0
        clock.now += 2.9
        await asyncio.sleep(0.05)
        assert cntlid in tgt.controllers
        with caplog.at_level(logging.WARNING):
            clock.now += 3.1
            await asyncio.wait_for(admin.lost, 2)
            await asyncio.wait_for(io.lost, 2)
        assert not tgt.controllers
        assert "keep-alive timeout" in caplog.text and f"controller {cntlid}" in caplog.text
    finally:
        await tgt.close()


async def test_kato_zero_never_expires():
    clock = FakeClock()
    tgt = make_target(clock=clock, keep_alive_interval=0.01)
    try:
        _, cntlid = await admin_session(tgt, SUBNQN, kato=0)
        clock.now += 10_000
        await asyncio.sleep(0.05)
        assert cntlid in tgt.controllers
    finally:
        await tgt.close()


async def test_aer_completes_on_namespace_change(target):
    host, _ = await admin_session(target, SUBNQN)
    aer = host.send(Command(AdminOpcode.ASYNC_EVENT_REQUEST))
    await asyncio.sleep(0.01)
    assert not aer.done()
    target.subsystems[SUBNQN].namespaces[2] = Namespace(2, RamBackend(1 << 20))
    target.namespace_changed(SUBNQN, 2)
    res = await asyncio.wait_for(aer, 2)
    assert res.status == 0
    assert res.cqe.dw0 == 0x2 | (0x00 << 8) | (0x04 << 16)
    # a second change before the log is read: recorded, but no second event (masked until read)
    target.namespace_changed(SUBNQN, 3)
    aer2 = host.send(Command(AdminOpcode.ASYNC_EVENT_REQUEST))
    await asyncio.sleep(0.01)
    assert not aer2.done()
    # RAE=1 keeps the list and the mask
    page = (await host.cmd(get_log(0x04, 4096, rae=True), read_len=4096)).data
    assert parse_changed_ns_list(page) == [2, 3]
    page = (await host.cmd(get_log(0x04, 4096), read_len=4096)).data
    assert parse_changed_ns_list(page) == [2, 3]
    assert parse_changed_ns_list((await host.cmd(get_log(0x04, 4096), read_len=4096)).data) == []
    # unmasked again: the next change completes the waiting AER
    target.namespace_changed(SUBNQN, 2)
    res = await asyncio.wait_for(aer2, 2)
    assert res.cqe.dw0 == 0x040002


async def test_aer_event_queued_until_request_and_limit(target):
    host, _ = await admin_session(target, SUBNQN)
    target.namespace_changed(SUBNQN, 1)
    res = await host.cmd(Command(AdminOpcode.ASYNC_EVENT_REQUEST))
    assert res.status == 0 and res.cqe.dw0 == 0x040002
    waiting = [host.send(Command(AdminOpcode.ASYNC_EVENT_REQUEST)) for _ in range(4)]
    res = await host.cmd(Command(AdminOpcode.ASYNC_EVENT_REQUEST))
    assert res.status == Status.ASYNC_LIMIT
    assert not any(w.done() for w in waiting)


async def test_aer_masked_by_configuration(target):
    host, _ = await admin_session(target, SUBNQN)
    assert (await host.cmd(set_feature(0x0B, 0))).status == 0
    aer = host.send(Command(AdminOpcode.ASYNC_EVENT_REQUEST))
    target.namespace_changed(SUBNQN, 1)
    await asyncio.sleep(0.02)
    assert not aer.done()
    page = (await host.cmd(get_log(0x04, 4096), read_len=4096)).data
    assert parse_changed_ns_list(page) == [1]


async def test_changed_ns_list_overflow(target):
    host, _ = await admin_session(target, SUBNQN)
    for nsid in range(1, 1100):
        target.namespace_changed(SUBNQN, nsid)
    page = (await host.cmd(get_log(0x04, 4096), read_len=4096)).data
    assert le32(page, 0) == 0xFFFFFFFF and le32(page, 4) == 0
