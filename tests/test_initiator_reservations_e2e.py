"""The host's reservation API against our target: HostControllers of different hosts on one namespace over the
loop transport (the access each type leaves the others, the report, preempt, release, clear, notifications),
the blocking wrapper and multipath over TCP, and the `nvmeof resv-*` commands against `nvmeof serve`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from ports import free_ports

import initiator
from initiator import sync
from initiator.controller import AsyncEvent, HostController
from nvmeof.spec.nvme import AsyncEventType
from nvmeof.spec.reservations import (
    AcquireAction,
    NotificationType,
    RegisterAction,
    ReleaseAction,
    ReservationReport,
    ReservationType,
)
from nvmeof.status import NvmeError, Status
from target.core import Target
from target.service import TargetService

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from tests.interop.ourtarget import serve_target  # noqa: E402

NQN = "nqn.2026-11.io.nvmeof-toolkit:resv-host"
BS = 512
DEADLINE = 20.0   # a bound for what takes milliseconds, so a missing event fails instead of hanging
KEYS = {"a": 0xA1A1, "b": 0xB2B2, "c": 0xC3C3}
BLOCK = bytes(range(256)) * 2


def host_identity(name: str) -> dict[str, object]:
    hostid = uuid.uuid5(uuid.NAMESPACE_DNS, f"{name}.resv-host.test")
    return {"hostnqn": f"nqn.2014-08.org.nvmexpress:uuid:{hostid}", "hostid": hostid}


@contextlib.asynccontextmanager
async def hosts(*names: str) -> AsyncIterator[tuple[Target, dict[str, HostController]]]:
    """A target with one 1 MiB namespace and one controller per host name, each its own host NQN and ID."""
    tgt = Target(keep_alive_interval=0.1)
    svc = TargetService(tgt)
    ctrls: dict[str, HostController] = {}
    try:
        await svc.add_subsystem(NQN)
        await svc.add_namespace(NQN, backend="ram", size=1 << 20, block_size=BS, nsid=1)
        for name in names:
            ctrls[name] = await initiator.connect("loop", 0, NQN, transport="loop", target=tgt,
                                                  **host_identity(name))
        yield tgt, ctrls
    finally:
        for ctrl in ctrls.values():
            await ctrl.disconnect()
        await tgt.close()


async def status_of(coro) -> int:
    """0 when the command succeeds, else the status the target answered."""
    try:
        await coro
    except NvmeError as err:
        return err.status
    return Status.SUCCESS


def by_host(report: ReservationReport, ctrl: HostController) -> bool | None:
    """Whether ``ctrl``'s host holds the reservation in ``report``; None when it is not registered."""
    for reg in report.registrants:
        if reg.hostid == ctrl.hostid.bytes:
            return reg.holds
    return None


async def next_reservation_event(ctrl: HostController) -> AsyncEvent:
    async with asyncio.timeout(DEADLINE):
        async for ev in ctrl.events():
            if ev.type == AsyncEventType.IO_CMD_SET:
                return ev
    raise AssertionError("the controller closed before a reservation event came")


# ---- the access table: what each type leaves a registrant (B) and a non-registrant (C) ---------------------

@pytest.mark.parametrize("rtype", list(ReservationType), ids=lambda t: t.name.lower())
async def test_each_type_gates_the_other_hosts(rtype: ReservationType):
    async with hosts("a", "b", "c") as (_, h):
        a, b, c = h["a"], h["b"], h["c"]
        await a.resv_register(1, nrkey=KEYS["a"])
        await b.resv_register(1, nrkey=KEYS["b"])
        await a.resv_acquire(1, crkey=KEYS["a"], rtype=rtype)

        conflict = Status.RESERVATION_CONFLICT
        ok = Status.SUCCESS
        await a.write(1, 0, BLOCK)
        assert await a.read(1, 0, 1) == BLOCK
        # NVMe Base 2.0, "Command Behavior in the Presence of a Reservation"
        registrant_reads = ok if rtype.registrants_only or not rtype.exclusive_access else conflict
        registrant_writes = ok if rtype.registrants_only else conflict
        outsider_reads = conflict if rtype.exclusive_access else ok
        assert await status_of(b.read(1, 0, 1)) == registrant_reads
        assert await status_of(b.write(1, 1, BLOCK)) == registrant_writes
        assert await status_of(c.read(1, 0, 1)) == outsider_reads
        assert await status_of(c.write(1, 1, BLOCK)) == conflict

        report = await c.resv_report(1)
        assert (report.rtype, report.regctl, len(report.registrants)) == (rtype, 2, 2)
        assert report.gen == 2                  # two registrations; an acquire does not count
        assert by_host(report, a) is True
        assert by_host(report, b) is rtype.all_registrants   # types 5 and 6: every registrant holds it
        assert by_host(report, c) is None
        assert {r.rkey for r in report.registrants} == {KEYS["a"], KEYS["b"]}

        # another type while A holds one is a conflict; so is an acquire by an unregistered host
        other = ReservationType.EXCLUSIVE_ACCESS if rtype != ReservationType.EXCLUSIVE_ACCESS else \
            ReservationType.WRITE_EXCLUSIVE
        assert await status_of(b.resv_acquire(1, crkey=KEYS["b"], rtype=other)) == conflict
        assert await status_of(c.resv_acquire(1, crkey=KEYS["c"], rtype=rtype)) == conflict

        await a.resv_release(1, crkey=KEYS["a"], rtype=rtype)
        after = await a.resv_report(1)
        assert after.rtype == 0 and after.regctl == 2 and not any(r.holds for r in after.registrants)
        await c.write(1, 1, BLOCK)              # no reservation: everyone has access again
        assert await c.read(1, 1, 1) == BLOCK


async def test_preempt_release_and_clear_with_notifications():
    async with hosts("a", "b") as (_, h):
        a, b = h["a"], h["b"]
        await a.resv_register(1, nrkey=KEYS["a"])
        await b.resv_register(1, nrkey=KEYS["b"])
        await a.resv_acquire(1, crkey=KEYS["a"], rtype=ReservationType.WRITE_EXCLUSIVE)
        gen = (await b.resv_report(1)).gen

        # B takes the reservation from A: A's registration goes, and A's controller is told (log 80h, read by
        # the host on the event)
        await b.resv_acquire(1, crkey=KEYS["b"], prkey=KEYS["a"], rtype=ReservationType.WRITE_EXCLUSIVE,
                             racqa=AcquireAction.PREEMPT)
        ev = await next_reservation_event(a)
        assert [(p.type, p.nsid) for p in ev.reservations] == [(NotificationType.REGISTRATION_PREEMPTED, 1)]
        assert ev.reservations[0].count >= 1 and ev.lid == 0x80
        assert (await a.get_reservation_log()).empty   # the event's read took it
        report = await a.resv_report(1)
        assert report.gen == gen + 1 and report.regctl == 1
        assert (by_host(report, a), by_host(report, b)) == (None, True)
        assert await status_of(a.write(1, 0, BLOCK)) == Status.RESERVATION_CONFLICT
        assert await a.read(1, 0, 1) is not None          # write exclusive: reads stay open

        # A registers again; B's Release of a type-1 reservation tells no one (only types 3-6 notify)
        await a.resv_register(1, nrkey=KEYS["a"])
        await b.resv_release(1, crkey=KEYS["b"], rtype=ReservationType.WRITE_EXCLUSIVE)
        assert (await b.resv_report(1)).rtype == 0
        await a.write(1, 0, BLOCK)

        # Clear: every registration and the reservation go, the other registrants are told
        await b.resv_acquire(1, crkey=KEYS["b"], rtype=ReservationType.WRITE_EXCLUSIVE_REG_ONLY)
        gen = (await b.resv_report(1)).gen
        await b.resv_release(1, crkey=KEYS["b"], rrela=ReleaseAction.CLEAR)
        ev = await next_reservation_event(a)
        assert [p.type for p in ev.reservations] == [NotificationType.RESERVATION_PREEMPTED]
        cleared = await a.resv_report(1)
        assert (cleared.rtype, cleared.regctl, cleared.registrants, cleared.gen) == (0, 0, (), gen + 1)


async def test_register_replace_unregister_and_wrong_keys():
    async with hosts("a") as (_, h):
        a = h["a"]
        conflict = Status.RESERVATION_CONFLICT
        await a.resv_register(1, nrkey=5)
        await a.resv_register(1, nrkey=5)      # the same key again is no change
        assert await status_of(a.resv_register(1, nrkey=6)) == conflict   # a different one needs Replace
        assert await status_of(a.resv_register(1, crkey=4, nrkey=6, rrega=RegisterAction.REPLACE)) == conflict
        await a.resv_register(1, crkey=5, nrkey=6, rrega=RegisterAction.REPLACE)
        await a.resv_register(1, crkey=999, nrkey=7, rrega=RegisterAction.REPLACE, iekey=True)
        report = await a.resv_report(1)
        assert [(r.rkey, r.holds) for r in report.registrants] == [(7, False)]
        assert await status_of(a.resv_acquire(1, crkey=6, rtype=ReservationType.WRITE_EXCLUSIVE)) == conflict
        # IEKEY reaches the target on Acquire and Release too, where NVMe 1.3+ makes it an invalid field
        assert await status_of(a.resv_acquire(1, crkey=7, rtype=1, iekey=True)) == Status.INVALID_FIELD
        assert await status_of(a.resv_release(1, crkey=7, rtype=1, iekey=True)) == Status.INVALID_FIELD
        assert await status_of(a.resv_register(1, crkey=6, rrega=RegisterAction.UNREGISTER)) == conflict
        await a.resv_register(1, crkey=7, rrega=RegisterAction.UNREGISTER)
        assert (await a.resv_report(1)).regctl == 0
        with pytest.raises(NvmeError) as info:
            await a.resv_release(1, crkey=7, rtype=ReservationType.WRITE_EXCLUSIVE)
        assert info.value.status == conflict      # a host that is not registered cannot release
        with pytest.raises(ValueError, match="NSID 0 is outside"):
            await a.resv_report(0)



async def test_reconnecting_controller_forwards_the_reservation_methods():
    async with hosts() as (tgt, _):
        async with await initiator.connect("loop", 0, NQN, transport="loop", target=tgt, reconnect=True,
                                           **host_identity("r")) as r:
            await r.resv_register(1, nrkey=3)
            await r.resv_acquire(1, crkey=3, rtype=ReservationType.EXCLUSIVE_ACCESS_REG_ONLY)
            report = await r.resv_report(1)
            assert [(x.rkey, x.holds) for x in report.registrants] == [(3, True)]
            assert (await r.get_reservation_log()).empty


async def test_report_sizes_and_the_regular_structure():
    async with hosts("a", "b", "c") as (_, h):
        for name in "abc":
            await h[name].resv_register(1, nrkey=KEYS[name])
        a = h["a"]
        full = await a.resv_report(1, size=None)    # the header first, then room for all three
        assert full.regctl == 3 and len(full.registrants) == 3
        assert {r.hostid for r in full.registrants} == {c.hostid.bytes for c in h.values()}
        cut = await a.resv_report(1, size=64 + 64)   # the extended header and one entry
        assert cut.regctl == 3 and len(cut.registrants) == 1
        raw = await a.resv_report_raw(1, size=4096)
        assert len(raw) == 4096 and raw[5:7] == (3).to_bytes(2, "little")   # REGCTL
        # our target's controllers use 128-bit host IDs (CTRATT bit 0): the 8-byte form is refused
        assert a.identity.ctratt & 1
        assert await status_of(a.resv_report(1, eds=False)) == Status.HOST_ID_INCONSIST


# ---- the blocking wrapper and multipath: same names, over TCP --------------------------------------------

def test_sync_wrapper_has_the_reservation_methods():
    port = free_ports(1)[0]

    async def start() -> Target:
        tgt = Target()
        svc = TargetService(tgt)
        await svc.add_subsystem(NQN)
        await svc.add_namespace(NQN, backend="ram", size=1 << 20, block_size=BS, nsid=1)
        await svc.add_listener("tcp", "127.0.0.1", port)
        return tgt

    tgt = sync.run(start())
    try:
        with sync.connect("127.0.0.1", port, NQN, **host_identity("a")) as a, \
                sync.connect("127.0.0.1", port, NQN, **host_identity("b")) as b:
            a.resv_register(1, nrkey=1)
            a.resv_acquire(1, crkey=1, rtype=ReservationType.EXCLUSIVE_ACCESS)
            with pytest.raises(NvmeError) as info:
                b.read(1, 0, 1)
            assert info.value.status == Status.RESERVATION_CONFLICT
            report = b.resv_report(1)
            assert report.rtype == ReservationType.EXCLUSIVE_ACCESS and report.regctl == 1
            assert b.get_reservation_log().empty
            a.resv_release(1, crkey=1, rtype=ReservationType.EXCLUSIVE_ACCESS)
            assert b.read(1, 0, 1) == bytes(BS)
    finally:
        sync.run(tgt.close())


async def test_multipath_carries_reservations_on_a_usable_path():
    tgt = Target()
    svc = TargetService(tgt)
    try:
        await svc.add_subsystem(NQN, allow_any_host=True)
        await svc.add_namespace(NQN, backend="ram", size=1 << 20, block_size=BS, nsid=1)
        ports = free_ports(2)
        listeners = [await svc.add_listener("tcp", "127.0.0.1", p) for p in ports]
        ident = host_identity("mp")
        async with initiator.connect_multipath([("127.0.0.1", p) for p in ports], NQN, no_path_timeout=DEADLINE,
                                               **ident) as mp:
            # path 0 inaccessible: the commands must go by path 1
            await svc.set_ana_state(listeners[0].id, 1, "inaccessible")
            before = [p.ios for p in mp.paths()]
            await mp.resv_register(1, nrkey=0x77)
            await mp.resv_acquire(1, crkey=0x77, rtype=ReservationType.WRITE_EXCLUSIVE)
            report = await mp.resv_report(1)
            after = [p.ios for p in mp.paths()]
            assert after[0] == before[0] and after[1] == before[1] + 3
            # one registrant: the host, whichever controller it came through
            assert [(r.hostid, r.holds, r.rkey) for r in report.registrants] == [(ident["hostid"].bytes, True, 0x77)]
            await mp.write(1, 0, BLOCK)       # the holder writes through the other path as well
            await mp.resv_release(1, crkey=0x77, rtype=ReservationType.WRITE_EXCLUSIVE)
            await mp.resv_register(1, crkey=0x77, rrega=RegisterAction.UNREGISTER)
            assert (await mp.resv_report(1)).regctl == 0
    finally:
        await tgt.close()


# ---- the command line against `nvmeof serve` -------------------------------------------------------------

def nvmeof(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nvmeof.cli", *args], capture_output=True, text=True, timeout=60,
                          cwd=_REPO, check=False)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with serve_target(tmp_path_factory.mktemp("serve"), size="4M") as t:
        yield t
        t.assert_no_errors()


def test_cli_register_acquire_report_release(served):
    def conn(name: str) -> list[str]:
        ident = host_identity(name)
        return ["-a", served.traddr, "-s", str(served.io_port), "-n", served.subnqn, "-q", str(ident["hostnqn"]),
                "-I", str(ident["hostid"])]

    def ok(*args: str) -> str:
        proc = nvmeof(*args)
        assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
        return proc.stdout

    try:
        assert ok("resv-register", *conn("a"), "--namespace-id", "1", "--nrkey", "0xabc") == \
            "NVME Reservation Register success\n"
        ok("resv-register", *conn("b"), "--nsid", "1", "-k", "4096")
        out = json.loads(ok("resv-acquire", *conn("a"), "-c", "2748", "--rtype", "exclusive-access", "-o", "json"))
        assert out == {"nsid": 1, "rtype": 2, "racqa": 0, "result": "success"}

        report = json.loads(ok("resv-report", *conn("b"), "-o", "json"))
        assert list(report) == ["gen", "rtype", "regctl", "ptpls", "regctlext"]   # CTRATT: 128-bit host IDs
        assert (report["rtype"], report["regctl"], report["gen"]) == (2, 2, 2)
        rows = {r["hostid"]: r for r in report["regctlext"]}
        assert rows[host_identity("a")["hostid"].hex]["rcsts"] == 1
        assert rows[host_identity("a")["hostid"].hex]["rkey"] == 0xABC
        assert rows[host_identity("b")["hostid"].hex] | {"cntlid": 0} == \
            {"cntlid": 0, "rcsts": 0, "rkey": 4096, "hostid": host_identity("b")["hostid"].hex}

        text = ok("resv-report", *conn("b"), "--numd", str(64 // 4 + 64 // 4 - 1)).splitlines()
        assert text[:7] == ["", "NVME Reservation status:", "", "gen       : 2", "rtype     : 2", "regctl    : 2",
                            "ptpls     : 0"]
        assert text[7] == "regctlext[0] :" and len([t for t in text if t.startswith("regctlext[")]) == 1
        raw = subprocess.run([sys.executable, "-m", "nvmeof.cli", "resv-report", *conn("b"), "-b"],
                             capture_output=True, timeout=60, cwd=_REPO, check=True).stdout
        assert len(raw) == 64 + 2 * 64 and raw[4] == 2

        # B may not read under A's exclusive access: exit 1 with the status named
        denied = nvmeof("read", *conn("b"), "--nsid", "1")
        assert denied.returncode == 1 and "RESERVATION_CONFLICT" in denied.stderr
        taken = nvmeof("resv-acquire", *conn("b"), "-c", "4096", "--rtype", "1")
        assert taken.returncode == 1 and "RESERVATION_CONFLICT" in taken.stderr

        assert ok("resv-release", *conn("a"), "-c", "0xabc", "--rtype", "2") == "NVME Reservation Release success\n"
        ok("read", *conn("b"), "--nsid", "1")
    finally:
        nvmeof("resv-release", *conn("a"), "-c", "0xabc", "--rrela", "clear")
