"""Reservation commands served by the target (loop transport): two hosts on one namespace, the conflicts the
access table gives, the report, notifications (log 80h, AEN, mask), PTPL across a restart, bad input."""

from __future__ import annotations

import asyncio
import struct

import pytest
from target_host import NS_SIZE, SUBNQN, make_target, open_loop

from nvmeof.spec.nvme import AdminOpcode, Command, FeatureId, IoOpcode, LogPageId
from nvmeof.spec.reservations import NotificationType, ReservationNotificationLog, parse_report
from nvmeof.spec.reservations import ReservationType as T
from nvmeof.status import Status
from target.admin import identify_namespace
from target.pr import LocalPrStore

HOST_A, HOST_B, HOST_C = bytes([0xA] * 16), bytes([0xB] * 16), bytes([0xC] * 16)


class Host:
    def __init__(self, admin, io, hostid):
        self.admin, self.io, self.hostid = admin, io, hostid

    async def register(self, nrkey=0, *, crkey=0, rrega=0, iekey=False, cptpl=0):
        cdw10 = rrega | (int(iekey) << 3) | (cptpl << 30)
        return await self.io.cmd(Command(IoOpcode.RESV_REGISTER, nsid=1, cdw10=cdw10), struct.pack("<QQ", crkey, nrkey))

    async def acquire(self, crkey, rtype, *, prkey=0, racqa=0, iekey=False):
        cdw10 = racqa | (int(iekey) << 3) | (int(rtype) << 8)
        return await self.io.cmd(Command(IoOpcode.RESV_ACQUIRE, nsid=1, cdw10=cdw10), struct.pack("<QQ", crkey, prkey))

    async def release(self, crkey, rtype=0, *, rrela=0):
        cdw10 = rrela | (int(rtype) << 8)
        return await self.io.cmd(Command(IoOpcode.RESV_RELEASE, nsid=1, cdw10=cdw10), struct.pack("<Q", crkey))

    async def report(self, size=4096, eds=True):
        res = await self.io.cmd(Command(IoOpcode.RESV_REPORT, nsid=1, cdw10=size // 4 - 1, cdw11=int(eds)),
                                read_len=size)
        return res, (parse_report(res.data, eds=True) if res.status == 0 else None)

    async def read(self):
        return await self.io.cmd(Command(IoOpcode.READ, nsid=1, cdw10=0, cdw12=0), read_len=512)

    async def write(self):
        return await self.io.cmd(Command(IoOpcode.WRITE, nsid=1, cdw10=0, cdw12=0), b"w" * 512)

    async def resv_log(self):
        res = await self.admin.cmd(Command(AdminOpcode.GET_LOG_PAGE, nsid=0xFFFFFFFF,
                                           cdw10=LogPageId.RESERVATION | ((64 // 4 - 1) << 16)), read_len=64)
        assert res.status == 0, res
        return ReservationNotificationLog.parse(res.data)


async def connect(target, hostid, hostnqn):
    admin = await open_loop(target)
    res = await admin.connect(SUBNQN, hostnqn=hostnqn, hostid=hostid)
    assert res.status == 0, res
    await admin.enable()
    cntlid = res.cqe.dw0 & 0xFFFF
    io = await open_loop(target)
    res = await io.connect(SUBNQN, qid=1, cntlid=cntlid, sqsize=127, hostnqn=hostnqn, hostid=hostid)
    assert res.status == 0, res
    return Host(admin, io, hostid)


@pytest.fixture
async def target(tmp_path):
    tgt = make_target()
    tgt.pr_store = LocalPrStore(tmp_path / "resv")
    yield tgt
    await tgt.close()


@pytest.fixture
async def hosts(target):
    a = await connect(target, HOST_A, "nqn.2014-08.org.nvmexpress:uuid:aaaa")
    b = await connect(target, HOST_B, "nqn.2014-08.org.nvmexpress:uuid:bbbb")
    c = await connect(target, HOST_C, "nqn.2014-08.org.nvmexpress:uuid:cccc")
    return a, b, c


EXPECT = {  # (registrant B read, write), (non-registrant C read, write)
    T.WRITE_EXCLUSIVE: ((True, False), (True, False)),
    T.EXCLUSIVE_ACCESS: ((False, False), (False, False)),
    T.WRITE_EXCLUSIVE_REG_ONLY: ((True, True), (True, False)),
    T.EXCLUSIVE_ACCESS_REG_ONLY: ((True, True), (False, False)),
    T.WRITE_EXCLUSIVE_ALL_REGS: ((True, True), (True, False)),
    T.EXCLUSIVE_ACCESS_ALL_REGS: ((True, True), (False, False)),
}


def status_ok(res, allowed):
    if allowed:
        return res.status == 0
    return res.status == Status.RESERVATION_CONFLICT and res.cqe.dnr


@pytest.mark.parametrize("rtype", list(T))
async def test_every_type_over_the_wire(target, hosts, rtype):
    a, b, c = hosts
    assert (await a.register(0x1111)).status == 0
    assert (await b.register(0x2222)).status == 0
    assert (await a.acquire(0x1111, rtype)).status == 0
    assert (await a.read()).status == 0 and (await a.write()).status == 0
    (b_read, b_write), (c_read, c_write) = EXPECT[rtype]
    assert status_ok(await b.read(), b_read) and status_ok(await b.write(), b_write)
    assert status_ok(await c.read(), c_read) and status_ok(await c.write(), c_write)
    res, rep = await b.report()
    assert res.status == 0 and rep.rtype == rtype and rep.regctl == 2
    holds = {r.hostid: r.holds for r in rep.registrants}
    assert holds[HOST_A] and holds[HOST_B] == rtype.all_registrants
    assert {r.hostid: r.rkey for r in rep.registrants} == {HOST_A: 0x1111, HOST_B: 0x2222}
    assert (await a.release(0x1111, rtype)).status == 0
    assert (await c.read()).status == 0 and (await c.write()).status == 0   # released: access restored


async def test_notifications_log_and_aen(target, hosts):
    a, b, _ = hosts
    aer = asyncio.ensure_future(b.admin.cmd(Command(AdminOpcode.ASYNC_EVENT_REQUEST), timeout=10))
    await a.register(1)
    await b.register(2)
    assert (await a.acquire(1, T.WRITE_EXCLUSIVE)).status == 0
    assert (await a.acquire(1, T.WRITE_EXCLUSIVE, racqa=1, prkey=2)).status == 0   # A preempts B's registration
    event = await asyncio.wait_for(aer, 5)
    assert event.cqe.dw0 & 0x7 == 6 and (event.cqe.dw0 >> 8) & 0xFF == 0 and (event.cqe.dw0 >> 16) & 0xFF == 0x80
    page = await b.resv_log()
    assert page.type == NotificationType.REGISTRATION_PREEMPTED and page.nsid == 1 and page.count == 1
    assert page.nalp == 0
    assert (await b.resv_log()).count == 0    # nothing more waits
    assert (await b.write()).status == Status.RESERVATION_CONFLICT   # no longer registered


async def test_notification_mask_feature(target, hosts):
    a, b, _ = hosts
    res = await b.admin.cmd(Command(AdminOpcode.SET_FEATURES, nsid=1, cdw10=FeatureId.RESV_MASK, cdw11=1 << 1))
    assert res.status == 0
    res = await b.admin.cmd(Command(AdminOpcode.GET_FEATURES, nsid=1, cdw10=FeatureId.RESV_MASK))
    assert res.status == 0 and res.cqe.dw0 == 1 << 1
    bad = await b.admin.cmd(Command(AdminOpcode.SET_FEATURES, nsid=1, cdw10=FeatureId.RESV_MASK, cdw11=1))
    assert bad.status == Status.INVALID_FIELD
    await a.register(1)
    await b.register(2)
    await a.acquire(1, T.WRITE_EXCLUSIVE, racqa=1, prkey=2)
    assert (await b.resv_log()).count == 0     # registration preempted is masked


async def test_report_needs_eds_and_room_and_bad_input_changes_nothing(target, hosts):
    a, _, _ = hosts
    await a.register(7)
    res, _ = await a.report(eds=False)
    assert res.status == Status.HOST_ID_INCONSIST
    res, _ = await a.report(size=32)
    assert res.status == Status.INVALID_FIELD
    before = target.subsystems[SUBNQN].namespaces[1].pr
    assert (await a.register(8, rrega=5)).status == Status.INVALID_FIELD
    assert (await a.acquire(7, 9)).status == Status.INVALID_FIELD
    assert (await a.acquire(7, T.WRITE_EXCLUSIVE, iekey=True)).status == Status.INVALID_FIELD
    assert (await a.acquire(8, T.WRITE_EXCLUSIVE)).status == Status.RESERVATION_CONFLICT
    assert (await a.release(7, rrela=4)).status == Status.INVALID_FIELD
    assert target.subsystems[SUBNQN].namespaces[1].pr == before


async def test_reservation_commands_on_a_missing_namespace(target, hosts):
    a, _, _ = hosts
    res = await a.io.cmd(Command(IoOpcode.RESV_REGISTER, nsid=5, cdw10=0), struct.pack("<QQ", 0, 1))
    assert res.status == Status.INVALID_NS


async def test_identify_advertises_reservations(target, hosts):
    a, _, _ = hosts
    res = await a.admin.cmd(Command(AdminOpcode.IDENTIFY, cdw10=1), read_len=4096)
    oncs = struct.unpack_from("<H", res.data, 520)[0]
    assert oncs & (1 << 5)
    res = await a.admin.cmd(Command(AdminOpcode.IDENTIFY, nsid=1, cdw10=0), read_len=4096)
    assert res.data[31] == 0xFF and res.data[30] & 1      # RESCAP: all types, PTPL, IEKEY; NMIC shared
    ns = target.subsystems[SUBNQN].namespaces[1]
    assert identify_namespace(ns)[31] == 0                # the builder alone promises nothing


async def test_ptpl_survives_a_restart_and_without_it_the_state_is_gone(tmp_path):
    async def serve():
        tgt = make_target()
        tgt.pr_store = LocalPrStore(tmp_path / "resv")
        ns = tgt.subsystems[SUBNQN].namespaces[1]
        from target import pr
        await pr.clear_on_start(tgt, ns)
        return tgt

    tgt = await serve()
    a = await connect(tgt, HOST_A, "nqn.2014-08.org.nvmexpress:uuid:aaaa")
    assert (await a.register(0x55, cptpl=3)).status == 0      # as the Linux host registers: PTPL on
    assert (await a.acquire(0x55, T.EXCLUSIVE_ACCESS)).status == 0
    res = await a.admin.cmd(Command(AdminOpcode.GET_FEATURES, nsid=1, cdw10=FeatureId.RESV_PERSIST))
    assert res.cqe.dw0 == 1
    uuid = tgt.subsystems[SUBNQN].namespaces[1].uuid
    await tgt.close()

    tgt = make_target()
    tgt.subsystems[SUBNQN].namespaces[1].uuid = uuid      # the same namespace, restarted
    tgt.pr_store = LocalPrStore(tmp_path / "resv")
    from target import pr
    await pr.clear_on_start(tgt, tgt.subsystems[SUBNQN].namespaces[1])
    b = await connect(tgt, HOST_B, "nqn.2014-08.org.nvmexpress:uuid:bbbb")
    assert (await b.read()).status == Status.RESERVATION_CONFLICT
    a = await connect(tgt, HOST_A, "nqn.2014-08.org.nvmexpress:uuid:aaaa")
    assert (await a.write()).status == 0
    # PTPL off through the feature: the file goes, and the next start begins empty
    res = await a.admin.cmd(Command(AdminOpcode.SET_FEATURES, nsid=1, cdw10=FeatureId.RESV_PERSIST, cdw11=0))
    assert res.status == 0
    assert not list((tmp_path / "resv").glob("*.json"))
    await tgt.close()


async def test_preempt_and_abort_waits_for_the_preempted_hosts_commands(target, hosts):
    a, b, _ = hosts
    ns = target.subsystems[SUBNQN].namespaces[1]
    gate = asyncio.Event()
    real_write = ns.backend.write

    async def slow_write(offset, data, *, fua=False):
        await gate.wait()
        await real_write(offset, data, fua=fua)

    await a.register(1)
    await b.register(2)
    await b.acquire(2, T.WRITE_EXCLUSIVE_REG_ONLY)
    ns.backend.write = slow_write
    b_write = asyncio.ensure_future(b.write())
    await asyncio.sleep(0.05)
    assert ns.pr_inflight.get(HOST_B) == 1
    preempt = asyncio.ensure_future(a.acquire(1, T.EXCLUSIVE_ACCESS, racqa=2, prkey=2))
    await asyncio.sleep(0.1)
    assert not preempt.done()               # waits for B's write to finish
    gate.set()
    assert (await b_write).status == 0
    assert (await preempt).status == 0
    assert (await b.write()).status == Status.RESERVATION_CONFLICT


async def test_without_workers_support_reservation_commands_are_invalid(target, hosts):
    a, _, _ = hosts
    target.reservations_supported = False
    assert (await a.register(1)).status == Status.INVALID_OPCODE


async def test_service_report_redacts_keys_and_removal_forgets_the_state(tmp_path):
    from target.core import Target
    from target.service import TargetService

    tgt = Target()
    tgt.pr_store = LocalPrStore(tmp_path / "resv")
    service = TargetService(tgt)
    await service.add_subsystem(SUBNQN)
    await service.add_namespace(SUBNQN, backend="ram", size=NS_SIZE, nsid=1)
    a = await connect(tgt, HOST_A, "nqn.2014-08.org.nvmexpress:uuid:aaaa")
    assert (await a.register(0xDEADBEEF, cptpl=3)).status == 0
    assert (await a.acquire(0xDEADBEEF, T.WRITE_EXCLUSIVE)).status == 0
    view = service.namespace_reservations(SUBNQN, 1)
    assert view["type"] == "write-exclusive" and view["holder"] == HOST_A.hex() and view["ptpl"]
    assert view["generation"] == 1
    assert view["registrants"] == [{"hostid": HOST_A.hex(), "hostnqns": ["nqn.2014-08.org.nvmexpress:uuid:aaaa"],
                                    "holds": True, "rkey": "<redacted>"}]
    assert "deadbeef" not in str(view).lower() and str(0xDEADBEEF) not in str(view)
    assert list((tmp_path / "resv").glob("*.json"))
    await service.remove_namespace(SUBNQN, 1)
    assert not list((tmp_path / "resv").glob("*.json"))
    await tgt.close()


async def test_batch_engine_fast_path_enforces_the_reservation():
    """The batch engine's fast path serves reads and writes without io.parse: a namespace with registrants
    must take the checked road there too (tcp_batch.py)."""
    from target_host import open_tcp

    from target.model import Listener
    from target.transports.tcp_batch import BatchTcpListener

    tgt = make_target()
    server = BatchTcpListener(tgt, Listener("tcp", "ipv4", "127.0.0.1", 0, portid=1))
    await server.start()
    try:
        async def tcp_host(hostid, hostnqn):
            admin = await open_tcp(server.port)
            res = await admin.connect(SUBNQN, hostnqn=hostnqn, hostid=hostid)
            await admin.enable()
            io = await open_tcp(server.port)
            res = await io.connect(SUBNQN, qid=1, cntlid=res.cqe.dw0 & 0xFFFF, sqsize=127, hostnqn=hostnqn,
                                   hostid=hostid)
            assert res.status == 0
            return Host(admin, io, hostid)

        a = await tcp_host(HOST_A, "nqn.2014-08.org.nvmexpress:uuid:aaaa")
        b = await tcp_host(HOST_B, "nqn.2014-08.org.nvmexpress:uuid:bbbb")
        assert (await b.read()).status == 0 and (await b.write()).status == 0   # fast path, no reservation
        assert (await a.register(1)).status == 0
        assert (await a.acquire(1, T.EXCLUSIVE_ACCESS)).status == 0
        assert (await b.read()).status == Status.RESERVATION_CONFLICT
        assert (await b.write()).status == Status.RESERVATION_CONFLICT
        assert (await a.read()).status == 0 and (await a.write()).status == 0
        assert (await a.release(1, T.EXCLUSIVE_ACCESS)).status == 0
        assert (await b.read()).status == 0
    finally:
        await server.stop()
        await tgt.close()


async def test_release_with_the_linux_hosts_16_byte_buffer(target, hosts):
    """nvme_pr_release sends Release with 16 bytes of data (the kernel's IOC_PR_RELEASE / IOC_PR_CLEAR)."""
    a, _, c = hosts
    await a.register(5)
    await a.acquire(5, T.EXCLUSIVE_ACCESS)
    res = await a.io.cmd(Command(IoOpcode.RESV_RELEASE, nsid=1, cdw10=int(T.EXCLUSIVE_ACCESS) << 8),
                         struct.pack("<QQ", 5, 0))
    assert res.status == 0 and (await c.read()).status == 0
    short = await a.io.cmd(Command(IoOpcode.RESV_REGISTER, nsid=1, cdw10=0), struct.pack("<Q", 5))
    assert short.status == Status.SGL_INVALID_DATA
