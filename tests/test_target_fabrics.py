"""Connect, Property Get/Set, Disconnect and the state gates, through the loop transport."""

from __future__ import annotations

import asyncio
import logging

import pytest
from target_host import (
    CC_ENABLE_VALUE,
    HOSTNQN,
    SUBNQN,
    admin_session,
    connect_data,
    io_session,
    make_target,
    open_loop,
)

from nvmeof import defaults
from nvmeof.spec.fabrics import DiscoveryLogEntry, DiscoveryLogHeader, SubType
from nvmeof.spec.nvme import SQE_FLAGS_PSDT_SGL, AdminOpcode, Command, FabricsType, IoOpcode
from nvmeof.status import Status
from target.model import Listener, Subsystem


@pytest.fixture
async def target():
    tgt = make_target()
    yield tgt
    await tgt.close()


async def test_admin_connect_returns_cntlid_and_registers_controller(target):
    host = await open_loop(target)
    res = await host.connect(SUBNQN, kato=5000)
    assert res.status == 0
    cntlid = res.cqe.dw0 & 0xFFFF
    assert 1 <= cntlid <= 0xFFEF
    assert res.cqe.sqid == 0
    ctrl = target.controllers[cntlid]
    assert ctrl.hostnqn == HOSTNQN and ctrl.kato_ms == 5000
    info = target.controllers_info()
    assert info[0]["cntlid"] == cntlid and info[0]["subnqn"] == SUBNQN and info[0]["transport"] == "loop"
    assert info[0]["queues"] == [{"qid": 0, "sqsize": 31, "hdgst": False, "ddgst": False}]
    # a second host connection gets a different cntlid
    host2 = await open_loop(target)
    res2 = await host2.connect(SUBNQN)
    assert res2.status == 0 and res2.cqe.dw0 & 0xFFFF != cntlid


async def test_property_enable_sequence(target):
    host = await open_loop(target)
    assert (await host.connect(SUBNQN)).status == 0
    cap = await host.prop_get(0x00, size8=True)
    value = cap.cqe.dw0 | (cap.cqe.dw1 << 32)
    assert value & 0xFFFF == defaults.MAX_QUEUE_SIZE - 1
    assert value & (1 << 16)                      # CQR
    assert (value >> 24) & 0xFF == defaults.CAP_TO_500MS
    assert value & (1 << 37)                      # CSS NVM
    assert not value & (1 << 43)                  # no CSI: single command set
    assert (value >> 48) & 0xF == 0 and (value >> 52) & 0xF == 0
    vs = await host.prop_get(0x08)
    assert vs.cqe.dw0 == (1 << 16) | (3 << 8)
    assert (await host.prop_get(0x1C)).cqe.dw0 == 0
    await host.enable()
    assert (await host.prop_get(0x14)).cqe.dw0 == CC_ENABLE_VALUE | 1
    # shutdown notification -> SHST complete
    assert (await host.prop_set(0x14, CC_ENABLE_VALUE | 1 | (1 << 14))).status == 0
    csts = (await host.prop_get(0x1C)).cqe.dw0
    assert (csts >> 2) & 3 == 2 and not csts & 1


async def test_property_errors(target):
    host = await open_loop(target)
    await host.connect(SUBNQN)
    assert (await host.prop_get(0x14, size8=True)).status == Status.INVALID_FIELD   # 8-byte CC
    assert (await host.prop_get(0x30)).status == Status.INVALID_FIELD
    assert (await host.prop_set(0x1C, 1)).status == Status.INVALID_FIELD            # CSTS is read-only


async def test_enable_with_bad_queue_entry_sizes_sets_cfs(target):
    host = await open_loop(target)
    await host.connect(SUBNQN)
    await host.prop_set(0x14, (7 << 16) | (4 << 20) | 1)
    csts = (await host.prop_get(0x1C)).cqe.dw0
    assert csts & 2 and not csts & 1
    res = await host.cmd(Command(AdminOpcode.IDENTIFY, cdw10=1), read_len=4096)
    assert res.status == Status.CMD_SEQ_ERROR


async def test_disable_resets(target):
    host, _ = await admin_session(target, SUBNQN)
    assert (await host.prop_set(0x14, CC_ENABLE_VALUE)).status == 0
    assert (await host.prop_get(0x1C)).cqe.dw0 & 1 == 0
    res = await host.cmd(Command(AdminOpcode.IDENTIFY, cdw10=1), read_len=4096)
    assert res.status == Status.CMD_SEQ_ERROR


async def test_command_before_connect_is_sequence_error(target):
    host = await open_loop(target)
    res = await host.prop_get(0x00, size8=True)
    assert res.status == Status.CMD_SEQ_ERROR and res.cqe.dnr
    res = await host.cmd(Command(AdminOpcode.IDENTIFY, cdw10=1), read_len=4096)
    assert res.status == Status.CMD_SEQ_ERROR


async def test_admin_before_enable_is_sequence_error(target):
    host = await open_loop(target)
    await host.connect(SUBNQN)
    res = await host.cmd(Command(AdminOpcode.IDENTIFY, cdw10=1), read_len=4096)
    assert res.status == Status.CMD_SEQ_ERROR and res.cqe.dnr


async def test_io_before_enable_is_sequence_error(target):
    # The I/O queue connects once the controller is enabled; then the host disables it and reads.
    admin, cntlid = await admin_session(target, SUBNQN)
    io = await io_session(target, SUBNQN, cntlid)
    await admin.prop_set(0x14, CC_ENABLE_VALUE)
    res = await io.cmd(Command(IoOpcode.READ, nsid=1, cdw10=0, cdw12=0), read_len=512)
    assert res.status == Status.CMD_SEQ_ERROR and res.cqe.dnr
    # and an I/O queue Connect before enabling is refused too
    admin2 = await open_loop(target)
    res = await admin2.connect(SUBNQN)
    cntlid2 = res.cqe.dw0 & 0xFFFF
    io2 = await open_loop(target)
    res = await io2.connect(SUBNQN, qid=1, cntlid=cntlid2)
    assert res.status == Status.CMD_SEQ_ERROR


async def test_connect_unknown_subsystem(target, caplog):
    host = await open_loop(target)
    with caplog.at_level(logging.WARNING):
        res = await host.connect("nqn.2026-01.com.example:nope")
    assert res.status == Status.CONNECT_INVALID_PARAM and res.cqe.dnr
    assert res.cqe.dw0 == (1 << 16) | 256     # IATTR=1 (Connect data), IPO=256 (SUBNQN)
    assert "nqn.2026-01.com.example:nope" in caplog.text and "does not exist" in caplog.text
    assert not target.controllers


async def test_a_refused_connect_is_logged_once(target, caplog):
    """Issue 11: ``NvmeError.logged`` is a field (default False) that Target.fail reads; the Connect
    refusal logs its reason where it is found and marks the error, so the generic "failed with" line
    of Target.fail does not repeat it."""
    from nvmeof.status import NvmeError

    assert NvmeError(Status.INVALID_FIELD).logged is False
    assert NvmeError(Status.INVALID_FIELD, logged=True).logged is True
    host = await open_loop(target)
    with caplog.at_level(logging.INFO):
        res = await host.connect("nqn.2026-01.com.example:nope")
    assert res.status == Status.CONNECT_INVALID_PARAM
    lines = [r.getMessage() for r in caplog.records if "does not exist" in r.getMessage()]
    assert len(lines) == 1 and "refused with" in lines[0], lines


async def test_connect_host_not_allowed(target, caplog):
    sub = target.subsystems[SUBNQN]
    sub.allow_any_host = False
    sub.hosts = {"nqn.2014-08.org.nvmexpress:uuid:other"}
    host = await open_loop(target)
    with caplog.at_level(logging.WARNING):
        res = await host.connect(SUBNQN)
    assert res.status == Status.CONNECT_INVALID_HOST and res.cqe.dnr
    assert res.cqe.dw0 == (1 << 16) | 512
    assert HOSTNQN in caplog.text and "not allowed" in caplog.text
    sub.hosts.add(HOSTNQN)
    assert (await host.connect(SUBNQN)).status == 0


@pytest.mark.parametrize(("sqsize", "ok"), [(0, False), (defaults.MAX_QUEUE_SIZE - 1, True),
                                            (defaults.MAX_QUEUE_SIZE, False)])
async def test_connect_sqsize(target, sqsize, ok):
    host = await open_loop(target)
    res = await host.connect(SUBNQN, sqsize=sqsize)
    if ok:
        assert res.status == 0
    else:
        assert res.status == Status.CONNECT_INVALID_PARAM and res.cqe.dw0 == 44


async def test_connect_format_and_static_cntlid(target):
    host = await open_loop(target)
    res = await host.connect(SUBNQN, recfmt=1)
    assert res.status == Status.CONNECT_FORMAT
    res = await host.connect(SUBNQN, cntlid=5)
    assert res.status == Status.CONNECT_INVALID_PARAM and res.cqe.dw0 == (1 << 16) | 16
    assert not target.controllers


async def test_connect_data_length_must_be_1024(target):
    host = await open_loop(target)
    data = connect_data(SUBNQN, HOSTNQN, 0xFFFF)[:512]
    cmd = Command(AdminOpcode.FABRICS, nsid=FabricsType.CONNECT, cdw11=31)
    res = await host.cmd(cmd, data)
    assert res.status == Status.SGL_INVALID_DATA and res.cqe.dnr


async def test_io_connect_checks(target):
    admin, cntlid = await admin_session(target, SUBNQN)
    # unknown cntlid
    q = await open_loop(target)
    res = await q.connect(SUBNQN, qid=1, cntlid=cntlid + 100)
    assert res.status == Status.CONNECT_INVALID_PARAM and res.cqe.dw0 == (1 << 16) | 16
    # other host NQN
    res = await q.connect(SUBNQN, qid=1, cntlid=cntlid, hostnqn="nqn.2014-08.org.nvmexpress:uuid:intruder")
    assert res.status == Status.CONNECT_INVALID_PARAM and res.cqe.dw0 == (1 << 16) | 16
    # qid above the granted queues
    res = await admin.cmd(Command(AdminOpcode.SET_FEATURES, cdw10=0x07, cdw11=(1 << 16) | 1))
    assert res.status == 0 and res.cqe.dw0 == (1 << 16) | 1
    res = await q.connect(SUBNQN, qid=3, cntlid=cntlid)
    assert res.status == Status.CONNECT_INVALID_PARAM and res.cqe.dw0 == 42
    # good, then the same qid again on another connection
    res = await q.connect(SUBNQN, qid=2, cntlid=cntlid, sqsize=127)
    assert res.status == 0 and res.cqe.sqid == 2 and res.cqe.dw0 & 0xFFFF == cntlid
    q2 = await open_loop(target)
    res = await q2.connect(SUBNQN, qid=2, cntlid=cntlid)
    assert res.status == Status.CONNECT_INVALID_PARAM and res.cqe.dw0 == 42
    # a second Connect on a connected queue
    res = await q.connect(SUBNQN, qid=1, cntlid=cntlid)
    assert res.status == Status.CONNECT_CTRL_BUSY
    # Number of Queues cannot change once I/O queues exist
    res = await admin.cmd(Command(AdminOpcode.SET_FEATURES, cdw10=0x07, cdw11=(3 << 16) | 3))
    assert res.status == Status.CMD_SEQ_ERROR
    assert [x["qid"] for x in target.controllers_info()[0]["queues"]] == [0, 2]


async def test_sqhd_advances_and_sqflow_disabled(target):
    _admin, cntlid = await admin_session(target, SUBNQN)
    io = await io_session(target, SUBNQN, cntlid)
    r1 = await io.cmd(Command(IoOpcode.FLUSH, nsid=1))
    r2 = await io.cmd(Command(IoOpcode.FLUSH, nsid=1))
    assert r2.cqe.sqhd == (r1.cqe.sqhd + 1) % 128
    io2 = await open_loop(target)
    res = await io2.connect(SUBNQN, qid=2, cntlid=cntlid, sqsize=127, cattr=1 << 2)
    assert res.status == 0 and res.cqe.sqhd == 0xFFFF
    r = await io2.cmd(Command(IoOpcode.FLUSH, nsid=1))
    assert r.status == 0 and r.cqe.sqhd == 0xFFFF


async def test_disconnect_io_queue_and_admin(target):
    admin, cntlid = await admin_session(target, SUBNQN)
    io = await io_session(target, SUBNQN, cntlid)
    res = await io.cmd(Command(AdminOpcode.FABRICS, nsid=FabricsType.DISCONNECT))
    assert res.status == 0
    await asyncio.wait_for(io.lost, 2)
    assert 1 not in target.controllers[cntlid].queues
    res = await admin.cmd(Command(AdminOpcode.FABRICS, nsid=FabricsType.DISCONNECT))
    assert res.status == 0
    await asyncio.wait_for(admin.lost, 2)
    assert not target.controllers


async def test_admin_connection_loss_tears_down_controller(target):
    admin, cntlid = await admin_session(target, SUBNQN)
    io = await io_session(target, SUBNQN, cntlid)
    admin.close()
    await asyncio.wait_for(io.lost, 2)
    assert not target.controllers


async def test_disconnect_controller_and_subsystem(target):
    admin, cntlid = await admin_session(target, SUBNQN)
    assert target.disconnect_controller(cntlid)
    assert not target.disconnect_controller(cntlid)
    await asyncio.wait_for(admin.lost, 2)
    admin2, _ = await admin_session(target, SUBNQN)
    assert target.disconnect_subsystem(SUBNQN) == 1
    await asyncio.wait_for(admin2.lost, 2)
    assert not target.controllers


async def test_prp_flag_rejected(target):
    host, _ = await admin_session(target, SUBNQN)
    cmd = Command(AdminOpcode.IDENTIFY, cdw10=1, flags=0)
    res = await host.cmd(cmd, read_len=4096)
    assert res.status == Status.INVALID_FIELD
    cmd = Command(AdminOpcode.IDENTIFY, cdw10=1, flags=SQE_FLAGS_PSDT_SGL)
    assert (await host.cmd(cmd, read_len=4096)).status == 0


async def test_unknown_fabrics_type(target):
    host = await open_loop(target)
    await host.connect(SUBNQN)
    res = await host.cmd(Command(AdminOpcode.FABRICS, nsid=0x7E))
    assert res.status == Status.INVALID_OPCODE


async def test_cntlid_allocation_unique_and_reused(target):
    ids = set()
    hosts = []
    for _ in range(5):
        h = await open_loop(target)
        res = await h.connect(SUBNQN)
        ids.add(res.cqe.dw0 & 0xFFFF)
        hosts.append(h)
    assert len(ids) == 5
    target._next_cntlid = 0xFFEF
    h = await open_loop(target)
    assert (await h.connect(SUBNQN)).cqe.dw0 & 0xFFFF == 0xFFEF
    h = await open_loop(target)
    assert (await h.connect(SUBNQN)).cqe.dw0 & 0xFFFF not in ids | {0xFFEF}


# --- who a controller belongs to: HOSTID on I/O queues, an empty HOSTNQN --------------------------

HOST_A = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-4000-8000-00000000000a"
HOST_B = "nqn.2014-08.org.nvmexpress:uuid:bbbbbbbb-0000-4000-8000-00000000000b"
HOSTID_A = bytes([0xA0] * 16)
HOSTID_B = bytes([0xB0] * 16)


async def _enabled_admin(target, hostnqn: str, hostid: bytes, subnqn: str = SUBNQN):
    host = await open_loop(target)
    res = await host.connect(subnqn, hostnqn=hostnqn, hostid=hostid)
    assert res.status == 0, res
    await host.enable()
    return host, res.cqe.dw0 & 0xFFFF


async def test_io_connect_needs_the_hostid_of_the_admin_connect(target, caplog):
    """Item 6: host B's NQN with host A's HOSTID used to attach an I/O queue to B's controller."""
    await _enabled_admin(target, HOST_A, HOSTID_A)
    _admin_b, cntlid_b = await _enabled_admin(target, HOST_B, HOSTID_B)
    q = await open_loop(target)
    with caplog.at_level(logging.WARNING):
        res = await q.connect(SUBNQN, qid=1, cntlid=cntlid_b, hostnqn=HOST_B, hostid=HOSTID_A, sqsize=127)
    assert res.status == Status.CONNECT_INVALID_PARAM and res.cqe.dnr
    assert res.cqe.dw0 == (1 << 16) | 0        # IATTR=1 (Connect data), IPO=0 (HOSTID)
    assert 1 not in target.controllers[cntlid_b].queues
    line = next(r.getMessage() for r in caplog.records if "HOSTID" in r.getMessage())
    assert HOST_B in line and f"controller {cntlid_b}" in line and HOSTID_A.hex() in line and HOSTID_B.hex() in line
    # the owner's own identity still attaches the queue
    res = await q.connect(SUBNQN, qid=1, cntlid=cntlid_b, hostnqn=HOST_B, hostid=HOSTID_B, sqsize=127)
    assert res.status == 0 and res.cqe.dw0 & 0xFFFF == cntlid_b


async def test_empty_hostnqn_admitted_where_any_host_may_connect(target):
    """Item 9: an all-zero HOSTNQN field is a host like any other where the subsystem allows any host."""
    admin, cntlid = await _enabled_admin(target, "", HOSTID_A)
    assert target.controllers[cntlid].hostnqn == ""
    assert target.controllers_info()[0]["hostnqn"] == ""
    io = await open_loop(target)
    res = await io.connect(SUBNQN, qid=1, cntlid=cntlid, hostnqn="", hostid=HOSTID_A, sqsize=127)
    assert res.status == 0
    assert (await io.cmd(Command(IoOpcode.FLUSH, nsid=1))).status == 0
    # the empty HOSTNQN owns that controller: a named host cannot join it, nor the reverse
    other = await open_loop(target)
    res = await other.connect(SUBNQN, qid=2, cntlid=cntlid, hostnqn=HOST_A, hostid=HOSTID_A)
    assert res.status == Status.CONNECT_INVALID_PARAM and res.cqe.dw0 == (1 << 16) | 16
    _admin_a, cntlid_a = await _enabled_admin(target, HOST_A, HOSTID_A)
    res = await other.connect(SUBNQN, qid=1, cntlid=cntlid_a, hostnqn="", hostid=HOSTID_A)
    assert res.status == Status.CONNECT_INVALID_PARAM and res.cqe.dw0 == (1 << 16) | 16
    admin.close()
    await asyncio.wait_for(io.lost, 2)


async def test_empty_hostnqn_refused_by_an_allow_list(target, caplog):
    sub = target.subsystems[SUBNQN]
    sub.allow_any_host = False
    sub.hosts = {HOST_A}
    host = await open_loop(target)
    with caplog.at_level(logging.WARNING):
        res = await host.connect(SUBNQN, hostnqn="")
    assert res.status == Status.CONNECT_INVALID_HOST and res.cqe.dnr
    assert res.cqe.dw0 == (1 << 16) | 512      # IATTR=1, IPO=512 (HOSTNQN)
    assert "empty HOSTNQN" in caplog.text and SUBNQN in caplog.text and "allow any host" in caplog.text
    assert not target.controllers


async def test_empty_hostnqn_discovery_lists_open_subsystems_only(target):
    target.listeners["io"] = Listener("tcp", "ipv4", "192.0.2.10", 4420, portid=1)
    target.subsystems["nqn.2026-01.com.example:closed"] = Subsystem(
        nqn="nqn.2026-01.com.example:closed", serial="SN9", allow_any_host=False, hosts={HOST_A})
    host, _ = await _enabled_admin(target, "", HOSTID_A, defaults.DISCOVERY_NQN)
    numrec = DiscoveryLogHeader.parse((await host.cmd(_get_log(1024), read_len=1024)).data).numrec
    size = 1024 * (1 + numrec)
    page = (await host.cmd(_get_log(size), read_len=size)).data
    entries = [DiscoveryLogEntry.parse(page[1024 * (i + 1):1024 * (i + 2)]) for i in range(numrec)]
    assert [e.subnqn for e in entries if e.subtype == SubType.NVME] == [SUBNQN]


def _get_log(length: int) -> Command:
    numd = length // 4 - 1
    return Command(AdminOpcode.GET_LOG_PAGE, cdw10=0x70 | ((numd & 0xFFFF) << 16), cdw11=numd >> 16)
